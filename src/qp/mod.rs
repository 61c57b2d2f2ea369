//! Queue pairs: the state machine in types, and a data path safe code cannot misuse.
//!
//! # The state machine
//! `Qp<Rc, Reset>` → [`init`](Qp::init) → `Qp<Rc, Init>` → [`rtr`](Qp::rtr) →
//! `Qp<Rc, Rtr>` → [`rts`](Qp::rts) → `Qp<Rc, Rts>`; [`to_error`](Qp::to_error)
//! and [`reset`](Qp::reset) from any state (ERR not from RESET). Each transition consumes the QP and
//! takes exactly the attributes the kernel requires; a refused transition
//! hands the QP back in its old state inside [`TransitionError`].
//!
//! UC ([`Uc`]: SEND and RDMA WRITE, unacknowledged) and UD ([`Ud`]:
//! datagrams through an [`AddressHandle`](crate::AddressHandle)) have the
//! same states with their own constructors ([`Qp::new_uc`], [`Qp::new_ud`]),
//! transition attributes ([`UcInitAttr`], [`UcRtrAttr`], [`UdInitAttr`]; no
//! retry or RNR attributes, no remote at UD's RTR) and request types
//! ([`UcSendWr`]: no READ or atomics; [`UdSendWr`]: SEND naming its address
//! handle, remote QPN and Q_Key; [`UdRecvWr`]: the GRH apart from the
//! payload). What a transport cannot do has no constructor, so it does not
//! compile (see `tests/ui`).
//! [`post_recv`](Qp::post_recv) exists from INIT on, [`post_send`](Qp::post_send)
//! only in RTS; misuse does not compile:
//!
//! ```compile_fail
//! # fn f(qp: &mut rdma_verbs::Qp<rdma_verbs::Rc, rdma_verbs::qp::Rtr>) {
//! qp.post_send(rdma_verbs::SendWr::send(1)); // no post_send before RTS
//! # }
//! ```
//!
//! # Why the safe data path is sound
//! After `ibv_post_send`/`ibv_post_recv` the NIC reads or writes the posted
//! buffers until the work request completes. The safe path makes that
//! ownership explicit:
//!
//! * Posting **moves** the buffers ([`Mr`](crate::Mr), or a read-only
//!   [`SharedMr`](crate::SharedMr) for SEND/WRITE sources) into a slot of the
//!   queue's preallocated ring (no heap allocation per work request). Nothing
//!   else can reach them until they come back.
//! * The `wr_id` the NIC sees is a **token**, not a pointer: the ring's index
//!   and generation in its CQ's ring table, and the request's sequence
//!   number. No two rings on a CQ share a tag: an index is reused only after
//!   its ring was reaped (with a new generation), and a table that would
//!   need an index past the token's 23 bits refuses the QP (`ledger::table`).
//!   [`Cq::poll`](crate::Cq::poll) (single consumer: `&mut Cq`)
//!   validates every completion before touching anything: the ring must be
//!   registered on that CQ under that tag, belong to the completion's QP
//!   number, and hold a posted request with that sequence number inside its
//!   in-flight window. Anything else (a raw-path post, a QP created outside
//!   this crate, a provider bug, a completion of a destroyed QP) comes back
//!   as [`CompletionSource::Foreign`](crate::CompletionSource::Foreign) or
//!   [`Stale`](crate::CompletionSource::Stale), without buffers.
//! * A valid completion returns the request's buffers inside the
//!   [`Completion`](crate::Completion). Queues complete in order, so it also
//!   retires the unsignaled requests before it; their buffers are released
//!   then, or handed back by
//!   [`Cq::poll_with_retired`](crate::Cq::poll_with_retired). The QP forces a
//!   signaled request when its ring would fill up, so it can never wedge.
//! * Each slot is claimed by one compare-exchange (POSTED → EMPTY) by whoever
//!   takes its buffers: the poller, the poster taking back a refused post, or
//!   the QP's destructor. A buffer moves out (or drops) exactly once.
//! * NIC-written destinations (receives, READ and atomic results) must be
//!   exclusively owned `Mr`s; `SharedMr` is refused there, since others may
//!   be reading it.
//! * **The CQ cannot overrun through the safe path.** A queue of depth `d`
//!   has at most `d` completions in its CQ (one per posted request, signaled
//!   or flushed), so creating a QP reserves its queues' depths on its CQs,
//!   and a QP that does not fit is refused
//!   ([`Error::CqTooSmall`]). If completions are
//!   lost anyway (raw posts, [`Cq::poll_raw`](crate::Cq::poll_raw)), the
//!   poller sees a later completion sweep a signaled request and reports
//!   [`Error::CompletionsLost`].
//! * **QP dropped with work in flight**: `ibv_destroy_qp` returns only when
//!   the NIC is done with the QP, so the destructor releases the buffers still
//!   posted right away. Its completions may still sit in the CQ: its rings
//!   stay registered (empty) until a poll finds the CQ empty, so those
//!   completions come back `Stale`; then the rings and their reserved CQ
//!   entries are given back. A queue with nothing in flight when its QP is
//!   dropped (every request retired by a polled completion) and no raw post
//!   ever has no completion left in the CQ: its reserved entries come back
//!   at once (its ring still waits for the empty poll).
//! * [`reset`](Qp::reset) needs a drained QP (nothing outstanding on either
//!   queue), because whether RESET discards posted work is up to the
//!   provider; [`to_error`](Qp::to_error) and polling the flushes drains it.
//!   An unsignaled send that completed successfully produces no completion
//!   to flush, so `to_error` posts a signaled zero-length drain marker when
//!   sends are outstanding (flushed at once, never on the wire) whose
//!   completion retires them and is not handed out.
//! * **Panics.** A panic in the iterator given to
//!   [`post_send_list`](Qp::post_send_list) / [`post_recv_list`](Qp::post_recv_list)
//!   unwinds through a guard that takes the requests staged for the verb
//!   call back out of the ring. A buffer whose `Drop` panics while the poller
//!   retires it is contained until the ring's books are consistent, then the
//!   panic resumes from `poll`; the QP's destructor contains it for good.
//! * **Shared receive queues** ([`crate::srq`]). Receives posted to an SRQ
//!   are consumed by whichever QP on it gets a message first, so they
//!   complete out of posting order across QPs: the in-order sweep above
//!   would retire receives another QP still fills. An SRQ's ring never
//!   sweeps: every SRQ receive produces its own completion (success or
//!   flush), which retires exactly its slot, and slots are reused in any
//!   order (a free list; each reuse bumps a per-slot generation carried in
//!   the token). The completion's QP number is whichever QP consumed the
//!   receive, so it is not checked; the token is validated strictly
//!   instead: the ring registered under that tag on *this* CQ, the slot
//!   posted, its generation current. That suffices because an SRQ is bound
//!   to one CQ and every QP the crate creates on it must use that CQ for its
//!   receives ([`Error::SrqCqMismatch`]), so the completion of an SRQ receive
//!   can only appear where its ring is registered; raw posts cannot carry
//!   tokens. The SRQ reserves its depth on that CQ; a QP on it reserves no
//!   receive entries and has a receive ring of depth 0 (its `post_recv` is
//!   refused with [`Error::QpUsesSrq`]). QPs keep the SRQ alive, so
//!   `ibv_destroy_srq` runs after all of them were destroyed; the buffers
//!   still posted are released after it returns, and the ring stays
//!   registered (empty) until the CQ is polled empty, like a destroyed QP's.
//!   A receive a QP had taken but not completed when that QP left the
//!   connection (ERR, RESET, destroyed) and that the provider neither completes nor
//!   flushes stays in its slot: its buffer is released with the SRQ, and
//!   [`Srq::posted`](crate::Srq::posted) keeps counting it. On rxe, ERR
//!   flushes such a receive (`WR_FLUSH_ERR`, buffer back) while
//!   [`reset`](Qp::reset) and dropping the QP mid-message lose it (a review's
//!   run with a 4 MiB SEND in flight: 5 buffers back and `posted()` 1 after
//!   a reset or a drop, 6 back and 0 after `to_error`). [`reset`](Qp::reset)
//!   cannot see it (the QP's own receive queue is empty), so move such a QP
//!   to ERR and poll before resetting or dropping it.
//! * **Scoped borrowing** ([`scope`], [`Cq::scope`](crate::Cq::scope)).
//!   Requests posted in a scope borrow their buffers for the scope's
//!   lifetime instead of moving them; the slots keep only the `wr_id`
//!   (in a per-QP side table), and the scope's tokens are ordinary tokens
//!   of the QP's ring. The scope holds `&mut` to the CQ and to each
//!   attached QP, so it alone polls and posts; its completions retire the
//!   ring as above (in order). `Cq::scope` returns, normally or by
//!   unwinding, only once every request posted in the scope was retired;
//!   requests that do not finish within the drain timeout are flushed by
//!   moving their QP to ERR (plus the drain marker behind unsignaled
//!   sends). Both rely on the rows "complete in posting order" and "ERR
//!   flushes every posted request" below; a provider that broke the second
//!   would make the scope abort the process rather than return.
//!   Completions that are not the scope's are kept in the CQ and returned,
//!   with their buffers, by the next [`Cq::poll`](crate::Cq::poll).
//! * **Memory a peer can write** (REMOTE_WRITE/REMOTE_ATOMIC) is never exposed
//!   as a Rust slice; copies in and out use atomic accesses (see
//!   [`crate::mr`]).
//!
//! # What the argument relies on
//! Each behaviour below is asserted on soft-RoCE by `tests/vm_soundness.rs`
//! (UD rows: `tests/vm_ud_uc.rs` and `qp::device_tests`; the shared receive
//! queue rows: `tests/vm_srq.rs`).
//!
//! | Assumption | Source | Test |
//! |---|---|---|
//! | Completions of one queue (SQ or RQ) arrive in posting order | IB spec vol. 1, 10.8.3 ("work requests on a queue complete in order"); `ibv_post_send(3)` | `each_queue_completes_in_posting_order` |
//! | No completion for a QP is generated after `ibv_destroy_qp` returns | `ibv_destroy_qp(3)`; Linux rxe `rxe_qp_do_cleanup` stops the QP's tasks (drivers/infiniband/sw/rxe/rxe_qp.c); mlx5 `destroy_qp_common` moves the QP to RESET before destroying it | `no_completion_arrives_after_destroy_returns` |
//! | ERR flushes every posted request with a completion | `ibv_modify_qp(3)` / IB spec 10.3.1 (error state: "work requests are completed in error") | `the_error_state_flushes_every_posted_request` |
//! | `wr_id`, `status`, `qp_num` are written for every completion; other fields only as the status and opcode make them valid | `ibv_poll_cq(3)`; rdma-core `providers/mlx5/cq.c` leaves the rest unwritten | `cq::tests` (host, poisoned entries), `failed_completions_report_what_was_posted` |
//! | An SRQ receive completes once, on the receive CQ of the QP that consumed it, carrying that QP's number | `ibv_create_srq(3)`, `ibv_post_srq_recv(3)`; IB spec vol. 1, 10.2.9 (an SRQ WQE is consumed by one QP and completes on its receive CQ) | `sixteen_qps_share_an_srq_and_every_receive_comes_back_once` |
//! | SRQ receives may complete out of posting order across the QPs that consume them | IB spec vol. 1, 10.2.9 (in-order completion holds per QP, not per SRQ) | `receives_consumed_out_of_order_across_qps_retire_their_own_slots` (and `ledger::ring::srq` unit tests) |
//! | A QP on an SRQ that enters ERR flushes only the receives it had consumed; the others stay in the SRQ for the other QPs | IB spec vol. 1, 10.2.9.5; Linux rxe `flush_recv_queue` returns early for QPs on an SRQ | `a_qp_on_the_srq_in_err_leaves_the_srq_receives_to_the_others` |
//! | No completion for an SRQ's receives after `ibv_destroy_srq` returns (it is called after every QP on it is destroyed) | `ibv_destroy_srq(3)` (refused while QPs use the SRQ) | `dropping_the_srq_and_its_qps_with_receives_posted_frees_everything` |
//! | A CQ of depth `d` holds `d` completions | `ibv_create_cq(3)` (`cqe` is the minimum; the actual depth is read back) | `queues_that_would_overrun_the_cq_are_refused` |
//! | A UD receive's first 40 bytes take the GRH: with a 40-byte first SGE the GRH fills it and the payload starts at the second; `byte_len` counts the 40 | IB spec vol. 1, 11.4.1.2 (`ibv_post_recv(3)`: "the first 40 bytes of the buffer"); Linux rxe `send_data_in` of the GRH before the payload (drivers/infiniband/sw/rxe/rxe_resp.c) | `ud_reaches_several_peers_and_the_grh_stays_apart_from_the_payload` |
//! | An extended post (`ibv_wr_start` .. `ibv_wr_complete`) that fails posts none of its requests, and legacy and extended posts may alternate on one QP | `ibv_wr_post(3)` (RETURN VALUE: "the entire posting will be aborted"; DESCRIPTION: batches of both APIs "can interleave" outside each other's critical region) | `a_refused_extended_chain_posts_nothing`, `every_operation_moves_the_same_bytes_on_both_apis` (`tests/vm_send_api.rs`) |
//! | A UD receive's GRH bytes are the IPv6 GRH, or on RoCE v2/IPv4 an IPv4 header in bytes 20..40 | rdma-core `ibv_init_ah_from_wc` (libibverbs/verbs.c) reads them so | `ud_reaches_several_peers_and_the_grh_stays_apart_from_the_payload` (`sgid`, `from_completion`) |
//!
//! Not relied on: that RESET discards posted work (some rxe versions keep
//! posted receives), hence the drained-QP rule above
//! (`reset_needs_a_drained_qp`); that `wr_id`s are ours (validated tokens,
//! `foreign_wr_ids_are_never_dereferenced`); that a provider copies a UD
//! send's address vector at post time (rxe and mlx5 do): the QP keeps a clone
//! of the [`AddressHandle`](crate::AddressHandle) until the send's slot is
//! reused or the QP is destroyed
//! (`a_ud_qp_keeps_its_address_handles_until_done_and_drops_everything_once`).
//!
//! Misuse that remains possible in safe code is harmless: completions
//! consumed by [`Cq::poll_raw`](crate::Cq::poll_raw) leave their buffers in
//! the ring until a later completion sweeps them (reported as lost) or the QP
//! is destroyed.
//!
//! The `unsafe` [`post_send_raw`](Qp::post_send_raw) /
//! [`post_recv_raw`](Qp::post_recv_raw) take C work requests for callers who
//! manage buffers themselves; their contract is in their `# Safety` sections.
//! Their completions come back as `Foreign` from `Cq::poll` (or raw from
//! `poll_raw`); they bypass the queue's depth, so keep the queue's total
//! within the QP's caps or the CQ can overrun.
//!
//! # What the safe path costs
//! Per request: the checks, moving its buffers into a slot and back out
//! (only the used entries are copied), an `Arc` count per
//! [`SharedMr`](crate::SharedMr) clone, and the C work request the verb reads.
//! No allocation, lock or system call of its own. A [`SendWr`] is about 230
//! bytes, so in tight loops build it in the `post_send` call (or in the
//! iterator given to `post_send_list`) rather than passing it through
//! variables, `if`/`match` results or closures that return it: each of those
//! is a copy. [`SendWr::send_from`], [`SendWr::write_from`] and
//! [`SendWr::read`] build one-buffer requests in place. The `perf` example's
//! `--safe` path and `benches/` measure the difference against `--raw`.
//!
//! # Send API
//! RC QPs from [`Qp::new`] and [`Qp::new_with_srq`] post their sends with the
//! extended work request API (`ibv_wr_*`, [`SendApi::Extended`]) where the
//! provider supports it and with `ibv_post_send` otherwise
//! ([`Qp::send_api`] tells; [`Qp::new_with_send_api`] chooses). Safe and
//! raw sends are written as a C chain and then either handed to
//! `ibv_post_send` or replayed as builder calls (a raw chain's reserved
//! `wr_id`s are checked during the replay); scoped requests on an extended
//! QP go straight to the builders, single posts and prepared lists alike.
//! [`send_ex`] has the rules. Nothing else differs: the rings, tokens and
//! checks are the same, and a refused extended post is refused whole.
//!
//! Inside [`Cq::scope`](crate::Cq::scope) a request costs about what the C
//! verb costs: no buffer moves, a 24-byte side entry per send post (8 bytes
//! per receive), the builders called directly (a C request written in place
//! on a legacy QP) and light completions (`cargo xtask insn`: `perf
//! --scoped` against `--raw`, README "Performance").

