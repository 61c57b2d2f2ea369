//! Shared receive queues on soft-RoCE: every receive accounted across the QPs
//! that share an SRQ, out-of-order consumption, a QP on the SRQ moved to ERR,
//! destruction with receives posted, the CQ rule and the limit event
//! (`tests/vm_srq_interop.rs` has `examples/srq_pingpong.rs` against rdma-core and
//! rdma_cm connections on an SRQ).
//!
//! The SRQ side: QPs created with `Qp::new_with_srq`, all on one CQ. Each
//! has a peer (an ordinary QP on its own CQ) that sends to it.
mod common;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use common::{WAIT, all_remote, buffer, ctx, gid_index, pattern, res_counts, serial, wait};
use rdma_verbs::Error;
use rdma_verbs::context::Context;
use rdma_verbs::cq::{Completion, Cq, WcOpcode, WcStatus};
use rdma_verbs::event::AsyncEvent;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{InitAttr, Qp, QpCaps, Rc, RecvWr, Rts, SendWr};
use rdma_verbs::srq::{Srq, SrqAttr};

fn dev(ctx: &Context) -> String {
    ctx.name().to_owned()
}

const SEND_CAPS: QpCaps = QpCaps {
    max_send_wr: 16,
    max_recv_wr: 0,
    max_send_sge: 1,
    max_recv_sge: 1,
    max_inline_data: 0,
    sq_sig_all: false,
};

/// `n` QPs on one SRQ (their receives and sends on `cq`), each connected to
/// a peer QP whose sends complete on `peer_cq`.
struct Setup {
    ctx: Context,
    pd: Pd,
    cq: Cq,
    peer_cq: Cq,
    srq: Srq,
    qps: Vec<Qp<Rc, Rts>>,
    peers: Vec<Qp<Rc, Rts>>,
}

fn setup(n: usize, srq_depth: u32) -> Setup {
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, srq_depth + n as u32 * SEND_CAPS.max_send_wr).expect("cq");
    let peer_caps = QpCaps {
        max_recv_wr: 1,
        ..SEND_CAPS
    };
    let peer_cq = Cq::new(&ctx, n as u32 * 17).expect("peer cq");
    let srq = Srq::new(&pd, &cq, SrqAttr::new(srq_depth, 1)).expect("srq");
    let gid = gid_index(&ctx);
    let (mut qps, mut peers) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let qp = Qp::new_with_srq(&pd, &cq, &cq, &srq, SEND_CAPS)
            .expect("qp on srq")
            .init(InitAttr::new(1, all_remote()))
            .expect("init");
        let peer = Qp::new(&pd, &peer_cq, &peer_cq, peer_caps)
            .expect("peer")
            .init(InitAttr::new(1, all_remote()))
            .expect("init");
        let (e, pe) = (
            qp.endpoint(Some(gid)).expect("endpoint"),
            peer.endpoint(Some(gid)).expect("endpoint"),
        );
        qps.push(qp.connect(&pe, Some(gid)).expect("connect"));
        peers.push(peer.connect(&e, Some(gid)).expect("connect peer"));
    }
    Setup {
        ctx,
        pd,
        cq,
        peer_cq,
        srq,
        qps,
        peers,
    }
}

/// Posts `n` receives of `len` bytes with wr_ids `first..`; returns wr_id → buffer address.
fn post_receives(s: &mut Setup, first: u64, n: u64, len: usize) -> HashMap<u64, u64> {
    let mut addrs = HashMap::new();
    let wrs: Vec<RecvWr> = (first..first + n)
        .map(|id| {
            let mr = buffer(&s.pd, len);
            addrs.insert(id, mr.addr());
            RecvWr::new(id, mr)
        })
        .collect();
    s.srq.post_recv_list(wrs).expect("post to srq");
    addrs
}

/// A message from peer `j`, its `k`th.
fn message(j: usize, k: usize, len: usize) -> Vec<u8> {
    pattern(len, (j * 16 + k) as u8)
}

/// Peer `j` sends `data` (signaled), from its own registered buffer.
fn send(s: &mut Setup, j: usize, data: &[u8], wr_id: u64) {
    let mut mr = Mr::new(&s.pd, data.len().max(1), AccessFlags::LOCAL_WRITE).expect("mr");
    mr.write_at(0, data).expect("write");
    let wr = if data.is_empty() {
        SendWr::send(wr_id)
    } else {
        SendWr::send(wr_id).sge(mr)
    };
    s.peers[j].post_send(wr).expect("peer send");
}

