//! Byte copies to and from memory that a peer may write at any moment
//! (remotely writable registrations).
//!
//! The NIC writes such memory by DMA while we copy. A plain
//! `copy_nonoverlapping` would then be a data race, which Rust's memory model
//! makes undefined behaviour (the compiler may assume the bytes do not change
//! under it: re-read, split or widen the loads). Atomic accesses are the
//! model's sanctioned way to share memory racily, with another thread or,
//! as here, with another agent (like memory shared with another process);
//! `Relaxed` suffices because ordering against the peer comes from the
//! completion that announces its data. `read_volatile`/`write_volatile` are
//! not an option: volatile accesses that race are still data races (volatile
//! is for MMIO), and they are no faster.
//!
//! Cost: a relaxed atomic load or store of a `u8` or `usize` is an ordinary
//! `mov` (x86-64 and AArch64), but the compiler cannot merge or vectorize
//! atomics. So the unaligned head and tail (under one word each) go byte by
//! byte with `AtomicU8`, and the aligned middle a word at a time with
//! `AtomicUsize`: one load and one store per 8 bytes, versus memcpy's 32-64
//! bytes per vector instruction. That is why memory no peer can write keeps
//! the plain copies.
//!
//! Rust's model also forbids racing atomic accesses of *different sizes* to
//! the same bytes. Our own accesses never race with each other (they need
//! `&Mr`/`&mut Mr` and so are ordered by the borrow rules); the NIC's DMA
//! writes are outside the abstract machine and have no Rust access size
//! (PCIe writes of up to a cache line), so no single size would "match"
//! them; the word size is as justified as a byte and eight times fewer
//! instructions.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU8, AtomicUsize};

const W: usize = size_of::<usize>();

/// Bytes before `p + head` are unaligned, `head <= n`; then whole words.
fn split(p: *const u8, n: usize) -> (usize, usize) {
    let head = ((p as usize).wrapping_neg() % W).min(n);
    let words = (n - head) / W;
    (head, words)
}

/// Copies `dst.len()` bytes from `src` into `dst`.
///
/// # Safety
/// `[src, src+dst.len())` is allocated, writable memory that stays
/// allocated during the call, does not overlap `dst`, and that other Rust
/// code does not access non-atomically (or atomically with other sizes)
/// during the call. Others (a NIC) may write it concurrently.
pub(super) unsafe fn load(src: *const u8, dst: &mut [u8]) {
    let (head, words) = split(src, dst.len());
    let (d_head, rest) = dst.split_at_mut(head);
    let (d_mid, d_tail) = rest.split_at_mut(words * W);
    let mut s = src;
    // SAFETY: (all three loops) every `s` stays in [src, src+dst.len()),
    // which is valid for the call (caller); `s` is word-aligned in the
    // middle loop (split); the accesses are atomic, so a concurrent write by
    // the NIC is no data race.
    unsafe {
        for d in d_head {
            *d = AtomicU8::from_ptr(s.cast_mut()).load(Relaxed);
            s = s.add(1);
        }
        for d in d_mid.chunks_exact_mut(W) {
            debug_assert!(s.cast::<usize>().is_aligned());
            let v = AtomicUsize::from_ptr(s.cast_mut().cast::<usize>()).load(Relaxed);
            d.copy_from_slice(&v.to_ne_bytes());
            s = s.add(W);
        }
        for d in d_tail {
            *d = AtomicU8::from_ptr(s.cast_mut()).load(Relaxed);
            s = s.add(1);
        }
    }
}