// A refused transition hands the whole QP back by value (that is the point);
// the error path is cold, so its size does not matter.
#![allow(clippy::result_large_err)]

pub mod attr;
pub(crate) mod post;
mod queue;
pub mod scope;
pub mod send_ex;
pub mod state;
mod uc;
mod ud;

pub use crate::ledger::wr;

#[cfg(test)]
mod device_tests;

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::cq::{Cq, CqInner};
use crate::error::{Error, Result, errno, last_errno};
use crate::ffi;
use crate::pd::Pd;
use crate::srq::{Srq, SrqInner};

pub use crate::ledger::sges::{Buffer, MAX_SAFE_SGES, Sges, SgesIntoIter};
pub use crate::ledger::wr::{PostError, RecvWr, SendWr};
pub use attr::{
    AddressVector, Endpoint, Grh, InitAttr, QpAttr, QpCaps, QpStateKind, RtrAttr, RtsAttr,
    UcInitAttr, UcRtrAttr, UdInitAttr,
};
pub use send_ex::SendApi;
pub use state::{
    CanPostRecv, CanPostSend, Connected, Init, QpState, QpType, Rc, Reset, Rtr, Rts, Uc, Ud,
};
pub use uc::UcSendWr;
pub use ud::{UdMessage, UdRecvWr, UdSendWr};

