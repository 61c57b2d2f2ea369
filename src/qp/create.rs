//! Creating QPs: the RC constructors and the one path every transport builds through.

use super::*;
use crate::error::Error;

impl Qp<Rc, Reset> {
    /// Creates an RC QP in `pd` whose sends complete on `send_cq` and receives
    /// on `recv_cq` (they may be the same CQ).
    ///
    /// Make each CQ deep enough for the signaled work requests of every QP on it.
    ///
    /// The QP posts its sends with the extended work request API where the
    /// provider supports it, with `ibv_post_send` otherwise; see
    /// [`send_api`](Qp::send_api) and [`SendApi`].
    #[doc(alias = "ibv_create_qp")]
    #[doc(alias = "ibv_create_qp_ex")]
    pub fn new(pd: &Pd, send_cq: &Cq, recv_cq: &Cq, caps: QpCaps) -> Result<Qp<Rc, Reset>> {
        Qp::create_with(pd, send_cq, recv_cq, caps, None, None, |_| {})
    }

    /// [`new`](Qp::new) with the send API chosen by the caller: `Legacy`
    /// always works; `Extended` fails where the provider cannot create an
    /// extended RC QP, instead of falling back: with [`Error::Unsupported`]
    /// when it says so (`EOPNOTSUPP`, as siw does), else with [`Error::Verb`]
    /// for `ibv_create_qp_ex` and the provider's errno.
    #[doc(alias = "ibv_create_qp")]
    #[doc(alias = "ibv_create_qp_ex")]
    pub fn new_with_send_api(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        api: SendApi,
    ) -> Result<Qp<Rc, Reset>> {
        Qp::create_with(pd, send_cq, recv_cq, caps, None, Some(api), |_| {})
    }

    /// Creates an RC QP whose receives come from the shared receive queue
    /// `srq` (see [`crate::srq`]): its own receive queue is not used
    /// (`caps.max_recv_wr` and `max_recv_sge` are ignored, and
    /// [`post_recv`](Qp::post_recv) is refused with [`Error::QpUsesSrq`]),
    /// and it reserves no receive entries on `recv_cq`, which must be the CQ
    /// the SRQ was created with ([`Error::SrqCqMismatch`] otherwise), and
    /// `pd` must be the SRQ's ([`Error::InvalidArgument`] otherwise:
    /// providers differ in which of the two PDs a receive's buffer is checked
    /// against). The QP keeps the SRQ alive.
    #[doc(alias = "ibv_create_qp")]
    #[doc(alias = "ibv_create_qp_ex")]
    pub fn new_with_srq(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        caps: QpCaps,
    ) -> Result<Qp<Rc, Reset>> {
        let srq = srq.inner();
        let caps = srq.admit_qp(pd, recv_cq, caps)?;
        let raw_srq = srq.raw.as_ptr();
        Qp::create_with(
            pd,
            send_cq,
            recv_cq,
            caps,
            Some(srq.clone()),
            None,
            |init| {
                init.srq = raw_srq;
            },
        )
    }
}

impl<T: QpType> Qp<T, Reset> {
    pub(super) fn create(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
    ) -> Result<Qp<T, Reset>> {
        Qp::create_with(
            pd,
            send_cq,
            recv_cq,
            caps,
            None,
            Some(SendApi::Legacy),
            |_| {},
        )
    }

