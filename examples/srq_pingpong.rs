//! `srq_pingpong`: a Rust port of rdma-core's `ibv_srq_pingpong`,
//! wire-compatible with it (either side can be the C program).
//!
//! ```text
//! srq_pingpong [options]          start a server and wait for connection
//! srq_pingpong [options] <host>   connect to server at <host>
//! ```
//!
//! `num_qp` RC QPs share one shared receive queue ([`Srq`]) and one CQ; each
//! QP ping-pongs messages with its peer QP, and the receives every QP needs
//! come from the SRQ, which is refilled to `rx_depth` whenever no more than
//! `num_qp` receives are left in it (as the C program does).
//!
//! Same options, defaults and output as the C program: `-p` TCP port (18515),
//! `-d` device (first found), `-i` device port (1), `-s` message size (4096),
//! `-m` path MTU (1024), `-q` QPs (16), `-r` receives posted at a time (500),
//! `-n` exchanges in all, over every QP (1000), `-l` service level (0), `-e`
//! sleep on CQ events instead of busy-polling, `-g` GID index (none; RoCE needs
//! one, usually 1 on soft-RoCE). Long forms (`--num-qp=4`) work too. The C
//! program has no `-o`/`-c`. Its TCP exchange sends 256 address lines each way
//! (its `MAX_QP`; the lines past `num_qp` are zero) and so does this one.
//!
//! Differences from the C program, all invisible on the wire:
//! * The data path is this crate's safe one: each receive owns its buffer
//!   (one registration cut into `rx_depth + num_qp` pieces of `size` bytes:
//!   the receives and one send buffer per QP), and the buffers come back with
//!   the completion of whichever QP consumed them.
//! * `-q` must be 1 to 256 (the C program does not check; more than 256
//!   overruns its arrays).
//! * The client retries connecting for up to 10 seconds (the C client gives
//!   up at once when the server is not listening yet).
//!
//! Run it inside the soft-RoCE guest, e.g. against the C program:
//! `cargo xtask run -- sh -c 'ibv_srq_pingpong -g 1 -n 64 & sleep 1; target/debug/examples/srq_pingpong -g 1 -n 64 10.99.0.1'`

use std::process::ExitCode;
use std::time::Instant;

// Its own command line and set-up; the shared module's parsing helpers,
// address lines and completion wait.
#[allow(dead_code)]
#[path = "shared/pingpong.rs"]
mod pingpong;

use pingpong::{
    CONNECT_TIMEOUT, Common, check_status, create_cq, getopt_each, long_opts, main_with,
    next_completions, num, open_channel, open_device, print_dest, print_option_lines, print_rate,
    print_usage_head,
};

use rdma_verbs::device::LinkLayer;
use rdma_verbs::exchange::{ExchangeListener, ExchangeStream};
use rdma_verbs::prelude::*;

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;
/// The C program's `MAX_QP`: how many address lines each side sends.
const MAX_QP: usize = 256;

/// The C program's options: the common ones and the number of QPs.
struct Opts {
    c: Common,
    num_qp: u32,
}

impl std::ops::Deref for Opts {
    type Target = Common;
    fn deref(&self) -> &Common {
        &self.c
    }
}

impl Opts {
    /// Applies option `-c` with value `v` (empty for a switch). Unlike the
    /// other ports, `-s` must be at least 1 and a `-g` out of range means no
    /// GID (the C program's `atoi` then).
    fn apply(&mut self, c: char, v: String) -> Result<(), String> {
        match c {
            's' => {
                self.c.size = num('s', &v)?;
                if self.c.size < 1 {
                    return Err("-s must be at least 1".into());
                }
            }
            'q' => self.num_qp = num('q', &v)?,
            'g' => {
                let g: i64 = num('g', &v)?;
                self.c.gidx = u8::try_from(g).ok();
            }
            c if self.c.apply(c, &v)? => {}
            other => return Err(format!("option -{other} is not supported by this port")),
        }
        Ok(())
    }
}

