//! One event channel for many ids (the async layer's ids of one runtime):
//! its events are read under one lock and routed to a queue per id.
//!
//! Every read of the channel (`rdma_get_cm_event`, which lets librdmacm act
//! on the event's id: a CONNECT_RESPONSE moves `id->qp` to RTS, a REJECTED to
//! ERR, a MULTICAST_JOIN attaches it) happens under [`SharedChannel`]'s lock,
//! and so does every librdmacm call and field access on an id of the channel
//! ([`IdInner::lock`] takes both locks, the id's first). So the event
//! processing never meets an `id->qp` that is being attached or cleared, as on
//! an id with a channel of its own, where the id's lock alone covers both.

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::task::{Context as TaskContext, Poll, Waker};

use super::*;
use crate::sys::addr_hash::AddrMap;
use crate::sys::call::verb;
use crate::sys::wake::wake_all;

/// An rdma_cm event channel shared by many ids, with the queue of events
/// read for each of them.
pub(crate) struct SharedChannel {
    pub(super) routes: Mutex<Routes>,
    /// Dropped after every id on it (each holds an `Arc` of this).
    pub(super) channel: EventChannel,
}

/// The events read for each id of a [`SharedChannel`], by the id's address.
pub(crate) struct Routes {
    slots: AddrMap<usize, Slot>,
    /// Nothing drives the channel any more (its runtime shut down).
    closed: bool,
    /// Wakers of tasks whose event was routed (or whose channel closed)
    /// under the lock, woken once it is released ([`RoutesGuard`]): a
    /// waker may run the task's code, which takes the lock again.
    woken: Vec<Waker>,
}

/// The lock of a [`SharedChannel`]'s routes. Dropping it releases the lock,
/// then wakes the tasks whose events were routed under it.
pub(crate) struct RoutesGuard<'a>(Option<MutexGuard<'a, Routes>>);

impl RoutesGuard<'_> {
    /// The wakers due so far, for a caller that releases further locks
    /// before waking them (see `IdGuard`).
    pub(super) fn take_woken(&mut self) -> Vec<Waker> {
        self.0
            .as_mut()
            .map(|r| std::mem::take(&mut r.woken))
            .unwrap_or_default()
    }
}

impl Deref for RoutesGuard<'_> {
    type Target = Routes;
    fn deref(&self) -> &Routes {
        self.0.as_ref().expect("held until dropped")
    }
}

impl DerefMut for RoutesGuard<'_> {
    fn deref_mut(&mut self) -> &mut Routes {
        self.0.as_mut().expect("held until dropped")
    }
}

impl Drop for RoutesGuard<'_> {
    fn drop(&mut self) {
        let woken = self.take_woken();
        self.0 = None;
        wake_all(woken);
    }
}

/// How many tasks' wakers an id keeps before it wakes them all (see `park`).
const MAX_PARKED: usize = 16;

/// One id's events, read and acknowledged, and the tasks waiting for them
/// (usually one; a listener's requests may be awaited from several).
#[derive(Default)]
struct Slot {
    events: VecDeque<CmEvent>,
    wakers: Vec<Waker>,
}

impl Slot {
    /// Queues `event`. An idle id holds no storage (see [`pop`](Self::pop)),
    /// and one event at a time is the rule: room for exactly one, where a
    /// first push would make room for four.
    fn push(&mut self, event: CmEvent) {
        if self.events.capacity() == 0 {
            self.events.reserve_exact(1);
        }
        self.events.push_back(event);
    }

    /// The oldest queued event. The queue's storage goes with its last
    /// event: a runtime with many connections keeps one slot per id, and
    /// most of them wait for nothing most of the time.
    fn pop(&mut self) -> Option<CmEvent> {
        let event = self.events.pop_front();
        if self.events.is_empty() {
            self.events = VecDeque::new();
        }
        event
    }
}

impl SharedChannel {
    /// A new channel (`rdma_create_event_channel`) with no ids yet.
    pub(crate) fn new() -> Result<Arc<SharedChannel>> {
        Ok(Arc::new(SharedChannel {
            routes: Mutex::new(Routes {
                slots: AddrMap::default(),
                closed: false,
                woken: Vec::new(),
            }),
            channel: EventChannel::new()?,
        }))
    }

