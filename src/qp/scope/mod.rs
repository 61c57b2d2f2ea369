//! Scoped borrowing: posting borrowed buffers inside a scope that cannot end
//! before the NIC is done with them.
//!
//! The ownership-passing path ([`Qp::post_send`]) moves each request's
//! buffers into the QP and back out of its completion. That is what makes it
//! safe anywhere, and it is also what it costs: a ~230-byte request built
//! and moved, buffers moved into a slot and out again, a ~190-byte
//! [`Completion`](crate::Completion) per polled entry. Inside
//! [`Cq::scope`] requests *borrow* their buffers instead ([`Src`] from
//! `&Mr`, [`Dst`] from `&mut Mr`), the QP keeps only the request's `wr_id`,
//! and [`Scope::poll`] hands back a small [`ScopedCompletion`]. Posting a
//! request costs little more than the C verb.
//!
//! # Why it is sound
//! The argument is `std::thread::scope`'s. [`Cq::scope`] lends the closure
//! a `&'scope Scope`; `'scope` is chosen by `Cq::scope`, so a buffer lent
//! to a request (`Src<'scope>`, `Dst<'scope>`) must be borrowed from outside
//! the closure and stays borrowed until `Cq::scope` returns. Before it
//! returns, normally or by unwinding from a panic in the closure,
//! `Cq::scope` waits until every request posted in the scope has completed
//! (the QP's queues complete in order, so a polled completion retires every
//! request before it). `mem::forget` cannot skip that wait: it runs in
//! `Cq::scope` itself, after the closure, not in a destructor. A `Dst`
//! comes from `&'scope mut Mr`, so no Rust code reads or writes memory the
//! NIC may be writing (the NIC writing the same `Dst` from several requests
//! races only with itself); a `Src` comes from a shared borrow, which the
//! NIC only reads.
//!
//! [`ScopedBuffers`] lend the buffers of one region one request at a time
//! instead: the region is borrowed exclusively for `'scope` as a `Dst`'s
//! is, and a buffer is handed to Rust code only while no request of it
//! that could write it (a receive), or, for writing, read it (a SEND or
//! WRITE), is in flight, which the queue's tail tells (a QP's own queues
//! complete in order, so a polled completion retires every request before
//! it on its queue). Reading borrows the `ScopedBuffers` shared, writing
//! and posting borrow it exclusively, so no slice of a buffer lives across
//! its next post.
//!
//! A scope may end with requests the closure did not poll: it waits for
//! them, and the first of them that failed is returned as the scope's error
//! ([`Error::WorkCompletion`]).
//!
//! Requests that do not complete in time (a peer that stopped answering
//! with `rnr_retry` 7, a scope that ends with unsignaled sends whose
//! successful completion produces no entry, a forgotten poll) do not hang
//! the program: after [`Scope::set_drain_timeout`] (5 s by default) the
//! scope moves each QP with requests outstanding to the error state, which
//! flushes every posted request with a completion (the `qp` module's
//! assumption table), posts the library's zero-length drain marker behind
//! unsignaled sends, waits for those flushes (at most 5 s) and returns
//! [`Error::ScopeDrained`]. Without a drain timeout (`Duration::MAX`), the
//! scope still stops waiting for sends that are all unsignaled after
//! [`DEFAULT_DRAIN_TIMEOUT`]: they can never complete successfully. A
//! provider that flushed nothing within that time would break the verbs
//! contract; the process is then aborted, since returning would let the NIC
//! write memory Rust has handed back.
//!
//! Nothing ends that wait early. A drain timeout too long to add to the
//! clock (`Duration::MAX`) means no limit for requests that can still
//! complete (see above for unsignaled sends); no assertion and no user code
//! runs while polling (a destructor of an ownership-passing request's buffer
//! that panics is caught, and the panic resumed after the wait); and were
//! the wait to unwind all the same, the process aborts
//! (`tests/vm_scope_edges.rs`).
//!
//! Which request a completion retires is read from the QP's side table,
//! whose entries for requests that were staged but not posted (the provider
//! refused them, or the iterator of a list panicked) are taken back at
//! once: a later post over the same sequence numbers never meets them. A
//! list's iterator may poll the scope: no reference into the QP lives while
//! it runs.
//!
//! The attached QP and the CQ are borrowed for the whole scope, so nothing
//! else can post on that QP, poll that CQ or destroy either meanwhile.
//! Requests posted before the scope with the ownership-passing path keep
//! working: their completions, and those of other QPs on the CQ, are kept
//! by [`Scope::poll`] and handed out (with their buffers) by the next
//! [`Cq::poll`] after the scope. Unsignaled ones that a scoped completion
//! retires (they have no entry of their own) have their buffers dropped,
//! as [`Cq::poll`] does: [`Cq::poll_with_retired`] cannot hand those back
//! from inside a scope. The kept completions stay in memory until that
//! poll: a long scope beside a busy QP of another thread on the same CQ
//! keeps all of that QP's completions (give such a QP its own CQ).
//!
//! A buffer of another protection domain or device fails its request with a
//! protection error status (the NIC checks the lkey); it never lets the NIC
//! reach memory outside the buffer.
//!
//! ```no_run
//! # use rdma_verbs::*;
//! # use rdma_verbs::qp::Rts;
//! # fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, src: &Mr, remote: RemoteMr) -> Result<()> {
//! let src = Src::new(src)?;
//! cq.scope(|s| -> Result<()> {
//!     let mut q = s.attach(qp)?;
//!     for i in 0..100u64 {
//!         // Every 10th request asks for a completion; the last one must.
//!         let signaled = i % 10 == 9;
//!         q.post_send(&ScopedSend::write(i, src, remote, 0).signaled(signaled))?;
//!         let mut done = Vec::with_capacity(16);
//!         s.poll(&mut done)?;
//!         for c in &done {
//!             c.result()?;
//!         }
//!     }
//!     Ok(())
//! })?;
//! # Ok(())
//! # }
//! ```