use crate::ledger::ring::Ring;
use queue::{RecvQueue, SendQueue};

/// A queue pair of transport `T` in state `S`.
pub struct Qp<T: QpType, S: QpState> {
    core: QpCore,
    _marker: PhantomData<(T, S)>,
}

struct QpCore {
    raw: NonNull<ffi::ibv_qp>,
    /// Slot rings of the send and receive queue, registered on their CQs.
    sq: Arc<Ring>,
    rq: Arc<Ring>,
    sq_head: u64,
    rq_head: u64,
    caps: QpCaps,
    psn: u32,
    port: u8,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    pd: Pd,
    /// UD only: the address handles of posted sends and the largest payload.
    ud: Option<Box<ud::UdState>>,
    /// The shared receive queue the QP takes its receives from (its own
    /// receive ring then has depth 0); released after the QP is destroyed.
    srq: Option<Arc<SrqInner>>,
    /// Dropped after the QP is destroyed (e.g. the rdma_cm id that created it).
    _keepalive: Option<Box<dyn Any + Send + Sync>>,
    /// What scoped requests need (see [`scope`]), made by the first scope.
    scoped: Option<Box<scope::ScopedTables>>,
    /// The extended send interface, when the QP was created with one.
    send_ex: Option<send_ex::SendEx>,
    /// The next `wr_id` an `AsyncQp` wrapping this QP gives a request: kept
    /// across wrappers, so that no completion of an earlier wrapper's
    /// request (retired, but perhaps not dispatched yet) carries the `wr_id`
    /// of a later one's.
    #[cfg(feature = "tokio")]
    async_next_id: u64,
    /// A raw post (`post_send_raw`, `post_recv_raw`) was made: its
    /// completions are not counted by the rings, so the CQ entries stay
    /// reserved after the QP is destroyed until a poll finds the CQ empty.
    raw_posted: bool,
}

// SAFETY: ibv_qp may be used from any thread; posting needs &mut Qp, so one
// thread posts at a time, and the rings are Send + Sync (see ring.rs).
unsafe impl Send for QpCore {}
// SAFETY: &Qp only reaches query verbs, which libibverbs makes thread-safe.
unsafe impl Sync for QpCore {}

impl Drop for QpCore {
    fn drop(&mut self) {
        // SAFETY: raw is a live QP owned by this core. After ibv_destroy_qp returns
        // the NIC no longer touches its buffers and generates no completion for it.
        let rc = unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) };
        if rc != 0 {
            // The QP survives, so its buffers, rings and address handles
            // must too: leak them.
            std::mem::forget(self.sq.clone());
            std::mem::forget(self.rq.clone());
            std::mem::forget(self.ud.take());
            return;
        }
        // A queue with nothing in flight (and no raw posts) has no completion
        // left in its CQ: its CQ entries can be given back now.
        let sq_drained = !self.raw_posted && self.sq.in_flight(self.sq_head) == 0;
        let rq_drained = !self.raw_posted && self.rq.in_flight(self.rq_head) == 0;
        // Release the buffers now (no need to wait for the CQ to be polled);
        // the rings stay registered until the CQs are polled empty, so that
        // completions still queued for this QP are recognised as stale.
        self.sq.release_all();
        self.rq.release_all();
        self.send_cq.rings.bury(&self.sq, sq_drained);
        self.recv_cq.rings.bury(&self.rq, rq_drained);
    }
}

impl QpCore {
    /// Posts the send chain at `head` (see [`send_ex::post_chain`]).
    ///
    /// # Safety
    /// As `ibv_post_send`'s: `head` heads a well-formed chain whose memory
    /// the caller keeps valid as the verb requires; `bad` is writable.
    #[inline(always)]
    unsafe fn post_send_chain(
        &self,
        head: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        // SAFETY: raw is live and send_ex (if any) is its extended interface;
        // the chain is the caller's promise.
        unsafe { send_ex::post_chain::<false>(self.raw.as_ptr(), self.send_ex.as_ref(), head, bad) }
    }

