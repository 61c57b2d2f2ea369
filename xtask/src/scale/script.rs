//! The guest script of `scale`: `sh -c SCRIPT scale OUTDIR PERF SCALE C_LOOP`.
//!
//! Log names (under OUTDIR, which `report` reads): `cm_IMPL_N_REP.{client,server}.{txt,rss}`
//! (IMPL `c` = cmtime, `blocking`, `batch` (blocking, through `cm::accept_all` and
//! `cm::connect_all`), `tokio`, `cserial` (the C loop's serial client against the
//! blocking server)),
//! `reg_IMPL_SIZE_REP.txt` and `qp_IMPL_REP.txt`
//! (IMPL `c` or `ours`), `rate_TEST_QPS_IMPL_REP.{client.txt,json}` (IMPL `perftest`,
//! `safe`, `scoped`); `status` has a line `NAME STATUS...` per run.

use std::fmt::Write as _;

use super::{PARTS, Plan, QP_ITERS, RATE_PATHS, RATE_QPS, RATE_TESTS, REG_SIZES};
use crate::compare::job_functions;

/// Time limit of each program in the guest, in seconds.
const RUN_LIMIT_SECS: u32 = 300;
/// First rdma_cm port; each connection run takes the next, so no run meets the ids
/// an earlier one left in the kernel.
const BASE_PORT: u32 = 7471;

/// The connection runs' implementations, in the order of even repetitions: the serial
/// C client next to the blocking one it is compared with.
pub(super) const CM_IMPLS: &[&str] = &["c", "cserial", "blocking", "batch", "tokio"];

/// Shell functions of the setup, registration and QP runs.
fn functions() -> String {
    let t = RUN_LIMIT_SECS;
    format!(
        "# peak NAME.SIDE CMD...: CMD's output in NAME.SIDE.txt, its peak RSS in NAME.SIDE.rss\n\
         peak() {{\n\
         \x20 f=$1; shift\n\
         \x20 /usr/bin/time -f 'maxrss_kib %M' -o \"$OUT/$f.rss\" timeout {t} \"$@\" > \"$OUT/$f.txt\" 2>&1\n\
         }}\n\
         # cm NAME IMPL N PORT: a server and a client setting up N connections\n\
         cm() {{\n\
         \x20 name=$1; impl=$2; n=$3; port=$4\n\
         \x20 if [ \"$impl\" = c ]; then\n\
         \x20   cmtime -p $port > \"$OUT/$name.server.txt\" 2>&1 &\n\
         \x20 else\n\
         \x20   smode=; cmode=\n\
         \x20   [ \"$impl\" = tokio ] && smode=--tokio && cmode=--tokio\n\
         \x20   [ \"$impl\" = batch ] && smode=--batch && cmode=--batch\n\
         \x20   peak $name.server $SCALE cm-server --conns $n --port $port $smode &\n\
         \x20 fi\n\
         \x20 spid=$!; sleep 1\n\
         \x20 if [ \"$impl\" = c ]; then\n\
         \x20   peak $name.client cmtime -s $ADDR -p $port -c $n; crc=$?\n\
         \x20   sed -n 's/^VmHWM:[^0-9]*\\([0-9]*\\).*/maxrss_kib \\1/p' /proc/$spid/status > \"$OUT/$name.server.rss\"\n\
         \x20   kill $spid\n\
         \x20 elif [ \"$impl\" = cserial ]; then\n\
         \x20   peak $name.client $CLOOP cm $ADDR $port $n; crc=$?\n\
         \x20 else\n\
         \x20   peak $name.client $SCALE cm-client $ADDR --conns $n --port $port $cmode; crc=$?\n\
         \x20 fi\n\
         \x20 wait $spid; src=$?\n\
         \x20 echo \"$name $crc $src\" >> \"$OUT/status\"\n\
         \x20 echo \"[scale] $name: client $crc, server $src\"\n\
         }}\n\
         # one NAME CMD...: one program, its output in NAME.txt\n\
         one() {{\n\
         \x20 name=$1; shift\n\
         \x20 timeout {t} \"$@\" > \"$OUT/$name.txt\" 2>&1; rc=$?\n\
         \x20 echo \"$name $rc\" >> \"$OUT/status\"\n\
         \x20 echo \"[scale] $name: $rc\"\n\
         }}\n"
    )
}

/// Registrations per `reg` run of `size` bytes: about 256 MiB pinned in all, 8 to 2000.
pub(super) fn reg_iters(size: u64) -> u64 {
    ((256u64 << 20) / size).clamp(8, 2000)
}

/// Iterations per QP of a `rate` run with `qps` QPs: about 25,000 messages in all.
pub(super) fn rate_iters(qps: u32) -> u64 {
    (25_000 / u64::from(qps)).clamp(100, 5000)
}

/// The connection counts `setup` runs: the plan's and 1 (the memory baseline).
pub(super) fn cm_counts(plan: &Plan) -> Vec<u32> {
    let mut v = vec![1];
    v.extend(&plan.conns);
    v
}

/// The guest script.
pub(super) fn script(plan: &Plan) -> String {
    let mut s = String::from("set -u\nOUT=$1; PERF=$2; SCALE=$3; CLOOP=$4\n");
    s.push_str(&job_functions());
    s.push_str(&functions());
    let mut port = BASE_PORT;
    for rep in 0..plan.reps {
        // Each part's runs in one order in even repetitions and the reverse in odd ones,
        // so that neither side of a comparison always runs first.
        let order = |mut v: Vec<&'static str>| {
            if rep % 2 == 1 {
                v.reverse();
            }
            v
        };
        for part in PARTS.iter().filter(|p| plan.has(p)) {
            match *part {
                "setup" => {
                    for n in cm_counts(plan) {
                        for imp in order(CM_IMPLS.to_vec()) {
                            let _ = writeln!(s, "cm cm_{imp}_{n}_{rep} {imp} {n} {port}");
                            port += 1;
                        }
                    }
                }
                "reg" => {
                    for &size in REG_SIZES {
                        let it = reg_iters(size);
                        for imp in order(vec!["c", "ours"]) {
                            let prog = if imp == "c" {
                                "$CLOOP reg"
                            } else {
                                "$SCALE reg --size"
                            };
                            let iters = if imp == "c" { "" } else { "--iters " };
                            let _ =
                                writeln!(s, "one reg_{imp}_{size}_{rep} {prog} {size} {iters}{it}");
                        }
                    }
                }
                "qp" => {
                    for imp in order(vec!["c", "ours"]) {
                        let cmd = if imp == "c" {
                            format!("$CLOOP qp {QP_ITERS} 1")
                        } else {
                            format!("$SCALE qp --iters {QP_ITERS}")
                        };
                        let _ = writeln!(s, "one qp_{imp}_{rep} {cmd}");
                    }
                }
                _ => rate_jobs(&mut s, rep, order),
            }
        }
    }
    s.push_str("echo '[scale] done'\n");
    s
}

/// The `rate` runs of one repetition.
fn rate_jobs(s: &mut String, rep: u32, order: impl Fn(Vec<&'static str>) -> Vec<&'static str>) {
    for test in RATE_TESTS {
        for &q in RATE_QPS {
            let n = rate_iters(q);
            let mut impls = vec!["perftest"];
            impls.extend(RATE_PATHS);
            for imp in order(impls) {
                let _ = writeln!(
                    s,
                    "job rate_{test}_{q}_{imp}_{rep} {imp} {test} 2 {n} -q {q}"
                );
            }
        }
    }
}
