//! The fault matrix: which programs run under which fault, and the bound each must meet.

use std::time::Duration;

use crate::wire::{Case, Expect, Fault, Side};

/// The SIGKILL bound for a survivor: the slowest path is a side blocked in a 30 s poll of
/// the examples (send_recv's receive wait), plus scheduling slack under emulation.
pub(super) const KILL_BOUND: Duration = Duration::from_secs(35);

pub(super) fn kill_case(
    program: &str,
    server: &str,
    client: &str,
    listen: Option<u16>,
    victim: Side,
) -> Case {
    Case {
        scenario: format!("SIGKILL {} mid-stream", victim.name()),
        program: program.into(),
        server: server.split_whitespace().map(str::to_owned).collect(),
        client: client.split_whitespace().map(str::to_owned).collect(),
        listen,
        fault: Fault::Kill {
            victim,
            after: Duration::from_secs(2),
        },
        expect: Expect::SurvivorFails {
            within: KILL_BOUND,
            says: match (program, victim) {
                ("rping", Side::Client) => "DISCONNECT",
                ("rping", Side::Server) => "disconnected after",
                _ => "error",
            },
            zero_ok: program == "rping" && victim == Side::Client,
        },
        limit: Duration::from_secs(60),
    }
}

pub(super) fn netem_case(
    program: &str,
    server: &str,
    client: &str,
    port: u16,
    netem: &'static str,
) -> Case {
    Case {
        scenario: if netem.is_empty() {
            "clean wire (baseline)".into()
        } else {
            format!("netem {netem}")
        },
        program: program.into(),
        server: server.split_whitespace().map(str::to_owned).collect(),
        client: client.split_whitespace().map(str::to_owned).collect(),
        listen: Some(port),
        fault: if netem.is_empty() {
            Fault::None
        } else {
            Fault::Netem(netem)
        },
        expect: Expect::BothOk,
        limit: Duration::from_secs(120),
    }
}

/// The kill cases: program, server, client, listen port.
pub(super) fn kill_programs() -> Vec<(&'static str, String, String, Option<u16>)> {
    let p = |n: u16| 18700 + n;
    vec![
        (
            "send_recv",
            format!("ex:send_recv --server --port {} --iters 1000000", p(1)),
            format!(
                "ex:send_recv --client {{peer}} --port {} --iters 1000000",
                p(1)
            ),
            Some(p(1)),
        ),
        (
            "rdma_write",
            format!("ex:rdma_write --server --port {} --iters 1000000", p(2)),
            format!(
                "ex:rdma_write --client {{peer}} --port {} --iters 1000000",
                p(2)
            ),
            Some(p(2)),
        ),
        (
            "rdma_read",
            format!("ex:rdma_read --server --port {} --iters 1000000", p(3)),
            format!(
                "ex:rdma_read --client {{peer}} --port {} --iters 1000000",
                p(3)
            ),
            Some(p(3)),
        ),
        (
            "perf write_bw",
            format!("ex:perf write_bw -n 1000000 -s 4096 -p {}", p(4)),
            format!("ex:perf write_bw -n 1000000 -s 4096 -p {} {{peer}}", p(4)),
            Some(p(4)),
        ),
        (
            "perf send_bw",
            format!("ex:perf send_bw -n 1000000 -s 4096 -p {}", p(5)),
            format!("ex:perf send_bw -n 1000000 -s 4096 -p {} {{peer}}", p(5)),
            Some(p(5)),
        ),
        (
            "rc_pingpong",
            format!("ex:rc_pingpong -g 1 -n 1000000 -p {}", p(6)),
            format!("ex:rc_pingpong -g 1 -n 1000000 -p {} {{peer}}", p(6)),
            Some(p(6)),
        ),
        (
            "rping",
            format!("ex:rping -s -a {{addr}} -p {}", p(7)),
            format!("ex:rping -c -a {{peer}} -p {} -C 1000000", p(7)),
            None,
        ),
    ]
}

