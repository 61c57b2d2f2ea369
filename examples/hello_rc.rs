// The complete two-process RC program of the crate docs (shown there as is):
// the client SENDs "ping", the server receives it and RDMA WRITEs "hello" into
// the region the client advertised, then SENDs "done".
use rdma_verbs::exchange::{self, DEFAULT_PORT, ExchangeListener};
use rdma_verbs::prelude::*;
use std::process::ExitCode;
use std::time::Duration;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Display (and Debug, which repeats it) says what went wrong
            // and what to do.
            eprintln!("hello_rc: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> rdma_verbs::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let usage =
        format!("usage: hello_rc server | hello_rc client [HOST]  (TCP port {DEFAULT_PORT})");
    match args.get(1).map(String::as_str) {
        Some("server" | "client") => {}
        None | Some("-h" | "--help") => {
            println!("{usage}");
            return Ok(());
        }
        Some(other) => return Err(Error::Other(format!("unknown role `{other}`; {usage}"))),
    }
    let ctx = Context::open(None)?; // the first device, e.g. rxe0
    let pd = Pd::new(&ctx)?;
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        ..QpCaps::default()
    };
    // Room for both queues: a provider that cannot resize a CQ (siw) needs it up front.
    let mut cq = Cq::new(&ctx, caps.max_send_wr + caps.max_recv_wr)?;
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    let mut qp = Qp::new(&pd, &cq, &cq, caps)?.init(InitAttr::new(1, access))?;
    let timeout = Duration::from_secs(30);
    let t = Duration::from_secs(10);

    if args.get(1).map(String::as_str) == Some("server") {
        // Post the receive before connecting, so the client's SEND finds it.
        qp.post_recv(RecvWr::new(1, pd.alloc_mr(64, AccessFlags::LOCAL_WRITE)?))?;
        let listener = ExchangeListener::bind(DEFAULT_PORT)?;
        let (mut qp, client) = exchange::serve(&listener, qp, None, &[], Some(timeout))?;
        let mut c = cq.poll_one(t)?;
        c.result()?;
        let msg = c.take_mr().expect("the receive buffer").to_vec()?;
        println!(
            "got {:?}",
            String::from_utf8_lossy(&msg[..c.byte_len as usize])
        );
        // WRITE the reply into the region the client advertised.
        let mut reply = pd.alloc_mr(5, AccessFlags::empty())?;
        reply.write_at(0, b"hello")?;
        let target = client.mrs.first().copied().ok_or_else(|| {
            Error::Protocol("the client advertised no memory region to WRITE into".into())
        })?;
        qp.post_send(SendWr::write_from(2, reply, target, 0))?;
        cq.poll_one(t)?.result()?;
        // Tell the client the WRITE is done: a SEND it has a receive for.
        qp.post_send(SendWr::send(3))?;
        cq.poll_one(t)?.result()?;
    } else {
        let host = args.get(2).map(String::as_str).unwrap_or("127.0.0.1");
        let target = pd.alloc_mr(64, access)?; // the peer WRITEs here
        qp.post_recv(RecvWr::empty(10))?; // for the server's "done" SEND
        let (mut qp, _server) =
            exchange::connect_client(host, DEFAULT_PORT, qp, None, &[target.remote()], timeout)?;
        let mut msg = pd.alloc_mr(64, AccessFlags::empty())?;
        msg.write_at(0, b"ping")?;
        qp.post_send(SendWr::send_from(1, msg.range(..4)?))?; // its first 4 bytes
        // The SEND's completion and the server's "done" may come in any order.
        for _ in 0..2 {
            cq.poll_one(t)?.result()?;
        }
        println!(
            "reply: {:?}",
            String::from_utf8_lossy(&target.to_vec()?[..5])
        );
    }
    Ok(())
}
