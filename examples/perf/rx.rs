//! The receiver of send_bw on the safe and raw paths (perftest's
//! `run_iter_bw_server`): `-r` receives per QP posted up front, each
//! re-posted as its completion is polled. The scoped receiver is
//! `super::scoped::receive`.

use rdma_verbs::ffi;
use rdma_verbs::prelude::*;

use super::{POLL_BATCH, QP_SHIFT, SAFE_POOL_CAP, split_pool, wc_error};
use crate::Bufs;
use crate::clock::{self, Phase, Rate};
use crate::conn::{self, Device, EvCq};
use crate::opts::{DataPath, Opts};
use crate::report::{self, BwRow};

/// The receiving side of SEND tests (perftest's `run_iter_bw_server`).
pub struct Rx {
    path: DataPath,
    iters: u64,
    tot_iters: u64,
    iterations: bool,
    events: bool,
    size: usize,
    stride: usize,
    nslots: usize,
    pub(super) rcnt: u64,
    /// When the first receive completed (0: none yet), perftest's server
    /// `tposted[0]`.
    first: u64,
    /// Duration mode: receives completed in the sampling phase.
    sampled: u64,
    /// Duration mode: the sampling phase's start and end ticks, set when the
    /// run ends (`run_size`).
    pub(super) window: Option<(u64, u64)>,
    posted: Vec<u64>,
    last_ne: usize,
    /// Safe: the completion array.
    out: Vec<Completion>,
    /// Raw: one C receive per QP, re-posted (copied by the provider) each time.
    /// Boxed: the request points at the SGE beside it, so it must not move.
    #[allow(clippy::vec_box)]
    rwr: Vec<Box<(ffi::ibv_recv_wr, ffi::ibv_sge)>>,
    recv_base: Vec<u64>,
    wcs: Box<[ffi::ibv_wc]>,
}

impl Rx {
    /// Prepares the receive side and posts `-r` receives per QP.
    pub(super) fn new(
        o: &Opts,
        dev: &Device,
        size: usize,
        qps: &mut [Qp<Rc, Rts>],
        bufs: &Bufs,
    ) -> Result<Rx> {
        let nq = qps.len();
        let rx_depth = o.rx_depth as usize;
        let (stride, nslots) = conn::cycle(size, 1);
        // Bidirectional: take every waiting receive in one poll, as perftest
        // (`run_iter_bi` gives RX priority over TX, so that fast sends do not
        // drain the peer's receive queue).
        let batch = if o.bidir {
            rx_depth.max(POLL_BATCH)
        } else {
            POLL_BATCH
        };
        let mut rx = Rx {
            path: o.path,
            iters: o.iters,
            tot_iters: o.iters * nq as u64,
            iterations: o.duration.is_none(),
            events: o.events,
            size,
            stride,
            nslots,
            rcnt: 0,
            first: 0,
            sampled: 0,
            window: None,
            posted: vec![0; nq],
            last_ne: 1,
            out: Vec::with_capacity(batch),
            rwr: Vec::new(),
            recv_base: Vec::new(),
            wcs: vec![ffi::ibv_wc::default(); batch].into_boxed_slice(),
        };
        match o.path {
            DataPath::Safe | DataPath::Scoped => rx.post_safe(dev, qps, rx_depth)?,
            DataPath::Raw => rx.post_raw(o, qps, bufs, rx_depth)?,
        }
        Ok(rx)
    }

    /// Safe and scoped paths: `rx_depth` receives per QP, each owning its
    /// buffer from one pool.
    fn post_safe(&mut self, dev: &Device, qps: &mut [Qp<Rc, Rts>], rx_depth: usize) -> Result<()> {
        let nq = qps.len();
        let size = self.size;
        let count = rx_depth * nq;
        if count.saturating_mul(size) > SAFE_POOL_CAP {
            return Err(Error::InvalidArgument {
                what: "safe receive buffers",
                reason: format!(
                    "{count} receives of {size} bytes need {} MiB (every posted receive \
                     owns its buffer); lower -r or use --raw",
                    (count * size) >> 20
                ),
            });
        }
        let mut pool = split_pool(dev, size, count)?;
        for (qi, qp) in qps.iter_mut().enumerate() {
            for i in 0..rx_depth {
                let mr = pool.pop().expect("pool sized for every receive");
                qp.post_recv(RecvWr::new(((qi as u64) << QP_SHIFT) | i as u64, mr))?;
            }
            self.posted[qi] = rx_depth as u64;
        }
        Ok(())
    }

