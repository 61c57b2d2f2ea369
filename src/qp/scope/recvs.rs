//! Receive buffers lent to one QP for a scope: [`RecvBuffers`], from
//! [`ScopedQp::recv_buffers`](super::ScopedQp::recv_buffers).

use std::ptr::NonNull;

use crate::error::{Error, Result, errno};
use crate::ffi;
use crate::mr::Mr;
use crate::qp::QpCore;

/// A region carved into receive buffers of one QP, for the rest of a
/// scope: each buffer is posted by its index, with its C request prepared
/// once, and its bytes can be read once its receive has completed (and
/// until it is posted again), without leaving the scope: the receive ring
/// of `ibv_rc_pingpong` and perftest.
///
/// A [`Dst`](super::Dst) lends memory the NIC may write until the scope
/// ends, so nothing can read it before; these buffers are lent one receive
/// at a time. Receives of a QP's own receive queue complete in order, so
/// a buffer is free again once the scope has polled the completion of its
/// latest receive or of any later receive of the QP (a flush included).
///
/// ```no_run
/// # use rdma_verbs::*;
/// # use rdma_verbs::qp::Rts;
/// # use std::time::Duration;
/// # fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mr: &mut Mr) -> Result<()> {
/// cq.scope(|s| -> Result<()> {
///     let mut q = s.attach(qp)?;
///     let mut rx = q.recv_buffers(mr, 4096)?;
///     for k in 0..rx.len() {
///         rx.post(k, k as u64)?; // the wr_id names the buffer
///     }
///     for _ in 0..100 {
///         let c = s.poll_one(Duration::from_secs(5))?;
///         c.result()?;
///         let k = c.wr_id as usize;
///         let message = &rx.bytes(k)?[..c.byte_len as usize];
///         println!("{message:?}");
///         rx.post(k, k as u64)?; // lent again
///     }
///     Ok(())
/// })
/// # }
/// ```
pub struct RecvBuffers<'scope> {
    /// The QP, attached to the scope (borrowed for `'scope`).
    core: NonNull<QpCore>,
    /// One C request per buffer; each `sg_list` points at its entry of
    /// `sges`, and `next` is null. Only `wr_id` changes, per post.
    wrs: Box<[ffi::ibv_recv_wr]>,
    /// One SGE per buffer; never read by Rust after construction.
    _sges: Box<[ffi::ibv_sge]>,
    /// For each buffer, one past the sequence number of its latest receive
    /// (0: never posted): in flight while above the receive queue's tail.
    posted: Box<[u64]>,
    /// Bytes per buffer; buffer `k` is `k * buf_len..(k + 1) * buf_len`.
    buf_len: usize,
    /// The region, borrowed exclusively for the scope: only these buffers
    /// reach it.
    mr: &'scope mut Mr,
}

impl<'scope> RecvBuffers<'scope> {
    /// The buffers of `mr` (`mr.len() / buf_len` of them) for `core`'s
    /// receive queue, which completes on the scope's CQ.
    pub(super) fn new(
        core: NonNull<QpCore>,
        mr: &'scope mut Mr,
        buf_len: usize,
    ) -> Result<RecvBuffers<'scope>> {
        let refuse = |reason: String| {
            Err(Error::InvalidArgument {
                what: "receive buffers",
                reason,
            })
        };
        if !mr.access().contains(crate::AccessFlags::LOCAL_WRITE) {
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
        let mut sges: Box<[ffi::ibv_sge]> = (0..count)
            .map(|k| ffi::ibv_sge {
                addr: mr.addr() + (k * buf_len) as u64,
                length,
                lkey: mr.lkey(),
            })
            .collect();
        let wrs = sges
            .iter_mut()
            .map(|sge| ffi::ibv_recv_wr {
                wr_id: 0,
                next: std::ptr::null_mut(),
                sg_list: sge,
                num_sge: 1,
            })
            .collect();
        Ok(RecvBuffers {
            core,
            wrs,
            _sges: sges,
            posted: vec![0; count].into_boxed_slice(),
            buf_len,
            mr,
        })
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.posted.len()
    }

    /// Always false: there is at least one buffer.
    pub fn is_empty(&self) -> bool {
        self.posted.is_empty()
    }

    /// Bytes per buffer.
    pub fn buf_len(&self) -> usize {
        self.buf_len
    }

