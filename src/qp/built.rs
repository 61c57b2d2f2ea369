//! The safe send path on a QP with extended builders: a request the builders
//! can express ([`send_request`](super::post::send_request)) is checked and
//! staged in its ring slot like any other, then posted with `ibv_wr_*` calls
//! directly, without writing a C request for the replay to read back.

use std::marker::PhantomData;

use crate::error::Error;
use crate::ffi;
use crate::ledger::ring::SlotMeta;
use crate::qp::PostError;
use crate::qp::queue::{
    self, POST_CHUNK, QueueCore, Unstage, WorkQueue, full, list_failed, refused,
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
        rc => Err(built_refused::<C, Q>(core, rc, seq)),
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
/// each request is checked, staged in its ring slot and built as it comes
/// from the caller's iterator, inside one critical region
/// (`ibv_wr_start` .. `ibv_wr_complete`) per [`POST_CHUNK`] requests; a
/// chunk's first request is pulled before its region opens. From a request
/// the builders cannot express on, the list (that request first) goes as C
/// forms, after what the region built ([`post_list_c`](queue::post_list_c)).
/// If the iterator panics, the region is aborted (`ibv_wr_abort`) and the
/// requests staged in it are taken back, their buffers dropped after the
/// region is closed.
#[inline]
pub(super) fn post_list<C: QueueCore, Q: WorkQueue<C>, I: Iterator<Item = Q::Wr>>(
    core: &mut C,
    ex: SendEx,
    mut wrs: I,
) -> Result<(), PostError> {
    use std::mem::ManuallyDrop;
    loop {
        // Staged through a reference, as in `post_list_c`; never dropped in
        // place, also not on unwinding (see `post_one_on`): forgotten once
        // staged, taken out when refused.
        let next = ManuallyDrop::new(wrs.next());
        let Some(wr) = &*next else {
            return Ok(());
        };
        let Some(mut r) = Q::request(wr) else {
            let rest = ManuallyDrop::into_inner(next).into_iter().chain(wrs);
            return queue::post_list_c::<C, Q, _>(core, rest);
        };
        let first_seq = *Q::ring_and_head(core).1;
        // SAFETY: `next` is forgotten once staged, returned whole when refused.
        if let Err(error) = unsafe { stage_built::<C, Q>(core, wr, &mut r) } {
            let rest = ManuallyDrop::into_inner(next).into_iter();
            return Err(list_failed(None, error, rest.map(Q::into_parts)));
        }
        // SAFETY: `ex` is the live QP's extended interface (the caller's
        // `&mut` core keeps the QP); `region` closes it on every path.
        unsafe { ex.start() };
        let region = Region::<C, Q> {
            staged: Unstage {
                core: &mut *core,
                first_seq,
                armed: true,
                _queue: PhantomData,
            },
            ex,
        };
        region.build(&r);
        let mut n = 1;
        loop {
            if n == POST_CHUNK {
                region.close()?;
                break;
            }
            let next = ManuallyDrop::new(wrs.next());
            let Some(wr) = &*next else {
                return region.close();
            };
            let Some(mut r) = Q::request(wr) else {
                // What the region built goes first; if it failed, nothing
                // after it is posted.
                if let Err(mut e) = region.close() {
                    let this = ManuallyDrop::into_inner(next).into_iter();
                    e.unposted.extend(this.map(Q::into_parts));
                    return Err(e);
                }
                let rest = ManuallyDrop::into_inner(next).into_iter().chain(wrs);
                return queue::post_list_c::<C, Q, _>(core, rest);
            };
            // SAFETY: `next` is forgotten once staged, returned whole when refused.
            if let Err(error) = unsafe { stage_built::<C, Q>(region.staged.core, wr, &mut r) } {
                let earlier = region.close();
                let rest = ManuallyDrop::into_inner(next).into_iter();
                return Err(list_failed(Some(earlier), error, rest.map(Q::into_parts)));
            }
            region.build(&r);
            n += 1;
        }
    }
}

/// An open critical region of a list post and the requests staged in it.
/// Dropped while armed (the caller's iterator panicked), it aborts the
/// region, then takes those requests back out of the ring.
struct Region<'c, C: QueueCore, Q: WorkQueue<C>> {
    staged: Unstage<'c, C, Q>,
    ex: SendEx,
}

impl<C: QueueCore, Q: WorkQueue<C>> Drop for Region<'_, C, Q> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.staged.armed {
            // SAFETY: armed means the region is open. The slots are taken
            // back (and their buffers dropped) when `staged` drops, after.
            unsafe { self.ex.abort() };
        }
    }
}

impl<C: QueueCore, Q: WorkQueue<C>> Region<'_, C, Q> {
    /// Builds `r`, staged last, in the region.
    #[inline(always)]
    fn build(&self, r: &Request) {
        // SAFETY: the region is open (armed); `r`'s SGE names the buffer its
        // slot now owns (validated: in the QP's PD, length within u32).
        let built = unsafe { self.ex.build_one(r) };
        // `send_request` gives builder opcodes only; were it not so, this
        // unwinds through `Drop`, which aborts the region and unstages.
        assert!(built, "a builder request without a builder");
    }

    /// Closes the region, posting what it built (one request at least).
    #[inline(always)]
    fn close(mut self) -> Result<(), PostError> {
        self.staged.armed = false;
        // SAFETY: the region is open (armed until just now); each built
        // request's SGE names a buffer its ring slot owns.
        match unsafe { self.ex.complete() } {
            0 => Ok(()),
            rc => Err(built_refused::<C, Q>(
                self.staged.core,
                Some(rc),
                self.staged.first_seq,
            )),
        }
    }
}

/// The builders' post of the requests staged from `first_seq` (the last
/// ones in the ring) returned `rc`. `None` (an opcode without a builder,
/// which `send_request` never gives them) posted nothing: they come back. A
/// failed `ibv_wr_complete` does not say whether they reached the queue
/// (`send_ex`'s module docs), so they stay in the ring until completions
/// retire them or the QP is dropped, as after a legacy post that names no
/// refused request.
#[cold]
#[inline(never)]
fn built_refused<C: QueueCore, Q: WorkQueue<C>>(
    core: &mut C,
    rc: Option<i32>,
    first_seq: u64,
) -> PostError {
    match rc {
        None => refused::<C, Q>(core, libc::EINVAL, Some(0), first_seq),
        Some(rc) => refused::<C, Q>(core, rc, None, first_seq),
    }
}
