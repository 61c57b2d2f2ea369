//! [`CmId`]: creating an id, binding, listening, its addresses and its events.

use super::*;
use crate::sys::call::verb;

/// An rdma_cm identifier (`rdma_cm_id`): one end of a connection, or a listener.
///
/// Owns its [`EventChannel`] (the ids of the async layer, feature `tokio`,
/// share one per runtime, which routes each event to its id). Dropping it
/// destroys the id (`rdma_destroy_id`;
/// a connected peer sees DISCONNECTED) once no QP created on it is left.
/// All methods take `&self`; they are serialised internally. A blocking
/// [`connect`](CmId::connect) holds the id only for each look at its events
/// (and for the `rdma_connect` call, which on iWARP may take TCP's connect
/// timeout: see `connect`), so getters (and `Debug`) on other threads answer
/// meanwhile; until it
/// returns, event readers there see no events (they are the handshake's)
/// and [`disconnect`](CmId::disconnect) is refused.
pub struct CmId {
    pub(super) inner: Arc<IdInner>,
}

impl CmId {
    /// Creates an id (`rdma_create_id`) for reliable connections (`RDMA_PS_TCP`) on a new channel.
    #[doc(alias = "rdma_create_id")]
    pub fn new() -> Result<CmId> {
        CmId::with_channel(EventChannel::new()?)
    }

    /// Creates an id (`rdma_create_id`) on `channel`, which it then owns (one id per channel).
    #[doc(alias = "rdma_create_id")]
    pub fn with_channel(channel: EventChannel) -> Result<CmId> {
        CmId::create(channel, ffi::RDMA_PS_TCP)
    }

    /// An id of port space `ps` on `channel`.
    pub(super) fn create(channel: EventChannel, ps: ffi::rdma_port_space) -> Result<CmId> {
        let mut raw: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: valid channel; raw is an out-pointer; no user context.
        let rc =
            unsafe { ffi::rdma_create_id(channel.as_raw(), &mut raw, std::ptr::null_mut(), ps) };
        let raw = match (rc, NonNull::new(raw)) {
            (0, Some(raw)) => raw,
            _ => return Err(Error::verb("rdma_create_id", last_errno())),
        };
        Ok(CmId {
            inner: Arc::new(IdInner::new(raw, IdChannel::Own(channel))),
        })
    }

    /// Wraps the new id of a connection request: moves it from the listener's
    /// channel to a fresh one of its own. On failure the id is destroyed.
    pub(super) fn adopt_request(child: NonNull<ffi::rdma_cm_id>) -> Result<CmId> {
        let moved = EventChannel::new().and_then(|ch| {
            // SAFETY: child is a live id with no event outstanding (its connect
            // request was acknowledged); ch is a valid channel.
            verb!(errno: unsafe { ffi::rdma_migrate_id(child.as_ptr(), ch.as_raw()) })?;
            Ok(ch)
        });
        match moved {
            Ok(channel) => Ok(CmId {
                inner: Arc::new(IdInner::new(child, IdChannel::Own(channel))),
            }),
            Err(e) => {
                // SAFETY: child is ours and nothing else refers to it.
                unsafe { ffi::rdma_destroy_id(child.as_ptr()) };
                Err(e)
            }
        }
    }

    /// The raw id. librdmacm calls on it bypass this wrapper's serialisation;
    /// do not destroy it, and leave `qp` NULL.
    pub fn as_raw(&self) -> *mut ffi::rdma_cm_id {
        self.inner.id()
    }

    /// The id's event channel (for `poll`/`epoll` on its
    /// [`readiness`](EventChannel::readiness): readable = [`CmId::get_event`] has work).
    ///
    /// The ids of the async layer (feature `tokio`) share one channel per
    /// runtime: its readiness then reports an event of any of them.
    pub fn channel(&self) -> &EventChannel {
        self.inner.event_channel()
    }

