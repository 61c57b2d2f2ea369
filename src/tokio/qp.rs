//! [`AsyncQp`]: awaitable operations on a QP whose CQs are [`AsyncCq`]s.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::cq::{AsyncCq, Shared};
use super::op::Operation;
use super::waiters::{NO_SLOT, wr_id};
use crate::channel::CqId;
use crate::cq::Completion;
use crate::error::Error;
use crate::mr::{Mr, RemoteMr};
use crate::qp::{CanPostRecv, CanPostSend, Connected};
use crate::qp::{PostError, Qp, QpState, QpType, Rc, RecvWr, SendWr, Sges};

/// A QP whose operations are futures that resolve to their [`Completion`]
/// (with the buffers back).
///
/// Built from a [`Qp`] created on the CQs of [`AsyncCq`]s and with nothing
/// outstanding; from then on every request goes through this wrapper, which
/// numbers them itself (the `wr_id` you give is replaced; read the
/// completion's `wr_id` to match requests posted with the `post_*` methods).
/// A `wr_id` is the request's number shifted left by 24 bits, the low 24
/// naming an awaited request's slot in its CQ's waiter slab (all ones for
/// `post_*`): `wr_id >> 24` counts the QP's requests, and `wr_id`s grow
/// with it.
/// All methods take `&self`: share it between tasks with an `Arc`.
///
/// # Cancel safety
/// An operation is posted when its future is first polled. Dropping the
/// future before that drops the request and its buffers (nothing was posted).
/// Dropping it after that (a `tokio::time::timeout` firing, a `select!` arm
/// losing) never frees or exposes the posted buffers: the QP owns them until
/// the request completes, and the completion, with the buffers, is then
/// returned by [`AsyncCq::next`] of the CQ it completed on. A posted future
/// that is forgotten (`mem::forget`) keeps its completion until the
/// `AsyncQp` is unwrapped or dropped; then it goes to `next` too. A post
/// the provider refuses without saying that the request stayed out of the
/// queue (a failed `ibv_wr_complete`) fails with no buffers in its
/// [`PostError`]: the request counts as posted, and its completion, if one
/// comes, is returned by `next` with them. Dropping
/// the `AsyncQp` destroys the QP and releases every buffer still posted, as
/// dropping a [`Qp`] does.
pub struct AsyncQp<T: QpType, S: QpState> {
    // Field order is drop order: the books free what forgotten futures kept
    // registered while the QP still holds its number (a QP created later may
    // get it), then the QP is destroyed.
    books: Parts,
    qp: Mutex<Qp<T, S>>,
}

/// The error of a refused [`AsyncQp::new`], the QP it gave back dropped: so
/// `AsyncQp::new(qp, &cq, &cq)?` works where a [`Result`](crate::Result) is
/// returned.
impl<T: QpType, S: QpState> From<(Error, Qp<T, S>)> for Error {
    fn from((error, _qp): (Error, Qp<T, S>)) -> Error {
        error
    }
}

