//! An rdma_cm echo server on one tokio runtime, and a client that opens many
//! connections at once (feature `tokio`).
//!
//! ```text
//! async_echo --server [--port 7472] [--size 4096] [--recv-depth 16] [--sync]
//! async_echo --client HOST [--port 7472] [--conns 1] [--msgs 1000] [--size 4096]
//! ```
//!
//! The server accepts every connection on one `AsyncCq` and one shared
//! receive queue (`Srq`): all connections' receives come from that queue,
//! all their completions arrive on that one CQ, and one task echoes every
//! message back on the connection it came from, reusing the receive buffer
//! (registered once) for the echo and then for the next receive. `--sync`
//! runs the baseline instead: a thread per connection with the blocking API
//! (and 16 receives of its own per connection).
//!
//! The client opens `--conns` connections concurrently; each sends `--msgs`
//! messages of `--size` bytes, one at a time, and checks every echoed byte.
//! It prints messages/s and the p50/p99 round-trip time, and exits 0 only if
//! every message came back intact. The server prints its RSS as the number
//! of connections grows (`conns=N rss_kib=R`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_verbs::cm::{CmEventKind, CmId, ConnParam, ConnectRequest};
use rdma_verbs::prelude::*;
use rdma_verbs::tokio::{AsyncCmId, AsyncCq, AsyncQp, Listener};

#[path = "shared/fd_limit.rs"]
mod fd_limit;
use fd_limit::raise_fd_limit;

/// Entries of the server's one CQ: the shared receive queue reserves its
/// depth on it and every connection its send depth ([`SEND_DEPTH`]): room for
/// 960 connections with the default `--recv-depth`.
const CQ_DEPTH: u32 = 16384;

/// Send queue depth of each server connection (one echo in flight per
/// message received).
const SEND_DEPTH: u32 = 16;

/// Receives each connection of the `--sync` baseline posts for itself.
const SYNC_RECV_DEPTH: u32 = 16;

/// Bound on every wait: connection setup, each round trip.
const WAIT: Duration = Duration::from_secs(60);
/// Most round trips a client run times (each one's time is kept).
const MAX_ROUND_TRIPS: usize = 10_000_000;

const USAGE: &str = "usage:
  async_echo --server [--port P] [--size S] [--recv-depth R] [--sync]
  async_echo --client HOST [--port P] [--conns N] [--msgs M] [--size S]

  --server          echo every message on every connection (one tokio runtime)
  --sync            with --server: a thread per connection instead (the baseline)
  --client HOST     connect --conns connections to HOST and check every echo
  --port P          rdma_cm port (default 7472)
  --conns N         concurrent connections, 1..=4096 (default 1)
  --msgs M          messages per connection (default 1000; at most 10,000,000 over all
                    connections)
  --size S          message size in bytes, 1..=1048576 (default 4096); the server's
                    --size is the largest message it accepts
  --recv-depth R    server: receives posted on the shared receive queue, shared by
                    every connection (default 1024)";

#[derive(Debug, Clone)]
struct Args {
    server: bool,
    sync: bool,
    host: Option<String>,
    port: u16,
    conns: usize,
    msgs: usize,
    size: usize,
    recv_depth: u32,
}

fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        server: false,
        sync: false,
        host: None,
        port: 7472,
        conns: 1,
        msgs: 1000,
        size: 4096,
        recv_depth: 1024,
    };
    let mut it = std::env::args().skip(1);
    fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> std::result::Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse()
            .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
    }
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--server" => a.server = true,
            "--sync" => a.sync = true,
            "--client" => a.host = Some(it.next().ok_or("--client needs a HOST")?),
            "--port" => a.port = num("--port", it.next())?,
            "--conns" => a.conns = num("--conns", it.next())?,
            "--msgs" => a.msgs = num("--msgs", it.next())?,
            "--size" => a.size = num("--size", it.next())?,
            "--recv-depth" => a.recv_depth = num("--recv-depth", it.next())?,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if a.server == a.host.is_some() {
        return Err("give exactly one of --server and --client HOST".into());
    }
    if !(1..=4096).contains(&a.conns) {
        return Err(format!("--conns {} is out of range 1..=4096", a.conns));
    }
    if !(1..=1 << 20).contains(&a.size) {
        return Err(format!("--size {} is out of range 1..=1048576", a.size));
    }
    // Every round trip's time is kept for the percentiles.
    if a.msgs == 0 || a.msgs.saturating_mul(a.conns) > MAX_ROUND_TRIPS {
        return Err(format!(
            "--msgs {} is out of range: 1 to {MAX_ROUND_TRIPS} round trips over all connections",
            a.msgs
        ));
    }
    if !(1..=4096).contains(&a.recv_depth) {
        return Err(format!(
            "--recv-depth {} is out of range 1..=4096",
            a.recv_depth
        ));
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("async_echo: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    raise_fd_limit();
    let outcome = if args.server && args.sync {
        sync_server(&args)
    } else {
        let rt = ::tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                what: "starting the tokio runtime",
                source,
            });
        rt.and_then(|rt| {
            rt.block_on(async {
                if args.server {
                    server(&args).await
                } else {
                    client(&args).await
                }
            })
        })
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("async_echo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn caps(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        ..QpCaps::default()
    }
}

/// Resident set size of this process in KiB (from /proc/self/status).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn listen_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], port))
}

/// A connection as the echo task sees it.
enum Conn {
    /// Accepted, ESTABLISHED not seen yet by the server: a message that
    /// already arrived (the client may start as soon as *it* sees
    /// ESTABLISHED) is parked here and echoed once the QP is ready.
    Accepting(Vec<Completion>),
    Ready(Arc<AsyncQp<Rc, Rts>>),
}

/// The server's one PD, CQ and shared receive queue.
struct Device {
    pd: Pd,
    cq: AsyncCq,
    srq: std::sync::Mutex<Srq>,
}

/// What the server shares between its accept task and its echo task.
struct Server {
    /// Created with the first connection (the device is known only then).
    device: tokio::sync::OnceCell<Device>,
    conns: std::sync::Mutex<HashMap<u32, Conn>>,
    /// Parked completions handed back to the echo task.
    requeue: tokio::sync::mpsc::UnboundedSender<Completion>,
    size: usize,
    recv_depth: u32,
}

async fn server(args: &Args) -> Result<()> {
    let listener = Listener::bind(listen_addr(args.port), 1024)?;
    println!("async_echo: listening on port {}", args.port);
    let (requeue, requeued) = tokio::sync::mpsc::unbounded_channel();
    let mut requeued = Some(requeued);
    let srv = Arc::new(Server {
        device: tokio::sync::OnceCell::new(),
        requeue,
        conns: std::sync::Mutex::new(HashMap::new()),
        size: args.size,
        recv_depth: args.recv_depth,
    });
    let max_conns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    loop {
        let req = listener.request().await?;
        // The device (and the echo task) come with the first connection;
        // later handshakes run concurrently.
        if srv.device.get().is_none() {
            setup(&srv, &req, &mut requeued).await?;
        }
        let (srv, max_conns) = (srv.clone(), max_conns.clone());
        tokio::spawn(async move {
            let (qp, mut id) = match accept(&srv, req).await {
                Ok(x) => x,
                Err(e) => return eprintln!("async_echo: a connection failed to set up: {e}"),
            };
            let (n, parked) = {
                let mut conns = srv.conns.lock().unwrap_or_else(|e| e.into_inner());
                let old = conns.insert(qp.qp_num(), Conn::Ready(qp.clone()));
                let parked = match old {
                    Some(Conn::Accepting(v)) => v,
                    _ => Vec::new(),
                };
                (conns.len(), parked)
            };
            for c in parked {
                let _ = srv.requeue.send(c);
            }
            if n > max_conns.fetch_max(n, std::sync::atomic::Ordering::SeqCst) {
                println!("conns={n} rss_kib={}", rss_kib());
            }
            // Forget the connection when the peer disconnects (or dies).
            let _ = id.event().await;
            srv.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&qp.qp_num());
        });
    }
}

