//! `cargo xtask compare`: perftest against this crate's `perf` example, safe and raw data
//! paths (and, with `--paths`, the scoped one), with identical parameters, in one soft-RoCE
//! guest.
//!
//! For every test (`write_bw`, `read_bw`, `send_bw`, `send_lat` by default) and size (2 B,
//! 64 B, 1 KiB, 4 KiB, 64 KiB, 1 MiB by default), the guest runs perftest's `ib_<test>`, then
//! `perf <test> --safe` and `perf <test> --raw` (`--paths` picks among `safe`, `raw` and
//! `scoped`; `perf --scoped` runs the bandwidth tests only, so a latency test never gets a
//! scoped run). The order rotates with each (test, size) and each repetition, so drift in
//! the guest's speed does not favour one of them; each runs as a server and a client on
//! rxe0 with the same flags: `-d $RDMA_VERBS_DEVICE -x 1 -F -s SIZE -n ITERS` and
//! perftest's defaults for everything else (tx depth 128 / 1, CQ moderation 100 or 1 above
//! 8 KiB, no inline data on soft-RoCE). Iterations scale with the size so that every run
//! moves about the same number of bytes: bandwidth tests `clamp(64 MiB / size, 64, 5000)`,
//! latency tests `clamp(16 MiB / size, 20, 1000)`.
//!
//! `atomic_bw` (`ib_atomic_bw`, fetch-and-add) runs only with `--tests atomic_bw`: atomics
//! always move 8 bytes (perftest refuses any other `-s`), so it runs at size 8 alone,
//! whatever `--sizes` says, with `-s 8` on both tools' command lines.
//!
//! Results: perftest's table (client side; the bandwidth taken from whichever of its
//! 2-decimal MiB/s and 6-decimal Mpps columns has more significant digits) and `perf`'s
//! `--out_json`. Each number is the median over the repetitions. Written:
//! `target/compare/compare.json` (rows `{test, path, size, unit, ours, perftest, ratio}`,
//! path `safe`, `raw` or `scoped`, ratio = ours / perftest), `target/compare/compare.svg`
//! (ratio against size, a line per path), and the raw logs under `target/compare/runs/`.
//! The printed table has a value and a ratio to perftest per path, and the ratios between
//! paths (safe/raw, scoped/safe, scoped/raw) of those `--paths` names.
//!
//! Exit status: 1 when a (test, size, path) combination has no median (no repetition of
//! it or of its perftest run gave a result) or the guest script did not finish; a single
//! repetition without a result is a printed warning naming the run, and the medians use
//! the other repetitions (exit 0).
//!
//! The guest writes its logs to a directory under the host's `/tmp`, which `cargo xtask
//! run` shares read-write with the guest whenever a command argument lies there.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod json;
mod render;
mod runner;
#[cfg(test)]
mod tests;

use crate::cmd::{self, run_checked};
use crate::run::{self, Invocation};
use crate::{Context, Error, Result};
use render::{Row, print_table, rows, svg, to_json};
pub(crate) use render::{json_num, median};
use runner::{collect, script};
pub(crate) use runner::{job_functions, parse_ours, parse_perftest};

/// Default message sizes.
pub(super) const DEFAULT_SIZES: &[u64] = &[2, 64, 1024, 4096, 65536, 1 << 20];
/// Default tests (perftest's tool is `ib_<test>`).
pub(super) const DEFAULT_TESTS: &[&str] = &["write_bw", "read_bw", "send_bw", "send_lat"];
/// Every test both tools implement.
pub(super) const KNOWN_TESTS: &[&str] = &[
    "write_bw",
    "read_bw",
    "send_bw",
    "write_lat",
    "send_lat",
    "read_lat",
    "atomic_bw",
];
/// perftest's `DEF_SIZE_ATOMIC`: the one size of `atomic_bw`.
pub(super) const ATOMIC_SIZE: u64 = 8;
/// Our data paths `--paths` can name, in table order (`perf --<path>`).
pub(super) const KNOWN_PATHS: &[&str] = &["safe", "raw", "scoped"];
/// Default `--paths`.
pub(super) const DEFAULT_PATHS: &[&str] = &["safe", "raw"];
/// Time limit of each side of one run inside the guest, in seconds.
pub(super) const SIDE_TIMEOUT_SECS: u32 = 180;

