//! `scale`: the crate's side of `cargo xtask scale`, the costs that grow with the
//! number of objects a program holds: registering memory, a QP's life, and
//! rdma_cm connection setup of many connections.
//!
//! ```text
//! scale reg --size BYTES --iters N      # Mr::register + Mr::into_buffer on one buffer
//! scale qp --iters N                    # Qp::new -> INIT -> RTR -> RTS -> drop
//! scale cm-server --conns N [--tokio | --batch] [--port P]
//! scale cm-client ADDR --conns N [--tokio | --batch] [--port P]
//! ```
//!
//! `--batch`: the blocking server accepts with one `cm::accept_all`, the
//! blocking client connects with one `cm::connect_all` (its setup is one
//! `step setup` line).
//!
//! Each prints `key value` lines (`ops_per_s`, or one `step NAME TOTAL_US` line
//! per connection step), the format xtask's C loops print too. The C programs it
//! is measured against are rdma-core's `cmtime` (rdma_cm) and a loop xtask
//! compiles (registration, QP life); `cargo xtask scale --help` says how they
//! pair up.
//!
//! Registration uses the owned path (`Mr::register` of a `Vec<u8>` allocated
//! once, `Mr::into_buffer` to get it back): the same kernel work as the C loop's
//! `ibv_reg_mr`/`ibv_dereg_mr` on a pre-allocated buffer, plus what the safe
//! API adds (the region's bookkeeping), which is what is being measured.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdma_verbs::prelude::*;

#[path = "scale/cm.rs"]
mod cm;
#[cfg(feature = "tokio")]
#[path = "scale/cm_async.rs"]
mod cm_async;
#[path = "shared/fd_limit.rs"]
mod fd_limit;

const USAGE: &str = "usage:
  scale reg --size BYTES --iters N
  scale qp --iters N
  scale cm-server --conns N [--tokio | --batch] [--port P]
  scale cm-client ADDR --conns N [--tokio | --batch] [--port P]";

/// Largest region `reg` accepts (the guest has 2 GiB).
const MAX_REG: usize = 1 << 30;
/// Most connections `cm-*` set up.
const MAX_CONNS: usize = 4096;

/// The command line.
#[derive(Debug)]
struct Args {
    cmd: String,
    addr: Option<String>,
    size: usize,
    iters: u64,
    conns: usize,
    tokio: bool,
    batch: bool,
    port: u16,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let cmd = it.next().ok_or("missing subcommand")?;
    if !["reg", "qp", "cm-server", "cm-client"].contains(&cmd.as_str()) {
        return Err(format!("unknown subcommand `{cmd}`"));
    }
    let mut a = Args {
        cmd,
        addr: None,
        size: 4096,
        iters: 1000,
        conns: 64,
        tokio: false,
        batch: false,
        port: 7471,
    };
    fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
        let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
        v.parse()
            .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
    }
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--size" => a.size = num("--size", it.next())?,
            "--iters" => a.iters = num("--iters", it.next())?,
            "--conns" => a.conns = num("--conns", it.next())?,
            "--port" => a.port = num("--port", it.next())?,
            "--tokio" => a.tokio = true,
            "--batch" => a.batch = true,
            s if !s.starts_with('-') && a.addr.is_none() => a.addr = Some(s.to_owned()),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    if !(1..=MAX_REG).contains(&a.size) {
        return Err(format!("--size {} is out of range 1..={MAX_REG}", a.size));
    }
    if a.iters == 0 {
        return Err("--iters must be at least 1".into());
    }
    if !(1..=MAX_CONNS).contains(&a.conns) {
        return Err(format!(
            "--conns {} is out of range 1..={MAX_CONNS}",
            a.conns
        ));
    }
    if a.batch && (a.tokio || !a.cmd.starts_with("cm-")) {
        return Err("--batch is the blocking cm-server's and cm-client's; not with --tokio".into());
    }
    if (a.cmd == "cm-client") != a.addr.is_some() {
        return Err("cm-client takes the server's address; the others take none".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("scale: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let outcome = match args.cmd.as_str() {
        "reg" => reg(args.size, args.iters),
        "qp" => qp_life(args.iters),
        _ => connections(&args),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The device named by `RDMA_VERBS_DEVICE`, or the first one.
fn open() -> Result<Context> {
    Context::open(std::env::var("RDMA_VERBS_DEVICE").ok().as_deref())
}

/// Prints the rate of `iters` operations done in `took`.
fn print_rate(iters: u64, took: Duration) {
    println!("iters {iters}");
    println!("ops_per_s {:.1}", iters as f64 / took.as_secs_f64());
}

/// `iters` registrations and deregistrations of one `size`-byte buffer.
fn reg(size: usize, iters: u64) -> Result<()> {
    let ctx = open()?;
    let pd = Pd::new(&ctx)?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    // Touched, so that each registration pins resident pages as the C loop's does.
    let mut buf = vec![1u8; size];
    let start = Instant::now();
    for _ in 0..iters {
        let mr = Mr::register(&pd, buf, access)?;
        buf = mr
            .into_buffer::<Vec<u8>>()
            .map_err(|_| Error::Other("the region did not give its buffer back".into()))?;
    }
    print_rate(iters, start.elapsed());
    Ok(())
}

/// `iters` RC QPs created, taken to RTS towards a peer QP and destroyed.
fn qp_life(iters: u64) -> Result<()> {
    let ctx = open()?;
    let pd = Pd::new(&ctx)?;
    let cq = Cq::new(&ctx, 512)?;
    let gid = ctx.default_gid_index(1)?;
    let mtu = ctx.query_port(1)?.active_mtu;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let peer = Qp::new(&pd, &cq, &cq, QpCaps::default())?.init(InitAttr::new(1, access))?;
    let remote = peer.endpoint(gid)?;
    let start = Instant::now();
    for _ in 0..iters {
        let qp = Qp::new(&pd, &cq, &cq, QpCaps::default())?
            .init(InitAttr::new(1, access))?
            .rtr(RtrAttr::new(&remote, 1, mtu, gid))?;
        let psn = qp.psn();
        drop(qp.rts(RtsAttr::new(psn))?);
    }
    print_rate(iters, start.elapsed());
    Ok(())
}

/// `cm-server` / `cm-client`, blocking or on tokio.
fn connections(a: &Args) -> Result<()> {
    fd_limit::raise_fd_limit();
    let run = cm::Run {
        conns: a.conns,
        port: a.port,
    };
    match (a.cmd.as_str(), a.tokio) {
        ("cm-server", false) if a.batch => cm::batch_server(&run),
        ("cm-server", false) => cm::server(&run),
        ("cm-client", false) if a.batch => {
            cm::batch_client(&run, a.addr.as_deref().unwrap_or_default())
        }
        ("cm-client", false) => cm::client(&run, a.addr.as_deref().unwrap_or_default()),
        #[cfg(feature = "tokio")]
        (cmd, true) => cm_async::run(&run, cmd == "cm-server", a.addr.as_deref()),
        #[cfg(not(feature = "tokio"))]
        (_, true) => Err(Error::Other(
            "--tokio needs the example built with `--features tokio`".into(),
        )),
        _ => unreachable!("parse() admits only these subcommands"),
    }
}