    /// After a move to ERR: when sends are outstanding (and a slot is free),
    /// posts a signaled zero-length SEND without buffers. In ERR it is flushed
    /// at once; queues complete in order, so its completion retires every
    /// send before it: unsignaled ones that completed without a completion,
    /// and any whose completion `poll_raw` consumed. The poller recognises it
    /// by its slot and does not hand it out. A provider that refuses the post
    /// leaves things as they were (the ring slot is taken back).
    ///
    /// Not on UD: a UD send needs an address handle, and UD sends are always
    /// signaled, so every one of them completes (or is flushed) anyway.
    fn post_drain_marker(&mut self) {
        if self.ud.is_some() {
            return;
        }
        let (ring, head) = (&self.sq, &mut self.sq_head);
        let in_flight = ring.in_flight(*head);
        if in_flight == 0 || in_flight >= ring.depth() {
            return;
        }
        let bufs = Sges::default();
        let meta = crate::ledger::ring::SlotMeta {
            opcode: ffi::IBV_WR_SEND,
            signaled: true,
            drain: true,
        };
        // SAFETY: producer side (&mut self); a slot is free (checked above);
        // `bufs` is empty and forgotten below.
        let token = unsafe { ring.fill(*head, 0, meta, &bufs) };
        std::mem::forget(bufs);
        *head += 1;
        let mut wr = ffi::ibv_send_wr {
            wr_id: token,
            opcode: ffi::IBV_WR_SEND,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a one-request chain; no SGEs, so the NIC touches no memory.
        let rc = unsafe {
            send_ex::post_chain::<false>(
                self.raw.as_ptr(),
                self.send_ex.as_ref(),
                &mut wr,
                &mut bad,
            )
        };
        if rc != 0 {
            // SAFETY: producer side; the device refused the marker.
            drop(unsafe { ring.unfill_from(*head - 1, head) });
        }
    }

    fn modify(
        &self,
        (mut attr, mask): (ffi::ibv_qp_attr, u32),
        from: &'static str,
        to: &'static str,
    ) -> Result<()> {
        // SAFETY: valid QP; attr is a fully initialised ibv_qp_attr.
        let rc = unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), &mut attr, mask as i32) };
        if rc == 0 {
            return Ok(());
        }
        let hint = match (rc.abs(), to) {
            (libc::EINVAL, "INIT") => Some("check the port number and pkey index".to_owned()),
            (libc::EINVAL, "RTS") if mask == attr::sq_psn_only(0).1 => {
                Some("check the SQ PSN (24 bits)".to_owned())
            }
            (libc::EINVAL | libc::ENODATA, "RTR") => Some(
                "check the remote QPN, the GID index (sgid_index must exist on this port; RoCE needs a GRH), \
                 the path MTU (at most the port's active_mtu) and max_dest_rd_atomic"
                    .to_owned(),
            ),
            (libc::ETIMEDOUT, "RTR") => Some(
                "the destination GID's IP address did not answer neighbour discovery (ARP/ND): is the \
                 peer up, and is its GID (from its endpoint) right?"
                    .to_owned(),
            ),
            (libc::EINVAL, "RTS") => Some("check timeout, retry_cnt (<= 7), rnr_retry (<= 7) and max_rd_atomic".to_owned()),
            _ => None,
        };
        Err(Error::Transition {
            from,
            to,
            mask,
            mask_names: attr::mask_names(mask),
            source: errno(rc),
            hint,
        })
    }
}

/// A refused transition: the error and the QP, still in its old state.
pub struct TransitionError<Q> {
    /// The QP, unchanged.
    pub qp: Q,
    /// Why it was refused.
    pub error: Error,
}

impl<Q> fmt::Debug for TransitionError<Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<Q> fmt::Display for TransitionError<Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<Q> std::error::Error for TransitionError<Q> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<Q> From<TransitionError<Q>> for Error {
    fn from(e: TransitionError<Q>) -> Error {
        e.error
    }
}

