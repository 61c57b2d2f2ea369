//! The shapes a new user reaches for, on real soft-RoCE: a SEND or WRITE of part of an
//! `Mr` (`Mr::range`), one-call UD addressing (`AddressHandle::for_endpoint`) and the
//! fallible SRQ refill (`Srq::try_refill`). Runs in the guest (`cargo xtask test`).

mod common;

use common::{pair, pattern, wait};
use rdma_verbs::error::Error;
use rdma_verbs::prelude::*;
use rdma_verbs::qp::Buffer;

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        ..QpCaps::default()
    }
}

/// An `Mr` of `len` bytes holding `pattern(len, seed)`.
fn filled(pd: &Pd, len: usize, seed: u8, access: AccessFlags) -> Mr {
    let mut mr = pd.alloc_mr(len, access).expect("alloc mr");
    mr.write_at(0, &pattern(len, seed)).expect("fill");
    mr
}

#[test]
fn a_send_of_a_range_delivers_its_bytes_and_gives_back_the_whole_mr() {
    let mut p = pair(caps());
    for k in 0..3u64 {
        let dst = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(k, dst)).unwrap();
    }
    let src = filled(&p.pd, 4096, 7, AccessFlags::empty());
    let (addr, data) = (src.addr(), pattern(4096, 7));
    // The first 100 bytes, then bytes 1000..1300 of the same Mr, then none of it.
    p.a.post_send(SendWr::send_from(1, src.range(..100).unwrap()))
        .unwrap();
    let mut sc = wait(&mut p.cq_a, 1);
    assert_eq!((sc[0].wr_id, sc[0].status), (1, WcStatus::Success));
    let src = sc[0].take_mr().expect("the source comes back");
    assert_eq!(
        (src.addr(), src.len()),
        (addr, 4096),
        "whole, not the range"
    );
    p.a.post_send(SendWr::send_from(2, src.range(1000..1300).unwrap()))
        .unwrap();
    let mut sc = wait(&mut p.cq_a, 1);
    let Some(Buffer::Range(r)) = sc[0].take_buffers().pop() else {
        panic!("the range comes back as a range");
    };
    assert_eq!((r.start(), r.len()), (1000, 300));
    let src = r.into_mr();
    assert_eq!((src.addr(), src.len()), (addr, 4096));
    p.a.post_send(SendWr::send_from(3, src.range(..0).unwrap()))
        .unwrap();
    let mut sc = wait(&mut p.cq_a, 1);
    assert_eq!((sc[0].wr_id, sc[0].status), (3, WcStatus::Success));
    assert_eq!(sc[0].take_mr().unwrap().len(), 4096);

    let mut rc = wait(&mut p.cq_b, 3);
    let expect: [&[u8]; 3] = [&data[..100], &data[1000..1300], &[]];
    for (c, want) in rc.iter_mut().zip(expect) {
        assert_eq!(c.status, WcStatus::Success);
        assert_eq!(c.byte_len as usize, want.len(), "wr {}", c.wr_id);
        let got = c.take_mr().unwrap().to_vec().unwrap();
        assert_eq!(&got[..want.len()], want, "wr {}", c.wr_id);
        assert!(got[want.len()..].iter().all(|&b| b == 0), "wr {}", c.wr_id);
    }
}

