//! ATOMIC_WRITE (`SendWr::atomic_write`) on real soft-RoCE: the 8 bytes land whole where
//! the device executes it (rxe from Linux 6.2: the 6.12 guest), and posting is refused with
//! `Error::Unsupported`, nothing posted, where it does not (6.1) or on a legacy-API QP.

mod common;

use common::{all_remote, caps_sr, ctx, pair_api, wait};
use rdma_verbs::Error;
use rdma_verbs::cq::{WcOpcode, WcStatus};
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::qp::{SendApi, SendWr};

const VALUE: u64 = 0x1122_3344_5566_7788;

/// A test of a refusal's error.
type Check<'a> = &'a dyn Fn(&Error) -> bool;

/// Whether this guest's device executes ATOMIC_WRITE: rxe from Linux 6.2 on (from the
/// kernel's release); siw, iWARP without atomics, never.
fn device_has_atomic_write(ctx: &rdma_verbs::context::Context) -> bool {
    if common::iwarp(ctx) {
        return false;
    }
    common::kernel_version() >= (6, 2)
}

#[test]
fn the_device_reports_atomic_write_where_it_has_it() {
    let ctx = ctx();
    let attr = ctx.query_device().unwrap();
    assert_eq!(
        attr.atomic_write(),
        device_has_atomic_write(&ctx),
        "device_cap_flags_ex {:#x}",
        attr.device_cap_flags_ex
    );
}

