//! Judging a case from what both agents recorded: a [`Row`] per case.

use std::fs;
use std::path::Path;
use std::time::Duration;

use super::Row;
use crate::wire::{Case, Expect, Fault, NodeResult, Side};

/// What node `node` recorded for case `i` (`i.N.result`), if it wrote it.
pub(super) fn read(dir: &Path, i: usize, node: u8) -> Option<NodeResult> {
    fs::read_to_string(dir.join(format!("{i}.{node}.result")))
        .ok()
        .map(|t| NodeResult::parse(&t))
}

/// The last `n` non-empty lines of node `node`'s output for case `i`, joined by " | ".
pub(super) fn tail(dir: &Path, i: usize, node: u8, n: usize) -> String {
    let text = fs::read_to_string(dir.join(format!("{i}.{node}.out"))).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

pub(super) fn describe(r: &NodeResult) -> String {
    if r.hung {
        format!("HUNG (killed at the deadline after {:.1} s)", r.elapsed_s)
    } else if r.killed {
        "killed by the fault".into()
    } else {
        match r.status {
            Some(st) => format!("exit {st} after {:.1} s", r.elapsed_s),
            None => "killed by a signal".into(),
        }
    }
}

/// The row of case `i`: its expectation checked against what node 1 (`n1`) and node 2
/// (`n2`) recorded; kernel objects left behind fail any case.
pub(super) fn judge(
    c: &Case,
    n1: &Option<NodeResult>,
    n2: &Option<NodeResult>,
    dir: &Path,
    i: usize,
) -> Row {
    let mut row = Row {
        scenario: c.scenario.clone(),
        program: c.program.clone(),
        expected: String::new(),
        observed: String::new(),
        time_to_error_s: None,
        messages: String::new(),
        verified_zero: false,
        leaked: None,
        pass: false,
        client_s: n2.as_ref().map_or(0.0, |r| r.elapsed_s),
    };
    let (Some(r1), Some(r2)) = (n1, n2) else {
        row.expected = "both nodes report".into();
        row.observed = format!("no result from node {}", if n1.is_none() { 1 } else { 2 });
        return row;
    };
    if let Some(p) = r1.problem.as_ref().or(r2.problem.as_ref()) {
        row.observed = format!("agent problem: {p}; ");
    }
    row.leaked = match (r1.leaked, r2.leaked) {
        (Some(a), Some(b)) => Some(a + b),
        _ => None,
    };
    let o = Outcome { r1, r2, dir, i };
    match &c.expect {
        Expect::BothOk => both_ok(&o, &mut row),
        Expect::SurvivorFails {
            within,
            says,
            zero_ok,
        } => survivor_fails(&o, &mut row, c, *within, says, *zero_ok),
        Expect::OneReports { within, says } => one_reports(&o, &mut row, *within, says),
        Expect::OkOrReports { says } => ok_or_reports(&o, &mut row, says),
        Expect::BothFail { within, says } => both_fail(&o, &mut row, *within, says),
        Expect::KeepsMoving => keeps_moving(&o, &mut row, c),
        Expect::ClientFails { within, says } => client_fails(&o, &mut row, *within, says),
    }
    if let Some(n) = row.leaked.filter(|n| *n > 0) {
        row.observed
            .push_str(&format!("; {n} kernel objects left behind (rdma res)"));
        row.pass = false;
    }
    row
}

/// Compares each netem row's client time against the clean run of the same program.
pub(super) fn add_throughput(rows: &mut [Row]) {
    let clean: Vec<(String, f64)> = rows
        .iter()
        .filter(|r| r.scenario.starts_with("clean") && r.pass)
        .map(|r| (r.program.clone(), r.client_s))
        .collect();
    for r in rows
        .iter_mut()
        .filter(|r| r.scenario.starts_with("netem") && r.pass)
    {
        if let Some((_, base)) = clean.iter().find(|(p, _)| *p == r.program) {
            r.observed.push_str(&format!(
                "; {:.0}% of the clean run's throughput ({:.1} s vs {:.1} s)",
                100.0 * base / r.client_s.max(1e-9),
                r.client_s,
                base
            ));
        }
    }
}

/// What both nodes recorded for case `i`, and where their output lies.
struct Outcome<'a> {
    r1: &'a NodeResult,
    r2: &'a NodeResult,
    dir: &'a Path,
    i: usize,
}

impl Outcome<'_> {
    /// The last `n` non-empty output lines of `node` ([`tail`]).
    fn tail(&self, node: u8, n: usize) -> String {
        tail(self.dir, self.i, node, n)
    }
}

/// Both programs exit 0 and the agents had no problem.
fn both_ok(o: &Outcome, row: &mut Row) {
    let (r1, r2) = (o.r1, o.r2);
    row.expected = "both exit 0, every message verified".into();
    row.observed
        .push_str(&format!("server {}, client {}", describe(r1), describe(r2)));
    row.pass = r1.status == Some(0)
        && r2.status == Some(0)
        && r1.problem.is_none()
        && r2.problem.is_none();
    row.verified_zero = row.pass;
    if !row.pass {
        row.messages = format!("server: {} || client: {}", o.tail(1, 3), o.tail(2, 3));
    }
}

