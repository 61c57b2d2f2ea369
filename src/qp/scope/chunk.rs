//! Posting an iterator's requests ([`ScopedQp::post_send_list`]) in chunks,
//! one `ibv_post_send` per [`POST_CHUNK`] requests.
//!
//! [`ScopedQp::post_send_list`]: super::ScopedQp::post_send_list

use std::ptr::NonNull;

use super::listing::{Listing, nested_post};
use super::post::not_on_scope_cq;
use super::side_table::{PostedRange, ScopedTables};
use super::{SIGNALED, ScopedListError, ScopedSend};
use crate::error::{Error, Result, errno};
use crate::ledger::ring::Ring;
use crate::qp::QpCore;
use crate::qp::post;
use crate::qp::queue::POST_CHUNK;

/// Posts a list chunk by chunk with `chunk` (how many it posted and whether
/// the list may have more, or why it stopped), until the list ends or a chunk
/// stops; the error counts every request posted before it.
#[inline(always)]
pub(super) fn post_in_chunks(
    mut chunk: impl FnMut() -> std::result::Result<(usize, bool), ScopedListError>,
) -> std::result::Result<(), ScopedListError> {
    let mut posted = 0;
    loop {
        match chunk() {
            Ok((n, more)) => {
                posted += n;
                if !more {
                    return Ok(());
                }
            }
            Err(e) => {
                return Err(ScopedListError {
                    posted: posted + e.posted,
                    error: e.error,
                });
            }
        }
    }
}

