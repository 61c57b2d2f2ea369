//! [`ExchangeListener`]: the server side's listening socket.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};
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

    /// The address listened on.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr().map_err(|source| Error::Io {
            what: "reading the listening address",
            source,
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
                Ok((stream, _)) => {
                    let mut s = ExchangeStream::from_tcp(stream)?;
                    let limit = timeout.filter(|t| !t.is_zero());
                    s.set_timeout(Some(limit.unwrap_or(PEER_MESSAGE_TIMEOUT)))?;
                    return Ok(s);
                }
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
