//! `cargo xtask insn`: user-space instructions per message, deterministically.
//!
//! Under QEMU/TCG a small message costs ~18 µs of kernel (rxe) work, so timing
//! hides what the user-space data path costs. This runs each client (perftest's
//! `ib_<test>`, this crate's `perf --safe`, `--raw` and `--scoped`) under callgrind in
//! one soft-RoCE guest at two iteration counts N1 < N2, with peak search off
//! (`-N`) on both tools, and reports (I(N2) − I(N1)) / (N2 − N1): the
//! program's total instructions per message, start-up and teardown cancelled.
//! One thing that does not cancel is left out of every run: perftest's
//! CPU-frequency calibration, a busy-wait on `gettimeofday` whose length
//! depends on the host's speed at that moment (see [`clock_calibration`]).
//! Servers run natively next to it with the same flags.
//!
//! Writes `target/compare/insn.json` (`insn-server.json` with `--side
//! server`, the receiver of send_bw under callgrind): rows `{test, path, size,
//! post_list, side, insn_per_msg}` with path `perftest`, `safe`, `raw` or
//! `scoped`, and prints a table with safe/raw, scoped/raw and raw/perftest.
//! `--check RATIO` (`--check-scoped RATIO`) exits 1 when any safe/raw
//! (scoped/raw) exceeds RATIO (the regression guard `cargo xtask test` runs).
//! Path `async` counts `perf --async N` (write_bw and send_bw through
//! `rdma_verbs::tokio` with N awaited requests in flight) next to `safe`, at
//! `-Q 1` on both: see [`async_rows`].
//!
//! With `--side server` the receiver's figure includes its empty polls, whose number
//! depends on timing: each run's poll calls are counted too, and a fit over the runs
//! takes their cost out (see [`polls`]); the table and the JSON rows add polls per
//! message, instructions per poll call and per message without them. Give `--reps 2` or
//! more: the fit needs four runs of a configuration.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{self, run_checked};
use crate::run::{self, Invocation};
use crate::{Context, Result};
use polls::Run;

mod async_rows;
mod plan;
mod polls;
mod receiver;

use plan::{Plan, parse_plans};

/// Per client or server process.
const SIDE_TIMEOUT_SECS: u32 = 300;
/// TCP port of the endpoint exchange of the first job running at a time (perftest's
/// default); the others take the next ports.
const BASE_PORT: u16 = 18515;

/// One measured configuration.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    test: String,
    size: u64,
    post_list: u64,
    path: String,
}

/// The median of `v` (the mean of the middle two for an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn keys(plan: &Plan) -> Vec<Key> {
    let mut out = Vec::new();
    for test in &plan.tests {
        let sizes = if test == "atomic_bw" {
            vec![8]
        } else {
            plan.sizes.clone()
        };
        for size in sizes {
            for &post_list in &plan.post_lists {
                for path in &plan.paths {
                    if async_rows::is_async(path) {
                        out.extend(async_rows::keys(plan, path, test, size, post_list));
                        continue;
                    }
                    out.push(Key {
                        test: test.clone(),
                        size,
                        post_list,
                        path: path.clone(),
                    });
                }
            }
        }
    }
    out
}

fn job_name(k: &Key, q: Option<u32>, n: u64, rep: u32) -> String {
    let q = q.map_or(String::new(), |q| format!("_q{q}"));
    let base = format!("{}_{}_l{}{q}_{}_{n}", k.test, k.size, k.post_list, k.path);
    if rep == 0 {
        base
    } else {
        format!("{base}_r{rep}")
    }
}

/// Whether some runs are annotated for their functions' names: in the guest, the server
/// side's runs and perftest's; on the host, every run's profile with
/// `RDMA_VERBS_INSN_KEEP_CG=1`. (The async runs' profiles, kept for the host too, name
/// libc's exported functions only, unless that variable is set.)
fn annotated(plans: &[Plan]) -> bool {
    std::env::var_os("RDMA_VERBS_INSN_KEEP_CG").is_some_and(|v| v == "1")
        || plans
            .iter()
            .any(|p| p.side == "server" || p.paths.iter().any(|path| path == "perftest"))
}