/// Posts up to [`POST_CHUNK`] requests of `reqs` with one verb call;
/// returns how many were posted and whether `reqs` may have more, or why the
/// next was not posted.
///
/// References into the QP's core live only between calls of `reqs.next()`,
/// which may poll the scope (and so use the core itself): `core` is the
/// QP's core, borrowed for the scope by the `ScopedQp` that calls.
#[inline(always)]
pub(super) fn post_send_chunk<'s>(
    core: NonNull<QpCore>,
    reqs: &mut impl Iterator<Item = ScopedSend<'s>>,
) -> std::result::Result<(usize, bool), ScopedListError> {
    // SAFETY: see above; no reference into the core is live; a poll from the
    // iterator changes neither the head nor the depth, and a post on this
    // queue from it is refused (`Listing`, below).
    let (head, depth, sig_all, tables_ok) = unsafe {
        let c = core.as_ref();
        (
            c.sq_head,
            c.sq.depth(),
            c.caps.sq_sig_all,
            c.ext.scoped.is_some(),
        )
    };
    if !tables_ok {
        return Err(not_on_scope_cq("send", 0));
    }
    // Posts on the send queue from the iterator are refused until the chunk
    // is posted (they would take the head the staged requests count on).
    // SAFETY: as above.
    let _listing = unsafe { Listing::mark(core, false) }.ok_or_else(|| ScopedListError {
        posted: 0,
        error: nested_post(false),
    })?;
    // Takes back the side entries of staged requests that are not posted,
    // also when the iterator panics (see `PostedRange`).
    let mut staged = StagedEntries {
        core,
        from: head,
        to: head,
    };
    let mut n = 0;
    // One past the chunk's last signaled request (0: none).
    let mut last_sig = 0;
    let mut refused = None;
    let mut more = true;
    while n < POST_CHUNK {
        let Some(req) = reqs.next() else {
            more = false;
            break;
        };
        // SAFETY: as above; the iterator has returned, so this is the only
        // reference until the next call of it.
        let c = unsafe { &mut *core.as_ptr() };
        let Some(tables) = c.ext.scoped.as_deref_mut() else {
            break; // not reached: attached QPs keep their tables
        };
        // SAFETY: n < POST_CHUNK; the QP's own tables and send ring.
        match unsafe { stage_in_chunk(tables, &c.sq, &req, head, n, depth, sig_all) } {
            Ok(signaled) => {
                if signaled {
                    last_sig = n + 1;
                }
            }
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
        n += 1;
        staged.to = head + n as u64;
    }
    if n > 0 {
        // SAFETY: as above; the iterator is not called again in this chunk,
        // and n requests were staged from the head.
        unsafe { post_staged_chunk(core, head, n, last_sig, &mut staged) }?;
    }
    match refused {
        None => Ok((n, more)),
        Some(error) => Err(ScopedListError { posted: n, error }),
    }
}

/// Stages `req` as request `n` of the chunk posted from `head`: its side
/// entry, SGE and C request (linked to the next) in the QP's tables, asking
/// for a completion if it takes the queue's last free slot. Returns whether
/// it asks for one, or why it is refused.
///
/// # Safety
/// `tables` and `ring` are the QP's; `n < POST_CHUNK`.
#[inline(always)]
unsafe fn stage_in_chunk(
    tables: &mut ScopedTables,
    ring: &Ring,
    req: &ScopedSend<'_>,
    head: u64,
    n: usize,
    depth: u64,
    sig_all: bool,
) -> Result<bool> {
    let seq = head + n as u64;
    // Polls from the iterator may have retired requests since.
    let in_flight = ring.in_flight(head);
    if in_flight + n as u64 >= depth {
        return Err(Error::QueueFull {
            queue: "send",
            depth: depth as u32,
        });
    }
    if !req.plainly_valid() {
        return Err(req.refusal());
    }
    let mut flags = req.flags | tables.fence_for(req.opcode);
    if in_flight + n as u64 + 1 == depth && !sig_all {
        // The last free slot: ask for a completion so the queue drains.
        flags |= SIGNALED;
    }
    let wrs = tables.send_wrs.as_mut_ptr();
    let sges = tables.sges.as_mut_ptr();
    // SAFETY: `index` masks with the ring's slot count, the table's length;
    // n < POST_CHUNK: inside both arrays, which live in the QP's tables and
    // nothing else references now.
    unsafe {
        *tables.sq.get_unchecked_mut(ring.index(seq)) =
            PostedRange::send(seq, req.wr_id, req.opcode);
        sges.add(n).write(req.sge);
        req.fill(&mut *wrs.add(n), ring.token(seq), flags, sges.add(n));
        (*wrs.add(n)).next = wrs.add(n + 1);
    }
    Ok(flags & SIGNALED != 0)
}

/// Posts the `n` requests staged from `head` in the QP's tables with one
/// `ibv_post_send` and commits what was posted: the queue's head, its last
/// signaled send (`last_sig`: one past the chunk's, 0 if none) and
/// `staged`, whose entries for requests not posted are taken back when it
/// drops.
///
/// # Safety
/// As [`post_send_chunk`]'s `core`, with no reference into it live; `n` in
/// `1..=POST_CHUNK` requests staged by [`stage_in_chunk`].
#[inline(always)]
unsafe fn post_staged_chunk(
    core: NonNull<QpCore>,
    head: u64,
    n: usize,
    last_sig: usize,
    staged: &mut StagedEntries,
) -> std::result::Result<(), ScopedListError> {
    // SAFETY: per the contract.
    let c = unsafe { &mut *core.as_ptr() };
    let Some(tables) = c.ext.scoped.as_deref_mut() else {
        unreachable!("checked above");
    };
    let wrs = tables.send_wrs.as_mut_ptr();
    // SAFETY: entry n - 1 was staged.
    unsafe { (*wrs.add(n - 1)).next = std::ptr::null_mut() };
    let mut bad = std::ptr::null_mut();
    // SAFETY: valid QP; a chain of n well-formed requests whose SGEs name
    // memory borrowed for 'scope (outliving every request posted in the
    // scope) and live in the QP's tables during the call.
    let rc = unsafe { c.post_send_chain(wrs, &mut bad) };
    if rc != 0 {
        // SAFETY: `wrs` heads the chain of `n` requests the provider refused
        // from `bad` on.
        return Err(unsafe { settle_refused_chunk(c, wrs, bad, head, n, rc, staged) });
    }
    c.sq_head = head + n as u64;
    staged.from = staged.to;
    if let (true, Some(t)) = (last_sig > 0, c.ext.scoped.as_deref_mut()) {
        t.sig_end = head + last_sig as u64;
    }
    Ok(())
}

/// The books after the provider refused a chunk from `bad` on. A provider
/// that did not say which may own some of them: count them all as posted, so
/// that the scope waits for (or flushes) them.
///
/// # Safety
/// `wrs` heads the chain of `n` staged requests just handed to the provider.
#[cold]
#[inline(never)]
unsafe fn settle_refused_chunk(
    c: &mut QpCore,
    wrs: *mut crate::ffi::ibv_send_wr,
    bad: *mut crate::ffi::ibv_send_wr,
    head: u64,
    n: usize,
    rc: i32,
    staged: &mut StagedEntries,
) -> ScopedListError {
    let ok = post::bad_index(bad, wrs, n).unwrap_or(n);
    c.sq_head = head + ok as u64;
    staged.from = head + ok as u64;
    // SAFETY: entries below n were staged.
    let sig = (0..ok)
        .rev()
        .find(|&j| unsafe { (*wrs.add(j)).send_flags } & SIGNALED != 0);
    if let (Some(j), Some(t)) = (sig, c.ext.scoped.as_deref_mut()) {
        t.sig_end = head + j as u64 + 1;
    }
    ScopedListError {
        posted: ok,
        error: Error::verb("ibv_post_send", errno(rc)),
    }
}

/// Side entries written for requests `from..to` of a chunk that are not
/// (yet) posted: taken back when dropped.
struct StagedEntries {
    core: NonNull<QpCore>,
    from: u64,
    to: u64,
}

impl Drop for StagedEntries {
    fn drop(&mut self) {
        if self.from == self.to {
            return;
        }
        // SAFETY: as in `post_send_chunk`; no other reference into the core
        // is live when the guard drops (after the chunk, or in an unwind
        // from the iterator).
        let c = unsafe { &mut *self.core.as_ptr() };
        if let Some(tables) = c.ext.scoped.as_deref_mut() {
            // SAFETY: the entries of staged requests, at or after the head.
            unsafe { PostedRange::unstage(tables.sq.as_mut_ptr(), &c.sq, self.from, self.to) };
        }
    }
}
