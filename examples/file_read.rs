//! A zero-copy file server: the server registers a memory-mapped file for
//! remote READ and nothing else; the client READs the whole file into one
//! registered buffer, chunk by chunk, and writes it out.
//!
//! ```text
//! file_read --server FILE [--port 18520]
//! file_read --client HOST --out PATH [--port 18520] [--chunk BYTES] [--hugepages]
//! ```
//!
//! * **The mapping.** The server maps FILE read-only and *private*
//!   (`MmapOptions::map_copy_read_only`) and registers it with REMOTE_READ
//!   only: the NIC reads the page cache's pages, no copy is made, and no peer
//!   can write them. A read-only *shared* mapping would be the obvious choice,
//!   but kernels before 6.2 pin every registration for writing, so it fails
//!   there with EFAULT even for REMOTE_READ; the private mapping registers on
//!   all kernels (docs/soundness.md, "Read-only memory"). The file must not be
//!   truncated while it is served: the NIC keeps reading the pinned pages,
//!   but the server's own reads past the new end raise SIGBUS.
//! * **The descriptor.** The region's address, length and rkey go through the
//!   crate's TCP exchange, followed by a small message of this example's own
//!   (a [`WireMessage`]): the file's length and checksum.
//! * **The copy.** The client registers a destination of the file's length
//!   (on 2 MiB huge pages with `--hugepages`; the error says how to reserve
//!   them when none are free), splits it into `--chunk`-byte pieces (1 MiB by
//!   default) and keeps up to 16 READs in flight. An RC send queue completes
//!   in order, so each piece is checksummed and written to PATH as its READ
//!   completes.
//! * **The checksum** is FNV-1a 64 over the file's bytes. Both sides print
//!   it, and the client fails unless it equals the server's.
//!
//! Both exit 1 with a message on any error: FILE missing or empty, PATH not
//! writable, a registration over the locked-memory limit (the error names the
//! limit), huge pages not reserved, the peer gone, a checksum mismatch.

// The shared set-up and exchange; this example parses its own command line
// (a FILE, --out, --chunk), so the shared parser goes unused.
#[allow(dead_code)]
#[path = "shared/app.rs"]
mod app;

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use memmap2::MmapOptions;
use rdma_verbs::exchange::WireMessage;
use rdma_verbs::mr::{AnonMemory, HugePageSize};
use rdma_verbs::prelude::*;

/// READs in flight at once.
const DEPTH: u32 = 16;
/// `--chunk`'s default.
const DEFAULT_CHUNK: usize = 1 << 20;
/// The largest `--chunk`: rxe's and most NICs' largest message is 2 GiB.
const MAX_CHUNK: usize = 1 << 30;

const USAGE: &str = "usage: file_read --server FILE [--port P] [--device DEV] [--gid-index I]\n       \
     file_read --client HOST --out PATH [--port P] [--chunk BYTES] [--hugepages] [--device DEV] [--gid-index I]";

/// The command line.
struct Opts {
    /// The connection options the shared code takes (role, port, device, GID).
    app: app::Args,
    /// The server's file.
    file: Option<PathBuf>,
    /// The client's output file.
    out: Option<PathBuf>,
    chunk: usize,
    hugepages: bool,
}

fn usage_error(msg: &str) -> ! {
    eprintln!("file_read: {msg}\n{USAGE}");
    std::process::exit(2)
}

