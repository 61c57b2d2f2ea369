//! `ud_pingpong`: a Rust port of rdma-core's `ibv_ud_pingpong`, wire-compatible
//! with it (either side can be the C program), on a `Qp<Ud, _>`.
//!
//! ```text
//! ud_pingpong [options]          start a server and wait for connection
//! ud_pingpong [options] <host>   connect to server at <host>
//! ```
//!
//! Same options, defaults and output as the C program: `-p` TCP port (18515),
//! `-d` device (first found), `-i` device port (1), `-s` message size (2048;
//! at most the port's active MTU), `-r` receives posted at a time (500), `-n`
//! exchanges (1000), `-l` service level (0), `-e` sleep on CQ events instead
//! of busy-polling, `-g` GID index (none; RoCE needs one, usually 1 on
//! soft-RoCE). Long forms (`--port=18515`) work too. The Q_Key is the C
//! program's 0x11111111.
//!
//! Differences from the C program, invisible on the wire: each receive has
//! its own 40-byte GRH buffer and its payload buffer (two SGEs, where the C
//! program receives `size + 40` bytes into one buffer and skips the first
//! 40), so the GRH is never mistaken for data; each send names the address
//! handle, remote QPN and Q_Key in its request.
//!
//! In the soft-RoCE guest, against the C program:
//! `cargo xtask run -- sh -c 'ibv_ud_pingpong -g 1 & sleep 1; target/debug/examples/ud_pingpong -g 1 10.99.0.1'`

#[path = "shared/pingpong.rs"]
mod pingpong;

use std::process::ExitCode;

use pingpong::{
    Common, LoopParams, PingQp, RECV_WRID, Resources, arm, caps, exchange_printed, local_endpoint,
    main_with, parse_common, print_option_lines, print_usage_head, run_loop, setup,
};
use rdma_verbs::ah::GRH_LEN;
use rdma_verbs::prelude::*;

/// The Q_Key `ibv_ud_pingpong` uses on both sides.
const QKEY: u32 = 0x1111_1111;

/// The C program's options: the common ones.
type Opts = Common;

fn usage(argv0: &str) {
    print_usage_head(argv0);
    print_option_lines("pdisrneg", 2048);
}

/// getopt_long("p:d:i:s:r:n:l:eg:") with GNU permutation.
fn parse_args(args: &[String]) -> Result<Opts, String> {
    parse_common(args, "pdisrnleg", 2048)
}

/// The QP once it can send: where its datagrams go, and the GRH buffers of
/// the receives not posted yet.
struct UdPing {
    qp: Qp<Ud, Rts>,
    ah: AddressHandle,
    remote_qpn: u32,
    grhs: Vec<Mr>,
    size: usize,
}

impl PingQp for UdPing {
    fn send(&mut self, wr_id: u64, buf: Option<Mr>, inline: bool) -> Result<Option<Mr>, String> {
        let err = |e: rdma_verbs::qp::PostError| format!("Couldn't post send: {}", e.error);
        let (ah, qpn) = (&self.ah, self.remote_qpn);
        match buf {
            Some(mr) if inline => {
                let data = mr.as_slice().map_err(|e| e.to_string())?;
                self.qp
                    .post_send(UdSendWr::send_inline(wr_id, data, ah, qpn, QKEY))
                    .map_err(err)?;
                Ok(Some(mr))
            }
            Some(mr) => self
                .qp
                .post_send(UdSendWr::send_from(wr_id, mr, ah, qpn, QKEY))
                .map(|()| None)
                .map_err(err),
            None => self
                .qp
                .post_send(UdSendWr::send(wr_id, ah, qpn, QKEY))
                .map(|()| None)
                .map_err(err),
        }
    }

    fn recv(&mut self, wr_id: u64, buf: Option<Mr>) -> Result<(), String> {
        post_recv(&mut self.qp, &mut self.grhs, wr_id, buf)
    }

    fn received(&mut self, wc: &mut Completion) -> Result<Option<Mr>, String> {
        let msg = wc.take_ud().map_err(|e| e.to_string())?;
        self.grhs.push(msg.grh);
        if msg.len as usize != self.size {
            return Err(format!(
                "received {} bytes from QPN {:#08x}, expected {}",
                msg.len, msg.src_qp, self.size
            ));
        }
        Ok(msg.payload)
    }
}

/// Posts a receive of one datagram: a GRH buffer from `grhs`, the payload
/// into `buf` (`None`: no payload).
fn post_recv<S: rdma_verbs::qp::CanPostRecv>(
    qp: &mut Qp<Ud, S>,
    grhs: &mut Vec<Mr>,
    wr_id: u64,
    buf: Option<Mr>,
) -> Result<(), String> {
    let grh = grhs.pop().ok_or("no GRH buffer left")?;
    let wr = match buf {
        Some(mr) => UdRecvWr::new(wr_id, grh, mr),
        None => UdRecvWr::grh_only(wr_id, grh),
    };
    qp.post_recv(wr).map_err(|e| e.error.to_string())
}

