//! [`AsyncChannel`]: a completion channel and the task that serves its CQs.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;

use ::tokio::io::unix::AsyncFd;
use ::tokio::sync::Notify;
use ::tokio::task::JoinHandle;

use super::cq::Shared;
use super::timer::FdTimer;
use super::{ReadinessFd, watch};
use crate::channel::CqId;
use crate::channel::{ACK_BATCH, CompletionChannel};
use crate::context::Context;
use crate::cq::Completion;
use crate::error::{Error, Result};
use crate::sys::addr_hash::AddrMap;

/// How many completions the driver takes per `ibv_poll_cq` call.
const POLL_BATCH: usize = 64;

/// Polls of one CQ before the driver moves on to the channel's other CQs
/// (and lets the tasks it woke run).
const ROUNDS_PER_TURN: usize = 16;

/// A completion channel whose driver task serves every [`AsyncCq`](super::AsyncCq)
/// created on it ([`AsyncCq::on_channel`](super::AsyncCq::on_channel)).
///
/// One channel and one task for many CQs: the driver reads which CQ each
/// event names and polls that one. Cheap to clone; the driver stops when
/// the last clone and the last CQ on it are dropped.
#[derive(Clone)]
pub struct AsyncChannel {
    inner: Arc<ChannelInner>,
}

struct ChannelInner {
    channel: CompletionChannel,
    registry: Arc<Registry>,
    driver: JoinHandle<()>,
}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// The CQs on a channel, shared by the handles and the driver.
#[derive(Default)]
struct Registry {
    cqs: Mutex<AddrMap<CqId, Weak<Shared>>>,
    /// Why the driver ended, once it has: set with `cqs` locked, so that a
    /// CQ is either stopped by `stop_all` or refused by `attach`, never left
    /// with no driver.
    ended: Mutex<Option<String>>,
    /// CQs added since the driver last looked: polled and armed first.
    added: Mutex<Vec<Arc<Shared>>>,
    kick: Notify,
}

impl Registry {
    fn cqs(&self) -> MutexGuard<'_, AddrMap<CqId, Weak<Shared>>> {
        self.cqs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn added(&self) -> MutexGuard<'_, Vec<Arc<Shared>>> {
        self.added.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn ended(&self) -> MutexGuard<'_, Option<String>> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl AsyncChannel {
    /// A completion channel on `ctx` and its driver task, spawned on the
    /// current tokio runtime. Fails outside a runtime.
    pub fn new(ctx: &Context) -> Result<AsyncChannel> {
        let channel = CompletionChannel::new(ctx)?;
        let fd = channel.readiness()?.as_raw_fd();
        // SAFETY: the readiness handle belongs to `channel`; a clone of it
        // moves into `Watch` next to `watched`, declared after it (dropped
        // after it), and keeps the descriptor open until then.
        let watched = unsafe { watch(fd, "registering a completion channel with tokio")? };
        let sweep = FdTimer::new(SAFETY_NET, Some(SAFETY_NET))?;
        let registry = Arc::new(Registry::default());
        let driver = ::tokio::spawn(drive(
            StopOnDrop(registry.clone()),
            Watch {
                watched,
                channel: channel.clone(),
                sweep,
            },
        ));
        Ok(AsyncChannel {
            inner: Arc::new(ChannelInner {
                channel,
                registry,
                driver,
            }),
        })
    }

    /// The device context.
    pub fn context(&self) -> &Context {
        self.inner.channel.context()
    }

    /// The underlying channel.
    pub(crate) fn channel(&self) -> &CompletionChannel {
        &self.inner.channel
    }

    /// Hands a new CQ to the driver; refused once the driver has ended
    /// (its runtime shut down, or the channel failed), since nothing would
    /// serve the CQ.
    pub(crate) fn attach(&self, cq: &Arc<Shared>) -> Result<()> {
        let reg = &self.inner.registry;
        let mut cqs = reg.cqs();
        if let Some(why) = reg.ended().as_deref() {
            return Err(Error::InvalidArgument {
                what: "AsyncCq::on_channel",
                reason: format!(
                    "the channel's completion driver has ended ({why}); create a new \
                     AsyncChannel on a running runtime"
                ),
            });
        }
        cqs.insert(cq.id, Arc::downgrade(cq));
        drop(cqs);
        reg.added().push(cq.clone());
        reg.kick.notify_one();
        Ok(())
    }

