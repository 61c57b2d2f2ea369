//! rdma_cm for UD QPs (`RDMA_PS_UDP`): what `udaddy` does.
//!
//! A UD connect does not connect anything: the client's `rdma_connect` sends
//! a SIDR request to the listener's address and port, the server's
//! `rdma_accept` answers with its QP number and Q_Key, and the client's
//! ESTABLISHED carries them with the path to the server. Both QPs are in RTS
//! from creation on (librdmacm moves a UD QP there in `rdma_create_qp`), with
//! the Q_Key [`UDP_QKEY`].
//!
//! The server learns nothing of the client's QP from the request: it answers
//! the first datagram it receives ([`UdPeer::reply_to`], from the datagram's
//! completion and GRH, as udaddy does with `ibv_create_ah_from_wc`).

use super::*;
use crate::ah::AddressHandle;
use crate::cq::Completion;
use crate::ledger::sges::Buffer;
use crate::qp::{AddressVector, QpState, Ud, UdMessage, UdSendWr};

/// The Q_Key of every QP rdma_cm creates for `RDMA_PS_UDP` ids
/// (`RDMA_UDP_QKEY`), and the one its SIDR replies announce.
pub const UDP_QKEY: u32 = ffi::RDMA_UDP_QKEY;

/// What the ESTABLISHED event of a UD connect carries (`rdma_ud_param`):
/// the path to the peer, its QP number and Q_Key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct UdParam {
    /// The path to the peer, for an [`AddressHandle`].
    pub av: AddressVector,
    /// The peer's QP number.
    pub qp_num: u32,
    /// The Q_Key the peer's QP receives with.
    pub qkey: u32,
}

impl UdParam {
    pub(super) fn from_ffi(p: &ffi::rdma_ud_param) -> UdParam {
        UdParam {
            av: AddressVector::from_ffi(&p.ah_attr),
            qp_num: p.qp_num,
            qkey: p.qkey,
        }
    }
}

/// A UD peer to send datagrams to: its address handle, QP number and Q_Key,
/// from [`CmId::connect_ud`] (the server's) or [`UdPeer::reply_to`] (a
/// client's, from its datagram). Cheap to clone; the handle keeps its
/// [`Pd`] alive.
///
/// ```no_run
/// # use rdma_verbs::prelude::*;
/// # use rdma_verbs::cm::UdPeer;
/// # fn f(qp: &mut Qp<Ud, Rts>, server: &UdPeer, buf: Mr) -> Result<()> {
/// qp.post_send(server.send_from(1, buf))?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct UdPeer {
    /// Where the datagrams go (in the PD of the QP they are sent from).
    pub ah: AddressHandle,
    /// The peer's QP number.
    pub qpn: u32,
    /// The peer QP's Q_Key.
    pub qkey: u32,
}

impl UdPeer {
    /// A SEND to this peer; add the payload with [`UdSendWr::sge`].
    pub fn send<'a>(&self, wr_id: u64) -> UdSendWr<'a> {
        UdSendWr::send(wr_id, &self.ah, self.qpn, self.qkey)
    }

    /// A SEND of the whole of `src` (an [`Mr`](crate::mr::Mr), or a part
    /// of one from [`Mr::range`](crate::mr::Mr::range)) to this peer.
    pub fn send_from<'a>(&self, wr_id: u64, src: impl Into<Buffer>) -> UdSendWr<'a> {
        UdSendWr::send_from(wr_id, src, &self.ah, self.qpn, self.qkey)
    }

