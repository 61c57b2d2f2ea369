//! Scoped borrowing (`Cq::scope`): requests that borrow their buffers, the
//! wait at the end of the scope, the flush when requests do not finish, and
//! coexistence with the ownership-passing path on the same CQ. Runs in the
//! soft-RoCE guest.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use common::{all_remote, caps_sr, pair, pair_api, pattern, scope_poll_n, summary, wait};
use rdma_verbs::cq::{CompletionSource, Cq, WcOpcode, WcStatus};
use rdma_verbs::mr::{AccessFlags, Mr};
use rdma_verbs::qp::scope::{DEFAULT_DRAIN_TIMEOUT, Dst, PreparedSends, ScopedSend, Src};
use rdma_verbs::qp::{QpStateKind, RecvWr, SendApi, SendWr};
use rdma_verbs::{Error, Result};

/// How long a scope may take to flush after its drain timeout (the module
/// docs' bound).
const FLUSH_BOUND: Duration = Duration::from_secs(5);

/// On both send APIs (an extended QP posts single scoped requests straight
/// through the builders).
#[test]
fn scoped_write_read_and_send_move_the_bytes() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        write_read_and_send(api);
    }
}

fn write_read_and_send(api: SendApi) {
    let mut p = pair_api(caps_sr(8, 4), api);
    assert_eq!(p.a.send_api(), api);
    let mr = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    p.b.post_recv(RecvWr::new(7, mr)).unwrap();
    let remote_mr = p.pd.alloc_mr(4096, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let data = pattern(4096, 3);
    let mut src = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &data).unwrap();
    let mut dst = p.pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE).unwrap();
    let (s_src, d_dst) = (Src::new(&src).unwrap(), Dst::new(&mut dst).unwrap());
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(1, s_src, remote, 0))?;
            // RC executes a READ after the WRITE before it.
            q.post_send(&ScopedSend::read(2, d_dst, remote, 0))?;
            q.post_send(&ScopedSend::send(3, s_src.slice(100, 300)?).imm(0xabcd))?;
            scope_poll_n(s, 3)
        })
        .unwrap();
    let got: Vec<_> = got.iter().map(summary).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success, WcOpcode::RdmaWrite, 0),
            (2, WcStatus::Success, WcOpcode::RdmaRead, 4096),
            (3, WcStatus::Success, WcOpcode::Send, 0),
        ]
    );
    assert_eq!(remote_mr.to_vec().unwrap(), data, "WRITE");
    assert_eq!(dst.to_vec().unwrap(), data, "READ back");
    let mut r = wait(&mut p.cq_b, 1);
    assert_eq!((r[0].wr_id, r[0].byte_len), (7, 300));
    assert_eq!(r[0].imm_data, Some(0xabcd));
    let recv = r[0].take_mr().unwrap();
    assert_eq!(recv.to_vec().unwrap()[..300], data[100..400]);
}

#[test]
fn scoped_receives_fill_borrowed_buffers() {
    let mut p = pair(caps_sr(8, 8));
    let mut bufs: Vec<Mr> = (0..4)
        .map(|_| p.pd.alloc_mr(512, AccessFlags::LOCAL_WRITE).unwrap())
        .collect();
    let dsts: Vec<Dst<'_>> = bufs.iter_mut().map(|m| Dst::new(m).unwrap()).collect();
    let (a, b) = (&mut p.a, &mut p.b);
    let pd = &p.pd;
    let got = p
        .cq_b
        .scope(|s| {
            let mut q = s.attach(b)?;
            for (i, d) in dsts.iter().enumerate() {
                q.post_recv(10 + i as u64, *d)?;
            }
            for i in 0..4u8 {
                let mut m = pd.alloc_mr(100 + usize::from(i), AccessFlags::LOCAL_WRITE)?;
                m.write_at(0, &pattern(100 + usize::from(i), i))?;
                a.post_send(SendWr::send_from(u64::from(i), m).imm(u32::from(i)))?;
            }
            scope_poll_n(s, 4)
        })
        .unwrap();
    for (i, c) in got.iter().enumerate() {
        assert_eq!(
            summary(c),
            (
                10 + i as u64,
                WcStatus::Success,
                WcOpcode::Recv,
                100 + i as u32
            )
        );
        assert_eq!(c.imm_data, Some(i as u32));
        assert_eq!(c.qp_num, p.b.qp_num());
    }
    for (i, m) in bufs.iter().enumerate() {
        assert_eq!(
            m.to_vec().unwrap()[..100 + i],
            pattern(100 + i, i as u8)[..]
        );
    }
    wait(&mut p.cq_a, 4);
}

