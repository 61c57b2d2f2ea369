//! The safe data path at its edges: panicking iterators, destroyed QPs,
//! foreign and stale completions, and the provider behaviour the soundness
//! argument relies on (see the `qp` module docs). CQ capacity is in
//! `vm_cq_capacity.rs`.
//! Runs in the soft-RoCE guest; tests are serialised because one of them
//! counts the device's kernel objects.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{WAIT, all_remote, caps_sr, ctx, pair, pair_with, pattern, res_counts, wait};
use rdma_verbs::cq::{Completion, CompletionSource, Cq, WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::scope::{ScopedSend, Src};
use rdma_verbs::qp::{InitAttr, Qp, QpCaps, RecvWr, SendWr};
use rdma_verbs::{Error, ffi};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Polls whatever is in `cq` within `window` (no count expected).
fn drain(cq: &mut Cq, window: Duration) -> Vec<Completion> {
    let mut out = Vec::with_capacity(256);
    let end = std::time::Instant::now() + window;
    while std::time::Instant::now() < end {
        if cq.poll(&mut out).expect("poll") == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    out
}

#[test]
fn a_panicking_post_list_iterator_leaves_the_queue_usable() {
    let _g = serial();
    // Two send slots: one unsignaled send in flight, then a list whose
    // iterator yields one request (taking the last slot, so forced signaled)
    // and panics before the verb is called.
    let mut p = pair_with(caps_sr(2, 4), |pd, _, b| {
        let mr = |_| pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv_list((0..4).map(|i| RecvWr::new(i, mr(i))))
            .unwrap();
    });
    p.a.post_send(SendWr::send(1).signaled(false)).unwrap();
    let src = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap().freeze();
    let probe = src.clone();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut n = 0;
        let _ = p.a.post_send_list(std::iter::from_fn(|| {
            n += 1;
            if n == 2 {
                panic!("iterator panics");
            }
            Some(SendWr::send_from(2, src.clone()))
        }));
    }));
    assert!(r.is_err(), "the iterator's panic propagates");
    drop(src);
    // The staged request was taken back and its buffer released with the unwind.
    let mr = probe
        .try_unfreeze()
        .expect("no clone of the source is left in the ring");
    // The queue still has its slot: a signaled send completes and retires the
    // unsignaled one before it.
    p.a.post_send(SendWr::send_from(3, mr)).unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (3, WcStatus::Success));
    p.a.post_send(SendWr::send(4)).unwrap();
    p.a.post_send(SendWr::send(5)).unwrap();
    let c = wait(&mut p.cq_a, 2);
    assert_eq!([c[0].wr_id, c[1].wr_id], [4, 5]);
    let got: Vec<u64> = wait(&mut p.cq_b, 4).iter().map(|c| c.wr_id).collect();
    assert_eq!(got, [0, 1, 2, 3], "the receiver saw exactly the four sends");
}

/// A list that mixes requests the builders express with one they cannot
/// (inline data) is all or nothing per chunk as well: the iterator panics
/// after both kinds were staged, and none of them reaches the peer.
#[test]
fn a_panicking_list_of_built_and_c_form_requests_posts_nothing() {
    let _g = serial();
    let caps = QpCaps {
        max_inline_data: 64,
        ..caps_sr(8, 4)
    };
    let mut p = pair_with(caps, |pd, _, b| {
        let mr = |_| pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv_list((0..4).map(|i| RecvWr::new(i, mr(i))))
            .unwrap();
    });
    let data = pattern(16, 3);
    let pd = p.pd.clone();
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut n = 0;
        let _ = p.a.post_send_list(std::iter::from_fn(|| {
            n += 1;
            match n {
                2 => Some(SendWr::send_inline(n, &data)),
                1 | 3 => {
                    let mut src = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
                    src.write_at(0, &data).unwrap();
                    Some(SendWr::send_from(n, src))
                }
                _ => panic!("iterator panics"),
            }
        }));
    }));
    assert!(r.is_err(), "the iterator's panic propagates");
    // The next send is the first message the peer receives.
    let mut src = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"after the panic!").unwrap();
    p.a.post_send(SendWr::send_from(9, src)).unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (9, WcStatus::Success));
    let mut got = wait(&mut p.cq_b, 1);
    assert_eq!((got[0].wr_id, got[0].status), (0, WcStatus::Success));
    let mr = got[0].take_mr().unwrap();
    assert_eq!(&mr.to_vec().unwrap()[..16], b"after the panic!");
    let late = drain(&mut p.cq_b, Duration::from_millis(100));
    assert!(
        late.is_empty(),
        "a request of the panicked list arrived: {late:?}"
    );
    assert!(drain(&mut p.cq_a, Duration::from_millis(10)).is_empty());
}

