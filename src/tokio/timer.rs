//! Timers on a `timerfd` watched by the runtime's IO driver, so that the
//! crate's futures need a runtime with IO only: tokio's own timers panic on
//! a runtime built without them (`enable_io()` alone), inside the driver
//! task or the caller's future.

use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use ::tokio::io::unix::AsyncFd;

use crate::error::{Error, Result};

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
/// timer: no limit).
pub(crate) async fn timeout<F: Future>(after: Duration, fut: F) -> Result<Option<F::Output>> {
    let timer = FdTimer::new(after, None)?;
    ::tokio::select! {
        biased;
        out = fut => Ok(Some(out)),
        t = timer.tick() => t.map(|()| None),
    }
}
