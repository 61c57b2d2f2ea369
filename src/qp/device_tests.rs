//! Device tests of the ring's panic safety that need crate internals (a
//! buffer whose `Drop` panics). Ignored on the host; `cargo xtask test` runs
//! them in the soft-RoCE guest (`--lib -- --ignored`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::context::Context;
use crate::cq::{Cq, WcStatus};
use crate::device::GidType;
use crate::ffi;
use crate::mr::Region;
use crate::mr::{AccessFlags, Mr};
use crate::pd::Pd;
use crate::qp::{InitAttr, Qp, QpCaps, RecvWr, SendWr};

/// Counts its drops, and panics in each.
struct PanicOnDrop {
    drops: Arc<AtomicUsize>,
    _mem: Box<[u8]>,
}

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
        panic!("a buffer's Drop panics");
    }
}

/// A 64-byte `Mr` whose release panics (as a device-memory keepalive might).
fn panicking_mr(pd: &Pd, drops: &Arc<AtomicUsize>) -> Mr {
    let mut mem = vec![0u8; 64].into_boxed_slice();
    let ptr = NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: registers 64 bytes of `mem`, which the keepalive owns (a Box's
    // heap allocation does not move when the Box does).
    let raw = unsafe {
        ffi::ibv_reg_mr(
            pd.as_raw(),
            ptr.as_ptr().cast(),
            64,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
        )
    };
    let raw = NonNull::new(raw).expect("ibv_reg_mr");
    let keep = PanicOnDrop {
        drops: drops.clone(),
        _mem: mem,
    };
    // SAFETY: `raw` registers [ptr, ptr+64) in `pd`, kept valid by `keep`.
    unsafe {
        Region::from_device_registration(pd, raw, ptr, 64, AccessFlags::LOCAL_WRITE, Box::new(keep))
    }
}

fn ctx() -> Context {
    let name = std::env::var("RDMA_VERBS_DEVICE").ok();
    Context::open(name.as_deref()).expect("these tests need an RDMA device")
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_buffer_whose_drop_panics_is_dropped_once_and_the_ring_goes_on() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let gid = ctx
        .gid_table()
        .unwrap()
        .iter()
        .find(|e| e.port == 1 && e.gid_type == GidType::RoceV2)
        .map(|e| e.index)
        .unwrap_or(0);
    let mut cq_a = Cq::new(&ctx, 64).unwrap();
    let mut cq_b = Cq::new(&ctx, 64).unwrap();
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        ..QpCaps::default()
    };
    let access = AccessFlags::LOCAL_WRITE;
    let a = Qp::new(&pd, &cq_a, &cq_a, caps)
        .unwrap()
        .init(InitAttr::new(1, access))
        .unwrap();
    let mut b = Qp::new(&pd, &cq_b, &cq_b, caps)
        .unwrap()
        .init(InitAttr::new(1, access))
        .unwrap();
    b.post_recv_list((0..4).map(|i| RecvWr::new(i, pd.alloc_mr(64, access).unwrap())))
        .unwrap();
    let ea = a.endpoint(Some(gid)).unwrap();
    let eb = b.endpoint(Some(gid)).unwrap();
    let mut a = a.connect(&eb, Some(gid)).unwrap();
    let _b = b.connect(&ea, Some(gid)).unwrap();

    let drops = Arc::new(AtomicUsize::new(0));
    // An unsignaled SEND from the panicking buffer, then a signaled one: its
    // completion retires the first, whose buffer is released while polling.
    a.post_send(SendWr::send_from(1, panicking_mr(&pd, &drops)).signaled(false))
        .unwrap();
    a.post_send(SendWr::send(2)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut out = Vec::with_capacity(8);
    let r = catch_unwind(AssertUnwindSafe(|| cq_a.poll(&mut out)));
    assert!(r.is_err(), "the Drop's panic reaches the poller");
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    assert_eq!(
        out.len(),
        1,
        "the completion was delivered before the panic went on"
    );
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    // The ring is consistent: more requests complete, nothing is dropped twice.
    for i in 3..5 {
        a.post_send(SendWr::send(i)).unwrap();
    }
    let mut more = Vec::with_capacity(8);
    cq_a.poll_n(&mut more, 2, Duration::from_secs(20)).unwrap();
    assert_eq!([more[0].wr_id, more[1].wr_id], [3, 4]);
    let mut recvs = Vec::with_capacity(8);
    cq_b.poll_n(&mut recvs, 4, Duration::from_secs(20)).unwrap();
    drop((a, cq_a));
    assert_eq!(drops.load(Ordering::SeqCst), 1);
}

/// Counts its drops.
struct CountOnDrop {
    drops: Arc<AtomicUsize>,
    _mem: Box<[u8]>,
}

impl Drop for CountOnDrop {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

/// A `len`-byte `Mr` whose release is counted in `drops`.
fn counted_mr(pd: &Pd, len: usize, drops: &Arc<AtomicUsize>) -> Mr {
    let mut mem = vec![0u8; len].into_boxed_slice();
    let ptr = NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: registers `len` bytes of `mem`, which the keepalive owns.
    let raw = unsafe {
        ffi::ibv_reg_mr(
            pd.as_raw(),
            ptr.as_ptr().cast(),
            len,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
        )
    };
    let raw = NonNull::new(raw).expect("ibv_reg_mr");
    let keep = CountOnDrop {
        drops: drops.clone(),
        _mem: mem,
    };
    // SAFETY: `raw` registers [ptr, ptr+len) in `pd`, kept valid by `keep`.
    unsafe {
        Region::from_device_registration(
            pd,
            raw,
            ptr,
            len,
            AccessFlags::LOCAL_WRITE,
            Box::new(keep),
        )
    }
}

#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_ud_qp_keeps_its_address_handles_until_done_and_drops_everything_once() {
    use crate::ah::AddressHandle;
    use crate::qp::AddressVector;
    use crate::qp::{UdInitAttr, UdRecvWr, UdSendWr};
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let gid_ix = ctx.default_gid_index(1).unwrap().unwrap_or(0);
    let gid = ctx.query_gid(1, gid_ix).unwrap();
    let mut cq = Cq::new(&ctx, 64).unwrap();
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        ..QpCaps::default()
    };
    let new_qp = |cq: &Cq| {
        Qp::new_ud(&pd, cq, cq, caps)
            .unwrap()
            .init(UdInitAttr::new(1, 7))
            .unwrap()
            .ready()
            .unwrap()
    };
    let mut a = new_qp(&cq);
    let ah = AddressHandle::new(&pd, AddressVector::global(1, gid, gid_ix)).unwrap();
    let count = || Arc::strong_count(&ah.inner);
    // Sends to a QP number nobody listens on (UD drops them silently).
    let nobody = a.qp_num() + 1000;
    for i in 0..3 {
        a.post_send(UdSendWr::send(i, &ah, nobody, 7)).unwrap();
    }
    assert_eq!(count(), 4, "one clone per posted send");
    let mut out = Vec::with_capacity(8);
    cq.poll_n(&mut out, 3, Duration::from_secs(20)).unwrap();
    assert!(out.iter().all(|c| c.status == WcStatus::Success));
    // Slots are reused round the ring: at most one clone per slot is kept.
    for i in 3..20 {
        a.post_send(UdSendWr::send(i, &ah, nobody, 7)).unwrap();
        cq.poll_n(&mut out, 1, Duration::from_secs(20)).unwrap();
    }
    assert!(count() <= 1 + 4, "{} clones", count());
    // A list whose second request is refused (over the MTU): the first is
    // posted and keeps its clone; the refused one and the one never pulled
    // drop theirs.
    let before = count();
    let big = Mr::new(&pd, a.max_message() as usize + 1, AccessFlags::LOCAL_WRITE).unwrap();
    let e = a
        .post_send_list([
            UdSendWr::send(30, &ah, nobody, 7),
            UdSendWr::send_from(31, big, &ah, nobody, 7),
            UdSendWr::send(32, &ah, nobody, 7),
        ])
        .unwrap_err();
    assert!(
        matches!(e.error, crate::Error::MessageTooLong { .. }),
        "{e}"
    );
    // The refused request comes back; the list is not pulled any further.
    assert_eq!(e.unposted.iter().map(|u| u.0).collect::<Vec<_>>(), [31]);
    drop(e);
    cq.poll_n(&mut out, 1, Duration::from_secs(20)).unwrap();
    assert_eq!(out.last().unwrap().wr_id, 30);
    assert!(count() <= before + 1, "{} clones", count());

    // Work in flight when the QP goes: receives that never complete and
    // sends whose completions nobody polled. Every buffer drops exactly once.
    let drops = Arc::new(AtomicUsize::new(0));
    let mut b = new_qp(&cq);
    for i in 0..4 {
        let grh = counted_mr(&pd, 40, &drops);
        let payload = counted_mr(&pd, 64, &drops);
        b.post_recv(UdRecvWr::new(i, grh, payload)).unwrap();
    }
    for i in 0..4 {
        let src = counted_mr(&pd, 16, &drops);
        b.post_send(UdSendWr::send_from(i, src, &ah, nobody, 7))
            .unwrap();
    }
    let before = count();
    assert_eq!(before, 5 + 4);
    drop(b);
    assert_eq!(
        drops.load(Ordering::SeqCst),
        12,
        "8 receive + 4 send buffers"
    );
    assert_eq!(count(), 5, "b's clones are gone");
    drop(a);
    assert_eq!(count(), 1, "only the user's handle is left");
    // The completions of b's sends are stale now; polling them drops nothing.
    let mut rest = Vec::with_capacity(16);
    std::thread::sleep(Duration::from_millis(200));
    cq.poll(&mut rest).unwrap();
    assert_eq!(drops.load(Ordering::SeqCst), 12);
}

