//! Work requests for the safe path.

use crate::error::{Error, Result};
use crate::ffi;
use crate::ledger::read_copy;
use crate::ledger::sges::{Buffer, Sges};
use crate::mr::{Mr, RemoteMr};
use crate::pd::Pd;

mod ext;
mod post_error;
mod recv;
pub(crate) use ext::ExtOps;
pub use ext::FlushPlacement;
pub use post_error::PostError;
pub use recv::RecvWr;

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendOp {
    Send,
    Write {
        remote: RemoteMr,
        offset: u64,
    },
    Read {
        remote: RemoteMr,
        offset: u64,
    },
    CompareSwap {
        remote: RemoteMr,
        offset: u64,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteMr,
        offset: u64,
        add: u64,
    },
    AtomicWrite {
        remote: RemoteMr,
        offset: u64,
        value: u64,
    },
    Flush {
        remote: RemoteMr,
        offset: u64,
        len: u64,
        /// `ibv_placement_type`: `ffi::IBV_FLUSH_GLOBAL` or `ffi::IBV_FLUSH_PERSISTENT`.
        placement: u8,
        /// `ibv_selectivity_level`: `ffi::IBV_FLUSH_RANGE` or `ffi::IBV_FLUSH_MR`.
        level: u8,
    },
}

/// A send-queue work request: SEND, RDMA WRITE/READ or an atomic, built with
/// the constructors and builder methods below and posted with
/// [`Qp::post_send`](crate::qp::Qp::post_send).
///
/// Buffers are moved in and come back with the completion. READ and atomic
/// destinations must be exclusively owned [`Mr`]s (the NIC writes them);
/// SEND/WRITE sources may also be [`SharedMr`](crate::mr::SharedMr)s.
///
/// In a tight loop, build the request inside the `post_send` call, and post
/// each kind of request from its own call (a `match` that posts in every arm,
/// not one `post_send` of the `match`'s result): a request is 144 bytes, each
/// move is a copy, and where its kind is known at the post its checks compile
/// to less (docs/performance.md, "What the safe path costs").
#[derive(Debug)]
pub struct SendWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) bufs: Sges,
    pub(crate) imm: Option<u32>,
    pub(crate) inline_data: Option<&'a [u8]>,
    pub(crate) flags: u32,
}

