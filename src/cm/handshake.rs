//! Attaching a QP to an id for the length of a handshake (sync and async).

use super::*;

/// Sets `id->qp` for the duration of a handshake and clears it again on drop
/// (restoring `id->pd`), so librdmacm never keeps a pointer to a QP this
/// crate may destroy. Create it while holding the id's lock, after the QP.
pub(super) struct QpAttach {
    id: *mut ffi::rdma_cm_id,
    pd: *mut ffi::ibv_pd,
}

impl QpAttach {
    /// # Safety
    /// `id` is valid, its lock is held for the guard's whole life, and `qp`
    /// stays alive until the guard is dropped.
    unsafe fn new(id: *mut ffi::rdma_cm_id, qp: *mut ffi::ibv_qp) -> QpAttach {
        // SAFETY: valid id, exclusive access under the lock (caller).
        unsafe {
            let pd = (*id).pd;
            (*id).qp = qp;
            QpAttach { id, pd }
        }
    }
}

impl Drop for QpAttach {
    fn drop(&mut self) {
        // SAFETY: the id is valid and its lock still held (see new).
        unsafe {
            (*self.id).qp = std::ptr::null_mut();
            (*self.id).pd = self.pd;
        }
    }
}

/// `id->qp` set for a handshake awaited without holding the id's lock (by the
/// async layer, and by a blocking [`CmId::connect`] between its polls);
/// dropping it clears `id->qp` (and restores `id->pd`) and the id's
/// `connecting` flag under the lock.
pub(crate) struct Handshake {
    inner: Arc<IdInner>,
    pd: *mut ffi::ibv_pd,
    /// The id is on an iWARP device ([`Handshake::on_iwarp`]).
    #[cfg(feature = "tokio")]
    iwarp: bool,
}

// SAFETY: the pointers are only dereferenced under the id's lock (in Drop).
unsafe impl Send for Handshake {}
// SAFETY: &Handshake gives access to nothing.
unsafe impl Sync for Handshake {}

impl Handshake {
    /// Turns an attach made under the lock into one that outlives the lock.
    pub(super) fn keep(inner: &Arc<IdInner>, attach: QpAttach) -> Handshake {
        let h = Handshake {
            inner: inner.clone(),
            pd: attach.pd,
            // SAFETY: valid id under its lock (the attach's); a connect or
            // accept happens on a bound id, whose `verbs` is an open context
            // with its device.
            #[cfg(feature = "tokio")]
            iwarp: unsafe {
                let verbs = (*attach.id).verbs;
                !verbs.is_null() && (*(*verbs).device).transport_type == ffi::IBV_TRANSPORT_IWARP
            },
        };
        std::mem::forget(attach);
        h
    }

    /// The handshake ends without ESTABLISHED: a late reply to it is
    /// screened ([`IdInner::screen`]).
    pub(crate) fn abandon(&self) {
        self.inner.abandoned.store(true, Ordering::Relaxed);
    }

    /// Whether the id is on an iWARP device. There the kernel's iWARP CM holds
    /// a reference to the QP from the connect (or accept) until the peer
    /// answers or the MPA timer expires (siw: 10 s), and destroying the QP or
    /// the id meanwhile waits for that.
    #[cfg(feature = "tokio")]
    pub(crate) fn on_iwarp(&self) -> bool {
        self.iwarp
    }
}

impl Drop for Handshake {
    fn drop(&mut self) {
        let _g = self.inner.lock();
        // SAFETY: valid id (the Arc), under its lock: the same writes as QpAttach's Drop.
        unsafe {
            (*self.inner.id()).qp = std::ptr::null_mut();
            (*self.inner.id()).pd = self.pd;
        }
        self.inner.connecting.store(false, Ordering::Relaxed);
    }
}

/// Starting halves of the handshakes, for the async layer (which awaits the
/// events through the channel's readiness handle instead of blocking) and
/// [`connect_all`](super::connect_all) / [`accept_all`](super::accept_all)
/// (which poll many ids' channels at once).
impl CmId {
    pub(crate) fn start_resolve_addr(&self, dst: SocketAddr, timeout: Duration) -> Result<()> {
        self.start_resolve_addr_from(None, dst, timeout)
    }

