//! `Cq`: completion queues, and the completions that hand buffers back.
//!
//! Polling a completion of a work request posted through the safe path
//! returns the buffers that request owned (see [`crate::qp`] for the design).

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::channel::{CompletionChannel, CqEvents};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::table::{RingCache, RingTable};
use crate::sys::call::verb;

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
/// may produce together with those of the other queues already on it (see
/// [`Error::CqTooSmall`]), so the CQ cannot overrun through the safe path.
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

pub(crate) struct CqInner {
    raw: NonNull<ffi::ibv_cq>,
    depth: u32,
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
// crate::channel), the channel (itself Sync), and `ibv_req_notify_cq` through
// `&Cq`, which libibverbs allows concurrently with polling (providers take
// the CQ lock for it). Polling itself needs `&mut Cq`.
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
        })?;
        if let Some(ch) = channel {
            ch.inner.attach();
        }
        // SAFETY: raw is valid; cqe is the actual depth the provider chose.
        let actual = unsafe { (*raw.as_ptr()).cqe };
        let depth = u32::try_from(actual).unwrap_or(depth);
        Ok(Cq {
            inner: Arc::new(CqInner {
                raw,
                depth,
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

    /// The depth the device gave the CQ (may exceed what was asked).
    pub fn depth(&self) -> u32 {
        self.inner.depth
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
