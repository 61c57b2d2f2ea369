//! The tokio integration (`rdma_verbs::tokio`, feature `tokio`) on soft-RoCE:
//! awaited operations with data verified, cancel safety under firing
//! timeouts with every buffer accounted, a dropped `AsyncCq` failing its
//! waiters instead of hanging, rdma_cm connect/accept/disconnect cycles with
//! kernel objects back to baseline, and async events.
mod common;

use common::procs::{Proc, example};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex as StdMutex;
use std::time::{Duration, Instant};

use rdma_verbs::cm::{CmEventKind, ConnParam};
use rdma_verbs::qp::{Init, Rts};
use rdma_verbs::tokio::{AsyncChannel, AsyncCmId, AsyncCq, AsyncEventStream, AsyncQp, Listener};
use rdma_verbs::{
    AccessFlags, AsyncEvent, Completion, CompletionSource, InitAttr, Mr, Pd, Qp, QpCaps, Rc,
    RecvWr, SendWr, WcOpcode, WcStatus,
};

static SERIAL: StdMutex<()> = StdMutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

struct AsyncPair {
    pd: Pd,
    cq_a: AsyncCq,
    cq_b: AsyncCq,
    a: AsyncQp<Rc, Rts>,
    b: AsyncQp<Rc, Rts>,
}

/// Two RC QPs connected to each other, each on an `AsyncCq` of its own; the
/// two CQs share one channel (and driver task) when `one_channel`.
fn async_pair_on(caps: QpCaps, one_channel: bool) -> AsyncPair {
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).unwrap();
    let depth = (caps.max_send_wr + caps.max_recv_wr) * 2;
    let (cq_a, cq_b) = if one_channel {
        let ch = AsyncChannel::new(&ctx).unwrap();
        let pair = (
            AsyncCq::on_channel(&ch, depth).unwrap(),
            AsyncCq::on_channel(&ch, depth).unwrap(),
        );
        assert!(format!("{ch:?}").contains("cqs: 2"), "{ch:?}");
        pair
    } else {
        (
            AsyncCq::new(&ctx, depth).unwrap(),
            AsyncCq::new(&ctx, depth).unwrap(),
        )
    };
    let gid = common::gid_index(&ctx);
    let mk = |cq: &AsyncCq| -> Qp<Rc, Init> {
        let c = cq.cq();
        Qp::new(&pd, &c, &c, caps)
            .unwrap()
            .init(InitAttr::new(1, common::all_remote()))
            .unwrap()
    };
    let (a, b) = (mk(&cq_a), mk(&cq_b));
    let (ea, eb) = (
        a.endpoint(Some(gid)).unwrap(),
        b.endpoint(Some(gid)).unwrap(),
    );
    let a = a.connect(&eb, Some(gid)).unwrap();
    let b = b.connect(&ea, Some(gid)).unwrap();
    let a = AsyncQp::new(a, &cq_a, &cq_a).map_err(|(e, _)| e).unwrap();
    let b = AsyncQp::new(b, &cq_b, &cq_b).map_err(|(e, _)| e).unwrap();
    AsyncPair {
        pd,
        cq_a,
        cq_b,
        a,
        b,
    }
}

fn async_pair(caps: QpCaps) -> AsyncPair {
    async_pair_on(caps, false)
}

fn caps(depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCaps::default()
    }
}

fn mr_with(pd: &Pd, data: &[u8]) -> Mr {
    let mut mr = pd
        .alloc_mr(data.len().max(1), AccessFlags::LOCAL_WRITE)
        .unwrap();
    mr.write_at(0, data).unwrap();
    mr
}

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