/// RTR, RTS and the address handle towards `dest`, as `pp_connect_ctx` does
/// it: a GRH only when the peer sent a GID, from our `-g` index (without
/// `-g`, the port's default GID).
fn connect(
    qp: Qp<Ud, Init>,
    o: &Opts,
    my_psn: u32,
    dest: &Endpoint,
) -> Result<(Qp<Ud, Rts>, AddressHandle), String> {
    let qp = qp
        .rtr()
        .map_err(|e| format!("Failed to modify QP to RTR: {}", e.error))?;
    let qp = qp
        .rts(my_psn)
        .map_err(|e| format!("Failed to modify QP to RTS: {}", e.error))?;
    let av = qp.address_vector(dest, o.gidx).map_err(|e| e.to_string())?;
    let ah = AddressHandle::new(qp.pd(), av.sl(o.sl))
        .map_err(|e| format!("Failed to create AH: {e}"))?;
    Ok((qp, ah))
}

/// One GRH buffer per receive (and a spare), cut from one registration.
fn grh_buffers(pd: &Pd, rx_depth: u32) -> Result<Vec<Mr>, String> {
    let n = rx_depth as usize + 1;
    let mut all = Mr::new(pd, n * GRH_LEN, AccessFlags::LOCAL_WRITE)
        .map_err(|e| format!("Couldn't register MR: {e}"))?;
    let mut grhs = Vec::with_capacity(n);
    for _ in 1..n {
        grhs.push(all.split_to(GRH_LEN).map_err(|e| e.to_string())?);
    }
    grhs.push(all);
    Ok(grhs)
}

fn main() -> ExitCode {
    main_with("ud_pingpong", usage, parse_args, run)
}

fn run(o: &Opts) -> Result<(), String> {
    let Resources {
        ctx,
        channel,
        pd,
        mut cq,
        bufs,
        first_send,
    } = setup(
        o.ib_devname.as_deref(),
        o.use_event,
        o.size,
        o.rx_depth,
        |ctx| {
            let port = ctx
                .query_port(o.ib_port)
                .map_err(|_| format!("Unable to query port info for port {}", o.ib_port))?;
            let mtu = port.active_mtu.bytes() as usize;
            if o.size > mtu {
                return Err(format!("Requested size larger than port MTU ({mtu})"));
            }
            Ok(AccessFlags::LOCAL_WRITE)
        },
    )?;
    let mut grhs = grh_buffers(&pd, o.rx_depth)?;

    let qp = Qp::new_ud(&pd, &cq, &cq, caps(o.rx_depth))
        .map_err(|e| format!("Couldn't create QP: {e}"))?;
    let use_inline = o.size > 0 && qp.caps().max_inline_data as usize >= o.size;
    let mut qp = qp
        .init(UdInitAttr::new(o.ib_port, QKEY))
        .map_err(|e| format!("Failed to modify QP to INIT: {}", e.error))?;
    for buf in bufs {
        post_recv(&mut qp, &mut grhs, RECV_WRID, buf)
            .map_err(|e| format!("Couldn't post receive: {e}"))?;
    }
    arm(&mut cq, o.use_event)?;
    let my_dest = local_endpoint(&qp, &ctx, o.ib_port, o.gidx)?;
    let (rem_dest, (qp, ah)) =
        exchange_printed(o, &my_dest, ':', |rem| connect(qp, o, my_dest.psn, rem))?;
    let mut ping = UdPing {
        qp,
        ah,
        remote_qpn: rem_dest.qpn,
        grhs,
        size: o.size,
    };
    let params = LoopParams::new(o, false, use_inline);
    let last = run_loop(&mut ping, &mut cq, &params, first_send)?;
    // The C program's order: QP, CQ, MR, AH, PD, channel, context.
    let UdPing { qp, ah, grhs, .. } = ping;
    drop(qp);
    drop(cq);
    drop((last, grhs, ah));
    drop((pd, channel, ctx));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        pingpong::test_args("ud_pingpong", s)
    }

    #[test]
    fn defaults_and_options_match_the_c_program() {
        let o = parse_args(&args("")).unwrap();
        assert_eq!(
            (o.port, o.ib_port, o.size, o.rx_depth, o.iters, o.sl),
            (18515, 1, 2048, 500, 1000, 0)
        );
        assert!(!o.use_event && o.gidx.is_none() && o.servername.is_none());
        let o = parse_args(&args("-e -g 1 -s 0x100 -r 8 --iters=5 host")).unwrap();
        assert!(o.use_event);
        assert_eq!((o.gidx, o.size, o.rx_depth, o.iters), (Some(1), 256, 8, 5));
        assert_eq!(o.servername.as_deref(), Some("host"));
        // ibv_ud_pingpong has no -m (the path MTU is the port's) nor -c.
        assert!(parse_args(&args("-m 1024")).is_err());
        assert!(parse_args(&args("-c")).is_err());
        assert!(parse_args(&args("-r 0")).is_err());
        assert!(parse_args(&args("a b")).is_err());
    }
}
