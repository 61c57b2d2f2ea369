//! `mcast`: UD multicast through rdma_cm, with librdmacm's `mckey` flags and
//! output; either side can be the C program.
//!
//! ```text
//! mcast -m GROUP [-b BIND] [-C COUNT] [-S SIZE] [-t SECS]       receive (server)
//! mcast -m GROUP -s [-b BIND] [-C COUNT] [-S SIZE]              send (client)
//! ```
//!
//! `-m` the IP multicast address to join, `-b` the local address to bind to
//! (its device carries the group; needed where no route to the group's
//! address exists), `-s` send to the group instead of receiving, `-C`
//! messages (10), `-S` message size in bytes (100; at most the port's
//! active MTU), as `mckey`'s. `-t` (this program's): how long a receiver
//! waits for the next datagram before counting the missing ones lost (10 s).
//! `mckey`'s `-c`, `-M`, `-o`, `-l` and `-p` are not offered.
//!
//! Each datagram is a SEND with immediate data (the sender's QPN, as `mckey`
//! sends). This program's datagrams carry their sequence number in the first
//! 4 bytes (big-endian) and a byte pattern derived from it after, so the
//! receiver verifies each one and counts the missing and the duplicates; a
//! `mckey` sender's payload is its uninitialised buffer, so from it the
//! receiver checks the length and that the immediate data is the sender's
//! QPN. UD may drop datagrams: a receiver that does not get all of them
//! says how many it lost and exits 1; a corrupt one also fails it. A sender
//! waits 3 s after joining before sending, as `mckey` does.
//!
//! In the soft-RoCE guest, against the C program:
//! `cargo xtask run -- sh -c 'mckey -m 239.1.1.1 -b 10.99.0.1 & sleep 1; target/debug/examples/mcast -m 239.1.1.1 -b 10.99.0.1 -s; wait'`

use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdma_verbs::ah::GRH_LEN;
use rdma_verbs::cm::{CmId, UdPeer};
use rdma_verbs::prelude::*;

/// Bound of every rdma_cm step.
const CM_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of the sequence number at the start of this program's datagrams.
const SEQ_LEN: usize = 4;
/// Sends in flight at a time.
const WINDOW: usize = 64;
/// Most receives posted at a time. A receiver posts one for every datagram it
/// expects up to this, before it joins (as mckey does): a sender's burst then
/// finds a receive for each datagram, where re-posting as completions come
/// lags behind the burst and UD drops what finds none.
const RECV_WINDOW: usize = 1024;

struct Opts {
    group: IpAddr,
    bind: Option<IpAddr>,
    sender: bool,
    count: usize,
    size: usize,
    quiet: Duration,
}

fn usage() -> String {
    "usage: mcast\n\t-m multicast_address\n\t[-s(ender)]\n\t[-b bind_address]\n\t\
     [-C message_count]\n\t[-S message_size]\n\t[-t receive timeout, seconds]"
        .to_owned()
}

/// getopt("m:sb:C:S:t:"): `-m 239.1.1.1` or `-m239.1.1.1`.
fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        group: IpAddr::from([0, 0, 0, 0]),
        bind: None,
        sender: false,
        count: 10,
        size: 100,
        quiet: Duration::from_secs(10),
    };
    let mut group = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let flag = a.strip_prefix('-').and_then(|f| f.chars().next());
        let Some(flag) = flag else {
            return Err(format!("unexpected argument {a}\n{}", usage()));
        };
        if flag == 's' && a.len() == 2 {
            o.sender = true;
            continue;
        }
        let inline = &a[2..];
        let v = if inline.is_empty() {
            it.next().cloned().ok_or_else(usage)?
        } else {
            inline.to_owned()
        };
        let bad = |what: &str| format!("{what}: bad value {v:?}\n{}", usage());
        match flag {
            'm' => group = Some(v.parse().map_err(|_| bad("-m"))?),
            'b' => o.bind = Some(v.parse().map_err(|_| bad("-b"))?),
            'C' => o.count = v.parse().map_err(|_| bad("-C"))?,
            'S' => o.size = v.parse().map_err(|_| bad("-S"))?,
            't' => o.quiet = Duration::from_secs(v.parse().map_err(|_| bad("-t"))?),
            _ => return Err(usage()),
        }
    }
    o.group = group.ok_or_else(usage)?;
    if o.size < SEQ_LEN {
        return Err(format!(
            "-S {}: at least {SEQ_LEN} bytes (the sequence number)",
            o.size
        ));
    }
    Ok(o)
}

