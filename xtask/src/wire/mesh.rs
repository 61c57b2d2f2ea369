//! The N-node agent (`xtask mesh-agent --dir DIR --iters K`): this node's part of the
//! all-to-all phases of `cargo xtask nodes` ([`crate::nodes`]), run in step with the other
//! nodes through barrier files in DIR, as the two-node agent does.
//!
//! In each phase every ordered pair of nodes (FROM, TO) is one link: TO runs the example's
//! server, FROM its client, so every node sends to every other node and receives from
//! each. Per phase `p` and link, each side writes `p.FROM-TO.ROLE.out` (the program's
//! output) and `p.FROM-TO.ROLE.result` ([`NodeResult`] lines). In a fault phase the last
//! node is the victim: 2 s after every client started it SIGKILLs its programs
//! ([`MeshFault::Kill`]) or cuts its side of the switch with a 100% netem loss
//! ([`MeshFault::Cut`]). Each survivor times its programs on links to the victim from the
//! moment it sees the fault's marker file, and records which of its other programs (links
//! among the survivors) were still running once all of those had ended (`alive`); those
//! are then stopped, and the next phase checks the survivors with a fresh verified
//! exchange.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::agent::{connected, listening, poll_until, sys};
use super::{NodeResult, POLL, Side};
use crate::{Error, Result};

/// How long an agent waits for the others at a barrier.
const BARRIER_WAIT: Duration = Duration::from_secs(120);
/// The fault's delay after every link to the victim is connected.
const FAULT_AFTER: Duration = Duration::from_secs(2);
/// How long the victim waits for its links' exchange connections: a client starting
/// in a guest that shares 2 cores with three others can take longer than
/// [`FAULT_AFTER`] to connect, and one that never connected would meet a listener
/// already gone (not the fault the phase is about).
const CONNECT_WAIT: Duration = Duration::from_secs(60);
/// Iterations of the streams that a fault interrupts (they never end by themselves).
const ENDLESS: usize = 1_000_000;

/// What the victim does in a fault phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MeshFault {
    /// SIGKILL of all its programs.
    Kill,
    /// `tc qdisc add dev eth0 root netem loss 100%`: nothing it sends arrives (as when its
    /// cable fails), until the phase ends.
    Cut,
}

/// One all-to-all phase.
#[derive(Clone, Debug)]
pub struct Phase {
    /// Its name in the table.
    pub name: &'static str,
    /// The example run on each link: `send_recv` (RC) or `ud_send` (UD).
    pub program: &'static str,
    /// Message size in bytes.
    pub size: usize,
    /// Messages per link; [`ENDLESS`] in fault phases.
    pub iters: usize,
    /// Nodes 1 to `nodes` take part.
    pub nodes: u8,
    /// The victim's fault (the victim is node `nodes`).
    pub fault: Option<MeshFault>,
    /// The deadline of each program; in a fault phase, of each program on a link to the
    /// victim from the fault on.
    pub limit: Duration,
}

/// The phases for `nodes` nodes with `k` messages per link: RC and UD among all, then the
/// last node SIGKILLed and cut off, each followed by an RC exchange among the others.
pub fn phases(nodes: u8, k: usize) -> Vec<Phase> {
    let all = |name, program, size| Phase {
        name,
        program,
        size,
        iters: k,
        nodes,
        fault: None,
        limit: Duration::from_secs(120),
    };
    let fault = |name, fault| Phase {
        iters: ENDLESS,
        fault: Some(fault),
        limit: FAULT_BOUND,
        ..all(name, "send_recv", 4096)
    };
    let survivors = |name| Phase {
        nodes: nodes - 1,
        ..all(name, "send_recv", 4096)
    };
    vec![
        all("RC all-to-all", "send_recv", 4096),
        all("UD all-to-all", "ud_send", 512),
        fault("SIGKILL of the last node", MeshFault::Kill),
        survivors("survivors' RC after SIGKILL"),
        fault("link cut of the last node", MeshFault::Cut),
        survivors("survivors' RC after the cut"),
    ]
}