/// `sh -c QUICK_START insn OUTDIR PERF SCRIPT DEBUG` runs `sh -c SCRIPT insn OUTDIR PERF` in a
/// private mount namespace (`unshare -m`; the host's is never touched) where two things
/// every process under callgrind reads at start-up are smaller. Neither changes what a run
/// does once started: the per-message figures stay the same (with no debug information, a
/// run's total too, to the instruction):
/// - libibverbs' configuration directory is a private tmpfs that lists only the measured
///   device's provider (a copy of its line); libibverbs loads every provider listed (17 on
///   Debian 12), ~2 s of each run's start-up under callgrind in the guest;
/// - where no run is annotated in the guest ([`annotated`]), `/usr/lib/debug` is empty, so
///   valgrind reads no detached debug information (libc6-dbg: ~1.2 s of each start-up).
///   Annotated runs keep it: without libc's names, the callers of `gettimeofday` that the
///   calibration rule leaves out of perftest's runs ([`clock_calibration`]) are not found
///   the same way (without them send_bw's perftest figure reads 247 instead of 320).
///
/// Both cost the same in every run and cancel in the difference of two, but make a third
/// of the guard's time. Where a private namespace is not possible (not root), or there is no
/// provider file to keep, everything loads as usual, as it does with
/// `RDMA_VERBS_INSN_FULL_START=1`.
const QUICK_START: &str = r#"script=$3; debug=$4; set -- "$1" "$2"
dev=${RDMA_VERBS_DEVICE:-rxe0}; provider=$(printf %s "$dev" | sed 's/_*[0-9]*$//')
conf=/etc/libibverbs.d
if [ "${RDMA_VERBS_INSN_FULL_START:-}" != 1 ] && [ -f "$conf/$provider.driver" ] \
    && unshare -m true 2>/dev/null; then
  exec unshare -m sh -c 'conf=$1; line=$(cat "$conf/$2.driver")
    if mount -t tmpfs none "$conf"; then
      printf "%s\n" "$line" > "$conf/$2.driver"
    else
      echo "insn: every provider loads" >&2
    fi
    if [ "$4" = hide ] && [ -d /usr/lib/debug ]; then mount -t tmpfs none /usr/lib/debug; fi
    s=$3; shift 4; exec sh -c "$s" insn "$@"' insn "$conf" "$provider" "$script" "$debug" "$@"
fi
exec sh -c "$script" insn "$@"
"#;

/// The guest script: `sh -c SCRIPT insn OUTDIR PERF`. Each job writes the
/// client's total instructions to `OUTDIR/NAME.insn`. The plans share the side and the send
/// API (see [`parse_plans`]); a job two plans both name runs once.
fn script(plans: &[Plan]) -> String {
    let mut s = job_function(&plans[0].side, plans[0].legacy_send);
    let mut named = std::collections::BTreeSet::new();
    let mut jobs = Vec::new();
    for plan in plans {
        // Repetitions run one after the other, so that a slow stretch of the
        // host does not land on every run of one figure.
        for rep in 0..plan.reps {
            for k in keys(plan) {
                for n in [plan.iters.0, plan.iters.1] {
                    let name = job_name(&k, plan.cq_mod, n, rep);
                    if named.insert(name.clone()) {
                        jobs.push(format!(
                            "job {name} {} {} {} {} {n} {} {}",
                            k.path,
                            k.test,
                            k.size,
                            k.post_list,
                            plan.cq_mod.unwrap_or(0),
                            u8::from(receiver::burst(plan, &k))
                        ));
                    }
                }
            }
        }
    }
    let at_once = plans.iter().map(|p| p.jobs).max().unwrap_or(1) as usize;
    for group in jobs.chunks(at_once) {
        if let [only] = group {
            let _ = writeln!(s, "{only} {BASE_PORT}");
            continue;
        }
        // Each job of a group on its own exchange port; the group ends before the next.
        for (slot, job) in (0u16..).zip(group) {
            let _ = writeln!(s, "{job} {} &", BASE_PORT + slot);
        }
        s.push_str("wait\n");
    }
    s.push_str("echo '[insn] done'\n");
    s
}

