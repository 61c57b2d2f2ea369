//! The registration cache and on-demand paging on real soft-RoCE: a hit is
//! the same kernel MR, invalidation makes the next lookup register anew while
//! old handles keep theirs alive, bad input is refused before the kernel, and
//! ODP is refused where the device reports no ODP capability.

mod common;

use std::sync::Mutex;
use std::time::Instant;

use common::{Pair, caps_sr, pair, pattern, res_counts, wait};
use rdma_verbs::mr::{Advice, CachedMr, ImplicitOdpMr, RegCache};
use rdma_verbs::prelude::*;

/// The tests compare the device's MR count: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn mr_count(p: &Pair) -> u64 {
    res_counts(p.ctx.name())["mr"]
}

/// Memory a C allocator hands out, as the cache's users have: `malloc`ed,
/// filled with `pattern(len, seed)`, freed on drop.
struct CBuf {
    ptr: *mut u8,
    len: usize,
}

impl CBuf {
    fn new(len: usize, seed: u8) -> CBuf {
        // SAFETY: malloc has no preconditions; checked for null below.
        let ptr = unsafe { libc::malloc(len) }.cast::<u8>();
        assert!(!ptr.is_null());
        let data = pattern(len, seed);
        // SAFETY: `len` fresh bytes at ptr; data has `len` bytes.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, len) };
        CBuf { ptr, len }
    }
}

// SAFETY: the pointer is only passed to the cache (and freed once, on drop).
unsafe impl Sync for CBuf {}

impl Drop for CBuf {
    fn drop(&mut self) {
        // SAFETY: from malloc, freed once; every test invalidates and drops its
        // handles before the buffer goes.
        unsafe { libc::free(self.ptr.cast()) };
    }
}

