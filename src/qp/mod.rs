//! Queue pairs: the state machine in types, and a data path safe code cannot misuse.
//!
//! # The state machine
//! `Qp<Rc, Reset>` → [`init`](Qp::init) → `Qp<Rc, Init>` → [`rtr`](Qp::rtr) → `Qp<Rc, Rtr>` →
//! [`rts`](Qp::rts) → `Qp<Rc, Rts>`; [`to_error`](Qp::to_error) (to the ERR state [`ErrorState`]) and
//! [`reset`](Qp::reset) from any state (ERR not from RESET). Each transition consumes the QP and
//! takes exactly the attributes the kernel requires for that step ([`InitAttr`], [`RtrAttr`],
//! [`RtsAttr`] for RC: the constructor takes the required ones, builder methods the optional ones;
//! defaults follow `ibv_rc_pingpong` and perftest; [`AddressVector`] says where packets go); a
//! refused transition hands the QP back in its old state inside [`TransitionError`]. [`Qp::query`]
//! reports every attribute ([`QpAttr`]), and the real state ([`QpState`] says why it may differ
//! from the type's).
//!
//! UC ([`Uc`]) and UD ([`Ud`]) have the same states with their own constructors ([`Qp::new_uc`],
//! [`Qp::new_ud`]), attributes and request types ([`UcSendWr`], [`UdSendWr`], [`UdRecvWr`]); what a
//! transport cannot do has no constructor, so it does not compile (see `tests/ui`).
//! A UD QP joins multicast groups with [`attach_mcast`](Qp::attach_mcast) and keeps them
//! until [`detach_mcast`](Qp::detach_mcast) or its drop ([`McastGroup`], [`MULTICAST_QPN`]).
//! [`post_recv`](Qp::post_recv) exists from INIT on, [`post_send`](Qp::post_send) only in RTS;
//! misuse does not compile:
//!
//! ```compile_fail
//! # fn f(qp: &mut rdma_verbs::qp::Qp<rdma_verbs::qp::Rc, rdma_verbs::qp::Rtr>) {
//! qp.post_send(rdma_verbs::qp::SendWr::send(1)); // no post_send before RTS
//! # }
//! ```
//!
//! # Posting and completing
//! Posting **moves** the request's buffers ([`Mr`](crate::mr::Mr), or a read-only
//! [`SharedMr`](crate::mr::SharedMr) for what the NIC only reads) into a slot of the queue's ring;
//! the `wr_id` the NIC carries is a token naming that slot. [`Cq::poll`](crate::cq::Cq::poll)
//! validates each token before touching anything and hands the buffers back in the
//! [`Completion`](crate::cq::Completion); anything it cannot validate comes back `Foreign` or
//! `Stale`, without buffers. A QP reserves its queues' depths on its CQs, so the safe path cannot
//! overrun a CQ; [`to_error`](Qp::to_error) flushes what is posted and [`reset`](Qp::reset) needs a
//! drained QP. Inside [`Cq::scope`](crate::cq::Cq::scope) requests borrow their buffers instead
//! ([`scope`]), at the raw path's cost.
//!
//! [`Qp::split`] gives a [`SendHalf`] and a [`RecvHalf`] that post from two threads at once,
//! like a socket's halves; the QP stays borrowed (no transition) while they live.
//! [`Qp::into_split`] gives owned ones ([`OwnedSendHalf::reunite`] puts the QP back together).
//!
//! The `unsafe` [`post_send_raw`](Qp::post_send_raw) / [`post_recv_raw`](Qp::post_recv_raw) take C
//! work requests (contract in their `# Safety` sections). RC sends go through the extended API
//! (`ibv_wr_*`) where the provider has it ([`Qp::send_api`], [`SendApi`]).
//!
//! Why this is sound, and each provider behaviour it relies on with its test, is written down in
//! `docs/soundness.md`; what a request costs, in `docs/performance.md`. A [`SendWr`] is about 230
//! bytes: build it in the `post_send` call rather than passing it through variables.

// A refused transition hands the whole QP back by value (that is the point);
// the error path is cold, so its size does not matter.
#![allow(clippy::result_large_err)]

