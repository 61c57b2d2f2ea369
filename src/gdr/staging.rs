//! The staging path of a [`GpuBuffer`]: chunks copied from
//! the device into registered host bounce buffers, each posted as soon as it is
//! filled.

use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::driver::sys::{self, CUdeviceptr};

use super::GdrError;
use super::direct::MAX_WRITE;
use super::ledger::{RegistrationKeepalive, WriteLedger, offset_by};
use super::memory::bind;
use crate::cq::Cq;
use crate::error::{Error, Result};
use crate::mr::{AccessFlags, Mr, RemoteMr, page_size};
use crate::pd::Pd;
use crate::qp::{Qp, Rc, Rts};

#[cfg(doc)]
use super::GpuBuffer;

/// How the staging fallback stages: `buffers` registered host bounce buffers
/// of `chunk_size` bytes each.
///
/// With two or more buffers, the device-to-host copy of one chunk overlaps the
/// RDMA WRITE of the previous one (double buffering).
///
/// [`GpuBuffer::with_config`] checks it with [`StagingConfig::validate`] and
/// refuses an invalid one with [`Error::InvalidArgument`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Bytes per bounce buffer, 1 to [`StagingConfig::MAX_CHUNK_SIZE`]
    /// (rounded up to the host page size). Default 4 MiB.
    pub chunk_size: usize,
    /// Number of bounce buffers, 1 to [`StagingConfig::MAX_BUFFERS`]. Default 2.
    pub buffers: usize,
    /// Page-lock the bounce buffers for CUDA too (`cuMemHostRegister`), so the
    /// copies run at full DMA speed; falls back to pageable copies if refused.
    /// The lock is released (`cuMemHostUnregister`) when the [`GpuBuffer`] is
    /// dropped, and the bounce buffers' memory is kept allocated until then
    /// even if some of it was lost to a QP (a timed-out write whose QP was
    /// dropped), so memory is never freed while CUDA still has it page-locked.
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

impl StagingConfig {
    /// The most bounce buffers a [`GpuBuffer`] allocates.
    pub const MAX_BUFFERS: usize = 64;
    /// The largest bounce buffer: 1 GiB (an SGE's length is 32-bit).
    pub const MAX_CHUNK_SIZE: usize = MAX_WRITE;

    /// Checks the limits: `buffers` in `1..=MAX_BUFFERS`, `chunk_size` in
    /// `1..=MAX_CHUNK_SIZE`. Pure; [`Error::InvalidArgument`] otherwise.
    pub fn validate(&self) -> Result<()> {
        if self.buffers == 0 || self.buffers > Self::MAX_BUFFERS {
            return Err(Error::InvalidArgument {
                what: "staging buffers",
                reason: format!(
                    "{} bounce buffers: must be 1 to {}",
                    self.buffers,
                    Self::MAX_BUFFERS
                ),
            });
        }
        if self.chunk_size == 0 || self.chunk_size > Self::MAX_CHUNK_SIZE {
            return Err(Error::InvalidArgument {
                what: "staging chunk size",
                reason: format!(
                    "{} bytes: must be 1 to {} (1 GiB)",
                    self.chunk_size,
                    Self::MAX_CHUNK_SIZE
                ),
            });
        }
        Ok(())
    }
}

/// Copies `dst.len()` bytes from a device address into `dst`.
pub(crate) type CopyFn = fn(&mut [u8], CUdeviceptr) -> std::result::Result<(), GdrError>;