impl<'a> SendWr<'a> {
    #[inline(always)]
    fn new(wr_id: u64, op: SendOp) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            bufs: Sges::default(),
            imm: None,
            inline_data: None,
            flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
        }
    }

    /// A SEND; add the payload with [`SendWr::sge`] (none: a zero-byte message).
    #[inline(always)]
    pub fn send(wr_id: u64) -> SendWr<'a> {
        SendWr::new(wr_id, SendOp::Send)
    }

    /// A SEND of the whole of `src`: `SendWr::send(wr_id).sge(src)` in one
    /// step (built in place, which matters in tight loops).
    #[inline(always)]
    pub fn send_from(wr_id: u64, src: impl Into<Buffer>) -> SendWr<'a> {
        SendWr::with_buffer(wr_id, SendOp::Send, src.into())
    }

    #[inline(always)]
    fn with_buffer(wr_id: u64, op: SendOp, buf: Buffer) -> SendWr<'a> {
        SendWr {
            wr_id,
            op,
            bufs: Sges::one(buf),
            imm: None,
            inline_data: None,
            flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
        }
    }

    /// A SEND whose payload the NIC copies from `data` at post time
    /// (IBV_SEND_INLINE): no buffer is held, `data` is free again when
    /// `post_send` returns. `data` may not exceed the QP's `max_inline_data`.
    #[inline(always)]
    pub fn send_inline(wr_id: u64, data: &'a [u8]) -> SendWr<'a> {
        let mut wr = SendWr::new(wr_id, SendOp::Send);
        wr.inline_data = Some(data);
        wr.flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        wr
    }

    /// An RDMA WRITE of the SGEs to `remote` at `offset` (bounds checked when
    /// posted). With no SGE it writes zero bytes: with [`imm`](SendWr::imm), a
    /// WRITE_WITH_IMM that only consumes a receive at the peer, as a
    /// notification.
    #[inline(always)]
    pub fn write(wr_id: u64, remote: RemoteMr, offset: u64) -> SendWr<'a> {
        SendWr::new(wr_id, SendOp::Write { remote, offset })
    }

    /// An RDMA WRITE of the whole of `src` to `remote` at `offset`:
    /// `SendWr::write(wr_id, remote, offset).sge(src)` in one step.
    #[inline(always)]
    pub fn write_from(
        wr_id: u64,
        src: impl Into<Buffer>,
        remote: RemoteMr,
        offset: u64,
    ) -> SendWr<'a> {
        SendWr::with_buffer(wr_id, SendOp::Write { remote, offset }, src.into())
    }

    /// An RDMA WRITE whose payload is copied from `data` at post time (inline).
    #[inline(always)]
    pub fn write_inline(wr_id: u64, data: &'a [u8], remote: RemoteMr, offset: u64) -> SendWr<'a> {
        let mut wr = SendWr::write(wr_id, remote, offset);
        wr.inline_data = Some(data);
        wr.flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        wr
    }

    /// An RDMA READ of `dest`'s length from `remote` at `offset` into `dest`:
    /// an [`Mr`] with LOCAL_WRITE, or a part of one ([`Mr::range`]) to read
    /// fewer bytes than the `Mr` holds (the completion gives the whole `Mr`
    /// back, as for a send from a range).
    #[inline(always)]
    pub fn read(wr_id: u64, dest: impl Into<Buffer>, remote: RemoteMr, offset: u64) -> SendWr<'a> {
        SendWr::with_buffer(wr_id, SendOp::Read { remote, offset }, dest.into())
    }

    /// Atomic compare-and-swap on the 8 bytes at `remote + offset`; the old
    /// value lands in `result` (an 8-byte `Mr` with LOCAL_WRITE).
    ///
    /// Byte order: `compare` and `swap` are host-order numbers. The target
    /// and the returned value are in the order the device uses for atomics:
    /// host order on soft-RoCE (`u64::from_ne_bytes` reads them); some NICs
    /// reply big-endian (rdma-core's "atomic HCA reply BE" capability), so
    /// check yours before sharing a counter with another program.
    #[inline]
    pub fn compare_swap(
        wr_id: u64,
        result: Mr,
        remote: RemoteMr,
        offset: u64,
        compare: u64,
        swap: u64,
    ) -> SendWr<'a> {
        let op = SendOp::CompareSwap {
            remote,
            offset,
            compare,
            swap,
        };
        SendWr::with_buffer(wr_id, op, Buffer::Owned(result))
    }

    /// Atomic fetch-and-add on the 8 bytes at `remote + offset`; the old value
    /// lands in `result` (an 8-byte `Mr` with LOCAL_WRITE). Byte order: as
    /// [`compare_swap`](SendWr::compare_swap).
    #[inline]
    pub fn fetch_add(
        wr_id: u64,
        result: Mr,
        remote: RemoteMr,
        offset: u64,
        add: u64,
    ) -> SendWr<'a> {
        let op = SendOp::FetchAdd {
            remote,
            offset,
            add,
        };
        SendWr::with_buffer(wr_id, op, Buffer::Owned(result))
    }

    /// ATOMIC_WRITE: writes the 8 bytes of `value` (host order, as
    /// [`compare_swap`](SendWr::compare_swap)'s operands) at `remote + offset`
    /// as one unit that the responder makes visible only whole (the IBTA's
    /// Memory Placement Extensions). The request carries its data, so it
    /// takes no buffer; the target must be 8-byte aligned and the peer's MR
    /// remotely writable.
    ///
    /// Only on a QP with the extended send API
    /// ([`Qp::send_api`](crate::qp::Qp::send_api)) on a device that executes
    /// it ([`DeviceAttr::atomic_write`](crate::context::DeviceAttr::atomic_write):
    /// rxe from Linux 6.2): elsewhere posting it fails with
    /// [`Error::Unsupported`] and nothing is posted.
    #[inline]
    pub fn atomic_write(wr_id: u64, remote: RemoteMr, offset: u64, value: u64) -> SendWr<'a> {
        SendWr::new(
            wr_id,
            SendOp::AtomicWrite {
                remote,
                offset,
                value,
            },
        )
    }

    /// FLUSH: makes the data earlier RDMA WRITEs of this QP placed in `len` bytes of `remote`
    /// at `offset` reach `placement` before the request completes
    /// (`ibv_wr_flush(qp, rkey, addr, len, type, IBV_FLUSH_RANGE)`, the IBTA's Memory
    /// Placement Extensions). It carries no data and takes no buffer; the peer's MR needs
    /// the placement's access flag ([`AccessFlags::FLUSH_GLOBAL`](crate::mr::AccessFlags::FLUSH_GLOBAL)),
    /// else the completion is `REM_ACCESS_ERR`. Completes with
    /// [`WcOpcode::Flush`](crate::cq::WcOpcode::Flush).
    ///
    /// Only on a QP with the extended send API ([`Qp::send_api`](crate::qp::Qp::send_api))
    /// of a libibverbs from rdma-core 45 on, on a device that reports the placement
    /// ([`DeviceAttr::flush_global`](crate::context::DeviceAttr::flush_global): rxe from
    /// Linux 6.2): elsewhere posting it fails with [`Error::Unsupported`] naming which is
    /// missing, and nothing is posted.
    #[inline]
    pub fn flush(
        wr_id: u64,
        remote: RemoteMr,
        offset: u64,
        len: u64,
        placement: FlushPlacement,
    ) -> SendWr<'a> {
        SendWr::new(
            wr_id,
            SendOp::Flush {
                remote,
                offset,
                len,
                placement: placement.bit(),
                level: ffi::IBV_FLUSH_RANGE,
            },
        )
    }

    /// FLUSH of the whole of the peer's MR that `remote` lies in (`IBV_FLUSH_MR`): as
    /// [`flush`](SendWr::flush), without a range.
    #[inline]
    pub fn flush_mr(wr_id: u64, remote: RemoteMr, placement: FlushPlacement) -> SendWr<'a> {
        SendWr::new(
            wr_id,
            SendOp::Flush {
                remote,
                offset: 0,
                len: remote.len,
                placement: placement.bit(),
                level: ffi::IBV_FLUSH_MR,
            },
        )
    }

    /// Appends a scatter/gather entry covering the whole buffer. Past
    /// [`MAX_SAFE_SGES`](crate::qp::MAX_SAFE_SGES) entries the buffer is dropped
    /// and posting fails with [`Error::TooManySges`].
    #[inline(always)]
    pub fn sge(mut self, buf: impl Into<Buffer>) -> SendWr<'a> {
        self.bufs.push(buf.into());
        self
    }

    /// Attaches immediate data (SEND_WITH_IMM / RDMA_WRITE_WITH_IMM).
    #[inline(always)]
    pub fn imm(mut self, imm: u32) -> SendWr<'a> {
        self.imm = Some(imm);
        self
    }

    /// Asks for no completion unless one is needed. The QP still signals when
    /// its send ring would otherwise fill up, so the ring can never wedge;
    /// buffers of unsignaled requests are released when a later completion
    /// retires them.
    #[inline(always)]
    pub fn unsignaled(mut self) -> SendWr<'a> {
        self.flags &= !ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self
    }

    /// Asks for a completion (`true`, the default) or not (`false`, as
    /// [`SendWr::unsignaled`]); for loops that signal every Nth request.
    #[inline(always)]
    pub fn signaled(mut self, signaled: bool) -> SendWr<'a> {
        let bit = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        self.flags = (self.flags & !bit) | if signaled { bit } else { 0 };
        self
    }

    /// Sets the solicited-event bit (wakes a peer waiting with solicited_only).
    #[inline(always)]
    pub fn solicited(mut self) -> SendWr<'a> {
        self.flags |= ffi::ibv_send_flags::IBV_SEND_SOLICITED.0;
        self
    }

    /// Waits for earlier RDMA READs/atomics to finish before this one starts.
    #[inline(always)]
    pub fn fence(mut self) -> SendWr<'a> {
        self.flags |= ffi::ibv_send_flags::IBV_SEND_FENCE.0;
        self
    }

    /// The application's id.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// Gives back the buffers of a request that was not posted.
    pub fn into_buffers(self) -> Sges {
        self.bufs
    }

    /// Checks everything that can be checked before the NIC sees the request.
    #[inline(always)]
    pub(crate) fn validate(
        &self,
        max_sge: u32,
        max_inline: u32,
        pd: &Pd,
        ext: impl FnOnce() -> ExtOps,
    ) -> Result<()> {
        if self.plainly_valid(max_sge, max_inline, pd) {
            Ok(())
        } else {
            read_copy(self).validate_fully(max_sge, max_inline, pd, ext())
        }
    }

    /// A quick pass on the post path: true only if
    /// [`validate_fully`](Self::validate_fully) would pass; false sends the
    /// request to it for the error that names the problem.
    #[inline(always)]
    fn plainly_valid(&self, max_sge: u32, max_inline: u32, pd: &Pd) -> bool {
        if self.bufs.overflow() != 0 {
            return false;
        }
        // One inline buffer is the common case: read where it lies, no loop.
        let mut len = if self.bufs.is_one_inline() {
            // SAFETY: checked just above.
            let b = unsafe { self.bufs.inline_first() };
            let l = b.len() as u64;
            // An atomic's exact length makes the SGE's bound redundant; the
            // request's kind is known where it is built, so this folds.
            let len_fits = match self.op {
                SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => l == 8,
                _ => l <= u64::from(u32::MAX),
            };
            // No `max_sge` test: every QP takes one send SGE (refused at
            // creation otherwise, `Qp::build`).
            if !len_fits || !b.in_pd(pd) {
                return false;
            }
            l
        } else if self.bufs.is_empty() {
            0
        } else {
            // On a copy: the list's slice may point into the request.
            match read_copy(&self.bufs).plain_len(max_sge, pd) {
                Some(l) => l,
                None => return false,
            }
        };
        if let Some(data) = self.inline_data {
            if !self.bufs.is_empty() || data.len() > max_inline as usize {
                return false;
            }
            len = data.len() as u64;
        }
        // As `RemoteMr::checked_addr`: inside the region clipped to the
        // address space.
        let fits = |remote: RemoteMr, offset: u64| {
            offset
                .checked_add(len)
                .is_some_and(|end| end <= remote.len.min(!remote.addr))
        };
        match self.op {
            SendOp::Send => true,
            SendOp::Write { remote, offset } => fits(remote, offset),
            SendOp::Read { remote, offset } => {
                self.imm.is_none()
                    && self.inline_data.is_none()
                    && self.bufs_locally_writable()
                    && fits(remote, offset)
            }
            SendOp::CompareSwap { remote, offset, .. }
            | SendOp::FetchAdd { remote, offset, .. } => {
                // One owned 8-byte result, an aligned 8-byte target in range.
                len == 8
                    && self.bufs.len() == 1
                    && self.imm.is_none()
                    && self.inline_data.is_none()
                    && self.bufs_locally_writable()
                    && fits(remote, offset)
                    && remote.addr.wrapping_add(offset) % 8 == 0
            }
            // Only the full check knows whether the QP takes them (and
            // refuses a buffer added to an ATOMIC_WRITE with `sge`).
            SendOp::AtomicWrite { .. } | SendOp::Flush { .. } => false,
        }
    }

    /// [`Sges::all_locally_writable`] for the quick pass, without a pointer
    /// that may point into the request (see [`Sges::inline_first`]).
    #[inline(always)]
    fn bufs_locally_writable(&self) -> bool {
        if self.bufs.is_one_inline() {
            // SAFETY: checked just above.
            unsafe { self.bufs.inline_first() }.locally_writable()
        } else {
            read_copy(&self.bufs).all_locally_writable()
        }
    }

    /// Every check, with the error that names what is wrong.
    #[cold]
    #[inline(never)]
    fn validate_fully(&self, max_sge: u32, max_inline: u32, pd: &Pd, ext: ExtOps) -> Result<()> {
        let n = self.bufs.len() + self.bufs.overflow();
        let max = (max_sge as usize).min(crate::ledger::sges::MAX_SAFE_SGES);
        if n > max {
            return Err(Error::TooManySges { requested: n, max });
        }
        self.bufs.check_lengths()?;
        self.bufs.check_pd(pd)?;
        if let Some(data) = self.inline_data {
            if !self.bufs.is_empty() {
                return Err(invalid(
                    "inline work request",
                    "carries inline data, so it takes no buffers",
                ));
            }
            if data.len() > max_inline as usize {
                return Err(invalid(
                    "inline data",
                    &format!(
                        "{} bytes exceed the QP's max_inline_data of {max_inline}",
                        data.len()
                    ),
                ));
            }
        }
        let len = self.payload_len();
        match self.op {
            SendOp::Send => {}
            SendOp::Write { remote, offset } => {
                remote.checked_addr(offset, len)?;
            }
            SendOp::Read { remote, offset } => {
                remote.checked_addr(offset, len)?;
                self.check_writable_dest("RDMA READ")?;
            }
            SendOp::CompareSwap { remote, offset, .. }
            | SendOp::FetchAdd { remote, offset, .. } => {
                let addr = remote.checked_addr(offset, 8)?;
                if addr % 8 != 0 {
                    return Err(invalid(
                        "atomic target",
                        &format!("address {addr:#x} is not 8-byte aligned"),
                    ));
                }
                if len != 8 || self.bufs.len() != 1 {
                    return Err(invalid("atomic result buffer", "must be one 8-byte Mr"));
                }
                self.check_writable_dest("atomic")?;
            }
            SendOp::AtomicWrite { remote, offset, .. } => {
                self.check_atomic_write(remote, offset, ext.atomic_write)?;
            }
            SendOp::Flush {
                remote,
                offset,
                len,
                placement,
                level,
            } => {
                self.check_flush(pd, (remote, offset, len), placement, level, ext.flush)?;
            }
        }
        if self.imm.is_some() && !matches!(self.op, SendOp::Send | SendOp::Write { .. }) {
            return Err(invalid(
                "immediate data",
                "only SEND and RDMA WRITE carry immediate data",
            ));
        }
        Ok(())
    }

    #[inline]
    fn check_writable_dest(&self, what: &str) -> Result<()> {
        if self.inline_data.is_some() || !self.bufs.all_owned() {
            return Err(invalid(
                "destination buffer",
                &format!(
                    "{what} writes its destination: pass owned Mrs, not SharedMr or inline data"
                ),
            ));
        }
        if !self.bufs.all_locally_writable() {
            return Err(invalid(
                "destination buffer",
                &format!(
                    "{what} writes its destination, so its Mr needs AccessFlags::LOCAL_WRITE \
                     (the NIC would fail it with LOC_PROT_ERR)"
                ),
            ));
        }
        Ok(())
    }

    #[inline]
    pub(crate) fn payload_len(&self) -> u64 {
        match self.inline_data {
            Some(d) => d.len() as u64,
            None => self.bufs.total_len(),
        }
    }

    /// Fills the C work request (sg_list and next are set by the caller). Call
    /// after [`validate`](Self::validate), which checked that the remote
    /// address arithmetic does not overflow.
    #[inline]
    pub(crate) fn fill_ffi(&self, wr: &mut ffi::ibv_send_wr) {
        use SendOp::*;
        wr.send_flags = self.flags;
        // Matched in place (a tuple of `op` and `imm` would copy `op`).
        let imm = self.imm.is_some();
        let (opcode, rdma) = match &self.op {
            Send if imm => (ffi::IBV_WR_SEND_WITH_IMM, None),
            Send => (ffi::IBV_WR_SEND, None),
            Write { remote, offset } if imm => {
                (ffi::IBV_WR_RDMA_WRITE_WITH_IMM, Some((remote, *offset)))
            }
            Write { remote, offset } => (ffi::IBV_WR_RDMA_WRITE, Some((remote, *offset))),
            Read { remote, offset } => (ffi::IBV_WR_RDMA_READ, Some((remote, *offset))),
            CompareSwap {
                remote,
                offset,
                compare,
                swap,
            } => {
                wr.wr.atomic = atomic_fields(remote, *offset, *compare, *swap);
                (ffi::IBV_WR_ATOMIC_CMP_AND_SWP, None)
            }
            FetchAdd {
                remote,
                offset,
                add,
            } => {
                wr.wr.atomic = atomic_fields(remote, *offset, *add, 0);
                (ffi::IBV_WR_ATOMIC_FETCH_AND_ADD, None)
            }
            Flush {
                remote,
                offset,
                len,
                placement,
                level,
            } => {
                // The builders' replay (`SendEx::build`) passes these to `ibv_wr_flush`.
                wr.wr.atomic = atomic_fields(
                    remote,
                    *offset,
                    *len,
                    u64::from(*placement) | u64::from(*level) << 8,
                );
                (ffi::IBV_WR_FLUSH, None)
            }
            AtomicWrite {
                remote,
                offset,
                value,
            } => {
                // The builders' replay (`SendEx::build`) passes the address of
                // `compare_add` to `ibv_wr_atomic_write`.
                wr.wr.atomic = atomic_fields(remote, *offset, *value, 0);
                (ffi::IBV_WR_ATOMIC_WRITE, None)
            }
        };
        wr.opcode = opcode;
        if let Some((remote, offset)) = rdma {
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: remote.addr.wrapping_add(offset),
                rkey: remote.rkey,
            };
        }
        if let Some(imm) = self.imm {
            wr.__bindgen_anon_1.imm_data = imm.to_be();
        }
    }
}

