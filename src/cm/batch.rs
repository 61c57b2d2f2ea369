//! Many RC connections set up at once from one thread, on the active side
//! ([`connect_all`]) and the passive one ([`accept_all`]): each id's next step
//! starts as soon as its event arrives, and one `poll(2)` over the ids' event
//! channels waits for all of them, as librdmacm's `cmtime` does, instead of
//! one connection's steps after another's.

use std::os::fd::RawFd;
use std::time::Instant;

use crate::sys::fd::deadline_after;

use super::*;

/// A connection [`connect_all`] or [`accept_all`] set up.
#[derive(Debug)]
pub struct Connected {
    /// The connection's id: its events ([`CmId::get_event`]), [`CmId::disconnect`].
    pub id: CmId,
    /// The QP, in RTS (receives posted before the connect carried over).
    pub qp: Qp<Rc, Rts>,
    /// The ESTABLISHED event (the peer's private data).
    pub established: CmEvent,
}

/// A QP attached to its id for the connect. Fields drop in declaration order:
/// the handshake detaches the QP before the QP is destroyed.
struct Attached {
    handshake: Handshake,
    qp: Qp<Rc, Init>,
}

/// Where one connection is.
enum Step {
    Addr,
    Route,
    /// A connect's or an accept's (what it waits for). Boxed: one connection
    /// of many is the size of the small steps.
    Handshake(Box<Attached>, Awaited),
}

impl Step {
    fn awaited(&self) -> Awaited {
        match self {
            Step::Addr => Awaited::ADDR_RESOLVED,
            Step::Route => Awaited::ROUTE_RESOLVED,
            Step::Handshake(_, awaited) => *awaited,
        }
    }
}

/// One connection on its way, with the deadline of its current step.
struct Pending {
    index: usize,
    id: CmId,
    step: Step,
    deadline: Instant,
}

/// What one event did to a connection.
// A value returned once per event and matched at once: boxing the large
// variant would allocate per connection for nothing.
#[allow(clippy::large_enum_variant)]
enum Advance {
    Waiting(Pending),
    Done(usize, Result<Connected>),
}

