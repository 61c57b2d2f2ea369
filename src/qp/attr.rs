//! Attributes of each QP state transition, and what `query()` reports.
//!
//! Each transition struct holds exactly the attributes the kernel requires
//! for that step of an RC QP (the constructor takes them), with the optional
//! ones as builder methods. Defaults follow `ibv_rc_pingpong` and perftest.

use std::fmt;

use crate::device::{Gid, Mtu};
use crate::error::Error;
use crate::ffi;
use crate::mr::AccessFlags;
use crate::sys::c_enum;

c_enum! {
    /// A QP state as the kernel reports it (`ibv_qp_state`).
    pub enum QpStateKind: u32 {
        /// Reset.
        Reset = ffi::IBV_QPS_RESET => "RESET",
        /// Initialised.
        Init = ffi::IBV_QPS_INIT => "INIT",
        /// Ready to receive.
        Rtr = ffi::IBV_QPS_RTR => "RTR",
        /// Ready to send.
        Rts = ffi::IBV_QPS_RTS => "RTS",
        /// Send queue drained.
        Sqd = ffi::IBV_QPS_SQD => "SQD",
        /// Send queue error.
        Sqe = ffi::IBV_QPS_SQE => "SQE",
        /// Error.
        Err = ffi::IBV_QPS_ERR => "ERR",
    }
}

/// What identifies one side of an RC connection: exchanged out of band.
///
/// A UD (or UC) QP is named the same way ([`Qp::endpoint`](crate::Qp::endpoint)
/// works on every transport, and [`crate::exchange`] carries it): a UD peer
/// needs `qpn` and `gid` (`lid` on InfiniBand) for its address handle and
/// sends; `psn` is its own send PSN. The Q_Key is not in it: both sides agree
/// on one ([`UdInitAttr::new`](crate::qp::UdInitAttr::new)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Endpoint {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// QP number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Port GID (all zero on InfiniBand without GRH).
    pub gid: Gid,
}

/// RESET → INIT (RC): port, P_Key index, remote access rights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitAttr {
    pub(crate) port: u8,
    pub(crate) pkey_index: u16,
    pub(crate) access: AccessFlags,
}

impl InitAttr {
    /// Port `port`, P_Key index 0, and the remote rights peers get on this QP
    /// (`REMOTE_WRITE`, `REMOTE_READ`, `REMOTE_ATOMIC`; `LOCAL_WRITE` is implied).
    pub fn new(port: u8, access: AccessFlags) -> InitAttr {
        InitAttr {
            port,
            pkey_index: 0,
            access,
        }
    }

    /// P_Key table index (default 0).
    pub fn pkey_index(mut self, index: u16) -> InitAttr {
        self.pkey_index = index;
        self
    }

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_INIT,
            pkey_index: self.pkey_index,
            port_num: self.port,
            qp_access_flags: self.access.bits(),
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        (
            attr,
            (M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS).0,
        )
    }
}

/// INIT → RTR (RC): path MTU, the remote QPN and PSN, responder resources,
/// RNR timer and the address vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrAttr {
    pub(crate) path_mtu: Mtu,
    pub(crate) dest_qpn: u32,
    pub(crate) rq_psn: u32,
    pub(crate) max_dest_rd_atomic: u8,
    pub(crate) min_rnr_timer: u8,
    pub(crate) av: AddressVector,
}

/// Where packets go (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// Destination LID (InfiniBand; 0 on RoCE).
    pub dlid: u16,
    /// Service level (4 bits).
    pub sl: u8,
    /// Source path bits (7 bits).
    pub src_path_bits: u8,
    /// Local port.
    pub port: u8,
    /// Global routing header: `Some` on RoCE (always) and routed InfiniBand.
    pub grh: Option<Grh>,
}

/// Global route (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grh {
    /// Destination GID.
    pub dgid: Gid,
    /// Index of the local GID to send from.
    pub sgid_index: u8,
    /// Hop limit (1 like `ibv_rc_pingpong`; raise it for routed RoCE v2).
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
}

impl AddressVector {
    /// Towards `dgid` (RoCE, or routed InfiniBand) from the local GID at
    /// `sgid_index` of `port`: hop limit 1 (like the rdma-core examples),
    /// traffic class, flow label and SL 0.
    pub fn global(port: u8, dgid: Gid, sgid_index: u8) -> AddressVector {
        AddressVector {
            dlid: 0,
            sl: 0,
            src_path_bits: 0,
            port,
            grh: Some(Grh {
                dgid,
                sgid_index,
                hop_limit: 1,
                traffic_class: 0,
                flow_label: 0,
            }),
        }
    }

