//! Attributes of each QP state transition, and what `query()` reports.
//!
//! Each transition struct holds exactly the attributes the kernel requires
//! for that step of an RC QP (the constructor takes them), with the optional
//! ones as builder methods. Defaults follow `ibv_rc_pingpong` and perftest.
//! The RC steps are [`InitAttr`], [`RtrAttr`] and [`RtsAttr`]; UC and UD have
//! their own; [`AddressVector`] says where packets go; [`QpCaps`] and
//! [`QpAttr`] hold the queue sizes and what a query reports.

use std::fmt;

use crate::device::Gid;
use crate::ffi;
use crate::sys::c_enum;

/// Builder methods that set one field each, documented field by field.
macro_rules! setters {
    ($ty:ident { $( $(#[$doc:meta])* $field:ident: $t:ty, )* }) => {
        impl $ty {
            $(
                $(#[$doc])*
                pub fn $field(mut self, $field: $t) -> $ty {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}

mod av;
mod caps;
mod rc;
mod uc_ud;

pub use av::{AddressVector, Grh};
pub use caps::{QpAttr, QpCaps};
pub use rc::{InitAttr, RtrAttr, RtsAttr};
pub(crate) use uc_ud::sq_psn_only;
pub use uc_ud::{UcInitAttr, UcRtrAttr, UdInitAttr};

c_enum! {
    /// A QP state as the kernel reports it (`ibv_qp_state`).
    #[doc(alias = "ibv_qp_state")]
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
/// A UD (or UC) QP is named the same way ([`Qp::endpoint`](crate::qp::Qp::endpoint)
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
    use crate::device::Mtu;
    use crate::mr::AccessFlags;

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