#[allow(clippy::too_many_arguments)]
pub(crate) fn staging_write(
    ledger: &mut WriteLedger,
    qp: &mut Qp<Rc, Rts>,
    cq: &mut Cq,
    st: &mut BounceBuffers,
    (ptr, copy): (CUdeviceptr, CopyFn),
    range: Range<usize>,
    remote: RemoteMr,
    remote_offset: u64,
) -> Result<()> {
    let mut off = range.start;
    while off < range.end {
        if ledger.first_error.is_some() {
            break;
        }
        let Some(mut buf) = st.free.pop() else {
            if ledger.outstanding == 0 {
                return Err(GdrError::BuffersInFlight.into());
            }
            ledger.wait(cq)?;
            st.give_back(std::mem::take(&mut ledger.returned));
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
        let at = offset_by("device address", ptr, off).and_then(|src| {
            offset_by("remote offset", remote_offset, off - range.start).map(|dst| (src, dst))
        });
        let copied = at.and_then(|at| {
            let dst = buf.as_mut_slice()?;
            copy(dst, at.0)?;
            Ok(at.1)
        });
        let dst_off = match copied {
            Ok(dst_off) => dst_off,
            Err(e) => {
                st.give_back(vec![buf]);
                return Err(e);
            }
        };
        ledger.post(qp, cq, buf, remote, dst_off)?;
        off += n;
    }
    Ok(())
}

/// The staging path's registered host bounce buffers.
pub(super) struct BounceBuffers {
    pub(super) stream: Option<Arc<CudaStream>>,
    /// Whole buffers ready for the next chunk.
    pub(super) free: Vec<Mr>,
    /// Unused tails cut off buffers for a short last chunk.
    pub(super) tails: Vec<Mr>,
    pub(super) chunk: usize,
    /// One per bounce buffer, for the whole life of the set.
    pub(super) buffers: Vec<BounceBuffer>,
}

/// What a [`BounceBuffers`] keeps of each bounce buffer besides its pieces.
pub(super) struct BounceBuffer {
    /// Keeps the buffer's registration and memory alive until after `Drop`
    /// unregistered the page-locking, even if every other piece is gone.
    pub(super) keepalive: RegistrationKeepalive,
    /// The host address page-locked with `cuMemHostRegister`, if it was.
    pub(super) pinned: Option<usize>,
}

impl BounceBuffers {
    pub(super) fn new(
        pd: &Pd,
        stream: Option<Arc<CudaStream>>,
        cfg: &StagingConfig,
    ) -> Result<BounceBuffers> {
        cfg.validate()?;
        let chunk = cfg
            .chunk_size
            .checked_next_multiple_of(page_size())
            .filter(|&c| c <= StagingConfig::MAX_CHUNK_SIZE)
            .ok_or_else(|| Error::InvalidArgument {
                what: "staging chunk size",
                reason: format!(
                    "{} bytes is too large once rounded up to the page size",
                    cfg.chunk_size
                ),
            })?;
        let mut st = BounceBuffers {
            stream,
            free: Vec::with_capacity(cfg.buffers),
            tails: Vec::new(),
            chunk,
            buffers: Vec::with_capacity(cfg.buffers),
        };
        if cfg.pin {
            bind(st.stream.as_ref())?;
        }
        for _ in 0..cfg.buffers {
            // A WRITE source: the NIC only reads it, so no access flags are needed.
            let mut mr = pd.alloc_mr(chunk, AccessFlags::empty())?;
            let keepalive = RegistrationKeepalive::cut_from(&mut mr)?;
            let mut pinned = None;
            if cfg.pin {
                let p = mr.as_mut_slice()?.as_mut_ptr();
                // SAFETY: [p, p+chunk) is the host memory of the registration `mr`
                // and `keepalive` are pieces of. The keepalive is stored in `st.buffers`
                // right below (nothing in between can fail) and is dropped only
                // after BounceBuffers' Drop has unregistered p, so the memory stays
                // allocated while it is page-locked, wherever the other pieces
                // go; page-locking does not move or change the bytes.
                let rc = unsafe {
                    sys::cuMemHostRegister_v2(
                        p.cast::<c_void>(),
                        chunk,
                        sys::CU_MEMHOSTREGISTER_PORTABLE,
                    )
                };
                if rc == sys::CUresult::CUDA_SUCCESS {
                    pinned = Some(p as usize);
                }
            }
            st.buffers.push(BounceBuffer { keepalive, pinned });
            st.free.push(mr);
        }
        Ok(st)
    }

    /// Returns buffers (whole, or heads of split ones) to the free list,
    /// joining the tails cut off for short chunks back on.
    pub(super) fn give_back(&mut self, bufs: Vec<Mr>) {
        for mut mr in bufs {
            if let Some(i) = self
                .tails
                .iter()
                .position(|t| Some(t.addr()) == mr.addr().checked_add(mr.len() as u64))
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

impl Drop for BounceBuffers {
    fn drop(&mut self) {
        if self.buffers.iter().all(|b| b.pinned.is_none()) {
            return;
        }
        // Errors are ignored: Drop never panics.
        let _ = bind(self.stream.as_ref());
        for b in std::mem::take(&mut self.buffers) {
            let Some(p) = b.pinned else { continue };
            // SAFETY: `p` was page-locked by cuMemHostRegister in BounceBuffers::new and is
            // unregistered exactly once; its memory is still allocated (b.keepalive holds
            // the registration); no CUDA copy into it is in flight (staging copies are
            // synchronous). Unregistering neither frees nor moves memory.
            let rc = unsafe { sys::cuMemHostUnregister(p as *mut c_void) };
            if rc != sys::CUresult::CUDA_SUCCESS {
                // CUDA may still consider the memory page-locked (e.g. no context
                // could be bound): never free it, so it cannot be reused meanwhile.
                std::mem::forget(b.keepalive);
            }
            // Otherwise `b.keepalive` drops here; the memory is freed once the last
            // piece (some may still be with a QP) is gone.
        }
    }
}
