//! `xtask fake-peer`: an exchange server that misbehaves, for the fault matrix.

use std::ffi::OsString;
use std::thread;
use std::time::{Duration, Instant};

use super::POLL;
use crate::{Error, Result};

/// `xtask fake-peer MODE PORT`: an exchange server that misbehaves, for the fault matrix.
/// It accepts one client on TCP `PORT` and then, by MODE: `garbage` answers with bytes that
/// are no message; `truncate` answers with the first 10 bytes of one and closes; `stall`
/// never answers; `reset` closes with the client's message unread, which makes the kernel
/// send a reset. It gives up after 60 s.
pub fn fake_peer_command(args: Vec<OsString>) -> Result<u8> {
    use std::io::{Read, Write};
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let (Some(mode), Some(port)) = (
        args.first(),
        args.get(1).and_then(|p| p.parse::<u16>().ok()),
    ) else {
        return Err(Error::usage("fake-peer MODE PORT"));
    };
    let io = |e: std::io::Error| Error::new(format!("fake-peer: {e}"));
    let listener = std::net::TcpListener::bind(("0.0.0.0", port)).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    let limit = Instant::now() + Duration::from_secs(60);
    let mut stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < limit => {
                thread::sleep(POLL)
            }
            Err(e) => return Err(io(e)),
        }
    };
    stream.set_nonblocking(false).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(io)?;
    // Let the client's first message arrive.
    thread::sleep(Duration::from_millis(300));
    match mode.as_str() {
        "garbage" => {
            stream.write_all(&[0xa5; 200]).map_err(io)?;
        }
        "truncate" => {
            let mut first = [0u8; 256];
            let n = stream.read(&mut first).map_err(io)?;
            // Echo back the start of the client's own message, then close.
            stream.write_all(&first[..n.min(10)]).map_err(io)?;
            println!("fake-peer: sent 10 bytes and closed");
            return Ok(0);
        }
        "reset" => {
            println!("fake-peer: closing with unread data (reset)");
            return Ok(0);
        }
        "stall" => {}
        _ => return Err(Error::usage(format!("fake-peer: unknown mode {mode}"))),
    }
    // Hold the connection until the client gives up.
    let mut sink = [0u8; 4096];
    while Instant::now() < limit {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    println!("fake-peer: the client closed the connection");
    Ok(0)
}
