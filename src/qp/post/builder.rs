//! A safe-path send request in the form the extended builders take, so that
//! a single post on an extended QP skips writing a C request and replaying it.

use crate::ffi;
use crate::ledger::wr::{SendOp, SendWr};
use crate::qp::send_ex::Request;

/// `wr` as a builder request (its `wr_id` left 0 for the ring's token), or
/// `None` when it needs what [`Request`] cannot say: inline data, more than
/// one buffer, ATOMIC_WRITE's data or FLUSH's range. Call it before [`SendWr::validate`]
/// only to decide the path: the remote address is computed wrapping, as
/// `fill_ffi` does, and the request is posted only once validated.
#[inline(always)]
pub(crate) fn send_request(wr: &SendWr<'_>) -> Option<Request> {
    if wr.inline_data.is_some() {
        return None;
    }
    // An empty buffer gives a zero-length SGE: posted without one, as
    // `fill_sges` skips it (some hardware reads a zero length as 2 GiB).
    // Read where it lies (`Sges::inline_first`): a slice of the list may
    // point into the request, which would keep it in memory.
    let sge = if wr.bufs.is_one_inline() {
        // SAFETY: checked just above.
        unsafe { wr.bufs.inline_first() }.sge()
    } else if wr.bufs.is_empty() {
        ffi::ibv_sge::default()
    } else {
        return None;
    };
    // The immediate travels big-endian in the operand's low half, as the
    // builders take it (`ibv_wr_send_imm(3)`).
    let imm = wr.imm.map(|i| u64::from(i.to_be()));
    let (opcode, rkey, remote_addr, operand, swap) = match wr.op {
        SendOp::Send => match imm {
            Some(i) => (ffi::IBV_WR_SEND_WITH_IMM, 0, 0, i, 0),
            None => (ffi::IBV_WR_SEND, 0, 0, 0, 0),
        },
        SendOp::Write { remote, offset } => {
            let addr = remote.addr.wrapping_add(offset);
            match imm {
                Some(i) => (ffi::IBV_WR_RDMA_WRITE_WITH_IMM, remote.rkey, addr, i, 0),
                None => (ffi::IBV_WR_RDMA_WRITE, remote.rkey, addr, 0, 0),
            }
        }
        SendOp::Read { remote, offset } => (
            ffi::IBV_WR_RDMA_READ,
            remote.rkey,
            remote.addr.wrapping_add(offset),
            0,
            0,
        ),
        SendOp::CompareSwap {
            remote,
            offset,
            compare,
            swap,
        } => (
            ffi::IBV_WR_ATOMIC_CMP_AND_SWP,
            remote.rkey,
            remote.addr.wrapping_add(offset),
            compare,
            swap,
        ),
        SendOp::FetchAdd {
            remote,
            offset,
            add,
        } => (
            ffi::IBV_WR_ATOMIC_FETCH_AND_ADD,
            remote.rkey,
            remote.addr.wrapping_add(offset),
            add,
            0,
        ),
        // Rare: written as a C request, whose replay builds it
        // (`SendEx::build`), so the builders' hot path has no arm for it.
        SendOp::AtomicWrite { .. } | SendOp::Flush { .. } => return None,
    };
    Some(Request {
        wr_id: 0,
        flags: wr.flags,
        opcode,
        rkey,
        remote_addr,
        operand,
        swap,
        sge,
    })
}