/// The matrix: `short` is the subset `cargo xtask test` runs.
pub fn matrix(short: bool) -> Vec<Case> {
    let mut cases = kill_cases(short);
    let streams = [
        (
            "send_recv (verified, 300 x 4 KiB)",
            "ex:send_recv --server --port 18720 --iters 300 --size 4096",
            "ex:send_recv --client {peer} --port 18720 --iters 300 --size 4096",
            18720,
        ),
        (
            "rdma_write (verified, 300 x 8 KiB)",
            "ex:rdma_write --server --port 18721 --iters 300 --size 8192",
            "ex:rdma_write --client {peer} --port 18721 --iters 300 --size 8192",
            18721,
        ),
    ];
    let netems: &[&'static str] = if short {
        &["", "loss 1%"]
    } else {
        &[
            "",
            "loss 1%",
            "loss 5%",
            "delay 5ms reorder 25% 50%",
            "duplicate 1%",
            "corrupt 0.1%",
        ]
    };
    let links = link_cases();
    let rnr = rnr_cases();
    if short {
        // The restored-wire row: its verdict does not hang on a timing bound
        // (the short-timeout row's 1.5 x bound is the full matrix's: on a host
        // loaded by other work it was missed by 0.13 s).
        cases.push(links[0].clone());
        cases.push(rnr[0].clone());
    } else {
        cases.extend(links);
        cases.extend(rnr);
        cases.push(cq_case());
    }
    cases.extend(client_cases(short));
    for (k, (program, server, client, port)) in streams.into_iter().enumerate() {
        if short && k > 0 {
            break;
        }
        for netem in netems {
            cases.push(netem_case(program, server, client, port, netem));
        }
    }
    if !short {
        cases.extend(load_cases());
        cases.extend(long_run_cases());
    }
    cases
}

/// SIGKILL of either side of each of [`kill_programs`] (`short`: three of them).
fn kill_cases(short: bool) -> Vec<Case> {
    let mut cases = Vec::new();
    for (program, server, client, listen) in kill_programs() {
        for victim in [Side::Server, Side::Client] {
            let keep = !short
                || matches!(
                    (program, victim),
                    ("send_recv", Side::Server)
                        | ("perf send_bw", Side::Client)
                        | ("rping", Side::Server)
                );
            if keep {
                cases.push(kill_case(program, &server, &client, listen, victim));
            }
        }
    }
    cases
}

/// The full matrix's rows under load: the device deleted under a running stream, and
/// 64-packet messages under heavy loss or reordering.
fn load_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    cases.push(Case {
        scenario: "rdma link delete under load".into(),
        program: "send_recv (the server's rxe0 deleted)".into(),
        server: "ex:send_recv --server --port 18760 --iters 3000"
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        client: "ex:send_recv --client {peer} --port 18760 --iters 3000"
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        listen: Some(18760),
        fault: Fault::DeviceDelete {
            after: Duration::from_secs(2),
        },
        // rxe cannot revoke a device from a process: the delete waits until the
        // process closes it; the stream must go on, and the objects must go away.
        expect: Expect::BothOk,
        limit: Duration::from_secs(90),
    });
    // 64-packet messages: under heavy loss or reordering, rxe's go-back-N spends the
    // crate's default retry_cnt (6) quickly; the stream may end with RETRY_EXC_ERR, but
    // must never deliver bad data or hang.
    for netem in ["loss 5%", "delay 5ms reorder 25% 50%"] {
        let mut c = netem_case(
            "rdma_write (verified, 100 x 64 KiB, default retry_cnt)",
            "ex:rdma_write --server --port 18722 --iters 100 --size 65536",
            "ex:rdma_write --client {peer} --port 18722 --iters 100 --size 65536",
            18722,
            netem,
        );
        c.expect = Expect::OkOrReports { says: "RETRY_EXC" };
        cases.push(c);
    }
    cases
}

/// The RNR NAK timer of `code` (IB spec vol. 1, 9.7.5.2.8, table "Encoding for RNR NAK
/// Timer"; rxe's `rnrnak_usec` holds the same table and waits at least one jiffy).
pub fn rnr_timer(code: u8) -> Duration {
    const USEC: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(USEC[usize::from(code & 31)])
}

