//! `rdma-verbs-vm run` (and `cargo xtask run` / `vm-exec`): run a command where an RDMA
//! device exists.
//!
//! When the host has an RDMA device (`/sys/class/infiniband/*`), the command runs directly on
//! the host. Otherwise it runs in a soft-RoCE guest ([`crate::vm`]), with `rxe0` on
//! 10.99.0.1. Either way it runs in the caller's working directory, its output streams as it
//! comes, and the runner exits with its exit status.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::choice::{Choice, GuestKernel, Provider, RdmaCore};
use crate::cmd::{self, Waited};
use crate::setup::{self, Verbosity};
use crate::vm::{self, Failure, Topology};
use crate::{Context, EXIT_TIMEOUT, Error, Result, TIMEOUT_ENV};

/// Host variables the command sees in the guest, by exact name. PATH and HOME keep the host's
/// paths working (the guest runs in the host's file tree).
const PASS_NAMES: &[&str] = &[
    "RUST_BACKTRACE",
    "RUST_LOG",
    "RUST_TEST_THREADS",
    "PATH",
    "HOME",
];
/// Host variables the command sees in the guest, by prefix. `CARGO_` carries what cargo sets
/// for a test binary it runs (CARGO_MANIFEST_DIR, CARGO_PKG_NAME, ...).
const PASS_PREFIXES: &[&str] = &["RDMA_VERBS_", "CARGO_"];

/// Whether the host variable `name` reaches the command in the guest: `PATH`, `HOME`,
/// `RUST_BACKTRACE`, `RUST_LOG`, `RUST_TEST_THREADS` and every `RDMA_VERBS_*` and `CARGO_*`.
pub fn passes_to_guest(name: &OsStr) -> bool {
    name.to_str()
        .is_some_and(|n| PASS_NAMES.contains(&n) || PASS_PREFIXES.iter().any(|p| n.starts_with(p)))
}

/// When set, `run` appends one line per guest failure ("timeout" or "boot") to the file it
/// names; this project's `cargo xtask test` uses it to count guests that did not boot.
pub const REPORT_ENV: &str = "RDMA_VERBS_VM_REPORT";

/// A command to run: program, arguments, working directory and environment.
#[derive(Clone, Debug)]
pub struct Invocation {
    /// The program, as given (a path, or a name looked up in `PATH`).
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Its working directory (the same path in the guest).
    pub cwd: PathBuf,
    /// Its environment in the guest (the host runs it with the full environment instead).
    pub env: Vec<(OsString, OsString)>,
}

impl Invocation {
    /// `program args` in the current directory, with the host variables that pass through.
    pub fn new(program: OsString, args: Vec<OsString>) -> Result<Self> {
        let cwd = std::env::current_dir().context(|| "cannot read the current directory".into())?;
        let env = std::env::vars_os()
            .filter(|(name, _)| passes_to_guest(name))
            .collect();
        Ok(Self {
            program,
            args,
            cwd,
            env,
        })
    }

    /// The program's absolute path: relative to `cwd` if it has a slash, else found in `PATH`.
    pub fn resolved_program(&self) -> Option<PathBuf> {
        let program = Path::new(&self.program);
        if program.components().count() > 1 || program.is_absolute() {
            return Some(self.cwd.join(program));
        }
        let path = self
            .env
            .iter()
            .find(|(n, _)| n == "PATH")
            .map(|(_, v)| v.clone())?;
        std::env::split_paths(&path)
            .map(|dir| self.cwd.join(dir).join(program))
            .find(|p| cmd::is_executable(p))
    }
}

