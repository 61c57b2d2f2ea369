//! A list being staged on a queue ([`Listing`]): its iterator may run user
//! code, which must not post on the same queue meanwhile.

use std::ptr::NonNull;

use crate::error::Error;
use crate::qp::QpCore;

/// Marks a queue of an attached QP while a list's requests are staged from
/// its head, from before the list's iterator is first called until the
/// chunk is posted or given up (also in an unwind from the iterator). The
/// staged requests count on the head they were numbered from, so a post on
/// the same queue from inside the iterator is refused while the mark is set
/// ([`nested_post`]); the QP's other queue takes posts as usual.
pub(super) struct Listing {
    core: NonNull<QpCore>,
    recv: bool,
}

impl Listing {
    /// Marks the receive (`recv`) or send queue of `core`, or returns None
    /// when a list is already staged on it (this one comes from its
    /// iterator: [`nested_post`] says why it is refused).
    ///
    /// # Safety
    /// `core` is an attached QP's, borrowed for the scope; no reference into
    /// it is live during this call or when the mark drops.
    #[inline(always)]
    pub(super) unsafe fn mark(core: NonNull<QpCore>, recv: bool) -> Option<Listing> {
        // SAFETY: per the contract.
        let c = unsafe { &mut *core.as_ptr() };
        let Some(t) = c.ext.scoped.as_deref_mut() else {
            return Some(Listing { core, recv }); // not attached: refused later
        };
        let flag = if recv {
            &mut t.rq_listing
        } else {
            &mut t.sq_listing
        };
        if *flag {
            return None;
        }
        *flag = true;
        Some(Listing { core, recv })
    }
}

impl Drop for Listing {
    fn drop(&mut self) {
        // SAFETY: per `mark`'s contract, no reference into the core is live.
        let c = unsafe { &mut *self.core.as_ptr() };
        if let Some(t) = c.ext.scoped.as_deref_mut() {
            if self.recv {
                t.rq_listing = false;
            } else {
                t.sq_listing = false;
            }
        }
    }
}

/// Why a post on a queue with a list being staged is refused.
#[cold]
#[inline(never)]
pub(super) fn nested_post(recv: bool) -> Error {
    let queue = if recv { "receive" } else { "send" };
    Error::InvalidArgument {
        what: "scoped post",
        reason: format!(
            "a list is being posted on this QP's {queue} queue and this post comes from its \
             iterator: post on that queue after the list (the QP's other queue takes posts)"
        ),
    }
}
