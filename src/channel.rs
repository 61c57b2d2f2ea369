//! Completion channels: sleeping until a completion queue has work.
//!
//! A [`CompletionChannel`] is a file descriptor the kernel makes readable when
//! an *armed* CQ attached to it receives a completion. The cycle is:
//!
//! 1. create the CQ on the channel ([`Cq::with_channel`]);
//! 2. arm it ([`Cq::req_notify`]): the next completion will raise one event;
//! 3. sleep on the channel ([`CompletionChannel::wait`], or `poll`/`epoll` on
//!    its fd, which is non-blocking);
//! 4. poll the CQ, re-arm, poll again, sleep again.
//!
//! [`Cq::wait_poll`] does all of that, including the re-arm race: a completion
//! that arrives after the last poll but before the arm raises no event, so it
//! polls once more after arming before it sleeps.
//!
//! # Acknowledging events
//! Every event must be acknowledged (`ibv_ack_cq_events`) before its CQ is
//! destroyed, or `ibv_destroy_cq` blocks forever. Acknowledging takes a mutex,
//! so it is batched: each event is counted on its CQ, [`Cq::wait_poll`] acks
//! in batches of [`ACK_BATCH`], [`Cq::ack_events`] acks on demand, and the
//! CQ's `Drop` acks whatever is left before destroying it. An event that
//! races with the CQ's destruction is acknowledged by the thread that read it
//! (a "closing" flag in the counter decides who does it), so no count is lost
//! and no event is acknowledged twice.
//!
//! The channel outlives its CQs: each CQ holds a reference to it.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::context::Context;
use crate::cq::{Completion, Cq};
use crate::error::{Error, Result, errno, last_errno};
use crate::ffi;

/// How many events [`Cq::wait_poll`] lets accumulate before acknowledging them.
pub const ACK_BATCH: u32 = 32;

/// A completion channel (`ibv_comp_channel`).
///
/// Cheap to clone (reference counted); every CQ attached to it keeps it alive.
/// Its file descriptor is non-blocking.
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

pub(crate) struct ChannelInner {
    raw: NonNull<ffi::ibv_comp_channel>,
    /// CQs created on this channel and not yet destroyed.
    attached: AtomicUsize,
    ctx: Context,
}

// SAFETY: a completion channel is a file descriptor plus a refcount that
// libibverbs updates under the context mutex; reading events is a read(2) on
// the fd, which any thread may do.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send; &ChannelInner only reads events (thread-safe) and the atomics.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: raw came from ibv_create_comp_channel; every CQ created on it
        // holds an Arc to this inner, so none is left (the call would refuse with
        // EBUSY otherwise). A failure is ignored: Drop never panics.
        unsafe { ffi::ibv_destroy_comp_channel(self.raw.as_ptr()) };
    }
}

