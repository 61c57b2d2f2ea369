//! A QP's send and receive halves posting from two threads at once
//! (`Qp::split`), and a scoped receiver that posts its receives before it
//! connects (`Cq::scope_adopt`). Runs in the soft-RoCE guest.

mod common;

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