/// Creates the PD and the one CQ on the first connection's device and
/// starts the echo task.
async fn setup(
    srv: &Arc<Server>,
    req: &ConnectRequest,
    requeued: &mut Option<tokio::sync::mpsc::UnboundedReceiver<Completion>>,
) -> Result<()> {
    let ctx = req.id().context()?;
    let (size, depth) = (srv.size, srv.recv_depth);
    srv.device
        .get_or_try_init(|| async {
            let pd = Pd::new(&ctx)?;
            let cq = AsyncCq::new(&ctx, CQ_DEPTH)?;
            let mut srq = Srq::new(&pd, &cq.cq(), SrqAttr::new(depth, 1))?;
            // Every receive buffer is registered once, here, and reused.
            let mut bufs = (0..depth).map(|_| pd.alloc_mr(size, AccessFlags::LOCAL_WRITE));
            let mut failed = None;
            srq.refill(|| match bufs.next()? {
                Ok(mr) => Some(RecvWr::new(0, mr)),
                Err(e) => {
                    failed = Some(e);
                    None
                }
            })?;
            if let Some(e) = failed {
                return Err(e);
            }
            Ok::<_, Error>(Device {
                pd,
                cq,
                srq: std::sync::Mutex::new(srq),
            })
        })
        .await?;
    if let Some(requeued) = requeued.take() {
        let srv = srv.clone();
        tokio::spawn(async move {
            if let Err(e) = echo(srv, requeued).await {
                eprintln!("async_echo: echo loop failed: {e}");
                std::process::exit(1);
            }
        });
    }
    Ok(())
}

/// Accepts one connection on the shared CQ and SRQ.
async fn accept(
    srv: &Arc<Server>,
    req: ConnectRequest,
) -> Result<(Arc<AsyncQp<Rc, Rts>>, AsyncCmId)> {
    let dev = srv.device.get().expect("set up before the first accept");
    let qp: Qp<Rc, Init> = {
        let c = dev.cq.cq();
        let srq = dev.srq.lock().unwrap_or_else(|e| e.into_inner());
        req.id()
            .create_qp_with_srq(&dev.pd, &c, &c, &srq, caps(SEND_DEPTH, 0))?
    };
    let qp = AsyncQp::new(qp, &dev.cq, &dev.cq)?;
    let qp_num = qp.qp_num();
    let conns = || srv.conns.lock().unwrap_or_else(|e| e.into_inner());
    conns().insert(qp_num, Conn::Accepting(Vec::new()));
    match AsyncCmId::accept(req, qp, &ConnParam::new(), WAIT).await {
        Ok((qp, id)) => Ok((Arc::new(qp), id)),
        Err(e) => {
            conns().remove(&qp_num);
            Err(e)
        }
    }
}

