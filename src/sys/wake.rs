//! Waking tasks from the library's own threads and locks.

use std::mem::ManuallyDrop;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::task::{Wake, Waker};

/// Wakes each of `wakers`. Call with no lock held that the woken tasks may
/// take: a waker may run the task's code (an executor that polls inside
/// `wake`). A waker that panics (an executor's bug) does not stop the
/// others, nor the reader, driver or drop that woke them.
pub(crate) fn wake_all(wakers: impl IntoIterator<Item = Waker>) {
    for w in wakers {
        let _ = catch_unwind(AssertUnwindSafe(|| w.wake()));
    }
}

/// A waker for `inner` whose wake and drop contain any panic of `inner`'s,
/// to hand to a primitive that wakes a list of tasks itself (tokio's
/// `Notify::notify_waiters`): there a panicking waker would end the wake-up
/// of the list, leaving the tasks after it notified but never woken.
pub(crate) fn contained(inner: &Waker) -> Waker {
    Waker::from(Arc::new(Contained(ManuallyDrop::new(inner.clone()))))
}

struct Contained(ManuallyDrop<Waker>);

impl Wake for Contained {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let _ = catch_unwind(AssertUnwindSafe(|| self.0.wake_by_ref()));
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used afterwards.
        let inner = unsafe { ManuallyDrop::take(&mut self.0) };
        let _ = catch_unwind(AssertUnwindSafe(move || drop(inner)));
    }
}
