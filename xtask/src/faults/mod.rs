//! `cargo xtask faults`: the fault matrix across two guests on a virtual wire, and the
//! host side of every two-node set (running it, judging it, the table and
//! `target/faults/faults.json`).
//!
//! Each case runs our examples with node 1 as server and node 2 as client ([`crate::wire`]).
//! The matrix's rows are judged here from what both agents recorded:
//! - a clean case passes when both programs exit 0 (the examples verify every byte they
//!   receive, so `lost`, `duplicated` and `corrupted` are 0 exactly when a verified stream
//!   passes; a message lost, duplicated or corrupted on the way would fail the run);
//! - a fault case passes when the survivor exits non-zero on its own (never killed at the
//!   deadline), within the case's bound after the fault, printing the expected error text.

use std::ffi::OsString;
use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod cases;
pub(crate) mod render;
#[cfg(test)]
mod tests;
mod verdict;

use crate::run::{Invocation, execute_pair};
use crate::wire;
use crate::{Error, Result};
pub use cases::matrix;
use render::{print_table, to_json};
use verdict::{add_throughput, judge, read};

/// One row of the table and of faults.json.
pub struct Row {
    /// Scenario, e.g. `kill server`.
    pub scenario: String,
    /// The programs.
    pub program: String,
    /// What must happen.
    pub expected: String,
    /// What happened.
    pub observed: String,
    /// Seconds from the fault to the survivor's exit.
    pub time_to_error_s: Option<f64>,
    /// The survivor's (or failing side's) last output lines.
    pub messages: String,
    /// Messages lost / duplicated / corrupted: 0 when a verified stream passed, else
    /// unknown.
    pub verified_zero: bool,
    /// Kernel objects left behind after both programs exited (both nodes), if known.
    pub leaked: Option<u64>,
    /// Whether the row passed.
    pub pass: bool,
    /// Seconds the client ran (throughput comparisons).
    pub client_s: f64,
}

/// Runs `set` on two guests; returns one row per case.
pub fn run_set(set: &str) -> Result<Vec<Row>> {
    let cases = wire::cases(set)?;
    // Under /tmp, so both guests share it read-write (see `wire`).
    let dir = PathBuf::from(format!("/tmp/rdma-verbs-wire-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|e| Error::new(format!("{}: {e}", dir.display())))?;
    let exe = std::env::current_exe().map_err(|e| Error::new(format!("current_exe: {e}")))?;
    let args: Vec<OsString> = ["wire-agent", "--set", set, "--dir"]
        .map(OsString::from)
        .into_iter()
        .chain([dir.clone().into_os_string()])
        .collect();
    let inv = Invocation::new(exe.into_os_string(), args)?;
    let budget: Duration = cases
        .iter()
        .map(|c| c.limit + Duration::from_secs(15))
        .sum();
    let start = Instant::now();
    let code = execute_pair([&inv, &inv], budget + Duration::from_secs(60))?;
    eprintln!(
        "xtask: two-node set {set}: {} cases in {:.0} s (agents' status {code})",
        cases.len(),
        start.elapsed().as_secs_f64()
    );
    let rows = cases
        .iter()
        .enumerate()
        .map(|(i, c)| judge(c, &read(&dir, i, 1), &read(&dir, i, 2), &dir, i))
        .collect();
    let _ = fs::remove_dir_all(&dir);
    Ok(rows)
}

/// Runs a set, adds the throughput comparison, prints the table and writes
/// `target/faults/<file>`; returns (passed, failed).
pub fn run_and_report(set: &str, file: &str) -> Result<(u64, u64)> {
    let mut rows = run_set(set)?;
    add_throughput(&mut rows);
    print_table(&rows);
    let dir = crate::target_dir().join("faults");
    fs::create_dir_all(&dir).map_err(|e| Error::new(format!("{}: {e}", dir.display())))?;
    let path = dir.join(file);
    fs::write(&path, to_json(&rows)).map_err(|e| Error::new(format!("{}: {e}", path.display())))?;
    let passed = rows.iter().filter(|r| r.pass).count() as u64;
    let failed = rows.len() as u64 - passed;
    say!("wrote {}", path.display());
    Ok((passed, failed))
}

/// `cargo xtask faults [--short]`.
pub fn faults_command(args: Vec<OsString>) -> Result<u8> {
    let mut set = "faults".to_string();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--short") => set = "faults-short".into(),
            Some("--set") => {
                set = it
                    .next()
                    .and_then(|v| v.to_str())
                    .ok_or_else(|| {
                        Error::usage(
                            "--set needs interop, faults-short, ci, faults, faults:WORD|WORD or interop:WORD|WORD",
                        )
                    })?
                    .into()
            }
            _ => return Err(Error::usage(format!("faults: unexpected {a:?}"))),
        }
    }
    let set = set.as_str();
    crate::test::build_examples()?;
    let start = Instant::now();
    let file = if set == "faults" {
        "faults.json".to_string()
    } else {
        let name: String = set
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("{name}.json")
    };
    let (passed, failed) = run_and_report(set, &file)?;
    say!(
        "faults: {passed} passed, {failed} failed ({:.0} s)",
        start.elapsed().as_secs_f64()
    );
    Ok(if failed == 0 { 0 } else { 1 })
}

