//! A ring's slot storage: allocated on the queue's first post, read through
//! the window that opens once the slots are in place.
//!
//! The ring's `window` (the depth the room check and the poller go by) stays
//! 0 until the slots exist, so the first post takes the room check's cold
//! path, which allocates them and opens the window, and a completion naming a
//! ring with no slots falls outside the window and is treated as stale.

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};

use super::{EMPTY, POSTED, Ring, Slot, SlotData};

impl Ring {
    /// The slot of sequence number `seq`, or `None` while nothing was ever
    /// posted to this ring (its slots are not allocated).
    #[inline(always)]
    pub(super) fn slot(&self, seq: u64) -> Option<&Slot> {
        let base = self.slots.load(Ordering::Acquire);
        if base.is_null() {
            return None;
        }
        // SAFETY: a non-null `slots` points to `mask + 1` slots that live as
        // long as the ring, and the index is masked into that range.
        Some(unsafe { &*base.add(self.index(seq)) })
    }

    /// The slot of sequence number `seq` for a caller that knows the slots
    /// are allocated.
    ///
    /// # Safety
    /// [`allocate_slots`](Ring::allocate_slots) ran, or the caller saw the window open.
    #[inline(always)]
    pub(super) unsafe fn slot_allocated(&self, seq: u64) -> &Slot {
        // Relaxed: what the contract names made the slots visible: the
        // caller's own allocation, its Acquire load of an open window (the
        // window opens after the slots are in place), or, for an SRQ's ring,
        // the ring's publication (it allocates before it is shared).
        let base = self.slots.load(Ordering::Relaxed);
        debug_assert!(!base.is_null());
        // SAFETY: allocated per the contract; in range as in `slot`.
        unsafe { &*base.add(self.index(seq)) }
    }

    /// The depth for the producer's room check: 0 until the slots are
    /// allocated (then a post finds no room and calls
    /// [`allocate_slots`](Ring::allocate_slots)), [`depth`](Ring::depth) after.
    #[inline(always)]
    pub(crate) fn posting_depth(&self) -> u64 {
        // Relaxed: only the producer allocates, and a producer handed to
        // another thread arrives there with its stores visible.
        u64::from(self.window.load(Ordering::Relaxed))
    }

    /// The producer's room check with `in_flight` requests outstanding:
    /// `Ok(depth)` when one more fits, `Err(depth)` when the queue is full.
    /// The depth is [`posting_depth`](Ring::posting_depth) when that leaves
    /// room, else (a full queue, or its first post) what
    /// [`allocate_slots`](Ring::allocate_slots) returns.
    #[inline(always)]
    pub(crate) fn room(&self, in_flight: u64) -> Result<u64, u64> {
        let depth = self.posting_depth();
        if in_flight < depth {
            Ok(depth)
        } else {
            self.room_after_allocating(in_flight)
        }
    }

    /// [`room`](Ring::room)'s cold path.
    #[cold]
    #[inline(never)]
    fn room_after_allocating(&self, in_flight: u64) -> Result<u64, u64> {
        let depth = self.allocate_slots();
        if in_flight < depth {
            Ok(depth)
        } else {
            Err(depth)
        }
    }

    /// The depth [`room`](Ring::room) checks against, full or not.
    #[inline(always)]
    pub(crate) fn room_depth(&self, in_flight: u64) -> u64 {
        self.room(in_flight).unwrap_or_else(|depth| depth)
    }

    /// Allocates the slots (every one EMPTY) unless they are already there,
    /// and returns the depth: the room check's cold path, taken on a queue's
    /// first post and whenever it is full. A queue of depth 0 (a QP's receive
    /// queue when an SRQ takes its receives) refuses every post and gets none.
    #[cold]
    #[inline(never)]
    pub(crate) fn allocate_slots(&self) -> u64 {
        if self.cap > 0 && self.slots.load(Ordering::Acquire).is_null() {
            self.install_slots();
        }
        self.depth()
    }

    /// Allocates and installs the slots, then opens the window.
    #[cold]
    fn install_slots(&self) {
        let fresh: Box<[Slot]> = (0..=self.mask)
            .map(|_| Slot {
                seq: AtomicU32::new(0),
                state: AtomicU8::new(EMPTY),
                data: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        let fresh = Box::into_raw(fresh).cast::<Slot>();
        let null = std::ptr::null_mut();
        if self
            .slots
            .compare_exchange(null, fresh, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // SAFETY: `fresh` came from `Box::into_raw` above with this
            // length and was never shared.
            drop(unsafe { self.slots_box(fresh) });
        }
        // Release: whoever sees the window open sees the slots.
        self.window.store(self.cap, Ordering::Release);
    }

    /// The boxed slice behind `base`.
    ///
    /// # Safety
    /// `base` is a `Box<[Slot]>` of [`slot_count`](Ring::slot_count) slots
    /// turned into a pointer (by `install_slots`), and the caller owns it (no
    /// other reference to the slots is live).
    pub(super) unsafe fn slots_box(&self, base: *mut Slot) -> Box<[Slot]> {
        let len = self.slot_count();
        // SAFETY: per the contract, `base` is a `Box<[Slot]>` of `len` slots.
        unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(base, len)) }
    }
}

/// Claims `slot` if it holds a posted request (see [`Ring::claim_ptr`]).
#[inline(always)]
pub(super) fn claim_slot(slot: &Slot) -> Option<*mut SlotData> {
    slot.state
        .compare_exchange(POSTED, EMPTY, Ordering::Acquire, Ordering::Relaxed)
        .ok()?;
    Some(slot.data.get().cast::<SlotData>())
}
