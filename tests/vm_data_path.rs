//! The RC data path on real soft-RoCE: every opcode, sizes, SGE counts, post
//! lists, signaling. Runs in the guest (`cargo xtask test`).

mod common;

use common::{pair, pair_with, pattern, wait};
use rdma_verbs::cq::{WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::{QpCaps, RecvWr, SendWr};

const SIZES: [usize; 5] = [0, 1, 4096, 1 << 20, 12_345];

fn caps(sge: u32) -> QpCaps {
    QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: sge,
        max_recv_sge: sge,
        max_inline_data: 64,
        sq_sig_all: false,
    }
}

/// Splits `len` bytes into `n` nearly equal pieces (the last takes the rest).
fn pieces(len: usize, n: usize) -> Vec<usize> {
    let base = len / n;
    (0..n)
        .map(|i| {
            if i + 1 == n {
                len - base * (n - 1)
            } else {
                base
            }
        })
        .collect()
}

/// An MR of `len` bytes (at least 1: registration needs a byte) cut to exactly `len`.
fn mr_exact(p: &common::Pair, len: usize, access: AccessFlags) -> Mr {
    let mut mr = p.pd.alloc_mr(len.max(1), access).expect("alloc mr");
    if len == 0 {
        let _rest = mr.split_off(0).expect("split");
    }
    mr
}

#[test]
fn send_recv_every_size_and_sge_count() {
    for nsge in [1usize, 3] {
        let mut p = pair(caps(nsge as u32));
        for (k, &len) in SIZES.iter().enumerate() {
            let data = pattern(len, k as u8);
            // Receive side: one big buffer split into nsge pieces.
            let mut rwr = RecvWr::empty(100 + k as u64);
            for part in pieces(len, nsge) {
                let mr = mr_exact(&p, part, AccessFlags::LOCAL_WRITE);
                rwr = rwr.sge(mr);
            }
            p.b.post_recv(rwr).expect("post recv");
            // SEND_WITH_IMM on the multi-SGE round, plain SEND otherwise.
            let imm = (nsge > 1).then_some(0x1000 + k as u32);
            let mut swr = SendWr::send(k as u64);
            if let Some(imm) = imm {
                swr = swr.imm(imm);
            }
            let mut off = 0;
            for part in pieces(len, nsge) {
                let mut mr = mr_exact(&p, part, AccessFlags::empty());
                mr.as_mut_slice()
                    .unwrap()
                    .copy_from_slice(&data[off..off + part]);
                off += part;
                swr = swr.sge(mr);
            }
            p.a.post_send(swr).expect("post send");
            let mut sc = wait(&mut p.cq_a, 1);
            assert_eq!(sc[0].status, WcStatus::Success, "{:?}", sc[0]);
            assert_eq!(sc[0].opcode, WcOpcode::Send);
            assert_eq!(sc[0].wr_id, k as u64);
            assert_eq!(sc[0].take_buffers().len(), nsge, "send buffers come back");
            let mut rc = wait(&mut p.cq_b, 1);
            let c = &mut rc[0];
            assert_eq!(c.status, WcStatus::Success, "{c:?}");
            assert_eq!(c.opcode, WcOpcode::Recv);
            assert_eq!(c.byte_len as usize, len);
            assert_eq!(c.wr_id, 100 + k as u64);
            assert_eq!(c.imm_data, imm);
            let got: Vec<u8> = c
                .take_buffers()
                .into_iter()
                .flat_map(|b| b.into_mr().unwrap().to_vec().unwrap())
                .collect();
            assert_eq!(got, data, "size {len}, {nsge} SGEs");
        }
    }
}

#[test]
fn send_with_imm_and_inline() {
    let mut p = pair(caps(1));
    for i in 0..2u64 {
        let mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(i, mr)).unwrap();
    }
    let msg = b"inline hello";
    p.a.post_send(SendWr::send_inline(7, msg).imm(0xdead_beef))
        .unwrap();
    let mut mr = p.pd.alloc_mr(5, AccessFlags::empty()).unwrap();
    mr.as_mut_slice().unwrap().copy_from_slice(b"hello");
    p.a.post_send(SendWr::send(8).sge(mr.freeze())).unwrap();
    let sc = wait(&mut p.cq_a, 2);
    assert!(sc.iter().all(|c| c.status == WcStatus::Success), "{sc:?}");
    let mut rc = wait(&mut p.cq_b, 2);
    assert_eq!(rc[0].imm_data, Some(0xdead_beef));
    assert_eq!(rc[0].byte_len as usize, msg.len());
    let mr0 = rc[0].take_mr().unwrap();
    assert_eq!(&mr0.to_vec().unwrap()[..msg.len()], msg);
    assert_eq!(rc[1].imm_data, None);
    assert_eq!(&rc[1].take_mr().unwrap().to_vec().unwrap()[..5], b"hello");
}

