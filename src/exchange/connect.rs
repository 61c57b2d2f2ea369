//! The exchange in `ibv_rc_pingpong`'s order, and the whole connection of an
//! RC QP built on it.

use std::time::Duration;

use super::listener::ExchangeListener;
use super::stream::ExchangeStream;
use super::wire::{PeerInfo, WireMessage};
use crate::error::Result;
use crate::mr::RemoteMr;
use crate::qp::{Init, Qp, Rc, Rts};

/// The client side of an exchange, in `ibv_rc_pingpong`'s order: connect
/// (retrying until `timeout`), send `local`, receive the server's message,
/// send `"done"`. Works with `M` = [`Endpoint`](crate::qp::Endpoint) against a C `ibv_rc_pingpong`
/// server, or `M` = [`PeerInfo`] against a server of this crate.
pub fn client_exchange<M: WireMessage>(
    host: &str,
    port: u16,
    local: &M,
    timeout: Duration,
) -> Result<M> {
    let mut s = ExchangeStream::connect(host, port, timeout)?;
    exchange_as_client(&mut s, local)
}

/// The server side of an exchange, in `ibv_rc_pingpong`'s order: accept one
/// client (waiting at most `timeout`, `None`: forever; each message then at
/// most as long, or [`PEER_MESSAGE_TIMEOUT`](super::PEER_MESSAGE_TIMEOUT)), receive its message,
/// run `before_reply` on it (connect the QP here, so it is ready when the
/// client's first message arrives), send `local`, receive `"done"`.
///
/// Returns the client's message and what `before_reply` returned. If
/// `before_reply` fails, the connection is closed without an answer (as the
/// C program does) and its error is returned.
pub fn server_exchange<M: WireMessage, T>(
    listener: &ExchangeListener,
    local: &M,
    timeout: Option<Duration>,
    before_reply: impl FnOnce(&M) -> Result<T>,
) -> Result<(M, T)> {
    let mut s = listener.accept(timeout)?;
    exchange_as_server(&mut s, local, before_reply)
}

/// Connects `qp` to a server of this crate ([`serve`]): sends this side's
/// endpoint and `mrs`, receives the server's, moves the QP to RTS, and
/// returns it with what the server advertised (its regions to WRITE/READ).
///
/// `gid_index` `None` picks [`Context::default_gid_index`](crate::context::Context::default_gid_index)
/// (the RoCE v2 GID on RoCE). Connecting retries until `timeout`; every
/// message sent or received is bounded by it too.
///
/// The QP is connected with [`Qp::connect`]'s defaults, which allow one
/// outstanding RDMA READ or atomic each way; for more, exchange with
/// [`client_exchange`] / [`server_exchange`] and move the QP through
/// [`Qp::rtr`] and [`Qp::rts`] with `max_dest_rd_atomic` / `max_rd_atomic`
/// raised.
pub fn connect_client(
    host: &str,
    port: u16,
    qp: Qp<Rc, Init>,
    gid_index: Option<u8>,
    mrs: &[RemoteMr],
    timeout: Duration,
) -> Result<(Qp<Rc, Rts>, PeerInfo)> {
    let (qp, remote, _) = connect_client_kept(host, port, qp, gid_index, mrs, timeout)?;
    Ok((qp, remote))
}

/// [`connect_client`], also returning the exchange connection, still open: keep it for
/// as long as the QP is connected and check [`ExchangeStream::peer_closed`] while waiting
/// for completions, to report a dead peer at once instead of after a timeout (the server
/// side must keep its end too: [`serve_kept`]).
pub fn connect_client_kept(
    host: &str,
    port: u16,
    qp: Qp<Rc, Init>,
    gid_index: Option<u8>,
    mrs: &[RemoteMr],
    timeout: Duration,
) -> Result<(Qp<Rc, Rts>, PeerInfo, ExchangeStream)> {
    let local = local_peer_info(&qp, gid_index, mrs)?;
    let mut s = ExchangeStream::connect(host, port, timeout)?;
    let remote = exchange_as_client(&mut s, &local)?;
    let qp = qp.connect(&remote.endpoint, gid_index)?;
    Ok((qp, remote, s))
}

