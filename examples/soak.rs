//! A verified soak: several RC QPs (one thread each) carry a random mix of SEND, RDMA WRITE
//! and RDMA READ of 1 B to 1 MiB for a given time. Every byte is checked against a
//! generator keyed by the message number, and every SEND / WRITE carries its number
//! (immediate data), so a message lost, duplicated, reordered or corrupted fails the run.
//! Both sides print their counts and their anonymous memory after warm-up and at the end,
//! and fail (exit 1) when it grew by more than 1 MiB in between.
//!
//! ```text
//! soak --server [--port 18530] [--qps 4]
//! soak --client HOST [--port 18530] [--qps 4] [--seconds 60] [--max-size 1048576]
//! ```
//!
//! The server answers each SEND / WRITE with an empty SEND whose immediate data says
//! whether the bytes matched; a READ reads back what the last WRITE of that QP left.
//! The QPs use `retry_cnt` 7, which rxe treats as "retry forever", so heavy loss slows the
//! stream down instead of ending it (what is tested here is that nothing is ever lost,
//! duplicated or corrupted); the exchange connection stays open as a liveness signal.
//! Each client QP ends with an empty SEND marked as the end of the run, so that the server
//! can tell a client that finished from one that was killed (both close the connection).

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use rdma_verbs::exchange::{ExchangeListener, ExchangeStream, PeerInfo};
use rdma_verbs::prelude::*;

#[path = "soak/memory.rs"]
mod memory;

use memory::{GROWTH_LIMIT_KIB, Memory, watch_memory};

const MIB: usize = 1 << 20;
/// Send queue depth: the server's verdicts (empty SENDs) whose completions have not been
/// polled yet. Under loss, the ACK of a verdict can come after the client has already
/// received it and sent the next message, so several may be outstanding.
const ACKS_IN_FLIGHT: u32 = 16;
/// Longest wait for one completion of a live peer.
const WAIT: Duration = Duration::from_secs(60);
/// The immediate of the client's last SEND on a lane, after its last message: the
/// server tells a run that ended from a client that died (both close the connection).
const END_OF_RUN: u32 = 0xffff_fffe;

struct Opts {
    client: Option<String>,
    port: u16,
    qps: usize,
    seconds: u64,
    max_size: usize,
    /// Which operations to mix: bit 0 SEND, bit 1 WRITE, bit 2 READ.
    ops: u8,
}

fn parse() -> std::result::Result<Opts, String> {
    let mut o = Opts {
        client: None,
        port: 18530,
        qps: 4,
        seconds: 60,
        max_size: MIB,
        ops: 7,
    };
    let mut server = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut num = |what: &str| -> std::result::Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{what} needs a number"))
        };
        match a.as_str() {
            "--server" => server = true,
            "--client" => o.client = Some(it.next().ok_or("--client needs a host")?),
            "--port" => o.port = u16::try_from(num("--port")?).map_err(|_| "bad --port")?,
            "--qps" => o.qps = num("--qps")? as usize,
            "--seconds" => o.seconds = num("--seconds")?,
            "--max-size" => o.max_size = num("--max-size")? as usize,
            "--ops" => {
                let v = it.next().ok_or("--ops needs a list")?;
                o.ops = 0;
                for op in v.split(',') {
                    o.ops |= match op {
                        "send" => 1,
                        "write" => 2,
                        "read" => 4,
                        _ => return Err(format!("--ops: unknown operation `{op}`")),
                    };
                }
            }
            "--help" | "-h" => {
                println!(
                    "usage: soak --server [--port P] [--qps N]\n       \
                     soak --client HOST [--port P] [--qps N] [--seconds S] [--max-size BYTES]\n            \
                     [--ops send,write,read]"
                );
                std::process::exit(0)
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if server == o.client.is_some() {
        return Err("say exactly one of --server or --client HOST".into());
    }
    if !(1..=64).contains(&o.qps)
        || o.seconds == 0
        || !(1..=MIB).contains(&o.max_size)
        || o.ops & 3 == 0
    {
        return Err(
            "--qps 1..64, --seconds >= 1, --max-size 1..1048576, --ops with send or write".into(),
        );
    }
    Ok(o)
}

/// Writes message `id`'s `n` bytes (xorshift64 keyed by the id) into `out`, reusing its
/// allocation (so the soak's own heap use stays flat and RSS shows the crate's).
fn pattern(id: u32, n: usize, out: &mut Vec<u8>) {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(id) << 17) ^ u64::from(id);
    out.clear();
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(n);
}

