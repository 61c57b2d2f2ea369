//! UD and UC on soft-RoCE: datagrams to several peers through address
//! handles with the GRH kept apart from the payload, replies through an
//! address handle built from a received completion, UC SEND and RDMA WRITE,
//! the typed errors for bad input, and `examples/{ud,uc}_pingpong.rs`
//! against rdma-core's `ibv_{ud,uc}_pingpong` in both roles, polling and
//! with `-e` (run inside the soft-RoCE guest by `cargo xtask test`, which
//! builds the examples first).

mod common;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::procs::{Proc, example, finish};
use common::{ctx, gid_index, pattern, wait};
use rdma_verbs::Error;
use rdma_verbs::ah::{AddressHandle, GRH_LEN};
use rdma_verbs::cq::{Cq, WcOpcode, WcStatus};
use rdma_verbs::device::Gid;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{
    AddressVector, Init, Qp, QpCaps, RecvWr, Rts, Uc, UcInitAttr, UcSendWr, Ud, UdInitAttr,
    UdRecvWr, UdSendWr,
};

const QKEY: u32 = 0x1111_1111;

static SERIAL: Mutex<()> = Mutex::new(());

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    }
}

/// A UD QP in RTS on port 1, with `Q_Key` [`QKEY`].
fn ud_qp(pd: &Pd, cq: &Cq) -> Qp<Ud, Rts> {
    Qp::new_ud(pd, cq, cq, caps())
        .unwrap()
        .init(UdInitAttr::new(1, QKEY))
        .unwrap()
        .ready()
        .unwrap()
}

/// A 40-byte GRH buffer and a `len`-byte payload buffer.
fn ud_bufs(pd: &Pd, len: usize) -> (Mr, Mr) {
    let mut all = pd
        .alloc_mr(GRH_LEN + len, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let grh = all.split_to(GRH_LEN).unwrap();
    (grh, all)
}

#[test]
fn ud_reaches_several_peers_and_the_grh_stays_apart_from_the_payload() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let gid_ix = gid_index(&ctx);
    let my_gid = ctx.query_gid(1, gid_ix).unwrap();
    let mut cq_a = Cq::new(&ctx, 32).unwrap();
    let mut a = ud_qp(&pd, &cq_a);
    let mut peers: Vec<(Cq, Qp<Ud, Rts>)> = (0..3)
        .map(|_| {
            let cq = Cq::new(&ctx, 32).unwrap();
            let qp = ud_qp(&pd, &cq);
            (cq, qp)
        })
        .collect();
    let mtu = a.max_message() as usize;
    assert_eq!(mtu, ctx.query_port(1).unwrap().active_mtu.bytes() as usize);
    for (i, (_, qp)) in peers.iter_mut().enumerate() {
        // The GRH area of each receive is pre-filled with a marker the NIC must overwrite.
        let (mut grh, payload) = ud_bufs(&pd, mtu);
        grh.fill(0xee).unwrap();
        qp.post_recv(UdRecvWr::new(i as u64, grh, payload)).unwrap();
    }
    let ah = AddressHandle::new(&pd, AddressVector::global(1, my_gid, gid_ix)).unwrap();
    // One datagram per peer, sizes up to the MTU, each with its own pattern.
    let sizes = [1, 100, mtu];
    for (i, (_, qp)) in peers.iter().enumerate() {
        let mut src = pd.alloc_mr(sizes[i], AccessFlags::LOCAL_WRITE).unwrap();
        src.write_at(0, &pattern(sizes[i], i as u8)).unwrap();
        let wr = UdSendWr::send_from(10 + i as u64, src, &ah, qp.qp_num(), QKEY);
        a.post_send(if i == 1 { wr.imm(0xabcd) } else { wr })
            .unwrap();
    }
    // The QP holds the handle for the sends: the user's may go at once.
    drop(ah);
    for c in wait(&mut cq_a, 3) {
        assert_eq!((c.status, c.opcode), (WcStatus::Success, WcOpcode::Send));
    }
    let mut replies = Vec::new();
    for (i, (cq, qp)) in peers.iter_mut().enumerate() {
        let mut c = wait(cq, 1).pop().unwrap();
        assert_eq!((c.wr_id, c.status), (i as u64, WcStatus::Success));
        assert!(c.has_grh(), "RoCE datagrams carry a GRH");
        assert_eq!(
            c.byte_len as usize,
            GRH_LEN + sizes[i],
            "byte_len counts the GRH"
        );
        let msg = c.take_ud().unwrap();
        assert_eq!(msg.len as usize, sizes[i]);
        assert_eq!(msg.src_qp, a.qp_num());
        assert_eq!(
            msg.sgid,
            Some(my_gid),
            "the sender's GID, read from the GRH"
        );
        assert_eq!(msg.imm_data, (i == 1).then_some(0xabcd));
        // The payload starts at the payload buffer's first byte: the GRH went
        // to the first SGE only.
        let payload = msg.payload.unwrap().to_vec().unwrap();
        assert_eq!(&payload[..sizes[i]], &pattern(sizes[i], i as u8)[..]);
        assert!(payload[sizes[i]..].iter().all(|&b| b == 0));
        assert_eq!(msg.grh.to_vec().unwrap(), msg.grh_bytes.to_vec());
        assert_ne!(msg.grh_bytes, [0xee; GRH_LEN], "the NIC wrote the GRH");
        // A port the device does not have is named as such (it was reported
        // as a GRH that names none of the port's GIDs).
        for port in [0, 2, 255] {
            match AddressHandle::from_completion(&pd, port, &c, &msg.grh_bytes) {
                Err(Error::InvalidArgument { what: "port", .. }) => {}
                other => panic!("port {port}: {other:?}"),
            }
        }
        // Answer through an address handle built from the completion.
        let back = AddressHandle::from_completion(&pd, 1, &c, &msg.grh_bytes).unwrap();
        let grh = back.attr().grh.expect("a GRH towards the sender");
        assert_eq!(grh.dgid, my_gid);
        replies.push((i, back, msg.src_qp));
        assert_eq!(qp.outstanding(), (0, 0));
    }
    let (grh, payload) = ud_bufs(&pd, 64);
    a.post_recv(UdRecvWr::new(99, grh, payload)).unwrap();
    let (i, back, to) = replies.swap_remove(2);
    let (peer_cq, peer) = &mut peers[i];
    let mut src = pd.alloc_mr(5, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, b"reply").unwrap();
    peer.post_send(UdSendWr::send_from(7, src, &back, to, QKEY))
        .unwrap();
    assert_eq!(wait(peer_cq, 1)[0].status, WcStatus::Success);
    let mut got = wait(&mut cq_a, 1).pop().unwrap();
    let msg = got.take_ud().unwrap();
    assert_eq!((msg.len, msg.src_qp), (5, peer.qp_num()));
    assert_eq!(&msg.payload.unwrap().to_vec().unwrap()[..5], b"reply");
}