/// The script's settings and its `listening` and `job` functions: `side` under callgrind,
/// `legacy_send` for `--use_old_post_send` on both tools. A job whose BURST is 1 runs
/// `perf --rx-burst`, and with the client side measured, its receiver under callgrind
/// too (`NAME.rx.insn`).
fn job_function(side: &str, legacy_send: bool) -> String {
    let t = SIDE_TIMEOUT_SECS;
    let extra = if legacy_send {
        " --use_old_post_send"
    } else {
        ""
    };
    format!(
        "set -u\n\
         OUT=$1; PERF=$2; SIDE={side}\n\
         DEV=${{RDMA_VERBS_DEVICE:-rxe0}}; ADDR=${{RDMA_VERBS_ADDR:-10.99.0.1}}\n\
         # listening PORT: waits until a server listens on TCP port PORT.\n\
         listening() {{\n\
         \x20 hex=$(printf '%04X' $1); i=0\n\
         \x20 until grep -q \":$hex 00000000:0000 0A\" /proc/net/tcp; do\n\
         \x20   i=$((i + 1)); [ $i -lt 600 ] || return 1; sleep 0.05\n\
         \x20 done\n\
         }}\n\
         # job NAME PATH TEST SIZE POSTLIST ITERS CQMOD BURST PORT (CQMOD 0: perftest's default)\n\
         job() {{\n\
         \x20 name=$1; path=$2; t=$3; s=$4; l=$5; n=$6; q=$7; burst=$8; port=$9; began=$(date +%s%N)\n\
         \x20 common=\"-d $DEV -x 1 -F -N -s $s -n $n -l $l -p $port{extra}\"\n\
         \x20 if [ \"$t\" = atomic_bw ]; then common=\"$common -A FETCH_AND_ADD\"; fi\n\
         \x20 if [ \"$q\" != 0 ]; then common=\"$common -Q $q\"; fi\n\
         \x20 if [ $burst = 1 ]; then common=\"$common --rx-burst\"; fi\n\
         \x20 case $path in\n\
         \x20   perftest) prog=\"ib_$t\" ;;\n\
         \x20   async-tasks*) prog=\"$PERF $t --async-tasks ${{path#async-tasks}}\" ;;\n\
         \x20   async-stream*) prog=\"$PERF $t --async-stream ${{path#async-stream}}\" ;;\n\
         \x20   async*) prog=\"$PERF $t --async ${{path#async}}\" ;;\n\
         \x20   *) prog=\"$PERF $t --$path\" ;;\n\
         \x20 esac\n\
         \x20 cg=\"valgrind --tool=callgrind --vgdb=no --callgrind-out-file=/tmp/$name.cg\"\n\
         \x20 if [ $SIDE = client ]; then scg=; ccg=$cg; else scg=$cg; ccg=; fi\n\
         \x20 if [ $SIDE$burst = client1 ]; then\n\
         \x20   scg=\"valgrind --tool=callgrind --vgdb=no --callgrind-out-file=/tmp/$name.rx.cg\"\n\
         \x20 fi\n\
         \x20 timeout {t} $scg $prog $common > \"$OUT/$name.server.txt\" 2>&1 &\n\
         \x20 spid=$!\n\
         \x20 if listening $port; then\n\
         \x20   timeout {t} $ccg $prog $common $ADDR > \"$OUT/$name.client.txt\" 2>&1; crc=$?\n\
         \x20 else\n\
         \x20   crc=98; kill $spid 2>/dev/null\n\
         \x20 fi\n\
         \x20 wait $spid; src=$?\n\
         \x20 sed -n 's/^\\(summary\\|totals\\): *//p' /tmp/$name.cg 2>/dev/null | head -1 > \"$OUT/$name.insn\"\n\
         \x20 if [ -f /tmp/$name.rx.cg ]; then\n\
         \x20   sed -n 's/^\\(summary\\|totals\\): *//p' /tmp/$name.rx.cg | head -1 > \"$OUT/$name.rx.insn\"\n\
         \x20   rm -f /tmp/$name.rx.cg\n\
         \x20 fi\n\
         \x20 # The calibration rule needs the callers of gettimeofday, the poll count\n\
         \x20 # the callers of the poll function; annotating takes ~3 s under TCG, so\n\
         \x20 # client runs are annotated only for perftest (whose calibration loop calls\n\
         \x20 # gettimeofday). Every function: the poll function is below the default\n\
         \x20 # 99% threshold.\n\
         \x20 if [ $SIDE = server ] || [ $path = perftest ]; then\n\
         \x20   callgrind_annotate --tree=caller --inclusive=yes --threshold=100 /tmp/$name.cg > \"$OUT/$name.callers\" 2>/dev/null\n\
         \x20 else\n\
         \x20   : > \"$OUT/$name.callers\"\n\
         \x20 fi\n\
         \x20 # Profiles to annotate on the host: the async runs', every run's with\n\
         \x20 # RDMA_VERBS_INSN_KEEP_CG=1 (in target/compare/insn-runs).\n\
         \x20 case $path/${{RDMA_VERBS_INSN_KEEP_CG:-}} in async*|*/1) cp /tmp/$name.cg \"$OUT/\" ;; esac\n\
         \x20 rm -f /tmp/$name.cg\n\
         \x20 echo \"[insn] $name: client $crc, server $src, $(( ($(date +%s%N) - began) / 1000000 )) ms\"\n\
         }}\n"
    )
}

