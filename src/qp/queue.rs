//! Posting on the safe path, written once for both queues: staging a request
//! (checks, its C form, its buffers into the slot ring), submitting a chunk
//! with one `ibv_post_*` call, and handing back what never reached the NIC.
//! On a QP with extended builders, send requests they can express skip the
//! C form (`qp/built.rs`).
//!
//! Requests are staged through a reference and then forgotten: passing the
//! 144-byte `SendWr` on by value would copy it at every step.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use crate::error::Error;
use crate::ffi;
use crate::ledger::read_copy;
use crate::ledger::ring::{Ring, SlotMeta};
use crate::ledger::sges::{MAX_SAFE_SGES, Sges};
use crate::ledger::wr::{ExtOps, RecvWr, SendWr};
use crate::pd::Pd;
use crate::qp::built;
use crate::qp::post::{self, ChainedWr};
use crate::qp::send_ex::{self, SendEx};
use crate::qp::{PostError, QpCaps, QpCore};

/// How many work requests one chained `ibv_post_*` call carries at most.
pub(crate) const POST_CHUNK: usize = 32;

/// What posting reads of a QP besides its queue's ring: the whole core, or
/// one half's share of it (`qp/split.rs`). Only the QP's fixed attributes.
pub(crate) trait QueueCore {
    /// The verbs QP.
    fn raw(&self) -> *mut ffi::ibv_qp;
    /// The capabilities the device granted.
    fn caps(&self) -> &QpCaps;
    /// The QP's PD.
    fn pd(&self) -> &Pd;
    /// Whether the QP takes its receives from a shared receive queue.
    fn uses_srq(&self) -> bool;
}

/// A [`QueueCore`] that posts sends: the send ring, its head and the
/// extended send interface.
pub(crate) trait SendCore: QueueCore {
    /// The send ring and its head.
    fn sq(&mut self) -> (&Ring, &mut u64);
    /// The extended send interface, when the QP has one.
    fn send_ex(&self) -> Option<&SendEx>;
}

/// A [`QueueCore`] that posts receives: the receive ring and its head.
pub(crate) trait RecvCore: QueueCore {
    /// The receive ring and its head.
    fn rq(&mut self) -> (&Ring, &mut u64);
}

impl QueueCore for QpCore {
    #[inline(always)]
    fn raw(&self) -> *mut ffi::ibv_qp {
        self.raw.as_ptr()
    }

    #[inline(always)]
    fn caps(&self) -> &QpCaps {
        &self.caps
    }

    #[inline(always)]
    fn pd(&self) -> &Pd {
        &self.pd
    }

    #[inline(always)]
    fn uses_srq(&self) -> bool {
        self.ext.srq.is_some()
    }
}

impl SendCore for QpCore {
    #[inline(always)]
    fn sq(&mut self) -> (&Ring, &mut u64) {
        (&self.sq, &mut self.sq_head)
    }

    #[inline(always)]
    fn send_ex(&self) -> Option<&SendEx> {
        self.ext.send_ex.as_ref()
    }
}

impl RecvCore for QpCore {
    #[inline(always)]
    fn rq(&mut self) -> (&Ring, &mut u64) {
        (&self.rq, &mut self.rq_head)
    }
}

/// What differs between the send and the receive queue, for posting on a
/// core `C` (the whole QP's by default).
pub(crate) trait WorkQueue<C: QueueCore = QpCore> {
    /// The safe work request.
    type Wr;
    /// Its C form.
    type CWr: ChainedWr;

    /// The queue's slot ring and head (its producer's sequence number).
    fn ring_and_head(core: &mut C) -> (&Ring, &mut u64);

    /// Everything that can be checked before the NIC sees `wr`.
    fn validate(core: &C, wr: &Self::Wr) -> Result<(), Error>;

    /// The C form of `wr` in `c` (all but `wr_id`, `next` and `sg_list`) and
    /// its SGEs in `sges`; `last_slot`: it takes the ring's last free slot.
    /// Returns the entry and what the poller needs to know of the request.
    fn write_c(
        core: &C,
        wr: &Self::Wr,
        c: &mut MaybeUninit<Self::CWr>,
        sges: &mut [MaybeUninit<ffi::ibv_sge>],
        last_slot: bool,
    ) -> (*mut Self::CWr, SlotMeta);

    /// The application's wr_id and the buffers of `wr`.
    fn id_and_bufs(wr: &Self::Wr) -> (u64, *const Sges);

