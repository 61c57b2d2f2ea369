//! The guest side of `compare`: the script that runs every (test, size, implementation)
//! and the reading of what each run wrote.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use super::json::Json;
use super::{Plan, SIDE_TIMEOUT_SECS, impls_for, is_bw, iters, sizes_for};

/// The guest script: `sh -c SCRIPT compare OUTDIR PERF`.
pub(super) fn script(plan: &Plan) -> String {
    let mut s = String::from("set -u\nOUT=$1; PERF=$2\n");
    s.push_str(&job_functions());
    for rep in 0..plan.reps {
        // The first implementation moves on by one from each (test, size) to the next and
        // from each repetition to the next, so that over the repetitions every one takes
        // every place (whatever the number of combinations modulo the implementations).
        let mut k = rep as usize;
        for test in &plan.tests {
            for &size in sizes_for(plan, test) {
                let n = iters(test, size);
                let impls = impls_for(plan, test);
                for j in 0..impls.len() {
                    let imp = impls[(j + k) % impls.len()];
                    let name = format!("{test}_{size}_{imp}_{rep}");
                    let _ = writeln!(s, "job {name} {imp} {test} {size} {n}");
                }
                k += 1;
            }
        }
    }
    s.push_str("echo '[compare] done'\n");
    s
}

/// The shell functions of a side-by-side run, for a script that has set `OUT`
/// (the log folder) and `PERF` (the `perf` example): `listening` (waits for a
/// server on TCP port 18515) and `job NAME IMPL TEST SIZE ITERS [FLAGS...]`,
/// which runs a server and a client of perftest's `ib_TEST` (IMPL `perftest`) or
/// `perf TEST --IMPL` with the same flags, the client writing `$OUT/NAME.json`
/// and both their output to `$OUT/NAME.{server,client}.txt`, and appends
/// `NAME CLIENT_STATUS SERVER_STATUS` to `$OUT/status`.
pub(crate) fn job_functions() -> String {
    let mut s = String::from(
        "DEV=${RDMA_VERBS_DEVICE:-rxe0}; ADDR=${RDMA_VERBS_ADDR:-10.99.0.1}\n\
         # Wait until a server listens on TCP port 18515 (0x4853), at most 30 s.\n\
         listening() {\n\
         \x20 i=0\n\
         \x20 until grep -q ':4853 00000000:0000 0A' /proc/net/tcp; do\n\
         \x20   i=$((i + 1)); [ $i -lt 600 ] || return 1; sleep 0.05\n\
         \x20 done\n\
         }\n\
         # job NAME IMPL TEST SIZE ITERS [FLAGS...]\n\
         job() {\n\
         \x20 name=$1; impl=$2; t=$3; s=$4; n=$5; shift 5\n\
         \x20 common=\"-d $DEV -x 1 -F -s $s -n $n $*\"\n\
         \x20 if [ \"$impl\" = perftest ]; then\n\
         \x20   srv=\"ib_$t $common\"; cli=\"ib_$t $common --out_json --out_json_file=$OUT/$name.json $ADDR\"\n\
         \x20 else\n\
         \x20   srv=\"$PERF $t $common --$impl\"; cli=\"$PERF $t $common --$impl --out_json --out_json_file=$OUT/$name.json $ADDR\"\n\
         \x20 fi\n",
    );
    let t = SIDE_TIMEOUT_SECS;
    let _ = write!(
        s,
        "\x20 timeout {t} $srv > \"$OUT/$name.server.txt\" 2>&1 &\n\
         \x20 spid=$!\n\
         \x20 if listening; then\n\
         \x20   timeout {t} $cli > \"$OUT/$name.client.txt\" 2>&1; crc=$?\n\
         \x20 else\n\
         \x20   crc=98; kill $spid 2>/dev/null\n\
         \x20 fi\n\
         \x20 wait $spid; src=$?\n\
         \x20 echo \"$name $crc $src\" >> \"$OUT/status\"\n\
         \x20 echo \"[compare] $name: client $crc, server $src\"\n\
         }}\n"
    );
    s
}

/// One run's numbers: bandwidth tests `[bw_avg MiB/s, Mpps]`, latency `[t_typical, p99]`.
pub(crate) type Numbers = [f64; 2];

/// (test, size, impl) -> the numbers of each repetition that finished.
pub(super) type Results = BTreeMap<(String, u64, String), Vec<Numbers>>;

/// Reads every run's output.
/// The parsed results, and the names of the runs that produced none (a
/// failed repetition must not vanish into a median of the others).
pub(super) fn collect(plan: &Plan, dir: &Path) -> (Results, Vec<String>) {
    let mut out = Results::new();
    let mut failed = Vec::new();
    for rep in 0..plan.reps {
        for test in &plan.tests {
            for &size in sizes_for(plan, test) {
                for imp in impls_for(plan, test) {
                    let name = format!("{test}_{size}_{imp}_{rep}");
                    let got = if imp == "perftest" {
                        fs::read_to_string(dir.join(format!("{name}.client.txt")))
                            .ok()
                            .and_then(|t| parse_perftest(&t, is_bw(test), size))
                    } else {
                        fs::read_to_string(dir.join(format!("{name}.json")))
                            .ok()
                            .and_then(|t| parse_ours(&t, is_bw(test)))
                    };
                    match got {
                        Some(n) => out
                            .entry((test.clone(), size, imp.to_string()))
                            .or_default()
                            .push(n),
                        None => failed.push(name),
                    }
                }
            }
        }
    }
    (out, failed)
}

/// perftest's result line (the first line after the `#bytes` header).
pub(crate) fn parse_perftest(text: &str, bw: bool, size: u64) -> Option<Numbers> {
    let mut lines = text.lines().skip_while(|l| !l.contains("#bytes"));
    lines.next()?;
    let line = lines.find(|l| !l.trim().is_empty())?;
    let v: Vec<f64> = line
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    if bw {
        let (avg, mpps) = (*v.get(3)?, *v.get(4)?);
        // Both columns come from the same time base (bw = mpps * 1e6 * size / 2^20); use
        // whichever was printed with the smaller relative rounding error (perftest prints
        // the bandwidth with 2 decimals, the message rate with 6).
        if avg <= 0.0 && mpps <= 0.0 {
            return None;
        }
        let avg_is_finer = mpps <= 0.0 || (avg > 0.0 && 0.005 / avg < 0.000_000_5 / mpps);
        let (bw, mpps) = if avg_is_finer {
            (avg, avg * 1_048_576.0 / size as f64 / 1e6)
        } else {
            (mpps * 1e6 * size as f64 / 1_048_576.0, mpps)
        };
        (bw > 0.0 && bw.is_finite() && mpps.is_finite()).then_some([bw, mpps])
    } else {
        // A run whose clock check failed prints `inf` and `-nan` (perftest's
        // "Correlation coefficient r^2 < 0.9") and exits 0: no result, not a
        // latency of infinity (whose ratio would read 0 and meet the target).
        let (typ, p99) = (*v.get(4)?, *v.get(7)?);
        (typ > 0.0 && typ.is_finite() && p99.is_finite()).then_some([typ, p99])
    }
}

/// `perf --out_json`'s first result.
pub(crate) fn parse_ours(text: &str, bw: bool) -> Option<Numbers> {
    let json = Json::parse(text)?;
    let r = json.get("results")?.index(0)?;
    let n = if bw {
        [r.get("bw_avg")?.num()?, r.get("msg_rate_mpps")?.num()?]
    } else {
        [r.get("t_typical")?.num()?, r.get("p99")?.num()?]
    };
    (n[0] > 0.0 && n.iter().all(|v| v.is_finite())).then_some(n)
}