impl Qp<Rc, Reset> {
    /// Creates an RC QP in `pd` whose sends complete on `send_cq` and receives
    /// on `recv_cq` (they may be the same CQ).
    ///
    /// Make each CQ deep enough for the signaled work requests of every QP on it.
    ///
    /// The QP posts its sends with the extended work request API where the
    /// provider supports it, with `ibv_post_send` otherwise; see
    /// [`send_api`](Qp::send_api) and [`send_ex`].
    pub fn new(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp<Rc, Reset>> {
        Qp::create_with(pd, send_cq, recv_cq, caps, None, None, |_| {})
    }

    /// [`new`](Qp::new) with the send API chosen by the caller: `Legacy`
    /// always works; `Extended` fails with [`Error::Verb`] for
    /// `ibv_create_qp_ex` (`EOPNOTSUPP`, or the provider's errno) where the
    /// provider cannot create an extended RC QP, instead of falling back.
    pub fn new_with_send_api(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        api: SendApi,
    ) -> Result<Qp<Rc, Reset>> {
        Qp::create_with(pd, send_cq, recv_cq, caps, None, Some(api), |_| {})
    }

    /// Creates an RC QP whose receives come from the shared receive queue
    /// `srq` (see [`crate::srq`]): its own receive queue is not used
    /// (`caps.max_recv_wr` and `max_recv_sge` are ignored, and
    /// [`post_recv`](Qp::post_recv) is refused with [`Error::QpUsesSrq`]),
    /// and it reserves no receive entries on `recv_cq`, which must be the CQ
    /// the SRQ was created with ([`Error::SrqCqMismatch`] otherwise), and
    /// `pd` must be the SRQ's ([`Error::InvalidArgument`] otherwise:
    /// providers differ in which of the two PDs a receive's buffer is checked
    /// against). The QP keeps the SRQ alive.
    pub fn new_with_srq(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Reset>> {
        let srq = srq.inner();
        if !Arc::ptr_eq(&srq.cq, &recv_cq.inner) {
            return Err(Error::SrqCqMismatch);
        }
        srq.check_qp_pd(pd)?;
        let caps = QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..caps
        };
        let raw_srq = srq.raw.as_ptr();
        Qp::create_with(
            pd,
            send_cq,
            recv_cq,
            caps,
            Some(srq.clone()),
            None,
            |init| {
                init.srq = raw_srq;
            },
        )
    }
}

impl<T: QpType> Qp<T, Reset> {
    fn create(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp<T, Reset>> {
        Qp::create_with(
            pd,
            send_cq,
            recv_cq,
            caps,
            None,
            Some(SendApi::Legacy),
            |_| {},
        )
    }

    /// [`create`](Qp::create), on `srq` if given, with `adjust` applied to the
    /// init attributes last. `api`: the send API (RC only; `None`: extended
    /// where the provider has it, legacy otherwise).
    fn create_with(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        srq: Option<Arc<SrqInner>>,
        api: Option<SendApi>,
        adjust: impl FnOnce(&mut ffi::ibv_qp_init_attr),
    ) -> Result<Qp<T, Reset>> {
        // The kernel resolves CQ handles in the PD's context: a CQ of another
        // context would silently name some other CQ there.
        let ctx = pd.context().as_raw();
        // SAFETY: both CQs are live; `context` is a plain field set at creation.
        let same =
            unsafe { (*send_cq.as_raw()).context == ctx && (*recv_cq.as_raw()).context == ctx };
        if !same {
            return Err(Error::InvalidArgument {
                what: "completion queue",
                reason: "the PD and both CQs must come from the same Context (device open)".into(),
            });
        }
        let try_extended = T::RAW == ffi::IBV_QPT_RC && api != Some(SendApi::Legacy);
        let mut extended = false;
        // SAFETY: ibv_create_qp and create_rc create a QP of type T from
        // exactly `init` (create_rc only when T is RC) and write the granted
        // caps back.
        let mut qp = unsafe {
            Qp::build(
                pd,
                send_cq,
                recv_cq,
                caps,
                random_psn(),
                1,
                None,
                srq,
                |init| {
                    adjust(init);
                    if try_extended {
                        // SAFETY: valid PD, CQs and SRQ of one context (checked
                        // above; kept alive by the Arcs the Qp stores).
                        match send_ex::create_rc(pd.as_raw(), init) {
                            Ok(raw) => {
                                extended = true;
                                return Ok(raw);
                            }
                            Err(e) if api == Some(SendApi::Extended) => {
                                return Err(Error::verb("ibv_create_qp_ex", e));
                            }
                            Err(_) => {}
                        }
                    }
                    // SAFETY: valid PD, CQs and SRQ (kept alive by the Arcs the Qp
                    // stores); init is fully initialised; the provider writes the
                    // granted caps back.
                    let raw = ffi::ibv_create_qp(pd.as_raw(), init);
                    NonNull::new(raw).ok_or_else(|| Error::verb("ibv_create_qp", last_errno()))
                },
            )?
        };
        if extended {
            // SAFETY: created by create_rc with RC_SEND_OPS; the SendEx lives
            // in the QP's core, which destroys the QP only when dropped.
            qp.core.send_ex = unsafe { send_ex::SendEx::load(qp.core.raw) };
            if qp.core.send_ex.is_none() && api == Some(SendApi::Extended) {
                return Err(Error::verb("ibv_qp_to_qp_ex", errno(libc::EOPNOTSUPP)));
            }
        }
        Ok(qp)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// Creates a QP with `create`, after reserving room on its CQs for every
    /// completion its queues may produce, and registers its slot rings there.
    ///
    /// # Safety
    /// `create` creates a QP of type `T` in `pd` from the `ibv_qp_init_attr`
    /// it is given (whose CQs it must not change), leaving it in state `S`
    /// with nothing posted, writes the granted caps back into it, and hands
    /// over ownership: the returned `Qp` destroys it with `ibv_destroy_qp` and
    /// then drops `keepalive`. `psn` and `port` are what the QP is set up with.
    /// With `srq`, `create` must create the QP on that SRQ (`init.srq`): its
    /// receive ring then has depth 0 and reserves nothing on `recv_cq` (the
    /// SRQ reserved its depth there), and the QP keeps the SRQ alive.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn build(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        psn: u32,
        port: u8,
        keepalive: Option<Box<dyn Any + Send + Sync>>,
        srq: Option<Arc<SrqInner>>,
        create: impl FnOnce(&mut ffi::ibv_qp_init_attr) -> Result<NonNull<ffi::ibv_qp>>,
    ) -> Result<Qp<T, S>> {
        let sq_want = caps.max_send_wr.max(1);
        let rq_want = if srq.is_some() {
            0
        } else {
            caps.max_recv_wr.max(1)
        };
        let ctx = pd.context();
        let sq_res = (send_cq.inner.rings.reserve(sq_want.into(), "send"))
            .map_err(|e| ctx.over_limit(e, "max_send_wr", sq_want, "max_qp_wr", |a| a.max_qp_wr))?;
        let rq_res = (recv_cq.inner.rings.reserve(rq_want.into(), "receive"))
            .map_err(|e| ctx.over_limit(e, "max_recv_wr", rq_want, "max_qp_wr", |a| a.max_qp_wr))?;
        let mut init = caps.init_attr(send_cq.as_raw(), recv_cq.as_raw(), T::RAW);
        let raw = create(&mut init)?;
        let got = caps.granted(&init);
        // SAFETY: `raw` is live (per the contract); qp_num is a plain field.
        let qp_num = unsafe { (*raw.as_ptr()).qp_num };
        // Never more in flight than asked for, even if the device rounded up.
        let sq = sq_res.publish(|tag| Ring::new(sq_want.min(got.max_send_wr), tag, qp_num));
        let rq = rq_res.publish(|tag| Ring::new(rq_want.min(got.max_recv_wr), tag, qp_num));
        Ok(Qp {
            core: QpCore {
                raw,
                sq,
                rq,
                sq_head: 0,
                rq_head: 0,
                caps: QpCaps {
                    max_send_wr: caps.max_send_wr.min(got.max_send_wr),
                    max_recv_wr: caps.max_recv_wr.min(got.max_recv_wr),
                    ..got
                },
                psn,
                port,
                send_cq: send_cq.inner.clone(),
                recv_cq: recv_cq.inner.clone(),
                pd: pd.clone(),
                ud: None,
                srq,
                _keepalive: keepalive,
                scoped: None,
                send_ex: None,
                #[cfg(feature = "tokio")]
                async_next_id: 1,
                raw_posted: false,
            },
            _marker: PhantomData,
        })
    }
}

fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most 4 bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    let v = if n == 4 {
        u32::from_ne_bytes(b)
    } else {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(1)
    };
    v & 0x00ff_ffff
}

impl<T: QpType, S: QpState> Qp<T, S> {
    fn into_state<S2: QpState>(self) -> Qp<T, S2> {
        Qp {
            core: self.core,
            _marker: PhantomData,
        }
    }

    /// Re-types the QP as being in state `S2` without calling any verb; the
    /// rings (and the receives already posted) stay as they are.
    ///
    /// For QPs that something else moved, e.g. librdmacm's `rdma_connect` /
    /// `rdma_accept`, which take a CM-managed QP from INIT to RTR and RTS
    /// themselves (see [`crate::cm`]).
    ///
    /// # Safety
    /// The QP must really be in `S2` now (as set by whoever moved it), so that
    /// the state-gated methods of `Qp<T, S2>` match what the kernel allows.
    pub(crate) unsafe fn assume_state<S2: QpState>(self) -> Qp<T, S2> {
        self.into_state()
    }

    fn transition<S2: QpState>(
        self,
        attr: (ffi::ibv_qp_attr, u32),
    ) -> Result<Qp<T, S2>, TransitionError<Qp<T, S>>> {
        match self.core.modify(attr, S::NAME, S2::NAME) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }

    /// How this QP posts its send requests: [`SendApi::Extended`] when it
    /// was created as an extended QP (`ibv_create_qp_ex` with the RC send
    /// operations; [`Qp::new`] does so where the provider supports it),
    /// [`SendApi::Legacy`] (`ibv_post_send`) otherwise. The safe API is the
    /// same over both.
    pub fn send_api(&self) -> SendApi {
        if self.core.send_ex.is_some() {
            SendApi::Extended
        } else {
            SendApi::Legacy
        }
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: raw is valid while self lives; qp_num is a plain field.
        unsafe { (*self.core.raw.as_ptr()).qp_num }
    }