/// `cargo xtask soak [--minutes N] [--seconds N] [--loss PCT] [--qps N] [--max-size B]`: the
/// verified soak (`examples/soak.rs`) across two guests with `netem loss PCT%` (default 1) on
/// both nodes' eth0, `--qps` QPs (default 4), mixed SEND/WRITE/READ of 1 B to `--max-size`
/// (default 1 MiB); each node
/// prints `rdma res` before and after, and the soak prints its counts and anonymous memory
/// (and fails when that grew by more than 1 MiB after warm-up).
pub fn soak_command(args: Vec<OsString>) -> Result<u8> {
    let mut seconds: u64 = 60;
    let mut loss = "1".to_string();
    let mut qps = "4".to_string();
    let mut max_size = "1048576".to_string();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let mut value = |what: &str| {
            it.next()
                .and_then(|v| v.into_string().ok())
                .ok_or_else(|| Error::usage(format!("{what} needs a value")))
        };
        match a.to_str() {
            Some("--minutes") => {
                seconds = 60
                    * value("--minutes")?
                        .parse::<u64>()
                        .map_err(|_| Error::usage("--minutes: a whole number"))?
            }
            Some("--seconds") => {
                seconds = value("--seconds")?
                    .parse::<u64>()
                    .map_err(|_| Error::usage("--seconds: a whole number"))?
            }
            Some("--loss") => loss = value("--loss")?,
            Some("--qps") => qps = value("--qps")?,
            Some("--max-size") => max_size = value("--max-size")?,
            _ => return Err(Error::usage(format!("soak: unexpected {a:?}"))),
        }
    }
    if loss.parse::<f64>().is_err() || qps.parse::<u32>().is_err() || seconds == 0 {
        return Err(Error::usage(
            "soak: --loss PCT, --qps N, a positive duration",
        ));
    }
    crate::test::build_examples()?;
    let soak = crate::target_dir().join("debug/examples/soak");
    let soak = crate::cmd::quoted(&soak);
    let netem = if loss.parse::<f64>().unwrap_or(0.0) > 0.0 {
        format!("tc qdisc add dev eth0 root netem loss {loss}% || exit 125; ")
    } else {
        String::new()
    };
    let wrap = |cmd: String| {
        format!(
            "{netem}echo \"rdma res before: $(rdma res | tr -s ' ')\"; {cmd}; st=$?; sleep 0.5; \
             echo \"rdma res after:  $(rdma res | tr -s ' ')\"; exit $st"
        )
    };
    let server = wrap(format!("{soak} --server --qps {qps}"));
    let client = wrap(format!(
        "{soak} --client \"$RDMA_VERBS_PEER\" --qps {qps} --seconds {seconds} --max-size {max_size}"
    ));
    let inv = |shell: String| Invocation::new("sh".into(), vec!["-c".into(), shell.into()]);
    let start = Instant::now();
    let code = execute_pair(
        [&inv(server)?, &inv(client)?],
        Duration::from_secs(seconds + 180),
    )?;
    say!(
        "soak: {seconds} s of traffic with {loss}% loss, status {code}, {:.0} s in all",
        start.elapsed().as_secs_f64()
    );
    Ok(code)
}
