//! The end of a scope: waiting for its requests, flushing the QPs of those
//! that do not complete in time, and aborting where returning would be
//! unsound.

use std::time::{Duration, Instant};

use super::run::{AttachedQp, ScopedQueue};
use super::{DEFAULT_DRAIN_TIMEOUT, Scope, ScopedCompletion};
use crate::cq::POLL_BATCH;
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::ring::{HeldPanic, Ring};
use crate::qp::QpCore;

/// How long flushes may take after the move to the error state.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

impl<'scope, 'env> Scope<'scope, 'env> {
    /// Waits for every scoped request, flushing QPs that do not finish in
    /// time. Returns the outcome and a panic caught while releasing
    /// buffers of the ownership-passing path on the way.
    pub(super) fn drain(&self) -> (Result<()>, HeldPanic) {
        let mut attached = self.attached.borrow_mut();
        let mut caught = None;
        // Allocated only if something is left to wait for.
        let mut scratch = Vec::new();
        // The first failed completion among those waited for here: the
        // closure did not poll them, so this is the only report they get.
        let mut failed = None;
        // No deadline when the timeout is too long to add (Duration::MAX).
        let start = Instant::now();
        let deadline = start.checked_add(self.drain_timeout.get());
        if self.wait(
            &attached,
            &mut scratch,
            &mut caught,
            Some(&mut failed),
            deadline,
        ) {
            return (failed.map_or(Ok(()), Err), caught);
        }
        // The timeout, or (without one) how long unsignaled sends were waited for.
        let after = start.elapsed().min(self.drain_timeout.get());
        let mut first = failed;
        for a in attached.iter_mut() {
            // SAFETY: the QP is borrowed for the scope and no `ScopedQp`
            // call is running (the closure has returned).
            let core = unsafe { a.core.as_mut() };
            let sq_left = scoped_outstanding(a.sq.as_ref(), &core.sq, core.sq_head);
            let rq_left = scoped_outstanding(a.rq.as_ref(), &core.rq, core.rq_head);
            if sq_left + rq_left == 0 {
                continue;
            }
            let qp_num = core.sq.qp_num();
            first.get_or_insert(Error::ScopeDrained {
                qp_num,
                outstanding: sq_left + rq_left,
                after,
            });
            let attr = ffi::ibv_qp_attr {
                qp_state: ffi::IBV_QPS_ERR,
                ..Default::default()
            };
            // An error here (already in ERR, say) changes nothing below:
            // the flushes are waited for in any case.
            let _ = core.modify(
                (attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0),
                "a scope",
                "ERR",
            );
            if sq_left > 0 {
                core.post_drain_marker();
                if let Some(w) = a.sq.as_mut() {
                    w.owned_end = core.sq_head;
                }
            }
        }
        let deadline = Instant::now().checked_add(FLUSH_TIMEOUT);
        // Flushes are expected now: not reported.
        if !self.wait(&attached, &mut scratch, &mut caught, None, deadline) {
            // The provider neither completed nor flushed the requests: the
            // NIC may still write memory this scope would hand back.
            abort_with(format_args!(
                "requests of a scope were neither completed nor flushed {FLUSH_TIMEOUT:?} after \
                 their QP entered the error state (a provider bug); aborting, since returning \
                 would hand their buffers back while the NIC may still use them"
            ));
        }
        (first.map_or(Ok(()), Err), caught)
    }

