//! Which extended send operations (ATOMIC_WRITE, FLUSH) a context's QPs take: asked of the
//! device once, turned off for good when a provider refuses a QP with one.

use super::Context;
use crate::ffi;

/// The bit of `ContextInner::flush` that says the placements were worked out.
const FLUSH_ASKED: u8 = 0x80;

impl Context {
    /// Whether this context's extended RC QPs take ATOMIC_WRITE: the device
    /// executes it ([`DeviceAttr::atomic_write`], queried once; a failed query
    /// reads as no) and its provider has not refused a QP with it
    /// ([`refuse_atomic_write`](Self::refuse_atomic_write)).
    pub(crate) fn atomic_write(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        match self.inner.atomic_write.load(Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let yes = self.query_device().is_ok_and(|a| a.atomic_write());
                // A concurrent refusal wins over this first answer.
                let _ = self.inner.atomic_write.compare_exchange(
                    0,
                    if yes { 1 } else { 2 },
                    Relaxed,
                    Relaxed,
                );
                self.inner.atomic_write.load(Relaxed) == 1
            }
        }
    }

    /// Records that the provider refused an RC QP with ATOMIC_WRITE: from now
    /// on no QP of this context offers it, including those made with it.
    pub(crate) fn refuse_atomic_write(&self) {
        self.inner
            .atomic_write
            .store(2, std::sync::atomic::Ordering::Relaxed);
    }

    /// The FLUSH placement types (`ffi::IBV_FLUSH_GLOBAL | ffi::IBV_FLUSH_PERSISTENT`) this
    /// context's extended RC QPs take: those the device reports
    /// ([`DeviceAttr::flush_global`], [`DeviceAttr::flush_persistent`], queried once; a failed
    /// query reads as none), none where the loaded libibverbs predates `ibv_wr_flush`
    /// (`ffi::has_wr_flush`) or its provider refused a QP with FLUSH
    /// ([`refuse_flush`](Self::refuse_flush)).
    pub(crate) fn flush_placements(&self) -> u8 {
        use std::sync::atomic::Ordering::Relaxed;
        let known = self.inner.flush.load(Relaxed);
        if known & FLUSH_ASKED != 0 {
            return known & !FLUSH_ASKED;
        }
        let placements = if ffi::has_wr_flush() {
            self.query_device().map_or(0, |a| a.flush_placements())
        } else {
            0
        };
        // A concurrent refusal wins over this first answer.
        let _ = self
            .inner
            .flush
            .compare_exchange(0, FLUSH_ASKED | placements, Relaxed, Relaxed);
        self.inner.flush.load(Relaxed) & !FLUSH_ASKED
    }

    /// Records that the provider refused an RC QP with FLUSH: from now on no QP of this
    /// context offers it, including those made with it.
    pub(crate) fn refuse_flush(&self) {
        self.inner
            .flush
            .store(FLUSH_ASKED, std::sync::atomic::Ordering::Relaxed);
    }
}