    /// Binds to a local address and port (`rdma_bind_addr`); port 0 picks one.
    /// Binding to a specific address also binds the id to that address's device.
    #[doc(alias = "rdma_bind_addr")]
    pub fn bind(&self, addr: SocketAddr) -> Result<()> {
        let mut a = RawAddr::new(addr);
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        // SAFETY: valid id, under its lock; a is a full socket address.
        let rc = unsafe { ffi::rdma_bind_addr(self.inner.id(), a.as_ptr()) };
        if rc == 0 {
            return Ok(());
        }
        let e = last_errno();
        let hint = match e.raw_os_error() {
            Some(libc::EADDRINUSE) => Some(format!(
                "port {} is already bound by another rdma_cm id",
                addr.port()
            )),
            // The kernel also answers EADDRNOTAVAIL when the port is bound
            // on an overlapping address (0.0.0.0 against a specific one).
            Some(libc::EADDRNOTAVAIL) => Some(format!(
                "{} is not an address of an RDMA-capable interface, or port {} is already bound \
                 on an overlapping address (the wildcard address and a specific one conflict)",
                addr.ip(),
                addr.port()
            )),
            Some(libc::ENODEV) => Some(format!(
                "{} is not an address of an RDMA-capable interface",
                addr.ip()
            )),
            _ => None,
        };
        Err(Error::Verb {
            verb: "rdma_bind_addr",
            source: e,
            hint,
        })
    }

    /// Starts listening for connection requests (`rdma_listen`); take them
    /// with [`CmId::get_request`].
    #[doc(alias = "rdma_listen")]
    pub fn listen(&self, backlog: i32) -> Result<()> {
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        // SAFETY: valid id, under its lock.
        verb!(errno: unsafe { ffi::rdma_listen(self.inner.id(), backlog) })?;
        Ok(())
    }

    /// A bound, listening id (`rdma_create_id`, `rdma_bind_addr`, `rdma_listen`):
    /// [`CmId::new`], [`bind`](CmId::bind), [`listen`](CmId::listen).
    #[doc(alias = "rdma_bind_addr")]
    #[doc(alias = "rdma_listen")]
    pub fn listener(addr: SocketAddr, backlog: i32) -> Result<CmId> {
        let id = CmId::new()?;
        id.bind(addr)?;
        id.listen(backlog)?;
        Ok(id)
    }

    /// Waits up to `timeout` for the next connection request on a listening id
    /// (the CONNECT_REQUEST event that `rdma_get_request` returns).
    /// Any other event ends the wait with its error.
    #[doc(alias = "rdma_get_request")]
    pub fn get_request(&self, timeout: Duration) -> Result<ConnectRequest> {
        let deadline = deadline_after(timeout);
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let mut ev = self.wait_event(remaining, "waiting for a connection request", timeout)?;
            if let Some(req) = ev.take_request() {
                return Ok(req);
            }
            if matches!(ev.kind, CmEventKind::AddrChange | CmEventKind::TimewaitExit) {
                continue;
            }
            return Err(ev.into_error("rdma_get_request"));
        }
    }
}

impl CmId {
    /// The device this id is bound to (after an address resolution, a bind to
    /// a device's address, or on a connection request's id), as a [`Context`]
    /// for creating the PD and CQs of its QP.
    ///
    /// The `ibv_context` belongs to librdmacm: this `Context` never closes it,
    /// and keeps librdmacm's device list pinned while it (or anything created
    /// from it) lives.
    pub fn context(&self) -> Result<Context> {
        let verbs = {
            let _g = self.inner.lock();
            // SAFETY: valid id under its lock; verbs is a plain field.
            unsafe { (*self.inner.id()).verbs }
        };
        let Some(raw) = NonNull::new(verbs) else {
            return Err(Error::InvalidArgument {
                what: "rdma_cm id",
                reason: "it is not bound to a device yet: resolve an address (active side), bind to a device's \
                         address, or take a connection request (passive side) first"
                    .into(),
            });
        };
        let pin = DeviceListPin::new(verbs)?;
        // SAFETY: librdmacm keeps the context of a device open while its
        // reference count (raised by the pin) is above zero; the pin is the owner.
        Ok(unsafe { Context::borrowed(raw, Box::new(pin)) })
    }

    /// The port of the device this id is bound to (0 before that).
    pub fn port_num(&self) -> u8 {
        let _g = self.inner.lock();
        // SAFETY: valid id under its lock; plain field.
        unsafe { (*self.inner.id()).port_num }
    }

