//! `Cq`: completion queues, and the completions that hand buffers back.
//!
//! Polling a completion of a work request posted through the safe path
//! returns the buffers that request owned (see [`crate::qp`] for the design).

use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::channel::{CompletionChannel, CqEvents};
use crate::context::Context;
use crate::enums::c_enum;
use crate::error::{Error, Result, errno, last_errno};
use crate::ffi;
use crate::qp::Sges;
use crate::qp::ring::Caught;
use crate::qp::table::{RingCache, RingTable, TAG_FLAG};

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
    /// `Ok` on success, else [`Error::WorkCompletion`] for the completion
    /// of `wr_id` (shared by every kind of completion).
    #[inline]
    pub(crate) fn result(self, wr_id: u64, vendor_err: u32) -> Result<()> {
        if self.is_success() {
            Ok(())
        } else {
            Err(Error::WorkCompletion {
                wr_id,
                status: self,
                vendor_err,
            })
        }
    }

    /// rdma-core's description (`ibv_wc_status_str`), e.g. "remote access error".
    pub fn description(self) -> String {
        // SAFETY: ibv_wc_status_str returns a static string for any value.
        unsafe { crate::device::cstr(ffi::ibv_wc_status_str(self.as_raw())) }
    }

    /// What usually causes this status, and what to check.
    pub fn hint(self) -> Option<&'static str> {
        Some(match self {
            WcStatus::RemAccessErr => {
                "check the rkey, that the remote range is inside the peer's MR, and its REMOTE_* access flags"
            }
            WcStatus::RnrRetryExcErr => {
                "the peer had no receive posted; post receives before the sender starts, or raise rnr_retry"
            }
            WcStatus::RetryExcErr => {
                "the peer did not answer: is it up, is its QP in RTR/RTS, do GID index and path MTU match? \
                 (retry_cnt 7 means retry forever on some providers, rxe included)"
            }
            WcStatus::LocLenErr => "the receive buffer is smaller than the incoming message",
            WcStatus::LocQpOpErr => {
                "on a receive: the incoming message is larger than the receive buffer (rxe reports this \
                 instead of LOC_LEN_ERR); on a send: the request is malformed for this QP (a buffer \
                 registered in another PD than the QP's, on rxe), or the link went down"
            }
            WcStatus::RemOpErr => {
                "the peer could not complete the operation: its receive buffer was too small for this \
                 SEND, or its QP failed (look at the peer's completions)"
            }
            WcStatus::RemInvReqErr => {
                "the peer's QP refused the request: it was not granted the access this operation needs \
                 (REMOTE_WRITE/READ/ATOMIC in the peer's InitAttr), or the operation does not fit its \
                 state or limits (e.g. more outstanding READs than its max_dest_rd_atomic)"
            }
            WcStatus::LocProtErr => {
                "a local buffer's lkey or access rights do not allow this operation (READ/atomic targets \
                 need LOCAL_WRITE), or it is registered in another PD than the QP's"
            }
            WcStatus::WrFlushErr => {
                "the QP is in the error state, so its outstanding requests were flushed: it was moved \
                 there (to_error), or an earlier request failed; the first completion that is not a \
                 flush, on this side or the peer's, says why"
            }
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

/// Where a polled completion came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionSource {
    /// A work request posted through the safe path: its buffers are in the
    /// completion and `wr_id` is the application's.
    Posted,
    /// Not a safe-path request of a QP on this CQ: a raw-path post
    /// (`post_*_raw`), a QP created outside this crate, or garbage from a
    /// provider. Nothing was looked up; `wr_id` is the raw value.
    Foreign,
    /// A safe-path token whose request is gone: a second completion for the
    /// same request, or one that raced with its QP's destruction (whose
    /// buffers were released then). `wr_id` is the raw token.
    Stale,
}

/// A polled work completion, with the buffers its work request owned.
///
/// Providers write only the `ibv_wc` fields that are valid for a completion's
/// status and opcode (ibv_poll_cq(3); mlx5 leaves the others unwritten), so
/// only those are read; every other field below is 0 / `None`.
pub struct Completion {
    /// The `wr_id` the application gave the work request (the raw value for
    /// [`Foreign`](CompletionSource::Foreign) and
    /// [`Stale`](CompletionSource::Stale) completions).
    pub wr_id: u64,
    /// Status; anything but `Success` means the operation did not happen.
    pub status: WcStatus,
    /// What completed. For safe-path requests this is what was posted, so it
    /// is right for failed completions too (a failed WRITE says `RdmaWrite`);
    /// receives say `Recv` or, on success, `RecvRdmaWithImm`. Foreign failed
    /// completions, whose opcode the provider does not report, say
    /// `Unknown(u32::MAX)`.
    pub opcode: WcOpcode,
    /// Bytes received (successful receives), read (RDMA READ) or 8 (atomics);
    /// 0 for everything else, which the provider does not report.
    pub byte_len: u32,
    /// Immediate data in host order, when a successful receive carried one.
    pub imm_data: Option<u32>,
    /// Local QP number (always reported).
    pub qp_num: u32,
    /// Remote QP number of a successful receive (meaningful on UD); else 0.
    pub src_qp: u32,
    /// Raw `ibv_wc_flags` of a successful completion; 0 on errors.
    pub wc_flags: u32,
    /// Vendor error syndrome of a failed completion; 0 on success.
    pub vendor_err: u32,
    /// Whether this is a safe-path completion (with buffers) or not.
    pub source: CompletionSource,
    /// Of a successful receive: source LID (bits 0..16), SL (16..24) and
    /// destination LID path bits (24..32), packed into one store.
    path: u32,
    bufs: Sges,
}

/// `wr_id`s of the safe path are tokens: ring tag in the high half (its top
/// bit, bit 63 of the token, always set).
const TOKEN_SHIFT: u32 = 32;

impl Completion {
    /// `Ok` on success, else [`Error::WorkCompletion`] naming the status.
    #[inline]
    pub fn result(&self) -> Result<()> {
        self.status.result(self.wr_id, self.vendor_err)
    }

    /// Source LID of a successful receive (UD on InfiniBand; 0 on RoCE).
    pub fn slid(&self) -> u16 {
        self.path as u16
    }

    /// Service level of a successful receive.
    pub fn sl(&self) -> u8 {
        (self.path >> 16) as u8
    }

    /// Destination LID path bits of a successful receive.
    pub fn dlid_path_bits(&self) -> u8 {
        (self.path >> 24) as u8
    }

    /// True when a successful UD receive carries a GRH (`IBV_WC_GRH`; always
    /// on RoCE): the first [`GRH_LEN`](crate::ah::GRH_LEN) bytes received
    /// hold it.
    pub fn has_grh(&self) -> bool {
        self.wc_flags & ffi::ibv_wc_flags::IBV_WC_GRH.0 != 0
    }

    /// The buffers the work request owned, without taking them.
    pub fn buffers(&self) -> &Sges {
        &self.bufs
    }

    /// Takes the buffers the work request owned: SEND/WRITE sources,
    /// receive, READ and atomic destinations (empty for inline sends and for
    /// foreign or stale completions).
    pub fn take_buffers(&mut self) -> Sges {
        std::mem::take(&mut self.bufs)
    }

    /// Takes the first exclusively owned buffer: a receive buffer, READ or
    /// atomic destination, or an `Mr` that was the source of a SEND/WRITE.
    #[inline]
    pub fn take_mr(&mut self) -> Option<crate::Mr> {
        self.bufs.take_first_owned()
    }

    /// Writes every field but `bufs` into `*dst`, reading from `wc` only the
    /// fields the provider wrote for this status and opcode.
    ///
    /// `posted` is the posted request's wr_id and opcode (safe path), `None`
    /// for foreign and stale completions; `recv` says it came from a receive
    /// queue.
    ///
    /// # Safety
    /// `dst` is valid for writes; `wc` was returned by `ibv_poll_cq` (so
    /// `wr_id`, `status`, `qp_num` are written, and the rest as ibv_poll_cq(3)
    /// says for the status and opcode).
    #[inline]
    unsafe fn write_from_wc(
        dst: *mut Completion,
        wc: *const ffi::ibv_wc,
        posted: Option<(u64, u32)>,
        recv: bool,
        source: CompletionSource,
    ) {
        // SAFETY: reads only fields the provider writes (see above), through
        // raw pointers, never a reference to the partly written struct; `dst`
        // is valid for writes (caller) and written field by field in place.
        unsafe {
            let raw_status = (*wc).status;
            let success = raw_status == ffi::IBV_WC_SUCCESS;
            let (wr_id, opcode) = match posted {
                Some((wr_id, op)) if !(success && recv) => (wr_id, op),
                Some((wr_id, _)) => (wr_id, (*wc).opcode),
                None if success => ((*wc).wr_id, (*wc).opcode),
                None => ((*wc).wr_id, u32::MAX),
            };
            let (mut byte_len, mut imm_data, mut src_qp, mut wc_flags, mut vendor_err) =
                (0, None, 0, 0, 0);
            let mut path = 0;
            let status = if success {
                wc_flags = (*wc).wc_flags;
                if opcode & ffi::IBV_WC_RECV != 0 {
                    byte_len = (*wc).byte_len;
                    src_qp = (*wc).src_qp;
                    path = u32::from((*wc).slid)
                        | u32::from((*wc).sl) << 16
                        | u32::from((*wc).dlid_path_bits) << 24;
                    if wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
                        // imm_data is the valid union member when WITH_IMM is set.
                        imm_data = Some(u32::from_be((*wc).__bindgen_anon_1.imm_data));
                    }
                } else if matches!(
                    opcode,
                    ffi::IBV_WC_RDMA_READ | ffi::IBV_WC_COMP_SWAP | ffi::IBV_WC_FETCH_ADD
                ) {
                    byte_len = (*wc).byte_len;
                }
                WcStatus::Success
            } else {
                vendor_err = (*wc).vendor_err;
                WcStatus::from_raw(raw_status)
            };
            (&raw mut (*dst).wr_id).write(wr_id);
            (&raw mut (*dst).status).write(status);
            (&raw mut (*dst).opcode).write(WcOpcode::from_raw(opcode));
            (&raw mut (*dst).byte_len).write(byte_len);
            (&raw mut (*dst).imm_data).write(imm_data);
            (&raw mut (*dst).qp_num).write((*wc).qp_num);
            (&raw mut (*dst).src_qp).write(src_qp);
            (&raw mut (*dst).wc_flags).write(wc_flags);
            (&raw mut (*dst).vendor_err).write(vendor_err);
            (&raw mut (*dst).source).write(source);
            (&raw mut (*dst).path).write(path);
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
            .field("source", &self.source)
            .field("buffers", &self.bufs.len())
            .finish()
    }
}

/// A completion queue (`ibv_cq`).
///
/// Not `Clone`: polling needs `&mut self`, which makes the poller the single
/// consumer of the completions of every QP attached to it. QPs keep the
/// underlying CQ alive, so it is destroyed after the last of them.
///
/// A QP is only created on a CQ that can hold every completion its queues
/// may produce together with those of the other queues already on it (see
/// [`Error::CqTooSmall`]), so the CQ cannot overrun through the safe path.
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
    /// The poller's copy of the ring table (see [`crate::qp`]).
    cache: RingCache,
    /// Completions a [`scope`](Cq::scope) polled that were not its own,
    /// handed out first by the next poll.
    pending: Vec<Completion>,
    /// Completions lost to [`Cq::poll_raw`] that a `poll_one` found along
    /// with the completion it returned: reported by the next poll.
    lost_unreported: u64,
}