/// The bound on a survivor's time to error after a fault: its program may be blocked in
/// the examples' 30 s receive wait (the peer went silent), plus scheduling slack under
/// emulation (the two-node matrix's SIGKILL bound).
pub const FAULT_BOUND: Duration = Duration::from_secs(35);

/// The ordered pairs (FROM, TO) of nodes 1 to `nodes`.
pub fn links(nodes: u8) -> Vec<(u8, u8)> {
    (1..=nodes)
        .flat_map(|from| {
            (1..=nodes)
                .filter(move |&to| to != from)
                .map(move |to| (from, to))
        })
        .collect()
}

/// The TCP port of link (FROM, TO) in phase `p`.
pub fn port(p: usize, (from, to): (u8, u8)) -> u16 {
    19000 + 100 * p as u16 + 10 * u16::from(from) + u16::from(to)
}

/// The file stem of link (FROM, TO)'s `role` in phase `p`.
pub fn stem(p: usize, (from, to): (u8, u8), role: Side) -> String {
    format!("{p}.{from}-{to}.{}", role.name())
}

/// One program this node runs in a phase.
struct Prog {
    link: (u8, u8),
    role: Side,
    child: Child,
    start: Instant,
    ended: Option<Instant>,
    result: NodeResult,
}

impl Prog {
    /// Whether it has exited (recording when and how).
    fn poll(&mut self) -> bool {
        if self.ended.is_some() {
            return true;
        }
        if let Ok(Some(st)) = self.child.try_wait() {
            self.ended = Some(Instant::now());
            self.result.status = st.code();
            return true;
        }
        false
    }

    /// SIGKILL, if it still runs; `hung`: at the deadline, else by the fault or the agent.
    fn kill(&mut self, hung: bool) {
        if self.poll() {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.ended = Some(Instant::now());
        if hung {
            self.result.hung = true;
        } else {
            self.result.killed = true;
        }
    }
}

/// `xtask mesh-agent --dir DIR --iters K`.
pub fn mesh_agent_command(args: Vec<OsString>) -> Result<u8> {
    let mut dir = None;
    let mut iters = None;
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--dir") => dir = it.next().map(PathBuf::from),
            Some("--iters") => iters = it.next().and_then(|v| v.to_str()?.parse::<usize>().ok()),
            _ => return Err(Error::usage(format!("mesh-agent: unexpected {a:?}"))),
        }
    }
    let (Some(dir), Some(iters)) = (dir, iters) else {
        return Err(Error::usage("mesh-agent needs --dir DIR --iters K"));
    };
    let env = |name: &str| -> Result<u8> {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::new(format!("mesh-agent: {name} is not set")))
    };
    let agent = Mesh {
        dir,
        me: env("RDMA_VERBS_NODE")?,
        nodes: env("RDMA_VERBS_NODES")?,
    };
    // Seconds since this guest booted: the boot-to-command time the host reports.
    if let Some(up) = fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
    {
        let _ = fs::write(agent.dir.join(format!("boot.{}", agent.me)), up);
    }
    for (p, phase) in phases(agent.nodes, iters).iter().enumerate() {
        for prog in agent.run_phase(p, phase) {
            println!(
                "phase {p} ({}), link {}->{} {}: {}",
                phase.name,
                prog.link.0,
                prog.link.1,
                prog.role.name(),
                prog.result.to_text().trim().replace('\n', ", ")
            );
        }
    }
    Ok(0)
}

/// This node's view of a run.
struct Mesh {
    dir: PathBuf,
    me: u8,
    nodes: u8,
}

impl Mesh {
    fn mark(&self, p: usize, what: &str) -> PathBuf {
        self.dir.join(format!("{p}.{what}"))
    }

    fn touch(&self, p: usize, what: &str) {
        let _ = fs::write(self.mark(p, what), b"");
    }

    /// Every node reaches `what` of phase `p`; false if one did not come in time.
    fn barrier(&self, p: usize, what: &str) -> bool {
        self.touch(p, &format!("{what}.{}", self.me));
        poll_until(BARRIER_WAIT, || {
            (1..=self.nodes).all(|n| self.mark(p, &format!("{what}.{n}")).exists())
        })
    }

