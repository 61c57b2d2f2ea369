//! The model's resources: creating and dropping CQs and QPs, breaking a link, and each QP
//! state transition.

use super::*;

impl Model {
    pub(super) fn create_cq(&mut self, i: usize) {
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

    pub(super) fn create_qp(&mut self, slot: usize) {
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
    pub(super) fn drop_qp(&mut self, slot: usize) {
        self.break_link(slot);
        let q = self.qps[slot].take().unwrap();
        self.destroyed_qpns.insert(q.qpn);
        trace!("slot {slot}: drop qpn {} ({})", q.qpn, q.qp.name());
        drop(q.qp);
        trace!("slot {slot}: dropped");
        self.stats.qp_drops += 1;
    }

    /// The link of `slot` is no longer healthy: move a peer in RTR/RTS to ERR
    /// (so it never waits on a QP that stopped answering).
    pub(super) fn break_link(&mut self, slot: usize) {
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

    pub(super) fn err_now(&mut self, slot: usize) {
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
    pub(super) fn take_drained(&mut self, id: u64) -> Option<Entry> {
        let q = self.qps.iter_mut().flatten().find(|q| {
            q.sq.fifo
                .front()
                .is_some_and(|e| e.wr_id == id && e.drain_covered)
        })?;
        q.sq.fifo.pop_front()
    }

    /// Signaled sends a drain marker polled just now swept (their own
    /// completions were consumed by poll_raw): the library reports them lost.
    pub(super) fn marker_swept_signaled(&self, cq_id: u64) -> u64 {
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
    pub(super) fn sync_drained(&mut self, cq_id: u64) {
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

    pub(super) fn err(&mut self, slot: usize) {
        if matches!(self.qps[slot].as_ref().unwrap().qp, AnyQp::Err(_)) {
            return;
        }
        if matches!(self.qps[slot].as_ref().unwrap().qp, AnyQp::Reset(_)) {
            // The kernel refuses RESET -> ERR (ib_modify_qp_is_ok), and the types
            // say so: `Qp<_, Reset>` has no `to_error` (tests/ui/to_error_in_reset.rs).
            return;
        }
        self.err_now(slot);
        self.break_link(slot);
    }

    pub(super) fn reset(&mut self, slot: usize) {
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
    pub(super) fn recover(&mut self, l: usize) {
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

    pub(super) fn init(&mut self, slot: usize) {
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
    pub(super) fn connect(&mut self, l: usize) {
        let (a, b, _) = self.links[l];
        for s in [a, b] {
            if matches!(self.qps[s].as_ref().unwrap().qp, AnyQp::Reset(_)) {
                self.init(s);
            }
        }
        let gid = self.gid;
        let ep = |m: &Model, s: usize| -> rdma_verbs::qp::Endpoint {
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
}
