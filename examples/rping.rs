//! `rping` in safe Rust: the rdma_cm ping/pong of rdma-core's
//! `librdmacm/examples/rping.c`, wire-compatible with it in both roles.
//!
//! ```text
//! rping -s [-vVd] [-S size] [-C count] [-a addr] [-p port] [-W secs]
//! rping -c [-vVd] [-S size] [-C count] [-I addr] -a addr [-p port] [-W secs]
//! ```
//!
//! Each ping: the client fills its source buffer with `rdma-ping-N: ` and a
//! rotating `A..z` pattern and SENDs its address/rkey/size (`struct
//! rping_rdma_info`, network byte order); the server RDMA-READs it and SENDs
//! a go-ahead; the client advertises its sink buffer the same way; the server
//! RDMA-WRITEs the data there and SENDs another go-ahead; with `-V` the
//! client checks that the sink equals the source. The client disconnects
//! after `-C` pings; the server serves one client and exits when it
//! disconnects. `-W` bounds every wait (default 60 s): nothing hangs.
//!
//! Extensions over the C tool: `-V` on the server also checks the data it
//! read against the expected pattern; `-W`.

use std::collections::VecDeque;
use std::error::Error as StdError;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdma_verbs::cm::{CmEventKind, CmId, ConnParam};
use rdma_verbs::prelude::*;

type Res<T> = std::result::Result<T, Box<dyn StdError>>;

/// Size of `struct rping_rdma_info` (buf u64, rkey u32, size u32).
const INFO_LEN: usize = 16;
/// `RPING_SQ_DEPTH`.
const SQ_DEPTH: u32 = 16;
/// `RPING_BUFSIZE`: sizes must stay below it.
const MAX_SIZE: usize = 64 * 1024;
/// `RPING_MIN_BUFSIZE`: sizeof("2147483647") + sizeof("rdma-ping-%d: ").
const MIN_SIZE: usize = 11 + 15;
const RECV_ID: u64 = 1;
const SEND_ID: u64 = 2;
const RDMA_ID: u64 = 3;

struct Opts {
    server: bool,
    addr: Option<String>,
    src: Option<String>,
    port: u16,
    count: u64,
    size: usize,
    verbose: bool,
    validate: bool,
    debug: bool,
    wait: Duration,
}

const USAGE: &str = "\
usage: rping -s [-vVd] [-S size] [-C count] [-a addr] [-p port] [-W secs]
       rping -c [-vVd] [-S size] [-C count] [-I addr] -a addr [-p port] [-W secs]
  -c        client side
  -s        server side (binds to 0.0.0.0 unless -a; IPv6 any: -a ::0)
  -a addr   address (client: the server's; server: the one to bind)
  -I addr   source address to bind to (client)
  -p port   port (default 7174)
  -C count  ping count (client; default: forever)
  -S size   ping data size (default 64)
  -v        display ping data
  -V        validate ping data
  -d        debug output
  -W secs   give up on any wait after secs (default 60)
  -h        print this help";

fn parse_args() -> Res<Opts> {
    let mut o = Opts {
        server: false,
        addr: None,
        src: None,
        port: 7174,
        count: 0,
        size: 64,
        verbose: false,
        validate: false,
        debug: false,
        wait: Duration::from_secs(60),
    };
    let mut role = None;
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        std::process::exit(0);
    }
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        let Some(flags) = a.strip_prefix('-').filter(|f| !f.is_empty()) else {
            return Err(format!("unexpected argument `{a}`\n{USAGE}").into());
        };
        for (k, c) in flags.char_indices() {
            if "aIpCSW".contains(c) {
                // getopt style: the value is the rest of this argument or the next one.
                let rest = &flags[k + c.len_utf8()..];
                let val = if !rest.is_empty() {
                    rest.to_owned()
                } else if i < args.len() {
                    i += 1;
                    args[i - 1].clone()
                } else {
                    return Err(format!("-{c} needs a value\n{USAGE}").into());
                };
                let num = |what: &str| -> Res<u64> {
                    val.parse::<u64>()
                        .map_err(|_| format!("invalid {what} `{val}`").into())
                };
                match c {
                    'a' => o.addr = Some(val.clone()),
                    'I' => o.src = Some(val.clone()),
                    'p' => o.port = u16::try_from(num("port")?).map_err(|_| "port out of range")?,
                    'C' => o.count = num("count")?,
                    'S' => {
                        let s = usize::try_from(num("size")?).unwrap_or(usize::MAX);
                        if !(MIN_SIZE..MAX_SIZE).contains(&s) {
                            return Err(format!(
                                "Invalid size {s} (valid range is {MIN_SIZE} to {})",
                                MAX_SIZE - 1
                            )
                            .into());
                        }
                        o.size = s;
                    }
                    'W' => o.wait = Duration::from_secs(num("wait")?.clamp(1, 1 << 20)),
                    _ => unreachable!(),
                }
                break;
            }
            match c {
                's' => role = Some(true),
                'c' => role = Some(false),
                'v' => o.verbose = true,
                'V' => o.validate = true,
                'd' => o.debug = true,
                _ => return Err(format!("unknown option -{c}\n{USAGE}").into()),
            }
        }
    }
    o.server = role.ok_or_else(|| format!("choose -s or -c\n{USAGE}"))?;
    if !o.server && o.addr.is_none() {
        return Err(format!("the client needs -a addr\n{USAGE}").into());
    }
    Ok(o)
}

