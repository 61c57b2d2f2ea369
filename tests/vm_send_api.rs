//! The two send APIs (`SendApi::Extended`: `ibv_wr_*` on an `ibv_qp_ex`;
//! `SendApi::Legacy`: `ibv_post_send`) on real soft-RoCE: which one a QP gets,
//! and every operation moving the same bytes over both, including the chains
//! the extended path hands to `ibv_post_send` (several SGEs). Runs in the
//! guest (`cargo xtask test`).

mod common;

use common::{ctx, pair_api, pattern, wait};
use rdma_verbs::cq::{Completion, Cq, WcOpcode, WcStatus};
use rdma_verbs::ffi;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{Qp, QpCaps, RecvWr, SendApi, SendWr};
use rdma_verbs::srq::{Srq, SrqAttr};

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 32,
        max_recv_wr: 32,
        max_send_sge: 3,
        max_recv_sge: 1,
        max_inline_data: 64,
        sq_sig_all: false,
    }
}

#[test]
fn rc_qps_use_the_extended_api_where_the_provider_has_it() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 256).unwrap();
    if common::iwarp(&ctx) {
        return iwarp_qps_use_ibv_post_send(&pd, &cq);
    }
    // rxe implements ibv_qp_ex: Qp::new picks it.
    let qp = Qp::new(&pd, &cq, &cq, caps()).unwrap();
    assert_eq!(qp.send_api(), SendApi::Extended);
    let qp = Qp::new_with_send_api(&pd, &cq, &cq, caps(), SendApi::Extended).unwrap();
    assert_eq!(qp.send_api(), SendApi::Extended);
    let qp = Qp::new_with_send_api(&pd, &cq, &cq, caps(), SendApi::Legacy).unwrap();
    assert_eq!(qp.send_api(), SendApi::Legacy);
    let srq = Srq::new(&pd, &cq, SrqAttr::new(8, 1)).unwrap();
    let qp = Qp::new_with_srq(&pd, &cq, &cq, &srq, caps()).unwrap();
    assert_eq!(qp.send_api(), SendApi::Extended);
    // UC and UD stay on ibv_post_send.
    let uc = Qp::new_uc(&pd, &cq, &cq, caps()).unwrap();
    assert_eq!(uc.send_api(), SendApi::Legacy);
}

/// siw's `ibv_create_qp_ex` refuses send operations (`EOPNOTSUPP`): `Qp::new` falls back
/// to `ibv_post_send`, asking for the extended API is `Unsupported`, and UC QPs do not
/// exist on iWARP.
fn iwarp_qps_use_ibv_post_send(pd: &Pd, cq: &Cq) {
    fn unsupported<T>(r: rdma_verbs::Result<T>) {
        match r {
            Err(rdma_verbs::Error::Unsupported { .. }) => {}
            Err(e) => panic!("expected Unsupported, got {e:?}"),
            Ok(_) => panic!("expected Unsupported, got a QP"),
        }
    }
    let qp = Qp::new(pd, cq, cq, caps()).unwrap();
    assert_eq!(qp.send_api(), SendApi::Legacy);
    unsupported(Qp::new_with_send_api(pd, cq, cq, caps(), SendApi::Extended));
    let qp = Qp::new_with_send_api(pd, cq, cq, caps(), SendApi::Legacy).unwrap();
    assert_eq!(qp.send_api(), SendApi::Legacy);
    let srq = Srq::new(pd, cq, SrqAttr::new(8, 1)).unwrap();
    let qp = Qp::new_with_srq(pd, cq, cq, &srq, caps()).unwrap();
    assert_eq!(qp.send_api(), SendApi::Legacy);
    unsupported(Qp::new_uc(pd, cq, cq, caps()));
    common::deviation("no extended send API (ibv_qp_ex): Qp::new uses ibv_post_send");
}

fn filled(pd: &Pd, data: &[u8]) -> Mr {
    let mut mr = pd
        .alloc_mr(data.len().max(1), AccessFlags::LOCAL_WRITE)
        .unwrap();
    if data.is_empty() {
        let _rest = mr.split_off(0).unwrap();
    } else {
        mr.write_at(0, data).unwrap();
    }
    mr
}

fn take_bytes(c: &mut Completion) -> Vec<u8> {
    let mut mr = c.take_mr().expect("a buffer");
    let len = c.byte_len as usize;
    mr.as_mut_slice().unwrap()[..len].to_vec()
}

