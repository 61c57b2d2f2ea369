//! RDMA WRITE between two processes: the client writes `--size` bytes into the
//! server's registered memory and signals each write with WRITE_WITH_IMM; the
//! server verifies the bytes and acknowledges with a SEND. Exits non-zero on
//! any mismatch.
//!
//! ```text
//! rdma_write --server [--port 18516]
//! rdma_write --client 10.99.0.1 [--size 65536] [--iters 10]
//! ```

#[path = "shared/app.rs"]
mod app;

use std::process::ExitCode;
use std::time::Instant;

use rdma_verbs::prelude::*;

fn main() -> ExitCode {
    let args = app::Args::parse("rdma_write", 18516);
    app::exit_on_error("rdma_write", || run(&args))
}

fn run(args: &app::Args) -> Result<()> {
    // The registered buffers and the expected-message pattern: refused up front when
    // they cannot fit, rather than OOM-killed while pinning.
    app::check_memory(args.size.saturating_mul(3))?;
    let mut side = app::open(args, 1)?;
    let qp = app::qp(&side)?;
    let pattern = app::Pattern::new(args.size);
    if args.client.is_none() {
        serve(args, &mut side, qp, &pattern)
    } else {
        write_all(args, &mut side, qp, &pattern)
    }
}

/// The server: offers its target region, checks each WRITE_WITH_IMM's data
/// and acknowledges it with an empty SEND.
fn serve(
    args: &app::Args,
    side: &mut app::Side,
    mut qp: Qp<Rc, Init>,
    pattern: &app::Pattern,
) -> Result<()> {
    // The target region: the peer may write it at any time, so it is read
    // with copies (read_at), never as a slice.
    let target = side.pd.alloc_mr(
        args.size,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
    )?;
    qp.post_recv(RecvWr::empty(0))?;
    let (mut qp, _) = app::connect(args, side, qp, &[target.remote()])?;
    let mut data = vec![0u8; args.size];
    // The acknowledgements are empty SENDs; one is in flight at most.
    let mut ack_in_flight = false;
    for i in 0..args.iters {
        // The client's WRITE_WITH_IMM, and the completion of our last ack,
        // in either order.
        let mut write = None;
        while write.is_none() || ack_in_flight {
            let c = side.poll("the client's next WRITE")?;
            c.result()?;
            match c.opcode {
                WcOpcode::Send if ack_in_flight => ack_in_flight = false,
                WcOpcode::RecvRdmaWithImm if write.is_none() => write = Some(c),
                _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
            }
        }
        if let Some(c) = write.filter(|c| c.imm_data != Some(i as u32)) {
            return Err(Error::Protocol(format!(
                "expected WRITE_WITH_IMM {i}, got {c:?}"
            )));
        }
        target.read_at(0, &mut data)?;
        if data != pattern.message(i) {
            return Err(Error::Protocol(format!("write {i}: content mismatch")));
        }
        qp.post_recv(RecvWr::empty(i as u64 + 1))?;
        qp.post_send(SendWr::send(i as u64))?;
        ack_in_flight = true;
    }
    // The last ack completes too before the QP goes away.
    let c = side.poll("the last acknowledgement's completion")?;
    c.result()?;
    if c.opcode != WcOpcode::Send {
        return Err(Error::Protocol(format!("unexpected completion {c:?}")));
    }
    // Both sides have all their completions before either QP goes away.
    side.finish()?;
    println!(
        "server: {} RDMA WRITEs of {} bytes received and verified",
        args.iters, args.size
    );
    Ok(())
}

/// The client: WRITEs each message into the server's region and waits for
/// its acknowledgement.
fn write_all(
    args: &app::Args,
    side: &mut app::Side,
    mut qp: Qp<Rc, Init>,
    pattern: &app::Pattern,
) -> Result<()> {
    qp.post_recv(RecvWr::empty(0))?;
    let (mut qp, remote) = app::connect(args, side, qp, &[])?;
    let target = *remote
        .mrs
        .first()
        .ok_or_else(|| Error::Protocol("server sent no memory region".into()))?;
    let mut src = Some(side.pd.alloc_mr(args.size, AccessFlags::empty())?);
    let start = Instant::now();
    for i in 0..args.iters {
        let mut buf = src.take().expect("source buffer is back");
        buf.write_at(0, pattern.message(i))?;
        qp.post_send(SendWr::write(i as u64, target, 0).sge(buf).imm(i as u32))?;
        // The WRITE's completion (its buffer comes back) and the server's ack,
        // in either order.
        let mut acked = false;
        while !acked || src.is_none() {
            let mut c = side.poll("the WRITE's completion and the server's acknowledgement")?;
            c.result()?;
            match c.opcode {
                WcOpcode::RdmaWrite if src.is_none() => src = c.take_mr(),
                WcOpcode::Recv if !acked => {
                    acked = true;
                    qp.post_recv(RecvWr::empty(i as u64 + 1))?;
                }
                _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    // Both sides have all their completions before either QP goes away.
    side.finish()?;
    println!(
        "client: {} RDMA WRITEs of {} bytes acknowledged in {:.3} s ({:.2} MB/s)",
        args.iters,
        args.size,
        secs,
        (args.iters * args.size) as f64 / secs / 1e6
    );
    Ok(())
}
