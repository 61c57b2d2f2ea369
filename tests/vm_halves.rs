//! A QP's send and receive halves posting from two threads at once
//! (`Qp::split`), and a scoped receiver that posts its receives before it
//! connects (`Cq::scope_adopt`). Runs in the soft-RoCE guest.

mod common;

use std::time::Instant;

use common::{all_remote, caps_sr, ctx, gid_index, pattern, scope_poll_n, wait};
use rdma_verbs::cq::{Cq, WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::scope::Dst;
use rdma_verbs::qp::{Init, InitAttr, Qp, QpCaps, Rc, RecvWr, Rts, SendWr};

/// Messages a scoped receiver takes after connecting in the scope.
const STARTUP_MSGS: usize = 1024;
/// Bytes per message of the start-up test.
const STARTUP_LEN: usize = 512;
/// Receives posted at a time (the first batch in INIT, before connecting).
const STARTUP_BATCH: usize = 16;

/// A QP in INIT on `cq` (both queues).
fn qp_init(pd: &Pd, cq: &Cq, caps: QpCaps) -> Qp<Rc, Init> {
    Qp::new(pd, cq, cq, caps)
        .expect("create qp")
        .init(InitAttr::new(1, all_remote()))
        .expect("init")
}

/// A scoped receiver adopts its QP in INIT, posts its first receives there,
/// connects inside the scope and takes every message through `Scope::poll`;
/// the QP comes back in RTS with nothing outstanding and keeps working.
#[test]
fn a_scoped_receiver_posts_before_connecting_and_connects_in_the_scope() {
    let ctx = ctx();
    let gid = gid_index(&ctx);
    let pd = Pd::new(&ctx).unwrap();
    let caps = caps_sr(STARTUP_BATCH as u32, STARTUP_BATCH as u32);
    let mut cq_a = Cq::new(&ctx, 64).unwrap();
    let mut cq_b = Cq::new(&ctx, 64).unwrap();
    let a = qp_init(&pd, &cq_a, caps);
    let b = qp_init(&pd, &cq_b, caps);
    let (ea, eb) = (
        a.endpoint(Some(gid)).unwrap(),
        b.endpoint(Some(gid)).unwrap(),
    );
    let mut a = a.connect(&eb, Some(gid)).unwrap();
    let mut big = pd
        .alloc_mr(STARTUP_MSGS * STARTUP_LEN, AccessFlags::LOCAL_WRITE)
        .unwrap();
    big.fill(0).unwrap();
    let dst = Dst::new(&mut big).unwrap();
    let slot = |i: usize| dst.slice(i * STARTUP_LEN, STARTUP_LEN).unwrap();
    let mut pool: Vec<Mr> = (0..STARTUP_BATCH)
        .map(|_| pd.alloc_mr(STARTUP_LEN, AccessFlags::LOCAL_WRITE).unwrap())
        .collect();
    let (sender, sender_cq) = (&mut a, &mut cq_a);
    let (count, b): (usize, Qp<Rc, Rts>) = cq_b
        .scope_adopt(b, |s, mut q| {
            for i in 0..STARTUP_BATCH {
                q.post_recv(i as u64, slot(i))?;
            }
            assert_eq!(q.outstanding(), (0, STARTUP_BATCH as u64));
            let mut q = q.connect(&ea, Some(gid))?;
            let mut got = 0;
            for batch in 0..STARTUP_MSGS / STARTUP_BATCH {
                for (k, mut m) in pool.drain(..).enumerate() {
                    let i = batch * STARTUP_BATCH + k;
                    m.write_at(0, &pattern(STARTUP_LEN, i as u8 ^ (i >> 8) as u8))?;
                    sender.post_send(SendWr::send_from(i as u64, m))?;
                }
                for c in scope_poll_n(s, STARTUP_BATCH)? {
                    assert_eq!(
                        (c.wr_id, c.status, c.opcode, c.byte_len),
                        (
                            got as u64,
                            WcStatus::Success,
                            WcOpcode::Recv,
                            STARTUP_LEN as u32
                        )
                    );
                    let next = got + STARTUP_BATCH;
                    if next < STARTUP_MSGS {
                        q.post_recv(next as u64, slot(next))?;
                    }
                    got += 1;
                }
                for mut c in wait(sender_cq, STARTUP_BATCH) {
                    c.result()?;
                    pool.push(c.take_mr().expect("the send's buffer"));
                }
            }
            Ok((got, q))
        })
        .unwrap();
    assert_eq!(count, STARTUP_MSGS);
    assert_eq!(b.outstanding(), (0, 0));
    let bytes = big.to_vec().unwrap();
    for (i, chunk) in bytes.chunks(STARTUP_LEN).enumerate() {
        assert_eq!(
            chunk,
            pattern(STARTUP_LEN, i as u8 ^ (i >> 8) as u8),
            "message {i}"
        );
    }
    // The QP came back typed RTS, and is: the ownership-passing path posts on it.
    let mut b = b;
    b.post_recv(RecvWr::new(
        9,
        pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let mut m = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    m.write_at(0, &pattern(64, 77)).unwrap();
    a.post_send(SendWr::send_from(1, m)).unwrap();
    let mut r = wait(&mut cq_b, 1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (9, WcStatus::Success, 64)
    );
    assert_eq!(r[0].take_mr().unwrap().to_vec().unwrap(), pattern(64, 77));
    wait(&mut cq_a, 1);
}

/// Messages each direction carries in the halves test.
const HALVES_MSGS: u32 = 10_000;
/// Bytes per message of the halves test.
const HALVES_LEN: usize = 256;
/// Queue depth of the halves test (and the sender's buffer pool).
const HALVES_DEPTH: u32 = 64;

/// The payload of message `i` of direction `dir`: its number, then a
/// pattern seeded by both.
fn message(dir: u8, i: u32) -> Vec<u8> {
    let mut m = pattern(HALVES_LEN, (i as u8).wrapping_mul(7) ^ dir);
    m[..4].copy_from_slice(&i.to_le_bytes());
    m[4] = dir;
    m
}

/// A send half's thread: posts every message of `dir` (through `post`) from
/// `pool`, taking each buffer back from the send CQ.
fn send_all(mut post: impl FnMut(SendWr<'static>), mut pool: Vec<Mr>, cq: &mut Cq, dir: u8) {
    let mut done = Vec::new();
    let (mut next, mut completed) = (0, 0);
    let deadline = Instant::now() + common::WAIT * 6;
    while completed < HALVES_MSGS {
        while next < HALVES_MSGS {
            let Some(mut m) = pool.pop() else { break };
            m.write_at(0, &message(dir, next)).unwrap();
            post(SendWr::send_from(u64::from(next), m).signaled(true));
            next += 1;
        }
        cq.poll(&mut done).unwrap();
        for mut c in done.drain(..) {
            assert_eq!(
                (c.wr_id, c.status),
                (u64::from(completed), WcStatus::Success)
            );
            pool.push(c.take_mr().expect("the send's buffer"));
            completed += 1;
        }
        assert!(Instant::now() < deadline, "sends stalled at {completed}");
    }
}

/// A receive half's thread: checks that every message of `dir` arrives
/// whole and in order, and posts each buffer again (through `post`) while
/// more are to come. Returns how many arrived.
fn recv_all(mut post: impl FnMut(RecvWr), cq: &mut Cq, dir: u8) -> u32 {
    let mut got = 0;
    let mut done = Vec::new();
    let deadline = Instant::now() + common::WAIT * 6;
    while got < HALVES_MSGS {
        cq.poll(&mut done).unwrap();
        for mut c in done.drain(..) {
            assert_eq!(
                (c.wr_id, c.status, c.byte_len),
                (u64::from(got), WcStatus::Success, HALVES_LEN as u32)
            );
            let m = c.take_mr().expect("the receive's buffer");
            assert_eq!(m.to_vec().unwrap(), message(dir, got), "message {got}");
            let next = got + HALVES_DEPTH;
            if next < HALVES_MSGS {
                post(RecvWr::new(u64::from(next), m));
            }
            got += 1;
        }
        assert!(Instant::now() < deadline, "receives stalled at {got}");
    }
    got
}

/// Buffers for a sender's pool.
fn pool(pd: &Pd) -> Vec<Mr> {
    (0..HALVES_DEPTH / 2)
        .map(|_| pd.alloc_mr(HALVES_LEN, AccessFlags::LOCAL_WRITE).unwrap())
        .collect()
}

/// Each peer's QP is split: one thread posts its sends while another posts
/// its receives, with no lock around the QP, both directions at once; every
/// message arrives whole and in order. Peer `a` is split by borrowing
/// (`split`, in `std::thread::scope`), peer `b` by value (`into_split`, in
/// spawned threads) and put back together (`reunite`); both end with
/// nothing outstanding.
#[test]
fn split_halves_post_sends_and_receives_from_two_threads() {
    let ctx = ctx();
    let gid = gid_index(&ctx);
    let pd = Pd::new(&ctx).unwrap();
    let caps = caps_sr(HALVES_DEPTH, HALVES_DEPTH);
    let cqs = || {
        let c = || Cq::new(&ctx, HALVES_DEPTH * 2).unwrap();
        (c(), c())
    };
    let ((mut sa, mut ra), (mut sb, mut rb)) = (cqs(), cqs());
    let mk = |scq: &Cq, rcq: &Cq| {
        Qp::new(&pd, scq, rcq, caps)
            .unwrap()
            .init(InitAttr::new(1, all_remote()))
            .unwrap()
    };
    let (mut a, mut b) = (mk(&sa, &ra), mk(&sb, &rb));
    for qp in [&mut a, &mut b] {
        let bufs = (0..HALVES_DEPTH).map(|i| {
            let mr = pd.alloc_mr(HALVES_LEN, AccessFlags::LOCAL_WRITE).unwrap();
            RecvWr::new(u64::from(i), mr)
        });
        qp.post_recv_list(bufs).unwrap();
    }
    let (ea, eb) = (
        a.endpoint(Some(gid)).unwrap(),
        b.endpoint(Some(gid)).unwrap(),
    );
    let mut a = a.connect(&eb, Some(gid)).unwrap();
    let b = b.connect(&ea, Some(gid)).unwrap();
    let (mut b_send, mut b_recv) = b.into_split();
    let b_pool = pool(&pd);
    let b_sender = std::thread::spawn(move || {
        send_all(|wr| b_send.post_send(wr).unwrap(), b_pool, &mut sb, 2);
        b_send
    });
    let b_receiver = std::thread::spawn(move || {
        let n = recv_all(|wr| b_recv.post_recv(wr).unwrap(), &mut rb, 1);
        (n, b_recv)
    });
    let (mut a_send, mut a_recv) = a.split();
    let a_pool = pool(&pd);
    let got_a = std::thread::scope(|t| {
        t.spawn(|| send_all(|wr| a_send.post_send(wr).unwrap(), a_pool, &mut sa, 1));
        let r = t.spawn(|| recv_all(|wr| a_recv.post_recv(wr).unwrap(), &mut ra, 2));
        r.join().unwrap()
    });
    assert_eq!((a_send.outstanding(), a_recv.outstanding()), (0, 0));
    let b_send = b_sender.join().unwrap();
    let (got_b, b_recv) = b_receiver.join().unwrap();
    assert_eq!((got_a, got_b), (HALVES_MSGS, HALVES_MSGS));
    let b: Qp<Rc, Rts> = b_send.reunite(b_recv).unwrap();
    assert_eq!((a.outstanding(), b.outstanding()), ((0, 0), (0, 0)));
    // Put back together, the QP changes state as a whole again.
    let b = b.to_error().unwrap();
    assert_eq!(b.outstanding(), (0, 0));
}

/// Requests a send list's iterator yields are built as they come, inside the
/// provider's critical region of the send queue (one per 32): the iterator
/// may poll the QP's CQ and post receives on the QP's receive half
/// meanwhile. From a request the builders cannot express (an inline SEND
/// here) on, the rest goes as C forms. Every send arrives with its bytes, in
/// order, and the receives the iterator posted take the peer's replies.
#[test]
fn a_send_lists_iterator_may_poll_and_post_receives_on_the_same_qp() {
    const N: u64 = 40;
    const INLINE_AT: u64 = 35;
    let caps = QpCaps {
        max_inline_data: 64,
        ..caps_sr(64, 64)
    };
    let mut p = common::pair_with(caps, |pd, _a, b| {
        for i in 0..N {
            let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            b.post_recv(RecvWr::new(i, mr)).unwrap();
        }
    });
    let pd = p.pd.clone();
    let inline = message(7, INLINE_AT as u32)[..16].to_vec();
    let (mut tx, mut rx) = p.a.split();
    let cq_a = &mut p.cq_a;
    let mut polled = Vec::new();
    let mut out = Vec::new();
    let list = (0..N).map(|i| {
        // Inside the send queue's region (before INLINE_AT): a poll of the
        // QP's CQ and a receive on its other queue.
        cq_a.poll(&mut out).unwrap();
        polled.append(&mut out);
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        rx.post_recv(RecvWr::new(100 + i, mr)).unwrap();
        if i == INLINE_AT {
            return SendWr::send_inline(i, &inline);
        }
        let mut src = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_at(0, &message(7, i as u32)[..16]).unwrap();
        SendWr::send_from(i, src)
    });
    tx.post_send_list(list).unwrap();
    let mut got = wait(&mut p.cq_b, N as usize);
    for (i, c) in got.iter_mut().enumerate() {
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
        let mr = c.take_mr().unwrap();
        assert_eq!(
            &mr.to_vec().unwrap()[..16],
            &message(7, i as u32)[..16],
            "message {i}"
        );
    }
    // The peer's replies land in the receives the iterator posted, in order.
    let replies = (0..N).map(|i| {
        let mut src = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        src.write_at(0, &i.to_le_bytes()).unwrap();
        SendWr::send_from(200 + i, src)
    });
    p.b.post_send_list(replies).unwrap();
    let mut all = polled;
    all.extend(wait(&mut p.cq_a, 2 * N as usize - all.len()));
    let (mut recvs, sends): (Vec<_>, Vec<_>) =
        all.into_iter().partition(|c| c.opcode == WcOpcode::Recv);
    let ids: Vec<u64> = sends.iter().map(|c| c.wr_id).collect();
    assert_eq!(
        ids,
        (0..N).collect::<Vec<_>>(),
        "the list's completions, in order"
    );
    assert!(sends.iter().all(|c| c.status == WcStatus::Success));
    assert_eq!(recvs.len(), N as usize);
    for (i, c) in recvs.iter_mut().enumerate() {
        assert_eq!((c.wr_id, c.status), (100 + i as u64, WcStatus::Success));
        let mr = c.take_mr().unwrap();
        assert_eq!(&mr.to_vec().unwrap()[..8], &(i as u64).to_le_bytes());
    }
    wait(&mut p.cq_b, N as usize);
}
