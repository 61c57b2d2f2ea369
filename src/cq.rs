//! `Cq`: completion queues, and the completions that hand buffers back.
//!
//! Polling a completion of a work request posted through the safe path
//! returns the buffers that request owned (see [`crate::qp`] for the design).

use std::any::Any;
use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::channel::{CompletionChannel, CqEvents};
use crate::context::Context;
use crate::enums::c_enum;
use crate::error::{Error, Result, errno, last_errno};
use crate::ffi;
use crate::qp::ring::{self, Sges};

c_enum! {
    /// Status of a work completion (`ibv_wc_status`).
    pub enum WcStatus: u32 {
        /// Success.
        Success = ffi::IBV_WC_SUCCESS => "IBV_WC_SUCCESS",
        /// Local length error (e.g. a receive buffer too small for the message).
        LocLenErr = ffi::IBV_WC_LOC_LEN_ERR => "IBV_WC_LOC_LEN_ERR",
        /// Local QP operation error.
        LocQpOpErr = ffi::IBV_WC_LOC_QP_OP_ERR => "IBV_WC_LOC_QP_OP_ERR",
        /// Local EE context operation error.
        LocEecOpErr = ffi::IBV_WC_LOC_EEC_OP_ERR => "IBV_WC_LOC_EEC_OP_ERR",
        /// Local protection error (bad lkey or access rights).
        LocProtErr = ffi::IBV_WC_LOC_PROT_ERR => "IBV_WC_LOC_PROT_ERR",
        /// Flushed: the QP was in the error state.
        WrFlushErr = ffi::IBV_WC_WR_FLUSH_ERR => "IBV_WC_WR_FLUSH_ERR",
        /// Memory window bind error.
        MwBindErr = ffi::IBV_WC_MW_BIND_ERR => "IBV_WC_MW_BIND_ERR",
        /// Bad response.
        BadRespErr = ffi::IBV_WC_BAD_RESP_ERR => "IBV_WC_BAD_RESP_ERR",
        /// Local access error.
        LocAccessErr = ffi::IBV_WC_LOC_ACCESS_ERR => "IBV_WC_LOC_ACCESS_ERR",
        /// Remote invalid request.
        RemInvReqErr = ffi::IBV_WC_REM_INV_REQ_ERR => "IBV_WC_REM_INV_REQ_ERR",
        /// Remote access error (wrong rkey, out of range, missing rights).
        RemAccessErr = ffi::IBV_WC_REM_ACCESS_ERR => "IBV_WC_REM_ACCESS_ERR",
        /// Remote operation error.
        RemOpErr = ffi::IBV_WC_REM_OP_ERR => "IBV_WC_REM_OP_ERR",
        /// Transport retry counter exceeded (peer unreachable).
        RetryExcErr = ffi::IBV_WC_RETRY_EXC_ERR => "IBV_WC_RETRY_EXC_ERR",
        /// RNR retry counter exceeded (peer had no receive posted).
        RnrRetryExcErr = ffi::IBV_WC_RNR_RETRY_EXC_ERR => "IBV_WC_RNR_RETRY_EXC_ERR",
        /// Local RDD violation.
        LocRddViolErr = ffi::IBV_WC_LOC_RDD_VIOL_ERR => "IBV_WC_LOC_RDD_VIOL_ERR",
        /// Remote invalid RD request.
        RemInvRdReqErr = ffi::IBV_WC_REM_INV_RD_REQ_ERR => "IBV_WC_REM_INV_RD_REQ_ERR",
        /// Remote aborted.
        RemAbortErr = ffi::IBV_WC_REM_ABORT_ERR => "IBV_WC_REM_ABORT_ERR",
        /// Invalid EE context number.
        InvEecnErr = ffi::IBV_WC_INV_EECN_ERR => "IBV_WC_INV_EECN_ERR",
        /// Invalid EE context state.
        InvEecStateErr = ffi::IBV_WC_INV_EEC_STATE_ERR => "IBV_WC_INV_EEC_STATE_ERR",
        /// Fatal error.
        FatalErr = ffi::IBV_WC_FATAL_ERR => "IBV_WC_FATAL_ERR",
        /// Response timeout.
        RespTimeoutErr = ffi::IBV_WC_RESP_TIMEOUT_ERR => "IBV_WC_RESP_TIMEOUT_ERR",
        /// General error.
        GeneralErr = ffi::IBV_WC_GENERAL_ERR => "IBV_WC_GENERAL_ERR",
        /// Tag matching error.
        TmErr = ffi::IBV_WC_TM_ERR => "IBV_WC_TM_ERR",
        /// Tag matching rendezvous incomplete.
        TmRndvIncomplete = ffi::IBV_WC_TM_RNDV_INCOMPLETE => "IBV_WC_TM_RNDV_INCOMPLETE",
    }
}

