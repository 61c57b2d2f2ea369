//! librdmacm: connecting with IP addresses and ports instead of exchanging
//! QP numbers out of band.
//!
//! # Active side
//! ```no_run
//! use std::time::Duration;
//! use rdma_verbs::cm::{CmId, ConnParam};
//! use rdma_verbs::{AccessFlags, Cq, Pd, QpCaps, RecvWr};
//! let t = Duration::from_secs(5);
//! let id = CmId::new()?;
//! id.resolve("10.99.0.1:7174".parse().unwrap(), t)?; // ADDR_RESOLVED, ROUTE_RESOLVED
//! let ctx = id.context()?;                           // the id's device
//! let pd = Pd::new(&ctx)?;
//! let mut cq = Cq::new(&ctx, 64)?;
//! let mut qp = id.create_qp(&pd, &cq, &cq, QpCaps::default())?; // Qp<Rc, Init>
//! qp.post_recv(RecvWr::new(1, pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?))?;
//! let (qp, established) = id.connect(qp, &ConnParam::new().private_data(b"hello"), t)?;
//! println!("server said {:?}", established.private_data);
//! # Ok::<(), rdma_verbs::Error>(())
//! ```
//!
//! # Passive side
//! ```no_run
//! use std::time::Duration;
//! use rdma_verbs::cm::{CmId, ConnParam};
//! use rdma_verbs::{Cq, Pd, QpCaps};
//! let t = Duration::from_secs(30);
//! let listener = CmId::new()?;
//! listener.bind("0.0.0.0:7174".parse().unwrap())?;
//! listener.listen(8)?;
//! let req = listener.get_request(t)?;                // CONNECT_REQUEST
//! let ctx = req.id().context()?;
//! let pd = Pd::new(&ctx)?;
//! let cq = Cq::new(&ctx, 64)?;
//! let qp = req.id().create_qp(&pd, &cq, &cq, QpCaps::default())?;
//! // post receives here: they carry over into the connected QP
//! let (qp, id) = req.accept(qp, &ConnParam::new(), t)?; // ESTABLISHED
//! # Ok::<(), rdma_verbs::Error>(())
//! ```
//!
//! # Events
//! Every [`CmId`] owns its own [`EventChannel`] (connection requests arrive
//! on the listener's and are moved to a fresh channel with `rdma_migrate_id`
//! before [`ConnectRequest`] is handed out), so the events of one connection
//! never reach a waiter on another. Each event is copied into a [`CmEvent`]
//! (kind, status, private data) and acknowledged (`rdma_ack_cm_event`) at
//! once, exactly once, so `rdma_destroy_id` never waits for an ack.
//!
//! The channel's descriptor is non-blocking and every wait here polls it with
//! a timeout: a failed resolution, a refused or unanswered connection, or a
//! peer that goes away ends a call with [`Error::CmEvent`] (naming the event,
//! its status and what it usually means) or
//! [`Error::Timeout { .. }`](Error::Timeout), never a hang.
//!
//! The descriptor itself is not handed out: an event read from it behind
//! librdmacm's back is never acknowledged, and `rdma_destroy_id` (the id's
//! `Drop`) then waits forever. Event loops watch
//! [`EventChannel::readiness`] instead, readable when an event is waiting
//! but unable to consume one (see [`crate::channel`]).
//!
//! # Private data
//! [`ConnParam::private_data`] travels with the request (connect), the reply
//! (accept) and the reject. On InfiniBand and RoCE the CM messages have fixed
//! sizes, so the receiver sees the data zero-padded to 56 bytes (connect),
//! 196 bytes (accept) or 148 bytes (reject); compare prefixes, or put a length
//! in your format.
//!
//! # How the QP gets to RTS (the escape hatch)
//! [`CmId::create_qp`] calls `rdma_create_qp` (which also takes the QP to
//! INIT with the CM's port, P_Key and access flags) and adopts the result
//! with the crate-internal `Qp::from_raw`, passing the id as the QP's
//! *keepalive*: the QP is destroyed (`ibv_destroy_qp`) first, then the id
//! (`rdma_destroy_id`), then its channel. [`CmId::connect`] and
//! [`ConnectRequest::accept`] let librdmacm move the QP to RTR and RTS
//! during the handshake, and then re-type the same `Qp` object (same rings,
//! so receives posted in INIT carry over) with the crate-internal, unsafe
//! `Qp::assume_state`, justified by the ESTABLISHED event.
//!
//! librdmacm remembers the QP in `rdma_cm_id.qp` and would touch it later
//! (`rdma_disconnect` moves it to ERR); `rdma_destroy_id` leaves it alone. So
//! that no librdmacm call can ever reach a destroyed QP, this module sets
//! `id->qp` only for the duration of `connect`/`accept` (while it owns the
//! QP) and clears it right after `rdma_create_qp` and after the handshake.
//! Consequence: [`CmId::disconnect`] does not flush the QP; call
//! [`Qp::to_error`] for that.
//!
//! The id's `ibv_context` belongs to librdmacm: [`CmId::context`] wraps it as
//! a [`Context`] that is never closed by this crate, and pins librdmacm's
//! device list (`rdma_get_devices`) so that it stays open while any object
//! created from it lives. Create the id's PD and CQs from that context.

