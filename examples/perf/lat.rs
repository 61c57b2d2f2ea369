//! The latency tests: perftest's `run_iter_lat_write` (WRITE ping-pong, each
//! side polls the last byte of its own buffer), `run_iter_lat_send` (SEND
//! ping-pong) and `run_iter_lat` (READ, client only), on either data path.
//!
//! As in perftest, the time stamp is taken just before each post and the
//! samples are the differences between consecutive posts (a full round trip,
//! halved for the ping-pong tests).

use rdma_verbs::ffi;
use rdma_verbs::prelude::*;

use crate::Bufs;
use crate::bw::{Stall, split_pool, wc_error};
use crate::clock::{self, Phase, Rate, Timer};
use crate::conn::{Ctrl, Device, EvCq, Queues};
use crate::opts::{DataPath, Opts, Test};
use crate::report::{self, LatDurRow, Table};

/// Runs every size of a latency test; returns the printed rows.
#[allow(clippy::too_many_arguments)]
pub fn run(
    o: &Opts,
    rate: &Rate,
    dev: &Device,
    q: &mut Queues,
    remote: &[RemoteMr],
    bufs: &mut Bufs,
    ctrl: &mut Ctrl,
) -> Result<Table> {
    let client = !o.is_server();
    let measures = o.test != Test::ReadLat || client;
    let mut table = Table::default();
    if measures {
        println!("{}", report::header(o));
    } else {
        println!(
            " (the client measures and prints {} results)",
            o.test.name()
        );
    }
    for &size in &o.sizes {
        let mut run = Lat::new(o, rate, dev, q, remote[0], bufs, size)?;
        ctrl.barrier(client)?;
        match o.test {
            Test::WriteLat => run.write_lat(q, bufs, ctrl)?,
            Test::SendLat => run.send_lat(q, ctrl)?,
            Test::ReadLat if client => run.read_lat(q, ctrl)?,
            _ => {}
        }
        // Both sides finish before either tears anything down.
        ctrl.barrier(client)?;
        if !measures {
            continue;
        }
        match run.timer {
            Some(t) => {
                let secs = t.sample_end.wrapping_sub(t.sample_start) as f64 / rate.per_sec();
                let n = run.sampled.max(1);
                let row = LatDurRow {
                    size: size as u64,
                    iters: run.sampled,
                    t_avg: secs * 1e6 / report::rtt_factor(o.test) / n as f64,
                    tps: run.sampled as f64 / secs,
                };
                println!("{}", report::lat_dur_line(&row));
                table.lat_dur.push(row);
            }
            None => {
                let mut deltas: Vec<u64> = run
                    .tposted
                    .windows(2)
                    .map(|w| w[1].wrapping_sub(w[0]))
                    .collect();
                let row =
                    report::lat_row(size, o.iters, &mut deltas, rate, report::rtt_factor(o.test));
                println!("{}", report::lat_line(&row));
                table.lat.push(row);
            }
        }
    }
    println!("{}", report::LINE);
    Ok(table)
}

/// The state of one size of a latency test.
struct Lat {
    path: DataPath,
    server: bool,
    size: usize,
    iters: u64,
    iterations: bool,
    cq_mod: u64,
    rx_depth: u64,
    events: bool,
    remote: RemoteMr,
    timer: Option<Timer>,
    sampled: u64,
    /// Post time of each iteration.
    tposted: Vec<u64>,
    /// Safe: the WRITE source (owned, comes back with each completion) or the
    /// SEND source (shared), inline bytes, READ destination, receive pool.
    src: Option<Mr>,
    shared_src: Option<SharedMr>,
    inline: Option<Vec<u8>>,
    dest: Option<Mr>,
    out: Vec<Completion>,
    /// Raw: the prepared send request and its SGE, receive request and its SGE.
    wr: RawSend,
    rwr: RawRecv,
    wcs: [ffi::ibv_wc; 1],
    /// Notices a peer that died or stopped: no progress for `STALL_LIMIT`.
    stall: Stall,
    /// Completions and bytes seen so far (what `stall` watches).
    progress: u64,
}