/// Sets up an RC connection to each of `dsts` at once, from this thread:
/// resolves each address and route, calls `make_qp` with the id once its route
/// is resolved (create the QP there with [`CmId::create_qp`] and post its
/// receives; when every destination routes through one device, the PD and CQs
/// can be shared, made on the first call from [`CmId::context`]), and connects
/// it with `param`. Each step of each connection is bounded by `timeout` (the
/// resolutions plus 2 s for the kernel to report, as [`CmId::resolve_addr`]), so
/// a connection ends within about three times that, plus what `make_qp` takes.
///
/// Returns one result per destination, in order: the [`Connected`] id and QP,
/// or what ended that connection (the error `make_qp` returned, an
/// [`Error::CmEvent`] such as REJECTED or UNREACHABLE, an
/// [`Error::Timeout`]); the others go on.
///
/// On iWARP two waits of the kernel's are outside `timeout`. Where
/// `rdma_connect` connects the TCP stream before it returns (siw on Debian's
/// 6.1 and 6.12 kernels does), a destination that does not answer holds the
/// whole call for TCP's connect timeout, and a refusal is an [`Error::Verb`]
/// (`ECONNREFUSED`) at once. And a connect that timed out keeps its QP in the kernel until the
/// peer answers or the MPA timer expires (siw: 10 s): such connections are
/// dropped after the others are done, and the call returns after that wait.
///
/// ```no_run
/// use std::time::Duration;
/// use rdma_verbs::cm::{connect_all, ConnParam};
/// use rdma_verbs::prelude::*;
/// let dsts: Vec<std::net::SocketAddr> = (0..64).map(|_| "10.99.0.1:7174".parse().unwrap()).collect();
/// // Four requests each way per connection, one CQ for all of them.
/// let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, ..QpCaps::default() };
/// let mut dev: Option<(Pd, Cq)> = None;
/// let conns = connect_all(&dsts, &ConnParam::new(), Duration::from_secs(5), |id| {
///     if dev.is_none() {
///         let ctx = id.context()?;
///         dev = Some((Pd::new(&ctx)?, Cq::new(&ctx, 64 * 8)?));
///     }
///     let (pd, cq) = dev.as_ref().expect("made above");
///     id.create_qp(pd, cq, cq, caps)
/// });
/// for c in conns {
///     let c = c?;
///     println!("connected QP {}", c.qp.qp_num());
/// }
/// # Ok::<(), rdma_verbs::Error>(())
/// ```
#[doc(alias = "rdma_connect")]
pub fn connect_all<F>(
    dsts: &[SocketAddr],
    param: &ConnParam,
    timeout: Duration,
    mut make_qp: F,
) -> Vec<Result<Connected>>
where
    F: FnMut(&CmId) -> Result<Qp<Rc, Init>>,
{
    let mut out: Vec<Option<Result<Connected>>> = dsts.iter().map(|_| None).collect();
    let mut pending = Vec::with_capacity(dsts.len());
    for (index, &dst) in dsts.iter().enumerate() {
        let started = CmId::new().and_then(|id| {
            id.start_resolve_addr(dst, timeout)?;
            Ok(id)
        });
        match started {
            Ok(id) => pending.push(Pending {
                index,
                id,
                step: Step::Addr,
                deadline: deadline_after(Awaited::ADDR_RESOLVED.limit(timeout)),
            }),
            Err(e) => out[index] = Some(Err(e)),
        }
    }
    let mut late = Vec::new();
    while !pending.is_empty() {
        let ready = poll_readable(pending.iter().map(|p| p.id.channel().fd()), &pending);
        pending = advance(
            pending,
            ready,
            param,
            timeout,
            &mut make_qp,
            &mut out,
            &mut late,
        );
    }
    finish(out, late)
}

