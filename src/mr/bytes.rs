//! Reading and writing an `Mr`'s bytes: slices for memory no peer can
//! write, copies (racy where a peer can) for any memory.

use super::Mr;
use super::racy;
use super::region::Backing;
use crate::error::{Error, Result};

impl Mr {
    fn host_ptr(&self) -> Result<*mut u8> {
        match self.region.backing {
            Backing::Heap(_) | Backing::Owned { .. } => {
                // SAFETY: off <= region len, so the result stays inside the
                // allocation (or the owned buffer's memory).
                Ok(unsafe { self.region.ptr.as_ptr().add(self.off) })
            }
            Backing::Device(_) | Backing::Borrowed | Backing::Leaked => {
                Err(Error::InvalidArgument {
                    what: "memory access",
                    reason: "this region is device (GPU) memory; copy it with the CUDA API".into(),
                })
            }
        }
    }

    /// [`Mr::host_ptr`] for a write by the CPU: refused for memory the
    /// process can only read (a read-only mapping), where a store would fault.
    fn host_ptr_mut(&self, op: &'static str) -> Result<*mut u8> {
        let p = self.host_ptr()?;
        match self.region.backing {
            Backing::Owned {
                writable: false, ..
            } => Err(Error::ReadOnlyMemory { op }),
            _ => Ok(p),
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
    /// [`ScopedBuffers`](crate::qp::scope::ScopedBuffers)).
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
        self.host_ptr_mut("a mutable slice of the bytes")?;
        let p = self.slice_check()?;
        // SAFETY: as in `part`, and `&mut self` makes the borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(p.add(offset), len) })
    }

    /// The bytes, mutably, for memory no peer can write. See [`Mr::as_slice`].
    ///
    /// Errors with [`Error::ReadOnlyMemory`] for memory the process can only
    /// read (a registered read-only mapping).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.host_ptr_mut("Mr::as_mut_slice")?;
        let p = self.slice_check()?;
        // SAFETY: as in as_slice, and &mut self makes the borrow unique.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, self.len) })
    }

    pub(super) fn range_check(&self, offset: usize, n: usize) -> Result<()> {
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

    /// Copies `src` into the range at `offset`. Works for remotely writable
    /// memory; errors with [`Error::ReadOnlyMemory`] for read-only memory.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.range_check(offset, src.len())?;
        let p = self.host_ptr_mut("Mr::write_at")?;
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

    /// Sets every byte of the range to `byte` (not for read-only memory).
    pub fn fill(&mut self, byte: u8) -> Result<()> {
        let p = self.host_ptr_mut("Mr::fill")?;
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
}