/// A poll into a `Vec` without spare capacity (`Vec::new()`, or one that is
/// full) makes room and takes the completions, on the ownership-passing path
/// and in a scope: it used to poll nothing, so a loop waiting that way never
/// saw a completion.
#[test]
fn polls_into_a_vec_without_room_take_completions() {
    let mut p = pair(caps(1));
    let deadline = std::time::Instant::now() + common::WAIT;
    let send = |p: &mut common::Pair, id: u64| {
        let mut m = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        m.write_at(0, &id.to_le_bytes()).unwrap();
        p.a.post_send(SendWr::send_from(id, m)).unwrap();
    };
    for id in 0..3u64 {
        let mr = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
        p.b.post_recv(RecvWr::new(id, mr)).unwrap();
    }
    send(&mut p, 0);
    let mut out = Vec::new();
    while out.is_empty() && std::time::Instant::now() < deadline {
        p.cq_a.poll(&mut out).unwrap();
    }
    assert_eq!(out[0].wr_id, 0);
    // Full: the next poll still takes the second.
    out.shrink_to_fit();
    assert_eq!(out.capacity(), 1);
    send(&mut p, 1);
    let mut retired = Vec::new();
    while out.len() < 2 && std::time::Instant::now() < deadline {
        p.cq_a.poll_with_retired(&mut out, &mut retired).unwrap();
    }
    assert_eq!((out[1].wr_id, out[1].status), (1, WcStatus::Success));
    let src = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let lent = rdma_verbs::qp::scope::Src::new(&src).unwrap();
    let (cq_a, a) = (&mut p.cq_a, &mut p.a);
    let scoped = cq_a
        .scope(|s| {
            s.attach(a)?
                .post_send(&rdma_verbs::qp::scope::ScopedSend::send(2, lent))?;
            let mut scoped = Vec::new();
            while scoped.is_empty() && std::time::Instant::now() < deadline {
                s.poll(&mut scoped)?;
            }
            Ok(scoped)
        })
        .unwrap();
    assert_eq!((scoped[0].wr_id, scoped[0].status), (2, WcStatus::Success));
    let got = wait(&mut p.cq_b, 3);
    let ids: Vec<u64> = got.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [0, 1, 2]);
}