impl Lat {
    #[allow(clippy::too_many_arguments)]
    fn new(
        o: &Opts,
        rate: &Rate,
        dev: &Device,
        q: &mut Queues,
        remote: RemoteMr,
        bufs: &mut Bufs,
        size: usize,
    ) -> Result<Lat> {
        let iterations = o.duration.is_none();
        let inline = size <= o.inline_size as usize && o.test != Test::ReadLat;
        // The byte the peer's WRITE changes last: cleared before the barrier.
        if o.test == Test::WriteLat {
            bufs.target.write_at(size - 1, &[0])?;
        }
        let (wr, rwr) = raw_requests(o, bufs, remote, size, inline);
        let tposted = timestamps(o)?;
        let mut lat = Lat {
            path: o.path,
            server: o.is_server(),
            size,
            iters: o.iters,
            iterations,
            cq_mod: u64::from(o.cq_mod),
            rx_depth: u64::from(o.rx_depth),
            events: o.events,
            remote,
            timer: None,
            sampled: 0,
            tposted,
            src: None,
            shared_src: None,
            inline: inline.then(|| vec![0u8; size]),
            dest: None,
            out: Vec::with_capacity(1),
            wr,
            rwr,
            wcs: [ffi::ibv_wc::default()],
            stall: Stall::new(rate),
            progress: 0,
        };
        lat.alloc_safe_buffers(o, dev, size, inline)?;
        lat.post_first_receives(o, dev, q, size)?;
        lat.timer = o.duration.map(|d| Timer::start(rate, d, o.margin));
        Ok(lat)
    }

    /// The safe path's buffers: the WRITE source (owned) or SEND source
    /// (shared) unless the data goes inline, and the READ destination.
    fn alloc_safe_buffers(
        &mut self,
        o: &Opts,
        dev: &Device,
        size: usize,
        inline: bool,
    ) -> Result<()> {
        if o.path == DataPath::Safe && !inline {
            match o.test {
                Test::WriteLat => {
                    self.src = Some(
                        dev.pd
                            .alloc_mr(size, rdma_verbs::mr::AccessFlags::LOCAL_WRITE)?,
                    )
                }
                Test::SendLat => {
                    self.shared_src = Some(
                        dev.pd
                            .alloc_mr(size, rdma_verbs::mr::AccessFlags::LOCAL_WRITE)?
                            .freeze(),
                    )
                }
                _ => {}
            }
        }
        if o.path == DataPath::Safe && o.test == Test::ReadLat {
            self.dest = Some(
                dev.pd
                    .alloc_mr(size, rdma_verbs::mr::AccessFlags::LOCAL_WRITE)?,
            );
        }
        Ok(())
    }

    /// SEND latency: `-r` receives posted before the barrier.
    fn post_first_receives(
        &mut self,
        o: &Opts,
        dev: &Device,
        q: &mut Queues,
        size: usize,
    ) -> Result<()> {
        if o.test == Test::SendLat {
            let qp = &mut q.qps[0];
            match o.path {
                DataPath::Safe | DataPath::Scoped => {
                    for (i, mr) in split_pool(dev, size, o.rx_depth as usize)?
                        .into_iter()
                        .enumerate()
                    {
                        qp.post_recv(RecvWr::new(i as u64, mr))?;
                    }
                }
                DataPath::Raw => {
                    for _ in 0..o.rx_depth {
                        // SAFETY: the SGE points into the second half of `Bufs::local`
                        // (LOCAL_WRITE, alive until after the QPs are destroyed), which
                        // nothing on this side reads or writes; polled with poll_raw.
                        unsafe { qp.post_recv_raw(&mut self.rwr.0)? };
                    }
                }
            }
        }
        Ok(())
    }

