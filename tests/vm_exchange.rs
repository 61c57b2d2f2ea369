//! Several RC clients served at once through the TCP exchange, on one CQ
//! created smaller than their queues need, with the ready barrier keeping
//! each client's first SEND until the server's receives are posted.
//! Runs in the soft-RoCE guest.

mod common;

use std::collections::HashMap;
use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use common::{WAIT, all_remote, ctx, gid_index, pattern, wait};
use rdma_verbs::exchange::{ExchangeListener, ExchangeStream, PeerInfo};
use rdma_verbs::prelude::*;

const CLIENTS: usize = 4;
const MSGS: usize = 4;
const LEN: usize = 256;

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    }
}

/// A client: exchanges on a stream of its own, connects with `rnr_retry` 0
/// (a SEND that finds no receive fails at once with `RNR_RETRY_EXC_ERR`),
/// waits for the server's ready signal, then SENDs `MSGS` messages.
/// Returns its QP number, and when the signal came.
fn client(port: u16, i: usize, start: &Barrier) -> (u32, Instant) {
    let ctx = ctx();
    let gid = gid_index(&ctx);
    let pd = Pd::new(&ctx).unwrap();
    let mut cq = Cq::new(&ctx, 16).unwrap();
    let qp = Qp::new(&pd, &cq, &cq, caps())
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    let local = PeerInfo::new(qp.endpoint(Some(gid)).unwrap());
    let qp_num = local.endpoint.qpn;
    start.wait();
    let mut conn = ExchangeStream::connect("127.0.0.1", port, WAIT).unwrap();
    conn.send(&local).unwrap();
    let remote: PeerInfo = conn.recv().unwrap();
    conn.send_done().unwrap();
    let mtu = ctx.query_port(1).unwrap().active_mtu;
    let mut qp = qp
        .rtr(RtrAttr::new(&remote.endpoint, 1, mtu, Some(gid)))
        .unwrap()
        .rts(RtsAttr::new(local.endpoint.psn).rnr_retry(0))
        .unwrap();
    conn.wait_ready().unwrap();
    let ready_at = Instant::now();
    for k in 0..MSGS {
        let mut mr = pd.alloc_mr(LEN, AccessFlags::empty()).unwrap();
        mr.write_at(0, &pattern(LEN, (i * MSGS + k) as u8)).unwrap();
        qp.post_send(SendWr::send_from(k as u64, mr)).unwrap();
    }
    for (k, c) in wait(&mut cq, MSGS).into_iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status),
            (k as u64, WcStatus::Success),
            "client {i}"
        );
    }
    (qp_num, ready_at)
}

#[test]
fn several_rc_clients_are_served_concurrently_and_wait_for_the_receives() {
    let ctx = ctx();
    common::require_hand_connection(&ctx);
    let gid = gid_index(&ctx);
    let pd = Pd::new(&ctx).unwrap();
    // Smaller than one QP's queues: it grows as each client's QP joins.
    let mut cq = Cq::new(&ctx, 4).unwrap();
    let listener = ExchangeListener::bind_addr("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = listener.local_addr().unwrap().port();
    let start = Barrier::new(CLIENTS);
    let (served, clients) = thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let start = &start;
                s.spawn(move || client(port, i, start))
            })
            .collect();
        let served = listener.serve_each(CLIENTS, Some(WAIT), |_, mut conn| {
            let qp = Qp::new(&pd, &cq, &cq, caps())?.init(InitAttr::new(1, all_remote()))?;
            let (mut qp, peer) = conn.serve(qp, Some(gid), &[])?;
            // The clients' QPs are in RTS now; without the barrier their
            // first SEND would meet no receive.
            thread::sleep(Duration::from_millis(200));
            for k in 0..MSGS {
                qp.post_recv(RecvWr::new(
                    k as u64,
                    pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE)?,
                ))?;
            }
            let posted_at = Instant::now();
            conn.ready()?;
            Ok((qp, conn, posted_at, peer.endpoint.qpn))
        });
        let clients: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
        (served, clients)
    });
    assert_eq!(served.len(), CLIENTS);
    let served: Vec<_> = served.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(cq.reserved(), (CLIENTS * 16) as u64);
    assert!(
        cq.depth() as usize >= CLIENTS * 16,
        "grew to {}",
        cq.depth()
    );
    // Each client's server-side QP, by the client's QP number.
    let by_client: HashMap<u32, usize> = clients
        .iter()
        .enumerate()
        .map(|(i, (qpn, _))| (*qpn, i))
        .collect();
    let mut seen = vec![0usize; CLIENTS];
    for mut c in wait(&mut cq, CLIENTS * MSGS) {
        assert_eq!((c.status, c.byte_len), (WcStatus::Success, LEN as u32));
        let (_, _, posted_at, client_qpn) = served
            .iter()
            .find(|(qp, ..)| qp.qp_num() == c.qp_num)
            .expect("a served QP");
        let i = by_client[client_qpn];
        assert!(
            clients[i].1 >= *posted_at,
            "client {i} started before the receives"
        );
        let k = seen[i];
        assert_eq!(c.wr_id, k as u64, "in order per QP");
        let mr = c.take_mr().unwrap();
        assert_eq!(mr.to_vec().unwrap(), pattern(LEN, (i * MSGS + k) as u8));
        seen[i] += 1;
    }
    assert_eq!(seen, [MSGS; CLIENTS]);
}

