//! A scope's buffers (`ScopedQp::buffers`): receives, SENDs and WRITEs
//! posted by buffer index, the bytes read and written inside the scope
//! between requests, and the errors for buffers in use and for bad input.
//! Runs in the soft-RoCE guest.

mod common;

use std::time::Duration;

use common::{all_remote, caps_sr, pair, pattern, wait};
use rdma_verbs::Error;
use rdma_verbs::cq::{WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::scope::MAX_SCOPED_BUFFERS;
use rdma_verbs::qp::{Qp, Rc, RecvWr, Rts, SendWr};

const POLL: Duration = Duration::from_secs(20);

fn message_len(seed: u8) -> usize {
    1 + usize::from(seed) * 20
}

/// Three rounds of four messages of different lengths through four buffers:
/// each message is read in the scope, byte for byte, from the buffer its
/// completion names, which is then posted again (but after the last round,
/// so that the scope ends with nothing outstanding).
#[test]
fn received_messages_are_read_in_the_scope_and_their_buffers_posted_again() {
    let mut p = pair(caps_sr(8, 8));
    let mut region = p.pd.alloc_mr(4 * 256, AccessFlags::LOCAL_WRITE).unwrap();
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    p.cq_b
        .scope(|s| -> rdma_verbs::Result<()> {
            let q = s.attach(b)?;
            let mut rx = q.buffers(&mut region, 256)?;
            assert_eq!((rx.len(), rx.buf_len()), (4, 256));
            for k in 0..4 {
                rx.post_recv(k, 100 + k as u64)?;
                assert!(rx.is_posted(k));
                assert!(matches!(rx.bytes(k), Err(Error::InvalidArgument { .. })));
            }
            for round in 0..3u8 {
                for seed in round * 4..round * 4 + 4 {
                    let len = message_len(seed);
                    let mut m = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE)?;
                    m.write_at(0, &pattern(len, seed))?;
                    a.post_send(SendWr::send_from(u64::from(seed), m))?;
                }
                for k in 0..4 {
                    let seed = round * 4 + k as u8;
                    let len = message_len(seed);
                    let c = s.poll_one(POLL)?;
                    assert_eq!(
                        (c.wr_id, c.status, c.opcode, c.byte_len as usize),
                        (100 + k as u64, WcStatus::Success, WcOpcode::Recv, len)
                    );
                    // In order: this completion frees buffer `k` and no later one.
                    assert!(!rx.is_posted(k));
                    assert_eq!(rx.is_posted(k + 1), k < 3);
                    assert_eq!(rx.bytes(k)?[..len], pattern(len, seed)[..]);
                    let mut head = [0u8; 3];
                    rx.read_at(k, 0, &mut head[..len.min(3)])?;
                    assert_eq!(head[..len.min(3)], pattern(len, seed)[..len.min(3)]);
                    if round < 2 {
                        rx.post_recv(k, 100 + k as u64)?;
                        assert!(rx.is_posted(k));
                    }
                }
                let sends = wait(cq_a, 4);
                assert!(sends.iter().all(|c| c.status == WcStatus::Success));
            }
            Ok(())
        })
        .unwrap();
    // Round 2's last message is what buffer 3 kept.
    assert_eq!(
        region.to_vec().unwrap()[768..768 + 221],
        pattern(221, 11)[..]
    );
}

