//! The state one rdma_cm id shares with its QP and handshake: the id, its
//! lock, its event channel (its own, or one shared with other ids), and
//! whether a blocking wait owns its events.

use super::*;
use crate::sys::call::verb;

pub(super) struct IdInner {
    pub(super) raw: NonNull<ffi::rdma_cm_id>,
    /// Serialises every librdmacm call on this id and every access to its fields.
    pub(super) lock: Mutex<()>,
    /// A blocking [`CmId::connect`] (or resolve) is waiting for its event
    /// (it polls the channel without the lock, and the id's events are its
    /// own until it returns). Written and read under `lock`.
    pub(super) connecting: AtomicBool,
    /// A connect on this id ended without ESTABLISHED (refused, timed out,
    /// or its future dropped), its QP detached and dropped: a reply that
    /// still arrives is screened ([`IdInner::screen`]).
    pub(super) abandoned: AtomicBool,
    /// The multicast groups joined and not left (`cm/mcast.rs`); the
    /// kernel leaves them when the id is destroyed.
    pub(super) groups: Mutex<Vec<Joined>>,
    /// Dropped after the id is destroyed.
    pub(super) channel: IdChannel,
}

/// Where an id's events arrive.
pub(super) enum IdChannel {
    /// A channel of the id's own: every event on it is the id's.
    Own(EventChannel),
    /// A channel shared with other ids, read under its lock and routed
    /// (`cm/shared.rs`).
    #[cfg(feature = "tokio")]
    Shared(Arc<SharedChannel>),
}

/// The id's lock, and for an id on a shared channel the channel's lock
/// too (taken second): what every librdmacm call on the id runs under.
pub(super) struct IdGuard<'a> {
    // Released by `Drop`: the channel's lock first, then the id's.
    #[cfg(feature = "tokio")]
    pub(super) routes: Option<RoutesGuard<'a>>,
    id: Option<MutexGuard<'a, ()>>,
}

impl Drop for IdGuard<'_> {
    fn drop(&mut self) {
        // Both locks go before the tasks whose events were routed under
        // them are woken: a waker may call back into this very id.
        #[cfg(feature = "tokio")]
        let woken = self.routes.as_mut().map(RoutesGuard::take_woken);
        #[cfg(feature = "tokio")]
        drop(self.routes.take());
        drop(self.id.take());
        #[cfg(feature = "tokio")]
        crate::sys::wake::wake_all(woken.unwrap_or_default());
    }
}

// SAFETY: librdmacm ids may be used from any thread; every call and field
// access through &IdInner happens under `lock`.
unsafe impl Send for IdInner {}
// SAFETY: as above.
unsafe impl Sync for IdInner {}

impl Drop for IdInner {
    fn drop(&mut self) {
        // A QP created on the id held an Arc to this inner, so it is gone,
        // and id->qp is NULL (this module never leaves it set).
        match &self.channel {
            IdChannel::Own(_) => {
                // SAFETY: raw came from rdma_create_id (or a connect request)
                // and is destroyed only here; every event fetched for it was
                // acknowledged, so this does not block. A failure is ignored:
                // Drop never panics.
                unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
            }
            // The events read for it and not taken are dropped here, after
            // the channel's lock is released.
            #[cfg(feature = "tokio")]
            IdChannel::Shared(shared) => drop(shared.destroy_id(self.raw)),
        }
    }
}

impl IdInner {
    /// A new id's state, on `channel`.
    pub(super) fn new(raw: NonNull<ffi::rdma_cm_id>, channel: IdChannel) -> IdInner {
        IdInner {
            raw,
            lock: Mutex::new(()),
            connecting: AtomicBool::new(false),
            abandoned: AtomicBool::new(false),
            groups: Mutex::new(Vec::new()),
            channel,
        }
    }

