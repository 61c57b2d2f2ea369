//! `Cq`: completion queues, and the completions that hand buffers back.
//!
//! Polling a completion of a work request posted through the safe path
//! returns the buffers that request owned (see [`crate::qp`] for the design).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::channel::{CompletionChannel, CqEvents};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::table::{Reservation, RingCache, RingTable};
use crate::sys::call::{VerbFailure, verb};

mod completion;
mod notify;
mod poll;

pub use crate::values::{WcOpcode, WcStatus};
pub use completion::{Completion, CompletionSource};
pub(crate) use poll::{POLL_BATCH, make_room, poll_exactly, poll_in_batches};

/// A completion queue (`ibv_cq`).
///
/// Not `Clone`: polling needs `&mut self`, which makes the poller the single
/// consumer of the completions of every QP attached to it. QPs keep the
/// underlying CQ alive, so it is destroyed after the last of them.
///
/// A QP is only created on a CQ that can hold every completion its queues
/// may produce together with those of the other queues already on it, so
/// the CQ cannot overrun through the safe path. A CQ too small for a new
/// QP's queues grows (`ibv_resize_cq`) to take them, doubling at least, up
/// to the device's `max_cqe`; only where the provider cannot resize, the
/// device's limit is reached, or growing is turned off
/// ([`set_auto_grow`](Cq::set_auto_grow)), is the QP refused
/// ([`Error::CqTooSmall`]). [`depth`](Cq::depth) reports the depth it has now.
#[doc(alias = "ibv_cq")]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
    /// The poller's copy of the ring table (see [`crate::qp`]).
    cache: RingCache,
    /// Completions a [`scope`](Cq::scope) polled that were not its own,
    /// handed out first by the next poll.
    pending: Vec<Completion>,
    /// Completions lost to [`Cq::poll_raw`] that a `poll_one` found along
    /// with the completion it returned: reported by the next poll.
    lost_unreported: u64,
}

impl Drop for Cq {
    fn drop(&mut self) {
        // Completions a scope kept for the next poll carry buffers, whose
        // `Drop` (an application's `OwnedMemory`) may panic: contained, one
        // by one, as the QP's destructor does. `inner` drops after this.
        for c in std::mem::take(&mut self.pending) {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(c)));
        }
    }
}

pub(crate) struct CqInner {
    raw: NonNull<ffi::ibv_cq>,
    /// The device's `max_cqe`: the CQ never grows past it.
    max_cqe: u32,
    /// Whether a QP whose queues do not fit grows the CQ (see [`Cq::set_auto_grow`]).
    auto_grow: AtomicBool,
    /// The slot rings whose completions this CQ carries, and the entries they reserve.
    pub(crate) rings: RingTable,
    /// Completion events read and not yet acknowledged; its address is the
    /// CQ's `cq_context` (see [`crate::channel`]). `Some` iff `channel` is.
    /// (An `Arc`, not a `Box`: moving a `Box` would assert uniqueness and
    /// invalidate the pointer the kernel hands back.)
    pub(crate) events: Option<Arc<CqEvents>>,
    /// Dropped after the CQ is destroyed: the channel outlives its CQs.
    pub(crate) channel: Option<CompletionChannel>,
    _ctx: Context,
}

// SAFETY: ibv_cq may be used from any thread; polling is serialised by &mut Cq.
unsafe impl Send for CqInner {}
// SAFETY: through &CqInner other threads reach: QP creation and destruction
// (the mutex-protected ring table), the event counter (atomics, see
// crate::channel), the channel (itself Sync), `ibv_req_notify_cq` through
// `&Cq`, under the channel's arm lock (apart from other arms, the channel's
// event reads and resizes: mlx5 arms without the CQ lock), and
// `ibv_resize_cq` (QP creation, `Cq::resize`),
// which runs with the ring table locked, so never two at once, and which
// providers serialise with polling under the same CQ lock (rxe and mlx5
// take it around the whole resize and the whole poll; docs/soundness.md,
// "Provider assumptions"). Polling itself needs `&mut Cq`.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Some(events) = self.events.as_deref() {
            // ibv_destroy_cq waits until every event read from the channel is
            // acknowledged: ack the counted ones; readers racing with us see the
            // closing flag and ack their own (see crate::channel).
            let n = events.close();
            if n > 0 {
                // SAFETY: valid CQ; n events were read and not yet acknowledged.
                unsafe { ffi::ibv_ack_cq_events(self.raw.as_ptr(), n) };
            }
        }
        // SAFETY: every QP using this CQ holds an Arc to it, so none is left.
        let rc = unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
        if rc != 0 {
            // The CQ survives (a QP still uses it): keep everything it may reach.
            self.rings.leak();
            std::mem::forget(self.events.take());
            std::mem::forget(self.channel.take());
            return;
        }
        if let Some(ch) = &self.channel {
            ch.inner.detach();
        }
    }
}

