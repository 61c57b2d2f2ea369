//! What the device's provider cannot do is refused with `Error::Unsupported` naming it, at
//! QP creation or transition time, before the provider answers with a bare errno (siw:
//! EOPNOTSUPP for a UD QP, EINVAL for a hand-connected QP's RTS). On a device that can
//! (rxe), the same calls succeed. The device is RDMA_VERBS_DEVICE, as everywhere.

mod common;

use rdma_verbs::device::{self, Transport};
use rdma_verbs::prelude::*;

/// Whether the test device speaks iWARP.
fn iwarp(ctx: &Context) -> bool {
    let list = device::devices().expect("device list");
    let dev = list
        .find(Some(ctx.name()))
        .expect("the open device is listed");
    dev.transport() == Transport::Iwarp
}

#[test]
fn ud_and_uc_qps_are_unsupported_on_iwarp_and_created_elsewhere() {
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 16).unwrap();
    let caps = common::caps_sr(4, 4);
    let ud = Qp::new_ud(&pd, &cq, &cq, caps).map(drop);
    let uc = Qp::new_uc(&pd, &cq, &cq, caps).map(drop);
    if iwarp(&ctx) {
        for (result, what) in [(ud, "UD"), (uc, "UC")] {
            match result {
                Err(
                    e @ Error::Unsupported {
                        verb: "ibv_create_qp",
                        ..
                    },
                ) => assert!(e.to_string().contains("iWARP"), "{what}: {e}"),
                other => panic!("{what} QP on iWARP: expected Unsupported, got {other:?}"),
            }
        }
    } else {
        ud.expect("UD QP");
        uc.expect("UC QP");
    }
}

#[test]
fn a_hand_connected_rc_qp_is_unsupported_on_iwarp_and_reaches_rts_elsewhere() {
    let ctx = common::ctx();
    let gid = common::gid_index(&ctx);
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 16).unwrap();
    let mk = || {
        Qp::new(&pd, &cq, &cq, common::caps_sr(4, 4))
            .unwrap()
            .init(InitAttr::new(1, common::all_remote()))
            .unwrap()
    };
    let (a, b) = (mk(), mk());
    let eb = b.endpoint(Some(gid)).unwrap();
    let connected = a.connect(&eb, Some(gid));
    if iwarp(&ctx) {
        match connected {
            Err(
                e @ Error::Unsupported {
                    verb: "ibv_modify_qp(RTR)",
                    ..
                },
            ) => assert!(e.to_string().contains("rdma_cm"), "{e}"),
            other => panic!("hand-connected QP on iWARP: expected Unsupported, got {other:?}"),
        }
    } else {
        connected.expect("INIT -> RTR -> RTS by hand");
    }
}

/// siw cannot map a queue at page offset 144 of a device context: libsiw reads
/// that mmap key (0x90000) as its "no key" value and destroys the queue, and the
/// next one lands at the same offset. 144 one-page CQs in a fresh context are
/// created, the 145th and 146th are refused with a `Verb` error whose hint says
/// so (a typed error, no panic, no hang). rxe has no such key: 200 CQs are created.
#[test]
fn siw_refuses_the_queue_at_mmap_offset_144_with_a_hint() {
    let ctx = common::ctx();
    let mut cqs = Vec::new();
    let mut refused = Vec::new();
    for i in 0..200 {
        match Cq::new(&ctx, 8) {
            Ok(cq) => cqs.push(cq),
            Err(e) => {
                refused.push((i, e));
                if refused.len() == 2 {
                    break;
                }
            }
        }
    }
    if !iwarp(&ctx) {
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(cqs.len(), 200);
        return;
    }
    assert_eq!(cqs.len(), 144, "{refused:?}");
    assert_eq!(
        refused.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        [144, 145]
    );
    for (_, e) in &refused {
        match e {
            Error::Verb {
                verb,
                hint: Some(hint),
                ..
            } => {
                assert_eq!(*verb, "ibv_create_cq");
                assert!(hint.contains("0x90000"), "{hint}");
            }
            other => panic!("expected a Verb error with siw's hint, got {other:?}"),
        }
    }
    // Another context has its own offsets.
    let other = common::ctx();
    Cq::new(&other, 8).expect("a CQ in a second context");
    common::deviation("siw refuses the queue mapped at page offset 144 of a context");
}

/// On iWARP the kernel holds a QP from its connect until the peer answers or the MPA
/// timer expires (siw: 10 s), and destroying the QP waits for that. A connect future
/// dropped while the server holds the request returns at once on a current-thread
/// runtime (the QP is destroyed on the runtime's blocking pool, so no other task
/// stalls), and the QP is gone once the server answers and the runtime is dropped.
#[cfg(feature = "tokio")]
#[test]
fn a_connect_dropped_while_the_server_holds_the_request_returns_at_once() {
    use rdma_verbs::cm::ConnParam;
    use rdma_verbs::tokio::{AsyncCmId, AsyncCq, AsyncQp, Listener};
    use std::time::{Duration, Instant};
    const T: Duration = Duration::from_secs(10);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let qp_num = rt.block_on(async {
        let server = common::guest_at(7531);
        let listener = Listener::bind(server, 4).unwrap();
        let holder = tokio::spawn(async move {
            let req = listener.request().await.unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
            drop(req); // rejects
        });
        let mut id = AsyncCmId::resolve(server, T).await.unwrap();
        let ctx = id.id().context().unwrap();
        let pd = Pd::new(&ctx).unwrap();
        let cq = AsyncCq::new(&ctx, 8).unwrap();
        let caps = common::caps_sr(2, 2);
        let qp = id.id().create_qp(&pd, &cq.cq(), &cq.cq(), caps).unwrap();
        let qp_num = qp.qp_num();
        let qp = AsyncQp::new(qp, &cq, &cq).map_err(|(e, _)| e).unwrap();
        let param = ConnParam::new();
        let mut connect = Box::pin(id.connect(qp, &param, T));
        let early = tokio::time::timeout(Duration::from_millis(500), &mut connect).await;
        assert!(
            early.is_err(),
            "the server holds the request: the connect waits; got {:?}",
            early.map(|r| r.map(|(_, ev)| ev.kind))
        );
        let t = Instant::now();
        drop(connect);
        drop(id);
        let took = t.elapsed();
        assert!(took < Duration::from_secs(1), "dropping took {took:?}");
        holder.await.unwrap();
        qp_num
    });
    drop(rt);
    let out = std::process::Command::new("rdma")
        .args(["resource", "show", "qp", "lqpn", &qp_num.to_string()])
        .output()
        .expect("run rdma");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        !listed.contains(&format!("lqpn {qp_num} ")),
        "QP {qp_num} is still there: {listed}"
    );
}
