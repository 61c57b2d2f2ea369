//! File-descriptor helpers for the event channels (completion, async, rdma_cm):
//! non-blocking mode and a readiness wait with a deadline.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

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

/// `now + timeout`, saturating far in the future instead of overflowing
/// (a huge timeout means "practically forever", not a panic).
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(Duration::from_secs(1 << 32)))
        .unwrap_or(now)
}

/// Waits until `fd` is readable or `deadline` passes (`None`: no deadline).
/// `Ok(true)`: readable (or interrupted: the caller retries), `Ok(false)`: timed out.
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

#[cfg(test)]
mod tests {
    use super::*;

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