/// The same with the async listener: a task per client serves it
/// (`tokio::exchange::ExchangeListener::serve`), all on one `AsyncCq`
/// created too small, which grows while its driver task polls it; each task
/// posts its receives and then signals ready.
#[cfg(feature = "tokio")]
#[test]
fn rc_clients_are_served_by_async_tasks_at_once() {
    use std::sync::Arc;

    common::require_hand_connection(&ctx());

    use rdma_verbs::tokio::exchange::{self as aexchange, ExchangeListener as AsyncListener};
    use rdma_verbs::tokio::{AsyncCq, AsyncQp};

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ctx = ctx();
    let gid = gid_index(&ctx);
    let pd = Pd::new(&ctx).unwrap();
    let start = Arc::new(Barrier::new(CLIENTS));
    rt.block_on(async {
        let cq = Arc::new(AsyncCq::new(&ctx, 4).unwrap());
        let blocking = ExchangeListener::bind_addr("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = Arc::new(AsyncListener::from_blocking(blocking).unwrap());
        let port = listener.local_addr().unwrap().port();
        let tasks: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (pd, cq, listener) = (pd.clone(), cq.clone(), listener.clone());
                tokio::spawn(async move {
                    let qp = Qp::new(&pd, &cq.cq(), &cq.cq(), caps())?
                        .init(InitAttr::new(1, all_remote()))?;
                    let (qp, peer, conn) = listener.serve(qp, Some(gid), &[], Some(WAIT)).await?;
                    let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e)?;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    for _ in 0..MSGS {
                        qp.post_recv(RecvWr::new(0, pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE)?))
                            .map_err(Error::from)?;
                    }
                    let posted_at = Instant::now();
                    let conn = aexchange::ready(conn).await?;
                    Ok::<_, Error>((qp, conn, posted_at, peer.endpoint.qpn))
                })
            })
            .collect();
        let clients: Vec<_> = (0..CLIENTS)
            .map(|i| {
                let start = start.clone();
                std::thread::spawn(move || client(port, i, &start))
            })
            .collect();
        let mut served = Vec::new();
        for t in tasks {
            served.push(t.await.unwrap().unwrap());
        }
        let clients: Vec<(u32, Instant)> = clients.into_iter().map(|c| c.join().unwrap()).collect();
        assert_eq!(cq.cq().reserved(), (CLIENTS * 16) as u64);
        assert!(cq.cq().depth() as usize >= CLIENTS * 16);
        let by_client: HashMap<u32, usize> = clients
            .iter()
            .enumerate()
            .map(|(i, (qpn, _))| (*qpn, i))
            .collect();
        let mut seen = vec![0usize; CLIENTS];
        for _ in 0..CLIENTS * MSGS {
            let mut c = tokio::time::timeout(WAIT, cq.next())
                .await
                .expect("a receive completion")
                .unwrap();
            assert_eq!((c.status, c.byte_len), (WcStatus::Success, LEN as u32));
            let (_, _, posted_at, client_qpn) = served
                .iter()
                .find(|(qp, ..)| qp.qp_num() == c.qp_num)
                .expect("a served QP");
            let i = by_client[client_qpn];
            assert!(
                clients[i].1 >= *posted_at,
                "client {i} started before the receives"
            );
            let mr = c.take_mr().unwrap();
            assert_eq!(
                mr.to_vec().unwrap(),
                pattern(LEN, (i * MSGS + seen[i]) as u8)
            );
            seen[i] += 1;
        }
        assert_eq!(seen, [MSGS; CLIENTS]);
    });
}