impl Opts {
    fn parse() -> Opts {
        let mut o = Opts {
            app: app::Args {
                client: None,
                size: 1,
                iters: 1,
                device: std::env::var("RDMA_VERBS_DEVICE").ok(),
                gid_index: None,
                port: 18520,
                qp_timeout: None,
                retry_cnt: None,
                rnr_retry: None,
                min_rnr_timer: None,
                cq_entries: None,
                stall: None,
                seed: 0,
            },
            file: None,
            out: None,
            chunk: DEFAULT_CHUNK,
            hugepages: false,
        };
        let mut it = std::env::args().skip(1);
        while let Some(arg) = it.next() {
            let mut val = |what: &str| {
                it.next()
                    .unwrap_or_else(|| usage_error(&format!("{what} needs a value")))
            };
            match arg.as_str() {
                "--server" | "-s" => o.file = Some(val("--server").into()),
                "--client" | "-c" => o.app.client = Some(val("--client")),
                "--out" | "-o" => o.out = Some(val("--out").into()),
                "--port" | "-p" => {
                    o.app.port = val("--port")
                        .parse()
                        .unwrap_or_else(|_| usage_error("bad --port"))
                }
                "--chunk" => {
                    o.chunk = val("--chunk")
                        .parse()
                        .ok()
                        .filter(|c| (1..=MAX_CHUNK).contains(c))
                        .unwrap_or_else(|| usage_error("bad --chunk (1 to 1073741824 bytes)"))
                }
                "--hugepages" => o.hugepages = true,
                "--device" | "-d" => o.app.device = Some(val("--device")),
                "--gid-index" | "-g" => {
                    let i = val("--gid-index").parse().ok();
                    o.app.gid_index = Some(i.unwrap_or_else(|| usage_error("bad --gid-index")))
                }
                "--help" | "-h" => {
                    println!("{USAGE}");
                    std::process::exit(0)
                }
                other => usage_error(&format!("unknown argument `{other}`")),
            }
        }
        match (&o.file, &o.app.client, &o.out) {
            (Some(_), None, None) if !o.hugepages => {}
            (None, Some(_), Some(_)) => {}
            (Some(_), None, _) => usage_error("--out and --hugepages are the client's options"),
            (None, Some(_), None) => usage_error("the client needs --out PATH"),
            _ => usage_error("say exactly one of --server FILE or --client HOST"),
        }
        o
    }
}

/// What the server tells the client about the file after the exchange: its
/// length and checksum. On the wire: `"file"`, then both as little-endian
/// `u64`s (20 bytes).
struct FileInfo {
    len: u64,
    fnv: u64,
}

impl WireMessage for FileInfo {
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()> {
        let mut msg = *b"file\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
        msg[4..12].copy_from_slice(&self.len.to_le_bytes());
        msg[12..].copy_from_slice(&self.fnv.to_le_bytes());
        w.write_all(&msg)
            .and_then(|()| w.flush())
            .map_err(|source| Error::Io {
                what: "sending the file's length and checksum",
                source,
            })
    }

    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<FileInfo> {
        let mut msg = [0u8; 20];
        r.read_exact(&mut msg).map_err(|source| Error::Io {
            what: "receiving the file's length and checksum",
            source,
        })?;
        if &msg[..4] != b"file" {
            return Err(Error::Protocol(format!(
                "expected the file message, got {:?}",
                msg.escape_ascii().to_string()
            )));
        }
        let word = |at: usize| u64::from_le_bytes(msg[at..at + 8].try_into().expect("8 bytes"));
        Ok(FileInfo {
            len: word(4),
            fnv: word(12),
        })
    }
}

/// FNV-1a 64, continued from `h` (start with [`FNV_START`]).
fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a 64's offset basis: the checksum of no bytes.
const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn main() -> ExitCode {
    let opts = Opts::parse();
    app::exit_on_error("file_read", || match (&opts.file, &opts.out) {
        (Some(file), _) => serve(&opts, file),
        (None, Some(out)) => fetch(&opts, out),
        (None, None) => unreachable!("Opts::parse requires a role"),
    })
}

/// Maps `file` read-only and private and registers it for remote READ.
fn map_file(pd: &Pd, file: &PathBuf) -> Result<Mr> {
    let named = |e: std::io::Error| Error::Other(format!("{}: {e}", file.display()));
    let f = File::open(file).map_err(named)?;
    let len = f.metadata().map_err(named)?.len();
    if len == 0 {
        return Err(Error::Other(format!(
            "{}: the file is empty; there is nothing to READ",
            file.display()
        )));
    }
    let len = usize::try_from(len).map_err(|_| Error::Other("file too large".into()))?;
    app::check_memory(len)?;
    // SAFETY: nothing in this process writes the file while it is mapped. Another
    // process may still truncate it: the module docs state what happens then
    // (SIGBUS on the server's own reads past the end), as docs/soundness.md does.
    let map = unsafe { MmapOptions::new().len(len).map_copy_read_only(&f) }.map_err(named)?;
    // Over RLIMIT_MEMLOCK this is Error::MemlockLimit, which names the limit.
    Mr::register(pd, map, AccessFlags::REMOTE_READ)
}

