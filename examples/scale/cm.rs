//! `scale cm-server` / `scale cm-client` on the blocking rdma_cm API: the steps
//! `cmtime` times, each over all connections before the next starts.
//!
//! The blocking calls wait for their event, so each step handles one connection
//! after the other (cmtime starts every resolution and connect, then waits for
//! all events on one channel).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use rdma_verbs::cm::{CmEventKind, CmId, ConnParam, EventChannel, accept_all, connect_all};
use rdma_verbs::prelude::*;

/// How long any one event may take before the run fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// What both sides agree on.
pub struct Run {
    pub conns: usize,
    pub port: u16,
}

/// The QP every connection gets: one request each way, as cmtime's.
pub fn caps() -> QpCaps {
    QpCaps {
        max_send_wr: 1,
        max_recv_wr: 1,
        ..QpCaps::default()
    }
}

/// cmtime's connection parameters: one READ in flight each way.
pub fn param() -> ConnParam {
    ConnParam::new().responder_resources(1).initiator_depth(1)
}

/// A CQ deep enough for the one request each way of `conns` QPs.
pub fn cq_depth(conns: usize) -> u32 {
    u32::try_from(2 * conns + 16).unwrap_or(u32::MAX)
}

/// The server's address, `ADDR:port`.
pub fn server_addr(addr: &str, port: u16) -> Result<SocketAddr> {
    let ip: IpAddr = addr.parse().map_err(|_| Error::InvalidArgument {
        what: "server address",
        reason: format!("`{addr}` is not an IP address"),
    })?;
    Ok(SocketAddr::new(ip, port))
}

/// Where the server listens.
pub fn listen_addr(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))
}

/// Times the steps of a run and prints each as `step NAME TOTAL_US`.
pub struct Steps(Instant);

impl Steps {
    pub fn start() -> Steps {
        Steps(Instant::now())
    }

    /// Ends the step `name` and starts the next.
    pub fn done(&mut self, name: &str) {
        println!("step {name} {}", self.0.elapsed().as_micros());
        self.0 = Instant::now();
    }
}

/// The QP of a connection on `id`, on the PD and CQ every connection shares
/// (made on the first call, on the id's device).
fn shared_qp(dev: &mut Option<(Pd, Cq)>, id: &CmId, conns: usize) -> Result<Qp<Rc, Init>> {
    if dev.is_none() {
        let ctx = id.context()?;
        *dev = Some((Pd::new(&ctx)?, Cq::new(&ctx, cq_depth(conns))?));
    }
    let Some((pd, cq)) = dev.as_ref() else {
        return Err(Error::Other("no device for the connection".into()));
    };
    id.create_qp(pd, cq, cq, caps())
}

/// Waits for each connection's DISCONNECTED from the client, answers it and
/// destroys the connection; then prints the run's summary.
fn serve_until_disconnected(
    conns: impl IntoIterator<Item = (Qp<Rc, Rts>, CmId)>,
    run: &Run,
    gone: usize,
) -> Result<()> {
    for (qp, id) in conns {
        id.expect_event(CmEventKind::Disconnected, WAIT)?;
        // The reply the client's disconnect waits for; the connection is down either way.
        let _ = id.disconnect();
        drop(qp);
    }
    println!("conns {}", run.conns);
    println!("disconnected_before_established {gone}");
    Ok(())
}

/// Accepts `conns` connections, then waits for each to be disconnected by the
/// client, answers the disconnect and destroys it.
pub fn server(run: &Run) -> Result<()> {
    let listener = CmId::listener(listen_addr(run.port), 1024)?;
    let mut dev: Option<(Pd, Cq)> = None;
    let mut conns = Vec::with_capacity(run.conns);
    let mut gone = 0;
    for _ in 0..run.conns {
        let req = listener.get_request(WAIT)?;
        let qp = shared_qp(&mut dev, req.id(), run.conns)?;
        match req.accept(qp, &param(), WAIT) {
            Ok(conn) => conns.push(conn),
            Err(e) if torn_down(&e) => gone += 1,
            Err(e) => return Err(e),
        }
    }
    serve_until_disconnected(conns, run, gone)
}

