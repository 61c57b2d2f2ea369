//! The random walk: the kernel's resource counts, one random step, the final check, and a
//! whole run.

use super::*;

impl Model {
    // ------------------------------------------------------------------
    // Kernel resources
    // ------------------------------------------------------------------

    /// Registrations of ours: the templates, every header and receive
    /// buffer not out of the `MrPool` (in the model's pools or in a ring)
    /// and the memory model's (the pool's one, regions); and how many more
    /// may still be alive (regions of dropped windows a QP may still hold).
    pub(super) fn expected_mrs(&self) -> (u64, u64) {
        let in_rings = self
            .qps
            .iter()
            .flatten()
            .flat_map(|q| q.sq.fifo.iter().chain(&q.rq.fifo))
            .filter(|e| !self.mem.in_pool(e.owned_addr))
            .count();
        let pooled = self.hdr_pool.len() + self.recv_pool.len();
        let (mem, maybe) = self.mem.registrations();
        (
            (self.templates.len() + pooled + in_rings) as u64 + mem,
            maybe,
        )
    }

    pub(super) fn check_res(&mut self) {
        let now = res_counts(&self.dev);
        let mut cq_ids: HashSet<u64> = self.cqs.iter().flatten().map(|c| c.id).collect();
        for q in self.qps.iter().flatten() {
            cq_ids.insert(q.send_cq);
            cq_ids.insert(q.recv_cq);
        }
        let (mem_qps, mem_cqs) = self.mem.qps_cqs();
        let (mrs, maybe) = self.expected_mrs();
        let got = now["mr"] - self.base["mr"];
        check!(
            (mrs..=mrs + maybe).contains(&got),
            "kernel has {got} mrs of ours, model {mrs} (+ up to {maybe} held by dropped windows)"
        );
        let want = [
            ("qp", self.qps.iter().flatten().count() as u64 + mem_qps),
            ("cq", cq_ids.len() as u64 + mem_cqs),
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

    pub(super) fn step(&mut self) {
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
    pub(super) fn finish(mut self) {
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
        self.mem.finish();
        self.check_res();
        for (i, (t, _)) in std::mem::take(&mut self.templates).into_iter().enumerate() {
            match t.try_unfreeze() {
                Ok(mr) => drop(mr),
                Err(_) => fail!("template {i}: a clone of the SharedMr leaked"),
            }
        }
        self.hdr_pool.clear();
        self.recv_pool.clear();
        self.mem.drop_pool();
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

pub(crate) fn run(seed: u64, steps: u64) {
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
        m.memory_tick();
        if i % 1000 == 999 {
            m.check_res();
        }
    }
    STEP.store(steps, Ordering::Relaxed);
    let s = std::mem::take(&mut m.stats);
    let mem = m.mem.summary();
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
    println!("lifecycle: memory: {mem}");
}
