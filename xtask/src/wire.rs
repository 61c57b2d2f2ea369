//! Two-node scenarios: the cases `cargo xtask test` (interop, short fault set) and
//! `cargo xtask faults` run across the virtual wire, and the agent that runs them in the
//! guests.
//!
//! The host boots two guests ([`rdma_verbs_vm::run::execute_pair`]) that both run this
//! binary as `xtask wire-agent --set SET --dir DIR`. Both agents walk the same case list
//! ([`cases`]) in step: node 1 always runs the server, node 2 the client. `DIR` lies under
//! `/tmp`, so the guests share the host's `/tmp` read-write (uncached 9p): the agents meet at
//! barrier files there, and each writes, per case `i`, `i.N.out` (its program's output) and
//! `i.N.result` (`key=value` lines, see [`NodeResult`]). The host reads those afterwards
//! ([`crate::faults`]) and judges each case against its [`Expect`].
//!
//! Times: every agent measures on its own clock only. A fault is timed by the node that
//! injects it; the survivor's time to error runs from the moment it sees the fault's marker
//! file (polled every [`POLL`]) to its program's exit, so it is late by at most one poll.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How often the agent polls files and processes.
pub const POLL: Duration = Duration::from_millis(50);
/// How long an agent waits for the other at a barrier.
const BARRIER_WAIT: Duration = Duration::from_secs(90);

/// The node that runs a case's server (node 1) or client (node 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Node 1.
    Server,
    /// Node 2.
    Client,
}

impl Side {
    /// The node number.
    pub fn node(self) -> u8 {
        match self {
            Side::Server => 1,
            Side::Client => 2,
        }
    }

    /// The other side.
    pub fn other(self) -> Side {
        match self {
            Side::Server => Side::Client,
            Side::Client => Side::Server,
        }
    }

    /// "server" or "client".
    pub fn name(self) -> &'static str {
        match self {
            Side::Server => "server",
            Side::Client => "client",
        }
    }
}

