//! A connected QP split into a send half and a receive half ([`Qp::split`]),
//! which post from two threads at once, as a socket's halves do.
//!
//! Each half holds borrows of disjoint fields of the QP's core: the send
//! half the send ring and its head (and the extended send interface), the
//! receive half the receive ring and its head; both read the QP's fixed
//! attributes (verbs handle, capabilities, PD). The borrow checker proves the
//! split; why the verbs allow it is in `docs/soundness.md`, "Send and
//! receive halves".

use std::marker::PhantomData;
use std::ptr::NonNull;

use super::queue::{self, QueueCore, RecvCore, RecvQueue, SendCore, SendQueue};
use super::send_ex::SendEx;
use super::*;

/// What both halves read of the QP: attributes fixed while it is split.
#[derive(Clone, Copy)]
struct Fixed<'q> {
    raw: NonNull<ffi::ibv_qp>,
    caps: &'q QpCaps,
    pd: &'q Pd,
    uses_srq: bool,
}

/// A half's share of the QP's core: [`Fixed`], one ring and its head.
struct Part<'q> {
    fixed: Fixed<'q>,
    ring: &'q Ring,
    head: &'q mut u64,
}

/// The send half's share: a [`Part`] and the extended send interface.
struct SendPart<'q> {
    part: Part<'q>,
    send_ex: Option<&'q SendEx>,
}

// SAFETY: a half is the only producer of its ring (it holds `&mut` to the
// head) and the only user of what else it names mutably; what it shares with
// the other half (the verbs handle, capabilities, PD) is only read, and
// libibverbs lets one thread post sends while another posts receives on the
// same QP (providers lock the two queues apart: see docs/soundness.md,
// "Provider assumptions"). The send interface is used by the send half alone.
unsafe impl Send for SendPart<'_> {}

// SAFETY: as for `SendPart`, for the receive queue.
unsafe impl Send for Part<'_> {}

macro_rules! queue_core {
    ($ty:ty, $($part:ident).+) => {
        impl QueueCore for $ty {
            #[inline(always)]
            fn raw(&self) -> *mut ffi::ibv_qp {
                self.$($part).+.raw.as_ptr()
            }

            #[inline(always)]
            fn caps(&self) -> &QpCaps {
                self.$($part).+.caps
            }

            #[inline(always)]
            fn pd(&self) -> &Pd {
                self.$($part).+.pd
            }

            #[inline(always)]
            fn uses_srq(&self) -> bool {
                self.$($part).+.uses_srq
            }
        }
    };
}

queue_core!(Part<'_>, fixed);
queue_core!(SendPart<'_>, part.fixed);

impl RecvCore for Part<'_> {
    #[inline(always)]
    fn rq(&mut self) -> (&Ring, &mut u64) {
        (self.ring, self.head)
    }
}

impl SendCore for SendPart<'_> {
    #[inline(always)]
    fn sq(&mut self) -> (&Ring, &mut u64) {
        (self.part.ring, self.part.head)
    }

    #[inline(always)]
    fn send_ex(&self) -> Option<&SendEx> {
        self.send_ex
    }
}

/// The send half of a split QP ([`Qp::split`]): posts send-queue requests
/// while the [`RecvHalf`] posts receives, from another thread if need be.
pub struct SendHalf<'q, T: QpType, S: QpState> {
    part: SendPart<'q>,
    _qp: PhantomData<fn() -> (T, S)>,
}

/// The receive half of a split QP ([`Qp::split`]): posts receives while the
/// [`SendHalf`] posts sends, from another thread if need be.
pub struct RecvHalf<'q, T: QpType, S: QpState> {
    part: Part<'q>,
    _qp: PhantomData<fn() -> (T, S)>,
}

impl<T: Connected, S: QpState> Qp<T, S> {
    /// Splits the QP into a send half and a receive half that post at the
    /// same time, each from its own thread (e.g. in `std::thread::scope`),
    /// without a lock around the QP; like `TcpStream`'s halves. The halves
    /// borrow the QP, so it cannot change state or be dropped while they
    /// live. Completions come from the QP's CQs as usual.
    ///
    /// RC and UC; a UD QP keeps its address handles with its sends, and
    /// posts through the whole QP.
    pub fn split(&mut self) -> (SendHalf<'_, T, S>, RecvHalf<'_, T, S>) {
        let (send, recv) = parts(&mut self.core);
        (
            SendHalf {
                part: send,
                _qp: PhantomData,
            },
            RecvHalf {
                part: recv,
                _qp: PhantomData,
            },
        )
    }
}

/// The halves' shares of `core`: borrows of disjoint fields.
fn parts(core: &mut QpCore) -> (SendPart<'_>, Part<'_>) {
    let fixed = Fixed {
        raw: core.raw,
        caps: &core.caps,
        pd: &core.pd,
        uses_srq: core.ext.srq.is_some(),
    };
    let send = SendPart {
        part: Part {
            fixed,
            ring: &core.sq,
            head: &mut core.sq_head,
        },
        send_ex: core.ext.send_ex.as_ref(),
    };
    let recv = Part {
        fixed,
        ring: &core.rq,
        head: &mut core.rq_head,
    };
    (send, recv)
}

