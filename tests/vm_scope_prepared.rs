//! Prepared send lists of a scope (`ScopedQp::prepare`): reposted whole and refused whole,
//! each request's wr_id and opcode reported, a range start surviving slot reuse, and every
//! operation moving the bytes, on both send APIs. Runs in the soft-RoCE guest.

mod common;

use std::time::Duration;

use common::{all_remote, caps_sr, pair_api, pattern, scope_poll_n, summary, wait};
use rdma_verbs::Error;
use rdma_verbs::cq::{WcOpcode, WcStatus};
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::qp::scope::{Dst, PreparedSends, ScopedSend, Src};
use rdma_verbs::qp::{RecvWr, SendApi};

/// On both send APIs (an extended QP posts a prepared list through the
/// builders, without its C chain).
#[test]
fn prepared_lists_repost_whole_and_are_refused_whole() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        repost_whole_and_refused_whole(api);
    }
}

fn repost_whole_and_refused_whole(api: SendApi) {
    let mut p = pair_api(caps_sr(112, 1), api);
    let remote_mr = p.pd.alloc_mr(48 * 64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let mut src = p.pd.alloc_mr(48 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(48 * 64, 5);
    src.write_at(0, &data).unwrap();
    let s_src = Src::new(&src).unwrap();
    let write =
        |i: u64| ScopedSend::write(0, s_src.slice(i as usize * 64, 64).unwrap(), remote, i * 64);
    // 48 WRITEs (more than one 32-request chunk) in one chain; the last signaled.
    let long = PreparedSends::new((0..48).map(|i| write(i).signaled(i == 47))).unwrap();
    assert_eq!(long.len(), 48);
    assert!(long.is_signaled(47) && !long.is_signaled(46));
    let short = PreparedSends::new((0..16).map(|i| write(i).signaled(false))).unwrap();
    let too_long = PreparedSends::new((0..113).map(|i| write(i % 48))).unwrap();
    assert!(matches!(
        PreparedSends::new([]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        PreparedSends::new([write(0), ScopedSend::write(0, s_src, remote, 64)]),
        Err(Error::RemoteOutOfBounds { offset: 64, .. })
    ));
    let qp = &mut p.a;
    let drained = p.cq_a.scope(|s| {
        s.set_drain_timeout(Duration::from_millis(200));
        let mut q = s.attach(qp)?;
        q.post_prepared(&long, 1000)?;
        q.post_prepared(&long, 2000)?;
        assert_eq!(q.outstanding(), (96, 0));
        // 16 free slots: a list of 48 is refused whole, one of 113 never fits.
        assert!(matches!(
            q.post_prepared(&long, 3000),
            Err(Error::QueueFull {
                queue: "send",
                depth: 112
            })
        ));
        assert!(matches!(
            q.post_prepared(&too_long, 3000),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(q.outstanding(), (96, 0));
        let got: Vec<_> = scope_poll_n(s, 2)?.iter().map(summary).collect();
        assert_eq!(
            got,
            [
                (1047, WcStatus::Success, WcOpcode::RdmaWrite, 0),
                (2047, WcStatus::Success, WcOpcode::RdmaWrite, 0),
            ]
        );
        assert_eq!(q.outstanding(), (0, 0));
        // Seven unsignaled lists of 16 fill the queue exactly: the last
        // request of the seventh is signaled for the queue's sake.
        for k in 1..=7 {
            q.post_prepared(&short, k * 100)?;
        }
        let got: Vec<_> = scope_poll_n(s, 1)?.iter().map(summary).collect();
        assert_eq!(got, [(715, WcStatus::Success, WcOpcode::RdmaWrite, 0)]);
        assert_eq!(q.outstanding(), (0, 0));
        // That flag was the post's, not the list's: posted again, the list
        // is all unsignaled and the scope has to flush it.
        q.post_prepared(&short, 800)?;
        Ok(())
    });
    assert!(
        matches!(
            drained,
            Err(Error::ScopeDrained {
                outstanding: 16,
                ..
            })
        ),
        "{drained:?}"
    );
    assert_eq!(remote_mr.to_vec().unwrap(), data);
}

/// On both send APIs (an extended QP posts a prepared list through the
/// builders, without its C chain).
#[test]
fn prepared_lists_report_each_requests_wr_id_and_opcode() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        report_each_requests_wr_id_and_opcode(api);
    }
}

fn report_each_requests_wr_id_and_opcode(api: SendApi) {
    let mut p = pair_api(caps_sr(64, 1), api);
    let remote_mr = p.pd.alloc_mr(512, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let mut src = p.pd.alloc_mr(512, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(512, 7);
    src.write_at(0, &data).unwrap();
    let s_src = Src::new(&src).unwrap();
    let mut back = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let d_back = Dst::new(&mut back).unwrap();
    let piece = |i: u64| s_src.slice(i as usize * 64, 64).unwrap();
    let write = |i: u64| ScopedSend::write(0, piece(i), remote, i * 64);
    // One operation: one side entry per post; completions inside the list
    // (entry 2) and at its end (entry 5).
    let writes = PreparedSends::new((0..6).map(|i| write(i).signaled(i == 2 || i == 5))).unwrap();
    // Mixed operations: an entry per request.
    let mixed = PreparedSends::new([
        write(6).signaled(false),
        ScopedSend::read(0, d_back, remote, 64).signaled(true),
    ])
    .unwrap();
    // Entry 1 has a wrong rkey: it fails at the peer and the QP flushes
    // the rest of the list, each with its own wr_id.
    let bad_rkey = rdma_verbs::mr::RemoteMr {
        rkey: remote.rkey ^ 0x5a5a,
        ..remote
    };
    let failing = PreparedSends::new([
        write(0).signaled(false),
        ScopedSend::write(0, piece(1), bad_rkey, 64).signaled(false),
        write(2).signaled(false),
        write(3).signaled(false),
    ])
    .unwrap();
    let qp = &mut p.a;
    let (good, failed) = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_prepared(&writes, 100)?;
            q.post_prepared(&writes, 200)?;
            q.post_prepared(&mixed, 300)?;
            q.post_send(&ScopedSend::write(400, piece(7), remote, 7 * 64))?;
            let good: Vec<_> = scope_poll_n(s, 6)?.iter().map(summary).collect();
            q.post_prepared(&failing, 500)?;
            let failed: Vec<_> = scope_poll_n(s, 3)?.iter().map(summary).collect();
            assert_eq!(q.outstanding(), (0, 0));
            Ok((good, failed))
        })
        .unwrap();
    let write_ok = |id| (id, WcStatus::Success, WcOpcode::RdmaWrite, 0);
    assert_eq!(
        good,
        [
            write_ok(102),
            write_ok(105),
            write_ok(202),
            write_ok(205),
            (301, WcStatus::Success, WcOpcode::RdmaRead, 64),
            write_ok(400),
        ]
    );
    assert_eq!(
        failed,
        [
            (501, WcStatus::RemAccessErr, WcOpcode::RdmaWrite, 0),
            (502, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0),
            (503, WcStatus::WrFlushErr, WcOpcode::RdmaWrite, 0),
        ]
    );
    assert_eq!(remote_mr.to_vec().unwrap(), data);
    assert_eq!(back.to_vec().unwrap(), data[64..128]);
}

/// On both send APIs (an extended QP posts a prepared list through the
/// builders, without its C chain).
#[test]
fn a_range_start_survives_its_slot_being_reused() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        range_start_survives_slot_reuse(api);
    }
}

fn range_start_survives_slot_reuse(api: SendApi) {
    // Depth 8 is a power of two, so the ring has exactly 8 slots and a post
    // may reuse the slot of a request retired a moment ago, here the first
    // slot of a list whose later requests are still in flight.
    let mut p = pair_api(caps_sr(8, 1), api);
    let remote_mr = p.pd.alloc_mr(5 * 64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let mut src = p.pd.alloc_mr(5 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(5 * 64, 11);
    src.write_at(0, &data).unwrap();
    let s_src = Src::new(&src).unwrap();
    let write =
        |i: u64| ScopedSend::write(0, s_src.slice(i as usize * 64, 64).unwrap(), remote, i * 64);
    let list = PreparedSends::new((0..4).map(|i| write(i).signaled(i == 0 || i == 3))).unwrap();
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_prepared(&list, 100)?;
            q.post_prepared(&list, 200)?;
            assert_eq!(q.outstanding(), (8, 0));
            let mut got: Vec<_> = scope_poll_n(s, 1)?.iter().map(summary).collect();
            // The first request retired: this post takes its slot.
            q.post_send(&ScopedSend::write(
                300,
                s_src.slice(4 * 64, 64)?,
                remote,
                4 * 64,
            ))?;
            got.extend(scope_poll_n(s, 4)?.iter().map(summary));
            Ok(got)
        })
        .unwrap();
    let ids: Vec<_> = got.iter().map(|g| (g.0, g.1, g.2)).collect();
    let ok = |id| (id, WcStatus::Success, WcOpcode::RdmaWrite);
    assert_eq!(ids, [ok(100), ok(103), ok(200), ok(203), ok(300)]);
    assert_eq!(remote_mr.to_vec().unwrap(), data);
}

/// A prepared list of each operation (the extended path picks the builder
/// once per list for WRITE, SEND, READ and fetch-and-add, per request for
/// the others), on both send APIs.
#[test]
fn prepared_lists_of_each_operation_move_the_bytes() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        prepared_lists_of_each_operation(api);
    }
}