    pub(super) fn lock(&self) -> RoutesGuard<'_> {
        RoutesGuard(Some(self.routes.lock().unwrap_or_else(|p| p.into_inner())))
    }

    /// The channel's readiness handle (readable when an event of any of its
    /// ids is waiting to be read).
    pub(crate) fn readiness(&self) -> Result<&Readiness> {
        self.channel.readiness()
    }

    /// Reads every event waiting on the channel and hands each to its id,
    /// waking the task that waits for it.
    pub(crate) fn dispatch(self: &Arc<Self>) -> Result<()> {
        let mut routes = self.lock();
        self.drain(&mut routes)
    }

    /// Marks the channel as no longer driven and wakes every waiter, which
    /// then fails instead of waiting for events nobody reads.
    pub(crate) fn close(&self) {
        let mut routes = self.lock();
        let Routes {
            slots,
            closed,
            woken,
        } = &mut *routes;
        *closed = true;
        for slot in slots.values_mut() {
            woken.append(&mut slot.wakers);
        }
    }

    /// [`dispatch`](Self::dispatch) with the lock held; the tasks to wake
    /// are left in `routes.woken`.
    pub(super) fn drain(self: &Arc<Self>, routes: &mut Routes) -> Result<()> {
        loop {
            let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
            let ch = self.channel.as_raw();
            // SAFETY: valid, non-blocking channel, read under its lock; ev is
            // an out-pointer.
            let got = verb!(errno: unsafe { ffi::rdma_get_cm_event(ch, &mut ev) });
            if let Err(failed) = got {
                return match failed.errno() {
                    Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(()),
                    _ => Err(failed.into()),
                };
            }
            // SAFETY: on success ev is a valid event until acknowledged below;
            // its ids live until then (rdma_destroy_id waits for the ack).
            let (key, (mut event, child)) = unsafe { (route_key(ev), copy_event(ev)) };
            // SAFETY: ev came from rdma_get_cm_event and is acknowledged exactly
            // once, after everything needed was copied out of it.
            unsafe { ffi::rdma_ack_cm_event(ev) };
            if !routes.slots.contains_key(&key) {
                // Its id is gone (dropped while the event was on its way). A
                // request's new id is known to nobody: refuse and destroy it
                // here (a `CmId` of it would take this lock again to drop).
                if let Some(child) = child {
                    // SAFETY: a live id that nothing else refers to, whose
                    // only event (the request) was acknowledged above.
                    unsafe {
                        ffi::rdma_reject(child.as_ptr(), std::ptr::null(), 0);
                        ffi::rdma_destroy_id(child.as_ptr());
                    }
                }
                continue;
            }
            if let Some(child) = child {
                event.request = Some(ConnectRequest {
                    id: Some(self.adopt(child, routes)),
                    private_data: event.private_data.clone(),
                    conn: event.conn,
                });
            }
            let slot = routes.slots.entry(key).or_default();
            slot.push(event);
            let wakers = std::mem::take(&mut slot.wakers);
            routes.woken.extend(wakers);
        }
    }

    /// Wraps the new id of a connection request taken on this channel,
    /// where it stays. Call with the lock held (`routes`).
    fn adopt(self: &Arc<Self>, child: NonNull<ffi::rdma_cm_id>, routes: &mut Routes) -> CmId {
        routes
            .slots
            .insert(child.as_ptr() as usize, Slot::default());
        CmId {
            inner: Arc::new(IdInner::new(child, IdChannel::Shared(self.clone()))),
        }
    }

    /// Creates an id of port space `ps` on this channel.
    pub(super) fn create_id(self: &Arc<Self>, ps: ffi::rdma_port_space) -> Result<CmId> {
        let mut routes = self.lock();
        let mut raw: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: valid channel; raw is an out-pointer; no user context.
        let rc = unsafe {
            ffi::rdma_create_id(self.channel.as_raw(), &mut raw, std::ptr::null_mut(), ps)
        };
        let raw = match (rc, NonNull::new(raw)) {
            (0, Some(raw)) => raw,
            _ => return Err(Error::verb("rdma_create_id", last_errno())),
        };
        routes.slots.insert(raw.as_ptr() as usize, Slot::default());
        Ok(CmId {
            inner: Arc::new(IdInner::new(raw, IdChannel::Shared(self.clone()))),
        })
    }

    /// Destroys `raw` (an id of this channel) and forgets its queue, under
    /// the lock, so no event of it is routed to an id created at the same
    /// address later. Returns the queue's events, to drop without the lock
    /// (a request's id takes it to drop).
    pub(super) fn destroy_id(&self, raw: NonNull<ffi::rdma_cm_id>) -> Option<Vec<CmEvent>> {
        let mut routes = self.lock();
        let slot = routes.slots.remove(&(raw.as_ptr() as usize));
        // SAFETY: raw is an id of this channel, destroyed only here (by its
        // IdInner's drop); every event read for it was acknowledged under
        // this lock, so this does not wait.
        unsafe { ffi::rdma_destroy_id(raw.as_ptr()) };
        drop(routes);
        slot.map(|s| s.events.into())
    }
}

impl Routes {
    /// `raw`'s next event, reading the channel first.
    pub(super) fn next_for(
        &mut self,
        shared: &Arc<SharedChannel>,
        raw: NonNull<ffi::rdma_cm_id>,
    ) -> Result<Option<CmEvent>> {
        shared.drain(self)?;
        Ok(self
            .slots
            .get_mut(&(raw.as_ptr() as usize))
            .and_then(Slot::pop))
    }

