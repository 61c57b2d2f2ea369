//! Memory windows: a peer's access to a range of a region, granted and
//! revoked through the send queue.
//!
//! A window ([`Mw`], `ibv_alloc_mw`) is allocated in a [`Pd`](crate::pd::Pd)
//! and bound to a range of an [`Mr`](crate::mr::Mr) whose registration has
//! [`MW_BIND`](crate::mr::AccessFlags::MW_BIND), with its own rights (a
//! subset of REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC) and its own rkey. The
//! region's rkey is never handed out: the window's is, and
//! revoking the window cuts the peer off without touching the registration.
//!
//! - **Type 2** (what RoCE NICs and soft-RoCE implement): bound with
//!   [`Qp::post_bind_mw`](crate::qp::Qp::post_bind_mw), a BIND_MW work
//!   request, and revoked with [`Qp::post_local_inv`](crate::qp::Qp::post_local_inv)
//!   (LOCAL_INV) or by the peer's SEND with invalidate
//!   ([`Qp::post_send_inv`](crate::qp::Qp::post_send_inv)); the receiver's
//!   completion names the rkey it invalidated
//!   ([`Completion::invalidated_rkey`](crate::cq::Completion::invalidated_rkey)).
//! - **Type 1**: bound with `ibv_bind_mw` through the same call (the provider
//!   posts it on the send queue); revoked by a zero-length bind
//!   ([`Qp::post_unbind_mw`](crate::qp::Qp::post_unbind_mw)). Type 1 windows
//!   cannot be invalidated (IB spec o10-37.2.26).
//!
//! Every bind and invalidation is a work request of the safe path: its
//! completion arrives on the send CQ with the request's `wr_id`
//! ([`WcOpcode::BindMw`](crate::cq::WcOpcode::BindMw),
//! [`WcOpcode::LocalInv`](crate::cq::WcOpcode::LocalInv)). The window grants
//! access once that completion is polled with `Success`; a completion in error
//! moves the QP to ERR, as any failed send does.
//!
//! # Lifetimes
//! A window keeps every region it was bound to registered and allocated until
//! it is deallocated (dropping the `Mw`), and the QP keeps the window itself
//! alive while a request naming it is in flight, so no peer can reach memory
//! that was freed. `docs/soundness.md` has the argument.

pub(crate) mod window;

pub(crate) use window::{BindPlan, MwInner, WindowHolder};
pub use window::{Mw, MwType};
