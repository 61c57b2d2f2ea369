//! Many rdma_cm connections at once from one thread (`cm::connect_all`,
//! `cm::accept_all`) on real soft-RoCE: every connection's data and ids checked,
//! failures reported in their place. Runs in the guest (`cargo xtask test`).

mod common;

use std::net::SocketAddr;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{send_bytes, wait};
use rdma_verbs::Error;
use rdma_verbs::cm::{CmEventKind, CmId, ConnParam, Connected};
use rdma_verbs::cq::{CompletionSource, Cq, WcStatus};
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{QpCaps, RecvWr};

const T: Duration = Duration::from_secs(20);

/// Disconnects every connection, then waits for each one's DISCONNECTED: all
/// at once, as the server answers them in its own order.
fn disconnect_all(conns: &[Connected]) {
    for c in conns {
        c.id.disconnect().expect("disconnect");
    }
    for c in conns {
        c.id.expect_event(CmEventKind::Disconnected, T)
            .expect("DISCONNECTED on the client");
    }
}

/// One request each way: nine QPs share a CQ of 64 (siw cannot grow a CQ).
fn one_each() -> QpCaps {
    QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
        ..QpCaps::default()
    }
}

/// `connect_all` sets up eight connections to one listener at once and reports
/// the one destination nobody listens on as its own error, in its place: each
/// connection gets its own accept private data and its own message, matched by
/// QP number on the client's shared CQ, and disconnects on its own.
#[test]
fn connect_all_sets_up_many_connections_and_reports_each_failure() {
    const N: u8 = 8;
    let addr = common::guest_at(20111);
    let dead = common::guest_at(20112);
    let (ready_tx, ready_rx) = mpsc::channel();
    let server = thread::spawn(move || {
        let listener = CmId::listener(addr, 16).expect("listen");
        ready_tx.send(()).expect("signal");
        let mut dev: Option<(Pd, Cq)> = None;
        let mut conns = Vec::new();
        let mut peers = Vec::new();
        for k in 0..N {
            let req = listener.get_request(T).expect("connect request");
            assert!(
                req.private_data().starts_with(b"all"),
                "{:?}",
                req.private_data()
            );
            if dev.is_none() {
                let ctx = req.id().context().expect("context");
                dev = Some((Pd::new(&ctx).expect("pd"), Cq::new(&ctx, 64).expect("cq")));
            }
            let (pd, cq) = dev.as_ref().expect("made above");
            let qp = req.id().create_qp(pd, cq, cq, one_each()).expect("qp");
            let (mut qp, id) = req
                .accept(qp, &ConnParam::new().private_data(&[k]), T)
                .expect("accept");
            send_bytes(pd, &mut qp, u64::from(k), format!("server {k}").as_bytes());
            peers.push(id.peer_addr().expect("the client's address"));
            conns.push((qp, id));
        }
        let (_, cq) = dev.as_mut().expect("made above");
        for c in wait(cq, usize::from(N)) {
            c.result().expect("send ok");
        }
        for (_qp, id) in &conns {
            id.expect_event(CmEventKind::Disconnected, T)
                .expect("DISCONNECTED on the server");
            // The reply the client's disconnect waits for.
            id.disconnect().expect("disconnect reply");
        }
        peers
    });
    ready_rx.recv_timeout(T).expect("server listening");

    let mut dsts = vec![addr; usize::from(N) + 1];
    dsts[3] = dead;
    let mut dev: Option<(Pd, Cq)> = None;
    let mut made = 0;
    let results =
        rdma_verbs::cm::connect_all(&dsts, &ConnParam::new().private_data(b"all"), T, |id| {
            if dev.is_none() {
                let ctx = id.context()?;
                dev = Some((Pd::new(&ctx)?, Cq::new(&ctx, 64)?));
            }
            let (pd, cq) = dev.as_ref().expect("made above");
            let mut qp = id.create_qp(pd, cq, cq, one_each())?;
            qp.post_recv(RecvWr::new(
                made,
                pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?,
            ))?;
            made += 1;
            Ok(qp)
        });
    assert_eq!(results.len(), dsts.len());
    let mut results: Vec<_> = results.into_iter().collect();
    let refused = results.remove(3);
    let iwarp = common::iwarp(&common::ctx());
    match refused {
        Err(Error::CmEvent {
            event: CmEventKind::Rejected | CmEventKind::Unreachable | CmEventKind::ConnectError,
            ..
        }) => {}
        // iWARP (siw on 6.1): rdma_connect connects the TCP stream itself.
        Err(
            e @ Error::Verb {
                verb: "rdma_connect",
                ..
            },
        ) if iwarp && e.errno() == Some(libc::ECONNREFUSED) => {}
        other => panic!("the dead port: expected REJECTED or UNREACHABLE, got {other:?}"),
    }
    let conns: Vec<_> = results
        .into_iter()
        .map(|r| r.expect("a connection to the listener"))
        .collect();
    // Each connection's accept data names the message the server sent on it.
    let mut by_qp = std::collections::HashMap::new();
    for c in &conns {
        assert_eq!(c.established.kind, CmEventKind::Established);
        by_qp.insert(c.qp.qp_num(), c.established.private_data[0]);
    }
    assert_eq!(by_qp.len(), usize::from(N), "distinct QPs");
    let mut seen: Vec<u8> = by_qp.values().copied().collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..N).collect::<Vec<_>>());
    // The refused connection's receive may come back flushed (its QP went to
    // ERR and was destroyed, releasing the buffer): a stale completion, whose
    // QP number a new QP may have taken since (siw reuses them). Every other
    // receive comes with its message.
    let (_, cq) = dev.as_mut().expect("made by make_qp");
    let (mut received, mut flushed) = (0, 0);
    while received < N {
        for mut c in wait(cq, 1) {
            if c.source == CompletionSource::Stale {
                assert_eq!(c.status, WcStatus::WrFlushErr, "{c:?}");
                assert!(
                    c.take_mr().is_none(),
                    "a stale completion carries no buffer"
                );
                flushed += 1;
                continue;
            }
            let k = by_qp[&c.qp_num];
            c.result().expect("recv ok");
            let data = c.take_mr().expect("buffer").to_vec().expect("copy");
            assert_eq!(
                &data[..c.byte_len as usize],
                format!("server {k}").as_bytes()
            );
            received += 1;
        }
    }
    assert!(flushed <= 1, "{flushed} flushed receives");
    // Each id is its QP's: the server saw connection k come from the address
    // of the id whose event carried k.
    let locals: Vec<(u8, Option<SocketAddr>)> = conns
        .iter()
        .map(|c| (by_qp[&c.qp.qp_num()], c.id.local_addr()))
        .collect();
    disconnect_all(&conns);
    let peers = server.join().expect("server thread");
    for (k, local) in locals {
        assert_eq!(Some(peers[usize::from(k)]), local, "connection {k}");
    }
    // No timeout is too long: the deadlines saturate.
    let mut dev: Option<(Pd, Cq)> = None;
    let r = rdma_verbs::cm::connect_all(&[dead], &ConnParam::new(), Duration::MAX, |id| {
        let ctx = id.context()?;
        let (pd, cq) = dev.insert((Pd::new(&ctx)?, Cq::new(&ctx, 4)?));
        id.create_qp(pd, cq, cq, one_each())
    });
    assert!(r[0].is_err(), "nobody listens on {dead}");
}

