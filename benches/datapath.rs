//! Data-path costs on a loopback QP pair (one device), safe path against raw
//! path on the same pair:
//!
//! * post + poll round trip of a 1-SGE SEND (with the receive re-posted) and
//!   of a 1-SGE RDMA WRITE;
//! * posting WRITEs one by one, one signaled in 16 (the bandwidth loop);
//! * `Cq::poll` / `Cq::poll_raw` of an empty CQ and of a full batch of 32.
//!
//! Each line: median ns per operation over the batches, the fastest batch, and
//! heap allocations per operation. Run inside the soft-RoCE guest:
//! `cargo bench --no-run` then `cargo xtask run -- target/release/deps/datapath-<hash> --bench`.

#[path = "harness/mod.rs"]
mod harness;

use std::hint::black_box;

use harness::{CountingAlloc, bench, ns, pair, require_bench_flag, ticks};
use rdma_verbs::qp::Rts;
use rdma_verbs::{AccessFlags, Completion, Cq, Mr, Qp, QpCaps, Rc, RecvWr, SendWr, SharedMr, ffi};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const MSG: usize = 64;
const BATCHES: usize = 7;

/// Polls `cq` (safe) until one completion is in `out`; panics on failure.
fn wait_safe(cq: &mut Cq, out: &mut Vec<Completion>) {
    out.clear();
    while out.is_empty() {
        cq.poll(out).expect("poll");
    }
    out[0].result().expect("completion");
}

/// Polls `cq` (raw) until one completion arrived.
fn wait_raw(cq: &mut Cq, wc: &mut [ffi::ibv_wc; 1]) {
    while cq.poll_raw(wc).expect("poll_raw") == 0 {}
    assert_eq!(wc[0].status, ffi::IBV_WC_SUCCESS, "raw completion failed");
}

/// A prepared 1-SGE send request on `mr`.
fn raw_wr(mr: &Mr, opcode: u32, signaled: bool) -> Box<(ffi::ibv_send_wr, ffi::ibv_sge)> {
    let mut b = Box::new((
        ffi::ibv_send_wr::default(),
        ffi::ibv_sge {
            addr: mr.addr(),
            length: MSG as u32,
            lkey: mr.lkey(),
        },
    ));
    b.0.opcode = opcode;
    b.0.num_sge = 1;
    b.0.sg_list = &mut b.1;
    if signaled {
        b.0.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
    }
    b
}

/// Posts a prepared raw request.
fn post_raw(qp: &mut Qp<Rc, Rts>, wr: &mut ffi::ibv_send_wr) {
    // SAFETY: every SGE used here points into an Mr that lives until the end of
    // `main`, after the QPs are gone; no Rust code reads or writes those Mrs
    // while requests are in flight; the remote address is inside `b`'s target
    // region; the completions are polled with poll_raw only.
    unsafe { qp.post_send_raw(wr) }.expect("post_send_raw");
}

