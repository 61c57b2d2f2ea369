//! rdma_cm events: their kinds, what is copied out of them, and the channel they arrive on.

use super::*;

pub use crate::values::CmEventKind;

/// An rdma_cm event channel (`rdma_event_channel`): the file descriptor the
/// kernel reports an id's events on.
///
/// Each [`CmId`] owns one (the async layer's ids share one per runtime; see
/// the [module docs](crate::cm)); its descriptor is
/// non-blocking and private. An application's own `poll`/`epoll` set watches
/// [`readiness`](Self::readiness) (readable = an event is waiting for
/// [`CmId::get_event`] / [`CmId::try_event`]).
pub struct EventChannel {
    raw: NonNull<ffi::rdma_event_channel>,
    readiness: ReadinessCell,
}

// SAFETY: an event channel is a file descriptor; librdmacm keeps no other
// state in it, and reading events from several threads is serialised by the kernel.
unsafe impl Send for EventChannel {}
// SAFETY: as above; through &EventChannel only the fd is read.
unsafe impl Sync for EventChannel {}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: raw came from rdma_create_event_channel; the id using it (if
        // any) was destroyed before (IdInner drops its channel last).
        unsafe { ffi::rdma_destroy_event_channel(self.raw.as_ptr()) };
    }
}

impl EventChannel {
    /// Opens a channel (`rdma_create_event_channel`) and makes it non-blocking.
    ///
    /// On a kernel without RDMA support this is [`Error::NoRdmaSupport`];
    /// with support but no device, [`Error::NoDevices`].
    #[doc(alias = "rdma_create_event_channel")]
    pub fn new() -> Result<EventChannel> {
        // SAFETY: plain constructor call.
        let raw = unsafe { ffi::rdma_create_event_channel() };
        let Some(raw) = NonNull::new(raw) else {
            return Err(channel_error(last_errno()));
        };
        let ch = EventChannel {
            raw,
            readiness: ReadinessCell::default(),
        };
        let fd = ch.fd();
        // SAFETY: fd is the channel's open descriptor; F_GETFL/F_SETFL only
        // change its status flags.
        let rc = unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl < 0 {
                fl
            } else {
                libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK)
            }
        };
        if rc < 0 {
            return Err(Error::Io {
                what: "making the rdma_cm event channel non-blocking",
                source: last_errno(),
            });
        }
        Ok(ch)
    }

    /// The raw channel. An event read through it (`rdma_get_cm_event`) must
    /// be acknowledged by whoever read it, or destroying its id blocks forever.
    pub fn as_raw(&self) -> *mut ffi::rdma_event_channel {
        self.raw.as_ptr()
    }

    /// A handle that is readable when an event is waiting, for an
    /// application's own `poll`/`epoll`/`AsyncFd` (then read the event with
    /// [`CmId::try_event`]). It cannot consume events itself: see
    /// [`Readiness`]. Created on first use.
    pub fn readiness(&self) -> Result<&Readiness> {
        self.readiness.get_or_watch(
            self.fd(),
            "creating the rdma_cm event channel's readiness epoll",
        )
    }

    pub(super) fn fd(&self) -> RawFd {
        // SAFETY: raw is valid while self lives; fd is a plain field.
        unsafe { (*self.raw.as_ptr()).fd }
    }
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

/// Why `rdma_create_event_channel` failed, in the crate's terms.
fn channel_error(e: io::Error) -> Error {
    match e.raw_os_error() {
        Some(libc::ENODEV) | Some(libc::ENOSYS) => match crate::device::devices() {
            Err(Error::NoRdmaSupport { .. }) => Error::NoRdmaSupport {
                verb: "rdma_create_event_channel",
            },
            Ok(list) if list.is_empty() => Error::NoDevices,
            // Devices exist: librdmacm itself is what failed.
            _ => Error::Verb {
                verb: "rdma_create_event_channel",
                source: e,
                hint: Some("RDMA devices exist but the RDMA CM is unavailable; load rdma_ucm (`modprobe rdma_ucm`)".into()),
            },
        },
        Some(libc::ENOENT) => Error::Verb {
            verb: "rdma_create_event_channel",
            source: e,
            hint: Some("/dev/infiniband/rdma_cm is missing; load rdma_ucm (`modprobe rdma_ucm`)".into()),
        },
        Some(libc::EACCES) | Some(libc::EPERM) => Error::Verb {
            verb: "rdma_create_event_channel",
            source: e,
            hint: Some("no permission on /dev/infiniband/rdma_cm (or an unsupported rdma_ucm ABI)".into()),
        },
        _ => Error::verb("rdma_create_event_channel", e),
    }
}