#[test]
fn destroying_a_qp_releases_its_buffers_without_a_poll() {
    let _g = serial();
    let ctx = ctx();
    let dev = ctx.name().to_owned();
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 64).unwrap();
    let mut qp = Qp::new(&pd, &cq, &cq, caps_sr(8, 8))
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    let before = res_counts(&dev)["mr"];
    for i in 0..8 {
        let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        qp.post_recv(RecvWr::new(i, mr)).unwrap();
    }
    assert_eq!(res_counts(&dev)["mr"], before + 8);
    drop(qp);
    // Nobody polled the CQ: the registrations are gone all the same.
    assert_eq!(res_counts(&dev)["mr"], before);
    drop(cq);
}

#[test]
fn completions_of_a_destroyed_qp_come_back_stale() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |_, _, b| {
        b.post_recv_list((0..4).map(RecvWr::empty)).unwrap();
    });
    let src = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap().freeze();
    for i in 0..4 {
        p.a.post_send(SendWr::send_from(i, src.clone())).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    let a_qpn = p.a.qp_num();
    let reserved = p.cq_a.reserved();
    drop(p.a);
    let src = src
        .try_unfreeze()
        .expect("the destroyed QP released its buffers before any poll");
    let got = wait(&mut p.cq_a, 4);
    for c in &got {
        assert_eq!(c.source, CompletionSource::Stale, "{c:?}");
        assert_eq!(c.qp_num, a_qpn);
        assert!(c.buffers().is_empty());
    }
    let mut out = Vec::with_capacity(4);
    assert_eq!(p.cq_a.poll(&mut out).unwrap(), 0);
    assert_eq!(p.cq_a.reserved(), reserved - 16, "its CQ entries came back");
    drop(src);
}

#[test]
fn foreign_wr_ids_are_never_dereferenced() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |_, _, b| {
        b.post_recv_list((0..8).map(RecvWr::empty)).unwrap();
    });
    // A safe completion first, so that its token's tag is known.
    p.a.post_send(SendWr::send(7)).unwrap();
    let ok = wait(&mut p.cq_a, 1);
    assert_eq!(ok[0].source, CompletionSource::Posted);
    // Raw posts on the same QP with wr_ids that look like pointers, like
    // nothing, or like one of the ring's own tokens for a request that does
    // not exist. The old design dereferenced every wr_id as a slot address.
    let heap = Box::into_raw(Box::new(0u64)) as u64;
    // wr_ids with bit 63 set (the safe path's marker) are refused at post.
    for id in [u64::MAX, 0xdead_beef_dead_beef] {
        let mut wr = ffi::ibv_send_wr {
            wr_id: id,
            opcode: ffi::IBV_WR_SEND,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        // SAFETY: no SGEs; refused before the verb.
        let r = unsafe { p.a.post_send_raw(&mut wr) };
        assert!(
            matches!(r, Err(Error::InvalidArgument { what: "wr_id", .. })),
            "{r:?}"
        );
    }
    let bogus = [0, 1, 0x7fff_ffff_ffff_ffff, heap, heap + 8];
    for (i, id) in bogus.iter().enumerate() {
        let mut wr = ffi::ibv_send_wr {
            wr_id: *id,
            opcode: ffi::IBV_WR_SEND,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        // SAFETY: no SGEs; the ring's depth is respected (one at a time, each
        // polled before the next).
        unsafe { p.a.post_send_raw(&mut wr) }.unwrap();
        let c = wait(&mut p.cq_a, 1);
        assert_eq!(c[0].wr_id, *id, "#{i}");
        assert_ne!(c[0].source, CompletionSource::Posted, "#{i}: {:?}", c[0]);
        assert!(c[0].buffers().is_empty());
        assert_eq!(c[0].status, WcStatus::Success);
    }
    // SAFETY: allocated above, never shared.
    drop(unsafe { Box::from_raw(heap as *mut u64) });
    // The safe path goes on as if nothing happened.
    p.a.post_send(SendWr::send(8)).unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].source), (8, CompletionSource::Posted));
    wait(&mut p.cq_b, 7);
}

