//! The async rows of `cargo xtask insn`: `perf --async N` (write_bw and send_bw
//! through `rdma_verbs::tokio` on a current-thread runtime, N awaited requests
//! in flight) next to `perf --safe`, the synchronous ownership path.
//!
//! Each async request is awaited, so signaled: a plan with `async` runs every job
//! at `-Q 1` unless `--cq-mod` says otherwise, and always measures `safe` too,
//! so that the ratio compares the same work per message (one signaled request,
//! its completion polled and its status checked).

use std::collections::BTreeMap;

use super::{Key, Plan};
use crate::{Error, Result};

/// The tests `perf --async` runs.
const TESTS: &[&str] = &["write_bw", "send_bw"];

/// The async paths: `perf --async N`, `perf --async-tasks N` and `perf --async-stream N`.
const PATHS: &[&str] = &["async", "async-tasks", "async-stream"];

/// Whether `path` (of `--paths`) is one of the async paths.
pub(super) fn is_async(path: &str) -> bool {
    PATHS.contains(&path)
}

/// `--check-async`'s value.
pub(super) fn ratio_arg(v: &str) -> Result<f64> {
    v.parse()
        .ok()
        .filter(|r: &f64| *r > 0.0)
        .ok_or_else(|| Error::usage("--check-async needs a positive ratio"))
}

/// Adds what a plan with `async` needs: `safe` for the ratio and `-Q 1`; refuses
/// one where `async` has nothing to run.
pub(super) fn complete(plan: &mut Plan) -> Result<()> {
    if !plan.paths.iter().any(|p| is_async(p)) {
        if plan.check_async.is_some() {
            return Err(Error::usage("--check-async needs async in --paths"));
        }
        return Ok(());
    }
    if plan.inflight.is_empty() || plan.inflight.contains(&0) {
        return Err(Error::usage("--inflight needs positive counts"));
    }
    if !plan.tests.iter().any(|t| TESTS.contains(&t.as_str())) || !plan.post_lists.contains(&1) {
        return Err(Error::usage(
            "async runs write_bw and send_bw with -l 1: give one of them in --tests and 1 in \
             --post-list",
        ));
    }
    if !plan.paths.iter().any(|p| p == "safe") {
        plan.paths.insert(0, "safe".into());
    }
    plan.cq_mod.get_or_insert(1);
    Ok(())
}

/// The keys of async path `path` for one (test, size, post list): one per in-flight
/// count (path `async16`, `async-tasks16`, `async-stream16`), where `perf --async` runs it.
pub(super) fn keys(plan: &Plan, path: &str, test: &str, size: u64, post_list: u64) -> Vec<Key> {
    if !TESTS.contains(&test) || post_list != 1 {
        return Vec::new();
    }
    plan.inflight
        .iter()
        .map(|n| Key {
            test: test.into(),
            size,
            post_list,
            path: format!("{path}{n}"),
        })
        .collect()
}

/// Prints the async table of `plan` (if it has async rows) and applies
/// `--check-async` to the largest in-flight count of each async path; false
/// when that fails.
pub(super) fn report(plan: &Plan, per_msg: &BTreeMap<Key, f64>) -> bool {
    let paths: Vec<&str> = PATHS
        .iter()
        .copied()
        .filter(|a| plan.paths.iter().any(|p| p == a))
        .collect();
    if paths.is_empty() {
        return true;
    }
    let mut inflight = plan.inflight.clone();
    inflight.sort_unstable();
    inflight.dedup();
    let q = plan
        .cq_mod
        .map_or("perftest's default".into(), |q| q.to_string());
    say!(
        "async (perf --async N: one task, N in flight; --async-tasks N: N tasks; \
         --async-stream N: post_send and next_batch; a \
         current-thread runtime) against safe, -Q {q} on all:"
    );
    let mut head = format!("{:<10} {:>8} {:>10}", "test", "size", "safe");
    for path in &paths {
        for n in &inflight {
            head += &format!(" {:>16} {:>6}", format!("{path} N={n}"), "/safe");
        }
    }
    say!("{head}");
    let get = |k: &Key, path: String| per_msg.get(&Key { path, ..k.clone() }).copied();
    let mut worst: Option<f64> = None;
    let mut missing = false;
    let largest = inflight.last().copied();
    let rows = super::keys(plan);
    for k in rows
        .iter()
        .filter(|k| k.path == "safe" && TESTS.contains(&k.test.as_str()))
    {
        if k.post_list != 1 {
            continue;
        }
        let safe = get(k, "safe".into());
        let mut line = format!("{:<10} {:>8} {:>10}", k.test, k.size, num(safe, 1));
        for &(path, n) in paths
            .iter()
            .flat_map(|p| inflight.iter().map(move |n| (p, *n)))
            .collect::<Vec<_>>()
            .iter()
        {
            let a = get(k, format!("{path}{n}"));
            let r = match (a, safe) {
                (Some(a), Some(s)) if s > 0.0 => Some(a / s),
                _ => None,
            };
            if Some(n) == largest {
                match r {
                    Some(r) => worst = Some(worst.map_or(r, |w| w.max(r))),
                    None => missing = true,
                }
            }
            line += &format!(" {:>16} {:>6}", num(a, 1), num(r, 3));
        }
        say!("{line}");
    }
    let Some(limit) = plan.check_async else {
        return true;
    };
    let n = largest.unwrap_or_default();
    match worst {
        Some(w) if !missing && w <= limit => {
            say!("xtask insn: async/safe at N={n} at most {w:.3} (guard {limit}): ok");
            true
        }
        Some(w) if !missing => {
            eprintln!("xtask insn: FAILED: async/safe at N={n} {w:.3} exceeds the guard {limit}");
            false
        }
        _ => {
            eprintln!("xtask insn: FAILED: no async/safe figure at N={n} for its guard");
            false
        }
    }
}

fn num(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.digits$}"))
}
