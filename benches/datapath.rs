//! Data-path costs on a loopback RC QP pair (one device), divan benches; each
//! case has a `safe` and a `raw` row, both on the same pair:
//!
//! * `send_round_trip`: post + poll of a 1-SGE 64-byte SEND, with the receive
//!   re-posted; `write_round_trip`: post + poll of a 1-SGE 64-byte RDMA WRITE;
//! * `write_1_in_16_signaled`: posting WRITEs one by one, one signaled in 16
//!   (the bandwidth loop), per WR;
//! * `poll_empty_cq`: `Cq::poll` / `Cq::poll_raw` of an empty CQ;
//!   `poll_full_batch_32`: one call that returns 32 completions (safe: and
//!   drops them); the 32 WRITEs are posted and completed untimed beforehand;
//!   its item rate is completions per second.
//!
//! Every case leaves the CQs drained, so safe and raw completions never mix.
//! Divan's `AllocProfiler` reports heap allocations per iteration, in rows
//! under the case's times; no such rows means none.
//!
//! Run inside the soft-RoCE guest: `cargo bench --no-run --all-features` prints
//! the executable, then
//! `cargo xtask run -- target/release/deps/datapath-<hash> --bench`.
//! Divan options follow `--bench` (e.g. a name filter, `--sample-count 50`).
//! The TSC timer is the default where the CPU has an invariant TSC (see
//! `harness::divan_main`); the guest's CPU has none, so there divan warns and
//! uses the OS clock (precision about 0.8 us there), read twice per sample of
//! several iterations.

#[path = "harness/mod.rs"]
mod harness;

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use divan::counter::ItemsCount;
use divan::{AllocProfiler, Bencher, black_box};
use harness::{Pair, pair};
use rdma_verbs::cq::{Completion, Cq};
use rdma_verbs::ffi;
use rdma_verbs::mr::{AccessFlags, Mr, RemoteMr, SharedMr};
use rdma_verbs::qp::{Qp, QpCaps, Rc, RecvWr, Rts, SendWr};

#[global_allocator]
static ALLOC: AllocProfiler = AllocProfiler::system();

const MSG: usize = 64;
/// Completions per call in `poll_full_batch_32`.
const BATCH: usize = 32;
/// Batches prepared per sample in `poll_full_batch_32` (all outstanding at once).
const BATCHES_PER_SAMPLE: u32 = 8;

fn main() {
    harness::divan_main("datapath");
    let short = SHORT_POLLS.load(Ordering::Relaxed);
    if short > 0 {
        println!("note: {short} full-batch polls found fewer than {BATCH} completions");
    }
}

/// The pair and buffers every case uses, set up on first use.
struct State {
    p: Pair,
    /// Safe-path source.
    src: SharedMr,
    /// Raw-path source and receive buffer: never touched by Rust code.
    raw_src: Mr,
    raw_dst: Mr,
    /// The WRITE target (64 messages), kept alive with the QPs.
    _target: Mr,
    remote: RemoteMr,
    out_a: Vec<Completion>,
    out_b: Vec<Completion>,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| {
    // Room for a sample's batches of `poll_full_batch_32`, all outstanding.
    let caps = QpCaps {
        max_send_wr: BATCHES_PER_SAMPLE * BATCH as u32,
        max_recv_wr: 64,
        ..QpCaps::default()
    };
    let p = pair(caps, 2 * BATCHES_PER_SAMPLE * BATCH as u32);
    let pd = p.pd.clone();
    let lw = AccessFlags::LOCAL_WRITE;
    let target = pd
        .alloc_mr(MSG * 64, lw | AccessFlags::REMOTE_WRITE)
        .expect("target");
    Mutex::new(State {
        src: pd.alloc_mr(MSG, lw).expect("src").freeze(),
        raw_src: pd.alloc_mr(MSG, lw).expect("raw src"),
        raw_dst: pd.alloc_mr(MSG, lw).expect("raw recv"),
        remote: target.remote(),
        _target: target,
        out_a: Vec::with_capacity(BATCH),
        out_b: Vec::with_capacity(BATCH),
        p,
    })
});

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(PoisonError::into_inner)
}

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

