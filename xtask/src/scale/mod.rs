//! `cargo xtask scale`: the costs that grow with the number of objects a program holds,
//! this crate against C in the same soft-RoCE guest and the same run.
//!
//! Parts (`--only`):
//! - `setup`: rdma_cm setup of n connections (`--n`, default 64, 256, 1,024) by
//!   `examples/scale.rs` (`cm-server`/`cm-client`: blocking, `--tokio`, and blocking with
//!   `--batch`, through `cm::accept_all` and `cm::connect_all`) against
//!   rdma-core's `cmtime` (rdmacm-utils): connections per second over the setup steps
//!   (create id, resolve address and route, create QP, connect), the time per connection
//!   of each step (create id and the two resolutions together, as the async layer does
//!   them in one future), and peak RSS per connection on each side (client: GNU time's
//!   maximum resident set; cmtime's server, which never exits: its VmHWM once the client
//!   is done), each as (peak at n - peak at n = 1) / (n - 1). On 6.1 kernels `VmHWM`
//!   leaves out pages a thread maps until its next 64 page faults, which `cmtime`'s
//!   server thread creating the QPs never reaches: its figure there is low (see
//!   docs/performance.md; `RDMA_VERBS_VM_KERNEL=6.12` counts it). Besides, the blocking
//!   client against C doing the same: `loops.c`'s serial client (`scale_c cm`: every step
//!   one connection at a time, each call followed by the wait for its event, one event
//!   channel), both against the blocking server (rows `cm_*_blocking_serial`).
//! - `reg`: registration and deregistration of 4 KiB, 1 MiB and 64 MiB regions
//!   (`scale reg`: `Mr::register` of a buffer allocated once and `Mr::into_buffer`)
//!   against a C loop of `ibv_reg_mr`/`ibv_dereg_mr` (`loops.c`, compiled here with the
//!   system's `cc` and run in the guest, which shares the host's rdma-core).
//! - `qp`: an RC QP created, taken to INIT, RTR (towards a peer QP) and RTS, destroyed
//!   (`scale qp` against the C loop).
//! - `rate`: 2-byte message rate of write_bw and send_bw with 1, 16 and 256 QPs, `perf
//!   --safe` (ownership passing) and `--scoped` against perftest, all with `-q N`.
//!
//! Every ratio is a rate, ours over C's, so higher is better everywhere: for a rate
//! (connections/s, operations/s, Mpps) `ours / c`, for a time or a memory per connection
//! `c / ours`. Each figure is the median over `--reps` repetitions (the order of C and
//! ours alternates between repetitions). Written: `target/scale/scale.json` (rows `{test,
//! n, ours, c, unit, ratio}`, `note` where a figure is missing and why), the markdown
//! table `target/scale/scale.md` (also printed), the logs under `target/scale/runs/`;
//! `--render` puts the table into docs/performance.md ("Cost at scale").

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod report;
mod script;
#[cfg(test)]
mod tests;

use crate::cmd::{self, run_checked};
use crate::compare::{Flags, parse_reps, parse_timeout};
use crate::{Context, Error, Result};

/// The parts `--only` can name, in run order.
pub(super) const PARTS: &[&str] = &["setup", "reg", "qp", "rate"];
/// Default connection counts of `setup`.
pub(super) const DEFAULT_CONNS: &[u32] = &[64, 256, 1024];
/// Region sizes of `reg`.
pub(super) const REG_SIZES: &[u64] = &[4096, 1 << 20, 64 << 20];
/// QP counts of `rate`.
pub(super) const RATE_QPS: &[u32] = &[1, 16, 256];
/// Tests of `rate`.
pub(super) const RATE_TESTS: &[&str] = &["write_bw", "send_bw"];
/// Our data paths in `rate` (`perf --<path>`).
pub(super) const RATE_PATHS: &[&str] = &["safe", "scoped"];
/// QP lifecycles per `qp` run.
pub(super) const QP_ITERS: u64 = 200;

const USAGE: &str = "\
usage: cargo xtask scale [--only setup,reg,qp,rate] [--reps R] [--n N1,N2,...]
                         [--timeout SECS]
       cargo xtask scale --render

Runs the crate's examples (scale, perf) and C (cmtime, a C loop built here, perftest) side
by side in one soft-RoCE guest; writes target/scale/scale.{json,md}.
  --only LIST     parts: setup (rdma_cm, n connections), reg (4 KiB, 1 MiB, 64 MiB
                  regions), qp (QP create, INIT, RTR, RTS, destroy), rate (2 B write_bw
                  and send_bw, 1, 16 and 256 QPs); default all
  --reps R        repetitions; medians are reported (default 3)
  --n LIST        connection counts of setup (default 64,256,1024)
  --timeout SECS  limit of the whole guest run (default 2400)
  --render        put target/scale/scale.md into docs/performance.md (no guest)
ratio: ours/C as a rate (times and memory per connection: C/ours); higher is better.";

/// What the command line asked for.
#[derive(Debug, PartialEq)]
pub(super) struct Plan {
    pub(super) parts: Vec<&'static str>,
    pub(super) reps: u32,
    pub(super) conns: Vec<u32>,
    pub(super) timeout: Duration,
}

impl Plan {
    pub(super) fn has(&self, part: &str) -> bool {
        self.parts.contains(&part)
    }
}

/// What `parse_args` found.
#[derive(Debug, PartialEq)]
pub(super) enum Asked {
    Run(Plan),
    Render,
    Help,
}

