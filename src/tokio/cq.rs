//! [`AsyncCq`]: a CQ whose completions are delivered to futures by a driver task.

use std::collections::VecDeque;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};
use std::task::{Context as TaskContext, Poll, Waker};

use ::tokio::sync::Notify;

use super::driver::AsyncChannel;
use super::waiters::{Key, Queue, Taken, Waiters};
use crate::channel::CqId;
use crate::context::Context;
use crate::cq::{Completion, Cq, CqInner};
use crate::error::{Error, Result};
use crate::qp::PostError;
use crate::sys::wake::wake_all;

#[derive(Default)]
pub(crate) struct State {
    /// Requests whose futures are alive.
    waiters: Waiters,
    /// Completions nobody awaits: requests posted without a future, and
    /// requests whose future was dropped before they completed.
    unclaimed: VecDeque<Completion>,
    /// Errors of the CQ itself (e.g. `CompletionsLost`), reported by `next`.
    pub(crate) errors: VecDeque<Error>,
    /// The task waiting in [`AsyncCq::next`].
    next_waker: Option<Waker>,
    /// The driver stopped (its error is in `errors`): waiters fail.
    stopped: bool,
}

/// What the driver task and the futures share.
pub(crate) struct Shared {
    /// Locked by the driver for a poll and by `AsyncQp::new`, never by user
    /// code ([`AsyncCq::cq`] lends a view of `inner` instead).
    cq: Mutex<Cq>,
    /// The CQ itself, for [`AsyncCq::cq`]'s views.
    inner: Arc<CqInner>,
    state: Mutex<State>,
    /// Signalled after every batch of completions: queues may have room again.
    room: Notify,
    pub(crate) id: CqId,
}

/// How long [`Shared::cq_patiently`] waits for the CQ's lock.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