#[test]
fn a_write_of_a_range_lands_exactly_those_bytes() {
    let mut p = pair(caps());
    let target =
        p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let src = filled(&p.pd, 2048, 3, AccessFlags::empty());
    let data = pattern(2048, 3);
    let wr = SendWr::write_from(9, src.range(500..=1499).unwrap(), target.remote(), 64);
    p.a.post_send(wr).unwrap();
    let mut sc = wait(&mut p.cq_a, 1);
    assert_eq!((sc[0].wr_id, sc[0].status), (9, WcStatus::Success));
    assert_eq!(sc[0].take_mr().unwrap().len(), 2048);
    let got = target.to_vec().unwrap();
    assert_eq!(&got[64..1064], &data[500..1500]);
    assert!(got[..64].iter().chain(&got[1064..]).all(|&b| b == 0));
    // The tail of a RemoteMr is checked against the range's length, not the Mr's:
    // 1000 bytes fit at the last 1000 bytes of the target.
    let src = filled(&p.pd, 2048, 4, AccessFlags::empty());
    let wr = SendWr::write_from(10, src.range(..1000).unwrap(), target.remote(), 4096 - 1000);
    p.a.post_send(wr).unwrap();
    let sc = wait(&mut p.cq_a, 1);
    assert_eq!((sc[0].wr_id, sc[0].status), (10, WcStatus::Success));
    assert_eq!(&target.to_vec().unwrap()[3096..], &pattern(2048, 4)[..1000]);
}