/// What is done to a running case.
#[derive(Clone, Debug)]
pub enum Fault {
    /// Nothing: both programs must succeed.
    None,
    /// SIGKILL of `victim`'s program `after` the client started.
    Kill {
        /// Whose program dies.
        victim: Side,
        /// Delay after the client's start.
        after: Duration,
    },
    /// `tc qdisc add dev eth0 root netem ARGS` on both nodes for the whole case.
    Netem(&'static str),
    /// `rdma link delete rxe0` on the server's node `after` the client started (the device
    /// goes away under the running server), re-added when the case ends.
    DeviceDelete {
        /// Delay after the client's start.
        after: Duration,
    },
    /// The client's node cuts its side of the wire `after` the client started and restores
    /// it after `down`: with `local`, `ip link set eth0 down` / `up` (the NIC itself goes
    /// down); else `tc qdisc add dev eth0 root netem loss 100%` / `del` (every packet is
    /// lost on the way, as when a cable or switch fails: the sender sees no error, only
    /// missing ACKs).
    LinkDown {
        /// Delay after the client's start.
        after: Duration,
        /// How long the link stays down.
        down: Duration,
        /// `ip link set down` rather than a 100% loss.
        local: bool,
    },
    /// The fault is the program's own (e.g. a receiver that stops posting receives): it
    /// happens when `by`'s program prints a line containing `text`; the other side's time
    /// to error runs from there.
    Printed {
        /// Whose program prints it.
        by: Side,
        /// The text that marks the fault.
        text: &'static str,
    },
    /// Both nodes sample their eth0 `rx_packets` `count` times (over 1 s each, 2 s apart,
    /// the first 1 s after the client started) while the programs run, then SIGKILL their
    /// program: a long run must keep moving packets the whole time.
    Sample {
        /// Number of 1 s samples.
        count: u32,
    },
}

/// How a case is judged.
#[derive(Clone, Debug)]
pub enum Expect {
    /// Both programs exit 0.
    BothOk,
    /// The survivor exits non-zero (not by our deadline) within `within` of the fault, and
    /// its output contains `says` (a typed error's text).
    SurvivorFails {
        /// The bound on the time to error.
        within: Duration,
        /// Text the survivor's output must contain.
        says: &'static str,
        /// Exit status 0 is right too (a server that treats the peer's disconnection as
        /// the normal end, as rping's does).
        zero_ok: bool,
    },
    /// At least one side exits non-zero within `within` of the fault, printing `says`;
    /// neither hangs.
    OneReports {
        /// The bound on the time to error.
        within: Duration,
        /// Text the reporting side's output must contain.
        says: &'static str,
    },
    /// Both exit 0 (every message verified), or one side reports `says` (a typed
    /// completion error) and neither hangs: the stream may fail, but only loudly.
    OkOrReports {
        /// Text the reporting side's output must contain.
        says: &'static str,
    },
    /// Both programs exit non-zero within `within` of their start, each printing `says` (a
    /// setup both sides must refuse).
    BothFail {
        /// The bound on each program's run time.
        within: Duration,
        /// Text both outputs must contain.
        says: &'static str,
    },
    /// [`Fault::Sample`]: every sample of both nodes is above zero, neither program exited
    /// with an error or printed one before it was killed (or finished).
    KeepsMoving,
    /// The client exits non-zero within `within` of its start, printing `says` (a client
    /// facing a dead address, a closed port or a misbehaving exchange peer).
    ClientFails {
        /// The bound on the client's run time.
        within: Duration,
        /// Text the client's output must contain.
        says: &'static str,
    },
}

/// One two-node scenario.
#[derive(Clone, Debug)]
pub struct Case {
    /// Scenario name, e.g. `interop` or `kill server`.
    pub scenario: String,
    /// The programs, e.g. `rc_pingpong (ours) <- ibv_rc_pingpong`.
    pub program: String,
    /// Server command (node 1); `ex:NAME` is our example NAME, else a program in PATH.
    /// `{peer}` is replaced by the other node's address, `{addr}` by the own one.
    pub server: Vec<String>,
    /// Client command (node 2), the same way.
    pub client: Vec<String>,
    /// TCP port the server listens on before the client may start; `None`: the client is
    /// retried while it fails within [`RETRY_FAST`] (rdma_cm servers show no TCP socket).
    pub listen: Option<u16>,
    /// The fault.
    pub fault: Fault,
    /// How it is judged.
    pub expect: Expect,
    /// Deadline of each program, after which the agent kills it (a hang).
    pub limit: Duration,
}

/// A client that fails this fast, before the server is ready, is started again.
pub const RETRY_FAST: Duration = Duration::from_secs(2);

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

fn case(scenario: &str, program: &str, server: &str, client: &str, listen: Option<u16>) -> Case {
    Case {
        scenario: scenario.into(),
        program: program.into(),
        server: words(server),
        client: words(client),
        listen,
        fault: Fault::None,
        expect: Expect::BothOk,
        limit: Duration::from_secs(60),
    }
}

/// The interop set: our examples against rdma-core's C tools (both roles) and against
/// themselves, across the wire.
fn interop() -> Vec<Case> {
    let i = "interop";
    vec![
        case(
            i,
            "rc_pingpong: ours server, ibv_rc_pingpong client",
            "ex:rc_pingpong -g 1 -n 200 -p 18601",
            "ibv_rc_pingpong -g 1 -n 200 -p 18601 {peer}",
            Some(18601),
        ),
        case(
            i,
            "rc_pingpong: ibv_rc_pingpong server, ours client",
            "ibv_rc_pingpong -g 1 -n 200 -p 18602",
            "ex:rc_pingpong -g 1 -n 200 -p 18602 {peer}",
            Some(18602),
        ),
        case(
            i,
            "rping: C server, ours client",
            "rping -s -a {addr} -p 18603 -C 20 -V",
            "ex:rping -c -a {peer} -p 18603 -C 20 -V",
            None,
        ),
        case(
            i,
            "rping: ours server, C client",
            "ex:rping -s -a {addr} -p 18604 -C 20 -V",
            "rping -c -a {peer} -p 18604 -C 20 -V",
            None,
        ),
        case(
            i,
            "perf write_bw: ours <-> ours",
            "ex:perf write_bw -n 2000 -s 4096 -p 18605",
            "ex:perf write_bw -n 2000 -s 4096 -p 18605 {peer}",
            Some(18605),
        ),
        case(
            i,
            "perf send_bw: ours <-> ours",
            "ex:perf send_bw -n 2000 -s 4096 -p 18606",
            "ex:perf send_bw -n 2000 -s 4096 -p 18606 {peer}",
            Some(18606),
        ),
        case(
            i,
            "send_recv (verified)",
            "ex:send_recv --server --port 18607 --iters 500 --size 4096",
            "ex:send_recv --client {peer} --port 18607 --iters 500 --size 4096",
            Some(18607),
        ),
        case(
            i,
            "rdma_write (verified)",
            "ex:rdma_write --server --port 18608 --iters 200 --size 65536",
            "ex:rdma_write --client {peer} --port 18608 --iters 200 --size 65536",
            Some(18608),
        ),
        case(
            i,
            "rdma_read (verified)",
            "ex:rdma_read --server --port 18609 --iters 200 --size 65536",
            "ex:rdma_read --client {peer} --port 18609 --iters 200 --size 65536",
            Some(18609),
        ),
    ]
}

/// The cases of a set: `interop`, `faults-short` (the short fault matrix), `ci` (both:
/// what `cargo xtask test` runs) or `faults` (the full matrix).
pub fn cases(set: &str) -> Result<Vec<Case>> {
    match set {
        "interop" => Ok(interop()),
        "ci" => Ok(interop()
            .into_iter()
            .chain(crate::faults::matrix(true))
            .collect()),
        "faults-short" => Ok(crate::faults::matrix(true)),
        "faults" => Ok(crate::faults::matrix(false)),
        // `faults:WORD|WORD...`: the rows of the full matrix whose scenario or program
        // contains one of the words (a quick rerun of some rows).
        _ if set.starts_with("faults:") => {
            let word = &set["faults:".len()..];
            let rows: Vec<Case> = crate::faults::matrix(false)
                .into_iter()
                .filter(|c| {
                    word.split('|')
                        .any(|w| c.scenario.contains(w) || c.program.contains(w))
                })
                .collect();
            if rows.is_empty() {
                Err(Error::usage(format!(
                    "no row of the matrix matches {word:?}"
                )))
            } else {
                Ok(rows)
            }
        }
        _ => Err(Error::usage(format!(
            "unknown case set {set:?} (interop, faults-short, ci, faults)"
        ))),
    }
}

/// What one node recorded for one case (`i.N.result`).
#[derive(Clone, Debug, Default)]
pub struct NodeResult {
    /// Exit status; `None` when killed (by the fault or the deadline).
    pub status: Option<i32>,
    /// Killed by the agent at the case's deadline (a hang).
    pub hung: bool,
    /// Killed by the fault (this node was the victim).
    pub killed: bool,
    /// The program exited before the fault was injected.
    pub early: bool,
    /// Seconds the program ran.
    pub elapsed_s: f64,
    /// Seconds from seeing the fault to the program's exit (survivors only).
    pub tte_s: Option<f64>,
    /// Kernel RDMA objects (`rdma res`: pd, cq, qp, mr, cm_id, ...) this node held after
    /// the case beyond those it held before it; `None` when `rdma res` could not be read.
    pub leaked: Option<u64>,
    /// [`Fault::Sample`]: eth0 packets received in each 1 s sample.
    pub samples: Vec<u64>,
    /// [`Fault::Sample`]: the program's output had an error in it when sampling ended
    /// (before either node killed its program).
    pub printed_error: bool,
    /// Problems of the agent itself (barrier timeouts, a program that did not start).
    pub problem: Option<String>,
}

impl NodeResult {
    fn to_text(&self) -> String {
        let mut s = String::new();
        if let Some(st) = self.status {
            s.push_str(&format!("status={st}\n"));
        }
        for (k, v) in [
            ("hung", self.hung),
            ("killed", self.killed),
            ("early", self.early),
            ("printed_error", self.printed_error),
        ] {
            if v {
                s.push_str(&format!("{k}=1\n"));
            }
        }
        s.push_str(&format!("elapsed_s={:.3}\n", self.elapsed_s));
        if let Some(t) = self.tte_s {
            s.push_str(&format!("tte_s={t:.3}\n"));
        }
        if let Some(n) = self.leaked {
            s.push_str(&format!("leaked={n}\n"));
        }
        if !self.samples.is_empty() {
            let v: Vec<String> = self.samples.iter().map(u64::to_string).collect();
            s.push_str(&format!("samples={}\n", v.join(",")));
        }
        if let Some(p) = &self.problem {
            s.push_str(&format!("problem={}\n", p.replace('\n', " ")));
        }
        s
    }

