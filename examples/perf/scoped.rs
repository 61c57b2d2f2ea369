//! `--scoped`: the sender's and the receiver's loops inside `Cq::scope`. The
//! requests borrow the same buffers the ownership-passing path moves (shared
//! source slices, READ and atomic destinations; receives cycle over slots of
//! one region like the raw path's), wr_ids and signaling are the same, and
//! the completions are the scope's light ones.

use rdma_verbs::prelude::*;
use rdma_verbs::qp::scope::{PreparedSends, Scope, ScopedCompletion, ScopedQp, ScopedSend};

use super::{ATOMIC_ADD_VALUE, ATOMIC_CMP_VALUE, ATOMIC_SWAP_VALUE, POLL_BATCH, QP_SHIFT};
use super::{Counts, PathState, SEQ_MASK, Shape, Stall, Tx};
use crate::clock::{Phase, Rate, Timer};
use crate::conn::{self, Ctrl, Device, Queues};
use crate::opts::{AtomicOp, Opts, Verb};
use crate::report::{BwRow, WireRow};

/// What the ownership-passing loop returns if it is handed a scoped sender.
pub fn not_here() -> Error {
    Error::Other("a scoped sender reached the ownership-passing loop".into())
}

/// Runs one size on the scoped path; returns the sender's row.
pub fn run_size(o: &Opts, rate: &Rate, q: &mut Queues, tx: &mut Tx, ctrl: &Ctrl) -> Result<BwRow> {
    let mut timer = o.duration.map(|d| Timer::start(rate, d, o.margin));
    let mut stall = Stall::new(rate);
    if tx.c.no_peak {
        tx.c.tposted[0] = crate::clock::now();
    }
    let Tx {
        shape,
        c,
        remote,
        path,
        tx_depth,
        ..
    } = &mut *tx;
    let (shape, tx_depth) = (*shape, *tx_depth);
    let PathState::Scoped(bufs) = path else {
        return Err(not_here());
    };
    // Borrowed for the whole scope: sources per (QP, slot), destinations
    // (READ, atomics) cycled over.
    let srcs = bufs
        .src
        .iter()
        .map(|slots| slots.iter().map(Src::shared).collect::<Result<Vec<_>>>())
        .collect::<Result<Vec<_>>>()?;
    let dsts = bufs
        .pool
        .iter_mut()
        .map(Dst::new)
        .collect::<Result<Vec<_>>>()?;
    let Queues { qps, send_cq, .. } = q;
    // Each QP's destinations per slot (READ, atomics), picked once: no
    // division per request.
    let qp_dsts: Vec<Vec<Dst<'_>>> = (0..qps.len())
        .map(|qi| match dsts.len() {
            0 => Vec::new(),
            n => (0..shape.nslots)
                .map(|slot| dsts[(qi * shape.nslots + slot) % n])
                .collect(),
        })
        .collect();
    send_cq.cq.scope(|s| -> Result<()> {
        let mut sq = qps
            .iter_mut()
            .map(|qp| s.attach(qp))
            .collect::<Result<Vec<_>>>()?;
        let mut run = Loop {
            s,
            sq: &mut sq,
            c,
            timer: &mut timer,
            stall: &mut stall,
            ctrl,
            shape,
            tx_depth,
        };
        let wr_id = |qi: usize, k: u64| ((qi as u64) << QP_SHIFT) | k;
        let dst = |qi: usize, slot: usize| qp_dsts[qi][slot];
        // One loop per operation, so that each is compiled with its request
        // shape known (the raw path keeps one prepared request per QP).
        match (shape.verb, shape.atomic) {
            (Verb::Write, _) => run.drive(|qi, k, slot, off| {
                ScopedSend::write(wr_id(qi, k), srcs[qi][slot], remote[qi], off)
            }),
            (Verb::Send, _) => {
                run.drive(|qi, k, slot, _| ScopedSend::send(wr_id(qi, k), srcs[qi][slot]))
            }
            (Verb::Read, _) => run.drive(|qi, k, slot, off| {
                ScopedSend::read(wr_id(qi, k), dst(qi, slot), remote[qi], off)
            }),
            (Verb::Atomic, AtomicOp::FetchAdd) => run.drive(|qi, k, slot, off| {
                ScopedSend::fetch_add(
                    wr_id(qi, k),
                    dst(qi, slot),
                    remote[qi],
                    off,
                    ATOMIC_ADD_VALUE,
                )
            }),
            (Verb::Atomic, AtomicOp::CmpSwap) => run.drive(|qi, k, slot, off| {
                ScopedSend::compare_swap(
                    wr_id(qi, k),
                    dst(qi, slot),
                    remote[qi],
                    off,
                    ATOMIC_CMP_VALUE,
                    ATOMIC_SWAP_VALUE,
                )
            }),
        }
    })?;
    Ok(super::tx_row(o, rate, timer, tx))
}

