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
//! The guest writes its logs to a directory under the host's `/tmp`, which `cargo xtask
//! run` shares read-write with the guest whenever a command argument lies there.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::cmd::{self, run_checked};
use crate::run::{self, Invocation};
use crate::{Context, Error, Result};

/// Default message sizes.
const DEFAULT_SIZES: &[u64] = &[2, 64, 1024, 4096, 65536, 1 << 20];
/// Default tests (perftest's tool is `ib_<test>`).
const DEFAULT_TESTS: &[&str] = &["write_bw", "read_bw", "send_bw", "send_lat"];
/// Every test both tools implement.
const KNOWN_TESTS: &[&str] = &[
    "write_bw",
    "read_bw",
    "send_bw",
    "write_lat",
    "send_lat",
    "read_lat",
    "atomic_bw",
];
/// perftest's `DEF_SIZE_ATOMIC`: the one size of `atomic_bw`.
const ATOMIC_SIZE: u64 = 8;
/// Our data paths `--paths` can name, in table order (`perf --<path>`).
const KNOWN_PATHS: &[&str] = &["safe", "raw", "scoped"];
/// Default `--paths`.
const DEFAULT_PATHS: &[&str] = &["safe", "raw"];
/// Time limit of each side of one run inside the guest, in seconds.
const SIDE_TIMEOUT_SECS: u32 = 180;

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
struct Plan {
    reps: u32,
    sizes: Vec<u64>,
    tests: Vec<String>,
    /// Our data paths, in `KNOWN_PATHS` order, no duplicates.
    paths: Vec<&'static str>,
    timeout: Duration,
}

fn parse_args(args: Vec<OsString>) -> Result<Option<Plan>> {
    let mut plan = Plan {
        reps: 5,
        sizes: DEFAULT_SIZES.to_vec(),
        tests: DEFAULT_TESTS.iter().map(|s| s.to_string()).collect(),
        paths: DEFAULT_PATHS.to_vec(),
        timeout: Duration::from_secs(2400),
    };
    let args: Vec<String> = args
        .into_iter()
        .map(|a| {
            a.into_string()
                .map_err(|a| Error::usage(format!("bad argument {a:?}")))
        })
        .collect::<Result<_>>()?;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v.to_owned())),
            None => (arg.as_str(), None),
        };
        let mut value = || -> Result<String> {
            inline
                .clone()
                .or_else(|| it.next().cloned())
                .ok_or_else(|| Error::usage(format!("{flag} needs a value\n\n{USAGE}")))
        };
        match flag {
            "--reps" => {
                plan.reps = value()?
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| Error::usage("--reps needs a positive number"))?
            }
            "--sizes" => {
                plan.sizes = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<u64>().ok().filter(|&n| n > 0))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        Error::usage("--sizes needs positive numbers, comma separated")
                    })?
            }
            "--tests" => {
                plan.tests = value()?.split(',').map(|s| s.trim().to_owned()).collect();
                if let Some(bad) = plan
                    .tests
                    .iter()
                    .find(|t| !KNOWN_TESTS.contains(&t.as_str()))
                {
                    return Err(Error::usage(format!("unknown test {bad:?}\n\n{USAGE}")));
                }
            }
            "--paths" => {
                let v = value()?;
                let asked: Vec<&str> = v.split(',').map(str::trim).collect();
                if let Some(bad) = asked.iter().find(|p| !KNOWN_PATHS.contains(p)) {
                    return Err(Error::usage(format!("unknown path {bad:?}\n\n{USAGE}")));
                }
                plan.paths = KNOWN_PATHS
                    .iter()
                    .copied()
                    .filter(|p| asked.contains(p))
                    .collect();
            }
            "--timeout" => {
                plan.timeout = crate::parse_secs(&value()?)
                    .map_err(|e| Error::usage(format!("--timeout: {e}")))?
            }
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

fn is_bw(test: &str) -> bool {
    test.ends_with("_bw")
}

/// The sizes `test` runs at: `--sizes`, except for atomics (always 8 bytes).
fn sizes_for<'a>(plan: &'a Plan, test: &str) -> &'a [u64] {
    if test == "atomic_bw" {
        &[ATOMIC_SIZE]
    } else {
        &plan.sizes
    }
}

/// How many (test, size) combinations the plan runs.
fn combinations(plan: &Plan) -> usize {
    plan.tests.iter().map(|t| sizes_for(plan, t).len()).sum()
}

/// Our data paths `test` runs on: `--paths`, less `scoped` for the latency tests
/// (`perf --scoped` runs the bandwidth tests only).
fn paths_for(plan: &Plan, test: &str) -> Vec<&'static str> {
    plan.paths
        .iter()
        .copied()
        .filter(|&p| p != "scoped" || is_bw(test))
        .collect()
}

/// The implementations `test` runs, in the order of the first repetition: perftest, then
/// `paths_for`.
fn impls_for(plan: &Plan, test: &str) -> Vec<&'static str> {
    let mut v = vec!["perftest"];
    v.extend(paths_for(plan, test));
    v
}

/// How many (test, size, path) combinations of ours the plan runs.
fn path_combinations(plan: &Plan) -> usize {
    plan.tests
        .iter()
        .map(|t| sizes_for(plan, t).len() * paths_for(plan, t).len())
        .sum()
}

