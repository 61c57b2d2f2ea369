//! The TCP exchange ([`crate::exchange`]) as futures: [`ExchangeListener`]
//! accepts clients and serves them, [`ready`], [`wait_ready`] and
//! [`barrier`] are the ready barrier of the kept connection. The exchange's
//! messages run on tokio's blocking threads (they are a few bytes, answered
//! at once), so no task's thread waits on a peer.

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use ::tokio::io::unix::AsyncFd;

use super::register;
use super::timer::timeout as within;
use crate::error::{Error, Result};
use crate::exchange::{self, ExchangeStream, PeerInfo};
use crate::mr::RemoteMr;
use crate::qp::{Init, Qp, Rc, Rts};

/// The async form of [`exchange::ExchangeListener`]: clients are accepted
/// as futures, and their exchanges run on tokio's blocking threads, so any
/// number of them proceed at once, each in a task of its own.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use std::time::Duration;
/// # use rdma_verbs::prelude::*;
/// # async fn f(pd: Pd, cq: Arc<Cq>) -> rdma_verbs::error::Result<()> {
/// use rdma_verbs::tokio::exchange::{self, ExchangeListener};
/// let listener = Arc::new(ExchangeListener::bind(rdma_verbs::exchange::DEFAULT_PORT)?);
/// loop {
///     let qp = Qp::new(&pd, &cq, &cq, QpCaps::default())?
///         .init(InitAttr::new(1, AccessFlags::empty()))?;
///     // One client: accepted here, its exchange awaited in a task of its own.
///     // (No limit on the wait for a client; each message then gets
///     // PEER_MESSAGE_TIMEOUT. A limit given here bounds each message too.)
///     let conn = listener.accept(None).await?;
///     tokio::spawn(async move {
///         let (qp, _peer, conn) = ExchangeListener::serve_on(conn, qp, None, &[]).await?;
///         // post the receives of `qp`, then tell the client it may send:
///         let _conn = exchange::ready(conn).await?;
///         # drop(qp);
///         Ok::<_, rdma_verbs::error::Error>(())
///     });
/// }
/// # }
/// ```
#[derive(Debug)]
pub struct ExchangeListener {
    listener: AsyncFd<TcpListener>,
}

impl ExchangeListener {
    /// [`exchange::ExchangeListener::bind`], registered with the current
    /// runtime (which needs its IO driver).
    pub fn bind(port: u16) -> Result<ExchangeListener> {
        ExchangeListener::from_blocking(exchange::ExchangeListener::bind(port)?)
    }

    /// Registers a listener with the current runtime.
    pub fn from_blocking(listener: exchange::ExchangeListener) -> Result<ExchangeListener> {
        // SAFETY: the AsyncFd owns the listening socket, so its descriptor
        // stays open and the same for the registration's life.
        let listener = unsafe {
            register(
                listener.into_std(),
                "registering the exchange listener with tokio",
            )?
        };
        Ok(ExchangeListener { listener })
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .get_ref()
            .local_addr()
            .map_err(|source| Error::Io {
                what: "reading the listening address",
                source,
            })
    }

    /// Waits for a client for at most `timeout` (`None`: forever; zero: only
    /// a client already waiting) and returns its connection, as
    /// [`exchange::ExchangeListener::accept`] does (each later message
    /// bounded the same way). Cancel safe: a client is taken from the backlog
    /// only when returned. Tasks may accept on one listener at once (share it
    /// in an `Arc`).
    pub async fn accept(&self, timeout: Option<Duration>) -> Result<ExchangeStream> {
        let accept = async {
            loop {
                let mut ready = self.listener.readable().await.map_err(|source| Error::Io {
                    what: "waiting for the exchange client",
                    source,
                })?;
                match self.try_accept(timeout)? {
                    Some(conn) => return Ok(conn),
                    None => ready.clear_ready(),
                }
            }
        };
        let timed_out = |after| Error::Timeout {
            what: "waiting for the exchange client to connect",
            after,
        };
        match timeout {
            None => accept.await,
            Some(t) if t.is_zero() => self.try_accept(timeout)?.ok_or_else(|| timed_out(t)),
            Some(t) => within(t, accept)
                .await?
                .unwrap_or_else(|| Err(timed_out(t))),
        }
    }

    /// A client already waiting, if any (`None` when the backlog is empty).
    fn try_accept(&self, timeout: Option<Duration>) -> Result<Option<ExchangeStream>> {
        loop {
            match self.listener.get_ref().accept() {
                Ok((stream, _)) => return exchange::accepted(stream, timeout).map(Some),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(source) => {
                    return Err(Error::Io {
                        what: "accepting the exchange connection",
                        source,
                    });
                }
            }
        }
    }

    /// Accepts one client and runs [`serve_on`](Self::serve_on) on it: the
    /// async [`exchange::serve_kept`]. Tasks that each call it on one
    /// listener serve their clients at once.
    pub async fn serve(
        &self,
        qp: Qp<Rc, Init>,
        gid_index: Option<u8>,
        mrs: &[RemoteMr],
        timeout: Option<Duration>,
    ) -> Result<(Qp<Rc, Rts>, PeerInfo, ExchangeStream)> {
        let conn = self.accept(timeout).await?;
        ExchangeListener::serve_on(conn, qp, gid_index, mrs).await
    }

    /// [`ExchangeStream::serve`] on a blocking thread of the runtime: the
    /// exchange of an accepted client, its QP connected before the answer.
    /// Each message waits at most the connection's timeout. The exchange
    /// runs to its end even if the future is dropped (the QP then goes with
    /// it).
    pub async fn serve_on(
        mut conn: ExchangeStream,
        qp: Qp<Rc, Init>,
        gid_index: Option<u8>,
        mrs: &[RemoteMr],
    ) -> Result<(Qp<Rc, Rts>, PeerInfo, ExchangeStream)> {
        let mrs = mrs.to_vec();
        blocking(move || {
            let (qp, peer) = conn.serve(qp, gid_index, &mrs)?;
            Ok((qp, peer, conn))
        })
        .await
    }
}

/// [`ExchangeStream::ready`], awaited; the connection comes back with it.
pub async fn ready(mut conn: ExchangeStream) -> Result<ExchangeStream> {
    blocking(move || conn.ready().map(|()| conn)).await
}

/// [`ExchangeStream::wait_ready`] (at most the connection's timeout),
/// awaited; the connection comes back with it.
pub async fn wait_ready(mut conn: ExchangeStream) -> Result<ExchangeStream> {
    blocking(move || conn.wait_ready().map(|()| conn)).await
}

/// [`ExchangeStream::barrier`] (at most the connection's timeout), awaited;
/// the connection comes back with it.
pub async fn barrier(mut conn: ExchangeStream) -> Result<ExchangeStream> {
    blocking(move || conn.barrier().map(|()| conn)).await
}

/// Runs `f` on the runtime's blocking threads; a panic in it is propagated.
/// Outside a tokio runtime (a future polled by another executor) it is a
/// typed error, where `spawn_blocking` would panic.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    let Ok(rt) = ::tokio::runtime::Handle::try_current() else {
        return Err(Error::InvalidArgument {
            what: "an async exchange step",
            reason: "polled outside a tokio runtime; await it in a tokio task (e.g. under \
                     #[tokio::main])"
                .into(),
        });
    };
    match rt.spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => match e.try_into_panic() {
            Ok(p) => std::panic::resume_unwind(p),
            Err(_) => Err(Error::Other(
                "the exchange's blocking task was cancelled: the runtime is shutting down".into(),
            )),
        },
    }
}
