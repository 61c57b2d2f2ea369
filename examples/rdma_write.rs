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
use std::time::{Duration, Instant};

use rdma_verbs::{AccessFlags, Error, RecvWr, Result, SendWr, WcOpcode};

const WAIT: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    let args = app::Args::parse("rdma_write", 18516);
    app::exit_on_error("rdma_write", || run(&args))
}

fn run(args: &app::Args) -> Result<()> {
    let mut side = app::open(args, 4)?;
    let mut qp = app::qp(&side, 4)?;
    let mut out = Vec::with_capacity(4);
    if args.client.is_none() {
        // The target region: the peer may write it at any time, so it is read
        // with copies (read_at), never as a slice.
        let target = side.pd.alloc_mr(
            args.size,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        )?;
        qp.post_recv(RecvWr::empty(0))?;
        let (mut qp, _) = app::connect(args, &side, qp, &[target.remote()])?;
        let mut ack = Some(side.pd.alloc_mr(1, AccessFlags::empty())?);
        let mut data = vec![0u8; args.size];
        for i in 0..args.iters {
            out.clear();
            side.cq.poll_n(&mut out, 1, WAIT)?;
            let c = &out[0];
            c.result()?;
            if c.opcode != WcOpcode::RecvRdmaWithImm || c.imm_data != Some(i as u32) {
                return Err(Error::Protocol(format!(
                    "expected WRITE_WITH_IMM {i}, got {c:?}"
                )));
            }
            target.read_at(0, &mut data)?;
            if data != app::payload(args.size, i) {
                return Err(Error::Protocol(format!("write {i}: content mismatch")));
            }
            qp.post_recv(RecvWr::empty(i as u64 + 1))?;
            qp.post_send(SendWr::send(i as u64).sge(ack.take().expect("ack buffer")))?;
            out.clear();
            side.cq.poll_n(&mut out, 1, WAIT)?;
            out[0].result()?;
            ack = out[0].take_mr();
        }
        println!(
            "server: {} RDMA WRITEs of {} bytes received and verified",
            args.iters, args.size
        );
        return Ok(());
    }
    for i in 0..4 {
        qp.post_recv(RecvWr::new(
            i,
            side.pd.alloc_mr(1, AccessFlags::LOCAL_WRITE)?,
        ))?;
    }
    let (mut qp, remote) = app::connect(args, &side, qp, &[])?;
    let target = *remote
        .mrs
        .first()
        .ok_or_else(|| Error::Protocol("server sent no memory region".into()))?;
    let mut src = Some(side.pd.alloc_mr(args.size, AccessFlags::empty())?);
    let start = Instant::now();
    for i in 0..args.iters {
        let mut buf = src.take().expect("source buffer is back");
        buf.write_at(0, &app::payload(args.size, i))?;
        qp.post_send(SendWr::write(i as u64, target, 0).sge(buf).imm(i as u32))?;
        let mut acked = false;
        while !acked || src.is_none() {
            out.clear();
            side.cq.poll_n(&mut out, 1, WAIT)?;
            for mut c in out.drain(..) {
                c.result()?;
                match c.opcode {
                    WcOpcode::RdmaWrite => src = c.take_mr(),
                    WcOpcode::Recv => {
                        acked = true;
                        qp.post_recv(RecvWr::new(c.wr_id, c.take_mr().expect("ack buffer")))?;
                    }
                    other => return Err(Error::Protocol(format!("unexpected completion {other}"))),
                }
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "client: {} RDMA WRITEs of {} bytes acknowledged in {:.3} s ({:.2} MB/s)",
        args.iters,
        args.size,
        secs,
        (args.iters * args.size) as f64 / secs / 1e6
    );
    Ok(())
}
