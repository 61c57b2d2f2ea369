//! UC queue pairs: SEND and RDMA WRITE to one peer, without acknowledgements.
//!
//! The state machine is RC's with fewer attributes (no responder resources,
//! RNR timer, timeouts or retries: nothing is acknowledged), and the send
//! queue takes [`UcSendWr`], which has no READ or atomic constructor:
//!
//! ```compile_fail
//! # fn f(qp: &mut rdma_verbs::qp::Qp<rdma_verbs::qp::Uc, rdma_verbs::qp::Rts>, m: rdma_verbs::mr::Mr, r: rdma_verbs::mr::RemoteMr) {
//! qp.post_send(rdma_verbs::qp::UcSendWr::read(1, m, r, 0)); // UC has no RDMA READ
//! # }
//! ```
//!
//! A UC message lost on the wire is lost: the sender completes successfully
//! all the same, and the receiver sees nothing (or, for a multi-packet
//! message, drops the rest of it).

use super::attr::{UcInitAttr, UcRtrAttr, sq_psn_only};
use super::queue::{self, SendQueue};
use super::state::{CanPostSend, Init, QpState, Reset, Rtr, Rts, Uc};
use super::{Endpoint, PostError, Qp, QpCaps, TransitionError, check_bits};
use crate::cq::Cq;
use crate::error::Result;
use crate::ledger::sges::{Buffer, Sges};
use crate::ledger::wr::SendWr;
use crate::mr::RemoteMr;
use crate::pd::Pd;

/// A UC send-queue work request: SEND or RDMA WRITE (with or without
/// immediate data). Built like [`SendWr`], posted with
/// `post_send` on a `Qp<Uc, Rts>`.
#[derive(Debug)]
pub struct UcSendWr<'a>(pub(crate) SendWr<'a>);

impl<'a> UcSendWr<'a> {
    /// A SEND; add the payload with [`UcSendWr::sge`].
    #[inline(always)]
    pub fn send(wr_id: u64) -> UcSendWr<'a> {
        UcSendWr(SendWr::send(wr_id))
    }

    /// A SEND of the whole of `src`.
    #[inline(always)]
    pub fn send_from(wr_id: u64, src: impl Into<Buffer>) -> UcSendWr<'a> {
        UcSendWr(SendWr::send_from(wr_id, src))
    }

    /// A SEND whose payload is copied from `data` at post time (inline).
    #[inline(always)]
    pub fn send_inline(wr_id: u64, data: &'a [u8]) -> UcSendWr<'a> {
        UcSendWr(SendWr::send_inline(wr_id, data))
    }

    /// An RDMA WRITE of the SGEs to `remote` at `offset` (bounds checked when
    /// posted). The peer's QP must allow it ([`UcInitAttr::remote_write`]).
    #[inline(always)]
    pub fn write(wr_id: u64, remote: RemoteMr, offset: u64) -> UcSendWr<'a> {
        UcSendWr(SendWr::write(wr_id, remote, offset))
    }

    /// An RDMA WRITE of the whole of `src` to `remote` at `offset`.
    #[inline(always)]
    pub fn write_from(
        wr_id: u64,
        src: impl Into<Buffer>,
        remote: RemoteMr,
        offset: u64,
    ) -> UcSendWr<'a> {
        UcSendWr(SendWr::write_from(wr_id, src, remote, offset))
    }

    /// An RDMA WRITE whose payload is copied from `data` at post time (inline).
    #[inline(always)]
    pub fn write_inline(wr_id: u64, data: &'a [u8], remote: RemoteMr, offset: u64) -> UcSendWr<'a> {
        UcSendWr(SendWr::write_inline(wr_id, data, remote, offset))
    }

    /// Appends a scatter/gather entry (see [`SendWr::sge`]).
    #[inline(always)]
    pub fn sge(self, buf: impl Into<Buffer>) -> UcSendWr<'a> {
        UcSendWr(self.0.sge(buf))
    }

    /// Attaches immediate data (SEND_WITH_IMM / RDMA_WRITE_WITH_IMM).
    #[inline(always)]
    pub fn imm(self, imm: u32) -> UcSendWr<'a> {
        UcSendWr(self.0.imm(imm))
    }

    /// Asks for no completion unless one is needed (see [`SendWr::unsignaled`]).
    #[inline(always)]
    pub fn unsignaled(self) -> UcSendWr<'a> {
        UcSendWr(self.0.unsignaled())
    }

    /// Asks for a completion (`true`, the default) or not.
    #[inline(always)]
    pub fn signaled(self, signaled: bool) -> UcSendWr<'a> {
        UcSendWr(self.0.signaled(signaled))
    }

    /// Sets the solicited-event bit.
    #[inline(always)]
    pub fn solicited(self) -> UcSendWr<'a> {
        UcSendWr(self.0.solicited())
    }

    /// The application's id.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Gives back the buffers of a request that was not posted.
    pub fn into_buffers(self) -> Sges {
        self.0.bufs
    }
}

