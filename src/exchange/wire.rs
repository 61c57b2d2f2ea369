//! The wire format: encoding and parsing of the exchange messages, and
//! reading and writing them on any `Read`/`Write`.
//!
//! The format itself is described on [`WireMessage`].

use std::fmt;
use std::io::{self, Read, Write};

use crate::device::Gid;
use crate::error::{Error, Result};
use crate::mr::RemoteMr;
use crate::qp::Endpoint;

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

fn protocol(msg: impl Into<String>) -> Error {
    Error::Protocol(msg.into())
}

/// Shows at most 64 bytes of peer input, escaped, for error messages.
struct EscapedInput<'a>(&'a [u8]);

impl fmt::Display for EscapedInput<'_> {
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
            EscapedInput(whole)
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
            EscapedInput(whole)
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
            EscapedInput(buf)
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
            EscapedInput(buf)
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
            EscapedInput(text)
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
/// extended message (see [`WireMessage`] for its wire format).
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
            EscapedInput(buf)
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
            EscapedInput(text)
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
                        format!(" ({})", EscapedInput(&buf[..got]))
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

/// A message that can travel over an [`ExchangeStream`](super::ExchangeStream): an
/// [`Endpoint`] (the `ibv_rc_pingpong` form) or a [`PeerInfo`] (the extended form).
///
/// # The `ibv_rc_pingpong` protocol
/// One message is `sprintf("%04x:%06x:%06x:%s", lid, qpn, psn, gid)` where
/// `gid` is the 16 GID bytes as 32 lowercase hex digits in network order,
/// sent as a fixed **52-byte** buffer (`sizeof "0000:000000:000000:` + 32
/// zeros + `"`, i.e. 51 characters and the terminating NUL):
///
/// 1. the client connects and writes its message;
/// 2. the server reads it, connects its QP (`ibv_rc_pingpong` moves it to
///    RTR/RTS *before* answering, so the client's first SEND finds it ready),
///    and writes its own message;
/// 3. the client reads that and writes `"done"` with its NUL (5 bytes);
/// 4. the server reads the `"done"`; both close the connection.
///
/// # The extended form: [`PeerInfo`]
/// Programs that RDMA WRITE or READ also need the peer's memory regions
/// ([`RemoteMr`]: address, length, rkey). The extended message is the
/// 52-byte endpoint message followed by
///
/// * a 10-byte header `"xmr1:%04x\0"`: the magic `xmr1:` and the number of
///   regions `n` (at most [`MAX_REMOTE_MRS`]), then
/// * `n` records of 43 bytes each, `"%016x:%016x:%08x\0"`: address, length and
///   rkey of one region.
///
/// Every part has a fixed size, so a reader knows how much to read before
/// it reads it and never buffers more than 52 + 10 + 43 × 1024 bytes. The same
/// four steps apply (client first, server answers, client writes `"done"`).
/// A C `ibv_rc_pingpong` does not speak the extended form; talking to one with
/// it fails with [`Error::Protocol`] or [`Error::Io`] (never a hang while
/// timeouts are set).
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

/// Reads until `buf` is full or the peer closes, and returns how many bytes
/// came (fewer than `buf.len()` only at the end of the stream).
pub(super) fn read_up_to<R: Read + ?Sized>(r: &mut R, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => break,
            // `min`: a `Read` that claims more than the buffer held.
            Ok(n) => got = got.saturating_add(n).min(buf.len()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Reads the closing `"done"`: `"done\0"`, or `"done"` followed by EOF.
pub fn read_done<R: Read + ?Sized>(r: &mut R) -> Result<()> {
    let mut buf = [0u8; DONE_MSG.len()];
    let got = read_up_to(r, &mut buf).map_err(|source| Error::Io {
        what: "receiving \"done\"",
        source,
    })?;
    match &buf[..got] {
        b"done\0" | b"done" => Ok(()),
        // Closed before a byte: the peer exited (or was killed), it did not
        // send something malformed.
        [] => Err(Error::PeerClosed {
            waiting_for: "its \"done\"",
        }),
        other => Err(protocol(format!(
            "expected \"done\" to close the exchange, got {}",
            EscapedInput(other)
        ))),
    }
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
        assert_eq!(EscapedInput(b"a\0\n").to_string(), "\"a\\x00\\n\"");
        let long = [b'x'; 100];
        assert!(EscapedInput(&long).to_string().ends_with("... (100 bytes)"));
    }
}
