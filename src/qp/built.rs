//! The safe send path on a QP with extended builders: a request the builders
//! can express ([`send_request`](super::post::send_request)) is checked and
//! staged in its ring slot like any other, then posted with `ibv_wr_*` calls
//! directly, without writing a C request for the replay to read back.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use crate::error::Error;
use crate::ffi;
use crate::ledger::ring::SlotMeta;
use crate::ledger::sges::MAX_SAFE_SGES;
use crate::qp::PostError;
use crate::qp::queue::{
    POST_CHUNK, QueueCore, Unstage, WorkQueue, full, list_failed, refused, stage, submit,
};
use crate::qp::send_ex::{Request, SendEx};

/// [`post_one`](crate::qp::queue::post_one) for a request whose builder form is `r`: the same checks
/// and slot as staging a C form, then `ex`'s builders instead of a C request and its
/// replay.
///
/// # Safety
/// `*wr` is moved out (into the ring, or back in the error when refused
/// before it was staged): the caller must forget it.
#[inline(always)]
pub(super) unsafe fn post_one<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    wr: &Q::Wr,
    ex: SendEx,
    mut r: Request,
) -> Result<(), PostError> {
    // SAFETY: the caller forgets `*wr`; refused, it is read out once here.
    let seq = match unsafe { stage_built::<C, Q>(core, wr, &mut r) } {
        Ok(seq) => seq,
        Err(error) => {
            return Err(PostError {
                error,
                // SAFETY: refused before staging, so `*wr` is whole; the
                // caller forgets it.
                unposted: vec![Q::into_parts(unsafe { std::ptr::read(wr) })],
            });
        }
    };
    // SAFETY: `ex` is the live QP's extended interface; `r`'s SGE names a
    // buffer the ring slot now owns (validated: registered in the QP's PD,
    // length within u32).
    match unsafe { ex.post_one(&r) } {
        Some(0) => Ok(()),
        rc => Err(built_refused::<C, Q>(core, rc, seq, 1)),
    }
}

/// Staging for a request whose builder form is `r`: checks `wr`, moves its
/// buffers into the queue's next slot and writes the slot's token and the
/// last-slot signal into `r`. Returns the slot's sequence number; on
/// refusal nothing changed.
///
/// # Safety
/// On `Ok` the buffers of `*wr` were moved out: the caller must forget `*wr`.
#[inline(always)]
unsafe fn stage_built<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    wr: &Q::Wr,
    r: &mut Request,
) -> Result<u64, Error> {
    const SIGNALED: u32 = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    Q::validate(core, wr)?;
    let sig_all = core.caps().sq_sig_all;
    let (ring, head) = Q::ring_and_head(core);
    let in_flight = ring.in_flight(*head);
    let depth = match ring.room(in_flight) {
        Ok(depth) => depth,
        Err(depth) => return Err(full::<C, Q>(core, depth)),
    };
    // The last free slot asks for a completion so the ring drains. On a QP
    // that signals every request the flag is set too: the provider signals
    // it either way, and one OR computes both cases.
    r.flags |= u32::from(in_flight + 1 == depth || sig_all) * SIGNALED;
    let meta = SlotMeta {
        opcode: r.opcode,
        signaled: r.flags & SIGNALED != 0,
        drain: false,
    };
    let (wr_id, bufs) = Q::id_and_bufs(wr);
    let seq = *head;
    // SAFETY: producer side (&mut core), space checked above against
    // `room`, which allocated the slots; the caller
    // forgets `*wr`, so its buffers live on only in the slot.
    r.wr_id = unsafe { ring.fill(seq, wr_id, meta, bufs) };
    *head += 1;
    // SAFETY: the caller forgets `*wr` (this function's contract).
    unsafe { Q::staged(core, seq, wr) };
    Ok(seq)
}