    /// Takes a CQ off the driver (its handle is being dropped).
    pub(crate) fn detach(&self, id: CqId) {
        let reg = &self.inner.registry;
        reg.cqs().remove(&id);
        reg.added().retain(|s| s.id != id);
    }
}

impl std::fmt::Debug for AsyncChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncChannel")
            .field("cqs", &self.inner.registry.cqs().len())
            .finish()
    }
}

struct Watch {
    // Field order is drop order: deregister from tokio while the descriptor is open.
    watched: AsyncFd<ReadinessFd>,
    channel: CompletionChannel,
    /// Expires every [`SAFETY_NET`].
    sweep: FdTimer,
}

/// Stops every CQ on the channel when the driver ends for any reason: an
/// error, its runtime shutting down, a panic, or never being polled (it is
/// an argument of the task's future, so dropping the future drops it).
struct StopOnDrop(Arc<Registry>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        stop_all(&self.0, "its driver task ended (runtime shut down?)");
    }
}

/// How often the driver looks at every CQ even without an event, so that an
/// event consumed behind its back (`CompletionChannel::try_next` on the
/// channel) costs at most this much latency instead of a hang.
const SAFETY_NET: std::time::Duration = std::time::Duration::from_secs(1);

/// The driver: serve the CQs with work, then sleep until an event or a new CQ.
async fn drive(guard: StopOnDrop, watch: Watch) {
    let registry = &*guard.0;
    let mut done = Batch {
        completions: Vec::with_capacity(POLL_BATCH),
        wakers: Vec::with_capacity(POLL_BATCH),
    };
    let mut pending: Vec<Arc<Shared>> = Vec::new();
    // The CQs still busy after a turn; swapped with `pending`, so that a
    // turn allocates nothing.
    let mut busy: Vec<Arc<Shared>> = Vec::new();
    loop {
        pending.append(&mut registry.added());
        for cq in pending.drain(..) {
            match serve(&cq, &mut done) {
                // (Locked: another thread holds the CQ's lock, for as long
                // as `AsyncQp::new` checks a QP.)
                Ok(Turn::More | Turn::Locked) => busy.push(cq),
                Ok(Turn::Idle) => {}
                Err(e) => cq.stop(e),
            }
        }
        std::mem::swap(&mut pending, &mut busy);
        // Events of the other CQs are read between turns, so a busy CQ
        // cannot starve them.
        if let Err(e) = read_events(registry, &watch.channel, &mut pending) {
            return stop_all(registry, &e);
        }
        if !pending.is_empty() {
            ::tokio::task::yield_now().await;
            continue;
        }
        ::tokio::select! {
            ready = watch.watched.readable() => {
                let mut ready = match ready {
                    Ok(r) => r,
                    Err(e) => return stop_all(registry, &e.to_string()),
                };
                if let Err(e) = read_events(registry, &watch.channel, &mut pending) {
                    return stop_all(registry, &e);
                }
                if pending.is_empty() {
                    // Read until empty: the next event is a new edge.
                    ready.clear_ready();
                }
            }
            () = registry.kick.notified() => {}
            tick = watch.sweep.tick() => {
                if let Err(e) = tick {
                    return stop_all(registry, &e.to_string());
                }
                pending = registry.cqs().values().filter_map(Weak::upgrade).collect();
            }
        }
    }
}

/// Reads every pending event, adding the CQs they name to `pending` once.
fn read_events(
    registry: &Registry,
    channel: &CompletionChannel,
    pending: &mut Vec<Arc<Shared>>,
) -> std::result::Result<(), String> {
    while let Some(id) = channel.try_next().map_err(|e| e.to_string())? {
        let cq = registry.cqs().get(&id).and_then(Weak::upgrade);
        if let Some(cq) = cq
            && !pending.iter().any(|p| Arc::ptr_eq(p, &cq))
        {
            pending.push(cq);
        }
    }
    Ok(())
}

/// How a CQ's turn ended.
enum Turn {
    /// Empty and armed.
    Idle,
    /// It still has work: serve it again.
    More,
    /// Another thread holds its lock: try again.
    Locked,
}