/// Host memory whose `Drop` panics once armed: an `OwnedMemory` that keeps
/// the trait's contract (the bytes live on the heap, reached only through it).
/// Also the gdr tests' panicking buffer ([`armed`](Self::armed)).
pub(crate) struct ArmedPanicMemory {
    v: Vec<u8>,
    armed: Arc<std::sync::atomic::AtomicBool>,
}

impl ArmedPanicMemory {
    /// `v`, armed from the start.
    #[cfg(feature = "gdr")]
    pub(crate) fn armed(v: Vec<u8>) -> ArmedPanicMemory {
        ArmedPanicMemory {
            v,
            armed: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }
}

// SAFETY: the Vec's heap buffer does not move and is reached only through it.
unsafe impl crate::mr::OwnedMemory for ArmedPanicMemory {
    fn memory(&mut self) -> (*mut u8, usize) {
        (self.v.as_mut_ptr(), self.v.len())
    }
}

impl Drop for ArmedPanicMemory {
    fn drop(&mut self) {
        if self.armed.load(Ordering::SeqCst) {
            panic!("an application's memory panics in Drop");
        }
    }
}

/// Two connected RC QPs with 4 send and receive slots, on CQs of their own;
/// `prep` runs on `b` in INIT.
fn small_pair(
    pd: &Pd,
    cq_a: &Cq,
    cq_b: &Cq,
    prep: impl FnOnce(&mut Qp<crate::qp::Rc, crate::qp::Init>),
) -> (
    Qp<crate::qp::Rc, crate::qp::Rts>,
    Qp<crate::qp::Rc, crate::qp::Rts>,
) {
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        ..QpCaps::default()
    };
    pair_with(pd, cq_a, cq_b, caps, prep)
}

