//! Registering memory the application already holds: [`Mr::register`] takes
//! ownership of a buffer whose address cannot move, [`Mr::into_buffer`] gives
//! it back, and [`Mr::register_raw`] registers memory the caller manages.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::region::{Backing, Region};
use super::{AccessFlags, Mr, check_len_access, reg_mr};
use crate::error::{Error, Result};
use crate::pd::Pd;

/// Host memory that an [`Mr`] can take over and register in place
/// ([`Mr::register`]), without copying it.
///
/// Implemented for `Vec<u8>` (its `len` bytes; the spare capacity is not
/// registered), `Box<[u8]>`, [`AnonMemory`](super::AnonMemory) and, with the
/// `memmap2` feature, `memmap2::MmapMut` (writable) and `memmap2::Mmap`
/// (read-only: registered only without write access).
///
/// # Safety
/// An implementation promises, for a value `b`:
/// - `b.memory()` returns the same `(ptr, len)` every time, and moving `b`
///   does not change it (the bytes live outside the value: on the heap, in a
///   mapping);
/// - `[ptr, ptr+len)` stays mapped and readable while `b` lives, and also
///   writable by the process when `b.host_writable()` is true (then it
///   returns true every time);
/// - while `b` lives, nothing but `b` can reach those bytes: no other value,
///   thread or process reads or writes them (so moving `b` into an `Mr`
///   leaves the NIC and the `Mr` the only ones touching them).
pub unsafe trait OwnedMemory: Send + Sync + 'static {
    /// The start and length of the memory.
    fn memory(&mut self) -> (*mut u8, usize);

    /// Whether the process may write the memory (false for a read-only
    /// mapping, which is then registered only without write access).
    fn host_writable(&self) -> bool {
        true
    }
}

// SAFETY: a Vec's heap buffer does not move with the Vec and is reached only
// through it; `len` bytes of it are initialised and writable.
unsafe impl OwnedMemory for Vec<u8> {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: as for Vec: the boxed bytes stay put and belong to the box alone.
unsafe impl OwnedMemory for Box<[u8]> {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: the mapping stays at its address until the value unmaps it on drop;
// creating it (`unsafe` in memmap2) promised that nothing else modifies the
// file's mapped bytes meanwhile.
#[cfg(feature = "memmap2")]
unsafe impl OwnedMemory for memmap2::MmapMut {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: as for MmapMut; the mapping is read-only, which host_writable says.
#[cfg(feature = "memmap2")]
unsafe impl OwnedMemory for memmap2::Mmap {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.as_ptr().cast_mut(), self.len())
    }

    fn host_writable(&self) -> bool {
        false
    }
}

/// Write rights the kernel pins pages for writing to serve (`ib_access_writable`).
const WRITE_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC)
    .union(AccessFlags::MW_BIND);

