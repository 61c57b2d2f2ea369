//! Polling in a scope: [`Scope::poll`] and its variants, and the reading of
//! each polled completion into a [`ScopedCompletion`].

use std::panic::resume_unwind;
use std::time::Duration;

use super::run::{AttachedQp, ScopedQueue};
use super::side_table::PostedRange;
use super::{Scope, ScopedCompletion};
use crate::cq::{Cq, WcOpcode, WcStatus, make_room, poll_exactly, poll_in_batches};
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::ring::HeldPanic;

impl<'scope, 'env> Scope<'scope, 'env> {
    /// Polls up to `out.capacity() - out.len()` completions of the scope's
    /// requests into `out` (its spare capacity: reserve it once) and returns
    /// how many were added. Allocates only when `out` has no spare capacity
    /// (room for 32 is reserved then, as [`Cq::poll`] does). Completions that are
    /// not the scope's (other QPs on the CQ, requests posted before the
    /// scope) are kept for the next [`Cq::poll`].
    ///
    /// # Errors
    /// As [`Cq::poll`]. A loss of completions ([`Error::CompletionsLost`],
    /// after [`Cq::poll_raw`]) found beside completions of the scope is
    /// reported by the CQ's next poll after the scope instead, so that those
    /// are returned here.
    #[doc(alias = "ibv_poll_cq")]
    #[inline]
    pub fn poll(&self, out: &mut Vec<ScopedCompletion>) -> Result<usize> {
        make_room(out);
        self.poll_up_to(out, out.capacity() - out.len())
    }

    /// Busy-polls until exactly `n` more of the scope's completions are in
    /// `out` (never more: the rest stay for the next poll), or fails with
    /// [`Error::Timeout { .. }`](Error::Timeout) after `timeout`; the
    /// completions polled before the timeout stay in `out`. `out` grows as
    /// completions come. As [`Cq::poll_n`], for a scope.
    ///
    /// # Errors
    /// [`Error::Timeout { .. }`](Error::Timeout), or as [`Cq::poll`].
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_n(
        &self,
        out: &mut Vec<ScopedCompletion>,
        n: usize,
        timeout: Duration,
    ) -> Result<()> {
        poll_exactly(
            out,
            n,
            timeout,
            "waiting for the scope's completions",
            |out, want| self.poll_up_to(out, want),
        )
    }

    /// Polls exactly one of the scope's completions, waiting up to `timeout`
    /// for it.
    ///
    /// # Errors
    /// As [`poll_n`](Self::poll_n).
    ///
    /// A poll that finds the completion and, on the way, completions of
    /// other requests that [`Cq::poll_raw`] took
    /// ([`Error::CompletionsLost`]) returns the completion; the loss is
    /// reported by the CQ's next poll after the scope.
    #[doc(alias = "ibv_poll_cq")]
    pub fn poll_one(&self, timeout: Duration) -> Result<ScopedCompletion> {
        let mut out = Vec::with_capacity(1);
        match self.poll_n(&mut out, 1, timeout) {
            Err(Error::CompletionsLost { count }) if !out.is_empty() => {
                // SAFETY: as in `poll_into`: the scope holds `&mut Cq` and no
                // user code runs while this reference lives.
                unsafe { (*self.cq.as_ptr()).defer_lost(count) };
            }
            r => r?,
        }
        out.pop().ok_or(Error::Timeout {
            what: "waiting for the scope's completion",
            after: timeout,
        })
    }

    /// [`poll`](Self::poll), taking at most `want` (at most the spare
    /// capacity) completions.
    #[inline(always)]
    fn poll_up_to(&self, out: &mut Vec<ScopedCompletion>, want: usize) -> Result<usize> {
        let attached = self.attached.borrow();
        let mut caught = None;
        let r = self.poll_into(&attached, out, want, &mut caught);
        drop(attached);
        if let Some(p) = caught {
            if let Err(Error::CompletionsLost { count }) = r {
                // SAFETY: as in `poll_into`: the scope holds `&mut Cq` and no
                // user code runs while this reference lives.
                unsafe { (*self.cq.as_ptr()).defer_lost(count) };
            }
            resume_unwind(p);
        }
        r
    }

