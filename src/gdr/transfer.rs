//! "Send this device buffer to that remote MR": [`GpuBuffer`], over GPUDirect
//! RDMA when the machine has it, through pinned host bounce buffers when not.

use std::ffi::c_void;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use cudarc::driver::sys::{self, CUdeviceptr};

use super::driver::{driver, set_sync_memops_on};
use super::memory::{bind, dtoh, sync_stream};
use super::register::{probe, register_direct};
use super::select::{Capabilities, Decision, GdrMode, GdrPath, Missing, decide};
use super::{AttemptFailure, DeviceMemory, GdrError};
use crate::cq::{Completion, Cq};
use crate::error::{Error, Result};
use crate::mr::{AccessFlags, Mr, RemoteMr, page_size};
use crate::pd::Pd;
use crate::qp::{Buffer, PostError, Qp, Rc, Rts, SendWr};

/// The upper 32 bits of every `wr_id` a [`GpuBuffer`] posts ("GDR\0").
pub const WR_ID_TAG: u64 = 0x4744_5200_0000_0000;
const TAG_MASK: u64 = 0xffff_ffff_0000_0000;

/// Largest single RDMA WRITE the direct path posts (SGE lengths are 32-bit).
const MAX_WRITE: usize = 1 << 30;
/// Direct-path WRITEs in flight at once.
const DIRECT_DEPTH: usize = 8;

/// How the staging fallback stages: `buffers` registered host bounce buffers
/// of `chunk_size` bytes each.
///
/// With two or more buffers, the device-to-host copy of one chunk overlaps the
/// RDMA WRITE of the previous one (double buffering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per bounce buffer (rounded up to the host page size). Default 4 MiB.
    pub chunk_size: usize,
    /// Number of bounce buffers (at least 1). Default 2.
    pub buffers: usize,
    /// Page-lock the bounce buffers for CUDA too (`cuMemHostRegister`), so the
    /// copies run at full DMA speed; falls back to pageable copies if refused.
    /// Default true.
    pub pin: bool,
}

impl Default for StagingConfig {
    fn default() -> StagingConfig {
        StagingConfig {
            chunk_size: 4 << 20,
            buffers: 2,
            pin: true,
        }
    }
}

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
    /// (e.g. receives of a QP sharing the CQ), with their buffers.
    pub others: Vec<Completion>,
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
/// The CQ passed to `write` must be the QP's send CQ. Other completions that
/// show up are handed back in [`Transfer::others`].
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
    next_seq: u64,
    /// Device-to-host copy of the staging path (`cuMemcpyDtoH`; host tests swap it).
    copy: CopyFn,
    /// Other work requests' completions polled by a `write` that then failed.
    stray: Vec<Completion>,
    state: State,
}

/// Copies `dst.len()` bytes from a device address into `dst`.
type CopyFn = fn(&mut [u8], CUdeviceptr) -> std::result::Result<(), GdrError>;

enum State {
    /// Pieces of the device registration in hand (normally one, the whole).
    Direct(Vec<Mr>),
    Staging(Staging),
}

impl GpuBuffer {
    /// Prepares `mem` for sending with the default [`StagingConfig`].
    pub fn new(pd: &Pd, mem: impl DeviceMemory, mode: GdrMode) -> Result<GpuBuffer> {
        GpuBuffer::with_config(pd, mem, mode, StagingConfig::default())
    }