/// Copies `src` to `dst`.
///
/// # Safety
/// `[dst, dst+src.len())` is allocated, writable memory that stays
/// allocated during the call, does not overlap `src`, and that other Rust
/// code does not access (except atomically with the same sizes) during
/// the call. Others (a NIC) may access it concurrently.
pub(super) unsafe fn store(src: &[u8], dst: *mut u8) {
    let (head, words) = split(dst, src.len());
    let (s_head, rest) = src.split_at(head);
    let (s_mid, s_tail) = rest.split_at(words * W);
    let mut d = dst;
    // SAFETY: as in `load`, for the destination.
    unsafe {
        for &b in s_head {
            AtomicU8::from_ptr(d).store(b, Relaxed);
            d = d.add(1);
        }
        for c in s_mid.chunks_exact(W) {
            debug_assert!(d.cast::<usize>().is_aligned());
            let mut w = [0u8; W];
            w.copy_from_slice(c);
            AtomicUsize::from_ptr(d.cast::<usize>()).store(usize::from_ne_bytes(w), Relaxed);
            d = d.add(W);
        }
        for &b in s_tail {
            AtomicU8::from_ptr(d).store(b, Relaxed);
            d = d.add(1);
        }
    }
}

/// Sets `n` bytes at `dst` to `byte`.
///
/// # Safety
/// As [`store`] for `[dst, dst+n)`.
pub(super) unsafe fn fill(dst: *mut u8, byte: u8, n: usize) {
    let (head, words) = split(dst, n);
    let word = usize::from_ne_bytes([byte; W]);
    let mut d = dst;
    // SAFETY: as in `store`.
    unsafe {
        for _ in 0..head {
            AtomicU8::from_ptr(d).store(byte, Relaxed);
            d = d.add(1);
        }
        for _ in 0..words {
            debug_assert!(d.cast::<usize>().is_aligned());
            AtomicUsize::from_ptr(d.cast::<usize>()).store(word, Relaxed);
            d = d.add(W);
        }
        for _ in 0..n - head - words * W {
            AtomicU8::from_ptr(d).store(byte, Relaxed);
            d = d.add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pseudo-random byte pattern (no two neighbouring words alike).
    fn pattern(n: usize, seed: u32) -> Vec<u8> {
        let mut x = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect()
    }

    #[test]
    fn racy_copies_are_byte_exact() {
        const PAD: usize = 24;
        for len in (0..100).chain([4096 + 3, (1 << 20) + 5]) {
            for src_off in 0..8 {
                for dst_off in 0..8 {
                    if len > 4096 && !matches!((src_off, dst_off), (0, 0) | (3, 5) | (7, 2)) {
                        continue; // the big sizes at a few alignments suffice
                    }
                    let seed = (len * 64 + src_off * 8 + dst_off) as u32;
                    let data = pattern(len, seed);

                    // load: from (shared) memory at src_off into a plain buffer.
                    let mut shared = pattern(len + 2 * PAD, !seed);
                    shared[PAD + src_off..][..len].copy_from_slice(&data);
                    let before = shared.clone();
                    let mut out = vec![0xa5u8; len + 2 * PAD];
                    // SAFETY: in bounds of `shared`, which nothing else accesses.
                    unsafe {
                        load(
                            shared.as_ptr().add(PAD + src_off),
                            &mut out[PAD + dst_off..][..len],
                        )
                    };
                    assert_eq!(&out[PAD + dst_off..][..len], &data[..], "load {len}");
                    assert!(out[..PAD + dst_off].iter().all(|&b| b == 0xa5));
                    assert!(out[PAD + dst_off + len..].iter().all(|&b| b == 0xa5));
                    assert_eq!(shared, before, "load must not write the source");

                    // store: into (shared) memory at dst_off, nothing around it.
                    let mut expect = before.clone();
                    expect[PAD + dst_off..][..len].copy_from_slice(&data);
                    // SAFETY: in bounds of `shared`, which nothing else accesses.
                    unsafe { store(&data, shared.as_mut_ptr().add(PAD + dst_off)) };
                    assert_eq!(shared, expect, "store {len} at +{dst_off}");

                    // fill
                    let byte = seed as u8 | 1;
                    expect[PAD + src_off..][..len].fill(byte);
                    // SAFETY: as above.
                    unsafe { fill(shared.as_mut_ptr().add(PAD + src_off), byte, len) };
                    assert_eq!(shared, expect, "fill {len} at +{src_off}");
                }
            }
        }
    }
}