/// The server: registers `file`, hands its descriptor to one client and waits
/// until the client says it is done.
fn serve(opts: &Opts, file: &PathBuf) -> Result<()> {
    let mut side = app::open(&opts.app, 1)?;
    let mr = map_file(&side.pd, file)?;
    // A REMOTE_READ-only region is not remotely writable: its bytes read as a slice.
    let fnv = fnv1a(FNV_START, mr.as_slice()?);
    println!(
        "server: serving {} ({} bytes, fnv1a64 {fnv:016x}) on port {}",
        file.display(),
        mr.len(),
        opts.app.port
    );
    let qp = app::qp(&side)?;
    let (_qp, _) = app::connect(&opts.app, &mut side, qp, &[mr.remote()])?;
    let peer = side
        .peer
        .as_mut()
        .expect("connect keeps the exchange stream");
    peer.send(&FileInfo {
        len: mr.len() as u64,
        fnv,
    })?;
    // The client's READs complete on its side only: wait for its barrier, without a
    // limit (a slow copy is no error; a client that dies closes the connection,
    // which ends the wait with Error::PeerClosed).
    peer.set_timeout(None)?;
    side.finish()?;
    println!("server: client done; {} bytes served", mr.len());
    Ok(())
}

/// The client's destination: `len` bytes for local writes (the NIC's READ
/// responses), on huge pages when asked.
fn destination(opts: &Opts, pd: &Pd, len: usize) -> Result<Mr> {
    app::check_memory(len)?;
    if opts.hugepages {
        // Error::HugePagesUnavailable says how many to reserve and how.
        Mr::new_huge(pd, len, AccessFlags::LOCAL_WRITE, HugePageSize::Size2M)
    } else {
        Mr::register(pd, AnonMemory::new(len)?, AccessFlags::LOCAL_WRITE)
    }
}

/// The client: READs the server's file into a registered buffer and writes it to `out`.
fn fetch(opts: &Opts, out: &PathBuf) -> Result<()> {
    // Created first, so that an unwritable PATH fails before anything is connected.
    let named = |e: std::io::Error| Error::Other(format!("{}: {e}", out.display()));
    let mut writer = BufWriter::with_capacity(1 << 20, File::create(out).map_err(named)?);
    let mut side = app::open(&opts.app, DEPTH)?;
    let qp = app::qp(&side)?;
    let (mut qp, remote) = app::connect(&opts.app, &mut side, qp, &[])?;
    let source = *remote
        .mrs
        .first()
        .ok_or_else(|| Error::Protocol("the server sent no memory region".into()))?;
    let peer = side
        .peer
        .as_mut()
        .expect("connect keeps the exchange stream");
    let info: FileInfo = peer.recv()?;
    if info.len != source.len {
        return Err(Error::Protocol(format!(
            "the server's file has {} bytes but its region {}",
            info.len, source.len
        )));
    }
    let len = usize::try_from(source.len).map_err(|_| Error::Other("file too large".into()))?;
    let mut rest = Some(destination(opts, &side.pd, len)?);
    let chunk = opts.chunk.min(len);
    let chunks = len.div_ceil(chunk) as u64;
    let (mut posted, mut done, mut fnv) = (0u64, 0u64, FNV_START);
    let start = Instant::now();
    while done < chunks {
        // Keep DEPTH READs in flight: each takes the next piece of the destination.
        while posted < chunks && posted - done < u64::from(DEPTH) {
            let mut piece = rest.take().expect("a piece is left while chunks are");
            if piece.len() > chunk {
                rest = Some(piece.split_off(chunk)?);
            }
            qp.post_send(SendWr::read(posted, piece, source, posted * chunk as u64))?;
            posted += 1;
        }
        let mut c = side.poll("a READ's completion")?;
        c.result()?;
        // RC completes a send queue's requests in order: this is READ `done`.
        let piece = match (c.wr_id, c.opcode, c.take_mr()) {
            (id, WcOpcode::RdmaRead, Some(piece)) if id == done => piece,
            _ => return Err(Error::Protocol(format!("unexpected completion {c:?}"))),
        };
        let bytes = piece.as_slice()?;
        fnv = fnv1a(fnv, bytes);
        writer.write_all(bytes).map_err(named)?;
        done += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    writer.flush().map_err(named)?;
    side.finish()?;
    println!(
        "client: read {len} bytes in {chunks} READs of up to {chunk} bytes in {secs:.3} s \
         ({:.1} MB/s){}; fnv1a64 {fnv:016x}; wrote {}",
        len as f64 / secs / 1e6,
        if opts.hugepages {
            " into 2 MiB huge pages"
        } else {
            ""
        },
        out.display()
    );
    if (fnv, len as u64) != (info.fnv, info.len) {
        return Err(Error::Other(format!(
            "checksum mismatch: the server's file has fnv1a64 {:016x}, the copy {fnv:016x}",
            info.fnv
        )));
    }
    Ok(())
}
