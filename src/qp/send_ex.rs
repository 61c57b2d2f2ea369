//! Extended send verbs (`ibv_wr_*` on an `ibv_qp_ex`) with automatic fallback
//! to the legacy `ibv_post_send`.
//!
//! An RC QP made by [`Qp::new`](super::Qp::new) or
//! [`Qp::new_with_srq`](super::Qp::new_with_srq) is created with
//! `ibv_create_qp_ex` and the RC send operations (SEND, SEND with immediate,
//! RDMA WRITE, WRITE with immediate, READ, both atomics) when the provider
//! supports that, and with `ibv_create_qp` otherwise;
//! [`Qp::send_api`](super::Qp::send_api) tells which
//! ([`Qp::new_with_send_api`](super::Qp::new_with_send_api) chooses). The safe
//! API is the same over both: raw and drain-marker posts, scoped lists from
//! an iterator, and safe requests the builders cannot express (inline data,
//! several buffers) are written as a C chain first, which an extended QP
//! replays as `ibv_wr_*` calls between one `ibv_wr_start` and one
//! `ibv_wr_complete`; other safe requests (`qp/built.rs`: one alone, or a
//! list's built as the caller's iterator yields them between
//! `SendEx::start` and `SendEx::complete`), scoped single posts and prepared
//! lists skip the C form and call the builders directly (`SendEx::post_one`,
//! `SendEx::post_list`, which picks the builder once for a list of one
//! operation).
//!
//! A chain with a request the builder calls cannot express exactly (another
//! opcode, more than one SGE, more than one inline piece) is posted whole with
//! `ibv_post_send` instead, after `ibv_wr_abort`: `ibv_wr_post(3)` allows the
//! two APIs on one QP outside each other's critical region. If it also holds
//! an ATOMIC_WRITE or FLUSH, which only the builders express, it is posted in
//! order in runs, each with the API that expresses it (`post_in_runs`). More than one SGE
//! is excluded because rdma-core 44's rxe `wr_set_sge_list` records a wrong
//! message length for such lists (fixed in rdma-core 64).
//!
//! `ibv_wr_complete` is documented to post all or nothing (`ibv_wr_post(3)`,
//! RETURN VALUE), but a failure does not prove that nothing reached the
//! queue: rxe's `wr_complete` publishes the requests (the producer index)
//! before its doorbell `write`, which can fail. So a failed
//! `ibv_wr_complete` names no refused request (`bad` stays null), as a
//! legacy post that does not say which failed: the callers keep the
//! requests' buffers until completions retire them.

use std::ptr::NonNull;

use crate::error::last_errno;
use crate::ffi;

/// How a QP posts its send requests; see [`Qp::send_api`](super::Qp::send_api).
///
/// An RC QP made by [`Qp::new`](super::Qp::new) or
/// [`Qp::new_with_srq`](super::Qp::new_with_srq) is created with
/// `ibv_create_qp_ex` and the RC send operations (SEND, SEND with immediate,
/// RDMA WRITE, WRITE with immediate, READ, both atomics) when the provider
/// supports that, and with `ibv_create_qp` otherwise
/// ([`Qp::new_with_send_api`](super::Qp::new_with_send_api) chooses). The safe
/// API is the same over both: an extended QP replays a list of requests as
/// `ibv_wr_*` calls between one `ibv_wr_start` and one `ibv_wr_complete`. A
/// list with a request the builders cannot express exactly (another opcode,
/// more than one SGE, more than one inline piece) is posted with
/// `ibv_post_send` instead (`ibv_wr_post(3)` allows the two APIs on one QP
/// outside each other's critical region), in runs with the builders' when it
/// also holds an ATOMIC_WRITE or FLUSH, which only they express.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SendApi {
    /// The extended work request API (`ibv_wr_start`, `ibv_wr_rdma_write`,
    /// `ibv_wr_set_sge`, ..., `ibv_wr_complete`) on an `ibv_qp_ex`: fewer
    /// instructions per request on providers that implement it (rxe, mlx5).
    Extended,
    /// `ibv_post_send` with a chain of `ibv_send_wr`, which every provider
    /// implements.
    Legacy,
}