    /// Advances the duration clock; true once it has run out.
    #[inline]
    fn ended(&mut self) -> bool {
        match self.timer.as_mut() {
            Some(t) => t.tick() == Phase::End,
            None => false,
        }
    }

    #[inline]
    fn more(&self, n: u64) -> bool {
        !self.iterations || n < self.iters
    }

    /// Records the post time of iteration `scnt` (0-based).
    #[inline]
    fn stamp(&mut self, scnt: u64) {
        if self.iterations {
            self.tposted[scnt as usize] = clock::now();
        } else if self.timer.is_some_and(|t| t.phase == Phase::Sample) {
            self.sampled += 1;
        }
    }

    /// Busy-polls (or sleeps, with `-e`) until one completion arrives on `cq`.
    /// Safe path: the completion is left in `self.out[0]`. `Ok(false)`: the
    /// duration ran out first.
    fn wait_one(&mut self, cq: &mut EvCq, ctrl: &Ctrl) -> Result<bool> {
        loop {
            let n = match self.path {
                DataPath::Safe | DataPath::Scoped => {
                    self.out.clear();
                    cq.cq.poll(&mut self.out)?
                }
                DataPath::Raw => cq.cq.poll_raw(&mut self.wcs)?,
            };
            if n > 0 {
                match self.path {
                    DataPath::Safe | DataPath::Scoped => self.out[0].result()?,
                    DataPath::Raw => {
                        if self.wcs[0].status != ffi::IBV_WC_SUCCESS {
                            return Err(wc_error(&self.wcs[0]));
                        }
                    }
                }
                self.progress += 1;
                return Ok(true);
            }
            if self.ended() {
                return Ok(false);
            }
            // A peer that died (or stopped) ends the run with an error.
            self.stall.check(self.progress, ctrl)?;
            if self.events {
                cq.wait_event()?;
            }
        }
    }

    /// Posts the test's send-queue request (signaled or not).
    #[inline]
    fn post(&mut self, qp: &mut Qp<Rc, Rts>, id: u64, signaled: bool) -> Result<()> {
        match self.path {
            DataPath::Safe | DataPath::Scoped => {
                let off = 0;
                // Each request built in its post_send call: a request picked by
                // an `if` and then passed on would be copied (144 bytes).
                let posted = if let Some(data) = self.inline.as_deref() {
                    match self.wr.0.opcode {
                        ffi::IBV_WR_SEND => {
                            qp.post_send(SendWr::send_inline(id, data).signaled(signaled))
                        }
                        _ => qp.post_send(
                            SendWr::write_inline(id, data, self.remote, off).signaled(signaled),
                        ),
                    }
                } else if let Some(src) = self.src.take() {
                    qp.post_send(SendWr::write_from(id, src, self.remote, off).signaled(signaled))
                } else if let Some(src) = &self.shared_src {
                    qp.post_send(SendWr::send_from(id, src.clone()).signaled(signaled))
                } else {
                    let dest = self
                        .dest
                        .take()
                        .ok_or_else(|| Error::Protocol("READ destination not back".into()))?;
                    qp.post_send(SendWr::read(id, dest, self.remote, off).signaled(signaled))
                };
                posted.map_err(Error::from)
            }
            DataPath::Raw => {
                let f = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                if signaled {
                    self.wr.0.send_flags |= f;
                } else {
                    self.wr.0.send_flags &= !f;
                }
                self.wr.0.wr_id = id;
                // SAFETY: the SGE points into the first half of `Bufs::local`
                // (registered, alive until after the QPs are destroyed); the last
                // byte is written only between a completion and the next post, when
                // the NIC is not reading it. Remote addresses are inside the peer's
                // region. Polled with poll_raw.
                unsafe { qp.post_send_raw(&mut self.wr.0) }
            }
        }
    }