#[test]
fn a_scope_returns_only_after_its_requests_completed() {
    let mut p = pair(caps_sr(64, 1));
    let remote_mr = p.pd.alloc_mr(64 * 64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let mut src = p.pd.alloc_mr(64 * 64, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(64 * 64, 9);
    src.write_at(0, &data).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    let start = Instant::now();
    p.cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            // 63 unsignaled WRITEs and a signaled last one; nothing polled.
            for i in 0..64u64 {
                let piece = s_src.slice(i as usize * 64, 64)?;
                q.post_send(&ScopedSend::write(i, piece, remote, i * 64).signaled(i == 63))?;
            }
            Ok(())
        })
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(5), "no drain timeout");
    assert_eq!(p.a.outstanding(), (0, 0));
    assert_eq!(remote_mr.to_vec().unwrap(), data);
    // The scope consumed its completions: nothing is left for Cq::poll.
    let mut rest = Vec::with_capacity(4);
    assert_eq!(p.cq_a.poll(&mut rest).unwrap(), 0);
}

#[test]
fn an_unsignaled_tail_is_flushed_within_the_bound_and_reported() {
    let mut p = pair(caps_sr(8, 1));
    // Kept registered: a WRITE to a deregistered region fails (and always completes).
    let remote_mr = p.pd.alloc_mr(64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp_num = p.a.qp_num();
    let qp = &mut p.a;
    let start = Instant::now();
    let r = p.cq_a.scope(|s| {
        s.set_drain_timeout(Duration::from_millis(200));
        let mut q = s.attach(qp)?;
        for i in 0..4 {
            q.post_send(&ScopedSend::write(i, s_src, remote, 0).signaled(false))?;
        }
        Ok(())
    });
    let took = start.elapsed();
    match r {
        Err(Error::ScopeDrained {
            qp_num: n,
            outstanding: 4,
            after,
        }) if n == qp_num && after == Duration::from_millis(200) => {}
        other => panic!("expected ScopeDrained, got {other:?}"),
    }
    assert!(took >= Duration::from_millis(200), "{took:?}");
    // The documented bound: the drain timeout plus at most 5 s for the
    // flush (rxe flushes at once; a loaded TCG guest has taken over 2 s).
    assert!(took < FLUSH_BOUND + Duration::from_millis(200), "{took:?}");
    assert_eq!(p.a.outstanding(), (0, 0));
    assert_eq!(p.a.query().unwrap().state, QpStateKind::Err);
}

/// A drain timeout of zero still polls once: a request whose completion is
/// already in the CQ is retired, not flushed (the QP does not go to ERR).
#[test]
fn a_drain_timeout_of_zero_takes_completions_already_there() {
    let mut p = pair(caps_sr(8, 1));
    let remote_mr = p.pd.alloc_mr(64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    p.cq_a
        .scope(|s| {
            s.set_drain_timeout(Duration::ZERO);
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(1, s_src, remote, 0))?;
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        })
        .unwrap();
    assert_eq!(p.a.query().unwrap().state, QpStateKind::Rts);
    assert_eq!(p.a.outstanding(), (0, 0));
}

/// Without a drain timeout, a scope that ends with unsignaled sends (which
/// never produce a completion when they succeed) still returns: after
/// `DEFAULT_DRAIN_TIMEOUT` it flushes them,
/// while signaled requests before them are waited for as usual.
#[test]
fn an_unsignaled_tail_is_flushed_without_a_drain_timeout() {
    // Both send APIs at once: each waits out DEFAULT_DRAIN_TIMEOUT.
    std::thread::scope(|t| {
        for api in [SendApi::Extended, SendApi::Legacy] {
            t.spawn(move || unsignaled_tail_without_a_drain_timeout(api));
        }
    });
}

fn unsignaled_tail_without_a_drain_timeout(api: SendApi) {
    let mut p = pair_api(caps_sr(8, 1), api);
    let remote_mr = p.pd.alloc_mr(256, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let src = p.pd.alloc_mr(256, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    let start = Instant::now();
    let r = p.cq_a.scope(|s| {
        s.set_drain_timeout(Duration::MAX);
        let mut q = s.attach(qp)?;
        for i in 0..4u64 {
            // A signaled one, then an unsignaled tail of three.
            q.post_send(&ScopedSend::write(i, s_src, remote, 0).signaled(i == 0))?;
        }
        Ok(())
    });
    let took = start.elapsed();
    match r {
        Err(Error::ScopeDrained {
            outstanding: 3,
            after,
            ..
        }) if after >= DEFAULT_DRAIN_TIMEOUT && after < DEFAULT_DRAIN_TIMEOUT * 2 => {}
        other => panic!("{api:?}: expected ScopeDrained, got {other:?}"),
    }
    assert!(
        took < DEFAULT_DRAIN_TIMEOUT + FLUSH_BOUND,
        "{api:?}: {took:?}"
    );
    assert_eq!(p.a.outstanding(), (0, 0));
    assert_eq!(p.a.query().unwrap().state, QpStateKind::Err);
}

/// A request that failed among those the closure left outstanding is the
/// scope's error (not `Ok` with nothing written and the QP in ERR), also when
/// the request was unsignaled.
#[test]
fn a_failed_request_the_closure_did_not_poll_is_the_scopes_error() {
    for signaled in [true, false] {
        let mut p = pair(caps_sr(8, 1));
        // No REMOTE_WRITE: the peer refuses the WRITE.
        let remote_mr = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let remote = remote_mr.remote();
        let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let s_src = Src::new(&src).unwrap();
        let qp = &mut p.a;
        let r = p.cq_a.scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(3, s_src, remote, 0).signaled(signaled))?;
            Ok("the closure's value")
        });
        match r {
            Err(Error::WorkCompletion {
                wr_id: 3,
                status: WcStatus::RemAccessErr,
                ..
            }) => {}
            other => panic!("signaled {signaled}: expected the failed WRITE, got {other:?}"),
        }
        assert_eq!(p.a.outstanding(), (0, 0));
        assert_eq!(remote_mr.to_vec().unwrap(), vec![0; 64]);
    }
}

