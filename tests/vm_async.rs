//! The tokio integration (`rdma_verbs::tokio`, feature `tokio`) on soft-RoCE:
//! awaited operations with data verified, cancel safety under firing
//! timeouts with every buffer accounted, a dropped `AsyncCq` failing its
//! waiters instead of hanging, CQ views and QP wrapping
//! (`tests/vm_async_cm.rs` has the runtimes, rdma_cm and async events).
mod common;

use common::async_pair::{AsyncPair, async_pair, async_pair_on, caps, mr_with, runtime};
use common::serial;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::{Duration, Instant};

use rdma_verbs::cq::{Completion, CompletionSource, WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{Qp, SendWr};
use rdma_verbs::tokio::{AsyncCq, AsyncQp};

/// SEND/RECV of 1 B to 16 KiB and WRITE then READ, all awaited, bytes
/// compared; the two CQs share one channel and driver task.
#[test]
fn awaited_operations_move_the_right_bytes() {
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        let p = async_pair_on(caps(16), true);
        let sizes = [1usize, 2, 63, 64, 1000, 4096, 16384];
        for (i, &len) in sizes.iter().enumerate() {
            let data = common::pattern(len, i as u8);
            let dest = p.pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
            let (got, sent) = tokio::join!(p.b.recv_into(dest), p.a.send(mr_with(&p.pd, &data)));
            let mut sent = sent.unwrap();
            assert_eq!(sent.status, WcStatus::Success);
            assert_eq!(sent.opcode, WcOpcode::Send);
            assert!(sent.take_mr().is_some(), "the send buffer comes back");
            let mut got = got.unwrap();
            got.result().unwrap();
            assert_eq!(got.opcode, WcOpcode::Recv);
            assert_eq!(got.byte_len as usize, len);
            assert_eq!(got.take_mr().unwrap().to_vec().unwrap(), data, "size {len}");
        }

        let len = 8192;
        let target = p.pd.alloc_mr(len, common::all_remote()).unwrap();
        let remote = target.remote();
        let data = common::pattern(len, 77);
        let w = p.a.write(mr_with(&p.pd, &data), remote, 0).await.unwrap();
        w.result().unwrap();
        assert_eq!(w.opcode, WcOpcode::RdmaWrite);
        let dest = p.pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
        let mut r = p.a.read(dest, remote, 0).await.unwrap();
        r.result().unwrap();
        assert_eq!(r.opcode, WcOpcode::RdmaRead);
        assert_eq!(r.take_mr().unwrap().to_vec().unwrap(), data);
        drop(target);
        assert_eq!(p.cq_a.unclaimed() + p.cq_b.unclaimed(), 0);
    });
}

/// Identity of a buffer: its address and key.
fn ident(mr: &Mr) -> (u64, u32) {
    (mr.addr(), mr.lkey())
}

