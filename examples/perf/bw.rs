//! The bandwidth tests: perftest's `run_iter_bw` (sender) and
//! `run_iter_bw_server` (receiver of SENDs, in `rx`), on the safe, raw or scoped
//! data path (the scoped loops in `scoped`).
//!
//! Work per message is the same as perftest's: at most `-t` requests in flight
//! per QP, one signaled every `-Q` (and the last), `-l` requests per post call,
//! completions polled 16 at a time, receives re-posted one by one, small
//! messages cycled over cache-line slots of one page.
//!
//! Nothing in the loops allocates, locks or makes a system call of its own:
//! every vector below is sized before the barrier that starts the run.
//! (libibverbs' soft-RoCE provider rings its doorbell with a `write(2)` per
//! post call, on both paths, as for perftest.)

use rdma_verbs::ffi;
use rdma_verbs::prelude::*;

use crate::Bufs;
use crate::clock::{self, Phase, Rate, Timer};
use crate::conn::{self, Ctrl, Device, EvCq, Queues};
use crate::opts::{AtomicOp, DataPath, Opts, Verb};
use crate::report::{self, BwRow, BwSamples, Table, WireRow};

mod raw_tx;
mod rx;
mod safe_tx;
mod scoped;

use raw_tx::RawTx;
use rx::Rx;
use safe_tx::SafeTx;

/// perftest's `CTX_POLL_BATCH`.
pub const POLL_BATCH: usize = 16;
/// The QP index sits in the top 16 bits of a safe-path `wr_id`; the rest
/// is the request's sequence number on its QP.
const QP_SHIFT: u32 = 48;
const SEQ_MASK: u64 = (1 << QP_SHIFT) - 1;
/// Most memory the safe path may pin for READ destinations / receive buffers.
const SAFE_POOL_CAP: usize = 512 << 20;
/// perftest's `ATOMIC_ADD_VALUE`: what each fetch-and-add adds.
const ATOMIC_ADD_VALUE: u64 = 1;
/// perftest's compare-and-swap operands: `compare_add` left zero, `ATOMIC_SWAP_VALUE`.
const ATOMIC_CMP_VALUE: u64 = 0;
const ATOMIC_SWAP_VALUE: u64 = 0;

/// Runs every size of a bandwidth test; returns the printed rows.
#[allow(clippy::too_many_arguments)]
pub fn run(
    o: &Opts,
    rate: &Rate,
    dev: &Device,
    q: &mut Queues,
    remote: &[RemoteMr],
    bufs: &Bufs,
    ctrl: &mut Ctrl,
) -> Result<Table> {
    let client = !o.is_server();
    let mut table = Table::default();
    println!("{}", report::header(o));
    for &size in &o.sizes {
        if o.path == DataPath::Scoped && o.receives() {
            // The receiver of a scoped send_bw posts its receives in the
            // scope, before the barrier (one way: it sends nothing).
            let row = scoped::receive(o, rate, dev, size, q, ctrl)?;
            if !o.rx_burst {
                ctrl.swap(client, &WireRow(None))?;
            }
            if let Some(row) = row {
                println!("{}", report::bw_line(&row, o.report_gbits));
                table.bw.push(row);
            }
            continue;
        }
        let mut tx = if o.sends() {
            Some(Tx::new(o, dev, size, remote, bufs)?)
        } else {
            None
        };
        let mut rx = if o.receives() {
            Some(Rx::new(o, dev, size, &mut q.qps, bufs)?)
        } else {
            None
        };
        ctrl.barrier(client)?;
        // --rx-burst: the receiver (which sends nothing: no row of its own)
        // polls only once the sender's row says it is done.
        let early = if o.rx_burst && !client {
            Some(ctrl.swap(client, &WireRow(None))?.0)
        } else {
            None
        };
        let mut mine = run_size(o, rate, q, tx.as_mut(), rx.as_mut(), ctrl)?;
        if let (Some(row), Some(rx)) = (mine.as_mut(), rx.as_ref()) {
            // A bidirectional SEND side in duration mode counts what it sent
            // and what it received in the sampling phase, as perftest's
            // `run_iter_bi` (0 received in iterations mode).
            row.iters += rx.sampled();
        }
        // A receiver that does not send (the send_bw server) reports what it
        // measured itself, as perftest's does.
        let received = match (&tx, &rx) {
            (None, Some(rx)) => rx.row(o, rate, clock::now()),
            _ => None,
        };
        let theirs = match early {
            Some(theirs) => theirs,
            None => ctrl.swap(client, &WireRow(mine))?.0,
        };
        let row = received.or(match (mine, theirs) {
            (Some(a), Some(b)) => Some(a.plus(b)),
            (a, b) => a.or(b),
        });
        if let Some(row) = row {
            println!("{}", report::bw_line(&row, o.report_gbits));
            table.bw.push(row);
        }
        // Dropped only now: the requests still in the rings hold their own clones.
        drop(tx);
        drop(rx);
    }
    println!("{}", report::LINE);
    Ok(table)
}