impl Shared {
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (every
        // critical section below is a few map/queue operations).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The CQ, waiting at most [`LOCK_PATIENCE`] for it: the driver holds
    /// it for a poll at a time and `AsyncQp::new` for a check, so longer
    /// means code running inside the driver's poll (a buffer's `Drop`, say)
    /// asked for it on the driver's own thread (waiting would deadlock).
    pub(crate) fn cq_patiently(&self) -> Option<MutexGuard<'_, Cq>> {
        let deadline = std::time::Instant::now() + LOCK_PATIENCE;
        loop {
            if let Some(c) = self.try_cq() {
                return Some(c);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::yield_now();
        }
    }

    /// The CQ unless someone holds it: the driver must not block its
    /// runtime's thread on a guard that a task keeps across an `.await` (on
    /// a current-thread runtime that task could then never run again).
    pub(crate) fn try_cq(&self) -> Option<MutexGuard<'_, Cq>> {
        match self.cq.try_lock() {
            Ok(c) => Some(c),
            Err(TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        }
    }

    /// Whether the driver stopped serving this CQ (waiters fail, nothing
    /// more will be delivered).
    pub(crate) fn is_stopped(&self) -> bool {
        self.state().stopped
    }

    pub(crate) fn room(&self) -> &Notify {
        &self.room
    }

    /// Registers request number `seq` of QP `qp_num`'s `queue`, about to be
    /// posted, with the waker of the task that awaits it (before its
    /// completion can be polled: callers register *before* posting and
    /// [`forget`](Self::forget) on failure); returns its key, whose `wr_id`
    /// names its slot. `None`, and nothing registered, once the driver
    /// stopped or with every slot taken.
    pub(crate) fn expect(&self, qp_num: u32, queue: Queue, seq: u64, waker: Waker) -> Option<Key> {
        let mut st = self.state();
        if st.stopped {
            return None;
        }
        st.waiters.register(qp_num, queue, seq, waker)
    }

    /// Withdraws a registration whose post failed. A post the provider did
    /// not name refused may still complete (its completion may even have come
    /// already): as for a dropped future, it goes to `next`.
    pub(crate) fn forget(&self, key: Key) {
        self.abandon(key);
    }

    /// Hands completions to their futures, or to `next`; `wake` is scratch
    /// space (empty on return), kept by the caller so that no batch allocates.
    pub(crate) fn dispatch(&self, done: &mut Vec<Completion>, wake: &mut Vec<Waker>) {
        {
            let mut st = self.state();
            let st = &mut *st;
            if st.waiters.is_idle() && st.unclaimed.is_empty() {
                // Nobody awaits a request: the batch becomes the unclaimed
                // queue whole (its buffer changes hands, no completion is
                // moved), and the queue's empty buffer is the next batch's.
                let batch = VecDeque::from(std::mem::take(done));
                *done = Vec::from(std::mem::replace(&mut st.unclaimed, batch));
            } else {
                st.waiters.park_all(done, wake, &mut st.unclaimed);
            }
            if !st.unclaimed.is_empty() {
                wake.extend(st.next_waker.take());
            }
        }
        // Wake outside the lock: a woken task may run at once on another thread.
        wake_all(wake.drain(..));
        self.room.notify_waiters();
    }

    /// The driver failed: every waiter and `next` learn it.
    pub(crate) fn stop(&self, error: Error) {
        let wake: Vec<Waker> = {
            let mut st = self.state();
            if st.stopped {
                // Once: the driver's sweep may find a stopped CQ failing
                // again, and each report would be queued for `next`.
                return;
            }
            st.stopped = true;
            st.errors.push_back(error);
            let mut wake: Vec<Waker> = st.waiters.take_wakers().collect();
            wake.extend(st.next_waker.take());
            wake
        };
        wake_all(wake);
        self.room.notify_waiters();
    }

    /// Polls for the completion of `key`. Errors come as the operation
    /// future's (nothing unposted), so that the completion is moved straight
    /// into the future's output.
    pub(crate) fn poll_done(
        &self,
        key: Key,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::result::Result<Completion, PostError>> {
        let failed = |reason: &str| {
            Poll::Ready(Err(PostError {
                error: Error::Other(reason.into()),
                unposted: Vec::new(),
            }))
        };
        let mut st = self.state();
        let waker = (!st.stopped).then_some(cx.waker());
        let taken = st.waiters.take(key, waker);
        drop(st);
        match taken {
            Taken::Done(c) => Poll::Ready(Ok(c)),
            Taken::Pending(replaced) => {
                // Dropped with the lock released (see `Taken::Pending`).
                drop(replaced);
                match waker {
                    Some(_) => Poll::Pending,
                    None => failed(
                        "the CQ's completion driver stopped (see AsyncCq::next for its \
                         error); this request's completion will not be delivered",
                    ),
                }
            }
            Taken::Unknown => failed("this request was not registered on the CQ"),
        }
    }

    /// The future for `key` was dropped: its completion (now or later) goes to `next`.
    pub(crate) fn abandon(&self, key: Key) {
        let mut st = self.state();
        // A pending request loses its slot: its completion will find none
        // holding its key and go to `next`; a completed one goes there now.
        let (done, stale) = st.waiters.release(key);
        let mut wake = None;
        if let Some(c) = done {
            st.unclaimed.push_back(c);
            wake = st.next_waker.take();
        }
        // Wakers are woken and dropped with the lock released.
        drop(st);
        drop(stale);
        wake_all(wake);
    }

    /// The wrapper of QP `qp_num` is gone (unwrapped or dropped), so no
    /// future of its can be polled again: the slots that forgotten ones
    /// (`mem::forget`) kept are freed as [`abandon`](Self::abandon) frees a
    /// dropped one's. Their completions go to `next`, and none of them can
    /// take the completion of a later request that happens to carry the
    /// same `wr_id` (a plain post on the unwrapped QP, or on a QP that
    /// reuses the number).
    pub(crate) fn abandon_qp(&self, qp_num: u32) {
        let mut stale = Vec::new();
        let wake = {
            let mut guard = self.state();
            let st = &mut *guard;
            let before = st.unclaimed.len();
            st.waiters.release_qp(qp_num, &mut st.unclaimed, &mut stale);
            (st.unclaimed.len() > before)
                .then(|| st.next_waker.take())
                .flatten()
        };
        // Outside the lock, as `dispatch` wakes.
        drop(stale);
        wake_all(wake);
    }
}

/// A completion queue driven by a tokio task: awaitable completions.
///
/// [`AsyncCq::new`] creates a CQ on a completion channel of its own;
/// [`AsyncCq::on_channel`] puts several CQs on one [`AsyncChannel`]. The
/// channel's driver task polls each CQ that has work; when one is empty it
/// arms it, polls once more (a completion that arrived before the arm raised
/// no event), and the driver sleeps on the channel's
/// [readiness](crate::channel::Readiness) handle through tokio's `AsyncFd`. Events are
/// acknowledged in batches of [`ACK_BATCH`](crate::channel::ACK_BATCH).
///
/// Each completion goes to the future of the operation that posted it
/// ([`AsyncQp`](super::AsyncQp)); completions nobody awaits (requests posted
/// with `post_*`, SRQ receives, and requests whose future was dropped) are
/// returned by [`next`](Self::next) with their buffers.
///
/// Dropping the `AsyncCq` takes it off its channel; futures still waiting on
/// it then fail instead of hanging. QPs created on it keep the CQ itself
/// alive, as with [`Cq`].
pub struct AsyncCq {
    shared: Arc<Shared>,
    channel: AsyncChannel,
}

impl AsyncCq {
    /// A CQ of at least `depth` entries with a completion channel (and driver
    /// task, on the current runtime) of its own. Fails outside a tokio runtime.
    pub fn new(ctx: &Context, depth: u32) -> Result<AsyncCq> {
        AsyncCq::on_channel(&AsyncChannel::new(ctx)?, depth)
    }

    /// A CQ of at least `depth` entries on `channel`, whose driver task serves
    /// it together with the channel's other CQs.
    pub fn on_channel(channel: &AsyncChannel, depth: u32) -> Result<AsyncCq> {
        let cq = Cq::with_channel(channel.context(), depth, channel.channel())?;
        let shared = Arc::new(Shared {
            id: cq.id(),
            inner: cq.inner.clone(),
            cq: Mutex::new(cq),
            state: Mutex::new(State::default()),
            room: Notify::new(),
        });
        channel.attach(&shared)?;
        Ok(AsyncCq {
            shared,
            channel: channel.clone(),
        })
    }

    /// The channel whose driver serves this CQ.
    pub fn channel(&self) -> &AsyncChannel {
        &self.channel
    }

    /// The CQ, read-only, to create QPs and SRQs on: `Qp::new(&pd, &cq.cq(),
    /// &cq.cq(), caps)`. Polling is the driver's (a completion polled
    /// elsewhere would never reach its future), so the view cannot poll.
    ///
    /// Not a lock: any number of views may live at once, on any thread and
    /// across `.await`s, without holding up the driver.
    ///
    /// Events are the driver's too: an event taken from the CQ's channel
    /// (`cq.cq().channel()`, then `try_next` on it or a clone) is found only
    /// by the driver's once-a-second sweep, so a thread that keeps taking
    /// them slows every future of the channel to about one completion per
    /// second.
    pub fn cq(&self) -> CqRef<'_> {
        CqRef {
            cq: Cq::view_of(&self.shared.inner),
            _async_cq: PhantomData,
        }
    }

    /// This CQ's id, as async events name it.
    pub fn id(&self) -> CqId {
        self.shared.id
    }

    /// The next completion nobody awaits (see the type's docs), with its
    /// buffers; errors of the CQ itself (e.g. [`Error::CompletionsLost`]) are
    /// returned here too.
    ///
    /// Cancel safe: a completion is removed only when it is returned. One
    /// task at a time should call it (a second caller replaces the first's
    /// wake-up).
    pub fn next(&self) -> Next<'_> {
        Next { cq: self }
    }

