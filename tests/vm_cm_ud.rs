//! rdma_cm for UD on soft-RoCE: a UD id resolves the listener's QP number
//! and Q_Key (SIDR), datagrams go both ways with their bytes and GRH checked,
//! refusals come back as typed errors in bounded time, and the crate talks to
//! rdma-core's `udaddy` (rdmacm-utils) in both roles. Runs in the guest
//! (`cargo xtask test`); without an RDMA device every test fails.

mod common;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::procs::{Proc, example};
use common::{pattern, serial, wait};
use rdma_verbs::ah::{GRH_LEN, grh_source_gid};
use rdma_verbs::cm::{CmEventKind, CmId, ConnParam, UDP_QKEY, UdPeer};
use rdma_verbs::prelude::*;
use rdma_verbs::qp::UdMessage;

/// Upper bound for any handshake step (TCG is slow).
const T: Duration = Duration::from_secs(20);
/// What address resolution is given before it must report an error.
const RESOLVE: Duration = Duration::from_millis(2000);
/// udaddy's fixed port, message size and count (its defaults).
const UDADDY_PORT: u16 = 7174;
const UDADDY_SIZE: usize = 100;
const UDADDY_COUNT: usize = 10;

/// The GID a datagram from this host carries as its source (RoCE v2 over IPv4).
fn own_gid() -> Gid {
    let v6 = match common::guest_ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    v6.to_string().parse().expect("a GID")
}

fn caps(n: u32) -> QpCaps {
    QpCaps {
        max_send_wr: n,
        max_recv_wr: n,
        ..QpCaps::default()
    }
}

/// PD, CQ and a UD QP (in RTS) on `id`'s device.
fn setup(id: &CmId, n: u32) -> (Pd, Cq, Qp<Ud, Rts>) {
    let ctx = id.context().expect("the id's device context");
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 4).expect("cq (grown by the QP)");
    let qp = id
        .create_ud_qp(&pd, &cq, &cq, caps(n))
        .expect("rdma_create_qp (UD)");
    (pd, cq, qp)
}

/// Posts `n` receives of `len` payload bytes each.
fn post_recvs(pd: &Pd, qp: &mut Qp<Ud, Rts>, n: usize, len: usize) {
    for i in 0..n {
        let grh = pd.alloc_mr(GRH_LEN, AccessFlags::LOCAL_WRITE).expect("grh");
        let payload = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).expect("payload");
        qp.post_recv(UdRecvWr::new(100 + i as u64, grh, payload))
            .expect("post recv");
    }
}

fn mr_with(pd: &Pd, data: &[u8]) -> Mr {
    let mut mr = pd.alloc_mr(data.len(), AccessFlags::empty()).expect("mr");
    mr.as_mut_slice().expect("slice").copy_from_slice(data);
    mr
}

/// Waits for `n` successful completions of `opcode` on `cq`, taking each
/// receive apart (completion and message); sends come back with no message.
fn collect(cq: &mut Cq, n: usize, opcode: WcOpcode) -> Vec<(Completion, Option<UdMessage>)> {
    let mut out = Vec::new();
    for mut c in wait(cq, n) {
        c.result().expect("completion status");
        assert_eq!(c.opcode, opcode, "{c:?}");
        let msg = (opcode == WcOpcode::Recv).then(|| c.take_ud().expect("a UD receive"));
        out.push((c, msg));
    }
    out
}

fn payload_of(msg: &UdMessage) -> Vec<u8> {
    let mr = msg.payload.as_ref().expect("payload buffer");
    mr.to_vec().expect("copy")[..msg.len as usize].to_vec()
}

/// A client: a resolved UD id with its QP and `recvs` receives posted.
fn client(addr: SocketAddr, recvs: usize, len: usize) -> (CmId, Pd, Cq, Qp<Ud, Rts>) {
    let id = CmId::new_ud()
        .expect("rdma_cm UD id (this test needs an RDMA device: run it with `cargo xtask test`)");
    id.resolve(addr, RESOLVE)
        .expect("resolve address and route");
    let (pd, cq, mut qp) = setup(&id, 16);
    post_recvs(&pd, &mut qp, recvs, len);
    (id, pd, cq, qp)
}

