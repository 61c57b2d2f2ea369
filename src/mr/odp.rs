//! On-demand paging: registrations whose pages the device faults in as it
//! touches them instead of pinning them up front, implicit registration of
//! the whole address space, and prefetch (`ibv_advise_mr`).

use std::fmt;
use std::ptr::NonNull;

use super::{AccessFlags, Mr, check_len_access, range_sge, reg_error};
use crate::error::{Error, Result};
use crate::ffi;
use crate::pd::Pd;
use crate::sys::call::verb;

/// What [`Mr::prefetch`] and [`ImplicitOdpMr::prefetch`] ask of the device
/// (`ibv_advise_mr`'s advice).
#[doc(alias = "ibv_advise_mr_advice")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advice {
    /// Fault the pages in for reading.
    Prefetch,
    /// Fault the pages in for writing (breaks copy-on-write sharing).
    PrefetchWrite,
    /// Map the pages that are already present, faulting none in.
    PrefetchNoFault,
}

impl Advice {
    fn raw(self) -> ffi::ib_uverbs_advise_mr_advice {
        match self {
            Advice::Prefetch => ffi::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH,
            Advice::PrefetchWrite => ffi::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE,
            Advice::PrefetchNoFault => ffi::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT,
        }
    }
}

/// `IBV_ADVISE_MR_FLAG_FLUSH`: return only when the prefetch is done.
const ADVISE_FLUSH: u32 = 1;

/// Refuses ON_DEMAND (`implicit`: a registration of the whole address space)
/// on a device whose attributes report no such capability, before the kernel
/// sees the request: its own answer would be a bare EINVAL or EOPNOTSUPP.
/// Inlined: every registration passes here, nearly all without ON_DEMAND.
#[inline]
pub(super) fn check_odp(pd: &Pd, access: AccessFlags, implicit: bool) -> Result<()> {
    if !access.contains(AccessFlags::ON_DEMAND) {
        return Ok(());
    }
    check_odp_caps(pd, implicit)
}

/// [`check_odp`] for an ON_DEMAND registration: the device's capabilities.
#[cold]
fn check_odp_caps(pd: &Pd, implicit: bool) -> Result<()> {
    let caps = pd.context().query_device()?.odp_general_caps;
    let ctx = pd.context().name();
    if caps & u64::from(ffi::IBV_ODP_SUPPORT) == 0 {
        return Err(Error::Unsupported {
            verb: "on-demand paging (IBV_ODP_SUPPORT)",
            hint: format!(
                "device {ctx} reports no ODP capability (odp_caps.general_caps lacks \
                 IBV_ODP_SUPPORT); register without AccessFlags::ON_DEMAND (pinned memory), \
                 or use a device with ODP (mlx5; rxe from Linux 6.15)"
            ),
        });
    }
    if implicit && caps & u64::from(ffi::IBV_ODP_SUPPORT_IMPLICIT) == 0 {
        return Err(Error::Unsupported {
            verb: "implicit on-demand paging (IBV_ODP_SUPPORT_IMPLICIT)",
            hint: format!(
                "device {ctx} supports ODP but not implicit ODP (odp_caps.general_caps lacks \
                 IBV_ODP_SUPPORT_IMPLICIT); register the ranges you use with \
                 AccessFlags::ON_DEMAND instead"
            ),
        });
    }
    Ok(())
}

/// `ibv_advise_mr` over one SGE.
fn advise(pd: &Pd, advice: Advice, wait: bool, mut sge: ffi::ibv_sge) -> Result<()> {
    let flags = if wait { ADVISE_FLUSH } else { 0 };
    // SAFETY: valid PD; one SGE that lives across the call. The kernel checks
    // the range against the registration named by the lkey.
    verb!(rc: unsafe { ffi::ibv_advise_mr(pd.as_raw(), advice.raw(), flags, &mut sge, 1) })?;
    Ok(())
}

impl Mr {
    /// Asks the device to fault this range's pages in now (`ibv_advise_mr`)
    /// so that the first access by the NIC does not wait for a page fault;
    /// with `wait`, returns only when they are in (`IBV_ADVISE_MR_FLAG_FLUSH`).
    ///
    /// Only for a registration with [`AccessFlags::ON_DEMAND`]: others are
    /// pinned already ([`Error::InvalidArgument`]). A range over 4 GiB is
    /// refused too (one SGE); prefetch it in pieces ([`Mr::split_off`]).
    #[doc(alias = "ibv_advise_mr")]
    pub fn prefetch(&self, advice: Advice, wait: bool) -> Result<()> {
        if !self.access().contains(AccessFlags::ON_DEMAND) {
            return Err(Error::InvalidArgument {
                what: "prefetch",
                reason: "this Mr was registered without AccessFlags::ON_DEMAND: its pages are \
                         pinned already, there is nothing to prefetch"
                    .into(),
            });
        }
        if u32::try_from(self.len()).is_err() {
            return Err(Error::InvalidArgument {
                what: "prefetch",
                reason: format!("{} bytes is past one SGE's 4 GiB", self.len()),
            });
        }
        advise(self.pd(), advice, wait, self.sge())
    }
}