    /// Takes `wr` apart (to hand back a request that was not posted).
    fn into_parts(wr: Self::Wr) -> (u64, Sges);

    /// `ibv_post_send` (or its extended form) / `ibv_post_recv`.
    ///
    /// # Safety
    /// As the verb's: a well-formed chain.
    unsafe fn post(core: &C, head: *mut Self::CWr, bad: *mut *mut Self::CWr) -> i32;

    /// The QP's extended builders, when its requests can skip the C form
    /// ([`request`](WorkQueue::request)). `None` by default.
    #[inline(always)]
    fn builders(_core: &C) -> Option<SendEx> {
        None
    }

    /// `wr` in the builders' form (its `wr_id` left for the ring's token),
    /// or `None` when it needs what they lack. `None` by default.
    #[inline(always)]
    fn request(_wr: &Self::Wr) -> Option<send_ex::Request> {
        None
    }

    /// Called once `wr` holds sequence number `seq` in the ring, for what
    /// must live with the request besides its buffers (a UD send's address
    /// handle). Nothing by default.
    ///
    /// # Safety
    /// `wr` is forgotten by the caller afterwards (so what this moves out of
    /// it is not dropped twice).
    #[inline(always)]
    unsafe fn staged(_core: &mut C, _seq: u64, _wr: &Self::Wr) {}
}

/// The send queue of a QP.
pub(crate) struct SendQueue<'a>(PhantomData<SendWr<'a>>);

impl<'a, C: SendCore> WorkQueue<C> for SendQueue<'a> {
    type Wr = SendWr<'a>;
    type CWr = ffi::ibv_send_wr;

    #[inline(always)]
    fn ring_and_head(core: &mut C) -> (&Ring, &mut u64) {
        core.sq()
    }

    #[inline(always)]
    fn validate(core: &C, wr: &SendWr<'a>) -> Result<(), Error> {
        let caps = core.caps();
        wr.validate(caps.max_send_sge, caps.max_inline_data, core.pd(), || {
            let ex = core.send_ex();
            let ctx = core.pd().context();
            ExtOps {
                atomic_write: ex.is_some_and(SendEx::atomic_write) && ctx.atomic_write(),
                flush: if ex.is_some_and(SendEx::flush) {
                    ctx.flush_placements()
                } else {
                    0
                },
            }
        })
    }

    #[inline(always)]
    fn write_c(
        core: &C,
        wr: &SendWr<'a>,
        c: &mut MaybeUninit<ffi::ibv_send_wr>,
        sges: &mut [MaybeUninit<ffi::ibv_sge>],
        last_slot: bool,
    ) -> (*mut ffi::ibv_send_wr, SlotMeta) {
        let c = c.write(ffi::ibv_send_wr::default());
        wr.fill_ffi(c);
        // As `built::stage_built`: the last free slot asks for a completion,
        // and a QP that signals every request gets the flag too.
        const SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        c.send_flags |= u32::from(last_slot || core.caps().sq_sig_all) * SIGNALED;
        let meta = SlotMeta {
            opcode: c.opcode,
            signaled: c.send_flags & SIGNALED != 0,
            drain: false,
        };
        c.num_sge = match wr.inline_data {
            // Inline: the NIC copies `data` during ibv_post_send; lkey is unused.
            Some(data) if !data.is_empty() => {
                sges[0].write(ffi::ibv_sge {
                    addr: data.as_ptr() as u64,
                    length: data.len() as u32,
                    lkey: 0,
                });
                1
            }
            Some(_) => 0,
            // On a copy: `fill_sges` is not inlined into every post.
            None => post::fill_sges(&read_copy(&wr.bufs), sges),
        };
        (c, meta)
    }

    #[inline(always)]
    fn builders(core: &C) -> Option<SendEx> {
        core.send_ex().copied()
    }

    #[inline(always)]
    fn request(wr: &SendWr<'a>) -> Option<send_ex::Request> {
        post::send_request(wr)
    }

    #[inline(always)]
    fn id_and_bufs(wr: &SendWr<'a>) -> (u64, *const Sges) {
        (wr.wr_id, &raw const wr.bufs)
    }

    fn into_parts(wr: SendWr<'a>) -> (u64, Sges) {
        (wr.wr_id, wr.bufs)
    }

    #[inline(always)]
    unsafe fn post(core: &C, head: *mut Self::CWr, bad: *mut *mut Self::CWr) -> i32 {
        // SAFETY: raw is live and send_ex (if any) is its extended
        // interface; the chain per this function's contract.
        unsafe { send_ex::post_chain::<false>(core.raw(), core.send_ex(), head, bad) }
    }
}