    /// The capabilities the device granted (it may round requests up).
    pub fn caps(&self) -> QpCaps {
        self.core.caps
    }

    /// The PSN this side starts sending with (random, 24 bits; goes in the [`Endpoint`]).
    pub fn psn(&self) -> u32 {
        self.core.psn
    }

    /// The PD the QP belongs to.
    pub fn pd(&self) -> &Pd {
        &self.core.pd
    }

    /// The raw `ibv_qp`, valid while this `Qp` lives. Changing its state behind
    /// the type's back voids the state guarantee (not memory safety). Post
    /// raw requests with [`post_send_raw`](Qp::post_send_raw) and
    /// [`post_recv_raw`](Qp::post_recv_raw), not `ibv_post_*` on this
    /// pointer: they keep the `wr_id`s out of the crate's tokens and mark the
    /// QP, so that its CQ entries stay reserved after a drop until the CQ is
    /// polled empty (the rings do not count raw requests).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.core.raw.as_ptr()
    }

    /// This side's endpoint for the peer: the LID of the QP's port (the one
    /// given to [`init`](Qp::init); 1 before that), its QPN and PSN, and the
    /// GID at `gid_index`. With `None`, [`Context::default_gid_index`](crate::Context::default_gid_index)
    /// chooses: the RoCE v2 IPv4-mapped GID on RoCE, no GID (zero) on
    /// InfiniBand, like `ibv_rc_pingpong` without `-g`.
    pub fn endpoint(&self, gid_index: Option<u8>) -> Result<Endpoint> {
        let ctx = self.core.pd.context();
        let port = self.core.port;
        let lid = ctx.query_port(port)?.lid;
        let index = match gid_index {
            Some(i) => Some(i),
            None => ctx.default_gid_index(port)?,
        };
        let gid = match index {
            Some(i) => ctx.query_gid(port, i)?,
            None => crate::Gid::ZERO,
        };
        Ok(Endpoint {
            lid,
            qpn: self.qp_num(),
            psn: self.core.psn,
            gid,
        })
    }

    /// Every attribute of the QP (`ibv_query_qp`), including its real state.
    pub fn query(&self) -> Result<QpAttr> {
        let mut attr = MaybeUninit::<ffi::ibv_qp_attr>::zeroed();
        let mut init = MaybeUninit::<ffi::ibv_qp_init_attr>::zeroed();
        let mask = 0x01ff_ffff; // every IBV_QP_* attribute bit
        // SAFETY: valid QP and out-structs.
        let rc =
            unsafe { ffi::ibv_query_qp(self.as_raw(), attr.as_mut_ptr(), mask, init.as_mut_ptr()) };
        if rc != 0 {
            return Err(Error::verb("ibv_query_qp", errno(rc)));
        }
        // SAFETY: zeroed and filled by the call; plain C structs (pointers may be null).
        Ok(unsafe { QpAttr::from_ffi(&attr.assume_init(), &init.assume_init()) })
    }

    /// Moves the QP to ERR: every outstanding work request completes with
    /// WR_FLUSH_ERR and its buffers come back through the CQ. Not from RESET
    /// (the kernel refuses RESET → ERR; the QP comes back unchanged).
    ///
    /// An unsignaled send that already completed successfully has no
    /// completion to flush, and a completion consumed by
    /// [`Cq::poll_raw`](crate::Cq::poll_raw) never reaches the safe path. So
    /// when sends are outstanding, a signaled zero-length request is posted
    /// after the move to ERR (it is flushed at once and never reaches the
    /// wire, like the kernel's `ib_drain_sq`); its completion retires the sends
    /// before it and is not handed out by [`Cq::poll`](crate::Cq::poll). Once
    /// the flushes are polled, [`outstanding`](Qp::outstanding) is `(0, 0)`
    /// and [`reset`](Qp::reset) succeeds. Not when `poll_raw` consumed
    /// completions of this QP: receives whose completions it took stay
    /// outstanding, and so do sends when every slot of the send queue is in
    /// use (no slot is left for the marker); destroy such a QP.
    ///
    /// The flush covers what was posted before the move: on rxe a receive
    /// posted to a QP already in ERR (a drained scope leaves its QPs there
    /// while they are still typed `Rts`) is not flushed until the next
    /// `to_error`; call it again before polling for that receive.
    pub fn to_error(self) -> Result<Qp<T, state::Error>, TransitionError<Qp<T, S>>> {
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_ERR,
            ..Default::default()
        };
        let mut qp = self.transition((attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0))?;
        qp.core.post_drain_marker();
        Ok(qp)
    }

    /// Whether the send (`send == true`) or receive queue has a free slot.
    #[cfg(feature = "tokio")]
    pub(crate) fn has_room(&self, send: bool) -> bool {
        let (ring, head) = if send {
            (&self.core.sq, self.core.sq_head)
        } else {
            (&self.core.rq, self.core.rq_head)
        };
        // A queue of depth 0 (receives of a QP on an SRQ): let the post
        // itself refuse, with its error.
        ring.depth() == 0 || ring.in_flight(head) < ring.depth()
    }

    /// The `ibv_cq`s of the send and receive queue.
    #[cfg(any(feature = "tokio", feature = "gdr"))]
    pub(crate) fn cq_raws(&self) -> (*mut ffi::ibv_cq, *mut ffi::ibv_cq) {
        (self.core.send_cq.as_raw(), self.core.recv_cq.as_raw())
    }

    /// The next `wr_id` of the `AsyncQp` numbering (see `QpCore`).
    #[cfg(feature = "tokio")]
    pub(crate) fn async_next_id(&self) -> u64 {
        self.core.async_next_id
    }

    /// Keeps where an `AsyncQp` left its numbering, for the next wrapper.
    #[cfg(feature = "tokio")]
    pub(crate) fn set_async_next_id(&mut self, id: u64) {
        self.core.async_next_id = id;
    }

    /// Work requests posted and not yet retired by a polled completion, as
    /// `(send, receive)`. [`reset`](Qp::reset) needs both to be 0.
    pub fn outstanding(&self) -> (u64, u64) {
        (
            self.core.sq.in_flight(self.core.sq_head),
            self.core.rq.in_flight(self.core.rq_head),
        )
    }

    /// Moves the QP to RESET, ready to be connected again.
    ///
    /// Refused with [`Error::WorkOutstanding`] (the QP comes back unchanged)
    /// while any work request is outstanding: whether RESET discards posted
    /// work is up to the provider (some rxe versions keep posted receives),
    /// so the buffers could not be handed back safely. Move the QP to ERR
    /// with [`to_error`](Qp::to_error) first and poll the flushed completions.
    /// On a QP attached to an SRQ that applies also to a receive it took from
    /// the SRQ mid-message, which this check cannot count (see the module
    /// docs, "Shared receive queues").
    pub fn reset(self) -> Result<Qp<T, Reset>, TransitionError<Qp<T, S>>> {
        let (send, receive) = self.outstanding();
        let outstanding = [("send", send), ("receive", receive)];
        if let Some(&(queue, count)) = outstanding.iter().find(|(_, n)| *n > 0) {
            return Err(TransitionError {
                qp: self,
                error: Error::WorkOutstanding { queue, count },
            });
        }
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RESET,
            ..Default::default()
        };
        self.transition((attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0))
    }
}

