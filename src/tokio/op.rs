//! [`Operation`]: the future of one awaited request of an [`AsyncQp`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskContext, Poll, Waker};

use ::tokio::sync::futures::Notified;

use super::cq::Shared;
use super::qp::{AsyncQp, PostOn, stopped};
use super::waiters::{Key, NO_SLOT, Queue, SLOT_BITS, wr_id};
use crate::cq::Completion;
use crate::error::Error;
use crate::qp::{PostError, QpState, QpType};
use crate::sys::wake::contained;

/// Posts its request when first polled (waiting for a free slot in the
/// queue if there is none), then waits for the request's completion.
///
/// Dropped before the post, it drops the request and its buffers (nothing
/// was posted); dropped after it, it hands the completion to
/// [`AsyncCq::next`](super::AsyncCq::next).
///
/// Written out by hand rather than as nested `async fn`s: those carried the
/// request through a future per level, copied at each, and armed a
/// `Notify` registration for every post; here the request is moved once
/// into the future, the registration is made only when the queue is full,
/// and the post registers the task's waker with the request, so that the
/// poll that posts does not look the request up again. `Unpin`: a window of
/// them can sit in a `VecDeque` and be polled in place.
pub(super) struct Operation<'a, T: QpType, S: QpState, R> {
    qp: &'a AsyncQp<T, S>,
    cq: &'a Shared,
    /// The request's key; until it is registered, its `wr_id` names no slot.
    key: Key,
    /// The request until it is posted.
    req: Option<R>,
    /// Armed while the queue is full: signalled after each batch of completions.
    room: Option<Pin<Box<Notified<'a>>>>,
    /// The task's waker and the one `room` holds for it, which contains a
    /// panic of the task's (see [`contained`]).
    room_waker: Option<Box<(Waker, Waker)>>,
    /// Posted and its completion not yet returned.
    waiting: bool,
}

/// What one try to post found.
enum Attempt {
    Posted,
    Full,
    Failed(PostError),
}

impl<'a, T: QpType, S: QpState, R: PostOn<T, S>> Operation<'a, T, S, R> {
    /// `req`, the QP's request number `seq`, for `cq` (the CQ of its
    /// queue); its `wr_id` is set when it is registered.
    pub(super) fn new(qp: &'a AsyncQp<T, S>, cq: &'a Shared, seq: u64, req: R) -> Self {
        let queue = if R::SEND { Queue::Send } else { Queue::Recv };
        Operation {
            qp,
            cq,
            key: (qp.qp_num(), queue, wr_id(seq, NO_SLOT)),
            req: Some(req),
            room: None,
            room_waker: None,
            waiting: false,
        }
    }

    /// Posts the request if its queue has a free slot: registered on the
    /// CQ first, with `waker` (the driver may poll the completion before the
    /// post returns), refused with the buffers back once the CQ's driver
    /// stopped.
    fn attempt(&mut self, waker: &Waker) -> Attempt {
        let mut qp = self.qp.lock();
        if !qp.has_room(R::SEND) {
            drop(qp);
            if self.cq.is_stopped() {
                return self.refuse(stopped());
            }
            return Attempt::Full;
        }
        if self.req.is_none() {
            // Only called while the request is held (see `post`).
            return Attempt::Posted;
        }
        let (qp_num, queue, id) = self.key;
        let Some(key) = self
            .cq
            .expect(qp_num, queue, id >> SLOT_BITS, waker.clone())
        else {
            drop(qp);
            let error = if self.cq.is_stopped() {
                stopped()
            } else {
                too_many()
            };
            return self.refuse(error);
        };
        self.key = key;
        // Posted where it lies: taking it out would copy it.
        let Some(req) = self.req.as_mut() else {
            return Attempt::Posted;
        };
        req.set_wr_id(key.2);
        // SAFETY: the request is forgotten right below.
        let posted = unsafe { req.post_in_place(&mut qp) };
        // SAFETY: the post moved the request out (into the ring or the
        // error): `None` goes over it without dropping it.
        unsafe { std::ptr::write(&mut self.req, None) };
        match posted {
            Ok(()) => {
                self.waiting = true;
                Attempt::Posted
            }
            Err(mut e) => {
                drop(qp);
                self.cq.forget(self.key);
                // Reported under the number it was made with.
                for (w, _) in &mut e.unposted {
                    *w = id;
                }
                Attempt::Failed(e)
            }
        }
    }

    /// The request back, unposted, with `error`.
    fn refuse(&mut self, error: Error) -> Attempt {
        let unposted = self
            .req
            .take()
            .map(|r| vec![(self.key.2, r.into_buffers())])
            .unwrap_or_default();
        Attempt::Failed(PostError { error, unposted })
    }

    /// Posts the request, waiting for room as long as its queue is full.
    fn post(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), PostError>> {
        while self.req.is_some() {
            if let Some(room) = self.room.as_mut() {
                let waker = match &mut self.room_waker {
                    Some(w) if w.0.will_wake(cx.waker()) => &w.1,
                    slot => {
                        let task = cx.waker().clone();
                        let held = contained(&task);
                        &slot.insert(Box::new((task, held))).1
                    }
                };
                if room
                    .as_mut()
                    .poll(&mut TaskContext::from_waker(waker))
                    .is_pending()
                {
                    return Poll::Pending;
                }
                self.room = None;
            }
            match self.attempt(cx.waker()) {
                Attempt::Posted => {}
                Attempt::Failed(e) => return Poll::Ready(Err(e)),
                Attempt::Full if self.room.is_none() => {
                    // Armed before the next look, so that a slot freed in
                    // between wakes this task.
                    let mut room = Box::pin(self.cq.room().notified());
                    room.as_mut().enable();
                    self.room = Some(room);
                    match self.attempt(cx.waker()) {
                        Attempt::Full => {}
                        Attempt::Posted => self.room = None,
                        Attempt::Failed(e) => return Poll::Ready(Err(e)),
                    }
                }
                Attempt::Full => {}
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: QpType, S: QpState, R: PostOn<T, S> + Unpin> Future for Operation<'_, T, S, R> {
    type Output = Result<Completion, PostError>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.req.is_some() {
            return match this.post(cx) {
                // Posted now, with this task's waker registered: its
                // completion wakes the task (it may already have).
                Poll::Ready(Ok(())) => Poll::Pending,
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            };
        }
        let polled = this.cq.poll_done(this.key, cx);
        if polled.is_ready() {
            this.waiting = false;
        }
        polled
    }
}

impl<T: QpType, S: QpState, R> Drop for Operation<'_, T, S, R> {
    fn drop(&mut self) {
        if self.waiting {
            self.cq.abandon(self.key);
        }
    }
}

/// A registration refused with every slot of the CQ's waiter slab taken.
fn too_many() -> Error {
    Error::Other(format!(
        "{NO_SLOT} awaited requests are registered on this CQ (their futures alive); \
         await or drop some first"
    ))
}
