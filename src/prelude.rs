//! The types most programs name, for `use rdma_verbs::prelude::*;`.
//!
//! Each type's own path is its module (`rdma_verbs::qp::Qp`); these are
//! re-exports of those, nothing else.
//!
//! Unlike `use rdma_verbs::*`, the prelude brings in no module, so it shadows
//! no crate of the same name (the `tokio` module with the `tokio` feature,
//! `ffi`, `error`): `tokio::runtime` still names the tokio crate after it.

pub use crate::ah::AddressHandle;
pub use crate::channel::CompletionChannel;
pub use crate::context::Context;
pub use crate::cq::{Completion, CompletionSource, Cq, WcOpcode, WcStatus};
pub use crate::device::{Gid, Mtu};
pub use crate::error::{Error, Result};
pub use crate::mr::{AccessFlags, Mr, MrPool, RemoteMr, SharedMr};
pub use crate::mw::{Mw, MwType};
pub use crate::pd::Pd;
pub use crate::qp::scope::{Dst, Src};
pub use crate::qp::{
    AddressVector, Endpoint, Init, InitAttr, PostError, Qp, QpCaps, Rc, RecvWr, Reset, Rtr,
    RtrAttr, Rts, RtsAttr, SendWr, TransitionError, Uc, UcInitAttr, UcRtrAttr, UcSendWr, Ud,
    UdInitAttr, UdRecvWr, UdSendWr,
};
pub use crate::srq::{Srq, SrqAttr};
