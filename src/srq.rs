//! `Srq`: shared receive queues, with the same ownership model as a QP's own
//! receive queue.
//!
//! Many QPs can take their receives from one shared receive queue (SRQ)
//! instead of each keeping its own posted: a server with hundreds of
//! connections keeps one pool of receive buffers deep enough for the traffic
//! of all of them (the usual advice: keep ~256 posted and refill in batches,
//! so that no sender meets an RNR NAK).
//!
//! * [`Srq::post_recv`] / [`Srq::post_recv_list`] **move** the buffers in;
//!   they come back in the [`Completion`](crate::cq::Completion) of whichever QP
//!   consumed the receive (its `qp_num` says which), polled from the one CQ
//!   the SRQ is bound to.
//! * The SRQ is bound to one CQ at creation ([`Srq::new`]): it reserves its
//!   depth there, and every QP created on it with
//!   [`Qp::new_with_srq`](crate::qp::Qp::new_with_srq) (or, for rdma_cm,
//!   [`CmId::create_qp_with_srq`](crate::cm::CmId::create_qp_with_srq)) must
//!   use that CQ as its receive CQ ([`Error::SrqCqMismatch`] otherwise). Such a QP reserves no
//!   receive entries and has no receive queue of its own
//!   ([`Qp::post_recv`](crate::qp::Qp::post_recv) on it is refused with
//!   [`Error::QpUsesSrq`]).
//! * Receives of an SRQ complete out of posting order across the QPs that
//!   consume them; each one completes exactly once and retires exactly its
//!   own slot (the design and what it relies on: `docs/soundness.md`,
//!   "Shared receive queues").
//! * QPs keep the SRQ alive: `ibv_destroy_srq` runs only after the last QP on
//!   it was destroyed and the `Srq` handle dropped, and the buffers still
//!   posted are released after it returns.
//! * [`Srq::arm_limit`] arms `IBV_EVENT_SRQ_LIMIT_REACHED`
//!   ([`AsyncEvent::SrqLimitReached`](crate::event::AsyncEvent::SrqLimitReached),
//!   matched with [`Srq::id`]); the event disarms the limit, arm it again to
//!   hear about the next time.
//! * [`Srq::refill`] tops the SRQ up to its depth from a buffer source.
//!
//! An example is on [`Srq`].

use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::cq::{Cq, CqInner};
use crate::error::{Error, Result};
use crate::event::SrqId;
use crate::ffi;
use crate::ledger::ring::{Ring, SrqProducer};
use crate::ledger::sges::{MAX_SAFE_SGES, Sges};
use crate::ledger::wr::{PostError, RecvWr};
use crate::pd::Pd;
use crate::qp::QpCaps;
use crate::qp::post;
use crate::sys::call::verb;

/// Requests per `ibv_post_srq_recv` call in [`Srq::post_recv_list`].
const CHUNK: usize = 32;

/// Sizes of a shared receive queue (`ibv_srq_attr`).
#[doc(alias = "ibv_srq_attr")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqAttr {
    /// Most receives posted at once.
    pub max_wr: u32,
    /// Most scatter entries per receive.
    pub max_sge: u32,
    /// The armed limit (0: not armed). At creation a non-zero limit is armed
    /// right away (see [`Srq::arm_limit`]).
    pub limit: u32,
}

impl SrqAttr {
    /// `max_wr` receives of up to `max_sge` buffers each, no limit armed.
    pub fn new(max_wr: u32, max_sge: u32) -> SrqAttr {
        SrqAttr {
            max_wr,
            max_sge,
            limit: 0,
        }
    }
}