/// [`post_list_on`](crate::qp::queue::post_list_on) on a QP with builders:
/// each chunk is staged whole before anything of it is posted (so a panic of
/// the caller's iterator takes the whole chunk back, as on the C path). Its
/// requests go to the builders without C forms (`SendEx::post_list`, which
/// picks the builder once when they share an opcode) until one the builders
/// cannot express; from there the chunk's rest is staged as C forms and
/// posted after the built part, with `ibv_post_send` or its replay.
#[inline]
pub(super) fn post_list<C: QueueCore, Q: WorkQueue<C>, I: Iterator<Item = Q::Wr>>(
    core: &mut C,
    ex: SendEx,
    mut wrs: I,
) -> Result<(), PostError> {
    let mut chunk = Chunk::<Q::CWr> {
        reqs: [const { MaybeUninit::uninit() }; POST_CHUNK],
        c_wrs: [const { MaybeUninit::uninit() }; POST_CHUNK],
        c_sges: [const { MaybeUninit::uninit() }; POST_CHUNK * MAX_SAFE_SGES],
    };
    loop {
        let (ring, head) = Q::ring_and_head(core);
        let (first_seq, tag) = (*head, u64::from(ring.tag()) << 32);
        let mut guard = Unstage::<C, Q> {
            core,
            first_seq,
            armed: true,
            _queue: PhantomData,
        };
        // The counts live outside the chunk's arrays (whose address reaches
        // C), so that they stay in registers.
        let mut n = Counts { built: 0, c: 0 };
        let mut exhausted = false;
        while n.built + n.c < POST_CHUNK {
            // Staged through a reference, as in `post_list_c`.
            // Never dropped in place, also not on unwinding (see
            // `post_one_on`): forgotten once staged, taken out when refused.
            let next = std::mem::ManuallyDrop::new(wrs.next());
            let Some(wr) = &*next else {
                exhausted = true;
                break;
            };
            // SAFETY: `next` is forgotten once staged, returned whole when refused.
            if let Err(error) = unsafe { chunk.stage::<C, Q>(&mut n, guard.core, wr) } {
                guard.armed = false;
                let core = &mut *guard.core;
                let earlier =
                    (n.built + n.c > 0).then(|| chunk.submit::<C, Q>(n, core, ex, first_seq, tag));
                return Err(list_failed(
                    earlier,
                    error,
                    std::mem::ManuallyDrop::into_inner(next)
                        .into_iter()
                        .map(Q::into_parts),
                ));
            }
        }
        guard.armed = false;
        let core = &mut *guard.core;
        if n.built + n.c > 0 {
            chunk.submit::<C, Q>(n, core, ex, first_seq, tag)?;
        }
        if exhausted {
            return Ok(());
        }
    }
}

/// One chunk of a list on a QP with builders: its first [`Counts::built`]
/// requests in the builders' form, then [`Counts::c`] in C form (with their
/// SGE blocks).
struct Chunk<W> {
    reqs: [MaybeUninit<Request>; POST_CHUNK],
    c_wrs: [MaybeUninit<W>; POST_CHUNK],
    c_sges: [MaybeUninit<ffi::ibv_sge>; POST_CHUNK * MAX_SAFE_SGES],
}

/// How many requests a [`Chunk`] holds in each form.
#[derive(Clone, Copy)]
struct Counts {
    built: usize,
    c: usize,
}

