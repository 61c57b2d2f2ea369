//! The buffers a scoped request borrows: [`Src`] (the NIC reads it) and
//! [`Dst`] (the NIC writes it).

use std::marker::PhantomData;

use crate::error::{Error, Result};
use crate::ffi;
use crate::mr::{AccessFlags, Mr, SharedMr};

/// A registered buffer the NIC may read (a SEND or WRITE source), borrowed
/// for `'scope`.
///
/// Register it in the PD of the QPs it is posted to: unlike the
/// ownership-passing path, a scoped post does not compare PDs (it costs
/// every post), so a buffer of another PD fails on the NIC, with
/// `LOC_PROT_ERR` (rxe: `LOC_QP_OP_ERR`), and moves the QP to ERR. The same
/// holds for [`Dst`].
#[derive(Clone, Copy, Debug)]
pub struct Src<'scope> {
    pub(super) sge: ffi::ibv_sge,
    _borrow: PhantomData<&'scope [u8]>,
}

impl<'scope> Src<'scope> {
    /// All of `mr`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a region over 4 GiB − 1 bytes (a
    /// scatter entry's limit).
    pub fn new(mr: &'scope Mr) -> Result<Src<'scope>> {
        Ok(Src {
            sge: checked_sge(mr.addr(), mr.len(), mr.lkey())?,
            _borrow: PhantomData,
        })
    }

    /// A buffer of a [`ScopedBuffers`](super::ScopedBuffers): `sge` names
    /// memory borrowed for `'scope` that the caller keeps from Rust writes
    /// while a request posted with it is in flight.
    pub(super) fn lent(sge: ffi::ibv_sge) -> Src<'scope> {
        Src {
            sge,
            _borrow: PhantomData,
        }
    }

    /// All of a shared (read-only) region.
    ///
    /// # Errors
    /// As [`Src::new`].
    pub fn shared(mr: &'scope SharedMr) -> Result<Src<'scope>> {
        Ok(Src {
            sge: checked_sge(mr.addr(), mr.len(), mr.lkey())?,
            _borrow: PhantomData,
        })
    }
}

/// A registered buffer the NIC may write (a receive, READ or atomic
/// destination), borrowed exclusively for `'scope`: no Rust code can read or
/// write it until the scope has ended. It is `Copy`, so several requests can
/// target the same memory (what they leave there is the NIC's business).
#[derive(Clone, Copy, Debug)]
pub struct Dst<'scope> {
    pub(super) sge: ffi::ibv_sge,
    _borrow: PhantomData<&'scope [u8]>,
}

impl<'scope> Dst<'scope> {
    /// All of `mr`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `mr` lacks
    /// [`AccessFlags::LOCAL_WRITE`] (the NIC would fail every request with
    /// a protection error) or is over 4 GiB − 1 bytes.
    pub fn new(mr: &'scope mut Mr) -> Result<Dst<'scope>> {
        if !mr.access().contains(AccessFlags::LOCAL_WRITE) {
            return Err(Error::InvalidArgument {
                what: "destination buffer",
                reason: "the NIC writes it, so its Mr needs AccessFlags::LOCAL_WRITE".into(),
            });
        }
        Ok(Dst {
            sge: checked_sge(mr.addr(), mr.len(), mr.lkey())?,
            _borrow: PhantomData,
        })
    }
}

/// `slice`, `len` and `is_empty`, the same for both kinds of lent buffer.
macro_rules! lent_buffer {
    ($kind:ident) => {
        impl<'scope> $kind<'scope> {
            /// Bytes `offset..offset + len` of this buffer.
            ///
            /// # Errors
            /// [`Error::InvalidArgument`] when the range is not inside it.
            pub fn slice(self, offset: usize, len: usize) -> Result<$kind<'scope>> {
                Ok($kind {
                    sge: sub_sge(self.sge, offset, len)?,
                    _borrow: PhantomData,
                })
            }

            /// Length in bytes.
            pub fn len(&self) -> usize {
                self.sge.length as usize
            }

            /// True when empty.
            pub fn is_empty(&self) -> bool {
                self.sge.length == 0
            }
        }
    };
}

lent_buffer!(Src);
lent_buffer!(Dst);

fn checked_sge(addr: u64, len: usize, lkey: u32) -> Result<ffi::ibv_sge> {
    let length = u32::try_from(len).map_err(|_| Error::InvalidArgument {
        what: "scoped buffer",
        reason: format!("{len} bytes exceed a scatter entry's 4 GiB - 1; slice it"),
    })?;
    Ok(ffi::ibv_sge { addr, length, lkey })
}

fn sub_sge(sge: ffi::ibv_sge, offset: usize, len: usize) -> Result<ffi::ibv_sge> {
    match offset.checked_add(len) {
        Some(end) if end <= sge.length as usize => Ok(ffi::ibv_sge {
            addr: sge.addr + offset as u64,
            length: len as u32,
            lkey: sge.lkey,
        }),
        _ => Err(Error::InvalidArgument {
            what: "buffer slice",
            reason: format!(
                "{offset}..{offset}+{len} is not inside the {} bytes",
                sge.length
            ),
        }),
    }
}