fn usage(argv0: &str) {
    print_usage_head(argv0);
    print_option_lines("pdism", 4096);
    println!("  -q, --num-qp=<num>     number of QPs to use (default 16)");
    print_option_lines("r", 4096);
    println!("  -n, --iters=<iters>    number of exchanges per QP(default 1000)");
    print_option_lines("legh", 4096);
}

/// getopt_long("p:d:i:s:m:q:r:n:l:eg:") with GNU permutation.
fn parse_args(args: &[String]) -> Result<Opts, String> {
    let long = long_opts("pdismrnleg", &[("num-qp", 'q', true)]);
    let mut o = Opts {
        c: Common::new(4096),
        num_qp: 16,
    };
    let mut positional = getopt_each(args, &long, |c, v| o.apply(c, v))?;
    match positional.len() {
        0 => {}
        1 => o.c.servername = positional.pop(),
        _ => return Err("too many arguments".into()),
    }
    if o.num_qp == 0 || o.num_qp as usize > MAX_QP {
        return Err(format!("-q must be 1 to {MAX_QP}"));
    }
    Ok(o)
}

/// INIT → RTR → RTS as `pp_connect_ctx` does it. Like the C program, the
/// first remote line decides whether there is a GRH, and names its GID.
fn connect(
    qp: Qp<Rc, Init>,
    o: &Opts,
    my_psn: u32,
    dest: &Endpoint,
    first: &Endpoint,
) -> Result<Qp<Rc, Rts>, String> {
    let grh = (first.gid.interface_id() != 0).then(|| o.gidx.unwrap_or(0));
    let dest = Endpoint {
        gid: first.gid,
        ..*dest
    };
    let attr = RtrAttr::new(&dest, o.ib_port, o.mtu, grh).sl(o.sl);
    let qp = qp
        .rtr(attr)
        .map_err(|e| format!("Failed to modify QP to RTR: {}", e.error))?;
    qp.rts(RtsAttr::new(my_psn))
        .map_err(|e| format!("Failed to modify QP to RTS: {}", e.error))
}

/// Connects every QP to its line of `rem`.
fn connect_all(
    qps: Vec<Qp<Rc, Init>>,
    o: &Opts,
    my: &[Endpoint],
    rem: &[Endpoint],
) -> Result<Vec<Qp<Rc, Rts>>, String> {
    qps.into_iter()
        .enumerate()
        .map(|(i, qp)| {
            connect(qp, o, my[i].psn, &rem[i], &rem[0])
                .map_err(|e| e.replace("QP to", &format!("QP[{i}] to")))
        })
        .collect()
}

fn main() -> ExitCode {
    main_with("srq_pingpong", usage, parse_args, run)
}

/// Sends `buf` on `qp` (inline when it fits: the buffer stays here).
fn post_send(qp: &mut Qp<Rc, Rts>, buf: Mr, inline: bool) -> Result<Option<Mr>, String> {
    let err = |e: rdma_verbs::qp::PostError| format!("Couldn't post send: {}", e.error);
    if inline {
        let data = buf.as_slice().map_err(|e| e.to_string())?;
        qp.post_send(SendWr::send_inline(SEND_WRID, data))
            .map_err(err)?;
        Ok(Some(buf))
    } else {
        qp.post_send(SendWr::send(SEND_WRID).sge(buf))
            .map_err(err)?;
        Ok(None)
    }
}

