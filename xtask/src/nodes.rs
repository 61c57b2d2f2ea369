//! `cargo xtask nodes`: four guests on the runner's virtual switch, all-to-all verified
//! exchanges over RC and UD, and the fault set's SIGKILL and link cut on one of the four
//! (the phases of [`crate::wire::mesh`]). The host boots the guests, each runs
//! `xtask mesh-agent`, and the host judges every link of every phase from what the agents
//! recorded: one row per link and role in the table and in `target/nodes/nodes.json`.
//!
//! [`run_nodes_check`] is the whole check, for `cargo xtask test` to call.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::faults::Row;
use crate::faults::render::{print_table, to_json};
use crate::run::{Invocation, execute_nodes};
use crate::wire::mesh::{FAULT_BOUND, MeshFault, Phase, links, phases, read};
use crate::wire::{NodeResult, Side};
use crate::{Error, Result};

/// Guests of the check.
pub const NODES: u8 = 4;
/// Messages per link and phase unless `--iters` says otherwise.
pub const DEFAULT_ITERS: usize = 50;

/// What a run of the check found.
pub struct Summary {
    /// Rows that passed.
    pub passed: u64,
    /// Rows that failed.
    pub failed: u64,
    /// Seconds from the first boot to the verdict.
    pub secs: f64,
    /// The slowest guest's seconds from its boot to the agent's start (guest uptime).
    pub boot_s: Option<f64>,
}

/// Runs the phases on [`NODES`] guests with `iters` messages per link, prints the table,
/// writes `target/nodes/nodes.json`. The examples must be built.
pub fn run_nodes_check(iters: usize) -> Result<Summary> {
    let start = Instant::now();
    // Under /tmp, which the guests share read-write (see `wire`).
    let dir = PathBuf::from(format!("/tmp/rdma-verbs-nodes-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).map_err(|e| Error::new(format!("{}: {e}", dir.display())))?;
    let exe = std::env::current_exe().map_err(|e| Error::new(format!("current_exe: {e}")))?;
    let args: Vec<OsString> = vec![
        "mesh-agent".into(),
        "--dir".into(),
        dir.clone().into_os_string(),
        "--iters".into(),
        iters.to_string().into(),
    ];
    let inv = Invocation::new(exe.into_os_string(), args)?;
    let invs = vec![&inv; usize::from(NODES)];
    let code = execute_nodes(&invs, Duration::from_secs(1200))?;
    let phases = phases(NODES, iters);
    let rows: Vec<Row> = phases
        .iter()
        .enumerate()
        .flat_map(|(p, phase)| judge_phase(&dir, p, phase))
        .collect();
    let boot_s = (1..=NODES)
        .filter_map(|n| fs::read_to_string(dir.join(format!("boot.{n}"))).ok())
        .filter_map(|s| s.trim().parse::<f64>().ok())
        .reduce(f64::max);
    let _ = fs::remove_dir_all(&dir);
    print_table(&rows);
    let out = crate::target_dir().join("nodes");
    fs::create_dir_all(&out).map_err(|e| Error::new(format!("{}: {e}", out.display())))?;
    let path = out.join("nodes.json");
    fs::write(&path, to_json(&rows)).map_err(|e| Error::new(format!("{}: {e}", path.display())))?;
    say!("wrote {} (agents' status {code})", path.display());
    let passed = rows.iter().filter(|r| r.pass).count() as u64;
    Ok(Summary {
        passed,
        failed: rows.len() as u64 - passed,
        secs: start.elapsed().as_secs_f64(),
        boot_s,
    })
}

/// `cargo xtask nodes [--iters K]`.
pub fn nodes_command(args: Vec<OsString>) -> Result<u8> {
    let mut iters = DEFAULT_ITERS;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--iters") => {
                iters = it
                    .next()
                    .and_then(|v| v.to_str()?.parse::<usize>().ok())
                    .filter(|&k| (1..=256).contains(&k))
                    .ok_or_else(|| Error::usage("--iters: 1 to 256 messages per link"))?
            }
            _ => return Err(Error::usage(format!("nodes: unexpected {a:?}"))),
        }
    }
    crate::test::build_examples()?;
    let s = run_nodes_check(iters)?;
    say!(
        "nodes: {} passed, {} failed ({:.0} s; the slowest guest started its agent {} s after \
         its boot)",
        s.passed,
        s.failed,
        s.secs,
        s.boot_s.map_or("?".into(), |b| format!("{b:.1}"))
    );
    Ok(if s.failed == 0 { 0 } else { 1 })
}

/// The node that runs `role` of `link`.
fn node_of(link: (u8, u8), role: Side) -> u8 {
    match role {
        Side::Server => link.1,
        Side::Client => link.0,
    }
}