//!
//! # Post lists
//! [`ScopedQp::post_send_list`] posts requests built by an iterator, 32 per
//! `ibv_post_send`. A list posted again and again (perftest's `-l`) is
//! cheaper as a [`PreparedSends`]: its requests are checked and laid out
//! once, and [`ScopedQp::post_prepared`] writes one side entry for the list
//! (when its requests share an operation) and posts the whole list, however
//! long, with one doorbell. On a QP with the extended send API each request
//! goes straight to its builder (chosen once for a list of one operation)
//! with its token as the `wr_id`; otherwise the tokens are written into the
//! list's C chain before one `ibv_post_send`. The tokens are what the raw
//! path, which re-posts an identical C list, does not pay:
//! without them the scope could not tell which request a completion (or a
//! flush after an error) retires, and so when the lent buffers are free.

mod buf;
mod buffers;
mod post;
mod prepared;
mod request;

use std::cell::RefCell;
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use crate::cq::{Cq, POLL_BATCH, WcOpcode, WcStatus, make_room, poll_exactly, poll_in_batches};
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::ring::{Caught, Ring, SlotMeta};
use crate::qp::queue::POST_CHUNK;
use crate::qp::state::{QpState, Rc};
use crate::qp::{Qp, QpCore};

pub use buf::{Dst, Src};
pub use buffers::{MAX_SCOPED_BUFFERS, ScopedBuffers};
pub use post::{ScopedListError, ScopedQp};
pub use prepared::PreparedSends;
pub use request::{ScopedCompletion, ScopedSend};

/// How long [`Cq::scope`] waits for the scope's requests by default before
/// moving their QPs to the error state.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// How long flushes may take after the move to the error state.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

const SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
/// What the QP keeps of scoped send requests, in a side table indexed like
/// the ring's slots: one entry per *range* of requests posted together with the
/// same opcode (a [`PreparedSends`] post), at the slot of its first request;
/// every other post is a range of one. Request `seq` of a range has the
/// `wr_id` `wr_id + (seq - self.seq)`.
///
/// Only range starts are written when posting; the slots of a range's other
/// requests keep stale entries, told apart by their `seq`. A completion
/// inside a range finds its start from the ring's tail (see
/// [`Posted::find`]) and, if the range goes on, writes the rest's start at
/// the next slot, so that a range's start always lies at or after the tail,
/// in a slot no post can reuse while the range is in flight.
///
/// Between posts no entry names a request at or after the queue's head: a
/// post that wrote entries for requests it then did not post (the provider
/// refused them, or the caller's iterator panicked) takes them back
/// ([`Posted::unstage`]). Otherwise a later range posted over the same
/// sequence numbers would meet them in its other slots and take them for
/// range starts.
#[derive(Clone, Copy)]
struct Posted {
    /// The `wr_id` of the range's first request.
    wr_id: u64,
    /// The sequence number of the range's first request (`u64::MAX`: never
    /// written).
    seq: u64,
    /// The opcode the completions report (`IBV_WC_*`, from what was posted:
    /// completions in error do not report one).
    wc_opcode: u32,
    /// Requests in the range.
    len: u32,
}

