//! RDMA READ between two processes: the server exposes `--size` bytes of
//! known content; the client READs them `--iters` times and verifies each;
//! then both meet at a barrier on the exchange connection (the server learns
//! the client is done). Exits non-zero on any mismatch.
//!
//! ```text
//! rdma_read --server [--port 18517]
//! rdma_read --client 10.99.0.1 [--size 65536] [--iters 10]
//! ```

#[path = "shared/app.rs"]
mod app;

use std::process::ExitCode;
use std::time::Instant;

use rdma_verbs::prelude::*;

fn main() -> ExitCode {
    let args = app::Args::parse("rdma_read", 18517);
    app::exit_on_error("rdma_read", || run(&args))
}

fn run(args: &app::Args) -> Result<()> {
    // The registered buffers and the expected-message pattern: refused up front when
    // they cannot fit, rather than OOM-killed while pinning.
    app::check_memory(args.size.saturating_mul(2))?;
    let mut side = app::open(args, 1)?;
    let qp = app::qp(&side)?;
    let expected = app::Pattern::new(args.size);
    let expected = expected.message(0);
    if args.client.is_none() {
        let mut source = side.pd.alloc_mr(args.size, AccessFlags::REMOTE_READ)?;
        source.as_mut_slice()?.copy_from_slice(expected);
        // Read-only for peers, so local reads as a slice stay allowed.
        let source = source.freeze();
        let (_qp, _) = app::connect(args, &mut side, qp, &[source.remote()])?;
        // The READs complete on the client only: its barrier says it is done.
        side.finish()?;
        println!("server: client finished reading {} bytes", args.size);
        return Ok(());
    }
    let (mut qp, remote) = app::connect(args, &mut side, qp, &[])?;
    let source = *remote
        .mrs
        .first()
        .ok_or_else(|| Error::Protocol("server sent no memory region".into()))?;
    let mut dest = side.pd.alloc_mr(args.size, AccessFlags::LOCAL_WRITE)?;
    let start = Instant::now();
    for i in 0..args.iters {
        dest.fill(0)?;
        qp.post_send(SendWr::read(i as u64, dest, source, 0))?;
        // One request in flight, no receives posted: this is the READ's.
        let mut c = side.poll("the READ's completion")?;
        c.result()?;
        dest = match (c.opcode, c.take_mr()) {
            (WcOpcode::RdmaRead, Some(buf)) => buf,
            _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
        };
        if dest.as_slice()? != expected {
            return Err(Error::Protocol(format!("read {i}: content mismatch")));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // Both sides have all their completions before either QP goes away.
    side.finish()?;
    println!(
        "client: {} RDMA READs of {} bytes verified in {:.3} s ({:.2} MB/s)",
        args.iters,
        args.size,
        secs,
        (args.iters * args.size) as f64 / secs / 1e6
    );
    Ok(())
}