/// Slack added to the RNR bound: a round trip, the agents' two 50 ms polls of the fault
/// marker and the failing process's exit, under emulation.
pub(super) const RNR_SLACK: Duration = Duration::from_secs(1);

/// The RNR bound: a SEND that keeps meeting an empty receive queue fails with
/// RNR_RETRY_EXC_ERR after the first RNR NAK plus `rnr_retry` waits of the receiver's
/// `min_rnr_timer` each (rnr_retry 7 retries forever), plus [`RNR_SLACK`].
pub fn rnr_bound(rnr_retry: u8, min_rnr_timer: u8) -> Duration {
    rnr_timer(min_rnr_timer) * u32::from(rnr_retry) + RNR_SLACK
}

/// RNR: send_recv's server echoes message 20 and then leaves its receive queue empty for
/// a while (`--stall-recv-at`), so the client's next SEND is answered with RNR NAKs.
pub(super) fn rnr_cases() -> Vec<Case> {
    let w = |s: String| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    let case = |port: u16, knobs: &str, stall_ms: u64, expect: Expect, program: String| Case {
        scenario: "RNR: receiver stops posting".into(),
        program,
        server: w(format!(
            "ex:send_recv --server --port {port} --iters 100 --size 4096 {knobs} \
             --stall-recv-at 20 --stall-ms {stall_ms}"
        )),
        client: w(format!(
            "ex:send_recv --client {{peer}} --port {port} --iters 100 --size 4096 {knobs}"
        )),
        listen: Some(port),
        fault: Fault::Printed {
            by: Side::Server,
            text: "receives paused",
        },
        expect,
        limit: Duration::from_secs(60),
    };
    let zero = rnr_bound(0, 12);
    let six = rnr_bound(6, 31);
    vec![
        case(
            18730,
            "--rnr-retry 0",
            2000,
            Expect::OneReports {
                within: zero,
                says: "RNR_RETRY_EXC",
            },
            format!(
                "send_recv, rnr_retry 0, min_rnr_timer 12 (bound {:.2} s)",
                zero.as_secs_f64()
            ),
        ),
        case(
            18731,
            "--rnr-retry 6 --min-rnr-timer 31",
            10_000,
            Expect::OneReports {
                within: six,
                says: "RNR_RETRY_EXC",
            },
            format!(
                "send_recv, rnr_retry 6, min_rnr_timer 31 (bound {:.2} s)",
                six.as_secs_f64()
            ),
        ),
        case(
            18732,
            "--rnr-retry 7",
            2000,
            Expect::BothOk,
            "send_recv, rnr_retry 7 (forever), receives back after 2 s".into(),
        ),
    ]
}

/// A CQ smaller than the QP's queues need: both sides must refuse it at setup
/// (`Error::CqTooSmall`), before waiting for the peer.
pub(super) fn cq_case() -> Case {
    let w = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    Case {
        scenario: "CQ too small for the queues".into(),
        program: "send_recv --cq-entries 1 (queues need 2)".into(),
        server: w("ex:send_recv --server --port 18735 --cq-entries 1"),
        client: w("ex:send_recv --client {peer} --port 18735 --cq-entries 1"),
        listen: Some(18735),
        fault: Fault::None,
        expect: Expect::BothFail {
            within: Duration::from_secs(10),
            says: "the CQ cannot hold",
        },
        limit: Duration::from_secs(60),
    }
}

/// Samples per long run (1 s each, 2 s apart: about 8 s of traffic).
pub(super) const LONG_SAMPLES: u32 = 4;

