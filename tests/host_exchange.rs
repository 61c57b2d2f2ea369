//! The out-of-band exchange over real TCP sockets on the loopback interface
//! (no RDMA device needed): both roles, byte-exact against what the C
//! `ibv_rc_pingpong` does on the wire, the extended form, retries, timeouts
//! and misbehaving peers.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use rdma_verbs::Error;
use rdma_verbs::exchange::{
    self, ENDPOINT_MSG_LEN, ExchangeListener, ExchangeStream, PeerInfo, client_exchange,
    server_exchange,
};
use rdma_verbs::mr::RemoteMr;
use rdma_verbs::qp::Endpoint;

const T: Duration = Duration::from_secs(10);

fn ep(qpn: u32) -> Endpoint {
    Endpoint {
        lid: 0,
        qpn,
        psn: 0x123456,
        gid: "::ffff:10.99.0.1".parse().unwrap(),
    }
}

fn listener() -> (ExchangeListener, u16) {
    let l = ExchangeListener::bind_addr("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = l.local_addr().unwrap().port();
    (l, port)
}

/// A port nobody listens on, below the ephemeral range: the other tests'
/// listeners (port 0) cannot be given it while this test leaves it free
/// (a port bound with 0 and released could be, and a client then reached
/// another test's server).
fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20_000 + (std::process::id() % 1000) as u16 * 8;
    for _ in 0..64 {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 8;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("ports {base}..{} are all taken", base + 8);
}

#[test]
fn client_and_server_exchange_endpoints_in_pingpong_order() {
    let (l, port) = listener();
    let connected = Arc::new(AtomicBool::new(false));
    let flag = connected.clone();
    let server = thread::spawn(move || {
        server_exchange(&l, &ep(0x22), Some(T), |remote: &Endpoint| {
            // The QP would be connected here, before the answer goes out.
            thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::SeqCst);
            Ok(remote.qpn)
        })
    });
    let remote = client_exchange("127.0.0.1", port, &ep(0x11), T).unwrap();
    assert!(
        connected.load(Ordering::SeqCst),
        "the answer came before before_reply finished"
    );
    assert_eq!(remote, ep(0x22));
    let (got, qpn) = server.join().unwrap().unwrap();
    assert_eq!(got, ep(0x11));
    assert_eq!(qpn, 0x11);
}

#[test]
fn server_side_is_byte_exact_with_a_c_client() {
    let (l, port) = listener();
    let server = thread::spawn(move || server_exchange(&l, &ep(0x22), Some(T), |_| Ok(())));
    // What ibv_rc_pingpong's pp_client_exch_dest does, call by call.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    let mine = b"0000:000011:123456:00000000000000000000ffff0a630001\0";
    assert_eq!(s.write(mine).unwrap(), ENDPOINT_MSG_LEN);
    let mut msg = [0u8; ENDPOINT_MSG_LEN];
    s.read_exact(&mut msg).unwrap();
    assert_eq!(
        &msg,
        b"0000:000022:123456:00000000000000000000ffff0a630001\0"
    );
    assert_eq!(s.write(b"done\0").unwrap(), 5);
    drop(s);
    let (got, ()) = server.join().unwrap().unwrap();
    assert_eq!(got, ep(0x11));
}

#[test]
fn client_side_is_byte_exact_with_a_c_server() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    // What pp_server_exch_dest does: one read of sizeof msg, one write, one read of "done".
    let server = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        c.set_read_timeout(Some(T)).unwrap();
        let mut msg = [0u8; ENDPOINT_MSG_LEN];
        let n = c.read(&mut msg).unwrap();
        assert_eq!(n, ENDPOINT_MSG_LEN, "the client's message came in pieces");
        c.write_all(b"0000:000022:123456:00000000000000000000ffff0a630001\0")
            .unwrap();
        let mut done = [0u8; ENDPOINT_MSG_LEN];
        let n = c.read(&mut done).unwrap();
        (msg, done[..n].to_vec())
    });
    let remote = client_exchange("127.0.0.1", port, &ep(0x11), T).unwrap();
    assert_eq!(remote, ep(0x22));
    let (msg, done) = server.join().unwrap();
    assert_eq!(
        &msg,
        b"0000:000011:123456:00000000000000000000ffff0a630001\0"
    );
    assert_eq!(done, b"done\0");
}