/// Every RC operation, alone, in a translated chain and in a chain the
/// extended path posts with `ibv_post_send`: the same completions and bytes
/// on both APIs.
#[test]
fn every_operation_moves_the_same_bytes_on_both_apis() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        let mut p = pair_api(caps(), api);
        assert_eq!((p.a.send_api(), p.b.send_api()), (api, api));
        let mut target =
            p.pd.alloc_mr(
                256,
                AccessFlags::LOCAL_WRITE
                    | AccessFlags::REMOTE_WRITE
                    | AccessFlags::REMOTE_READ
                    | AccessFlags::REMOTE_ATOMIC,
            )
            .unwrap();
        target.write_at(200, &1000u64.to_ne_bytes()).unwrap();
        let remote = target.remote();
        for id in 0..6 {
            let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            p.b.post_recv(RecvWr::new(100 + id, mr)).unwrap();
        }
        let (d0, d1, d2) = (pattern(40, 1), pattern(21, 2), pattern(64, 3));
        let (w, inl) = (pattern(48, 4), pattern(17, 5));

        // One chain of every operation the builders express.
        let wrs = vec![
            SendWr::send_from(0, filled(&p.pd, &d0)),
            SendWr::send_from(1, filled(&p.pd, &d1)).imm(0x1234_5678),
            SendWr::send_inline(2, &inl),
            SendWr::send(3),
            SendWr::write_from(4, filled(&p.pd, &w), remote, 8),
            SendWr::write_from(5, filled(&p.pd, &w[..8]), remote, 100).imm(7),
            SendWr::fetch_add(
                6,
                p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap(),
                remote,
                200,
                5,
            ),
        ];
        p.a.post_send_list(wrs).unwrap();
        let mut sc = wait(&mut p.cq_a, 7);
        let got: Vec<_> = sc.iter().map(|c| (c.wr_id, c.status, c.opcode)).collect();
        use WcOpcode::*;
        let ops = [Send, Send, Send, Send, RdmaWrite, RdmaWrite, FetchAdd];
        let want: Vec<_> = (0..7)
            .map(|i| (i as u64, WcStatus::Success, ops[i]))
            .collect();
        assert_eq!(got, want, "{api:?}");
        assert_eq!(take_bytes_mr(&mut sc[6]), 1000u64.to_ne_bytes(), "{api:?}");
        let mut rc = wait(&mut p.cq_b, 5);
        let lens: Vec<_> = rc
            .iter()
            .map(|c| (c.wr_id, c.byte_len, c.imm_data))
            .collect();
        assert_eq!(
            lens,
            [
                (100, 40, None),
                (101, 21, Some(0x1234_5678)),
                (102, 17, None),
                (103, 0, None),
                (104, 8, Some(7)),
            ],
            "{api:?}"
        );
        assert_eq!(take_bytes(&mut rc[0]), d0);
        assert_eq!(take_bytes(&mut rc[1]), d1);
        assert_eq!(take_bytes(&mut rc[2]), inl);
        let mut t = [0u8; 256];
        target.read_at(0, &mut t).unwrap();
        assert_eq!(&t[8..56], &w[..], "{api:?}");
        assert_eq!(&t[100..108], &w[..8], "{api:?}");
        assert_eq!(u64::from_ne_bytes(t[200..208].try_into().unwrap()), 1005);

        // A chain with a three-SGE SEND (the extended path posts it whole
        // with ibv_post_send), a READ and a compare-and-swap.
        let dest = p.pd.alloc_mr(48, AccessFlags::LOCAL_WRITE).unwrap();
        let wrs = vec![
            SendWr::read(7, dest, remote, 8),
            SendWr::send_from(8, filled(&p.pd, &d2[..10]))
                .sge(filled(&p.pd, &d2[10..30]))
                .sge(filled(&p.pd, &d2[30..])),
            SendWr::compare_swap(
                9,
                p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap(),
                remote,
                200,
                1005,
                77,
            ),
        ];
        p.a.post_send_list(wrs).unwrap();
        let mut sc = wait(&mut p.cq_a, 3);
        let got: Vec<_> = sc.iter().map(|c| (c.wr_id, c.status, c.opcode)).collect();
        assert_eq!(
            got,
            [
                (7, WcStatus::Success, RdmaRead),
                (8, WcStatus::Success, Send),
                (9, WcStatus::Success, CompSwap)
            ],
            "{api:?}"
        );
        assert_eq!(take_bytes_mr(&mut sc[0]), w, "{api:?}");
        assert_eq!(sc[1].take_buffers().len(), 3);
        assert_eq!(take_bytes_mr(&mut sc[2]), 1005u64.to_ne_bytes());
        target.read_at(200, &mut t[..8]).unwrap();
        assert_eq!(u64::from_ne_bytes(t[..8].try_into().unwrap()), 77);
        let mut rc = wait(&mut p.cq_b, 1);
        assert_eq!((rc[0].wr_id, rc[0].byte_len), (105, 64), "{api:?}");
        assert_eq!(take_bytes(&mut rc[0]), d2, "{api:?}");

        // The raw path goes through the same posting: a two-request WRITE
        // chain, the second one signaled.
        let src = filled(&p.pd, &d2);
        let mut sge = [
            sge(src.addr(), 32, src.lkey()),
            sge(src.addr() + 32, 32, src.lkey()),
        ];
        let mut second = raw_wr(21, &mut sge[1], ffi::IBV_WR_RDMA_WRITE, SIGNALED);
        second.wr.rdma.remote_addr = remote.addr + 160;
        second.wr.rdma.rkey = remote.rkey;
        let mut first = raw_wr(20, &mut sge[0], ffi::IBV_WR_RDMA_WRITE, 0);
        first.next = &mut second;
        first.wr.rdma.remote_addr = remote.addr + 128;
        first.wr.rdma.rkey = remote.rkey;
        // SAFETY: both SGEs lie in `src` and the remote range in `target`,
        // which live until the completion below; one request in flight.
        unsafe { p.a.post_send_raw(&mut first) }.unwrap();
        let c = wait(&mut p.cq_a, 1);
        assert_eq!((c[0].wr_id, c[0].status), (21, WcStatus::Success));
        target.read_at(128, &mut t[..64]).unwrap();
        assert_eq!(&t[..64], &d2[..], "{api:?}");
        drop(src);
    }
}

const SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;

fn sge(addr: u64, length: u32, lkey: u32) -> ffi::ibv_sge {
    ffi::ibv_sge { addr, length, lkey }
}

/// A one-SGE C request (remote address and `next` left to the caller).
fn raw_wr(wr_id: u64, sge: &mut ffi::ibv_sge, opcode: u32, flags: u32) -> ffi::ibv_send_wr {
    ffi::ibv_send_wr {
        wr_id,
        sg_list: sge,
        num_sge: 1,
        opcode,
        send_flags: flags,
        ..Default::default()
    }
}

fn take_bytes_mr(c: &mut Completion) -> Vec<u8> {
    c.take_mr().expect("a buffer").to_vec().unwrap()
}

/// A builder's refusal aborts the whole extended chain (`ibv_wr_post(3)`):
/// here a WRITE followed by a SEND whose inline data exceeds the QP's inline
/// limit (rxe flags it in `wr_set_inline_data`). The post fails, nothing of
/// it executes, and the QP goes on working. (The safe paths still count a
/// failed `ibv_wr_complete` as posted: rxe's can fail after queueing.)
#[test]
fn a_refused_extended_chain_posts_nothing() {
    let mut p = pair_api(caps(), SendApi::Extended);
    let target =
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let remote = target.remote();
    let src = filled(&p.pd, &pattern(32, 9));
    let big = pattern(caps().max_inline_data as usize * 4, 10);
    let mut sge = [
        sge(src.addr(), 32, src.lkey()),
        sge(big.as_ptr() as u64, big.len() as u32, 0),
    ];
    let inline = ffi::ibv_send_flags::IBV_SEND_INLINE.0;
    let mut second = raw_wr(2, &mut sge[1], ffi::IBV_WR_SEND, SIGNALED | inline);
    let mut first = raw_wr(1, &mut sge[0], ffi::IBV_WR_RDMA_WRITE, SIGNALED);
    first.next = &mut second;
    first.wr.rdma.remote_addr = remote.addr;
    first.wr.rdma.rkey = remote.rkey;
    // SAFETY: the SGEs lie in `src` and `big`, which outlive the QP's use of
    // them (the chain is refused; were it not, the completions are awaited
    // below before they drop).
    let r = unsafe { p.a.post_send_raw(&mut first) };
    assert!(r.is_err(), "{r:?}");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut out = Vec::new();
    p.cq_a.poll(&mut out).unwrap();
    assert!(out.is_empty(), "a refused chain completed: {out:?}");
    let mut t = [0u8; 32];
    target.read_at(0, &mut t).unwrap();
    assert_eq!(t, [0u8; 32], "the refused WRITE wrote");

    // The QP goes on working: the same WRITE alone.
    first.next = std::ptr::null_mut();
    // SAFETY: as above; one request, awaited below.
    unsafe { p.a.post_send_raw(&mut first) }.unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));
    target.read_at(0, &mut t).unwrap();
    assert_eq!(&t[..], &pattern(32, 9)[..]);
    drop((src, big));
}

