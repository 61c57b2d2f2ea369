//! Run programs in a throwaway soft-RoCE guest: real RDMA verbs on machines whose kernel has
//! no RDMA support (or no RDMA hardware).
//!
//! `rdma-verbs-vm setup` installs the host packages it needs (Debian/Ubuntu, through apt),
//! downloads Debian's kernel package and builds a small busybox initramfs; `rdma-verbs-vm run
//! -- CMD ARGS` boots that kernel under QEMU (TCG, no outside network), loads `rdma_rxe`,
//! creates `rxe0` on a veth pair with 10.99.0.1, and runs `CMD` in the guest, where the
//! host's root filesystem is visible read-only at the same paths, so host-built programs run
//! unchanged. As a cargo target runner,
//!
//! ```toml
//! # .cargo/config.toml
//! [target.x86_64-unknown-linux-gnu]
//! runner = ["rdma-verbs-vm", "run", "--"]
//! ```
//!
//! makes `cargo test` and `cargo run` execute in the guest, with `RDMA_VERBS_DEVICE=rxe0` and
//! `RDMA_VERBS_ADDR=10.99.0.1` set. When the host already has an RDMA device, the command
//! runs directly on the host instead.
//!
//! `rdma-verbs-vm run --nodes 2 -- CMD` boots two guests joined by a virtual wire (QEMU's
//! UDP socket netdev on 127.0.0.1), rxe0 on eth0 of each (10.99.1.1 and 10.99.1.2), and runs
//! CMD on both with `RDMA_VERBS_NODE`, `RDMA_VERBS_NODES`, `RDMA_VERBS_ADDR`,
//! `RDMA_VERBS_PEER` and `RDMA_VERBS_PEERS` set ([`run::execute_pair`], [`vm::run_pair`]).
//! `--nodes 3` and `--nodes 4` put three or four guests (10.99.1.1 to 10.99.1.4) on a
//! virtual switch in the runner, where every guest reaches every other one
//! ([`run::execute_nodes`], [`vm::run_nodes`]).
//!
//! The guest image is cached in [`setup::vm_dir`]: `$RDMA_VERBS_VM_DIR`, else
//! `$XDG_CACHE_HOME/rdma-verbs-vm`, else `~/.cache/rdma-verbs-vm`. The guest layout is
//! described in [`vm`], the commands in [`run`].
//!
//! Only `std` is used, so this crate builds even while the crates it runs do not.

/// `println!` that ignores a closed stdout (as in `rdma-verbs-vm help | head`) instead of
/// panicking.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

pub mod choice;
pub mod cmd;
mod cpio;
pub mod run;
pub mod setup;
pub mod vm;

use std::fmt;
use std::path::Path;
use std::time::Duration;

/// Exit status for a usage error (unknown command, bad flag).
pub const EXIT_USAGE: u8 = 2;
/// Exit status when the command did not finish in time (as timeout(1) does).
pub const EXIT_TIMEOUT: u8 = 124;
/// Exit status when the runner itself failed: missing packages, a guest that did not boot, ...
pub const EXIT_INFRA: u8 = 125;

/// Default time limit of `run`, in seconds.
pub const DEFAULT_TIMEOUT_SECS: u64 = 900;
/// Environment variable that sets the time limit of `run` without `--timeout`, in seconds.
pub const TIMEOUT_ENV: &str = "RDMA_VERBS_VM_TIMEOUT";
/// The older name of [`TIMEOUT_ENV`] (from this project's `cargo xtask`), still read.
pub const TIMEOUT_ENV_OLD: &str = "XTASK_TIMEOUT";

/// An error that ends the process with a message and an exit status.
#[derive(Debug)]
pub struct Error {
    /// What went wrong, for a human.
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

    /// A usage error (exit status [`EXIT_USAGE`]); the binary prints its usage text after it.
    pub fn usage(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            code: EXIT_USAGE,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

/// Result type of every fallible function here.
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

/// The value of the environment variable `name`, else of `old_name`; empty counts as unset.
pub fn env_or_old(name: &str, old_name: &str) -> Option<std::ffi::OsString> {
    [name, old_name]
        .into_iter()
        .filter_map(std::env::var_os)
        .find(|v| !v.is_empty())
}

/// The time limit from [`TIMEOUT_ENV`] (or [`TIMEOUT_ENV_OLD`]), or [`DEFAULT_TIMEOUT_SECS`].
pub fn timeout_from_env() -> Result<Duration> {
    match env_or_old(TIMEOUT_ENV, TIMEOUT_ENV_OLD) {
        Some(v) => parse_secs(&v.to_string_lossy())
            .map_err(|e| Error::usage(format!("{TIMEOUT_ENV}: {e}"))),
        None => Ok(Duration::from_secs(DEFAULT_TIMEOUT_SECS)),
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