/// A shared receive queue; see the [module docs](self).
///
/// ```no_run
/// use rdma_verbs::prelude::*;
///
/// # fn main() -> rdma_verbs::Result<()> {
/// let ctx = Context::open(None)?;
/// let pd = Pd::new(&ctx)?;
/// let mut cq = Cq::new(&ctx, 512 + 16 * 8)?;
/// let mut srq = Srq::new(&pd, &cq, SrqAttr::new(512, 1))?;
/// // Sixteen QPs share the SRQ's receives; their sends use the same CQ.
/// let caps = QpCaps { max_send_wr: 8, ..QpCaps::default() };
/// let qps = (0..16)
///     .map(|_| Qp::new_with_srq(&pd, &cq, &cq, &srq, caps))
///     .collect::<rdma_verbs::Result<Vec<_>>>()?;
/// // Keep it full: 512 receives of 4 KiB each.
/// let mut next_id = 0;
/// srq.refill(|| {
///     next_id += 1;
///     Mr::new(&pd, 4096, AccessFlags::LOCAL_WRITE).ok().map(|mr| RecvWr::new(next_id, mr))
/// })?;
/// srq.arm_limit(64)?; // IBV_EVENT_SRQ_LIMIT_REACHED below 64 posted
/// // ... connect the QPs; then each receive comes back on `cq` with its buffer:
/// let mut wcs = Vec::with_capacity(32);
/// cq.poll(&mut wcs)?;
/// for mut wc in wcs.drain(..) {
///     let buf = wc.take_mr(); // the buffer, from whichever QP (wc.qp_num) consumed it
///     if let Some(mr) = buf {
///         srq.post_recv(RecvWr::new(wc.wr_id, mr))?; // and back into the pool
///     }
/// }
/// # drop(qps);
/// # Ok(())
/// # }
/// ```
#[doc(alias = "ibv_srq")]
pub struct Srq {
    inner: Arc<SrqInner>,
    producer: SrqProducer,
}

/// What the QPs on an SRQ keep alive.
pub(crate) struct SrqInner {
    pub(crate) raw: NonNull<ffi::ibv_srq>,
    /// The slots holding posted receives, registered on `cq`.
    ring: Arc<Ring>,
    /// The CQ every completion of this SRQ's receives goes to.
    pub(crate) cq: Arc<CqInner>,
    attr: SrqAttr,
    pd: Pd,
}

impl SrqInner {
    /// Refuses a QP of another PD than the SRQ's: providers check the
    /// receives' buffers against the QP's PD (rxe) or the SRQ's, so only one
    /// PD for both lets a receive succeed everywhere.
    pub(crate) fn check_qp_pd(&self, pd: &Pd) -> Result<()> {
        if Arc::ptr_eq(&self.pd.inner, &pd.inner) {
            return Ok(());
        }
        Err(Error::InvalidArgument {
            what: "QP on a shared receive queue",
            reason: "its PD is not the SRQ's: create the QP with the PD the SRQ was created with \
                     (a receive's buffer can only be registered in one of them)"
                .into(),
        })
    }

    /// Admits a QP of `pd` whose receives complete on `recv_cq`: refused
    /// unless both are the SRQ's; the QP's caps then ask for no receive
    /// queue of its own (the SRQ reserved its depth on the CQ).
    pub(crate) fn admit_qp(&self, pd: &Pd, recv_cq: &Cq, caps: QpCaps) -> Result<QpCaps> {
        if !Arc::ptr_eq(&self.cq, &recv_cq.inner) {
            return Err(Error::SrqCqMismatch);
        }
        self.check_qp_pd(pd)?;
        Ok(QpCaps {
            max_recv_wr: 0,
            max_recv_sge: 0,
            ..caps
        })
    }
}

// SAFETY: ibv_srq may be used from any thread; posting needs &mut Srq (one
// producer), the ring is Send + Sync (see ledger/ring.rs).
unsafe impl Send for SrqInner {}
// SAFETY: &SrqInner reaches only thread-safe verbs (modify/query) and the ring.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // Reached after every QP on the SRQ was destroyed (they hold this Arc).
        // SAFETY: raw is a live SRQ owned by this value; after
        // ibv_destroy_srq returns the NIC no longer touches its receives.
        let rc = unsafe { ffi::ibv_destroy_srq(self.raw.as_ptr()) };
        if rc != 0 {
            // A QP created outside this crate may still use it: the buffers
            // must outlive it, so leak them.
            std::mem::forget(self.ring.clone());
            return;
        }
        self.ring.release_all();
        // Completions of its receives may still be in the CQ: the ring stays
        // registered (empty) until a poll finds the CQ empty.
        self.cq.rings.retire_destroyed(&self.ring, false);
    }
}

/// The error for an SRQ limit at or above the SRQ's depth.
fn limit_refused(limit: u32, depth: u32) -> Error {
    Error::InvalidArgument {
        what: "SRQ limit",
        reason: format!(
            "{limit} is not below the SRQ's depth of {depth} (the most receives it holds), so \
             the limit event would fire at once and after every re-arm; arm a limit below {depth}"
        ),
    }
}