    /// Parses what [`to_text`](Self::to_text) wrote.
    pub fn parse(text: &str) -> NodeResult {
        let mut r = NodeResult::default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            match k {
                "status" => r.status = v.parse().ok(),
                "hung" => r.hung = true,
                "killed" => r.killed = true,
                "early" => r.early = true,
                "printed_error" => r.printed_error = true,
                "elapsed_s" => r.elapsed_s = v.parse().unwrap_or(0.0),
                "tte_s" => r.tte_s = v.parse().ok(),
                "leaked" => r.leaked = v.parse().ok(),
                "samples" => r.samples = v.split(',').filter_map(|n| n.parse().ok()).collect(),
                "problem" => r.problem = Some(v.to_owned()),
                _ => {}
            }
        }
        r
    }
}

/// `xtask wire-agent --set SET --dir DIR`: runs this node's half of every case of SET.
pub fn agent_command(args: Vec<OsString>) -> Result<u8> {
    let mut set = None;
    let mut dir = None;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--set") => set = it.next().and_then(|v| v.into_string().ok()),
            Some("--dir") => dir = it.next().map(PathBuf::from),
            _ => return Err(Error::usage(format!("wire-agent: unexpected {a:?}"))),
        }
    }
    let (Some(set), Some(dir)) = (set, dir) else {
        return Err(Error::usage("wire-agent needs --set SET --dir DIR"));
    };
    let env = |name: &str| {
        std::env::var(name).map_err(|_| Error::new(format!("wire-agent: {name} is not set")))
    };
    let node: u8 = env("RDMA_VERBS_NODE")?
        .parse()
        .map_err(|_| Error::new("wire-agent: bad RDMA_VERBS_NODE"))?;
    let side = if node == 1 {
        Side::Server
    } else {
        Side::Client
    };
    let agent = Agent {
        dir,
        side,
        addr: env("RDMA_VERBS_ADDR")?,
        peer: env("RDMA_VERBS_PEER")?,
    };
    for (i, c) in cases(&set)?.iter().enumerate() {
        let result = agent.run_case(i, c);
        println!(
            "case {i}: {} / {}: {}",
            c.scenario,
            c.program,
            result.to_text().trim().replace('\n', ", ")
        );
        let path = agent.dir.join(format!("{i}.{node}.result"));
        fs::write(&path, result.to_text())
            .map_err(|e| Error::new(format!("cannot write {}: {e}", path.display())))?;
    }
    Ok(0)
}

