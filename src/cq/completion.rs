//! What a poll returns: one completion, with the buffers of its safe-path request.

use std::fmt;

use crate::error::Result;
use crate::ffi;
use crate::ledger::sges::Sges;
use crate::values::{WcOpcode, WcStatus};

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
    /// The `wr_id` the application gave the work request. For
    /// [`Foreign`](CompletionSource::Foreign) and
    /// [`Stale`](CompletionSource::Stale) completions it is the raw value the
    /// provider reported (for a stale one, the library's internal token),
    /// which names no request of yours.
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
    /// The rkey a successful receive of a SEND with invalidate invalidated
    /// (`IBV_WC_WITH_INV`): that memory window grants nothing any more
    /// (see [`crate::mw`]).
    pub invalidated_rkey: Option<u32>,
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
    pub(super) bufs: Sges,
}

/// `wr_id`s of the safe path are tokens: ring tag in the high half (its top
/// bit, bit 63 of the token, always set).
pub(super) const TOKEN_SHIFT: u32 = 32;

impl Completion {
    /// `Ok` on success, else [`Error::WorkCompletion`](crate::Error::WorkCompletion) naming the status.
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
    /// atomic destination, or an `Mr` that was the source of a SEND/WRITE
    /// (the whole `Mr` when the request carried a range of it, [`Mr::range`](crate::mr::Mr::range)).
    #[inline]
    pub fn take_mr(&mut self) -> Option<crate::mr::Mr> {
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
    pub(super) unsafe fn write_from_wc(
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
            let mut invalidated_rkey = None;
            let mut path = 0;
            let status = if success {
                wc_flags = (*wc).wc_flags;
                if opcode & ffi::IBV_WC_RECV != 0 {
                    byte_len = (*wc).byte_len;
                    src_qp = (*wc).src_qp;
                    path = u32::from((*wc).slid)
                        | u32::from((*wc).sl) << 16
                        | u32::from((*wc).dlid_path_bits) << 24;
                    // The union member read is the one the flag names valid.
                    if wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0 {
                        imm_data = Some(u32::from_be((*wc).__bindgen_anon_1.imm_data));
                    } else if wc_flags & ffi::ibv_wc_flags::IBV_WC_WITH_INV.0 != 0 {
                        invalidated_rkey = Some((*wc).__bindgen_anon_1.invalidated_rkey);
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
            (&raw mut (*dst).invalidated_rkey).write(invalidated_rkey);
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
            .field("invalidated_rkey", &self.invalidated_rkey)
            .field("qp_num", &self.qp_num)
            .field("source", &self.source)
            .field("buffers", &self.bufs.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

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
    fn a_receive_with_invalidate_reports_the_rkey_not_immediate_data() {
        let mut wc = poisoned_wc(ffi::IBV_WC_SUCCESS, ffi::IBV_WC_RECV, 8);
        let p = wc.as_mut_ptr();
        // SAFETY: writes into the local's own storage through raw pointers.
        unsafe {
            (&raw mut (*p).wc_flags).write(ffi::ibv_wc_flags::IBV_WC_WITH_INV.0);
            (&raw mut (*p).__bindgen_anon_1.invalidated_rkey).write(0x1234_5678);
        }
        let c = complete(&wc, Some((6, ffi::IBV_WC_RECV)), true);
        assert_eq!((c.invalidated_rkey, c.imm_data), (Some(0x1234_5678), None));
        let wc = poisoned_wc(ffi::IBV_WC_SUCCESS, ffi::IBV_WC_RECV, 8);
        assert_eq!(
            complete(&wc, Some((6, ffi::IBV_WC_RECV)), true).invalidated_rkey,
            None
        );
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
