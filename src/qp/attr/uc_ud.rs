//! The UC and UD transitions: fewer attributes than RC (no remote reads or
//! atomics, nothing acknowledged, no remote at UD's RTR).

use super::Endpoint;
use super::av::path_setters;
use super::rc::{InitAttr, RtrAttr};
use crate::device::Mtu;
use crate::ffi;
use crate::mr::AccessFlags;

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

setters!(UdInitAttr {
    /// P_Key table index (default 0).
    pkey_index: u16,
});

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

setters!(UcInitAttr {
    /// P_Key table index (default 0).
    pkey_index: u16,
});

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

    pub(crate) fn to_ffi(self) -> (ffi::ibv_qp_attr, u32) {
        let (attr, mask) = self.rc.to_ffi();
        use ffi::ibv_qp_attr_mask as M;
        (
            attr,
            mask & !(M::IBV_QP_MAX_DEST_RD_ATOMIC | M::IBV_QP_MIN_RNR_TIMER).0,
        )
    }
}

path_setters!(UcRtrAttr, rc);

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