#[test]
fn one_step_constructors_send_and_write_the_whole_buffer() {
    let mut p = pair(caps(1));
    let target =
        p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let remote = target.remote();
    p.b.post_recv(RecvWr::new(
        1,
        p.pd.alloc_mr(300, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let mut src = p.pd.alloc_mr(300, AccessFlags::empty()).unwrap();
    src.as_mut_slice()
        .unwrap()
        .copy_from_slice(&pattern(300, 9));
    let src = src.freeze();
    p.a.post_send(SendWr::write_from(5, src.slice(0, 300).unwrap(), remote, 1000).unsignaled())
        .unwrap();
    p.a.post_send(SendWr::send_from(6, src.clone()).signaled(true))
        .unwrap();
    let sc = wait(&mut p.cq_a, 1);
    assert_eq!((sc[0].wr_id, sc[0].status), (6, WcStatus::Success));
    assert_eq!(sc[0].buffers().len(), 1, "the SEND's source comes back");
    let mut rc = wait(&mut p.cq_b, 1);
    assert_eq!(rc[0].byte_len, 300);
    assert_eq!(rc[0].take_mr().unwrap().to_vec().unwrap(), pattern(300, 9));
    // The WRITE completed before the SEND (same QP, in order).
    let got = target.to_vec().unwrap();
    assert_eq!(&got[1000..1300], &pattern(300, 9)[..]);
    assert!(got[..1000].iter().chain(&got[1300..]).all(|&b| b == 0));
}

#[test]
fn inline_over_the_limit_is_refused_before_posting() {
    let mut p = pair(caps(1));
    let max = p.a.caps().max_inline_data as usize;
    let big = vec![1u8; max + 1];
    let err = p.a.post_send(SendWr::send_inline(1, &big)).unwrap_err();
    assert!(
        matches!(
            err.error,
            rdma_verbs::Error::InvalidArgument {
                what: "inline data",
                ..
            }
        ),
        "{err}"
    );
}

/// `data` copied into `nsge` freshly registered buffers, in order.
fn source_buffers(p: &common::Pair, data: &[u8], nsge: usize) -> Vec<Mr> {
    let mut off = 0;
    pieces(data.len(), nsge)
        .into_iter()
        .map(|part| {
            let mut mr = mr_exact(p, part, AccessFlags::empty());
            mr.write_at(0, &data[off..off + part]).unwrap();
            off += part;
            mr
        })
        .collect()
}

#[test]
fn rdma_write_with_and_without_imm_every_size_and_sge_count() {
    let mut p = pair(caps(2));
    let region = 2 << 20;
    let target =
        p.pd.alloc_mr(region, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
            .unwrap();
    let remote = target.remote();
    for (nsge, with_imm) in [(1usize, false), (1, true), (2, false), (2, true)] {
        for (k, &len) in SIZES.iter().enumerate() {
            let data = pattern(len, 50 + k as u8 + nsge as u8 + u8::from(with_imm));
            let off = (k as u64) * 3 + nsge as u64; // unaligned offsets too
            let id = (nsge * 100 + usize::from(with_imm) * 10 + k) as u64;
            let mut wr = SendWr::write(id, remote, off);
            if with_imm {
                p.b.post_recv(RecvWr::empty(id)).unwrap();
                wr = wr.imm(id as u32);
            }
            for mr in source_buffers(&p, &data, nsge) {
                wr = wr.sge(mr);
            }
            p.a.post_send(wr).unwrap();
            let mut sc = wait(&mut p.cq_a, 1);
            assert_eq!(sc[0].status, WcStatus::Success, "{:?}", sc[0]);
            assert_eq!(sc[0].opcode, WcOpcode::RdmaWrite);
            assert_eq!(sc[0].take_buffers().len(), nsge, "source buffers come back");
            if with_imm {
                let rc = wait(&mut p.cq_b, 1);
                assert_eq!(rc[0].status, WcStatus::Success);
                assert_eq!(rc[0].opcode, WcOpcode::RecvRdmaWithImm);
                assert_eq!(rc[0].imm_data, Some(id as u32));
            }
            // The requester's completion means the responder acknowledged the data.
            let mut got = vec![0u8; len];
            target.read_at(off as usize, &mut got).unwrap();
            assert_eq!(got, data, "write of {len} bytes at {off} from {nsge} SGEs");
        }
    }
    // Plain WRITE (no immediate, no receive consumed).
    let src = source_buffers(&p, b"0123456789abcdef", 1).pop().unwrap();
    p.a.post_send(SendWr::write(99, remote, 100).sge(src))
        .unwrap();
    assert_eq!(wait(&mut p.cq_a, 1)[0].status, WcStatus::Success);
    let mut got = [0u8; 16];
    target.read_at(100, &mut got).unwrap();
    assert_eq!(&got, b"0123456789abcdef");
    let mut out = Vec::with_capacity(1);
    assert_eq!(
        p.cq_b.poll(&mut out).unwrap(),
        0,
        "a plain WRITE consumes no receive"
    );
}

#[test]
fn rdma_read_every_size_and_sge_count() {
    let mut p = pair(caps(2));
    let region = 2 << 20;
    let mut source =
        p.pd.alloc_mr(region, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    let all = pattern(region, 9);
    source.as_mut_slice().unwrap().copy_from_slice(&all);
    let remote = source.remote();
    for nsge in [1usize, 2] {
        for (k, &len) in SIZES.iter().enumerate() {
            let off = k * 7 + nsge;
            let mut dests = pieces(len, nsge)
                .into_iter()
                .map(|n| mr_exact(&p, n, AccessFlags::LOCAL_WRITE));
            let mut wr = SendWr::read(k as u64, dests.next().unwrap(), remote, off as u64);
            for d in dests {
                wr = wr.sge(d);
            }
            p.a.post_send(wr).unwrap();
            let mut sc = wait(&mut p.cq_a, 1);
            assert_eq!(sc[0].status, WcStatus::Success, "{:?}", sc[0]);
            assert_eq!(sc[0].opcode, WcOpcode::RdmaRead);
            let got: Vec<u8> = sc[0]
                .take_buffers()
                .into_iter()
                .flat_map(|b| b.into_mr().unwrap().to_vec().unwrap())
                .collect();
            assert_eq!(
                got,
                &all[off..off + len],
                "read of {len} bytes at {off} into {nsge} SGEs"
            );
        }
    }
}

/// A READ into a range of an `Mr` writes only the range, and its completion
/// gives the whole `Mr` back.
#[test]
fn rdma_read_into_a_range_writes_only_the_range() {
    let mut p = pair(caps(1));
    let mut source =
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)
            .unwrap();
    source.write_at(0, &pattern(64, 4)).unwrap();
    let mut dest = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    dest.write_at(0, &[0xee; 64]).unwrap();
    let range = dest.range(8..24).unwrap();
    p.a.post_send(SendWr::read(5, range, source.remote(), 32))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1).pop().unwrap();
    assert_eq!((c.wr_id, c.status, c.byte_len), (5, WcStatus::Success, 16));
    let got = c.take_mr().expect("the whole Mr").to_vec().unwrap();
    let mut want = vec![0xee; 64];
    want[8..24].copy_from_slice(&pattern(64, 4)[32..48]);
    assert_eq!(got, want);
}

#[test]
fn atomics_return_the_old_value_and_update_memory() {
    let mut p = pair(caps(1));
    let mut target =
        p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC)
            .unwrap();
    target.write_at(8, &100u64.to_ne_bytes()).unwrap();
    let remote = target.remote();

    let res = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    p.a.post_send(SendWr::fetch_add(1, res, remote, 8, 5))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{:?}", c[0]);
    assert_eq!(c[0].opcode, WcOpcode::FetchAdd);
    let old = u64::from_ne_bytes(
        c[0].take_mr()
            .unwrap()
            .to_vec()
            .unwrap()
            .try_into()
            .unwrap(),
    );
    assert_eq!(old, 100);
    let mut now = [0u8; 8];
    target.read_at(8, &mut now).unwrap();
    assert_eq!(u64::from_ne_bytes(now), 105);

    // Failing compare: memory unchanged, old value returned.
    let res = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    p.a.post_send(SendWr::compare_swap(2, res, remote, 8, 1, 7))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].opcode, WcOpcode::CompSwap);
    assert_eq!(
        u64::from_ne_bytes(
            c[0].take_mr()
                .unwrap()
                .to_vec()
                .unwrap()
                .try_into()
                .unwrap()
        ),
        105
    );
    target.read_at(8, &mut now).unwrap();
    assert_eq!(u64::from_ne_bytes(now), 105);

    // Matching compare: swapped.
    let res = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    p.a.post_send(SendWr::compare_swap(3, res, remote, 8, 105, 7))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(
        u64::from_ne_bytes(
            c[0].take_mr()
                .unwrap()
                .to_vec()
                .unwrap()
                .try_into()
                .unwrap()
        ),
        105
    );
    target.read_at(8, &mut now).unwrap();
    assert_eq!(u64::from_ne_bytes(now), 7);

    // Misaligned target and wrong result size are refused locally.
    let res = p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    let e =
        p.a.post_send(SendWr::fetch_add(4, res, remote, 3, 1))
            .unwrap_err();
    assert!(e.to_string().contains("8-byte aligned"), "{e}");
    let res = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let e =
        p.a.post_send(SendWr::fetch_add(5, res, remote, 8, 1))
            .unwrap_err();
    assert_eq!(e.unposted.len(), 1, "buffer handed back");
}