/// Accepts up to `n` connection requests on `listener` from this thread,
/// without waiting for one connection before the next: calls `make_qp` with
/// each request as it comes (create the QP with [`CmId::create_qp`] on
/// [`request.id()`](ConnectRequest::id) and post its receives; its private
/// data and peer are there too; an error rejects it), accepts it with `param`
/// at once, and waits for the ESTABLISHED of every accepted connection
/// together, each bounded by `timeout`. Each request must come within
/// `timeout` of the previous one (or of the call); when none does, taking
/// stops and fewer than `n` results come back.
///
/// Returns one result per request taken, in the order they came (the order
/// `make_qp` was called in): the [`Connected`] id and QP, or what ended that
/// connection. An error on the listener (an error event, or one taking a
/// request, such as running out of file descriptors: each connection's id has
/// an event channel) ends the taking, as the last result. A `listener` that is
/// not listening gets no request: no result after `timeout`. One whose events
/// the tokio layer reads (an async `Listener`'s id) is refused with
/// [`Error::InvalidArgument`]. On iWARP an accept that timed out keeps its QP
/// in the kernel until the MPA exchange ends, and the call returns after that
/// wait (as [`connect_all`]'s).
/// ```no_run
/// use std::time::Duration;
/// use rdma_verbs::cm::{accept_all, CmId, ConnParam};
/// use rdma_verbs::prelude::*;
/// let listener = CmId::listener("0.0.0.0:7174".parse().unwrap(), 1024)?;
/// let caps = QpCaps { max_send_wr: 4, max_recv_wr: 4, ..QpCaps::default() };
/// let mut dev: Option<(Pd, Cq)> = None;
/// let conns = accept_all(&listener, 64, &ConnParam::new(), Duration::from_secs(5), |req| {
///     if dev.is_none() {
///         let ctx = req.id().context()?;
///         dev = Some((Pd::new(&ctx)?, Cq::new(&ctx, 64 * 8)?));
///     }
///     let (pd, cq) = dev.as_ref().expect("made above");
///     req.id().create_qp(pd, cq, cq, caps)
/// });
/// println!("{} connections", conns.iter().filter(|c| c.is_ok()).count());
/// # Ok::<(), rdma_verbs::Error>(())
/// ```
#[doc(alias = "rdma_accept")]
pub fn accept_all<F>(
    listener: &CmId,
    n: usize,
    param: &ConnParam,
    timeout: Duration,
    mut make_qp: F,
) -> Vec<Result<Connected>>
where
    F: FnMut(&ConnectRequest) -> Result<Qp<Rc, Init>>,
{
    if listener.inner.is_shared() {
        return vec![Err(Error::InvalidArgument {
            what: "listener",
            reason: "its events arrive on the tokio runtime's shared channel, which that \
                     runtime reads: accept its requests with the async Listener, or listen \
                     with CmId::listener"
                .into(),
        })];
    }
    // `n` may be a "no more than"; the vector grows as requests come.
    let mut out = Vec::with_capacity(n.min(1024));
    let mut pending: Vec<Pending> = Vec::new();
    let mut late = Vec::new();
    // When the next request must have come by; `None` once taking stopped.
    let mut next_request = (n > 0).then(|| deadline_after(timeout));
    // Accepted connections have no step that makes a QP.
    let mut no_qp = |_: &CmId| {
        Err(Error::Other(
            "accept_all makes no QP after the accept".into(),
        ))
    };
    while next_request.is_some() || !pending.is_empty() {
        let until = pending.iter().map(|p| p.deadline).chain(next_request).min();
        let listening = next_request.map(|_| listener.channel().fd());
        let fds = listening
            .into_iter()
            .chain(pending.iter().map(|p| p.id.channel().fd()));
        let mut ready = poll_until(fds, until);
        // Started after the poll: their channels are looked at from the next one.
        let mut started = Vec::new();
        match (next_request, ready.as_mut()) {
            (Some(by), Ok(ready)) => {
                let requested = ready.remove(0);
                let mut start = |req, index| {
                    let p = start_accept(req, index, param, timeout, &mut make_qp);
                    p.map(|p| started.push(p))
                };
                let taking = Taking {
                    listener,
                    n,
                    timeout,
                };
                next_request = taking.take(requested, by, &mut out, &mut start);
            }
            (Some(_), Err(e)) => {
                out.push(Some(Err(Error::Io {
                    what: "polling the rdma_cm event channels",
                    source: io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0)),
                })));
                next_request = None;
            }
            (None, _) => {}
        }
        pending = advance(
            pending, ready, param, timeout, &mut no_qp, &mut out, &mut late,
        );
        pending.append(&mut started);
    }
    finish(out, late)
}

/// What `accept_all` takes requests from, and how many within what time.
struct Taking<'a> {
    listener: &'a CmId,
    n: usize,
    timeout: Duration,
}

impl Taking<'_> {
    /// Takes the requests waiting on the listener (when `requested`, its
    /// channel is readable), handing each to `start` with its index in `out`;
    /// returns when the next one must have come by (`timeout` after the last),
    /// or `None` when taking is over (`n` taken, `by` passed, or an error on
    /// the listener, recorded in `out`).
    fn take(
        &self,
        requested: bool,
        by: Instant,
        out: &mut Vec<Option<Result<Connected>>>,
        start: &mut dyn FnMut(ConnectRequest, usize) -> Result<()>,
    ) -> Option<Instant> {
        let mut by = by;
        while requested && out.len() < self.n {
            let mut ev = match self.listener.try_event() {
                Ok(Some(ev)) => ev,
                Ok(None) => break,
                Err(e) => {
                    out.push(Some(Err(e)));
                    return None;
                }
            };
            if let Some(req) = ev.take_request() {
                let index = out.len();
                out.push(None);
                if let Err(e) = start(req, index) {
                    out[index] = Some(Err(e));
                }
                by = deadline_after(self.timeout);
            } else if !matches!(ev.kind, CmEventKind::AddrChange | CmEventKind::TimewaitExit) {
                out.push(Some(Err(ev.into_error("rdma_get_request"))));
                return None;
            }
        }
        (out.len() < self.n && Instant::now() < by).then_some(by)
    }
}

