//! The ledger of posted work: what the queues and the CQs share.
//!
//! A posted request's buffers sit in a slot of its queue's [`ring`] until its
//! completion is polled; the `wr_id` the NIC carries is a token naming the ring
//! (by its index in the CQ's [`table`]) and the slot. [`sges`] and [`wr`] are the
//! scatter/gather lists and the safe work requests that fill the slots. No queue
//! object owns this layer: the QP's queues produce into it, the CQ's poll consumes
//! from it, and neither imports the other.

pub(crate) mod range;
pub(crate) mod ring;
pub(crate) mod sges;
pub(crate) mod table;
pub(crate) mod wr;

/// A bitwise copy of `*v`, never dropped, to hand to code that is not
/// inlined. Passing `v`'s own address there would keep the value in memory
/// in the caller: LLVM keeps a local (a request the post path builds) in
/// registers only while it sees every use of the local's address.
#[inline(always)]
pub(crate) fn read_copy<T>(v: &T) -> std::mem::ManuallyDrop<T> {
    // SAFETY: `v` is valid for reads. The copy is only read (behind a shared
    // reference) and never dropped, so what `T` owns stays owned once, by
    // `*v`, which is not written while the borrow lasts.
    std::mem::ManuallyDrop::new(unsafe { std::ptr::read(v) })
}