/// `ibv_rc_pingpong`'s buffer: each message is received into a buffer,
/// reversed there and sent back from it, and the buffer receives again once
/// its SEND has completed; meanwhile it can be read but not written or
/// posted. A WRITE from a buffer reaches the peer's region.
#[test]
fn an_echo_answers_from_the_buffer_it_received_into() {
    const N: u8 = 8;
    let mut p = pair(caps_sr(8, 8));
    let mut region = p.pd.alloc_mr(2 * 1024, AccessFlags::LOCAL_WRITE).unwrap();
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let remote = target.remote();
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    let mut echoes = Vec::new();
    p.cq_b
        .scope(|s| -> rdma_verbs::Result<()> {
            let q = s.attach(b)?;
            let mut bufs = q.buffers(&mut region, 1024)?;
            for k in 0..2 {
                bufs.post_recv(k, k as u64)?;
            }
            // Message `i` is received into buffer `i % 2` (its wr_id is `i`)
            // and answered from it (wr_id 500 + `i`, even, so the same buffer).
            let send = |a: &mut Qp<Rc, Rts>, i: u8| -> rdma_verbs::Result<()> {
                let len = message_len(i * 6);
                let echo = pd.alloc_mr(1024, AccessFlags::LOCAL_WRITE)?;
                a.post_recv(RecvWr::new(u64::from(i), echo))?;
                let mut m = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE)?;
                m.write_at(0, &pattern(len, i))?;
                a.post_send(SendWr::send_from(1000 + u64::from(i), m))?;
                Ok(())
            };
            send(a, 0)?;
            send(a, 1)?;
            let mut answered = 0;
            while answered < N {
                let c = s.poll_one(POLL)?;
                c.result()?;
                let k = (c.wr_id % 2) as usize;
                let i = (c.wr_id % 500) as u8;
                match c.opcode {
                    WcOpcode::Recv => {
                        let len = c.byte_len as usize;
                        assert_eq!(len, message_len(i * 6));
                        assert_eq!(bufs.bytes(k)?[..len], pattern(len, i)[..]);
                        bufs.bytes_mut(k)?[..len].reverse();
                        bufs.post_send(k, len, 500 + u64::from(i))?;
                        // Sending: readable, not writable, no receive.
                        assert!(bufs.is_posted(k));
                        assert_eq!(bufs.bytes(k)?[0], pattern(len, i)[len - 1]);
                        let busy = |r: rdma_verbs::Result<()>| match r {
                            Err(Error::InvalidArgument { reason, .. }) => {
                                assert!(reason.contains("send has not completed"), "{reason}")
                            }
                            other => panic!("expected InvalidArgument, got {other:?}"),
                        };
                        busy(bufs.bytes_mut(k).map(drop));
                        busy(bufs.write_at(k, 0, b"x"));
                        busy(bufs.post_recv(k, 0));
                    }
                    WcOpcode::Send => {
                        assert_eq!(i, answered);
                        assert!(!bufs.is_posted(k));
                        answered += 1;
                        if i + 2 < N {
                            bufs.post_recv(k, u64::from(i + 2))?;
                            send(a, i + 2)?;
                        }
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            // A WRITE of the last buffer used, written in place first.
            bufs.write_at(0, 0, b"written from a scoped buffer")?;
            bufs.post_write(0, 28, remote, 8, 900)?;
            let c = s.poll_one(POLL)?;
            assert_eq!(
                (c.wr_id, c.status, c.opcode),
                (900, WcStatus::Success, WcOpcode::RdmaWrite)
            );
            echoes = wait(cq_a, 2 * usize::from(N));
            Ok(())
        })
        .unwrap();
    let mut got = 0;
    for mut c in echoes {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        if c.opcode == WcOpcode::Recv {
            let i = c.wr_id as u8;
            let len = message_len(i * 6);
            assert_eq!(c.byte_len as usize, len);
            let mut want = pattern(len, i);
            want.reverse();
            assert_eq!(c.take_mr().unwrap().to_vec().unwrap()[..len], want[..]);
            got += 1;
        }
    }
    assert_eq!(got, N);
    assert_eq!(
        &target.to_vec().unwrap()[8..36],
        b"written from a scoped buffer"
    );
}

fn refusal(r: rdma_verbs::Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::InvalidArgument { what, reason }) => format!("{what}: {reason}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// Regions the NIC could not write, of another PD, too small or cut too
/// fine, indices and lengths out of range, a buffer posted while it
/// receives and a full receive queue are typed errors; a region a peer may
/// write is read with atomic loads only; receives left posted are flushed
/// at the scope's end.
#[test]
fn scoped_buffers_refuse_bad_input() {
    let mut p = pair(caps_sr(8, 8));
    let other_pd = Pd::new(&p.ctx).unwrap();
    let mut read_only = p.pd.alloc_mr(256, AccessFlags::empty()).unwrap();
    let mut foreign = other_pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let mut small = p.pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    let mut empty = p.pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    let mut fine =
        p.pd.alloc_mr(MAX_SCOPED_BUFFERS + 1, AccessFlags::LOCAL_WRITE)
            .unwrap();
    let mut region = p.pd.alloc_mr(2 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut remote: Mr = p.pd.alloc_mr(64, all_remote()).unwrap();
    let message = pattern(40, 9);
    let mut m = p.pd.alloc_mr(40, AccessFlags::LOCAL_WRITE).unwrap();
    m.write_at(0, &message).unwrap();
    let (a, b) = (&mut p.a, &mut p.b);
    let r = p.cq_b.scope(|s| {
        let q = s.attach(b)?;
        let why = refusal(q.buffers(&mut read_only, 64));
        assert!(why.contains("LOCAL_WRITE"), "{why}");
        let why = refusal(q.buffers(&mut foreign, 64));
        assert!(why.contains("another PD"), "{why}");
        let why = refusal(q.buffers(&mut small, 101));
        assert!(why.contains("holds no 101-byte buffer"), "{why}");
        let why = refusal(q.buffers(&mut empty, 0));
        assert!(why.contains("a buffer of 0 bytes"), "{why}");
        let why = refusal(q.buffers(&mut fine, 1));
        assert!(why.contains("at most 65536"), "{why}");

        let mut rrx = q.buffers(&mut remote, 64)?;
        rrx.post_recv(0, 5)?;
        let why = refusal(rrx.post_send(0, 8, 6));
        assert!(why.contains("receive has not completed"), "{why}");
        a.post_send(SendWr::send_from(1, m))?;
        let c = s.poll_one(POLL)?;
        assert_eq!((c.wr_id, c.status, c.byte_len), (5, WcStatus::Success, 40));
        assert!(matches!(rrx.bytes(0), Err(Error::RemotelyWritable)));
        assert!(matches!(rrx.bytes_mut(0), Err(Error::RemotelyWritable)));
        let mut got = [0u8; 40];
        rrx.read_at(0, 0, &mut got)?;
        assert_eq!(got[..], message[..]);
        assert!(refusal(rrx.read_at(0, 30, &mut got)).contains("outside the 64-byte buffer"));
        assert!(refusal(rrx.post_send(0, 65, 6)).contains("65 bytes; the buffers hold 64"));

        let mut rx = q.buffers(&mut region, 64)?;
        assert!(refusal(rx.post_recv(2, 0)).contains("index 2; there are 2"));
        assert!(!rx.is_posted(2));
        assert!(refusal(rx.bytes(2)).contains("index 2"));
        let posted = (0..64)
            .position(|i| rx.post_recv(i % 2, i as u64).is_err())
            .expect("the receive queue fills");
        match rx.post_recv(0, 0) {
            Err(Error::QueueFull {
                queue: "receive",
                depth,
            }) => assert_eq!(depth as usize, posted),
            other => panic!("expected QueueFull, got {other:?}"),
        }
        s.set_drain_timeout(Duration::from_millis(200));
        Ok(posted as u64)
    });
    match r {
        Err(Error::ScopeDrained { outstanding, .. }) => assert!(outstanding >= 8, "{outstanding}"),
        other => panic!("expected ScopeDrained, got {other:?}"),
    }
}

/// A list of 40 receives into 8 buffers (each buffer five times) goes out as
/// two chains; the messages complete in list order with the list's wr_ids,
/// a buffer stays posted until its last receive has completed, and each
/// buffer then holds the last message it received, byte for byte.
#[test]
fn a_receive_list_completes_in_order_into_its_buffers() {
    const N: usize = 40;
    let mut p = pair(caps_sr(64, 64));
    let mut region = p.pd.alloc_mr(8 * 128, AccessFlags::LOCAL_WRITE).unwrap();
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    p.cq_b
        .scope(|s| -> rdma_verbs::Result<()> {
            let q = s.attach(b)?;
            let mut rx = q.buffers(&mut region, 128)?;
            rx.post_recv_list((0..N).map(|i| (i % 8, 1000 + i as u64)))?;
            assert_eq!(q.outstanding(), (0, N as u64));
            for i in 0..N {
                let len = message_len(i as u8 % 7);
                let mut m = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE)?;
                m.write_at(0, &pattern(len, i as u8))?;
                a.post_send(SendWr::send_from(i as u64, m))?;
            }
            for i in 0..N {
                let c = s.poll_one(POLL)?;
                assert_eq!(
                    (c.wr_id, c.status, c.opcode, c.byte_len as usize),
                    (
                        1000 + i as u64,
                        WcStatus::Success,
                        WcOpcode::Recv,
                        message_len(i as u8 % 7)
                    )
                );
                // Buffer i % 8 receives again at i + 8 while that is in the list.
                assert_eq!(rx.is_posted(i % 8), i + 8 < N, "receive {i}");
            }
            for k in 0..8 {
                let i = N - 8 + k;
                let len = message_len(i as u8 % 7);
                assert_eq!(rx.bytes(k)?[..len], pattern(len, i as u8)[..], "buffer {k}");
            }
            let sends = wait(cq_a, N);
            assert!(sends.iter().all(|c| c.status == WcStatus::Success));
            Ok(())
        })
        .unwrap();
}

/// A receive list stops at its first refused receive (an index out of
/// range, a buffer whose SEND is in flight, a full queue) with the receives
/// before it posted, and those complete; an iterator that panics leaves the
/// queue as it was.
#[test]
fn a_receive_list_stops_at_a_refused_receive() {
    let mut p = pair(caps_sr(8, 8));
    let mut region = p.pd.alloc_mr(2 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    let r = p.cq_b.scope(|s| {
        let q = s.attach(b)?;
        let mut rx = q.buffers(&mut region, 64)?;
        let e = rx
            .post_recv_list([(0, 1), (1, 2), (0, 3), (2, 4), (1, 5)])
            .unwrap_err();
        assert_eq!(e.posted, 3);
        assert!(refusal(Err::<(), _>(e.error)).contains("index 2; there are 2"));
        assert_eq!(q.outstanding(), (0, 3));

        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rx.post_recv_list((0..6).map(|i| if i == 4 { panic!("iterator") } else { (0, i) }))
        }));
        assert!(panicked.is_err());
        assert_eq!(q.outstanding(), (0, 3));

        for i in 1..=3u8 {
            let mut m = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE)?;
            m.write_at(0, &pattern(16, i))?;
            a.post_send(SendWr::send_from(u64::from(i), m))?;
        }
        for i in 1..=3u64 {
            let c = s.poll_one(POLL)?;
            assert_eq!((c.wr_id, c.status, c.byte_len), (i, WcStatus::Success, 16));
        }
        assert_eq!(rx.bytes(0)?[..16], pattern(16, 3)[..]);
        assert_eq!(rx.bytes(1)?[..16], pattern(16, 2)[..]);

        // Buffer 1 sends (the peer receives it), so it cannot receive.
        let echo = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?;
        a.post_recv(RecvWr::new(70, echo))?;
        rx.post_send(1, 16, 7)?;
        let e = rx.post_recv_list([(0, 8), (1, 9)]).unwrap_err();
        assert_eq!(e.posted, 1);
        assert!(refusal(Err::<(), _>(e.error)).contains("send has not completed"));
        let c = s.poll_one(POLL)?;
        assert_eq!((c.wr_id, c.status), (7, WcStatus::Success));
        let mut echo = wait(cq_a, 4).into_iter().find(|c| c.wr_id == 70).unwrap();
        assert_eq!((echo.status, echo.byte_len), (WcStatus::Success, 16));
        assert_eq!(echo.take_mr().unwrap().to_vec()?[..16], pattern(16, 2)[..]);

        let e = rx.post_recv_list((0..100).map(|i| (1, i))).unwrap_err();
        let depth = match e.error {
            Error::QueueFull {
                queue: "receive",
                depth,
            } => u64::from(depth),
            other => panic!("expected QueueFull, got {other:?}"),
        };
        assert_eq!(e.posted as u64, depth - 1);
        assert_eq!(q.outstanding(), (0, depth));
        s.set_drain_timeout(Duration::from_millis(200));
        Ok(())
    });
    match r {
        Err(Error::ScopeDrained { outstanding, .. }) => assert!(outstanding >= 8, "{outstanding}"),
        other => panic!("expected ScopeDrained, got {other:?}"),
    }
}