/// A runtime built without its IO driver gets a typed error from the
/// constructors (tokio itself would panic on registering the descriptor).
#[test]
fn a_runtime_without_io_gets_an_error_not_a_panic() {
    let _g = serial();
    let ctx = common::ctx();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    for err in [
        rt.block_on(async { AsyncCq::new(&ctx, 16).map(drop) }),
        rt.block_on(async { AsyncChannel::new(&ctx).map(drop) }),
    ] {
        let err = err.expect_err("no IO driver");
        assert!(
            matches!(err, rdma_verbs::Error::InvalidArgument { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("enable_all"), "{err}");
    }

    // A connect made on a runtime with IO, awaited on one without: its
    // timeout's timer cannot be registered (this panicked inside tokio).
    let rt_io = runtime();
    let (mut id, qp, _cq) = rt_io.block_on(async {
        let id = AsyncCmId::resolve(addr(7496), T).await.unwrap();
        let ctx = id.id().context().unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 8).unwrap();
        let qp = id.id().create_qp(&pd, &cq.cq(), &cq.cq(), caps(2)).unwrap();
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        (id, qp, cq)
    });
    let e = rt
        .block_on(id.connect(qp, &ConnParam::new(), T))
        .map(drop)
        .expect_err("no IO driver to time the wait with");
    assert!(
        matches!(e, rdma_verbs::Error::InvalidArgument { .. }),
        "{e:?}"
    );
}

/// A runtime built with IO but without timers (`enable_io()` only): the
/// driver and the rdma_cm waits use timers of their own (tokio's panicked
/// there, in the driver task or in `AsyncCmId::resolve`).
#[test]
fn a_runtime_without_timers_works() {
    let _g = serial();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let p = async_pair(caps(4));
        let target = p.pd.alloc_mr(64, common::all_remote()).unwrap();
        let c =
            p.a.write(mr_with(&p.pd, b"no timers"), target.remote(), 0)
                .await
                .unwrap();
        c.result().unwrap();
        assert_eq!(&target.to_vec().unwrap()[..9], b"no timers");
        let recv =
            p.b.recv_into(p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap());
        // `join!` polls in order: the receive is posted first.
        let (got, sent) = tokio::join!(recv, p.a.send(mr_with(&p.pd, b"ping")));
        sent.unwrap().result().unwrap();
        let mut got = got.map_err(|e| e.error).unwrap();
        got.result().unwrap();
        let got = got.take_mr().unwrap();
        assert_eq!(&got.to_vec().unwrap()[..4], b"ping");

        // An rdma_cm wait that ends by its event, and one that times out.
        let t = Instant::now();
        let id = AsyncCmId::resolve(addr(7497), T).await.unwrap();
        assert!(id.id().context().is_ok());
        let short = Duration::from_millis(300);
        let e = AsyncCmId::resolve("10.99.0.77:7497".parse().unwrap(), short)
            .await
            .map(drop)
            .expect_err("nobody has 10.99.0.77");
        assert!(
            matches!(
                e,
                rdma_verbs::Error::Timeout { .. } | rdma_verbs::Error::CmEvent { .. }
            ),
            "{e:?}"
        );
        assert!(t.elapsed() < T, "took {:?}", t.elapsed());
    });
}

/// Kernel object counts of the guest's device.
fn counts() -> HashMap<String, u64> {
    let dev = std::env::var("RDMA_VERBS_DEVICE").unwrap_or_else(|_| "rxe0".into());
    common::res_counts(&dev)
}

fn addr(port: u16) -> SocketAddr {
    let ip = std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into());
    format!("{ip}:{port}").parse().unwrap()
}

const T: Duration = Duration::from_secs(10);

