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
use std::time::{Duration, Instant};

use rdma_verbs::exchange::{self, ExchangeListener};
use rdma_verbs::qp::Init;
use rdma_verbs::{
    AccessFlags, CompletionChannel, Context, Cq, Endpoint, Gid, InitAttr, LinkLayer, Mr, Mtu, Pd,
    Qp, QpCaps, Rc, RecvWr, RtrAttr, RtsAttr, SendWr, ffi,
};

const RECV_WRID: u64 = 1;
const SEND_WRID: u64 = 2;

/// How long the client keeps trying to reach the server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

struct Opts {
    port: u16,
    ib_devname: Option<String>,
    ib_port: u8,
    size: usize,
    mtu: Mtu,
    rx_depth: u32,
    iters: u32,
    sl: u8,
    use_event: bool,
    gidx: Option<u8>,
    use_odp: bool,
    validate: bool,
    servername: Option<String>,
}

impl Default for Opts {
    fn default() -> Opts {
        Opts {
            port: exchange::DEFAULT_PORT,
            ib_devname: None,
            ib_port: 1,
            size: 4096,
            mtu: Mtu::Mtu1024,
            rx_depth: 500,
            iters: 1000,
            sl: 0,
            use_event: false,
            gidx: None,
            use_odp: false,
            validate: false,
            servername: None,
        }
    }
}

fn usage(argv0: &str) {
    println!("Usage:");
    println!("  {argv0}            start a server and wait for connection");
    println!("  {argv0} <host>     connect to server at <host>");
    println!();
    println!("Options:");
    println!("  -p, --port=<port>      listen on/connect to port <port> (default 18515)");
    println!("  -d, --ib-dev=<dev>     use IB device <dev> (default first device found)");
    println!("  -i, --ib-port=<port>   use port <port> of IB device (default 1)");
    println!("  -s, --size=<size>      size of message to exchange (default 4096)");
    println!("  -m, --mtu=<size>       path MTU (default 1024)");
    println!("  -r, --rx-depth=<dep>   number of receives to post at a time (default 500)");
    println!("  -n, --iters=<iters>    number of exchanges (default 1000)");
    println!("  -l, --sl=<sl>          service level value");
    println!("  -e, --events           sleep on CQ events (default poll)");
    println!("  -g, --gid-idx=<gid index> local port gid index");
    println!("  -o, --odp\t\t    use on demand paging");
    println!("  -c, --chk\t            validate received buffer");
    println!("  -h, --help             print this help");
}

/// `strtol(s, NULL, 0)`: decimal, `0x` hex or `0` octal, optional sign.
fn c_long(s: &str) -> Option<i64> {
    let s = s.trim_start();
    let (neg, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        i64::from_str_radix(h, 16).ok()?
    } else if s.len() > 1 && s.starts_with('0') {
        i64::from_str_radix(&s[1..], 8).ok()?
    } else {
        s.parse::<i64>().ok()?
    };
    Some(if neg { -v } else { v })
}

fn num<T: TryFrom<i64>>(opt: char, v: &str) -> Result<T, String> {
    c_long(v)
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| format!("invalid value `{v}` for -{opt}"))
}

