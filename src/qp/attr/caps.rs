//! Queue sizes at creation ([`QpCaps`]) and every attribute `query()`
//! reports ([`QpAttr`]).

use super::QpStateKind;
use super::av::AddressVector;
use crate::device::Mtu;
use crate::ffi;
use crate::mr::AccessFlags;

/// Queue sizes asked for at creation; the device may round them up (read the
/// result with [`Qp::caps`](crate::qp::Qp::caps)).
#[doc(alias = "ibv_qp_cap")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR (at least 1 is asked for, whatever this says). A
    /// request of the ownership-passing path (`SendWr`) carries at most
    /// [`MAX_SAFE_SGES`](crate::qp::MAX_SAFE_SGES) (4) buffers whatever this
    /// allows; more serve `post_send_raw`.
    pub max_send_sge: u32,
    /// SGEs per receive WR; a `RecvWr` carries at most
    /// [`MAX_SAFE_SGES`](crate::qp::MAX_SAFE_SGES) (4) buffers.
    pub max_recv_sge: u32,
    /// Bytes a send may carry inline.
    pub max_inline_data: u32,
    /// Signal every send regardless of its flag.
    pub sq_sig_all: bool,
}

impl Default for QpCaps {
    /// 128 / 128 WRs, 1 SGE each way, no inline, selective signaling.
    fn default() -> QpCaps {
        QpCaps {
            max_send_wr: 128,
            max_recv_wr: 128,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        }
    }
}

impl QpCaps {
    /// The creation attributes for a QP of `qp_type` on these CQs.
    pub(crate) fn init_attr(
        self,
        send_cq: *mut ffi::ibv_cq,
        recv_cq: *mut ffi::ibv_cq,
        qp_type: ffi::ibv_qp_type,
    ) -> ffi::ibv_qp_init_attr {
        ffi::ibv_qp_init_attr {
            send_cq,
            recv_cq,
            cap: ffi::ibv_qp_cap {
                max_send_wr: self.max_send_wr,
                max_recv_wr: self.max_recv_wr,
                // At least one: a scoped send (and a prepared list) on the
                // extended API writes its SGE through ibv_wr_set_sge, which
                // providers do not check against a WQE sized for none.
                max_send_sge: self.max_send_sge.max(1),
                max_recv_sge: self.max_recv_sge,
                max_inline_data: self.max_inline_data,
            },
            qp_type,
            sq_sig_all: i32::from(self.sq_sig_all),
            ..Default::default()
        }
    }

    /// What the device granted (`init.cap` after creation).
    pub(crate) fn granted(self, init: &ffi::ibv_qp_init_attr) -> QpCaps {
        QpCaps::from_ffi(&init.cap, self.sq_sig_all)
    }

    fn from_ffi(cap: &ffi::ibv_qp_cap, sq_sig_all: bool) -> QpCaps {
        QpCaps {
            max_send_wr: cap.max_send_wr,
            max_recv_wr: cap.max_recv_wr,
            max_send_sge: cap.max_send_sge,
            max_recv_sge: cap.max_recv_sge,
            max_inline_data: cap.max_inline_data,
            sq_sig_all,
        }
    }
}

/// Every attribute of a QP (`ibv_query_qp`). The `Debug` print lists them all,
/// which is what to look at when a handshake fails.
#[doc(alias = "ibv_qp_attr")]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpAttr {
    /// Current state.
    pub state: QpStateKind,
    /// Path MTU.
    pub path_mtu: Mtu,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Remote QP number.
    pub dest_qp_num: u32,
    /// Remote access rights.
    pub access: AccessFlags,
    /// Capabilities.
    pub cap: QpCaps,
    /// Address vector.
    pub av: AddressVector,
    /// P_Key index.
    pub pkey_index: u16,
    /// SQ draining.
    pub sq_draining: bool,
    /// Outstanding RDMA READ/atomic as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA READ/atomic as responder.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code.
    pub min_rnr_timer: u8,
    /// Port.
    pub port: u8,
    /// ACK timeout code.
    pub timeout: u8,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// RNR retry count.
    pub rnr_retry: u8,
}

impl QpAttr {
    pub(crate) fn from_ffi(a: &ffi::ibv_qp_attr, init: &ffi::ibv_qp_init_attr) -> QpAttr {
        let ah = &a.ah_attr;
        QpAttr {
            state: QpStateKind::from_raw(a.qp_state),
            path_mtu: Mtu::from_raw(a.path_mtu),
            qkey: a.qkey,
            rq_psn: a.rq_psn,
            sq_psn: a.sq_psn,
            dest_qp_num: a.dest_qp_num,
            access: AccessFlags::from_bits_retain(a.qp_access_flags),
            cap: QpCaps::from_ffi(&a.cap, init.sq_sig_all != 0),
            av: AddressVector::from_ffi(ah),
            pkey_index: a.pkey_index,
            sq_draining: a.sq_draining != 0,
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            port: a.port_num,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
        }
    }
}
