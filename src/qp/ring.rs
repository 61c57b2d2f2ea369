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
#[derive(Debug, Default)]
pub struct Sges {
    items: [Option<Buffer>; MAX_SAFE_SGES],
    len: usize,
    /// Entries offered beyond the capacity (reported at post time).
    pub(crate) overflow: usize,
}

impl Sges {
    /// Appends a buffer; beyond [`MAX_SAFE_SGES`] the request will be refused when posted.
    #[inline]
    pub fn push(&mut self, b: Buffer) {
        if self.len < MAX_SAFE_SGES {
            self.items[self.len] = Some(b);
            self.len += 1;
        } else {
            self.overflow += 1;
        }
    }

    /// Number of buffers.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there are none.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Total bytes.
    #[inline]
    pub fn total_len(&self) -> u64 {
        self.iter().map(|b| b.len() as u64).sum()
    }

    /// The buffers in order.
    #[inline]
    pub fn iter(&self) -> impl Iterator<Item = &Buffer> {
        self.items[..self.len].iter().flatten()
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
        let i = self.items[..self.len]
            .iter()
            .position(|b| matches!(b, Some(Buffer::Owned(_))))?;
        let b = self.items[i].take();
        self.items[i..self.len].rotate_left(1);
        self.len -= 1;
        b.and_then(Buffer::into_mr)
    }
}

impl IntoIterator for Sges {
    type Item = Buffer;
    type IntoIter = std::iter::Flatten<std::array::IntoIter<Option<Buffer>, MAX_SAFE_SGES>>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter().flatten()
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
    state: AtomicU8,
    data: UnsafeCell<MaybeUninit<SlotData>>,
}

/// A ring of slots for one queue.
pub(crate) struct Ring {
    slots: Box<[Slot]>,
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
        let slots = (0..depth.max(1))
            .map(|_| Slot {
                ring: me,
                state: AtomicU8::new(EMPTY),
                data: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        Ring {
            slots,
            tail: AtomicU64::new(0),
        }
    }

    /// Capacity in work requests.
    #[inline]
    pub(crate) fn depth(&self) -> u64 {
        self.slots.len() as u64
    }

    /// Outstanding work requests, seen from the producer whose count is `head`.
    #[inline]
    pub(crate) fn in_flight(&self, head: u64) -> u64 {
        head - self.tail.load(Ordering::Acquire)
    }

    /// Fills the slot for sequence number `seq` and returns its address as a wr_id.
    ///
    /// # Safety
    /// Only the producer calls this, for `seq` with `in_flight(seq) < depth`.
    #[inline]
    pub(crate) unsafe fn fill(&self, seq: u64, wr_id: u64, bufs: Sges) -> u64 {
        let slot = &self.slots[(seq % self.depth()) as usize];
        debug_assert_eq!(slot.state.load(Ordering::Relaxed), EMPTY);
        // SAFETY: the slot is EMPTY and behind the consumer's tail: only the producer
        // touches it until the Release store below publishes it.
        unsafe { (*slot.data.get()).write(SlotData { wr_id, bufs }) };
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
                let slot = &self.slots[(seq % self.depth()) as usize];
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
/// returns the application's wr_id and the slot's buffers.
///
/// # Safety
/// `wr_id` came from a completion of a work request posted by [`Ring::fill`],
/// the ring is still alive (its QP or a CQ graveyard holds it), and the caller
/// is that queue's only consumer (holds `&mut` to its CQ).
#[inline]
pub(crate) unsafe fn retire(wr_id: u64, mut retired: Option<&mut Vec<(u64, Sges)>>) -> (u64, Sges) {
    let slot_ptr = wr_id as *const Slot;
    // SAFETY: per the contract the slot and its ring are alive.
    let ring = unsafe { &*(*slot_ptr).ring };
    let base = ring.slots.as_ptr() as usize;
    let idx = (slot_ptr as usize - base) / std::mem::size_of::<Slot>();
    let depth = ring.depth();
    let tail = ring.tail.load(Ordering::Relaxed);
    let dist = (idx as u64 + depth - tail % depth) % depth;
    let target = &ring.slots[idx];
    if target.state.load(Ordering::Acquire) != POSTED {
        // A completion for a slot already retired (cannot happen with in-order
        // queues): report it without buffers rather than guess.
        return (0, Sges::default());
    }
    for s in 0..dist {
        let slot = &ring.slots[((tail + s) % depth) as usize];
        if slot.state.load(Ordering::Acquire) == POSTED {
            // SAFETY: POSTED (so initialised) and older than a completed slot: the
            // NIC is done with it and only this consumer touches it now; EMPTY
            // below marks the data moved out.
            let data = unsafe { (*slot.data.get()).assume_init_read() };
            if let Some(v) = retired.as_deref_mut() {
                v.push((data.wr_id, data.bufs));
            }
            slot.state.store(EMPTY, Ordering::Relaxed);
        }
    }
    // SAFETY: POSTED (acquired above, so initialised), completed, consumer-only
    // from here on; EMPTY below marks the data moved out.
    let data = unsafe { (*target.data.get()).assume_init_read() };
    target.state.store(EMPTY, Ordering::Relaxed);
    ring.tail.store(tail + dist + 1, Ordering::Release);
    (data.wr_id, data.bufs)
}