/// Two UC QPs connected to each other; `b` grants REMOTE_WRITE.
fn uc_pair(
    pd: &Pd,
    cq_a: &Cq,
    cq_b: &Cq,
    prep: impl FnOnce(&mut Qp<Uc, Init>),
) -> (Qp<Uc, Rts>, Qp<Uc, Rts>) {
    let gid = gid_index(pd.context());
    let a = Qp::new_uc(pd, cq_a, cq_a, caps())
        .unwrap()
        .init(UcInitAttr::new(1))
        .unwrap();
    let mut b = Qp::new_uc(pd, cq_b, cq_b, caps())
        .unwrap()
        .init(UcInitAttr::new(1).remote_write())
        .unwrap();
    prep(&mut b);
    let (ea, eb) = (
        a.endpoint(Some(gid)).unwrap(),
        b.endpoint(Some(gid)).unwrap(),
    );
    (
        a.connect(&eb, Some(gid)).unwrap(),
        b.connect(&ea, Some(gid)).unwrap(),
    )
}

#[test]
fn uc_sends_and_writes_arrive_byte_for_byte() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (mut cq_a, mut cq_b) = (Cq::new(&ctx, 32).unwrap(), Cq::new(&ctx, 32).unwrap());
    let (mut a, _b) = uc_pair(&pd, &cq_a, &cq_b, |b| {
        let buf = pd.alloc_mr(10_000, AccessFlags::LOCAL_WRITE).unwrap();
        b.post_recv(RecvWr::new(1, buf)).unwrap();
        b.post_recv(RecvWr::empty(2)).unwrap();
    });
    let target = pd
        .alloc_mr(8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .unwrap();
    // A multi-packet SEND (10,000 bytes over a ~1 KiB MTU).
    let data = pattern(10_000, 3);
    let mut src = pd.alloc_mr(data.len(), AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &data).unwrap();
    a.post_send(UcSendWr::send_from(1, src)).unwrap();
    // An RDMA WRITE with immediate into b's region at an offset.
    let wdata = pattern(3000, 9);
    let mut wsrc = pd.alloc_mr(wdata.len(), AccessFlags::LOCAL_WRITE).unwrap();
    wsrc.write_at(0, &wdata).unwrap();
    a.post_send(UcSendWr::write_from(2, wsrc, target.remote(), 100).imm(77))
        .unwrap();
    let done = wait(&mut cq_a, 2);
    assert_eq!(
        done.iter()
            .map(|c| (c.wr_id, c.status, c.opcode))
            .collect::<Vec<_>>(),
        [
            (1, WcStatus::Success, WcOpcode::Send),
            (2, WcStatus::Success, WcOpcode::RdmaWrite)
        ]
    );
    let mut got = wait(&mut cq_b, 2);
    assert_eq!((got[0].wr_id, got[0].byte_len), (1, 10_000));
    assert_eq!(got[0].take_mr().unwrap().to_vec().unwrap(), data);
    assert_eq!(
        (got[1].wr_id, got[1].opcode, got[1].imm_data),
        (2, WcOpcode::RecvRdmaWithImm, Some(77))
    );
    let mut back = vec![0; wdata.len()];
    target.read_at(100, &mut back).unwrap();
    assert_eq!(back, wdata);
}

