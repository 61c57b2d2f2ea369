//! The tokio integration (`rdma_verbs::tokio`, feature `tokio`) on soft-RoCE, around the
//! data path: runtimes without IO or timers, rdma_cm connect/accept/disconnect cycles with
//! kernel objects back to baseline, async events, the async echo example, and misuse and
//! shutdown ending in errors, not hangs.
mod common;

use common::async_pair::{AsyncPair, async_pair, caps, mr_with, runtime};
use common::procs::{Proc, example};
use common::serial;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_verbs::cm::{CmEventKind, ConnParam, ConnectRequest};
use rdma_verbs::event::AsyncEvent;
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{Init, InitAttr, Qp, QpCaps, Rc, RecvWr, Rts};
use rdma_verbs::tokio::{AsyncChannel, AsyncCmId, AsyncCq, AsyncEventStream, AsyncQp, Listener};

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
    // timeout's timer cannot be registered (this panicked inside tokio). Someone
    // listens (and never accepts), so the connect starts on every provider and the
    // wait is what fails: iWARP's rdma_connect would fail first, with
    // ECONNREFUSED, on a port nobody listens on.
    let _listener = rdma_verbs::cm::CmId::listener(addr(7496), 1).expect("listen");
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
/// and keeps them for the life of the process. 100 cycles by default (about
/// 3 s in the guest; `RDMA_VERBS_ASYNC_CYCLES` sets another count): the counts must
/// come back exactly, so one object left per cycle shows after any number of cycles.
#[test]
fn cm_connect_accept_disconnect_cycles_leave_nothing_behind() {
    let _g = serial();
    let cycles: u32 = std::env::var("RDMA_VERBS_ASYNC_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
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
        // iWARP (siw): rdma_connect itself fails with ECONNREFUSED (iw_cm connects
        // the TCP stream synchronously).
        let refused_at_once = matches!(
            e,
            rdma_verbs::Error::Verb {
                verb: "rdma_connect",
                ..
            }
        ) && e.errno() == Some(libc::ECONNREFUSED);
        if common::iwarp(&ctx) {
            assert!(refused_at_once, "expected ECONNREFUSED on iWARP, got {e:?}");
            common::deviation("rdma_connect to a dead port fails with ECONNREFUSED, no event");
        } else {
            assert!(
                matches!(e, rdma_verbs::Error::CmEvent { .. }),
                "expected a REJECTED/UNREACHABLE event error, got {e:?}"
            );
        }
        assert!(t.elapsed() < T, "took {:?}", t.elapsed());
    });
}

