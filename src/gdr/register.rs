//! Registering device memory with the NIC: dma-buf and nvidia-peermem.

use std::fmt;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};

use super::driver::{
    allocation_of, allocation_rdma_capable, cu, device_attribute, device_of, driver,
    memory_kind_of, set_sync_memops_on,
};
use super::memory::{bind, sub_range, sync_stream};
use super::plan::PathPlan;
use super::select::Capabilities;
#[cfg(doc)]
use super::select::decide;
use super::{AttemptFailure, DeviceMemory, GdrError};
use crate::error::{Error, Result, last_errno};
use crate::ffi;
use crate::mr::{AccessFlags, Mr, Region, page_size, reg_error};
use crate::pd::Pd;
use crate::values::gdr::{GdrMode, GdrPath, MemoryKind, Missing};

/// The GPU page size GPUDirect RDMA maps in (64 KiB on every NVIDIA GPU so far).
///
/// dma-buf exports are aligned outwards to this (and never to less than the
/// host page size, which `cuMemGetHandleForAddressRange` requires).
pub const GPU_PAGE_SIZE: usize = 64 << 10;

/// The page-aligned device range exported as a dma-buf to register `[ptr, ptr+len)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExportWindow {
    /// First exported device address (aligned).
    pub base: CUdeviceptr,
    /// Exported length in bytes (aligned).
    pub size: usize,
    /// `ptr - base`: where the registered bytes start inside the dma-buf (the
    /// `offset` argument of `ibv_reg_dmabuf_mr`).
    pub offset: u64,
}

/// Computes the export window for `[ptr, ptr+len)`. Pure.
///
/// The window is `[ptr, ptr+len)` aligned outwards to `max(GPU_PAGE_SIZE,
/// host_page)`. Where that would leave the containing `allocation` (base,
/// size; from `cuMemGetAddressRange`), that edge is aligned to `host_page`
/// only. A `host_page` that is not a power of two is rounded up to one.
/// `None` when the range, the page size or the window overflows.
pub fn export_window(
    ptr: CUdeviceptr,
    len: usize,
    allocation: Option<(CUdeviceptr, usize)>,
    host_page: usize,
) -> Option<ExportWindow> {
    let host_page = u64::try_from(host_page.max(1))
        .ok()?
        .checked_next_power_of_two()?;
    let align = host_page.max(GPU_PAGE_SIZE as u64);
    let end = ptr.checked_add(len as u64)?;
    let mut lo = ptr & !(align - 1);
    let mut hi = end.checked_next_multiple_of(align)?;
    if let Some((base, size)) = allocation {
        let alloc_end = base.checked_add(size as u64)?;
        if lo < base {
            lo = ptr & !(host_page - 1);
        }
        if hi > alloc_end {
            hi = end.checked_next_multiple_of(host_page)?;
        }
    }
    Some(ExportWindow {
        base: lo,
        size: usize::try_from(hi - lo).ok()?,
        offset: ptr - lo,
    })
}

/// A dma-buf exported from device memory: the file descriptor (closed on
/// drop) and the window it covers.
#[derive(Debug)]
pub struct DmaBufExport {
    /// The dma-buf file descriptor.
    pub fd: OwnedFd,
    /// The exported device range.
    pub window: ExportWindow,
}

/// Exports `[offset, offset+len)` of `mem` as a dma-buf (`cuMemGetHandleForAddressRange`)
/// (`cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`),
/// aligned as [`export_window`] describes.
///
/// The fd does not keep the memory allocated: keep `mem` alive while anything
/// (e.g. an MR) uses it.
#[doc(alias = "cuMemGetHandleForAddressRange")]
pub fn export_dma_buf<D: DeviceMemory + ?Sized>(
    mem: &D,
    offset: usize,
    len: usize,
) -> Result<DmaBufExport> {
    let state = driver()?;
    let (ptr, total) = mem.device_range();
    let start = sub_range(ptr, total, offset, len)?;
    if len == 0 {
        return Err(Error::InvalidArgument {
            what: "dma-buf length",
            reason: "it is 0, and it must be at least 1 byte".into(),
        });
    }
    if !state.dma_buf_symbol {
        return Err(GdrError::NoPath {
            mode: GdrMode::DmaBuf,
            missing: vec![Missing::DmaBuf],
            failures: Vec::new(),
        }
        .into());
    }
    bind(mem.stream())?;
    Ok(export_range(start, len)?)
}

