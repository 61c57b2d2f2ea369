//! `uc_pingpong`: a Rust port of rdma-core's `ibv_uc_pingpong`, wire-compatible
//! with it (either side can be the C program), on a `Qp<Uc, _>`.
//!
//! ```text
//! uc_pingpong [options]          start a server and wait for connection
//! uc_pingpong [options] <host>   connect to server at <host>
//! ```
//!
//! Same options, defaults and output as the C program: `-p` TCP port (18515),
//! `-d` device (first found), `-i` device port (1), `-s` message size (4096),
//! `-m` path MTU (1024), `-r` receives posted at a time (500), `-n` exchanges
//! (1000), `-l` service level (0), `-e` sleep on CQ events instead of
//! busy-polling, `-g` GID index (none; RoCE needs one, usually 1 on
//! soft-RoCE). Long forms (`--port=18515`) work too.
//!
//! UC is unreliable: a message lost on the wire is not resent, and then both
//! sides wait forever (as the C program does). The data path and its buffer
//! handling are `rc_pingpong`'s (`examples/shared/pingpong.rs`).
//!
//! In the soft-RoCE guest, against the C program:
//! `cargo xtask run -- sh -c 'ibv_uc_pingpong -g 1 & sleep 1; target/debug/examples/uc_pingpong -g 1 10.99.0.1'`

#[path = "shared/pingpong.rs"]
mod pingpong;

use std::process::ExitCode;

use pingpong::{
    Common, LoopParams, Resources, arm, caps, exchange_printed, local_endpoint, main_with,
    parse_common, post_receives, print_option_lines, print_usage_head, run_loop, setup,
};
use rdma_verbs::prelude::*;

/// The C program's options: the common ones.
type Opts = Common;

fn usage(argv0: &str) {
    print_usage_head(argv0);
    print_option_lines("pdismrnleg", 4096);
}

/// getopt_long("p:d:i:s:m:r:n:l:eg:") with GNU permutation.
fn parse_args(args: &[String]) -> Result<Opts, String> {
    parse_common(args, "pdismrnleg", 4096)
}

/// INIT → RTR → RTS as `pp_connect_ctx` does it: a GRH only when the peer
/// sent a GID, from our `-g` index.
fn connect(
    qp: Qp<Uc, Init>,
    o: &Opts,
    my_psn: u32,
    dest: &Endpoint,
) -> Result<Qp<Uc, Rts>, String> {
    let grh = (dest.gid.interface_id() != 0).then(|| o.gidx.unwrap_or(0));
    let attr = UcRtrAttr::new(dest, o.ib_port, o.mtu, grh).sl(o.sl);
    let qp = qp
        .rtr(attr)
        .map_err(|e| format!("Failed to modify QP to RTR: {}", e.error))?;
    qp.rts(my_psn)
        .map_err(|e| format!("Failed to modify QP to RTS: {}", e.error))
}

fn main() -> ExitCode {
    main_with("uc_pingpong", usage, parse_args, run)
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
        |_| Ok(AccessFlags::LOCAL_WRITE),
    )?;
    let qp = Qp::new_uc(&pd, &cq, &cq, caps(o.rx_depth))
        .map_err(|e| format!("Couldn't create QP: {e}"))?;
    let use_inline = o.size > 0 && qp.caps().max_inline_data as usize >= o.size;
    let mut qp = qp
        .init(UcInitAttr::new(o.ib_port))
        .map_err(|e| format!("Failed to modify QP to INIT: {}", e.error))?;
    post_receives(&mut qp, bufs)?;
    arm(&mut cq, o.use_event)?;
    let my_dest = local_endpoint(&qp, &ctx, o.ib_port, o.gidx)?;
    let (_, mut qp) = exchange_printed(o, &my_dest, ',', |rem| connect(qp, o, my_dest.psn, rem))?;
    let params = LoopParams::new(o, false, use_inline);
    let last = run_loop(&mut qp, &mut cq, &params, first_send)?;
    // The C program's order: QP, CQ, MR, PD, channel, context.
    drop(qp);
    drop(cq);
    drop(last);
    drop((pd, channel, ctx));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_verbs::device::Mtu;

    fn args(s: &str) -> Vec<String> {
        pingpong::test_args("uc_pingpong", s)
    }

    #[test]
    fn defaults_and_options_match_the_c_program() {
        let o = parse_args(&args("")).unwrap();
        assert_eq!(
            (o.port, o.ib_port, o.size, o.mtu, o.rx_depth, o.iters, o.sl),
            (18515, 1, 4096, Mtu::Mtu1024, 500, 1000, 0)
        );
        assert!(!o.use_event && o.gidx.is_none() && o.servername.is_none());
        let o = parse_args(&args("-eg1 -m 2048 -n 0x10 --size=1 host")).unwrap();
        assert!(o.use_event);
        assert_eq!(
            (o.gidx, o.mtu, o.iters, o.size),
            (Some(1), Mtu::Mtu2048, 16, 1)
        );
        assert_eq!(o.servername.as_deref(), Some("host"));
        // RC-only options of ibv_rc_pingpong are not ibv_uc_pingpong's.
        assert!(parse_args(&args("-c")).is_err());
        assert!(parse_args(&args("-o")).is_err());
        assert!(parse_args(&args("-m 1000")).is_err());
        assert!(parse_args(&args("a b")).is_err());
    }
}