use std::fmt;
use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::channel::{Readiness, ReadinessCell, deadline_after};
use crate::context::Context;
use crate::cq::Cq;
use crate::error::{Error, Result, last_errno};
use crate::ffi;
use crate::pd::Pd;
use crate::qp::{Init, Qp, QpCaps, Rc, Rts};

mod addr;
mod event;
mod handshake;
mod param;
mod request;

use addr::*;
use event::*;
pub use event::{CmEvent, CmEventKind, ConnInfo, EventChannel};
use handshake::*;
pub use param::ConnParam;
pub use request::{ConnectRequest, REJECT_PRIVATE_DATA_MAX};

/// How long an event reader sleeps between looks while a blocking connect on
/// another thread owns the id's events.
const CONNECTING_SLICE: Duration = Duration::from_millis(10);

/// How long past its own timeout a resolution may take before the wait gives up.
const RESOLVE_GRACE: Duration = Duration::from_secs(2);

struct IdInner {
    raw: NonNull<ffi::rdma_cm_id>,
    /// Serialises every librdmacm call on this id and every access to its fields.
    lock: Mutex<()>,
    /// A blocking [`CmId::connect`] (or resolve) is waiting for its event
    /// (it polls the channel without the lock, and the id's events are its
    /// own until it returns). Written and read under `lock`.
    connecting: AtomicBool,
    /// Dropped after the id is destroyed.
    channel: EventChannel,
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
    fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn id(&self) -> *mut ffi::rdma_cm_id {
        self.raw.as_ptr()
    }

