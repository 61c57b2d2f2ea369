//! A seeded random-lifecycle test of the safe data path: 2–3 RC QPs on 1–2
//! shared CQs, connected in loopback on the one device (QPs 0 and 1 to each
//! other, QP 2 to itself), driven through random sequences of posts, polls,
//! transitions and drops against a model that predicts every completion,
//! every returned buffer and the kernel's resource counts.
//!
//! `RDMA_VERBS_LIFECYCLE_SEED` (default: the clock) and
//! `RDMA_VERBS_LIFECYCLE_STEPS` (default 10,000) select the run; the seed is
//! printed at the start (on stderr, past the harness's capture, so that a run
//! killed from outside still names it) and in every failure. See
//! docs/lifecycle.md.

mod common;

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{all_remote, ctx, gid_index, res_counts};
use rdma_verbs::context::Context;
use rdma_verbs::cq::{Completion, CompletionSource, Cq, WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr, SharedMr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{
    Buffer, Init, InitAttr, PostError, Qp, QpCaps, Rc, RecvWr, Reset, RtrAttr, Rts, RtsAttr,
    SendWr, Sges,
};
use rdma_verbs::{Error, ffi};

static SERIAL: Mutex<()> = Mutex::new(());
static SEED: AtomicU64 = AtomicU64::new(0);
static STEP: AtomicU64 = AtomicU64::new(0);

const INJECTED: &str = "lifecycle: injected iterator panic";
const STEPS_ENV: &str = "RDMA_VERBS_LIFECYCLE_STEPS";
const SEED_ENV: &str = "RDMA_VERBS_LIFECYCLE_SEED";
const HDR: usize = 32;
const RECV_LEN: usize = 4096;
const TEMPLATE_LEN: usize = 4096;
const MAGIC: u32 = 0x11fe_c7c1;
/// Bound on every wait for completions that the model says must come.
const WAIT: Duration = Duration::from_secs(15);

macro_rules! fail {
    ($($t:tt)*) => {
        panic!(
            "lifecycle seed={} step={}: {} (rerun with {}={})",
            SEED.load(Ordering::Relaxed),
            STEP.load(Ordering::Relaxed),
            format!($($t)*),
            SEED_ENV,
            SEED.load(Ordering::Relaxed),
        )
    };
}

static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `RDMA_VERBS_LIFECYCLE_TRACE=1`: one line per action, for reading a failing seed.
macro_rules! trace {
    ($($t:tt)*) => {
        if TRACE.load(Ordering::Relaxed) {
            eprintln!("[{}] {}", STEP.load(Ordering::Relaxed), format!($($t)*));
        }
    };
}

macro_rules! check {
    ($c:expr, $($t:tt)*) => {
        if !$c {
            fail!($($t)*);
        }
    };
}

mod lifecycle;

use lifecycle::run;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Panics the test injects are expected; anything else is reported with the seed.
fn quiet_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied());
        if msg == Some(INJECTED) {
            return;
        }
        eprintln!(
            "lifecycle: panic at seed={} step={}",
            SEED.load(Ordering::Relaxed),
            STEP.load(Ordering::Relaxed)
        );
        default(info);
    }));
}

#[test]
fn random_lifecycle() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let seed = env_u64(SEED_ENV).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    let steps = env_u64(STEPS_ENV).unwrap_or(10_000);
    SEED.store(seed, Ordering::Relaxed);
    quiet_injected_panics();
    TRACE.store(
        env_u64("RDMA_VERBS_LIFECYCLE_TRACE").is_some_and(|v| v != 0),
        Ordering::Relaxed,
    );
    // Straight to stderr: the harness captures `eprintln!`, and a binary killed
    // from outside (a runner's time limit) never shows what it captured.
    let _ = writeln!(
        std::io::stderr().lock(),
        "lifecycle: starting seed={seed} steps={steps} ({SEED_ENV}={seed})"
    );
    // Watchdog: nothing may block; a wedged run fails with its seed and step. Its
    // default (60 s for 10,000 steps; walks take 2-9 s) fires before the 120 s
    // that `cargo xtask providers` gives the whole binary.
    let limit =
        Duration::from_secs(env_u64("RDMA_VERBS_LIFECYCLE_WATCHDOG_S").unwrap_or(30 + steps / 333));
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
            let _ = writeln!(
                std::io::stderr().lock(),
                "lifecycle: watchdog: seed={} stuck at step {} after {limit:?}",
                SEED.load(Ordering::Relaxed),
                STEP.load(Ordering::Relaxed)
            );
            std::process::exit(3);
        }
    });
    run(seed, steps);
    let _ = done.send(());
}

