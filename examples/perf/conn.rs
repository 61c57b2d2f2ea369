//! Setting up one side: device, CQs (with completion channels for `-e`), QPs,
//! and the out-of-band exchange with the peer over TCP (crate::exchange).
//!
//! The exchange, on one TCP connection:
//! 1. both sides send their parameter fingerprint and check the peer's matches;
//! 2. the client sends one `PeerInfo` per QP (endpoint + the region the peer
//!    may WRITE/READ), the server receives them all and answers with its own;
//! 3. both connect their QPs; then [`Ctrl::barrier`] before each size and the
//!    results exchange after it.

use std::time::Duration;

use rdma_verbs::exchange::{ExchangeListener, ExchangeStream, PeerInfo, WireMessage};
use rdma_verbs::prelude::*;
use rdma_verbs::qp::SendApi;

use crate::opts::{DataPath, Opts, Verb};
use crate::report::Fingerprint;

/// How long the client keeps trying to reach the server, and how long the
/// server waits for a client.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(120);
/// The first try, after which the client says it is waiting.
const FIRST_TRY: Duration = Duration::from_secs(1);

/// A CQ and, in events mode, the completion channel it reports to.
pub struct EvCq {
    /// The CQ.
    pub cq: Cq,
    /// Its channel (`-e`).
    pub chan: Option<CompletionChannel>,
}

impl EvCq {
    fn new(ctx: &Context, depth: u32, events: bool) -> Result<EvCq> {
        if events {
            let chan = CompletionChannel::new(ctx)?;
            let cq = Cq::with_channel(ctx, depth, &chan)?;
            cq.req_notify(false)?;
            Ok(EvCq {
                cq,
                chan: Some(chan),
            })
        } else {
            Ok(EvCq {
                cq: Cq::new(ctx, depth)?,
                chan: None,
            })
        }
    }

    /// Events mode: sleeps until the CQ reports a completion, then re-arms it
    /// (perftest's `ctx_notify_events`). Without a channel: returns at once.
    /// No event for [`STALL_LIMIT`](crate::bw::STALL_LIMIT) is an error: the
    /// peer is gone (a receive would otherwise wait forever).
    pub fn wait_event(&mut self) -> Result<()> {
        if let Some(chan) = &self.chan {
            if chan.wait(Some(crate::bw::STALL_LIMIT))?.is_none() {
                return Err(Error::Timeout {
                    what: "a completion event: none arrived (the peer is gone or stopped)",
                    after: crate::bw::STALL_LIMIT,
                });
            }
            if self.cq.unacked_events() >= rdma_verbs::channel::ACK_BATCH {
                self.cq.ack_events();
            }
            self.cq.req_notify(false)?;
        }
        Ok(())
    }
}

/// The device-side objects of one side.
pub struct Device {
    /// The device.
    pub ctx: Context,
    /// The protection domain.
    pub pd: Pd,
    /// The GID index used.
    pub gid_index: u8,
    /// The port's active MTU in bytes.
    pub mtu: u32,
    /// Outstanding READs/atomics per QP: `-o`, at most (and by default) the
    /// device's `max_qp_rd_atom` (perftest's `ctx_set_out_reads`).
    pub max_rd_atomic: u8,
}

impl Device {
    /// Opens `-d`'s device and a PD.
    pub fn open(o: &Opts) -> Result<Device> {
        let ctx = Context::open(o.device.as_deref())?;
        let pd = Pd::new(&ctx)?;
        // Like perftest's -x: the RoCE v2 IPv4-mapped GID by default.
        let gid_index = match o.gid_index {
            // Checked now, before waiting for a peer (an empty slot is an error).
            Some(i) => ctx.query_gid(o.ib_port, i).map(|_| i)?,
            None => ctx.default_gid_index(o.ib_port)?.unwrap_or(0),
        };
        let mtu = ctx.query_port(o.ib_port)?.active_mtu.bytes();
        let dev = ctx.query_device()?;
        let dev_max = u8::try_from(dev.max_qp_rd_atom.clamp(1, 255)).unwrap_or(1);
        let max_rd_atomic = match o.outs {
            Some(n) if n > u32::from(dev_max) => {
                eprintln!(
                    "perf: number of outstanding reads is above max = {dev_max}; \
                     changing to that max value"
                );
                dev_max
            }
            // In range (the guard above): the conversion cannot fail.
            Some(n) if n > 0 => u8::try_from(n).unwrap_or(dev_max),
            _ => dev_max,
        };
        Ok(Device {
            ctx,
            pd,
            gid_index,
            mtu,
            max_rd_atomic,
        })
    }

