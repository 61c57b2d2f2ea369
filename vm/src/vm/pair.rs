//! Two guests on a virtual wire ([`run_pair`]).

use std::net::UdpSocket;
use std::thread;
use std::time::{Duration, Instant};

use super::{BOOT_ATTEMPTS, Failure, Guest, Output, Topology, boot_timeout, start};
use crate::cmd::Waited;
use crate::run::Invocation;
use crate::setup::VmAssets;
use crate::{Context, Error, Result};

/// Two free UDP ports on 127.0.0.1 (bound and released: another process could take one in
/// between, which makes QEMU fail to start and the run report a boot failure).
fn free_udp_ports() -> Result<[u16; 2]> {
    let a = UdpSocket::bind("127.0.0.1:0").context(|| "cannot bind a UDP port".into())?;
    let b = UdpSocket::bind("127.0.0.1:0").context(|| "cannot bind a UDP port".into())?;
    let port = |s: &UdpSocket| {
        s.local_addr()
            .map(|a| a.port())
            .context(|| "cannot read a bound UDP port".into())
    };
    Ok([port(&a)?, port(&b)?])
}

/// The outcome of one guest run: its command's exit status, or why there is none.
type Outcome = std::result::Result<u8, (Failure, Error)>;

/// Boots two guests joined by a virtual wire ([`Topology::Wire`], node 1 runs `invs[0]`,
/// node 2 `invs[1]`), streams their output with `[node1] ` / `[node2] ` prefixes, and returns
/// each node's outcome. Both guests are killed when `timeout` passes. When either guest is
/// stuck before its command, both are killed and booted again, once.
pub fn run_pair(assets: &VmAssets, invs: [&Invocation; 2], timeout: Duration) -> [Outcome; 2] {
    let boot = match boot_timeout() {
        Ok(b) => b,
        Err(e) => {
            let again = Error::usage(e.message.clone());
            return [Err((Failure::Boot, e)), Err((Failure::Boot, again))];
        }
    };
    let mut attempt = 1;
    loop {
        match run_pair_once(assets, invs, timeout, boot, attempt < BOOT_ATTEMPTS) {
            Some(outcomes) => return outcomes,
            None => {
                eprintln!("rdma-verbs-vm: booting both guests again");
                attempt += 1;
            }
        }
    }
}

/// A guest of the pair: started, or why it could not start.
type Started = std::result::Result<Option<Guest>, (Failure, Error)>;

/// One try of [`run_pair`]; `None` when a guest was stuck before its command and `retry`
/// allows another try (both guests are killed then).
fn run_pair_once(
    assets: &VmAssets,
    invs: [&Invocation; 2],
    timeout: Duration,
    boot: Duration,
    retry: bool,
) -> Option<[Outcome; 2]> {
    let ports = match free_udp_ports() {
        Ok(p) => p,
        Err(e) => {
            let again = Error::new(e.message.clone());
            return Some([Err((Failure::Boot, e)), Err((Failure::Boot, again))]);
        }
    };
    let topology = |node: u8| Topology::Wire {
        node,
        local_port: ports[usize::from(node - 1)],
        peer_port: ports[usize::from(2 - node)],
    };
    let started_at = Instant::now();
    let mut guests: [Started; 2] = [1u8, 2].map(|node| {
        start(
            assets,
            invs[usize::from(node - 1)],
            topology(node),
            Output::Prefixed(format!("[node{node}] ")),
        )
        .map(Some)
    });
    let (waited, stuck) = watch(&mut guests, started_at + timeout, started_at + boot);
    let [first, second] = outcomes(guests, waited, stuck, timeout, boot);
    if stuck && retry {
        for (node, outcome) in [(1, &first), (2, &second)] {
            if let Err((_, e)) = outcome {
                eprintln!("rdma-verbs-vm: node{node}: {}", e.message);
            }
        }
        return None;
    }
    Some([first, second])
}

/// Waits until both guests have exited, killing those still running at `deadline`, or
/// until one is still before its command at `boot_deadline` (then `stuck` is true). Returns
/// how each guest ended (`None`: still running) and `stuck`.
fn watch(
    guests: &mut [Started; 2],
    deadline: Instant,
    boot_deadline: Instant,
) -> ([Option<Waited>; 2], bool) {
    let mut waited: [Option<Waited>; 2] = [None, None];
    let mut stuck = false;
    loop {
        let mut running = false;
        for (guest, w) in guests.iter_mut().zip(waited.iter_mut()) {
            let Ok(Some(g)) = guest else { continue };
            if w.is_some() {
                continue;
            }
            match g.child.try_wait() {
                Ok(Some(status)) => *w = Some(Waited::Exited(status)),
                Ok(None) if Instant::now() >= deadline => {
                    let _ = g.child.kill();
                    let _ = g.child.wait();
                    *w = Some(Waited::TimedOut);
                }
                Ok(None) => {
                    running = true;
                    stuck |= Instant::now() >= boot_deadline && !g.started();
                }
                Err(_) => {
                    let _ = g.child.kill();
                    *w = g.child.wait().ok().map(Waited::Exited);
                    if w.is_none() {
                        *w = Some(Waited::TimedOut);
                    }
                }
            }
        }
        if !running || stuck {
            return (waited, stuck);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Each node's outcome once [`watch`] returned.
fn outcomes(
    guests: [Started; 2],
    waited: [Option<Waited>; 2],
    stuck: bool,
    timeout: Duration,
    boot: Duration,
) -> [Outcome; 2] {
    let mut outcomes = guests
        .into_iter()
        .zip(waited)
        .enumerate()
        .map(|(i, (guest, w))| {
            let node = i + 1;
            match guest {
                Err(e) => Err(e),
                Ok(None) => Err((Failure::Boot, Error::new("guest not started"))),
                Ok(Some(g)) if stuck && !g.started() => Err((Failure::Boot, g.abandon(boot))),
                Ok(Some(mut g)) if stuck && w.is_none() => {
                    g.stop();
                    Err((
                        Failure::Boot,
                        Error::new(format!(
                            "node{node} was killed: the other guest did not start its command"
                        )),
                    ))
                }
                Ok(Some(g)) => g.finish(w.unwrap_or(Waited::TimedOut), timeout),
            }
        });
    [0, 1].map(|_| {
        outcomes
            .next()
            .unwrap_or_else(|| Err((Failure::Boot, Error::new("node missing"))))
    })
}