/// `cargo xtask insn`: measures every plan in one guest, then prints each plan's table and
/// applies its checks; returns 1 when a check failed or a figure is missing.
pub fn insn_command(args: Vec<OsString>) -> Result<u8> {
    let passed = checked_plans(args)?;
    Ok(u8::from(passed.contains(&false)))
}

/// [`insn_command`]'s work: whether each plan passed its checks with all its figures, in
/// order (none after `--help`).
pub fn checked_plans(args: Vec<OsString>) -> Result<Vec<bool>> {
    let Some(plans) = parse_plans(args)? else {
        return Ok(Vec::new());
    };
    let perf = build_perf()?;
    let work = PathBuf::from(format!("/tmp/rdma-verbs-insn.{}", std::process::id()));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).context(|| format!("cannot create {}", work.display()))?;
    let mut inv = Invocation::new(
        "sh".into(),
        vec![
            "-c".into(),
            QUICK_START.into(),
            "insn".into(),
            work.clone().into(),
            perf.into(),
            script(&plans).into(),
            if annotated(&plans) {
                "keep".into()
            } else {
                "hide".into()
            },
        ],
    )?;
    inv.cwd = crate::workspace_root().to_path_buf();
    let runs: usize = plans
        .iter()
        .map(|p| keys(p).len() * 2 * p.reps as usize)
        .sum();
    eprintln!(
        "xtask insn: {runs} {} runs under callgrind in one guest",
        plans[0].side
    );
    let timeout = plans.iter().map(|p| p.timeout).max().unwrap_or_default();
    let code = match run::execute(inv, timeout) {
        Ok(code) => code,
        Err(e) => {
            // The runs' files, for the error's diagnosis; `work` goes either way.
            let _ = keep_logs(&work);
            return Err(e);
        }
    };

    let mut calibration = Vec::new();
    let measured: Vec<Measured> = plans
        .iter()
        .map(|plan| per_message(plan, &work, &mut calibration))
        .collect();
    let logs = keep_logs(&work)?;
    let mut rows = BTreeMap::new();
    let mut receiver = BTreeMap::new();
    for m in &measured {
        rows.extend(m.per_msg.iter().map(|(k, v)| (k.clone(), *v)));
        receiver.extend(
            m.runs.iter().filter_map(|(k, r)| {
                Some((k.clone(), polls::figures(r, m.per_msg.get(k).copied())?))
            }),
        );
    }
    let json = crate::target_dir()
        .join("compare")
        .join(if plans[0].side == "client" {
            "insn.json"
        } else {
            "insn-server.json"
        });
    fs::write(&json, to_json(&rows, &receiver, &plans[0].side))
        .context(|| format!("cannot write {}", json.display()))?;

    if let (Some(lo), Some(hi)) = (calibration.iter().min(), calibration.iter().max()) {
        say!(
            "xtask insn: excluded a clock calibration loop (the callers of gettimeofday) \
             from {} runs: {lo}..{hi} instructions each",
            calibration.len()
        );
    }
    let passed = plans
        .iter()
        .zip(&measured)
        .map(|(plan, m)| judge(plan, m, code, &logs))
        .collect();
    say!("wrote {}", json.display());
    Ok(passed)
}