    /// Polls up to `want` completions (at most `out`'s spare capacity).
    pub(super) fn poll_into(
        &self,
        attached: &[AttachedQp],
        out: &mut Vec<ScopedCompletion>,
        want: usize,
        caught: &mut HeldPanic,
    ) -> Result<usize> {
        // SAFETY: Cq::scope holds `&mut Cq` for the whole scope and this is
        // the only place that dereferences it mutably; no user code runs
        // while the reference lives, so it cannot be re-entered.
        let cq = unsafe { &mut *self.cq.as_ptr() };
        let start = out.len();
        let want = want.min(out.capacity() - start);
        let mut lost = 0;
        let raw = cq.as_raw();
        // SAFETY: the scope is the CQ's only consumer; `want` is the spare
        // capacity; interpret writes the element whenever it returns true.
        unsafe {
            poll_in_batches(raw, out, want, |wc, next| {
                interpret(cq, attached, wc, caught, &mut lost, next)
            })
        }?;
        if lost > 0 {
            if out.len() == start {
                return Err(Error::CompletionsLost { count: lost });
            }
            // The scope's completions are returned; the loss waits for the
            // CQ's next poll after the scope (an error here would leave
            // them unread behind a `?`).
            cq.defer_lost(lost);
        }
        Ok(out.len() - start)
    }
}

/// Interprets one completion polled by a scope: a scoped request's is
/// written to `out` as a [`ScopedCompletion`] (and true returned); anything else is kept in the
/// CQ for its next poll.
///
/// # Safety
/// `wc` was returned by `ibv_poll_cq` on `cq`, whose only consumer the
/// caller is; the attached QPs are live and not being posted to; `out` is
/// valid for a write.
#[inline(always)]
unsafe fn interpret(
    cq: &mut Cq,
    attached: &[AttachedQp],
    wc: *const ffi::ibv_wc,
    caught: &mut HeldPanic,
    lost: &mut u64,
    out: *mut ScopedCompletion,
) -> bool {
    // SAFETY: per the contract.
    unsafe {
        let tag = ((*wc).wr_id >> 32) as u32;
        for a in attached {
            // Each queue's interpretation is compiled for it (`RECV`).
            match (&a.sq, &a.rq) {
                (Some(w), _) if w.tag == tag => {
                    return interpret_on::<false>(cq, a, w, wc, caught, lost, out);
                }
                (_, Some(w)) if w.tag == tag => {
                    return interpret_on::<true>(cq, a, w, wc, caught, lost, out);
                }
                _ => {}
            }
        }
        cq.keep_for_next_poll(wc, caught, lost);
        false
    }
}

/// [`interpret`] for a completion whose token carries the tag of `w`, the
/// receive queue (`RECV`) or the send queue of `a`.
///
/// # Safety
/// As [`interpret`]'s.
#[inline(always)]
unsafe fn interpret_on<const RECV: bool>(
    cq: &mut Cq,
    a: &AttachedQp,
    w: &ScopedQueue,
    wc: *const ffi::ibv_wc,
    caught: &mut HeldPanic,
    lost: &mut u64,
    out: *mut ScopedCompletion,
) -> bool {
    // SAFETY: per the contract.
    unsafe {
        let token = (*wc).wr_id;
        // The attached QP is not being posted to (contract): this is the
        // only reference to it.
        let core = &mut *a.core.as_ptr();
        let (ring, head) = if RECV {
            (&*core.rq, core.rq_head)
        } else {
            (&*core.sq, core.sq_head)
        };
        let tail = ring.tail();
        let dist = u64::from((token as u32).wrapping_sub(tail as u32));
        let seq = tail + dist;
        if w.qp_num != (*wc).qp_num || dist >= head - tail || seq < w.start {
            // Not a scoped request: an earlier request of the
            // ownership-passing path, or a stale or forged token.
            cq.keep_for_next_poll(wc, caught, lost);
            return false;
        }
        if ring.retire_through(tail, seq, w.owned_end, caught, lost) {
            return false; // the drain marker
        }
        let Some(tables) = core.ext.scoped.as_deref_mut() else {
            return false;
        };
        // The side tables have the ring's slot count; `seq` is in flight and
        // at or after both the old tail and the scope's start.
        let p = if RECV {
            PostedRange {
                wr_id: *tables.rq.get_unchecked(ring.index(seq)),
                seq,
                wc_opcode: ffi::IBV_WC_RECV,
                len: 1,
            }
        } else {
            PostedRange::find(tables.sq.as_mut_ptr(), ring, seq, tail.max(w.start))
        };
        write_completion(wc, p, RECV, out);
        true
    }
}