impl WcStatus {
    /// rdma-core's description (`ibv_wc_status_str`), e.g. "remote access error".
    pub fn description(self) -> String {
        // SAFETY: ibv_wc_status_str returns a static string for any value.
        unsafe { crate::device::cstr(ffi::ibv_wc_status_str(self.as_raw())) }
    }

    /// What usually causes this status.
    pub fn hint(self) -> Option<&'static str> {
        Some(match self {
            WcStatus::RemAccessErr => {
                "check the rkey, that the remote range is inside the peer's MR, and its REMOTE_* access flags"
            }
            WcStatus::RnrRetryExcErr => {
                "the peer had no receive posted; post receives before the sender starts, or raise rnr_retry"
            }
            WcStatus::RetryExcErr => {
                "the peer did not answer: is it up, is its QP in RTR/RTS, do GID index and path MTU match?"
            }
            WcStatus::LocLenErr => "the receive buffer is smaller than the incoming message",
            WcStatus::LocProtErr => {
                "a local buffer's lkey or access rights do not allow this operation (READ/atomic targets need LOCAL_WRITE)"
            }
            WcStatus::WrFlushErr => "the QP is in the error state; earlier completions say why",
            _ => return None,
        })
    }

    /// True for success.
    pub fn is_success(self) -> bool {
        self == WcStatus::Success
    }
}

c_enum! {
    /// What a work completion completed (`ibv_wc_opcode`).
    pub enum WcOpcode: u32 {
        /// SEND (with or without immediate).
        Send = ffi::IBV_WC_SEND => "SEND",
        /// RDMA WRITE.
        RdmaWrite = ffi::IBV_WC_RDMA_WRITE => "RDMA_WRITE",
        /// RDMA READ.
        RdmaRead = ffi::IBV_WC_RDMA_READ => "RDMA_READ",
        /// Atomic compare and swap.
        CompSwap = ffi::IBV_WC_COMP_SWAP => "COMP_SWAP",
        /// Atomic fetch and add.
        FetchAdd = ffi::IBV_WC_FETCH_ADD => "FETCH_ADD",
        /// Memory window bind.
        BindMw = ffi::IBV_WC_BIND_MW => "BIND_MW",
        /// Local invalidate.
        LocalInv = ffi::IBV_WC_LOCAL_INV => "LOCAL_INV",
        /// TSO.
        Tso = ffi::IBV_WC_TSO => "TSO",
        /// Atomic write.
        AtomicWrite = ffi::IBV_WC_ATOMIC_WRITE => "ATOMIC_WRITE",
        /// A receive.
        Recv = ffi::IBV_WC_RECV => "RECV",
        /// A receive consumed by RDMA WRITE with immediate.
        RecvRdmaWithImm = ffi::IBV_WC_RECV_RDMA_WITH_IMM => "RECV_RDMA_WITH_IMM",
    }
}

/// A polled work completion, with the buffers its work request owned.
pub struct Completion {
    /// The `wr_id` the application gave the work request.
    pub wr_id: u64,
    /// Status; anything but `Success` means the operation did not happen.
    pub status: WcStatus,
    /// Operation (only meaningful on success).
    pub opcode: WcOpcode,
    /// Bytes received (receives, READ, atomics).
    pub byte_len: u32,
    /// Immediate data in host order, when the sender attached one.
    pub imm_data: Option<u32>,
    /// Local QP number.
    pub qp_num: u32,
    /// Remote QP number (UD).
    pub src_qp: u32,
    /// Raw `ibv_wc_flags`.
    pub wc_flags: u32,
    /// Vendor error syndrome for failed completions.
    pub vendor_err: u32,
    bufs: Sges,
}