/// The receive queue of a QP.
pub(crate) struct RecvQueue;

impl<C: RecvCore> WorkQueue<C> for RecvQueue {
    type Wr = RecvWr;
    type CWr = ffi::ibv_recv_wr;

    #[inline(always)]
    fn ring_and_head(core: &mut C) -> (&Ring, &mut u64) {
        core.rq()
    }

    #[inline(always)]
    fn validate(core: &C, wr: &RecvWr) -> Result<(), Error> {
        wr.validate(core.caps().max_recv_sge, core.pd())
            .map_err(|e| recv_refused(core, e))
    }

    #[inline(always)]
    fn write_c(
        _core: &C,
        wr: &RecvWr,
        c: &mut MaybeUninit<ffi::ibv_recv_wr>,
        sges: &mut [MaybeUninit<ffi::ibv_sge>],
        _last_slot: bool,
    ) -> (*mut ffi::ibv_recv_wr, SlotMeta) {
        let c = c.write(ffi::ibv_recv_wr {
            num_sge: post::fill_sges(&wr.bufs, sges),
            ..Default::default()
        });
        let meta = SlotMeta {
            opcode: ffi::IBV_WC_RECV,
            signaled: true,
            drain: false,
        };
        (c, meta)
    }

    #[inline(always)]
    fn id_and_bufs(wr: &RecvWr) -> (u64, *const Sges) {
        (wr.wr_id, &raw const wr.bufs)
    }

    fn into_parts(wr: RecvWr) -> (u64, Sges) {
        (wr.wr_id, wr.bufs)
    }

    #[inline(always)]
    unsafe fn post(core: &C, head: *mut Self::CWr, bad: *mut *mut Self::CWr) -> i32 {
        // SAFETY: valid QP; the chain per this function's contract.
        unsafe { post::ibv_post_recv(core.raw(), head, bad) }
    }
}

/// A queue that posts on `Base` with more to check per request and, for a
/// send, more to write and to keep (UD's address): only what differs is
/// written for it, [`Extended`] forwards the rest.
pub(crate) trait Extension {
    /// The queue it posts on.
    type Base: WorkQueue;
    /// Its work request: the base queue's and more.
    type Wr;

    /// The base queue's request inside `wr`.
    fn base(wr: &Self::Wr) -> &<Self::Base as WorkQueue>::Wr;

    /// Takes the base queue's request out of `wr`.
    fn into_base(wr: Self::Wr) -> <Self::Base as WorkQueue>::Wr;

    /// Everything that can be checked before the NIC sees `wr`, the base
    /// queue's checks included (in the order whose error comes first).
    fn validate(core: &QpCore, wr: &Self::Wr) -> Result<(), Error>;

    /// Writes into `c` what the base queue's C form lacks. Nothing by default.
    ///
    /// # Safety
    /// `c` points to the entry the base queue's `write_c` just initialised.
    #[inline(always)]
    unsafe fn complete_c(_wr: &Self::Wr, _c: *mut <Self::Base as WorkQueue>::CWr) {}

    /// As [`WorkQueue::staged`], after the base queue's. Nothing by default.
    ///
    /// # Safety
    /// As [`WorkQueue::staged`].
    #[inline(always)]
    unsafe fn staged(_core: &mut QpCore, _seq: u64, _wr: &Self::Wr) {}
}

/// The work queue of an [`Extension`].
pub(crate) struct Extended<E>(PhantomData<E>);

impl<E: Extension> WorkQueue for Extended<E> {
    type Wr = E::Wr;
    type CWr = <E::Base as WorkQueue>::CWr;

    #[inline(always)]
    fn ring_and_head(core: &mut QpCore) -> (&Ring, &mut u64) {
        E::Base::ring_and_head(core)
    }

    #[inline(always)]
    fn validate(core: &QpCore, wr: &Self::Wr) -> Result<(), Error> {
        E::validate(core, wr)
    }

    #[inline(always)]
    fn write_c(
        core: &QpCore,
        wr: &Self::Wr,
        c: &mut MaybeUninit<Self::CWr>,
        sges: &mut [MaybeUninit<ffi::ibv_sge>],
        last_slot: bool,
    ) -> (*mut Self::CWr, SlotMeta) {
        let (p, meta) = E::Base::write_c(core, E::base(wr), c, sges, last_slot);
        // SAFETY: `p` points to the entry the base's write_c just initialised.
        unsafe { E::complete_c(wr, p) };
        (p, meta)
    }

