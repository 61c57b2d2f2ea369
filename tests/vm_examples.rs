//! The two-process examples run to completion: `send_recv`, `rdma_write`,
//! `rdma_read` (1000 iterations) and `rc_pingpong` (`-n 1000`), at 4 KiB and
//! 1 B, server and client on the same device (run inside the soft-RoCE guest
//! by `cargo xtask test`; build the examples first with `cargo build
//! --all-features --examples`, which `cargo xtask test` does).
//!
//! Each case starts the server, waits until it listens, runs the client
//! against $RDMA_VERBS_ADDR, and checks that both exit 0 within [`LIMIT`]
//! (a side that is not done by then is killed: a lost completion used to
//! stall both for 30 s) and print the line that says the data was verified.
//! Cases run one at a time, each on its own TCP port.
mod common;

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const ITERS: usize = 1000;
const SIZES: [usize; 2] = [4096, 1];
/// Per side, from the server's start.
const LIMIT: Duration = Duration::from_secs(60);

static SERIAL: Mutex<()> = Mutex::new(());

/// target/<profile>/examples/NAME, next to this test's deps/ directory.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = dir.join("examples").join(name);
    assert!(
        bin.is_file(),
        "{} has not been built: run `cargo build --all-features --examples` first (cargo xtask test does)",
        bin.display()
    );
    bin
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

/// A running example, its stdout and stderr going to a file.
struct Proc {
    name: String,
    child: Child,
    out: PathBuf,
}

impl Proc {
    fn spawn(bin: &Path, args: &[String], tag: &str) -> Proc {
        let out =
            std::env::temp_dir().join(format!("vm_examples-{}-{tag}.out", std::process::id()));
        let f = File::create(&out).expect("output file");
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("dup"))
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let file = bin.file_name().unwrap_or_default().to_string_lossy();
        Proc {
            name: format!("{file} {}", args.join(" ")),
            child,
            out,
        }
    }

    fn output(&self) -> String {
        fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits until `deadline`; kills the process after that (`None`).
    fn wait(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if Instant::now() > deadline {
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

/// Runs example `name` as server (`server_args`, listening on `port`), then
/// as client (`client_args`, which name the server); returns both outputs and
/// the time taken, once both exited 0 in time.
fn run_pair(
    name: &str,
    port: u16,
    server_args: &[String],
    client_args: &[String],
) -> (String, String, Duration) {
    let bin = example(name);
    let t = Instant::now();
    let deadline = t + LIMIT;
    let mut server = Proc::spawn(&bin, server_args, &format!("{port}-server"));
    while !listening(port) {
        if let Some(st) = server.child.try_wait().expect("try_wait") {
            panic!(
                "`{}` exited with {st} before listening:\n{}",
                server.name,
                server.output()
            );
        }
        assert!(
            Instant::now() < deadline,
            "`{}` never listened on {port}",
            server.name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut client = Proc::spawn(&bin, client_args, &format!("{port}-client"));
    let cst = client.wait(deadline);
    let sst = server.wait(deadline);
    let took = t.elapsed();
    let (sout, cout) = (server.output(), client.output());
    let report = format!(
        "server `{}`: {}\n{sout}\nclient `{}`: {}\n{cout}",
        server.name,
        status(sst),
        client.name,
        status(cst)
    );
    assert!(
        cst.is_some_and(|s| s.success()) && sst.is_some_and(|s| s.success()),
        "a side failed or was not done within {LIMIT:?}:\n{report}"
    );
    (sout, cout, took)
}

fn status(st: Option<ExitStatus>) -> String {
    match st {
        Some(st) => st.to_string(),
        None => format!("killed: not done within {LIMIT:?}"),
    }
}

fn addr() -> String {
    std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into())
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

fn assert_line(out: &str, who: &str, prefix: &str) {
    assert!(
        out.lines().any(|l| l.starts_with(prefix)),
        "{who}: no line starting with `{prefix}`:\n{out}"
    );
}

/// One of the `app.rs` examples at each size: `server_says` and
/// `client_says` are the starts of the lines each side prints on success,
/// with `{size}` replaced.
fn app_example(name: &str, base_port: u16, server_says: &str, client_says: &str) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for (k, size) in SIZES.into_iter().enumerate() {
        let port = (base_port + k as u16).to_string();
        let (iters, size_s) = (ITERS.to_string(), size.to_string());
        let opts = ["--iters", &iters, "--size", &size_s, "--port", &port];
        let server = strings(&[&["--server"][..], &opts].concat());
        let client = strings(&[&["--client", &addr()][..], &opts].concat());
        let (sout, cout, took) = run_pair(name, base_port + k as u16, &server, &client);
        let fill = |s: &str| s.replace("{size}", &size_s).replace("{iters}", &iters);
        assert_line(&sout, "server", &fill(server_says));
        assert_line(&cout, "client", &fill(client_says));
        eprintln!("{name} --size {size} --iters {ITERS}: ok in {took:?}");
    }
}

#[test]
fn send_recv() {
    app_example(
        "send_recv",
        19510,
        "server: {iters} messages of {size} bytes sent and verified",
        "client: {iters} messages of {size} bytes sent and verified",
    );
}

#[test]
fn rdma_write() {
    app_example(
        "rdma_write",
        19520,
        "server: {iters} RDMA WRITEs of {size} bytes received and verified",
        "client: {iters} RDMA WRITEs of {size} bytes acknowledged",
    );
}

#[test]
fn rdma_read() {
    app_example(
        "rdma_read",
        19530,
        "server: client finished reading {size} bytes",
        "client: {iters} RDMA READs of {size} bytes verified",
    );
}

#[test]
fn rc_pingpong() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let gid = common::gid_index(&common::ctx()).to_string();
    for (k, size) in SIZES.into_iter().enumerate() {
        let port = 19540 + k as u16;
        let (port_s, iters, size_s) = (port.to_string(), ITERS.to_string(), size.to_string());
        // -c: the server checks the last message it received.
        let server = strings(&["-g", &gid, "-n", &iters, "-s", &size_s, "-p", &port_s, "-c"]);
        let mut client = server.clone();
        client.push(addr());
        let (sout, cout, took) = run_pair("rc_pingpong", port, &server, &client);
        let bytes = (size * ITERS * 2).to_string();
        for (who, out) in [("server", &sout), ("client", &cout)] {
            assert_line(out, who, &format!("{bytes} bytes in "));
            assert_line(out, who, &format!("{ITERS} iters in "));
            assert!(
                !out.contains("invalid data"),
                "{who}: data check failed:\n{out}"
            );
        }
        eprintln!("rc_pingpong -s {size} -n {ITERS}: ok in {took:?}");
    }
}
