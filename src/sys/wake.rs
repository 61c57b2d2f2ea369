//! Waking tasks from the library's own threads and locks.

use std::task::Waker;

/// Wakes each of `wakers`. Call with no lock held that the woken tasks may
/// take: a waker may run the task's code (an executor that polls inside
/// `wake`). A waker that panics (an executor's bug) does not stop the
/// others, nor the reader, driver or drop that woke them.
pub(crate) fn wake_all(wakers: impl IntoIterator<Item = Waker>) {
    for w in wakers {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake()));
    }
}