fn run(o: &Opts) -> Result<(), String> {
    if o.num_qp > o.rx_depth {
        return Err(format!(
            "rx_depth {} is too small for {} QPs -- must have at least one receive per QP.",
            o.rx_depth, o.num_qp
        ));
    }
    let ctx = open_device(o.ib_devname.as_deref())?;
    let channel = open_channel(&ctx, o.use_event)?;
    let pd = Pd::new(&ctx).map_err(|e| format!("Couldn't allocate PD: {e}"))?;
    let (mut send_bufs, mut spare) = buffers(o, &pd)?;
    // The SRQ's rx_depth entries plus one send per QP: the C program's CQ size.
    let depth = o.rx_depth + o.num_qp;
    let mut cq = create_cq(&ctx, channel.as_ref(), depth)?;
    let mut srq = Srq::new(&pd, &cq, SrqAttr::new(o.rx_depth, 1))
        .map_err(|e| format!("Couldn't create SRQ: {e}"))?;
    let (qps, use_inline) = create_qps(o, &pd, &cq, &srq)?;
    refill(&mut srq, &mut spare, o.rx_depth)?;
    if o.use_event {
        cq.req_notify(false)
            .map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }
    let my_dest = local_dests(o, &ctx, &qps)?;
    let (rem_dest, mut qps) = exchange_dests(o, qps, &my_dest)?;
    for d in &rem_dest[..o.num_qp as usize] {
        print_dest("remote address:", d, ',');
    }
    let mut ping = Ping {
        qps: &mut qps,
        srq: &mut srq,
        send_bufs: &mut send_bufs,
        spare: &mut spare,
        use_inline,
    };
    ping.run(o, &mut cq, depth as usize)?;
    // Destroy in the C program's order: QPs, SRQ (its receives' buffers are
    // released then), CQ (its Drop acknowledges the CQ events), MRs, PD,
    // channel, context.
    drop(qps);
    drop(srq);
    drop(cq);
    drop((spare, send_bufs));
    drop((pd, channel, ctx));
    Ok(())
}

/// `rx_depth` receive buffers plus one send buffer per QP, from one
/// registration: the send buffers, and the receives' (spare until posted).
fn buffers(o: &Opts, pd: &Pd) -> Result<(Vec<Option<Mr>>, Vec<Mr>), String> {
    let num_qp = o.num_qp as usize;
    let nbufs = o.rx_depth as usize + num_qp;
    let total = o
        .size
        .checked_mul(nbufs)
        .ok_or("message size times rx depth overflows")?;
    let mut all = Mr::new(pd, total, AccessFlags::LOCAL_WRITE)
        .map_err(|e| format!("Couldn't register MR: {e}"))?;
    let mut bufs: Vec<Mr> = Vec::with_capacity(nbufs);
    for _ in 0..nbufs - 1 {
        bufs.push(all.split_to(o.size).map_err(|e| e.to_string())?);
    }
    bufs.push(all);
    let send_bufs = bufs.drain(..num_qp).map(Some).collect();
    Ok((send_bufs, bufs))
}

