//! The model's application-owned memory: headers registered in place from a `Vec` and
//! taken back, receive buffers out of an `MrPool`, and memory windows on a QP of their
//! own, allocated, bound, invalidated and dropped in random orders relative to that QP and
//! their regions.

use super::*;
use rdma_verbs::mr::MrPool;
use rdma_verbs::mw::{Mw, MwType};

/// Buffers in the model's receive pool.
const POOL_BUFS: usize = 16;
/// Bytes of a window's region.
const REGION_LEN: usize = 8192;

#[derive(Default)]
pub(super) struct MemStats {
    owned_registered: u64,
    owned_back: u64,
    pool_gets: u64,
    pool_puts: u64,
    foreign_refused: u64,
    binds: u64,
    invalidations: u64,
    mw_drops: u64,
    region_drops: u64,
    wqp_drops: u64,
}

/// A window and the ids of every region it was ever bound to (it holds them).
struct Window {
    mw: Mw,
    holds: HashSet<u64>,
}

impl Window {
    /// A type 2 window bound (through the windows' QP) and not invalidated:
    /// rxe holds a reference to that QP until the window is invalidated or
    /// deallocated.
    fn bound_type2(&self) -> bool {
        self.mw.mw_type() == MwType::Type2 && self.mw.remote().is_some()
    }
}

/// The windows' QP (connected to itself) and its CQ.
struct WinQp {
    qp: Qp<Rc, Rts>,
    cq: Cq,
}

pub(super) struct Memory {
    /// `RDMA_VERBS_LIFECYCLE_MEMORY`: unset (or `all`), every memory step;
    /// `owned`, the Vec headers and pool buffers without the windows; `0`,
    /// none (docs/lifecycle.md).
    owned_on: bool,
    windows_on: bool,
    /// Draws of its own: the rest of the walk is the same for a seed with or
    /// without these steps, so a failing seed can be replayed without them.
    rng: Rng,
    pool: Option<MrPool>,
    pool_range: (u64, u64),
    /// Regions windows may be bound to, with their ids.
    regions: Vec<(u64, Mr)>,
    windows: Vec<Window>,
    wqp: Option<WinQp>,
    /// Regions of windows dropped while the windows' QP lives: the QP's send
    /// ring may still hold such a window (a request holds its window until
    /// its slot is reused or the QP is destroyed), and the window its
    /// regions, so they may or may not be registered still.
    lingering: HashSet<u64>,
    next_region: u64,
    next_wr: u64,
    pub(super) stats: MemStats,
}

impl Memory {
    pub(super) fn new(pd: &Pd, seed: u64) -> Memory {
        let pool = MrPool::new(pd, RECV_LEN, POOL_BUFS, AccessFlags::LOCAL_WRITE).unwrap();
        let first = pool.get().unwrap();
        let start = first.addr();
        pool.put(first).unwrap();
        let knob = std::env::var("RDMA_VERBS_LIFECYCLE_MEMORY").unwrap_or_default();
        Memory {
            owned_on: knob != "0",
            windows_on: knob != "0" && knob != "owned",
            rng: Rng(seed ^ 0x6d65_6d6f_7279),
            pool: Some(pool),
            pool_range: (start, start + (RECV_LEN * POOL_BUFS) as u64),
            regions: Vec::new(),
            windows: Vec::new(),
            wqp: None,
            lingering: HashSet::new(),
            next_region: 0,
            next_wr: 0,
            stats: MemStats::default(),
        }
    }

    fn pool(&self) -> &MrPool {
        self.pool.as_ref().expect("the pool lives until finish")
    }

    /// Ends the pool's registration (every buffer is back or dropped by now).
    pub(super) fn drop_pool(&mut self) {
        self.pool = None;
    }

    pub(super) fn in_pool(&self, addr: u64) -> bool {
        (self.pool_range.0..self.pool_range.1).contains(&addr)
    }