    /// Raw path: one prepared request per QP into the second half of its
    /// stretch of `Bufs::local`, posted `rx_depth` times.
    fn post_raw(
        &mut self,
        o: &Opts,
        qps: &mut [Qp<Rc, Rts>],
        bufs: &Bufs,
        rx_depth: usize,
    ) -> Result<()> {
        let buff = conn::buff_size(o.max_size());
        for (qi, qp) in qps.iter_mut().enumerate() {
            // The second half of this QP's stretch of `Bufs::local`.
            let base = bufs.local.addr() + ((2 * qi + 1) * buff) as u64;
            self.recv_base.push(base);
            let mut b = Box::new((
                ffi::ibv_recv_wr::default(),
                ffi::ibv_sge {
                    addr: base,
                    length: self.size as u32,
                    lkey: bufs.local.lkey(),
                },
            ));
            b.0.wr_id = qi as u64;
            b.0.num_sge = 1;
            b.0.sg_list = &mut b.1;
            self.rwr.push(b);
            for i in 0..rx_depth {
                self.set_recv_addr(qi, i as u64);
                let wr = &mut self.rwr[qi].0;
                // SAFETY: the SGE points into `Bufs::local` (LOCAL_WRITE, alive
                // until after the QPs are destroyed), which nothing on this side
                // reads or writes; completions are polled with poll_raw.
                unsafe { qp.post_recv_raw(wr)? };
            }
            self.posted[qi] = rx_depth as u64;
        }
        Ok(())
    }

    fn set_recv_addr(&mut self, qi: usize, n: u64) {
        if self.nslots > 1 {
            let off = ((n % self.nslots as u64) as usize * self.stride) as u64;
            self.rwr[qi].1.addr = self.recv_base[qi] + off;
        }
    }

    pub(super) fn done(&self, phase: Phase) -> bool {
        if self.iterations {
            self.rcnt >= self.tot_iters
        } else {
            phase == Phase::End
        }
    }

    /// Polls up to 16 receive completions (with `-b`, up to `-r`) and
    /// re-posts their receives.
    pub(super) fn poll_round(
        &mut self,
        qps: &mut [Qp<Rc, Rts>],
        cq: &mut EvCq,
        phase: Phase,
    ) -> Result<()> {
        if self.done(phase) {
            return Ok(());
        }
        if self.events && self.last_ne == 0 {
            cq.wait_event()?;
        }
        let ne = match self.path {
            DataPath::Safe | DataPath::Scoped => {
                self.out.clear();
                let ne = cq.cq.poll(&mut self.out)?;
                for i in 0..ne {
                    let c = &mut self.out[i];
                    c.result()?;
                    let qi = (c.wr_id >> QP_SHIFT) as usize;
                    self.rcnt += 1;
                    if !self.iterations || self.posted[qi] < self.iters {
                        let mr = c.take_mr().ok_or_else(|| {
                            Error::Protocol("receive completion without its buffer".into())
                        })?;
                        qps[qi].post_recv(RecvWr::new(c.wr_id, mr))?;
                        self.posted[qi] += 1;
                    }
                }
                ne
            }
            DataPath::Raw => {
                let ne = cq.cq.poll_raw(&mut self.wcs)?;
                for i in 0..ne {
                    let wc = self.wcs[i];
                    if wc.status != ffi::IBV_WC_SUCCESS {
                        return Err(wc_error(&wc));
                    }
                    let qi = wc.wr_id as usize;
                    self.rcnt += 1;
                    if !self.iterations || self.posted[qi] < self.iters {
                        let n = self.posted[qi];
                        self.set_recv_addr(qi, n);
                        let wr = &mut self.rwr[qi].0;
                        // SAFETY: as in `Rx::new`.
                        unsafe { qps[qi].post_recv_raw(wr)? };
                        self.posted[qi] += 1;
                    }
                }
                ne
            }
        };
        if ne > 0 && self.first == 0 {
            self.first = clock::now();
        }
        if !self.iterations && phase == Phase::Sample {
            self.sampled += ne as u64;
        }
        self.last_ne = ne;
        Ok(())
    }

    /// Duration mode: receives completed in the sampling phase.
    pub(super) fn sampled(&self) -> u64 {
        self.sampled
    }

    /// The receiver's own row (perftest's server: no peak): from its first
    /// receive to `end`, or in duration mode the receives of the sampling
    /// phase over its length.
    pub(super) fn row(&self, o: &Opts, rate: &Rate, end: u64) -> Option<BwRow> {
        let Some((start, stop)) = self.window else {
            return receiver_row(o, rate, self.size, self.rcnt, self.first, end);
        };
        Some(report::span_row(
            self.size,
            self.sampled,
            start,
            stop,
            rate,
            o.report_gbits,
        ))
    }
}

/// A receiver's row in iterations mode: `received` messages of `size` bytes
/// from tick `first` to `end` (`None` in duration mode, or before any receive).
pub(super) fn receiver_row(
    o: &Opts,
    rate: &Rate,
    size: usize,
    received: u64,
    first: u64,
    end: u64,
) -> Option<BwRow> {
    if o.duration.is_some() || first == 0 {
        return None;
    }
    Some(report::span_row(
        size,
        received,
        first,
        end,
        rate,
        o.report_gbits,
    ))
}