impl<W> Chunk<W> {
    /// Stages `wr` in the builders' form while the chunk has no C form yet
    /// and the builders can express it, else in C form.
    ///
    /// # Safety
    /// On `Ok` the buffers of `*wr` were moved out: the caller must forget `*wr`.
    #[inline(always)]
    unsafe fn stage<C: QueueCore, Q: WorkQueue<C, CWr = W>>(
        &mut self,
        n: &mut Counts,
        core: &mut C,
        wr: &Q::Wr,
    ) -> Result<(), Error> {
        if n.c == 0 {
            if let Some(r) = Q::request(wr) {
                // Staged in its chunk entry (copying it there afterwards would
                // move it once more); a refused request leaves the entry
                // unused, past `built`.
                let r = self.reqs[n.built].write(r);
                // SAFETY: per this function's contract.
                unsafe { stage_built::<C, Q>(core, wr, r)? };
                n.built += 1;
                return Ok(());
            }
        }
        let (c, sges) = (
            &mut self.c_wrs[n.c],
            &mut self.c_sges[n.c * MAX_SAFE_SGES..],
        );
        // SAFETY: per this function's contract.
        unsafe { stage::<C, Q>(core, wr, c, sges)? };
        n.c += 1;
        Ok(())
    }

    /// Posts what is staged (sequence numbers from `first_seq`): the built
    /// part, then the C part. A refused built part keeps or takes back the C
    /// part with itself (nothing of the C part was posted); a refused C part
    /// is taken back from the request the provider named.
    #[inline(always)]
    fn submit<C: QueueCore, Q: WorkQueue<C, CWr = W>>(
        &mut self,
        n: Counts,
        core: &mut C,
        ex: SendEx,
        first_seq: u64,
        tag: u64,
    ) -> Result<(), PostError> {
        if n.built > 0 {
            let reqs = &self.reqs[..n.built];
            submit_built::<C, Q>(core, ex, reqs, first_seq, tag)?;
        }
        if n.c > 0 {
            let c_first = first_seq + n.built as u64;
            submit::<C, Q>(core, &mut self.c_wrs, &mut self.c_sges, n.c, c_first)?;
        }
        Ok(())
    }
}

/// Posts the staged builder requests `reqs` (sequence numbers from
/// `first_seq`, tokens `tag | seq`) in one critical region (see
/// [`built_refused`] for a refusal).
#[inline(always)]
fn submit_built<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    ex: SendEx,
    reqs: &[MaybeUninit<Request>],
    first_seq: u64,
    tag: u64,
) -> Result<(), PostError> {
    // SAFETY: the caller passes the entries it initialised.
    let reqs = unsafe { &*(reqs as *const [MaybeUninit<Request>] as *const [Request]) };
    // The opcode every request has, if they share one (a compare each, here
    // rather than while staging, where it costs a branch on the chunk's state).
    let first = reqs.first().map(|r| r.opcode);
    let uniform = first.filter(|&op| reqs.iter().all(|r| r.opcode == op));
    // SAFETY: `ex` is the live QP's extended interface; each request's SGE
    // names a buffer its ring slot owns (validated when staged); request `j`
    // gets token `tag | (first_seq + j)`, the ring's token for its slot.
    match unsafe { ex.post_list(reqs, uniform, tag, first_seq as u32) } {
        Some(0) => Ok(()),
        rc => Err(built_refused::<C, Q>(core, rc, first_seq, reqs.len())),
    }
}

/// The builders' post of the `built` requests from `first_seq` returned
/// `rc`. `None` (an opcode without a builder, which `send_request` never
/// gives them) posted nothing: they come back with whatever was staged after
/// them. A failed `ibv_wr_complete` does not say whether they reached the
/// queue (`send_ex`'s module docs), so they stay in the ring until
/// completions retire them or the QP is dropped, as after a legacy post that
/// names no refused request; what was staged after them (never posted) comes
/// back.
#[cold]
#[inline(never)]
fn built_refused<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    rc: Option<i32>,
    first_seq: u64,
    built: usize,
) -> PostError {
    let staged_after = first_seq + built as u64 != *Q::ring_and_head(core).1;
    match rc {
        None => refused::<C, Q>(core, libc::EINVAL, Some(0), first_seq),
        // What was staged after them comes back.
        Some(rc) if staged_after => refused::<C, Q>(core, rc, Some(built), first_seq),
        // Nothing after them: all stays, as for a refusal that names no request.
        Some(rc) => refused::<C, Q>(core, rc, None, first_seq),
    }
}
