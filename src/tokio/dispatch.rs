//! The rdma_cm event channel the async layer's ids of one runtime share, and
//! the task that reads it and hands each event to its id's waiter.
//!
//! One channel per runtime instead of one per id: an id costs no descriptor,
//! epoll instance or reactor registration of its own, and one readiness wakes
//! one reader, which routes each event by its id ([`SharedChannel`]). The
//! task runs as long as its runtime; when the runtime shuts down it closes
//! the channel's routes, so waiters on ids that outlive it fail instead of
//! waiting for events nobody reads.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, Weak};

use ::tokio::io::unix::AsyncFd;
use ::tokio::runtime::{Handle, Id};

use super::{ReadinessFd, watch};
use crate::cm::SharedChannel;
use crate::error::{Error, Result};

/// What one runtime holds of `T`, looked up by the runtime's id.
pub(super) type PerRuntime<T> = Mutex<Vec<(Id, Weak<T>)>>;

/// The current runtime's `T` in `registry`, made with `make` if it has none
/// alive. A typed error outside a runtime.
pub(super) fn per_runtime<T>(
    registry: &PerRuntime<T>,
    what: &'static str,
    make: impl FnOnce() -> Result<Arc<T>>,
) -> Result<Arc<T>> {
    let Ok(handle) = Handle::try_current() else {
        return Err(Error::InvalidArgument {
            what,
            reason:
                "called outside a tokio runtime; call it from a task (e.g. under #[tokio::main])"
                    .into(),
        });
    };
    let id = handle.id();
    let mut reg = registry.lock().unwrap_or_else(|p| p.into_inner());
    reg.retain(|(_, w)| w.strong_count() > 0);
    if let Some(t) = reg
        .iter()
        .find(|(i, _)| *i == id)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(t);
    }
    let t = make()?;
    reg.push((id, Arc::downgrade(&t)));
    Ok(t)
}

/// The current runtime's shared rdma_cm event channel, made (with its
/// reader task) on first use.
pub(super) fn shared_channel() -> Result<Arc<SharedChannel>> {
    static CHANNELS: PerRuntime<SharedChannel> = Mutex::new(Vec::new());
    per_runtime(
        &CHANNELS,
        "registering an rdma_cm event channel with tokio",
        || {
            let shared = SharedChannel::new()?;
            let fd = shared.readiness()?.as_raw_fd();
            // SAFETY: the readiness handle belongs to `shared`'s channel; the
            // reader keeps `shared` in a field after `watched`, so the
            // registration goes first.
            let watched = unsafe { watch(fd, "registering an rdma_cm event channel with tokio")? };
            let reader = Reader {
                watched,
                shared: shared.clone(),
            };
            ::tokio::spawn(reader.run());
            Ok(shared)
        },
    )
}

/// The task that reads a shared channel.
struct Reader {
    // Field order is drop order: deregister from tokio while the descriptor is open.
    watched: AsyncFd<ReadinessFd>,
    shared: Arc<SharedChannel>,
}

impl Reader {
    /// Reads and routes events whenever the channel is readable, until the
    /// runtime shuts down (or the channel fails: its waiters fail then too).
    async fn run(self) {
        loop {
            let Ok(mut ready) = self.watched.readable().await else {
                return;
            };
            if self.shared.dispatch().is_err() {
                return;
            }
            // Read until EAGAIN: nothing is waiting unless an event came
            // since, which tokio's readiness tick keeps.
            ready.clear_ready();
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.shared.close();
    }
}
