//! What the GPU-memory paths are called, and what each may lack.

use std::fmt;
use std::str::FromStr;

use crate::error::Error;

/// How the caller wants GPU memory to reach the NIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum GdrMode {
    /// dma-buf if the GPU supports it, else nvidia-peermem if it is loaded,
    /// else (for transfers) staging through host memory.
    #[default]
    Auto,
    /// GPUDirect RDMA through a dma-buf export (`cuMemGetHandleForAddressRange`
    /// + `ibv_reg_dmabuf_mr`) only.
    DmaBuf,
    /// GPUDirect RDMA through the nvidia-peermem kernel module (plain
    /// `ibv_reg_mr` on the device pointer) only.
    PeerMem,
    /// Copy through registered host bounce buffers (no GPUDirect needed).
    Staging,
}

impl fmt::Display for GdrMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GdrMode::Auto => "auto",
            GdrMode::DmaBuf => "dmabuf",
            GdrMode::PeerMem => "peermem",
            GdrMode::Staging => "staging",
        })
    }
}

impl FromStr for GdrMode {
    type Err = Error;

    /// Parses `auto`, `dmabuf` (or `dma-buf`), `peermem` (or `peer-mem`), `staging`.
    fn from_str(s: &str) -> Result<GdrMode, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(GdrMode::Auto),
            "dmabuf" | "dma-buf" | "dma_buf" => Ok(GdrMode::DmaBuf),
            "peermem" | "peer-mem" | "nvidia-peermem" => Ok(GdrMode::PeerMem),
            "staging" | "stage" => Ok(GdrMode::Staging),
            _ => Err(Error::InvalidArgument {
                what: "GDR mode",
                reason: format!("`{s}`: expected auto, dmabuf, peermem or staging"),
            }),
        }
    }
}

/// The path that GPU memory actually takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GdrPath {
    /// Registered as a dma-buf MR; the NIC reads GPU memory directly.
    DmaBuf,
    /// Registered through nvidia-peermem; the NIC reads GPU memory directly.
    PeerMem,
    /// Copied through host bounce buffers; the NIC reads host memory.
    Staging,
}

impl GdrPath {
    /// True for the paths where the NIC reads GPU memory itself.
    pub fn is_direct(self) -> bool {
        !matches!(self, GdrPath::Staging)
    }
}

impl fmt::Display for GdrPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GdrPath::DmaBuf => "dma-buf (GPUDirect RDMA)",
            GdrPath::PeerMem => "nvidia-peermem (GPUDirect RDMA)",
            GdrPath::Staging => "staging through host memory",
        })
    }
}

/// What a pointer is, per `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Device memory (`cuMemAlloc`, a memory pool, or VMM): what GPUDirect RDMA needs.
    Device,
    /// Managed (unified) memory (`cuMemAllocManaged`): can be staged, not registered.
    Managed,
    /// Page-locked host memory known to CUDA (`cuMemHostAlloc` / `cuMemHostRegister`).
    HostPinned,
    /// An address CUDA does not know: ordinary host memory.
    NotCuda,
    /// Could not be determined (the driver is missing or the query failed).
    Unknown,
}

impl fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemoryKind::Device => "device",
            MemoryKind::Managed => "managed (unified)",
            MemoryKind::HostPinned => "pinned host",
            MemoryKind::NotCuda => "ordinary host (unknown to CUDA)",
            MemoryKind::Unknown => "unknown",
        })
    }
}

/// One piece that is missing for a path, with what to do about it (its `Display`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Missing {
    /// The CUDA driver is not usable.
    CudaDriver,
    /// The buffer is not device memory (the kind it is instead).
    DeviceMemory(MemoryKind),
    /// The GPU does not support GPUDirect RDMA at all.
    GpuDirectRdma,
    /// dma-buf export is not supported by this GPU / driver / kernel.
    DmaBuf,
    /// The nvidia-peermem module is not loaded.
    PeerMem,
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::CudaDriver => f.write_str(
                "the CUDA driver (libcuda.so.1) is not usable: install the NVIDIA driver, check \
                 that nvidia-smi sees the GPU, and run containers with the NVIDIA container \
                 toolkit (--gpus all)",
            ),
            Missing::DeviceMemory(kind) => write!(
                f,
                "the buffer is {kind} memory, not device memory (cuPointerGetAttribute \
                 CU_POINTER_ATTRIBUTE_MEMORY_TYPE): allocate it with cuMemAlloc \
                 (gdr::DeviceAlloc) or a CudaStream; managed memory can only be staged, and \
                 host memory is registered directly with Pd::alloc_mr"
            ),
            Missing::GpuDirectRdma => f.write_str(
                "this GPU does not support GPUDirect RDMA \
                 (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 0; typical for consumer \
                 GPUs): use staging, or a data-center GPU",
            ),
            Missing::DmaBuf => f.write_str(
                "dma-buf export is not available (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 or \
                 cuMemGetHandleForAddressRange missing): it needs Linux >= 5.12, the NVIDIA open \
                 kernel modules (driver >= 515; the proprietary modules cannot export dma-bufs) \
                 and CUDA >= 11.7",
            ),
            Missing::PeerMem => f.write_str(
                "nvidia-peermem is not loaded (no /sys/module/nvidia_peermem): run \
                 `sudo modprobe nvidia-peermem` (it ships with the NVIDIA driver and needs an \
                 RDMA stack with peer-memory support, e.g. MLNX_OFED/DOCA-OFED)",
            ),
        }
    }
}