    /// A field wider than its wire field, refused (some providers truncate
    /// it silently instead).
    pub(crate) fn check_widths(&self) -> Option<Error> {
        super::check_bits("SL", self.sl.into(), 4)
            .or_else(|| super::check_bits("source path bits", self.src_path_bits.into(), 7))
            .or_else(|| {
                let g = self.grh.as_ref()?;
                super::check_bits("flow label", g.flow_label, 20)
            })
    }

    /// Towards `dlid` within an InfiniBand subnet (no GRH; RoCE refuses this).
    pub fn local(port: u8, dlid: u16) -> AddressVector {
        AddressVector {
            dlid,
            sl: 0,
            src_path_bits: 0,
            port,
            grh: None,
        }
    }

    /// Service level.
    pub fn sl(mut self, sl: u8) -> AddressVector {
        self.sl = sl;
        self
    }

    /// Hop limit of the GRH (no effect without one).
    pub fn hop_limit(mut self, hops: u8) -> AddressVector {
        if let Some(g) = self.grh.as_mut() {
            g.hop_limit = hops;
        }
        self
    }

    /// Traffic class of the GRH (no effect without one).
    pub fn traffic_class(mut self, tclass: u8) -> AddressVector {
        if let Some(g) = self.grh.as_mut() {
            g.traffic_class = tclass;
        }
        self
    }

    pub(crate) fn to_ffi(self) -> ffi::ibv_ah_attr {
        let mut ah = ffi::ibv_ah_attr {
            dlid: self.dlid,
            sl: self.sl,
            src_path_bits: self.src_path_bits,
            port_num: self.port,
            ..Default::default()
        };
        if let Some(g) = self.grh {
            ah.is_global = 1;
            ah.grh = ffi::ibv_global_route {
                dgid: g.dgid.to_ffi(),
                flow_label: g.flow_label,
                sgid_index: g.sgid_index,
                hop_limit: g.hop_limit,
                traffic_class: g.traffic_class,
            };
        }
        ah
    }

    pub(crate) fn from_ffi(ah: &ffi::ibv_ah_attr) -> AddressVector {
        AddressVector {
            dlid: ah.dlid,
            sl: ah.sl,
            src_path_bits: ah.src_path_bits,
            port: ah.port_num,
            grh: (ah.is_global != 0).then(|| Grh {
                dgid: Gid::from_ffi(&ah.grh.dgid),
                sgid_index: ah.grh.sgid_index,
                hop_limit: ah.grh.hop_limit,
                traffic_class: ah.grh.traffic_class,
                flow_label: ah.grh.flow_label,
            }),
        }
    }
}

impl RtrAttr {
    /// Connects to `remote` over `port` with `path_mtu` (use the port's
    /// `active_mtu`). A GRH is added when `sgid_index` is `Some` (RoCE needs
    /// it; `ibv_rc_pingpong -g`). Defaults: max_dest_rd_atomic 1,
    /// min_rnr_timer 12 (0.64 ms), SL 0, hop limit 1.
    pub fn new(remote: &Endpoint, port: u8, path_mtu: Mtu, sgid_index: Option<u8>) -> RtrAttr {
        RtrAttr {
            path_mtu,
            dest_qpn: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            av: AddressVector {
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                port,
                grh: sgid_index.map(|i| Grh {
                    dgid: remote.gid,
                    sgid_index: i,
                    hop_limit: 1,
                    traffic_class: 0,
                    flow_label: 0,
                }),
            },
        }
    }

    /// Outstanding RDMA READs/atomics this side accepts as responder.
    pub fn max_dest_rd_atomic(mut self, n: u8) -> RtrAttr {
        self.max_dest_rd_atomic = n;
        self
    }

    /// RNR NAK timer code (0..=31; 12 = 0.64 ms).
    pub fn min_rnr_timer(mut self, code: u8) -> RtrAttr {
        self.min_rnr_timer = code;
        self
    }

    /// Service level.
    pub fn sl(mut self, sl: u8) -> RtrAttr {
        self.av.sl = sl;
        self
    }

    /// Hop limit of the GRH (no effect without one).
    pub fn hop_limit(mut self, hops: u8) -> RtrAttr {
        if let Some(g) = self.av.grh.as_mut() {
            g.hop_limit = hops;
        }
        self
    }