    /// Up to `max` completions nobody awaits, moved into `out` (appended),
    /// waiting for the first: the batch form of [`next`](Self::next), for a
    /// stream of requests posted with `post_send`/`post_recv` and read in
    /// place, the async counterpart of [`Cq::poll`] into a `Vec`. Resolves to
    /// how many were moved: at least 1, or 0 when `max` is 0. Errors of the
    /// CQ itself come as with `next`, once no completion is left to hand
    /// over.
    ///
    /// One lock of the CQ's state and at most one wake-up serve the whole
    /// batch, where `next` costs a future's poll per completion.
    ///
    /// Cancel safe: completions are moved into `out` only when it resolves.
    /// One task at a time should wait on `next` or `next_batch` (a second
    /// caller replaces the first's wake-up).
    ///
    /// ```no_run
    /// # async fn stream(qp: &rdma_verbs::tokio::AsyncQp<rdma_verbs::qp::Rc, rdma_verbs::qp::Rts>,
    /// #                 cq: &rdma_verbs::tokio::AsyncCq, bufs: Vec<rdma_verbs::mr::Mr>)
    /// #     -> rdma_verbs::error::Result<()> {
    /// use rdma_verbs::qp::SendWr;
    /// let n = bufs.len();
    /// for buf in bufs {
    ///     // Signaled, so that each SEND completes into `next_batch`.
    ///     qp.post_send(SendWr::send_from(0, buf).signaled(true))?;
    /// }
    /// let mut done = Vec::with_capacity(n);
    /// while done.len() < n {
    ///     let want = n - done.len();
    ///     cq.next_batch(&mut done, want).await?;
    /// }
    /// for c in &done {
    ///     c.result()?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn next_batch<'a>(&'a self, out: &'a mut Vec<Completion>, max: usize) -> NextBatch<'a> {
        NextBatch { cq: self, out, max }
    }

    /// The next unclaimed completion, if one is already there.
    pub fn try_next(&self) -> Result<Option<Completion>> {
        let mut st = self.shared.state();
        if let Some(e) = st.errors.pop_front() {
            return Err(e);
        }
        Ok(st.unclaimed.pop_front())
    }

    /// How many completions wait for [`next`](Self::next).
    pub fn unclaimed(&self) -> usize {
        self.shared.state().unclaimed.len()
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

impl Drop for AsyncCq {
    fn drop(&mut self) {
        self.channel.detach(self.shared.id);
        self.shared
            .stop(Error::Other("the AsyncCq was dropped".into()));
    }
}

impl std::fmt::Debug for AsyncCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCq")
            .field("id", &self.shared.id)
            .field("unclaimed", &self.unclaimed())
            .finish()
    }
}

