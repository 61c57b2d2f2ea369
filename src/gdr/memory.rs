//! Device memory as this module sees it: [`DeviceMemory`], plain `cuMemAlloc`
//! allocations ([`DeviceAlloc`]), foreign ranges ([`DeviceRange`]) and the
//! synchronous copies the staging path is built from.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::GdrError;
use super::driver::{cu, cu_err, driver};
use crate::error::{Error, Result};

/// Device memory that can back a registration or a transfer: a CUDA
/// allocation (or part of one) together with whatever keeps it allocated.
///
/// Implemented for cudarc's [`CudaSlice`], for [`DeviceAlloc`] and
/// [`DeviceRange`], and for `Arc`/`Box` of any of them (pass an `Arc` and keep
/// a clone to go on launching kernels on the memory while it is registered).
///
/// # Safety
/// `device_range` returns the same `(address, length)` on every call, and that
/// range is a live CUDA allocation (or part of one) for as long as the value
/// lives: registrations keep the value alive and the NIC accesses the range
/// until they are gone. `stream`, if given, belongs to the context the memory
/// was allocated in.
///
/// The range must be valid for *any* bytes: a peer's RDMA WRITE or atomic, a
/// RECV, or [`copy_to_device`] may store arbitrary bytes anywhere in it, so
/// every typed view of the memory (e.g. a `CudaSlice<T>` that safe code can
/// copy back as `T`s) must have an element type for which every bit pattern
/// is a valid value (see [`PlainBytes`]).
pub unsafe trait DeviceMemory: Send + Sync + 'static {
    /// Device address of the first byte and length in bytes.
    fn device_range(&self) -> (CUdeviceptr, usize);

    /// The stream whose work produces or consumes this memory. It is
    /// synchronized before the memory is registered, before a transfer reads
    /// it, and its context is bound to the calling thread before CUDA calls.
    fn stream(&self) -> Option<&Arc<CudaStream>>;
}

mod sealed {
    pub trait Sealed {}
}

/// Element types of device memory this module will hand to the NIC or fill
/// with bytes: every bit pattern of `size_of::<T>()` bytes is a valid `T`, and
/// `T` has no padding.
///
/// A registered `CudaSlice<T>` can be filled with arbitrary bytes by a peer
/// (RDMA WRITE, atomics, a RECV) or by [`copy_to_device`], after which
/// cudarc's safe API (`clone_dtoh`, kernels) reads them back as `T`s; for a
/// type like `bool` or `char` that would produce invalid values. So
/// [`DeviceMemory`] is implemented only for `CudaSlice<T>` with `T` among:
/// `u8`..`u128`, `usize`, `i8`..`i128`, `isize`, `f32`, `f64`, and arrays
/// `[T; N]` of these. (For untyped bytes use [`DeviceAlloc`].)
///
/// Sealed: it cannot be implemented outside this crate.
pub trait PlainBytes: sealed::Sealed + Copy + Send + Sync + 'static {}

macro_rules! plain_bytes {
    ($($t:ty),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl PlainBytes for $t {}
    )*};
}
plain_bytes!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize, f32, f64
);
impl<T: PlainBytes, const N: usize> sealed::Sealed for [T; N] {}
impl<T: PlainBytes, const N: usize> PlainBytes for [T; N] {}

// SAFETY: a CudaSlice owns its allocation until dropped; its pointer and length never
// change, so the range stays live and fixed while a registration holds the slice. The
// NIC (a peer's WRITE or atomic, a RECV) and copy_to_device may store arbitrary bytes in
// it, which cudarc's safe API then reads back as `T`s: `T: PlainBytes` makes every such
// byte pattern a valid `[T]` (integers and floats of every bit pattern, arrays of them,
// no padding), so no invalid value can come out of it.
unsafe impl<T: PlainBytes> DeviceMemory for CudaSlice<T> {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        // device_ptr orders this (the slice's own) stream after pending writes and
        // records a read when `_record` drops; both only touch CUDA events.
        let (ptr, _record) = self.device_ptr(self.stream());
        (ptr, self.num_bytes())
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        Some(CudaSlice::stream(self))
    }
}

