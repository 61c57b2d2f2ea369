//! Shared and remote views of registered memory: [`SharedMr`], a read-only
//! range posted many times at once, and [`RemoteMr`], a peer's region as data.

use std::fmt;
use std::sync::Arc;

use super::{Mr, debug_range, range_sge};
use crate::error::{Error, Result};
use crate::ffi;
use crate::pd::Pd;

impl Mr {
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
    /// The shared region, without the range.
    #[inline(always)]
    pub(crate) fn into_base(self) -> Arc<Mr> {
        self.base
    }

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
                reason: format!(
                    "{} bytes at {offset} run past the end of this {}-byte shared range",
                    dst.len(),
                    self.len
                ),
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
        range_sge(self.addr(), self.len, self.lkey())
    }
}

impl fmt::Debug for SharedMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        debug_range(f, "SharedMr", self.addr(), self.len, self.lkey()).finish()
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
    /// The length of [`to_bytes`](Self::to_bytes)'s form.
    pub const WIRE_LEN: usize = 20;

    /// The region as 20 bytes to hand a peer, for instance in rdma_cm private
    /// data (`ConnParam::private_data`: at most 56 bytes on connect, 196 on
    /// accept): address, length and rkey, big-endian. The peer reads it with
    /// [`from_bytes`](Self::from_bytes).
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0; Self::WIRE_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..16].copy_from_slice(&self.len.to_be_bytes());
        b[16..].copy_from_slice(&self.rkey.to_be_bytes());
        b
    }

    /// The region a peer sent with [`to_bytes`](Self::to_bytes), from the
    /// first 20 bytes of `bytes` (private data arrives padded with zeros).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (`"remote region"`) for fewer than 20 bytes
    /// or a region whose end overflows the address space.
    pub fn from_bytes(bytes: &[u8]) -> Result<RemoteMr> {
        let refuse = |reason: String| Error::InvalidArgument {
            what: "remote region",
            reason,
        };
        let Some(b) = bytes.get(..Self::WIRE_LEN) else {
            return Err(refuse(format!(
                "{} bytes, where RemoteMr::to_bytes gives {}",
                bytes.len(),
                Self::WIRE_LEN
            )));
        };
        let word =
            |r: std::ops::Range<usize>| b[r].iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x));
        let r = RemoteMr {
            addr: word(0..8),
            len: word(8..16),
            rkey: word(16..20) as u32,
        };
        if r.addr.checked_add(r.len).is_none() {
            return Err(refuse(format!(
                "address {:#x} + length {} overflows",
                r.addr, r.len
            )));
        }
        Ok(r)
    }

    /// Checks that `[offset, offset+len)` lies inside the region, and its
    /// addresses inside the 64-bit address space (the fields are public, so a
    /// region built by hand may claim to wrap), and returns its address.
    #[inline]
    pub fn checked_addr(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            // Inside the region clipped to the address space (`!addr` is
            // `u64::MAX - addr`), so `addr + offset` does not wrap either.
            Some(end) if end <= self.len.min(!self.addr) => Ok(self.addr.wrapping_add(offset)),
            _ => Err(Error::RemoteOutOfBounds {
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_past_the_top_of_the_address_space_is_out_of_bounds() {
        // Ranges end before 2^64 (as `from_bytes` requires of a region).
        let r = RemoteMr {
            addr: u64::MAX - 4,
            len: 16,
            rkey: 1,
        };
        assert_eq!(r.checked_addr(0, 4).unwrap(), u64::MAX - 4);
        assert_eq!(r.checked_addr(3, 1).unwrap(), u64::MAX - 1);
        for (offset, len) in [(0, 8), (4, 1), (3, 2), (0, 5)] {
            assert!(
                matches!(
                    r.checked_addr(offset, len),
                    Err(Error::RemoteOutOfBounds { region_len: 16, .. })
                ),
                "[{offset}, {offset}+{len})"
            );
        }
        assert!(r.checked_addr(u64::MAX, 2).is_err());
    }

    #[test]
    fn remote_regions_go_to_bytes_and_back() {
        let r = RemoteMr {
            addr: 0x0102_0304_0506_0708,
            len: 1 << 20,
            rkey: 0xdead_beef,
        };
        let mut padded = r.to_bytes().to_vec();
        assert_eq!(padded[..4], [1, 2, 3, 4]);
        padded.resize(196, 0);
        assert_eq!(RemoteMr::from_bytes(&padded).unwrap(), r);
        assert!(matches!(
            RemoteMr::from_bytes(&padded[..19]),
            Err(Error::InvalidArgument {
                what: "remote region",
                ..
            })
        ));
        let wraps = RemoteMr {
            addr: u64::MAX,
            len: 2,
            rkey: 1,
        };
        assert!(matches!(
            RemoteMr::from_bytes(&wraps.to_bytes()),
            Err(Error::InvalidArgument {
                what: "remote region",
                ..
            })
        ));
    }

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
}