/// [`small_pair`] with `caps`.
fn pair_with(
    pd: &Pd,
    cq_a: &Cq,
    cq_b: &Cq,
    caps: QpCaps,
    prep: impl FnOnce(&mut Qp<crate::qp::Rc, crate::qp::Init>),
) -> (
    Qp<crate::qp::Rc, crate::qp::Rts>,
    Qp<crate::qp::Rc, crate::qp::Rts>,
) {
    let ctx = ctx();
    let gid = ctx.default_gid_index(1).unwrap().unwrap_or(0);
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let mk = |cq: &Cq| {
        Qp::new(pd, cq, cq, caps)
            .unwrap()
            .init(InitAttr::new(1, access))
            .unwrap()
    };
    let a = mk(cq_a);
    let mut b = mk(cq_b);
    prep(&mut b);
    let (ea, eb) = (
        a.endpoint(Some(gid)).unwrap(),
        b.endpoint(Some(gid)).unwrap(),
    );
    (
        a.connect(&eb, Some(gid)).unwrap(),
        b.connect(&ea, Some(gid)).unwrap(),
    )
}

/// Binds a window over a region of [`ArmedPanicMemory`] through `b` (its send
/// queue completing on `cq`), drops the window and the `Mr`, polls the bind,
/// and arms the memory: the retired request's slot then holds the last
/// reference to the window, and through it to the region.
fn leave_a_window_over_panicking_memory(
    pd: &Pd,
    b: &mut Qp<crate::qp::Rc, crate::qp::Rts>,
    cq: &mut Cq,
) {
    use crate::mw::{Mw, MwType};
    let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mem = ArmedPanicMemory {
        v: vec![0; 4096],
        armed: armed.clone(),
    };
    let mr = Mr::register(pd, mem, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap();
    let mut mw = Mw::new(pd, MwType::Type2).unwrap();
    b.post_bind_mw(100, &mut mw, &mr, 0..64, AccessFlags::REMOTE_READ)
        .unwrap();
    // Dropped before the bind is polled: the QP keeps the window (an `Mw`
    // dropped after its bind retired is deallocated at once).
    drop((mw, mr));
    let mut out = Vec::with_capacity(4);
    cq.poll_n(&mut out, 1, Duration::from_secs(10)).unwrap();
    assert_eq!(out[0].status, WcStatus::Success);
    armed.store(true, Ordering::SeqCst);
}

/// A window whose last reference is a retired request's, over a region whose
/// memory panics in `Drop`: the window request that reuses the slot lets it
/// go before anything is staged, so the panic reaches the caller with the
/// queue as it was, the new window counted once per reference, and the QP
/// goes on posting and is destroyed cleanly.
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_window_region_that_panics_in_drop_leaves_the_send_queue_consistent() {
    use crate::mw::{Mw, MwType};
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (cq_a, mut cq_b) = (Cq::new(&ctx, 64).unwrap(), Cq::new(&ctx, 64).unwrap());
    let (_a, mut b) = small_pair(&pd, &cq_a, &cq_b, |_| {});
    let wait = |cq: &mut Cq| {
        let mut out = Vec::with_capacity(4);
        cq.poll_n(&mut out, 1, Duration::from_secs(10)).unwrap();
        out.pop().unwrap()
    };
    leave_a_window_over_panicking_memory(&pd, &mut b, &mut cq_b);
    let mr2 = Mr::new(&pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap();
    let mut mw2 = Mw::new(&pd, MwType::Type2).unwrap();
    let mut panicked = 0;
    for i in 0..16u64 {
        let r = catch_unwind(AssertUnwindSafe(|| {
            if i % 2 == 0 {
                b.post_bind_mw(200 + i, &mut mw2, &mr2, 0..64, AccessFlags::REMOTE_READ)
                    .map(drop)
            } else {
                b.post_local_inv(200 + i, &mut mw2)
            }
        }));
        match r {
            Ok(r) => {
                r.unwrap();
                let c = wait(&mut cq_b);
                assert_eq!((c.wr_id, c.status), (200 + i, WcStatus::Success));
            }
            Err(_) => {
                panicked += 1;
                // Nothing of the request was posted.
                assert_eq!(b.outstanding(), (0, 0), "request {i}");
                let held = b.core.ext.windows.as_ref().unwrap().holding(mw2.shared());
                assert_eq!(Arc::strong_count(mw2.shared()), 1 + held);
                // The request goes out when posted again.
                b.post_local_inv(200 + i, &mut mw2)
                    .or_else(|_| {
                        b.post_bind_mw(200 + i, &mut mw2, &mr2, 0..64, AccessFlags::REMOTE_READ)
                            .map(drop)
                    })
                    .unwrap();
                assert_eq!(wait(&mut cq_b).wr_id, 200 + i);
            }
        }
    }
    assert_eq!(panicked, 1);
    drop((b, mw2, mr2));
}

/// Dropping a QP whose retired request's window is the last reference to a
/// region that panics in `Drop`: the panic stays inside the destructor, the
/// QP is destroyed and its posted receive buffer is released.
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn dropping_a_qp_contains_a_window_regions_panic() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (cq_a, mut cq_b) = (Cq::new(&ctx, 64).unwrap(), Cq::new(&ctx, 64).unwrap());
    let drops = Arc::new(AtomicUsize::new(0));
    let (_a, mut b) = small_pair(&pd, &cq_a, &cq_b, |b| {
        b.post_recv(RecvWr::new(9, counted_mr(&pd, 64, &drops)))
            .unwrap();
    });
    leave_a_window_over_panicking_memory(&pd, &mut b, &mut cq_b);
    let r = catch_unwind(AssertUnwindSafe(move || drop(b)));
    assert!(r.is_ok(), "a panic left the QP's destructor");
    assert_eq!(
        drops.load(Ordering::SeqCst),
        1,
        "the posted receive's buffer"
    );
}

/// [`pair_with`] with `sges` SGEs a send and three 256-byte receives posted
/// on `b`.
fn sge_pair(
    pd: &Pd,
    cq_a: &Cq,
    cq_b: &Cq,
    sges: u32,
) -> (
    Qp<crate::qp::Rc, crate::qp::Rts>,
    Qp<crate::qp::Rc, crate::qp::Rts>,
) {
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: sges,
        ..QpCaps::default()
    };
    pair_with(pd, cq_a, cq_b, caps, |b| {
        for i in 0..3 {
            let mr = pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
            b.post_recv(RecvWr::new(i, mr)).unwrap();
        }
    })
}

