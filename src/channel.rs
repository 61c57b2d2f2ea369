//! Completion channels: sleeping until a completion queue has work.
//!
//! A [`CompletionChannel`] is a file descriptor the kernel makes readable when
//! an *armed* CQ attached to it receives a completion. The cycle is:
//!
//! 1. create the CQ on the channel ([`Cq::with_channel`](crate::cq::Cq::with_channel));
//! 2. arm it ([`Cq::req_notify`](crate::cq::Cq::req_notify)): the next completion will raise one event;
//! 3. sleep on the channel ([`CompletionChannel::wait`], or `poll`/`epoll` on
//!    its [readiness handle](CompletionChannel::readiness));
//! 4. read the event ([`CompletionChannel::try_next`]), poll the CQ, re-arm,
//!    poll again, sleep again.
//!
//! [`Cq::wait_poll`](crate::cq::Cq::wait_poll) does all of that, including the re-arm race: a completion
//! that arrives after the last poll but before the arm raises no event, so it
//! polls once more after arming before it sleeps.
//!
//! # Acknowledging events
//! Every event must be acknowledged (`ibv_ack_cq_events`) before its CQ is
//! destroyed, or `ibv_destroy_cq` blocks forever. Acknowledging takes a mutex,
//! so it is batched: each event is counted on its CQ, [`Cq::wait_poll`](crate::cq::Cq::wait_poll) acks
//! in batches of [`ACK_BATCH`], [`Cq::ack_events`](crate::cq::Cq::ack_events) acks on demand, and the
//! CQ's `Drop` acks whatever is left before destroying it. An event that
//! races with the CQ's destruction is acknowledged by the thread that read it
//! (a "closing" flag in the counter decides who does it), so no count is lost
//! and no event is acknowledged twice.
//!
//! The channel outlives its CQs: each CQ holds a reference to it.
//!
//! # Readiness and foreign CQs
//! The channel's descriptor is not reachable from safe code (a `read(2)` on
//! it would consume an event nobody acknowledges); event loops get a
//! [`Readiness`] handle instead ([`CompletionChannel::readiness`]), an epoll
//! instance that is readable when the channel is and cannot consume events.
//! [`try_next`](CompletionChannel::try_next) counts events only for CQs that
//! [`Cq::with_channel`](crate::cq::Cq::with_channel) registered; a CQ created on
//! the channel through [`as_raw`](CompletionChannel::as_raw) is foreign: its
//! events are acknowledged at once and only its [`CqId`] is returned. Why
//! both keep safe code sound is in `docs/soundness.md`.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::call::verb;
pub(crate) use crate::sys::fd::{deadline_after, poll_readable, set_nonblocking};

/// How many events [`Cq::wait_poll`](crate::cq::Cq::wait_poll) lets accumulate before acknowledging them.
pub const ACK_BATCH: u32 = 32;

/// The longest [`Cq::wait_poll`](crate::cq::Cq::wait_poll) sleeps on its channel before it polls the
/// CQ again: 1 s.
pub const WAIT_SLICE: Duration = Duration::from_secs(1);

/// A completion channel (`ibv_comp_channel`).
///
/// Cheap to clone (reference counted); every CQ attached to it keeps it alive.
/// Its file descriptor is non-blocking and private: event loops watch the
/// [`readiness`](Self::readiness) handle instead (see the [module docs](self)).
#[doc(alias = "ibv_comp_channel")]
#[derive(Clone)]
pub struct CompletionChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

pub(crate) struct ChannelInner {
    raw: NonNull<ffi::ibv_comp_channel>,
    /// CQs created on this channel and not yet destroyed.
    attached: AtomicUsize,
    /// The CQs of this crate on this channel.
    cqs: CqRegistry,
    readiness: ReadinessCell,
    /// Held around every read of an event (`ibv_get_cq_event`) and every arm
    /// of a CQ on the channel (`ibv_req_notify_cq`, [`ChannelInner::arm`]):
    /// a provider may update a CQ's arm state in both without a lock (mlx5's
    /// `mlx5_cq_event` increments `arm_sn`, which `mlx5_arm_cq` reads).
    arm: Mutex<()>,
    ctx: Context,
}

