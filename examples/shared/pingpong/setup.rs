//! What every port sets up before its loop, in the C programs' order and
//! with their messages: device, channel, PD, CQ, buffers, the local endpoint
//! and the TCP exchange of endpoints.

use rdma_verbs::device::LinkLayer;
use rdma_verbs::exchange::{self, ExchangeListener};
use rdma_verbs::prelude::*;
use rdma_verbs::qp::{Connected, QpState, QpType};

use super::{CONNECT_TIMEOUT, Common, RECV_WRID};

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

/// The completion channel the CQ's events come on, with `-e`.
pub fn open_channel(ctx: &Context, use_event: bool) -> Result<Option<CompletionChannel>, String> {
    if !use_event {
        return Ok(None);
    }
    CompletionChannel::new(ctx)
        .map(Some)
        .map_err(|e| format!("Couldn't create completion channel: {e}"))
}

/// The CQ of `depth` entries, on `channel` when there is one.
pub fn create_cq(
    ctx: &Context,
    channel: Option<&CompletionChannel>,
    depth: u32,
) -> Result<Cq, String> {
    match channel {
        Some(ch) => Cq::with_channel(ctx, depth, ch),
        None => Cq::new(ctx, depth),
    }
    .map_err(|e| format!("Couldn't create CQ: {e}"))
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
    let channel = open_channel(&ctx, use_event)?;
    let pd = Pd::new(&ctx).map_err(|e| format!("Couldn't allocate PD: {e}"))?;
    let access = access(&ctx)?;
    // The CQ before the buffers: it checks the depth against the device's
    // max_cqe, so that a huge -r is refused before anything is allocated.
    let depth = rx_depth.checked_add(1).ok_or("-r is too large")?;
    let cq = create_cq(&ctx, channel.as_ref(), depth)?;
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

/// Prints this side's address line (ending in `local_sep`), exchanges
/// endpoints and connects with `connect`, printing the peer's line: the
/// client before it connects, the server after, as the C programs do.
pub fn exchange_printed<Q>(
    o: &Common,
    my_dest: &Endpoint,
    local_sep: char,
    connect: impl FnOnce(&Endpoint) -> Result<Q, String>,
) -> Result<(Endpoint, Q), String> {
    print_dest("local address: ", my_dest, local_sep);
    let client = o.servername.is_some();
    let (rem_dest, q) = exchange_dest(o.servername.as_deref(), o.port, my_dest, |rem| {
        if client {
            print_dest("remote address:", rem, ',');
        }
        connect(rem)
    })?;
    if !client {
        print_dest("remote address:", &rem_dest, ',');
    }
    Ok((rem_dest, q))
}
