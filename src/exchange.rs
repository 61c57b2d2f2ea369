//! Out-of-band endpoint exchange over TCP, wire-compatible with `ibv_rc_pingpong`.
//!
//! Before two RC queue pairs can talk, each side must learn the other's
//! [`Endpoint`] (LID, QP number, PSN, GID). rdma-core's example programs send
//! it over a TCP connection as text; this module speaks exactly that protocol,
//! so a Rust program can connect to a C `ibv_rc_pingpong` and the reverse.
//!
//! # The `ibv_rc_pingpong` protocol
//! One message is `sprintf("%04x:%06x:%06x:%s", lid, qpn, psn, gid)` where
//! `gid` is the 16 GID bytes as 32 lowercase hex digits in network order,
//! sent as a fixed **52-byte** buffer (`sizeof "0000:000000:000000:` + 32
//! zeros + `"`, i.e. 51 characters and the terminating NUL):
//!
//! 1. the client connects and writes its message;
//! 2. the server reads it, connects its QP (`ibv_rc_pingpong` moves it to
//!    RTR/RTS *before* answering, so the client's first SEND finds it ready),
//!    and writes its own message;
//! 3. the client reads that and writes `"done"` with its NUL (5 bytes);
//! 4. the server reads the `"done"`; both close the connection.
//!
//! [`client_exchange`] and [`server_exchange`] run that sequence;
//! [`ExchangeStream`] and [`ExchangeListener`] are the pieces for other orders.
//! [`connect_client`] and [`serve`] do the whole connection of an RC QP
//! (exchange, then INIT → RTR → RTS on each side, the server before it answers).
//!
//! # The extended form: [`PeerInfo`]
//! Programs that RDMA WRITE or READ also need the peer's memory regions
//! ([`RemoteMr`]: address, length, rkey). The extended message is the
//! 52-byte endpoint message followed by
//!
//! * a 10-byte header `"xmr1:%04x\0"`: the magic `xmr1:` and the number of
//!   regions `n` (at most [`MAX_REMOTE_MRS`]), then
//! * `n` records of 43 bytes each, `"%016x:%016x:%08x\0"`: address, length and
//!   rkey of one region.
//!
//! Every part has a fixed size, so a reader knows how much to read before
//! it reads it and never buffers more than 52 + 10 + 43 × 1024 bytes. The same
//! four steps apply (client first, server answers, client writes `"done"`).
//! A C `ibv_rc_pingpong` does not speak the extended form; talking to one with
//! it fails with [`Error::Protocol`] or [`Error::Io`] (never a hang while
//! timeouts are set).
//!
//! # Errors
//! Malformed, truncated or oversized input is an [`Error::Protocol`]; a
//! failing socket an [`Error::Io`]; a read or write that ran out of time an
//! [`Error::Timeout { .. }`](Error::Timeout). Nothing here panics on what a peer sends.
//!
//! ```no_run
//! use std::time::Duration;
//! use rdma_verbs::exchange::{client_exchange, DEFAULT_PORT};
//! # fn f(local: rdma_verbs::Endpoint) -> rdma_verbs::Result<()> {
//! let remote = client_exchange("10.99.0.1", DEFAULT_PORT, &local, Duration::from_secs(10))?;
//! println!("remote: {remote}");
//! # Ok(()) }
//! ```

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::device::Gid;
use crate::error::{Error, Result};
use crate::mr::RemoteMr;
use crate::qp::{Endpoint, Init, Qp, Rc, Rts};

/// The TCP port `ibv_rc_pingpong` uses by default.
pub const DEFAULT_PORT: u16 = 18515;

/// Size of one `ibv_rc_pingpong` endpoint message on the wire, NUL included:
/// `sizeof "0000:000000:000000:00000000000000000000000000000000"`.
pub const ENDPOINT_MSG_LEN: usize = 52;

/// What the client sends last: `"done"` and its NUL (`sizeof "done"` bytes).
pub const DONE_MSG: &[u8; 5] = b"done\0";

/// Size of the header of the extended form's region list.
pub const MR_HEADER_LEN: usize = 10;

