//! Objects dropped in any order neither crash nor leak: the kernel's resource
//! counts (`rdma resource show`) return to where they were. One test per
//! binary, so no other test's objects are counted.

mod common;

use common::{all_remote, ctx, res_counts as counts};
use rdma_verbs::cq::Cq;
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{InitAttr, Qp, QpCaps, RecvWr};

#[test]
fn every_drop_order_releases_every_kernel_object() {
    let dev = ctx().name().to_owned();
    let before = counts(&dev);
    for order in 0..6 {
        let ctx = ctx();
        let pd = Pd::new(&ctx).unwrap();
        let cq = Cq::new(&ctx, 256).unwrap();
        let mr = pd.alloc_mr(8192, AccessFlags::LOCAL_WRITE).unwrap();
        let mut qp = Qp::new(&pd, &cq, &cq, QpCaps::default())
            .unwrap()
            .init(InitAttr::new(1, all_remote()))
            .unwrap();
        qp.post_recv(RecvWr::new(
            1,
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
        .unwrap();
        let during = counts(&dev);
        assert!(
            during["qp"] > before["qp"] && during["mr"] > before["mr"],
            "{during:?}"
        );
        // Drop the handles in a different order each round; children keep parents alive.
        match order {
            0 => drop((ctx, pd, cq, mr, qp)),
            1 => {
                drop(qp);
                drop(mr);
                drop(cq);
                drop(pd);
                drop(ctx);
            }
            2 => {
                drop(ctx);
                drop(pd);
                drop(cq);
                drop(mr);
                drop(qp);
            }
            3 => {
                drop(cq);
                drop(ctx);
                drop(qp);
                drop(pd);
                drop(mr);
            }
            4 => {
                drop(pd);
                drop(mr);
                drop(ctx);
                drop(qp);
                drop(cq);
            }
            _ => {
                drop(mr);
                drop(qp);
                drop(ctx);
                drop(cq);
                drop(pd);
            }
        }
        let after = counts(&dev);
        for k in ["pd", "cq", "qp", "mr", "ctx"] {
            assert_eq!(
                after.get(k),
                before.get(k),
                "{k} leaked in drop order {order}: {before:?} -> {after:?}"
            );
        }
    }
}
