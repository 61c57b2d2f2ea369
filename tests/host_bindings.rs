//! The checked-in bindings (`src/ffi/bindings_<arch>.rs`, generated from the baseline
//! rdma-core) against the rdma-core headers this build compiled with: every size,
//! alignment and field offset the C compiler measures in `src/ffi/layout_probe.c`
//! must match the Rust side. Structs that rdma-core extends at the end (with a
//! `comp_mask`, their size passed to the library) may be larger in Rust than in older
//! headers, never smaller. Runs without an RDMA device.
//!
//! The bindings' own layout asserts (bindgen's, compiled into the crate) check the
//! same against the baseline headers for the target architecture.

use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};

use rdma_verbs::ffi;

/// Structs whose size grows across rdma-core releases by design.
const EXTENSIBLE: &[&str] = &["ibv_device_attr_ex", "ibv_qp_ex", "ibv_cq_ex"];

macro_rules! size {
    ($t:ident) => {
        [
            (concat!("size ", stringify!($t)), size_of::<ffi::$t>()),
            (concat!("align ", stringify!($t)), align_of::<ffi::$t>()),
        ]
    };
}
macro_rules! off {
    ($t:ident, $f:ident) => {
        [
            (
                concat!("offset ", stringify!($t), ".", stringify!($f)),
                offset_of!(ffi::$t, $f),
            ),
            ("", 0),
        ]
    };
}

