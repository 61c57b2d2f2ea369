//! Asynchronous events: what the device reports outside of completions.
//!
//! A QP that the hardware moved to an error state, a CQ that overflowed, a
//! port that went down or came up: libibverbs delivers these on the context's
//! async file descriptor. [`Context::async_events`] returns a reader whose
//! [`next`](AsyncEvents::next) sleeps on that descriptor (made non-blocking)
//! with a timeout, copies the event out as an [`AsyncEvent`] (the QP number,
//! CQ, SRQ or port it concerns are read *before* the event is acknowledged,
//! while the object is guaranteed to exist), and acknowledges it exactly once.
//!
//! ```no_run
//! use std::time::Duration;
//! let ctx = rdma_verbs::context::Context::open(None)?;
//! let mut events = ctx.async_events()?;
//! while let Some(ev) = events.next(Some(Duration::from_secs(1)))? {
//!     println!("{ev}");
//! }
//! # Ok::<(), rdma_verbs::Error>(())
//! ```
//!
//! Which events a device raises is up to its driver; the soft-RoCE findings
//! are recorded in `tests/vm_events.rs`.
//!
//! The async descriptor itself is not handed out: an event read from it
//! behind libibverbs' back is never acknowledged, and destroying the QP or
//! CQ it names then blocks forever. Event loops watch
//! [`AsyncEvents::readiness`] instead, which is readable when an event is
//! waiting but cannot consume one (see [`crate::channel`]).

use std::fmt;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::channel::{
    CqId, Readiness, ReadinessCell, deadline_after, poll_readable, set_nonblocking,
};
use crate::context::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::call::verb;

/// Identifies a shared receive queue in events (the address of its `ibv_srq`).
///
/// Compare with [`Srq::id`](crate::srq::Srq::id). Only meaningful while that SRQ
/// exists: the allocator hands a dropped SRQ's address to the next one (a
/// review saw one address for 22 of 40 SRQs created one after another), so
/// an event read after its SRQ was dropped can match a newer SRQ. Handle an
/// SRQ's events before dropping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrqId(pub(crate) usize);

impl SrqId {
    /// The id of a raw `ibv_srq`.
    pub fn from_raw(srq: *const ffi::ibv_srq) -> SrqId {
        SrqId(srq as usize)
    }

    /// The `ibv_srq` address as an integer.
    pub fn addr(self) -> usize {
        self.0
    }
}

