//! Two RC QPs connected to each other over `AsyncCq`s, and what the async tests build them
//! with.

use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{Init, InitAttr, Qp, QpCaps, Rc, Rts};
use rdma_verbs::tokio::{AsyncChannel, AsyncCq, AsyncQp};

/// A multi-threaded runtime with IO and timers.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Two connected RC QPs, `a` on `cq_a` and `b` on `cq_b`, in one PD.
pub struct AsyncPair {
    pub pd: Pd,
    pub cq_a: AsyncCq,
    pub cq_b: AsyncCq,
    pub a: AsyncQp<Rc, Rts>,
    pub b: AsyncQp<Rc, Rts>,
}

/// Two RC QPs connected to each other, each on an `AsyncCq` of its own; the
/// two CQs share one channel (and driver task) when `one_channel`.
pub fn async_pair_on(caps: QpCaps, one_channel: bool) -> AsyncPair {
    let ctx = super::ctx();
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
    let gid = super::gid_index(&ctx);
    let mk = |cq: &AsyncCq| -> Qp<Rc, Init> {
        let c = cq.cq();
        Qp::new(&pd, &c, &c, caps)
            .unwrap()
            .init(InitAttr::new(1, super::all_remote()))
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

/// [`async_pair_on`] with a channel per CQ.
pub fn async_pair(caps: QpCaps) -> AsyncPair {
    async_pair_on(caps, false)
}

/// `depth` send and receive requests.
pub fn caps(depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCaps::default()
    }
}

/// A local-write MR holding `data` (at least 1 byte).
pub fn mr_with(pd: &Pd, data: &[u8]) -> Mr {
    let mut mr = pd
        .alloc_mr(data.len().max(1), AccessFlags::LOCAL_WRITE)
        .unwrap();
    mr.write_at(0, data).unwrap();
    mr
}