impl Qp<Uc, Reset> {
    /// Creates a UC QP in `pd` whose sends complete on `send_cq` and receives
    /// on `recv_cq` (they may be the same CQ).
    #[doc(alias = "ibv_create_qp")]
    pub fn new_uc(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp<Uc, Reset>> {
        Qp::create(pd, send_cq, recv_cq, caps)
    }

    /// RESET → INIT.
    #[doc(alias = "ibv_modify_qp")]
    pub fn init(self, attr: UcInitAttr) -> Result<Qp<Uc, Init>, TransitionError<Qp<Uc, Reset>>> {
        self.init_on(attr.port, attr.to_ffi())
    }
}

impl Qp<Uc, Init> {
    /// INIT → RTR. Values wider than their wire fields (dest QPN and RQ PSN,
    /// 24 bits) are refused before the kernel sees them, and so is an address
    /// without a GRH on RoCE (as for RC's [`rtr`](Qp::rtr)).
    #[doc(alias = "ibv_modify_qp")]
    pub fn rtr(self, attr: UcRtrAttr) -> Result<Qp<Uc, Rtr>, TransitionError<Qp<Uc, Init>>> {
        if let Some(error) = self.check_rtr(&attr.rc) {
            return Err(TransitionError { qp: self, error });
        }
        self.transition(attr.to_ffi())
    }

    /// INIT → RTR → RTS towards `remote` with the defaults of
    /// `ibv_uc_pingpong`: path MTU = the port's active MTU, a GRH from
    /// `gid_index` (`None`: [`Context::default_gid_index`](crate::context::Context::default_gid_index)).
    /// A failure destroys the QP (its buffers are released) and returns the error.
    #[doc(alias = "ibv_modify_qp")]
    pub fn connect(self, remote: &Endpoint, gid_index: Option<u8>) -> Result<Qp<Uc, Rts>> {
        let port = self.core.port;
        let (mtu, gid_index) = self.connect_defaults(gid_index)?;
        let sq_psn = self.core.psn;
        let qp = self.rtr(UcRtrAttr::new(remote, port, mtu, gid_index))?;
        Ok(qp.rts(sq_psn)?)
    }
}

impl Qp<Uc, Rtr> {
    /// RTR → RTS, sending from `sq_psn` (this side's [`Endpoint::psn`]; 24 bits).
    #[doc(alias = "ibv_modify_qp")]
    pub fn rts(self, sq_psn: u32) -> Result<Qp<Uc, Rts>, TransitionError<Qp<Uc, Rtr>>> {
        if let Some(error) = check_bits("SQ PSN", sq_psn, 24) {
            return Err(TransitionError { qp: self, error });
        }
        self.transition(sq_psn_only(sq_psn))
    }
}

impl<S: QpState> Qp<Uc, S> {
    /// Posts one SEND or RDMA WRITE; its buffers return with the completion
    /// (as RC's [`post_send`](Qp::post_send)).
    #[inline]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, wr: UcSendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_one::<SendQueue>(&mut self.core, wr.0)
    }

    /// Posts SENDs and RDMA WRITEs as chained lists (as RC's
    /// [`post_send_list`](Qp::post_send_list)).
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_list<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = UcSendWr<'a>>,
    ) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_list::<SendQueue<'a>>(&mut self.core, wrs.into_iter().map(|w| w.0))
    }
}
