//! Creating the QP of a [`CmId`] (`rdma_create_qp`).

use super::*;
use crate::srq::SrqInner;

impl CmId {
    /// Creates an RC QP for this id (`rdma_create_qp`), in INIT, ready for
    /// receives to be posted before [`connect`](CmId::connect) /
    /// [`ConnectRequest::accept`]. `pd` and the CQs must come from
    /// [`CmId::context`] (one PD and CQ may serve the QPs of many ids on the
    /// same device). The QP keeps this id alive.
    ///
    /// Access: the kernel's CM grants the QP REMOTE_WRITE, and REMOTE_READ
    /// and REMOTE_ATOMIC when this side accepts READs/atomics as target
    /// (responder resources above 0; the default [`ConnParam`] asks the
    /// device maximum). What a peer may touch is still decided by each
    /// [`Mr`](crate::mr::Mr)'s own access flags.
    #[doc(alias = "rdma_create_qp")]
    pub fn create_qp(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Init>> {
        self.create_qp_on(pd, send_cq, recv_cq, None, caps)
    }

    /// [`create_qp`](CmId::create_qp) (`rdma_create_qp`) for a QP whose receives come from the
    /// shared receive queue `srq`, as [`Qp::new_with_srq`] makes them:
    /// `recv_cq` must be the SRQ's CQ ([`Error::SrqCqMismatch`]), the QP
    /// reserves no receive entries and its `post_recv` is refused. The QP
    /// keeps the SRQ alive.
    #[doc(alias = "rdma_create_qp")]
    pub fn create_qp_with_srq(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &crate::srq::Srq,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Init>> {
        self.create_qp_on(pd, send_cq, recv_cq, Some(srq), caps)
    }

    /// `rdma_create_qp` on this id, adopted as a `Qp` that keeps the id alive.
    fn create_qp_on(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: Option<&crate::srq::Srq>,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Init>> {
        let (srq, caps) = srq_and_caps(pd, recv_cq, srq, caps)?;
        let raw_srq = srq
            .as_ref()
            .map_or(std::ptr::null_mut(), |s| s.raw.as_ptr());
        let _g = self.inner.lock();
        let (id, port) = self.free_id_on_device_locked(pd, &[send_cq, recv_cq], false)?;
        let keepalive: Box<dyn std::any::Any + Send + Sync> = Box::new(self.inner.clone());
        // SAFETY: rdma_create_qp creates an RC QP in `pd` from `init` (its CQs
        // unchanged), moves it to INIT with nothing posted and writes the granted
        // caps back; id->qp is cleared, so the Qp is its only owner. The CM
        // chooses the PSN (0 is a placeholder; psn() is meaningless for CM QPs).
        // The keepalive keeps the id alive until after ibv_destroy_qp.
        unsafe {
            Qp::build(
                pd,
                send_cq,
                recv_cq,
                caps,
                0,
                port,
                Some(keepalive),
                srq,
                |init| {
                    init.srq = raw_srq;
                    // SAFETY: valid id (its lock is held), PD and CQs of its device;
                    // init is fully initialised.
                    create_detached_qp(id, pd, init)
                },
            )
        }
    }

    /// The raw id and its port, once it is known to be free for a new QP: no
    /// blocking wait owns it, it is bound to the device of `pd` and `cqs`, and
    /// no QP is attached to it, and it is a UD id if `ud`, else an RC one.
    /// Call with the lock held.
    pub(super) fn free_id_on_device_locked(
        &self,
        pd: &Pd,
        cqs: &[&Cq],
        ud: bool,
    ) -> Result<(*mut ffi::rdma_cm_id, u8)> {
        // A connect waiting on another thread has its QP attached.
        self.inner.refuse_if_waiting()?;
        let id = self.inner.id();
        check_port_space(id, ud)?;
        // SAFETY: valid id under its lock; plain fields.
        let (verbs, port, cur) = unsafe { ((*id).verbs, (*id).port_num, (*id).qp) };
        check_same_device(verbs, pd, cqs)?;
        if !cur.is_null() {
            // A handshake in progress has its QP attached: rdma_create_qp
            // would replace it and the handshake would fail half-open.
            return Err(busy_id());
        }
        Ok((id, port))
    }
}

pub(super) fn busy_id() -> Error {
    Error::InvalidArgument {
        what: "rdma_cm id",
        reason: "a QP is already attached to it (id->qp set outside this crate)".into(),
    }
}

pub(super) fn not_bound() -> Error {
    Error::InvalidArgument {
        what: "rdma_cm id",
        reason: "it is not bound to a device yet: resolve the address and route first".into(),
    }
}

pub(super) fn other_device(what: &'static str) -> Error {
    Error::InvalidArgument {
        what,
        reason: "it belongs to another device context than the rdma_cm id; create it from `CmId::context()`".into(),
    }
}

pub(super) fn check_same_device(verbs: *mut ffi::ibv_context, pd: &Pd, cqs: &[&Cq]) -> Result<()> {
    if verbs.is_null() {
        return Err(not_bound());
    }
    if pd.context().as_raw() != verbs {
        return Err(other_device("protection domain"));
    }
    for cq in cqs {
        // SAFETY: the CQ is valid while borrowed; context is a plain field.
        if unsafe { (*cq.as_raw()).context } != verbs {
            return Err(other_device("completion queue"));
        }
    }
    Ok(())
}

/// That `qp` is on the device (`verbs`) and port of the id it connects on:
/// librdmacm's handshake moves the QP to the id's port, where the QP's own
/// record (its endpoint's GID and LID) would still name the other.
pub(super) fn check_qp_device(
    verbs: *mut ffi::ibv_context,
    port: u8,
    qp: &Qp<Rc, Init>,
) -> Result<()> {
    if verbs.is_null() {
        return Err(not_bound());
    }
    // SAFETY: the QP is valid while borrowed; context is a plain field.
    if unsafe { (*qp.as_raw()).context } != verbs {
        return Err(other_device("queue pair"));
    }
    if port != 0 && qp.port_num() != port {
        return Err(Error::InvalidArgument {
            what: "queue pair",
            reason: format!(
                "it is on port {}, the rdma_cm id on port {port}; create it on this id \
                 (CmId::create_qp) or on the id's port",
                qp.port_num()
            ),
        });
    }
    Ok(())
}

/// The SRQ a QP takes its receives from (checked against `recv_cq` and `pd`),
/// and `caps` without receive entries when there is one.
fn srq_and_caps(
    pd: &Pd,
    recv_cq: &Cq,
    srq: Option<&crate::srq::Srq>,
    caps: QpCaps,
) -> Result<(Option<Arc<SrqInner>>, QpCaps)> {
    let Some(srq) = srq else {
        return Ok((None, caps));
    };
    let srq = srq.inner();
    let caps = srq.admit_qp(pd, recv_cq, caps)?;
    Ok((Some(srq.clone()), caps))
}

/// `rdma_create_qp` on `id`, leaving the id as it was: its previous PD is
/// restored and `id->qp` cleared right after (see the module docs), so the
/// returned QP has no other owner.
///
/// # Safety
/// `id` is valid and its lock is held; `pd` and the CQs in `init` belong to
/// the id's device.
pub(super) unsafe fn create_detached_qp(
    id: *mut ffi::rdma_cm_id,
    pd: &Pd,
    init: &mut ffi::ibv_qp_init_attr,
) -> Result<NonNull<ffi::ibv_qp>> {
    // SAFETY: the caller's contract: valid id under its lock, PD and CQs of its
    // device, init fully initialised.
    let (rc, qp) = unsafe {
        let saved_pd = (*id).pd;
        let rc = ffi::rdma_create_qp(id, pd.as_raw(), init);
        let qp = (*id).qp;
        (*id).qp = std::ptr::null_mut();
        (*id).pd = saved_pd;
        (rc, qp)
    };
    match (rc, NonNull::new(qp)) {
        (0, Some(qp)) => Ok(qp),
        _ => Err(create_qp_error(last_errno())),
    }
}

/// The error of a failed `rdma_create_qp`, with what EINVAL usually means.
fn create_qp_error(e: io::Error) -> Error {
    let hint = match e.raw_os_error() {
        Some(libc::EINVAL) => Some(
            "a capability (max_send_wr, max_recv_wr, max_*_sge, \
             max_inline_data) exceeds the device limits, or the id's \
             connection is gone (a connection request whose client \
             gave up)"
                .into(),
        ),
        _ => None,
    };
    Error::Verb {
        verb: "rdma_create_qp",
        source: e,
        hint,
    }
}