impl Default for Posted {
    fn default() -> Posted {
        Posted {
            wr_id: 0,
            seq: u64::MAX,
            wc_opcode: 0,
            len: 0,
        }
    }
}

impl Posted {
    /// Takes back the entries written for requests `from..to`, which were
    /// not posted (see the type's docs).
    ///
    /// # Safety
    /// `side` has `ring.slot_count()` entries and no other reference to it
    /// is live; `from..to` are at or after the queue's head and fewer than
    /// its depth, so their slots hold no entry of a request in flight.
    #[cold]
    unsafe fn unstage(side: *mut Posted, ring: &Ring, from: u64, to: u64) {
        for seq in from..to {
            // SAFETY: per the contract; `index` masks with the slot count.
            unsafe { *side.add(ring.index(seq)) = Posted::default() };
        }
    }

    /// The entry of send-queue request `seq` posted alone with `wr_opcode`.
    #[inline(always)]
    fn send(seq: u64, wr_id: u64, wr_opcode: u32) -> Posted {
        Posted {
            wr_id,
            seq,
            wc_opcode: SlotMeta::completion_opcode_of(wr_opcode),
            len: 1,
        }
    }

    /// What was posted as request `seq` (as a range of one), for its
    /// completion; `side` is the queue's side table, `low` the ring's tail
    /// before this completion (or the scope's first request, if later).
    ///
    /// Ranges tile the scope's requests in posting order, and a range in
    /// flight starts at or after the tail (see the type's docs), so a range
    /// starts at `low` and the next ones follow it: walk them to the one
    /// holding `seq`. Requests posted alone are found at once in their own
    /// slot.
    ///
    /// # Safety
    /// `side` has `ring.slot_count()` entries and no other reference to it
    /// is live; `seq` is a scoped request in flight, `low <= seq`.
    #[inline(always)]
    unsafe fn find(side: *mut Posted, ring: &Ring, seq: u64, low: u64) -> Posted {
        // SAFETY: per the contract; `index` masks with the slot count.
        unsafe {
            let mut start = *side.add(ring.index(seq));
            if start.seq != seq {
                let mut at = low;
                loop {
                    start = *side.add(ring.index(at));
                    if start.seq != at || start.len == 0 {
                        // Not reachable while the invariant holds; report
                        // the request with the entry its own slot has (no
                        // assertion: a panic while polling could end a
                        // scope before its requests).
                        return *side.add(ring.index(seq));
                    }
                    if seq - at < u64::from(start.len) {
                        break;
                    }
                    at += u64::from(start.len);
                }
            }
            let k = seq - start.seq;
            if u64::from(start.len) > k + 1 {
                // The range goes on after `seq`, which this completion
                // retires: its rest starts at the next slot.
                *side.add(ring.index(seq + 1)) = Posted {
                    wr_id: start.wr_id.wrapping_add(k + 1),
                    seq: seq + 1,
                    wc_opcode: start.wc_opcode,
                    len: start.len - (k as u32 + 1),
                };
            }
            Posted {
                wr_id: start.wr_id.wrapping_add(k),
                seq,
                wc_opcode: start.wc_opcode,
                len: 1,
            }
        }
    }
}

/// A QP's tables for scoped requests, allocated by its first scope and
/// reused by the next ones: no allocation per scope or per request.
pub(crate) struct ScopedTables {
    sq: Box<[Posted]>,
    /// The `wr_id` of each scoped receive, at its slot (receives are posted
    /// one at a time, so they need no ranges).
    rq: Box<[u64]>,
    /// C requests of one post call, zeroed once (see [`ScopedSend::fill`]).
    send_wrs: Box<[ffi::ibv_send_wr; POST_CHUNK]>,
    sges: Box<[ffi::ibv_sge; POST_CHUNK]>,
    /// One past the sequence number of the last signaled scoped send posted
    /// (0: none): the scope's end tells an unsignaled tail by it.
    sig_end: u64,
}

// SAFETY: plain data; the raw pointers inside the C requests are only
// written and read during a post call on the QP's owner thread.
unsafe impl Send for ScopedTables {}
// SAFETY: as above; `&ScopedTables` gives no access to anything.
unsafe impl Sync for ScopedTables {}

