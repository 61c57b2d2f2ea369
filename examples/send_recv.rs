//! RC SEND/RECV between two processes: the client sends `--iters` messages of
//! `--size` bytes, the server checks each and echoes it back, the client
//! checks the echo. Exits non-zero on any mismatch.
//!
//! ```text
//! send_recv --server [--port 18515]
//! send_recv --client 10.99.0.1 [--size 4096] [--iters 10]
//! ```

#[path = "shared/app.rs"]
mod app;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use rdma_verbs::{AccessFlags, Error, RecvWr, Result, SendWr, WcOpcode};

const WAIT: Duration = Duration::from_secs(30);

fn main() -> ExitCode {
    let args = app::Args::parse("send_recv", 18515);
    app::exit_on_error("send_recv", || run(&args))
}

fn run(args: &app::Args) -> Result<()> {
    let mut side = app::open(args, 4)?;
    let mut qp = app::qp(&side, 4)?;
    // Receive buffer posted before connecting, so the first message finds it.
    qp.post_recv(RecvWr::new(
        0,
        side.pd.alloc_mr(args.size, AccessFlags::LOCAL_WRITE)?,
    ))?;
    let (mut qp, _) = app::connect(args, &side, qp, &[])?;
    let mut out = Vec::with_capacity(4);
    let mut send_buf = Some(side.pd.alloc_mr(args.size, AccessFlags::empty())?);
    let start = Instant::now();
    for i in 0..args.iters {
        let expected = app::payload(args.size, i);
        if args.client.is_some() {
            let mut buf = send_buf.take().expect("send buffer is back");
            buf.write_at(0, &expected)?;
            qp.post_send(SendWr::send(i as u64).sge(buf))?;
        }
        // Wait for our send (client) and the peer's message.
        let mut got_recv = None;
        while got_recv.is_none() || send_buf.is_none() {
            out.clear();
            side.cq.poll_n(&mut out, 1, WAIT)?;
            for mut c in out.drain(..) {
                c.result()?;
                match c.opcode {
                    WcOpcode::Recv => {
                        got_recv = Some((c.byte_len as usize, c.take_mr().expect("receive buffer")))
                    }
                    _ => send_buf = c.take_mr(),
                }
            }
            if args.client.is_none() && got_recv.is_some() {
                break;
            }
        }
        let (len, buf) = got_recv.expect("received");
        let data = buf.to_vec()?;
        if len != args.size || data[..len] != expected[..] {
            return Err(Error::Protocol(format!(
                "message {i}: {len} bytes, content mismatch"
            )));
        }
        // Re-arm the receive for the next message before answering.
        qp.post_recv(RecvWr::new(i as u64 + 1, buf))?;
        if args.client.is_none() {
            let mut echo = send_buf.take().expect("send buffer is back");
            echo.write_at(0, &data)?;
            qp.post_send(SendWr::send(i as u64).sge(echo))?;
            out.clear();
            side.cq.poll_n(&mut out, 1, WAIT)?;
            out[0].result()?;
            send_buf = out[0].take_mr();
        }
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{}: {} messages of {} bytes sent and verified in {:.3} s ({:.1} us per round trip)",
        args.role(),
        args.iters,
        args.size,
        secs,
        secs * 1e6 / args.iters as f64
    );
    Ok(())
}