#[test]
fn extended_form_carries_memory_regions() {
    let (l, port) = listener();
    let mr = |i: u64| RemoteMr {
        addr: 0x7f00_0000_0000 + i * 4096,
        len: 4096,
        rkey: i as u32 + 1,
    };
    let server_info = PeerInfo::new(ep(0x22)).with_mr(mr(1)).with_mr(mr(2));
    let client_info = PeerInfo {
        endpoint: ep(0x11),
        mrs: (0..exchange::MAX_REMOTE_MRS as u64).map(mr).collect(),
    };
    let si = server_info.clone();
    let server = thread::spawn(move || server_exchange(&l, &si, Some(T), |_| Ok(())));
    let got = client_exchange("127.0.0.1", port, &client_info, T).unwrap();
    assert_eq!(got, server_info);
    let (theirs, ()) = server.join().unwrap().unwrap();
    assert_eq!(theirs, client_info);
}

#[test]
fn client_retries_until_the_server_listens() {
    let port = free_port();
    let server = thread::spawn(move || {
        thread::sleep(Duration::from_millis(400));
        let l = ExchangeListener::bind_addr(SocketAddr::from(([127, 0, 0, 1], port))).unwrap();
        server_exchange(&l, &ep(0x22), Some(T), |_| Ok(()))
    });
    let t = Instant::now();
    let remote = client_exchange("127.0.0.1", port, &ep(0x11), T).unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert_eq!(remote, ep(0x22));
    server.join().unwrap().unwrap();
}

