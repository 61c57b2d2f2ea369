//! Async integration on tokio (cargo feature `tokio`): completions,
//! operations, rdma_cm connection setup and async events as futures.
//!
//! ```no_run
//! # async fn f() -> rdma_verbs::Result<()> {
//! use rdma_verbs::tokio::{AsyncCq, AsyncQp};
//! use rdma_verbs::prelude::*;
//! let ctx = Context::open(None)?;
//! let pd = Pd::new(&ctx)?;
//! let cq = AsyncCq::new(&ctx, 256)?;
//! let qp = Qp::new(&pd, &cq.cq(), &cq.cq(), QpCaps::default())?;
//! # let remote: rdma_verbs::qp::Endpoint = todo!();
//! let qp = qp.init(InitAttr::new(1, AccessFlags::empty()))?.connect(&remote, None)?;
//! // (or with rdma_cm: AsyncCmId::connect / accept)
//! let qp = AsyncQp::new(qp, &cq, &cq)?;
//! let mut buf = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
//! buf.write_at(0, b"hello")?;
//! let mut done = qp.send(buf).await?; // resolves when the SEND completed
//! done.result()?;
//! let buf = done.take_mr().expect("the buffer comes back");
//! # drop(buf);
//! # Ok(()) }
//! ```
//!
//! An [`AsyncCq`] is a CQ on an [`AsyncChannel`] whose driver task, spawned on
//! the runtime that created it, polls the CQs with work and sleeps on the
//! channel's readiness; each completion goes to the future that awaits it, or
//! to [`AsyncCq::next`]. The runtime needs its IO driver (`enable_io`); a
//! constructor in a runtime without it returns [`Error::InvalidArgument`].
//!
//! Cancellation is safe: a posted buffer belongs to the QP, not to the future.
//! A future dropped after its post leaves the request in flight, and its
//! completion, with the buffers, comes back from [`AsyncCq::next`].
//! Operation futures are `Unpin`: to keep N requests in flight from one task,
//! hold a window of them in a `VecDeque`, poll each new one once (that posts
//! it) and await the oldest (`examples/perf/async_tx.rs`). For a stream where
//! no request needs a future of its own, post with [`AsyncQp::post_send`] /
//! [`AsyncQp::post_recv`] and take the completions in batches with
//! [`AsyncCq::next_batch`]: one lock and one wake-up per batch instead of a
//! future's registration and polls per request (1.4× the synchronous path's
//! instructions per message at 16 in flight, where a future per request costs
//! 2.2×; docs/performance.md, "The async path").
//! Everything here is `Send` and `Sync`; [`AsyncQp`] methods may run from many
//! tasks at once, [`AsyncCq::next`] and [`AsyncCq::next_batch`] are for one
//! consumer task. rdma_cm
//! ([`Listener`], [`AsyncCmId`]) and async events ([`AsyncEventStream`]) are
//! awaited the same way.

mod cm;
mod cq;
mod dispatch;
mod driver;
mod events;
pub mod exchange;
mod op;
mod qp;
mod timer;
mod waiters;

pub use cm::{AsyncCmId, Listener};
pub use cq::{AsyncCq, CqRef, Next, NextBatch};
pub use driver::AsyncChannel;
pub use events::AsyncEventStream;
pub use exchange::ExchangeListener;
pub use qp::{AsyncQp, QpRef};

use std::os::fd::{AsRawFd, RawFd};

use ::tokio::io::Interest;
use ::tokio::io::unix::AsyncFd;

use crate::error::{Error, Result};

/// A readiness handle's descriptor, registered with tokio; its owner lives
/// next to the [`AsyncFd`] and is dropped after it.
struct ReadinessFd(RawFd);

impl AsRawFd for ReadinessFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Registers the readiness descriptor `fd` with the current runtime's
/// reactor for reading.
///
/// # Safety
/// `fd` stays open, and the same descriptor, until the returned `AsyncFd` is
/// dropped (callers keep it in a struct field declared before the owner of
/// `fd`, so it is dropped first).
unsafe fn watch(fd: RawFd, what: &'static str) -> Result<AsyncFd<ReadinessFd>> {
    // SAFETY: per this function's contract.
    unsafe { register(ReadinessFd(fd), what) }
}

/// Registers `inner`'s descriptor with the current runtime's reactor for
/// reading; a typed error outside a runtime or in one without IO (where
/// tokio panics).
///
/// # Safety
/// `inner`'s descriptor stays open, and the same descriptor, until the
/// returned `AsyncFd` is dropped (it is if `inner` owns it).
unsafe fn register<T: AsRawFd>(inner: T, what: &'static str) -> Result<AsyncFd<T>> {
    if ::tokio::runtime::Handle::try_current().is_err() {
        return Err(Error::InvalidArgument {
            what,
            reason:
                "called outside a tokio runtime; call it from a task (e.g. under #[tokio::main])"
                    .into(),
        });
    }
    // A runtime is current (checked above), but tokio panics when it was
    // built without IO; nothing is registered then, so the panic is turned
    // into an error (tokio offers no way to ask first).
    let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: the caller keeps the descriptor open and unchanged for the
        // AsyncFd's life.
        unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
    }));
    match registered {
        Ok(r) => r.map_err(|e| Error::Io {
            what,
            source: e.into_parts().1,
        }),
        Err(_) => Err(Error::InvalidArgument {
            what,
            reason: "the tokio runtime has no IO driver; build it with enable_all() or \
                     enable_io() (as #[tokio::main] does)"
                .into(),
        }),
    }
}
