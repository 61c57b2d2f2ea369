//! [`GpuBuffer`]: "send this device buffer to that remote MR", over GPUDirect
//! RDMA when the machine has it, through pinned host bounce buffers when not.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;

use super::direct::{direct_write, reassemble};
use super::driver::{driver, set_sync_memops_on};
use super::ledger::{InFlight, RegistrationKeepalive, WriteLedger};
use super::memory::{bind, dtoh, sync_stream};
use super::plan::PathPlan;
use super::register::register_direct;
use super::select::Capabilities;
use super::staging::{BounceBuffers, CopyFn, StagingConfig, staging_write};
use super::{AttemptFailure, DeviceMemory};
#[cfg(doc)]
use super::{GdrError, decide};
use crate::cq::{Completion, Cq};
use crate::error::{Error, Result};
use crate::mr::{AccessFlags, Mr, RemoteMr};
use crate::pd::Pd;
use crate::qp::{Qp, Rc, Rts, Sges};
use crate::values::gdr::{GdrMode, GdrPath, Missing};

/// What one [`GpuBuffer::write`] did.
pub struct Transfer {
    /// The path the bytes took.
    pub path: GdrPath,
    /// Bytes written to the peer.
    pub bytes: u64,
    /// RDMA WRITEs posted.
    pub work_requests: u64,
    /// From the first copy/post to the last completion.
    pub elapsed: Duration,
    /// Completions of other work requests that the CQ delivered meanwhile
    /// (e.g. receives of a QP sharing the CQ, or WRITEs of another
    /// [`GpuBuffer`] on the same QP), with their buffers except as
    /// [`Transfer::taken_buffers`] says.
    pub others: Vec<Completion>,
    /// Buffers that had to be taken out of completions in [`Transfer::others`]
    /// to see whose they were, with the completion's `wr_id`: their QP number
    /// and `wr_id` matched a WRITE this buffer had in flight (someone posted a
    /// `wr_id` carrying [`WR_ID_TAG`](super::WR_ID_TAG)), but the buffers were not its own.
    /// Those completions are in `others` without buffers. Normally empty.
    pub taken_buffers: Vec<(u64, Sges)>,
}

impl Transfer {
    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        let s = self.elapsed.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s / 1e9
        } else {
            0.0
        }
    }
}

impl fmt::Debug for Transfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transfer")
            .field("path", &self.path)
            .field("bytes", &self.bytes)
            .field("work_requests", &self.work_requests)
            .field("elapsed", &self.elapsed)
            .field("others", &self.others.len())
            .field("taken_buffers", &self.taken_buffers.len())
            .finish()
    }
}

/// Device memory prepared for sending with RDMA WRITE.
///
/// [`GpuBuffer::new`] picks the path ([`GdrMode`]); [`GpuBuffer::path`] says
/// which one it got. [`GpuBuffer::write`] then does the same thing on every
/// path: it waits for the memory's stream (so kernels that produced the data
/// have finished), moves the bytes to the peer's MR with the crate's safe data
/// path (`post_send` of `SendWr::write`, buffers back from `Cq::poll`), and
/// returns when every WRITE has completed.
///
/// * Direct (dma-buf / peer-mem): the device memory itself is registered and
///   posted, in WRITEs of at most 1 GiB.
/// * Staging: chunks are copied (`cuMemcpyDtoH`) into registered host bounce
///   buffers, each posted as soon as it is filled; with two or more buffers the
///   next copy runs while the previous chunk is on the wire.
///
/// The CQ passed to `write` must be the QP's send CQ (refused with
/// [`Error::InvalidArgument`] otherwise). A `write` takes back
/// only completions of its own WRITEs: same QP number and `wr_id` as one it
/// has in flight, carrying a piece of its own registration (device memory or
/// bounce buffer). Other completions that show up are handed back in
/// [`Transfer::others`]; several `GpuBuffer`s may share a QP and CQ.
pub struct GpuBuffer {
    mem: Arc<dyn DeviceMemory>,
    ptr: CUdeviceptr,
    len: usize,
    path: GdrPath,
    caps: Capabilities,
    skipped: Vec<Missing>,
    failures: Vec<AttemptFailure>,
    sync_memops: bool,
    timeout: Duration,
    /// Number of `write`s that posted something: the current one's id.
    writes: u64,
    /// WRITEs posted and not yet seen completing (also those of earlier
    /// writes that timed out).
    in_flight: Vec<InFlight>,
    /// Device-to-host copy of the staging path (`cuMemcpyDtoH`; host tests swap it).
    copy: CopyFn,
    /// Other work requests' completions polled by a `write` that then failed.
    stray: Vec<Completion>,
    /// Buffers taken out of `stray` completions (see [`Transfer::taken_buffers`]).
    stray_buffers: Vec<(u64, Sges)>,
    state: PathState,
}