impl<T: QpType, S: QpState> SendHalf<'_, T, S> {
    /// Send-queue requests posted and not yet retired by a polled completion.
    pub fn outstanding(&self) -> u64 {
        self.part.part.ring.in_flight(*self.part.part.head)
    }
}

impl<T: QpType, S: QpState> RecvHalf<'_, T, S> {
    /// Receives posted and not yet retired by a polled completion.
    pub fn outstanding(&self) -> u64 {
        self.part.ring.in_flight(*self.part.head)
    }
}

impl<S: QpState> SendHalf<'_, Rc, S> {
    /// Posts one send-queue request, as [`Qp::post_send`].
    #[inline]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, wr: SendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_one_on::<_, SendQueue>(&mut self.part, wr)
    }

    /// Posts send-queue requests as chained lists, as [`Qp::post_send_list`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_list<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_list_on::<_, SendQueue<'a>, _>(&mut self.part, wrs)
    }
}

impl<S: QpState> SendHalf<'_, Uc, S> {
    /// Posts one SEND or RDMA WRITE, as a UC QP's `post_send`.
    #[inline]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, wr: UcSendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        queue::post_one_on::<_, SendQueue>(&mut self.part, wr.0)
    }
}

impl<T: Connected, S: QpState> RecvHalf<'_, T, S> {
    /// Posts one receive, as [`Qp::post_recv`].
    #[inline]
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_one_on::<_, RecvQueue>(&mut self.part, wr)
    }

    /// Posts receives as chained lists, as [`Qp::post_recv_list`].
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_list(&mut self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        queue::post_list_on::<_, RecvQueue, _>(&mut self.part, wrs)
    }
}

/// The QP that owned halves share, boxed: freed (the QP destroyed) when the
/// last half drops, or handed back whole by [`OwnedSendHalf::reunite`].
struct SharedQp(NonNull<QpCore>);

impl Drop for SharedQp {
    fn drop(&mut self) {
        // SAFETY: a `Box<Qp<_, _>>` leaked by `into_split` (`Qp` is
        // transparent over its core); the last half is gone, so nothing
        // refers to it any more.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

// SAFETY: only the pointer's owner: it is dereferenced once, by the last
// holder, to free the QP (which is Send).
unsafe impl Send for SharedQp {}

// SAFETY: `&SharedQp` gives no access to the QP.
unsafe impl Sync for SharedQp {}

/// The send half of a QP split by value ([`Qp::into_split`]): as
/// [`SendHalf`], but owning its share, so it can move into a spawned thread
/// or task; [`reunite`](OwnedSendHalf::reunite) gives the QP back.
pub struct OwnedSendHalf<T: QpType, S: QpState> {
    qp: Arc<SharedQp>,
    _qp: PhantomData<fn() -> (T, S)>,
}

/// The receive half of a QP split by value ([`Qp::into_split`]).
pub struct OwnedRecvHalf<T: QpType, S: QpState> {
    qp: Arc<SharedQp>,
    _qp: PhantomData<fn() -> (T, S)>,
}

/// [`OwnedSendHalf::reunite`] was given halves of two different QPs: both
/// come back.
pub struct ReuniteError<T: QpType, S: QpState>(pub OwnedSendHalf<T, S>, pub OwnedRecvHalf<T, S>);

impl<T: QpType, S: QpState> fmt::Debug for ReuniteError<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ReuniteError(..)")
    }
}

impl<T: QpType, S: QpState> fmt::Display for ReuniteError<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "the send and receive halves are of two different QPs: reunite each with its own",
        )
    }
}

impl<T: QpType, S: QpState> std::error::Error for ReuniteError<T, S> {}

/// The fixed fields of the core at `p`, each borrowed on its own.
///
/// # Safety
/// `p` is a live core for `'a` whose fixed fields nobody writes meanwhile.
unsafe fn fixed_of<'a>(p: *mut QpCore) -> Fixed<'a> {
    // SAFETY: per the contract; each reference covers one field only, so
    // none overlaps what the other half writes.
    unsafe {
        Fixed {
            raw: (*p).raw,
            caps: &*std::ptr::addr_of!((*p).caps),
            pd: &*std::ptr::addr_of!((*p).pd),
            uses_srq: (*p).ext.srq.is_some(),
        }
    }
}

impl<T: Connected, S: QpState> Qp<T, S> {
    /// Splits the QP by value into halves that own their shares (for
    /// spawned threads or tokio tasks), as [`split`](Qp::split) does by
    /// borrowing. The QP is destroyed when both halves are dropped;
    /// [`OwnedSendHalf::reunite`] gives it back whole, to change its state.
    pub fn into_split(self) -> (OwnedSendHalf<T, S>, OwnedRecvHalf<T, S>) {
        let ptr = NonNull::from(Box::leak(Box::new(self))).cast::<QpCore>();
        let qp = Arc::new(SharedQp(ptr));
        (
            OwnedSendHalf {
                qp: qp.clone(),
                _qp: PhantomData,
            },
            OwnedRecvHalf {
                qp,
                _qp: PhantomData,
            },
        )
    }
}

