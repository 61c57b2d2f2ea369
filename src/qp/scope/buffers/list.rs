//! [`ScopedBuffers::post_recv_list`]: receives chained, one `ibv_post_recv`
//! per [`POST_CHUNK`].

use std::mem::MaybeUninit;

use super::ScopedBuffers;
use crate::error::{Error, errno};
use crate::ffi;
use crate::qp::post;
use crate::qp::queue::POST_CHUNK;
use crate::qp::scope::ScopedListError;
use crate::qp::scope::chunk::post_in_chunks;
use crate::qp::scope::listing::{Listing, nested_post};
use crate::qp::scope::post::not_on_scope_cq;
use crate::qp::state::{CanPostRecv, QpState};

impl<S: QpState> ScopedBuffers<'_, S> {
    /// Posts a receive into buffer `k` for each `(k, wr_id)` of `reqs`,
    /// chained: one `ibv_post_recv` per 32, where
    /// [`post_recv`](Self::post_recv) makes one per receive. A receiver that
    /// re-posts the buffers of a batch of completions pays the provider's
    /// lock and call once per batch. A buffer may appear more than once, as
    /// with `post_recv`.
    ///
    /// On a refused receive the ones before it are posted (and complete as
    /// usual) and the iterator is not pulled further. Nothing is committed
    /// before the verb accepts a chain, so a panicking iterator leaves the
    /// queue as it was.
    ///
    /// A receiver of `n` messages: each buffer receives, is read once its
    /// completion is polled, and receives again while more messages are due,
    /// one chain per poll:
    ///
    /// ```no_run
    /// # use rdma_verbs::prelude::*;
    /// # fn f(cq: &mut Cq, qp: &mut Qp<Rc, Rts>, mr: &mut Mr, n: usize) -> Result<()> {
    /// cq.scope(|s| -> Result<()> {
    ///     let q = s.attach(qp)?;
    ///     let mut bufs = q.buffers(mr, 4096)?;
    ///     // The buffer's index is the receive's wr_id.
    ///     let mut posted = bufs.len().min(n);
    ///     bufs.post_recv_list((0..posted).map(|k| (k, k as u64)))?;
    ///     let (mut got, mut out) = (0, Vec::with_capacity(16));
    ///     while got < n {
    ///         out.clear();
    ///         s.poll(&mut out)?;
    ///         for c in &out {
    ///             c.result()?;
    ///             let message = &bufs.bytes(c.wr_id as usize)?[..c.byte_len as usize];
    ///             println!("{} bytes", message.len());
    ///         }
    ///         got += out.len();
    ///         let again = out.len().min(n - posted);
    ///         bufs.post_recv_list(out[..again].iter().map(|c| (c.wr_id as usize, c.wr_id)))?;
    ///         posted += again;
    ///     }
    ///     Ok(())
    /// })
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`post_recv`](Self::post_recv), with how many were posted.
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_list(
        &mut self,
        reqs: impl IntoIterator<Item = (usize, u64)>,
    ) -> std::result::Result<(), ScopedListError>
    where
        S: CanPostRecv,
    {
        if !self.rq_in_scope {
            return Err(not_on_scope_cq("receive", 0));
        }
        let mut reqs = reqs.into_iter();
        post_in_chunks(|| self.post_recv_chunk(&mut reqs))
    }

    /// Posts up to [`POST_CHUNK`] receives of `reqs` as one chain; returns
    /// how many were posted and whether `reqs` may have more, or why the next
    /// was not posted.
    ///
    /// The caller's iterator may poll the scope, which reads and writes the
    /// QP's core: references into it live only between calls of
    /// `reqs.next()`. A side entry written for a receive that is not posted
    /// lies at or after the head, where no completion is looked up.
    #[inline(always)]
    fn post_recv_chunk(
        &mut self,
        reqs: &mut impl Iterator<Item = (usize, u64)>,
    ) -> std::result::Result<(usize, bool), ScopedListError> {
        // Posts on the receive queue from the iterator are refused until the
        // chunk is posted (they would take the head it counts on).
        // SAFETY: the QP is borrowed for 'scope (see `post_recv`); no
        // reference into its core is live now or when the mark drops.
        let listing = unsafe { Listing::mark(self.core, true) }.ok_or_else(|| ScopedListError {
            posted: 0,
            error: nested_post(true),
        })?;
        // SAFETY: as above; read-only.
        let (head, depth, mut room) = unsafe {
            let c = self.core.as_ref();
            let depth = c.rq.depth();
            (
                c.rq_head,
                depth,
                depth.saturating_sub(c.rq.in_flight(c.rq_head)),
            )
        };
        let mut chain = [const { MaybeUninit::<ffi::ibv_recv_wr>::uninit() }; POST_CHUNK];
        let wrs = chain.as_mut_ptr().cast::<ffi::ibv_recv_wr>();
        let mut n = 0;
        let mut refused = None;
        let mut more = true;
        while n < POST_CHUNK {
            let Some((k, wr_id)) = reqs.next() else {
                more = false;
                break;
            };
            // SAFETY: as above; the iterator has returned, so this is the
            // only reference until its next call.
            let core = unsafe { &mut *self.core.as_ptr() };
            let seq = head + n as u64;
            let ring = &*core.rq;
            let (Some(wr), Some(&send_end), Some(tables)) = (
                self.recv_wrs.get(k),
                self.send_end.get(k),
                core.ext.scoped.as_deref_mut(),
            ) else {
                refused = Some(k);
                break;
            };
            if n as u64 >= room {
                // Polls from the iterator may have retired receives since.
                room = depth.saturating_sub(ring.in_flight(head));
            }
            if n as u64 >= room || (send_end != 0 && send_end > core.sq.tail()) {
                refused = Some(k);
                break;
            }
            // SAFETY: `index` masks with the ring's slot count, the table's
            // length; n < POST_CHUNK, inside `chain`.
            unsafe {
                *tables.rq.get_unchecked_mut(ring.index(seq)) = wr_id;
                wrs.add(n).write(ffi::ibv_recv_wr {
                    wr_id: ring.token(seq),
                    next: wrs.add(n + 1),
                    sg_list: wr.sg_list,
                    num_sge: 1,
                });
            }
            n += 1;
        }
        // The iterator is done for this chunk; the reason for a refusal is
        // read without the chunk's own mark.
        drop(listing);
        if n > 0 {
            // SAFETY: n receives were written to `chain` from the head.
            unsafe { self.post_chain(wrs, head, n) }?;
        }
        match refused {
            None => Ok((n, more)),
            Some(k) => Err(ScopedListError {
                posted: n,
                error: self.refused(k),
            }),
        }
    }

    /// Posts the chain of `n` receives at `wrs`, staged from `head`, and
    /// commits what was posted: the queue's head and each buffer's latest
    /// receive.
    ///
    /// # Safety
    /// `wrs` holds `n` (1 to [`POST_CHUNK`]) receives written by
    /// `post_recv_chunk`, entry `j` for sequence number `head + j`, each
    /// linked to the next; no reference into the QP's core is live.
    #[inline(always)]
    unsafe fn post_chain(
        &mut self,
        wrs: *mut ffi::ibv_recv_wr,
        head: u64,
        n: usize,
    ) -> std::result::Result<(), ScopedListError> {
        // SAFETY: the contract; entry n - 1 was written.
        unsafe { (*wrs.add(n - 1)).next = std::ptr::null_mut() };
        // SAFETY: as in `post_recv_chunk`; the iterator is not called again
        // in this chunk.
        let core = unsafe { &mut *self.core.as_ptr() };
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; a chain of n receives whose SGEs name buffers of
        // a region borrowed exclusively for 'scope, which outlives every
        // request posted in the scope (see `post_recv`).
        let rc = unsafe { post::ibv_post_recv(core.raw.as_ptr(), wrs, &mut bad) };
        // A provider that did not say where it stopped may own them all:
        // count them as posted, so that the scope waits for (or flushes) them.
        let ok = if rc == 0 {
            n
        } else {
            post::bad_index(bad, wrs, n).unwrap_or(n)
        };
        core.rq_head = head + ok as u64;
        let base = self.recv_wrs[0].sg_list;
        for j in 0..ok {
            // SAFETY: entry j was written with the SGE of one buffer, an
            // element of the array `base` starts.
            let k = unsafe { (*wrs.add(j)).sg_list.offset_from(base) } as usize;
            // SAFETY: `k` indexes `sges`, which has as many entries as
            // `recv_end`.
            unsafe { *self.recv_end.get_unchecked_mut(k) = head + j as u64 + 1 };
        }
        if rc != 0 {
            return Err(ScopedListError {
                posted: ok,
                error: Error::verb("ibv_post_recv", errno(rc)),
            });
        }
        Ok(())
    }
}
