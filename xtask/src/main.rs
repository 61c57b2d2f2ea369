//! Project automation for `rdma-verbs`, run as `cargo xtask <command>`.
//!
//! The main job is giving the project a real RDMA device on machines whose kernel has none:
//! `setup` builds a small soft-RoCE (rdma_rxe) guest out of Debian's kernel and busybox, `run`
//! and `vm-exec` run host-built programs inside it, `test` runs the whole test suite with
//! `tests/vm_*.rs` inside guests, and `demo` runs the examples there. The recipe behind it is
//! described in `RXE-VM.md`; the guest layout is described in [`vm`].
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

mod cmd;
mod compare;
mod cpio;
mod demo;
mod gpu;
mod insn;
mod run;
mod setup;
mod test;
mod vm;

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// Exit status for a usage error (unknown command, bad flag).
pub const EXIT_USAGE: u8 = 2;
/// Exit status when the command did not finish in time (as timeout(1) does).
pub const EXIT_TIMEOUT: u8 = 124;
/// Exit status when xtask itself failed: missing packages, a guest that did not boot, ...
pub const EXIT_INFRA: u8 = 125;

/// Default time limit of `run`, `vm-exec` and `demo`, in seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 900;
/// Environment variable that sets the time limit of `vm-exec` (and of `run` without
/// `--timeout`), in seconds.
pub const TIMEOUT_ENV: &str = "XTASK_TIMEOUT";

/// `cargo xtask help`.
const USAGE: &str = "\
usage: cargo xtask <command> [args]

commands:
  setup                          install host packages (apt) if missing, download the Debian
                                 kernel and build the guest image under target/rxe-vm/
  run [--timeout SECS] -- CMD [ARGS...]
                                 run CMD in a soft-RoCE guest (rxe0 on 10.99.0.1), or directly
                                 when the host has an RDMA device; exits with CMD's status
  vm-exec CMD [ARGS...]          the same as `run`, without options; meant as a cargo target
                                 runner (CARGO_TARGET_<TRIPLE>_RUNNER=\"<xtask> vm-exec\")
  test [CARGO TEST ARGS...]      host tests, examples build, then tests/vm_*.rs in guests
  demo                           build the examples and run them in one guest
  insn [--tests ..] [--check R]  user-space instructions per message under callgrind in the
                                 guest (perftest, perf --safe, perf --raw), target/compare/insn.json
  gpu-check [ARGS...]            on a machine with an NVIDIA GPU: the GPUDirect check
                                 (examples/gpu_check.rs, feature gdr), run on the host
  help                           print this help

environment:
  XTASK_TIMEOUT=SECS             time limit of run / vm-exec / each device test binary
                                 (default 900)
  XTASK_VM_DEBUG=1               full kernel log in the run directory, which is kept
  RDMA_VERBS_VM_MEM_MB=N         guest memory in MiB (default 2048; at least 1024)
  RDMA_VERBS_*, RUST_BACKTRACE, RUST_LOG, RUST_TEST_THREADS, PATH, HOME, CARGO_*
                                 passed through to the command in the guest

exit status: the command's own; 124 on timeout; 125 when xtask or the guest failed;
2 on a usage error.";

/// An error that ends the xtask process with a message and an exit status.
#[derive(Debug)]
pub struct Error {
    /// What went wrong, for a human; printed as `xtask: <message>`.
    pub message: String,
    /// The process exit status to use.
    pub code: u8,
}

impl Error {
    /// An infrastructure failure (exit status [`EXIT_INFRA`]).
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code: EXIT_INFRA,
        }
    }

    /// A usage error (exit status [`EXIT_USAGE`]); the usage text is printed after it.
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            message: format!("{}\n\n{USAGE}", message.into()),
            code: EXIT_USAGE,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Result type of every fallible xtask function.
pub type Result<T> = std::result::Result<T, Error>;

/// Adds a description of what was being done to an I/O error.
pub trait Context<T> {
    /// Turns an error into an [`Error`] whose message is `what()` followed by the cause.
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::new(format!("{}: {e}", what())))
    }
}

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

/// The time limit from [`TIMEOUT_ENV`], or [`DEFAULT_TIMEOUT_SECS`].
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(TIMEOUT_ENV) {
        Ok(v) => parse_secs(&v).map_err(|e| Error::usage(format!("{TIMEOUT_ENV}: {e}"))),
        Err(_) => Ok(Duration::from_secs(DEFAULT_TIMEOUT_SECS)),
    }
}

/// Whether a process with this decimal id exists (false for anything that is not a pid).
pub fn pid_alive(pid: &str) -> bool {
    !pid.is_empty()
        && pid.bytes().all(|b| b.is_ascii_digit())
        && Path::new("/proc").join(pid).exists()
}

/// Parses a positive whole number of seconds.
pub fn parse_secs(v: &str) -> std::result::Result<Duration, String> {
    match v.trim().parse::<u64>() {
        Ok(n) if n > 0 => Ok(Duration::from_secs(n)),
        _ => Err(format!("expected a positive number of seconds, got {v:?}")),
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
            setup::setup(setup::Verbosity::Report).map(|_| 0)
        }
        Some("run") => run::run_command(rest),
        Some("compare") => compare::compare_command(rest),
        Some("insn") => insn::insn_command(rest),
        Some("vm-exec") => run::vm_exec_command(rest),
        Some("test") => test::test_command(rest),
        Some("gpu-check") => gpu::gpu_check_command(rest),
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
    match dispatch(std::env::args_os().skip(1).collect()) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::from(e.code)
        }
    }
}
