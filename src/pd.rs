//! `Pd`: a protection domain.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::context::Context;
use crate::error::Result;
use crate::ffi;
use crate::sys::call::verb;

/// A protection domain (`ibv_pd`). Cheap to clone; keeps its `Context` open,
/// and every `Mr` and `Qp` created in it keeps it alive.
#[doc(alias = "ibv_pd")]
#[derive(Clone)]
pub struct Pd {
    pub(crate) inner: Arc<PdInner>,
}

pub(crate) struct PdInner {
    raw: NonNull<ffi::ibv_pd>,
    ctx: Context,
}

// SAFETY: ibv_pd may be used from any thread; this crate only passes it to
// thread-safe verbs (reg_mr, create_qp, dealloc in Drop).
unsafe impl Send for PdInner {}
// SAFETY: as above; nothing is mutated through &self.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: raw came from ibv_alloc_pd; every MR/QP holds an Arc to this, so
        // none is left. Errors are ignored: Drop never panics.
        unsafe { ffi::ibv_dealloc_pd(self.raw.as_ptr()) };
    }
}

impl Pd {
    /// Allocates a protection domain (`ibv_alloc_pd`).
    #[doc(alias = "ibv_alloc_pd")]
    pub fn new(ctx: &Context) -> Result<Pd> {
        // SAFETY: valid context.
        let raw = verb!(ptr: unsafe { ffi::ibv_alloc_pd(ctx.as_raw()) })?;
        Ok(Pd {
            inner: Arc::new(PdInner {
                raw,
                ctx: ctx.clone(),
            }),
        })
    }

    /// The device this PD belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The raw `ibv_pd`, valid while this `Pd` (or a clone) lives.
    pub fn as_raw(&self) -> *mut ffi::ibv_pd {
        self.inner.raw.as_ptr()
    }
}

impl Context {
    /// Allocates a protection domain (`ibv_alloc_pd`); see [`Pd::new`].
    #[doc(alias = "ibv_alloc_pd")]
    pub fn alloc_pd(&self) -> Result<Pd> {
        Pd::new(self)
    }
}

impl fmt::Debug for Pd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: raw is valid while self lives; handle is a plain field.
        let handle = unsafe { (*self.as_raw()).handle };
        f.debug_struct("Pd")
            .field("device", &self.inner.ctx.name())
            .field("handle", &handle)
            .finish()
    }
}
