//! Part of an `Mr` as a work request's buffer: [`Mr::range`] and [`MrRange`].
//!
//! A range goes to the NIC as the bytes it covers and comes back with the
//! completion as the whole `Mr` ([`Buffer::into_mr`], [`Completion::take_mr`]).
//! Its layout keeps [`Buffer`] at 32 bytes, with the sent window at the same
//! place as an owned `Mr`, so the post path reads both without telling them
//! apart and posting a whole buffer costs what it did before ranges existed.
//!
//! [`Completion::take_mr`]: crate::cq::Completion::take_mr

use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Bound, RangeBounds};

use crate::error::Error;
use crate::ledger::sges::Buffer;
use crate::mr::Mr;

/// Bytes before the window a range can give back: what its 24-bit field holds.
pub const MAX_RANGE_START: usize = (1 << 24) - 1;

/// An `Mr` narrowed to the bytes a SEND, WRITE or READ works on, made by
/// [`Mr::range`]; it becomes the whole `Mr` again with [`MrRange::into_mr`]
/// (or [`Buffer::into_mr`]).
///
/// The fields are private: only [`Mr::range`] builds one, from an `Mr` it
/// owns, so widening the window back reclaims exactly the bytes it cut off.
/// Packed, so that inside a [`Buffer`] (`repr(u8)`: the tag, then this at
/// offset 1) the window sits at offset 8, where an owned `Mr` does.
#[repr(C, packed)]
pub struct MrRange {
    /// Bytes cut off before the window, little-endian.
    head: [u8; 3],
    /// Bytes cut off after the window.
    tail: u32,
    /// The bytes the NIC sees.
    window: Mr,
}

const _: () = {
    assert!(
        size_of::<Buffer>() == 32,
        "the post and poll paths copy Buffers"
    );
    assert!(align_of::<MrRange>() == 1 && size_of::<MrRange>() == 31);
    assert!(align_of::<Buffer>() == align_of::<Mr>());
};

impl MrRange {
    /// Bytes the work request sends, writes or reads.
    pub fn len(&self) -> usize {
        self.with_window(Mr::len)
    }

    /// True for a zero-byte range (a zero-byte SEND or WRITE).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the window starts in the whole `Mr`.
    pub fn start(&self) -> usize {
        let [a, b, c] = self.head;
        usize::from(a) | usize::from(b) << 8 | usize::from(c) << 16
    }

    /// The whole `Mr` the range was cut from.
    pub fn into_mr(self) -> Mr {
        let (head, tail) = (self.start(), self.tail as usize);
        let MrRange { window, .. } = self;
        let mut mr = window;
        // SAFETY: `Mr::range` narrowed this Mr by exactly `head` bytes before
        // and `tail` after, and consumed the Mr that owned them; the fields
        // are private, so no other Mr owns them and widening reclaims them.
        unsafe { mr.widen(head, tail) };
        mr
    }

    /// Lends the window to `f` (a packed field cannot be borrowed in place).
    fn with_window<R>(&self, f: impl FnOnce(&Mr) -> R) -> R {
        // SAFETY: a bitwise copy of the live window, read unaligned as the
        // field may be; ManuallyDrop keeps it from being dropped, so the
        // registration's reference count is untouched.
        let w = ManuallyDrop::new(unsafe { std::ptr::read_unaligned(&raw const self.window) });
        f(&w)
    }
}

impl Buffer {
    /// The `Mr` the NIC sees of an `Owned` or `Range` buffer, without a
    /// branch between the two.
    ///
    /// # Safety
    /// `self` is not [`Buffer::Shared`].
    #[inline(always)]
    pub(crate) unsafe fn nic_mr(&self) -> &Mr {
        // SAFETY: `Buffer` is `repr(u8)`: each variant is laid out as a
        // `repr(C)` struct of the tag and its field. `Owned`'s Mr is at
        // offset 8 (its alignment); `Range`'s MrRange (alignment 1) at offset
        // 1, and its window, after 3 + 4 packed bytes, at 8 as well. A Buffer
        // is aligned as an Mr, so either is an aligned, live Mr borrowed for
        // `self`'s lifetime; the caller excluded `Shared`.
        unsafe { &*(self as *const Buffer).cast::<u8>().add(8).cast::<Mr>() }
    }
}