/// `run [--timeout SECS] [--kernel K] [--provider P] [--rdma-core R] [--nodes 1..4] [--node1 SHELL] ...
/// [--node4 SHELL] [--] [CMD [ARGS...]]`.
///
/// With `--nodes N` (2 to 4), N guests on one network each run the command (see
/// [`execute_nodes`]); `--nodeK SHELL` gives node K its own command, run as `sh -c SHELL`.
/// `--kernel`, `--provider` and `--rdma-core` override `RDMA_VERBS_VM_KERNEL`,
/// `RDMA_VERBS_VM_PROVIDER` and `RDMA_VERBS_VM_RDMA_CORE` (see [`Choice`]).
pub fn run_command(args: Vec<OsString>) -> Result<u8> {
    let mut timeout = None;
    let mut choice = Choice::from_env()?;
    let mut nodes = 1usize;
    let mut per_node: [Option<OsString>; vm::MAX_NODES] = Default::default();
    let mut rest = args.into_iter().peekable();
    while let Some(arg) = rest.peek() {
        let Some(flag) = arg.to_str() else { break };
        if flag == "--" {
            rest.next();
            break;
        }
        if !flag.starts_with('-') {
            break;
        }
        let flag = flag.to_string();
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(OsString::from(v))),
            None => (flag.clone(), None),
        };
        rest.next();
        let mut value = |what: &str| {
            inline
                .clone()
                .or_else(|| rest.next())
                .ok_or_else(|| Error::usage(format!("{name} needs {what}")))
        };
        match name.as_str() {
            "--timeout" => {
                timeout = Some(parse_timeout(
                    &value("a number of seconds")?.to_string_lossy(),
                )?)
            }
            "--nodes" => nodes = parse_nodes(&value("1 to 4")?)?,
            "--kernel" => {
                choice.kernel = GuestKernel::parse(&value("6.1 or 6.12")?.to_string_lossy())?
            }
            "--provider" => {
                choice.provider = Provider::parse(&value("rxe or siw")?.to_string_lossy())?
            }
            "--rdma-core" => {
                choice.rdma_core = RdmaCore::parse(&value("host or 56")?.to_string_lossy())?
            }
            _ => match node_flag(&name) {
                Some(k) => per_node[k - 1] = Some(value("a shell command")?),
                None => return Err(Error::usage(format!("unknown option {flag:?} for run"))),
            },
        }
    }
    let timeout = match timeout {
        Some(t) => t,
        None => crate::timeout_from_env()?,
    };
    let mut command = rest;
    let program = command.next();
    let args: Vec<OsString> = command.collect();
    if let Some(k) = (1..=vm::MAX_NODES).find(|&k| per_node[k - 1].is_some() && k > nodes) {
        return Err(Error::usage(format!(
            "--node{k} needs --nodes {} or more (got --nodes {nodes})",
            k.max(2)
        )));
    }
    if nodes == 1 && per_node.iter().any(Option::is_some) {
        return Err(Error::usage("--node1 needs --nodes 2 or more"));
    }
    if nodes == 1 {
        let Some(program) = program else {
            return Err(Error::usage("run: missing the command to run"));
        };
        return execute_choice(Invocation::new(program, args)?, timeout, choice);
    }
    let invs = node_invocations(per_node, nodes, program, args)?;
    let refs: Vec<&Invocation> = invs.iter().collect();
    execute_nodes_choice(&refs, timeout, choice)
}

/// The command of each of the first `nodes` nodes: its own `--nodeK` shell command
/// (`sh -c SHELL`), else `program args`.
fn node_invocations(
    per_node: [Option<OsString>; vm::MAX_NODES],
    nodes: usize,
    program: Option<OsString>,
    args: Vec<OsString>,
) -> Result<Vec<Invocation>> {
    let mut invs = Vec::new();
    for (k, own) in per_node.into_iter().take(nodes).enumerate() {
        invs.push(match (own, &program) {
            (Some(shell), _) => Invocation::new("sh".into(), vec!["-c".into(), shell])?,
            (None, Some(program)) => Invocation::new(program.clone(), args.clone())?,
            (None, None) => {
                return Err(Error::usage(format!(
                    "run --nodes {nodes}: missing the command for node {} (CMD, or --node{})",
                    k + 1,
                    k + 1
                )));
            }
        });
    }
    Ok(invs)
}

/// The value of `--nodes`: 1 to [`vm::MAX_NODES`].
fn parse_nodes(value: &OsStr) -> Result<usize> {
    value
        .to_str()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| (1..=vm::MAX_NODES).contains(n))
        .ok_or_else(|| {
            Error::usage(format!(
                "--nodes: expected 1 to {}, got {value:?}",
                vm::MAX_NODES
            ))
        })
}