/// The memcheck run: this binary's `random_lifecycle` again, under valgrind,
/// with fewer steps (`RDMA_VERBS_LIFECYCLE_VALGRIND_STEPS`, default 1,000;
/// about 30 s in the soft-RoCE guest, 22 s of it memcheck's start-up). Any memcheck error, definite leak or
/// test failure fails it; the seed is printed by the child. The child's output
/// passes through this test's, and a walk the device cannot run (an
/// `Error::Unsupported` of the child's) is named in this test's failure too.
#[test]
fn random_lifecycle_under_valgrind() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let steps = env_u64("RDMA_VERBS_LIFECYCLE_VALGRIND_STEPS").unwrap_or(1_000);
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = std::process::Command::new("valgrind");
    cmd.args([
        // No gdbserver pipes: valgrind cannot create them on every file
        // system the guest has (e.g. a checkout under the host's /tmp).
        "--vgdb=no",
        // Memcheck reads inlined frames by default, which costs seconds for a
        // test binary under emulation; reports keep the outer frames' lines.
        "--read-inline-info=no",
        "--error-exitcode=99",
        "--leak-check=full",
        "--errors-for-leak-kinds=definite,indirect",
        "--show-leak-kinds=definite,indirect",
    ]);
    cmd.arg(&exe)
        .args([
            "random_lifecycle",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STEPS_ENV, steps.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => panic!("cannot run valgrind ({e}); `cargo xtask setup` installs it"),
    };
    let echoes = [
        echo_lines(child.stdout.take().expect("piped stdout"), false),
        echo_lines(child.stderr.take().expect("piped stderr"), true),
    ];
    let end = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for valgrind") {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("valgrind run of {steps} steps did not finish in 600 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let unsupported = echoes
        .into_iter()
        .filter_map(|e| e.join().expect("echo thread"))
        .next();
    if let (false, Some(line)) = (status.success(), unsupported) {
        panic!(
            "valgrind run of random_lifecycle ({steps} steps): the walk needs what the device lacks: {line}"
        );
    }
    assert!(
        status.success(),
        "valgrind run of random_lifecycle ({steps} steps) failed: {status} (99: memcheck errors; see the seed above)"
    );
}

/// Copies `from`'s lines to this test's stdout (stderr if `err`), where the
/// harness keeps them with the test's output; returns the first line that names
/// an unsupported feature (the crate's `Error::Unsupported`).
fn echo_lines(
    from: impl std::io::Read + Send + 'static,
    err: bool,
) -> std::thread::JoinHandle<Option<String>> {
    use std::io::BufRead;
    std::thread::spawn(move || {
        let mut unsupported = None;
        for line in std::io::BufReader::new(from).lines().map_while(Result::ok) {
            if err {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
            let names_unsupported =
                line.contains(" is not supported: ") || line.contains("Unsupported { verb: ");
            if unsupported.is_none() && names_unsupported {
                unsupported = Some(line);
            }
        }
        unsupported
    })
}

/// `wrs` as an iterator that panics (with [`INJECTED`]) when asked for item `p`.
fn panicking_at<W>(wrs: Vec<W>, p: u64) -> impl Iterator<Item = W> {
    let mut k = 0;
    let mut it = wrs.into_iter();
    std::iter::from_fn(move || {
        if k == p {
            panic!("{INJECTED}");
        }
        k += 1;
        it.next()
    })
}

// --- Library issues the random walk found, as minimal regression tests. ---

fn small_caps(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        ..QpCaps::default()
    }
}

/// Drains whatever `cq` delivers within `window`.
fn drain_for(cq: &mut Cq, window: Duration) -> Vec<Completion> {
    let mut out = Vec::with_capacity(64);
    let end = Instant::now() + window;
    while Instant::now() < end {
        if cq.poll(&mut out).expect("poll") == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    out
}

/// An unsignaled send that completed successfully produces no completion,
/// not even after `to_error`; it used to stay in the ring so that `reset` was
/// refused forever. `to_error` now posts a drain marker whose (invisible)
/// completion retires it: ERR, poll, RESET works.
#[test]
fn reset_after_a_completed_unsignaled_send() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut p = common::pair_with(small_caps(4, 4), |_, _, b| {
        b.post_recv(RecvWr::empty(0)).unwrap();
    });
    p.a.post_send(SendWr::send(1).signaled(false)).unwrap();
    // The receiver got it: the send is complete on the wire.
    assert_eq!(common::wait(&mut p.cq_b, 1)[0].status, WcStatus::Success);
    let a = p.a.to_error().unwrap();
    assert_eq!(a.outstanding(), (2, 0), "the send and the drain marker");
    let flushed = drain_for(&mut p.cq_a, Duration::from_millis(300));
    assert!(
        flushed.is_empty(),
        "the marker is not handed out: {flushed:?}"
    );
    assert_eq!(a.outstanding(), (0, 0));
    match a.reset() {
        Ok(_) => {}
        Err(e) => panic!(
            "reset of an ERR QP with nothing left to complete: {}",
            e.error
        ),
    }
}

/// A list post that runs out of queue room posts the requests that fit and
/// hands back the refused one without pulling the caller's iterator again:
/// a panicking (or endless) iterator beyond that point is never reached.
#[test]
fn a_list_post_refused_for_room_stops_pulling_the_iterator() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut p = common::pair_with(small_caps(2, 8), |_, _, b| {
        b.post_recv_list((0..8).map(RecvWr::empty)).unwrap();
    });
    let mut k = 0;
    let r = p.a.post_send_list(std::iter::from_fn(|| {
        k += 1;
        if k == 4 {
            panic!("pulled after the refusal");
        }
        Some(SendWr::send(k))
    }));
    match r {
        Err(e) => {
            assert!(matches!(e.error, Error::QueueFull { depth: 2, .. }), "{e}");
            let ids: Vec<u64> = e.unposted.iter().map(|(id, _)| *id).collect();
            assert_eq!(ids, [3], "only the refused request comes back");
        }
        Ok(()) => panic!("a depth-2 queue took three requests"),
    }
    assert_eq!(k, 3, "the iterator was not pulled after the refusal");
    let done: Vec<u64> = common::wait(&mut p.cq_a, 2)
        .iter()
        .map(|c| c.wr_id)
        .collect();
    assert_eq!(done, [1, 2], "the two that fit were posted");
}
