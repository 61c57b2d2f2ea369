//! What the ports of rdma-core's `ibv_*_pingpong` share: their getopt_long
//! command line, the address lines they print, opening the device and the
//! TCP exchange of endpoints. Included with `#[path]` by each port.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdma_verbs::exchange::{self, ExchangeListener};
use rdma_verbs::qp::{Connected, Init, QpState, QpType, Rts};
use rdma_verbs::{
    AccessFlags, Completion, CompletionChannel, Context, Cq, Endpoint, Gid, LinkLayer, Mr, Mtu, Pd,
    Qp, QpCaps, Rc, RecvWr, SendWr, Uc, UcSendWr,
};

/// How long the client keeps trying to reach the server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `strtol(s, NULL, 0)`: decimal, `0x` hex or `0` octal, optional sign.
pub fn c_long(s: &str) -> Option<i64> {
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

/// The value of option `-opt` as a `T`, or an error naming it.
pub fn num<T: TryFrom<i64>>(opt: char, v: &str) -> Result<T, String> {
    c_long(v)
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| format!("invalid value `{v}` for -{opt}"))
}

/// One long option: its name, its short letter, whether it takes a value.
pub type LongOpt = (&'static str, char, bool);

/// The options every `ibv_*_pingpong` takes, with the C programs' defaults.
pub struct Common {
    /// `-p`: TCP port (18515).
    pub port: u16,
    /// `-d`: device (the first found).
    pub ib_devname: Option<String>,
    /// `-i`: device port (1).
    pub ib_port: u8,
    /// `-s`: message size.
    pub size: usize,
    /// `-m`: path MTU (1024; UD has no `-m`).
    pub mtu: Mtu,
    /// `-r`: receives posted at a time (500).
    pub rx_depth: u32,
    /// `-n`: exchanges (1000).
    pub iters: u32,
    /// `-l`: service level (0).
    pub sl: u8,
    /// `-e`: sleep on CQ events.
    pub use_event: bool,
    /// `-g`: GID index (none).
    pub gidx: Option<u8>,
    /// The server to connect to (none: be the server).
    pub servername: Option<String>,
}

impl Common {
    /// The C programs' defaults, with message size `size`.
    pub fn new(size: usize) -> Common {
        Common {
            port: rdma_verbs::exchange::DEFAULT_PORT,
            ib_devname: None,
            ib_port: 1,
            size,
            mtu: Mtu::Mtu1024,
            rx_depth: 500,
            iters: 1000,
            sl: 0,
            use_event: false,
            gidx: None,
            servername: None,
        }
    }

    /// Applies option `-c` with value `v`; `Ok(false)` if it is not a common one.
    pub fn apply(&mut self, c: char, v: &str) -> Result<bool, String> {
        match c {
            'p' => self.port = num('p', v)?,
            'd' => self.ib_devname = Some(v.to_owned()),
            'i' => {
                self.ib_port = num('i', v)?;
                if self.ib_port < 1 {
                    return Err("-i must be at least 1".into());
                }
            }
            's' => self.size = num('s', v)?,
            'm' => {
                let bytes: u32 = num('m', v)?;
                self.mtu = Mtu::from_bytes(bytes)
                    .ok_or_else(|| format!("invalid MTU {v} (256, 512, 1024, 2048 or 4096)"))?;
            }
            'r' => self.rx_depth = num('r', v)?,
            'n' => self.iters = num('n', v)?,
            'l' => self.sl = num('l', v)?,
            'e' => self.use_event = true,
            // A negative index is the C programs' "none".
            'g' => {
                let g = num::<i64>('g', v)?;
                self.gidx = match u8::try_from(g) {
                    Ok(g) => Some(g),
                    Err(_) if g < 0 => None,
                    Err(_) => return Err(format!("invalid -g {g}: a GID index is 0 to 255")),
                };
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Takes the server name from the positional arguments and checks the rest.
    pub fn finish(&mut self, mut positional: Vec<String>) -> Result<(), String> {
        match positional.len() {
            0 => {}
            1 => self.servername = positional.pop(),
            _ => return Err("too many arguments".into()),
        }
        if self.rx_depth == 0 {
            return Err("-r must be at least 1".into());
        }
        Ok(())
    }
}

/// A port's `main`: `-h`/`--help` prints `usage` and exits 0; options that do
/// not parse print the error and `usage` and exit 1; so does a failing `run`.
pub fn main_with<O>(
    name: &str,
    usage: fn(&str),
    parse: fn(&[String]) -> Result<O, String>,
    run: fn(&O) -> Result<(), String>,
) -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let argv0 = args.first().map_or(name, String::as_str).to_owned();
    if args.iter().skip(1).any(|a| a == "-h" || a == "--help") {
        usage(&argv0);
        return ExitCode::SUCCESS;
    }
    let o = match parse(&args) {
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

/// getopt_long with GNU permutation over `args` (`args[0]` is the program):
/// the options in order, as (letter, value), and the positional arguments.
#[allow(clippy::type_complexity)]
pub fn getopt(
    args: &[String],
    long: &[LongOpt],
) -> Result<(Vec<(char, String)>, Vec<String>), String> {
    let takes_arg = |c: char| long.iter().find(|l| l.1 == c).map(|l| l.2);
    let mut opts = Vec::new();
    let mut positional = Vec::new();
    let mut it = args.iter().skip(1);
    let mut only_positional = false;
    while let Some(arg) = it.next() {
        if only_positional || arg == "-" || !arg.starts_with('-') {
            positional.push(arg.clone());
        } else if arg == "--" {
            only_positional = true;
        } else if let Some(body) = arg.strip_prefix("--") {
            let (name, val) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_owned())),
                None => (body, None),
            };
            let Some(&(_, c, has_arg)) = long.iter().find(|l| l.0 == name) else {
                return Err(format!("unrecognized option '--{name}'"));
            };
            let val = match (has_arg, val) {
                (true, Some(v)) => v,
                (true, None) => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("option '--{name}' requires an argument"))?,
                (false, Some(_)) => {
                    return Err(format!("option '--{name}' doesn't allow an argument"));
                }
                (false, None) => String::new(),
            };
            opts.push((c, val));
        } else {
            let body = &arg[1..];
            for (i, c) in body.char_indices() {
                match takes_arg(c) {
                    None => return Err(format!("invalid option -- '{c}'")),
                    Some(false) => opts.push((c, String::new())),
                    Some(true) => {
                        let rest = &body[i + c.len_utf8()..];
                        let v = if rest.is_empty() {
                            it.next()
                                .cloned()
                                .ok_or_else(|| format!("option requires an argument -- '{c}'"))?
                        } else {
                            rest.to_owned()
                        };
                        opts.push((c, v));
                        break;
                    }
                }
            }
        }
    }
    Ok((opts, positional))
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

/// The GID as `inet_ntop(AF_INET6)` prints it, exactly like the C programs.
pub fn ntop(gid: &Gid) -> String {
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

/// `  local address:  LID 0x0000, QPN 0x000011, PSN 0x000022<sep> GID ::`
/// (`sep` is `,`, or `:` where the C program prints that).
pub fn print_dest(which: &str, d: &Endpoint, sep: char) {
    println!(
        "  {which} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}{sep} GID {}",
        d.lid,
        d.qpn,
        d.psn,
        ntop(&d.gid)
    );
}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&p| p > 0)
        .unwrap_or(4096)
}

/// Opens the device named `-d` (or the first), with the C programs' messages.
pub fn open_device(name: Option<&str>) -> Result<Context, String> {
    Context::open(name).map_err(|e| match (name, e) {
        (Some(name), rdma_verbs::Error::DeviceNotFound { .. }) => {
            format!("IB device {name} not found")
        }
        (_, rdma_verbs::Error::NoDevices) => "No IB devices found".to_owned(),
        (_, e) => format!("Couldn't get context: {e}"),
    })
}

/// What every port sets up before its QP, in the C programs' order.
pub struct Resources {
    /// The device.
    pub ctx: Context,
    /// The completion channel (`-e`).
    pub channel: Option<CompletionChannel>,
    /// The PD.
    pub pd: Pd,
    /// The one CQ, `rx_depth + 1` deep.
    pub cq: Cq,
    /// `rx_depth` receive buffers of `size` bytes (`None`s for 0 bytes).
    pub bufs: Vec<Option<Mr>>,
    /// The first message, filled with 0x7b as in the C programs.
    pub first_send: Option<Mr>,
}

/// Opens the device, the channel (with `-e`), the PD, registers `rx_depth +
/// 1` buffers of `size` bytes in one region with `access(&ctx)` (after the
/// PD, where the C programs check ODP), and creates the CQ.
pub fn setup(
    devname: Option<&str>,
    use_event: bool,
    size: usize,
    rx_depth: u32,
    access: impl FnOnce(&Context) -> Result<AccessFlags, String>,
) -> Result<Resources, String> {
    let ctx = open_device(devname)?;
    let channel = if use_event {
        Some(
            CompletionChannel::new(&ctx)
                .map_err(|e| format!("Couldn't create completion channel: {e}"))?,
        )
    } else {
        None
    };
    let pd = Pd::new(&ctx).map_err(|e| format!("Couldn't allocate PD: {e}"))?;
    let access = access(&ctx)?;
    // The CQ before the buffers: it checks the depth against the device's
    // max_cqe, so that a huge -r is refused before anything is allocated.
    let depth = rx_depth.checked_add(1).ok_or("-r is too large")?;
    let cq = match &channel {
        Some(ch) => Cq::with_channel(&ctx, depth, ch),
        None => Cq::new(&ctx, depth),
    }
    .map_err(|e| format!("Couldn't create CQ: {e}"))?;
    // Buffers: rx_depth receives plus the first message to send, from one registration.
    let nbufs = rx_depth as usize + 1;
    let mut bufs: Vec<Option<Mr>> = Vec::with_capacity(nbufs);
    if size == 0 {
        bufs.resize_with(nbufs, || None);
    } else {
        let total = size
            .checked_mul(nbufs)
            .ok_or("message size times rx depth overflows")?;
        let mut all =
            Mr::new(&pd, total, access).map_err(|e| format!("Couldn't register MR: {e}"))?;
        for _ in 0..nbufs - 1 {
            bufs.push(Some(all.split_to(size).map_err(|e| e.to_string())?));
        }
        bufs.push(Some(all));
    }
    let mut first_send = bufs.pop().flatten();
    if let Some(b) = first_send.as_mut() {
        b.fill(0x7b).map_err(|e| e.to_string())?;
    }
    Ok(Resources {
        ctx,
        channel,
        pd,
        cq,
        bufs,
        first_send,
    })
}

/// The C programs' QP: one send, `rx_depth` receives, one SGE each way.
pub fn caps(rx_depth: u32) -> QpCaps {
    QpCaps {
        max_send_wr: 1,
        max_recv_wr: rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
        sq_sig_all: false,
    }
}

/// Posts a receive into each of `bufs` (RC, UC).
#[allow(dead_code)] // ud_pingpong posts a GRH buffer with each
pub fn post_receives<T: Connected>(
    qp: &mut Qp<T, Init>,
    bufs: Vec<Option<Mr>>,
) -> Result<(), String> {
    let recvs = bufs.into_iter().map(|b| match b {
        Some(mr) => RecvWr::new(RECV_WRID, mr),
        None => RecvWr::empty(RECV_WRID),
    });
    qp.post_recv_list(recvs)
        .map_err(|e| format!("Couldn't post receive ({}): {}", e.unposted.len(), e.error))
}

/// Arms the CQ for the first event (`-e`).
pub fn arm(cq: &mut Cq, use_event: bool) -> Result<(), String> {
    if use_event {
        cq.req_notify(false)
            .map_err(|e| format!("Couldn't request CQ notification: {e}"))?;
    }
    Ok(())
}

/// This side's endpoint as the C programs build it: the port's LID (an
/// InfiniBand port must have one), the QPN and PSN, and the GID at `-g`, or
/// none (all zero) without `-g`.
pub fn local_endpoint<T: QpType, S: QpState>(
    qp: &Qp<T, S>,
    ctx: &Context,
    port: u8,
    gidx: Option<u8>,
) -> Result<Endpoint, String> {
    let portinfo = ctx
        .query_port(port)
        .map_err(|e| format!("Couldn't get port info: {e}"))?;
    if portinfo.link_layer != LinkLayer::Ethernet && portinfo.lid == 0 {
        return Err("Couldn't get local LID".into());
    }
    match gidx {
        Some(g) => qp.endpoint(Some(g)),
        None => qp.endpoint(None).map(|e| Endpoint {
            gid: Gid::ZERO,
            ..e
        }),
    }
    .map_err(|_| format!("can't read sgid of index {}", gidx.unwrap_or(0)))
}

/// The C programs' exchange of endpoints: the client sends first and
/// connects after the answer; the server runs `connect` on the client's
/// endpoint before it answers (so the client's first message finds it
/// ready). Returns the peer's endpoint and what `connect` returned.
pub fn exchange_dest<Q>(
    servername: Option<&str>,
    port: u16,
    my_dest: &Endpoint,
    connect: impl FnOnce(&Endpoint) -> Result<Q, String>,
) -> Result<(Endpoint, Q), String> {
    match servername {
        Some(host) => {
            let rem = exchange::client_exchange(host, port, my_dest, CONNECT_TIMEOUT).map_err(
                |e| match e {
                    rdma_verbs::Error::Io { what, .. } if what.starts_with("connecting") => {
                        format!("Couldn't connect to {host}:{port}: {e}")
                    }
                    e => format!("Couldn't read/write remote address: {e}"),
                },
            )?;
            let q = connect(&rem)?;
            Ok((rem, q))
        }
        None => {
            let listener = ExchangeListener::bind(port)
                .map_err(|e| format!("Couldn't listen to port {port}: {e}"))?;
            exchange::server_exchange(&listener, my_dest, None, |rem| {
                connect(rem).map_err(rdma_verbs::Error::Protocol)
            })
            .map_err(|e| format!("Couldn't exchange addresses: {e}"))
        }
    }
}

/// `wr_id` of every receive (as the C programs).
pub const RECV_WRID: u64 = 1;
/// `wr_id` of every send.
pub const SEND_WRID: u64 = 2;

/// What the ping-pong loop needs to know of the options.
pub struct LoopParams {
    /// Bytes per message.
    pub size: usize,
    /// Receives kept posted.
    pub rx_depth: u32,
    /// Exchanges.
    pub iters: u32,
    /// Sleep on CQ events instead of busy-polling.
    pub use_event: bool,
    /// `-c`: the client zeroes its message's page starts, the server checks them.
    pub validate: bool,
    /// This side connected to a server (it sends first).
    pub is_client: bool,
    /// Send inline (the QP's max_inline_data covers the message).
    pub use_inline: bool,
}

/// The QP of a ping-pong port: how it sends and receives one message.
pub trait PingQp {
    /// Posts a SEND of `buf` (`None`: zero bytes), inline when `inline`;
    /// returns the buffer when the NIC copied it (inline), else `None`.
    fn send(&mut self, wr_id: u64, buf: Option<Mr>, inline: bool) -> Result<Option<Mr>, String>;
    /// Posts a receive into `buf` (`None`: zero bytes).
    fn recv(&mut self, wr_id: u64, buf: Option<Mr>) -> Result<(), String>;
    /// The payload buffer of a successful receive completion.
    fn received(&mut self, wc: &mut Completion) -> Result<Option<Mr>, String>;
}

/// RC and UC send and receive alike (only the request type differs).
macro_rules! connected_ping_qp {
    ($transport:ty, $send_wr:ident) => {
        impl PingQp for Qp<$transport, Rts> {
            fn send(
                &mut self,
                wr_id: u64,
                buf: Option<Mr>,
                inline: bool,
            ) -> Result<Option<Mr>, String> {
                let err = |e: rdma_verbs::PostError| format!("Couldn't post send: {}", e.error);
                match buf {
                    Some(mr) if inline => {
                        let data = mr.as_slice().map_err(|e| e.to_string())?;
                        self.post_send($send_wr::send_inline(wr_id, data))
                            .map_err(err)?;
                        // The NIC copied the data: the buffer is free again.
                        Ok(Some(mr))
                    }
                    Some(mr) => self
                        .post_send($send_wr::send(wr_id).sge(mr))
                        .map(|()| None)
                        .map_err(err),
                    None => self
                        .post_send($send_wr::send(wr_id))
                        .map(|()| None)
                        .map_err(err),
                }
            }

            fn recv(&mut self, wr_id: u64, buf: Option<Mr>) -> Result<(), String> {
                let wr = match buf {
                    Some(mr) => RecvWr::new(wr_id, mr),
                    None => RecvWr::empty(wr_id),
                };
                self.post_recv(wr).map_err(|e| e.error.to_string())
            }

            fn received(&mut self, wc: &mut Completion) -> Result<Option<Mr>, String> {
                Ok(wc.take_mr())
            }
        }
    };
}

connected_ping_qp!(Rc, SendWr);
connected_ping_qp!(Uc, UcSendWr);

/// The C programs' loop: the client sends first; each side sends again once
/// its last send completed and a message arrived, `iters` times; then both
/// print the throughput lines. `first_send` is the client's first message
/// (and every buffer the loop receives into is one it sent from before, as
/// in the C programs, where one buffer serves both directions). Returns the
/// buffer it holds at the end.
/// How long the ping-pong may go without a completion before it gives up. The C
/// programs wait forever, and with their retry_cnt of 7 rxe never reports a dead peer
/// either (and a UD peer that died is never reported at all), so a peer that died
/// would leave this side spinning for good.
pub const STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(20);

pub fn run_loop<Q: PingQp>(
    qp: &mut Q,
    cq: &mut Cq,
    p: &LoopParams,
    mut first_send: Option<Mr>,
) -> Result<Option<Mr>, String> {
    let page = page_size();
    if p.is_client && p.validate {
        if let Some(b) = first_send.as_mut() {
            for i in (0..p.size).step_by(page) {
                // C: buf[i] = i / page_size % sizeof(char), which is always 0.
                b.write_at(i, &[0]).map_err(|e| e.to_string())?;
            }
        }
    }

    // The buffer to send next: the last one received (the C program's single buffer).
    let mut next_send: Option<Mr> = first_send;
    let mut pending = RECV_WRID;
    let post_send = |qp: &mut Q, buf: Option<Mr>| qp.send(SEND_WRID, buf, p.use_inline);
    // Receives posted: at most rx_depth (C: "receives to post at a time"); a
    // buffer that comes back while rx_depth are posted waits in `spare`.
    let mut posted = p.rx_depth;
    let mut spare: Vec<Mr> = Vec::new();
    let mut give_back = |qp: &mut Q, posted: &mut u32, buf: Option<Mr>| -> Result<(), String> {
        let buf = match buf {
            Some(mr) if *posted >= p.rx_depth => {
                spare.push(mr);
                return Ok(());
            }
            Some(mr) => Some(mr),
            None if p.size == 0 && *posted < p.rx_depth => None,
            None => match spare.pop() {
                Some(mr) if *posted < p.rx_depth => Some(mr),
                Some(mr) => {
                    spare.push(mr);
                    return Ok(());
                }
                None => return Ok(()),
            },
        };
        qp.recv(RECV_WRID, buf)
            .map_err(|e| format!("Couldn't post receive ({posted}): {e}"))?;
        *posted += 1;
        Ok(())
    };

    if p.is_client {
        if let Some(freed) = post_send(qp, next_send.take())? {
            give_back(qp, &mut posted, Some(freed))?;
        }
        pending |= SEND_WRID;
    }

    let start = Instant::now();
    let (mut rcnt, mut scnt) = (0u32, 0u32);
    let mut wcs = Vec::with_capacity(2);
    while rcnt < p.iters || scnt < p.iters {
        next_completions(cq, &mut wcs, p.use_event)?;
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
                        give_back(qp, &mut posted, Some(mr))?;
                    }
                }
                RECV_WRID => {
                    rcnt += 1;
                    posted -= 1;
                    let got = qp.received(&mut wc)?;
                    if p.validate && !p.is_client && rcnt == p.iters {
                        if let Some(mr) = &got {
                            let data = mr.as_slice().map_err(|e| e.to_string())?;
                            for i in (0..p.size).step_by(page) {
                                if data[i] != 0 {
                                    println!("invalid data in page {}", i / page);
                                }
                            }
                        }
                    }
                    if p.size > 0 {
                        let got = got.ok_or("receive came back without its buffer")?;
                        if let Some(old) = next_send.replace(got) {
                            give_back(qp, &mut posted, Some(old))?;
                        }
                    }
                    // Keep rx_depth receives posted (a spare buffer, or none for 0 bytes).
                    give_back(qp, &mut posted, None)?;
                }
                other => return Err(format!("Completion for unknown wr_id {other}")),
            }
            pending &= !wc.wr_id;
            if scnt < p.iters && pending == 0 {
                let buf = if p.size == 0 { None } else { next_send.take() };
                if p.size > 0 && buf.is_none() {
                    return Err("Couldn't post send: no buffer".into());
                }
                if let Some(freed) = post_send(qp, buf)? {
                    give_back(qp, &mut posted, Some(freed))?;
                }
                pending = RECV_WRID | SEND_WRID;
            }
        }
    }
    print_rate(p.size, p.iters, start);
    Ok(next_send)
}