/// Runs one size; returns this side's row if it sent.
fn run_size(
    o: &Opts,
    rate: &Rate,
    q: &mut Queues,
    mut tx: Option<&mut Tx>,
    mut rx: Option<&mut Rx>,
    ctrl: &Ctrl,
) -> Result<Option<BwRow>> {
    if let (Some(tx), DataPath::Scoped) = (tx.as_deref_mut(), o.path) {
        return scoped::run_size(o, rate, q, tx, ctrl).map(Some);
    }
    if tx.is_none() && rx.is_none() {
        // Nothing to do on this side (the server of a one-way WRITE/READ test):
        // wait for the peer's results on the TCP connection instead of spinning.
        return Ok(None);
    }
    // Duration mode ends the run; --run_infinitely only uses -D as its report period.
    let mut timer = match o.run_infinitely {
        true => None,
        false => o.duration.map(|d| Timer::start(rate, d, o.margin)),
    };
    let period = rate.ticks(o.duration.unwrap_or(5) as f64);
    let mut next_report = clock::now() + period;
    let mut last_count = 0u64;
    let mut last_t = clock::now();
    let mut stall = Stall::new(rate);
    if let Some(tx) = tx.as_deref_mut() {
        if tx.c.no_peak {
            tx.c.tposted[0] = clock::now();
        }
    }
    loop {
        let phase = match timer.as_mut() {
            Some(t) => t.tick(),
            None => Phase::Sample,
        };
        if let Some(tx) = tx.as_deref_mut() {
            tx.post_round(&mut q.qps, phase)?;
        }
        if let Some(rx) = rx.as_deref_mut() {
            let cq = q.recv_cq.as_mut().expect("send tests have a receive CQ");
            rx.poll_round(&mut q.qps, cq, phase)?;
        }
        if let Some(tx) = tx.as_deref_mut() {
            tx.poll_round(&mut q.send_cq, phase)?;
        }
        let progress =
            tx.as_deref().map_or(0, |t| t.c.totccnt) + rx.as_deref().map_or(0, |r| r.rcnt);
        stall.check(progress, ctrl)?;
        if o.run_infinitely {
            let t = clock::now();
            if t >= next_report {
                let count = tx.as_deref().map_or(0, |tx| tx.c.totccnt);
                if tx.is_some() {
                    let size = tx.as_deref().map_or(0, |tx| tx.size);
                    let row =
                        report::span_row(size, count - last_count, last_t, t, rate, o.report_gbits);
                    println!("{}", report::bw_line(&row, o.report_gbits));
                }
                last_count = count;
                last_t = t;
                next_report = t + period;
            }
            continue;
        }
        let tx_done = tx.as_deref().is_none_or(|tx| tx.done(phase));
        let rx_done = rx.as_deref().is_none_or(|rx| rx.done(phase));
        if tx_done && rx_done {
            break;
        }
    }
    if let (Some(rx), Some(t)) = (rx, timer) {
        rx.window = Some((t.sample_start, t.sample_end));
    }
    let Some(tx) = tx else { return Ok(None) };
    Ok(Some(tx_row(o, rate, timer, tx)))
}

/// The sender's result row.
fn tx_row(o: &Opts, rate: &Rate, timer: Option<Timer>, tx: &mut Tx) -> BwRow {
    match timer {
        Some(t) => report::span_row(
            tx.size,
            tx.c.sampled,
            t.sample_start,
            t.sample_end,
            rate,
            o.report_gbits,
        ),
        None => {
            if tx.c.no_peak {
                tx.c.tcompleted[0] = clock::now();
            }
            let s = BwSamples {
                size: tx.size,
                iters: tx.c.tot_iters,
                post_list: u64::from(o.post_list),
                cq_mod: u64::from(o.cq_mod),
                tposted: &tx.c.tposted,
                tcompleted: &tx.c.tcompleted,
                no_peak: tx.c.no_peak,
            };
            report::bw_row(&s, rate, o.report_gbits)
        }
    }
}

/// How long the loop may go without a completion before it gives up: a peer
/// that died leaves the receiver (and a sender whose requests never fail)
/// spinning forever otherwise (perftest does).
pub const STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