impl Srq {
    /// Creates a shared receive queue (`ibv_create_srq`) in `pd` whose
    /// receives complete on `cq`
    /// (the receive CQ of every QP created on it), reserving `attr.max_wr`
    /// entries there ([`Error::CqTooSmall`] when they do not fit). A non-zero
    /// `attr.limit` is armed (see [`arm_limit`](Srq::arm_limit)).
    #[doc(alias = "ibv_create_srq")]
    pub fn new(pd: &Pd, cq: &Cq, attr: SrqAttr) -> Result<Srq> {
        if attr.max_wr == 0 {
            return Err(Error::InvalidArgument {
                what: "SRQ max_wr",
                reason: "a shared receive queue needs room for at least one receive".into(),
            });
        }
        // SAFETY: the CQ is live; `context` is a plain field set at creation.
        if unsafe { (*cq.as_raw()).context } != pd.context().as_raw() {
            return Err(Error::InvalidArgument {
                what: "completion queue",
                reason: "the PD and the CQ must come from the same Context (device open)".into(),
            });
        }
        if attr.limit >= attr.max_wr {
            // Refused before anything is created (arm_limit checks again
            // against the depth granted).
            return Err(limit_refused(attr.limit, attr.max_wr));
        }
        let reservation =
            (cq.inner.reserve(attr.max_wr.into(), "shared receive")).map_err(|e| {
                let ctx = pd.context();
                ctx.over_limit(e, "SRQ max_wr", attr.max_wr, "max_srq_wr", |a| a.max_srq_wr)
            })?;
        // Zeroed in memory, tail padding included, and filled field by field
        // (a struct literal would leave the padding undefined): libibverbs'
        // `ibv_cmd_create_srq` copies `sizeof(ibv_srq_init_attr)` bytes into an
        // `ibv_srq_init_attr_ex`, whose `comp_mask` lies where this struct has
        // its 4 bytes of tail padding, and then tests bits of `comp_mask`.
        let mut init = std::mem::MaybeUninit::<ffi::ibv_srq_init_attr>::zeroed();
        let p = init.as_mut_ptr();
        // SAFETY: `p` points at the zeroed struct; field stores through it
        // write those fields only, leaving the padding zero.
        unsafe {
            (*p).attr.max_wr = attr.max_wr;
            (*p).attr.max_sge = attr.max_sge;
        }
        // SAFETY: valid PD; `p` is a fully initialised struct (zero is a valid
        // null context and zero limit); the provider writes the granted sizes
        // back.
        let raw = verb!(ptr: unsafe { ffi::ibv_create_srq(pd.as_raw(), p) })?;
        // SAFETY: every field was initialised above (and by the provider).
        let init = unsafe { init.assume_init() };
        let granted = SrqAttr {
            // Never more posted than asked for (and reserved), even if the
            // device rounded up.
            max_wr: attr.max_wr.min(init.attr.max_wr),
            max_sge: attr.max_sge.min(init.attr.max_sge),
            limit: 0,
        };
        let ring = reservation.publish(|tag| Ring::new_srq(granted.max_wr, tag));
        let inner = Arc::new(SrqInner {
            raw,
            ring,
            cq: cq.inner.clone(),
            attr: granted,
            pd: pd.clone(),
        });
        let srq = Srq {
            inner,
            producer: SrqProducer::new(),
        };
        if attr.limit > 0 {
            srq.arm_limit(attr.limit)?;
        }
        Ok(srq)
    }

    pub(crate) fn inner(&self) -> &Arc<SrqInner> {
        &self.inner
    }

    /// The raw `ibv_srq`, valid while this `Srq` (or a QP on it) lives.
    ///
    /// A QP attached to it outside this crate must use the SRQ's CQ as its
    /// receive CQ: completions are validated by their token, and a token
    /// polled from another CQ could name a ring there.
    pub fn as_raw(&self) -> *mut ffi::ibv_srq {
        self.inner.raw.as_ptr()
    }

    /// The id async events name this SRQ by
    /// ([`AsyncEvent::SrqLimitReached`](crate::event::AsyncEvent::SrqLimitReached),
    /// [`AsyncEvent::SrqErr`](crate::event::AsyncEvent::SrqErr)).
    pub fn id(&self) -> SrqId {
        SrqId::from_raw(self.as_raw())
    }