#[test]
fn an_atomic_write_lands_whole_or_is_unsupported_before_posting() {
    let mut p = pair_api(caps_sr(8, 8), SendApi::Extended);
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let posted =
        p.a.post_send(SendWr::atomic_write(7, target.remote(), 16, VALUE));
    if !p.ctx.query_device().unwrap().atomic_write() {
        let e = posted.unwrap_err();
        assert!(
            matches!(
                e.error,
                Error::Unsupported {
                    verb: "ibv_wr_atomic_write",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.error.to_string().contains("RDMA WRITE"), "{}", e.error);
        // Nothing was posted: the queue is empty and a plain WRITE still works.
        let src = p.pd.alloc_mr(8, AccessFlags::empty()).unwrap();
        p.a.post_send(SendWr::write(8, target.remote(), 0).sge(src))
            .unwrap();
        let c = wait(&mut p.cq_a, 1);
        assert_eq!((c[0].wr_id, c[0].status), (8, WcStatus::Success));
        return;
    }
    posted.unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{:?}", c[0]);
    assert_eq!((c[0].wr_id, c[0].opcode), (7, WcOpcode::AtomicWrite));
    let bytes = target.to_vec().unwrap();
    let mut want = vec![0u8; 64];
    want[16..24].copy_from_slice(&VALUE.to_ne_bytes());
    assert_eq!(bytes, want);
}

#[test]
fn a_target_without_remote_write_is_a_remote_access_error() {
    let mut p = pair_api(caps_sr(8, 8), SendApi::Extended);
    let target =
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    let posted =
        p.a.post_send(SendWr::atomic_write(3, target.remote(), 0, VALUE));
    if !p.ctx.query_device().unwrap().atomic_write() {
        let e = posted.unwrap_err().error;
        assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
        return;
    }
    posted.unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::RemAccessErr, "{:?}", c[0]);
    assert_eq!(target.to_vec().unwrap(), vec![0u8; 64]);
}

#[test]
fn bad_atomic_writes_are_refused_with_what_is_wrong() {
    let mut p = pair_api(caps_sr(8, 8), SendApi::Extended);
    let supported = p.ctx.query_device().unwrap().atomic_write();
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let invalid = |e: &Error| matches!(e, Error::InvalidArgument { .. });
    let unsupported = |e: &Error| matches!(e, Error::Unsupported { .. });
    // Misaligned, out of range, and with a buffer: typed refusals, nothing posted.
    let misaligned =
        p.a.post_send(SendWr::atomic_write(1, target.remote(), 4, VALUE));
    let past_end =
        p.a.post_send(SendWr::atomic_write(2, target.remote(), 64, VALUE));
    // Writable and 8 bytes, as a compare-and-swap's result: still refused.
    let buf = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let with_buffer =
        p.a.post_send(SendWr::atomic_write(3, target.remote(), 0, VALUE).sge(buf));
    let out_of_bounds = |e: &Error| {
        matches!(
            e,
            Error::RemoteOutOfBounds {
                offset: 64,
                len: 8,
                ..
            }
        )
    };
    let cases: [(&str, _, Check<'_>); 3] = [
        ("misaligned", misaligned, &invalid),
        ("past the end", past_end, &out_of_bounds),
        ("with a buffer", with_buffer, &invalid),
    ];
    for (what, r, when_supported) in cases {
        let e = r.unwrap_err().error;
        let expected = if supported {
            when_supported(&e)
        } else {
            unsupported(&e)
        };
        assert!(expected, "{what}: {e:?}");
    }
    // A legacy-API QP has no way to carry the data: Unsupported on every device.
    let mut l = pair_api(caps_sr(8, 8), SendApi::Legacy);
    let target = l.pd.alloc_mr(64, all_remote()).unwrap();
    let e =
        l.a.post_send(SendWr::atomic_write(4, target.remote(), 0, VALUE))
            .unwrap_err();
    assert!(unsupported(&e.error), "{e:?}");
    let buf = l.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let e =
        l.a.post_send(SendWr::atomic_write(5, target.remote(), 0, VALUE).sge(buf))
            .unwrap_err();
    assert!(unsupported(&e.error), "with a buffer: {e:?}");
    assert!(l.cq_a.poll(&mut Vec::new()).unwrap() == 0);
}

/// A list mixing ATOMIC_WRITEs (only the extended API expresses them) with a
/// SEND of two buffers (only `ibv_post_send` does) is posted in order, each
/// run with its API; where the device lacks ATOMIC_WRITE it is refused
/// before anything is posted.
#[test]
fn a_list_mixing_atomic_writes_and_a_two_buffer_send_posts_all_in_order() {
    let caps = rdma_verbs::qp::QpCaps {
        max_send_sge: 2,
        ..caps_sr(8, 8)
    };
    let mut p = pair_api(caps, SendApi::Extended);
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let filled = |data: &[u8]| {
        let mut mr = p.pd.alloc_mr(data.len(), AccessFlags::empty()).unwrap();
        mr.write_at(0, data).unwrap();
        mr
    };
    let dest = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.post_recv(rdma_verbs::qp::RecvWr::new(9, dest)).unwrap();
    let list = [
        SendWr::atomic_write(1, target.remote(), 8, VALUE),
        SendWr::send(2).sge(filled(b"abcd")).sge(filled(b"efgh")),
        SendWr::atomic_write(3, target.remote(), 24, !VALUE),
    ];
    let posted = p.a.post_send_list(list);
    if !p.ctx.query_device().unwrap().atomic_write() {
        let e = posted.unwrap_err();
        assert!(matches!(e.error, Error::Unsupported { .. }), "{e:?}");
        assert_eq!(p.a.outstanding(), (0, 0), "nothing posted");
        return;
    }
    posted.unwrap();
    let c = wait(&mut p.cq_a, 3);
    let got: Vec<_> = c.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(got, [1, 2, 3].map(|id| (id, WcStatus::Success)));
    let mut r = wait(&mut p.cq_b, 1).pop().unwrap();
    assert_eq!((r.wr_id, r.byte_len), (9, 8));
    assert_eq!(r.take_mr().unwrap().to_vec().unwrap(), b"abcdefgh");
    let mut want = vec![0u8; 64];
    want[8..16].copy_from_slice(&VALUE.to_ne_bytes());
    want[24..32].copy_from_slice(&(!VALUE).to_ne_bytes());
    assert_eq!(target.to_vec().unwrap(), want);
}

/// A QP the device refuses for its caps (a million SGEs) does not turn
/// ATOMIC_WRITE off for the context: a QP made before it still carries one
/// where the device has it, and gets `Unsupported` where it does not.
#[test]
fn a_qp_refused_for_its_caps_leaves_atomic_write_on() {
    let mut p = pair_api(caps_sr(8, 8), SendApi::Extended);
    let too_many = rdma_verbs::qp::QpCaps {
        max_send_sge: 1 << 20,
        ..caps_sr(8, 8)
    };
    let refused = rdma_verbs::qp::Qp::new(&p.pd, &p.cq_a, &p.cq_a, too_many);
    assert!(refused.is_err(), "no device takes a million SGEs");
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let posted =
        p.a.post_send(SendWr::atomic_write(7, target.remote(), 8, VALUE));
    if !device_has_atomic_write(&p.ctx) {
        let e = posted.unwrap_err().error;
        assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
        return;
    }
    posted.unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!((c[0].wr_id, c[0].status), (7, WcStatus::Success));
    assert_eq!(target.to_vec().unwrap()[8..16], VALUE.to_ne_bytes());
}