/// Every completion of every connection: a message (a receive of the shared
/// queue, consumed by whichever connection it arrived on) is echoed from the
/// buffer it arrived in; when the echo has gone out, the buffer goes back to
/// the shared receive queue.
async fn echo(
    srv: Arc<Server>,
    mut requeued: tokio::sync::mpsc::UnboundedReceiver<Completion>,
) -> Result<()> {
    let dev = srv.device.get().expect("set before the task starts");
    let repost = |buf: Mr| {
        let mut srq = dev.srq.lock().unwrap_or_else(|e| e.into_inner());
        srq.post_recv(RecvWr::new(0, buf))
    };
    loop {
        let mut c: Completion = tokio::select! {
            c = dev.cq.next() => c?,
            Some(c) = requeued.recv() => c,
        };
        if c.source != CompletionSource::Posted {
            continue; // a connection that is gone (its buffers were released)
        }
        if c.opcode != WcOpcode::Recv {
            // An echo went out (or was flushed): the buffer, whole, is free again.
            let Some(buf) = c.take_mr() else { continue };
            repost(buf)?;
            continue;
        }
        if c.result().is_err() {
            if let Some(buf) = c.take_mr() {
                repost(buf)?;
            }
            continue;
        }
        let conn = {
            let mut conns = srv.conns.lock().unwrap_or_else(|e| e.into_inner());
            match conns.get_mut(&c.qp_num) {
                Some(Conn::Ready(qp)) => Some(qp.clone()),
                Some(Conn::Accepting(parked)) => {
                    parked.push(c);
                    continue;
                }
                None => None,
            }
        };
        let Some(buf) = c.take_mr() else { continue };
        let Some(conn) = conn else {
            repost(buf)?; // the connection is gone
            continue;
        };
        // Echo the bytes received: a range of the buffer, whole again on completion.
        let echo = buf.range(..c.byte_len as usize)?;
        if let Err(mut e) = conn.post_send(SendWr::send_from(0, echo)) {
            // Not posted (e.g. the connection went to ERR): keep the buffer.
            let buf = e
                .unposted
                .pop()
                .and_then(|(_, b)| b.into_iter().next()?.into_mr());
            if let Some(b) = buf {
                repost(b)?;
            }
        }
    }
}

/// The baseline: a thread per connection, blocking calls.
fn sync_server(args: &Args) -> Result<()> {
    let listener = CmId::listener(listen_addr(args.port), 1024)?;
    println!(
        "async_echo: listening on port {} (thread per connection)",
        args.port
    );
    let live = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut max_conns = 0;
    loop {
        let req = listener.get_request(Duration::from_secs(24 * 3600))?;
        let ctx = req.id().context()?;
        let (size, depth) = (args.size, SYNC_RECV_DEPTH);
        let live2 = live.clone();
        let n = live.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        std::thread::spawn(move || {
            if let Err(e) = sync_conn(req, &ctx, size, depth) {
                eprintln!("async_echo: connection ended: {e}");
            }
            live2.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        });
        if n > max_conns {
            max_conns = n;
            println!("conns={n} rss_kib={}", rss_kib());
        }
    }
}

fn sync_conn(req: ConnectRequest, ctx: &Context, size: usize, depth: u32) -> Result<()> {
    let pd = Pd::new(ctx)?;
    let channel = CompletionChannel::new(ctx)?;
    let mut cq = Cq::with_channel(ctx, depth * 2, &channel)?;
    let mut done = Vec::with_capacity(1);
    let mut qp = req.id().create_qp(&pd, &cq, &cq, caps(depth, depth))?;
    for _ in 0..depth {
        qp.post_recv(RecvWr::new(0, pd.alloc_mr(size, AccessFlags::LOCAL_WRITE)?))?;
    }
    let (mut qp, id) = req.accept(qp, &ConnParam::new(), WAIT)?;
    loop {
        // Sleep on the channel (a thread per connection must not spin);
        // look for DISCONNECTED between waits.
        let mut c = loop {
            if cq.wait_poll(&mut done, Some(Duration::from_millis(500)))? > 0 {
                break done.pop().expect("one completion");
            }
            if let Some(ev) = id.try_event()?
                && ev.kind == CmEventKind::Disconnected
            {
                return Ok(());
            }
        };
        if c.status == WcStatus::WrFlushErr {
            // The QP went to ERR: the client left (iWARP flushes before
            // DISCONNECTED can be read).
            return Ok(());
        }
        c.result()?;
        let Some(buf) = c.take_mr() else { continue };
        if c.opcode == WcOpcode::Recv {
            qp.post_send(SendWr::send_from(0, buf.range(..c.byte_len as usize)?))?;
        } else {
            qp.post_recv(RecvWr::new(0, buf))?;
        }
    }
}