/// Connects to `server`, exchanges one message each way, disconnects.
async fn client_cycle(server: SocketAddr, seq: u32) {
    let mut id = AsyncCmId::resolve(server, T).await.unwrap();
    let ctx = id.id().context().unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let cq = AsyncCq::new(&ctx, 16).unwrap();
    let qp = {
        let c = cq.cq();
        id.id().create_qp(&pd, &c, &c, caps(4)).unwrap()
    };
    let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
    qp.post_recv(RecvWr::new(
        0,
        pd.alloc_mr(4, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let (qp, ev) = id
        .connect(qp, &ConnParam::new().private_data(&seq.to_le_bytes()), T)
        .await
        .unwrap();
    assert_eq!(ev.kind, CmEventKind::Established);
    let sent = qp.send(mr_with(&pd, &seq.to_le_bytes())).await.unwrap();
    sent.result().unwrap();
    let mut got = tokio::time::timeout(T, cq.next()).await.unwrap().unwrap();
    got.result().unwrap();
    assert_eq!(
        got.take_mr().unwrap().to_vec().unwrap(),
        (seq + 1).to_le_bytes()
    );
    id.disconnect(T).await.unwrap();
}

/// The server: accepts, echoes seq + 1, waits for DISCONNECTED, repeats;
/// gives the listener back, and the last connection's id.
async fn server_loop(listener: Listener, cycles: u32) -> (Listener, Option<AsyncCmId>) {
    // Each connection's id is kept until the next request: the client's
    // disconnect must not wait for the id's destruction (it waited its
    // whole timeout when the server's disconnect sent nothing).
    let mut kept = None;
    for _ in 0..cycles {
        let req = listener.request().await.unwrap();
        let seq = u32::from_le_bytes(req.private_data()[..4].try_into().unwrap());
        let ctx = req.id().context().unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 16).unwrap();
        let qp = {
            let c = cq.cq();
            req.id().create_qp(&pd, &c, &c, caps(4)).unwrap()
        };
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        qp.post_recv(RecvWr::new(
            0,
            pd.alloc_mr(4, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
        .unwrap();
        let (qp, mut id) = AsyncCmId::accept(req, qp, &ConnParam::new(), T)
            .await
            .unwrap();
        let mut got = tokio::time::timeout(T, cq.next()).await.unwrap().unwrap();
        got.result().unwrap();
        let n = u32::from_le_bytes(got.take_mr().unwrap().to_vec().unwrap().try_into().unwrap());
        assert_eq!(n, seq);
        qp.send(mr_with(&pd, &(seq + 1).to_le_bytes()))
            .await
            .unwrap()
            .result()
            .unwrap();
        let ev = tokio::time::timeout(T, id.event()).await.unwrap().unwrap();
        assert_eq!(ev.kind, CmEventKind::Disconnected);
        // The peer disconnected first: nothing to wait for (this waited
        // out its whole timeout, then failed).
        let t = Instant::now();
        id.disconnect(T).await.unwrap();
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        kept = Some(id);
    }
    (listener, kept)
}

/// Connect, message each way, disconnect, destroy: many times, every object
/// back at the end. The baseline is taken after one warm-up cycle, because
/// librdmacm opens the device (and allocates a PD of its own) on first use
/// and keeps them for the life of the process. 300 cycles by default (about
/// 10 s in the guest; `RDMA_VERBS_ASYNC_CYCLES` sets another count).
#[test]
fn cm_connect_accept_disconnect_cycles_leave_nothing_behind() {
    let _g = serial();
    let cycles: u32 = std::env::var("RDMA_VERBS_ASYNC_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let rt = runtime();
    let (before, after, elapsed) = rt.block_on(async {
        let server = addr(7471);
        let listener = Listener::bind(server, 16).unwrap();
        let srv = tokio::spawn(server_loop(listener, cycles + 1));
        client_cycle(server, 0).await;
        let before = counts();
        let t = Instant::now();
        for seq in 1..=cycles {
            client_cycle(server, seq * 2).await;
        }
        // The last id is kept, as the first one was when `before` was taken.
        let listener = tokio::time::timeout(T, srv).await.unwrap().unwrap();
        let elapsed = t.elapsed();
        let after = counts();
        drop(listener);
        (before, after, elapsed)
    });
    println!("{cycles} async rdma_cm connect/send/recv/disconnect cycles in {elapsed:?}");
    for k in ["qp", "cq", "mr", "pd", "cm_id"] {
        assert_eq!(
            before.get(k),
            after.get(k),
            "{k} count after {cycles} cycles"
        );
    }
}

/// Connecting to a port nobody listens on is refused within the bound.
#[test]
fn cm_connect_to_a_dead_port_is_an_error_not_a_hang() {
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        let t = Instant::now();
        let mut id = AsyncCmId::resolve(addr(7499), T).await.unwrap();
        let ctx = id.id().context().unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 8).unwrap();
        let qp = {
            let c = cq.cq();
            id.id().create_qp(&pd, &c, &c, caps(2)).unwrap()
        };
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        let e = id.connect(qp, &ConnParam::new(), T).await.unwrap_err();
        assert!(
            matches!(e, rdma_verbs::Error::CmEvent { .. }),
            "expected a REJECTED/UNREACHABLE event error, got {e:?}"
        );
        assert!(t.elapsed() < T, "took {:?}", t.elapsed());
    });
}

/// Async events arrive through the stream: GID_CHANGE when an address is
/// added to the netdev.
#[test]
fn async_events_arrive_on_the_stream() {
    let _g = serial();
    assert_eq!(
        std::env::var("RDMA_VERBS_DEVICE").ok().as_deref(),
        Some("rxe0"),
        "this test changes veth0's addresses and needs the soft-RoCE guest"
    );
    let rt = runtime();
    rt.block_on(async {
        let ctx = common::ctx();
        let mut events = AsyncEventStream::new(&ctx).unwrap();
        let ip = |args: &[&str]| {
            let st = std::process::Command::new("ip")
                .args(args)
                .status()
                .unwrap();
            assert!(st.success(), "ip {args:?}");
        };
        ip(&["addr", "add", "10.99.8.1/24", "dev", "veth0"]);
        let ev = tokio::time::timeout(Duration::from_secs(5), events.next()).await;
        ip(&["addr", "del", "10.99.8.1/24", "dev", "veth0"]);
        let ev = ev.expect("an event within 5 s").unwrap();
        assert_eq!(ev, AsyncEvent::GidChange { port: 1 });
    });
}

/// Starts `async_echo --server` on `port` and waits until it listens.
fn echo_server(port: u16) -> Proc {
    let args = vec!["--server".to_owned(), "--port".to_owned(), port.to_string()];
    let server = Proc::spawn(
        "async_echo",
        &example("async_echo"),
        &args,
        &format!("{port}"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server.output().contains("listening on port") {
        assert!(
            Instant::now() < deadline,
            "server never listened:\n{}",
            server.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server
}

fn echo_client(port: u16, conns: u32, msgs: u32) -> Proc {
    let ip = std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into());
    let args: Vec<String> = ["--client", &ip, "--port", &port.to_string()]
        .into_iter()
        .map(str::to_owned)
        .chain([
            "--conns".into(),
            conns.to_string(),
            "--msgs".into(),
            msgs.to_string(),
        ])
        .collect();
    Proc::spawn(
        "async_echo",
        &example("async_echo"),
        &args,
        &format!("{port}-client"),
    )
}

/// The example verifies every echoed byte over 32 concurrent connections,
/// then a client whose server is killed mid-run exits non-zero in bounded time.
#[test]
fn async_echo_verifies_every_byte_and_reports_a_dead_server() {
    let _g = serial();
    let server = echo_server(7481);
    let mut client = echo_client(7481, 32, 20);
    let st = client.wait_until(Instant::now() + Duration::from_secs(120));
    let out = client.output();
    assert!(
        st.is_some_and(|s| s.success()),
        "client failed: {st:?}\n{out}\nserver:\n{}",
        server.output()
    );
    assert!(
        out.contains("conns=32 msgs=20 size=4096 verified=640 "),
        "{out}"
    );

    let mut client = echo_client(7481, 4, 1_000_000);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        !client.output().contains("connections failed"),
        "the client failed while its server was alive:\n{}",
        client.output()
    );
    let killed = Instant::now();
    drop(server); // kills it
    let st = client.wait_until(killed + Duration::from_secs(30));
    let out = client.output();
    let st =
        st.unwrap_or_else(|| panic!("client still running 30 s after its server died:\n{out}"));
    assert!(!st.success(), "client exited 0 without its server:\n{out}");
    assert!(out.contains("connections failed"), "{out}");
    println!(
        "client noticed its server's death after {:?}",
        killed.elapsed()
    );
}

/// A receive awaited on a QP that takes its receives from an SRQ is refused
/// at once (rather than waiting for room forever); a
/// request waiting for room when its AsyncCq goes away gets its buffer back
/// (it used to hang); CQs whose runtime shut down fail their waiters from
/// another runtime instead of hanging.
#[test]
fn misuse_and_shutdown_end_in_errors_not_hangs() {
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        // An AsyncQp on an SRQ: recv is refused with QpUsesSrq.
        let ctx = common::ctx();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 64).unwrap();
        let srq = rdma_verbs::Srq::new(&pd, &cq.cq(), rdma_verbs::SrqAttr::new(8, 1)).unwrap();
        let qp = {
            let c = cq.cq();
            Qp::new_with_srq(&pd, &c, &c, &srq, caps(4)).unwrap()
        };
        let qp = qp.init(InitAttr::new(1, common::all_remote())).unwrap();
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let e = tokio::time::timeout(Duration::from_secs(5), qp.recv_into(mr))
            .await
            .expect("refused at once, not waiting for room")
            .unwrap_err();
        assert!(
            matches!(e.error, rdma_verbs::Error::QpUsesSrq { .. }),
            "{:?}",
            e.error
        );
        assert_eq!(e.unposted.len(), 1, "the buffer comes back");
    });

    rt.block_on(async {
        // A receive queue of depth 1: the second receive waits for room;
        // dropping the AsyncCq ends both waits, the second with its buffer.
        let AsyncPair {
            pd,
            cq_a,
            cq_b,
            a,
            b,
        } = async_pair(QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            ..QpCaps::default()
        });
        let b = Arc::new(b);
        let first = {
            let (b, mr) = (b.clone(), pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap());
            tokio::spawn(async move { b.recv_into(mr).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = {
            let (b, mr) = (b.clone(), pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap());
            tokio::spawn(async move { b.recv_into(mr).await.map(drop) })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "the queue is full: the second waits");
        drop(cq_b);
        let bound = Duration::from_secs(5);
        let r1 = tokio::time::timeout(bound, first)
            .await
            .expect("first ends")
            .unwrap();
        assert!(r1.is_err(), "no completion can come any more");
        let r2 = tokio::time::timeout(bound, second)
            .await
            .expect("second ends")
            .unwrap();
        let e = r2.expect_err("refused: the driver stopped");
        assert_eq!(e.unposted.len(), 1, "its buffer comes back unposted");
        drop((a, cq_a));
    });
    drop(rt);

    // CQs of a runtime that shut down: waiters on another runtime fail.
    let rt_a = runtime();
    let p = rt_a.block_on(async { async_pair(caps(4)) });
    drop(rt_a);
    let rt_b = runtime();
    rt_b.block_on(async {
        let mr = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        let r = tokio::time::timeout(Duration::from_secs(5), p.b.recv_into(mr))
            .await
            .expect("must not hang once the driver's runtime is gone");
        assert!(r.is_err());
    });
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
