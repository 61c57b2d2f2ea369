//! Registered memory: `Mr` owns its bytes and its registration.
//!
//! # Ownership model
//! A registration ([`Mr::new`]) allocates page-aligned memory and registers it.
//! An `Mr` value is an *exclusive* view of a byte range of that registration:
//! [`Mr::split_off`] cuts it into disjoint `Mr`s that share the registration
//! (like `bytes::BytesMut`), and [`Mr::unsplit`] joins neighbours back. The
//! memory is deregistered and freed when the last piece is dropped.
//!
//! Posting a work request *moves* the `Mr` into the queue pair; polling its
//! completion gives it back (see [`crate::qp`]). Because the value is moved,
//! safe code cannot read, write, free or reuse a buffer while the NIC owns it.
//! Buffers the NIC only reads (SEND / WRITE sources) can be shared instead:
//! [`Mr::freeze`] turns an `Mr` into a [`SharedMr`] that clones cheaply and can
//! be posted many times at once; [`SharedMr::try_unfreeze`] recovers the `Mr`
//! when every clone has come back.
//!
//! # Remotely writable memory
//! A region registered with `REMOTE_WRITE` or `REMOTE_ATOMIC` can be changed
//! by a peer at any moment, outside Rust's knowledge. Handing out `&[u8]` or
//! `&mut [u8]` to such memory would let the compiler assume it does not change,
//! so [`Mr::as_slice`] refuses with [`Error::RemotelyWritable`]; use
//! [`Mr::read_at`], [`Mr::to_vec`] and [`Mr::write_at`], which copy through raw
//! pointers without ever creating a reference to the shared bytes (the same
//! model as memory shared with another process). A copy taken while a peer is
//! writing may observe a mix of old and new bytes; order it after the
//! completion that announces the data (e.g. a WRITE_WITH_IMM receive).

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result, last_errno, memlock_limit};
use crate::ffi;
use crate::pd::Pd;

bitflags::bitflags! {
    /// Memory access rights (`ibv_access_flags`).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// The local NIC may write (needed for RECV targets and READ destinations).
        const LOCAL_WRITE = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        /// Peers may RDMA WRITE into it (needs LOCAL_WRITE).
        const REMOTE_WRITE = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        /// Peers may RDMA READ it.
        const REMOTE_READ = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        /// Peers may run atomics on it (needs LOCAL_WRITE).
        const REMOTE_ATOMIC = ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
        /// Memory windows may be bound to it.
        const MW_BIND = ffi::ibv_access_flags::IBV_ACCESS_MW_BIND.0;
        /// Zero-based addressing (remote addresses are offsets).
        const ZERO_BASED = ffi::ibv_access_flags::IBV_ACCESS_ZERO_BASED.0;
        /// On-demand paging (no pinning); devices without ODP refuse it.
        const ON_DEMAND = ffi::ibv_access_flags::IBV_ACCESS_ON_DEMAND.0;
        /// Backed by huge pages.
        const HUGETLB = ffi::ibv_access_flags::IBV_ACCESS_HUGETLB.0;
        /// Relaxed PCIe ordering. Optional: devices that lack it ignore it
        /// (registered through `ibv_reg_mr_iova2`, rdma-core's optional-access path).
        const RELAXED_ORDERING = ffi::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
    }
}

impl AccessFlags {
    /// True when a peer can change the memory: REMOTE_WRITE, REMOTE_ATOMIC, or
    /// MW_BIND (a memory window bound to it may grant remote write).
    pub fn remotely_writable(self) -> bool {
        self.intersects(
            AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC | AccessFlags::MW_BIND,
        )
    }
}