/// Size of one region record of the extended form.
pub const MR_RECORD_LEN: usize = 43;

/// The most regions one [`PeerInfo`] may carry.
pub const MAX_REMOTE_MRS: usize = 1024;

/// Magic at the start of the extended form's header.
const MR_MAGIC: &[u8; 5] = b"xmr1:";

/// How long a connected peer may take to send each exchange message when
/// [`ExchangeListener::accept`] was given no timeout.
pub const PEER_MESSAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long [`ExchangeStream::connect`] waits between attempts.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

fn protocol(msg: impl Into<String>) -> Error {
    Error::Protocol(msg.into())
}

/// Shows at most 64 bytes of peer input, escaped, for error messages.
struct Shown<'a>(&'a [u8]);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cut = self.0.len().min(64);
        write!(f, "\"{}\"", self.0[..cut].escape_ascii())?;
        if cut < self.0.len() {
            write!(f, "... ({} bytes)", self.0.len())?;
        }
        Ok(())
    }
}

/// Parses 1 to `max_digits` lowercase or uppercase hex digits.
fn hex_field(field: &[u8], max_digits: usize, what: &str, whole: &[u8]) -> Result<u64> {
    if field.is_empty() || field.len() > max_digits || !field.iter().all(u8::is_ascii_hexdigit) {
        return Err(protocol(format!(
            "{what} is not 1 to {max_digits} hex digits in {}",
            Shown(whole)
        )));
    }
    let mut v = 0u64;
    for &b in field {
        // is_ascii_hexdigit was checked above, so to_digit cannot fail; 16 digits fit a u64.
        let d = char::from(b).to_digit(16).unwrap_or(0);
        v = (v << 4) | u64::from(d);
    }
    Ok(v)
}

/// Parses exactly 32 hex digits into a GID (network order), like rdma-core's
/// `wire_gid_to_gid`.
fn wire_gid(field: &[u8], whole: &[u8]) -> Result<Gid> {
    if field.len() != 32 || !field.iter().all(u8::is_ascii_hexdigit) {
        return Err(protocol(format!(
            "GID is not 32 hex digits in {}",
            Shown(whole)
        )));
    }
    let mut raw = [0u8; 16];
    for (i, byte) in raw.iter_mut().enumerate() {
        let hi = char::from(field[2 * i]).to_digit(16).unwrap_or(0);
        let lo = char::from(field[2 * i + 1]).to_digit(16).unwrap_or(0);
        *byte = ((hi << 4) | lo) as u8;
    }
    Ok(Gid(raw))
}

/// The text of a fixed-size NUL-terminated record: the bytes before the first
/// NUL. Bytes after it are ignored, as `sscanf` in `ibv_rc_pingpong` ignores them.
fn c_text<'a>(buf: &'a [u8], what: &str) -> Result<&'a [u8]> {
    match buf.iter().position(|&b| b == 0) {
        Some(nul) => Ok(&buf[..nul]),
        None => Err(protocol(format!(
            "{what} is not NUL-terminated: {}",
            Shown(buf)
        ))),
    }
}

/// Encodes `ep` as the 52-byte message `ibv_rc_pingpong` sends.
///
/// QP number and PSN must fit 24 bits (they do for every real QP); anything
/// else would not fit the C program's buffer and is refused.
pub fn encode_endpoint(ep: &Endpoint) -> Result<[u8; ENDPOINT_MSG_LEN]> {
    for (what, v) in [("QP number", ep.qpn), ("PSN", ep.psn)] {
        if v > 0x00ff_ffff {
            return Err(Error::InvalidArgument {
                what: "endpoint",
                reason: format!("{what} {v:#x} does not fit 24 bits"),
            });
        }
    }
    let text = format!(
        "{:04x}:{:06x}:{:06x}:{}",
        ep.lid,
        ep.qpn,
        ep.psn,
        ep.gid.to_wire_hex()
    );
    let mut msg = [0u8; ENDPOINT_MSG_LEN];
    // 4 + 1 + 6 + 1 + 6 + 1 + 32 = 51 bytes; the 52nd stays NUL.
    msg[..text.len()].copy_from_slice(text.as_bytes());
    Ok(msg)
}