/// A comma-separated list, each item checked by `item`.
fn list<T>(s: &str, item: impl Fn(&str) -> Option<T>, what: &str) -> Result<Vec<T>> {
    s.split(',')
        .map(|x| item(x.trim()))
        .collect::<Option<Vec<_>>>()
        .filter(|v| !v.is_empty())
        .ok_or_else(|| Error::usage(format!("{what}\n\n{USAGE}")))
}

pub(super) fn parse_args(args: Vec<OsString>) -> Result<Asked> {
    let mut plan = Plan {
        parts: PARTS.to_vec(),
        reps: 3,
        conns: DEFAULT_CONNS.to_vec(),
        timeout: Duration::from_secs(2400),
    };
    let mut flags = Flags::new(args, USAGE)?;
    while let Some((flag, inline)) = flags.next() {
        let mut value = || flags.value(&flag, inline.clone());
        match flag.as_str() {
            "--only" => {
                let asked = list(
                    &value()?,
                    |p| PARTS.iter().find(|&&k| k == p),
                    "--only takes setup, reg, qp, rate",
                )?;
                plan.parts = PARTS
                    .iter()
                    .copied()
                    .filter(|p| asked.contains(&p))
                    .collect();
            }
            "--reps" => plan.reps = parse_reps(&value()?)?,
            "--n" => {
                plan.conns = list(
                    &value()?,
                    |n| n.parse().ok().filter(|n| (2..=4096).contains(n)),
                    "--n takes connection counts of 2 to 4096, comma separated",
                )?
            }
            "--timeout" => plan.timeout = parse_timeout(&value()?)?,
            "--render" => return Ok(Asked::Render),
            "-h" | "--help" => return Ok(Asked::Help),
            other => {
                return Err(Error::usage(format!(
                    "unknown option {other:?} for scale\n\n{USAGE}"
                )));
            }
        }
    }
    Ok(Asked::Run(plan))
}

/// `cargo xtask scale [...]`.
pub fn scale_command(args: Vec<OsString>) -> Result<u8> {
    let plan = match parse_args(args)? {
        Asked::Run(plan) => plan,
        Asked::Render => return report::render().map(|()| 0),
        Asked::Help => {
            say!("{USAGE}");
            return Ok(0);
        }
    };
    let work = PathBuf::from(format!("/tmp/rdma-verbs-scale.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).context(|| format!("cannot create {}", work.display()))?;
    let tools = build(&work)?;
    let code = run_in_guest(&plan, &tools, &work)?;
    let out_dir = crate::target_dir().join("scale");
    let runs_dir = crate::compare::keep_logs(&work, &out_dir)?;
    let rows = report::rows(&plan, &runs_dir);
    let table = report::table(&rows);
    say!("{table}");
    let json_path = out_dir.join("scale.json");
    fs::write(&json_path, report::to_json(&rows))
        .context(|| format!("cannot write {}", json_path.display()))?;
    let md_path = out_dir.join("scale.md");
    fs::write(&md_path, &table).context(|| format!("cannot write {}", md_path.display()))?;
    say!(
        "wrote {} and {}; logs in {}",
        json_path.display(),
        md_path.display(),
        runs_dir.display()
    );
    let missing = rows.iter().filter(|r| r.note.is_some()).count();
    if missing > 0 {
        eprintln!("xtask scale: {missing} row(s) have no figure; their notes say why");
    }
    if code != 0 {
        eprintln!("xtask scale: the guest script ended with status {code}");
    }
    Ok(u8::from(missing > 0 || code != 0))
}

/// The programs the guest runs.
pub(super) struct Tools {
    perf: PathBuf,
    scale: PathBuf,
    c_loop: PathBuf,
}

/// Builds `perf` and `scale` (release, feature tokio) and the C loop (into `work`).
fn build(work: &Path) -> Result<Tools> {
    let root = crate::workspace_root();
    let mut cargo = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cargo
        .args(["build", "--release", "--features", "tokio"])
        .args(["--example", "perf", "--example", "scale"])
        .current_dir(root);
    eprintln!("xtask scale: {}", cmd::display(&cargo));
    run_checked(&mut cargo)?;
    let src = work.join("loops.c");
    fs::write(&src, include_str!("loops.c"))
        .context(|| format!("cannot write {}", src.display()))?;
    let c_loop = work.join("scale_c");
    let mut cc = Command::new(std::env::var_os("CC").unwrap_or_else(|| "cc".into()));
    cc.arg("-O2")
        .arg("-o")
        .arg(&c_loop)
        .arg(&src)
        .arg("-libverbs")
        .arg("-lrdmacm");
    eprintln!("xtask scale: {}", cmd::display(&cc));
    run_checked(&mut cc)?;
    let examples = crate::target_dir().join("release/examples");
    Ok(Tools {
        perf: examples.join("perf"),
        scale: examples.join("scale"),
        c_loop,
    })
}

/// Runs the plan's script in one guest, logs into `work`; the script's exit status.
fn run_in_guest(plan: &Plan, tools: &Tools, work: &Path) -> Result<u8> {
    let script = script::script(plan);
    eprintln!(
        "xtask scale: {} x {} repetitions in one guest",
        plan.parts.join(", "),
        plan.reps
    );
    let args = [work, &tools.perf, &tools.scale, &tools.c_loop];
    crate::compare::run_script(script, "scale", &args, plan.timeout)
}