    /// Polls (discarding the scope's completions) until no attached queue
    /// has scoped requests outstanding, or `deadline` (if any). True when
    /// drained. With `failed` (the wait before any flush), the first failed
    /// completion is kept there if it is empty, and the wait also ends
    /// (false) once every queue with requests outstanding has been, for
    /// [`DEFAULT_DRAIN_TIMEOUT`], a send queue whose outstanding requests
    /// are all unsignaled: a successful one never produces a completion, so
    /// only a flush can retire them, also without a deadline. Without a
    /// deadline it ends too when, a second or more into the wait, a QP's
    /// state cannot complete its outstanding requests
    /// ([`outstanding_on_a_stalled_qp`]): in ERR the flushes of what was
    /// posted before the move came at once, and what is left was posted after,
    /// which rxe flushes only on the next move to ERR; in INIT nothing
    /// completes until the move to ERR flushes it.
    fn wait(
        &self,
        attached: &[AttachedQp],
        scratch: &mut Vec<ScopedCompletion>,
        caught: &mut HeldPanic,
        mut failed: Option<&mut Option<Error>>,
        deadline: Option<Instant>,
    ) -> bool {
        let mut tails_since = None;
        // When (without a deadline) to look for a QP in the error state next.
        let mut err_check = Instant::now() + ERR_CHECK_INTERVAL;
        // A deadline already past (a drain timeout of 0) still polls once:
        // completions already in the CQ retire their requests.
        let mut polled = false;
        loop {
            let (mut left, mut awaited) = (0, 0);
            for a in attached {
                // SAFETY: as in `drain`; read-only.
                let core = unsafe { a.core.as_ref() };
                let sq = scoped_outstanding(a.sq.as_ref(), &core.sq, core.sq_head);
                let rq = scoped_outstanding(a.rq.as_ref(), &core.rq, core.rq_head);
                left += sq + rq;
                awaited += rq;
                if sq > 0 && !unsignaled_tail(core) {
                    awaited += sq;
                }
            }
            if left == 0 {
                return true;
            }
            let now = Instant::now();
            tails_since = if failed.is_some() && awaited == 0 {
                Some(tails_since.unwrap_or(now))
            } else {
                None
            };
            let tails_only = tails_since.is_some_and(|t| now - t > DEFAULT_DRAIN_TIMEOUT);
            let stuck_in_err = failed.is_some() && deadline.is_none() && now >= err_check && {
                err_check = now + ERR_CHECK_INTERVAL;
                attached.iter().any(outstanding_on_a_stalled_qp)
            };
            if polled && (tails_only || stuck_in_err || deadline.is_some_and(|d| now > d)) {
                return false;
            }
            polled = true;
            scratch.clear();
            scratch.reserve(POLL_BATCH);
            // Lost completions cannot hide a scoped request (the sweep
            // retires it all the same), so the error needs no action here.
            if let Ok(0) | Err(_) = self.poll_into(attached, scratch, POLL_BATCH, caught) {
                std::thread::yield_now();
            }
            if let Some(f) = failed.as_deref_mut().filter(|f| f.is_none()) {
                *f = scratch.iter().find_map(|c| c.result().err());
            }
        }
    }
}

/// Aborts the process when dropped: armed around the scope's drain, and
/// forgotten once it returned.
pub(super) struct AbortOnUnwind;

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        abort_with(format_args!(
            "a scope's drain unwound (a bug); aborting, since returning would hand back \
             buffers that requests of the scope may still use"
        ));
    }
}

/// Writes `why` to stderr (ignoring a failed write, which `eprintln!` would
/// turn into a panic) and aborts.
#[cold]
fn abort_with(why: std::fmt::Arguments<'_>) -> ! {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "rdma-verbs: {why}");
    std::process::abort()
}

/// How often a drain without a deadline looks for a QP in the error state
/// (the first time, this long into the wait).
const ERR_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// Whether `a` has scoped requests outstanding that its QP's state cannot
/// complete (`ibv_query_qp`; false when the query fails): in ERR (what was
/// posted after the move waits for the next one), in RESET or INIT (nothing
/// completes: a QP adopted in INIT whose connect failed, say), or sends in
/// a state other than RTS and SQD.
fn outstanding_on_a_stalled_qp(a: &AttachedQp) -> bool {
    // SAFETY: as in `Scope::drain`; read-only.
    let core = unsafe { a.core.as_ref() };
    let sq = scoped_outstanding(a.sq.as_ref(), &core.sq, core.sq_head);
    let rq = scoped_outstanding(a.rq.as_ref(), &core.rq, core.rq_head);
    if sq + rq == 0 {
        return false;
    }
    let mut attr = std::mem::MaybeUninit::<ffi::ibv_qp_attr>::zeroed();
    let mut init = std::mem::MaybeUninit::<ffi::ibv_qp_init_attr>::zeroed();
    // SAFETY: a live QP (borrowed for the scope) and zeroed out-structs.
    let rc = unsafe {
        ffi::ibv_query_qp(
            core.raw.as_ptr(),
            attr.as_mut_ptr(),
            ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
            init.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return false;
    }
    // SAFETY: zeroed, and filled by the call, which succeeded.
    match unsafe { attr.assume_init_ref() }.qp_state {
        ffi::IBV_QPS_ERR | ffi::IBV_QPS_RESET | ffi::IBV_QPS_INIT => true,
        ffi::IBV_QPS_RTS | ffi::IBV_QPS_SQD => false,
        _ => sq > 0,
    }
}

/// Whether every send outstanding on the QP is unsignaled (none of those
/// the scope posted after its last signaled send has been retired by it).
fn unsignaled_tail(core: &QpCore) -> bool {
    !core.caps.sq_sig_all
        && core
            .ext
            .scoped
            .as_ref()
            .is_some_and(|t| t.sig_end <= core.sq.tail())
}

/// Scoped requests of a queue in the scope still outstanding: none if nothing
/// was posted in the scope, else everything up to its head (earlier
/// requests complete before the scope's, in order).
fn scoped_outstanding(w: Option<&ScopedQueue>, ring: &Ring, head: u64) -> u64 {
    match w {
        Some(w) if head > w.start => head - ring.tail().max(w.start).min(head),
        _ => 0,
    }
}