/// `cargo build --release --example perf --features tokio`: the `perf` every insn run
/// measures.
pub fn perf_build_command() -> Command {
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build
        .args([
            "build",
            "--release",
            "--example",
            "perf",
            // tokio for the async paths; perf uses nothing of gdr.
            "--features",
            "tokio",
        ])
        .current_dir(crate::workspace_root());
    build
}

/// Builds `perf` ([`perf_build_command`]); returns the binary.
fn build_perf() -> Result<PathBuf> {
    let mut build = perf_build_command();
    eprintln!("xtask insn: {}", cmd::display(&build));
    run_checked(&mut build)?;
    Ok(crate::target_dir().join("release/examples/perf"))
}

/// One plan's figures.
struct Measured {
    /// Instructions per message of each configuration measured.
    per_msg: BTreeMap<Key, f64>,
    /// Jobs without a result.
    missing: Vec<String>,
    /// Server side: every run of each configuration whose poll calls were counted.
    runs: BTreeMap<Key, Vec<Run>>,
    /// Client side with `--receiver burst`: the receiver's instructions per message.
    receiver: BTreeMap<Key, f64>,
}

/// The instructions per message of each of `plan`'s configurations, from the jobs' files
/// in `work`; adds the clock calibration loops it left out to `calibration`.
fn per_message(plan: &Plan, work: &Path, calibration: &mut Vec<u64>) -> Measured {
    let poll_fn = polls::find_poll_fn(work);
    let mut runs: BTreeMap<Key, Vec<Run>> = BTreeMap::new();
    let mut total = |k: &Key, n: u64, rep: u32| -> Option<u64> {
        let name = job_name(k, plan.cq_mod, n, rep);
        let all: u64 = fs::read_to_string(work.join(format!("{name}.insn")))
            .ok()?
            .trim()
            .replace(',', "")
            .parse()
            .ok()?;
        let callers = fs::read_to_string(work.join(format!("{name}.callers"))).ok()?;
        let clock = clock_calibration(&callers);
        if clock > 0 {
            calibration.push(clock);
        }
        let insn = all.saturating_sub(clock);
        let counted = poll_fn
            .as_ref()
            .and_then(|(file, offset)| polls::calls(&callers, file, *offset));
        if let Some(p) = counted {
            runs.entry(k.clone()).or_default().push(Run {
                n: n as f64,
                insn: insn as f64,
                polls: p as f64,
            });
        }
        Some(insn)
    };
    let mut per_msg: BTreeMap<Key, f64> = BTreeMap::new();
    let mut missing = Vec::new();
    for k in keys(plan) {
        let (n1, n2) = plan.iters;
        let mut figures = Vec::new();
        for rep in 0..plan.reps {
            match (total(&k, n1, rep), total(&k, n2, rep)) {
                (Some(a), Some(b)) => figures.push((b as f64 - a as f64) / (n2 - n1) as f64),
                _ => missing.push(job_name(&k, plan.cq_mod, n1, rep)),
            }
        }
        if figures.len() == plan.reps as usize {
            per_msg.insert(k, median(&mut figures));
        }
    }
    let receiver = receiver::per_message(plan, work);
    Measured {
        per_msg,
        missing,
        runs,
        receiver,
    }
}