/// What backs a registration.
pub(crate) enum Backing {
    /// Host memory this crate allocated with `layout`.
    Heap(Layout),
    /// Memory owned elsewhere (e.g. a CUDA allocation), kept alive by the box.
    /// Not host-accessible.
    Device(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// Deregistration failed: the memory was deliberately leaked.
    Leaked,
}

/// One `ibv_mr` and its memory. Shared by all `Mr` pieces cut from it.
pub(crate) struct Region {
    raw: NonNull<ffi::ibv_mr>,
    ptr: NonNull<u8>,
    len: usize,
    access: AccessFlags,
    backing: Backing,
    pd: Pd,
}

// SAFETY: the region's bytes are only reached through `Mr` pieces with disjoint
// ranges (or immutable `SharedMr`s); ibv_mr may be used and deregistered from any thread.
unsafe impl Send for Region {}
// SAFETY: &Region only gives out keys and addresses, never the bytes.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: raw came from a reg_mr call; no QP holds a piece (leases hold
        // an Arc to this region), so the NIC no longer touches the memory.
        let rc = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
        if rc != 0 {
            // Still registered: the NIC (or a peer holding the rkey) may reach the
            // memory, so it must never be freed. Leak it.
            std::mem::forget(std::mem::replace(&mut self.backing, Backing::Leaked));
            return;
        }
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: ptr was allocated with exactly this layout; deregistered above.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl Region {
    /// Wraps a registration of memory that this crate did not allocate.
    ///
    /// # Safety
    /// `raw` is a live registration of `[ptr, ptr+len)` in `pd`, owned by the
    /// caller and handed over; `keepalive` keeps that memory valid until dropped.
    #[allow(dead_code)]
    pub(crate) unsafe fn from_device_registration(
        pd: &Pd,
        raw: NonNull<ffi::ibv_mr>,
        ptr: NonNull<u8>,
        len: usize,
        access: AccessFlags,
        keepalive: Box<dyn Any + Send + Sync>,
    ) -> Mr {
        let region = Region {
            raw,
            ptr,
            len,
            access,
            backing: Backing::Device(keepalive),
            pd: pd.clone(),
        };
        Mr {
            region: Arc::new(region),
            off: 0,
            len,
        }
    }
}

/// An exclusively owned range of registered memory.
///
/// See the [module docs](self) for the ownership model.
pub struct Mr {
    region: Arc<Region>,
    off: usize,
    len: usize,
}

impl Mr {
    /// Allocates `len` zeroed, page-aligned bytes and registers them with `access`
    /// (`ibv_reg_mr_iova2`, so optional flags like RELAXED_ORDERING are honoured).
    ///
    /// `len` may be anything from 1 byte to what RLIMIT_MEMLOCK allows; over the
    /// limit the error is [`Error::MemlockLimit`] with what to do.
    pub fn new(pd: &Pd, len: usize, access: AccessFlags) -> Result<Mr> {
        if len == 0 {
            return Err(Error::InvalidArgument {
                what: "MR length",
                reason: "must be at least 1 byte".into(),
            });
        }
        let page = page_size();
        let alloc_len =
            len.checked_next_multiple_of(page)
                .ok_or_else(|| Error::InvalidArgument {
                    what: "MR length",
                    reason: format!("{len} bytes is too large"),
                })?;
        let layout =
            Layout::from_size_align(alloc_len, page).map_err(|e| Error::InvalidArgument {
                what: "MR length",
                reason: e.to_string(),
            })?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            return Err(Error::InvalidArgument {
                what: "MR length",
                reason: format!("could not allocate {len} bytes"),
            });
        };
        // SAFETY: valid PD; [ptr, ptr+len) is memory we own for the registration's life.
        let raw = unsafe {
            ffi::ibv_reg_mr_iova2(
                pd.as_raw(),
                ptr.as_ptr().cast(),
                len,
                ptr.as_ptr() as u64,
                access.bits(),
            )
        };
        let Some(raw) = NonNull::new(raw) else {
            let e = last_errno();
            // SAFETY: allocated above with this layout, not registered.
            unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
            return Err(reg_error("ibv_reg_mr", len, e));
        };
        let region = Region {
            raw,
            ptr,
            len,
            access,
            backing: Backing::Heap(layout),
            pd: pd.clone(),
        };
        Ok(Mr {
            region: Arc::new(region),
            off: 0,
            len,
        })
    }

    /// Bytes in this range.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty range.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Local key, for SGEs.
    #[inline]
    pub fn lkey(&self) -> u32 {
        // SAFETY: raw is valid while the region lives.
        unsafe { (*self.region.raw.as_ptr()).lkey }
    }

