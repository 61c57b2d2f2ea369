//! Memory registration cost by size, divan benches. The argument is the size
//! in KiB; the item rate counts 4 KiB pages (pages per second).
//!
//! Sizes 4 KiB to 1 GiB when the machine has at least 4 GiB of memory, else
//! to 256 MiB (the default soft-RoCE guest has 2 GiB).
//! Give the guest more with `RDMA_VERBS_VM_MEM_MB=4608 cargo xtask run -- ...`.
//! Three measurements per size:
//!
//! * `new_mr`: `Mr::new`, allocate page-aligned zeroed memory and register it
//!   (`ibv_reg_mr_iova2`: the kernel pins every page and builds its page list);
//! * `drop_mr`: drop of that `Mr`, `ibv_dereg_mr` (unpin) and free;
//! * `reg_dereg`: `ibv_reg_mr_iova2` + `ibv_dereg_mr` of memory that is
//!   already allocated and touched, which isolates the kernel's pin/unpin work.
//!
//! One operation per sample (so one `Mr` lives at a time), up to 100 samples
//! or about 3 s per size, untimed setup included (5 s for `drop_mr`, whose
//! setup is `Mr::new`).
//!
//! Run inside the soft-RoCE guest: `cargo bench --no-run --all-features` prints
//! the executable, then
//! `cargo xtask run -- target/release/deps/mr_reg-<hash> --bench`.
//! Divan options follow `--bench`. The TSC timer is the default where the CPU
//! has an invariant TSC (not in the guest: there divan warns and uses the OS
//! clock); see `harness::divan_main`.

#[path = "harness/mod.rs"]
mod harness;

use std::sync::LazyLock;

use divan::Bencher;
use divan::counter::ItemsCount;
use harness::ctx;
use rdma_verbs::context::Context;
use rdma_verbs::ffi;
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::pd::Pd;

const PAGE: usize = 4096;

fn main() {
    harness::divan_main("mr_reg");
    println!("argument: size in KiB; item/s: 4 KiB pages per second");
    if largest() < 1 << 30 {
        println!(
            "note: MemTotal {} MiB; the 1 GiB size needs 4 GiB (RDMA_VERBS_VM_MEM_MB=4608)",
            mem_total() >> 20
        );
    }
}

/// MemTotal from /proc/meminfo, in bytes (0 if unreadable).
fn mem_total() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            let line = t.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib << 10)
        })
        .unwrap_or(0)
}

/// The largest size measured, in bytes.
fn largest() -> usize {
    if mem_total() >= 4 << 30 {
        1 << 30
    } else {
        256 << 20
    }
}

/// The sizes, in KiB: 4 KiB, then times 4 up to [`largest`].
fn sizes_kib() -> Vec<usize> {
    std::iter::successors(Some(PAGE >> 10), |k| Some(k * 4))
        .take_while(|&k| k << 10 <= largest())
        .collect()
}

static PD: LazyLock<(Context, Pd)> = LazyLock::new(|| {
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    (ctx, pd)
});

fn access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
}

/// `bencher` with the page count of `kib` as its item counter.
fn per_page<'a, 'b>(bencher: Bencher<'a, 'b>, kib: usize) -> Bencher<'a, 'b> {
    bencher.counter(ItemsCount::new((kib << 10) / PAGE))
}

#[divan::bench(args = sizes_kib(), sample_count = 100, sample_size = 1, max_time = 3)]
fn new_mr(bencher: Bencher, kib: usize) {
    let pd = &PD.1;
    per_page(bencher, kib).bench_local(|| Mr::new(pd, kib << 10, access()).expect("Mr::new"));
}

#[divan::bench(args = sizes_kib(), sample_count = 100, sample_size = 1, max_time = 5)]
fn drop_mr(bencher: Bencher, kib: usize) {
    let pd = &PD.1;
    per_page(bencher, kib)
        .with_inputs(|| Mr::new(pd, kib << 10, access()).expect("Mr::new"))
        .bench_local_values(drop);
}

#[divan::bench(args = sizes_kib(), sample_count = 100, sample_size = 1, max_time = 3)]
fn reg_dereg(bencher: Bencher, kib: usize) {
    let pd = &PD.1;
    let size = kib << 10;
    let mut mem = vec![1u8; size + PAGE];
    let off = mem.as_ptr().align_offset(PAGE);
    let ptr = mem[off..].as_mut_ptr();
    let access = access().bits();
    per_page(bencher, kib).bench_local(|| {
        // SAFETY: [ptr, ptr+size) lies in `mem`, which outlives the call pair
        // and is not touched meanwhile; the registration is released right after.
        let raw =
            unsafe { ffi::ibv_reg_mr_iova2(pd.as_raw(), ptr.cast(), size, ptr as u64, access) };
        assert!(
            !raw.is_null(),
            "ibv_reg_mr_iova2 failed: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: raw came from ibv_reg_mr_iova2 above and is deregistered once.
        let rc = unsafe { ffi::ibv_dereg_mr(raw) };
        assert_eq!(rc, 0, "ibv_dereg_mr");
    });
    drop(mem);
}
