//! What the two-process examples share: options, setup, and connecting the
//! QP through the crate's TCP exchange. Included with `#[path]` by each example.

use std::time::Duration;

use rdma_verbs::exchange::{self, ExchangeListener, ExchangeStream, PeerInfo};
use rdma_verbs::prelude::*;

/// Options every example takes.
pub struct Args {
    /// `None`: server; `Some(host)`: client of that host.
    pub client: Option<String>,
    pub size: usize,
    pub iters: usize,
    pub device: Option<String>,
    pub gid_index: Option<u8>,
    pub port: u16,
    /// `--qp-timeout`: the ACK timeout code (4.096 us x 2^N); `None`: the crate's default.
    pub qp_timeout: Option<u8>,
    /// `--retry-cnt`: transport retries before RETRY_EXC_ERR; `None`: the crate's default.
    pub retry_cnt: Option<u8>,
    /// `--rnr-retry`: RNR NAK retries before RNR_RETRY_EXC_ERR (7: forever); `None`: the
    /// crate's default.
    pub rnr_retry: Option<u8>,
    /// `--min-rnr-timer`: the RNR NAK timer code this side asks its senders to wait (IB spec
    /// table; 12 = 0.64 ms); `None`: the crate's default.
    pub min_rnr_timer: Option<u8>,
    /// `--cq-entries`: the CQ's size instead of what the QP's queues need, fixed (to
    /// show the refusal of a CQ too small for them).
    pub cq_entries: Option<u32>,
    /// `--stall-recv-at N --stall-ms M` (send_recv's server): after answering message N,
    /// post the next receive only M ms later, so the peer's next SEND meets no receive.
    /// Parsed for send_recv only (the other examples refuse the option and never read it).
    #[allow(dead_code)]
    pub stall: Option<(usize, Duration)>,
    /// `--seed`: varies the message pattern ([`Pattern::seeded`]), so streams between
    /// different pairs carry different bytes; both sides give the same seed. Read by
    /// send_recv and ud_send only.
    #[allow(dead_code)]
    pub seed: u64,
}

/// Whether example `name` takes `--seed` (the examples whose messages are a [`Pattern`]
/// sent from one side to the other).
fn seeded(name: &str) -> bool {
    matches!(name, "send_recv" | "ud_send")
}

/// The usage line of example `name` (send_recv has the stall options).
fn usage(name: &str) -> String {
    format!(
        "usage: {name} (--server | --client HOST) [--size BYTES] [--iters N] [--device DEV] [--gid-index I] [--port TCP_PORT] [--qp-timeout 0-31] [--retry-cnt 0-7] [--rnr-retry 0-7] [--min-rnr-timer 0-31] [--cq-entries N]{}{}",
        if seeded(name) { " [--seed N]" } else { "" },
        if name == "send_recv" {
            " [--stall-recv-at N --stall-ms MS]"
        } else {
            ""
        }
    )
}

/// `v` as a `T` that `ok` accepts.
fn number<T: std::str::FromStr>(v: &str, ok: impl Fn(&T) -> bool) -> Option<T> {
    v.parse().ok().filter(ok)
}

