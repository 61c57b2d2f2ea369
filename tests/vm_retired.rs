//! The destinations of unsignaled READs come back from the poll that retires
//! them: as a list (`Cq::poll_with_retired`) or one by one to a closure
//! (`Cq::poll_recycling`), in posting order, with the data the NIC wrote; a
//! panicking closure leaves the CQ consistent. Runs in the guest (`cargo xtask
//! test`).

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};

use common::{Pair, pair, pattern};
use rdma_verbs::cq::{Completion, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr, RemoteMr};
use rdma_verbs::qp::{QpCaps, SendWr};

/// Default capabilities with `sge` scatter entries per send request.
fn caps(sge: u32) -> QpCaps {
    QpCaps {
        max_send_sge: sge,
        ..QpCaps::default()
    }
}

/// A 512-byte source of pattern bytes at the peer, and its bytes.
fn source(p: &Pair) -> (Mr, Vec<u8>, RemoteMr) {
    let mut source = p.pd.alloc_mr(8 * 64, AccessFlags::REMOTE_READ).unwrap();
    let all = pattern(8 * 64, 77);
    source.as_mut_slice().unwrap().copy_from_slice(&all);
    let remote = source.remote();
    (source, all, remote)
}

/// Posts eight 64-byte READs of `remote` (READ `i` at offset `64 * i`), only
/// the last signaled; READ `split` reads into two 32-byte destinations.
fn post_eight_reads(p: &mut Pair, remote: RemoteMr, split: Option<u64>) {
    let dest = |len| p.pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).unwrap();
    let wrs: Vec<SendWr> = (0..8u64)
        .map(|i| {
            let wr = if Some(i) == split {
                SendWr::read(i, dest(32), remote, i * 64).sge(dest(32))
            } else {
                SendWr::read(i, dest(64), remote, i * 64)
            };
            if i == 7 { wr } else { wr.unsignaled() }
        })
        .collect();
    p.a.post_send_list(wrs).unwrap();
}

/// Polls with `poll` until the signaled READ's completion arrives.
fn poll_until_one(
    p: &mut Pair,
    mut poll: impl FnMut(&mut Pair, &mut Vec<Completion>) -> rdma_verbs::Result<usize>,
) -> Completion {
    let mut out = Vec::with_capacity(1);
    let start = std::time::Instant::now();
    while out.is_empty() {
        poll(p, &mut out).unwrap();
        assert!(start.elapsed() < common::WAIT, "no completion");
    }
    assert_eq!(out[0].status, WcStatus::Success, "{:?}", out[0]);
    assert_eq!(out[0].wr_id, 7);
    out.pop().unwrap()
}

#[test]
fn unsignaled_reads_hand_their_destinations_back_through_poll_with_retired() {
    let mut p = pair(caps(1));
    let (_source, all, remote) = source(&p);
    post_eight_reads(&mut p, remote, None);
    let mut retired = Vec::with_capacity(8);
    let mut last = poll_until_one(&mut p, |p, out| p.cq_a.poll_with_retired(out, &mut retired));
    let mut got: Vec<(u64, Mr)> = retired
        .into_iter()
        .map(|(id, bufs)| (id, bufs.into_iter().next().unwrap().into_mr().unwrap()))
        .collect();
    got.push((7, last.take_mr().unwrap()));
    assert_eq!(
        got.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>(),
        "posting order"
    );
    for (id, mr) in got {
        let off = id as usize * 64;
        assert_eq!(mr.to_vec().unwrap(), &all[off..off + 64], "READ {id}");
    }
}

/// Each destination comes to the closure once, in posting order, a request
/// with two destinations in list order, each holding what the NIC read.
#[test]
fn unsignaled_reads_hand_each_destination_to_poll_recycling() {
    let mut p = pair(caps(2));
    let (_source, all, remote) = source(&p);
    post_eight_reads(&mut p, remote, Some(3));
    let mut got: Vec<(u64, Mr)> = Vec::new();
    let mut last = poll_until_one(&mut p, |p, out| {
        p.cq_a
            .poll_recycling(out, |id, b| got.push((id, b.into_mr().unwrap())))
    });
    let ids: Vec<u64> = got.iter().map(|(id, _)| *id).collect();
    assert_eq!(ids, [0, 1, 2, 3, 3, 4, 5, 6], "posting order, READ 3 twice");
    let mut bytes = Vec::new();
    for (_, mr) in &got {
        bytes.extend(mr.to_vec().unwrap());
    }
    assert_eq!(bytes, &all[..7 * 64], "what the NIC read, in order");
    let mr = last.take_mr().unwrap();
    assert_eq!(mr.to_vec().unwrap(), &all[7 * 64..], "the signaled READ's");
    assert!(last.take_mr().is_none());
}