/// How many runs (each a server and a client) one repetition makes.
fn runs_per_rep(plan: &Plan) -> usize {
    plan.tests
        .iter()
        .map(|t| sizes_for(plan, t).len() * impls_for(plan, t).len())
        .sum()
}

/// Iterations for `test` at `size`: about the same bytes per run at every size.
fn iters(test: &str, size: u64) -> u64 {
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
    let root = crate::workspace_root();
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build
        .args(["build", "--release", "--example", "perf"])
        .current_dir(root);
    eprintln!("xtask compare: {}", cmd::display(&build));
    run_checked(&mut build)?;
    let perf = crate::target_dir().join("release/examples/perf");

    let work = PathBuf::from(format!("/tmp/rdma-verbs-compare.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).context(|| format!("cannot create {}", work.display()))?;
    let script = script(&plan);
    let runs = runs_per_rep(&plan) * plan.reps as usize;
    let scoped_bw_only = if plan.paths.contains(&"scoped") && plan.tests.iter().any(|t| !is_bw(t)) {
        " (scoped: bandwidth tests only)"
    } else {
        ""
    };
    eprintln!(
        "xtask compare: {runs} runs ({} (test, size) pairs x perftest and {}{scoped_bw_only} x {} repetitions) in one guest",
        combinations(&plan),
        plan.paths.join(", "),
        plan.reps
    );
    let mut inv = Invocation::new(
        "sh".into(),
        vec![
            "-c".into(),
            script.into(),
            "compare".into(),
            work.clone().into(),
            perf.into(),
        ],
    )?;
    inv.cwd = root.to_path_buf();
    let code = run::execute(inv, plan.timeout)?;
    if code != 0 {
        eprintln!(
            "xtask compare: the guest script ended with status {code}; reporting what finished"
        );
    }

    let out_dir = crate::target_dir().join("compare");
    let runs_dir = out_dir.join("runs");
    let _ = fs::remove_dir_all(&runs_dir);
    fs::create_dir_all(&runs_dir).context(|| format!("cannot create {}", runs_dir.display()))?;
    for entry in fs::read_dir(&work).context(|| format!("cannot read {}", work.display()))? {
        let entry = entry.context(|| format!("cannot read {}", work.display()))?;
        let _ = fs::copy(entry.path(), runs_dir.join(entry.file_name()));
    }
    let _ = fs::remove_dir_all(&work);

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
    let missing = path_combinations(&plan) - rows.iter().filter(|r| r.primary).count();
    if !failed.is_empty() {
        eprintln!(
            "xtask compare: {} run(s) produced no result (medians use the others): {}; logs in {}",
            failed.len(),
            failed.join(", "),
            runs_dir.display()
        );
    }
    if missing > 0 || !failed.is_empty() {
        eprintln!(
            "xtask compare: {missing} (test, size, path) combinations have no result; see {}",
            runs_dir.display()
        );
        return Ok(1);
    }
    Ok(if code == 0 { 0 } else { 1 })
}

/// The guest script: `sh -c SCRIPT compare OUTDIR PERF`.
fn script(plan: &Plan) -> String {
    let mut s = String::from(
        "set -u\n\
         OUT=$1; PERF=$2\n\
         DEV=${RDMA_VERBS_DEVICE:-rxe0}; ADDR=${RDMA_VERBS_ADDR:-10.99.0.1}\n\
         # Wait until a server listens on TCP port 18515 (0x4853), at most 30 s.\n\
         listening() {\n\
         \x20 i=0\n\
         \x20 until grep -q ':4853 00000000:0000 0A' /proc/net/tcp; do\n\
         \x20   i=$((i + 1)); [ $i -lt 600 ] || return 1; sleep 0.05\n\
         \x20 done\n\
         }\n\
         # job NAME IMPL TEST SIZE ITERS\n\
         job() {\n\
         \x20 name=$1; impl=$2; t=$3; s=$4; n=$5\n\
         \x20 common=\"-d $DEV -x 1 -F -s $s -n $n\"\n\
         \x20 if [ \"$impl\" = perftest ]; then\n\
         \x20   srv=\"ib_$t $common\"; cli=\"ib_$t $common --out_json --out_json_file=$OUT/$name.json $ADDR\"\n\
         \x20 else\n\
         \x20   srv=\"$PERF $t $common --$impl\"; cli=\"$PERF $t $common --$impl --out_json --out_json_file=$OUT/$name.json $ADDR\"\n\
         \x20 fi\n",
    );
    let t = SIDE_TIMEOUT_SECS;
    let _ = write!(
        s,
        "\x20 timeout {t} $srv > \"$OUT/$name.server.txt\" 2>&1 &\n\
         \x20 spid=$!\n\
         \x20 if listening; then\n\
         \x20   timeout {t} $cli > \"$OUT/$name.client.txt\" 2>&1; crc=$?\n\
         \x20 else\n\
         \x20   crc=98; kill $spid 2>/dev/null\n\
         \x20 fi\n\
         \x20 wait $spid; src=$?\n\
         \x20 echo \"$name $crc $src\" >> \"$OUT/status\"\n\
         \x20 echo \"[compare] $name: client $crc, server $src\"\n\
         }}\n"
    );
    for rep in 0..plan.reps {
        // The first implementation moves on by one from each (test, size) to the next and
        // from each repetition to the next, so that over the repetitions every one takes
        // every place (whatever the number of combinations modulo the implementations).
        let mut k = rep as usize;
        for test in &plan.tests {
            for &size in sizes_for(plan, test) {
                let n = iters(test, size);
                let impls = impls_for(plan, test);
                for j in 0..impls.len() {
                    let imp = impls[(j + k) % impls.len()];
                    let name = format!("{test}_{size}_{imp}_{rep}");
                    let _ = writeln!(s, "job {name} {imp} {test} {size} {n}");
                }
                k += 1;
            }
        }
    }
    s.push_str("echo '[compare] done'\n");
    s
}

/// One run's numbers: bandwidth tests `[bw_avg MiB/s, Mpps]`, latency `[t_typical, p99]`.
type Numbers = [f64; 2];

/// (test, size, impl) -> the numbers of each repetition that finished.
type Results = BTreeMap<(String, u64, String), Vec<Numbers>>;

/// Reads every run's output.
/// The parsed results, and the names of the runs that produced none (a
/// failed repetition must not vanish into a median of the others).
fn collect(plan: &Plan, dir: &Path) -> (Results, Vec<String>) {
    let mut out = Results::new();
    let mut failed = Vec::new();
    for rep in 0..plan.reps {
        for test in &plan.tests {
            for &size in sizes_for(plan, test) {
                for imp in impls_for(plan, test) {
                    let name = format!("{test}_{size}_{imp}_{rep}");
                    let got = if imp == "perftest" {
                        fs::read_to_string(dir.join(format!("{name}.client.txt")))
                            .ok()
                            .and_then(|t| parse_perftest(&t, is_bw(test), size))
                    } else {
                        fs::read_to_string(dir.join(format!("{name}.json")))
                            .ok()
                            .and_then(|t| parse_ours(&t, is_bw(test)))
                    };
                    match got {
                        Some(n) => out
                            .entry((test.clone(), size, imp.to_string()))
                            .or_default()
                            .push(n),
                        None => failed.push(name),
                    }
                }
            }
        }
    }
    (out, failed)
}

/// perftest's result line (the first line after the `#bytes` header).
fn parse_perftest(text: &str, bw: bool, size: u64) -> Option<Numbers> {
    let mut lines = text.lines().skip_while(|l| !l.contains("#bytes"));
    lines.next()?;
    let line = lines.find(|l| !l.trim().is_empty())?;
    let v: Vec<f64> = line
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    if bw {
        let (avg, mpps) = (*v.get(3)?, *v.get(4)?);
        // Both columns come from the same time base (bw = mpps * 1e6 * size / 2^20); use
        // whichever was printed with the smaller relative rounding error (perftest prints
        // the bandwidth with 2 decimals, the message rate with 6).
        if avg <= 0.0 && mpps <= 0.0 {
            return None;
        }
        let avg_is_finer = mpps <= 0.0 || (avg > 0.0 && 0.005 / avg < 0.000_000_5 / mpps);
        let (bw, mpps) = if avg_is_finer {
            (avg, avg * 1_048_576.0 / size as f64 / 1e6)
        } else {
            (mpps * 1e6 * size as f64 / 1_048_576.0, mpps)
        };
        (bw > 0.0 && bw.is_finite() && mpps.is_finite()).then_some([bw, mpps])
    } else {
        // A run whose clock check failed prints `inf` and `-nan` (perftest's
        // "Correlation coefficient r^2 < 0.9") and exits 0: no result, not a
        // latency of infinity (whose ratio would read 0 and meet the target).
        let (typ, p99) = (*v.get(4)?, *v.get(7)?);
        (typ > 0.0 && typ.is_finite() && p99.is_finite()).then_some([typ, p99])
    }
}

/// `perf --out_json`'s first result.
fn parse_ours(text: &str, bw: bool) -> Option<Numbers> {
    let json = Json::parse(text)?;
    let r = json.get("results")?.index(0)?;
    let n = if bw {
        [r.get("bw_avg")?.num()?, r.get("msg_rate_mpps")?.num()?]
    } else {
        [r.get("t_typical")?.num()?, r.get("p99")?.num()?]
    };
    (n[0] > 0.0 && n.iter().all(|v| v.is_finite())).then_some(n)
}

/// One row of compare.json.
struct Row {
    test: String,
    path: &'static str,
    size: u64,
    unit: &'static str,
    ours: f64,
    perftest: f64,
    /// perftest's own spread over the repetitions: (max - min) / median.
    perftest_spread: f64,
    /// The metric the plot shows (bandwidth, or typical latency).
    primary: bool,
}

impl Row {
    fn ratio(&self) -> f64 {
        self.ours / self.perftest
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// (max - min) / median: how much one implementation varies between repetitions.
fn spread(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    let min = v.iter().copied().fold(f64::MAX, f64::min);
    (max - min) / median(v)
}

fn rows(plan: &Plan, results: &Results) -> Vec<Row> {
    let mut rows = Vec::new();
    for test in &plan.tests {
        let units: [&'static str; 2] = if is_bw(test) {
            ["MB/sec", "Mpps"]
        } else {
            ["t_typical usec", "p99 usec"]
        };
        for &size in sizes_for(plan, test) {
            let Some(pt) = results.get(&(test.clone(), size, "perftest".to_string())) else {
                continue;
            };
            for path in paths_for(plan, test) {
                let Some(ours) = results.get(&(test.clone(), size, path.to_string())) else {
                    continue;
                };
                for (m, unit) in units.iter().enumerate() {
                    let o: Vec<f64> = ours.iter().map(|n| n[m]).collect();
                    let p: Vec<f64> = pt.iter().map(|n| n[m]).collect();
                    rows.push(Row {
                        test: test.clone(),
                        path,
                        size,
                        unit,
                        ours: median(&o),
                        perftest: median(&p),
                        perftest_spread: spread(&p),
                        primary: m == 0,
                    });
                }
            }
        }
    }
    rows
}

fn find<'a>(rows: &'a [Row], test: &str, path: &str, size: u64, unit: &str) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.test == test && r.path == path && r.size == size && r.unit == unit)
}

/// The ratio columns between two of our paths (`a/b`) the table shows, of those `--paths`
/// names.
fn path_pairs(plan: &Plan) -> Vec<(&'static str, &'static str)> {
    [("safe", "raw"), ("scoped", "safe"), ("scoped", "raw")]
        .into_iter()
        .filter(|(a, b)| plan.paths.contains(a) && plan.paths.contains(b))
        .collect()
}

/// Prints [`table`].
fn print_table(plan: &Plan, rows: &[Row], runs_dir: &Path) {
    let text = table(plan, rows, runs_dir);
    say!("{}", text.strip_suffix('\n').unwrap_or(&text));
}

/// The printed table, its targets and where the logs are.
fn table(plan: &Plan, rows: &[Row], runs_dir: &Path) -> String {
    let mut out = String::new();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "perftest vs rdma-verbs `perf` (soft-RoCE rxe0 in a TCG guest; median of {} repetition(s))",
        plan.reps
    );
    let pairs = path_pairs(plan);
    let mut header = format!(
        "{:<9} {:>8} {:<15} {:>12} {:>8}",
        "test", "size", "unit", "perftest", "spread"
    );
    for path in &plan.paths {
        let _ = write!(header, " {path:>12} {:>7}", "ratio");
    }
    for (a, b) in &pairs {
        let _ = write!(header, " {:>11}", format!("{a}/{b}"));
    }
    let _ = writeln!(out, "{header}");
    let mut misses = Vec::new();
    for test in &plan.tests {
        for &size in sizes_for(plan, test) {
            let units: &[&str] = if is_bw(test) {
                &["MB/sec", "Mpps"]
            } else {
                &["t_typical usec", "p99 usec"]
            };
            for unit in units {
                let ours: Vec<Option<&Row>> = plan
                    .paths
                    .iter()
                    .map(|p| find(rows, test, p, size, unit))
                    .collect();
                let any = ours.iter().flatten().next();
                let pt = any.map_or("-".to_owned(), |r| format!("{:.4}", r.perftest));
                let pt_spread = any.map_or("-".to_owned(), |r| {
                    format!("{:.0}%", r.perftest_spread * 100.0)
                });
                let mut line = format!("{test:<9} {size:>8} {unit:<15} {pt:>12} {pt_spread:>8}");
                for r in &ours {
                    let cell = r.map_or("-".to_owned(), |r| format!("{:.4}", r.ours));
                    let ratio = r.map_or("-".to_owned(), |r| format!("{:.2}", r.ratio()));
                    let _ = write!(line, " {cell:>12} {ratio:>7}");
                }
                for (a, b) in &pairs {
                    let cell = match (
                        find(rows, test, a, size, unit),
                        find(rows, test, b, size, unit),
                    ) {
                        (Some(a), Some(b)) => format!("{:.3}", a.ours / b.ours),
                        _ => "-".to_owned(),
                    };
                    let _ = write!(line, " {cell:>11}");
                }
                let _ = writeln!(out, "{line}");
                for r in ours.into_iter().flatten() {
                    let ok = if is_bw(test) {
                        r.ratio() >= 1.0
                    } else {
                        r.ratio() <= 1.0
                    };
                    if !ok {
                        misses.push(format!(
                            "{test} {size} B {unit} {}: ratio {:.2} (target {} 1.00)",
                            r.path,
                            r.ratio(),
                            if is_bw(test) { ">=" } else { "<=" }
                        ));
                    }
                }
            }
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "targets: bandwidth/message rate ours/perftest >= 1.00, latency <= 1.00, safe (and scoped) vs raw within 3% at 2 B"
    );
    if misses.is_empty() {
        let _ = writeln!(out, "  every ours/perftest target met");
    } else {
        let _ = writeln!(out, "  missed ({}):", misses.len());
        for m in &misses {
            let _ = writeln!(out, "    {m}");
        }
    }
    for test in plan.tests.iter().filter(|t| is_bw(t)) {
        let small = if test == "atomic_bw" { ATOMIC_SIZE } else { 2 };
        for path in ["safe", "scoped"] {
            if let (Some(s), Some(r)) = (
                find(rows, test, path, small, "Mpps"),
                find(rows, test, "raw", small, "Mpps"),
            ) {
                let d = (s.ours / r.ours - 1.0) * 100.0;
                let _ = writeln!(
                    out,
                    "  {test} {small} B {path} vs raw message rate: {d:+.1}% ({})",
                    if d.abs() <= 3.0 {
                        "within 3%"
                    } else {
                        "outside 3%"
                    }
                );
            }
        }
    }
    let lat: Vec<&str> = plan
        .tests
        .iter()
        .filter(|t| !is_bw(t))
        .map(String::as_str)
        .collect();
    if plan.paths.contains(&"scoped") && !lat.is_empty() {
        let _ = writeln!(
            out,
            "  no scoped runs for {} (perf --scoped runs the bandwidth tests only)",
            lat.join(", ")
        );
    }
    let _ = writeln!(out, "logs: {}", runs_dir.display());
    out
}

fn to_json(rows: &[Row]) -> String {
    let mut s = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {{\"test\": \"{}\", \"path\": \"{}\", \"size\": {}, \"unit\": \"{}\", \"ours\": {}, \"perftest\": {}, \"ratio\": {}}}{}",
            r.test,
            r.path,
            r.size,
            r.unit,
            json_num(r.ours),
            json_num(r.perftest),
            json_num(r.ratio()),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("]\n");
    s
}

fn json_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".to_owned()
    }
}

/// The plot's colour of each of `--paths`.
fn path_colors(plan: &Plan) -> Vec<(&'static str, &'static str)> {
    [
        ("safe", "#1f77b4"),
        ("raw", "#ff7f0e"),
        ("scoped", "#2ca02c"),
    ]
    .into_iter()
    .filter(|(p, _)| plan.paths.contains(p))
    .collect()
}

/// A plot of ours/perftest against size: one panel per test, a line per data path
/// (bandwidth tests: MiB/s ratio, higher is better; latency: typical-latency ratio, lower
/// is better), a dashed line at parity.
fn svg(plan: &Plan, rows: &[Row]) -> String {
    const PW: f64 = 420.0;
    const PH: f64 = 260.0;
    const M: f64 = 50.0;
    let cols = 2usize;
    let panels = plan.tests.len().max(1);
    let nrows = panels.div_ceil(cols);
    let (w, h) = (
        cols as f64 * (PW + M) + M,
        nrows as f64 * (PH + 2.0 * M) + 40.0,
    );
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{M}\" y=\"24\" font-size=\"15\">rdma-verbs perf / perftest (soft-RoCE, TCG guest; median of {} runs)</text>\n",
        plan.reps
    );
    let all_sizes = || plan.tests.iter().flat_map(|t| sizes_for(plan, t)).copied();
    let (lo_size, hi_size) = (
        all_sizes().min().unwrap_or(2).max(1) as f64,
        all_sizes().max().unwrap_or(2).max(2) as f64,
    );
    let span = (hi_size.log2() - lo_size.log2()).max(1.0);
    for (i, test) in plan.tests.iter().enumerate() {
        let (x0, y0) = (
            M + (i % cols) as f64 * (PW + M),
            40.0 + M + (i / cols) as f64 * (PH + 2.0 * M),
        );
        let unit = if is_bw(test) {
            "MB/sec"
        } else {
            "t_typical usec"
        };
        let pts: Vec<&Row> = rows
            .iter()
            .filter(|r| &r.test == test && r.unit == unit)
            .collect();
        let ratios: Vec<f64> = pts
            .iter()
            .map(|r| r.ratio())
            .filter(|v| v.is_finite())
            .collect();
        let ymin = ratios.iter().copied().fold(0.8f64, f64::min).min(0.8) - 0.05;
        let ymax = ratios.iter().copied().fold(1.2f64, f64::max).max(1.2) + 0.05;
        let x = |size: f64| x0 + (size.log2() - lo_size.log2()) / span * PW;
        let y = |v: f64| y0 + PH - (v - ymin) / (ymax - ymin) * PH;
        let better = if is_bw(test) {
            "higher is better"
        } else {
            "lower is better"
        };
        let _ = writeln!(
            s,
            "<text x=\"{x0}\" y=\"{}\" font-size=\"13\">{test}: {unit} ours/perftest ({better})</text>\n\
             <rect x=\"{x0}\" y=\"{y0}\" width=\"{PW}\" height=\"{PH}\" fill=\"none\" stroke=\"#888\"/>\n\
             <line x1=\"{x0}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#444\" stroke-dasharray=\"4 3\"/>",
            y0 - 8.0,
            y(1.0),
            x0 + PW,
            y(1.0)
        );
        // y ticks
        let mut t = (ymin * 10.0).ceil() / 10.0;
        while t <= ymax {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{t:.1}</text>",
                x0 - 4.0,
                y(t) + 4.0
            );
            t += if ymax - ymin > 2.0 { 0.5 } else { 0.1 };
        }
        // x ticks
        for &size in sizes_for(plan, test) {
            let label = if size >= 1 << 20 {
                format!("{}M", size >> 20)
            } else if size >= 1024 {
                format!("{}K", size >> 10)
            } else {
                size.to_string()
            };
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>",
                x(size as f64),
                y0 + PH + 14.0
            );
        }
        for (path, color) in path_colors(plan) {
            let line: Vec<String> = pts
                .iter()
                .filter(|r| r.path == path && r.ratio().is_finite())
                .map(|r| format!("{:.1},{:.1}", x(r.size as f64), y(r.ratio())))
                .collect();
            if !line.is_empty() {
                let _ = writeln!(
                    s,
                    "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"/>",
                    line.join(" ")
                );
                for p in &line {
                    let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
                    let _ = writeln!(
                        s,
                        "<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"{color}\"/>"
                    );
                }
            }
        }
    }
    let ly = h - 14.0;
    let mut lx = M;
    for (path, color) in path_colors(plan) {
        let _ = writeln!(
            s,
            "<rect x=\"{lx}\" y=\"{}\" width=\"12\" height=\"4\" fill=\"{color}\"/><text x=\"{}\" y=\"{ly}\">{path} path</text>",
            ly - 4.0,
            lx + 16.0
        );
        lx += 90.0;
    }
    let _ = writeln!(
        s,
        "<text x=\"{lx}\" y=\"{ly}\">x: message size (bytes, log scale); dashed: parity</text>"
    );
    s.push_str("</svg>\n");
    s
}