impl Args {
    /// Parses `--server | --client HOST`, `--size N`, `--iters N`, `--device D`,
    /// `--gid-index I`, `--port P`, `--qp-timeout T`, `--retry-cnt R`, `--rnr-retry R`,
    /// `--min-rnr-timer C`, `--cq-entries N`, (send_recv and ud_send) `--seed N` and (send_recv only) `--stall-recv-at N
    /// --stall-ms M`; exits with usage on anything else.
    pub fn parse(name: &str, default_port: u16) -> Args {
        let usage = usage(name);
        let mut a = Args {
            client: None,
            size: 4096,
            iters: 10,
            device: std::env::var("RDMA_VERBS_DEVICE").ok(),
            gid_index: None,
            port: default_port,
            qp_timeout: None,
            retry_cnt: None,
            rnr_retry: None,
            min_rnr_timer: None,
            cq_entries: None,
            stall: None,
            seed: 0,
        };
        let mut server = false;
        let (mut stall_at, mut stall_ms) = (None, None);
        let mut it = std::env::args().skip(1);
        let fail = |msg: &str| -> ! {
            eprintln!("{name}: {msg}\n{usage}");
            std::process::exit(2)
        };
        while let Some(arg) = it.next() {
            let mut val = |what: &str| {
                it.next()
                    .unwrap_or_else(|| fail(&format!("{what} needs a value")))
            };
            // `$flag`'s value as a `$t` (at most `$max`), or usage with "bad $flag".
            macro_rules! num {
                ($flag:literal, $t:ty) => {
                    number::<$t>(&val($flag), |_| true)
                        .unwrap_or_else(|| fail(concat!("bad ", $flag)))
                };
                ($flag:literal, $t:ty, max $max:literal) => {
                    number::<$t>(&val($flag), |v| *v <= $max)
                        .unwrap_or_else(|| fail(concat!("bad ", $flag, " (0 to ", $max, ")")))
                };
            }
            match arg.as_str() {
                "--server" | "-s" => server = true,
                "--client" | "-c" => a.client = Some(val("--client")),
                "--size" => a.size = num!("--size", usize),
                "--iters" | "-n" => a.iters = num!("--iters", usize),
                "--device" | "-d" => a.device = Some(val("--device")),
                "--gid-index" | "-g" => a.gid_index = Some(num!("--gid-index", u8)),
                "--qp-timeout" => a.qp_timeout = Some(num!("--qp-timeout", u8, max 31)),
                "--retry-cnt" => a.retry_cnt = Some(num!("--retry-cnt", u8, max 7)),
                "--rnr-retry" => a.rnr_retry = Some(num!("--rnr-retry", u8, max 7)),
                "--min-rnr-timer" => a.min_rnr_timer = Some(num!("--min-rnr-timer", u8, max 31)),
                "--cq-entries" => {
                    let n = number::<u32>(&val("--cq-entries"), |n| *n >= 1);
                    a.cq_entries = Some(n.unwrap_or_else(|| fail("bad --cq-entries (at least 1)")))
                }
                "--stall-recv-at" if name == "send_recv" => {
                    stall_at = Some(num!("--stall-recv-at", usize))
                }
                "--stall-ms" if name == "send_recv" => stall_ms = Some(num!("--stall-ms", u64)),
                "--port" | "-p" => a.port = num!("--port", u16),
                "--seed" if seeded(name) => a.seed = num!("--seed", u64),
                "--help" | "-h" => {
                    println!("{usage}");
                    std::process::exit(0)
                }
                other => fail(&format!("unknown argument `{other}`")),
            }
        }
        if let Err(msg) = a.check(server, stall_at, stall_ms) {
            fail(msg);
        }
        a
    }

    /// The rules between the options: exactly one role, sizes of at least 1,
    /// and the stall's two options together, on the server.
    fn check(
        &mut self,
        server: bool,
        stall_at: Option<usize>,
        stall_ms: Option<u64>,
    ) -> std::result::Result<(), &'static str> {
        if server == self.client.is_some() {
            return Err("say exactly one of --server or --client HOST");
        }
        if self.size == 0 || self.iters == 0 {
            return Err("--size and --iters must be at least 1");
        }
        match (stall_at, stall_ms) {
            (None, None) => {}
            (Some(at), Some(ms)) if server => self.stall = Some((at, Duration::from_millis(ms))),
            (Some(_), Some(_)) => return Err("--stall-recv-at is the server's option"),
            _ => return Err("--stall-recv-at and --stall-ms go together"),
        }
        Ok(())
    }

    /// "server" or "client", for messages.
    pub fn role(&self) -> &'static str {
        if self.client.is_some() {
            "client"
        } else {
            "server"
        }
    }
}

/// Refuses to register `bytes` in all when that is more than the memory available
/// (`MemAvailable` in /proc/meminfo): registration pins every page, and pinning more than
/// there is gets the process killed by the kernel's OOM killer instead of an error.
pub fn check_memory(bytes: usize) -> Result<()> {
    let available_kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    match available_kib {
        Some(kib) if bytes as u64 > kib.saturating_mul(1024) => {
            Err(rdma_verbs::Error::InvalidArgument {
                what: "--size",
                reason: format!(
                    "the buffers need {bytes} bytes of pinned memory, more than the {} bytes \
                     available (MemAvailable); use a smaller --size",
                    kib * 1024
                ),
            })
        }
        _ => Ok(()),
    }
}