impl<T: QpType, S: QpState> AsyncQp<T, S> {
    /// Wraps `qp`, whose send queue completes on `send_cq` and receive queue
    /// on `recv_cq` (the same `AsyncCq` for both is common).
    ///
    /// Refused, with the QP back, if its CQs are not those, if it has work
    /// outstanding ([`Error::WorkOutstanding`]): the completions of requests
    /// numbered before the wrapper could be confused with its own, or if it
    /// is called from inside the driver's poll (a buffer's `Drop`:
    /// [`Error::InvalidArgument`], since the check needs the CQ's lock).
    /// `?` in a function returning [`Result`](crate::Result) takes the error
    /// and drops the QP.
    #[allow(clippy::result_large_err)]
    pub fn new(
        qp: Qp<T, S>,
        send_cq: &AsyncCq,
        recv_cq: &AsyncCq,
    ) -> std::result::Result<AsyncQp<T, S>, (Error, Qp<T, S>)> {
        let (s, r) = qp.cq_raws();
        if CqId::from_raw(s) != send_cq.id() || CqId::from_raw(r) != recv_cq.id() {
            return Err((
                Error::InvalidArgument {
                    what: "AsyncQp::new",
                    reason: "the QP was not created on these AsyncCqs' CQs".into(),
                },
                qp,
            ));
        }
        // Under the CQs' locks: the driver polls and dispatches under them,
        // so a completion it retired (outstanding no longer counts it) has
        // reached its waiter or `next` before this check passes, and cannot
        // be taken for a request of this wrapper numbered like it (plain
        // posts choose their own wr_ids).
        // In address order, so that two threads wrapping QPs on the same two
        // CQs in opposite roles cannot hold one each and wait for the other.
        let (first, second) = if recv_cq.id().0 < send_cq.id().0 {
            (recv_cq, send_cq)
        } else {
            (send_cq, recv_cq)
        };
        let first_lock = first.shared().cq_patiently();
        let second_lock = (first.id() != second.id()).then(|| second.shared().cq_patiently());
        if first_lock.is_none() || matches!(second_lock, Some(None)) {
            return Err((
                Error::InvalidArgument {
                    what: "AsyncQp::new",
                    reason: "its AsyncCq's completion driver held the CQ for 2 s (called from \
                             code that runs inside the driver's poll, such as a buffer's Drop?)"
                        .into(),
                },
                qp,
            ));
        }
        let (sends, recvs) = qp.outstanding();
        drop((first_lock, second_lock));
        if sends + recvs > 0 {
            let (queue, count) = if sends > 0 {
                ("send", sends)
            } else {
                ("receive", recvs)
            };
            return Err((Error::WorkOutstanding { queue, count }, qp));
        }
        Ok(AsyncQp {
            books: Parts {
                qp_num: qp.qp_num(),
                // Where the QP's previous wrapper (if any) stopped: its requests'
                // completions may not all be dispatched yet.
                next_id: AtomicU64::new(qp.async_next_id()),
                send: send_cq.shared().clone(),
                recv: recv_cq.shared().clone(),
            },
            qp: Mutex::new(qp),
        })
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.books.qp_num
    }

    /// The QP, read-only (`query`, `endpoint`, `caps`, `outstanding`): every
    /// post goes through the wrapper, which numbers its requests, so that no
    /// completion can be taken for another request's.
    ///
    /// The `QpRef` holds the lock every post of this wrapper takes: read
    /// what you need and drop it, never keep it across an `.await` (a post
    /// of the same task, or of another on the same thread, would wait for it
    /// for ever). [`qp_num`](Self::qp_num) takes no lock.
    pub fn qp(&self) -> QpRef<'_, T, S> {
        QpRef(self.lock())
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Qp<T, S>> {
        self.qp.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves the QP to ERR ([`Qp::to_error`]): every outstanding request is
    /// flushed; awaited ones resolve with `WR_FLUSH_ERR` and their buffers.
    ///
    /// # Errors
    /// `ibv_modify_qp`'s, should the kernel refuse ERR (a device gone, say);
    /// the QP is then dropped, which destroys it and releases what it held,
    /// as dropping the `AsyncQp` does.
    pub fn to_error(self) -> Result<AsyncQp<T, crate::qp::ErrorState>, Error>
    where
        S: crate::qp::CanMoveToError,
    {
        let (qp, parts) = self.into_parts();
        match qp.to_error() {
            Ok(qp) => Ok(AsyncQp::from_parts(qp, parts)),
            Err(e) => {
                // The books first, while the QP (in `e`) holds its number.
                drop(parts);
                Err(e.error)
            }
        }
    }

    /// Unwraps the QP. Requests still outstanding complete through
    /// [`AsyncCq::next`] (those of forgotten futures too), and a later post
    /// on the QP may choose any `wr_id`.
    pub fn into_inner(self) -> Qp<T, S> {
        self.into_parts().0
    }

    /// The QP and the wrapper's books, for a state change that awaits.
    pub(crate) fn into_parts(self) -> (Qp<T, S>, Parts) {
        let mut qp = self.qp.into_inner().unwrap_or_else(|e| e.into_inner());
        qp.set_async_next_id(self.books.next_id.load(Ordering::Relaxed));
        (qp, self.books)
    }

    /// Puts [`into_parts`](Self::into_parts) back together (same QP).
    pub(crate) fn from_parts(qp: Qp<T, S>, books: Parts) -> AsyncQp<T, S> {
        AsyncQp {
            qp: Mutex::new(qp),
            books,
        }
    }

    /// The next request number.
    fn seq(&self) -> u64 {
        self.books.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The `wr_id` of a request nobody awaits: its number, no slot.
    fn id(&self) -> u64 {
        wr_id(self.seq(), NO_SLOT)
    }
}

impl<T: Connected, S: CanPostRecv> AsyncQp<T, S> {
    /// Posts a receive and waits for its completion (a message arrived, or
    /// the receive was flushed). Waits for room when the receive queue is full.
    pub fn recv(
        &self,
        wr: RecvWr,
    ) -> impl Future<Output = std::result::Result<Completion, PostError>> + Send + Unpin + '_ {
        Operation::new(self, &self.books.recv, self.seq(), wr)
    }

    /// A receive into the whole of `buf`: `recv(RecvWr::new(_, buf))`.
    pub fn recv_into(
        &self,
        buf: Mr,
    ) -> impl Future<Output = std::result::Result<Completion, PostError>> + Send + Unpin + '_ {
        self.recv(RecvWr::new(0, buf))
    }