/// Notices a run that stopped completing anything. The clock is read only
/// after many idle rounds, never while completions arrive.
pub struct Stall {
    last: u64,
    idle: u32,
    since: Option<u64>,
    limit_ticks: u64,
}

impl Stall {
    pub fn new(rate: &Rate) -> Stall {
        Stall {
            last: 0,
            idle: 0,
            since: None,
            limit_ticks: rate.ticks(STALL_LIMIT.as_secs_f64()),
        }
    }

    /// While nothing completes, also checks every 65,536 idle rounds whether the peer's
    /// process is gone (its end of the TCP connection closed): that is reported at once,
    /// a peer that is merely silent after [`STALL_LIMIT`].
    #[inline]
    pub fn check(&mut self, progress: u64, ctrl: &Ctrl) -> Result<()> {
        if progress != self.last {
            self.last = progress;
            self.idle = 0;
            self.since = None;
            return Ok(());
        }
        self.idle = self.idle.wrapping_add(1);
        if self.idle % 65_536 != 0 {
            return Ok(());
        }
        if ctrl.peer_closed()? {
            return Err(Error::PeerClosed {
                waiting_for: "completions",
            });
        }
        let now = clock::now();
        match self.since {
            None => self.since = Some(now),
            Some(t0) if now.wrapping_sub(t0) > self.limit_ticks => {
                return Err(Error::Timeout {
                    what: "completions: none arrived (the peer is gone or stopped)",
                    after: STALL_LIMIT,
                });
            }
            Some(_) => {}
        }
        Ok(())
    }
}

/// Turns a failed raw completion into an error.
pub fn wc_error(wc: &ffi::ibv_wc) -> Error {
    let status = WcStatus::from_raw(wc.status);
    Error::Protocol(format!(
        "work completion failed: {status} ({}), wr_id {}, vendor error {:#x}{}",
        status.description(),
        wc.wr_id,
        wc.vendor_err,
        status.hint().map_or(String::new(), |h| format!("; {h}"))
    ))
}

/// perftest's signaling rule: request `k` of a QP asks for a completion when
/// `k % cq_mod == cq_mod - 1`, and the last request of an iterations run does.
#[derive(Debug, Clone, Copy)]
struct Signal {
    cq_mod: u64,
    iters: u64,
    iterations: bool,
}

impl Signal {
    /// The rule itself ([`SigClock`] applies it without dividing).
    #[cfg(test)]
    fn at(self, k: u64) -> bool {
        k % self.cq_mod == self.cq_mod - 1 || (self.iterations && k == self.iters - 1)
    }

    /// The first request that signals.
    fn first(self) -> u64 {
        let boundary = self.cq_mod - 1;
        if self.iterations {
            boundary.min(self.iters.saturating_sub(1))
        } else {
            boundary
        }
    }

    /// The request that signals after `k`, which did.
    #[inline(always)]
    fn after(self, k: u64) -> u64 {
        // `k` is a moderation boundary or the run's last request.
        let next = k + self.cq_mod;
        match self.iterations {
            true if k + 1 >= self.iters => u64::MAX,
            true if next >= self.iters => self.iters - 1,
            _ => next,
        }
    }
}

/// [`Signal::at`] for one QP's requests taken in order, without a division
/// per request: it keeps the next request that signals.
#[derive(Debug, Clone, Copy)]
pub struct SigClock {
    sig: Signal,
    next: u64,
}

impl SigClock {
    fn new(sig: Signal) -> SigClock {
        SigClock {
            sig,
            next: sig.first(),
        }
    }

    /// Whether request `k` signals; `k` follows the previous call's by one.
    #[inline(always)]
    fn at(&mut self, k: u64) -> bool {
        if k != self.next {
            return false;
        }
        self.next = self.sig.after(k);
        true
    }
}

/// The counters and time stamps of a sender (perftest's `scnt`, `ccnt`,
/// `tposted`, `tcompleted`).
struct Counts {
    iters: u64,
    tot_iters: u64,
    iterations: bool,
    no_peak: bool,
    scnt: Vec<u64>,
    ccnt: Vec<u64>,
    totscnt: u64,
    totccnt: u64,
    sampled: u64,
    tposted: Vec<u64>,
    tcompleted: Vec<u64>,
    /// Each QP's signaling clock.
    sig: Vec<SigClock>,
}

