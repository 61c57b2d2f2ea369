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
