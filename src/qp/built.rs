//! The safe send path on a QP with extended builders: a request the builders
//! can express ([`send_request`](super::post::send_request)) is checked and
//! staged in its ring slot like any other, then posted with `ibv_wr_*` calls
//! directly, without writing a C request for the replay to read back.

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use crate::error::Error;
use crate::ffi;
use crate::ledger::ring::SlotMeta;
use crate::qp::PostError;
use crate::qp::queue::{
    POST_CHUNK, QueueCore, Unstage, WorkQueue, full, list_failed, post_list_c, refused,
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
        // All or nothing: the request did not reach the NIC. (`None`, an
        // opcode without a builder, cannot come from `send_request`.)
        rc => Err(refused::<C, Q>(
            core,
            rc.unwrap_or(libc::EINVAL),
            Some(0),
            seq,
        )),
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
    let (in_flight, depth) = (ring.in_flight(*head), ring.depth());
    if in_flight >= depth {
        return Err(full::<C, Q>(core, depth));
    }
    if in_flight + 1 == depth && !sig_all {
        // The last free slot: ask for a completion so the ring drains.
        r.flags |= SIGNALED;
    }
    let meta = SlotMeta {
        opcode: r.opcode,
        signaled: sig_all || r.flags & SIGNALED != 0,
        drain: false,
    };
    let (wr_id, bufs) = Q::id_and_bufs(wr);
    let seq = *head;
    // SAFETY: producer side (&mut core), space checked above; the caller
    // forgets `*wr`, so its buffers live on only in the slot.
    r.wr_id = unsafe { ring.fill(seq, wr_id, meta, bufs) };
    *head += 1;
    // SAFETY: the caller forgets `*wr` (this function's contract).
    unsafe { Q::staged(core, seq, wr) };
    Ok(seq)
}

/// [`post_list_on`](crate::qp::queue::post_list_on) on a QP with builders: each chunk goes out without C
/// forms, in one critical region (`SendEx::post_list`, which picks the
/// builder once when the chunk shares an opcode). From a request the
/// builders cannot express on, the rest goes through [`post_list_c`](crate::qp::queue::post_list_c).
#[inline]
pub(super) fn post_list<C: QueueCore, Q: WorkQueue<C>, I: Iterator<Item = Q::Wr>>(
    core: &mut C,
    ex: SendEx,
    mut wrs: I,
) -> Result<(), PostError> {
    let mut reqs = [const { MaybeUninit::<Request>::uninit() }; POST_CHUNK];
    loop {
        let (ring, head) = Q::ring_and_head(core);
        let (first_seq, tag) = (*head, u64::from(ring.tag()) << 32);
        let mut guard = Unstage::<C, Q> {
            core,
            first_seq,
            armed: true,
            _queue: PhantomData,
        };
        let (mut n, mut uniform, mut mixed) = (0, 0, false);
        let (mut exhausted, mut rest) = (false, None);
        while n < POST_CHUNK {
            // Staged through a reference, as in `post_list_c`.
            let next = wrs.next();
            let Some(wr) = &next else {
                exhausted = true;
                break;
            };
            let Some(mut r) = Q::request(wr) else {
                rest = next;
                break;
            };
            // SAFETY: `next` is forgotten once staged, returned whole when refused.
            if let Err(error) = unsafe { stage_built::<C, Q>(guard.core, wr, &mut r) } {
                guard.armed = false;
                let core = &mut *guard.core;
                let earlier = (n > 0)
                    .then(|| submit_built::<C, Q>(core, ex, &reqs[..n], None, first_seq, tag));
                return Err(list_failed(
                    earlier,
                    error,
                    next.into_iter().map(Q::into_parts),
                ));
            }
            std::mem::forget(next);
            mixed |= n > 0 && r.opcode != uniform;
            uniform = r.opcode;
            reqs[n].write(r);
            n += 1;
        }
        guard.armed = false;
        let core = &mut *guard.core;
        if n > 0 {
            let uniform = (!mixed).then_some(uniform);
            if let Err(mut e) = submit_built::<C, Q>(core, ex, &reqs[..n], uniform, first_seq, tag)
            {
                e.unposted.extend(rest.map(Q::into_parts));
                return Err(e);
            }
        }
        if let Some(wr) = rest {
            return post_list_c::<C, Q, _>(core, std::iter::once(wr).chain(wrs));
        }
        if exhausted {
            return Ok(());
        }
    }
}

/// Posts the staged builder requests `reqs` (sequence numbers from
/// `first_seq`, tokens `tag | seq`) in one critical region; refused, they
/// all come back (all or nothing).
#[inline(always)]
fn submit_built<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    ex: SendEx,
    reqs: &[MaybeUninit<Request>],
    uniform: Option<u32>,
    first_seq: u64,
    tag: u64,
) -> Result<(), PostError> {
    // SAFETY: the caller passes the entries it initialised.
    let reqs = unsafe { &*(reqs as *const [MaybeUninit<Request>] as *const [Request]) };
    // SAFETY: `ex` is the live QP's extended interface; each request's SGE
    // names a buffer its ring slot owns (validated when staged); request `j`
    // gets token `tag | (first_seq + j)`, the ring's token for its slot.
    match unsafe { ex.post_list(reqs, uniform, tag, first_seq as u32) } {
        Some(0) => Ok(()),
        rc => Err(refused::<C, Q>(
            core,
            rc.unwrap_or(libc::EINVAL),
            Some(0),
            first_seq,
        )),
    }
}