/// The server side of [`connect_client`]: waits for one client on `listener`
/// (at most `timeout`, `None`: forever; see [`ExchangeListener::accept`] for
/// the messages), connects `qp` to it *before*
/// answering (so the client's first message finds it ready), sends this
/// side's endpoint and `mrs`, and returns the QP in RTS with what the client
/// advertised. If connecting fails, the client sees the connection closed
/// ([`Error::PeerGaveUp`](crate::Error::PeerGaveUp)) and this side gets the error.
pub fn serve(
    listener: &ExchangeListener,
    qp: Qp<Rc, Init>,
    gid_index: Option<u8>,
    mrs: &[RemoteMr],
    timeout: Option<Duration>,
) -> Result<(Qp<Rc, Rts>, PeerInfo)> {
    let (qp, remote, _) = serve_kept(listener, qp, gid_index, mrs, timeout)?;
    Ok((qp, remote))
}

/// [`serve`], also returning the exchange connection, still open (see
/// [`connect_client_kept`]).
pub fn serve_kept(
    listener: &ExchangeListener,
    qp: Qp<Rc, Init>,
    gid_index: Option<u8>,
    mrs: &[RemoteMr],
    timeout: Option<Duration>,
) -> Result<(Qp<Rc, Rts>, PeerInfo, ExchangeStream)> {
    let mut s = listener.accept(timeout)?;
    let (qp, remote) = s.serve(qp, gid_index, mrs)?;
    Ok((qp, remote, s))
}

impl ExchangeStream {
    /// The server side of [`connect_client`] on a connection already
    /// accepted ([`ExchangeListener::accept`], [`ExchangeListener::incoming`]):
    /// what [`serve`] does after accepting. The connection stays open for
    /// [`ready`](Self::ready) / [`wait_ready`](Self::wait_ready) and
    /// [`peer_closed`](Self::peer_closed).
    ///
    /// Each message waits at most the stream's [`timeout`](Self::timeout), so
    /// a client that connects and stalls fails only its own call (with
    /// [`Error::Timeout`](crate::Error::Timeout)): serving each accepted
    /// client on a thread of its own
    /// ([`ExchangeListener::serve_each`]) keeps it from holding up the others.
    pub fn serve(
        &mut self,
        qp: Qp<Rc, Init>,
        gid_index: Option<u8>,
        mrs: &[RemoteMr],
    ) -> Result<(Qp<Rc, Rts>, PeerInfo)> {
        let local = local_peer_info(&qp, gid_index, mrs)?;
        let (remote, qp) = exchange_as_server(self, &local, |remote: &PeerInfo| {
            qp.connect(&remote.endpoint, gid_index)
        })?;
        Ok((qp, remote))
    }
}

/// The client's half of the four steps on a connected stream: send `local`,
/// receive the server's message, send `"done"`.
fn exchange_as_client<M: WireMessage>(s: &mut ExchangeStream, local: &M) -> Result<M> {
    s.send(local)?;
    let remote = s.recv()?;
    s.send_done()?;
    Ok(remote)
}

/// The server's half of the four steps on an accepted stream: receive the
/// client's message, run `before_reply` on it, send `local`, receive `"done"`.
fn exchange_as_server<M: WireMessage, T>(
    s: &mut ExchangeStream,
    local: &M,
    before_reply: impl FnOnce(&M) -> Result<T>,
) -> Result<(M, T)> {
    let remote = s.recv()?;
    let t = before_reply(&remote)?;
    s.send(local)?;
    s.recv_done()?;
    Ok((remote, t))
}

/// This side's extended message: `qp`'s endpoint and the regions `mrs`.
fn local_peer_info(qp: &Qp<Rc, Init>, gid_index: Option<u8>, mrs: &[RemoteMr]) -> Result<PeerInfo> {
    let mut local = PeerInfo::new(qp.endpoint(gid_index)?);
    local.mrs.extend_from_slice(mrs);
    Ok(local)
}
