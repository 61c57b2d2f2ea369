//! Posting in a scope: [`ScopedQp`].

use std::marker::PhantomData;
use std::ptr::NonNull;

use super::chunk::{post_in_chunks, post_send_chunk};
use super::listing::nested_post;
use super::prepared::{
    post_prepared_chain, post_prepared_ex, settle_refused_prepared, stage_prepared,
};
use super::side_table::PostedRange;
use super::{Dst, PreparedSends, ScopedBuffers};
use super::{SIGNALED, ScopedSend};
use crate::error::{Error, Result, errno};
use crate::ffi;
use crate::mr::Mr;
use crate::qp::post;
use crate::qp::state::{CanPostRecv, CanPostSend, QpState, Rc};
use crate::qp::{Qp, QpCore};

/// A QP attached to a [`Scope`](super::Scope): posts requests that borrow their buffers
/// for `'scope`.
pub struct ScopedQp<'scope, S: QpState> {
    core: NonNull<QpCore>,
    sq_in_scope: bool,
    rq_in_scope: bool,
    _qp: PhantomData<&'scope mut Qp<Rc, S>>,
    /// Invariant in `'scope`: were it covariant, the handle could be
    /// shortened to a lifetime inside the closure and post buffers borrowed
    /// only there (`tests/ui/scope_touch_lent_destination.rs`).
    _invariant: PhantomData<fn(&'scope ()) -> &'scope ()>,
    /// Not `Send`: the scope reads the QP's counters on its own thread.
    _not_send: PhantomData<*mut ()>,
}

/// A [`ScopedQp::post_send_list`] stopped at a refused request.
#[derive(Debug, thiserror::Error)]
#[error("{error} (after {posted} requests of the list were posted)")]
pub struct ScopedListError {
    /// Requests from the start of the list that were posted (they complete
    /// as usual). When the provider refuses a chain without saying which
    /// request it stopped at, the whole chain counts as posted: the scope
    /// waits for it, or flushes it.
    pub posted: usize,
    /// Why the next one was not.
    pub error: Error,
}

impl From<ScopedListError> for Error {
    fn from(e: ScopedListError) -> Error {
        e.error
    }
}

