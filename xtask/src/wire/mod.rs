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

use std::time::Duration;

mod agent;
mod fake_peer;
pub mod mesh;
#[cfg(test)]
mod tests;

use crate::{Error, Result};
pub use agent::agent_command;
pub use fake_peer::fake_peer_command;

/// How often the agent polls files and processes.
pub const POLL: Duration = Duration::from_millis(50);
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
    /// Server command (node 1); `ex:NAME` is our example NAME, else a program in PATH
    /// (which finds the examples' directory in `$RDMA_VERBS_EXAMPLES`). `{peer}` is
    /// replaced by the other node's address, `{addr}` by the own one.
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
        case(
            i,
            "mw_grant (window granted, used, revoked)",
            "ex:mw_grant --server --port 18610",
            "ex:mw_grant --client {peer} --port 18610",
            Some(18610),
        ),
        // Multicast: node 1 receives, node 2 sends to the group (UDP port space, no TCP
        // socket to wait for). The sender starts 2 s late and pauses 3 s after its join (as
        // mckey does), so the receiver has joined first. mckey as receiver exits 0 only
        // when all 20 arrived; ours also verifies each and says how many were lost.
        Case {
            client: shell(
                "sleep 2; exec \"$RDMA_VERBS_EXAMPLES/mcast\" -m 239.1.2.10 -b {addr} -s -C 20",
            ),
            ..case(
                i,
                "mcast: mckey receiver, ours sender",
                "mckey -m 239.1.2.10 -b {addr} -C 20",
                "",
                None,
            )
        },
        Case {
            client: shell("sleep 2; exec mckey -m 239.1.2.11 -b {addr} -s -C 20"),
            ..case(
                i,
                "mcast: ours receiver, mckey sender",
                "ex:mcast -m 239.1.2.11 -b {addr} -C 20",
                "",
                None,
            )
        },
        // rdma_cm UD (SIDR), udaddy's port 7174: 10 datagrams each way. The client that
        // asks before the server listens fails fast (SIDR status 1) and is started again.
        // Ours as client checks every echoed reply; as server each datagram's length and
        // immediate data.
        case(
            i,
            "ud_cm: udaddy server, ours client",
            "udaddy -b {addr} -C 10",
            "ex:ud_cm -s {peer} -C 10",
            None,
        ),
        case(
            i,
            "ud_cm: ours server, udaddy client",
            "ex:ud_cm -b {addr} -C 10",
            "udaddy -s {peer} -C 10",
            None,
        ),
        // The client fails unless its copy's checksum equals the server's: 8 chunks of
        // 1 MiB across the wire, about 7 s (the huge-page destination is covered in one
        // guest by tests/vm_examples.rs).
        Case {
            server: shell(
                "head -c 8388608 /dev/urandom > /dev/shm/file_read.src && \
                 exec \"$RDMA_VERBS_EXAMPLES/file_read\" --server /dev/shm/file_read.src --port 18611",
            ),
            // The longest case, whose time grows with the machine's load: 120 s, not 60 s.
            limit: Duration::from_secs(120),
            ..case(
                i,
                "file_read 8 MiB (checksummed)",
                "",
                "ex:file_read --client {peer} --port 18611 --out /dev/shm/file_read.copy",
                Some(18611),
            )
        },
    ]
}

/// A command run by `sh -c`, where `$RDMA_VERBS_EXAMPLES` is the examples' directory.
fn shell(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
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
        // `faults:WORD|WORD...` / `interop:WORD|WORD...`: the rows of the full matrix (or
        // the interop set) whose scenario or program contains one of the words (a quick
        // rerun of some rows).
        _ if set.starts_with("faults:") => rows_matching(crate::faults::matrix(false), &set[7..]),
        _ if set.starts_with("interop:") => rows_matching(interop(), &set[8..]),
        _ => Err(Error::usage(format!(
            "unknown case set {set:?} (interop, faults-short, ci, faults)"
        ))),
    }
}

/// The rows of `cases` whose scenario or program contains one of the `|`-separated words.
fn rows_matching(cases: Vec<Case>, words: &str) -> Result<Vec<Case>> {
    let rows: Vec<Case> = cases
        .into_iter()
        .filter(|c| {
            words
                .split('|')
                .any(|w| c.scenario.contains(w) || c.program.contains(w))
        })
        .collect();
    if rows.is_empty() {
        Err(Error::usage(format!("no row of the set matches {words:?}")))
    } else {
        Ok(rows)
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
    /// N-node fault phases ([`mesh`]): the program (a link among survivors) was still
    /// running once the survivor's links to the victim had all ended.
    pub alive: bool,
}

impl NodeResult {
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        if let Some(st) = self.status {
            s.push_str(&format!("status={st}\n"));
        }
        for (k, v) in [
            ("hung", self.hung),
            ("killed", self.killed),
            ("early", self.early),
            ("printed_error", self.printed_error),
            ("alive", self.alive),
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
                "alive" => r.alive = true,
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