/// A minimal JSON value, enough to read `perf --out_json` (xtask uses only std).
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Num(f64),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    fn parse(text: &str) -> Option<Json> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value()?;
        p.ws();
        (p.i == p.s.len()).then_some(v)
    }

    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    fn index(&self, i: usize) -> Option<&Json> {
        match self {
            Json::Arr(v) => v.get(i),
            _ => None,
        }
    }

    fn num(&self) -> Option<f64> {
        match self {
            Json::Num(n) => Some(*n),
            _ => None,
        }
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Option<()> {
        self.ws();
        (self.s.get(self.i) == Some(&b)).then(|| self.i += 1)
    }

    fn lit(&mut self, word: &str, v: Json) -> Option<Json> {
        self.s[self.i..].starts_with(word.as_bytes()).then(|| {
            self.i += word.len();
            v
        })
    }

    fn value(&mut self) -> Option<Json> {
        self.ws();
        match *self.s.get(self.i)? {
            b'{' => {
                self.i += 1;
                let mut kv = Vec::new();
                if self.eat(b'}').is_some() {
                    return Some(Json::Obj(kv));
                }
                loop {
                    self.ws();
                    let Json::Str(k) = self.string()? else {
                        return None;
                    };
                    self.eat(b':')?;
                    kv.push((k, self.value()?));
                    if self.eat(b',').is_none() {
                        self.eat(b'}')?;
                        return Some(Json::Obj(kv));
                    }
                }
            }
            b'[' => {
                self.i += 1;
                let mut v = Vec::new();
                if self.eat(b']').is_some() {
                    return Some(Json::Arr(v));
                }
                loop {
                    v.push(self.value()?);
                    if self.eat(b',').is_none() {
                        self.eat(b']')?;
                        return Some(Json::Arr(v));
                    }
                }
            }
            b'"' => self.string(),
            b't' => self.lit("true", Json::Bool(true)),
            b'f' => self.lit("false", Json::Bool(false)),
            b'n' => self.lit("null", Json::Null),
            _ => {
                let start = self.i;
                while self
                    .s
                    .get(self.i)
                    .is_some_and(|c| c.is_ascii_digit() || b"+-.eE".contains(c))
                {
                    self.i += 1;
                }
                std::str::from_utf8(&self.s[start..self.i])
                    .ok()?
                    .parse()
                    .ok()
                    .map(Json::Num)
            }
        }
    }

    fn string(&mut self) -> Option<Json> {
        if self.s.get(self.i) != Some(&b'"') {
            return None;
        }
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let c = *self.s.get(self.i)?;
            self.i += 1;
            match c {
                b'"' => return String::from_utf8(out).ok().map(Json::Str),
                b'\\' => {
                    let e = *self.s.get(self.i)?;
                    self.i += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'u' => {
                            let hex = std::str::from_utf8(self.s.get(self.i..self.i + 4)?).ok()?;
                            self.i += 4;
                            let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                            out.extend_from_slice(ch.to_string().as_bytes());
                        }
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_perftest_tables() {
        let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                  2          5000             0.10               0.09   \t\t   0.045376\n";
        let n = parse_perftest(bw, true, 2).unwrap();
        assert!((n[1] - 0.045376).abs() < 1e-9);
        assert!((n[0] - 0.045376 * 2e6 / 1_048_576.0).abs() < 1e-9);
        let big = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                   1048576    64               52.84              49.50  \t\t   0.000050\n";
        let n = parse_perftest(big, true, 1 << 20).unwrap();
        assert_eq!(n[0], 49.50);
        assert!((n[1] - 49.5e-6).abs() < 1e-12);
        let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
                   2       1000          7.23           20846.16      9.06     \t       104.69      \t441.65 \t\t2471.77 \t\t20846.16\n";
        assert_eq!(parse_perftest(lat, false, 2).unwrap(), [9.06, 2471.77]);
        assert!(parse_perftest("Couldn't connect", true, 2).is_none());
        // perftest's output when its clock check failed (exit status 0).
        let failed = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
                      4096    1000          inf            inf          inf          inf          -nan         inf          inf\n";
        assert!(parse_perftest(failed, false, 4096).is_none());
    }

    #[test]
    fn parses_our_json() {
        let text = r#"{"test": "write_bw", "x": [1, -2.5e3, true, null, "a\"b\u0041"],
            "results": [{"size": 2, "bw_avg": 0.5, "msg_rate_mpps": 0.25}]}"#;
        assert_eq!(parse_ours(text, true), Some([0.5, 0.25]));
        let j = Json::parse(text).unwrap();
        assert_eq!(
            j.get("x").unwrap().index(4),
            Some(&Json::Str("a\"bA".into()))
        );
        assert_eq!(j.get("x").unwrap().index(1).unwrap().num(), Some(-2500.0));
        assert!(Json::parse("{\"a\": }").is_none());
    }

    #[test]
    fn script_is_valid_shell_and_rotates() {
        let plan = Plan {
            reps: 2,
            sizes: vec![2, 65536],
            tests: vec!["write_bw".into(), "send_lat".into()],
            paths: DEFAULT_PATHS.to_vec(),
            timeout: Duration::from_secs(1),
        };
        let s = script(&plan);
        let ok = Command::new("sh").args(["-n", "-c", &s]).status();
        assert!(ok.is_ok_and(|st| st.success()), "{s}");
        assert_eq!(s.matches("\njob ").count(), 2 * 2 * 2 * 3);
        assert!(s.contains("job write_bw_2_perftest_0 perftest write_bw 2 5000"));
        assert!(s.contains("job write_bw_65536_safe_0 safe write_bw 65536 1024"));
        assert!(s.contains("send_lat_65536_raw_1 raw send_lat 65536 256"));
        assert!(!s.contains("scoped"));
        assert_eq!(runs_per_rep(&plan), 2 * 2 * 3);
    }

    /// The implementations of one (test, size) in the script's order, per repetition.
    fn order(s: &str, test: &str, size: u64, reps: u32) -> Vec<Vec<String>> {
        (0..reps)
            .map(|rep| {
                s.lines()
                    .filter_map(|l| l.strip_prefix("job "))
                    .map(|l| l.split(' ').collect::<Vec<_>>())
                    .filter(|w| {
                        w[2] == test
                            && w[3] == size.to_string()
                            && w[0].ends_with(&format!("_{rep}"))
                    })
                    .map(|w| w[1].to_owned())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn script_rotates_with_scoped_and_lat_tests_never_get_it() {
        let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
        // 4 (test, size) combinations per repetition and 4 implementations of write_bw: a
        // rotation by combination alone would give write_bw the same order every time.
        let plan = parse_args(args(
            "--reps 4 --tests write_bw,send_lat --sizes 2,65536 --paths scoped,safe,raw",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(plan.paths, ["safe", "raw", "scoped"]);
        let s = script(&plan);
        let ok = Command::new("sh").args(["-n", "-c", &s]).status();
        assert!(ok.is_ok_and(|st| st.success()), "{s}");
        // write_bw: 2 sizes x 4 impls; send_lat: 2 sizes x 3.
        assert_eq!(runs_per_rep(&plan), 8 + 6);
        assert_eq!(s.matches("\njob ").count(), 4 * (8 + 6));
        assert_eq!(path_combinations(&plan), 2 * 3 + 2 * 2);
        assert!(s.contains("job write_bw_65536_scoped_0 scoped write_bw 65536 1024"));
        assert!(s.contains("--$impl"), "perf runs with --scoped");
        for line in s.lines().filter(|l| l.starts_with("job send_lat")) {
            assert!(!line.contains("scoped"), "{line}");
        }
        assert_eq!(paths_for(&plan, "send_lat"), ["safe", "raw"]);
        assert_eq!(paths_for(&plan, "read_lat"), ["safe", "raw"]);
        assert_eq!(paths_for(&plan, "read_bw"), ["safe", "raw", "scoped"]);
        // Every repetition runs each implementation once, and each takes every place in
        // turn (the rotation includes scoped).
        for (test, size, n) in [
            ("write_bw", 2, 4),
            ("write_bw", 65536, 4),
            ("send_lat", 2, 3),
            ("send_lat", 65536, 3),
        ] {
            let reps = order(&s, test, size, plan.reps);
            for r in &reps {
                let mut sorted = r.clone();
                sorted.sort();
                sorted.dedup();
                assert_eq!(sorted.len(), n, "{test} {size}: {r:?}");
                assert_eq!(r.len(), n, "{test} {size}: {r:?}");
            }
            for place in 0..n {
                let mut at: Vec<&String> = reps.iter().map(|r| &r[place]).collect();
                at.sort();
                at.dedup();
                assert_eq!(
                    at.len(),
                    n.min(plan.reps as usize),
                    "{test} {size}: {reps:?}"
                );
            }
        }
        let atomic = parse_args(args(
            "--reps 1 --tests atomic_bw,read_lat --paths raw,scoped",
        ))
        .unwrap()
        .unwrap();
        let s = script(&atomic);
        assert!(s.contains("job atomic_bw_8_scoped_0 scoped atomic_bw 8 5000"));
        assert!(!s.contains("job atomic_bw_8_safe_0"));
        assert!(!s.contains("job read_lat_2_scoped"));
        assert!(s.contains("job read_lat_2_raw_0 raw read_lat 2 1000"));
        assert!(parse_args(args("--paths safe,fast")).is_err());
        let plan = parse_args(args("--paths scoped")).unwrap().unwrap();
        assert_eq!(plan.paths, ["scoped"]);
        assert_eq!(path_pairs(&plan), []);
        let plan = parse_args(args("")).unwrap().unwrap();
        assert_eq!(plan.paths, ["safe", "raw"]);
        assert_eq!(path_pairs(&plan), [("safe", "raw")]);
    }

    #[test]
    fn scoped_results_make_rows_and_json() {
        let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
        let plan = parse_args(args(
            "--reps 1 --tests write_bw,send_lat --sizes 2 --paths safe,raw,scoped",
        ))
        .unwrap()
        .unwrap();
        let mut results = Results::new();
        for (test, imp, n) in [
            ("write_bw", "perftest", [1.0, 0.5]),
            ("write_bw", "safe", [0.9, 0.45]),
            ("write_bw", "raw", [1.0, 0.5]),
            ("write_bw", "scoped", [1.1, 0.55]),
            ("send_lat", "perftest", [10.0, 20.0]),
            ("send_lat", "safe", [11.0, 22.0]),
            ("send_lat", "raw", [10.0, 20.0]),
        ] {
            results.insert((test.to_owned(), 2, imp.to_owned()), vec![n]);
        }
        let rows = rows(&plan, &results);
        assert_eq!(
            rows.iter().filter(|r| r.primary).count(),
            path_combinations(&plan)
        );
        let r = find(&rows, "write_bw", "scoped", 2, "MB/sec").unwrap();
        assert!((r.ratio() - 1.1).abs() < 1e-9);
        assert!(find(&rows, "send_lat", "scoped", 2, "t_typical usec").is_none());
        let json = to_json(&rows);
        assert!(json.contains(
            "{\"test\": \"write_bw\", \"path\": \"scoped\", \"size\": 2, \"unit\": \"MB/sec\""
        ));
        assert!(Json::parse(&json).is_some());
        let svg = svg(&plan, &rows);
        assert!(svg.contains("scoped path"));
        assert_eq!(svg.matches("<polyline").count(), 3 + 2);
    }

    /// A plan of two tests at two sizes with all three paths, and rows with a missing
    /// scoped result, a missed target and a NaN.
    fn fixed_plan_and_rows() -> (Plan, Vec<Row>) {
        let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
        let plan = parse_args(args(
            "--reps 2 --tests write_bw,send_lat --sizes 2,65536 --paths safe,raw,scoped",
        ))
        .unwrap()
        .unwrap();
        let mut results = Results::new();
        for (test, size, imp, a, b) in [
            ("write_bw", 2, "perftest", [1.0, 0.5], [1.2, 0.6]),
            ("write_bw", 2, "safe", [0.9, 0.45], [1.0, 0.5]),
            ("write_bw", 2, "raw", [1.0, 0.5], [1.0, 0.5]),
            ("write_bw", 2, "scoped", [1.1, 0.55], [1.3, 0.65]),
            (
                "write_bw",
                65536,
                "perftest",
                [900.0, 0.014],
                [910.0, 0.0145],
            ),
            ("write_bw", 65536, "safe", [905.0, 0.0141], [915.5, 0.0146]),
            ("write_bw", 65536, "raw", [f64::NAN, 0.0], [f64::NAN, 0.0]),
            ("send_lat", 2, "perftest", [10.0, 20.0], [12.0, 22.0]),
            ("send_lat", 2, "safe", [11.0, 22.0], [11.5, 23.0]),
            ("send_lat", 2, "raw", [10.0, 20.0], [9.5, 19.0]),
            ("send_lat", 65536, "perftest", [30.0, 40.0], [31.0, 41.0]),
            ("send_lat", 65536, "safe", [29.0, 39.5], [30.0, 40.0]),
        ] {
            results.insert((test.to_owned(), size, imp.to_owned()), vec![a, b]);
        }
        let rows = rows(&plan, &results);
        (plan, rows)
    }

    #[test]
    fn renderers_are_pinned() {
        let (plan, rows) = fixed_plan_and_rows();
        let pinned = crate::pinned::assert_pinned;
        pinned(
            "compare.table.txt",
            &table(&plan, &rows, Path::new("/runs")),
        );
        pinned("compare.json", &to_json(&rows));
        pinned("compare.svg", &svg(&plan, &rows));
    }

    #[test]
    fn atomic_bw_is_optional_and_runs_at_8_bytes_only() {
        let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
        let plan = parse_args(args("")).unwrap().unwrap();
        assert!(!plan.tests.iter().any(|t| t == "atomic_bw"));
        let plan = parse_args(args("--tests atomic_bw,write_bw --sizes 2,65536 --reps 1"))
            .unwrap()
            .unwrap();
        assert_eq!(plan.tests, ["atomic_bw", "write_bw"]);
        assert_eq!(sizes_for(&plan, "atomic_bw"), [8]);
        assert_eq!(sizes_for(&plan, "write_bw"), [2, 65536]);
        assert_eq!(combinations(&plan), 3);
        let s = script(&plan);
        let ok = Command::new("sh").args(["-n", "-c", &s]).status();
        assert!(ok.is_ok_and(|st| st.success()), "{s}");
        assert_eq!(s.matches("\njob atomic_bw_").count(), 3);
        assert!(s.contains("job atomic_bw_8_perftest_0 perftest atomic_bw 8 5000"));
        assert!(s.contains("job atomic_bw_8_safe_0 safe atomic_bw 8 5000"));
        assert!(s.contains("job atomic_bw_8_raw_0 raw atomic_bw 8 5000"));
        assert!(!s.contains("atomic_bw_2_"));
        assert!(parse_args(args("--tests atomic_lat")).is_err());
    }

    #[test]
    fn iterations_scale_with_size() {
        assert_eq!(iters("write_bw", 2), 5000);
        assert_eq!(iters("read_bw", 1 << 20), 64);
        assert_eq!(iters("send_lat", 1 << 20), 20);
        assert_eq!(iters("send_lat", 4096), 1000);
    }
}