/// Parses one 52-byte `ibv_rc_pingpong` endpoint message.
///
/// Accepts what C's `sscanf("%x:%x:%x:%s")` + `wire_gid_to_gid` accept for
/// well-formed input: four `:`-separated fields, hex numbers (LID up to
/// `0xffff`, QPN and PSN up to 24 bits) and a 32-hex-digit GID, ended by a
/// NUL within the 52 bytes. Any other length or content is an
/// [`Error::Protocol`].
pub fn parse_endpoint(buf: &[u8]) -> Result<Endpoint> {
    if buf.len() != ENDPOINT_MSG_LEN {
        return Err(protocol(format!(
            "endpoint message has {} bytes, expected {ENDPOINT_MSG_LEN}: {}",
            buf.len(),
            Shown(buf)
        )));
    }
    let text = c_text(buf, "endpoint message")?;
    let mut fields = text.split(|&b| b == b':');
    let (Some(lid), Some(qpn), Some(psn), Some(gid), None) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return Err(protocol(format!(
            "endpoint message is not LID:QPN:PSN:GID: {}",
            Shown(text)
        )));
    };
    let lid = hex_field(lid, 4, "LID", text)?;
    let qpn = hex_field(qpn, 6, "QP number", text)?;
    let psn = hex_field(psn, 6, "PSN", text)?;
    Ok(Endpoint {
        lid: lid as u16,
        qpn: qpn as u32,
        psn: psn as u32,
        gid: wire_gid(gid, text)?,
    })
}

/// One side's endpoint plus the memory regions it lets the peer access: the
/// extended message (see the [module docs](self) for its wire format).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PeerInfo {
    /// The QP endpoint (sent exactly as `ibv_rc_pingpong` sends it).
    pub endpoint: Endpoint,
    /// Regions the peer may WRITE/READ/atomically access, in order.
    pub mrs: Vec<RemoteMr>,
}

impl PeerInfo {
    /// An endpoint with no regions.
    pub fn new(endpoint: Endpoint) -> PeerInfo {
        PeerInfo {
            endpoint,
            mrs: Vec::new(),
        }
    }

    /// Adds a region (builder style).
    pub fn with_mr(mut self, mr: RemoteMr) -> PeerInfo {
        self.mrs.push(mr);
        self
    }

    /// Bytes this message takes on the wire.
    pub fn wire_len(&self) -> usize {
        ENDPOINT_MSG_LEN + MR_HEADER_LEN + self.mrs.len() * MR_RECORD_LEN
    }
}

