//! Shared receive queues with peers outside the crate's own tests, on soft-RoCE:
//! `examples/srq_pingpong.rs` against rdma-core's `ibv_srq_pingpong` in both roles (run
//! inside the guest by `cargo xtask test`), and rdma_cm connections sharing one SRQ.
mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::procs::{Proc, example, finish};
use common::{buffer, ctx, gid_index, serial, wait};
use rdma_verbs::cq::{Cq, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{QpCaps, RecvWr, SendWr};
use rdma_verbs::srq::{Srq, SrqAttr};

// --- interop with rdma-core's ibv_srq_pingpong -----------------------------

const C_PROGRAM: &str = "ibv_srq_pingpong";
/// -n: exchanges in all (over every QP); small, TCG is slow.
const ITERS: u32 = 64;
const LIMIT: Duration = Duration::from_secs(60);

fn c_program() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(C_PROGRAM))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("{C_PROGRAM} not found on PATH: install ibverbs-utils (rdma-core's examples)")
        })
}

/// The `  {which} address: ...` lines' fields, in order.
fn addresses(out: &str, which: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.starts_with(&format!("  {which} address:")))
        .map(|l| l.split_once("LID ").map(|x| x.1).unwrap_or("").to_owned())
        .collect()
}

fn check_closing(out: &str, size: usize, who: &str) {
    let bytes = size as u64 * u64::from(ITERS) * 2;
    for start in [format!("{bytes} bytes in "), format!("{ITERS} iters in ")] {
        assert!(
            out.lines().any(|l| l.starts_with(&start)),
            "{who}: no `{start}` line:\n{out}"
        );
    }
}

fn interop(
    server: (&str, PathBuf),
    client: (&str, PathBuf),
    num_qp: Option<u32>,
    events: bool,
    port: u16,
) {
    let ctx = ctx();
    common::require_hand_connection(&ctx);
    let gid = gid_index(&ctx);
    let size = 1024;
    let mut args = vec![
        "-g".to_owned(),
        gid.to_string(),
        "-n".to_owned(),
        ITERS.to_string(),
        "-s".to_owned(),
        size.to_string(),
        "-p".to_owned(),
        port.to_string(),
    ];
    if let Some(q) = num_qp {
        args.extend(["-q".to_owned(), q.to_string()]);
    }
    if events {
        args.push("-e".to_owned());
    }
    let t = Instant::now();
    let s = Proc::server(server.0, &server.1, &args, port, t + LIMIT);
    let host = std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into());
    let mut cargs = args.clone();
    cargs.push(host);
    let c = Proc::spawn(client.0, &client.1, &cargs, &format!("{port}-client"));
    let (sout, cout) = finish(s, c, Instant::now() + LIMIT);
    let report = format!("server:\n{sout}\nclient:\n{cout}");
    check_closing(&sout, size, "server");
    check_closing(&cout, size, "client");
    let n = num_qp.unwrap_or(16) as usize;
    let (sl, sr, cl, cr) = (
        addresses(&sout, "local"),
        addresses(&sout, "remote"),
        addresses(&cout, "local"),
        addresses(&cout, "remote"),
    );
    assert_eq!(sl.len(), n, "{report}");
    assert_eq!(sr, cl, "{report}");
    assert_eq!(cr, sl, "{report}");
    eprintln!(
        "{} server, {} client, -q {n}, -e {events}: ok in {:?}",
        server.0,
        client.0,
        t.elapsed()
    );
}

fn interop_both_ways(num_qp: Option<u32>, events: bool, port: u16) {
    let ours = ("srq_pingpong (ours)", example("srq_pingpong"));
    let c = (C_PROGRAM, c_program());
    interop(ours.clone(), c.clone(), num_qp, events, port);
    interop(c, ours, num_qp, events, port + 1);
}

#[test]
fn srq_pingpong_interop_default_qps_polling() {
    let _g = serial();
    interop_both_ways(None, false, 18800);
}

#[test]
fn srq_pingpong_interop_four_qps_with_events() {
    let _g = serial();
    interop_both_ways(Some(4), true, 18810);
}

#[test]
fn srq_pingpong_interop_four_qps_polling_and_default_qps_with_events() {
    let _g = serial();
    interop_both_ways(Some(4), false, 18820);
    interop_both_ways(None, true, 18830);
}

// --- rdma_cm -------------------------------------------------------------

