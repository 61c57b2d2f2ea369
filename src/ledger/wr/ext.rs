//! The extended operations of a send request, ATOMIC_WRITE and FLUSH: what says whether a
//! QP takes them, and their checks before posting.

use super::{SendWr, invalid};
use crate::error::{Error, Result};
use crate::ffi;
use crate::mr::RemoteMr;
use crate::pd::Pd;

/// Where a FLUSH ([`SendWr::flush`]) makes the data written before it land
/// (`enum ibv_placement_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlushPlacement {
    /// The global visibility point: every later reader of the memory, the responder's CPU
    /// included, sees the data (`IBV_FLUSH_GLOBAL`; the target MR needs
    /// [`AccessFlags::FLUSH_GLOBAL`](crate::mr::AccessFlags::FLUSH_GLOBAL)).
    Global,
    /// Persistence: the data survives a power loss (`IBV_FLUSH_PERSISTENT`; the target MR
    /// needs [`AccessFlags::FLUSH_PERSISTENT`](crate::mr::AccessFlags::FLUSH_PERSISTENT),
    /// which rxe grants only on persistent memory).
    Persistent,
}

impl FlushPlacement {
    /// The `ibv_placement_type` bit.
    pub(super) fn bit(self) -> u8 {
        match self {
            FlushPlacement::Global => ffi::IBV_FLUSH_GLOBAL,
            FlushPlacement::Persistent => ffi::IBV_FLUSH_PERSISTENT,
        }
    }
}

/// The extended operations a QP takes, asked only when a request needs them (they
/// decide whether ATOMIC_WRITE and FLUSH are posted or refused).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ExtOps {
    /// The QP takes ATOMIC_WRITE.
    pub(crate) atomic_write: bool,
    /// The FLUSH placement types (`ibv_placement_type` bits) it takes; 0: no FLUSH.
    pub(crate) flush: u8,
}

impl SendWr<'_> {
    /// ATOMIC_WRITE's checks: a QP that takes it, no buffers, an aligned
    /// 8-byte target in range.
    pub(super) fn check_atomic_write(
        &self,
        remote: RemoteMr,
        offset: u64,
        supported: bool,
    ) -> Result<()> {
        if !supported {
            return Err(Error::Unsupported {
                verb: "ibv_wr_atomic_write",
                hint: "ATOMIC_WRITE needs the extended send API (Qp::send_api() == \
                       SendApi::Extended) on a device whose device_cap_flags_ex has \
                       IB_UVERBS_DEVICE_ATOMIC_WRITE (DeviceAttr::atomic_write(): rxe from Linux \
                       6.2); write the 8 bytes with an RDMA WRITE instead"
                    .into(),
            });
        }
        if self.inline_data.is_some() || !self.bufs.is_empty() || self.bufs.overflow() != 0 {
            return Err(invalid(
                "ATOMIC_WRITE",
                "carries its 8 bytes in the request: it takes no buffer or inline data",
            ));
        }
        let addr = remote.checked_addr(offset, 8)?;
        if addr % 8 != 0 {
            return Err(invalid(
                "atomic target",
                &format!("address {addr:#x} is not 8-byte aligned"),
            ));
        }
        Ok(())
    }

    /// FLUSH's checks: a QP that takes `placement`, no buffers, a range (`remote`, `offset`,
    /// `len`) inside the region unless the level is the whole MR.
    pub(super) fn check_flush(
        &self,
        pd: &Pd,
        (remote, offset, len): (RemoteMr, u64, u64),
        placement: u8,
        level: u8,
        supported: u8,
    ) -> Result<()> {
        if supported & placement == 0 {
            return Err(flush_unsupported(pd, placement));
        }
        if self.inline_data.is_some() || !self.bufs.is_empty() || self.bufs.overflow() != 0 {
            return Err(invalid(
                "FLUSH",
                "carries no data: it takes no buffer or inline data",
            ));
        }
        if level == ffi::IBV_FLUSH_RANGE {
            remote.checked_addr(offset, len)?;
        }
        Ok(())
    }
}

/// Why a FLUSH to `placement` is refused: the loaded libibverbs predates `ibv_wr_flush`, the
/// device lacks the placement, or the QP cannot carry it.
#[cold]
#[inline(never)]
fn flush_unsupported(pd: &Pd, placement: u8) -> Error {
    let hint = if !ffi::has_wr_flush() {
        let loaded = match ffi::libibverbs_release() {
            Some(r) => format!("rdma-core {r}"),
            None => "of an unknown release (no release in its file name)".to_owned(),
        };
        format!(
            "the libibverbs loaded at run time is {loaded}, older than rdma-core {}, the first \
             with ibv_wr_flush: run with a newer rdma-core",
            ffi::FLUSH_SINCE
        )
    } else {
        let attr = pd.context().query_device();
        let (flag, method) = if placement == ffi::IBV_FLUSH_GLOBAL {
            ("IB_UVERBS_DEVICE_FLUSH_GLOBAL", "flush_global")
        } else {
            ("IB_UVERBS_DEVICE_FLUSH_PERSISTENT", "flush_persistent")
        };
        if attr.is_ok_and(|a| a.flush_placements() & placement == 0) {
            format!(
                "the device's device_cap_flags_ex lacks {flag} (DeviceAttr::{method}(): rxe \
                 from Linux 6.2)"
            )
        } else {
            "FLUSH needs the extended send API (Qp::send_api() == SendApi::Extended) on a QP \
             its provider created with IBV_QP_EX_WITH_FLUSH"
                .to_owned()
        }
    };
    Error::Unsupported {
        verb: "ibv_wr_flush",
        hint,
    }
}
