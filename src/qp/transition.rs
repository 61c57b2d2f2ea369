//! Moving a QP between states: RESET → INIT → RTR → RTS, ERR and back to RESET.

use super::*;
use crate::error::Error;

/// A refused transition: the error and the QP, still in its old state.
pub struct TransitionError<Q> {
    /// The QP, unchanged.
    pub qp: Q,
    /// Why it was refused.
    pub error: Error,
}

impl<Q> fmt::Debug for TransitionError<Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransitionError")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<Q> fmt::Display for TransitionError<Q> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.error, f)
    }
}

impl<Q> std::error::Error for TransitionError<Q> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<Q> From<TransitionError<Q>> for Error {
    fn from(e: TransitionError<Q>) -> Error {
        e.error
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    pub(super) fn into_state<S2: QpState>(self) -> Qp<T, S2> {
        Qp {
            core: self.core,
            _marker: PhantomData,
        }
    }

    /// Re-types the QP as being in state `S2` without calling any verb; the
    /// rings (and the receives already posted) stay as they are.
    ///
    /// For QPs that something else moved, e.g. librdmacm's `rdma_connect` /
    /// `rdma_accept`, which take a CM-managed QP from INIT to RTR and RTS
    /// themselves (see [`crate::cm`]).
    ///
    /// # Safety
    /// The QP must really be in `S2` now (as set by whoever moved it), so that
    /// the state-gated methods of `Qp<T, S2>` match what the kernel allows.
    pub(crate) unsafe fn assume_state<S2: QpState>(self) -> Qp<T, S2> {
        self.into_state()
    }

    pub(super) fn transition<S2: QpState>(
        self,
        attr: (ffi::ibv_qp_attr, u32),
    ) -> Result<Qp<T, S2>, TransitionError<Qp<T, S>>> {
        match self.core.modify(attr, S::NAME, S2::NAME) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }

    /// Moves the QP to ERR: every outstanding work request completes with
    /// WR_FLUSH_ERR and its buffers come back through the CQ. From every
    /// state but RESET ([`CanMoveToError`]): the kernel
    /// refuses RESET → ERR, so a `Qp<_, Reset>` has no `to_error`.
    ///
    /// An unsignaled send that already completed successfully has no
    /// completion to flush, and a completion consumed by
    /// [`Cq::poll_raw`](crate::cq::Cq::poll_raw) never reaches the safe path. So
    /// when sends are outstanding, a signaled zero-length request is posted
    /// after the move to ERR (it is flushed at once and never reaches the
    /// wire, like the kernel's `ib_drain_sq`); its completion retires the sends
    /// before it and is not handed out by [`Cq::poll`](crate::cq::Cq::poll). Once
    /// the flushes are polled, [`outstanding`](Qp::outstanding) is `(0, 0)`
    /// and [`reset`](Qp::reset) succeeds. Not when `poll_raw` consumed
    /// completions of this QP: receives whose completions it took stay
    /// outstanding, and so do sends when every slot of the send queue is in
    /// use (no slot is left for the marker); destroy such a QP.
    ///
    /// The flush covers what was posted before the move: on rxe a receive
    /// posted to a QP already in ERR (a drained scope leaves its QPs there
    /// while they are still typed `Rts`) is not flushed until the next
    /// `to_error`; call it again before polling for that receive.
    #[doc(alias = "ibv_modify_qp")]
    pub fn to_error(self) -> Result<Qp<T, state::ErrorState>, TransitionError<Qp<T, S>>>
    where
        S: state::CanMoveToError,
    {
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_ERR,
            ..Default::default()
        };
        let mut qp = self.transition((attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0))?;
        qp.core.post_drain_marker();
        Ok(qp)
    }

