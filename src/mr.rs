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
//! [`Mr::read_at`], [`Mr::to_vec`] and [`Mr::write_at`], which copy with
//! relaxed atomic loads and stores and never create a reference to the shared
//! bytes (the same model as memory shared with another process), so a peer
//! writing concurrently is not a data race. A copy taken while a peer is
//! writing may observe a mix of old and new bytes; order it after the
//! completion that announces the data (e.g. a WRITE_WITH_IMM receive).

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result, memlock_limit};
use crate::ffi;
use crate::pd::Pd;
use crate::sys::call::verb;

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
        if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC)
            && !access.contains(AccessFlags::LOCAL_WRITE)
        {
            // ibv_reg_mr(3): the kernel refuses this with a bare EINVAL.
            return Err(Error::InvalidArgument {
                what: "MR access flags",
                reason: "REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE too (ibv_reg_mr(3))"
                    .into(),
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
        // SAFETY: valid PD; [ptr, ptr+len) is memory we own for the registration's life.
        let registered = verb!(ptr: unsafe {
            ffi::ibv_reg_mr_iova2(
                pd.as_raw(),
                ptr.as_ptr().cast(),
                len,
                ptr.as_ptr() as u64,
                access.bits(),
            )
        });
        let raw = match registered {
            Ok(raw) => raw,
            Err(failed) => {
                // SAFETY: allocated above with this layout, not registered.
                unsafe { alloc::dealloc(ptr.as_ptr(), layout) };
                // Named as users call it: ibv_reg_mr(3) is the header's macro
                // that reaches ibv_reg_mr_iova2 for optional access flags.
                return Err(reg_error("ibv_reg_mr", len, failed.source));
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

    /// Bytes `offset..offset + len`, for memory no peer can write, while the
    /// NIC may be using other parts of the range (a scope's
    /// [`ScopedBuffers`](crate::ScopedBuffers)).
    ///
    /// # Safety
    /// Nothing writes `offset..offset + len` while the returned slice lives:
    /// no request posted with that part is in flight or posted meanwhile.
    pub(crate) unsafe fn part(&self, offset: usize, len: usize) -> Result<&[u8]> {
        self.range_check(offset, len)?;
        let p = self.slice_check()?;
        // SAFETY: inside this Mr's piece of the allocation (range_check),
        // which no peer may write (slice_check) and, per the contract, the
        // local NIC does not write while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(p.add(offset), len) })
    }

    /// [`Mr::part`], mutably.
    ///
    /// # Safety
    /// Nothing reads or writes `offset..offset + len` while the returned
    /// slice lives: no request posted with that part is in flight or posted
    /// meanwhile.
    pub(crate) unsafe fn part_mut(&mut self, offset: usize, len: usize) -> Result<&mut [u8]> {
        self.range_check(offset, len)?;
        let p = self.slice_check()?;
        // SAFETY: as in `part`, and `&mut self` makes the borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(p.add(offset), len) })
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
        // SAFETY: (both arms) offset + dst.len() <= self.len (range_check), so the
        // source lies inside this Mr's piece of the allocation, which stays
        // allocated while `self` lives; `dst` is a distinct Rust buffer. No
        // reference to the registered bytes is created.
        unsafe {
            let src = p.add(offset);
            if self.region.access.remotely_writable() {
                // A peer may write these bytes while we copy: atomic loads.
                racy::load(src, dst);
            } else {
                // No peer can write it (no REMOTE_WRITE/ATOMIC/MW_BIND) and the
                // local NIC writes only posted buffers, which are moved out of
                // safe code or lent to a scope (whose `ScopedBuffers` call
                // this only for a part no receive is writing): nothing writes
                // these bytes during the copy.
                std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
            }
        }
        Ok(())
    }

    /// Copies `src` into the range at `offset`. Works for remotely writable memory.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.range_check(offset, src.len())?;
        let p = self.host_ptr()?;
        // SAFETY: (both arms) the destination lies inside this exclusively owned
        // piece (range_check; pieces are disjoint and `&mut self` is unique), and
        // `src` is a distinct Rust buffer.
        unsafe {
            let dst = p.add(offset);
            if self.region.access.remotely_writable() {
                // A peer may access these bytes concurrently: atomic stores.
                racy::store(src, dst);
            } else {
                // Nothing else reads or writes the piece while `&mut self` lives.
                std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
            }
        }
        Ok(())
    }

    /// Sets every byte of the range to `byte`.
    pub fn fill(&mut self, byte: u8) -> Result<()> {
        let p = self.host_ptr()?;
        // SAFETY: (both arms) [p, p+len) is this exclusively owned piece of the
        // allocation (see write_at).
        unsafe {
            if self.region.access.remotely_writable() {
                racy::fill(p, byte, self.len);
            } else {
                std::ptr::write_bytes(p, byte, self.len);
            }
        }
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

// `Pd::alloc_mr` lives with what it builds: a PD knows nothing of regions.
impl Pd {
    /// Allocates `len` bytes of page-aligned, zeroed memory and registers it.
    /// Shorthand for [`Mr::new`].
    pub fn alloc_mr(&self, len: usize, access: AccessFlags) -> Result<Mr> {
        Mr::new(self, len, access)
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
    /// The PD it is registered in.
    pub fn pd(&self) -> &Pd {
        self.base.pd()
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

/// Byte copies to and from memory that a peer may write at any moment
/// (remotely writable registrations).
///
/// The NIC writes such memory by DMA while we copy. A plain
/// `copy_nonoverlapping` would then be a data race, which Rust's memory model
/// makes undefined behaviour (the compiler may assume the bytes do not change
/// under it: re-read, split or widen the loads). Atomic accesses are the
/// model's sanctioned way to share memory racily, with another thread or,
/// as here, with another agent (like memory shared with another process);
/// `Relaxed` suffices because ordering against the peer comes from the
/// completion that announces its data. `read_volatile`/`write_volatile` are
/// not an option: volatile accesses that race are still data races (volatile
/// is for MMIO), and they are no faster.
///
/// Cost: a relaxed atomic load or store of a `u8` or `usize` is an ordinary
/// `mov` (x86-64 and AArch64), but the compiler cannot merge or vectorize
/// atomics. So the unaligned head and tail (under one word each) go byte by
/// byte with `AtomicU8`, and the aligned middle a word at a time with
/// `AtomicUsize`: one load and one store per 8 bytes, versus memcpy's 32-64
/// bytes per vector instruction. That is why memory no peer can write keeps
/// the plain copies.
///
/// Rust's model also forbids racing atomic accesses of *different sizes* to
/// the same bytes. Our own accesses never race with each other (they need
/// `&Mr`/`&mut Mr` and so are ordered by the borrow rules); the NIC's DMA
/// writes are outside the abstract machine and have no Rust access size
/// (PCIe writes of up to a cache line), so no single size would "match"
/// them; the word size is as justified as a byte and eight times fewer
/// instructions.
mod racy {
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::atomic::{AtomicU8, AtomicUsize};

    const W: usize = size_of::<usize>();

    /// Bytes before `p + head` are unaligned, `head <= n`; then whole words.
    fn split(p: *const u8, n: usize) -> (usize, usize) {
        let head = ((p as usize).wrapping_neg() % W).min(n);
        let words = (n - head) / W;
        (head, words)
    }

    /// Copies `dst.len()` bytes from `src` into `dst`.
    ///
    /// # Safety
    /// `[src, src+dst.len())` is allocated, writable memory that stays
    /// allocated during the call, does not overlap `dst`, and that other Rust
    /// code does not access non-atomically (or atomically with other sizes)
    /// during the call. Others (a NIC) may write it concurrently.
    pub(super) unsafe fn load(src: *const u8, dst: &mut [u8]) {
        let (head, words) = split(src, dst.len());
        let (d_head, rest) = dst.split_at_mut(head);
        let (d_mid, d_tail) = rest.split_at_mut(words * W);
        let mut s = src;
        // SAFETY: (all three loops) every `s` stays in [src, src+dst.len()),
        // which is valid for the call (caller); `s` is word-aligned in the
        // middle loop (split); the accesses are atomic, so a concurrent write by
        // the NIC is no data race.
        unsafe {
            for d in d_head {
                *d = AtomicU8::from_ptr(s.cast_mut()).load(Relaxed);
                s = s.add(1);
            }
            for d in d_mid.chunks_exact_mut(W) {
                debug_assert!(s.cast::<usize>().is_aligned());
                let v = AtomicUsize::from_ptr(s.cast_mut().cast::<usize>()).load(Relaxed);
                d.copy_from_slice(&v.to_ne_bytes());
                s = s.add(W);
            }
            for d in d_tail {
                *d = AtomicU8::from_ptr(s.cast_mut()).load(Relaxed);
                s = s.add(1);
            }
        }
    }

    /// Copies `src` to `dst`.
    ///
    /// # Safety
    /// `[dst, dst+src.len())` is allocated, writable memory that stays
    /// allocated during the call, does not overlap `src`, and that other Rust
    /// code does not access (except atomically with the same sizes) during
    /// the call. Others (a NIC) may access it concurrently.
    pub(super) unsafe fn store(src: &[u8], dst: *mut u8) {
        let (head, words) = split(dst, src.len());
        let (s_head, rest) = src.split_at(head);
        let (s_mid, s_tail) = rest.split_at(words * W);
        let mut d = dst;
        // SAFETY: as in `load`, for the destination.
        unsafe {
            for &b in s_head {
                AtomicU8::from_ptr(d).store(b, Relaxed);
                d = d.add(1);
            }
            for c in s_mid.chunks_exact(W) {
                debug_assert!(d.cast::<usize>().is_aligned());
                let mut w = [0u8; W];
                w.copy_from_slice(c);
                AtomicUsize::from_ptr(d.cast::<usize>()).store(usize::from_ne_bytes(w), Relaxed);
                d = d.add(W);
            }
            for &b in s_tail {
                AtomicU8::from_ptr(d).store(b, Relaxed);
                d = d.add(1);
            }
        }
    }

    /// Sets `n` bytes at `dst` to `byte`.
    ///
    /// # Safety
    /// As [`store`] for `[dst, dst+n)`.
    pub(super) unsafe fn fill(dst: *mut u8, byte: u8, n: usize) {
        let (head, words) = split(dst, n);
        let word = usize::from_ne_bytes([byte; W]);
        let mut d = dst;
        // SAFETY: as in `store`.
        unsafe {
            for _ in 0..head {
                AtomicU8::from_ptr(d).store(byte, Relaxed);
                d = d.add(1);
            }
            for _ in 0..words {
                debug_assert!(d.cast::<usize>().is_aligned());
                AtomicUsize::from_ptr(d.cast::<usize>()).store(word, Relaxed);
                d = d.add(W);
            }
            for _ in 0..n - head - words * W {
                AtomicU8::from_ptr(d).store(byte, Relaxed);
                d = d.add(1);
            }
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

    /// A pseudo-random byte pattern (no two neighbouring words alike).
    fn pattern(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn racy_copies_are_byte_exact() {
        const PAD: usize = 24;
        for len in (0..100).chain([4096 + 3, (1 << 20) + 5]) {
            for src_off in 0..8 {
                for dst_off in 0..8 {
                    if len > 4096 && !matches!((src_off, dst_off), (0, 0) | (3, 5) | (7, 2)) {
                        continue; // the big sizes at a few alignments suffice
                    }
                    let seed = (len * 64 + src_off * 8 + dst_off) as u32;
                    let data = pattern(len, seed);

                    // load: from (shared) memory at src_off into a plain buffer.
                    let mut shared = pattern(len + 2 * PAD, !seed);
                    shared[PAD + src_off..][..len].copy_from_slice(&data);
                    let before = shared.clone();
                    let mut out = vec![0xa5u8; len + 2 * PAD];
                    // SAFETY: in bounds of `shared`, which nothing else accesses.
                    unsafe {
                        racy::load(
                            shared.as_ptr().add(PAD + src_off),
                            &mut out[PAD + dst_off..][..len],
                        )
                    };
                    assert_eq!(&out[PAD + dst_off..][..len], &data[..], "load {len}");
                    assert!(out[..PAD + dst_off].iter().all(|&b| b == 0xa5));
                    assert!(out[PAD + dst_off + len..].iter().all(|&b| b == 0xa5));
                    assert_eq!(shared, before, "load must not write the source");

                    // store: into (shared) memory at dst_off, nothing around it.
                    let mut expect = before.clone();
                    expect[PAD + dst_off..][..len].copy_from_slice(&data);
                    // SAFETY: in bounds of `shared`, which nothing else accesses.
                    unsafe { racy::store(&data, shared.as_mut_ptr().add(PAD + dst_off)) };
                    assert_eq!(shared, expect, "store {len} at +{dst_off}");

                    // fill
                    let byte = seed as u8 | 1;
                    expect[PAD + src_off..][..len].fill(byte);
                    // SAFETY: as above.
                    unsafe { racy::fill(shared.as_mut_ptr().add(PAD + src_off), byte, len) };
                    assert_eq!(shared, expect, "fill {len} at +{src_off}");
                }
            }
        }
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