/// Encodes `info` in the extended form.
///
/// Refuses more than [`MAX_REMOTE_MRS`] regions, a region whose address range
/// wraps around (`addr + len` overflows), and what [`encode_endpoint`] refuses.
pub fn encode_peer_info(info: &PeerInfo) -> Result<Vec<u8>> {
    if info.mrs.len() > MAX_REMOTE_MRS {
        return Err(Error::InvalidArgument {
            what: "peer info",
            reason: format!(
                "{} memory regions, at most {MAX_REMOTE_MRS} can be sent",
                info.mrs.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(info.wire_len());
    out.extend_from_slice(&encode_endpoint(&info.endpoint)?);
    let header = format!("xmr1:{:04x}\0", info.mrs.len());
    out.extend_from_slice(header.as_bytes());
    for mr in &info.mrs {
        if mr.addr.checked_add(mr.len).is_none() {
            return Err(Error::InvalidArgument {
                what: "remote MR",
                reason: format!("{:#x} + {} overflows the address space", mr.addr, mr.len),
            });
        }
        let rec = format!("{:016x}:{:016x}:{:08x}\0", mr.addr, mr.len, mr.rkey);
        out.extend_from_slice(rec.as_bytes());
    }
    debug_assert_eq!(out.len(), info.wire_len());
    Ok(out)
}

/// Parses the extended header; returns the number of region records that follow.
pub fn parse_mr_header(buf: &[u8]) -> Result<usize> {
    if buf.len() != MR_HEADER_LEN {
        return Err(protocol(format!(
            "region list header has {} bytes, expected {MR_HEADER_LEN}",
            buf.len()
        )));
    }
    let text = c_text(buf, "region list header")?;
    let Some(count) = text.strip_prefix(MR_MAGIC.as_slice()) else {
        return Err(protocol(format!(
            "expected the extended exchange header `xmr1:NNNN`, got {} \
             (is the peer a plain ibv_rc_pingpong, which sends no memory regions?)",
            Shown(buf)
        )));
    };
    let n = hex_field(count, 4, "region count", text)? as usize;
    if n > MAX_REMOTE_MRS {
        return Err(protocol(format!(
            "peer announces {n} memory regions, at most {MAX_REMOTE_MRS} are accepted"
        )));
    }
    Ok(n)
}

/// Parses one 43-byte region record of the extended form.
pub fn parse_mr_record(buf: &[u8]) -> Result<RemoteMr> {
    if buf.len() != MR_RECORD_LEN {
        return Err(protocol(format!(
            "region record has {} bytes, expected {MR_RECORD_LEN}",
            buf.len()
        )));
    }
    let text = c_text(buf, "region record")?;
    let mut fields = text.split(|&b| b == b':');
    let (Some(addr), Some(len), Some(rkey), None) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return Err(protocol(format!(
            "region record is not ADDR:LEN:RKEY: {}",
            Shown(text)
        )));
    };
    let addr = hex_field(addr, 16, "region address", text)?;
    let len = hex_field(len, 16, "region length", text)?;
    let rkey = hex_field(rkey, 8, "rkey", text)? as u32;
    if addr.checked_add(len).is_none() {
        return Err(protocol(format!(
            "region {addr:#x} + {len} wraps around the address space"
        )));
    }
    Ok(RemoteMr { addr, len, rkey })
}

/// Parses a complete extended message (exactly [`PeerInfo::wire_len`] bytes).
pub fn parse_peer_info(buf: &[u8]) -> Result<PeerInfo> {
    if buf.len() < ENDPOINT_MSG_LEN + MR_HEADER_LEN {
        return Err(protocol(format!(
            "extended message has {} bytes, at least {} expected",
            buf.len(),
            ENDPOINT_MSG_LEN + MR_HEADER_LEN
        )));
    }
    let (ep, rest) = buf.split_at(ENDPOINT_MSG_LEN);
    let (header, records) = rest.split_at(MR_HEADER_LEN);
    let endpoint = parse_endpoint(ep)?;
    let n = parse_mr_header(header)?;
    if records.len() != n * MR_RECORD_LEN {
        return Err(protocol(format!(
            "extended message announces {n} regions ({} bytes) but carries {} bytes of them",
            n * MR_RECORD_LEN,
            records.len()
        )));
    }
    let mrs = records
        .chunks_exact(MR_RECORD_LEN)
        .map(parse_mr_record)
        .collect::<Result<Vec<_>>>()?;
    Ok(PeerInfo { endpoint, mrs })
}

/// Reads exactly `buf.len()` bytes; EOF first is a truncated message, or
/// [`Error::PeerGaveUp`] when nothing of the peer's `first` message came.
fn read_full<R: Read + ?Sized>(
    r: &mut R,
    buf: &mut [u8],
    what: &'static str,
    first: bool,
) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            // Nothing at all before the first message: the peer gave up.
            Ok(0) if got == 0 && first => return Err(Error::PeerGaveUp),
            Ok(0) => {
                return Err(protocol(format!(
                    "{what}: the peer closed the connection after {got} of {} bytes{}",
                    buf.len(),
                    if got > 0 {
                        format!(" ({})", Shown(&buf[..got]))
                    } else {
                        String::new()
                    }
                )));
            }
            Ok(n) => got = got.saturating_add(n).min(buf.len()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => return Err(Error::Io { what, source }),
        }
    }
    Ok(())
}

fn write_all<W: Write + ?Sized>(w: &mut W, buf: &[u8], what: &'static str) -> Result<()> {
    w.write_all(buf)
        .and_then(|()| w.flush())
        .map_err(|source| Error::Io { what, source })
}

/// A message that can travel over an [`ExchangeStream`]: an [`Endpoint`] (the
/// `ibv_rc_pingpong` form) or a [`PeerInfo`] (the extended form).
pub trait WireMessage: Sized {
    /// Writes the message.
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()>;
    /// Reads and parses one message, reading no byte beyond it.
    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<Self>;
}

impl WireMessage for Endpoint {
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()> {
        // One write of the whole 52 bytes: the C peer reads it with one read().
        write_all(w, &encode_endpoint(self)?, "sending the local endpoint")
    }

    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<Endpoint> {
        let mut buf = [0u8; ENDPOINT_MSG_LEN];
        read_full(r, &mut buf, "receiving the remote endpoint", true)?;
        parse_endpoint(&buf)
    }
}

impl WireMessage for PeerInfo {
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()> {
        write_all(w, &encode_peer_info(self)?, "sending the local peer info")
    }

    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<PeerInfo> {
        let endpoint = Endpoint::read_from(r)?;
        let mut header = [0u8; MR_HEADER_LEN];
        read_full(r, &mut header, "receiving the remote region list", false)?;
        let n = parse_mr_header(&header)?;
        let mut mrs = Vec::with_capacity(n);
        let mut rec = [0u8; MR_RECORD_LEN];
        for _ in 0..n {
            read_full(r, &mut rec, "receiving a remote region", false)?;
            mrs.push(parse_mr_record(&rec)?);
        }
        Ok(PeerInfo { endpoint, mrs })
    }
}

/// Writes the closing `"done"` (5 bytes with the NUL, as `ibv_rc_pingpong`).
pub fn write_done<W: Write + ?Sized>(w: &mut W) -> Result<()> {
    write_all(w, DONE_MSG, "sending \"done\"")
}

/// Reads the closing `"done"`: `"done\0"`, or `"done"` followed by EOF.
pub fn read_done<R: Read + ?Sized>(r: &mut R) -> Result<()> {
    let mut buf = [0u8; DONE_MSG.len()];
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            // `min`: a `Read` that claims more than the buffer held.
            Ok(n) => got = got.saturating_add(n).min(buf.len()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(Error::Io {
                    what: "receiving \"done\"",
                    source,
                });
            }
        }
    }
    match &buf[..got] {
        b"done\0" | b"done" => Ok(()),
        // Closed before a byte: the peer exited (or was killed), it did not
        // send something malformed.
        [] => Err(Error::PeerClosed {
            waiting_for: "its \"done\"",
        }),
        other => Err(protocol(format!(
            "expected \"done\" to close the exchange, got {}",
            Shown(other)
        ))),
    }
}

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