/// One asynchronous event (`ibv_async_event`), copied out and acknowledged.
///
/// Each variant is one `ibv_event_type` and names the object it concerns.
#[doc(alias = "ibv_async_event")]
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncEvent {
    /// `IBV_EVENT_CQ_ERR`: the CQ overran (more completions than its depth).
    CqErr {
        /// The CQ (compare with [`crate::cq::Cq::id`]).
        cq: CqId,
    },
    /// `IBV_EVENT_QP_FATAL`: the QP hit an error it cannot report in a completion.
    QpFatal {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_QP_REQ_ERR`: invalid request on the QP (it is in ERR now).
    QpReqErr {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_QP_ACCESS_ERR`: local access violation (the QP is in ERR now).
    QpAccessErr {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_COMM_EST`: first packet received on a QP in RTR.
    CommEst {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_SQ_DRAINED`: the send queue of a QP in SQD has drained.
    SqDrained {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_PATH_MIG`: the QP migrated to its alternate path.
    PathMig {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_PATH_MIG_ERR`: path migration failed.
    PathMigErr {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_DEVICE_FATAL`: the device is unusable; close it.
    DeviceFatal,
    /// `IBV_EVENT_PORT_ACTIVE`: the port became ACTIVE.
    PortActive {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_PORT_ERR`: the port left ACTIVE (link down).
    PortErr {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_LID_CHANGE`: the port's LID changed.
    LidChange {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_PKEY_CHANGE`: the port's P_Key table changed.
    PkeyChange {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_SM_CHANGE`: the subnet manager changed.
    SmChange {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_SRQ_ERR`: the SRQ hit an error.
    SrqErr {
        /// The SRQ.
        srq: SrqId,
    },
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`: the SRQ fell below its armed limit.
    SrqLimitReached {
        /// The SRQ.
        srq: SrqId,
    },
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`: a QP on an SRQ in ERR consumed its last WQE.
    QpLastWqeReached {
        /// QP number.
        qp_num: u32,
    },
    /// `IBV_EVENT_CLIENT_REREGISTER`: the SM asks clients to re-register.
    ClientReregister {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_GID_CHANGE`: the port's GID table changed.
    GidChange {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_WQ_FATAL`: a work queue hit a fatal error.
    WqFatal {
        /// WQ number.
        wq_num: u32,
    },
    /// An event type this crate does not know (newer rdma-core).
    Unknown {
        /// The raw `ibv_event_type`.
        event_type: u32,
    },
}

impl AsyncEvent {
    /// Copies the event out. Reads through the element pointer, so the event
    /// must not be acknowledged yet.
    ///
    /// # Safety
    /// `ev` was filled by `ibv_get_async_event` and not yet acknowledged, so
    /// the QP/CQ/SRQ/WQ it names is alive.
    unsafe fn from_ffi(ev: &ffi::ibv_async_event) -> AsyncEvent {
        // Each closure reads the union member that the event type makes valid,
        // and is called only for such types.
        let qpn = || {
            // SAFETY: `qp` is the member set for QP events.
            let qp = unsafe { ev.element.qp };
            if qp.is_null() {
                0
            } else {
                // SAFETY: the QP is alive until the event is acked (caller's contract).
                unsafe { (*qp).qp_num }
            }
        };
        // SAFETY: `port_num` is the member set for port events.
        let port = || u8::try_from(unsafe { ev.element.port_num }).unwrap_or(0);
        // SAFETY: `srq` is the member set for SRQ events.
        let srq = || SrqId::from_raw(unsafe { ev.element.srq });
        use AsyncEvent::*;
        match ev.event_type {
            ffi::IBV_EVENT_CQ_ERR => CqErr {
                // SAFETY: `cq` is the member set for CQ events; only its address is used.
                cq: CqId::from_raw(unsafe { ev.element.cq }),
            },
            ffi::IBV_EVENT_QP_FATAL => QpFatal { qp_num: qpn() },
            ffi::IBV_EVENT_QP_REQ_ERR => QpReqErr { qp_num: qpn() },
            ffi::IBV_EVENT_QP_ACCESS_ERR => QpAccessErr { qp_num: qpn() },
            ffi::IBV_EVENT_COMM_EST => CommEst { qp_num: qpn() },
            ffi::IBV_EVENT_SQ_DRAINED => SqDrained { qp_num: qpn() },
            ffi::IBV_EVENT_PATH_MIG => PathMig { qp_num: qpn() },
            ffi::IBV_EVENT_PATH_MIG_ERR => PathMigErr { qp_num: qpn() },
            ffi::IBV_EVENT_DEVICE_FATAL => DeviceFatal,
            ffi::IBV_EVENT_PORT_ACTIVE => PortActive { port: port() },
            ffi::IBV_EVENT_PORT_ERR => PortErr { port: port() },
            ffi::IBV_EVENT_LID_CHANGE => LidChange { port: port() },
            ffi::IBV_EVENT_PKEY_CHANGE => PkeyChange { port: port() },
            ffi::IBV_EVENT_SM_CHANGE => SmChange { port: port() },
            ffi::IBV_EVENT_SRQ_ERR => SrqErr { srq: srq() },
            ffi::IBV_EVENT_SRQ_LIMIT_REACHED => SrqLimitReached { srq: srq() },
            ffi::IBV_EVENT_QP_LAST_WQE_REACHED => QpLastWqeReached { qp_num: qpn() },
            ffi::IBV_EVENT_CLIENT_REREGISTER => ClientReregister { port: port() },
            ffi::IBV_EVENT_GID_CHANGE => GidChange { port: port() },
            ffi::IBV_EVENT_WQ_FATAL => {
                // SAFETY: `wq` is the member set for WQ events.
                let wq = unsafe { ev.element.wq };
                let wq_num = if wq.is_null() {
                    0
                } else {
                    // SAFETY: the WQ is alive until the event is acked (caller's contract).
                    unsafe { (*wq).wq_num }
                };
                WqFatal { wq_num }
            }
            other => Unknown { event_type: other },
        }
    }

    /// The raw `ibv_event_type`.
    pub fn event_type(&self) -> u32 {
        use AsyncEvent::*;
        match self {
            CqErr { .. } => ffi::IBV_EVENT_CQ_ERR,
            QpFatal { .. } => ffi::IBV_EVENT_QP_FATAL,
            QpReqErr { .. } => ffi::IBV_EVENT_QP_REQ_ERR,
            QpAccessErr { .. } => ffi::IBV_EVENT_QP_ACCESS_ERR,
            CommEst { .. } => ffi::IBV_EVENT_COMM_EST,
            SqDrained { .. } => ffi::IBV_EVENT_SQ_DRAINED,
            PathMig { .. } => ffi::IBV_EVENT_PATH_MIG,
            PathMigErr { .. } => ffi::IBV_EVENT_PATH_MIG_ERR,
            DeviceFatal => ffi::IBV_EVENT_DEVICE_FATAL,
            PortActive { .. } => ffi::IBV_EVENT_PORT_ACTIVE,
            PortErr { .. } => ffi::IBV_EVENT_PORT_ERR,
            LidChange { .. } => ffi::IBV_EVENT_LID_CHANGE,
            PkeyChange { .. } => ffi::IBV_EVENT_PKEY_CHANGE,
            SmChange { .. } => ffi::IBV_EVENT_SM_CHANGE,
            SrqErr { .. } => ffi::IBV_EVENT_SRQ_ERR,
            SrqLimitReached { .. } => ffi::IBV_EVENT_SRQ_LIMIT_REACHED,
            QpLastWqeReached { .. } => ffi::IBV_EVENT_QP_LAST_WQE_REACHED,
            ClientReregister { .. } => ffi::IBV_EVENT_CLIENT_REREGISTER,
            GidChange { .. } => ffi::IBV_EVENT_GID_CHANGE,
            WqFatal { .. } => ffi::IBV_EVENT_WQ_FATAL,
            Unknown { event_type } => *event_type,
        }
    }

    /// The C name, e.g. `IBV_EVENT_QP_FATAL`.
    pub fn name(&self) -> &'static str {
        use AsyncEvent::*;
        match self {
            CqErr { .. } => "IBV_EVENT_CQ_ERR",
            QpFatal { .. } => "IBV_EVENT_QP_FATAL",
            QpReqErr { .. } => "IBV_EVENT_QP_REQ_ERR",
            QpAccessErr { .. } => "IBV_EVENT_QP_ACCESS_ERR",
            CommEst { .. } => "IBV_EVENT_COMM_EST",
            SqDrained { .. } => "IBV_EVENT_SQ_DRAINED",
            PathMig { .. } => "IBV_EVENT_PATH_MIG",
            PathMigErr { .. } => "IBV_EVENT_PATH_MIG_ERR",
            DeviceFatal => "IBV_EVENT_DEVICE_FATAL",
            PortActive { .. } => "IBV_EVENT_PORT_ACTIVE",
            PortErr { .. } => "IBV_EVENT_PORT_ERR",
            LidChange { .. } => "IBV_EVENT_LID_CHANGE",
            PkeyChange { .. } => "IBV_EVENT_PKEY_CHANGE",
            SmChange { .. } => "IBV_EVENT_SM_CHANGE",
            SrqErr { .. } => "IBV_EVENT_SRQ_ERR",
            SrqLimitReached { .. } => "IBV_EVENT_SRQ_LIMIT_REACHED",
            QpLastWqeReached { .. } => "IBV_EVENT_QP_LAST_WQE_REACHED",
            ClientReregister { .. } => "IBV_EVENT_CLIENT_REREGISTER",
            GidChange { .. } => "IBV_EVENT_GID_CHANGE",
            WqFatal { .. } => "IBV_EVENT_WQ_FATAL",
            Unknown { .. } => "unknown event",
        }
    }

    /// rdma-core's description (`ibv_event_type_str`), e.g. "local work queue catastrophic error".
    #[doc(alias = "ibv_event_type_str")]
    pub fn description(&self) -> String {
        // SAFETY: ibv_event_type_str returns a static string for any value.
        unsafe { crate::sys::cstr::cstr(ffi::ibv_event_type_str(self.event_type())) }
    }

    /// The QP number, for QP events.
    pub fn qp_num(&self) -> Option<u32> {
        use AsyncEvent::*;
        match *self {
            QpFatal { qp_num }
            | QpReqErr { qp_num }
            | QpAccessErr { qp_num }
            | CommEst { qp_num }
            | SqDrained { qp_num }
            | PathMig { qp_num }
            | PathMigErr { qp_num }
            | QpLastWqeReached { qp_num } => Some(qp_num),
            _ => None,
        }
    }

    /// The port number, for port events.
    pub fn port(&self) -> Option<u8> {
        use AsyncEvent::*;
        match *self {
            PortActive { port }
            | PortErr { port }
            | LidChange { port }
            | PkeyChange { port }
            | SmChange { port }
            | ClientReregister { port }
            | GidChange { port } => Some(port),
            _ => None,
        }
    }

    /// The CQ, for `CqErr`.
    pub fn cq(&self) -> Option<CqId> {
        match *self {
            AsyncEvent::CqErr { cq } => Some(cq),
            _ => None,
        }
    }
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.name(), self.description())?;
        if let Some(q) = self.qp_num() {
            write!(f, " on QP {q:#08x}")?;
        }
        if let Some(p) = self.port() {
            write!(f, " on port {p}")?;
        }
        match self {
            AsyncEvent::CqErr { cq } => write!(f, " on {cq}"),
            AsyncEvent::SrqErr { srq } | AsyncEvent::SrqLimitReached { srq } => {
                write!(f, " on srq@{:#x}", srq.0)
            }
            AsyncEvent::WqFatal { wq_num } => write!(f, " on WQ {wq_num:#x}"),
            AsyncEvent::Unknown { event_type } => write!(f, " type {event_type}"),
            _ => Ok(()),
        }
    }
}

/// Reads the asynchronous events of a device context.
///
/// Holds the context open. Several readers of one context split its events
/// between them; use one.
pub struct AsyncEvents {
    ctx: Context,
    readiness: ReadinessCell,
}

impl Context {
    /// A reader of this context's asynchronous events; makes the context's
    /// async fd non-blocking.
    pub fn async_events(&self) -> Result<AsyncEvents> {
        let r = AsyncEvents {
            ctx: self.clone(),
            readiness: ReadinessCell::default(),
        };
        set_nonblocking(r.fd()).map_err(|source| Error::Io {
            what: "making the async event fd non-blocking",
            source,
        })?;
        Ok(r)
    }
}

impl AsyncEvents {
    fn fd(&self) -> RawFd {
        // SAFETY: the context is open while self holds it; async_fd is a plain field.
        unsafe { (*self.ctx.as_raw()).async_fd }
    }

    /// The context the events come from.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// A handle that is readable when an event is waiting, for an
    /// application's own `poll`/`epoll`/`AsyncFd` (then read the event with
    /// [`try_next`](Self::try_next)). It cannot consume events itself: see
    /// [`Readiness`]. Created on first use.
    pub fn readiness(&self) -> Result<&Readiness> {
        self.readiness
            .get_or_watch(self.fd(), "creating the async event readiness epoll")
    }

    /// Reads one pending event without blocking (`ibv_get_async_event`, then
    /// `ibv_ack_async_event`); `None` when there is none.
    #[doc(alias("ibv_get_async_event", "ibv_ack_async_event"))]
    pub fn try_next(&mut self) -> Result<Option<AsyncEvent>> {
        let mut ev = MaybeUninit::<ffi::ibv_async_event>::zeroed();
        // SAFETY: valid context; ev is a valid out-struct.
        let done = verb!(errno: unsafe {
            ffi::ibv_get_async_event(self.ctx.as_raw(), ev.as_mut_ptr())
        });
        if let Err(failed) = done {
            return match failed.source.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                _ => Err(failed.into()),
            };
        }
        // SAFETY: filled by the successful call.
        let mut ev = unsafe { ev.assume_init() };
        // SAFETY: the event is not acknowledged yet, so what it names is alive.
        let out = unsafe { AsyncEvent::from_ffi(&ev) };
        // SAFETY: acknowledges the one event just read, exactly once; nothing
        // reads through its element pointer afterwards.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Ok(Some(out))
    }

    /// Sleeps until an event arrives (`ibv_get_async_event`) or `timeout`
    /// (`None`: forever) passes; `None` on timeout.
    #[doc(alias = "ibv_get_async_event")]
    pub fn next(&mut self, timeout: Option<Duration>) -> Result<Option<AsyncEvent>> {
        let deadline = timeout.map(deadline_after);
        loop {
            if let Some(ev) = self.try_next()? {
                return Ok(Some(ev));
            }
            if !poll_readable(self.fd(), deadline).map_err(|source| Error::Io {
                what: "waiting for async events",
                source,
            })? {
                return Ok(None);
            }
        }
    }

    /// Every event that arrives within `window` (for tests and diagnostics).
    pub fn collect_for(&mut self, window: Duration) -> Result<Vec<AsyncEvent>> {
        let end = deadline_after(window);
        let mut out = Vec::new();
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.next(Some(left))? {
                Some(ev) => out.push(ev),
                None => return Ok(out),
            }
        }
    }
}

impl fmt::Debug for AsyncEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEvents")
            .field("context", &self.ctx.name())
            .field("fd", &self.fd())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(event_type: u32) -> ffi::ibv_async_event {
        ffi::ibv_async_event {
            element: ffi::ibv_async_event__bindgen_ty_1 { port_num: 1 },
            event_type,
        }
    }

    #[test]
    fn every_event_type_maps_and_roundtrips() {
        for t in 0..=ffi::IBV_EVENT_WQ_FATAL {
            let mut e = ev(t);
            // Pointer-carrying events: use null pointers (read as 0 / null id).
            if ![
                ffi::IBV_EVENT_PORT_ACTIVE,
                ffi::IBV_EVENT_PORT_ERR,
                ffi::IBV_EVENT_LID_CHANGE,
                ffi::IBV_EVENT_PKEY_CHANGE,
                ffi::IBV_EVENT_SM_CHANGE,
                ffi::IBV_EVENT_CLIENT_REREGISTER,
                ffi::IBV_EVENT_GID_CHANGE,
                ffi::IBV_EVENT_DEVICE_FATAL,
            ]
            .contains(&t)
            {
                e.element = ffi::ibv_async_event__bindgen_ty_1 {
                    qp: std::ptr::null_mut(),
                };
            }
            // SAFETY: no pointer is dereferenced (they are null).
            let a = unsafe { AsyncEvent::from_ffi(&e) };
            assert!(!matches!(a, AsyncEvent::Unknown { .. }), "type {t}");
            assert_eq!(a.event_type(), t);
            assert!(a.name().starts_with("IBV_EVENT_"));
            assert!(!a.to_string().is_empty());
            if a.port().is_some() {
                assert_eq!(a.port(), Some(1));
            }
        }
        // SAFETY: an unknown type reads nothing through the element.
        let u = unsafe { AsyncEvent::from_ffi(&ev(999)) };
        assert_eq!(u, AsyncEvent::Unknown { event_type: 999 });
        assert_eq!(u.event_type(), 999);
    }

    #[test]
    fn qp_number_is_read_through_the_pointer() {
        let mut qp: ffi::ibv_qp = unsafe_zeroed();
        qp.qp_num = 0x1234;
        let e = ffi::ibv_async_event {
            element: ffi::ibv_async_event__bindgen_ty_1 { qp: &mut qp },
            event_type: ffi::IBV_EVENT_QP_FATAL,
        };
        // SAFETY: the element points to a live ibv_qp.
        let a = unsafe { AsyncEvent::from_ffi(&e) };
        assert_eq!(a, AsyncEvent::QpFatal { qp_num: 0x1234 });
        assert_eq!(a.qp_num(), Some(0x1234));
        assert!(a.to_string().contains("QP 0x001234"), "{a}");
    }

    fn unsafe_zeroed<T>() -> T {
        // SAFETY: only used for plain C structs of integers and raw pointers,
        // for which all-zero is valid.
        unsafe { std::mem::zeroed() }
    }
}