impl Mr {
    /// Registers `buf` in place, taking ownership of it until the registration
    /// ends: the result is an ordinary `Mr` over `buf`'s bytes (split, freeze,
    /// post it as any other), and [`Mr::into_buffer`] gives `buf` back.
    ///
    /// Errors: an empty buffer is [`Error::InvalidArgument`]; a read-only
    /// buffer (`memmap2::Mmap`) asked for LOCAL_WRITE, REMOTE_WRITE,
    /// REMOTE_ATOMIC or MW_BIND is [`Error::ReadOnlyMemory`]; over the
    /// memlock limit, [`Error::MemlockLimit`]. On any error `buf` is dropped
    /// and nothing stays registered.
    #[doc(alias("ibv_reg_mr", "ibv_reg_mr_iova2"))]
    pub fn register<B: OwnedMemory>(pd: &Pd, buf: B, access: AccessFlags) -> Result<Mr> {
        // Boxed first, and the memory asked of the boxed value, which is not
        // moved again: moving a `Box<[u8]>` re-borrows its heap block, so a
        // pointer taken before the move would not be valid after it, for
        // Rust's aliasing rules, even at the same address.
        let mut boxed = Box::new(buf);
        let (ptr, len) = boxed.memory();
        let writable = boxed.host_writable();
        check_len_access(len, access)?;
        if !writable && access.intersects(WRITE_ACCESS) {
            return Err(Error::ReadOnlyMemory {
                op: "registration with LOCAL_WRITE, REMOTE_WRITE, REMOTE_ATOMIC or MW_BIND",
            });
        }
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::InvalidArgument {
            what: "MR address",
            reason: "the buffer's memory pointer is null".into(),
        })?;
        // The box's pointer is what moves from here on, never the buffer.
        let buf: Box<dyn Any + Send + Sync> = boxed;
        // SAFETY: `buf` keeps [ptr, ptr+len) mapped until dropped, and the
        // region drops it only after deregistering (or on failure right here).
        let raw = unsafe { reg_mr(pd, ptr, len, access) }.map_err(file_hint)?;
        let region = Region {
            raw,
            ptr,
            len,
            access,
            backing: Backing::Owned {
                buf,
                type_name: std::any::type_name::<B>(),
                writable,
            },
            pd: pd.clone(),
        };
        Ok(Mr {
            region: Arc::new(region),
            off: 0,
            len,
        })
    }

    /// Registers `len` bytes at `ptr` that the caller manages (memory from a C
    /// library, shared memory), keeping `keepalive` until the registration
    /// ends; it is dropped right after deregistration, so it may own (and on
    /// drop free) the memory.
    ///
    /// The result is an ordinary `Mr`: host access through it
    /// ([`Mr::as_slice`], [`Mr::write_at`], ...) works as for any other.
    ///
    /// # Safety
    /// - `[ptr, ptr+len)` is mapped, readable and writable by this process,
    ///   and stays so until `keepalive` is dropped (after the returned `Mr`,
    ///   every piece split from it, every [`SharedMr`](super::SharedMr)
    ///   frozen from it and every work request posted with them are gone);
    /// - until then nothing but the returned `Mr` (and its pieces) reads or
    ///   writes those bytes: no C code, thread, other process or Rust
    ///   reference, since the NIC may write them whenever a piece is posted
    ///   and the `Mr` hands out slices that assume no one else writes.
    ///
    /// A zero `len` or a null `ptr` is refused with
    /// [`Error::InvalidArgument`] before anything reaches the kernel.
    /// For memory the process may only read, implement [`OwnedMemory`] with
    /// `host_writable` false instead.
    #[doc(alias("ibv_reg_mr", "ibv_reg_mr_iova2"))]
    pub unsafe fn register_raw(
        pd: &Pd,
        ptr: *mut u8,
        len: usize,
        access: AccessFlags,
        keepalive: impl Send + Sync + 'static,
    ) -> Result<Mr> {
        /// The caller's memory as an `OwnedMemory`, sound by `register_raw`'s contract.
        struct Raw<K> {
            ptr: *mut u8,
            len: usize,
            _keepalive: K,
        }
        // SAFETY: the pointer is only dereferenced through the Mr, which the
        // caller may send and share like any other (register_raw's contract).
        unsafe impl<K: Send> Send for Raw<K> {}
        // SAFETY: as above; &Raw gives nothing out.
        unsafe impl<K: Sync> Sync for Raw<K> {}
        // SAFETY: register_raw's contract is this trait's for `[ptr, ptr+len)`.
        unsafe impl<K: Send + Sync + 'static> OwnedMemory for Raw<K> {
            fn memory(&mut self) -> (*mut u8, usize) {
                (self.ptr, self.len)
            }
        }
        let raw = Raw {
            ptr,
            len,
            _keepalive: keepalive,
        };
        Mr::register(pd, raw, access)
    }

    /// Deregisters this `Mr` and gives back the buffer [`Mr::register`] took,
    /// with whatever the NIC and the application wrote into it.
    ///
    /// Works when this `Mr` is the whole registration: no piece split off it
    /// is alive elsewhere (rejoin them with [`Mr::unsplit`]) and no
    /// [`SharedMr`](super::SharedMr) clone or posted request holds it. Otherwise,
    /// or when `B` is not the registered type, or the memory is not an owned
    /// buffer, the `Mr` comes back in the error, still registered.
    pub fn into_buffer<B: OwnedMemory>(self) -> Result<B, MrRefused> {
        if let Err(error) = self.check_whole::<B>() {
            return Err(MrRefused { mr: self, error });
        }
        let Mr { region, off, len } = self;
        let region = match Arc::try_unwrap(region) {
            Ok(region) => region,
            Err(region) => {
                let error = Error::InvalidArgument {
                    what: "Mr::into_buffer",
                    reason: "another handle shares this registration (a piece split off it, a \
                             SharedMr clone or a posted request); rejoin or retire them first"
                        .into(),
                };
                let mr = Mr { region, off, len };
                return Err(MrRefused { mr, error });
            }
        };
        match region.deregister_into_backing() {
            // check_whole saw an owned `B` in this (unshared) region.
            Ok(Backing::Owned { buf, .. }) => match buf.downcast::<B>() {
                Ok(b) => Ok(*b),
                Err(_) => unreachable!("check_whole saw a {}", std::any::type_name::<B>()),
            },
            Ok(_) => unreachable!("check_whole saw an owned backing"),
            Err((region, error)) => Err(MrRefused {
                mr: Mr { region, off, len },
                error,
            }),
        }
    }

    /// Whether this `Mr` spans the whole registration of an owned `B`.
    fn check_whole<B: 'static>(&self) -> Result<()> {
        let Backing::Owned { buf, type_name, .. } = &self.region.backing else {
            return Err(Error::InvalidArgument {
                what: "Mr::into_buffer",
                reason: "this Mr's memory was not registered with Mr::register (no buffer to \
                         give back)"
                    .into(),
            });
        };
        if !buf.is::<B>() {
            return Err(Error::InvalidArgument {
                what: "Mr::into_buffer",
                reason: format!(
                    "the registered buffer is a {type_name}, not a {}",
                    std::any::type_name::<B>()
                ),
            });
        }
        if self.off != 0 || self.len != self.region.len {
            return Err(Error::InvalidArgument {
                what: "Mr::into_buffer",
                reason: format!(
                    "this Mr is bytes [{}, {}) of a {}-byte registration; rejoin the pieces \
                     with Mr::unsplit first",
                    self.off,
                    self.off + self.len,
                    self.region.len
                ),
            });
        }
        Ok(())
    }
}