impl ExchangeStream {
    /// Connects to `host:port`, retrying refused or failed attempts (the
    /// server may not be listening yet) until `timeout` has passed; then uses
    /// `timeout` as the limit of each later message.
    ///
    /// `host` is a name or an address (`10.99.0.1`, `fe80::1%eth0`); every
    /// address it resolves to is tried, as `ibv_rc_pingpong` does.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<ExchangeStream> {
        let start = Instant::now();
        let mut last: Option<io::Error> = None;
        loop {
            match (host, port).to_socket_addrs() {
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
        msg.write_to(&mut self.timed())
            .map_err(|e| map_timeout(e, self.timeout))
    }

    /// Receives one message.
    pub fn recv<M: WireMessage>(&mut self) -> Result<M> {
        M::read_from(&mut self.timed()).map_err(|e| map_timeout(e, self.timeout))
    }

    /// Sends the closing `"done"`.
    pub fn send_done(&mut self) -> Result<()> {
        write_done(&mut self.timed()).map_err(|e| map_timeout(e, self.timeout))
    }

    /// Receives the closing `"done"`.
    pub fn recv_done(&mut self) -> Result<()> {
        read_done(&mut self.timed()).map_err(|e| map_timeout(e, self.timeout))
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
    /// ([`connect_client_kept`], [`serve_kept`]) turns it into a liveness signal: a side
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
    fn timed(&self) -> Timed<'_> {
        Timed {
            stream: &self.stream,
            deadline: self.timeout.and_then(|t| Instant::now().checked_add(t)),
        }
    }
}

/// The stream for one message: each read or write waits at most what is
/// left of the message's time limit. A socket timeout alone bounds each
/// read, so a peer sending a byte at a time could stretch one message (and
/// hold the other side) without end.
struct Timed<'a> {
    stream: &'a TcpStream,
    deadline: Option<Instant>,
}

