//! FLUSH (`SendWr::flush`) on real soft-RoCE: where the loaded libibverbs has
//! `ibv_wr_flush` (rdma-core 45 on: the guest's `--rdma-core 56`) and the device
//! reports the placement (rxe from Linux 6.2: the 6.12 guest), a WRITE followed by a
//! FLUSH completes with `FLUSH` and the bytes are there; elsewhere posting it is refused
//! with `Error::Unsupported` naming what is missing (the library's release, or the
//! device's capability), and nothing is posted.
//!
//! Which userland the guest runs comes from the runner (`RDMA_VERBS_VM_RDMA_CORE=56`
//! where it laid Debian 13's rdma-core over the host's; unset: the host's own).

mod common;

use common::{Pair, all_remote, caps_sr, ctx, pair_api, pair_api_access, pattern, wait};
use rdma_verbs::Error;
use rdma_verbs::cq::{WcOpcode, WcStatus};
use rdma_verbs::ffi;
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::qp::{FlushPlacement, SendApi, SendWr};

/// Whether the kernel is 6.2 or newer (rxe's FLUSH and its MR access flags).
fn kernel_has_flush() -> bool {
    common::kernel_version() >= (6, 2)
}

/// Whether the runner gave the guest rdma-core 56.
fn runs_rdma_core_56() -> bool {
    std::env::var("RDMA_VERBS_VM_RDMA_CORE").as_deref() == Ok("56")
}

/// The release in the name of the host's libibverbs (`44` of `libibverbs.so.1.14.44.0`).
fn hosts_release_by_name() -> Option<u32> {
    let real = std::fs::canonicalize("/usr/lib/x86_64-linux-gnu/libibverbs.so.1").ok()?;
    let name = real.file_name()?.to_str()?.to_owned();
    name.strip_prefix("libibverbs.so.1.")?
        .split('.')
        .nth(1)?
        .parse()
        .ok()
}

#[test]
fn the_loaded_libibverbs_is_the_guests() {
    let release = ffi::libibverbs_release();
    println!(
        "libibverbs release {release:?}, wr_flush {}, RDMA_VERBS_VM_RDMA_CORE {:?}",
        ffi::has_wr_flush(),
        std::env::var("RDMA_VERBS_VM_RDMA_CORE")
    );
    if runs_rdma_core_56() {
        // Laid over 44's file name: told by ibv_wr_opcode_str (rdma-core 49 on).
        assert!(release.is_some_and(|r| r >= 49), "{release:?}");
        assert!(ffi::has_wr_flush());
    } else {
        assert_eq!(release, hosts_release_by_name());
        assert_eq!(
            ffi::has_wr_flush(),
            release.is_some_and(|r| r >= ffi::FLUSH_SINCE)
        );
    }
}

#[test]
fn the_device_reports_flush_where_it_has_it() {
    let ctx = ctx();
    let attr = ctx.query_device().unwrap();
    let expected = kernel_has_flush() && !common::iwarp(&ctx);
    assert_eq!(
        attr.flush_global(),
        expected,
        "device_cap_flags_ex {:#x}",
        attr.device_cap_flags_ex
    );
}

/// A pair of extended-API QPs that take FLUSH to the global visibility point from their
/// peer where the kernel knows the access flag: rxe's responder checks the QP's
/// `qp_access_flags` before the MR's.
fn flush_pair() -> Pair {
    let access = if kernel_has_flush() {
        all_remote() | AccessFlags::FLUSH_GLOBAL
    } else {
        all_remote()
    };
    pair_api_access(caps_sr(8, 8), SendApi::Extended, access)
}

/// Whether FLUSH to the global visibility point can run here, from the kernel, the
/// provider and the userland the runner gave the guest.
fn flush_expected(ctx: &rdma_verbs::context::Context) -> bool {
    kernel_has_flush() && !common::iwarp(ctx) && ffi::has_wr_flush()
}

/// Checks the refusal of a FLUSH where it cannot run: the hint names the library's release
/// where it is older than 45, else the device's capability.
fn assert_refused(e: &Error) {
    assert!(
        matches!(
            e,
            Error::Unsupported {
                verb: "ibv_wr_flush",
                ..
            }
        ),
        "{e:?}"
    );
    let text = e.to_string();
    if ffi::has_wr_flush() {
        assert!(text.contains("IB_UVERBS_DEVICE_FLUSH_GLOBAL"), "{text}");
    } else {
        assert!(text.contains("older than rdma-core 45"), "{text}");
    }
}

