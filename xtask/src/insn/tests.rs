//! Unit tests of `insn`: the median, the clock calibration rule, the guest script.

use super::plan::parse_args;
use super::*;

#[test]
fn median_of_odd_and_even_counts() {
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    assert_eq!(median(&mut [7.5]), 7.5);
}

#[test]
fn clock_calibration_is_the_inclusive_cost_of_gettimeofdays_callers() {
    // Shaped like `callgrind_annotate --tree=caller --inclusive=yes` of ib_write_bw.
    let annotate = "\
--------------------------------------------------------------------------------
Ir________________ file:function

5,084,931 (100.0%)  *  ???:0x0000000000005360 [/usr/bin/ib_write_bw]

  553,475 (10.88%)  < ???:0x0000000000028a30 (1x) [/usr/bin/ib_write_bw]
  553,475 (10.88%)  *  ???:0x0000000000028690 [/usr/bin/ib_write_bw]

  166,607 ( 3.28%)  < ???:0x0000000000028690 (23,801x) [/usr/bin/ib_write_bw]
  166,607 ( 3.28%)  *  ./time/../sysdeps/unix/sysv/linux/gettimeofday.c:__gettimeofday_syscall [/usr/lib/x86_64-linux-gnu/libc.so.6]

  120,000 ( 2.36%)  < ???:0x000000000001ea90 (3,000x) [/usr/bin/ib_write_bw]
  120,000 ( 2.36%)  *  ???:0x0000000000003cc0 [/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so]
";
    assert_eq!(clock_calibration(annotate), 553_475);
    // perf's runs: nothing calls gettimeofday.
    let perf = "\
  322,800 (50.0%)  < /work/main/examples/perf/bw.rs:perf::bw::run (1x) [/tmp/perf]
  322,800 (50.0%)  *  /work/main/examples/perf/bw.rs:perf::bw::run_size [/tmp/perf]
";
    assert_eq!(clock_calibration(perf), 0);
}

#[test]
fn repetitions_get_their_own_jobs() {
    let plan = parse_args(
        [
            "--tests",
            "write_bw",
            "--post-list",
            "1",
            "--paths",
            "raw",
            "--reps",
            "3",
        ]
        .map(OsString::from)
        .to_vec(),
    )
    .unwrap()
    .unwrap();
    let s = script(std::slice::from_ref(&plan));
    for name in [
        "write_bw_2_l1_raw_2000",
        "write_bw_2_l1_raw_8000_r1",
        "write_bw_2_l1_raw_2000_r2",
    ] {
        assert!(s.contains(&format!("job {name} ")), "{name} in:\n{s}");
    }
    assert_eq!(s.matches("\njob ").count(), 6);
    assert!(parse_args(["--reps", "0"].map(OsString::from).to_vec()).is_err());
}

#[test]
fn plans_joined_with_then_share_one_script() {
    let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
    let plans = parse_plans(args(&[
        "--tests",
        "send_bw",
        "--post-list",
        "1",
        "--paths",
        "raw,scoped",
        "--check-scoped",
        "1.10",
        "--then",
        "--tests",
        "send_bw",
        "--post-list",
        "8,1",
        "--paths",
        "raw",
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(plans.len(), 2);
    assert_eq!(plans[0].check_scoped, Some(1.10));
    assert_eq!(plans[1].check_scoped, None);
    let s = script(&plans);
    // send_bw raw with lists of 1 is in both plans: measured once.
    assert_eq!(s.matches("\njob send_bw_2_l1_raw_2000 ").count(), 1);
    assert_eq!(s.matches("\njob ").count(), 6);
    assert!(parse_plans(args(&["--side", "server", "--then", "--tests", "send_bw"])).is_err());
}

#[test]
fn async_paths_bring_safe_and_signal_every_request() {
    let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
    let plan = parse_args(args(&[
        "--tests",
        "write_bw,read_bw",
        "--post-list",
        "1,8",
        "--paths",
        "async,async-tasks",
        "--inflight",
        "16",
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(
        plan.cq_mod,
        Some(1),
        "async requests are all signaled: -Q 1 for safe too"
    );
    let paths: Vec<String> = keys(&plan).into_iter().map(|k| k.path).collect();
    // write_bw at -l 1 only: async runs neither read_bw nor post lists.
    assert_eq!(
        paths,
        ["safe", "async16", "async-tasks16", "safe", "safe", "safe"]
    );
    let s = script(std::slice::from_ref(&plan));
    assert!(
        s.contains("\njob write_bw_2_l1_q1_async16_2000 async16 write_bw 2 1 2000 1 "),
        "{s}"
    );
    assert!(s.contains("async-tasks*) prog=\"$PERF $t --async-tasks ${path#async-tasks}\""));
    // An explicit -Q stays; a guard needs async in the plan; read_bw alone has no async row.
    let plan = parse_args(args(&[
        "--paths", "async", "--cq-mod", "100", "--tests", "send_bw",
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(plan.cq_mod, Some(100));
    assert!(parse_args(args(&["--paths", "safe", "--check-async", "1.5"])).is_err());
    assert!(parse_args(args(&["--paths", "async", "--tests", "read_bw"])).is_err());
    assert!(parse_args(args(&["--paths", "async", "--inflight", "0"])).is_err());
}

#[test]
fn the_suites_guard_is_three_plans_with_their_checks() {
    let args = crate::test::insn_guard_args()
        .into_iter()
        .map(OsString::from)
        .collect();
    let plans = super::plan::parse_plans(args).unwrap().unwrap();
    assert_eq!(plans.len(), 3);
    assert!(plans[0].check.is_some() && plans[0].check_scoped.is_some());
    // The send_bw receiver is measured in the first plan's runs, in burst mode: only
    // its send_bw jobs of perf's paths run with --rx-burst.
    assert!(plans[0].rx_burst && plans[0].check_receiver.is_some());
    let burst: Vec<String> = keys(&plans[0])
        .into_iter()
        .filter(|k| super::receiver::burst(&plans[0], k))
        .map(|k| format!("{}_{}", k.test, k.path))
        .collect();
    assert_eq!(burst, ["send_bw_raw", "send_bw_scoped"]);
    let s = script(&plans);
    assert!(
        s.contains("job send_bw_2_l1_raw_1000 raw send_bw 2 1 1000 0 1 "),
        "{s}"
    );
    assert!(
        s.contains("job write_bw_2_l1_raw_1000 raw write_bw 2 1 1000 0 0 "),
        "{s}"
    );
    assert!(plans[1].check_scoped.is_some() && !plans[1].rx_burst);
    let stream = &plans[2];
    assert!(stream.check_async.is_some());
    assert_eq!(stream.cq_mod, Some(1), "the stream and safe both at -Q 1");
    let paths: Vec<String> = keys(stream).into_iter().map(|k| k.path).collect();
    assert_eq!(paths, ["safe", "async-stream16"]);
}
