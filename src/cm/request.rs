//! [`ConnectRequest`]: a connection request taken on a listener.

use super::*;
use crate::sys::call::verb;

/// Most private data a reject carries on InfiniBand and RoCE (the CM's REJ
/// message; rdma_cm refuses more with EINVAL).
pub const REJECT_PRIVATE_DATA_MAX: usize = 148;

/// A connection request taken on a listener: accept or reject it.
/// Dropping it unanswered rejects it.
///
/// In async code (feature `tokio`), accept with
/// [`AsyncCmId::accept`](crate::tokio::AsyncCmId::accept), which awaits the
/// peer's confirmation; [`accept`](ConnectRequest::accept) here blocks the
/// thread until it comes (up to its timeout), which stalls a tokio worker.
pub struct ConnectRequest {
    pub(super) id: Option<CmId>,
    pub(super) private_data: Vec<u8>,
    pub(super) conn: ConnInfo,
}

impl ConnectRequest {
    /// The id of the new connection (moved to a channel of its own, or on
    /// the listener's when the async layer shares it); use its
    /// [`context`](CmId::context) for the PD and CQs and
    /// [`create_qp`](CmId::create_qp) for the QP to accept with.
    pub fn id(&self) -> &CmId {
        // The id is only taken by accept/reject, which consume self.
        self.id
            .as_ref()
            .unwrap_or_else(|| unreachable!("ConnectRequest without an id"))
    }

    /// The private data the peer sent with its connect (padded; see the module docs).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// What the peer asked for (responder resources, initiator depth, QPN...).
    pub fn conn(&self) -> &ConnInfo {
        &self.conn
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id().peer_addr()
    }

    /// Accepts (`rdma_accept`) with `qp` (from [`CmId::create_qp`] on [`id`](ConnectRequest::id))
    /// and waits up to `timeout` for ESTABLISHED. librdmacm moves the QP to
    /// RTR and RTS; receives posted in INIT stay posted. Returns the QP and
    /// the connection's id (QP first, as [`CmId::connect`] does).
    ///
    /// Blocking: it parks the calling thread until the peer confirms. From
    /// async code use [`AsyncCmId::accept`](crate::tokio::AsyncCmId::accept)
    /// (feature `tokio`) instead.
    #[doc(alias = "rdma_accept")]
    pub fn accept(
        mut self,
        qp: Qp<Rc, Init>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(Qp<Rc, Rts>, CmId)> {
        param.validate()?;
        let Some(cm) = self.id.take() else {
            return Err(busy_id());
        };
        let handshake = {
            let _g = cm.inner.lock();
            cm.inner.refuse_if_waiting()?;
            let id = cm.inner.id();
            // SAFETY: the lock is held while `attach` is a QpAttach: it becomes
            // a Handshake (which re-locks to detach) before the lock is
            // released; the QP outlives the Handshake (dropped below, and on
            // unwinding before the parameter `qp`).
            let attach =
                unsafe { attach_and_call(id, &qp, param, ffi::rdma_accept, "rdma_accept")? };
            cm.inner.connecting.store(true, Ordering::Relaxed);
            Handshake::keep(&cm.inner, attach)
        };
        // Without the lock between polls, as in `CmId::connect` (on a channel
        // shared with other ids, a wait holding the lock would hold up their
        // events too).
        let ev = cm.inner.expect(Awaited::ACCEPTED, timeout);
        drop(handshake);
        ev?;
        // SAFETY: rdma_accept returned 0 only after moving the attached QP
        // to RTR and RTS, and the peer confirmed (ESTABLISHED).
        let qp = unsafe { qp.assume_state::<Rts>() };
        Ok((qp, cm))
    }

    /// Rejects the request (`rdma_reject`) with `private_data` for the peer
    /// (at most [`REJECT_PRIVATE_DATA_MAX`] bytes, InfiniBand/RoCE's limit),
    /// which sees REJECTED with status 28 (consumer defined).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for longer private data, [`Error::Verb`]
    /// when rdma_cm refuses; either way the request is consumed, and its
    /// drop rejects it without private data.
    #[doc(alias = "rdma_reject")]
    pub fn reject(mut self, private_data: &[u8]) -> Result<()> {
        let len = match u8::try_from(private_data.len()) {
            Ok(n) if usize::from(n) <= REJECT_PRIVATE_DATA_MAX => n,
            _ => {
                return Err(Error::InvalidArgument {
                    what: "private data",
                    reason: format!(
                        "{} bytes; a reject carries at most {REJECT_PRIVATE_DATA_MAX} on \
                         InfiniBand/RoCE (the request was rejected without it)",
                        private_data.len()
                    ),
                });
            }
        };
        let Some(cm) = self.id.take() else {
            return Err(busy_id());
        };
        let _g = cm.inner.lock();
        let data = if private_data.is_empty() {
            std::ptr::null()
        } else {
            private_data.as_ptr().cast()
        };
        // SAFETY: valid id under its lock; data points to len bytes.
        verb!(errno: unsafe { ffi::rdma_reject(cm.inner.id(), data, len) })?;
        Ok(())
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if let Some(cm) = self.id.take() {
            let _g = cm.inner.lock();
            // SAFETY: valid id under its lock; no private data. Errors are
            // ignored (the id's destruction rejects the peer anyway).
            unsafe { ffi::rdma_reject(cm.inner.id(), std::ptr::null(), 0) };
        }
    }
}

impl fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("peer", &self.id.as_ref().and_then(CmId::peer_addr))
            .field("private_data", &self.private_data.len())
            .field("conn", &self.conn)
            .finish()
    }
}
