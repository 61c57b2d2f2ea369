//! The core provider assumptions of docs/soundness.md on QPs connected through rdma_cm, so
//! that they run on every provider: soft-RoCE (rxe) and soft-iWARP (siw), whose QPs connect
//! through rdma_cm only. SEND/RECV, WRITE and READ, in-order completion per queue, the flush
//! on ERR, the `ibv_wc` fields, the SRQ, the scope and the tokio layer; immediate data and
//! atomics are refused on iWARP with `Error::Unsupported` and work elsewhere.

mod common;

use std::thread;
use std::time::Duration;

use common::{all_remote, pattern, scope_poll_n, summary, wait};
use rdma_verbs::cm::{CmId, ConnParam};
use rdma_verbs::context::Context;
use rdma_verbs::cq::{Cq, WcOpcode, WcStatus};
use rdma_verbs::device::{self, Transport};
use rdma_verbs::error::Error;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::scope::{Dst, ScopedSend, Src};
use rdma_verbs::qp::{Init, Qp, QpCaps, Rc, RecvWr, Rts, SendWr};
use rdma_verbs::srq::{Srq, SrqAttr};

/// Upper bound for a handshake step (TCG is slow).
const T: Duration = Duration::from_secs(20);

/// Whether `ctx`'s device speaks iWARP.
fn iwarp(ctx: &Context) -> bool {
    let list = device::devices().expect("device list");
    let dev = list.find(Some(ctx.name())).expect("the device is listed");
    dev.transport() == Transport::Iwarp
}

fn caps(depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCaps::default()
    }
}

/// A resolved active-side id towards `port`, and its device context (librdmacm's, which
/// the passive side's ids share on loopback).
fn client(port: u16) -> (CmId, Context) {
    let id = CmId::new().expect("rdma_cm id (this test needs an RDMA device)");
    id.resolve(common::guest_at(port), T)
        .expect("resolve address and route");
    let ctx = id.context().expect("the id's context");
    (id, ctx)
}

/// Connects `a` (created on `client`) to a QP that `make_b` creates on the passive side of
/// a listener on `port`. Returns both QPs in RTS and the ids that keep the connection.
fn connect(
    port: u16,
    client: CmId,
    a: Qp<Rc, Init>,
    make_b: impl FnOnce(&CmId) -> Qp<Rc, Init> + Send,
) -> (Qp<Rc, Rts>, Qp<Rc, Rts>, [CmId; 3]) {
    let listener = CmId::listener(common::guest_at(port), 4).expect("listen");
    thread::scope(|s| {
        let server = s.spawn(move || {
            let req = listener.get_request(T).expect("connect request");
            let b = make_b(req.id());
            let (b, id) = req.accept(b, &ConnParam::new(), T).expect("accept");
            (b, id, listener)
        });
        let (a, _) = client
            .connect(a, &ConnParam::new(), T)
            .expect("rdma_connect");
        let (b, id_b, listener) = server.join().expect("the passive side");
        (a, b, [client, id_b, listener])
    })
}

/// Two RC QPs connected through rdma_cm on loopback, in one PD, a CQ each.
struct CmPair {
    iwarp: bool,
    pd: Pd,
    cq_a: Cq,
    cq_b: Cq,
    a: Qp<Rc, Rts>,
    b: Qp<Rc, Rts>,
    _ids: [CmId; 3],
}

fn cm_pair(port: u16, depth: u32) -> CmPair {
    let (id, ctx) = client(port);
    let pd = Pd::new(&ctx).expect("pd");
    let cq_a = Cq::new(&ctx, 4 * depth).expect("cq a");
    let cq_b = Cq::new(&ctx, 4 * depth).expect("cq b");
    let a = id.create_qp(&pd, &cq_a, &cq_a, caps(depth)).expect("qp a");
    let (a, b, ids) = connect(port, id, a, |id_b| {
        id_b.create_qp(&pd, &cq_b, &cq_b, caps(depth))
            .expect("qp b")
    });
    CmPair {
        iwarp: iwarp(&ctx),
        pd,
        cq_a,
        cq_b,
        a,
        b,
        _ids: ids,
    }
}

