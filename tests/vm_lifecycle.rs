//! A seeded random-lifecycle test of the safe data path: 2–3 RC QPs on 1–2
//! shared CQs, connected in loopback on the one device (QPs 0 and 1 to each
//! other, QP 2 to itself), driven through random sequences of posts, polls,
//! transitions and drops against a model that predicts every completion,
//! every returned buffer and the kernel's resource counts.
//!
//! `RDMA_VERBS_LIFECYCLE_SEED` (default: the clock) and
//! `RDMA_VERBS_LIFECYCLE_STEPS` (default 10,000) select the run; the seed is
//! printed at the start and in every failure. See docs/lifecycle.md.

mod common;

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{all_remote, ctx, gid_index, res_counts};
use rdma_verbs::ffi;
use rdma_verbs::qp::{Buffer, Init, Reset, Rts, Sges, state};
use rdma_verbs::{
    AccessFlags, Completion, CompletionSource, Context, Cq, Error, InitAttr, Mr, Pd, PostError, Qp,
    QpCaps, Rc, RecvWr, RtrAttr, RtsAttr, SendWr, SharedMr, WcOpcode, WcStatus,
};

static SERIAL: Mutex<()> = Mutex::new(());
static SEED: AtomicU64 = AtomicU64::new(0);
static STEP: AtomicU64 = AtomicU64::new(0);

const INJECTED: &str = "lifecycle: injected iterator panic";
const STEPS_ENV: &str = "RDMA_VERBS_LIFECYCLE_STEPS";
const SEED_ENV: &str = "RDMA_VERBS_LIFECYCLE_SEED";
const HDR: usize = 32;
const RECV_LEN: usize = 4096;
const TEMPLATE_LEN: usize = 4096;
const MAGIC: u32 = 0x11fe_c7c1;
/// Bound on every wait for completions that the model says must come.
const WAIT: Duration = Duration::from_secs(15);

macro_rules! fail {
    ($($t:tt)*) => {
        panic!(
            "lifecycle seed={} step={}: {} (rerun with {}={})",
            SEED.load(Ordering::Relaxed),
            STEP.load(Ordering::Relaxed),
            format!($($t)*),
            SEED_ENV,
            SEED.load(Ordering::Relaxed),
        )
    };
}

static TRACE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `RDMA_VERBS_LIFECYCLE_TRACE=1`: one line per action, for reading a failing seed.
macro_rules! trace {
    ($($t:tt)*) => {
        if TRACE.load(Ordering::Relaxed) {
            eprintln!("[{}] {}", STEP.load(Ordering::Relaxed), format!($($t)*));
        }
    };
}

