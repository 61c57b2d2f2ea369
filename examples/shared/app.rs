//! What the two-process examples share: options, setup, and connecting the
//! QP through the crate's TCP exchange. Included with `#[path]` by each example.

use std::time::Duration;

use rdma_verbs::exchange::{self, ExchangeListener, PeerInfo};
use rdma_verbs::qp::{Init, Rts};
use rdma_verbs::{AccessFlags, Context, Cq, InitAttr, Pd, Qp, QpCaps, Rc, RemoteMr, Result};

/// Options every example takes.
pub struct Args {
    /// `None`: server; `Some(host)`: client of that host.
    pub client: Option<String>,
    pub size: usize,
    pub iters: usize,
    pub device: Option<String>,
    pub gid_index: Option<u8>,
    pub port: u16,
}

impl Args {
    /// Parses `--server | --client HOST`, `--size N`, `--iters N`, `--device D`,
    /// `--gid-index I`, `--port P`; exits with usage on anything else.
    pub fn parse(name: &str, default_port: u16) -> Args {
        let usage = format!(
            "usage: {name} (--server | --client HOST) [--size BYTES] [--iters N] [--device DEV] [--gid-index I] [--port TCP_PORT]"
        );
        let mut a = Args {
            client: None,
            size: 4096,
            iters: 10,
            device: std::env::var("RDMA_VERBS_DEVICE").ok(),
            gid_index: None,
            port: default_port,
        };
        let mut server = false;
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
            match arg.as_str() {
                "--server" | "-s" => server = true,
                "--client" | "-c" => a.client = Some(val("--client")),
                "--size" => a.size = val("--size").parse().unwrap_or_else(|_| fail("bad --size")),
                "--iters" | "-n" => {
                    a.iters = val("--iters")
                        .parse()
                        .unwrap_or_else(|_| fail("bad --iters"))
                }
                "--device" | "-d" => a.device = Some(val("--device")),
                "--gid-index" | "-g" => {
                    a.gid_index = Some(
                        val("--gid-index")
                            .parse()
                            .unwrap_or_else(|_| fail("bad --gid-index")),
                    )
                }
                "--port" | "-p" => {
                    a.port = val("--port").parse().unwrap_or_else(|_| fail("bad --port"))
                }
                "--help" | "-h" => {
                    println!("{usage}");
                    std::process::exit(0)
                }
                other => fail(&format!("unknown argument `{other}`")),
            }
        }
        if server == a.client.is_some() {
            fail("say exactly one of --server or --client HOST");
        }
        if a.size == 0 || a.iters == 0 {
            fail("--size and --iters must be at least 1");
        }
        a
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

/// The verbs objects of one side.
pub struct Side {
    pub pd: Pd,
    pub cq: Cq,
    pub gid_index: u8,
    /// Work requests each queue of the QP may hold.
    pub depth: u32,
}

/// Opens the device, a PD, and one CQ for both queues of a QP whose queues
/// hold `depth` work requests each.
pub fn open(args: &Args, depth: u32) -> Result<Side> {
    let ctx = Context::open(args.device.as_deref())?;
    let pd = Pd::new(&ctx)?;
    // Every completion the QP's queues may produce must fit: `depth` for the
    // send queue plus `depth` for the receive queue.
    let cq = Cq::new(&ctx, 2 * depth)?;
    // Like `-g`/`-x` on soft-RoCE: the RoCE v2 IPv4-mapped GID by default.
    let gid_index = match args.gid_index {
        Some(i) => i,
        None => ctx.default_gid_index(1)?.unwrap_or(0),
    };
    Ok(Side {
        pd,
        cq,
        gid_index,
        depth,
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
/// message finds it ready.
pub fn connect(
    args: &Args,
    side: &Side,
    qp: Qp<Rc, Init>,
    mrs: &[RemoteMr],
) -> Result<(Qp<Rc, Rts>, PeerInfo)> {
    let gid = Some(side.gid_index);
    let timeout = Duration::from_secs(30);
    let (qp, remote) = match &args.client {
        Some(host) => exchange::connect_client(host, args.port, qp, gid, mrs, timeout)?,
        None => {
            let listener = ExchangeListener::bind(args.port)?;
            exchange::serve(&listener, qp, gid, mrs, Some(timeout))?
        }
    };
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
    pub fn new(len: usize) -> Pattern {
        let mut bytes = Vec::with_capacity(len + 256 + 8);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
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
