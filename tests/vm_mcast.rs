//! UD multicast on soft-RoCE, in one guest (rxe loops a group's datagrams
//! back to the QPs attached on the same device): verbs attach and detach
//! with the bytes and GRH checked, what the kernel does to a QP destroyed
//! with a group attached, rdma_cm join / leave, typed refusals, and
//! interop with librdmacm's `mckey` (rdmacm-utils) in both roles. The tests
//! take turns (`serial`): one counts the device's QPs. Runs in
//! the guest (`cargo xtask test`); without an RDMA device every test fails.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::procs::{Proc, example};
use common::{guest_ip, pattern, res_counts, serial, wait};
use rdma_verbs::ah::{GRH_LEN, grh_source_gid};
use rdma_verbs::cm::{CmEventKind, CmId, UDP_QKEY, UdPeer};
use rdma_verbs::ffi;
use rdma_verbs::prelude::*;
use rdma_verbs::qp::{AddressVector, MULTICAST_QPN, McastGroup, UdMessage};

/// Upper bound of an rdma_cm step (TCG is slow).
const T: Duration = Duration::from_secs(20);
/// How long a test waits to be sure a datagram does not arrive.
const SILENCE: Duration = Duration::from_millis(1500);
/// The Q_Key of the verbs-level tests' QPs.
const QKEY: u32 = 0x1111_1111;

/// The GID a datagram from this host carries as its source (RoCE v2 over IPv4).
fn own_gid() -> Gid {
    match guest_ip() {
        IpAddr::V4(v4) => Gid(v4.to_ipv6_mapped().octets()),
        IpAddr::V6(v6) => Gid(v6.octets()),
    }
}

/// The GID of IPv4 group `g` on RoCE v2 (`::ffff:g`).
fn group_gid(g: Ipv4Addr) -> Gid {
    Gid(g.to_ipv6_mapped().octets())
}

fn caps(n: u32) -> QpCaps {
    QpCaps {
        max_send_wr: n,
        max_recv_wr: n,
        ..QpCaps::default()
    }
}

/// A UD QP in RTS with the Q_Key [`QKEY`] and `recvs` receives of `len` bytes.
fn ud_qp(pd: &Pd, cq: &Cq, recvs: usize, len: usize) -> Qp<Ud, Rts> {
    let mut qp = Qp::new_ud(pd, cq, cq, caps(16))
        .expect("ud qp")
        .init(UdInitAttr::new(1, QKEY))
        .expect("init")
        .ready()
        .expect("rts");
    post_recvs(pd, &mut qp, recvs, len);
    qp
}

fn post_recvs(pd: &Pd, qp: &mut Qp<Ud, Rts>, n: usize, len: usize) {
    for i in 0..n {
        let grh = pd.alloc_mr(GRH_LEN, AccessFlags::LOCAL_WRITE).expect("grh");
        let payload = pd.alloc_mr(len, AccessFlags::LOCAL_WRITE).expect("payload");
        qp.post_recv(UdRecvWr::new(100 + i as u64, grh, payload))
            .expect("post recv");
    }
}

fn mr_with(pd: &Pd, data: &[u8]) -> Mr {
    let mut mr = pd.alloc_mr(data.len(), AccessFlags::empty()).expect("mr");
    mr.as_mut_slice().expect("slice").copy_from_slice(data);
    mr
}

/// One receive completion of `cq`, taken apart, and its payload.
fn recv_one(cq: &mut Cq) -> (Completion, UdMessage, Vec<u8>) {
    let mut c = wait(cq, 1).pop().unwrap();
    c.result().expect("receive status");
    assert_eq!(c.opcode, WcOpcode::Recv, "{c:?}");
    let m = c.take_ud().expect("a UD receive");
    let p = m.payload.as_ref().unwrap().to_vec().unwrap()[..m.len as usize].to_vec();
    (c, m, p)
}

/// Asserts that nothing completes on `cq` for [`SILENCE`].
fn assert_silent(cq: &mut Cq, what: &str) {
    let mut out = Vec::new();
    match cq.poll_n(&mut out, 1, SILENCE) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("{what}: expected no completion, got {other:?} {out:?}"),
    }
}