impl<'scope, S: QpState> ScopedQp<'scope, S> {
    /// The handle of a QP the scope attached; `sq_in_scope` / `rq_in_scope`: its send /
    /// receive queue completes on the scope's CQ.
    pub(super) fn new(
        core: NonNull<QpCore>,
        sq_in_scope: bool,
        rq_in_scope: bool,
    ) -> ScopedQp<'scope, S> {
        ScopedQp {
            core,
            sq_in_scope,
            rq_in_scope,
            _qp: PhantomData,
            _invariant: PhantomData,
            _not_send: PhantomData,
        }
    }

    /// The core of the QP this handle posts on.
    pub(super) fn core_ptr(&self) -> NonNull<QpCore> {
        self.core
    }

    /// The same handle for the QP in state `S2`, once a transition moved it
    /// there (only for a QP the scope owns: see `adopt.rs`).
    pub(super) fn retype<S2: QpState>(self) -> ScopedQp<'scope, S2> {
        ScopedQp::new(self.core, self.sq_in_scope, self.rq_in_scope)
    }

    /// Posts one send-queue request.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the send queue has no free slot (poll
    /// first); [`Error::RemoteOutOfBounds`] / [`Error::InvalidArgument`] for
    /// a request that does not fit its remote region or operation;
    /// [`Error::InvalidArgument`] when the QP's send queue does not complete
    /// on the scope's CQ; [`Error::Verb`] when the provider refuses it (when
    /// it does not say that the request stayed out of the queue, as a failed
    /// `ibv_wr_complete` does not, the request counts as posted: the scope
    /// waits for it or flushes it at its end).
    #[inline(always)]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, req: &ScopedSend<'scope>) -> Result<()>
    where
        S: CanPostSend,
    {
        // SAFETY: the QP is borrowed for 'scope by this handle; the scope
        // reads it only between calls on this same thread (neither is Send
        // or Sync), so this is the only live reference.
        let core = unsafe { self.core.as_mut() };
        let head = core.sq_head;
        let ring = &*core.sq;
        let (in_flight, depth) = (ring.in_flight(head), ring.depth());
        let tables = match core.ext.scoped.as_deref_mut() {
            Some(t)
                if self.sq_in_scope
                    && in_flight < depth
                    && req.plainly_valid()
                    && !t.sq_listing =>
            {
                t
            }
            // By value: a reference escaping into the cold call would keep
            // the request in memory on the hot path too.
            _ => return Err(self.send_refused(*req)),
        };
        let mut flags = req.flags | tables.fence_for(req.opcode);
        if in_flight + 1 == depth && !core.caps.sq_sig_all {
            // The last free slot: ask for a completion so the queue drains.
            flags |= SIGNALED;
        }
        let i = ring.index(head);
        // SAFETY: `index` masks with the ring's slot count, the table's length.
        unsafe { *tables.sq.get_unchecked_mut(i) = PostedRange::send(head, req.wr_id, req.opcode) };
        if let Some(ex) = core.ext.send_ex.as_ref() {
            // SAFETY: one well-formed request whose SGE names memory
            // borrowed for 'scope, which outlives every request posted in the
            // scope.
            match unsafe { ex.post_one(&req.ex_request(ring.token(head), flags)) } {
                Some(0) => {
                    core.sq_head = head + 1;
                    if flags & SIGNALED != 0 {
                        tables.sig_end = head + 1;
                    }
                    return Ok(());
                }
                // A failed `ibv_wr_complete` does not say that the request
                // stayed out of the queue (`send_ex`'s module docs): counted
                // as posted, as a legacy refusal that names no request.
                Some(rc) => {
                    core.sq_head = head + 1;
                    if flags & SIGNALED != 0 {
                        tables.sig_end = head + 1;
                    }
                    return Err(core.send_refused(rc, req.opcode));
                }
                None => {}
            }
        }
        let sig_end = tables.sig_end;
        if flags & SIGNALED != 0 {
            // Before the post: a refused one may count as posted below.
            tables.sig_end = head + 1;
        }
        let wr = &mut tables.send_wrs[0];
        let mut sge = req.sge;
        req.fill(wr, ring.token(head), flags, &mut sge);
        wr.next = std::ptr::null_mut();
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; one well-formed request whose SGE (on this
        // stack frame during the call) names memory borrowed for 'scope,
        // which outlives every request posted in the scope.
        // (An extended QP took the request above unless its opcode has no
        // builder here: then this is the right verb for it too.)
        let rc = unsafe { post::ibv_post_send(core.raw.as_ptr(), wr, &mut bad) };
        if rc != 0 {
            // As in a list: a provider that does not say it refused the
            // request may own it; count it as posted.
            if post::bad_index(bad, wr as *mut ffi::ibv_send_wr, 1).is_none() {
                core.sq_head = head + 1;
            } else {
                // SAFETY: the entry written above, for the head.
                unsafe { PostedRange::unstage(tables.sq.as_mut_ptr(), ring, head, head + 1) };
                tables.sig_end = sig_end;
            }
            return Err(core.send_refused(rc, req.opcode));
        }
        core.sq_head = head + 1;
        Ok(())
    }

    /// Why [`post_send`](ScopedQp::post_send) refused `req`.
    #[cold]
    #[inline(never)]
    fn send_refused(&self, req: ScopedSend<'scope>) -> Error {
        // SAFETY: as in `post_send`; read-only.
        let core = unsafe { self.core.as_ref() };
        if !self.sq_in_scope || core.ext.scoped.is_none() {
            return not_on_scope_cq("send", 0).error;
        }
        if core.ext.scoped.as_ref().is_some_and(|t| t.sq_listing) {
            return nested_post(false);
        }
        let depth = core.sq.depth();
        if core.sq.in_flight(core.sq_head) >= depth {
            return Error::QueueFull {
                queue: "send",
                depth: depth as u32,
            };
        }
        req.refusal()
    }

    /// Posts requests as chained lists, one `ibv_post_send` per 32 (build
    /// them in the iterator: nothing is copied on the way). On a refused
    /// request the ones before it are posted (and complete as usual) and
    /// the iterator is not pulled further. Nothing is committed before the
    /// verb accepts a chain, so a panicking iterator leaves the queue as it
    /// was.
    ///
    /// # Errors
    /// As [`post_send`](ScopedQp::post_send), with how many were posted.
    #[inline(always)]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_list(
        &mut self,
        reqs: impl IntoIterator<Item = ScopedSend<'scope>>,
    ) -> std::result::Result<(), ScopedListError>
    where
        S: CanPostSend,
    {
        if !self.sq_in_scope {
            return Err(not_on_scope_cq("send", 0));
        }
        let mut reqs = reqs.into_iter();
        // The QP is passed by pointer: the caller's iterator may poll the
        // scope, which reads and writes the QP's core, so no reference to it
        // may live while the iterator runs.
        post_in_chunks(|| post_send_chunk(self.core, &mut reqs))
    }

    /// Posts a [`PreparedSends`] list with one doorbell (one critical region
    /// of the extended send API, or one `ibv_post_send`); request `j` of the
    /// list gets the `wr_id` `first_wr_id + j` (wrapping). All or nothing: a
    /// list that does not fit in the free slots is refused whole.
    ///
    /// When the same list would not fit again before a completion, its last
    /// request asks for one even if it was built unsignaled, so that a list
    /// posted again and again cannot fill the queue with requests nothing
    /// retires. A *longer* list refused while every request in flight is
    /// unsignaled waits for nothing: post a signaled request first.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when fewer slots than the list's length are
    /// free (poll first); [`Error::InvalidArgument`] when the QP's send
    /// queue does not complete on the scope's CQ; [`Error::Verb`] when the
    /// provider refuses it (with `ibv_post_send`, the requests before the one
    /// it names were posted; when it names none, and with the extended send
    /// API, the whole list counts as posted, since the verb's failure does not
    /// say that it stayed out of the queue: the scope waits for it).
    #[inline(always)]
    #[doc(alias = "ibv_post_send")]
    pub fn post_prepared(&mut self, list: &PreparedSends<'scope>, first_wr_id: u64) -> Result<()>
    where
        S: CanPostSend,
    {
        // SAFETY: as in `post_send`.
        let core = unsafe { self.core.as_mut() };
        let head = core.sq_head;
        let ring = &*core.sq;
        let n = list.len() as u64;
        let (in_flight, depth) = (ring.in_flight(head), ring.depth());
        let tables = match core.ext.scoped.as_deref_mut() {
            Some(t) if self.sq_in_scope && in_flight + n <= depth && !t.sq_listing => t,
            _ => return Err(self.prepared_refused(n)),
        };
        let side = tables.sq.as_mut_ptr();
        // SAFETY: the QP's side table, which nothing else references now;
        // the list fits in the free slots from the head.
        unsafe { stage_prepared(side, ring, list, head, first_wr_id) };
        // Ask for a completion when the same list would not fit again until
        // one comes (this one taking the last free slot among them): a queue
        // holding only unsignaled requests would never drain.
        let force = in_flight + 2 * n > depth && list.sig_end() != n && !core.caps.sq_sig_all;
        let (sig_end, list_sig) = (tables.sig_end, if force { n } else { list.sig_end() });
        if list_sig > 0 {
            // Before the post; taken back below for what is not posted.
            tables.sig_end = head + list_sig;
        }
        // Tokens of head + j are `tag | (low + j)`, as Ring::token computes.
        let tag = u64::from(ring.tag()) << 32;
        let low = head as u32;
        debug_assert_eq!(tag | u64::from(low), ring.token(head));
        // Not with the iWARP fence (`ScopedTables::fence`): the builders'
        // requests carry only each request's own flags; the chain sets it.
        if let Some(ex) = core.ext.send_ex.as_ref().filter(|_| tables.fence == 0) {
            // SAFETY: ex is the QP's extended interface.
            match unsafe { post_prepared_ex(ex, list, force, tag, low) } {
                Some(0) => {
                    core.sq_head = head + n;
                    return Ok(());
                }
                // Counted as posted: a failed `ibv_wr_complete` does not say
                // that the list stayed out of the queue (`send_ex`'s docs).
                Some(rc) => {
                    core.sq_head = head + n;
                    return Err(Error::verb("ibv_post_send", errno(rc)));
                }
                // Not reached with the operations a scoped request has; the
                // C chain below still posts it.
                None => {}
            }
        }
        let fence = tables.fence;
        // SAFETY: the core is the QP's, valid for the scope.
        if let Err((rc, ok)) = unsafe { post_prepared_chain(core, list, force, fence, tag, low) } {
            // SAFETY: `side` is the QP's side table, with the entries
            // written above.
            unsafe { settle_refused_prepared(core, side, list, head, sig_end, ok) };
            return Err(Error::verb("ibv_post_send", errno(rc)));
        }
        core.sq_head = head + n;
        Ok(())
    }

    /// Why [`post_prepared`](ScopedQp::post_prepared) refused a list of `n`.
    #[cold]
    #[inline(never)]
    fn prepared_refused(&self, n: u64) -> Error {
        // SAFETY: as in `post_send`; read-only.
        let core = unsafe { self.core.as_ref() };
        if !self.sq_in_scope || core.ext.scoped.is_none() {
            return not_on_scope_cq("send", 0).error;
        }
        if core.ext.scoped.as_ref().is_some_and(|t| t.sq_listing) {
            return nested_post(false);
        }
        let depth = core.sq.depth();
        if n > depth {
            return Error::InvalidArgument {
                what: "prepared list",
                reason: format!("{n} requests do not fit a send queue of {depth}"),
            };
        }
        Error::QueueFull {
            queue: "send",
            depth: depth as u32,
        }
    }

    /// Posts a receive into `dst`.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the receive queue is full;
    /// [`Error::InvalidArgument`] when the QP's receives do not complete on
    /// the scope's CQ (or come from a shared receive queue);
    /// [`Error::Verb`] when the provider refuses it.
    #[inline(always)]
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, wr_id: u64, dst: Dst<'scope>) -> Result<()>
    where
        S: CanPostRecv,
    {
        // SAFETY: as in `post_send`.
        let core = unsafe { self.core.as_mut() };
        let head = core.rq_head;
        let ring = &*core.rq;
        let tables = match core.ext.scoped.as_deref_mut() {
            Some(t) if self.rq_in_scope && ring.in_flight(head) < ring.depth() && !t.rq_listing => {
                t
            }
            _ => return Err(self.recv_refused()),
        };
        // SAFETY: `index` masks with the ring's slot count, the table's length.
        unsafe { *tables.rq.get_unchecked_mut(ring.index(head)) = wr_id };
        let mut sge = dst.sge;
        let mut wr = ffi::ibv_recv_wr {
            wr_id: ring.token(head),
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: i32::from(sge.length != 0),
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; the SGE names memory borrowed exclusively for
        // 'scope, which outlives every request posted in the scope.
        let rc = unsafe { post::ibv_post_recv(core.raw.as_ptr(), &mut wr, &mut bad) };
        // As for sends: a provider that does not say it refused the receive
        // may own it; count it as posted, so that the scope waits for (or
        // flushes) it.
        if rc == 0 || post::bad_index(bad, &raw mut wr, 1).is_none() {
            core.rq_head = head + 1;
        }
        if rc != 0 {
            return Err(Error::verb("ibv_post_recv", errno(rc)));
        }
        Ok(())
    }

    /// Carves `mr` into `mr.len() / buf_len` buffers of this QP for the rest
    /// of the scope, lent to the NIC one request at a time (a receive, a
    /// SEND or a WRITE, posted by index) and readable and writable between
    /// requests. See [`ScopedBuffers`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mr` lacks
    /// [`AccessFlags::LOCAL_WRITE`](crate::mr::AccessFlags::LOCAL_WRITE), is
    /// registered in another PD than the QP's, holds no buffer of `buf_len`
    /// bytes (1 to 4 GiB − 1) or more than [`MAX_SCOPED_BUFFERS`](super::MAX_SCOPED_BUFFERS).
    pub fn buffers(&self, mr: &'scope mut Mr, buf_len: usize) -> Result<ScopedBuffers<'scope, S>> {
        ScopedBuffers::new(self.core, self.sq_in_scope, self.rq_in_scope, mr, buf_len)
    }

    /// Why [`post_recv`](ScopedQp::post_recv) refused.
    #[cold]
    #[inline(never)]
    fn recv_refused(&self) -> Error {
        // SAFETY: as in `post_send`; read-only.
        let core = unsafe { self.core.as_ref() };
        if !self.rq_in_scope || core.ext.scoped.is_none() {
            return not_on_scope_cq("receive", 0).error;
        }
        if core.ext.scoped.as_ref().is_some_and(|t| t.rq_listing) {
            return nested_post(true);
        }
        Error::QueueFull {
            queue: "receive",
            depth: core.rq.depth() as u32,
        }
    }

    /// Requests posted on the send and receive queue that have not been
    /// retired by a polled completion yet, as `(send, receive)`.
    pub fn outstanding(&self) -> (u64, u64) {
        // SAFETY: as in `post_send_list`; read-only.
        let core = unsafe { self.core.as_ref() };
        (
            core.sq.in_flight(core.sq_head),
            core.rq.in_flight(core.rq_head),
        )
    }
}

#[cold]
pub(super) fn not_on_scope_cq(queue: &str, posted: usize) -> ScopedListError {
    ScopedListError {
        posted,
        error: Error::InvalidArgument {
            what: "scoped post",
            reason: format!(
                "this QP's {queue} queue does not complete on the scope's CQ (or takes its \
                 receives from a shared receive queue)"
            ),
        },
    }
}