/// Byte `i` of datagram `seq` after its sequence number.
fn pattern_byte(seq: u32, i: usize) -> u8 {
    (seq.wrapping_mul(31) as u8)
        .wrapping_add((i as u8).wrapping_mul(7))
        .wrapping_add(0x5a)
}

/// The payload of datagram `seq`.
fn datagram(seq: u32, size: usize) -> Vec<u8> {
    let mut d: Vec<u8> = (0..size).map(|i| pattern_byte(seq, i)).collect();
    d[..SEQ_LEN].copy_from_slice(&seq.to_be_bytes());
    d
}

/// What a receiver counted.
#[derive(Default)]
struct Tally {
    seen: Vec<bool>,
    verified: usize,
    from_c: usize,
    duplicates: usize,
    corrupt: usize,
}

impl Tally {
    /// Judges one datagram of `len` bytes (`data`) with immediate `imm` from
    /// QP `src_qp`.
    fn judge(&mut self, data: &[u8], size: usize, imm: Option<u32>, src_qp: u32) {
        if data.len() != size {
            self.corrupt += 1;
            return;
        }
        let seq = u32::from_be_bytes(data[..SEQ_LEN].try_into().expect("4 bytes"));
        let ours = (seq as usize) < self.seen.len() && data == datagram(seq, size).as_slice();
        if ours {
            if std::mem::replace(&mut self.seen[seq as usize], true) {
                self.duplicates += 1;
            } else {
                self.verified += 1;
            }
        } else if imm == Some(src_qp) {
            // A C mckey: its payload is not patterned; its immediate data is its QPN.
            self.from_c += 1;
        } else {
            self.corrupt += 1;
        }
    }

    fn received(&self) -> usize {
        self.verified + self.from_c
    }
}

/// The id bound to the group's device, its QP, CQ and PD.
struct Member {
    id: CmId,
    pd: Pd,
    cq: Cq,
    qp: Qp<Ud, Rts>,
}

fn member(o: &Opts) -> Result<Member> {
    let id = CmId::new_ud()?;
    let group = SocketAddr::new(o.group, 0);
    id.resolve_addr(o.bind.map(|b| SocketAddr::new(b, 0)), group, CM_TIMEOUT)?;
    let ctx = id.context()?;
    let max = ctx.query_port(id.port_num())?.active_mtu.bytes() as usize;
    if o.size > max {
        return Err(Error::InvalidArgument {
            what: "message size",
            reason: format!(
                "mcast: message_size {} is larger than active mtu {max}",
                o.size
            ),
        });
    }
    let pd = Pd::new(&ctx)?;
    let (send_depth, recv_depth) = if o.sender {
        (o.count.clamp(1, WINDOW) as u32, 1)
    } else {
        (1, o.count.clamp(1, RECV_WINDOW) as u32)
    };
    let cq = Cq::new(&ctx, send_depth + recv_depth)?;
    let caps = QpCaps {
        max_send_wr: send_depth,
        max_recv_wr: recv_depth,
        ..QpCaps::default()
    };
    let qp = id.create_ud_qp(&pd, &cq, &cq, caps)?;
    Ok(Member { id, pd, cq, qp })
}

/// Posts receive `i` (its wr_id).
fn post_recv(m: &mut Member, i: u64, size: usize) -> Result<()> {
    let grh = m.pd.alloc_mr(GRH_LEN, AccessFlags::LOCAL_WRITE)?;
    let payload = m.pd.alloc_mr(size, AccessFlags::LOCAL_WRITE)?;
    m.qp.post_recv(UdRecvWr::new(i, grh, payload))?;
    Ok(())
}