#[test]
fn a_write_then_a_flush_lands_or_the_flush_is_refused_naming_what_is_missing() {
    let mut p = flush_pair();
    let expected = flush_expected(&p.ctx);
    // Kernels before 6.2 refuse the FLUSH access flags at registration.
    let access = if kernel_has_flush() {
        all_remote() | AccessFlags::FLUSH_GLOBAL
    } else {
        all_remote()
    };
    let target = p.pd.alloc_mr(4096, access).unwrap();
    let data = pattern(256, 7);
    let mut src = p.pd.alloc_mr(256, AccessFlags::empty()).unwrap();
    src.as_mut_slice().unwrap().copy_from_slice(&data);
    p.a.post_send(SendWr::write_from(1, src, target.remote(), 512))
        .unwrap();
    let flushed = p.a.post_send(SendWr::flush(
        2,
        target.remote(),
        512,
        256,
        FlushPlacement::Global,
    ));
    if !expected {
        assert_refused(&flushed.unwrap_err().error);
        let c = wait(&mut p.cq_a, 1);
        assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));
        assert_eq!(&target.to_vec().unwrap()[512..768], &data[..]);
        // Nothing else was posted.
        assert_eq!(p.cq_a.poll(&mut Vec::new()).unwrap(), 0);
        return;
    }
    flushed.unwrap();
    let c = wait(&mut p.cq_a, 2);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (1, WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert_eq!(
        (c[1].wr_id, c[1].status, c[1].opcode),
        (2, WcStatus::Success, WcOpcode::Flush),
        "{:?}",
        c[1]
    );
    let bytes = target.to_vec().unwrap();
    assert_eq!(&bytes[512..768], &data[..]);
    assert!(bytes[..512].iter().chain(&bytes[768..]).all(|&b| b == 0));
    // The whole MR, too.
    p.a.post_send(SendWr::flush_mr(3, target.remote(), FlushPlacement::Global))
        .unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (3, WcStatus::Success, WcOpcode::Flush)
    );
}

#[test]
fn bad_flushes_are_refused_with_what_is_wrong() {
    let mut p = pair_api(caps_sr(8, 8), SendApi::Extended);
    let expected = flush_expected(&p.ctx);
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    let past_end = p.a.post_send(SendWr::flush(
        1,
        target.remote(),
        32,
        64,
        FlushPlacement::Global,
    ));
    let buf = p.pd.alloc_mr(8, AccessFlags::empty()).unwrap();
    let with_buffer =
        p.a.post_send(SendWr::flush(2, target.remote(), 0, 8, FlushPlacement::Global).sge(buf));
    if expected {
        let e = past_end.unwrap_err().error;
        assert!(
            matches!(
                e,
                Error::RemoteOutOfBounds {
                    offset: 32,
                    len: 64,
                    ..
                }
            ),
            "{e:?}"
        );
        let e = with_buffer.unwrap_err().error;
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    } else {
        assert_refused(&past_end.unwrap_err().error);
        assert_refused(&with_buffer.unwrap_err().error);
    }
    // A legacy-API QP cannot carry it: Unsupported everywhere.
    let mut l = pair_api(caps_sr(8, 8), SendApi::Legacy);
    let target = l.pd.alloc_mr(64, all_remote()).unwrap();
    let e =
        l.a.post_send(SendWr::flush(
            3,
            target.remote(),
            0,
            8,
            FlushPlacement::Global,
        ))
        .unwrap_err()
        .error;
    assert!(
        matches!(
            e,
            Error::Unsupported {
                verb: "ibv_wr_flush",
                ..
            }
        ),
        "{e:?}"
    );
    if expected {
        assert!(e.to_string().contains("extended send API"), "{e}");
    }
    assert_eq!(l.cq_a.poll(&mut Vec::new()).unwrap(), 0);
}

#[test]
fn a_flush_of_memory_registered_without_its_flag_is_a_remote_access_error() {
    let mut p = flush_pair();
    if !flush_expected(&p.ctx) {
        let target = p.pd.alloc_mr(64, all_remote()).unwrap();
        let e =
            p.a.post_send(SendWr::flush(
                1,
                target.remote(),
                0,
                64,
                FlushPlacement::Global,
            ))
            .unwrap_err()
            .error;
        assert_refused(&e);
        return;
    }
    // Remotely writable, but not registered for FLUSH.
    let target = p.pd.alloc_mr(64, all_remote()).unwrap();
    p.a.post_send(SendWr::flush(
        1,
        target.remote(),
        0,
        64,
        FlushPlacement::Global,
    ))
    .unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status),
        (1, WcStatus::RemAccessErr),
        "{:?}",
        c[0]
    );
}

#[test]
fn a_flush_to_a_qp_without_its_access_flag_is_an_invalid_request() {
    // The responder QP takes remote writes, not FLUSH: rxe refuses the request before it
    // looks at the MR (its `check_qp_attr_access`).
    let mut p = pair_api(caps_sr(8, 8), SendApi::Extended);
    let access = if kernel_has_flush() {
        all_remote() | AccessFlags::FLUSH_GLOBAL
    } else {
        all_remote()
    };
    let target = p.pd.alloc_mr(64, access).unwrap();
    let posted = p.a.post_send(SendWr::flush(
        1,
        target.remote(),
        0,
        64,
        FlushPlacement::Global,
    ));
    if !flush_expected(&p.ctx) {
        assert_refused(&posted.unwrap_err().error);
        return;
    }
    posted.unwrap();
    let c = wait(&mut p.cq_a, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (1, WcStatus::RemInvReqErr, WcOpcode::Flush),
        "{:?}",
        c[0]
    );
}