/// `num_qp` RC QPs on the SRQ, in INIT, and whether every one sends a
/// message inline.
fn create_qps(o: &Opts, pd: &Pd, cq: &Cq, srq: &Srq) -> Result<(Vec<Qp<Rc, Init>>, bool), String> {
    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 0,
        max_send_sge: 1,
        max_recv_sge: 0,
        max_inline_data: 0,
        sq_sig_all: false,
    };
    let mut use_inline = true;
    let mut qps = Vec::with_capacity(o.num_qp as usize);
    for i in 0..o.num_qp as usize {
        let qp = Qp::new_with_srq(pd, cq, cq, srq, caps)
            .map_err(|e| format!("Couldn't create QP[{i}]: {e}"))?;
        use_inline &= qp.caps().max_inline_data as usize >= o.size;
        qps.push(qp);
    }
    let qps = qps
        .into_iter()
        .enumerate()
        .map(|(i, qp)| {
            qp.init(InitAttr::new(o.ib_port, AccessFlags::empty()))
                .map_err(|e| format!("Failed to modify QP[{i}] to INIT: {}", e.error))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok((qps, use_inline))
}

/// Posts spare buffers to the SRQ up to `rx_depth` receives.
fn refill(srq: &mut Srq, spare: &mut Vec<Mr>, rx_depth: u32) -> Result<(), String> {
    srq.refill(|| spare.pop().map(|mr| RecvWr::new(RECV_WRID, mr)))
        .map_err(|e| format!("Couldn't post receive ({}): {}", srq.posted(), e.error))?;
    // Short only while buffers are elsewhere: receives of the batch being handled
    // hand theirs back a moment later (the next refill posts them). Short with
    // buffers to spare is the C program's failure.
    if srq.posted() < u64::from(rx_depth) && !spare.is_empty() {
        return Err(format!("Couldn't post receive ({})", srq.posted()));
    }
    Ok(())
}

/// This side's `MAX_QP` address lines (those past `num_qp` zero, as in the C
/// program), printing each QP's.
fn local_dests(o: &Opts, ctx: &Context, qps: &[Qp<Rc, Init>]) -> Result<Vec<Endpoint>, String> {
    let portinfo = ctx
        .query_port(o.ib_port)
        .map_err(|e| format!("Couldn't get port info: {e}"))?;
    let gid = match o.gidx {
        Some(g) => ctx
            .query_gid(o.ib_port, g)
            .map_err(|_| format!("Could not get local gid for gid index {g}"))?,
        None => Gid::ZERO,
    };
    let mut my_dest = vec![
        Endpoint {
            lid: 0,
            qpn: 0,
            psn: 0,
            gid: Gid::ZERO,
        };
        MAX_QP
    ];
    for (d, qp) in my_dest.iter_mut().zip(qps) {
        *d = Endpoint {
            lid: portinfo.lid,
            qpn: qp.qp_num(),
            psn: qp.psn(),
            gid,
        };
        if portinfo.link_layer != LinkLayer::Ethernet && d.lid == 0 {
            return Err("Couldn't get local LID".into());
        }
        print_dest("local address: ", d, ',');
    }
    Ok(my_dest)
}

/// Every QP, connected to its peer.
type ConnectedQps = Vec<Qp<Rc, Rts>>;

/// The C program's exchange of `MAX_QP` address lines each way; the server
/// connects its QPs before answering, so the client's first message finds
/// them ready.
fn exchange_dests(
    o: &Opts,
    qps: Vec<Qp<Rc, Init>>,
    my_dest: &[Endpoint],
) -> Result<(Vec<Endpoint>, ConnectedQps), String> {
    let exchange_err = |e: rdma_verbs::Error| format!("Couldn't exchange addresses: {e}");
    match &o.servername {
        Some(host) => {
            let mut s = ExchangeStream::connect(host, o.port, CONNECT_TIMEOUT)
                .map_err(|e| format!("Couldn't connect to {host}:{}: {e}", o.port))?;
            for d in my_dest {
                s.send(d).map_err(exchange_err)?;
            }
            let rem = (0..MAX_QP)
                .map(|_| s.recv::<Endpoint>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(exchange_err)?;
            s.send_done().map_err(exchange_err)?;
            drop(s);
            let qps = connect_all(qps, o, my_dest, &rem)?;
            Ok((rem, qps))
        }
        None => {
            let listener = ExchangeListener::bind(o.port)
                .map_err(|e| format!("Couldn't listen to port {}: {e}", o.port))?;
            let mut s = listener.accept(None).map_err(exchange_err)?;
            drop(listener);
            let rem = (0..MAX_QP)
                .map(|_| s.recv::<Endpoint>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(exchange_err)?;
            let qps = connect_all(qps, o, my_dest, &rem)
                .map_err(|e| format!("{e}\nCouldn't connect to remote QP"))?;
            for d in my_dest {
                s.send(d).map_err(exchange_err)?;
            }
            s.recv_done().map_err(exchange_err)?;
            Ok((rem, qps))
        }
    }
}

/// The ping-pong over every QP: what each QP sends from, and the SRQ's
/// buffers.
struct Ping<'a> {
    qps: &'a mut [Qp<Rc, Rts>],
    srq: &'a mut Srq,
    /// Each QP's send buffer while it is not in flight.
    send_bufs: &'a mut [Option<Mr>],
    /// Receive buffers not posted to the SRQ.
    spare: &'a mut Vec<Mr>,
    use_inline: bool,
}

impl Ping<'_> {
    /// The C program's loop: the client's QPs send first; each QP sends again
    /// once its last send completed and a message arrived, until `iters`
    /// messages went each way over all QPs; then the throughput lines.
    fn run(&mut self, o: &Opts, cq: &mut Cq, depth: usize) -> Result<(), String> {
        // pending[i]: what QP i still waits for before its next send.
        let mut pending = vec![RECV_WRID; self.qps.len()];
        if o.servername.is_some() {
            for (i, p) in pending.iter_mut().enumerate() {
                self.send(i)?;
                *p = SEND_WRID | RECV_WRID;
            }
        }
        let start = Instant::now();
        let (mut rcnt, mut scnt) = (0u32, 0u32);
        let mut wcs = Vec::with_capacity(depth);
        while rcnt < o.iters || scnt < o.iters {
            next_completions(cq, &mut wcs, o.use_event)?;
            for mut wc in wcs.drain(..) {
                check_status(&wc)?;
                let Some(i) = self.qps.iter().position(|q| q.qp_num() == wc.qp_num) else {
                    return Err(format!("Couldn't find QPN {:06x}", wc.qp_num));
                };
                match wc.wr_id {
                    SEND_WRID => {
                        scnt += 1;
                        // A sent buffer (not inline) comes back to its QP.
                        if let Some(mr) = wc.take_mr() {
                            self.send_bufs[i] = Some(mr);
                        }
                    }
                    RECV_WRID => {
                        // The buffer of the receive, from whichever QP took it.
                        let mr = wc.take_mr().ok_or("receive came back without its buffer")?;
                        self.spare.push(mr);
                        if self.srq.posted() <= u64::from(o.num_qp) {
                            refill(self.srq, self.spare, o.rx_depth)?;
                        }
                        rcnt += 1;
                    }
                    other => return Err(format!("Completion for unknown wr_id {other}")),
                }
                pending[i] &= !wc.wr_id;
                if scnt < o.iters && pending[i] == 0 {
                    self.send(i)?;
                    pending[i] = RECV_WRID | SEND_WRID;
                }
            }
        }
        print_rate(o.size, o.iters, start);
        Ok(())
    }

    /// Sends QP `i`'s buffer.
    fn send(&mut self, i: usize) -> Result<(), String> {
        let buf = self.send_bufs[i]
            .take()
            .ok_or("Couldn't post send: no buffer")?;
        self.send_bufs[i] = post_send(&mut self.qps[i], buf, self.use_inline)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_verbs::device::Mtu;

    fn args(s: &str) -> Vec<String> {
        pingpong::test_args("srq_pingpong", s)
    }

    #[test]
    fn defaults_match_the_c_program() {
        let o = parse_args(&args("")).unwrap();
        assert_eq!(
            (
                o.port, o.ib_port, o.size, o.mtu, o.num_qp, o.rx_depth, o.iters, o.sl
            ),
            (18515, 1, 4096, Mtu::Mtu1024, 16, 500, 1000, 0)
        );
        assert!(!o.use_event);
        assert!(o.gidx.is_none() && o.servername.is_none() && o.ib_devname.is_none());
    }

    #[test]
    fn getopt_forms() {
        let o = parse_args(&args(
            "-p 1234 -d rxe0 -s1 -m 4096 -q4 -r 0x10 -n 010 -l 2 -eg 1 10.99.0.1",
        ))
        .unwrap();
        assert_eq!(o.port, 1234);
        assert_eq!(o.ib_devname.as_deref(), Some("rxe0"));
        assert_eq!((o.size, o.mtu, o.num_qp), (1, Mtu::Mtu4096, 4));
        assert_eq!((o.rx_depth, o.iters, o.sl), (16, 8, 2));
        assert!(o.use_event);
        assert_eq!(o.gidx, Some(1));
        assert_eq!(o.servername.as_deref(), Some("10.99.0.1"));
        let o = parse_args(&args("--num-qp=2 --size 65536 --events --gid-idx=-1 host")).unwrap();
        assert_eq!(
            (o.num_qp, o.size, o.use_event, o.gidx),
            (2, 65536, true, None)
        );
        for bad in [
            "-x", "-m 1000", "-p 70000", "a b", "-i 0", "-p", "-c", "-o", "-s 0", "-q 0", "-q 257",
        ] {
            assert!(parse_args(&args(bad)).is_err(), "{bad}");
        }
    }
}