fn join(m: &Member, o: &Opts) -> Result<UdPeer> {
    println!("mcast: joining");
    let (peer, ev) =
        m.id.join_multicast(&m.qp, SocketAddr::new(o.group, 0), CM_TIMEOUT)?;
    let p = ev
        .ud
        .expect("MULTICAST_JOIN carries the group's parameters");
    let dgid = p.av.grh.map(|g| g.dgid.to_string()).unwrap_or_default();
    println!(
        "mcast: joined dgid: {dgid} mlid {:#x} sl {}",
        p.av.dlid, p.av.sl
    );
    Ok(peer)
}

/// Sends `count` datagrams to the group, at most [`WINDOW`] in flight.
fn send_all(m: &mut Member, peer: &UdPeer, o: &Opts) -> Result<()> {
    println!("initiating data transfers");
    let (mut posted, mut done) = (0usize, 0usize);
    let mut out = Vec::new();
    while done < o.count {
        while posted < o.count && posted - done < WINDOW.min(m.qp.caps().max_send_wr as usize) {
            let mut mr = m.pd.alloc_mr(o.size, AccessFlags::empty())?;
            mr.as_mut_slice()?
                .copy_from_slice(&datagram(posted as u32, o.size));
            let wr = peer.send_from(posted as u64, mr).imm(m.qp.qp_num());
            m.qp.post_send(wr)?;
            posted += 1;
        }
        out.clear();
        m.cq.poll_n(&mut out, 1, CM_TIMEOUT)?;
        for c in out.drain(..) {
            c.result()?;
            done += 1;
        }
    }
    Ok(())
}

/// Receives until `count` datagrams came or none came for `quiet`.
fn receive_all(m: &mut Member, o: &Opts) -> Result<Tally> {
    let mut t = Tally {
        seen: vec![false; o.count],
        ..Tally::default()
    };
    println!("receiving data transfers");
    let mut out = Vec::new();
    let mut last = Instant::now();
    while t.received() + t.corrupt < o.count && last.elapsed() < o.quiet {
        out.clear();
        let n = m.cq.poll_n(&mut out, 1, Duration::from_millis(200));
        if matches!(n, Err(Error::Timeout { .. })) {
            continue;
        }
        n?;
        for mut c in out.drain(..) {
            let msg = c.take_ud()?;
            let payload = msg.payload.as_ref().expect("a payload buffer").to_vec()?;
            let data = &payload[..(msg.len as usize).min(payload.len())];
            t.judge(data, o.size, msg.imm_data, msg.src_qp);
            post_recv(m, c.wr_id, o.size)?;
            last = Instant::now();
        }
    }
    Ok(t)
}

fn run(o: &Opts) -> Result<bool> {
    println!(
        "mcast: starting {}",
        if o.sender { "client" } else { "server" }
    );
    let mut m = member(o)?;
    if !o.sender {
        for i in 0..o.count.min(RECV_WINDOW) {
            post_recv(&mut m, i as u64, o.size)?;
        }
    }
    let peer = join(&m, o)?;
    // mckey's pause, for the network to learn the group before the first datagram
    // (a receiver's receives are posted already: it needs none).
    if o.sender {
        std::thread::sleep(Duration::from_secs(3));
    }
    let mut ok = true;
    if o.count > 0 {
        if o.sender {
            send_all(&mut m, &peer, o)?;
        } else {
            let t = receive_all(&mut m, o)?;
            let lost = o.count.saturating_sub(t.received() + t.corrupt);
            println!(
                "mcast: received {} of {}: {} verified, {} from a C mckey (length and \
                 immediate data checked), {} corrupt, {} duplicate, {} lost",
                t.received(),
                o.count,
                t.verified,
                t.from_c,
                t.corrupt,
                t.duplicates,
                lost
            );
            ok = lost == 0 && t.corrupt == 0;
        }
        println!("data transfers complete");
    }
    m.id.leave_multicast(&m.qp, SocketAddr::new(o.group, 0))?;
    Ok(ok)
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
    let status = match run(&o) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            println!("mcast: {e}");
            1
        }
    };
    println!("test complete");
    println!("return status {status}");
    ExitCode::from(status)
}