/// Checks the GRH of a datagram to IPv4 group `g`: on RoCE v2 over IPv4 its
/// last 20 bytes are the IPv4 header, whose destination is the group.
fn assert_grh_to_group(c: &Completion, m: &UdMessage, g: Ipv4Addr) {
    assert!(c.has_grh(), "a RoCE UD receive has a GRH");
    assert_eq!(m.sgid, Some(own_gid()));
    assert_eq!(grh_source_gid(&m.grh_bytes), Some(own_gid()));
    assert_eq!(&m.grh_bytes[36..40], &g.octets(), "IPv4 destination");
}

/// The interface's IP-level membership of group `g` (IGMP), which rxe's
/// local loopback of multicast goes by; rdma_cm's join adds it itself.
fn ip_member(g: Ipv4Addr) -> UdpSocket {
    let IpAddr::V4(me) = guest_ip() else {
        panic!("an IPv4 guest address")
    };
    let s = UdpSocket::bind("0.0.0.0:0").expect("udp socket");
    s.join_multicast_v4(&g, &me).expect("IP_ADD_MEMBERSHIP");
    s
}

#[test]
fn verbs_attach_delivers_and_detach_stops_delivery() {
    let _serial = serial();
    let g = Ipv4Addr::new(239, 10, 0, 1);
    let _igmp = ip_member(g);
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let (mut cq_a, mut cq_b, cq_s) = (
        Cq::new(&ctx, 64).unwrap(),
        Cq::new(&ctx, 64).unwrap(),
        Cq::new(&ctx, 64).unwrap(),
    );
    let (a, b) = (ud_qp(&pd, &cq_a, 4, 256), ud_qp(&pd, &cq_b, 4, 256));
    let mut s = ud_qp(&pd, &cq_s, 0, 0);
    a.attach_mcast(group_gid(g), 0).expect("attach a");
    b.attach_mcast(group_gid(g), 0).expect("attach b");
    assert_eq!(
        a.mcast_groups(),
        vec![McastGroup {
            gid: group_gid(g),
            lid: 0
        }]
    );
    let av = AddressVector::global(1, group_gid(g), common::gid_index(&ctx));
    let ah = AddressHandle::new(&pd, av).expect("ah to the group");
    let msg = pattern(200, 3);
    s.post_send(UdSendWr::send_from(1, mr_with(&pd, &msg), &ah, MULTICAST_QPN, QKEY).imm(7))
        .expect("send to the group");
    for cq in [&mut cq_a, &mut cq_b] {
        let (c, m, p) = recv_one(cq);
        assert_eq!(p, msg);
        assert_eq!(c.byte_len as usize, GRH_LEN + msg.len());
        assert_eq!((m.src_qp, m.imm_data), (s.qp_num(), Some(7)));
        assert_grh_to_group(&c, &m, g);
    }
    // After a's detach only b receives.
    a.detach_mcast(group_gid(g), 0).expect("detach a");
    assert!(a.mcast_groups().is_empty());
    let msg2 = pattern(100, 5);
    s.post_send(UdSendWr::send_from(
        2,
        mr_with(&pd, &msg2),
        &ah,
        MULTICAST_QPN,
        QKEY,
    ))
    .expect("send again");
    let (_, _, p) = recv_one(&mut cq_b);
    assert_eq!(p, msg2);
    assert_silent(&mut cq_a, "a detached QP");
}