impl fmt::Debug for MrRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tail = self.tail;
        self.with_window(|w| {
            f.debug_struct("MrRange")
                .field("start", &self.start())
                .field("window", w)
                .field("after", &tail)
                .finish()
        })
    }
}

impl From<MrRange> for Buffer {
    #[inline]
    fn from(r: MrRange) -> Buffer {
        Buffer::Range(r)
    }
}

impl Mr {
    /// The bytes `range` of this `Mr` as a work request's buffer: a SEND,
    /// WRITE or READ covers only those bytes, and the completion gives back
    /// the whole `Mr` ([`Completion::take_mr`](crate::cq::Completion::take_mr),
    /// [`Buffer::into_mr`]).
    ///
    /// ```no_run
    /// # use rdma_verbs::prelude::*;
    /// # fn f(qp: &mut rdma_verbs::qp::Qp<rdma_verbs::qp::Rc, rdma_verbs::qp::Rts>, buf: Mr, n: usize) -> rdma_verbs::error::Result<()> {
    /// // The first n bytes of `buf` (a zero-length range is a zero-byte SEND).
    /// qp.post_send(SendWr::send_from(1, buf.range(..n)?))?;
    /// # Ok(()) }
    /// ```
    ///
    /// A range starts at most [`MAX_RANGE_START`] bytes into the `Mr` and ends
    /// at most `u32::MAX` bytes before its end (where the whole `Mr` is kept
    /// while the request is in flight); beyond those, or outside the `Mr`, the
    /// error is [`RangeError`], which gives the `Mr` back.
    pub fn range(self, range: impl RangeBounds<usize>) -> Result<MrRange, RangeError> {
        let len = self.len();
        let start = match range.start_bound() {
            Bound::Included(&s) => Some(s),
            Bound::Excluded(&s) => s.checked_add(1),
            Bound::Unbounded => Some(0),
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.checked_add(1),
            Bound::Excluded(&e) => Some(e),
            Bound::Unbounded => Some(len),
        };
        let (start, end) = match (start, end) {
            (Some(s), Some(e)) if s <= e && e <= len => (s, e),
            _ => {
                let shown = |b: Bound<&usize>| match b {
                    Bound::Included(v) => format!("{v} (included)"),
                    Bound::Excluded(v) => format!("{v} (excluded)"),
                    Bound::Unbounded => "open".to_owned(),
                };
                let reason = format!(
                    "the range from {} to {} is outside this {len}-byte Mr; \
                     pass a range within 0..{len}",
                    shown(range.start_bound()),
                    shown(range.end_bound()),
                );
                return Err(RangeError::new(self, reason));
            }
        };
        let tail = len - end;
        if start > MAX_RANGE_START || u32::try_from(tail).is_err() {
            let reason = format!(
                "the range {start}..{end} leaves {start} bytes before it and {tail} after it; \
                 a range keeps at most {MAX_RANGE_START} bytes before and {} after, so \
                 split the Mr first (split_to, split_off) and take the range of the piece",
                u32::MAX
            );
            return Err(RangeError::new(self, reason));
        }
        let mut window = self;
        window.narrow(start, end - start);
        let [a, b, c, _] = (start as u32).to_le_bytes();
        Ok(MrRange {
            head: [a, b, c],
            tail: tail as u32,
            window,
        })
    }
}

/// [`Mr::range`] refused the range: why, and the `Mr`, unchanged.
///
/// Converts into [`Error`] (dropping the `Mr`) for `?`.
pub struct RangeError {
    /// Why ([`Error::InvalidArgument`]).
    pub error: Error,
    /// The `Mr` the range was asked of.
    pub mr: Mr,
}

impl RangeError {
    #[cold]
    fn new(mr: Mr, reason: String) -> RangeError {
        RangeError {
            error: Error::InvalidArgument {
                what: "Mr range",
                reason,
            },
            mr,
        }
    }
}

impl fmt::Debug for RangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RangeError")
            .field("error", &self.error)
            .field("mr", &self.mr)
            .finish()
    }
}

impl fmt::Display for RangeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for RangeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<RangeError> for Error {
    fn from(e: RangeError) -> Error {
        e.error
    }
}