#[test]
fn failed_completions_report_what_was_posted() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |pd, _, b| {
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(RecvWr::new(9, mr)).unwrap();
    });
    // A successful SEND: the sender's completion has no length (providers
    // do not report one); the receiver's has the exact length.
    let mut src = p.pd.alloc_mr(40, AccessFlags::empty()).unwrap();
    src.fill(0x5a).unwrap();
    p.a.post_send(SendWr::send_from(1, src)).unwrap();
    let s = wait(&mut p.cq_a, 1);
    assert_eq!(
        (s[0].opcode, s[0].byte_len, s[0].src_qp),
        (WcOpcode::Send, 0, 0)
    );
    assert_eq!(s[0].vendor_err, 0);
    let mut r = wait(&mut p.cq_b, 1);
    assert_eq!((r[0].opcode, r[0].byte_len), (WcOpcode::Recv, 40));
    assert_eq!(r[0].take_mr().unwrap().to_vec().unwrap()[..40], [0x5a; 40]);
    // A WRITE with a wrong rkey fails; the completion still says WRITE.
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let mut bad = target.remote();
    bad.rkey ^= 0x5555;
    let src = p.pd.alloc_mr(8, AccessFlags::empty()).unwrap();
    p.a.post_send(SendWr::write_from(2, src, bad, 0)).unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::RemAccessErr);
    assert_eq!(c[0].opcode, WcOpcode::RdmaWrite, "{:?}", c[0]);
    assert_eq!((c[0].byte_len, c[0].wc_flags, c[0].imm_data), (0, 0, None));
    assert_eq!(c[0].take_buffers().len(), 1, "the source comes back");
}

// --- Provider behaviour the soundness argument relies on (qp module docs) ---

#[test]
fn each_queue_completes_in_posting_order() {
    let _g = serial();
    let mut p = pair_with(caps_sr(64, 64), |_, _, b| {
        b.post_recv_list((0..64).map(RecvWr::empty)).unwrap();
    });
    p.a.post_send_list((0..64).map(SendWr::send)).unwrap();
    let sends: Vec<u64> = wait(&mut p.cq_a, 64).iter().map(|c| c.wr_id).collect();
    let recvs: Vec<u64> = wait(&mut p.cq_b, 64).iter().map(|c| c.wr_id).collect();
    let expected: Vec<u64> = (0..64).collect();
    assert_eq!(sends, expected);
    assert_eq!(recvs, expected);
}

#[test]
fn the_error_state_flushes_every_posted_request() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut cq = Cq::new(&ctx, 64).unwrap();
    let mut qp = Qp::new(&pd, &cq, &cq, caps_sr(8, 16))
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    for i in 0..16 {
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        qp.post_recv(RecvWr::new(i, mr)).unwrap();
    }
    let qp = qp.to_error().unwrap();
    let mut got = wait(&mut cq, 16);
    for (i, c) in got.iter_mut().enumerate() {
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::WrFlushErr));
        assert_eq!(c.opcode, WcOpcode::Recv);
        assert_eq!(c.take_mr().map(|m| m.len()), Some(64));
    }
    assert!(drain(&mut cq, Duration::from_millis(200)).is_empty());
    drop(qp);
}

#[test]
fn no_completion_arrives_after_destroy_returns() {
    let _g = serial();
    let mut p = pair_with(caps_sr(64, 64), |_, _, b| {
        b.post_recv_list((0..64).map(RecvWr::empty)).unwrap();
    });
    let a_qpn = p.a.qp_num();
    // Destroy with work in flight; whatever completions were generated before
    // are in the CQ now, and nothing may follow.
    p.a.post_send_list((0..64).map(SendWr::send)).unwrap();
    drop(p.a);
    let first = drain(&mut p.cq_a, Duration::from_millis(300));
    assert!(first.len() <= 64);
    assert!(first.iter().all(|c| c.qp_num == a_qpn));
    std::thread::sleep(Duration::from_millis(500));
    let later = drain(&mut p.cq_a, Duration::from_millis(300));
    assert!(later.is_empty(), "completions after destroy: {later:?}");
}

