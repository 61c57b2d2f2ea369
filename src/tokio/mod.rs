//! Async integration on tokio (cargo feature `tokio`): completions,
//! operations, rdma_cm connection setup and async events as futures.
//!
//! ```no_run
//! # async fn f() -> rdma_verbs::Result<()> {
//! use rdma_verbs::tokio::{AsyncCq, AsyncQp};
//! use rdma_verbs::{AccessFlags, Context, InitAttr, Pd, Qp, QpCaps};
//! let ctx = Context::open(None)?;
//! let pd = Pd::new(&ctx)?;
//! let cq = AsyncCq::new(&ctx, 256)?;
//! let qp = Qp::new(&pd, &cq.cq(), &cq.cq(), QpCaps::default())?;
//! # let remote: rdma_verbs::Endpoint = todo!();
//! let qp = qp.init(InitAttr::new(1, AccessFlags::empty()))?.connect(&remote, None)?;
//! // (or with rdma_cm: AsyncCmId::connect / accept)
//! let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _qp)| e)?;
//! let mut buf = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
//! buf.write_at(0, b"hello")?;
//! let mut done = qp.send(buf).await?; // resolves when the SEND completed
//! done.result()?;
//! let buf = done.take_mr().expect("the buffer comes back");
//! # drop(buf);
//! # Ok(()) }
//! ```
//!
//! # How it works
//! An [`AsyncCq`] is a CQ on an [`AsyncChannel`]: a completion channel (its
//! own, or shared by many CQs) with a driver task, spawned on the runtime it
//! was created in, that polls each CQ with work, and when a CQ is empty arms
//! it, polls once more and sleeps on the channel's
//! [`Readiness`](crate::Readiness) handle through tokio's `AsyncFd`; the
//! events name the CQs to poll next and are acknowledged in batches. Each completion is handed to the future that
//! awaits it, or queued for [`AsyncCq::next`].
//!
//! [`AsyncQp`] numbers its requests itself and registers each one on its CQ
//! before posting it, so a completion finds its future by (QP number, queue,
//! `wr_id`) whatever order things happen in.
//!
//! The runtime needs its IO driver (`Builder::enable_io` or `enable_all`,
//! as `#[tokio::main]` has): a constructor called, or an rdma_cm wait first
//! polled, in a runtime without it returns [`Error::InvalidArgument`].
//! Tokio offers no way to ask whether a runtime has IO, so that error comes
//! from catching tokio's own panic: the panic hook runs first (printing
//! tokio's message), and in a `panic = "abort"` build the process aborts
//! there, as it would in tokio's own IO types. Tokio's timers are not
//! needed: the driver task and the rdma_cm waits time out on timers of
//! their own (`timerfd`), so a runtime without `enable_time` works too.
//!
//! # Cancel safety
//! The ownership-passing data path is what makes cancellation sound: a posted
//! buffer belongs to the QP, not to the future. Dropping an operation's future
//! after it was posted leaves the request in flight; its completion, with the
//! buffers, is then returned by [`AsyncCq::next`]. Nothing is freed while the
//! NIC may still use it, and nothing is lost: every buffer comes back exactly
//! once, from the operation's future or from `next`, unless the QP is
//! dropped first (which releases them, as for a synchronous [`Qp`](crate::Qp)).
//!
//! # Threading model
//! Everything here is `Send` and `Sync` and works on the multi-threaded
//! runtime. [`AsyncQp`] methods take `&self` and can run from many tasks at
//! once (posting is serialised by a mutex held only for the post).
//! [`AsyncCq::next`] is meant for one consumer task: a second concurrent
//! caller replaces the first one's wake-up. The driver task runs on the
//! runtime that created the [`AsyncCq`]; dropping the `AsyncCq` stops it, and
//! futures still waiting on it then fail instead of hanging. So does shutting
//! that runtime down. Awaiting from another runtime works only while the
//! creating one runs its tasks: a current-thread runtime runs them only
//! inside its `block_on`, so futures awaited elsewhere while it sits idle
//! wait until it runs again. Create the `AsyncCq` on the runtime that awaits
//! its operations.
//!
//! rdma_cm ([`Listener`], [`AsyncCmId`]) and async events ([`AsyncEventStream`])
//! are awaited the same way, through the readiness handles of their channels.

mod cm;
mod cq;
mod driver;
mod events;
mod qp;
mod timer;

pub use cm::{AsyncCmId, Listener};
pub use cq::{AsyncCq, CqRef, Next};
pub use driver::AsyncChannel;
pub use events::AsyncEventStream;
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