/// Checks a receive completion's buffer: its wr_id was posted, it comes back
/// once, in the buffer posted with it, holding `expect` byte for byte.
fn check_receive(
    wc: &mut Completion,
    posted: &HashMap<u64, u64>,
    seen: &mut HashSet<u64>,
    expect: &[u8],
) {
    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    assert_eq!(wc.opcode, WcOpcode::Recv);
    assert_eq!(wc.byte_len as usize, expect.len());
    assert!(seen.insert(wc.wr_id), "wr_id {} came back twice", wc.wr_id);
    let mr = wc.take_mr().expect("the receive's buffer");
    assert_eq!(
        Some(&mr.addr()),
        posted.get(&wc.wr_id),
        "not the buffer posted with it"
    );
    assert_eq!(&mr.as_slice().expect("read")[..expect.len()], expect);
}

#[test]
fn sixteen_qps_share_an_srq_and_every_receive_comes_back_once() {
    let _g = serial();
    const N: usize = 16;
    const PER_QP: usize = 4;
    const LEN: usize = 300;
    let mut s = setup(N, (N * PER_QP) as u32);
    // The SRQ's CQ holds its receives and the QPs' sends; the QPs reserved
    // no receive entries of their own.
    assert_eq!(s.cq.reserved(), (N * PER_QP + N * 16) as u64);
    let posted = post_receives(&mut s, 1000, (N * PER_QP) as u64, LEN);
    assert_eq!(s.srq.posted(), (N * PER_QP) as u64);
    // Each peer sends PER_QP messages of different lengths (in order on its QP).
    for k in 0..PER_QP {
        for j in 0..N {
            let len = LEN - 7 * k - j;
            let data = message(j, k, len);
            send(&mut s, j, &data, (j * PER_QP + k) as u64);
        }
    }
    let sends = wait(&mut s.peer_cq, N * PER_QP);
    assert!(sends.iter().all(|c| c.status == WcStatus::Success));
    let mut wcs = wait(&mut s.cq, N * PER_QP);
    let index: HashMap<u32, usize> = s
        .qps
        .iter()
        .enumerate()
        .map(|(i, q)| (q.qp_num(), i))
        .collect();
    let mut next = [0usize; N];
    let mut seen = HashSet::new();
    for wc in &mut wcs {
        // The completion names the QP that consumed the receive.
        let j = *index
            .get(&wc.qp_num)
            .unwrap_or_else(|| panic!("qp_num {:#x}", wc.qp_num));
        let k = next[j];
        next[j] += 1;
        check_receive(wc, &posted, &mut seen, &message(j, k, LEN - 7 * k - j));
    }
    assert_eq!(
        next, [PER_QP; N],
        "every QP consumed its messages' receives"
    );
    assert_eq!(seen.len(), N * PER_QP);
    assert_eq!(s.srq.posted(), 0);
    // The SRQ refills to its depth; nothing else is in the CQ.
    let mut pool: Vec<Mr> = wcs.iter_mut().filter_map(Completion::take_mr).collect();
    assert!(pool.is_empty(), "buffers were taken already");
    pool.extend((0..N * PER_QP + 5).map(|_| buffer(&s.pd, LEN)));
    let n = s
        .srq
        .refill(|| pool.pop().map(|mr| RecvWr::new(1, mr)))
        .expect("refill");
    assert_eq!(
        (n, s.srq.posted(), pool.len()),
        (N * PER_QP, (N * PER_QP) as u64, 5)
    );
    let mut out = Vec::with_capacity(4);
    assert_eq!(s.cq.poll(&mut out).expect("poll"), 0);
}

