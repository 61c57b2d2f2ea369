//! `MrPool` on real soft-RoCE: buffers under threads come back exactly once,
//! get/put allocate nothing, foreign buffers are refused, and pool buffers
//! serve as the receive buffers of an SRQ.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use common::{all_remote, ctx, gid_index, pattern, res_counts, wait};
use rdma_verbs::mr::MrPool;
use rdma_verbs::prelude::*;

/// Counts every allocation of the process.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; the counter is atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Allocation counts and MR counts are process-wide: one test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn buffers_under_threads_come_back_exactly_once() {
    let _g = serial();
    let pd = Pd::new(&ctx()).unwrap();
    let pool = MrPool::new(&pd, 256, 64, AccessFlags::LOCAL_WRITE).unwrap();
    assert_eq!(
        (pool.capacity(), pool.available(), pool.buf_len()),
        (64, 64, 256)
    );
    let first = pool.get().unwrap();
    let base = first.addr();
    pool.put(first).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let pool = &pool;
            s.spawn(move || {
                let mut held = Vec::with_capacity(8);
                for i in 0..5000u32 {
                    // Hold up to 8 at once, so the threads contend for the last ones.
                    while held.len() < 8 {
                        match pool.get() {
                            Some(mut mr) => {
                                assert_eq!(mr.len(), 256);
                                mr.write_at(0, &[t; 256]).unwrap();
                                held.push(mr);
                            }
                            None => break,
                        }
                    }
                    if let Some(mr) = held.pop() {
                        assert_eq!(mr.as_slice().unwrap(), &[t; 256], "iteration {i}");
                        pool.put(mr).unwrap();
                    }
                }
                for mr in held {
                    pool.put(mr).unwrap();
                }
            });
        }
    });
    assert_eq!(pool.available(), 64);
    let all: Vec<Mr> = std::iter::from_fn(|| pool.get()).collect();
    let addrs: HashSet<u64> = all.iter().map(Mr::addr).collect();
    let expect: HashSet<u64> = (0..64).map(|k| base + k * 256).collect();
    assert_eq!(addrs, expect, "every buffer back exactly once");
    assert!(pool.get().is_none());
    for mr in all {
        pool.put(mr).unwrap();
    }
}

#[test]
fn get_and_put_allocate_nothing() {
    let _g = serial();
    let pd = Pd::new(&ctx()).unwrap();
    let pool = MrPool::new(&pd, 64, 16, AccessFlags::LOCAL_WRITE).unwrap();
    let mut held = Vec::with_capacity(16);
    let before = ALLOCS.load(Ordering::Relaxed);
    for _ in 0..10_000 {
        while let Some(mr) = pool.get() {
            held.push(mr);
        }
        for mr in held.drain(..) {
            pool.put(mr).unwrap();
        }
    }
    assert_eq!(ALLOCS.load(Ordering::Relaxed) - before, 0, "allocations");
}

#[test]
fn foreign_and_cut_buffers_are_refused() {
    let _g = serial();
    let ctx = ctx();
    let dev = ctx.name().to_owned();
    let pd = Pd::new(&ctx).unwrap();
    let mrs = res_counts(&dev)["mr"];
    let a = MrPool::new(&pd, 100, 4, AccessFlags::empty()).unwrap();
    let b = MrPool::new(&pd, 100, 4, AccessFlags::empty()).unwrap();
    assert_eq!(res_counts(&dev)["mr"], mrs + 2, "one registration per pool");
    let refused = |r: Result<(), rdma_verbs::mr::MrRefused>| {
        let e = r.expect_err("should be refused");
        assert!(
            matches!(
                e.error,
                Error::InvalidArgument {
                    what: "pool buffer",
                    ..
                }
            ),
            "{e}"
        );
        e.mr
    };
    let x = refused(b.put(a.get().unwrap()));
    assert_eq!(b.available(), 4);
    let mut x = x;
    let tail = x.split_off(50).unwrap();
    let mut x = refused(a.put(x));
    let tail = refused(a.put(tail));
    x.unsplit(tail).unwrap();
    a.put(x).unwrap();
    refused(a.put(pd.alloc_mr(100, AccessFlags::empty()).unwrap()));
    assert_eq!(a.available(), 4);
    assert!(matches!(
        MrPool::new(&pd, 0, 4, AccessFlags::empty()),
        Err(Error::InvalidArgument { .. })
    ));
    let mr = pd.alloc_mr(10, AccessFlags::empty()).unwrap();
    assert!(matches!(
        MrPool::from_mr(mr, 11),
        Err(Error::InvalidArgument {
            what: "pool buffer length",
            ..
        })
    ));
    drop((a, b));
    assert_eq!(res_counts(&dev)["mr"], mrs);
}

#[test]
fn pool_buffers_are_the_receive_buffers_of_an_srq() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut cq = Cq::new(&ctx, 64).unwrap();
    let mut peer_cq = Cq::new(&ctx, 64).unwrap();
    let mut srq = Srq::new(&pd, &cq, SrqAttr::new(16, 1)).unwrap();
    let caps = common::caps_sr(16, 1);
    let qp = Qp::new_with_srq(&pd, &cq, &cq, &srq, caps)
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    let peer = Qp::new(&pd, &peer_cq, &peer_cq, caps)
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    let gid = Some(gid_index(&ctx));
    let (e, pe) = (qp.endpoint(gid).unwrap(), peer.endpoint(gid).unwrap());
    let _qp = qp.connect(&pe, gid).unwrap();
    let mut peer = peer.connect(&e, gid).unwrap();

    let pool = MrPool::new(&pd, 1024, 8, AccessFlags::LOCAL_WRITE).unwrap();
    for id in 0..8 {
        srq.post_recv(RecvWr::new(id, pool.get().unwrap())).unwrap();
    }
    assert_eq!(pool.available(), 0);
    for k in 0..8u8 {
        let mut src = pd.alloc_mr(1000, AccessFlags::empty()).unwrap();
        src.as_mut_slice()
            .unwrap()
            .copy_from_slice(&pattern(1000, k));
        peer.post_send(SendWr::send(u64::from(k)).sge(src)).unwrap();
    }
    for c in wait(&mut peer_cq, 8) {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
    }
    let mut got = HashSet::new();
    for mut c in wait(&mut cq, 8) {
        assert_eq!((c.status, c.byte_len), (WcStatus::Success, 1000), "{c:?}");
        let mr = c.take_mr().unwrap();
        let bytes = mr.to_vec().unwrap();
        let k = (0..8u8)
            .find(|&k| bytes[..1000] == pattern(1000, k)[..])
            .expect("one of the messages");
        assert!(got.insert(k), "message {k} twice");
        pool.put(mr).unwrap();
    }
    assert_eq!((got.len(), pool.available()), (8, 8));
}