    /// Most receives posted at once: the `max_wr` asked for (or less if the
    /// device granted less).
    pub fn depth(&self) -> u32 {
        self.inner.attr.max_wr
    }

    /// Most scatter entries per receive (as granted).
    pub fn max_sge(&self) -> u32 {
        self.inner.attr.max_sge
    }

    /// Receives posted and not yet retired by a polled completion. Keep it
    /// near [`depth`](Srq::depth) with [`refill`](Srq::refill).
    ///
    /// This is the crate's count, not the device's: receives whose
    /// completions wait in the CQ unpolled are counted here but no longer
    /// held by the device, so a limit event can come while `posted()` is
    /// still above the limit.
    ///
    /// A receive whose completion was consumed by
    /// [`Cq::poll_raw`](crate::cq::Cq::poll_raw), or that a QP had taken when it
    /// was destroyed mid-message (if the provider neither completes nor
    /// flushes it), stays counted here and keeps its slot; its buffer is
    /// released when the SRQ is destroyed.
    pub fn posted(&self) -> u64 {
        self.producer.in_flight(&self.inner.ring)
    }

    /// Arms the SRQ limit (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): when fewer
    /// than `limit` receives are left posted, the device raises
    /// `IBV_EVENT_SRQ_LIMIT_REACHED` once
    /// ([`AsyncEvent::SrqLimitReached`](crate::event::AsyncEvent::SrqLimitReached)
    /// with this SRQ's [`id`](Srq::id)) and disarms it; call again to re-arm.
    /// `limit` must be below [`depth`](Srq::depth), the most receives this
    /// SRQ ever holds ([`Error::InvalidArgument`] otherwise: the event would
    /// fire at once and after every re-arm); 0 disarms.
    #[doc(alias = "ibv_modify_srq")]
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        let depth = self.depth();
        if limit >= depth {
            return Err(limit_refused(limit, depth));
        }
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: valid SRQ; attr is initialised; only srq_limit is read.
        verb!(rc: unsafe { ffi::ibv_modify_srq(self.as_raw(), &mut attr, ffi::IBV_SRQ_LIMIT as i32) })?;
        Ok(())
    }

    /// The SRQ's attributes as the device reports them (`ibv_query_srq`):
    /// its real depth (may exceed [`depth`](Srq::depth)), scatter entries,
    /// and the armed limit (0 once the limit event fired, or never armed).
    ///
    /// # Errors
    /// [`Error::Unsupported`] where the provider cannot report them (siw).
    #[doc(alias = "ibv_query_srq")]
    pub fn query(&self) -> Result<SrqAttr> {
        let mut attr = MaybeUninit::<ffi::ibv_srq_attr>::zeroed();
        // SAFETY: valid SRQ and out-struct.
        verb!(rc: unsafe { ffi::ibv_query_srq(self.as_raw(), attr.as_mut_ptr()) }).map_err(
            |f| {
                if f.errno() == Some(libc::EOPNOTSUPP) {
                    return Error::Unsupported {
                        verb: f.verb,
                        hint: "the device's provider does not report SRQ attributes (siw has no \
                           query_srq): Srq::depth and Srq::max_sge give what creation granted"
                            .into(),
                    };
                }
                Error::from(f)
            },
        )?;
        // SAFETY: zeroed, then filled by the call; plain integers.
        let a = unsafe { attr.assume_init() };
        Ok(SrqAttr {
            max_wr: a.max_wr,
            max_sge: a.max_sge,
            limit: a.srq_limit,
        })
    }

    /// Posts one receive (`ibv_post_srq_recv`); its buffers come back with
    /// the completion of the QP that consumes it. Refused with [`Error::QueueFull`] when
    /// [`depth`](Srq::depth) receives are posted.
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn post_recv(&mut self, wr: RecvWr) -> Result<(), PostError> {
        self.post_recv_list(std::iter::once(wr))
    }

    /// Posts receives as chained lists (one `ibv_post_srq_recv` per 32). On
    /// failure, the requests taken from `wrs` that did not reach the NIC come
    /// back in the error with their buffers; `wrs` is not pulled any further.
    /// If `wrs` panics, the requests it yielded since the last verb call are
    /// taken back (their buffers drop with the unwind).
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn post_recv_list(
        &mut self,
        wrs: impl IntoIterator<Item = RecvWr>,
    ) -> Result<(), PostError> {
        let mut wrs = wrs.into_iter();
        let mut c_wrs = [const { MaybeUninit::<ffi::ibv_recv_wr>::uninit() }; CHUNK];
        let mut c_sges = [const { MaybeUninit::<ffi::ibv_sge>::uninit() }; CHUNK * MAX_SAFE_SGES];
        loop {
            let mut guard = Unstage {
                srq: self,
                tokens: [0; CHUNK],
                n: 0,
            };
            let mut exhausted = false;
            while guard.n < CHUNK {
                // (`next` may panic: the guard takes the staged requests back.)
                // Staged through a reference: by value it would be copied again.
                let next = wrs.next();
                let Some(wr) = &next else {
                    exhausted = true;
                    break;
                };
                let n = guard.n;
                let sges = &mut c_sges[n * MAX_SAFE_SGES..];
                // SAFETY: `next` is forgotten once staged, handed back when refused.
                match unsafe { guard.srq.stage(wr, &mut c_wrs[n], sges) } {
                    Ok(token) => {
                        std::mem::forget(next);
                        guard.tokens[n] = token;
                        guard.n += 1;
                    }
                    Err(error) => {
                        // Post what was staged before it, then report.
                        let earlier = guard.submit(&mut c_wrs, &mut c_sges);
                        let refused = next.map(|wr| (wr.wr_id, wr.into_buffers()));
                        return Err(match earlier {
                            Err(mut e) => {
                                e.unposted.extend(refused);
                                e
                            }
                            Ok(()) => PostError {
                                error,
                                unposted: refused.into_iter().collect(),
                            },
                        });
                    }
                }
            }
            guard.submit(&mut c_wrs, &mut c_sges)?;
            if exhausted {
                return Ok(());
            }
        }
    }

    /// Tops the SRQ up to its [`depth`](Srq::depth) with receives from
    /// `make` (called until the SRQ is full or it returns `None`) and returns
    /// how many were posted (one `ibv_post_srq_recv` per 32). Typical use:
    /// call it after each poll, with `make` taking buffers back from a pool,
    /// to keep the SRQ deep enough that no sender meets an RNR NAK.
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn refill(&mut self, make: impl FnMut() -> Option<RecvWr>) -> Result<usize, PostError> {
        let room = u64::from(self.depth()).saturating_sub(self.posted());
        // Counted as they are made, not as a change of `posted()`: a poll
        // (in `make`, or on another thread) lowers that meanwhile.
        let mut made = 0;
        let list = std::iter::from_fn(make)
            .take(room as usize)
            .inspect(|_| made += 1);
        self.post_recv_list(list)?;
        Ok(made)
    }

    /// [`refill`](Srq::refill) with a fallible `make`, such as an allocator:
    /// tops the SRQ up to its depth with the receives `make` returns, stops
    /// at its first error and returns it with how many receives were posted
    /// before it ([`RefillError::Make`]); `Ok` is the count when the SRQ is
    /// full.
    ///
    /// ```no_run
    /// # use rdma_verbs::prelude::*;
    /// # fn f(srq: &mut Srq, pd: &Pd) -> std::result::Result<(), Box<dyn std::error::Error>> {
    /// let posted = srq.try_refill(|| {
    ///     pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).map(|mr| RecvWr::new(0, mr))
    /// })?;
    /// # Ok(()) }
    /// ```
    #[doc(alias = "ibv_post_srq_recv")]
    pub fn try_refill<E>(
        &mut self,
        mut make: impl FnMut() -> Result<RecvWr, E>,
    ) -> Result<usize, RefillError<E>> {
        let mut failed = None;
        let posted = self
            .refill(|| match make() {
                Ok(wr) => Some(wr),
                Err(e) => {
                    failed = Some(e);
                    None
                }
            })
            .map_err(RefillError::Post)?;
        match failed {
            Some(error) => Err(RefillError::Make { error, posted }),
            None => Ok(posted),
        }
    }

    /// Checks `wr`, writes its C form into `c` and its SGEs into `sges`, and
    /// moves its buffers into a free slot; returns the token (its `wr_id`).
    /// On refusal nothing changed.
    ///
    /// # Safety
    /// On `Ok` the buffers of `*wr` were moved out: the caller must forget
    /// `*wr` (neither drop nor use it again).
    unsafe fn stage(
        &mut self,
        wr: &RecvWr,
        c: &mut MaybeUninit<ffi::ibv_recv_wr>,
        sges: &mut [MaybeUninit<ffi::ibv_sge>],
    ) -> Result<u64, Error> {
        wr.validate(self.inner.attr.max_sge, &self.inner.pd)?;
        let c = c.write(ffi::ibv_recv_wr {
            num_sge: post::fill_sges(&wr.bufs, sges),
            ..Default::default()
        });
        // SAFETY: producer side (&mut self holds the ring's only producer);
        // on Some the buffers moved into the slot and the caller forgets `wr`.
        let token = unsafe {
            self.inner
                .ring
                .fill_srq(&mut self.producer, wr.wr_id, &raw const wr.bufs)
        };
        let Some(token) = token else {
            return Err(Error::QueueFull {
                queue: "shared receive",
                depth: self.depth(),
            });
        };
        c.wr_id = token;
        Ok(token)
    }
}

