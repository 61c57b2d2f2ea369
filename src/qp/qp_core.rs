//! The state every QP carries, whatever its type and state: the verbs handle,
//! its rings and heads, its CQs, and what the transport and features add.

use super::*;
use crate::error::Error;

pub(super) struct QpCore {
    pub(super) raw: NonNull<ffi::ibv_qp>,
    /// Slot rings of the send and receive queue, registered on their CQs.
    pub(super) sq: Arc<Ring>,
    pub(super) rq: Arc<Ring>,
    pub(super) sq_head: u64,
    pub(super) rq_head: u64,
    pub(super) caps: QpCaps,
    pub(super) psn: u32,
    pub(super) port: u8,
    pub(super) send_cq: Arc<CqInner>,
    pub(super) recv_cq: Arc<CqInner>,
    pub(super) pd: Pd,
    /// What the transport and the features add (UD addressing, an SRQ, the
    /// extended send API, scoped requests, the async numbering).
    pub(super) ext: QpExtensions,
    /// A raw post (`post_send_raw`, `post_recv_raw`) was made: its
    /// completions are not counted by the rings, so the CQ entries stay
    /// reserved after the QP is destroyed until a poll finds the CQ empty.
    pub(super) raw_posted: bool,
}

/// What a transport or a feature adds to a QP, apart from the core's books:
/// a new feature adds its state here.
pub(super) struct QpExtensions {
    /// UD only: the address handles of posted sends and the largest payload.
    pub(super) ud: Option<Box<ud::UdState>>,
    /// The shared receive queue the QP takes its receives from (its own
    /// receive ring then has depth 0); released after the QP is destroyed.
    pub(super) srq: Option<Arc<SrqInner>>,
    /// Dropped after the QP is destroyed (e.g. the rdma_cm id that created it).
    pub(super) _keepalive: Option<Box<dyn Any + Send + Sync>>,
    /// What scoped requests need (see [`scope`]), made by the first scope.
    pub(super) scoped: Option<Box<scope::ScopedTables>>,
    /// The extended send interface, when the QP was created with one.
    pub(super) send_ex: Option<send_ex::SendEx>,
    /// The multicast groups the QP is attached to, detached before it is
    /// destroyed (`qp/mcast.rs`).
    pub(super) mcast: mcast::Memberships,
    /// The memory windows that window requests name, by send slot (see
    /// `qp/mw.rs`); made by the first such request.
    pub(super) windows: Option<Arc<mw::WindowTable>>,
    /// The next `wr_id` an `AsyncQp` wrapping this QP gives a request: kept
    /// across wrappers, so that no completion of an earlier wrapper's
    /// request (retired, but perhaps not dispatched yet) carries the `wr_id`
    /// of a later one's.
    #[cfg(feature = "tokio")]
    pub(super) async_next_id: u64,
}

impl QpExtensions {
    /// A QP's extensions at creation: its SRQ, if any, and what to keep alive
    /// until it is destroyed; the rest is set up by its constructor or later.
    pub(super) fn new(
        srq: Option<Arc<SrqInner>>,
        keepalive: Option<Box<dyn Any + Send + Sync>>,
    ) -> QpExtensions {
        QpExtensions {
            ud: None,
            srq,
            _keepalive: keepalive,
            scoped: None,
            send_ex: None,
            mcast: mcast::Memberships::default(),
            windows: None,
            #[cfg(feature = "tokio")]
            async_next_id: 1,
        }
    }
}

// SAFETY: ibv_qp may be used from any thread; posting on a queue needs &mut
// of its head (the whole Qp, or one half of a split one), so one thread posts
// on each queue at a time, and the rings are Send + Sync (see ledger/ring.rs).
unsafe impl Send for QpCore {}

// SAFETY: &Qp only reaches query verbs, which libibverbs makes thread-safe.
unsafe impl Sync for QpCore {}