impl Counts {
    /// Zeroed counters for `-q` QPs, with room for `peak_len` timestamps.
    fn new(o: &Opts, tot_iters: u64, iterations: bool, peak_len: usize, sig: Signal) -> Counts {
        let nq = o.num_qps as usize;
        Counts {
            iters: o.iters,
            tot_iters,
            iterations,
            no_peak: o.no_peak,
            scnt: vec![0; nq],
            ccnt: vec![0; nq],
            totscnt: 0,
            totccnt: 0,
            sampled: 0,
            tposted: vec![0; peak_len],
            tcompleted: vec![0; peak_len],
            sig: vec![SigClock::new(sig); nq],
        }
    }

    /// Accounts for `fill` requests retired by one completion.
    #[inline]
    fn complete(&mut self, fill: u64, phase: Phase) {
        self.totccnt += fill;
        if !self.no_peak {
            let idx = self.totccnt.min(self.tot_iters).max(1) - 1;
            self.tcompleted[idx as usize] = clock::now();
        }
        if !self.iterations && phase == Phase::Sample {
            self.sampled += fill;
        }
    }
}

/// The sending side of a bandwidth test (perftest's `run_iter_bw`).
pub struct Tx {
    size: usize,
    tx_depth: u64,
    events: bool,
    shape: Shape,
    c: Counts,
    last_ne: usize,
    remote: Vec<RemoteMr>,
    path: PathState,
}

/// What every post call needs to know (copied out of `Tx` to keep the
/// borrows of its parts apart).
#[derive(Debug, Clone, Copy)]
struct Shape {
    verb: Verb,
    /// Atomic tests: fetch-and-add or compare-and-swap.
    atomic: AtomicOp,
    post_list: u64,
    sig: Signal,
    /// Cache-line cycling of small messages: stride and slot count.
    stride: usize,
    nslots: usize,
}

/// Per-path state of a sender.
enum PathState {
    Safe(SafeTx),
    Raw(RawTx),
    /// `--scoped`: run by `crate::scoped`.
    Scoped(SafeTx),
}

impl Tx {
    fn new(o: &Opts, dev: &Device, size: usize, remote: &[RemoteMr], bufs: &Bufs) -> Result<Tx> {
        let nq = o.num_qps as usize;
        let iterations = o.duration.is_none();
        let tot_iters = o.iters * nq as u64;
        let (stride, nslots) = conn::cycle(size, o.post_list);
        let peak_len = if o.no_peak {
            1
        } else {
            tot_iters.max(1) as usize
        };
        let inline = size <= o.inline_size as usize && !o.test.verb().writes_local();
        let path = match o.path {
            DataPath::Safe => PathState::Safe(SafeTx::new(o, dev, size, nslots, stride, inline)?),
            // The same buffers, borrowed by the requests instead of moved.
            DataPath::Scoped => {
                PathState::Scoped(SafeTx::new(o, dev, size, nslots, stride, false)?)
            }
            DataPath::Raw => PathState::Raw(RawTx::new(o, size, remote, bufs, inline)),
        };
        let sig = Signal {
            cq_mod: u64::from(o.cq_mod),
            iters: o.iters,
            iterations,
        };
        Ok(Tx {
            size,
            tx_depth: u64::from(o.tx_depth),
            events: o.events,
            shape: Shape {
                verb: o.test.verb(),
                atomic: o.atomic,
                post_list: u64::from(o.post_list),
                sig,
                stride,
                nslots,
            },
            c: Counts::new(o, tot_iters, iterations, peak_len, sig),
            last_ne: 1,
            remote: remote.to_vec(),
            path,
        })
    }

    fn done(&self, phase: Phase) -> bool {
        if self.c.iterations {
            self.c.totscnt >= self.c.tot_iters && self.c.totccnt >= self.c.tot_iters
        } else {
            phase == Phase::End
        }
    }

    /// Posts on every QP while its window has room.
    fn post_round(&mut self, qps: &mut [Qp<Rc, Rts>], phase: Phase) -> Result<()> {
        if phase == Phase::End {
            return Ok(());
        }
        // One loop for single posts and one for lists, as a program that
        // posts one way writes it: neither's code shapes the other's.
        if self.shape.post_list == 1 {
            self.post_round_as::<false>(qps)
        } else {
            self.post_round_as::<true>(qps)
        }
    }

