//! Many RC connections set up at once from one thread ([`connect_all`]): each
//! id's next step starts as soon as its event arrives, and one `poll(2)` over
//! the ids' event channels waits for all of them, as librdmacm's `cmtime`
//! does, instead of one connection's steps after another's.

use std::time::Instant;

use crate::sys::fd::deadline_after;

use super::*;

/// A connection [`connect_all`] set up.
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
    /// Boxed: one connection of many is the size of the small steps.
    Connect(Box<Attached>),
}

impl Step {
    fn awaited(&self) -> Awaited {
        match self {
            Step::Addr => Awaited::ADDR_RESOLVED,
            Step::Route => Awaited::ROUTE_RESOLVED,
            Step::Connect(_) => Awaited::CONNECTED,
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
    // Timed out on their connect: dropped last (see above).
    let mut late = Vec::new();
    while !pending.is_empty() {
        let ready = match wait_for_events(&pending) {
            Ok(ready) => ready,
            Err(e) => {
                // poll itself failed: every connection still on its way ends with it.
                for p in pending.drain(..) {
                    out[p.index] = Some(Err(Error::Io {
                        what: "polling the rdma_cm event channels",
                        source: io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0)),
                    }));
                }
                break;
            }
        };
        let now = Instant::now();
        let mut next = Vec::with_capacity(pending.len());
        for (p, readable) in pending.into_iter().zip(ready) {
            let advanced = if readable {
                drain_events(p, param, timeout, &mut make_qp)
            } else {
                Advance::Waiting(p)
            };
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
        pending = next;
    }
    drop(late);
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(Error::Other("connect_all left a connection".into()))))
        .collect()
}

/// Polls the pending ids' channels until one is readable or the nearest
/// deadline; which are readable, in order.
fn wait_for_events(pending: &[Pending]) -> io::Result<Vec<bool>> {
    let mut fds: Vec<libc::pollfd> = pending
        .iter()
        .map(|p| libc::pollfd {
            fd: p.id.channel().fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let nearest = pending
        .iter()
        .map(|p| p.deadline)
        .min()
        .unwrap_or_else(Instant::now);
    let wait = nearest.saturating_duration_since(Instant::now());
    // Rounded up, so a deadline is not polled for in a busy loop just before it.
    let ms = i32::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
    // nfds_t is an unsigned long: every length fits.
    let n = fds.len() as libc::nfds_t;
    // SAFETY: `fds` is a live array of `n` pollfds; each fd is an open event
    // channel of an id that `pending` keeps alive during the call.
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
                    Step::Connect(Box::new(Attached { handshake, qp })),
                    Awaited::CONNECTED,
                ),
                Err(e) => return Advance::Done(p.index, Err(e)),
            }
        }
        Step::Connect(attached) => {
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
