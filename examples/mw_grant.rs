//! Granting a peer access to part of a region with a memory window, then
//! revoking it.
//!
//! ```text
//! mw_grant --server [--port 18530]
//! mw_grant --client HOST [--port 18530]
//! ```
//!
//! 1. The server registers an 8 KiB region with LOCAL_WRITE and MW_BIND only:
//!    no rkey of the region itself grants a peer anything. It binds a type 2
//!    window over bytes 1024..5120 with REMOTE_READ and REMOTE_WRITE (a
//!    BIND_MW work request on its connected QP) and sends the window's
//!    descriptor (address, length, the window's own rkey) over the exchange
//!    connection.
//! 2. The client READs the window and checks the server's pattern, then
//!    WRITEs 256 bytes into it, and tells the server (a barrier on the
//!    exchange connection).
//! 3. The server checks the written bytes in its region, revokes the window
//!    (a LOCAL_INV work request) and tells the client.
//! 4. The client READs again: the completion fails with `REM_ACCESS_ERR`
//!    ([`WcStatus::RemAccessErr`]), and the example says so. A failed request
//!    moves an RC QP to the error state, as the IB spec says: the client's QP
//!    is done after it (a program that goes on would connect a new QP).
//!
//! Both exit 0 only when every step behaved as stated; anything else (a
//! mismatch, a READ that succeeds through the revoked window, a completion
//! with another status, the peer gone) exits 1 with a message.
//!
//! On soft-RoCE (rxe), an access through a window is checked against the
//! bound region's range rather than the window's, so a peer holding the
//! window's rkey could reach the whole region (docs/soundness.md, "Memory
//! windows"): grant windows over regions that hold only what the peer may
//! see.

// The shared options, set-up and exchange; its memory check is for the examples
// that size their buffers from the command line.
#[allow(dead_code)]
#[path = "shared/app.rs"]
mod app;

use std::io::{Read, Write};
use std::process::ExitCode;

use rdma_verbs::exchange::{ExchangeStream, WireMessage};
use rdma_verbs::prelude::*;

/// The region's size.
const REGION: usize = 8192;
/// The window: bytes 1024..5120 of the region.
const WINDOW: std::ops::Range<usize> = 1024..5120;
/// Where in the window the client writes, and how much.
const WRITE_AT: usize = 512;
const WRITE_LEN: usize = 256;

/// The window's descriptor on the exchange connection: `"wnd1"`, then
/// address, length and rkey as little-endian integers (24 bytes).
struct Grant(RemoteMr);

impl WireMessage for Grant {
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()> {
        let mut msg = [0u8; 24];
        msg[..4].copy_from_slice(b"wnd1");
        msg[4..12].copy_from_slice(&self.0.addr.to_le_bytes());
        msg[12..20].copy_from_slice(&self.0.len.to_le_bytes());
        msg[20..].copy_from_slice(&self.0.rkey.to_le_bytes());
        w.write_all(&msg)
            .and_then(|()| w.flush())
            .map_err(|source| Error::Io {
                what: "sending the window's descriptor",
                source,
            })
    }

    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<Grant> {
        let mut msg = [0u8; 24];
        r.read_exact(&mut msg).map_err(|source| Error::Io {
            what: "receiving the window's descriptor",
            source,
        })?;
        if &msg[..4] != b"wnd1" {
            return Err(Error::Protocol(format!(
                "expected a window descriptor, got {}",
                msg.escape_ascii()
            )));
        }
        let field = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&msg[r]);
            u64::from_le_bytes(b)
        };
        Ok(Grant(RemoteMr {
            addr: field(4..12),
            len: field(12..20),
            rkey: field(20..24) as u32,
        }))
    }
}

fn main() -> ExitCode {
    let args = app::Args::parse("mw_grant", 18530);
    app::exit_on_error("mw_grant", || {
        if args.client.is_some() {
            client(&args)
        } else {
            server(&args)
        }
    })
}

/// The kept exchange connection.
fn peer(side: &mut app::Side) -> &mut ExchangeStream {
    side.peer
        .as_mut()
        .expect("connect keeps the exchange stream")
}

/// The next completion, which must be `wr_id`'s with `opcode` and success.
fn expect_ok(
    side: &mut app::Side,
    what: &'static str,
    wr_id: u64,
    opcode: WcOpcode,
) -> Result<Completion> {
    let c = side.poll(what)?;
    c.result()?;
    if (c.wr_id, c.opcode) != (wr_id, opcode) {
        return Err(Error::Protocol(format!(
            "{what}: unexpected completion {c:?}"
        )));
    }
    Ok(c)
}

