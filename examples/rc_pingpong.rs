//! `rc_pingpong`: a Rust port of rdma-core's `ibv_rc_pingpong`, wire-compatible
//! with it (either side can be the C program).
//!
//! ```text
//! rc_pingpong [options]          start a server and wait for connection
//! rc_pingpong [options] <host>   connect to server at <host>
//! ```
//!
//! Same options, defaults and output as the C program: `-p` TCP port (18515),
//! `-d` device (first found), `-i` device port (1), `-s` message size (4096),
//! `-m` path MTU (1024), `-r` receives posted at a time (500), `-n` exchanges
//! (1000), `-l` service level (0), `-e` sleep on CQ events instead of
//! busy-polling, `-g` GID index (none; RoCE needs one, usually 1 on soft-RoCE),
//! `-c` validate the received buffer, `-o` on-demand paging (refused when the
//! device lacks ODP for RC send/receive). Long forms (`--port=18515`) work too.
//!
//! Differences from the C program, all invisible on the wire:
//! * The data path is this crate's safe one: each receive owns its buffer
//!   (one registration cut into `rx_depth + 1` pieces of `size` bytes), and
//!   what a side sends is the buffer it last received, as in the C program,
//!   where one buffer serves both directions.
//! * The client retries connecting for up to 10 seconds (the C client gives
//!   up at once when the server is not listening yet).
//!
//! Run it inside the soft-RoCE guest, e.g. against the C program:
//! `cargo xtask run -- sh -c 'ibv_rc_pingpong -g 1 & sleep 1; target/debug/examples/rc_pingpong -g 1 10.99.0.1'`

use std::process::ExitCode;

#[path = "shared/pingpong.rs"]
mod pingpong;

use pingpong::{
    Common, LoopParams, Resources, arm, caps, exchange_printed, getopt, local_endpoint, long_opts,
    main_with, post_receives, print_option_lines, print_usage_head, run_loop, setup,
};
use rdma_verbs::ffi;
use rdma_verbs::prelude::*;

/// The C program's options: the common ones, ODP and the data check.
struct Opts {
    c: Common,
    use_odp: bool,
    validate: bool,
}

impl std::ops::Deref for Opts {
    type Target = Common;
    fn deref(&self) -> &Common {
        &self.c
    }
}

fn usage(argv0: &str) {
    print_usage_head(argv0);
    print_option_lines("pdismrnleg", 4096);
    println!("  -o, --odp\t\t    use on demand paging");
    println!("  -c, --chk\t            validate received buffer");
    print_option_lines("h", 4096);
}

/// getopt_long("p:d:i:s:m:r:n:l:eg:oc") with GNU permutation.
fn parse_args(args: &[String]) -> Result<Opts, String> {
    let long = long_opts(
        "pdismrnleg",
        &[
            ("odp", 'o', false),
            ("chk", 'c', false),
            ("iodp", 'O', false),
            ("prefetch", 'P', false),
            ("ts", 't', false),
            ("dm", 'j', false),
            ("new_send", 'N', false),
        ],
    );
    let (opts, positional) = getopt(args, &long)?;
    let mut o = Opts {
        c: Common::new(4096),
        use_odp: false,
        validate: false,
    };
    for (c, v) in opts {
        match c {
            'o' => o.use_odp = true,
            'c' => o.validate = true,
            c if o.c.apply(c, &v)? => {}
            other => return Err(format!("option -{other} is not supported by this port")),
        }
    }
    o.c.finish(positional)?;
    Ok(o)
}

/// INIT → RTR → RTS as `pp_connect_ctx` does it.
fn connect(
    qp: Qp<Rc, Init>,
    o: &Opts,
    my_psn: u32,
    dest: &Endpoint,
) -> Result<Qp<Rc, rdma_verbs::qp::Rts>, String> {
    // A GRH only when the peer sent a GID, with our -g index (C: sgid_idx).
    let grh = (dest.gid.interface_id() != 0).then(|| o.gidx.unwrap_or(0));
    let attr = RtrAttr::new(dest, o.ib_port, o.mtu, grh).sl(o.sl);
    let qp = qp
        .rtr(attr)
        .map_err(|e| format!("Failed to modify QP to RTR: {}", e.error))?;
    qp.rts(RtsAttr::new(my_psn))
        .map_err(|e| format!("Failed to modify QP to RTS: {}", e.error))
}

