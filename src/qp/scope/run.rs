//! [`Cq::scope`], which runs the closure and then waits for the scope's
//! requests, and the [`Scope`] it lends the closure, which attaches QPs.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::ptr::NonNull;
use std::time::Duration;

use super::drain::AbortOnUnwind;
use super::{DEFAULT_DRAIN_TIMEOUT, ScopedQp, ScopedTables};
use crate::cq::Cq;
use crate::error::{Error, Result};
use crate::ledger::ring::Ring;
use crate::qp::state::{QpState, Rc};
use crate::qp::{Qp, QpCore};

/// One queue of an attached QP that completes on the scope's CQ.
pub(super) struct ScopedQueue {
    /// The ring's tag (high half of its tokens).
    pub(super) tag: u32,
    /// The QP number its completions carry.
    pub(super) qp_num: u32,
    /// The first sequence number of the scope: requests before it were
    /// posted by the ownership-passing path.
    pub(super) start: u64,
    /// Slots below this may hold ownership-passing requests (or a drain
    /// marker) that a scoped completion sweeps.
    pub(super) owned_end: u64,
}

/// A QP attached to the scope, with those of its queues that complete on
/// the scope's CQ.
pub(super) struct AttachedQp {
    /// The QP's core, borrowed for the scope.
    pub(super) core: NonNull<QpCore>,
    pub(super) sq: Option<ScopedQueue>,
    pub(super) rq: Option<ScopedQueue>,
}

/// The scope of [`Cq::scope`]: attach QPs, post borrowed buffers, poll.
///
/// Neither `Send` nor `Sync`: everything happens on the thread that called
/// `Cq::scope`.
pub struct Scope<'scope, 'env: 'scope> {
    /// The CQ, borrowed mutably by `Cq::scope` for the whole scope.
    pub(super) cq: NonNull<Cq>,
    pub(super) attached: RefCell<Vec<AttachedQp>>,
    pub(super) drain_timeout: Cell<Duration>,
    /// Invariant in both lifetimes, like `std::thread::Scope`.
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl Cq {
    /// Runs `f` in a scope where requests posted on QPs of this CQ borrow
    /// their buffers ([`Src`](super::Src), [`Dst`](super::Dst)) instead of
    /// moving them, and returns what `f` returned once every request posted
    /// in the scope has completed. See the [module docs](crate::qp::scope).
    ///
    /// If `f` panics, the scope still waits for its requests, then the panic
    /// resumes.
    ///
    /// # Errors
    /// `f`'s error if it returned one (the requests it left outstanding were
    /// waited for all the same, and their QPs moved to the error state if
    /// that took longer than the drain timeout). Else, and with `f`'s value
    /// dropped (the QP needs attention): [`Error::WorkCompletion`] for the
    /// first request that failed among those `f` left outstanding, or
    /// [`Error::ScopeDrained`] when requests were still outstanding after
    /// the drain timeout and their QPs were moved to the error state to
    /// flush them.
    pub fn scope<'env, F, R>(&'env mut self, f: F) -> Result<R>
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> Result<R>,
    {
        let scope = Scope {
            cq: NonNull::from(&mut *self),
            attached: RefCell::new(Vec::new()),
            drain_timeout: Cell::new(DEFAULT_DRAIN_TIMEOUT),
            _scope: PhantomData,
            _env: PhantomData,
        };
        let result = catch_unwind(AssertUnwindSafe(|| f(&scope)));
        // Were the drain to unwind (a bug), returning would end the borrows
        // of buffers still in use by the NIC: abort instead.
        let abort = AbortOnUnwind;
        let (drained, caught) = scope.drain();
        std::mem::forget(abort);
        let result = match result {
            Err(panic) => resume_unwind(panic),
            Ok(result) => result,
        };
        if let Some(p) = caught {
            resume_unwind(p);
        }
        match (result, drained) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
            (Ok(value), Ok(())) => Ok(value),
        }
    }
}

impl<'scope, 'env> Scope<'scope, 'env> {
    /// Attaches `qp` for the rest of the scope. Its queues whose
    /// completions go to this scope's CQ take scoped requests.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when neither of its queues completes on
    /// this CQ.
    pub fn attach<S: QpState>(
        &'scope self,
        qp: &'scope mut Qp<Rc, S>,
    ) -> Result<ScopedQp<'scope, S>> {
        // SAFETY: `cq` is valid for the whole scope (Cq::scope holds the
        // borrow); only its address is compared.
        let cq_inner = unsafe { std::sync::Arc::as_ptr(&(*self.cq.as_ptr()).inner) };
        let core = &mut qp.core;
        let sq_in_scope = std::ptr::eq(std::sync::Arc::as_ptr(&core.send_cq), cq_inner);
        let rq_in_scope =
            std::ptr::eq(std::sync::Arc::as_ptr(&core.recv_cq), cq_inner) && core.ext.srq.is_none();
        if !sq_in_scope && !rq_in_scope {
            return Err(Error::InvalidArgument {
                what: "scoped QP",
                reason: "neither of its queues completes on the scope's CQ".into(),
            });
        }
        if sq_in_scope && core.caps.max_send_sge == 0 {
            // Scoped sends carry one SGE, written by the extended API's
            // builders without a check against the QP's capacity.
            return Err(Error::InvalidArgument {
                what: "scoped QP",
                reason: "its send queue takes no scatter/gather entry (max_send_sge 0)".into(),
            });
        }
        if core.ext.scoped.is_none() {
            core.ext.scoped = Some(Box::new(ScopedTables::new(core)));
        }
        let scoped_queue = |in_scope: bool, ring: &Ring, head: u64| {
            in_scope.then(|| ScopedQueue {
                tag: ring.tag(),
                qp_num: ring.qp_num(),
                start: head,
                owned_end: head,
            })
        };
        let attached = AttachedQp {
            sq: scoped_queue(sq_in_scope, &core.sq, core.sq_head),
            rq: scoped_queue(rq_in_scope, &core.rq, core.rq_head),
            core: NonNull::from(&mut *core),
        };
        let ptr = attached.core;
        self.attached.borrow_mut().push(attached);
        Ok(ScopedQp::new(ptr, sq_in_scope, rq_in_scope))
    }

    /// How long the end of the scope waits for outstanding requests before
    /// flushing their QPs ([`DEFAULT_DRAIN_TIMEOUT`] unless set). A timeout
    /// past what `Instant` can hold (`Duration::MAX`) waits without limit
    /// for requests that can still complete; sends that are all unsignaled
    /// (which never complete when they succeed) are flushed after
    /// [`DEFAULT_DRAIN_TIMEOUT`] all the same, and requests still posted on a
    /// QP whose state cannot complete them (ERR: rxe flushes a receive posted
    /// after the QP entered it only on the next move there; RESET or INIT: a
    /// QP adopted in INIT whose connect failed) after about a second.
    pub fn set_drain_timeout(&self, timeout: Duration) {
        self.drain_timeout.set(timeout);
    }
}