    /// Sets the last byte of the next WRITE's source to `v`.
    fn mark_source(&mut self, v: u8) -> Result<()> {
        if self.path == DataPath::Raw {
            // Inline or not, the raw request's SGE points into `Bufs::local`.
            let p = (self.wr.1.addr + self.size as u64 - 1) as *mut u8;
            // SAFETY: inside `Bufs::local`, which outlives this run; the previous
            // WRITE from it has completed (its completion was polled), so the NIC
            // is not reading it, and no Rust reference to that memory exists.
            unsafe { p.write_volatile(v) };
        } else if let Some(data) = self.inline.as_mut() {
            data[self.size - 1] = v;
        } else if let Some(src) = self.src.as_mut() {
            src.write_at(self.size - 1, &[v])?;
        }
        Ok(())
    }

    /// perftest's `run_iter_lat_write`.
    fn write_lat(&mut self, q: &mut Queues, bufs: &Bufs, ctrl: &Ctrl) -> Result<()> {
        let (mut scnt, mut ccnt, mut rcnt) = (0u64, 0u64, 0u64);
        let poll_at = self.size - 1;
        let poll_ptr = (bufs.target.addr() + poll_at as u64) as *const u8;
        while self.more(scnt) || self.more(ccnt) || self.more(rcnt) {
            if self.more(rcnt) && !(scnt < 1 && self.server) {
                rcnt += 1;
                let want = rcnt as u8;
                loop {
                    let got = match self.path {
                        DataPath::Safe | DataPath::Scoped => {
                            let mut b = [0u8];
                            bufs.target.read_at(poll_at, &mut b)?;
                            // Keeps the compiler from assuming the byte cannot change.
                            std::hint::black_box(());
                            b[0]
                        }
                        // SAFETY: inside `Bufs::target`, alive for the run; the peer's
                        // NIC writes it concurrently, hence the volatile read.
                        DataPath::Raw => unsafe { poll_ptr.read_volatile() },
                    };
                    if got == want || self.ended() {
                        break;
                    }
                    self.stall.check(self.progress, ctrl)?;
                    std::hint::spin_loop();
                }
            }
            self.progress += 1;
            if self.ended() {
                break;
            }
            if self.more(scnt) {
                self.stamp(scnt);
                scnt += 1;
                self.mark_source(scnt as u8)?;
                self.post(&mut q.qps[0], scnt, true)?;
            }
            if self.more(ccnt) {
                if !self.wait_one(&mut q.send_cq, ctrl)? {
                    break;
                }
                ccnt += 1;
                if self.path == DataPath::Safe {
                    self.src = self.out[0].take_mr().or(self.src.take());
                    self.out.clear();
                }
            }
        }
        Ok(())
    }

    /// perftest's `run_iter_lat_send`.
    fn send_lat(&mut self, q: &mut Queues, ctrl: &Ctrl) -> Result<()> {
        let (mut scnt, mut rcnt) = (0u64, 0u64);
        let client = !self.server;
        // The receive consumed by the last message, re-posted once the reply is
        // on its way (perftest re-posts before replying; the work is the same,
        // but this keeps the re-post off the round trip).
        let mut repost: Option<(u64, Option<Mr>)> = None;
        while self.more(scnt) || self.more(rcnt) {
            if self.more(rcnt) && !(scnt < 1 && client) {
                let rcq = q.recv_cq.as_mut().expect("send tests have a receive CQ");
                if !self.wait_one(rcq, ctrl)? {
                    break;
                }
                rcnt += 1;
                if !self.iterations || rcnt + self.rx_depth <= self.iters {
                    repost = Some(match self.path {
                        DataPath::Safe | DataPath::Scoped => {
                            let c = &mut self.out[0];
                            let mr = c.take_mr().ok_or_else(|| {
                                Error::Protocol("receive completion without its buffer".into())
                            })?;
                            (c.wr_id, Some(mr))
                        }
                        DataPath::Raw => (0, None),
                    });
                }
                self.out.clear();
            }
            if self.ended() {
                break;
            }
            let mut signaled = false;
            if self.more(scnt) {
                self.stamp(scnt);
                scnt += 1;
                signaled = scnt % self.cq_mod == 0 || (self.iterations && scnt == self.iters);
                self.post(&mut q.qps[0], scnt, signaled)?;
            }
            if let Some((id, mr)) = repost.take() {
                let qp = &mut q.qps[0];
                match mr {
                    Some(mr) => qp.post_recv(RecvWr::new(id, mr))?,
                    // SAFETY: as for the initial receives (`Lat::new`).
                    None => unsafe { qp.post_recv_raw(&mut self.rwr.0)? },
                }
            }
            if signaled {
                if !self.wait_one(&mut q.send_cq, ctrl)? {
                    break;
                }
                self.out.clear();
            }
        }
        Ok(())
    }