/// The RC send operations an extended QP is created with.
pub(crate) const RC_SEND_OPS: u64 = (ffi::IBV_QP_EX_WITH_SEND
    | ffi::IBV_QP_EX_WITH_SEND_WITH_IMM
    | ffi::IBV_QP_EX_WITH_RDMA_WRITE
    | ffi::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
    | ffi::IBV_QP_EX_WITH_RDMA_READ
    | ffi::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP
    | ffi::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) as u64;

/// ATOMIC_WRITE, added to [`RC_SEND_OPS`] on devices that execute it.
pub(crate) const ATOMIC_WRITE_OP: u64 = ffi::IBV_QP_EX_WITH_ATOMIC_WRITE as u64;

/// FLUSH, added to [`RC_SEND_OPS`] on devices that execute it, with a libibverbs that has
/// it (`ffi::has_wr_flush`).
pub(crate) const FLUSH_OP: u64 = ffi::IBV_QP_EX_WITH_FLUSH;

/// Creates an RC QP from `init` with `ibv_create_qp_ex` and the send
/// operations `ops` ([`RC_SEND_OPS`], perhaps with [`ATOMIC_WRITE_OP`]); on
/// success writes the granted caps back into `init`. On failure returns the
/// errno (`EOPNOTSUPP` where the provider has no extended QPs or not these
/// operations).
///
/// # Safety
/// `pd` is live and `init` describes an RC QP whose CQs (and SRQ) are live
/// and of `pd`'s context.
pub(crate) unsafe fn create_rc(
    pd: *mut ffi::ibv_pd,
    init: &mut ffi::ibv_qp_init_attr,
    ops: u64,
) -> Result<NonNull<ffi::ibv_qp>, std::io::Error> {
    let mut ex = ffi::ibv_qp_init_attr_ex {
        qp_context: init.qp_context,
        send_cq: init.send_cq,
        recv_cq: init.recv_cq,
        srq: init.srq,
        cap: init.cap,
        qp_type: init.qp_type,
        sq_sig_all: init.sq_sig_all,
        comp_mask: ffi::IBV_QP_INIT_ATTR_PD | ffi::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        pd,
        send_ops_flags: ops,
        ..Default::default()
    };
    // A provider may refuse without setting errno: none left from before.
    crate::sys::call::clear_errno();
    // SAFETY: pd is live (contract) and its context is the QP's; `ex` is
    // fully initialised, with the comp_mask naming the fields set.
    let raw = unsafe { ffi::ibv_create_qp_ex((*pd).context, &mut ex) };
    match NonNull::new(raw) {
        Some(raw) => {
            init.cap = ex.cap;
            Ok(raw)
        }
        None => Err(last_errno()),
    }
}

/// Calls the entry point `$f` of the `ibv_qp_ex` at `$q` with `$args`, read
/// at the call as the `ibv_wr_*` inline functions do (keeping copies would
/// cost a spill of all of them per post).
///
/// Only for a `SendEx`'s `qpx`: [`SendEx::load`] checked every entry point
/// used here is set, and providers set them once, at creation.
macro_rules! op {
    ($q:expr, $f:ident $(, $args:expr)*) => {
        ((*$q).$f.unwrap_unchecked())($q $(, $args)*)
    };
}

/// The extended interface of one QP: its `ibv_qp_ex`, whose builder and
/// setter entry points were checked at creation. A copy is used only while
/// the QP lives, as the original is.
#[derive(Clone, Copy)]
pub(crate) struct SendEx {
    qpx: NonNull<ffi::ibv_qp_ex>,
}

