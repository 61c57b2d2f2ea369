//! The status and opcode of a work completion.

use crate::error::{Error, Result};
use crate::ffi;
use crate::sys::c_enum;

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
        unsafe { crate::sys::cstr::cstr(ffi::ibv_wc_status_str(self.as_raw())) }
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
                 (retry_cnt 7 means retry forever on some providers, rxe included). On rxe in Linux 6.1 (not \
                 in 6.12) a SEND whose receiver posts its receive late also ends here, after (retry_cnt + 1) \
                 ACK timeouts (about 0.5 s by default) whatever rnr_retry says: post receives before \
                 the peer sends, or raise RtsAttr::timeout"
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
                 (REMOTE_WRITE/READ/ATOMIC, or FLUSH_GLOBAL/PERSISTENT for a FLUSH, in the peer's \
                 InitAttr), or the operation does not fit its \
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
        /// FLUSH (rdma-core 45's `IBV_WC_FLUSH`).
        Flush = ffi::IBV_WC_FLUSH => "FLUSH",
        /// Atomic write.
        AtomicWrite = ffi::IBV_WC_ATOMIC_WRITE => "ATOMIC_WRITE",
        /// A receive.
        Recv = ffi::IBV_WC_RECV => "RECV",
        /// A receive consumed by RDMA WRITE with immediate.
        RecvRdmaWithImm = ffi::IBV_WC_RECV_RDMA_WITH_IMM => "RECV_RDMA_WITH_IMM",
    }
}
