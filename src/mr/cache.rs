//! A registration cache for memory the caller manages: registering the same
//! (address, length, access) again returns the registration already made.

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use super::region::{Backing, Region};
use super::{AccessFlags, RemoteMr, check_len_access, range_sge, reg_mr};
use crate::error::{Error, Result};
use crate::ffi;
use crate::pd::Pd;
use crate::sys::addr_hash::AddrMap;

/// An entry's key: the exact address, length and access rights registered.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    addr: usize,
    len: usize,
    access: u32,
}

type Map = AddrMap<Key, Arc<Region>>;

/// What the cache's lock guards.
struct Inner {
    map: Map,
    /// Bumped by every invalidation, so a miss that registered outside the
    /// lock can tell whether its range may have been invalidated meanwhile.
    epoch: u64,
    hits: u64,
    misses: u64,
}

/// A registration cache of one protection domain, for memory the crate does
/// not own: buffers a C library or an allocator hands out again and again.
///
/// [`RegCache::get`] looks the exact (address, length, access) up in a hash
/// map under a mutex: a hit clones a reference count and makes no system
/// call; a miss registers (`ibv_reg_mr`) and remembers the registration. An
/// entry stays until [`RegCache::invalidate`] is called over any byte of its
/// range (the application frees or remaps the memory), [`RegCache::clear`],
/// or the cache is dropped; it is then deregistered as soon as the last
/// [`CachedMr`] handle on it is dropped, and later lookups of that range
/// register anew. There is no eviction by size: the caller decides what
/// stays pinned, by invalidating.
///
/// Keys are exact. A lookup of a sub-range of a cached entry, or of the same
/// range with fewer rights, is a miss and registers its own entry: serving it
/// from a larger entry (as UCX's rcache does, with page-aligned, merged
/// regions in an interval tree) would make a hit a range search and tie the
/// lifetime of unrelated buffers to one pinned region.
///
/// The cache is `Sync`: share it between threads by reference or in an `Arc`.
pub struct RegCache {
    pd: Pd,
    inner: Mutex<Inner>,
}

/// A handle on a cached registration: its keys and range, for the raw data
/// path ([`Qp::post_send_raw`](crate::qp::Qp::post_send_raw), an SGE built
/// with [`CachedMr::sge`]) or a peer ([`CachedMr::remote`]).
///
/// It keeps the registration alive: after the entry is invalidated the keys
/// stay valid until every handle on it is dropped. It gives no access to the
/// bytes themselves, which belong to the caller.
#[derive(Clone)]
pub struct CachedMr {
    region: Arc<Region>,
}

impl RegCache {
    /// An empty cache registering in `pd`.
    pub fn new(pd: &Pd) -> RegCache {
        RegCache {
            pd: pd.clone(),
            inner: Mutex::new(Inner {
                map: Map::default(),
                epoch: 0,
                hits: 0,
                misses: 0,
            }),
        }
    }

    /// The PD it registers in.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic under the lock leaves the map consistent (no update spans
        // two statements), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registration of `[ptr, ptr+len)` with `access`: the cached one
    /// when this exact range and access were registered and not invalidated
    /// since (no system call), otherwise a new registration, cached.
    ///
    /// Errors, before anything reaches the kernel: a zero `len` or a null
    /// `ptr` ([`Error::InvalidArgument`]), REMOTE_WRITE or REMOTE_ATOMIC
    /// without LOCAL_WRITE, ON_DEMAND on a device without on-demand paging
    /// ([`Error::Unsupported`]). A failed registration is the verb's error
    /// ([`Error::MemlockLimit`] over the memlock limit); nothing is cached.
    ///
    /// # Safety
    /// - `[ptr, ptr+len)` is memory of this process, mapped (writable too
    ///   when `access` has a write right) now and until the caller has called
    ///   [`invalidate`](Self::invalidate) over it (or [`clear`](Self::clear)ed
    ///   or dropped the cache) *and* dropped every [`CachedMr`] of it: free or
    ///   remap it only after that, since the pinned pages would otherwise go
    ///   on receiving what the NIC writes while the address is reused;
    /// - while registered with a remote write right (REMOTE_WRITE,
    ///   REMOTE_ATOMIC, MW_BIND), no Rust reference to those bytes exists:
    ///   a peer holding the rkey may change them at any moment.
    #[doc(alias("ibv_reg_mr", "rcache"))]
    pub unsafe fn get(&self, ptr: *mut u8, len: usize, access: AccessFlags) -> Result<CachedMr> {
        let key = Key {
            addr: ptr as usize,
            len,
            access: access.bits(),
        };
        let epoch = {
            let mut inner = self.lock();
            if let Some(region) = inner.map.get(&key) {
                let region = region.clone();
                inner.hits += 1;
                return Ok(CachedMr { region });
            }
            inner.misses += 1;
            inner.epoch
        };
        // SAFETY: get's contract is register's.
        let region = Arc::new(unsafe { self.register(ptr, len, access) }?);
        let mut inner = self.lock();
        // Another thread may have registered the same key meanwhile: serve
        // its entry (ours deregisters on drop). If an invalidation ran
        // meanwhile, this range may be gone from the caller's point of view:
        // hand the registration out (the caller's contract held when it
        // asked) without caching it.
        if let Some(existing) = inner.map.get(&key) {
            return Ok(CachedMr {
                region: existing.clone(),
            });
        }
        if inner.epoch == epoch {
            inner.map.insert(key, region.clone());
        }
        Ok(CachedMr { region })
    }

