//! Project automation for `rdma-verbs`, run as `cargo xtask <command>`.
//!
//! The main job is giving the project a real RDMA device on machines whose kernel has none:
//! `setup` builds a small soft-RoCE (rdma_rxe) guest out of Debian's kernel and busybox, `run`
//! and `vm-exec` run host-built programs inside it, `test` runs the whole test suite with
//! `tests/vm_*.rs` inside guests, and `demo` runs the examples there. The guest machinery is
//! the workspace crate `rdma-verbs-vm` (`vm/`), which users get as the `rdma-verbs-vm`
//! binary; xtask keeps its guest image under `target/rxe-vm/`.
//!
//! Only `std` is used, so this crate builds even while the main crate does not.

/// `println!` that ignores a closed stdout (as in `cargo xtask help | head`) instead of
/// panicking.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

mod compare;
mod demo;
mod faults;
mod gpu;
mod insn;
mod layers;
mod matrix;
mod nodes;
#[cfg(test)]
mod pinned;
mod providers;
mod scale;
mod test;
mod wire;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub use rdma_verbs_vm::{
    Context, EXIT_INFRA, EXIT_USAGE, Error, Result, cmd, parse_secs, run, setup, timeout_from_env,
};

/// Host packages xtask needs on top of [`setup::PACKAGES`]: valgrind (tests/vm_lifecycle.rs
/// runs under it in the guest).
pub const EXTRA_PACKAGES: &[&str] = &["valgrind"];

/// [`setup::setup`] with xtask's [`EXTRA_PACKAGES`].
pub fn setup_vm(verbosity: setup::Verbosity) -> Result<setup::VmAssets> {
    setup::setup(verbosity, EXTRA_PACKAGES)
}

/// `cargo xtask help`.
const USAGE: &str = "\
usage: cargo xtask <command> [args]

