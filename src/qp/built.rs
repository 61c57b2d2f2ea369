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
    self, POST_CHUNK, QueueCore, Unstage, WorkQueue, full, list_failed, refused, stage, submit,
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
/// each request is checked, staged in its ring slot and built as it comes
/// from the caller's iterator, inside one critical region
/// (`ibv_wr_start` .. `ibv_wr_complete`) per [`POST_CHUNK`] requests; a
/// chunk's first request is pulled before its region opens. A chunk that
/// meets a request the builders cannot express stages the rest as C forms
/// and posts them after what its region built ([`finish_chunk_c`]); a list
/// whose chunk starts with one goes as C forms from there
/// ([`post_list_c`](queue::post_list_c)). If the iterator panics, the region
/// is aborted (`ibv_wr_abort`) and the requests staged in the chunk are taken
/// back, their buffers dropped after the region is closed: nothing of the
/// chunk was posted.
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
                region.close(n)?;
                break;
            }
            let next = ManuallyDrop::new(wrs.next());
            let Some(wr) = &*next else {
                return region.close(n);
            };
            let Some(mut r) = Q::request(wr) else {
                match finish_chunk_c::<C, Q, I>(region, n, next, &mut wrs) {
                    Ok(true) => return Ok(()),
                    Ok(false) => break,
                    Err(e) => return Err(e),
                }
            };
            // SAFETY: `next` is forgotten once staged, returned whole when refused.
            if let Err(error) = unsafe { stage_built::<C, Q>(region.staged.core, wr, &mut r) } {
                let earlier = region.close(n);
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

    /// Closes the region, posting the `built` requests it built (one at
    /// least).
    #[inline(always)]
    fn close(self, built: usize) -> Result<(), PostError> {
        self.close_then(built, |_| Ok(()))
    }

    /// Closes the region, posting the `built` requests it built (one at
    /// least), then, if that succeeded, runs `then` (which posts what was
    /// staged after them as C forms). A failed region takes back what was
    /// staged after it ([`built_refused`]).
    #[inline(always)]
    fn close_then(
        mut self,
        built: usize,
        then: impl FnOnce(&mut C) -> Result<(), PostError>,
    ) -> Result<(), PostError> {
        self.staged.armed = false;
        let first_seq = self.staged.first_seq;
        let core = &mut *self.staged.core;
        // SAFETY: the region is open (armed until just now); each built
        // request's SGE names a buffer its ring slot owns.
        match unsafe { self.ex.complete() } {
            0 => then(core),
            rc => Err(built_refused::<C, Q>(core, Some(rc), first_seq, built)),
        }
    }
}

/// The rest of a chunk from `first`, a request the builders cannot express,
/// after the `built` requests of `region`: staged as C forms (the iterator
/// still runs inside the region), then the region's requests are posted and
/// the C forms after them (`submit`: `ibv_post_send` or its replay). Returns whether the iterator
/// ran out. Out of line: its C forms' arrays stay off the builders' loop.
#[inline(never)]
fn finish_chunk_c<C: QueueCore, Q: WorkQueue<C>, I: Iterator<Item = Q::Wr>>(
    region: Region<'_, C, Q>,
    built: usize,
    first: std::mem::ManuallyDrop<Option<Q::Wr>>,
    wrs: &mut I,
) -> Result<bool, PostError> {
    let mut c_wrs = [const { MaybeUninit::<Q::CWr>::uninit() }; POST_CHUNK];
    let mut c_sges = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; POST_CHUNK * MAX_SAFE_SGES];
    let c_first = region.staged.first_seq + built as u64;
    let mut n = 0;
    let mut next = first;
    let exhausted = loop {
        let Some(wr) = &*next else {
            break true;
        };
        let sges = &mut c_sges[n * MAX_SAFE_SGES..];
        // SAFETY: `next` is forgotten once staged, returned whole when refused.
        if let Err(error) = unsafe { stage::<C, Q>(region.staged.core, wr, &mut c_wrs[n], sges) } {
            let earlier = region.close_then(built, |core| {
                if n == 0 {
                    return Ok(());
                }
                submit::<C, Q>(core, &mut c_wrs, &mut c_sges, n, c_first)
            });
            let rest = std::mem::ManuallyDrop::into_inner(next).into_iter();
            return Err(list_failed(Some(earlier), error, rest.map(Q::into_parts)));
        }
        n += 1;
        if built + n == POST_CHUNK {
            break false;
        }
        // Never dropped in place (see `post_list`).
        next = std::mem::ManuallyDrop::new(wrs.next());
    };
    region.close_then(built, |core| {
        submit::<C, Q>(core, &mut c_wrs, &mut c_sges, n, c_first)
    })?;
    Ok(exhausted)
}

/// The builders' post of the `built` requests from `first_seq` returned
/// `rc`. `None` (an opcode without a builder, which `send_request` never
/// gives them) posted nothing: they come back with whatever was staged after
/// them. A failed `ibv_wr_complete` does not say whether they reached the
/// queue (`send_ex`'s module docs), so they stay in the ring until
/// completions retire them or the QP is dropped, as after a legacy post that
/// names no refused request; what was staged after them (C forms, never
/// posted) comes back.
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