    /// Starts `role` of `link` in phase `p`.
    fn spawn(&self, p: usize, phase: &Phase, link: (u8, u8), role: Side) -> Result<Prog> {
        let exe = std::env::current_exe().map_err(|e| Error::new(format!("current_exe: {e}")))?;
        let examples = exe
            .parent()
            .ok_or_else(|| Error::new("no binary directory"))?
            .join("examples");
        let out = self.dir.join(format!("{}.out", stem(p, link, role)));
        let file =
            fs::File::create(&out).map_err(|e| Error::new(format!("{}: {e}", out.display())))?;
        let err = file
            .try_clone()
            .map_err(|e| Error::new(format!("{}: {e}", out.display())))?;
        let mut c = Command::new(examples.join(phase.program));
        match role {
            Side::Server => c.arg("--server"),
            Side::Client => c.args(["--client", &rdma_verbs_vm::vm::wire_addr(link.1)]),
        };
        let seed = 1000 * p + 10 * usize::from(link.0) + usize::from(link.1);
        c.args(["--port", &port(p, link).to_string()])
            .args(["--iters", &phase.iters.to_string()])
            .args(["--size", &phase.size.to_string()])
            .args(["--seed", &seed.to_string()])
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(err);
        let child = c
            .spawn()
            .map_err(|e| Error::new(format!("cannot start {}: {e}", phase.program)))?;
        Ok(Prog {
            link,
            role,
            child,
            start: Instant::now(),
            ended: None,
            result: NodeResult::default(),
        })
    }

    /// Starts this node's servers, then (once every node's servers listen) its clients.
    fn start_all(&self, p: usize, phase: &Phase, problem: &mut Option<String>) -> Vec<Prog> {
        let mine = links(phase.nodes);
        let mut progs = Vec::new();
        let start = |link, role, progs: &mut Vec<Prog>, problem: &mut Option<String>| match self
            .spawn(p, phase, link, role)
        {
            Ok(prog) => progs.push(prog),
            Err(e) => *problem = Some(e.message),
        };
        if self.me <= phase.nodes {
            for &link in mine.iter().filter(|l| l.1 == self.me) {
                start(link, Side::Server, &mut progs, problem);
            }
            let ports: Vec<u16> = progs.iter().map(|pr| port(p, pr.link)).collect();
            if !poll_until(Duration::from_secs(30), || {
                ports.iter().all(|&pt| listening(pt))
            }) {
                *problem = Some("a server did not listen within 30 s".into());
            }
        }
        if !self.barrier(p, "ready") {
            *problem = Some("another node's servers never got ready".into());
        }
        if self.me <= phase.nodes {
            for &link in mine.iter().filter(|l| l.0 == self.me) {
                start(link, Side::Client, &mut progs, problem);
            }
        }
        if !self.barrier(p, "cstart") {
            *problem = Some("another node never started its clients".into());
        }
        progs
    }

    /// Runs this node's part of phase `p` and writes its programs' results.
    fn run_phase(&self, p: usize, phase: &Phase) -> Vec<Prog> {
        let mut problem = None;
        if !self.barrier(p, "start") {
            problem = Some("another node never reached the phase's start".into());
        }
        let mut progs = self.start_all(p, phase, &mut problem);
        match phase.fault {
            None => supervise(&mut progs, Instant::now() + phase.limit),
            Some(fault) if self.me == phase.nodes => {
                self.inject(p, fault, &mut progs, &mut problem)
            }
            Some(_) => self.survive(p, phase, &mut progs, &mut problem),
        }
        for prog in &mut progs {
            prog.result.elapsed_s =
                (prog.ended.unwrap_or_else(Instant::now) - prog.start).as_secs_f64();
            prog.result.problem = prog.result.problem.take().or_else(|| problem.clone());
            let path = self
                .dir
                .join(format!("{}.result", stem(p, prog.link, prog.role)));
            let _ = fs::write(path, prog.result.to_text());
        }
        if !self.barrier(p, "end") {
            eprintln!("mesh-agent: phase {p}: another node never reached the phase's end");
        }
        progs
    }

