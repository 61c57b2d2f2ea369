//! The safe path's sender state: shared sources per (QP, slot), owned READ
//! and atomic destinations, and one post call of `-l` requests.

use rdma_verbs::prelude::*;

use super::{
    ATOMIC_ADD_VALUE, ATOMIC_CMP_VALUE, ATOMIC_SWAP_VALUE, POLL_BATCH, QP_SHIFT, SAFE_POOL_CAP,
    Shape, SigClock, split_pool,
};
use crate::conn::{self, Device};
use crate::opts::{AtomicOp, Opts, Verb};

/// Safe-path state: shared sources per (QP, slot), READ/atomic destinations,
/// inline bytes, and the completion array.
pub(super) struct SafeTx {
    pub(super) src: Vec<Vec<SharedMr>>,
    pub(super) pool: Vec<Mr>,
    pub(super) inline: Option<Vec<u8>>,
    pub(super) out: Vec<Completion>,
}

impl SafeTx {
    /// One safe post call: one request (`LIST` false) or `-l` requests;
    /// sources are shared slices (an `Arc` clone each), READ and atomic
    /// destinations owned pieces from the pool.
    /// Inlined into the round as the raw sender's post is: called, it sets up
    /// a frame the size of a list post's chunk for every post.
    #[inline(always)]
    pub(super) fn post<const LIST: bool>(
        &mut self,
        shape: &Shape,
        qp: &mut Qp<Rc, Rts>,
        qi: usize,
        first: u64,
        remote: RemoteMr,
        clock: &mut SigClock,
    ) -> Result<()> {
        let SafeTx {
            src, pool, inline, ..
        } = self;
        // No sources for READ/atomics (their buffers are destinations from `pool`).
        let src = src.get(qi).map_or(&[][..], Vec::as_slice);
        let inline = inline.as_deref();
        // Each sequence number's wr_id, source slot, remote offset and signal.
        macro_rules! at {
            ($k:expr) => {{
                let k: u64 = $k;
                // As the raw path: no division when every request uses one slot.
                let slot = if shape.nslots > 1 {
                    (k % shape.nslots as u64) as usize
                } else {
                    0
                };
                (
                    ((qi as u64) << QP_SHIFT) | k,
                    slot,
                    (slot * shape.stride) as u64,
                    clock.at(k),
                )
            }};
        }
        // One post call per verb, as a loop that posts one verb writes it: the
        // request's kind is known where it is posted, so the crate's matches
        // on it fold away. Built where consumed: a closure returning a
        // 144-byte SendWr would copy it on the way out.
        macro_rules! post {
            (|$id:ident, $slot:ident, $off:ident, $sig:ident| $wr:expr) => {
                if !LIST {
                    let ($id, $slot, $off, $sig) = at!(first);
                    qp.post_send($wr)
                } else {
                    qp.post_send_list((0..shape.post_list).map(|j| {
                        let ($id, $slot, $off, $sig) = at!(first + j);
                        $wr
                    }))
                }
            };
        }
        // `.signaled` in every arm: on the match's value it would copy it.
        match (shape.verb, inline) {
            (Verb::Write, Some(data)) => post!(|id, _slot, off, sig| {
                SendWr::write_inline(id, data, remote, off).signaled(sig)
            }),
            (Verb::Write, None) => post!(|id, slot, off, sig| {
                SendWr::write_from(id, src[slot].clone(), remote, off).signaled(sig)
            }),
            (Verb::Send, Some(data)) => {
                post!(|id, _slot, _off, sig| SendWr::send_inline(id, data).signaled(sig))
            }
            (Verb::Send, None) => post!(|id, slot, _off, sig| {
                SendWr::send_from(id, src[slot].clone()).signaled(sig)
            }),
            (Verb::Read, _) => post!(|id, _slot, off, sig| {
                let dest = pool.pop().expect("READ destination pool sized for the run");
                SendWr::read(id, dest, remote, off).signaled(sig)
            }),
            // `off` is a multiple of the 64-byte slot stride: 8-byte aligned.
            (Verb::Atomic, _) => {
                let mut dest = || pool.pop().expect("atomic result pool sized for the run");
                match shape.atomic {
                    AtomicOp::FetchAdd => post!(|id, _slot, off, sig| {
                        SendWr::fetch_add(id, dest(), remote, off, ATOMIC_ADD_VALUE).signaled(sig)
                    }),
                    AtomicOp::CmpSwap => post!(|id, _slot, off, sig| {
                        SendWr::compare_swap(
                            id,
                            dest(),
                            remote,
                            off,
                            ATOMIC_CMP_VALUE,
                            ATOMIC_SWAP_VALUE,
                        )
                        .signaled(sig)
                    }),
                }
            }
        }
        .map_err(Error::from)
    }

    pub(super) fn new(
        o: &Opts,
        dev: &Device,
        size: usize,
        nslots: usize,
        stride: usize,
        inline: bool,
    ) -> Result<SafeTx> {
        let nq = o.num_qps as usize;
        let verb = o.test.verb();
        let mut src = Vec::with_capacity(nq);
        let mut pool = Vec::new();
        if verb.writes_local() {
            // Every READ's destination / atomic's result buffer comes back
            // (unsignaled ones through poll_recycling), and at most
            // tx_depth are in flight per QP.
            let count = o.tx_depth as usize * nq;
            if count.saturating_mul(size) > SAFE_POOL_CAP {
                return Err(Error::InvalidArgument {
                    what: o.test.name(),
                    reason: format!(
                        "needs {count} destination buffers of {size} bytes ({} MiB); \
                         lower -t or use --raw",
                        (count * size) >> 20
                    ),
                });
            }
            pool = split_pool(dev, size, count)?;
        } else if !inline {
            let buff = conn::buff_size(size);
            let region = dev
                .pd
                .alloc_mr(buff * nq, AccessFlags::LOCAL_WRITE)?
                .freeze();
            for qi in 0..nq {
                let mut slots = Vec::with_capacity(nslots);
                for s in 0..nslots {
                    slots.push(region.slice(qi * buff + s * stride, size)?);
                }
                src.push(slots);
            }
        }
        Ok(SafeTx {
            src,
            pool,
            inline: inline.then(|| vec![0xa5u8; size]),
            out: Vec::with_capacity(POLL_BATCH),
        })
    }
}
