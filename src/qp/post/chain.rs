//! Building chained C work-request lists for the safe post path.
//!
//! The arrays live on the poster's stack. Every pointer handed to C (`next`,
//! `sg_list`, the list head) is derived from one raw base pointer per array,
//! taken after the last write through a Rust reference, so the pointers stay
//! valid under Rust's aliasing rules while C reads them.

use std::mem::MaybeUninit;
use std::ptr;

use crate::ffi;
use crate::ledger::sges::{MAX_SAFE_SGES, Sges};

/// A C work request that can be chained (`ibv_send_wr`, `ibv_recv_wr`).
pub(crate) trait ChainedWr: Copy + Default {
    /// The queue it goes to, "send" or "receive", for errors.
    const QUEUE: &'static str;
    /// The verb that posts it, `ibv_post_send` or `ibv_post_recv`, for errors.
    const POST_VERB: &'static str;

    /// Sets `next` and `sg_list` of the request at `wr`.
    ///
    /// # Safety
    /// `wr` points to a live request.
    unsafe fn link(wr: *mut Self, next: *mut Self, sges: *mut ffi::ibv_sge);

    /// Sets `wr_id` of the request at `wr`.
    ///
    /// # Safety
    /// `wr` points to a live request.
    unsafe fn set_wr_id(wr: *mut Self, id: u64);
}

// `ibv_send_wr` and `ibv_recv_wr` chain the same way: `next`, `sg_list`, `wr_id`.
macro_rules! chained_wr {
    ($($wr:ty => $queue:literal, $verb:literal;)*) => {$(
        impl ChainedWr for $wr {
            const QUEUE: &'static str = $queue;
            const POST_VERB: &'static str = $verb;

            #[inline]
            unsafe fn link(wr: *mut Self, next: *mut Self, sges: *mut ffi::ibv_sge) {
                // SAFETY: guaranteed by the caller.
                unsafe {
                    (*wr).next = next;
                    (*wr).sg_list = sges;
                }
            }

            #[inline]
            unsafe fn set_wr_id(wr: *mut Self, id: u64) {
                // SAFETY: guaranteed by the caller.
                unsafe { (*wr).wr_id = id };
            }
        }
    )*};
}

chained_wr! {
    ffi::ibv_send_wr => "send", "ibv_post_send";
    ffi::ibv_recv_wr => "receive", "ibv_post_recv";
}

/// Writes the SGEs of `bufs` into `out`, skipping empty buffers (some hardware
/// reads a zero length as 2 GiB), and returns how many were written.
#[inline]
pub(crate) fn fill_sges(bufs: &Sges, out: &mut [MaybeUninit<ffi::ibv_sge>]) -> i32 {
    // One buffer is the common case: no iterator for it.
    if let [b] = bufs.as_slice() {
        if b.is_empty() {
            return 0;
        }
        out[0].write(b.sge());
        return 1;
    }
    let mut n = 0;
    for b in bufs.iter().filter(|b| !b.is_empty()) {
        out[n].write(b.sge());
        n += 1;
    }
    n as i32
}

/// Chains the first `n` requests of `wrs` (which must be initialised), request
/// `i` using the SGE block `sges[i * MAX_SAFE_SGES..]` (of which C reads only
/// the request's `num_sge` entries), and returns the head of the list.
#[inline]
pub(crate) fn link<W: ChainedWr>(
    wrs: &mut [MaybeUninit<W>],
    sges: &mut [MaybeUninit<ffi::ibv_sge>],
    n: usize,
) -> *mut W {
    assert!(n <= wrs.len() && n * MAX_SAFE_SGES <= sges.len());
    let w = wrs.as_mut_ptr().cast::<W>();
    let s = sges.as_mut_ptr().cast::<ffi::ibv_sge>();
    for i in 0..n {
        let next = if i + 1 < n {
            w.wrapping_add(i + 1)
        } else {
            ptr::null_mut()
        };
        // SAFETY: i < n <= wrs.len() and entry i is initialised (caller); the SGE
        // block offset is inside `sges`; only `next`/`sg_list` are written.
        unsafe { W::link(w.add(i), next, s.add(i * MAX_SAFE_SGES)) };
    }
    w
}

/// Position of `bad` in the list of `n` requests starting at `head`, or `None`
/// when the provider pointed elsewhere (or nowhere).
#[inline]
pub(crate) fn bad_index<W>(bad: *mut W, head: *mut W, n: usize) -> Option<usize> {
    let offset = (bad as usize).checked_sub(head as usize)?;
    let size = size_of::<W>();
    (offset % size == 0 && offset / size < n).then_some(offset / size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_a_chain_and_finds_bad_entries() {
        let mut wrs = [MaybeUninit::new(ffi::ibv_recv_wr::default()); 4];
        let mut sges = [MaybeUninit::new(ffi::ibv_sge::default()); 4 * MAX_SAFE_SGES];
        let head = link(&mut wrs, &mut sges, 3);
        // SAFETY: reading back what link wrote into the live arrays.
        unsafe {
            assert_eq!((*head).next, head.add(1));
            assert_eq!((*head.add(1)).next, head.add(2));
            assert!((*head.add(2)).next.is_null());
            assert_eq!(
                (*head.add(1)).sg_list,
                sges.as_mut_ptr().add(MAX_SAFE_SGES).cast()
            );
            assert_eq!(bad_index(head.add(2), head, 3), Some(2));
            assert_eq!(bad_index(head.add(3), head, 3), None);
        }
        assert_eq!(bad_index(ptr::null_mut(), head, 3), None);
        assert_eq!(bad_index(head.wrapping_byte_add(3), head, 3), None);
    }
}