#[test]
fn a_range_outside_the_mr_is_refused_and_the_mr_comes_back() {
    let p = pair(caps());
    let mr = p.pd.alloc_mr(100, AccessFlags::empty()).unwrap();
    let addr = mr.addr();
    let e = mr.range(50..101).unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::InvalidArgument {
                what: "Mr range",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!((e.mr.addr(), e.mr.len()), (addr, 100), "the Mr, unchanged");
    #[allow(clippy::reversed_empty_ranges)]
    let e = e.mr.range(60..50).unwrap_err();
    assert!(matches!(e.error, Error::InvalidArgument { .. }));
    let e = e.mr.range(..=usize::MAX).unwrap_err();
    // `?` turns it into the crate's Error.
    let as_error: Error = e.into();
    assert!(matches!(
        as_error,
        Error::InvalidArgument {
            what: "Mr range",
            ..
        }
    ));
}

const QKEY: u32 = 0x1111_1111;

/// A UD QP in RTS on port 1 with Q_Key [`QKEY`].
fn ud_qp(pd: &Pd, cq: &Cq) -> Qp<Ud, Rts> {
    Qp::new_ud(pd, cq, cq, caps())
        .unwrap()
        .init(rdma_verbs::qp::UdInitAttr::new(1, QKEY))
        .unwrap()
        .ready()
        .unwrap()
}

#[test]
fn ud_peers_address_each_other_from_their_endpoints_in_one_call() {
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (mut cq_a, mut cq_b) = (Cq::new(&ctx, 32).unwrap(), Cq::new(&ctx, 32).unwrap());
    let (mut a, mut b) = (ud_qp(&pd, &cq_a), ud_qp(&pd, &cq_b));
    // What each side would send the other over the exchange.
    let (ea, eb) = (a.endpoint(None).unwrap(), b.endpoint(None).unwrap());
    let to_b = AddressHandle::for_endpoint(&a, &eb, None).unwrap();
    let to_a = AddressHandle::for_endpoint(&b, &ea, None).unwrap();
    let av = to_b.attr();
    let grh = av.grh.expect("RoCE addresses by GID");
    let default_ix = ctx.default_gid_index(1).unwrap().expect("a RoCE v2 GID");
    assert_eq!((av.port, av.sl), (1, 0));
    assert_eq!(
        (grh.dgid, grh.sgid_index, grh.hop_limit),
        (eb.gid, default_ix, 1)
    );
    for (qp, k) in [(&mut a, 1u64), (&mut b, 2)] {
        let mut all = pd
            .alloc_mr(rdma_verbs::ah::GRH_LEN + 256, AccessFlags::LOCAL_WRITE)
            .unwrap();
        let grh = all.split_to(rdma_verbs::ah::GRH_LEN).unwrap();
        qp.post_recv(UdRecvWr::new(k, grh, all)).unwrap();
    }
    // Each sends the other part of a buffer (a range, as on RC).
    let src = filled(&pd, 256, 5, AccessFlags::empty());
    a.post_send(UdSendWr::send_from(
        10,
        src.range(16..116).unwrap(),
        &to_b,
        eb.qpn,
        QKEY,
    ))
    .unwrap();
    let src = filled(&pd, 256, 6, AccessFlags::empty());
    b.post_send(UdSendWr::send_from(
        20,
        src.range(..7).unwrap(),
        &to_a,
        ea.qpn,
        QKEY,
    ))
    .unwrap();
    for (cq, qp_from, want) in [
        (&mut cq_b, a.qp_num(), pattern(256, 5)[16..116].to_vec()),
        (&mut cq_a, b.qp_num(), pattern(256, 6)[..7].to_vec()),
    ] {
        let mut got = wait(cq, 2);
        got.sort_by_key(|c| c.opcode == WcOpcode::Send);
        let [recv, send] = &mut got[..] else {
            unreachable!()
        };
        assert_eq!(
            (send.status, send.take_mr().unwrap().len()),
            (WcStatus::Success, 256)
        );
        assert_eq!(recv.status, WcStatus::Success);
        let msg = recv.take_ud().unwrap();
        assert_eq!((msg.len as usize, msg.src_qp), (want.len(), qp_from));
        assert_eq!(
            &msg.payload.unwrap().to_vec().unwrap()[..want.len()],
            &want[..]
        );
    }
    // An endpoint without a GID cannot be reached on RoCE: the error says so.
    let no_gid = Endpoint {
        gid: Gid::ZERO,
        ..eb
    };
    match AddressHandle::for_endpoint(&a, &no_gid, None) {
        Err(Error::InvalidArgument {
            what: "endpoint", ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn try_refill_stops_at_the_allocators_error_and_says_how_many_were_posted() {
    use rdma_verbs::srq::RefillError;
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut cq = Cq::new(&ctx, 64).unwrap();
    let peer_cq = Cq::new(&ctx, 64).unwrap();
    let mut srq = Srq::new(&pd, &cq, SrqAttr::new(8, 1)).unwrap();
    let gid = common::gid_index(&ctx);
    let qp = Qp::new_with_srq(&pd, &cq, &cq, &srq, caps())
        .unwrap()
        .init(InitAttr::new(1, common::all_remote()))
        .unwrap();
    let peer = Qp::new(&pd, &peer_cq, &peer_cq, caps())
        .unwrap()
        .init(InitAttr::new(1, common::all_remote()))
        .unwrap();
    let (e, pe) = (
        qp.endpoint(Some(gid)).unwrap(),
        peer.endpoint(Some(gid)).unwrap(),
    );
    let _qp = qp.connect(&pe, Some(gid)).unwrap();
    let mut peer = peer.connect(&e, Some(gid)).unwrap();
    // An allocator that runs dry after 3 buffers.
    let mut left = 3;
    let mut alloc = |id: u64| -> Result<RecvWr, &'static str> {
        if left == 0 {
            return Err("pool exhausted");
        }
        left -= 1;
        Ok(RecvWr::new(
            id,
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
    };
    match srq.try_refill(|| alloc(1)) {
        Err(RefillError::Make {
            error: "pool exhausted",
            posted: 3,
        }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(srq.posted(), 3);
    // With room again, it fills the SRQ to its depth and says so.
    let posted = srq
        .try_refill(|| {
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)
                .map(|mr| RecvWr::new(2, mr))
        })
        .unwrap();
    assert_eq!((posted, srq.posted()), (5, 8));
    // The receives it posted take messages.
    let src = filled(&pd, 64, 9, AccessFlags::empty());
    peer.post_send(SendWr::send_from(7, src.range(..40).unwrap()))
        .unwrap();
    let mut c = wait(&mut cq, 1).pop().unwrap();
    assert_eq!((c.wr_id, c.status, c.byte_len), (1, WcStatus::Success, 40));
    assert_eq!(
        &c.take_mr().unwrap().to_vec().unwrap()[..40],
        &pattern(64, 9)[..40]
    );
}
