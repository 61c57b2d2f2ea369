//! UD SEND/RECV between two processes, verified: the client sends `--iters` datagrams of
//! `--size` bytes (at most the port's active MTU), one at a time; the server checks the
//! length and every byte of each and echoes it back; the client checks the echo. Exits
//! non-zero on any mismatch, on a datagram from an unexpected QP, or when one does not
//! come within 30 s (UD never retransmits: a lost datagram is reported, never skipped).
//!
//! ```text
//! ud_send --server [--port 18516] [--seed N]
//! ud_send --client 10.99.0.1 [--size 256] [--iters 10] [--seed N]
//! ```
//!
//! The endpoints (QPN, GID) travel over the crate's TCP exchange, whose connection stays
//! open: a peer that dies is reported at once ([`Error::PeerClosed`]). `--seed` varies the
//! bytes as in send_recv.

// The RC helpers (QP, connect) of the shared code go unused here.
#[allow(dead_code)]
#[path = "shared/app.rs"]
mod app;

use std::process::ExitCode;
use std::time::Duration;

use rdma_verbs::ah::GRH_LEN;
use rdma_verbs::exchange::{ExchangeListener, ExchangeStream};
use rdma_verbs::prelude::*;

/// The Q_Key of both sides.
const QKEY: u32 = 0x5544_0001;

fn main() -> ExitCode {
    let mut args = app::Args::parse("ud_send", 18516);
    if !std::env::args().any(|a| a == "--size") {
        args.size = 256;
    }
    app::exit_on_error("ud_send", || run(&args))
}

/// The UD QP, the peer's address and the send buffer (when no send is in flight).
struct Link {
    qp: Qp<Ud, Rts>,
    ah: AddressHandle,
    remote_qpn: u32,
    send: Option<Mr>,
    /// A datagram's completion that came while this side waited for its send's.
    early: Option<Completion>,
}

/// Posts a receive of one datagram (a GRH buffer and `len` payload bytes).
fn post_recv(qp: &mut Qp<Ud, Rts>, pd: &Pd, wr_id: u64, len: usize) -> Result<()> {
    let mut all = pd.alloc_mr(GRH_LEN + len, AccessFlags::LOCAL_WRITE)?;
    let grh = all.split_to(GRH_LEN)?;
    Ok(qp.post_recv(UdRecvWr::new(wr_id, grh, all))?)
}

impl Link {
    /// Sends `msg` and waits for the send's completion (its buffer comes back with it).
    fn send(&mut self, side: &mut app::Side, id: u64, msg: &[u8]) -> Result<()> {
        let mut buf = self.send.take().expect("the send buffer is back");
        buf.write_at(0, msg)?;
        let wr = UdSendWr::send_from(id, buf, &self.ah, self.remote_qpn, QKEY);
        self.qp.post_send(wr)?;
        loop {
            let mut c = side.poll("our datagram's send completion")?;
            c.result()?;
            // The peer's answer may complete before our send does (seen on rxe).
            if c.opcode == WcOpcode::Recv && self.early.is_none() {
                self.early = Some(c);
                continue;
            }
            match (c.opcode, c.take_mr()) {
                (WcOpcode::Send, Some(buf)) => {
                    self.send = Some(buf);
                    return Ok(());
                }
                _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
            }
        }
    }

    /// Waits for the next datagram and checks that it is `expected`, from the peer's QP.
    fn expect(&mut self, side: &mut app::Side, i: usize, expected: &[u8]) -> Result<()> {
        let mut c = match self.early.take() {
            Some(c) => c,
            None => side.poll("the peer's next datagram")?,
        };
        c.result()?;
        if c.opcode != WcOpcode::Recv {
            return Err(Error::Protocol(format!("unexpected completion {c:?}")));
        }
        let msg = c.take_ud()?;
        if msg.src_qp != self.remote_qpn {
            return Err(Error::Protocol(format!(
                "datagram {i} from QPN {:#x}, expected the peer's {:#x}",
                msg.src_qp, self.remote_qpn
            )));
        }
        let payload = msg
            .payload
            .ok_or_else(|| Error::Protocol("a receive without its payload buffer".into()))?;
        if msg.len as usize != expected.len() || payload.as_slice()? != expected {
            return Err(Error::Protocol(format!(
                "datagram {i}: {} bytes, content mismatch",
                msg.len
            )));
        }
        Ok(())
    }
}

/// The UD QP in RTS, with the peer's address from the TCP exchange (kept open in
/// `side.peer`), and one receive posted before the peer may send.
fn connect(args: &app::Args, side: &mut app::Side) -> Result<Link> {
    let caps = QpCaps {
        max_send_wr: 2,
        max_recv_wr: 2,
        ..QpCaps::default()
    };
    let mut qp = Qp::new_ud(&side.pd, &side.cq, &side.cq, caps)?
        .init(UdInitAttr::new(1, QKEY))?
        .ready()?;
    let mtu = qp.max_message() as usize;
    if args.size > mtu {
        return Err(Error::InvalidArgument {
            what: "--size",
            reason: format!("a datagram holds at most the port's active MTU, {mtu} bytes"),
        });
    }
    post_recv(&mut qp, &side.pd, 0, args.size)?;
    let local = qp.endpoint(Some(side.gid_index))?;
    let timeout = Duration::from_secs(30);
    let (mut stream, remote) = match &args.client {
        Some(host) => {
            let mut s = ExchangeStream::connect(host, args.port, timeout)?;
            s.send(&local)?;
            let remote: Endpoint = s.recv()?;
            (s, remote)
        }
        None => {
            let listener = ExchangeListener::bind(args.port)?;
            let mut s = listener.accept(Some(timeout))?;
            let remote: Endpoint = s.recv()?;
            s.send(&local)?;
            (s, remote)
        }
    };
    // Both sides' first receives are posted before either sends.
    stream.barrier()?;
    let ah = AddressHandle::new(&side.pd, qp.address_vector(&remote, Some(side.gid_index))?)?;
    side.peer = Some(stream);
    Ok(Link {
        qp,
        ah,
        remote_qpn: remote.qpn,
        send: Some(side.pd.alloc_mr(args.size, AccessFlags::empty())?),
        early: None,
    })
}

fn run(args: &app::Args) -> Result<()> {
    app::check_memory(args.size.saturating_mul(4))?;
    let mut side = app::open(args, 2)?;
    let mut link = connect(args, &mut side)?;
    let pattern = app::Pattern::seeded(args.size, args.seed);
    let client = args.client.is_some();
    let start = std::time::Instant::now();
    for i in 0..args.iters {
        let expected = pattern.message(i);
        if client {
            link.send(&mut side, i as u64, expected)?;
        }
        // The peer's datagram (the client's, or the server's echo of it); the next
        // receive is posted before this side answers, so the peer's next one finds it.
        link.expect(&mut side, i, expected)?;
        post_recv(&mut link.qp, &side.pd, i as u64 + 1, args.size)?;
        if !client {
            link.send(&mut side, i as u64, expected)?;
        }
    }
    side.finish()?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "{}: {} datagrams of {} bytes sent and verified in {:.3} s",
        args.role(),
        args.iters,
        args.size,
        secs
    );
    Ok(())
}
