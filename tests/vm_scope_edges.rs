//! Scoped borrowing at its edges: a drain timeout
//! too long to add to the clock, side entries of requests that were staged
//! but never posted (an iterator that panics half-way through a list), an
//! iterator that polls the scope while its list is being posted, scope polls
//! that meet a completion lost to `poll_raw`, and a QP asked for no send SGE.
//! Runs in the soft-RoCE guest.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::time::{Duration, Instant};

use common::{WAIT, all_remote, caps_sr, pair, pair_api, pattern, scope_poll_n, wait};
use rdma_verbs::Error;
use rdma_verbs::cq::{WcOpcode, WcStatus};
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::qp::scope::{Dst, PreparedSends, ScopedSend, Src};
use rdma_verbs::qp::{RecvWr, SendApi, SendWr};

/// `Duration::MAX` means no limit: the scope waits for its receive (which a
/// peer fills 300 ms later) instead of panicking on `Instant + Duration`,
/// which once ended the scope with the receive still posted.
#[test]
fn a_drain_timeout_of_duration_max_waits_for_the_receive() {
    let p = pair_api(caps_sr(4, 4), SendApi::Extended);
    let (pd, mut cq_a, mut cq_b, mut a, mut b) = (p.pd, p.cq_a, p.cq_b, p.a, p.b);
    let mut msg = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    msg.fill(0xab).unwrap();
    let peer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        b.post_send(SendWr::send_from(5, msg)).unwrap();
        let mut out = Vec::with_capacity(1);
        cq_b.poll_n(&mut out, 1, WAIT).unwrap();
        assert_eq!(out[0].status, WcStatus::Success);
        (b, cq_b)
    });
    let mut rbuf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let d = Dst::new(&mut rbuf).unwrap();
    let start = Instant::now();
    let qp = &mut a;
    cq_a.scope(|s| {
        s.set_drain_timeout(Duration::MAX);
        s.attach(qp)?.post_recv(1, d)
    })
    .expect("the scope waits for its receive");
    assert!(
        start.elapsed() >= Duration::from_millis(250),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(a.outstanding(), (0, 0));
    assert_eq!(rbuf.as_slice().unwrap(), &[0xab; 64][..]);
    peer.join().unwrap();
}

/// Without a drain limit, a receive posted after a failed request moved the
/// QP to the error state (which rxe does not flush until the QP is moved to
/// ERR again) does not hold the scope forever: once the wait has found the
/// QP in ERR with the receive still posted, the scope moves it to ERR again,
/// the receive is flushed, and the scope ends with `ScopeDrained`.
#[test]
fn a_drain_without_limit_ends_for_a_receive_posted_after_a_failure() {
    let p = pair(caps_sr(8, 8));
    let (pd, mut cq_b, mut b) = (p.pd, p.cq_b, p.b);
    let (done_tx, done) = std::sync::mpsc::channel();
    // On its own thread, so that a scope that never ends fails the test.
    std::thread::spawn(move || {
        let mut region = pd.alloc_mr(2 * 64, AccessFlags::LOCAL_WRITE).unwrap();
        let start = Instant::now();
        let r = cq_b.scope(|s| -> rdma_verbs::Result<()> {
            s.set_drain_timeout(Duration::MAX);
            let q = s.attach(&mut b)?;
            let mut bufs = q.buffers(&mut region, 64)?;
            let nowhere = rdma_verbs::mr::RemoteMr {
                addr: 0x10000,
                len: 4096,
                rkey: 0x1234,
            };
            bufs.post_write(0, 16, nowhere, 0, 1)?;
            let c = s.poll_one(WAIT)?;
            assert_ne!((c.wr_id, c.status), (1, WcStatus::Success));
            bufs.post_recv(1, 2)
        });
        let _ = done_tx.send((r, start.elapsed()));
    });
    let (r, took) = done
        .recv_timeout(Duration::from_secs(40))
        .expect("the scope ends");
    match r {
        Err(Error::ScopeDrained { outstanding: 1, .. }) => {}
        other => panic!("expected ScopeDrained with the receive outstanding, got {other:?}"),
    }
    assert!(took < Duration::from_secs(20), "{took:?}");
}