impl SendEx {
    /// The extended interface of `qp`, if its provider filled in every entry
    /// point the RC operations need.
    ///
    /// # Safety
    /// `qp` is live and was created by `ibv_create_qp_ex` with
    /// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS` and [`RC_SEND_OPS`]; the result is
    /// used only while it lives.
    pub(crate) unsafe fn load(qp: NonNull<ffi::ibv_qp>) -> Option<SendEx> {
        // SAFETY: per the contract, qp was created with send ops, so the
        // provider embeds it in an ibv_qp_ex (ibv_qp_to_qp_ex(3)).
        let qpx = NonNull::new(unsafe { ffi::ibv_qp_to_qp_ex(qp.as_ptr()) })?;
        // SAFETY: qpx is live; the entry points are plain fields the provider
        // set at creation.
        let x = unsafe { qpx.as_ref() };
        let all = x.wr_start.is_some()
            && x.wr_complete.is_some()
            && x.wr_abort.is_some()
            && x.wr_send.is_some()
            && x.wr_send_imm.is_some()
            && x.wr_rdma_write.is_some()
            && x.wr_rdma_write_imm.is_some()
            && x.wr_rdma_read.is_some()
            && x.wr_atomic_cmp_swp.is_some()
            && x.wr_atomic_fetch_add.is_some()
            && x.wr_set_sge.is_some()
            && x.wr_set_sge_list.is_some()
            && x.wr_set_inline_data.is_some();
        all.then_some(SendEx { qpx })
    }

    /// Whether this QP, of a context whose QPs take ATOMIC_WRITE
    /// (`Context::atomic_write`, which a QP created without the operation
    /// turns off), has its builder.
    pub(crate) fn atomic_write(&self) -> bool {
        // SAFETY: qpx is live while the QP is; the entry point is a plain field
        // the provider set at creation.
        unsafe { (*self.qpx.as_ptr()).wr_atomic_write.is_some() }
    }

    /// Whether this QP, of a context whose QPs take FLUSH (`Context::flush_placements`),
    /// has its builder: never on a libibverbs older than rdma-core 45, whose `ibv_qp_ex` has
    /// no such field (`ffi::wr_flush`).
    pub(crate) fn flush(&self) -> bool {
        // SAFETY: qpx is live while the QP is, an ibv_qp_ex of the loaded library's provider.
        unsafe { ffi::wr_flush(self.qpx.as_ptr()).is_some() }
    }

