//! The buffers of a work request: [`Buffer`] and the list [`Sges`].

use std::fmt;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use crate::ledger::range::MrRange;
use crate::mr::{Mr, SharedMr};

/// Most scatter/gather entries a safe-path work request can carry.
pub const MAX_SAFE_SGES: usize = 4;

/// A buffer handed to the NIC: exclusively owned, part of an owned `Mr`, or a
/// shared read-only range.
///
/// `repr(u8)` fixes the layout the post path relies on (see [`MrRange`]).
#[derive(Debug)]
#[repr(u8)]
pub enum Buffer {
    /// An exclusively owned range (the NIC may write it).
    Owned(Mr) = 0,
    /// A shared read-only range (SEND/WRITE sources only).
    Shared(SharedMr) = 1,
    /// Part of an exclusively owned `Mr` ([`Mr::range`]): the NIC sees the
    /// part, [`into_mr`](Buffer::into_mr) gives back the whole `Mr`.
    Range(MrRange) = 2,
}

impl Buffer {
    /// The owned `Mr`, if this is one; for a [`Range`](Buffer::Range), the
    /// whole `Mr` it was cut from.
    #[inline]
    pub fn into_mr(self) -> Option<Mr> {
        match self {
            Buffer::Owned(m) => Some(m),
            // Its `Arc` dropped on its own: dropping the `SharedMr` in place
            // would hand the address of the whole `Buffer` to `Arc`'s slow
            // path and keep the `Buffer` on the stack.
            Buffer::Shared(s) => {
                drop(s.into_base());
                None
            }
            Buffer::Range(r) => Some(r.into_mr()),
        }
    }

    /// Bytes the NIC sees (for a range, the range's length).
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Buffer::Shared(s) => s.len(),
            // SAFETY: not Shared.
            _ => unsafe { self.nic_mr() }.len(),
        }
    }

    /// True when empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the NIC may write into it (a READ's or atomic's destination):
    /// owned, and registered with LOCAL_WRITE.
    #[inline(always)]
    pub(crate) fn locally_writable(&self) -> bool {
        match self {
            Buffer::Shared(_) => false,
            // SAFETY: not Shared.
            _ => unsafe { self.nic_mr() }
                .access()
                .contains(crate::mr::AccessFlags::LOCAL_WRITE),
        }
    }

    /// Whether the buffer is registered in `pd`.
    #[inline(always)]
    pub(crate) fn in_pd(&self, pd: &crate::pd::Pd) -> bool {
        let own = match self {
            Buffer::Shared(s) => s.pd(),
            // SAFETY: not Shared.
            _ => unsafe { self.nic_mr() }.pd(),
        };
        std::sync::Arc::ptr_eq(&own.inner, &pd.inner)
    }

    #[inline]
    pub(crate) fn sge(&self) -> crate::ffi::ibv_sge {
        match self {
            Buffer::Shared(s) => s.sge(),
            // SAFETY: not Shared.
            _ => unsafe { self.nic_mr() }.sge(),
        }
    }
}

impl From<Mr> for Buffer {
    fn from(m: Mr) -> Buffer {
        Buffer::Owned(m)
    }
}

impl From<SharedMr> for Buffer {
    fn from(s: SharedMr) -> Buffer {
        Buffer::Shared(s)
    }
}

/// The buffers of one work request: up to [`MAX_SAFE_SGES`].
///
/// One buffer (the common case) is stored inline, so building, posting and
/// retiring such a request allocates nothing and moves a 48-byte list; a
/// second buffer moves them all into one heap block of [`MAX_SAFE_SGES`]
/// entries (allocated when the request is built, not when it is posted).
pub struct Sges {
    /// Entry 0 while `spill` is `None` (initialised when `len` is 1).
    first: MaybeUninit<Buffer>,
    /// `Some`: every entry lives here, the first `len` initialised. Freed
    /// by `Drop` (so that a list without one has no drop glue for it).
    spill: ManuallyDrop<Option<Box<[MaybeUninit<Buffer>; MAX_SAFE_SGES]>>>,
    len: u8,
    /// Entries offered beyond the capacity (reported at post time).
    overflow: u32,
}

impl Default for Sges {
    #[inline(always)]
    fn default() -> Sges {
        Sges {
            first: MaybeUninit::uninit(),
            spill: ManuallyDrop::new(None),
            len: 0,
            overflow: 0,
        }
    }
}

impl Drop for Sges {
    #[inline]
    fn drop(&mut self) {
        if self.spill.is_none() {
            if self.len == 1 {
                // SAFETY: with no block, entry 0 is `first`, initialised when
                // `len` is 1; nothing reads it after this.
                unsafe { self.first.assume_init_drop() };
            }
        } else {
            self.drop_spilled();
        }
    }
}

