//! A tiny timing harness for the `harness = false` benches (no criterion: it is
//! heavy for a 2-core box, and the benches run inside a soft-RoCE guest).
//!
//! Time stamps are the CPU's time-stamp counter, calibrated against the
//! monotonic clock (the guest's clock source is the slow HPET), and every case
//! reports the median of several batches. [`CountingAlloc`] counts heap
//! allocations made through Rust's global allocator (libibverbs' own `malloc`
//! calls are not seen). Benches run only with `--bench` (as `cargo bench` and
//! `cargo xtask run -- target/release/deps/<bench>-<hash> --bench` pass it), so
//! that `cargo test --benches` on a machine without RDMA does not fail.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rdma_verbs::QpCaps;

/// Counts allocations; install with `#[global_allocator]`.
pub struct CountingAlloc;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; the counter
// update has no effect on the memory handed out.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations (alloc, alloc_zeroed, realloc) so far.
pub fn allocs() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

/// Reads the time-stamp counter (nanoseconds elsewhere).
#[inline(always)]
pub fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86_64.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }
}

/// Ticks per nanosecond, measured over 100 ms.
pub fn ticks_per_ns() -> f64 {
    static RATE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *RATE.get_or_init(|| {
        let t0 = Instant::now();
        let c0 = ticks();
        std::thread::sleep(Duration::from_millis(100));
        let c1 = ticks();
        (c1 - c0) as f64 / t0.elapsed().as_nanos() as f64
    })
}

/// Converts ticks to nanoseconds.
pub fn ns(ticks: u64) -> f64 {
    ticks as f64 / ticks_per_ns()
}

/// Exits 0 with a note unless `--bench` was passed (see the module docs).
pub fn require_bench_flag(name: &str) {
    if !std::env::args().any(|a| a == "--bench") {
        println!("{name}: skipped (run with --bench, inside `cargo xtask run`)");
        std::process::exit(0);
    }
}

/// The result of one case.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// Median nanoseconds per operation over the batches.
    pub ns_per_op: f64,
    /// Fastest batch, nanoseconds per operation.
    pub min_ns_per_op: f64,
    /// Heap allocations per operation, over all timed batches.
    pub allocs_per_op: f64,
}

/// Runs `f(ops)` once to warm up, then `batches` times for `ops` operations
/// each; prints and returns the median time per operation.
pub fn bench(name: &str, batches: usize, ops: u64, mut f: impl FnMut(u64)) -> Measured {
    f(ops.div_ceil(4).max(1));
    let mut per_op = Vec::with_capacity(batches);
    let a0 = allocs();
    for _ in 0..batches {
        let t0 = ticks();
        f(ops);
        let t1 = ticks();
        per_op.push(ns(t1 - t0) / ops as f64);
    }
    let a = allocs() - a0;
    per_op.sort_by(f64::total_cmp);
    let m = Measured {
        ns_per_op: per_op[per_op.len() / 2],
        min_ns_per_op: per_op[0],
        allocs_per_op: a as f64 / (batches as u64 * ops) as f64,
    };
    println!(
        "{name:<44} {:>11.1} ns/op  (min {:>9.1})  {:>6.3} allocs/op",
        m.ns_per_op, m.min_ns_per_op, m.allocs_per_op
    );
    m
}

// The device setup is the tests' own (one copy of it).
#[path = "../../tests/common/mod.rs"]
mod common;

#[allow(unused_imports)] // each bench includes this file and uses a different subset
pub use common::{Pair, all_remote, ctx, gid_index};

/// Creates and connects a pair with `caps`; `cq_depth` completions per CQ.
pub fn pair(caps: QpCaps, cq_depth: u32) -> Pair {
    common::pair_sized(caps, cq_depth, |_, _, _| {})
}