/// getopt_long("p:d:i:s:m:r:n:l:eg:oc") with GNU permutation.
fn parse_args(args: &[String]) -> Result<Opts, String> {
    const LONG: &[(&str, char, bool)] = &[
        ("port", 'p', true),
        ("ib-dev", 'd', true),
        ("ib-port", 'i', true),
        ("size", 's', true),
        ("mtu", 'm', true),
        ("rx-depth", 'r', true),
        ("iters", 'n', true),
        ("sl", 'l', true),
        ("events", 'e', false),
        ("gid-idx", 'g', true),
        ("odp", 'o', false),
        ("chk", 'c', false),
        ("iodp", 'O', false),
        ("prefetch", 'P', false),
        ("ts", 't', false),
        ("dm", 'j', false),
        ("new_send", 'N', false),
    ];
    let takes_arg = |c: char| LONG.iter().find(|l| l.1 == c).map(|l| l.2);
    let mut o = Opts::default();
    let mut positional = Vec::new();
    let mut it = args.iter().skip(1);
    let mut only_positional = false;
    while let Some(arg) = it.next() {
        let mut opts: Vec<(char, Option<String>)> = Vec::new();
        if only_positional || arg == "-" || !arg.starts_with('-') {
            positional.push(arg.clone());
            continue;
        } else if arg == "--" {
            only_positional = true;
            continue;
        } else if let Some(long) = arg.strip_prefix("--") {
            let (name, val) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (long, None),
            };
            let Some(&(_, c, has_arg)) = LONG.iter().find(|l| l.0 == name) else {
                return Err(format!("unrecognized option '--{name}'"));
            };
            let val = match (has_arg, val) {
                (true, Some(v)) => Some(v),
                (true, None) => Some(
                    it.next()
                        .cloned()
                        .ok_or_else(|| format!("option '--{name}' requires an argument"))?,
                ),
                (false, Some(_)) => {
                    return Err(format!("option '--{name}' doesn't allow an argument"));
                }
                (false, None) => None,
            };
            opts.push((c, val));
        } else {
            let body = &arg[1..];
            for (i, c) in body.char_indices() {
                match takes_arg(c) {
                    None => return Err(format!("invalid option -- '{c}'")),
                    Some(false) => opts.push((c, None)),
                    Some(true) => {
                        let rest = &body[i + c.len_utf8()..];
                        let v = if rest.is_empty() {
                            it.next()
                                .cloned()
                                .ok_or_else(|| format!("option requires an argument -- '{c}'"))?
                        } else {
                            rest.to_owned()
                        };
                        opts.push((c, Some(v)));
                        break;
                    }
                }
            }
        }
        for (c, v) in opts {
            let v = v.unwrap_or_default();
            match c {
                'p' => o.port = num('p', &v)?,
                'd' => o.ib_devname = Some(v),
                'i' => {
                    o.ib_port = num('i', &v)?;
                    if o.ib_port < 1 {
                        return Err("-i must be at least 1".into());
                    }
                }
                's' => o.size = num('s', &v)?,
                'm' => {
                    let bytes: u32 = num('m', &v)?;
                    o.mtu = Mtu::from_bytes(bytes)
                        .ok_or_else(|| format!("invalid MTU {v} (256, 512, 1024, 2048 or 4096)"))?;
                }
                'r' => o.rx_depth = num('r', &v)?,
                'n' => o.iters = num('n', &v)?,
                'l' => o.sl = num('l', &v)?,
                'e' => o.use_event = true,
                'g' => {
                    let g: i64 = num('g', &v)?;
                    o.gidx = u8::try_from(g).ok();
                }
                'o' => o.use_odp = true,
                'c' => o.validate = true,
                other => return Err(format!("option -{other} is not supported by this port")),
            }
        }
    }
    match positional.len() {
        0 => {}
        1 => o.servername = positional.pop(),
        _ => return Err("too many arguments".into()),
    }
    if o.rx_depth == 0 {
        return Err("-r must be at least 1".into());
    }
    Ok(o)
}

unsafe extern "C" {
    /// glibc's `inet_ntop` (not bound by the libc crate).
    fn inet_ntop(
        af: libc::c_int,
        src: *const libc::c_void,
        dst: *mut libc::c_char,
        size: libc::socklen_t,
    ) -> *const libc::c_char;
}

/// The GID as `inet_ntop(AF_INET6)` prints it, exactly like the C program.
fn ntop(gid: &Gid) -> String {
    let mut buf = [0 as libc::c_char; 64];
    let raw = gid.raw();
    // SAFETY: raw is 16 bytes (an in6_addr); buf has room for INET6_ADDRSTRLEN.
    let p = unsafe {
        inet_ntop(
            libc::AF_INET6,
            raw.as_ptr().cast(),
            buf.as_mut_ptr(),
            buf.len() as libc::socklen_t,
        )
    };
    if p.is_null() {
        return gid.to_string();
    }
    // SAFETY: inet_ntop wrote a NUL-terminated string into buf.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

fn print_dest(which: &str, d: &Endpoint) {
    println!(
        "  {which} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        d.lid,
        d.qpn,
        d.psn,
        ntop(&d.gid)
    );
}

fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&p| p > 0)
        .unwrap_or(4096)
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