    #[inline(always)]
    fn id_and_bufs(wr: &Self::Wr) -> (u64, *const Sges) {
        E::Base::id_and_bufs(E::base(wr))
    }

    fn into_parts(wr: Self::Wr) -> (u64, Sges) {
        E::Base::into_parts(E::into_base(wr))
    }

    #[inline(always)]
    unsafe fn post(core: &QpCore, head: *mut Self::CWr, bad: *mut *mut Self::CWr) -> i32 {
        // SAFETY: per this function's contract.
        unsafe { E::Base::post(core, head, bad) }
    }

    #[inline(always)]
    unsafe fn staged(core: &mut QpCore, seq: u64, wr: &Self::Wr) {
        // SAFETY: per this function's contract, for both parts of `wr`.
        unsafe {
            E::Base::staged(core, seq, E::base(wr));
            E::staged(core, seq, wr);
        }
    }
}

/// Checks `wr`, writes its C form into `c` and its SGEs into `sges`, and moves
/// its buffers into the queue's next slot. On refusal nothing changed.
///
/// # Safety
/// On `Ok` the buffers of `*wr` were moved out: the caller must forget `*wr`
/// (neither drop nor use it again).
#[inline(always)]
pub(super) unsafe fn stage<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    wr: &Q::Wr,
    c: &mut MaybeUninit<Q::CWr>,
    sges: &mut [MaybeUninit<ffi::ibv_sge>],
) -> Result<(), Error> {
    Q::validate(core, wr)?;
    let (ring, head) = Q::ring_and_head(core);
    let in_flight = ring.in_flight(*head);
    let depth = match ring.room(in_flight) {
        Ok(depth) => depth,
        Err(depth) => return Err(full::<C, Q>(core, depth)),
    };
    let (c, meta) = Q::write_c(core, wr, c, sges, in_flight + 1 == depth);
    let (wr_id, bufs) = Q::id_and_bufs(wr);
    let (ring, head) = Q::ring_and_head(core);
    let seq = *head;
    // SAFETY: producer side (&mut QpCore), space checked above against
    // `room`, which allocated the slots; the caller
    // forgets `*wr`, so its buffers live on only in the slot. `c` points to
    // the entry written just above.
    unsafe { Q::CWr::set_wr_id(c, ring.fill(seq, wr_id, meta, bufs)) };
    *head += 1;
    // SAFETY: the caller forgets `*wr` (this function's contract).
    unsafe { Q::staged(core, seq, wr) };
    Ok(())
}

/// A receive was refused: on a QP on a shared receive queue (no receive
/// queue of its own, no scatter entries), say so first.
#[cold]
#[inline(never)]
fn recv_refused<C: RecvCore>(core: &C, e: Error) -> Error {
    if core.uses_srq() {
        return full::<C, RecvQueue>(core, 0);
    }
    e
}

/// The queue has no free slot; a QP on a shared receive queue has no
/// receive queue at all (depth 0).
#[cold]
#[inline(never)]
pub(super) fn full<C: QueueCore, Q: WorkQueue<C>>(core: &C, depth: u64) -> Error {
    if depth == 0 && core.uses_srq() {
        // SAFETY: raw is a live QP; qp_num is a plain field.
        let qp_num = unsafe { (*core.raw()).qp_num };
        return Error::QpUsesSrq { qp_num };
    }
    Error::QueueFull {
        queue: Q::CWr::QUEUE,
        depth: depth as u32,
    }
}

/// Posts the `n` staged requests (sequence numbers from `first_seq`) with one
/// verb call; on refusal takes back what the device did not accept.
#[inline(always)]
pub(super) fn submit<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    c_wrs: &mut [MaybeUninit<Q::CWr>],
    c_sges: &mut [MaybeUninit<ffi::ibv_sge>],
    n: usize,
    first_seq: u64,
) -> Result<(), PostError> {
    let head = post::link(c_wrs, c_sges, n);
    let mut bad: *mut Q::CWr = std::ptr::null_mut();
    // SAFETY: valid QP; the chain and its SGEs live on the caller's stack
    // frame; every SGE points into a buffer owned by a ring slot or into inline
    // data borrowed for the caller's call.
    let rc = unsafe { Q::post(core, head, &mut bad) };
    if rc == 0 {
        Ok(())
    } else {
        Err(refused::<C, Q>(
            core,
            rc,
            post::bad_index(bad, head, n),
            first_seq,
        ))
    }
}