#[test]
fn post_lists_of_1_16_and_max_send_wr() {
    let mut p = pair_with(
        QpCaps {
            max_send_wr: 40,
            max_recv_wr: 64,
            ..caps(1)
        },
        |_, _, _| {},
    );
    let max = p.a.caps().max_send_wr.min(40) as usize;
    for n in [1usize, 16, max] {
        let recvs: Vec<RecvWr> = (0..n)
            .map(|i| {
                RecvWr::new(
                    i as u64,
                    p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap(),
                )
            })
            .collect();
        p.b.post_recv_list(recvs).unwrap();
        let sends: Vec<SendWr> = (0..n)
            .map(|i| {
                let mut mr = p.pd.alloc_mr(8, AccessFlags::empty()).unwrap();
                mr.as_mut_slice()
                    .unwrap()
                    .copy_from_slice(&(i as u64).to_le_bytes());
                SendWr::send(i as u64).sge(mr)
            })
            .collect();
        p.a.post_send_list(sends).unwrap();
        let sc = wait(&mut p.cq_a, n);
        assert!(sc.iter().all(|c| c.status == WcStatus::Success));
        let mut rc = wait(&mut p.cq_b, n);
        for (i, c) in rc.iter_mut().enumerate() {
            assert_eq!(c.wr_id, i as u64, "in order");
            let v = u64::from_le_bytes(c.take_mr().unwrap().to_vec().unwrap().try_into().unwrap());
            assert_eq!(v, i as u64);
        }
    }
}

