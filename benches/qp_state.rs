//! QP state transitions: creation and destruction, RESET → INIT → RTR → RTS,
//! back to RESET directly or through ERR, each timed on its own (median over the
//! repetitions). The RTR step connects to a second QP of the same device.
//! Run inside the soft-RoCE guest:
//! `cargo bench --no-run`, then `cargo xtask run -- target/release/deps/qp_state-<hash> --bench`.

#[path = "harness/mod.rs"]
mod harness;

use harness::{all_remote, ctx, gid_index, ns, require_bench_flag, ticks};
use rdma_verbs::{Cq, InitAttr, Pd, Qp, QpCaps, RtrAttr, RtsAttr};

const REPS: usize = 40;

fn report(name: &str, mut v: Vec<f64>) {
    v.sort_by(f64::total_cmp);
    println!(
        "{name:<36} {:>10.1} us  (min {:>8.1}, max {:>8.1})",
        v[v.len() / 2] / 1e3,
        v[0] / 1e3,
        v[v.len() - 1] / 1e3
    );
}

fn main() {
    require_bench_flag("qp_state");
    let ctx = ctx();
    let pd = Pd::new(&ctx).expect("pd");
    let cq = Cq::new(&ctx, 256).expect("cq");
    let gid = gid_index(&ctx);
    let caps = QpCaps::default();
    let mtu = ctx.query_port(1).expect("port").active_mtu;
    let peer = Qp::new(&pd, &cq, &cq, caps)
        .expect("peer")
        .init(InitAttr::new(1, all_remote()))
        .expect("peer init");
    let remote = peer
        .endpoint(1, Some(u32::from(gid)))
        .expect("peer endpoint");
    println!("rdma-verbs qp_state bench ({REPS} repetitions, median)");

    let (mut create, mut destroy) = (Vec::new(), Vec::new());
    for _ in 0..REPS {
        let t0 = ticks();
        let qp = Qp::new(&pd, &cq, &cq, caps).expect("create");
        let t1 = ticks();
        drop(std::hint::black_box(qp));
        let t2 = ticks();
        create.push(ns(t1 - t0));
        destroy.push(ns(t2 - t1));
    }
    report("create (ibv_create_qp)", create);
    report("destroy (ibv_destroy_qp)", destroy);

    let (mut init, mut rtr, mut rts, mut reset) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut to_err, mut err_reset) = (Vec::new(), Vec::new());
    let mut qp = Qp::new(&pd, &cq, &cq, caps).expect("create");
    for rep in 0..2 * REPS {
        let t0 = ticks();
        let q1 = qp.init(InitAttr::new(1, all_remote())).expect("init");
        let t1 = ticks();
        let q2 = q1
            .rtr(RtrAttr::new(&remote, 1, mtu, Some(gid)))
            .expect("rtr");
        let t2 = ticks();
        let psn = q2.psn();
        let q3 = q2.rts(RtsAttr::new(psn)).expect("rts");
        let t3 = ticks();
        init.push(ns(t1 - t0));
        rtr.push(ns(t2 - t1));
        rts.push(ns(t3 - t2));
        // Every other round leaves RTS through ERR (RTS -> ERR -> RESET).
        qp = if rep % 2 == 0 {
            let q4 = q3.reset().expect("reset");
            reset.push(ns(ticks() - t3));
            q4
        } else {
            let e = q3.to_error().expect("to_error");
            let t4 = ticks();
            let q4 = e.reset().expect("reset from ERR");
            to_err.push(ns(t4 - t3));
            err_reset.push(ns(ticks() - t4));
            q4
        };
    }
    report("RESET -> INIT", init);
    report("INIT -> RTR", rtr);
    report("RTR -> RTS", rts);
    report("RTS -> RESET", reset);
    report("RTS -> ERR", to_err);
    report("ERR -> RESET", err_reset);
    drop(qp);
    drop(peer);
}