    /// Builds `w` after `ibv_wr_start`; false if the builders cannot express
    /// it exactly (nothing about it then reaches the NIC: the caller aborts).
    ///
    /// # Safety
    /// Inside this QP's critical region; `w` is well formed (its `sg_list`
    /// holds `num_sge` entries).
    #[inline(always)]
    unsafe fn build(&self, w: &ffi::ibv_send_wr) -> bool {
        let q = self.qpx.as_ptr();
        if !(0..=1).contains(&w.num_sge) {
            return false;
        }
        // SAFETY: inside the critical region (contract), through `op!`'s
        // checked entry points; wr_id and wr_flags are read by the next
        // builder call; the unions are read as the opcode defines them
        // (ibv_post_send(3)).
        unsafe {
            (*q).wr_id = w.wr_id;
            (*q).wr_flags = w.send_flags;
            // Each arm reads only the union fields its opcode defines.
            let (rdma, atomic) = (&w.wr.rdma, &w.wr.atomic);
            match w.opcode {
                ffi::IBV_WR_RDMA_WRITE => op!(q, wr_rdma_write, rdma.rkey, rdma.remote_addr),
                ffi::IBV_WR_SEND => op!(q, wr_send),
                ffi::IBV_WR_RDMA_READ => op!(q, wr_rdma_read, rdma.rkey, rdma.remote_addr),
                ffi::IBV_WR_SEND_WITH_IMM => op!(q, wr_send_imm, w.__bindgen_anon_1.imm_data),
                ffi::IBV_WR_RDMA_WRITE_WITH_IMM => op!(
                    q,
                    wr_rdma_write_imm,
                    rdma.rkey,
                    rdma.remote_addr,
                    w.__bindgen_anon_1.imm_data
                ),
                ffi::IBV_WR_ATOMIC_FETCH_AND_ADD => op!(
                    q,
                    wr_atomic_fetch_add,
                    atomic.rkey,
                    atomic.remote_addr,
                    atomic.compare_add
                ),
                ffi::IBV_WR_ATOMIC_CMP_AND_SWP => op!(
                    q,
                    wr_atomic_cmp_swp,
                    atomic.rkey,
                    atomic.remote_addr,
                    atomic.compare_add,
                    atomic.swap
                ),
                ffi::IBV_WR_ATOMIC_WRITE => {
                    // The request carries its data: no setter follows.
                    return self.build_atomic_write(
                        atomic.rkey,
                        atomic.remote_addr,
                        &atomic.compare_add,
                    );
                }
                ffi::IBV_WR_FLUSH => {
                    // The request carries no data: no setter follows. `fill_ffi` packs the
                    // placement in the low byte of `swap`, the level in the next.
                    return self.build_flush(
                        atomic.rkey,
                        atomic.remote_addr,
                        atomic.compare_add,
                        atomic.swap,
                    );
                }
                _ => return false,
            }
            let inline = w.send_flags & ffi::ibv_send_flags::IBV_SEND_INLINE.0 != 0;
            match (w.num_sge, inline) {
                (0, false) => op!(q, wr_set_sge_list, 0, std::ptr::null()),
                (0, true) => op!(q, wr_set_inline_data, std::ptr::null_mut(), 0),
                (_, false) => {
                    let s = &*w.sg_list;
                    op!(q, wr_set_sge, s.lkey, s.addr, s.length)
                }
                (_, true) => {
                    let s = &*w.sg_list;
                    op!(q, wr_set_inline_data, s.addr as *mut _, s.length as usize)
                }
            }
        }
        true
    }
}

/// One request in the form the builders take: what a scoped request holds,
/// posted without writing a C request first.
pub(crate) struct Request {
    pub(crate) wr_id: u64,
    pub(crate) flags: u32,
    pub(crate) opcode: u32,
    pub(crate) rkey: u32,
    pub(crate) remote_addr: u64,
    /// The atomic compare (or add) operand, or the immediate (big-endian,
    /// low half).
    pub(crate) operand: u64,
    pub(crate) swap: u64,
    /// Not inline; a zero length means no SGE.
    pub(crate) sge: ffi::ibv_sge,
}

impl SendEx {
    /// Builds `r` with `wr_id` after `ibv_wr_start`; false (nothing built)
    /// for an opcode the builders here do not take.
    ///
    /// # Safety
    /// Inside this QP's critical region.
    #[inline(always)]
    unsafe fn build_request(&self, r: &Request, wr_id: u64) -> bool {
        let q = self.qpx.as_ptr();
        let (rkey, addr) = (r.rkey, r.remote_addr);
        // SAFETY: inside the critical region (contract), through `op!`'s
        // checked entry points; wr_id and wr_flags are read by the builder.
        unsafe {
            (*q).wr_id = wr_id;
            (*q).wr_flags = r.flags;
            match r.opcode {
                ffi::IBV_WR_RDMA_WRITE => op!(q, wr_rdma_write, rkey, addr),
                ffi::IBV_WR_SEND => op!(q, wr_send),
                ffi::IBV_WR_RDMA_READ => op!(q, wr_rdma_read, rkey, addr),
                ffi::IBV_WR_SEND_WITH_IMM => op!(q, wr_send_imm, r.operand as u32),
                ffi::IBV_WR_RDMA_WRITE_WITH_IMM => {
                    op!(q, wr_rdma_write_imm, rkey, addr, r.operand as u32)
                }
                ffi::IBV_WR_ATOMIC_FETCH_AND_ADD => {
                    op!(q, wr_atomic_fetch_add, rkey, addr, r.operand)
                }
                ffi::IBV_WR_ATOMIC_CMP_AND_SWP => {
                    op!(q, wr_atomic_cmp_swp, rkey, addr, r.operand, r.swap)
                }
                _ => return false,
            }
            self.set_data(r);
        }
        true
    }