#[test]
fn reset_needs_a_drained_qp() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut cq = Cq::new(&ctx, 64).unwrap();
    let mut qp = Qp::new(&pd, &cq, &cq, caps_sr(8, 8))
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    for i in 0..3 {
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        qp.post_recv(RecvWr::new(i, mr)).unwrap();
    }
    if common::iwarp(&ctx) {
        // No way back to RESET on iWARP (siw would stay in ERR and strand later
        // receives): refused with the QP back, which still flushes in ERR.
        let (qp, refused) = match qp.reset() {
            Err(e) => (e.qp, e.error),
            Ok(_) => panic!("reset on iWARP"),
        };
        assert!(
            matches!(
                refused,
                Error::Unsupported {
                    verb: "ibv_modify_qp(RESET)",
                    ..
                }
            ),
            "{refused:?}"
        );
        let qp = qp.to_error().unwrap();
        assert_eq!(wait(&mut cq, 3).len(), 3);
        drop(qp);
        panic!("{refused}");
    }
    // RESET may or may not discard posted receives (provider-specific), so
    // the buffers could not be accounted for: refused, QP handed back.
    let qp = match qp.reset() {
        Err(e) => {
            assert!(
                matches!(
                    e.error,
                    Error::WorkOutstanding {
                        queue: "receive",
                        count: 3
                    }
                ),
                "{}",
                e.error
            );
            e.qp
        }
        Ok(_) => panic!("reset with outstanding receives"),
    };
    // The documented way: ERR, poll the flushes, then RESET, and reuse it.
    let qp = qp.to_error().unwrap();
    assert_eq!(wait(&mut cq, 3).len(), 3);
    let qp = qp.reset().expect("reset of a drained QP");
    let mut qp = qp.init(InitAttr::new(1, all_remote())).unwrap();
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    qp.post_recv(RecvWr::new(42, mr)).unwrap();
    let qp = qp.to_error().unwrap();
    let c = wait(&mut cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (42, WcStatus::WrFlushErr));
    drop(qp);
}

#[test]
fn a_pair_still_talks_after_all_of_this() {
    let _g = serial();
    let mut p = pair(caps_sr(4, 4));
    let mr = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.post_recv(RecvWr::new(1, mr)).unwrap();
    p.a.post_send(SendWr::send(2)).unwrap();
    assert_eq!(wait(&mut p.cq_a, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&mut p.cq_b, 1)[0].byte_len, 0);
}

/// A raw `wr_id` equal to a token must never retire a safe request still in
/// flight (its buffer would come back while the NIC still reads it): tokens
/// have bit 63 set and raw posts must leave it clear.
#[test]
fn a_raw_wr_id_never_retires_a_safe_request_in_flight() {
    let _g = serial();
    let mut p = pair_with(caps_sr(4, 4), |pd, _, b| {
        // One receive only: consumed by the raw SEND.
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(RecvWr::new(100, mr)).unwrap();
    });
    let raw = |wr_id| ffi::ibv_send_wr {
        wr_id,
        opcode: ffi::IBV_WR_SEND,
        send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
        ..Default::default()
    };
    // A wr_id with the reserved bit is refused before the NIC sees it.
    let mut bad = raw(rdma_verbs::qp::RAW_WR_ID_RESERVED | 5);
    // SAFETY: no SGEs; a single request.
    match unsafe { p.a.post_send_raw(&mut bad) } {
        Err(Error::InvalidArgument { what: "wr_id", .. }) => {}
        other => panic!("expected the reserved bit to be refused, got {other:?}"),
    }
    let mut wr = raw(0);
    // SAFETY: no SGEs; 2 requests in flight <= max_send_wr.
    unsafe { p.a.post_send_raw(&mut wr) }.unwrap();
    let mut src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    src.fill(0xaa).unwrap();
    // No receive left at b: this SEND waits in RNR retry.
    p.a.post_send(SendWr::send_from(77, src)).unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].source), (0, CompletionSource::Foreign));
    assert!(c[0].buffers().is_empty());
    assert_eq!(
        p.a.outstanding(),
        (1, 0),
        "the safe SEND is still in flight"
    );
    // Let it go: the peer gets the bytes that were posted.
    let dst = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.post_recv(RecvWr::new(101, dst)).unwrap();
    let mut got = wait(&mut p.cq_b, 2);
    assert_eq!(got[1].take_mr().unwrap().to_vec().unwrap(), [0xaa; 64]);
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].source), (77, CompletionSource::Posted));
    assert_eq!(c[0].buffers().len(), 1);
}