/// Adds what usually causes EFAULT on an owned buffer: a file mapping the
/// kernel will not pin for writing.
fn file_hint(e: Error) -> Error {
    match e {
        Error::Verb {
            verb,
            source,
            hint: None,
        } if source.raw_os_error() == Some(libc::EFAULT) => Error::Verb {
            verb,
            source,
            hint: Some(
                "the kernel could not pin the memory. A read-only shared file mapping: kernels \
                 before 6.2 pin every registration for writing, which it refuses; map the file \
                 privately (memmap2::MmapOptions::map_copy_read_only). A writable shared file \
                 mapping: kernels from 6.5 refuse long-term write pins of files on filesystems \
                 with dirty tracking (ext4, xfs, ...); register it without write access, map it \
                 privately, put the file on tmpfs/hugetlbfs, or copy it"
                    .into(),
            ),
        },
        e => e,
    }
}

/// A call that takes an `Mr` ([`Mr::into_buffer`],
/// [`MrPool::put`](super::MrPool::put)) refused it: the error, and the `Mr`
/// back, unchanged and still registered.
pub struct MrRefused {
    /// The `Mr` that was handed in.
    pub mr: Mr,
    /// Why: a split or shared registration, another buffer type, a failed
    /// deregistration, a buffer of another pool.
    pub error: Error,
}

impl fmt::Debug for MrRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MrRefused")
            .field("mr", &self.mr)
            .field("error", &self.error)
            .finish()
    }
}

impl fmt::Display for MrRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for MrRefused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<MrRefused> for Error {
    fn from(e: MrRefused) -> Error {
        e.error
    }
}
