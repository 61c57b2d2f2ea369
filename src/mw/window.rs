//! `Mw`: one memory window, what it keeps alive, and the checks a bind
//! passes before the NIC sees it.

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::error::{Error, Result};
use crate::ffi;
use crate::mr::{AccessFlags, Mr, Region, RemoteMr};
use crate::pd::Pd;
use crate::sys::call::verb;

/// The kind of a memory window (`ibv_mw_type`).
#[doc(alias = "ibv_mw_type")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MwType {
    /// Bound with `ibv_bind_mw`, revoked by a zero-length bind; not tied to
    /// a QP (`IBV_MW_TYPE_1`).
    Type1,
    /// Bound by a BIND_MW work request and revoked by LOCAL_INV or a peer's
    /// SEND with invalidate; tied to the QP that bound it (`IBV_MW_TYPE_2`).
    Type2,
}

impl MwType {
    fn raw(self) -> ffi::ibv_mw_type {
        match self {
            MwType::Type1 => ffi::IBV_MW_TYPE_1,
            MwType::Type2 => ffi::IBV_MW_TYPE_2,
        }
    }

    /// The device capability flags that announce this type, and their names.
    fn capability(self) -> (u32, &'static str) {
        match self {
            MwType::Type1 => (ffi::IBV_DEVICE_MEM_WINDOW, "IBV_DEVICE_MEM_WINDOW"),
            MwType::Type2 => (
                ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2A | ffi::IBV_DEVICE_MEM_WINDOW_TYPE_2B,
                "IBV_DEVICE_MEM_WINDOW_TYPE_2A or _2B",
            ),
        }
    }
}

/// A memory window (`ibv_mw`): a peer's access to a range of a region, with
/// its own rights and rkey. See the [module docs](super).
///
/// Dropping it deallocates the window (`ibv_dealloc_mw`), which revokes any
/// access it still grants; then the regions it was bound to are released.
/// While a request naming the window (a bind, an invalidation) is still in
/// flight, its QP keeps the window: it is deallocated when that QP's next
/// window request is posted, or when the QP is dropped.
#[doc(alias = "ibv_mw")]
pub struct Mw {
    inner: Arc<MwInner>,
    /// The range the last bind posted grants, until it is revoked locally.
    bound: Option<RemoteMr>,
}

/// The window itself, shared with the QP while a request naming it is in
/// flight.
pub(crate) struct MwInner {
    raw: NonNull<ffi::ibv_mw>,
    ty: MwType,
    pd: Pd,
    /// Every region the window was ever bound to: each stays registered and
    /// allocated until the window is deallocated, whatever the peer does.
    regions: Mutex<Vec<Arc<Region>>>,
    /// The tables of the QPs that the window's requests went to, which hold
    /// the window while such a request is in flight (one per QP, by address).
    held_by: Mutex<Vec<Weak<dyn WindowHolder>>>,
}

/// A QP's table of the windows its window requests name (`qp/mw.rs`).
pub(crate) trait WindowHolder: Send + Sync {
    /// Lets go of the windows whose requests have retired.
    fn release_retired(&self);
}

impl MwInner {
    /// Records that `holder` holds the window for a request in flight.
    pub(crate) fn held_by(&self, holder: Weak<dyn WindowHolder>) {
        let mut held_by = self.held_by.lock().unwrap_or_else(PoisonError::into_inner);
        // Tables of QPs that are gone need no call any more.
        held_by.retain(|h| h.strong_count() > 0);
        if !held_by.iter().any(|h| Weak::ptr_eq(h, &holder)) {
            held_by.push(holder);
        }
    }
}

// SAFETY: an ibv_mw may be used and deallocated from any thread; its rkey is
// written only through `&mut Mw` (one thread), and `regions` is behind a mutex.
unsafe impl Send for MwInner {}
// SAFETY: as above; `&MwInner` reads nothing the provider changes.
unsafe impl Sync for MwInner {}

impl Drop for MwInner {
    fn drop(&mut self) {
        // SAFETY: raw came from ibv_alloc_mw; no request naming it is in
        // flight (each holds an Arc to this). After it returns 0 the window
        // grants nothing, so the regions may go.
        let rc = unsafe { ffi::ibv_dealloc_mw(self.raw.as_ptr()) };
        if rc != 0 {
            // The window may still grant access: its regions must stay
            // registered and allocated for good. Leak them.
            let regions = self
                .regions
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner);
            std::mem::forget(std::mem::take(regions));
        }
    }
}

impl Drop for Mw {
    /// The QPs that the window's requests went to let go of the retired
    /// requests' windows, so that this window is deallocated now unless a
    /// request naming it is still in flight on one of them.
    fn drop(&mut self) {
        let holders = std::mem::take(
            &mut *self
                .inner
                .held_by
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for table in holders.iter().filter_map(Weak::upgrade) {
            table.release_retired();
        }
    }
}

/// A bind that passed every check: what the work request names.
pub(crate) struct BindPlan {
    pub(crate) mr: *mut ffi::ibv_mr,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: AccessFlags,
}

/// The rights a window can grant.
const WINDOW_RIGHTS: AccessFlags = AccessFlags::REMOTE_READ
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_ATOMIC);