#[test]
fn receives_consumed_out_of_order_across_qps_retire_their_own_slots() {
    let _g = serial();
    // The SRQ hands out its receives in posting order, as messages begin to
    // arrive; each completes when its message has arrived whole. QP 0's peer
    // sends a long message first: its first packets take a receive, and the
    // rest follows in windows of rxe's unacknowledged-packet limit (128), each
    // waiting for the responder's acknowledgement, so 4 MiB (4,096 packets at
    // a 1,024-byte path MTU) takes tens of milliseconds of kernel work under
    // the emulator. A few milliseconds after it is posted, QP 1's peer sends
    // short messages: they take later receives and complete first. Repeat
    // until that order was seen (each round checks every byte either way).
    const BIG: usize = 4 << 20;
    const SMALL: usize = 4;
    let mut s = setup(2, 8);
    let mut out_of_order = false;
    for round in 0..20u64 {
        let first = round * 100;
        let posted = post_receives(&mut s, first, 1 + SMALL as u64, BIG);
        let big = message(0, round as usize, BIG);
        let small: Vec<Vec<u8>> = (0..SMALL).map(|k| message(1, k, 64 + k)).collect();
        let mut bufs = std::iter::once(&big).chain(&small).map(|d| {
            let mut mr = Mr::new(&s.pd, d.len(), AccessFlags::LOCAL_WRITE).expect("mr");
            mr.write_at(0, d).expect("write");
            mr
        });
        let big_buf = bufs.next().expect("big");
        let small_bufs: Vec<Mr> = bufs.collect();
        s.peers[0]
            .post_send(SendWr::send(0).sge(big_buf))
            .expect("big send");
        std::thread::sleep(Duration::from_millis(3));
        for (k, mr) in small_bufs.into_iter().enumerate() {
            s.peers[1]
                .post_send(SendWr::send(1 + k as u64).sge(mr))
                .expect("small send");
        }
        wait(&mut s.peer_cq, 1 + SMALL);
        let mut wcs = wait(&mut s.cq, 1 + SMALL);
        let mut seen = HashSet::new();
        let order: Vec<u64> = wcs.iter().map(|c| c.wr_id - first).collect();
        let mut k = 0;
        for wc in &mut wcs {
            let expect = if wc.qp_num == s.qps[0].qp_num() {
                &big
            } else {
                k += 1;
                &small[k - 1]
            };
            check_receive(wc, &posted, &mut seen, expect);
        }
        assert_eq!(s.srq.posted(), 0);
        eprintln!("round {round}: completion order {order:?}");
        if order.windows(2).any(|w| w[0] > w[1]) {
            out_of_order = true;
            break;
        }
    }
    assert!(
        out_of_order,
        "the receives always completed in posting order"
    );
}

/// `refill` counts the receives it posted, also when the CQ is polled while
/// it runs (the count was a difference of `posted()`, which such a poll
/// lowers: it underflowed).
#[test]
fn refill_counts_its_posts_when_a_poll_runs_meanwhile() {
    let _g = serial();
    let mut s = setup(1, 8);
    post_receives(&mut s, 0, 4, 64);
    for k in 0..4 {
        send(&mut s, 0, &message(0, k, 64), k as u64);
    }
    // The four receives complete (still in the CQ, so still counted).
    let deadline = Instant::now() + Duration::from_secs(10);
    while s
        .peer_cq
        .poll(&mut Vec::with_capacity(4))
        .expect("peer poll")
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the peer's sends did not complete"
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(s.srq.posted(), 4);
    let (pd, cq) = (&s.pd, &mut s.cq);
    let mut polled = Vec::with_capacity(8);
    let mut calls = 0;
    let n = s
        .srq
        .refill(|| {
            calls += 1;
            if calls > 1 {
                return None;
            }
            // The poll takes the four receives back: posted() drops to 0.
            while polled.len() < 4 {
                cq.poll(&mut polled).expect("poll");
                assert!(Instant::now() < deadline, "{} of 4 receives", polled.len());
            }
            Some(RecvWr::new(100, buffer(pd, 64)))
        })
        .expect("refill");
    assert_eq!((n, s.srq.posted()), (1, 1));
    assert_eq!(polled.len(), 4);
}

#[test]
fn a_qp_on_the_srq_in_err_leaves_the_srq_receives_to_the_others() {
    let _g = serial();
    let mut s = setup(2, 8);
    let posted = post_receives(&mut s, 0, 8, 64);
    // QP 0 goes to ERR with no message in progress: it holds none of the
    // SRQ's receives, so nothing is flushed and all 8 stay posted.
    let qp0 = s.qps.remove(0);
    let qp0 = qp0.to_error().expect("to ERR");
    assert_eq!(qp0.outstanding(), (0, 0));
    let mut out = Vec::with_capacity(8);
    assert_eq!(
        s.cq.poll(&mut out).expect("poll"),
        0,
        "a receive was flushed: {out:?}"
    );
    assert_eq!(s.srq.posted(), 8);
    // The other QP gets all of them, each once, with its data.
    for k in 0..8 {
        send(&mut s, 1, &message(1, k, 64 - k), k as u64);
    }
    wait(&mut s.peer_cq, 8);
    let mut seen = HashSet::new();
    for (k, mut wc) in wait(&mut s.cq, 8).into_iter().enumerate() {
        assert_eq!(wc.qp_num, s.qps[0].qp_num());
        check_receive(&mut wc, &posted, &mut seen, &message(1, k, 64 - k));
    }
    assert_eq!(s.srq.posted(), 0);
    // The QP in ERR can be reset (nothing of its own outstanding) and dropped.
    let qp0 = qp0.reset().expect("reset");
    drop(qp0);
}