    /// Moves the QP to RESET, ready to be connected again.
    ///
    /// Refused with [`Error::WorkOutstanding`] (the QP comes back unchanged)
    /// while any work request is outstanding: whether RESET discards posted
    /// work is up to the provider (some rxe versions keep posted receives),
    /// so the buffers could not be handed back safely. Move the QP to ERR
    /// with [`to_error`](Qp::to_error) first and poll the flushed completions.
    /// On a QP attached to an SRQ that applies also to a receive it took from
    /// the SRQ mid-message, which this check cannot count (see the module
    /// docs, "Shared receive queues").
    ///
    /// Refused with [`Error::Unsupported`] on an iWARP device: an iWARP QP is bound to
    /// its connection, and siw accepts the move out of ERR without making it (the QP
    /// stays in ERR, where a receive posted later is neither consumed nor flushed).
    /// Create a new QP instead.
    ///
    /// Linux 6.12's rxe races with a reset while the peer is still sending: its
    /// responder can dereference a NULL receive WQE (a kernel oops), and a
    /// receive after the reconnection was seen completing with a message not
    /// sent on the new connection (docs/providers.md, "6.12's rxe"). There,
    /// destroy the QP and create a new one instead.
    #[doc(alias = "ibv_modify_qp")]
    pub fn reset(self) -> Result<Qp<T, Reset>, TransitionError<Qp<T, S>>> {
        if self.core.pd.context().is_iwarp() {
            return Err(self.iwarp_reset_refused());
        }
        let (send, receive) = self.outstanding();
        let outstanding = [("send", send), ("receive", receive)];
        if let Some(&(queue, count)) = outstanding.iter().find(|(_, n)| *n > 0) {
            return Err(TransitionError {
                qp: self,
                error: Error::WorkOutstanding { queue, count },
            });
        }
        let attr = ffi::ibv_qp_attr {
            qp_state: ffi::IBV_QPS_RESET,
            ..Default::default()
        };
        let mut qp = self.transition::<Reset>((attr, ffi::ibv_qp_attr_mask::IBV_QP_STATE.0))?;
        // The QP keeps its number across RESET, and a provider may still put a
        // packet of the old connection on the wire after the move (6.12's rxe
        // runs the requester from a work queue). A fresh PSN keeps such a
        // packet outside the next connection's window.
        qp.core.psn = super::create::random_psn();
        Ok(qp)
    }
}

impl Qp<Rc, Reset> {
    /// RESET → INIT.
    #[doc(alias = "ibv_modify_qp")]
    pub fn init(self, attr: InitAttr) -> Result<Qp<Rc, Init>, TransitionError<Qp<Rc, Reset>>> {
        self.init_on(attr.port, attr.to_ffi())
    }
}

impl<T: QpType> Qp<T, Reset> {
    /// RESET → INIT on `port` (remembered for [`endpoint`](Qp::endpoint)).
    pub(super) fn init_on(
        mut self,
        port: u8,
        attr: (ffi::ibv_qp_attr, u32),
    ) -> Result<Qp<T, Init>, TransitionError<Qp<T, Reset>>> {
        // The port and P_Key index, checked here: the kernel says EINVAL for
        // a missing port, and soft-RoCE takes an index past its table.
        let pkey_index = attr.0.pkey_index;
        let checked = self.core.pd.context().port_facts(port).and_then(|p| {
            match p.pkey_tbl_len > 0 && pkey_index >= p.pkey_tbl_len {
                true => Err(Error::InvalidArgument {
                    what: "pkey index",
                    reason: format!(
                        "{pkey_index} is past the {} entries of port {port}'s P_Key table",
                        p.pkey_tbl_len
                    ),
                }),
                false => Ok(()),
            }
        });
        if let Err(error) = checked {
            return Err(TransitionError { qp: self, error });
        }
        let old = self.core.port;
        self.core.port = port;
        self.transition(attr).map_err(|mut e| {
            e.qp.core.port = old;
            e
        })
    }
}

impl Qp<Rc, Init> {
    /// INIT → RTR. Values wider than their wire fields (dest QPN and RQ PSN
    /// 24 bits, min_rnr_timer 5) are refused before the kernel sees them.
    ///
    /// On RoCE (an Ethernet port) the address vector needs a GRH with the
    /// peer's GID; one without is refused here with an error that says so
    /// (the kernel would only say EINVAL).
    #[doc(alias = "ibv_modify_qp")]
    pub fn rtr(self, attr: RtrAttr) -> Result<Qp<Rc, Rtr>, TransitionError<Qp<Rc, Init>>> {
        match self.rtr_in_place(attr) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }

    /// INIT → RTR without re-typing (for [`rtr`](Qp::rtr) and a QP a scope
    /// adopted): on `Ok` the QP is in RTR and the caller re-types it.
    pub(crate) fn rtr_in_place(&self, attr: RtrAttr) -> Result<()> {
        let error = check_bits("min_rnr_timer", attr.min_rnr_timer.into(), 5)
            .or_else(|| self.check_rtr(&attr));
        if let Some(error) = error {
            return Err(error);
        }
        self.core.modify(attr.to_ffi(), Init::NAME, Rtr::NAME)
    }

    /// The attributes [`connect`](Qp::connect) moves the QP with.
    pub(crate) fn connect_attrs(
        &self,
        remote: &Endpoint,
        gid_index: Option<u8>,
    ) -> Result<(RtrAttr, RtsAttr)> {
        let (mtu, gid_index) = self.connect_defaults(gid_index)?;
        Ok((
            RtrAttr::new(remote, self.core.port, mtu, gid_index),
            RtsAttr::new(self.core.psn),
        ))
    }

    /// INIT → RTR → RTS towards `remote` with the defaults of `ibv_rc_pingpong`:
    /// path MTU = the port's active MTU, a GRH from `gid_index` (with `None`,
    /// [`Context::default_gid_index`](crate::context::Context::default_gid_index)
    /// chooses: the RoCE v2 GID on RoCE, no GRH on InfiniBand).
    /// A failure destroys the QP (its buffers are released) and returns the error.
    ///
    /// Like `ibv_rc_pingpong`, this allows one outstanding RDMA READ or
    /// atomic each way (`max_rd_atomic` and `max_dest_rd_atomic` 1, as
    /// [`RtrAttr::new`] and [`RtsAttr::new`]); more in flight wait on the
    /// NIC. For deeper READ/atomic pipelines, go through
    /// [`rtr`](Qp::rtr) and [`rts`](Qp::rts) with those fields raised (up to
    /// the device's `max_qp_rd_atom`).
    #[doc(alias = "ibv_modify_qp")]
    pub fn connect(self, remote: &Endpoint, gid_index: Option<u8>) -> Result<Qp<Rc, Rts>> {
        let (rtr, rts) = self.connect_attrs(remote, gid_index)?;
        let qp = self.rtr(rtr)?;
        Ok(qp.rts(rts)?)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// [`reset`](Qp::reset)'s refusal on an iWARP device, with the QP back.
    #[cold]
    #[inline(never)]
    fn iwarp_reset_refused(self) -> TransitionError<Qp<T, S>> {
        let error = self.core.pd.context().iwarp_unsupported(
            "ibv_modify_qp(RESET)",
            "way back to RESET: an iWARP QP belongs to its connection, and siw leaves it in \
             ERR (later receives are neither consumed nor flushed); create a new QP",
        );
        TransitionError { qp: self, error }
    }
}

impl<T: QpType> Qp<T, Init> {
    /// The checks of INIT → RTR common to RC and UC: a device that can take a
    /// QP connected by hand (iWARP cannot), wire field widths and the GRH RoCE
    /// needs.
    pub(super) fn check_rtr(&self, attr: &RtrAttr) -> Option<Error> {
        let ctx = self.core.pd.context();
        if ctx.is_iwarp() {
            return Some(ctx.iwarp_unsupported(
                "ibv_modify_qp(RTR)",
                "QPs connected by hand (an exchanged Endpoint): iWARP connects through \
                 rdma_cm only (cm::CmId: connect, or get_request and accept)",
            ));
        }
        check_bits("dest QPN", attr.dest_qpn, 24)
            .or_else(|| check_bits("RQ PSN", attr.rq_psn, 24))
            .or_else(|| attr.av.check_widths())
            .or_else(|| self.check_path_mtu(attr.path_mtu))
            .or_else(|| self.check_roce_grh(&attr.av))
    }

