//! rdma_cm connection setup as futures: [`Listener`], [`AsyncCmId`].

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ::tokio::io::unix::AsyncFd;

use super::dispatch::shared_channel;
use super::qp::{AsyncQp, Parts};
use super::{ReadinessFd, watch};
use crate::cm::event::Awaited;
use crate::cm::{
    CmEvent, CmEventKind, CmId, ConnParam, ConnectRequest, Handshake, UdPeer, ud_peer,
};
use crate::error::{Error, Result};
use crate::qp::Rc;
use crate::qp::{Init, Qp, QpState, Rts, Ud};

/// A [`CmId`] whose events are awaited: routed to it from the runtime's
/// shared channel (`dispatch.rs`), or, for an id with a channel of its own
/// (a request taken on a blocking listener), through that channel's
/// readiness handle.
struct Watched {
    // Field order is drop order: deregister from tokio while the descriptor is open.
    watched: Option<AsyncFd<ReadinessFd>>,
    id: CmId,
    /// DISCONNECTED was handed out (by `event` or a `disconnect`).
    disconnected: AtomicBool,
}

impl Watched {
    fn new(id: CmId) -> Result<Watched> {
        let watched = if id.is_shared() {
            None
        } else {
            let fd = id.channel().readiness()?.as_raw_fd();
            // SAFETY: the readiness handle belongs to the id's channel, which
            // the id owns; `watched` is declared before `id`, so it is dropped
            // first.
            Some(unsafe { watch(fd, "registering an rdma_cm event channel with tokio")? })
        };
        Ok(Watched {
            watched,
            id,
            disconnected: AtomicBool::new(false),
        })
    }

    /// A new id on the current runtime's shared channel: RC, or UD if `ud`.
    fn create(ud: bool) -> Result<Watched> {
        Watched::new(CmId::new_on(&shared_channel()?, ud)?)
    }

    /// A new id on the runtime's shared channel, bound to `addr` and
    /// listening.
    fn listen(addr: SocketAddr, backlog: i32, ud: bool) -> Result<Watched> {
        let w = Watched::create(ud)?;
        w.id.bind(addr)?;
        w.id.listen(backlog)?;
        Ok(w)
    }

    /// Notes DISCONNECTED in `ev`.
    fn note(&self, ev: Result<CmEvent>) -> Result<CmEvent> {
        if ev
            .as_ref()
            .is_ok_and(|e| e.kind == CmEventKind::Disconnected)
        {
            self.disconnected.store(true, Ordering::Relaxed);
        }
        ev
    }

    /// The id's next event if one is there, noting DISCONNECTED.
    fn try_event(&self) -> Result<Option<CmEvent>> {
        let ev = self.id.try_event()?;
        if ev
            .as_ref()
            .is_some_and(|e| e.kind == CmEventKind::Disconnected)
        {
            self.disconnected.store(true, Ordering::Relaxed);
        }
        Ok(ev)
    }

    /// The id's next event. Cancel safe: an event is taken only when returned.
    async fn event(&self) -> Result<CmEvent> {
        let Some(watched) = &self.watched else {
            return self.note(std::future::poll_fn(|cx| self.id.poll_event(cx)).await);
        };
        loop {
            if let Some(ev) = self.try_event()? {
                return Ok(ev);
            }
            let mut ready = watched.readable().await.map_err(|source| Error::Io {
                what: "waiting for rdma_cm events",
                source,
            })?;
            match self.try_event()? {
                Some(ev) => return Ok(ev),
                None => ready.clear_ready(),
            }
        }
    }

    /// Waits for the event `awaited` names, up to its limit for `timeout`;
    /// any other event (but the harmless ones) is returned as its error.
    /// (`awaited` is one of the constants, by reference: this future is in
    /// every connection's setup, and its size in every task that awaits it.)
    async fn expect(&self, awaited: &'static Awaited, timeout: Duration) -> Result<CmEvent> {
        let limit = awaited.limit(timeout);
        super::timer::timeout(limit, async {
            loop {
                if let Some(r) = awaited.judge(self.event().await?) {
                    return r;
                }
            }
        })
        .await?
        .unwrap_or(Err(Error::Timeout {
            what: awaited.what,
            after: limit,
        }))
    }

    /// `rdma_connect` with `qp` attached, which the returned guard holds
    /// until the handshake ends. Not an `async fn`: the QP is moved once.
    fn start_connect(&self, qp: AsyncQp<Rc, Init>, param: &ConnParam) -> Result<InFlight> {
        let (qp, parts) = qp.into_parts();
        // SAFETY: `qp` lives in this frame until `InFlight` takes it with the
        // handshake, and InFlight drops the handshake first.
        let handshake = unsafe { self.id.start_connect(&qp, param)? };
        Ok(InFlight::new(handshake, qp, parts))
    }

