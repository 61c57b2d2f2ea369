//! Completion channels, the hybrid poll/sleep loop and async events, on a real
//! device (run inside the soft-RoCE guest by `cargo xtask test`).
//!
//! What soft-RoCE (rdma_rxe, Debian kernel 6.1) reports as async events, as
//! measured in the guest:
//! * `IBV_EVENT_CQ_ERR` for every completion that does not fit a full CQ (the
//!   QP stays in RTS);
//! * `IBV_EVENT_PORT_ERR` when the netdev goes down, `IBV_EVENT_PORT_ACTIVE`
//!   when it comes back up (twice for one `ip link set up`);
//! * `IBV_EVENT_GID_CHANGE` when an IP address is added to or removed from the netdev;
//! * no QP event when a QP is moved to ERR by the user, nor when an RDMA WRITE
//!   with a bad rkey moves both QPs to ERR (the requester only gets a
//!   REM_ACCESS_ERR completion): rxe does not raise QP_FATAL, QP_REQ_ERR or
//!   QP_ACCESS_ERR there.
//!
//! The event descriptors themselves are private (a read through a duplicate
//! would consume an event nobody acknowledges and hang Drop); the
//! `*_readiness_reports_without_consuming` tests check the readiness handles
//! that replace them.
//!
//! The tests take one lock, so they run one at a time: the port test takes
//! the link down, which would break the others.
mod common;

use std::fs::File;
use std::io::Read;
use std::os::fd::AsFd;
use std::process::Command;