/// An implicit on-demand-paging registration: one lkey and rkey for the
/// whole address space of the process (`ibv_reg_mr(pd, NULL, SIZE_MAX,
/// ON_DEMAND | ...)`), pages faulted in as the NIC touches them.
///
/// It gives out keys only; use them in raw work requests
/// ([`Qp::post_send_raw`](crate::qp::Qp::post_send_raw)), whose contract
/// covers the memory they name, and prefetch with
/// [`ImplicitOdpMr::prefetch`]. Deregistered on drop.
pub struct ImplicitOdpMr {
    raw: NonNull<ffi::ibv_mr>,
    access: AccessFlags,
    pd: Pd,
}

// SAFETY: an ibv_mr may be used and deregistered from any thread; the value
// gives out keys, never memory.
unsafe impl Send for ImplicitOdpMr {}
// SAFETY: as above; &self methods only read the keys or call ibv_advise_mr.
unsafe impl Sync for ImplicitOdpMr {}

impl ImplicitOdpMr {
    /// Registers the whole address space of the process in `pd` with
    /// `access` (ON_DEMAND is added).
    ///
    /// Refused with [`Error::Unsupported`], before the kernel sees it, on a
    /// device that does not report implicit ODP
    /// (`IBV_ODP_SUPPORT_IMPLICIT`); REMOTE_WRITE or REMOTE_ATOMIC without
    /// LOCAL_WRITE is [`Error::InvalidArgument`].
    ///
    /// # Safety
    /// The rkey reaches every byte of the process: with a remote right, a
    /// peer holding it reads (REMOTE_READ) or writes (REMOTE_WRITE,
    /// REMOTE_ATOMIC) any mapped memory, Rust objects included. Give it only
    /// to peers that stay inside memory the application set aside for them
    /// (and has no Rust reference to while they may write it); without
    /// remote rights only local raw work requests use it.
    #[doc(alias("ibv_reg_mr", "IBV_ODP_SUPPORT_IMPLICIT"))]
    pub unsafe fn register(pd: &Pd, access: AccessFlags) -> Result<ImplicitOdpMr> {
        let access = access | AccessFlags::ON_DEMAND;
        check_len_access(usize::MAX, access)?;
        check_odp(pd, access, true)?;
        // SAFETY: valid PD; a NULL address with SIZE_MAX bytes and IOVA 0 is
        // the implicit-ODP form, which maps nothing until the NIC faults.
        let raw = verb!(ptr: unsafe {
            ffi::ibv_reg_mr_iova2(pd.as_raw(), std::ptr::null_mut(), usize::MAX, 0, access.bits())
        })
        .map_err(|failed| reg_error("ibv_reg_mr", usize::MAX, failed.source))?;
        Ok(ImplicitOdpMr {
            raw,
            access,
            pd: pd.clone(),
        })
    }

    /// Local key, for SGEs of any address.
    pub fn lkey(&self) -> u32 {
        // SAFETY: raw is valid until drop.
        unsafe { (*self.raw.as_ptr()).lkey }
    }

    /// Remote key (see [`register`](Self::register)'s contract).
    pub fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.raw.as_ptr()).rkey }
    }

    /// Access rights (ON_DEMAND included).
    pub fn access(&self) -> AccessFlags {
        self.access
    }

    /// The PD it is registered in.
    pub fn pd(&self) -> &Pd {
        &self.pd
    }

    /// The raw `ibv_mr`, valid while this value lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mr {
        self.raw.as_ptr()
    }

    /// Asks the device to fault `[addr, addr+len)` in now (see
    /// [`Mr::prefetch`]). The kernel checks the range against the process's
    /// mappings; an empty range or one over 4 GiB is
    /// [`Error::InvalidArgument`].
    #[doc(alias = "ibv_advise_mr")]
    pub fn prefetch(&self, addr: u64, len: usize, advice: Advice, wait: bool) -> Result<()> {
        if len == 0 || u32::try_from(len).is_err() {
            return Err(Error::InvalidArgument {
                what: "prefetch",
                reason: format!("{len} bytes: give 1 byte to 4 GiB per call"),
            });
        }
        advise(&self.pd, advice, wait, range_sge(addr, len, self.lkey()))
    }
}

impl Drop for ImplicitOdpMr {
    fn drop(&mut self) {
        // SAFETY: raw came from ibv_reg_mr_iova2 and is deregistered once. A
        // failure leaves the registration (it owns no memory, nothing leaks
        // but the kernel object).
        unsafe { ffi::ibv_dereg_mr(self.raw.as_ptr()) };
    }
}

impl fmt::Debug for ImplicitOdpMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImplicitOdpMr")
            .field("lkey", &format_args!("{:#x}", self.lkey()))
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("access", &self.access)
            .finish()
    }
}