const USAGE: &str = "\
usage: cargo xtask compare [--reps N] [--sizes S1,S2,...] [--tests T1,T2,...] [--paths P1,...]
                           [--timeout SECS]

Runs perftest (ib_<test>) and the `perf` example (--safe and --raw by default) with identical
parameters in one soft-RoCE guest and writes target/compare/compare.{json,svg}.
  --reps N        repetitions of every run; medians are reported (default 5)
  --sizes LIST    message sizes in bytes (default 2,64,1024,4096,65536,1048576)
  --tests LIST    of write_bw,read_bw,send_bw,write_lat,send_lat,read_lat,atomic_bw
                  (default write_bw,read_bw,send_bw,send_lat; atomic_bw runs at 8 B only)
  --paths LIST    our data paths, of safe,raw,scoped (default safe,raw); scoped (perf
                  --scoped, Cq::scope) runs the bandwidth tests only, *_lat tests skip it
  --timeout SECS  limit of the whole guest run (default 2400)";

/// What the command line asked for.
pub(super) struct Plan {
    reps: u32,
    sizes: Vec<u64>,
    tests: Vec<String>,
    /// Our data paths, in `KNOWN_PATHS` order, no duplicates.
    paths: Vec<&'static str>,
    timeout: Duration,
}

/// `--sizes LIST`: positive numbers, comma separated.
fn parse_sizes(list: &str) -> Result<Vec<u64>> {
    list.split(',')
        .map(|s| s.trim().parse::<u64>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::usage("--sizes needs positive numbers, comma separated"))
}

/// `--tests LIST`: names of [`KNOWN_TESTS`].
fn parse_tests(list: &str) -> Result<Vec<String>> {
    let tests: Vec<String> = list.split(',').map(|s| s.trim().to_owned()).collect();
    match tests.iter().find(|t| !KNOWN_TESTS.contains(&t.as_str())) {
        Some(bad) => Err(Error::usage(format!("unknown test {bad:?}\n\n{USAGE}"))),
        None => Ok(tests),
    }
}

/// `--paths LIST`: names of [`KNOWN_PATHS`], returned in that order without duplicates.
fn parse_paths(list: &str) -> Result<Vec<&'static str>> {
    let asked: Vec<&str> = list.split(',').map(str::trim).collect();
    if let Some(bad) = asked.iter().find(|p| !KNOWN_PATHS.contains(p)) {
        return Err(Error::usage(format!("unknown path {bad:?}\n\n{USAGE}")));
    }
    Ok(KNOWN_PATHS
        .iter()
        .copied()
        .filter(|p| asked.contains(p))
        .collect())
}

/// A command line of `--flag VALUE` and `--flag=VALUE` options, read one flag at a time.
pub(crate) struct Flags {
    args: std::vec::IntoIter<String>,
    usage: &'static str,
}

