//! Scoped borrowing: posting borrowed buffers inside a scope that cannot end
//! before the NIC is done with them.
//!
//! The ownership-passing path ([`Qp::post_send`](crate::qp::Qp::post_send))
//! moves each request's buffers into the QP and back out of its completion.
//! Inside [`Cq::scope`](crate::cq::Cq::scope) requests *borrow* their buffers
//! instead ([`Src`] from `&Mr`, [`Dst`] from `&mut Mr`), the QP keeps only
//! the request's `wr_id`, and [`Scope::poll`] hands back a small
//! [`ScopedCompletion`]: posting a request costs little more than the C verb.
//!
//! As with `std::thread::scope`, what a scope lends stays borrowed until
//! [`Cq::scope`](crate::cq::Cq::scope) returns, and it returns only once every
//! request posted in it has completed, also after a panic in the closure.
//! Requests still outstanding after [`Scope::set_drain_timeout`] are flushed
//! by moving their QP to the error state
//! ([`Error::ScopeDrained`](crate::Error::ScopeDrained)). The soundness
//! argument is in the repository's `docs/soundness.md`.
//!
//! - [`Scope::attach`] lends a QP to the scope as a [`ScopedQp`], which posts
//!   with [`post_send`](ScopedQp::post_send),
//!   [`post_recv`](ScopedQp::post_recv),
//!   [`post_send_list`](ScopedQp::post_send_list) (32 requests per verb call)
//!   and [`post_prepared`](ScopedQp::post_prepared) (a [`PreparedSends`]
//!   laid out once, posted with one doorbell each time).
//! - [`ScopedBuffers`] lend the buffers of one region one request at a time,
//!   readable and writable between requests; their receives go out one by
//!   one or chained ([`post_recv_list`](ScopedBuffers::post_recv_list)).
//! - A list's iterator runs while its requests are staged from the queue's
//!   head: it may poll the scope and post on the QP's other queue, and a post
//!   on the same queue from it is refused.
//! - Start-up: [`Cq::scope_adopt`](crate::cq::Cq::scope_adopt) owns a QP for
//!   the scope, so a receiver posts its receives in INIT, connects with
//!   [`AdoptedQp::connect`] (then tells its peer to send) and polls; the QP
//!   comes back drained, in RTS. Receives posted before a scope are not its.
//! - Completions that are not the scope's (other QPs on the CQ, requests
//!   posted before the scope) are kept for the next
//!   [`Cq::poll`](crate::cq::Cq::poll).
//!
//! ```no_run
//! # use rdma_verbs::prelude::*;
//! # use rdma_verbs::qp::scope::ScopedSend;
//! # fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, src: &Mr, remote: RemoteMr) -> Result<()> {
//! let src = Src::new(src)?;
//! cq.scope(|s| -> Result<()> {
//!     let mut q = s.attach(qp)?;
//!     q.post_send(&ScopedSend::write(7, src, remote, 0))?;
//!     s.poll_one(std::time::Duration::from_secs(5))?.result()
//! })
//! # }
//! ```

mod adopt;
mod buf;
mod buffers;
mod chunk;
mod drain;
mod listing;
mod poll;
mod post;
mod prepared;
mod request;
mod run;
mod side_table;

use std::time::Duration;

use crate::ffi;

pub use adopt::AdoptedQp;
pub use buf::{Dst, Src};
pub use buffers::{MAX_SCOPED_BUFFERS, ScopedBuffers};
pub use post::{ScopedListError, ScopedQp};
pub use prepared::PreparedSends;
pub use request::{ScopedCompletion, ScopedSend};
pub use run::Scope;
pub(crate) use side_table::ScopedTables;

/// How long [`Cq::scope`] waits for the scope's requests by default before
/// moving their QPs to the error state.
///
/// [`Cq::scope`]: crate::cq::Cq::scope
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The `IBV_SEND_SIGNALED` flag of a send request.
const SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