impl<T: QpType, S: QpState> OwnedSendHalf<T, S> {
    /// The share of the QP this half posts with, for as long as `&mut self`.
    fn half(&mut self) -> SendHalf<'_, T, S> {
        let p = self.qp.0.as_ptr();
        // SAFETY: the QP lives while `self.qp` does; this half alone
        // touches the send ring's head and the send interface (and `&mut
        // self` makes one share at a time), the receive half never writes
        // what either reads; each reference covers one field, made by
        // place projection without a reference to the whole core.
        let part = unsafe {
            SendPart {
                part: Part {
                    fixed: fixed_of(p),
                    ring: &(*p).sq,
                    head: &mut *std::ptr::addr_of_mut!((*p).sq_head),
                },
                send_ex: (*p).ext.send_ex.as_ref(),
            }
        };
        SendHalf {
            part,
            _qp: PhantomData,
        }
    }

    /// Puts the QP back together from its two halves.
    ///
    /// # Errors
    /// [`ReuniteError`], with both halves, when they are of different QPs.
    pub fn reunite(self, recv: OwnedRecvHalf<T, S>) -> Result<Qp<T, S>, ReuniteError<T, S>> {
        if !Arc::ptr_eq(&self.qp, &recv.qp) {
            return Err(ReuniteError(self, recv));
        }
        drop(recv);
        let shared = match Arc::try_unwrap(self.qp) {
            Ok(shared) => shared,
            // Only the two halves hold it, and the other one is gone.
            Err(_) => unreachable!("a third owner of a split QP"),
        };
        let ptr = shared.0;
        std::mem::forget(shared);
        // SAFETY: leaked by `into_split` as a `Box<Qp<T, S>>`; the other
        // half is dropped and the last `SharedQp` forgotten, so this is the
        // only owner, and no share of it is live.
        Ok(*unsafe { Box::from_raw(ptr.cast::<Qp<T, S>>().as_ptr()) })
    }

    /// Send-queue requests posted and not yet retired by a polled completion.
    pub fn outstanding(&self) -> u64 {
        let p = self.qp.0.as_ptr();
        // SAFETY: the QP lives while `self.qp` does; only this half writes
        // the head, and not while `&self` is held; one field each.
        unsafe { (*p).sq.in_flight(*std::ptr::addr_of!((*p).sq_head)) }
    }
}

impl<T: QpType, S: QpState> OwnedRecvHalf<T, S> {
    /// The share of the QP this half posts with, for as long as `&mut self`.
    fn half(&mut self) -> RecvHalf<'_, T, S> {
        let p = self.qp.0.as_ptr();
        // SAFETY: as in `OwnedSendHalf::half`, for the receive ring's head.
        let part = unsafe {
            Part {
                fixed: fixed_of(p),
                ring: &(*p).rq,
                head: &mut *std::ptr::addr_of_mut!((*p).rq_head),
            }
        };
        RecvHalf {
            part,
            _qp: PhantomData,
        }
    }

    /// Receives posted and not yet retired by a polled completion.
    pub fn outstanding(&self) -> u64 {
        let p = self.qp.0.as_ptr();
        // SAFETY: as in `OwnedSendHalf::outstanding`, for the receive queue.
        unsafe { (*p).rq.in_flight(*std::ptr::addr_of!((*p).rq_head)) }
    }
}

impl<S: QpState> OwnedSendHalf<Rc, S> {
    /// Posts one send-queue request, as [`Qp::post_send`].
    #[inline]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, wr: SendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        self.half().post_send(wr)
    }

    /// Posts send-queue requests as chained lists, as [`Qp::post_send_list`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_list<'a>(
        &mut self,
        wrs: impl IntoIterator<Item = SendWr<'a>>,
    ) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        self.half().post_send_list(wrs)
    }
}

impl<S: QpState> OwnedSendHalf<Uc, S> {
    /// Posts one SEND or RDMA WRITE, as a UC QP's `post_send`.
    #[inline]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, wr: UcSendWr<'_>) -> Result<(), PostError>
    where
        S: CanPostSend,
    {
        self.half().post_send(wr)
    }
}

impl<T: Connected, S: QpState> OwnedRecvHalf<T, S> {
    /// Posts one receive, as [`Qp::post_recv`].
    #[inline]
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        self.half().post_recv(wr)
    }

    /// Posts receives as chained lists, as [`Qp::post_recv_list`].
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv_list(&mut self, wrs: impl IntoIterator<Item = RecvWr>) -> Result<(), PostError>
    where
        S: CanPostRecv,
    {
        self.half().post_recv_list(wrs)
    }
}
