//! The async path (`--async N`, feature `tokio`): the client of write_bw and
//! send_bw through `rdma_verbs::tokio::AsyncQp`, on a current-thread runtime.
//!
//! Each message WRITEs or SENDs its slot (the same shared slices, cycled over
//! the same cache-line slots, as the safe path) through `AsyncQp::post`, and
//! its completion is awaited and its status checked; N requests are in
//! flight, in one of two shapes:
//! * `--async N`: one task keeps a window of N operations, oldest first (what
//!   `StreamExt::buffered(N)` does): each new operation is polled once, which
//!   posts it, and the oldest is awaited;
//! * `--async-tasks N`: N tasks, each taking the next message number and
//!   awaiting its operation before taking another;
//! * `--async-stream N`: one task posts with `AsyncQp::post_send` (no future
//!   per request) until N are in flight, then takes every completion there is
//!   with `AsyncCq::next_batch` and checks each one's status.
//!
//! Every request is signaled (a future resolves on its own completion; the
//! stream asks for each one), so the fair sync figure to set it against is
//! the safe path's with `-Q 1`.
//!
//! The CQs are `AsyncCq`s on one channel, whose driver task runs on the same
//! thread as the tasks. The server runs the safe path (its side is not
//! counted), so the two sides exchange what they always do: barrier, run,
//! results.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;

use rdma_verbs::mr::SharedMr;
use rdma_verbs::prelude::*;
use rdma_verbs::tokio::{AsyncCq, AsyncQp};

use crate::clock::{self, Rate};
use crate::conn::{self, Ctrl, Device};
use crate::opts::{AsyncShape, Opts, Verb};
use crate::report::{self, Table, WireRow};

/// Runs every size of the client's side of `o` with `inflight` requests in
/// flight; `regions[0]` is what the peer may access.
pub fn run(
    o: &Opts,
    rate: &Rate,
    dev: &Device,
    regions: &[RemoteMr],
    inflight: u32,
) -> Result<Table> {
    let rt = ::tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|source| Error::Io {
            what: "starting the tokio runtime",
            source,
        })?;
    // The CQs' driver task is spawned on the runtime current at their creation.
    let _in_rt = rt.enter();
    let (caps, send_depth, recv_depth) = conn::shape(o);
    let send_cq = AsyncCq::new(&dev.ctx, send_depth)?;
    let recv_cq = match recv_depth {
        Some(d) => Some(AsyncCq::on_channel(send_cq.channel(), d)?),
        None => None,
    };
    let rcq = recv_cq.as_ref().unwrap_or(&send_cq);
    let qp = Qp::new(&dev.pd, &send_cq.cq(), &rcq.cq(), caps)?
        .init(InitAttr::new(o.ib_port, conn::QP_ACCESS))?;
    let (qps, remote, mut ctrl) = conn::connect(o, dev, vec![qp], regions)?;
    let qp = qps
        .into_iter()
        .next()
        .ok_or_else(|| Error::Protocol("no QP was connected".into()))?;
    let qp = Arc::new(AsyncQp::new(qp, &send_cq, rcq)?);
    let mut table = Table::default();
    println!("{}", report::header(o));
    for &size in &o.sizes {
        let row = run_size(
            o, rate, dev, size, &rt, &qp, &send_cq, remote[0], inflight, &mut ctrl,
        )?;
        println!("{}", report::bw_line(&row, o.report_gbits));
        table.bw.push(row);
    }
    println!("{}", report::LINE);
    // The QP goes before its CQs (the tasks that held clones have ended).
    drop(qp);
    Ok(table)
}

/// One size: barrier, the stream, the results exchange.
#[allow(clippy::too_many_arguments)]
fn run_size(
    o: &Opts,
    rate: &Rate,
    dev: &Device,
    size: usize,
    rt: &::tokio::runtime::Runtime,
    qp: &Arc<AsyncQp<Rc, Rts>>,
    send_cq: &AsyncCq,
    remote: RemoteMr,
    inflight: u32,
    ctrl: &mut Ctrl,
) -> Result<report::BwRow> {
    let (stride, nslots) = conn::cycle(size, o.post_list);
    let region = dev
        .pd
        .alloc_mr(conn::buff_size(size), AccessFlags::LOCAL_WRITE)?
        .freeze();
    let src = (0..nslots)
        .map(|s| region.slice(s * stride, size))
        .collect::<Result<Vec<_>>>()?;
    let stream = Stream {
        qp: qp.clone(),
        src: src.into(),
        remote,
        stride: stride as u64,
        verb: o.test.verb(),
        iters: o.iters,
        next: AtomicU64::new(0),
    };
    ctrl.barrier(true)?;
    let start = clock::now();
    match o.async_shape {
        AsyncShape::Window => rt.block_on(stream.window(inflight as usize))?,
        AsyncShape::Tasks => rt.block_on(stream.run(inflight))?,
        AsyncShape::Stream => rt.block_on(stream.stream(send_cq, inflight as usize))?,
    }
    let end = clock::now();
    let mine = report::span_row(size, o.iters, start, end, rate, o.report_gbits);
    // The server's row: none from a receiver that does not send.
    let theirs = ctrl.swap(true, &WireRow(Some(mine)))?.0;
    Ok(theirs.map_or(mine, |t| mine.plus(t)))
}