/// `a` READs all of `src` (memory registered in `b`'s PD, the same as `a`'s).
fn read_from(p: &mut Pair, src: &CachedMr) -> Vec<u8> {
    let dest = p.pd.alloc_mr(src.len(), AccessFlags::LOCAL_WRITE).unwrap();
    p.a.post_send(SendWr::read(7, dest, src.remote(), 0))
        .unwrap();
    let mut c = wait(&mut p.cq_a, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{:?}", c[0]);
    assert_eq!(c[0].opcode, WcOpcode::RdmaRead);
    c[0].take_mr().unwrap().to_vec().unwrap()
}

const READ: AccessFlags = AccessFlags::REMOTE_READ;

#[test]
fn a_hit_is_the_same_registration_and_no_new_kernel_mr() {
    let _g = serial();
    let mut p = pair(caps_sr(4, 4));
    let base = mr_count(&p);
    let buf = CBuf::new(8192 + 100, 3);
    let cache = RegCache::new(&p.pd);

    // SAFETY (every get below): buf stays allocated until after the cache
    // and every handle are gone; no Rust reference to it exists.
    let h1 = unsafe { cache.get(buf.ptr, buf.len, READ) }.unwrap();
    assert_eq!(mr_count(&p), base + 1);
    let h2 = unsafe { cache.get(buf.ptr, buf.len, READ) }.unwrap();
    assert_eq!(mr_count(&p), base + 1, "a hit registers nothing");
    assert!(h1.same_registration(&h2));
    assert_eq!((h1.lkey(), h1.rkey()), (h2.lkey(), h2.rkey()));
    assert_eq!((h2.addr(), h2.len()), (buf.ptr as u64, buf.len));
    assert_eq!(cache.hits_misses(), (1, 1));
    assert_eq!(read_from(&mut p, &h2), pattern(buf.len, 3));

    // Keys are exact: other rights or a sub-range are entries of their own.
    let other = unsafe { cache.get(buf.ptr, buf.len, READ | AccessFlags::LOCAL_WRITE) }.unwrap();
    let sub = unsafe { cache.get(buf.ptr, 4096, READ) }.unwrap();
    assert!(!other.same_registration(&h1) && !sub.same_registration(&h1));
    assert_eq!(mr_count(&p), base + 3);
    assert_eq!((cache.len(), cache.hits_misses()), (3, (1, 3)));
    assert_eq!(read_from(&mut p, &sub), pattern(4096, 3));

    // Dropping handles keeps the entries: the cache holds them.
    drop((h1, h2, other, sub));
    assert_eq!(mr_count(&p), base + 3);
    drop(cache);
    assert_eq!(mr_count(&p), base, "dropping the cache deregisters all");
}

#[test]
fn invalidation_makes_the_next_get_register_anew_and_old_handles_live_on() {
    let _g = serial();
    let mut p = pair(caps_sr(4, 4));
    let base = mr_count(&p);
    let buf = CBuf::new(3 * 4096, 9);
    let cache = RegCache::new(&p.pd);

    // SAFETY (every get below): as in the test above.
    let old = unsafe { cache.get(buf.ptr, buf.len, READ) }.unwrap();
    // An overlapping range (the last byte of the entry) invalidates it.
    let last = buf.ptr.wrapping_add(buf.len - 1);
    assert_eq!(cache.invalidate(last, 4096).unwrap(), 1);
    assert_eq!(cache.len(), 0);
    // A range next to it does not.
    let _ = unsafe { cache.get(buf.ptr, buf.len, READ) }.unwrap();
    assert_eq!(
        cache
            .invalidate(buf.ptr.wrapping_add(buf.len), 4096)
            .unwrap(),
        0
    );
    let new = unsafe { cache.get(buf.ptr, buf.len, READ) }.unwrap();
    assert!(!new.same_registration(&old));
    assert_ne!(new.rkey(), old.rkey());
    assert_eq!(
        mr_count(&p),
        base + 2,
        "the old one lives while its handle does"
    );
    assert_eq!(cache.hits_misses(), (1, 2));

    // The old handle's keys still work: the registration is alive.
    assert_eq!(read_from(&mut p, &old), pattern(buf.len, 9));
    drop(old);
    assert_eq!(mr_count(&p), base + 1, "deregistered with its last handle");
    assert_eq!(read_from(&mut p, &new), pattern(buf.len, 9));

    // Invalidating an entry without handles deregisters it at once.
    drop(new);
    assert_eq!(cache.invalidate(buf.ptr, buf.len).unwrap(), 1);
    assert_eq!(mr_count(&p), base);
    assert!(cache.is_empty());
}

#[test]
fn bad_input_is_refused_before_the_kernel() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let base = mr_count(&p);
    let buf = CBuf::new(4096, 1);
    let cache = RegCache::new(&p.pd);
    let invalid = |r: Result<CachedMr>| match r {
        Err(Error::InvalidArgument { what, .. }) => what,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    // SAFETY: refused before registration; buf is valid anyway.
    assert_eq!(invalid(unsafe { cache.get(buf.ptr, 0, READ) }), "MR length");
    assert_eq!(
        invalid(unsafe { cache.get(std::ptr::null_mut(), 4096, READ) }),
        "MR address"
    );
    assert_eq!(
        invalid(unsafe { cache.get(buf.ptr, 4096, AccessFlags::REMOTE_WRITE) }),
        "MR access flags"
    );
    match cache.invalidate(buf.ptr, 0) {
        Err(Error::InvalidArgument { what, .. }) => assert_eq!(what, "invalidated range"),
        other => panic!("{other:?}"),
    }
    assert_eq!(mr_count(&p), base);
    assert_eq!((cache.len(), cache.hits_misses()), (0, (0, 3)));

    let h = unsafe { cache.get(buf.ptr, 4096, READ) }.unwrap();
    assert_eq!(h.sge(4000, 96).unwrap().addr, buf.ptr as u64 + 4000);
    assert!(matches!(
        h.sge(4000, 97),
        Err(Error::InvalidArgument {
            what: "SGE range",
            ..
        })
    ));
    assert!(matches!(
        h.sge(usize::MAX, 2),
        Err(Error::InvalidArgument { .. })
    ));
    drop((h, cache));
    assert_eq!(mr_count(&p), base);
}

#[test]
fn handles_from_many_threads_share_one_registration() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let base = mr_count(&p);
    let bufs: Vec<CBuf> = (0..8).map(|i| CBuf::new(4096, i)).collect();
    let cache = RegCache::new(&p.pd);
    let rkeys: Vec<Vec<u32>> = std::thread::scope(|s| {
        let ts: Vec<_> = (0..4)
            .map(|_| {
                let (cache, bufs) = (&cache, &bufs);
                s.spawn(move || {
                    (0..2000)
                        .map(|i| {
                            let b = &bufs[i % bufs.len()];
                            // SAFETY: bufs outlive the cache and its handles.
                            unsafe { cache.get(b.ptr, b.len, READ) }.unwrap().rkey()
                        })
                        .collect()
                })
            })
            .collect();
        ts.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_eq!(cache.len(), 8);
    assert_eq!(mr_count(&p), base + 8, "one registration per buffer");
    for r in &rkeys[1..] {
        assert_eq!(r, &rkeys[0], "every thread saw the same keys");
    }
    let (hits, misses) = cache.hits_misses();
    assert_eq!(hits + misses, 8000);
    assert!(misses >= 8, "{misses}");
    cache.clear();
    assert_eq!(mr_count(&p), base);
}

/// Median of `n` timings of `f`, in ns.
fn median_ns(n: usize, mut f: impl FnMut()) -> u128 {
    let mut t: Vec<u128> = (0..n)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_nanos()
        })
        .collect();
    t.sort_unstable();
    t[n / 2]
}