    /// Takes the id's lock (and its shared channel's).
    pub(super) fn lock(&self) -> IdGuard<'_> {
        let id = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        IdGuard {
            #[cfg(feature = "tokio")]
            routes: match &self.channel {
                IdChannel::Own(_) => None,
                IdChannel::Shared(s) => Some(s.lock()),
            },
            id: Some(id),
        }
    }

    /// The channel the id's events arrive on.
    pub(super) fn event_channel(&self) -> &EventChannel {
        match &self.channel {
            IdChannel::Own(ch) => ch,
            #[cfg(feature = "tokio")]
            IdChannel::Shared(s) => &s.channel,
        }
    }

    /// Whether the id shares its channel with other ids.
    pub(super) fn is_shared(&self) -> bool {
        !matches!(self.channel, IdChannel::Own(_))
    }

    pub(super) fn id(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// Fetches one event if one is waiting, with the lock `g` (this id's).
    pub(super) fn try_event_locked(&self, g: &mut IdGuard<'_>) -> Result<Option<CmEvent>> {
        #[cfg(feature = "tokio")]
        if let (IdChannel::Shared(s), Some(routes)) = (&self.channel, g.routes.as_mut()) {
            return routes.next_for(s, self.raw);
        }
        let _ = g;
        let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        let ch = self.event_channel().as_raw();
        // SAFETY: valid channel (non-blocking, so this never sleeps), the id's
        // own, read under its lock; ev is an out-pointer.
        let got = verb!(errno: unsafe { ffi::rdma_get_cm_event(ch, &mut ev) });
        if let Err(failed) = got {
            return match failed.errno() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(failed.into()),
            };
        }
        // SAFETY: on success ev is a valid event until acknowledged below.
        let (mut event, child) = unsafe { copy_event(ev) };
        // SAFETY: ev came from rdma_get_cm_event and is acknowledged exactly once,
        // after everything needed was copied out of it.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        if let Some(child) = child {
            event.request = Some(ConnectRequest {
                id: Some(CmId::adopt_request(child)?),
                private_data: event.private_data.clone(),
                conn: event.conn,
            });
        }
        Ok(Some(event))
    }

    /// Waits for the next event until `deadline`, taking the lock for each
    /// fetch only, so other calls on the id proceed while this one sleeps.
    pub(super) fn next_event(
        &self,
        deadline: Instant,
        what: &'static str,
        total: Duration,
    ) -> Result<CmEvent> {
        loop {
            let ev = self.try_event_locked(&mut self.lock())?;
            if let Some(ev) = ev {
                return Ok(ev);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what, after: total });
            }
            self.sleep_for_event(deadline - now)?;
        }
    }

    /// Sleeps until the id's channel is readable or `left` passes. On a
    /// shared channel, another thread may read the id's event meanwhile and
    /// queue it: the sleep is cut to a slice, so the queue is looked at again.
    pub(super) fn sleep_for_event(&self, left: Duration) -> Result<()> {
        let left = if self.is_shared() {
            left.min(CONNECTING_SLICE)
        } else {
            left
        };
        poll_readable(self.event_channel().fd(), left)
    }

    /// Waits for the event `awaited` names, up to its limit for `timeout`,
    /// taking the lock for each look at the events only (see
    /// [`IdInner::next_event`]); any other event (but the harmless ones)
    /// ends the wait with its error.
    pub(super) fn expect(&self, awaited: Awaited, timeout: Duration) -> Result<CmEvent> {
        let limit = awaited.limit(timeout);
        let deadline = deadline_after(limit);
        loop {
            let ev = self.next_event(deadline, awaited.what, limit)?;
            if let Some(r) = awaited.judge(ev) {
                return r;
            }
        }
    }

    /// `ev` as handed to the application: a CONNECT_RESPONSE or ESTABLISHED
    /// after an abandoned connect names a connection with no QP on this
    /// side, so it becomes an error that says what to do.
    pub(super) fn screen(&self, ev: CmEvent) -> Result<CmEvent> {
        let stale = matches!(
            ev.kind,
            CmEventKind::ConnectResponse | CmEventKind::Established
        );
        if !stale || !self.abandoned.load(Ordering::Relaxed) {
            return Ok(ev);
        }
        Err(Error::CmEvent {
            op: "rdma_get_cm_event",
            event: ev.kind,
            status: ev.status,
            private_data: ev.private_data,
            hint: Some(
                "the peer answered a connect that this id had abandoned (it failed, timed out \
                 or its future was dropped), whose QP is gone: drop the id (the kernel tells \
                 the peer) and connect again with a new id and QP"
                    .into(),
            ),
        })
    }

    /// Whether a blocking connect or resolve owns the id's events now. Call
    /// with the lock held.
    pub(super) fn connecting(&self) -> bool {
        self.connecting.load(Ordering::Relaxed)
    }

    /// Refuses a call that would start a second blocking wait on the id (the
    /// kernel would refuse its verb too, in another state) or disconnect it
    /// while one owns its events. Call with the lock held.
    pub(super) fn refuse_if_waiting(&self) -> Result<()> {
        if self.connecting() {
            return Err(Error::InvalidArgument {
                what: "rdma_cm id",
                reason: "a connect or resolve on another thread is waiting for its event on it; \
                         call again once it returned (it ends at its timeout)"
                    .into(),
            });
        }
        Ok(())
    }
}

/// The id's events marked as a blocking resolve's own while it waits
/// without the lock (as a [`Handshake`] does for a connect); unmarked on drop.
pub(super) struct BlockingWaitGuard<'a>(&'a IdInner);

impl<'a> BlockingWaitGuard<'a> {
    /// Marks them. Call with the lock held.
    pub(super) fn mark(inner: &'a IdInner) -> BlockingWaitGuard<'a> {
        inner.connecting.store(true, Ordering::Relaxed);
        BlockingWaitGuard(inner)
    }
}

impl Drop for BlockingWaitGuard<'_> {
    fn drop(&mut self) {
        let _g = self.0.lock();
        self.0.connecting.store(false, Ordering::Relaxed);
    }
}