impl Completion {
    /// `Ok` on success, else [`Error::WorkCompletion`] naming the status.
    #[inline]
    pub fn result(&self) -> Result<()> {
        if self.status.is_success() {
            Ok(())
        } else {
            Err(Error::WorkCompletion {
                wr_id: self.wr_id,
                status: self.status,
                vendor_err: self.vendor_err,
            })
        }
    }

    /// The buffers the work request owned, without taking them.
    pub fn buffers(&self) -> &Sges {
        &self.bufs
    }

    /// Takes the buffers the work request owned (empty for inline sends and for
    /// completions polled after their QP was reset or destroyed).
    pub fn take_buffers(&mut self) -> Sges {
        std::mem::take(&mut self.bufs)
    }

    /// Takes the first exclusively owned buffer (a receive buffer, READ or atomic destination).
    #[inline]
    pub fn take_mr(&mut self) -> Option<crate::Mr> {
        self.bufs.take_first_owned()
    }

    /// Writes every field but `bufs` from `wc` into `*dst`.
    ///
    /// # Safety
    /// `dst` is valid for writes.
    #[inline]
    unsafe fn write_from_wc(dst: *mut Completion, wc: &ffi::ibv_wc, wr_id: u64) {
        let with_imm = wc.wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        // SAFETY: imm_data is the valid union member when WITH_IMM is set.
        let imm_data = with_imm.then(|| u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data }));
        // Success is by far the common case: skip the status lookup for it.
        let status = if wc.status == ffi::IBV_WC_SUCCESS {
            WcStatus::Success
        } else {
            WcStatus::from_raw(wc.status)
        };
        // SAFETY: `dst` is valid for writes (caller); fields are written in place
        // so the buffers (moved in separately) are not copied again.
        unsafe {
            (&raw mut (*dst).wr_id).write(wr_id);
            (&raw mut (*dst).status).write(status);
            (&raw mut (*dst).opcode).write(WcOpcode::from_raw(wc.opcode));
            (&raw mut (*dst).byte_len).write(wc.byte_len);
            (&raw mut (*dst).imm_data).write(imm_data);
            (&raw mut (*dst).qp_num).write(wc.qp_num);
            (&raw mut (*dst).src_qp).write(wc.src_qp);
            (&raw mut (*dst).wc_flags).write(wc.wc_flags);
            (&raw mut (*dst).vendor_err).write(wc.vendor_err);
        }
    }
}

impl fmt::Debug for Completion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("wr_id", &self.wr_id)
            .field("status", &self.status)
            .field("opcode", &self.opcode)
            .field("byte_len", &self.byte_len)
            .field("imm_data", &self.imm_data)
            .field("qp_num", &self.qp_num)
            .field("buffers", &self.bufs.len())
            .finish()
    }
}

/// A completion queue (`ibv_cq`).
///
/// Not `Clone`: polling needs `&mut self`, which makes the poller the single
/// consumer of the completions of every QP attached to it. QPs keep the
/// underlying CQ alive, so it is destroyed after the last of them.
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

pub(crate) struct CqInner {
    raw: NonNull<ffi::ibv_cq>,
    depth: u32,
    /// Slot rings of destroyed QPs whose stale completions may still sit in this CQ.
    graveyard: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
    dead: AtomicUsize,
    /// Completion events read and not yet acknowledged; its address is the
    /// CQ's `cq_context` (see [`crate::channel`]). `Some` iff `channel` is.
    /// (An `Arc`, not a `Box`: moving a `Box` would assert uniqueness and
    /// invalidate the pointer the kernel hands back.)
    pub(crate) events: Option<Arc<CqEvents>>,
    /// Dropped after the CQ is destroyed: the channel outlives its CQs.
    pub(crate) channel: Option<CompletionChannel>,
    _ctx: Context,
}

// SAFETY: ibv_cq may be used from any thread; polling is serialised by &mut Cq.
unsafe impl Send for CqInner {}
// SAFETY: through &CqInner only QP creation and the mutex-protected graveyard are reached.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        if let Some(events) = self.events.as_deref() {
            // ibv_destroy_cq waits until every event read from the channel is
            // acknowledged: ack the counted ones; readers racing with us see the
            // closing flag and ack their own (see crate::channel).
            let n = events.close();
            if n > 0 {
                // SAFETY: valid CQ; n events were read and not yet acknowledged.
                unsafe { ffi::ibv_ack_cq_events(self.raw.as_ptr(), n) };
            }
        }
        // SAFETY: every QP using this CQ holds an Arc to it, so none is left.
        let rc = unsafe { ffi::ibv_destroy_cq(self.raw.as_ptr()) };
        if rc != 0 {
            // The CQ survives (a QP still uses it): keep everything it may reach.
            let graveyard =
                std::mem::take(self.graveyard.get_mut().unwrap_or_else(|p| p.into_inner()));
            std::mem::forget(graveyard);
            std::mem::forget(self.events.take());
            std::mem::forget(self.channel.take());
            return;
        }
        if let Some(ch) = &self.channel {
            ch.inner.detach();
        }
    }
}

