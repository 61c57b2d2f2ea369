//! Prepared lists of scoped requests: [`PreparedSends`], and the steps of
//! posting one with [`ScopedQp::post_prepared`](super::ScopedQp::post_prepared).

use std::cell::UnsafeCell;
use std::marker::PhantomData;

use super::side_table::PostedRange;
use super::{SIGNALED, ScopedSend};
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::ring::{Ring, SlotMeta};
use crate::qp::QpCore;
use crate::qp::post;
use crate::qp::send_ex::{Request, SendEx};

/// A list of scoped send requests checked and laid out once (as a C chain
/// and in the extended send API's form), to be posted many times, each time
/// with one doorbell (the chained post lists of perftest's `-l`). Posting
/// gives each request its token as the `wr_id` and, for
/// a list whose requests share one operation, a single side entry for the
/// whole list; the requests' buffers, remote ranges, operands and signaled
/// flags stay as prepared.
///
/// The list may be longer than 32 (one doorbell for all of it) but not
/// longer than the send queue. Its buffers stay borrowed while it exists, so
/// it can be built before the scope and posted in it.
pub struct PreparedSends<'scope> {
    /// The C chain (`next` links it; each `sg_list` points into `sges`).
    /// Written only during a post, on the thread that owns the list (it is
    /// not `Sync`: it holds raw pointers).
    wrs: UnsafeCell<Box<[ffi::ibv_send_wr]>>,
    /// One SGE per request; never read by Rust after construction.
    _sges: Box<[ffi::ibv_sge]>,
    /// Each request's completion opcode (`IBV_WC_*`) and prepared flags.
    ops: Box<[(u32, u32)]>,
    /// The completion opcode every request shares, if they do: then a post
    /// keeps one side entry for the whole list.
    uniform: Option<u32>,
    /// The requests in the builders' form, for QPs with the extended send
    /// API (their `wr_id`s unused); written during a post like `wrs`.
    requests: UnsafeCell<Box<[Request]>>,
    /// The work request opcode every request shares, if they do.
    uniform_wr: Option<u32>,
    /// One past the index of the last signaled request, 0 if none (see
    /// `post_prepared`).
    sig_end: u32,
    _borrow: PhantomData<&'scope [u8]>,
}