    /// Builds an ATOMIC_WRITE of the 8 bytes at `value` to `rkey`/`addr`, the
    /// request's data included; false (nothing built) when the QP does not
    /// take it.
    ///
    /// # Safety
    /// Inside this QP's critical region, `wr_id` and `wr_flags` set.
    #[cold]
    #[inline(never)]
    unsafe fn build_atomic_write(&self, rkey: u32, addr: u64, value: &u64) -> bool {
        let q = self.qpx.as_ptr();
        // SAFETY: q is this live QP's ibv_qp_ex; the entry point is a plain
        // field the provider set at creation.
        match unsafe { (*q).wr_atomic_write } {
            Some(f) => {
                // SAFETY: inside the critical region (contract), with the builder
                // of a QP created with ATOMIC_WRITE; it copies the 8 bytes at
                // `value` into the request before it returns (`atomic_wr` is
                // read by the call, ibv_wr_post(3)).
                unsafe { f(q, rkey, addr, std::ptr::from_ref(value).cast()) };
                true
            }
            None => false,
        }
    }

    /// Builds a FLUSH of `len` bytes at `rkey`/`addr`, `kind` holding the placement (low
    /// byte) and the level (next byte); false (nothing built) when the QP does not take it.
    ///
    /// # Safety
    /// Inside this QP's critical region, `wr_id` and `wr_flags` set.
    #[cold]
    #[inline(never)]
    unsafe fn build_flush(&self, rkey: u32, addr: u64, len: u64, kind: u64) -> bool {
        let q = self.qpx.as_ptr();
        let Ok(len) = usize::try_from(len) else {
            return false;
        };
        // SAFETY: q is this live QP's ibv_qp_ex; `wr_flush` reads the field only where the
        // loaded library has it.
        match unsafe { ffi::wr_flush(q) } {
            Some(f) => {
                // SAFETY: inside the critical region (contract), with the builder of a QP
                // created with FLUSH; it takes its arguments by value.
                unsafe { f(q, rkey, addr, len, kind as u8, (kind >> 8) as u8) };
                true
            }
            None => false,
        }
    }

    /// Sets the built request's data: `r`'s SGE, or none.
    ///
    /// # Safety
    /// Inside this QP's critical region, right after a builder.
    #[inline(always)]
    unsafe fn set_data(&self, r: &Request) {
        let q = self.qpx.as_ptr();
        let s = &r.sge;
        // SAFETY: per the contract, through `op!`'s checked entry points.
        unsafe {
            if s.length != 0 {
                op!(q, wr_set_sge, s.lkey, s.addr, s.length)
            } else {
                op!(q, wr_set_sge_list, 0, std::ptr::null())
            }
        }
    }

    /// Posts `r` alone (`ibv_wr_start`, builder, setter, `ibv_wr_complete`):
    /// `Some(0)`, or `Some(errno)` from `ibv_wr_complete` (then `r` may have
    /// reached the queue: see the module's docs), or `None`, with nothing
    /// posted, for an opcode the builders here do not take.
    ///
    /// # Safety
    /// As [`post_chain`]'s for a one-request chain of `r`.
    #[inline(always)]
    pub(crate) unsafe fn post_one(&self, r: &Request) -> Option<i32> {
        let q = self.qpx.as_ptr();
        // SAFETY: q is a live extended QP (contract); the critical region
        // opened here is closed on both paths.
        unsafe {
            op!(q, wr_start);
            if !self.build_request(r, r.wr_id) {
                // Nothing was built: close the region empty.
                op!(q, wr_abort);
                return None;
            }
            Some(op!(q, wr_complete))
        }
    }