    /// `rdma_accept` of `request` with `qp` attached: the guard that holds
    /// the QP until the handshake ends, and the connection's id.
    fn start_accept(
        request: ConnectRequest,
        qp: AsyncQp<Rc, Init>,
        param: &ConnParam,
    ) -> Result<(InFlight, Watched)> {
        let (qp, parts) = qp.into_parts();
        // SAFETY: as in start_connect: `qp` outlives `handshake`.
        let (id, handshake) = unsafe { request.start_accept(&qp, param)? };
        let in_flight = InFlight::new(handshake, qp, parts);
        Ok((in_flight, Watched::new(id)?))
    }
}

/// A QP attached to an id for a connect or accept that has not finished.
/// Dropped unfinished (the future cancelled, a timeout, a refusal), it
/// detaches the QP at once and drops it. On iWARP the QP is dropped on the
/// runtime's blocking pool: the kernel holds it until the peer answers or its
/// MPA timer expires (siw: 10 s), and destroying it waits for that, which must
/// not stall the runtime's other tasks. The QP holds the id, so the id is
/// destroyed after it.
struct InFlight {
    handshake: Option<Handshake>,
    qp: Option<(Qp<Rc, Init>, Parts)>,
}

impl InFlight {
    /// Holds `qp` with the `handshake` it is attached by.
    fn new(handshake: Handshake, qp: Qp<Rc, Init>, parts: Parts) -> InFlight {
        InFlight {
            handshake: Some(handshake),
            qp: Some((qp, parts)),
        }
    }

    /// The handshake finished: detaches the QP and gives it back.
    fn finish(mut self) -> (Qp<Rc, Init>, Parts) {
        drop(self.handshake.take());
        self.qp
            .take()
            .expect("InFlight holds its QP until finished")
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(handshake) = self.handshake.take() else {
            return;
        };
        let iwarp = handshake.on_iwarp();
        handshake.abandon();
        // Detached here, before the QP can be destroyed anywhere: the id never
        // points at a destroyed QP, and is free for another attach at once.
        drop(handshake);
        let Some((qp, parts)) = self.qp.take() else {
            return;
        };
        // The books first, while the QP holds its number (see `AsyncQp`).
        drop(parts);
        let rt = match ::tokio::runtime::Handle::try_current() {
            Ok(rt) if iwarp => rt,
            _ => return drop(qp),
        };
        // A pool that is shutting down drops the closure, and so the QP, right
        // here. One that cannot start a thread panics after queueing it: no
        // panic leaves a Drop, which may run during unwinding.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            drop(rt.spawn_blocking(move || drop(qp)));
        }));
    }
}

/// A listening rdma_cm id: connection requests, awaited.
pub struct Listener {
    inner: Watched,
}

impl Listener {
    /// Binds to `addr` and listens with `backlog` (`rdma_bind_addr`,
    /// `rdma_listen`). Needs a tokio runtime.
    #[doc(alias = "rdma_bind_addr")]
    #[doc(alias = "rdma_listen")]
    pub fn bind(addr: SocketAddr, backlog: i32) -> Result<Listener> {
        Ok(Listener {
            inner: Watched::listen(addr, backlog, false)?,
        })
    }

    /// A UD listener ([`CmId::ud_listener`]): its requests are answered with
    /// [`ConnectRequest::accept_ud`], which does not wait.
    #[doc(alias = "rdma_listen")]
    pub fn bind_ud(addr: SocketAddr, backlog: i32) -> Result<Listener> {
        Ok(Listener {
            inner: Watched::listen(addr, backlog, true)?,
        })
    }

    /// The id, e.g. for its local address.
    pub fn id(&self) -> &CmId {
        &self.inner.id
    }

    /// The next connection request. Cancel safe. Create the QP with
    /// `request.id().create_qp(..)`, wrap it in an [`AsyncQp`], post receives,
    /// then [`AsyncCmId::accept`] (dropping the request rejects it).
    pub async fn request(&self) -> Result<ConnectRequest> {
        loop {
            let mut ev = self.inner.event().await?;
            if let Some(req) = ev.take_request() {
                return Ok(req);
            }
            if !matches!(ev.kind, CmEventKind::AddrChange | CmEventKind::TimewaitExit) {
                return Err(ev.into_error("rdma_get_request"));
            }
        }
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local_addr", &self.inner.id.local_addr())
            .finish()
    }
}

