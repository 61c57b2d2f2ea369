//! Choosing how GPU memory reaches the NIC: a pure function from what was
//! observed ([`Capabilities`]) to what to try ([`Decision`]).

use crate::values::gdr::{GdrMode, GdrPath, MemoryKind, Missing};

/// What was observed about the driver, the GPU, the buffer and the kernel.
/// The input of [`decide`]; [`probe`](super::probe) fills it in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// libcuda loads, has the needed functions, and `cuInit` succeeds.
    pub driver: bool,
    /// What the buffer is.
    pub memory: MemoryKind,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` of the buffer's GPU
    /// (`None`: not reported). `Some(false)` rules out both direct paths.
    pub gpudirect_rdma: Option<bool>,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` of the allocation.
    /// Reported in errors but deliberately **not** used by [`decide`]: drivers
    /// disagree on it for stream-ordered pool memory, and a wrong "no" would
    /// refuse a path that works; a registration that really cannot work fails
    /// at the verbs call and `Auto` moves on.
    pub allocation_rdma_capable: Option<bool>,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` is set and libcuda exports
    /// `cuMemGetHandleForAddressRange`.
    pub dma_buf: bool,
    /// `/sys/module/nvidia_peermem` (or the older `nv_peer_mem`) exists.
    pub peermem: bool,
}

impl Capabilities {
    /// What is known when the CUDA driver is missing: nothing works.
    pub const NO_DRIVER: Capabilities = Capabilities {
        driver: false,
        memory: MemoryKind::Unknown,
        gpudirect_rdma: None,
        allocation_rdma_capable: None,
        dma_buf: false,
        peermem: false,
    };
}

/// What [`decide`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Try these paths in this order (the first that works is used).
    /// `skipped` names what rules out the paths the mode would otherwise prefer.
    Try {
        /// Non-empty, best first: DmaBuf before PeerMem before Staging.
        paths: Vec<GdrPath>,
        /// Why better paths are not in the list.
        skipped: Vec<Missing>,
    },
    /// Nothing can work: every missing piece.
    Refuse(Vec<Missing>),
}

impl Decision {
    /// The paths to try (empty when refused).
    pub fn paths(&self) -> &[GdrPath] {
        match self {
            Decision::Try { paths, .. } => paths,
            Decision::Refuse(_) => &[],
        }
    }

    /// The missing pieces (why paths were skipped, or why nothing works).
    pub fn missing(&self) -> &[Missing] {
        match self {
            Decision::Try { skipped, .. } => skipped,
            Decision::Refuse(m) => m,
        }
    }
}

/// Decides which paths to try for `mode` given what was observed. Pure: no
/// I/O, the same answer for the same input.
///
/// * No CUDA driver: refused (even staging copies need it).
/// * Memory that is neither device nor managed: refused.
/// * Direct paths (dma-buf, peer-mem) need device memory and a GPU that does
///   not deny GPUDirect RDMA; dma-buf also needs dma-buf support, peer-mem the
///   loaded module. `Auto` tries dma-buf, then peer-mem, then staging.
/// * Staging works for device and managed memory with `Auto` and `Staging`.
pub fn decide(mode: GdrMode, caps: &Capabilities) -> Decision {
    if !caps.driver {
        return Decision::Refuse(vec![Missing::CudaDriver]);
    }
    if !matches!(caps.memory, MemoryKind::Device | MemoryKind::Managed) {
        return Decision::Refuse(vec![Missing::DeviceMemory(caps.memory)]);
    }
    let mut paths = Vec::new();
    let mut skipped = Vec::new();
    if mode != GdrMode::Staging {
        if caps.memory != MemoryKind::Device {
            skipped.push(Missing::DeviceMemory(caps.memory));
        } else if caps.gpudirect_rdma == Some(false) {
            skipped.push(Missing::GpuDirectRdma);
        } else {
            if matches!(mode, GdrMode::Auto | GdrMode::DmaBuf) {
                if caps.dma_buf {
                    paths.push(GdrPath::DmaBuf);
                } else {
                    skipped.push(Missing::DmaBuf);
                }
            }
            if matches!(mode, GdrMode::Auto | GdrMode::PeerMem) {
                if caps.peermem {
                    paths.push(GdrPath::PeerMem);
                } else {
                    skipped.push(Missing::PeerMem);
                }
            }
        }
    }
    if matches!(mode, GdrMode::Auto | GdrMode::Staging) {
        paths.push(GdrPath::Staging);
    }
    if paths.is_empty() {
        Decision::Refuse(skipped)
    } else {
        Decision::Try { paths, skipped }
    }
}
