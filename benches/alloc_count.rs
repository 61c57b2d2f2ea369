//! Heap allocations per operation on the safe data paths (ownership passing
//! and scoped borrowing), in steady state.
//!
//! A counting `#[global_allocator]` counts every Rust allocation while each
//! loop runs (after a warm-up that reaches steady state). The bench exits with
//! status 1 if any case allocates at all. Ownership-passing cases: the
//! bandwidth loops of `perf` (WRITE from a shared source with 1 in 100
//! signaled, READ into owned destinations handed back by their completions,
//! SEND with the receive re-posted), post lists, inline WRITEs, and polling an
//! empty CQ. Scoped cases, each inside one `Cq::scope` (on a second QP pair,
//! so that no ownership-passing request is outstanding), polled with
//! `Scope::poll` into a `Vec` with reserved capacity: WRITE from a `Src` with
//! 1 in 100 signaled, READ into a `Dst` (1 in 16 signaled), SEND with the
//! receive re-posted by `ScopedQp::post_recv` in the peer's scope (nested on
//! its CQ), a `PreparedSends` list of 8 WRITEs posted with `post_prepared`,
//! and polling an empty CQ. What entering a scope allocates (not per
//! operation) is printed for information and not checked. Registered memory:
//! an `MrPool` get and put, and a `RegCache` hit.
//! Run inside the soft-RoCE guest:
//! `cargo bench --no-run`, then `cargo xtask run -- target/release/deps/alloc_count-<hash> --bench`.

#[path = "harness/mod.rs"]
mod harness;

use harness::{CountingAlloc, Pair, allocs, pair, require_bench_flag};
use rdma_verbs::Result;
use rdma_verbs::cq::{Completion, Cq};
use rdma_verbs::mr::{AccessFlags, MrPool, RegCache, RemoteMr, SharedMr};
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::scope::{Dst, PreparedSends, Scope, ScopedCompletion, ScopedSend, Src};
use rdma_verbs::qp::{QpCaps, RecvWr, SendWr};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const OPS: u64 = 2000;

/// Polls `cq` until `n` completions arrived, into `out` (never beyond its
/// capacity); checks each and drops it.
fn retire(
    cq: &mut Cq,
    out: &mut Vec<Completion>,
    mut n: usize,
    mut keep: impl FnMut(&mut Completion),
) {
    while n > 0 {
        out.clear();
        let got = cq.poll(out).expect("poll");
        for c in out.iter_mut() {
            c.result().expect("completion");
            keep(c);
        }
        n -= got.min(n);
    }
    out.clear();
}

/// Polls the scope until `n` of its completions arrived, into `out` (never
/// beyond its capacity); checks each.
fn retire_scoped(s: &Scope<'_, '_>, out: &mut Vec<ScopedCompletion>, mut n: usize) {
    while n > 0 {
        out.clear();
        let got = s.poll(out).expect("scope poll");
        for c in out.iter() {
            c.result().expect("scoped completion");
        }
        n -= got.min(n);
    }
    out.clear();
}

/// Runs `f(OPS)` twice (warm-up, then counted); returns allocations per op.
fn count(name: &str, mut f: impl FnMut(u64)) -> f64 {
    f(OPS / 4);
    let a0 = allocs();
    f(OPS);
    let per_op = (allocs() - a0) as f64 / OPS as f64;
    println!("{name:<52} {per_op:>8.4} allocs/op");
    per_op
}

fn main() {
    require_bench_flag("alloc_count");
    let caps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 128,
        max_inline_data: 64,
        ..QpCaps::default()
    };
    let mut p = pair(caps, 512);
    let pd = p.pd.clone();
    let lw = AccessFlags::LOCAL_WRITE;
    let src = pd.alloc_mr(4096, lw).expect("src").freeze();
    let target = pd
        .alloc_mr(
            4096,
            lw | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )
        .expect("target");
    let remote = target.remote();
    let mut out: Vec<Completion> = Vec::with_capacity(16);
    let mut out_b: Vec<Completion> = Vec::with_capacity(16);
    let mut results = Vec::new();
    println!("rdma-verbs alloc_count bench: Rust heap allocations per operation, steady state");

    write_cases(&mut p, &src, remote, &mut out, &mut results);
    read_send_poll_cases(&mut p, &src, remote, &mut out, &mut out_b, &mut results);
    memory_cases(&pd, &mut results);
    drop(p);
    drop(target);
    scoped_cases(caps, &mut results).expect("scoped cases");

    let worst = results.iter().copied().fold(0.0, f64::max);
    if worst > 0.0 {
        println!("FAILED: the safe data path allocates in steady state ({worst} allocs/op)");
        std::process::exit(1);
    }
    println!("ok: 0 allocations per operation in every case");
}