    /// Where `ibv_poll_cq` lands: the provider library's file name and the
    /// function's offset in it, as callgrind names a function of a library
    /// without symbols (`cargo xtask insn --side server` counts its calls).
    pub fn poll_fn(&self) -> Option<(String, usize)> {
        // SAFETY: the context is open while `self` lives; `ops.poll_cq` is a
        // plain function pointer that libibverbs set when it opened it.
        let f = unsafe { (*self.ctx.as_raw()).ops.poll_cq }? as usize;
        let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
        // SAFETY: `info` is valid for a write; dladdr only reads the
        // loader's tables for the address.
        if unsafe { libc::dladdr(f as *const libc::c_void, info.as_mut_ptr()) } == 0 {
            return None;
        }
        // SAFETY: dladdr succeeded, so it filled `info`; `dli_fname` is a
        // C string the loader owns while the library stays loaded (the
        // context keeps it).
        let info = unsafe { info.assume_init() };
        if info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: non-null, NUL-terminated (dladdr's contract).
        let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
        let file = name.to_string_lossy();
        let file = file.rsplit('/').next().unwrap_or_default().to_owned();
        Some((file, f - info.dli_fbase as usize))
    }
}

/// The CQs and QPs of one side.
pub struct Queues {
    /// The QPs, connected. Declared first: dropped before the CQs.
    pub qps: Vec<Qp<Rc, Rts>>,
    /// Send completions.
    pub send_cq: EvCq,
    /// Receive completions (send tests), else `None` (the QPs use `send_cq`).
    pub recv_cq: Option<EvCq>,
}

/// QPs in INIT, before the exchange.
pub struct Pending {
    qps: Vec<Qp<Rc, Init>>,
    send_cq: EvCq,
    recv_cq: Option<EvCq>,
}

/// What the QPs of a side are created with: their capabilities, the depth of
/// the send CQ, and of the receive CQ (send tests; else `None`, and the
/// QPs' receive queues complete on the send CQ).
///
/// Send queue depth: `-t`, plus one slot on the safe path, so that its ring
/// never forces an extra signaled request (it signals when its last free slot
/// is taken, and perftest's loop keeps at most `-t` requests in flight).
pub fn shape(o: &Opts) -> (QpCaps, u32, Option<u32>) {
    let nq = o.num_qps;
    let max_send_wr = match o.path {
        DataPath::Safe | DataPath::Scoped => o.tx_depth + 1,
        DataPath::Raw => o.tx_depth,
    };
    let caps = QpCaps {
        max_send_wr,
        max_recv_wr: o.rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: o.inline_size,
        sq_sig_all: false,
    };
    // Each CQ holds every completion its queues may produce: a QP's send
    // queue its depth on the send CQ, its receive queue its depth on the
    // receive CQ (the send CQ when receives are not used).
    let sends = max_send_wr.saturating_mul(nq);
    let recvs = o.rx_depth.saturating_mul(nq);
    if o.test.verb() == Verb::Send {
        (caps, sends, Some(recvs))
    } else {
        (caps, sends.saturating_add(recvs), None)
    }
}

/// The access a QP grants its peer: every test's.
pub const QP_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE
    .union(AccessFlags::REMOTE_WRITE)
    .union(AccessFlags::REMOTE_READ)
    .union(AccessFlags::REMOTE_ATOMIC);

/// Creates the CQs and `-q` QPs in INIT (see [`shape`]).
pub fn create(o: &Opts, dev: &Device) -> Result<Pending> {
    let (caps, send_depth, recv_depth) = shape(o);
    let recv_cq = match recv_depth {
        Some(d) => Some(EvCq::new(&dev.ctx, d, o.events)?),
        None => None,
    };
    let send_cq = EvCq::new(&dev.ctx, send_depth, o.events)?;
    let mut qps = Vec::with_capacity(o.num_qps as usize);
    for _ in 0..o.num_qps {
        let rcq = recv_cq.as_ref().map_or(&send_cq.cq, |c| &c.cq);
        let qp = if o.old_post_send {
            Qp::new_with_send_api(&dev.pd, &send_cq.cq, rcq, caps, SendApi::Legacy)?
        } else {
            Qp::new(&dev.pd, &send_cq.cq, rcq, caps)?
        };
        let qp = qp.init(InitAttr::new(o.ib_port, QP_ACCESS))?;
        qps.push(qp);
    }
    Ok(Pending {
        qps,
        send_cq,
        recv_cq,
    })
}

/// The TCP connection to the peer, kept for barriers and results.
pub struct Ctrl {
    stream: ExchangeStream,
}

/// A read or write on the control connection that failed because the peer's end is gone
/// (EOF in the middle of a message, a reset, a broken pipe) becomes
/// [`Error::PeerClosed`], instead of the socket's own "failed to fill whole buffer".
fn peer_died(waiting_for: &'static str) -> impl Fn(Error) -> Error {
    move |e| match e {
        Error::Io { ref source, .. }
            if matches!(
                source.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            Error::PeerClosed { waiting_for }
        }
        Error::PeerGaveUp => Error::PeerClosed { waiting_for },
        e => e,
    }
}

/// How long the client waits for the server's answer at a barrier or to
/// its results. The server answers as soon as the client's message arrives
/// (it waits there first, or is about to), so a server that stopped
/// answering without closing the connection (a stopped process, a hung
/// host) ends the client's run with an error instead of a wait forever.
/// The server cannot bound its own waits: a passive server (write_bw,
/// read_lat) waits for the client through the whole run.
const REPLY_LIMIT: Duration = Duration::from_secs(60);

impl Ctrl {
    /// Both sides wait here until the other arrives (client first, then server).
    pub fn barrier(&mut self, client: bool) -> Result<()> {
        let map = peer_died("the peer at the start of a size");
        if client {
            self.stream.send_done().map_err(&map)?;
            let what = "the server at the start or end of a size (a stopped or hung server?)";
            self.answer(what, |s| s.recv_done()).map_err(&map)
        } else {
            self.stream.recv_done().map_err(&map)?;
            self.stream.send_done().map_err(&map)
        }
    }

