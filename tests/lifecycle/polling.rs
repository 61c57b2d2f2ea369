//! The model polling: the completions each CQ will certainly deliver, checking each against
//! its prediction, and draining a QP.

use super::*;

impl Model {
    /// Completions the CQ `id` will certainly deliver: signaled sends, and
    /// receives that are flushed or have their message posted already; of
    /// QPs whose completions no poll_raw consumed.
    pub(super) fn certain(&self, id: u64) -> usize {
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

    pub(super) fn poll(&mut self, c: usize) {
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
            4..=5 => {
                let cap = self.rng.range(1, 6) as usize;
                out = Vec::with_capacity(cap);
                retired.reserve(self.rng.below(3) as usize);
                self.cqs[c]
                    .as_mut()
                    .unwrap()
                    .cq
                    .poll_with_retired(&mut out, &mut retired)
            }
            6 => {
                // One by one, regrouped per request as poll_with_retired
                // lists them (every request of the model has a buffer, and
                // its own wr_id).
                out = Vec::with_capacity(self.rng.range(1, 6) as usize);
                let cq = &mut self.cqs[c].as_mut().unwrap().cq;
                cq.poll_recycling(&mut out, |id, b| match retired.last_mut() {
                    Some((last, bufs)) if *last == id => bufs.push(b),
                    _ => {
                        let mut bufs = Sges::default();
                        bufs.push(b);
                        retired.push((id, bufs));
                    }
                })
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
    pub(super) fn check_reserved(&self, c: usize) {
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

    pub(super) fn process(
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
    pub(super) fn drain(&mut self, slot: usize) {
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
}