    /// Posts a receive whose completion nobody awaits: it comes back from
    /// [`AsyncCq::next`]. Returns the `wr_id` it was given. Does not wait for
    /// room ([`Error::QueueFull`] instead).
    pub fn post_recv(&self, mut wr: RecvWr) -> std::result::Result<u64, PostError> {
        let id = self.id();
        wr.wr_id = id;
        self.lock().post_recv(wr).map(|()| id)
    }
}

impl<S: CanPostSend> AsyncQp<Rc, S> {
    /// Posts a send-queue request (SEND, WRITE, READ, atomic; made signaled)
    /// and waits for its completion. Waits for room when the send queue is full.
    pub fn post<'a>(
        &'a self,
        mut wr: SendWr<'a>,
    ) -> impl Future<Output = std::result::Result<Completion, PostError>> + Send + Unpin + 'a {
        wr.flags |= crate::ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        Operation::new(self, &self.books.send, self.seq(), wr)
    }

    /// SENDs the whole of `src` and waits for its completion.
    pub fn send(
        &self,
        src: impl Into<crate::qp::Buffer>,
    ) -> impl Future<Output = std::result::Result<Completion, PostError>> + Send + Unpin + '_ {
        self.post(SendWr::send_from(0, src))
    }

    /// RDMA WRITEs the whole of `src` to `remote` at `offset`.
    pub fn write(
        &self,
        src: impl Into<crate::qp::Buffer>,
        remote: RemoteMr,
        offset: u64,
    ) -> impl Future<Output = std::result::Result<Completion, PostError>> + Send + Unpin + '_ {
        self.post(SendWr::write_from(0, src, remote, offset))
    }

    /// RDMA READs `dest`'s length from `remote` at `offset` into `dest`, an
    /// [`Mr`] or a part of one ([`Mr::range`], [`SendWr::read`]).
    pub fn read(
        &self,
        dest: impl Into<crate::qp::Buffer>,
        remote: RemoteMr,
        offset: u64,
    ) -> impl Future<Output = std::result::Result<Completion, PostError>> + Send + Unpin + '_ {
        self.post(SendWr::read(0, dest, remote, offset))
    }

    /// Posts a send-queue request whose completion (if signaled) nobody
    /// awaits: it comes back from [`AsyncCq::next`]. Returns the `wr_id` it
    /// was given. Does not wait for room ([`Error::QueueFull`] instead).
    // Inlined and posted in place: moving the request on copies all of it.
    #[inline(always)]
    pub fn post_send(&self, wr: SendWr<'_>) -> std::result::Result<u64, PostError> {
        let mut qp = self.lock();
        // Taken in after the lock: the post reads the request through its
        // address, and written before the lock's call the compiler would
        // read it back from memory instead of folding its checks.
        let mut wr = std::mem::ManuallyDrop::new(wr);
        let id = self.id();
        wr.wr_id = id;
        // SAFETY: `wr` is never dropped; its buffers are in the ring or in
        // the error.
        let posted = unsafe { qp.post_send_in_place(&wr) };
        posted.map(|()| id)
    }
}

