//! `MrPool` get and put, in a loop of a given length, for counting
//! instructions per buffer under callgrind.
//!
//! `pool_insn --bench MODE N` runs N iterations of MODE on a pool of 64
//! buffers of 4 KiB: `getput` (`get` then `put` of one buffer) or, with the
//! `bytes` feature, `bytes` (`get`, `to_bytes` over the whole buffer, and the
//! drop of that `Bytes`, which puts the buffer back). Run it under callgrind at
//! two counts in the soft-RoCE guest; the difference of the two totals over
//! the difference of the counts is the cost per buffer, start-up (device
//! open, registration) and teardown cancelled, as `cargo xtask insn` does:
//! `cargo bench --features bytes --bench pool_insn --no-run`, then
//! `cargo xtask run -- sh -c 'valgrind --tool=callgrind
//! --callgrind-out-file=/tmp/p.cg BIN --bench getput 10000'` (and 110000),
//! each total on the `summary:` line of the output file
//! (`docs/performance.md`, "Pool get and put").

#[path = "harness/mod.rs"]
mod harness;

use std::hint::black_box;

use harness::{ctx, require_bench_flag};
use rdma_verbs::mr::{AccessFlags, MrPool};
use rdma_verbs::pd::Pd;

fn main() {
    require_bench_flag("pool_insn");
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let (mode, n) = match args.as_slice() {
        [mode, n] => (
            mode.as_str(),
            n.parse::<u64>().expect("N: an iteration count"),
        ),
        _ => {
            eprintln!("usage: pool_insn --bench getput|bytes N");
            std::process::exit(2);
        }
    };
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let pool = MrPool::new(&pd, 4096, 64, AccessFlags::LOCAL_WRITE).expect("pool");
    match mode {
        "getput" => {
            for _ in 0..n {
                let mr = black_box(pool.get().expect("a free buffer"));
                pool.put(mr).expect("put");
            }
        }
        "bytes" => bytes_loop(pool, n),
        _ => {
            eprintln!("pool_insn: unknown mode {mode:?} (getput or bytes)");
            std::process::exit(2);
        }
    }
}

#[cfg(feature = "bytes")]
fn bytes_loop(pool: MrPool, n: u64) {
    let pool = std::sync::Arc::new(pool);
    for _ in 0..n {
        let mr = pool.get().expect("a free buffer");
        let b = pool
            .to_bytes(mr, 4096)
            .map_err(|r| r.error)
            .expect("to_bytes");
        drop(black_box(b));
    }
}

#[cfg(not(feature = "bytes"))]
fn bytes_loop(_: MrPool, _: u64) {
    eprintln!("pool_insn: the bytes mode needs --features bytes");
    std::process::exit(2);
}
