//! [`AsyncEventStream`]: a device's asynchronous events, awaited.

use std::os::fd::AsRawFd;

use ::tokio::io::unix::AsyncFd;

use super::{ReadinessFd, watch};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::event::{AsyncEvent, AsyncEvents};

/// A context's asynchronous events (port changes, QP/CQ/SRQ errors,
/// `SRQ_LIMIT_REACHED`, ...), one `next().await` at a time.
///
/// Each event is acknowledged as it is read, so dropping QPs and CQs never
/// waits on this stream. Use one stream per context (several split the events).
pub struct AsyncEventStream {
    // Field order is drop order: deregister from tokio while the descriptor is open.
    watched: AsyncFd<ReadinessFd>,
    events: AsyncEvents,
}

impl AsyncEventStream {
    /// A stream of `ctx`'s async events. Needs a tokio runtime.
    pub fn new(ctx: &Context) -> Result<AsyncEventStream> {
        let events = ctx.async_events()?;
        let fd = events.readiness()?.as_raw_fd();
        // SAFETY: the readiness handle belongs to `events`; `watched` is
        // declared before it, so it is dropped first.
        let watched = unsafe { watch(fd, "registering the async event channel with tokio")? };
        Ok(AsyncEventStream { watched, events })
    }

    /// The next event. Cancel safe: an event is read only when it is returned.
    pub async fn next(&mut self) -> Result<AsyncEvent> {
        loop {
            if let Some(ev) = self.events.try_next()? {
                return Ok(ev);
            }
            let mut ready = self.watched.readable().await.map_err(|source| Error::Io {
                what: "waiting for async events",
                source,
            })?;
            match self.events.try_next()? {
                Some(ev) => return Ok(ev),
                None => ready.clear_ready(),
            }
        }
    }
}

impl std::fmt::Debug for AsyncEventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncEventStream").finish_non_exhaustive()
    }
}
