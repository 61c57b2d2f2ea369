//! Shared helpers for the device tests (`tests/vm_*.rs`) and the benches, which run inside the
//! soft-RoCE guest (`cargo xtask test`) or on a host with an RDMA device.
//! Without a device they fail with the library's error: they never skip.
#![allow(dead_code)]

#[cfg(feature = "tokio")]
pub mod async_pair;
pub mod procs;

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use rdma_verbs::Result;
use rdma_verbs::context::Context;
use rdma_verbs::cq::{Completion, Cq, WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::scope::{Scope, ScopedCompletion};
use rdma_verbs::qp::{Init, InitAttr, Qp, QpCaps, Rc, Rts, SendApi};

/// How long a test waits for completions before failing.
pub const WAIT: Duration = Duration::from_secs(20);

/// The device named by RDMA_VERBS_DEVICE (set by `cargo xtask run`), else the first one.
pub fn ctx() -> Context {
    let name = std::env::var("RDMA_VERBS_DEVICE").ok();
    match Context::open(name.as_deref()) {
        Ok(c) => c,
        Err(e) => panic!("this test needs an RDMA device (run it with `cargo xtask test`): {e}"),
    }
}

/// The running kernel's (major, minor) version, from `/proc/sys/kernel/osrelease`.
pub fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap(), parts.next().unwrap_or(0))
}

/// Whether `ctx`'s device speaks iWARP (siw): RC through rdma_cm only, completions of a
/// READ after those of requests posted behind it, and the other deviations
/// docs/providers.md lists.
pub fn iwarp(ctx: &Context) -> bool {
    use rdma_verbs::device::{self, Transport};
    let list = device::devices().expect("device list");
    let dev = list.find(Some(ctx.name())).expect("the device is listed");
    dev.transport() == Transport::Iwarp
}

/// Fails with the crate's refusal of a QP connected by hand (an exchanged `Endpoint`,
/// INIT -> RTR -> RTS) when `ctx`'s device is iWARP, whose QPs connect through rdma_cm
/// only; returns on other devices. Tests that pair QPs that way, or run programs that do,
/// call it first: on siw they end in `Error::Unsupported`, which `cargo xtask providers`
/// reports as `unsupported`, rather than in a C tool's failure or a peer's timeout.
pub fn require_hand_connection(ctx: &Context) {
    if let Some(e) = hand_connection_refusal(ctx) {
        panic!("{e}");
    }
}

/// On iWARP, the crate's `Error::Unsupported` for a QP connected by hand (see
/// [`require_hand_connection`]); `None` elsewhere. Panics when iWARP gets anything else.
pub fn hand_connection_refusal(ctx: &Context) -> Option<rdma_verbs::Error> {
    use rdma_verbs::Error;
    if !iwarp(ctx) {
        return None;
    }
    let gid = gid_index(ctx);
    let pd = Pd::new(ctx).expect("pd");
    let cq = Cq::new(ctx, 16).expect("cq");
    let mk = || {
        Qp::new(&pd, &cq, &cq, caps_sr(4, 4))
            .expect("qp")
            .init(InitAttr::new(1, all_remote()))
            .expect("INIT")
    };
    let (a, b) = (mk(), mk());
    let eb = b.endpoint(Some(gid)).expect("endpoint");
    match a.connect(&eb, Some(gid)) {
        Err(e @ Error::Unsupported { .. }) => Some(e),
        other => panic!("a hand-connected QP on iWARP: expected Unsupported, got {other:?}"),
    }
}

/// Reports that the test saw the provider deviate from what docs/soundness.md assumes (or
/// from rxe's behaviour the test asserts elsewhere) in a way the crate stays sound under:
/// the test asserts that behaviour exactly, and `cargo xtask providers` (which runs the
/// binaries with `--show-output`) turns a pass with this line into `deviation`.
pub fn deviation(what: &str) {
    println!("DEVIATION: {what}");
}