    /// Registrations the memory model holds for certain (the pool's, the
    /// regions and every region a window keeps), and how many more may be
    /// alive (lingering in the windows' QP).
    pub(super) fn registrations(&self) -> (u64, u64) {
        let mut ids: HashSet<u64> = self.regions.iter().map(|r| r.0).collect();
        for w in &self.windows {
            ids.extend(&w.holds);
        }
        let maybe = self.lingering.difference(&ids).count() as u64;
        (u64::from(self.pool.is_some()) + ids.len() as u64, maybe)
    }

    /// Drops the windows' QP, after every type 2 window still bound through
    /// it: rxe's `ibv_destroy_qp` (kernel 6.1) waits about 50 s for the QP
    /// reference such a window holds, so an application invalidates or drops
    /// those windows first (`memory_step` invalidates some of them).
    fn drop_wqp(&mut self) {
        let mut i = 0;
        while i < self.windows.len() {
            if self.windows[i].bound_type2() {
                self.drop_window(i);
                self.stats.mw_drops += 1;
            } else {
                i += 1;
            }
        }
        trace!(
            "memory: drop the window QP ({} windows left)",
            self.windows.len()
        );
        self.wqp = None;
        trace!("memory: window QP dropped");
        self.lingering.clear();
    }

    fn drop_window(&mut self, i: usize) {
        let w = self.windows.swap_remove(i);
        trace!(
            "memory: drop window {i} ({:?}, bound {})",
            w.mw.mw_type(),
            w.mw.remote().is_some()
        );
        if self.wqp.is_some() {
            self.lingering.extend(w.holds);
        }
    }

    /// QPs and CQs of the windows.
    pub(super) fn qps_cqs(&self) -> (u64, u64) {
        let n = u64::from(self.wqp.is_some());
        (n, n)
    }

    pub(super) fn summary(&self) -> String {
        let s = &self.stats;
        format!(
            "{} Vec headers registered ({} taken back), {} pool gets, {} puts, {} foreign \
             buffers refused, {} window binds, {} invalidations, {} window drops, {} region \
             drops, {} window-QP drops",
            s.owned_registered,
            s.owned_back,
            s.pool_gets,
            s.pool_puts,
            s.foreign_refused,
            s.binds,
            s.invalidations,
            s.mw_drops,
            s.region_drops,
            s.wqp_drops
        )
    }

    /// Drops everything in a random order.
    pub(super) fn finish(&mut self) {
        while self.wqp.is_some() || !self.windows.is_empty() || !self.regions.is_empty() {
            match self.rng.below(3) {
                0 => self.drop_wqp(),
                1 if !self.windows.is_empty() => {
                    let i = self.rng.below(self.windows.len() as u64) as usize;
                    self.drop_window(i);
                }
                _ if !self.regions.is_empty() => {
                    let i = self.rng.below(self.regions.len() as u64) as usize;
                    self.regions.swap_remove(i);
                }
                _ => {}
            }
        }
    }
}

impl Model {
    /// A header buffer: sometimes a `Vec` registered in place.
    pub(super) fn owned_hdr(&mut self) -> Option<Mr> {
        if !self.mem.owned_on || !self.mem.rng.chance(20) {
            return None;
        }
        let mr = Mr::register(&self.pd, vec![0u8; HDR], AccessFlags::empty())
            .unwrap_or_else(|e| fail!("register a Vec: {e}"));
        self.mem.stats.owned_registered += 1;
        Some(mr)
    }

    /// A receive buffer: sometimes one of the pool's.
    pub(super) fn pool_buf(&mut self) -> Option<Mr> {
        if !self.mem.owned_on || !self.mem.rng.chance(30) {
            return None;
        }
        let mr = self.mem.pool().get()?;
        check!(mr.len() == RECV_LEN, "pool buffer of {} bytes", mr.len());
        self.mem.stats.pool_gets += 1;
        Some(mr)
    }

