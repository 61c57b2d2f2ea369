//! Loading libcuda without panicking, and the thin layer over the CUDA calls
//! this module makes.
//!
//! cudarc (with `dynamic-loading`) resolves every driver function lazily and
//! panics when libcuda, or one symbol in it, is missing. Every entry point of
//! [`crate::gdr`] therefore goes through [`driver`] first: it loads the
//! library once, checks that each symbol this module (and
//! `CudaContext::new`) calls is present, and runs `cuInit`; a failure becomes
//! [`GdrError::DriverNotAvailable`].

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};
use cudarc::driver::{CudaContext, DriverError};

use super::{GdrError, MemoryKind};
use crate::error::{Error, Result};

/// Symbols called by this module or by `CudaContext::new` / `CudaStream::synchronize`.
const REQUIRED: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuPointerGetAttribute",
    "cuPointerSetAttribute",
    "cuMemGetAddressRange_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemsetD8_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
];

/// The dma-buf export (CUDA 11.7+); its absence only disables that path.
const DMA_BUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";

/// What a successful load found.
#[derive(Debug)]
pub(crate) struct DriverState {
    /// `cuDriverGetVersion`, e.g. 12080.
    pub(crate) version: i32,
    /// Whether `cuMemGetHandleForAddressRange` exists.
    pub(crate) dma_buf_symbol: bool,
}

static STATE: OnceLock<std::result::Result<DriverState, String>> = OnceLock::new();

/// The loaded driver, or the typed "CUDA driver not available" error. Never panics.
pub(crate) fn driver() -> std::result::Result<&'static DriverState, GdrError> {
    match STATE.get_or_init(load) {
        Ok(state) => Ok(state),
        Err(detail) => Err(GdrError::DriverNotAvailable {
            detail: detail.clone(),
        }),
    }
}

fn load() -> std::result::Result<DriverState, String> {
    // SAFETY: dlopen()s the candidate names of libcuda and closes them again; loading
    // the NVIDIA driver library runs only its own initialisers and touches none of our memory.
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "libcuda.so could not be loaded (no NVIDIA driver installed, or it is not \
                    on the dynamic loader's path)"
                .to_owned(),
        );
    }
    // SAFETY: is_culib_present() just loaded one of the same candidates, so culib()
    // finds a library (it would panic only when none loads).
    let lib = unsafe { sys::culib() };
    let has = |name: &str| {
        // SAFETY: a dlsym lookup; the symbol is neither called nor dereferenced here,
        // so the pointer type given is irrelevant.
        unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
    };
    let missing: Vec<&str> = REQUIRED.iter().copied().filter(|n| !has(n)).collect();
    if !missing.is_empty() {
        return Err(format!(
            "libcuda lacks {} (the NVIDIA driver is too old; CUDA 11.7 or newer is needed)",
            missing.join(", ")
        ));
    }
    // SAFETY: the symbol exists (checked above); cuInit(0) has no memory preconditions.
    let rc = unsafe { sys::cuInit(0) };
    if rc != CUresult::CUDA_SUCCESS {
        let why = match rc {
            CUresult::CUDA_ERROR_NO_DEVICE => {
                "no NVIDIA GPU is visible (check nvidia-smi, CUDA_VISIBLE_DEVICES, and for \
                 containers --gpus / the NVIDIA container toolkit)"
            }
            CUresult::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => {
                "the user-space libcuda does not match the loaded nvidia kernel module \
                 (reboot or reload the driver after an upgrade)"
            }
            _ => "the driver failed to initialise (see dmesg for NVRM messages)",
        };
        return Err(format!("cuInit failed with {rc:?}: {why}"));
    }
    let mut version = 0;
    // SAFETY: symbol checked; writes one int into `version`.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    Ok(DriverState {
        version,
        dma_buf_symbol: has(DMA_BUF_SYMBOL),
    })
}

/// Maps a CUDA status to `Ok` or [`GdrError::Cuda`].
pub(crate) fn cu(call: &'static str, rc: CUresult) -> std::result::Result<(), GdrError> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(call, rc))
    }
}

/// [`GdrError::Cuda`] for a failed call.
pub(crate) fn cuda_error(call: &'static str, rc: CUresult) -> GdrError {
    GdrError::Cuda {
        call,
        code: rc as u32,
        name: format!("{rc:?}"),
    }
}

/// A cudarc safe-API error as [`GdrError::Cuda`].
pub(crate) fn cu_err(call: &'static str, e: DriverError) -> GdrError {
    cuda_error(call, e.0)
}

/// Checks that the CUDA driver can be used: libcuda loads, has every function
/// this module needs, and `cuInit` succeeds (so at least one GPU is visible).
///
/// Returns the driver version (`cuDriverGetVersion`, e.g. `12080` for 12.8).
/// Fails with [`GdrError::DriverNotAvailable`] (never a panic) otherwise.
pub fn check_driver() -> Result<i32> {
    Ok(driver()?.version)
}