/// The verbs objects of one side.
pub struct Side {
    pub pd: Pd,
    pub cq: Cq,
    pub gid_index: u8,
    /// Work requests each queue of the QP may hold.
    pub depth: u32,
    /// The exchange connection, kept open while connected: it closes when the peer's
    /// process dies, which [`Side::poll`] reports at once.
    pub peer: Option<ExchangeStream>,
}

/// How long [`Side::poll`] waits for a completion of a live peer.
pub const WAIT: Duration = Duration::from_secs(30);

/// The slices [`Side::poll`] waits in, checking the peer between them.
const SLICE: Duration = Duration::from_millis(100);

impl Side {
    /// The closing handshake on the kept exchange connection: tells the peer this side
    /// has all its completions and waits until the peer says the same. Without it, a side
    /// that finished first would destroy its QP while the peer's last request still waits
    /// for an ACK that was lost: the retransmission would then find no QP and end in
    /// RETRY_EXC_ERR (seen under 5% loss).
    pub fn finish(&mut self) -> Result<()> {
        self.peer.as_mut().map_or(Ok(()), ExchangeStream::barrier)
    }

    /// The next completion, waiting at most [`WAIT`]; fails with
    /// [`Error::PeerClosed`](rdma_verbs::Error::PeerClosed) as soon as the peer's
    /// exchange connection is closed while nothing comes (its process died).
    pub fn poll(&mut self, what: &'static str) -> Result<Completion> {
        let start = std::time::Instant::now();
        loop {
            match self.cq.poll_one(SLICE) {
                Err(rdma_verbs::Error::Timeout { .. }) => {}
                other => return other,
            }
            if let Some(peer) = &self.peer {
                if peer.peer_closed()? {
                    return Err(rdma_verbs::Error::PeerClosed { waiting_for: what });
                }
            }
            if start.elapsed() >= WAIT {
                return Err(rdma_verbs::Error::Timeout { what, after: WAIT });
            }
        }
    }
}

/// Opens the device, a PD, and one CQ for both queues of a QP whose queues
/// hold `depth` work requests each.
pub fn open(args: &Args, depth: u32) -> Result<Side> {
    let ctx = Context::open(args.device.as_deref())?;
    let pd = Pd::new(&ctx)?;
    // Every completion the QP's queues may produce must fit: `depth` for the
    // send queue plus `depth` for the receive queue.
    // (`--cq-entries` overrides it with a CQ that does not grow: a QP whose queues do
    // not fit is then refused with `Error::CqTooSmall`. A CQ that grows takes any QP.)
    let cq = Cq::new(&ctx, args.cq_entries.unwrap_or(2 * depth))?;
    cq.set_auto_grow(args.cq_entries.is_none());
    // Like `-g`/`-x` on soft-RoCE: the RoCE v2 IPv4-mapped GID by default.
    let gid_index = match args.gid_index {
        // Checked now, before waiting for a peer: an empty or missing slot is an error
        // naming the valid indices.
        Some(i) => ctx.query_gid(1, i).map(|_| i)?,
        None => ctx.default_gid_index(1)?.unwrap_or(0),
    };
    Ok(Side {
        pd,
        cq,
        gid_index,
        depth,
        peer: None,
    })
}

/// An RC QP in INIT with REMOTE_WRITE/READ rights, on `side`'s CQ, with
/// `side.depth` work requests per queue.
pub fn qp(side: &Side) -> Result<Qp<Rc, Init>> {
    let caps = QpCaps {
        max_send_wr: side.depth,
        max_recv_wr: side.depth,
        ..QpCaps::default()
    };
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    Ok(Qp::new(&side.pd, &side.cq, &side.cq, caps)?.init(InitAttr::new(1, access))?)
}