// SAFETY: the Arc keeps the inner value (and so its allocation) alive; delegates.
unsafe impl<D: DeviceMemory + ?Sized> DeviceMemory for Arc<D> {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        (**self).device_range()
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        (**self).stream()
    }
}

// SAFETY: the Box keeps the inner value alive; delegates.
unsafe impl<D: DeviceMemory + ?Sized> DeviceMemory for Box<D> {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        (**self).device_range()
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        (**self).stream()
    }
}

/// Device memory from `cuMemAlloc` (not a stream-ordered pool), freed with
/// `cuMemFree` on drop.
///
/// cudarc's `CudaStream::alloc` uses the stream-ordered allocator where the
/// GPU has one; plain `cuMemAlloc` memory is what every GPUDirect RDMA stack
/// documents and tests, so the examples use this.
pub struct DeviceAlloc {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceAlloc {
    /// Allocates `len` bytes (rounded up to [`GPU_PAGE_SIZE`](super::GPU_PAGE_SIZE)
    /// inside, so the buffer never shares a GPU page with another allocation)
    /// in the context of `stream`, and zeroes them.
    pub fn new(stream: &Arc<CudaStream>, len: usize) -> Result<DeviceAlloc> {
        driver()?;
        if len == 0 {
            return Err(Error::InvalidArgument {
                what: "device allocation length",
                reason: "it is 0, and it must be at least 1 byte".into(),
            });
        }
        let rounded = len
            .checked_next_multiple_of(super::GPU_PAGE_SIZE)
            .ok_or_else(|| Error::InvalidArgument {
                what: "device allocation length",
                reason: format!("{len} bytes is too large"),
            })?;
        bind(Some(stream))?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: driver loaded, context bound; writes one device pointer.
        cu("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, rounded)
        })?;
        let alloc = DeviceAlloc {
            ptr,
            len,
            stream: stream.clone(),
        };
        // SAFETY: [ptr, ptr+rounded) is the device allocation just made.
        cu("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, rounded) })?;
        // A memset of device memory may run asynchronously on the legacy stream;
        // finish it so work on any (also non-blocking) stream sees zeros.
        // SAFETY: no arguments; the context is bound.
        cu("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })?;
        Ok(alloc)
    }

    /// The device address.
    pub fn device_ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Length in bytes (as asked for).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty allocation (never: `new` refuses 0 bytes).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream it was allocated for.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // Errors are ignored: Drop never panics. cuMemFree waits for work using it.
        let _ = bind(Some(&self.stream));
        // SAFETY: ptr came from cuMemAlloc and is freed once; registrations of it held
        // this value alive, so none is left.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

impl fmt::Debug for DeviceAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceAlloc")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: the allocation lives until drop; ptr and len never change; it is untyped
// bytes, so any bytes written into it are valid.
unsafe impl DeviceMemory for DeviceAlloc {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        (self.ptr, self.len)
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        Some(&self.stream)
    }
}

/// A range of device memory owned elsewhere (a raw `CUdeviceptr` range),
/// kept alive by an owner value.
pub struct DeviceRange {
    ptr: CUdeviceptr,
    len: usize,
    stream: Option<Arc<CudaStream>>,
    _owner: Box<dyn Any + Send + Sync>,
}

impl DeviceRange {
    /// Wraps `[ptr, ptr+len)`.
    ///
    /// # Safety
    /// The range is CUDA device memory (or managed memory) that stays
    /// allocated until `owner` is dropped; `stream`, if given, belongs to the
    /// context it was allocated in. Any bytes may be written into it (by a
    /// peer through a registration, or [`copy_to_device`]): whatever reads it
    /// as typed values (e.g. a `CudaSlice<bool>` it was cut from) must accept
    /// every bit pattern (see [`PlainBytes`]).
    pub unsafe fn new(
        ptr: CUdeviceptr,
        len: usize,
        stream: Option<Arc<CudaStream>>,
        owner: Box<dyn Any + Send + Sync>,
    ) -> DeviceRange {
        DeviceRange {
            ptr,
            len,
            stream,
            _owner: owner,
        }
    }
}

impl fmt::Debug for DeviceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceRange")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

// SAFETY: DeviceRange::new's contract (live, fixed range; valid for any bytes).
unsafe impl DeviceMemory for DeviceRange {
    fn device_range(&self) -> (CUdeviceptr, usize) {
        (self.ptr, self.len)
    }

