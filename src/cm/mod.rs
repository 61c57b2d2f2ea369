//! librdmacm: connecting with IP addresses and ports instead of exchanging
//! QP numbers out of band.
//!
//! The active side resolves the peer, creates its QP on the id and connects;
//! the passive side binds and listens, takes a [`ConnectRequest`] with
//! [`CmId::get_request`], creates its QP on the request's id and accepts it.
//! Both QPs end in RTS, with receives posted in INIT carried over. For UD
//! (`RDMA_PS_UDP`, what `udaddy` does) see [`CmId::new_ud`] and [`UdPeer`]; for
//! UD multicast (what `mckey` does), [`CmId::join_multicast`].
//! ```no_run
//! use std::time::Duration;
//! use rdma_verbs::cm::{CmId, ConnParam};
//! use rdma_verbs::prelude::*;
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
//! Many connections at once from one thread: [`connect_all`] and [`accept_all`]
//! (each connection's next step on its event, as `cmtime` does).
//!
//! Every [`CmId`] owns its [`EventChannel`] (the async layer's ids share one
//! per runtime, with each event routed to its id); each event is copied into a
//! [`CmEvent`] and acknowledged at once. Every wait takes a timeout and ends
//! with [`Error::CmEvent`] (naming the event and what it usually means) or
//! [`Error::Timeout { .. }`](Error::Timeout), never a hang. Event loops watch
//! [`EventChannel::readiness`]; the descriptor itself is not handed out.
//!
//! [`ConnParam::private_data`] reaches the peer zero-padded to the CM message's
//! size (56 bytes on connect, 196 on accept, 148 on reject): compare prefixes.
//! To hand the peer a region for its WRITEs and READs, send
//! [`RemoteMr::to_bytes`](crate::mr::RemoteMr::to_bytes) there and read it with
//! [`RemoteMr::from_bytes`](crate::mr::RemoteMr::from_bytes).
//!
//! The QP is owned by its `Qp` alone: this module attaches it to the id
//! (`id->qp`) only during `connect`/`accept` and clears it after, so no
//! librdmacm call reaches a destroyed QP. Hence [`CmId::disconnect`] does not
//! flush the QP; call [`Qp::to_error`] for that. The id's `ibv_context`
//! belongs to librdmacm: create the PD and CQs from [`CmId::context`].

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
mod batch;
mod create_qp;
pub(crate) mod event;
mod handshake;
mod id;
mod inner;
mod mcast;
mod param;
mod request;
mod resolve;
#[cfg(feature = "tokio")]
mod shared;
mod ud;

use addr::*;
pub use batch::{Connected, accept_all, connect_all};
use create_qp::*;
use event::*;
pub use event::{CmEvent, CmEventKind, ConnInfo, EventChannel};
#[cfg(feature = "tokio")]
pub(crate) use handshake::Handshake;
use handshake::*;
pub use id::CmId;
use inner::*;
use mcast::Joined;
pub use param::ConnParam;
pub use request::{ConnectRequest, REJECT_PRIVATE_DATA_MAX};
#[cfg(feature = "tokio")]
use shared::RoutesGuard;
#[cfg(feature = "tokio")]
pub(crate) use shared::SharedChannel;
use ud::check_port_space;
#[cfg(feature = "tokio")]
pub(crate) use ud::ud_peer;
pub use ud::{UDP_QKEY, UdParam, UdPeer};

/// How long an event reader sleeps between looks while a blocking connect on
/// another thread owns the id's events.
const CONNECTING_SLICE: Duration = Duration::from_millis(10);

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
            ud: None,
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
            ud: None,
            request: None,
        }
        .into_error("rdma_resolve_addr");
        assert!(e.to_string().contains("ARP"), "{e}");
    }

    #[test]
    fn unreachable_hints_tell_sidr_statuses_from_errnos() {
        let unreachable = |status| {
            CmEvent {
                kind: CmEventKind::Unreachable,
                status,
                private_data: vec![],
                conn: ConnInfo::default(),
                ud: None,
                request: None,
            }
            .into_error("rdma_connect (UD)")
            .to_string()
        };
        let s = unreachable(1);
        assert!(
            s.contains("nobody listens") && s.contains("SIDR status 1"),
            "{s}"
        );
        let s = unreachable(2);
        assert!(s.contains("rejected") && s.contains("SIDR status 2"), "{s}");
        let s = unreachable(-libc::ETIMEDOUT);
        assert!(s.contains("did not answer") && !s.contains("SIDR"), "{s}");
    }

    #[test]
    fn multicast_errors_say_what_failed() {
        let e = CmEvent {
            kind: CmEventKind::MulticastError,
            status: -libc::ENODEV,
            private_data: vec![],
            conn: ConnInfo::default(),
            ud: None,
            request: None,
        }
        .into_error("rdma_join_multicast");
        let s = e.to_string();
        assert!(
            s.contains("RDMA_CM_EVENT_MULTICAST_ERROR") && s.contains("multicast group"),
            "{s}"
        );
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