    /// A header came back: sometimes take its `Vec` back. A buffer
    /// registered in place comes back whole and alone (the ring gave up its
    /// handle); one from `Mr::new` is refused, unchanged.
    pub(super) fn take_back_hdr(&mut self, mr: Mr) -> Option<Mr> {
        if !self.mem.rng.chance(40) {
            return Some(mr);
        }
        match mr.into_buffer::<Vec<u8>>() {
            Ok(v) => {
                check!(
                    v.len() == HDR && v[0..4] == MAGIC.to_le_bytes(),
                    "a header Vec came back as {v:?}"
                );
                self.mem.stats.owned_back += 1;
                None
            }
            Err(r) => {
                let reason = format!("{}", r.error);
                check!(
                    reason.contains("not registered with Mr::register"),
                    "into_buffer of a returned header: {reason}"
                );
                Some(r.mr)
            }
        }
    }

    /// A receive buffer came back: a pool buffer goes back to the pool; a
    /// buffer of `Mr::new` offered to the pool is refused and kept.
    pub(super) fn put_back_recv(&mut self, mr: Mr) -> Option<Mr> {
        if self.mem.in_pool(mr.addr()) {
            if let Err(r) = self.mem.pool().put(mr) {
                fail!("the pool refused its own buffer: {}", r.error);
            }
            self.mem.stats.pool_puts += 1;
            return None;
        }
        if self.mem.rng.chance(10) {
            return match self.mem.pool().put(mr) {
                Ok(()) => fail!("the pool took a buffer of another registration"),
                Err(r) => {
                    self.mem.stats.foreign_refused += 1;
                    Some(r.mr)
                }
            };
        }
        Some(mr)
    }

    /// After each step of the walk: now and then, one step of the windows.
    pub(super) fn memory_tick(&mut self) {
        if self.mem.windows_on && self.mem.rng.chance(2) {
            self.memory_step();
        }
    }

    /// One random step of the windows.
    fn memory_step(&mut self) {
        let a = self.mem.rng.below(10);
        trace!(
            "memory {a}: {} windows, {} regions, window QP {}",
            self.mem.windows.len(),
            self.mem.regions.len(),
            self.mem.wqp.is_some()
        );
        match a {
            0 if self.mem.wqp.is_none() => self.mem.wqp = Some(self.win_qp()),
            0 => {
                // Some of the bound type 2 windows are invalidated and live on;
                // `drop_wqp` drops the others.
                for wi in 0..self.mem.windows.len() {
                    if self.mem.windows[wi].bound_type2() && self.mem.rng.chance(50) {
                        self.revoke_at(wi);
                    }
                }
                self.mem.drop_wqp();
                self.mem.stats.wqp_drops += 1;
            }
            1 | 2 if self.mem.regions.len() < 3 => {
                let access = AccessFlags::LOCAL_WRITE
                    | AccessFlags::REMOTE_READ
                    | AccessFlags::REMOTE_WRITE
                    | AccessFlags::MW_BIND;
                let mr = Mr::new(&self.pd, REGION_LEN, access).unwrap();
                self.mem.regions.push((self.mem.next_region, mr));
                self.mem.next_region += 1;
            }
            1 | 2 => {
                let i = self.mem.rng.below(self.mem.regions.len() as u64) as usize;
                self.mem.regions.swap_remove(i);
                self.mem.stats.region_drops += 1;
            }
            3 if self.mem.windows.len() < 3 => {
                let ty = if self.mem.rng.chance(50) {
                    MwType::Type1
                } else {
                    MwType::Type2
                };
                let mw = Mw::new(&self.pd, ty).unwrap_or_else(|e| fail!("alloc mw: {e}"));
                self.mem.windows.push(Window {
                    mw,
                    holds: HashSet::new(),
                });
            }
            3 | 4 if !self.mem.windows.is_empty() => {
                let i = self.mem.rng.below(self.mem.windows.len() as u64) as usize;
                self.mem.drop_window(i);
                self.mem.stats.mw_drops += 1;
            }
            5..=7 => self.bind(),
            8 | 9 => self.revoke(),
            _ => {}
        }
    }