/// What a peer asked for or granted, from a connection event (`rdma_conn_param`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct ConnInfo {
    /// Outstanding RDMA READ/atomic requests the sender accepts as target.
    pub responder_resources: u8,
    /// Outstanding RDMA READ/atomic requests the sender issues.
    pub initiator_depth: u8,
    /// Hardware flow control.
    pub flow_control: u8,
    /// Transport retries.
    pub retry_count: u8,
    /// RNR retries.
    pub rnr_retry_count: u8,
    /// Whether the sender's QP uses an SRQ.
    pub srq: u8,
    /// The sender's QP number.
    pub qp_num: u32,
}

/// One rdma_cm event, copied out of librdmacm's buffer and already
/// acknowledged.
pub struct CmEvent {
    /// What happened.
    pub kind: CmEventKind,
    /// 0, a negative errno, or (REJECTED on InfiniBand/RoCE) the IB CM reject
    /// reason, or (UNREACHABLE answering a UD connect) the SIDR status.
    pub status: i32,
    /// Private data that came with the event (padded; see the [module docs](crate::cm)).
    pub private_data: Vec<u8>,
    /// The connection parameters that came with it (connection events of
    /// RC ids; all zero on UD ids).
    pub conn: ConnInfo,
    /// On a UD id ([`CmId::new_ud`]), the peer's address, QP number and Q_Key
    /// that came with ESTABLISHED (the answer to
    /// [`connect_ud`](CmId::connect_ud)), or the group's that came with
    /// MULTICAST_JOIN ([`join_multicast`](CmId::join_multicast): QPN
    /// [`MULTICAST_QPN`](crate::qp::MULTICAST_QPN)); `None` otherwise.
    pub ud: Option<UdParam>,
    pub(super) request: Option<ConnectRequest>,
}

impl CmEvent {
    /// For a CONNECT_REQUEST on a listener: the request, to accept or reject.
    /// Dropping it unanswered rejects the peer.
    pub fn take_request(&mut self) -> Option<ConnectRequest> {
        self.request.take()
    }

    /// This event as the error of `op` when something else was expected,
    /// with a hint of what it usually means.
    pub fn into_error(self, op: &'static str) -> Error {
        Error::CmEvent {
            op,
            event: self.kind,
            status: self.status,
            hint: event_hint(self.kind, self.status),
            private_data: self.private_data,
        }
    }
}

/// How long past its own timeout a resolution may take before the wait gives
/// up (the kernel reports a resolution's timeout only after it).
const RESOLVE_GRACE: Duration = Duration::from_secs(2);

/// An event a call waits for, and how the wait names itself: one per call,
/// shared by the blocking calls and their futures (`crate::tokio`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Awaited {
    /// The event that ends the wait.
    kind: CmEventKind,
    /// The call, as another event's error names it.
    op: &'static str,
    /// The wait, as a timeout names it.
    pub(crate) what: &'static str,
    /// How much longer than the call's timeout the wait lasts.
    grace: Duration,
}