    /// A SEND to this peer whose payload is copied from `data` when posted.
    pub fn send_inline<'a>(&self, wr_id: u64, data: &'a [u8]) -> UdSendWr<'a> {
        UdSendWr::send_inline(wr_id, data, &self.ah, self.qpn, self.qkey)
    }

    /// The sender of a datagram `qp` received, to answer it: the address
    /// handle from its completion and GRH
    /// ([`AddressHandle::from_completion`], `ibv_create_ah_from_wc`), its
    /// QP number, and [`UDP_QKEY`] (the Q_Key of rdma_cm's UD QPs; set
    /// [`qkey`](UdPeer::qkey) for a peer set up otherwise). `msg` is what
    /// [`Completion::take_ud`] took from `completion`.
    ///
    /// # Errors
    /// As [`AddressHandle::from_completion`].
    pub fn reply_to<S: QpState>(
        qp: &Qp<Ud, S>,
        completion: &Completion,
        msg: &UdMessage,
    ) -> Result<UdPeer> {
        let ah =
            AddressHandle::from_completion(qp.pd(), qp.port_num(), completion, &msg.grh_bytes)?;
        Ok(UdPeer {
            ah,
            qpn: msg.src_qp,
            qkey: UDP_QKEY,
        })
    }
}

impl CmId {
    /// Creates an id (`rdma_create_id`) for UD datagrams (`RDMA_PS_UDP`) on
    /// a new channel: resolve it and [`connect_ud`](CmId::connect_ud)
    /// (client), or bind and listen ([`CmId::ud_listener`], server). Its QP
    /// comes from [`create_ud_qp`](CmId::create_ud_qp); the RC calls
    /// (`create_qp`, `connect`, `accept`) refuse it.
    #[doc(alias = "rdma_create_id")]
    #[doc(alias = "RDMA_PS_UDP")]
    pub fn new_ud() -> Result<CmId> {
        CmId::create(EventChannel::new()?, ffi::RDMA_PS_UDP)
    }

    /// A bound UD id listening for [`connect_ud`](CmId::connect_ud)
    /// requests ([`CmId::new_ud`], `rdma_bind_addr`, `rdma_listen`); take
    /// them with [`get_request`](CmId::get_request) and answer with
    /// [`ConnectRequest::accept_ud`].
    #[doc(alias = "rdma_listen")]
    pub fn ud_listener(addr: SocketAddr, backlog: i32) -> Result<CmId> {
        let id = CmId::new_ud()?;
        id.bind(addr)?;
        id.listen(backlog)?;
        Ok(id)
    }

    /// Creates the UD QP of a UD id (`rdma_create_qp`), already in RTS with
    /// the Q_Key [`UDP_QKEY`] (librdmacm moves it through INIT and RTR), its
    /// `max_recv_sge` raised to 2 as [`Qp::new_ud`] does. `pd` and the CQs
    /// must come from [`CmId::context`]; the QP keeps this id alive. Post
    /// its receives before [`connect_ud`](CmId::connect_ud) /
    /// [`ConnectRequest::accept_ud`], so the first datagram finds one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] on an RC id or one not bound to a device
    /// yet, or for a PD or CQ of another device; [`Error::Unsupported`] on
    /// iWARP (which has no UD); `rdma_create_qp`'s error otherwise.
    #[doc(alias = "rdma_create_qp")]
    pub fn create_ud_qp(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
    ) -> Result<Qp<Ud, Rts>> {
        let caps = QpCaps {
            max_recv_sge: caps.max_recv_sge.max(2),
            ..caps
        };
        if pd.context().is_iwarp() {
            return Err(pd
                .context()
                .iwarp_unsupported("rdma_create_qp", "UD QPs: use RC (CmId::new)"));
        }
        let _g = self.inner.lock();
        let (id, port) = self.free_id_on_device_locked(pd, &[send_cq, recv_cq], true)?;
        let mtu = pd.context().query_port(port)?.active_mtu.bytes();
        let keepalive: Box<dyn std::any::Any + Send + Sync> = Box::new(self.inner.clone());
        // SAFETY: on a UD id rdma_create_qp creates a UD QP in `pd` from `init`
        // (its CQs unchanged), moves it through INIT and RTR to RTS with
        // nothing posted and writes the granted caps back; id->qp is cleared,
        // so the Qp is its only owner. Its SQ PSN is 0. The keepalive keeps
        // the id alive until after ibv_destroy_qp.
        let qp = unsafe {
            Qp::<Ud, Rts>::build(
                pd,
                send_cq,
                recv_cq,
                caps,
                0,
                port,
                Some(keepalive),
                None,
                |init| {
                    // SAFETY: valid id (its lock is held), PD and CQs of its
                    // device; init is fully initialised.
                    create_detached_qp(id, pd, init)
                },
            )?
        };
        Ok(qp.with_ud_state(mtu))
    }

