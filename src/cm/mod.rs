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
use crate::enums::c_enum;
use crate::error::{Error, Result, last_errno};
use crate::ffi;
use crate::pd::Pd;
use crate::qp::{Init, Qp, QpCaps, Rc, Rts};

mod addr;
mod create_qp;
mod event;
mod handshake;
mod id;
mod inner;
mod param;
mod request;
mod resolve;

use addr::*;
use create_qp::*;
use event::*;
pub use event::{CmEvent, CmEventKind, ConnInfo, EventChannel};
use handshake::*;
pub use id::CmId;
use inner::*;
pub use param::ConnParam;
pub use request::{ConnectRequest, REJECT_PRIVATE_DATA_MAX};

/// How long an event reader sleeps between looks while a blocking connect on
/// another thread owns the id's events.
const CONNECTING_SLICE: Duration = Duration::from_millis(10);

/// How long past its own timeout a resolution may take before the wait gives up.
const RESOLVE_GRACE: Duration = Duration::from_secs(2);

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
