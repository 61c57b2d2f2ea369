//! The per-queue slot rings that hold posted buffers until their completion.
//!
//! Each queue (SQ, RQ) of a QP has a ring of slots. Posting moves the work
//! request's buffers into the next slot and gives the NIC a *token* as the
//! `wr_id`: the ring's tag (its index in the CQ's [`RingTable`](super::table)
//! and a generation) in the high 32 bits, the request's sequence number in the
//! low 32. Polling validates the token before touching anything (the ring must
//! be registered on that CQ under that tag, belong to the completion's QP, and
//! hold a posted request of that sequence number inside its in-flight window),
//! takes the buffers out and advances the ring's tail. Queues complete in
//! order, so a completion for sequence `k` also retires every unsignaled
//! request before it. A completion that fails validation is never
//! dereferenced: it comes back as foreign or stale. An iWARP send queue
//! completes a READ after the requests posted behind it: its ring retires
//! out of order (`Ring::retire_out_of_order`), decided when the QP is
//! created, so an in-order queue pays one untaken branch for it.
//!
//! Concurrency: the poster (`&mut Qp`) is the only producer and the poller of
//! the queue's CQ (`&mut Cq`) the only consumer. A slot is published with its
//! `state` (Release on post) and claimed with a compare-exchange POSTED →
//! EMPTY (Acquire) by whoever takes its buffers: the consumer retiring it, the
//! producer taking back a refused post, or the QP's destructor releasing what
//! a destroyed QP left behind. Exactly one claim succeeds, so a buffer is
//! moved out (or dropped) exactly once. Slots are handed back to the producer
//! through `tail` (Release on retire, Acquire on post).
//!
//! A ring's slots are allocated on its first post (`slots.rs`).

use std::any::Any;
use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, Ordering};

use crate::ledger::sges::Sges;

mod slots;
mod srq;
mod sweep;
use slots::claim_slot;
pub(crate) use srq::SrqProducer;
use sweep::drop_in_place_catching;
pub(crate) use sweep::{Recycle, Release, Sweep};

const EMPTY: u8 = 0;
const POSTED: u8 = 1;

/// What the poller needs to know about a posted request besides its buffers.
#[derive(Clone, Copy)]
pub(crate) struct SlotMeta {
    /// What was posted, so that completions in error report it too: the
    /// `ibv_wr_opcode` of a send (mapped to its completion opcode by
    /// [`SlotMeta::completion_opcode`] when polled, off the post path), or
    /// `IBV_WC_RECV` for a receive.
    pub(crate) opcode: u32,
    /// It asked for a completion. A later completion that sweeps a signaled
    /// request means that request's own completion was lost.
    pub(crate) signaled: bool,
    /// The library's own drain marker (see `QpCore::post_drain_marker`): its
    /// completion retires the requests before it and is not handed out.
    pub(crate) drain: bool,
}

impl SlotMeta {
    /// Whether this is a receive.
    #[inline(always)]
    pub(crate) fn is_recv(self) -> bool {
        self.opcode == crate::ffi::IBV_WC_RECV
    }

    /// Whether the NIC writes the request's local buffers (a READ's
    /// destination, an atomic's result) after it has read its sources.
    #[inline]
    pub(crate) fn nic_writes_local(self) -> bool {
        use crate::ffi;
        matches!(
            self.opcode,
            ffi::IBV_WR_RDMA_READ
                | ffi::IBV_WR_ATOMIC_CMP_AND_SWP
                | ffi::IBV_WR_ATOMIC_FETCH_AND_ADD
        )
    }

    /// The `ibv_wc_opcode` the request completes with.
    #[inline]
    pub(crate) fn completion_opcode(self) -> u32 {
        SlotMeta::completion_opcode_of(self.opcode)
    }

