//! QP states and types as zero-sized marker types.
//!
//! The state parameter of [`Qp`](super::Qp) is the last state this process
//! moved the QP to. The hardware may still move it to ERR on its own (a failed
//! work request, a fatal event): that shows up as error completions and async
//! events, and [`Qp::query`](super::Qp::query) reports the real state.

mod sealed {
    pub trait Sealed {}
}

/// A QP state marker.
///
/// The state parameter of [`Qp`](super::Qp) is the last state this process
/// moved the QP to. The hardware may still move it to ERR on its own (a failed
/// work request, a fatal event): that shows up as error completions and async
/// events, and [`Qp::query`](super::Qp::query) reports the real state.
pub trait QpState: sealed::Sealed + Send + Sync + 'static {
    /// The state's name, as in `ibv_qp_state`.
    const NAME: &'static str;
}

/// States in which receives may be posted (INIT, RTR, RTS).
#[diagnostic::on_unimplemented(
    message = "receives can be posted only from INIT on: this QP is in `{Self}`",
    label = "call `init` first",
    note = "the QP state machine is RESET -> init -> INIT -> rtr -> RTR -> rts -> RTS"
)]
pub trait CanPostRecv: QpState {}

/// States in which send-queue requests may be posted (RTS).
#[diagnostic::on_unimplemented(
    message = "sends, WRITEs, READs and atomics can be posted only in RTS: this QP is in `{Self}`",
    label = "connect the QP first (`connect`, or `rtr` then `rts`)",
    note = "the QP state machine is RESET -> init -> INIT -> rtr -> RTR -> rts -> RTS"
)]
pub trait CanPostSend: QpState {}

/// States the kernel lets a QP move to ERR from: every one but RESET (INIT,
/// RTR, RTS and ERR itself), as the IB spec's state diagram has it.
#[diagnostic::on_unimplemented(
    message = "a QP in `{Self}` cannot be moved to ERR: the kernel refuses RESET -> ERR",
    label = "a QP in RESET has no work to flush; `init` it first, or just drop it",
    note = "every state but RESET can move to ERR (INIT, RTR, RTS, ERR)"
)]
pub trait CanMoveToError: QpState {}

/// A QP transport type marker.
pub trait QpType: sealed::Sealed + Send + Sync + 'static {
    /// The `ibv_qp_type` value.
    const RAW: crate::ffi::ibv_qp_type;
}

macro_rules! marker {
    ($(#[$m:meta])* $name:ident, $text:literal) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name;
        impl sealed::Sealed for $name {}
        impl QpState for $name {
            const NAME: &'static str = $text;
        }
    };
}

marker!(
    /// RESET: just created, or reset.
    Reset, "RESET"
);
marker!(
    /// INIT: receives may be posted; nothing is sent or received yet.
    Init, "INIT"
);
marker!(
    /// RTR: ready to receive.
    Rtr, "RTR"
);
marker!(
    /// RTS: ready to send.
    Rts, "RTS"
);
marker!(
    /// ERR: every outstanding work request is flushed with WR_FLUSH_ERR.
    ErrorState, "ERR"
);

impl CanPostRecv for Init {}
impl CanPostRecv for Rtr {}
impl CanPostRecv for Rts {}
impl CanPostSend for Rts {}
impl CanMoveToError for Init {}
impl CanMoveToError for Rtr {}
impl CanMoveToError for Rts {}
impl CanMoveToError for ErrorState {}

/// Reliable Connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rc;
impl sealed::Sealed for Rc {}
impl QpType for Rc {
    const RAW: crate::ffi::ibv_qp_type = crate::ffi::IBV_QPT_RC;
}

/// Unreliable Connected: SEND and RDMA WRITE to one peer QP, no
/// acknowledgements (a lost packet loses the message, silently).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Uc;
impl sealed::Sealed for Uc {}
impl QpType for Uc {
    const RAW: crate::ffi::ibv_qp_type = crate::ffi::IBV_QPT_UC;
}

/// Unreliable Datagram: SENDs of at most one path MTU to any UD QP, each
/// addressed by an [`AddressHandle`](crate::ah::AddressHandle), remote QPN and
/// Q_Key; receives carry a 40-byte GRH before the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ud;
impl sealed::Sealed for Ud {}
impl QpType for Ud {
    const RAW: crate::ffi::ibv_qp_type = crate::ffi::IBV_QPT_UD;
}

/// Connected transports (RC, UC): receives are plain [`RecvWr`](super::RecvWr)s.
/// UD receives take a GRH buffer too ([`UdRecvWr`](super::UdRecvWr)).
pub trait Connected: QpType {}
impl Connected for Rc {}
impl Connected for Uc {}
