//! # rdma-verbs
//!
//! Safe Rust bindings to RDMA verbs (libibverbs) and librdmacm.
//!
//! * RAII handles: [`Context`](context::Context), [`Pd`](pd::Pd), [`Mr`](mr::Mr),
//!   [`Cq`](cq::Cq), [`Qp`](qp::Qp); children keep their parents alive, `Drop`
//!   never panics.
//! * The QP state machine in the type system: `post_send` on a QP that is not
//!   in RTS does not compile ([`qp`]).
//! * A data path that safe code cannot misuse: posting moves buffers into the
//!   QP, polling the completion gives them back ([`qp`] explains why it is sound).
//! * RC, UC and UD transports ([`Rc`](qp::Rc), [`Uc`](qp::Uc), [`Ud`](qp::Ud)):
//!   each takes only the requests it can carry (no READ on UC, every UD send
//!   names its [`AddressHandle`](ah::AddressHandle), remote QPN and Q_Key; UD
//!   receives keep the GRH apart).
//! * One path per type: its module (`rdma_verbs::qp::Qp`, `rdma_verbs::cq::Cq`);
//!   the crate root holds the modules, [`Error`] and [`Result`];
//!   `use rdma_verbs::prelude::*` brings in the types most programs name.
//! * [`ffi`]: the raw bindings, generated from rdma-core's headers.
//!
//! The [`guide`] walks from opening a device to an RDMA WRITE application and
//! lists the errors newcomers meet, with what to do about each.
//!
//! # A complete RC program
//! `examples/hello_rc.rs`: run it as `hello_rc server` on one machine and
//! `hello_rc client HOST` on the other (or both in one soft-RoCE guest: see
//! the README). The client SENDs a message; the server receives it and RDMA
//! WRITEs a reply into the region the client advertised.
#![doc = concat!("```no_run\n", include_str!("../examples/hello_rc.rs"), "\n```")]
#![warn(missing_docs)]
// The guide and the blocking rdma_cm docs point to their async counterparts in
// `crate::tokio`, which exists only with the `tokio` feature: without it those
// links have no target. The documentation is checked with every feature
// (`cargo doc --all-features`, as docs.rs builds it), where they resolve.
#![cfg_attr(not(feature = "tokio"), allow(rustdoc::broken_intra_doc_links))]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
// An error built eagerly in `ok_or` allocates its message on the success path too.
#![warn(clippy::or_fun_call)]

pub mod ah;
pub mod channel;
pub mod cm;
pub mod context;
pub mod cq;
pub mod device;
pub mod error;
pub mod event;
pub mod exchange;
pub mod ffi;
#[cfg(feature = "gdr")]
pub mod gdr;
pub mod guide;
mod ledger;
pub mod mr;
pub mod mw;
pub mod pd;
pub mod prelude;
pub mod qp;
pub mod srq;
mod sys;
#[cfg(feature = "tokio")]
pub mod tokio;
mod values;

pub use error::{Error, Result};