    /// The `ibv_wc_opcode` a request posted with `opcode` (an
    /// `ibv_wr_opcode`, or `IBV_WC_RECV` for a receive) completes with.
    #[inline]
    pub(crate) fn completion_opcode_of(opcode: u32) -> u32 {
        use crate::ffi;
        match opcode {
            ffi::IBV_WC_RECV => ffi::IBV_WC_RECV,
            ffi::IBV_WR_RDMA_WRITE | ffi::IBV_WR_RDMA_WRITE_WITH_IMM => ffi::IBV_WC_RDMA_WRITE,
            ffi::IBV_WR_RDMA_READ => ffi::IBV_WC_RDMA_READ,
            ffi::IBV_WR_ATOMIC_CMP_AND_SWP => ffi::IBV_WC_COMP_SWAP,
            ffi::IBV_WR_ATOMIC_FETCH_AND_ADD => ffi::IBV_WC_FETCH_ADD,
            ffi::IBV_WR_ATOMIC_WRITE => ffi::IBV_WC_ATOMIC_WRITE,
            ffi::IBV_WR_FLUSH => ffi::IBV_WC_FLUSH,
            ffi::IBV_WR_LOCAL_INV => ffi::IBV_WC_LOCAL_INV,
            ffi::IBV_WR_BIND_MW => ffi::IBV_WC_BIND_MW,
            _ => ffi::IBV_WC_SEND,
        }
    }
}

struct SlotData {
    wr_id: u64,
    meta: SlotMeta,
    bufs: Sges,
}

/// One slot. `data` is initialised exactly while `state` is POSTED.
struct Slot {
    /// Sequence number (low 32 bits) of the request last posted here.
    seq: AtomicU32,
    state: AtomicU8,
    data: UnsafeCell<MaybeUninit<SlotData>>,
}

/// A retired request handed to the poller.
pub(crate) struct Retired {
    /// The application's wr_id.
    pub(crate) wr_id: u64,
    /// What was posted.
    pub(crate) meta: SlotMeta,
}

/// A panic caught while dropping buffers, re-raised once bookkeeping is done.
pub(crate) type HeldPanic = Option<Box<dyn Any + Send>>;

/// A ring of slots for one queue.
pub(crate) struct Ring {
    /// `mask + 1` slots (a power of two, at least `cap`, so that a sequence
    /// number maps to its slot with a mask instead of a division), allocated
    /// by the producer's first post: null until then, so a queue that is never
    /// posted to (the receive queue of a QP that only sends, a QP destroyed
    /// unused) costs no slot memory, and creating a QP builds none.
    slots: AtomicPtr<Slot>,
    mask: u32,
    /// Most work requests in flight: the queue's depth.
    cap: u32,
    /// The depth the producer's room checks and the poller's window go by:
    /// 0 until the slots are allocated, `cap` from then on. So neither needs
    /// a test of its own for unallocated slots: the first post finds no room
    /// and allocates them on that cold path, and the poller finds every
    /// sequence number outside an empty window.
    window: AtomicU32,
    tail: AtomicU64,
    /// High half of every token: index in the CQ's table and generation.
    tag: u32,
    /// The QP whose queue this is (completions of other QPs never match), or
    /// `SRQ_QPN` for a shared receive queue's ring.
    qp_num: u32,
    /// A shared receive queue's free slots (`None` for a QP's own queues).
    srq: Option<srq::FreeList>,
    /// Whether the provider may complete this queue out of order (iWARP:
    /// siw completes a SEND before an earlier READ), so that a signaled
    /// request swept without its completion may still be in the NIC's hands.
    out_of_order: bool,
    /// Whether any request may complete after later ones (EFA), not only READs
    /// and atomics (iWARP): then a signaled request swept by a later
    /// completion stays in flight until its own, and an unsignaled one is held.
    any_order: bool,
    /// Such requests' buffers, kept until the ring goes (after the QP is
    /// destroyed) instead of being dropped or handed back.
    held: std::sync::Mutex<Vec<Sges>>,
    /// On an out-of-order ring, one past the furthest request retired: the
    /// slots between the tail and here are retired or still in flight (only
    /// the consumer touches it).
    done_end: AtomicU64,
    /// [`release_posted`](Ring::release_posted) emptied the ring after its QP
    /// was destroyed: nothing is posted to it any more, so its drop has
    /// nothing left to release.
    released: AtomicBool,
}