fn rust_layouts() -> BTreeMap<&'static str, usize> {
    let all: Vec<[(&'static str, usize); 2]> = vec![
        size!(ibv_sge),
        size!(ibv_send_wr),
        size!(ibv_recv_wr),
        size!(ibv_wc),
        size!(ibv_qp_attr),
        size!(ibv_qp_init_attr),
        size!(ibv_qp_cap),
        size!(ibv_ah_attr),
        size!(ibv_global_route),
        size!(ibv_port_attr),
        size!(ibv_device_attr),
        size!(ibv_device_attr_ex),
        size!(ibv_gid_entry),
        size!(ibv_async_event),
        size!(ibv_context),
        size!(ibv_device),
        size!(ibv_pd),
        size!(ibv_mr),
        size!(ibv_cq),
        size!(ibv_qp),
        size!(ibv_srq),
        size!(ibv_comp_channel),
        size!(rdma_cm_event),
        size!(rdma_conn_param),
        size!(rdma_cm_id),
        size!(rdma_event_channel),
        size!(ibv_qp_ex),
        size!(ibv_cq_ex),
        off!(ibv_wc, wr_id),
        off!(ibv_wc, status),
        off!(ibv_wc, opcode),
        off!(ibv_wc, vendor_err),
        off!(ibv_wc, byte_len),
        off!(ibv_wc, qp_num),
        off!(ibv_wc, src_qp),
        off!(ibv_wc, wc_flags),
        off!(ibv_wc, pkey_index),
        off!(ibv_wc, slid),
        off!(ibv_wc, sl),
        off!(ibv_wc, dlid_path_bits),
        off!(ibv_send_wr, wr_id),
        off!(ibv_send_wr, next),
        off!(ibv_send_wr, sg_list),
        off!(ibv_send_wr, num_sge),
        off!(ibv_send_wr, opcode),
        off!(ibv_send_wr, send_flags),
        off!(ibv_send_wr, wr),
        off!(ibv_recv_wr, wr_id),
        off!(ibv_recv_wr, next),
        off!(ibv_recv_wr, sg_list),
        off!(ibv_recv_wr, num_sge),
        off!(ibv_qp_attr, qp_state),
        off!(ibv_qp_attr, cur_qp_state),
        off!(ibv_qp_attr, path_mtu),
        off!(ibv_qp_attr, qp_access_flags),
        off!(ibv_qp_attr, cap),
        off!(ibv_qp_attr, ah_attr),
        off!(ibv_qp_attr, pkey_index),
        off!(ibv_qp_attr, sq_draining),
        off!(ibv_qp_attr, max_rd_atomic),
        off!(ibv_qp_attr, port_num),
        off!(ibv_qp_attr, timeout),
        off!(ibv_qp_attr, retry_cnt),
        off!(ibv_qp_attr, rnr_retry),
        off!(ibv_qp_init_attr, qp_context),
        off!(ibv_qp_init_attr, send_cq),
        off!(ibv_qp_init_attr, recv_cq),
        off!(ibv_qp_init_attr, srq),
        off!(ibv_qp_init_attr, cap),
        off!(ibv_qp_init_attr, qp_type),
        off!(ibv_qp_init_attr, sq_sig_all),
        off!(ibv_port_attr, state),
        off!(ibv_port_attr, max_mtu),
        off!(ibv_port_attr, active_mtu),
        off!(ibv_port_attr, gid_tbl_len),
        off!(ibv_port_attr, lid),
        off!(ibv_port_attr, link_layer),
        off!(ibv_port_attr, active_speed),
        off!(ibv_device_attr_ex, orig_attr),
        off!(ibv_device_attr_ex, comp_mask),
        off!(ibv_context, device),
        off!(ibv_context, ops),
        off!(ibv_context, cmd_fd),
        off!(ibv_context, async_fd),
        off!(ibv_context, num_comp_vectors),
        off!(ibv_qp, context),
        off!(ibv_qp, qp_context),
        off!(ibv_qp, pd),
        off!(ibv_qp, send_cq),
        off!(ibv_qp, recv_cq),
        off!(ibv_qp, handle),
        off!(ibv_qp, qp_num),
        off!(ibv_qp, state),
        off!(ibv_qp, qp_type),
        off!(ibv_mr, context),
        off!(ibv_mr, pd),
        off!(ibv_mr, addr),
        off!(ibv_mr, length),
        off!(ibv_mr, handle),
        off!(ibv_mr, lkey),
        off!(ibv_mr, rkey),
        off!(rdma_cm_event, id),
        off!(rdma_cm_event, listen_id),
        off!(rdma_cm_event, event),
        off!(rdma_cm_event, status),
        off!(rdma_cm_event, param),
        off!(rdma_cm_id, verbs),
        off!(rdma_cm_id, channel),
        off!(rdma_cm_id, context),
        off!(rdma_cm_id, qp),
        off!(rdma_cm_id, route),
        off!(rdma_cm_id, ps),
        off!(rdma_cm_id, port_num),
        off!(rdma_cm_id, event),
        off!(rdma_cm_id, send_cq),
        off!(rdma_cm_id, recv_cq),
        off!(rdma_cm_id, srq),
        off!(rdma_cm_id, pd),
        off!(rdma_cm_id, qp_type),
        off!(ibv_async_event, element),
        off!(ibv_async_event, event_type),
        off!(ibv_gid_entry, gid),
        off!(ibv_gid_entry, gid_index),
        off!(ibv_gid_entry, port_num),
        off!(ibv_gid_entry, gid_type),
        off!(ibv_gid_entry, ndev_ifindex),
    ];
    all.into_iter()
        .flatten()
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

#[test]
fn bindings_match_the_installed_headers() {
    let rust = rust_layouts();
    let c = ffi::__layouts();
    assert_eq!(
        c.len(),
        rust.len(),
        "layout_probe.c and this test list different facts"
    );
    let mut bad = Vec::new();
    for (name, c_value) in &c {
        let r = *rust
            .get(name.as_str())
            .unwrap_or_else(|| panic!("{name} not in the test"));
        let extensible = name
            .strip_prefix("size ")
            .is_some_and(|t| EXTENSIBLE.contains(&t));
        let ok = if extensible {
            r >= *c_value
        } else {
            r == *c_value
        };
        if !ok {
            bad.push(format!("{name}: C {c_value}, Rust {r}"));
        }
    }
    assert!(
        bad.is_empty(),
        "bindings differ from the installed headers:\n{}",
        bad.join("\n")
    );
}

/// `cargo xtask matrix` sets `RDMA_VERBS_EXPECT_UNSUPPORTED=ibv_reg_dmabuf_mr` where the
/// libibverbs loaded at run time predates the verb (Debian 11's): the call must then be
/// the typed error, without reaching C (so the null arguments are never used).
#[test]
fn verbs_missing_from_the_loaded_library_are_unsupported() {
    let Ok(expect) = std::env::var("RDMA_VERBS_EXPECT_UNSUPPORTED") else {
        return;
    };
    if expect.split(',').any(|v| v == "ibv_reg_dmabuf_mr") {
        // SAFETY: the symbol is absent (the matrix says so), so nothing is called.
        let r = unsafe { ffi::ibv_reg_dmabuf_mr(std::ptr::null_mut(), 0, 0, 0, -1, 0) }
            .map_err(rdma_verbs::Error::from);
        match r {
            Err(
                e @ rdma_verbs::Error::Unsupported {
                    verb: "ibv_reg_dmabuf_mr",
                    ..
                },
            ) => {
                assert!(
                    e.to_string()
                        .contains("is not supported: the libibverbs loaded"),
                    "{e}"
                );
            }
            other => panic!("expected Error::Unsupported, got {other:?}"),
        }
    }
}
