//! A pool of fixed-size registered buffers carved from one registration.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::owned::MrRefused;
use super::{AccessFlags, Mr};
use crate::error::{Error, Result};
use crate::pd::Pd;

/// The most buffers one [`MrPool`] holds (16 Mi): its free list takes 24
/// bytes per buffer, allocated up front.
pub const MAX_POOL_BUFFERS: usize = 1 << 24;

/// Fixed-size buffers cut from one registration, handed out as ordinary
/// [`Mr`] pieces and taken back.
///
/// A buffer from [`MrPool::get`] is an `Mr` like any other: post it on any
/// data path (SEND source, READ destination, receive buffer of a QP or an
/// SRQ, scopes, tokio), split it, freeze it; give it back with
/// [`MrPool::put`] (a buffer that is dropped instead is simply lost to the
/// pool). Getting and putting take a mutex over a stack with room for every
/// buffer: no system call (uncontended) and no allocation. The pool is `Sync`:
/// share it between threads by reference or in an `Arc`. The registration
/// ends when the pool and every buffer out of it are dropped. A buffer posted
/// as a receive stays with its queue until it completes or the queue is
/// dropped (an [`Srq`](crate::srq::Srq) outlives the QPs that used it), so
/// [`available`](MrPool::available) counts it out until then.
pub struct MrPool {
    /// An empty piece at the end of the registration: names it for `put`.
    anchor: Mr,
    /// Offset of the first buffer in the registration.
    base: usize,
    buf_len: usize,
    count: usize,
    free: Mutex<Vec<Mr>>,
}

impl MrPool {
    /// Registers `count` buffers of `buf_len` bytes each in one registration
    /// of zeroed, page-aligned memory ([`Mr::new`]). `count` is 1 to
    /// [`MAX_POOL_BUFFERS`], refused otherwise before anything is registered.
    pub fn new(pd: &Pd, buf_len: usize, count: usize, access: AccessFlags) -> Result<MrPool> {
        let total = buf_len
            .checked_mul(count)
            .ok_or_else(|| Error::InvalidArgument {
                what: "pool size",
                reason: format!("{count} buffers of {buf_len} bytes overflow usize"),
            })?;
        if total == 0 || count > MAX_POOL_BUFFERS {
            return Err(Error::InvalidArgument {
                what: "pool size",
                reason: format!(
                    "{count} buffers of {buf_len} bytes: needs 1 to MAX_POOL_BUFFERS \
                     ({MAX_POOL_BUFFERS}) buffers of at least 1 byte"
                ),
            });
        }
        MrPool::from_mr(Mr::new(pd, total, access)?, buf_len)
    }

    /// Cuts an existing `Mr` (a registration on huge pages, an owned buffer
    /// registered with [`Mr::register`]) into buffers of `buf_len` bytes; the
    /// bytes after the last whole buffer are not handed out. Refused when that
    /// makes no buffer or more than [`MAX_POOL_BUFFERS`].
    pub fn from_mr(mut mr: Mr, buf_len: usize) -> Result<MrPool> {
        let count = mr.len().checked_div(buf_len).unwrap_or(0);
        if count == 0 || count > MAX_POOL_BUFFERS {
            return Err(Error::InvalidArgument {
                what: "pool buffer length",
                reason: format!(
                    "{buf_len} bytes: must be at least 1 and at most the {} bytes of the Mr, \
                     and cut it into at most MAX_POOL_BUFFERS ({MAX_POOL_BUFFERS}) buffers",
                    mr.len()
                ),
            });
        }
        let base = mr.off;
        // The bytes after the last whole buffer are dropped (unused).
        drop(mr.split_off(count * buf_len)?);
        let anchor = mr.split_off(mr.len())?;
        let mut free = Vec::new();
        // Fallible: a tiny `buf_len` on a large Mr asks for a list that an
        // infallible allocation would abort the process over.
        if free.try_reserve_exact(count).is_err() {
            return Err(Error::InvalidArgument {
                what: "pool buffer length",
                reason: format!(
                    "{buf_len} bytes cuts the Mr into {count} buffers, whose free list could not \
                     be allocated: use larger buffers"
                ),
            });
        }
        // Pushed from the highest address down: `get` hands out the lowest first.
        while !mr.is_empty() {
            free.push(mr.split_off(mr.len() - buf_len)?);
        }
        Ok(MrPool {
            anchor,
            base,
            buf_len,
            count,
            free: Mutex::new(free),
        })
    }

    /// A free buffer, or `None` when all are out.
    pub fn get(&self) -> Option<Mr> {
        self.lock().pop()
    }

    /// Takes a buffer back. Refused, with the `Mr` back in the error, when it
    /// is not one of this pool's buffers as handed out (another pool's or
    /// registration's, or a piece of another length: rejoin the pieces first).
    pub fn put(&self, mr: Mr) -> Result<(), MrRefused> {
        if !self.is_ours(&mr) {
            let error = self.not_ours(&mr);
            return Err(MrRefused { mr, error });
        }
        // Pieces of one registration are disjoint, so at most `count` buffers
        // of this length and alignment exist: the push stays within the
        // capacity reserved in `from_mr` and never allocates.
        let mut free = self.lock();
        debug_assert!(free.len() < self.count);
        free.push(mr);
        Ok(())
    }

    /// Whether `mr` is one of this pool's buffers as handed out.
    #[inline]
    pub(super) fn is_ours(&self, mr: &Mr) -> bool {
        Arc::ptr_eq(&mr.region, &self.anchor.region)
            && mr.len == self.buf_len
            && mr.off >= self.base
            && mr.off + mr.len <= self.anchor.off
            && (mr.off - self.base) % self.buf_len == 0
    }

    /// The refusal of a buffer that [`MrPool::is_ours`] rejected.
    #[cold]
    pub(super) fn not_ours(&self, mr: &Mr) -> Error {
        Error::InvalidArgument {
            what: "pool buffer",
            reason: format!(
                "this {}-byte Mr is not one of this pool's {}-byte buffers (another pool's \
                 or registration's, or a piece cut from one); return it to the pool it \
                 came from, whole",
                mr.len, self.buf_len
            ),
        }
    }

    /// Buffers in the pool now (not handed out).
    pub fn available(&self) -> usize {
        self.lock().len()
    }

    /// Buffers the pool was cut into.
    pub fn capacity(&self) -> usize {
        self.count
    }

    /// Bytes per buffer.
    pub fn buf_len(&self) -> usize {
        self.buf_len
    }

    /// The stack; a thread that panicked while holding it left it whole
    /// (push and pop do not panic half-way), so poisoning is ignored.
    fn lock(&self) -> MutexGuard<'_, Vec<Mr>> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl fmt::Debug for MrPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrPool")
            .field("buf_len", &self.buf_len)
            .field("capacity", &self.count)
            .field("available", &self.available())
            .field("lkey", &format_args!("{:#x}", self.anchor.lkey()))
            .finish()
    }
}
