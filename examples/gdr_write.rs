//! RDMA WRITE from GPU memory into a peer's (host) memory region.
//!
//! ```text
//! server$ cargo run --release --features gdr --example gdr_write -- --server [--size 64M]
//! client$ cargo run --release --features gdr --example gdr_write -- --client SERVER_HOST \
//!             [--size 64M] [--mode auto|dmabuf|peermem|staging] [--gpu 0] [--iters 10]
//! ```
//! Common options: `--port N` (TCP port of the exchange, default 18515),
//! `--device NAME` (RDMA device, default: the first), `--gid-index N` (needed on
//! RoCE; omit on InfiniBand), `--size BYTES` (K/M/G suffixes; both sides must agree).
//!
//! The client fills a GPU buffer with a pattern, prepares it with
//! `GpuBuffer::new` (which picks GPUDirect RDMA via dma-buf or nvidia-peermem,
//! or stages through host memory), RDMA-WRITEs it into the server's MR, and
//! prints the path taken and the bandwidth. The server checks every byte and
//! reports back. The endpoint/MR exchange is a one-line text protocol over TCP.
//! Without a GPU the client exits with status 1 and the typed error's message.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

use rdma_verbs::gdr::{self, DeviceAlloc, GdrMode, GpuBuffer};
use rdma_verbs::prelude::*;

const USAGE: &str = "usage: gdr_write (--server | --client HOST) [--port N] [--size BYTES] \
                     [--device RDMA_DEV] [--gid-index N] [--gpu N] [--mode auto|dmabuf|peermem|staging] \
                     [--iters N]";

struct Args {
    server: bool,
    host: Option<String>,
    port: u16,
    size: usize,
    device: Option<String>,
    gid_index: Option<u8>,
    gpu: usize,
    mode: GdrMode,
    iters: u32,
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1 << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        server: false,
        host: None,
        port: 18515,
        size: 64 << 20,
        device: None,
        gid_index: None,
        gpu: 0,
        mode: GdrMode::Auto,
        iters: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--server" => a.server = true,
            "--client" => a.host = Some(val()?),
            "--port" => a.port = val()?.parse().map_err(|e| format!("--port: {e}"))?,
            "--size" => {
                a.size = parse_size(&val()?).ok_or("--size: expected e.g. 4096, 64K, 16M")?
            }
            "--device" => a.device = Some(val()?),
            "--gid-index" => {
                a.gid_index = Some(val()?.parse().map_err(|e| format!("--gid-index: {e}"))?)
            }
            "--gpu" => a.gpu = val()?.parse().map_err(|e| format!("--gpu: {e}"))?,
            "--mode" => a.mode = val()?.parse().map_err(|e| format!("--mode: {e}"))?,
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0)
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if a.server == a.host.is_some() {
        return Err("give exactly one of --server and --client HOST".into());
    }
    if a.size == 0 || a.iters == 0 {
        return Err("--size and --iters must be at least 1".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gdr_write: {e}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let r = if args.server {
        server(&args)
    } else {
        client(&args)
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("gdr_write: {e}");
            ExitCode::FAILURE
        }
    }
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// The byte at `i` of the test pattern (both sides compute it).
fn pattern(i: usize) -> u8 {
    (i as u8).wrapping_mul(131).wrapping_add((i >> 10) as u8) ^ 0x5a
}

/// One QP with its CQ, in INIT, ready to be connected.
struct Side {
    pd: Pd,
    cq: Cq,
    qp: Qp<Rc, rdma_verbs::qp::Init>,
}

fn open_side(args: &Args, access: AccessFlags) -> AnyResult<Side> {
    let ctx = Context::open(args.device.as_deref())?;
    let pd = Pd::new(&ctx)?;
    let cq = Cq::new(&ctx, 256)?;
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 1,
        ..QpCaps::default()
    };
    let qp = Qp::new(&pd, &cq, &cq, caps)?
        .init(InitAttr::new(1, access))
        .map_err(|e| e.error)?;
    Ok(Side { pd, cq, qp })
}

fn format_endpoint(e: &Endpoint) -> String {
    format!("{} {} {} {}", e.lid, e.qpn, e.psn, e.gid.to_wire_hex())
}

fn parse_endpoint(f: &[&str]) -> AnyResult<Endpoint> {
    if f.len() < 4 {
        return Err("short endpoint message".into());
    }
    Ok(Endpoint {
        lid: f[0].parse()?,
        qpn: f[1].parse()?,
        psn: f[2].parse()?,
        gid: f[3].parse::<Gid>()?,
    })
}

fn read_line(r: &mut BufReader<TcpStream>) -> AnyResult<String> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err("peer closed the connection".into());
    }
    Ok(line.trim_end().to_owned())
}

fn connect(side: Side, remote: &Endpoint, args: &Args) -> AnyResult<(Qp<Rc, Rts>, Cq, Pd)> {
    let qp = side.qp.connect(remote, args.gid_index)?;
    Ok((qp, side.cq, side.pd))
}

