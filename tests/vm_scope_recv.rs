//! A scope's receive buffers (`ScopedQp::recv_buffers`): receives posted by
//! buffer index, their bytes read inside the scope once polled, and the
//! errors for reads of buffers in flight and for bad input. Runs in the
//! soft-RoCE guest.

mod common;

use std::time::Duration;

use common::{all_remote, caps_sr, pair, pattern};
use rdma_verbs::{AccessFlags, Error, Mr, Pd, SendWr, WcOpcode, WcStatus};

/// Three rounds of four messages of different lengths through four buffers:
/// each message is read in the scope, byte for byte, from the buffer its
/// completion names, which is then posted again.
#[test]
fn received_messages_are_read_in_the_scope_and_their_buffers_posted_again() {
    let mut p = pair(caps_sr(8, 8));
    let mut region = p.pd.alloc_mr(4 * 256, AccessFlags::LOCAL_WRITE).unwrap();
    let (a, b, pd, cq_a) = (&mut p.a, &mut p.b, &p.pd, &mut p.cq_a);
    p.cq_b
        .scope(|s| -> rdma_verbs::Result<()> {
            let q = s.attach(b)?;
            let mut rx = q.recv_buffers(&mut region, 256)?;
            assert_eq!((rx.len(), rx.buf_len()), (4, 256));
            for k in 0..4 {
                rx.post(k, 100 + k as u64)?;
                assert!(rx.is_posted(k));
                assert!(matches!(rx.bytes(k), Err(Error::InvalidArgument { .. })));
            }
            for round in 0..3u8 {
                for i in 0..4u8 {
                    let seed = round * 4 + i;
                    let len = 1 + usize::from(seed) * 20;
                    let mut m = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE)?;
                    m.write_at(0, &pattern(len, seed))?;
                    a.post_send(SendWr::send_from(u64::from(seed), m))?;
                }
                for i in 0..4u8 {
                    let seed = round * 4 + i;
                    let len = 1 + usize::from(seed) * 20;
                    let c = s.poll_one(Duration::from_secs(20))?;
                    let k = usize::from(i);
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
                    rx.post(k, 100 + k as u64)?;
                    assert!(rx.is_posted(k));
                }
                let mut sends = Vec::new();
                cq_a.poll_n(&mut sends, 4, common::WAIT)?;
                assert!(sends.iter().all(|c| c.status == WcStatus::Success));
            }
            // The four receives posted last are left to the drain timeout.
            s.set_drain_timeout(Duration::from_millis(200));
            Ok(())
        })
        .map_or_else(
            |e| {
                assert!(
                    matches!(e, Error::ScopeDrained { outstanding: 4, .. }),
                    "{e}"
                )
            },
            |()| panic!("four receives were left outstanding"),
        );
    // Round 2's last message is what buffer 3 kept.
    assert_eq!(
        region.to_vec().unwrap()[768..768 + 221],
        pattern(221, 11)[..]
    );
}

fn refusal(r: rdma_verbs::Result<impl std::fmt::Debug>) -> String {
    match r {
        Err(Error::InvalidArgument { what, reason }) => format!("{what}: {reason}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// Regions the NIC could not write, of another PD or too small, indices out
/// of range and a full receive queue are typed errors; a region a peer may
/// write is read with atomic loads only.
#[test]
fn receive_buffers_refuse_bad_input() {
    let mut p = pair(caps_sr(8, 8));
    let other_pd = Pd::new(&p.ctx).unwrap();
    let mut read_only = p.pd.alloc_mr(256, AccessFlags::empty()).unwrap();
    let mut foreign = other_pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let mut small = p.pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    let mut empty = p.pd.alloc_mr(100, AccessFlags::LOCAL_WRITE).unwrap();
    let mut region = p.pd.alloc_mr(2 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let mut remote: Mr = p.pd.alloc_mr(64, all_remote()).unwrap();
    let message = pattern(40, 9);
    let mut m = p.pd.alloc_mr(40, AccessFlags::LOCAL_WRITE).unwrap();
    m.write_at(0, &message).unwrap();
    let (a, b) = (&mut p.a, &mut p.b);
    let r = p.cq_b.scope(|s| {
        let q = s.attach(b)?;
        let why = refusal(q.recv_buffers(&mut read_only, 64));
        assert!(why.contains("LOCAL_WRITE"), "{why}");
        let why = refusal(q.recv_buffers(&mut foreign, 64));
        assert!(why.contains("another PD"), "{why}");
        let why = refusal(q.recv_buffers(&mut small, 101));
        assert!(why.contains("holds no 101-byte buffer"), "{why}");
        let why = refusal(q.recv_buffers(&mut empty, 0));
        assert!(why.contains("a buffer of 0 bytes"), "{why}");

        let mut rrx = q.recv_buffers(&mut remote, 64)?;
        rrx.post(0, 5)?;
        a.post_send(SendWr::send_from(1, m))?;
        let c = s.poll_one(Duration::from_secs(20))?;
        assert_eq!((c.wr_id, c.status, c.byte_len), (5, WcStatus::Success, 40));
        assert!(matches!(rrx.bytes(0), Err(Error::RemotelyWritable)));
        let mut got = [0u8; 40];
        rrx.read_at(0, 0, &mut got)?;
        assert_eq!(got[..], message[..]);
        assert!(refusal(rrx.read_at(0, 30, &mut got)).contains("outside the 64-byte buffer"));

        let mut rx = q.recv_buffers(&mut region, 64)?;
        assert!(refusal(rx.post(2, 0)).contains("index 2; there are 2"));
        assert!(!rx.is_posted(2));
        assert!(refusal(rx.bytes(2)).contains("index 2"));
        let posted = (0..64)
            .position(|i| rx.post(i % 2, i as u64).is_err())
            .expect("the receive queue fills");
        match rx.post(0, 0) {
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