fn prepared_lists_of_each_operation(api: SendApi) {
    let mut p = pair_api(caps_sr(32, 8), api);
    assert_eq!(p.a.send_api(), api);
    let remote_mr = p.pd.alloc_mr(512, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let data = pattern(512, 13);
    let mut src = p.pd.alloc_mr(512, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &data).unwrap();
    let mut back = p.pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let mut olds = p.pd.alloc_mr(32, AccessFlags::LOCAL_WRITE).unwrap();
    for i in 0..6 {
        let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(20 + i, mr)).unwrap();
    }
    let s_src = Src::new(&src).unwrap();
    let (d_back, d_olds) = (Dst::new(&mut back).unwrap(), Dst::new(&mut olds).unwrap());
    let piece = |at: usize| s_src.slice(at, 64).unwrap();
    let last = |i: u64, n: u64| i == n - 1;
    fn list(reqs: Vec<ScopedSend<'_>>) -> PreparedSends<'_> {
        PreparedSends::new(reqs).unwrap()
    }
    // WRITE 0..256 of the remote region, SEND 256..512 to the receives,
    // READ the written bytes back, add 1 four times to the counter at 256,
    // and WRITE with immediate twice (per-request builders).
    let writes = list(
        (0..4)
            .map(|i| ScopedSend::write(0, piece(i * 64), remote, i as u64 * 64))
            .collect(),
    );
    let sends = list(
        (0..4)
            .map(|i| ScopedSend::send(0, piece(256 + i * 64)).signaled(last(i as u64, 4)))
            .collect(),
    );
    let reads = list(
        (0..4u64)
            .map(|i| {
                let d = d_back.slice(i as usize * 64, 64).unwrap();
                ScopedSend::read(0, d, remote, i * 64).signaled(last(i, 4))
            })
            .collect(),
    );
    let adds = list(
        (0..4u64)
            .map(|i| {
                let d = d_olds.slice(i as usize * 8, 8).unwrap();
                ScopedSend::fetch_add(0, d, remote, 256, 1).signaled(last(i, 4))
            })
            .collect(),
    );
    let imms = list(
        (0..2u64)
            .map(|i| {
                let at = 320 + i as usize * 64;
                ScopedSend::write(0, piece(at), remote, at as u64)
                    .imm(0x100 + i as u32)
                    .signaled(last(i, 2))
            })
            .collect(),
    );
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_prepared(&writes, 100)?;
            q.post_prepared(&sends, 200)?;
            // The WRITEs completed (all signaled) before the READs go out.
            let mut got = scope_poll_n(s, 5)?;
            q.post_prepared(&reads, 300)?;
            q.post_prepared(&adds, 400)?;
            q.post_prepared(&imms, 500)?;
            got.extend(scope_poll_n(s, 3)?);
            Ok(got)
        })
        .unwrap();
    let got: Vec<_> = got.iter().map(summary).collect();
    let ok = |id, op, len| (id, WcStatus::Success, op, len);
    assert_eq!(
        got,
        [
            ok(100, WcOpcode::RdmaWrite, 0),
            ok(101, WcOpcode::RdmaWrite, 0),
            ok(102, WcOpcode::RdmaWrite, 0),
            ok(103, WcOpcode::RdmaWrite, 0),
            ok(203, WcOpcode::Send, 0),
            ok(303, WcOpcode::RdmaRead, 64),
            ok(403, WcOpcode::FetchAdd, 8),
            ok(501, WcOpcode::RdmaWrite, 0),
        ],
        "{api:?}"
    );
    let remote_now = remote_mr.to_vec().unwrap();
    assert_eq!(remote_now[..256], data[..256], "WRITE");
    assert_eq!(back.to_vec().unwrap(), data[..256], "READ back");
    let counter = u64::from_ne_bytes(remote_now[256..264].try_into().unwrap());
    assert_eq!(counter, 4, "fetch-and-add");
    let olds: Vec<u64> = olds
        .to_vec()
        .unwrap()
        .chunks(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(olds, [0, 1, 2, 3]);
    assert_eq!(remote_now[320..448], data[320..448], "WRITE with immediate");
    let mut r = wait(&mut p.cq_b, 6);
    for (i, c) in r.iter_mut().enumerate() {
        assert_eq!((c.wr_id, c.status), (20 + i as u64, WcStatus::Success));
        if i < 4 {
            let at = 256 + i * 64;
            assert_eq!((c.opcode, c.byte_len), (WcOpcode::Recv, 64));
            assert_eq!(c.take_mr().unwrap().to_vec().unwrap(), data[at..at + 64]);
        } else {
            assert_eq!(c.opcode, WcOpcode::RecvRdmaWithImm);
            assert_eq!(c.imm_data, Some(0x100 + i as u32 - 4));
        }
    }
}