impl Drop for QpCore {
    fn drop(&mut self) {
        self.release_retired_windows();
        self.detach_all_mcast();
        // SAFETY: raw is a live QP owned by this core. After ibv_destroy_qp returns
        // the NIC no longer touches its buffers and generates no completion for it.
        let rc = unsafe { ffi::ibv_destroy_qp(self.raw.as_ptr()) };
        if rc != 0 {
            // The QP survives, so its buffers, rings and address handles
            // must too: leak them.
            std::mem::forget(self.sq.clone());
            std::mem::forget(self.rq.clone());
            std::mem::forget(self.ext.ud.take());
            std::mem::forget(self.ext.windows.take());
            return;
        }
        // A queue with nothing in flight (and no raw posts) has no completion
        // left in its CQ: its CQ entries can be given back now. Not a send
        // queue that holds requests swept while the NIC may still have them
        // (an unsignaled READ on iWARP): a flush may complete them yet.
        let sq_drained =
            !self.raw_posted && self.sq.in_flight(self.sq_head) == 0 && !self.sq.holds_any();
        let rq_drained = !self.raw_posted && self.rq.in_flight(self.rq_head) == 0;
        // Release the buffers now (no need to wait for the CQ to be polled);
        // the rings stay registered until the CQs are polled empty, so that
        // completions still queued for this QP are recognised as stale.
        // SAFETY: this core was the rings' only producer, the heads are its
        // counts, and the QP is destroyed, so nothing more is posted.
        unsafe {
            self.sq.release_posted(self.sq_head);
            self.rq.release_posted(self.rq_head);
        }
        self.send_cq.rings.retire_destroyed(&self.sq, sq_drained);
        self.recv_cq.rings.retire_destroyed(&self.rq, rq_drained);
        if let Some(table) = self.ext.windows.take() {
            table.release_all();
        }
    }
}

impl QpCore {
    /// Lets go of the windows that only retired requests name, before the
    /// QP is destroyed: a type 2 window bound through this QP holds a
    /// reference on it in rxe, whose destroy then waits for it (about 50 s
    /// on Linux 6.1) before giving up. Requests still in flight keep theirs
    /// until the QP is gone.
    fn release_retired_windows(&mut self) {
        if let Some(table) = self.ext.windows.as_ref() {
            crate::mw::WindowHolder::release_retired(&**table);
        }
    }

    /// Posts the send chain at `head` (see [`send_ex::post_chain`]).
    ///
    /// # Safety
    /// As `ibv_post_send`'s: `head` heads a well-formed chain whose memory
    /// the caller keeps valid as the verb requires; `bad` is writable.
    #[inline(always)]
    pub(super) unsafe fn post_send_chain(
        &self,
        head: *mut ffi::ibv_send_wr,
        bad: *mut *mut ffi::ibv_send_wr,
    ) -> i32 {
        // SAFETY: raw is live and send_ex (if any) is its extended interface;
        // the chain is the caller's promise.
        unsafe {
            send_ex::post_chain::<false>(self.raw.as_ptr(), self.ext.send_ex.as_ref(), head, bad)
        }
    }