impl Qp<Rc, Reset> {
    /// RESET → INIT.
    pub fn init(self, attr: InitAttr) -> Result<Qp<Rc, Init>, TransitionError<Qp<Rc, Reset>>> {
        self.init_on(attr.port, attr.to_ffi())
    }
}

impl<T: QpType> Qp<T, Reset> {
    /// RESET → INIT on `port` (remembered for [`endpoint`](Qp::endpoint)).
    fn init_on(
        mut self,
        port: u8,
        attr: (ffi::ibv_qp_attr, u32),
    ) -> Result<Qp<T, Init>, TransitionError<Qp<T, Reset>>> {
        // The port and P_Key index, checked here: the kernel says EINVAL for
        // a missing port, and soft-RoCE takes an index past its table.
        let pkey_index = attr.0.pkey_index;
        let checked = self.core.pd.context().query_port(port).and_then(|p| {
            match p.pkey_tbl_len > 0 && pkey_index >= p.pkey_tbl_len {
                true => Err(Error::InvalidArgument {
                    what: "pkey index",
                    reason: format!(
                        "{pkey_index} is past the {} entries of port {port}'s P_Key table",
                        p.pkey_tbl_len
                    ),
                }),
                false => Ok(()),
            }
        });
        if let Err(error) = checked {
            return Err(TransitionError { qp: self, error });
        }
        let old = self.core.port;
        self.core.port = port;
        self.transition(attr).map_err(|mut e| {
            e.qp.core.port = old;
            e
        })
    }
}

impl Qp<Rc, Init> {
    /// INIT → RTR. Values wider than their wire fields (dest QPN and RQ PSN
    /// 24 bits, min_rnr_timer 5) are refused before the kernel sees them.
    ///
    /// On RoCE (an Ethernet port) the address vector needs a GRH with the
    /// peer's GID; one without is refused here with an error that says so
    /// (the kernel would only say EINVAL).
    pub fn rtr(self, attr: RtrAttr) -> Result<Qp<Rc, Rtr>, TransitionError<Qp<Rc, Init>>> {
        let error = check_bits("min_rnr_timer", attr.min_rnr_timer.into(), 5)
            .or_else(|| self.check_rtr(&attr));
        if let Some(error) = error {
            return Err(TransitionError { qp: self, error });
        }
        self.transition(attr.to_ffi())
    }

    /// INIT → RTR → RTS towards `remote` with the defaults of `ibv_rc_pingpong`:
    /// path MTU = the port's active MTU, a GRH from `gid_index` (with `None`,
    /// [`Context::default_gid_index`](crate::Context::default_gid_index)
    /// chooses: the RoCE v2 GID on RoCE, no GRH on InfiniBand).
    /// A failure destroys the QP (its buffers are released) and returns the error.
    ///
    /// Like `ibv_rc_pingpong`, this allows one outstanding RDMA READ or
    /// atomic each way (`max_rd_atomic` and `max_dest_rd_atomic` 1, as
    /// [`RtrAttr::new`] and [`RtsAttr::new`]); more in flight wait on the
    /// NIC. For deeper READ/atomic pipelines, go through
    /// [`rtr`](Qp::rtr) and [`rts`](Qp::rts) with those fields raised (up to
    /// the device's `max_qp_rd_atom`).
    pub fn connect(self, remote: &Endpoint, gid_index: Option<u8>) -> Result<Qp<Rc, Rts>> {
        let port = self.core.port;
        let (mtu, gid_index) = self.connect_defaults(gid_index)?;
        let sq_psn = self.core.psn;
        let qp = self.rtr(RtrAttr::new(remote, port, mtu, gid_index))?;
        Ok(qp.rts(RtsAttr::new(sq_psn))?)
    }
}

impl<T: QpType> Qp<T, Init> {
    /// The checks of INIT → RTR common to RC and UC: wire field widths and
    /// the GRH RoCE needs.
    fn check_rtr(&self, attr: &RtrAttr) -> Option<Error> {
        check_bits("dest QPN", attr.dest_qpn, 24)
            .or_else(|| check_bits("RQ PSN", attr.rq_psn, 24))
            .or_else(|| attr.av.check_widths())
            .or_else(|| self.check_roce_grh(&attr.av))
    }

    /// The path MTU and GID index `connect` uses: the port's active MTU, and
    /// `gid_index` or the port's default.
    fn connect_defaults(&self, gid_index: Option<u8>) -> Result<(crate::Mtu, Option<u8>)> {
        let port = self.core.port;
        let ctx = self.core.pd.context();
        let mtu = ctx.query_port(port)?.active_mtu;
        let gid_index = match gid_index {
            Some(i) => Some(i),
            None => ctx.default_gid_index(port)?,
        };
        Ok((mtu, gid_index))
    }

    /// On an Ethernet (RoCE) port: a GRH, towards a non-zero GID.
    fn check_roce_grh(&self, av: &AddressVector) -> Option<Error> {
        let port = self.core.pd.context().query_port(av.port).ok()?;
        if port.link_layer != crate::LinkLayer::Ethernet {
            return None;
        }
        let reason = match &av.grh {
            None => {
                "RoCE (an Ethernet port) needs a GRH: give a GID index (RtrAttr::new's \
                     sgid_index; Context::default_gid_index picks the RoCE v2 one)"
            }
            Some(g) if g.dgid.is_zero() => {
                "the peer's endpoint carries no GID (all zero), which RoCE needs: the peer must \
                 send its GID (Qp::endpoint picks one by default)"
            }
            Some(_) => return None,
        };
        Some(Error::InvalidArgument {
            what: "address vector",
            reason: reason.into(),
        })
    }
}

impl Qp<Rc, Rtr> {
    /// RTR → RTS. Values wider than their wire fields (SQ PSN 24 bits, timeout
    /// 5, retry_cnt and rnr_retry 3) are refused before the kernel sees them.
    pub fn rts(self, attr: RtsAttr) -> Result<Qp<Rc, Rts>, TransitionError<Qp<Rc, Rtr>>> {
        let error = check_bits("SQ PSN", attr.sq_psn, 24)
            .or_else(|| check_bits("timeout", attr.timeout.into(), 5))
            .or_else(|| check_bits("retry_cnt", attr.retry_cnt.into(), 3))
            .or_else(|| check_bits("rnr_retry", attr.rnr_retry.into(), 3));
        if let Some(error) = error {
            return Err(TransitionError { qp: self, error });
        }
        self.transition(attr.to_ffi())
    }
}

/// Bit 63 of a `wr_id`: set in every token of the safe path, so raw posts
/// (`post_send_raw`, `post_recv_raw`) must leave it clear.
pub const RAW_WR_ID_RESERVED: u64 = 1 << 63;