/// This node's view of a run.
struct Agent {
    dir: PathBuf,
    side: Side,
    addr: String,
    peer: String,
}

/// Polls `f` every [`POLL`] until it is true or `wait` passed; whether it became true.
fn poll_until(wait: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + wait;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        thread::sleep(POLL);
    }
}

/// True when something listens on TCP `port` (/proc/net/tcp{,6}, state 0A).
fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
            })
    })
}

/// Undoes a [`Fault::LinkDown`].
fn restore(fault: &Fault) {
    if let Fault::LinkDown { local, .. } = fault {
        let _ = if *local {
            sys("ip", "link set eth0 up")
        } else {
            sys("tc", "qdisc del dev eth0 root")
        };
    }
}

/// Kernel RDMA object counts of this node, by kind, summed over devices (`rdma res`:
/// `0: rxe0: pd 1 cq 2 qp 2 cm_id 0 mr 2 ctx 1 srq 0`).
fn res_counts() -> Option<Vec<(String, u64)>> {
    let path = crate::cmd::find_tool("rdma")?;
    let out = Command::new(path).arg("res").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let mut counts: Vec<(String, u64)> = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let words: Vec<&str> = line.split_whitespace().skip(2).collect();
        for pair in words.chunks(2) {
            if let [kind, n] = pair
                && let Ok(n) = n.parse::<u64>()
            {
                match counts.iter_mut().find(|(k, _)| k == kind) {
                    Some((_, c)) => *c += n,
                    None => counts.push(((*kind).to_owned(), n)),
                }
            }
        }
    }
    Some(counts)
}