#[test]
fn ours_to_ours_sends_both_ways() {
    let addr = common::guest_at(20301);
    let (ready_tx, ready_rx) = mpsc::channel();
    let (qpn_tx, qpn_rx) = mpsc::channel();
    let server = thread::spawn(move || {
        let listener = CmId::ud_listener(addr, 4).expect("listen (UD)");
        ready_tx.send(()).expect("signal");
        let req = listener.get_request(T).expect("UD connect request");
        assert!(
            req.private_data().starts_with(b"ud-client"),
            "request private data: {:?}",
            req.private_data()
        );
        let (pd, mut cq, mut qp) = setup(req.id(), 16);
        qpn_tx.send(qp.qp_num()).expect("qpn");
        post_recvs(&pd, &mut qp, 1, 64);
        let _id = req
            .accept_ud(&qp, &ConnParam::new().private_data(b"ud-server"))
            .expect("accept (SIDR reply)");
        let (c, msg) = collect(&mut cq, 1, WcOpcode::Recv).pop().unwrap();
        let msg = msg.unwrap();
        // The GRH's 40 bytes are counted in byte_len and kept out of the payload.
        assert_eq!(c.byte_len as usize, GRH_LEN + 13, "{c:?}");
        assert!(c.has_grh(), "a RoCE UD receive has a GRH");
        assert_eq!(msg.sgid, Some(own_gid()));
        assert_eq!(grh_source_gid(&msg.grh_bytes), Some(own_gid()));
        let got = payload_of(&msg);
        let peer = UdPeer::reply_to(&qp, &c, &msg).expect("address handle from the completion");
        assert_eq!(peer.qpn, msg.src_qp);
        assert_eq!(peer.qkey, UDP_QKEY);
        qp.post_send(peer.send_from(2, mr_with(&pd, b"pong from the UD server")))
            .expect("post reply");
        collect(&mut cq, 1, WcOpcode::Send);
        (got, msg.src_qp)
    });
    ready_rx.recv_timeout(T).expect("server listening");

    let (_id, pd, mut cq, mut qp) = client(addr, 1, 64);
    assert_eq!(qp.query().expect("query").qkey, UDP_QKEY);
    let (peer, ev) = _id
        .connect_ud(&qp, &ConnParam::new().private_data(b"ud-client"), T)
        .expect("connect (SIDR)");
    assert_eq!(ev.kind, CmEventKind::Established);
    assert!(ev.private_data.starts_with(b"ud-server"), "{ev:?}");
    let server_qpn = qpn_rx.recv_timeout(T).expect("server qpn");
    assert_eq!(peer.qpn, server_qpn);
    assert_eq!(peer.qkey, UDP_QKEY);
    assert_eq!(ev.ud.expect("UD parameters").qp_num, server_qpn);

    qp.post_send(peer.send_from(1, mr_with(&pd, b"ping (client)")))
        .expect("post send");
    let mut sends = 0;
    let mut reply = None;
    while sends < 1 || reply.is_none() {
        let mut c = wait(&mut cq, 1).pop().unwrap();
        c.result().expect("client completion");
        match c.opcode {
            WcOpcode::Send => sends += 1,
            WcOpcode::Recv => {
                let msg = c.take_ud().expect("UD receive");
                assert_eq!(c.byte_len as usize, GRH_LEN + 23);
                assert_eq!(msg.src_qp, server_qpn);
                assert_eq!(msg.sgid, Some(own_gid()));
                reply = Some(payload_of(&msg));
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(reply.unwrap(), b"pong from the UD server");
    let (got, src_qp) = server.join().expect("server thread");
    assert_eq!(got, b"ping (client)");
    assert_eq!(src_qp, qp.qp_num());
}

#[test]
fn nobody_listening_is_unreachable_in_bounded_time() {
    let (id, _pd, _cq, qp) = client(common::guest_at(20302), 0, 0);
    let t = Instant::now();
    let err = id
        .connect_ud(&qp, &ConnParam::new(), T)
        .expect_err("nobody listens on 20302");
    match &err {
        Error::CmEvent { event, status, .. } => {
            assert_eq!(*event, CmEventKind::Unreachable, "{err}");
            assert_eq!(*status, 1, "SIDR status 1 (no listener): {err}");
        }
        other => panic!("expected a CmEvent error, got {other:?}"),
    }
    assert!(err.to_string().contains("nobody listens"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

#[test]
fn a_qp_with_another_qkey_is_refused_and_the_client_sees_the_reject() {
    let addr = common::guest_at(20303);
    let (ready_tx, ready_rx) = mpsc::channel();
    let server = thread::spawn(move || {
        let listener = CmId::ud_listener(addr, 4).expect("listen (UD)");
        ready_tx.send(()).expect("signal");
        let req = listener.get_request(T).expect("UD connect request");
        let ctx = req.id().context().expect("context");
        let pd = Pd::new(&ctx).expect("pd");
        let cq = Cq::new(&ctx, 4).expect("cq");
        let qp = Qp::new_ud(&pd, &cq, &cq, caps(4))
            .expect("ud qp")
            .init(UdInitAttr::new(req.id().port_num(), 0x1111_1111))
            .expect("init")
            .ready()
            .expect("rts");
        // Refused before the SIDR reply; the dropped request rejects the client.
        match req.accept_ud(&qp, &ConnParam::new()) {
            Err(Error::InvalidArgument { what, reason }) => {
                assert_eq!(what, "queue pair");
                assert!(reason.contains("Q_Key"), "{reason}");
            }
            other => panic!("expected the Q_Key refusal, got {other:?}"),
        }
    });
    ready_rx.recv_timeout(T).expect("server listening");
    let (id, _pd, _cq, qp) = client(addr, 0, 0);
    let err = id
        .connect_ud(&qp, &ConnParam::new(), T)
        .expect_err("the server rejects");
    match &err {
        Error::CmEvent { event, status, .. } => {
            assert_eq!(*event, CmEventKind::Unreachable, "{err}");
            assert_eq!(*status, 2, "SIDR status 2 (rejected): {err}");
        }
        other => panic!("expected a CmEvent error, got {other:?}"),
    }
    server.join().expect("server thread");
}

#[test]
fn rc_and_ud_calls_refuse_the_other_port_space() {
    let ud = CmId::new_ud().expect("UD id");
    ud.resolve(common::guest_at(20304), RESOLVE)
        .expect("resolve");
    let ctx = ud.context().expect("context");
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 4).expect("cq");
    match ud.create_qp(&pd, &cq, &cq, caps(4)) {
        Err(Error::InvalidArgument { what, reason }) => {
            assert_eq!(what, "rdma_cm id");
            assert!(reason.contains("create_ud_qp"), "{reason}");
        }
        other => panic!("an RC QP on a UD id: {other:?}"),
    }
    let rc = CmId::new().expect("RC id");
    rc.resolve(common::guest_at(20304), RESOLVE)
        .expect("resolve");
    match rc.create_ud_qp(&pd, &cq, &cq, caps(4)) {
        Err(Error::InvalidArgument { what, reason }) => {
            assert_eq!(what, "rdma_cm id");
            assert!(reason.contains("new_ud"), "{reason}");
        }
        other => panic!("a UD QP on an RC id: {other:?}"),
    }
}

// --- interop with rdma-core's udaddy ----------------------------------------

fn udaddy() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("udaddy"))
        .find(|p| p.is_file())
        .expect("udaddy not found on PATH: install rdmacm-utils")
}

/// Waits for udaddy to exit 0 with its closing lines, by `deadline`.
fn udaddy_done(mut p: Proc, deadline: Instant) -> String {
    let st = p.wait_until(deadline);
    let out = p.output();
    assert!(
        st.is_some_and(|s| s.success()),
        "`{}` failed or was not done in time ({st:?}):\n{out}",
        p.name
    );
    for line in ["data transfers complete", "return status 0"] {
        assert!(out.contains(line), "udaddy printed no `{line}`:\n{out}");
    }
    out
}

#[test]
fn ours_client_against_udaddy_server() {
    let _serial = serial();
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = Proc::spawn("udaddy", &udaddy(), &[], "udaddy-server");
    let msg = pattern(UDADDY_SIZE, 7);
    // udaddy listens on no TCP port to watch: ask until it answers.
    let (id, pd, mut cq, mut qp, peer) = loop {
        let (id, pd, cq, qp) = client(common::guest_at(UDADDY_PORT), UDADDY_COUNT, UDADDY_SIZE);
        match id.connect_ud(&qp, &ConnParam::new(), T) {
            Ok((peer, _)) => break (id, pd, cq, qp, peer),
            Err(Error::CmEvent { status: 1, .. }) if Instant::now() < deadline => {
                thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("connect to udaddy: {e}\n{}", server.output()),
        }
    };
    assert_eq!(peer.qkey, UDP_QKEY);
    // udaddy answers to the QPN in the immediate data.
    for i in 0..UDADDY_COUNT {
        qp.post_send(
            peer.send_from(i as u64, mr_with(&pd, &msg))
                .imm(qp.qp_num()),
        )
        .expect("post send");
    }
    let mut replies = Vec::new();
    let mut sends = 0;
    while replies.len() < UDADDY_COUNT || sends < UDADDY_COUNT {
        let mut c = wait(&mut cq, 1).pop().unwrap();
        c.result().expect("completion");
        match c.opcode {
            WcOpcode::Send => sends += 1,
            WcOpcode::Recv => {
                let m = c.take_ud().expect("UD receive");
                assert_eq!(c.byte_len as usize, GRH_LEN + UDADDY_SIZE);
                assert_eq!(m.src_qp, peer.qpn);
                assert_eq!(
                    m.imm_data,
                    Some(peer.qpn),
                    "udaddy sends its QPN as immediate data"
                );
                replies.push(payload_of(&m));
            }
            other => panic!("unexpected {other}"),
        }
    }
    // udaddy sends the first 100 bytes of its receive buffer: the GRH of our
    // last datagram, then the first 60 bytes of its payload.
    for r in &replies {
        assert_eq!(grh_source_gid(&r[..GRH_LEN]), Some(own_gid()));
        assert_eq!(&r[GRH_LEN..], &msg[..UDADDY_SIZE - GRH_LEN]);
    }
    udaddy_done(server, deadline);
    drop((qp, id));
}

#[test]
fn udaddy_client_against_ours_server() {
    let _serial = serial();
    let ctx = common::ctx();
    if common::iwarp(&ctx) {
        // No UD on iWARP: the crate refuses the QP (udaddy would fail on its side, and
        // the listener wait for its request).
        let pd = rdma_verbs::pd::Pd::new(&ctx).unwrap();
        let cq = rdma_verbs::cq::Cq::new(&ctx, 16).unwrap();
        match rdma_verbs::qp::Qp::new_ud(&pd, &cq, &cq, common::caps_sr(4, 4)) {
            Err(e @ rdma_verbs::Error::Unsupported { .. }) => panic!("{e}"),
            other => panic!(
                "a UD QP on iWARP: expected Unsupported, got {:?}",
                other.err()
            ),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let listener = CmId::ud_listener(common::guest_at(UDADDY_PORT), 4).expect("listen (UD)");
    let host = common::guest_ip().to_string();
    let client = Proc::spawn("udaddy", &udaddy(), &["-s".into(), host], "udaddy-client");
    let req = listener.get_request(T).expect("udaddy's request");
    let (pd, mut cq, mut qp) = setup(req.id(), 16);
    post_recvs(&pd, &mut qp, UDADDY_COUNT, UDADDY_SIZE);
    let _id = req.accept_ud(&qp, &ConnParam::new()).expect("accept");
    let got = collect(&mut cq, UDADDY_COUNT, WcOpcode::Recv);
    let (c0, m0) = &got[0];
    let m0 = m0.as_ref().unwrap();
    for (c, m) in &got {
        let m = m.as_ref().unwrap();
        assert_eq!(c.byte_len as usize, GRH_LEN + UDADDY_SIZE);
        assert_eq!(
            m.imm_data,
            Some(m.src_qp),
            "udaddy sends its QPN as immediate data"
        );
        assert_eq!(m.src_qp, m0.src_qp);
        assert_eq!(m.sgid, Some(own_gid()));
    }
    let peer = UdPeer::reply_to(&qp, c0, m0).expect("reply address");
    let reply = pattern(UDADDY_SIZE, 9);
    for i in 0..UDADDY_COUNT {
        qp.post_send(peer.send_from(i as u64, mr_with(&pd, &reply)))
            .expect("post reply");
    }
    collect(&mut cq, UDADDY_COUNT, WcOpcode::Send);
    udaddy_done(client, deadline);
}

/// Runs `spawn()`'s program until it does not fail fast (its server was
/// not listening yet: SIDR status 1), by `deadline`.
fn until_served(spawn: impl Fn() -> Proc, deadline: Instant) -> Proc {
    loop {
        let mut p = spawn();
        let started = Instant::now();
        let quick = p.wait_until(started + Duration::from_secs(2));
        let refused = quick.is_some_and(|s| !s.success()) && p.output().contains("error: 1");
        if !refused || Instant::now() >= deadline {
            return p;
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// Waits for our `ud_cm` example to exit 0 having heard every datagram with `line`.
fn ud_cm_done(mut p: Proc, deadline: Instant, line: &str) {
    let st = p.wait_until(deadline);
    let out = p.output();
    assert!(
        st.is_some_and(|s| s.success()),
        "ud_cm failed or was not done in time ({st:?}):\n{out}"
    );
    for want in [line, "data transfers complete", "return status 0"] {
        assert!(out.contains(want), "ud_cm printed no `{want}`:\n{out}");
    }
}

/// examples/ud_cm.rs against udaddy with the same flags, both roles: our
/// client checks every echoed reply, our server every datagram's length and
/// immediate data (udaddy's payload is an uninitialised buffer).
#[test]
fn ud_cm_example_against_udaddy_both_ways() {
    let _serial = serial();
    let host = common::guest_ip().to_string();
    let flags = |s: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = s.iter().map(|a| a.to_string()).collect();
        v.extend(["-C", "10", "-S", "100"].map(String::from));
        v
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let server = Proc::spawn("udaddy", &udaddy(), &flags(&[]), "udaddy-server");
    let client = until_served(
        || {
            Proc::spawn(
                "ud_cm",
                &example("ud_cm"),
                &flags(&["-s", &host]),
                "ud_cm-client",
            )
        },
        deadline,
    );
    ud_cm_done(
        client,
        deadline,
        "received 10 of 10: 10 verified, 0 from a C udaddy",
    );
    udaddy_done(server, deadline);

    let deadline = Instant::now() + Duration::from_secs(60);
    let server = Proc::spawn("ud_cm", &example("ud_cm"), &flags(&[]), "ud_cm-server");
    let client = until_served(
        || Proc::spawn("udaddy", &udaddy(), &flags(&["-s", &host]), "udaddy-client"),
        deadline,
    );
    udaddy_done(client, deadline);
    ud_cm_done(
        server,
        deadline,
        "received 10 of 10: 0 verified, 10 from a C udaddy",
    );
}

/// The async layer: a UD listener and an awaited SIDR exchange, then one
/// datagram each way as in the blocking test.
#[cfg(feature = "tokio")]
#[test]
fn async_connect_ud_against_an_async_listener() {
    use rdma_verbs::tokio::{AsyncCmId, Listener};
    let addr = common::guest_at(20305);
    let rt = common::async_pair::runtime();
    rt.block_on(async {
        let listener = Listener::bind_ud(addr, 4).expect("listen (UD)");
        let server = tokio::spawn(async move {
            let req = listener.request().await.expect("UD request");
            let (pd, cq, mut qp) = setup(req.id(), 4);
            post_recvs(&pd, &mut qp, 1, 64);
            let id = req.accept_ud(&qp, &ConnParam::new()).expect("accept");
            (id, pd, cq, qp)
        });
        let mut id = AsyncCmId::resolve_ud(addr, RESOLVE).await.expect("resolve");
        let (pd, mut cq, mut qp) = setup(id.id(), 4);
        post_recvs(&pd, &mut qp, 1, 64);
        let (peer, ev) = id
            .connect_ud(&qp, &ConnParam::new(), T)
            .await
            .expect("connect (UD)");
        assert_eq!(ev.kind, CmEventKind::Established);
        let (_sid, spd, mut scq, mut sqp) = server.await.expect("server task");
        assert_eq!(peer.qpn, sqp.qp_num());
        qp.post_send(peer.send_inline(1, b"async ping"))
            .expect("post send");
        let (c, m) = collect(&mut scq, 1, WcOpcode::Recv).pop().unwrap();
        let m = m.unwrap();
        assert_eq!(payload_of(&m), b"async ping");
        let back = UdPeer::reply_to(&sqp, &c, &m).expect("reply address");
        sqp.post_send(back.send_from(2, mr_with(&spd, b"async pong")))
            .expect("post reply");
        collect(&mut scq, 1, WcOpcode::Send);
        let mut got = None;
        while got.is_none() {
            let mut c = wait(&mut cq, 1).pop().unwrap();
            c.result().expect("client completion");
            if c.opcode == WcOpcode::Recv {
                got = Some(payload_of(&c.take_ud().expect("UD receive")));
            }
        }
        assert_eq!(got.unwrap(), b"async pong");
    });
}