/// `accept_all` against `connect_all`: eight connections set up at once on
/// both sides, each request's private data seen by `make_qp`, one result per
/// request, one message per connection, each connection's two ids paired
/// with their QPs (the client id whose QP got message k is the peer of the
/// server's id k), and a listener nobody calls anymore ends the taking after
/// `timeout` with what it took.
#[test]
fn accept_all_takes_many_requests_at_once() {
    const N: usize = 8;
    let addr = common::guest_at(20113);
    let listener = CmId::listener(addr, 16).expect("listen");
    let server = thread::spawn(move || {
        let mut dev: Option<(Pd, Cq)> = None;
        let mut seen = Vec::new();
        let conns = rdma_verbs::cm::accept_all(&listener, N, &ConnParam::new(), T, |req| {
            seen.push(req.private_data()[..3].to_vec());
            if dev.is_none() {
                let ctx = req.id().context()?;
                dev = Some((Pd::new(&ctx)?, Cq::new(&ctx, 64)?));
            }
            let (pd, cq) = dev.as_ref().expect("made above");
            req.id().create_qp(pd, cq, cq, one_each())
        });
        assert_eq!(conns.len(), N);
        assert!(seen.iter().all(|p| p == b"all"), "{seen:?}");
        let mut conns: Vec<_> = conns.into_iter().map(|c| c.expect("accepted")).collect();
        let (pd, cq) = dev.as_mut().expect("made by make_qp");
        let mut peers = Vec::new();
        for (k, c) in conns.iter_mut().enumerate() {
            send_bytes(pd, &mut c.qp, k as u64, format!("server {k}").as_bytes());
            peers.push(c.id.peer_addr().expect("the client's address"));
        }
        for c in wait(cq, N) {
            c.result().expect("send ok");
        }
        for c in &conns {
            c.id.expect_event(CmEventKind::Disconnected, T)
                .expect("DISCONNECTED on the server");
            c.id.disconnect().expect("disconnect reply");
        }
        // Nobody calls any more: the taking ends after its timeout, with none.
        let t = Instant::now();
        let none = rdma_verbs::cm::accept_all(
            &listener,
            1,
            &ConnParam::new(),
            Duration::from_millis(200),
            |_| unreachable!("no request comes"),
        );
        assert!(none.is_empty(), "{} results", none.len());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        peers
    });
    let mut dev: Option<(Pd, Cq)> = None;
    let conns: Vec<_> = rdma_verbs::cm::connect_all(
        &[addr; N],
        &ConnParam::new().private_data(b"all"),
        T,
        |id| {
            let ctx = id.context()?;
            if dev.is_none() {
                dev = Some((Pd::new(&ctx)?, Cq::new(&ctx, 64)?));
            }
            let (pd, cq) = dev.as_ref().expect("made above");
            let mut qp = id.create_qp(pd, cq, cq, one_each())?;
            qp.post_recv(RecvWr::new(0, pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?))?;
            Ok(qp)
        },
    )
    .into_iter()
    .map(|r| r.expect("connected"))
    .collect();
    let (_, cq) = dev.as_mut().expect("made by make_qp");
    let mut got = std::collections::HashMap::new();
    for mut c in wait(cq, N) {
        c.result().expect("recv ok");
        let data = c.take_mr().expect("buffer").to_vec().expect("copy");
        let text = String::from_utf8(data[..c.byte_len as usize].to_vec()).expect("utf-8");
        let k: usize = text
            .strip_prefix("server ")
            .and_then(|k| k.parse().ok())
            .unwrap_or_else(|| panic!("message {text:?}"));
        assert!(
            got.insert(c.qp_num, k).is_none(),
            "two messages on QP {}",
            c.qp_num
        );
    }
    let locals: Vec<(usize, Option<SocketAddr>)> = conns
        .iter()
        .map(|c| (got[&c.qp.qp_num()], c.id.local_addr()))
        .collect();
    disconnect_all(&conns);
    let peers = server.join().expect("server thread");
    let mut ks: Vec<usize> = locals.iter().map(|(k, _)| *k).collect();
    ks.sort_unstable();
    assert_eq!(ks, (0..N).collect::<Vec<_>>());
    for (k, local) in locals {
        assert_eq!(Some(peers[k]), local, "connection {k}");
    }
}