async fn client(args: &Args) -> Result<()> {
    let host = args.host.as_deref().expect("checked by parse");
    let ip: std::net::IpAddr = host
        .parse()
        .map_err(|_| Error::Other(format!("--client {host}: not an IP address")))?;
    let server = SocketAddr::new(ip, args.port);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(args.conns);
    for conn in 0..args.conns {
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            one_connection(server, &args, conn).await
        }));
    }
    let mut rtts = Vec::with_capacity(args.conns * args.msgs);
    let mut failed = 0;
    for t in tasks {
        match t.await {
            Ok(Ok(mut v)) => rtts.append(&mut v),
            Ok(Err(e)) => {
                failed += 1;
                eprintln!("async_echo: connection failed: {e}");
            }
            Err(e) => {
                failed += 1;
                eprintln!("async_echo: connection task failed: {e}");
            }
        }
    }
    let elapsed = started.elapsed();
    if failed > 0 {
        return Err(Error::Other(format!(
            "{failed} of {} connections failed",
            args.conns
        )));
    }
    rtts.sort_unstable();
    let pct = |p: usize| rtts[(rtts.len() - 1) * p / 100];
    println!(
        "conns={} msgs={} size={} verified={} elapsed_s={:.3} msgs_per_s={:.0} p50_us={:.1} p99_us={:.1}",
        args.conns,
        args.msgs,
        args.size,
        rtts.len(),
        elapsed.as_secs_f64(),
        rtts.len() as f64 / elapsed.as_secs_f64(),
        pct(50).as_secs_f64() * 1e6,
        pct(99).as_secs_f64() * 1e6,
    );
    Ok(())
}

/// The message `i` of connection `conn`.
fn message(conn: usize, i: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|k| (k as u8).wrapping_mul(31) ^ (i as u8).wrapping_add(conn as u8))
        .collect()
}

/// One connection: `msgs` round trips, every echoed byte checked.
async fn one_connection(server: SocketAddr, args: &Args, conn: usize) -> Result<Vec<Duration>> {
    let mut id = AsyncCmId::resolve(server, WAIT).await?;
    let ctx = id.id().context()?;
    let pd = Pd::new(&ctx)?;
    let cq = AsyncCq::new(&ctx, 8)?;
    let qp = {
        let c = cq.cq();
        id.id().create_qp(&pd, &c, &c, caps(2, 2))?
    };
    let qp = AsyncQp::new(qp, &cq, &cq)?;
    let (qp, _) = id.connect(qp, &ConnParam::new(), WAIT).await?;
    let mut out = pd.alloc_mr(args.size, AccessFlags::LOCAL_WRITE)?;
    let mut back = pd.alloc_mr(args.size, AccessFlags::LOCAL_WRITE)?;
    let mut rtts = Vec::with_capacity(args.msgs);
    for i in 0..args.msgs {
        let msg = message(conn, i, args.size);
        out.write_at(0, &msg)?;
        let t = Instant::now();
        let round = async { tokio::join!(qp.recv_into(back), qp.send(out)) };
        // A server that dies after our SEND was acknowledged never fails a
        // request of ours: its DISCONNECTED (sent by its kernel) tells.
        let (got, sent) = tokio::select! {
            r = tokio::time::timeout(WAIT, round) => r.map_err(|_| Error::Timeout {
                what: "waiting for an echo (is the server alive?)",
                after: WAIT,
            })?,
            ev = id.event() => {
                return Err(Error::Other(format!(
                    "connection {conn}: the server went away before echoing message {i} ({})",
                    ev.map_or_else(|e| e.to_string(), |ev| format!("{:?}", ev.kind))
                )));
            }
        };
        let (mut got, mut sent) = (got?, sent?);
        rtts.push(t.elapsed());
        sent.result()?;
        got.result()?;
        out = sent.take_mr().expect("the send buffer comes back");
        back = got.take_mr().expect("the receive buffer comes back");
        if got.byte_len as usize != args.size || back.to_vec()? != msg {
            return Err(Error::Protocol(format!(
                "connection {conn}: message {i} came back different ({} bytes)",
                got.byte_len
            )));
        }
    }
    id.disconnect(WAIT).await?;
    Ok(rtts)
}
