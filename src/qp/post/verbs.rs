//! The crate's only calls of `ibv_post_send`, `ibv_post_recv` and
//! `ibv_post_srq_recv`: every post, safe, scoped, raw or extended-API fallback,
//! goes through these, so what reaches the verbs is in one place. They keep
//! the verbs' names, so `sys::call::verb!` names a failed post after them.

use crate::ffi;

/// Hands the send chain at `wr` to the NIC (`ibv_post_send`).
///
/// # Safety
/// As `ibv_post_send(3)`: `qp` is a live QP, `wr` heads a well-formed chain
/// whose SGEs point into memory registered in the QP's PD that stays valid
/// until the requests complete, and `bad` is writable.
#[inline(always)]
pub(crate) unsafe fn ibv_post_send(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    // SAFETY: the caller's contract is the verb's.
    unsafe { ffi::ibv_post_send(qp, wr, bad) }
}

/// Hands the receive chain at `wr` to the NIC (`ibv_post_recv`).
///
/// # Safety
/// As `ibv_post_recv(3)`: `qp` is a live QP, `wr` heads a well-formed chain
/// whose SGEs point into memory registered in the QP's PD that stays valid
/// until the requests complete, and `bad` is writable.
#[inline(always)]
pub(crate) unsafe fn ibv_post_recv(
    qp: *mut ffi::ibv_qp,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: the caller's contract is the verb's.
    unsafe { ffi::ibv_post_recv(qp, wr, bad) }
}

/// Hands the receive chain at `wr` to a shared receive queue (`ibv_post_srq_recv`).
///
/// # Safety
/// As `ibv_post_srq_recv(3)`: `srq` is a live SRQ, `wr` heads a well-formed
/// chain whose SGEs point into memory registered in the SRQ's PD that stays
/// valid until the requests complete, and `bad` is writable.
#[inline(always)]
pub(crate) unsafe fn ibv_post_srq_recv(
    srq: *mut ffi::ibv_srq,
    wr: *mut ffi::ibv_recv_wr,
    bad: *mut *mut ffi::ibv_recv_wr,
) -> i32 {
    // SAFETY: the caller's contract is the verb's.
    unsafe { ffi::ibv_post_srq_recv(srq, wr, bad) }
}