    /// Asks the UD listener at the resolved address for its QP
    /// (`rdma_connect`, a SIDR request carrying `param`'s private data, at
    /// most 180 bytes on InfiniBand/RoCE) and waits up to `timeout` for the
    /// reply: the server as a [`UdPeer`] (an address handle in `qp`'s PD),
    /// and the ESTABLISHED event (with the reply's private data and the raw
    /// [`UdParam`]). `qp` is this id's QP ([`create_ud_qp`](CmId::create_ud_qp)).
    ///
    /// # Errors
    /// [`Error::CmEvent`] with UNREACHABLE when nobody listens there (SIDR
    /// status 1) or the server rejected the request (status 2), and when no
    /// reply came at all (a negative errno); [`Error::Timeout`] after
    /// `timeout`; [`Error::InvalidArgument`] on an RC id or for a QP of
    /// another device. An id asks once: drop it after a failure. To retry
    /// while the server starts, repeat the whole setup on a new id
    /// (`CmId::new_ud`, resolve, `create_ud_qp`, post the receives, then
    /// `connect_ud`): the QP and its address handles belong to the id's try.
    #[doc(alias = "rdma_connect")]
    pub fn connect_ud<S: QpState>(
        &self,
        qp: &Qp<Ud, S>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(UdPeer, CmEvent)> {
        let _own = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            self.start_connect_ud_locked(qp, param)?;
            BlockingWaitGuard::mark(&self.inner)
        };
        let ev = self.inner.expect(Awaited::UD_CONNECTED, timeout)?;
        Ok((ud_peer(qp, &ev)?, ev))
    }

    /// The UD `rdma_connect` (a SIDR request; ESTABLISHED or an error event
    /// follows). Call with the lock held.
    pub(crate) fn start_connect_ud_locked<S: QpState>(
        &self,
        qp: &Qp<Ud, S>,
        param: &ConnParam,
    ) -> Result<()> {
        param.validate()?;
        let id = self.inner.id();
        check_ud_qp(id, qp)?;
        let mut cp = param.to_ffi();
        cp.qp_num = qp.qp_num();
        // SAFETY: valid id under its lock (caller), no QP attached (a UD
        // connect needs none: the QPN travels in `cp`); cp and its private
        // data live across the call.
        if unsafe { ffi::rdma_connect(id, &mut cp) } != 0 {
            return Err(ud_call_error("rdma_connect", last_errno()));
        }
        Ok(())
    }

    /// [`start_connect_ud_locked`](CmId::start_connect_ud_locked) taking the
    /// lock, for the async layer.
    #[cfg(feature = "tokio")]
    pub(crate) fn start_connect_ud<S: QpState>(
        &self,
        qp: &Qp<Ud, S>,
        param: &ConnParam,
    ) -> Result<()> {
        let _g = self.inner.lock();
        self.start_connect_ud_locked(qp, param)
    }
}

/// The server a UD connect's ESTABLISHED event names, as a [`UdPeer`] whose
/// address handle is in `qp`'s PD.
pub(crate) fn ud_peer<S: QpState>(qp: &Qp<Ud, S>, ev: &CmEvent) -> Result<UdPeer> {
    let Some(p) = ev.ud else {
        return Err(Error::InvalidArgument {
            what: "rdma_cm event",
            reason: "ESTABLISHED on a UD id without its UD parameters".into(),
        });
    };
    Ok(UdPeer {
        ah: AddressHandle::new(qp.pd(), p.av)?,
        qpn: p.qp_num,
        qkey: p.qkey,
    })
}

