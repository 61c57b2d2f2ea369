//! `ud_cm`: rdma_cm UD datagrams (`RDMA_PS_UDP`, SIDR), with librdmacm's
//! `udaddy` flags and output; either side can be the C program.
//!
//! ```text
//! ud_cm [-b BIND] [-c CONNS] [-C COUNT] [-S SIZE]                 server
//! ud_cm -s SERVER [-b BIND] [-c CONNS] [-C COUNT] [-S SIZE]       client
//! ```
//!
//! `-s` the server to connect to (without it: serve), `-b` the local
//! address to bind to, `-c` connections (1), `-C` messages per connection
//! (10), `-S` message size in bytes (100; at most the port's active MTU),
//! `-p` the port space (only `0x111`, UDP, is offered; `-P udp` too), as
//! `udaddy`'s; its port is `udaddy`'s, 7174. `udaddy`'s `-f` and `-t` are
//! not offered.
//!
//! As in `udaddy`, the client sends `-C` SENDs with immediate data (its
//! QPN) on each connection; the server answers each connection with `-C`
//! datagrams holding the first `-S` bytes of its receive buffer: the GRH of
//! the last datagram, then that datagram's payload. This program's
//! datagrams carry a fixed byte pattern, so its server verifies each one
//! (from a C `udaddy`, whose payload is an uninitialised buffer, it checks
//! the length and that the immediate data is the sender's QPN), and its
//! client checks each reply: the length, the sender's QPN, its GRH's source
//! (this host) and the echoed pattern. UD may drop datagrams: a side that
//! hears nothing for 10 s counts the missing ones lost and exits 1; a wrong
//! one also fails it.
//!
//! In the soft-RoCE guest, against the C program:
//! `cargo xtask run -- sh -c 'udaddy & sleep 1; target/debug/examples/ud_cm -s 10.99.0.1; wait'`

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

use rdma_verbs::ah::{GRH_LEN, grh_source_gid};
use rdma_verbs::cm::{CmId, ConnParam, UdPeer};
use rdma_verbs::prelude::*;
use rdma_verbs::qp::UdMessage;

/// udaddy's port.
const PORT: u16 = 7174;
/// `RDMA_PS_UDP`, the one port space offered.
const PS_UDP: i64 = 0x111;
/// Bound of address and route resolution (udaddy's 2000 ms).
const RESOLVE: Duration = Duration::from_millis(2000);
/// Bound of a SIDR exchange, and of the server's wait for each request.
const CM_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a side waits for the next datagram before counting the rest lost.
const QUIET: Duration = Duration::from_secs(10);

struct Opts {
    dst: Option<String>,
    bind: Option<IpAddr>,
    conns: usize,
    count: usize,
    size: usize,
}

fn usage() -> String {
    "usage: ud_cm\n\t[-s server_address]\n\t[-b bind_address]\n\t[-P port_space]\n\t    udp\n\t\
     [-c connections]\n\t[-C message_count]\n\t[-S message_size]\n\t\
     [-p port_space - 0x111 for UDP (default)]"
        .to_owned()
}

/// A `-p` value as strtol(.., 0) reads it: `0x` hex, `0` octal, else decimal.
fn port_space(v: &str) -> Option<i64> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        i64::from_str_radix(h, 16).ok()
    } else if v.len() > 1 && v.starts_with('0') {
        i64::from_str_radix(&v[1..], 8).ok()
    } else {
        v.parse().ok()
    }
}

/// getopt("s:b:c:C:S:p:P:"): `-s 10.0.0.1` or `-s10.0.0.1`.
fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        dst: None,
        bind: None,
        conns: 1,
        count: 10,
        size: 100,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(flag) = a.strip_prefix('-').and_then(|f| f.chars().next()) else {
            return Err(format!("unexpected argument {a}\n{}", usage()));
        };
        let inline = &a[1 + flag.len_utf8()..];
        let v = if inline.is_empty() {
            it.next().cloned().ok_or_else(usage)?
        } else {
            inline.to_owned()
        };
        let bad = |what: &str| format!("{what}: bad value {v:?}\n{}", usage());
        match flag {
            's' => o.dst = Some(v.clone()),
            'b' => o.bind = Some(v.parse().map_err(|_| bad("-b"))?),
            'c' => o.conns = v.parse().map_err(|_| bad("-c"))?,
            'C' => o.count = v.parse().map_err(|_| bad("-C"))?,
            'S' => o.size = v.parse().map_err(|_| bad("-S"))?,
            'p' if port_space(&v) == Some(PS_UDP) => {}
            'P' if v.eq_ignore_ascii_case("udp") => {}
            'p' | 'P' => {
                return Err(format!(
                    "-{flag} {v}: only the UDP port space (-p 0x111, -P udp) is offered; \
                     IPoIB's (0x2) is not"
                ));
            }
            _ => return Err(usage()),
        }
    }
    if o.size == 0 {
        // udaddy's rule: no payload, no messages (connect only).
        o.count = 0;
    }
    if o.conns == 0 {
        return Err("-c: at least one connection".into());
    }
    Ok(o)
}

