//! Memory registration cost by size, with the cost per 4 KiB page.
//!
//! Sizes 4 KiB to 1 GiB when the machine has at least 4 GiB of memory, else
//! to 256 MiB (the default soft-RoCE guest has 2 GiB, and a size needs room
//! for the buffer twice: `Mr::new`'s allocation and the touched copy below).
//! Give the guest more with `RDMA_VERBS_VM_MEM_MB=4608 cargo xtask run -- ...`.
//! Three measurements per size:
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

fn main() {
    require_bench_flag("mr_reg");
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let total = mem_total();
    let largest: usize = if total >= 4 << 30 { 1 << 30 } else { 256 << 20 };
    println!(
        "rdma-verbs mr_reg bench: registration cost by size (4 KiB .. {} MiB; MemTotal {} MiB{})",
        largest >> 20,
        total >> 20,
        if largest < 1 << 30 {
            "; 1 GiB needs 4 GiB: RDMA_VERBS_VM_MEM_MB=4608"
        } else {
            ""
        }
    );
    println!(
        "{:>10} {:>6} {:>14} {:>12} {:>14} {:>12} {:>16} {:>12}",
        "size", "reps", "Mr::new us", "ns/page", "drop us", "ns/page", "reg+dereg us", "ns/page"
    );
    let mut size = PAGE;
    while size <= largest {
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