    /// Remote key, for peers.
    #[inline]
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.region.raw.as_ptr()).rkey }
    }

    /// The address the NIC uses for the start of this range (the IOVA).
    #[inline]
    pub fn addr(&self) -> u64 {
        self.region.ptr.as_ptr() as u64 + self.off as u64
    }

    /// Access rights of the registration.
    pub fn access(&self) -> AccessFlags {
        self.region.access
    }

    /// The PD it is registered in.
    pub fn pd(&self) -> &Pd {
        &self.region.pd
    }

    /// Length of the whole registration this range was cut from.
    pub fn region_len(&self) -> usize {
        self.region.len
    }

    /// The raw `ibv_mr` of the registration.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.region.raw.as_ptr()
    }

    /// The descriptor of this range for a peer (address, length, rkey).
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.len as u64,
            rkey: self.rkey(),
        }
    }

    fn host_ptr(&self) -> Result<*mut u8> {
        match self.region.backing {
            // SAFETY: off <= region len, so the result stays inside the allocation.
            Backing::Heap(_) => Ok(unsafe { self.region.ptr.as_ptr().add(self.off) }),
            Backing::Device(_) | Backing::Leaked => Err(Error::InvalidArgument {
                what: "memory access",
                reason: "this region is device (GPU) memory; copy it with the CUDA API".into(),
            }),
        }
    }

    fn slice_check(&self) -> Result<*mut u8> {
        let p = self.host_ptr()?;
        if self.region.access.remotely_writable() {
            Err(Error::RemotelyWritable)
        } else {
            Ok(p)
        }
    }

    /// The bytes, for memory no peer can write.
    ///
    /// Errors with [`Error::RemotelyWritable`] for REMOTE_WRITE/REMOTE_ATOMIC
    /// regions (use [`Mr::read_at`] / [`Mr::to_vec`]).
    pub fn as_slice(&self) -> Result<&[u8]> {
        let p = self.slice_check()?;
        // SAFETY: [p, p+len) is inside the allocation, owned exclusively by this Mr
        // (disjoint from every other piece), not posted (the Mr would have been
        // moved), and no peer may write it (checked above).
        Ok(unsafe { std::slice::from_raw_parts(p, self.len) })
    }

    /// The bytes, mutably, for memory no peer can write. See [`Mr::as_slice`].
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        let p = self.slice_check()?;
        // SAFETY: as in as_slice, and &mut self makes the borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, self.len) })
    }

    fn range_check(&self, offset: usize, n: usize) -> Result<()> {
        if offset.checked_add(n).is_none_or(|end| end > self.len) {
            return Err(Error::InvalidArgument {
                what: "offset",
                reason: format!(
                    "[{offset}, {offset}+{n}) is outside this {}-byte range",
                    self.len
                ),
            });
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the range. Works for
    /// remotely writable memory too (see the module docs).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.range_check(offset, dst.len())?;
        let p = self.host_ptr()?;
        // SAFETY: the source range is inside this Mr's allocation and the
        // destination is a distinct Rust buffer; a raw copy creates no reference
        // to memory a peer might be writing.
        unsafe { std::ptr::copy_nonoverlapping(p.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the range at `offset`. Works for remotely writable memory.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.range_check(offset, src.len())?;
        let p = self.host_ptr()?;
        // SAFETY: destination inside this exclusively owned range; raw copy as above.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p.add(offset), src.len()) };
        Ok(())
    }

    /// Sets every byte of the range to `byte`.
    pub fn fill(&mut self, byte: u8) -> Result<()> {
        let p = self.host_ptr()?;
        // SAFETY: the range is inside the allocation and exclusively ours.
        unsafe { std::ptr::write_bytes(p, byte, self.len) };
        Ok(())
    }

    /// A copy of the range's bytes.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// Splits off `[at, len)` as a new `Mr`; `self` keeps `[0, at)`.
    pub fn split_off(&mut self, at: usize) -> Result<Mr> {
        self.range_check(at, 0)?;
        let tail = Mr {
            region: self.region.clone(),
            off: self.off + at,
            len: self.len - at,
        };
        self.len = at;
        Ok(tail)
    }

    /// Splits off `[0, at)` as a new `Mr`; `self` keeps `[at, len)`.
    pub fn split_to(&mut self, at: usize) -> Result<Mr> {
        self.range_check(at, 0)?;
        let head = Mr {
            region: self.region.clone(),
            off: self.off,
            len: at,
        };
        self.off += at;
        self.len -= at;
        Ok(head)
    }

    /// Joins `other` back onto the end of `self` when it is the adjacent piece of
    /// the same registration; otherwise hands it back.
    pub fn unsplit(&mut self, other: Mr) -> std::result::Result<(), Mr> {
        if Arc::ptr_eq(&self.region, &other.region) && self.off + self.len == other.off {
            self.len += other.len;
            Ok(())
        } else {
            Err(other)
        }
    }

    /// Makes the range immutable and shareable, for posting as a SEND/WRITE
    /// source many times at once.
    pub fn freeze(self) -> SharedMr {
        let len = self.len;
        SharedMr {
            base: Arc::new(self),
            off: 0,
            len,
        }
    }

    #[inline]
    pub(crate) fn sge(&self) -> ffi::ibv_sge {
        ffi::ibv_sge {
            addr: self.addr(),
            length: self.len as u32,
            lkey: self.lkey(),
        }
    }
}

impl fmt::Debug for Mr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .finish()
    }
}