impl fmt::Debug for Sges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl Sges {
    /// A list of one buffer.
    #[inline(always)]
    pub fn one(b: Buffer) -> Sges {
        Sges {
            first: MaybeUninit::new(b),
            spill: ManuallyDrop::new(None),
            len: 1,
            overflow: 0,
        }
    }

    /// `Drop` of a list with a heap block: its entries one at a time, then
    /// the block. A panicking entry's `Drop` does not stop the others (a
    /// second panic while the first unwinds would abort the process): the
    /// first panic resumes once every entry is dropped and the block freed.
    #[cold]
    #[inline(never)]
    fn drop_spilled(&mut self) {
        let len = self.len as usize;
        // SAFETY: `drop` runs once, and nothing reads `spill` after it.
        let Some(mut block) = (unsafe { ManuallyDrop::take(&mut self.spill) }) else {
            return;
        };
        // SAFETY: with a block, its first `len` entries are the initialised
        // ones; they are dropped once, here.
        let first_panic = unsafe { drop_each_entry(block.as_mut_ptr().cast::<Buffer>(), 0..len) };
        drop(block);
        resume_unless_unwinding(first_panic);
    }

    /// Where the entries live: `first` or the heap block.
    #[inline(always)]
    fn base(&self) -> *const Buffer {
        match &*self.spill {
            None => self.first.as_ptr(),
            Some(b) => b.as_ptr().cast::<Buffer>(),
        }
    }

    #[inline(always)]
    fn base_mut(&mut self) -> *mut Buffer {
        match &mut *self.spill {
            None => self.first.as_mut_ptr(),
            Some(b) => b.as_mut_ptr().cast::<Buffer>(),
        }
    }

    /// Appends a buffer; beyond [`MAX_SAFE_SGES`] the buffer is dropped and the
    /// request will be refused with [`TooManySges`](crate::Error::TooManySges) when posted.
    #[inline]
    pub fn push(&mut self, b: Buffer) {
        let len = self.len as usize;
        if len == 0 && self.spill.is_none() {
            self.first.write(b);
            self.len = 1;
        } else if len < MAX_SAFE_SGES {
            self.spilled()[len].write(b);
            self.len += 1;
        } else {
            self.overflow = self.overflow.saturating_add(1);
        }
    }

    /// The heap block, made on first use (with the inline entry moved in).
    #[cold]
    #[inline(never)]
    fn spilled(&mut self) -> &mut [MaybeUninit<Buffer>; MAX_SAFE_SGES] {
        if self.spill.is_none() {
            let mut block = Box::new([const { MaybeUninit::uninit() }; MAX_SAFE_SGES]);
            if self.len == 1 {
                // SAFETY: with no block, entry 0 is `first`, initialised when
                // `len` is 1; it moves to the block and `first` is not read again.
                block[0].write(unsafe { self.first.assume_init_read() });
            }
            *self.spill = Some(block);
        }
        self.spill.as_mut().expect("made above")
    }

    /// True when the list is one buffer held inline (no heap block): then
    /// [`inline_first`](Self::inline_first) is that buffer.
    #[inline(always)]
    pub(crate) fn is_one_inline(&self) -> bool {
        self.len == 1 && self.spill.is_none()
    }

    /// The inline entry, reached without choosing between it and the heap
    /// block: a pointer that may point into the list would keep a request
    /// that holds it in memory on the post path.
    ///
    /// # Safety
    /// [`is_one_inline`](Self::is_one_inline) is true.
    #[inline(always)]
    pub(crate) unsafe fn inline_first(&self) -> &Buffer {
        // SAFETY: with no block and `len` 1, `first` is initialised (caller).
        unsafe { self.first.assume_init_ref() }
    }

    /// The post path's quick pass over a list that is not one inline
    /// buffer: its total length when every buffer is in `pd`, within u32 and
    /// the list within `max_sge` entries; `None` sends the request to the
    /// full check for the error. Out of line, on a copy ([`read_copy`]).
    ///
    /// [`read_copy`]: crate::ledger::read_copy
    #[inline(never)]
    pub(crate) fn plain_len(&self, max_sge: u32, pd: &crate::pd::Pd) -> Option<u64> {
        if self.overflow != 0 || self.len() > max_sge as usize {
            return None;
        }
        let mut len = 0u64;
        for b in self.iter() {
            let l = b.len() as u64;
            if l > u64::from(u32::MAX) || !b.in_pd(pd) {
                return None;
            }
            len += l;
        }
        Some(len)
    }

