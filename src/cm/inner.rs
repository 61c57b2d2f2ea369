//! The state one rdma_cm id shares with its QP and handshake: the id, its
//! lock, its event channel, and whether a blocking wait owns its events.

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
    /// The multicast groups joined and not left (`cm/mcast.rs`); the
    /// kernel leaves them when the id is destroyed.
    pub(super) groups: Mutex<Vec<Joined>>,
    /// Dropped after the id is destroyed.
    pub(super) channel: EventChannel,
}

// SAFETY: librdmacm ids may be used from any thread; every call and field
// access through &IdInner happens under `lock`.
unsafe impl Send for IdInner {}
// SAFETY: as above.
unsafe impl Sync for IdInner {}

impl Drop for IdInner {
    fn drop(&mut self) {
        // SAFETY: raw came from rdma_create_id (or a connect request) and is
        // destroyed only here; every event fetched for it was acknowledged, so
        // this does not block; a QP created on it held an Arc to this inner, so
        // it is gone, and id->qp is NULL (this module never leaves it set).
        // A failure is ignored: Drop never panics.
        unsafe { ffi::rdma_destroy_id(self.raw.as_ptr()) };
    }
}

impl IdInner {
    pub(super) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn id(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// Fetches one event if one is waiting. Call with the lock held.
    pub(super) fn try_event_locked(&self) -> Result<Option<CmEvent>> {
        let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: valid channel (non-blocking, so this never sleeps); ev is an out-pointer.
        let got = verb!(errno: unsafe { ffi::rdma_get_cm_event(self.channel.as_raw(), &mut ev) });
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

    /// Waits for the next event until `deadline`. With `locked`, the caller
    /// holds the lock throughout; without, the lock is taken for each fetch
    /// only, so other calls on the id proceed while this one sleeps.
    pub(super) fn next_event(
        &self,
        deadline: Instant,
        what: &'static str,
        total: Duration,
        locked: bool,
    ) -> Result<CmEvent> {
        loop {
            let ev = if locked {
                self.try_event_locked()?
            } else {
                let _g = self.lock();
                self.try_event_locked()?
            };
            if let Some(ev) = ev {
                return Ok(ev);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what, after: total });
            }
            poll_readable(self.channel.fd(), deadline - now)?;
        }
    }

    /// Waits for the event `awaited` names, up to its limit for `timeout`;
    /// any other event (but the harmless ones) ends the wait with its error.
    /// `locked` as in [`IdInner::next_event`].
    pub(super) fn expect(
        &self,
        awaited: Awaited,
        timeout: Duration,
        locked: bool,
    ) -> Result<CmEvent> {
        let limit = awaited.limit(timeout);
        let deadline = deadline_after(limit);
        loop {
            let ev = self.next_event(deadline, awaited.what, limit, locked)?;
            if let Some(r) = awaited.judge(ev) {
                return r;
            }
        }
    }

    /// [`IdInner::expect`] with the lock held by the caller throughout.
    pub(super) fn expect_locked(&self, awaited: Awaited, timeout: Duration) -> Result<CmEvent> {
        self.expect(awaited, timeout, true)
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
