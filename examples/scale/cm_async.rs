//! `scale cm-server --tokio` / `scale cm-client --tokio`: the same steps on the
//! async rdma_cm layer, every connection's step started before any is awaited
//! (as cmtime does), on one runtime thread.
//!
//! `AsyncCmId::resolve` creates the id and resolves address and route in one
//! future, so the client reports those three as one step, `resolve`.

use tokio::task::JoinSet;

use rdma_verbs::cm::{CmEventKind, EventChannel};
use rdma_verbs::prelude::*;
use rdma_verbs::tokio::{AsyncCmId, AsyncCq, AsyncQp, Listener};

use super::cm::{Run, Steps, WAIT, caps, cq_depth, listen_addr, param, server_addr, torn_down};

/// Runs the server or the client on a current-thread runtime.
pub fn run(run: &Run, server: bool, addr: Option<&str>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| Error::Io {
            what: "starting the tokio runtime",
            source,
        })?;
    rt.block_on(async {
        match addr {
            Some(addr) if !server => client(run, addr).await,
            _ => serve(run).await,
        }
    })
}

/// Every task's result, in the order the tasks finished (no caller depends on
/// the order), collected into one `Vec`.
async fn all<T: 'static>(mut set: JoinSet<Result<T>>) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(set.len());
    while let Some(joined) = set.join_next().await {
        out.push(joined.map_err(|e| Error::Other(format!("a connection task failed: {e}")))??);
    }
    Ok(out)
}

/// Accepts `conns` connections, each on its own task, which then waits for the
/// client's disconnect, answers it and destroys the connection (or finds it torn
/// down already, see [`torn_down`]).
async fn serve(run: &Run) -> Result<()> {
    let listener = Listener::bind(listen_addr(run.port), 1024)?;
    let mut dev: Option<(Pd, AsyncCq)> = None;
    let mut set = JoinSet::new();
    for _ in 0..run.conns {
        let req = listener.request().await?;
        if dev.is_none() {
            let ctx = req.id().context()?;
            dev = Some((Pd::new(&ctx)?, AsyncCq::new(&ctx, cq_depth(run.conns))?));
        }
        let Some((pd, cq)) = &dev else {
            return Err(Error::Other("no device for the request".into()));
        };
        let qp = req.id().create_qp(pd, &cq.cq(), &cq.cq(), caps())?;
        let qp = AsyncQp::new(qp, cq, cq)?;
        set.spawn(async move {
            let (qp, mut id) = match AsyncCmId::accept(req, qp, &param(), WAIT).await {
                Ok(up) => up,
                Err(e) if torn_down(&e) => return Ok(true),
                Err(e) => return Err(e),
            };
            let ev = id.event().await?;
            if ev.kind != CmEventKind::Disconnected {
                return Err(ev.into_error("waiting for the client's disconnect"));
            }
            id.disconnect(WAIT).await?;
            drop(qp);
            Ok(false)
        });
    }
    let gone = all(set).await?.into_iter().filter(|&g| g).count();
    println!("conns {}", run.conns);
    println!("disconnected_before_established {gone}");
    Ok(())
}

/// Sets up `conns` connections to `addr`, each step started for all of them
/// before it is awaited, then tears them down.
async fn client(run: &Run, addr: &str) -> Result<()> {
    let dst = server_addr(addr, run.port)?;
    // As the blocking client: librdmacm's one-time start, untimed as in cmtime.
    let _warm = EventChannel::new()?;
    let mut t = Steps::start();
    let mut set = JoinSet::new();
    for _ in 0..run.conns {
        set.spawn(async move { AsyncCmId::resolve(dst, WAIT).await });
    }
    let ids = all(set).await?;
    t.done("resolve");
    let ctx = ids[0].id().context()?;
    let pd = Pd::new(&ctx)?;
    let cq = AsyncCq::new(&ctx, cq_depth(run.conns))?;
    let mut qps = Vec::with_capacity(run.conns);
    for id in &ids {
        let qp = id.id().create_qp(&pd, &cq.cq(), &cq.cq(), caps())?;
        qps.push(AsyncQp::new(qp, &cq, &cq)?);
    }
    t.done("create_qp");
    let mut set = JoinSet::new();
    for (mut id, qp) in ids.into_iter().zip(qps) {
        set.spawn(async move {
            let r = id.connect(qp, &param(), WAIT).await;
            r.map(|(qp, _)| (id, qp))
        });
    }
    let up = all(set).await?;
    t.done("connect");
    let mut set = JoinSet::new();
    for (mut id, qp) in up {
        set.spawn(async move {
            let r = id.disconnect(WAIT).await;
            drop(qp);
            r.map(|()| id)
        });
    }
    let ids = all(set).await?;
    t.done("disconnect");
    drop(ids);
    t.done("destroy");
    println!("conns {}", run.conns);
    Ok(())
}