/// An unsignaled SEND (wr_id 1) from `n` buffers that panic in `Drop`, then
/// a signaled one (wr_id 2) whose completion retires it; waits for both.
fn post_panicking_then_signaled(
    a: &mut Qp<crate::qp::Rc, crate::qp::Rts>,
    pd: &Pd,
    drops: &Arc<AtomicUsize>,
    n: usize,
) {
    let mut wr = SendWr::send(1);
    for _ in 0..n {
        wr = wr.sge(panicking_mr(pd, drops));
    }
    a.post_send(wr.signaled(false)).unwrap();
    a.post_send(SendWr::send(2)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
}

/// `items`, then a panic of the iterator itself.
fn then_panic<T>(mut items: impl Iterator<Item = T>) -> impl Iterator<Item = T> {
    std::iter::from_fn(move || {
        Some(
            items
                .next()
                .unwrap_or_else(|| panic!("the iterator panics")),
        )
    })
}

/// That `r` is the panic of a [`then_panic`] iterator, not a buffer's.
fn expect_iterator_panic(r: std::thread::Result<()>) {
    let payload = r.expect_err("the iterator's panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the iterator panics"));
}

/// A list post whose iterator panics after staging two requests whose
/// buffers both panic in `Drop`: both are taken back and dropped once each
/// (the second panic, during the first's unwind, is contained, not an
/// abort), the iterator's panic reaches the caller, and the queue goes on.
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_panicking_list_iterator_releases_each_panicking_buffer_it_staged() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (mut cq_a, cq_b) = (Cq::new(&ctx, 64).unwrap(), Cq::new(&ctx, 64).unwrap());
    let (mut a, _b) = small_pair(&pd, &cq_a, &cq_b, |b| {
        b.post_recv(RecvWr::new(
            9,
            pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap(),
        ))
        .unwrap();
    });
    let drops = Arc::new(AtomicUsize::new(0));
    let sends = (1..=2).map(|i| SendWr::send_from(i, panicking_mr(&pd, &drops)));
    let r = catch_unwind(AssertUnwindSafe(|| a.post_send_list(then_panic(sends))));
    expect_iterator_panic(r.map(drop));
    assert_eq!(drops.load(Ordering::SeqCst), 2, "each staged buffer, once");
    assert_eq!(a.outstanding(), (0, 0), "nothing of the list stays posted");
    a.post_send(SendWr::send(5)).unwrap();
    let mut out = Vec::with_capacity(4);
    cq_a.poll_n(&mut out, 1, Duration::from_secs(10)).unwrap();
    assert_eq!((out[0].wr_id, out[0].status), (5, WcStatus::Success));
}