macro_rules! check {
    ($c:expr, $($t:tt)*) => {
        if !$c {
            fail!($($t)*);
        }
    };
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for b in *p {
            h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// A QP in whichever state the model last moved it to.
enum AnyQp {
    Reset(Qp<Rc, Reset>),
    Init(Qp<Rc, Init>),
    Rts(Qp<Rc, Rts>),
    Err(Qp<Rc, state::Error>),
}

macro_rules! each {
    ($q:expr, $v:ident => $e:expr) => {
        match $q {
            AnyQp::Reset($v) => $e,
            AnyQp::Init($v) => $e,
            AnyQp::Rts($v) => $e,
            AnyQp::Err($v) => $e,
        }
    };
}

impl AnyQp {
    fn name(&self) -> &'static str {
        match self {
            AnyQp::Reset(_) => "RESET",
            AnyQp::Init(_) => "INIT",
            AnyQp::Rts(_) => "RTS",
            AnyQp::Err(_) => "ERR",
        }
    }
    fn into_error(self) -> AnyQp {
        match each!(self, q => q.to_error().map_err(|e| e.error)) {
            Ok(q) => AnyQp::Err(q),
            Err(e) => fail!("to_error refused: {e}"),
        }
    }
    /// `reset`, handing back the QP unchanged (and the error) when refused.
    fn reset(self) -> (AnyQp, Option<Error>) {
        macro_rules! go {
            ($q:expr, $w:ident) => {
                match $q.reset() {
                    Ok(q) => (AnyQp::Reset(q), None),
                    Err(e) => (AnyQp::$w(e.qp), Some(e.error)),
                }
            };
        }
        match self {
            AnyQp::Reset(q) => go!(q, Reset),
            AnyQp::Init(q) => go!(q, Init),
            AnyQp::Rts(q) => go!(q, Rts),
            AnyQp::Err(q) => go!(q, Err),
        }
    }
    fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        match self {
            AnyQp::Init(q) => q.post_recv(wr),
            AnyQp::Rts(q) => q.post_recv(wr),
            _ => unreachable!("model posts receives only in INIT/RTR/RTS"),
        }
    }
    fn post_recv_list(&mut self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<(), PostError> {
        match self {
            AnyQp::Init(q) => q.post_recv_list(wrs),
            AnyQp::Rts(q) => q.post_recv_list(wrs),
            _ => unreachable!("model posts receives only in INIT/RTR/RTS"),
        }
    }
    fn can_recv(&self) -> bool {
        matches!(self, AnyQp::Init(_) | AnyQp::Rts(_))
    }
}

/// A posted work request, as the model expects the ring to hold it.
#[derive(Debug, Clone)]
struct Entry {
    wr_id: u64,
    /// Asked for a completion (or forced to, taking the ring's last slot).
    signaled: bool,
    /// Posted before its QP went to ERR: may complete with WR_FLUSH_ERR.
    may_flush: bool,
    /// Address of the exclusively owned `Mr` it carries (header or receive buffer).
    owned_addr: u64,
    /// Sends: carries a shared template slice too.
    body: bool,
    /// Receives: index since the QP's last reset (which message lands here).
    idx: u64,
    /// A send before the drain marker `to_error` posted (the last send was
    /// unsignaled): retired without a completion of its own once the
    /// marker's (invisible) completion is polled, unless it flushes itself.
    drain_covered: bool,
}

#[derive(Default)]
struct Queue {
    fifo: VecDeque<Entry>,
    depth: u64,
    flushed_seen: bool,
    /// `to_error` posted a drain marker whose completion was not polled yet
    /// (it counts as outstanding, and is never handed out).
    marker: bool,
}

struct QpSlot {
    qp: AnyQp,
    inst: u64,
    qpn: u32,
    send_cq: u64,
    recv_cq: u64,
    sq: Queue,
    rq: Queue,
    /// Bumped by reset: receive indices start over.
    epoch: u64,
    recvs_since_reset: u64,
    sends_since_reset: u64,
    /// Messages the peer posted to this QP since its reset (receive credits used).
    incoming: u64,
    /// A poll_raw consumed completions of this QP: the model cannot say which.
    tainted: bool,
}

struct CqSlot {
    cq: Cq,
    id: u64,
}

#[derive(Default)]
struct Stats {
    posted_send: u64,
    posted_recv: u64,
    completions: u64,
    flushed: u64,
    stale: u64,
    lost: u64,
    retired: u64,
    queue_full: u64,
    panics: u64,
    resets: u64,
    refused_resets: u64,
    cq_too_small: u64,
    connects: u64,
    qp_drops: u64,
    cq_drops: u64,
    raw: u64,
    res_checks: u64,
}

struct Model {
    rng: Rng,
    ctx: Context,
    pd: Pd,
    dev: String,
    gid: u8,
    base: HashMap<String, u64>,
    templates: Vec<(SharedMr, Vec<u8>)>,
    hdr_pool: Vec<Mr>,
    recv_pool: Vec<Mr>,
    qps: Vec<Option<QpSlot>>,
    cqs: Vec<Option<CqSlot>>,
    /// Links: (a, b) connected to each other (a == b: to itself); `up` while healthy.
    links: Vec<(usize, usize, bool)>,
    /// What each posted message must look like when received: (receiver inst, epoch, idx).
    expected: HashMap<(u64, u64, u64), (u32, u64)>,
    destroyed_qpns: HashSet<u32>,
    next_inst: u64,
    next_cq: u64,
    next_wr: u64,
    seq: u64,
    stats: Stats,
}

fn wr_id(inst: u64, recv: bool, n: u64) -> u64 {
    (inst << 40) | (u64::from(recv) << 39) | (n & ((1 << 39) - 1))
}

fn wr_parts(id: u64) -> (u64, bool) {
    (id >> 40, id & (1 << 39) != 0)
}

impl Model {
    fn new(seed: u64) -> Model {
        let mut rng = Rng(seed);
        let ctx = ctx();
        let pd = Pd::new(&ctx).expect("pd");
        let dev = ctx.name().to_owned();
        let gid = gid_index(&ctx);
        let base = res_counts(&dev);
        let mut templates = Vec::new();
        for _ in 0..4 {
            let mut mr = pd.alloc_mr(TEMPLATE_LEN, AccessFlags::empty()).unwrap();
            let bytes: Vec<u8> = (0..TEMPLATE_LEN).map(|_| rng.next() as u8).collect();
            mr.write_at(0, &bytes).unwrap();
            templates.push((mr.freeze(), bytes));
        }
        let nqps = if rng.chance(50) { 3 } else { 2 };
        let ncqs = if rng.chance(50) { 2 } else { 1 };
        let mut links = vec![(0, 1, false)];
        if nqps == 3 {
            links.push((2, 2, false));
        }
        Model {
            rng,
            ctx,
            pd,
            dev,
            gid,
            base,
            templates,
            hdr_pool: Vec::new(),
            recv_pool: Vec::new(),
            qps: (0..nqps).map(|_| None).collect(),
            cqs: (0..ncqs).map(|_| None).collect(),
            links,
            expected: HashMap::new(),
            destroyed_qpns: HashSet::new(),
            next_inst: 1,
            next_cq: 1,
            next_wr: 0,
            seq: 0,
            stats: Stats::default(),
        }
    }

    fn link_of(&self, slot: usize) -> usize {
        self.links
            .iter()
            .position(|&(a, b, _)| a == slot || b == slot)
            .unwrap()
    }

    fn peer_of(&self, slot: usize) -> usize {
        let (a, b, _) = self.links[self.link_of(slot)];
        if a == slot { b } else { a }
    }

    fn hdr_mr(&mut self) -> Mr {
        self.hdr_pool
            .pop()
            .unwrap_or_else(|| self.pd.alloc_mr(HDR, AccessFlags::empty()).unwrap())
    }

    fn recv_mr(&mut self) -> Mr {
        self.recv_pool.pop().unwrap_or_else(|| {
            self.pd
                .alloc_mr(RECV_LEN, AccessFlags::LOCAL_WRITE)
                .unwrap()
        })
    }

    fn give_back(&mut self, mr: Mr) {
        // Keep the pools bounded; the rest is deregistered (and counted).
        if mr.len() == HDR {
            if self.hdr_pool.len() < 64 {
                self.hdr_pool.push(mr);
            }
        } else if self.recv_pool.len() < 64 {
            self.recv_pool.push(mr);
        }
    }

    fn cq_index(&self, id: u64) -> Option<usize> {
        self.cqs
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| c.id == id))
    }

    // ------------------------------------------------------------------
    // Resources
    // ------------------------------------------------------------------

    fn create_cq(&mut self, i: usize) {
        let depth = self.rng.range(24, 112) as u32;
        let cq = Cq::new(&self.ctx, depth).unwrap_or_else(|e| fail!("create cq: {e}"));
        // The model keeps the books of fixed depths.
        cq.set_auto_grow(false);
        check!(cq.reserved() == 0, "fresh CQ has reservations");
        self.cqs[i] = Some(CqSlot {
            cq,
            id: self.next_cq,
        });
        self.next_cq += 1;
    }

    fn create_qp(&mut self, slot: usize) {
        let live: Vec<usize> = (0..self.cqs.len())
            .filter(|&i| self.cqs[i].is_some())
            .collect();
        if live.is_empty() {
            return;
        }
        let s = live[self.rng.below(live.len() as u64) as usize];
        let r = live[self.rng.below(live.len() as u64) as usize];
        let big = self.rng.chance(5);
        let sq = if big {
            200
        } else {
            self.rng.range(2, 16) as u32
        };
        let rq = self.rng.range(2, 16) as u32;
        let caps = QpCaps {
            max_send_wr: sq,
            max_recv_wr: rq,
            max_send_sge: 2,
            max_recv_sge: 1,
            ..QpCaps::default()
        };
        let (scq, rcq) = (
            &self.cqs[s].as_ref().unwrap(),
            &self.cqs[r].as_ref().unwrap(),
        );
        let free_s = u64::from(scq.cq.depth()) - scq.cq.reserved();
        let free_r = if s == r {
            free_s.saturating_sub(u64::from(sq))
        } else {
            u64::from(rcq.cq.depth()) - rcq.cq.reserved()
        };
        let predicted = if u64::from(sq) > free_s {
            Some(("send", u64::from(sq), free_s))
        } else if u64::from(rq) > free_r {
            Some(("receive", u64::from(rq), free_r))
        } else {
            None
        };
        let got = Qp::new(&self.pd, &scq.cq, &rcq.cq, caps);
        match (got, predicted) {
            (Ok(qp), None) => {
                let granted = qp.caps();
                let inst = self.next_inst;
                self.next_inst += 1;
                let qpn = qp.qp_num();
                self.qps[slot] = Some(QpSlot {
                    qp: AnyQp::Reset(qp),
                    inst,
                    qpn,
                    send_cq: scq.id,
                    recv_cq: rcq.id,
                    sq: Queue {
                        depth: u64::from(granted.max_send_wr),
                        ..Queue::default()
                    },
                    rq: Queue {
                        depth: u64::from(granted.max_recv_wr),
                        ..Queue::default()
                    },
                    epoch: 0,
                    recvs_since_reset: 0,
                    sends_since_reset: 0,
                    incoming: 0,
                    tainted: false,
                });
                check!(
                    granted.max_send_wr <= sq && granted.max_recv_wr <= rq,
                    "granted caps exceed the request: {granted:?}"
                );
            }
            (
                Err(Error::CqTooSmall {
                    queue,
                    needed,
                    free,
                    ..
                }),
                Some(p),
            ) => {
                check!(
                    (queue, needed, free) == p,
                    "CqTooSmall {:?}, model {p:?}",
                    (queue, needed, free)
                );
                self.stats.cq_too_small += 1;
            }
            (Ok(_), Some(p)) => fail!("QP created although the model predicted CqTooSmall {p:?}"),
            (Err(e), p) => fail!("create qp: {e} (model predicted {p:?})"),
        }
    }

    /// Drops the QP in `slot`: its ring buffers are released by the library.
    fn drop_qp(&mut self, slot: usize) {
        self.break_link(slot);
        let q = self.qps[slot].take().unwrap();
        self.destroyed_qpns.insert(q.qpn);
        drop(q.qp);
        self.stats.qp_drops += 1;
    }

    /// The link of `slot` is no longer healthy: move a peer in RTR/RTS to ERR
    /// (so it never waits on a QP that stopped answering).
    fn break_link(&mut self, slot: usize) {
        let l = self.link_of(slot);
        self.links[l].2 = false;
        let peer = self.peer_of(slot);
        if peer != slot {
            if let Some(p) = self.qps[peer].as_ref() {
                if matches!(p.qp, AnyQp::Rts(_)) {
                    self.err_now(peer);
                }
            }
        }
    }

    fn err_now(&mut self, slot: usize) {
        let mut q = self.qps[slot].take().unwrap();
        q.qp = q.qp.into_error();
        for e in q.sq.fifo.iter_mut().chain(q.rq.fifo.iter_mut()) {
            e.may_flush = true;
        }
        // to_error posts a drain marker when sends are outstanding (and the
        // ring has room, counting a marker already pending): it will retire
        // every send before it.
        let in_flight = q.sq.fifo.len() as u64 + u64::from(q.sq.marker);
        if in_flight > 0 && in_flight < q.sq.depth {
            for e in q.sq.fifo.iter_mut() {
                e.drain_covered = true;
            }
            q.sq.marker = true;
        }
        self.qps[slot] = Some(q);
    }

    /// The drained send `id` came back in a retired list without a completion
    /// of its own: the drain marker swept it. Removes it from the model.
    fn take_drained(&mut self, id: u64) -> Option<Entry> {
        let q = self.qps.iter_mut().flatten().find(|q| {
            q.sq.fifo
                .front()
                .is_some_and(|e| e.wr_id == id && e.drain_covered)
        })?;
        q.sq.fifo.pop_front()
    }

    /// Signaled sends a drain marker polled just now swept (their own
    /// completions were consumed by poll_raw): the library reports them lost.
    fn marker_swept_signaled(&self, cq_id: u64) -> u64 {
        let mut n = 0;
        for q in self.qps.iter().flatten() {
            if q.sq.marker && q.send_cq == cq_id && each!(&q.qp, qp => qp.outstanding()).0 == 0 {
                let sig = q.sq.fifo.iter().filter(|e| e.signaled).count() as u64;
                check!(
                    sig == 0 || q.tainted,
                    "the drain marker swept {sig} signaled sends"
                );
                n += sig;
            }
        }
        n
    }

    /// After a poll of CQ `cq_id`: a drain marker whose completion was polled
    /// (the library reports no send outstanding) retired the covered sends
    /// still in the model, releasing their buffers.
    fn sync_drained(&mut self, cq_id: u64) {
        for q in self.qps.iter_mut().flatten() {
            if q.sq.marker && q.send_cq == cq_id && each!(&q.qp, qp => qp.outstanding()).0 == 0 {
                check!(
                    q.sq.fifo.iter().all(|e| e.drain_covered),
                    "sends after the drain marker"
                );
                trace!(
                    "qpn {}: drain marker retired {} sends",
                    q.qpn,
                    q.sq.fifo.len()
                );
                q.sq.fifo.clear();
                q.sq.marker = false;
            }
        }
    }

    fn err(&mut self, slot: usize) {
        if matches!(self.qps[slot].as_ref().unwrap().qp, AnyQp::Err(_)) {
            return;
        }
        if matches!(self.qps[slot].as_ref().unwrap().qp, AnyQp::Reset(_)) {
            // The type allows RESET -> ERR, the kernel does not
            // (ib_modify_qp_is_ok): refused, and the QP comes back unchanged.
            let mut q = self.qps[slot].take().unwrap();
            let AnyQp::Reset(r) = q.qp else {
                unreachable!()
            };
            q.qp = match r.to_error() {
                Ok(_) => fail!("RESET -> ERR was accepted"),
                Err(e) => {
                    check!(
                        matches!(e.error, Error::Transition { .. }),
                        "RESET -> ERR: {}",
                        e.error
                    );
                    AnyQp::Reset(e.qp)
                }
            };
            self.qps[slot] = Some(q);
            return;
        }
        self.err_now(slot);
        self.break_link(slot);
    }

    fn reset(&mut self, slot: usize) {
        let mut q = self.qps[slot].take().unwrap();
        let expect = if !q.sq.fifo.is_empty() || q.sq.marker {
            Some(("send", q.sq.fifo.len() as u64 + u64::from(q.sq.marker)))
        } else if !q.rq.fifo.is_empty() {
            Some(("receive", q.rq.fifo.len() as u64))
        } else {
            None
        };
        let was = q.qp.name();
        let (qp, err) = q.qp.reset();
        let now = qp.name();
        q.qp = qp;
        let ok = err.is_none();
        match (err, expect) {
            (None, None) => {
                check!(now == "RESET", "reset left the QP in {now}");
                q.epoch += 1;
                q.recvs_since_reset = 0;
                q.sends_since_reset = 0;
                q.incoming = 0;
                q.sq.flushed_seen = false;
                q.rq.flushed_seen = false;
                self.stats.resets += 1;
            }
            (Some(Error::WorkOutstanding { queue, count }), Some(x)) => {
                check!(
                    (queue, count) == x,
                    "WorkOutstanding {:?}, model {x:?}",
                    (queue, count)
                );
                check!(now == was, "refused reset changed the state {was} -> {now}");
                self.stats.refused_resets += 1;
            }
            (e, x) => fail!("reset from {was}: {e:?}, model expected {x:?}"),
        }
        self.qps[slot] = Some(q);
        if ok {
            self.break_link(slot);
        }
    }

    /// The documented way back to a connectable QP: ERR, poll the flushes,
    /// RESET; a QP whose queues cannot drain (completions consumed by
    /// poll_raw, an unsignaled send that succeeded silently, its CQ dropped)
    /// is destroyed instead.
    fn recover(&mut self, l: usize) {
        let (a, b, _) = self.links[l];
        for s in [a, b] {
            let Some(q) = self.qps[s].as_ref() else {
                continue;
            };
            if matches!(q.qp, AnyQp::Reset(_) | AnyQp::Init(_)) {
                continue;
            }
            self.err(s);
            self.drain(s);
            self.reset(s);
            if !matches!(self.qps[s].as_ref().unwrap().qp, AnyQp::Reset(_)) {
                trace!("slot {s}: cannot be reset, destroyed");
                self.drop_qp(s);
            }
        }
    }

    fn init(&mut self, slot: usize) {
        let mut q = self.qps[slot].take().unwrap();
        let AnyQp::Reset(r) = q.qp else {
            unreachable!()
        };
        q.qp = match r.init(InitAttr::new(1, all_remote())) {
            Ok(q) => AnyQp::Init(q),
            Err(e) => fail!("init: {}", e.error),
        };
        self.qps[slot] = Some(q);
    }

    /// Connects link `l` whose QPs are both in RESET or INIT.
    fn connect(&mut self, l: usize) {
        let (a, b, _) = self.links[l];
        for s in [a, b] {
            if matches!(self.qps[s].as_ref().unwrap().qp, AnyQp::Reset(_)) {
                self.init(s);
            }
        }
        let gid = self.gid;
        let ep = |m: &Model, s: usize| -> rdma_verbs::Endpoint {
            each!(&m.qps[s].as_ref().unwrap().qp, q => q.endpoint(Some(gid)))
                .unwrap_or_else(|e| fail!("endpoint: {e}"))
        };
        let (ea, eb) = (ep(self, a), ep(self, b));
        let mtu = self.ctx.query_port(1).unwrap().active_mtu;
        for (s, remote) in [(a, eb), (b, ea)] {
            if s == b && a == b {
                break;
            }
            let manual = self.rng.chance(50);
            let mut q = self.qps[s].take().unwrap();
            let AnyQp::Init(i) = q.qp else { unreachable!() };
            let psn = i.psn();
            q.qp = if manual {
                let rtr = i
                    .rtr(RtrAttr::new(&remote, 1, mtu, Some(gid)))
                    .unwrap_or_else(|e| fail!("rtr: {}", e.error));
                AnyQp::Rts(
                    rtr.rts(RtsAttr::new(psn))
                        .unwrap_or_else(|e| fail!("rts: {}", e.error)),
                )
            } else {
                AnyQp::Rts(
                    i.connect(&remote, Some(gid))
                        .unwrap_or_else(|e| fail!("connect: {e}")),
                )
            };
            self.qps[s] = Some(q);
        }
        self.links[l].2 = true;
        self.stats.connects += 1;
    }

    // ------------------------------------------------------------------
    // Posting
    // ------------------------------------------------------------------

    /// Receive credits the sender in `slot` has towards its peer (0 unless healthy).
    fn credits(&self, slot: usize) -> u64 {
        let l = self.link_of(slot);
        if !self.links[l].2 {
            return 0;
        }
        let peer = self.peer_of(slot);
        let (Some(s), Some(p)) = (self.qps[slot].as_ref(), self.qps[peer].as_ref()) else {
            return 0;
        };
        if !matches!(s.qp, AnyQp::Rts(_)) {
            return 0;
        }
        p.recvs_since_reset - p.incoming
    }

    /// Builds one message: header `Mr` (sequence number, where it goes) and
    /// maybe a template slice. Returns the request, its model entry and
    /// what the receiver must see.
    fn build_send(&mut self, slot: usize) -> (SendWr<'static>, Entry, (u32, u64)) {
        let inst = self.qps[slot].as_ref().unwrap().inst;
        let id = wr_id(inst, false, self.next_wr);
        self.next_wr += 1;
        self.seq += 1;
        let mut hdr = self.hdr_mr();
        let t = self.rng.below(self.templates.len() as u64) as usize;
        let body_len = if self.rng.chance(25) {
            0
        } else {
            self.rng.range(1, 2048) as usize
        };
        let off = self.rng.below((TEMPLATE_LEN - body_len) as u64 + 1) as usize;
        let mut h = [0u8; HDR];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..12].copy_from_slice(&inst.to_le_bytes());
        h[12..20].copy_from_slice(&self.seq.to_le_bytes());
        h[20..24].copy_from_slice(&(body_len as u32).to_le_bytes());
        h[24..32].copy_from_slice(&id.to_le_bytes());
        hdr.as_mut_slice().unwrap().copy_from_slice(&h);
        let (tpl, bytes) = &self.templates[t];
        let body = &bytes[off..off + body_len];
        let expect = ((HDR + body_len) as u32, fnv(&[&h, body]));
        let signaled = self.rng.chance(60);
        let addr = hdr.addr();
        let mut wr = SendWr::send_from(id, hdr).signaled(signaled);
        if body_len > 0 {
            wr = wr.sge(tpl.slice(off, body_len).unwrap());
        }
        let entry = Entry {
            wr_id: id,
            signaled,
            may_flush: false,
            owned_addr: addr,
            body: body_len > 0,
            idx: 0,
            drain_covered: false,
        };
        (wr, entry, expect)
    }

    fn build_recv(&mut self, slot: usize) -> (RecvWr, Entry) {
        let inst = self.qps[slot].as_ref().unwrap().inst;
        let id = wr_id(inst, true, self.next_wr);
        self.next_wr += 1;
        let mr = self.recv_mr();
        let entry = Entry {
            wr_id: id,
            signaled: true,
            may_flush: false,
            owned_addr: mr.addr(),
            body: false,
            idx: 0,
            drain_covered: false,
        };
        (RecvWr::new(id, mr), entry)
    }

    /// Takes back the buffers of requests that were not posted.
    /// Checks how a list post whose iterator panics on item `p` ended, for a
    /// list of `n` of which `fits` had room; returns what was posted.
    fn panicking_list_outcome(
        &mut self,
        r: std::thread::Result<Result<(), PostError>>,
        p: u64,
        fits: usize,
        n: u64,
        slot: usize,
    ) -> Result<usize, PostError> {
        match r {
            // Past the queue's room (p > fits) the library stops at the
            // refused request and never pulls the panicking item.
            Ok(res) => {
                check!(
                    p as usize > fits && fits < n as usize,
                    "the iterator was to panic at {p} (fits {fits}, n {n}) but did not"
                );
                res.map(|()| n as usize)
            }
            // Panicking while staging posts nothing.
            Err(payload) => {
                check!(
                    payload.downcast_ref::<String>().map(String::as_str) == Some(INJECTED),
                    "unexpected panic"
                );
                check!(
                    p as usize <= fits,
                    "pulled past the refusal (p {p}, fits {fits})"
                );
                self.stats.panics += 1;
                trace!("slot {slot}: list of {n} panicked at {p}, nothing posted");
                Ok(0)
            }
        }
    }

    /// Checks how a post of `n` requests (`fits` of them had room among
    /// `free` slots) ended, drops from `entries` what was not posted, and
    /// returns how many were.
    #[allow(clippy::too_many_arguments)]
    fn post_outcome(
        &mut self,
        r: Result<usize, PostError>,
        panicked_list: bool,
        entries: &mut Vec<Entry>,
        fits: usize,
        n: u64,
        free: u64,
        recv: bool,
    ) -> usize {
        let kind = if recv { "receive" } else { "send" };
        match r {
            Ok(posted) if panicked_list => {
                entries.truncate(posted);
                posted
            }
            Ok(_) => {
                check!(
                    fits == n as usize,
                    "posted {n} {kind}s with {free} free slots"
                );
                n as usize
            }
            Err(e) => {
                check!(fits < n as usize, "{kind} refused with room: {}", e.error);
                // Only the refused request comes back; the iterator is not
                // pulled further, so the rest drop with it (released).
                let mut rest = entries.split_off(fits);
                rest.truncate(1);
                self.unposted(e, &rest, recv);
                fits
            }
        }
    }

    fn unposted(&mut self, e: PostError, want: &[Entry], recv: bool) {
        let depth = {
            let q = self
                .qps
                .iter()
                .flatten()
                .find(|q| want.first().is_some_and(|w| wr_parts(w.wr_id).0 == q.inst));
            q.map(|q| if recv { q.rq.depth } else { q.sq.depth })
        };
        match e.error {
            Error::QueueFull { queue, depth: d } => {
                check!(
                    queue == if recv { "receive" } else { "send" } && Some(u64::from(d)) == depth,
                    "QueueFull {queue} {d}, model depth {depth:?}"
                );
            }
            other => fail!("post refused: {other}"),
        }
        self.stats.queue_full += 1;
        let got: Vec<u64> = e.unposted.iter().map(|(id, _)| *id).collect();
        let exp: Vec<u64> = want.iter().map(|w| w.wr_id).collect();
        check!(got == exp, "unposted {got:x?}, model {exp:x?}");
        for ((_, bufs), w) in e.unposted.into_iter().zip(want) {
            self.take_buffers(bufs, w, "unposted");
        }
    }

    /// Checks the buffers that came back for `w` and returns them to the pools.
    fn take_buffers(&mut self, bufs: Sges, w: &Entry, what: &str) -> Option<Mr> {
        let (_, recv) = wr_parts(w.wr_id);
        let n = 1 + usize::from(w.body);
        check!(
            bufs.len() == n,
            "{what} {:#x}: {} buffers back, model {n}",
            w.wr_id,
            bufs.len()
        );
        let mut owned = None;
        for (i, b) in bufs.into_iter().enumerate() {
            match (i, b) {
                (0, Buffer::Owned(mr)) => {
                    check!(
                        mr.addr() == w.owned_addr,
                        "{what} {:#x}: a different Mr came back",
                        w.wr_id
                    );
                    owned = Some(mr);
                }
                (1, Buffer::Shared(s)) if !recv => drop(s),
                (i, b) => fail!("{what} {:#x}: buffer {i} is {b:?}", w.wr_id),
            }
        }
        if recv {
            owned
        } else {
            self.give_back(owned.unwrap());
            None
        }
    }

    fn post_send(&mut self, slot: usize, list: bool) {
        let credits = self.credits(slot);
        if credits == 0 {
            return;
        }
        let (free, depth) = {
            let q = &self.qps[slot].as_ref().unwrap().sq;
            (q.depth - q.fifo.len() as u64, q.depth)
        };
        if free == 0 && !self.rng.chance(15) {
            return;
        }
        let n = if list {
            self.rng.range(1, credits.min(free + 2).min(8))
        } else {
            1
        };
        let panic_at = (list && self.rng.chance(15)).then(|| self.rng.below(n + 1));
        let mut wrs = Vec::new();
        let mut entries = Vec::new();
        let mut expects = Vec::new();
        for _ in 0..n {
            let (wr, e, x) = self.build_send(slot);
            wrs.push(wr);
            entries.push(e);
            expects.push(x);
        }
        // The request taking the ring's last slot is forced signaled.
        let fits = free.min(n) as usize;
        for (k, e) in entries.iter_mut().enumerate().take(fits) {
            if self.qps[slot].as_ref().unwrap().sq.fifo.len() as u64 + k as u64 + 1 == depth {
                e.signaled = true;
            }
        }
        let q = self.qps[slot].as_mut().unwrap();
        let AnyQp::Rts(qp) = &mut q.qp else {
            unreachable!()
        };
        let r = if let Some(p) = panic_at {
            let r = catch_unwind(AssertUnwindSafe(|| qp.post_send_list(panicking_at(wrs, p))));
            self.panicking_list_outcome(r, p, fits, n, slot)
        } else if list {
            qp.post_send_list(wrs).map(|()| n as usize)
        } else {
            qp.post_send(wrs.pop().unwrap()).map(|()| 1)
        };
        let posted = self.post_outcome(r, panic_at.is_some(), &mut entries, fits, n, free, false);
        let peer = self.peer_of(slot);
        let (pinst, pepoch, pin) = {
            let p = self.qps[peer].as_ref().unwrap();
            (p.inst, p.epoch, p.incoming)
        };
        for (k, x) in expects.into_iter().take(posted).enumerate() {
            self.expected.insert((pinst, pepoch, pin + k as u64), x);
        }
        self.qps[peer].as_mut().unwrap().incoming += posted as u64;
        trace!("slot {slot}: {posted}/{n} sends posted (free {free}, panic {panic_at:?})");
        let q = self.qps[slot].as_mut().unwrap();
        q.sends_since_reset += posted as u64;
        q.sq.fifo.extend(entries.into_iter().take(posted));
        self.stats.posted_send += posted as u64;
    }

    fn post_recv(&mut self, slot: usize, list: bool) {
        if !self.qps[slot].as_ref().unwrap().qp.can_recv() {
            return;
        }
        let (free, depth) = {
            let q = &self.qps[slot].as_ref().unwrap().rq;
            (q.depth - q.fifo.len() as u64, q.depth)
        };
        if free == 0 && !self.rng.chance(15) {
            return;
        }
        let n = if list {
            self.rng.range(1, (free + 2).min(8))
        } else {
            1
        };
        let panic_at = (list && self.rng.chance(15)).then(|| self.rng.below(n + 1));
        let mut wrs = Vec::new();
        let mut entries = Vec::new();
        for _ in 0..n {
            let (wr, e) = self.build_recv(slot);
            wrs.push(wr);
            entries.push(e);
        }
        let fits = free.min(n) as usize;
        let q = self.qps[slot].as_mut().unwrap();
        let r = if let Some(p) = panic_at {
            let qp = &mut q.qp;
            let r = catch_unwind(AssertUnwindSafe(|| qp.post_recv_list(panicking_at(wrs, p))));
            self.panicking_list_outcome(r, p, fits, n, slot)
        } else if list {
            q.qp.post_recv_list(wrs).map(|()| n as usize)
        } else {
            q.qp.post_recv(wrs.pop().unwrap()).map(|()| 1)
        };
        let posted = self.post_outcome(r, panic_at.is_some(), &mut entries, fits, n, free, true);
        trace!(
            "slot {slot} qpn {}: {posted}/{n} receives posted (free {free} depth {depth} fifo {:x?})",
            self.qps[slot].as_ref().unwrap().qpn,
            self.qps[slot]
                .as_ref()
                .unwrap()
                .rq
                .fifo
                .iter()
                .map(|e| e.wr_id & 0xfff)
                .collect::<Vec<_>>()
        );
        let q = self.qps[slot].as_mut().unwrap();
        for (k, mut e) in entries.into_iter().take(posted).enumerate() {
            e.idx = q.recvs_since_reset + k as u64;
            q.rq.fifo.push_back(e);
        }
        q.recvs_since_reset += posted as u64;
        self.stats.posted_recv += posted as u64;
    }

    // ------------------------------------------------------------------
    // Polling
    // ------------------------------------------------------------------

    /// Completions the CQ `id` will certainly deliver: signaled sends, and
    /// receives that are flushed or have their message posted already; of
    /// QPs whose completions no poll_raw consumed.
    fn certain(&self, id: u64) -> usize {
        let mut n = 0;
        for q in self.qps.iter().flatten().filter(|q| !q.tainted) {
            if q.send_cq == id {
                n += q.sq.fifo.iter().filter(|e| e.signaled).count();
            }
            if q.recv_cq == id {
                let err = matches!(q.qp, AnyQp::Err(_));
                n +=
                    q.rq.fifo
                        .iter()
                        .filter(|e| err || e.may_flush || e.idx < q.incoming)
                        .count();
            }
        }
        n
    }

    fn poll(&mut self, c: usize) {
        let id = self.cqs[c].as_ref().unwrap().id;
        let kind = self.rng.below(10);
        let mut out: Vec<Completion>;
        let mut retired = Vec::new();
        let mut drained_sure = false;
        let r = match kind {
            // plain poll, small or CQ-sized buffer
            0..=3 => {
                let cap = if self.rng.chance(50) {
                    self.rng.range(1, 4) as usize
                } else {
                    drained_sure = true;
                    self.cqs[c].as_ref().unwrap().cq.depth() as usize + 1
                };
                out = Vec::with_capacity(cap);
                self.cqs[c].as_mut().unwrap().cq.poll(&mut out)
            }
            4..=6 => {
                let cap = self.rng.range(1, 6) as usize;
                out = Vec::with_capacity(cap);
                retired.reserve(self.rng.below(3) as usize);
                self.cqs[c]
                    .as_mut()
                    .unwrap()
                    .cq
                    .poll_with_retired(&mut out, &mut retired)
            }
            7..=8 => {
                let certain = self.certain(id);
                let k = self.rng.range(0, certain.min(6) as u64) as usize;
                out = Vec::new();
                let r = self.cqs[c].as_mut().unwrap().cq.poll_n(&mut out, k, WAIT);
                if let Err(Error::Timeout { .. }) = r {
                    fail!(
                        "poll_n({k}) timed out with {} of them (model: {certain} certain)",
                        out.len()
                    );
                }
                if r.is_ok() {
                    check!(out.len() == k, "poll_n({k}) returned {}", out.len());
                }
                r.map(|()| k)
            }
            _ => {
                if !self.rng.chance(20) {
                    return;
                }
                let mut wcs = vec![ffi::ibv_wc::default(); self.rng.range(1, 3) as usize];
                let n = self.cqs[c]
                    .as_mut()
                    .unwrap()
                    .cq
                    .poll_raw(&mut wcs)
                    .unwrap_or_else(|e| fail!("poll_raw: {e}"));
                for wc in &wcs[..n] {
                    self.stats.raw += 1;
                    if let Some(q) = self.qps.iter_mut().flatten().find(|q| q.qpn == wc.qp_num) {
                        q.tainted = true;
                    } else {
                        check!(
                            self.destroyed_qpns.contains(&wc.qp_num),
                            "raw completion of unknown QP {}",
                            wc.qp_num
                        );
                    }
                }
                return;
            }
        };
        let with_retired = (4..=6).contains(&kind);
        self.process(id, out, with_retired.then_some(retired), r);
        if drained_sure {
            self.check_reserved(c);
        }
    }

    /// After a poll that found the CQ empty, buried rings are gone: the CQ
    /// reserves exactly the depths of the live queues on it.
    fn check_reserved(&self, c: usize) {
        let cq = self.cqs[c].as_ref().unwrap();
        let mut live = 0;
        for q in self.qps.iter().flatten() {
            if q.send_cq == cq.id {
                live += q.sq.depth;
            }
            if q.recv_cq == cq.id {
                live += q.rq.depth;
            }
        }
        check!(
            cq.cq.reserved() == live,
            "CQ reserves {} after an emptying poll, live queues {live}",
            cq.cq.reserved()
        );
    }

    fn process(
        &mut self,
        cq_id: u64,
        out: Vec<Completion>,
        retired: Option<Vec<(u64, Sges)>>,
        r: rdma_verbs::Result<usize>,
    ) {
        let mut lost = 0u64;
        let mut swept_all: Vec<Entry> = Vec::new();
        for mut c in out {
            trace!("cq {cq_id}: {c:?}");
            self.stats.completions += 1;
            match c.source {
                CompletionSource::Posted => {}
                CompletionSource::Stale => {
                    check!(
                        self.destroyed_qpns.contains(&c.qp_num) && c.buffers().is_empty(),
                        "stale completion of QP {} ({c:?})",
                        c.qp_num
                    );
                    self.stats.stale += 1;
                    continue;
                }
                other => fail!("{other:?} completion {c:?}"),
            }
            let (inst, recv) = wr_parts(c.wr_id);
            let Some(slot) = self
                .qps
                .iter()
                .position(|q| q.as_ref().is_some_and(|q| q.inst == inst))
            else {
                fail!("completion {c:?} of a QP the model dropped");
            };
            let q = self.qps[slot].as_mut().unwrap();
            check!(c.qp_num == q.qpn, "completion {c:?} names QP {}", q.qpn);
            check!(
                (if recv { q.recv_cq } else { q.send_cq }) == cq_id,
                "completion {c:?} on the wrong CQ"
            );
            let tainted = q.tainted;
            let queue = if recv { &mut q.rq } else { &mut q.sq };
            let Some(pos) = queue.fifo.iter().position(|e| e.wr_id == c.wr_id) else {
                fail!("completion {c:?} of a request the model does not have in flight");
            };
            let swept: Vec<Entry> = queue.fifo.drain(..pos).collect();
            let e = queue.fifo.pop_front().unwrap();
            let sig_swept = swept.iter().filter(|s| s.signaled).count() as u64;
            check!(
                sig_swept == 0 || tainted,
                "completion {c:?} swept {sig_swept} signaled requests, no poll_raw involved"
            );
            lost += sig_swept;
            // Status: success unless the QP went to ERR; per queue, no success after a flush.
            match c.status {
                WcStatus::Success => {
                    check!(!queue.flushed_seen, "{c:?}: success after a flush");
                    check!(
                        e.signaled,
                        "{c:?}: unsignaled request completed successfully"
                    );
                }
                WcStatus::WrFlushErr => {
                    check!(
                        e.may_flush,
                        "{c:?}: flushed, but the QP was never moved to ERR"
                    );
                    queue.flushed_seen = true;
                    self.stats.flushed += 1;
                }
                s => fail!("{c:?}: status {s:?}"),
            }
            let op = c.opcode;
            check!(
                op == if recv { WcOpcode::Recv } else { WcOpcode::Send },
                "{c:?}: opcode {op:?}"
            );
            let (epoch, recv_ok) = (q.epoch, c.status == WcStatus::Success && recv);
            let byte_len = c.byte_len;
            let bufs = c.take_buffers();
            if let Some(mr) = self.take_buffers(bufs, &e, "completion") {
                if recv_ok {
                    let key = (inst, epoch, e.idx);
                    let Some((len, hash)) = self.expected.remove(&key) else {
                        fail!("{c:?}: a receive succeeded with no message posted for it ({key:?})");
                    };
                    check!(byte_len == len, "{c:?}: {byte_len} bytes, sent {len}");
                    let data = mr.as_slice().unwrap();
                    let got = fnv(&[&data[..len as usize]]);
                    check!(
                        got == hash,
                        "{c:?}: received bytes differ from what was sent (header {:x?})",
                        &data[..HDR.min(len as usize)]
                    );
                } else if !recv {
                    unreachable!();
                }
                self.give_back(mr);
            }
            swept_all.extend(swept);
        }
        lost += self.marker_swept_signaled(cq_id);
        match (r, lost) {
            (Ok(_), 0) => {}
            (Err(Error::CompletionsLost { count }), n) if n > 0 => {
                check!(count == n, "CompletionsLost {count}, model {n}");
                self.stats.lost += n;
            }
            (r, n) => fail!("poll returned {r:?}, model expected {n} lost"),
        }
        // Without `retired` the library released them: the Mr count check sees them gone.
        if let Some(all) = retired {
            let mut ret = Vec::with_capacity(all.len());
            for (id, bufs) in all {
                let drained = (!swept_all.iter().any(|e| e.wr_id == id))
                    .then(|| self.take_drained(id))
                    .flatten();
                match drained {
                    Some(e) => {
                        self.stats.retired += 1;
                        if let Some(mr) = self.take_buffers(bufs, &e, "drained") {
                            self.give_back(mr);
                        }
                    }
                    None => ret.push((id, bufs)),
                }
            }
            let got: Vec<u64> = ret.iter().map(|(id, _)| *id).collect();
            let exp: Vec<u64> = swept_all.iter().map(|e| e.wr_id).collect();
            check!(got == exp, "retired {got:x?}, model {exp:x?}");
            self.stats.retired += ret.len() as u64;
            for ((_, bufs), e) in ret.into_iter().zip(&swept_all) {
                if let Some(mr) = self.take_buffers(bufs, e, "retired") {
                    self.give_back(mr);
                }
            }
        }
        self.sync_drained(cq_id);
    }

    /// Polls until the QP in `slot` has no certain completions left (bounded),
    /// then a little more for the uncertain ones (flushed unsignaled sends).
    fn drain(&mut self, slot: usize) {
        let q = self.qps[slot].as_ref().unwrap();
        for id in [q.send_cq, q.recv_cq] {
            let Some(c) = self.cq_index(id) else { continue };
            let end = Instant::now() + WAIT;
            loop {
                let certain = self.certain(id);
                let mut out = Vec::with_capacity(certain.max(1));
                let r = self.cqs[c].as_mut().unwrap().cq.poll(&mut out);
                let n = out.len();
                self.process(id, out, None, r.map(|_| n));
                if n == 0 && certain == 0 {
                    break;
                }
                if n == 0 && Instant::now() > end {
                    fail!("drain: {certain} completions never came");
                }
            }
            // Flushes of unsignaled sends are not certain: give them a moment.
            let end = Instant::now() + Duration::from_millis(2);
            while Instant::now() < end {
                let mut out = Vec::with_capacity(8);
                let r = self.cqs[c].as_mut().unwrap().cq.poll(&mut out);
                let n = out.len();
                self.process(id, out, None, r.map(|_| n));
            }
        }
    }

    // ------------------------------------------------------------------
    // Kernel resources
    // ------------------------------------------------------------------

    fn expected_mrs(&self) -> u64 {
        let in_rings: usize = self
            .qps
            .iter()
            .flatten()
            .map(|q| q.sq.fifo.len() + q.rq.fifo.len())
            .sum();
        (self.templates.len() + self.hdr_pool.len() + self.recv_pool.len() + in_rings) as u64
    }

    fn check_res(&mut self) {
        let now = res_counts(&self.dev);
        let mut cq_ids: HashSet<u64> = self.cqs.iter().flatten().map(|c| c.id).collect();
        for q in self.qps.iter().flatten() {
            cq_ids.insert(q.send_cq);
            cq_ids.insert(q.recv_cq);
        }
        let want = [
            ("mr", self.expected_mrs()),
            ("qp", self.qps.iter().flatten().count() as u64),
            ("cq", cq_ids.len() as u64),
        ];
        for (k, n) in want {
            let got = now[k] - self.base[k];
            check!(got == n, "kernel has {got} {k}s of ours, model {n}");
        }
        self.stats.res_checks += 1;
    }

    // ------------------------------------------------------------------
    // The random walk
    // ------------------------------------------------------------------

    fn step(&mut self) {
        let nq = self.qps.len() as u64;
        let slot = self.rng.below(nq) as usize;
        let a = self.rng.below(1000);
        let have = self.qps[slot].is_some();
        trace!(
            "action {a} slot {slot} ({})",
            self.qps[slot].as_ref().map_or("none", |q| q.qp.name())
        );
        match a {
            0..=179 if have => self.post_send(slot, false),
            180..=279 if have => self.post_send(slot, true),
            280..=429 if have => self.post_recv(slot, false),
            430..=529 if have => self.post_recv(slot, true),
            530..=799 => {
                let c = self.rng.below(self.cqs.len() as u64) as usize;
                if self.cqs[c].is_some() {
                    self.poll(c);
                }
            }
            800..=819 if have => self.err(slot),
            820..=859 if have => {
                if self.rng.chance(70) {
                    self.drain(slot);
                }
                self.reset(slot);
            }
            860..=899 => {
                let l = self.rng.below(self.links.len() as u64) as usize;
                let (x, y, up) = self.links[l];
                let ready = |m: &Model, s: usize| {
                    m.qps[s]
                        .as_ref()
                        .is_some_and(|q| matches!(q.qp, AnyQp::Reset(_) | AnyQp::Init(_)))
                };
                if up {
                    return;
                }
                if !(ready(self, x) && ready(self, y)) && self.rng.chance(60) {
                    self.recover(l);
                }
                if ready(self, x) && ready(self, y) {
                    self.connect(l);
                }
            }
            900..=914 if have => {
                if matches!(self.qps[slot].as_ref().unwrap().qp, AnyQp::Reset(_)) {
                    self.init(slot);
                }
            }
            915..=919 if have => self.drop_qp(slot),
            925..=969 if !have => self.create_qp(slot),
            970..=971 => {
                let c = self.rng.below(self.cqs.len() as u64) as usize;
                if self.cqs[c].take().is_some() {
                    self.stats.cq_drops += 1;
                }
            }
            972..=999 => {
                let c = self.rng.below(self.cqs.len() as u64) as usize;
                if self.cqs[c].is_none() {
                    self.create_cq(c);
                }
            }
            _ => {}
        }
    }

    /// Drops everything in a random order and checks that nothing leaked.
    fn finish(mut self) {
        self.check_res();
        while self.qps.iter().any(Option::is_some) || self.cqs.iter().any(Option::is_some) {
            if self.rng.chance(50) {
                let s = self.rng.below(self.qps.len() as u64) as usize;
                if self.qps[s].is_some() {
                    self.drop_qp(s);
                }
            } else {
                let c = self.rng.below(self.cqs.len() as u64) as usize;
                if self.rng.chance(50) && self.cqs[c].is_some() {
                    self.poll(c);
                }
                self.cqs[c] = None;
            }
        }
        self.check_res();
        for (i, (t, _)) in std::mem::take(&mut self.templates).into_iter().enumerate() {
            match t.try_unfreeze() {
                Ok(mr) => drop(mr),
                Err(_) => fail!("template {i}: a clone of the SharedMr leaked"),
            }
        }
        self.hdr_pool.clear();
        self.recv_pool.clear();
        let now = res_counts(&self.dev);
        for k in ["mr", "qp", "cq", "pd"] {
            check!(
                now[k] == self.base[k],
                "{k} count {} after everything was dropped, baseline {}",
                now[k],
                self.base[k]
            );
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Panics the test injects are expected; anything else is reported with the seed.
fn quiet_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied());
        if msg == Some(INJECTED) {
            return;
        }
        eprintln!(
            "lifecycle: panic at seed={} step={}",
            SEED.load(Ordering::Relaxed),
            STEP.load(Ordering::Relaxed)
        );
        default(info);
    }));
}