    /// The victim's side of a fault phase.
    fn inject(&self, p: usize, fault: MeshFault, progs: &mut [Prog], problem: &mut Option<String>) {
        // Each program's exchange connection: a server's on its own port, a client's
        // to its peer's (the examples keep it open for the whole run).
        let links: Vec<(u16, bool)> = progs
            .iter()
            .map(|pr| (port(p, pr.link), pr.role == Side::Server))
            .collect();
        if !poll_until(CONNECT_WAIT, || {
            links.iter().all(|&(pt, local)| connected(pt, local))
        }) {
            *problem = Some("a link to the victim did not connect within 60 s".into());
        }
        thread::sleep(FAULT_AFTER);
        match fault {
            MeshFault::Kill => progs.iter_mut().for_each(|pr| pr.kill(false)),
            MeshFault::Cut => {
                if let Err(e) = sys("tc", "qdisc add dev eth0 root netem loss 100%") {
                    *problem = Some(e);
                }
            }
        }
        self.touch(p, "fault");
        if !self.barrier(p, "judged") {
            problem.get_or_insert_with(|| "a survivor never judged the fault".into());
        }
        if fault == MeshFault::Cut {
            let _ = sys("tc", "qdisc del dev eth0 root");
        }
        // Its own programs' fate is not judged: they lost their peers or their link.
        progs.iter_mut().for_each(|pr| pr.kill(false));
    }

    /// A survivor's side of a fault phase: times its programs on links to the victim and
    /// records which of the others still run once those ended.
    fn survive(&self, p: usize, phase: &Phase, progs: &mut [Prog], problem: &mut Option<String>) {
        let victim = phase.nodes;
        let fault_mark = self.mark(p, "fault");
        let seen = poll_until(FAULT_AFTER + Duration::from_secs(30), || {
            fault_mark.exists()
        });
        let fault_at = Instant::now();
        if !seen {
            *problem = Some("the victim's fault marker never came".into());
        }
        let to_victim = |pr: &Prog| pr.link.0 == victim || pr.link.1 == victim;
        let deadline = fault_at + phase.limit;
        loop {
            let mut waiting = false;
            for pr in progs.iter_mut().filter(|pr| to_victim(pr)) {
                if !pr.poll() {
                    waiting = true;
                    if Instant::now() >= deadline {
                        pr.kill(true);
                    }
                }
            }
            if !waiting {
                break;
            }
            thread::sleep(POLL);
        }
        for pr in progs.iter_mut() {
            if to_victim(pr) {
                pr.result.tte_s = pr
                    .ended
                    .map(|e| e.saturating_duration_since(fault_at).as_secs_f64());
            } else {
                pr.result.alive = !pr.poll();
            }
        }
        if !self.barrier(p, "judged") {
            problem.get_or_insert_with(|| "another node never judged the fault".into());
        }
        progs.iter_mut().for_each(|pr| pr.kill(false));
    }
}

/// Waits until every program has exited, killing those still running at `deadline`.
fn supervise(progs: &mut [Prog], deadline: Instant) {
    loop {
        let mut running = false;
        for pr in progs.iter_mut() {
            if !pr.poll() {
                if Instant::now() >= deadline {
                    pr.kill(true);
                } else {
                    running = true;
                }
            }
        }
        if !running {
            return;
        }
        thread::sleep(POLL);
    }
}

/// Reads what a node recorded for `role` of `link` in phase `p`, and the last `n` lines of
/// its program's output.
pub fn read(
    dir: &Path,
    p: usize,
    link: (u8, u8),
    role: Side,
    n: usize,
) -> Option<(NodeResult, String)> {
    let s = stem(p, link, role);
    let result = fs::read_to_string(dir.join(format!("{s}.result"))).ok()?;
    let out = fs::read_to_string(dir.join(format!("{s}.out"))).unwrap_or_default();
    let lines: Vec<&str> = out.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(n)..].join(" | ");
    Some((NodeResult::parse(&result), tail))
}
