//! [`ExchangeStream`]: one TCP connection of an exchange, each message
//! bounded by a time limit.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::wire::{WireMessage, read_done, read_up_to, write_done};
use crate::error::{Error, Result};

/// How long [`ExchangeStream::connect`] waits between attempts.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// The ready signal of [`ExchangeStream::ready`]: `"ready"` and a NUL, in the
/// style of the closing `"done"`.
pub const READY_MSG: &[u8; 6] = b"ready\0";

/// One TCP connection of an exchange, with a time limit on each message.
#[derive(Debug)]
pub struct ExchangeStream {
    stream: TcpStream,
    timeout: Option<Duration>,
}

/// Turns a socket timeout (`WouldBlock`/`TimedOut` from a timed read/write)
/// into [`Error::Timeout { .. }`](Error::Timeout).
fn map_timeout(e: Error, timeout: Option<Duration>) -> Error {
    match (e, timeout) {
        (Error::Io { what, source }, Some(after))
            if matches!(
                source.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Error::Timeout { what, after }
        }
        (e, _) => e,
    }
}

/// The addresses of `host:port`, looked up for at most `limit`. A literal
/// address needs no lookup; a name is looked up (`getaddrinfo`, which has no
/// deadline of its own) on a thread of its own, left to finish alone when
/// the limit passes first.
fn resolve(host: &str, port: u16, limit: Duration) -> io::Result<Vec<SocketAddr>> {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = host.to_owned();
    std::thread::Builder::new()
        .name("exchange-resolve".into())
        .spawn(move || {
            let addrs = (name.as_str(), port)
                .to_socket_addrs()
                .map(Iterator::collect::<Vec<_>>);
            // The caller may have stopped waiting.
            let _ = tx.send(addrs);
        })?;
    rx.recv_timeout(limit).unwrap_or_else(|_| {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("looking up {host} took longer than {limit:?}"),
        ))
    })
}