impl ChannelInner {
    pub(crate) fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.raw.as_ptr()
    }

    pub(crate) fn context(&self) -> &Context {
        &self.ctx
    }

    pub(crate) fn attach(&self) {
        self.attached.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn detach(&self) {
        self.attached.fetch_sub(1, Ordering::AcqRel);
    }

    fn fd(&self) -> RawFd {
        // SAFETY: raw is valid while self lives; fd is a plain field set at creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

/// Identifies a CQ in events (the address of its `ibv_cq`).
///
/// Compare with [`Cq::id`]. Only meaningful while that CQ exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CqId(pub(crate) usize);

impl CqId {
    /// The id of a raw `ibv_cq` (e.g. one named by an async event).
    pub fn from_raw(cq: *const ffi::ibv_cq) -> CqId {
        CqId(cq as usize)
    }

    /// The `ibv_cq` address as an integer.
    pub fn addr(self) -> usize {
        self.0
    }
}

impl fmt::Display for CqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cq@{:#x}", self.0)
    }
}

/// Per-CQ count of events read but not yet acknowledged; its address is the
/// CQ's `cq_context`. Bit 31 says the CQ is being destroyed.
pub(crate) struct CqEvents {
    state: AtomicU32,
}

const CLOSING: u32 = 1 << 31;
/// Beyond this many pending events the reader acknowledges its own.
const MAX_PENDING: u32 = 1 << 30;

impl CqEvents {
    pub(crate) fn new() -> CqEvents {
        CqEvents {
            state: AtomicU32::new(0),
        }
    }

    /// Reader side: counts one event. `false` when the CQ is closing (or the
    /// count is saturated): the reader must acknowledge the event itself.
    fn count(&self) -> bool {
        self.state
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                (s & CLOSING == 0 && s < MAX_PENDING).then_some(s + 1)
            })
            .is_ok()
    }

    /// Owner side: takes the pending count (to acknowledge it).
    pub(crate) fn take(&self) -> u32 {
        self.state.fetch_and(CLOSING, Ordering::AcqRel) & !CLOSING
    }

    /// Owner side, before destroying the CQ: marks it closing and takes the count.
    pub(crate) fn close(&self) -> u32 {
        self.state.swap(CLOSING, Ordering::AcqRel) & !CLOSING
    }

    /// Events counted and not yet acknowledged.
    pub(crate) fn pending(&self) -> u32 {
        self.state.load(Ordering::Acquire) & !CLOSING
    }
}

impl CompletionChannel {
    /// Creates a completion channel (`ibv_create_comp_channel`) and makes its
    /// file descriptor non-blocking.
    pub fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: valid context.
        let raw = unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) };
        let raw = NonNull::new(raw)
            .ok_or_else(|| Error::verb("ibv_create_comp_channel", last_errno()))?;
        let inner = ChannelInner {
            raw,
            attached: AtomicUsize::new(0),
            ctx: ctx.clone(),
        };
        set_nonblocking(inner.fd()).map_err(|e| Error::Io {
            what: "making the completion channel's fd non-blocking",
            source: e,
        })?;
        Ok(CompletionChannel {
            inner: Arc::new(inner),
        })
    }

    /// The device context the channel belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The raw `ibv_comp_channel`, valid while this channel (or a clone, or a
    /// CQ on it) lives.
    ///
    /// Do not create CQs on it through the raw pointer: [`wait`](Self::wait)
    /// reads every event's `cq_context` as this crate's event counter.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.as_raw()
    }

    /// How many CQs are attached to the channel.
    pub fn attached_cqs(&self) -> usize {
        self.inner.attached.load(Ordering::Acquire)
    }

    /// Reads one pending event without blocking (`ibv_get_cq_event` on the
    /// non-blocking fd): `Some(cq)` names the CQ that had a completion, `None`
    /// means no event was pending. The event is counted on that CQ and
    /// acknowledged later (see the [module docs](self)); the CQ is disarmed
    /// until the next [`Cq::req_notify`].
    pub fn try_next(&self) -> Result<Option<CqId>> {
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: valid channel; the out-pointers are valid locals.
        let rc = unsafe { ffi::ibv_get_cq_event(self.as_raw(), &mut cq, &mut cq_ctx) };
        if rc != 0 {
            let e = last_errno();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(Error::verb("ibv_get_cq_event", e)),
            };
        }
        if cq.is_null() {
            return Err(Error::verb(
                "ibv_get_cq_event",
                io::Error::new(io::ErrorKind::InvalidData, "event names no CQ"),
            ));
        }
        let counted = if cq_ctx.is_null() {
            false
        } else {
            // SAFETY: every CQ created on a channel of this crate (Cq::with_channel)
            // has a CqEvents as cq_context, held (only) by its CqInner and dropped
            // only after ibv_destroy_cq returned. ibv_destroy_cq does not return while this
            // event is unacknowledged, so the counter is alive here. After `count`
            // hands the event over, this thread no longer touches the counter.
            let events = unsafe { &*(cq_ctx as *const CqEvents) };
            events.count()
        };
        if !counted {
            // SAFETY: the CQ is alive (its destruction waits for this ack); we
            // acknowledge exactly the one event we read and then never touch it.
            unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        }
        Ok(Some(CqId::from_raw(cq)))
    }

    /// Sleeps until an attached, armed CQ has an event, for at most `timeout`
    /// (`None`: forever). Returns the CQ's id, or `None` when the time ran out.
    /// See [`try_next`](Self::try_next) for what happens to the event.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Option<CqId>> {
        let deadline = timeout.map(deadline_after);
        loop {
            if let Some(id) = self.try_next()? {
                return Ok(Some(id));
            }
            if !poll_readable(self.inner.fd(), deadline).map_err(|e| Error::Io {
                what: "waiting on the completion channel",
                source: e,
            })? {
                return Ok(None);
            }
        }
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.fd()
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd stays open until the channel is destroyed, which cannot
        // happen while &self (and so an Arc to the inner) is borrowed.
        unsafe { BorrowedFd::borrow_raw(self.inner.fd()) }
    }
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.inner.fd())
            .field("attached_cqs", &self.attached_cqs())
            .finish()
    }
}

