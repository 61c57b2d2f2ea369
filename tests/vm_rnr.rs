//! A SEND whose receiver posts its receive late (RNR NAK retry) on real soft-RoCE: how long
//! the sender waits, and which attribute bounds the wait on each kernel.
//!
//! rxe on Debian 12's 6.1 kernel counts the ACK timeouts that pass while the responder answers
//! with RNR NAKs against `retry_cnt`, so the wait ends in `RETRY_EXC_ERR` after about
//! `(retry_cnt + 1) × the ACK timeout` even with `rnr_retry` 7 (infinite); 6.12's rxe waits
//! for the receive as the spec says. Measured in the guest with `timeout` 12/14/17,
//! `retry_cnt` 1/6 and the receive 100 ms–2 s late (docs/providers.md).

mod common;

use std::time::Duration;

use common::{all_remote, ctx, gid_index, pattern};
use rdma_verbs::Error;
use rdma_verbs::cq::{Completion, Cq, WcStatus};
use rdma_verbs::mr::AccessFlags;
use rdma_verbs::pd::Pd;
use rdma_verbs::qp::{InitAttr, Qp, QpCaps, RecvWr, RtrAttr, RtsAttr, SendWr};

const LEN: usize = 64;

fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
        sq_sig_all: false,
    }
}

/// What a SEND whose receive was posted `late` after it came to: the sender's completion and,
/// when the SEND succeeded, the bytes the receiver got.
struct LateReceive {
    send: Completion,
    received: Option<Vec<u8>>,
}

/// Posts a SEND from `a` to `b` (RTS attributes `rts`, `rnr_retry` 7), posts `b`'s receive
/// `late` later, and waits for both sides.
fn late_receive(late: Duration, rts: impl FnOnce(RtsAttr) -> RtsAttr) -> LateReceive {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut cq_a = Cq::new(&ctx, 16).unwrap();
    let mut cq_b = Cq::new(&ctx, 16).unwrap();
    let gid = gid_index(&ctx);
    let mtu = ctx.query_port(1).unwrap().active_mtu;
    let init = |cq: &Cq| {
        Qp::new(&pd, cq, cq, caps())
            .unwrap()
            .init(InitAttr::new(1, all_remote()))
            .unwrap()
    };
    let (a, b) = (init(&cq_a), init(&cq_b));
    let (ea, eb) = (
        a.endpoint(Some(gid)).unwrap(),
        b.endpoint(Some(gid)).unwrap(),
    );
    let mut a = a
        .rtr(RtrAttr::new(&eb, 1, mtu, Some(gid)))
        .unwrap()
        .rts(rts(RtsAttr::new(ea.psn)).rnr_retry(7))
        .unwrap();
    let mut b = b
        .rtr(RtrAttr::new(&ea, 1, mtu, Some(gid)))
        .unwrap()
        .rts(RtsAttr::new(eb.psn))
        .unwrap();
    let mut src = pd.alloc_mr(LEN, AccessFlags::empty()).unwrap();
    src.write_at(0, &pattern(LEN, 7)).unwrap();
    let dst = pd.alloc_mr(LEN, AccessFlags::LOCAL_WRITE).unwrap();
    a.post_send(SendWr::send(1).sge(src)).unwrap();
    std::thread::sleep(late);
    b.post_recv(RecvWr::new(2, dst)).unwrap();
    let mut sent = Vec::new();
    cq_a.poll_n(&mut sent, 1, Duration::from_secs(20)).unwrap();
    let send = sent.pop().unwrap();
    let received = (send.status == WcStatus::Success).then(|| {
        let mut got = Vec::new();
        cq_b.poll_n(&mut got, 1, Duration::from_secs(5)).unwrap();
        assert_eq!(got[0].status, WcStatus::Success, "{:?}", got[0]);
        got[0]
            .take_mr()
            .expect("the receive's buffer")
            .to_vec()
            .unwrap()
    });
    LateReceive { send, received }
}

/// Whether this guest's rxe ends an RNR wait after `retry_cnt + 1` ACK timeouts (6.1 does,
/// 6.12 does not).
fn rnr_wait_bounded_by_ack_timeouts() -> bool {
    common::kernel_version() < (6, 12)
}

#[test]
fn a_receive_posted_within_the_ack_budget_gets_the_message() {
    // 200 ms is inside (6 + 1) × 67 ms, the crate's default timeout 14 and retry_cnt 6.
    let r = late_receive(Duration::from_millis(200), |rts| rts);
    assert_eq!(r.send.status, WcStatus::Success, "{:?}", r.send);
    assert_eq!(r.received.unwrap(), pattern(LEN, 7));
}

#[test]
fn a_longer_ack_timeout_lets_the_sender_wait_for_a_receive_a_second_late() {
    // timeout 17 (~537 ms) × 7 ≈ 3.8 s covers the 1 s on every kernel.
    let r = late_receive(Duration::from_secs(1), |rts| rts.timeout(17));
    assert_eq!(r.send.status, WcStatus::Success, "{:?}", r.send);
    assert_eq!(r.received.unwrap(), pattern(LEN, 7));
}

#[test]
fn a_receive_a_second_late_is_retry_exc_err_where_rxe_counts_ack_timeouts() {
    let mut r = late_receive(Duration::from_secs(1), |rts| rts);
    if !rnr_wait_bounded_by_ack_timeouts() {
        assert_eq!(r.send.status, WcStatus::Success, "{:?}", r.send);
        assert_eq!(r.received.unwrap(), pattern(LEN, 7));
        return;
    }
    assert_eq!(r.send.status, WcStatus::RetryExcErr, "{:?}", r.send);
    assert!(
        r.send.take_mr().is_some(),
        "the failed SEND's buffer comes back"
    );
    let err = r.send.result().unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkCompletion {
                status: WcStatus::RetryExcErr,
                ..
            }
        ),
        "{err:?}"
    );
    // The hint names the attribute that helps, and does not send users to rnr_retry alone.
    let msg = err.to_string();
    assert!(
        msg.contains("RtsAttr::timeout") && msg.contains("late"),
        "{msg}"
    );
}