fn run(seed: u64, steps: u64) {
    let start = Instant::now();
    let mut m = Model::new(seed);
    println!(
        "lifecycle: seed={seed} ({SEED_ENV}={seed}) steps={steps} qps={} cqs={} device={}",
        m.qps.len(),
        m.cqs.len(),
        m.dev
    );
    for i in 0..steps {
        STEP.store(i, Ordering::Relaxed);
        m.step();
        if i % 1000 == 999 {
            m.check_res();
        }
    }
    STEP.store(steps, Ordering::Relaxed);
    let s = std::mem::take(&mut m.stats);
    m.finish();
    println!(
        "lifecycle: seed={seed} steps={steps} done in {:.1?}: {} sends, {} receives posted; \
         {} completions ({} flushed, {} stale), {} retired handed back, {} lost after poll_raw \
         ({} raw), {} queue-full refusals, {} injected panics, {} resets ({} refused), \
         {} connects, {} CqTooSmall, {} QP drops, {} CQ drops, {} resource checks",
        start.elapsed(),
        s.posted_send,
        s.posted_recv,
        s.completions,
        s.flushed,
        s.stale,
        s.retired,
        s.lost,
        s.raw,
        s.queue_full,
        s.panics,
        s.resets,
        s.refused_resets,
        s.connects,
        s.cq_too_small,
        s.qp_drops,
        s.cq_drops,
        s.res_checks + 1,
    );
}