/// Makes `req`'s QP and accepts it without waiting: the connection, waiting
/// for ESTABLISHED. An error drops the request (rejecting it) or, after a
/// failed `rdma_accept`, its id (which refuses the peer).
fn start_accept<F>(
    req: ConnectRequest,
    index: usize,
    param: &ConnParam,
    timeout: Duration,
    make_qp: &mut F,
) -> Result<Pending>
where
    F: FnMut(&ConnectRequest) -> Result<Qp<Rc, Init>>,
{
    let qp = make_qp(&req)?;
    // SAFETY: as in `next_step`: the QP moves into `Attached` with its
    // handshake and leaves it only when the handshake is dropped.
    let (id, handshake) = unsafe { req.start_accept(&qp, param)? };
    Ok(Pending {
        index,
        id,
        step: Step::Handshake(Box::new(Attached { handshake, qp }), Awaited::ACCEPTED),
        deadline: deadline_after(Awaited::ACCEPTED.limit(timeout)),
    })
}

/// Moves each pending connection on with the events of the ids `ready` says
/// are readable, records the ones that ended in `out` (those past their
/// deadline as timed out, kept in `late`), and returns the others.
fn advance<F>(
    pending: Vec<Pending>,
    ready: io::Result<Vec<bool>>,
    param: &ConnParam,
    timeout: Duration,
    make_qp: &mut F,
    out: &mut [Option<Result<Connected>>],
    late: &mut Vec<Pending>,
) -> Vec<Pending>
where
    F: FnMut(&CmId) -> Result<Qp<Rc, Init>>,
{
    let ready = match ready {
        Ok(ready) => ready,
        Err(e) => {
            // poll itself failed: every connection still on its way ends with it.
            for p in pending {
                out[p.index] = Some(Err(Error::Io {
                    what: "polling the rdma_cm event channels",
                    source: io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0)),
                }));
            }
            return Vec::new();
        }
    };
    let now = Instant::now();
    let mut next = Vec::with_capacity(pending.len());
    for (i, p) in pending.into_iter().enumerate() {
        // One readiness per pending connection, in order (a missing one: not readable).
        let readable = ready.get(i).copied().unwrap_or(false);
        let mut advanced = if readable {
            drain_events(p, param, timeout, make_qp)
        } else {
            Advance::Waiting(p)
        };
        if let Advance::Waiting(p) = advanced {
            advanced = if !readable && p.deadline <= now {
                // A last look: its event may have come after the poll (while
                // other connections' requests were taken, say).
                drain_events(p, param, timeout, make_qp)
            } else {
                Advance::Waiting(p)
            };
        }
        match advanced {
            Advance::Waiting(p) if p.deadline <= now => {
                let awaited = p.step.awaited();
                out[p.index] = Some(Err(Error::Timeout {
                    what: awaited.what,
                    after: awaited.limit(timeout),
                }));
                late.push(p);
            }
            Advance::Waiting(p) => next.push(p),
            Advance::Done(index, r) => out[index] = Some(r),
        }
    }
    next
}

/// The results in order, after dropping the connections that timed out
/// (on iWARP that waits for the kernel, see [`connect_all`]).
fn finish(out: Vec<Option<Result<Connected>>>, late: Vec<Pending>) -> Vec<Result<Connected>> {
    drop(late);
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Other("a batch left a connection".into()))))
        .collect()
}

