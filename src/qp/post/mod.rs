//! Posting work requests: the safe `post_send`/`post_recv` family, the raw
//! (`unsafe`) posts, and the C chains both hand to the verbs.

mod builder;
mod chain;
mod verbs;

pub(crate) use builder::send_request;

pub(crate) use chain::{ChainedWr, bad_index, fill_sges, link};
pub(crate) use verbs::{ibv_post_recv, ibv_post_send, ibv_post_srq_recv};

use super::*;
use crate::error::Error;
use crate::sys::call::verb;

/// Bit 63 of a `wr_id`: set in every token of the safe path, so raw posts
/// (`post_send_raw`, `post_recv_raw`) must leave it clear.
pub const RAW_WR_ID_RESERVED: u64 = 1 << 63;

/// Refuses a raw chain with a `wr_id` that has [`RAW_WR_ID_RESERVED`] set.
///
/// # Safety
/// `head` heads a well-formed chain; `parts` reads `(wr_id, next)` of one entry.
pub(super) unsafe fn check_raw_wr_ids<W>(
    head: *const W,
    parts: impl Fn(*const W) -> (u64, *mut W),
) -> Result<()> {
    // One OR over the chain, and the walk again only to name the culprit:
    // this runs on every raw receive post and raw send on a legacy QP, so it
    // costs a load and an OR per request (an extended QP's replay checks raw
    // sends while posting: see send_ex::post_chain).
    let mut any = 0;
    let mut w = head;
    while !w.is_null() {
        let (wr_id, next) = parts(w);
        any |= wr_id;
        w = next;
    }
    if any & RAW_WR_ID_RESERVED == 0 {
        return Ok(());
    }
    // Some request has the bit, so this stops before the chain's end.
    let mut w = head;
    loop {
        let (wr_id, next) = parts(w);
        if wr_id & RAW_WR_ID_RESERVED != 0 {
            return Err(reserved_wr_id(wr_id));
        }
        w = next;
    }
}

#[cold]
pub(super) fn reserved_wr_id(wr_id: u64) -> Error {
    Error::InvalidArgument {
        what: "wr_id",
        reason: format!(
            "{wr_id:#x} has bit 63 set, which marks the safe path's own wr_ids; raw posts must leave it clear"
        ),
    }
}

// The state bounds sit on the methods (not the impl) so that calling one in
// the wrong state reports the trait's diagnostic ("connect the QP first").
impl<T: Connected, S: QpState> Qp<T, S> {
    /// Posts one receive; its buffers return with the completion.
    #[inline]
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_one::<RecvQueue>(&mut self.core, wr)
    }

    /// [`post_recv`](Qp::post_recv) of a request the caller holds, as
    /// [`post_send_in_place`](Qp::post_send_in_place).
    ///
    /// # Safety
    /// `*wr` is moved out (into the ring, or into the error when refused):
    /// the caller must forget it.
    #[cfg(feature = "tokio")]
    #[inline(always)]
    pub(crate) unsafe fn post_recv_in_place(&mut self, wr: &RecvWr) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        // SAFETY: per this function's contract.
        unsafe { queue::post_one_in_place::<QpCore, RecvQueue>(&mut self.core, wr) }
    }

    /// Posts receives as chained lists (one `ibv_post_recv` per 32 requests).
    /// On failure, the requests taken from `wrs` that did not reach the NIC
    /// come back in the error with their buffers; `wrs` is not pulled any
    /// further (pass `iter.by_ref()` to keep the rest). If `wrs` panics, the
    /// requests it yielded since the last verb call are taken back (their
    /// buffers drop with the unwind); earlier chunks were posted.
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_list(&mut self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_list::<RecvQueue>(&mut self.core, wrs)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// Posts a C receive work request list as is (`ibv_post_recv`).
    ///
    /// # Safety
    /// Every SGE must point into memory registered in this QP's PD with
    /// LOCAL_WRITE, that stays valid, and that nothing reads or writes, until
    /// the request's completion is polled (or the QP is destroyed). Safe-path
    /// requests in flight plus raw ones must not exceed the QP's
    /// `max_recv_wr`, or the CQ may overrun. The completion comes back from
    /// [`Cq::poll`](crate::cq::Cq::poll) as
    /// [`CompletionSource::Foreign`](crate::cq::CompletionSource::Foreign) with
    /// your `wr_id` (or from [`Cq::poll_raw`](crate::cq::Cq::poll_raw)). `wr`
    /// heads a well-formed chain (`next` null-terminated).
    ///
    /// # Errors
    /// A `wr_id` with bit 63 set is refused ([`RAW_WR_ID_RESERVED`]): those
    /// are the safe path's tokens, and a raw completion that looked like one
    /// would retire a safe request still in flight.
    #[doc(alias = "ibv_post_recv")]
    pub unsafe fn post_recv_raw(&mut self, wr: &mut ffi::ibv_recv_wr) -> Result<()>
    where
        S: CanPostRecv,
    {
        // SAFETY: the caller promises a well-formed chain.
        unsafe { check_raw_wr_ids(wr, |w| ((*w).wr_id, (*w).next))? };
        self.core.raw_posted = true;
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid QP; the caller upholds the buffer contract.
        verb!(rc: unsafe { ibv_post_recv(self.as_raw(), wr, &mut bad) })?;
        Ok(())
    }
}