/// Index of the RoCE v2 IPv4-mapped GID on port 1 (what `-g`/`-x` usually
/// select on soft-RoCE), or 0 when there is none.
pub fn gid_index(ctx: &Context) -> u8 {
    ctx.default_gid_index(1).expect("gid table").unwrap_or(0)
}

/// Remote rights the test QPs grant.
pub fn all_remote() -> AccessFlags {
    AccessFlags::LOCAL_WRITE
        | AccessFlags::REMOTE_WRITE
        | AccessFlags::REMOTE_READ
        | AccessFlags::REMOTE_ATOMIC
}

/// Default capabilities with `send` / `recv` requests per queue.
pub fn caps_sr(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        ..QpCaps::default()
    }
}

/// Polls the scope until `n` completions came (fails after [`WAIT`]).
pub fn scope_poll_n(s: &Scope<'_, '_>, n: usize) -> Result<Vec<ScopedCompletion>> {
    let mut out = Vec::new();
    s.poll_n(&mut out, n, WAIT)?;
    Ok(out)
}

/// Two RC QPs on one device connected to each other (soft-RoCE loops back).
pub struct Pair {
    pub ctx: Context,
    pub pd: Pd,
    pub cq_a: Cq,
    pub cq_b: Cq,
    pub a: Qp<Rc, Rts>,
    pub b: Qp<Rc, Rts>,
}

/// Creates QPs `a` and `b` in INIT, lets `prep` post receives, then connects them.
pub fn pair_with(
    caps: QpCaps,
    prep: impl FnOnce(&Pd, &mut Qp<Rc, Init>, &mut Qp<Rc, Init>),
) -> Pair {
    pair_sized(caps, (caps.max_send_wr + caps.max_recv_wr) * 2, prep)
}

/// [`pair_with`] with `cq_depth` completions per CQ.
pub fn pair_sized(
    caps: QpCaps,
    cq_depth: u32,
    prep: impl FnOnce(&Pd, &mut Qp<Rc, Init>, &mut Qp<Rc, Init>),
) -> Pair {
    pair_on(caps, cq_depth, None, all_remote(), prep)
}

/// A connected pair whose QPs both post with `api`.
pub fn pair_api(caps: QpCaps, api: SendApi) -> Pair {
    let depth = (caps.max_send_wr + caps.max_recv_wr) * 2;
    pair_on(caps, depth, Some(api), all_remote(), |_, _, _| {})
}

/// [`pair_api`] with the QPs' remote `access` (`InitAttr`'s) given.
pub fn pair_api_access(caps: QpCaps, api: SendApi, access: AccessFlags) -> Pair {
    let depth = (caps.max_send_wr + caps.max_recv_wr) * 2;
    pair_on(caps, depth, Some(api), access, |_, _, _| {})
}

/// [`pair_sized`] with the send API given (`None`: `Qp::new`'s choice).
fn pair_on(
    caps: QpCaps,
    cq_depth: u32,
    api: Option<SendApi>,
    access: AccessFlags,
    prep: impl FnOnce(&Pd, &mut Qp<Rc, Init>, &mut Qp<Rc, Init>),
) -> Pair {
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq_a = Cq::new(&ctx, cq_depth).expect("cq a");
    let cq_b = Cq::new(&ctx, cq_depth).expect("cq b");
    let gid = gid_index(&ctx);
    let mk = |cq: &Cq| {
        match api {
            None => Qp::new(&pd, cq, cq, caps),
            Some(api) => Qp::new_with_send_api(&pd, cq, cq, caps, api),
        }
        .expect("create qp")
        .init(InitAttr::new(1, access))
        .expect("init")
    };
    let mut a = mk(&cq_a);
    let mut b = mk(&cq_b);
    prep(&pd, &mut a, &mut b);
    let ea = a.endpoint(Some(gid)).expect("endpoint a");
    let eb = b.endpoint(Some(gid)).expect("endpoint b");
    let a = a.connect(&eb, Some(gid)).expect("connect a");
    let b = b.connect(&ea, Some(gid)).expect("connect b");
    Pair {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

/// A connected pair with nothing posted.
pub fn pair(caps: QpCaps) -> Pair {
    pair_with(caps, |_, _, _| {})
}

/// Polls `cq` until `n` completions arrived (fails the test after [`WAIT`]).
pub fn wait(cq: &mut Cq, n: usize) -> Vec<Completion> {
    let mut out = Vec::with_capacity(n);
    cq.poll_n(&mut out, n, WAIT).expect("completions");
    out
}

/// A deterministic byte pattern for `len` bytes, varied by `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u8)
                .wrapping_mul(31)
                .wrapping_add(seed)
                .wrapping_add((i >> 8) as u8)
        })
        .collect()
}