impl<'scope> PreparedSends<'scope> {
    /// Checks and lays out `reqs` (their `wr_id`s are ignored: see
    /// [`ScopedQp::post_prepared`](super::ScopedQp::post_prepared)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list, else the error the
    /// first bad request would get when posted alone
    /// ([`Error::RemoteOutOfBounds`], [`Error::InvalidArgument`]).
    pub fn new(
        reqs: impl IntoIterator<Item = ScopedSend<'scope>>,
    ) -> Result<PreparedSends<'scope>> {
        let reqs: Vec<ScopedSend<'scope>> = reqs.into_iter().collect();
        if reqs.is_empty() {
            return Err(Error::InvalidArgument {
                what: "prepared list",
                reason: "has no request".into(),
            });
        }
        if let Some(bad) = reqs.iter().find(|r| !r.plainly_valid()) {
            return Err(bad.refusal());
        }
        if u32::try_from(reqs.len()).is_err() {
            return Err(Error::InvalidArgument {
                what: "prepared list",
                reason: format!("{} requests exceed any send queue", reqs.len()),
            });
        }
        let mut sges: Box<[ffi::ibv_sge]> = reqs.iter().map(|r| r.sge).collect();
        let mut wrs: Box<[ffi::ibv_send_wr]> =
            vec![ffi::ibv_send_wr::default(); reqs.len()].into_boxed_slice();
        let n = reqs.len();
        let (wp, sp) = (wrs.as_mut_ptr(), sges.as_mut_ptr());
        for (j, r) in reqs.iter().enumerate() {
            // SAFETY: j < n, the length of both boxed slices, whose heap
            // storage never moves while the list exists.
            unsafe {
                r.fill(&mut *wp.add(j), 0, r.flags, sp.add(j));
                (*wp.add(j)).next = if j + 1 < n {
                    wp.add(j + 1)
                } else {
                    std::ptr::null_mut()
                };
            }
        }
        let ops: Box<[(u32, u32)]> = reqs
            .iter()
            .map(|r| (SlotMeta::completion_opcode_of(r.opcode), r.flags))
            .collect();
        let first = ops[0].0;
        let requests: Box<[Request]> = reqs.iter().map(|r| r.ex_request(0, r.flags)).collect();
        let first_wr = reqs[0].opcode;
        Ok(PreparedSends {
            requests: UnsafeCell::new(requests),
            uniform_wr: reqs
                .iter()
                .all(|r| r.opcode == first_wr)
                .then_some(first_wr),
            wrs: UnsafeCell::new(wrs),
            _sges: sges,
            uniform: ops.iter().all(|&(op, _)| op == first).then_some(first),
            // n fits in u32 (checked above).
            sig_end: ops
                .iter()
                .rposition(|&(_, flags)| flags & SIGNALED != 0)
                .map_or(0, |j| j as u32 + 1),
            ops,
            _borrow: PhantomData,
        })
    }

    /// How many requests one post of the list makes.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Always false: a prepared list has at least one request.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Whether request `j` asks for a completion when it succeeds.
    ///
    /// # Panics
    /// If `j` is not below [`len`](Self::len).
    pub fn is_signaled(&self, j: usize) -> bool {
        self.ops[j].1 & SIGNALED != 0
    }

    /// Each request's completion opcode (`IBV_WC_*`) and prepared flags,
    /// in order: one entry per request of the chain.
    pub(super) fn ops(&self) -> &[(u32, u32)] {
        &self.ops
    }

    /// The completion opcode every request shares, if they do.
    pub(super) fn uniform_opcode(&self) -> Option<u32> {
        self.uniform
    }

    /// The C chain, for one post call.
    ///
    /// # Safety
    /// No other reference to the chain may be live: the caller is the
    /// post call on the list's thread, which does not re-enter.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn chain(&self) -> &mut [ffi::ibv_send_wr] {
        // SAFETY: the caller guarantees exclusivity (see above).
        unsafe { &mut *self.wrs.get() }
    }

    /// The requests in the builders' form, for one post call.
    ///
    /// # Safety
    /// As [`chain`](PreparedSends::chain).
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn requests(&self) -> &mut [Request] {
        // SAFETY: the caller guarantees exclusivity (see above).
        unsafe { &mut *self.requests.get() }
    }

    /// The work request opcode every request shares, if they do.
    pub(super) fn uniform_wr_opcode(&self) -> Option<u32> {
        self.uniform_wr
    }

    /// The prepared flags of request `j`.
    pub(super) fn flags(&self, j: usize) -> u32 {
        self.ops[j].1
    }

    /// One past the index of the list's last signaled request (0: none).
    #[inline(always)]
    pub(super) fn sig_end(&self) -> u64 {
        u64::from(self.sig_end)
    }
}

impl std::fmt::Debug for PreparedSends<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedSends")
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

/// Writes the side entries of `list` posted from `head`: one range for a
/// list whose requests share an opcode, else one entry per request (see
/// [`PostedRange`]).
///
/// # Safety
/// `side` has `ring.slot_count()` entries and no other reference to it is
/// live; `list` fits in the free slots from `head`.
#[inline(always)]
pub(super) unsafe fn stage_prepared(
    side: *mut PostedRange,
    ring: &Ring,
    list: &PreparedSends<'_>,
    head: u64,
    first_wr_id: u64,
) {
    let n = list.len() as u64;
    match list.uniform_opcode() {
        // One side entry for the whole list (see `PostedRange`).
        // SAFETY: `index` masks with the ring's slot count, the table's length.
        Some(wc_opcode) => unsafe {
            *side.add(ring.index(head)) = PostedRange {
                wr_id: first_wr_id,
                seq: head,
                wc_opcode,
                len: n as u32,
            };
        },
        None => {
            for (j, &(wc_opcode, _)) in list.ops().iter().enumerate() {
                let seq = head + j as u64;
                // SAFETY: as above.
                unsafe {
                    *side.add(ring.index(seq)) = PostedRange {
                        wr_id: first_wr_id.wrapping_add(j as u64),
                        seq,
                        wc_opcode,
                        len: 1,
                    };
                }
            }
        }
    }
}

/// Posts `list` with the extended send API in one critical region, request
/// `j` with the token `tag | (low + j)` and the last one signaled if
/// `force`. Returns what [`SendEx::post_list`] returns: `None` when a
/// request has no builder (nothing posted), else the verb's result.
///
/// # Safety
/// `ex` is the extended interface of the QP the list is posted on.
#[inline(always)]
pub(super) unsafe fn post_prepared_ex(
    ex: &SendEx,
    list: &PreparedSends<'_>,
    force: bool,
    tag: u64,
    low: u32,
) -> Option<i32> {
    let last = list.len() - 1;
    // SAFETY: this call is the only user of the list's requests (the list is
    // not Sync and no user code runs until it returns).
    let reqs = unsafe { list.requests() };
    if force {
        reqs[last].flags |= SIGNALED;
    }
    // SAFETY: requests checked when the list was built, whose SGEs name
    // memory borrowed for at least 'scope, which outlives every request
    // posted in the scope; ex is the QP's extended interface (contract).
    let rc = unsafe { ex.post_list(reqs, list.uniform_wr_opcode(), tag, low) };
    if force {
        reqs[last].flags = list.flags(last);
    }
    rc
}

