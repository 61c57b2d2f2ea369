//! What a scope posts ([`ScopedSend`]) and polls ([`ScopedCompletion`]).

use std::marker::PhantomData;

use super::{Dst, SIGNALED, Src};
use crate::cq::{WcOpcode, WcStatus};
use crate::error::{Error, Result};
use crate::ffi;
use crate::mr::RemoteMr;
use crate::qp::send_ex;

/// Why a [`ScopedSend`] will be refused when posted (checked when it is
/// built, so that posting it checks one byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Fault {
    None,
    /// `[offset, offset + len)` is not inside the remote region (the offset
    /// and the region's length are kept in `operand` and `swap`).
    OutOfBounds,
    /// Immediate data on an operation that carries none.
    Imm,
    /// An atomic's result buffer is not 8 bytes.
    AtomicLen,
    /// An atomic's target is not 8-byte aligned.
    AtomicAlign,
}

/// A send-queue request of a scope: SEND, RDMA WRITE, RDMA READ or an
/// atomic on one borrowed buffer. Signaled unless
/// [`signaled(false)`](ScopedSend::signaled) says otherwise. Its remote range
/// is checked when it is built; a bad request is refused when posted.
#[derive(Clone, Copy, Debug)]
pub struct ScopedSend<'scope> {
    pub(super) wr_id: u64,
    pub(super) sge: ffi::ibv_sge,
    /// The remote address (WRITE, READ, atomics).
    remote_addr: u64,
    /// Atomics: the compare (or add) operand. SEND / WRITE with immediate:
    /// the immediate, big-endian, in the low half.
    operand: u64,
    /// Compare-and-swap: the swap operand.
    swap: u64,
    rkey: u32,
    pub(super) opcode: u32,
    pub(super) flags: u32,
    fault: Fault,
    _borrow: PhantomData<&'scope [u8]>,
}