impl Mw {
    /// Allocates a window of type `ty` in `pd` (`ibv_alloc_mw`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the capability when the device does not
    /// announce windows of this type (`device_cap_flags`, `max_mw`).
    #[doc(alias = "ibv_alloc_mw")]
    pub fn new(pd: &Pd, ty: MwType) -> Result<Mw> {
        let attr = pd.context().query_device()?;
        let (flags, names) = ty.capability();
        if attr.device_cap_flags & flags == 0 || attr.max_mw <= 0 {
            return Err(unsupported(pd, ty, names));
        }
        // SAFETY: valid PD; `ty` is one of the two types verbs.h defines.
        let allocated = verb!(ptr: unsafe { ffi::ibv_alloc_mw(pd.as_raw(), ty.raw()) });
        let raw = allocated.map_err(|failed| match failed.errno() {
            Some(libc::EOPNOTSUPP) => unsupported(pd, ty, names),
            _ => failed.into(),
        })?;
        Ok(Mw {
            inner: Arc::new(MwInner {
                raw,
                ty,
                pd: pd.clone(),
                regions: Mutex::new(Vec::new()),
                held_by: Mutex::new(Vec::new()),
            }),
            bound: None,
        })
    }

    /// The window's type.
    pub fn mw_type(&self) -> MwType {
        self.inner.ty
    }

    /// The PD it was allocated in.
    pub fn pd(&self) -> &Pd {
        &self.inner.pd
    }

    /// The window's current rkey: the one the last bind posted gives it.
    pub fn rkey(&self) -> u32 {
        // SAFETY: raw is valid while the window lives; rkey is a plain field
        // written only through `&mut self` (see `bind_posted`) or by the
        // provider inside `ibv_bind_mw`, which also takes `&mut self`.
        unsafe { (*self.inner.raw.as_ptr()).rkey }
    }

    /// What a peer needs to use the window: the range the last bind posted
    /// (address, length, rkey), or `None` before the first bind and after a
    /// local revocation was posted. The peer's accesses succeed once that
    /// bind's completion was polled with `Success`.
    pub fn remote(&self) -> Option<RemoteMr> {
        self.bound
    }

    /// Takes note that a peer's SEND with invalidate revoked the window:
    /// `rkey` is what the receive completion reported
    /// ([`Completion::invalidated_rkey`](crate::cq::Completion::invalidated_rkey)).
    /// Returns whether it was this window's current binding (then
    /// [`remote`](Mw::remote) is `None` and the window can be bound again).
    pub fn invalidated_by_peer(&mut self, rkey: u32) -> bool {
        let ours = self.bound.is_some_and(|b| b.rkey == rkey);
        if ours {
            self.bound = None;
        }
        ours
    }

    /// The raw `ibv_mw`, valid while this `Mw` lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_mw {
        self.inner.raw.as_ptr()
    }

    /// The shared window, for a request naming it to hold while in flight.
    pub(crate) fn shared(&self) -> &Arc<MwInner> {
        &self.inner
    }

    /// Checks a bind of `[offset, offset + len)` of `mr` with `access`,
    /// posted on a QP in `qp_pd`; on success the window holds the region
    /// from now on.
    pub(crate) fn plan_bind(
        &self,
        qp_pd: &Pd,
        mr: &Mr,
        offset: usize,
        len: usize,
        access: AccessFlags,
    ) -> Result<BindPlan> {
        check_bind(self, qp_pd, mr, offset, len, access)?;
        let region = mr.region();
        let mut regions = self
            .inner
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !regions.iter().any(|r| Arc::ptr_eq(r, region)) {
            regions.push(region.clone());
        }
        Ok(BindPlan {
            mr: mr.as_raw(),
            addr: mr.addr() + offset as u64,
            len: len as u64,
            access,
        })
    }

    /// The rkey a type 2 bind gives the window: the current one with its
    /// 8-bit key advanced (`ibv_inc_rkey`), so a peer's stale rkey of an
    /// earlier binding no longer matches.
    pub(crate) fn next_rkey(&self) -> u32 {
        // SAFETY: ibv_inc_rkey is arithmetic on its argument.
        unsafe { ffi::ibv_inc_rkey(self.rkey()) }
    }

    /// A bind of `plan` was accepted by the device: a type 2 window takes
    /// `rkey` (the provider leaves a posted bind's new rkey to the
    /// application; its next bind must name it), a type 1 window already
    /// has its new rkey from `ibv_bind_mw`. A zero-length bind unbinds.
    pub(crate) fn bind_posted(&mut self, plan: &BindPlan, rkey: u32) {
        if self.inner.ty == MwType::Type2 {
            // SAFETY: raw is valid; `&mut self` excludes every other reader
            // and writer of the field in this process.
            unsafe { (*self.inner.raw.as_ptr()).rkey = rkey };
        }
        self.bound = (plan.len > 0).then(|| RemoteMr {
            addr: plan.addr,
            len: plan.len,
            rkey: self.rkey(),
        });
    }

    /// A local revocation was posted: the window grants nothing once it
    /// completes.
    pub(crate) fn revoke_posted(&mut self) {
        self.bound = None;
    }

    /// The last bound range's region, for a type 1 unbind (a zero-length
    /// bind still names a region on some providers): the latest of the
    /// window's regions that holds the range (the list keeps each region
    /// once, in the order of its first bind).
    pub(crate) fn last_plan(&self) -> Option<BindPlan> {
        let b = self.bound?;
        let regions = self
            .inner
            .regions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let region = regions
            .iter()
            .rev()
            .find(|r| r.covers(b.addr, b.len))
            .or_else(|| regions.last())?;
        Some(BindPlan {
            mr: region.raw_mr(),
            addr: b.addr,
            len: 0,
            access: AccessFlags::empty(),
        })
    }
}