    /// Traffic class of the GRH (no effect without one).
    pub fn traffic_class(mut self, tclass: u8) -> RtrAttr {
        if let Some(g) = self.av.grh.as_mut() {
            g.traffic_class = tclass;
        }
        self
    }

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let ah = self.av.to_ffi();
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTR,
            path_mtu: self.path_mtu.as_raw(),
            dest_qp_num: self.dest_qpn,
            rq_psn: self.rq_psn,
            max_dest_rd_atomic: self.max_dest_rd_atomic,
            min_rnr_timer: self.min_rnr_timer,
            ah_attr: ah,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_AV
            | M::IBV_QP_PATH_MTU
            | M::IBV_QP_DEST_QPN
            | M::IBV_QP_RQ_PSN
            | M::IBV_QP_MAX_DEST_RD_ATOMIC
            | M::IBV_QP_MIN_RNR_TIMER;
        (attr, mask.0)
    }
}

/// RTR → RTS (RC): send PSN, ACK timeout, retry counts, initiator depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsAttr {
    pub(crate) sq_psn: u32,
    pub(crate) timeout: u8,
    pub(crate) retry_cnt: u8,
    pub(crate) rnr_retry: u8,
    pub(crate) max_rd_atomic: u8,
}

impl RtsAttr {
    /// Starts sending at `sq_psn` (this side's [`Endpoint::psn`]). Defaults:
    /// timeout 14 (~67 ms), retry_cnt 6, rnr_retry 7 (infinite), max_rd_atomic 1.
    ///
    /// With these, a peer that is gone (destroyed QP, dead host, cut link) is
    /// reported as `RETRY_EXC_ERR` after `retry_cnt + 1` ACK timeouts: about
    /// 7 × 67 ms ≈ 0.5 s (the IB spec lets a device stretch each timeout up to
    /// 4×, so at most ~1.9 s). `retry_cnt` 7 is *not* used by default: some
    /// providers (rxe among them) treat it as "retry forever", so a dead peer
    /// would never be reported. `ibv_rc_pingpong` uses 7.
    pub fn new(sq_psn: u32) -> RtsAttr {
        RtsAttr {
            sq_psn,
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }

    /// Local ACK timeout code: 4.096 µs × 2^timeout (0 = infinite).
    pub fn timeout(mut self, code: u8) -> RtsAttr {
        self.timeout = code;
        self
    }

    /// Transport retries before RETRY_EXC_ERR (0..=7; 7 means "forever" on
    /// some providers, rxe included).
    pub fn retry_cnt(mut self, n: u8) -> RtsAttr {
        self.retry_cnt = n;
        self
    }

    /// RNR retries before RNR_RETRY_EXC_ERR (0..=6; 7 = infinite).
    pub fn rnr_retry(mut self, n: u8) -> RtsAttr {
        self.rnr_retry = n;
        self
    }

    /// Outstanding RDMA READs/atomics this side issues.
    pub fn max_rd_atomic(mut self, n: u8) -> RtsAttr {
        self.max_rd_atomic = n;
        self
    }

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTS,
            sq_psn: self.sq_psn,
            timeout: self.timeout,
            retry_cnt: self.retry_cnt,
            rnr_retry: self.rnr_retry,
            max_rd_atomic: self.max_rd_atomic,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        let mask = M::IBV_QP_STATE
            | M::IBV_QP_SQ_PSN
            | M::IBV_QP_TIMEOUT
            | M::IBV_QP_RETRY_CNT
            | M::IBV_QP_RNR_RETRY
            | M::IBV_QP_MAX_QP_RD_ATOMIC;
        (attr, mask.0)
    }
}

/// RESET → INIT (UD): port, P_Key index and the Q_Key. UD has no remote
/// access rights to grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdInitAttr {
    pub(crate) port: u8,
    pub(crate) pkey_index: u16,
    pub(crate) qkey: u32,
}

impl UdInitAttr {
    /// Port `port`, P_Key index 0, receiving datagrams sent with `qkey`
    /// (`ibv_ud_pingpong` uses 0x11111111).
    pub fn new(port: u8, qkey: u32) -> UdInitAttr {
        UdInitAttr {
            port,
            pkey_index: 0,
            qkey,
        }
    }

    /// P_Key table index (default 0).
    pub fn pkey_index(mut self, index: u16) -> UdInitAttr {
        self.pkey_index = index;
        self
    }

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_INIT,
            pkey_index: self.pkey_index,
            port_num: self.port,
            qkey: self.qkey,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        (
            attr,
            (M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_QKEY).0,
        )
    }
}

