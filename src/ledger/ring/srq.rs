//! The ring of a shared receive queue: slots reused out of order.
//!
//! Receives of a shared receive queue (SRQ) are consumed by whichever QP on it
//! gets a message first, so they complete out of posting order across QPs
//! (QP A takes WQE 1, QP B takes WQE 2, B's message completes first). The
//! in-order sweep of a QP's own queues would retire WQE 1 with B's
//! completion, so an SRQ ring never sweeps: every SRQ receive produces its
//! own completion (success or flush) and that completion retires exactly
//! its slot.
//!
//! A token names the slot directly: the low 32 bits are the slot index
//! (`log2(slots)` bits) under a per-slot generation that is bumped every time
//! the slot is reused, so a completion validates against the slot's current
//! posting only. Free slots go from the consumer (the poller, which frees
//! them in completion order) back to the producer (the SRQ's poster) through
//! a single-producer single-consumer list of indices; slots the producer
//! takes back from a refused post go to its own refused_slots.
//!
//! The completion's QP number is the QP that consumed the receive, so it
//! cannot be checked against one QP: the ring's `qp_num` is [`SRQ_QPN`],
//! which no completion carries (QP numbers are 24 bits), and the poller
//! dispatches here when a token names an SRQ ring.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::{EMPTY, POSTED, Retired, Ring, SlotData, SlotMeta};
use crate::ledger::sges::Sges;

/// The `qp_num` of an SRQ ring: no completion carries it (QPNs are 24 bits).
pub(crate) const SRQ_QPN: u32 = u32::MAX;

/// Free slot indices, handed from the consumer to the producer.
pub(super) struct FreeList {
    /// A ring buffer of slot indices (as many entries as slots).
    idx: Box<[AtomicU32]>,
    /// Indices ever pushed (by the consumer; the first `slots` at creation).
    pushed: AtomicU64,
    /// Bits of the slot index in a token's low half.
    shift: u32,
}

/// The producer's side of an SRQ ring (held by the `Srq` handle, `&mut` to post).
pub(crate) struct SrqProducer {
    /// Receives posted (minus those taken back): `in_flight` is `head - tail`.
    head: u64,
    /// Indices popped from the free list.
    popped: u64,
    /// Slots taken back from refused posts, reused first.
    refused_slots: Vec<u32>,
}

impl SrqProducer {
    /// The producer of a new SRQ ring (nothing posted yet).
    pub(crate) fn new() -> SrqProducer {
        SrqProducer {
            head: 0,
            popped: 0,
            refused_slots: Vec::new(),
        }
    }

    /// Receives posted and not yet retired by a polled completion.
    #[inline]
    pub(crate) fn in_flight(&self, ring: &Ring) -> u64 {
        ring.in_flight(self.head)
    }
}

impl Ring {
    /// The ring of a shared receive queue of `depth` receives.
    /// Its producer is a new [`SrqProducer`].
    pub(crate) fn new_srq(depth: u32, tag: u32) -> Ring {
        let mut ring = Ring::new(depth.max(1), tag, SRQ_QPN);
        ring.allocate_slots();
        let n = ring.slot_count() as u32;
        ring.srq = Some(FreeList {
            idx: (0..n).map(AtomicU32::new).collect(),
            pushed: AtomicU64::new(u64::from(n)),
            shift: n.trailing_zeros(),
        });
        ring
    }

    /// Whether this is a shared receive queue's ring.
    #[inline(always)]
    pub(crate) fn is_srq(&self) -> bool {
        self.qp_num == SRQ_QPN
    }