/// A pool's get and put, and a registration-cache hit (the warm-up's first
/// lookup is the miss that registers).
fn memory_cases(pd: &Pd, results: &mut Vec<f64>) {
    let pool = MrPool::new(pd, 256, 64, AccessFlags::LOCAL_WRITE).expect("pool");
    results.push(count("MrPool get + put", |n| {
        for _ in 0..n {
            let mr = pool.get().expect("a free buffer");
            pool.put(mr).expect("put back");
        }
    }));
    // Memory a C library hands out, as the cache's users have.
    let mut mem = vec![0u8; 4096];
    let ptr = mem.as_mut_ptr();
    let cache = RegCache::new(pd);
    results.push(count("RegCache::get, a hit", |n| {
        for _ in 0..n {
            // SAFETY: `mem` outlives the cache (dropped first, below) and
            // every handle (dropped right away); nothing references it.
            std::hint::black_box(unsafe { cache.get(ptr, 4096, AccessFlags::LOCAL_WRITE) })
                .expect("get");
        }
    }));
    drop(cache);
    drop(mem);
}

/// The WRITE cases: a shared source, a post list, inline data.
fn write_cases(
    p: &mut Pair,
    src: &SharedMr,
    remote: RemoteMr,
    out: &mut Vec<Completion>,
    results: &mut Vec<f64>,
) {
    results.push(count("WRITE, shared source, 1 in 100 signaled", |n| {
        for i in 0..n {
            let wr = SendWr::write(i, remote, (i % 64) * 64).sge(src.slice(0, 64).expect("slice"));
            let wr = if i % 100 == 99 || i == n - 1 {
                wr
            } else {
                wr.unsignaled()
            };
            p.a.post_send(wr).expect("post_send");
            if i % 100 == 99 || i == n - 1 {
                retire(&mut p.cq_a, out, 1, |_| {});
            }
        }
    }));

    let piece = src.slice(0, 64).expect("slice");
    results.push(count("WRITE, post list of 16 (1 signaled)", |n| {
        for i in (0..n).step_by(16) {
            let wrs = (0..16).map(|j| {
                let wr = SendWr::write(i + j, remote, j * 64).sge(piece.clone());
                if j == 15 { wr } else { wr.unsignaled() }
            });
            p.a.post_send_list(wrs).expect("post_send_list");
            retire(&mut p.cq_a, out, 1, |_| {});
        }
    }));

    let data = [0x5au8; 32];
    results.push(count("WRITE inline (32 bytes), 1 in 16 signaled", |n| {
        for i in 0..n {
            let wr = SendWr::write_inline(i, &data, remote, 0);
            let wr = if i % 16 == 15 { wr } else { wr.unsignaled() };
            p.a.post_send(wr).expect("post_send");
            if i % 16 == 15 {
                retire(&mut p.cq_a, out, 1, |_| {});
            }
        }
    }));
}

/// READ into recycled destinations, SEND with its receive re-posted, and the
/// poll of an empty CQ.
fn read_send_poll_cases(
    p: &mut Pair,
    src: &SharedMr,
    remote: RemoteMr,
    out: &mut Vec<Completion>,
    out_b: &mut Vec<Completion>,
    results: &mut Vec<f64>,
) {
    let pd = p.pd.clone();
    let lw = AccessFlags::LOCAL_WRITE;
    // READ: each destination comes back with its (signaled) completion.
    let mut dests: Vec<rdma_verbs::mr::Mr> = Vec::with_capacity(8);
    for _ in 0..8 {
        dests.push(pd.alloc_mr(64, lw).expect("dest"));
    }
    results.push(count("READ into owned destinations, recycled", |n| {
        for i in 0..n {
            let dest = dests.pop().expect("a destination is back");
            p.a.post_send(SendWr::read(i, dest, remote, 0))
                .expect("post_send");
            retire(&mut p.cq_a, out, 1, |c| {
                if let Some(mr) = c.take_mr() {
                    dests.push(mr);
                }
            });
        }
    }));

    // SEND with the receive re-posted from its completion.
    for i in 0..16 {
        p.b.post_recv(RecvWr::new(i, pd.alloc_mr(64, lw).expect("recv")))
            .expect("post_recv");
    }
    let msg = src.slice(0, 64).expect("slice");
    results.push(count("SEND + RECV re-posted from its completion", |n| {
        for i in 0..n {
            p.a.post_send(SendWr::send(i).sge(msg.clone()))
                .expect("post_send");
            retire(&mut p.cq_a, out, 1, |_| {});
            out_b.clear();
            while out_b.is_empty() {
                p.cq_b.poll(out_b).expect("poll");
            }
            let c = &mut out_b[0];
            c.result().expect("receive");
            let mr = c.take_mr().expect("receive buffer");
            p.b.post_recv(RecvWr::new(c.wr_id, mr)).expect("post_recv");
            out_b.clear();
        }
    }));

    results.push(count("poll of an empty CQ", |n| {
        for _ in 0..n {
            out.clear();
            std::hint::black_box(p.cq_a.poll(out).expect("poll"));
        }
    }));
}