    /// Registers `[ptr, ptr+len)` as a region that never frees its memory.
    ///
    /// # Safety
    /// [`get`](Self::get)'s contract.
    unsafe fn register(&self, ptr: *mut u8, len: usize, access: AccessFlags) -> Result<Region> {
        check_len_access(len, access)?;
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::InvalidArgument {
            what: "MR address",
            reason: "the pointer is null".into(),
        })?;
        // SAFETY: the memory stays mapped until the entry is invalidated and
        // every handle (each holding the region) is dropped (get's contract).
        let raw = unsafe { reg_mr(&self.pd, ptr, len, access) }?;
        Ok(Region {
            raw,
            ptr,
            len,
            access,
            backing: Backing::Borrowed,
            pd: self.pd.clone(),
        })
    }

    /// Forgets every entry whose range overlaps `[ptr, ptr+len)`, before the
    /// application frees or remaps that memory; returns how many.
    ///
    /// A forgotten entry is deregistered when its last [`CachedMr`] is
    /// dropped (right away when none is alive); until then its keys stay
    /// valid. The next [`get`](Self::get) of such a range registers anew.
    /// Invalidation scans every entry (it is rare next to lookups).
    /// A zero `len` is [`Error::InvalidArgument`].
    pub fn invalidate(&self, ptr: *const u8, len: usize) -> Result<usize> {
        if len == 0 {
            return Err(Error::InvalidArgument {
                what: "invalidated range",
                reason: "its length is 0; pass the length of the memory being freed".into(),
            });
        }
        let start = ptr as usize;
        let end = start.saturating_add(len);
        let mut gone = Vec::new();
        {
            let mut inner = self.lock();
            inner.epoch += 1;
            inner.map.retain(|k, region| {
                let overlaps = k.addr < end && start < k.addr + k.len;
                if overlaps {
                    gone.push(region.clone());
                }
                !overlaps
            });
        }
        // Deregistration (a system call) happens here, outside the lock.
        Ok(gone.len())
    }

    /// Forgets every entry (as [`invalidate`](Self::invalidate) over all memory).
    pub fn clear(&self) {
        let map = {
            let mut inner = self.lock();
            inner.epoch += 1;
            std::mem::take(&mut inner.map)
        };
        drop(map);
    }

    /// Number of cached entries.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lookups served from the cache and lookups that registered, so far.
    pub fn hits_misses(&self) -> (u64, u64) {
        let inner = self.lock();
        (inner.hits, inner.misses)
    }
}

impl fmt::Debug for RegCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("RegCache")
            .field("entries", &inner.map.len())
            .field("hits", &inner.hits)
            .field("misses", &inner.misses)
            .finish()
    }
}

impl CachedMr {
    /// Local key, for SGEs.
    pub fn lkey(&self) -> u32 {
        // SAFETY: raw is valid while the region lives.
        unsafe { (*self.region.raw.as_ptr()).lkey }
    }

    /// Remote key, for peers.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.region.raw.as_ptr()).rkey }
    }

    /// Start address of the registered range (its IOVA too).
    pub fn addr(&self) -> u64 {
        self.region.ptr.as_ptr() as u64
    }

    /// Length of the registered range.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// Always false: an empty range is never registered.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Access rights of the registration.
    pub fn access(&self) -> AccessFlags {
        self.region.access
    }

    /// The raw `ibv_mr`, valid while this handle lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.region.raw.as_ptr()
    }

    /// Whether `other` is a handle on the same registration.
    pub fn same_registration(&self, other: &CachedMr) -> bool {
        Arc::ptr_eq(&self.region, &other.region)
    }

    /// The descriptor of the whole range for a peer (address, length, rkey).
    pub fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr(),
            len: self.region.len as u64,
            rkey: self.rkey(),
        }
    }

    /// The scatter/gather entry for `len` bytes at `offset` of the range, for
    /// a raw work request; a range past the end (or over 4 GiB, an SGE's
    /// limit) is [`Error::InvalidArgument`].
    pub fn sge(&self, offset: usize, len: usize) -> Result<ffi::ibv_sge> {
        let end = offset.checked_add(len);
        if end.is_none_or(|end| end > self.region.len) || u32::try_from(len).is_err() {
            return Err(Error::InvalidArgument {
                what: "SGE range",
                reason: format!(
                    "{len} bytes at offset {offset} do not fit the {}-byte registration \
                     (or an SGE's 32-bit length)",
                    self.region.len
                ),
            });
        }
        Ok(range_sge(self.addr() + offset as u64, len, self.lkey()))
    }
}

impl fmt::Debug for CachedMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedMr")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.region.len)
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.region.access)
            .finish()
    }
}
