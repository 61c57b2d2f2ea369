//! UD queue pairs: datagrams to any UD QP, each addressed by type.
//!
//! * RESET → [`init`](Qp::init) ([`UdInitAttr`]: port, P_Key index, Q_Key)
//!   → [`rtr`](Qp::rtr) (nothing: a UD QP has no remote) →
//!   [`rts`](Qp::rts) (the send PSN); [`ready`](Qp::ready) does both.
//! * Sends are [`UdSendWr`]s: SEND (with or without immediate data) only,
//!   and each names its [`AddressHandle`], remote QPN and Q_Key. A payload
//!   over the port's active MTU is refused when posted
//!   ([`Error::MessageTooLong`]). An RC-style request does not compile:
//!
//! ```compile_fail
//! # fn f(qp: &mut rdma_verbs::qp::Qp<rdma_verbs::qp::Ud, rdma_verbs::qp::Rts>) {
//! qp.post_send(rdma_verbs::qp::SendWr::send(1)); // no address handle
//! # }
//! ```
//!
//! * Receives are [`UdRecvWr`]s: a [`GRH_LEN`]-byte buffer for the Global
//!   Route Header the NIC writes first, and the payload buffer; the
//!   completion takes them apart ([`Completion::take_ud`] → [`UdMessage`]),
//!   so the GRH is never read as data.
//!
//! # The address handle lives until the send is done
//! The NIC (or a provider that does not copy the address vector at post
//! time) reads a send's AH until the send completes. Posting moves a clone
//! of it into the QP, next to the request's ring slot; it is released when
//! that slot is used again (by then the send has completed: a slot is reused
//! only after its request retired) or when the QP is destroyed. Only the
//! poster touches these clones, so the RC path pays nothing for them.
//!
//! UD sends are always signaled (there is no `unsignaled`): every send then
//! has a completion or a flush, which is what lets
//! [`to_error`](Qp::to_error) drain a UD QP without posting a marker (a
//! marker would need an address handle).

use super::attr::{UdInitAttr, sq_psn_only};
use super::queue::{self, Extended, Extension, RecvQueue, SendQueue, WorkQueue};
use super::state::{CanPostRecv, CanPostSend, Init, QpState, Reset, Rtr, Rts, Ud};
use super::{PostError, Qp, QpCaps, QpCore, TransitionError, check_bits};
use crate::ah::{AddressHandle, GRH_LEN, grh_source_gid};
use crate::cq::{Completion, CompletionSource, Cq, WcOpcode};
use crate::device::Gid;
use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::sges::{Buffer, Sges};
use crate::ledger::wr::{RecvWr, SendWr};
use crate::mr::Mr;
use crate::pd::Pd;

/// What a UD QP keeps besides RC's state.
pub(crate) struct UdState {
    /// The address handle of the send with sequence number `seq` at
    /// `seq & (len - 1)`; `len` is a power of two at least the send queue's
    /// depth, so an entry is overwritten only by a send posted after the one
    /// it holds retired.
    ahs: Box<[Option<AddressHandle>]>,
    /// The largest payload one datagram carries: the port's active MTU (set
    /// at INIT).
    mtu: u32,
}

/// A UD send: SEND (with or without immediate data) of at most one path MTU
/// to `remote_qpn` through an address handle, with the receiver's Q_Key.
/// Posted with `post_send` on a `Qp<Ud, Rts>`;
/// always signaled.
#[derive(Debug)]
pub struct UdSendWr<'a> {
    pub(crate) wr: SendWr<'a>,
    pub(crate) ah: AddressHandle,
    pub(crate) remote_qpn: u32,
    pub(crate) qkey: u32,
}

impl<'a> UdSendWr<'a> {
    #[inline(always)]
    fn to(wr: SendWr<'a>, ah: &AddressHandle, remote_qpn: u32, qkey: u32) -> UdSendWr<'a> {
        UdSendWr {
            wr,
            ah: ah.clone(),
            remote_qpn,
            qkey,
        }
    }

    /// A SEND to QP `remote_qpn` through `ah`, with `qkey` (the receiving
    /// QP's Q_Key); add the payload with [`UdSendWr::sge`].
    #[inline(always)]
    pub fn send(wr_id: u64, ah: &AddressHandle, remote_qpn: u32, qkey: u32) -> UdSendWr<'a> {
        UdSendWr::to(SendWr::send(wr_id), ah, remote_qpn, qkey)
    }