enum PathState {
    Direct {
        /// Pieces of the device registration in hand (normally one, the whole).
        pieces: Vec<Mr>,
        /// Keeps the registration and names it.
        keepalive: RegistrationKeepalive,
    },
    Staging(BounceBuffers),
}

impl PathState {
    /// The `ibv_mr`s (as addresses) of this buffer's own registrations.
    fn regions(&self) -> Vec<usize> {
        match self {
            PathState::Direct { keepalive, .. } => vec![keepalive.region()],
            PathState::Staging(st) => st.buffers.iter().map(|b| b.keepalive.region()).collect(),
        }
    }

    /// Takes back pieces that returned from the NIC (or were never posted).
    fn give_back(&mut self, returned: Vec<Mr>) {
        match self {
            PathState::Direct { pieces, .. } => {
                pieces.extend(returned);
                if let Some(whole) = reassemble(pieces) {
                    pieces.push(whole);
                }
            }
            PathState::Staging(st) => st.give_back(returned),
        }
    }
}

impl GpuBuffer {
    /// Prepares `mem` for sending with the default [`StagingConfig`].
    pub fn new(pd: &Pd, mem: impl DeviceMemory, mode: GdrMode) -> Result<GpuBuffer> {
        GpuBuffer::with_config(pd, mem, mode, StagingConfig::default())
    }

    /// Prepares `mem` for sending: observes the machine ([`probe`](super::probe)),
    /// decides ([`decide`]) and tries the paths in order until one works.
    ///
    /// Errors: [`Error::InvalidArgument`] for a `config` that
    /// [`StagingConfig::validate`] refuses (checked first);
    /// [`GdrError::DriverNotAvailable`] without libcuda;
    /// [`GdrError::NoPath`] listing every missing piece and failed attempt.
    pub fn with_config(
        pd: &Pd,
        mem: impl DeviceMemory,
        mode: GdrMode,
        config: StagingConfig,
    ) -> Result<GpuBuffer> {
        config.validate()?;
        driver()?;
        let mem: Arc<dyn DeviceMemory> = Arc::new(mem);
        let (ptr, len) = mem.device_range();
        if len == 0 {
            return Err(Error::InvalidArgument {
                what: "device memory length",
                reason: "it is 0, and it must be at least 1 byte".into(),
            });
        }
        if ptr.checked_add(len as u64).is_none() {
            return Err(Error::InvalidArgument {
                what: "device memory",
                reason: format!("[{ptr:#x}, +{len}) overflows the address space"),
            });
        }
        let plan = PathPlan::for_memory(&*mem, mode)?;
        let caps = *plan.capabilities();
        bind(mem.stream())?;
        sync_stream(mem.stream())?;
        let sync_memops = plan.has_direct() && set_sync_memops_on(ptr).is_ok();
        let chosen = plan.first_working(|path| match path {
            GdrPath::DmaBuf | GdrPath::PeerMem => {
                register_direct(pd, &mem, ptr, len, AccessFlags::empty(), path).and_then(
                    |mut mr| {
                        let keepalive = RegistrationKeepalive::cut_from(&mut mr)?;
                        Ok(PathState::Direct {
                            pieces: vec![mr],
                            keepalive,
                        })
                    },
                )
            }
            GdrPath::Staging => {
                BounceBuffers::new(pd, mem.stream().cloned(), &config).map(PathState::Staging)
            }
        })?;
        Ok(GpuBuffer {
            mem,
            ptr,
            len,
            path: chosen.path,
            caps,
            skipped: chosen.skipped,
            failures: chosen.failures,
            sync_memops,
            timeout: Duration::from_secs(30),
            writes: 0,
            in_flight: Vec::new(),
            copy: dtoh,
            stray: Vec::new(),
            stray_buffers: Vec::new(),
            state: chosen.value,
        })
    }

