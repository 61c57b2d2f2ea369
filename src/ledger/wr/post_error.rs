//! A refused post and the requests it gives back.

use std::fmt;

use crate::error::Error;
use crate::ledger::sges::Sges;

/// A refused post: the error and the buffers of every request that did not
/// reach the NIC, as `(wr_id, buffers)` in order.
pub struct PostError {
    /// Why.
    pub error: Error,
    /// Requests not posted, with their buffers.
    pub unposted: Vec<(u64, Sges)>,
}

impl fmt::Debug for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostError")
            .field("error", &self.error)
            .field("unposted", &self.unposted.len())
            .finish()
    }
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({} work requests not posted)",
            self.error,
            self.unposted.len()
        )
    }
}

impl std::error::Error for PostError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<PostError> for Error {
    fn from(e: PostError) -> Error {
        e.error
    }
}