fn server(args: &app::Args) -> Result<()> {
    let mut side = app::open(args, 4)?;
    let pattern = app::Pattern::new(REGION);
    let mut region = Mr::new(
        &side.pd,
        REGION,
        AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
    )?;
    region.write_at(0, pattern.message(0))?;
    let mut mw = Mw::new(&side.pd, MwType::Type2)?;
    let qp = app::qp(&side)?;
    // A type 2 window is bound by a work request, so on a connected QP.
    let (mut qp, _) = app::connect(args, &mut side, qp, &[])?;
    let rights = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    let grant = qp.post_bind_mw(1, &mut mw, &region, WINDOW, rights)?;
    expect_ok(&mut side, "the window's bind", 1, WcOpcode::BindMw)?;
    println!(
        "server: window rkey {:#x} bound over bytes {WINDOW:?} of a region with no remote rights",
        grant.rkey
    );
    peer(&mut side).send(&Grant(grant))?;
    // The client has READ and WRITTEN through the window.
    peer(&mut side).barrier()?;
    let mut got = [0u8; WRITE_LEN];
    region.read_at(WINDOW.start + WRITE_AT, &mut got)?;
    if got[..] != pattern.message(1)[..WRITE_LEN] {
        return Err(Error::Other(
            "the client's WRITE through the window did not arrive in the region".into(),
        ));
    }
    println!("server: the client's {WRITE_LEN}-byte WRITE through the window arrived");
    qp.post_local_inv(2, &mut mw)?;
    expect_ok(
        &mut side,
        "the window's invalidation",
        2,
        WcOpcode::LocalInv,
    )?;
    println!("server: window revoked (LOCAL_INV completed)");
    // The window is revoked: the client may try again.
    peer(&mut side).barrier()?;
    side.finish()?;
    println!("server: every step behaved as stated");
    Ok(())
}

fn client(args: &app::Args) -> Result<()> {
    let mut side = app::open(args, 4)?;
    let qp = app::qp(&side)?;
    let (mut qp, _) = app::connect(args, &mut side, qp, &[])?;
    let Grant(window) = peer(&mut side).recv()?;
    println!(
        "client: granted {} bytes, rkey {:#x}",
        window.len, window.rkey
    );
    let pattern = app::Pattern::new(REGION);
    let len = usize::try_from(window.len).expect("a window of this example");
    let dst = Mr::new(&side.pd, len, AccessFlags::LOCAL_WRITE)?;
    qp.post_send(SendWr::read(1, dst, window, 0))?;
    let mut c = expect_ok(
        &mut side,
        "the READ through the window",
        1,
        WcOpcode::RdmaRead,
    )?;
    let dst = c
        .take_mr()
        .expect("a READ's completion gives its buffer back");
    if dst.to_vec()? != pattern.message(0)[WINDOW] {
        return Err(Error::Other(
            "the READ through the window returned other bytes than the server's".into(),
        ));
    }
    println!("client: READ {len} bytes through the window, verified");
    let mut src = Mr::new(&side.pd, WRITE_LEN, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, &pattern.message(1)[..WRITE_LEN])?;
    qp.post_send(SendWr::write_from(2, src, window, WRITE_AT as u64))?;
    expect_ok(
        &mut side,
        "the WRITE through the window",
        2,
        WcOpcode::RdmaWrite,
    )?;
    println!("client: WROTE {WRITE_LEN} bytes through the window");
    peer(&mut side).barrier()?;
    // The server has revoked the window.
    peer(&mut side).barrier()?;
    qp.post_send(SendWr::read(3, dst, window, 0))?;
    let c = side.poll("the READ through the revoked window")?;
    match (c.wr_id, c.status) {
        (3, WcStatus::RemAccessErr) => println!(
            "client: READ through the revoked window failed with {} (WcStatus::{:?}), as \
             expected; the QP is in the error state now",
            c.status, c.status
        ),
        (3, WcStatus::Success) => {
            return Err(Error::Other(
                "a READ through the revoked window succeeded".into(),
            ));
        }
        _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
    }
    side.finish()?;
    println!("client: every step behaved as stated");
    Ok(())
}