fn resolve(host: &str, port: u16) -> Res<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("getaddrinfo failed ({e}) - invalid hostname or IP address"))?
        .next()
        .ok_or_else(|| format!("{host}: no address").into())
}

/// `struct rping_rdma_info` on the wire.
fn encode_info(addr: u64, rkey: u32, size: u32) -> [u8; INFO_LEN] {
    let mut b = [0u8; INFO_LEN];
    b[..8].copy_from_slice(&addr.to_be_bytes());
    b[8..12].copy_from_slice(&rkey.to_be_bytes());
    b[12..].copy_from_slice(&size.to_be_bytes());
    b
}

fn decode_info(b: &[u8]) -> RemoteMr {
    let addr = u64::from_be_bytes(b[..8].try_into().unwrap_or_default());
    let rkey = u32::from_be_bytes(b[8..12].try_into().unwrap_or_default());
    let size = u32::from_be_bytes(b[12..16].try_into().unwrap_or_default());
    RemoteMr {
        addr,
        len: u64::from(size),
        rkey,
    }
}

/// The client's ping `ping` of `size` bytes, exactly as rping.c builds it:
/// `rdma-ping-N: ` then characters from `start` (65 + N mod 58) cycling
/// through 'A'..='z', NUL-terminated.
fn ping_data(ping: u64, size: usize) -> Vec<u8> {
    let mut buf = vec![0u8; size];
    let head = format!("rdma-ping-{}: ", ping as i32);
    let cc = head.len().min(size.saturating_sub(1));
    buf[..cc].copy_from_slice(&head.as_bytes()[..cc]);
    let mut c = 65 + (ping % 58) as u8;
    for b in &mut buf[cc..] {
        *b = c;
        c += 1;
        if c > 122 {
            c = 65;
        }
    }
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    buf
}

