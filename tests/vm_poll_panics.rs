//! A buffer whose `Drop` panics (an application's `OwnedMemory`) while a poll
//! retires its request, on soft-RoCE: what the CQ still reports and holds
//! after the panic has gone on to the caller.
mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use common::{caps_sr, pair_with};
use rdma_verbs::cq::WcStatus;
use rdma_verbs::mr::{AccessFlags, Mr, OwnedMemory};
use rdma_verbs::qp::scope::{ScopedSend, Src};
use rdma_verbs::qp::{RecvWr, SendWr};
use rdma_verbs::{Error, ffi};

/// Host memory whose `Drop` panics.
struct PanicsInDrop(Vec<u8>);

impl Drop for PanicsInDrop {
    fn drop(&mut self) {
        panic!("an application's memory panics in Drop");
    }
}

// SAFETY: the Vec's heap block does not move and is reached only through it.
unsafe impl OwnedMemory for PanicsInDrop {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.0.as_mut_ptr(), self.0.len())
    }
}

const T: Duration = Duration::from_secs(5);

/// A poll that finds requests lost to `poll_raw` and retires a buffer that
/// panics reports the loss at its next poll, after the panic.
#[test]
fn a_loss_found_by_a_poll_that_panics_is_reported_by_the_next() {
    let mut p = pair_with(caps_sr(8, 8), |pd, _, b| {
        for i in 0..2 {
            let buf = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
            b.post_recv(RecvWr::new(i, buf)).unwrap();
        }
    });
    let panicky = Mr::register(&p.pd, PanicsInDrop(vec![7; 64]), AccessFlags::empty()).unwrap();
    p.a.post_send(SendWr::send_from(1, panicky)).unwrap();
    // poll_raw takes the first completion: its request, and the buffer,
    // stay in the ring until a later completion sweeps them as lost.
    let mut raw = [ffi::ibv_wc::default(); 4];
    let start = Instant::now();
    while p.cq_a.poll_raw(&mut raw).unwrap() == 0 {
        assert!(start.elapsed() < T, "the first SEND never completed");
    }
    assert_eq!(raw[0].status, ffi::IBV_WC_SUCCESS);
    p.a.post_send(SendWr::send(2)).unwrap();
    let mut out = Vec::with_capacity(8);
    let start = Instant::now();
    let panicked = loop {
        match catch_unwind(AssertUnwindSafe(|| p.cq_a.poll(&mut out))) {
            Err(_) => break true,
            Ok(Ok(0)) if start.elapsed() < T => continue,
            Ok(other) => panic!("expected the buffer's panic, got {other:?}"),
        }
    };
    assert!(panicked);
    assert_eq!(out.len(), 1, "the second SEND's completion was read");
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    let mut more = Vec::with_capacity(8);
    match p.cq_a.poll(&mut more) {
        Err(Error::CompletionsLost { count: 1 }) => {}
        other => panic!("expected the loss of one completion, got {other:?}"),
    }
    assert!(matches!(p.cq_a.poll(&mut more), Ok(0)));
}

/// Completions a scope kept for the next poll, one with a buffer that panics,
/// are dropped with the CQ without the panic leaving `Drop`.
#[test]
fn dropping_a_cq_contains_the_panic_of_a_kept_completions_buffer() {
    let mut p = common::pair(caps_sr(8, 1));
    let target = p.pd.alloc_mr(256, common::all_remote()).unwrap();
    let remote = target.remote();
    let panicky = Mr::register(&p.pd, PanicsInDrop(vec![7; 64]), AccessFlags::empty()).unwrap();
    p.a.post_send(SendWr::write_from(11, panicky, remote, 64))
        .unwrap();
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    // The scope's poll reads the earlier WRITE's completion too and keeps it,
    // with its buffer, for the CQ's next poll.
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(1, s_src, remote, 128))?;
            common::scope_poll_n(s, 1)
        })
        .expect("the scoped WRITE");
    assert_eq!(got.len(), 1);
    let common::Pair { cq_a, a, .. } = p;
    let dropped = catch_unwind(AssertUnwindSafe(move || drop(cq_a)));
    assert!(dropped.is_ok(), "the panic left Cq's drop");
    drop(a);
}