impl Awaited {
    /// `rdma_resolve_addr`'s ADDR_RESOLVED.
    pub(crate) const ADDR_RESOLVED: Awaited = Awaited {
        kind: CmEventKind::AddrResolved,
        op: "rdma_resolve_addr",
        what: "rdma_resolve_addr: waiting for ADDR_RESOLVED",
        grace: RESOLVE_GRACE,
    };
    /// `rdma_resolve_route`'s ROUTE_RESOLVED.
    pub(crate) const ROUTE_RESOLVED: Awaited = Awaited {
        kind: CmEventKind::RouteResolved,
        op: "rdma_resolve_route",
        what: "rdma_resolve_route: waiting for ROUTE_RESOLVED",
        grace: RESOLVE_GRACE,
    };
    /// `rdma_connect`'s ESTABLISHED.
    pub(crate) const CONNECTED: Awaited = Awaited {
        kind: CmEventKind::Established,
        op: "rdma_connect",
        what: "rdma_connect: waiting for ESTABLISHED",
        grace: Duration::ZERO,
    };
    /// A UD `rdma_connect`'s ESTABLISHED (the peer's SIDR reply).
    pub(crate) const UD_CONNECTED: Awaited = Awaited {
        kind: CmEventKind::Established,
        op: "rdma_connect (UD)",
        what: "rdma_connect (UD): waiting for the peer's SIDR reply (ESTABLISHED)",
        grace: Duration::ZERO,
    };
    /// `rdma_accept`'s ESTABLISHED.
    pub(crate) const ACCEPTED: Awaited = Awaited {
        kind: CmEventKind::Established,
        op: "rdma_accept",
        what: "rdma_accept: waiting for ESTABLISHED",
        grace: Duration::ZERO,
    };
    /// `rdma_join_multicast`'s MULTICAST_JOIN.
    pub(crate) const MCAST_JOINED: Awaited = Awaited {
        kind: CmEventKind::MulticastJoin,
        op: "rdma_join_multicast",
        what: "rdma_join_multicast: waiting for MULTICAST_JOIN",
        grace: Duration::ZERO,
    };
    /// `rdma_disconnect`'s DISCONNECTED (only the futures wait for it).
    #[cfg(feature = "tokio")]
    pub(crate) const DISCONNECTED: Awaited = Awaited {
        kind: CmEventKind::Disconnected,
        op: "rdma_disconnect",
        what: "rdma_disconnect: waiting for DISCONNECTED",
        grace: Duration::ZERO,
    };

    /// How long to wait for a call given `timeout`.
    pub(crate) fn limit(&self, timeout: Duration) -> Duration {
        timeout.saturating_add(self.grace)
    }

    /// What `ev` does to the wait: the awaited event ends it (`Some(Ok)`),
    /// the harmless ADDR_CHANGE / TIMEWAIT_EXIT leave it waiting (`None`),
    /// any other ends it with its error.
    pub(crate) fn judge(&self, ev: CmEvent) -> Option<Result<CmEvent>> {
        if ev.kind == self.kind {
            return Some(Ok(ev));
        }
        if matches!(ev.kind, CmEventKind::AddrChange | CmEventKind::TimewaitExit) {
            return None;
        }
        Some(Err(ev.into_error(self.op)))
    }
}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("kind", &self.kind)
            .field("status", &self.status)
            .field("private_data", &self.private_data.len())
            .field("conn", &self.conn)
            .field("ud", &self.ud)
            .field("request", &self.request.is_some())
            .finish()
    }
}