// SAFETY: slot data is only touched by whoever won the slot's POSTED → EMPTY
// claim or (for EMPTY slots behind the tail) by the single producer; the
// hand-overs are acquire/release on `state` and `tail`; the buffers are Send.
unsafe impl Send for Ring {}
// SAFETY: as above: all shared mutation goes through the atomics.
unsafe impl Sync for Ring {}

impl Ring {
    /// A ring for `depth` requests. Depth 0 (a QP whose receives come from a
    /// shared receive queue) refuses every post.
    pub(crate) fn new(depth: u32, tag: u32, qp_num: u32) -> Ring {
        let cap = depth.min(1 << 30);
        let n = cap.next_power_of_two().max(1);
        Ring {
            slots: AtomicPtr::new(std::ptr::null_mut()),
            mask: n - 1,
            cap,
            window: AtomicU32::new(0),
            tail: AtomicU64::new(0),
            tag,
            qp_num,
            srq: None,
            out_of_order: false,
            any_order: false,
            held: std::sync::Mutex::new(Vec::new()),
            done_end: AtomicU64::new(0),
            released: AtomicBool::new(false),
        }
    }

    /// This ring's queue may complete out of order (an iWARP QP's send queue).
    pub(crate) fn completing_out_of_order(mut self) -> Ring {
        self.out_of_order = true;
        self
    }

    /// Any request of this ring's queue may complete after later ones (see
    /// `any_order`).
    pub(crate) fn completing_in_any_order(mut self) -> Ring {
        self.out_of_order = true;
        self.any_order = true;
        self
    }

    /// On a queue that completes out of order, whether a request swept by a
    /// later completion may still be in the NIC's hands: one that asked for
    /// its own completion (which has not come), or one whose buffers the NIC
    /// writes (siw completes a SEND before an earlier READ, signaled or not).
    /// The ordinary path leaves a signaled READ in flight instead (see
    /// [`retire_out_of_order`](Ring::retire_out_of_order)); the scope's
    /// requests before the scope sweep this way.
    #[cold]
    fn nic_may_still_use(&self, meta: SlotMeta) -> bool {
        self.any_order || meta.signaled || meta.nic_writes_local()
    }

    /// Whether this ring's queue may complete out of order (see
    /// [`completing_out_of_order`](Ring::completing_out_of_order)).
    #[inline]
    pub(crate) fn completes_out_of_order(&self) -> bool {
        self.out_of_order
    }

