//! What a QP keeps of its scoped requests: [`PostedRange`] entries in side
//! tables indexed like its rings' slots ([`ScopedTables`]).

use crate::ffi;
use crate::ledger::ring::{Ring, SlotMeta};
use crate::qp::QpCore;
use crate::qp::queue::POST_CHUNK;

/// What the QP keeps of scoped send requests, in a side table indexed like
/// the ring's slots: one entry per *range* of requests posted together with the
/// same opcode (a [`PreparedSends`](super::PreparedSends) post), at the slot of its first request;
/// every other post is a range of one. Request `seq` of a range has the
/// `wr_id` `wr_id + (seq - self.seq)`.
///
/// Only range starts are written when posting; the slots of a range's other
/// requests keep stale entries, told apart by their `seq`. A completion
/// inside a range finds its start from the ring's tail (see
/// [`PostedRange::find`]) and, if the range goes on, writes the rest's start at
/// the next slot, so that a range's start always lies at or after the tail,
/// in a slot no post can reuse while the range is in flight.
///
/// Between posts no entry names a request at or after the queue's head: a
/// post that wrote entries for requests it then did not post (the provider
/// refused them, or the caller's iterator panicked) takes them back
/// ([`PostedRange::unstage`]). Otherwise a later range posted over the same
/// sequence numbers would meet them in its other slots and take them for
/// range starts.
#[derive(Clone, Copy)]
pub(super) struct PostedRange {
    /// The `wr_id` of the range's first request.
    pub(super) wr_id: u64,
    /// The sequence number of the range's first request (`u64::MAX`: never
    /// written).
    pub(super) seq: u64,
    /// The opcode the completions report (`IBV_WC_*`, from what was posted:
    /// completions in error do not report one).
    pub(super) wc_opcode: u32,
    /// Requests in the range.
    pub(super) len: u32,
}

impl Default for PostedRange {
    fn default() -> PostedRange {
        PostedRange {
            wr_id: 0,
            seq: u64::MAX,
            wc_opcode: 0,
            len: 0,
        }
    }
}

impl PostedRange {
    /// Takes back the entries written for requests `from..to`, which were
    /// not posted (see the type's docs).
    ///
    /// # Safety
    /// `side` has `ring.slot_count()` entries and no other reference to it
    /// is live; `from..to` are at or after the queue's head and fewer than
    /// its depth, so their slots hold no entry of a request in flight.
    #[cold]
    pub(super) unsafe fn unstage(side: *mut PostedRange, ring: &Ring, from: u64, to: u64) {
        for seq in from..to {
            // SAFETY: per the contract; `index` masks with the slot count.
            unsafe { *side.add(ring.index(seq)) = PostedRange::default() };
        }
    }

    /// The entry of send-queue request `seq` posted alone with `wr_opcode`.
    #[inline(always)]
    pub(super) fn send(seq: u64, wr_id: u64, wr_opcode: u32) -> PostedRange {
        PostedRange {
            wr_id,
            seq,
            wc_opcode: SlotMeta::completion_opcode_of(wr_opcode),
            len: 1,
        }
    }

    /// What was posted as request `seq` (as a range of one), for its
    /// completion; `side` is the queue's side table, `low` the ring's tail
    /// before this completion (or the scope's first request, if later).
    ///
    /// Ranges tile the scope's requests in posting order, and a range in
    /// flight starts at or after the tail (see the type's docs), so a range
    /// starts at `low` and the next ones follow it: walk them to the one
    /// holding `seq`. Requests posted alone are found at once in their own
    /// slot.
    ///
    /// # Safety
    /// `side` has `ring.slot_count()` entries and no other reference to it
    /// is live; `seq` is a scoped request in flight, `low <= seq`.
    #[inline(always)]
    pub(super) unsafe fn find(
        side: *mut PostedRange,
        ring: &Ring,
        seq: u64,
        low: u64,
    ) -> PostedRange {
        // SAFETY: per the contract; `index` masks with the slot count.
        unsafe {
            let mut start = *side.add(ring.index(seq));
            if start.seq != seq {
                let mut at = low;
                loop {
                    start = *side.add(ring.index(at));
                    if start.seq != at || start.len == 0 {
                        // Not reachable while the invariant holds; report
                        // the request with the entry its own slot has (no
                        // assertion: a panic while polling could end a
                        // scope before its requests).
                        return *side.add(ring.index(seq));
                    }
                    if seq - at < u64::from(start.len) {
                        break;
                    }
                    at += u64::from(start.len);
                }
            }
            let k = seq - start.seq;
            if u64::from(start.len) > k + 1 {
                // The range goes on after `seq`, which this completion
                // retires: its rest starts at the next slot.
                *side.add(ring.index(seq + 1)) = PostedRange {
                    wr_id: start.wr_id.wrapping_add(k + 1),
                    seq: seq + 1,
                    wc_opcode: start.wc_opcode,
                    len: start.len - (k as u32 + 1),
                };
            }
            PostedRange {
                wr_id: start.wr_id.wrapping_add(k),
                seq,
                wc_opcode: start.wc_opcode,
                len: 1,
            }
        }
    }
}