/// Objects in `after` beyond those in `before`, summed over kinds.
fn leaked(before: &[(String, u64)], after: &[(String, u64)]) -> u64 {
    after
        .iter()
        .map(|(k, n)| {
            let was = before.iter().find(|(b, _)| b == k).map_or(0, |(_, c)| *c);
            n.saturating_sub(was)
        })
        .sum()
}

/// Runs a system tool (`tc`, `ip`) found in the sbin directories; its failure is reported.
pub fn sys(tool: &str, args: &str) -> std::result::Result<(), String> {
    let path = crate::cmd::find_tool(tool).ok_or_else(|| format!("{tool} not found"))?;
    let out = Command::new(path)
        .args(args.split_whitespace())
        .output()
        .map_err(|e| format!("{tool}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{tool} {args}` failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Agent {
    fn mark(&self, i: usize, what: &str) -> PathBuf {
        self.dir.join(format!("{i}.{what}"))
    }

    fn touch(&self, i: usize, what: &str) {
        let _ = fs::write(self.mark(i, what), b"");
    }

    fn seen(&self, i: usize, what: &str) -> bool {
        self.mark(i, what).exists()
    }

    /// Both nodes reach `what` of case `i`; false if the other did not come in time.
    fn barrier(&self, i: usize, what: &str) -> bool {
        let me = self.side.node();
        self.touch(i, &format!("{what}.{me}"));
        let other = format!("{what}.{}", 3 - me);
        poll_until(BARRIER_WAIT, || self.seen(i, &other))
    }

    fn command(&self, argv: &[String], out: &Path) -> std::result::Result<Command, String> {
        let fill = |s: &String| {
            s.replace("{peer}", &self.peer)
                .replace("{addr}", &self.addr)
        };
        let first = argv.first().ok_or("empty command")?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut args: Vec<String> = argv[1..].iter().map(fill).collect();
        let program = if let Some(name) = first.strip_prefix("ex:") {
            exe.parent()
                .ok_or("no binary directory")?
                .join("examples")
                .join(name)
        } else if let Some(sub) = first.strip_prefix("self:") {
            // This binary's own helpers (the fake exchange peer).
            args.insert(0, sub.to_owned());
            exe
        } else {
            PathBuf::from(first)
        };
        let file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .map_err(|e| format!("{}: {e}", out.display()))?;
        let err = file.try_clone().map_err(|e| e.to_string())?;
        let mut c = Command::new(program);
        c.args(args).stdin(Stdio::null()).stdout(file).stderr(err);
        Ok(c)
    }

    fn spawn(&self, argv: &[String], out: &Path) -> std::result::Result<Child, String> {
        self.command(argv, out)?
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", argv[0]))
    }

    fn run_case(&self, i: usize, c: &Case) -> NodeResult {
        let mut r = NodeResult::default();
        if !self.barrier(i, "start") {
            r.problem = Some("the other node never reached the case's start".into());
            return r;
        }
        let before = res_counts();
        if let Fault::Netem(args) = c.fault
            && let Err(e) = sys("tc", &format!("qdisc add dev eth0 root netem {args}"))
        {
            r.problem = Some(e);
        }
        let out = self.mark(i, &format!("{}.out", self.side.node()));
        let outcome = match self.side {
            Side::Server => self.server(i, c, &out, &mut r),
            Side::Client => self.client(i, c, &out, &mut r),
        };
        if let Err(e) = outcome {
            r.problem = Some(e);
        }
        if matches!(c.fault, Fault::Netem(_)) {
            let _ = sys("tc", "qdisc del dev eth0 root");
        }
        if matches!(c.fault, Fault::DeviceDelete { .. })
            && self.side == Side::Server
            && let Err(e) = self.readd_device()
        {
            r.problem.get_or_insert(e);
        }
        // Objects of a process are freed when it exits; give the kernel a moment.
        thread::sleep(Duration::from_millis(300));
        if let (Some(b), Some(a)) = (before, res_counts()) {
            r.leaked = Some(leaked(&b, &a));
        }
        if !self.barrier(i, "end") {
            r.problem
                .get_or_insert_with(|| "the other node never reached the case's end".into());
        }
        r
    }

    /// Puts rxe0 back on eth0 after a [`Fault::DeviceDelete`] and waits until it is ACTIVE.
    fn readd_device(&self) -> std::result::Result<(), String> {
        if !Path::new("/sys/class/infiniband/rxe0").exists() {
            sys("rdma", "link add rxe0 type rxe netdev eth0")?;
        }
        let active = || {
            fs::read_to_string("/sys/class/infiniband/rxe0/ports/1/state")
                .is_ok_and(|s| s.contains("ACTIVE"))
        };
        if poll_until(Duration::from_secs(10), active) {
            Ok(())
        } else {
            Err("rxe0 did not come back ACTIVE".into())
        }
    }

    fn server(
        &self,
        i: usize,
        c: &Case,
        out: &Path,
        r: &mut NodeResult,
    ) -> std::result::Result<(), String> {
        let start = Instant::now();
        if c.server.is_empty() {
            // A client-only case (a dead address or port): nothing runs here.
            self.touch(i, "ready");
            r.status = Some(0);
            return Ok(());
        }
        let mut child = self.spawn(&c.server, out)?;
        if let Some(port) = c.listen {
            let up = poll_until(Duration::from_secs(30), || {
                listening(port) || matches!(child.try_wait(), Ok(Some(_)))
            });
            if !up {
                let _ = child.kill();
            }
        }
        self.touch(i, "ready");
        self.supervise(i, c, &mut child, start, r);
        Ok(())
    }

    fn client(
        &self,
        i: usize,
        c: &Case,
        out: &Path,
        r: &mut NodeResult,
    ) -> std::result::Result<(), String> {
        if !poll_until(Duration::from_secs(40), || self.seen(i, "ready")) {
            return Err("the server never got ready".into());
        }
        let first = Instant::now();
        loop {
            let start = Instant::now();
            let mut child = self.spawn(&c.client, out)?;
            if c.listen.is_none() {
                // Retry a client that fails fast (the rdma_cm server is not bound yet).
                let quick = poll_until(RETRY_FAST, || matches!(child.try_wait(), Ok(Some(_))));
                let failed = quick && !matches!(child.try_wait(), Ok(Some(st)) if st.success());
                if failed && first.elapsed() < Duration::from_secs(20) {
                    let _ = child.wait();
                    thread::sleep(Duration::from_millis(300));
                    continue;
                }
            }
            // The client's start, from which faults are timed: for a retried client, the
            // attempt that did not fail fast (a server killed while its slow start still
            // rejected the first attempts never met a client).
            self.touch(i, "cstart");
            self.supervise(i, c, &mut child, start, r);
            return Ok(());
        }
    }

    /// Waits for this node's program, injecting this node's part of the fault and timing
    /// the other's.
    fn supervise(&self, i: usize, c: &Case, child: &mut Child, start: Instant, r: &mut NodeResult) {
        let cstart = || poll_until(Duration::from_secs(40), || self.seen(i, "cstart"));
        let mut fault_at: Option<Instant> = None;
        let mut act: Option<(Instant, u8)> = None; // (when, what): 1 = kill, 2 = link down
        let mut link_up_at: Option<Instant> = None;
        let mut deleting: Option<Child> = None;
        match &c.fault {
            Fault::Kill { victim, after } if *victim == self.side && cstart() => {
                act = Some((Instant::now() + *after, 1));
            }
            Fault::LinkDown { after, .. } if self.side == Side::Client => {
                act = Some((Instant::now() + *after, 2));
            }
            Fault::DeviceDelete { after } if self.side == Side::Server && cstart() => {
                act = Some((Instant::now() + *after, 3));
            }
            Fault::Sample { count } if self.side == Side::Client || cstart() => {
                self.sample_and_kill(i, child, *count, start + c.limit, r);
                r.elapsed_s = start.elapsed().as_secs_f64();
                return;
            }
            _ => {}
        }
        let out = self.mark(i, &format!("{}.out", self.side.node()));
        let deadline = start + c.limit;
        let status = loop {
            if let Ok(Some(st)) = child.try_wait() {
                break Some(st);
            }
            let now = Instant::now();
            if let Some((when, what)) = act
                && now >= when
            {
                act = None;
                if what == 1 {
                    let _ = child.kill();
                    let _ = child.wait();
                    r.killed = true;
                    self.touch(i, "fault");
                    break None;
                }
                if what == 3 {
                    // In the background: on rxe it blocks while the device is in use.
                    match crate::cmd::find_tool("rdma").map(|t| {
                        Command::new(t)
                            .args(["link", "delete", "rxe0"])
                            .stdin(Stdio::null())
                            .spawn()
                    }) {
                        Some(Ok(child)) => deleting = Some(child),
                        _ => r.problem = Some("cannot run rdma link delete".into()),
                    }
                    self.touch(i, "fault");
                    fault_at = Some(now);
                }
                if let Fault::LinkDown { down, local, .. } = c.fault {
                    let cut = if local {
                        sys("ip", "link set eth0 down")
                    } else {
                        sys("tc", "qdisc add dev eth0 root netem loss 100%")
                    };
                    if let Err(e) = cut {
                        r.problem = Some(e);
                    }
                    self.touch(i, "fault");
                    fault_at = Some(now);
                    link_up_at = Some(now + down);
                }
            }
            if let Some(up) = link_up_at
                && now >= up
            {
                restore(&c.fault);
                link_up_at = None;
            }
            if let Fault::Printed { by, text } = c.fault
                && by == self.side
                && fault_at.is_none()
                && fs::read_to_string(&out).is_ok_and(|o| o.contains(text))
            {
                self.touch(i, "fault");
                fault_at = Some(now);
            }
            if fault_at.is_none() && self.seen(i, "fault") {
                fault_at = Some(now);
            }
            if now >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                r.hung = true;
                break None;
            }
            thread::sleep(POLL);
        };
        if fault_at.is_none()
            && (self.seen(i, "fault")
                || matches!(c.fault, Fault::Printed { by, .. } if by != self.side)
                    && poll_until(Duration::from_secs(2), || self.seen(i, "fault")))
        {
            // The program exited within one poll of the fault, or (a printed fault) before
            // the marker of the other node's print reached this node, which takes up to two
            // polls: the time to error is at most that (recorded as one poll).
            fault_at = Some(Instant::now() - POLL);
        }
        if link_up_at.is_some() {
            restore(&c.fault);
        }
        if let Some(mut delete) = deleting {
            // rxe cannot disassociate user contexts: the delete completes only once the
            // processes using the device have closed it.
            let done = poll_until(Duration::from_secs(10), || {
                matches!(delete.try_wait(), Ok(Some(_)))
            });
            match delete.try_wait() {
                Ok(Some(st)) if st.success() => {}
                Ok(Some(st)) => r.problem = Some(format!("rdma link delete failed: {st}")),
                _ => {
                    let _ = delete.kill();
                    let _ = delete.wait();
                    r.problem = Some(format!(
                        "rdma link delete still blocked {} after the program exited",
                        if done { "" } else { "10 s" }
                    ));
                }
            }
        }
        let end = Instant::now();
        r.elapsed_s = (end - start).as_secs_f64();
        r.status = status.and_then(|s| s.code());
        if act.is_some() && !r.killed {
            r.early = true;
        }
        if let Some(at) = fault_at {
            if !r.killed {
                r.tte_s = Some((end - at).as_secs_f64());
            }
        } else if !matches!(c.fault, Fault::None | Fault::Netem(_)) && !r.killed {
            r.early = true;
        }
    }
}

impl Agent {
    /// [`Fault::Sample`]: `count` samples of this node's eth0 `rx_packets` over 1 s each,
    /// 2 s apart, the first 1 s from now, into `r.samples`. Then, before either node kills
    /// anything (a barrier: the first kill makes the other side report its dead peer),
    /// whether the output has an error in it; then SIGKILL of `child` (recorded in
    /// `r.killed`) unless it exited by itself (its status in `r.status`).
    fn sample_and_kill(
        &self,
        i: usize,
        child: &mut Child,
        count: u32,
        deadline: Instant,
        r: &mut NodeResult,
    ) {
        let rx = || {
            fs::read_to_string("/sys/class/net/eth0/statistics/rx_packets")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
        };
        let exited = |child: &mut Child, wait: Duration| {
            poll_until(wait, || matches!(child.try_wait(), Ok(Some(_))))
        };
        let second = Duration::from_secs(1);
        let mut done = exited(child, second);
        for k in 0..count {
            if k > 0 && !done {
                done = exited(child, second);
            }
            if done || Instant::now() >= deadline {
                break;
            }
            let Some(before) = rx() else {
                r.problem = Some("cannot read eth0's rx_packets".into());
                break;
            };
            done = exited(child, second);
            match rx() {
                Some(after) => r.samples.push(after.saturating_sub(before)),
                None => r.problem = Some("cannot read eth0's rx_packets".into()),
            }
        }
        let exited = matches!(child.try_wait(), Ok(Some(_)));
        let out = self.mark(i, &format!("{}.out", self.side.node()));
        r.printed_error = fs::read_to_string(&out)
            .unwrap_or_default()
            .to_lowercase()
            .contains("error");
        if !self.barrier(i, "sampled") {
            r.problem = Some("the other node never finished sampling".into());
        }
        match child.try_wait() {
            Ok(Some(st)) if exited => r.status = st.code(),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                r.killed = true;
            }
        }
    }
}