    /// `raw`'s next event, or `Pending` with `cx`'s waker kept for when one
    /// is routed to it. While the channel's reader runs, this only looks at
    /// the queue (the reader reads the channel, and a read here would mostly
    /// find it empty: one more system call per wait); once it stopped, this
    /// reads the channel itself before giving up with an error.
    pub(super) fn poll_for(
        &mut self,
        shared: &Arc<SharedChannel>,
        raw: NonNull<ffi::rdma_cm_id>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<CmEvent>> {
        let queued = self
            .slots
            .get_mut(&(raw.as_ptr() as usize))
            .and_then(Slot::pop);
        if let Some(ev) = queued {
            return Poll::Ready(Ok(ev));
        }
        if self.closed {
            if let Some(ev) = self.next_for(shared, raw)? {
                return Poll::Ready(Ok(ev));
            }
        }
        self.park(raw, cx)
    }

    /// Keeps `cx`'s waker for `raw`'s next event (`Pending`), or an error
    /// once nothing drives the channel.
    pub(super) fn park(
        &mut self,
        raw: NonNull<ffi::rdma_cm_id>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<CmEvent>> {
        if self.closed {
            return Poll::Ready(Err(Error::InvalidArgument {
                what: "waiting for an rdma_cm event",
                reason: "the tokio runtime that read this id's events has shut down; \
                         await the id's futures on the runtime that created it"
                    .into(),
            }));
        }
        let slot = self.slots.entry(raw.as_ptr() as usize).or_default();
        if !slot.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            if slot.wakers.len() >= MAX_PARKED {
                // Those of futures dropped since (a listener's requests
                // awaited under timeouts from ever new tasks) would pile up
                // until an event came: all are woken once the lock is
                // released, and the live ones park again.
                self.woken.append(&mut slot.wakers);
            }
            slot.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// The id an event is for: the listener's for a CONNECT_REQUEST (whose `id`
/// is the new one), else the event's id.
///
/// # Safety
/// `ev` is a valid, not yet acknowledged event.
unsafe fn route_key(ev: *const ffi::rdma_cm_event) -> usize {
    // SAFETY: the caller's contract; plain fields.
    unsafe {
        if (*ev).event == ffi::RDMA_CM_EVENT_CONNECT_REQUEST {
            (*ev).listen_id as usize
        } else {
            (*ev).id as usize
        }
    }
}

/// The ids of a shared channel, for the async layer.
impl CmId {
    /// A new id on `shared`: RC (`RDMA_PS_TCP`), or UD (`RDMA_PS_UDP`) if `ud`.
    pub(crate) fn new_on(shared: &Arc<SharedChannel>, ud: bool) -> Result<CmId> {
        shared.create_id(if ud {
            ffi::RDMA_PS_UDP
        } else {
            ffi::RDMA_PS_TCP
        })
    }

    /// Whether the id's events come through a shared channel (awaited with
    /// [`poll_event`](Self::poll_event)) rather than a channel of its own.
    pub(crate) fn is_shared(&self) -> bool {
        self.inner.is_shared()
    }

    /// The next event of an id on a shared channel, or `Pending` until one
    /// is routed to it (the channel's reader wakes `cx` then). While a
    /// blocking wait on another thread owns the id's events, `Pending`.
    pub(crate) fn poll_event(&self, cx: &mut TaskContext<'_>) -> Poll<Result<CmEvent>> {
        let mut g = self.inner.lock();
        let (IdChannel::Shared(shared), Some(routes)) = (&self.inner.channel, g.routes.as_mut())
        else {
            return Poll::Ready(Err(Error::InvalidArgument {
                what: "rdma_cm id",
                reason: "its events arrive on a channel of its own, not a shared one".into(),
            }));
        };
        if self.inner.connecting() {
            return routes.park(self.inner.raw, cx);
        }
        match routes.poll_for(shared, self.inner.raw, cx) {
            Poll::Ready(Ok(ev)) => Poll::Ready(self.inner.screen(ev)),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(status: i32) -> CmEvent {
        CmEvent {
            kind: CmEventKind::Established,
            status,
            private_data: vec![],
            conn: ConnInfo::default(),
            ud: None,
            request: None,
        }
    }

    #[test]
    fn a_slot_keeps_order_and_frees_its_queue_when_empty() {
        let mut slot = Slot::default();
        slot.push(event(1));
        assert_eq!(slot.events.capacity(), 1);
        slot.push(event(2));
        slot.push(event(3));
        assert_eq!(slot.pop().map(|e| e.status), Some(1));
        slot.push(event(4));
        let order: Vec<i32> = std::iter::from_fn(|| slot.pop())
            .map(|e| e.status)
            .collect();
        assert_eq!(order, [2, 3, 4]);
        assert_eq!(slot.events.capacity(), 0);
        assert!(slot.pop().is_none());
    }
}
