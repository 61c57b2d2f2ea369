//! The bookkeeping of one [`GpuBuffer::write`](super::GpuBuffer::write): the
//! WRITEs it posts, telling its own completions from others', and what comes
//! back from the NIC.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::cq::{Completion, Cq};
use crate::error::{Error, Result};
use crate::mr::{Mr, RemoteMr};
use crate::qp::{Buffer, PostError, Qp, Rc, Rts, SendWr, Sges};

#[cfg(doc)]
use super::{GpuBuffer, Transfer};

/// The upper 32 bits of every `wr_id` a [`GpuBuffer`] posts ("GDR\0"); the
/// lower 32 bits are a process-wide sequence number.
///
/// The tag is informational: a `GpuBuffer` claims a completion only when its
/// QP number and `wr_id` are those of one of its own WRITEs still in flight
/// **and** the buffer it carries is a piece of one of the `GpuBuffer`'s own
/// registrations. Anything else (your own work requests, also ones whose
/// `wr_id` carries this tag, and another `GpuBuffer`'s WRITEs) is handed back
/// in [`Transfer::others`].
pub const WR_ID_TAG: u64 = 0x4744_5200_0000_0000;
pub(super) const TAG_MASK: u64 = 0xffff_ffff_0000_0000;

/// Sequence numbers for the low half of `wr_id`s, shared by every
/// [`GpuBuffer`] of the process so that two of them on one QP do not reuse
/// each other's `wr_id`s (until it wraps at 2^32, which the buffer check covers).
pub(super) static NEXT_WR_SEQ: AtomicU64 = AtomicU64::new(0);

/// A zero-length piece cut off the end of a registration. Held by the
/// [`GpuBuffer`] for its whole life, it keeps the registration (its `ibv_mr`
/// and the memory behind it) alive however many of the other pieces are lost
/// to a QP, so [`Mr::as_raw`] names this registration and no other for as long
/// as the buffer compares completions against it, and the staging path can
/// unpin the memory before it is freed.
pub(super) struct RegistrationKeepalive(pub(super) Mr);

impl RegistrationKeepalive {
    /// Cuts the keepalive off the end of `mr` (which keeps all of its bytes).
    pub(super) fn cut_from(mr: &mut Mr) -> Result<RegistrationKeepalive> {
        let at = mr.len();
        Ok(RegistrationKeepalive(mr.split_off(at)?))
    }

    /// The registration it keeps, as an address (`Mr::as_raw`).
    pub(super) fn region(&self) -> usize {
        self.0.as_raw() as usize
    }
}

/// One WRITE posted by a [`GpuBuffer`] and not yet seen completing.
pub(super) struct InFlight {
    pub(super) qp_num: u32,
    pub(super) wr_id: u64,
    /// `Mr::as_raw` and `Mr::addr` of the posted piece: unique among the pieces
    /// out, since live pieces of a registration never overlap.
    pub(super) region: usize,
    pub(super) addr: u64,
    /// The `write` that posted it (`GpuBuffer::writes`).
    pub(super) write: u64,
}

/// `base + off`, or an error instead of overflowing.
pub(super) fn offset_by(what: &'static str, base: u64, off: usize) -> Result<u64> {
    base.checked_add(off as u64)
        .ok_or_else(|| Error::InvalidArgument {
            what,
            reason: format!("{base:#x} + {off} overflows"),
        })
}

/// Posting and polling for one `write`.
pub(super) struct WriteLedger {
    pub(super) qp_num: u32,
    /// This write's id (`GpuBuffer::writes`); in-flight entries of older ones
    /// are stale WRITEs of a write that timed out (their buffers are reclaimed).
    pub(super) write: u64,
    /// The buffer's own registrations (`Mr::as_raw`).
    pub(super) regions: Vec<usize>,
    pub(super) in_flight: Vec<InFlight>,
    pub(super) polled: Vec<Completion>,
    pub(super) others: Vec<Completion>,
    pub(super) taken: Vec<(u64, Sges)>,
    pub(super) timeout: Duration,
    pub(super) outstanding: usize,
    pub(super) first_error: Option<Error>,
    /// Buffers back from the NIC (or never posted), to return to the state.
    pub(super) returned: Vec<Mr>,
    pub(super) posted: u64,
    /// A panic from a polled buffer's `Drop` (see [`poll_once`](Self::poll_once)),
    /// resumed by the write once its books are back in the buffer.
    pub(super) panic: Option<Box<dyn Any + Send>>,
}

impl WriteLedger {
    pub(super) fn new(
        qp_num: u32,
        write: u64,
        regions: Vec<usize>,
        in_flight: Vec<InFlight>,
        timeout: Duration,
    ) -> WriteLedger {
        WriteLedger {
            qp_num,
            write,
            regions,
            in_flight,
            // Cq::poll fills up to the capacity: this is the batch size.
            polled: Vec::with_capacity(32),
            others: Vec::new(),
            taken: Vec::new(),
            timeout,
            outstanding: 0,
            first_error: None,
            returned: Vec::new(),
            posted: 0,
            panic: None,
        }
    }