/// Async events arrive through the stream: GID_CHANGE when an address is
/// added to the netdev.
#[test]
fn async_events_arrive_on_the_stream() {
    let _g = serial();
    assert!(
        matches!(
            std::env::var("RDMA_VERBS_DEVICE").ok().as_deref(),
            Some("rxe0" | "siw0")
        ),
        "this test changes veth0's addresses and needs the guest"
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
        let iwarp = common::iwarp(&ctx);
        ip(&["addr", "add", "10.99.8.1/24", "dev", "veth0"]);
        // siw raises no event for an address (its one GID is the MAC's): wait less.
        let within = Duration::from_secs(if iwarp { 2 } else { 5 });
        let ev = tokio::time::timeout(within, events.next()).await;
        ip(&["addr", "del", "10.99.8.1/24", "dev", "veth0"]);
        if iwarp {
            assert!(ev.is_err(), "an event on iWARP: {ev:?}");
            common::deviation("no GID_CHANGE on address changes: the GID is the MAC's");
            return;
        }
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
/// another runtime instead of hanging, and a CQ added to their channel then
/// is refused.
#[test]
fn misuse_and_shutdown_end_in_errors_not_hangs() {
    let _g = serial();
    let rt = runtime();
    rt.block_on(async {
        // An AsyncQp on an SRQ: recv is refused with QpUsesSrq.
        let ctx = common::ctx();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 64).unwrap();
        let srq =
            rdma_verbs::srq::Srq::new(&pd, &cq.cq(), rdma_verbs::srq::SrqAttr::new(8, 1)).unwrap();
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
        // A CQ added to that channel now would have no driver: refused.
        let e = AsyncCq::on_channel(p.cq_b.channel(), 16).expect_err("no driver serves it");
        assert!(
            matches!(e, rdma_verbs::Error::InvalidArgument { ref reason, .. }
                if reason.contains("driver has ended")),
            "{e:?}"
        );
    });
}

/// How many connections `many_ids_on_one_runtime_each_get_their_own_events`
/// sets up at once, and how many more abandon their connect.
#[derive(Clone, Copy)]
struct Many {
    up: u32,
    abandoned: u32,
}

impl Many {
    /// 64 and 8; on iWARP 16 and 4. The process's ids share one context, and
    /// siw cannot map a queue at page offset 144 of a context
    /// (`vm_provider_caps::siw_refuses_the_queue_at_mmap_offset_144_with_a_hint`):
    /// each connection maps 3 one-page queues on each side here.
    fn for_device(ctx: &rdma_verbs::context::Context) -> Many {
        if common::iwarp(ctx) {
            common::deviation(
                "16 connections at once, not 64: siw maps at most 144 queue pages in a context",
            );
            Many {
                up: 16,
                abandoned: 4,
            }
        } else {
            Many {
                up: 64,
                abandoned: 8,
            }
        }
    }
}

/// The server of `many_ids_...`: accepts every request whose private data is
/// below `many.up` (each on a task of its own: accept with `seq * 3`, send
/// `seq + 1000`, wait for DISCONNECTED, answer it) and keeps the others
/// unanswered until all `many.up` are served, then drops them (rejecting
/// peers whose ids are gone).
async fn many_server(listener: Listener, many: Many) -> u32 {
    let mut held = Vec::new();
    let mut tasks = tokio::task::JoinSet::new();
    while (tasks.len() as u32) < many.up || (held.len() as u32) < many.abandoned {
        let req = listener.request().await.unwrap();
        let seq = u32::from_le_bytes(req.private_data()[..4].try_into().unwrap());
        if seq >= many.up {
            held.push(req);
            continue;
        }
        tasks.spawn(async move {
            let (pd, _cq, qp) = request_qp(&req);
            let accept = ConnParam::new().private_data(&(seq * 3).to_le_bytes());
            let (qp, mut id) = AsyncCmId::accept(req, qp, &accept, T).await.unwrap();
            let reply = (seq + 1000).to_le_bytes();
            qp.send(mr_with(&pd, &reply))
                .await
                .unwrap()
                .result()
                .unwrap();
            let ev = tokio::time::timeout(T, id.event())
                .await
                .unwrap_or_else(|_| panic!("connection {seq}: no DISCONNECTED in {T:?}"))
                .unwrap();
            assert_eq!(ev.kind, CmEventKind::Disconnected, "connection {seq}");
            id.disconnect(T).await.unwrap();
            seq
        });
    }
    let mut served = 0;
    while let Some(seq) = tasks.join_next().await {
        assert!(seq.unwrap() < many.up);
        served += 1;
    }
    drop(held);
    served
}

/// A client of `many_ids_...` up to its connect: the id resolved towards
/// `server`, and its PD, QP and CQ.
async fn resolved_client(server: SocketAddr) -> (AsyncCmId, Pd, AsyncQp<Rc, Init>, AsyncCq) {
    let id = AsyncCmId::resolve(server, T).await.unwrap();
    let ctx = id.id().context().unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let cq = AsyncCq::new(&ctx, 8).unwrap();
    let qp = id.id().create_qp(&pd, &cq.cq(), &cq.cq(), caps(4)).unwrap();
    let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
    (id, pd, qp, cq)
}

/// A PD, an `AsyncCq` and an INIT `AsyncQp` on `req`'s device, to accept it with.
fn request_qp(req: &ConnectRequest) -> (Pd, AsyncCq, AsyncQp<Rc, Init>) {
    let ctx = req.id().context().unwrap();
    let pd = Pd::new(&ctx).unwrap();
    let cq = AsyncCq::new(&ctx, 8).unwrap();
    let qp = req
        .id()
        .create_qp(&pd, &cq.cq(), &cq.cq(), caps(4))
        .unwrap();
    let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
    (pd, cq, qp)
}

/// One client of `many_ids_...`: connects with `seq`, checks the accept's
/// private data and the server's message; gives the id and what it needs back.
async fn many_client(server: SocketAddr, seq: u32) -> (AsyncCmId, AsyncQp<Rc, Rts>, AsyncCq) {
    let (mut id, pd, qp, cq) = resolved_client(server).await;
    qp.post_recv(RecvWr::new(
        0,
        pd.alloc_mr(4, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let param = ConnParam::new().private_data(&seq.to_le_bytes());
    let (qp, ev) = id.connect(qp, &param, T).await.unwrap();
    assert_eq!(ev.kind, CmEventKind::Established);
    assert_eq!(
        ev.private_data[..4],
        (seq * 3).to_le_bytes(),
        "connection {seq}"
    );
    let mut got = tokio::time::timeout(T, cq.next()).await.unwrap().unwrap();
    got.result().unwrap();
    let got = got.take_mr().unwrap().to_vec().unwrap();
    assert_eq!(got, (seq + 1000).to_le_bytes(), "connection {seq}");
    (id, qp, cq)
}

/// A client that gives up: its connect's future is dropped while the server
/// holds the request, then its id is dropped. On iWARP the kernel holds the
/// QP until the server answers; the drop must not stall the runtime
/// (`vm_provider_caps::a_connect_dropped_while_the_server_holds_the_request_returns_at_once`).
async fn abandoning_client(server: SocketAddr, seq: u32) {
    let (mut id, _pd, qp, _cq) = resolved_client(server).await;
    let param = ConnParam::new().private_data(&seq.to_le_bytes());
    let connect = id.connect(qp, &param, T);
    if let Ok(r) = tokio::time::timeout(Duration::from_millis(300), connect).await {
        panic!(
            "the server holds the request: the connect waits; got {:?}",
            r.map(|(_, ev)| ev.kind)
        );
    }
    drop(id);
}

/// The ids of one runtime share one event channel: 64 connections (16 on
/// iWARP, see [`Many`]) set up at once each get their own events (the accept's
/// private data and a message, checked per connection), while 8 (4) more
/// clients drop their connect's future and their id mid-handshake, and 8 (4)
/// of the connections drop their id with its own DISCONNECTED still unread.
/// The others then disconnect normally, and every id and QP is gone at the end.
#[test]
fn many_ids_on_one_runtime_each_get_their_own_events() {
    let _g = serial();
    let many = Many::for_device(&common::ctx());
    let rt = runtime();
    let before = counts();
    rt.block_on(async {
        let server = addr(7481);
        let listener = Listener::bind(server, 128).unwrap();
        let srv = tokio::spawn(many_server(listener, many));
        let mut clients = tokio::task::JoinSet::new();
        for seq in 0..many.up {
            clients.spawn(async move { (seq, many_client(server, seq).await) });
        }
        let mut quitters = tokio::task::JoinSet::new();
        for seq in many.up..many.up + many.abandoned {
            quitters.spawn(abandoning_client(server, seq));
        }
        let mut up = Vec::new();
        while let Some(r) = clients.join_next().await {
            up.push(r.unwrap());
        }
        // The server holds the quitters' requests until every connection is
        // served (after the disconnects below), so each connect waits until
        // its client gives up.
        while let Some(r) = quitters.join_next().await {
            r.unwrap();
        }
        up.sort_by_key(|(seq, _)| *seq);
        let mut closing = tokio::task::JoinSet::new();
        for (seq, (mut id, qp, cq)) in up {
            closing.spawn(async move {
                if seq < many.abandoned {
                    // Its DISCONNECTED comes once the server answers; the id
                    // is dropped with it queued (or still in the kernel).
                    id.id().disconnect().unwrap();
                    tokio::time::sleep(Duration::from_millis(300)).await;
                } else {
                    let t = Instant::now();
                    id.disconnect(T).await.unwrap();
                    assert!(t.elapsed() < T, "connection {seq}");
                }
                drop((qp, cq, id));
            });
        }
        while let Some(r) = closing.join_next().await {
            r.unwrap();
        }
        let served = tokio::time::timeout(T, srv).await.unwrap().unwrap();
        assert_eq!(served, many.up);
    });
    drop(rt);
    let after = counts();
    for k in ["qp", "cq", "cm_id"] {
        assert_eq!(before.get(k), after.get(k), "{k} count at the end");
    }
}

/// A connect whose future is dropped leaves its id without a QP; when the
/// server accepts afterwards, the late answer is an error that says so, not
/// an event a caller could take for a connection.
#[test]
fn a_reply_to_a_cancelled_connect_is_an_error_that_says_so() {
    let rt = runtime();
    rt.block_on(async {
        let param = ConnParam::new();
        let listener = Listener::bind(addr(7482), 4).unwrap();
        let client = async {
            let (mut id, pd, qp, cq) = resolved_client(addr(7482)).await;
            let connect = id.connect(qp, &param, T);
            let cancelled = tokio::time::timeout(Duration::from_millis(300), connect).await;
            assert!(cancelled.is_err(), "the server holds the request");
            (id, pd, cq)
        };
        let (req, (mut id, _pd, _cq)) = tokio::join!(listener.request(), client);
        let req = req.unwrap();
        let iwarp = common::iwarp(&req.id().context().unwrap());
        let (_pd, _cq, qp) = request_qp(&req);
        let accept = AsyncCmId::accept(req, qp, &param, Duration::from_millis(500));
        let (accepted, late) = tokio::join!(accept, tokio::time::timeout(T, id.event()));
        match accepted {
            Err(_) => {}
            // iWARP: the kernel's CM answers the MPA request of the abandoned
            // id itself, so the server's accept completes.
            Ok(_) if iwarp => common::deviation("the accept of a cancelled connect completed"),
            Ok(_) => panic!("accepted a cancelled connect"),
        }
        match late.expect("the late answer arrives") {
            Err(rdma_verbs::Error::CmEvent {
                event: CmEventKind::ConnectResponse | CmEventKind::Established,
                hint: Some(hint),
                ..
            }) => assert!(hint.contains("abandoned"), "{hint}"),
            other if iwarp => {
                common::deviation(&format!("a reply to a cancelled connect: {other:?}"))
            }
            other => panic!("expected the late answer as an error, got {other:?}"),
        }
    });
}

/// `cm::accept_all` refuses a listener whose events the runtime reads (it
/// would wait on a channel the runtime empties) with a typed error.
#[test]
fn accept_all_refuses_an_async_listener() {
    let rt = runtime();
    rt.block_on(async {
        let listener = Listener::bind(addr(7498), 4).unwrap();
        let r = rdma_verbs::cm::accept_all(listener.id(), 1, &ConnParam::new(), T, |_| {
            unreachable!("no request is taken")
        });
        assert!(
            matches!(
                r.as_slice(),
                [Err(rdma_verbs::Error::InvalidArgument {
                    what: "listener",
                    ..
                })]
            ),
            "{r:?}"
        );
    });
}

/// A waker that calls back into the cm API (as an executor that polls the
/// task inside `wake` does) runs once the runtime's reader has released the
/// channel's lock: it gets its answer, and the channel's ids go on.
#[test]
fn a_waker_that_calls_into_the_id_does_not_stop_the_channel() {
    use std::future::Future;
    use std::sync::mpsc;
    use std::task::{Context, Wake, Waker};

    struct AsksTheListener(Arc<Listener>, mpsc::Sender<bool>);
    impl Wake for AsksTheListener {
        fn wake(self: Arc<Self>) {
            let _ = self.1.send(self.0.id().local_addr().is_some());
        }
    }

    let _g = serial();
    let rt = runtime();
    let _in_rt = rt.enter();
    let listener = Arc::new(Listener::bind(addr(7499), 4).unwrap());
    let (tx, woken) = mpsc::channel();
    let waker = Waker::from(Arc::new(AsksTheListener(listener.clone(), tx)));
    let mut request = Box::pin(listener.request());
    assert!(
        request
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
    );
    // The client's request is routed by the runtime's reader, which wakes
    // the waker above.
    let client = rt.spawn(async {
        let mut id = AsyncCmId::resolve(addr(7499), T).await.unwrap();
        let ctx = id.id().context().unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 4).unwrap();
        let qp = id.id().create_qp(&pd, &cq.cq(), &cq.cq(), caps(2)).unwrap();
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        // Refused: the server rejects the request below.
        id.connect(qp, &ConnParam::new(), T).await.map(drop)
    });
    assert_eq!(woken.recv_timeout(T), Ok(true), "the waker got its answer");
    let got = rt.block_on(async { tokio::time::timeout(T, request).await });
    let req = got.expect("the request is ready").expect("a request");
    drop(req);
    let refused = rt.block_on(async { tokio::time::timeout(T, client).await });
    let refused = refused.expect("the client ends").unwrap();
    assert!(refused.is_err(), "the dropped request rejects the client");
    assert!(
        listener.id().local_addr().is_some(),
        "the listener still answers"
    );
}