#[test]
fn unsignaled_sends_with_periodic_signaling_never_overrun() {
    unsignaled_sends_with_periodic_signaling(16);
}

#[test]
fn a_send_ring_whose_depth_is_not_a_power_of_two_wraps_correctly() {
    // The slot ring rounds up to a power of two internally; the queue must
    // still refuse the 14th outstanding request and wrap many times.
    unsignaled_sends_with_periodic_signaling(13);
}

fn unsignaled_sends_with_periodic_signaling(depth: u32) {
    let mut p = pair(QpCaps {
        max_send_wr: depth,
        max_recv_wr: 256,
        ..caps(1)
    });
    let total = 200usize;
    let recvs: Vec<RecvWr> = (0..total)
        .map(|i| {
            RecvWr::new(
                i as u64,
                p.pd.alloc_mr(4, AccessFlags::LOCAL_WRITE).unwrap(),
            )
        })
        .collect();
    let mut recvs = recvs.into_iter();
    p.b.post_recv_list(recvs.by_ref().take(200)).unwrap();
    let src = p.pd.alloc_mr(4, AccessFlags::empty()).unwrap().freeze();
    let mut posted = 0;
    let mut signaled = 0;
    let mut out = Vec::with_capacity(16);
    while posted < total {
        // Signal one in 8; the QP also forces a signal when its ring would fill.
        let wr = SendWr::send(posted as u64).sge(src.clone());
        let wr = if posted % 8 == 7 { wr } else { wr.unsignaled() };
        match p.a.post_send(wr) {
            Ok(()) => posted += 1,
            Err(e) => {
                assert!(
                    matches!(e.error, rdma_verbs::Error::QueueFull { .. }),
                    "{e}"
                );
                out.clear();
                signaled += p.cq_a.poll(&mut out).unwrap();
                assert!(out.iter().all(|c| c.status == WcStatus::Success), "{out:?}");
            }
        }
    }
    let mut rc = Vec::with_capacity(total);
    p.cq_b.poll_n(&mut rc, total, common::WAIT).unwrap();
    assert!(rc.iter().all(|c| c.status == WcStatus::Success));
    // Drain the send side: every clone of `src` comes back, so it unfreezes.
    let start = std::time::Instant::now();
    let mut src = src;
    loop {
        out.clear();
        signaled += p.cq_a.poll(&mut out).unwrap();
        match src.try_unfreeze() {
            Ok(_) => break,
            Err(s) => src = s,
        }
        assert!(
            start.elapsed() < common::WAIT,
            "send buffers never all came back"
        );
    }
    assert!(signaled >= total / 8, "{signaled} signaled completions");
    assert!(signaled < total, "unsignaled sends produced no completion");
}

#[test]
fn buffer_lists_keep_their_order_and_release_every_buffer_once() {
    let p = pair(caps(4));
    let base = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap().freeze();
    let owned = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let bufs = SendWr::send(0)
        .sge(base.slice(0, 8).unwrap())
        .sge(base.slice(8, 4).unwrap())
        .sge(owned)
        .sge(base.slice(16, 2).unwrap())
        .into_buffers();
    let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
    assert_eq!(lens, [8, 4, 16, 2]);
    assert_eq!(bufs.as_slice()[1].len(), 4);
    // Take two, drop the iterator with two left: those are released, the
    // taken ones live on until dropped, and nothing is released twice.
    let mut it = bufs.into_iter();
    assert_eq!(it.size_hint(), (4, Some(4)));
    let first = it.next().unwrap();
    let second = it.next().unwrap();
    drop(it);
    assert_eq!((first.len(), second.len()), (8, 4));
    let base = base.try_unfreeze().expect_err("two slices are still alive");
    drop((first, second));
    let whole = base.try_unfreeze().expect("every slice was released");
    assert_eq!(whole.len(), 64);
    // push appends to a list taken back from a request.
    let mut bufs = SendWr::send(0)
        .sge(whole.freeze().slice(0, 8).unwrap())
        .sge(p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap())
        .into_buffers();
    assert_eq!(bufs.len(), 2);
    bufs.push(p.pd.alloc_mr(1, AccessFlags::empty()).unwrap().into());
    assert_eq!(bufs.total_len(), 8 + 16 + 1);
    // pop takes from the end, in place.
    assert_eq!(bufs.pop().map(|b| b.len()), Some(1));
    assert!(matches!(bufs.pop(), Some(rdma_verbs::qp::Buffer::Owned(m)) if m.len() == 16));
    assert_eq!(bufs.pop().map(|b| b.len()), Some(8));
    assert!(bufs.pop().is_none() && bufs.is_empty());
}