impl ConnectRequest {
    /// Answers a UD request (`rdma_accept`, a SIDR reply) with `qp`'s number
    /// and the Q_Key [`UDP_QKEY`], and `param`'s private data (at most 136
    /// bytes on InfiniBand/RoCE). Does not wait: a UD accept has no
    /// confirmation. Returns the request's id (a QP created on it keeps it
    /// alive anyway).
    ///
    /// `qp` may be the request id's own ([`CmId::create_ud_qp`]), or one UD
    /// QP that answers many clients: any on the id's device and port that
    /// receives with [`UDP_QKEY`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an RC request, a QP of another device
    /// or port, or one with another Q_Key; `rdma_accept`'s error otherwise.
    /// Either way the request is consumed (its drop rejects it).
    #[doc(alias = "rdma_accept")]
    pub fn accept_ud<S: QpState>(mut self, qp: &Qp<Ud, S>, param: &ConnParam) -> Result<CmId> {
        param.validate()?;
        let qkey = qp.query()?.qkey;
        if qkey != UDP_QKEY {
            return Err(Error::InvalidArgument {
                what: "queue pair",
                reason: format!(
                    "its Q_Key is {qkey:#x}, and rdma_cm tells the client {UDP_QKEY:#x} \
                     (cm::UDP_QKEY): create it with CmId::create_ud_qp, or with \
                     UdInitAttr::new(port, cm::UDP_QKEY)"
                ),
            });
        }
        let Some(cm) = self.id.take() else {
            return Err(busy_id());
        };
        {
            let _g = cm.inner.lock();
            let id = cm.inner.id();
            check_ud_qp(id, qp)?;
            let mut cp = param.to_ffi();
            cp.qp_num = qp.qp_num();
            // SAFETY: valid id under its lock; no QP attached, the QPN
            // travels in `cp`; cp and its private data live across the call.
            if unsafe { ffi::rdma_accept(id, &mut cp) } != 0 {
                return Err(ud_call_error("rdma_accept", last_errno()));
            }
        }
        Ok(cm)
    }
}

/// Whether `id` was created for UD (`RDMA_PS_UDP`). Call with its lock held.
pub(super) fn is_ud(id: *mut ffi::rdma_cm_id) -> bool {
    // SAFETY: valid id under its lock (caller); plain field.
    unsafe { (*id).qp_type == ffi::IBV_QPT_UD }
}

/// Refuses an RC call on a UD id (`ud: false`) or a UD call on an RC id.
pub(super) fn check_port_space(id: *mut ffi::rdma_cm_id, ud: bool) -> Result<()> {
    if is_ud(id) == ud {
        return Ok(());
    }
    let reason = if ud {
        "it was created for RC (RDMA_PS_TCP): create the id with CmId::new_ud (or CmId::ud_listener) for UD"
    } else {
        "it was created for UD (RDMA_PS_UDP): use create_ud_qp, connect_ud and ConnectRequest::accept_ud"
    };
    Err(Error::InvalidArgument {
        what: "rdma_cm id",
        reason: reason.into(),
    })
}

/// Checks that `id` is a UD id and `qp` on its device and port. Call with
/// the id's lock held.
pub(super) fn check_ud_qp<S: QpState>(id: *mut ffi::rdma_cm_id, qp: &Qp<Ud, S>) -> Result<()> {
    check_port_space(id, true)?;
    // SAFETY: valid id under its lock (caller); plain fields.
    let (verbs, port) = unsafe { ((*id).verbs, (*id).port_num) };
    if verbs.is_null() {
        return Err(not_bound());
    }
    // SAFETY: the QP is valid while borrowed; context is a plain field.
    if unsafe { (*qp.as_raw()).context } != verbs {
        return Err(other_device("queue pair"));
    }
    if qp.port_num() != port {
        return Err(Error::InvalidArgument {
            what: "queue pair",
            reason: format!(
                "it is on port {}, the rdma_cm id on port {port}: datagrams to it would arrive on the other port",
                qp.port_num()
            ),
        });
    }
    Ok(())
}

/// The error of a failed UD `rdma_connect` / `rdma_accept`.
fn ud_call_error(verb: &'static str, e: io::Error) -> Error {
    let hint = (e.raw_os_error() == Some(libc::EINVAL)).then(|| {
        format!(
            "{}check the private data length (InfiniBand/RoCE: at most 180 bytes on a UD \
             connect, 136 on its accept) and that the address and route were resolved",
            super::handshake::once_hint(verb)
        )
    });
    Error::Verb {
        verb,
        source: e,
        hint,
    }
}