fn mr_with(pd: &Pd, data: &[u8]) -> Mr {
    let mut mr = pd.alloc_mr(data.len(), AccessFlags::LOCAL_WRITE).unwrap();
    mr.write_at(0, data).unwrap();
    mr
}

#[test]
fn send_recv_write_and_read_move_the_bytes_and_report_the_wc_fields() {
    let mut p = cm_pair(21001, 8);
    let data = pattern(4096, 5);
    p.b.post_recv(RecvWr::new(
        70,
        p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let target = p.pd.alloc_mr(4096, all_remote()).unwrap();
    let remote = target.remote();
    p.a.post_send(SendWr::write_from(1, mr_with(&p.pd, &data), remote, 0))
        .unwrap();
    let back = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    // RC executes a READ after the WRITE posted before it.
    p.a.post_send(SendWr::read(2, back, remote, 0)).unwrap();
    p.a.post_send(SendWr::send_from(3, mr_with(&p.pd, &data[..300])))
        .unwrap();
    let mut sent = wait(&mut p.cq_a, 3);
    let order: Vec<u64> = sent.iter().map(|c| c.wr_id).collect();
    if p.iwarp && order != [1, 2, 3] {
        // siw completes the READ when its response arrives, after the SEND behind it;
        // the ledger retires each request on its own completion.
        assert_eq!(order, [1, 3, 2], "only the READ completes late");
        common::deviation("a SEND posted after a READ completed before it (iWARP)");
        sent.sort_by_key(|c| c.wr_id);
    }
    let got: Vec<_> = sent
        .iter()
        .map(|c| {
            (
                c.wr_id, c.status, c.opcode, c.byte_len, c.qp_num, c.imm_data,
            )
        })
        .collect();
    let qa = p.a.qp_num();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite, 0, qa, None),
            (2, WcStatus::Success, WcOpcode::RdmaRead, 4096, qa, None),
            (3, WcStatus::Success, WcOpcode::Send, 0, qa, None),
        ]
    );
    assert_eq!(target.to_vec().unwrap(), data, "WRITE");
    let read = sent[1].take_mr().expect("the READ's buffer comes back");
    assert_eq!(read.to_vec().unwrap(), data, "READ");
    let mut r = wait(&mut p.cq_b, 1);
    let c = &mut r[0];
    assert_eq!(
        (
            c.wr_id, c.status, c.opcode, c.byte_len, c.qp_num, c.imm_data
        ),
        (
            70,
            WcStatus::Success,
            WcOpcode::Recv,
            300,
            p.b.qp_num(),
            None
        )
    );
    let buf = c.take_mr().expect("the receive's buffer").to_vec().unwrap();
    assert_eq!(buf[..300], data[..300]);
}

#[test]
fn each_queue_completes_in_posting_order() {
    const N: u64 = 48;
    let mut p = cm_pair(21002, N as u32);
    for i in 0..N {
        let mr = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(1000 + i, mr)).unwrap();
    }
    let target = p.pd.alloc_mr(8 * N as usize, all_remote()).unwrap();
    for i in 0..N {
        let bytes = i.to_le_bytes();
        let wr = if i % 2 == 0 {
            SendWr::send_from(i, mr_with(&p.pd, &bytes))
        } else {
            SendWr::write_from(i, mr_with(&p.pd, &bytes), target.remote(), 8 * i)
        };
        p.a.post_send(wr).unwrap();
    }
    let sends: Vec<u64> = wait(&mut p.cq_a, N as usize)
        .iter()
        .map(|c| {
            c.result().unwrap();
            c.wr_id
        })
        .collect();
    assert_eq!(sends, (0..N).collect::<Vec<_>>(), "send queue order");
    let recvs = wait(&mut p.cq_b, (N / 2) as usize);
    for (k, mut c) in recvs.into_iter().enumerate() {
        c.result().unwrap();
        assert_eq!(c.wr_id, 1000 + k as u64, "receive queue order");
        let got = c.take_mr().unwrap().to_vec().unwrap();
        assert_eq!(got, (2 * k as u64).to_le_bytes(), "the k-th SEND");
    }
    let written = target.to_vec().unwrap();
    for i in (1..N).step_by(2) {
        let at = 8 * i as usize;
        assert_eq!(written[at..at + 8], i.to_le_bytes());
    }
}