/// RESET → INIT (UC): port, P_Key index, and whether the peer may RDMA
/// WRITE into this side (UC has no RDMA READ or atomics to grant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UcInitAttr {
    pub(crate) port: u8,
    pub(crate) pkey_index: u16,
    pub(crate) remote_write: bool,
}

impl UcInitAttr {
    /// Port `port`, P_Key index 0, no remote access (SENDs only, like
    /// `ibv_uc_pingpong`).
    pub fn new(port: u8) -> UcInitAttr {
        UcInitAttr {
            port,
            pkey_index: 0,
            remote_write: false,
        }
    }

    /// Lets the peer RDMA WRITE into this side's `REMOTE_WRITE` regions.
    pub fn remote_write(mut self) -> UcInitAttr {
        self.remote_write = true;
        self
    }

    /// P_Key table index (default 0).
    pub fn pkey_index(mut self, index: u16) -> UcInitAttr {
        self.pkey_index = index;
        self
    }

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let access = if self.remote_write {
            AccessFlags::REMOTE_WRITE
        } else {
            AccessFlags::empty()
        };
        InitAttr {
            port: self.port,
            pkey_index: self.pkey_index,
            access,
        }
        .to_ffi()
    }
}

/// INIT → RTR (UC): path MTU, the remote QPN and PSN, and the address
/// vector. Unlike RC there are no responder resources (no READ/atomics) and
/// no RNR timer (nothing is acknowledged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UcRtrAttr {
    pub(crate) rc: RtrAttr,
}

impl UcRtrAttr {
    /// Connects to `remote` over `port` with `path_mtu`; a GRH from
    /// `sgid_index` when `Some` (RoCE needs it), as [`RtrAttr::new`].
    pub fn new(remote: &Endpoint, port: u8, path_mtu: Mtu, sgid_index: Option<u8>) -> UcRtrAttr {
        UcRtrAttr {
            rc: RtrAttr::new(remote, port, path_mtu, sgid_index),
        }
    }

    /// Service level.
    pub fn sl(self, sl: u8) -> UcRtrAttr {
        UcRtrAttr { rc: self.rc.sl(sl) }
    }

    /// Hop limit of the GRH (no effect without one).
    pub fn hop_limit(self, hops: u8) -> UcRtrAttr {
        UcRtrAttr {
            rc: self.rc.hop_limit(hops),
        }
    }

    /// Traffic class of the GRH (no effect without one).
    pub fn traffic_class(self, tclass: u8) -> UcRtrAttr {
        UcRtrAttr {
            rc: self.rc.traffic_class(tclass),
        }
    }

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let (attr, mask) = self.rc.to_ffi();
        use ffi::ibv_qp_attr_mask as M;
        (
            attr,
            mask & !(M::IBV_QP_MAX_DEST_RD_ATOMIC | M::IBV_QP_MIN_RNR_TIMER).0,
        )
    }
}

/// RTR → RTS for UC and UD: the send PSN only (nothing is acknowledged, so
/// there are no timeouts or retries).
pub(crate) fn sq_psn_only(sq_psn: u32) -> (ffi::ibv_qp_attr, u32) {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::IBV_QPS_RTS,
        sq_psn,
        ..Default::default()
    };
    use ffi::ibv_qp_attr_mask as M;
    (attr, (M::IBV_QP_STATE | M::IBV_QP_SQ_PSN).0)
}

/// Queue sizes asked for at creation; the device may round them up (read the
/// result with [`Qp::caps`](crate::qp::Qp::caps)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send WR (at least 1 is asked for, whatever this says).
    pub max_send_sge: u32,
    /// SGEs per receive WR.
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
        QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
            sq_sig_all: self.sq_sig_all,
        }
    }
}

/// Every attribute of a QP (`ibv_query_qp`). The `Debug` print lists them all,
/// which is what to look at when a handshake fails.
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
            cap: QpCaps {
                max_send_wr: a.cap.max_send_wr,
                max_recv_wr: a.cap.max_recv_wr,
                max_send_sge: a.cap.max_send_sge,
                max_recv_sge: a.cap.max_recv_sge,
                max_inline_data: a.cap.max_inline_data,
                sq_sig_all: init.sq_sig_all != 0,
            },
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