/// Receives of the scope and sends of the same QP complete on one CQ, after
/// two ownership-passing receives posted before the scope: the scope reads
/// its receives in order (into the buffers their wr_ids name) and its sends
/// from one batch of completions, and leaves the earlier receives, with
/// their buffers, to the CQ's next poll.
#[test]
fn receives_and_sends_of_one_qp_are_read_from_one_batch() {
    let mut p = common::pair_with(caps_sr(16, 16), |pd, _, b| {
        for id in 0..2 {
            let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            b.post_recv(RecvWr::new(id, mr)).unwrap();
        }
    });
    let mut region = p.pd.alloc_mr(4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let out_mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let src = rdma_verbs::qp::scope::Src::new(&out_mr).unwrap();
    let msg = |i: u8| pattern(16 + usize::from(i), i);
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    for id in 0..3 {
        a.post_recv(RecvWr::new(
            50 + id,
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
        .unwrap();
    }
    p.cq_b
        .scope(|s| -> rdma_verbs::Result<()> {
            let mut q = s.attach(b)?;
            let mut rx = q.buffers(&mut region, 64)?;
            rx.post_recv_list((0..6).map(|j| (j % 4, 100 + j as u64)))?;
            for j in 0..3 {
                q.post_send(&rdma_verbs::qp::scope::ScopedSend::send(200 + j, src))?;
            }
            for i in 0..8u8 {
                let mut m = pd.alloc_mr(msg(i).len(), AccessFlags::LOCAL_WRITE)?;
                m.write_at(0, &msg(i))?;
                a.post_send(SendWr::send_from(u64::from(i), m))?;
            }
            std::thread::sleep(Duration::from_millis(300));
            let got = common::scope_poll_n(s, 9)?;
            let recvs: Vec<_> = got.iter().filter(|c| c.opcode == WcOpcode::Recv).collect();
            let sends: Vec<_> = got.iter().filter(|c| c.opcode == WcOpcode::Send).collect();
            assert_eq!(
                recvs
                    .iter()
                    .map(|c| (c.wr_id, c.status, c.byte_len))
                    .collect::<Vec<_>>(),
                (0..6u8)
                    .map(|j| (100 + u64::from(j), WcStatus::Success, 18 + u32::from(j)))
                    .collect::<Vec<_>>()
            );
            assert_eq!(
                sends
                    .iter()
                    .map(|c| (c.wr_id, c.status))
                    .collect::<Vec<_>>(),
                [200, 201, 202].map(|w| (w, WcStatus::Success))
            );
            // Receive j holds message j + 2; each buffer, its last receive's.
            for (k, j) in [(0, 4u8), (1, 5), (2, 2), (3, 3)] {
                let m = msg(j + 2);
                assert_eq!(rx.bytes(k)?[..m.len()], m[..], "buffer {k}");
            }
            Ok(())
        })
        .unwrap();
    let mut out = Vec::with_capacity(4);
    p.cq_b.poll_n(&mut out, 2, Duration::from_secs(5)).unwrap();
    for (i, mut c) in out.into_iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode),
            (i as u64, WcStatus::Success, WcOpcode::Recv)
        );
        let m = msg(i as u8);
        assert_eq!(c.take_mr().unwrap().to_vec().unwrap()[..m.len()], m[..]);
    }
    assert_eq!(wait(cq_a, 11).len(), 11);
}

