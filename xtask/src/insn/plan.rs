//! `cargo xtask insn`'s command line: the usage text and the plans it parses
//! (one per `--then` group).

use std::ffi::OsString;
use std::time::Duration;

use super::async_rows;
use crate::{Error, Result};

const USAGE: &str = "\
usage: cargo xtask insn [--tests T,..] [--sizes S,..] [--post-list L,..] [--paths P,..]
                        [--iters N1,N2] [--side client|server] [--check RATIO]
                        [--check-scoped RATIO] [--reps N] [--timeout SECS]
                        [--send-api extended|legacy] [--jobs N] [--inflight N,..]
                        [--cq-mod Q] [--check-async RATIO] [--receiver busy|burst]
                        [--check-receiver RATIO] [--then OPTIONS...]

  --tests      write_bw,send_bw,read_bw,atomic_bw (default write_bw,send_bw,read_bw)
  --sizes      message sizes in bytes (default 2; atomic_bw always 8)
  --post-list  WRs per post call, perftest's -l (default 1,8)
  --paths      perftest,safe,raw,scoped,async,async-tasks,async-stream (default the first
               four; scoped: perf --scoped, Cq::scope; async: perf --async N, write_bw and
               send_bw at -l 1 through rdma_verbs::tokio on a current-thread runtime, one
               task with N operations in flight; async-tasks: N tasks of one each;
               async-stream: AsyncQp::post_send and AsyncCq::next_batch, N in flight; safe
               always with them)
  --inflight   async: requests in flight, a row each (default 1,16)
  --cq-mod     perftest's -Q on every run (default: not given, perftest's 100; with async
               in --paths 1, as every async request is awaited, so signaled)
  --check-async  exit 1 if async/safe at the largest --inflight exceeds RATIO
  --iters      the two iteration counts (default 2000,8000)
  --side       which side runs under callgrind (default client; server: the receiver
               of send_bw, the only test whose server works per message; its poll
               calls are counted and their cost fitted out, which needs --reps 2 or more)
  --receiver   how perf's send_bw receiver meets the messages: busy (default; it polls
               while the sender sends, and with --side server its empty polls are fitted
               out) or burst (perf --rx-burst: every receive is posted before the run and
               read only once the sender is done, so no poll comes back empty and one run
               per count gives the figure). With --side client, burst also runs the
               receiver of the plan's send_bw jobs of paths raw and scoped under callgrind,
               in the same runs, and prints its figures apart
  --check-receiver  with --side client and --receiver burst: exit 1 if the receiver's
               scoped/raw exceeds RATIO
  --check      exit 1 if safe/raw instructions per message exceed RATIO anywhere
  --check-scoped  the same for scoped/raw
  --reps       runs of each pair (default 1): the figure is the median of their
               differences (busy-polling loops count their empty polls, so a
               figure can move between runs; perftest's more than ours)
  --timeout    limit for the whole guest run (default 1800)
  --send-api   extended (default): perf posts with the ibv_wr_* API where the
               provider has it (our Qp::new), perftest as it chooses (Debian 12's
               perftest 4.5 keeps ibv_post_send on rxe: \"ibv_wr* API : OFF\" in its
               banner); legacy: both with ibv_post_send (--use_old_post_send on both)
  --jobs       jobs (client and server pairs) the guest runs at the same time, 1 to 4
               (default 1); with --then, the largest given
  --then       a further set of the options above, measured in the same guest and
               reported and checked on its own (same --side and --send-api; the guest's
               limit is the largest --timeout)";
const KNOWN_TESTS: &[&str] = &["write_bw", "send_bw", "read_bw", "atomic_bw"];
const KNOWN_PATHS: &[&str] = &[
    "perftest",
    "safe",
    "raw",
    "scoped",
    "async",
    "async-tasks",
    "async-stream",
];
pub(super) struct Plan {
    pub(super) tests: Vec<String>,
    pub(super) sizes: Vec<u64>,
    pub(super) post_lists: Vec<u64>,
    pub(super) paths: Vec<String>,
    pub(super) iters: (u64, u64),
    /// Runs of each (N1, N2) pair; the figure is the median.
    pub(super) reps: u32,
    pub(super) check: Option<f64>,
    pub(super) check_scoped: Option<f64>,
    /// The side under callgrind: "client" or "server".
    pub(super) side: String,
    pub(super) timeout: Duration,
    /// `--use_old_post_send` on both tools.
    pub(super) legacy_send: bool,
    /// `--receiver burst`: `perf --rx-burst` on both sides of the send_bw jobs of perf's
    /// paths (with the client side measured, their receiver too).
    pub(super) rx_burst: bool,
    /// Largest scoped/raw of the burst receiver measured beside client runs.
    pub(super) check_receiver: Option<f64>,
    /// Jobs the guest runs at the same time.
    pub(super) jobs: u32,
    /// `async`: requests in flight, one row each.
    pub(super) inflight: Vec<u32>,
    /// perftest's `-Q` on every run (`None`: not given).
    pub(super) cq_mod: Option<u32>,
    /// Largest async/safe at the largest in-flight count.
    pub(super) check_async: Option<f64>,
}

fn list<T: std::str::FromStr>(v: &str, what: &str) -> Result<Vec<T>> {
    v.split(',')
        .map(|s| s.trim().parse::<T>().ok())
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::usage(format!("{what}: bad list {v:?}\n\n{USAGE}")))
}