#[test]
fn rdma_cm_connections_share_one_srq() {
    use rdma_verbs::cm::{CmId, ConnParam};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};
    let _g = serial();
    const T: Duration = Duration::from_secs(20);
    let ip = std::env::var("RDMA_VERBS_ADDR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(IpAddr::V4(Ipv4Addr::new(10, 99, 0, 1)));
    let addr = SocketAddr::new(ip, 20901);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let listener = CmId::listener(addr, 4).expect("listen");
        ready_tx.send(()).expect("signal");
        let mut conns = Vec::new();
        let mut shared: Option<(Pd, Cq, Srq, HashMap<u64, u64>)> = None;
        for _ in 0..2 {
            let req = listener.get_request(T).expect("connect request");
            let (pd, cq, srq, _) = shared.get_or_insert_with(|| {
                // PD, CQ and SRQ in the context librdmacm opened for the device.
                let ctx = req.id().context().expect("context");
                let pd = Pd::new(&ctx).expect("pd");
                let cq = Cq::new(&ctx, 8 + 2 * 4).expect("cq");
                let mut srq = Srq::new(&pd, &cq, SrqAttr::new(8, 1)).expect("srq");
                let mut posted = HashMap::new();
                for id in 0..4 {
                    let mr = buffer(&pd, 64);
                    posted.insert(id, mr.addr());
                    srq.post_recv(RecvWr::new(id, mr)).expect("post");
                }
                (pd, cq, srq, posted)
            });
            let caps = QpCaps {
                max_send_wr: 4,
                ..QpCaps::default()
            };
            let qp = req
                .id()
                .create_qp_with_srq(pd, cq, cq, srq, caps)
                .expect("rdma_create_qp on the srq");
            conns.push(req.accept(qp, &ConnParam::new(), T).expect("accept"));
        }
        let (_pd, mut cq, srq, posted) = shared.expect("two connections");
        let mut seen = HashSet::new();
        let mut by_qp: HashMap<u32, Vec<Vec<u8>>> = HashMap::new();
        for mut wc in wait(&mut cq, 4) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert!(seen.insert(wc.wr_id));
            let mr = wc.take_mr().expect("buffer");
            assert_eq!(Some(&mr.addr()), posted.get(&wc.wr_id));
            let data = mr.as_slice().expect("read")[..wc.byte_len as usize].to_vec();
            by_qp.entry(wc.qp_num).or_default().push(data);
        }
        assert_eq!(srq.posted(), 0);
        // Each connection's QP got its client's two messages, in order.
        let mut got: Vec<Vec<Vec<u8>>> = conns
            .iter()
            .map(|(qp, _)| by_qp.remove(&qp.qp_num()).unwrap_or_default())
            .collect();
        got.sort();
        got
    });
    ready_rx.recv_timeout(T).expect("server listening");
    let mut clients = Vec::new();
    for i in 0..2u8 {
        let id = CmId::new().expect("rdma_cm id");
        id.resolve(addr, Duration::from_secs(2)).expect("resolve");
        let ctx = id.context().expect("context");
        let pd = Pd::new(&ctx).expect("pd");
        let mut cq = Cq::new(&ctx, 8).expect("cq");
        let caps = QpCaps {
            max_send_wr: 4,
            max_recv_wr: 1,
            ..QpCaps::default()
        };
        let qp = id.create_qp(&pd, &cq, &cq, caps).expect("qp");
        let (mut qp, _) = id.connect(qp, &ConnParam::new(), T).expect("connect");
        for k in 0..2u8 {
            let mut mr = Mr::new(&pd, 16, AccessFlags::LOCAL_WRITE).expect("mr");
            mr.write_at(0, &[i; 16]).expect("write");
            mr.write_at(0, &[k]).expect("write");
            qp.post_send(SendWr::send(u64::from(k)).sge(mr))
                .expect("send");
        }
        for c in wait(&mut cq, 2) {
            assert_eq!(c.status, WcStatus::Success);
        }
        clients.push((qp, id, cq, pd));
    }
    let got = server.join().expect("server");
    let expect: Vec<Vec<Vec<u8>>> = (0..2u8)
        .map(|i| {
            (0..2u8)
                .map(|k| {
                    let mut m = vec![i; 16];
                    m[0] = k;
                    m
                })
                .collect()
        })
        .collect();
    assert_eq!(got, expect);
    drop(clients);
}