/// How long the ping-pong may go without a completion before it gives up. ibv_rc_pingpong
/// waits forever, and with its retry_cnt of 7 rxe never reports a dead peer either, so a
/// peer that died would leave this side spinning for good.
const STALL_LIMIT: Duration = Duration::from_secs(20);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let argv0 = args
        .first()
        .map_or("rc_pingpong", String::as_str)
        .to_owned();
    if args.iter().skip(1).any(|a| a == "-h" || a == "--help") {
        usage(&argv0);
        return ExitCode::SUCCESS;
    }
    let o = match parse_args(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{argv0}: {e}");
            usage(&argv0);
            return ExitCode::from(1);
        }
    };
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

fn run(o: &Opts) -> Result<(), String> {
    let ctx = Context::open(o.ib_devname.as_deref()).map_err(|e| match (&o.ib_devname, e) {
        (Some(name), rdma_verbs::Error::DeviceNotFound { .. }) => {
            format!("IB device {name} not found")
        }
        (_, rdma_verbs::Error::NoDevices) => "No IB devices found".to_owned(),
        (_, e) => format!("Couldn't get context: {e}"),
    })?;
    let channel = if o.use_event {
        Some(
            CompletionChannel::new(&ctx)
                .map_err(|e| format!("Couldn't create completion channel: {e}"))?,
        )
    } else {
        None
    };
    let pd = Pd::new(&ctx).map_err(|e| format!("Couldn't allocate PD: {e}"))?;

    let mut access = AccessFlags::LOCAL_WRITE;
    if o.use_odp {
        let attr = ctx
            .query_device()
            .map_err(|e| format!("Couldn't query device for its features: {e}"))?;
        let rc_caps = ffi::IBV_ODP_SUPPORT_SEND | ffi::IBV_ODP_SUPPORT_RECV;
        if attr.odp_general_caps & u64::from(ffi::IBV_ODP_SUPPORT) == 0
            || attr.odp_rc_caps & rc_caps != rc_caps
        {
            return Err("The device isn't ODP capable or does not support RC send and receive with ODP (unsupported)".into());
        }
        access |= AccessFlags::ON_DEMAND;
    }

    // Buffers: rx_depth receives plus the first message to send, from one registration.
    let nbufs = o.rx_depth as usize + 1;
    let mut bufs: Vec<Option<Mr>> = Vec::with_capacity(nbufs);
    if o.size == 0 {
        bufs.resize_with(nbufs, || None);
    } else {
        let total = o
            .size
            .checked_mul(nbufs)
            .ok_or("message size times rx depth overflows")?;
        let mut all =
            Mr::new(&pd, total, access).map_err(|e| format!("Couldn't register MR: {e}"))?;
        for _ in 0..nbufs - 1 {
            bufs.push(Some(all.split_to(o.size).map_err(|e| e.to_string())?));
        }
        bufs.push(Some(all));
    }
    let mut first_send = bufs.pop().flatten();
    if let Some(b) = first_send.as_mut() {
        b.fill(0x7b).map_err(|e| e.to_string())?;
    }

    let depth = o.rx_depth + 1;
    let mut cq = match &channel {
        Some(ch) => Cq::with_channel(&ctx, depth, ch),
        None => Cq::new(&ctx, depth),
    }
    .map_err(|e| format!("Couldn't create CQ: {e}"))?;

    let caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: o.rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
        sq_sig_all: false,
    };
    let qp = Qp::new(&pd, &cq, &cq, caps).map_err(|e| format!("Couldn't create QP: {e}"))?;
    let use_inline = o.size > 0 && qp.caps().max_inline_data as usize >= o.size;
    let mut qp = qp
        .init(InitAttr::new(o.ib_port, AccessFlags::empty()))
        .map_err(|e| format!("Failed to modify QP to INIT: {}", e.error))?;

    let recvs = bufs.into_iter().map(|b| match b {
        Some(mr) => RecvWr::new(RECV_WRID, mr),
        None => RecvWr::empty(RECV_WRID),
    });
    qp.post_recv_list(recvs)
        .map_err(|e| format!("Couldn't post receive ({}): {}", e.unposted.len(), e.error))?;

    if o.use_event {
        cq.req_notify(false)
            .map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }

    let portinfo = ctx
        .query_port(o.ib_port)
        .map_err(|e| format!("Couldn't get port info: {e}"))?;
    if portinfo.link_layer != LinkLayer::Ethernet && portinfo.lid == 0 {
        return Err("Couldn't get local LID".into());
    }
    let my_dest = match o.gidx {
        Some(g) => qp.endpoint(Some(g)),
        // Like ibv_rc_pingpong without -g: no GID on the wire.
        None => qp.endpoint(None).map(|e| rdma_verbs::Endpoint {
            gid: rdma_verbs::Gid::ZERO,
            ..e
        }),
    }
    .map_err(|_| format!("can't read sgid of index {}", o.gidx.unwrap_or(0)))?;
    print_dest("local address: ", &my_dest);

    let (rem_dest, mut qp) = match &o.servername {
        Some(host) => {
            let rem = exchange::client_exchange(host, o.port, &my_dest, CONNECT_TIMEOUT).map_err(
                |e| match e {
                    rdma_verbs::Error::Io { what, .. } if what.starts_with("connecting") => {
                        format!("Couldn't connect to {host}:{}: {e}", o.port)
                    }
                    e => format!("Couldn't read/write remote address: {e}"),
                },
            )?;
            print_dest("remote address:", &rem);
            let qp = connect(qp, o, my_dest.psn, &rem)?;
            (rem, qp)
        }
        None => {
            let listener = ExchangeListener::bind(o.port)
                .map_err(|e| format!("Couldn't listen to port {}: {e}", o.port))?;
            let (rem, qp) = exchange::server_exchange(&listener, &my_dest, None, |rem| {
                connect(qp, o, my_dest.psn, rem).map_err(rdma_verbs::Error::Protocol)
            })
            .map_err(|e| format!("Couldn't exchange addresses: {e}"))?;
            print_dest("remote address:", &rem);
            (rem, qp)
        }
    };
    let _ = rem_dest;

    let page = page_size();
    if o.servername.is_some() && o.validate {
        if let Some(b) = first_send.as_mut() {
            for i in (0..o.size).step_by(page) {
                // C: buf[i] = i / page_size % sizeof(char), which is always 0.
                b.write_at(i, &[0]).map_err(|e| e.to_string())?;
            }
        }
    }

    // The buffer to send next: the last one received (the C program's single buffer).
    let mut next_send: Option<Mr> = first_send;
    let mut pending = RECV_WRID;
    let post_send =
        |qp: &mut Qp<Rc, rdma_verbs::qp::Rts>, buf: Option<Mr>| -> Result<Option<Mr>, String> {
            let err = |e: rdma_verbs::PostError| format!("Couldn't post send: {}", e.error);
            match buf {
                Some(mr) if use_inline => {
                    let data = mr.as_slice().map_err(|e| e.to_string())?;
                    qp.post_send(SendWr::send_inline(SEND_WRID, data))
                        .map_err(err)?;
                    // The NIC copied the data: the buffer is free again.
                    Ok(Some(mr))
                }
                Some(mr) => qp
                    .post_send(SendWr::send(SEND_WRID).sge(mr))
                    .map(|()| None)
                    .map_err(err),
                None => qp
                    .post_send(SendWr::send(SEND_WRID))
                    .map(|()| None)
                    .map_err(err),
            }
        };
    // Receives posted: at most rx_depth (C: "receives to post at a time"); a
    // buffer that comes back while rx_depth are posted waits in `spare`.
    let mut posted = o.rx_depth;
    let mut spare: Vec<Mr> = Vec::new();
    let mut give_back = |qp: &mut Qp<Rc, rdma_verbs::qp::Rts>,
                         posted: &mut u32,
                         buf: Option<Mr>|
     -> Result<(), String> {
        let buf = match buf {
            Some(mr) if *posted >= o.rx_depth => {
                spare.push(mr);
                return Ok(());
            }
            Some(mr) => Some(mr),
            None if o.size == 0 && *posted < o.rx_depth => None,
            None => match spare.pop() {
                Some(mr) if *posted < o.rx_depth => Some(mr),
                Some(mr) => {
                    spare.push(mr);
                    return Ok(());
                }
                None => return Ok(()),
            },
        };
        let wr = match buf {
            Some(mr) => RecvWr::new(RECV_WRID, mr),
            None => RecvWr::empty(RECV_WRID),
        };
        qp.post_recv(wr)
            .map_err(|e| format!("Couldn't post receive ({posted}): {}", e.error))?;
        *posted += 1;
        Ok(())
    };

    if o.servername.is_some() {
        if let Some(freed) = post_send(&mut qp, next_send.take())? {
            give_back(&mut qp, &mut posted, Some(freed))?;
        }
        pending |= SEND_WRID;
    }

    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut wcs = Vec::with_capacity(2);
    let stalled = || {
        format!(
            "error: no completion for {} s: the peer stopped answering (its process died or \
             its QP failed)",
            STALL_LIMIT.as_secs()
        )
    };
    while rcnt < o.iters || scnt < o.iters {
        wcs.clear();
        if o.use_event {
            // 0 completions: the limit passed.
            let n = cq
                .wait_poll(&mut wcs, Some(STALL_LIMIT))
                .map_err(|e| format!("Failed to get cq_event: {e}"))?;
            if n == 0 {
                return Err(stalled());
            }
        } else {
            let idle_since = Instant::now();
            let mut spins = 0u32;
            while cq
                .poll(&mut wcs)
                .map_err(|e| format!("poll CQ failed {e}"))?
                == 0
            {
                spins = spins.wrapping_add(1);
                if spins % 4096 == 0 && idle_since.elapsed() > STALL_LIMIT {
                    return Err(stalled());
                }
            }
        }
        for mut wc in wcs.drain(..) {
            if !wc.status.is_success() {
                return Err(format!(
                    "Failed status {} ({}) for wr_id {}",
                    wc.status.description(),
                    wc.status.as_raw(),
                    wc.wr_id
                ));
            }
            match wc.wr_id {
                SEND_WRID => {
                    scnt += 1;
                    // A sent buffer (not inline) comes back: receive into it again.
                    if let Some(mr) = wc.take_mr() {
                        give_back(&mut qp, &mut posted, Some(mr))?;
                    }
                }
                RECV_WRID => {
                    rcnt += 1;
                    posted -= 1;
                    let got = wc.take_mr();
                    if o.validate && o.servername.is_none() && rcnt == o.iters {
                        if let Some(mr) = &got {
                            let data = mr.as_slice().map_err(|e| e.to_string())?;
                            for i in (0..o.size).step_by(page) {
                                if data[i] != 0 {
                                    println!("invalid data in page {}", i / page);
                                }
                            }
                        }
                    }
                    if o.size > 0 {
                        let got = got.ok_or("receive came back without its buffer")?;
                        if let Some(old) = next_send.replace(got) {
                            give_back(&mut qp, &mut posted, Some(old))?;
                        }
                    }
                    // Keep rx_depth receives posted (a spare buffer, or none for 0 bytes).
                    give_back(&mut qp, &mut posted, None)?;
                }
                other => return Err(format!("Completion for unknown wr_id {other}")),
            }
            pending &= !wc.wr_id;
            if scnt < o.iters && pending == 0 {
                let buf = if o.size == 0 { None } else { next_send.take() };
                if o.size > 0 && buf.is_none() {
                    return Err("Couldn't post send: no buffer".into());
                }
                if let Some(freed) = post_send(&mut qp, buf)? {
                    give_back(&mut qp, &mut posted, Some(freed))?;
                }
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    let usec = start.elapsed().as_secs_f64() * 1e6;
    let bytes = o.size as i64 * i64::from(o.iters) * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        o.iters,
        usec / 1e6,
        usec / f64::from(o.iters)
    );
    // Destroy in the C program's order: QP, CQ (its Drop acknowledges the CQ
    // events), MRs, PD, channel, context.
    drop(qp);
    drop(next_send);
    drop(cq);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        std::iter::once("rc_pingpong")
            .chain(s.split_whitespace())
            .map(str::to_owned)
            .collect()
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
    }

    #[test]
    fn ntop_matches_inet_ntop() {
        let g: Gid = "::ffff:10.99.0.1".parse().unwrap();
        assert_eq!(ntop(&g), "::ffff:10.99.0.1");
        assert_eq!(ntop(&Gid::ZERO), "::");
        assert_eq!(ntop(&"fe80::1".parse().unwrap()), "fe80::1");
    }
}