/// One request with two buffers (a list on the heap) that both panic in
/// `Drop`, retired by a later completion: the poll's panic is the first
/// buffer's, both are dropped once, and the ring goes on.
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_request_whose_buffers_all_panic_in_drop_drops_each_once() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (mut cq_a, cq_b) = (Cq::new(&ctx, 64).unwrap(), Cq::new(&ctx, 64).unwrap());
    let (mut a, _b) = sge_pair(&pd, &cq_a, &cq_b, 2);
    let drops = Arc::new(AtomicUsize::new(0));
    post_panicking_then_signaled(&mut a, &pd, &drops, 2);
    let mut out = Vec::with_capacity(4);
    let r = catch_unwind(AssertUnwindSafe(|| cq_a.poll(&mut out)));
    assert!(r.is_err(), "a buffer's panic reaches the poller");
    assert_eq!(drops.load(Ordering::SeqCst), 2, "both buffers, once each");
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    a.post_send(SendWr::send(3)).unwrap();
    let mut more = Vec::with_capacity(4);
    cq_a.poll_n(&mut more, 1, Duration::from_secs(10)).unwrap();
    assert_eq!((more[0].wr_id, more[0].status), (3, WcStatus::Success));
    drop((a, cq_a));
    assert_eq!(drops.load(Ordering::SeqCst), 2);
}