    /// After a move to ERR: when sends are outstanding (and a slot is free),
    /// posts a signaled zero-length SEND without buffers. In ERR it is flushed
    /// at once; queues complete in order, so its completion retires every
    /// send before it: unsignaled ones that completed without a completion,
    /// and any whose completion `poll_raw` consumed. The poller recognises it
    /// by its slot and does not hand it out. A provider that names the post
    /// refused leaves things as they were (the ring slot is taken back); one
    /// that fails without naming it (a failed doorbell may have queued it)
    /// leaves the marker counted.
    ///
    /// Not on UD: a UD send needs an address handle, and UD sends are always
    /// signaled, so every one of them completes (or is flushed) anyway.
    pub(super) fn post_drain_marker(&mut self) {
        if self.ext.ud.is_some() {
            return;
        }
        let (ring, head) = (&self.sq, &mut self.sq_head);
        let in_flight = ring.in_flight(*head);
        if in_flight == 0 || in_flight >= ring.room_depth(in_flight) {
            return;
        }
        let bufs = Sges::default();
        let meta = crate::ledger::ring::SlotMeta {
            opcode: ffi::IBV_WR_SEND,
            signaled: true,
            drain: true,
        };
        // SAFETY: producer side (&mut self); a slot is free (checked above
        // against `room_depth`, which allocated the slots);
        // `bufs` is empty and forgotten below.
        let token = unsafe { ring.fill(*head, 0, meta, &bufs) };
        std::mem::forget(bufs);
        *head += 1;
        let mut wr = ffi::ibv_send_wr {
            wr_id: token,
            opcode: ffi::IBV_WR_SEND,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        let mut bad = std::ptr::null_mut();
        // SAFETY: a one-request chain; no SGEs, so the NIC touches no memory.
        let rc = unsafe {
            send_ex::post_chain::<false>(
                self.raw.as_ptr(),
                self.ext.send_ex.as_ref(),
                &mut wr,
                &mut bad,
            )
        };
        // Taken back only when the provider named it refused: a failed
        // `ibv_wr_complete` or doorbell may have queued it (it has no
        // buffers, so keeping its slot costs nothing).
        if rc != 0 && !bad.is_null() {
            // SAFETY: producer side; the device refused the marker.
            drop(unsafe { ring.unfill_from(*head - 1, head) });
        }
    }

    pub(super) fn modify(
        &self,
        (mut attr, mask): (ffi::ibv_qp_attr, u32),
        from: &'static str,
        to: &'static str,
    ) -> Result<()> {
        // SAFETY: valid QP; attr is a fully initialised ibv_qp_attr.
        let rc = unsafe { ffi::ibv_modify_qp(self.raw.as_ptr(), &mut attr, mask as i32) };
        if rc == 0 {
            return Ok(());
        }
        let hint = match (rc.abs(), to) {
            (libc::EINVAL, "INIT") => Some(
                "check the access flags: a QP takes LOCAL_WRITE, REMOTE_READ, REMOTE_WRITE, \
                 REMOTE_ATOMIC and the FLUSH ones, not the registration-only ones (e.g. \
                 ON_DEMAND)"
                    .to_owned(),
            ),
            (libc::EINVAL, "RTS") if mask == attr::sq_psn_only(0).1 => {
                Some("check the SQ PSN (24 bits)".to_owned())
            }
            (libc::EINVAL | libc::ENODATA, "RTR") => Some(
                "check the remote QPN, the GID index (sgid_index must exist on this port; RoCE needs a GRH), \
                 the path MTU and max_dest_rd_atomic"
                    .to_owned(),
            ),
            (libc::ETIMEDOUT, "RTR") => Some(
                "the destination GID's IP address did not answer neighbour discovery (ARP/ND): is the \
                 peer up, and is its GID (from its endpoint) right?"
                    .to_owned(),
            ),
            (libc::EINVAL, "RTS") => Some("check timeout, retry_cnt (<= 7), rnr_retry (<= 7) and max_rd_atomic".to_owned()),
            _ => None,
        };
        Err(Error::Transition {
            from,
            to,
            mask,
            mask_names: attr::mask_names(mask),
            source: errno(rc),
            hint,
        })
    }
}

/// The error of a post (`verb`) on a QP of `pd` the provider refused with `rc`; `staged` is the
/// refused request's `ibv_wr_opcode` (`IBV_WC_RECV` for a receive) and whether it has
/// no buffers, when known. An iWARP device (siw, iWARP RNICs) has no immediate data,
/// atomics or memory-window operations, and libsiw takes no receive without a buffer:
/// its provider refuses those with a bare `EINVAL`, which becomes
/// [`Error::Unsupported`] naming what is missing. This runs only after a post
/// failed, so the requests that succeed pay nothing for the check.
#[cold]
#[inline(never)]
pub(super) fn post_refused(
    pd: &Pd,
    verb: &'static str,
    rc: i32,
    staged: Option<(u32, bool)>,
) -> Error {
    let missing = match staged {
        Some((ffi::IBV_WR_SEND_WITH_IMM | ffi::IBV_WR_RDMA_WRITE_WITH_IMM, _)) => {
            "immediate data (SEND or WRITE with imm): carry the value in the payload instead"
        }
        Some((ffi::IBV_WR_ATOMIC_CMP_AND_SWP | ffi::IBV_WR_ATOMIC_FETCH_AND_ADD, _)) => {
            "atomics (its atomic_cap is ATOMIC_NONE): use a two-sided protocol or a device \
             with atomics"
        }
        Some((ffi::IBV_WR_BIND_MW | ffi::IBV_WR_LOCAL_INV, _)) => {
            "memory-window operations (BIND_MW, LOCAL_INV): grant access with Mr registrations"
        }
        Some((ffi::IBV_WC_RECV, true)) => {
            "receive without a buffer (siw's provider refuses one with no scatter entry): \
             give the receive a buffer of at least one byte instead of RecvWr::empty"
        }
        _ => return Error::verb(verb, errno(rc)),
    };
    if !pd.context().is_iwarp() {
        return Error::verb(verb, errno(rc));
    }
    Error::Unsupported {
        verb,
        hint: format!("the QP's device speaks iWARP, which has no {missing}"),
    }
}

impl QpCore {
    /// [`post_refused`] for a send of `opcode`.
    #[cold]
    #[inline(never)]
    pub(super) fn send_refused(&self, rc: i32, opcode: u32) -> Error {
        post_refused(&self.pd, "ibv_post_send", rc, Some((opcode, false)))
    }
}