#[cold]
fn unsupported(pd: &Pd, ty: MwType, names: &str) -> Error {
    Error::Unsupported {
        verb: "ibv_alloc_mw",
        hint: format!(
            "{} does not support memory windows of {ty:?} (its device_cap_flags lack {names}, \
             or max_mw is 0); use a device that does, or grant access with a region's own rkey",
            pd.context().name()
        ),
    }
}

fn invalid(what: &'static str, reason: String) -> Error {
    Error::InvalidArgument { what, reason }
}

/// Everything a bind can be refused for before the NIC sees it (a bind the
/// device refuses completes in error and moves the QP to ERR).
fn check_bind(
    mw: &Mw,
    qp_pd: &Pd,
    mr: &Mr,
    offset: usize,
    len: usize,
    access: AccessFlags,
) -> Result<()> {
    let same = |a: &Pd, b: &Pd| Arc::ptr_eq(&a.inner, &b.inner);
    if !same(mw.pd(), mr.pd()) || !same(mw.pd(), qp_pd) {
        return Err(invalid(
            "protection domain",
            "the window, the region and the QP must be in the same PD (IB spec C10-72): \
             allocate the window in the region's PD and bind it on a QP of that PD"
                .into(),
        ));
    }
    if !mr.access().contains(AccessFlags::MW_BIND) {
        return Err(invalid(
            "region access flags",
            format!(
                "the region was registered with {:?}, without AccessFlags::MW_BIND: register it \
                 with MW_BIND to bind windows to it",
                mr.access()
            ),
        ));
    }
    if len == 0 {
        return Err(invalid(
            "window length",
            "a window covers at least 1 byte; revoke one with post_local_inv (type 2) or \
             post_unbind_mw (type 1)"
                .into(),
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > mr.len()) {
        return Err(invalid(
            "window range",
            format!(
                "{len} bytes at offset {offset} reach past the end of the {}-byte Mr: bind a \
                 range inside it",
                mr.len()
            ),
        ));
    }
    check_rights(mr.access(), access)
}

/// A window grants only remote rights, at least one, and REMOTE_WRITE or
/// REMOTE_ATOMIC only over a region the NIC may write (IB spec C10-74).
fn check_rights(region: AccessFlags, access: AccessFlags) -> Result<()> {
    let extra = access.difference(WINDOW_RIGHTS);
    if !extra.is_empty() || access.is_empty() {
        return Err(invalid(
            "window access flags",
            format!(
                "{access:?}: a window grants one or more of REMOTE_READ, REMOTE_WRITE and \
                 REMOTE_ATOMIC, and nothing else"
            ),
        ));
    }
    let writes = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC;
    if access.intersects(writes) && !region.contains(AccessFlags::LOCAL_WRITE) {
        return Err(invalid(
            "window access flags",
            format!(
                "{access:?} is wider than the region allows: it was registered with {region:?}, \
                 and a window may grant REMOTE_WRITE or REMOTE_ATOMIC only over a region with \
                 LOCAL_WRITE (IB spec C10-74); grant REMOTE_READ only, or register the region \
                 with LOCAL_WRITE"
            ),
        ));
    }
    Ok(())
}

impl fmt::Debug for Mw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mw")
            .field("type", &self.inner.ty)
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .field("bound", &self.bound)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rights_are_remote_only_and_writes_need_local_write() {
        let rw = AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND;
        let ro = AccessFlags::REMOTE_READ | AccessFlags::MW_BIND;
        assert!(check_rights(rw, AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE).is_ok());
        assert!(check_rights(ro, AccessFlags::REMOTE_READ).is_ok());
        let refused = |region, access| match check_rights(region, access) {
            Err(Error::InvalidArgument { what, .. }) => what,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            refused(ro, AccessFlags::REMOTE_WRITE),
            "window access flags"
        );
        assert_eq!(
            refused(rw, AccessFlags::REMOTE_ATOMIC | AccessFlags::LOCAL_WRITE),
            "window access flags"
        );
        assert_eq!(refused(rw, AccessFlags::empty()), "window access flags");
    }
}