/// Moves `qp` to `state` with `ffi::ibv_modify_qp`, behind the types' back.
///
/// # Safety
/// `qp` is live; `attr` and `mask` are what the transition needs.
unsafe fn modify_raw(qp: *mut ffi::ibv_qp, mut attr: ffi::ibv_qp_attr, mask: u32) {
    // SAFETY: per this function's contract.
    let rc = unsafe { ffi::ibv_modify_qp(qp, &mut attr, mask as _) };
    assert_eq!(rc, 0, "ibv_modify_qp to {}", attr.qp_state);
}

/// A failed `ibv_wr_complete` keeps the request's buffer: rxe queues the
/// request before its doorbell, and the doorbell is what refuses below RTS.
/// The QP, typed `Rts`, is moved back to RESET and INIT by hand; a safe SEND
/// is then refused with its buffer kept, and the move to ERR flushes the
/// queued request: its completion brings the buffer back. (Had the refusal
/// returned the buffer, the NIC would have held a request on memory its
/// owner had back.)
#[test]
fn a_failed_extended_post_keeps_its_buffer_for_the_flush() {
    use ffi::ibv_qp_attr_mask as m;
    let mut p = pair_api(caps(), SendApi::Extended);
    let qp = p.a.as_raw();
    let state = |qp_state| ffi::ibv_qp_attr {
        qp_state,
        ..Default::default()
    };
    let init = ffi::ibv_qp_attr {
        port_num: 1,
        ..state(ffi::IBV_QPS_INIT)
    };
    // SAFETY: the QP is live; RESET and INIT take these attributes. Nothing
    // is outstanding, and the safe post below is what the test is about.
    unsafe {
        modify_raw(qp, state(ffi::IBV_QPS_RESET), m::IBV_QP_STATE.0);
        let mask = m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0;
        modify_raw(qp, init, mask | m::IBV_QP_ACCESS_FLAGS.0);
    }
    let data = pattern(32, 11);
    let e =
        p.a.post_send(SendWr::send_from(7, filled(&p.pd, &data)))
            .expect_err("a send in INIT");
    assert!(
        e.unposted.is_empty(),
        "the buffer came back although the request is queued: {e}"
    );
    // SAFETY: the QP is live; ERR takes only the state.
    unsafe { modify_raw(qp, state(ffi::IBV_QPS_ERR), m::IBV_QP_STATE.0) };
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (7, WcStatus::WrFlushErr));
    assert_eq!(take_bytes_mr(&mut c[0]), data);
}