fn server(args: &Args) -> AnyResult<bool> {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let side = open_side(args, access)?;
    let mr = side.pd.alloc_mr(args.size, access)?;
    let me = side.qp.endpoint(args.gid_index)?;
    let listener = TcpListener::bind(("0.0.0.0", args.port))?;
    println!(
        "server: {} bytes at {:#x} rkey {:#x}; waiting on port {}",
        mr.len(),
        mr.addr(),
        mr.rkey(),
        args.port
    );
    let (stream, peer) = listener.accept()?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut w = stream;
    let r = mr.remote();
    writeln!(
        w,
        "GDRW1 {} {} {} {}",
        format_endpoint(&me),
        r.addr,
        r.len,
        r.rkey
    )?;
    let line = read_line(&mut reader)?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.first() != Some(&"GDRW1") {
        return Err(format!("unexpected hello from {peer}: {line}").into());
    }
    let remote = parse_endpoint(&f[1..])?;
    let (_qp, _cq, _pd) = connect(side, &remote, args)?;
    writeln!(w, "READY")?;
    // The client WRITEs; "DONE" comes after its last WRITE completed, so the
    // data is in `mr` when it arrives.
    let line = read_line(&mut reader)?;
    if !line.starts_with("DONE") {
        return Err(format!("unexpected message: {line}").into());
    }
    let got = mr.to_vec()?;
    let bad = got.iter().enumerate().position(|(i, &b)| b != pattern(i));
    match bad {
        None => {
            println!("server: {line}; all {} bytes verified", got.len());
            writeln!(w, "OK")?;
            Ok(true)
        }
        Some(i) => {
            println!(
                "server: MISMATCH at byte {i}: got {:#04x}, expected {:#04x}",
                got[i],
                pattern(i)
            );
            writeln!(w, "BAD {i}")?;
            Ok(false)
        }
    }
}

fn client(args: &Args) -> AnyResult<bool> {
    // GPU first: without one this fails right here with the typed error.
    let cuda = gdr::cuda_context(args.gpu)?;
    let stream = cuda.default_stream();
    let mut mem = DeviceAlloc::new(&stream, args.size)?;
    let host: Vec<u8> = (0..args.size).map(pattern).collect();
    gdr::copy_to_device(&mut mem, 0, &host)?;
    drop(host);

    let side = open_side(args, AccessFlags::LOCAL_WRITE)?;
    let mut buf = GpuBuffer::new(&side.pd, mem, args.mode)?;
    println!(
        "client: GPU {} ({}), {} bytes, mode {} -> path: {}",
        args.gpu,
        cuda.name().unwrap_or_else(|_| "?".into()),
        args.size,
        args.mode,
        buf.path()
    );
    for m in buf.skipped() {
        println!("  not used: {m}");
    }
    for f in buf.failures() {
        println!("  tried: {f}");
    }

    let host_name = args.host.as_deref().unwrap_or_default();
    let stream = TcpStream::connect((host_name, args.port))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut w = stream;
    let line = read_line(&mut reader)?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.first() != Some(&"GDRW1") || f.len() < 8 {
        return Err(format!("unexpected hello: {line}").into());
    }
    let remote_ep = parse_endpoint(&f[1..5])?;
    let remote_mr = RemoteMr {
        addr: f[5].parse()?,
        len: f[6].parse()?,
        rkey: f[7].parse()?,
    };
    if remote_mr.len < args.size as u64 {
        return Err(format!(
            "the server's MR has {} bytes, fewer than --size {}",
            remote_mr.len, args.size
        )
        .into());
    }
    let me = side.qp.endpoint(args.gid_index)?;
    writeln!(w, "GDRW1 {}", format_endpoint(&me))?;
    let (mut qp, mut cq, _pd) = connect(side, &remote_ep, args)?;
    if read_line(&mut reader)? != "READY" {
        return Err("server did not get ready".into());
    }

    buf.set_timeout(Duration::from_secs(20));
    let mut total = Duration::ZERO;
    let mut bytes = 0u64;
    for _ in 0..args.iters {
        let t = buf.write(&mut qp, &mut cq, remote_mr, 0)?;
        total += t.elapsed;
        bytes += t.bytes;
    }
    let gbps = bytes as f64 / total.as_secs_f64().max(1e-9) / 1e9;
    println!(
        "client: wrote {} x {} bytes via {} in {:.3} ms: {:.2} GB/s ({:.1} Gbit/s)",
        args.iters,
        args.size,
        buf.path(),
        total.as_secs_f64() * 1e3,
        gbps,
        gbps * 8.0
    );
    writeln!(w, "DONE path={:?} bytes={bytes} gbps={gbps:.2}", buf.path())?;
    let verdict = read_line(&mut reader)?;
    println!("client: server says {verdict}");
    Ok(verdict == "OK")
}