/// Names of the bits in an `ibv_qp_attr_mask`, for error messages.
pub(crate) fn mask_names(mask: u32) -> String {
    const NAMES: [&str; 21] = [
        "STATE",
        "CUR_STATE",
        "EN_SQD_ASYNC_NOTIFY",
        "ACCESS_FLAGS",
        "PKEY_INDEX",
        "PORT",
        "QKEY",
        "AV",
        "PATH_MTU",
        "TIMEOUT",
        "RETRY_CNT",
        "RNR_RETRY",
        "RQ_PSN",
        "MAX_QP_RD_ATOMIC",
        "ALT_PATH",
        "MIN_RNR_TIMER",
        "SQ_PSN",
        "MAX_DEST_RD_ATOMIC",
        "PATH_MIG_STATE",
        "CAP",
        "DEST_QPN",
    ];
    let names: Vec<&str> = (0..NAMES.len())
        .filter(|b| mask & (1 << b) != 0)
        .map(|b| NAMES[b])
        .collect();
    names.join("|")
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
            self.lid, self.qpn, self.psn, self.gid
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtr_attr_mask_and_grh() {
        let remote = Endpoint {
            lid: 0,
            qpn: 0x11,
            psn: 0x22,
            gid: "::ffff:10.99.0.1".parse().unwrap(),
        };
        let (a, mask) = RtrAttr::new(&remote, 1, Mtu::Mtu1024, Some(1)).to_ffi();
        assert_eq!(
            mask_names(mask),
            "STATE|AV|PATH_MTU|RQ_PSN|MIN_RNR_TIMER|MAX_DEST_RD_ATOMIC|DEST_QPN"
        );
        assert_eq!(a.ah_attr.is_global, 1);
        assert_eq!(a.ah_attr.grh.sgid_index, 1);
        assert_eq!(a.dest_qp_num, 0x11);
        assert_eq!(a.rq_psn, 0x22);
        let (a, _) = RtrAttr::new(&remote, 1, Mtu::Mtu1024, None).to_ffi();
        assert_eq!(a.ah_attr.is_global, 0);
    }

    #[test]
    fn uc_and_ud_masks_are_what_the_kernel_requires() {
        // ibv_modify_qp(3), "required attributes" per transport.
        let remote = Endpoint {
            lid: 0,
            qpn: 0x11,
            psn: 0x22,
            gid: "::ffff:10.99.0.1".parse().unwrap(),
        };
        let (a, mask) = UcRtrAttr::new(&remote, 1, Mtu::Mtu1024, Some(1)).to_ffi();
        assert_eq!(mask_names(mask), "STATE|AV|PATH_MTU|RQ_PSN|DEST_QPN");
        assert_eq!(
            (a.dest_qp_num, a.rq_psn, a.ah_attr.is_global),
            (0x11, 0x22, 1)
        );
        let (a, mask) = UcInitAttr::new(1).remote_write().to_ffi();
        assert_eq!(mask_names(mask), "STATE|ACCESS_FLAGS|PKEY_INDEX|PORT");
        assert_eq!(a.qp_access_flags, AccessFlags::REMOTE_WRITE.bits());
        assert_eq!(UcInitAttr::new(1).to_ffi().0.qp_access_flags, 0);
        let (a, mask) = UdInitAttr::new(2, 0x1111_1111).pkey_index(3).to_ffi();
        assert_eq!(mask_names(mask), "STATE|PKEY_INDEX|PORT|QKEY");
        assert_eq!((a.qkey, a.port_num, a.pkey_index), (0x1111_1111, 2, 3));
        let (a, mask) = sq_psn_only(7);
        assert_eq!(mask_names(mask), "STATE|SQ_PSN");
        assert_eq!(a.sq_psn, 7);
    }

    #[test]
    fn rts_defaults_are_rc_pingpongs_but_a_bounded_retry_cnt() {
        // ibv_rc_pingpong uses retry_cnt 7, which rxe treats as "forever": 6
        // reports a dead peer (see RtsAttr::new).
        let (a, mask) = RtsAttr::new(5).to_ffi();
        assert_eq!(
            (
                a.timeout,
                a.retry_cnt,
                a.rnr_retry,
                a.max_rd_atomic,
                a.sq_psn
            ),
            (14, 6, 7, 1, 5)
        );
        assert_eq!(
            mask_names(mask),
            "STATE|TIMEOUT|RETRY_CNT|RNR_RETRY|MAX_QP_RD_ATOMIC|SQ_PSN"
        );
    }
}