    /// A SEND of the whole of `src` to QP `remote_qpn` through `ah`.
    #[inline(always)]
    pub fn send_from(
        wr_id: u64,
        src: impl Into<Buffer>,
        ah: &AddressHandle,
        remote_qpn: u32,
        qkey: u32,
    ) -> UdSendWr<'a> {
        UdSendWr::to(SendWr::send_from(wr_id, src), ah, remote_qpn, qkey)
    }

    /// A SEND whose payload is copied from `data` at post time (inline).
    #[inline(always)]
    pub fn send_inline(
        wr_id: u64,
        data: &'a [u8],
        ah: &AddressHandle,
        remote_qpn: u32,
        qkey: u32,
    ) -> UdSendWr<'a> {
        UdSendWr::to(SendWr::send_inline(wr_id, data), ah, remote_qpn, qkey)
    }

    /// Appends a scatter/gather entry (see [`SendWr::sge`]).
    #[inline(always)]
    pub fn sge(mut self, buf: impl Into<Buffer>) -> UdSendWr<'a> {
        self.wr = self.wr.sge(buf);
        self
    }

    /// Attaches immediate data (SEND_WITH_IMM).
    #[inline(always)]
    pub fn imm(mut self, imm: u32) -> UdSendWr<'a> {
        self.wr = self.wr.imm(imm);
        self
    }

    /// Sets the solicited-event bit.
    #[inline(always)]
    pub fn solicited(mut self) -> UdSendWr<'a> {
        self.wr = self.wr.solicited();
        self
    }

    /// The application's id.
    pub fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }

    /// Gives back the buffers of a request that was not posted.
    pub fn into_buffers(self) -> Sges {
        self.wr.bufs
    }
}

/// A UD receive: a [`GRH_LEN`]-byte buffer for the GRH and the payload
/// buffer, scattered in that order (two SGEs: create the QP with
/// `max_recv_sge` ≥ 2, which [`Qp::new_ud`] ensures).
#[derive(Debug)]
pub struct UdRecvWr {
    pub(crate) wr: RecvWr,
}

impl UdRecvWr {
    /// A receive of one datagram: its GRH into `grh` (exactly [`GRH_LEN`]
    /// bytes, checked when posted: a larger buffer would take the start of
    /// the payload), its payload into `payload`.
    #[inline]
    pub fn new(wr_id: u64, grh: Mr, payload: Mr) -> UdRecvWr {
        UdRecvWr {
            wr: RecvWr::new(wr_id, grh).sge(payload),
        }
    }

    /// A receive of a datagram without payload (only its GRH).
    #[inline]
    pub fn grh_only(wr_id: u64, grh: Mr) -> UdRecvWr {
        UdRecvWr {
            wr: RecvWr::new(wr_id, grh),
        }
    }

    /// Gives back the buffers of a request that was not posted.
    pub fn into_buffers(self) -> Sges {
        self.wr.bufs
    }
}

/// A received datagram, taken apart by [`Completion::take_ud`].
#[derive(Debug)]
pub struct UdMessage {
    /// The GRH buffer ([`GRH_LEN`] bytes).
    pub grh: Mr,
    /// What the NIC wrote into `grh` (undefined unless [`Completion::has_grh`]):
    /// pass it to [`AddressHandle::from_completion`] to answer the sender.
    pub grh_bytes: [u8; GRH_LEN],
    /// The payload buffer (`None` for a [`UdRecvWr::grh_only`] receive).
    pub payload: Option<Mr>,
    /// Payload bytes received (the completion's `byte_len` minus the GRH).
    pub len: u32,
    /// The sender's QP number.
    pub src_qp: u32,
    /// The sender's GID, read from the GRH when the completion has one.
    pub sgid: Option<Gid>,
    /// Immediate data, if the SEND carried one.
    pub imm_data: Option<u32>,
}