/// A prepared list of unsignaled requests posted again and again keeps
/// draining: the post that leaves no room for the list again asks for a
/// completion (otherwise lists of 3 on a queue of 8 would stop at 6 in
/// flight, none signaled, and every later post would be refused).
#[test]
fn an_unsignaled_prepared_list_posted_again_and_again_keeps_draining() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        let mut p = pair_api(caps_sr(8, 1), api);
        let remote_mr = p.pd.alloc_mr(64, all_remote()).unwrap();
        let remote = remote_mr.remote();
        let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        let s_src = Src::new(&src).unwrap();
        let qp = &mut p.a;
        let posted = p
            .cq_a
            .scope(|s| {
                let list = PreparedSends::new(
                    (0..3u64).map(|i| ScopedSend::write(i, s_src, remote, 0).signaled(false)),
                )?;
                let mut q = s.attach(qp)?;
                let mut out = Vec::with_capacity(16);
                let (mut posted, deadline) = (0, Instant::now() + Duration::from_secs(10));
                while posted < 30 && Instant::now() < deadline {
                    match q.post_prepared(&list, posted * 3) {
                        Ok(()) => posted += 1,
                        Err(Error::QueueFull { .. }) => {
                            out.clear();
                            s.poll(&mut out)?;
                            for c in &out {
                                c.result()?;
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(posted)
            })
            .unwrap();
        assert_eq!(posted, 30, "{api:?}");
        assert_eq!(p.a.outstanding(), (0, 0));
    }
}

#[test]
fn a_panic_in_the_scope_waits_for_the_flush_then_resumes() {
    let mut p = pair(caps_sr(4, 4));
    let mut bufs: Vec<Mr> = (0..2)
        .map(|_| p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap())
        .collect();
    let dsts: Vec<Dst<'_>> = bufs.iter_mut().map(|m| Dst::new(m).unwrap()).collect();
    let qp = &mut p.a;
    let cq = &mut p.cq_a;
    let start = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(|| {
        cq.scope(|s| -> Result<()> {
            s.set_drain_timeout(Duration::from_millis(100));
            let mut q = s.attach(qp)?;
            for (i, d) in dsts.iter().enumerate() {
                // Nobody sends: these receives can only be flushed.
                q.post_recv(i as u64, *d)?;
            }
            // Unwinds like `panic!` without running the panic hook, whose
            // backtrace takes the better part of a second to print in the
            // guest (and is not what this test times).
            std::panic::resume_unwind(Box::new("boom"));
        })
    }));
    let took = start.elapsed();
    let payload = r.expect_err("the panic propagates");
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom"));
    assert!(
        took >= Duration::from_millis(100) && took < FLUSH_BOUND + Duration::from_millis(100),
        "{took:?}"
    );
    assert_eq!(p.a.outstanding(), (0, 0));
    // The receive buffers are ours again.
    bufs[0].fill(1).unwrap();
}

#[test]
fn completions_that_are_not_the_scopes_wait_for_cq_poll() {
    let mut p = pair(caps_sr(8, 1));
    // Kept registered: a WRITE to a deregistered region fails (and always completes).
    let remote_mr = p.pd.alloc_mr(256, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let owned = |fill: u8| {
        let mut m = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
        m.fill(fill).unwrap();
        m
    };
    // Ownership-passing requests posted before the scope: an unsignaled one
    // and a signaled one.
    p.a.post_send(SendWr::write_from(10, owned(10), remote, 0).signaled(false))
        .unwrap();
    p.a.post_send(SendWr::write_from(11, owned(11), remote, 64))
        .unwrap();
    let src = owned(1);
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            q.post_send(&ScopedSend::write(1, s_src, remote, 128))?;
            scope_poll_n(s, 1)
        })
        .unwrap();
    assert_eq!(
        got.iter().map(summary).collect::<Vec<_>>(),
        [(1, WcStatus::Success, WcOpcode::RdmaWrite, 0)]
    );
    // The earlier signaled request's completion, with its buffer.
    let mut out = Vec::with_capacity(4);
    assert_eq!(p.cq_a.poll(&mut out).unwrap(), 1);
    assert_eq!(
        (out[0].wr_id, out[0].status, out[0].source),
        (11, WcStatus::Success, CompletionSource::Posted)
    );
    let mr = out[0].take_mr().expect("its buffer comes back");
    assert_eq!(mr.to_vec().unwrap(), vec![11; 64]);
    out.clear();
    assert_eq!(p.cq_a.poll(&mut out).unwrap(), 0, "exactly once");
    assert_eq!(p.a.outstanding(), (0, 0));
}

