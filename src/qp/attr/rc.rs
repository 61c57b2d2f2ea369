//! The RC transitions: RESET → INIT → RTR → RTS.

use super::Endpoint;
use super::av::{AddressVector, Grh, path_setters};
use crate::device::Mtu;
use crate::ffi;
use crate::mr::AccessFlags;

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
                grh: sgid_index.map(|i| Grh::towards(remote.gid, i)),
            },
        }
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

setters!(InitAttr {
    /// P_Key table index (default 0).
    pkey_index: u16,
});

setters!(RtrAttr {
    /// Outstanding RDMA READs/atomics this side accepts as responder.
    max_dest_rd_atomic: u8,
    /// RNR NAK timer code (0..=31; 12 = 0.64 ms).
    min_rnr_timer: u8,
});

path_setters!(RtrAttr, av);

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
    ///
    /// rxe in Linux 6.1 (not 6.12) also ends a wait for a receiver that has no
    /// receive posted after those `retry_cnt + 1` ACK timeouts, as `RETRY_EXC_ERR`,
    /// although `rnr_retry` 7 means "wait forever": where receives may be posted
    /// more than ~0.5 s late, raise `timeout` (docs/providers.md).
    pub fn new(sq_psn: u32) -> RtsAttr {
        RtsAttr {
            sq_psn,
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
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

setters!(RtsAttr {
    /// Local ACK timeout code: 4.096 µs × 2^timeout (0 = infinite: a request
    /// to a peer that is gone then never completes; polls with a timeout, a
    /// scope's drain and dropping the QP still end).
    timeout: u8,
    /// Transport retries before RETRY_EXC_ERR (0..=7; 7 means "forever" on
    /// some providers, rxe included).
    retry_cnt: u8,
    /// RNR retries before RNR_RETRY_EXC_ERR (0..=6; 7 = infinite).
    rnr_retry: u8,
    /// Outstanding RDMA READs/atomics this side issues.
    max_rd_atomic: u8,
});