    /// Removes and returns the last buffer (cheaper than consuming the list
    /// with `into_iter` when recycling buffers in a loop).
    #[inline]
    pub fn pop(&mut self) -> Option<Buffer> {
        let len = self.len.checked_sub(1)?;
        self.len = len;
        // SAFETY: entry `len` was initialised; `self.len` no longer covers it,
        // so it is read exactly once.
        Some(unsafe { self.base_mut().add(len as usize).read() })
    }

    /// Number of buffers.
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// True when there are none.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Buffers offered beyond [`MAX_SAFE_SGES`] (and dropped).
    #[inline]
    pub(crate) fn overflow(&self) -> usize {
        self.overflow as usize
    }

    /// The buffers in order.
    #[inline]
    pub fn as_slice(&self) -> &[Buffer] {
        // SAFETY: exactly the first `len` entries are initialised.
        unsafe { std::slice::from_raw_parts(self.base(), self.len()) }
    }

    /// Total bytes.
    #[inline]
    pub fn total_len(&self) -> u64 {
        self.iter().map(|b| b.len() as u64).sum()
    }

    /// The buffers in order.
    #[inline]
    pub fn iter(&self) -> std::slice::Iter<'_, Buffer> {
        self.as_slice().iter()
    }

    /// Refuses a buffer whose length does not fit an SGE's 32-bit length field
    /// (it would be truncated, and the NIC would address a different range).
    #[inline]
    pub(crate) fn check_lengths(&self) -> crate::Result<()> {
        match self.iter().find(|b| b.len() > u32::MAX as usize) {
            Some(b) => Err(crate::Error::InvalidArgument {
                what: "buffer length",
                reason: format!(
                    "{} bytes do not fit one SGE (at most {} bytes); split the buffer",
                    b.len(),
                    u32::MAX
                ),
            }),
            None => Ok(()),
        }
    }

    /// Refuses a buffer registered in another PD than `pd` (the QP's): its
    /// lkey would fail the request on the NIC and move the QP to ERR.
    #[inline]
    pub(crate) fn check_pd(&self, pd: &crate::pd::Pd) -> crate::Result<()> {
        if self.iter().all(|b| b.in_pd(pd)) {
            return Ok(());
        }
        Err(other_pd())
    }

    #[inline]
    pub(crate) fn all_owned(&self) -> bool {
        self.iter()
            .all(|b| matches!(b, Buffer::Owned(_) | Buffer::Range(_)))
    }

    /// Every buffer is an owned `Mr` registered with LOCAL_WRITE (the NIC may
    /// write it: a receive, READ or atomic destination).
    #[inline]
    pub(crate) fn all_locally_writable(&self) -> bool {
        self.iter().all(Buffer::locally_writable)
    }

    #[inline]
    pub(crate) fn take_first_owned(&mut self) -> Option<Mr> {
        if self.len == 1 && self.spill.is_none() && matches!(self.as_slice()[0], Buffer::Owned(_)) {
            // The common case (a receive or READ into one buffer).
            self.len = 0;
            // SAFETY: with no block, entry 0 is `first`, initialised; `len` is
            // 0 now, so it is read once.
            return unsafe { self.first.assume_init_read() }.into_mr();
        }
        let i = self
            .iter()
            .position(|b| matches!(b, Buffer::Owned(_) | Buffer::Range(_)))?;
        let len = self.len();
        // SAFETY: i < len, so entry i is initialised; it is read out once, the
        // initialised entries after it shift down by one and `len` shrinks, so
        // every entry stays initialised exactly once.
        let b = unsafe {
            let base = self.base_mut();
            let b = base.add(i).read();
            std::ptr::copy(base.add(i + 1), base.add(i), len - i - 1);
            b
        };
        self.len -= 1;
        b.into_mr()
    }

    /// Drops the buffers of `*p` in place, one inline buffer (the common
    /// case) right here. If a buffer's `Drop` panics, none is dropped twice.
    ///
    /// # Safety
    /// `p` is a live `Sges` that is not used (nor dropped) afterwards.
    #[inline(always)]
    pub(crate) unsafe fn drop_in_place(p: *mut Sges) {
        // SAFETY: per the contract; with one inline entry, `len` is cleared
        // before the entry (initialised) is dropped, so it is dropped exactly
        // once, and there is no block to free.
        unsafe {
            if (*p).len == 1 && (*p).spill.is_none() {
                (*p).len = 0;
                std::ptr::drop_in_place((*p).first.as_mut_ptr());
            } else {
                std::ptr::drop_in_place(p);
            }
        }
    }

    /// Moves the buffers of `*src` to `dst`: the 48-byte list itself (an
    /// inline entry with it, a heap block by its pointer).
    ///
    /// # Safety
    /// `src` is a live `Sges` that is not used (nor dropped) afterwards; `dst`
    /// is valid for writes and holds nothing that needs dropping.
    #[inline(always)]
    pub(crate) unsafe fn move_to(src: *const Sges, dst: *mut Sges) {
        // SAFETY: per the contract: the list moves bitwise (an uninitialised
        // `first` is a `MaybeUninit`), and `src` is not used again.
        unsafe { dst.write(src.read()) }
    }
}