#[test]
fn random_lifecycle() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let seed = env_u64(SEED_ENV).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64
    });
    let steps = env_u64(STEPS_ENV).unwrap_or(10_000);
    SEED.store(seed, Ordering::Relaxed);
    quiet_injected_panics();
    TRACE.store(
        env_u64("RDMA_VERBS_LIFECYCLE_TRACE").is_some_and(|v| v != 0),
        Ordering::Relaxed,
    );
    // Watchdog: nothing may block; a wedged run fails with its seed.
    let limit =
        Duration::from_secs(env_u64("RDMA_VERBS_LIFECYCLE_WATCHDOG_S").unwrap_or(60 + steps / 50));
    let (done, wait) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = wait.recv_timeout(limit) {
            eprintln!(
                "lifecycle: watchdog: seed={} stuck at step {} after {limit:?}",
                SEED.load(Ordering::Relaxed),
                STEP.load(Ordering::Relaxed)
            );
            std::process::exit(3);
        }
    });
    run(seed, steps);
    let _ = done.send(());
}

/// The memcheck run: this binary's `random_lifecycle` again, under valgrind,
/// with fewer steps (`RDMA_VERBS_LIFECYCLE_VALGRIND_STEPS`, default 2,000;
/// about 30 s in the soft-RoCE guest). Any memcheck error, definite leak or
/// test failure fails it; the seed is printed by the child.
#[test]
fn random_lifecycle_under_valgrind() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let steps = env_u64("RDMA_VERBS_LIFECYCLE_VALGRIND_STEPS").unwrap_or(2_000);
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = std::process::Command::new("valgrind");
    cmd.args([
        // No gdbserver pipes: valgrind cannot create them on every file
        // system the guest has (e.g. a checkout under the host's /tmp).
        "--vgdb=no",
        "--error-exitcode=99",
        "--leak-check=full",
        "--errors-for-leak-kinds=definite,indirect",
        "--show-leak-kinds=definite,indirect",
    ]);
    cmd.arg(&exe)
        .args([
            "random_lifecycle",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STEPS_ENV, steps.to_string());
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => panic!("cannot run valgrind ({e}); `cargo xtask setup` installs it"),
    };
    let end = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for valgrind") {
            break s;
        }
        if Instant::now() > end {
            let _ = child.kill();
            panic!("valgrind run of {steps} steps did not finish in 600 s");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        status.success(),
        "valgrind run of random_lifecycle ({steps} steps) failed: {status} (99: memcheck errors; see the seed above)"
    );
}