/// A prepared 1-SGE send request on `mr` (boxed: `sg_list` points into it).
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

/// A raw RDMA WRITE of `raw_src` to the start of the target.
fn raw_write(s: &State) -> Box<(ffi::ibv_send_wr, ffi::ibv_sge)> {
    let mut w = raw_wr(&s.raw_src, ffi::IBV_WR_RDMA_WRITE, true);
    w.0.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
        remote_addr: s.remote.addr,
        rkey: s.remote.rkey,
    };
    w
}

/// Posts a prepared raw request.
fn post_raw(qp: &mut Qp<Rc, Rts>, wr: &mut ffi::ibv_send_wr) {
    // SAFETY: every SGE used here points into an Mr of `STATE`, which is never
    // dropped; no Rust code reads or writes those Mrs; the remote address is
    // inside the target; the completions are polled with poll_raw only.
    unsafe { qp.post_send_raw(wr) }.expect("post_send_raw");
}

mod send_round_trip {
    use super::*;

    #[divan::bench(sample_count = 100, sample_size = 32)]
    fn safe(bencher: Bencher) {
        let mut g = state();
        let State {
            p,
            src,
            out_a,
            out_b,
            ..
        } = &mut *g;
        let lw = AccessFlags::LOCAL_WRITE;
        p.b.post_recv(RecvWr::new(0, p.pd.alloc_mr(MSG, lw).expect("recv")))
            .expect("post_recv");
        let mut i = 0;
        bencher.bench_local(|| {
            i += 1;
            p.a.post_send(SendWr::send(i).sge(src.clone()))
                .expect("post_send");
            wait_safe(&mut p.cq_a, out_a);
            wait_safe(&mut p.cq_b, out_b);
            let mr = out_b[0].take_mr().expect("receive buffer");
            p.b.post_recv(RecvWr::new(0, mr)).expect("post_recv");
            out_a.clear();
            out_b.clear();
        });
        // Retire the receive still posted: one more SEND.
        p.a.post_send(SendWr::send(0).sge(src.clone()))
            .expect("post_send");
        wait_safe(&mut p.cq_a, out_a);
        wait_safe(&mut p.cq_b, out_b);
        out_a.clear();
        out_b.clear();
    }

    #[divan::bench(sample_count = 100, sample_size = 32)]
    fn raw(bencher: Bencher) {
        let mut g = state();
        let s = &mut *g;
        let mut send = raw_wr(&s.raw_src, ffi::IBV_WR_SEND, true);
        let mut recv = Box::new((
            ffi::ibv_recv_wr::default(),
            ffi::ibv_sge {
                addr: s.raw_dst.addr(),
                length: MSG as u32,
                lkey: s.raw_dst.lkey(),
            },
        ));
        recv.0.num_sge = 1;
        recv.0.sg_list = &mut recv.1;
        let p = &mut s.p;
        // SAFETY: raw_dst is registered with LOCAL_WRITE, lives in `STATE` (never
        // dropped) and is never touched by Rust code; completions are polled
        // with poll_raw.
        unsafe { p.b.post_recv_raw(&mut recv.0) }.expect("post_recv_raw");
        let mut wc = [ffi::ibv_wc::default()];
        let mut i = 0;
        bencher.bench_local(|| {
            i += 1;
            send.0.wr_id = i;
            post_raw(&mut p.a, &mut send.0);
            wait_raw(&mut p.cq_a, &mut wc);
            wait_raw(&mut p.cq_b, &mut wc);
            // SAFETY: as for the first raw receive.
            unsafe { p.b.post_recv_raw(&mut recv.0) }.expect("post_recv_raw");
        });
        // Consume the outstanding raw receive.
        post_raw(&mut p.a, &mut send.0);
        wait_raw(&mut p.cq_a, &mut wc);
        wait_raw(&mut p.cq_b, &mut wc);
    }
}

mod write_round_trip {
    use super::*;