impl CqInner {
    pub(crate) fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.raw.as_ptr()
    }

    /// Keeps a destroyed QP's rings alive until this CQ has been drained.
    pub(crate) fn bury(&self, rings: Arc<dyn Any + Send + Sync>) {
        let mut g = self.graveyard.lock().unwrap_or_else(|p| p.into_inner());
        g.push(rings);
        self.dead.store(g.len(), Ordering::Release);
    }
}

/// How many work completions one `ibv_poll_cq` call fetches at most.
const POLL_BATCH: usize = 32;

impl Cq {
    /// Creates a CQ with room for at least `depth` completions (`ibv_create_cq`).
    ///
    /// A depth above the device's `max_cqe` is refused before calling the kernel.
    pub fn new(ctx: &Context, depth: u32) -> Result<Cq> {
        Cq::create(ctx, depth, None)
    }

    /// `ibv_create_cq`, on `channel` if given (see [`Cq::with_channel`]).
    pub(crate) fn create(
        ctx: &Context,
        depth: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<Cq> {
        let max = ctx.query_device()?.max_cqe;
        if depth == 0 || i64::from(depth) > i64::from(max) {
            return Err(Error::InvalidArgument {
                what: "CQ depth",
                reason: format!("{depth} is outside 1..={max} (the device's max_cqe)"),
            });
        }
        let events = channel.map(|_| Arc::new(CqEvents::new()));
        let cq_context = events.as_ref().map_or(std::ptr::null_mut(), |e| {
            Arc::as_ptr(e) as *mut libc::c_void
        });
        let channel_raw = channel.map_or(std::ptr::null_mut(), |c| c.as_raw());
        // SAFETY: valid context and channel (same device, checked by the caller);
        // cq_context points to the shared counter, which this CqInner holds and
        // frees only after ibv_destroy_cq; vector 0.
        let raw =
            unsafe { ffi::ibv_create_cq(ctx.as_raw(), depth as i32, cq_context, channel_raw, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::verb("ibv_create_cq", last_errno()))?;
        if let Some(ch) = channel {
            ch.inner.attach();
        }
        // SAFETY: raw is valid; cqe is the actual depth the provider chose.
        let actual = unsafe { (*raw.as_ptr()).cqe };
        Ok(Cq {
            inner: Arc::new(CqInner {
                raw,
                depth: u32::try_from(actual).unwrap_or(depth),
                graveyard: Mutex::new(Vec::new()),
                dead: AtomicUsize::new(0),
                events,
                channel: channel.cloned(),
                _ctx: ctx.clone(),
            }),
        })
    }

    /// The depth the device gave the CQ (may exceed what was asked).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// The raw `ibv_cq`.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.as_raw()
    }

    /// Polls up to `out.capacity() - out.len()` completions into `out`, returning
    /// how many were added. Never allocates: reserve the capacity once.
    ///
    /// Each completion of a safe-path work request carries that request's
    /// buffers back ([`Completion::take_mr`], [`Completion::take_buffers`]);
    /// unsignaled sends before it are retired and their buffers released
    /// (use [`Cq::poll_with_retired`] to get those back).
    #[inline]
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        self.poll_inner(out, None)
    }

    /// [`Cq::poll`], and the buffers of the unsignaled requests each completion
    /// retires are appended to `retired` as `(wr_id, buffers)` in posting order
    /// instead of being released: the way to recycle unsignaled READ or atomic
    /// destinations. Allocates only if `retired` runs out of capacity.
    pub fn poll_with_retired(
        &mut self,
        out: &mut Vec<Completion>,
        retired: &mut Vec<(u64, Sges)>,
    ) -> Result<usize> {
        self.poll_inner(out, Some(retired))
    }

