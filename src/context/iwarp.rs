//! What a [`Context`] knows of iWARP devices (siw and the iWARP RNICs): what
//! they cannot do, and what siw's refusals mean.

use super::Context;
use crate::error::Error;
use crate::ffi;

/// The hint of [`Context::explain_queue_refusal`].
const SIW_KEY_HINT: &str = "siw refuses a queue the kernel maps at page offset 144 of a \
     device context (libsiw reads that mmap key, 0x90000, as SIW_INVAL_UOBJ_KEY), and the \
     context's next queue is placed there again: keep fewer than about 144 pages of CQs and \
     QP queues (e.g. 48 connections with a one-page CQ, SQ and RQ each) in one context, or \
     open another Context for the rest (rdma_cm's ids share one context per device)";

impl Context {
    /// Whether the device speaks iWARP (`IBV_TRANSPORT_IWARP`, as siw and the iWARP
    /// RNICs): its QPs are RC only, connect through rdma_cm only, and carry neither
    /// immediate data nor atomics.
    pub(crate) fn is_iwarp(&self) -> bool {
        // SAFETY: an open context's `device` points at its ibv_device, which
        // libibverbs keeps alive (its own reference on the device) as long as
        // the context is open; the field is plain data set when the device was
        // found.
        unsafe { (*(*self.inner.raw.as_ptr()).device).transport_type == ffi::IBV_TRANSPORT_IWARP }
    }

    /// Whether the device's transport is neither InfiniBand/RoCE nor iWARP (EFA,
    /// usNIC, one not known): nothing says its send queue completes in posting
    /// order. EFA does not (rdma-core's `providers/efa` completes sends
    /// out of order and finds each request by the id in its completion).
    pub(crate) fn completes_sends_in_any_order(&self) -> bool {
        // SAFETY: as in `is_iwarp`.
        let transport = unsafe { (*(*self.inner.raw.as_ptr()).device).transport_type };
        transport != ffi::IBV_TRANSPORT_IB && transport != ffi::IBV_TRANSPORT_IWARP
    }

    /// [`Error::Unsupported`] for `verb` on an iWARP device, saying what it lacks
    /// (`missing`) and what to do instead.
    pub(crate) fn iwarp_unsupported(&self, verb: &'static str, missing: &str) -> Error {
        Error::Unsupported {
            verb,
            hint: format!(
                "{} is an iWARP device (provider {}), which has no {missing}",
                self.name(),
                if self.name().starts_with("siw") {
                    "siw"
                } else {
                    "iWARP"
                }
            ),
        }
    }

    /// `e` with what siw's refusal of a new CQ or QP means, when it is one: a
    /// creation that failed without an errno on an iWARP device. libsiw takes
    /// the mmap key 0x90000 for its "no key" value (`SIW_INVAL_UOBJ_KEY`), but
    /// the kernel hands out keys by page offset, first fit, within one device
    /// context: the queue mapped at page 144 gets that key, libsiw destroys it,
    /// and the next one lands there again.
    pub(crate) fn explain_queue_refusal(&self, e: Error) -> Error {
        match e {
            Error::Verb { verb, source, .. }
                if self.is_iwarp() && source.raw_os_error().is_none() =>
            {
                Error::Verb {
                    verb,
                    source,
                    hint: Some(SIW_KEY_HINT.into()),
                }
            }
            e => e,
        }
    }
}