/// The CQ of an [`AsyncCq`], read-only: see [`AsyncCq::cq`].
pub struct CqRef<'a> {
    /// A view sharing the CQ, with a poller state nobody uses: only `&Cq`
    /// is lent out, and polling needs `&mut Cq`.
    cq: Cq,
    _async_cq: PhantomData<&'a AsyncCq>,
}

impl std::ops::Deref for CqRef<'_> {
    type Target = Cq;

    fn deref(&self) -> &Cq {
        &self.cq
    }
}

/// The future of [`AsyncCq::next`].
#[must_use = "futures do nothing unless awaited"]
pub struct Next<'a> {
    cq: &'a AsyncCq,
}

impl Future for Next<'_> {
    type Output = Result<Completion>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<Completion>> {
        let mut st = self.cq.shared.state();
        if let Some(c) = st.unclaimed.pop_front() {
            return Poll::Ready(Ok(c));
        }
        let (polled, replaced) = st.nothing_unclaimed(cx);
        drop(st);
        drop(replaced);
        polled.map(Err)
    }
}

impl State {
    /// For a `next` or `next_batch` that found no completion: the CQ's next
    /// error, or that its driver stopped, else `Pending` with the caller's
    /// waker kept; with the waker that one replaced, for the caller to drop
    /// once the lock is released (a waker's drop may run an executor's
    /// code, which may take it again).
    fn nothing_unclaimed(&mut self, cx: &mut TaskContext<'_>) -> (Poll<Error>, Option<Waker>) {
        if let Some(e) = self.errors.pop_front() {
            return (Poll::Ready(e), None);
        }
        if self.stopped {
            let e = Error::Other("the CQ's completion driver stopped".into());
            return (Poll::Ready(e), None);
        }
        let replaced = match &mut self.next_waker {
            Some(w) if w.will_wake(cx.waker()) => None,
            w => w.replace(cx.waker().clone()),
        };
        (Poll::Pending, replaced)
    }
}

/// The future of [`AsyncCq::next_batch`].
#[must_use = "futures do nothing unless awaited"]
pub struct NextBatch<'a> {
    cq: &'a AsyncCq,
    out: &'a mut Vec<Completion>,
    max: usize,
}

impl Future for NextBatch<'_> {
    type Output = Result<usize>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<usize>> {
        let this = self.get_mut();
        if this.max == 0 {
            return Poll::Ready(Ok(0));
        }
        let mut st = this.cq.shared.state();
        let all = st.unclaimed.len();
        let n = all.min(this.max);
        if n == 0 {
            let (polled, replaced) = st.nothing_unclaimed(cx);
            drop(st);
            drop(replaced);
            return polled.map(Err);
        }
        if n < all {
            this.out.extend(st.unclaimed.drain(..n));
            return Poll::Ready(Ok(n));
        }
        // All of them: the queue's buffer goes to `out` whole when `out` is
        // empty (no completion is moved; `out`'s buffer becomes the queue's),
        // else in one copy.
        let mut taken = Vec::from(std::mem::take(&mut st.unclaimed));
        if this.out.is_empty() {
            std::mem::swap(this.out, &mut taken);
        } else {
            this.out.append(&mut taken);
        }
        st.unclaimed = VecDeque::from(taken);
        Poll::Ready(Ok(n))
    }
}