/// Every buffer comes back exactly once, from the operation's future or, when
/// a timeout dropped the future after the post, from `AsyncCq::next`; the
/// data of every message is verified; MRs are back to baseline at the end.
#[test]
fn cancelled_operations_return_every_buffer_exactly_once() {
    let _g = serial();
    let dev = std::env::var("RDMA_VERBS_DEVICE").unwrap_or_else(|_| "rxe0".into());
    let before = common::res_counts(&dev);
    let rt = runtime();
    rt.block_on(async {
        const TASKS: usize = 4;
        const PER_TASK: usize = 150;
        const LEN: usize = 256;
        let depth = (TASKS * PER_TASK) as u32;
        let p = Arc::new(async_pair(caps(depth)));
        let posted = Arc::new(StdMutex::new(HashMap::<(u64, u32), &'static str>::new()));
        let back = Arc::new(StdMutex::new(Vec::<((u64, u32), Completion)>::new()));
        let mut timed_out = 0usize;

        // Receives first, each awaited with a timeout that fires (no message
        // yet): they stay posted and must come back through cq_b.next().
        for _ in 0..TASKS * PER_TASK {
            let mr = p.pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
            posted.lock().unwrap().insert(ident(&mr), "recv");
            let r = tokio::time::timeout(Duration::from_micros(1), p.b.recv_into(mr)).await;
            assert!(r.is_err(), "a receive completed with no message sent");
        }

        // Senders on several tasks, each SEND under a timeout between 0 and
        // ~200 us: some complete in time, the rest are dropped in flight.
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let (p, posted, back) = (p.clone(), posted.clone(), back.clone());
            tasks.push(tokio::spawn(async move {
                let mut dropped = 0usize;
                for i in 0..PER_TASK {
                    let seq = (t * PER_TASK + i) as u32;
                    let mut data = common::pattern(LEN, seq as u8);
                    data[..4].copy_from_slice(&seq.to_le_bytes());
                    let mr = mr_with(&p.pd, &data);
                    posted.lock().unwrap().insert(ident(&mr), "send");
                    let limit = Duration::from_micros((seq as u64 * 37) % 200);
                    match tokio::time::timeout(limit, p.a.send(mr)).await {
                        Ok(c) => {
                            let mut c = c.unwrap();
                            c.result().unwrap();
                            let mr = c.take_mr().expect("send buffer back");
                            back.lock().unwrap().push((ident(&mr), c));
                        }
                        Err(_) => dropped += 1,
                    }
                }
                dropped
            }));
        }
        for t in tasks {
            timed_out += t.await.unwrap();
        }

        // Everything dropped in flight comes back through next().
        let total = TASKS * PER_TASK;
        let sends_back = back.lock().unwrap().len();
        let mut seqs = Vec::new();
        let deadline = Duration::from_secs(30);
        for _ in 0..total - sends_back {
            let mut c = tokio::time::timeout(deadline, p.cq_a.next())
                .await
                .expect("a dropped send's completion")
                .unwrap();
            assert_eq!(c.source, CompletionSource::Posted);
            c.result().unwrap();
            let mr = c.take_mr().expect("buffer of a dropped send");
            back.lock().unwrap().push((ident(&mr), c));
        }
        for _ in 0..total {
            let mut c = tokio::time::timeout(deadline, p.cq_b.next())
                .await
                .expect("a dropped receive's completion")
                .unwrap();
            c.result().unwrap();
            assert_eq!(c.byte_len as usize, LEN);
            let mr = c.take_mr().expect("receive buffer");
            let bytes = mr.to_vec().unwrap();
            let seq = u32::from_le_bytes(bytes[..4].try_into().unwrap());
            let mut want = common::pattern(LEN, seq as u8);
            want[..4].copy_from_slice(&seq.to_le_bytes());
            assert_eq!(bytes, want, "message {seq}");
            seqs.push(seq);
            back.lock().unwrap().push((ident(&mr), c));
        }
        seqs.sort_unstable();
        assert_eq!(seqs, (0..total as u32).collect::<Vec<_>>(), "every message once");

        let mut returned: Vec<(u64, u32)> = back.lock().unwrap().iter().map(|x| x.0).collect();
        returned.sort_unstable();
        let n = returned.len();
        returned.dedup();
        assert_eq!(returned.len(), n, "a buffer came back twice");
        let mut want: Vec<(u64, u32)> = posted.lock().unwrap().keys().copied().collect();
        want.sort_unstable();
        assert_eq!(returned, want, "every posted buffer back");
        assert!(
            timed_out > 0 && timed_out < total,
            "the timeouts should fire for some sends and not others: {timed_out} of {total}"
        );
        assert_eq!(p.cq_a.unclaimed() + p.cq_b.unclaimed(), 0);
        println!("cancel safety: {total} sends ({timed_out} dropped in flight), {total} receives (all dropped in flight): every buffer back once");
        back.lock().unwrap().clear();
    });
    drop(rt);
    let after = common::res_counts(&dev);
    for k in ["qp", "cq", "mr", "pd"] {
        assert_eq!(before.get(k), after.get(k), "{k} count after the test");
    }
}

/// More awaited WRITEs than the send queue holds (depth 4), on a
/// current-thread runtime: a window of 32 operations in one task (each
/// polled once when made, the oldest awaited) and 8 joined at once. Those
/// past the depth wait for room, none is refused or lost, each resolves with
/// its own completion (success, its own buffer back) and every byte lands.
#[test]
fn operations_beyond_the_queue_depth_wait_for_room() {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::Poll;

    let _g = serial();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let p = async_pair(caps(4));
        const N: usize = 32;
        const LEN: usize = 64;
        let target = p.pd.alloc_mr(N * LEN, common::all_remote()).unwrap();
        let remote = target.remote();
        let sources: Vec<Mr> = (0..N)
            .map(|i| mr_with(&p.pd, &common::pattern(LEN, i as u8)))
            .collect();
        let idents: Vec<(u64, u32)> = sources.iter().map(ident).collect();
        let mut ring = std::collections::VecDeque::new();
        let mut made = 0;
        let mut sources = sources.into_iter();
        let mut back = Vec::new();
        std::future::poll_fn(|cx| {
            loop {
                for src in sources.by_ref() {
                    let mut op = p.a.write(src, remote, (made * LEN) as u64);
                    made += 1;
                    assert!(Pin::new(&mut op).poll(cx).is_pending(), "posted, not done");
                    ring.push_back(op);
                }
                let Some(oldest) = ring.front_mut() else {
                    return Poll::Ready(());
                };
                match Pin::new(oldest).poll(cx) {
                    Poll::Ready(done) => {
                        ring.pop_front();
                        let mut c = done.unwrap();
                        assert_eq!(
                            (c.status, c.opcode),
                            (WcStatus::Success, WcOpcode::RdmaWrite)
                        );
                        back.push(ident(&c.take_mr().expect("its buffer comes back")));
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await;
        assert_eq!(
            back, idents,
            "each operation returned its own buffer, in order"
        );
        let want: Vec<u8> = (0..N).flat_map(|i| common::pattern(LEN, i as u8)).collect();
        assert_eq!(target.to_vec().unwrap(), want);

        let data: Vec<Vec<u8>> = (0..8).map(|i| common::pattern(LEN, 100 + i)).collect();
        let w = |i: usize| {
            p.a.write(mr_with(&p.pd, &data[i]), remote, (i * LEN) as u64)
        };
        let done = tokio::join!(w(0), w(1), w(2), w(3), w(4), w(5), w(6), w(7));
        for c in <[_; 8]>::from(done) {
            assert_eq!(c.unwrap().status, WcStatus::Success);
        }
        assert_eq!(target.to_vec().unwrap()[..8 * LEN], data.concat()[..]);
        assert_eq!(p.cq_a.unclaimed(), 0, "every completion went to its future");
    });
}

/// A future waiting on an `AsyncCq` that is dropped fails instead of hanging.
#[test]
fn dropping_the_async_cq_fails_its_waiters() {
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        let AsyncPair {
            pd,
            cq_a,
            cq_b,
            a,
            b,
        } = async_pair(caps(4));
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let waiter = tokio::spawn(async move { b.recv_into(mr).await.map(drop) });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished(), "nothing was sent: the receive waits");
        drop(cq_b);
        let r = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("the waiter must end once its AsyncCq is dropped")
            .unwrap();
        let e = r.expect_err("no completion can arrive any more");
        assert!(e.to_string().contains("driver stopped"), "{e}");
        drop((a, cq_a));
    });
}

/// A QP unwrapped and wrapped again goes on numbering its requests where
/// the first wrapper stopped: a completion of the first wrapper's request
/// that the driver has retired but not dispatched yet can never carry the
/// `wr_id` of the second wrapper's (were both numbered 1, a new write's future
/// could resolve with the old write's buffer).
#[test]
fn a_rewrapped_qp_continues_its_request_numbers() {
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        let p = async_pair(caps(4));
        let target = p.pd.alloc_mr(64, common::all_remote()).unwrap();
        let remote = target.remote();
        let w =
            p.a.write(mr_with(&p.pd, b"first"), remote, 0)
                .await
                .unwrap();
        w.result().unwrap();
        let first = w.wr_id;
        let a = AsyncQp::new(p.a.into_inner(), &p.cq_a, &p.cq_a)
            .map_err(|(e, _)| e)
            .unwrap();
        let w = a.write(mr_with(&p.pd, b"second"), remote, 8).await.unwrap();
        w.result().unwrap();
        assert!(w.wr_id > first, "{} after {first}", w.wr_id);
        let posted = a.post_send(SendWr::write_from(0, mr_with(&p.pd, b"third"), remote, 16));
        assert!(posted.unwrap() > w.wr_id);
        let mut c = p.cq_a.next().await.unwrap();
        c.result().unwrap();
        assert!(c.take_mr().is_some());
        assert_eq!(
            &target.to_vec().unwrap()[..21],
            b"first\0\0\0second\0\0third"
        );
    });
}