/// The verb returned `rc`: requests from the one at `bad` on were refused; if
/// the provider did not say which, keep them all in the ring (the NIC may own
/// some).
#[cold]
#[inline(never)]
pub(super) fn refused<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    rc: i32,
    bad: Option<usize>,
    first_seq: u64,
) -> PostError {
    let (ring, head) = Q::ring_and_head(core);
    let from = bad.map_or(*head, |i| first_seq + i as u64);
    // SAFETY: producer side; the device refused the request at `from`.
    let staged = bad.and_then(|_| unsafe { ring.staged(from) });
    // SAFETY: producer side; the device refused these requests.
    let unposted = unsafe { ring.unfill_from(from, head) };
    PostError {
        error: super::qp_core::post_refused(core.pd(), Q::CWr::POST_VERB, rc, staged),
        unposted,
    }
}

/// Posts one request: no list machinery, one entry on the stack.
#[inline(always)]
pub(crate) fn post_one<Q: WorkQueue>(core: &mut QpCore, wr: Q::Wr) -> Result<(), PostError> {
    post_one_on::<QpCore, Q>(core, wr)
}

/// [`post_one`] on any core: the whole QP's or a half's.
#[inline(always)]
pub(crate) fn post_one_on<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    wr: Q::Wr,
) -> Result<(), PostError> {
    // Never dropped here, also not if the post unwinds: a drop in place
    // would keep the request in memory (`read_copy`), and its buffers may be
    // in the ring by then.
    let wr = std::mem::ManuallyDrop::new(wr);
    // SAFETY: `post_one_in_place` moves `wr` out exactly once (into the ring
    // or back in its error); `wr` is not dropped. (Through a reference:
    // moving the request would copy all of it.)
    unsafe { post_one_in_place::<C, Q>(core, &wr) }
}

/// [`post_one_on`] for a request the caller holds.
///
/// # Safety
/// `*wr` is moved out (into the ring, or into the error when refused): the
/// caller must forget it.
#[inline(always)]
pub(crate) unsafe fn post_one_in_place<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    wr: &Q::Wr,
) -> Result<(), PostError> {
    if let Some(ex) = Q::builders(core) {
        if let Some(r) = Q::request(wr) {
            // SAFETY: the caller forgets `*wr` (this function's contract).
            return unsafe { built::post_one::<C, Q>(core, wr, ex, r) };
        }
    }
    let mut c_wr = [const { MaybeUninit::<Q::CWr>::uninit() }; 1];
    let mut c_sges = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; MAX_SAFE_SGES];
    let first_seq = *Q::ring_and_head(core).1;
    // SAFETY: the caller forgets `*wr`; refused, it is read out once here.
    if let Err(error) = unsafe { stage::<C, Q>(core, wr, &mut c_wr[0], &mut c_sges) } {
        return Err(PostError {
            error,
            // SAFETY: refused before staging, so `*wr` is whole; the caller
            // forgets it.
            unposted: vec![Q::into_parts(unsafe { std::ptr::read(wr) })],
        });
    }
    submit::<C, Q>(core, &mut c_wr, &mut c_sges, 1, first_seq)
}

/// Posts requests as chained lists, one verb call per [`POST_CHUNK`]. On
/// failure the requests that were taken from the iterator but did not reach
/// the NIC come back in the error; the iterator is not pulled further.
///
/// If the caller's iterator panics, the requests staged for the chunk in
/// progress never reached the NIC: an unwind guard takes them back out of the
/// ring (their buffers are dropped with the unwinding), so the queue is left
/// exactly as if they had never been offered.
#[inline]
pub(crate) fn post_list<Q: WorkQueue>(
    core: &mut QpCore,
    wrs: impl IntoIterator<Item = Q::Wr>,
) -> Result<(), PostError> {
    post_list_on::<QpCore, Q, _>(core, wrs)
}

/// [`post_list`] on any core: the whole QP's or a half's.
#[inline]
pub(crate) fn post_list_on<C: QueueCore, Q: WorkQueue<C>, I: IntoIterator<Item = Q::Wr>>(
    core: &mut C,
    wrs: I,
) -> Result<(), PostError> {
    match Q::builders(core) {
        Some(ex) => built::post_list::<C, Q, _>(core, ex, wrs.into_iter()),
        None => post_list_c::<C, Q, _>(core, wrs.into_iter()),
    }
}

