//! CQ capacity on the safe data path: exact poll counts, queues that would
//! overrun their CQ refused or the CQ grown, resizes within the reservations
//! and the device's limit, and completions lost to raw polls reported. Runs in
//! the soft-RoCE guest; tests are serialised, so that no test's queues and
//! CQs share the device with another's.

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::{WAIT, all_remote, caps_sr, ctx, pair_sized, pair_with, pattern, wait};
use rdma_verbs::cq::{CompletionSource, Cq, WcStatus};
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{InitAttr, Qp, QpCaps, RecvWr, SendWr};
use rdma_verbs::{Error, ffi};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn poll_n_returns_exactly_the_count_asked_for() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |_, _, b| {
        b.post_recv_list((0..4).map(RecvWr::empty)).unwrap();
    });
    for i in 0..4 {
        p.a.post_send(SendWr::send(i)).unwrap();
    }
    // Let all four completions land in the CQ first.
    std::thread::sleep(Duration::from_millis(300));
    let mut out = Vec::with_capacity(16);
    p.cq_a.poll_n(&mut out, 1, WAIT).unwrap();
    assert_eq!(out.len(), 1, "poll_n(1) with room for 16 returned {out:?}");
    p.cq_a.poll_n(&mut out, 2, WAIT).unwrap();
    assert_eq!(out.len(), 3);
    // More than the CQ's depth in one call works too (in several polls).
    let c = p.cq_a.poll_one(WAIT).unwrap();
    let ids: Vec<u64> = out.iter().chain([&c]).map(|c| c.wr_id).collect();
    assert_eq!(ids, [0, 1, 2, 3]);
    let mut none = Vec::with_capacity(4);
    assert_eq!(
        p.cq_a.poll(&mut none).unwrap(),
        0,
        "nothing was left behind"
    );
    for c in wait(&mut p.cq_b, 4) {
        assert_eq!(c.status, WcStatus::Success);
    }
}