#[test]
fn bad_input_gets_typed_errors() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let gid_ix = gid_index(&ctx);
    let my_gid = ctx.query_gid(1, gid_ix).unwrap();
    // A local GID index with no GID behind it.
    let e = AddressHandle::new(&pd, AddressVector::global(1, my_gid, 200)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                what: "gid index",
                ..
            }
        ),
        "{e}"
    );
    // RoCE without a GRH, or towards the zero GID.
    let e = AddressHandle::new(&pd, AddressVector::local(1, 0)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                what: "address vector",
                ..
            }
        ),
        "{e}"
    );
    let e = AddressHandle::new(&pd, AddressVector::global(1, Gid::ZERO, gid_ix)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidArgument {
                what: "address vector",
                ..
            }
        ),
        "{e}"
    );
    let e = AddressHandle::new(&pd, AddressVector::global(9, my_gid, gid_ix)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { what: "port", .. }),
        "{e}"
    );
    // Fields wider than their wire fields (soft-RoCE took them as given).
    let good = AddressVector::global(1, my_gid, gid_ix);
    let mut wide_flow = good;
    wide_flow.grh.as_mut().unwrap().flow_label = 1 << 20;
    for (av, field) in [
        (AddressVector { sl: 16, ..good }, "SL"),
        (
            AddressVector {
                src_path_bits: 128,
                ..good
            },
            "source path bits",
        ),
        (wide_flow, "flow label"),
    ] {
        match AddressHandle::new(&pd, av) {
            Err(Error::InvalidArgument { what, .. }) if what == field => {}
            other => panic!("{field}: {other:?}"),
        }
    }

    let cq = Cq::new(&ctx, 32).unwrap();
    let mut qp = ud_qp(&pd, &cq);
    let ah = AddressHandle::new(&pd, AddressVector::global(1, my_gid, gid_ix)).unwrap();
    // One byte over the MTU: refused at post, the buffer comes back.
    let mtu = qp.max_message();
    let big = pd
        .alloc_mr(mtu as usize + 1, AccessFlags::LOCAL_WRITE)
        .unwrap();
    let e = qp
        .post_send(UdSendWr::send_from(1, big, &ah, qp.qp_num(), QKEY))
        .unwrap_err();
    assert!(
        matches!(e.error, Error::MessageTooLong { len, max } if len == u64::from(mtu) + 1 && max == mtu),
        "{e}"
    );
    assert_eq!(e.unposted.len(), 1);
    assert_eq!(e.unposted[0].1.total_len(), u64::from(mtu) + 1);
    // An address handle of another PD.
    let other = Pd::new(&ctx).unwrap();
    let foreign = AddressHandle::new(&other, AddressVector::global(1, my_gid, gid_ix)).unwrap();
    let e = qp
        .post_send(UdSendWr::send(2, &foreign, qp.qp_num(), QKEY))
        .unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::InvalidArgument {
                what: "address handle",
                ..
            }
        ),
        "{e}"
    );
    // A remote QPN wider than 24 bits.
    let e = qp
        .post_send(UdSendWr::send(3, &ah, 1 << 24, QKEY))
        .unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::InvalidArgument {
                what: "remote QPN",
                ..
            }
        ),
        "{e}"
    );
    // A GRH buffer that is not 40 bytes (it would take payload bytes too).
    let (_, payload) = ud_bufs(&pd, 64);
    let grh = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let e = qp.post_recv(UdRecvWr::new(4, grh, payload)).unwrap_err();
    assert!(
        matches!(
            e.error,
            Error::InvalidArgument {
                what: "GRH buffer",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(e.unposted[0].1.len(), 2);
    // Nothing of the above reached the queues.
    assert_eq!(qp.outstanding(), (0, 0));
}

// --- Interoperability with rdma-core's C programs ---------------------------

/// -n: small, TCG is slow.
const ITERS: u32 = 20;
/// Per process.
const LIMIT: Duration = Duration::from_secs(60);

fn c_program(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found on PATH: install ibverbs-utils"))
}

/// The address fields (`LID ..., QPN ..., PSN ...`) of a `  {which} address:` line.
fn address(out: &str, which: &str) -> String {
    let line = out
        .lines()
        .find(|l| l.starts_with(&format!("  {which} address:")))
        .unwrap_or_else(|| panic!("no `{which} address` line in:\n{out}"));
    let fields = line.split_once("LID ").map_or("", |x| x.1);
    // ibv_ud_pingpong's local line has `: GID`, the others `, GID`.
    fields.replace(": GID", ", GID")
}

/// Runs `transport` (`ud` or `uc`) with `server`/`client` each ours or C's.
fn interop(transport: &str, ours_serve: bool, events: bool, size: usize, port: u16) {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let gid = gid_index(&ctx());
    let ours = (example(&format!("{transport}_pingpong")), "ours");
    let c = (c_program(&format!("ibv_{transport}_pingpong")), "C");
    let ((sbin, sname), (cbin, cname)) = if ours_serve { (ours, c) } else { (c, ours) };
    let mut args: Vec<String> = ["-g", &gid.to_string(), "-n", &ITERS.to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["-s".into(), size.to_string(), "-p".into(), port.to_string()]);
    if events {
        args.push("-e".into());
    }
    let t = Instant::now();
    let server = Proc::server(sname, &sbin, &args, port, t + LIMIT);
    let mut cargs = args.clone();
    cargs.push(std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into()));
    let client = Proc::spawn(cname, &cbin, &cargs, &format!("{port}-client"));
    let (sout, cout) = finish(server, client, Instant::now() + LIMIT);
    let report = format!("{transport} server {sname}:\n{sout}\nclient {cname}:\n{cout}");
    let bytes = size as u64 * u64::from(ITERS) * 2;
    for out in [&sout, &cout] {
        assert!(out.contains(&format!("\n{bytes} bytes in ")), "{report}");
        assert!(out.contains(&format!("\n{ITERS} iters in ")), "{report}");
    }
    assert_eq!(
        address(&sout, "remote"),
        address(&cout, "local"),
        "{report}"
    );
    assert_eq!(
        address(&cout, "remote"),
        address(&sout, "local"),
        "{report}"
    );
    eprintln!(
        "{transport}: server {sname}, client {cname}, -e {events}, -s {size}: ok in {:?}",
        t.elapsed()
    );
}

#[test]
fn ud_pingpong_interoperates_with_ibv_ud_pingpong() {
    let mut port = 18800;
    for ours_serve in [true, false] {
        for events in [false, true] {
            // 1 KiB: soft-RoCE's active MTU on the guest's veth (a UD message is one packet).
            for size in [1, 1024] {
                interop("ud", ours_serve, events, size, port);
                port += 1;
            }
        }
    }
}

#[test]
fn uc_pingpong_interoperates_with_ibv_uc_pingpong() {
    let mut port = 18820;
    for ours_serve in [true, false] {
        for events in [false, true] {
            for size in [1, 4096] {
                interop("uc", ours_serve, events, size, port);
                port += 1;
            }
        }
    }
}

#[test]
fn ud_pingpong_refuses_a_message_over_the_mtu() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mtu = ctx().query_port(1).unwrap().active_mtu.bytes();
    let out = std::process::Command::new(example("ud_pingpong"))
        .args(["-s", &(mtu + 1).to_string(), "-p", "18840"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("Requested size larger than port MTU ({mtu})")),
        "{err}"
    );
}

#[test]
fn the_ports_answer_help_and_refuse_bad_input_with_exit_1() {
    let run = |name: &str, args: &[&str]| {
        let out = std::process::Command::new(example(name))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    for name in ["ud_pingpong", "uc_pingpong"] {
        let (code, out, _) = run(name, &["--help"]);
        assert_eq!(code, Some(0), "{name} --help");
        assert!(out.contains("--gid-idx=<gid index>"), "{out}");
        for (args, says) in [
            (&["-x"][..], "invalid option -- 'x'"),
            (&["-r", "0"][..], "-r must be at least 1"),
            (&["-p", "70000"][..], "invalid value `70000` for -p"),
            (&["a", "b"][..], "too many arguments"),
            (&["-d", "nosuchdev"][..], "IB device nosuchdev not found"),
        ] {
            let (code, _, err) = run(name, args);
            assert_eq!(code, Some(1), "{name} {args:?}: {err}");
            assert!(err.contains(says), "{name} {args:?}: {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    // ibv_ud_pingpong has no -m: the path MTU is the port's.
    let (code, _, err) = run("ud_pingpong", &["-m", "1024"]);
    assert_eq!(
        (code, err.contains("invalid option -- 'm'")),
        (Some(1), true),
        "{err}"
    );
}