    /// [`create`](Qp::create), on `srq` if given, with `adjust` applied to the
    /// init attributes last. `api`: the send API (RC only; `None`: extended
    /// where the provider has it, legacy otherwise).
    pub(super) fn create_with(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        srq: Option<Arc<SrqInner>>,
        api: Option<SendApi>,
        adjust: impl FnOnce(&mut ffi::ibv_qp_init_attr),
    ) -> Result<Qp<T, Reset>> {
        // The kernel resolves CQ handles in the PD's context: a CQ of another
        // context would silently name some other CQ there.
        let ctx = pd.context().as_raw();
        // SAFETY: both CQs are live; `context` is a plain field set at creation.
        let same =
            unsafe { (*send_cq.as_raw()).context == ctx && (*recv_cq.as_raw()).context == ctx };
        if !same {
            return Err(Error::InvalidArgument {
                what: "completion queue",
                reason: "the PD and both CQs must come from the same Context (device open)".into(),
            });
        }
        // iWARP has RC only; siw would fail the create with a bare EOPNOTSUPP.
        if T::RAW != ffi::IBV_QPT_RC && pd.context().is_iwarp() {
            return Err(pd
                .context()
                .iwarp_unsupported("ibv_create_qp", "UD or UC QPs: use RC (through rdma_cm)"));
        }
        let try_extended = T::RAW == ffi::IBV_QPT_RC && api != Some(SendApi::Legacy);
        let mut extended = false;
        // SAFETY: ibv_create_qp and create_rc create a QP of type T from
        // exactly `init` (create_rc only when T is RC) and write the granted
        // caps back.
        let mut qp = unsafe {
            Qp::build(
                pd,
                send_cq,
                recv_cq,
                caps,
                random_psn(),
                1,
                None,
                srq,
                |init| {
                    adjust(init);
                    if try_extended {
                        match create_extended(pd, init) {
                            Ok(raw) => {
                                extended = true;
                                return Ok(raw);
                            }
                            Err(e) if api == Some(SendApi::Extended) => {
                                return Err(extended_refused(e));
                            }
                            Err(_) => {}
                        }
                    }
                    // Not the errno of an extended create refused above.
                    crate::sys::call::clear_errno();
                    // SAFETY: valid PD, CQs and SRQ (kept alive by the Arcs the Qp
                    // stores); init is fully initialised; the provider writes the
                    // granted caps back.
                    let raw = ffi::ibv_create_qp(pd.as_raw(), init);
                    NonNull::new(raw).ok_or_else(|| Error::verb("ibv_create_qp", last_errno()))
                },
            )?
        };
        if extended {
            // SAFETY: created by create_rc with RC_SEND_OPS; the SendEx lives
            // in the QP's core, which destroys the QP only when dropped.
            qp.core.ext.send_ex = unsafe { send_ex::SendEx::load(qp.core.raw) };
            if qp.core.ext.send_ex.is_none() && api == Some(SendApi::Extended) {
                return Err(Error::Unsupported {
                    verb: "ibv_qp_to_qp_ex",
                    hint: NO_EXTENDED_API.into(),
                });
            }
        }
        Ok(qp)
    }
}

impl<T: QpType, S: QpState> Qp<T, S> {
    /// Creates a QP with `create`, after reserving room on its CQs for every
    /// completion its queues may produce, and registers its slot rings there.
    ///
    /// # Safety
    /// `create` creates a QP of type `T` in `pd` from the `ibv_qp_init_attr`
    /// it is given (whose CQs it must not change), leaving it in state `S`
    /// with nothing posted, writes the granted caps back into it, and hands
    /// over ownership: the returned `Qp` destroys it with `ibv_destroy_qp` and
    /// then drops `keepalive`. `psn` and `port` are what the QP is set up with.
    /// With `srq`, `create` must create the QP on that SRQ (`init.srq`): its
    /// receive ring then has depth 0 and reserves nothing on `recv_cq` (the
    /// SRQ reserved its depth there), and the QP keeps the SRQ alive.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn build(
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: QpCaps,
        psn: u32,
        port: u8,
        keepalive: Option<Box<dyn Any + Send + Sync>>,
        srq: Option<Arc<SrqInner>>,
        create: impl FnOnce(&mut ffi::ibv_qp_init_attr) -> Result<NonNull<ffi::ibv_qp>>,
    ) -> Result<Qp<T, S>> {
        let sq_want = caps.max_send_wr.max(1);
        let rq_want = if srq.is_some() {
            0
        } else {
            caps.max_recv_wr.max(1)
        };
        let ctx = pd.context();
        let sq_res = (send_cq.inner.reserve(sq_want.into(), "send"))
            .map_err(|e| ctx.over_limit(e, "max_send_wr", sq_want, "max_qp_wr", |a| a.max_qp_wr))?;
        let rq_res = (recv_cq.inner.reserve(rq_want.into(), "receive"))
            .map_err(|e| ctx.over_limit(e, "max_recv_wr", rq_want, "max_qp_wr", |a| a.max_qp_wr))?;
        let mut init = caps.init_attr(send_cq.as_raw(), recv_cq.as_raw(), T::RAW);
        let raw = create(&mut init).map_err(|e| pd.context().explain_queue_refusal(e))?;
        let got = caps.granted(&init);
        // SAFETY: `raw` is live (per the contract); qp_num is a plain field.
        let qp_num = unsafe { (*raw.as_ptr()).qp_num };
        // Never more in flight than asked for, even if the device rounded up.
        let (iwarp, any_order) = (ctx.is_iwarp(), ctx.completes_sends_in_any_order());
        let sq = sq_res.publish(|tag| {
            let ring = Ring::new(sq_want.min(got.max_send_wr), tag, qp_num);
            if any_order {
                ring.completing_in_any_order()
            } else if iwarp {
                ring.completing_out_of_order()
            } else {
                ring
            }
        });
        let rq = rq_res.publish(|tag| Ring::new(rq_want.min(got.max_recv_wr), tag, qp_num));
        let qp = Qp {
            core: QpCore {
                raw,
                sq,
                rq,
                sq_head: 0,
                rq_head: 0,
                caps: QpCaps {
                    max_send_wr: caps.max_send_wr.min(got.max_send_wr),
                    max_recv_wr: caps.max_recv_wr.min(got.max_recv_wr),
                    ..got
                },
                psn,
                port,
                send_cq: send_cq.inner.clone(),
                recv_cq: recv_cq.inner.clone(),
                pd: pd.clone(),
                ext: QpExtensions::new(srq, keepalive),
                raw_posted: false,
            },
            _marker: PhantomData,
        };
        if got.max_send_sge == 0 {
            // Asked for at least one (`QpCaps::init_attr`): the post path's
            // quick pass and the builders' `ibv_wr_set_sge`, which providers
            // do not check, rely on every QP taking one send SGE. (Dropping
            // `qp` destroys it.)
            return Err(Error::Unsupported {
                verb: "ibv_create_qp",
                hint: "the provider granted no send scatter/gather entry for a request of \
                       at least one; this crate needs one per QP"
                    .into(),
            });
        }
        Ok(qp)
    }
}

