//! What the benches share: the `--bench` gate, divan's entry point, a counting
//! allocator (for `alloc_count`) and the device setup of the tests.
//!
//! Benches run only with `--bench` (as `cargo bench` and
//! `cargo xtask run -- target/release/deps/<bench>-<hash> --bench` pass it), so
//! that `cargo test --benches` on a machine without RDMA does not fail.
// Each bench includes this file and uses a different subset of it.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use rdma_verbs::qp::QpCaps;

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

/// Exits 0 with a note unless `--bench` was passed (see the module docs).
pub fn require_bench_flag(name: &str) {
    if !std::env::args().any(|a| a == "--bench") {
        println!("{name}: skipped (run with --bench, inside `cargo xtask run`)");
        std::process::exit(0);
    }
}

/// The `main` of the divan benches: the `--bench` gate, then `divan::main()`
/// with the TSC timer unless `--timer` or `DIVAN_TIMER` chose one.
///
/// Divan has no setter for the timer, only the flag and the variable, so this
/// sets the variable. Divan falls back to the OS clock (with a warning) where
/// the CPU does not report an invariant TSC, as in the `cargo xtask` guest.
pub fn divan_main(name: &str) {
    require_bench_flag(name);
    let chosen = std::env::var_os("DIVAN_TIMER").is_some()
        || std::env::args().any(|a| a == "--timer" || a.starts_with("--timer="));
    if !chosen {
        // SAFETY: called first thing in `main`, before any other thread exists
        // (divan starts its threads inside `divan::main`).
        unsafe { std::env::set_var("DIVAN_TIMER", "tsc") };
    }
    divan::main();
}

// The device setup is the tests' own (one copy of it).
#[path = "../../tests/common/mod.rs"]
mod common;

#[allow(unused_imports)] // each bench uses a different subset
pub use common::{Pair, all_remote, ctx, gid_index};

/// Creates and connects a pair with `caps`; `cq_depth` completions per CQ.
pub fn pair(caps: QpCaps, cq_depth: u32) -> Pair {
    common::pair_sized(caps, cq_depth, |_, _, _| {})
}
