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

use common::procs::{Proc, example, finish};

use std::sync::Mutex;
use std::time::{Duration, Instant};

const ITERS: usize = 1000;
const SIZES: [usize; 2] = [4096, 1];
/// Per side, from the server's start.
const LIMIT: Duration = Duration::from_secs(60);

static SERIAL: Mutex<()> = Mutex::new(());

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
    let server = Proc::server(name, &bin, server_args, port, deadline);
    let client = Proc::spawn(name, &bin, client_args, &format!("{port}-client"));
    let (sout, cout) = finish(server, client, deadline);
    (sout, cout, t.elapsed())
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

/// The crate docs' two-process program (`examples/hello_rc.rs`, shown there
/// as is) does what the docs say.
#[test]
fn hello_rc() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    common::require_hand_connection(&common::ctx());
    let port = rdma_verbs::exchange::DEFAULT_PORT;
    let (sout, cout, took) = run_pair(
        "hello_rc",
        port,
        &strings(&["server"]),
        &strings(&["client", &addr()]),
    );
    assert_line(&sout, "server", "got \"ping\"");
    assert_line(&cout, "client", "reply: \"hello\"");
    eprintln!("hello_rc: ok in {took:?}");
}

/// `perf send_bw -D 4`: the server, which only receives, prints a row of its
/// own, as perftest's does: the receives of its sampling phase (perftest's
/// margin is `-D / 4` whole seconds, so 4 - 2 x 1 = 2 s) over that phase.
#[test]
fn perf_send_bw_server_reports_its_sampling_window_in_duration_mode() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    common::require_hand_connection(&common::ctx());
    let port = 19560u16;
    let p = port.to_string();
    let args = [
        "send_bw", "--raw", "-x", "1", "-s", "2", "-D", "4", "-p", &p,
    ];
    let server = strings(&args);
    let mut client = server.clone();
    client.push(addr());
    let (sout, _cout, took) = run_pair("perf", port, &server, &client);
    // ` #bytes #iterations BW-peak BW-average MsgRate`
    let row: Vec<f64> = sout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|w| w.len() == 5 && w[0] == "2")
        .unwrap_or_else(|| panic!("server: no result row for 2 bytes:\n{sout}"))
        .iter()
        .map(|w| w.parse().expect("a number"))
        .collect();
    let (iters, mpps) = (row[1], row[4]);
    assert!(iters > 0.0 && mpps > 0.0, "server row {row:?}:\n{sout}");
    let window = iters / (mpps * 1e6);
    assert!(
        (1.8..2.3).contains(&window),
        "server row {row:?} spans {window:.2} s, not the 2 s sampling phase:\n{sout}"
    );
    eprintln!("perf send_bw -D 4: server row {row:?} ({window:.2} s), ok in {took:?}");
}

/// Bad arguments end in an error that names the problem, at once: never a
/// panic, an abort or exit 0.
#[test]
fn bad_arguments_end_in_errors_not_panics() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let a = addr();
    let cases: [(&str, Vec<&str>, &str); 8] = [
        ("devinfo", vec!["-i", "5"], "has port(s)"),
        // The error's Display form (not the Debug form `main` returning a
        // `Result` prints).
        ("hello_rc", vec!["serve"], "hello_rc: unknown role `serve`"),
        ("rc_pingpong", vec!["-r", "4294967295"], "-r is too large"),
        (
            "uc_pingpong",
            vec!["-r", "100000000", "-s", "1"],
            "Couldn't create CQ",
        ),
        (
            "async_echo",
            vec!["--client", &a, "--msgs", "0"],
            "--msgs 0 is out of range",
        ),
        (
            "perf",
            vec!["write_bw", "-D", "18446744073709551615"],
            "-D must be at most",
        ),
        (
            "file_read",
            vec!["--server", "/nonexistent/file"],
            "file_read: error: /nonexistent/file: No such file or directory",
        ),
        (
            "file_read",
            vec!["--client", &a, "--out", "/nonexistent/dir/copy"],
            "file_read: error: /nonexistent/dir/copy: No such file or directory",
        ),
    ];
    for (i, (name, args, says)) in cases.iter().enumerate() {
        let mut p = Proc::spawn(name, &example(name), &strings(args), &format!("bad-{i}"));
        let status = p.wait_until(Instant::now() + Duration::from_secs(20));
        let out = p.output();
        let status = status.unwrap_or_else(|| panic!("{name} {args:?} did not exit:\n{out}"));
        assert!(!status.success(), "{name} {args:?} exited 0:\n{out}");
        assert!(
            !out.contains("panicked"),
            "{name} {args:?} panicked:\n{out}"
        );
        assert!(
            out.contains(says),
            "{name} {args:?} does not say `{says}`:\n{out}"
        );
    }
}

