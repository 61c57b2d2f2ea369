//! Forwarding a guest's output ports to our stdout and stderr.

use std::io;
use std::thread;

/// Where a guest's output goes.
#[derive(Clone, Debug)]
pub(super) enum Output {
    /// Straight to our stdout and stderr.
    Inherit,
    /// To our stdout and stderr, each line prefixed (`[node1] `).
    Prefixed(String),
}

/// A thread copying `from` to our stdout (`to_stdout`) or stderr, prefixing each line for
/// [`Output::Prefixed`]. A line is written with one call, so lines of two guests never mix.
pub(super) fn forward(
    mut from: impl io::Read + Send + 'static,
    output: Output,
    to_stdout: bool,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let prefix = match output {
            Output::Inherit => {
                let _ = if to_stdout {
                    io::copy(&mut from, &mut io::stdout())
                } else {
                    io::copy(&mut from, &mut io::stderr())
                };
                return;
            }
            Output::Prefixed(prefix) => prefix,
        };
        let mut reader = io::BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match io::BufRead::read_until(&mut reader, b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let mut out = prefix.as_bytes().to_vec();
            out.extend_from_slice(&line);
            if !out.ends_with(b"\n") {
                out.push(b'\n');
            }
            let _ = if to_stdout {
                io::Write::write_all(&mut io::stdout().lock(), &out)
            } else {
                io::Write::write_all(&mut io::stderr().lock(), &out)
            };
        }
    })
}