    /// The path this buffer uses.
    pub fn path(&self) -> GdrPath {
        self.path
    }

    /// Bytes of device memory.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer (never: `new` refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What was observed when the path was chosen.
    pub fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    /// What ruled out the paths the mode would have preferred.
    pub fn skipped(&self) -> &[Missing] {
        &self.skipped
    }

    /// Paths tried (and failed) before [`GpuBuffer::path`] worked.
    pub fn failures(&self) -> &[AttemptFailure] {
        &self.failures
    }

    /// Whether `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` was set (direct paths).
    pub fn sync_memops(&self) -> bool {
        self.sync_memops
    }

    /// The device memory.
    pub fn memory(&self) -> &Arc<dyn DeviceMemory> {
        &self.mem
    }

    /// How long `write` waits without any completion before giving up
    /// ([`Error::Timeout { .. }`](Error::Timeout)). Default 30 s.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Completions of other work requests that a failed `write` polled from
    /// the CQ (a successful one returns them in [`Transfer::others`]).
    pub fn take_stray_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.stray)
    }

    /// Buffers that a failed `write` had to take out of stray completions to
    /// see whose they were (a successful one returns them in
    /// [`Transfer::taken_buffers`]), with the completion's `wr_id`.
    pub fn take_stray_buffers(&mut self) -> Vec<(u64, Sges)> {
        std::mem::take(&mut self.stray_buffers)
    }

    /// RDMA-WRITEs the whole buffer to `remote` at `remote_offset`.
    pub fn write(
        &mut self,
        qp: &mut Qp<Rc, Rts>,
        cq: &mut Cq,
        remote: RemoteMr,
        remote_offset: u64,
    ) -> Result<Transfer> {
        self.write_range(qp, cq, 0..self.len, remote, remote_offset)
    }

    /// RDMA-WRITEs bytes `range` of the buffer to `remote` at `remote_offset`.
    ///
    /// Returns when every WRITE has completed. On a failed completion the
    /// remaining WRITEs are drained and the first error is returned (other
    /// completions polled meanwhile wait in
    /// [`take_stray_completions`](Self::take_stray_completions)). On
    /// [`Error::Timeout { .. }`](Error::Timeout) the buffers still posted
    /// stay with the QP; they are reclaimed when a later `write` polls their
    /// completions (each `write` polls the CQ once before it starts while
    /// some are out). Until then
    /// the direct path fails with [`GdrError::BuffersInFlight`] and the
    /// staging path runs on the bounce buffers it has.
    pub fn write_range(
        &mut self,
        qp: &mut Qp<Rc, Rts>,
        cq: &mut Cq,
        range: Range<usize>,
        remote: RemoteMr,
        remote_offset: u64,
    ) -> Result<Transfer> {
        self.check_write(qp, cq, &range)?;
        let n = range.end - range.start;
        remote.checked_addr(remote_offset, n as u64)?;
        if n == 0 {
            return Ok(Transfer {
                path: self.path,
                bytes: 0,
                work_requests: 0,
                elapsed: Duration::ZERO,
                others: Vec::new(),
                taken_buffers: Vec::new(),
            });
        }
        bind(self.mem.stream())?;
        sync_stream(self.mem.stream())?;
        self.writes += 1;
        let mut ledger = WriteLedger::new(
            qp.qp_num(),
            self.writes,
            self.state.regions(),
            std::mem::take(&mut self.in_flight),
            self.timeout,
        );
        let t0 = Instant::now();
        let mut run = self.reclaim_earlier_writes(&mut ledger, cq);
        if run.is_ok() {
            run = self.post_range(&mut ledger, qp, cq, range, remote, remote_offset);
        }
        // Whatever happened, wait for what is still posted (bounded by the timeout).
        let drain = ledger.drain(cq);
        let elapsed = t0.elapsed();
        self.in_flight = std::mem::take(&mut ledger.in_flight);
        self.state.give_back(std::mem::take(&mut ledger.returned));
        let failed = run.err().or(drain.err()).or(ledger.first_error.take());
        if let Some(e) = failed {
            self.stray.append(&mut ledger.others);
            self.stray_buffers.append(&mut ledger.taken);
            return Err(e);
        }
        Ok(Transfer {
            path: self.path,
            bytes: n as u64,
            work_requests: ledger.posted,
            elapsed,
            others: ledger.others,
            taken_buffers: ledger.taken,
        })
    }

    /// Refuses a CQ that is not `qp`'s send CQ and a range outside the buffer.
    fn check_write(&self, qp: &Qp<Rc, Rts>, cq: &Cq, range: &Range<usize>) -> Result<()> {
        if qp.cq_raws().0 != cq.as_raw() {
            // Its completions would never show up: the wait would spin until
            // the timeout (never, with `Duration::MAX`).
            return Err(Error::InvalidArgument {
                what: "GpuBuffer::write",
                reason: "the CQ is not the QP's send CQ: pass the CQ the QP was created with \
                         as its send CQ"
                    .into(),
            });
        }
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument {
                what: "device range",
                reason: format!(
                    "{}..{} is outside the {}-byte device buffer",
                    range.start, range.end, self.len
                ),
            });
        }
        Ok(())
    }

    /// Takes back what earlier (timed-out) writes left posted, if it is done.
    fn reclaim_earlier_writes(&mut self, ledger: &mut WriteLedger, cq: &mut Cq) -> Result<()> {
        if ledger.in_flight.is_empty() {
            return Ok(());
        }
        let r = ledger.poll_once(cq).map(drop);
        self.state.give_back(std::mem::take(&mut ledger.returned));
        r
    }

    /// Posts the WRITEs of `range` on this buffer's path.
    fn post_range(
        &mut self,
        ledger: &mut WriteLedger,
        qp: &mut Qp<Rc, Rts>,
        cq: &mut Cq,
        range: Range<usize>,
        remote: RemoteMr,
        remote_offset: u64,
    ) -> Result<()> {
        match &mut self.state {
            PathState::Direct { pieces, .. } => direct_write(
                ledger,
                qp,
                cq,
                pieces,
                self.len,
                range,
                remote,
                remote_offset,
            ),
            PathState::Staging(st) => staging_write(
                ledger,
                qp,
                cq,
                st,
                (self.ptr, self.copy),
                range,
                remote,
                remote_offset,
            ),
        }
    }
}