#[test]
fn attach_refusals_are_typed() {
    let _serial = serial();
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 16).unwrap();
    let qp = ud_qp(&pd, &cq, 0, 0);
    let unicast = own_gid();
    match qp.attach_mcast(unicast, 0) {
        Err(Error::InvalidArgument { what, reason }) => {
            assert_eq!(what, "multicast GID");
            assert!(reason.contains("not a multicast GID"), "{reason}");
        }
        other => panic!("a unicast GID: {other:?}"),
    }
    let g = group_gid(Ipv4Addr::new(239, 10, 0, 2));
    qp.attach_mcast(g, 0).expect("attach");
    match qp.attach_mcast(g, 0) {
        Err(Error::InvalidArgument { what, reason }) => {
            assert_eq!(what, "multicast group");
            assert!(reason.contains("already attached"), "{reason}");
        }
        other => panic!("a second attach: {other:?}"),
    }
    let other = group_gid(Ipv4Addr::new(239, 10, 0, 3));
    match qp.detach_mcast(other, 0) {
        Err(Error::InvalidArgument { what, reason }) => {
            assert_eq!(what, "multicast group");
            assert!(reason.contains("not attached"), "{reason}");
        }
        other => panic!("detaching a group never attached: {other:?}"),
    }
    qp.detach_mcast(g, 0).expect("detach");
}

/// The kernel refuses to destroy a QP with a group attached (uverbs: EBUSY),
/// so the crate's drop detaches first; a dropped attached QP is really gone.
#[test]
fn destroying_an_attached_qp() {
    let _serial = serial();
    let dev = std::env::var("RDMA_VERBS_DEVICE").unwrap_or_else(|_| "rxe0".into());
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 16).unwrap();
    let g = group_gid(Ipv4Addr::new(239, 10, 0, 4));
    let before = res_counts(&dev)["qp"];
    {
        let qp = ud_qp(&pd, &cq, 0, 0);
        let raw_gid = ffi::ibv_gid { raw: g.0 };
        // SAFETY: a live UD QP; the gid is read during the call only.
        let rc = unsafe { ffi::ibv_attach_mcast(qp.as_raw(), &raw_gid, 0) };
        assert_eq!(rc, 0, "raw attach");
        // SAFETY: the QP is live; if the kernel destroyed it, it is forgotten
        // below so the Qp's drop does not destroy it twice.
        let rc = unsafe { ffi::ibv_destroy_qp(qp.as_raw()) };
        if rc == 0 {
            std::mem::forget(qp);
            panic!("ibv_destroy_qp destroyed a QP with a group attached");
        }
        assert_eq!(rc, libc::EBUSY, "ibv_destroy_qp of an attached QP");
        // SAFETY: as above; the QP is still there.
        let rc = unsafe { ffi::ibv_detach_mcast(qp.as_raw(), &raw_gid, 0) };
        assert_eq!(rc, 0, "raw detach");
    }
    assert_eq!(
        res_counts(&dev)["qp"],
        before,
        "the raw-attached QP is gone"
    );
    {
        let qp = ud_qp(&pd, &cq, 0, 0);
        qp.attach_mcast(g, 0).expect("attach");
        assert_eq!(res_counts(&dev)["qp"], before + 1);
    }
    assert_eq!(
        res_counts(&dev)["qp"],
        before,
        "the drop of an attached QP detaches and destroys it"
    );
}

/// A UD id resolved to `group` from the guest's address, its QP (Q_Key
/// UDP_QKEY) and `recvs` receives of `len` bytes.
fn cm_member(group: SocketAddr, recvs: usize, len: usize) -> (CmId, Pd, Cq, Qp<Ud, Rts>) {
    let id = CmId::new_ud().expect("UD id (needs an RDMA device: `cargo xtask test`)");
    id.resolve_addr(Some(common::guest_at(0)), group, T)
        .expect("resolve the group from the guest's address");
    let ctx = id.context().expect("context");
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 64).expect("cq");
    let mut qp = id.create_ud_qp(&pd, &cq, &cq, caps(16)).expect("UD QP");
    post_recvs(&pd, &mut qp, recvs, len);
    (id, pd, cq, qp)
}