/// FNV-1a 64, as `file_read` prints it.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A file in the guest's tmpfs, removed on drop.
struct TempFile(std::path::PathBuf);

impl TempFile {
    fn path(name: &str) -> TempFile {
        let name = format!("vm_examples-{name}-{}", std::process::id());
        TempFile(std::env::temp_dir().join(name))
    }

    fn arg(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Sets `/proc/sys/vm/nr_hugepages` (the guest runs the tests as root) and
/// restores it when dropped.
struct HugePages(String);

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

impl HugePages {
    fn set(n: u64) -> HugePages {
        let old = std::fs::read_to_string(NR_HUGEPAGES).expect("this kernel has hugetlbfs");
        std::fs::write(NR_HUGEPAGES, n.to_string()).unwrap();
        let free = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";
        let free: u64 = std::fs::read_to_string(free)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(free, n, "the guest could not reserve {n} huge pages");
        HugePages(old)
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, self.0.trim());
    }
}

/// `file_read` copies a 16 MiB file: into ordinary pages in 1 MiB READs, then
/// into huge pages in READs of 1,000,000 bytes (the last one shorter); both
/// sides print the file's checksum and the copy is the file, byte for byte.
/// Over the memlock limit the server fails naming the limit; with no huge
/// pages reserved, `--hugepages` fails on both sides, the client saying how
/// to reserve them.
#[test]
fn file_read_copies_a_16_mib_file_with_and_without_huge_pages() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    const LEN: usize = 16 << 20;
    let src = TempFile::path("file_read-src");
    let data = random_bytes(LEN);
    std::fs::write(&src.0, &data).unwrap();
    let want = format!("fnv1a64 {:016x}", fnv1a(&data));
    let runs: [(&[&str], &str, u64); 2] = [
        (&[], "16 READs of up to 1048576 bytes", 0),
        (
            &["--hugepages", "--chunk", "1000000"],
            "17 READs of up to 1000000 bytes",
            8,
        ),
    ];
    for (k, (extra, reads, huge)) in runs.into_iter().enumerate() {
        let _h = (huge > 0).then(|| HugePages::set(huge));
        let out = TempFile::path(&format!("file_read-out{k}"));
        let port = (19570 + k as u16).to_string();
        let server = strings(&["--server", &src.arg(), "--port", &port]);
        let (host, out_arg) = (addr(), out.arg());
        let client = [
            &["--client", &host, "--port", &port, "--out", &out_arg][..],
            extra,
        ];
        let (sout, cout, took) = run_pair(
            "file_read",
            19570 + k as u16,
            &server,
            &strings(&client.concat()),
        );
        assert_line(
            &sout,
            "server",
            &format!("server: serving {} ({LEN} bytes, {want})", src.arg()),
        );
        assert_line(
            &sout,
            "server",
            &format!("server: client done; {LEN} bytes served"),
        );
        assert_line(
            &cout,
            "client",
            &format!("client: read {LEN} bytes in {reads}"),
        );
        assert!(cout.contains(&want), "client: no `{want}`:\n{cout}");
        assert_eq!(cout.contains("into 2 MiB huge pages"), huge > 0, "{cout}");
        assert!(
            std::fs::read(&out.0).unwrap() == data,
            "the copy differs from the file"
        );
        eprintln!("file_read {extra:?}: ok in {took:?}");
    }
    memlock_refusal(&src);
    huge_page_refusal(&src);
}

