//! Timers on a `timerfd` watched by the runtime's IO driver, so that the
//! crate's futures need a runtime with IO only: tokio's own timers panic on
//! a runtime built without them (`enable_io()` alone), inside the driver
//! task or the caller's future.
//!
//! The waits of [`timeout`] share one `timerfd` per runtime ([`Timers`]: a
//! heap of deadlines, the descriptor armed for the earliest); [`FdTimer`] is
//! a descriptor of its own, for a periodic timer.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context as TaskContext, Poll, Waker};
use std::time::{Duration, Instant};

use ::tokio::io::unix::AsyncFd;

use super::dispatch::{PerRuntime, per_runtime};
use crate::error::{Error, Result};
use crate::sys::wake::wake_all;

/// A `timerfd` (CLOCK_MONOTONIC) registered with the current runtime.
pub(crate) struct FdTimer {
    fd: AsyncFd<OwnedFd>,
}

impl FdTimer {
    /// Expires `after` from now, then every `period` if given; a time too
    /// long for the kernel's `timespec` never expires. A typed error outside
    /// a runtime with IO (a future awaited on another runtime than the one
    /// that made its id, say).
    pub(crate) fn new(after: Duration, period: Option<Duration>) -> Result<FdTimer> {
        let io_err = |source| Error::Io {
            what: "creating a timer (timerfd)",
            source,
        };
        // SAFETY: plain syscall; the result is checked.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        };
        if raw < 0 {
            return Err(io_err(io::Error::last_os_error()));
        }
        // SAFETY: a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        if let Some(value) = timespec(after) {
            let spec = libc::itimerspec {
                it_value: value,
                it_interval: period.and_then(timespec).unwrap_or(libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                }),
            };
            // SAFETY: valid timerfd and itimerspec; the old value is not asked for.
            let rc =
                unsafe { libc::timerfd_settime(fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
            if rc != 0 {
                return Err(io_err(io::Error::last_os_error()));
            }
        }
        // SAFETY: the AsyncFd owns the descriptor, which stays open until it
        // has been deregistered (the AsyncFd drops its inner value last).
        let fd = unsafe { super::register(fd, "registering a timer with tokio")? };
        Ok(FdTimer { fd })
    }

    /// Waits for the next expiry (at once if one passed since the last
    /// call). Cancel safe: an expiry is consumed only when this returns.
    pub(crate) async fn tick(&self) -> Result<()> {
        loop {
            let mut ready = self.fd.readable().await.map_err(|source| Error::Io {
                what: "waiting for a timer (timerfd)",
                source,
            })?;
            let mut expiries = 0u64;
            // SAFETY: valid descriptor; reads 8 bytes into a u64.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    (&raw mut expiries).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            if n == std::mem::size_of::<u64>() as isize {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::WouldBlock {
                return Err(Error::Io {
                    what: "reading a timer (timerfd)",
                    source: e,
                });
            }
            ready.clear_ready();
        }
    }
}

/// `d` as a `timespec`, at least 1 ns (0 would disarm the timer); `None`
/// when its seconds do not fit.
fn timespec(d: Duration) -> Option<libc::timespec> {
    let d = d.max(Duration::from_nanos(1));
    Some(libc::timespec {
        tv_sec: libc::time_t::try_from(d.as_secs()).ok()?,
        tv_nsec: d.subsec_nanos().into(),
    })
}

/// `fut`, or `None` once `after` has passed first (`after` too long for a
/// deadline: no limit). The deadline is one of the current runtime's
/// [`Timers`], taken at the first poll; a typed error outside a runtime with
/// IO.
pub(crate) fn timeout<F: Future>(after: Duration, fut: F) -> Timeout<F> {
    Timeout {
        fut,
        after,
        sleep: None,
    }
}

/// The future of [`timeout`]: `fut` polled first, then the deadline. A struct
/// rather than an `async fn`, which would keep `fut` twice (its argument and
/// the future it awaits), and this future is in every rdma_cm wait.
#[must_use = "futures do nothing unless polled"]
pub(crate) struct Timeout<F> {
    /// Pinned with the `Timeout`: never moved out of, dropped in place.
    fut: F,
    after: Duration,
    /// Set at the first poll; `Some(None)`: no limit.
    sleep: Option<Option<Sleep>>,
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<Option<F::Output>>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        // SAFETY: `fut` is structurally pinned: it is only ever reached as
        // `Pin<&mut F>` below, never moved out of or replaced, and `Timeout`
        // has no `Drop` of its own and is `Unpin` only when `F` is. The other
        // fields are not pinned (`Sleep` is `Unpin`).
        let this = unsafe { self.get_unchecked_mut() };
        if this.sleep.is_none() {
            let timers = match Timers::current() {
                Ok(t) => t,
                Err(e) => return Poll::Ready(Err(e)),
            };
            this.sleep = Some(match Sleep::new(&timers, this.after) {
                None => None,
                Some(Ok(sleep)) => Some(sleep),
                Some(Err(e)) => return Poll::Ready(Err(e)),
            });
        }
        // SAFETY: as above: `fut` stays where it is until the `Timeout` is dropped.
        let fut = unsafe { Pin::new_unchecked(&mut this.fut) };
        if let Poll::Ready(out) = fut.poll(cx) {
            return Poll::Ready(Ok(Some(out)));
        }
        match &mut this.sleep {
            Some(Some(sleep)) => Pin::new(sleep).poll(cx).map(|t| t.map(|()| None)),
            _ => Poll::Pending,
        }
    }
}