/// A QP's tables for scoped requests, allocated by its first scope and
/// reused by the next ones: no allocation per scope or per request.
pub(crate) struct ScopedTables {
    /// One [`PostedRange`] per send-queue slot (see its docs).
    pub(super) sq: Box<[PostedRange]>,
    /// The `wr_id` of each scoped receive, at its slot (receives are posted
    /// one at a time, so they need no ranges).
    pub(super) rq: Box<[u64]>,
    /// C requests of one post call, zeroed once (see [`ScopedSend::fill`](super::ScopedSend::fill)).
    pub(super) send_wrs: Box<[ffi::ibv_send_wr; POST_CHUNK]>,
    /// The SGEs of `send_wrs`, one each.
    pub(super) sges: Box<[ffi::ibv_sge; POST_CHUNK]>,
    /// One past the sequence number of the last signaled scoped send posted
    /// (0: none): the scope's end tells an unsignaled tail by it.
    pub(super) sig_end: u64,
    /// Send flags every scoped send but a READ carries ([`fence_for`](Self::fence_for)):
    /// `IBV_SEND_FENCE` on a send queue that completes out of order (iWARP), 0
    /// elsewhere. The scope's end and its polls count requests by the ring's
    /// tail, which must not pass a READ the NIC is still writing; a fenced
    /// request starts (and so completes) only after the READs before it
    /// completed, which keeps completions in posting order. (siw refuses a
    /// fenced READ; READs complete in order among themselves.)
    pub(super) fence: u32,
    /// A list is being staged from the send / receive queue's head (see
    /// [`Listing`](super::listing::Listing)): other posts on that queue wait
    /// for it.
    pub(super) sq_listing: bool,
    pub(super) rq_listing: bool,
}

// SAFETY: plain data; the raw pointers inside the C requests are only
// written and read during a post call on the QP's owner thread.
unsafe impl Send for ScopedTables {}
// SAFETY: as above; `&ScopedTables` gives no access to anything.
unsafe impl Sync for ScopedTables {}

impl ScopedTables {
    /// The fence flag a scoped send posted with `wr_opcode` carries (see `fence`).
    #[inline(always)]
    pub(super) fn fence_for(&self, wr_opcode: u32) -> u32 {
        if wr_opcode == ffi::IBV_WR_RDMA_READ {
            0
        } else {
            self.fence
        }
    }

    /// Tables sized for `core`'s rings.
    pub(super) fn new(core: &QpCore) -> ScopedTables {
        ScopedTables {
            sq: vec![PostedRange::default(); core.sq.slot_count()].into_boxed_slice(),
            rq: vec![0; core.rq.slot_count()].into_boxed_slice(),
            send_wrs: Box::new([ffi::ibv_send_wr::default(); POST_CHUNK]),
            sges: Box::new([ffi::ibv_sge::default(); POST_CHUNK]),
            sig_end: 0,
            fence: if core.sq.completes_out_of_order() {
                ffi::ibv_send_flags::IBV_SEND_FENCE.0
            } else {
                0
            },
            sq_listing: false,
            rq_listing: false,
        }
    }
}
