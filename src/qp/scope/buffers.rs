//! Buffers lent to one QP for a scope, one request at a time:
//! [`ScopedBuffers`], from [`ScopedQp::buffers`](super::ScopedQp::buffers).

mod list;

use std::marker::PhantomData;
use std::ptr::NonNull;

use super::{ScopedQp, ScopedSend, Src};
use crate::error::{Error, Result, errno};
use crate::ffi;
use crate::mr::{Mr, RemoteMr};
use crate::qp::QpCore;
use crate::qp::state::{CanPostRecv, CanPostSend, QpState};

/// Most buffers one region is carved into (their tables take 64 bytes each).
pub const MAX_SCOPED_BUFFERS: usize = 1 << 16;

/// A region carved into buffers of one QP for the rest of a scope, each lent
/// to the NIC one request at a time: a receive (with its C request prepared
/// once), a SEND or an RDMA WRITE, posted by the buffer's index. Between
/// requests a buffer belongs to Rust again: its bytes can be read once its
/// receive has completed, and written once its send has too, without
/// leaving the scope. This is the buffer of `ibv_rc_pingpong`, which
/// receives a message and sends one from the same memory.
///
/// A [`Dst`](super::Dst) or [`Src`] lends memory until the scope ends;
/// these buffers are lent per request. A QP's own receive queue, and its
/// send queue, complete in order, so a buffer is free again once the scope
/// has polled the completion of its latest request or of a later one of the
/// same queue (a flush included; an unsignaled send is retired by the next
/// signaled one). The sends posted here are all signaled.
///
/// A receive completes only when a message arrives, so the scope waits at
/// its end for receives still posted: it ends with
/// [`Error::ScopeDrained`] after the drain timeout, having moved the QP to
/// the error state to flush them. Post only the receives the scope will
/// consume, or keep the scope open as long as the QP receives. After a
/// failed request has moved the QP to the error state, a receive posted
/// anyway is not flushed by rxe until that drain (see
/// [`Qp::to_error`](crate::qp::Qp::to_error)).
///
/// An echo of one message (the peer sends it, then waits for the answer):
///
/// ```no_run
/// # use rdma_verbs::prelude::*;
/// # use std::time::Duration;
/// # fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mr: &mut Mr) -> Result<()> {
/// cq.scope(|s| -> Result<()> {
///     let q = s.attach(qp)?; // its send and receive queues complete on `cq`
///     let mut bufs = q.buffers(mr, 4096)?;
///     bufs.post_recv(0, 1)?;
///     let c = s.poll_one(Duration::from_secs(5))?;
///     c.result()?;
///     // `byte_len` is what the message wrote into the buffer (for a
///     // `WcOpcode::Recv`; an RDMA WRITE with immediate writes elsewhere).
///     let len = c.byte_len as usize;
///     bufs.bytes_mut(0)?[..len].make_ascii_uppercase();
///     bufs.post_send(0, len, 2)?; // the same buffer, lent again
///     s.poll_one(Duration::from_secs(5))?.result()
/// })
/// # }
/// ```
pub struct ScopedBuffers<'scope, S: QpState> {
    /// The QP, attached to the scope (borrowed for `'scope`).
    core: NonNull<QpCore>,
    /// Its send / receive queue completes on the scope's CQ.
    sq_in_scope: bool,
    rq_in_scope: bool,
    /// One C receive per buffer; each `sg_list` points at its entry of
    /// `sges`, and `next` is null. Only `wr_id` changes, per post.
    recv_wrs: Box<[ffi::ibv_recv_wr]>,
    /// One SGE per buffer (all of it); read by Rust only to build sends.
    sges: Box<[ffi::ibv_sge]>,
    /// For each buffer, one past the sequence number of its latest receive
    /// (0: none): in flight while above the receive queue's tail.
    recv_end: Box<[u64]>,
    /// The same for its latest send-queue request.
    send_end: Box<[u64]>,
    /// Bytes per buffer; buffer `k` is `k * buf_len..(k + 1) * buf_len`.
    buf_len: usize,
    /// The region, borrowed exclusively for the scope: only these buffers
    /// reach it.
    mr: &'scope mut Mr,
    _state: PhantomData<fn() -> S>,
}

/// What keeps a buffer from Rust code or from another request.
#[derive(PartialEq, Eq)]
enum Busy {
    Receiving,
    Sending,
}