impl Flags {
    /// The arguments, which must be UTF-8; `usage` follows the errors.
    pub(crate) fn new(args: Vec<OsString>, usage: &'static str) -> Result<Flags> {
        let args = args
            .into_iter()
            .map(|a| {
                a.into_string()
                    .map_err(|a| Error::usage(format!("bad argument {a:?}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Flags {
            args: args.into_iter(),
            usage,
        })
    }

    /// The value of `flag`: `inline` (from `--flag=VALUE`), else the next argument.
    pub(crate) fn value(&mut self, flag: &str, inline: Option<String>) -> Result<String> {
        let usage = self.usage;
        inline
            .or_else(|| self.args.next())
            .ok_or_else(|| Error::usage(format!("{flag} needs a value\n\n{usage}")))
    }
}

impl Iterator for Flags {
    /// A flag, and the value written after its `=` if there is one.
    type Item = (String, Option<String>);

    fn next(&mut self) -> Option<(String, Option<String>)> {
        let arg = self.args.next()?;
        Some(match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
            None => (arg, None),
        })
    }
}

/// `--reps N`: a positive number.
pub(crate) fn parse_reps(v: &str) -> Result<u32> {
    v.parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| Error::usage("--reps needs a positive number"))
}

/// `--timeout SECS`.
pub(crate) fn parse_timeout(v: &str) -> Result<Duration> {
    crate::parse_secs(v).map_err(|e| Error::usage(format!("--timeout: {e}")))
}

/// The plan of `cargo xtask compare ARGS`; `None` after `--help`.
fn parse_args(args: Vec<OsString>) -> Result<Option<Plan>> {
    let mut plan = Plan {
        reps: 5,
        sizes: DEFAULT_SIZES.to_vec(),
        tests: DEFAULT_TESTS.iter().map(|s| s.to_string()).collect(),
        paths: DEFAULT_PATHS.to_vec(),
        timeout: Duration::from_secs(2400),
    };
    let mut flags = Flags::new(args, USAGE)?;
    while let Some((flag, inline)) = flags.next() {
        let mut value = || flags.value(&flag, inline.clone());
        match flag.as_str() {
            "--reps" => plan.reps = parse_reps(&value()?)?,
            "--sizes" => plan.sizes = parse_sizes(&value()?)?,
            "--tests" => plan.tests = parse_tests(&value()?)?,
            "--paths" => plan.paths = parse_paths(&value()?)?,
            "--timeout" => plan.timeout = parse_timeout(&value()?)?,
            "-h" | "--help" => {
                say!("{USAGE}");
                return Ok(None);
            }
            other => {
                return Err(Error::usage(format!(
                    "unknown option {other:?} for compare\n\n{USAGE}"
                )));
            }
        }
    }
    Ok(Some(plan))
}

pub(super) fn is_bw(test: &str) -> bool {
    test.ends_with("_bw")
}

/// The sizes `test` runs at: `--sizes`, except for atomics (always 8 bytes).
pub(super) fn sizes_for<'a>(plan: &'a Plan, test: &str) -> &'a [u64] {
    if test == "atomic_bw" {
        &[ATOMIC_SIZE]
    } else {
        &plan.sizes
    }
}

/// How many (test, size) combinations the plan runs.
pub(super) fn combinations(plan: &Plan) -> usize {
    plan.tests.iter().map(|t| sizes_for(plan, t).len()).sum()
}

/// Our data paths `test` runs on: `--paths`, less `scoped` for the latency tests
/// (`perf --scoped` runs the bandwidth tests only).
pub(super) fn paths_for(plan: &Plan, test: &str) -> Vec<&'static str> {
    plan.paths
        .iter()
        .copied()
        .filter(|&p| p != "scoped" || is_bw(test))
        .collect()
}

/// The implementations `test` runs, in the order of the first repetition: perftest, then
/// `paths_for`.
pub(super) fn impls_for(plan: &Plan, test: &str) -> Vec<&'static str> {
    let mut v = vec!["perftest"];
    v.extend(paths_for(plan, test));
    v
}

/// How many (test, size, path) combinations of ours the plan runs.
pub(super) fn path_combinations(plan: &Plan) -> usize {
    plan.tests
        .iter()
        .map(|t| sizes_for(plan, t).len() * paths_for(plan, t).len())
        .sum()
}

/// How many runs (each a server and a client) one repetition makes.
pub(super) fn runs_per_rep(plan: &Plan) -> usize {
    plan.tests
        .iter()
        .map(|t| sizes_for(plan, t).len() * impls_for(plan, t).len())
        .sum()
}

/// Iterations for `test` at `size`: about the same bytes per run at every size.
pub(super) fn iters(test: &str, size: u64) -> u64 {
    if is_bw(test) {
        ((64u64 << 20) / size).clamp(64, 5000)
    } else {
        ((16u64 << 20) / size).clamp(20, 1000)
    }
}