pub(super) fn parse_args(args: Vec<OsString>) -> Result<Option<Plan>> {
    let mut plan = Plan {
        tests: ["write_bw", "send_bw", "read_bw"]
            .map(String::from)
            .to_vec(),
        sizes: vec![2],
        post_lists: vec![1, 8],
        paths: ["perftest", "safe", "raw", "scoped"]
            .map(String::from)
            .to_vec(),
        iters: (2000, 8000),
        reps: 1,
        check: None,
        check_scoped: None,
        side: "client".into(),
        timeout: Duration::from_secs(1800),
        legacy_send: false,
        rx_burst: false,
        check_receiver: None,
        jobs: 1,
        inflight: vec![1, 16],
        cq_mod: None,
        check_async: None,
    };
    let mut it = args.into_iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(flag) = it.next() {
        if matches!(flag.as_str(), "-h" | "--help") {
            say!("{USAGE}");
            return Ok(None);
        }
        let value = it
            .next()
            .ok_or_else(|| Error::usage(format!("{flag} needs a value\n\n{USAGE}")))?;
        match flag.as_str() {
            "--tests" => plan.tests = list(&value, "--tests")?,
            "--sizes" => plan.sizes = list(&value, "--sizes")?,
            "--post-list" => plan.post_lists = list(&value, "--post-list")?,
            "--side" if value == "client" || value == "server" => plan.side = value,
            "--send-api" if value == "extended" || value == "legacy" => {
                plan.legacy_send = value == "legacy"
            }
            "--receiver" if value == "busy" || value == "burst" => plan.rx_burst = value == "burst",
            "--paths" => plan.paths = list(&value, "--paths")?,
            "--iters" => match list::<u64>(&value, "--iters")?[..] {
                [a, b] if 0 < a && a < b => plan.iters = (a, b),
                _ => return Err(Error::usage("--iters needs N1,N2 with 0 < N1 < N2")),
            },
            "--inflight" => plan.inflight = list(&value, "--inflight")?,
            "--cq-mod" => {
                plan.cq_mod = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|&q: &u32| q > 0)
                        .ok_or_else(|| Error::usage("--cq-mod needs a positive count"))?,
                )
            }
            "--check-async" => plan.check_async = Some(async_rows::ratio_arg(&value)?),
            "--check-receiver" => {
                plan.check_receiver = Some(
                    value
                        .parse()
                        .ok()
                        .filter(|r: &f64| *r > 0.0)
                        .ok_or_else(|| Error::usage("--check-receiver needs a positive ratio"))?,
                )
            }
            "--check" | "--check-scoped" => {
                let ratio = value
                    .parse()
                    .ok()
                    .filter(|r: &f64| *r > 0.0)
                    .ok_or_else(|| Error::usage(format!("{flag} needs a positive ratio")))?;
                if flag == "--check" {
                    plan.check = Some(ratio);
                } else {
                    plan.check_scoped = Some(ratio);
                }
            }
            "--jobs" => {
                plan.jobs = value
                    .parse()
                    .ok()
                    .filter(|j: &u32| (1..=4).contains(j))
                    .ok_or_else(|| Error::usage("--jobs needs 1 to 4"))?
            }
            "--reps" => {
                plan.reps = value
                    .parse()
                    .ok()
                    .filter(|&r: &u32| r > 0)
                    .ok_or_else(|| Error::usage("--reps needs a positive count"))?
            }
            "--timeout" => {
                plan.timeout = crate::parse_secs(&value)
                    .map_err(|e| Error::usage(format!("--timeout: {e}")))?
            }
            other => return Err(Error::usage(format!("unknown option {other:?}\n\n{USAGE}"))),
        }
    }
    validate(&plan)?;
    async_rows::complete(&mut plan)?;
    Ok(Some(plan))
}