fn main() {
    require_bench_flag("datapath");
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        ..QpCaps::default()
    };
    let mut p = pair(caps, 256);
    let pd = p.pd.clone();
    let lw = AccessFlags::LOCAL_WRITE;
    let src: SharedMr = pd.alloc_mr(MSG, lw).expect("src").freeze();
    let raw_src = pd.alloc_mr(MSG, lw).expect("raw src");
    let raw_dst = pd.alloc_mr(MSG, lw).expect("raw recv");
    let target = pd
        .alloc_mr(MSG * 64, lw | AccessFlags::REMOTE_WRITE)
        .expect("target");
    let remote = target.remote();
    let mut out_a: Vec<Completion> = Vec::with_capacity(32);
    let mut out_b: Vec<Completion> = Vec::with_capacity(32);
    let mut wc = [ffi::ibv_wc::default()];
    println!("rdma-verbs datapath bench ({MSG}-byte messages, loopback RC pair)");

    // SEND round trip, safe: the receive buffer comes back and is re-posted.
    p.b.post_recv(RecvWr::new(0, pd.alloc_mr(MSG, lw).expect("recv")))
        .expect("post_recv");
    let safe_send = bench("send round trip, safe", BATCHES, 400, |n| {
        for i in 0..n {
            p.a.post_send(SendWr::send(i).sge(src.clone()))
                .expect("post_send");
            wait_safe(&mut p.cq_a, &mut out_a);
            wait_safe(&mut p.cq_b, &mut out_b);
            let mr = out_b[0].take_mr().expect("receive buffer");
            p.b.post_recv(RecvWr::new(0, mr)).expect("post_recv");
            out_a.clear();
            out_b.clear();
        }
    });
    // Retire the receive still posted on the safe path: one more SEND.
    p.a.post_send(SendWr::send(0).sge(src.clone()))
        .expect("post_send");
    wait_safe(&mut p.cq_a, &mut out_a);
    wait_safe(&mut p.cq_b, &mut out_b);
    out_a.clear();
    out_b.clear();

    // SEND round trip, raw.
    let mut send_wr = raw_wr(&raw_src, ffi::IBV_WR_SEND, true);
    let mut recv = Box::new((
        ffi::ibv_recv_wr::default(),
        ffi::ibv_sge {
            addr: raw_dst.addr(),
            length: MSG as u32,
            lkey: raw_dst.lkey(),
        },
    ));
    recv.0.num_sge = 1;
    recv.0.sg_list = &mut recv.1;
    // SAFETY: raw_dst is registered with LOCAL_WRITE, outlives the QPs and is
    // never touched by Rust code; completions are polled with poll_raw.
    unsafe { p.b.post_recv_raw(&mut recv.0) }.expect("post_recv_raw");
    let raw_send = bench("send round trip, raw", BATCHES, 400, |n| {
        for i in 0..n {
            send_wr.0.wr_id = i;
            post_raw(&mut p.a, &mut send_wr.0);
            wait_raw(&mut p.cq_a, &mut wc);
            wait_raw(&mut p.cq_b, &mut wc);
            // SAFETY: as for the first raw receive.
            unsafe { p.b.post_recv_raw(&mut recv.0) }.expect("post_recv_raw");
        }
    });
    // Consume the outstanding raw receive before the safe cases.
    post_raw(&mut p.a, &mut send_wr.0);
    wait_raw(&mut p.cq_a, &mut wc);
    wait_raw(&mut p.cq_b, &mut wc);

    // WRITE round trip (post, wait for the completion).
    let safe_write = bench("write round trip, safe", BATCHES, 400, |n| {
        for i in 0..n {
            p.a.post_send(SendWr::write(i, remote, 0).sge(src.clone()))
                .expect("post_send");
            wait_safe(&mut p.cq_a, &mut out_a);
            out_a.clear();
        }
    });
    let mut write_wr = raw_wr(&raw_src, ffi::IBV_WR_RDMA_WRITE, true);
    write_wr.0.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
        remote_addr: remote.addr,
        rkey: remote.rkey,
    };
    let raw_write = bench("write round trip, raw", BATCHES, 400, |n| {
        for i in 0..n {
            write_wr.0.wr_id = i;
            post_raw(&mut p.a, &mut write_wr.0);
            wait_raw(&mut p.cq_a, &mut wc);
        }
    });

    // Posting one by one, one signaled in 16 (the bandwidth loop's shape).
    let safe_post = bench(
        "write, 1 signaled in 16, per WR, safe",
        BATCHES,
        1600,
        |n| {
            for i in 0..n {
                // Built in the call (an `if` choosing between requests copies one).
                p.a.post_send(
                    SendWr::write_from(i, src.clone(), remote, (i % 64) * MSG as u64)
                        .signaled(i % 16 == 15),
                )
                .expect("post_send");
                if i % 16 == 15 {
                    wait_safe(&mut p.cq_a, &mut out_a);
                    out_a.clear();
                }
            }
        },
    );
    let raw_post = bench("write, 1 signaled in 16, per WR, raw", BATCHES, 1600, |n| {
        for i in 0..n {
            let sig = i % 16 == 15;
            write_wr.0.send_flags = if sig {
                ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            write_wr.0.wr.rdma.remote_addr = remote.addr + (i % 64) * MSG as u64;
            post_raw(&mut p.a, &mut write_wr.0);
            if sig {
                wait_raw(&mut p.cq_a, &mut wc);
            }
        }
    });

    // Polling an empty CQ.
    let mut out32: Vec<Completion> = Vec::with_capacity(32);
    let mut wcs = [ffi::ibv_wc::default(); 32];
    bench("poll empty CQ, safe", BATCHES, 20_000, |n| {
        for _ in 0..n {
            black_box(p.cq_b.poll(&mut out32).expect("poll"));
        }
    });
    bench("poll empty CQ, raw", BATCHES, 20_000, |n| {
        for _ in 0..n {
            black_box(p.cq_b.poll_raw(&mut wcs).expect("poll_raw"));
        }
    });

    // Polling a full batch of 32 (and, safe, dropping the completions with the
    // shared sources they carry back).
    let full_safe = full_batch("poll full batch of 32, per call, safe", |fill| {
        if fill {
            for i in 0..32 {
                p.a.post_send(SendWr::write(i, remote, i * MSG as u64).sge(src.clone()))
                    .expect("post_send");
            }
            return 0;
        }
        let t0 = ticks();
        let got = p.cq_a.poll(&mut out32).expect("poll");
        out32.clear();
        let t = ticks() - t0;
        drain_safe(&mut p.cq_a, 32 - got, &mut out32);
        if got == 32 { t } else { u64::MAX }
    });
    let full_raw = full_batch("poll full batch of 32, per call, raw", |fill| {
        if fill {
            for i in 0..32 {
                write_wr.0.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
                write_wr.0.wr.rdma.remote_addr = remote.addr + i * MSG as u64;
                post_raw(&mut p.a, &mut write_wr.0);
            }
            return 0;
        }
        let t0 = ticks();
        let got = p.cq_a.poll_raw(&mut wcs).expect("poll_raw");
        let t = ticks() - t0;
        let mut left = 32 - got;
        while left > 0 {
            left -= p.cq_a.poll_raw(&mut wcs[..left]).expect("poll_raw");
        }
        if got == 32 { t } else { u64::MAX }
    });

    println!();
    println!("safe - raw, per operation:");
    for (what, s, r) in [
        ("send round trip", safe_send.ns_per_op, raw_send.ns_per_op),
        (
            "write round trip",
            safe_write.ns_per_op,
            raw_write.ns_per_op,
        ),
        (
            "write post (1 in 16 signaled)",
            safe_post.ns_per_op,
            raw_post.ns_per_op,
        ),
        ("poll full batch of 32", full_safe, full_raw),
    ] {
        println!(
            "  {what:<32} {:>+10.1} ns  ({:+.1}%)",
            s - r,
            (s / r - 1.0) * 100.0
        );
    }
    drop(p);
    drop((raw_src, raw_dst, target));
}