/// The requests staged for one verb call; while not submitted, dropping it
/// (an unwind from the caller's iterator) takes them back out of the ring.
struct Unstage<'s> {
    srq: &'s mut Srq,
    tokens: [u64; CHUNK],
    n: usize,
}

impl Unstage<'_> {
    /// Posts the staged requests with one `ibv_post_srq_recv`; on refusal
    /// takes back those the device did not accept.
    fn submit(
        &mut self,
        c_wrs: &mut [MaybeUninit<ffi::ibv_recv_wr>],
        c_sges: &mut [MaybeUninit<ffi::ibv_sge>],
    ) -> Result<(), PostError> {
        let n = std::mem::take(&mut self.n);
        if n == 0 {
            return Ok(());
        }
        let head = post::link(c_wrs, c_sges, n);
        let mut bad = std::ptr::null_mut();
        // SAFETY: valid SRQ; the chain and its SGEs live on the caller's stack
        // frame; every SGE points into a buffer owned by a ring slot.
        let done = verb!(rc: unsafe { post::ibv_post_srq_recv(self.srq.as_raw(), head, &mut bad) });
        let Err(failed) = done else {
            return Ok(());
        };
        // Requests from `bad` on were refused; if the provider did not say
        // which, keep them all in the ring (the NIC may own some).
        let from = post::bad_index(bad, head, n).unwrap_or(n);
        let srq = &mut *self.srq;
        let unposted = self.tokens[from..n]
            .iter()
            // SAFETY: producer side; the device refused these requests.
            .filter_map(|&t| unsafe { srq.inner.ring.unfill_srq(&mut srq.producer, t) })
            .collect();
        Err(PostError {
            error: failed.into(),
            unposted,
        })
    }
}