/// Refuses a raw chain with a `wr_id` that has [`RAW_WR_ID_RESERVED`] set.
///
/// # Safety
/// `head` heads a well-formed chain; `parts` reads `(wr_id, next)` of one entry.
unsafe fn check_raw_wr_ids<W>(
    head: *const W,
    parts: impl Fn(*const W) -> (u64, *mut W),
) -> Result<()> {
    // One OR over the chain, and the walk again only to name the culprit:
    // this runs on every raw receive post and raw send on a legacy QP, so it
    // costs a load and an OR per request (an extended QP's replay checks raw
    // sends while posting: see send_ex::post_chain).
    let mut any = 0;
    let mut w = head;
    while !w.is_null() {
        let (wr_id, next) = parts(w);
        any |= wr_id;
        w = next;
    }
    if any & RAW_WR_ID_RESERVED == 0 {
        return Ok(());
    }
    // Some request has the bit, so this stops before the chain's end.
    let mut w = head;
    loop {
        let (wr_id, next) = parts(w);
        if wr_id & RAW_WR_ID_RESERVED != 0 {
            return Err(reserved_wr_id(wr_id));
        }
        w = next;
    }
}

#[cold]
fn reserved_wr_id(wr_id: u64) -> Error {
    Error::InvalidArgument {
        what: "wr_id",
        reason: format!(
            "{wr_id:#x} has bit 63 set, which marks the safe path's own wr_ids; raw posts must leave it clear"
        ),
    }
}

/// Refuses a value that does not fit its `bits`-wide field (some providers
/// silently truncate instead of failing).
fn check_bits(what: &'static str, v: u32, bits: u32) -> Option<Error> {
    (v >> bits != 0).then(|| Error::InvalidArgument {
        what,
        reason: format!("{v:#x} does not fit in {bits} bits"),
    })
}

// The state bounds sit on the methods (not the impl) so that calling one in
// the wrong state reports the trait's diagnostic ("connect the QP first").
impl<T: Connected, S: QpState> Qp<T, S> {
    /// Posts one receive; its buffers return with the completion.
    #[inline]
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_one::<RecvQueue>(&mut self.core, wr)
    }

    /// Posts receives as chained lists (one `ibv_post_recv` per 32 requests).
    /// On failure, the requests taken from `wrs` that did not reach the NIC
    /// come back in the error with their buffers; `wrs` is not pulled any
    /// further (pass `iter.by_ref()` to keep the rest). If `wrs` panics, the
    /// requests it yielded since the last verb call are taken back (their
    /// buffers drop with the unwind); earlier chunks were posted.
    pub fn post_recv_list(&mut self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_list::<RecvQueue>(&mut self.core, wrs)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// Posts a C receive work request list as is (`ibv_post_recv`).
    ///
    /// # Safety
    /// Every SGE must point into memory registered in this QP's PD with
    /// LOCAL_WRITE, that stays valid, and that nothing reads or writes, until
    /// the request's completion is polled (or the QP is destroyed). Safe-path
    /// requests in flight plus raw ones must not exceed the QP's
    /// `max_recv_wr`, or the CQ may overrun. The completion comes back from
    /// [`Cq::poll`](crate::Cq::poll) as
    /// [`CompletionSource::Foreign`](crate::CompletionSource::Foreign) with
    /// your `wr_id` (or from [`Cq::poll_raw`](crate::Cq::poll_raw)). `wr`
    /// heads a well-formed chain (`next` null-terminated).
    ///
    /// # Errors
    /// A `wr_id` with bit 63 set is refused ([`RAW_WR_ID_RESERVED`]): those
    /// are the safe path's tokens, and a raw completion that looked like one
    /// would retire a safe request still in flight.
    pub unsafe fn post_recv_raw(&mut self, wr: &mut ffi::ibv_recv_wr) -> Result<()>
    where
        S: CanPostRecv,
    {
        // SAFETY: the caller promises a well-formed chain.
        unsafe { check_raw_wr_ids(wr, |w| ((*w).wr_id, (*w).next))? };
        self.core.raw_posted = true;
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; the caller upholds the buffer contract.
        let rc = unsafe { ffi::ibv_post_recv(self.as_raw(), wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::verb("ibv_post_recv", errno(rc)))
        }
    }
}

impl<S: QpState> Qp<Rc, S> {
    /// Posts one send-queue work request; its buffers return with the completion.
    #[inline]
    pub fn post_send(&mut self, wr: SendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_one::<SendQueue>(&mut self.core, wr)
    }

    /// Posts send-queue work requests as chained lists (one `ibv_post_send`, one
    /// doorbell, per 32 requests). On failure (e.g. [`Error::QueueFull`]), the
    /// requests taken from `wrs` that did not reach the NIC come back in the
    /// error with their buffers; `wrs` is not pulled any further (pass
    /// `iter.by_ref()` to keep the rest). If `wrs` panics, the requests it
    /// yielded since the last verb call are taken back (their buffers drop
    /// with the unwind); earlier chunks of 32 were posted and complete as usual.
    pub fn post_send_list<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_list::<SendQueue<'a>>(&mut self.core, wrs)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// Posts a C send work request list as is (`ibv_post_send`).
    ///
    /// # Safety
    /// Every SGE must point into memory registered in this QP's PD that stays
    /// valid until the request's completion is polled (or a later signaled
    /// request's, for unsignaled ones), or the QP is destroyed; memory the NIC
    /// writes (READ/atomic destinations) must not be read or written by anyone
    /// else meanwhile, and memory it reads must not be written. Remote addresses
    /// are not checked. Safe-path requests in flight plus raw ones must not
    /// exceed the QP's `max_send_wr`, or the CQ may overrun. The completion
    /// comes back from [`Cq::poll`](crate::Cq::poll) as
    /// [`CompletionSource::Foreign`](crate::CompletionSource::Foreign) with
    /// your `wr_id` (or from [`Cq::poll_raw`](crate::Cq::poll_raw)). `wr`
    /// heads a well-formed chain (`next` null-terminated). Leave one slot of
    /// `max_send_wr` for the drain marker [`to_error`](Qp::to_error) may post.
    ///
    /// # Errors
    /// A `wr_id` with bit 63 set is refused ([`RAW_WR_ID_RESERVED`]), as for
    /// [`post_recv_raw`](Qp::post_recv_raw).
    #[inline(always)]
    pub unsafe fn post_send_raw(&mut self, wr: &mut ffi::ibv_send_wr) -> Result<()>
    where
        S: CanPostSend,
    {
        self.core.raw_posted = true;
        let mut bad = std::ptr::null_mut();
        let core = &self.core;
        // SAFETY: valid QP, send_ex its extended interface; the caller
        // upholds the buffer contract and promises a well-formed chain.
        // Reserved wr_ids are refused before anything is posted.
        let rc = unsafe {
            send_ex::post_chain::<true>(core.raw.as_ptr(), core.send_ex.as_ref(), wr, &mut bad)
        };
        match rc {
            0 => Ok(()),
            send_ex::RESERVED_WR_ID => Err(
                // SAFETY: as above; this walk only names the culprit.
                unsafe { check_raw_wr_ids(wr, |w| ((*w).wr_id, (*w).next)) }
                    .err()
                    .unwrap_or_else(|| reserved_wr_id(RAW_WR_ID_RESERVED)),
            ),
            rc => Err(Error::verb("ibv_post_send", errno(rc))),
        }
    }
}

impl<T: QpType, S: QpState> fmt::Debug for Qp<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &self.qp_num())
            .field("state", &S::NAME)
            .field("caps", &self.core.caps)
            .finish()
    }
}