    /// [`post_round`](Tx::post_round) with one post call per request
    /// (`LIST` false) or per `-l` requests.
    #[inline(never)]
    fn post_round_as<const LIST: bool>(&mut self, qps: &mut [Qp<Rc, Rts>]) -> Result<()> {
        let shape = self.shape;
        let pl = shape.post_list;
        let Tx {
            c, path, remote, ..
        } = self;
        // Each QP's counters, looked up once per QP rather than per post.
        let per_qp = qps.iter_mut().zip(&mut c.scnt).zip(&c.ccnt).zip(&mut c.sig);
        for (qi, (((qp, scnt), &ccnt), clock)) in per_qp.enumerate() {
            let remote = remote[qi];
            while (!c.iterations || *scnt < c.iters) && *scnt + pl <= self.tx_depth + ccnt {
                if !c.no_peak {
                    c.tposted[c.totscnt as usize] = clock::now();
                }
                let first = *scnt;
                match &mut *path {
                    PathState::Safe(s) => s.post::<LIST>(&shape, qp, qi, first, remote, clock)?,
                    PathState::Raw(r) => r.post(shape, qp, qi, first, remote, clock)?,
                    PathState::Scoped(_) => return Err(scoped::not_here()),
                }
                *scnt += pl;
                c.totscnt += pl;
            }
        }
        Ok(())
    }

    /// Polls up to 16 send completions (perftest's completion step).
    fn poll_round(&mut self, cq: &mut EvCq, phase: Phase) -> Result<()> {
        let due = if self.c.iterations {
            self.c.totccnt < self.c.tot_iters
        } else {
            self.c.totccnt < self.c.totscnt
        };
        if !due {
            return Ok(());
        }
        if self.events && self.last_ne == 0 {
            cq.wait_event()?;
        }
        let c = &mut self.c;
        let ne = match &mut self.path {
            PathState::Safe(s) => {
                s.out.clear();
                // READ and atomics: the NIC wrote into owned destinations; recycle them.
                let read = self.shape.verb.writes_local();
                let ne = if read {
                    let pool = &mut s.pool;
                    cq.cq.poll_recycling(&mut s.out, |_, b| {
                        if let Some(mr) = b.into_mr() {
                            pool.push(mr);
                        }
                    })?
                } else {
                    cq.cq.poll(&mut s.out)?
                };
                for comp in s.out.iter_mut() {
                    comp.result()?;
                    let qi = (comp.wr_id >> QP_SHIFT) as usize;
                    let seq = comp.wr_id & SEQ_MASK;
                    if read {
                        if let Some(mr) = comp.take_mr() {
                            s.pool.push(mr);
                        }
                    }
                    // The completion retires every request up to `seq` on its QP.
                    let fill = (seq + 1).saturating_sub(c.ccnt[qi]);
                    c.ccnt[qi] = seq + 1;
                    c.complete(fill, phase);
                }
                // Drops the completions, and with them the shared sources they held.
                s.out.clear();
                ne
            }
            PathState::Scoped(_) => return Err(scoped::not_here()),
            PathState::Raw(r) => {
                let ne = cq.cq.poll_raw(&mut r.wcs)?;
                for wc in &r.wcs[..ne] {
                    if wc.status != ffi::IBV_WC_SUCCESS {
                        return Err(wc_error(wc));
                    }
                    let qi = wc.wr_id as usize;
                    let mut fill = self.shape.sig.cq_mod;
                    if c.iterations && c.ccnt[qi] + fill > c.iters {
                        fill = c.iters - c.ccnt[qi];
                    }
                    c.ccnt[qi] += fill;
                    c.complete(fill, phase);
                }
                ne
            }
        };
        self.last_ne = ne;
        Ok(())
    }
}

/// `count` owned, disjoint `size`-byte pieces of one registration.
pub fn split_pool(dev: &Device, size: usize, count: usize) -> Result<Vec<Mr>> {
    let mut pool = Vec::with_capacity(count);
    if count == 0 {
        return Ok(pool);
    }
    let mut rest = dev.pd.alloc_mr(size * count, AccessFlags::LOCAL_WRITE)?;
    for _ in 1..count {
        let tail = rest.split_off(size)?;
        pool.push(rest);
        rest = tail;
    }
    pool.push(rest);
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use super::{SigClock, Signal};

    #[test]
    fn the_clock_signals_what_the_rule_says() {
        for cq_mod in [1, 2, 3, 7, 8, 100] {
            for iters in [1, 2, 5, 7, 8, 99, 100, 101, 250] {
                for iterations in [true, false] {
                    let sig = Signal {
                        cq_mod,
                        iters,
                        iterations,
                    };
                    let mut clock = SigClock::new(sig);
                    let end = if iterations { iters } else { 3 * iters + 5 };
                    for k in 0..end {
                        assert_eq!(clock.at(k), sig.at(k), "{sig:?} k {k}");
                    }
                }
            }
        }
    }
}