impl Completion {
    /// Takes a successful UD receive apart: the GRH and payload buffers, the
    /// payload length (`byte_len` − 40), the sender's QPN and GID. For the
    /// completions of [`UdRecvWr`]s; a failed one (e.g. a flush) hands its
    /// buffers back with [`take_buffers`](Completion::take_buffers).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (nothing is taken) when this is not a
    /// successful receive laid out as a `UdRecvWr` posts it (a
    /// [`GRH_LEN`]-byte buffer first, then at most one more); the error of
    /// reading the GRH (nothing taken either) when the host cannot read its
    /// buffer (device memory).
    pub fn take_ud(&mut self) -> Result<UdMessage> {
        let bufs = self.buffers().as_slice();
        let shaped = matches!(bufs.first(), Some(Buffer::Owned(g)) if g.len() == GRH_LEN)
            && bufs.len() <= 2
            && bufs.iter().all(|b| matches!(b, Buffer::Owned(_)));
        if !self.status.is_success()
            || self.source != CompletionSource::Posted
            || !matches!(self.opcode, WcOpcode::Recv)
            || !shaped
            || (self.byte_len as usize) < GRH_LEN
        {
            return Err(Error::InvalidArgument {
                what: "UD receive completion",
                reason: format!(
                    "take_ud takes a successful receive of a UdRecvWr; this is a {} with {} and {} buffer(s)",
                    self.opcode,
                    self.status,
                    bufs.len()
                ),
            });
        }
        // Read before anything is taken: a GRH buffer the host cannot read
        // (device memory) is refused with the buffers left in place.
        let mut grh_bytes = [0; GRH_LEN];
        if let Some(Buffer::Owned(g)) = bufs.first() {
            g.read_at(0, &mut grh_bytes)?;
        }
        let mut it = self.take_buffers().into_iter().filter_map(Buffer::into_mr);
        let grh = it.next().expect("checked above: an owned GRH buffer");
        let payload = it.next();
        Ok(UdMessage {
            grh,
            grh_bytes,
            payload,
            len: self.byte_len - GRH_LEN as u32,
            src_qp: self.src_qp,
            sgid: if self.has_grh() {
                grh_source_gid(&grh_bytes)
            } else {
                None
            },
            imm_data: self.imm_data,
        })
    }
}

impl Qp<Ud, Reset> {
    /// Creates a UD QP in `pd` whose sends complete on `send_cq` and receives
    /// on `recv_cq` (they may be the same CQ). `max_recv_sge` is raised to 2
    /// if lower: a [`UdRecvWr`] has a GRH and a payload buffer.
    #[doc(alias = "ibv_create_qp")]
    pub fn new_ud(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp<Ud, Reset>> {
        let caps = QpCaps {
            max_recv_sge: caps.max_recv_sge.max(2),
            ..caps
        };
        let qp: Qp<Ud, Reset> = Qp::create(pd, send_cq, recv_cq, caps)?;
        Ok(qp.with_ud_state(0))
    }

    /// RESET → INIT. Also reads the port's active MTU: the largest payload
    /// a send may carry.
    #[doc(alias = "ibv_modify_qp")]
    pub fn init(
        mut self,
        attr: UdInitAttr,
    ) -> Result<Qp<Ud, Init>, TransitionError<Qp<Ud, Reset>>> {
        let mtu = match self.core.pd.context().query_port(attr.port) {
            Ok(p) => p.active_mtu.bytes(),
            Err(error) => return Err(TransitionError { qp: self, error }),
        };
        if let Some(ud) = self.core.ext.ud.as_mut() {
            ud.mtu = mtu;
        }
        self.init_on(attr.port, attr.to_ffi())
    }
}

impl Qp<Ud, Init> {
    /// INIT → RTR (a UD QP has no remote: nothing else to set).
    #[doc(alias = "ibv_modify_qp")]
    pub fn rtr(self) -> Result<Qp<Ud, Rtr>, TransitionError<Qp<Ud, Init>>> {
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RTR,
            ..Default::default()
        };
        self.transition((attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0))
    }

    /// INIT → RTR → RTS, sending from this QP's [`psn`](Qp::psn) (what
    /// `ibv_ud_pingpong` does). A failure destroys the QP (its buffers are
    /// released) and returns the error.
    #[doc(alias = "ibv_modify_qp")]
    pub fn ready(self) -> Result<Qp<Ud, Rts>> {
        let psn = self.core.psn;
        Ok(self.rtr()?.rts(psn)?)
    }
}

impl Qp<Ud, Rtr> {
    /// RTR → RTS, sending from `sq_psn` (24 bits).
    pub fn rts(self, sq_psn: u32) -> Result<Qp<Ud, Rts>, TransitionError<Qp<Ud, Rtr>>> {
        if let Some(error) = check_bits("SQ PSN", sq_psn, 24) {
            return Err(TransitionError { qp: self, error });
        }
        self.transition(sq_psn_only(sq_psn))
    }
}