/// `wrs` as an iterator that panics (with [`INJECTED`]) when asked for item `p`.
fn panicking_at<W>(wrs: Vec<W>, p: u64) -> impl Iterator<Item = W> {
    let mut k = 0;
    let mut it = wrs.into_iter();
    std::iter::from_fn(move || {
        if k == p {
            panic!("{INJECTED}");
        }
        k += 1;
        it.next()
    })
}

// --- Library issues the random walk found, as minimal regression tests. ---

fn small_caps(send: u32, recv: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        ..QpCaps::default()
    }
}

/// Drains whatever `cq` delivers within `window`.
fn drain_for(cq: &mut Cq, window: Duration) -> Vec<Completion> {
    let mut out = Vec::with_capacity(64);
    let end = Instant::now() + window;
    while Instant::now() < end {
        if cq.poll(&mut out).expect("poll") == 0 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    out
}

/// An unsignaled send that completed successfully produces no completion,
/// not even after `to_error`; it used to stay in the ring so that `reset` was
/// refused forever. `to_error` now posts a drain marker whose (invisible)
/// completion retires it: ERR, poll, RESET works.
#[test]
fn reset_after_a_completed_unsignaled_send() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut p = common::pair_with(small_caps(4, 4), |_, _, b| {
        b.post_recv(RecvWr::empty(0)).unwrap();
    });
    p.a.post_send(SendWr::send(1).signaled(false)).unwrap();
    // The receiver got it: the send is complete on the wire.
    assert_eq!(common::wait(&mut p.cq_b, 1)[0].status, WcStatus::Success);
    let a = p.a.to_error().unwrap();
    assert_eq!(a.outstanding(), (2, 0), "the send and the drain marker");
    let flushed = drain_for(&mut p.cq_a, Duration::from_millis(300));
    assert!(
        flushed.is_empty(),
        "the marker is not handed out: {flushed:?}"
    );
    assert_eq!(a.outstanding(), (0, 0));
    match a.reset() {
        Ok(_) => {}
        Err(e) => panic!(
            "reset of an ERR QP with nothing left to complete: {}",
            e.error
        ),
    }
}