/// With no huge pages reserved, `--hugepages` fails on both sides: the
/// client's error says how to reserve them, and the server sees it go.
fn huge_page_refusal(src: &TempFile) {
    let _h = HugePages::set(0);
    let out = TempFile::path("file_read-out-refused");
    let port = 19572u16;
    let p = port.to_string();
    let bin = example("file_read");
    let deadline = Instant::now() + LIMIT;
    let mut server = Proc::server(
        "file_read",
        &bin,
        &strings(&["--server", &src.arg(), "--port", &p]),
        port,
        deadline,
    );
    let args = strings(&[
        "--client",
        &addr(),
        "--port",
        &p,
        "--out",
        &out.arg(),
        "--hugepages",
    ]);
    let mut client = Proc::spawn("file_read", &bin, &args, "refused-client");
    let (cst, sst) = (client.wait_until(deadline), server.wait_until(deadline));
    let (cout, sout) = (client.output(), server.output());
    assert!(
        cst.is_some_and(|s| s.code() == Some(1)),
        "client: {cst:?}\n{cout}"
    );
    assert!(
        sst.is_some_and(|s| s.code() == Some(1)),
        "server: {sst:?}\n{sout}"
    );
    assert!(
        cout.contains("/nr_hugepages"),
        "client: no way to reserve them:\n{cout}"
    );
    assert!(sout.contains("file_read: error: "), "server:\n{sout}");
}

/// Run as nobody under an 8 MiB RLIMIT_MEMLOCK (root is never limited), the
/// server cannot register the 16 MiB file and says so, naming the limit.
fn memlock_refusal(src: &TempFile) {
    let bin = example("file_read");
    let args = [
        "--memlock=8388608:8388608",
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ];
    let args: Vec<String> = strings(&args)
        .into_iter()
        .chain([bin.display().to_string()])
        .chain(strings(&["--server", &src.arg(), "--port", "19573"]))
        .collect();
    let mut p = Proc::spawn(
        "prlimit",
        std::path::Path::new("/usr/bin/prlimit"),
        &args,
        "memlock",
    );
    let status = p.wait_until(Instant::now() + LIMIT);
    let out = p.output();
    assert!(
        status.is_some_and(|s| s.code() == Some(1)),
        "{status:?}\n{out}"
    );
    assert!(out.contains("file_read: error: "), "{out}");
    assert!(
        out.contains("8388608 bytes") && out.contains("ulimit -l"),
        "{out}"
    );
}

/// Pseudo-random bytes (xorshift64), so that a misplaced chunk changes the checksum.
fn random_bytes(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// `mw_grant`: the client READs and WRITEs through the granted window, the
/// server sees the WRITE and revokes the window, and the client's next READ
/// fails with REM_ACCESS_ERR.
#[test]
fn mw_grant_grants_then_revokes_a_window() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let port = 19580u16;
    let p = port.to_string();
    let (sout, cout, took) = run_pair(
        "mw_grant",
        port,
        &strings(&["--server", "--port", &p]),
        &strings(&["--client", &addr(), "--port", &p]),
    );
    assert_line(
        &sout,
        "server",
        "server: the client's 256-byte WRITE through the window arrived",
    );
    assert_line(
        &sout,
        "server",
        "server: window revoked (LOCAL_INV completed)",
    );
    assert_line(&sout, "server", "server: every step behaved as stated");
    assert_line(
        &cout,
        "client",
        "client: READ 4096 bytes through the window, verified",
    );
    assert_line(
        &cout,
        "client",
        "client: READ through the revoked window failed with IBV_WC_REM_ACCESS_ERR (WcStatus::RemAccessErr)",
    );
    assert_line(&cout, "client", "client: every step behaved as stated");
    eprintln!("mw_grant: ok in {took:?}");
}