/// K for a `--nodeK` flag (1 to [`vm::MAX_NODES`]).
fn node_flag(name: &str) -> Option<usize> {
    name.strip_prefix("--node")
        .and_then(|k| k.parse::<usize>().ok())
        .filter(|k| (1..=vm::MAX_NODES).contains(k))
}

/// `vm-exec CMD [ARGS...]`: like `run` without options, for use as a cargo target runner
/// (cargo calls it with the test binary's path and the test arguments).
pub fn vm_exec_command(args: Vec<OsString>) -> Result<u8> {
    let mut command = args.into_iter();
    let Some(program) = command.next() else {
        return Err(Error::usage("vm-exec: missing the command to run"));
    };
    execute(
        Invocation::new(program, command.collect())?,
        crate::timeout_from_env()?,
    )
}

/// Parses the value of `--timeout`.
fn parse_timeout(value: &str) -> Result<Duration> {
    crate::parse_secs(value).map_err(|e| Error::usage(format!("--timeout: {e}")))
}

/// Runs `inv` on the host if it has an RDMA device, else in a guest of the [`Choice`] the
/// environment makes; returns its exit status.
pub fn execute(inv: Invocation, timeout: Duration) -> Result<u8> {
    execute_choice(inv, timeout, Choice::from_env()?)
}

/// [`execute`] in a guest of `choice` (when the host has no RDMA device of its own).
pub fn execute_choice(inv: Invocation, timeout: Duration, choice: Choice) -> Result<u8> {
    let assets = setup::setup_choice(Verbosity::Quiet, &[], choice)?;
    let devices = host_rdma_devices();
    if let Some(first) = devices.first() {
        return run_on_host(&inv, first, timeout);
    }
    vm::run(&assets, &inv, Topology::Loopback, timeout).map_err(|(failure, error)| {
        report_failure(failure);
        error
    })
}

/// Runs `invs[0]` on node 1 and `invs[1]` on node 2 of two guests on a virtual wire;
/// [`execute_nodes`] with two nodes.
pub fn execute_pair(invs: [&Invocation; 2], timeout: Duration) -> Result<u8> {
    execute_nodes(&invs, timeout)
}

/// [`execute_pair`] on guests of `choice` (`RDMA_VERBS_DEVICE` then names its device).
pub fn execute_pair_choice(
    invs: [&Invocation; 2],
    timeout: Duration,
    choice: Choice,
) -> Result<u8> {
    execute_nodes_choice(&invs, timeout, choice)
}

/// Runs `invs[K-1]` on node K of 2 to 4 guests ([`vm::run_nodes`]: two on a virtual wire,
/// more on a virtual switch); always in guests, even when the host has an RDMA device.
/// Each command sees `RDMA_VERBS_NODE` (K), `RDMA_VERBS_NODES` (how many),
/// `RDMA_VERBS_ADDR` (its own address, 10.99.1.K), `RDMA_VERBS_PEERS` (every other
/// node's, space-separated), `RDMA_VERBS_PEER` (the next node's: K+1, node 1 after the
/// last) and `RDMA_VERBS_DEVICE=rxe0`. Reports every outcome on stderr; returns 0 when all
/// exited with 0, else the first failure's status (124 for a timeout, 125 for a guest that
/// failed, else the command's).
pub fn execute_nodes(invs: &[&Invocation], timeout: Duration) -> Result<u8> {
    execute_nodes_choice(invs, timeout, Choice::from_env()?)
}