/// Polls `cq` for up to [`ROUNDS_PER_TURN`] batches; when it is empty, arms
/// it and polls once more.
fn serve(cq: &Shared, done: &mut Batch) -> Result<Turn> {
    for _ in 0..ROUNDS_PER_TURN {
        match poll_into(cq, done)? {
            None => return Ok(Turn::Locked),
            Some(0) => {}
            Some(_) => continue,
        }
        let Some(mut c) = cq.try_cq() else {
            return Ok(Turn::Locked);
        };
        if c.unacked_events() >= ACK_BATCH {
            c.ack_events();
        }
        c.req_notify(false)?;
        drop(c);
        match poll_into(cq, done)? {
            None => return Ok(Turn::Locked),
            Some(0) => return Ok(Turn::Idle),
            Some(_) => {}
        }
    }
    Ok(Turn::More)
}

/// One poll, its completions dispatched (`None`: a task holds the CQ's
/// lock); a lost-completions report is queued for `next` (the completions
/// of that poll are dispatched either way). The lock is held until they are
/// dispatched: `AsyncQp::new` checks that a QP has nothing outstanding under
/// the same lock, so a completion retired by this poll cannot still be on
/// its way to the waiters when a new wrapper registers its own.
fn poll_into(cq: &Shared, done: &mut Batch) -> Result<Option<usize>> {
    let Some(mut c) = cq.try_cq() else {
        return Ok(None);
    };
    done.keep_batch_size();
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        c.poll(&mut done.completions)
    }));
    let n = match polled {
        Ok(Ok(n)) => n,
        Ok(Err(e @ Error::CompletionsLost { .. })) => {
            cq.state().errors.push_back(e);
            done.completions.len()
        }
        Ok(Err(e)) => {
            // Completions read by the call's earlier batches are this CQ's:
            // dispatched before the error stops it (the batch is the
            // channel's, reused for its other CQs).
            if !done.completions.is_empty() {
                cq.dispatch(&mut done.completions, &mut done.wakers);
            }
            return Err(e);
        }
        // A buffer's Drop panicked while the poll retired requests. `Cq::poll`
        // lets such a panic go on only once its books are consistent, with
        // the completions it read in `done.completions`: they are dispatched,
        // and the panic is reported to `next` instead of ending the driver
        // (and with it every CQ on the channel).
        Err(panic) => {
            cq.state().errors.push_back(Error::Other(format!(
                "a buffer's Drop panicked while the completion driver polled: {}",
                panic_text(&*panic)
            )));
            done.completions.len()
        }
    };
    if n > 0 {
        cq.dispatch(&mut done.completions, &mut done.wakers);
    }
    drop(c);
    Ok(Some(n))
}

/// What a panic said, when it said it with a string.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

/// The driver's scratch space for one poll, allocated once: the completions
/// and the wakers of their futures.
struct Batch {
    completions: Vec<Completion>,
    wakers: Vec<Waker>,
}

impl Batch {
    /// A poll reads as many completions as `completions` has room for, and
    /// that vector trades buffers with the CQ's unclaimed queue (and through
    /// it with a caller of `next_batch`), so it can come back with any
    /// capacity: keep it about [`POLL_BATCH`], so that one poll neither holds
    /// the CQ for an unbounded batch nor allocates each time.
    fn keep_batch_size(&mut self) {
        let v = &mut self.completions;
        if v.capacity() > 4 * POLL_BATCH && v.is_empty() {
            *v = Vec::with_capacity(POLL_BATCH);
        } else if v.capacity() < POLL_BATCH {
            v.reserve_exact(POLL_BATCH - v.len());
        }
    }
}

/// The driver ends: every CQ on the channel stops, its waiters fail, and
/// CQs attached from now on are refused.
fn stop_all(registry: &Registry, error: &str) {
    let cqs: Vec<Arc<Shared>> = {
        let cqs = registry.cqs();
        registry.ended().get_or_insert_with(|| error.to_owned());
        cqs.values().filter_map(Weak::upgrade).collect()
    };
    for cq in cqs {
        cq.stop(Error::Other(format!(
            "the completion channel failed: {error}"
        )));
    }
}