fn export_range(ptr: CUdeviceptr, len: usize) -> std::result::Result<DmaBufExport, GdrError> {
    let window =
        export_window(ptr, len, allocation_of(ptr), page_size()).ok_or_else(|| GdrError::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as u32,
            name: "address range overflows".into(),
        })?;
    let mut fd: libc::c_int = -1;
    // SAFETY: driver loaded and the symbol present (callers checked); the driver writes
    // one int (the new fd) into `fd`; the window lies in memory the caller keeps alive.
    cu("cuMemGetHandleForAddressRange", unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&raw mut fd).cast(),
            window.base,
            window.size,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    })?;
    if fd < 0 {
        return Err(GdrError::Cuda {
            call: "cuMemGetHandleForAddressRange",
            code: 0,
            name: format!("returned success with fd {fd}"),
        });
    }
    // SAFETY: the driver just created this fd for us and nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(DmaBufExport { fd, window })
}

/// Whether the nvidia-peermem module (or the older nv_peer_mem) is loaded.
pub fn peermem_loaded() -> bool {
    ["/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

/// Observes everything [`decide`] needs about `mem` on this machine. Never
/// fails: without a CUDA driver it returns [`Capabilities::NO_DRIVER`].
pub fn probe<D: DeviceMemory + ?Sized>(mem: &D) -> Capabilities {
    let Ok(state) = driver() else {
        return Capabilities::NO_DRIVER;
    };
    let _ = bind(mem.stream());
    let (ptr, _) = mem.device_range();
    let memory = memory_kind_of(ptr);
    let dev = device_of(ptr).or_else(|| mem.stream().map(|s| s.context().cu_device()));
    let attr = |a| dev.and_then(|d| device_attribute(d, a)).map(|v| v != 0);
    use sys::CUdevice_attribute::*;
    Capabilities {
        driver: true,
        memory,
        gpudirect_rdma: attr(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED),
        allocation_rdma_capable: if memory == MemoryKind::Device {
            allocation_rdma_capable(ptr)
        } else {
            None
        },
        dma_buf: state.dma_buf_symbol && attr(CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) == Some(true),
        peermem: peermem_loaded(),
    }
}

/// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation behind `mem`, so
/// synchronous CUDA copies into it complete before they return (what a NIC
/// reading the memory afterwards needs).
pub fn set_sync_memops<D: DeviceMemory + ?Sized>(mem: &D) -> Result<()> {
    driver()?;
    bind(mem.stream())?;
    Ok(set_sync_memops_on(mem.device_range().0)?)
}

/// Reads `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` of the allocation behind `mem`.
pub fn sync_memops<D: DeviceMemory + ?Sized>(mem: &D) -> Result<bool> {
    driver()?;
    bind(mem.stream())?;
    Ok(super::driver::sync_memops_of(mem.device_range().0)?)
}

/// Device memory registered with the NIC: the [`Mr`] and how it was done.
pub struct Registration {
    /// The registration. Its [`addr`](Mr::addr) is the device address (the
    /// IOVA peers target), it keeps the device memory alive, and it never
    /// hands out a host slice ([`Mr::as_slice`] and friends refuse device memory).
    pub mr: Mr,
    /// Which path registered it.
    pub path: GdrPath,
    /// Whether `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` could be set on the allocation.
    pub sync_memops: bool,
    /// What ruled out the paths the mode would have preferred.
    pub skipped: Vec<Missing>,
    /// Paths that were tried and failed before `path` worked.
    pub failures: Vec<AttemptFailure>,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("mr", &self.mr)
            .field("path", &self.path)
            .field("sync_memops", &self.sync_memops)
            .field("skipped", &self.skipped)
            .field("failures", &self.failures)
            .finish()
    }
}

/// Registers device memory with the NIC (`ibv_reg_dmabuf_mr` or `ibv_reg_mr`; GPUDirect RDMA) so peers can READ /
/// WRITE it and it can be a local SGE, choosing the path with `mode`:
///
/// * [`GdrMode::DmaBuf`]: exports the range as a dma-buf and registers it with
///   `ibv_reg_dmabuf_mr`; the fd is closed once the MR holds the dma-buf.
/// * [`GdrMode::PeerMem`]: `ibv_reg_mr` on the device pointer (nvidia-peermem).
/// * [`GdrMode::Auto`]: dma-buf when the GPU supports it and the verbs call
///   succeeds, else peer-mem; never staging (that is not a registration; see
///   [`GpuBuffer`](super::GpuBuffer)).
///
/// The MR's IOVA is the device address, so a peer targets
/// [`Mr::remote`]`.addr` like any other MR. `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`
/// is set on the allocation first (recorded in [`Registration::sync_memops`]).
/// Before the memory's stream is synchronized it is not registered, but
/// **ordering later GPU work against RDMA is the caller's job**: synchronize
/// the stream (or an event) that wrote the data before posting a WRITE from
/// it, and do not let kernels write what the NIC is still reading.
///
/// Errors: [`GdrError::DriverNotAvailable`] without libcuda, [`GdrError::NoPath`]
/// listing each missing piece and each failed attempt (with what to do).
#[doc(alias = "ibv_reg_dmabuf_mr")]
#[doc(alias = "ibv_reg_mr")]
pub fn register(
    pd: &Pd,
    mem: impl DeviceMemory,
    access: AccessFlags,
    mode: GdrMode,
) -> Result<Registration> {
    register_shared(pd, Arc::new(mem), access, mode)
}

pub(crate) fn register_shared(
    pd: &Pd,
    mem: Arc<dyn DeviceMemory>,
    access: AccessFlags,
    mode: GdrMode,
) -> Result<Registration> {
    driver()?;
    if mode == GdrMode::Staging {
        return Err(Error::InvalidArgument {
            what: "GDR mode",
            reason: "staging is not a registration: use GpuBuffer to send device memory \
                     through host bounce buffers"
                .into(),
        });
    }
    let (ptr, len) = mem.device_range();
    if len == 0 {
        return Err(Error::InvalidArgument {
            what: "device memory length",
            reason: "it is 0, and it must be at least 1 byte".into(),
        });
    }
    let plan = PathPlan::for_memory(&*mem, mode)?.direct_only()?;
    bind(mem.stream())?;
    // A stream-ordered allocation exists only once its stream reached it.
    sync_stream(mem.stream())?;
    let sync_memops = set_sync_memops_on(ptr).is_ok();
    let chosen = plan.first_working(|path| register_direct(pd, &mem, ptr, len, access, path))?;
    Ok(Registration {
        mr: chosen.value,
        path: chosen.path,
        sync_memops,
        skipped: chosen.skipped,
        failures: chosen.failures,
    })
}

/// Registers `[ptr, ptr+len)` of `mem` on one direct path.
pub(crate) fn register_direct(
    pd: &Pd,
    mem: &Arc<dyn DeviceMemory>,
    ptr: CUdeviceptr,
    len: usize,
    access: AccessFlags,
    path: GdrPath,
) -> Result<Mr> {
    let host_ptr = NonNull::new(ptr as usize as *mut u8).ok_or_else(|| Error::InvalidArgument {
        what: "device pointer",
        reason: "it is null; pass the pointer of a live device allocation".into(),
    })?;
    let raw = match path {
        GdrPath::DmaBuf => {
            let export = export_range(ptr, len)?;
            // Refused rather than widened: bit 31 has no meaning to the kernel.
            let access_bits = i32::try_from(access.bits()).map_err(|_| Error::InvalidArgument {
                what: "access flags",
                reason: format!(
                    "{:#x} has bit 31 set, which no access flag uses",
                    access.bits()
                ),
            })?;
            // SAFETY: valid PD; `export.fd` is a live dma-buf of `export.window.size`
            // bytes and [offset, offset+len) lies inside it by construction of the
            // window; the IOVA is the device address itself. The kernel takes its own
            // reference to the dma-buf, so the fd may be closed afterwards.
            let raw = unsafe {
                ffi::ibv_reg_dmabuf_mr(
                    pd.as_raw(),
                    export.window.offset,
                    len,
                    ptr,
                    export.fd.as_raw_fd(),
                    access_bits,
                )?
            };
            let err = last_errno();
            drop(export); // closes the fd: the MR (if any) holds the dma-buf now
            NonNull::new(raw).ok_or_else(|| reg_error("ibv_reg_dmabuf_mr", len, err))?
        }
        GdrPath::PeerMem => {
            // SAFETY: valid PD. The kernel pins [ptr, ptr+len) through the
            // nvidia-peermem client (or refuses, touching nothing); the memory stays
            // allocated while the MR lives because the MR keeps `mem` alive.
            let raw = unsafe {
                ffi::ibv_reg_mr_iova2(
                    pd.as_raw(),
                    host_ptr.as_ptr().cast(),
                    len,
                    ptr,
                    access.bits(),
                )
            };
            NonNull::new(raw).ok_or_else(|| reg_error("ibv_reg_mr", len, last_errno()))?
        }
        GdrPath::Staging => {
            return Err(Error::InvalidArgument {
                what: "GDR path",
                reason: "staging is not a registration".into(),
            });
        }
    };
    // SAFETY: `raw` registers exactly [ptr, ptr+len) in `pd` with IOVA ptr and is
    // handed over; the keepalive (a clone of `mem`) keeps that memory allocated until
    // the region is deregistered and dropped.
    Ok(unsafe {
        Region::from_device_registration(pd, raw, host_ptr, len, access, Box::new(mem.clone()))
    })
}