/// The fault's victim was killed; the survivor exits on its own in time, saying `says`.
fn survivor_fails(
    o: &Outcome,
    row: &mut Row,
    c: &Case,
    within: Duration,
    says: &str,
    zero_ok: bool,
) {
    let (r1, r2) = (o.r1, o.r2);
    let victim = match c.fault {
        Fault::Kill { victim, .. } => victim,
        _ => Side::Server,
    };
    let survivor = victim.other();
    let (rs, rv) = match survivor {
        Side::Server => (r1, r2),
        Side::Client => (r2, r1),
    };
    row.expected = format!(
        "{} {} within {:.1} s",
        survivor.name(),
        if zero_ok {
            "handles DISCONNECTED and exits"
        } else {
            "exits non-zero with a typed error"
        },
        within.as_secs_f64()
    );
    row.observed = format!("{}: {}", survivor.name(), describe(rs));
    if !rv.killed {
        row.observed.push_str(&format!(
            "; {} was not killed ({})",
            victim.name(),
            describe(rv)
        ));
    }
    row.time_to_error_s = rs.tte_s;
    row.messages = o.tail(survivor.node(), 2);
    row.pass = rv.killed
        && !rs.hung
        && rs.status.is_some_and(|s| s != 0 || zero_ok)
        && rs.tte_s.is_some_and(|t| t <= within.as_secs_f64())
        && row.messages.contains(says);
}

/// One side reports one of `says` (`|`-separated) in time; neither hangs.
fn one_reports(o: &Outcome, row: &mut Row, within: Duration, says: &str) {
    let (r1, r2) = (o.r1, o.r2);
    row.expected = format!(
        "one side reports {} within {:.2} s of the fault; no hang",
        says.replace('|', " or "),
        within.as_secs_f64()
    );
    row.observed = format!("server {}, client {}", describe(r1), describe(r2));
    let reports = |r: &NodeResult, node: u8| {
        r.status.is_some_and(|s| s != 0)
            && r.tte_s.is_some_and(|t| t <= within.as_secs_f64())
            && says.split('|').any(|w| o.tail(node, 3).contains(w))
    };
    let first = [(r1, 1u8), (r2, 2u8)]
        .into_iter()
        .filter(|(r, _)| r.status.is_some_and(|s| s != 0))
        .min_by(|a, b| {
            let t = |r: &NodeResult| r.tte_s.unwrap_or(f64::MAX);
            t(a.0).total_cmp(&t(b.0))
        });
    if let Some((r, node)) = first {
        row.time_to_error_s = r.tte_s;
        row.messages = o.tail(node, 2);
    }
    row.pass = !r1.hung && !r2.hung && (reports(r1, 1) || reports(r2, 2));
}

/// Every message verified, or a side reports `says`; neither hangs.
fn ok_or_reports(o: &Outcome, row: &mut Row, says: &str) {
    let (r1, r2) = (o.r1, o.r2);
    row.expected =
        format!("every message verified, or {says} reported (typed, no hang, no bad data)");
    row.observed = format!("server {}, client {}", describe(r1), describe(r2));
    let ok = r1.status == Some(0) && r2.status == Some(0);
    let reported = [(r1, 1u8), (r2, 2u8)]
        .into_iter()
        .find(|(r, node)| r.status.is_some_and(|s| s != 0) && o.tail(*node, 3).contains(says));
    if let Some((_, node)) = reported {
        row.messages = o.tail(node, 1);
        row.observed.push_str(&format!(
            "; {says} on the {}",
            if node == 1 { "server" } else { "client" }
        ));
    }
    row.verified_zero = ok;
    row.pass = !r1.hung && !r2.hung && (ok || reported.is_some());
}

/// Both refuse at setup in time, saying `says`.
fn both_fail(o: &Outcome, row: &mut Row, within: Duration, says: &str) {
    let (r1, r2) = (o.r1, o.r2);
    row.expected = format!(
        "both refuse at setup: exit non-zero with \"{says}\" within {:.1} s, no hang",
        within.as_secs_f64()
    );
    row.observed = format!("server {}, client {}", describe(r1), describe(r2));
    row.time_to_error_s = Some(r1.elapsed_s.max(r2.elapsed_s));
    row.messages = o.tail(2, 1);
    let refused = |r: &NodeResult, node: u8| {
        !r.hung
            && r.status.is_some_and(|s| s != 0)
            && r.elapsed_s <= within.as_secs_f64()
            && o.tail(node, 3).contains(says)
    };
    row.pass = refused(r1, 1) && refused(r2, 2);
}

/// Both nodes receive packets in every sample and report no error.
fn keeps_moving(o: &Outcome, row: &mut Row, c: &Case) {
    let (r1, r2) = (o.r1, o.r2);
    let count = match c.fault {
        Fault::Sample { count } => count as usize,
        _ => 0,
    };
    row.expected =
        format!("both nodes receive packets in each of {count} 1-s samples; no error until killed");
    let show = |r: &NodeResult| {
        let v: Vec<String> = r.samples.iter().map(u64::to_string).collect();
        format!("[{}] pkt/s, {}", v.join(", "), describe(r))
    };
    row.observed = format!("server {}; client {}", show(r1), show(r2));
    let moving = |r: &NodeResult| {
        count > 0
            && r.samples.len() == count
            && r.samples.iter().all(|n| *n > 0)
            && !r.hung
            && (r.killed || r.status == Some(0))
            && r.problem.is_none()
            && !r.printed_error
    };
    row.pass = moving(r1) && moving(r2);
    if !row.pass {
        row.messages = format!("server: {} || client: {}", o.tail(1, 2), o.tail(2, 2));
    }
}

/// The client exits non-zero in time, saying `says`.
fn client_fails(o: &Outcome, row: &mut Row, within: Duration, says: &str) {
    let r2 = o.r2;
    row.expected = format!(
        "client exits non-zero with a typed error within {:.1} s",
        within.as_secs_f64()
    );
    row.observed = format!("client {}", describe(r2));
    row.time_to_error_s = Some(r2.elapsed_s);
    row.messages = o.tail(2, 2);
    row.pass = !r2.hung
        && r2.status.is_some_and(|s| s != 0)
        && r2.elapsed_s <= within.as_secs_f64()
        && row.messages.contains(says);
}