/// A receiver adopted in INIT posts a receive, then its connect fails: the
/// closure returns the error, and the drain without a limit does not wait
/// for the receive for ever (an INIT QP completes nothing): it flushes it
/// with a move to ERR and the scope returns the connect's error.
#[test]
fn a_drain_without_limit_ends_for_receives_on_a_qp_left_in_init() {
    use rdma_verbs::qp::{InitAttr, Qp};
    let (done_tx, done) = std::sync::mpsc::channel();
    // On its own thread, so that a scope that never ends fails the test.
    std::thread::spawn(move || {
        let ctx = common::ctx();
        let pd = rdma_verbs::pd::Pd::new(&ctx).unwrap();
        let mut cq = rdma_verbs::cq::Cq::new(&ctx, 16).unwrap();
        let other_cq = rdma_verbs::cq::Cq::new(&ctx, 16).unwrap();
        let init = |cq| {
            Qp::new(&pd, cq, cq, caps_sr(4, 4))
                .unwrap()
                .init(InitAttr::new(1, all_remote()))
                .unwrap()
        };
        let peer = init(&other_cq)
            .endpoint(Some(common::gid_index(&ctx)))
            .unwrap();
        let qp = init(&cq);
        let mut mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let start = Instant::now();
        let r = cq.scope_adopt(qp, |s, mut q| {
            s.set_drain_timeout(Duration::MAX);
            q.post_recv(1, Dst::new(&mut mr)?)?;
            // No such GID index: the move to RTR is refused.
            let q = q.connect(&peer, Some(200))?;
            Ok(((), q))
        });
        let _ = done_tx.send((r.map(drop), start.elapsed()));
    });
    let (r, took) = done
        .recv_timeout(Duration::from_secs(30))
        .expect("the scope ends");
    assert!(r.is_err(), "the connect failed");
    assert!(
        !matches!(r, Err(Error::ScopeDrained { .. })),
        "the closure's error comes first: {r:?}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
}

/// An iterator that panics after two requests: nothing of the list is
/// posted, and its side entries are taken back, so that a prepared list
/// posted over the same sequence numbers later reports its own `wr_id`s
/// and opcode (a stale entry once made a WRITE completion come back as the
/// panicked list's READ with its `wr_id`).
#[test]
fn a_panicking_list_leaves_no_side_entries_behind() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        panicking_list_leaves_nothing(api);
    }
}

fn panicking_list_leaves_nothing(api: SendApi) {
    let mut p = pair_api(caps_sr(16, 4), api);
    let remote_mr = p.pd.alloc_mr(4096, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut dst = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let (s_src, d_dst) = (Src::new(&src).unwrap(), Dst::new(&mut dst).unwrap());
    // Signaled at 1 and 3: the second completion lies inside the range.
    let list = PreparedSends::new(
        (0..4u64).map(|j| ScopedSend::write(0, s_src, remote, 64 * j).signaled(j % 2 == 1)),
    )
    .unwrap();
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            let panicked = catch_unwind(AssertUnwindSafe(|| {
                let _ = q.post_send_list((0..3u64).map(|i| {
                    if i == 2 {
                        resume_unwind(Box::new("the iterator panics"));
                    }
                    ScopedSend::read(100 + i, d_dst, remote, 0)
                }));
            }));
            assert!(panicked.is_err(), "{api:?}");
            assert_eq!(q.outstanding(), (0, 0), "{api:?}: nothing posted");
            q.post_prepared(&list, 7)?;
            scope_poll_n(s, 2)
        })
        .unwrap();
    let got: Vec<_> = got
        .iter()
        .map(|c| (c.wr_id, c.status, c.opcode, c.byte_len))
        .collect();
    let write = |wr_id| (wr_id, WcStatus::Success, WcOpcode::RdmaWrite, 0);
    assert_eq!(got, [write(8), write(10)], "{api:?}");
}

/// The list's iterator may poll the scope between requests: here it waits,
/// polling, until the queue of 8 has room for its next request (the
/// completions retire requests of the previous list). Every request is
/// posted once, each completion names its own, and the room the polls made
/// is seen by the list's capacity check.
#[test]
fn an_iterator_that_polls_the_scope_posts_every_request() {
    let mut p = pair_api(caps_sr(8, 4), SendApi::Extended);
    let remote_mr = p.pd.alloc_mr(4096, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    let mut ids = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            let mut seen: Vec<u64> = Vec::new();
            let mut polled = Vec::with_capacity(8);
            for round in 0..3u64 {
                q.post_send_list((0..8u64).map(|i| {
                    let k = round * 8 + i;
                    let end = Instant::now() + WAIT;
                    // Room for request k: requests up to k - 8 completed.
                    while seen.len() as u64 + 8 <= k {
                        assert!(Instant::now() < end, "{} completions", seen.len());
                        polled.clear();
                        s.poll(&mut polled).expect("poll inside the iterator");
                        seen.extend(polled.iter().map(|c| c.wr_id));
                    }
                    ScopedSend::write(k, s_src, remote, 64 * i)
                }))?;
            }
            let left = 24 - seen.len();
            seen.extend(scope_poll_n(s, left)?.iter().map(|c| {
                assert_eq!(
                    (c.status, c.opcode),
                    (WcStatus::Success, WcOpcode::RdmaWrite)
                );
                c.wr_id
            }));
            Ok(seen)
        })
        .unwrap();
    ids.sort_unstable();
    assert_eq!(ids, (0..24).collect::<Vec<_>>());
}

