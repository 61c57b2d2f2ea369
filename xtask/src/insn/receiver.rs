//! The send_bw receiver measured in the client runs (`--side client --receiver burst`):
//! `perf --rx-burst` posts every receive before the run and polls only once the sender is
//! done, so no poll comes back empty and the receiver's instructions per message need no
//! fit; each such job also writes the receiver's total, `NAME.rx.insn`.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use super::plan::Plan;
use super::{Key, job_name, keys, median};

/// Whether `k`'s jobs in `plan` run `perf --rx-burst`: the send_bw jobs of perf's paths
/// (with the client side measured, raw and scoped only: each burst job starts a second
/// callgrind, and the guard compares those two).
pub(super) fn burst(plan: &Plan, k: &Key) -> bool {
    let paths: &[&str] = if plan.side == "client" {
        &["raw", "scoped"]
    } else {
        &["safe", "raw", "scoped"]
    };
    plan.rx_burst && k.test == "send_bw" && paths.contains(&k.path.as_str())
}

/// The receiver's instructions per message of each burst configuration of a client-side
/// plan, the median over its repetitions; empty for other plans.
pub(super) fn per_message(plan: &Plan, work: &Path) -> BTreeMap<Key, f64> {
    let mut out = BTreeMap::new();
    if plan.side != "client" {
        return out;
    }
    let total = |k: &Key, n: u64, rep: u32| -> Option<f64> {
        let name = job_name(k, plan.cq_mod, n, rep);
        let text = fs::read_to_string(work.join(format!("{name}.rx.insn"))).ok()?;
        text.trim().replace(',', "").parse().ok()
    };
    let (n1, n2) = plan.iters;
    for k in keys(plan).into_iter().filter(|k| burst(plan, k)) {
        let mut figures: Vec<f64> = (0..plan.reps)
            .filter_map(|rep| Some((total(&k, n2, rep)? - total(&k, n1, rep)?) / (n2 - n1) as f64))
            .collect();
        if figures.len() == plan.reps as usize {
            out.insert(k, median(&mut figures));
        }
    }
    out
}

/// Prints the receiver's figures and applies `--check-receiver` (scoped/raw); false when
/// the check fails or has no figure.
pub(super) fn judge(plan: &Plan, receiver: &BTreeMap<Key, f64>) -> bool {
    if !receiver.is_empty() {
        say!(
            "the send_bw receiver in the same runs (perf --rx-burst: every receive posted \
             first, read once the sender is done), instructions per message:"
        );
        say!(
            "{:<10} {:>8} {:>3} {:>10} {:>10} {:>10} {:>11}",
            "test",
            "size",
            "-l",
            "raw",
            "safe",
            "scoped",
            "scoped/raw"
        );
    }
    let get = |k: &Key, path: &str| {
        receiver
            .get(&Key {
                path: path.into(),
                ..k.clone()
            })
            .copied()
    };
    let num = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    let mut worst: Option<f64> = None;
    let mut shown = std::collections::BTreeSet::new();
    for k in receiver.keys() {
        if !shown.insert((k.test.clone(), k.size, k.post_list)) {
            continue;
        }
        let (r, s, sc) = (get(k, "raw"), get(k, "safe"), get(k, "scoped"));
        let ratio = match (sc, r) {
            (Some(sc), Some(r)) if r > 0.0 => Some(sc / r),
            _ => None,
        };
        worst = match (worst, ratio) {
            (Some(w), Some(x)) => Some(w.max(x)),
            (w, x) => w.or(x),
        };
        say!(
            "{:<10} {:>8} {:>3} {:>10} {:>10} {:>10} {:>11}",
            k.test,
            k.size,
            k.post_list,
            num(r),
            num(s),
            num(sc),
            ratio.map_or("-".to_owned(), |v| format!("{v:.3}"))
        );
    }
    match (plan.check_receiver, worst) {
        (Some(limit), Some(worst)) if worst > limit => {
            eprintln!(
                "xtask insn: FAILED: receiver scoped/raw {worst:.3} exceeds the guard {limit}"
            );
            false
        }
        (Some(limit), Some(worst)) => {
            say!("xtask insn: receiver scoped/raw at most {worst:.3} (guard {limit}): ok");
            true
        }
        (Some(_), None) => {
            eprintln!("xtask insn: FAILED: no receiver scoped/raw figure for its guard");
            false
        }
        (None, _) => true,
    }
}