#[test]
fn queues_that_would_overrun_the_cq_are_refused() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut cq = Cq::new(&ctx, 64).unwrap();
    // A CQ that does not grow: the queues that do not fit are refused.
    cq.set_auto_grow(false);
    let depth = u64::from(cq.depth());
    let first = Qp::new(&pd, &cq, &cq, caps_sr(16, 16)).unwrap();
    assert_eq!(cq.reserved(), 32);
    // Every QP on the CQ counts: the second one gets what is left, not more.
    let left = depth - 32;
    let too_deep = u32::try_from(left).unwrap() + 1;
    match Qp::new(&pd, &cq, &cq, caps_sr(too_deep, 1)) {
        Err(Error::CqTooSmall {
            queue: "send",
            needed,
            free,
            ..
        }) => assert_eq!((needed, free), (left + 1, left)),
        other => panic!("expected CqTooSmall, got {other:?}"),
    }
    match Qp::new(&pd, &cq, &cq, caps_sr(1, too_deep)) {
        Err(
            e @ Error::CqTooSmall {
                queue: "receive", ..
            },
        ) => assert!(e.to_string().contains("create the CQ with more entries")),
        other => panic!("expected CqTooSmall, got {other:?}"),
    }
    // Past the device's own limit no CQ could help: the error says so.
    let max = ctx.query_device().unwrap().max_qp_wr;
    match Qp::new(&pd, &cq, &cq, caps_sr(u32::MAX, 1)) {
        Err(Error::InvalidArgument {
            what: "max_send_wr",
            reason,
        }) => assert!(
            reason.contains(&format!("device's max_qp_wr of {max}")),
            "{reason}"
        ),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(cq.reserved(), 32, "refused QPs reserve nothing");
    let second = Qp::new(&pd, &cq, &cq, caps_sr(1, too_deep - 2)).unwrap();
    assert_eq!(cq.reserved(), depth);
    drop(second);
    // Nothing was posted on it: no completion of it can be in the CQ, so its
    // entries come back at once, and a QP of its size fits again.
    assert_eq!(cq.reserved(), 32);
    let mut third = Qp::new(&pd, &cq, &cq, caps_sr(1, too_deep - 2))
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    assert_eq!(cq.reserved(), depth);
    // With a receive posted, its completion (a flush, say) may still be in
    // the CQ when the QP is dropped: its entries come back once a poll finds
    // the CQ empty.
    third
        .post_recv(RecvWr::new(
            1,
            pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
        .unwrap();
    let sq_depth = u64::from(third.caps().max_send_wr);
    drop(third);
    assert_eq!(
        cq.reserved(),
        depth - sq_depth,
        "the empty send queue's entries came back, not the receive queue's"
    );
    let mut out = Vec::with_capacity(4);
    // rxe leaves a destroyed QP's receives where they are; siw flushes them into the CQ
    // while ibv_destroy_qp runs. Such a completion names a QP that is gone: it comes back
    // stale (its buffer was released with the QP), and the next poll finds the CQ empty.
    let n = cq.poll(&mut out).unwrap();
    assert!(n <= 1, "{out:?}");
    for c in &out {
        assert_eq!(
            (c.source, c.status),
            (CompletionSource::Stale, WcStatus::WrFlushErr),
            "{c:?}"
        );
    }
    if n > 0 {
        assert_eq!(cq.poll(&mut out).unwrap(), 0);
    }
    assert_eq!(cq.reserved(), 32);
    drop(first);
}

/// `Cq::new(&ctx, 16)` with the default caps (128 sends, 128 receives), as C
/// programs size CQs: the CQ grows to hold both queues, and a full send
/// queue's worth of messages, left in the CQs before polling, comes back
/// whole and in order.
#[test]
fn a_cq_too_small_for_the_default_caps_grows_and_carries_traffic() {
    let _g = serial();
    if refused_on_a_cq_that_cannot_grow(16, QpCaps::default()) {
        return;
    }
    const N: u64 = 128;
    let mut p = pair_sized(QpCaps::default(), 16, |pd, _, b| {
        let mr = |_| pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv_list((0..N).map(|i| RecvWr::new(i, mr(i))))
            .unwrap();
    });
    for cq in [&p.cq_a, &p.cq_b] {
        assert_eq!(cq.reserved(), 2 * N, "both queues of one QP");
        assert!(cq.depth() >= 2 * N as u32, "grew to {}", cq.depth());
    }
    for i in 0..N {
        let mut mr = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap();
        mr.as_mut_slice()
            .unwrap()
            .copy_from_slice(&pattern(64, i as u8));
        p.a.post_send(SendWr::send_from(i, mr)).unwrap();
    }
    // Every completion in the CQs before the first poll: more than the 16
    // they were created with.
    std::thread::sleep(Duration::from_millis(500));
    let sent = wait(&mut p.cq_a, N as usize);
    assert!(
        sent.iter().all(|c| c.status == WcStatus::Success),
        "{sent:?}"
    );
    let got = wait(&mut p.cq_b, N as usize);
    for (i, c) in got.into_iter().enumerate() {
        let mut c = c;
        assert_eq!(
            (c.wr_id, c.status, c.byte_len),
            (i as u64, WcStatus::Success, 64)
        );
        let mr = c.take_mr().expect("the receive's buffer");
        assert_eq!(mr.as_slice().unwrap(), &pattern(64, i as u8)[..]);
    }
}

/// On iWARP (siw, which cannot resize a CQ): a QP whose send queue does not fit a CQ of
/// `depth` is refused with `Error::CqTooSmall` naming the numbers, reported as a deviation
/// (true); elsewhere false, and the CQ grows as the caller's test asserts.
fn refused_on_a_cq_that_cannot_grow(depth: u32, caps: QpCaps) -> bool {
    let ctx = ctx();
    if !common::iwarp(&ctx) {
        return false;
    }
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, depth).unwrap();
    match Qp::new(&pd, &cq, &cq, caps) {
        Err(Error::CqTooSmall {
            queue: "send",
            needed,
            free,
            depth: d,
        }) => assert_eq!(
            (needed, free, d),
            (
                u64::from(caps.max_send_wr),
                u64::from(depth),
                u64::from(depth)
            )
        ),
        other => panic!("expected CqTooSmall on a CQ siw cannot grow, got {other:?}"),
    }
    assert_eq!(cq.reserved(), 0, "the refused QP's reservations came back");
    common::deviation("no CQ resize: a QP whose queues do not fit its CQ is CqTooSmall");
    true
}

/// `Cq::resize` grows and shrinks within what the queues reserve, and a QP
/// whose queues would take the CQ past the device's `max_cqe` is refused,
/// its reservations given back.
#[test]
fn resize_respects_the_reservations_and_the_device_limit() {
    let _g = serial();
    if refused_on_a_cq_that_cannot_grow(8, caps_sr(64, 64)) {
        return;
    }
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 8).unwrap();
    let qp = Qp::new(&pd, &cq, &cq, caps_sr(64, 64)).unwrap();
    assert_eq!(cq.reserved(), 128);
    let grown = cq.depth();
    assert!(grown >= 128, "{grown}");
    assert_eq!(cq.resize(1000).unwrap(), cq.depth());
    assert!(cq.depth() >= 1000);
    match cq.resize(127) {
        Err(Error::InvalidArgument {
            what: "CQ depth",
            reason,
        }) => assert!(reason.contains("below the 128 entries"), "{reason}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let back = cq.resize(128).unwrap();
    assert!((128..1000).contains(&back), "shrunk to {back}");
    let max = ctx.query_device().unwrap().max_cqe as u32;
    assert!(matches!(
        cq.resize(max + 1),
        Err(Error::InvalidArgument {
            what: "CQ depth",
            ..
        })
    ));
    // Queues that need more than max_cqe in all: no resize can take them.
    // (One send queue where the device allows queues that deep, else a
    // full send queue and a receive queue.)
    let max_wr = ctx.query_device().unwrap().max_qp_wr as u32;
    let need = max + 1 - 128;
    let (queue, caps, needed) = if need <= max_wr {
        ("send", caps_sr(need, 1), need)
    } else {
        ("receive", caps_sr(max_wr, need - max_wr), need - max_wr)
    };
    match Qp::new(&pd, &cq, &cq, caps) {
        Err(Error::CqTooSmall {
            queue: q,
            needed: n,
            ..
        }) => assert_eq!((q, n), (queue, u64::from(needed))),
        other => panic!("expected CqTooSmall, got {other:?}"),
    }
    // A send queue that fit may have grown the CQ; its reservation went
    // with the refused QP.
    assert!(cq.depth() >= back);
    assert_eq!(cq.reserved(), 128);
    drop(qp);
}

#[test]
fn completions_consumed_by_poll_raw_are_reported_lost() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |_, _, b| {
        b.post_recv_list((0..2).map(RecvWr::empty)).unwrap();
    });
    p.a.post_send(SendWr::send(1)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut raw = [ffi::ibv_wc::default(); 4];
    assert_eq!(p.cq_a.poll_raw(&mut raw).unwrap(), 1);
    p.a.post_send(SendWr::send(2)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut out = Vec::with_capacity(4);
    match p.cq_a.poll(&mut out) {
        Err(Error::CompletionsLost { count: 1 }) => {}
        other => panic!("expected CompletionsLost, got {other:?}"),
    }
    assert_eq!(out.len(), 1, "the completion that exposed the loss is kept");
    assert_eq!(out[0].wr_id, 2);
    wait(&mut p.cq_b, 2);
}

/// `poll_one` returns the completion whose poll exposed a loss, buffer and
/// all, and the next poll reports the loss (the completion and its buffer
/// are not dropped).
#[test]
fn poll_one_keeps_the_completion_that_exposed_a_loss() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |pd, _, b| {
        b.post_recv_list(
            (0..2).map(|i| RecvWr::new(i, pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap())),
        )
        .unwrap();
    });
    p.a.post_send(SendWr::send(1)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut raw = [ffi::ibv_wc::default(); 4];
    assert_eq!(p.cq_a.poll_raw(&mut raw).unwrap(), 1);
    let mut src = p.pd.alloc_mr(16, AccessFlags::empty()).unwrap();
    src.write_at(0, b"sixteen bytes ok").unwrap();
    p.a.post_send(SendWr::send_from(2, src).signaled(true))
        .unwrap();
    let mut c = p.cq_a.poll_one(WAIT).expect("the completion, not the loss");
    assert_eq!((c.wr_id, c.status), (2, WcStatus::Success));
    let back = c.take_mr().expect("its buffer comes back");
    assert_eq!(back.to_vec().unwrap(), b"sixteen bytes ok");
    let mut out = Vec::with_capacity(4);
    match p.cq_a.poll(&mut out) {
        Err(Error::CompletionsLost { count: 1 }) => assert!(out.is_empty()),
        other => panic!("expected the deferred CompletionsLost, got {other:?}"),
    }
    assert_eq!(p.cq_a.poll(&mut out).unwrap(), 0, "reported once");
    assert_eq!(p.a.outstanding(), (0, 0));
    wait(&mut p.cq_b, 2);
}