/// Long-running loops: every streaming example and perf test with 1,000,000 iterations,
/// sampled while it runs and then killed.
pub(super) fn long_run_cases() -> Vec<Case> {
    let p = |n: u16| 18770 + n;
    let programs = long_run_programs(p);
    let mut cases: Vec<Case> = programs
        .into_iter()
        .map(|(program, server, client, listen)| {
            let iters = if program == "rping" {
                " -C 1000000"
            } else if program.contains("pingpong") {
                " -n 1000000"
            } else {
                " --iters 1000000"
            };
            long_case(
                program,
                &format!("{server}{iters}"),
                &format!("{client}{iters}"),
                listen,
            )
        })
        .collect();
    for (k, test) in [
        "write_bw",
        "send_bw",
        "read_bw",
        "write_lat",
        "send_lat",
        "read_lat",
        "atomic_bw",
    ]
    .into_iter()
    .enumerate()
    {
        let port = p(10 + k as u16);
        cases.push(long_case(
            &format!("perf {test}"),
            &format!("ex:perf {test} -n 1000000 -p {port}"),
            &format!("ex:perf {test} -n 1000000 -p {port} {{peer}}"),
            Some(port),
        ));
    }
    cases
}

/// The examples of the long runs, each with its server and client command (no iteration
/// count yet) and the TCP port the server listens on; `p(n)` is the n-th port of the set.
fn long_run_programs(p: impl Fn(u16) -> u16) -> Vec<(&'static str, String, String, Option<u16>)> {
    vec![
        (
            "send_recv",
            format!("ex:send_recv --server --port {}", p(0)),
            format!("ex:send_recv --client {{peer}} --port {}", p(0)),
            Some(p(0)),
        ),
        (
            "rdma_write",
            format!("ex:rdma_write --server --port {}", p(1)),
            format!("ex:rdma_write --client {{peer}} --port {}", p(1)),
            Some(p(1)),
        ),
        (
            "rdma_read",
            format!("ex:rdma_read --server --port {}", p(2)),
            format!("ex:rdma_read --client {{peer}} --port {}", p(2)),
            Some(p(2)),
        ),
        (
            "rc_pingpong",
            format!("ex:rc_pingpong -g 1 -p {}", p(3)),
            format!("ex:rc_pingpong -g 1 -p {} {{peer}}", p(3)),
            Some(p(3)),
        ),
        (
            "uc_pingpong",
            format!("ex:uc_pingpong -g 1 -p {}", p(4)),
            format!("ex:uc_pingpong -g 1 -p {} {{peer}}", p(4)),
            Some(p(4)),
        ),
        (
            "ud_pingpong",
            format!("ex:ud_pingpong -g 1 -s 512 -p {}", p(5)),
            format!("ex:ud_pingpong -g 1 -s 512 -p {} {{peer}}", p(5)),
            Some(p(5)),
        ),
        (
            "srq_pingpong",
            format!("ex:srq_pingpong -g 1 -p {}", p(6)),
            format!("ex:srq_pingpong -g 1 -p {} {{peer}}", p(6)),
            Some(p(6)),
        ),
        (
            "rping",
            format!("ex:rping -s -a {{addr}} -p {}", p(7)),
            format!("ex:rping -c -a {{peer}} -p {}", p(7)),
            None,
        ),
    ]
}

pub(super) fn long_case(program: &str, server: &str, client: &str, listen: Option<u16>) -> Case {
    Case {
        scenario: "long run (1,000,000 iters)".into(),
        program: program.into(),
        server: server.split_whitespace().map(str::to_owned).collect(),
        client: client.split_whitespace().map(str::to_owned).collect(),
        listen,
        fault: Fault::Sample {
            count: LONG_SAMPLES,
        },
        expect: Expect::KeepsMoving,
        limit: Duration::from_secs(60),
    }
}

/// The ACK-timeout bound of RC: a request that gets no ACK fails with RETRY_EXC_ERR after
/// `retry_cnt + 1` timeouts of 4.096 us x 2^`timeout` each (IB spec 9.7.6.1.3; a device may
/// round a timeout up, and rxe counts them in kernel jiffies).
pub fn retry_bound(timeout: u8, retry_cnt: u8) -> Duration {
    Duration::from_secs_f64(4.096e-6 * f64::from(1u32 << timeout) * f64::from(retry_cnt + 1))
}