#[test]
fn cm_join_send_receive_leave() {
    let _serial = serial();
    let g = Ipv4Addr::new(239, 10, 1, 1);
    let group = SocketAddr::new(g.into(), 0);
    let (id_a, _pa, mut cq_a, qp_a) = cm_member(group, 4, 512);
    let (id_b, _pb, mut cq_b, qp_b) = cm_member(group, 4, 512);
    let (id_s, pd_s, mut cq_s, mut qp_s) = cm_member(group, 0, 0);
    let (_, ev) = id_a.join_multicast(&qp_a, group, T).expect("join a");
    assert_eq!(ev.kind, CmEventKind::MulticastJoin);
    let ud = ev.ud.expect("the group's UD parameters");
    assert_eq!((ud.qp_num, ud.qkey), (MULTICAST_QPN, UDP_QKEY));
    assert_eq!(ud.av.grh.expect("a GRH").dgid, group_gid(g));
    id_b.join_multicast(&qp_b, group, T).expect("join b");
    let (peer, _) = id_s.join_multicast(&qp_s, group, T).expect("join s");
    assert_eq!((peer.qpn, peer.qkey), (MULTICAST_QPN, UDP_QKEY));
    assert_eq!(id_s.multicast_groups().len(), 1);
    let send = |qp: &mut Qp<Ud, Rts>, cq: &mut Cq, peer: &UdPeer, data: &[u8]| {
        qp.post_send(peer.send_from(1, mr_with(&pd_s, data)))
            .expect("send to the group");
        wait(cq, 1)
            .pop()
            .unwrap()
            .result()
            .expect("send completion");
    };
    let msg = pattern(300, 11);
    send(&mut qp_s, &mut cq_s, &peer, &msg);
    for cq in [&mut cq_a, &mut cq_b] {
        let (c, m, p) = recv_one(cq);
        assert_eq!(p, msg);
        assert_eq!(m.src_qp, qp_s.qp_num());
        assert_grh_to_group(&c, &m, g);
    }
    id_a.leave_multicast(&qp_a, group).expect("leave a");
    assert!(qp_a.mcast_groups().is_empty() && id_a.multicast_groups().is_empty());
    let msg2 = pattern(64, 12);
    send(&mut qp_s, &mut cq_s, &peer, &msg2);
    assert_eq!(recv_one(&mut cq_b).2, msg2);
    assert_silent(&mut cq_a, "a QP whose id left the group");
}

#[test]
fn cm_join_refusals_are_typed() {
    let _serial = serial();
    let group = SocketAddr::new(Ipv4Addr::new(239, 10, 2, 1).into(), 0);
    let (id, pd, cq, qp) = cm_member(group, 0, 0);
    let expect_invalid = |r: Result<()>, want: &str, text: &str| match r {
        Err(Error::InvalidArgument { what, reason }) => {
            assert_eq!(what, want);
            assert!(reason.contains(text), "{reason}");
        }
        other => panic!("expected {want} refused, got {other:?}"),
    };
    let unicast = common::guest_at(0);
    expect_invalid(
        id.join_multicast(&qp, unicast, T).map(drop),
        "multicast address",
        "not a multicast address",
    );
    expect_invalid(
        id.leave_multicast(&qp, group),
        "multicast group",
        "did not join",
    );
    let rc = CmId::new().expect("RC id");
    rc.resolve_addr(Some(common::guest_at(0)), group, T)
        .expect("resolve");
    expect_invalid(
        rc.join_multicast(&qp, group, T).map(drop),
        "rdma_cm id",
        "new_ud",
    );
    // A second join of the same group on one id.
    id.join_multicast(&qp, group, T).expect("join");
    expect_invalid(
        id.join_multicast(&qp, group, T).map(drop),
        "multicast group",
        "already",
    );
    // A QP that is not the one attached cannot leave for it, also when it is
    // attached to the group by hand: its attachment stays.
    let other = ud_qp(&pd, &cq, 0, 0);
    expect_invalid(
        id.leave_multicast(&other, group),
        "multicast group",
        "not attached",
    );
    let [(_, g)] = id.multicast_groups()[..] else {
        panic!("one group: {:?}", id.multicast_groups());
    };
    other.attach_mcast(g.gid, g.lid).expect("attach by hand");
    expect_invalid(
        id.leave_multicast(&other, group),
        "multicast group",
        "not attached",
    );
    assert_eq!(other.mcast_groups(), [g]);
    assert_eq!(qp.mcast_groups(), [g]);
    // The QP that joined, detached by hand, still takes the id out.
    qp.detach_mcast(g.gid, g.lid).expect("detach by hand");
    id.leave_multicast(&qp, group).expect("leave");
    assert!(id.multicast_groups().is_empty());
    assert_eq!(other.mcast_groups(), [g]);
    other.detach_mcast(g.gid, g.lid).expect("detach");
    // The QP that joined, dropped (its drop detached it): a second join
    // says how to leave, any UD QP then leaves in its place, and the group
    // can be joined again.
    id.join_multicast(&other, group, T)
        .expect("join with the other QP");
    drop(other);
    let third = ud_qp(&pd, &cq, 0, 0);
    expect_invalid(
        id.join_multicast(&third, group, T).map(drop),
        "multicast group",
        "since dropped",
    );
    id.leave_multicast(&third, group)
        .expect("leave in the dropped QP's place");
    assert!(id.multicast_groups().is_empty() && third.mcast_groups().is_empty());
    id.join_multicast(&third, group, T).expect("join again");
    assert_eq!(third.mcast_groups().len(), 1);
    id.leave_multicast(&third, group).expect("leave");
    assert!(third.mcast_groups().is_empty());
}

