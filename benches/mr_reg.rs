//! Memory registration cost by size, with the cost per 4 KiB page.
//!
//! Sizes 4 KiB to 256 MiB: the soft-RoCE guest has 2 GiB of memory, so the
//! 1 GiB end of the range is left out (256 MiB is the largest that leaves
//! room for the buffer being pinned twice over during `Mr::new`'s zeroing and
//! the registration). Three measurements per size:
//!
//! * `Mr::new`: allocate page-aligned zeroed memory and register it
//!   (`ibv_reg_mr_iova2`: the kernel pins every page and builds its page list);
//! * drop of that `Mr`: `ibv_dereg_mr` (unpin) and free;
//! * registration alone: `ibv_reg_mr_iova2` + `ibv_dereg_mr` of memory that is
//!   already allocated and touched, which isolates the kernel's pin/unpin work.
//!
//! Run inside the soft-RoCE guest:
//! `cargo bench --no-run`, then `cargo xtask run -- target/release/deps/mr_reg-<hash> --bench`.

#[path = "harness/mod.rs"]
mod harness;

use harness::{ctx, ns, require_bench_flag, ticks};
use rdma_verbs::{AccessFlags, Mr, Pd, ffi};

const PAGE: usize = 4096;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    require_bench_flag("mr_reg");
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    println!(
        "rdma-verbs mr_reg bench: registration cost by size (4 KiB .. 256 MiB; the guest has 2 GiB)"
    );
    println!(
        "{:>10} {:>6} {:>14} {:>12} {:>14} {:>12} {:>16} {:>12}",
        "size", "reps", "Mr::new us", "ns/page", "drop us", "ns/page", "reg+dereg us", "ns/page"
    );
    let mut size = PAGE;
    while size <= 256 << 20 {
        let pages = (size / PAGE) as f64;
        let reps = (64usize << 20).div_ceil(size).clamp(3, 200);
        let (mut new_ns, mut drop_ns, mut reg_ns) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..reps {
            let t0 = ticks();
            let mr = Mr::new(&pd, size, access).expect("Mr::new");
            let t1 = ticks();
            drop(std::hint::black_box(mr));
            let t2 = ticks();
            new_ns.push(ns(t1 - t0));
            drop_ns.push(ns(t2 - t1));
        }
        // Registration alone, of touched memory.
        let mut mem = vec![1u8; size + PAGE];
        let off = mem.as_ptr().align_offset(PAGE);
        let ptr = mem[off..].as_mut_ptr();
        for _ in 0..reps {
            let t0 = ticks();
            // SAFETY: [ptr, ptr+size) is memory we own for the whole call pair and
            // do not touch meanwhile; the registration is released right after.
            let raw = unsafe {
                ffi::ibv_reg_mr_iova2(pd.as_raw(), ptr.cast(), size, ptr as u64, access.bits())
            };
            assert!(
                !raw.is_null(),
                "ibv_reg_mr_iova2 failed: {}",
                std::io::Error::last_os_error()
            );
            // SAFETY: raw came from ibv_reg_mr_iova2 above and is deregistered once.
            let rc = unsafe { ffi::ibv_dereg_mr(raw) };
            assert_eq!(rc, 0, "ibv_dereg_mr");
            reg_ns.push(ns(ticks() - t0));
        }
        drop(mem);
        let (n, d, r) = (median(new_ns), median(drop_ns), median(reg_ns));
        let label = if size >= 1 << 20 {
            format!("{} MiB", size >> 20)
        } else {
            format!("{} KiB", size >> 10)
        };
        println!(
            "{label:>10} {reps:>6} {:>14.1} {:>12.1} {:>14.1} {:>12.1} {:>16.1} {:>12.1}",
            n / 1e3,
            n / pages,
            d / 1e3,
            d / pages,
            r / 1e3,
            r / pages
        );
        size *= 4;
    }
}