/// The bytes up to the first NUL, as text (what C's `printf("%s")` shows).
fn c_str(b: &[u8]) -> String {
    let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// What the connection reports to the ping loops.
enum Ev {
    /// The peer's SEND, already re-armed: its rping_rdma_info.
    Recv(RemoteMr),
    /// An RDMA READ or WRITE completed; its buffer.
    Rdma(WcOpcode, Mr),
    /// The peer disconnected.
    Disconnected,
}

/// One rping connection: the QP, its CQ, the id, and the 16-byte message buffers.
struct Conn {
    id: CmId,
    cq: Cq,
    qp: Qp<Rc, Rts>,
    send_buf: Option<Mr>,
    ready: VecDeque<Ev>,
    polled: Vec<Completion>,
    wait: Duration,
    debug: bool,
}

impl Conn {
    /// The connected side: its id, CQ, QP and the buffer its SENDs go from.
    fn new(id: CmId, cq: Cq, qp: Qp<Rc, Rts>, send_buf: Mr, o: &Opts) -> Conn {
        Conn {
            id,
            cq,
            qp,
            send_buf: Some(send_buf),
            ready: VecDeque::new(),
            polled: Vec::with_capacity(8),
            wait: o.wait,
            debug: o.debug,
        }
    }

    fn dbg(&self, msg: impl FnOnce() -> String) {
        if self.debug {
            println!("{}", msg());
        }
    }

    /// Polls the CQ once and looks at the id's events (sleeping up to 1 ms on
    /// its channel when there is nothing), queueing what it finds.
    fn pump(&mut self) -> Res<()> {
        let mut polled = std::mem::take(&mut self.polled);
        polled.clear();
        self.cq.poll(&mut polled)?;
        let any = !polled.is_empty();
        for mut c in polled.drain(..) {
            if c.status == WcStatus::WrFlushErr {
                // The connection is going down: iWARP moves the QP to ERR when
                // the peer closes, before DISCONNECTED is read here. rping skips
                // flushed completions too; the send buffer comes back for reuse.
                self.dbg(|| format!("flushed completion of wr {}", c.wr_id));
                if c.wr_id == SEND_ID {
                    self.send_buf = c.take_mr();
                }
                continue;
            }
            if let Err(e) = c.result() {
                return Err(format!("cq completion failed: {e}").into());
            }
            match c.opcode {
                WcOpcode::Send => {
                    self.dbg(|| "send completion".into());
                    self.send_buf = c.take_mr();
                }
                WcOpcode::Recv => {
                    self.dbg(|| "recv completion".into());
                    let mr = c.take_mr().ok_or("receive without its buffer")?;
                    if c.byte_len as usize != INFO_LEN {
                        return Err(format!("Received bogus data, size {}", c.byte_len).into());
                    }
                    let info = decode_info(&mr.to_vec()?);
                    // Re-arm first: the peer's next SEND may follow right away.
                    self.qp.post_recv(RecvWr::new(RECV_ID, mr))?;
                    self.ready.push_back(Ev::Recv(info));
                }
                op @ (WcOpcode::RdmaRead | WcOpcode::RdmaWrite) => {
                    self.dbg(|| format!("{} completion", op.name().to_lowercase()));
                    let mr = c.take_mr().ok_or("RDMA completion without its buffer")?;
                    self.ready.push_back(Ev::Rdma(op, mr));
                }
                other => return Err(format!("unexpected completion {other}").into()),
            }
        }
        self.polled = polled;
        if any {
            return Ok(());
        }
        match self.id.get_event(Duration::from_millis(1)) {
            Ok(ev) => {
                self.dbg(|| format!("cma_event type {} status {}", ev.kind, ev.status));
                match ev.kind {
                    CmEventKind::Disconnected => self.ready.push_back(Ev::Disconnected),
                    CmEventKind::AddrChange
                    | CmEventKind::TimewaitExit
                    | CmEventKind::Established => {}
                    _ => return Err(ev.into_error("rping").into()),
                }
            }
            Err(Error::Timeout { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    /// The next receive, RDMA completion or disconnect, waiting at most `-W`.
    fn next(&mut self, waiting_for: &str) -> Res<Ev> {
        let deadline = Instant::now() + self.wait;
        loop {
            if let Some(ev) = self.ready.pop_front() {
                return Ok(ev);
            }
            if Instant::now() > deadline {
                return Err(
                    format!("timed out after {:?} waiting for {waiting_for}", self.wait).into(),
                );
            }
            self.pump()?;
        }
    }

    /// SENDs a 16-byte rping_rdma_info (waiting for the buffer's previous send).
    fn send_info(&mut self, info: [u8; INFO_LEN]) -> Res<()> {
        let deadline = Instant::now() + self.wait;
        while self.send_buf.is_none() {
            if Instant::now() > deadline {
                return Err("timed out waiting for a send completion".into());
            }
            self.pump()?;
        }
        let mut buf = self.send_buf.take().ok_or("send buffer")?;
        buf.write_at(0, &info)?;
        self.qp.post_send(SendWr::send(SEND_ID).sge(buf))?;
        Ok(())
    }
}

/// PD, CQ, INIT QP with its receive posted, on `id`'s device.
fn setup(id: &CmId, o: &Opts) -> Res<(Pd, Cq, Qp<Rc, rdma_verbs::qp::Init>, Mr)> {
    let ctx = id.context()?;
    let pd = Pd::new(&ctx)?;
    if o.debug {
        println!("created pd {pd:?}");
    }
    let cq = Cq::new(&ctx, SQ_DEPTH * 2)?;
    let caps = QpCaps {
        max_send_wr: SQ_DEPTH,
        max_recv_wr: 2,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
        sq_sig_all: false,
    };
    let mut qp = id.create_qp(&pd, &cq, &cq, caps)?;
    if o.debug {
        println!("created qp {qp:?}");
    }
    qp.post_recv(RecvWr::new(
        RECV_ID,
        pd.alloc_mr(INFO_LEN, AccessFlags::LOCAL_WRITE)?,
    ))?;
    let send_buf = pd.alloc_mr(INFO_LEN, AccessFlags::empty())?;
    Ok((pd, cq, qp, send_buf))
}

/// rping's connection parameters: one outstanding READ each way, 7 retries.
fn conn_param() -> ConnParam {
    ConnParam::new()
        .responder_resources(1)
        .initiator_depth(1)
        .retry_count(7)
        .rnr_retry_count(7)
}

fn run_server(o: &Opts) -> Res<()> {
    let bind = resolve(o.addr.as_deref().unwrap_or("0.0.0.0"), o.port)?;
    let listener = CmId::listener(bind, 3)?;
    if o.debug {
        println!("rdma_bind_addr successful\nrdma_listen on {bind}");
    }
    let req = listener.get_request(o.wait)?;
    if o.debug {
        println!("child cma from {:?}", req.peer_addr());
    }
    let (pd, cq, qp, send_buf) = setup(req.id(), o)?;
    // The READ destination and WRITE source; never advertised, so local access only.
    let rdma_buf = pd.alloc_mr(o.size, AccessFlags::LOCAL_WRITE)?;
    if o.debug {
        println!("accepting client connection request");
    }
    let (qp, id) = req.accept(qp, &conn_param(), o.wait)?;
    let mut conn = Conn::new(id, cq, qp, send_buf, o);
    let mut rdma_buf = Some(rdma_buf);
    let mut ping = 0u64;
    while serve_ping(&mut conn, o, &mut rdma_buf, ping)? {
        ping += 1;
    }
    eprintln!("server DISCONNECT EVENT...");
    if o.debug {
        println!("{ping} pings served");
    }
    // The client left; tear down (QP, then the ids, then the channels).
    let _ = conn.id.disconnect();
    drop(conn);
    drop(listener);
    Ok(())
}

/// Serves ping `ping`: READs the client's source into the buffer in `slot`,
/// checks it, WRITEs it back to the client's sink, with the go-aheads
/// between; false once the client disconnected.
fn serve_ping(conn: &mut Conn, o: &Opts, slot: &mut Option<Mr>, ping: u64) -> Res<bool> {
    let go_ahead = [0u8; INFO_LEN];
    // Wait for the client's source advertisement.
    let src = match conn.next("the client's source buffer")? {
        Ev::Recv(info) => info,
        Ev::Disconnected => return Ok(false),
        Ev::Rdma(..) => return Err("unexpected RDMA completion".into()),
    };
    conn.dbg(|| {
        format!(
            "Received rkey {:x} addr {:x} len {} from peer",
            src.rkey, src.addr, src.len
        )
    });
    let len = src.len as usize;
    if len == 0 || len > o.size {
        return Err(format!(
            "the client's buffer is {len} bytes, ours {} (use the same -S)",
            o.size
        )
        .into());
    }
    // RDMA READ the ping into the first `len` bytes.
    let mut buf = slot.take().expect("the buffer is back between pings");
    let rest = buf.split_off(len)?;
    conn.qp.post_send(SendWr::read(RDMA_ID, buf, src, 0))?;
    conn.dbg(|| "server posted rdma read req".into());
    let rdma_buf = match conn.next("the RDMA READ")? {
        Ev::Rdma(WcOpcode::RdmaRead, mut mr) => {
            mr.unsplit(rest).map_err(|_| "buffer pieces do not join")?;
            mr
        }
        Ev::Disconnected => return Ok(false),
        _ => return Err("wait for RDMA_READ_COMPLETE".into()),
    };
    let data = rdma_buf.as_slice()?;
    if o.verbose {
        println!("server ping data: {}", c_str(data));
    }
    if o.validate && data[..len] != ping_data(ping, len)[..] {
        return Err(format!("data mismatch in ping {ping}: got `{}`", c_str(data)).into());
    }
    // Tell the client to continue.
    conn.send_info(go_ahead)?;
    conn.dbg(|| "server posted go ahead".into());
    // Wait for the client's sink advertisement.
    let sink = match conn.next("the client's sink buffer")? {
        Ev::Recv(info) => info,
        Ev::Disconnected => return Ok(false),
        Ev::Rdma(..) => return Err("unexpected RDMA completion".into()),
    };
    conn.dbg(|| "server received sink adv".into());
    // RDMA WRITE the string (with its NUL) back.
    let n = (c_str(rdma_buf.as_slice()?).len() + 1).min(o.size);
    if n as u64 > sink.len {
        return Err(format!("the client's sink is {} bytes, the ping {n}", sink.len).into());
    }
    // The first n bytes; the whole buffer comes back with the completion.
    conn.qp
        .post_send(SendWr::write_from(RDMA_ID, rdma_buf.range(..n)?, sink, 0))?;
    *slot = Some(match conn.next("the RDMA WRITE")? {
        Ev::Rdma(WcOpcode::RdmaWrite, mr) => mr,
        Ev::Disconnected => return Ok(false),
        _ => return Err("wait for RDMA_WRITE_COMPLETE".into()),
    });
    conn.dbg(|| "server rdma write complete".into());
    // Tell the client to begin again.
    conn.send_info(go_ahead)?;
    conn.dbg(|| "server posted go ahead".into());
    Ok(true)
}

fn run_client(o: &Opts) -> Res<()> {
    let dst = resolve(o.addr.as_deref().unwrap_or_default(), o.port)?;
    let src = o.src.as_deref().map(|s| resolve(s, 0)).transpose()?;
    let id = CmId::new()?;
    id.resolve_addr(src, dst, Duration::from_millis(2000))?;
    id.resolve_route(Duration::from_millis(2000))?;
    if o.debug {
        println!("rdma_resolve_addr - rdma_resolve_route successful");
    }
    let (pd, cq, qp, send_buf) = setup(&id, o)?;
    // The source the server READs, and the sink it WRITEs.
    let rw = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ;
    let mut start_buf = pd.alloc_mr(o.size, rw)?;
    let rdma_buf = pd.alloc_mr(o.size, rw | AccessFlags::REMOTE_WRITE)?;
    let (qp, _established) = id.connect(qp, &conn_param(), o.wait)?;
    if o.debug {
        println!("rdma_connect successful");
    }
    let mut conn = Conn::new(id, cq, qp, send_buf, o);
    let size = u32::try_from(o.size)?;
    let mut ping = 0u64;
    let mut disconnected = false;
    while o.count == 0 || ping < o.count {
        if !ping_once(&mut conn, o, &mut start_buf, &rdma_buf, ping, size)? {
            disconnected = true;
            break;
        }
        ping += 1;
    }
    if disconnected {
        eprintln!("client DISCONNECT EVENT...");
        // A server that leaves before the pings asked for (or, with -C 0, at all: only
        // the client ends an endless run) is a failure. The C rping exits 0 here too; a
        // caller could not tell a dead server from success.
        let asked = if o.count == 0 {
            "endless".to_string()
        } else {
            o.count.to_string()
        };
        return Err(format!(
            "the server disconnected after {ping} of {asked} pings (it exited or was killed)"
        )
        .into());
    } else {
        conn.id.disconnect()?;
        // Our side sees DISCONNECTED too once the server answers (bounded).
        let _ = conn
            .id
            .expect_event(CmEventKind::Disconnected, Duration::from_secs(2));
    }
    if o.debug {
        println!("{ping} pings done");
    }
    drop(conn);
    drop((start_buf, rdma_buf));
    Ok(())
}

/// Ping `ping`: advertises the source (filled with the ping's data) and the
/// sink, each after the server's go-ahead, and checks what the server wrote
/// back; false once the server disconnected.
fn ping_once(
    conn: &mut Conn,
    o: &Opts,
    start_buf: &mut Mr,
    rdma_buf: &Mr,
    ping: u64,
    size: u32,
) -> Res<bool> {
    let expected = ping_data(ping, o.size);
    // Nothing reads the source now: the server is done with the last ping.
    start_buf.as_mut_slice()?.copy_from_slice(&expected);
    conn.send_info(encode_info(start_buf.addr(), start_buf.rkey(), size))?;
    // Wait for the server to ACK (it has READ the source).
    match conn.next("the server's go-ahead after its READ")? {
        Ev::Recv(_) => {}
        Ev::Disconnected => return Ok(false),
        Ev::Rdma(..) => return Err("unexpected RDMA completion".into()),
    }
    conn.send_info(encode_info(rdma_buf.addr(), rdma_buf.rkey(), size))?;
    // Wait for the server to say the RDMA WRITE is complete.
    match conn.next("the server's go-ahead after its WRITE")? {
        Ev::Recv(_) => {}
        Ev::Disconnected => return Ok(false),
        Ev::Rdma(..) => return Err("unexpected RDMA completion".into()),
    }
    // The sink is remotely writable: copy it out (ordered after the go-ahead).
    let got = rdma_buf.to_vec()?;
    if o.validate && got != expected {
        return Err(format!(
            "data mismatch!\n  sent `{}`\n  got  `{}`",
            c_str(&expected),
            c_str(&got)
        )
        .into());
    }
    if o.verbose {
        println!("ping data: {}", c_str(&got));
    }
    Ok(true)
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let r = if o.server {
        run_server(&o)
    } else {
        run_client(&o)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rping {}: {e}", if o.server { "server" } else { "client" });
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_pattern_matches_rping_c() {
        let p = ping_data(0, 64);
        assert_eq!(&p[..16], b"rdma-ping-0: ABC");
        assert_eq!(p[63], 0);
        let p = ping_data(1, 64);
        assert_eq!(&p[..16], b"rdma-ping-1: BCD");
        // 'z' wraps to 'A'.
        let p = ping_data(57, 40);
        assert_eq!(&p[14..17], b"zAB");
        let p = ping_data(58, 40);
        assert_eq!(&p[14..16], b"AB");
    }

    #[test]
    fn info_is_network_order() {
        let b = encode_info(0x0102_0304_0506_0708, 0x0a0b_0c0d, 64);
        assert_eq!(b[0], 1);
        assert_eq!(b[8], 0x0a);
        assert_eq!(b[15], 64);
        let r = decode_info(&b);
        assert_eq!(
            (r.addr, r.rkey, r.len),
            (0x0102_0304_0506_0708, 0x0a0b_0c0d, 64)
        );
    }
}