/// `AsyncCq::cq()` is a view, not a lock: two in one expression create a
/// QP (this deadlocked when it was a lock guard: a new user's first
/// attempt), and a view kept across an `.await` on a current-thread
/// runtime, or forgotten, holds up neither the driver nor `AsyncQp::new`.
#[test]
fn cq_views_hold_up_nothing() {
    let _g = serial();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let p = async_pair(caps(4));
        // On another thread, so that a deadlock fails the test instead of
        // hanging it.
        let ctx = p.pd.context().clone();
        let cq = Arc::new(AsyncCq::new(&ctx, 64).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let cq2 = cq.clone();
        std::thread::spawn(move || {
            let pd = Pd::new(&ctx).unwrap();
            let _ = tx.send(Qp::new(&pd, &cq2.cq(), &cq2.cq(), caps(4)).map(drop));
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("Qp::new with two views in one expression returns")
            .unwrap();

        let target = p.pd.alloc_mr(64, common::all_remote()).unwrap();
        let remote = target.remote();
        let view = p.cq_a.cq();
        let mut c = tokio::time::timeout(
            Duration::from_secs(10),
            p.a.write(mr_with(&p.pd, b"held"), remote, 0),
        )
        .await
        .expect("the completion does not wait for the view")
        .unwrap();
        c.result().unwrap();
        assert_eq!(c.take_mr().unwrap().to_vec().unwrap(), b"held");
        assert_eq!(&target.to_vec().unwrap()[..4], b"held");
        assert_eq!(view.depth(), p.cq_a.cq().depth());
        // Rewrapping checks the QP under the driver's lock: accepted while
        // views live (one of them forgotten).
        std::mem::forget(p.cq_a.cq());
        let a = AsyncQp::new(p.a.into_inner(), &p.cq_a, &p.cq_a)
            .map_err(|(e, _)| e)
            .unwrap();
        let c = tokio::time::timeout(
            Duration::from_secs(10),
            a.write(mr_with(&p.pd, b"again"), remote, 8),
        )
        .await
        .expect("a forgotten view holds up nothing")
        .unwrap();
        c.result().unwrap();
        assert_eq!(&target.to_vec().unwrap()[8..13], b"again");
        drop(view);
    });
}

/// Two threads wrapping QPs whose send and receive CQs are the same two
/// `AsyncCq`s in opposite roles: `AsyncQp::new` takes the CQs' locks in one
/// order, so neither waits for the other (each held one and timed out on
/// the other after 2 s).
#[test]
fn wrapping_qps_on_crossed_cqs_from_two_threads_never_waits() {
    let _g = serial();
    let rt = runtime();
    let _enter = rt.enter();
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (x, y) = (
        Arc::new(AsyncCq::new(&ctx, 64).unwrap()),
        Arc::new(AsyncCq::new(&ctx, 64).unwrap()),
    );
    let threads: Vec<_> = [(x.clone(), y.clone()), (y, x)]
        .into_iter()
        .map(|(s, r)| {
            let pd = pd.clone();
            std::thread::spawn(move || {
                for _ in 0..300 {
                    let qp = Qp::new(&pd, &s.cq(), &r.cq(), caps(1)).unwrap();
                    let t = Instant::now();
                    AsyncQp::new(qp, &s, &r).map_err(|(e, _)| e).unwrap();
                    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// Resizing a CQ (`Cq::resize`, which QP creation also runs when a CQ is too
/// small) from another thread while the driver task polls it and traffic
/// flows: 200 messages of 64 B come through whole, in order, none lost,
/// while both CQs are resized over and over between their reserved
/// entries and 1024.
#[test]
fn resizing_while_the_driver_polls_loses_nothing() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let _g = serial();
    let rt = runtime();
    let p = Arc::new(rt.block_on(async { async_pair(caps(16)) }));
    let stop = Arc::new(AtomicBool::new(false));
    let resizes = Arc::new(AtomicU64::new(0));
    let resizer = {
        let (p, stop, resizes) = (p.clone(), stop.clone(), resizes.clone());
        std::thread::spawn(move || {
            let mut big = true;
            while !stop.load(Ordering::Relaxed) {
                for cq in [&p.cq_a, &p.cq_b] {
                    let cq = cq.cq();
                    let want = if big { 1024 } else { cq.reserved() as u32 };
                    let got = cq.resize(want).expect("resize");
                    assert!(got >= want && u64::from(got) >= cq.reserved());
                    resizes.fetch_add(1, Ordering::Relaxed);
                }
                big = !big;
            }
        })
    };
    rt.block_on(async {
        for i in 0..200u32 {
            let data = common::pattern(64, i as u8);
            let dest = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            let (got, sent) = tokio::join!(p.b.recv_into(dest), p.a.send(mr_with(&p.pd, &data)));
            assert_eq!(sent.unwrap().status, WcStatus::Success, "message {i}");
            let mut got = got.unwrap();
            assert_eq!(
                (got.status, got.byte_len),
                (WcStatus::Success, 64),
                "message {i}"
            );
            assert_eq!(
                got.take_mr().unwrap().to_vec().unwrap(),
                data,
                "message {i}"
            );
        }
    });
    stop.store(true, Ordering::Relaxed);
    resizer.join().unwrap();
    let n = resizes.load(Ordering::Relaxed);
    assert!(n >= 100, "only {n} resizes ran during the traffic");
    assert_eq!(p.cq_a.unclaimed() + p.cq_b.unclaimed(), 0);
}

/// A stream without futures: receives and SENDs posted with `post_recv` /
/// `post_send`, their completions taken in batches by `next_batch`: never
/// more than `max`, never none, each with its buffer, in posting order, the
/// bytes of every message where its receive landed; a `next_batch` that
/// times out before anything completed moves nothing.
#[test]
fn next_batch_takes_a_stream_of_completions_in_batches() {
    const MSGS: usize = 12;
    const LEN: usize = 100;
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        let p = async_pair(caps(16));
        let mut none = Vec::new();
        assert_eq!(p.cq_a.next_batch(&mut none, 0).await.unwrap(), 0);
        let waited =
            tokio::time::timeout(Duration::from_millis(50), p.cq_a.next_batch(&mut none, 4));
        assert!(waited.await.is_err(), "nothing posted, nothing to take");
        assert!(none.is_empty());

        let recv_ids: Vec<u64> = (0..MSGS)
            .map(|_| {
                let dest = p.pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
                p.b.post_recv(rdma_verbs::qp::RecvWr::new(0, dest)).unwrap()
            })
            .collect();
        let send_ids: Vec<u64> = (0..MSGS)
            .map(|k| {
                let src = mr_with(&p.pd, &common::pattern(LEN, k as u8));
                p.a.post_send(SendWr::send_from(0, src).signaled(true))
                    .unwrap()
            })
            .collect();

        let deadline = Duration::from_secs(10);
        let mut sent = Vec::new();
        while sent.len() < MSGS {
            let before = sent.len();
            let n = tokio::time::timeout(deadline, p.cq_a.next_batch(&mut sent, 5))
                .await
                .expect("the SENDs complete")
                .unwrap();
            assert!(
                (1..=5).contains(&n),
                "{n} completions in one batch of at most 5"
            );
            assert_eq!(sent.len(), before + n);
        }
        for (c, id) in sent.iter_mut().zip(&send_ids) {
            c.result().unwrap();
            assert_eq!((c.opcode, c.wr_id), (WcOpcode::Send, *id));
            assert!(c.take_mr().is_some(), "the SEND's buffer comes back");
        }

        let mut got = Vec::new();
        while got.len() < MSGS {
            tokio::time::timeout(deadline, p.cq_b.next_batch(&mut got, 64))
                .await
                .expect("the receives complete")
                .unwrap();
        }
        for (k, (c, id)) in got.iter_mut().zip(&recv_ids).enumerate() {
            c.result().unwrap();
            assert_eq!(
                (c.opcode, c.wr_id, c.byte_len as usize),
                (WcOpcode::Recv, *id, LEN)
            );
            let data = c.take_mr().unwrap().to_vec().unwrap();
            assert_eq!(data, common::pattern(LEN, k as u8), "message {k}");
        }
        assert_eq!(p.cq_a.unclaimed() + p.cq_b.unclaimed(), 0);
    });
}

/// Polls `f` once (an operation posts its request on its first poll).
async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) {
    std::future::poll_fn(|cx| {
        let _ = std::pin::Pin::new(&mut *f).poll(cx);
        std::task::Poll::Ready(())
    })
    .await;
}

/// An unsignaled SEND whose buffer panics in `Drop` is retired by the
/// driver's poll: the panic is reported by the CQ's `try_next`, and the
/// driver goes on serving both CQs of its channel (the awaited send and
/// receives, and a later send, complete).
#[test]
fn a_buffer_that_panics_in_drop_does_not_stop_the_driver() {
    let _g = serial();
    runtime().block_on(async {
        let p = async_pair_on(caps(16), true);
        let recv = || {
            p.b.recv_into(p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap())
        };
        let (mut r1, mut r2, mut r3) = (recv(), recv(), recv());
        for r in [&mut r1, &mut r2, &mut r3] {
            poll_once(r).await;
        }
        let panicky = Mr::register(
            &p.pd,
            common::PanicsInDrop(vec![7; 64]),
            AccessFlags::LOCAL_WRITE,
        )
        .unwrap();
        p.a.post_send(SendWr::send_from(0, panicky).signaled(false))
            .unwrap();
        let wait = Duration::from_secs(10);
        let sent = tokio::time::timeout(wait, p.a.send(mr_with(&p.pd, b"hello")))
            .await
            .expect("the driver goes on")
            .unwrap();
        assert_eq!(sent.status, WcStatus::Success);
        let (c1, c2) = tokio::time::timeout(wait, async { (r1.await.unwrap(), r2.await.unwrap()) })
            .await
            .expect("the other CQ is served");
        assert_eq!(
            (c1.status, c1.byte_len, c2.status, c2.byte_len),
            (WcStatus::Success, 64, WcStatus::Success, 5)
        );
        match p.cq_a.try_next() {
            Err(rdma_verbs::Error::Other(why)) => assert!(why.contains("panicked"), "{why}"),
            other => panic!("expected the panic's report, got {other:?}"),
        }
        let again = tokio::time::timeout(wait, p.a.send(mr_with(&p.pd, b"again")))
            .await
            .expect("later sends complete")
            .unwrap();
        assert_eq!(again.status, WcStatus::Success);
        let c3 = tokio::time::timeout(wait, r3).await.unwrap().unwrap();
        assert_eq!((c3.status, c3.byte_len), (WcStatus::Success, 5));
    });
}

/// A posted receive whose future is forgotten keeps its waiter slot only
/// while its `AsyncQp` lives. Unwrapped, the QP's outstanding receive
/// completes through `AsyncCq::next`, as `into_inner` promises, and a later
/// plain receive with the same `wr_id` is not taken for it.
#[test]
fn a_forgotten_operation_completes_through_next_once_unwrapped() {
    let _g = serial();
    runtime().block_on(async {
        let p = async_pair(caps(4));
        let mut forgotten =
            p.b.recv_into(p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap());
        poll_once(&mut forgotten).await;
        std::mem::forget(forgotten);
        let mut b = p.b.into_inner();
        let wait = Duration::from_secs(10);
        let sent = p.a.send(mr_with(&p.pd, b"first")).await.unwrap();
        assert_eq!(sent.status, WcStatus::Success);
        let mut c = tokio::time::timeout(wait, p.cq_b.next())
            .await
            .expect("the forgotten receive's completion comes from next")
            .unwrap();
        assert_eq!((c.status, c.byte_len), (WcStatus::Success, 5));
        assert_eq!(&c.take_mr().unwrap().to_vec().unwrap()[..5], b"first");

        let same = c.wr_id;
        let buf = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(rdma_verbs::qp::RecvWr::new(same, buf)).unwrap();
        let sent = p.a.send(mr_with(&p.pd, b"second")).await.unwrap();
        assert_eq!(sent.status, WcStatus::Success);
        let mut c = tokio::time::timeout(wait, p.cq_b.next())
            .await
            .expect("the plain receive's completion comes from next")
            .unwrap();
        assert_eq!((c.wr_id, c.byte_len), (same, 6));
        assert_eq!(&c.take_mr().unwrap().to_vec().unwrap()[..6], b"second");
    });
}

/// A request waiting for room in the send queue, polled with a waker that
/// panics, and another task's request waiting for room too: the completion
/// that frees the slot wakes the other task (the panic is contained, not
/// left to end the wake-up of the rest), the driver goes on, and dropping
/// the CQ does not panic.
#[test]
fn a_panicking_waker_waiting_for_room_strands_no_other_task() {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Wake, Waker};

    struct Panics;
    impl Wake for Panics {
        fn wake(self: Arc<Self>) {
            panic!("a waker panics");
        }
    }
    let _g = serial();
    runtime().block_on(async {
        let AsyncPair {
            pd,
            cq_a,
            cq_b,
            a,
            b,
        } = async_pair(caps(1));
        let a = Arc::new(a);
        let target = pd.alloc_mr(64, common::all_remote()).unwrap();
        let remote = target.remote();
        let wait = Duration::from_secs(10);
        // The queue's one slot, taken before the driver has run.
        let mut first = a.write(mr_with(&pd, &[1; 8]), remote, 0);
        poll_once(&mut first).await;
        let mut stuck = a.write(mr_with(&pd, &[2; 8]), remote, 8);
        let panics = Waker::from(Arc::new(Panics));
        let polled = Pin::new(&mut stuck).poll(&mut Context::from_waker(&panics));
        assert!(polled.is_pending(), "the queue is full: it waits for room");
        let other = tokio::spawn({
            let (a, src) = (a.clone(), mr_with(&pd, &[3; 8]));
            async move { a.write(src, remote, 16).await.map(|c| c.status) }
        });
        tokio::task::yield_now().await;
        assert!(!other.is_finished(), "the other task waits for room too");
        let c = tokio::time::timeout(wait, first).await.unwrap().unwrap();
        assert_eq!(c.status, WcStatus::Success);
        let status = tokio::time::timeout(wait, other)
            .await
            .expect("the other task is woken when the slot frees")
            .unwrap()
            .unwrap();
        assert_eq!(status, WcStatus::Success);
        drop(stuck);
        let again = tokio::time::timeout(wait, a.write(mr_with(&pd, &[4; 8]), remote, 24))
            .await
            .expect("the driver goes on")
            .unwrap();
        assert_eq!(again.status, WcStatus::Success);
        assert_eq!(
            &target.to_vec().unwrap()[16..32],
            &[[3u8; 8], [4; 8]].concat()[..]
        );
        drop((a, b, cq_b));
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(cq_a)));
        assert!(dropped.is_ok(), "dropping the CQ does not panic");
    });
}

