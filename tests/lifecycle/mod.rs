//! The model of the random-lifecycle test: the QPs, CQs and buffers it drives and what it
//! predicts of each (`tests/vm_lifecycle.rs` runs it; docs/lifecycle.md describes it).

use super::*;

/// splitmix64.
struct Rng(u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (n > 0).
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub(super) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
    pub(super) fn chance(&mut self, percent: u64) -> bool {
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
    Err(Qp<Rc, rdma_verbs::qp::ErrorState>),
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
    pub(super) fn name(&self) -> &'static str {
        match self {
            AnyQp::Reset(_) => "RESET",
            AnyQp::Init(_) => "INIT",
            AnyQp::Rts(_) => "RTS",
            AnyQp::Err(_) => "ERR",
        }
    }
    pub(super) fn into_error(self) -> AnyQp {
        let moved = match self {
            AnyQp::Reset(_) => fail!("to_error from RESET (the types do not offer it)"),
            AnyQp::Init(q) => q.to_error().map_err(|e| e.error),
            AnyQp::Rts(q) => q.to_error().map_err(|e| e.error),
            AnyQp::Err(q) => q.to_error().map_err(|e| e.error),
        };
        match moved {
            Ok(q) => AnyQp::Err(q),
            Err(e) => fail!("to_error refused: {e}"),
        }
    }
    /// `reset`, handing back the QP unchanged (and the error) when refused.
    pub(super) fn reset(self) -> (AnyQp, Option<Error>) {
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
    pub(super) fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        match self {
            AnyQp::Init(q) => q.post_recv(wr),
            AnyQp::Rts(q) => q.post_recv(wr),
            _ => unreachable!("model posts receives only in INIT/RTR/RTS"),
        }
    }
    pub(super) fn post_recv_list(
        &mut self,
        wrs: impl IntoIterator<Item = RecvWr>,
    ) -> Result<(), PostError> {
        match self {
            AnyQp::Init(q) => q.post_recv_list(wrs),
            AnyQp::Rts(q) => q.post_recv_list(wrs),
            _ => unreachable!("model posts receives only in INIT/RTR/RTS"),
        }
    }
    pub(super) fn can_recv(&self) -> bool {
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
    /// Vec headers, pool buffers and memory windows (`memory.rs`).
    mem: memory::Memory,
}

fn wr_id(inst: u64, recv: bool, n: u64) -> u64 {
    (inst << 40) | (u64::from(recv) << 39) | (n & ((1 << 39) - 1))
}

fn wr_parts(id: u64) -> (u64, bool) {
    (id >> 40, id & (1 << 39) != 0)
}

impl Model {
    pub(super) fn new(seed: u64) -> Model {
        let mut rng = Rng(seed);
        let ctx = ctx();
        let pd = Pd::new(&ctx).expect("pd");
        let dev = ctx.name().to_owned();
        let gid = gid_index(&ctx);
        let base = res_counts(&dev);
        let mem = memory::Memory::new(&pd, seed);
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
            mem,
        }
    }

    pub(super) fn link_of(&self, slot: usize) -> usize {
        self.links
            .iter()
            .position(|&(a, b, _)| a == slot || b == slot)
            .unwrap()
    }

    pub(super) fn peer_of(&self, slot: usize) -> usize {
        let (a, b, _) = self.links[self.link_of(slot)];
        if a == slot { b } else { a }
    }

    pub(super) fn hdr_mr(&mut self) -> Mr {
        if let Some(mr) = self.owned_hdr() {
            return mr;
        }
        self.hdr_pool
            .pop()
            .unwrap_or_else(|| self.pd.alloc_mr(HDR, AccessFlags::empty()).unwrap())
    }

    pub(super) fn recv_mr(&mut self) -> Mr {
        if let Some(mr) = self.pool_buf() {
            return mr;
        }
        self.recv_pool.pop().unwrap_or_else(|| {
            self.pd
                .alloc_mr(RECV_LEN, AccessFlags::LOCAL_WRITE)
                .unwrap()
        })
    }

    pub(super) fn give_back(&mut self, mr: Mr) {
        // Keep the pools bounded; the rest is deregistered (and counted).
        let taken = if mr.len() == HDR {
            self.take_back_hdr(mr)
        } else {
            self.put_back_recv(mr)
        };
        let Some(mr) = taken else {
            return;
        };
        if mr.len() == HDR {
            if self.hdr_pool.len() < 64 {
                self.hdr_pool.push(mr);
            }
        } else if self.recv_pool.len() < 64 {
            self.recv_pool.push(mr);
        }
    }

    pub(super) fn cq_index(&self, id: u64) -> Option<usize> {
        self.cqs
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| c.id == id))
    }
}

// After `each!`, which they use.
mod memory;
mod polling;
mod posting;
mod resources;
mod walk;

pub(crate) use walk::run;
