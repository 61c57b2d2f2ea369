//! RC SEND/RECV between two processes: the client sends `--iters` messages of
//! `--size` bytes, the server checks each and echoes it back, the client
//! checks the echo. Exits non-zero on any mismatch.
//!
//! ```text
//! send_recv --server [--port 18515]
//! send_recv --client 10.99.0.1 [--size 4096] [--iters 10]
//! ```
//!
//! `--seed N` (both sides the same) varies the messages' bytes, so streams between different
//! pairs of nodes carry different content.
//!
//! `--stall-recv-at N --stall-ms M` (server): after echoing message N the server posts its
//! next receive only M ms later, so the client's next SEND meets an empty receive queue and
//! is answered with RNR NAKs; with `--rnr-retry 0` the client's SEND fails with
//! RNR_RETRY_EXC_ERR, with `--rnr-retry 7` it is retried until the receive is there (the
//! fault matrix's RNR rows).

#[path = "shared/app.rs"]
mod app;

use std::process::ExitCode;
use std::time::Instant;

use rdma_verbs::prelude::*;

fn main() -> ExitCode {
    let args = app::Args::parse("send_recv", 18515);
    app::exit_on_error("send_recv", || run(&args))
}

/// The buffers that completions hand back.
struct Bufs {
    /// The send buffer, when no SEND is in flight.
    send: Option<Mr>,
    /// A message received and not handled yet, with its length.
    received: Option<(usize, Mr)>,
}

impl Bufs {
    /// Polls one completion and files the buffer it hands back. One SEND and
    /// one receive are in flight at most, so each slot is empty when it fills.
    fn poll(&mut self, side: &mut app::Side) -> Result<()> {
        let mut c = side.poll("the peer's next message or our SEND's completion")?;
        c.result()?;
        match (c.opcode, c.take_mr()) {
            (WcOpcode::Send, Some(buf)) if self.send.is_none() => self.send = Some(buf),
            (WcOpcode::Recv, Some(buf)) if self.received.is_none() => {
                self.received = Some((c.byte_len as usize, buf))
            }
            _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
        }
        Ok(())
    }

    /// Sends `msg` once the previous SEND has completed.
    fn send(
        &mut self,
        side: &mut app::Side,
        qp: &mut Qp<Rc, Rts>,
        id: usize,
        msg: &[u8],
    ) -> Result<()> {
        while self.send.is_none() {
            self.poll(side)?;
        }
        let mut buf = self.send.take().expect("send buffer is back");
        buf.write_at(0, msg)?;
        Ok(qp.post_send(SendWr::send(id as u64).sge(buf))?)
    }

    /// Waits for the next message.
    fn recv(&mut self, side: &mut app::Side) -> Result<(usize, Mr)> {
        loop {
            if let Some(got) = self.received.take() {
                return Ok(got);
            }
            self.poll(side)?;
        }
    }
}

fn run(args: &app::Args) -> Result<()> {
    // The registered buffers and the expected-message pattern: refused up front when
    // they cannot fit, rather than OOM-killed while pinning.
    app::check_memory(args.size.saturating_mul(3))?;
    let mut side = app::open(args, 1)?;
    let mut qp = app::qp(&side)?;
    // Receive buffer posted before connecting, so the first message finds it.
    qp.post_recv(RecvWr::new(
        0,
        side.pd.alloc_mr(args.size, AccessFlags::LOCAL_WRITE)?,
    ))?;
    let (mut qp, _) = app::connect(args, &mut side, qp, &[])?;
    let pattern = app::Pattern::seeded(args.size, args.seed);
    let mut bufs = Bufs {
        send: Some(side.pd.alloc_mr(args.size, AccessFlags::empty())?),
        received: None,
    };
    let client = args.client.is_some();
    let start = Instant::now();
    for i in 0..args.iters {
        let expected = pattern.message(i);
        if client {
            bufs.send(&mut side, &mut qp, i, expected)?;
        }
        // The peer's message (the client's, or the server's echo of it).
        let (len, buf) = bufs.recv(&mut side)?;
        if len != args.size || buf.as_slice()? != expected {
            return Err(Error::Protocol(format!(
                "message {i}: {len} bytes, content mismatch"
            )));
        }
        match args.stall {
            Some((at, pause)) if at == i => {
                // Answer first, then leave the receive queue empty for `pause`.
                bufs.send(&mut side, &mut qp, i, expected)?;
                println!(
                    "server: receives paused after message {i} for {} ms",
                    pause.as_millis()
                );
                std::thread::sleep(pause);
                qp.post_recv(RecvWr::new(i as u64 + 1, buf))?;
                println!("server: receives posted again");
            }
            _ => {
                // Re-arm the receive for the next message before answering.
                qp.post_recv(RecvWr::new(i as u64 + 1, buf))?;
                if !client {
                    bufs.send(&mut side, &mut qp, i, expected)?;
                }
            }
        }
    }
    // The last SEND completes too before the QP goes away.
    while bufs.send.is_none() {
        bufs.poll(&mut side)?;
    }
    // Both sides have all their completions before either QP goes away.
    side.finish()?;
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