    /// The local address (`rdma_get_local_addr`), once bound or resolved.
    #[doc(alias = "rdma_get_local_addr")]
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let _g = self.inner.lock();
        // SAFETY: valid id under its lock; the result points into the id.
        unsafe { read_addr(ffi::rdma_get_local_addr(self.inner.id())) }
    }

    /// The peer's address (`rdma_get_peer_addr`), once resolved or connected.
    #[doc(alias = "rdma_get_peer_addr")]
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let _g = self.inner.lock();
        // SAFETY: valid id under its lock; the result points into the id.
        let a = unsafe { read_addr(ffi::rdma_get_peer_addr(self.inner.id())) };
        a.filter(|a| !(a.ip().is_unspecified() && a.port() == 0))
    }

    /// Disconnects (`rdma_disconnect`): the peer, and this id, see DISCONNECTED.
    /// Does not wait and does not touch the QP (see the module docs; use
    /// [`Qp::to_error`] to flush it). On an id that is not connected yet (a
    /// [`ConnectRequest`]'s before it is accepted) rdma_cm does nothing and
    /// reports success: refuse such a request with
    /// [`ConnectRequest::reject`].
    ///
    /// While a [`connect`](CmId::connect) on another thread is waiting for
    /// ESTABLISHED, this returns [`Error::InvalidArgument`] at once (that
    /// connect ends at its timeout; a future of the async layer's connect can
    /// be dropped instead).
    #[doc(alias = "rdma_disconnect")]
    pub fn disconnect(&self) -> Result<()> {
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        // SAFETY: valid id under its lock; id->qp is NULL, so librdmacm only
        // sends the disconnect.
        verb!(errno: unsafe { ffi::rdma_disconnect(self.inner.id()) })?;
        Ok(())
    }

    /// Waits up to `timeout` for the next event of this id (`rdma_get_cm_event`,
    /// acknowledged at once with `rdma_ack_cm_event`; the events of a
    /// handshake in progress in another thread are that handshake's).
    /// [`Error::Timeout { .. }`](Error::Timeout) when none came.
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_ack_cm_event")]
    pub fn get_event(&self, timeout: Duration) -> Result<CmEvent> {
        self.wait_event(timeout, "waiting for an rdma_cm event", timeout)
    }

    /// Waits up to `timeout` for the next event (`rdma_get_cm_event`) and checks that it is `kind`;
    /// any other event becomes its [`Error::CmEvent`].
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_ack_cm_event")]
    pub fn expect_event(&self, kind: CmEventKind, timeout: Duration) -> Result<CmEvent> {
        let ev = self.get_event(timeout)?;
        if ev.kind == kind {
            Ok(ev)
        } else {
            Err(ev.into_error("expect_event"))
        }
    }

    /// The next event without waiting (`rdma_get_cm_event` on the non-blocking channel), if one is there.
    /// `None` too while a [`connect`](CmId::connect) or a resolve on another
    /// thread waits (the events it waits for are its own).
    #[doc(alias = "rdma_get_cm_event")]
    #[doc(alias = "rdma_ack_cm_event")]
    pub fn try_event(&self) -> Result<Option<CmEvent>> {
        let mut g = self.inner.lock();
        if self.inner.connecting() {
            return Ok(None);
        }
        let ev = self.inner.try_event_locked(&mut g)?;
        ev.map(|ev| self.inner.screen(ev)).transpose()
    }

    fn wait_event(
        &self,
        timeout: Duration,
        what: &'static str,
        total: Duration,
    ) -> Result<CmEvent> {
        let deadline = deadline_after(timeout);
        loop {
            // Sleep without the lock, so other calls on the id can proceed.
            let connecting = {
                let mut g = self.inner.lock();
                let connecting = self.inner.connecting();
                if !connecting {
                    if let Some(ev) = self.inner.try_event_locked(&mut g)? {
                        return self.inner.screen(ev);
                    }
                }
                connecting
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout { what, after: total });
            }
            if connecting {
                // The channel may be readable with the handshake's event:
                // sleep instead of polling it, and look again.
                std::thread::sleep((deadline - now).min(CONNECTING_SLICE));
            } else {
                self.inner.sleep_for_event(deadline - now)?;
            }
        }
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .field("port_num", &self.port_num())
            .finish()
    }
}