    fn stream(&self) -> Option<&Arc<CudaStream>> {
        self.stream.as_ref()
    }
}

/// Binds the stream's context to the calling thread.
pub(crate) fn bind(stream: Option<&Arc<CudaStream>>) -> std::result::Result<(), GdrError> {
    match stream {
        Some(s) => s
            .context()
            .bind_to_thread()
            .map_err(|e| cu_err("cuCtxSetCurrent", e)),
        None => Ok(()),
    }
}

/// Waits for the work queued on the memory's stream (kernels writing it).
pub(crate) fn sync_stream(stream: Option<&Arc<CudaStream>>) -> std::result::Result<(), GdrError> {
    match stream {
        Some(s) => s
            .synchronize()
            .map_err(|e| cu_err("cuStreamSynchronize", e)),
        None => Ok(()),
    }
}

/// `[offset, offset+n)` of a `len`-byte buffer, as a device address.
pub(crate) fn sub_range(
    ptr: CUdeviceptr,
    len: usize,
    offset: usize,
    n: usize,
) -> Result<CUdeviceptr> {
    match offset.checked_add(n) {
        Some(end) if end <= len => {
            ptr.checked_add(offset as u64)
                .ok_or_else(|| Error::InvalidArgument {
                    what: "device range",
                    reason: format!("{ptr:#x} + {offset} overflows the address space"),
                })
        }
        _ => Err(Error::InvalidArgument {
            what: "device range",
            reason: format!("[{offset}, {offset}+{n}) is outside the {len}-byte device buffer"),
        }),
    }
}

/// Synchronous device-to-host copy (`cuMemcpyDtoH`): returns when `dst` holds the bytes.
///
/// The caller has checked that `[src, src+dst.len())` lies in live device memory
/// and ordered it after the GPU work writing it.
pub(crate) fn dtoh(dst: &mut [u8], src: CUdeviceptr) -> std::result::Result<(), GdrError> {
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: dst is an exclusively borrowed host buffer of dst.len() bytes; the
    // source range is live device memory (caller); cuMemcpyDtoH is synchronous for
    // device-to-host copies, so nothing writes dst after it returns.
    cu("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    })
}

/// Host-to-device copy (`cuMemcpyHtoD`) followed by `cuCtxSynchronize`, so the
/// bytes are in device memory, visible to every stream, when it returns.
pub(crate) fn htod(dst: CUdeviceptr, src: &[u8]) -> std::result::Result<(), GdrError> {
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: src is a borrowed host buffer of src.len() bytes; the destination is
    // live device memory (caller); cuMemcpyHtoD has consumed the source when it returns.
    cu("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
    })?;
    // SAFETY: no arguments; waits for the copy to land.
    cu("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// Copies `dst.len()` bytes at `offset` of `mem` into host memory, after the
/// work queued on the memory's stream finished. The staging path's copy.
pub fn copy_from_device<D: DeviceMemory + ?Sized>(
    mem: &D,
    offset: usize,
    dst: &mut [u8],
) -> Result<()> {
    driver()?;
    let (ptr, len) = mem.device_range();
    let src = sub_range(ptr, len, offset, dst.len())?;
    bind(mem.stream())?;
    sync_stream(mem.stream())?;
    Ok(dtoh(dst, src)?)
}

/// Copies `src` into `mem` at `offset`, after the work queued on the memory's
/// stream finished; the bytes are in device memory when it returns.
///
/// Only that stream is waited for: a read of the same memory still queued on
/// another stream (a `memcpy_dtoh` on a second non-blocking stream, say) can
/// see some old and some new bytes. Synchronise such streams first.
pub fn copy_to_device<D: DeviceMemory + ?Sized>(
    mem: &mut D,
    offset: usize,
    src: &[u8],
) -> Result<()> {
    driver()?;
    let (ptr, len) = mem.device_range();
    let dst = sub_range(ptr, len, offset, src.len())?;
    bind(mem.stream())?;
    sync_stream(mem.stream())?;
    Ok(htod(dst, src)?)
}