impl ScopedTables {
    fn new(core: &QpCore) -> ScopedTables {
        ScopedTables {
            sq: vec![Posted::default(); core.sq.slot_count()].into_boxed_slice(),
            rq: vec![0; core.rq.slot_count()].into_boxed_slice(),
            send_wrs: Box::new([ffi::ibv_send_wr::default(); POST_CHUNK]),
            sges: Box::new([ffi::ibv_sge::default(); POST_CHUNK]),
            sig_end: 0,
        }
    }
}

/// One queue of an attached QP that completes on the scope's CQ.
struct Watch {
    /// The ring's tag (high half of its tokens).
    tag: u32,
    /// The QP number its completions carry.
    qp_num: u32,
    /// The first sequence number of the scope: requests before it were
    /// posted by the ownership-passing path.
    start: u64,
    /// Slots below this may hold ownership-passing requests (or a drain
    /// marker) that a scoped completion sweeps.
    owned_end: u64,
}

struct Attached {
    core: NonNull<QpCore>,
    sq: Option<Watch>,
    rq: Option<Watch>,
}

/// The scope of [`Cq::scope`]: attach QPs, post borrowed buffers, poll.
///
/// Neither `Send` nor `Sync`: everything happens on the thread that called
/// `Cq::scope`.
pub struct Scope<'scope, 'env: 'scope> {
    cq: NonNull<Cq>,
    attached: RefCell<Vec<Attached>>,
    drain_timeout: std::cell::Cell<Duration>,
    /// Invariant in both lifetimes, like `std::thread::Scope`.
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl Cq {
    /// Runs `f` in a scope where requests posted on QPs of this CQ borrow
    /// their buffers ([`Src`], [`Dst`]) instead of moving them, and returns
    /// what `f` returned once every request posted in the scope has
    /// completed. See the [module docs](crate::qp::scope) for the design.
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
            drain_timeout: std::cell::Cell::new(DEFAULT_DRAIN_TIMEOUT),
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
        let sq_ok = std::ptr::eq(std::sync::Arc::as_ptr(&core.send_cq), cq_inner);
        let rq_ok =
            std::ptr::eq(std::sync::Arc::as_ptr(&core.recv_cq), cq_inner) && core.srq.is_none();
        if !sq_ok && !rq_ok {
            return Err(Error::InvalidArgument {
                what: "scoped QP",
                reason: "neither of its queues completes on the scope's CQ".into(),
            });
        }
        if sq_ok && core.caps.max_send_sge == 0 {
            // Scoped sends carry one SGE, written by the extended API's
            // builders without a check against the QP's capacity.
            return Err(Error::InvalidArgument {
                what: "scoped QP",
                reason: "its send queue takes no scatter/gather entry (max_send_sge 0)".into(),
            });
        }
        if core.scoped.is_none() {
            core.scoped = Some(Box::new(ScopedTables::new(core)));
        }
        let watch = |ok: bool, ring: &crate::ledger::ring::Ring, head: u64| {
            ok.then(|| Watch {
                tag: ring.tag(),
                qp_num: ring.qp_num(),
                start: head,
                owned_end: head,
            })
        };
        let attached = Attached {
            sq: watch(sq_ok, &core.sq, core.sq_head),
            rq: watch(rq_ok, &core.rq, core.rq_head),
            core: NonNull::from(&mut *core),
        };
        let ptr = attached.core;
        self.attached.borrow_mut().push(attached);
        Ok(ScopedQp::new(ptr, sq_ok, rq_ok))
    }

    /// How long the end of the scope waits for outstanding requests before
    /// flushing their QPs ([`DEFAULT_DRAIN_TIMEOUT`] unless set). A timeout
    /// past what `Instant` can hold (`Duration::MAX`) waits without limit
    /// for requests that can still complete; sends that are all unsignaled
    /// (which never complete when they succeed) are flushed after
    /// [`DEFAULT_DRAIN_TIMEOUT`] all the same.
    pub fn set_drain_timeout(&self, timeout: Duration) {
        self.drain_timeout.set(timeout);
    }

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
            resume_unwind(p);
        }
        r
    }

    /// Polls up to `want` completions (at most `out`'s spare capacity).
    fn poll_into(
        &self,
        attached: &[Attached],
        out: &mut Vec<ScopedCompletion>,
        want: usize,
        caught: &mut Caught,
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

    /// Waits for every scoped request, flushing QPs that do not finish in
    /// time. Returns the outcome and a panic caught while releasing
    /// buffers of the ownership-passing path on the way.
    fn drain(&self) -> (Result<()>, Caught) {
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
            let sq_left = pending(a.sq.as_ref(), &core.sq, core.sq_head);
            let rq_left = pending(a.rq.as_ref(), &core.rq, core.rq_head);
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
    /// only a flush can retire them, also without a deadline.
    fn wait(
        &self,
        attached: &[Attached],
        scratch: &mut Vec<ScopedCompletion>,
        caught: &mut Caught,
        mut failed: Option<&mut Option<Error>>,
        deadline: Option<Instant>,
    ) -> bool {
        let mut tails_since = None;
        // A deadline already past (a drain timeout of 0) still polls once:
        // completions already in the CQ retire their requests.
        let mut polled = false;
        loop {
            let (mut left, mut awaited) = (0, 0);
            for a in attached {
                // SAFETY: as in `drain`; read-only.
                let core = unsafe { a.core.as_ref() };
                let sq = pending(a.sq.as_ref(), &core.sq, core.sq_head);
                let rq = pending(a.rq.as_ref(), &core.rq, core.rq_head);
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
            if polled && (tails_only || deadline.is_some_and(|d| now > d)) {
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
struct AbortOnUnwind;

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

/// Whether every send outstanding on the QP is unsignaled (none of those
/// the scope posted after its last signaled send has been retired by it).
fn unsignaled_tail(core: &QpCore) -> bool {
    !core.caps.sq_sig_all
        && core
            .scoped
            .as_ref()
            .is_some_and(|t| t.sig_end <= core.sq.tail())
}

/// Scoped requests of a watched queue still outstanding: none if nothing
/// was posted in the scope, else everything up to its head (earlier
/// requests complete before the scope's, in order).
fn pending(w: Option<&Watch>, ring: &crate::ledger::ring::Ring, head: u64) -> u64 {
    match w {
        Some(w) if head > w.start => head - ring.tail().max(w.start).min(head),
        _ => 0,
    }
}

/// Interprets one completion polled by a scope: a scoped request's is
/// written light to `out` (and true returned); anything else is kept in the
/// CQ for its next poll.
///
/// # Safety
/// `wc` was returned by `ibv_poll_cq` on `cq`, whose only consumer the
/// caller is; the attached QPs are live and not being posted to; `out` is
/// valid for a write.
#[inline(always)]
unsafe fn interpret(
    cq: &mut Cq,
    attached: &[Attached],
    wc: *const ffi::ibv_wc,
    caught: &mut Caught,
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
        cq.stash(wc, caught, lost);
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
    a: &Attached,
    w: &Watch,
    wc: *const ffi::ibv_wc,
    caught: &mut Caught,
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
            cq.stash(wc, caught, lost);
            return false;
        }
        if ring.retire_through(seq, w.owned_end, caught, lost) {
            return false; // the drain marker
        }
        let Some(tables) = core.scoped.as_deref_mut() else {
            return false;
        };
        // The side tables have the ring's slot count; `seq` is in flight and
        // at or after both the old tail and the scope's start.
        let p = if RECV {
            Posted {
                wr_id: *tables.rq.get_unchecked(ring.index(seq)),
                seq,
                wc_opcode: ffi::IBV_WC_RECV,
                len: 1,
            }
        } else {
            Posted::find(tables.sq.as_mut_ptr(), ring, seq, tail.max(w.start))
        };
        light(wc, p, RECV, out);
        true
    }
}

/// Writes the light completion of a scoped request to `out`.
///
/// # Safety
/// As `Completion::write_from_wc`: only fields valid for the status and
/// opcode are read; `out` is valid for a write.
#[inline(always)]
unsafe fn light(wc: *const ffi::ibv_wc, p: Posted, recv: bool, out: *mut ScopedCompletion) {
    // SAFETY: per the contract.
    unsafe {
        let raw_status = (*wc).status;
        if raw_status != ffi::IBV_WC_SUCCESS {
            return failed(wc, p, out);
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

/// Writes the light completion of a failed (or flushed) scoped request.
///
/// # Safety
/// As [`light`].
#[cold]
#[inline(never)]
unsafe fn failed(wc: *const ffi::ibv_wc, p: Posted, out: *mut ScopedCompletion) {
    // SAFETY: per the contract; status, vendor_err and qp_num are valid
    // for every completion.
    unsafe {
        out.write(ScopedCompletion {
            wr_id: p.wr_id,
            status: WcStatus::from_raw((*wc).status),
            opcode: WcOpcode::from_raw(p.wc_opcode),
            byte_len: 0,
            imm_data: None,
            qp_num: (*wc).qp_num,
            vendor_err: (*wc).vendor_err,
        });
    }
}
