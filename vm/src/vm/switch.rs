//! The virtual switch of 3 or 4 guests ([`Switch`]): a learning Ethernet switch in the
//! runner process, on UDP sockets on 127.0.0.1.
//!
//! Each guest's QEMU sends every frame its NIC transmits as one UDP datagram to the
//! guest's own port of the switch and receives frames on its own port (QEMU's socket
//! netdev, `udp=SWITCH_PORT,localaddr=GUEST_PORT`). One thread per switch port relays
//! the frames: to every other port for broadcast and multicast destinations (ARP, IPv6
//! neighbour discovery, RoCE multicast groups) and for unicast destinations not seen yet,
//! else to the port the destination MAC was last seen on. Frames are relayed as they are,
//! so what the guests do to their own links (`ip link set eth0 down`, `tc ... netem`) acts
//! as on the two-guest wire.

use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use crate::{Context, Result};

/// How long a port's thread blocks in `recv` before it checks whether to stop: the bound
/// on how long dropping the [`Switch`] takes.
const STOP_POLL: Duration = Duration::from_millis(100);
/// Receive buffer of a port: QEMU's largest frame (64 KiB and its headers) fits.
const FRAME_MAX: usize = 70_000;

/// The ports and the MAC table, shared by the port threads.
struct Shared {
    /// Port `i`'s socket: bound on 127.0.0.1, connected to guest `i`'s NIC port, so it
    /// receives that guest's frames only and sends to it.
    ports: Vec<UdpSocket>,
    /// Where each MAC address was last seen (port index).
    macs: Mutex<Vec<([u8; 6], usize)>>,
    stop: AtomicBool,
}

/// A running switch; its threads stop when it is dropped.
pub(super) struct Switch {
    shared: Arc<Shared>,
    threads: Vec<thread::JoinHandle<()>>,
}