/// Drops everything in `order` with receives posted: kernel objects and
/// registrations return to the baseline.
fn drop_with_receives_posted(srq_first: bool) {
    let ctx0 = ctx();
    let dev = dev(&ctx0);
    let base = res_counts(&dev);
    let mut s = setup(4, 32);
    post_receives(&mut s, 0, 32, 128);
    let during = res_counts(&dev);
    assert_eq!(during["srq"], base["srq"] + 1);
    assert_eq!(during["qp"], base["qp"] + 8);
    assert!(during["mr"] >= base["mr"] + 32);
    let Setup {
        ctx,
        pd,
        cq,
        peer_cq,
        srq,
        qps,
        peers,
    } = s;
    if srq_first {
        // The QPs keep the SRQ (and its 32 buffers) alive.
        drop(srq);
        let now = res_counts(&dev);
        assert_eq!((now["srq"], now["mr"]), (during["srq"], during["mr"]));
        drop(qps);
    } else {
        drop(qps);
        let now = res_counts(&dev);
        assert_eq!((now["srq"], now["mr"]), (during["srq"], during["mr"]));
        drop(srq);
    }
    // ibv_destroy_srq ran and released every posted buffer.
    let now = res_counts(&dev);
    assert_eq!(now["srq"], base["srq"]);
    assert_eq!(now["mr"], base["mr"]);
    drop((peers, cq, peer_cq, pd, ctx));
    let end = res_counts(&dev);
    for k in ["pd", "cq", "qp", "mr", "srq"] {
        assert_eq!(end[k], base[k], "{k}: {base:?} -> {end:?}");
    }
}

#[test]
fn dropping_the_srq_and_its_qps_with_receives_posted_frees_everything() {
    let _g = serial();
    drop_with_receives_posted(false);
    drop_with_receives_posted(true);
}

#[test]
fn qps_on_an_srq_need_its_cq_and_have_no_receive_queue() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 64).expect("cq");
    let other = Cq::new(&ctx, 64).expect("cq");
    let srq = Srq::new(&pd, &cq, SrqAttr::new(32, 1)).expect("srq");
    assert_eq!(cq.reserved(), 32);
    let e = Qp::new_with_srq(&pd, &cq, &other, &srq, SEND_CAPS).unwrap_err();
    assert!(matches!(e, Error::SrqCqMismatch), "{e:?}");
    // A QP of another PD: refused (rxe checks a receive's buffer against the
    // QP's PD, so no receive could succeed on it: the SRQ's buffers are in
    // the SRQ's PD, the only ones its posts take).
    let e =
        Qp::new_with_srq(&Pd::new(&ctx).expect("pd"), &other, &cq, &srq, SEND_CAPS).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert_eq!(cq.reserved(), 32, "nothing reserved by the refused QP");
    // Sends may go elsewhere; the receive CQ reserves nothing more.
    let mut qp = Qp::new_with_srq(&pd, &other, &cq, &srq, SEND_CAPS)
        .expect("qp")
        .init(InitAttr::new(1, all_remote()))
        .expect("init");
    assert_eq!((cq.reserved(), other.reserved()), (32, 16));
    let e = qp.post_recv(RecvWr::new(1, buffer(&pd, 8))).unwrap_err();
    assert!(
        matches!(e.error, Error::QpUsesSrq { qp_num } if qp_num == qp.qp_num()),
        "{e:?}"
    );
    assert_eq!(e.unposted.len(), 1, "the buffer comes back");
    // The SRQ's depth is its limit: one more is refused with its buffer.
    let mut srq = srq;
    for i in 0..32 {
        srq.post_recv(RecvWr::new(i, buffer(&pd, 8))).expect("post");
    }
    let e = srq.post_recv(RecvWr::new(99, buffer(&pd, 8))).unwrap_err();
    assert!(
        matches!(e.error, Error::QueueFull { depth: 32, .. }),
        "{e:?}"
    );
    assert_eq!(e.unposted[0].0, 99);
    // A panic in the iterator takes the requests staged for that call back
    // out of the SRQ (their buffers drop with the unwind).
    drop(e);
    let mrs_before = res_counts(&dev(&ctx))["mr"];
    let mut srq2 = Srq::new(&pd, &other, SrqAttr::new(8, 1)).expect("srq 2");
    let pd2 = pd.clone();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        srq2.post_recv_list((0..4).map(|i| {
            assert!(i < 3, "iterator panics");
            RecvWr::new(i, buffer(&pd2, 8))
        }))
    }));
    assert!(r.is_err());
    assert_eq!(srq2.posted(), 0);
    assert_eq!(
        res_counts(&dev(&ctx))["mr"],
        mrs_before,
        "the staged buffers were dropped"
    );
    srq2.post_recv(RecvWr::new(7, buffer(&pd, 8)))
        .expect("still usable");
    assert_eq!(srq2.posted(), 1);
    // An SRQ that does not fit a CQ that does not grow is refused.
    cq.set_auto_grow(false);
    let free = u64::from(cq.depth()) - 32;
    let e = Srq::new(&pd, &cq, SrqAttr::new(free as u32 + 1, 1)).unwrap_err();
    assert!(
        matches!(e, Error::CqTooSmall { needed, free: f, .. } if needed == free + 1 && f == free),
        "{e:?}"
    );
}

