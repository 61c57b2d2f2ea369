//! The errors of GPU memory (the `gdr` feature), and the hints they carry.

use std::fmt;

use super::Error;
use crate::values::gdr::{GdrMode, GdrPath, Missing};

/// What can go wrong with GPU memory. Reaches callers as [`Error::Gdr`](crate::Error).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum GdrError {
    /// libcuda is missing, too old, or `cuInit` failed (no GPU visible).
    #[error(
        "CUDA driver not available: {detail}. GPU memory needs the NVIDIA driver's \
         libcuda.so.1 and a visible GPU (check nvidia-smi; in containers use the NVIDIA \
         container toolkit, --gpus all)"
    )]
    DriverNotAvailable {
        /// What exactly failed.
        detail: String,
    },

    /// A CUDA driver call failed.
    #[error("{call} failed: {name} ({code}){}", cuda_hint(call, *code))]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The `CUresult` value.
        code: u32,
        /// Its name, e.g. `CUDA_ERROR_NOT_SUPPORTED`.
        name: String,
    },

    /// No path can move this memory with the requested mode.
    #[error(
        "no way to use this GPU memory with mode `{mode}`:{}",
        Listing(missing, failures)
    )]
    NoPath {
        /// The mode asked for.
        mode: GdrMode,
        /// Missing pieces, each with what to do.
        missing: Vec<Missing>,
        /// Paths that were tried and failed.
        failures: Vec<AttemptFailure>,
    },

    /// The buffers of an earlier transfer are still posted (it timed out).
    #[error(
        "the buffers of an earlier transfer of this GPU buffer are still posted (it timed out); \
         they come back when their completions are polled by a later write, or recreate the \
         GpuBuffer"
    )]
    BuffersInFlight,
}

/// A path that was tried and failed, and why.
#[derive(Debug)]
pub struct AttemptFailure {
    /// The path.
    pub path: GdrPath,
    /// The error it gave.
    pub error: Box<Error>,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` of the allocation, for the hint.
    pub allocation_rdma_capable: Option<bool>,
}

impl fmt::Display for AttemptFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.path, self.error)?;
        let errno = self.error.errno();
        let hint = match (self.path, errno) {
            (GdrPath::DmaBuf, Some(libc::EOPNOTSUPP)) | (GdrPath::DmaBuf, Some(libc::ENOSYS)) => {
                Some(
                    "the RDMA driver cannot register dma-bufs (needs e.g. mlx5 or efa on Linux \
                     >= 5.12; soft-RoCE cannot)",
                )
            }
            (GdrPath::PeerMem, Some(libc::EFAULT)) | (GdrPath::PeerMem, Some(libc::EINVAL)) => {
                Some(
                    "the kernel could not pin the GPU pages: is nvidia-peermem loaded \
                     (`modprobe nvidia-peermem`) and does the NIC's RDMA stack support peer memory?",
                )
            }
            _ => None,
        };
        if let Some(h) = hint {
            write!(f, " ({h})")?;
        }
        if self.path.is_direct() && self.allocation_rdma_capable == Some(false) {
            f.write_str(
                " (note: CUDA reports this allocation as not GPUDirect-RDMA capable; allocate \
                 it with cuMemAlloc / gdr::DeviceAlloc rather than a stream-ordered pool or VMM \
                 without gpuDirectRDMACapable)",
            )?;
        }
        Ok(())
    }
}

struct Listing<'a>(&'a [Missing], &'a [AttemptFailure]);

impl fmt::Display for Listing<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() && self.1.is_empty() {
            return f.write_str(" nothing to try");
        }
        for m in self.0 {
            write!(f, "\n  - {m}")?;
        }
        for a in self.1 {
            write!(f, "\n  - {a}")?;
        }
        Ok(())
    }
}

fn cuda_hint(call: &str, code: u32) -> &'static str {
    use cudarc::driver::sys::CUresult as R;
    let not_supported = code == R::CUDA_ERROR_NOT_SUPPORTED as u32;
    let invalid = code == R::CUDA_ERROR_INVALID_VALUE as u32;
    match call {
        "cuMemGetHandleForAddressRange" if not_supported => {
            "; dma-buf export needs the NVIDIA open kernel modules and Linux >= 5.12"
        }
        "cuMemGetHandleForAddressRange" if invalid => {
            "; the page-aligned range must lie inside one device allocation (allocate at least \
             64 KiB, e.g. with gdr::DeviceAlloc)"
        }
        _ if code == R::CUDA_ERROR_INVALID_CONTEXT as u32 => {
            "; no CUDA context is current on this thread: give the memory a stream \
             (DeviceMemory::stream) or bind its context first"
        }
        _ => "",
    }
}
