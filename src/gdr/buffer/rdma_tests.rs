//! Device tests of [`GpuBuffer`] with host memory posing as device memory
//! (see the module's declaration in `buffer.rs`).

use std::sync::atomic::Ordering;

use cudarc::driver::CudaStream;

use super::*;
use crate::context::Context;
use crate::device::GidType;
use crate::gdr::GdrError;
use crate::gdr::direct::MAX_WRITE;
use crate::gdr::ledger::{NEXT_WR_SEQ, TAG_MASK, WR_ID_TAG};
use crate::gdr::staging::StagingConfig;
use crate::qp::device_tests::ArmedPanicMemory;
use crate::qp::{Buffer, SendWr};
use crate::qp::{InitAttr, QpCaps};

/// Host memory posing as device memory.
struct HostMem(Box<[u8]>);

// SAFETY: the boxed bytes stay put and allocated while the value lives.
unsafe impl DeviceMemory for HostMem {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        (self.0.as_ptr() as CUdeviceptr, self.0.len())
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        None
    }
}

fn host_copy(dst: &mut [u8], src: CUdeviceptr) -> std::result::Result<(), GdrError> {
    // SAFETY: in these tests `src` points into a live HostMem at least dst.len()
    // bytes long (write_range checked the range), disjoint from `dst`.
    unsafe {
        std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len())
    };
    Ok(())
}

impl GpuBuffer {
    fn for_host_test(pd: &Pd, bytes: Vec<u8>, path: GdrPath, cfg: StagingConfig) -> GpuBuffer {
        let mem: Arc<dyn DeviceMemory> = Arc::new(HostMem(bytes.into_boxed_slice()));
        let (ptr, len) = mem.device_range();
        let state = match path {
            GdrPath::Staging => PathState::Staging(
                BounceBuffers::new(pd, None, &StagingConfig { pin: false, ..cfg })
                    .expect("staging"),
            ),
            _ => {
                let mut mr =
                    register_direct(pd, &mem, ptr, len, AccessFlags::empty(), GdrPath::PeerMem)
                        .expect("register host memory");
                let keepalive = RegistrationKeepalive::cut_from(&mut mr).expect("keepalive");
                PathState::Direct {
                    pieces: vec![mr],
                    keepalive,
                }
            }
        };
        GpuBuffer {
            mem,
            ptr,
            len,
            path,
            caps: Capabilities::NO_DRIVER,
            skipped: Vec::new(),
            failures: Vec::new(),
            sync_memops: false,
            timeout: Duration::from_secs(20),
            writes: 0,
            in_flight: Vec::new(),
            copy: host_copy,
            stray: Vec::new(),
            stray_buffers: Vec::new(),
            state,
        }
    }

    fn buffers_home(&self) -> bool {
        match &self.state {
            PathState::Direct { pieces: p, .. } => p.len() == 1 && p[0].len() == self.len,
            PathState::Staging(st) => {
                st.tails.is_empty() && st.free.iter().all(|m| m.len() == st.chunk)
            }
        }
    }

    fn free_buffers(&self) -> usize {
        match &self.state {
            PathState::Direct { pieces: p, .. } => p.len(),
            PathState::Staging(st) => st.free.len(),
        }
    }
}

struct Pair {
    pd: Pd,
    a: Qp<Rc, Rts>,
    cq_a: Cq,
    _b: Qp<Rc, Rts>,
    cq_b: Cq,
}