/// The same for an SRQ's list post: two receives whose buffers panic in
/// `Drop`, then the iterator's panic: both are taken back and dropped once,
/// and the SRQ takes receives again.
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_panicking_srq_list_iterator_releases_each_panicking_buffer_it_staged() {
    use crate::srq::{Srq, SrqAttr};
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let cq = Cq::new(&ctx, 64).unwrap();
    let mut srq = Srq::new(&pd, &cq, SrqAttr::new(8, 1)).unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let recvs = (1..=2).map(|i| RecvWr::new(i, panicking_mr(&pd, &drops)));
    let r = catch_unwind(AssertUnwindSafe(|| srq.post_recv_list(then_panic(recvs))));
    expect_iterator_panic(r.map(drop));
    assert_eq!(drops.load(Ordering::SeqCst), 2, "each staged buffer, once");
    assert_eq!(srq.posted(), 0, "nothing of the list stays posted");
    let mr = pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    srq.post_recv(RecvWr::new(3, mr)).unwrap();
    assert_eq!(srq.posted(), 1);
}

/// A request's buffers taken back by iterating them, the iterator dropped
/// with two left whose `Drop` panics: both are dropped once, one panic goes
/// on (no abort).
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_buffer_iterator_dropped_early_drops_each_panicking_buffer_once() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let wr = SendWr::send(1)
        .sge(panicking_mr(&pd, &drops))
        .sge(panicking_mr(&pd, &drops))
        .sge(panicking_mr(&pd, &drops));
    let mut bufs = wr.into_buffers().into_iter();
    let first = bufs.next().expect("three buffers");
    assert!(catch_unwind(AssertUnwindSafe(move || drop(first))).is_err());
    assert_eq!(drops.load(Ordering::SeqCst), 1);
    let rest = catch_unwind(AssertUnwindSafe(move || drop(bufs)));
    let payload = rest.expect_err("a buffer's panic goes on");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"a buffer's Drop panics")
    );
    assert_eq!(drops.load(Ordering::SeqCst), 3, "each buffer, once");
}

/// `poll_recycling`'s closure panics on the first buffer of a request with
/// three, whose `Drop`s all panic: the closure's panic goes on from the
/// poll, the two buffers it did not take are dropped once each (their
/// panics contained, not left to abort the process during the closure's
/// unwind), and the queue goes on.
#[test]
#[ignore = "needs an RDMA device: run in the soft-RoCE guest"]
fn a_panicking_recycler_and_panicking_buffers_do_not_abort() {
    let ctx = ctx();
    let pd = Pd::new(&ctx).unwrap();
    let (mut cq_a, cq_b) = (Cq::new(&ctx, 64).unwrap(), Cq::new(&ctx, 64).unwrap());
    let (mut a, _b) = sge_pair(&pd, &cq_a, &cq_b, 3);
    let drops = Arc::new(AtomicUsize::new(0));
    post_panicking_then_signaled(&mut a, &pd, &drops, 3);
    let mut kept = Vec::new();
    let mut out = Vec::with_capacity(4);
    let r = catch_unwind(AssertUnwindSafe(|| {
        cq_a.poll_recycling(&mut out, |_, b| {
            kept.push(b);
            panic!("the recycler panics");
        })
    }));
    let payload = r.expect_err("the recycler's panic reaches the caller");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"the recycler panics"));
    assert_eq!(kept.len(), 1, "the closure took one buffer");
    assert_eq!(
        drops.load(Ordering::SeqCst),
        2,
        "the two it did not take, once each"
    );
    assert_eq!((out[0].wr_id, out[0].status), (2, WcStatus::Success));
    assert!(catch_unwind(AssertUnwindSafe(move || drop(kept))).is_err());
    assert_eq!(drops.load(Ordering::SeqCst), 3);
    a.post_send(SendWr::send(3)).unwrap();
    let mut more = Vec::with_capacity(4);
    cq_a.poll_n(&mut more, 1, Duration::from_secs(10)).unwrap();
    assert_eq!((more[0].wr_id, more[0].status), (3, WcStatus::Success));
}