/// A request the wrapper can post on a `Qp<T, S>`: sends only on RC,
/// receives on connected transports.
pub(super) trait PostOn<T: QpType, S: QpState> {
    /// Whether it goes to the send queue.
    const SEND: bool;
    /// Posts the request where it lies: moving it to the post would copy it.
    ///
    /// # Safety
    /// `*self` is moved out (into the ring, or into the error when refused):
    /// the caller must forget it.
    unsafe fn post_in_place(&self, qp: &mut Qp<T, S>) -> std::result::Result<(), PostError>;
    fn into_buffers(self) -> Sges;
    fn set_wr_id(&mut self, wr_id: u64);
}

impl<S: CanPostSend> PostOn<Rc, S> for SendWr<'_> {
    const SEND: bool = true;
    #[inline(always)]
    unsafe fn post_in_place(&self, qp: &mut Qp<Rc, S>) -> std::result::Result<(), PostError> {
        // SAFETY: per this function's contract.
        unsafe { qp.post_send_in_place(self) }
    }
    fn into_buffers(self) -> Sges {
        SendWr::into_buffers(self)
    }
    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

impl<T: Connected, S: CanPostRecv> PostOn<T, S> for RecvWr {
    const SEND: bool = false;
    #[inline(always)]
    unsafe fn post_in_place(&self, qp: &mut Qp<T, S>) -> std::result::Result<(), PostError> {
        // SAFETY: per this function's contract.
        unsafe { qp.post_recv_in_place(self) }
    }
    fn into_buffers(self) -> Sges {
        RecvWr::into_buffers(self)
    }
    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

pub(super) fn stopped() -> Error {
    Error::Other(
        "the CQ's completion driver stopped (its AsyncCq was dropped or its runtime shut down)"
            .into(),
    )
}

/// The QP of an [`AsyncQp`], read-only: see [`AsyncQp::qp`]. It holds the
/// wrapper's post lock: not a guard to keep across an `.await`.
pub struct QpRef<'a, T: QpType, S: QpState>(MutexGuard<'a, Qp<T, S>>);

impl<T: QpType, S: QpState> std::ops::Deref for QpRef<'_, T, S> {
    type Target = Qp<T, S>;

    fn deref(&self) -> &Qp<T, S> {
        &self.0
    }
}

impl<T: QpType, S: QpState> std::fmt::Debug for AsyncQp<T, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncQp")
            .field("qp_num", &self.books.qp_num)
            .field("state", &S::NAME)
            .finish()
    }
}

/// An [`AsyncQp`] without its QP: its CQs and request numbers. Dropped
/// (the wrapper unwrapped or dropped, or a connect abandoned), it frees the
/// CQs' waiter slots that forgotten futures of the QP kept
/// ([`Shared::abandon_qp`]).
pub(crate) struct Parts {
    send: Arc<Shared>,
    recv: Arc<Shared>,
    qp_num: u32,
    next_id: AtomicU64,
}

impl Drop for Parts {
    fn drop(&mut self) {
        self.send.abandon_qp(self.qp_num);
        if !Arc::ptr_eq(&self.send, &self.recv) {
            self.recv.abandon_qp(self.qp_num);
        }
    }
}
