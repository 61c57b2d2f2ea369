//! Device discovery and attributes on real soft-RoCE, checked field by field
//! against `ibv_devinfo -v` run in the same guest.

mod common;

use std::collections::HashMap;
use std::process::Command;

use common::ctx;
use rdma_verbs::Error;
use rdma_verbs::cq::Cq;
use rdma_verbs::device::{GidType, LinkLayer, PortState, devices, format_guid};

/// `ibv_devinfo -v -d DEV` parsed into (device-level fields, per-port fields, GID lines).
struct DevInfo {
    dev: HashMap<String, String>,
    ports: Vec<HashMap<String, String>>,
    gids: Vec<(u8, u8, String)>,
}

fn ibv_devinfo(dev: &str) -> DevInfo {
    let out = Command::new("ibv_devinfo")
        .args(["-v", "-d", dev])
        .output()
        .expect("run ibv_devinfo");
    assert!(
        out.status.success(),
        "ibv_devinfo failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut info = DevInfo {
        dev: HashMap::new(),
        ports: Vec::new(),
        gids: Vec::new(),
    };
    for line in text.lines() {
        let t = line.trim();
        let Some((k, v)) = t.split_once(':') else {
            continue;
        };
        let (k, v) = (k.trim().to_owned(), v.trim().to_owned());
        if k == "port" {
            info.ports.push(HashMap::new());
        } else if let Some(idx) = k.strip_prefix("GID[").and_then(|s| s.strip_suffix(']')) {
            info.gids
                .push((info.ports.len() as u8, idx.trim().parse().unwrap(), v));
        } else if let Some(p) = info.ports.last_mut() {
            p.entry(k).or_insert(v);
        } else {
            info.dev.entry(k).or_insert(v);
        }
    }
    info
}

fn num(s: &str) -> u64 {
    let s = s.split_whitespace().next().unwrap_or(s);
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap_or_else(|_| panic!("not a number: {s}")),
    }
}