    #[divan::bench(sample_count = 100, sample_size = 32)]
    fn safe(bencher: Bencher) {
        let mut g = state();
        let State {
            p,
            src,
            remote,
            out_a,
            ..
        } = &mut *g;
        let mut i = 0;
        bencher.bench_local(|| {
            i += 1;
            p.a.post_send(SendWr::write(i, *remote, 0).sge(src.clone()))
                .expect("post_send");
            wait_safe(&mut p.cq_a, out_a);
            out_a.clear();
        });
    }

    #[divan::bench(sample_count = 100, sample_size = 32)]
    fn raw(bencher: Bencher) {
        let mut g = state();
        let mut write = raw_write(&g);
        let p = &mut g.p;
        let mut wc = [ffi::ibv_wc::default()];
        let mut i = 0;
        bencher.bench_local(|| {
            i += 1;
            write.0.wr_id = i;
            post_raw(&mut p.a, &mut write.0);
            wait_raw(&mut p.cq_a, &mut wc);
        });
    }
}

/// Per WR posted; every 16th is signaled and waited for.
mod write_1_in_16_signaled {
    use super::*;

    #[divan::bench(sample_count = 100, sample_size = 64)]
    fn safe(bencher: Bencher) {
        let mut g = state();
        let State {
            p,
            src,
            remote,
            out_a,
            ..
        } = &mut *g;
        let mut i: u64 = 0;
        bencher.bench_local(|| {
            let sig = i % 16 == 15;
            // Built in the call (an `if` choosing between requests copies one).
            p.a.post_send(
                SendWr::write_from(i, src.clone(), *remote, (i % 64) * MSG as u64).signaled(sig),
            )
            .expect("post_send");
            if sig {
                wait_safe(&mut p.cq_a, out_a);
                out_a.clear();
            }
            i += 1;
        });
        // A signaled one retires any unsignaled ones left.
        if i % 16 != 0 {
            p.a.post_send(SendWr::write_from(i, src.clone(), *remote, 0))
                .expect("post_send");
            wait_safe(&mut p.cq_a, out_a);
            out_a.clear();
        }
    }

    #[divan::bench(sample_count = 100, sample_size = 64)]
    fn raw(bencher: Bencher) {
        let mut g = state();
        let mut write = raw_write(&g);
        let remote = g.remote;
        let p = &mut g.p;
        let mut wc = [ffi::ibv_wc::default()];
        let mut i: u64 = 0;
        bencher.bench_local(|| {
            let sig = i % 16 == 15;
            write.0.send_flags = if sig {
                ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            write.0.wr.rdma.remote_addr = remote.addr + (i % 64) * MSG as u64;
            post_raw(&mut p.a, &mut write.0);
            if sig {
                wait_raw(&mut p.cq_a, &mut wc);
            }
            i += 1;
        });
        if i % 16 != 0 {
            write.0.send_flags = ffi::ibv_send_flags::IBV_SEND_SIGNALED.0;
            post_raw(&mut p.a, &mut write.0);
            wait_raw(&mut p.cq_a, &mut wc);
        }
    }
}

mod poll_empty_cq {
    use super::*;

    #[divan::bench(sample_count = 100, sample_size = 1000)]
    fn safe(bencher: Bencher) {
        let mut g = state();
        let State { p, out_b, .. } = &mut *g;
        bencher.bench_local(|| black_box(p.cq_b.poll(out_b).expect("poll")));
        assert!(out_b.is_empty(), "the CQ was not empty");
    }

    #[divan::bench(sample_count = 100, sample_size = 1000)]
    fn raw(bencher: Bencher) {
        let mut g = state();
        let cq = &mut g.p.cq_b;
        let mut wcs = [ffi::ibv_wc::default(); BATCH];
        bencher.bench_local(|| black_box(cq.poll_raw(&mut wcs).expect("poll_raw")));
    }
}

/// Full-batch polls that found fewer than [`BATCH`] completions.
static SHORT_POLLS: AtomicUsize = AtomicUsize::new(0);

/// Bookkeeping of `poll_full_batch_32`: each input posts [`BATCH`] signaled
/// WRITEs and sleeps until they should have completed (untimed); each timed
/// iteration polls once. Leftovers of a short poll are drained before the next
/// sample's inputs.
struct Batches {
    posted: usize,
    polled: usize,
    polled_since_post: bool,
    wait: Duration,
}

impl Batches {
    fn new() -> Self {
        Self {
            posted: 0,
            polled: 0,
            polled_since_post: false,
            wait: Duration::from_millis(2),
        }
    }

