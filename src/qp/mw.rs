//! Memory-window requests on an RC send queue: BIND_MW (and type 1's
//! `ibv_bind_mw`), LOCAL_INV and SEND with invalidate.
//!
//! They go through the send queue's ring like every safe-path request, so
//! their completions carry valid tokens and retire in order with the rest;
//! each is signaled. A request naming a window holds the window (its
//! `Arc`) in a side table indexed by slot, with the request's sequence
//! number, as a UD send holds its address handle. Entries whose request
//! retired (behind the ring's tail) are let go of before each window post,
//! when the window's owner drops its `Mw`, and before the QP is destroyed;
//! the rest after it is destroyed.

use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError};

use super::queue::{self, WorkQueue};
use super::*;
use crate::error::Error;
use crate::ledger::ring::SlotMeta;
use crate::mr::{AccessFlags, Mr, RemoteMr};
use crate::mw::{BindPlan, Mw, MwInner, MwType, WindowHolder};

/// A window request's sequence number and the window it names.
type WindowEntry = Option<(u64, Arc<MwInner>)>;

/// The windows that window requests name, by send slot, each with its
/// request's sequence number. Shared with the windows (as their
/// [`WindowHolder`]), whose owner's drop lets go of the retired entries.
pub(super) struct WindowTable {
    /// The QP's send ring: the requests before its tail have retired.
    sq: Arc<Ring>,
    entries: Mutex<Box<[WindowEntry]>>,
    /// Windows of entries that a new request replaced before they were let
    /// go (a poll on another thread retired them after the post looked):
    /// let go with the next retired ones, never while a request is staged.
    replaced: Mutex<Vec<Arc<MwInner>>>,
}

impl WindowTable {
    fn new(sq: &Arc<Ring>) -> Arc<WindowTable> {
        Arc::new(WindowTable {
            sq: sq.clone(),
            entries: Mutex::new((0..sq.slot_count()).map(|_| None).collect()),
            replaced: Mutex::new(Vec::new()),
        })
    }

    fn replaced(&self) -> MutexGuard<'_, Vec<Arc<MwInner>>> {
        self.replaced.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn entries(&self) -> MutexGuard<'_, Box<[WindowEntry]>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes out the entries that `drop_if` picks by sequence number, to be
    /// dropped after the lock (a window's last reference may drop an
    /// application's memory, whose `Drop` could come back here).
    fn take_where(&self, drop_if: impl Fn(u64) -> bool) -> Vec<Arc<MwInner>> {
        let mut taken: Vec<Arc<MwInner>> = self
            .entries()
            .iter_mut()
            .filter(|e| e.as_ref().is_some_and(|(seq, _)| drop_if(*seq)))
            .filter_map(|e| e.take().map(|(_, w)| w))
            .collect();
        taken.append(&mut self.replaced());
        taken
    }

    /// Lets go of every window, the QP destroyed (a panicking `Drop` of a
    /// window's memory contained).
    pub(super) fn release_all(&self) {
        for w in self.take_where(|_| true) {
            drop_window_catching(Some(w));
        }
    }

    /// How many entries hold `mw` (for tests).
    #[cfg(test)]
    pub(super) fn holding(&self, mw: &Arc<MwInner>) -> usize {
        let entries = self.entries();
        entries
            .iter()
            .filter(|e| e.as_ref().is_some_and(|(_, w)| Arc::ptr_eq(w, mw)))
            .count()
    }
}

impl WindowTable {
    /// Lets go of the windows whose requests retired (behind the ring's
    /// tail), each drop caught: the first panic of a window's memory's `Drop`
    /// is returned once all are dropped.
    fn release_retired_catching(&self) -> Option<Box<dyn std::any::Any + Send>> {
        let tail = self.sq.tail();
        let mut caught = None;
        for w in self.take_where(|seq| seq < tail) {
            let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(w)));
            if let Err(p) = dropped {
                caught.get_or_insert(p);
            }
        }
        caught
    }
}

impl WindowHolder for WindowTable {
    /// For an `Mw`'s drop and the QP's: a panic is contained.
    fn release_retired(&self) {
        let _ = self.release_retired_catching();
    }
}

/// Lets go of a window a request named. The last reference to a window
/// holds its region, whose memory may be the application's (`OwnedMemory`)
/// with a `Drop` that panics: the panic is contained, as a posted buffer's
/// is when the QP is destroyed, so that it cannot leave the QP's destructor
/// (or an `Mw`'s) before `ibv_destroy_qp`.
pub(super) fn drop_window_catching(entry: Option<Arc<MwInner>>) {
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(entry)));
}