    /// Prepares `mem` for sending: observes the machine ([`probe`](super::probe)),
    /// decides ([`decide`]) and tries the paths in order until one works.
    ///
    /// Errors: [`GdrError::DriverNotAvailable`] without libcuda;
    /// [`GdrError::NoPath`] listing every missing piece and failed attempt.
    pub fn with_config(
        pd: &Pd,
        mem: impl DeviceMemory,
        mode: GdrMode,
        config: StagingConfig,
    ) -> Result<GpuBuffer> {
        driver()?;
        if config.chunk_size == 0 || config.buffers == 0 {
            return Err(Error::InvalidArgument {
                what: "staging config",
                reason: "chunk_size and buffers must be at least 1".into(),
            });
        }
        let mem: Arc<dyn DeviceMemory> = Arc::new(mem);
        let (ptr, len) = mem.device_range();
        if len == 0 {
            return Err(Error::InvalidArgument {
                what: "device memory length",
                reason: "must be at least 1 byte".into(),
            });
        }
        let caps = probe(&*mem);
        let (paths, skipped) = match decide(mode, &caps) {
            Decision::Refuse(missing) => {
                return Err(GdrError::NoPath {
                    mode,
                    missing,
                    failures: Vec::new(),
                }
                .into());
            }
            Decision::Try { paths, skipped } => (paths, skipped),
        };
        bind(mem.stream())?;
        sync_stream(mem.stream())?;
        let sync_memops = paths.iter().any(|p| p.is_direct()) && set_sync_memops_on(ptr).is_ok();
        let mut failures = Vec::new();
        for path in paths {
            let state = match path {
                GdrPath::DmaBuf | GdrPath::PeerMem => {
                    register_direct(pd, &mem, ptr, len, AccessFlags::empty(), path)
                        .map(|mr| State::Direct(vec![mr]))
                }
                GdrPath::Staging => {
                    Staging::new(pd, mem.stream().cloned(), &config).map(State::Staging)
                }
            };
            match state {
                Ok(state) => {
                    return Ok(GpuBuffer {
                        mem,
                        ptr,
                        len,
                        path,
                        caps,
                        skipped,
                        failures,
                        sync_memops,
                        timeout: Duration::from_secs(30),
                        next_seq: 0,
                        copy: dtoh,
                        stray: Vec::new(),
                        state,
                    });
                }
                Err(error) => failures.push(AttemptFailure {
                    path,
                    error: Box::new(error),
                    allocation_rdma_capable: caps.allocation_rdma_capable,
                }),
            }
        }
        Err(GdrError::NoPath {
            mode,
            missing: skipped,
            failures,
        }
        .into())
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
    /// ([`Error::Timeout`]). Default 30 s.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Completions of other work requests that a failed `write` polled from
    /// the CQ (a successful one returns them in [`Transfer::others`]).
    pub fn take_stray_completions(&mut self) -> Vec<Completion> {
        std::mem::take(&mut self.stray)
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
    /// [`Error::Timeout`] the buffers still posted stay with the QP; they are
    /// reclaimed when a later `write` polls their completions.
    pub fn write_range(
        &mut self,
        qp: &mut Qp<Rc, Rts>,
        cq: &mut Cq,
        range: Range<usize>,
        remote: RemoteMr,
        remote_offset: u64,
    ) -> Result<Transfer> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument {
                what: "device range",
                reason: format!(
                    "{}..{} is outside the {}-byte device buffer",
                    range.start, range.end, self.len
                ),
            });
        }
        let n = range.end - range.start;
        remote.checked_addr(remote_offset, n as u64)?;
        let start_seq = self.next_seq;
        let mut eng = Engine {
            qp_num: qp.qp_num(),
            first_seq: start_seq,
            next_seq: start_seq,
            polled: Vec::with_capacity(32),
            others: Vec::new(),
            timeout: self.timeout,
            outstanding: 0,
            first_error: None,
            returned: Vec::new(),
            posted: 0,
        };
        if n == 0 {
            return Ok(Transfer {
                path: self.path,
                bytes: 0,
                work_requests: 0,
                elapsed: Duration::ZERO,
                others: Vec::new(),
            });
        }
        bind(self.mem.stream())?;
        sync_stream(self.mem.stream())?;
        let t0 = Instant::now();
        let run = match &mut self.state {
            State::Direct(pieces) => direct_write(
                &mut eng,
                qp,
                cq,
                pieces,
                self.len,
                range,
                remote,
                remote_offset,
            ),
            State::Staging(st) => staging_write(
                &mut eng,
                qp,
                cq,
                st,
                (self.ptr, self.copy),
                range,
                remote,
                remote_offset,
            ),
        };
        // Whatever happened, wait for what is still posted (bounded by the timeout).
        let mut drain = Ok(());
        while eng.outstanding > 0 {
            if let Err(e) = eng.wait(cq) {
                drain = Err(e);
                break;
            }
        }
        let elapsed = t0.elapsed();
        self.next_seq = eng.next_seq;
        let returned = std::mem::take(&mut eng.returned);
        match &mut self.state {
            State::Direct(pieces) => {
                pieces.extend(returned);
                if let Some(whole) = reassemble(pieces) {
                    pieces.push(whole);
                }
            }
            State::Staging(st) => st.give_back(returned),
        }
        let failed = run.err().or(drain.err()).or(eng.first_error.take());
        if let Some(e) = failed {
            self.stray.append(&mut eng.others);
            return Err(e);
        }
        Ok(Transfer {
            path: self.path,
            bytes: n as u64,
            work_requests: eng.posted,
            elapsed,
            others: eng.others,
        })
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
            .finish()
    }
}