/// Sets O_NONBLOCK on `fd`.
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; F_GETFL/F_SETFL touch no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    if flags & libc::O_NONBLOCK == 0 {
        // SAFETY: as above.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Waits until `fd` is readable or `deadline` passes (`None`: no deadline).
/// `Ok(true)`: readable (or interrupted: the caller retries), `Ok(false)`: timed out.
/// `now + timeout`, saturating far in the future instead of overflowing
/// (a huge timeout means "practically forever", not a panic).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(1 << 32)))
        .unwrap_or(now)
}

pub(crate) fn poll_readable(fd: RawFd, deadline: Option<Instant>) -> io::Result<bool> {
    let ms = match deadline {
        None => -1,
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            // Round up so a sub-millisecond rest does not spin with timeout 0.
            i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        }
    };
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(true)
        } else {
            Err(e)
        };
    }
    if rc == 0 {
        // Timed out, unless the deadline has in fact not passed (rounding).
        return Ok(deadline.is_none_or(|d| Instant::now() < d));
    }
    Ok(true)
}

impl Cq {
    /// Creates a CQ whose completion events go to `channel`
    /// (`ibv_create_cq` with a channel, completion vector 0).
    ///
    /// The CQ keeps the channel alive; arm it with [`req_notify`](Cq::req_notify)
    /// or let [`wait_poll`](Cq::wait_poll) do so.
    pub fn with_channel(ctx: &Context, depth: u32, channel: &CompletionChannel) -> Result<Cq> {
        if !Arc::ptr_eq(&ctx.inner, &channel.inner.context().inner) {
            return Err(Error::InvalidArgument {
                what: "completion channel",
                reason: "it belongs to another device context; create it from the same Context"
                    .into(),
            });
        }
        Cq::create(ctx, depth, Some(channel))
    }

    /// This CQ's id, as [`CompletionChannel::wait`] and async events name it.
    pub fn id(&self) -> CqId {
        CqId::from_raw(self.as_raw())
    }

    /// The channel the CQ reports to, if any.
    pub fn channel(&self) -> Option<&CompletionChannel> {
        self.inner.channel.as_ref()
    }