/// `pd`, `cq`, `qp`, `mr`, `ctx` counts of the device, from `rdma resource show`.
pub fn res_counts(dev: &str) -> std::collections::HashMap<String, u64> {
    let out = std::process::Command::new("rdma")
        .args(["resource", "show"])
        .output()
        .expect("run rdma");
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains(&format!("{dev}:")))
        .unwrap_or_else(|| panic!("{dev} not in {text}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .windows(2)
        .filter_map(|w| Some((w[0].to_owned(), w[1].parse().ok()?)))
        .collect()
}

/// Whether `r` polls readable within `timeout` (`libc::poll`, as an event loop would).
pub fn readable(r: &rdma_verbs::channel::Readiness, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(r),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
    assert!(rc >= 0, "poll: {}", std::io::Error::last_os_error());
    rc == 1 && pfd.revents & libc::POLLIN != 0
}

/// Tests that count kernel objects (`rdma resource show`) run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Holds this test binary's lock of tests that count kernel objects (a test that panicked
/// while holding it leaves it usable).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A registered receive buffer of `len` bytes, zeroed.
pub fn buffer(pd: &Pd, len: usize) -> Mr {
    let mut mr = Mr::new(pd, len, AccessFlags::LOCAL_WRITE).expect("mr");
    mr.fill(0).expect("fill");
    mr
}

/// Posts a signaled SEND of `data` from a buffer of its own, which the ring
/// keeps until the SEND completes.
pub fn send_bytes(pd: &Pd, qp: &mut Qp<Rc, Rts>, wr_id: u64, data: &[u8]) {
    let mut mr = pd
        .alloc_mr(data.len(), AccessFlags::empty())
        .expect("send mr");
    mr.as_mut_slice().expect("slice").copy_from_slice(data);
    qp.post_send(rdma_verbs::qp::SendWr::send(wr_id).sge(mr))
        .expect("post send");
}

/// A scoped completion's wr_id, status, opcode and byte length, to compare in one assert.
pub fn summary(c: &ScopedCompletion) -> (u64, WcStatus, WcOpcode, u32) {
    (c.wr_id, c.status, c.opcode, c.byte_len)
}

/// The guest's RDMA address (`cargo xtask run` sets `RDMA_VERBS_ADDR`; 10.99.0.1 otherwise).
pub fn guest_ip() -> std::net::IpAddr {
    std::env::var("RDMA_VERBS_ADDR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::new(10, 99, 0, 1)))
}

/// The guest's RDMA address on `port` (a port per test, so a binary's tests can run in
/// parallel).
pub fn guest_at(port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::new(guest_ip(), port)
}

/// Host memory whose `Drop` panics (unless a panic is already unwinding): an
/// application's `OwnedMemory` that keeps the trait's contract (the bytes live
/// on the heap, reached only through it), for the tests of panics in polls.
pub struct PanicsInDrop(pub Vec<u8>);

// SAFETY: the Vec's heap buffer does not move and is reached only through it.
unsafe impl rdma_verbs::mr::OwnedMemory for PanicsInDrop {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.0.as_mut_ptr(), self.0.len())
    }
}

impl Drop for PanicsInDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("an application's memory panics in Drop");
        }
    }
}