pub(crate) struct CqInner {
    raw: NonNull<ffi::ibv_cq>,
    depth: u32,
    /// The slot rings whose completions this CQ carries, and the entries they reserve.
    pub(crate) rings: RingTable,
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
// SAFETY: through &CqInner other threads reach: QP creation and destruction
// (the mutex-protected ring table), the event counter (atomics, see
// crate::channel), the channel (itself Sync), and `ibv_req_notify_cq` through
// `&Cq`, which libibverbs allows concurrently with polling (providers take
// the CQ lock for it). Polling itself needs `&mut Cq`.
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
            self.rings.leak();
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
}

/// How many work completions one `ibv_poll_cq` call fetches at most.
pub(crate) const POLL_BATCH: usize = 32;

/// Reserves room for a batch when `out` has none spare: a poll into a full
/// (or new) `Vec` would otherwise take nothing, and a loop waiting for a
/// completion that way would never see one.
#[inline(always)]
pub(crate) fn make_room<T>(out: &mut Vec<T>) {
    if out.capacity() == out.len() {
        out.reserve(POLL_BATCH);
    }
}

/// Polls `raw` in batches of up to [`POLL_BATCH`] until `want` entries were
/// read or the CQ ran dry, handing each entry with the next free element of
/// `out`'s spare capacity to `each`, which returns true when it wrote that
/// element (then it counts as added). Returns whether the CQ ran dry. Shared
/// by [`Cq::poll`] and the scope's poll.
///
/// # Safety
/// `raw` is a live CQ whose only consumer the caller is; `want` is at most
/// `out`'s spare capacity; `each` returns true only after writing every
/// field of the element it was given.
#[inline(always)]
pub(crate) unsafe fn poll_in_batches<T>(
    raw: *mut ffi::ibv_cq,
    out: &mut Vec<T>,
    want: usize,
    mut each: impl FnMut(*const ffi::ibv_wc, *mut T) -> bool,
) -> Result<bool> {
    let mut wcs = [MaybeUninit::<ffi::ibv_wc>::uninit(); POLL_BATCH];
    let mut total = 0;
    while total < want {
        let n = (want - total).min(POLL_BATCH);
        // SAFETY: valid CQ (contract); wcs has room for n entries.
        let rc = unsafe { ffi::ibv_poll_cq(raw, n as i32, wcs[0].as_mut_ptr()) };
        if rc < 0 {
            return Err(Error::verb("ibv_poll_cq", errno(rc)));
        }
        let got = (rc as usize).min(n);
        // The length is counted in a local for the batch (not re-read from
        // `out` per entry) and reaches `out` when the guard drops, after the
        // batch or during an unwind from `each`: written elements are kept.
        let mut added = SetLenOnDrop {
            len: out.len(),
            out: &mut *out,
        };
        let next = added.out.as_mut_ptr();
        for wc in &wcs[..got] {
            // SAFETY: ibv_poll_cq wrote this entry; total < want <= spare
            // capacity, so element `added.len` has room; it is counted only
            // once `each` wrote it (contract).
            unsafe {
                if each(wc.as_ptr(), next.add(added.len)) {
                    added.len += 1;
                }
            }
        }
        drop(added);
        total += got;
        if got < n {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Sets the length of `out` to `len` when dropped (see [`poll_in_batches`]).
struct SetLenOnDrop<'a, T> {
    out: &'a mut Vec<T>,
    len: usize,
}

impl<T> Drop for SetLenOnDrop<'_, T> {
    fn drop(&mut self) {
        // SAFETY: `len` counts the elements `each` wrote, all within the
        // spare capacity `poll_in_batches` was given.
        unsafe { self.out.set_len(self.len) }
    }
}

impl Cq {
    /// Creates a CQ with room for at least `depth` completions (`ibv_create_cq`).
    ///
    /// A depth above the device's `max_cqe` is refused before calling the
    /// kernel. Size it for every QP that will use it: each queue needs as
    /// many entries as its depth (`max_send_wr` / `max_recv_wr`).
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
        let depth = u32::try_from(actual).unwrap_or(depth);
        Ok(Cq {
            inner: Arc::new(CqInner {
                raw,
                depth,
                rings: RingTable::new(depth),
                events,
                channel: channel.cloned(),
                _ctx: ctx.clone(),
            }),
            cache: RingCache::default(),
            pending: Vec::new(),
            lost_unreported: 0,
        })
    }

    /// Another handle on the CQ of `inner`, with an empty poller state of its
    /// own, to be lent out as `&Cq` only (never polled: the owner polls).
    /// Everything `&Cq` offers goes through `inner`, which is `Sync`.
    #[cfg(feature = "tokio")]
    pub(crate) fn view_of(inner: &Arc<CqInner>) -> Cq {
        Cq {
            inner: inner.clone(),
            cache: RingCache::default(),
            pending: Vec::new(),
            lost_unreported: 0,
        }
    }

    /// The depth the device gave the CQ (may exceed what was asked).
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// CQ entries the queues of the QPs on this CQ may still fill: the sum of
    /// their depths, plus those of destroyed QPs whose completions may still
    /// be in the CQ (until a poll finds it empty; a queue dropped with
    /// nothing in flight and no raw posts gives its entries back at once).
    pub fn reserved(&self) -> u64 {
        self.inner.rings.reserved()
    }

    /// The raw `ibv_cq`, valid while this `Cq` (or a QP on it) lives.
    ///
    /// Completions polled through it bypass the safe path: the buffers of the
    /// requests they complete stay in their QP's ring until a later completion
    /// of the same queue sweeps them (reported as
    /// [`Error::CompletionsLost`]) or the QP is destroyed.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.as_raw()
    }

    /// Polls up to `out.capacity() - out.len()` completions into `out` (its
    /// spare capacity: reserve it once), returning how many were added. When
    /// `out` has no spare capacity (`Vec::new()`), room for 32 completions
    /// is reserved first, the only case that allocates: a poll never takes
    /// nothing for want of room.
    ///
    /// Each completion of a safe-path work request carries that request's
    /// buffers back ([`Completion::take_mr`], [`Completion::take_buffers`]);
    /// unsignaled sends before it are retired and their buffers released
    /// (use [`Cq::poll_with_retired`] to get those back). Completions that are
    /// not the safe path's come back marked [`CompletionSource::Foreign`] or
    /// [`CompletionSource::Stale`], without buffers.
    ///
    /// # Errors
    /// [`Error::CompletionsLost`] when a completion swept a signaled request
    /// whose own completion never arrived (the CQ overran, or it was consumed
    /// by [`poll_raw`](Cq::poll_raw)); the completions polled in that call are
    /// in `out` all the same.
    #[inline]
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize> {
        make_room(out);
        self.poll_inner(out, usize::MAX, None)
    }

    /// [`Cq::poll`], and the buffers of the unsignaled requests each completion
    /// retires are appended to `retired` as `(wr_id, buffers)` in posting order
    /// instead of being released: the way to recycle unsignaled READ or atomic
    /// destinations. Allocates only if `retired` runs out of capacity (or
    /// `out` has none spare, as [`Cq::poll`]).
    pub fn poll_with_retired(
        &mut self,
        out: &mut Vec<Completion>,
        retired: &mut Vec<(u64, Sges)>,
    ) -> Result<usize> {
        make_room(out);
        self.poll_inner(out, usize::MAX, Some(retired))
    }

    #[inline]
    fn poll_inner(
        &mut self,
        out: &mut Vec<Completion>,
        want: usize,
        mut retired: Option<&mut Vec<(u64, Sges)>>,
    ) -> Result<usize> {
        let start = out.len();
        let want = want.min(out.capacity() - start);
        if !self.pending.is_empty() || self.lost_unreported != 0 {
            // A loss a poll_one deferred, then completions a scope polled
            // for others, come first.
            return self.take_deferred(out, want);
        }
        let buried = self.inner.rings.buried();
        let mut caught: Caught = None;
        let mut lost = 0;
        let raw = self.as_raw();
        // SAFETY: `raw` is this CQ; the completion is built in place in
        // `out`'s spare capacity and every field is written when
        // complete_into returns true.
        let drained = unsafe {
            poll_in_batches(raw, out, want, |wc, dst| {
                self.complete_into(wc, dst, retired.as_deref_mut(), &mut caught, &mut lost)
            })
        }?;
        if drained && buried > 0 {
            self.reap(buried);
        }
        if let Some(p) = caught {
            // A buffer's Drop panicked while the ring was being retired: the
            // books are consistent now, so let the panic go on.
            std::panic::resume_unwind(p);
        }
        if lost > 0 {
            return Err(Error::CompletionsLost { count: lost });
        }
        Ok(out.len() - start)
    }

    /// Interprets one polled work completion: validates its token, retires
    /// its request (and the unsignaled ones before it) and writes the
    /// [`Completion`] with the buffers to `dst`. Returns false, having written
    /// nothing, for the library's own drain marker.
    ///
    /// # Safety
    /// `wc` was returned by `ibv_poll_cq` on this CQ (so `wr_id`, `status`,
    /// `qp_num` are written, the rest as ibv_poll_cq(3) says for the status
    /// and opcode); `dst` is valid for writes and holds nothing to drop.
    #[inline(always)]
    pub(crate) unsafe fn complete_into(
        &mut self,
        wc: *const ffi::ibv_wc,
        dst: *mut Completion,
        retired: Option<&mut Vec<(u64, Sges)>>,
        caught: &mut Caught,
        lost: &mut u64,
    ) -> bool {
        // SAFETY: per the contract; `retire` writes the buffers iff it
        // returns Some, else they are set empty below; write_from_wc reads
        // the entry only as its status and opcode allow.
        unsafe {
            let bufs = &raw mut (*dst).bufs;
            let token = (*wc).wr_id;
            let tag = (token >> TOKEN_SHIFT) as u32;
            let ring = if tag & TAG_FLAG == 0 {
                None // not a token: raw posts keep bit 63 clear
            } else {
                self.cache.get(&self.inner.rings, tag)
            };
            let (source, posted, recv) = match ring {
                Some(ring) if ring.qp_num() == (*wc).qp_num => {
                    match ring.retire(token as u32, retired, bufs, caught, lost) {
                        // The library's own drain marker (see Qp::to_error):
                        // it has retired the requests before it; nothing to
                        // hand out (its empty buffer list needs no drop).
                        Some(r) if r.meta.drain => return false,
                        Some(r) => (
                            CompletionSource::Posted,
                            Some((r.wr_id, r.meta.completion_opcode())),
                            r.meta.is_recv(),
                        ),
                        None => (CompletionSource::Stale, None, false),
                    }
                }
                // A shared receive queue's receive, consumed by any QP on
                // it: it retires exactly its own slot.
                Some(ring) if ring.is_srq() => match ring.retire_srq(token as u32, bufs) {
                    Some(r) => (
                        CompletionSource::Posted,
                        Some((r.wr_id, ffi::IBV_WC_RECV)),
                        true,
                    ),
                    None => (CompletionSource::Stale, None, false),
                },
                _ => (CompletionSource::Foreign, None, false),
            };
            if posted.is_none() {
                bufs.write(Sges::default());
            }
            Completion::write_from_wc(dst, wc, posted, recv, source);
            true
        }
    }

    /// Keeps a completion that a [`scope`](Cq::scope) polled but that was
    /// not its own, for the next [`poll`](Cq::poll).
    ///
    /// # Safety
    /// As [`complete_into`](Cq::complete_into) for `wc`.
    pub(crate) unsafe fn stash(
        &mut self,
        wc: *const ffi::ibv_wc,
        caught: &mut Caught,
        lost: &mut u64,
    ) {
        let mut pending = std::mem::take(&mut self.pending);
        pending.reserve(1);
        let len = pending.len();
        // SAFETY: room for one more was reserved; complete_into writes every
        // field when it returns true, and nothing otherwise.
        unsafe {
            if self.complete_into(wc, pending.as_mut_ptr().add(len), None, caught, lost) {
                pending.set_len(len + 1);
            }
        }
        self.pending = pending;
    }

    /// Keeps a loss for the next poll to report.
    pub(crate) fn defer_lost(&mut self, count: u64) {
        self.lost_unreported = self.lost_unreported.saturating_add(count);
    }

    /// What earlier polls left for this one: a loss a `poll_one` deferred
    /// (reported first, alone), else up to `want` stashed completions moved
    /// into `out` (oldest first).
    #[cold]
    #[inline(never)]
    fn take_deferred(&mut self, out: &mut Vec<Completion>, want: usize) -> Result<usize> {
        if self.lost_unreported != 0 {
            let count = std::mem::take(&mut self.lost_unreported);
            return Err(Error::CompletionsLost { count });
        }
        let n = want.min(self.pending.len());
        out.extend(self.pending.drain(..n));
        Ok(n)
    }

    /// The CQ was found empty: completions of QPs destroyed before the poll
    /// began are gone, so their rings can be unregistered and their CQ
    /// entries given back.
    #[cold]
    fn reap(&mut self, buried: usize) {
        let reaped = self.inner.rings.reap(buried, &mut self.cache);
        // Dropped outside the table's lock (the buffers were released already).
        drop(reaped);
    }

    /// Polls raw work completions (`ibv_poll_cq`) without interpreting `wr_id`.
    ///
    /// For completions of work requests posted with `post_send_raw` /
    /// `post_recv_raw`. Safe-path completions consumed here do not hand their
    /// buffers back: they stay in the QP's ring until a later completion on
    /// the same queue polled with [`Cq::poll`] sweeps them (and reports them
    /// as [`Error::CompletionsLost`]), or the QP is destroyed. Only the
    /// fields ibv_poll_cq(3) names valid for each entry's status and opcode
    /// hold data (the rest are as `wcs` had them).
    pub fn poll_raw(&mut self, wcs: &mut [ffi::ibv_wc]) -> Result<usize> {
        let n = i32::try_from(wcs.len()).unwrap_or(i32::MAX);
        // SAFETY: valid CQ; wcs has room for n entries (already initialised,
        // so fields the provider leaves unwritten keep their values).
        let rc = unsafe { ffi::ibv_poll_cq(self.as_raw(), n, wcs.as_mut_ptr()) };
        if rc < 0 {
            Err(Error::verb("ibv_poll_cq", errno(rc)))
        } else {
            Ok(rc as usize)
        }
    }

    /// Busy-polls until exactly `n` more completions are in `out` (never
    /// more: the rest stay in the CQ for the next poll), or fails with
    /// [`Error::Timeout { .. }`](Error::Timeout) after `timeout`; the
    /// completions polled before the timeout stay in `out`. `out` grows as
    /// completions come (at least 32 more at a time), so a huge
    /// `n` allocates only for what arrives.
    pub fn poll_n(
        &mut self,
        out: &mut Vec<Completion>,
        n: usize,
        timeout: std::time::Duration,
    ) -> Result<()> {
        poll_exactly(out, n, timeout, "waiting for completions", |out, want| {
            self.poll_inner(out, want, None)
        })
    }

    /// Polls exactly one completion, waiting up to `timeout` for it.
    ///
    /// A poll that finds the completion and, on the way, completions that
    /// [`poll_raw`](Cq::poll_raw) took ([`Error::CompletionsLost`]) returns
    /// the completion (with its buffers); the next poll reports the loss.
    pub fn poll_one(&mut self, timeout: std::time::Duration) -> Result<Completion> {
        let mut out = Vec::with_capacity(1);
        match self.poll_n(&mut out, 1, timeout) {
            Err(Error::CompletionsLost { count }) if !out.is_empty() => self.defer_lost(count),
            r => r?,
        }
        out.pop().ok_or(Error::Timeout {
            what: "waiting for a completion",
            after: timeout,
        })
    }
}