/// A scratch buffer of `n` bytes whose pages are all resident now. A zeroed allocation of
/// this size is mapped lazily: its pages would come in as larger messages are drawn,
/// after warm-up for the largest sizes.
fn resident(n: usize) -> Vec<u8> {
    vec![0x5a; n]
}

/// One QP with its own CQ and buffers.
struct Lane {
    qp: Qp<rdma_verbs::qp::Rc, rdma_verbs::qp::Rts>,
    cq: Waiter,
    /// The peer's region (client) / unused (server).
    remote: RemoteMr,
    /// Remotely accessible region (server) / the source and sink (client).
    region: Mr,
    /// Receive buffer (server) / unused (client).
    buf: Option<Mr>,
    /// Scratch: a copy of received bytes, and the expected ones.
    data: Vec<u8>,
    want: Vec<u8>,
}

/// A CQ with a completion channel of its own, and the completions already polled from it
/// but not yet handed out.
struct Waiter {
    cq: Cq,
    ready: Vec<Completion>,
}

impl Waiter {
    /// Waits for one completion, sleeping on the channel (a lane that spins would take the
    /// CPU from the other lanes and from rxe on a one-CPU guest), checking the peer's
    /// liveness between slices.
    fn next(&mut self, peer: &ExchangeStream, what: &'static str) -> Result<Completion> {
        let start = Instant::now();
        while self.ready.is_empty() {
            if self
                .cq
                .wait_poll(&mut self.ready, Some(Duration::from_millis(200)))?
                > 0
            {
                break;
            }
            if peer.peer_closed()? {
                return Err(Error::PeerClosed { waiting_for: what });
            }
            if start.elapsed() > WAIT {
                return Err(Error::Timeout { what, after: WAIT });
            }
        }
        let c = self.ready.remove(0);
        c.result()?;
        Ok(c)
    }
}