#[test]
fn device_list_finds_the_soft_roce_device() {
    let want = std::env::var("RDMA_VERBS_DEVICE").unwrap_or_else(|_| "rxe0".into());
    let list = devices().expect("device list");
    assert!(!list.is_empty());
    let d = list.find(Some(&want)).expect("device by name");
    assert_eq!(d.name(), want);
    // soft-iWARP's devices are siwN (an RNIC), soft-RoCE's rxeN (a CA on the IB
    // transport, as RoCE reports).
    use rdma_verbs::device::{NodeType, Transport};
    let kind = if want.starts_with("siw") {
        (Transport::Iwarp, NodeType::Rnic)
    } else {
        (Transport::Ib, NodeType::Ca)
    };
    assert_eq!((d.transport(), d.node_type()), kind);
    match list.find(Some("no_such_dev0")) {
        Err(Error::DeviceNotFound { name, available }) => {
            assert_eq!(name, "no_such_dev0");
            assert!(available.contains(&want));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn query_device_matches_ibv_devinfo() {
    let ctx = ctx();
    let a = ctx.query_device().unwrap();
    let info = ibv_devinfo(ctx.name());
    let d = &info.dev;
    assert_eq!(d["hca_id"], ctx.name());
    assert_eq!(d["fw_ver"], a.fw_ver);
    assert_eq!(d["node_guid"], format_guid(a.node_guid));
    assert_eq!(d["sys_image_guid"], format_guid(a.sys_image_guid));
    assert_eq!(num(&d["vendor_id"]), u64::from(a.vendor_id));
    assert_eq!(num(&d["vendor_part_id"]), u64::from(a.vendor_part_id));
    assert_eq!(num(&d["hw_ver"]), u64::from(a.hw_ver));
    assert_eq!(num(&d["phys_port_cnt"]), u64::from(a.phys_port_cnt));
    assert_eq!(num(&d["max_mr_size"]), a.max_mr_size);
    assert_eq!(num(&d["page_size_cap"]), a.page_size_cap);
    let ints: [(&str, i64); 27] = [
        ("max_qp", a.max_qp.into()),
        ("max_qp_wr", a.max_qp_wr.into()),
        ("max_sge", a.max_sge.into()),
        ("max_sge_rd", a.max_sge_rd.into()),
        ("max_cq", a.max_cq.into()),
        ("max_cqe", a.max_cqe.into()),
        ("max_mr", a.max_mr.into()),
        ("max_pd", a.max_pd.into()),
        ("max_qp_rd_atom", a.max_qp_rd_atom.into()),
        ("max_ee_rd_atom", a.max_ee_rd_atom.into()),
        ("max_res_rd_atom", a.max_res_rd_atom.into()),
        ("max_qp_init_rd_atom", a.max_qp_init_rd_atom.into()),
        ("max_ee_init_rd_atom", a.max_ee_init_rd_atom.into()),
        ("max_ee", a.max_ee.into()),
        ("max_rdd", a.max_rdd.into()),
        ("max_mw", a.max_mw.into()),
        ("max_raw_ipv6_qp", a.max_raw_ipv6_qp.into()),
        ("max_raw_ethy_qp", a.max_raw_ethy_qp.into()),
        ("max_mcast_grp", a.max_mcast_grp.into()),
        ("max_mcast_qp_attach", a.max_mcast_qp_attach.into()),
        (
            "max_total_mcast_qp_attach",
            a.max_total_mcast_qp_attach.into(),
        ),
        ("max_ah", a.max_ah.into()),
        ("max_srq", a.max_srq.into()),
        ("max_srq_wr", a.max_srq_wr.into()),
        ("max_srq_sge", a.max_srq_sge.into()),
        ("max_pkeys", a.max_pkeys.into()),
        ("local_ca_ack_delay", a.local_ca_ack_delay.into()),
    ];
    for (k, v) in ints {
        assert_eq!(num(&d[k]) as i64, v, "{k}");
    }
    assert!(
        d["atomic_cap"].starts_with(a.atomic_cap.name()),
        "atomic_cap {} vs {}",
        d["atomic_cap"],
        a.atomic_cap
    );
}

#[test]
fn query_port_and_gid_table_match_ibv_devinfo() {
    let ctx = ctx();
    let info = ibv_devinfo(ctx.name());
    let nports = ctx.query_device().unwrap().phys_port_cnt;
    assert_eq!(info.ports.len(), usize::from(nports));
    for (i, p) in info.ports.iter().enumerate() {
        let a = ctx.query_port(i as u8 + 1).unwrap();
        assert!(
            p["state"].starts_with(a.state.name()),
            "state {} vs {}",
            p["state"],
            a.state
        );
        assert_eq!(
            p["max_mtu"].split_whitespace().next().unwrap(),
            a.max_mtu.name()
        );
        assert_eq!(
            p["active_mtu"].split_whitespace().next().unwrap(),
            a.active_mtu.name()
        );
        assert_eq!(num(&p["sm_lid"]), u64::from(a.sm_lid));
        assert_eq!(num(&p["port_lid"]), u64::from(a.lid));
        assert_eq!(num(&p["port_lmc"]), u64::from(a.lmc));
        assert_eq!(p["link_layer"], a.link_layer.name());
        assert_eq!(num(&p["max_msg_sz"]), u64::from(a.max_msg_sz));
        assert_eq!(num(&p["port_cap_flags"]), u64::from(a.port_cap_flags));
        // "invalid value (0)" where the port has no VLs (iWARP).
        let vl = &p["max_vl_num"];
        let vl = vl
            .strip_prefix("invalid value (")
            .and_then(|v| v.strip_suffix(')'))
            .unwrap_or_else(|| vl.split_whitespace().next().unwrap());
        assert_eq!(num(vl), u64::from(a.max_vl_num));
        assert_eq!(num(&p["pkey_tbl_len"]), u64::from(a.pkey_tbl_len));
        assert_eq!(num(&p["gid_tbl_len"]), a.gid_tbl_len as u64);
        match p.get("phys_state") {
            Some(ps) => assert!(
                ps.ends_with(&format!("({})", a.phys_state)),
                "phys_state {ps} vs {}",
                a.phys_state
            ),
            // ibv_devinfo prints no physical state for an iWARP port.
            None => assert!(common::iwarp(&ctx), "ibv_devinfo printed no phys_state"),
        }
        assert_eq!(a.state, PortState::Active);
        assert_eq!(a.link_layer, LinkLayer::Ethernet);
    }
    // GIDs: same index, value and type as ibv_devinfo prints.
    let table = ctx.gid_table().unwrap();
    // ibv_devinfo of rdma-core 44 lists no GID for siw on 6.12 (it does on 6.1); the
    // crate's table has siw's one entry on both, checked below.
    let listed = !info.gids.is_empty() || !common::iwarp(&ctx);
    assert!(listed || table.len() == 1, "{table:?}");
    assert!(listed || info.gids.is_empty());
    if listed {
        assert!(!info.gids.is_empty());
        assert_eq!(table.len(), info.gids.len(), "{table:?} vs {:?}", info.gids);
    }
    for (port, idx, text) in &info.gids {
        let e = table
            .iter()
            .find(|e| e.port == *port && e.index == *idx)
            .unwrap_or_else(|| panic!("GID[{idx}] missing"));
        let mut parts = text.split(',').map(str::trim);
        assert_eq!(parts.next().unwrap(), e.gid.to_string(), "GID[{idx}] value");
        if let Some(ty) = parts.next() {
            assert_eq!(ty, e.gid_type.name(), "GID[{idx}] type");
        }
        assert_eq!(ctx.query_gid(*port, *idx).unwrap(), e.gid);
        let ex = ctx.query_gid_entry(*port, *idx).unwrap();
        assert_eq!(&ex, e);
    }
    if common::iwarp(&ctx) {
        // siw's one GID is built from the netdev's MAC; it has no address GIDs.
        assert_eq!(table.len(), 1, "{table:?}");
        assert_eq!(table[0].gid_type, GidType::Ib, "{table:?}");
        assert!(!table[0].gid.is_ipv4_mapped(), "{table:?}");
        common::deviation("one GID, from the netdev's MAC, type IB: no RoCE v2 GID");
        return;
    }
    let v2 = table
        .iter()
        .find(|e| e.gid_type == GidType::RoceV2 && e.gid.to_string().starts_with("::ffff:"))
        .expect("RoCE v2 IPv4 GID");
    if let Ok(addr) = std::env::var("RDMA_VERBS_ADDR") {
        assert_eq!(v2.gid.to_string(), format!("::ffff:{addr}"));
    }
    assert!(v2.netdev.is_some(), "{v2:?}");
}

#[test]
fn bad_port_and_gid_index_are_typed_errors() {
    let ctx = ctx();
    assert!(matches!(
        ctx.query_port(7),
        Err(Error::InvalidArgument { what: "port", .. })
    ));
    assert!(matches!(
        ctx.query_gid_entry(1, 200),
        Err(Error::InvalidArgument {
            what: "gid index",
            ..
        })
    ));
    // An index past the table, or an empty slot, is an error naming the valid
    // ones (it used to come back as the zero GID).
    match ctx.query_gid(1, 200) {
        Err(
            e @ Error::InvalidArgument {
                what: "gid index", ..
            },
        ) => assert!(e.to_string().contains("valid: "), "{e}"),
        other => panic!("{other:?}"),
    }
    // A GID of a port that does not exist names the port.
    for port in [0, 2, 255] {
        assert!(
            matches!(
                ctx.query_gid(port, 0),
                Err(Error::InvalidArgument { what: "port", .. })
            ),
            "port {port}"
        );
    }
}

#[test]
fn the_default_gid_is_the_roce_v2_ipv4_mapped_one() {
    let ctx = ctx();
    let i = ctx
        .default_gid_index(1)
        .unwrap()
        .expect("rxe is RoCE: a GID is needed");
    let e = ctx.query_gid_entry(1, i).unwrap();
    if common::iwarp(&ctx) {
        // siw's one GID (index 0) comes from the netdev's MAC.
        assert_eq!(
            (i, e.gid_type),
            (0, rdma_verbs::device::GidType::Ib),
            "{e:?}"
        );
        assert!(!e.gid.is_ipv4_mapped(), "{e:?}");
        common::deviation("the default GID is the MAC-based IB one: no RoCE v2 GID");
        return;
    }
    assert_eq!(e.gid_type, rdma_verbs::device::GidType::RoceV2);
    assert!(e.gid.is_ipv4_mapped(), "{e:?}");
    let addr = std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into());
    assert_eq!(e.gid.to_ipv6().to_ipv4_mapped().unwrap().to_string(), addr);
}

#[test]
fn cq_deeper_than_max_cqe_is_refused_cleanly() {
    let ctx = ctx();
    let max = ctx.query_device().unwrap().max_cqe as u32;
    match Cq::new(&ctx, max + 1) {
        Err(Error::InvalidArgument {
            what: "CQ depth",
            reason,
        }) => assert!(reason.contains(&max.to_string()), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Cq::new(&ctx, 0),
        Err(Error::InvalidArgument { .. })
    ));
    let cq = Cq::new(&ctx, max).expect("max_cqe itself is fine");
    assert!(cq.depth() >= max);
}