// SAFETY: a completion channel is a file descriptor plus a refcount that
// libibverbs updates under the context mutex; reading events is a read(2) on
// the fd, which any thread may do.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send; &ChannelInner only reads events (thread-safe) and the atomics.
unsafe impl Sync for ChannelInner {}

impl ChannelInner {
    /// The lock that keeps arms and event reads of the channel's CQs apart
    /// (see the field); a poisoned one is taken as it is (it guards nothing
    /// but the calls).
    pub(crate) fn arm_lock(&self) -> MutexGuard<'_, ()> {
        self.arm.lock().unwrap_or_else(|p| p.into_inner())
    }
}

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

    /// Records `cq` (created on this channel with `events` as its
    /// `cq_context`) as one of this crate's, so that
    /// [`CompletionChannel::try_next`] counts its events on `events`.
    pub(crate) fn register(&self, cq: *mut ffi::ibv_cq, events: &Arc<CqEvents>) {
        self.cqs.register(cq as usize, events);
    }

    fn fd(&self) -> RawFd {
        // SAFETY: raw is valid while self lives; fd is a plain field set at creation.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

/// Identifies a CQ in events (the address of its `ibv_cq`).
///
/// Compare with [`Cq::id`](crate::cq::Cq::id). Only meaningful while that CQ exists (a new CQ
/// can get a dropped one's address; see [`SrqId`](crate::event::SrqId)).
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

/// The CQs this crate created on one channel: `ibv_cq` address and a weak
/// reference to the event counter that is its `cq_context`. Entries whose
/// counter is gone are pruned on the next registration.
///
/// Matching the pair (not just the address) and upgrading the `Weak` under
/// the lock means a counter is only ever reached through a live `Arc`: even an
/// `ibv_cq` address reused by a foreign CQ between a CQ's destruction and its
/// counter's release cannot make a reader touch freed or foreign memory. (A
/// `Weak` also keeps the counter's allocation, so its address is not reused
/// by another counter while the entry exists.)
#[derive(Default)]
struct CqRegistry(Mutex<Vec<(usize, Weak<CqEvents>)>>);

impl CqRegistry {
    fn lock(&self) -> MutexGuard<'_, Vec<(usize, Weak<CqEvents>)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&self, cq: usize, events: &Arc<CqEvents>) {
        let mut cqs = self.lock();
        cqs.retain(|(_, w)| w.strong_count() > 0);
        cqs.push((cq, Arc::downgrade(events)));
    }

    /// The counter of CQ `cq` if it is registered with `cq_ctx` as its
    /// counter and the counter is alive; `None` for a foreign CQ.
    fn counter(&self, cq: usize, cq_ctx: *const CqEvents) -> Option<Arc<CqEvents>> {
        self.lock()
            .iter()
            .find(|(addr, w)| *addr == cq && std::ptr::eq(w.as_ptr(), cq_ctx))
            .and_then(|(_, w)| w.upgrade())
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

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
    #[doc(alias = "ibv_create_comp_channel")]
    pub fn new(ctx: &Context) -> Result<CompletionChannel> {
        // SAFETY: valid context.
        let raw = verb!(ptr: unsafe { ffi::ibv_create_comp_channel(ctx.as_raw()) })?;
        let inner = ChannelInner {
            raw,
            attached: AtomicUsize::new(0),
            cqs: CqRegistry::default(),
            readiness: ReadinessCell::default(),
            arm: Mutex::new(()),
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
    /// A CQ created on it through the FFI is foreign to this crate:
    /// [`try_next`](Self::try_next) acknowledges its events at once and
    /// returns its id (see the [module docs](self)). An event read through the
    /// raw channel (`ibv_get_cq_event`) must be acknowledged by whoever read
    /// it, or destroying its CQ blocks forever.
    pub fn as_raw(&self) -> *mut ffi::ibv_comp_channel {
        self.inner.as_raw()
    }

    /// A handle that is readable when an event is waiting, for an
    /// application's own `poll`/`epoll`/`AsyncFd` (then read the event with
    /// [`try_next`](Self::try_next)). It cannot consume events itself: see
    /// [`Readiness`]. Created on first use and shared by the channel's clones.
    pub fn readiness(&self) -> Result<&Readiness> {
        self.inner.readiness.get_or_watch(
            self.inner.fd(),
            "creating the completion channel's readiness epoll",
        )
    }

    /// How many CQs are attached to the channel.
    pub fn attached_cqs(&self) -> usize {
        self.inner.attached.load(Ordering::Acquire)
    }

    /// Reads one pending event without blocking (`ibv_get_cq_event` on the
    /// non-blocking fd): `Some(cq)` names the CQ that had a completion, `None`
    /// means no event was pending. The event is counted on that CQ and
    /// acknowledged later (see the [module docs](self)); the CQ is disarmed
    /// until the next [`Cq::req_notify`](crate::cq::Cq::req_notify). The event of a CQ created on the
    /// channel outside this crate is acknowledged at once.
    #[doc(alias = "ibv_get_cq_event")]
    pub fn try_next(&self) -> Result<Option<CqId>> {
        let mut cq: *mut ffi::ibv_cq = std::ptr::null_mut();
        let mut cq_ctx: *mut libc::c_void = std::ptr::null_mut();
        let arm = self.inner.arm_lock();
        // SAFETY: valid channel; the out-pointers are valid locals; no arm
        // of a CQ on the channel runs meanwhile (`arm`).
        let done = verb!(errno: unsafe {
            ffi::ibv_get_cq_event(self.as_raw(), &mut cq, &mut cq_ctx)
        });
        drop(arm);
        if let Err(failed) = done {
            return match failed.source.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(failed.into()),
            };
        }
        if cq.is_null() {
            return Err(Error::verb(
                "ibv_get_cq_event",
                io::Error::new(io::ErrorKind::InvalidData, "event names no CQ"),
            ));
        }
        // Only a registered (cq, counter) pair is counted, through a strong
        // reference taken from the registry: no cq_context is dereferenced
        // as a raw pointer, so a CQ created on the channel through the FFI
        // cannot make this read foreign memory.
        let counted = self
            .inner
            .cqs
            .counter(cq as usize, cq_ctx.cast_const().cast())
            .is_some_and(|events| events.count());
        if !counted {
            // SAFETY: the CQ is alive (its destruction waits for this ack); we
            // acknowledge exactly the one event we read and then never touch it.
            unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        }
        Ok(Some(CqId::from_raw(cq)))
    }

    /// Sleeps until an attached, armed CQ has an event (`ibv_get_cq_event`),
    /// for at most `timeout` (`None`: forever). Returns the CQ's id, or `None`
    /// when the time ran out. See [`try_next`](Self::try_next) for what
    /// happens to the event.
    #[doc(alias = "ibv_get_cq_event")]
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

/// Readiness of an event descriptor this crate keeps private: an `epoll`
/// instance watching it for `EPOLLIN` (level-triggered).
///
/// Readable (`poll`, `epoll`, tokio's `AsyncFd`) exactly while an event is
/// waiting on the watched descriptor; `read(2)` on it fails with `EINVAL`,
/// so it can never consume an event (the reason the real descriptor is not
/// handed out is in the [module docs](self)). Read the event with the owner's
/// `try_next`. A duplicate of the descriptor keeps working while the owner
/// lives; once the owner is dropped it never becomes readable again.
pub struct Readiness {
    epoll: OwnedFd,
}

impl Readiness {
    /// A new epoll instance watching `fd` (open while the caller holds it).
    fn watch(fd: RawFd) -> io::Result<Readiness> {
        // SAFETY: plain syscall, no pointers.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: ep is a descriptor epoll_create1 just opened for us alone.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: valid epoll descriptor; fd is open (caller); ev is a valid
        // struct that the kernel only reads.
        let rc = unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Readiness { epoll })
    }
}

impl AsFd for Readiness {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

impl AsRawFd for Readiness {
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}

impl fmt::Debug for Readiness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Readiness")
            .field("epoll_fd", &self.epoll.as_raw_fd())
            .finish()
    }
}

/// A [`Readiness`] created on first use; shared by the three event sources.
#[derive(Default)]
pub(crate) struct ReadinessCell(OnceLock<Readiness>);

impl ReadinessCell {
    /// The handle watching `fd` (which must stay open while the owner of
    /// this cell lives), created now if needed.
    pub(crate) fn get_or_watch(&self, fd: RawFd, what: &'static str) -> Result<&Readiness> {
        if let Some(r) = self.0.get() {
            return Ok(r);
        }
        let r = Readiness::watch(fd).map_err(|source| Error::Io { what, source })?;
        // A racing caller may have stored its handle first: both watch the same
        // descriptor, ours is closed.
        Ok(self.0.get_or_init(|| r))
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

#[cfg(test)]
mod tests {
    use std::time::Instant;

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
    fn registry_counts_only_registered_pairs() {
        let reg = CqRegistry::default();
        let a = Arc::new(CqEvents::new());
        let b = Arc::new(CqEvents::new());
        reg.register(0x1000, &a);
        let got = reg.counter(0x1000, Arc::as_ptr(&a)).expect("registered");
        assert!(Arc::ptr_eq(&got, &a));
        drop(got);
        // A foreign CQ: unknown address, or a known address with another context.
        assert!(reg.counter(0x2000, Arc::as_ptr(&a)).is_none());
        assert!(reg.counter(0x1000, Arc::as_ptr(&b)).is_none());
        assert!(reg.counter(0x1000, std::ptr::null()).is_none());
        // A dropped CQ's counter is not reached, and its entry goes on the next registration.
        let a_ptr = Arc::as_ptr(&a);
        drop(a);
        assert!(reg.counter(0x1000, a_ptr).is_none());
        assert_eq!(reg.len(), 1);
        reg.register(0x1000, &b);
        assert_eq!(reg.len(), 1);
        assert!(reg.counter(0x1000, Arc::as_ptr(&b)).is_some());
    }

    /// The readiness handle follows the watched descriptor and cannot read
    /// from it (a pipe stands in for the event descriptor).
    #[test]
    fn readiness_reports_without_consuming() {
        use std::io::Read;
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors into fds.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let cell = ReadinessCell::default();
        let r = cell.get_or_watch(fds[0], "test").unwrap();
        assert!(std::ptr::eq(r, cell.get_or_watch(fds[0], "test").unwrap()));
        let ready = |r: &Readiness| {
            poll_readable(
                r.as_raw_fd(),
                Some(Instant::now() + Duration::from_millis(20)),
            )
            .unwrap()
        };
        assert!(!ready(r));
        // SAFETY: writes one byte from a valid buffer to our pipe.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        assert!(ready(r));
        // Level-triggered: still readable, and reading the handle fails.
        assert!(ready(r));
        let mut dup = std::fs::File::from(r.as_fd().try_clone_to_owned().unwrap());
        let e = dup.read(&mut [0u8; 16]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        // The byte is still in the pipe; once it is read, the handle is quiet.
        let mut b = [0u8; 1];
        // SAFETY: reads one byte into a valid buffer from our pipe.
        assert_eq!(unsafe { libc::read(fds[0], b.as_mut_ptr().cast(), 1) }, 1);
        assert!(!ready(r));
        // SAFETY: closing the descriptors we created.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }
}