#[cfg(feature = "tokio")]
#[test]
fn async_join_receives_from_a_blocking_sender() {
    let _serial = serial();
    use rdma_verbs::tokio::AsyncCmId;
    let g = Ipv4Addr::new(239, 10, 3, 1);
    let group = SocketAddr::new(g.into(), 0);
    let rt = common::async_pair::runtime();
    rt.block_on(async {
        let mut id = AsyncCmId::resolve_multicast(common::guest_at(0), group, T)
            .await
            .expect("resolve the group");
        let ctx = id.id().context().expect("context");
        let pd = Pd::new(&ctx).expect("pd");
        let mut cq = Cq::new(&ctx, 16).expect("cq");
        let mut qp = id.id().create_ud_qp(&pd, &cq, &cq, caps(4)).expect("qp");
        post_recvs(&pd, &mut qp, 1, 64);
        let (_, ev) = id.join_multicast(&qp, group, T).await.expect("join");
        assert_eq!(ev.ud.map(|u| u.qp_num), Some(MULTICAST_QPN));
        let (id_s, pd_s, mut cq_s, mut qp_s) = cm_member(group, 0, 0);
        let (peer, _) = id_s.join_multicast(&qp_s, group, T).expect("join s");
        qp_s.post_send(peer.send_from(1, mr_with(&pd_s, b"async group")))
            .expect("send");
        wait(&mut cq_s, 1).pop().unwrap().result().expect("sent");
        assert_eq!(recv_one(&mut cq).2, b"async group");
        id.leave_multicast(&qp, group).expect("leave");
    });
}

// --- interop with librdmacm's mckey -----------------------------------------

/// `name` on PATH.
fn on_path(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found on PATH: install {package}"))
}

fn mckey() -> PathBuf {
    on_path("mckey", "rdmacm-utils")
}

fn stdbuf() -> PathBuf {
    on_path("stdbuf", "coreutils")
}