mod attr;
mod built;
mod create;
mod mcast;
mod mw;
pub(crate) mod post;
mod qp_core;
mod queue;
pub mod scope;
mod send_ex;
mod split;
mod state;
mod transition;
mod uc;
mod ud;

#[cfg(test)]
pub(crate) mod device_tests;

use std::any::Any;
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::cq::{Cq, CqInner};
use crate::error::{Result, errno, last_errno};
use crate::ffi;
use crate::pd::Pd;
use crate::srq::{Srq, SrqInner};
use crate::sys::call::verb;

pub use crate::ledger::range::{MAX_RANGE_START, MrRange, RangeError};
pub use crate::ledger::sges::{Buffer, MAX_SAFE_SGES, Sges, SgesIntoIter};
pub use crate::ledger::wr::{FlushPlacement, PostError, RecvWr, SendWr};
pub use attr::{
    AddressVector, Endpoint, Grh, InitAttr, QpAttr, QpCaps, QpStateKind, RtrAttr, RtsAttr,
    UcInitAttr, UcRtrAttr, UdInitAttr,
};
pub use mcast::{MULTICAST_QPN, McastGroup};
pub use send_ex::SendApi;
pub use split::{OwnedRecvHalf, OwnedSendHalf, RecvHalf, ReuniteError, SendHalf};
pub use state::{
    CanMoveToError, CanPostRecv, CanPostSend, Connected, ErrorState, Init, QpState, QpType, Rc,
    Reset, Rtr, Rts, Uc, Ud,
};
pub use uc::UcSendWr;
pub use ud::{UdMessage, UdRecvWr, UdSendWr};

use crate::ledger::ring::Ring;
pub use post::RAW_WR_ID_RESERVED;
use post::check_raw_wr_ids;
use qp_core::{QpCore, QpExtensions};
use queue::{RecvQueue, SendQueue};
pub use transition::TransitionError;
use transition::check_bits;

/// A queue pair of transport `T` in state `S`.
// Transparent: a scope that adopted a QP holds it by a pointer to its core
// and re-types it in place (`scope/adopt.rs`).
#[repr(transparent)]
pub struct Qp<T: QpType, S: QpState> {
    core: QpCore,
    _marker: PhantomData<(T, S)>,
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// How this QP posts its send requests: [`SendApi::Extended`] when it
    /// was created as an extended QP (`ibv_create_qp_ex` with the RC send
    /// operations; [`Qp::new`] does so where the provider supports it),
    /// [`SendApi::Legacy`] (`ibv_post_send`) otherwise. The safe API is the
    /// same over both.
    pub fn send_api(&self) -> SendApi {
        if self.core.ext.send_ex.is_some() {
            SendApi::Extended
        } else {
            SendApi::Legacy
        }
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: raw is valid while self lives; qp_num is a plain field.
        unsafe { (*self.core.raw.as_ptr()).qp_num }
    }

    /// The capabilities the device granted (it may round requests up).
    pub fn caps(&self) -> QpCaps {
        self.core.caps
    }

    /// The PSN this side starts sending with (random, 24 bits; goes in the [`Endpoint`]).
    /// [`reset`](Qp::reset) draws a new one, so read it after the reset for the next
    /// connection's [`Endpoint`].
    pub fn psn(&self) -> u32 {
        self.core.psn
    }

    /// The PD the QP belongs to.
    pub fn pd(&self) -> &Pd {
        &self.core.pd
    }

    /// The raw `ibv_qp`, valid while this `Qp` lives. Changing its state behind
    /// the type's back voids the state guarantee (not memory safety). Post
    /// raw requests with [`post_send_raw`](Qp::post_send_raw) and
    /// [`post_recv_raw`](Qp::post_recv_raw), not `ibv_post_*` on this
    /// pointer: they keep the `wr_id`s out of the crate's tokens and mark the
    /// QP, so that its CQ entries stay reserved after a drop until the CQ is
    /// polled empty (the rings do not count raw requests).
    pub fn as_raw(&self) -> *mut ffi::ibv_qp {
        self.core.raw.as_ptr()
    }