    /// Opens a critical region (`ibv_wr_start`): the QP's send queue is
    /// the provider's until [`complete`](SendEx::complete) or
    /// [`abort`](SendEx::abort).
    ///
    /// # Safety
    /// The QP lives; no region of it is open; one of the two closes this one.
    #[inline(always)]
    pub(crate) unsafe fn start(&self) {
        // SAFETY: per the contract, through `op!`'s checked entry point.
        unsafe { op!(self.qpx.as_ptr(), wr_start) }
    }

    /// Builds `r` (its `wr_id` the ring's token) in the open region; false,
    /// with nothing built, for an opcode the builders here do not take
    /// (which [`send_request`](crate::qp::post::send_request) never gives).
    ///
    /// # Safety
    /// Inside this QP's critical region; `r`'s SGE names memory that stays
    /// valid until its completion (a ring slot's buffer).
    #[inline(always)]
    pub(crate) unsafe fn build_one(&self, r: &Request) -> bool {
        // SAFETY: per the contract.
        unsafe { self.build_request(r, r.wr_id) }
    }

    /// Closes the open region, posting what it built (`ibv_wr_complete`):
    /// 0, or the errno (then the requests may have reached the queue: see
    /// the module's docs).
    ///
    /// # Safety
    /// Inside this QP's critical region.
    #[inline(always)]
    pub(crate) unsafe fn complete(&self) -> i32 {
        // SAFETY: per the contract, through `op!`'s checked entry point.
        unsafe { op!(self.qpx.as_ptr(), wr_complete) }
    }

    /// Closes the open region, discarding what it built (`ibv_wr_abort`).
    ///
    /// # Safety
    /// Inside this QP's critical region.
    #[inline(always)]
    pub(crate) unsafe fn abort(&self) {
        // SAFETY: per the contract, through `op!`'s checked entry point.
        unsafe { op!(self.qpx.as_ptr(), wr_abort) }
    }

    /// Posts `reqs` in one critical region; request `j` gets the `wr_id`
    /// `tag | (low + j)` (the low half wrapping, as ring tokens do) instead
    /// of its own. `uniform` is the opcode every request has, if they share
    /// one: the builder is then chosen once for the list. Returns as
    /// [`post_one`](SendEx::post_one).
    ///
    /// # Safety
    /// As [`post_chain`]'s for the chain of `reqs`.
    #[inline(always)]
    pub(crate) unsafe fn post_list(
        &self,
        reqs: &[Request],
        uniform: Option<u32>,
        tag: u64,
        low: u32,
    ) -> Option<i32> {
        let q = self.qpx.as_ptr();
        let token = |j: usize| tag | u64::from(low.wrapping_add(j as u32));
        // SAFETY: q is a live extended QP (contract); the critical region
        // opened here is closed on every path; `op!`'s entry points were
        // checked.
        unsafe {
            op!(q, wr_start);
            // One loop per shared operation, so that its builder is known.
            macro_rules! each {
                ($r:ident => $build:expr) => {
                    for (j, $r) in reqs.iter().enumerate() {
                        (*q).wr_id = token(j);
                        (*q).wr_flags = $r.flags;
                        $build;
                        self.set_data($r);
                    }
                };
            }
            match uniform {
                Some(ffi::IBV_WR_RDMA_WRITE) => {
                    each!(r => op!(q, wr_rdma_write, r.rkey, r.remote_addr))
                }
                Some(ffi::IBV_WR_SEND) => each!(r => op!(q, wr_send)),
                Some(ffi::IBV_WR_RDMA_READ) => {
                    each!(r => op!(q, wr_rdma_read, r.rkey, r.remote_addr))
                }
                Some(ffi::IBV_WR_ATOMIC_FETCH_AND_ADD) => {
                    each!(r => op!(q, wr_atomic_fetch_add, r.rkey, r.remote_addr, r.operand))
                }
                _ => {
                    for (j, r) in reqs.iter().enumerate() {
                        if !self.build_request(r, token(j)) {
                            op!(q, wr_abort);
                            return None;
                        }
                    }
                }
            }
            Some(op!(q, wr_complete))
        }
    }
}