impl Switch {
    /// A switch with one port per entry of `guest_ports` (the UDP ports on 127.0.0.1 the
    /// guests' NICs receive on). Returns it and its own port for each guest, in order.
    pub(super) fn start(guest_ports: &[u16]) -> Result<(Switch, Vec<u16>)> {
        let mut ports = Vec::new();
        let mut own = Vec::new();
        for &guest in guest_ports {
            let socket = UdpSocket::bind("127.0.0.1:0")
                .context(|| "cannot bind a UDP port for the virtual switch".into())?;
            socket
                .connect(("127.0.0.1", guest))
                .context(|| format!("cannot aim the virtual switch at UDP port {guest}"))?;
            socket
                .set_read_timeout(Some(STOP_POLL))
                .context(|| "cannot set a read timeout on the switch's socket".into())?;
            own.push(
                socket
                    .local_addr()
                    .context(|| "cannot read the switch's UDP port".into())?
                    .port(),
            );
            ports.push(socket);
        }
        let shared = Arc::new(Shared {
            ports,
            macs: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
        });
        let threads = (0..guest_ports.len())
            .map(|port| {
                let shared = Arc::clone(&shared);
                thread::spawn(move || relay(&shared, port))
            })
            .collect();
        Ok((Switch { shared, threads }, own))
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The ports a frame received on `from` goes to: `dst`'s port once it is known, else every
/// other port (also for broadcast and multicast, whose first byte has its low bit set).
/// Learns that `src` is on `from`.
fn destinations(
    macs: &mut Vec<([u8; 6], usize)>,
    from: usize,
    src: [u8; 6],
    dst: [u8; 6],
    count: usize,
) -> Vec<usize> {
    if src[0] & 1 == 0 {
        match macs.iter_mut().find(|(m, _)| *m == src) {
            Some(entry) => entry.1 = from,
            None => macs.push((src, from)),
        }
    }
    let known = (dst[0] & 1 == 0)
        .then(|| macs.iter().find(|(m, _)| *m == dst).map(|&(_, p)| p))
        .flatten();
    match known {
        Some(port) if port == from => Vec::new(),
        Some(port) => vec![port],
        None => (0..count).filter(|&p| p != from).collect(),
    }
}

/// Port `port`'s thread: relays each frame its guest sends until the switch stops. Send
/// errors are ignored (a guest not started yet or gone loses the frame, as on a cable).
fn relay(shared: &Shared, port: usize) {
    let mut frame = vec![0u8; FRAME_MAX];
    while !shared.stop.load(Ordering::Relaxed) {
        // Timeouts, and ECONNREFUSED while the guest's port is not bound yet, end in the
        // stop check.
        let Ok(len) = shared.ports[port].recv(&mut frame) else {
            continue;
        };
        if len < 12 {
            continue;
        }
        let mac = |at: usize| {
            let mut m = [0u8; 6];
            m.copy_from_slice(&frame[at..at + 6]);
            m
        };
        let to = match shared.macs.lock() {
            Ok(mut macs) => destinations(&mut macs, port, mac(6), mac(0), shared.ports.len()),
            Err(_) => return,
        };
        for p in to {
            let _ = shared.ports[p].send(&frame[..len]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BCAST: [u8; 6] = [0xff; 6];

    fn node(n: u8) -> [u8; 6] {
        [0x52, 0x54, 0, 0x99, 1, n]
    }

    #[test]
    fn floods_until_learned_then_forwards() {
        let mut macs = Vec::new();
        assert_eq!(destinations(&mut macs, 0, node(1), BCAST, 4), [1, 2, 3]);
        assert_eq!(destinations(&mut macs, 2, node(3), node(1), 4), [0]);
        assert_eq!(destinations(&mut macs, 0, node(1), node(3), 4), [2]);
        assert_eq!(destinations(&mut macs, 0, node(1), node(4), 4), [1, 2, 3]);
        // RoCE multicast (IPv4 group 239.x: 01:00:5e:...) reaches every other port.
        let group = [0x01, 0x00, 0x5e, 0x01, 0x02, 0x03];
        assert_eq!(destinations(&mut macs, 1, node(2), group, 4), [0, 2, 3]);
        // A MAC that moves is learned again.
        assert_eq!(destinations(&mut macs, 3, node(1), BCAST, 4), [0, 1, 2]);
        assert_eq!(destinations(&mut macs, 2, node(3), node(1), 4), [3]);
        assert!(destinations(&mut macs, 3, node(4), node(1), 4).is_empty());
    }

    #[test]
    fn relays_frames_between_ports() {
        let guests: Vec<UdpSocket> = (0..3)
            .map(|_| UdpSocket::bind("127.0.0.1:0").expect("bind"))
            .collect();
        for g in &guests {
            g.set_read_timeout(Some(Duration::from_secs(5)))
                .expect("timeout");
        }
        let ports: Vec<u16> = guests
            .iter()
            .map(|g| g.local_addr().expect("addr").port())
            .collect();
        let (switch, own) = Switch::start(&ports).expect("switch");
        let send = |from: usize, dst: [u8; 6], src: [u8; 6], body: &[u8]| {
            let mut f = dst.to_vec();
            f.extend_from_slice(&src);
            f.extend_from_slice(body);
            guests[from]
                .send_to(&f, ("127.0.0.1", own[from]))
                .expect("send");
        };
        let recv = |at: usize| {
            let mut buf = [0u8; 64];
            let n = guests[at].recv(&mut buf).expect("a frame");
            buf[12..n].to_vec()
        };
        send(0, BCAST, node(1), b"hello all");
        assert_eq!(recv(1), b"hello all");
        assert_eq!(recv(2), b"hello all");
        send(2, node(1), node(3), b"to one");
        assert_eq!(recv(0), b"to one");
        send(0, node(3), node(1), b"back");
        assert_eq!(recv(2), b"back");
        guests[1]
            .set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        assert!(
            guests[1].recv(&mut buf).is_err(),
            "unicast leaked to port 1"
        );
        drop(switch);
    }
}