/// Copies the jobs' files from `work` to `target/compare/insn-runs` and removes `work`;
/// returns the copy.
fn keep_logs(work: &Path) -> Result<PathBuf> {
    let out_dir = crate::target_dir().join("compare");
    fs::create_dir_all(&out_dir).context(|| format!("cannot create {}", out_dir.display()))?;
    let logs = out_dir.join("insn-runs");
    let _ = fs::remove_dir_all(&logs);
    let _ = fs::create_dir_all(&logs);
    if let Ok(entries) = fs::read_dir(work) {
        for e in entries.flatten() {
            let _ = fs::copy(e.path(), logs.join(e.file_name()));
        }
    }
    let _ = fs::remove_dir_all(work);
    Ok(logs)
}

/// Prints `plan`'s table and applies its checks; false when a check failed or a figure is
/// missing (`code`: the guest's exit status).
fn judge(plan: &Plan, measured: &Measured, code: u8, logs: &Path) -> bool {
    let (worst, worst_scoped) = print_table(plan, &measured.per_msg);
    let async_ok = async_rows::report(plan, &measured.per_msg);
    if !measured.runs.is_empty() {
        polls::print_table(&measured.runs, &measured.per_msg);
    }
    if !measured.missing.is_empty() || code != 0 {
        eprintln!(
            "xtask insn: no result for {} (guest status {code}); logs in {}",
            if measured.missing.is_empty() {
                "-".to_owned()
            } else {
                measured.missing.join(", ")
            },
            logs.display()
        );
        return false;
    }
    let mut ok = true;
    for (what, limit, worst) in [
        ("safe/raw", plan.check, worst),
        ("scoped/raw", plan.check_scoped, worst_scoped),
    ] {
        match (limit, worst) {
            (Some(limit), Some(worst)) if worst > limit => {
                eprintln!("xtask insn: FAILED: {what} {worst:.3} exceeds the guard {limit}");
                ok = false;
            }
            (Some(limit), Some(worst)) => {
                say!("xtask insn: {what} at most {worst:.3} (guard {limit}): ok")
            }
            (Some(_), None) => {
                eprintln!("xtask insn: FAILED: no {what} figure for its guard");
                ok = false;
            }
            _ => {}
        }
    }
    ok && async_ok && receiver::judge(plan, &measured.receiver)
}

/// Prints the table; returns the largest safe/raw and scoped/raw ratios.
fn print_table(plan: &Plan, per_msg: &BTreeMap<Key, f64>) -> (Option<f64>, Option<f64>) {
    say!(
        "instructions per message ({side}, {api} send API, callgrind, (I({n2}) - I({n1})) / {d}):",
        side = plan.side,
        api = if plan.legacy_send {
            "legacy"
        } else {
            "our extended"
        },
        n1 = plan.iters.0,
        n2 = plan.iters.1,
        d = plan.iters.1 - plan.iters.0
    );
    say!(
        "{:<10} {:>8} {:>3} {:>10} {:>10} {:>10} {:>10} {:>9} {:>11} {:>12}",
        "test",
        "size",
        "-l",
        "perftest",
        "raw",
        "safe",
        "scoped",
        "safe/raw",
        "scoped/raw",
        "raw/perftest"
    );
    let get = |k: &Key, path: &str| {
        per_msg
            .get(&Key {
                path: path.into(),
                ..k.clone()
            })
            .copied()
    };
    let num = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let (mut worst, mut worst_scoped): (Option<f64>, Option<f64>) = (None, None);
    let max = |w: Option<f64>, x: Option<f64>| match (w, x) {
        (Some(w), Some(x)) => Some(w.max(x)),
        (w, x) => w.or(x),
    };
    // One line per configuration: the keys of the first path with a column here.
    let first = plan.paths.iter().find(|p| !async_rows::is_async(p));
    for k in keys(plan).iter().filter(|k| Some(&k.path) == first) {
        let (p, r, s) = (get(k, "perftest"), get(k, "raw"), get(k, "safe"));
        let sc = get(k, "scoped");
        let (sr, scr) = (ratio(s, r), ratio(sc, r));
        worst = max(worst, sr);
        worst_scoped = max(worst_scoped, scr);
        let fmt = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.3}"));
        say!(
            "{:<10} {:>8} {:>3} {:>10} {:>10} {:>10} {:>10} {:>9} {:>11} {:>12}",
            k.test,
            k.size,
            k.post_list,
            num(p),
            num(r),
            num(s),
            num(sc),
            fmt(sr),
            fmt(scr),
            fmt(ratio(r, p))
        );
    }
    (worst, worst_scoped)
}