/// What a window request does.
enum WindowOp {
    /// BIND_MW of `mw` to `plan`, giving it `rkey` (type 2; a type 1
    /// window's provider picks its own in `ibv_bind_mw`).
    Bind {
        mw: *mut ffi::ibv_mw,
        rkey: u32,
        plan: BindPlan,
    },
    /// LOCAL_INV of `rkey`.
    LocalInv { rkey: u32 },
    /// SEND of the buffers, invalidating the peer's `rkey`.
    SendInv { rkey: u32 },
}

/// A window request on its way into the send ring.
struct WindowWr {
    wr_id: u64,
    op: WindowOp,
    bufs: Sges,
    /// The window the request names, held until its slot is reused.
    keep: Option<Arc<MwInner>>,
}

/// The send queue, for window requests.
struct WindowQueue;

impl WorkQueue for WindowQueue {
    type Wr = WindowWr;
    type CWr = ffi::ibv_send_wr;

    fn ring_and_head(core: &mut QpCore) -> (&Ring, &mut u64) {
        (&core.sq, &mut core.sq_head)
    }

    fn validate(core: &QpCore, wr: &WindowWr) -> Result<(), Error> {
        let n = wr.bufs.len() + wr.bufs.overflow();
        let max = (core.caps.max_send_sge as usize).min(MAX_SAFE_SGES);
        if n > max {
            return Err(Error::TooManySges { requested: n, max });
        }
        wr.bufs.check_lengths()?;
        wr.bufs.check_pd(&core.pd)
    }

    fn write_c(
        _core: &QpCore,
        wr: &WindowWr,
        c: &mut MaybeUninit<ffi::ibv_send_wr>,
        sges: &mut [MaybeUninit<ffi::ibv_sge>],
        _last_slot: bool,
    ) -> (*mut ffi::ibv_send_wr, SlotMeta) {
        let c = c.write(ffi::ibv_send_wr {
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        });
        match &wr.op {
            WindowOp::Bind { mw, rkey, plan } => {
                c.opcode = ffi::IBV_WR_BIND_MW;
                c.__bindgen_anon_2.bind_mw = ffi::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 {
                    mw: *mw,
                    rkey: *rkey,
                    bind_info: ffi::ibv_mw_bind_info {
                        mr: plan.mr,
                        addr: plan.addr,
                        length: plan.len,
                        mw_access_flags: plan.access.bits(),
                    },
                };
            }
            WindowOp::LocalInv { rkey } => {
                c.opcode = ffi::IBV_WR_LOCAL_INV;
                c.__bindgen_anon_1.invalidate_rkey = *rkey;
            }
            WindowOp::SendInv { rkey } => {
                c.opcode = ffi::IBV_WR_SEND_WITH_INV;
                c.__bindgen_anon_1.invalidate_rkey = *rkey;
                c.num_sge = post::fill_sges(&wr.bufs, sges);
            }
        }
        let meta = SlotMeta {
            opcode: c.opcode,
            signaled: true,
            drain: false,
        };
        (c, meta)
    }

    fn id_and_bufs(wr: &WindowWr) -> (u64, *const Sges) {
        (wr.wr_id, &raw const wr.bufs)
    }

    fn into_parts(wr: WindowWr) -> (u64, Sges) {
        (wr.wr_id, wr.bufs)
    }

    unsafe fn post(
        core: &QpCore,
        head: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        // SAFETY: `head` is the one request `write_c` wrote (window requests
        // are posted one at a time); its bind_mw member is the valid one for
        // BIND_MW, and its `mw` a live window (the request holds it).
        let type1_bind = unsafe {
            let w = &*head;
            if w.opcode == ffi::IBV_WR_BIND_MW {
                let b = w.__bindgen_anon_2.bind_mw;
                ((*b.mw).type_ == ffi::IBV_MW_TYPE_1).then_some((w.wr_id, w.send_flags, b))
            } else {
                None
            }
        };
        let Some((wr_id, send_flags, b)) = type1_bind else {
            // SAFETY: a well-formed chain of one; the caller keeps its
            // buffers in the ring until the completion.
            return unsafe { core.post_send_chain(head, bad) };
        };
        let mut bind = ffi::ibv_mw_bind {
            wr_id,
            send_flags,
            bind_info: b.bind_info,
        };
        // SAFETY: live QP and window (the request holds it); the region
        // named in bind_info is held by the window until it is deallocated.
        match verb!(rc: unsafe { ffi::ibv_bind_mw(core.raw.as_ptr(), b.mw, &mut bind) }) {
            Ok(()) => 0,
            // `*bad` stays null: providers post the bind as a send request
            // (rxe's `rxe_bind_mw` through `rxe_post_send`, whose doorbell
            // can fail with the request queued), so an error does not say
            // that nothing was posted; the slot stays counted.
            Err(failed) => failed.errno().unwrap_or(libc::EINVAL),
        }
    }