impl ExchangeStream {
    /// Connects to `host:port`, retrying refused or failed attempts (the
    /// server may not be listening yet) until `timeout` has passed; then uses
    /// `timeout` as the limit of each later message.
    ///
    /// `host` is a name or an address (`10.99.0.1`, `fe80::1%eth0`); every
    /// address it resolves to is tried, as `ibv_rc_pingpong` does. The
    /// name's lookup counts against `timeout` too: a resolver that does not
    /// answer in time ends the call with the other failures.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<ExchangeStream> {
        let start = Instant::now();
        let mut last: Option<io::Error> = None;
        loop {
            match resolve(host, port, timeout.saturating_sub(start.elapsed())) {
                Ok(addrs) => {
                    for addr in addrs {
                        let left = timeout.saturating_sub(start.elapsed());
                        if left.is_zero() {
                            break;
                        }
                        match TcpStream::connect_timeout(&addr, left) {
                            Ok(stream) => {
                                let mut s = ExchangeStream::from_tcp(stream)?;
                                s.set_timeout(Some(timeout))?;
                                return Ok(s);
                            }
                            Err(e) => last = Some(e),
                        }
                    }
                }
                Err(e) => last = Some(e),
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                let last = last.unwrap_or_else(|| io::Error::from(io::ErrorKind::TimedOut));
                return Err(Error::Io {
                    what: "connecting to the exchange server",
                    source: io::Error::new(
                        last.kind(),
                        format!("{host}:{port}: {last} (kept trying for {timeout:?})"),
                    ),
                });
            }
            std::thread::sleep(left.min(RETRY_INTERVAL));
        }
    }

    /// Wraps a connected stream (blocking mode, no time limit until
    /// [`set_timeout`](Self::set_timeout)).
    pub fn from_tcp(stream: TcpStream) -> Result<ExchangeStream> {
        stream.set_nonblocking(false).map_err(|source| Error::Io {
            what: "configuring the exchange socket",
            source,
        })?;
        // Small messages, answered at once: do not let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        Ok(ExchangeStream {
            stream,
            timeout: None,
        })
    }

    /// Sets the time limit of each message sent or received (`None`: wait
    /// forever); a message that takes longer fails with
    /// [`Error::Timeout { .. }`](Error::Timeout), however its bytes trickle in.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a zero limit (a socket cannot have
    /// one; `None` waits without a limit).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        if timeout.is_some_and(|t| t.is_zero()) {
            return Err(Error::InvalidArgument {
                what: "exchange message timeout",
                reason: "zero (give a positive limit, or None to wait without one)".into(),
            });
        }
        self.stream
            .set_read_timeout(timeout)
            .and_then(|()| self.stream.set_write_timeout(timeout))
            .map_err(|source| Error::Io {
                what: "setting the exchange socket's timeout",
                source,
            })?;
        self.timeout = timeout;
        Ok(())
    }

    /// The time limit of each message (`None`: none).
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout
    }

    /// Sends one message.
    pub fn send<M: WireMessage>(&mut self, msg: &M) -> Result<()> {
        msg.write_to(&mut self.for_one_message())
            .map_err(|e| map_timeout(e, self.timeout))
    }

    /// Receives one message.
    pub fn recv<M: WireMessage>(&mut self) -> Result<M> {
        M::read_from(&mut self.for_one_message()).map_err(|e| map_timeout(e, self.timeout))
    }

    /// Sends the closing `"done"`.
    pub fn send_done(&mut self) -> Result<()> {
        write_done(&mut self.for_one_message()).map_err(|e| map_timeout(e, self.timeout))
    }

    /// Receives the closing `"done"`.
    pub fn recv_done(&mut self) -> Result<()> {
        read_done(&mut self.for_one_message()).map_err(|e| map_timeout(e, self.timeout))
    }

    /// Tells the peer that this side is ready (sends [`READY_MSG`]): for a
    /// receiver, that its receives are posted, so the peer's sends find them.
    /// The peer waits for it with [`wait_ready`](Self::wait_ready).
    ///
    /// Use it on the connection kept after the exchange
    /// ([`serve_kept`](super::serve_kept), [`connect_client_kept`](super::connect_client_kept),
    /// [`ExchangeStream::serve`]), once the QP is connected: a sender that
    /// starts before the peer's receives are posted meets RNR NAKs, or, with
    /// `rnr_retry` 0, an `RNR_RETRY_EXC_ERR` completion.
    pub fn ready(&mut self) -> Result<()> {
        let mut w = self.for_one_message();
        w.write_all(READY_MSG)
            .and_then(|()| w.flush())
            .map_err(|source| {
                let e = Error::Io {
                    what: "sending the ready signal",
                    source,
                };
                closed_as_peer_closed(map_timeout(e, self.timeout))
            })
    }

    /// Waits for the peer's [`ready`](Self::ready), at most the stream's
    /// [`timeout`](Self::timeout) (none: without a limit).
    ///
    /// # Errors
    /// [`Error::Timeout`] when the signal does not come in time;
    /// [`Error::PeerClosed`] when the peer closed the connection (its process
    /// exited or was killed) instead; [`Error::Protocol`] for anything but
    /// [`READY_MSG`].
    pub fn wait_ready(&mut self) -> Result<()> {
        let mut buf = [0u8; READY_MSG.len()];
        let timeout = self.timeout;
        let got = read_up_to(&mut self.for_one_message(), &mut buf).map_err(|source| {
            let e = Error::Io {
                what: "waiting for the peer's ready signal",
                source,
            };
            closed_as_peer_closed(map_timeout(e, timeout))
        })?;
        match &buf[..got] {
            b if b == READY_MSG => Ok(()),
            [] => Err(Error::PeerClosed {
                waiting_for: "its ready signal",
            }),
            other => Err(Error::Protocol(format!(
                "expected the ready signal \"ready\\0\", got {:?}{}",
                String::from_utf8_lossy(other),
                if got < buf.len() {
                    " and then the connection closed"
                } else {
                    ""
                }
            ))),
        }
    }

    /// A barrier of both sides: [`ready`](Self::ready), then
    /// [`wait_ready`](Self::wait_ready). When both sides call it, neither
    /// returns before the other has called it (the signal is a few bytes, so
    /// sending it first never waits for the peer to read).
    pub fn barrier(&mut self) -> Result<()> {
        self.ready()?;
        self.wait_ready()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Result<SocketAddr> {
        self.stream.peer_addr().map_err(|source| Error::Io {
            what: "reading the peer's address",
            source,
        })
    }

    /// Whether the peer has closed its end of the connection, checked without waiting and
    /// without consuming anything: true once it shut down or its process exited (the
    /// kernel closes a dead process's sockets, so SIGKILL counts), false while it is open
    /// (unread data from the peer counts as open).
    ///
    /// Keeping the exchange connection open for the life of an RDMA connection
    /// ([`connect_client_kept`](super::connect_client_kept), [`serve_kept`](super::serve_kept)) turns it into a liveness signal: a side
    /// waiting for completions that never come can tell a dead peer from a slow one.
    pub fn peer_closed(&self) -> Result<bool> {
        let io_err = |source| Error::Io {
            what: "checking the exchange connection",
            source,
        };
        // One non-blocking peek (MSG_DONTWAIT), leaving the socket's mode
        // alone: switching the shared socket to non-blocking and back let a
        // call on another thread switch it back before this one peeked, and
        // the peek then waited for data.
        let mut byte = 0u8;
        // SAFETY: the descriptor is this stream's open socket for the whole
        // call; the buffer is one writable byte on this frame.
        let n = unsafe {
            libc::recv(
                self.stream.as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        let peeked = usize::try_from(n).map_err(|_| io::Error::last_os_error());
        match peeked {
            Ok(0) => Ok(true),
            Ok(_) => Ok(false),
            Err(e) => match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(false),
                io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => Ok(true),
                _ => Err(io_err(e)),
            },
        }
    }

    /// The TCP stream, with the time limit as its read and write timeouts
    /// (a message's reads left them at what was left of its limit).
    pub fn into_inner(self) -> TcpStream {
        let _ = self.stream.set_read_timeout(self.timeout);
        let _ = self.stream.set_write_timeout(self.timeout);
        self.stream
    }

    /// The stream for one message, within the time limit (if any).
    fn for_one_message(&self) -> DeadlineStream<'_> {
        DeadlineStream {
            stream: &self.stream,
            deadline: self.timeout.and_then(|t| Instant::now().checked_add(t)),
        }
    }
}

/// A reset or broken connection met while waiting for the peer: it closed
/// its end (a killed process's socket is reset when data is unread).
fn closed_as_peer_closed(e: Error) -> Error {
    match e {
        Error::Io { source, .. }
            if matches!(
                source.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::BrokenPipe
            ) =>
        {
            Error::PeerClosed {
                waiting_for: "its ready signal",
            }
        }
        e => e,
    }
}

/// The stream for one message: each read or write waits at most what is
/// left of the message's time limit. A socket timeout alone bounds each
/// read, so a peer sending a byte at a time could stretch one message (and
/// hold the other side) without end.
struct DeadlineStream<'a> {
    stream: &'a TcpStream,
    deadline: Option<Instant>,
}

impl DeadlineStream<'_> {
    /// Sets the socket's read or write timeout to what is left.
    fn arm(&self, read: bool) -> io::Result<()> {
        let Some(deadline) = self.deadline else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        if read {
            self.stream.set_read_timeout(Some(left))
        } else {
            self.stream.set_write_timeout(Some(left))
        }
    }
}

impl Read for DeadlineStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(true)?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for DeadlineStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(false)?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&mut &*self.stream).flush()
    }
}