    /// `rdma_resolve_addr` from `src`, taking the lock.
    pub(crate) fn start_resolve_addr_from(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> Result<()> {
        let _g = self.inner.lock();
        self.start_resolve_addr_locked(src, dst, timeout)
    }

    pub(crate) fn start_resolve_route(&self, timeout: Duration) -> Result<()> {
        let _g = self.inner.lock();
        self.start_resolve_route_locked(timeout)
    }

    /// `rdma_connect` with `qp` attached; ESTABLISHED (or an error event) follows.
    ///
    /// # Safety
    /// `qp` stays alive (not dropped, not moved out of its `Qp`) until the
    /// returned [`Handshake`] is dropped.
    pub(crate) unsafe fn start_connect(
        &self,
        qp: &Qp<Rc, Init>,
        param: &ConnParam,
    ) -> Result<Handshake> {
        param.validate()?;
        let _g = self.inner.lock();
        let id = self.inner.id();
        // SAFETY: the lock is held while `attach` is a QpAttach: it becomes a
        // Handshake (which re-locks to detach) before the lock is released;
        // the QP outlives the Handshake (caller).
        let attach = unsafe { attach_and_call(id, qp, param, ffi::rdma_connect, "rdma_connect")? };
        Ok(Handshake::keep(&self.inner, attach))
    }
}

impl ConnectRequest {
    /// `rdma_accept` with `qp` attached; ESTABLISHED (or an error event)
    /// follows on the returned id.
    ///
    /// # Safety
    /// As [`CmId::start_connect`].
    pub(crate) unsafe fn start_accept(
        mut self,
        qp: &Qp<Rc, Init>,
        param: &ConnParam,
    ) -> Result<(CmId, Handshake)> {
        param.validate()?;
        let Some(cm) = self.id.take() else {
            return Err(busy_id());
        };
        let handshake = {
            let _g = cm.inner.lock();
            let id = cm.inner.id();
            // SAFETY: as in start_connect: the lock is held until `attach`
            // has become a Handshake, and the QP outlives that (caller).
            let attach =
                unsafe { attach_and_call(id, qp, param, ffi::rdma_accept, "rdma_accept")? };
            Handshake::keep(&cm.inner, attach)
        };
        Ok((cm, handshake))
    }
}

/// Checks that `qp` is on the id's device and that no QP is attached, attaches
/// it and makes the handshake call `verb` (`rdma_connect` or `rdma_accept`).
///
/// # Safety
/// `id` is valid and its lock is held for the returned guard's whole life;
/// `qp` outlives the guard.
pub(super) unsafe fn attach_and_call(
    id: *mut ffi::rdma_cm_id,
    qp: &Qp<Rc, Init>,
    param: &ConnParam,
    call: unsafe extern "C" fn(*mut ffi::rdma_cm_id, *mut ffi::rdma_conn_param) -> libc::c_int,
    verb: &'static str,
) -> Result<QpAttach> {
    check_port_space(id, false)?;
    // SAFETY: valid id under its lock (caller); plain fields.
    let (verbs, port, cur) = unsafe { ((*id).verbs, (*id).port_num, (*id).qp) };
    check_qp_device(verbs, port, qp)?;
    if !cur.is_null() {
        return Err(busy_id());
    }
    // SAFETY: valid id, locked for the guard's life; qp outlives it (caller).
    let attach = unsafe { QpAttach::new(id, qp.as_raw()) };
    let mut cp = param.to_ffi();
    // SAFETY: valid id with our QP attached; cp and its private data live
    // across the call.
    let rc = unsafe { call(id, &mut cp) };
    if rc != 0 {
        return Err(conn_call_error(verb, last_errno()));
    }
    Ok(attach)
}

impl CmId {
    /// Connects to the resolved peer (`rdma_connect`) and waits up to
    /// `timeout` for ESTABLISHED, returning the QP in RTS and the ESTABLISHED
    /// event (with the peer's accept private data).
    ///
    /// librdmacm moves `qp` to RTR and RTS during the handshake; receives
    /// posted before stay posted. `qp` must be on this id's device (normally
    /// from [`CmId::create_qp`]). A REJECTED, UNREACHABLE or CONNECT_ERROR
    /// event is returned as [`Error::CmEvent`]; on any failure the QP is
    /// dropped, and the id should be dropped too (an rdma_cm id connects once):
    /// a late answer from the peer (CONNECT_RESPONSE or ESTABLISHED) comes
    /// from the id's event calls as an [`Error::CmEvent`] that says so.
    /// On iWARP the kernel holds the QP until the peer answers or the MPA timer
    /// expires (siw: 10 s), so after a `timeout` shorter than that, dropping
    /// the QP waits for the rest (the async `AsyncCmId::connect` drops it on
    /// the runtime's blocking pool instead). And where `rdma_connect` itself
    /// connects the TCP stream before it returns (siw on Debian's 6.1 and
    /// 6.12 kernels), a peer that does not answer holds the call, and the
    /// id's other methods on other threads, for TCP's connect timeout
    /// (about 2 minutes with the default `tcp_syn_retries`), whatever
    /// `timeout` says; a refusal is an [`Error::Verb`] (`ECONNREFUSED`) at once.
    #[doc(alias = "rdma_connect")]
    pub fn connect(
        &self,
        qp: Qp<Rc, Init>,
        param: &ConnParam,
        timeout: Duration,
    ) -> Result<(Qp<Rc, Rts>, CmEvent)> {
        param.validate()?;
        let handshake = {
            let _g = self.inner.lock();
            self.inner.refuse_if_waiting()?;
            let id = self.inner.id();
            // SAFETY: the lock is held while `attach` is a QpAttach: it becomes
            // a Handshake (which re-locks to detach) before the lock is
            // released; the QP outlives the Handshake (dropped below, and on
            // unwinding before the parameter `qp`).
            let attach =
                unsafe { attach_and_call(id, &qp, param, ffi::rdma_connect, "rdma_connect")? };
            self.inner.connecting.store(true, Ordering::Relaxed);
            Handshake::keep(&self.inner, attach)
        };
        // Without the lock between polls: getters and other calls on this id
        // do not wait for the handshake (event readers and `disconnect` see
        // `connecting` and leave the id's events and QP alone).
        let ev = self.inner.expect(Awaited::CONNECTED, timeout);
        if ev.is_err() {
            handshake.abandon();
        }
        drop(handshake);
        let ev = ev?;
        // SAFETY: ESTABLISHED on an id with this QP attached means librdmacm
        // processed the reply and moved the QP to RTR and RTS (else it reports
        // CONNECT_ERROR).
        Ok((unsafe { qp.assume_state::<Rts>() }, ev))
    }
}

fn conn_call_error(verb: &'static str, e: io::Error) -> Error {
    let hint = match e.raw_os_error() {
        Some(libc::EINVAL) => Some(format!(
            "{}check the private data length (InfiniBand/RoCE: at most 56 bytes on connect, 196 on accept), \
             responder_resources/initiator_depth (at most the device's max_qp_rd_atom/max_qp_init_rd_atom), \
             and that the address and route were resolved",
            once_hint(verb)
        )),
        _ => None,
    };
    Error::Verb {
        verb,
        source: e,
        hint,
    }
}

/// The first thing to check when `rdma_connect` refuses with EINVAL: an id
/// connects once, and a second connect on it (after one that succeeded,
/// failed or timed out) is refused the same way as bad parameters.
pub(super) fn once_hint(verb: &str) -> &'static str {
    if verb == "rdma_connect" {
        "an rdma_cm id connects once: after a connect on it (also one that failed or timed \
         out) resolve a new id; otherwise "
    } else {
        ""
    }
}