/// Polls with `poll(out, want)` (which adds at most `want`, at most `out`'s
/// spare capacity) until exactly `n` more are in `out`, or fails with
/// [`Error::Timeout`] naming `what` after `timeout`. `out` grows with what
/// arrives (by at least [`POLL_BATCH`] where `n` allows), never by `n` up
/// front: a huge `n` must not reserve (or abort on) memory it never uses.
pub(crate) fn poll_exactly<T>(
    out: &mut Vec<T>,
    n: usize,
    timeout: std::time::Duration,
    what: &'static str,
    mut poll: impl FnMut(&mut Vec<T>, usize) -> Result<usize>,
) -> Result<()> {
    let target = out.len().saturating_add(n);
    let start = std::time::Instant::now();
    while out.len() < target {
        let want = target - out.len();
        if out.len() == out.capacity() {
            out.reserve(want.min(POLL_BATCH));
        }
        if poll(out, want)? == 0 && start.elapsed() > timeout {
            return Err(Error::Timeout {
                what,
                after: timeout,
            });
        }
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An `ibv_wc` whose every byte is garbage except the fields a provider
    /// writes for the given status (as mlx5 does: the rest keep whatever the
    /// caller's array held).
    fn poisoned_wc(status: u32, opcode: u32, byte_len: u32) -> MaybeUninit<ffi::ibv_wc> {
        let mut wc = MaybeUninit::<ffi::ibv_wc>::uninit();
        let p = wc.as_mut_ptr();
        // SAFETY: writes into the local's own storage through raw pointers.
        unsafe {
            std::ptr::write_bytes(p.cast::<u8>(), 0xab, size_of::<ffi::ibv_wc>());
            (&raw mut (*p).wr_id).write(0x77);
            (&raw mut (*p).status).write(status);
            (&raw mut (*p).qp_num).write(5);
            if status == ffi::IBV_WC_SUCCESS {
                (&raw mut (*p).opcode).write(opcode);
                (&raw mut (*p).wc_flags).write(0);
                if opcode & ffi::IBV_WC_RECV != 0 || opcode == ffi::IBV_WC_RDMA_READ {
                    (&raw mut (*p).byte_len).write(byte_len);
                }
                if opcode & ffi::IBV_WC_RECV != 0 {
                    (&raw mut (*p).src_qp).write(9);
                    (&raw mut (*p).slid).write(0x1234);
                    (&raw mut (*p).sl).write(3);
                    (&raw mut (*p).dlid_path_bits).write(5);
                }
            } else {
                (&raw mut (*p).vendor_err).write(0x12);
            }
        }
        wc
    }

    fn complete(
        wc: &MaybeUninit<ffi::ibv_wc>,
        posted: Option<(u64, u32)>,
        recv: bool,
    ) -> Completion {
        let mut c = MaybeUninit::<Completion>::uninit();
        let source = match posted {
            Some(_) => CompletionSource::Posted,
            None => CompletionSource::Foreign,
        };
        // SAFETY: `c` is valid for writes; every field is written (bufs here).
        unsafe {
            (&raw mut (*c.as_mut_ptr()).bufs).write(Sges::default());
            Completion::write_from_wc(c.as_mut_ptr(), wc.as_ptr(), posted, recv, source);
            c.assume_init()
        }
    }

    #[test]
    fn failed_completions_read_only_the_always_valid_fields() {
        let wc = poisoned_wc(ffi::IBV_WC_REM_ACCESS_ERR, 0, 0);
        let c = complete(&wc, Some((1, ffi::IBV_WC_RDMA_WRITE)), false);
        assert_eq!(
            (c.wr_id, c.status, c.qp_num),
            (1, WcStatus::RemAccessErr, 5)
        );
        assert_eq!(c.opcode, WcOpcode::RdmaWrite, "what was posted");
        assert_eq!(
            (c.byte_len, c.src_qp, c.wc_flags, c.imm_data),
            (0, 0, 0, None)
        );
        assert_eq!(c.vendor_err, 0x12);
        let c = complete(&wc, None, false);
        assert_eq!((c.wr_id, c.opcode), (0x77, WcOpcode::Unknown(u32::MAX)));
        assert_eq!(c.byte_len, 0);
    }

    #[test]
    fn successful_sends_do_not_read_length_source_or_vendor_error() {
        let wc = poisoned_wc(ffi::IBV_WC_SUCCESS, ffi::IBV_WC_SEND, 0);
        let c = complete(&wc, Some((3, ffi::IBV_WC_SEND)), false);
        assert_eq!(
            (c.opcode, c.byte_len, c.src_qp, c.vendor_err),
            (WcOpcode::Send, 0, 0, 0)
        );
        assert_eq!((c.slid(), c.sl(), c.dlid_path_bits()), (0, 0, 0));
        let wc = poisoned_wc(ffi::IBV_WC_SUCCESS, ffi::IBV_WC_RDMA_READ, 4096);
        let c = complete(&wc, Some((4, ffi::IBV_WC_RDMA_READ)), false);
        assert_eq!((c.byte_len, c.src_qp, c.vendor_err), (4096, 0, 0));
    }

    #[test]
    fn successful_receives_read_their_fields() {
        let wc = poisoned_wc(ffi::IBV_WC_SUCCESS, ffi::IBV_WC_RECV, 40);
        let c = complete(&wc, Some((6, ffi::IBV_WC_RECV)), true);
        assert_eq!((c.opcode, c.byte_len, c.src_qp), (WcOpcode::Recv, 40, 9));
        assert_eq!((c.slid(), c.sl(), c.dlid_path_bits()), (0x1234, 3, 5));
        assert_eq!((c.vendor_err, c.imm_data), (0, None));
    }
}