use common::readable;
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use rdma_verbs::channel::{CompletionChannel, Readiness};
use rdma_verbs::context::Context;
use rdma_verbs::cq::{Cq, WcOpcode};
use rdma_verbs::device::PortState;
use rdma_verbs::event::{AsyncEvent, AsyncEvents};
use rdma_verbs::mr::{AccessFlags, RemoteMr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{InitAttr, Qp, QpCaps, Rc, RecvWr, Rts, SendWr};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Two connected RC QPs whose CQs report to their own completion channels.
struct ChanPair {
    ctx: Context,
    pd: Pd,
    cq_a: Cq,
    cq_b: Cq,
    a: Qp<Rc, Rts>,
    b: Qp<Rc, Rts>,
}

fn chan_pair(caps: QpCaps, b_recvs: u64) -> ChanPair {
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let depth = (caps.max_send_wr + caps.max_recv_wr) * 2;
    let ch_a = CompletionChannel::new(&ctx).expect("channel a");
    let ch_b = CompletionChannel::new(&ctx).expect("channel b");
    let cq_a = Cq::with_channel(&ctx, depth, &ch_a).expect("cq a");
    let cq_b = Cq::with_channel(&ctx, depth, &ch_b).expect("cq b");
    // The CQs hold the channels: dropping ours here proves they outlive it.
    drop((ch_a, ch_b));
    let gid = common::gid_index(&ctx);
    let mk = |cq: &Cq| {
        Qp::new(&pd, cq, cq, caps)
            .expect("create qp")
            .init(InitAttr::new(1, common::all_remote()))
            .expect("init")
    };
    let a = mk(&cq_a);
    let mut b = mk(&cq_b);
    b.post_recv_list((0..b_recvs).map(RecvWr::empty))
        .expect("post receives");
    let ea = a.endpoint(Some(gid)).expect("endpoint a");
    let eb = b.endpoint(Some(gid)).expect("endpoint b");
    let a = a.connect(&eb, Some(gid)).expect("connect a");
    let b = b.connect(&ea, Some(gid)).expect("connect b");
    ChanPair {
        ctx,
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

#[test]
fn channel_waiter_sleeps_until_a_completion_arrives() {
    let _g = serial();
    let mut p = chan_pair(QpCaps::default(), 2);
    let ch = p.cq_b.channel().expect("channel").clone();
    assert_eq!(ch.attached_cqs(), 1);

    // Nothing armed, nothing posted: the wait times out.
    let t = Instant::now();
    assert_eq!(ch.wait(Some(Duration::from_millis(200))).unwrap(), None);
    assert!(t.elapsed() >= Duration::from_millis(200));

    // Armed; a thread sleeps on the channel until the SEND lands.
    p.cq_b.req_notify(false).unwrap();
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        let id = ch.wait(Some(common::WAIT));
        (id, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(500));
    p.a.post_send(SendWr::send(1).imm(7)).unwrap();
    let (id, slept) = waiter.join().unwrap();
    assert_eq!(id.unwrap(), Some(p.cq_b.id()), "the event names cq_b");
    assert!(slept >= Duration::from_millis(400), "woke after {slept:?}");
    assert_eq!(p.cq_b.unacked_events(), 1);
    let got = common::wait(&mut p.cq_b, 1);
    assert_eq!(got[0].imm_data, Some(7));
    assert_eq!(got[0].opcode, WcOpcode::Recv);
    assert_eq!(p.cq_b.ack_events(), 1);
    assert_eq!(p.cq_b.unacked_events(), 0);
    common::wait(&mut p.cq_a, 1);

    // The hybrid loop in a thread: sleeps, then returns the completion.
    let ChanPair {
        mut a,
        mut cq_a,
        mut cq_b,
        ctx: _ctx,
        pd: _pd,
        b: _b,
    } = p;
    let sleeper = std::thread::spawn(move || {
        let mut out = Vec::with_capacity(4);
        let t = Instant::now();
        let n = cq_b.wait_poll(&mut out, Some(common::WAIT));
        (cq_b, out, n, t.elapsed())
    });
    std::thread::sleep(Duration::from_millis(500));
    a.post_send(SendWr::send(2).imm(8)).unwrap();
    let (mut cq_b, out, n, slept) = sleeper.join().unwrap();
    assert_eq!(n.unwrap(), 1);
    assert_eq!(out[0].imm_data, Some(8));
    assert!(slept >= Duration::from_millis(400), "woke after {slept:?}");
    let mut out = Vec::with_capacity(4);
    assert_eq!(cq_a.wait_poll(&mut out, Some(common::WAIT)).unwrap(), 1);

    // Nothing more to come: wait_poll times out with 0.
    let mut out = Vec::with_capacity(4);
    let t = Instant::now();
    assert_eq!(
        cq_b.wait_poll(&mut out, Some(Duration::from_millis(300)))
            .unwrap(),
        0
    );
    assert!(t.elapsed() >= Duration::from_millis(300));
}

#[test]
fn cq_drop_acks_outstanding_events() {
    let _g = serial();
    let mut p = chan_pair(QpCaps::default(), 4);
    for i in 0..3 {
        p.cq_b.req_notify(false).unwrap();
        p.a.post_send(SendWr::send(i)).unwrap();
        let ch = p.cq_b.channel().unwrap().clone();
        assert_eq!(ch.wait(Some(common::WAIT)).unwrap(), Some(p.cq_b.id()));
        common::wait(&mut p.cq_b, 1);
        common::wait(&mut p.cq_a, 1);
    }
    assert_eq!(p.cq_b.unacked_events(), 3);
    // Destroy everything: ibv_destroy_cq would block forever on 3 unacked events.
    let t = Instant::now();
    drop(p);
    assert!(t.elapsed() < Duration::from_secs(10));
}

/// A monitor holding a clone of the channel may take the event a
/// `wait_poll` waiter sleeps on; the waiter still returns the completion
/// within `WAIT_SLICE` (it slept on until its timeout: forever with `None`).
/// Who reads the event first is a race, so several rounds are run and the
/// ones the monitor won are counted.
#[test]
fn wait_poll_finds_a_completion_whose_event_a_clone_took() {
    let _g = serial();
    let p = chan_pair(QpCaps::default(), 8);
    let ch = p.cq_b.channel().expect("channel").clone();
    let ChanPair {
        mut a,
        mut cq_a,
        cq_b,
        ctx: _ctx,
        pd: _pd,
        b: _b,
    } = p;
    const ROUNDS: u64 = 6;
    let (done_tx, done_rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let mut cq_b = cq_b;
        for _ in 0..ROUNDS {
            let mut out = Vec::with_capacity(4);
            let n = cq_b.wait_poll(&mut out, None).expect("wait_poll");
            done_tx.send((n, out[0].imm_data)).unwrap();
        }
        cq_b
    });
    let mut monitor_won = 0;
    for i in 0..ROUNDS {
        // The waiter is asleep on the channel by now.
        std::thread::sleep(Duration::from_millis(300));
        a.post_send(SendWr::send(i).imm(i as u32)).unwrap();
        // The monitor spins on the event until the waiter has returned.
        let until = Instant::now() + Duration::from_secs(3);
        let mut got = None;
        while got.is_none() && Instant::now() < until {
            if ch.try_next().unwrap().is_some() {
                monitor_won += 1;
            }
            got = done_rx.try_recv().ok();
        }
        let (n, imm) = got.unwrap_or_else(|| {
            panic!("round {i}: wait_poll still asleep 3 s after the completion arrived")
        });
        assert_eq!((n, imm), (1, Some(i as u32)));
        common::wait(&mut cq_a, 1);
    }
    drop(waiter.join().unwrap());
    eprintln!("the monitor took the event in {monitor_won} of {ROUNDS} rounds");
}

#[test]
fn wait_poll_refuses_a_shared_channel() {
    let _g = serial();
    let ctx = common::ctx();
    let ch = CompletionChannel::new(&ctx).unwrap();
    let mut c1 = Cq::with_channel(&ctx, 16, &ch).unwrap();
    let _c2 = Cq::with_channel(&ctx, 16, &ch).unwrap();
    assert_eq!(ch.attached_cqs(), 2);
    let mut out = Vec::with_capacity(1);
    let e = c1.wait_poll(&mut out, Some(Duration::ZERO)).unwrap_err();
    assert!(e.to_string().contains("channel of its own"), "{e}");
    let plain = Cq::new(&ctx, 16).unwrap();
    assert!(plain.req_notify(false).is_err());
    // A channel of another context is refused.
    let other = Context::open(Some(ctx.name())).unwrap();
    assert!(Cq::with_channel(&other, 16, &ch).is_err());
}

#[test]
fn hybrid_loop_loses_nothing_in_a_burst_of_10000() {
    const N: u32 = 10_000;
    const DEPTH: u32 = 256;
    let _g = serial();
    let caps = QpCaps {
        max_send_wr: DEPTH,
        max_recv_wr: DEPTH,
        ..QpCaps::default()
    };
    let p = chan_pair(caps, u64::from(DEPTH));
    let ChanPair {
        mut a,
        mut b,
        mut cq_a,
        mut cq_b,
        ctx: _ctx,
        pd: _pd,
    } = p;
    let start = Instant::now();
    let receiver = std::thread::spawn(move || -> Result<(u32, u32), String> {
        let mut out = Vec::with_capacity(64);
        let (mut next, mut calls) = (0u32, 0u32);
        while next < N {
            out.clear();
            let n = cq_b
                .wait_poll(&mut out, Some(common::WAIT))
                .map_err(|e| e.to_string())?;
            calls += 1;
            if n == 0 {
                return Err(format!(
                    "no completion for {:?} after #{next}",
                    common::WAIT
                ));
            }
            for c in out.drain(..) {
                c.result().map_err(|e| e.to_string())?;
                if c.imm_data != Some(next) {
                    return Err(format!("expected message {next}, got {:?}", c.imm_data));
                }
                next += 1;
                b.post_recv(RecvWr::empty(u64::from(next)))
                    .map_err(|e| e.to_string())?;
            }
        }
        drop(b);
        Ok((next, calls))
    });
    let mut in_flight = 0u32;
    let mut out = Vec::with_capacity(DEPTH as usize);
    let mut send_waits = 0;
    for i in 0..N {
        while in_flight == DEPTH {
            out.clear();
            let n = cq_a.wait_poll(&mut out, Some(common::WAIT)).unwrap();
            assert!(n > 0, "send completions stalled at {i}");
            send_waits += 1;
            for c in &out {
                c.result().unwrap();
            }
            in_flight -= n as u32;
        }
        a.post_send(SendWr::send(u64::from(i)).imm(i)).unwrap();
        in_flight += 1;
    }
    while in_flight > 0 {
        out.clear();
        let n = cq_a.wait_poll(&mut out, Some(common::WAIT)).unwrap();
        assert!(n > 0, "last send completions stalled");
        in_flight -= n as u32;
    }
    let (received, calls) = receiver.join().unwrap().unwrap();
    assert_eq!(received, N);
    eprintln!(
        "burst: {N} messages in {:?}; receiver wait_poll calls: {calls}, sender waits: {send_waits}",
        start.elapsed()
    );
}

/// Collects the events of `window`, printing them.
fn events_for(evs: &mut AsyncEvents, tag: &str, window: Duration) -> Vec<AsyncEvent> {
    let got = evs.collect_for(window).expect("async events");
    eprintln!("[{tag}] {got:?}");
    got
}

/// A connected pair whose `a` sends complete on a CQ of depth 1 (`small`):
/// the only way left to overrun a CQ is the raw path, see [`overrun`].
struct SmallCqPair {
    a: Qp<Rc, Rts>,
    b: Qp<Rc, Rts>,
    small: Cq,
    big: Cq,
}

fn small_cq_pair(ctx: &Context, pd: &Pd) -> SmallCqPair {
    let small = Cq::new(ctx, 1).unwrap();
    // The pair needs a CQ that stays small.
    small.set_auto_grow(false);
    let big = Cq::new(ctx, 64).unwrap();
    let gid = common::gid_index(ctx);
    let a_caps = QpCaps {
        max_send_wr: small.depth(),
        max_recv_wr: 8,
        ..QpCaps::default()
    };
    // The safe path refuses a send queue deeper than the CQ can hold.
    match Qp::new(
        pd,
        &small,
        &big,
        QpCaps {
            max_send_wr: 8,
            ..a_caps
        },
    ) {
        Err(rdma_verbs::Error::CqTooSmall {
            queue: "send",
            needed: 8,
            ..
        }) => {}
        other => panic!("expected CqTooSmall, got {other:?}"),
    }
    let mk = |scq: &Cq, caps: QpCaps| {
        Qp::new(pd, scq, &big, caps)
            .unwrap()
            .init(InitAttr::new(1, common::all_remote()))
            .unwrap()
    };
    let a = mk(&small, a_caps);
    let mut b = mk(
        &big,
        QpCaps {
            max_send_wr: 8,
            ..a_caps
        },
    );
    b.post_recv_list((0..8).map(RecvWr::empty)).unwrap();
    let ea = a.endpoint(Some(gid)).unwrap();
    let eb = b.endpoint(Some(gid)).unwrap();
    let a = a.connect(&eb, Some(gid)).unwrap();
    let b = b.connect(&ea, Some(gid)).unwrap();
    SmallCqPair { a, b, small, big }
}

/// Signaled zero-byte SENDs through the raw path (which bypasses the ring's
/// depth), never polled: tries for up to 5 s to get `n` accepted (the send
/// queue frees a slot only once the previous request completed), and
/// returns how many were.
fn overrun(a: &mut Qp<Rc, Rts>, n: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut posted = 0;
    while posted < n && Instant::now() < deadline {
        let mut wr = rdma_verbs::ffi::ibv_send_wr {
            wr_id: posted as u64,
            opcode: rdma_verbs::ffi::IBV_WR_SEND,
            send_flags: rdma_verbs::ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        // SAFETY: no SGEs (nothing for the NIC to read); the completions are
        // never polled through the safe path.
        if unsafe { a.post_send_raw(&mut wr) }.is_ok() {
            posted += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    posted
}

#[test]
fn cq_overflow_raises_cq_err_naming_the_cq() {
    let _g = serial();
    let ctx = common::ctx();
    let mut evs = ctx.async_events().unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let SmallCqPair {
        mut a,
        b: _b,
        small,
        big: _big,
    } = small_cq_pair(&ctx, &pd);
    let posted = overrun(&mut a, small.depth() as usize + 1);
    let got = events_for(&mut evs, "cq overflow", Duration::from_secs(2));
    let overflow = posted - small.depth() as usize;
    assert!(overflow > 0, "only {posted} raw posts went through");
    assert!(
        got.iter()
            .any(|e| *e == AsyncEvent::CqErr { cq: small.id() }),
        "no CQ_ERR for the small CQ: {got:?}"
    );
    assert!(
        got.iter().all(|e| e.cq() == Some(small.id())),
        "unexpected events: {got:?}"
    );
    // rxe raises one per completion that did not fit.
    assert_eq!(got.len(), overflow, "{got:?}");
    assert!(got[0].to_string().contains("IBV_EVENT_CQ_ERR"));
}

#[test]
fn qp_errors_raise_no_qp_event_on_rxe() {
    let _g = serial();
    // A QP moved to ERR by the user.
    let p = common::pair(QpCaps::default());
    let mut evs = p.ctx.async_events().unwrap();
    let (qa, qb) = (p.a.qp_num(), p.b.qp_num());
    let a = p.a.to_error().unwrap();
    assert_eq!(a.query().unwrap().state, rdma_verbs::qp::QpStateKind::Err);
    let got = events_for(&mut evs, "to_error", Duration::from_secs(1));
    // Whatever a device reports must name our QPs; rxe reports nothing.
    assert!(
        got.iter()
            .all(|e| e.qp_num().is_some_and(|q| q == qa || q == qb)),
        "{got:?}"
    );
    assert!(
        got.is_empty(),
        "rxe raised {got:?} for a user-requested ERR"
    );

    // An RDMA WRITE with a bad rkey: both QPs go to ERR, the requester gets
    // REM_ACCESS_ERR; rxe raises no QP_ACCESS_ERR / QP_REQ_ERR / QP_FATAL.
    let mut p = common::pair(QpCaps::default());
    let mut evs = p.ctx.async_events().unwrap();
    let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let bad = RemoteMr {
        addr: 0x1000,
        len: 64,
        rkey: 0xdead,
    };
    p.a.post_send(SendWr::write(1, bad, 0).sge(mr)).unwrap();
    let c = common::wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, rdma_verbs::cq::WcStatus::RemAccessErr);
    let got = events_for(&mut evs, "bad rkey", Duration::from_secs(1));
    let (qa, qb) = (p.a.qp_num(), p.b.qp_num());
    assert!(
        got.iter()
            .all(|e| e.qp_num().is_some_and(|q| q == qa || q == qb)),
        "{got:?}"
    );
    assert!(
        got.is_empty(),
        "rxe raised {got:?} for a remote access error"
    );
    assert_eq!(p.a.query().unwrap().state, rdma_verbs::qp::QpStateKind::Err);
    assert_eq!(p.b.query().unwrap().state, rdma_verbs::qp::QpStateKind::Err);
}

/// Brings veth0 back up (and waits for the port) even when the test fails.
struct LinkGuard<'a>(&'a Context);

impl Drop for LinkGuard<'_> {
    fn drop(&mut self) {
        let _ = ip(&["link", "set", "veth0", "up"]);
        let _ = wait_port(self.0, PortState::Active);
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let st = Command::new("ip")
        .args(args)
        .status()
        .map_err(|e| format!("cannot run ip {args:?}: {e}"))?;
    st.success()
        .then_some(())
        .ok_or_else(|| format!("ip {args:?} failed: {st}"))
}

fn wait_port(ctx: &Context, want: PortState) -> Result<(), String> {
    let t = Instant::now();
    loop {
        let st = ctx.query_port(1).map_err(|e| e.to_string())?.state;
        if st == want {
            return Ok(());
        }
        if t.elapsed() > common::WAIT {
            return Err(format!("port 1 stayed {st:?}, expected {want:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn port_and_gid_events_follow_the_netdev() {
    let _g = serial();
    let ctx = common::ctx();
    let guest_device = std::env::var("RDMA_VERBS_DEVICE").ok();
    if !matches!(guest_device.as_deref(), Some("rxe0" | "siw0")) {
        // Never take a real host's link down: this runs only in the guest.
        panic!("this test toggles veth0 and needs the guest (RDMA_VERBS_DEVICE=rxe0 or siw0)");
    }
    let iwarp = common::iwarp(&ctx);
    let mut evs = ctx.async_events().unwrap();
    let _ = events_for(&mut evs, "before", Duration::from_millis(200));
    let guard = LinkGuard(&ctx);

    ip(&["link", "set", "veth0", "down"]).unwrap();
    wait_port(&ctx, PortState::Down).unwrap();
    let got = events_for(&mut evs, "veth0 down", Duration::from_secs(1));
    assert_eq!(got, vec![AsyncEvent::PortErr { port: 1 }]);

    ip(&["link", "set", "veth0", "up"]).unwrap();
    wait_port(&ctx, PortState::Active).unwrap();
    let got = events_for(&mut evs, "veth0 up", Duration::from_secs(1));
    assert!(!got.is_empty(), "no PORT_ACTIVE");
    // rxe 6.1 raises PORT_ACTIVE twice for one `up`.
    assert!(
        got.iter().all(|e| *e == AsyncEvent::PortActive { port: 1 }),
        "{got:?}"
    );
    drop(guard);

    ip(&["addr", "add", "10.99.7.1/24", "dev", "veth0"]).unwrap();
    let got = events_for(&mut evs, "addr add", Duration::from_secs(1));
    let _ = ip(&["addr", "del", "10.99.7.1/24", "dev", "veth0"]);
    if iwarp {
        // siw's one GID comes from the MAC: addresses change no GID.
        assert_eq!(got, vec![], "events on address add");
        let got = events_for(&mut evs, "addr del", Duration::from_secs(1));
        assert_eq!(got, vec![], "events on address del");
        common::deviation("no GID_CHANGE on address changes: the GID is the MAC's");
        return;
    }
    assert!(
        got.contains(&AsyncEvent::GidChange { port: 1 }),
        "no GID_CHANGE on address add: {got:?}"
    );
    let got = events_for(&mut evs, "addr del", Duration::from_secs(1));
    assert!(
        got.contains(&AsyncEvent::GidChange { port: 1 }),
        "no GID_CHANGE on address del: {got:?}"
    );
    // The device works again: a pair connects and exchanges a message.
    let mut p = common::pair(QpCaps::default());
    p.b.post_recv(RecvWr::empty(1)).unwrap();
    p.a.post_send(SendWr::send(1)).unwrap();
    common::wait(&mut p.cq_b, 1)[0].result().unwrap();
}

/// `read` on a duplicate of the handle (all safe code) fails with EINVAL:
/// it cannot consume the event the handle reports.
fn read_through_a_dup_fails(r: &Readiness) {
    let mut dup = File::from(r.as_fd().try_clone_to_owned().expect("dup"));
    let e = dup
        .read(&mut [0u8; 256])
        .expect_err("reading the readiness handle must fail");
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
}

/// Drops `v` on a thread and fails if that does not return within 5 s
/// (an unacknowledged event makes ibv_destroy_cq / ibv_destroy_qp wait forever).
fn drop_returns<T: Send + 'static>(what: &str, v: T) {
    let (tx, rx) = mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        drop(v);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| panic!("dropping {what} still blocked after {:?}", t.elapsed()));
}

/// The regression test for the hang: the channel's own descriptor is out of
/// safe code's reach (`tests/ui/completion_channel_fd_is_private.rs`), its
/// readiness handle reports the event, reading the handle consumes nothing,
/// `try_next` still gets the event, and dropping the CQ returns.
#[test]
fn completion_readiness_reports_without_consuming() {
    let _g = serial();
    let mut p = chan_pair(QpCaps::default(), 2);
    let ch = p.cq_b.channel().expect("channel").clone();
    {
        let r = ch.readiness().expect("readiness handle");
        assert!(
            std::ptr::eq(r, ch.readiness().unwrap()),
            "one handle per channel"
        );
        assert!(!readable(r, Duration::ZERO), "nothing armed yet");

        p.cq_b.req_notify(false).unwrap();
        p.a.post_send(SendWr::send(1).imm(5)).unwrap();
        assert!(readable(r, common::WAIT), "no readiness for the completion");
        read_through_a_dup_fails(r);
        assert!(readable(r, Duration::ZERO), "the event is still waiting");

        assert_eq!(ch.try_next().unwrap(), Some(p.cq_b.id()));
        assert_eq!(p.cq_b.unacked_events(), 1, "counted on cq_b, not yet acked");
        assert!(!readable(r, Duration::ZERO), "the event was consumed once");
        assert_eq!(ch.try_next().unwrap(), None);
    }
    assert_eq!(common::wait(&mut p.cq_b, 1)[0].imm_data, Some(5));
    common::wait(&mut p.cq_a, 1);

    // A second event, read and left unacknowledged: Drop acks both.
    p.cq_b.req_notify(false).unwrap();
    p.a.post_send(SendWr::send(2)).unwrap();
    assert_eq!(ch.wait(Some(common::WAIT)).unwrap(), Some(p.cq_b.id()));
    assert_eq!(p.cq_b.unacked_events(), 2);
    // A duplicate of the handle outlives everything and stays harmless.
    let dup = ch
        .readiness()
        .unwrap()
        .as_fd()
        .try_clone_to_owned()
        .unwrap();
    drop(ch);
    drop_returns("the CQs, QPs and channels", p);
    let mut dup = File::from(dup);
    assert!(dup.read(&mut [0u8; 16]).is_err());
}

/// The same for the async event descriptor: a CQ overflow raises CQ_ERR,
/// the handle reports it, reading the handle consumes nothing, `try_next`
/// gets it, and destroying the CQ (which waits for its async events) returns.
#[test]
fn async_readiness_reports_without_consuming() {
    let _g = serial();
    let ctx = common::ctx();
    let mut evs = ctx.async_events().unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let SmallCqPair {
        mut a,
        b,
        small,
        big,
    } = small_cq_pair(&ctx, &pd);

    let r = evs.readiness().expect("readiness handle");
    assert!(!readable(r, Duration::ZERO), "no event yet");
    let depth = small.depth() as usize;
    assert!(
        overrun(&mut a, depth + 1) > depth,
        "the raw posts went through"
    );
    assert!(readable(r, common::WAIT), "no readiness for CQ_ERR");
    read_through_a_dup_fails(r);
    assert!(readable(r, Duration::ZERO), "the event is still waiting");
    let dup = r.as_fd().try_clone_to_owned().unwrap();

    let first = evs
        .try_next()
        .unwrap()
        .expect("the event the handle reported");
    assert_eq!(first, AsyncEvent::CqErr { cq: small.id() });
    let rest = events_for(&mut evs, "after readiness", Duration::from_secs(2));
    assert!(
        rest.iter()
            .all(|e| *e == AsyncEvent::CqErr { cq: small.id() }),
        "{rest:?}"
    );
    let r = evs.readiness().unwrap();
    assert!(!readable(r, Duration::ZERO), "every event was read");
    drop_returns("the QPs and CQs", (a, b, small, big, pd));
    drop(evs);
    drop(ctx);
    let mut dup = File::from(dup);
    assert!(dup.read(&mut [0u8; 16]).is_err());
}

/// A CQ attached to a `wait_poll`'s channel while it waits (so the channel
/// serves two CQs) ends that wait with `InvalidArgument`, at the latest when
/// it reads the new CQ's event, which stays counted on that CQ.
#[test]
fn a_cq_attached_during_a_wait_poll_ends_it() {
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).unwrap();
    let ch = CompletionChannel::new(&ctx).unwrap();
    let mut cq_a = Cq::with_channel(&ctx, 16, &ch).unwrap();
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        let mut out = Vec::with_capacity(4);
        let r = cq_a.wait_poll(&mut out, Some(Duration::from_secs(20)));
        (r, start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let cq_b = Cq::with_channel(&ctx, 16, &ch).unwrap();
    let mut qp = Qp::new(&pd, &cq_b, &cq_b, common::caps_sr(4, 4))
        .unwrap()
        .init(InitAttr::new(1, AccessFlags::LOCAL_WRITE))
        .unwrap();
    qp.post_recv(RecvWr::empty(7)).unwrap();
    cq_b.req_notify(false).unwrap();
    // The flushed receive raises cq_b's event.
    let qp = qp.to_error().map_err(|e| e.error).unwrap();
    let (r, took) = waiter.join().unwrap();
    assert!(
        matches!(
            r,
            Err(rdma_verbs::Error::InvalidArgument {
                what: "completion channel",
                ..
            })
        ),
        "{r:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "the wait went on for {took:?}"
    );
    // Read by the waiter or still on the channel: cq_b's event is cq_b's.
    if cq_b.unacked_events() == 0 {
        assert_eq!(
            ch.wait(Some(Duration::from_secs(2))).unwrap(),
            Some(cq_b.id())
        );
    }
    assert_eq!(cq_b.unacked_events(), 1);
    drop(qp);
}