/// `cargo xtask compare [...]`.
pub fn compare_command(args: Vec<OsString>) -> Result<u8> {
    let Some(plan) = parse_args(args)? else {
        return Ok(0);
    };
    let perf = build_perf()?;
    let work = PathBuf::from(format!("/tmp/rdma-verbs-compare.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).context(|| format!("cannot create {}", work.display()))?;
    let code = run_in_guest(&plan, &perf, &work)?;

    let out_dir = crate::target_dir().join("compare");
    let runs_dir = keep_logs(&work, &out_dir)?;
    let (results, failed) = collect(&plan, &runs_dir);
    let rows = rows(&plan, &results);
    print_table(&plan, &rows, &runs_dir);
    let json_path = out_dir.join("compare.json");
    fs::write(&json_path, to_json(&rows))
        .context(|| format!("cannot write {}", json_path.display()))?;
    let svg_path = out_dir.join("compare.svg");
    fs::write(&svg_path, svg(&plan, &rows))
        .context(|| format!("cannot write {}", svg_path.display()))?;
    say!("wrote {} and {}", json_path.display(), svg_path.display());
    let verdict = judge(&plan, &rows, &failed, code);
    for line in &verdict.lines {
        eprintln!("xtask compare: {line}; logs in {}", runs_dir.display());
    }
    Ok(verdict.code)
}

/// How a finished comparison ends: what to print, and the exit status.
#[derive(Debug, PartialEq, Eq)]
struct Verdict {
    /// Warnings and errors, one a line.
    lines: Vec<String>,
    /// 1 when a (test, size, path) combination has no median or the guest
    /// script did not finish; 0 otherwise, also when single repetitions gave
    /// no result (the medians use the others; a warning names them).
    code: u8,
}

/// Judges a comparison from its primary rows, the runs that produced no result and
/// the guest script's exit status.
fn judge(plan: &Plan, rows: &[Row], failed: &[String], script_code: u8) -> Verdict {
    let mut lines = Vec::new();
    if !failed.is_empty() {
        lines.push(format!(
            "warning: {} run(s) produced no result (medians use the other repetitions): {}",
            failed.len(),
            failed.join(", ")
        ));
    }
    let missing = path_combinations(plan) - rows.iter().filter(|r| r.primary).count();
    if missing > 0 {
        lines.push(format!(
            "error: {missing} (test, size, path) combinations have no result"
        ));
    }
    let code = u8::from(missing > 0 || script_code != 0);
    Verdict { lines, code }
}

/// Builds the `perf` example (release); its path.
fn build_perf() -> Result<PathBuf> {
    let root = crate::workspace_root();
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build
        .args(["build", "--release", "--example", "perf"])
        .current_dir(root);
    eprintln!("xtask compare: {}", cmd::display(&build));
    run_checked(&mut build)?;
    Ok(crate::target_dir().join("release/examples/perf"))
}

/// Runs the plan's script in one guest, logs into `work`; the script's exit status.
fn run_in_guest(plan: &Plan, perf: &Path, work: &Path) -> Result<u8> {
    let script = script(plan);
    let runs = runs_per_rep(plan) * plan.reps as usize;
    let scoped_bw_only = if plan.paths.contains(&"scoped") && plan.tests.iter().any(|t| !is_bw(t)) {
        " (scoped: bandwidth tests only)"
    } else {
        ""
    };
    eprintln!(
        "xtask compare: {runs} runs ({} (test, size) pairs x perftest and {}{scoped_bw_only} x {} repetitions) in one guest",
        combinations(plan),
        plan.paths.join(", "),
        plan.reps
    );
    let code = run_script(script, "compare", &[work, perf], plan.timeout)?;
    if code != 0 {
        eprintln!(
            "xtask compare: the guest script ended with status {code}; reporting what finished"
        );
    }
    Ok(code)
}

/// Runs `sh -c SCRIPT NAME ARGS...` in one guest (from the workspace root), at most
/// `timeout`; the script's exit status.
pub(crate) fn run_script(
    script: String,
    name: &str,
    args: &[&Path],
    timeout: Duration,
) -> Result<u8> {
    let mut argv: Vec<OsString> = vec!["-c".into(), script.into(), name.into()];
    argv.extend(args.iter().map(|a| a.as_os_str().to_owned()));
    let mut inv = Invocation::new("sh".into(), argv)?;
    inv.cwd = crate::workspace_root().to_path_buf();
    run::execute(inv, timeout)
}

/// Moves the logs from `work` to `<out_dir>/runs` (emptied first); that folder.
pub(crate) fn keep_logs(work: &Path, out_dir: &Path) -> Result<PathBuf> {
    let runs_dir = out_dir.join("runs");
    let _ = fs::remove_dir_all(&runs_dir);
    fs::create_dir_all(&runs_dir).context(|| format!("cannot create {}", runs_dir.display()))?;
    for entry in fs::read_dir(work).context(|| format!("cannot read {}", work.display()))? {
        let entry = entry.context(|| format!("cannot read {}", work.display()))?;
        let _ = fs::copy(entry.path(), runs_dir.join(entry.file_name()));
    }
    let _ = fs::remove_dir_all(work);
    Ok(runs_dir)
}