/// One end of an rdma_cm connection, with awaitable events.
pub struct AsyncCmId {
    inner: Watched,
}

impl AsyncCmId {
    /// A new id with its address and route to `dst` resolved (`rdma_resolve_addr`,
    /// `rdma_resolve_route`; each step
    /// bounded by `timeout`, plus 2 s for the kernel to report). Next: create
    /// the PD, CQs and QP on [`id().context()`](CmId::context), then
    /// [`connect`](Self::connect).
    #[doc(alias = "rdma_resolve_addr")]
    #[doc(alias = "rdma_resolve_route")]
    pub async fn resolve(dst: SocketAddr, timeout: Duration) -> Result<AsyncCmId> {
        AsyncCmId::resolve_on(Watched::create(false)?, dst, timeout).await
    }

    /// [`resolve`](Self::resolve) for a UD id ([`CmId::new_ud`]). Next: the
    /// PD, CQs and [`create_ud_qp`](CmId::create_ud_qp) on
    /// [`id().context()`](CmId::context), then [`connect_ud`](Self::connect_ud).
    #[doc(alias = "rdma_resolve_addr")]
    #[doc(alias = "rdma_resolve_route")]
    pub async fn resolve_ud(dst: SocketAddr, timeout: Duration) -> Result<AsyncCmId> {
        AsyncCmId::resolve_on(Watched::create(true)?, dst, timeout).await
    }

    /// A new UD id bound to the device of `local`, with the multicast
    /// address `group` resolved from it (`rdma_resolve_addr`, what
    /// `mckey -b local -m group` does; bounded by `timeout` plus 2 s). Next:
    /// the PD, CQs and [`create_ud_qp`](CmId::create_ud_qp) on
    /// [`id().context()`](CmId::context), then
    /// [`join_multicast`](Self::join_multicast).
    #[doc(alias = "rdma_resolve_addr")]
    pub async fn resolve_multicast(
        local: SocketAddr,
        group: SocketAddr,
        timeout: Duration,
    ) -> Result<AsyncCmId> {
        let w = Watched::create(true)?;
        w.id.start_resolve_addr_from(Some(local), group, timeout)?;
        w.expect(&Awaited::ADDR_RESOLVED, timeout).await?;
        Ok(AsyncCmId { inner: w })
    }

    async fn resolve_on(w: Watched, dst: SocketAddr, timeout: Duration) -> Result<AsyncCmId> {
        w.id.start_resolve_addr(dst, timeout)?;
        w.expect(&Awaited::ADDR_RESOLVED, timeout).await?;
        w.id.start_resolve_route(timeout)?;
        w.expect(&Awaited::ROUTE_RESOLVED, timeout).await?;
        Ok(AsyncCmId { inner: w })
    }

    /// The id (its device, addresses, `create_qp`).
    pub fn id(&self) -> &CmId {
        &self.inner.id
    }