/// A list post that runs out of queue room posts the requests that fit and
/// hands back the refused one without pulling the caller's iterator again:
/// a panicking (or endless) iterator beyond that point is never reached.
#[test]
fn a_list_post_refused_for_room_stops_pulling_the_iterator() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let mut p = common::pair_with(small_caps(2, 8), |_, _, b| {
        b.post_recv_list((0..8).map(RecvWr::empty)).unwrap();
    });
    let mut k = 0;
    let r = p.a.post_send_list(std::iter::from_fn(|| {
        k += 1;
        if k == 4 {
            panic!("pulled after the refusal");
        }
        Some(SendWr::send(k))
    }));
    match r {
        Err(e) => {
            assert!(matches!(e.error, Error::QueueFull { depth: 2, .. }), "{e}");
            let ids: Vec<u64> = e.unposted.iter().map(|(id, _)| *id).collect();
            assert_eq!(ids, [3], "only the refused request comes back");
        }
        Ok(()) => panic!("a depth-2 queue took three requests"),
    }
    assert_eq!(k, 3, "the iterator was not pulled after the refusal");
    let done: Vec<u64> = common::wait(&mut p.cq_a, 2)
        .iter()
        .map(|c| c.wr_id)
        .collect();
    assert_eq!(done, [1, 2], "the two that fit were posted");
}
