//! The model posting: building sends and receives, single and as lists (some with an
//! iterator that panics), and what a refused post must hand back.

use super::*;

impl Model {
    /// Receive credits the sender in `slot` has towards its peer (0 unless healthy).
    pub(super) fn credits(&self, slot: usize) -> u64 {
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
    pub(super) fn build_send(&mut self, slot: usize) -> (SendWr<'static>, Entry, (u32, u64)) {
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

    pub(super) fn build_recv(&mut self, slot: usize) -> (RecvWr, Entry) {
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
    pub(super) fn panicking_list_outcome(
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
    pub(super) fn post_outcome(
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

    pub(super) fn unposted(&mut self, e: PostError, want: &[Entry], recv: bool) {
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
    pub(super) fn take_buffers(&mut self, bufs: Sges, w: &Entry, what: &str) -> Option<Mr> {
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

    pub(super) fn post_send(&mut self, slot: usize, list: bool) {
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

    pub(super) fn post_recv(&mut self, slot: usize, list: bool) {
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
}