#[test]
fn the_error_state_flushes_every_posted_request_with_its_fields() {
    let p = cm_pair(21003, 8);
    let CmPair {
        pd, mut cq_b, b, ..
    } = p;
    let mut b = b;
    for i in 0..6u64 {
        let mr = pd
            .alloc_mr(64 + i as usize, AccessFlags::LOCAL_WRITE)
            .unwrap();
        b.post_recv(RecvWr::new(i, mr)).unwrap();
    }
    let qb = b.qp_num();
    let _b = b.to_error().map_err(|e| e.error).expect("to ERR");
    let got = wait(&mut cq_b, 6);
    for (i, mut c) in got.into_iter().enumerate() {
        assert_eq!(
            (
                c.wr_id, c.status, c.opcode, c.qp_num, c.byte_len, c.imm_data
            ),
            (i as u64, WcStatus::WrFlushErr, WcOpcode::Recv, qb, 0, None),
            "flushed receive {i}"
        );
        let buf = c
            .take_mr()
            .expect("the flushed receive's buffer comes back");
        assert_eq!(buf.len(), 64 + i);
    }
    assert_eq!(
        cq_b.poll(&mut Vec::new()).unwrap(),
        0,
        "one completion per receive"
    );
}

#[test]
fn immediate_data_and_atomics_are_unsupported_on_iwarp_and_work_elsewhere() {
    let mut p = cm_pair(21004, 8);
    // The SEND and the WRITE with immediate data each consume a receive.
    for wr_id in [9, 10] {
        let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(wr_id, mr)).unwrap();
    }
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let result = || p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let refused = [
        (
            "SEND with imm",
            SendWr::send_from(1, mr_with(&p.pd, b"imm")).imm(7),
        ),
        (
            "WRITE with imm",
            SendWr::write_from(2, mr_with(&p.pd, b"imm"), target.remote(), 0).imm(8),
        ),
        (
            "fetch-and-add",
            SendWr::fetch_add(3, result(), target.remote(), 8, 5),
        ),
        (
            "compare-and-swap",
            SendWr::compare_swap(4, result(), target.remote(), 16, 0, 6),
        ),
    ];
    if p.iwarp {
        for (what, wr) in refused {
            let e = p.a.post_send(wr).expect_err(what);
            assert!(
                matches!(
                    e.error,
                    Error::Unsupported {
                        verb: "ibv_post_send",
                        ..
                    }
                ),
                "{what}: {e:?}"
            );
            assert!(e.error.to_string().contains("iWARP"), "{what}: {}", e.error);
            assert_eq!(e.unposted.len(), 1, "{what}: its buffers come back");
        }
        // The QP still works.
        p.a.post_send(SendWr::send_from(5, mr_with(&p.pd, b"after")))
            .unwrap();
        wait(&mut p.cq_a, 1)[0].result().unwrap();
        let mut r = wait(&mut p.cq_b, 1);
        r[0].result().unwrap();
        assert_eq!(r[0].imm_data, None);
        assert_eq!(&r[0].take_mr().unwrap().to_vec().unwrap()[..5], b"after");
    } else {
        for (_, wr) in refused {
            p.a.post_send(wr).unwrap();
        }
        let mut sent = wait(&mut p.cq_a, 4);
        for c in &sent {
            c.result().unwrap();
        }
        let old = sent[2].take_mr().unwrap().to_vec().unwrap();
        assert_eq!(old, 0u64.to_ne_bytes(), "fetch-and-add's old value");
        let r = wait(&mut p.cq_b, 2);
        let got: Vec<_> = r.iter().map(|c| (c.wr_id, c.opcode, c.imm_data)).collect();
        assert_eq!(
            got,
            [
                (9, WcOpcode::Recv, Some(7)),
                (10, WcOpcode::RecvRdmaWithImm, Some(8))
            ]
        );
        let t = target.to_vec().unwrap();
        assert_eq!(t[8..16], 5u64.to_ne_bytes());
        assert_eq!(t[16..24], 6u64.to_ne_bytes());
    }
}