impl<S: QpState> Qp<Ud, S> {
    /// Gives a freshly created UD QP the state its sends need: a slot per
    /// send queue entry for the address handles, and `mtu` (the port's
    /// active MTU; 0 until INIT reads it). For every UD constructor,
    /// including rdma_cm's (`crate::cm`), which creates the QP in RTS.
    pub(crate) fn with_ud_state(mut self, mtu: u32) -> Qp<Ud, S> {
        let slots = self.core.sq.depth().next_power_of_two() as usize;
        self.core.ext.ud = Some(Box::new(UdState {
            ahs: (0..slots).map(|_| None).collect(),
            mtu,
        }));
        self
    }

    /// Where this QP's datagrams to `remote` go, from the QP's port: on RoCE
    /// (and whenever `remote` carries a GID) a GRH towards `remote.gid` from
    /// the local GID at `gid_index` (`None`: the port's default, the RoCE v2
    /// IPv4-mapped GID, as [`Qp::endpoint`] and `connect` choose), hop limit
    /// 1 and SL 0 like [`AddressVector::global`](super::AddressVector::global); on InfiniBand without a GID,
    /// `remote.lid`. Change SL, hop limit or traffic class on the result
    /// before [`AddressHandle::new`]; [`AddressHandle::for_endpoint`] is both
    /// steps with these defaults.
    ///
    /// # Errors
    /// The port or GID queries' errors, and on RoCE a `remote` without a GID
    /// ([`Error::InvalidArgument`]: the peer must send its endpoint from
    /// [`Qp::endpoint`], which includes one).
    pub fn address_vector(
        &self,
        remote: &super::Endpoint,
        gid_index: Option<u8>,
    ) -> Result<super::AddressVector> {
        let port = self.core.port;
        let ctx = self.core.pd.context();
        let ethernet = ctx.query_port(port)?.link_layer == crate::values::LinkLayer::Ethernet;
        if remote.gid.is_zero() {
            if ethernet {
                return Err(Error::InvalidArgument {
                    what: "endpoint",
                    reason: "the peer's endpoint carries no GID (all zero), and RoCE addresses by GID: have the peer send the endpoint that Qp::endpoint returns"
                        .into(),
                });
            }
            return Ok(super::AddressVector::local(port, remote.lid));
        }
        let index = match gid_index {
            Some(i) => i,
            None => ctx.default_gid_index(port)?.unwrap_or(0),
        };
        Ok(super::AddressVector::global(port, remote.gid, index))
    }

    /// The largest payload one send may carry: the port's active MTU (0
    /// before INIT).
    pub fn max_message(&self) -> u32 {
        self.core.ext.ud.as_ref().map_or(0, |u| u.mtu)
    }

    /// Posts one datagram; its buffers return with the completion, and the
    /// QP keeps its address handle alive until then.
    ///
    /// # Errors
    /// As RC's [`post_send`](Qp::post_send), and [`Error::MessageTooLong`]
    /// for a payload over [`max_message`](Qp::max_message), an
    /// [`Error::InvalidArgument`] for a remote QPN wider than 24 bits or an
    /// address handle of another PD.
    #[inline]
    pub fn post_send(&mut self, wr: UdSendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_one::<UdSendQueue>(&mut self.core, wr)
    }

    /// Posts datagrams as chained lists (as RC's
    /// [`post_send_list`](Qp::post_send_list)).
    pub fn post_send_list<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = UdSendWr<'a>>,
    ) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_list::<UdSendQueue<'a>>(&mut self.core, wrs)
    }

    /// Posts one receive; its buffers return with the completion
    /// ([`Completion::take_ud`]).
    ///
    /// # Errors
    /// As RC's [`post_recv`](Qp::post_recv), and [`Error::InvalidArgument`]
    /// when the GRH buffer is not [`GRH_LEN`] bytes.
    #[inline]
    pub fn post_recv(&mut self, wr: UdRecvWr) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_one::<UdRecvQueue>(&mut self.core, wr)
    }

    /// Posts receives as chained lists (as RC's
    /// [`post_recv_list`](Qp::post_recv_list)).
    pub fn post_recv_list(
        &mut self,
        wrs: impl IntoIterator<Item = UdRecvWr>,
    ) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_list::<UdRecvQueue>(&mut self.core, wrs)
    }
}

/// The send queue of a UD QP: RC's, plus the datagram's address.
type UdSendQueue<'a> = Extended<UdSend<'a>>;