/// A closure that panics on its first buffer: the poll's bookkeeping
/// finishes (the completion is in `out`, nothing is handed out twice), the
/// buffers not handed over are released, the panic reaches the caller, and
/// the QP carries on.
#[test]
fn a_panicking_recycler_leaves_the_cq_consistent() {
    let mut p = pair(caps(1));
    let (_source, all, remote) = source(&p);
    post_eight_reads(&mut p, remote, None);
    let mut out = Vec::with_capacity(1);
    let mut calls = 0;
    let start = std::time::Instant::now();
    let panicked = loop {
        let r = catch_unwind(AssertUnwindSafe(|| {
            p.cq_a.poll_recycling(&mut out, |id, _| {
                calls += 1;
                panic!("recycler refuses {id}");
            })
        }));
        match r {
            Err(e) => break e,
            Ok(n) => assert_eq!(n.unwrap(), 0, "a completion without its panic"),
        }
        assert!(start.elapsed() < common::WAIT, "no completion");
    };
    assert_eq!(
        panicked.downcast_ref::<String>().map(String::as_str),
        Some("recycler refuses 0")
    );
    assert_eq!(calls, 1, "not called after it panicked");
    assert_eq!(out.len(), 1, "the polled completion is kept");
    assert_eq!((out[0].wr_id, out[0].status), (7, WcStatus::Success));
    assert_eq!(out[0].take_mr().unwrap().to_vec().unwrap(), &all[7 * 64..]);
    // The ring moved on: the next eight READs retire as usual.
    post_eight_reads(&mut p, remote, None);
    let mut got = Vec::new();
    poll_until_one(&mut p, |p, out| {
        p.cq_a.poll_recycling(out, |id, _| got.push(id))
    });
    assert_eq!(got, (0..7).collect::<Vec<_>>());
}

/// The closure may post to the QP whose completions it is handed: each
/// destination goes straight into a new READ (of the same 64 bytes, so the
/// first seven are read twice), while the poll is still sweeping.
#[test]
fn a_recycler_may_repost_each_destination_on_the_same_qp() {
    let mut p = pair(caps(1));
    let (_source, all, remote) = source(&p);
    post_eight_reads(&mut p, remote, None);
    let (qp, cq) = (&mut p.a, &mut p.cq_a);
    let mut out = Vec::with_capacity(1);
    let start = std::time::Instant::now();
    while out.is_empty() {
        cq.poll_recycling(&mut out, |id, b| {
            let wr = SendWr::read(100 + id, b, remote, id * 64);
            // The last one signaled: it retires the six before it.
            let wr = if id == 6 { wr } else { wr.unsignaled() };
            qp.post_send(wr).expect("re-posted from the closure");
        })
        .unwrap();
        assert!(start.elapsed() < common::WAIT, "no completion");
    }
    assert_eq!((out[0].wr_id, out[0].status), (7, WcStatus::Success));
    let mut got = Vec::new();
    let mut again = Vec::with_capacity(1);
    while again.is_empty() {
        cq.poll_recycling(&mut again, |id, b| got.push((id, b.into_mr().unwrap())))
            .unwrap();
        assert!(start.elapsed() < 2 * common::WAIT, "no second completion");
    }
    assert_eq!((again[0].wr_id, again[0].status), (106, WcStatus::Success));
    got.push((106, again[0].take_mr().unwrap()));
    assert_eq!(
        got.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        (100..107).collect::<Vec<_>>()
    );
    for (id, mr) in got {
        let off = (id - 100) as usize * 64;
        assert_eq!(mr.to_vec().unwrap(), &all[off..off + 64], "READ {id}");
    }
}
