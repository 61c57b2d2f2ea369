//! `examples/rping.rs` against rdma-core's C `rping` (rdmacm-utils), in both
//! roles, with data validation, and against itself. Runs in the guest
//! (`cargo xtask test`, which builds the examples first); without an RDMA
//! device, the C rping, or our example binary, every test fails with a
//! message saying which is missing.

mod common;

use std::io::Read;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Everything a test may take, connection retries included (TCG is slow).
const LIMIT: Duration = Duration::from_secs(90);
/// rping's arguments common to both sides.
const PING_ARGS: [&str; 5] = ["-C", "5", "-S", "64", "-V"];

fn ip() -> String {
    std::env::var("RDMA_VERBS_ADDR")
        .ok()
        .and_then(|s| s.parse::<IpAddr>().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::new(10, 99, 0, 1)))
        .to_string()
}

/// Our example: `<target>/<profile>/examples/rping`, next to this test's `deps/`.
fn ours() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let p = exe
        .parent()
        .and_then(|d| d.parent())
        .map(|d| d.join("examples").join("rping"))
        .expect("test binary lives in <target>/<profile>/deps");
    assert!(
        p.is_file(),
        "{} is not built: run `cargo build --examples` (or `cargo xtask test`, which does) first",
        p.display()
    );
    p
}

/// rdma-core's rping from PATH.
fn theirs() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("rping"))
        .find(|p| p.is_file())
        .expect("the C rping is not installed: `apt-get install rdmacm-utils`")
}

/// A child process that is killed if the test ends early.
struct Proc {
    name: &'static str,
    child: Option<Child>,
}

impl Proc {
    fn spawn(name: &'static str, prog: &PathBuf, args: &[String]) -> Proc {
        let child = Command::new(prog)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{name}: cannot start {}: {e}", prog.display()));
        Proc {
            name,
            child: Some(child),
        }
    }

    fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Waits until `deadline` (then kills it); returns the status and output.
    fn finish(mut self, deadline: Instant) -> (Option<ExitStatus>, String) {
        let mut child = self.child.take().expect("child");
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(50)),
                _ => {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
            }
        };
        let mut out = String::new();
        if let Some(mut s) = child.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        if let Some(mut s) = child.stderr.take() {
            let _ = s.read_to_string(&mut out);
        }
        (status, format!("--- {} ---\n{out}", self.name))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(c) = self.child.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `server` (`-s`) and then `client` (`-c`, retried while the server
/// is still getting ready) on `port`; both must exit 0, and the client's
/// `-v` output must show all five pings.
fn interop(server: (&'static str, PathBuf), client: (&'static str, PathBuf), port: u16) {
    let start = Instant::now();
    let deadline = start + LIMIT;
    let ip = ip();
    let common: Vec<String> = ["-a", &ip, "-p", &port.to_string(), "-v"]
        .iter()
        .chain(PING_ARGS.iter())
        .map(|s| s.to_string())
        .collect();
    let mut sargs = vec!["-s".to_string()];
    sargs.extend(common.iter().cloned());
    let mut cargs = vec!["-c".to_string()];
    cargs.extend(common.iter().cloned());

    let mut srv = Proc::spawn(server.0, &server.1, &sargs);
    let mut attempts = Vec::new();
    let (cstatus, cout) = loop {
        thread::sleep(Duration::from_millis(300));
        let cl = Proc::spawn(client.0, &client.1, &cargs);
        let (st, out) = cl.finish(deadline);
        let ok = st.is_some_and(|s| s.success());
        // Refused because the server is not listening yet: try again.
        if !ok && srv.running() && Instant::now() < deadline && attempts.len() < 20 {
            attempts.push(out);
            continue;
        }
        break (st, out);
    };
    let (sstatus, sout) = srv.finish(deadline);
    let report = format!(
        "{} server + {} client on port {port} ({} refused attempts first):\n{cout}\n{sout}\nearlier attempts:\n{}",
        server.0,
        client.0,
        attempts.len(),
        attempts.join("\n")
    );
    assert!(
        cstatus.is_some_and(|s| s.success()),
        "client failed: {cstatus:?}\n{report}"
    );
    assert!(
        sstatus.is_some_and(|s| s.success()),
        "server failed: {sstatus:?}\n{report}"
    );
    for n in 0..5 {
        assert!(
            cout.contains(&format!("ping data: rdma-ping-{n}: ")),
            "ping {n} missing from the client's output\n{report}"
        );
    }
    assert!(!cout.contains("rdma-ping-5"), "{report}");
    assert!(sout.contains("server ping data: rdma-ping-4: "), "{report}");
    eprintln!(
        "{} server + {} client: ok in {:?} ({} retries)",
        server.0,
        client.0,
        start.elapsed(),
        attempts.len()
    );
}

#[test]
fn our_server_with_c_client() {
    interop(("ours", ours()), ("C rping", theirs()), 20201);
}

#[test]
fn c_server_with_our_client() {
    interop(("C rping", theirs()), ("ours", ours()), 20202);
}

#[test]
fn ours_with_ours() {
    interop(("ours", ours()), ("ours", ours()), 20203);
}

#[test]
fn our_client_without_server_fails_fast() {
    let start = Instant::now();
    let ip = ip();
    let out = Command::new(ours())
        .args(["-c", "-a", &ip, "-p", "20204", "-C", "1", "-W", "20"])
        .output()
        .expect("run rping");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "nobody listens on 20204: {text}");
    // rxe reports a REJECTED event; on iWARP (siw) rdma_connect itself is refused.
    if common::iwarp(&common::ctx()) {
        assert!(
            text.contains("rdma_connect failed: Connection refused"),
            "{text}"
        );
        common::deviation("rdma_connect to a dead port fails with ECONNREFUSED, no event");
    } else {
        assert!(text.contains("REJECTED"), "{text}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}