    /// perftest's `run_iter_lat` (READ): post, wait for the completion, repeat.
    fn read_lat(&mut self, q: &mut Queues, ctrl: &Ctrl) -> Result<()> {
        let mut scnt = 0u64;
        while self.more(scnt) {
            if self.ended() {
                break;
            }
            self.stamp(scnt);
            scnt += 1;
            self.post(&mut q.qps[0], scnt, true)?;
            if !self.wait_one(&mut q.send_cq, ctrl)? {
                break;
            }
            if self.path == DataPath::Safe {
                self.dest = self.out[0].take_mr();
                self.out.clear();
            }
        }
        Ok(())
    }
}

/// A prepared raw send request with its SGE (boxed: the request points at it).
type RawSend = Box<(ffi::ibv_send_wr, ffi::ibv_sge)>;
/// A prepared raw receive request with its SGE.
type RawRecv = Box<(ffi::ibv_recv_wr, ffi::ibv_sge)>;

/// The raw path's prepared requests: the send (WRITE, READ or SEND of `size`
/// bytes from the first half of `Bufs::local`, signaled but for SEND) and the
/// receive (into the second half).
fn raw_requests(
    o: &Opts,
    bufs: &Bufs,
    remote: RemoteMr,
    size: usize,
    inline: bool,
) -> (RawSend, RawRecv) {
    let verb_op = match o.test {
        Test::WriteLat => ffi::IBV_WR_RDMA_WRITE,
        Test::ReadLat => ffi::IBV_WR_RDMA_READ,
        _ => ffi::IBV_WR_SEND,
    };
    let local = bufs.local.addr();
    let mut wr = Box::new((
        ffi::ibv_send_wr::default(),
        ffi::ibv_sge {
            addr: local,
            length: size as u32,
            lkey: bufs.local.lkey(),
        },
    ));
    wr.0.num_sge = 1;
    wr.0.sg_list = &mut wr.1;
    wr.0.opcode = verb_op;
    wr.0.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    wr.0.send_flags = if o.test == Test::SendLat {
        0
    } else {
        ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
    };
    if inline {
        wr.0.send_flags |= ffi::ibv_send_flags::IBV_SEND_INLINE.0;
    }
    let buff = crate::conn::buff_size(o.max_size());
    let mut rwr = Box::new((
        ffi::ibv_recv_wr::default(),
        ffi::ibv_sge {
            addr: local + buff as u64,
            length: size as u32,
            lkey: bufs.local.lkey(),
        },
    ));
    rwr.0.num_sge = 1;
    rwr.0.sg_list = &mut rwr.1;
    (wr, rwr)
}

/// One timestamp per iteration (as perftest keeps): refused, not aborted
/// on, when `-n` asks for more than can be allocated.
fn timestamps(o: &Opts) -> Result<Vec<u64>> {
    let samples = usize::try_from(o.iters).unwrap_or(usize::MAX);
    let mut tposted = Vec::new();
    if tposted.try_reserve_exact(samples).is_err() {
        return Err(Error::InvalidArgument {
            what: "-n",
            reason: format!(
                "{} iterations need a timestamp each, more memory than can be allocated",
                o.iters
            ),
        });
    }
    tposted.resize(samples, 0);
    Ok(tposted)
}
