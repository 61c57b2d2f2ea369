//! Two to four guests on one network ([`run_nodes`]): two on a virtual wire, three or four
//! on a virtual switch.

use std::net::UdpSocket;
use std::thread;
use std::time::{Duration, Instant};

use super::switch::Switch;
use super::{BOOT_ATTEMPTS, Failure, Guest, Output, Topology, boot_timeout, start};
use crate::cmd::Waited;
use crate::run::Invocation;
use crate::setup::VmAssets;
use crate::{Context, Error, Result};

/// The most guests [`run_nodes`] boots.
pub const MAX_NODES: usize = 4;

/// `n` UDP ports on 127.0.0.1, held by their sockets until the caller drops them (then
/// another process could take one before QEMU binds it, which makes QEMU fail to start and
/// the run report a boot failure).
fn reserve_udp_ports(n: usize) -> Result<(Vec<UdpSocket>, Vec<u16>)> {
    let sockets = (0..n)
        .map(|_| UdpSocket::bind("127.0.0.1:0").context(|| "cannot bind a UDP port".into()))
        .collect::<Result<Vec<_>>>()?;
    let ports = sockets
        .iter()
        .map(|s| {
            s.local_addr()
                .map(|a| a.port())
                .context(|| "cannot read a bound UDP port".into())
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((sockets, ports))
}

/// The outcome of one guest run: its command's exit status, or why there is none.
pub type Outcome = std::result::Result<u8, (Failure, Error)>;

/// The same failure for every one of `n` nodes.
fn all_failed(n: usize, failure: Failure, e: &Error) -> Vec<Outcome> {
    (0..n)
        .map(|_| {
            Err((
                failure,
                Error {
                    message: e.message.clone(),
                    code: e.code,
                },
            ))
        })
        .collect()
}

/// Boots two guests joined by a virtual wire (node 1 runs `invs[0]`, node 2 `invs[1]`);
/// [`run_nodes`] with two nodes.
pub fn run_pair(assets: &VmAssets, invs: [&Invocation; 2], timeout: Duration) -> [Outcome; 2] {
    let mut outcomes = run_nodes(assets, &invs, timeout).into_iter();
    [0, 1].map(|_| {
        outcomes
            .next()
            .unwrap_or_else(|| Err((Failure::Boot, Error::new("node missing"))))
    })
}

/// Boots one guest per entry of `invs` (2 to [`MAX_NODES`]; node K runs `invs[K-1]`) and
/// returns each node's outcome. Two guests are joined by a virtual wire
/// ([`Topology::Wire`]), three or four by a virtual switch in this process
/// ([`Topology::Switch`]). Their output streams with `[nodeK] ` prefixes. Every guest is
/// killed when `timeout` passes. When any guest is stuck before its command, all are killed
/// and booted again, once.
pub fn run_nodes(assets: &VmAssets, invs: &[&Invocation], timeout: Duration) -> Vec<Outcome> {
    if !(2..=MAX_NODES).contains(&invs.len()) {
        let e = Error::usage(format!("2 to {MAX_NODES} nodes, not {}", invs.len()));
        return all_failed(invs.len(), Failure::Boot, &e);
    }
    let boot = match boot_timeout() {
        Ok(b) => b,
        Err(e) => return all_failed(invs.len(), Failure::Boot, &e),
    };
    let mut attempt = 1;
    loop {
        match run_nodes_once(assets, invs, timeout, boot, attempt < BOOT_ATTEMPTS) {
            Some(outcomes) => return outcomes,
            None => {
                eprintln!("rdma-verbs-vm: booting all {} guests again", invs.len());
                attempt += 1;
            }
        }
    }
}

/// A guest of the set: started, or why it could not start.
type Started = std::result::Result<Option<Guest>, (Failure, Error)>;

/// The topology of each node (node K at index K-1), and the switch that joins them when
/// there are more than two.
fn wiring(n: usize) -> Result<(Vec<Topology>, Option<Switch>)> {
    // The guests' ports stay reserved while the switch binds its own, so that none of the
    // switch's ports is one a guest is about to bind.
    let (reserved, ports) = reserve_udp_ports(n)?;
    if n == 2 {
        let wire = |node: u8| Topology::Wire {
            node,
            local_port: ports[usize::from(node - 1)],
            peer_port: ports[usize::from(2 - node)],
        };
        return Ok((vec![wire(1), wire(2)], None));
    }
    let (switch, switch_ports) = Switch::start(&ports)?;
    drop(reserved);
    let topologies = (0..n)
        .map(|i| Topology::Switch {
            node: i as u8 + 1,
            nodes: n as u8,
            local_port: ports[i],
            switch_port: switch_ports[i],
        })
        .collect();
    Ok((topologies, Some(switch)))
}

/// One try of [`run_nodes`]; `None` when a guest was stuck before its command and `retry`
/// allows another try (all guests are killed then).
fn run_nodes_once(
    assets: &VmAssets,
    invs: &[&Invocation],
    timeout: Duration,
    boot: Duration,
    retry: bool,
) -> Option<Vec<Outcome>> {
    let (topologies, switch) = match wiring(invs.len()) {
        Ok(w) => w,
        Err(e) => return Some(all_failed(invs.len(), Failure::Boot, &e)),
    };
    let started_at = Instant::now();
    let mut guests: Vec<Started> = topologies
        .iter()
        .zip(invs)
        .enumerate()
        .map(|(i, (&topology, inv))| {
            let prefix = format!("[node{}] ", i + 1);
            start(assets, inv, topology, Output::Prefixed(prefix)).map(Some)
        })
        .collect();
    let (waited, stuck) = watch(&mut guests, started_at + timeout, started_at + boot);
    let outcomes = outcomes(guests, waited, stuck, timeout, boot);
    // Every guest has exited: the switch has nobody left to relay for.
    drop(switch);
    if stuck && retry {
        for (i, outcome) in outcomes.iter().enumerate() {
            if let Err((_, e)) = outcome {
                eprintln!("rdma-verbs-vm: node{}: {}", i + 1, e.message);
            }
        }
        return None;
    }
    Some(outcomes)
}

/// Waits until every guest has exited, killing those still running at `deadline`, or
/// until one is still before its command at `boot_deadline` (then `stuck` is true). Returns
/// how each guest ended (`None`: still running) and `stuck`.
fn watch(
    guests: &mut [Started],
    deadline: Instant,
    boot_deadline: Instant,
) -> (Vec<Option<Waited>>, bool) {
    let mut waited: Vec<Option<Waited>> = guests.iter().map(|_| None).collect();
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
    guests: Vec<Started>,
    waited: Vec<Option<Waited>>,
    stuck: bool,
    timeout: Duration,
    boot: Duration,
) -> Vec<Outcome> {
    guests
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
                            "node{node} was killed: another guest did not start its command"
                        )),
                    ))
                }
                Ok(Some(g)) => g.finish(w.unwrap_or(Waited::TimedOut), timeout),
            }
        })
        .collect()
}