#[test]
fn scoped_atomics_and_post_lists() {
    for api in [SendApi::Extended, SendApi::Legacy] {
        atomics_and_post_lists(api);
    }
}

fn atomics_and_post_lists(api: SendApi) {
    let mut p = pair_api(caps_sr(16, 1), api);
    let counter = p.pd.alloc_mr(8, all_remote()).unwrap();
    let remote = counter.remote();
    let mut results = p.pd.alloc_mr(8 * 9, AccessFlags::LOCAL_WRITE).unwrap();
    let all = Dst::new(&mut results).unwrap();
    let qp = &mut p.a;
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            let adds = (0..8u64)
                .map(|i| {
                    Ok(ScopedSend::fetch_add(
                        i,
                        all.slice(i as usize * 8, 8)?,
                        remote,
                        0,
                        1,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            q.post_send_list(adds)?;
            // 8 == 8: swapped to 100, and the old value (8) comes back.
            let cas = ScopedSend::compare_swap(8, all.slice(64, 8)?, remote, 0, 8, 100);
            q.post_send(&cas)?;
            scope_poll_n(s, 9)
        })
        .unwrap();
    for (i, c) in got.iter().enumerate() {
        let op = if i < 8 {
            WcOpcode::FetchAdd
        } else {
            WcOpcode::CompSwap
        };
        assert_eq!(summary(c), (i as u64, WcStatus::Success, op, 8));
    }
    let bytes = results.to_vec().unwrap();
    let olds: Vec<u64> = bytes
        .chunks(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(olds, [0, 1, 2, 3, 4, 5, 6, 7, 8]);
    let now = u64::from_ne_bytes(counter.to_vec().unwrap().try_into().unwrap());
    assert_eq!(now, 100);
}

#[test]
fn bad_scoped_requests_get_typed_errors() {
    let mut p = pair(caps_sr(4, 1));
    // Kept registered: a WRITE to a deregistered region fails (and always completes).
    let remote_mr = p.pd.alloc_mr(64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let mut read_only = p.pd.alloc_mr(64, AccessFlags::empty()).unwrap();
    assert!(matches!(
        Dst::new(&mut read_only),
        Err(Error::InvalidArgument { .. })
    ));
    let src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    let s_src = Src::new(&src).unwrap();
    assert!(matches!(
        s_src.slice(60, 8),
        Err(Error::InvalidArgument { .. })
    ));
    let mut wide = p.pd.alloc_mr(16, AccessFlags::LOCAL_WRITE).unwrap();
    let d_wide = Dst::new(&mut wide).unwrap();
    // A QP whose queues complete on another CQ cannot join the scope.
    let a = &mut p.a;
    let other = p.cq_b.scope(|s| s.attach(a).map(drop));
    assert!(
        matches!(other, Err(Error::InvalidArgument { .. })),
        "{other:?}"
    );
    let bad_rkey = rdma_verbs::mr::RemoteMr {
        rkey: remote.rkey ^ 0x5a5a,
        ..remote
    };
    let got = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(&mut p.a)?;
            let err = |r: Result<()>| r.expect_err("refused");
            assert!(matches!(
                err(q.post_send(&ScopedSend::write(1, s_src, remote, 8))),
                Error::RemoteOutOfBounds { .. }
            ));
            // In bounds of its length, past the top of the address space.
            let wraps = rdma_verbs::mr::RemoteMr {
                addr: u64::MAX - 3,
                len: 1 << 20,
                ..remote
            };
            assert!(matches!(
                err(q.post_send(&ScopedSend::write(1, s_src, wraps, 0))),
                Error::RemoteOutOfBounds { .. }
            ));
            assert!(matches!(
                err(q.post_send(&ScopedSend::read(1, d_wide, remote, 0).imm(1))),
                Error::InvalidArgument { .. }
            ));
            assert!(matches!(
                err(q.post_send(&ScopedSend::fetch_add(1, d_wide, remote, 0, 1))),
                Error::InvalidArgument { .. }
            ));
            let eight = d_wide.slice(0, 8)?;
            assert!(matches!(
                err(q.post_send(&ScopedSend::fetch_add(1, eight, remote, 4, 1))),
                Error::InvalidArgument { .. }
            ));
            // Four fit (the last one is signaled for the queue's sake);
            // the fifth does not.
            for i in 0..4 {
                q.post_send(&ScopedSend::write(i, s_src, remote, 0).signaled(false))?;
            }
            assert!(matches!(
                err(q.post_send(&ScopedSend::write(4, s_src, remote, 0))),
                Error::QueueFull { depth: 4, .. }
            ));
            assert_eq!(q.outstanding(), (4, 0));
            let first = scope_poll_n(s, 1)?;
            assert_eq!(
                summary(&first[0]),
                (3, WcStatus::Success, WcOpcode::RdmaWrite, 0)
            );
            assert_eq!(q.outstanding(), (0, 0));
            // A wrong rkey fails at the peer: an error completion naming the
            // operation.
            q.post_send(&ScopedSend::write(9, s_src, bad_rkey, 0))?;
            scope_poll_n(s, 1)
        })
        .unwrap();
    assert_eq!(
        (got[0].wr_id, got[0].status, got[0].opcode),
        (9, WcStatus::RemAccessErr, WcOpcode::RdmaWrite)
    );
    assert!(matches!(
        got[0].result(),
        Err(Error::WorkCompletion { wr_id: 9, .. })
    ));
}

/// A scope over a CQ with nothing attached returns at once.
/// `poll_n` takes exactly `n` (the rest wait for the next poll), `poll_one`
/// the next, and a timed poll with nothing outstanding ends in a timeout,
/// also for a count no vector can hold (it reserved the count up front:
/// a capacity-overflow panic, or an abort for 2^40).
#[test]
fn timed_scope_polls_take_exactly_what_they_ask_for() {
    let mut p = pair(caps_sr(8, 4));
    let remote_mr = p.pd.alloc_mr(64, all_remote()).unwrap();
    let remote = remote_mr.remote();
    let mut src = p.pd.alloc_mr(64, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &pattern(64, 9)).unwrap();
    let s_src = Src::new(&src).unwrap();
    let qp = &mut p.a;
    let (two, third, idle) = p
        .cq_a
        .scope(|s| {
            let mut q = s.attach(qp)?;
            for i in 0..3u64 {
                q.post_send(&ScopedSend::write(
                    10 + i,
                    s_src.slice(i as usize * 8, 8)?,
                    remote,
                    i * 8,
                ))?;
            }
            // All three complete before the first poll asks for two.
            std::thread::sleep(Duration::from_millis(200));
            let mut two = Vec::new();
            s.poll_n(&mut two, 2, Duration::from_secs(10))?;
            let third = s.poll_one(Duration::from_secs(10))?;
            let started = Instant::now();
            let idle = s.poll_one(Duration::from_millis(100));
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{:?}",
                started.elapsed()
            );
            for huge in [usize::MAX, 1 << 40] {
                let mut none = Vec::new();
                let r = s.poll_n(&mut none, huge, Duration::from_millis(10));
                assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            }
            Ok((two, third, idle))
        })
        .unwrap();
    for huge in [usize::MAX, 1 << 40] {
        let mut none = Vec::new();
        let r = p.cq_a.poll_n(&mut none, huge, Duration::from_millis(10));
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
    }
    let ids: Vec<_> = two.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(ids, [(10, WcStatus::Success), (11, WcStatus::Success)]);
    assert_eq!((third.wr_id, third.opcode), (12, WcOpcode::RdmaWrite));
    assert!(matches!(idle, Err(Error::Timeout { .. })), "{idle:?}");
    assert_eq!(remote_mr.to_vec().unwrap()[..24], pattern(64, 9)[..24]);
}

#[test]
fn an_empty_scope_returns_its_value() {
    let ctx = common::ctx();
    let mut cq = Cq::new(&ctx, 4).unwrap();
    assert_eq!(cq.scope(|_| Ok(42)).unwrap(), 42);
}