/// Drops requests (wr_id, buffers) taken back during an unwind one at a time:
/// a second panic from a buffer's `Drop` while the first unwinds would abort
/// the process, so each is contained.
#[cold]
pub(crate) fn drop_each_catching(requests: Vec<(u64, Sges)>) {
    for r in requests {
        let _ = catch_unwind(AssertUnwindSafe(move || drop(r)));
    }
}

/// The buffers of an [`Sges`], by value.
pub struct SgesIntoIter {
    sges: Sges,
    next: u8,
}

impl Iterator for SgesIntoIter {
    type Item = Buffer;

    #[inline]
    fn next(&mut self) -> Option<Buffer> {
        if self.next >= self.sges.len {
            return None;
        }
        let i = self.next as usize;
        self.next += 1;
        // SAFETY: i < len, so entry i is initialised; `next` moved past it, so
        // Drop below never touches it again.
        Some(unsafe { self.sges.base_mut().add(i).read() })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.sges.len - self.next) as usize;
        (n, Some(n))
    }
}

impl Drop for SgesIntoIter {
    /// Drops the buffers not handed out one at a time, as `Sges`'s drop does:
    /// each once, a panic of theirs going on after the last.
    fn drop(&mut self) {
        let (from, to) = (self.next as usize, self.sges.len as usize);
        // Sges::drop must not see the entries already handed out.
        self.sges.len = 0;
        // SAFETY: `to <= MAX_SAFE_SGES`, within the entries' storage; entries
        // from..to are initialised and not handed out, and dropped once, here;
        // the block (if any) is freed by Sges::drop afterwards.
        let first_panic = unsafe { drop_each_entry(self.sges.base_mut(), from..to) };
        resume_unless_unwinding(first_panic);
    }
}

/// Drops the buffers at `base[range]` one at a time, each under its own
/// `catch_unwind`, and returns the first panic (a second one while the first
/// unwinds would abort the process).
///
/// # Safety
/// Those entries are initialised, and nothing uses or drops them afterwards.
unsafe fn drop_each_entry(
    base: *mut Buffer,
    range: std::ops::Range<usize>,
) -> Option<Box<dyn std::any::Any + Send>> {
    let mut first_panic = None;
    for i in range {
        // SAFETY: per the contract: an initialised entry, dropped once.
        let dropped = catch_unwind(AssertUnwindSafe(|| unsafe {
            std::ptr::drop_in_place(base.add(i))
        }));
        if let Err(p) = dropped {
            first_panic.get_or_insert(p);
        }
    }
    first_panic
}

/// Lets a buffer's panic go on from a drop, unless the thread is already
/// unwinding (the drop runs in its cleanup), where a second panic would abort
/// the process: that one is dropped, and the first goes on.
fn resume_unless_unwinding(panic: Option<Box<dyn std::any::Any + Send>>) {
    if let Some(p) = panic
        && !std::thread::panicking()
    {
        resume_unwind(p);
    }
}

impl fmt::Debug for SgesIntoIter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SgesIntoIter")
            .field("remaining", &(self.sges.len - self.next))
            .finish()
    }
}

impl IntoIterator for Sges {
    type Item = Buffer;
    type IntoIter = SgesIntoIter;

    #[inline]
    fn into_iter(self) -> SgesIntoIter {
        SgesIntoIter {
            sges: self,
            next: 0,
        }
    }
}

impl<'a> IntoIterator for &'a Sges {
    type Item = &'a Buffer;
    type IntoIter = std::slice::Iter<'a, Buffer>;

    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

#[cold]
#[inline(never)]
fn other_pd() -> crate::Error {
    crate::Error::InvalidArgument {
        what: "work request buffer",
        reason: "it is registered in another protection domain than the queue's; register it \
                 with the same Pd (the NIC would fail the request with a protection error and \
                 move the QP to ERR)"
            .into(),
    }
}
