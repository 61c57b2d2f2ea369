//! `perf`: perftest's bandwidth and latency tests, written with this crate, on
//! its safe data path (`--safe`, the default) or its raw one (`--raw`).
//!
//! ```text
//! perf write_bw -d rxe0 -x 1 -s 65536 -n 1000            # server
//! perf write_bw -d rxe0 -x 1 -s 65536 -n 1000 10.99.0.1  # client
//! ```
//!
//! Subcommands: `write_bw`, `read_bw`, `send_bw`, `write_lat`, `send_lat`,
//! `read_lat`, `atomic_bw` (8-byte fetch-and-add, or compare-and-swap with
//! `-A CMP_AND_SWAP`; `-o` sets the outstanding READs/atomics). Flags are
//! perftest's where they apply (`perf <test> -h`), with
//! perftest's defaults and dependency rules, so that the same flags do the
//! same work as the C tools: the same message counts, send queue depth, CQ
//! moderation (100, or 1 above 8 KiB), signaling, post lists, poll batches
//! (16) and address cycling. Output: perftest's table, columns and units
//! (MB = MiB; `--report_gbits`: Gb = 10^9 bits); `--out_json` writes the
//! same rows as JSON (to `--out_json_file`, default `perftest_out.json` as
//! perftest's; the schema is ours: an object whose `results` list has a row
//! per size).
//!
//! The two data paths:
//! * **safe**: `Qp::post_send_list` with `SharedMr` sources (WRITE/SEND), owned
//!   `Mr` destinations (READ, atomic results, receives), `Cq::poll` into a
//!   preallocated vector; buffers come back with their completions.
//! * **raw**: `unsafe Qp::post_send_raw` of a prepared C `ibv_send_wr` list into
//!   registered memory, and `Cq::poll_raw`.
//!
//! `--scoped` runs the bandwidth tests in a `Cq::scope`; `--async N` (feature
//! `tokio`) runs the client of write_bw and send_bw through
//! `rdma_verbs::tokio::AsyncQp`, N awaited requests in flight.
//!
//! Differences from perftest, all outside the timed loops: the safe path asks
//! for one more send queue slot than `-t` (the slot ring signals when its last
//! slot is taken; the loop still keeps at most `-t` requests in flight);
//! safe-path READ and atomic destinations are `-t` pieces of a pool per QP,
//! recycled from completions (unsignaled ones through
//! `Cq::poll_recycling`); inline data is off unless `-I` is given, and on
//! with it (perftest turns `-I` off on devices it does not recognise, soft-RoCE
//! among them); READ and atomic tests refuse `-I` (as perftest); `-o` sets both `max_rd_atomic` and `max_dest_rd_atomic` from
//! this side's value (perftest takes the initiator's from the peer; both sides
//! must be started with the same flags here anyway).

#[cfg(feature = "tokio")]
#[path = "perf/async_tx.rs"]
mod async_tx;
#[path = "perf/bw.rs"]
mod bw;
#[path = "perf/clock.rs"]
mod clock;
#[path = "perf/conn.rs"]
mod conn;
#[path = "perf/lat.rs"]
mod lat;
#[path = "perf/opts.rs"]
mod opts;
#[path = "perf/report.rs"]
mod report;

use std::process::ExitCode;
use std::time::Duration;

use rdma_verbs::prelude::*;

use crate::opts::Opts;

/// Memory every test registers up front, for the largest size; `main` keeps it
/// until after the QPs are destroyed, so raw-path requests can never outlive it.
pub struct Bufs {
    /// What the peer WRITEs into and READs from: one `BUFF_SIZE` stretch per
    /// QP. Peers write it at any time: read only with copies (`read_at`).
    pub target: Mr,
    /// Raw-path local memory: per QP, a source / READ destination stretch and
    /// a receive stretch, `BUFF_SIZE` each (perftest's `ctx->buf`).
    pub local: Mr,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match opts::parse(&args) {
        Ok(Some(o)) => o,
        Ok(None) => return ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("perf: {msg}\n{}", opts::usage());
            return ExitCode::from(2);
        }
    };
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!(
                "perf {} ({}): error: {e}",
                o.test.name(),
                if o.is_server() { "server" } else { "client" }
            );
            ExitCode::FAILURE
        }
    }
}

fn run(o: &Opts) -> Result<()> {
    let rate = clock::Rate::calibrate(Duration::from_millis(100));
    let dev = conn::Device::open(o)?;
    let nq = o.num_qps as usize;
    let buff = conn::buff_size(o.max_size());
    let mut remote_access =
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    if o.test.verb() == opts::Verb::Atomic {
        remote_access |= AccessFlags::REMOTE_ATOMIC;
    }
    // Declared before the queues: dropped after them.
    let mut bufs = Bufs {
        target: dev.pd.alloc_mr(buff * nq, remote_access)?,
        local: dev.pd.alloc_mr(2 * buff * nq, AccessFlags::LOCAL_WRITE)?,
    };
    let regions: Vec<RemoteMr> = (0..nq)
        .map(|qi| RemoteMr {
            addr: bufs.target.addr() + (qi * buff) as u64,
            len: buff as u64,
            rkey: bufs.target.rkey(),
        })
        .collect();
    // `--async`'s client makes and drops its own queues (on async CQs).
    #[cfg(feature = "tokio")]
    if let (Some(n), false) = (o.inflight, o.is_server()) {
        report::banner(o, &dev, &rate, None);
        let table = async_tx::run(o, &rate, &dev, &regions, n)?;
        return write_json(o, &dev, &rate, &table);
    }
    let pending = conn::create(o, &dev)?;
    let (mut queues, remote, mut ctrl) = conn::establish(o, &dev, pending, &regions)?;
    report::banner(o, &dev, &rate, queues.qps.first().map(|q| q.send_api()));
    let table = if o.test.is_bw() {
        bw::run(o, &rate, &dev, &mut queues, &remote, &bufs, &mut ctrl)?
    } else {
        lat::run(o, &rate, &dev, &mut queues, &remote, &mut bufs, &mut ctrl)?
    };
    write_json(o, &dev, &rate, &table)?;
    // The QPs go first (their requests may still point into `bufs`).
    drop(queues);
    drop(bufs);
    Ok(())
}

fn write_json(
    o: &Opts,
    dev: &conn::Device,
    rate: &clock::Rate,
    table: &report::Table,
) -> Result<()> {
    report::write_json(o, dev.ctx.name(), rate, table).map_err(|source| rdma_verbs::Error::Io {
        what: "writing the JSON results",
        source,
    })
}