/// A raw chain with a reserved `wr_id` anywhere in it is refused whole,
/// before anything reaches the NIC, on both APIs and on the extended API's
/// fallback to `ibv_post_send` (a request with two SGEs): the extended path
/// checks the `wr_id`s while it replays the chain instead of walking it
/// first.
#[test]
fn a_raw_chain_with_a_reserved_wr_id_is_refused_whole() {
    let reserved = rdma_verbs::qp::RAW_WR_ID_RESERVED;
    for api in [SendApi::Extended, SendApi::Legacy] {
        for two_sges in [false, true] {
            let mut p = pair_api(caps(), api);
            let target =
                p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
                    .unwrap();
            let remote = target.remote();
            let src = filled(&p.pd, &pattern(32, 21));
            let mut sges = [
                sge(src.addr(), 16, src.lkey()),
                sge(src.addr() + 16, 16, src.lkey()),
                sge(src.addr(), 8, src.lkey()),
            ];
            let (head, tail) = sges.split_at_mut(2);
            let mut second = raw_wr(reserved | 2, &mut tail[0], ffi::IBV_WR_RDMA_WRITE, SIGNALED);
            second.wr.rdma.remote_addr = remote.addr + 32;
            second.wr.rdma.rkey = remote.rkey;
            let mut first = raw_wr(1, &mut head[0], ffi::IBV_WR_RDMA_WRITE, SIGNALED);
            first.num_sge = if two_sges { 2 } else { 1 };
            first.wr.rdma.remote_addr = remote.addr;
            first.wr.rdma.rkey = remote.rkey;
            first.next = &mut second;
            let case = format!("{api:?}, two SGEs: {two_sges}");
            // SAFETY: the SGEs lie in `src`, which outlives every request
            // (they are refused; the one posted after is awaited).
            match unsafe { p.a.post_send_raw(&mut first) } {
                Err(rdma_verbs::Error::InvalidArgument { what: "wr_id", .. }) => {}
                other => panic!("{case}: expected the reserved wr_id refused, got {other:?}"),
            }
            // Nothing of the chain ran: the next request's completion is the
            // first one, and the target is untouched by the refused WRITE.
            first.next = std::ptr::null_mut();
            first.wr_id = 3;
            // SAFETY: as above; one request, awaited below.
            unsafe { p.a.post_send_raw(&mut first) }.unwrap();
            let c = wait(&mut p.cq_a, 1);
            assert_eq!((c[0].wr_id, c[0].status), (3, WcStatus::Success), "{case}");
            let mut out = Vec::new();
            p.cq_a.poll(&mut out).unwrap();
            assert!(out.is_empty(), "{case}: {out:?}");
            let got = target.to_vec().unwrap();
            let len = if two_sges { 32 } else { 16 };
            assert_eq!(got[..len], pattern(32, 21)[..len], "{case}");
            assert!(got[len..].iter().all(|&b| b == 0), "{case}: {got:?}");
        }
    }
}

/// A QP created with `sq_sig_all` completes every request, also those posted
/// unsignaled: each comes back once with its own wr_id and buffer, one by one
/// and in a list, on both APIs, and the ring counts none of them as lost.
#[test]
fn a_qp_that_signals_every_request_returns_each_one() {
    // siw has no extended send API.
    let apis = if common::iwarp(&ctx()) {
        &[SendApi::Legacy][..]
    } else {
        &[SendApi::Extended, SendApi::Legacy][..]
    };
    for &api in apis {
        let caps = QpCaps {
            sq_sig_all: true,
            ..caps()
        };
        let mut p = pair_api(caps, api);
        let target =
            p.pd.alloc_mr(256, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
                .unwrap();
        let remote = target.remote();
        let data = pattern(32, 7);
        // Fills the 32-entry ring twice over: the unsignaled requests are
        // retired by their own completions, never swept.
        for round in 0..2u64 {
            for i in 0..16u64 {
                let off = i * 8;
                let wr =
                    SendWr::write_from(round * 100 + i, filled(&p.pd, &data[..8]), remote, off)
                        .unsignaled();
                p.a.post_send(wr).unwrap();
            }
            let list = (16..32u64).map(|i| {
                SendWr::write_from(round * 100 + i, filled(&p.pd, &data[..8]), remote, i * 8)
                    .unsignaled()
            });
            p.a.post_send_list(list).unwrap();
            let mut got = wait(&mut p.cq_a, 32);
            let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
            let want: Vec<u64> = (0..32).map(|i| round * 100 + i).collect();
            assert_eq!(ids, want, "{api:?}");
            for c in &mut got {
                assert_eq!(
                    (c.status, c.opcode),
                    (WcStatus::Success, WcOpcode::RdmaWrite)
                );
                let mr = c.take_mr().expect("the source back");
                assert_eq!(
                    mr.to_vec().unwrap(),
                    &data[..8],
                    "{api:?}: wr_id {}",
                    c.wr_id
                );
            }
        }
        let mut none = Vec::new();
        assert_eq!(p.cq_a.poll(&mut none).unwrap(), 0, "{api:?}");
        let mut copy = vec![0u8; 256];
        target.read_at(0, &mut copy).unwrap();
        for i in 0..32 {
            assert_eq!(&copy[i * 8..i * 8 + 8], &data[..8], "{api:?}: slot {i}");
        }
    }
}