/// `xtask fake-peer MODE PORT`: an exchange server that misbehaves, for the fault matrix.
/// It accepts one client on TCP `PORT` and then, by MODE: `garbage` answers with bytes that
/// are no message; `truncate` answers with the first 10 bytes of one and closes; `stall`
/// never answers; `reset` closes with the client's message unread, which makes the kernel
/// send a reset. It gives up after 60 s.
pub fn fake_peer_command(args: Vec<OsString>) -> Result<u8> {
    use std::io::{Read, Write};
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let (Some(mode), Some(port)) = (
        args.first(),
        args.get(1).and_then(|p| p.parse::<u16>().ok()),
    ) else {
        return Err(Error::usage("fake-peer MODE PORT"));
    };
    let io = |e: std::io::Error| Error::new(format!("fake-peer: {e}"));
    let listener = std::net::TcpListener::bind(("0.0.0.0", port)).map_err(io)?;
    listener.set_nonblocking(true).map_err(io)?;
    let limit = Instant::now() + Duration::from_secs(60);
    let mut stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < limit => {
                thread::sleep(POLL)
            }
            Err(e) => return Err(io(e)),
        }
    };
    stream.set_nonblocking(false).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(io)?;
    // Let the client's first message arrive.
    thread::sleep(Duration::from_millis(300));
    match mode.as_str() {
        "garbage" => {
            stream.write_all(&[0xa5; 200]).map_err(io)?;
        }
        "truncate" => {
            let mut first = [0u8; 256];
            let n = stream.read(&mut first).map_err(io)?;
            // Echo back the start of the client's own message, then close.
            stream.write_all(&first[..n.min(10)]).map_err(io)?;
            println!("fake-peer: sent 10 bytes and closed");
            return Ok(0);
        }
        "reset" => {
            println!("fake-peer: closing with unread data (reset)");
            return Ok(0);
        }
        "stall" => {}
        _ => return Err(Error::usage(format!("fake-peer: unknown mode {mode}"))),
    }
    // Hold the connection until the client gives up.
    let mut sink = [0u8; 4096];
    while Instant::now() < limit {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    println!("fake-peer: the client closed the connection");
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_results_round_trip() {
        let r = NodeResult {
            status: Some(1),
            early: true,
            elapsed_s: 2.5,
            tte_s: Some(0.25),
            leaked: Some(0),
            samples: vec![12, 0, 7],
            problem: Some("a\nb".into()),
            ..NodeResult::default()
        };
        let back = NodeResult::parse(&r.to_text());
        assert_eq!(back.status, Some(1));
        assert!(back.early && !back.hung && !back.killed);
        assert_eq!(back.tte_s, Some(0.25));
        assert_eq!(back.leaked, Some(0));
        assert_eq!(back.samples, vec![12, 0, 7]);
        assert_eq!(back.problem.as_deref(), Some("a b"));
    }

    #[test]
    fn leaks_count_only_growth() {
        let before = vec![("qp".to_string(), 1), ("pd".to_string(), 1)];
        let after = vec![
            ("qp".to_string(), 3),
            ("pd".to_string(), 0),
            ("mr".to_string(), 2),
        ];
        assert_eq!(leaked(&before, &after), 4);
    }

    #[test]
    fn every_set_has_cases_with_clients() {
        for set in ["interop", "faults-short", "ci", "faults", "faults:RNR"] {
            let cases = cases(set).unwrap_or_default();
            assert!(!cases.is_empty(), "{set}");
            for c in &cases {
                assert!(!c.client.is_empty(), "{set}: {} has no client", c.program);
            }
        }
        assert!(cases("nope").is_err());
        assert!(cases("faults:no such row").is_err());
    }
}