/// The lanes count themselves done and wait for the end's measurement.
#[derive(Default)]
struct Gate {
    done: std::sync::atomic::AtomicUsize,
    measured: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct Counts {
    send: AtomicU64,
    write: AtomicU64,
    read: AtomicU64,
    bytes: AtomicU64,
}

/// Runs until the client's end-of-run SEND; returns the lane (its memory is measured
/// before it is freed). A client that closes the connection before that died: an error.
fn server_lane(mut l: Lane, peer: &ExchangeStream, counts: &Counts) -> Result<Lane> {
    let mut expected: u32 = 0;
    let mut acks_out: u32 = 0;
    l.qp.post_recv(RecvWr::new(0, l.buf.take().expect("receive buffer")))?;
    loop {
        let mut c = l.cq.next(peer, "the client's next message")?;
        let (n, id) = (c.byte_len as usize, c.imm_data.unwrap_or(u32::MAX));
        let buf = c.take_mr();
        if c.opcode == WcOpcode::Recv && id == END_OF_RUN {
            l.buf = buf;
            return Ok(l);
        }
        let ok = match c.opcode {
            WcOpcode::Send => {
                acks_out -= 1;
                continue;
            }
            WcOpcode::Recv => {
                let buf = buf
                    .as_ref()
                    .ok_or(Error::Other("receive without buffer".into()))?;
                counts.send.fetch_add(1, Ordering::Relaxed);
                pattern(id, n, &mut l.want);
                buf.as_slice()?[..n] == l.want[..]
            }
            WcOpcode::RecvRdmaWithImm => {
                counts.write.fetch_add(1, Ordering::Relaxed);
                l.region.read_at(0, &mut l.data[..n])?;
                pattern(id, n, &mut l.want);
                l.data[..n] == l.want[..]
            }
            other => return Err(Error::Other(format!("unexpected completion {other:?}"))),
        };
        counts.bytes.fetch_add(n as u64, Ordering::Relaxed);
        if id != expected {
            return Err(Error::Protocol(format!(
                "message {id} arrived where {expected} was due: {}",
                if id < expected { "duplicated" } else { "lost" }
            )));
        }
        expected = expected.wrapping_add(1);
        l.qp.post_recv(RecvWr::new(u64::from(id), buf.expect("buffer back")))?;
        // A full send queue: only verdict completions can come now (the client waits
        // for this verdict before sending more).
        while acks_out == ACKS_IN_FLIGHT {
            let c = l.cq.next(peer, "a verdict's completion")?;
            if c.opcode != WcOpcode::Send {
                return Err(Error::Other(format!("unexpected completion {c:?}")));
            }
            acks_out -= 1;
        }
        l.qp.post_send(SendWr::send(u64::from(id)).imm(u32::from(ok)))?;
        acks_out += 1;
        if !ok {
            return Err(Error::Protocol(format!(
                "message {id} ({n} bytes): corrupted"
            )));
        }
    }
}

fn client_lane(
    mut l: Lane,
    peer: &ExchangeStream,
    counts: &Counts,
    o: &Opts,
    lane: usize,
    until: Instant,
) -> Result<Lane> {
    let mut rng = 0x2545_f491_4f6c_dd1du64 ^ (lane as u64 + 1);
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut id: u32 = 0;
    let enabled: Vec<u64> = (0..3).filter(|b| o.ops & (1 << b) != 0).collect();
    let mut last_write: Option<(u32, usize)> = None;
    let mut region = Some(l.region);
    while Instant::now() < until {
        let (n, op) = draw(next(), o, &enabled, last_write.is_some());
        let mut buf = region.take().expect("buffer is back");
        if op == 2 {
            if let Some((wid, wn)) = last_write {
                let rest = buf.split_off(wn)?;
                l.qp.post_send(SendWr::read(u64::from(id), buf, l.remote, 0))?;
                let mut c = l.cq.next(peer, "a READ's completion").inspect_err(|_| {
                    eprintln!("soak: QP {lane}: READ of message {wid} ({wn} bytes) failed")
                })?;
                let mut got = c
                    .take_mr()
                    .ok_or(Error::Other("READ without buffer".into()))?;
                // The region is remotely accessible: compare a copy.
                got.read_at(0, &mut l.data[..wn])?;
                pattern(wid, wn, &mut l.want);
                if l.data[..wn] != l.want[..] {
                    return Err(Error::Protocol(format!("READ of message {wid}: corrupted")));
                }
                got.unsplit(rest)
                    .map_err(|_| Error::Other("buffer pieces".into()))?;
                region = Some(got);
                counts.read.fetch_add(1, Ordering::Relaxed);
                counts.bytes.fetch_add(wn as u64, Ordering::Relaxed);
                continue;
            }
        }
        l.qp.post_recv(RecvWr::empty(u64::from(id)))?;
        pattern(id, n, &mut l.want);
        buf.write_at(0, &l.want)?;
        // The first n bytes; the completion gives the whole region back.
        let buf = buf.range(..n)?;
        if op == 0 {
            l.qp.post_send(SendWr::send(u64::from(id)).sge(buf).imm(id))?;
        } else {
            l.qp.post_send(SendWr::write(u64::from(id), l.remote, 0).sge(buf).imm(id))?;
            last_write = Some((id, n));
        }
        region = Some(await_verdict(&mut l.cq, peer, lane, id, n, op)?);
        if op == 0 {
            counts.send.fetch_add(1, Ordering::Relaxed);
        } else {
            counts.write.fetch_add(1, Ordering::Relaxed);
        }
        counts.bytes.fetch_add(n as u64, Ordering::Relaxed);
        id = id.wrapping_add(1);
    }
    // Tells the server this lane is done (an empty SEND it has a receive for).
    l.qp.post_send(SendWr::send(u64::from(id)).imm(END_OF_RUN))?;
    l.cq.next(peer, "the end-of-run SEND's completion")?;
    Ok(Lane {
        region: region.expect("buffer is back"),
        ..l
    })
}

/// A message's size and operation from the random `r`: sizes log-uniform in
/// 1..=max_size; 0 SEND, 1 WRITE, 2 READ, drawn among the enabled ones (a
/// READ needs a WRITE before it).
fn draw(r: u64, o: &Opts, enabled: &[u64], wrote: bool) -> (usize, u64) {
    let bits = (usize::BITS - o.max_size.leading_zeros()) as u64;
    let n = (1usize << (r % bits)).min(o.max_size);
    let n = (n + (r >> 32) as usize % n).clamp(1, o.max_size);
    let mut op = enabled[((r >> 8) % enabled.len() as u64) as usize];
    if op == 2 && !wrote {
        op = if o.ops & 2 != 0 { 1 } else { 0 };
    }
    (n, op)
}

/// Waits for the server's verdict on message `id` and for the completion
/// that hands back its buffer.
fn await_verdict(
    cq: &mut Waiter,
    peer: &ExchangeStream,
    lane: usize,
    id: u32,
    n: usize,
    op: u64,
) -> Result<Mr> {
    let mut acked = false;
    let mut back = None;
    while !acked || back.is_none() {
        let mut c = cq
            .next(peer, "a completion or the server's verdict")
            .inspect_err(|_| {
                eprintln!(
                    "soak: QP {lane}: {} of message {id} ({n} bytes) failed",
                    if op == 0 { "SEND" } else { "WRITE" }
                )
            })?;
        match c.opcode {
            WcOpcode::Recv => {
                if c.imm_data != Some(1) {
                    return Err(Error::Protocol(format!(
                        "the server found message {id} ({n} bytes) corrupted"
                    )));
                }
                acked = true;
            }
            _ => back = c.take_mr(),
        }
    }
    Ok(back.expect("buffer"))
}

fn run(o: &Opts) -> Result<()> {
    disable_thp()?;
    let ctx = Context::open(std::env::var("RDMA_VERBS_DEVICE").ok().as_deref())?;
    let pd = Pd::new(&ctx)?;
    let (lanes, stream) = connect_lanes(o, &ctx, &pd)?;
    let peer = Arc::new(stream);
    let counts = Arc::new(Counts::default());
    let gate = Arc::new(Gate::default());
    let start = Instant::now();
    let warm = Duration::from_secs(o.seconds.min(50) / 5 + 1);
    let until = start + Duration::from_secs(o.seconds);
    let role = if o.client.is_some() {
        "client"
    } else {
        "server"
    };
    let handles = spawn_lanes(o, lanes, &peer, &counts, &gate, until);
    thread::sleep(warm);
    let memory = watch_memory(&gate, &handles);
    let (mut result, lanes) = join_lanes(handles);
    let traffic_ok = result.is_ok();
    let growth = memory.end as i64 - memory.start as i64;
    if traffic_ok && growth > GROWTH_LIMIT_KIB as i64 {
        memory.print_growth(role);
        result = Err(Error::Other(format!(
            "anonymous memory grew by {growth} KiB after warm-up (the limit is {GROWTH_LIMIT_KIB} KiB)"
        )));
    }
    drop(lanes);
    let (s, w, r) = (
        counts.send.load(Ordering::Relaxed),
        counts.write.load(Ordering::Relaxed),
        counts.read.load(Ordering::Relaxed),
    );
    let Memory {
        start: anon_start,
        end: anon_end,
        peak: anon_peak,
        ..
    } = memory;
    println!(
        "soak {role}: {} messages (SEND {s}, WRITE {w}, READ {r}), {} bytes verified in {:.1} s on {} QPs; \
         {}; anonymous memory {anon_start} KiB after {} s warm-up, {anon_end} KiB at the end \
         ({growth:+} KiB; peak {anon_peak} KiB)",
        s + w + r,
        counts.bytes.load(Ordering::Relaxed),
        start.elapsed().as_secs_f64(),
        o.qps,
        if traffic_ok {
            "0 lost, 0 duplicated, 0 corrupted"
        } else {
            "stopped by the error below"
        },
        warm.as_secs(),
    );
    result
}

/// No transparent huge pages for this process: khugepaged (every 10 s, and with the
/// default max_ptes_none 511) turns any 2 MiB-aligned range of an anonymous mapping that
/// has one page in it into a huge page, all of it resident. In the guests that collapsed
/// the mostly unused 2 MiB thread stacks and scratch buffers at a random moment of the run
/// (+2 to +6 MiB, 10-20 s in), which is the kernel's choice of page size, not memory
/// the soak or the crate allocated: with it off, growth means allocation.
fn disable_thp() -> Result<()> {
    // SAFETY: prctl(PR_SET_THP_DISABLE) takes integers only and changes no memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) } != 0 {
        return Err(Error::Other(format!(
            "prctl(PR_SET_THP_DISABLE): {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// A QP in INIT with its CQ and its region, before the exchange.
type UnconnectedQp = (Qp<Rc, Init>, Cq, Mr);

/// `o.qps` QPs in INIT, each with its CQ (on its own channel) and its 1 MiB region.
fn create_qps(o: &Opts, ctx: &Context, pd: &Pd) -> Result<Vec<UnconnectedQp>> {
    let mut pending = Vec::new();
    for _ in 0..o.qps {
        let channel = CompletionChannel::new(ctx)?;
        let cq = Cq::with_channel(ctx, 2 * ACKS_IN_FLIGHT, &channel)?;
        let caps = QpCaps {
            max_send_wr: ACKS_IN_FLIGHT,
            max_recv_wr: 2,
            ..QpCaps::default()
        };
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let qp = Qp::new(pd, &cq, &cq, caps)?.init(InitAttr::new(1, access))?;
        let region = pd.alloc_mr(MIB, access)?;
        pending.push((qp, cq, region));
    }
    Ok(pending)
}

/// Swaps the QPs' endpoints and regions with the peer: the client sends first.
fn exchange_peers(
    o: &Opts,
    stream: &mut ExchangeStream,
    local: &[PeerInfo],
) -> Result<Vec<PeerInfo>> {
    let mut remote: Vec<PeerInfo> = Vec::new();
    if o.client.is_some() {
        for l in local {
            stream.send(l)?;
        }
        for _ in 0..o.qps {
            remote.push(stream.recv()?);
        }
    } else {
        for _ in 0..o.qps {
            remote.push(stream.recv()?);
        }
        for l in local {
            stream.send(l)?;
        }
    }
    Ok(remote)
}

/// Creates the lanes, connects each QP to its peer's and returns them with the
/// exchange connection (kept open: its closing is how a lane learns the peer died).
fn connect_lanes(o: &Opts, ctx: &Context, pd: &Pd) -> Result<(Vec<Lane>, ExchangeStream)> {
    let gid = ctx.default_gid_index(1)?;
    let mtu = ctx.query_port(1)?.active_mtu;
    let pending = create_qps(o, ctx, pd)?;
    let local: Vec<PeerInfo> = pending
        .iter()
        .map(|(qp, _, region)| Ok(PeerInfo::new(qp.endpoint(gid)?).with_mr(region.remote())))
        .collect::<Result<_>>()?;
    let timeout = Duration::from_secs(60);
    let mut stream = match &o.client {
        Some(host) => ExchangeStream::connect(host, o.port, timeout)?,
        None => ExchangeListener::bind(o.port)?.accept(Some(timeout))?,
    };
    let remote = exchange_peers(o, &mut stream, &local)?;
    let mut lanes = Vec::new();
    for ((qp, cq, region), (r, l)) in pending.into_iter().zip(remote.iter().zip(&local)) {
        let qp = qp
            .rtr(RtrAttr::new(&r.endpoint, 1, mtu, gid).min_rnr_timer(12))?
            .rts(RtsAttr::new(l.endpoint.psn).retry_cnt(7))?;
        let buf = if o.client.is_none() {
            Some(pd.alloc_mr(MIB, AccessFlags::LOCAL_WRITE)?)
        } else {
            None
        };
        let remote = *r
            .mrs
            .first()
            .ok_or_else(|| Error::Protocol("the peer sent no region".into()))?;
        lanes.push(Lane {
            qp,
            cq: Waiter {
                cq,
                ready: Vec::with_capacity(2 * ACKS_IN_FLIGHT as usize),
            },
            remote,
            region,
            buf,
            data: resident(MIB),
            want: resident(MIB + 8),
        });
    }
    // Both sides are connected before the client starts.
    if o.client.is_some() {
        stream.send_done()?;
    } else {
        stream.recv_done()?;
    }
    stream.set_timeout(None)?;
    Ok((lanes, stream))
}

/// One thread per lane, running the client's or the server's side; a lane
/// that fails ends the process. Each thread then holds its stack, arena and
/// lane until the memory at the end is measured.
fn spawn_lanes(
    o: &Opts,
    lanes: Vec<Lane>,
    peer: &Arc<ExchangeStream>,
    counts: &Arc<Counts>,
    gate: &Arc<Gate>,
    until: Instant,
) -> Vec<thread::JoinHandle<Result<Lane>>> {
    let mut handles = Vec::new();
    for (k, lane) in lanes.into_iter().enumerate() {
        let (peer, counts, gate) = (Arc::clone(peer), Arc::clone(counts), Arc::clone(gate));
        let client = o.client.is_some();
        let o = Opts {
            client: o.client.clone(),
            ..*o
        };
        handles.push(thread::spawn(move || {
            let r = if client {
                client_lane(lane, &peer, &counts, &o, k, until)
            } else {
                server_lane(lane, &peer, &counts)
            };
            if let Err(e) = &r {
                // The other lanes would wait for their peer lanes for a minute: end now.
                eprintln!(
                    "soak {}: QP {k}: error: {e}",
                    if client { "client" } else { "server" }
                );
                std::process::exit(1);
            }
            gate.done.fetch_add(1, Ordering::SeqCst);
            while !gate.measured.load(Ordering::SeqCst) {
                thread::sleep(Duration::from_millis(10));
            }
            r
        }));
    }
    handles
}

/// Joins the lanes' threads: the lanes back, or the first error.
fn join_lanes(handles: Vec<thread::JoinHandle<Result<Lane>>>) -> (Result<()>, Vec<Lane>) {
    let mut result = Ok(());
    let mut lanes = Vec::new();
    for h in handles {
        match h
            .join()
            .unwrap_or_else(|_| Err(Error::Other("a lane panicked".into())))
        {
            Ok(lane) => lanes.push(lane),
            Err(e) => {
                if result.is_ok() {
                    result = Err(e);
                }
            }
        }
    }
    (result, lanes)
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("soak: error: {e}");
            ExitCode::FAILURE
        }
    }
}