/// A list's iterator runs while the list's requests are staged from the
/// queue's head: a post on the same queue from inside it is refused (it
/// would take the head the staged requests count on), a post on the QP's
/// other queue is not, and every request that was posted completes.
#[test]
fn a_post_from_a_lists_iterator_on_the_same_queue_is_refused() {
    let mut p = pair(caps_sr(16, 16));
    let mut rx_region = p.pd.alloc_mr(4 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut extra = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let out_mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    for id in 0..8 {
        a.post_recv(RecvWr::new(
            50 + id,
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
        .unwrap();
    }
    let extra = rdma_verbs::qp::scope::Dst::new(&mut extra).unwrap();
    let src = rdma_verbs::qp::scope::Src::new(&out_mr).unwrap();
    let send = |wr_id| rdma_verbs::qp::scope::ScopedSend::send(wr_id, src);
    let nested = |r: rdma_verbs::Result<()>| match r {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("list is being posted"), "{reason}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    p.cq_b
        .scope(|s| -> rdma_verbs::Result<()> {
            let mut q = s.attach(b)?;
            let mut rx = q.buffers(&mut rx_region, 64)?;
            // A receive list whose iterator posts a receive (refused) and a
            // send (posted).
            let mut inner = Vec::new();
            rx.post_recv_list((0..2).map(|k| {
                if k == 1 {
                    inner.push(q.post_recv(99, extra));
                    inner.push(q.post_send(&send(300)));
                }
                (k, 100 + k as u64)
            }))?;
            assert_eq!(inner.len(), 2);
            nested(inner.remove(0));
            inner.remove(0)?;
            assert_eq!(q.outstanding(), (1, 2));
            // A send list whose iterator posts a send through the buffers
            // (refused) and a receive (posted).
            let mut inner = Vec::new();
            q.post_send_list((0..2).map(|j| {
                if j == 1 {
                    inner.push(rx.post_send(3, 8, 301));
                    inner.push(rx.post_recv(2, 102));
                }
                send(400 + j)
            }))?;
            nested(inner.remove(0));
            inner.remove(0)?;
            assert_eq!(q.outstanding(), (3, 3));
            for i in 0..3u8 {
                let mut m = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE)?;
                m.write_at(0, &pattern(16, i))?;
                a.post_send(SendWr::send_from(u64::from(i), m))?;
            }
            let mut got = common::scope_poll_n(s, 6)?;
            got.sort_by_key(|c| c.wr_id);
            assert_eq!(
                got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
                [100, 101, 102, 300, 400, 401].map(|w| (w, WcStatus::Success))
            );
            for k in 0..3 {
                assert_eq!(rx.bytes(k)?[..16], pattern(16, k as u8)[..], "buffer {k}");
            }
            assert_eq!(q.outstanding(), (0, 0));
            Ok(())
        })
        .unwrap();
    assert_eq!(wait(cq_a, 6).len(), 6);
}
