//! [`ExchangeListener`]: the server side's listening socket.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::stream::ExchangeStream;
use crate::error::{Error, Result};

/// How long a connected peer may take to send each exchange message when
/// [`ExchangeListener::accept`] was given no timeout.
pub const PEER_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// A listening socket for the server side of an exchange.
#[derive(Debug)]
pub struct ExchangeListener {
    listener: TcpListener,
}

impl ExchangeListener {
    /// Listens on `port` of every IPv4 address (`0.0.0.0`, where
    /// `ibv_rc_pingpong`'s `getaddrinfo(NULL, AI_PASSIVE)` binds), or of every
    /// IPv6 address when IPv4 is unavailable. `SO_REUSEADDR` is set, so a port
    /// is reusable at once after an earlier run.
    pub fn bind(port: u16) -> Result<ExchangeListener> {
        let v4 = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
        match ExchangeListener::bind_addr(v4) {
            Ok(l) => Ok(l),
            Err(e4) => {
                let v6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, port));
                ExchangeListener::bind_addr(v6).map_err(|_| e4)
            }
        }
    }

    /// Listens on one address (port 0 picks a free port; see [`local_addr`](Self::local_addr)).
    pub fn bind_addr(addr: SocketAddr) -> Result<ExchangeListener> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::Io {
            what: "listening for the exchange",
            source: io::Error::new(e.kind(), format!("{addr}: {e}")),
        })?;
        listener.set_nonblocking(true).map_err(|source| Error::Io {
            what: "configuring the listening socket",
            source,
        })?;
        Ok(ExchangeListener { listener })
    }

    /// The listening socket (non-blocking), for the async listener.
    #[cfg(feature = "tokio")]
    pub(crate) fn into_std(self) -> TcpListener {
        self.listener
    }

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr().map_err(|source| Error::Io {
            what: "reading the listening address",
            source,
        })
    }

    /// The clients as they connect, one [`accept`](Self::accept) without a
    /// time limit each (their messages then get [`PEER_MESSAGE_TIMEOUT`]), as
    /// [`TcpListener::incoming`]: the iterator never ends. Hand each
    /// connection to a thread of its own to run its exchange
    /// ([`ExchangeStream::serve`]), so a slow client does not hold up the
    /// next `accept`; [`serve_each`](Self::serve_each) does that for a
    /// known number of clients.
    pub fn incoming(&self) -> Incoming<'_> {
        Incoming { listener: self }
    }

    /// Accepts `clients` clients, running `handle(i, connection)` for the
    /// `i`-th on a thread of its own as soon as it connects, and returns what
    /// each returned, in the order they connected.
    ///
    /// Accepting never waits for a client's messages, so clients are served
    /// concurrently, and one that stalls fails only its own `handle` (each
    /// message waits at most `timeout`, or [`PEER_MESSAGE_TIMEOUT`] with
    /// `None`, as [`accept`](Self::accept)). `timeout` also bounds the wait
    /// for each next client: if one does not come, no more are accepted,
    /// the clients already accepted are still waited for, and the last entry
    /// of the result is the error that stopped accepting (so the result has
    /// fewer than `clients` entries only then; a thread the system refuses
    /// to start stops accepting the same way, with an [`Error::Io`]). A
    /// panic in `handle` is propagated once every thread has ended.
    ///
    /// `handle` may borrow from the caller (the threads are scoped): a PD and
    /// CQ to create each client's QP with, then [`ExchangeStream::serve`].
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use rdma_verbs::prelude::*;
    /// # use rdma_verbs::exchange::{ExchangeListener, DEFAULT_PORT};
    /// # fn f(pd: &Pd, cq: &Cq) -> rdma_verbs::error::Result<()> {
    /// let listener = ExchangeListener::bind(DEFAULT_PORT)?;
    /// let served = listener.serve_each(8, Some(Duration::from_secs(10)), |_, mut conn| {
    ///     let qp = Qp::new(pd, cq, cq, QpCaps::default())?
    ///         .init(InitAttr::new(1, AccessFlags::empty()))?;
    ///     let (qp, _peer) = conn.serve(qp, None, &[])?;
    ///     Ok((qp, conn))
    /// });
    /// for client in served {
    ///     let (qp, mut conn) = client?;
    ///     // post the receives of `qp`, then tell the client it may send:
    ///     conn.ready()?;
    ///     # drop(qp);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn serve_each<T: Send>(
        &self,
        clients: usize,
        timeout: Option<Duration>,
        handle: impl Fn(usize, ExchangeStream) -> Result<T> + Sync,
    ) -> Vec<Result<T>> {
        let handle = &handle;
        std::thread::scope(|scope| {
            // Grows as clients come: `clients` may be a bound, not a count.
            let mut threads = Vec::new();
            let mut stopped = None;
            for i in 0..clients {
                let started = self.accept(timeout).and_then(|conn| {
                    // A thread the system refuses (a pids or memory limit)
                    // ends the serving with an error, not a panic; the
                    // client's connection closes.
                    std::thread::Builder::new()
                        .name(format!("exchange client {i}"))
                        .spawn_scoped(scope, move || handle(i, conn))
                        .map_err(|source| Error::Io {
                            what: "starting a thread for an exchange client",
                            source,
                        })
                });
                match started {
                    Ok(thread) => threads.push(thread),
                    Err(e) => {
                        stopped = Some(e);
                        break;
                    }
                }
            }
            let mut out: Vec<Result<T>> = threads
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect();
            out.extend(stopped.map(Err));
            out
        })
    }

    /// Waits for a client for at most `timeout` (`None`: forever) and returns
    /// the connection, whose reads and writes then get the same limit (with
    /// `None` or a zero timeout, [`PEER_MESSAGE_TIMEOUT`]: a client that
    /// connects and then says nothing must not hold the server forever).
    pub fn accept(&self, timeout: Option<Duration>) -> Result<ExchangeStream> {
        let start = Instant::now();
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => return accepted(stream, timeout),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(source) => {
                    return Err(Error::Io {
                        what: "accepting the exchange connection",
                        source,
                    });
                }
            }
            let wait_ms = match timeout {
                None => -1,
                Some(t) => {
                    let left = t.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(Error::Timeout {
                            what: "waiting for the exchange client to connect",
                            after: t,
                        });
                    }
                    // Round up so a sub-millisecond rest does not spin.
                    i32::try_from(left.as_millis().saturating_add(1)).unwrap_or(i32::MAX)
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: pfd is one valid pollfd for the listener's open descriptor.
            let rc = unsafe { libc::poll(&mut pfd, 1, wait_ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(Error::Io {
                        what: "waiting for the exchange client",
                        source: e,
                    });
                }
            }
        }
    }
}

/// A connection just accepted, as [`ExchangeListener::accept`] returns it:
/// blocking, each message bounded by `timeout` (with `None` or zero,
/// [`PEER_MESSAGE_TIMEOUT`]).
pub(crate) fn accepted(stream: TcpStream, timeout: Option<Duration>) -> Result<ExchangeStream> {
    let mut s = ExchangeStream::from_tcp(stream)?;
    let limit = timeout.filter(|t| !t.is_zero());
    s.set_timeout(Some(limit.unwrap_or(PEER_MESSAGE_TIMEOUT)))?;
    Ok(s)
}

/// The clients of an [`ExchangeListener`] as they connect; see
/// [`ExchangeListener::incoming`].
#[derive(Debug)]
pub struct Incoming<'a> {
    listener: &'a ExchangeListener,
}

impl Iterator for Incoming<'_> {
    type Item = Result<ExchangeStream>;

    fn next(&mut self) -> Option<Result<ExchangeStream>> {
        Some(self.listener.accept(None))
    }
}
