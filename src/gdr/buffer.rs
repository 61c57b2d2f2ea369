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
        // Wait for what is still posted (bounded by the timeout), unless a
        // wait already saw nothing complete for a whole timeout: then what is
        // posted stays with the QP, for a later write to reclaim.
        let drain = match run {
            Err(Error::Timeout { .. }) => Ok(()),
            _ => ledger.drain(cq),
        };
        let elapsed = t0.elapsed();
        self.in_flight = std::mem::take(&mut ledger.in_flight);
        self.state.give_back(std::mem::take(&mut ledger.returned));
        if let Some(panic) = ledger.panic.take() {
            // A buffer retired by a poll panicked in its `Drop`; the books
            // are whole again, so the panic goes on to the caller.
            self.stray.append(&mut ledger.others);
            self.stray_buffers.append(&mut ledger.taken);
            std::panic::resume_unwind(panic);
        }
        let failed = run
            .err()
            .or_else(|| drain.err())
            .or_else(|| ledger.first_error.take());
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
mod rdma_tests;