    /// Moves `*bufs` into a free slot and returns the token to post as the
    /// wr_id, or `None` (nothing moved) when no slot is free or this is not
    /// an SRQ ring.
    ///
    /// # Safety
    /// Only the producer `p` of this ring calls this (it was created with
    /// it); on `Some`, `*bufs` was moved out (the caller must not use or drop
    /// it afterwards).
    pub(crate) unsafe fn fill_srq(
        &self,
        p: &mut SrqProducer,
        wr_id: u64,
        bufs: *const Sges,
    ) -> Option<u64> {
        let fl = self.srq.as_ref()?;
        if p.in_flight(self) >= self.depth() {
            return None;
        }
        let idx = match p.refused_slots.pop() {
            Some(i) => i,
            None => {
                if p.popped == fl.pushed.load(Ordering::Acquire) {
                    return None;
                }
                let i = fl.idx[(p.popped & u64::from(self.mask)) as usize].load(Ordering::Relaxed);
                p.popped += 1;
                i
            }
        };
        // SAFETY: an SRQ ring (`srq` is set) allocated its slots in `new_srq`.
        let slot = unsafe { self.slot_allocated(u64::from(idx)) };
        debug_assert_eq!(slot.state.load(Ordering::Relaxed), EMPTY);
        let generation = (slot.seq.load(Ordering::Relaxed) >> fl.shift).wrapping_add(1);
        let low = generation.wrapping_shl(fl.shift) | idx;
        let data = slot.data.get().cast::<SlotData>();
        let meta = SlotMeta {
            opcode: crate::ffi::IBV_WC_RECV,
            signaled: true,
            drain: false,
        };
        // SAFETY: the slot came off the free list (or the refused_slots), so it is
        // EMPTY and nobody else touches its data until the Release store below
        // publishes it (the consumer pushed it only after moving its data
        // out); `bufs` per the contract.
        unsafe {
            (&raw mut (*data).wr_id).write(wr_id);
            (&raw mut (*data).meta).write(meta);
            Sges::move_to(bufs, &raw mut (*data).bufs);
        }
        slot.seq.store(low, Ordering::Relaxed);
        slot.state.store(POSTED, Ordering::Release);
        p.head += 1;
        Some((u64::from(self.tag) << 32) | u64::from(low))
    }

    /// Takes back the request posted with `token` that never reached the NIC
    /// (the post was refused or unwound); its slot goes to the refused_slots.
    ///
    /// # Safety
    /// Only the producer `p` calls this, for a token `fill_srq` returned
    /// whose work request the device did not accept.
    pub(crate) unsafe fn unfill_srq(&self, p: &mut SrqProducer, token: u64) -> Option<(u64, Sges)> {
        let low = token as u32;
        let idx = low & self.mask;
        if self.slot(u64::from(idx))?.seq.load(Ordering::Relaxed) != low {
            return None;
        }
        let d = self.claim(u64::from(idx))?;
        p.refused_slots.push(idx);
        p.head -= 1;
        Some((d.wr_id, d.bufs))
    }

    /// Retires exactly the receive named by `low` (the token's low half),
    /// moving its buffers to `bufs_out`, and frees its slot. Returns `None`
    /// without changing anything when `low` names no posted receive of this
    /// ring (a stale or forged completion), or when the destructor took it
    /// first.
    ///
    /// # Safety
    /// The caller is this ring's only consumer (holds `&mut` to its CQ) and
    /// `bufs_out` is valid for writes and holds nothing that needs dropping.
    #[inline(never)]
    pub(crate) unsafe fn retire_srq(&self, low: u32, bufs_out: *mut Sges) -> Option<Retired> {
        let fl = self.srq.as_ref()?;
        let idx = low & self.mask;
        // SAFETY: an SRQ ring (`srq` is set) allocated its slots in `new_srq`.
        let slot = unsafe { self.slot_allocated(u64::from(idx)) };
        if slot.state.load(Ordering::Acquire) != POSTED || slot.seq.load(Ordering::Relaxed) != low {
            return None;
        }
        let d = self.claim_ptr(u64::from(idx))?;
        // SAFETY: claimed, so initialised and ours; the buffers move out once
        // and the slot is EMPTY, so no one reads them again.
        let retired = unsafe {
            Sges::move_to(&raw const (*d).bufs, bufs_out);
            Retired {
                wr_id: (*d).wr_id,
                meta: (*d).meta,
            }
        };
        // Hand the slot back to the producer (after its data was moved out).
        let pushed = fl.pushed.load(Ordering::Relaxed);
        fl.idx[(pushed & u64::from(self.mask)) as usize].store(idx, Ordering::Relaxed);
        fl.pushed.store(pushed + 1, Ordering::Release);
        let tail = self.tail.load(Ordering::Relaxed);
        self.tail.store(tail + 1, Ordering::Release);
        Some(retired)
    }
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::*;