/// Byte `i` of every datagram this program sends.
fn pattern(size: usize) -> Vec<u8> {
    (0..size)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(0x5a))
        .collect()
}

/// One connection: its id, PD, CQ, QP and (once known) its peer.
struct Node {
    id: CmId,
    pd: Pd,
    cq: Cq,
    qp: Qp<Ud, Rts>,
    peer: Option<UdPeer>,
    /// Receives that completed while sends were awaited.
    early: Vec<Completion>,
}

/// PD, CQ and QP on `id`'s device, with `count` receives posted; refuses a
/// message larger than the port's active MTU, as udaddy does.
fn setup(id: &CmId, o: &Opts) -> Result<(Pd, Cq, Qp<Ud, Rts>)> {
    let ctx = id.context()?;
    let mtu = ctx.query_port(id.port_num())?.active_mtu.bytes() as usize;
    if o.count > 0 && o.size > mtu {
        return Err(Error::InvalidArgument {
            what: "message size",
            reason: format!("message_size {} is larger than active mtu {mtu}", o.size),
        });
    }
    let pd = Pd::new(&ctx)?;
    let depth = o.count.max(1) as u32;
    let cq = Cq::new(&ctx, 2 * depth)?;
    let caps = QpCaps {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCaps::default()
    };
    let mut qp = id.create_ud_qp(&pd, &cq, &cq, caps)?;
    for i in 0..o.count {
        let grh = pd.alloc_mr(GRH_LEN, AccessFlags::LOCAL_WRITE)?;
        let payload = pd.alloc_mr(o.size.max(1), AccessFlags::LOCAL_WRITE)?;
        qp.post_recv(UdRecvWr::new(i as u64, grh, payload))?;
    }
    Ok((pd, cq, qp))
}

/// What one side heard on one connection.
#[derive(Default)]
struct Tally {
    verified: usize,
    from_c: usize,
    wrong: usize,
    /// GRH and payload of the last datagram, as udaddy's receive buffer holds them.
    last: Vec<u8>,
}

/// Receives `count` datagrams on `n` (or until none came for [`QUIET`]),
/// judging each with `judge`; the server answers the first one's sender.
fn receive(n: &mut Node, o: &Opts, judge: impl Fn(&[u8], &UdMessage) -> Judged) -> Result<Tally> {
    let mut t = Tally::default();
    let mut out = Vec::new();
    out.append(&mut n.early);
    while t.verified + t.from_c + t.wrong < o.count {
        if out.is_empty() {
            match n.cq.poll_n(&mut out, 1, QUIET) {
                Err(Error::Timeout { .. }) => break,
                r => r?,
            };
        }
        for mut c in out.drain(..) {
            c.result()?;
            if c.opcode != WcOpcode::Recv {
                continue;
            }
            let msg = c.take_ud()?;
            let payload = msg.payload.as_ref().expect("a payload buffer").to_vec()?;
            let data = &payload[..(msg.len as usize).min(payload.len())];
            match judge(data, &msg) {
                Judged::Verified => t.verified += 1,
                Judged::FromC => t.from_c += 1,
                Judged::Wrong => t.wrong += 1,
            }
            if n.peer.is_none() {
                n.peer = Some(UdPeer::reply_to(&n.qp, &c, &msg)?);
            }
            t.last = [&msg.grh_bytes[..], data].concat();
        }
    }
    Ok(t)
}

enum Judged {
    Verified,
    FromC,
    Wrong,
}

/// Sends `count` datagrams of `data` to the node's peer, immediate data its
/// own QPN (the reply address udaddy's server uses), and waits for them.
fn send_all(n: &mut Node, o: &Opts, data: &[u8]) -> Result<()> {
    let peer = n.peer.as_ref().expect("a peer before sending");
    for i in 0..o.count {
        let mut mr = n.pd.alloc_mr(o.size.max(1), AccessFlags::empty())?;
        mr.as_mut_slice()?[..o.size].copy_from_slice(&data[..o.size]);
        n.qp.post_send(peer.send_from(i as u64, mr).imm(n.qp.qp_num()))?;
    }
    let (mut done, mut out) = (0, Vec::new());
    while done < o.count {
        out.clear();
        n.cq.poll_n(&mut out, 1, CM_TIMEOUT)?;
        for c in out.drain(..) {
            c.result()?;
            if c.opcode == WcOpcode::Send {
                done += 1;
            } else {
                n.early.push(c);
            }
        }
    }
    Ok(())
}