/// A task whose future only its wakers own (as in executors whose tasks
/// live in their wakers): its future holds a posted receive and waits in
/// `AsyncCq::next`. Another caller of `next` replaces its waker, the last
/// one, so the task and its future are dropped right there, and the
/// receive's drop hands it back to the CQ, which must not be locked at
/// that moment (it was: a deadlock).
#[test]
fn a_replaced_waker_that_drops_a_task_does_not_deadlock_the_cq() {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Wake, Waker};

    type Task = StdMutex<Option<Pin<Box<dyn Future<Output = ()> + Send>>>>;
    struct OwnedByWakers(Task);
    impl Wake for OwnedByWakers {
        fn wake(self: Arc<Self>) {}
    }
    let _g = serial();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        runtime().block_on(async {
            let AsyncPair {
                pd,
                cq_a,
                cq_b,
                a,
                b,
            } = async_pair(caps(4));
            let (b, cq_b) = (Arc::new(b), Arc::new(cq_b));
            let mr = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
            let future = {
                let (b, cq_b) = (b.clone(), cq_b.clone());
                async move {
                    let mut recv = b.recv_into(mr);
                    let posted = Pin::new(&mut recv).poll(&mut Context::from_waker(Waker::noop()));
                    assert!(posted.is_pending(), "posted");
                    let _ = cq_b.next().await;
                    drop(recv);
                }
            };
            let task = Arc::new(OwnedByWakers(StdMutex::new(Some(Box::pin(future)))));
            let waker = Waker::from(task.clone());
            let polled = {
                let mut slot = task.0.lock().unwrap();
                let fut = slot.as_mut().unwrap();
                fut.as_mut().poll(&mut Context::from_waker(&waker))
            };
            assert!(polled.is_pending(), "waits in next");
            drop((waker, task));
            // Only `next`'s kept waker owns the task now: replacing it
            // drops the task, its future and its posted receive.
            let mut next = cq_b.next();
            let polled = Pin::new(&mut next).poll(&mut Context::from_waker(Waker::noop()));
            assert!(polled.is_pending());
            drop(next);
            // The CQ goes on: the abandoned receive takes a SEND, its
            // completion comes from `next`.
            let sent = tokio::time::timeout(Duration::from_secs(10), a.send(mr_with(&pd, b"hi")))
                .await
                .expect("the send completes")
                .unwrap();
            assert_eq!(sent.status, WcStatus::Success);
            let c = tokio::time::timeout(Duration::from_secs(10), cq_b.next())
                .await
                .expect("the abandoned receive completes through next")
                .unwrap();
            assert_eq!((c.status, c.byte_len), (WcStatus::Success, 2));
            drop((a, b, cq_a));
        });
        done_tx.send(()).unwrap();
    });
    done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the test finishes: no deadlock on the CQ's lock");
}