/// Exchanges endpoints (and `mrs`) with the peer and brings the QP to RTS.
/// The server connects its QP before answering, so the client's first
/// message finds it ready. The exchange connection stays open in `side.peer`
/// (see [`Side::poll`]).
pub fn connect(
    args: &Args,
    side: &mut Side,
    qp: Qp<Rc, Init>,
    mrs: &[RemoteMr],
) -> Result<(Qp<Rc, Rts>, PeerInfo)> {
    let gid = Some(side.gid_index);
    let timeout = Duration::from_secs(30);
    let defaults = args.qp_timeout.is_none()
        && args.retry_cnt.is_none()
        && args.rnr_retry.is_none()
        && args.min_rnr_timer.is_none();
    let (qp, remote, peer) = if defaults {
        match &args.client {
            Some(host) => exchange::connect_client_kept(host, args.port, qp, gid, mrs, timeout)?,
            None => {
                let listener = ExchangeListener::bind(args.port)?;
                exchange::serve_kept(&listener, qp, gid, mrs, Some(timeout))?
            }
        }
    } else {
        // The same exchange, with this side's ACK timeout, retry counts and RNR timer.
        let mut local = PeerInfo::new(qp.endpoint(gid)?);
        local.mrs.extend_from_slice(mrs);
        let mut rts = RtsAttr::new(local.endpoint.psn);
        if let Some(t) = args.qp_timeout {
            rts = rts.timeout(t);
        }
        if let Some(r) = args.retry_cnt {
            rts = rts.retry_cnt(r);
        }
        if let Some(r) = args.rnr_retry {
            rts = rts.rnr_retry(r);
        }
        let rnr_timer = args.min_rnr_timer;
        let mtu = side.pd.context().query_port(1)?.active_mtu;
        let to_rts = |qp: Qp<Rc, Init>, remote: &PeerInfo| -> Result<Qp<Rc, Rts>> {
            let mut rtr = RtrAttr::new(&remote.endpoint, 1, mtu, gid);
            if let Some(t) = rnr_timer {
                rtr = rtr.min_rnr_timer(t);
            }
            Ok(qp.rtr(rtr)?.rts(rts)?)
        };
        match &args.client {
            Some(host) => {
                let mut s = ExchangeStream::connect(host, args.port, timeout)?;
                s.send(&local)?;
                let remote: PeerInfo = s.recv()?;
                s.send_done()?;
                (to_rts(qp, &remote)?, remote, s)
            }
            None => {
                let mut s = ExchangeListener::bind(args.port)?.accept(Some(timeout))?;
                let remote: PeerInfo = s.recv()?;
                let qp = to_rts(qp, &remote)?;
                s.send(&local)?;
                s.recv_done()?;
                (qp, remote, s)
            }
        }
    };
    side.peer = Some(peer);
    println!("{}: remote {}", args.role(), remote.endpoint);
    Ok((qp, remote))
}

/// The messages: message `i` is the window at `i % 256` of one pseudo-random
/// byte string, so consecutive messages differ and none is generated in the
/// loop (compare with `==` on slices: a `memcmp`, fast in debug builds too).
pub struct Pattern {
    bytes: Vec<u8>,
    len: usize,
}

impl Pattern {
    /// Messages of `len` bytes.
    #[allow(dead_code)]
    pub fn new(len: usize) -> Pattern {
        Pattern::seeded(len, 0)
    }

    /// Messages of `len` bytes from the generator started at `seed` (each seed gives
    /// other bytes).
    pub fn seeded(len: usize, seed: u64) -> Pattern {
        let mut bytes = Vec::with_capacity(len + 256 + 8);
        // Never zero, where xorshift would stay.
        let mut x: u64 = (0x9e37_79b9_7f4a_7c15 ^ seed.wrapping_mul(0xbf58_476d_1ce4_e5b9)) | 1;
        while bytes.len() < len + 256 {
            // xorshift64, eight bytes at a time.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            bytes.extend_from_slice(&x.to_le_bytes());
        }
        Pattern { bytes, len }
    }

    /// The content of message `iter`.
    pub fn message(&self, iter: usize) -> &[u8] {
        let at = iter % 256;
        &self.bytes[at..at + self.len]
    }
}

/// Runs `f`, printing the error and exiting 1 on failure.
pub fn exit_on_error(name: &str, f: impl FnOnce() -> Result<()>) -> std::process::ExitCode {
    match f() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