fn pair(max_send_wr: u32) -> Pair {
    let name = std::env::var("RDMA_VERBS_DEVICE").ok();
    let ctx = Context::open(name.as_deref()).expect("these tests need an RDMA device");
    let pd = Pd::new(&ctx).expect("pd");
    let gid = ctx
        .gid_table()
        .expect("gids")
        .iter()
        .find(|e| {
            e.port == 1 && e.gid_type == GidType::RoceV2 && e.gid.raw()[10..12] == [0xff, 0xff]
        })
        .map(|e| e.index)
        .unwrap_or(0);
    let caps = QpCaps {
        max_send_wr,
        ..QpCaps::default()
    };
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let cq_a = Cq::new(&ctx, 256).expect("cq");
    let cq_b = Cq::new(&ctx, 256).expect("cq");
    let a = Qp::new(&pd, &cq_a, &cq_a, caps)
        .unwrap()
        .init(InitAttr::new(1, access))
        .unwrap();
    let b = Qp::new(&pd, &cq_b, &cq_b, caps)
        .unwrap()
        .init(InitAttr::new(1, access))
        .unwrap();
    let ea = a.endpoint(Some(gid)).unwrap();
    let eb = b.endpoint(Some(gid)).unwrap();
    Pair {
        a: a.connect(&eb, Some(gid)).expect("connect a"),
        _b: b.connect(&ea, Some(gid)).expect("connect b"),
        pd,
        cq_a,
        cq_b,
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

fn target(pd: &Pd, len: usize) -> Mr {
    pd.alloc_mr(len, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)
        .expect("target")
}

fn check_path(path: GdrPath, cfg: StagingConfig, max_send_wr: u32) {
    let mut p = pair(max_send_wr);
    let len = (1 << 20) + 1234;
    let data = pattern(len, 5);
    let mut buf = GpuBuffer::for_host_test(&p.pd, data.clone(), path, cfg);
    let dst = target(&p.pd, len + 4096);
    // Whole buffer at offset 100 of the target.
    let t = buf
        .write(&mut p.a, &mut p.cq_a, dst.remote(), 100)
        .expect("write");
    assert_eq!(t.bytes, len as u64);
    assert_eq!(t.path, path);
    let got = dst.to_vec().unwrap();
    assert!(got[..100].iter().all(|&b| b == 0));
    assert!(got[100..100 + len] == data[..], "whole write differs");
    assert!(got[100 + len..].iter().all(|&b| b == 0));
    if path == GdrPath::Staging {
        assert_eq!(t.work_requests as usize, len.div_ceil(buf_chunk(&buf)));
    }
    assert!(buf.buffers_home(), "buffers back after a write");
    // A sub-range, unaligned, to offset 0, twice (buffers are reusable).
    for _ in 0..2 {
        let r = 70_001..900_003;
        buf.write_range(&mut p.a, &mut p.cq_a, r.clone(), dst.remote(), 0)
            .expect("write_range");
        let got = dst.to_vec().unwrap();
        assert!(got[..r.len()] == data[r.clone()], "range write differs");
        assert!(buf.buffers_home());
    }
    // Empty range: nothing posted.
    let t = buf
        .write_range(&mut p.a, &mut p.cq_a, 5..5, dst.remote(), 0)
        .unwrap();
    assert_eq!((t.bytes, t.work_requests), (0, 0));
    // Out of the remote region: refused before posting.
    let e = buf
        .write(&mut p.a, &mut p.cq_a, dst.remote(), 4097)
        .unwrap_err();
    assert!(matches!(e, Error::RemoteOutOfBounds { .. }), "{e:?}");
    let e = buf
        .write_range(&mut p.a, &mut p.cq_a, 10..len + 1, dst.remote(), 0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(buf.buffers_home());
}

fn buf_chunk(b: &GpuBuffer) -> usize {
    match &b.state {
        PathState::Staging(st) => st.chunk,
        PathState::Direct { .. } => MAX_WRITE,
    }
}

fn small(buffers: usize) -> StagingConfig {
    StagingConfig {
        chunk_size: 64 << 10,
        buffers,
        pin: false,
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn staging_double_buffered_writes_arrive_intact() {
    check_path(GdrPath::Staging, small(2), 64);
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn staging_with_one_and_many_buffers() {
    check_path(GdrPath::Staging, small(1), 64);
    check_path(GdrPath::Staging, small(5), 64);
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn staging_retries_when_the_send_queue_is_full() {
    // 6 buffers but only 2 send slots: posts hit QueueFull and wait.
    check_path(GdrPath::Staging, small(6), 2);
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn direct_writes_arrive_intact_and_the_registration_reassembles() {
    check_path(GdrPath::PeerMem, small(2), 64);
    check_path(GdrPath::DmaBuf, small(2), 2);
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn other_completions_are_handed_back() {
    let mut p = pair(64);
    let dst = target(&p.pd, 1 << 20);
    let mine = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap();
    p.a.post_send(SendWr::write(42, dst.remote(), 0).sge(mine))
        .unwrap();
    let mut buf = GpuBuffer::for_host_test(&p.pd, pattern(300_000, 1), GdrPath::Staging, small(2));
    let t = buf
        .write(&mut p.a, &mut p.cq_a, dst.remote(), 4096)
        .unwrap();
    let ids: Vec<u64> = t.others.iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [42]);
    let mut others = t.others;
    assert_eq!(others[0].take_mr().map(|m| m.len()), Some(64));
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_cq_that_is_not_the_send_cq_is_refused() {
    let mut p = pair(64);
    let dst = target(&p.pd, 1 << 20);
    let mut buf = GpuBuffer::for_host_test(&p.pd, pattern(4096, 3), GdrPath::Staging, small(2));
    buf.set_timeout(Duration::MAX);
    // Its completions would never show up on the peer's CQ: this spun
    // forever.
    let e = buf
        .write(&mut p.a, &mut p.cq_b, dst.remote(), 0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert!(buf.buffers_home());
    buf.write(&mut p.a, &mut p.cq_a, dst.remote(), 0).unwrap();
    assert_eq!(&dst.to_vec().unwrap()[..4096], &pattern(4096, 3)[..]);
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_failed_write_drains_and_keeps_the_buffers() {
    for path in [GdrPath::Staging, GdrPath::PeerMem] {
        let mut p = pair(64);
        let dst = target(&p.pd, 1 << 20);
        let mut bad = dst.remote();
        bad.rkey ^= 0x5a5a; // the peer refuses: REM_ACCESS_ERR, then flushes
        let mut buf = GpuBuffer::for_host_test(&p.pd, pattern(500_000, 9), path, small(3));
        let e = buf.write(&mut p.a, &mut p.cq_a, bad, 0).unwrap_err();
        assert!(
            matches!(e, Error::WorkCompletion { status, .. } if status != crate::cq::WcStatus::Success),
            "{path:?}: {e:?}"
        );
        assert!(buf.buffers_home(), "{path:?}: buffers lost after an error");
        assert_eq!(
            buf.free_buffers(),
            if path == GdrPath::Staging { 3 } else { 1 }
        );
    }
}

/// Leaves one WRITE of `buf` posted and unpolled, as a write that timed out does.
fn abandon_one_write(buf: &mut GpuBuffer, p: &mut Pair, dst: &Mr) {
    buf.writes += 1;
    let mut ledger = WriteLedger::new(
        p.a.qp_num(),
        buf.writes,
        buf.state.regions(),
        std::mem::take(&mut buf.in_flight),
        buf.timeout,
    );
    let piece = match &mut buf.state {
        PathState::Direct { pieces, .. } => pieces.pop().expect("the registration"),
        PathState::Staging(st) => st.free.pop().expect("a free bounce buffer"),
    };
    ledger
        .post(&mut p.a, &mut p.cq_a, piece, dst.remote(), 0)
        .expect("post");
    buf.in_flight = ledger.in_flight;
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_user_wr_id_with_the_tag_keeps_its_buffer() {
    let mut p = pair(64);
    let dst = target(&p.pd, 1 << 20);
    let data = pattern(300_000, 3);
    let mut buf = GpuBuffer::for_host_test(&p.pd, data.clone(), GdrPath::Staging, small(2));
    // The very wr_ids the write's first WRITEs get (tests run one at a time),
    // and one more with the tag, posted first with buffers of the user's.
    let next = NEXT_WR_SEQ.load(Ordering::Relaxed);
    let mut ids: Vec<u64> = (0..4)
        .map(|i| WR_ID_TAG | ((next + i) & !TAG_MASK))
        .chain([WR_ID_TAG | 0xdead])
        .collect();
    for &id in &ids {
        let mine = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap();
        p.a.post_send(SendWr::write(id, dst.remote(), 512 << 10).sge(mine))
            .unwrap();
    }
    let t = buf
        .write(&mut p.a, &mut p.cq_a, dst.remote(), 0)
        .expect("write");
    assert!(dst.to_vec().unwrap()[..data.len()] == data[..]);
    assert!(
        buf.buffers_home(),
        "the buffer's own bounce buffers are back"
    );
    assert!(
        !t.taken_buffers.is_empty(),
        "a colliding wr_id was seen (run with --test-threads 1)"
    );
    // Every user completion came back with its own 64-byte buffer, in the
    // completion or, where it had to be taken out to check, beside it.
    let mut got = Vec::new();
    for mut c in t.others {
        if let Some(m) = c.take_mr() {
            got.push((c.wr_id, m.len()));
        }
    }
    for (id, sges) in t.taken_buffers {
        let lens: Vec<usize> = sges.iter().map(Buffer::len).collect();
        assert_eq!(lens, [64]);
        got.push((id, 64));
    }
    got.sort_unstable();
    ids.sort_unstable();
    assert_eq!(got, ids.iter().map(|&i| (i, 64)).collect::<Vec<_>>());
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn another_gpu_buffer_on_the_same_qp_is_not_absorbed() {
    let mut p = pair(64);
    let dst = target(&p.pd, 4 << 20);
    let mut a = GpuBuffer::for_host_test(&p.pd, pattern(4 << 20, 1), GdrPath::Staging, small(3));
    abandon_one_write(&mut a, &mut p, &dst);
    abandon_one_write(&mut a, &mut p, &dst);
    let a_regions = a.state.regions();
    let a_out = a.in_flight.len();
    let data = pattern(1 << 20, 2);
    let mut b = GpuBuffer::for_host_test(&p.pd, data.clone(), GdrPath::Staging, small(2));
    let t = b
        .write(&mut p.a, &mut p.cq_a, dst.remote(), 0)
        .expect("write b");
    assert!(dst.to_vec().unwrap()[..data.len()] == data[..]);
    assert!(b.buffers_home(), "b has all its buffers");
    assert!(b.in_flight.is_empty());
    assert!(t.taken_buffers.is_empty());
    // a's stale WRITEs (posted before b's, so all completed) are handed back
    // to the caller, not taken by b.
    assert_eq!(t.others.len(), a_out);
    for mut c in t.others {
        assert_eq!(c.wr_id & TAG_MASK, WR_ID_TAG);
        let mr = c.take_mr().expect("a's bounce buffer piece");
        assert!(a_regions.contains(&(mr.as_raw() as usize)));
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_later_write_takes_back_what_a_timed_out_one_left() {
    for path in [GdrPath::PeerMem, GdrPath::Staging] {
        let mut p = pair(64);
        let dst = target(&p.pd, 4 << 20);
        let data = pattern(4 << 20, 7);
        let mut buf = GpuBuffer::for_host_test(&p.pd, data.clone(), path, small(2));
        abandon_one_write(&mut buf, &mut p, &dst);
        std::thread::sleep(Duration::from_millis(200));
        let t = buf
            .write(&mut p.a, &mut p.cq_a, dst.remote(), 0)
            .unwrap_or_else(|e| panic!("{path:?}: {e:?}"));
        assert!(t.others.is_empty(), "{path:?}: {t:?}");
        assert!(buf.in_flight.is_empty(), "{path:?}");
        assert!(buf.buffers_home(), "{path:?}");
        assert!(dst.to_vec().unwrap()[..data.len()] == data[..], "{path:?}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn bad_staging_configs_are_refused_without_allocating() {
    let p = pair(4);
    for cfg in [
        StagingConfig {
            buffers: usize::MAX,
            ..small(1)
        },
        StagingConfig {
            buffers: 0,
            ..small(1)
        },
        StagingConfig {
            chunk_size: usize::MAX,
            ..small(1)
        },
        StagingConfig {
            chunk_size: 0,
            ..small(1)
        },
    ] {
        let e = BounceBuffers::new(&p.pd, None, &cfg)
            .err()
            .expect("refused");
        assert!(matches!(e, Error::InvalidArgument { .. }), "{cfg:?}: {e:?}");
        let mem = HostMem(vec![0u8; 4096].into_boxed_slice());
        let e = GpuBuffer::with_config(&p.pd, mem, GdrMode::Staging, cfg).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{cfg:?}: {e:?}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn buffers_lost_with_their_qp_stay_allocated_until_the_buffer_goes() {
    for path in [GdrPath::PeerMem, GdrPath::Staging] {
        let mut p = pair(64);
        let dst = target(&p.pd, 4 << 20);
        let mut buf = GpuBuffer::for_host_test(&p.pd, pattern(1 << 20, 4), path, small(2));
        let regions = buf.state.regions();
        abandon_one_write(&mut buf, &mut p, &dst);
        // The QP and its CQ go, and with them the posted piece.
        drop(p);
        // Every registration is still held (and named) by its keepalive.
        assert_eq!(buf.state.regions(), regions, "{path:?}");
        if let PathState::Staging(st) = &buf.state {
            assert!(st.buffers.iter().all(|b| b.keepalive.0.is_empty()));
            assert_eq!(st.buffers.len(), 2);
        }
        drop(buf);
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_write_that_times_out_waits_one_timeout() {
    const LIMIT: Duration = Duration::from_millis(150);
    for path in [GdrPath::PeerMem, GdrPath::Staging] {
        let p = pair(64);
        let dst = target(&p.pd, 4 << 20);
        let mut buf = GpuBuffer::for_host_test(&p.pd, pattern(1 << 20, 4), path, small(2));
        buf.set_timeout(LIMIT);
        // Without the peer QP nothing completes until the retries run out
        // (about half a second on rxe), well after the limit.
        let Pair {
            pd: _pd,
            mut a,
            mut cq_a,
            _b,
            cq_b,
        } = p;
        drop((_b, cq_b));
        let t = Instant::now();
        let e = buf
            .write(&mut a, &mut cq_a, dst.remote(), 0)
            .expect_err("nothing completes");
        let took = t.elapsed();
        assert!(
            matches!(e, Error::Timeout { after, .. } if after == LIMIT),
            "{path:?}: {e:?}"
        );
        // One wait that saw nothing complete for LIMIT ends the write; a
        // second one for the WRITEs left posted would double it.
        assert!(took < LIMIT * 7 / 4, "{path:?}: took {took:?}");
        assert!(
            !buf.in_flight.is_empty(),
            "{path:?}: the WRITEs stay posted"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_panic_from_a_polled_buffer_leaves_the_gpu_buffer_whole() {
    for path in [GdrPath::PeerMem, GdrPath::Staging] {
        let mut p = pair(64);
        let dst = target(&p.pd, 4 << 20);
        let data = pattern(1 << 20, 5);
        let mut buf = GpuBuffer::for_host_test(&p.pd, data.clone(), path, small(2));
        // An unsignaled WRITE of the application's on the same QP: the
        // write's first completion retires it, and its buffer's Drop panics.
        let panicky = Mr::register(
            &p.pd,
            ArmedPanicMemory::armed(vec![1; 64]),
            AccessFlags::empty(),
        )
        .expect("register");
        p.a.post_send(
            SendWr::write(1, dst.remote(), 3 << 20)
                .sge(panicky)
                .signaled(false),
        )
        .unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            buf.write(&mut p.a, &mut p.cq_a, dst.remote(), 0)
        }));
        assert!(r.is_err(), "{path:?}: the panic reaches the caller");
        assert!(buf.in_flight.is_empty(), "{path:?}: every WRITE completed");
        assert!(buf.buffers_home(), "{path:?}: no buffer lost to the panic");
        assert!(dst.to_vec().unwrap()[..data.len()] == data[..], "{path:?}");
        let t = buf
            .write(&mut p.a, &mut p.cq_a, dst.remote(), 1 << 20)
            .unwrap_or_else(|e| panic!("{path:?}: a later write: {e:?}"));
        assert_eq!(t.bytes, data.len() as u64, "{path:?}");
        assert!(
            dst.to_vec().unwrap()[1 << 20..][..data.len()] == data[..],
            "{path:?}"
        );
    }
}