/// The atomic-shaped part of a C work request (atomics, ATOMIC_WRITE, FLUSH):
/// the target at `remote` + `offset` and the two 64-bit operands.
#[inline(always)]
fn atomic_fields(
    remote: &RemoteMr,
    offset: u64,
    compare_add: u64,
    swap: u64,
) -> ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
    ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
        remote_addr: remote.addr.wrapping_add(offset),
        compare_add,
        swap,
        rkey: remote.rkey,
    }
}

fn invalid(what: &'static str, reason: &str) -> Error {
    Error::InvalidArgument {
        what,
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request is written once per post (its fields, into the caller's
    /// `Option` or argument) and its list moved into a slot and out again:
    /// one inline buffer keeps both small.
    #[test]
    fn a_send_request_takes_at_most_144_bytes() {
        assert_eq!(size_of::<Buffer>(), 32);
        assert_eq!(size_of::<Sges>(), 48);
        assert!(
            size_of::<SendWr<'_>>() <= 144,
            "{}",
            size_of::<SendWr<'_>>()
        );
        assert_eq!(size_of::<Option<SendWr<'_>>>(), size_of::<SendWr<'_>>());
    }

    #[test]
    fn an_empty_list_pops_nothing_and_iterates_nothing() {
        let mut s = Sges::default();
        assert!(s.is_empty());
        assert!(s.pop().is_none());
        assert_eq!(s.as_slice().len(), 0);
        assert_eq!(s.into_iter().count(), 0);
    }
}
