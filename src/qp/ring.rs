//! The per-QP slot rings that hold posted buffers until their completion.
//!
//! Each queue (SQ, RQ) of a QP has a ring of `depth` slots. Posting stores the
//! work request's buffers in the next slot and passes the slot's address as
//! the `wr_id`; polling reads the address back from the completion, takes the
//! buffers out and advances the ring's tail. Queues complete in order, so a
//! completion for slot `k` also retires every unsignaled slot before it.
//!
//! Concurrency: the poster (`&mut Qp`) is the only producer, the poller of the
//! queue's CQ (`&mut Cq`) the only consumer. A slot is handed over with its
//! `state` (Release on post, Acquire on retire) and handed back through
//! `tail` (Release on retire, Acquire on post).

use std::cell::UnsafeCell;
use std::fmt;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use crate::mr::{Mr, SharedMr};

/// Most scatter/gather entries a safe-path work request can carry.
pub const MAX_SAFE_SGES: usize = 4;

/// A buffer handed to the NIC: exclusively owned, or a shared read-only range.
#[derive(Debug)]
pub enum Buffer {
    /// An exclusively owned range (the NIC may write it).
    Owned(Mr),
    /// A shared read-only range (SEND/WRITE sources only).
    Shared(SharedMr),
}

impl Buffer {
    /// The owned `Mr`, if this is one.
    #[inline]
    pub fn into_mr(self) -> Option<Mr> {
        match self {
            Buffer::Owned(m) => Some(m),
            Buffer::Shared(_) => None,
        }
    }

    /// Bytes in the buffer.
    #[inline]
    pub fn len(&self) -> usize {
        match self {
            Buffer::Owned(m) => m.len(),
            Buffer::Shared(s) => s.len(),
        }
    }