    /// Called before posting a batch: true if completions are left over from
    /// the previous sample (the first input of a sample follows its polls).
    fn must_drain(&mut self) -> bool {
        let drain = self.polled_since_post && self.polled < self.posted;
        self.polled_since_post = false;
        drain
    }

    /// Records a timed poll that returned `got`.
    fn record(&mut self, got: usize) {
        self.polled += got;
        self.polled_since_post = true;
        if got < BATCH {
            SHORT_POLLS.fetch_add(1, Ordering::Relaxed);
            self.wait = (self.wait * 2).min(Duration::from_millis(200));
        }
    }
}

mod poll_full_batch_32 {
    use super::*;

    /// The safe case's CQ, output and bookkeeping, shared by its two closures.
    struct Safe<'a> {
        cq: &'a mut Cq,
        out: Vec<Completion>,
        b: Batches,
    }

    impl Safe<'_> {
        fn drain(&mut self) {
            while self.b.polled < self.b.posted {
                self.out.clear();
                self.b.polled += self.cq.poll(&mut self.out).expect("poll");
            }
            self.out.clear();
        }
    }

    #[divan::bench(sample_count = 50, sample_size = BATCHES_PER_SAMPLE)]
    fn safe(bencher: Bencher) {
        let mut g = state();
        let State { p, src, remote, .. } = &mut *g;
        let (qp, remote) = (&mut p.a, *remote);
        let st = RefCell::new(Safe {
            cq: &mut p.cq_a,
            out: Vec::with_capacity(BATCH),
            b: Batches::new(),
        });
        bencher
            .counter(ItemsCount::new(BATCH))
            .with_inputs(|| {
                let mut s = st.borrow_mut();
                if s.b.must_drain() {
                    s.drain();
                }
                for i in 0..BATCH as u64 {
                    qp.post_send(SendWr::write(i, remote, i * MSG as u64).sge(src.clone()))
                        .expect("post_send");
                }
                s.b.posted += BATCH;
                std::thread::sleep(s.b.wait);
            })
            .bench_local_refs(|_| {
                let mut s = st.borrow_mut();
                let s = &mut *s;
                let got = s.cq.poll(&mut s.out).expect("poll");
                s.out.clear();
                s.b.record(got);
            });
        st.borrow_mut().drain();
    }

    #[divan::bench(sample_count = 50, sample_size = BATCHES_PER_SAMPLE)]
    fn raw(bencher: Bencher) {
        let mut g = state();
        let mut write = raw_write(&g);
        let remote = g.remote;
        let p = &mut g.p;
        let qp = &mut p.a;
        let st = RefCell::new((&mut p.cq_a, Batches::new()));
        let drain = |cq: &mut Cq, b: &mut Batches| {
            let mut wcs = [ffi::ibv_wc::default(); BATCH];
            while b.polled < b.posted {
                let n = (b.posted - b.polled).min(BATCH);
                b.polled += cq.poll_raw(&mut wcs[..n]).expect("poll_raw");
            }
        };
        let mut wcs = [ffi::ibv_wc::default(); BATCH];
        bencher
            .counter(ItemsCount::new(BATCH))
            .with_inputs(|| {
                let mut s = st.borrow_mut();
                let (cq, b) = &mut *s;
                if b.must_drain() {
                    drain(cq, b);
                }
                for i in 0..BATCH as u64 {
                    write.0.wr.rdma.remote_addr = remote.addr + i * MSG as u64;
                    post_raw(qp, &mut write.0);
                }
                b.posted += BATCH;
                std::thread::sleep(b.wait);
            })
            .bench_local_refs(|_| {
                let mut s = st.borrow_mut();
                let (cq, b) = &mut *s;
                let got = cq.poll_raw(&mut wcs).expect("poll_raw");
                b.record(got);
            });
        let (cq, b) = &mut *st.borrow_mut();
        drain(cq, b);
    }
}