/// A pair whose `a` sent one SEND (to `b`, which has two receives posted)
/// whose completion `poll_raw` took: the CQ counts it as lost.
fn pair_with_a_lost_completion() -> common::Pair {
    let mut p = pair(caps_sr(8, 8));
    p.b.post_recv_list(
        (0..2).map(|i| RecvWr::new(i, p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap())),
    )
    .unwrap();
    p.a.post_send(SendWr::send(1)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut raw = [rdma_verbs::ffi::ibv_wc::default(); 4];
    assert_eq!(p.cq_a.poll_raw(&mut raw).unwrap(), 1);
    p
}

/// `Scope::poll_one` returns the scope's completion whose poll exposed the
/// loss of an earlier send's completion (taken by `poll_raw` before the
/// scope); the CQ's next poll after the scope reports the loss (the
/// completion is not dropped).
#[test]
fn scope_poll_one_keeps_its_completion_when_a_loss_shows() {
    let mut p = pair_with_a_lost_completion();
    let mut src = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"scoped and kept!").unwrap();
    let qp = &mut p.a;
    let c = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::send(77, Src::new(&src)?))?;
            s.poll_one(Duration::from_secs(10))
        })
        .expect("the scope's completion, not the loss");
    assert_eq!((c.wr_id, c.status), (77, WcStatus::Success));
    let mut out = Vec::with_capacity(4);
    match p.cq_a.poll(&mut out) {
        Err(Error::CompletionsLost { count: 1 }) => assert!(out.is_empty()),
        other => panic!("expected the deferred CompletionsLost, got {other:?}"),
    }
    let mut got = wait(&mut p.cq_b, 2);
    let second = got
        .iter_mut()
        .find(|c| c.byte_len == 16)
        .expect("the scoped send");
    assert_eq!(
        &second.take_mr().unwrap().to_vec().unwrap()[..16],
        b"scoped and kept!"
    );
}

/// `Scope::poll` returns the scope's completion found beside the loss of an
/// earlier send's completion (taken by `poll_raw` before the scope), and the
/// loss waits for the CQ's next poll after the scope (failing `poll` with
/// `CompletionsLost` while the completion is in `out` would let a `?` skip it).
#[test]
fn scope_poll_returns_its_completion_and_defers_a_loss() {
    let mut p = pair_with_a_lost_completion();
    let src = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::send(78, Src::new(&src)?))?;
            let mut out = Vec::with_capacity(4);
            let deadline = Instant::now() + Duration::from_secs(10);
            while out.is_empty() && Instant::now() < deadline {
                s.poll(&mut out)?;
            }
            Ok(out)
        })
        .expect("the scope's completion, not the loss");
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].wr_id, got[0].status), (78, WcStatus::Success));
    let mut out = Vec::with_capacity(4);
    match p.cq_a.poll(&mut out) {
        Err(Error::CompletionsLost { count: 1 }) => assert!(out.is_empty()),
        other => panic!("expected the deferred CompletionsLost, got {other:?}"),
    }
    wait(&mut p.cq_b, 2);
}

/// A QP asked for no send SGE gets one anyway (`QpCaps::max_send_sge` is
/// raised to 1): a scoped send on the extended API writes its SGE through
/// `ibv_wr_set_sge`, unchecked by the provider, into a WQE sized for none
/// (the QP would go to ERR with LOC_QP_OP_ERR).
#[test]
fn a_qp_asked_for_no_send_sge_takes_a_scoped_send() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        let caps = rdma_verbs::qp::QpCaps {
            max_send_sge: 0,
            ..caps_sr(8, 4)
        };
        let mut p = pair_api(caps, api);
        assert!(p.a.caps().max_send_sge >= 1, "{api:?}: {:?}", p.a.caps());
        let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(7, mr)).unwrap();
        let data = pattern(48, 9);
        let mut src = p.pd.alloc_mr(48, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_at(0, &data).unwrap();
        let qp = &mut p.a;
        let c = p
            .cq_a
            .scope(|s| {
                let mut q = s.attach(qp)?;
                q.post_send(&ScopedSend::send(5, Src::new(&src)?))?;
                s.poll_one(Duration::from_secs(10))
            })
            .unwrap();
        assert_eq!((c.wr_id, c.status), (5, WcStatus::Success), "{api:?}");
        let mut r = wait(&mut p.cq_b, 1);
        assert_eq!(
            &r[0].take_mr().unwrap().to_vec().unwrap()[..48],
            &data[..],
            "{api:?}"
        );
    }
}