/// Waits until `p` printed `line`, failing if it exits first or `deadline` passes.
fn wait_for_line(p: &mut Proc, line: &str, deadline: Instant) {
    while !p.output().contains(line) {
        if let Some(st) = p.try_status() {
            panic!(
                "`{}` exited ({st}) before `{line}`:\n{}",
                p.name,
                p.output()
            );
        }
        assert!(
            Instant::now() < deadline,
            "`{}` never printed `{line}`:\n{}",
            p.name,
            p.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for `p` to exit 0 by `deadline` with every line of `lines`.
fn done(mut p: Proc, deadline: Instant, lines: &[&str]) -> String {
    let st = p.wait_until(deadline);
    let out = p.output();
    assert!(
        st.is_some_and(|s| s.success()),
        "`{}` failed or was not done in time ({st:?}):\n{out}",
        p.name
    );
    for l in lines {
        assert!(out.contains(l), "`{}` printed no `{l}`:\n{out}", p.name);
    }
    out
}

/// The senders' and receivers' arguments for group `g`: `-m g -b own -C n -S size`.
fn mckey_args(g: Ipv4Addr, bind: IpAddr, n: usize, size: usize, send: bool) -> Vec<String> {
    let mut a: Vec<String> = ["-m", &g.to_string(), "-b", &bind.to_string()]
        .map(String::from)
        .to_vec();
    a.extend(["-C".into(), n.to_string(), "-S".into(), size.to_string()]);
    if send {
        a.push("-s".into());
    }
    a
}

/// Packets the device `dev` has put on the wire (rxe's `sent_pkts` counter;
/// `None` where the provider has no such counter).
/// Runs the sender `spawn` starts (`mckey -s` or ours) to a clean end and
/// returns how many packets device `dev` sent meanwhile, where it counts them.
fn send_counted(dev: &str, deadline: Instant, spawn: impl FnOnce() -> Proc) -> Option<u64> {
    let before = sent_pkts(dev);
    done(
        spawn(),
        deadline,
        &[
            "initiating data transfers",
            "data transfers complete",
            "return status 0",
        ],
    );
    before.zip(sent_pkts(dev)).map(|(b, a)| a - b)
}

fn sent_pkts(dev: &str) -> Option<u64> {
    let path = format!("/sys/class/infiniband/{dev}/ports/1/hw_counters/sent_pkts");
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// One sender and the receivers, each a program (`mckey` or this crate's
/// `mcast` example) on this guest, all bound to `bind`: the receivers start
/// first and the sender once each is receiving; every receiver must exit 0
/// (mckey: all `n` datagrams arrived; mcast: all arrived and verified). A
/// receiver's failure says how many packets the device sent while the sender
/// ran (the receivers send none): a C `mckey` destroys its address handle
/// right after posting its unsignaled sends, and where the kernel sends them
/// later (rxe from 6.4 on, docs/providers.md) a datagram can fail on the
/// sender's side, which that count tells apart from a loss on the receiving one.
/// Takes the receivers' list so that it runs with more than one.
fn one_sender_to_receivers(sender: &str, receivers: &[&str], g: Ipv4Addr, n: usize) -> Vec<String> {
    let _serial = serial();
    // UD first: on a provider without it (iWARP) this fails with the crate's
    // Error::Unsupported, as every other test here does, not inside mckey.
    let ctx = common::ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 4).expect("cq");
    drop(Qp::new_ud(&pd, &cq, &cq, caps(1)).expect("a UD QP"));
    let deadline = Instant::now() + Duration::from_secs(90);
    // mckey's stdout is a file here: line-buffer it (stdbuf) so its lines show as printed.
    let spawn = |name: &str, args: Vec<String>, tag: &str| {
        if name == "mckey" {
            let mut a = vec!["-oL".to_owned(), mckey().display().to_string()];
            a.extend(args);
            Proc::spawn(name, &stdbuf(), &a, tag)
        } else {
            Proc::spawn(name, &example(name), &args, tag)
        }
    };
    let bind = guest_ip();
    let mut rx = Vec::new();
    for (i, r) in receivers.iter().enumerate() {
        let mut p = spawn(r, mckey_args(g, bind, n, 100, false), &format!("rx{i}"));
        wait_for_line(&mut p, "receiving data transfers", deadline);
        rx.push(p);
    }
    let sent = send_counted(ctx.name(), deadline, || {
        spawn(sender, mckey_args(g, bind, n, 100, true), "tx")
    });
    let sent = format!("the device sent {sent:?} packets of {n} while `{sender}` ran");
    rx.into_iter()
        .map(|p| {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                done(p, deadline, &["data transfers complete", "return status 0"])
            }));
            out.unwrap_or_else(|e| {
                let why = e.downcast_ref::<String>().cloned().unwrap_or_default();
                panic!("{why}\n({sent})")
            })
        })
        .map(|out| format!("{out}\n({sent})"))
        .collect()
}

