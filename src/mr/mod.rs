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
//! # Memory the application owns
//! [`Mr::register`] registers a buffer in place, without copying: a `Vec<u8>`,
//! a `Box<[u8]>`, an [`AnonMemory`] mapping (huge pages: [`Mr::new_huge`]) or,
//! with the `memmap2` feature, a file mapping (see [`OwnedMemory`]). The `Mr`
//! owns the buffer while registered; [`Mr::into_buffer`] gives it back.
//! [`Mr::register_raw`] is the `unsafe` path for memory the caller manages.
//! [`MrPool`] hands out fixed-size `Mr` buffers of one registration.
//! [`RegCache`] serves repeated registrations of caller-managed memory from
//! a hash map until the range is invalidated; [`AccessFlags::ON_DEMAND`]
//! registers without pinning where the device has on-demand paging
//! ([`Mr::prefetch`], [`ImplicitOdpMr`]).
//!
//! # Remotely writable memory
//! A region registered with `REMOTE_WRITE` or `REMOTE_ATOMIC` can be changed
//! by a peer at any moment, outside Rust's knowledge. Handing out `&[u8]` or
//! `&mut [u8]` to such memory would let the compiler assume it does not change,
//! so [`Mr::as_slice`] refuses with [`Error::RemotelyWritable`]; use
//! [`Mr::read_at`], [`Mr::to_vec`] and [`Mr::write_at`], which copy with
//! relaxed atomic loads and stores and never create a reference to the shared
//! bytes (the same model as memory shared with another process), so a peer
//! writing concurrently is not a data race. A copy taken while a peer is
//! writing may observe a mix of old and new bytes; order it after the
//! completion that announces the data (e.g. a WRITE_WITH_IMM receive).

mod anon;
mod bytes;
mod cache;
mod odp;
mod owned;
mod pool;
#[cfg(feature = "bytes")]
mod pool_bytes;
mod racy;
mod region;
mod shared;

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ffi;
use crate::pd::Pd;
use crate::sys::call::verb;

pub use anon::{AnonMemory, HugePageSize};
pub use cache::{CachedMr, RegCache};
pub use odp::{Advice, ImplicitOdpMr};
pub use owned::{MrRefused, OwnedMemory};
pub use pool::{MAX_POOL_BUFFERS, MrPool};
pub(crate) use region::{Backing, Region, page_size, reg_error};
pub use shared::{RemoteMr, SharedMr};

bitflags::bitflags! {
    /// Memory access rights (`ibv_access_flags`).
    #[doc(alias = "ibv_access_flags")]
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
        /// Peers may FLUSH it to the global visibility point
        /// ([`SendWr::flush`](crate::qp::SendWr::flush)); kernels before 6.2 refuse the
        /// registration (`EINVAL`).
        const FLUSH_GLOBAL = ffi::IBV_ACCESS_FLUSH_GLOBAL;
        /// Peers may FLUSH it to persistence; rxe takes it only on persistent memory.
        const FLUSH_PERSISTENT = ffi::IBV_ACCESS_FLUSH_PERSISTENT;
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

/// An exclusively owned range of registered memory.
///
/// See the [module docs](self) for the ownership model.
#[doc(alias = "ibv_mr")]
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
    #[doc(alias("ibv_reg_mr", "ibv_reg_mr_iova2"))]
    pub fn new(pd: &Pd, len: usize, access: AccessFlags) -> Result<Mr> {
        check_len_access(len, access)?;
        let page = page_size();
        let alloc_len =
            len.checked_next_multiple_of(page)
                .ok_or_else(|| Error::InvalidArgument {
                    what: "MR length",
                    reason: format!("{len} bytes is too large"),
                })?;
        let layout =
            Layout::from_size_align(alloc_len, page).map_err(|_| Error::InvalidArgument {
                what: "MR length",
                reason: format!("{len} bytes is more than one allocation can hold"),
            })?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            return Err(Error::Io {
                what: "allocating the memory to register",
                source: std::io::Error::new(
                    std::io::ErrorKind::OutOfMemory,
                    format!("could not allocate {len} bytes"),
                ),
            });
        };
        // SAFETY: [ptr, ptr+len) is memory allocated above, freed only after
        // the registration ends (Region's drop) or right below on failure.
        let raw = match unsafe { reg_mr(pd, ptr, len, access) } {
            Ok(raw) => raw,
            Err(e) => {
                // SAFETY: allocated above with this layout, not registered.
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
                return Err(e);
            }
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

    /// The descriptor of this range for a peer (address, length, rkey). The
    /// rkey grants the peer the whole registration with its remote rights,
    /// not only this range: a peer that ignores the length can reach the
    /// other pieces split from it.
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.len as u64,
            rkey: self.rkey(),
        }
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

    #[inline]
    pub(crate) fn sge(&self) -> ffi::ibv_sge {
        range_sge(self.addr(), self.len, self.lkey())
    }

    /// The registration this range was cut from (a memory window bound to
    /// the range holds it, so it stays registered while the window lives).
    pub(crate) fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Narrows this range to `[start, start + len)` of itself; the caller
    /// keeps what it needs to [`widen`](Self::widen) it back.
    pub(crate) fn narrow(&mut self, start: usize, len: usize) {
        debug_assert!(start.checked_add(len).is_some_and(|end| end <= self.len));
        self.off += start;
        self.len = len;
    }

    /// Grows this range by `head` bytes before and `tail` bytes after.
    ///
    /// # Safety
    /// Those bytes belong to the same registration and to no other `Mr`: they
    /// are what [`narrow`](Self::narrow) cut off this one.
    pub(crate) unsafe fn widen(&mut self, head: usize, tail: usize) {
        self.off -= head;
        self.len += head + tail;
    }
}