/// When `poll_raw` consumed the drain marker, `reset` is not refused forever:
/// `to_error` again posts a new marker (whenever sends are outstanding), so
/// the documented recovery works.
#[test]
fn to_error_again_recovers_from_poll_raw_eating_the_marker() {
    let _g = serial();
    let mut p = pair_with(caps_sr(4, 4), |_, _, b| {
        b.post_recv_list((0..4).map(RecvWr::empty)).unwrap();
    });
    p.a.post_send(SendWr::send(1).signaled(false)).unwrap();
    wait(&mut p.cq_b, 1);
    let qp = p.a.to_error().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut wcs = [ffi::ibv_wc::default(); 8];
    assert_eq!(
        p.cq_a.poll_raw(&mut wcs).unwrap(),
        1,
        "the marker's completion"
    );
    assert_eq!(qp.outstanding(), (2, 0));
    let qp = qp.to_error().unwrap();
    let mut out = Vec::with_capacity(8);
    let end = std::time::Instant::now() + WAIT;
    while qp.outstanding() != (0, 0) && std::time::Instant::now() < end {
        match p.cq_a.poll(&mut out) {
            // The second marker sweeps the first, whose completion poll_raw took.
            Ok(_) | Err(Error::CompletionsLost { count: 1 }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    assert!(out.is_empty(), "markers are not handed out: {out:?}");
    assert!(qp.reset().is_ok(), "reset after the recovery");
}

// A buffer whose `Drop` panics (an application's `OwnedMemory`) while a poll
// retires its request: what the CQ still reports and holds after the panic
// has gone on to the caller.

/// A poll that finds requests lost to `poll_raw` and retires a buffer that
/// panics reports the loss at its next poll, after the panic.
#[test]
fn a_loss_found_by_a_poll_that_panics_is_reported_by_the_next() {
    let _g = serial();
    let mut p = pair_with(caps_sr(8, 8), |pd, _, b| {
        for i in 0..2 {
            let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            b.post_recv(RecvWr::new(i, buf)).unwrap();
        }
    });
    let panicky = Mr::register(
        &p.pd,
        common::PanicsInDrop(vec![7; 64]),
        AccessFlags::empty(),
    )
    .unwrap();
    p.a.post_send(SendWr::send_from(1, panicky)).unwrap();
    // poll_raw takes the first completion: its request, and the buffer,
    // stay in the ring until a later completion sweeps them as lost.
    let mut raw = [ffi::ibv_wc::default(); 4];
    let start = Instant::now();
    while p.cq_a.poll_raw(&mut raw).unwrap() == 0 {
        assert!(start.elapsed() < WAIT, "the first SEND never completed");
    }
    assert_eq!(raw[0].status, ffi::IBV_WC_SUCCESS);
    p.a.post_send(SendWr::send(2)).unwrap();
    let mut out = Vec::with_capacity(8);
    let start = Instant::now();
    let panicked = loop {
        match catch_unwind(AssertUnwindSafe(|| p.cq_a.poll(&mut out))) {
            Err(_) => break true,
            Ok(Ok(0)) if start.elapsed() < WAIT => continue,
            Ok(other) => panic!("expected the buffer's panic, got {other:?}"),
        }
    };
    assert!(panicked);
    assert_eq!(out.len(), 1, "the second SEND's completion was read");
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    let mut more = Vec::with_capacity(8);
    match p.cq_a.poll(&mut more) {
        Err(Error::CompletionsLost { count: 1 }) => {}
        other => panic!("expected the loss of one completion, got {other:?}"),
    }
    assert!(matches!(p.cq_a.poll(&mut more), Ok(0)));
}

/// Completions a scope kept for the next poll, one with a buffer that panics,
/// are dropped with the CQ without the panic leaving `Drop`.
#[test]
fn dropping_a_cq_contains_the_panic_of_a_kept_completions_buffer() {
    let _g = serial();
    let mut p = pair(caps_sr(8, 1));
    let target = p.pd.alloc_mr(256, all_remote()).unwrap();
    let remote = target.remote();
    let panicky = Mr::register(
        &p.pd,
        common::PanicsInDrop(vec![7; 64]),
        AccessFlags::empty(),
    )
    .unwrap();
    p.a.post_send(SendWr::write_from(11, panicky, remote, 64))
        .unwrap();
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    // The scope's poll reads the earlier WRITE's completion too and keeps it,
    // with its buffer, for the CQ's next poll.
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(1, s_src, remote, 128))?;
            common::scope_poll_n(s, 1)
        })
        .expect("the scoped WRITE");
    assert_eq!(got.len(), 1);
    let common::Pair { cq_a, a, .. } = p;
    let dropped = catch_unwind(AssertUnwindSafe(move || drop(cq_a)));
    assert!(dropped.is_ok(), "the panic left Cq's drop");
    drop(a);
}