/// Joins the pieces of one registration back into a single `Mr` when they are
/// all there and adjacent; otherwise leaves them as they are.
fn reassemble(pieces: &mut Vec<Mr>) -> Option<Mr> {
    pieces.sort_by_key(Mr::addr);
    let mut it = std::mem::take(pieces).into_iter();
    let mut acc = it.next()?;
    for p in it {
        if let Err(p) = acc.unsplit(p) {
            pieces.push(p);
        }
    }
    if pieces.is_empty() {
        Some(acc)
    } else {
        pieces.push(acc);
        None
    }
}

#[allow(clippy::too_many_arguments)]
fn direct_write(
    eng: &mut Engine,
    qp: &mut Qp<Rc, Rts>,
    cq: &mut Cq,
    pieces: &mut Vec<Mr>,
    total: usize,
    range: Range<usize>,
    remote: RemoteMr,
    remote_offset: u64,
) -> Result<()> {
    let whole = match reassemble(pieces) {
        Some(mr) if mr.len() == total => mr,
        other => {
            pieces.extend(other);
            return Err(GdrError::BuffersInFlight.into());
        }
    };
    // Cut [range) out of the registration; the rest waits in `returned`.
    let mut rest = whole;
    if range.start > 0 {
        let mid = rest.split_off(range.start)?;
        eng.returned.push(std::mem::replace(&mut rest, mid));
    }
    if range.end < total {
        let tail = rest.split_off(range.end - range.start)?;
        eng.returned.push(tail);
    }
    let mut rest = Some(rest);
    let mut sent = 0usize;
    while let Some(mut cur) = rest.take() {
        if eng.first_error.is_some() {
            eng.returned.push(cur);
            break;
        }
        if cur.len() > MAX_WRITE {
            rest = Some(cur.split_off(MAX_WRITE)?);
        }
        while eng.outstanding >= DIRECT_DEPTH {
            if let Err(e) = eng.wait(cq) {
                eng.returned.push(cur);
                eng.returned.extend(rest);
                return Err(e);
            }
        }
        let n = cur.len();
        if let Err(e) = eng.post(qp, cq, cur, remote, remote_offset + sent as u64) {
            eng.returned.extend(rest);
            return Err(e);
        }
        sent += n;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn staging_write(
    eng: &mut Engine,
    qp: &mut Qp<Rc, Rts>,
    cq: &mut Cq,
    st: &mut Staging,
    (ptr, copy): (CUdeviceptr, CopyFn),
    range: Range<usize>,
    remote: RemoteMr,
    remote_offset: u64,
) -> Result<()> {
    let mut off = range.start;
    while off < range.end {
        if eng.first_error.is_some() {
            break;
        }
        let Some(mut buf) = st.free.pop() else {
            if eng.outstanding == 0 {
                return Err(GdrError::BuffersInFlight.into());
            }
            eng.wait(cq)?;
            st.give_back(std::mem::take(&mut eng.returned));
            continue;
        };
        let n = st.chunk.min(range.end - off).min(buf.len());
        if n < buf.len() {
            match buf.split_off(n) {
                Ok(tail) => st.tails.push(tail),
                Err(e) => {
                    st.free.push(buf);
                    return Err(e);
                }
            }
        }
        let copied = match buf.as_mut_slice() {
            Ok(dst) => copy(dst, ptr + off as u64).map_err(Error::from),
            Err(e) => Err(e),
        };
        if let Err(e) = copied {
            st.give_back(vec![buf]);
            return Err(e);
        }
        eng.post(
            qp,
            cq,
            buf,
            remote,
            remote_offset + (off - range.start) as u64,
        )?;
        off += n;
    }
    Ok(())
}

/// Posting and polling for one `write`.
struct Engine {
    qp_num: u32,
    /// First sequence number of this write; older ones are stale completions
    /// of an earlier write that timed out (their buffers are reclaimed).
    first_seq: u64,
    next_seq: u64,
    polled: Vec<Completion>,
    others: Vec<Completion>,
    timeout: Duration,
    outstanding: usize,
    first_error: Option<Error>,
    /// Buffers back from the NIC (or never posted), to return to the state.
    returned: Vec<Mr>,
    posted: u64,
}

impl Engine {
    /// Posts one WRITE of `piece`; when the send queue is full, waits for one of
    /// ours to complete and retries. On failure the piece is in `returned`.
    fn post(
        &mut self,
        qp: &mut Qp<Rc, Rts>,
        cq: &mut Cq,
        mut piece: Mr,
        remote: RemoteMr,
        remote_offset: u64,
    ) -> Result<()> {
        loop {
            let wr_id = WR_ID_TAG | (self.next_seq & !TAG_MASK);
            self.next_seq += 1;
            match qp.post_send(SendWr::write(wr_id, remote, remote_offset).sge(piece)) {
                Ok(()) => {
                    self.outstanding += 1;
                    self.posted += 1;
                    return Ok(());
                }
                Err(PostError { error, unposted }) => {
                    let back = unposted
                        .into_iter()
                        .flat_map(|(_, sges)| sges)
                        .find_map(Buffer::into_mr);
                    match (error, back) {
                        (Error::QueueFull { .. }, Some(mr)) if self.outstanding > 0 => {
                            piece = mr;
                            if let Err(e) = self.wait(cq) {
                                self.returned.push(piece);
                                return Err(e);
                            }
                        }
                        (error, back) => {
                            self.returned.extend(back);
                            return Err(error);
                        }
                    }
                }
            }
        }
    }

    /// Polls until at least one WRITE of this transfer completes (buffers go to
    /// `returned`, the first failure to `first_error`), or the timeout passes
    /// without one.
    fn wait(&mut self, cq: &mut Cq) -> Result<()> {
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            self.polled.clear();
            cq.poll(&mut self.polled)?;
            let mut ours = 0;
            for mut c in self.polled.drain(..) {
                let tagged = c.qp_num == self.qp_num && c.wr_id & TAG_MASK == WR_ID_TAG;
                let seq = c.wr_id & !TAG_MASK;
                if !tagged || seq >= (self.next_seq & !TAG_MASK) {
                    self.others.push(c);
                    continue;
                }
                let stale = seq < (self.first_seq & !TAG_MASK);
                for b in c.take_buffers() {
                    if let Some(mr) = b.into_mr() {
                        self.returned.push(mr);
                    }
                }
                if stale {
                    continue;
                }
                ours += 1;
                self.outstanding = self.outstanding.saturating_sub(1);
                if let Err(e) = c.result() {
                    self.first_error.get_or_insert(e);
                }
            }
            if ours > 0 {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout {
                    what: "RDMA WRITE completions of a GPU buffer",
                    after: self.timeout,
                });
            }
            idle += 1;
            if idle % 1024 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// The staging path's registered host bounce buffers.
struct Staging {
    stream: Option<Arc<CudaStream>>,
    /// Whole buffers ready for the next chunk.
    free: Vec<Mr>,
    /// Unused tails cut off buffers for a short last chunk.
    tails: Vec<Mr>,
    chunk: usize,
    /// Host addresses page-locked with cuMemHostRegister (unregistered on drop).
    pinned: Vec<usize>,
}

impl Staging {
    fn new(pd: &Pd, stream: Option<Arc<CudaStream>>, cfg: &StagingConfig) -> Result<Staging> {
        let chunk = cfg
            .chunk_size
            .checked_next_multiple_of(page_size())
            .ok_or_else(|| Error::InvalidArgument {
                what: "staging chunk size",
                reason: format!("{} bytes is too large", cfg.chunk_size),
            })?;
        let mut st = Staging {
            stream,
            free: Vec::with_capacity(cfg.buffers),
            tails: Vec::new(),
            chunk,
            pinned: Vec::new(),
        };
        if cfg.pin {
            bind(st.stream.as_ref())?;
        }
        for _ in 0..cfg.buffers {
            // A WRITE source: the NIC only reads it, so no access flags are needed.
            let mut mr = pd.alloc_mr(chunk, AccessFlags::empty())?;
            if cfg.pin {
                let p = mr.as_mut_slice()?.as_mut_ptr();
                // SAFETY: [p, p+chunk) is host memory owned by `mr`, which lives in
                // this Staging (or, if lost to a QP, in its ring) at least until Drop
                // unregisters it; page-locking does not move or change the bytes.
                let rc = unsafe {
                    sys::cuMemHostRegister_v2(
                        p.cast::<c_void>(),
                        chunk,
                        sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                if rc == sys::CUresult::CUDA_SUCCESS {
                    st.pinned.push(p as usize);
                }
            }
            st.free.push(mr);
        }
        Ok(st)
    }

    /// Returns buffers (whole, or heads of split ones) to the free list,
    /// joining the tails cut off for short chunks back on.
    fn give_back(&mut self, bufs: Vec<Mr>) {
        for mut mr in bufs {
            if let Some(i) = self
                .tails
                .iter()
                .position(|t| t.addr() == mr.addr() + mr.len() as u64)
            {
                let tail = self.tails.swap_remove(i);
                if let Err(tail) = mr.unsplit(tail) {
                    self.tails.push(tail);
                }
            }
            if mr.len() >= self.chunk {
                self.free.push(mr);
            } else {
                // A head whose tail is still out: wait for it.
                self.tails.push(mr);
                self.rejoin_tails();
            }
        }
    }

    /// Joins neighbouring pieces among the tails; whole buffers go to `free`.
    fn rejoin_tails(&mut self) {
        self.tails.sort_by_key(Mr::addr);
        let mut out: Vec<Mr> = Vec::new();
        for t in std::mem::take(&mut self.tails) {
            match out.last_mut() {
                Some(prev) => {
                    if let Err(t) = prev.unsplit(t) {
                        out.push(t);
                    }
                }
                None => out.push(t),
            }
        }
        for m in out {
            if m.len() >= self.chunk {
                self.free.push(m);
            } else {
                self.tails.push(m);
            }
        }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.pinned.is_empty() {
            return;
        }
        // Errors are ignored: Drop never panics.
        let _ = bind(self.stream.as_ref());
        for &p in &self.pinned {
            // SAFETY: `p` was page-locked by cuMemHostRegister in Staging::new and is
            // unregistered exactly once; no CUDA copy into it is in flight (staging
            // copies are synchronous). Unregistering neither frees nor moves memory.
            let _ = unsafe { sys::cuMemHostUnregister(p as *mut c_void) };
        }
    }
}

/// The RDMA half of [`GpuBuffer`] (chunking, double buffering, wr_id tagging,
/// queue-full retries, reassembly, error draining) on a real RDMA device, with
/// host memory standing in for GPU memory: the direct path registers it like
/// peer-mem does (`ibv_reg_mr` at IOVA = address), the staging path copies
/// with `memcpy` instead of `cuMemcpyDtoH`. They need an RDMA device but no
/// GPU, so they are ignored on the host; run them in the soft-RoCE guest:
/// `cargo xtask run -- <lib test binary> --ignored gdr::transfer::rdma_tests`.
#[cfg(test)]
mod rdma_tests {
    use super::*;
    use crate::qp::{InitAttr, QpCaps};
    use crate::{Context, GidType};

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
                GdrPath::Staging => State::Staging(
                    Staging::new(pd, None, &StagingConfig { pin: false, ..cfg }).expect("staging"),
                ),
                _ => State::Direct(vec![
                    register_direct(pd, &mem, ptr, len, AccessFlags::empty(), GdrPath::PeerMem)
                        .expect("register host memory"),
                ]),
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
                next_seq: 0,
                copy: host_copy,
                stray: Vec::new(),
                state,
            }
        }

        fn buffers_home(&self) -> bool {
            match &self.state {
                State::Direct(p) => p.len() == 1 && p[0].len() == self.len,
                State::Staging(st) => {
                    st.tails.is_empty() && st.free.iter().all(|m| m.len() == st.chunk)
                }
            }
        }

        fn free_buffers(&self) -> usize {
            match &self.state {
                State::Direct(p) => p.len(),
                State::Staging(st) => st.free.len(),
            }
        }
    }

    struct Pair {
        pd: Pd,
        a: Qp<Rc, Rts>,
        cq_a: Cq,
        _b: Qp<Rc, Rts>,
        _cq_b: Cq,
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
            .map(|e| e.index as u8)
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
        let ea = a.endpoint(1, Some(u32::from(gid))).unwrap();
        let eb = b.endpoint(1, Some(u32::from(gid))).unwrap();
        Pair {
            a: a.connect(&eb, Some(gid)).expect("connect a"),
            _b: b.connect(&ea, Some(gid)).expect("connect b"),
            pd,
            cq_a,
            _cq_b: cq_b,
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
            State::Staging(st) => st.chunk,
            State::Direct(_) => MAX_WRITE,
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
    fn a_failed_write_drains_and_keeps_the_buffers() {
        for path in [GdrPath::Staging, GdrPath::PeerMem] {
            let mut p = pair(64);
            let dst = target(&p.pd, 1 << 20);
            let mut bad = dst.remote();
            bad.rkey ^= 0x5a5a; // the peer refuses: REM_ACCESS_ERR, then flushes
            let mut buf = GpuBuffer::for_host_test(&p.pd, pattern(500_000, 9), path, small(3));
            let e = buf.write(&mut p.a, &mut p.cq_a, bad, 0).unwrap_err();
            assert!(
                matches!(e, Error::WorkCompletion { status, .. } if status != crate::WcStatus::Success),
                "{path:?}: {e:?}"
            );
            assert!(buf.buffers_home(), "{path:?}: buffers lost after an error");
            assert_eq!(
                buf.free_buffers(),
                if path == GdrPath::Staging { 3 } else { 1 }
            );
        }
    }
}