/// One stream of messages, shared by its tasks.
struct Stream {
    qp: Arc<AsyncQp<Rc, Rts>>,
    /// One shared slice per cache-line slot.
    src: Arc<[SharedMr]>,
    remote: RemoteMr,
    stride: u64,
    verb: Verb,
    iters: u64,
    /// The next message number to send.
    next: AtomicU64,
}

impl Stream {
    /// The source of message `k` and its offset in the peer's region.
    fn source(&self, k: u64) -> (SharedMr, u64) {
        let slot = (k % self.src.len() as u64) as usize;
        (self.src[slot].clone(), slot as u64 * self.stride)
    }

    /// The request for message `k`.
    fn request(&self, k: u64) -> SendWr<'static> {
        let (src, offset) = self.source(k);
        match self.verb {
            Verb::Write => SendWr::write_from(0, src, self.remote, offset),
            _ => SendWr::send_from(0, src),
        }
    }

    /// One task, a window of `inflight` operations: new ones are polled once
    /// (posted) as the oldest complete.
    async fn window(&self, inflight: usize) -> Result<()> {
        let mut ring = VecDeque::with_capacity(inflight);
        let mut k = 0;
        std::future::poll_fn(|cx| {
            loop {
                while ring.len() < inflight && k < self.iters {
                    // Made in place: moving a made operation into the ring
                    // would copy its request.
                    ring.push_back(self.qp.post(self.request(k)));
                    k += 1;
                    let Some(op) = ring.back_mut() else { break };
                    if let Poll::Ready(done) = Pin::new(op).poll(cx) {
                        ring.pop_back();
                        done.map_err(Error::from)?.result()?;
                    }
                }
                let Some(oldest) = ring.front_mut() else {
                    return Poll::Ready(Ok(()));
                };
                match Pin::new(oldest).poll(cx) {
                    Poll::Ready(done) => {
                        ring.pop_front();
                        done.map_err(Error::from)?.result()?;
                    }
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await
    }

    /// One task, `inflight` requests posted without futures: posts until the
    /// window is full, then takes whatever completions are there in one batch.
    /// One loop per verb, as a stream of one verb is written: the request's
    /// kind is known where it is posted.
    async fn stream(&self, cq: &AsyncCq, inflight: usize) -> Result<()> {
        match self.verb {
            Verb::Write => {
                let write = |k| {
                    let (src, offset) = self.source(k);
                    SendWr::write_from(0, src, self.remote, offset)
                };
                self.stream_of(cq, inflight, write).await
            }
            _ => {
                let send = |k| SendWr::send_from(0, self.source(k).0);
                self.stream_of(cq, inflight, send).await
            }
        }
    }

    /// [`stream`](Stream::stream) with the requests `request` makes.
    async fn stream_of(
        &self,
        cq: &AsyncCq,
        inflight: usize,
        request: impl Fn(u64) -> SendWr<'static>,
    ) -> Result<()> {
        let mut done = Vec::with_capacity(inflight);
        let (mut posted, mut completed) = (0u64, 0u64);
        while completed < self.iters {
            while posted < self.iters && posted - completed < inflight as u64 {
                self.qp
                    .post_send(request(posted).signaled(true))
                    .map_err(Error::from)?;
                posted += 1;
            }
            completed += cq.next_batch(&mut done, inflight).await? as u64;
            for c in done.drain(..) {
                c.result()?;
            }
        }
        Ok(())
    }

    /// Spawns `inflight` tasks and waits for all of them.
    async fn run(self, inflight: u32) -> Result<()> {
        let this = Arc::new(self);
        let tasks: Vec<_> = (0..inflight)
            .map(|_| ::tokio::spawn(this.clone().task()))
            .collect();
        let mut first_error = None;
        for t in tasks {
            let outcome = t
                .await
                .unwrap_or_else(|e| Err(Error::Other(format!("an async stream task failed: {e}"))));
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Sends messages one at a time, each awaited, until the stream's
    /// numbers run out.
    async fn task(self: Arc<Self>) -> Result<()> {
        loop {
            let k = self.next.fetch_add(1, Ordering::Relaxed);
            if k >= self.iters {
                return Ok(());
            }
            self.qp
                .post(self.request(k))
                .await
                .map_err(Error::from)?
                .result()?;
        }
    }
}