#[test]
fn srq_receives_complete_once_on_the_qp_that_took_them() {
    const PER: u64 = 4;
    let (id1, ctx) = client(21005);
    let pd = Pd::new(&ctx).unwrap();
    let mut srq_cq = Cq::new(&ctx, 64).unwrap();
    let mut srq = Srq::new(&pd, &srq_cq, SrqAttr::new(16, 1)).expect("SRQ");
    for i in 0..2 * PER {
        let mr = pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
        srq.post_recv(RecvWr::new(100 + i, mr)).unwrap();
    }
    let send_cq = Cq::new(&ctx, 64).unwrap();
    let mut cq_a = Cq::new(&ctx, 64).unwrap();
    let mut pairs = Vec::new();
    for (port, id) in [(21005u16, Some(id1)), (21006, None)] {
        let id = id.unwrap_or_else(|| client(port).0);
        let a = id.create_qp(&pd, &cq_a, &cq_a, caps(8)).unwrap();
        let (srq, pd, send_cq, srq_cq) = (&srq, &pd, &send_cq, &srq_cq);
        pairs.push(connect(port, id, a, move |id_b| {
            id_b.create_qp_with_srq(pd, send_cq, srq_cq, srq, caps(8))
                .expect("QP on the SRQ")
        }));
    }
    for (n, (a, _, _)) in pairs.iter_mut().enumerate() {
        for i in 0..PER {
            let tag = (n as u64) << 32 | i;
            a.post_send(SendWr::send_from(i, mr_with(&pd, &tag.to_le_bytes())))
                .unwrap();
        }
    }
    for c in wait(&mut cq_a, 2 * PER as usize) {
        c.result().unwrap();
    }
    let mut seen = Vec::new();
    let mut next = [0u64; 2];
    for mut c in wait(&mut srq_cq, 2 * PER as usize) {
        c.result().unwrap();
        let tag = u64::from_le_bytes(
            c.take_mr().unwrap().to_vec().unwrap()[..8]
                .try_into()
                .unwrap(),
        );
        let n = (tag >> 32) as usize;
        assert_eq!(
            c.qp_num,
            pairs[n].1.qp_num(),
            "on the QP its sender reached"
        );
        assert_eq!(tag & 0xffff_ffff, next[n], "in order per QP");
        next[n] += 1;
        seen.push(c.wr_id);
    }
    seen.sort_unstable();
    assert_eq!(
        seen,
        (100..100 + 2 * PER).collect::<Vec<_>>(),
        "each receive once"
    );
    assert_eq!(
        srq_cq.poll(&mut Vec::new()).unwrap(),
        0,
        "each receive once"
    );
}

#[test]
fn the_scope_moves_the_bytes_over_cm_qps() {
    let mut p = cm_pair(21007, 8);
    let mr = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.post_recv(RecvWr::new(7, mr)).unwrap();
    let remote_mr = p.pd.alloc_mr(4096, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let data = pattern(4096, 9);
    let src = mr_with(&p.pd, &data);
    let mut dst = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let (s_src, d_dst) = (Src::new(&src).unwrap(), Dst::new(&mut dst).unwrap());
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(1, s_src, remote, 0))?;
            q.post_send(&ScopedSend::read(2, d_dst, remote, 0))?;
            q.post_send(&ScopedSend::send(3, s_src.slice(100, 300)?))?;
            scope_poll_n(s, 3)
        })
        .unwrap();
    let got: Vec<_> = got.iter().map(summary).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite, 0),
            (2, WcStatus::Success, WcOpcode::RdmaRead, 4096),
            (3, WcStatus::Success, WcOpcode::Send, 0),
        ]
    );
    assert_eq!(remote_mr.to_vec().unwrap(), data, "WRITE");
    assert_eq!(dst.to_vec().unwrap(), data, "READ back");
    let mut r = wait(&mut p.cq_b, 1);
    assert_eq!((r[0].wr_id, r[0].byte_len), (7, 300));
    assert_eq!(
        r[0].take_mr().unwrap().to_vec().unwrap()[..300],
        data[100..400]
    );
}