impl CqInner {
    pub(crate) fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }

    /// Sets aside room for `n` completions of a `queue` queue (see
    /// [`RingTable::reserve`]), growing the CQ when they do not fit: to
    /// twice its depth or what they need, whichever is more, within the
    /// device's `max_cqe` (doubling keeps a CQ that many QPs join from being
    /// resized for each). Refused with [`Error::CqTooSmall`] where the
    /// provider cannot resize a CQ or the device's limit is too low.
    pub(crate) fn reserve(&self, n: u64, queue: &'static str) -> Result<Reservation<'_>> {
        self.rings.reserve(n, queue, |want, depth| {
            let max = u64::from(self.max_cqe);
            if want > max || !self.auto_grow.load(Ordering::Relaxed) {
                return Ok(None);
            }
            match self.resize_locked(want.max(depth.saturating_mul(2)).min(max)) {
                Ok(depth) => Ok(Some(depth.into())),
                Err(f) if matches!(f.errno(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) => Ok(None),
                Err(f) => Err(f.into()),
            }
        })
    }

    /// `ibv_resize_cq` to at least `depth` entries, returning the depth the
    /// provider gave the CQ. Called with the ring table locked (the only
    /// callers are [`RingTable::reserve`]'s and [`RingTable::resize`]'s
    /// closures), so no two resizes overlap and the table's depth is set
    /// from the result before anyone reserves against it. `depth` is at
    /// least the entries reserved, so at least the completions the CQ may
    /// hold now, as `ibv_resize_cq` requires.
    fn resize_locked(&self, depth: u64) -> std::result::Result<u32, VerbFailure> {
        let cqe = i32::try_from(depth).unwrap_or(i32::MAX);
        // An arm (mlx5 reads the consumer index without the CQ lock) waits.
        let _arm = self.channel.as_ref().map(|c| c.inner.arm_lock());
        // SAFETY: the CQ is live (self owns it); no other resize runs (the
        // table is locked) and no arm or event read of its channel (`_arm`);
        // a poll running on another thread meets the provider's CQ lock,
        // which it holds around the whole resize (rxe `rxe_resize_cq`, mlx5
        // `mlx5_resize_cq`), and the provider moves the completions already
        // in the CQ to the new queue.
        verb!(rc: unsafe { ffi::ibv_resize_cq(self.as_raw(), cqe) })?;
        // SAFETY: the CQ is live; `cqe` was written by the resize that just
        // returned on this thread (no other runs, see above), and the
        // provider may have rounded it up.
        let actual = unsafe { (*self.as_raw()).cqe };
        // What the provider reports, even below what was asked: the books
        // must never count entries the CQ does not have.
        Ok(u32::try_from(actual).unwrap_or(0))
    }
}

impl Cq {
    /// Creates a CQ with room for at least `depth` completions (`ibv_create_cq`).
    ///
    /// A depth above the device's `max_cqe` is refused before calling the
    /// kernel. Size it for every QP that will use it: each queue needs as
    /// many entries as its depth (`max_send_wr` / `max_recv_wr`).
    #[doc(alias = "ibv_create_cq")]
    pub fn new(ctx: &Context, depth: u32) -> Result<Cq> {
        Cq::create(ctx, depth, None)
    }

    /// `ibv_create_cq`, on `channel` if given (see [`Cq::with_channel`]).
    pub(crate) fn create(
        ctx: &Context,
        depth: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<Cq> {
        let max = ctx.query_device()?.max_cqe;
        if depth == 0 || i64::from(depth) > i64::from(max) {
            return Err(Error::InvalidArgument {
                what: "CQ depth",
                reason: format!("{depth} is outside 1..={max} (the device's max_cqe)"),
            });
        }
        let events = channel.map(|_| Arc::new(CqEvents::new()));
        let cq_context = events.as_ref().map_or(std::ptr::null_mut(), |e| {
            Arc::as_ptr(e) as *mut libc::c_void
        });
        let channel_raw = channel.map_or(std::ptr::null_mut(), |c| c.as_raw());
        // SAFETY: valid context and channel (same device, checked by the caller);
        // cq_context points to the shared counter, which this CqInner holds and
        // frees only after ibv_destroy_cq; vector 0.
        let raw = verb!(ptr: unsafe {
            ffi::ibv_create_cq(ctx.as_raw(), depth as i32, cq_context, channel_raw, 0)
        })
        .map_err(|f| ctx.explain_queue_refusal(f.into()))?;
        if let Some(ch) = channel {
            ch.inner.attach();
        }
        // SAFETY: raw is valid; cqe is the actual depth the provider chose.
        let actual = unsafe { (*raw.as_ptr()).cqe };
        let depth = u32::try_from(actual).unwrap_or(depth);
        Ok(Cq {
            inner: Arc::new(CqInner {
                raw,
                max_cqe: u32::try_from(max).unwrap_or(depth).max(depth),
                auto_grow: AtomicBool::new(true),
                rings: RingTable::new(depth),
                events,
                channel: channel.cloned(),
                _ctx: ctx.clone(),
            }),
            cache: RingCache::default(),
            pending: Vec::new(),
            lost_unreported: 0,
        })
    }

    /// Another handle on the CQ of `inner`, with an empty poller state of its
    /// own, to be lent out as `&Cq` only (never polled: the owner polls).
    /// Everything `&Cq` offers goes through `inner`, which is `Sync`.
    #[cfg(feature = "tokio")]
    pub(crate) fn view_of(inner: &Arc<CqInner>) -> Cq {
        Cq {
            inner: inner.clone(),
            cache: RingCache::default(),
            pending: Vec::new(),
            lost_unreported: 0,
        }
    }

    /// The depth the device gave the CQ (may exceed what was asked), now:
    /// it grows when a QP's queues need more (see [`Cq`]) or on
    /// [`resize`](Cq::resize).
    pub fn depth(&self) -> u32 {
        u32::try_from(self.inner.rings.depth()).unwrap_or(u32::MAX)
    }

    /// Whether a QP (or SRQ) whose queues do not fit the CQ grows it (the
    /// default), or is refused with [`Error::CqTooSmall`] (`false`: the CQ
    /// keeps the depth it has, for a program that bounds its memory or
    /// sizes its CQs itself).
    pub fn set_auto_grow(&self, on: bool) {
        self.inner.auto_grow.store(on, Ordering::Relaxed);
    }

    /// Resizes the CQ to at least `depth` entries (`ibv_resize_cq`) and
    /// returns the depth the provider gave it (it may round up; asking for
    /// less than the depth now may leave the CQ as it is).
    ///
    /// Growing in advance saves the resize a QP created later would make;
    /// shrinking gives memory back once QPs are gone.
    ///
    /// # Errors
    /// - [`Error::InvalidArgument`] for 0, a depth past the device's
    ///   `max_cqe`, or one below [`reserved`](Cq::reserved) (the entries
    ///   the queues on the CQ may fill: destroy QPs, and poll the CQ empty
    ///   after destroying QPs with work in flight, first);
    /// - [`Error::Verb`] for `ibv_resize_cq` where the provider refuses
    ///   (`EOPNOTSUPP` where it cannot resize CQs: create the CQ with the
    ///   depth it needs).
    #[doc(alias = "ibv_resize_cq")]
    pub fn resize(&self, depth: u32) -> Result<u32> {
        let max = self.inner.max_cqe;
        if depth == 0 || depth > max {
            return Err(Error::InvalidArgument {
                what: "CQ depth",
                reason: format!("{depth} is outside 1..={max} (the device's max_cqe)"),
            });
        }
        let depth = self.inner.rings.resize(|reserved| {
            if u64::from(depth) < reserved {
                return Err(Error::InvalidArgument {
                    what: "CQ depth",
                    reason: format!(
                        "{depth} is below the {reserved} entries the queues on the CQ reserve; \
                         destroy QPs first (and poll the CQ empty if they had work in flight), \
                         or resize to at least {reserved}"
                    ),
                });
            }
            match self.inner.resize_locked(depth.into()) {
                Ok(d) => Ok(d.into()),
                Err(f) if matches!(f.errno(), Some(libc::EOPNOTSUPP | libc::ENOSYS)) => {
                    Err(Error::Verb {
                        verb: f.verb,
                        source: f.source,
                        hint: Some(
                            "this provider cannot resize a CQ: create it with the depth it needs"
                                .into(),
                        ),
                    })
                }
                Err(f) => Err(f.into()),
            }
        })?;
        Ok(u32::try_from(depth).unwrap_or(u32::MAX))
    }

    /// CQ entries the queues of the QPs on this CQ may still fill: the sum of
    /// their depths, plus those of destroyed QPs whose completions may still
    /// be in the CQ (until a poll finds it empty; a queue dropped with
    /// nothing in flight and no raw posts gives its entries back at once).
    pub fn reserved(&self) -> u64 {
        self.inner.rings.reserved()
    }

    /// The raw `ibv_cq`, valid while this `Cq` (or a QP on it) lives.
    ///
    /// Completions polled through it bypass the safe path: the buffers of the
    /// requests they complete stay in their QP's ring until a later completion
    /// of the same queue sweeps them (reported as
    /// [`Error::CompletionsLost`]) or the QP is destroyed.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.as_raw()
    }
}

impl fmt::Debug for Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq").field("depth", &self.depth()).finish()
    }
}

impl Context {
    /// Creates a completion queue (`ibv_create_cq`); see [`Cq::new`].
    #[doc(alias = "ibv_create_cq")]
    pub fn create_cq(&self, depth: u32) -> Result<Cq> {
        Cq::new(self, depth)
    }
}