/// An immutable, cheaply clonable range of registered memory. The NIC may read
/// it through any number of in-flight work requests at once.
#[derive(Clone)]
pub struct SharedMr {
    base: Arc<Mr>,
    off: usize,
    len: usize,
}

impl SharedMr {
    /// Bytes in this range.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty range.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A sub-range `[offset, offset+len)` of this range.
    pub fn slice(&self, offset: usize, len: usize) -> Result<SharedMr> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::InvalidArgument {
                what: "slice",
                reason: format!(
                    "[{offset}, {offset}+{len}) is outside this {}-byte range",
                    self.len
                ),
            });
        }
        Ok(SharedMr {
            base: self.base.clone(),
            off: self.off + offset,
            len,
        })
    }

    /// The bytes (for memory no peer can write; see [`Mr::as_slice`]).
    pub fn as_slice(&self) -> Result<&[u8]> {
        let s = self.base.as_slice()?;
        Ok(&s[self.off..self.off + self.len])
    }

    /// Copies bytes out at `offset` (any memory; see [`Mr::read_at`]).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::InvalidArgument {
                what: "offset",
                reason: "outside the shared range".into(),
            });
        }
        self.base.read_at(self.off + offset, dst)
    }

    /// Local key.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.base.lkey()
    }

    /// Remote key.
    #[inline]
    pub fn rkey(&self) -> u32 {
        self.base.rkey()
    }

    /// NIC address of the start of this range.
    #[inline]
    pub fn addr(&self) -> u64 {
        self.base.addr() + self.off as u64
    }

    /// The descriptor of this range for a peer.
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.len as u64,
            rkey: self.rkey(),
        }
    }

    /// The original `Mr`, if this is the last clone; otherwise `self` back.
    pub fn try_unfreeze(self) -> std::result::Result<Mr, SharedMr> {
        let SharedMr { base, off, len } = self;
        Arc::try_unwrap(base).map_err(|base| SharedMr { base, off, len })
    }

    #[inline]
    pub(crate) fn sge(&self) -> ffi::ibv_sge {
        ffi::ibv_sge {
            addr: self.addr(),
            length: self.len as u32,
            lkey: self.lkey(),
        }
    }
}

impl fmt::Debug for SharedMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedMr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .finish()
    }
}

/// A peer's memory region as plain data: what WRITE, READ and atomics target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RemoteMr {
    /// Remote virtual address (IOVA) of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

impl RemoteMr {
    /// Checks that `[offset, offset+len)` lies inside the region and returns its address.
    #[inline]
    pub fn checked_addr(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => {
                self.addr
                    .checked_add(offset)
                    .ok_or(Error::RemoteOutOfBounds {
                        offset,
                        len,
                        region_len: self.len,
                    })
            }
            _ => Err(Error::RemoteOutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// Maps a failed registration to the memlock error where that is the cause.
pub(crate) fn reg_error(verb: &'static str, len: usize, e: std::io::Error) -> Error {
    let code = e.raw_os_error().unwrap_or(0);
    if (code == libc::ENOMEM || code == libc::EPERM) && !has_cap_ipc_lock() {
        if let Some(limit) = memlock_limit() {
            return Error::MemlockLimit {
                verb,
                requested: len,
                limit: Some(limit),
                source: e,
            };
        }
    }
    Error::verb(verb, e)
}

/// Whether this process has CAP_IPC_LOCK (then memlock does not apply).
fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("CapEff:"))?;
            u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_bounds_are_checked() {
        let r = RemoteMr {
            addr: 0x1000,
            len: 100,
            rkey: 7,
        };
        assert_eq!(r.checked_addr(0, 100).unwrap(), 0x1000);
        assert_eq!(r.checked_addr(99, 1).unwrap(), 0x1000 + 99);
        assert!(matches!(
            r.checked_addr(99, 2),
            Err(Error::RemoteOutOfBounds {
                offset: 99,
                len: 2,
                region_len: 100
            })
        ));
        assert!(matches!(
            r.checked_addr(u64::MAX, 2),
            Err(Error::RemoteOutOfBounds { .. })
        ));
    }

    #[test]
    fn access_flags_match_verbs_h() {
        assert_eq!(AccessFlags::LOCAL_WRITE.bits(), 1);
        assert_eq!(AccessFlags::REMOTE_ATOMIC.bits(), 8);
        assert_eq!(
            AccessFlags::RELAXED_ORDERING.bits(),
            ffi::IBV_ACCESS_OPTIONAL_FIRST
        );
        assert!((AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).remotely_writable());
        assert!(!(AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ).remotely_writable());
    }
}