/// Retires `n` more safe completions.
fn drain_safe(cq: &mut Cq, mut n: usize, out: &mut Vec<Completion>) {
    while n > 0 {
        out.clear();
        n -= cq.poll(out).expect("poll").min(n);
    }
    out.clear();
}

/// Times one poll of a CQ holding 32 completions: `step(true)` posts 32
/// signaled requests, `step(false)` polls once and returns the ticks taken
/// (`u64::MAX` when fewer than 32 had arrived). Prints and returns the median
/// ns per call.
fn full_batch(name: &str, mut step: impl FnMut(bool) -> u64) -> f64 {
    let mut wait_ms = 2u64;
    let mut samples = Vec::new();
    let a0 = harness::allocs();
    let mut calls = 0;
    while samples.len() < 41 && calls < 400 {
        calls += 1;
        step(true);
        std::thread::sleep(std::time::Duration::from_millis(wait_ms));
        let t = step(false);
        if t == u64::MAX {
            wait_ms = (wait_ms * 2).min(200);
        } else {
            samples.push(ns(t));
        }
    }
    let allocs = harness::allocs() - a0;
    samples.sort_by(f64::total_cmp);
    let med = samples.get(samples.len() / 2).copied().unwrap_or(f64::NAN);
    println!(
        "{name:<44} {med:>11.1} ns/call ({:.1} ns/completion, {} samples)  {:.3} allocs/completion",
        med / 32.0,
        samples.len(),
        allocs as f64 / (calls * 32) as f64
    );
    med
}