    /// Whether the ring keeps buffers of requests that may still be at the
    /// NIC (see `held`): their queue may still produce completions (flushes).
    pub(crate) fn holds_any(&self) -> bool {
        !self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    /// Keeps the buffers at `bufs` until the ring is dropped (see `held`).
    ///
    /// # Safety
    /// `bufs` belongs to a slot the caller claimed; they are moved out once.
    #[cold]
    #[inline(never)]
    unsafe fn hold(&self, bufs: *mut Sges) {
        let mut kept = Sges::default();
        // SAFETY: per the contract; `kept` holds nothing that needs dropping.
        unsafe { Sges::move_to(bufs, &mut kept) };
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(kept);
    }

    /// Capacity in work requests.
    #[inline]
    pub(crate) fn depth(&self) -> u64 {
        u64::from(self.cap)
    }

    /// The tag in the high half of this ring's tokens.
    #[inline]
    pub(crate) fn tag(&self) -> u32 {
        self.tag
    }

    /// The QP number the ring's completions carry.
    #[inline]
    pub(crate) fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// Outstanding work requests, seen from the producer whose count is `head`.
    #[inline]
    pub(crate) fn in_flight(&self, head: u64) -> u64 {
        head.wrapping_sub(self.tail.load(Ordering::Acquire))
    }

    /// The token the NIC carries for sequence number `seq`.
    #[inline(always)]
    pub(crate) fn token(&self, seq: u64) -> u64 {
        (u64::from(self.tag) << 32) | (seq & 0xffff_ffff)
    }

    /// Number of slots (a power of two): the size of a side table indexed
    /// by [`index`](Ring::index).
    #[inline]
    pub(crate) fn slot_count(&self) -> usize {
        self.mask as usize + 1
    }

    /// The slot index of sequence number `seq`.
    #[inline(always)]
    pub(crate) fn index(&self, seq: u64) -> usize {
        (seq & u64::from(self.mask)) as usize
    }

    /// The consumer's tail: every request before it is retired.
    #[inline(always)]
    pub(crate) fn tail(&self) -> u64 {
        self.tail.load(Ordering::Acquire)
    }

    /// Retires every request up to and including `seq` for a completion the
    /// slots did not carry (a scoped request, see `qp::scope`): posted slots
    /// in `tail..owned_end` (requests of the ordinary path, or a drain
    /// marker) are claimed and their buffers dropped on the way, and `lost`
    /// counts the signaled ones among them. Returns true when the slot of
    /// `seq` itself held such a request (then it is not the scope's).
    ///
    /// # Safety
    /// The caller is this ring's only consumer and read its tail as `tail`
    /// (passed in, so that the hot path loads it once); `seq` lies in
    /// `tail..head`.
    #[inline(always)]
    pub(crate) unsafe fn retire_through(
        &self,
        tail: u64,
        seq: u64,
        owned_end: u64,
        caught: &mut HeldPanic,
        lost: &mut u64,
    ) -> bool {
        debug_assert_eq!(tail, self.tail.load(Ordering::Relaxed));
        let mut own = false;
        if tail < owned_end {
            own = self.sweep_owned(tail, (seq + 1).min(owned_end), seq, caught, lost);
        }
        self.tail.store(seq + 1, Ordering::Release);
        own
    }

    #[cold]
    #[inline(never)]
    fn sweep_owned(
        &self,
        from: u64,
        to: u64,
        target: u64,
        caught: &mut HeldPanic,
        lost: &mut u64,
    ) -> bool {
        let mut own = false;
        for s in from..to {
            let Some(d) = self.claim_ptr(s) else { continue };
            own |= s == target;
            // SAFETY: claimed, so initialised and ours; dropped once.
            unsafe {
                let swept = s != target;
                let swept_signaled = (*d).meta.signaled && swept;
                *lost += u64::from(swept_signaled);
                if swept && self.out_of_order && self.nic_may_still_use((*d).meta) {
                    self.hold(&raw mut (*d).bufs);
                } else {
                    drop_in_place_catching(&raw mut (*d).bufs, caught);
                }
            }
        }
        own
    }

    /// Moves `*bufs` into the slot for sequence number `seq` and returns the
    /// token to post as the wr_id.
    ///
    /// # Safety
    /// Only the producer calls this, for `seq` with `in_flight(seq) <
    /// posting_depth()` (so the slots are allocated); `*bufs` is moved out
    /// (the caller must not use or drop it afterwards).
    #[inline]
    pub(crate) unsafe fn fill(
        &self,
        seq: u64,
        wr_id: u64,
        meta: SlotMeta,
        bufs: *const Sges,
    ) -> u64 {
        // SAFETY: the room check allocated the slots (contract).
        let slot = unsafe { self.slot_allocated(seq) };
        debug_assert_eq!(slot.state.load(Ordering::Relaxed), EMPTY);
        let data = slot.data.get().cast::<SlotData>();
        // SAFETY: the slot is EMPTY, and `seq` is at the producer's head, past
        // every sequence number the consumer, a claimer or a sweep looks at
        // (they stay in `tail..head`), so nobody else touches its data until
        // the Release store below publishes it; `bufs` per the contract.
        unsafe {
            (&raw mut (*data).wr_id).write(wr_id);
            (&raw mut (*data).meta).write(meta);
            Sges::move_to(bufs, &raw mut (*data).bufs);
        }
        slot.seq.store(seq as u32, Ordering::Relaxed);
        slot.state.store(POSTED, Ordering::Release);
        self.token(seq)
    }

    /// Claims the slot for `seq` if it holds a posted request: the caller now
    /// owns the data behind the pointer and must move it out (or drop it)
    /// before the tail passes the slot.
    #[inline(always)]
    fn claim_ptr(&self, seq: u64) -> Option<*mut SlotData> {
        claim_slot(self.slot(seq)?)
    }

    /// [`claim_ptr`](Ring::claim_ptr) for a caller that knows the slots are allocated.
    ///
    /// # Safety
    /// As [`slot_allocated`](Ring::slot_allocated)'s.
    #[inline(always)]
    unsafe fn claim_allocated(&self, seq: u64) -> Option<*mut SlotData> {
        // SAFETY: per the contract.
        claim_slot(unsafe { self.slot_allocated(seq) })
    }

    /// Claims the slot for `seq` and moves its data out (cold paths).
    fn claim(&self, seq: u64) -> Option<SlotData> {
        // SAFETY: the claim succeeded, so the data was initialised (published
        // with Release, acquired by the claim) and this thread alone moves it out.
        self.claim_ptr(seq).map(|d| unsafe { d.read() })
    }

    /// The `ibv_wr_opcode` (or `IBV_WC_RECV`) of the request staged at `seq` and whether
    /// it has no buffers, if its slot holds it: what a provider refused (cold paths only).
    ///
    /// # Safety
    /// Only the producer calls this, for a slot it filled whose work request the
    /// device did not accept (so no completion can claim it meanwhile).
    #[cold]
    pub(crate) unsafe fn staged(&self, seq: u64) -> Option<(u32, bool)> {
        let slot = self.slot(seq)?;
        if slot.state.load(Ordering::Acquire) != POSTED
            || slot.seq.load(Ordering::Relaxed) != seq as u32
        {
            return None;
        }
        // SAFETY: POSTED means the data is initialised; per the contract nobody
        // claims it while this reads it.
        let data = unsafe { &*slot.data.get().cast::<SlotData>() };
        Some((data.meta.opcode, data.bufs.is_empty()))
    }

    /// Takes back the slots `from..*head` that were filled but never reached
    /// the NIC (the post failed or unwound), and moves `head` back to `from`.
    ///
    /// # Safety
    /// Only the producer calls this, for slots it filled and whose work requests
    /// the device did not accept.
    pub(crate) unsafe fn unfill_from(&self, from: u64, head: &mut u64) -> Vec<(u64, Sges)> {
        let out = (from..*head)
            .filter_map(|seq| self.claim(seq))
            .map(|d| (d.wr_id, d.bufs))
            .collect();
        *head = from;
        out
    }

    /// Releases the buffers of every request still posted. For the QP's
    /// destructor, after `ibv_destroy_qp` returned (the NIC is done with them);
    /// a panicking buffer `Drop` is contained so the destructor never unwinds.
    pub(crate) fn release_all(&self) {
        if self.slots.load(Ordering::Acquire).is_null() {
            return;
        }
        for seq in 0..self.slot_count() as u64 {
            if let Some(d) = self.claim(seq) {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(d)));
            }
        }
    }

    /// [`release_all`](Ring::release_all) for a QP's own queue whose producer
    /// count is `head`, scanning only what can still be posted: the producer
    /// advances `head` right after filling its slot, with nothing between that
    /// can unwind, takes slots back before moving `head` back, and the tail
    /// never passes a posted slot, so every posted request lies in `tail..head`.
    /// The scan is as long as what is in flight, usually nothing, not the ring.
    /// Marks the ring released (see `released`).
    ///
    /// # Safety
    /// The caller was this ring's producer, `head` its count, and it posts
    /// nothing more (the QP is destroyed).
    pub(crate) unsafe fn release_posted(&self, head: u64) {
        let tail = self.tail.load(Ordering::Acquire);
        for seq in tail..head {
            if let Some(d) = self.claim(seq) {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(d)));
            }
        }
        self.released.store(true, Ordering::Relaxed);
    }

    /// Retires the request with sequence number `seq32` (low 32 bits) and every
    /// request before it, moving its buffers to `bufs_out`.
    ///
    /// The buffers of requests swept on the way go to `sweep`; a panic there
    /// (a buffer's `Drop`, a recycling closure) is kept in `caught` (the first
    /// one) so the ring stays consistent, and `lost` counts swept requests that had asked
    /// for a completion (theirs never came: the CQ overran, or someone else
    /// consumed it). Returns `None` without changing anything when `seq32`
    /// names no posted request of this ring (a stale or forged completion), or
    /// after sweeping when the destructor took the request first.
    ///
    /// # Safety
    /// The caller is this ring's only consumer (holds `&mut` to its CQ) and
    /// `bufs_out` is valid for writes and holds nothing that needs dropping.
    /// The completion carrying `seq32` came from this ring's QP.
    #[inline]
    pub(crate) unsafe fn retire(
        &self,
        seq32: u32,
        sweep: &mut impl Sweep,
        bufs_out: *mut Sges,
        caught: &mut HeldPanic,
        lost: &mut u64,
    ) -> Option<Retired> {
        let tail = self.tail.load(Ordering::Relaxed);
        let dist = seq32.wrapping_sub(tail as u32);
        // Acquire: an open window means the slots are visible.
        if dist >= self.window.load(Ordering::Acquire) {
            return None;
        }
        let seq = tail + u64::from(dist);
        // SAFETY: the window is open, so the slots are allocated.
        let target = unsafe { self.slot_allocated(seq) };
        if target.state.load(Ordering::Acquire) != POSTED
            || target.seq.load(Ordering::Relaxed) != seq32
        {
            return None;
        }
        if self.out_of_order {
            // SAFETY: per the contract; `seq` is posted and in the window.
            return unsafe { self.retire_out_of_order(tail, seq, sweep, bufs_out, caught, lost) };
        }
        for s in tail..seq {
            // SAFETY: `target` is a slot of this ring, so they are allocated.
            let Some(d) = (unsafe { self.claim_allocated(s) }) else {
                continue;
            };
            // SAFETY: claimed, so initialised and ours; each field is moved out
            // (or dropped) once, and the slot is EMPTY so no one reads it again.
            unsafe {
                *lost += u64::from((*d).meta.signaled);
                sweep.take((*d).wr_id, &raw mut (*d).bufs, caught);
            }
        }
        // SAFETY: per the contract.
        let done = unsafe { Self::take_target(target, bufs_out) };
        self.tail.store(seq + 1, Ordering::Release);
        done
    }

    /// Claims the completed request's slot `target` and moves its buffers to `bufs_out`.
    ///
    /// # Safety
    /// As [`retire`](Ring::retire)'s.
    #[inline(always)]
    unsafe fn take_target(target: &Slot, bufs_out: *mut Sges) -> Option<Retired> {
        claim_slot(target).map(|d| {
            // SAFETY: claimed, so initialised and ours; `bufs_out` is valid for
            // writes per the contract; only the used buffer entries are copied.
            unsafe {
                Sges::move_to(&raw const (*d).bufs, bufs_out);
                Retired {
                    wr_id: (*d).wr_id,
                    meta: (*d).meta,
                }
            }
        })
    }

    /// [`retire`](Ring::retire) on a queue that completes out of order (iWARP: a
    /// READ completes when its response has arrived, after the SENDs and WRITEs
    /// posted behind it, which complete in posting order among themselves).
    ///
    /// The completion of `seq` retires its own slot. Before it, a signaled READ
    /// or atomic still posted stays in flight (its own completion comes later)
    /// and keeps the tail, so its slot and the window stay reserved; an
    /// unsignaled one never gets a completion, so its buffers are held until
    /// the ring goes (`held`); every other request before `seq` completed
    /// before it and retires as on an in-order queue, except that a signaled
    /// one (whose completion was lost) is held as well. `done_end` remembers
    /// the furthest request retired, so that the completion of the READ at the
    /// tail moves the tail past the slots retired ahead of it. On a ring whose
    /// requests may all complete late (`any_order`), every signaled request
    /// before `seq` stays in flight as a READ does, and every unsignaled one is
    /// held.
    ///
    /// # Safety
    /// As [`retire`](Ring::retire)'s; `tail` is the tail it loaded and `seq`
    /// a posted request of the window.
    #[cold]
    #[inline(never)]
    unsafe fn retire_out_of_order(
        &self,
        tail: u64,
        seq: u64,
        sweep: &mut impl Sweep,
        bufs_out: *mut Sges,
        caught: &mut HeldPanic,
        lost: &mut u64,
    ) -> Option<Retired> {
        let mut first_left = None;
        for s in tail..seq {
            // SAFETY: `seq` is posted (contract), so the slots are allocated.
            let slot = unsafe { self.slot_allocated(s) };
            if slot.state.load(Ordering::Acquire) != POSTED {
                continue; // retired ahead of an earlier READ
            }
            // SAFETY: POSTED, so initialised (published with Release, seen
            // with the Acquire above); the producer writes no slot in
            // `tail..head` (only at the head, past `seq`) and nobody writes
            // `meta` after the fill, so a copy is sound even if the destructor
            // claims the slot meanwhile.
            let meta = unsafe { (*slot.data.get().cast::<SlotData>()).meta };
            if meta.signaled && (self.any_order || meta.nic_writes_local()) {
                first_left.get_or_insert(s);
                continue;
            }
            // SAFETY: as above.
            let Some(d) = (unsafe { self.claim_allocated(s) }) else {
                continue;
            };
            // SAFETY: claimed, so initialised and ours; moved out or dropped once.
            unsafe {
                *lost += u64::from(meta.signaled);
                if self.nic_may_still_use(meta) {
                    self.hold(&raw mut (*d).bufs);
                    continue;
                }
                sweep.take((*d).wr_id, &raw mut (*d).bufs, caught);
            }
        }
        // SAFETY: per the contract (`seq` is posted, so the slots are allocated).
        let done = unsafe { Self::take_target(self.slot_allocated(seq), bufs_out) };
        let done_end = self.done_end.load(Ordering::Relaxed).max(seq + 1);
        self.done_end.store(done_end, Ordering::Relaxed);
        let new_tail = first_left.unwrap_or_else(|| {
            // Past the slots retired ahead of `seq`, up to the next one in flight.
            (seq + 1..done_end)
                .find(|&s| {
                    // SAFETY: as above.
                    unsafe { self.slot_allocated(s) }
                        .state
                        .load(Ordering::Relaxed)
                        == POSTED
                })
                .unwrap_or(done_end)
        });
        self.tail.store(new_tail, Ordering::Release);
        done
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Reached only after the QP was destroyed (the NIC is done) or never
        // posted to; release_posted claimed everything already in the first
        // case (the last owner's drop is ordered after its store).
        if !*self.released.get_mut() {
            self.release_all();
        }
        // The buffers held for an out-of-order queue go one at a time, a
        // panicking `Drop` contained, as `release_all`'s: the ring's last
        // owner may be a CQ's drop or a poll.
        let held = self.held.get_mut();
        for bufs in std::mem::take(held.unwrap_or_else(std::sync::PoisonError::into_inner)) {
            let _ = catch_unwind(AssertUnwindSafe(move || drop(bufs)));
        }
        let base = *self.slots.get_mut();
        if !base.is_null() {
            // SAFETY: `base` came from `install_slots`, and `&mut self` means
            // no reference to the slots is left; their data was moved out or
            // dropped above (or never initialised), and `Slot` has no drop glue
            // of its own.
            drop(unsafe { self.slots_box(base) });
        }
    }
}

#[cfg(test)]
mod tests;