    /// Fetches one event if one is waiting. Call with the lock held.
    fn try_event_locked(&self) -> Result<Option<CmEvent>> {
        let mut ev: *mut ffi::rdma_cm_event = std::ptr::null_mut();
        // SAFETY: valid channel (non-blocking, so this never sleeps); ev is an out-pointer.
        let rc = unsafe { ffi::rdma_get_cm_event(self.channel.as_raw(), &mut ev) };
        if rc != 0 {
            let e = last_errno();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(None),
                _ => Err(Error::verb("rdma_get_cm_event", e)),
            };
        }
        // SAFETY: on success ev is a valid event until acknowledged below.
        let (kind, status, private_data, conn, child) = unsafe { copy_event(ev) };
        // SAFETY: ev came from rdma_get_cm_event and is acknowledged exactly once,
        // after everything needed was copied out of it.
        unsafe { ffi::rdma_ack_cm_event(ev) };
        let request = match child {
            Some(child) => Some(ConnectRequest {
                id: Some(CmId::adopt_request(child)?),
                private_data: private_data.clone(),
                conn,
            }),
            None => None,
        };
        Ok(Some(CmEvent {
            kind,
            status,
            private_data,
            conn,
            request,
        }))
    }

    /// Waits for the next event until `deadline`. With `locked`, the caller
    /// holds the lock throughout; without, the lock is taken for each fetch
    /// only, so other calls on the id proceed while this one sleeps.
    fn next_event(
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

    /// Waits for an event of `kind`; any other event (but the harmless
    /// ADDR_CHANGE / TIMEWAIT_EXIT) ends the wait with its error. `locked` as
    /// in [`IdInner::next_event`].
    fn expect(
        &self,
        kind: CmEventKind,
        op: &'static str,
        what: &'static str,
        timeout: Duration,
        locked: bool,
    ) -> Result<CmEvent> {
        let deadline = deadline_after(timeout);
        loop {
            let ev = self.next_event(deadline, what, timeout, locked)?;
            if ev.kind == kind {
                return Ok(ev);
            }
            if matches!(ev.kind, CmEventKind::AddrChange | CmEventKind::TimewaitExit) {
                continue;
            }
            return Err(ev.into_error(op));
        }
    }

    /// [`IdInner::expect`] with the lock held by the caller throughout.
    fn expect_locked(
        &self,
        kind: CmEventKind,
        op: &'static str,
        what: &'static str,
        timeout: Duration,
    ) -> Result<CmEvent> {
        self.expect(kind, op, what, timeout, true)
    }

    /// Whether a blocking connect or resolve owns the id's events now. Call
    /// with the lock held.
    fn connecting(&self) -> bool {
        self.connecting.load(Ordering::Relaxed)
    }

    /// Refuses a call that would start a second blocking wait on the id (the
    /// kernel would refuse its verb too, in another state) or disconnect it
    /// while one owns its events. Call with the lock held.
    fn refuse_if_waiting(&self) -> Result<()> {
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
struct OwnEvents<'a>(&'a IdInner);

impl<'a> OwnEvents<'a> {
    /// Marks them. Call with the lock held.
    fn mark(inner: &'a IdInner) -> OwnEvents<'a> {
        inner.connecting.store(true, Ordering::Relaxed);
        OwnEvents(inner)
    }
}

impl Drop for OwnEvents<'_> {
    fn drop(&mut self) {
        let _g = self.0.lock();
        self.0.connecting.store(false, Ordering::Relaxed);
    }
}

/// An rdma_cm identifier (`rdma_cm_id`): one end of a connection, or a listener.
///
/// Owns its [`EventChannel`]. Dropping it destroys the id (`rdma_destroy_id`;
/// a connected peer sees DISCONNECTED) once no QP created on it is left.
/// All methods take `&self`; they are serialised internally. A blocking
/// [`connect`](CmId::connect) holds the id only for each look at its events,
/// so getters (and `Debug`) on other threads answer meanwhile; until it
/// returns, event readers there see no events (they are the handshake's)
/// and [`disconnect`](CmId::disconnect) is refused.
pub struct CmId {
    inner: Arc<IdInner>,
}

impl CmId {
    /// Creates an id for reliable connections (`RDMA_PS_TCP`) on a new channel.
    pub fn new() -> Result<CmId> {
        CmId::with_channel(EventChannel::new()?)
    }

    /// Creates an id on `channel`, which it then owns (one id per channel).
    pub fn with_channel(channel: EventChannel) -> Result<CmId> {
        let mut raw: *mut ffi::rdma_cm_id = std::ptr::null_mut();
        // SAFETY: valid channel; raw is an out-pointer; no user context.
        let rc = unsafe {
            ffi::rdma_create_id(
                channel.as_raw(),
                &mut raw,
                std::ptr::null_mut(),
                ffi::RDMA_PS_TCP,
            )
        };
        let raw = match (rc, NonNull::new(raw)) {
            (0, Some(raw)) => raw,
            _ => return Err(Error::verb("rdma_create_id", last_errno())),
        };
        Ok(CmId {
            inner: Arc::new(IdInner {
                raw,
                lock: Mutex::new(()),
                connecting: AtomicBool::new(false),
                channel,
            }),
        })
    }

    /// Wraps the new id of a connection request: moves it from the listener's
    /// channel to a fresh one of its own. On failure the id is destroyed.
    fn adopt_request(child: NonNull<ffi::rdma_cm_id>) -> Result<CmId> {
        let moved = EventChannel::new().and_then(|ch| {
            // SAFETY: child is a live id with no event outstanding (its connect
            // request was acknowledged); ch is a valid channel.
            let rc = unsafe { ffi::rdma_migrate_id(child.as_ptr(), ch.as_raw()) };
            if rc == 0 {
                Ok(ch)
            } else {
                Err(Error::verb("rdma_migrate_id", last_errno()))
            }
        });
        match moved {
            Ok(channel) => Ok(CmId {
                inner: Arc::new(IdInner {
                    raw: child,
                    lock: Mutex::new(()),
                    connecting: AtomicBool::new(false),
                    channel,
                }),
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
    pub fn channel(&self) -> &EventChannel {
        &self.inner.channel
    }

    /// Binds to a local address and port (`rdma_bind_addr`); port 0 picks one.
    /// Binding to a specific address also binds the id to that address's device.
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
    pub fn listen(&self, backlog: i32) -> Result<()> {
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        // SAFETY: valid id, under its lock.
        let rc = unsafe { ffi::rdma_listen(self.inner.id(), backlog) };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::verb("rdma_listen", last_errno()))
        }
    }

    /// A bound, listening id: [`CmId::new`], [`bind`](CmId::bind), [`listen`](CmId::listen).
    pub fn listener(addr: SocketAddr, backlog: i32) -> Result<CmId> {
        let id = CmId::new()?;
        id.bind(addr)?;
        id.listen(backlog)?;
        Ok(id)
    }

    /// Waits up to `timeout` for the next connection request on a listening id.
    /// Any other event ends the wait with its error.
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

    /// Resolves `dst` to a device, port and (RoCE) next-hop MAC
    /// (`rdma_resolve_addr`, waiting for ADDR_RESOLVED), optionally from
    /// `src`. The kernel gives up after `timeout` (ADDR_ERROR, status
    /// -ETIMEDOUT); this call returns at the latest 2 s after that.
    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let _own = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            self.start_resolve_addr_locked(src, dst, timeout)?;
            OwnEvents::mark(&self.inner)
        };
        self.inner
            .expect(
                CmEventKind::AddrResolved,
                "rdma_resolve_addr",
                "rdma_resolve_addr: waiting for ADDR_RESOLVED",
                timeout.saturating_add(RESOLVE_GRACE),
                false,
            )
            .map(drop)
    }

    /// Calls `rdma_resolve_addr` (ADDR_RESOLVED or ADDR_ERROR follows). Call
    /// with the lock held.
    fn start_resolve_addr_locked(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let mut d = RawAddr::new(dst);
        let mut s = src.map(RawAddr::new);
        let sp = s.as_mut().map_or(std::ptr::null_mut(), RawAddr::as_ptr);
        // SAFETY: valid id under its lock; the addresses are full sockaddrs.
        let rc = unsafe { ffi::rdma_resolve_addr(self.inner.id(), sp, d.as_ptr(), ms(timeout)) };
        if rc != 0 {
            let e = last_errno();
            let hint = match e.raw_os_error() {
                Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH) => {
                    Some(format!("there is no route to {}", dst.ip()))
                }
                Some(libc::ENODEV) | Some(libc::EADDRNOTAVAIL) => Some(format!(
                    "the route to {} does not go through an RDMA device",
                    dst.ip()
                )),
                _ => None,
            };
            return Err(Error::Verb {
                verb: "rdma_resolve_addr",
                source: e,
                hint,
            });
        }
        Ok(())
    }

    /// Resolves the route to the resolved address (`rdma_resolve_route`,
    /// waiting for ROUTE_RESOLVED; returns at the latest 2 s after `timeout`).
    pub fn resolve_route(&self, timeout: Duration) -> Result<()> {
        let _own = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            self.start_resolve_route_locked(timeout)?;
            OwnEvents::mark(&self.inner)
        };
        self.inner
            .expect(
                CmEventKind::RouteResolved,
                "rdma_resolve_route",
                "rdma_resolve_route: waiting for ROUTE_RESOLVED",
                timeout.saturating_add(RESOLVE_GRACE),
                false,
            )
            .map(drop)
    }

    /// Calls `rdma_resolve_route` (ROUTE_RESOLVED or ROUTE_ERROR follows).
    /// Call with the lock held.
    fn start_resolve_route_locked(&self, timeout: Duration) -> Result<()> {
        // librdmacm reads `id->verbs->device` without a check: NULL until an
        // address resolution (or a bind to a device's address) succeeded.
        // SAFETY: valid id under its lock (caller); verbs is a plain field.
        if unsafe { (*self.inner.id()).verbs }.is_null() {
            return Err(Error::InvalidArgument {
                what: "rdma_cm id",
                reason: "its route cannot be resolved before its address: call resolve_addr \
                         (and wait for it to succeed) first, or use resolve"
                    .into(),
            });
        }
        // SAFETY: valid id under its lock (caller), bound to a device.
        let rc = unsafe { ffi::rdma_resolve_route(self.inner.id(), ms(timeout)) };
        if rc != 0 {
            let source = last_errno();
            let hint = (source.raw_os_error() == Some(libc::ENODEV)).then(|| {
                "the address resolved to an interface without RDMA (a loopback address such as \
                 127.0.0.1 or ::1?): use an address of the RDMA interface itself"
                    .to_owned()
            });
            return Err(Error::Verb {
                verb: "rdma_resolve_route",
                source,
                hint,
            });
        }
        Ok(())
    }

    /// [`resolve_addr`](CmId::resolve_addr) then [`resolve_route`](CmId::resolve_route),
    /// each with `timeout`: what a client does before [`create_qp`](CmId::create_qp).
    pub fn resolve(&self, dst: SocketAddr, timeout: Duration) -> Result<()> {
        self.resolve_addr(None, dst, timeout)?;
        self.resolve_route(timeout)
    }

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
    pub fn local_addr(&self) -> Option<SocketAddr> {
        let _g = self.inner.lock();
        // SAFETY: valid id under its lock; the result points into the id.
        unsafe { read_addr(ffi::rdma_get_local_addr(self.inner.id())) }
    }

    /// The peer's address (`rdma_get_peer_addr`), once resolved or connected.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        let _g = self.inner.lock();
        // SAFETY: valid id under its lock; the result points into the id.
        let a = unsafe { read_addr(ffi::rdma_get_peer_addr(self.inner.id())) };
        a.filter(|a| !(a.ip().is_unspecified() && a.port() == 0))
    }

    /// Creates an RC QP for this id (`rdma_create_qp`), in INIT, ready for
    /// receives to be posted before [`connect`](CmId::connect) /
    /// [`ConnectRequest::accept`]. `pd` and the CQs must come from
    /// [`CmId::context`] (one PD and CQ may serve the QPs of many ids on the
    /// same device). The QP keeps this id alive.
    ///
    /// Access: the kernel's CM grants the QP REMOTE_WRITE, and REMOTE_READ
    /// and REMOTE_ATOMIC when this side accepts READs/atomics as target
    /// (responder resources above 0; the default [`ConnParam`] asks the
    /// device maximum). What a peer may touch is still decided by each
    /// [`Mr`](crate::Mr)'s own access flags.
    pub fn create_qp(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Init>> {
        self.create_qp_on(pd, send_cq, recv_cq, None, caps)
    }

    /// [`create_qp`](CmId::create_qp) for a QP whose receives come from the
    /// shared receive queue `srq`, as [`Qp::new_with_srq`] makes them:
    /// `recv_cq` must be the SRQ's CQ ([`Error::SrqCqMismatch`]), the QP
    /// reserves no receive entries and its `post_recv` is refused. The QP
    /// keeps the SRQ alive.
    pub fn create_qp_with_srq(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &crate::Srq,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Init>> {
        self.create_qp_on(pd, send_cq, recv_cq, Some(srq), caps)
    }

    fn create_qp_on(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: Option<&crate::Srq>,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Init>> {
        let (srq, caps) = match srq {
            Some(srq) => {
                let srq = srq.inner();
                if !Arc::ptr_eq(&srq.cq, &recv_cq.inner) {
                    return Err(Error::SrqCqMismatch);
                }
                srq.check_qp_pd(pd)?;
                let caps = QpCaps {
                    max_recv_wr: 0,
                    max_recv_sge: 0,
                    ..caps
                };
                (Some(srq.clone()), caps)
            }
            None => (None, caps),
        };
        let raw_srq = srq
            .as_ref()
            .map_or(std::ptr::null_mut(), |s| s.raw.as_ptr());
        let _g = self.inner.lock();
        // A connect waiting on another thread has its QP attached (below).
        self.inner.refuse_if_waiting()?;
        let id = self.inner.id();
        // SAFETY: valid id under its lock; plain fields.
        let (verbs, port, cur) = unsafe { ((*id).verbs, (*id).port_num, (*id).qp) };
        check_same_device(verbs, pd, &[send_cq, recv_cq])?;
        if !cur.is_null() {
            // A handshake in progress has its QP attached: rdma_create_qp
            // would replace it and the handshake would fail half-open.
            return Err(busy_id());
        }
        let keepalive: Box<dyn std::any::Any + Send + Sync> = Box::new(self.inner.clone());
        // SAFETY: rdma_create_qp creates an RC QP in `pd` from `init` (its CQs
        // unchanged), moves it to INIT with nothing posted and writes the granted
        // caps back; id->qp is cleared, so the Qp is its only owner. The CM
        // chooses the PSN (0 is a placeholder; psn() is meaningless for CM QPs).
        // The keepalive keeps the id alive until after ibv_destroy_qp.
        unsafe {
            Qp::build(
                pd,
                send_cq,
                recv_cq,
                caps,
                0,
                port,
                Some(keepalive),
                srq,
                |init| {
                    init.srq = raw_srq;
                    // SAFETY: valid id (under its lock), PD and CQs of its device; init
                    // is fully initialised. The id's previous PD is restored and
                    // id->qp cleared right after (see the module docs).
                    let (rc, qp) = {
                        let saved_pd = (*id).pd;
                        let rc = ffi::rdma_create_qp(id, pd.as_raw(), init);
                        let qp = (*id).qp;
                        (*id).qp = std::ptr::null_mut();
                        (*id).pd = saved_pd;
                        (rc, qp)
                    };
                    match (rc, NonNull::new(qp)) {
                        (0, Some(qp)) => Ok(qp),
                        _ => {
                            let e = last_errno();
                            let hint = match e.raw_os_error() {
                                Some(libc::EINVAL) => Some(
                                    "a capability (max_send_wr, max_recv_wr, max_*_sge, \
                                     max_inline_data) exceeds the device limits, or the id's \
                                     connection is gone (a connection request whose client \
                                     gave up)"
                                        .into(),
                                ),
                                _ => None,
                            };
                            Err(Error::Verb {
                                verb: "rdma_create_qp",
                                source: e,
                                hint,
                            })
                        }
                    }
                },
            )
        }
    }

    /// Connects to the resolved peer (`rdma_connect`) and waits up to
    /// `timeout` for ESTABLISHED, returning the QP in RTS and the ESTABLISHED
    /// event (with the peer's accept private data).
    ///
    /// librdmacm moves `qp` to RTR and RTS during the handshake; receives
    /// posted before stay posted. `qp` must be on this id's device (normally
    /// from [`CmId::create_qp`]). A REJECTED, UNREACHABLE or CONNECT_ERROR
    /// event is returned as [`Error::CmEvent`]; on any failure the QP is
    /// dropped, and the id should be dropped too (an rdma_cm id connects once).
    pub fn connect(
        &self,
        qp: Qp<Rc, Init>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(Qp<Rc, Rts>, CmEvent)> {
        param.validate()?;
        let handshake = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            let id = self.inner.id();
            // SAFETY: the lock is held while `attach` is a QpAttach: it becomes
            // a Handshake (which re-locks to detach) before the lock is
            // released; the QP outlives the Handshake (dropped below, and on
            // unwinding before the parameter `qp`).
            let attach =
                unsafe { attach_and_call(id, &qp, param, ffi::rdma_connect, "rdma_connect")? };
            self.inner.connecting.store(true, Ordering::Relaxed);
            Handshake::keep(&self.inner, attach)
        };
        // Without the lock between polls: getters and other calls on this id
        // do not wait for the handshake (event readers and `disconnect` see
        // `connecting` and leave the id's events and QP alone).
        let ev = self.inner.expect(
            CmEventKind::Established,
            "rdma_connect",
            "rdma_connect: waiting for ESTABLISHED",
            timeout,
            false,
        );
        drop(handshake);
        let ev = ev?;
        // SAFETY: ESTABLISHED on an id with this QP attached means librdmacm
        // processed the reply and moved the QP to RTR and RTS (else it reports
        // CONNECT_ERROR).
        Ok((unsafe { qp.assume_state::<Rts>() }, ev))
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
    pub fn disconnect(&self) -> Result<()> {
        let _g = self.inner.lock();
        self.inner.refuse_if_waiting()?;
        // SAFETY: valid id under its lock; id->qp is NULL, so librdmacm only
        // sends the disconnect.
        let rc = unsafe { ffi::rdma_disconnect(self.inner.id()) };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::verb("rdma_disconnect", last_errno()))
        }
    }

    /// Waits up to `timeout` for the next event of this id (the events of a
    /// handshake in progress in another thread are that handshake's).
    /// [`Error::Timeout { .. }`](Error::Timeout) when none came.
    pub fn get_event(&self, timeout: Duration) -> Result<CmEvent> {
        self.wait_event(timeout, "waiting for an rdma_cm event", timeout)
    }

    /// Waits up to `timeout` for the next event and checks that it is `kind`;
    /// any other event becomes its [`Error::CmEvent`].
    pub fn expect_event(&self, kind: CmEventKind, timeout: Duration) -> Result<CmEvent> {
        let ev = self.get_event(timeout)?;
        if ev.kind == kind {
            Ok(ev)
        } else {
            Err(ev.into_error("expect_event"))
        }
    }

    /// The next event without waiting, if one is there.
    /// `None` too while a [`connect`](CmId::connect) or a resolve on another
    /// thread waits (the events it waits for are its own).
    pub fn try_event(&self) -> Result<Option<CmEvent>> {
        let _g = self.inner.lock();
        if self.inner.connecting() {
            return Ok(None);
        }
        self.inner.try_event_locked()
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
                let _g = self.inner.lock();
                let connecting = self.inner.connecting();
                if !connecting {
                    if let Some(ev) = self.inner.try_event_locked()? {
                        return Ok(ev);
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
                poll_readable(self.inner.channel.fd(), deadline - now)?;
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

fn busy_id() -> Error {
    Error::InvalidArgument {
        what: "rdma_cm id",
        reason: "a QP is already attached to it (id->qp set outside this crate)".into(),
    }
}

fn not_bound() -> Error {
    Error::InvalidArgument {
        what: "rdma_cm id",
        reason: "it is not bound to a device yet: resolve the address and route first".into(),
    }
}

fn other_device(what: &'static str) -> Error {
    Error::InvalidArgument {
        what,
        reason: "it belongs to another device context than the rdma_cm id; create it from `CmId::context()`".into(),
    }
}

fn check_same_device(verbs: *mut ffi::ibv_context, pd: &Pd, cqs: &[&Cq]) -> Result<()> {
    if verbs.is_null() {
        return Err(not_bound());
    }
    if pd.context().as_raw() != verbs {
        return Err(other_device("protection domain"));
    }
    for cq in cqs {
        // SAFETY: the CQ is valid while borrowed; context is a plain field.
        if unsafe { (*cq.as_raw()).context } != verbs {
            return Err(other_device("completion queue"));
        }
    }
    Ok(())
}

fn check_qp_device(verbs: *mut ffi::ibv_context, qp: &Qp<Rc, Init>) -> Result<()> {
    if verbs.is_null() {
        return Err(not_bound());
    }
    // SAFETY: the QP is valid while borrowed; context is a plain field.
    if unsafe { (*qp.as_raw()).context } != verbs {
        return Err(other_device("queue pair"));
    }
    Ok(())
}

fn conn_call_error(verb: &'static str, e: io::Error) -> Error {
    let hint = match e.raw_os_error() {
        Some(libc::EINVAL) => Some(
            "check the private data length (InfiniBand/RoCE: at most 56 bytes on connect, 196 on accept), \
             responder_resources/initiator_depth (at most the device's max_qp_rd_atom/max_qp_init_rd_atom), \
             and that the address and route were resolved"
                .into(),
        ),
        _ => None,
    };
    Error::Verb {
        verb,
        source: e,
        hint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_names_follow_rdma_core() {
        assert_eq!(
            CmEventKind::from_raw(ffi::RDMA_CM_EVENT_REJECTED),
            CmEventKind::Rejected
        );
        assert_eq!(CmEventKind::Rejected.name(), "RDMA_CM_EVENT_REJECTED");
        assert_eq!(CmEventKind::TimewaitExit.as_raw(), 15);
        assert_eq!(CmEventKind::from_raw(99), CmEventKind::Unknown(99));
        for raw in 0..16 {
            let k = CmEventKind::from_raw(raw);
            // SAFETY: rdma_event_str returns a static string for any value.
            let c = unsafe { crate::device::cstr(ffi::rdma_event_str(raw)) };
            assert_eq!(k.name(), c);
        }
    }

    #[test]
    fn socket_addresses_round_trip() {
        for s in ["10.99.0.1:7174", "[fe80::1%3]:1", "0.0.0.0:0", "[::]:65535"] {
            let a: SocketAddr = s.parse().unwrap();
            let mut raw = RawAddr::new(a);
            // SAFETY: raw holds a full sockaddr of its family.
            let back = unsafe { read_addr(raw.as_ptr()) };
            assert_eq!(back, Some(a), "{s}");
        }
    }

    #[test]
    fn rejected_hints_name_the_cause() {
        let e = CmEvent {
            kind: CmEventKind::Rejected,
            status: 8,
            private_data: vec![],
            conn: ConnInfo::default(),
            request: None,
        }
        .into_error("rdma_connect");
        let s = e.to_string();
        assert!(
            s.contains("RDMA_CM_EVENT_REJECTED") && s.contains("nobody listens"),
            "{s}"
        );
        let e = CmEvent {
            kind: CmEventKind::AddrError,
            status: -libc::ETIMEDOUT,
            private_data: vec![],
            conn: ConnInfo::default(),
            request: None,
        }
        .into_error("rdma_resolve_addr");
        assert!(e.to_string().contains("ARP"), "{e}");
    }

    #[test]
    fn huge_timeouts_do_not_overflow() {
        assert!(deadline_after(Duration::MAX) > Instant::now());
        assert_eq!(ms(Duration::MAX), i32::MAX);
    }

    #[test]
    fn conn_param_limits() {
        assert!(ConnParam::new().private_data(&[0; 256]).validate().is_err());
        assert!(ConnParam::new().retry_count(8).validate().is_err());
        let p = ConnParam::new().private_data(b"abc");
        let c = p.to_ffi();
        assert_eq!(c.private_data_len, 3);
        assert_eq!(c.responder_resources, 255);
    }

    /// On a machine without RDMA (like the project's build hosts) the channel
    /// reports that clearly; elsewhere it opens.
    #[test]
    fn event_channel_reports_missing_rdma() {
        match EventChannel::new() {
            Ok(ch) => assert!(ch.fd() >= 0),
            Err(e) => {
                if !std::path::Path::new("/sys/class/infiniband").exists() {
                    assert!(
                        matches!(e, Error::NoRdmaSupport { .. } | Error::NoDevices),
                        "unexpected error without RDMA: {e}"
                    );
                }
            }
        }
    }
}