/// The sender's loop in a scope (perftest's `run_iter_bw`).
struct Loop<'a, 'scope, 'env> {
    s: &'scope Scope<'scope, 'env>,
    sq: &'a mut [ScopedQp<'scope, Rts>],
    c: &'a mut Counts,
    timer: &'a mut Option<Timer>,
    stall: &'a mut Stall,
    ctrl: &'a Ctrl,
    shape: Shape,
    tx_depth: u64,
}

impl<'scope> Loop<'_, 'scope, '_> {
    /// Runs until every request completed; `request(qi, k, slot, offset)`
    /// is request `k` of QP `qi`.
    fn drive(
        &mut self,
        request: impl Fn(usize, u64, usize, u64) -> ScopedSend<'scope>,
    ) -> Result<()> {
        let (shape, c) = (self.shape, &mut *self.c);
        let pl = shape.post_list;
        let mut out: Vec<ScopedCompletion> = Vec::with_capacity(POLL_BATCH);
        let request = |qi: usize, k: u64| {
            let slot = if shape.nslots > 1 {
                (k % shape.nslots as u64) as usize
            } else {
                0
            };
            request(qi, k, slot, (slot * shape.stride) as u64)
        };
        // Lists start at multiples of their length: when the moderation
        // divides it (and the run's last request falls on its boundary) every
        // list signals the same entries, as in the raw path and perftest.
        let sig = shape.sig;
        let fixed = pl % sig.cq_mod == 0 && (!sig.iterations || sig.iters % sig.cq_mod == 0);
        let pattern: Vec<bool> = (0..pl).map(|j| (j + 1) % sig.cq_mod == 0).collect();
        // With a fixed pattern each QP re-posts one prepared list (like the
        // raw path and perftest, every post of it targets the same slots).
        let prepared = if pl > 1 && fixed {
            (0..self.sq.len())
                .map(|qi| {
                    PreparedSends::new(
                        (0..pl).map(|j| request(qi, j).signaled(pattern[j as usize])),
                    )
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        loop {
            let phase = self.timer.as_mut().map_or(Phase::Sample, Timer::tick);
            if phase != Phase::End {
                // Each QP's counters, looked up once per QP (as the raw loop).
                let per_qp = self
                    .sq
                    .iter_mut()
                    .zip(&mut c.scnt)
                    .zip(&c.ccnt)
                    .zip(&mut c.sig);
                for (qi, (((qp, scnt), &ccnt), clock)) in per_qp.enumerate() {
                    while (!c.iterations || *scnt < c.iters) && *scnt + pl <= self.tx_depth + ccnt {
                        if !c.no_peak {
                            c.tposted[c.totscnt as usize] = crate::clock::now();
                        }
                        let first = *scnt;
                        if pl == 1 {
                            qp.post_send(&request(qi, first).signaled(clock.at(first)))?;
                        } else if fixed {
                            qp.post_prepared(&prepared[qi], ((qi as u64) << QP_SHIFT) | first)?;
                        } else {
                            qp.post_send_list(
                                (first..first + pl).map(|k| request(qi, k).signaled(clock.at(k))),
                            )?;
                        }
                        *scnt += pl;
                        c.totscnt += pl;
                    }
                }
            }
            let due = if c.iterations {
                c.totccnt < c.tot_iters
            } else {
                c.totccnt < c.totscnt
            };
            if due {
                out.clear();
                self.s.poll(&mut out)?;
                for comp in &out {
                    comp.result()?;
                    let qi = (comp.wr_id >> QP_SHIFT) as usize;
                    let seq = comp.wr_id & SEQ_MASK;
                    // The completion retires every request up to `seq` on its QP.
                    let fill = (seq + 1).saturating_sub(c.ccnt[qi]);
                    c.ccnt[qi] = seq + 1;
                    c.complete(fill, phase);
                }
            }
            self.stall.check(c.totccnt, self.ctrl)?;
            let done = if c.iterations {
                c.totscnt >= c.tot_iters && c.totccnt >= c.tot_iters
            } else {
                phase == Phase::End
            };
            if done || self.sq.is_empty() {
                return Ok(());
            }
        }
    }
}

/// The receiver of a scoped send_bw for one size: carves one region into
/// `ScopedBuffers` per QP (perftest's cycle of slots), posts `-r` receives per
/// QP, meets the sender at the barrier, and re-posts the receives each poll
/// completed, one chain per QP, until `-n` per QP have been posted. Returns
/// its own row (see `Rx::row`).
pub fn receive(
    o: &Opts,
    rate: &Rate,
    dev: &Device,
    size: usize,
    q: &mut Queues,
    ctrl: &mut Ctrl,
) -> Result<Option<BwRow>> {
    let nq = q.qps.len();
    let (stride, nslots) = conn::cycle(size, 1);
    // One buffer per slot; a slot is `stride` bytes when there are several.
    let buf_len = if nslots > 1 { stride } else { size };
    let buff = conn::buff_size(size);
    let mut region = dev.pd.alloc_mr(buff * nq, AccessFlags::LOCAL_WRITE)?;
    let mut regions = (1..nq)
        .map(|_| region.split_to(buff))
        .collect::<Result<Vec<_>>>()?;
    regions.push(region);
    let mut stall = Stall::new(rate);
    let Queues { qps, recv_cq, .. } = q;
    let recv_cq = recv_cq
        .as_mut()
        .ok_or_else(|| Error::Other("send_bw has a receive CQ".into()))?;
    let (iters, rx_depth) = (o.iters, u64::from(o.rx_depth));
    recv_cq.cq.scope(|s| -> Result<Option<BwRow>> {
        let mut rq = qps
            .iter_mut()
            .zip(regions.iter_mut())
            .map(|(qp, region)| s.attach(qp)?.buffers(region, buf_len))
            .collect::<Result<Vec<_>>>()?;
        // As the raw path: no division when every receive uses one slot.
        let slot = move |n: u64| {
            if nslots > 1 {
                (n % nslots as u64) as usize
            } else {
                0
            }
        };
        let mut posted = vec![0u64; nq];
        for (qi, bufs) in rq.iter_mut().enumerate() {
            let tag = (qi as u64) << QP_SHIFT;
            bufs.post_recv_list((0..rx_depth).map(move |n| (slot(n), tag | n)))?;
            posted[qi] = rx_depth;
        }
        ctrl.barrier(false)?;
        if o.rx_burst {
            // Every receive is posted: read them once the sender is done.
            ctrl.swap(false, &WireRow(None))?;
        }
        let mut out: Vec<ScopedCompletion> = Vec::with_capacity(POLL_BATCH);
        let (mut rcnt, total) = (0u64, iters * nq as u64);
        let mut first = 0;
        // Receives each QP is owed by this batch, and the QPs owed any.
        let mut due = vec![0u64; nq];
        let mut owed: Vec<usize> = Vec::with_capacity(nq.min(POLL_BATCH));
        while rcnt < total {
            out.clear();
            s.poll(&mut out)?;
            if first == 0 && !out.is_empty() {
                first = crate::clock::now();
            }
            for c in &out {
                c.result()?;
                let qi = (c.wr_id >> QP_SHIFT) as usize;
                rcnt += 1;
                if due[qi] == 0 {
                    owed.push(qi);
                }
                due[qi] += 1;
            }
            // One chain per QP for the batch's receives.
            for &qi in &owed {
                let n = posted[qi];
                let m = due[qi].min(iters.saturating_sub(n));
                due[qi] = 0;
                if m > 0 {
                    let tag = (qi as u64) << QP_SHIFT;
                    rq[qi].post_recv_list((n..n + m).map(move |n| (slot(n), tag | n)))?;
                    posted[qi] = n + m;
                }
            }
            owed.clear();
            stall.check(rcnt, ctrl)?;
        }
        let end = crate::clock::now();
        Ok(super::rx::receiver_row(o, rate, size, rcnt, first, end))
    })
}