/// [`post_list_on`] through C forms: chained lists, one verb call per chunk.
/// Not inlined: next to the builders' loop it would make the send path's
/// callers too large to inline the caller's iterator (a call per chunk of up
/// to 32 requests is what this costs).
#[inline(never)]
pub(super) fn post_list_c<C: QueueCore, Q: WorkQueue<C>, I: Iterator<Item = Q::Wr>>(
    core: &mut C,
    mut wrs: I,
) -> Result<(), PostError> {
    // Uninitialised: only the entries a post uses are written (no memset per call).
    let mut c_wrs = [const { MaybeUninit::<Q::CWr>::uninit() }; POST_CHUNK];
    let mut c_sges = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; POST_CHUNK * MAX_SAFE_SGES];
    loop {
        let first_seq = *Q::ring_and_head(core).1;
        let mut guard = Unstage::<C, Q> {
            core,
            first_seq,
            armed: true,
            _queue: PhantomData,
        };
        let mut n = 0;
        let mut exhausted = false;
        while n < POST_CHUNK {
            // Staged through a reference: binding the request by value would
            // copy all of it once more. (`next` may panic: see Unstage.)
            // Never dropped in place, also not on unwinding (see
            // `post_one_on`): forgotten once staged, taken out when refused.
            let next = std::mem::ManuallyDrop::new(wrs.next());
            let Some(wr) = &*next else {
                exhausted = true;
                break;
            };
            let sges = &mut c_sges[n * MAX_SAFE_SGES..];
            // SAFETY: `next` is forgotten once staged, returned whole when refused.
            if let Err(error) = unsafe { stage::<C, Q>(guard.core, wr, &mut c_wrs[n], sges) } {
                guard.armed = false;
                let core = &mut *guard.core;
                // Post what was staged before it, then report.
                let earlier =
                    (n > 0).then(|| submit::<C, Q>(core, &mut c_wrs, &mut c_sges, n, first_seq));
                // The caller's iterator is not pulled any further: what it has
                // not yielded stays with it (a panic or an endless iterator
                // there must not hide what was posted).
                return Err(list_failed(
                    earlier,
                    error,
                    std::mem::ManuallyDrop::into_inner(next)
                        .into_iter()
                        .map(Q::into_parts),
                ));
            }
            n += 1;
        }
        guard.armed = false;
        let core = &mut *guard.core;
        if n > 0 {
            submit::<C, Q>(core, &mut c_wrs, &mut c_sges, n, first_seq)?;
        }
        if exhausted {
            return Ok(());
        }
    }
}

/// While armed (the caller's iterator may still panic), dropping this takes
/// the requests staged since `first_seq` back out of the ring.
pub(super) struct Unstage<'c, C: QueueCore, Q: WorkQueue<C>> {
    pub(super) core: &'c mut C,
    pub(super) first_seq: u64,
    pub(super) armed: bool,
    pub(super) _queue: PhantomData<fn(Q)>,
}

impl<C: QueueCore, Q: WorkQueue<C>> Drop for Unstage<'_, C, Q> {
    // Runs disarmed after every chunk: the test is inlined, the unwinding
    // path is not.
    #[inline(always)]
    fn drop(&mut self) {
        if self.armed {
            self.unstage();
        }
    }
}

impl<C: QueueCore, Q: WorkQueue<C>> Unstage<'_, C, Q> {
    /// Takes the requests staged since `first_seq` back out of the ring.
    #[cold]
    #[inline(never)]
    fn unstage(&mut self) {
        let (ring, head) = Q::ring_and_head(self.core);
        // SAFETY: producer side; the staged requests were never submitted.
        let unstaged = unsafe { ring.unfill_from(self.first_seq, head) };
        // Their buffers drop here, during the unwind.
        crate::ledger::sges::drop_each_catching(unstaged);
    }
}

/// The error of a list post that stopped at a refused request: the earlier
/// requests' post result (if any were staged), the refusal, and the requests
/// from the refused one on.
#[cold]
pub(super) fn list_failed(
    earlier: Option<Result<(), PostError>>,
    error: Error,
    rest: impl Iterator<Item = (u64, Sges)>,
) -> PostError {
    match earlier {
        // The earlier requests failed too: that error comes first.
        Some(Err(mut e)) => {
            e.unposted.extend(rest);
            e
        }
        _ => PostError {
            error,
            unposted: rest.collect(),
        },
    }
}