#[test]
fn hit_against_miss_cost() {
    let _g = serial();
    let p = pair(caps_sr(1, 1));
    let cache = RegCache::new(&p.pd);
    for len in [4096usize, 1 << 20] {
        let buf = CBuf::new(len, 0);
        let access = AccessFlags::LOCAL_WRITE | READ;
        // SAFETY (every get): buf outlives the cache's entries and handles.
        let hit = median_ns(20_000, || {
            let _ = std::hint::black_box(unsafe { cache.get(buf.ptr, len, access) }.unwrap());
        });
        let miss = median_ns(200, || {
            let h = unsafe { cache.get(buf.ptr, len, access) }.unwrap();
            cache.invalidate(buf.ptr, len).unwrap();
            std::hint::black_box(h);
        });
        let fresh = median_ns(200, || {
            // SAFETY: buf outlives the Mr, dropped right here; nothing else
            // touches it meanwhile.
            let mr = unsafe { Mr::register_raw(&p.pd, buf.ptr, len, access, ()) }.unwrap();
            std::hint::black_box(mr);
        });
        println!(
            "reg_cache {len} bytes: hit {hit} ns, miss (register + deregister) {miss} ns, \
             Mr::register_raw + drop {fresh} ns"
        );
        assert!(
            hit < miss,
            "a hit ({hit} ns) costs less than a registration ({miss} ns)"
        );
        cache.clear();
    }
}

#[test]
fn odp_is_refused_where_the_device_reports_none() {
    let _g = serial();
    let mut p = pair(caps_sr(4, 4));
    let base = mr_count(&p);
    let attr = p.ctx.query_device().unwrap();
    let (general, rc) = (attr.odp_general_caps, attr.odp_rc_caps);
    println!(
        "{} odp_general_caps {general:#x} odp_rc_caps {rc:#x}",
        p.ctx.name()
    );
    let odp = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::ON_DEMAND;
    const ODP_SUPPORT: u64 = 1;
    const ODP_SUPPORT_IMPLICIT: u64 = 2;

    // Not ODP: prefetch refuses whatever the device.
    let pinned = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    assert!(matches!(
        pinned.prefetch(Advice::Prefetch, true),
        Err(Error::InvalidArgument {
            what: "prefetch",
            ..
        })
    ));
    drop(pinned);

    if general & ODP_SUPPORT == 0 {
        for r in [
            Mr::new(&p.pd, 4096, odp),
            Mr::register(&p.pd, vec![0u8; 4096], odp),
        ] {
            match r {
                Err(Error::Unsupported { verb, hint }) => {
                    assert_eq!(verb, "on-demand paging (IBV_ODP_SUPPORT)");
                    assert!(hint.contains(p.ctx.name()), "{hint}");
                }
                other => panic!("expected Unsupported, got {other:?}"),
            }
        }
    } else {
        // The real path: register on demand, prefetch, WRITE into it.
        let mr = Mr::register(&p.pd, vec![0u8; 8192], odp).unwrap();
        mr.prefetch(Advice::PrefetchWrite, true).unwrap();
        let data = pattern(8192, 5);
        let mut src = p.pd.alloc_mr(8192, AccessFlags::empty()).unwrap();
        src.as_mut_slice().unwrap().copy_from_slice(&data);
        p.a.post_send(SendWr::write(1, mr.remote(), 0).sge(src))
            .unwrap();
        let c = wait(&mut p.cq_a, 1);
        assert_eq!(c[0].status, WcStatus::Success, "{:?}", c[0]);
        assert_eq!(mr.to_vec().unwrap(), data);
        assert_eq!(mr.into_buffer::<Vec<u8>>().unwrap(), data);
    }
    // SAFETY: refused or registered without remote rights; dropped below.
    match unsafe { ImplicitOdpMr::register(&p.pd, AccessFlags::LOCAL_WRITE) } {
        Err(Error::Unsupported { verb, .. }) => {
            assert!(general & ODP_SUPPORT_IMPLICIT == 0, "{general:#x}");
            let want = if general & ODP_SUPPORT == 0 {
                "on-demand paging (IBV_ODP_SUPPORT)"
            } else {
                "implicit on-demand paging (IBV_ODP_SUPPORT_IMPLICIT)"
            };
            assert_eq!(verb, want);
        }
        Ok(all) => {
            assert!(general & ODP_SUPPORT_IMPLICIT != 0);
            let v = vec![1u8; 4096];
            all.prefetch(v.as_ptr() as u64, v.len(), Advice::Prefetch, true)
                .unwrap();
        }
        Err(e) => panic!("{e:?}"),
    }
    assert_eq!(mr_count(&p), base, "nothing left registered");
}