/// Clears `wcs` and fills it with the next completions: busy-polling, or
/// sleeping on the CQ's channel with `use_event`. A peer that stops
/// answering (its process died or its QP failed) ends the run with an error
/// after [`STALL_LIMIT`] without a completion, instead of a wait forever.
pub fn next_completions(
    cq: &mut Cq,
    wcs: &mut Vec<Completion>,
    use_event: bool,
) -> Result<(), String> {
    let stalled = || {
        format!(
            "error: no completion for {} s: the peer stopped answering (its process died or \
             its QP failed)",
            STALL_LIMIT.as_secs()
        )
    };
    wcs.clear();
    if use_event {
        // 0 completions: the limit passed.
        let n = cq
            .wait_poll(wcs, Some(STALL_LIMIT))
            .map_err(|e| format!("Failed to get cq_event: {e}"))?;
        if n == 0 {
            return Err(stalled());
        }
    } else {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        while cq.poll(wcs).map_err(|e| format!("poll CQ failed {e}"))? == 0 {
            spins = spins.wrapping_add(1);
            if spins % 4096 == 0 && idle_since.elapsed() > STALL_LIMIT {
                return Err(stalled());
            }
        }
    }
    Ok(())
}

/// The C programs' closing lines: bytes and iterations per second since
/// `start`, for `iters` exchanges of `size` bytes each way.
pub fn print_rate(size: usize, iters: u32, start: Instant) {
    let usec = start.elapsed().as_secs_f64() * 1e6;
    let bytes = size as i64 * i64::from(iters) * 2;
    println!(
        "{bytes} bytes in {:.2} seconds = {:.2} Mbit/sec",
        usec / 1e6,
        bytes as f64 * 8.0 / usec
    );
    println!(
        "{} iters in {:.2} seconds = {:.2} usec/iter",
        iters,
        usec / 1e6,
        usec / f64::from(iters)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn c_long_reads_like_strtol() {
        assert_eq!(c_long("0x10"), Some(16));
        assert_eq!(c_long("010"), Some(8));
        assert_eq!(c_long("-1"), Some(-1));
        assert_eq!(c_long("x"), None);
    }

    #[test]
    fn ntop_matches_inet_ntop() {
        let g: Gid = "::ffff:10.99.0.1".parse().unwrap();
        assert_eq!(ntop(&g), "::ffff:10.99.0.1");
        assert_eq!(ntop(&Gid::ZERO), "::");
        assert_eq!(ntop(&"fe80::1".parse().unwrap()), "fe80::1");
    }
}
