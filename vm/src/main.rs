//! `rdma-verbs-vm`: run programs, `cargo test` and `cargo run` in a soft-RoCE guest.
//! See the library documentation ([`rdma_verbs_vm`]) for what it does.

use std::ffi::OsString;
use std::io::Write as _;
use std::process::ExitCode;

use rdma_verbs_vm::setup::{self, Verbosity};
use rdma_verbs_vm::{EXIT_USAGE, Error, Result, run};

const USAGE: &str = "\
usage: rdma-verbs-vm <command> [args]

commands:
  setup                          install the host packages it needs (apt) if missing, download
                                 Debian's kernel and build the guest image (in the cache dir)
  run [--timeout SECS] [--kernel 6.1|6.12] [--provider rxe|siw] [--rdma-core host|56]
      [--] CMD [ARGS...]         run CMD in a soft-RoCE guest (rxe0 on 10.99.0.1), or directly
                                 when the host has an RDMA device; exits with CMD's status
  run --nodes N [--timeout SECS] [--node1 SH] ... [--node4 SH] [--] [CMD [ARGS...]]
                                 N = 2 to 4 guests, 10.99.1.1 to 10.99.1.N, rxe0 on eth0 of
                                 each: two on a virtual wire (UDP on 127.0.0.1), three or four
                                 on a virtual switch in the runner; CMD runs on each with
                                 RDMA_VERBS_NODE=K, RDMA_VERBS_NODES=N, RDMA_VERBS_ADDR (own),
                                 RDMA_VERBS_PEERS (all others), RDMA_VERBS_PEER (the next node);
                                 --nodeK SH runs `sh -c SH` on node K instead; output lines
                                 prefixed [nodeK]; exits non-zero if any fails
  help                           print this help
  version                        print the version

as a cargo runner, in .cargo/config.toml:
  [target.x86_64-unknown-linux-gnu]
  runner = [\"rdma-verbs-vm\", \"run\", \"--\"]

environment:
  RDMA_VERBS_VM_DIR=DIR          cache directory (default $XDG_CACHE_HOME/rdma-verbs-vm,
                                 else ~/.cache/rdma-verbs-vm)
  RDMA_VERBS_VM_TIMEOUT=SECS     time limit of run without --timeout (default 900)
  RDMA_VERBS_VM_WRITABLE=DIRS    colon-separated host directories the guest may write to
                                 (everything else but /tmp is read-only in the guest)
  RDMA_VERBS_VM_DEBUG=1          full kernel log in the run directory, which is kept
  RDMA_VERBS_VM_MEM_MB=N         guest memory in MiB (default 2048, 1024 with 3 or 4 nodes;
                                 at least 1024)
  RDMA_VERBS_VM_KERNEL=6.1|6.12  guest kernel: Debian 12's (default) or bookworm-backports'
  RDMA_VERBS_VM_PROVIDER=rxe|siw soft-RoCE rxe0 (default) or soft-iWARP siw0
  RDMA_VERBS_VM_RDMA_CORE=host|56
                                 the guest's rdma-core: the host's (default) or Debian 13's 56
                                 with its C library, laid over the host's files in the guest
  RDMA_VERBS_*, RUST_BACKTRACE, RUST_LOG, RUST_TEST_THREADS, PATH, HOME, CARGO_*
                                 passed through to the command in the guest

exit status: the command's own; 124 on timeout; 125 when the runner or the guest failed;
2 on a usage error.";

fn dispatch(args: Vec<OsString>) -> Result<u8> {
    let mut args = args.into_iter();
    let Some(command) = args.next() else {
        return Err(Error::usage("missing command"));
    };
    let rest: Vec<OsString> = args.collect();
    match command.to_str() {
        Some("setup") => {
            if let Some(extra) = rest.first() {
                return Err(Error::usage(format!(
                    "setup takes no arguments, got {extra:?}"
                )));
            }
            setup::setup(Verbosity::Report, &[]).map(|_| 0)
        }
        Some("run") => run::run_command(rest),
        Some("help" | "-h" | "--help") => {
            let _ = writeln!(std::io::stdout(), "{USAGE}");
            Ok(0)
        }
        Some("version" | "-V" | "--version") => {
            let _ = writeln!(
                std::io::stdout(),
                "rdma-verbs-vm {}",
                env!("CARGO_PKG_VERSION")
            );
            Ok(0)
        }
        _ => Err(Error::usage(format!("unknown command {command:?}"))),
    }
}

fn main() -> ExitCode {
    match dispatch(std::env::args_os().skip(1).collect()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("rdma-verbs-vm: {e}");
            if e.code == EXIT_USAGE {
                eprintln!("\n{USAGE}");
            }
            ExitCode::from(e.code)
        }
    }
}