    /// Posts a receive into buffer `k`; its completion carries `wr_id`.
    /// Posting a buffer whose receive is still in flight is allowed (both
    /// receives write it); it is readable again once the latest has
    /// completed.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `k >= self.len()`;
    /// [`Error::QueueFull`] when the receive queue is full (poll first);
    /// [`Error::Verb`] when the provider refuses it.
    #[inline(always)]
    pub fn post(&mut self, k: usize, wr_id: u64) -> Result<()> {
        // SAFETY: the QP is borrowed for 'scope by the `ScopedQp` this came
        // from; the scope and that handle use it only during their calls on
        // this thread (none is Send), so this is the only live reference.
        let core = unsafe { self.core.as_mut() };
        let head = core.rq_head;
        let ring = &*core.rq;
        let (Some(wr), Some(tables)) = (self.wrs.get_mut(k), core.scoped.as_deref_mut()) else {
            return Err(self.refused(k));
        };
        if ring.in_flight(head) >= ring.depth() {
            return Err(self.refused(k));
        }
        // SAFETY: `index` masks with the ring's slot count, the table's length.
        unsafe { *tables.rq.get_unchecked_mut(ring.index(head)) = wr_id };
        wr.wr_id = ring.token(head);
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; one request whose SGE names buffer `k` of a region
        // borrowed exclusively for 'scope, which outlives every request
        // posted in the scope; only this type reaches it, and it lends the
        // buffer to Rust only while no receive of it is in flight.
        let rc = unsafe { ffi::ibv_post_recv(core.raw.as_ptr(), wr, &mut bad) };
        if rc != 0 {
            return Err(Error::verb("ibv_post_recv", errno(rc)));
        }
        core.rq_head = head + 1;
        // SAFETY: `k` is in bounds (`wrs` has as many entries).
        unsafe { *self.posted.get_unchecked_mut(k) = head + 1 };
        Ok(())
    }

    /// Why [`post`](RecvBuffers::post) refused buffer `k`.
    #[cold]
    #[inline(never)]
    fn refused(&self, k: usize) -> Error {
        // SAFETY: as in `post`; read-only.
        let core = unsafe { self.core.as_ref() };
        if k >= self.len() {
            return self.out_of_range(k);
        }
        if core.scoped.is_none() {
            return Error::InvalidArgument {
                what: "receive buffers",
                reason: "their QP has no scoped tables (a bug)".into(),
            };
        }
        Error::QueueFull {
            queue: "receive",
            depth: core.rq.depth() as u32,
        }
    }

    #[cold]
    fn out_of_range(&self, k: usize) -> Error {
        Error::InvalidArgument {
            what: "receive buffer",
            reason: format!("index {k}; there are {}", self.len()),
        }
    }

    /// Whether a receive of buffer `k` is in flight (posted, and neither
    /// its completion nor a later one of the QP polled by the scope); false
    /// for `k >= self.len()` (no such buffer).
    pub fn is_posted(&self, k: usize) -> bool {
        // SAFETY: as in `post`; read-only.
        let tail = unsafe { self.core.as_ref().rq.tail() };
        self.posted.get(k).is_some_and(|&end| end > tail)
    }

    /// Buffer `k`'s offset in the region, once it is readable.
    fn readable(&self, k: usize) -> Result<usize> {
        if k >= self.len() {
            return Err(self.out_of_range(k));
        }
        if self.is_posted(k) {
            return Err(Error::InvalidArgument {
                what: "receive buffer",
                reason: format!(
                    "buffer {k}'s receive has not completed: poll its completion (through the \
                     scope) before reading it"
                ),
            });
        }
        Ok(k * self.buf_len)
    }

    /// The bytes of buffer `k` (all [`buf_len`](Self::buf_len) of them; a
    /// completion's `byte_len` says how many the message wrote).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `k >= self.len()` or while a receive
    /// of the buffer is in flight; [`Error::RemotelyWritable`] when the
    /// region is registered for remote writes or atomics (a peer may write
    /// it at any time: use [`read_at`](Self::read_at)); as [`Mr::as_slice`]
    /// for device memory.
    pub fn bytes(&self, k: usize) -> Result<&[u8]> {
        let at = self.readable(k)?;
        // SAFETY: no receive of buffer `k` is in flight (checked), and none
        // can be posted while the slice borrows `self` (posting takes
        // `&mut self`); nothing else reaches the region (borrowed
        // exclusively by `self.mr`).
        unsafe { self.mr.part(at, self.buf_len) }
    }

    /// Copies `dst.len()` bytes of buffer `k`, from `offset`, into `dst`;
    /// works for regions a peer may write too (with atomic loads).
    ///
    /// # Errors
    /// As [`bytes`](Self::bytes), without the remote-write refusal;
    /// [`Error::InvalidArgument`] when the range is not inside the buffer.
    pub fn read_at(&self, k: usize, offset: usize, dst: &mut [u8]) -> Result<()> {
        let at = self.readable(k)?;
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.buf_len)
        {
            return Err(Error::InvalidArgument {
                what: "offset",
                reason: format!(
                    "[{offset}, {offset}+{}) is outside the {}-byte buffer",
                    dst.len(),
                    self.buf_len
                ),
            });
        }
        // Inside buffer `k`, which no receive is writing.
        self.mr.read_at(at + offset, dst)
    }
}

impl std::fmt::Debug for RecvBuffers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBuffers")
            .field("len", &self.len())
            .field("buf_len", &self.buf_len)
            .finish_non_exhaustive()
    }
}