    /// A path MTU of the five IB ones, at most the port's active MTU: the
    /// kernel takes anything up to the device's largest (rxe), and a QP
    /// whose packets do not fit the link fails only when it sends.
    fn check_path_mtu(&self, mtu: crate::device::Mtu) -> Option<Error> {
        let reason = if mtu.bytes() == 0 {
            format!("{mtu:?} is not an InfiniBand MTU: use Mtu::Mtu256 to Mtu::Mtu4096")
        } else {
            let (port, ctx) = (self.core.port, self.core.pd.context());
            // The cached value answers the usual case without a system call.
            if mtu.bytes() <= ctx.port_facts(port).ok()?.first_active_mtu.bytes() {
                return None;
            }
            let active = ctx.query_port(port).ok()?.active_mtu;
            if mtu.bytes() <= active.bytes() {
                return None;
            }
            format!(
                "{} bytes is more than port {port}'s active MTU ({} bytes): packets that size \
                 would not fit the link; use at most the active MTU (Qp::connect does)",
                mtu.bytes(),
                active.bytes()
            )
        };
        Some(Error::InvalidArgument {
            what: "path MTU",
            reason,
        })
    }

    /// The path MTU and GID index `connect` uses: the port's active MTU, and
    /// `gid_index` or the port's default.
    pub(super) fn connect_defaults(
        &self,
        gid_index: Option<u8>,
    ) -> Result<(crate::device::Mtu, Option<u8>)> {
        let port = self.core.port;
        let ctx = self.core.pd.context();
        let mtu = ctx.query_port(port)?.active_mtu;
        let gid_index = match gid_index {
            Some(i) => Some(i),
            None => ctx.default_gid_index(port)?,
        };
        Ok((mtu, gid_index))
    }

    /// On an Ethernet (RoCE) port: a GRH, towards a non-zero GID.
    pub(super) fn check_roce_grh(&self, av: &AddressVector) -> Option<Error> {
        let port = self.core.pd.context().port_facts(av.port).ok()?;
        if port.link_layer != crate::device::LinkLayer::Ethernet {
            return None;
        }
        let reason = match &av.grh {
            None => {
                "RoCE (an Ethernet port) needs a GRH: give a GID index (RtrAttr::new's \
                     sgid_index; Context::default_gid_index picks the RoCE v2 one)"
            }
            Some(g) if g.dgid.is_zero() => {
                "the peer's endpoint carries no GID (all zero), which RoCE needs: the peer must \
                 send its GID (Qp::endpoint picks one by default)"
            }
            Some(_) => return None,
        };
        Some(Error::InvalidArgument {
            what: "address vector",
            reason: reason.into(),
        })
    }
}

impl Qp<Rc, Rtr> {
    /// RTR → RTS. Values wider than their wire fields (SQ PSN 24 bits, timeout
    /// 5, retry_cnt and rnr_retry 3) are refused before the kernel sees them.
    #[doc(alias = "ibv_modify_qp")]
    pub fn rts(self, attr: RtsAttr) -> Result<Qp<Rc, Rts>, TransitionError<Qp<Rc, Rtr>>> {
        match self.rts_in_place(attr) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }

    /// RTR → RTS without re-typing (for [`rts`](Qp::rts) and a QP a scope
    /// adopted): on `Ok` the QP is in RTS and the caller re-types it.
    pub(crate) fn rts_in_place(&self, attr: RtsAttr) -> Result<()> {
        let error = check_bits("SQ PSN", attr.sq_psn, 24)
            .or_else(|| check_bits("timeout", attr.timeout.into(), 5))
            .or_else(|| check_bits("retry_cnt", attr.retry_cnt.into(), 3))
            .or_else(|| check_bits("rnr_retry", attr.rnr_retry.into(), 3));
        if let Some(error) = error {
            return Err(error);
        }
        self.core.modify(attr.to_ffi(), Rtr::NAME, Rts::NAME)
    }
}

/// Refuses a value that does not fit its `bits`-wide field (some providers
/// silently truncate instead of failing).
pub(super) fn check_bits(what: &'static str, v: u32, bits: u32) -> Option<Error> {
    (v >> bits != 0).then(|| Error::InvalidArgument {
        what,
        reason: format!("{v:#x} does not fit in {bits} bits"),
    })
}