#[cfg(feature = "tokio")]
#[test]
fn the_tokio_layer_moves_the_bytes_over_cm_qps() {
    use rdma_verbs::tokio::{AsyncCmId, AsyncCq, AsyncQp, Listener};

    let rt = common::async_pair::runtime();
    rt.block_on(async {
        let listener = Listener::bind(common::guest_at(21008), 4).unwrap();
        let (remote_tx, remote_rx) = tokio::sync::oneshot::channel();
        let server = tokio::spawn(async move {
            let req = listener.request().await.unwrap();
            let ctx = req.id().context().unwrap();
            let pd = Pd::new(&ctx).unwrap();
            let cq = AsyncCq::new(&ctx, 16).unwrap();
            let qp = {
                let c = cq.cq();
                req.id().create_qp(&pd, &c, &c, caps(4)).unwrap()
            };
            let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
            let target = pd.alloc_mr(1024, all_remote()).unwrap();
            qp.post_recv(RecvWr::new(
                0,
                pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
            ))
            .unwrap();
            let (_qp, mut id) = AsyncCmId::accept(req, qp, &ConnParam::new(), T)
                .await
                .unwrap();
            remote_tx.send(target.remote()).unwrap();
            let mut got = tokio::time::timeout(T, cq.next()).await.unwrap().unwrap();
            got.result().unwrap();
            let msg = got.take_mr().unwrap().to_vec().unwrap()[..got.byte_len as usize].to_vec();
            let ev = tokio::time::timeout(T, id.event()).await.unwrap().unwrap();
            assert_eq!(ev.kind, rdma_verbs::cm::CmEventKind::Disconnected);
            (msg, target.to_vec().unwrap())
        });
        let mut id = AsyncCmId::resolve(common::guest_at(21008), T)
            .await
            .unwrap();
        let ctx = id.id().context().unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 16).unwrap();
        let qp = {
            let c = cq.cq();
            id.id().create_qp(&pd, &c, &c, caps(4)).unwrap()
        };
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        let (qp, _) = id.connect(qp, &ConnParam::new(), T).await.unwrap();
        let remote = remote_rx.await.unwrap();
        let data = pattern(1024, 11);
        let w = qp.write(mr_with(&pd, &data), remote, 0).await.unwrap();
        assert_eq!(
            (w.status, w.opcode),
            (WcStatus::Success, WcOpcode::RdmaWrite)
        );
        let back = pd.alloc_mr(1024, AccessFlags::LOCAL_WRITE).unwrap();
        let mut r = qp.read(back, remote, 0).await.unwrap();
        assert_eq!(
            (r.status, r.opcode, r.byte_len),
            (WcStatus::Success, WcOpcode::RdmaRead, 1024)
        );
        assert_eq!(r.take_mr().unwrap().to_vec().unwrap(), data, "READ back");
        let s = qp.send(mr_with(&pd, b"over tokio")).await.unwrap();
        s.result().unwrap();
        id.disconnect(T).await.unwrap();
        let (msg, written) = server.await.unwrap();
        assert_eq!(msg, b"over tokio");
        assert_eq!(written, data, "WRITE");
    });
}