impl fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("path", &self.path)
            .field("skipped", &self.skipped)
            .field("sync_memops", &self.sync_memops)
            .field("in_flight", &self.in_flight.len())
            .finish()
    }
}

/// The RDMA half of [`GpuBuffer`] (chunking, double buffering, telling its
/// own completions from others', reclaiming what a timed-out write left
/// posted, queue-full retries, reassembly, error draining) on a real RDMA
/// device, with host memory standing in for GPU memory: the direct path
/// registers it like peer-mem does (`ibv_reg_mr` at IOVA = address), the
/// staging path copies with `memcpy` instead of `cuMemcpyDtoH`. They need an
/// RDMA device but no GPU, so they are ignored on the host; run them in the
/// soft-RoCE guest, one at a time (one test predicts the next `wr_id`s):
/// `cargo xtask run -- <lib test binary> --ignored gdr::buffer::rdma_tests --test-threads 1`.
#[cfg(test)]
mod rdma_tests {
    use std::sync::atomic::Ordering;

    use cudarc::driver::CudaStream;

    use super::*;
    use crate::context::Context;
    use crate::device::GidType;
    use crate::gdr::GdrError;
    use crate::gdr::direct::MAX_WRITE;
    use crate::gdr::ledger::{NEXT_WR_SEQ, TAG_MASK, WR_ID_TAG};
    use crate::gdr::staging::StagingConfig;
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
        let mut buf =
            GpuBuffer::for_host_test(&p.pd, pattern(300_000, 1), GdrPath::Staging, small(2));
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
        let mut a =
            GpuBuffer::for_host_test(&p.pd, pattern(4 << 20, 1), GdrPath::Staging, small(3));
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
}
