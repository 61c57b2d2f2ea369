//! `MrPool` on real soft-RoCE: buffers under threads come back exactly once,
//! get/put allocate nothing, foreign buffers are refused, and pool buffers
//! serve as the receive buffers of an SRQ.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Mutex;

use common::{all_remote, ctx, gid_index, pattern, res_counts, wait};
use rdma_verbs::mr::MrPool;
use rdma_verbs::prelude::*;

/// Counts every allocation, per thread: the test harness's own threads
/// (its output capture, other tests' set-up) allocate while a test runs.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// Allocations made so far by the calling thread.
fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards to the system allocator unchanged; the counter is a
// const-initialised thread-local (touching it allocates nothing), skipped
// while the thread's locals are being torn down.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
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

/// MR counts are process-wide: one test at a time.
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
    let before = allocs();
    for _ in 0..10_000 {
        while let Some(mr) = pool.get() {
            held.push(mr);
        }
        for mr in held.drain(..) {
            pool.put(mr).unwrap();
        }
    }
    assert_eq!(allocs() - before, 0, "allocations");
}

/// A pool of more buffers than `MAX_POOL_BUFFERS` is refused with a typed
/// error (its free list is allocated up front, and a list too large to
/// allocate would abort the process), before registering when `new` is
/// asked for it.
#[test]
fn a_pool_of_too_many_buffers_is_refused() {
    use rdma_verbs::mr::MAX_POOL_BUFFERS;
    let _g = serial();
    let pd = Pd::new(&ctx()).unwrap();
    let too_many = |r: Result<MrPool>| match r {
        Err(Error::InvalidArgument { what, reason }) => {
            assert!(what.starts_with("pool"), "{what}");
            assert!(reason.contains("MAX_POOL_BUFFERS"), "{reason}");
        }
        other => panic!(
            "expected a typed refusal, got {:?}",
            other.map(|p| p.capacity())
        ),
    };
    too_many(MrPool::new(
        &pd,
        1,
        MAX_POOL_BUFFERS + 1,
        AccessFlags::empty(),
    ));
    let mr = Mr::new(&pd, MAX_POOL_BUFFERS + 1, AccessFlags::empty()).unwrap();
    too_many(MrPool::from_mr(mr, 1));
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

/// A QP taking its receives from an SRQ, connected to a peer QP; the SRQ's
/// completions arrive on `cq`, the peer's on `peer_cq`.
struct SrqPair {
    cq: Cq,
    peer_cq: Cq,
    srq: Srq,
    _qp: Qp<Rc, Rts>,
    peer: Qp<Rc, Rts>,
}

fn srq_pair(ctx: &Context, pd: &Pd) -> SrqPair {
    let cq = Cq::new(ctx, 64).unwrap();
    let peer_cq = Cq::new(ctx, 64).unwrap();
    let srq = Srq::new(pd, &cq, SrqAttr::new(16, 1)).unwrap();
    let caps = common::caps_sr(16, 1);
    let qp = Qp::new_with_srq(pd, &cq, &cq, &srq, caps)
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    let peer = Qp::new(pd, &peer_cq, &peer_cq, caps)
        .unwrap()
        .init(InitAttr::new(1, all_remote()))
        .unwrap();
    let gid = Some(gid_index(ctx));
    let (e, pe) = (qp.endpoint(gid).unwrap(), peer.endpoint(gid).unwrap());
    let qp = qp.connect(&pe, gid).unwrap();
    let peer = peer.connect(&e, gid).unwrap();
    SrqPair {
        cq,
        peer_cq,
        srq,
        _qp: qp,
        peer,
    }
}

/// Sends `count` messages of `len` bytes, message `k` being `pattern(len, k)`.
fn send_patterns(pd: &Pd, p: &mut SrqPair, count: u8, len: usize) {
    for k in 0..count {
        let mut src = pd.alloc_mr(len, AccessFlags::empty()).unwrap();
        src.as_mut_slice()
            .unwrap()
            .copy_from_slice(&pattern(len, k));
        p.peer
            .post_send(SendWr::send(u64::from(k)).sge(src))
            .unwrap();
    }
    for c in wait(&mut p.peer_cq, count.into()) {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
    }
}

#[test]
fn pool_buffers_are_the_receive_buffers_of_an_srq() {
    let _g = serial();
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let mut p = srq_pair(&ctx, &pd);
    let pool = MrPool::new(&pd, 1024, 8, AccessFlags::LOCAL_WRITE).unwrap();
    for id in 0..8 {
        p.srq
            .post_recv(RecvWr::new(id, pool.get().unwrap()))
            .unwrap();
    }
    assert_eq!(pool.available(), 0);
    send_patterns(&pd, &mut p, 8, 1000);
    let mut got = HashSet::new();
    for mut c in wait(&mut p.cq, 8) {
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

/// `MrPool::to_bytes`: received buffers as `bytes::Bytes`, without a copy.
#[cfg(feature = "bytes")]
mod bytes_interop {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;

    #[test]
    fn received_buffers_read_as_bytes_in_place_and_return_on_the_last_drop() {
        let _g = serial();
        let ctx = ctx();
        let dev = ctx.name().to_owned();
        let pd = Pd::new(&ctx).unwrap();
        let mrs = res_counts(&dev)["mr"];
        let mut p = srq_pair(&ctx, &pd);
        let pool = Arc::new(MrPool::new(&pd, 1024, 8, AccessFlags::LOCAL_WRITE).unwrap());
        let first = pool.get().unwrap();
        let base = first.addr();
        pool.put(first).unwrap();
        for id in 0..8 {
            p.srq
                .post_recv(RecvWr::new(id, pool.get().unwrap()))
                .unwrap();
        }
        send_patterns(&pd, &mut p, 8, 1000);

        let mut msgs: Vec<Option<Bytes>> = vec![None; 8];
        for mut c in wait(&mut p.cq, 8) {
            assert_eq!((c.status, c.byte_len), (WcStatus::Success, 1000), "{c:?}");
            let mr = c.take_mr().unwrap();
            let addr = mr.addr();
            let b = pool.to_bytes(mr, c.byte_len as usize).unwrap();
            // In place: the Bytes points into the registered buffer.
            assert_eq!(b.as_ptr() as u64, addr, "no copy");
            let k = (0..8u8)
                .find(|&k| b[..] == pattern(1000, k)[..])
                .expect("one of the messages");
            assert!(
                msgs[usize::from(k)].replace(b).is_none(),
                "message {k} twice"
            );
        }
        let msgs: Vec<Bytes> = msgs.into_iter().map(Option::unwrap).collect();
        assert_eq!(pool.available(), 0);

        let tails: Vec<Bytes> = msgs.iter().map(|b| b.slice(600..)).collect();
        let clones = msgs.clone();
        drop(msgs);
        // Dropped on another thread: the owner is Send.
        std::thread::spawn(move || drop(clones)).join().unwrap();
        assert_eq!(pool.available(), 0, "the slices still hold every buffer");
        for (k, t) in (0..8u8).zip(&tails) {
            assert_eq!(t[..], pattern(1000, k)[600..], "slice of message {k}");
        }
        drop(tails);
        assert_eq!(pool.available(), 8, "every buffer back with its last slice");

        let all: Vec<Mr> = std::iter::from_fn(|| pool.get()).collect();
        let addrs: HashSet<u64> = all.iter().map(Mr::addr).collect();
        let expect: HashSet<u64> = (0..8).map(|k| base + k * 1024).collect();
        assert_eq!(addrs, expect, "every buffer back exactly once");
        for mr in all {
            pool.put(mr).unwrap();
        }

        // A Bytes keeps the pool, and so the registration, alive.
        let b = pool.to_bytes(pool.get().unwrap(), 16).unwrap();
        assert_eq!(b.len(), 16);
        drop((pool, p));
        assert_eq!(res_counts(&dev)["mr"], mrs + 1, "the pool lives on in b");
        drop(b);
        assert_eq!(
            res_counts(&dev)["mr"],
            mrs,
            "deregistered with the last Bytes"
        );
    }

    #[test]
    fn bytes_are_refused_where_a_peer_could_write_the_buffer() {
        let _g = serial();
        let ctx = ctx();
        let dev = ctx.name().to_owned();
        let pd = Pd::new(&ctx).unwrap();
        let mrs = res_counts(&dev)["mr"];
        let lw = AccessFlags::LOCAL_WRITE;
        for access in [
            lw | AccessFlags::REMOTE_WRITE,
            lw | AccessFlags::REMOTE_ATOMIC,
            lw | AccessFlags::MW_BIND,
        ] {
            let pool = Arc::new(MrPool::new(&pd, 64, 2, access).unwrap());
            let refused = pool.to_bytes(pool.get().unwrap(), 64).unwrap_err();
            assert!(
                matches!(refused.error, Error::RemotelyWritable),
                "{access:?}: {}",
                refused.error
            );
            pool.put(refused.mr).unwrap();
            assert_eq!(pool.available(), 2, "{access:?}");
        }

        // A peer may read, not write: accepted.
        let a = Arc::new(MrPool::new(&pd, 64, 2, lw | AccessFlags::REMOTE_READ).unwrap());
        let b = Arc::new(MrPool::new(&pd, 64, 2, lw).unwrap());
        let bytes = a.to_bytes(a.get().unwrap(), 64).unwrap();
        assert_eq!(bytes[..], [0u8; 64], "fresh pool memory is zeroed");

        let refused = b.to_bytes(a.get().unwrap(), 64).unwrap_err();
        assert!(
            matches!(
                refused.error,
                Error::InvalidArgument {
                    what: "pool buffer",
                    ..
                }
            ),
            "{}",
            refused.error
        );
        let refused = a.to_bytes(refused.mr, 65).unwrap_err();
        assert!(
            matches!(
                refused.error,
                Error::InvalidArgument {
                    what: "pool buffer length",
                    ..
                }
            ),
            "{}",
            refused.error
        );
        a.put(refused.mr).unwrap();
        assert_eq!((a.available(), b.available()), (1, 2));
        drop(bytes);
        assert_eq!(a.available(), 2);
        drop((a, b));
        assert_eq!(res_counts(&dev)["mr"], mrs);
    }
}
