//! The registration under every `Mr` piece: one `ibv_mr`, the memory it
//! covers, and how a failed registration is reported.

use std::alloc::{self, Layout};
use std::any::Any;
use std::mem::ManuallyDrop;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use super::{AccessFlags, Mr};
use crate::error::{Error, errno, memlock_limit};
use crate::ffi;
use crate::pd::Pd;

/// What backs a registration.
pub(crate) enum Backing {
    /// Host memory this crate allocated with `layout`.
    Heap(Layout),
    /// Memory owned elsewhere (e.g. a CUDA allocation), kept alive by the box.
    /// Not host-accessible.
    Device(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// Host memory handed over by the application ([`Mr::register`]): the
    /// buffer that owns it, its type's name (for [`Mr::into_buffer`]'s
    /// errors), and whether the process may write it (false for a read-only
    /// mapping).
    Owned {
        buf: Box<dyn Any + Send + Sync>,
        type_name: &'static str,
        writable: bool,
    },
    /// Memory the caller manages, registered through a
    /// [`RegCache`](super::RegCache): never freed here, and never reached by
    /// the CPU through the crate (the cache's handles give out keys only).
    Borrowed,
    /// Deregistration failed: the memory was deliberately leaked.
    Leaked,
}

/// One `ibv_mr` and its memory. Shared by all `Mr` pieces cut from it.
pub(crate) struct Region {
    pub(super) raw: NonNull<ffi::ibv_mr>,
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
    pub(super) access: AccessFlags,
    pub(super) backing: Backing,
    pub(super) pd: Pd,
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
    /// Deregisters and hands back what backs the memory, without freeing it;
    /// on failure the region is returned (ready for a new `Mr`), still
    /// registered, with the error.
    pub(super) fn deregister_into_backing(self) -> Result<Backing, (Arc<Region>, Error)> {
        // SAFETY: raw came from a reg_mr call; `self` is the only handle to the
        // region (moved in), so no piece is posted and the NIC no longer
        // touches the memory.
        let rc = unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
        if rc != 0 {
            return Err((Arc::new(self), Error::verb("ibv_dereg_mr", errno(rc))));
        }
        let this = ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again, so each field with a
        // destructor is read out exactly once; the others are `Copy`.
        let (backing, pd) = unsafe { (ptr::read(&this.backing), ptr::read(&this.pd)) };
        drop(pd);
        Ok(backing)
    }

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
