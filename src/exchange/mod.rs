//! Out-of-band endpoint exchange over TCP, wire-compatible with `ibv_rc_pingpong`.
//!
//! Before two RC queue pairs can talk, each side must learn the other's
//! [`Endpoint`](crate::qp::Endpoint) (LID, QP number, PSN, GID). rdma-core's example
//! programs send it over a TCP connection as text; this module speaks exactly that
//! protocol, so a Rust program can connect to a C `ibv_rc_pingpong` and the reverse.
//! Its extended form, [`PeerInfo`], also carries the memory regions a peer may
//! RDMA WRITE or READ. [`WireMessage`] describes both formats byte for byte.
//!
//! # How to use it
//! * [`connect_client`] and [`serve`] do the whole connection of an RC QP:
//!   exchange, then INIT → RTR → RTS on each side (the server before it answers).
//!   Their `_kept` forms also return the TCP connection, whose
//!   [`ExchangeStream::peer_closed`] tells a dead peer from a slow one.
//! * Many clients: [`ExchangeListener::serve_each`] serves each on a thread of
//!   its own, [`ExchangeListener::incoming`] hands out the connections, and
//!   [`ExchangeStream::serve`] runs the server's exchange on one (the async
//!   form is `rdma_verbs::tokio::exchange`). On a kept connection,
//!   [`ExchangeStream::ready`] / [`ExchangeStream::wait_ready`] (or
//!   [`ExchangeStream::barrier`]) keep a sender from starting before its
//!   peer's receives are posted.
//! * [`client_exchange`] and [`server_exchange`] only exchange the messages, in
//!   `ibv_rc_pingpong`'s order; [`ExchangeStream`] and [`ExchangeListener`] are the
//!   pieces for other orders.
//!
//! # Errors
//! Malformed, truncated or oversized input is an [`Error::Protocol`]; a
//! failing socket an [`Error::Io`]; a read or write that ran out of time an
//! [`Error::Timeout { .. }`](Error::Timeout). Nothing here panics on what a peer sends.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_verbs::exchange::{client_exchange, DEFAULT_PORT};
//! # fn f(local: rdma_verbs::qp::Endpoint) -> rdma_verbs::Result<()> {
//! let remote = client_exchange("10.99.0.1", DEFAULT_PORT, &local, Duration::from_secs(10))?;
//! println!("remote: {remote}");
//! # Ok(()) }
//! ```

#[cfg(doc)]
use crate::error::Error;

mod connect;
mod listener;
mod stream;
mod wire;

pub use connect::{
    client_exchange, connect_client, connect_client_kept, serve, serve_kept, server_exchange,
};
#[cfg(feature = "tokio")]
pub(crate) use listener::accepted;
pub use listener::{ExchangeListener, Incoming, PEER_MESSAGE_TIMEOUT};
pub use stream::{ExchangeStream, READY_MSG};
pub use wire::{
    DONE_MSG, ENDPOINT_MSG_LEN, MAX_REMOTE_MRS, MR_HEADER_LEN, MR_RECORD_LEN, PeerInfo,
    WireMessage, encode_endpoint, encode_peer_info, parse_endpoint, parse_mr_header,
    parse_mr_record, parse_peer_info, read_done, write_done,
};

/// The TCP port `ibv_rc_pingpong` uses by default.
pub const DEFAULT_PORT: u16 = 18515;