/// Polls `fds` until one is readable or the nearest deadline of `pending`
/// (or `until`) passes; which are readable, in order.
fn poll_readable(fds: impl Iterator<Item = RawFd>, pending: &[Pending]) -> io::Result<Vec<bool>> {
    poll_until(fds, pending.iter().map(|p| p.deadline).min())
}

/// Polls `fds` until one is readable or `until` passes (now when `None`).
fn poll_until(fds: impl Iterator<Item = RawFd>, until: Option<Instant>) -> io::Result<Vec<bool>> {
    let mut fds: Vec<libc::pollfd> = fds
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let wait = until.map_or(Duration::ZERO, |t| {
        t.saturating_duration_since(Instant::now())
    });
    // Rounded up, so a deadline is not polled for in a busy loop just before it.
    let ms = i32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    // nfds_t is an unsigned long: every length fits.
    let n = fds.len() as libc::nfds_t;
    // SAFETY: `fds` is a live array of `n` pollfds; each fd is an open event
    // channel of an id the caller keeps alive during the call.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(fds.iter().map(|f| f.revents != 0).collect())
}

/// Takes the id's waiting events and moves the connection on with each.
fn drain_events<F>(mut p: Pending, param: &ConnParam, timeout: Duration, make_qp: &mut F) -> Advance
where
    F: FnMut(&CmId) -> Result<Qp<Rc, Init>>,
{
    loop {
        let ev = match p.id.try_event() {
            Ok(Some(ev)) => ev,
            Ok(None) => return Advance::Waiting(p),
            Err(e) => return Advance::Done(p.index, Err(e)),
        };
        match p.step.awaited().judge(ev) {
            None => {}
            Some(Err(e)) => return Advance::Done(p.index, Err(e)),
            Some(Ok(ev)) => match next_step(p, ev, param, timeout, make_qp) {
                Advance::Waiting(again) => p = again,
                done => return done,
            },
        }
    }
}

/// Starts the step after the one `ev` ended.
fn next_step<F>(
    mut p: Pending,
    ev: CmEvent,
    param: &ConnParam,
    timeout: Duration,
    make_qp: &mut F,
) -> Advance
where
    F: FnMut(&CmId) -> Result<Qp<Rc, Init>>,
{
    let step = std::mem::replace(&mut p.step, Step::Addr);
    let (step, awaited) = match step {
        Step::Addr => match p.id.start_resolve_route(timeout) {
            Ok(()) => (Step::Route, Awaited::ROUTE_RESOLVED),
            Err(e) => return Advance::Done(p.index, Err(e)),
        },
        Step::Route => {
            let qp = match make_qp(&p.id) {
                Ok(qp) => qp,
                Err(e) => return Advance::Done(p.index, Err(e)),
            };
            // SAFETY: the QP moves into `Attached` with its handshake, whose
            // fields drop the handshake first, and leaves it only with the
            // handshake, which is dropped right then (below), before the QP is
            // used or dropped. Moving a `Qp` does not move the `ibv_qp`
            // librdmacm points at.
            match unsafe { p.id.start_connect(&qp, param) } {
                Ok(handshake) => (
                    Step::Handshake(Box::new(Attached { handshake, qp }), Awaited::CONNECTED),
                    Awaited::CONNECTED,
                ),
                Err(e) => return Advance::Done(p.index, Err(e)),
            }
        }
        Step::Handshake(attached, _) => {
            let Attached { handshake, qp } = *attached;
            drop(handshake);
            // SAFETY: ESTABLISHED on an id with this QP attached means librdmacm
            // moved the QP to RTR and RTS (else it reports CONNECT_ERROR).
            let qp = unsafe { qp.assume_state::<Rts>() };
            let connected = Connected {
                id: p.id,
                qp,
                established: ev,
            };
            return Advance::Done(p.index, Ok(connected));
        }
    };
    p.step = step;
    p.deadline = deadline_after(awaited.limit(timeout));
    Advance::Waiting(p)
}