/// Link cases: the client's node cuts the wire (100% loss) or takes its NIC down for 2 s
/// mid-stream.
pub(super) fn link_cases() -> Vec<Case> {
    let stream = |port: u16, knobs: &str| {
        let w = |s: String| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        (
            w(format!(
                "ex:send_recv --server --port {port} --iters 1500 --size 4096 {knobs}"
            )),
            w(format!(
                "ex:send_recv --client {{peer}} --port {port} --iters 1500 --size 4096 {knobs}"
            )),
        )
    };
    let cut = |local| Fault::LinkDown {
        after: Duration::from_secs(1),
        down: Duration::from_secs(2),
        local,
    };
    let (s1, c1) = stream(18740, "--qp-timeout 18 --retry-cnt 6");
    let (s2, c2) = stream(18741, "--qp-timeout 16 --retry-cnt 3");
    let (s3, c3) = stream(18742, "");
    let long = retry_bound(18, 6);
    let short = retry_bound(16, 3);
    vec![
        Case {
            scenario: "wire cut 2 s, then restored".into(),
            program: format!(
                "send_recv, timeout 18 x retry_cnt 6 (bound {:.1} s)",
                long.as_secs_f64()
            ),
            server: s1,
            client: c1,
            listen: Some(18740),
            fault: cut(false),
            expect: Expect::BothOk,
            limit: Duration::from_secs(90),
        },
        Case {
            scenario: "wire cut 2 s, short timeout".into(),
            program: format!(
                "send_recv, timeout 16 x retry_cnt 3 (bound {:.2} s)",
                short.as_secs_f64()
            ),
            server: s2,
            client: c2,
            listen: Some(18741),
            fault: cut(false),
            expect: Expect::OneReports {
                within: short.mul_f64(1.5),
                says: "RETRY_EXC",
            },
            limit: Duration::from_secs(60),
        },
        Case {
            scenario: "NIC down 2 s (ip link down)".into(),
            program: "send_recv, crate defaults".into(),
            server: s3,
            client: c3,
            listen: Some(18742),
            fault: cut(true),
            // rxe fails the next send at once when its netdev is down, whatever the
            // timeout (a local error, not a retry); a peer sending to it meanwhile runs
            // out of retries (the defaults' bound, 0.47 s).
            expect: Expect::OneReports {
                within: Duration::from_secs(1),
                says: "LOC_QP_OP_ERR|RETRY_EXC",
            },
            limit: Duration::from_secs(60),
        },
    ]
}

/// rdma_cm and TCP-exchange clients facing a dead address, a closed port, or a fake
/// exchange peer.
pub(super) fn client_cases(short: bool) -> Vec<Case> {
    let client_only = |scenario: &str, program: &str, client: &str, within: u64| Case {
        expect: Expect::ClientFails {
            within: Duration::from_secs(within),
            says: "rdma_cm reported",
        },
        scenario: scenario.into(),
        program: program.into(),
        server: Vec::new(),
        client: client.split_whitespace().map(str::to_owned).collect(),
        listen: Some(0),
        fault: Fault::None,
        limit: Duration::from_secs(60),
    };
    let fake = |mode: &str, port: u16, within: u64| Case {
        scenario: format!("exchange peer: {mode}"),
        program: "send_recv client vs a fake server".into(),
        server: vec!["self:fake-peer".into(), mode.into(), port.to_string()],
        client: format!("ex:send_recv --client {{peer}} --port {port}")
            .split_whitespace()
            .map(str::to_owned)
            .collect(),
        listen: Some(port),
        fault: Fault::None,
        expect: Expect::ClientFails {
            within: Duration::from_secs(within),
            says: "error",
        },
        limit: Duration::from_secs(70),
    };
    let mut cases = vec![
        client_only(
            "rdma_cm connect: closed port",
            "rping client",
            "ex:rping -c -a {peer} -p 18750 -C 1",
            5,
        ),
        fake("garbage", 18751, 5),
    ];
    if !short {
        cases.extend([
            client_only(
                "rdma_cm connect: dead address",
                "rping client",
                "ex:rping -c -a 10.99.1.77 -p 18752 -C 1",
                5,
            ),
            fake("truncate", 18753, 5),
            fake("reset", 18754, 5),
            fake("stall", 18755, 35),
        ]);
    }
    cases
}