/// mckey sending to ours: all 10 arrive and are checked. On 6.12's rxe, mckey's
/// teardown races its own sends (it destroys its address handle right after
/// posting them, docs/providers.md), so a try in which the device sent fewer
/// than it was asked to must still deliver every one it sent, and is tried
/// again, three tries at most; the second and third ask for 100, so that its
/// first sends are on the wire before it is done posting (on 6.12.95 it put 0 of
/// 10, 1 of 100 and 0 of 100). If no try had all on the wire, the test reports
/// that as a deviation of the provider when our receiver got and checked every
/// datagram the device sent in each try and reported the rest lost, and fails
/// otherwise (a try whose datagrams all left the device must deliver them all).
#[test]
fn mckey_sends_to_ours() {
    let mut sent_per_try = Vec::new();
    for (attempt, n) in [10, 100, 100].into_iter().enumerate() {
        let attempt = attempt + 1;
        let Some((sent, out)) = mckey_to_ours_once(Ipv4Addr::new(239, 10, 4, 2), n) else {
            return;
        };
        assert!(
            out.contains(&format!(
                "received {sent} of {n}: 0 verified, {sent} from a C mckey"
            )) && out.contains(" 0 corrupt, 0 duplicate"),
            "try {attempt}: our receiver did not get each of the {sent} datagrams the device sent:\n{out}"
        );
        eprintln!("try {attempt}: mckey put {sent} of {n} datagrams on the wire; trying again");
        sent_per_try.push(format!("{sent} of {n}"));
    }
    // The device's packet counter shows the loss is mckey's own: what it put on the
    // wire, our receiver got and checked, and it reported the rest as lost.
    common::deviation(&format!(
        "mckey put {sent_per_try:?} datagrams on the wire in 3 tries (its teardown destroys \
         the address handle while this kernel's rxe still has the sends queued); our receiver \
         got and checked every one it sent and counted the rest lost"
    ));
}

/// One try of mckey sending `n` datagrams to our receiver. `None` when every
/// one arrived and our receiver exited 0; else how many packets the device
/// sent while mckey ran (fewer than `n`: mckey's own loss) and our output.
fn mckey_to_ours_once(g: Ipv4Addr, n: usize) -> Option<(u64, String)> {
    let _serial = serial();
    let ctx = common::ctx();
    drop(
        Qp::new_ud(
            &Pd::new(&ctx).expect("pd"),
            &Cq::new(&ctx, 4).expect("cq"),
            &Cq::new(&ctx, 4).expect("cq"),
            caps(1),
        )
        .expect("a UD QP"),
    );
    let deadline = Instant::now() + Duration::from_secs(90);
    let bind = guest_ip();
    let args = mckey_args(g, bind, n, 100, false);
    let mut rx = Proc::spawn("mcast", &example("mcast"), &args, "rx0");
    wait_for_line(&mut rx, "receiving data transfers", deadline);
    let sent = send_counted(ctx.name(), deadline, || {
        let mut a = vec!["-oL".to_owned(), mckey().display().to_string()];
        a.extend(mckey_args(g, bind, n, 100, true));
        Proc::spawn("mckey", &stdbuf(), &a, "tx")
    });
    let st = rx.wait_until(deadline);
    let out = rx.output();
    if st.is_some_and(|s| s.success()) {
        assert!(
            out.contains(&format!(
                "received {n} of {n}: 0 verified, {n} from a C mckey"
            )),
            "{out}"
        );
        return None;
    }
    match sent {
        Some(k) if k < n as u64 => Some((k, out)),
        _ => panic!(
            "our receiver failed although the device sent {sent:?} of {n} packets ({st:?}):\n{out}"
        ),
    }
}

/// Ours sending to mckey too: mckey must receive all of them and exit 0.
#[test]
fn ours_to_ours_and_mckey_verified() {
    let out = one_sender_to_receivers(
        "mcast",
        &["mcast", "mckey"],
        Ipv4Addr::new(239, 10, 4, 3),
        20,
    );
    assert!(
        out[0].contains("received 20 of 20: 20 verified") && out[0].contains("0 lost"),
        "{}",
        out[0]
    );
}
