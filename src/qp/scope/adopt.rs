//! Connecting inside a scope: [`Cq::scope_adopt`] takes a QP by value, lends
//! it to the closure as an [`AdoptedQp`] that can post and move to RTR and
//! RTS, and gives it back drained, typed in the state the closure reached.

use std::ops::Deref;
use std::ptr::NonNull;

use super::{Dst, PreparedSends, Scope, ScopedListError, ScopedQp, ScopedSend};
use crate::cq::Cq;
use crate::error::Result;
use crate::qp::state::{CanPostRecv, CanPostSend, Init, QpState, Rc, Rtr, Rts};
use crate::qp::{Endpoint, Qp, QpCore, RtrAttr, RtsAttr, TransitionError};

/// A QP a scope owns ([`Cq::scope_adopt`]): a [`ScopedQp`] that can also
/// change state, since nothing outside the scope names the QP by a type its
/// kernel state could contradict. It posts with the methods below and reads
/// through `Deref`; there is no `DerefMut`, so the `ScopedQp` inside cannot
/// be swapped for another attached QP's, which a transition of this handle
/// would then move.
pub struct AdoptedQp<'scope, S: QpState> {
    q: ScopedQp<'scope, S>,
}

impl<'scope, S: QpState> AdoptedQp<'scope, S> {
    /// As [`ScopedQp::post_send`].
    ///
    /// # Errors
    /// As [`ScopedQp::post_send`].
    #[inline(always)]
    #[doc(alias = "ibv_post_send")]
    pub fn post_send(&mut self, req: &ScopedSend<'scope>) -> Result<()>
    where
        S: CanPostSend,
    {
        self.q.post_send(req)
    }

    /// As [`ScopedQp::post_send_list`].
    ///
    /// # Errors
    /// As [`ScopedQp::post_send_list`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_send_list(
        &mut self,
        reqs: impl IntoIterator<Item = ScopedSend<'scope>>,
    ) -> std::result::Result<(), ScopedListError>
    where
        S: CanPostSend,
    {
        self.q.post_send_list(reqs)
    }

    /// As [`ScopedQp::post_prepared`].
    ///
    /// # Errors
    /// As [`ScopedQp::post_prepared`].
    #[doc(alias = "ibv_post_send")]
    pub fn post_prepared(&mut self, list: &PreparedSends<'scope>, first_wr_id: u64) -> Result<()>
    where
        S: CanPostSend,
    {
        self.q.post_prepared(list, first_wr_id)
    }

    /// As [`ScopedQp::post_recv`].
    ///
    /// # Errors
    /// As [`ScopedQp::post_recv`].
    #[inline(always)]
    #[doc(alias = "ibv_post_recv")]
    pub fn post_recv(&mut self, wr_id: u64, dst: Dst<'scope>) -> Result<()>
    where
        S: CanPostRecv,
    {
        self.q.post_recv(wr_id, dst)
    }
}

impl<'scope, S: QpState> AdoptedQp<'scope, S> {
    /// Re-types the handle once a transition moved the QP to `S2`.
    fn into_state<S2: QpState>(self) -> AdoptedQp<'scope, S2> {
        AdoptedQp { q: self.q.retype() }
    }

    /// The QP as a `Qp<Rc, S>`, for a transition's checks and its verb.
    fn qp(&self) -> &Qp<Rc, S> {
        // SAFETY: `Qp` is `repr(transparent)` over its core, which the scope
        // owns until `scope_adopt` returns; the handle is used on the scope's
        // thread only (not Send), and no other reference to the core is live
        // during this call (the scope reads it only inside its own calls).
        unsafe { self.q.core_ptr().cast::<Qp<Rc, S>>().as_ref() }
    }
}

impl<'scope> AdoptedQp<'scope, Init> {
    /// INIT → RTR, as [`Qp::rtr`]; the receives posted stay posted.
    #[doc(alias = "ibv_modify_qp")]
    pub fn rtr(
        self,
        attr: RtrAttr,
    ) -> std::result::Result<AdoptedQp<'scope, Rtr>, TransitionError<AdoptedQp<'scope, Init>>> {
        match self.qp().rtr_in_place(attr) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }

    /// INIT → RTR → RTS towards `remote`, with [`Qp::connect`]'s defaults.
    /// Unlike `Qp::connect`, a refusal leaves the QP with the scope, which
    /// destroys it once its requests are drained.
    #[doc(alias = "ibv_modify_qp")]
    pub fn connect(
        self,
        remote: &Endpoint,
        gid_index: Option<u8>,
    ) -> Result<AdoptedQp<'scope, Rts>> {
        let (rtr, rts) = self.qp().connect_attrs(remote, gid_index)?;
        Ok(self.rtr(rtr)?.rts(rts)?)
    }
}

impl<'scope> AdoptedQp<'scope, Rtr> {
    /// RTR → RTS, as [`Qp::rts`].
    #[doc(alias = "ibv_modify_qp")]
    pub fn rts(
        self,
        attr: RtsAttr,
    ) -> std::result::Result<AdoptedQp<'scope, Rts>, TransitionError<AdoptedQp<'scope, Rtr>>> {
        match self.qp().rts_in_place(attr) {
            Ok(()) => Ok(self.into_state()),
            Err(error) => Err(TransitionError { qp: self, error }),
        }
    }
}

impl<'scope, S: QpState> Deref for AdoptedQp<'scope, S> {
    type Target = ScopedQp<'scope, S>;

    fn deref(&self) -> &ScopedQp<'scope, S> {
        &self.q
    }
}

/// The QP's heap allocation while the scope owns it; dropping this destroys
/// the QP (after the scope drained it).
struct Owned(NonNull<QpCore>);

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: a `Box<Qp<Rc, _>>` leaked by `scope_adopt`, whose layout is
        // its core's (`repr(transparent)`); the scope ended, so nothing
        // refers to it any more.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

impl Cq {
    /// [`Cq::scope`] that owns `qp` for the scope: `f` gets it as an
    /// [`AdoptedQp`] to post receives on before it is connected and to
    /// connect it ([`AdoptedQp::connect`], or [`rtr`](AdoptedQp::rtr) and
    /// [`rts`](AdoptedQp::rts)), and hands it back in the state it reached;
    /// once the scope's requests are drained, the QP comes back with `f`'s
    /// value, typed in that state.
    ///
    /// # Errors
    /// As [`Cq::scope`], and when `qp` cannot be attached (neither of its
    /// queues completes on this CQ). On any error the QP is destroyed after
    /// the drain.
    pub fn scope_adopt<'env, S, S2, F, R>(
        &'env mut self,
        qp: Qp<Rc, S>,
        f: F,
    ) -> Result<(R, Qp<Rc, S2>)>
    where
        S: QpState,
        S2: QpState,
        F: for<'scope> FnOnce(
            &'scope Scope<'scope, 'env>,
            AdoptedQp<'scope, S>,
        ) -> Result<(R, AdoptedQp<'scope, S2>)>,
    {
        // Boxed and held by its pointer: the scope's records and the
        // handle point into it, and moving a Box would retag it.
        let owned = Owned(NonNull::from(Box::leak(Box::new(qp))).cast::<QpCore>());
        let ptr = owned.0;
        let value = self.scope(|s| {
            // SAFETY: the allocation lives until `owned` drops, after the
            // scope; this is the only reference made from it until then.
            let qp = unsafe { ptr.cast::<Qp<Rc, S>>().as_mut() };
            let q = AdoptedQp { q: s.attach(qp)? };
            let (value, q) = f(s, q)?;
            // The handle's invariant 'scope ties it to this scope, whose
            // only adopted QP is this one, and without `DerefMut` its
            // `ScopedQp` is the one made above: the QP typed `S2` below is
            // the one its transitions moved.
            assert_eq!(q.q.core_ptr(), ptr, "an AdoptedQp names its own QP");
            Ok(value)
        })?;
        std::mem::forget(owned);
        // SAFETY: leaked above as a Box<Qp<Rc, S>>; `Qp` is transparent over
        // its core, and the closure's handle says the QP reached S2. The
        // scope drained, so nothing refers to it any more.
        let qp = unsafe { Box::from_raw(ptr.cast::<Qp<Rc, S2>>().as_ptr()) };
        Ok((value, *qp))
    }
}