/// [`execute_nodes`] on guests of `choice` (`RDMA_VERBS_DEVICE` then names its device).
pub fn execute_nodes_choice(invs: &[&Invocation], timeout: Duration, choice: Choice) -> Result<u8> {
    if !(2..=vm::MAX_NODES).contains(&invs.len()) {
        return Err(Error::usage(format!(
            "2 to {} nodes, not {}",
            vm::MAX_NODES,
            invs.len()
        )));
    }
    let assets = setup::setup_choice(Verbosity::Quiet, &[], choice)?;
    let outcomes = vm::run_nodes(&assets, invs, timeout);
    let mut worst: Option<u8> = None;
    for (i, outcome) in outcomes.into_iter().enumerate() {
        let node = i + 1;
        let code = match outcome {
            Ok(code) => {
                eprintln!("rdma-verbs-vm: node{node} exited with status {code}");
                code
            }
            Err((failure, e)) => {
                report_failure(failure);
                eprintln!("rdma-verbs-vm: node{node}: {e}");
                e.code
            }
        };
        if code != 0 && worst.is_none() {
            worst = Some(code);
        }
    }
    Ok(worst.unwrap_or(0))
}

/// Names of the host's RDMA devices, sorted.
pub fn host_rdma_devices() -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir("/sys/class/infiniband")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Runs `inv` directly, with the full host environment; RDMA_VERBS_DEVICE defaults to
/// `device` (a value the caller set wins, as does their RDMA_VERBS_ADDR if any).
fn run_on_host(inv: &Invocation, device: &str, timeout: Duration) -> Result<u8> {
    let mut command = Command::new(&inv.program);
    command.args(&inv.args).current_dir(&inv.cwd);
    if std::env::var_os("RDMA_VERBS_DEVICE").is_none() {
        command.env("RDMA_VERBS_DEVICE", device);
    }
    let mut child = command
        .spawn()
        .context(|| format!("cannot run `{}`", cmd::display(&command)))?;
    match cmd::wait_with_deadline(&mut child, timeout)? {
        Waited::Exited(status) => Ok(cmd::shell_code(status)),
        Waited::TimedOut => {
            report_failure(Failure::Timeout);
            Err(Error {
                message: format!(
                    "timed out after {} s (the command was killed; --timeout SECS or \
                     {TIMEOUT_ENV}=SECS raises the limit)",
                    timeout.as_secs()
                ),
                code: EXIT_TIMEOUT,
            })
        }
    }
}

/// Appends the failure to the [`REPORT_ENV`] file, if the caller asked for one.
fn report_failure(failure: Failure) {
    let Some(path) = std::env::var_os(REPORT_ENV) else {
        return;
    };
    let line = match failure {
        Failure::Timeout => "timeout\n",
        Failure::Boot => "boot\n",
    };
    if let Ok(mut file) = fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = file.write_all(line.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage_error(args: &[&str]) -> Option<String> {
        match run_command(args.iter().map(OsString::from).collect()) {
            Err(e) if e.code == crate::EXIT_USAGE => Some(e.message),
            _ => None,
        }
    }

    #[test]
    fn node_options_are_checked_before_anything_runs() {
        assert!(usage_error(&["--nodes", "5", "--", "true"]).is_some_and(|m| m.contains("1 to 4")));
        assert!(usage_error(&["--nodes", "0", "--", "true"]).is_some_and(|m| m.contains("1 to 4")));
        assert!(usage_error(&["--node1", "true"]).is_some_and(|m| m.contains("--nodes 2")));
        assert!(
            usage_error(&["--nodes=3", "--node4", "true", "--", "true"])
                .is_some_and(|m| m.contains("--node4 needs --nodes 4"))
        );
        assert!(usage_error(&["--node5", "true"]).is_some_and(|m| m.contains("unknown option")));
        assert!(
            usage_error(&["--nodes=2", "--node1", "true"]).is_some_and(|m| m.contains("node 2"))
        );
        assert!(
            usage_error(&["--nodes=4", "--node1", "a", "--node2", "b", "--node3", "c"])
                .is_some_and(|m| m.contains("--node4"))
        );
        assert!(usage_error(&["--nodes"]).is_some_and(|m| m.contains("needs")));
        assert!(usage_error(&["--bogus"]).is_some_and(|m| m.contains("unknown option")));
        assert!(usage_error(&["--kernel", "5.10", "true"]).is_some_and(|m| m.contains("6.12")));
        assert!(usage_error(&["--provider=mlx5", "true"]).is_some_and(|m| m.contains("siw")));
    }
}