#[test]
fn too_many_sges_is_a_typed_error_with_the_buffers_back() {
    let mut p = pair(caps(2));
    // The device may grant more SGEs than asked; the safe path carries at most MAX_SAFE_SGES.
    let max = (p.a.caps().max_send_sge as usize).min(rdma_verbs::qp::MAX_SAFE_SGES);
    let mut wr = SendWr::send(1);
    for _ in 0..=max {
        wr = wr.sge(p.pd.alloc_mr(8, AccessFlags::empty()).unwrap());
    }
    let e = p.a.post_send(wr).unwrap_err();
    match e.error {
        rdma_verbs::Error::TooManySges { requested, max: m } => {
            assert_eq!((requested, m), (max + 1, max))
        }
        ref other => panic!("{other}"),
    }
    assert_eq!(
        e.unposted[0].1.len(),
        max.min(rdma_verbs::qp::MAX_SAFE_SGES),
        "the buffers that fit come back"
    );
}

/// A buffer registered in another PD is refused when posted, with the
/// buffer back (the NIC failed it with a protection error, LOC_QP_OP_ERR on
/// rxe, and the QP went to ERR); the QP then carries data as before.
#[test]
fn buffers_of_another_pd_are_refused_and_the_qp_lives() {
    let mut p = pair(caps(2));
    let other = rdma_verbs::pd::Pd::new(&p.ctx).unwrap();
    let refused = |e: rdma_verbs::qp::PostError, id: u64| {
        assert!(
            matches!(e.error, rdma_verbs::Error::InvalidArgument { .. }),
            "{}",
            e.error
        );
        assert!(
            e.error.to_string().contains("protection domain"),
            "{}",
            e.error
        );
        assert_eq!(e.unposted.len(), 1);
        assert_eq!((e.unposted[0].0, e.unposted[0].1.len()), (id, 1));
    };
    let foreign = other.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    refused(p.a.post_send(SendWr::send(1).sge(foreign)).unwrap_err(), 1);
    let shared = other.alloc_mr(8, AccessFlags::empty()).unwrap().freeze();
    let mixed = SendWr::send(2)
        .sge(p.pd.alloc_mr(4, AccessFlags::empty()).unwrap())
        .sge(shared.slice(0, 4).unwrap());
    let e = p.a.post_send(mixed).unwrap_err();
    assert!(matches!(e.error, rdma_verbs::Error::InvalidArgument { .. }));
    assert_eq!(e.unposted[0].1.len(), 2);
    let foreign = other.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    refused(p.b.post_recv(RecvWr::new(3, foreign)).unwrap_err(), 3);
    let srq_cq = rdma_verbs::cq::Cq::new(&p.ctx, 16).unwrap();
    let mut srq =
        rdma_verbs::srq::Srq::new(&p.pd, &srq_cq, rdma_verbs::srq::SrqAttr::new(4, 1)).unwrap();
    let foreign = other.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap();
    refused(srq.post_recv(RecvWr::new(4, foreign)).unwrap_err(), 4);

    p.b.post_recv(RecvWr::new(
        5,
        p.pd.alloc_mr(8, AccessFlags::LOCAL_WRITE).unwrap(),
    ))
    .unwrap();
    let mut src = p.pd.alloc_mr(8, AccessFlags::empty()).unwrap();
    src.write_at(0, b"same pd!").unwrap();
    p.a.post_send(SendWr::send(6).sge(src)).unwrap();
    let mut got = wait(&mut p.cq_b, 1);
    assert_eq!(got[0].status, WcStatus::Success, "{:?}", got[0]);
    assert_eq!(got[0].take_mr().unwrap().to_vec().unwrap(), b"same pd!");
    assert_eq!(wait(&mut p.cq_a, 1)[0].status, WcStatus::Success);
}