impl AddressHandle {
    /// The address handle towards the peer whose endpoint is `remote`, for
    /// the UD QP `qp` (in its PD, from its port): [`Qp::address_vector`] and
    /// [`AddressHandle::new`] in one call.
    ///
    /// ```no_run
    /// # use rdma_verbs::prelude::*;
    /// # fn f(qp: &Qp<Ud, Rts>, peer: &Endpoint, buf: Mr) -> Result<()> {
    /// let ah = AddressHandle::for_endpoint(qp, peer, None)?;
    /// let wr = UdSendWr::send_from(1, buf, &ah, peer.qpn, 0x1111_1111);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Qp::address_vector`] and [`AddressHandle::new`].
    #[doc(alias = "ibv_create_ah")]
    pub fn for_endpoint<S: QpState>(
        qp: &Qp<Ud, S>,
        remote: &super::Endpoint,
        gid_index: Option<u8>,
    ) -> Result<AddressHandle> {
        AddressHandle::new(qp.pd(), qp.address_vector(remote, gid_index)?)
    }
}

/// What a UD send adds to RC's: see [`UdSendQueue`].
struct UdSend<'a>(std::marker::PhantomData<UdSendWr<'a>>);

impl<'a> Extension for UdSend<'a> {
    type Base = SendQueue<'a>;
    type Wr = UdSendWr<'a>;

    #[inline(always)]
    fn base<'w>(wr: &'w UdSendWr<'a>) -> &'w SendWr<'a> {
        &wr.wr
    }

    #[inline(always)]
    fn into_base(wr: UdSendWr<'a>) -> SendWr<'a> {
        wr.wr
    }

    fn validate(core: &QpCore, wr: &UdSendWr<'a>) -> Result<(), Error> {
        SendQueue::validate(core, &wr.wr)?;
        let Some(ud) = core.ext.ud.as_ref() else {
            return Err(Error::InvalidArgument {
                what: "UD send",
                reason: "this QP was not created as a UD QP".into(),
            });
        };
        let len = wr.wr.payload_len();
        if len > u64::from(ud.mtu) {
            return Err(Error::MessageTooLong { len, max: ud.mtu });
        }
        if let Some(e) = check_bits("remote QPN", wr.remote_qpn, 24) {
            return Err(e);
        }
        if !std::sync::Arc::ptr_eq(&wr.ah.pd().inner, &core.pd.inner) {
            return Err(Error::InvalidArgument {
                what: "address handle",
                reason: "it belongs to another PD than the QP".into(),
            });
        }
        Ok(())
    }

    #[inline(always)]
    unsafe fn complete_c(wr: &UdSendWr<'a>, c: *mut ffi::ibv_send_wr) {
        // SAFETY: `c` points to an initialised entry (this function's contract).
        unsafe {
            (*c).wr.ud = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
                ah: wr.ah.as_raw(),
                remote_qpn: wr.remote_qpn,
                remote_qkey: wr.qkey,
            };
        }
    }

    #[inline(always)]
    unsafe fn staged(core: &mut QpCore, seq: u64, wr: &UdSendWr<'a>) {
        // SAFETY: the caller forgets `wr`, so the handle moves out exactly once.
        let ah = unsafe { std::ptr::read(&wr.ah) };
        // `validate` refused the request if there were no UdState.
        if let Some(ud) = core.ext.ud.as_mut() {
            let i = seq as usize & (ud.ahs.len() - 1);
            // The previous occupant's send retired (see UdState::ahs).
            ud.ahs[i] = Some(ah);
        }
    }
}

/// The receive queue of a UD QP: RC's, with the GRH buffer checked.
type UdRecvQueue = Extended<UdRecv>;

/// What a UD receive adds to RC's: see [`UdRecvQueue`].
struct UdRecv;

impl Extension for UdRecv {
    type Base = RecvQueue;
    type Wr = UdRecvWr;

    #[inline(always)]
    fn base(wr: &UdRecvWr) -> &RecvWr {
        &wr.wr
    }

    #[inline(always)]
    fn into_base(wr: UdRecvWr) -> RecvWr {
        wr.wr
    }

    fn validate(core: &QpCore, wr: &UdRecvWr) -> Result<(), Error> {
        let grh = wr.wr.bufs.as_slice().first().map_or(0, Buffer::len);
        if grh != GRH_LEN {
            return Err(Error::InvalidArgument {
                what: "GRH buffer",
                reason: format!(
                    "{grh} bytes; a UD receive's first buffer takes the {GRH_LEN}-byte GRH exactly \
                     (a larger one would take the start of the payload too): cut it with Mr::split_to({GRH_LEN})"
                ),
            });
        }
        RecvQueue::validate(core, &wr.wr)
    }
}