impl Timed<'_> {
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

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(true)?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(false)?;
        (&mut &*self.stream).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&mut &*self.stream).flush()
    }
}

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

/// The client side of an exchange, in `ibv_rc_pingpong`'s order: connect
/// (retrying until `timeout`), send `local`, receive the server's message,
/// send `"done"`. Works with `M` = [`Endpoint`] against a C `ibv_rc_pingpong`
/// server, or `M` = [`PeerInfo`] against a server of this crate.
pub fn client_exchange<M: WireMessage>(
    host: &str,
    port: u16,
    local: &M,
    timeout: Duration,
) -> Result<M> {
    let mut s = ExchangeStream::connect(host, port, timeout)?;
    s.send(local)?;
    let remote = s.recv()?;
    s.send_done()?;
    Ok(remote)
}

/// The server side of an exchange, in `ibv_rc_pingpong`'s order: accept one
/// client (waiting at most `timeout`, `None`: forever; each message then at
/// most as long, or [`PEER_MESSAGE_TIMEOUT`]), receive its message,
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
    let remote = s.recv()?;
    let t = before_reply(&remote)?;
    s.send(local)?;
    s.recv_done()?;
    Ok((remote, t))
}

/// Connects `qp` to a server of this crate ([`serve`]): sends this side's
/// endpoint and `mrs`, receives the server's, moves the QP to RTS, and
/// returns it with what the server advertised (its regions to WRITE/READ).
///
/// `gid_index` `None` picks [`Context::default_gid_index`](crate::Context::default_gid_index)
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
    let mut local = PeerInfo::new(qp.endpoint(gid_index)?);
    local.mrs.extend_from_slice(mrs);
    let mut s = ExchangeStream::connect(host, port, timeout)?;
    s.send(&local)?;
    let remote: PeerInfo = s.recv()?;
    s.send_done()?;
    let qp = qp.connect(&remote.endpoint, gid_index)?;
    Ok((qp, remote, s))
}