    fn win_qp(&mut self) -> WinQp {
        let cq = Cq::new(&self.ctx, 16).unwrap();
        let caps = QpCaps {
            max_send_wr: 4,
            max_recv_wr: 1,
            ..QpCaps::default()
        };
        let qp = Qp::new(&self.pd, &cq, &cq, caps)
            .and_then(|q| q.init(InitAttr::new(1, all_remote())).map_err(|e| e.error))
            .unwrap_or_else(|e| fail!("window QP: {e}"));
        let ep = qp.endpoint(Some(self.gid)).unwrap();
        let qp = qp
            .connect(&ep, Some(self.gid))
            .unwrap_or_else(|e| fail!("connect window QP: {e}"));
        WinQp { qp, cq }
    }

    /// Binds a random window to a random range of a random region and
    /// waits for the bind's completion.
    fn bind(&mut self) {
        let m = &mut self.mem;
        let (Some(w), false, false) = (m.wqp.as_mut(), m.windows.is_empty(), m.regions.is_empty())
        else {
            return;
        };
        let wi = m.rng.below(m.windows.len() as u64) as usize;
        let ri = m.rng.below(m.regions.len() as u64) as usize;
        let start = m.rng.below(REGION_LEN as u64 / 2) as usize;
        let end = start + 1 + m.rng.below((REGION_LEN - start) as u64 - 1) as usize;
        let (id, region) = &m.regions[ri];
        let win = &mut m.windows[wi];
        if win.bound_type2() {
            // A bound type 2 window must be invalidated before it is bound again.
            return;
        }
        let wr = m.next_wr;
        m.next_wr += 1;
        let access = AccessFlags::REMOTE_READ;
        let remote =
            w.qp.post_bind_mw(wr, &mut win.mw, region, start..end, access)
                .unwrap_or_else(|e| fail!("bind: {}", e.error));
        win.holds.insert(*id);
        check!(
            remote.addr == region.addr() + start as u64 && remote.len == (end - start) as u64,
            "bind returned {remote:?}"
        );
        let mut out = Vec::new();
        w.cq.poll_n(&mut out, 1, WAIT)
            .unwrap_or_else(|e| fail!("bind completion: {e}"));
        check!(
            out[0].status == WcStatus::Success && out[0].wr_id == wr,
            "bind completed {:?}",
            out[0]
        );
        m.stats.binds += 1;
    }

    /// Revokes a random bound window: LOCAL_INV (type 2) or a zero-length
    /// bind (type 1), and waits for its completion.
    fn revoke(&mut self) {
        if self.mem.wqp.is_none() || self.mem.windows.is_empty() {
            return;
        }
        let wi = self.mem.rng.below(self.mem.windows.len() as u64) as usize;
        self.revoke_at(wi);
    }

    /// Revokes window `wi` if it is bound, and waits for the completion.
    fn revoke_at(&mut self, wi: usize) {
        let m = &mut self.mem;
        let (Some(w), win) = (m.wqp.as_mut(), &mut m.windows[wi]) else {
            return;
        };
        if win.mw.remote().is_none() {
            return;
        }
        let wr = m.next_wr;
        m.next_wr += 1;
        let (posted, opcode) = match win.mw.mw_type() {
            MwType::Type2 => (w.qp.post_local_inv(wr, &mut win.mw), WcOpcode::LocalInv),
            _ => (w.qp.post_unbind_mw(wr, &mut win.mw), WcOpcode::BindMw),
        };
        posted.unwrap_or_else(|e| fail!("revoke: {}", e.error));
        let mut out = Vec::new();
        w.cq.poll_n(&mut out, 1, WAIT)
            .unwrap_or_else(|e| fail!("revoke completion: {e}"));
        check!(
            out[0].status == WcStatus::Success && out[0].wr_id == wr && out[0].opcode == opcode,
            "revoke completed {:?}",
            out[0]
        );
        m.stats.invalidations += 1;
    }
}