commands:
  setup                          install host packages (apt) if missing, download the Debian
                                 kernel and build the guest image under target/rxe-vm/, and
                                 siw's module for the suite's second cell (6.1/siw)
  run [--timeout SECS] [--kernel 6.1|6.12] [--provider rxe|siw] [--rdma-core host|56]
      -- CMD [ARGS...]           run CMD in a soft-RoCE guest (rxe0 on 10.99.0.1), or directly
                                 when the host has an RDMA device; exits with CMD's status
  run --nodes N [--timeout SECS] [--node1 SH] ... [--node4 SH] [--] [CMD [ARGS...]]
                                 N = 2 to 4 guests, 10.99.1.1 to 10.99.1.N, rxe0 on eth0 of
                                 each: two on a virtual wire (UDP on 127.0.0.1), three or four
                                 on a virtual switch in the runner; CMD runs on each with
                                 RDMA_VERBS_NODE=K, RDMA_VERBS_NODES=N, RDMA_VERBS_ADDR (own),
                                 RDMA_VERBS_PEERS (all others), RDMA_VERBS_PEER (the next node);
                                 --nodeK SH runs `sh -c SH` on node K instead; output lines
                                 prefixed [nodeK]; exits non-zero if any fails
  vm-exec CMD [ARGS...]          the same as `run`, without options; meant as a cargo target
                                 runner (CARGO_TARGET_<TRIPLE>_RUNNER=\"<xtask> vm-exec\")
  test [--quick] [CARGO TEST ARGS...]
                                 the whole suite: layers, host and doc tests, examples build,
                                 tests/vm_*.rs and the library's device tests in one guest,
                                 the runner crate, the two-node set, soak, instruction guard;
                                 --quick: layers, host tests (compile-fail included) and the core
                                 device tests in one guest, for the edit-test loop
  faults [--short | --set SET]   the fault matrix on two guests on a virtual wire: SIGKILLed
                                 peers, netem loss/reorder/duplication/corruption, RNR, long
                                 runs; prints a table, writes target/faults/faults.json
                                 (SET: interop, faults-short, ci, faults, or 'faults:W1|W2' /
                                 'interop:W1|W2': the rows of the full matrix / the interop set
                                 whose scenario or program names one of the words)
  nodes [--iters K]              four guests on the virtual switch: verified all-to-all over
                                 RC (send_recv) and UD (ud_send), K messages per link (50),
                                 then the last node SIGKILLed and its link cut: the others
                                 must report typed errors in time and keep exchanging; prints
                                 a table, writes target/nodes/nodes.json
  soak [--minutes N] [--loss PCT] [--qps N] [--max-size BYTES]
                                 verified soak across two guests (examples/soak.rs): mixed
                                 SEND/WRITE/READ 1 B-1 MiB on N QPs under PCT% loss (default
                                 1 minute, 1%, 4 QPs); counts, anonymous memory (fails if it
                                 grew > 1 MiB after warm-up), rdma res before/after
  demo                           build the examples and run them in one guest
  insn [--tests ..] [--check R]  user-space instructions per message under callgrind in the
                                 guest (perftest, perf --safe, --raw, --scoped),
                                 target/compare/insn.json (`insn --help`)
  compare [--reps N] [--tests ..] [--paths ..]
                                 timing: perftest and perf side by side in one guest, medians;
                                 target/compare/compare.{json,svg} (`compare --help`)
  scale [--only ..] [--reps R] [--n ..] | --render
                                 cost at scale against C in one guest: rdma_cm setup of n
                                 connections (cmtime, and a serial C client against the
                                 blocking one), registration and QP lifecycle (a C loop),
                                 2 B message rate on 1-256 QPs (perftest -q);
                                 target/scale/scale.{json,md} (`scale --help`)
  gpu-check [ARGS...]            on a machine with an NVIDIA GPU: the GPUDirect check
                                 (examples/gpu_check.rs, feature gdr), run on the host
  matrix [--no-fetch]            host tests against Debian 11/12/13's rdma-core and each
                                 installed libclang (feature bindgen); target/matrix/matrix.json
  providers [--cells K/P,..] [--limit SECS] [--tests vm_a,..]
                                 the device test binaries on each cell, one guest per cell
                                 (kernels 6.1, 6.12 x providers rxe, siw); one row per test in
                                 target/providers/providers.json (pass, unsupported,
                                 deviation, fail); --render: docs/providers.md's tables;
                                 --suite-cell: only the short cell `test` runs (6.1/siw)
  layers [--edges]               check src/'s imports against the layer table of
                                 ARCHITECTURE.md (no upward import, no circle of more than
                                 3 files across modules); --edges prints every file's imports
  help                           print this help

environment:
  XTASK_TIMEOUT=SECS             time limit of run / vm-exec / each device test binary
  (or RDMA_VERBS_VM_TIMEOUT)     (default 900)
  XTASK_VM_DEBUG=1               full kernel log in the run directory, which is kept
  (or RDMA_VERBS_VM_DEBUG)
  RDMA_VERBS_VM_WRITABLE=DIRS    colon-separated host directories the guest may write to
  RDMA_VERBS_INSN_FULL_START=1   insn: every provider and all debug information load in each
                                 callgrind run (by default only the device's provider, and no
                                 detached debug information unless runs are annotated)
  RDMA_VERBS_VM_MEM_MB=N         guest memory in MiB (default 2048, 1024 with 3 or 4 nodes;
                                 at least 1024)
  RDMA_VERBS_VM_KERNEL=6.1|6.12  guest kernel: Debian 12's (default) or bookworm-backports'
  RDMA_VERBS_VM_PROVIDER=rxe|siw soft-RoCE rxe0 (default) or soft-iWARP siw0 (built by setup)
  RDMA_VERBS_VM_RDMA_CORE=host|56
                                 the guest's rdma-core: the host's (default, 44 on Debian 12)
                                 or Debian 13's 56 with its C library, laid over the host's
  RDMA_VERBS_*, RUST_BACKTRACE, RUST_LOG, RUST_TEST_THREADS, PATH, HOME, CARGO_*
                                 passed through to the command in the guest

exit status: the command's own; 124 on timeout; 125 when xtask or the guest failed;
2 on a usage error.";

/// The workspace root: the parent of this crate's manifest directory.
///
/// It is fixed at compile time, so it is right both under `cargo xtask` and when cargo runs the
/// built binary as a target runner from another directory.
pub fn workspace_root() -> &'static Path {
    let xtask_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    xtask_dir.parent().unwrap_or(xtask_dir)
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` when set (relative to the current directory,
/// as cargo reads it), else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                std::env::current_dir()
                    .map(|cwd| cwd.join(&dir))
                    .unwrap_or(dir)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// Runs the command named by the first argument; returns the exit status.
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
            setup_vm(setup::Verbosity::Report)?;
            // The second cell `cargo xtask test` runs (siw's module is built here).
            let (kernel, provider) = providers::SUITE_CELL;
            let choice = rdma_verbs_vm::choice::Choice {
                kernel,
                provider,
                ..Default::default()
            };
            setup::setup_choice(setup::Verbosity::Report, EXTRA_PACKAGES, choice).map(|_| 0)
        }
        Some("run") => run::run_command(rest),
        Some("compare") => compare::compare_command(rest),
        Some("insn") => insn::insn_command(rest),
        Some("scale") => scale::scale_command(rest),
        Some("vm-exec") => run::vm_exec_command(rest),
        Some("faults") => faults::faults_command(rest),
        Some("soak") => faults::soak_command(rest),
        Some("wire-agent") => wire::agent_command(rest),
        Some("nodes") => nodes::nodes_command(rest),
        Some("mesh-agent") => wire::mesh::mesh_agent_command(rest),
        Some("fake-peer") => wire::fake_peer_command(rest),
        Some("test") => test::test_command(rest),
        Some("matrix") => matrix::matrix_command(rest),
        Some("providers") => providers::providers_command(rest),
        Some("gpu-check") => gpu::gpu_check_command(rest),
        Some("layers") => layers::layers_command(rest),
        Some("demo") => {
            if let Some(extra) = rest.first() {
                return Err(Error::usage(format!(
                    "demo takes no arguments, got {extra:?}"
                )));
            }
            demo::demo_command()
        }
        Some("help" | "-h" | "--help") => {
            say!("{USAGE}");
            Ok(0)
        }
        _ => Err(Error::usage(format!("unknown command {command:?}"))),
    }
}

fn main() -> ExitCode {
    setup::set_default_dir(target_dir().join("rxe-vm"));
    match dispatch(std::env::args_os().skip(1).collect()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("xtask: {e}");
            if e.code == EXIT_USAGE {
                eprintln!("\n{USAGE}");
            }
            ExitCode::from(e.code)
        }
    }
}