    /// Posts one WRITE of `piece`; when the send queue is full, waits for one of
    /// ours to complete and retries. On failure the piece is in `returned`.
    pub(super) fn post(
        &mut self,
        qp: &mut Qp<Rc, Rts>,
        cq: &mut Cq,
        mut piece: Mr,
        remote: RemoteMr,
        remote_offset: u64,
    ) -> Result<()> {
        let seq = NEXT_WR_SEQ.fetch_add(1, Ordering::Relaxed);
        let wr_id = WR_ID_TAG | (seq & !TAG_MASK);
        let (region, addr) = (piece.as_raw() as usize, piece.addr());
        loop {
            match qp.post_send(SendWr::write(wr_id, remote, remote_offset).sge(piece)) {
                Ok(()) => {
                    self.in_flight.push(InFlight {
                        qp_num: self.qp_num,
                        wr_id,
                        region,
                        addr,
                        write: self.write,
                    });
                    self.outstanding += 1;
                    self.posted += 1;
                    return Ok(());
                }
                Err(PostError { error, unposted }) => {
                    let back = unposted
                        .into_iter()
                        .flat_map(|(_, sges)| sges)
                        .find_map(Buffer::into_mr);
                    match (error, back) {
                        (Error::QueueFull { .. }, Some(mr)) if self.outstanding > 0 => {
                            piece = mr;
                            if let Err(e) = self.wait(cq) {
                                self.returned.push(piece);
                                return Err(e);
                            }
                        }
                        (error, back) => {
                            self.returned.extend(back);
                            return Err(error);
                        }
                    }
                }
            }
        }
    }

    /// The in-flight WRITE that `c` (with buffers `bufs`) completes: same QP
    /// and `wr_id`, and its one buffer is the posted piece of one of our own
    /// registrations.
    fn own_write(&self, c: &Completion, bufs: &Sges) -> Option<usize> {
        let mut it = bufs.iter();
        let (Some(Buffer::Owned(mr)), None) = (it.next(), it.next()) else {
            return None;
        };
        let region = mr.as_raw() as usize;
        if !self.regions.contains(&region) {
            return None;
        }
        self.in_flight.iter().position(|p| {
            p.qp_num == c.qp_num && p.wr_id == c.wr_id && p.region == region && p.addr == mr.addr()
        })
    }

    /// Polls the CQ once. Our completions: buffers to `returned`, stale ones
    /// only reclaimed, the first failure of this write to `first_error`;
    /// everything else to `others`. Returns how many WRITEs of this write completed.
    pub(super) fn poll_once(&mut self, cq: &mut Cq) -> Result<usize> {
        let mut polled = std::mem::take(&mut self.polled);
        polled.clear();
        // A retired buffer whose `Drop` panics makes the poll resume that
        // panic once the CQ's books are consistent, with the completions it
        // read in `polled`: they are taken in here, and the panic is held
        // until the write has put its books back.
        let r = match catch_unwind(AssertUnwindSafe(|| cq.poll(&mut polled))) {
            Ok(r) => r,
            Err(panic) => {
                self.panic.get_or_insert(panic);
                Ok(0)
            }
        };
        let mut ours = 0;
        for mut c in polled.drain(..) {
            // Cheap and non-destructive first: is it one of our wr_ids at all?
            if !self
                .in_flight
                .iter()
                .any(|p| p.qp_num == c.qp_num && p.wr_id == c.wr_id)
            {
                self.others.push(c);
                continue;
            }
            // Then the buffer, which only the work request's poster can hold.
            let bufs = c.take_buffers();
            let Some(i) = self.own_write(&c, &bufs) else {
                if !bufs.is_empty() {
                    self.taken.push((c.wr_id, bufs));
                }
                self.others.push(c);
                continue;
            };
            let p = self.in_flight.swap_remove(i);
            self.returned
                .extend(bufs.into_iter().filter_map(Buffer::into_mr));
            if p.write != self.write {
                continue; // a stale WRITE of an earlier write: reclaimed only
            }
            ours += 1;
            self.outstanding = self.outstanding.saturating_sub(1);
            if let Err(e) = c.result() {
                self.first_error.get_or_insert(e);
            }
        }
        self.polled = polled;
        r.map(|_| ours)
    }

    /// Waits for every WRITE of this write still posted; stops at the first
    /// wait that fails (a timeout) and returns its error.
    pub(super) fn drain(&mut self, cq: &mut Cq) -> Result<()> {
        while self.outstanding > 0 {
            self.wait(cq)?;
        }
        Ok(())
    }

    /// Polls until at least one WRITE of this transfer completes (buffers go to
    /// `returned`, the first failure to `first_error`), or the timeout passes
    /// without one.
    pub(super) fn wait(&mut self, cq: &mut Cq) -> Result<()> {
        let start = Instant::now();
        let mut idle = 0u32;
        loop {
            if self.poll_once(cq)? > 0 {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(Error::Timeout {
                    what: "RDMA WRITE completions of a GPU buffer",
                    after: self.timeout,
                });
            }
            idle += 1;
            if idle % 1024 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