/// Refuses unknown tests and paths and zero sizes or post lists.
fn validate(plan: &Plan) -> Result<()> {
    if let Some(bad) = plan
        .tests
        .iter()
        .find(|t| !KNOWN_TESTS.contains(&t.as_str()))
    {
        return Err(Error::usage(format!("unknown test {bad:?}\n\n{USAGE}")));
    }
    if let Some(bad) = plan
        .paths
        .iter()
        .find(|p| !KNOWN_PATHS.contains(&p.as_str()))
    {
        return Err(Error::usage(format!("unknown path {bad:?}\n\n{USAGE}")));
    }
    if plan.sizes.contains(&0) || plan.post_lists.contains(&0) {
        return Err(Error::usage("sizes and post lists must be positive"));
    }
    if plan.rx_burst
        && plan.side == "server"
        && (plan.tests.iter().any(|t| t != "send_bw")
            || plan
                .paths
                .iter()
                .any(|p| !matches!(p.as_str(), "safe" | "raw" | "scoped")))
    {
        return Err(Error::usage(
            "--side server --receiver burst measures perf's send_bw receiver: --tests \
             send_bw and the paths safe, raw or scoped",
        ));
    }
    if plan.check_receiver.is_some() && (plan.side != "client" || !plan.rx_burst) {
        return Err(Error::usage(
            "--check-receiver needs --side client and --receiver burst",
        ));
    }
    Ok(())
}

/// The plans of `args`: groups of options separated by `--then`, measured in one guest.
/// They must agree on `--side` and `--send-api` (the guest script's settings); the guest's
/// time limit is the largest `--timeout`. `None` after `--help`.
pub(super) fn parse_plans(args: Vec<OsString>) -> Result<Option<Vec<Plan>>> {
    let mut groups: Vec<Vec<OsString>> = vec![Vec::new()];
    for arg in args {
        if arg == "--then" {
            groups.push(Vec::new());
        } else if let Some(group) = groups.last_mut() {
            group.push(arg);
        }
    }
    let mut plans = Vec::new();
    for group in groups {
        let Some(plan) = parse_args(group)? else {
            return Ok(None);
        };
        plans.push(plan);
    }
    if plans
        .iter()
        .any(|p| p.side != plans[0].side || p.legacy_send != plans[0].legacy_send)
    {
        return Err(Error::usage(
            "plans joined with --then must use the same --side and --send-api",
        ));
    }
    Ok(Some(plans))
}
