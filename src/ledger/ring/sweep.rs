//! Where a poll puts the buffers of the unsignaled requests a completion
//! sweeps: released ([`Release`], [`Cq::poll`](crate::cq::Cq::poll)), kept in
//! a list (`Vec<(u64, Sges)>`, `Cq::poll_with_retired`) or handed to the
//! application one by one ([`Recycle`], `Cq::poll_recycling`).

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::HeldPanic;
use crate::ledger::sges::{Buffer, Sges};

/// A destination for swept requests' buffers.
pub(crate) trait Sweep {
    /// Takes `bufs`, the buffers of the request `wr_id`. A panic (a buffer's `Drop`,
    /// the application's closure) is kept in `caught` (the first one) instead
    /// of unwinding through the ring's bookkeeping.
    ///
    /// # Safety
    /// `bufs` is a live list (of a claimed slot) that nothing uses afterwards.
    unsafe fn take(&mut self, wr_id: u64, bufs: *mut Sges, caught: &mut HeldPanic);
}

/// Drops them.
pub(crate) struct Release;

impl Sweep for Release {
    #[inline(always)]
    unsafe fn take(&mut self, _wr_id: u64, bufs: *mut Sges, caught: &mut HeldPanic) {
        // SAFETY: per the contract.
        unsafe { drop_in_place_catching(bufs, caught) }
    }
}

impl Sweep for Vec<(u64, Sges)> {
    /// Appends the request's wr_id and buffers, written in place (a push
    /// would copy the whole entry once more).
    #[inline]
    unsafe fn take(&mut self, wr_id: u64, bufs: *mut Sges, _caught: &mut HeldPanic) {
        self.reserve(1);
        let len = self.len();
        // SAFETY: `reserve` made room for one more entry; both fields are
        // written before `set_len`; the buffers move out once (contract).
        unsafe {
            let dst = self.as_mut_ptr().add(len);
            (&raw mut (*dst).0).write(wr_id);
            Sges::move_to(bufs, &raw mut (*dst).1);
            self.set_len(len + 1);
        }
    }
}

/// Hands each buffer, with its request's wr_id, to the closure; after a
/// panic of the closure the rest of the poll's buffers are dropped.
pub(crate) struct Recycle<F>(pub(crate) F);

impl<F: FnMut(u64, Buffer)> Sweep for Recycle<F> {
    #[inline(always)]
    unsafe fn take(&mut self, wr_id: u64, bufs: *mut Sges, caught: &mut HeldPanic) {
        if caught.is_some() {
            // SAFETY: per the contract.
            return unsafe { drop_in_place_catching(bufs, caught) };
        }
        let f = &mut self.0;
        // SAFETY: per the contract the list moves out once (its one inline
        // buffer alone in the common case, read where it lies).
        if unsafe { (*bufs).is_one_inline() } {
            // SAFETY: as above.
            let b = unsafe { std::ptr::read((*bufs).inline_first()) };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| f(wr_id, b))) {
                caught.get_or_insert(p);
            }
            return;
        }
        // SAFETY: as above.
        let mut rest = unsafe { std::ptr::read(bufs) }.into_iter();
        // The iterator stays outside the closure's unwind: what the closure
        // has not taken when it panics is dropped afterwards, where a panic
        // of theirs is caught too (dropped by the unwind, a second panic
        // would abort the process).
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| {
            for b in &mut rest {
                f(wr_id, b);
            }
        })) {
            caught.get_or_insert(p);
        }
        if let Err(p) = catch_unwind(AssertUnwindSafe(move || drop(rest))) {
            caught.get_or_insert(p);
        }
    }
}

/// Drops the buffers at `bufs`; a panic from a buffer's `Drop` is kept in
/// `caught` (the first one; later ones are discarded) instead of unwinding
/// through the caller's bookkeeping. (A panicking element does not stop the
/// others from being dropped, and none is dropped twice.)
///
/// # Safety
/// `bufs` is a live list that nothing uses afterwards.
#[inline(always)]
pub(super) unsafe fn drop_in_place_catching(bufs: *mut Sges, caught: &mut HeldPanic) {
    // SAFETY: per the contract.
    if unsafe { (*bufs).is_empty() } {
        return;
    }
    // SAFETY: per the contract; dropped exactly once even if it unwinds.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { Sges::drop_in_place(bufs) }));
    if let Err(p) = r {
        caught.get_or_insert(p);
    }
}