    unsafe fn staged(core: &mut QpCore, seq: u64, wr: &WindowWr) {
        // SAFETY: the caller forgets `wr`, so the Arc moves out exactly once.
        let Some(keep) = (unsafe { std::ptr::read(&wr.keep) }) else {
            return;
        };
        let table = core
            .ext
            .windows
            .get_or_insert_with(|| WindowTable::new(&core.sq));
        let holder: Arc<dyn WindowHolder> = table.clone();
        keep.held_by(Arc::downgrade(&holder));
        // The previous occupant of the slot retired (the ring holds fewer
        // requests than it has slots) and was let go before the post
        // (`release_retired_windows`), unless a poll on another thread
        // retired it since, or a refused request left it: then it is kept
        // aside, since nothing may be dropped here, while the request is
        // half staged.
        let old = table.entries()[core.sq.index(seq)].replace((seq, keep));
        if let Some((_, w)) = old {
            table.replaced().push(w);
        }
    }
}

/// Lets go of the windows that retired requests named, before a window
/// request is posted. The last reference to a window holds its region, whose
/// memory may be the application's (`OwnedMemory`) with a `Drop` that panics;
/// here nothing is staged yet, so such a panic reaches the caller with the
/// queue as it was, where it would otherwise unwind through a request half
/// staged.
fn release_retired_windows(core: &mut QpCore) {
    let caught = core
        .ext
        .windows
        .as_ref()
        .and_then(|t| t.release_retired_catching());
    if let Some(panic) = caught {
        std::panic::resume_unwind(panic);
    }
}

impl WindowWr {
    fn new(wr_id: u64, op: WindowOp, keep: Option<Arc<MwInner>>) -> WindowWr {
        WindowWr {
            wr_id,
            op,
            bufs: Sges::default(),
            keep,
        }
    }
}

/// A request refused before it reached the queue.
#[cold]
fn refused(wr_id: u64, error: Error) -> PostError {
    PostError {
        error,
        unposted: vec![(wr_id, Sges::default())],
    }
}

fn wrong_type(mw: &Mw, what: &str) -> Error {
    Error::InvalidArgument {
        what: "memory window type",
        reason: format!(
            "{what} takes a {} window; this one is {:?}",
            match mw.mw_type() {
                MwType::Type1 => "type 2",
                MwType::Type2 => "type 1",
            },
            mw.mw_type()
        ),
    }
}

fn not_bound() -> Error {
    Error::InvalidArgument {
        what: "memory window",
        reason: "the window is not bound (or its revocation was posted already): bind it with \
                 post_bind_mw first"
            .into(),
    }
}

impl<S: QpState> Qp<Rc, S> {
    /// Binds `mw` to `range` of `mr` (offsets into the `Mr`), granting
    /// `access` (REMOTE_READ, REMOTE_WRITE, REMOTE_ATOMIC): a BIND_MW work
    /// request for a type 2 window, `ibv_bind_mw` for a type 1 window; both
    /// complete on the send CQ with `wr_id` and
    /// [`WcOpcode::BindMw`](crate::cq::WcOpcode::BindMw).
    ///
    /// Returns what the peer needs (address, length and the window's new
    /// rkey); its accesses succeed once the completion was polled with
    /// `Success`. From now on the window holds the region, which stays
    /// registered and allocated until the window is dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] before anything is posted when the range
    /// is not inside `mr`, `access` asks for more than a window grants or
    /// the region allows, the region lacks [`AccessFlags::MW_BIND`], or the
    /// window, region and QP are not in one PD.
    #[doc(alias("ibv_bind_mw", "IBV_WR_BIND_MW", "ibv_wr_bind_mw"))]
    pub fn post_bind_mw(
        &mut self,
        wr_id: u64,
        mw: &mut Mw,
        mr: &Mr,
        range: Range<usize>,
        access: AccessFlags,
    ) -> Result<RemoteMr, PostError>
    where
        S: CanPostSend,
    {
        let len = range.end.checked_sub(range.start).ok_or_else(|| {
            let reason = format!("range {range:?} ends before it starts");
            refused(
                wr_id,
                Error::InvalidArgument {
                    what: "window range",
                    reason,
                },
            )
        })?;
        let plan = mw
            .plan_bind(&self.core.pd, mr, range.start, len, access)
            .map_err(|e| refused(wr_id, e))?;
        self.post_bind_plan(wr_id, mw, plan)?;
        Ok(mw.remote().unwrap_or_default())
    }