/// Number of CUDA devices (`cuDeviceGetCount`).
pub fn device_count() -> Result<usize> {
    driver()?;
    let mut n = 0;
    // SAFETY: driver loaded and initialised; writes one int.
    cu("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Opens (retains) the primary context of GPU `ordinal` through cudarc.
///
/// Unlike calling `CudaContext::new` directly, this never panics on a machine
/// without libcuda: it fails with [`GdrError::DriverNotAvailable`], and with
/// [`Error::InvalidArgument`] for an ordinal that does not exist.
pub fn cuda_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::InvalidArgument {
            what: "CUDA device",
            reason: format!("ordinal {ordinal} does not exist ({count} GPU(s) visible)"),
        });
    }
    CudaContext::new(ordinal).map_err(|e| cu_err("cuDevicePrimaryCtxRetain", e).into())
}

/// Reads an attribute of a device pointer into an 8-byte zeroed buffer (every
/// attribute this module reads is at most 8 bytes: an int, a bool or an enum).
fn pointer_attribute(
    attr: sys::CUpointer_attribute,
    ptr: CUdeviceptr,
) -> std::result::Result<[u8; 8], CUresult> {
    let mut buf = 0u64;
    // SAFETY: driver loaded (callers went through driver()); `buf` has room for the
    // at most 8 bytes the driver writes for the attributes read here.
    let rc = unsafe { sys::cuPointerGetAttribute((&raw mut buf).cast(), attr, ptr) };
    if rc == CUresult::CUDA_SUCCESS {
        Ok(buf.to_ne_bytes())
    } else {
        Err(rc)
    }
}

fn as_bool(b: [u8; 8]) -> bool {
    b.iter().any(|&x| x != 0)
}

fn as_u32(b: [u8; 8]) -> u32 {
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

/// What kind of memory `ptr` is, per `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` and
/// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
pub(crate) fn memory_kind_of(ptr: CUdeviceptr) -> MemoryKind {
    use sys::CUpointer_attribute::*;
    let ty = match pointer_attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr) {
        Ok(b) => as_u32(b),
        // "ptr was not allocated by, mapped by, or registered with" CUDA.
        Err(CUresult::CUDA_ERROR_INVALID_VALUE) => return MemoryKind::NotCuda,
        Err(_) => return MemoryKind::Unknown,
    };
    let managed = pointer_attribute(CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
        .map(as_bool)
        .unwrap_or(false);
    if managed {
        return MemoryKind::Managed;
    }
    match ty {
        t if t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryKind::Device,
        t if t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryKind::HostPinned,
        t if t == sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32 => MemoryKind::Managed,
        _ => MemoryKind::Unknown,
    }
}

/// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`, `None` when it cannot be read.
pub(crate) fn allocation_rdma_capable(ptr: CUdeviceptr) -> Option<bool> {
    pointer_attribute(
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
        ptr,
    )
    .ok()
    .map(as_bool)
}

/// `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` of the allocation containing `ptr`.
pub(crate) fn sync_memops_of(ptr: CUdeviceptr) -> std::result::Result<bool, GdrError> {
    pointer_attribute(
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
        ptr,
    )
    .map(as_bool)
    .map_err(|rc| cuda_error("cuPointerGetAttribute(SYNC_MEMOPS)", rc))
}

/// Sets `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on the allocation containing `ptr`.
pub(crate) fn set_sync_memops_on(ptr: CUdeviceptr) -> std::result::Result<(), GdrError> {
    let one: u32 = 1;
    // SAFETY: driver loaded; the driver reads one unsigned int from `one`.
    let rc = unsafe {
        sys::cuPointerSetAttribute(
            (&raw const one).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            ptr,
        )
    };
    cu("cuPointerSetAttribute(SYNC_MEMOPS)", rc)
}

/// The CUDA device ordinal `ptr` was allocated on.
pub(crate) fn device_of(ptr: CUdeviceptr) -> Option<sys::CUdevice> {
    let ordinal = pointer_attribute(
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        ptr,
    )
    .ok()
    .map(|b| as_u32(b) as i32)?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: driver initialised; writes one CUdevice.
    let rc = unsafe { sys::cuDeviceGet(&mut dev, ordinal) };
    (rc == CUresult::CUDA_SUCCESS).then_some(dev)
}

/// A device attribute, `None` when the driver does not know it.
pub(crate) fn device_attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Option<i32> {
    let mut v = 0;
    // SAFETY: driver initialised; `dev` came from cuDeviceGet; writes one int.
    let rc = unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) };
    (rc == CUresult::CUDA_SUCCESS).then_some(v)
}

/// The allocation (`cuMemGetAddressRange`) that contains `ptr`: base and size.
pub(crate) fn allocation_of(ptr: CUdeviceptr) -> Option<(CUdeviceptr, usize)> {
    let mut base: CUdeviceptr = 0;
    let mut size = 0usize;
    // SAFETY: driver initialised; writes one pointer and one size.
    let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    (rc == CUresult::CUDA_SUCCESS).then_some((base, size))
}