impl<'scope> ScopedSend<'scope> {
    #[inline(always)]
    fn new(wr_id: u64, sge: ffi::ibv_sge, opcode: u32) -> ScopedSend<'scope> {
        ScopedSend {
            wr_id,
            sge,
            remote_addr: 0,
            operand: 0,
            swap: 0,
            rkey: 0,
            opcode,
            flags: SIGNALED,
            fault: Fault::None,
            _borrow: PhantomData,
        }
    }

    /// A request on `remote` at `offset` for `len` bytes.
    #[inline(always)]
    fn remote(
        wr_id: u64,
        sge: ffi::ibv_sge,
        opcode: u32,
        remote: RemoteMr,
        offset: u64,
        len: u64,
    ) -> ScopedSend<'scope> {
        let mut r = ScopedSend::new(wr_id, sge, opcode);
        r.rkey = remote.rkey;
        // As `RemoteMr::checked_addr`: inside the region clipped to the
        // address space (`!addr` is `u64::MAX - addr`), so `addr + offset`
        // does not wrap either.
        match offset.checked_add(len) {
            Some(end) if end <= remote.len.min(!remote.addr) => {
                r.remote_addr = remote.addr.wrapping_add(offset);
            }
            _ => {
                r.fault = Fault::OutOfBounds;
                (r.operand, r.swap) = (offset, remote.len);
            }
        }
        r
    }

    /// An atomic on the 8 bytes of `remote` at `offset`, result in `dst`.
    #[inline(always)]
    fn atomic(
        wr_id: u64,
        dst: Dst<'scope>,
        opcode: u32,
        remote: RemoteMr,
        offset: u64,
        (operand, swap): (u64, u64),
    ) -> ScopedSend<'scope> {
        let mut r = ScopedSend::remote(wr_id, dst.sge, opcode, remote, offset, 8);
        if r.fault == Fault::None {
            (r.operand, r.swap) = (operand, swap);
            if dst.sge.length != 8 {
                r.fault = Fault::AtomicLen;
            } else if r.remote_addr % 8 != 0 {
                r.fault = Fault::AtomicAlign;
            }
        }
        r
    }

    /// SEND of `src` (empty: a zero-length SEND).
    #[inline(always)]
    pub fn send(wr_id: u64, src: Src<'scope>) -> ScopedSend<'scope> {
        ScopedSend::new(wr_id, src.sge, ffi::IBV_WR_SEND)
    }

    /// RDMA WRITE of `src` to `remote` at `offset`.
    #[inline(always)]
    pub fn write(
        wr_id: u64,
        src: Src<'scope>,
        remote: RemoteMr,
        offset: u64,
    ) -> ScopedSend<'scope> {
        let len = u64::from(src.sge.length);
        ScopedSend::remote(wr_id, src.sge, ffi::IBV_WR_RDMA_WRITE, remote, offset, len)
    }

    /// RDMA READ of `dst.len()` bytes from `remote` at `offset` into `dst`.
    #[inline(always)]
    pub fn read(wr_id: u64, dst: Dst<'scope>, remote: RemoteMr, offset: u64) -> ScopedSend<'scope> {
        let len = u64::from(dst.sge.length);
        ScopedSend::remote(wr_id, dst.sge, ffi::IBV_WR_RDMA_READ, remote, offset, len)
    }

    /// Atomic fetch-and-add of `add` on the 8 bytes of `remote` at `offset`
    /// (8-byte aligned); the old value lands in `dst` (8 bytes).
    #[inline(always)]
    pub fn fetch_add(
        wr_id: u64,
        dst: Dst<'scope>,
        remote: RemoteMr,
        offset: u64,
        add: u64,
    ) -> ScopedSend<'scope> {
        let op = ffi::IBV_WR_ATOMIC_FETCH_AND_ADD;
        ScopedSend::atomic(wr_id, dst, op, remote, offset, (add, 0))
    }

    /// Atomic compare-and-swap on the 8 bytes of `remote` at `offset`
    /// (8-byte aligned); the old value lands in `dst` (8 bytes).
    #[inline(always)]
    pub fn compare_swap(
        wr_id: u64,
        dst: Dst<'scope>,
        remote: RemoteMr,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> ScopedSend<'scope> {
        let op = ffi::IBV_WR_ATOMIC_CMP_AND_SWP;
        ScopedSend::atomic(wr_id, dst, op, remote, offset, (compare, swap))
    }

    /// Carries immediate data (SEND and WRITE only; on others the post is
    /// refused).
    #[inline]
    pub fn imm(mut self, imm: u32) -> ScopedSend<'scope> {
        match self.opcode {
            ffi::IBV_WR_SEND => self.opcode = ffi::IBV_WR_SEND_WITH_IMM,
            ffi::IBV_WR_RDMA_WRITE => self.opcode = ffi::IBV_WR_RDMA_WRITE_WITH_IMM,
            _ => self.fault = Fault::Imm,
        }
        if self.fault == Fault::None {
            self.operand = u64::from(imm.to_be());
        }
        self
    }

    /// Whether a successful completion is generated (errors always are).
    /// The QP still signals the request that takes the queue's last free
    /// slot, so the queue can always drain. End a scope's sends with a
    /// signaled request and poll it, or the scope has to flush the QP
    /// (see the [module docs](super)).
    #[inline(always)]
    pub fn signaled(mut self, signaled: bool) -> ScopedSend<'scope> {
        self.flags = (self.flags & !SIGNALED) | if signaled { SIGNALED } else { 0 };
        self
    }

    /// Sets the solicited-event bit (SEND only).
    #[inline]
    pub fn solicited(mut self) -> ScopedSend<'scope> {
        self.flags |= ffi::ibv_send_flags::IBV_SEND_SOLICITED.0;
        self
    }

    /// Waits for earlier READs and atomics before this request starts.
    #[inline]
    pub fn fence(mut self) -> ScopedSend<'scope> {
        self.flags |= ffi::ibv_send_flags::IBV_SEND_FENCE.0;
        self
    }

    /// The `wr_id` its completion will carry.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// True unless posting it will be refused ([`refusal`](Self::refusal)
    /// says why).
    #[inline(always)]
    pub(super) fn plainly_valid(&self) -> bool {
        self.fault == Fault::None
    }

    /// Why the request is refused.
    #[cold]
    #[inline(never)]
    pub(super) fn refusal(&self) -> Error {
        let invalid = |what: &'static str, reason: String| Error::InvalidArgument { what, reason };
        match self.fault {
            Fault::None => invalid("scoped request", "accepted".into()),
            Fault::OutOfBounds => Error::RemoteOutOfBounds {
                offset: self.operand,
                len: match self.opcode {
                    ffi::IBV_WR_ATOMIC_FETCH_AND_ADD | ffi::IBV_WR_ATOMIC_CMP_AND_SWP => 8,
                    _ => u64::from(self.sge.length),
                },
                region_len: self.swap,
            },
            Fault::Imm => invalid(
                "immediate data",
                "only SEND and RDMA WRITE carry immediate data".into(),
            ),
            Fault::AtomicLen => invalid(
                "atomic result buffer",
                format!("must be 8 bytes, not {}", self.sge.length),
            ),
            Fault::AtomicAlign => invalid(
                "atomic target",
                format!("address {:#x} is not 8-byte aligned", self.remote_addr),
            ),
        }
    }

    /// The request as the extended builders take it.
    #[inline(always)]
    pub(super) fn ex_request(&self, token: u64, flags: u32) -> send_ex::Request {
        send_ex::Request {
            wr_id: token,
            flags,
            opcode: self.opcode,
            rkey: self.rkey,
            remote_addr: self.remote_addr,
            operand: self.operand,
            swap: self.swap,
            sge: self.sge,
        }
    }

    /// Writes the C request (all but `next`; `sg_list` points at `sge`).
    /// Fields this operation does not use keep whatever they held: the
    /// provider reads only the ones its opcode names.
    #[inline(always)]
    pub(super) fn fill(
        &self,
        wr: &mut ffi::ibv_send_wr,
        token: u64,
        flags: u32,
        sge: *mut ffi::ibv_sge,
    ) {
        wr.wr_id = token;
        wr.sg_list = sge;
        wr.num_sge = i32::from(self.sge.length != 0);
        wr.opcode = self.opcode;
        wr.send_flags = flags;
        let rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: self.remote_addr,
            rkey: self.rkey,
        };
        match self.opcode {
            ffi::IBV_WR_SEND => {}
            ffi::IBV_WR_SEND_WITH_IMM => wr.__bindgen_anon_1.imm_data = self.operand as u32,
            ffi::IBV_WR_RDMA_WRITE | ffi::IBV_WR_RDMA_READ => wr.wr.rdma = rdma,
            ffi::IBV_WR_RDMA_WRITE_WITH_IMM => {
                wr.wr.rdma = rdma;
                wr.__bindgen_anon_1.imm_data = self.operand as u32;
            }
            _ => {
                wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
                    remote_addr: self.remote_addr,
                    compare_add: self.operand,
                    swap: self.swap,
                    rkey: self.rkey,
                };
            }
        }
    }
}

/// A completion of a scoped request: what the application needs, without
/// buffers (the scope's requests borrowed theirs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScopedCompletion {
    /// The request's `wr_id`.
    pub wr_id: u64,
    /// Status; anything but `Success` means the operation did not happen.
    pub status: WcStatus,
    /// What completed (what was posted, also for failed completions).
    pub opcode: WcOpcode,
    /// Bytes received (successful receives), read (READ) or 8 (atomics);
    /// else 0.
    pub byte_len: u32,
    /// Immediate data in host order, when a successful receive carried one.
    pub imm_data: Option<u32>,
    /// The local QP number.
    pub qp_num: u32,
    /// Vendor error syndrome of a failed completion; 0 on success.
    pub vendor_err: u32,
}

impl ScopedCompletion {
    /// `Ok` on success, else [`Error::WorkCompletion`] naming the status.
    #[inline]
    pub fn result(&self) -> Result<()> {
        self.status.result(self.wr_id, self.vendor_err)
    }
}