/// The blocking server with `cm::accept_all`: every request accepted as it
/// comes, every ESTABLISHED awaited together; then as `server`.
pub fn batch_server(run: &Run) -> Result<()> {
    let listener = CmId::listener(listen_addr(run.port), 1024)?;
    let mut dev: Option<(Pd, Cq)> = None;
    let mut accepted = accept_all(&listener, run.conns, &param(), WAIT, |req| {
        shared_qp(&mut dev, req.id(), run.conns)
    });
    if accepted.len() < run.conns {
        return Err(Error::Other(format!(
            "{} of {} connection requests came",
            accepted.len(),
            run.conns
        )));
    }
    if let Some(failed) = accepted
        .iter()
        .position(|c| c.as_ref().is_err_and(|e| !torn_down(e)))
    {
        // An error: returned by `?`.
        accepted.swap_remove(failed)?;
    }
    let gone = accepted.iter().filter(|c| c.is_err()).count();
    // Served where `accept_all` left them, held once.
    let conns = accepted.into_iter().flatten().map(|c| (c.qp, c.id));
    serve_until_disconnected(conns, run, gone)
}

/// Whether an accept failed because the client had disconnected already: its
/// last handshake message (RTU) can arrive after its disconnect (a lost RTU is
/// answered by a REP resent later), so the connection was set up from the
/// client's side and is torn down already.
pub fn torn_down(e: &Error) -> bool {
    matches!(
        e,
        Error::CmEvent {
            event: CmEventKind::Disconnected,
            ..
        }
    )
}

/// Sets up `conns` connections to `addr` step by step, then tears them down.
pub fn client(run: &Run, addr: &str) -> Result<()> {
    let dst = server_addr(addr, run.port)?;
    // librdmacm opens every device on its first channel; cmtime creates its
    // channel before it starts timing, so does this.
    let _warm = EventChannel::new()?;
    let mut t = Steps::start();
    let ids = (0..run.conns)
        .map(|_| CmId::new())
        .collect::<Result<Vec<_>>>()?;
    t.done("create_id");
    for id in &ids {
        id.resolve_addr(None, dst, WAIT)?;
    }
    t.done("resolve_addr");
    for id in &ids {
        id.resolve_route(WAIT)?;
    }
    t.done("resolve_route");
    let ctx = ids[0].context()?;
    let pd = Pd::new(&ctx)?;
    let cq = Cq::new(&ctx, cq_depth(run.conns))?;
    let mut qps = Vec::with_capacity(run.conns);
    for id in &ids {
        qps.push(id.create_qp(&pd, &cq, &cq, caps())?);
    }
    t.done("create_qp");
    // Each connected QP is collected where its INIT form was (std reuses the
    // buffer for a same-size map), so the connections are held once, as
    // `cmtime` holds its array of nodes.
    let up = qps
        .into_iter()
        .zip(&ids)
        .map(|(qp, id)| Ok(id.connect(qp, &param(), WAIT)?.0))
        .collect::<Result<Vec<_>>>()?;
    t.done("connect");
    tear_down(ids, up, t, run)
}

/// The client's teardown, timed as cmtime's: a disconnect sent on every id, the QPs
/// dropped, each id's DISCONNECTED awaited (`step disconnect`), the ids destroyed
/// (`step destroy`).
fn tear_down(ids: Vec<CmId>, qps: Vec<Qp<Rc, Rts>>, t: Steps, run: &Run) -> Result<()> {
    for id in &ids {
        id.disconnect()?;
    }
    drop(qps);
    await_disconnected(ids, t, run)
}

/// The rest of [`tear_down`] once every id was disconnected and the QPs dropped.
fn await_disconnected(ids: Vec<CmId>, mut t: Steps, run: &Run) -> Result<()> {
    for id in &ids {
        id.expect_event(CmEventKind::Disconnected, WAIT)?;
    }
    t.done("disconnect");
    drop(ids);
    t.done("destroy");
    println!("conns {}", run.conns);
    Ok(())
}

/// The blocking client with `cm::connect_all`: every connection's steps on
/// their events, all at once; the setup is one step (`step setup`), the
/// teardown as `client`'s, on the connections where `connect_all` left them
/// (held once, as `client` holds its own).
pub fn batch_client(run: &Run, addr: &str) -> Result<()> {
    let dst = server_addr(addr, run.port)?;
    let _warm = EventChannel::new()?;
    let mut t = Steps::start();
    let mut dev: Option<(Pd, Cq)> = None;
    let mut conns = connect_all(&vec![dst; run.conns], &param(), WAIT, |id| {
        shared_qp(&mut dev, id, run.conns)
    });
    if let Some(failed) = conns.iter().position(Result::is_err) {
        // An error: returned by `?`.
        conns.swap_remove(failed)?;
    }
    t.done("setup");
    for c in conns.iter().flatten() {
        c.id.disconnect()?;
    }
    // The QPs (and ESTABLISHED events) dropped, the ids kept (in the results'
    // buffer: std reuses it for this collect).
    let ids = conns
        .into_iter()
        .filter_map(Result::ok)
        .map(|c| c.id)
        .collect();
    await_disconnected(ids, t, run)
}