/// Instructions spent in functions that call `gettimeofday`, from
/// `callgrind_annotate --tree=caller --inclusive=yes` output: their inclusive cost.
///
/// perftest measures the CPU frequency once, at report time, by busy-waiting
/// on `gettimeofday` for a fixed stretch of wall time (`get_cpu_mhz`). Under
/// callgrind that loop runs a number of times that depends on how fast the
/// host is at that moment, not on the message count, so it does not cancel
/// in I(N2) − I(N1) and swung perftest's figure by up to 2×. This crate's
/// `perf` never calls `gettimeofday` (Rust's clock is `clock_gettime`; a profile
/// still names it, as the dynamic loader resolves its IFUNC at start-up, the
/// same count in every run), so the guest script annotates the client runs of
/// perftest only and hands the others' in empty, which this reads as 0.
fn clock_calibration(annotate: &str) -> u64 {
    // Blocks are separated by blank lines: `COST (PCT)  < CALLER (Nx) [OBJ]`
    // lines, then `COST (PCT)  *  FUNCTION [OBJ]` for the function itself.
    let mut inclusive: BTreeMap<&str, u64> = BTreeMap::new();
    let mut callers_of_clock: Vec<&str> = Vec::new();
    for block in annotate.split("\n\n") {
        let mut callers = Vec::new();
        for line in block.lines() {
            let Some((cost, rest)) = line.trim_start().split_once(' ') else {
                continue;
            };
            let Ok(cost) = cost.replace(',', "").parse::<u64>() else {
                continue;
            };
            // Skip the percentage: `( 3.28%)`.
            let rest = rest.split_once(')').map_or(rest, |(_, r)| r).trim_start();
            if let Some(caller) = rest.strip_prefix('<') {
                // `NAME (Nx) [OBJ]`: the name ends before the call count.
                if let Some((name, _)) = caller.trim().rsplit_once(" (") {
                    callers.push(name);
                }
            } else if let Some(me) = rest.strip_prefix('*') {
                let me = me.trim();
                let name = me.rsplit_once(" [").map_or(me, |(n, _)| n);
                inclusive.insert(name, cost);
                if name.ends_with("gettimeofday") || name.ends_with("__gettimeofday_syscall") {
                    callers_of_clock.append(&mut callers);
                }
            }
        }
    }
    callers_of_clock.sort_unstable();
    callers_of_clock.dedup();
    callers_of_clock
        .iter()
        .filter_map(|c| inclusive.get(c))
        .sum()
}

/// The rows of `insn.json` / `insn-server.json`; `receiver`: the poll figures of the
/// server side's configurations.
fn to_json(
    per_msg: &BTreeMap<Key, f64>,
    receiver: &BTreeMap<Key, polls::Figures>,
    side: &str,
) -> String {
    let rows: Vec<String> = per_msg
        .iter()
        .map(|(k, v)| {
            format!(
                "  {{\"test\": \"{}\", \"path\": \"{}\", \"size\": {}, \"post_list\": {}, \"side\": \"{side}\", \"insn_per_msg\": {v:.1}{}}}",
                k.test,
                k.path,
                k.size,
                k.post_list,
                receiver.get(k).map(polls::json_fields).unwrap_or_default()
            )
        })
        .collect();
    format!("[\n{}\n]\n", rows.join(",\n"))
}

#[cfg(test)]
mod tests;