fn main() -> ExitCode {
    main_with("rc_pingpong", usage, parse_args, run)
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
            if !o.use_odp {
                return Ok(AccessFlags::LOCAL_WRITE);
            }
            let attr = ctx
                .query_device()
                .map_err(|e| format!("Couldn't query device for its features: {e}"))?;
            let rc_caps = ffi::IBV_ODP_SUPPORT_SEND | ffi::IBV_ODP_SUPPORT_RECV;
            if attr.odp_general_caps & u64::from(ffi::IBV_ODP_SUPPORT) == 0
                || attr.odp_rc_caps & rc_caps != rc_caps
            {
                return Err("The device isn't ODP capable or does not support RC send and receive with ODP (unsupported)".into());
            }
            Ok(AccessFlags::LOCAL_WRITE | AccessFlags::ON_DEMAND)
        },
    )?;
    let qp =
        Qp::new(&pd, &cq, &cq, caps(o.rx_depth)).map_err(|e| format!("Couldn't create QP: {e}"))?;
    let use_inline = o.size > 0 && qp.caps().max_inline_data as usize >= o.size;
    let mut qp = qp
        .init(InitAttr::new(o.ib_port, AccessFlags::empty()))
        .map_err(|e| format!("Failed to modify QP to INIT: {}", e.error))?;
    post_receives(&mut qp, bufs)?;
    arm(&mut cq, o.use_event)?;
    let my_dest = local_endpoint(&qp, &ctx, o.ib_port, o.gidx)?;
    let (_, mut qp) =
        exchange_printed(&o.c, &my_dest, ',', |rem| connect(qp, o, my_dest.psn, rem))?;

    let params = LoopParams::new(&o.c, o.validate, use_inline);
    let last = run_loop(&mut qp, &mut cq, &params, first_send)?;
    // Destroy in the C program's order: QP, CQ (its Drop acknowledges the CQ
    // events), MRs, PD, channel, context.
    drop(qp);
    drop(last);
    drop(cq);
    drop((pd, channel, ctx));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_verbs::device::Mtu;

    fn args(s: &str) -> Vec<String> {
        pingpong::test_args("rc_pingpong", s)
    }

    #[test]
    fn defaults_match_the_c_program() {
        let o = parse_args(&args("")).unwrap();
        assert_eq!(
            (o.port, o.ib_port, o.size, o.mtu, o.rx_depth, o.iters, o.sl),
            (18515, 1, 4096, Mtu::Mtu1024, 500, 1000, 0)
        );
        assert!(!o.use_event && !o.use_odp && !o.validate);
        assert!(o.gidx.is_none() && o.servername.is_none() && o.ib_devname.is_none());
    }

    #[test]
    fn getopt_forms() {
        let o = parse_args(&args(
            "-p 1234 -d rxe0 -s1 -m 4096 -r 0x10 -n 010 -l 2 -eg 1 -c 10.99.0.1 -o",
        ))
        .unwrap();
        assert_eq!(o.port, 1234);
        assert_eq!(o.ib_devname.as_deref(), Some("rxe0"));
        assert_eq!(o.size, 1);
        assert_eq!(o.mtu, Mtu::Mtu4096);
        assert_eq!(o.rx_depth, 16);
        assert_eq!(o.iters, 8);
        assert_eq!(o.sl, 2);
        assert!(o.use_event && o.validate && o.use_odp);
        assert_eq!(o.gidx, Some(1));
        assert_eq!(o.servername.as_deref(), Some("10.99.0.1"));
        let o = parse_args(&args("--port=99 --size 65536 --events --gid-idx=-1 host")).unwrap();
        assert_eq!(
            (o.port, o.size, o.use_event, o.gidx),
            (99, 65536, true, None)
        );
        assert!(parse_args(&args("-x")).is_err());
        assert!(parse_args(&args("-m 1000")).is_err());
        assert!(parse_args(&args("-p 70000")).is_err());
        assert!(parse_args(&args("a b")).is_err());
        assert!(parse_args(&args("-i 0")).is_err());
        assert!(parse_args(&args("-p")).is_err());
        assert!(parse_args(&args("-t")).is_err());
        assert!(
            parse_args(&args("-g 300")).is_err(),
            "not silently \"no GID\""
        );
    }
}
