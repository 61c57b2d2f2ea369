//! RC QP costs, divan benches: creation (`ibv_create_qp`) and destruction
//! (`ibv_destroy_qp`), and each transition timed on its own: RESET -> INIT,
//! INIT -> RTR, RTR -> RTS, and back: RTS -> RESET, RTS -> ERR, ERR -> RESET.
//! Each iteration gets a fresh QP brought to the starting state untimed; the
//! RTR step connects to a second QP of the same device.
//!
//! Run inside the soft-RoCE guest: `cargo bench --no-run --all-features` prints
//! the executable, then
//! `cargo xtask run -- target/release/deps/qp_state-<hash> --bench`.
//! Divan options follow `--bench`. The TSC timer is the default where the CPU
//! has an invariant TSC (not in the guest: there divan warns and uses the OS
//! clock); see `harness::divan_main`.

#[path = "harness/mod.rs"]
mod harness;

use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};

use divan::Bencher;
use harness::{all_remote, ctx, gid_index};
use rdma_verbs::context::Context;
use rdma_verbs::cq::Cq;
use rdma_verbs::device::Mtu;
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{Endpoint, Init, InitAttr, Qp, QpCaps, Rc, Reset, Rtr, RtrAttr, Rts, RtsAttr};

fn main() {
    harness::divan_main("qp_state");
}

/// What every case uses: a CQ for all QPs and a peer QP (in INIT) to connect to.
struct Setup {
    _ctx: Context,
    pd: Pd,
    cq: Cq,
    gid: u8,
    mtu: Mtu,
    _peer: Qp<Rc, Init>,
    remote: Endpoint,
}

static SETUP: LazyLock<Mutex<Setup>> = LazyLock::new(|| {
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 256).expect("cq");
    let gid = gid_index(&ctx);
    let mtu = ctx.query_port(1).expect("port").active_mtu;
    let peer = Qp::new(&pd, &cq, &cq, QpCaps::default())
        .expect("peer")
        .init(InitAttr::new(1, all_remote()))
        .expect("peer init");
    let remote = peer.endpoint(Some(gid)).expect("peer endpoint");
    Mutex::new(Setup {
        _ctx: ctx,
        pd,
        cq,
        gid,
        mtu,
        _peer: peer,
        remote,
    })
});

fn setup() -> MutexGuard<'static, Setup> {
    SETUP.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Setup {
    fn reset(&self) -> Qp<Rc, Reset> {
        Qp::new(&self.pd, &self.cq, &self.cq, QpCaps::default()).expect("create")
    }

    fn init(&self) -> Qp<Rc, Init> {
        to_init(self.reset())
    }

    fn rtr(&self) -> Qp<Rc, Rtr> {
        self.to_rtr(self.init())
    }

    fn rts(&self) -> Qp<Rc, Rts> {
        to_rts(self.rtr())
    }

    fn to_rtr(&self, qp: Qp<Rc, Init>) -> Qp<Rc, Rtr> {
        qp.rtr(RtrAttr::new(&self.remote, 1, self.mtu, Some(self.gid)))
            .expect("rtr")
    }
}

fn to_init(qp: Qp<Rc, Reset>) -> Qp<Rc, Init> {
    qp.init(InitAttr::new(1, all_remote())).expect("init")
}

fn to_rts(qp: Qp<Rc, Rtr>) -> Qp<Rc, Rts> {
    let psn = qp.psn();
    qp.rts(RtsAttr::new(psn)).expect("rts")
}

// Each sample times 4 iterations back to back; the QPs they return are
// destroyed untimed.
const COUNT: u32 = 100;
const SIZE: u32 = 4;

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn create(bencher: Bencher) {
    let s = setup();
    bencher.bench_local(|| s.reset());
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn destroy(bencher: Bencher) {
    let s = setup();
    bencher.with_inputs(|| s.reset()).bench_local_values(drop);
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn reset_to_init(bencher: Bencher) {
    let s = setup();
    bencher
        .with_inputs(|| s.reset())
        .bench_local_values(to_init);
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn init_to_rtr(bencher: Bencher) {
    let s = setup();
    bencher
        .with_inputs(|| s.init())
        .bench_local_values(|qp| s.to_rtr(qp));
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn rtr_to_rts(bencher: Bencher) {
    let s = setup();
    bencher.with_inputs(|| s.rtr()).bench_local_values(to_rts);
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn rts_to_reset(bencher: Bencher) {
    let s = setup();
    bencher
        .with_inputs(|| s.rts())
        .bench_local_values(|qp| qp.reset().expect("reset"));
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn rts_to_err(bencher: Bencher) {
    let s = setup();
    bencher
        .with_inputs(|| s.rts())
        .bench_local_values(|qp| qp.to_error().expect("to_error"));
}

#[divan::bench(sample_count = COUNT, sample_size = SIZE)]
fn err_to_reset(bencher: Bencher) {
    let s = setup();
    bencher
        .with_inputs(|| s.rts().to_error().expect("to_error"))
        .bench_local_values(|qp| qp.reset().expect("reset from ERR"));
}