/// What [`post_chain`] returns when `REFUSE_RESERVED` is set and a request
/// of the chain has a `wr_id` with [`RAW_WR_ID_RESERVED`](super::RAW_WR_ID_RESERVED)
/// set: nothing was posted. Not an errno, nor a negated one (some
/// providers return `-errno`).
pub(crate) const RESERVED_WR_ID: i32 = i32::MIN;

/// Posts the send chain at `head` on `qp`, through `ex` when given (and the
/// chain can be expressed with its builders), with `ibv_post_send` otherwise.
/// Returns 0 or an errno; on failure `*bad` is the first request refused, or
/// stays null when the verb did not say (a failed `ibv_wr_complete`). With `REFUSE_RESERVED` (raw posts), a chain with a reserved `wr_id` is
/// refused whole with [`RESERVED_WR_ID`]; the builders' replay checks it on
/// the way instead of walking the chain once more.
///
/// # Safety
/// As `ibv_post_send`'s: `qp` is live (and `ex` is its extended interface),
/// `head` heads a well-formed chain, `bad` is writable.
#[inline(always)]
pub(crate) unsafe fn post_chain<const REFUSE_RESERVED: bool>(
    qp: *mut ffi::ibv_qp,
    ex: Option<&SendEx>,
    head: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    let Some(ex) = ex else {
        // SAFETY: per this function's contract.
        unsafe {
            if REFUSE_RESERVED && any_reserved(head) {
                return RESERVED_WR_ID;
            }
            return super::post::ibv_post_send(qp, head, bad);
        }
    };
    let q = ex.qpx.as_ptr();
    // SAFETY: q is qp's extended interface (contract); the critical region
    // opened here is closed on every path below; every request read is part
    // of the well-formed chain.
    unsafe {
        op!(q, wr_start);
        let mut w = head;
        let mut ids = 0;
        while let Some(r) = w.as_ref() {
            if !ex.build(r) {
                return legacy::<REFUSE_RESERVED>(qp, ex, head, bad);
            }
            ids |= r.wr_id;
            w = r.next;
        }
        if REFUSE_RESERVED && ids & super::RAW_WR_ID_RESERVED != 0 {
            op!(q, wr_abort);
            return RESERVED_WR_ID;
        }
        // Failed, it leaves `*bad` null: the requests may be queued.
        op!(q, wr_complete)
    }
}

/// Whether a request of the chain at `head` has a reserved `wr_id`.
///
/// # Safety
/// `head` heads a well-formed chain.
#[inline(always)]
unsafe fn any_reserved(head: *const ffi::ibv_send_wr) -> bool {
    // SAFETY: every request read is part of the well-formed chain.
    unsafe { super::check_raw_wr_ids(head, |w| ((*w).wr_id, (*w).next)).is_err() }
}

/// The chain holds a request the builders cannot express: drop what was built
/// and post the whole chain the legacy way.
///
/// # Safety
/// As [`post_chain`]'s, inside `ex`'s critical region.
#[cold]
#[inline(never)]
unsafe fn legacy<const REFUSE_RESERVED: bool>(
    qp: *mut ffi::ibv_qp,
    ex: &SendEx,
    head: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    // SAFETY: inside the critical region (contract); after the abort nothing
    // built reaches the queue, and ibv_post_send runs outside the region.
    unsafe {
        let q = ex.qpx.as_ptr();
        op!(q, wr_abort);
        if REFUSE_RESERVED && any_reserved(head) {
            return RESERVED_WR_ID;
        }
        let mut w = head;
        while let Some(r) = w.as_ref() {
            if builder_only(r) {
                return post_in_runs(qp, ex, head, bad);
            }
            w = r.next;
        }
        super::post::ibv_post_send(qp, head, bad)
    }
}