#[test]
fn client_gives_up_after_its_timeout() {
    let port = free_port();
    let t = Instant::now();
    let e = ExchangeStream::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(5),
        "{took:?}"
    );
    match &e {
        Error::Io { what, source } => {
            assert!(what.contains("connecting"), "{e}");
            assert!(
                source.to_string().contains(&format!("127.0.0.1:{port}")),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
    // An unresolvable name fails the same way, within the timeout.
    let e = ExchangeStream::connect("no-such-host.invalid", 1, Duration::from_millis(200));
    assert!(matches!(e, Err(Error::Io { .. })), "{e:?}");
}

#[test]
fn accept_times_out() {
    let (l, _) = listener();
    let t = Instant::now();
    let e = l.accept(Some(Duration::from_millis(200))).unwrap_err();
    assert!(t.elapsed() >= Duration::from_millis(200));
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
}

/// A zero accept timeout still bounds the connection's messages (it used to
/// leave them without a limit: a silent client held the server forever), and
/// a zero message limit is refused rather than taken for none.
#[test]
fn a_zero_timeout_never_means_no_limit() {
    let (l, port) = listener();
    let _client = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let t = Instant::now();
    let mut s = loop {
        match l.accept(Some(Duration::ZERO)) {
            Ok(s) => break s,
            Err(Error::Timeout { .. }) if t.elapsed() < T => thread::yield_now(),
            Err(e) => panic!("{e:?}"),
        }
    };
    assert_eq!(s.timeout(), Some(exchange::PEER_MESSAGE_TIMEOUT));
    let e = s.set_timeout(Some(Duration::ZERO)).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
    assert_eq!(s.timeout(), Some(exchange::PEER_MESSAGE_TIMEOUT));
    s.set_timeout(None).unwrap();
    assert_eq!(s.timeout(), None);
}

/// Runs a server exchange against a raw peer that does `peer`; returns the server's result.
fn against(peer: impl FnOnce(TcpStream) + Send + 'static) -> Result<Endpoint, Error> {
    let (l, port) = listener();
    let p = thread::spawn(move || peer(TcpStream::connect(("127.0.0.1", port)).unwrap()));
    let r = server_exchange(&l, &ep(0x22), Some(Duration::from_millis(500)), |_| Ok(()));
    p.join().unwrap();
    r.map(|(e, ())| e)
}

#[test]
fn misbehaving_peers_get_errors_not_panics_or_hangs() {
    // Truncated: 30 bytes, then close.
    let e = against(|mut s| s.write_all(&[b'0'; 30]).unwrap()).unwrap_err();
    assert!(
        matches!(&e, Error::Protocol(m) if m.contains("after 30 of 52")),
        "{e:?}"
    );
    // Garbage of the right size.
    let e = against(|mut s| s.write_all(&[0xff; 52]).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
    // Silent peer: the read limit fires.
    let e = against(|s| {
        thread::sleep(Duration::from_millis(900));
        drop(s)
    })
    .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    // Good message, then something else than "done".
    let e = against(|mut s| {
        s.write_all(&exchange::encode_endpoint(&ep(1)).unwrap())
            .unwrap();
        let mut m = [0u8; 52];
        s.read_exact(&mut m).unwrap();
        s.write_all(b"nope!").unwrap();
    })
    .unwrap_err();
    assert!(
        matches!(&e, Error::Protocol(m) if m.contains("done")),
        "{e:?}"
    );
    // Good message, then a close without "done": the peer went away.
    let e = against(|mut s| {
        s.write_all(&exchange::encode_endpoint(&ep(1)).unwrap())
            .unwrap();
        let mut m = [0u8; 52];
        s.read_exact(&mut m).unwrap();
    })
    .unwrap_err();
    assert!(matches!(e, Error::PeerClosed { .. }), "{e:?}");
    // Oversized: a message far longer than 52 bytes is cut at 52 and refused.
    let e = against(|mut s| {
        let _ = s.write_all(&[b'1'; 4096]);
    })
    .unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

#[test]
fn extended_client_against_plain_server_fails_cleanly() {
    let (l, port) = listener();
    let server = thread::spawn(move || {
        server_exchange(&l, &ep(0x22), Some(Duration::from_secs(2)), |_| Ok(()))
    });
    let info = PeerInfo::new(ep(0x11)).with_mr(RemoteMr {
        addr: 0x1000,
        len: 64,
        rkey: 9,
    });
    let t = Instant::now();
    let e = client_exchange("127.0.0.1", port, &info, Duration::from_secs(2)).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            e,
            Error::Protocol(_) | Error::Io { .. } | Error::Timeout { .. }
        ),
        "{e:?}"
    );
    // The plain server read the xmr1 header where it expected "done".
    let se = server.join().unwrap().unwrap_err();
    assert!(matches!(se, Error::Protocol(_)), "{se:?}");
}

#[test]
fn bind_default_all_addresses() {
    // Port 0: any free port on 0.0.0.0, as ibv_rc_pingpong binds.
    let l = ExchangeListener::bind(0).unwrap();
    let a = l.local_addr().unwrap();
    assert!(a.ip().is_unspecified(), "{a}");
}

#[test]
fn peer_closed_tells_a_closed_or_dead_peer_from_a_live_one() {
    let (l, port) = listener();
    let t = thread::spawn(move || {
        let s = ExchangeStream::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        // Unread data from a live peer: still open.
        let mut raw = s.into_inner();
        raw.write_all(b"x").unwrap();
        thread::sleep(Duration::from_millis(300));
        // Then the peer goes away (as a killed process's socket does).
        drop(raw);
    });
    let s = l.accept(Some(Duration::from_secs(5))).unwrap();
    assert!(!s.peer_closed().unwrap(), "a connected peer is not closed");
    t.join().unwrap();
    // The unread byte does not hide the close forever: once it is consumed, EOF shows.
    let mut raw = s.into_inner();
    let mut b = [0u8; 1];
    raw.read_exact(&mut b).unwrap();
    let s = ExchangeStream::from_tcp(raw).unwrap();
    assert!(s.peer_closed().unwrap(), "the peer's close is seen at once");
    // Checking does not block and can be repeated.
    assert!(s.peer_closed().unwrap());
}

/// The time limit holds for a whole message, not each read: a peer that
/// sends a valid message a byte at a time is cut off at the limit (each
/// byte arrived well within it, and the message took 13 s).
#[test]
fn a_trickling_peer_is_cut_off_at_the_message_limit() {
    let start = Instant::now();
    let e = against(|mut s| {
        for b in exchange::encode_endpoint(&ep(1)).unwrap() {
            if s.write_all(&[b]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(250));
        }
    })
    .unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    // 500 ms limit; the peer's thread ends at its next failed write.
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

/// `peer_closed` from two threads at once never waits (it switched the
/// shared socket to non-blocking and back, so one call could peek in
/// blocking mode and wait for data).
#[test]
fn peer_closed_from_two_threads_does_not_block() {
    let (l, port) = listener();
    let client = thread::spawn(move || {
        let s = ExchangeStream::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        thread::sleep(Duration::from_secs(3));
        drop(s);
    });
    let mut s = l.accept(Some(Duration::from_secs(5))).unwrap();
    s.set_timeout(None).unwrap();
    let s = Arc::new(s);
    let stop = Instant::now() + Duration::from_millis(1500);
    let checkers: Vec<_> = (0..2)
        .map(|_| {
            let s = Arc::clone(&s);
            thread::spawn(move || {
                let mut calls = 0u64;
                while Instant::now() < stop {
                    assert!(!s.peer_closed().unwrap(), "the peer is alive");
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    for c in checkers {
        // A blocked call would still be waiting when the peer closes (3 s).
        let calls = c.join().unwrap();
        assert!(calls > 0);
    }
    assert!(
        Instant::now() < stop + Duration::from_millis(1000),
        "a check blocked"
    );
    client.join().unwrap();
}

/// A `Read` that claims one byte more than the buffer it was given (a
/// broken wrapper, not a peer): the readers return, they do not panic.
#[test]
fn a_reader_claiming_more_than_it_was_given_gets_no_panic() {
    struct Liar(u8);
    impl Read for Liar {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            buf.fill(self.0);
            Ok(buf.len() + 1)
        }
    }
    let e = exchange::read_done(&mut Liar(b'x')).unwrap_err();
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

/// The server side of a plain (`Endpoint`) exchange on an accepted connection.
fn answer(conn: &mut ExchangeStream, qpn: u32) -> Result<Endpoint, Error> {
    let remote: Endpoint = conn.recv()?;
    conn.send(&ep(qpn))?;
    conn.recv_done()?;
    Ok(remote)
}

/// Eight clients connecting at once are served at once: every handler runs
/// while all eight are in progress (served one after another, the first
/// would wait for the others in vain and report it), and each client gets
/// its own answer.
#[test]
fn serve_each_serves_clients_concurrently() {
    const N: usize = 8;
    let (l, port) = listener();
    let clients: Vec<_> = (0..N as u32)
        .map(|i| thread::spawn(move || client_exchange("127.0.0.1", port, &ep(0x100 + i), T)))
        .collect();
    let running = AtomicU16::new(0);
    let served = l.serve_each(N, Some(T), |i, mut conn| {
        running.fetch_add(1, Ordering::SeqCst);
        let start = Instant::now();
        while usize::from(running.load(Ordering::SeqCst)) < N && start.elapsed() < T {
            thread::sleep(Duration::from_millis(5));
        }
        let together = usize::from(running.load(Ordering::SeqCst)) == N;
        let remote = answer(&mut conn, 0x200 + i as u32)?;
        Ok((together, remote.qpn))
    });
    assert_eq!(served.len(), N);
    let mut qpns = Vec::new();
    for r in served {
        let (together, qpn) = r.unwrap();
        assert!(together, "a handler ran while not all eight were running");
        qpns.push(qpn);
    }
    qpns.sort_unstable();
    assert_eq!(qpns, (0x100..0x100 + N as u32).collect::<Vec<_>>());
    let mut answers: Vec<u32> = clients
        .into_iter()
        .map(|c| c.join().unwrap().unwrap().qpn)
        .collect();
    answers.sort_unstable();
    assert_eq!(answers, (0x200..0x200 + N as u32).collect::<Vec<_>>());
}

/// A client that connects first and then says nothing fails its own
/// exchange at the message limit; the clients after it are answered at
/// once, not after it.
#[test]
fn a_stalled_client_does_not_hold_up_the_others() {
    let limit = Duration::from_millis(1500);
    let (l, port) = listener();
    let stalled = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let server = thread::spawn(move || {
        l.serve_each(4, Some(limit), |i, mut conn| {
            answer(&mut conn, 0x300 + i as u32)
        })
    });
    // Let the stalled client be accepted first.
    thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    let clients: Vec<_> = (0..3)
        .map(|i| {
            thread::spawn(move || {
                let r = client_exchange("127.0.0.1", port, &ep(0x10 + i), T);
                (r, start.elapsed())
            })
        })
        .collect();
    for c in clients {
        let (r, took) = c.join().unwrap();
        assert!(r.is_ok(), "{r:?}");
        assert!(
            took < limit / 2,
            "a client waited {took:?} behind the stalled one"
        );
    }
    let served = server.join().unwrap();
    assert_eq!(served.len(), 4);
    assert!(
        matches!(served[0], Err(Error::Timeout { .. })),
        "{:?}",
        served[0]
    );
    assert!(served[1..].iter().all(|r| r.is_ok()), "{served:?}");
    drop(stalled);
}

/// A client that never comes stops the accepting after `timeout`: the
/// clients served before it are returned, then the timeout.
#[test]
fn serve_each_returns_the_served_and_the_error_that_stopped_it() {
    let (l, port) = listener();
    let client = thread::spawn(move || client_exchange("127.0.0.1", port, &ep(1), T));
    let t = Instant::now();
    let served = l.serve_each(3, Some(Duration::from_millis(300)), |_, mut conn| {
        answer(&mut conn, 2)
    });
    assert!(t.elapsed() < T);
    assert_eq!(client.join().unwrap().unwrap().qpn, 2);
    assert_eq!(served.len(), 2, "{served:?}");
    assert_eq!(served[0].as_ref().unwrap().qpn, 1);
    assert!(
        matches!(served[1], Err(Error::Timeout { .. })),
        "{:?}",
        served[1]
    );
}

/// `incoming` hands out each client as it connects, to be served on a
/// thread of its own.
#[test]
fn incoming_hands_out_each_client() {
    let (l, port) = listener();
    let clients: Vec<_> = (0..3)
        .map(|i| thread::spawn(move || client_exchange("127.0.0.1", port, &ep(0x40 + i), T)))
        .collect();
    let servers: Vec<_> = l
        .incoming()
        .take(3)
        .map(|conn| {
            let mut conn = conn.unwrap();
            assert_eq!(conn.timeout(), Some(exchange::PEER_MESSAGE_TIMEOUT));
            thread::spawn(move || answer(&mut conn, 0x50).map(|e| e.qpn))
        })
        .collect();
    let mut got: Vec<u32> = servers
        .into_iter()
        .map(|s| s.join().unwrap().unwrap())
        .collect();
    got.sort_unstable();
    assert_eq!(got, [0x40, 0x41, 0x42]);
    for c in clients {
        assert_eq!(c.join().unwrap().unwrap().qpn, 0x50);
    }
}

/// Two ends of one connection: (accepted, connected).
fn connected_pair() -> (ExchangeStream, ExchangeStream) {
    let (l, port) = listener();
    let client = thread::spawn(move || ExchangeStream::connect("127.0.0.1", port, T).unwrap());
    let server = l.accept(Some(T)).unwrap();
    (server, client.join().unwrap())
}

/// The barrier returns on each side only once the other side reached it;
/// `ready` sent early is waited for later.
#[test]
fn the_barrier_waits_for_the_peer() {
    let (mut a, mut b) = connected_pair();
    let late = Duration::from_millis(300);
    let peer = thread::spawn(move || {
        thread::sleep(late);
        b.barrier().unwrap();
        b.ready().unwrap();
        b
    });
    let t = Instant::now();
    a.barrier().unwrap();
    assert!(t.elapsed() >= late, "returned after {:?}", t.elapsed());
    let mut b = peer.join().unwrap();
    a.wait_ready().unwrap();
    // Nothing left over on either side.
    a.set_timeout(Some(Duration::from_millis(100))).unwrap();
    b.set_timeout(Some(Duration::from_millis(100))).unwrap();
    assert!(matches!(a.wait_ready(), Err(Error::Timeout { .. })));
    assert!(matches!(b.wait_ready(), Err(Error::Timeout { .. })));
}

/// A peer that vanishes, stays silent or sends something else gets a typed
/// error, within the stream's time limit.
#[test]
fn the_barrier_reports_a_vanished_silent_or_confused_peer() {
    // Closed (a process exiting or killed closes its sockets).
    let (mut a, b) = connected_pair();
    let t = Instant::now();
    let closer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(100));
        drop(b);
    });
    let e = a.barrier().unwrap_err();
    closer.join().unwrap();
    assert!(
        matches!(
            e,
            Error::PeerClosed {
                waiting_for: "its ready signal"
            }
        ),
        "{e:?}"
    );
    assert!(t.elapsed() < T);
    // Silent: the stream's limit.
    let (mut a, _b) = connected_pair();
    a.set_timeout(Some(Duration::from_millis(200))).unwrap();
    let t = Instant::now();
    let e = a.wait_ready().unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < T);
    // Something else, then closed.
    let (mut a, b) = connected_pair();
    let mut raw = b.into_inner();
    raw.write_all(b"done\0").unwrap();
    drop(raw);
    let e = a.wait_ready().unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ref m) if m.contains("done")),
        "{e:?}"
    );
    // Half a signal, then closed.
    let (mut a, b) = connected_pair();
    let mut raw = b.into_inner();
    raw.write_all(b"rea").unwrap();
    drop(raw);
    let e = a.wait_ready().unwrap_err();
    assert!(
        matches!(e, Error::Protocol(ref m) if m.contains("closed")),
        "{e:?}"
    );
}

/// The async listener on a single-threaded runtime: tasks accept at once,
/// their barriers are awaited without holding the runtime's one thread (a
/// stalled client fails its own task at the message limit while the others
/// finish at once), a peer that closes is `PeerClosed`, and an accept with
/// no client times out.
#[cfg(feature = "tokio")]
#[test]
fn async_accept_and_barrier_hold_no_task_up() {
    use rdma_verbs::tokio::exchange as aexchange;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let blocking = ExchangeListener::bind_addr("127.0.0.1:0".parse().unwrap()).unwrap();
        let l = Arc::new(aexchange::ExchangeListener::from_blocking(blocking).unwrap());
        let port = l.local_addr().unwrap().port();
        let limit = Duration::from_millis(1500);
        let t = Instant::now();
        let e = l
            .accept(Some(Duration::from_millis(200)))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        assert!(t.elapsed() >= Duration::from_millis(200));
        // Zero: only a client already waiting.
        let e = l.accept(Some(Duration::ZERO)).await.unwrap_err();
        assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
        let waiting = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let t = Instant::now();
        let conn = loop {
            match l.accept(Some(Duration::ZERO)).await {
                Ok(conn) => break conn,
                Err(Error::Timeout { .. }) if t.elapsed() < T => tokio::task::yield_now().await,
                Err(e) => panic!("{e:?}"),
            }
        };
        assert_eq!(conn.timeout(), Some(exchange::PEER_MESSAGE_TIMEOUT));
        drop((conn, waiting));
        // Four tasks waiting for a client each, then the clients: one stalls.
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                tokio::spawn(async move {
                    let conn = l.accept(Some(limit)).await?;
                    let start = Instant::now();
                    aexchange::barrier(conn).await.map(|_| start.elapsed())
                })
            })
            .collect();
        let stalled = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let clients: Vec<_> = (0..3)
            .map(|_| {
                thread::spawn(move || {
                    let start = Instant::now();
                    let mut c = ExchangeStream::connect("127.0.0.1", port, T).unwrap();
                    c.barrier().map(|()| start.elapsed())
                })
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await.unwrap());
        }
        for c in clients {
            let took = c.join().unwrap().unwrap();
            assert!(
                took < limit / 2,
                "a client waited {took:?} behind the stalled one"
            );
        }
        let (ok, err): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.is_ok());
        assert_eq!((ok.len(), err.len()), (3, 1), "{ok:?} {err:?}");
        for took in ok {
            assert!(
                took.unwrap() < limit / 2,
                "a barrier waited behind the stalled client"
            );
        }
        assert!(matches!(err[0], Err(Error::Timeout { .. })), "{err:?}");
        drop(stalled);
        // A peer that closes instead of signalling.
        let closer = thread::spawn(move || drop(TcpStream::connect(("127.0.0.1", port)).unwrap()));
        let conn = l.accept(Some(T)).await.unwrap();
        closer.join().unwrap();
        let e = aexchange::wait_ready(conn).await.unwrap_err();
        assert!(matches!(e, Error::PeerClosed { .. }), "{e:?}");
    });
}