/// Prints one connection's tally; true when all arrived and none was wrong.
fn report(who: &str, i: usize, t: &Tally, o: &Opts) -> bool {
    let lost = o.count.saturating_sub(t.verified + t.from_c + t.wrong);
    println!(
        "ud_cm: {who} {i}: received {} of {}: {} verified, {} from a C udaddy (length and \
         immediate data checked), {} wrong, {} lost",
        t.verified + t.from_c,
        o.count,
        t.verified,
        t.from_c,
        t.wrong,
        lost
    );
    lost == 0 && t.wrong == 0
}

fn run_server(o: &Opts) -> Result<bool> {
    println!("ud_cm: starting server");
    let bind = SocketAddr::new(o.bind.unwrap_or(IpAddr::from([0, 0, 0, 0])), PORT);
    let listener = CmId::ud_listener(bind, o.conns as i32)?;
    let mut nodes = Vec::new();
    for _ in 0..o.conns {
        let req = listener.get_request(CM_TIMEOUT)?;
        let (pd, cq, qp) = setup(req.id(), o)?;
        let id = req.accept_ud(&qp, &ConnParam::new())?;
        let peer = None;
        nodes.push(Node {
            id,
            pd,
            cq,
            qp,
            peer,
            early: Vec::new(),
        });
    }
    let mut ok = true;
    if o.count > 0 {
        println!("receiving data transfers");
        let want = pattern(o.size);
        let mut echoes = Vec::new();
        for (i, n) in nodes.iter_mut().enumerate() {
            let t = receive(n, o, |data, m| {
                if data.len() != o.size || m.imm_data != Some(m.src_qp) {
                    Judged::Wrong
                } else if data == want.as_slice() {
                    Judged::Verified
                } else {
                    Judged::FromC
                }
            })?;
            ok &= report("connection", i, &t, o);
            echoes.push(t.last);
        }
        println!("sending replies");
        for (n, echo) in nodes.iter_mut().zip(echoes) {
            if n.peer.is_some() {
                send_all(n, o, &echo)?;
            }
        }
        println!("data transfers complete");
    }
    Ok(ok)
}

fn run_client(o: &Opts, dst: &str) -> Result<bool> {
    println!("ud_cm: starting client");
    let to = (dst, PORT)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| Error::InvalidArgument {
            what: "server address",
            reason: format!("{dst} does not resolve to an address"),
        })?;
    println!("ud_cm: connecting");
    let mut nodes = Vec::new();
    for _ in 0..o.conns {
        let id = CmId::new_ud()?;
        id.resolve_addr(o.bind.map(|b| SocketAddr::new(b, 0)), to, RESOLVE)?;
        id.resolve_route(RESOLVE)?;
        let (pd, cq, qp) = setup(&id, o)?;
        let (peer, _) = id.connect_ud(&qp, &ConnParam::new(), CM_TIMEOUT)?;
        let peer = Some(peer);
        nodes.push(Node {
            id,
            pd,
            cq,
            qp,
            peer,
            early: Vec::new(),
        });
    }
    let mut ok = true;
    if o.count > 0 {
        println!("initiating data transfers");
        let sent = pattern(o.size);
        for n in &mut nodes {
            send_all(n, o, &sent)?;
        }
        println!("receiving data transfers");
        let echoed = o.size.saturating_sub(GRH_LEN);
        for (i, n) in nodes.iter_mut().enumerate() {
            let server = n.peer.as_ref().map(|p| p.qpn);
            let me = n.id.local_addr().map(|a| a.ip());
            let t = receive(n, o, |data, m| {
                let grh = &data[..GRH_LEN.min(data.len())];
                let from_me = grh.len() < GRH_LEN || grh_source_gid(grh) == me.map(mapped_gid);
                let good = data.len() == o.size
                    && Some(m.src_qp) == server
                    && m.imm_data == server
                    && from_me
                    && data[o.size - echoed..] == sent[..echoed];
                if good {
                    Judged::Verified
                } else {
                    Judged::Wrong
                }
            })?;
            ok &= report("connection", i, &t, o);
        }
        println!("data transfers complete");
    }
    Ok(ok)
}

/// The GID a datagram from `ip` carries as its source (RoCE v2 over IPv4
/// uses the IPv4-mapped address).
fn mapped_gid(ip: IpAddr) -> Gid {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    Gid(v6.octets())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "-h" || a == "--help") {
        println!("{}", usage());
        return ExitCode::SUCCESS;
    }
    let o = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            println!("{e}");
            return ExitCode::from(1);
        }
    };
    let r = match &o.dst {
        Some(dst) => run_client(&o, dst),
        None => run_server(&o),
    };
    let status = match r {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(Error::CmEvent { event, status, .. }) => {
            println!("ud_cm: event: {event}, error: {status}");
            1
        }
        Err(e) => {
            println!("ud_cm: {e}");
            1
        }
    };
    println!("test complete");
    println!("return status {status}");
    ExitCode::from(status)
}