    fn post(ring: &Ring, p: &mut SrqProducer, wr_id: u64) -> Option<u64> {
        let bufs = Sges::default();
        // SAFETY: single producer; `bufs` is empty (forgetting it leaks nothing).
        let t = unsafe { ring.fill_srq(p, wr_id, &bufs) };
        std::mem::forget(bufs);
        t
    }

    fn retire(ring: &Ring, token: u64) -> Option<u64> {
        let mut out = MaybeUninit::<Sges>::uninit();
        // SAFETY: single consumer; `out` is written iff Some is returned.
        let r = unsafe { ring.retire_srq(token as u32, out.as_mut_ptr()) };
        r.map(|r| {
            // SAFETY: written by retire_srq, which returned Some.
            drop(unsafe { out.assume_init() });
            r.wr_id
        })
    }

    #[test]
    fn completes_out_of_order_and_reuses_slots() {
        let (ring, mut p) = (Ring::new_srq(3, 0x8000_0100), SrqProducer::new());
        let t: Vec<u64> = (0..3).map(|i| post(&ring, &mut p, i).unwrap()).collect();
        assert_eq!(post(&ring, &mut p, 9), None, "depth 3");
        assert_eq!(p.in_flight(&ring), 3);
        // The second completes first: exactly it is retired.
        assert_eq!(retire(&ring, t[1]), Some(1));
        assert_eq!(retire(&ring, t[1]), None, "a repeat is stale");
        assert_eq!(p.in_flight(&ring), 2);
        // Its slot is reused under a new generation: the old token stays stale.
        let t3 = post(&ring, &mut p, 3).unwrap();
        assert_ne!(t3, t[1]);
        assert_eq!(retire(&ring, t[1]), None);
        assert_eq!(retire(&ring, t[2]), Some(2));
        assert_eq!(retire(&ring, t3), Some(3));
        assert_eq!(retire(&ring, t[0]), Some(0));
        assert_eq!(p.in_flight(&ring), 0);
    }

    #[test]
    fn forged_and_foreign_tokens_are_refused() {
        let (ring, mut p) = (Ring::new_srq(4, 0x8000_0100), SrqProducer::new());
        let t = post(&ring, &mut p, 7).unwrap();
        // Another slot, or the same slot under another generation.
        assert_eq!(retire(&ring, t ^ 1), None);
        assert_eq!(retire(&ring, t.wrapping_add(4)), None);
        // Not an SRQ ring: nothing to fill or retire.
        let plain = Ring::new(4, 0x8000_0200, 5);
        assert!(!plain.is_srq() && ring.is_srq());
        assert_eq!(post(&plain, &mut p, 1), None);
        assert_eq!(retire(&plain, t), None);
        assert_eq!(retire(&ring, t), Some(7));
    }

    #[test]
    fn refused_posts_are_taken_back_once() {
        let (ring, mut p) = (Ring::new_srq(2, 0x8000_0100), SrqProducer::new());
        let a = post(&ring, &mut p, 1).unwrap();
        let b = post(&ring, &mut p, 2).unwrap();
        // SAFETY: producer side; pretend the device refused `b`.
        let back = unsafe { ring.unfill_srq(&mut p, b) };
        assert_eq!(back.map(|(id, _)| id), Some(2));
        // SAFETY: as above; a second take-back finds nothing.
        assert!(unsafe { ring.unfill_srq(&mut p, b) }.is_none());
        assert_eq!(retire(&ring, b), None);
        assert_eq!(p.in_flight(&ring), 1);
        // Many rounds through every slot: the free list never loses or
        // duplicates one.
        let mut live = vec![a];
        for i in 0..1000u64 {
            while let Some(t) = post(&ring, &mut p, i) {
                live.push(t);
            }
            assert_eq!(live.len(), 2);
            let t = live.remove((i % 2) as usize);
            assert!(retire(&ring, t).is_some());
        }
    }

    #[test]
    fn release_all_takes_what_is_posted() {
        let (ring, mut p) = (Ring::new_srq(2, 0x8000_0100), SrqProducer::new());
        let t = post(&ring, &mut p, 1).unwrap();
        ring.release_all();
        assert_eq!(retire(&ring, t), None);
    }
}
