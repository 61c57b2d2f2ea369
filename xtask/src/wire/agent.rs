//! The wire agent: this node's half of every case of a set, run in step with the other
//! node through barrier files, with this node's part of each fault.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::{Case, Fault, NodeResult, POLL, RETRY_FAST, Side, cases};
use crate::{Error, Result};

/// How long an agent waits for the other at a barrier.
const BARRIER_WAIT: Duration = Duration::from_secs(90);

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
pub(super) fn poll_until(wait: Duration, mut f: impl FnMut() -> bool) -> bool {
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
pub(super) fn listening(port: u16) -> bool {
    tcp_socket(1, port, "0A")
}

/// True when a TCP connection whose local (`local`) or remote end is `port` is
/// established (state 01).
pub(super) fn connected(port: u16, local: bool) -> bool {
    tcp_socket(if local { 1 } else { 2 }, port, "01")
}

/// Whether /proc/net/tcp{,6} has a socket in `state` whose address in column
/// `col` (1: local, 2: remote) has `port`.
fn tcp_socket(col: usize, port: u16, state: &str) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[col].ends_with(&want) && cols[3] == state
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
pub(super) fn leaked(before: &[(String, u64)], after: &[(String, u64)]) -> u64 {
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

/// [`Fault::DeviceDelete`]: starts `rdma link delete rxe0` in the background (on rxe it
/// blocks while the device is in use); a failure to start is recorded in `r.problem`.
fn start_device_delete(r: &mut NodeResult) -> Option<Child> {
    match crate::cmd::find_tool("rdma").map(|t| {
        Command::new(t)
            .args(["link", "delete", "rxe0"])
            .stdin(Stdio::null())
            .spawn()
    }) {
        Some(Ok(child)) => Some(child),
        _ => {
            r.problem = Some("cannot run rdma link delete".into());
            None
        }
    }
}

/// Waits up to 10 s for the `rdma link delete` of [`start_device_delete`] after the program
/// exited (rxe cannot disassociate user contexts: the delete completes only once the
/// processes using the device have closed it); kills it and records a problem if it is still
/// blocked, or records its failure.
fn finish_device_delete(mut delete: Child, r: &mut NodeResult) {
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

/// [`Fault::LinkDown`]: cuts this node's side of the wire (`ip link set eth0 down` when
/// `local`, else a 100% netem loss); a failure is recorded in `r.problem`.
fn cut_link(local: bool, r: &mut NodeResult) {
    let cut = if local {
        sys("ip", "link set eth0 down")
    } else {
        sys("tc", "qdisc add dev eth0 root netem loss 100%")
    };
    if let Err(e) = cut {
        r.problem = Some(e);
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
        let examples = exe.parent().ok_or("no binary directory")?.join("examples");
        let program = if let Some(name) = first.strip_prefix("ex:") {
            examples.join(name)
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
        c.env("RDMA_VERBS_EXAMPLES", examples);
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
        let Some(mut act) = self.planned_action(i, c, child, start, r) else {
            return;
        };
        let mut fault_at: Option<Instant> = None;
        let mut link_up_at: Option<Instant> = None;
        let mut deleting: Option<Child> = None;
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
                    deleting = start_device_delete(r);
                    self.touch(i, "fault");
                    fault_at = Some(now);
                }
                if let Fault::LinkDown { down, local, .. } = c.fault {
                    cut_link(local, r);
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
        if fault_at.is_none() && self.fault_seen_late(i, c) {
            // The program exited within one poll of the fault, or (a printed fault) before
            // the marker of the other node's print reached this node, which takes up to two
            // polls: the time to error is at most that (recorded as one poll).
            fault_at = Some(Instant::now() - POLL);
        }
        if link_up_at.is_some() {
            restore(&c.fault);
        }
        if let Some(delete) = deleting {
            finish_device_delete(delete, r);
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

    /// What this node does to case `i` and when: `(when, what)`, what 1 = kill, 2 = link
    /// down, 3 = device delete (timed from the client's start where the fault needs it).
    /// `None` when the case was a [`Fault::Sample`], which this runs to the end here.
    fn planned_action(
        &self,
        i: usize,
        c: &Case,
        child: &mut Child,
        start: Instant,
        r: &mut NodeResult,
    ) -> Option<Option<(Instant, u8)>> {
        let cstart = || poll_until(Duration::from_secs(40), || self.seen(i, "cstart"));
        match &c.fault {
            Fault::Kill { victim, after } if *victim == self.side && cstart() => {
                Some(Some((Instant::now() + *after, 1)))
            }
            Fault::LinkDown { after, .. } if self.side == Side::Client => {
                Some(Some((Instant::now() + *after, 2)))
            }
            Fault::DeviceDelete { after } if self.side == Side::Server && cstart() => {
                Some(Some((Instant::now() + *after, 3)))
            }
            Fault::Sample { count } if self.side == Side::Client || cstart() => {
                self.sample_and_kill(i, child, *count, start + c.limit, r);
                r.elapsed_s = start.elapsed().as_secs_f64();
                None
            }
            _ => Some(None),
        }
    }

    /// After the program exited with no fault seen: whether the fault's marker is there
    /// now, or (a fault printed by the other node) arrives within 2 s.
    fn fault_seen_late(&self, i: usize, c: &Case) -> bool {
        self.seen(i, "fault")
            || matches!(c.fault, Fault::Printed { by, .. } if by != self.side)
                && poll_until(Duration::from_secs(2), || self.seen(i, "fault"))
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
