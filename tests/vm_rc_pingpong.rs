//! Interoperability of `examples/rc_pingpong.rs` with rdma-core's C
//! `ibv_rc_pingpong`, in both roles, polling and with `-e`, at 1 B, 4 KiB and
//! 64 KiB (run inside the soft-RoCE guest by `cargo xtask test`; build the
//! example first with `cargo build --examples`, which `cargo xtask test` does).
//!
//! Every case runs both programs with `-c` (the server checks the data it
//! received last) and checks that both exit 0 and print the address lines
//! and the closing lines, and that each side's remote address is the other's
//! local one. Cases run one at a time, each on its own TCP port.
mod common;

use common::procs::{Proc, example, finish};

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// -n: small, TCG is slow.
const ITERS: u32 = 50;
const SIZES: [usize; 3] = [1, 4096, 65536];
/// Per process.
const LIMIT: Duration = Duration::from_secs(120);

static SERIAL: Mutex<()> = Mutex::new(());

const C_PROGRAM: &str = "ibv_rc_pingpong";

/// target/<profile>/examples/rc_pingpong.
fn ours() -> PathBuf {
    example("rc_pingpong")
}

fn c_program() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(C_PROGRAM))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{C_PROGRAM} not found on PATH: install ibverbs-utils (rdma-core's examples)")
        })
}

/// The `  local address:  LID ..., QPN 0x..., PSN 0x..., GID ...` line's fields.
fn address(out: &str, which: &str) -> String {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("  {which} address:")))
        .unwrap_or_else(|| panic!("no `{which} address` line in:\n{out}"));
    let fields = line.split_once("LID ").map(|x| x.1).unwrap_or("");
    assert!(
        fields.starts_with("0x") && fields.contains(", QPN 0x") && fields.contains(", PSN 0x"),
        "malformed line `{line}`"
    );
    assert!(
        fields.contains(", GID ::ffff:10.99.0.1") || !fields.contains("::ffff:"),
        "unexpected GID in `{line}`"
    );
    fields.to_owned()
}

fn check_closing(out: &str, size: usize, who: &str) {
    let bytes = size as u64 * u64::from(ITERS) * 2;
    let b = out
        .lines()
        .find(|l| l.starts_with(&format!("{bytes} bytes in ")))
        .unwrap_or_else(|| panic!("{who}: no `{bytes} bytes in` line:\n{out}"));
    assert!(
        b.ends_with(" Mbit/sec") && b.contains(" seconds = "),
        "{who}: `{b}`"
    );
    let i = out
        .lines()
        .find(|l| l.starts_with(&format!("{ITERS} iters in ")))
        .unwrap_or_else(|| panic!("{who}: no `{ITERS} iters in` line:\n{out}"));
    assert!(
        i.ends_with(" usec/iter") && i.contains(" seconds = "),
        "{who}: `{i}`"
    );
    assert!(
        !out.contains("invalid data"),
        "{who}: data check failed:\n{out}"
    );
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Ours,
    C,
}

impl Side {
    fn program(self) -> (PathBuf, &'static str) {
        match self {
            Side::Ours => (ours(), "rc_pingpong (ours)"),
            Side::C => (c_program(), C_PROGRAM),
        }
    }
}

struct Case {
    server: Side,
    client: Side,
    events: bool,
    size: usize,
    port: u16,
}

fn run_case(c: &Case, gid: u8) -> Duration {
    let mut args = vec![
        "-g".to_owned(),
        gid.to_string(),
        "-n".to_owned(),
        ITERS.to_string(),
        "-s".to_owned(),
        c.size.to_string(),
        "-p".to_owned(),
        c.port.to_string(),
        "-c".to_owned(),
    ];
    if c.events {
        args.push("-e".to_owned());
    }
    let ((sbin, sname), (cbin, cname)) = (c.server.program(), c.client.program());
    let t = Instant::now();
    let server = Proc::server(sname, &sbin, &args, c.port, t + LIMIT);
    let host = std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into());
    let mut cargs = args.clone();
    cargs.push(host);
    let client = Proc::spawn(cname, &cbin, &cargs, &format!("{}-client", c.port));
    let (sout, cout) = finish(server, client, Instant::now() + LIMIT);
    let report = format!("server:\n{sout}\nclient:\n{cout}");
    check_closing(&sout, c.size, "server");
    check_closing(&cout, c.size, "client");
    // Each side's remote address is the other's local one.
    assert_eq!(
        address(&sout, "remote"),
        address(&cout, "local"),
        "{report}"
    );
    assert_eq!(
        address(&cout, "remote"),
        address(&sout, "local"),
        "{report}"
    );
    t.elapsed()
}

fn run_all(server: Side, client: Side, base_port: u16, sizes: &[usize]) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = common::ctx();
    common::require_hand_connection(&ctx);
    let gid = common::gid_index(&ctx);
    let mut port = base_port;
    for events in [false, true] {
        for &size in sizes {
            let c = Case {
                server,
                client,
                events,
                size,
                port,
            };
            let took = run_case(&c, gid);
            eprintln!(
                "server {server:?}, client {client:?}, -e {events}, -s {size}: ok in {took:?}"
            );
            port += 1;
        }
    }
}

#[test]
fn ours_as_server_with_c_client() {
    run_all(Side::Ours, Side::C, 18700, &SIZES);
}

#[test]
fn c_server_with_ours_as_client() {
    run_all(Side::C, Side::Ours, 18720, &SIZES);
}

#[test]
fn ours_with_ours_odd_size() {
    // A size that is not a multiple of the page or the MTU.
    run_all(Side::Ours, Side::Ours, 18740, &[100_000]);
}