/// The rows of phase `p`: one per link in a clean phase (both sides must exit 0 with
/// every message verified); in a fault phase one per survivor's program.
fn judge_phase(dir: &Path, p: usize, phase: &Phase) -> Vec<Row> {
    let mut rows = Vec::new();
    for link in links(phase.nodes) {
        let row = |observed: String, expected: &str, pass: bool, messages: String| Row {
            scenario: phase.name.into(),
            program: format!("{} {}->{}", phase.program, link.0, link.1),
            expected: expected.into(),
            observed,
            time_to_error_s: None,
            messages,
            verified_zero: false,
            leaked: None,
            pass,
            client_s: 0.0,
        };
        let sides = [Side::Server, Side::Client].map(|role| read(dir, p, link, role, 3));
        let Some(fault) = phase.fault else {
            let [server, client] = sides;
            let (pass, observed, messages) = both_verified(server, client);
            let mut r = row(
                observed,
                "both exit 0, every message verified",
                pass,
                messages,
            );
            r.verified_zero = pass;
            rows.push(r);
            continue;
        };
        for (role, side) in [Side::Server, Side::Client].into_iter().zip(sides) {
            let node = node_of(link, role);
            if node == phase.nodes {
                continue;
            }
            let to_victim = link.0 == phase.nodes || link.1 == phase.nodes;
            let mut r = row(String::new(), "", false, String::new());
            r.program = format!("{} on node {node}", r.program);
            match side {
                None => r.observed = format!("no result from node {node}"),
                Some((res, tail)) if to_victim => {
                    fails_in_time(&mut r, &res, fault, &tail);
                    r.messages = tail;
                }
                Some((res, tail)) => {
                    r.expected = "still exchanging once the links to the victim ended".into();
                    r.pass = res.alive && res.problem.is_none();
                    r.observed = if res.alive {
                        "running".into()
                    } else {
                        format!("ended: {}", describe(&res))
                    };
                    r.messages = tail;
                }
            }
            rows.push(r);
        }
    }
    rows
}

/// The error texts a survivor's program may end with after `fault`: the peer's exchange
/// connection closed (a SIGKILLed peer) or transport retries exhausted (a peer that stopped
/// answering); a receiver whose peer went silent ends with the examples' 30 s timeout.
fn says(fault: MeshFault) -> &'static [&'static str] {
    match fault {
        MeshFault::Kill => &["closed its exchange connection", "RETRY_EXC"],
        MeshFault::Cut => &["RETRY_EXC", "timed out"],
    }
}

/// A survivor's program on a link to the victim: non-zero exit on its own within
/// [`FAULT_BOUND`] of the fault, with one of [`says`]'s texts.
fn fails_in_time(r: &mut Row, res: &NodeResult, fault: MeshFault, tail: &str) {
    let texts = says(fault);
    r.expected = format!(
        "exits non-zero within {} s, saying {}",
        FAULT_BOUND.as_secs(),
        texts.join(" or ")
    );
    r.time_to_error_s = res.tte_s;
    r.observed = describe(res);
    if let Some(problem) = &res.problem {
        r.observed.push_str(&format!("; agent problem: {problem}"));
    }
    r.pass = res.status.is_some_and(|s| s != 0)
        && !res.hung
        && !res.killed
        && res.problem.is_none()
        && res.tte_s.is_some_and(|t| t <= FAULT_BOUND.as_secs_f64())
        && texts.iter().any(|t| tail.contains(t));
}

/// Both sides of a clean link exited 0; the client said it verified every message.
fn both_verified(
    server: Option<(NodeResult, String)>,
    client: Option<(NodeResult, String)>,
) -> (bool, String, String) {
    let (Some((s, stail)), Some((c, ctail))) = (server, client) else {
        return (false, "a node wrote no result".into(), String::new());
    };
    let ok = |r: &NodeResult| r.status == Some(0) && r.problem.is_none();
    let pass = ok(&s) && ok(&c) && ctail.contains("sent and verified");
    let mut observed = format!("server {}, client {}", describe(&s), describe(&c));
    if let Some(problem) = s.problem.as_ref().or(c.problem.as_ref()) {
        observed.push_str(&format!("; agent problem: {problem}"));
    }
    let messages = if pass {
        String::new()
    } else {
        format!("server: {stail} || client: {ctail}")
    };
    (pass, observed, messages)
}

/// A program's end, for the table.
fn describe(r: &NodeResult) -> String {
    if r.hung {
        format!("HUNG (killed at the deadline after {:.1} s)", r.elapsed_s)
    } else if r.killed {
        "killed by the agent".into()
    } else {
        match r.status {
            Some(st) => format!("exit {st} after {:.1} s", r.elapsed_s),
            None => "killed by a signal".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_ordered_pair_is_a_link_with_its_own_port() {
        let all = links(NODES);
        assert_eq!(all.len(), 12);
        let mut ports: Vec<u16> = (0..phases(NODES, 1).len())
            .flat_map(|p| all.iter().map(move |&l| crate::wire::mesh::port(p, l)))
            .collect();
        let n = ports.len();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), n);
        assert_eq!(links(3).len(), 6);
    }

    #[test]
    fn survivors_fail_only_in_time_and_loudly() {
        let mut r = judge_phase(Path::new("/nonexistent"), 2, &phases(NODES, 1)[2]);
        assert!(r.iter().all(|row| !row.pass));
        let res = NodeResult {
            status: Some(1),
            tte_s: Some(0.4),
            ..NodeResult::default()
        };
        let row = &mut r[0];
        fails_in_time(
            row,
            &res,
            MeshFault::Kill,
            "error: the peer closed its exchange connection",
        );
        assert!(row.pass);
        fails_in_time(
            row,
            &res,
            MeshFault::Cut,
            "error: the peer closed its exchange connection",
        );
        assert!(!row.pass, "the wrong error for a cut link");
        let late = NodeResult {
            tte_s: Some(36.0),
            ..res.clone()
        };
        fails_in_time(
            row,
            &late,
            MeshFault::Kill,
            "closed its exchange connection",
        );
        assert!(!row.pass, "too late");
        let ok = NodeResult {
            status: Some(0),
            ..res
        };
        fails_in_time(row, &ok, MeshFault::Kill, "closed its exchange connection");
        assert!(!row.pass, "a survivor must notice");
    }
}