    /// Connects (`rdma_connect`) with `qp` (created on this id, wrapped in an [`AsyncQp`];
    /// receives posted before carry over) and waits up to `timeout` for
    /// ESTABLISHED. Returns the QP in RTS and the ESTABLISHED event (the
    /// peer's private data). A rejection, an unreachable peer or a timeout is
    /// an error; the QP is dropped then. Cancel safe: dropping the future
    /// abandons the handshake and drops the QP (on iWARP, where the kernel
    /// holds the QP until the peer answers or the MPA timer expires, on the
    /// runtime's blocking pool, so no task waits for that). An id connects
    /// once: after a failed or abandoned connect, drop it; a late answer from
    /// the peer comes from [`event`](Self::event) as an [`Error::CmEvent`]
    /// that says so. On iWARP, where `rdma_connect` connects the TCP stream
    /// before it returns (siw), a peer that does not answer holds the
    /// runtime thread that polls this future for TCP's connect timeout
    /// ([`CmId::connect`](crate::cm::CmId::connect) says more).
    #[doc(alias = "rdma_connect")]
    pub async fn connect(
        &mut self,
        qp: AsyncQp<Rc, Init>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(AsyncQp<Rc, Rts>, CmEvent)> {
        let in_flight = self.inner.start_connect(qp, param)?;
        let ev = self.inner.expect(&Awaited::CONNECTED, timeout).await?;
        let (qp, parts) = in_flight.finish();
        // SAFETY: ESTABLISHED on an id with this QP attached means librdmacm
        // moved the QP to RTR and RTS (else it reports CONNECT_ERROR).
        let qp = unsafe { qp.assume_state::<Rts>() };
        Ok((AsyncQp::from_parts(qp, parts), ev))
    }

    /// [`CmId::connect_ud`], awaited: asks the UD listener for its QP and
    /// returns it as a [`UdPeer`] (with the ESTABLISHED event). Errors as
    /// there. Cancel safe: dropping the future abandons the request (drop
    /// the id then).
    #[doc(alias = "rdma_connect")]
    pub async fn connect_ud<S: QpState>(
        &mut self,
        qp: &Qp<Ud, S>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(UdPeer, CmEvent)> {
        self.inner.id.start_connect_ud(qp, param)?;
        let ev = self.inner.expect(&Awaited::UD_CONNECTED, timeout).await?;
        Ok((ud_peer(qp, &ev)?, ev))
    }

    /// [`CmId::join_multicast`], awaited: joins the group at `group`,
    /// attaches `qp` to it and returns where to send to it (a [`UdPeer`])
    /// with the MULTICAST_JOIN event. Errors as there. Dropping the future
    /// before it is done leaves the id joined without `qp` attached: drop
    /// the id then (the kernel leaves its groups).
    #[doc(alias = "rdma_join_multicast")]
    pub async fn join_multicast<S: QpState>(
        &mut self,
        qp: &Qp<Ud, S>,
        group: SocketAddr,
        timeout: Duration,
    ) -> Result<(UdPeer, CmEvent)> {
        self.inner.id.start_join(qp, group)?;
        let ev = self.inner.expect(&Awaited::MCAST_JOINED, timeout).await;
        self.inner.id.finish_join(qp, group, ev)
    }

    /// [`CmId::leave_multicast`]: detaches `qp` from the group and leaves
    /// it (does not wait).
    #[doc(alias = "rdma_leave_multicast")]
    pub fn leave_multicast<S: QpState>(&mut self, qp: &Qp<Ud, S>, group: SocketAddr) -> Result<()> {
        self.inner.id.leave_multicast(qp, group)
    }

    /// Accepts (`rdma_accept`) `request` with `qp` (created on `request.id()`, wrapped in an
    /// [`AsyncQp`]; receives posted before carry over) and waits up to
    /// `timeout` for ESTABLISHED. Returns the QP in RTS and the connection's id.
    #[doc(alias = "rdma_accept")]
    pub async fn accept(
        request: ConnectRequest,
        qp: AsyncQp<Rc, Init>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(AsyncQp<Rc, Rts>, AsyncCmId)> {
        let (in_flight, w) = Watched::start_accept(request, qp, param)?;
        w.expect(&Awaited::ACCEPTED, timeout).await?;
        let (qp, parts) = in_flight.finish();
        // SAFETY: rdma_accept moved the attached QP to RTR and RTS, and the
        // peer confirmed (ESTABLISHED).
        let qp = unsafe { qp.assume_state::<Rts>() };
        Ok((AsyncQp::from_parts(qp, parts), AsyncCmId { inner: w }))
    }

    /// The next event of this connection (e.g.
    /// [`CmEventKind::Disconnected`] when the peer goes away). Cancel safe.
    pub async fn event(&mut self) -> Result<CmEvent> {
        self.inner.event().await
    }

    /// Sends a disconnect (`rdma_disconnect`) and waits up to `timeout` for
    /// this side's DISCONNECTED. Flush the QP with `to_error` afterwards.
    /// A peer that answers (or whose process is gone: its kernel answers)
    /// confirms within milliseconds; one that is frozen or cut off never does,
    /// and the wait lasts the whole `timeout`: keep it short, or drop the id
    /// when no confirmation is needed.
    ///
    /// Once DISCONNECTED was seen (the peer disconnected first and
    /// [`event`](Self::event) returned it, or an earlier `disconnect`), the
    /// connection is down already: it sends the disconnect (the reply the
    /// peer waits for) and returns `Ok` at once.
    #[doc(alias = "rdma_disconnect")]
    pub async fn disconnect(&mut self, timeout: Duration) -> Result<()> {
        if self.inner.disconnected.load(Ordering::Relaxed) {
            // Still sent: it is the reply the peer's own disconnect waits
            // for (until this id is destroyed otherwise). An error changes
            // nothing: the connection is down.
            let _ = self.inner.id.disconnect();
            return Ok(());
        }
        self.inner.id.disconnect()?;
        self.inner
            .expect(&Awaited::DISCONNECTED, timeout)
            .await
            .map(drop)
    }
}

impl std::fmt::Debug for AsyncCmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCmId")
            .field("id", &self.inner.id)
            .finish()
    }
}