impl<'scope, S: QpState> ScopedBuffers<'scope, S> {
    /// The buffers of `mr` (`mr.len() / buf_len` of them) for `core`, whose
    /// send / receive queue completes on the scope's CQ per `sq_in_scope` / `rq_in_scope`.
    pub(super) fn new(
        core: NonNull<QpCore>,
        sq_in_scope: bool,
        rq_in_scope: bool,
        mr: &'scope mut Mr,
        buf_len: usize,
    ) -> Result<ScopedBuffers<'scope, S>> {
        let refuse = |reason: String| {
            Err(Error::InvalidArgument {
                what: "scoped buffers",
                reason,
            })
        };
        if !mr.access().contains(crate::mr::AccessFlags::LOCAL_WRITE) {
            return refuse(
                "the NIC writes them, so their Mr needs AccessFlags::LOCAL_WRITE".into(),
            );
        }
        // SAFETY: the QP is borrowed for 'scope (see `ScopedQp`); read-only.
        let qp_pd = unsafe { &core.as_ref().pd };
        if !std::sync::Arc::ptr_eq(&mr.pd().inner, &qp_pd.inner) {
            return refuse("their Mr is registered in another PD than the QP's".into());
        }
        let length = match u32::try_from(buf_len) {
            Ok(0) | Err(_) => {
                return refuse(format!(
                    "a buffer of {buf_len} bytes (1 to 4 GiB - 1, a scatter entry's limit)"
                ));
            }
            Ok(n) => n,
        };
        let count = mr.len() / buf_len;
        if count == 0 {
            return refuse(format!(
                "the {}-byte Mr holds no {buf_len}-byte buffer",
                mr.len()
            ));
        }
        if count > MAX_SCOPED_BUFFERS {
            return refuse(format!(
                "{count} buffers of {buf_len} bytes; at most {MAX_SCOPED_BUFFERS} (use larger \
                 buffers or a smaller Mr)"
            ));
        }
        let mut sges: Box<[ffi::ibv_sge]> = (0..count)
            .map(|k| ffi::ibv_sge {
                addr: mr.addr() + (k * buf_len) as u64,
                length,
                lkey: mr.lkey(),
            })
            .collect();
        let recv_wrs = sges
            .iter_mut()
            .map(|sge| ffi::ibv_recv_wr {
                wr_id: 0,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: 1,
            })
            .collect();
        Ok(ScopedBuffers {
            core,
            sq_in_scope,
            rq_in_scope,
            recv_wrs,
            sges,
            recv_end: vec![0; count].into_boxed_slice(),
            send_end: vec![0; count].into_boxed_slice(),
            buf_len,
            mr,
            _state: PhantomData,
        })
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.recv_end.len()
    }

    /// Always false: there is at least one buffer.
    pub fn is_empty(&self) -> bool {
        self.recv_end.is_empty()
    }

    /// Bytes per buffer.
    pub fn buf_len(&self) -> usize {
        self.buf_len
    }

    /// Posts a receive into buffer `k`; its completion carries `wr_id`.
    /// Posting a buffer whose receive is in flight is allowed (both receives
    /// write it); it is readable again once the latest has completed.
    /// [`post_recv_list`](Self::post_recv_list) posts several with one verb
    /// call.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `k >= self.len()`, while a SEND or
    /// WRITE of the buffer is in flight, or when the QP's receives do not
    /// complete on the scope's CQ (or come from a shared receive queue);
    /// [`Error::QueueFull`] when the receive queue is full (poll first);
    /// [`Error::Verb`] when the provider refuses it.
    #[inline(always)]
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, k: usize, wr_id: u64) -> Result<()>
    where
        S: CanPostRecv,
    {
        // SAFETY: the QP is borrowed for 'scope by the `ScopedQp` this came
        // from; the scope and its handles use it only during their calls on
        // this thread (none is Send), so this is the only live reference.
        let core = unsafe { &mut *self.core.as_ptr() };
        let head = core.rq_head;
        let ring = &*core.rq;
        let (Some(wr), Some(&send_end), Some(tables)) = (
            self.recv_wrs.get_mut(k),
            self.send_end.get(k),
            core.ext.scoped.as_deref_mut(),
        ) else {
            return Err(self.refused(k));
        };
        if !self.rq_in_scope
            || ring.in_flight(head) >= ring.depth()
            || (send_end != 0 && send_end > core.sq.tail())
            || tables.rq_listing
        {
            return Err(self.refused(k));
        }
        // SAFETY: `index` masks with the ring's slot count, the table's length.
        unsafe { *tables.rq.get_unchecked_mut(ring.index(head)) = wr_id };
        wr.wr_id = ring.token(head);
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; one request whose SGE names buffer `k` of a region
        // borrowed exclusively for 'scope, which outlives every request
        // posted in the scope; only this type reaches it, and it lends the
        // buffer to Rust only while no request of it is in flight.
        let rc = unsafe { crate::qp::post::ibv_post_recv(core.raw.as_ptr(), wr, &mut bad) };
        // As for sends: a provider that does not say it refused the receive
        // may own it; count it as posted, so that the buffer stays lent
        // until the receive is retired (or flushed).
        if rc == 0 || crate::qp::post::bad_index(bad, wr as *mut ffi::ibv_recv_wr, 1).is_none() {
            core.rq_head = head + 1;
            // SAFETY: `k` is in bounds (`recv_wrs` has as many entries).
            unsafe { *self.recv_end.get_unchecked_mut(k) = head + 1 };
        }
        if rc != 0 {
            return Err(Error::verb("ibv_post_recv", errno(rc)));
        }
        Ok(())
    }

    /// Posts a signaled SEND of the first `len` bytes of buffer `k`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `k >= self.len()`, `len` over
    /// [`buf_len`](Self::buf_len), while a receive of the buffer is in
    /// flight, or when the QP's send queue does not complete on the scope's
    /// CQ; else as [`ScopedQp::post_send`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, k: usize, len: usize, wr_id: u64) -> Result<()>
    where
        S: CanPostSend,
    {
        let src = self.source(k, len)?;
        self.post(k, ScopedSend::send(wr_id, src))
    }

    /// Posts a signaled RDMA WRITE of the first `len` bytes of buffer `k`
    /// to `remote` at `offset`.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send), and [`Error::RemoteOutOfBounds`]
    /// when the write does not fit `remote`.
    #[doc(alias = "ibv_post_send")]
    pub fn post_write(
        &mut self,
        k: usize,
        len: usize,
        remote: RemoteMr,
        offset: u64,
        wr_id: u64,
    ) -> Result<()>
    where
        S: CanPostSend,
    {
        let src = self.source(k, len)?;
        self.post(k, ScopedSend::write(wr_id, src, remote, offset))
    }

    /// The first `len` bytes of buffer `k` as a source, when no receive of
    /// it is in flight.
    fn source(&self, k: usize, len: usize) -> Result<Src<'scope>> {
        self.readable(k)?;
        if len > self.buf_len {
            return Err(Error::InvalidArgument {
                what: "scoped buffer length",
                reason: format!("{len} bytes; the buffers hold {}", self.buf_len),
            });
        }
        let mut sge = self.sges[k];
        sge.length = len as u32;
        Ok(Src::lent(sge))
    }

    /// Posts `req` (from buffer `k`) on the send queue and records it.
    fn post(&mut self, k: usize, req: ScopedSend<'scope>) -> Result<()>
    where
        S: CanPostSend,
    {
        // SAFETY: as in `post_recv`; read-only, and no reference into the
        // core lives across the post below.
        let head = unsafe { self.core.as_ref().sq_head };
        let mut q = ScopedQp::<'scope, S>::new(self.core, self.sq_in_scope, self.rq_in_scope);
        let r = q.post_send(&req.signaled(true));
        // SAFETY: as above.
        let after = unsafe { self.core.as_ref().sq_head };
        if after > head {
            // PostedRange, or possibly owned by the provider after a refusal: the
            // NIC may read the buffer until the request is retired.
            self.send_end[k] = head + 1;
        }
        r
    }

    /// Why [`post_recv`](Self::post_recv) refused buffer `k`.
    #[cold]
    #[inline(never)]
    fn refused(&self, k: usize) -> Error {
        // SAFETY: as in `post_recv`; read-only.
        let core = unsafe { self.core.as_ref() };
        if k >= self.len() {
            return self.out_of_range(k);
        }
        if self.busy(k) == Some(Busy::Sending) {
            return busy_error(k, "send");
        }
        if !self.rq_in_scope || core.ext.scoped.is_none() {
            return super::post::not_on_scope_cq("receive", 0).error;
        }
        if core.ext.scoped.as_ref().is_some_and(|t| t.rq_listing) {
            return super::listing::nested_post(true);
        }
        Error::QueueFull {
            queue: "receive",
            depth: core.rq.depth() as u32,
        }
    }

    #[cold]
    fn out_of_range(&self, k: usize) -> Error {
        Error::InvalidArgument {
            what: "scoped buffer",
            reason: format!("index {k}; there are {}", self.len()),
        }
    }

    /// Whether a request of buffer `k` is in flight (posted, and neither its
    /// completion nor a later one of the same queue polled by the scope);
    /// false for `k >= self.len()` (no such buffer).
    pub fn is_posted(&self, k: usize) -> bool {
        self.busy(k).is_some()
    }

    /// What keeps buffer `k` (in bounds) from Rust code, if anything: a
    /// receive in flight first.
    fn busy(&self, k: usize) -> Option<Busy> {
        // SAFETY: as in `post_recv`; read-only.
        let core = unsafe { self.core.as_ref() };
        if self.recv_end.get(k).is_some_and(|&e| e > core.rq.tail()) {
            Some(Busy::Receiving)
        } else if self.send_end.get(k).is_some_and(|&e| e > core.sq.tail()) {
            Some(Busy::Sending)
        } else {
            None
        }
    }

    /// Refuses an index out of range, or a buffer a receive may be writing.
    fn readable(&self, k: usize) -> Result<()> {
        if k >= self.len() {
            return Err(self.out_of_range(k));
        }
        match self.busy(k) {
            Some(Busy::Receiving) => Err(busy_error(k, "receive")),
            Some(Busy::Sending) | None => Ok(()),
        }
    }

    /// Refuses an index out of range, or a buffer any request still uses.
    fn writable(&self, k: usize) -> Result<()> {
        if k >= self.len() {
            return Err(self.out_of_range(k));
        }
        match self.busy(k) {
            Some(Busy::Receiving) => Err(busy_error(k, "receive")),
            Some(Busy::Sending) => Err(busy_error(k, "send")),
            None => Ok(()),
        }
    }

    /// The bytes of buffer `k` (all [`buf_len`](Self::buf_len) of them; a
    /// receive's completion says in `byte_len` how many its message wrote,
    /// for [`WcOpcode::Recv`](crate::cq::WcOpcode::Recv): an RDMA WRITE with
    /// immediate consumes a receive but writes elsewhere). Readable while a
    /// SEND or WRITE of it is in flight (the NIC only reads it then).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `k >= self.len()` or while a receive
    /// of the buffer is in flight; [`Error::RemotelyWritable`] when the
    /// region is registered for remote writes or atomics (a peer may write
    /// it at any time: use [`read_at`](Self::read_at)); as [`Mr::as_slice`]
    /// for device memory.
    pub fn bytes(&self, k: usize) -> Result<&[u8]> {
        self.readable(k)?;
        // SAFETY: no receive of buffer `k` is in flight (checked), and none
        // can be posted while the slice borrows `self` (posting takes
        // `&mut self`); nothing else reaches the region (borrowed
        // exclusively by `self.mr`).
        unsafe { self.mr.part(k * self.buf_len, self.buf_len) }
    }

    /// The bytes of buffer `k`, to write, once no request of it is in
    /// flight.
    ///
    /// # Errors
    /// As [`bytes`](Self::bytes), and [`Error::InvalidArgument`] while a
    /// SEND or WRITE of the buffer is in flight (use
    /// [`write_at`](Self::write_at) for a region a peer may write).
    pub fn bytes_mut(&mut self, k: usize) -> Result<&mut [u8]> {
        self.writable(k)?;
        // SAFETY: no request of buffer `k` is in flight (checked), none can
        // be posted while the slice borrows `self` mutably, and nothing else
        // reaches the region.
        unsafe { self.mr.part_mut(k * self.buf_len, self.buf_len) }
    }

    /// Copies `dst.len()` bytes of buffer `k`, from `offset`, into `dst`;
    /// works for regions a peer may write too (with atomic loads).
    ///
    /// # Errors
    /// As [`bytes`](Self::bytes), without the remote-write refusal;
    /// [`Error::InvalidArgument`] when the range is not inside the buffer.
    pub fn read_at(&self, k: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.readable(k)?;
        let at = self.inside(k, offset, dst.len())?;
        self.mr.read_at(at, dst)
    }

    /// Copies `src` into buffer `k` at `offset`, once no request of it is in
    /// flight; works for regions a peer may write too (with atomic stores).
    ///
    /// # Errors
    /// As [`bytes_mut`](Self::bytes_mut), without the remote-write refusal;
    /// [`Error::InvalidArgument`] when the range is not inside the buffer.
    pub fn write_at(&mut self, k: usize, offset: usize, src: &[u8]) -> Result<()> {
        self.writable(k)?;
        let at = self.inside(k, offset, src.len())?;
        self.mr.write_at(at, src)
    }

    /// The region offset of `offset..offset + n` of buffer `k`, if inside it.
    fn inside(&self, k: usize, offset: usize, n: usize) -> Result<usize> {
        if offset.checked_add(n).is_none_or(|end| end > self.buf_len) {
            return Err(Error::InvalidArgument {
                what: "offset",
                reason: format!(
                    "[{offset}, {offset}+{n}) is outside the {}-byte buffer",
                    self.buf_len
                ),
            });
        }
        Ok(k * self.buf_len + offset)
    }
}

/// Why a buffer cannot be used yet: its `what` ("receive" or "send") is in
/// flight.
#[cold]
fn busy_error(k: usize, what: &str) -> Error {
    Error::InvalidArgument {
        what: "scoped buffer",
        reason: format!(
            "buffer {k}'s {what} has not completed: poll its completion (through the scope) first"
        ),
    }
}

impl<S: QpState> std::fmt::Debug for ScopedBuffers<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopedBuffers")
            .field("len", &self.len())
            .field("buf_len", &self.buf_len)
            .finish_non_exhaustive()
    }
}