    /// Sends one message and receives the peer's (client sends first).
    pub fn swap<M: WireMessage>(&mut self, client: bool, msg: &M) -> Result<M> {
        let map = peer_died("the peer's results");
        if client {
            self.stream.send(msg).map_err(&map)?;
            let what = "the server's results (a stopped or hung server?)";
            self.answer(what, |s| s.recv()).map_err(&map)
        } else {
            let got = self.stream.recv().map_err(&map)?;
            self.stream.send(msg).map_err(&map)?;
            Ok(got)
        }
    }

    /// Whether the peer's process is gone (see `ExchangeStream::peer_closed`).
    pub fn peer_closed(&self) -> Result<bool> {
        self.stream.peer_closed()
    }

    /// The client's read of the server's answer, within [`REPLY_LIMIT`];
    /// `what` names it in the timeout's error.
    fn answer<T>(
        &mut self,
        what: &'static str,
        read: impl FnOnce(&mut ExchangeStream) -> Result<T>,
    ) -> Result<T> {
        self.stream.set_timeout(Some(REPLY_LIMIT))?;
        let got = read(&mut self.stream);
        self.stream.set_timeout(None)?;
        got.map_err(|e| match e {
            Error::Timeout { after, .. } => Error::Timeout { what, after },
            e => e,
        })
    }
}

/// Exchanges endpoints and regions with the peer and connects the QPs.
/// `regions[i]` is what the peer may access through QP `i`. Returns the
/// queues, the peer's region per QP, and the control connection.
pub fn establish(
    o: &Opts,
    dev: &Device,
    pending: Pending,
    regions: &[RemoteMr],
) -> Result<(Queues, Vec<RemoteMr>, Ctrl)> {
    let Pending {
        qps,
        send_cq,
        recv_cq,
    } = pending;
    let (qps, regions_out, ctrl) = connect(o, dev, qps, regions)?;
    Ok((
        Queues {
            qps,
            send_cq,
            recv_cq,
        },
        regions_out,
        ctrl,
    ))
}

/// [`establish`] for QPs on CQs of the caller's: the exchange with the peer,
/// and `qps` connected.
pub fn connect(
    o: &Opts,
    dev: &Device,
    qps: Vec<Qp<Rc, Init>>,
    regions: &[RemoteMr],
) -> Result<(Vec<ConnectedQp>, Vec<RemoteMr>, Ctrl)> {
    let gid = dev.gid_index;
    let mut local = Vec::with_capacity(qps.len());
    for (qp, region) in qps.iter().zip(regions) {
        local.push(PeerInfo::new(qp.endpoint(Some(gid))?).with_mr(*region));
    }
    let client = !o.is_server();
    let mut stream = connect_ctrl(o)?;
    check_fingerprint(o, &mut stream, client)?;
    let remote = exchange_peers(&mut stream, client, &local)?;
    let (connected, regions_out) = connect_qps(o, dev, qps, &remote, &local)?;
    // The run itself may take long (-D, --run_infinitely): no time limit from here on.
    stream.set_timeout(None)?;
    Ok((connected, regions_out, Ctrl { stream }))
}

/// The control connection: the client connects (waiting for a server started
/// late), the server accepts.
fn connect_ctrl(o: &Opts) -> Result<ExchangeStream> {
    Ok(match &o.host {
        Some(host) => ExchangeStream::connect(host, o.port, FIRST_TRY).or_else(|_| {
            // perftest gives up at once; this waits for a server started
            // late, and says so rather than sitting there silently.
            eprintln!(
                " No server at {host}:{} yet; retrying for up to {} s",
                o.port,
                CONNECT_TIMEOUT.as_secs()
            );
            ExchangeStream::connect(host, o.port, CONNECT_TIMEOUT)
        })?,
        None => ExchangeListener::bind(o.port)?.accept(Some(CONNECT_TIMEOUT))?,
    })
}

/// Both sides must run the same test with the same options: their
/// fingerprints are swapped (the client's first) and compared.
fn check_fingerprint(o: &Opts, stream: &mut ExchangeStream, client: bool) -> Result<()> {
    let mine = Fingerprint(o.fingerprint());
    let theirs = if client {
        stream.send(&mine)?;
        stream.recv::<Fingerprint>()?
    } else {
        let t = stream.recv::<Fingerprint>()?;
        stream.send(&mine)?;
        t
    };
    if theirs != mine {
        return Err(Error::Other(format!(
            "client and server were started with different parameters (start both with the \
             same options):\n  local:  {}\n  remote: {}",
            mine.0, theirs.0
        )));
    }
    Ok(())
}

/// Swaps the QPs' endpoints and regions with the peer, the client's first.
fn exchange_peers(
    stream: &mut ExchangeStream,
    client: bool,
    local: &[PeerInfo],
) -> Result<Vec<PeerInfo>> {
    let mut remote: Vec<PeerInfo> = Vec::with_capacity(local.len());
    if client {
        for l in local {
            stream.send(l)?;
        }
        for _ in 0..local.len() {
            remote.push(stream.recv()?);
        }
    } else {
        for _ in 0..local.len() {
            remote.push(stream.recv()?);
        }
        for l in local {
            stream.send(l)?;
        }
    }
    Ok(remote)
}

/// A QP ready to send.
type ConnectedQp = Qp<Rc, Rts>;

/// Brings each QP to RTS towards its peer QP; returns them with the region
/// the peer offers through each.
fn connect_qps(
    o: &Opts,
    dev: &Device,
    qps: Vec<Qp<Rc, Init>>,
    remote: &[PeerInfo],
    local: &[PeerInfo],
) -> Result<(Vec<ConnectedQp>, Vec<RemoteMr>)> {
    let mut connected = Vec::with_capacity(qps.len());
    let mut regions_out = Vec::with_capacity(qps.len());
    for ((qp, r), l) in qps.into_iter().zip(remote).zip(local) {
        let rd = if o.test.verb().writes_local() {
            dev.max_rd_atomic
        } else {
            1
        };
        let mtu = dev.ctx.query_port(o.ib_port)?.active_mtu;
        let rtr = RtrAttr::new(&r.endpoint, o.ib_port, mtu, Some(dev.gid_index))
            .max_dest_rd_atomic(rd)
            .min_rnr_timer(12);
        let qp = qp
            .rtr(rtr)?
            .rts(RtsAttr::new(l.endpoint.psn).max_rd_atomic(rd))?;
        connected.push(qp);
        let region = r
            .mrs
            .first()
            .copied()
            .ok_or_else(|| Error::Protocol("the peer sent no memory region".into()))?;
        regions_out.push(region);
    }
    Ok((connected, regions_out))
}

/// perftest's `BUFF_SIZE`: a message, but at least one page (`cycle_buffer`).
pub fn buff_size(size: usize) -> usize {
    size.max(page_size())
}

/// The page size, perftest's `cycle_buffer`.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// perftest's address cycling for small messages: consecutive messages go
/// to consecutive cache-line-aligned slots of one page (`increase_loc_addr`,
/// `increase_rem_addr`). Returns (slot stride, number of slots); one slot when
/// the message is larger than half a page or a post list is used.
pub fn cycle(size: usize, post_list: u32) -> (usize, usize) {
    const CACHE_LINE: usize = 64;
    let page = page_size();
    if post_list != 1 || size > page / 2 {
        return (0, 1);
    }
    let inc = if size > CACHE_LINE {
        size.div_ceil(CACHE_LINE) * CACHE_LINE
    } else {
        CACHE_LINE
    };
    (inc, (page / inc).max(1))
}