    /// True when empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub(crate) fn sge(&self) -> crate::ffi::ibv_sge {
        match self {
            Buffer::Owned(m) => m.sge(),
            Buffer::Shared(s) => s.sge(),
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

/// The buffers of one work request: up to [`MAX_SAFE_SGES`], stored inline
/// (no heap allocation per work request).
///
/// Only the first `len` entries are initialised, and the hot paths copy only
/// those (a one-buffer request moves one 32-byte entry, not the whole array).
pub struct Sges {
    items: [MaybeUninit<Buffer>; MAX_SAFE_SGES],
    len: u8,
    /// Entries offered beyond the capacity (reported at post time).
    overflow: u32,
}

impl Default for Sges {
    #[inline]
    fn default() -> Sges {
        Sges {
            items: [const { MaybeUninit::uninit() }; MAX_SAFE_SGES],
            len: 0,
            overflow: 0,
        }
    }
}

impl Drop for Sges {
    #[inline]
    fn drop(&mut self) {
        let len = self.len as usize;
        // SAFETY: exactly the first `len` entries are initialised.
        unsafe { std::ptr::drop_in_place(self.as_mut_ptr_slice(len)) };
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
        let mut s = Sges::default();
        s.items[0].write(b);
        s.len = 1;
        s
    }

    #[inline(always)]
    fn as_mut_ptr_slice(&mut self, len: usize) -> *mut [Buffer] {
        std::ptr::slice_from_raw_parts_mut(self.items.as_mut_ptr().cast::<Buffer>(), len)
    }

    /// Appends a buffer; beyond [`MAX_SAFE_SGES`] the buffer is dropped and the
    /// request will be refused with [`TooManySges`](crate::Error::TooManySges) when posted.
    #[inline]
    pub fn push(&mut self, b: Buffer) {
        let len = self.len as usize;
        if len < MAX_SAFE_SGES {
            self.items[len].write(b);
            self.len += 1;
        } else {
            self.overflow = self.overflow.saturating_add(1);
        }
    }

    /// Removes and returns the last buffer (cheaper than consuming the list
    /// with `into_iter` when recycling buffers in a loop).
    #[inline]
    pub fn pop(&mut self) -> Option<Buffer> {
        let len = self.len.checked_sub(1)?;
        self.len = len;
        // SAFETY: entry `len` was initialised; `self.len` no longer covers it,
        // so it is read exactly once.
        Some(unsafe { self.items[len as usize].assume_init_read() })
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
        unsafe { std::slice::from_raw_parts(self.items.as_ptr().cast::<Buffer>(), self.len()) }
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

    #[inline]
    pub(crate) fn all_owned(&self) -> bool {
        self.iter().all(|b| matches!(b, Buffer::Owned(_)))
    }

    #[inline]
    pub(crate) fn take_first_owned(&mut self) -> Option<Mr> {
        if self.len == 1 && matches!(self.as_slice()[0], Buffer::Owned(_)) {
            // The common case (a receive or READ into one buffer).
            self.len = 0;
            // SAFETY: entry 0 was initialised; `len` is 0 now, so it is read once.
            return unsafe { self.items[0].assume_init_read() }.into_mr();
        }
        let i = self.iter().position(|b| matches!(b, Buffer::Owned(_)))?;
        let len = self.len();
        // SAFETY: i < len, so entry i is initialised; it is read out once, the
        // initialised entries after it shift down by one and `len` shrinks, so
        // every entry stays initialised exactly once.
        let b = unsafe {
            let base = self.items.as_mut_ptr().cast::<Buffer>();
            let b = base.add(i).read();
            std::ptr::copy(base.add(i + 1), base.add(i), len - i - 1);
            b
        };
        self.len -= 1;
        b.into_mr()
    }

    /// Moves the buffers of `*src` to `dst`, copying only the initialised
    /// entries (fixed-size copies, so no `memcpy` call on the hot path).
    ///
    /// # Safety
    /// `src` is a live `Sges` that is not used (nor dropped) afterwards; `dst`
    /// is valid for writes and holds nothing that needs dropping.
    #[inline(always)]
    pub(crate) unsafe fn move_to(src: *const Sges, dst: *mut Sges) {
        // SAFETY: per the contract; entries below `len` are initialised in
        // `src` and written in `dst`, the rest stay uninitialised.
        unsafe {
            let len = (*src).len;
            (*dst).len = len;
            (*dst).overflow = (*src).overflow;
            let s = (&raw const (*src).items).cast::<MaybeUninit<Buffer>>();
            let d = (&raw mut (*dst).items).cast::<MaybeUninit<Buffer>>();
            // Unrolled on purpose: a loop here becomes a memcpy call.
            if len > 0 {
                d.write(s.read());
            }
            if len > 1 {
                d.add(1).write(s.add(1).read());
            }
            if len > 2 {
                d.add(2).write(s.add(2).read());
            }
            if len > 3 {
                d.add(3).write(s.add(3).read());
            }
        }
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
        Some(unsafe { self.sges.items[i].assume_init_read() })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = (self.sges.len - self.next) as usize;
        (n, Some(n))
    }
}

impl Drop for SgesIntoIter {
    fn drop(&mut self) {
        let (from, to) = (self.next as usize, self.sges.len as usize);
        // Sges::drop must not see the entries already handed out.
        self.sges.len = 0;
        for item in &mut self.sges.items[from..to] {
            // SAFETY: entries from..to are initialised and not handed out.
            unsafe { item.assume_init_drop() };
        }
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

const EMPTY: u8 = 0;
const POSTED: u8 = 1;

struct SlotData {
    wr_id: u64,
    bufs: Sges,
}

/// One slot; its address is the work request's `wr_id`. `data` is initialised
/// exactly while `state` is POSTED (so nothing is written to empty it).
pub(crate) struct Slot {
    ring: *const Ring,
    /// This slot's index in its ring (so a completion finds it without a division).
    index: u64,
    state: AtomicU8,
    data: UnsafeCell<MaybeUninit<SlotData>>,
}

/// A ring of slots for one queue.
pub(crate) struct Ring {
    /// A power of two (at least `cap`) so that a sequence number maps to its
    /// slot with a mask instead of a 64-bit division.
    slots: Box<[Slot]>,
    mask: u64,
    /// Most work requests in flight: the queue's depth.
    cap: u64,
    tail: AtomicU64,
}

/// Both rings of a QP, allocated together so one `Arc` keeps them alive.
pub(crate) struct Rings {
    pub(crate) sq: Ring,
    pub(crate) rq: Ring,
}

// SAFETY: slot contents are only touched by the single producer (holding &mut Qp)
// and the single consumer (holding &mut Cq), handed over with acquire/release on
// `state` and `tail`; the buffers inside are Send.
unsafe impl Send for Rings {}
// SAFETY: as above.
unsafe impl Sync for Rings {}

impl Rings {
    pub(crate) fn new(sq_depth: u32, rq_depth: u32) -> Arc<Rings> {
        Arc::new_cyclic(|weak| {
            let base: *const Rings = weak.as_ptr();
            // SAFETY: only field addresses are computed (`&raw const`, no read);
            // they are fixed once the Arc allocation exists and are dereferenced
            // only after new_cyclic returns.
            let (sq_ptr, rq_ptr) = unsafe { (&raw const (*base).sq, &raw const (*base).rq) };
            Rings {
                sq: Ring::new(sq_depth, sq_ptr),
                rq: Ring::new(rq_depth, rq_ptr),
            }
        })
    }
}

impl Ring {
    fn new(depth: u32, me: *const Ring) -> Ring {
        let cap = u64::from(depth.max(1));
        let n = cap.next_power_of_two();
        let slots = (0..n)
            .map(|index| Slot {
                ring: me,
                index,
                state: AtomicU8::new(EMPTY),
                data: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Ring {
            slots,
            mask: n - 1,
            cap,
            tail: AtomicU64::new(0),
        }
    }

    /// Capacity in work requests.
    #[inline]
    pub(crate) fn depth(&self) -> u64 {
        self.cap
    }

    /// Outstanding work requests, seen from the producer whose count is `head`.
    #[inline]
    pub(crate) fn in_flight(&self, head: u64) -> u64 {
        head - self.tail.load(Ordering::Acquire)
    }

    /// The slot of sequence number `seq`.
    #[inline(always)]
    fn slot(&self, seq: u64) -> &Slot {
        // SAFETY: `mask` is `slots.len() - 1`, so the index is in bounds.
        unsafe { self.slots.get_unchecked((seq & self.mask) as usize) }
    }

    /// Moves `*bufs` into the slot for sequence number `seq` and returns the
    /// slot's address as a wr_id.
    ///
    /// # Safety
    /// Only the producer calls this, for `seq` with `in_flight(seq) < depth`;
    /// `*bufs` is moved out (the caller must not use or drop it afterwards).
    #[inline]
    pub(crate) unsafe fn fill(&self, seq: u64, wr_id: u64, bufs: *const Sges) -> u64 {
        let slot = self.slot(seq);
        debug_assert_eq!(slot.state.load(Ordering::Relaxed), EMPTY);
        let data = slot.data.get().cast::<SlotData>();
        // SAFETY: the slot is EMPTY and behind the consumer's tail: only the producer
        // touches it until the Release store below publishes it; `bufs` per the contract.
        unsafe {
            (&raw mut (*data).wr_id).write(wr_id);
            Sges::move_to(bufs, &raw mut (*data).bufs);
        }
        slot.state.store(POSTED, Ordering::Release);
        slot as *const Slot as u64
    }

    /// Takes back the slots `from..*head` that were filled but never reached
    /// the NIC (the post failed), and moves `head` back to `from`.
    ///
    /// # Safety
    /// Only the producer calls this, for slots it filled and whose work requests
    /// the device did not accept.
    pub(crate) unsafe fn unfill_from(&self, from: u64, head: &mut u64) -> Vec<(u64, Sges)> {
        let out = (from..*head)
            .map(|seq| {
                let slot = self.slot(seq);
                // SAFETY: no completion can name this slot, so the consumer never
                // touches it; it was POSTED, so its data is initialised, and EMPTY
                // below marks the data moved out.
                let data = unsafe { (*slot.data.get()).assume_init_read() };
                slot.state.store(EMPTY, Ordering::Relaxed);
                (data.wr_id, data.bufs)
            })
            .collect();
        *head = from;
        out
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        for slot in self.slots.iter_mut() {
            if *slot.state.get_mut() == POSTED {
                // SAFETY: POSTED slots hold initialised data; &mut self is exclusive and
                // the ring is dropped only after its QP was destroyed (NIC done).
                unsafe { slot.data.get_mut().assume_init_drop() };
            }
        }
    }
}

/// Retires the slot a completion's `wr_id` names, and every unsignaled slot
/// before it (their buffers go to `retired` if given, else are released);
/// moves the slot's buffers to `bufs_out` and returns the application's wr_id.
///
/// # Safety
/// `wr_id` came from a completion of a work request posted by [`Ring::fill`],
/// the ring is still alive (its QP or a CQ graveyard holds it), and the caller
/// is that queue's only consumer (holds `&mut` to its CQ). `bufs_out` is valid
/// for writes and holds nothing that needs dropping.
#[inline]
pub(crate) unsafe fn retire(
    wr_id: u64,
    mut retired: Option<&mut Vec<(u64, Sges)>>,
    bufs_out: *mut Sges,
) -> u64 {
    let slot_ptr = wr_id as *const Slot;
    // SAFETY: per the contract the slot and its ring are alive.
    let (ring, target) = unsafe { (&*(*slot_ptr).ring, &*slot_ptr) };
    let idx = target.index;
    let tail = ring.tail.load(Ordering::Relaxed);
    let dist = idx.wrapping_sub(tail) & ring.mask;
    if target.state.load(Ordering::Acquire) != POSTED {
        // A completion for a slot already retired (cannot happen with in-order
        // queues): report it without buffers rather than guess.
        // SAFETY: valid for writes per the contract.
        unsafe { bufs_out.write(Sges::default()) };
        return 0;
    }
    for s in 0..dist {
        let slot = ring.slot(tail + s);
        if slot.state.load(Ordering::Acquire) == POSTED {
            let data = slot.data.get().cast::<SlotData>();
            // SAFETY: POSTED (so initialised) and older than a completed slot: the
            // NIC is done with it and only this consumer touches it now; EMPTY
            // below marks the data moved out (or dropped). `v` has room for one
            // more after `reserve`, and both fields are written before `set_len`.
            unsafe {
                match retired.as_deref_mut() {
                    Some(v) => {
                        // Written in place in the spare capacity, the buffers'
                        // used entries only (a push would copy 144 bytes).
                        v.reserve(1);
                        let len = v.len();
                        let dst = v.as_mut_ptr().add(len);
                        (&raw mut (*dst).0).write((*data).wr_id);
                        Sges::move_to(&raw const (*data).bufs, &raw mut (*dst).1);
                        v.set_len(len + 1);
                    }
                    None => std::ptr::drop_in_place(&raw mut (*data).bufs),
                }
            }
            slot.state.store(EMPTY, Ordering::Relaxed);
        }
    }
    let data = target.data.get().cast::<SlotData>();
    // SAFETY: POSTED (acquired above, so initialised), completed, consumer-only
    // from here on; EMPTY below marks the data moved out.
    let app_wr_id = unsafe {
        Sges::move_to(&raw const (*data).bufs, bufs_out);
        (*data).wr_id
    };
    target.state.store(EMPTY, Ordering::Relaxed);
    ring.tail.store(tail + dist + 1, Ordering::Release);
    app_wr_id
}