/// The deadlines of one runtime's waits, on one `timerfd` armed for the
/// earliest, which a task of the runtime watches: a wait costs a heap entry,
/// not a descriptor, a registration and three system calls.
pub(crate) struct Timers {
    state: Mutex<Deadlines>,
    /// Dropped after the task's registration of it.
    fd: OwnedFd,
}

/// The pending deadlines, earliest first, and who waits for each.
struct Deadlines {
    /// (deadline, key); a key no longer in `waits` was cancelled.
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    waits: HashMap<u64, Wait>,
    /// What the timerfd is set to.
    armed: Option<Instant>,
    next_key: u64,
    /// The task stopped (its runtime shut down): waits fail.
    closed: bool,
}

struct Wait {
    deadline: Instant,
    fired: bool,
    waker: Option<Waker>,
}

impl Timers {
    /// The current runtime's timers, made (with their task) on first use.
    fn current() -> Result<Arc<Timers>> {
        static TIMERS: PerRuntime<Timers> = Mutex::new(Vec::new());
        per_runtime(&TIMERS, "registering a timer with tokio", || {
            let timers = Arc::new(Timers {
                state: Mutex::new(Deadlines {
                    heap: BinaryHeap::new(),
                    waits: HashMap::new(),
                    armed: None,
                    next_key: 0,
                    closed: false,
                }),
                fd: timerfd()?,
            });
            // SAFETY: the descriptor belongs to `timers`, which the task keeps
            // in a field after `watched`, so the registration goes first.
            let watched =
                unsafe { super::watch(timers.fd.as_raw_fd(), "registering a timer with tokio")? };
            let task = TimerTask {
                watched,
                timers: timers.clone(),
            };
            ::tokio::spawn(task.run());
            Ok(timers)
        })
    }

    fn lock(&self) -> MutexGuard<'_, Deadlines> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the timerfd to expire at `at` (at least 1 ns from now).
    fn arm(&self, d: &mut Deadlines, at: Instant) -> Result<()> {
        let after = at.saturating_duration_since(Instant::now());
        let spec = libc::itimerspec {
            it_value: timespec(after).unwrap_or(libc::timespec {
                tv_sec: libc::time_t::MAX,
                tv_nsec: 0,
            }),
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
        };
        // SAFETY: valid timerfd and itimerspec; the old value is not asked for.
        let rc =
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) };
        if rc != 0 {
            return Err(Error::Io {
                what: "setting a timer (timerfd)",
                source: io::Error::last_os_error(),
            });
        }
        d.armed = Some(at);
        Ok(())
    }

    /// Fires every deadline that passed and arms the timerfd for the next.
    /// The tasks are woken once the lock is released: a waker may poll its
    /// task, whose wait takes the lock.
    fn fire(&self) -> Result<()> {
        let mut due = Vec::new();
        let armed = {
            let mut d = self.lock();
            let now = Instant::now();
            d.armed = None;
            let mut next = None;
            while let Some(&Reverse((at, key))) = d.heap.peek() {
                if at > now {
                    next = Some(at);
                    break;
                }
                d.heap.pop();
                if let Some(w) = d.waits.get_mut(&key) {
                    w.fired = true;
                    due.extend(w.waker.take());
                }
            }
            next.map_or(Ok(()), |at| self.arm(&mut d, at))
        };
        wake_all(due);
        armed
    }

    /// Fails every wait: nothing fires them any more.
    fn close(&self) {
        let due: Vec<Waker> = {
            let mut d = self.lock();
            d.closed = true;
            d.waits
                .values_mut()
                .filter_map(|w| w.waker.take())
                .collect()
        };
        wake_all(due);
    }
}

/// A wait for one deadline of a runtime's [`Timers`]; dropping it cancels it.
struct Sleep {
    timers: Arc<Timers>,
    key: u64,
}