/// An unsignaled READ that a later SEND's completion retires: where a queue completes in
/// posting order (rxe) its destination comes back through `poll_with_retired` with the
/// bytes read; on iWARP (siw completes a SEND before an earlier READ) the NIC may still be
/// writing it, so it is kept until the QP is destroyed and never handed back.
#[test]
fn an_unsignaled_read_is_handed_back_only_where_the_queue_completes_in_order() {
    let mut p = cm_pair(21009, 8);
    let data = pattern(4096, 13);
    let mut source = p.pd.alloc_mr(4096, all_remote()).unwrap();
    source.write_at(0, &data).unwrap();
    let remote = source.remote();
    p.b.post_recv(RecvWr::new(
        80,
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let back = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.a.post_send(SendWr::read(1, back, remote, 0).unsignaled())
        .unwrap();
    p.a.post_send(SendWr::send_from(2, mr_with(&p.pd, &data[..64])))
        .unwrap();
    let (mut out, mut retired) = (Vec::new(), Vec::new());
    let start = std::time::Instant::now();
    while out.is_empty() {
        p.cq_a.poll_with_retired(&mut out, &mut retired).unwrap();
        assert!(start.elapsed() < T, "no completion for the SEND");
    }
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    if p.iwarp {
        assert!(
            retired.is_empty(),
            "a READ swept on iWARP must not come back while the NIC may write it"
        );
    } else {
        assert_eq!(retired.len(), 1, "the READ is retired by the SEND");
        let (id, bufs) = retired.pop().unwrap();
        let mr = bufs.into_iter().next().unwrap().into_mr().unwrap();
        assert_eq!((id, mr.to_vec().unwrap()), (1, data.clone()));
    }
    let r = wait(&mut p.cq_b, 1);
    assert_eq!((r[0].wr_id, r[0].byte_len), (80, 64));
    // The QP goes first, then what it held (nothing here may outlive it).
    drop(p.a);
}

/// READs of 1 MiB interleaved with small SENDs, all signaled: siw completes each SEND when
/// it is sent and each READ when its response has arrived, so the SENDs usually complete
/// first. Every request comes back once, with its fields and bytes, whatever the order;
/// the SENDs keep their order among themselves and so do the READs. Where the queue
/// completes in order (rxe) the order is the posting order.
#[test]
fn sends_behind_large_reads_complete_on_their_own_and_every_request_comes_back() {
    const LEN: usize = 1 << 20;
    let mut p = cm_pair(21010, 8);
    let data = pattern(LEN, 17);
    let mut source = p.pd.alloc_mr(LEN, all_remote()).unwrap();
    source.write_at(0, &data).unwrap();
    let remote = source.remote();
    for i in 0..2 {
        let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(80 + i, mr)).unwrap();
    }
    for (read, send) in [(1, 2), (3, 4)] {
        let back = p.pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
        p.a.post_send(SendWr::read(read, back, remote, 0)).unwrap();
        p.a.post_send(SendWr::send_from(send, mr_with(&p.pd, &data[..64])))
            .unwrap();
    }
    let mut done = wait(&mut p.cq_a, 4);
    let order: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    let pos = |id| order.iter().position(|&w| w == id).unwrap();
    assert!(
        pos(1) < pos(3) && pos(2) < pos(4),
        "each kind in order: {order:?}"
    );
    if order != [1, 2, 3, 4] {
        assert!(
            p.iwarp,
            "out of posting order on an in-order queue: {order:?}"
        );
        common::deviation(&format!("SENDs completed before earlier READs: {order:?}"));
    }
    done.sort_by_key(|c| c.wr_id);
    let qa = p.a.qp_num();
    for c in &mut done {
        let (opcode, len) = match c.wr_id {
            1 | 3 => (WcOpcode::RdmaRead, LEN as u32),
            _ => (WcOpcode::Send, 0),
        };
        assert_eq!(
            (c.status, c.opcode, c.byte_len, c.qp_num),
            (WcStatus::Success, opcode, len, qa),
            "wr {}",
            c.wr_id
        );
        let mr = c.take_mr().expect("every request's buffer comes back");
        if opcode == WcOpcode::RdmaRead {
            assert!(mr.to_vec().unwrap() == data, "READ {} bytes", c.wr_id);
        }
    }
    let got = wait(&mut p.cq_b, 2);
    assert_eq!(
        got.iter()
            .map(|c| (c.wr_id, c.byte_len))
            .collect::<Vec<_>>(),
        [(80, 64), (81, 64)]
    );
}