/// A starting PSN: a splitmix64 step over a per-process seed from
/// `getrandom`, so consecutive QPs get unrelated PSNs (a stale packet of an
/// earlier connection does not fall into a new one's window) without a
/// system call per QP.
pub(super) fn random_psn() -> u32 {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEED: OnceLock<u64> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let seed = *SEED.get_or_init(|| {
        let mut b = [0u8; 8];
        // SAFETY: getrandom writes at most 8 bytes into b.
        let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
        if n == 8 {
            u64::from_ne_bytes(b)
        } else {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id())
        }
    });
    let mut z = seed.wrapping_add(
        COUNT
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z as u32) & 0x00ff_ffff
}

/// What an `Extended` QP the provider cannot make is told to do instead.
const NO_EXTENDED_API: &str = "the device's provider has no extended send API (ibv_wr_*) for RC QPs: \
     create the QP with SendApi::Legacy, or with Qp::new, which falls back to it";

/// The error of an `Extended` QP whose `ibv_create_qp_ex` failed with `e`.
#[cold]
fn extended_refused(e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return Error::Unsupported {
            verb: "ibv_create_qp_ex",
            hint: NO_EXTENDED_API.into(),
        };
    }
    Error::verb("ibv_create_qp_ex", e)
}

/// Creates an extended RC QP from `init`: with ATOMIC_WRITE and FLUSH among its
/// send operations where the context's QPs take them (`Context::atomic_write`,
/// `Context::flush_placements`), else with [`send_ex::RC_SEND_OPS`]. Refused,
/// it tries again without FLUSH (the newer), then without ATOMIC_WRITE; only
/// when a QP without an operation is then made is that operation turned off
/// for the whole context, so that no QP made without it is asked for it. A
/// refusal of every form (bad caps, no memory) turns nothing off.
fn create_extended(
    pd: &Pd,
    init: &mut ffi::ibv_qp_init_attr,
) -> std::result::Result<NonNull<ffi::ibv_qp>, std::io::Error> {
    let ctx = pd.context();
    let (atomic_write, flush) = (ctx.atomic_write(), ctx.flush_placements() != 0);
    let forms = [(atomic_write, flush), (atomic_write, false), (false, false)];
    let mut refused = None;
    for (i, &(aw, fl)) in forms.iter().enumerate() {
        if i > 0 && forms[i - 1] == (aw, fl) {
            continue;
        }
        let mut ops = send_ex::RC_SEND_OPS;
        if aw {
            ops |= send_ex::ATOMIC_WRITE_OP;
        }
        if fl {
            ops |= send_ex::FLUSH_OP;
        }
        // SAFETY: valid PD, CQs and SRQ of one context (checked by the
        // caller; kept alive by the Arcs the Qp stores).
        match unsafe { send_ex::create_rc(pd.as_raw(), init, ops) } {
            Ok(raw) => {
                // Made without what the forms before it had: that refused them.
                if flush && !fl {
                    ctx.refuse_flush();
                }
                if atomic_write && !aw {
                    ctx.refuse_atomic_write();
                }
                return Ok(raw);
            }
            Err(e) => refused = Some(e),
        }
    }
    Err(refused.unwrap_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL)))
}