impl<S: QpState> Qp<Rc, S> {
    /// Posts one send-queue work request; its buffers return with the completion.
    #[inline(always)]
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_wr_start")]
    pub fn post_send(&mut self, wr: SendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_one::<SendQueue>(&mut self.core, wr)
    }

    /// [`post_send`](Qp::post_send) of a request the caller holds: for a
    /// caller that has the request in place and would copy it to move it.
    ///
    /// # Safety
    /// `*wr` is moved out (into the ring, or into the error when refused):
    /// the caller must forget it.
    #[cfg(feature = "tokio")]
    #[inline(always)]
    pub(crate) unsafe fn post_send_in_place(&mut self, wr: &SendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        // SAFETY: per this function's contract.
        unsafe { queue::post_one_in_place::<QpCore, SendQueue>(&mut self.core, wr) }
    }

    /// Posts send-queue work requests as chained lists (one `ibv_post_send`, or
    /// one region of the extended API's builders, per 32 requests; a chunk
    /// that mixes requests the builders take with ones they cannot express
    /// takes one of each). On failure (e.g. [`Error::QueueFull`]), the
    /// requests taken from `wrs` that did not reach the NIC come back in the
    /// error with their buffers; `wrs` is not pulled any further (pass
    /// `iter.by_ref()` to keep the rest). If `wrs` panics, the requests it
    /// yielded since the last verb call are taken back (their buffers drop
    /// with the unwind); earlier chunks of 32 were posted and complete as usual.
    ///
    /// With the extended send API ([`Qp::send_api`]) each request goes to the
    /// provider's builders as `wrs` yields it, so `wrs` runs while this QP's
    /// send queue is held for the chunk (`ibv_wr_start` .. `ibv_wr_complete`,
    /// a spinlock on rxe and mlx5): keep it short. It may poll CQs, post on
    /// other QPs and, when the list is posted from a send half
    /// ([`Qp::split`]), post receives on the receive half; a panic aborts the
    /// chunk (`ibv_wr_abort`) before the requests it staged are taken back.
    /// A chunk with requests the builders cannot express (inline data,
    /// several buffers, ATOMIC_WRITE, FLUSH) posts those as C forms after
    /// the built ones (and where a chunk starts with one, the rest of the
    /// list goes as C forms); on both APIs a panic of `wrs` posts nothing of
    /// its chunk.
    #[doc(alias = "ibv_post_send")]
    #[doc(alias = "ibv_wr_start")]
    pub fn post_send_list<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_list::<SendQueue<'a>>(&mut self.core, wrs)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// Posts a C send work request list as is (`ibv_post_send`).
    ///
    /// # Safety
    /// Every SGE must point into memory registered in this QP's PD that stays
    /// valid until the request's completion is polled (or a later signaled
    /// request's, for unsignaled ones), or the QP is destroyed; memory the NIC
    /// writes (READ/atomic destinations) must not be read or written by anyone
    /// else meanwhile, and memory it reads must not be written. Remote addresses
    /// are not checked. Safe-path requests in flight plus raw ones must not
    /// exceed the QP's `max_send_wr`, or the CQ may overrun. The completion
    /// comes back from [`Cq::poll`](crate::cq::Cq::poll) as
    /// [`CompletionSource::Foreign`](crate::cq::CompletionSource::Foreign) with
    /// your `wr_id` (or from [`Cq::poll_raw`](crate::cq::Cq::poll_raw)). `wr`
    /// heads a well-formed chain (`next` null-terminated). Leave one slot of
    /// `max_send_wr` for the drain marker [`to_error`](Qp::to_error) may post.
    ///
    /// # Errors
    /// A `wr_id` with bit 63 set is refused ([`RAW_WR_ID_RESERVED`]), as for
    /// [`post_recv_raw`](Qp::post_recv_raw).
    #[inline(always)]
    #[doc(alias = "ibv_post_send")]
    pub unsafe fn post_send_raw(&mut self, wr: &mut ffi::ibv_send_wr) -> Result<()>
    where
        S: CanPostSend,
    {
        self.core.raw_posted = true;
        let mut bad = std::ptr::null_mut();
        let core = &self.core;
        // SAFETY: valid QP, send_ex its extended interface; the caller
        // upholds the buffer contract and promises a well-formed chain.
        // Reserved wr_ids are refused before anything is posted.
        let rc = unsafe {
            send_ex::post_chain::<true>(core.raw.as_ptr(), core.ext.send_ex.as_ref(), wr, &mut bad)
        };
        match rc {
            0 => Ok(()),
            send_ex::RESERVED_WR_ID => Err(
                // SAFETY: as above; this walk only names the culprit.
                unsafe { check_raw_wr_ids(wr, |w| ((*w).wr_id, (*w).next)) }
                    .err()
                    .unwrap_or_else(|| reserved_wr_id(RAW_WR_ID_RESERVED)),
            ),
            rc => Err(Error::verb("ibv_post_send", errno(rc))),
        }
    }
}