impl Drop for Unstage<'_> {
    fn drop(&mut self) {
        let n = std::mem::take(&mut self.n);
        let srq = &mut *self.srq;
        let unstaged: Vec<(u64, Sges)> = self.tokens[..n]
            .iter()
            // SAFETY: producer side; the staged requests were never submitted.
            .filter_map(|&t| unsafe { srq.inner.ring.unfill_srq(&mut srq.producer, t) })
            .collect();
        // Their buffers drop here, during the unwind.
        crate::ledger::sges::drop_each_catching(unstaged);
    }
}

impl fmt::Debug for Srq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Srq")
            .field("depth", &self.depth())
            .field("max_sge", &self.max_sge())
            .field("posted", &self.posted())
            .finish()
    }
}

/// Why [`Srq::try_refill`] stopped before the SRQ was full.
#[derive(Debug)]
pub enum RefillError<E> {
    /// `make` failed; the receives it made before were posted.
    Make {
        /// `make`'s error.
        error: E,
        /// Receives posted before it.
        posted: usize,
    },
    /// Posting was refused (as [`Srq::refill`]'s error).
    Post(PostError),
}

impl<E: std::fmt::Display> std::fmt::Display for RefillError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RefillError::Make { error, posted } => write!(
                f,
                "making a receive for the SRQ failed after {posted} were posted: {error}"
            ),
            RefillError::Post(e) => e.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for RefillError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            RefillError::Make { error, .. } => Some(error),
            RefillError::Post(e) => Some(e),
        }
    }
}
