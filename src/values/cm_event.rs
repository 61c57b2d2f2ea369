//! The kinds of rdma_cm events.

use crate::ffi;
use crate::sys::c_enum;

c_enum! {
    /// The kind of an rdma_cm event (`rdma_cm_event_type`).
    pub enum CmEventKind: u32 {
        /// `rdma_resolve_addr` succeeded.
        AddrResolved = ffi::RDMA_CM_EVENT_ADDR_RESOLVED => "RDMA_CM_EVENT_ADDR_RESOLVED",
        /// `rdma_resolve_addr` failed (status: negative errno).
        AddrError = ffi::RDMA_CM_EVENT_ADDR_ERROR => "RDMA_CM_EVENT_ADDR_ERROR",
        /// `rdma_resolve_route` succeeded.
        RouteResolved = ffi::RDMA_CM_EVENT_ROUTE_RESOLVED => "RDMA_CM_EVENT_ROUTE_RESOLVED",
        /// `rdma_resolve_route` failed.
        RouteError = ffi::RDMA_CM_EVENT_ROUTE_ERROR => "RDMA_CM_EVENT_ROUTE_ERROR",
        /// A peer asks to connect (listener side).
        ConnectRequest = ffi::RDMA_CM_EVENT_CONNECT_REQUEST => "RDMA_CM_EVENT_CONNECT_REQUEST",
        /// The peer answered a connect of an id without a QP.
        ConnectResponse = ffi::RDMA_CM_EVENT_CONNECT_RESPONSE => "RDMA_CM_EVENT_CONNECT_RESPONSE",
        /// Establishing the connection failed.
        ConnectError = ffi::RDMA_CM_EVENT_CONNECT_ERROR => "RDMA_CM_EVENT_CONNECT_ERROR",
        /// The peer did not answer.
        Unreachable = ffi::RDMA_CM_EVENT_UNREACHABLE => "RDMA_CM_EVENT_UNREACHABLE",
        /// The peer (or its CM) refused the connection.
        Rejected = ffi::RDMA_CM_EVENT_REJECTED => "RDMA_CM_EVENT_REJECTED",
        /// The connection is up.
        Established = ffi::RDMA_CM_EVENT_ESTABLISHED => "RDMA_CM_EVENT_ESTABLISHED",
        /// The connection is down (either side disconnected).
        Disconnected = ffi::RDMA_CM_EVENT_DISCONNECTED => "RDMA_CM_EVENT_DISCONNECTED",
        /// The RDMA device went away.
        DeviceRemoval = ffi::RDMA_CM_EVENT_DEVICE_REMOVAL => "RDMA_CM_EVENT_DEVICE_REMOVAL",
        /// A multicast join completed.
        MulticastJoin = ffi::RDMA_CM_EVENT_MULTICAST_JOIN => "RDMA_CM_EVENT_MULTICAST_JOIN",
        /// A multicast group failed.
        MulticastError = ffi::RDMA_CM_EVENT_MULTICAST_ERROR => "RDMA_CM_EVENT_MULTICAST_ERROR",
        /// The id's local address changed.
        AddrChange = ffi::RDMA_CM_EVENT_ADDR_CHANGE => "RDMA_CM_EVENT_ADDR_CHANGE",
        /// The QP left the time-wait state and may be reused.
        TimewaitExit = ffi::RDMA_CM_EVENT_TIMEWAIT_EXIT => "RDMA_CM_EVENT_TIMEWAIT_EXIT",
    }
}
