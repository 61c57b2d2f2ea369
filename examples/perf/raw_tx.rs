//! The raw path's sender state: one prepared, chained C list per QP, reused
//! for every post call (like perftest's `ctx->wr`).

use rdma_verbs::ffi;
use rdma_verbs::prelude::*;

use super::{ATOMIC_ADD_VALUE, ATOMIC_CMP_VALUE, ATOMIC_SWAP_VALUE, POLL_BATCH, Shape, SigClock};
use crate::Bufs;
use crate::conn;
use crate::opts::{AtomicOp, Opts, Verb};

/// Raw-path state: one chained C list per QP, reused for every post (like
/// perftest's `ctx->wr`), and the completion array.
pub(super) struct RawTx {
    /// The signaled entries are the same in every post (set at creation).
    pub(super) fixed_flags: bool,
    /// Each QP's prepared list.
    pub(super) lists: Vec<RawList>,
    pub(super) wcs: Box<[ffi::ibv_wc]>,
}

/// One QP's prepared C list, its SGEs and where its local slots start.
pub(super) struct RawList {
    pub(super) wrs: Box<[ffi::ibv_send_wr]>,
    pub(super) sges: Box<[ffi::ibv_sge]>,
    pub(super) local_base: u64,
}

impl RawTx {
    /// One raw post call of the prepared list: only the signaled flags (and,
    /// for small messages, the cycled addresses) change between calls.
    /// Inlined into the round, as the safe sender's post is.
    #[inline(always)]
    pub(super) fn post(
        &mut self,
        shape: Shape,
        qp: &mut Qp<Rc, Rts>,
        qi: usize,
        first: u64,
        remote: RemoteMr,
        clock: &mut SigClock,
    ) -> Result<()> {
        let signaled = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
        let RawList {
            wrs,
            sges,
            local_base,
        } = &mut self.lists[qi];
        if !self.fixed_flags {
            for (j, wr) in wrs.iter_mut().enumerate() {
                if clock.at(first + j as u64) {
                    wr.send_flags |= signaled;
                } else {
                    wr.send_flags &= !signaled;
                }
            }
        }
        if shape.nslots > 1 {
            let off = ((first % shape.nslots as u64) as usize * shape.stride) as u64;
            sges[0].addr = *local_base + off;
            if shape.verb == Verb::Atomic {
                // A multiple of the 64-byte slot stride: 8-byte aligned.
                wrs[0].wr.atomic.remote_addr = remote.addr + off;
            } else {
                wrs[0].wr.rdma.remote_addr = remote.addr + off;
            }
        }
        // SAFETY: the list's SGEs point into `Bufs::local`, registered in this PD
        // with LOCAL_WRITE and kept alive by `main` until after the QPs are
        // destroyed; nothing on this side reads or writes it meanwhile (the NIC
        // may, which is all this test asks of it). Remote addresses lie inside
        // the region the peer registered for this QP. Completions are polled
        // with poll_raw only.
        unsafe { qp.post_send_raw(&mut wrs[0]) }
    }

    pub(super) fn new(
        o: &Opts,
        size: usize,
        remote: &[RemoteMr],
        bufs: &Bufs,
        inline: bool,
    ) -> RawTx {
        let nq = o.num_qps as usize;
        let pl = o.post_list as usize;
        let buff = conn::buff_size(o.max_size());
        let opcode = match (o.test.verb(), o.atomic) {
            (Verb::Write, _) => ffi::IBV_WR_RDMA_WRITE,
            (Verb::Read, _) => ffi::IBV_WR_RDMA_READ,
            (Verb::Send, _) => ffi::IBV_WR_SEND,
            (Verb::Atomic, AtomicOp::FetchAdd) => ffi::IBV_WR_ATOMIC_FETCH_AND_ADD,
            (Verb::Atomic, AtomicOp::CmpSwap) => ffi::IBV_WR_ATOMIC_CMP_AND_SWP,
        };
        let mut flags = 0;
        if inline {
            flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
        }
        // Posts start at multiples of the list length; when the moderation
        // divides it (and, in iterations mode, the last request falls on a
        // moderation boundary, as the options ensure) every post signals the
        // same entries: set them once, as perftest does.
        let cq_mod = u64::from(o.cq_mod);
        let fixed_flags =
            pl as u64 % cq_mod == 0 && (o.duration.is_some() || o.iters % cq_mod == 0);
        let mut lists = Vec::with_capacity(nq);
        for (qi, r) in remote.iter().enumerate().take(nq) {
            let base = bufs.local.addr() + (2 * qi * buff) as u64;
            let mut sge: Box<[ffi::ibv_sge]> = vec![
                ffi::ibv_sge {
                    addr: base,
                    length: size as u32,
                    lkey: bufs.local.lkey(),
                };
                pl
            ]
            .into_boxed_slice();
            let mut list: Box<[ffi::ibv_send_wr]> =
                vec![ffi::ibv_send_wr::default(); pl].into_boxed_slice();
            let list_ptr = list.as_mut_ptr();
            for (j, wr) in list.iter_mut().enumerate() {
                wr.wr_id = qi as u64;
                wr.opcode = opcode;
                wr.send_flags = flags;
                if fixed_flags && (j as u64 % cq_mod == cq_mod - 1) {
                    wr.send_flags |= ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                }
                wr.num_sge = 1;
                wr.sg_list = &mut sge[j];
                // With a post list every request targets the same addresses, as in perftest.
                set_target(wr, o, r);
                wr.next = if j + 1 < pl {
                    // SAFETY: j + 1 < pl: inside the same boxed slice, which never moves.
                    unsafe { list_ptr.add(j + 1) }
                } else {
                    std::ptr::null_mut()
                };
            }
            lists.push(RawList {
                wrs: list,
                sges: sge,
                local_base: base,
            });
        }
        RawTx {
            fixed_flags,
            lists,
            wcs: vec![ffi::ibv_wc::default(); POLL_BATCH].into_boxed_slice(),
        }
    }
}

/// Points `wr` at the remote region `r`: the atomic operands for atomic tests,
/// the RDMA address otherwise.
fn set_target(wr: &mut ffi::ibv_send_wr, o: &Opts, r: &RemoteMr) {
    if o.test.verb() == Verb::Atomic {
        // The region's start is page aligned (8-byte aligned for the NIC).
        wr.wr.atomic = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 {
            remote_addr: r.addr,
            compare_add: match o.atomic {
                AtomicOp::FetchAdd => ATOMIC_ADD_VALUE,
                AtomicOp::CmpSwap => ATOMIC_CMP_VALUE,
            },
            swap: ATOMIC_SWAP_VALUE,
            rkey: r.rkey,
        };
    } else {
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: r.addr,
            rkey: r.rkey,
        };
    }
}