/// Posts `list`'s C chain with one `ibv_post_send`, request `j` with the
/// token `tag | (low + j)`, the last one signaled if `force` and every one
/// carrying the flags `fence` (the QP's `ScopedTables::fence`). When the
/// provider refuses it: its error code and the index of the first request
/// refused (`None` when it does not say).
///
/// # Safety
/// `core` is the core of a QP attached to the scope the list is posted in.
#[inline(always)]
pub(super) unsafe fn post_prepared_chain(
    core: &QpCore,
    list: &PreparedSends<'_>,
    force: bool,
    fence: u32,
    tag: u64,
    low: u32,
) -> std::result::Result<(), (i32, Option<usize>)> {
    let last = list.len() - 1;
    // SAFETY: as for the requests in `post_prepared_ex`.
    let wrs = unsafe { list.chain() };
    for (j, wr) in wrs.iter_mut().enumerate() {
        wr.wr_id = tag | u64::from(low.wrapping_add(j as u32));
    }
    if force {
        wrs[last].send_flags |= SIGNALED;
    }
    if fence != 0 {
        set_fence(wrs, fence);
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: valid QP; a chain of well-formed requests (checked when the
    // list was built) whose SGEs name memory borrowed for at least 'scope,
    // which outlives every request posted in the scope.
    let rc = unsafe { core.post_send_chain(wrs.as_mut_ptr(), &mut bad) };
    if fence != 0 {
        restore_all_flags(wrs, list);
    } else if force {
        wrs[last].send_flags = list.flags(last);
    }
    if rc != 0 {
        return Err((rc, post::bad_index(bad, wrs.as_mut_ptr(), wrs.len())));
    }
    Ok(())
}

/// Adds `fence` to every request but the READs of a chain about to be posted
/// (iWARP only: see `ScopedTables::fence`).
#[cold]
#[inline(never)]
fn set_fence(wrs: &mut [ffi::ibv_send_wr], fence: u32) {
    for wr in wrs
        .iter_mut()
        .filter(|wr| wr.opcode != ffi::IBV_WR_RDMA_READ)
    {
        wr.send_flags |= fence;
    }
}

/// Every request's flags as the list was built (after a fence was added).
#[cold]
#[inline(never)]
fn restore_all_flags(wrs: &mut [ffi::ibv_send_wr], list: &PreparedSends<'_>) {
    for (j, wr) in wrs.iter_mut().enumerate() {
        wr.send_flags = list.flags(j);
    }
}

/// Commits what a refused `ibv_post_send` of `list` (posted from `head`)
/// did post: the requests before `ok`, the first refused one, or all of
/// them when the provider did not say which it refused (it may own some:
/// the scope then waits for, or flushes, them all). `sig_end` is the QP's
/// last signaled send before the post.
///
/// # Safety
/// `side` is `core`'s send side table, with `list`'s entries from `head`
/// written by [`stage_prepared`]; no other reference to it is live.
#[cold]
#[inline(never)]
pub(super) unsafe fn settle_refused_prepared(
    core: &mut QpCore,
    side: *mut PostedRange,
    list: &PreparedSends<'_>,
    head: u64,
    sig_end: u64,
    ok: Option<usize>,
) {
    let ring = &*core.sq;
    let n = list.len();
    match ok {
        // The list's range covers the posted requests only.
        // SAFETY: `index` masks with the ring's slot count, the table's length.
        Some(ok) if ok > 0 && list.uniform_opcode().is_some() => unsafe {
            (*side.add(ring.index(head))).len = ok as u32;
        },
        // SAFETY: the entries written for the refused ones.
        Some(ok) => unsafe { PostedRange::unstage(side, ring, head + ok as u64, head + n as u64) },
        None => {}
    }
    let posted = ok.unwrap_or(n);
    core.sq_head = head + posted as u64;
    if posted < n {
        let sig = (0..posted).rev().find(|&j| list.is_signaled(j));
        if let Some(t) = core.ext.scoped.as_deref_mut() {
            t.sig_end = sig.map_or(sig_end, |j| head + j as u64 + 1);
        }
    }
}