/// The scoped cases, on a pair of their own (see the module docs).
fn scoped_cases(caps: QpCaps, results: &mut Vec<f64>) -> Result<()> {
    const RECVS: u64 = 16;
    let mut p = pair(caps, 512);
    let pd = p.pd.clone();
    let lw = AccessFlags::LOCAL_WRITE;
    let src_mr = pd.alloc_mr(4096, lw)?;
    let target = pd.alloc_mr(
        4096,
        lw | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
    )?;
    let remote = target.remote();
    let mut read_mr = pd.alloc_mr(64, lw)?;
    let mut recv_mr = pd.alloc_mr(RECVS as usize * 64, lw)?;
    // Borrowed for the scopes below (built outside them, as the scopes
    // require); all of it is set up before anything is counted.
    let src = Src::new(&src_mr)?.slice(0, 64)?;
    let read_dst = Dst::new(&mut read_mr)?;
    let recv_all = Dst::new(&mut recv_mr)?;
    let recv_dst = (0..RECVS)
        .map(|j| recv_all.slice(j as usize * 64, 64))
        .collect::<Result<Vec<_>>>()?;
    let list = PreparedSends::new(
        (0..8u64).map(|j| ScopedSend::write(0, src, remote, j * 64).signaled(j == 7)),
    )?;
    let mut out: Vec<ScopedCompletion> = Vec::with_capacity(16);
    let mut out_b: Vec<ScopedCompletion> = Vec::with_capacity(16);

    p.cq_a.scope(|s| -> Result<()> {
        let mut q = s.attach(&mut p.a)?;
        results.push(count("scoped WRITE from a Src, 1 in 100 signaled", |n| {
            for i in 0..n {
                let last = i % 100 == 99 || i == n - 1;
                let wr = ScopedSend::write(i, src, remote, (i % 64) * 64).signaled(last);
                q.post_send(&wr).expect("post_send");
                if last {
                    retire_scoped(s, &mut out, 1);
                }
            }
        }));
        results.push(count("scoped READ into a Dst, 1 in 16 signaled", |n| {
            for i in 0..n {
                let last = i % 16 == 15 || i == n - 1;
                let wr = ScopedSend::read(i, read_dst, remote, 0).signaled(last);
                q.post_send(&wr).expect("post_send");
                if last {
                    retire_scoped(s, &mut out, 1);
                }
            }
        }));
        results.push(count(
            "scoped PreparedSends of 8 WRITEs (1 signaled)",
            |n| {
                for i in (0..n).step_by(8) {
                    q.post_prepared(&list, i).expect("post_prepared");
                    retire_scoped(s, &mut out, 1);
                }
            },
        ));
        results.push(count("scoped poll of an empty CQ", |n| {
            for _ in 0..n {
                out.clear();
                std::hint::black_box(s.poll(&mut out).expect("poll"));
            }
        }));
        Ok(())
    })?;

    // SEND from a's scope; b's receives, posted and re-posted in its own
    // scope on its CQ, nested in a's.
    p.cq_a.scope(|sa| -> Result<()> {
        let mut qa = sa.attach(&mut p.a)?;
        p.cq_b.scope(|sb| -> Result<()> {
            let mut qb = sb.attach(&mut p.b)?;
            for j in 0..RECVS {
                qb.post_recv(j, recv_dst[j as usize])?;
            }
            let mut send = |i: u64, repost: bool| {
                qa.post_send(&ScopedSend::send(i, src)).expect("post_send");
                retire_scoped(sa, &mut out, 1);
                out_b.clear();
                while out_b.is_empty() {
                    sb.poll(&mut out_b).expect("poll");
                }
                let c = out_b[0];
                c.result().expect("receive");
                assert_eq!(c.byte_len, 64);
                if repost {
                    qb.post_recv(c.wr_id, recv_dst[c.wr_id as usize])
                        .expect("post_recv");
                }
                out_b.clear();
            };
            results.push(count("scoped SEND + RECV re-posted by post_recv", |n| {
                for i in 0..n {
                    send(i, true);
                }
            }));
            // Use up the posted receives so that the scope ends with nothing
            // outstanding.
            for i in 0..RECVS {
                send(i, false);
            }
            Ok(())
        })
    })?;

    // Information: what entering a scope and attaching a QP costs (once per
    // scope, not per operation; the QP's tables already exist).
    let a0 = harness::allocs();
    p.cq_a.scope(|s| s.attach(&mut p.a).map(drop))?;
    println!(
        "{:<52} {:>8} allocs (per scope; information, not checked)",
        "Cq::scope + attach",
        harness::allocs() - a0
    );
    Ok(())
}