    /// This side's endpoint for the peer: the LID of the QP's port (the one
    /// given to [`init`](Qp::init); 1 before that), its QPN and PSN, and the
    /// GID at `gid_index`. With `None`, [`Context::default_gid_index`](crate::context::Context::default_gid_index)
    /// chooses: the RoCE v2 IPv4-mapped GID on RoCE, no GID (zero) on
    /// InfiniBand, like `ibv_rc_pingpong` without `-g`.
    #[doc(alias = "ibv_query_gid")]
    pub fn endpoint(&self, gid_index: Option<u8>) -> Result<Endpoint> {
        let ctx = self.core.pd.context();
        let port = self.core.port;
        let lid = ctx.query_port(port)?.lid;
        let index = match gid_index {
            Some(i) => Some(i),
            None => ctx.default_gid_index(port)?,
        };
        let gid = match index {
            Some(i) => ctx.query_gid(port, i)?,
            None => crate::device::Gid::ZERO,
        };
        Ok(Endpoint {
            lid,
            qpn: self.qp_num(),
            psn: self.core.psn,
            gid,
        })
    }

    /// Every attribute of the QP (`ibv_query_qp`), including its real state.
    #[doc(alias = "ibv_query_qp")]
    pub fn query(&self) -> Result<QpAttr> {
        let mut attr = MaybeUninit::<ffi::ibv_qp_attr>::zeroed();
        let mut init = MaybeUninit::<ffi::ibv_qp_init_attr>::zeroed();
        let mask = 0x01ff_ffff; // every IBV_QP_* attribute bit
        // SAFETY: valid QP and out-structs.
        verb!(rc: unsafe {
            ffi::ibv_query_qp(self.as_raw(), attr.as_mut_ptr(), mask, init.as_mut_ptr())
        })?;
        // SAFETY: zeroed and filled by the call; plain C structs (pointers may be null).
        Ok(unsafe { QpAttr::from_ffi(&attr.assume_init(), &init.assume_init()) })
    }

    /// Whether the send (`send == true`) or receive queue has a free slot.
    #[cfg(feature = "tokio")]
    pub(crate) fn has_room(&self, send: bool) -> bool {
        let (ring, head) = if send {
            (&self.core.sq, self.core.sq_head)
        } else {
            (&self.core.rq, self.core.rq_head)
        };
        // A queue of depth 0 (receives of a QP on an SRQ): let the post
        // itself refuse, with its error.
        ring.depth() == 0 || ring.in_flight(head) < ring.depth()
    }

    /// The `ibv_cq`s of the send and receive queue.
    #[cfg(any(feature = "tokio", feature = "gdr"))]
    pub(crate) fn cq_raws(&self) -> (*mut ffi::ibv_cq, *mut ffi::ibv_cq) {
        (self.core.send_cq.as_raw(), self.core.recv_cq.as_raw())
    }

    /// The next `wr_id` of the `AsyncQp` numbering (see `QpCore`).
    #[cfg(feature = "tokio")]
    pub(crate) fn async_next_id(&self) -> u64 {
        self.core.ext.async_next_id
    }

    /// Keeps where an `AsyncQp` left its numbering, for the next wrapper.
    #[cfg(feature = "tokio")]
    pub(crate) fn set_async_next_id(&mut self, id: u64) {
        self.core.ext.async_next_id = id;
    }

    /// The port the QP sends from and receives on (set at INIT).
    pub(crate) fn port_num(&self) -> u8 {
        self.core.port
    }

    /// Work requests posted and not yet retired by a polled completion, as
    /// `(send, receive)`. [`reset`](Qp::reset) needs both to be 0.
    pub fn outstanding(&self) -> (u64, u64) {
        (
            self.core.sq.in_flight(self.core.sq_head),
            self.core.rq.in_flight(self.core.rq_head),
        )
    }
}

impl<T: QpType, S: QpState> fmt::Debug for Qp<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qp_num", &self.qp_num())
            .field("state", &S::NAME)
            .field("caps", &self.core.caps)
            .finish()
    }
}