    /// Revokes a type 1 window: a zero-length bind (`ibv_bind_mw(3)`),
    /// completing with [`WcOpcode::BindMw`](crate::cq::WcOpcode::BindMw).
    /// Type 1 windows cannot be invalidated; type 2 windows use
    /// [`post_local_inv`](Qp::post_local_inv).
    #[doc(alias = "ibv_bind_mw")]
    pub fn post_unbind_mw(&mut self, wr_id: u64, mw: &mut Mw) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        if mw.mw_type() != MwType::Type1 {
            return Err(refused(wr_id, wrong_type(mw, "post_unbind_mw")));
        }
        let plan = mw.last_plan().ok_or_else(|| refused(wr_id, not_bound()))?;
        self.post_bind_plan(wr_id, mw, plan)
    }

    fn post_bind_plan(&mut self, wr_id: u64, mw: &mut Mw, plan: BindPlan) -> Result<(), PostError> {
        let type1 = mw.mw_type() == MwType::Type1;
        let rkey = mw.next_rkey();
        let (addr, len, access, mr) = (plan.addr, plan.len, plan.access, plan.mr);
        let op = WindowOp::Bind {
            mw: mw.as_raw(),
            rkey,
            plan,
        };
        release_retired_windows(&mut self.core);
        let wr = WindowWr::new(wr_id, op, Some(mw.shared().clone()));
        queue::post_one::<WindowQueue>(&mut self.core, wr).map_err(|mut e| {
            if let (true, Error::Verb { verb, source, .. }) = (type1, &mut e.error) {
                if *verb == "ibv_post_send" {
                    let source = std::mem::replace(source, std::io::Error::other(""));
                    e.error = Error::verb("ibv_bind_mw", source);
                }
            }
            e
        })?;
        mw.bind_posted(
            &BindPlan {
                mr,
                addr,
                len,
                access,
            },
            rkey,
        );
        Ok(())
    }

    /// Revokes a type 2 window: a LOCAL_INV work request for its rkey,
    /// completing on the send CQ with `wr_id` and
    /// [`WcOpcode::LocalInv`](crate::cq::WcOpcode::LocalInv). Once it
    /// completed, a peer's access through the window fails with
    /// `REM_ACCESS_ERR`; the window can then be bound again.
    #[doc(alias("IBV_WR_LOCAL_INV", "ibv_wr_local_inv"))]
    pub fn post_local_inv(&mut self, wr_id: u64, mw: &mut Mw) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        if mw.mw_type() != MwType::Type2 {
            return Err(refused(wr_id, wrong_type(mw, "post_local_inv")));
        }
        if mw.remote().is_none() {
            return Err(refused(wr_id, not_bound()));
        }
        let op = WindowOp::LocalInv { rkey: mw.rkey() };
        release_retired_windows(&mut self.core);
        let wr = WindowWr::new(wr_id, op, Some(mw.shared().clone()));
        queue::post_one::<WindowQueue>(&mut self.core, wr)?;
        mw.revoke_posted();
        Ok(())
    }

    /// A SEND of `bufs` that also invalidates the peer's window `rkey`
    /// (SEND_WITH_INV): the peer's receive completion reports the rkey
    /// ([`Completion::invalidated_rkey`](crate::cq::Completion::invalidated_rkey))
    /// and the window grants nothing from then on. The buffers come back with
    /// the completion, as [`post_send`](Qp::post_send)'s do. Only type 2
    /// windows can be invalidated; the peer's device fails the receive
    /// otherwise. (rxe reports the receive without `IBV_WC_WITH_INV`, so no
    /// rkey there: see `docs/soundness.md`.)
    #[doc(alias("IBV_WR_SEND_WITH_INV", "ibv_wr_send_inv"))]
    pub fn post_send_inv(&mut self, wr_id: u64, bufs: Sges, rkey: u32) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        let mut wr = WindowWr::new(wr_id, WindowOp::SendInv { rkey }, None);
        wr.bufs = bufs;
        queue::post_one::<WindowQueue>(&mut self.core, wr)
    }
}