/// Posts copies of the requests `run` points to, linked in that order, with
/// `ibv_post_send`; `*bad` is set to the original of the copy the provider
/// names (left alone when it names none).
///
/// # Safety
/// Each pointer is a request of a well-formed chain, whose SGEs stay valid
/// as `ibv_post_send` requires; `bad` is writable.
#[cold]
unsafe fn post_copies(
    qp: *mut ffi::ibv_qp,
    run: &[*mut ffi::ibv_send_wr],
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    // SAFETY: each pointer is a live request (contract), copied by value.
    let mut copies: Vec<ffi::ibv_send_wr> = run.iter().map(|&r| unsafe { *r }).collect();
    let (base, n) = (copies.as_mut_ptr(), copies.len());
    for i in 0..n {
        // SAFETY: `i` and `i + 1 < n` are within the vector, which is not
        // resized; every access goes through `base`.
        unsafe {
            (*base.add(i)).next = if i + 1 < n {
                base.add(i + 1)
            } else {
                std::ptr::null_mut()
            };
        }
    }
    let mut bad_copy = std::ptr::null_mut();
    // SAFETY: a well-formed chain of copies, alive for the call; their SGE
    // lists are the originals' (contract).
    let rc = unsafe { super::post::ibv_post_send(qp, base, &mut bad_copy) };
    if let Some(i) = super::post::bad_index(bad_copy, base, n) {
        // SAFETY: `bad` is writable (contract).
        unsafe { *bad = run[i] };
    }
    rc
}

/// `ibv_post_send` has no field for an ATOMIC_WRITE's data or a FLUSH's kind.
fn builder_only(r: &ffi::ibv_send_wr) -> bool {
    r.opcode == ffi::IBV_WR_ATOMIC_WRITE || r.opcode == ffi::IBV_WR_FLUSH
}

/// A chain with requests only the builders express (ATOMIC_WRITE, FLUSH) and
/// requests they do not (several SGEs, several inline pieces, other
/// opcodes): posted in order, in runs, each run with the API that expresses
/// it: the longest stretch the builders take, then the longest stretch
/// without a builder-only request with `ibv_post_send`, and so on. A refused
/// run stops the chain: `*bad` is the request `ibv_post_send` names, or stays
/// null after a failed `ibv_wr_complete` (it does not say what was queued).
///
/// # Safety
/// As [`post_chain`]'s, outside `ex`'s critical region. The chain is only
/// read (an `ibv_post_send` run is a linked copy of its requests: a raw
/// caller's chain may be shared or read-only).
#[cold]
#[inline(never)]
unsafe fn post_in_runs(
    qp: *mut ffi::ibv_qp,
    ex: &SendEx,
    head: *mut ffi::ibv_send_wr,
    bad: *mut *mut ffi::ibv_send_wr,
) -> i32 {
    let q = ex.qpx.as_ptr();
    let mut start = head;
    // SAFETY: every request read or relinked is part of the well-formed
    // chain (contract); each critical region opened is closed before the next
    // verb; a cut link is restored right after the post that needed it.
    unsafe {
        while !start.is_null() {
            op!(q, wr_start);
            let mut w = start;
            while let Some(r) = w.as_ref() {
                if !ex.build(r) {
                    break;
                }
                w = r.next;
            }
            if w == start {
                op!(q, wr_abort);
            } else {
                let rc = op!(q, wr_complete);
                if rc != 0 {
                    return rc;
                }
            }
            let Some(first) = w.as_ref() else {
                return 0;
            };
            if builder_only(first) {
                // Neither API takes it (the builders refused it).
                *bad = w;
                return libc::EOPNOTSUPP;
            }
            // The legacy run: up to the next builder-only request.
            let mut run = vec![w];
            let mut rest = first.next;
            while let Some(next) = rest.as_ref() {
                if builder_only(next) {
                    break;
                }
                run.push(rest);
                rest = next.next;
            }
            let rc = post_copies(qp, &run, bad);
            if rc != 0 {
                return rc;
            }
            start = rest;
        }
    }
    0
}
