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

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// -n: small, TCG is slow.
const ITERS: u32 = 50;
const SIZES: [usize; 3] = [1, 4096, 65536];
/// Per process.
const LIMIT: Duration = Duration::from_secs(120);

static SERIAL: Mutex<()> = Mutex::new(());

const C_PROGRAM: &str = "ibv_rc_pingpong";

/// target/<profile>/examples/rc_pingpong, next to this test's deps/ directory.
fn ours() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = dir.join("examples").join("rc_pingpong");
    assert!(
        bin.is_file(),
        "{} has not been built: run `cargo build --examples` first (cargo xtask test does)",
        bin.display()
    );
    bin
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

/// True when something listens on TCP `port` (/proc/net/tcp{,6}, state 0A).
/// Probing by connecting would consume the server's only accept().
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
            })
    })
}

struct Proc {
    name: String,
    child: Child,
    out: PathBuf,
}

impl Proc {
    fn spawn(name: &str, bin: &Path, args: &[String], tag: &str) -> Proc {
        let out =
            std::env::temp_dir().join(format!("vm_rc_pingpong-{}-{tag}.out", std::process::id()));
        let f = File::create(&out).expect("output file");
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("dup"))
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        Proc {
            name: format!("{name} {}", args.join(" ")),
            child,
            out,
        }
    }

    fn output(&self) -> String {
        fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits at most `limit`; kills the process after that.
    fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let t = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if t.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = fs::remove_file(&self.out);
    }
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
    let mut server = Proc::spawn(sname, &sbin, &args, &format!("{}-server", c.port));
    while !listening(c.port) {
        if let Some(st) = server.child.try_wait().expect("try_wait") {
            panic!(
                "{} exited with {st} before listening:\n{}",
                server.name,
                server.output()
            );
        }
        assert!(
            t.elapsed() < LIMIT,
            "{} never listened on {}",
            server.name,
            c.port
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let host = std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into());
    let mut cargs = args.clone();
    cargs.push(host);
    let mut client = Proc::spawn(cname, &cbin, &cargs, &format!("{}-client", c.port));
    let cst = client.wait(LIMIT);
    let sst = server.wait(LIMIT);
    let (sout, cout) = (server.output(), client.output());
    let report = format!(
        "server `{}`: {sst:?}\n{sout}\nclient `{}`: {cst:?}\n{cout}",
        server.name, client.name
    );
    assert!(
        cst.is_some_and(|s| s.success()) && sst.is_some_and(|s| s.success()),
        "a side failed or timed out:\n{report}"
    );
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
    let gid = common::gid_index(&common::ctx());
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