/// The server side of [`connect_client`]: waits for one client on `listener`
/// (at most `timeout`, `None`: forever; see [`ExchangeListener::accept`] for
/// the messages), connects `qp` to it *before*
/// answering (so the client's first message finds it ready), sends this
/// side's endpoint and `mrs`, and returns the QP in RTS with what the client
/// advertised. If connecting fails, the client sees the connection closed
/// ([`Error::PeerGaveUp`]) and this side gets the error.
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
    let mut local = PeerInfo::new(qp.endpoint(gid_index)?);
    local.mrs.extend_from_slice(mrs);
    let mut s = listener.accept(timeout)?;
    let remote: PeerInfo = s.recv()?;
    let qp = qp.connect(&remote.endpoint, gid_index)?;
    s.send(&local)?;
    s.recv_done()?;
    Ok((qp, remote, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep() -> Endpoint {
        Endpoint {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: "::ffff:10.99.0.1".parse().unwrap(),
        }
    }

    #[test]
    fn message_size_is_sizeof_the_c_template() {
        assert_eq!(
            ENDPOINT_MSG_LEN,
            "0000:000000:000000:00000000000000000000000000000000".len() + 1
        );
        assert_eq!(MR_HEADER_LEN, "xmr1:0000".len() + 1);
        assert_eq!(
            MR_RECORD_LEN,
            "0000000000000000:0000000000000000:00000000".len() + 1
        );
    }

    #[test]
    fn encodes_like_sprintf() {
        let msg = encode_endpoint(&ep()).unwrap();
        assert_eq!(
            &msg[..],
            b"0000:000011:abcdef:00000000000000000000ffff0a630001\0"
        );
        let e = Endpoint {
            lid: 0xbeef,
            qpn: 0xffffff,
            psn: 0,
            gid: Gid::ZERO,
        };
        assert_eq!(
            &encode_endpoint(&e).unwrap()[..],
            b"beef:ffffff:000000:00000000000000000000000000000000\0"
        );
        assert_eq!(parse_endpoint(&encode_endpoint(&e).unwrap()).unwrap(), e);
    }

    #[test]
    fn refuses_qpn_or_psn_over_24_bits() {
        let mut e = ep();
        e.qpn = 0x0100_0000;
        assert!(matches!(
            encode_endpoint(&e),
            Err(Error::InvalidArgument { .. })
        ));
        let mut e = ep();
        e.psn = u32::MAX;
        assert!(encode_endpoint(&e).is_err());
    }

    #[test]
    fn parses_what_c_sends() {
        let got = parse_endpoint(b"0000:000011:abcdef:00000000000000000000ffff0a630001\0").unwrap();
        assert_eq!(got, ep());
        // sscanf("%x") takes upper case and short fields too.
        let mut m = b"1:2:3:FE800000000000000000000000000001".to_vec();
        m.resize(ENDPOINT_MSG_LEN, 0);
        let got = parse_endpoint(&m).unwrap();
        assert_eq!((got.lid, got.qpn, got.psn), (1, 2, 3));
        assert_eq!(got.gid.to_string(), "fe80::1");
    }

    fn pad(text: &[u8]) -> Vec<u8> {
        let mut v = text.to_vec();
        v.resize(ENDPOINT_MSG_LEN, 0);
        v
    }

    #[test]
    fn rejects_malformed_endpoint_messages() {
        let good = encode_endpoint(&ep()).unwrap();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (good[..51].to_vec(), "51 bytes"),
            ([&good[..], b"x"].concat(), "53 bytes"),
            (vec![], "0 bytes"),
            (vec![b'a'; 52], "not NUL-terminated"),
            (pad(b"0000:000011:abcdef"), "not LID:QPN:PSN:GID"),
            (
                pad(b"0000:000011:abcdef:0000000000000000000ffff0a630001"),
                "GID",
            ),
            (
                pad(b"0000:00001g:abcdef:00000000000000000000ffff0a630001"),
                "QP number",
            ),
            (
                pad(b"00000:00011:abcdef:00000000000000000000ffff0a630001"),
                "LID",
            ),
            (
                pad(b"0000::abcdef:00000000000000000000ffff0a630001"),
                "QP number",
            ),
            (
                pad(b"0000:000011:abcdef:0000000000000000000ffff0a630001:"),
                "not LID:QPN:PSN:GID",
            ),
            (
                pad(b"0000:1000000:abcdef:0000000000000000ffff0a630001"),
                "QP number",
            ),
            (pad(b"\xff\xfe:1:2:3"), "LID"),
        ];
        for (input, want) in cases {
            match parse_endpoint(&input) {
                Err(Error::Protocol(msg)) => assert!(msg.contains(want), "{want}: {msg}"),
                other => panic!("{want}: {other:?}"),
            }
        }
    }

    #[test]
    fn peer_info_roundtrip_and_layout() {
        let info = PeerInfo::new(ep())
            .with_mr(RemoteMr {
                addr: 0x7f00_0000_1000,
                len: 4096,
                rkey: 0x1234,
            })
            .with_mr(RemoteMr {
                addr: u64::MAX - 8,
                len: 8,
                rkey: u32::MAX,
            });
        let wire = encode_peer_info(&info).unwrap();
        assert_eq!(wire.len(), info.wire_len());
        assert_eq!(&wire[52..62], b"xmr1:0002\0");
        assert_eq!(
            &wire[62..105],
            b"00007f0000001000:0000000000001000:00001234\0"
        );
        assert_eq!(parse_peer_info(&wire).unwrap(), info);
        let mut cur = io::Cursor::new(&wire);
        assert_eq!(PeerInfo::read_from(&mut cur).unwrap(), info);
        assert_eq!(cur.position() as usize, wire.len());
        // No regions.
        let empty = PeerInfo::new(ep());
        let wire = encode_peer_info(&empty).unwrap();
        assert_eq!(wire.len(), 62);
        assert_eq!(parse_peer_info(&wire).unwrap(), empty);
    }

    #[test]
    fn peer_info_rejects_bad_input() {
        let info = PeerInfo::new(ep()).with_mr(RemoteMr {
            addr: 1,
            len: 2,
            rkey: 3,
        });
        let wire = encode_peer_info(&info).unwrap();
        // Truncated and oversized.
        for cut in [0, 10, 52, 61, 62, 100, wire.len() - 1] {
            assert!(
                matches!(parse_peer_info(&wire[..cut]), Err(Error::Protocol(_))),
                "cut {cut}"
            );
            let mut cur = io::Cursor::new(&wire[..cut]);
            let r = PeerInfo::read_from(&mut cur);
            if cut == 0 {
                assert!(matches!(r, Err(Error::PeerGaveUp)), "{r:?}");
            } else {
                assert!(matches!(r, Err(Error::Protocol(_))), "stream cut {cut}");
            }
        }
        assert!(parse_peer_info(&[&wire[..], b"\0"].concat()).is_err());
        // Too many regions announced.
        let mut w = wire.clone();
        w[52..62].copy_from_slice(b"xmr1:ffff\0");
        match parse_peer_info(&w) {
            Err(Error::Protocol(m)) => assert!(m.contains("at most"), "{m}"),
            other => panic!("{other:?}"),
        }
        let mut cur = io::Cursor::new(&w);
        assert!(PeerInfo::read_from(&mut cur).is_err());
        // Wrong magic: a plain pingpong peer.
        let mut w = wire.clone();
        w[52..57].copy_from_slice(b"done\0");
        match parse_peer_info(&w) {
            Err(Error::Protocol(m)) => assert!(m.contains("ibv_rc_pingpong"), "{m}"),
            other => panic!("{other:?}"),
        }
        // Wrapping range.
        let rec = b"ffffffffffffffff:0000000000000002:00000001\0";
        assert!(parse_mr_record(rec).is_err());
        assert!(
            encode_peer_info(&PeerInfo::new(ep()).with_mr(RemoteMr {
                addr: u64::MAX,
                len: 1,
                rkey: 0
            }))
            .is_err()
        );
        let too_many = PeerInfo {
            endpoint: ep(),
            mrs: vec![RemoteMr::default(); MAX_REMOTE_MRS + 1],
        };
        assert!(encode_peer_info(&too_many).is_err());
    }

    #[test]
    fn done_handling() {
        let mut v = Vec::new();
        write_done(&mut v).unwrap();
        assert_eq!(v, b"done\0");
        read_done(&mut io::Cursor::new(b"done\0")).unwrap();
        read_done(&mut io::Cursor::new(b"done")).unwrap();
        // Nothing at all: the peer closed (exited or was killed).
        assert!(matches!(
            read_done(&mut io::Cursor::new(b"")),
            Err(Error::PeerClosed { .. })
        ));
        for bad in [&b"don"[..], b"DONE\0", b"nope\0"] {
            assert!(
                matches!(
                    read_done(&mut io::Cursor::new(bad)),
                    Err(Error::Protocol(_))
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn truncated_stream_is_a_protocol_error() {
        let good = encode_endpoint(&ep()).unwrap();
        let mut cur = io::Cursor::new(&good[..30]);
        match Endpoint::read_from(&mut cur) {
            Err(Error::Protocol(m)) => assert!(m.contains("after 30 of 52 bytes"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn shown_escapes_and_cuts() {
        assert_eq!(Shown(b"a\0\n").to_string(), "\"a\\x00\\n\"");
        let long = [b'x'; 100];
        assert!(Shown(&long).to_string().ends_with("... (100 bytes)"));
    }
}
