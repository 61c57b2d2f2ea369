//! Polling: completions read in batches, their tokens validated, their buffers handed back.

use std::mem::MaybeUninit;

use super::completion::TOKEN_SHIFT;
use super::{Completion, CompletionSource, Cq};
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::ring::{HeldPanic, Recycle, Release, Sweep};
use crate::ledger::sges::{Buffer, Sges};
use crate::ledger::table::TAG_FLAG;
use crate::sys::call::verb;

/// How many work completions one `ibv_poll_cq` call fetches at most.
pub(crate) const POLL_BATCH: usize = 32;

/// Reserves room for a batch when `out` has none spare: a poll into a full
/// (or new) `Vec` would otherwise take nothing, and a loop waiting for a
/// completion that way would never see one.
#[inline(always)]
pub(crate) fn make_room<T>(out: &mut Vec<T>) {
    if out.capacity() == out.len() {
        out.reserve(POLL_BATCH);
    }
}

/// Polls `raw` in batches of up to [`POLL_BATCH`] until `want` entries were
/// read or the CQ ran dry, handing each entry with the next free element of
/// `out`'s spare capacity to `each`, which returns true when it wrote that
/// element (then it counts as added). Returns whether the CQ ran dry. Shared
/// by [`Cq::poll`] and the scope's poll.
///
/// # Safety
/// `raw` is a live CQ whose only consumer the caller is; `want` is at most
/// `out`'s spare capacity; `each` returns true only after writing every
/// field of the element it was given.
#[inline(always)]
pub(crate) unsafe fn poll_in_batches<T>(
    raw: *mut ffi::ibv_cq,
    out: &mut Vec<T>,
    want: usize,
    mut each: impl FnMut(*const ffi::ibv_wc, *mut T) -> bool,
) -> Result<bool> {
    let mut wcs = [MaybeUninit::<ffi::ibv_wc>::uninit(); POLL_BATCH];
    let mut total = 0;
    while total < want {
        let n = (want - total).min(POLL_BATCH);
        // SAFETY: valid CQ (contract); wcs has room for n entries.
        let rc = verb!(count: unsafe { ffi::ibv_poll_cq(raw, n as i32, wcs[0].as_mut_ptr()) })?;
        let got = (rc as usize).min(n);
        // The length is counted in a local for the batch (not re-read from
        // `out` per entry) and reaches `out` when the guard drops, after the
        // batch or during an unwind from `each`: written elements are kept.
        let mut added = SetLenOnDrop {
            len: out.len(),
            out: &mut *out,
        };
        let next = added.out.as_mut_ptr();
        for wc in &wcs[..got] {
            // SAFETY: ibv_poll_cq wrote this entry; total < want <= spare
            // capacity, so element `added.len` has room; it is counted only
            // once `each` wrote it (contract).
            unsafe {
                if each(wc.as_ptr(), next.add(added.len)) {
                    added.len += 1;
                }
            }
        }
        drop(added);
        total += got;
        if got < n {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Sets the length of `out` to `len` when dropped (see [`poll_in_batches`]).
struct SetLenOnDrop<'a, T> {
    out: &'a mut Vec<T>,
    len: usize,
}

impl<T> Drop for SetLenOnDrop<'_, T> {
    fn drop(&mut self) {
        // SAFETY: `len` counts the elements `each` wrote, all within the
        // spare capacity `poll_in_batches` was given.
        unsafe { self.out.set_len(self.len) }
    }
}

impl Cq {
    /// Polls (`ibv_poll_cq`) up to `out.capacity() - out.len()` completions
    /// into `out` (its spare capacity: reserve it once), returning how many
    /// were added. When
    /// `out` has no spare capacity (`Vec::new()`), room for 32 completions
    /// is reserved first, the only case that allocates: a poll never takes
    /// nothing for want of room.
    ///
    /// Each completion of a safe-path work request carries that request's
    /// buffers back ([`Completion::take_mr`], [`Completion::take_buffers`]);
    /// unsignaled sends before it are retired and their buffers released
    /// (use [`Cq::poll_with_retired`] or [`Cq::poll_recycling`] to get those
    /// back). Completions that are not the safe path's come back marked
    /// [`CompletionSource::Foreign`] or [`CompletionSource::Stale`], without
    /// buffers.
    ///
    /// # Errors
    /// [`Error::CompletionsLost`] when a completion swept a signaled request
    /// whose own completion never arrived (the CQ overran, or it was consumed
    /// by [`poll_raw`](Cq::poll_raw)); the completions polled in that call are
    /// in `out` all the same.
    #[inline]
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        make_room(out);
        self.poll_inner(out, usize::MAX, &mut Release)
    }

    /// [`Cq::poll`] (`ibv_poll_cq`), and the buffers of the unsignaled
    /// requests each completion retires are appended to `retired` as
    /// `(wr_id, buffers)` in posting order instead of being released: the way
    /// to recycle unsignaled READ or atomic
    /// destinations. Allocates only if `retired` runs out of capacity (or
    /// `out` has none spare, as [`Cq::poll`]).
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_with_retired(
        &mut self,
        out: &mut Vec<Completion>,
        retired: &mut Vec<(u64, Sges)>,
    ) -> Result<usize> {
        make_room(out);
        self.poll_inner(out, usize::MAX, retired)
    }

    /// [`Cq::poll`] (`ibv_poll_cq`), and each buffer of the unsignaled
    /// requests the completions retire is handed to `recycle` with its
    /// request's `wr_id` (in posting order, a request's buffers in list
    /// order) instead of being released: the cheapest way to return
    /// unsignaled READ or atomic destinations to a pool, with no list in
    /// between ([`Buffer::into_mr`](crate::qp::Buffer::into_mr) gives an owned
    /// destination back as the [`Mr`](crate::mr::Mr) it was posted as). A
    /// signaled request's buffers come back in its [`Completion`], as with
    /// [`Cq::poll`].
    ///
    /// If `recycle` panics, the buffers it has not been handed in this call
    /// are released instead, and the panic resumes once the poll has
    /// finished its bookkeeping (the completions it read are in `out`).
    ///
    /// ```no_run
    /// # use rdma_verbs::prelude::*;
    /// # fn f(cq: &mut Cq, out: &mut Vec<Completion>, pool: &mut Vec<Mr>) -> Result<()> {
    /// cq.poll_recycling(out, |_wr_id, buf| pool.extend(buf.into_mr()))?;
    /// for c in out.iter_mut() {
    ///     c.result()?;
    ///     pool.extend(c.take_mr());
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Cq::poll`].
    #[inline]
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_recycling(
        &mut self,
        out: &mut Vec<Completion>,
        recycle: impl FnMut(u64, Buffer),
    ) -> Result<usize> {
        make_room(out);
        self.poll_inner(out, usize::MAX, &mut Recycle(recycle))
    }

    #[inline]
    fn poll_inner(
        &mut self,
        out: &mut Vec<Completion>,
        want: usize,
        sweep: &mut impl Sweep,
    ) -> Result<usize> {
        let start = out.len();
        let want = want.min(out.capacity() - start);
        if !self.pending.is_empty() || self.lost_unreported != 0 {
            // A loss a poll_one deferred, then completions a scope polled
            // for others, come first.
            return self.take_deferred(out, want);
        }
        let destroyed = self.inner.rings.destroyed();
        let mut caught: HeldPanic = None;
        let mut lost = 0;
        let raw = self.as_raw();
        // SAFETY: `raw` is this CQ; the completion is built in place in
        // `out`'s spare capacity and every field is written when
        // complete_into returns true.
        let polled = unsafe {
            poll_in_batches(raw, out, want, |wc, dst| {
                self.complete_into(wc, dst, sweep, &mut caught, &mut lost)
            })
        };
        let drained = match polled {
            Ok(drained) => drained,
            // `ibv_poll_cq` failed after earlier batches of this call: what
            // they found is not dropped. A loss is reported by the next
            // poll; a held panic goes on (the error will recur).
            Err(e) => {
                if lost > 0 {
                    self.defer_lost(lost);
                }
                if let Some(p) = caught {
                    std::panic::resume_unwind(p);
                }
                return Err(e);
            }
        };
        if drained && destroyed > 0 {
            self.unregister_destroyed(destroyed);
        }
        if let Some(p) = caught {
            // A buffer's Drop panicked while the ring was being retired: the
            // books are consistent now, so let the panic go on. A loss found
            // by the same poll is reported by the next one.
            if lost > 0 {
                self.defer_lost(lost);
            }
            std::panic::resume_unwind(p);
        }
        if lost > 0 {
            return Err(Error::CompletionsLost { count: lost });
        }
        Ok(out.len() - start)
    }

    /// Interprets one polled work completion: validates its token, retires
    /// its request (and the unsignaled ones before it) and writes the
    /// [`Completion`] with the buffers to `dst`. Returns false, having written
    /// nothing, for the library's own drain marker.
    ///
    /// # Safety
    /// `wc` was returned by `ibv_poll_cq` on this CQ (so `wr_id`, `status`,
    /// `qp_num` are written, the rest as ibv_poll_cq(3) says for the status
    /// and opcode); `dst` is valid for writes and holds nothing to drop.
    #[inline(always)]
    pub(crate) unsafe fn complete_into(
        &mut self,
        wc: *const ffi::ibv_wc,
        dst: *mut Completion,
        sweep: &mut impl Sweep,
        caught: &mut HeldPanic,
        lost: &mut u64,
    ) -> bool {
        // SAFETY: per the contract; `retire` writes the buffers iff it
        // returns Some, else they are set empty below; write_from_wc reads
        // the entry only as its status and opcode allow.
        unsafe {
            let bufs = &raw mut (*dst).bufs;
            let token = (*wc).wr_id;
            let tag = (token >> TOKEN_SHIFT) as u32;
            let ring = if tag & TAG_FLAG == 0 {
                None // not a token: raw posts keep bit 63 clear
            } else {
                self.cache.get(&self.inner.rings, tag)
            };
            let (source, posted, recv) = match ring {
                Some(ring) if ring.qp_num() == (*wc).qp_num => {
                    match ring.retire(token as u32, sweep, bufs, caught, lost) {
                        // The library's own drain marker (see Qp::to_error):
                        // it has retired the requests before it; nothing to
                        // hand out (its empty buffer list needs no drop).
                        Some(r) if r.meta.drain => return false,
                        Some(r) => (
                            CompletionSource::Posted,
                            Some((r.wr_id, r.meta.completion_opcode())),
                            r.meta.is_recv(),
                        ),
                        None => (CompletionSource::Stale, None, false),
                    }
                }
                // A shared receive queue's receive, consumed by any QP on
                // it: it retires exactly its own slot.
                Some(ring) if ring.is_srq() => match ring.retire_srq(token as u32, bufs) {
                    Some(r) => (
                        CompletionSource::Posted,
                        Some((r.wr_id, ffi::IBV_WC_RECV)),
                        true,
                    ),
                    None => (CompletionSource::Stale, None, false),
                },
                _ => (CompletionSource::Foreign, None, false),
            };
            if posted.is_none() {
                bufs.write(Sges::default());
            }
            Completion::write_from_wc(dst, wc, posted, recv, source);
            true
        }
    }

    /// Keeps a completion that a [`scope`](Cq::scope) polled but that was
    /// not its own, for the next [`poll`](Cq::poll).
    ///
    /// # Safety
    /// As [`complete_into`](Cq::complete_into) for `wc`.
    pub(crate) unsafe fn keep_for_next_poll(
        &mut self,
        wc: *const ffi::ibv_wc,
        caught: &mut HeldPanic,
        lost: &mut u64,
    ) {
        let mut pending = std::mem::take(&mut self.pending);
        pending.reserve(1);
        let len = pending.len();
        // SAFETY: room for one more was reserved; complete_into writes every
        // field when it returns true, and nothing otherwise.
        unsafe {
            if self.complete_into(
                wc,
                pending.as_mut_ptr().add(len),
                &mut Release,
                caught,
                lost,
            ) {
                pending.set_len(len + 1);
            }
        }
        self.pending = pending;
    }

    /// Keeps a loss for the next poll to report.
    pub(crate) fn defer_lost(&mut self, count: u64) {
        self.lost_unreported = self.lost_unreported.saturating_add(count);
    }

    /// What earlier polls left for this one: a loss a `poll_one` deferred
    /// (reported first, alone), else up to `want` kept completions moved
    /// into `out` (oldest first).
    #[cold]
    #[inline(never)]
    fn take_deferred(&mut self, out: &mut Vec<Completion>, want: usize) -> Result<usize> {
        if self.lost_unreported != 0 {
            let count = std::mem::take(&mut self.lost_unreported);
            return Err(Error::CompletionsLost { count });
        }
        let n = want.min(self.pending.len());
        out.extend(self.pending.drain(..n));
        Ok(n)
    }

    /// The CQ was found empty: completions of QPs destroyed before the poll
    /// began are gone, so their rings can be unregistered and their CQ
    /// entries given back.
    #[cold]
    fn unregister_destroyed(&mut self, destroyed: usize) {
        let unregistered = self
            .inner
            .rings
            .unregister_destroyed(destroyed, &mut self.cache);
        // Dropped outside the table's lock (the buffers were released already).
        drop(unregistered);
    }

    /// Polls raw work completions (`ibv_poll_cq`) without interpreting `wr_id`.
    ///
    /// For completions of work requests posted with `post_send_raw` /
    /// `post_recv_raw`. Safe-path completions consumed here do not hand their
    /// buffers back: they stay in the QP's ring until a later completion on
    /// the same queue polled with [`Cq::poll`] sweeps them (and reports them
    /// as [`Error::CompletionsLost`]), or the QP is destroyed. Only the
    /// fields ibv_poll_cq(3) names valid for each entry's status and opcode
    /// hold data (the rest are as `wcs` had them).
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_raw(&mut self, wcs: &mut [ffi::ibv_wc]) -> Result<usize> {
        let n = i32::try_from(wcs.len()).unwrap_or(i32::MAX);
        // SAFETY: valid CQ; wcs has room for n entries (already initialised,
        // so fields the provider leaves unwritten keep their values).
        let got = verb!(count: unsafe { ffi::ibv_poll_cq(self.as_raw(), n, wcs.as_mut_ptr()) })?;
        Ok(got as usize)
    }

    /// Busy-polls (`ibv_poll_cq`) until exactly `n` more completions are in `out` (never
    /// more: the rest stay in the CQ for the next poll), or fails with
    /// [`Error::Timeout { .. }`](Error::Timeout) after `timeout`; the
    /// completions polled before the timeout stay in `out`. `out` grows as
    /// completions come (at least 32 more at a time), so a huge
    /// `n` allocates only for what arrives.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_n(
        &mut self,
        out: &mut Vec<Completion>,
        n: usize,
        timeout: std::time::Duration,
    ) -> Result<()> {
        poll_exactly(out, n, timeout, "waiting for completions", |out, want| {
            self.poll_inner(out, want, &mut Release)
        })
    }

    /// Polls exactly one completion (`ibv_poll_cq`), busy-polling up to
    /// `timeout` for it, as [`poll_n`](Cq::poll_n) does: the thread spins
    /// while it waits. To sleep until a completion comes, create the CQ with a
    /// channel and use [`wait_poll`](Cq::wait_poll).
    ///
    /// A poll that finds the completion and, on the way, completions that
    /// [`poll_raw`](Cq::poll_raw) took ([`Error::CompletionsLost`]) returns
    /// the completion (with its buffers); the next poll reports the loss.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_one(&mut self, timeout: std::time::Duration) -> Result<Completion> {
        let mut out = Vec::with_capacity(1);
        match self.poll_n(&mut out, 1, timeout) {
            Err(Error::CompletionsLost { count }) if !out.is_empty() => self.defer_lost(count),
            r => r?,
        }
        out.pop().ok_or(Error::Timeout {
            what: "waiting for a completion",
            after: timeout,
        })
    }
}

/// Polls with `poll(out, want)` (which adds at most `want`, at most `out`'s
/// spare capacity) until exactly `n` more are in `out`, or fails with
/// [`Error::Timeout`] naming `what` after `timeout`. `out` grows with what
/// arrives (by at least [`POLL_BATCH`] where `n` allows), never by `n` up
/// front: a huge `n` must not reserve (or abort on) memory it never uses.
pub(crate) fn poll_exactly<T>(
    out: &mut Vec<T>,
    n: usize,
    timeout: std::time::Duration,
    what: &'static str,
    mut poll: impl FnMut(&mut Vec<T>, usize) -> Result<usize>,
) -> Result<()> {
    let target = out.len().saturating_add(n);
    let start = std::time::Instant::now();
    while out.len() < target {
        let want = target - out.len();
        if out.len() == out.capacity() {
            out.reserve(want.min(POLL_BATCH));
        }
        if poll(out, want)? == 0 && start.elapsed() > timeout {
            return Err(Error::Timeout {
                what,
                after: timeout,
            });
        }
    }
    Ok(())
}