impl Sleep {
    /// A wait of `after` from now; `None` when that is past what an
    /// `Instant` holds (no limit).
    fn new(timers: &Arc<Timers>, after: Duration) -> Option<Result<Sleep>> {
        let deadline = Instant::now().checked_add(after)?;
        let mut d = timers.lock();
        let key = d.next_key;
        d.next_key += 1;
        d.waits.insert(
            key,
            Wait {
                deadline,
                fired: false,
                waker: None,
            },
        );
        d.heap.push(Reverse((deadline, key)));
        // Cancelled waits stay in the heap until their deadline: rebuild it
        // from the live ones when they are the most of it.
        if d.heap.len() > 64 + 2 * d.waits.len() {
            let live = d.waits.iter().map(|(&k, w)| Reverse((w.deadline, k)));
            d.heap = live.collect();
        }
        let sleep = Sleep {
            timers: timers.clone(),
            key,
        };
        if d.armed.is_none_or(|a| deadline < a) {
            if let Err(e) = timers.arm(&mut d, deadline) {
                drop(d);
                return Some(Err(e));
            }
        }
        Some(Ok(sleep))
    }
}

impl Future for Sleep {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        let mut d = self.timers.lock();
        let closed = d.closed;
        let Some(w) = d.waits.get_mut(&self.key) else {
            return Poll::Ready(Ok(()));
        };
        if w.fired {
            return Poll::Ready(Ok(()));
        }
        if closed {
            return Poll::Ready(Err(Error::InvalidArgument {
                what: "waiting for a timer",
                reason: "the tokio runtime that runs this wait's timer has shut down".into(),
            }));
        }
        let replaced = w.waker.replace(cx.waker().clone());
        // Wakers drop with the lock released: a waker's drop may run an
        // executor's code, which may take it again.
        drop(d);
        drop(replaced);
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        // The guard is a temporary of this statement: the wait (and its
        // waker) drops after the lock is released.
        let wait = self.timers.lock().waits.remove(&self.key);
        drop(wait);
    }
}

/// The task that watches a runtime's timerfd.
struct TimerTask {
    // Field order is drop order: deregister from tokio while the descriptor is open.
    watched: AsyncFd<super::ReadinessFd>,
    timers: Arc<Timers>,
}

impl TimerTask {
    async fn run(self) {
        loop {
            let Ok(mut ready) = self.watched.readable().await else {
                return;
            };
            let mut expiries = 0u64;
            // SAFETY: valid descriptor; reads 8 bytes into a u64.
            let n = unsafe {
                libc::read(
                    self.timers.fd.as_raw_fd(),
                    (&raw mut expiries).cast(),
                    std::mem::size_of::<u64>(),
                )
            };
            if n != std::mem::size_of::<u64>() as isize {
                ready.clear_ready();
                continue;
            }
            if self.timers.fire().is_err() {
                return;
            }
        }
    }
}

impl Drop for TimerTask {
    fn drop(&mut self) {
        self.timers.close();
    }
}

/// A new non-blocking `timerfd` (CLOCK_MONOTONIC, the clock of `Instant`), disarmed.
fn timerfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let raw = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    if raw < 0 {
        return Err(Error::Io {
            what: "creating a timer (timerfd)",
            source: io::Error::last_os_error(),
        });
    }
    // SAFETY: a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits of one runtime share its timer: each ends at its own deadline
    /// whatever order they were made in, a future that ends first wins, and
    /// cancelled waits do not pile up in the heap.
    #[test]
    fn waits_share_one_timer_and_end_at_their_deadlines() {
        let rt = ::tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        rt.block_on(async {
            let t0 = Instant::now();
            let mut set = ::tokio::task::JoinSet::new();
            for i in (1..=20u64).rev() {
                set.spawn(async move {
                    let r = timeout(Duration::from_millis(10 * i), std::future::pending::<()>());
                    assert!(r.await.unwrap().is_none());
                    (i, t0.elapsed())
                });
            }
            assert_eq!(
                timeout(Duration::from_secs(5), async { 7 }).await.unwrap(),
                Some(7)
            );
            while let Some(j) = set.join_next().await {
                let (i, at) = j.unwrap();
                assert!(at >= Duration::from_millis(10 * i), "{i}: {at:?}");
            }
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            let timers = Timers::current().unwrap();
            assert!(Arc::ptr_eq(&timers, &Timers::current().unwrap()));
            for _ in 0..1000 {
                timeout(Duration::from_secs(60), async {}).await.unwrap();
            }
            let d = timers.lock();
            assert!(d.waits.is_empty());
            assert!(d.heap.len() <= 65, "{}", d.heap.len());
        });
    }
}