    /// Arms the CQ (`ibv_req_notify_cq`): the next completion (with
    /// `solicited_only`, the next solicited or error completion) raises one
    /// event on the channel. Completions already in the CQ raise none: poll
    /// after arming (see [`wait_poll`](Cq::wait_poll)).
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        if self.inner.channel.is_none() {
            return Err(no_channel());
        }
        // SAFETY: valid CQ.
        let rc = unsafe { ffi::ibv_req_notify_cq(self.as_raw(), i32::from(solicited_only)) };
        if rc != 0 {
            return Err(Error::verb("ibv_req_notify_cq", errno(rc)));
        }
        Ok(())
    }

    /// Acknowledges the events counted on this CQ so far (`ibv_ack_cq_events`),
    /// returning how many. Optional: [`wait_poll`](Cq::wait_poll) and `Drop` do it.
    pub fn ack_events(&mut self) -> u32 {
        let Some(events) = self.inner.events.as_deref() else {
            return 0;
        };
        let n = events.take();
        if n > 0 {
            // SAFETY: valid CQ (&mut self); n events were read and not yet acked.
            unsafe { ffi::ibv_ack_cq_events(self.as_raw(), n) };
        }
        n
    }

    /// Events read from the channel for this CQ and not yet acknowledged.
    pub fn unacked_events(&self) -> u32 {
        self.inner.events.as_deref().map_or(0, CqEvents::pending)
    }

    /// Polls, and sleeps on the channel while the CQ is empty, until at least
    /// one completion is in `out` or `timeout` (`None`: forever) has passed.
    /// Returns how many completions were added; `0` only on timeout.
    ///
    /// The loop: poll; if empty, arm ([`req_notify`](Cq::req_notify)), poll
    /// again (a completion that slipped in before the arm raised no event),
    /// then sleep on the channel and start over; events are acknowledged in
    /// batches of [`ACK_BATCH`]. Like [`poll`](Cq::poll) it fills `out` up to its
    /// capacity (it reserves room when `out` is full).
    ///
    /// The channel must serve this CQ alone: a waiter on a shared channel
    /// could consume the event meant for another CQ's waiter. With several CQs
    /// on one channel, use [`CompletionChannel::wait`] and poll the CQ it names.
    pub fn wait_poll(
        &mut self,
        out: &mut Vec<Completion>,
        timeout: Option<Duration>,
    ) -> Result<usize> {
        let Some(channel) = self.inner.channel.clone() else {
            return Err(no_channel());
        };
        if channel.attached_cqs() > 1 {
            return Err(Error::InvalidArgument {
                what: "completion channel",
                reason: format!(
                    "wait_poll needs a channel of its own, this one serves {} CQs; \
                     use CompletionChannel::wait and poll the CQ it names",
                    channel.attached_cqs()
                ),
            });
        }
        if out.len() == out.capacity() {
            out.reserve(32);
        }
        let deadline = timeout.map(deadline_after);
        loop {
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            self.req_notify(false)?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(0);
            }
            if channel.wait(left)?.is_none() {
                // Timed out; one last look, in case a completion raced the clock.
                return self.poll(out);
            }
            if self.unacked_events() >= ACK_BATCH {
                self.ack_events();
            }
        }
    }
}

fn no_channel() -> Error {
    Error::InvalidArgument {
        what: "CQ",
        reason: "this CQ has no completion channel; create it with Cq::with_channel".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_counter_hands_over_exactly_once() {
        let c = CqEvents::new();
        assert!(c.count());
        assert!(c.count());
        assert_eq!(c.pending(), 2);
        assert_eq!(c.take(), 2);
        assert_eq!(c.take(), 0);
        assert!(c.count());
        assert_eq!(c.close(), 1);
        // Closing: readers must ack their own events.
        assert!(!c.count());
        assert_eq!(c.pending(), 0);
        assert_eq!(c.take(), 0);
    }

    #[test]
    fn event_counter_saturates() {
        let c = CqEvents::new();
        c.state.store(MAX_PENDING, Ordering::Release);
        assert!(!c.count());
        assert_eq!(c.take(), MAX_PENDING);
        assert!(c.count());
    }

    #[test]
    fn poll_readable_times_out_and_sees_data() {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into fds.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        set_nonblocking(fds[0]).unwrap();
        let t = Instant::now();
        let ready =
            poll_readable(fds[0], Some(Instant::now() + Duration::from_millis(30))).unwrap();
        assert!(!ready);
        assert!(t.elapsed() >= Duration::from_millis(30));
        // SAFETY: writes one byte from a valid buffer to our pipe.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        assert!(poll_readable(fds[0], None).unwrap());
        // SAFETY: F_GETFL on our descriptor.
        let fl = unsafe { libc::fcntl(fds[0], libc::F_GETFL) };
        assert_ne!(fl & libc::O_NONBLOCK, 0);
        // SAFETY: closing the descriptors we created.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }
}