    #[inline]
    fn poll_inner(
        &mut self,
        out: &mut Vec<Completion>,
        mut retired: Option<&mut Vec<(u64, Sges)>>,
    ) -> Result<usize> {
        let want = out.capacity() - out.len();
        let dead = self.inner.dead.load(Ordering::Acquire);
        let mut wcs = [MaybeUninit::<ffi::ibv_wc>::uninit(); POLL_BATCH];
        let mut total = 0;
        let mut drained = false;
        while total < want {
            let n = (want - total).min(POLL_BATCH);
            // SAFETY: valid CQ; wcs has room for n entries.
            let rc = unsafe { ffi::ibv_poll_cq(self.as_raw(), n as i32, wcs[0].as_mut_ptr()) };
            if rc < 0 {
                return Err(Error::verb("ibv_poll_cq", errno(rc)));
            }
            let got = rc as usize;
            for wc in &wcs[..got] {
                // SAFETY: the first `got` entries were written by ibv_poll_cq.
                let wc = unsafe { wc.assume_init_ref() };
                let len = out.len();
                // The completion is built in place in `out`'s spare capacity
                // (total < want, so there is room): its buffers move once.
                // SAFETY: in bounds of the allocation (len < capacity). Safe-path WRs
                // carry a slot pointer as wr_id, into rings kept alive by their QP or
                // by this CQ's graveyard; raw-path users promised (post_*_raw's
                // contract) not to poll their completions with this method. Every
                // field is written before set_len.
                unsafe {
                    let dst = out.as_mut_ptr().add(len);
                    let wr_id =
                        ring::retire(wc.wr_id, retired.as_deref_mut(), &raw mut (*dst).bufs);
                    Completion::write_from_wc(dst, wc, wr_id);
                    out.set_len(len + 1);
                }
            }
            total += got;
            if got < n {
                drained = true;
                break;
            }
        }
        if drained && dead > 0 {
            self.reap(dead);
        }
        Ok(total)
    }

    /// The CQ was found empty: completions of QPs destroyed before the poll
    /// began are gone, so their rings can be freed.
    fn reap(&mut self, dead: usize) {
        let mut g = self
            .inner
            .graveyard
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let n = dead.min(g.len());
        let reaped: Vec<_> = g.drain(..n).collect();
        self.inner.dead.store(g.len(), Ordering::Release);
        drop(g);
        // Dropped outside the lock: releasing buffers may run arbitrary Drop code
        // (e.g. a device-memory keepalive) that could bury another QP here.
        drop(reaped);
    }

    /// Polls raw work completions (`ibv_poll_cq`) without interpreting `wr_id`.
    ///
    /// For completions of work requests posted with `post_send_raw` /
    /// `post_recv_raw`. Safe-path completions consumed here do not hand their
    /// buffers back: they stay in the QP's ring until a later completion on the
    /// same queue polled with [`Cq::poll`] sweeps them (queues complete in
    /// order), or the QP is destroyed.
    pub fn poll_raw(&mut self, wcs: &mut [ffi::ibv_wc]) -> Result<usize> {
        let n = i32::try_from(wcs.len()).unwrap_or(i32::MAX);
        // SAFETY: valid CQ; wcs has room for n entries.
        let rc = unsafe { ffi::ibv_poll_cq(self.as_raw(), n, wcs.as_mut_ptr()) };
        if rc < 0 {
            Err(Error::verb("ibv_poll_cq", errno(rc)))
        } else {
            Ok(rc as usize)
        }
    }

    /// Busy-polls until at least `n` more completions are in `out`, or fails
    /// with [`Error::Timeout`] after `timeout`.
    pub fn poll_n(
        &mut self,
        out: &mut Vec<Completion>,
        n: usize,
        timeout: std::time::Duration,
    ) -> Result<()> {
        let target = out.len().saturating_add(n);
        out.reserve(n.min(self.depth() as usize));
        let start = std::time::Instant::now();
        while out.len() < target {
            if self.poll(out)? == 0 && start.elapsed() > timeout {
                return Err(Error::Timeout {
                    what: "waiting for completions",
                    after: timeout,
                });
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq").field("depth", &self.depth()).finish()
    }
}

impl Context {
    /// Creates a completion queue; see [`Cq::new`].
    pub fn create_cq(&self, depth: u32) -> Result<Cq> {
        Cq::new(self, depth)
    }
}