/// Writes the [`ScopedCompletion`] of a scoped request to `out`.
///
/// # Safety
/// As `Completion::write_from_wc`: only fields valid for the status and
/// opcode are read; `out` is valid for a write.
#[inline(always)]
unsafe fn write_completion(
    wc: *const ffi::ibv_wc,
    p: PostedRange,
    recv: bool,
    out: *mut ScopedCompletion,
) {
    // SAFETY: per the contract.
    unsafe {
        let raw_status = (*wc).status;
        if raw_status != ffi::IBV_WC_SUCCESS {
            return write_failed(wc, p.wr_id, p.wc_opcode, out);
        }
        let (opcode, byte_len, imm_data) = if recv {
            let imm = ((*wc).wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
                .then(|| u32::from_be((*wc).__bindgen_anon_1.imm_data));
            ((*wc).opcode, (*wc).byte_len, imm)
        } else {
            // READ and atomics report the bytes they brought back.
            let reads = matches!(
                p.wc_opcode,
                ffi::IBV_WC_RDMA_READ | ffi::IBV_WC_COMP_SWAP | ffi::IBV_WC_FETCH_ADD
            );
            (p.wc_opcode, if reads { (*wc).byte_len } else { 0 }, None)
        };
        let opcode = if recv {
            recv_opcode(opcode)
        } else {
            WcOpcode::from_raw(opcode)
        };
        out.write(ScopedCompletion {
            wr_id: p.wr_id,
            status: WcStatus::Success,
            opcode,
            byte_len,
            imm_data,
            qp_num: (*wc).qp_num,
            vendor_err: 0,
        });
    }
}

/// The opcode of a successful receive: one of two in practice, compared
/// first (the general mapping, inlined here, tested for send opcodes first).
#[inline(always)]
fn recv_opcode(raw: u32) -> WcOpcode {
    match raw {
        ffi::IBV_WC_RECV => WcOpcode::Recv,
        ffi::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
        _ => other_opcode(raw),
    }
}

/// [`WcOpcode::from_raw`] out of line, for [`recv_opcode`].
#[cold]
#[inline(never)]
fn other_opcode(raw: u32) -> WcOpcode {
    WcOpcode::from_raw(raw)
}

/// Writes the [`ScopedCompletion`] of a failed (or flushed) scoped request.
///
/// # Safety
/// As [`write_completion`].
/// `wr_id` and `wc_opcode` are the request's (of its [`PostedRange`]),
/// passed alone so that the hot path keeps the range in registers.
#[cold]
#[inline(never)]
unsafe fn write_failed(
    wc: *const ffi::ibv_wc,
    wr_id: u64,
    wc_opcode: u32,
    out: *mut ScopedCompletion,
) {
    // SAFETY: per the contract; status, vendor_err and qp_num are valid
    // for every completion.
    unsafe {
        out.write(ScopedCompletion {
            wr_id,
            status: WcStatus::from_raw((*wc).status),
            opcode: WcOpcode::from_raw(wc_opcode),
            byte_len: 0,
            imm_data: None,
            qp_num: (*wc).qp_num,
            vendor_err: (*wc).vendor_err,
        });
    }
}