fn event_hint(kind: CmEventKind, status: i32) -> Option<String> {
    let errno_text = || io::Error::from_raw_os_error(status.saturating_abs()).to_string();
    let h = match kind {
        CmEventKind::AddrError => match -status {
            libc::ETIMEDOUT => {
                "nothing answered ARP/neighbour discovery for that address: is it up, on the network of an RDMA device?"
                    .to_owned()
            }
            libc::ENETUNREACH | libc::EHOSTUNREACH => "there is no route to that address".to_owned(),
            libc::ENODEV | libc::EADDRNOTAVAIL => {
                "the route to that address does not go through an RDMA device (is rxe/RoCE set up on that interface?)"
                    .to_owned()
            }
            _ => format!("address resolution failed: {}", errno_text()),
        },
        CmEventKind::RouteError => {
            format!("route resolution failed ({}); on InfiniBand, is a subnet manager running?", errno_text())
        }
        CmEventKind::Rejected => match status {
            8 => "nobody listens on that address and port (IB CM reject reason 8: invalid service ID)".to_owned(),
            28 => "the peer application rejected the connection, or its process exited or was killed \
                   before accepting (IB CM reject reason 28: consumer defined; see private_data)"
                .to_owned(),
            s => format!("the connection was refused (IB CM reject reason {s})"),
        },
        // A UD connect's SIDR reply with a failure status (positive: the IB
        // CM's SIDR status, where RC's UNREACHABLE carries a negative errno).
        CmEventKind::Unreachable if status > 0 => match status {
            1 => "nobody listens for UD (RDMA_PS_UDP) requests on that address and port \
                  (SIDR status 1: service ID not supported)"
                .to_owned(),
            2 => "the peer application rejected the UD request (SIDR status 2)".to_owned(),
            3 => "the peer accepted without a QP (SIDR status 3)".to_owned(),
            s => format!("the UD request was refused (SIDR status {s})"),
        },
        CmEventKind::Unreachable => format!(
            "the peer did not answer the connection request ({}); is the peer up and its port reachable?",
            errno_text()
        ),
        CmEventKind::ConnectError => {
            format!("the connection could not be established ({})", errno_text())
        }
        CmEventKind::Disconnected => "the peer disconnected".to_owned(),
        CmEventKind::MulticastError => format!(
            "the multicast group could not be joined or was lost ({}); on InfiniBand the subnet \
             manager refused or dropped the group, on RoCE the interface left it (address change?)",
            errno_text()
        ),
        CmEventKind::DeviceRemoval => "the RDMA device was removed".to_owned(),
        _ => return None,
    };
    Some(h)
}

/// Copies what the crate needs out of a librdmacm event: the event
/// (without its request) and, for a CONNECT_REQUEST, the new id.
///
/// # Safety
/// `ev` is a valid, not yet acknowledged event.
pub(super) unsafe fn copy_event(
    ev: *const ffi::rdma_cm_event,
) -> (CmEvent, Option<NonNull<ffi::rdma_cm_id>>) {
    // SAFETY: ev is valid (caller).
    let e = unsafe { &*ev };
    let kind = CmEventKind::from_raw(e.event);
    let mut out = CmEvent {
        kind,
        status: e.status,
        private_data: Vec::new(),
        conn: ConnInfo::default(),
        ud: None,
        request: None,
    };
    // SAFETY: librdmacm points `id` at the event's id (the new one for a
    // CONNECT_REQUEST, of the listener's port space), valid until the ack.
    let ud = unsafe { (*e.id).qp_type } == ffi::IBV_QPT_UD;
    if matches!(
        kind,
        CmEventKind::MulticastJoin | CmEventKind::MulticastError
    ) {
        // param.ud's private_data of a multicast event is the join's user
        // context, not data; JOIN's address, QPN and Q_Key are the group's.
        if kind == CmEventKind::MulticastJoin {
            // SAFETY: librdmacm fills param.ud for multicast events.
            out.ud = Some(UdParam::from_ffi(unsafe { &e.param.ud }));
        }
    } else if ud {
        // SAFETY: librdmacm fills param.ud for the ids of UD port spaces.
        let p = unsafe { e.param.ud };
        // SAFETY: as below: private_data_len bytes inside the event.
        out.private_data = unsafe { copy_private_data(p.private_data, p.private_data_len) };
        out.ud = (kind == CmEventKind::Established).then(|| UdParam::from_ffi(&p));
    } else {
        // SAFETY: for connected ids librdmacm fills param.conn.
        let c = unsafe { e.param.conn };
        // SAFETY: as below: private_data_len bytes inside the event.
        out.private_data = unsafe { copy_private_data(c.private_data, c.private_data_len) };
        out.conn = ConnInfo {
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            flow_control: c.flow_control,
            retry_count: c.retry_count,
            rnr_retry_count: c.rnr_retry_count,
            srq: c.srq,
            qp_num: c.qp_num,
        };
    }
    let child = if kind == CmEventKind::ConnectRequest {
        NonNull::new(e.id)
    } else {
        None
    };
    (out, child)
}

/// The private data of an event, copied.
///
/// # Safety
/// `data` is NULL or points to `len` readable bytes (librdmacm points it
/// inside the event, valid until the ack).
unsafe fn copy_private_data(data: *const libc::c_void, len: u8) -> Vec<u8> {
    if data.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }.to_vec()
}