/// `serve_each`'s count is how many clients to serve at most: a huge one
/// allocates nothing up front and ends, like any other, at the first accept
/// that fails.
#[test]
fn serve_each_takes_a_huge_count_as_a_bound() {
    let (l, port) = listener();
    let client = thread::spawn(move || client_exchange("127.0.0.1", port, &ep(0x300), T));
    let served = l.serve_each(
        usize::MAX,
        Some(Duration::from_millis(500)),
        |i, mut conn| answer(&mut conn, 0x400 + i as u32).map(|r| r.qpn),
    );
    assert_eq!(served.len(), 2, "{served:?}");
    assert_eq!(*served[0].as_ref().unwrap(), 0x300);
    assert!(
        matches!(served[1], Err(Error::Timeout { .. })),
        "{served:?}"
    );
    assert_eq!(client.join().unwrap().unwrap().qpn, 0x400);
}

/// An async exchange step polled by an executor other than tokio's (no
/// runtime on the thread) is a typed error, not tokio's panic.
#[cfg(feature = "tokio")]
#[test]
fn an_async_step_outside_a_tokio_runtime_is_an_error() {
    use rdma_verbs::tokio::exchange as aexchange;
    use std::task::{Context, Poll, Waker};
    let (a, _b) = connected_pair();
    let mut step = std::pin::pin!(aexchange::barrier(a));
    let polled = step.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    let Poll::Ready(Err(e)) = polled else {
        panic!("ready with an error at the first poll")
    };
    assert!(
        matches!(e, Error::InvalidArgument { ref reason, .. } if reason.contains("outside a tokio runtime")),
        "{e:?}"
    );
}
