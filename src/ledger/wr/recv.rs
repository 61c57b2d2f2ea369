//! Receive work requests.

use super::invalid;
use crate::error::{Error, Result};
use crate::ledger::sges::{Buffer, Sges};
use crate::mr::Mr;
use crate::pd::Pd;

/// A receive work request: exclusively owned buffers the NIC may fill.
#[derive(Debug)]
pub struct RecvWr {
    pub(crate) wr_id: u64,
    pub(crate) bufs: Sges,
}

impl RecvWr {
    /// A receive into `buf`.
    #[inline]
    pub fn new(wr_id: u64, buf: Mr) -> RecvWr {
        RecvWr {
            wr_id,
            bufs: Sges::one(Buffer::Owned(buf)),
        }
    }

    /// A receive with no buffer (for zero-byte messages and WRITE_WITH_IMM notifications).
    #[inline]
    pub fn empty(wr_id: u64) -> RecvWr {
        RecvWr {
            wr_id,
            bufs: Sges::default(),
        }
    }

    /// Appends a scatter entry.
    #[inline]
    pub fn sge(mut self, buf: Mr) -> RecvWr {
        self.bufs.push(Buffer::Owned(buf));
        self
    }

    /// Gives back the buffers of a request that was not posted.
    pub fn into_buffers(self) -> Sges {
        self.bufs
    }

    #[inline]
    pub(crate) fn validate(&self, max_sge: u32, pd: &Pd) -> Result<()> {
        let n = self.bufs.len() + self.bufs.overflow();
        let max = (max_sge as usize).min(crate::ledger::sges::MAX_SAFE_SGES);
        if n > max {
            return Err(Error::TooManySges { requested: n, max });
        }
        if !self.bufs.all_locally_writable() {
            return Err(invalid(
                "receive buffer",
                "the NIC writes receive buffers, so their Mr needs AccessFlags::LOCAL_WRITE \
                 (the receive would fail with LOC_PROT_ERR)",
            ));
        }
        self.bufs.check_pd(pd)?;
        self.bufs.check_lengths()
    }
}