impl Region {
    /// The raw `ibv_mr`, valid while the region lives.
    pub(crate) fn raw_mr(&self) -> *mut ffi::ibv_mr {
        self.raw.as_ptr()
    }

    /// Whether `addr..addr + len` (addresses as `Mr::addr` gives them) lies
    /// inside the region.
    pub(crate) fn covers(&self, addr: u64, len: u64) -> bool {
        let start = self.ptr.as_ptr() as u64;
        addr >= start && addr.saturating_add(len) <= start + self.len as u64
    }
}

/// Refuses an empty registration and access flags the kernel would refuse
/// with a bare EINVAL.
fn check_len_access(len: usize, access: AccessFlags) -> Result<()> {
    if len == 0 {
        return Err(Error::InvalidArgument {
            what: "MR length",
            reason: "it is 0, and it must be at least 1 byte".into(),
        });
    }
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
        && !access.contains(AccessFlags::LOCAL_WRITE)
    {
        // ibv_reg_mr(3): the kernel refuses this with a bare EINVAL.
        return Err(Error::InvalidArgument {
            what: "MR access flags",
            reason: "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too (ibv_reg_mr(3))".into(),
        });
    }
    Ok(())
}

/// Registers `[ptr, ptr+len)` with `access` (`ibv_reg_mr_iova2`, IOVA = address,
/// so optional flags like RELAXED_ORDERING are honoured).
///
/// # Safety
/// `[ptr, ptr+len)` is memory of this process that stays mapped until the
/// returned registration is deregistered.
unsafe fn reg_mr(
    pd: &Pd,
    ptr: NonNull<u8>,
    len: usize,
    access: AccessFlags,
) -> Result<NonNull<ffi::ibv_mr>> {
    odp::check_odp(pd, access, false)?;
    // SAFETY: valid PD; the memory stays mapped for the registration's life
    // (caller).
    let registered = verb!(ptr: unsafe {
        ffi::ibv_reg_mr_iova2(
            pd.as_raw(),
            ptr.as_ptr().cast(),
            len,
            ptr.as_ptr() as u64,
            access.bits(),
        )
    });
    // Named as users call it: ibv_reg_mr(3) is the header's macro that
    // reaches ibv_reg_mr_iova2 for optional access flags.
    registered.map_err(|failed| reg_error("ibv_reg_mr", len, failed.source))
}

/// The scatter/gather entry for `len` bytes at `addr` under `lkey`.
#[inline]
fn range_sge(addr: u64, len: usize, lkey: u32) -> ffi::ibv_sge {
    ffi::ibv_sge {
        addr,
        length: len as u32,
        lkey,
    }
}

/// A `Debug` printer that starts with what every range shows: its address,
/// length and local key.
fn debug_range<'a, 'b>(
    f: &'a mut fmt::Formatter<'b>,
    name: &str,
    addr: u64,
    len: usize,
    lkey: u32,
) -> fmt::DebugStruct<'a, 'b> {
    let mut d = f.debug_struct(name);
    d.field("addr", &format_args!("{addr:#x}"))
        .field("len", &len)
        .field("lkey", &format_args!("{lkey:#x}"));
    d
}

// `Pd::alloc_mr` lives with what it builds: a PD knows nothing of regions.
impl Pd {
    /// Allocates `len` bytes of page-aligned, zeroed memory and registers it
    /// (`ibv_reg_mr`). Shorthand for [`Mr::new`].
    #[doc(alias = "ibv_reg_mr")]
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Mr> {
        Mr::new(self, len, access)
    }
}

impl fmt::Debug for Mr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        debug_range(f, "Mr", self.addr(), self.len, self.lkey())
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