/// A limit the SRQ can never stay at or above (its depth or more) is refused
/// (soft-RoCE takes it up to its own, larger depth and fires at once), and a
/// CQ too small for an SRQ names the shared receive queue.
#[test]
fn a_limit_not_below_the_depth_is_refused() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 64).expect("cq");
    let srq = Srq::new(&pd, &cq, SrqAttr::new(8, 1)).expect("srq");
    assert_eq!(srq.depth(), 8);
    for limit in [8, 9, 100] {
        let e = srq
            .arm_limit(limit)
            .expect_err("a limit at or past the depth");
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    what: "SRQ limit",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("depth of 8"), "{e}");
    }
    assert_eq!(srq.query().expect("query").limit, 0, "nothing was armed");
    srq.arm_limit(7).expect("below the depth");
    assert_eq!(srq.query().expect("query").limit, 7);
    cq.set_auto_grow(false);
    let e = Srq::new(&pd, &cq, SrqAttr::new(cq.depth() + 1, 1)).expect_err("too deep for the CQ");
    assert!(
        matches!(
            e,
            Error::CqTooSmall {
                queue: "shared receive",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(e.to_string().contains("this shared receive queue"), "{e}");
    let e = Srq::new(&pd, &cq, SrqAttr::new(u32::MAX, 1)).expect_err("past the device");
    assert!(e.to_string().contains("device's max_srq_wr"), "{e}");
    // Refused before the SRQ is created: no CQ entries stay reserved for
    // it (the SRQ below takes all of the CQ's that the first one left).
    let mut bad = SrqAttr::new(20, 1);
    bad.limit = 20;
    let e = Srq::new(&pd, &cq, bad).expect_err("a limit at the depth");
    assert!(e.to_string().contains("depth of 20"), "{e}");
    Srq::new(&pd, &cq, SrqAttr::new(cq.depth() - 8, 1)).expect("the rest of the CQ");
}

#[test]
fn the_srq_limit_event_arrives_and_can_be_rearmed() {
    let _g = serial();
    let mut s = setup(1, 8);
    let mut evs = s.ctx.async_events().expect("async events");
    let posted = post_receives(&mut s, 0, 8, 32);
    let mut seen = HashSet::new();
    let mut next_id = 100;
    for round in 0..2 {
        s.srq.arm_limit(4).expect("arm");
        assert_eq!(s.srq.query().expect("query").limit, 4);
        // 5 receives consumed: 3 left, below the limit of 4.
        for k in 0..5 {
            send(&mut s, 0, &message(0, k, 32), k as u64);
        }
        wait(&mut s.peer_cq, 5);
        let mut wcs = wait(&mut s.cq, 5);
        let ev = evs
            .next(Some(WAIT))
            .expect("event")
            .expect("SRQ_LIMIT_REACHED in time");
        assert_eq!(
            ev,
            AsyncEvent::SrqLimitReached { srq: s.srq.id() },
            "round {round}"
        );
        // The event disarmed the limit.
        assert_eq!(s.srq.query().expect("query").limit, 0);
        // Refill what came back (their buffers, under new wr_ids).
        let mut back = Vec::new();
        for (k, wc) in wcs.iter_mut().enumerate() {
            if round == 0 {
                check_receive(wc, &posted, &mut seen, &message(0, k, 32));
            }
            back.push(wc.take_mr().unwrap_or_else(|| buffer(&s.pd, 32)));
        }
        s.srq
            .post_recv_list(back.into_iter().map(|mr| {
                next_id += 1;
                RecvWr::new(next_id, mr)
            }))
            .expect("refill");
        assert_eq!(s.srq.posted(), 8);
    }
}
