//! Received pool buffers as [`bytes::Bytes`], without a copy (`bytes` feature).

use std::sync::Arc;

use super::owned::MrRefused;
use super::{Mr, MrPool};
use crate::error::Error;

/// The owner behind a pool buffer's `Bytes`: the buffer's `Mr`, and the pool
/// it goes back to when the last `Bytes` of it drops.
struct PoolBytes {
    /// Always `Some` until the drop takes it back to the pool.
    mr: Option<Mr>,
    /// Bytes of the buffer the `Bytes` shows (the received length).
    len: usize,
    pool: Arc<MrPool>,
}

impl AsRef<[u8]> for PoolBytes {
    fn as_ref(&self) -> &[u8] {
        let Some(mr) = &self.mr else { return &[] };
        // SAFETY: `MrPool::to_bytes` built this owner only after `as_slice`
        // accepted the `Mr` (host memory the process may read, in a
        // registration no peer can write: no REMOTE_WRITE, REMOTE_ATOMIC or
        // MW_BIND) and `len <= mr.len`, so [ptr + off, + len) is inside the
        // registration's memory. The owner holds the `Mr` by value and never
        // posts or hands it out, so neither the NIC nor safe code writes those
        // bytes (the pool's other buffers are disjoint pieces) until the drop
        // below, which runs after the last `Bytes` (and this borrow) is gone.
        unsafe { std::slice::from_raw_parts(mr.region.ptr.as_ptr().add(mr.off), self.len) }
    }
}

impl Drop for PoolBytes {
    fn drop(&mut self) {
        if let Some(mr) = self.mr.take() {
            // `to_bytes` checked that the buffer is one of this pool's, so
            // `put` takes it; were it refused, the buffer would only be lost
            // to the pool (its `Mr` drops with the error).
            let _ = self.pool.put(mr);
        }
    }
}

impl MrPool {
    /// The first `len` bytes of a pool buffer as [`bytes::Bytes`], without
    /// copying: typically a receive buffer back from its completion, with
    /// `len` the completion's `byte_len` when its opcode is
    /// [`WcOpcode::Recv`](crate::cq::WcOpcode::Recv). A receive used up by a
    /// WRITE with immediate ([`WcOpcode::RecvRdmaWithImm`](crate::cq::WcOpcode::RecvRdmaWithImm))
    /// reports the WRITE's length but leaves the buffer as it was (the bytes
    /// of its previous use): take 0 bytes of it then. Clones and slices of the `Bytes`
    /// share the buffer, which goes back to this pool (as by [`MrPool::put`])
    /// when the last of them drops.
    ///
    /// Refused, with the `Mr` back in the error, when:
    /// - the pool's registration lets a peer write the buffer (REMOTE_WRITE,
    ///   REMOTE_ATOMIC or MW_BIND, under which a window may grant a peer
    ///   write access): [`Error::RemotelyWritable`], since a `Bytes` promises
    ///   bytes that do not change; copy with [`Mr::to_vec`] instead, or use a
    ///   pool registered without those rights for receives;
    /// - the `Mr` is not one of this pool's buffers as handed out
    ///   ([`Error::InvalidArgument`], as for `put`);
    /// - `len` is more than the buffer's length ([`Error::InvalidArgument`]).
    ///
    /// The pool must be in an [`Arc`]: every `Bytes` keeps it alive. Unlike
    /// `get` and `put`, the conversion allocates once (the `Bytes`' shared
    /// header, by `Bytes::from_owner`), freed with the last clone.
    ///
    /// ```no_run
    /// # fn main() -> rdma_verbs::error::Result<()> {
    /// use std::sync::Arc;
    /// use rdma_verbs::mr::MrPool;
    /// use rdma_verbs::prelude::*;
    /// # let ctx = Context::open(None)?;
    /// # let pd = Pd::new(&ctx)?;
    /// # let cq = Cq::new(&ctx, 16)?;
    /// # let mut srq = Srq::new(&pd, &cq, SrqAttr::new(16, 1))?;
    /// let pool = Arc::new(MrPool::new(&pd, 4096, 64, AccessFlags::LOCAL_WRITE)?);
    /// srq.post_recv(RecvWr::new(1, pool.get().expect("a free buffer")))?;
    /// // ... a completion `wc` for that receive arrives:
    /// # let mut wc: Completion = unimplemented!();
    /// let mr = wc.take_mr().expect("the receive buffer");
    /// let msg: bytes::Bytes = pool.to_bytes(mr, wc.byte_len as usize).map_err(|r| r.error)?;
    /// let header = msg.slice(..8); // shares the buffer
    /// drop(msg);
    /// drop(header); // the buffer is back in the pool
    /// # Ok(()) }
    /// ```
    pub fn to_bytes(self: &Arc<Self>, mr: Mr, len: usize) -> Result<::bytes::Bytes, MrRefused> {
        if !self.is_ours(&mr) {
            let error = self.not_ours(&mr);
            return Err(MrRefused { mr, error });
        }
        if len > mr.len {
            let error = Error::InvalidArgument {
                what: "pool buffer length",
                reason: format!(
                    "{len} bytes asked of a {}-byte buffer; pass at most the buffer's length \
                     (a completion's byte_len)",
                    mr.len
                ),
            };
            return Err(MrRefused { mr, error });
        }
        if let Err(error) = mr.as_slice() {
            return Err(MrRefused { mr, error });
        }
        Ok(::bytes::Bytes::from_owner(PoolBytes {
            mr: Some(mr),
            len,
            pool: Arc::clone(self),
        }))
    }
}
