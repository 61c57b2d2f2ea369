//! Unit tests of `compare`: argument parsing, the guest script, parsing, rows and the
//! pinned renderers.

use super::json::Json;
use super::render::*;
use super::runner::*;
use super::*;
use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

#[test]
fn parses_perftest_tables() {
    let bw = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
              2          5000             0.10               0.09   \t\t   0.045376\n";
    let n = parse_perftest(bw, true, 2).unwrap();
    assert!((n[1] - 0.045376).abs() < 1e-9);
    assert!((n[0] - 0.045376 * 2e6 / 1_048_576.0).abs() < 1e-9);
    let big = " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
               1048576    64               52.84              49.50  \t\t   0.000050\n";
    let n = parse_perftest(big, true, 1 << 20).unwrap();
    assert_eq!(n[0], 49.50);
    assert!((n[1] - 49.5e-6).abs() < 1e-12);
    let lat = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
               2       1000          7.23           20846.16      9.06     \t       104.69      \t441.65 \t\t2471.77 \t\t20846.16\n";
    assert_eq!(parse_perftest(lat, false, 2).unwrap(), [9.06, 2471.77]);
    assert!(parse_perftest("Couldn't connect", true, 2).is_none());
    // perftest's output when its clock check failed (exit status 0).
    let failed = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n \
                  4096    1000          inf            inf          inf          inf          -nan         inf          inf\n";
    assert!(parse_perftest(failed, false, 4096).is_none());
}

#[test]
fn parses_our_json() {
    let text = r#"{"test": "write_bw", "x": [1, -2.5e3, true, null, "a\"b\u0041"],
        "results": [{"size": 2, "bw_avg": 0.5, "msg_rate_mpps": 0.25}]}"#;
    assert_eq!(parse_ours(text, true), Some([0.5, 0.25]));
    let j = Json::parse(text).unwrap();
    assert_eq!(
        j.get("x").unwrap().index(4),
        Some(&Json::Str("a\"bA".into()))
    );
    assert_eq!(j.get("x").unwrap().index(1).unwrap().num(), Some(-2500.0));
    assert!(Json::parse("{\"a\": }").is_none());
}

#[test]
fn script_is_valid_shell_and_rotates() {
    let plan = Plan {
        reps: 2,
        sizes: vec![2, 65536],
        tests: vec!["write_bw".into(), "send_lat".into()],
        paths: DEFAULT_PATHS.to_vec(),
        timeout: Duration::from_secs(1),
    };
    let s = script(&plan);
    let ok = Command::new("sh").args(["-n", "-c", &s]).status();
    assert!(ok.is_ok_and(|st| st.success()), "{s}");
    assert_eq!(s.matches("\njob ").count(), 2 * 2 * 2 * 3);
    assert!(s.contains("job write_bw_2_perftest_0 perftest write_bw 2 5000"));
    assert!(s.contains("job write_bw_65536_safe_0 safe write_bw 65536 1024"));
    assert!(s.contains("send_lat_65536_raw_1 raw send_lat 65536 256"));
    assert!(!s.contains("scoped"));
    assert_eq!(runs_per_rep(&plan), 2 * 2 * 3);
}

/// The implementations of one (test, size) in the script's order, per repetition.
fn order(s: &str, test: &str, size: u64, reps: u32) -> Vec<Vec<String>> {
    (0..reps)
        .map(|rep| {
            s.lines()
                .filter_map(|l| l.strip_prefix("job "))
                .map(|l| l.split(' ').collect::<Vec<_>>())
                .filter(|w| {
                    w[2] == test && w[3] == size.to_string() && w[0].ends_with(&format!("_{rep}"))
                })
                .map(|w| w[1].to_owned())
                .collect()
        })
        .collect()
}

#[test]
fn script_rotates_with_scoped_and_lat_tests_never_get_it() {
    let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
    // 4 (test, size) combinations per repetition and 4 implementations of write_bw: a
    // rotation by combination alone would give write_bw the same order every time.
    let plan = parse_args(args(
        "--reps 4 --tests write_bw,send_lat --sizes 2,65536 --paths scoped,safe,raw",
    ))
    .unwrap()
    .unwrap();
    assert_eq!(plan.paths, ["safe", "raw", "scoped"]);
    let s = script(&plan);
    let ok = Command::new("sh").args(["-n", "-c", &s]).status();
    assert!(ok.is_ok_and(|st| st.success()), "{s}");
    // write_bw: 2 sizes x 4 impls; send_lat: 2 sizes x 3.
    assert_eq!(runs_per_rep(&plan), 8 + 6);
    assert_eq!(s.matches("\njob ").count(), 4 * (8 + 6));
    assert_eq!(path_combinations(&plan), 2 * 3 + 2 * 2);
    assert!(s.contains("job write_bw_65536_scoped_0 scoped write_bw 65536 1024"));
    assert!(s.contains("--$impl"), "perf runs with --scoped");
    for line in s.lines().filter(|l| l.starts_with("job send_lat")) {
        assert!(!line.contains("scoped"), "{line}");
    }
    assert_eq!(paths_for(&plan, "send_lat"), ["safe", "raw"]);
    assert_eq!(paths_for(&plan, "read_lat"), ["safe", "raw"]);
    assert_eq!(paths_for(&plan, "read_bw"), ["safe", "raw", "scoped"]);
    // Every repetition runs each implementation once, and each takes every place in
    // turn (the rotation includes scoped).
    for (test, size, n) in [
        ("write_bw", 2, 4),
        ("write_bw", 65536, 4),
        ("send_lat", 2, 3),
        ("send_lat", 65536, 3),
    ] {
        let reps = order(&s, test, size, plan.reps);
        for r in &reps {
            let mut sorted = r.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), n, "{test} {size}: {r:?}");
            assert_eq!(r.len(), n, "{test} {size}: {r:?}");
        }
        for place in 0..n {
            let mut at: Vec<&String> = reps.iter().map(|r| &r[place]).collect();
            at.sort();
            at.dedup();
            assert_eq!(
                at.len(),
                n.min(plan.reps as usize),
                "{test} {size}: {reps:?}"
            );
        }
    }
    let atomic = parse_args(args(
        "--reps 1 --tests atomic_bw,read_lat --paths raw,scoped",
    ))
    .unwrap()
    .unwrap();
    let s = script(&atomic);
    assert!(s.contains("job atomic_bw_8_scoped_0 scoped atomic_bw 8 5000"));
    assert!(!s.contains("job atomic_bw_8_safe_0"));
    assert!(!s.contains("job read_lat_2_scoped"));
    assert!(s.contains("job read_lat_2_raw_0 raw read_lat 2 1000"));
    assert!(parse_args(args("--paths safe,fast")).is_err());
    let plan = parse_args(args("--paths scoped")).unwrap().unwrap();
    assert_eq!(plan.paths, ["scoped"]);
    assert_eq!(path_pairs(&plan), []);
    let plan = parse_args(args("")).unwrap().unwrap();
    assert_eq!(plan.paths, ["safe", "raw"]);
    assert_eq!(path_pairs(&plan), [("safe", "raw")]);
}

#[test]
fn scoped_results_make_rows_and_json() {
    let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
    let plan = parse_args(args(
        "--reps 1 --tests write_bw,send_lat --sizes 2 --paths safe,raw,scoped",
    ))
    .unwrap()
    .unwrap();
    let mut results = Results::new();
    for (test, imp, n) in [
        ("write_bw", "perftest", [1.0, 0.5]),
        ("write_bw", "safe", [0.9, 0.45]),
        ("write_bw", "raw", [1.0, 0.5]),
        ("write_bw", "scoped", [1.1, 0.55]),
        ("send_lat", "perftest", [10.0, 20.0]),
        ("send_lat", "safe", [11.0, 22.0]),
        ("send_lat", "raw", [10.0, 20.0]),
    ] {
        results.insert((test.to_owned(), 2, imp.to_owned()), vec![n]);
    }
    let rows = rows(&plan, &results);
    assert_eq!(
        rows.iter().filter(|r| r.primary).count(),
        path_combinations(&plan)
    );
    let r = find(&rows, "write_bw", "scoped", 2, "MB/sec").unwrap();
    assert!((r.ratio() - 1.1).abs() < 1e-9);
    assert!(find(&rows, "send_lat", "scoped", 2, "t_typical usec").is_none());
    let json = to_json(&rows);
    assert!(json.contains(
        "{\"test\": \"write_bw\", \"path\": \"scoped\", \"size\": 2, \"unit\": \"MB/sec\""
    ));
    assert!(Json::parse(&json).is_some());
    let svg = svg(&plan, &rows);
    assert!(svg.contains("scoped path"));
    assert_eq!(svg.matches("<polyline").count(), 3 + 2);
}

/// A plan of two tests at two sizes with all three paths, and rows with a missing
/// scoped result, a missed target and a NaN.
fn fixed_plan_and_rows() -> (Plan, Vec<Row>) {
    let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
    let plan = parse_args(args(
        "--reps 2 --tests write_bw,send_lat --sizes 2,65536 --paths safe,raw,scoped",
    ))
    .unwrap()
    .unwrap();
    let mut results = Results::new();
    for (test, size, imp, a, b) in [
        ("write_bw", 2, "perftest", [1.0, 0.5], [1.2, 0.6]),
        ("write_bw", 2, "safe", [0.9, 0.45], [1.0, 0.5]),
        ("write_bw", 2, "raw", [1.0, 0.5], [1.0, 0.5]),
        ("write_bw", 2, "scoped", [1.1, 0.55], [1.3, 0.65]),
        (
            "write_bw",
            65536,
            "perftest",
            [900.0, 0.014],
            [910.0, 0.0145],
        ),
        ("write_bw", 65536, "safe", [905.0, 0.0141], [915.5, 0.0146]),
        ("write_bw", 65536, "raw", [f64::NAN, 0.0], [f64::NAN, 0.0]),
        ("send_lat", 2, "perftest", [10.0, 20.0], [12.0, 22.0]),
        ("send_lat", 2, "safe", [11.0, 22.0], [11.5, 23.0]),
        ("send_lat", 2, "raw", [10.0, 20.0], [9.5, 19.0]),
        ("send_lat", 65536, "perftest", [30.0, 40.0], [31.0, 41.0]),
        ("send_lat", 65536, "safe", [29.0, 39.5], [30.0, 40.0]),
    ] {
        results.insert((test.to_owned(), size, imp.to_owned()), vec![a, b]);
    }
    let rows = rows(&plan, &results);
    (plan, rows)
}

#[test]
fn renderers_are_pinned() {
    let (plan, rows) = fixed_plan_and_rows();
    let pinned = crate::pinned::assert_pinned;
    pinned(
        "compare.table.txt",
        &table(&plan, &rows, Path::new("/runs")),
    );
    pinned("compare.json", &to_json(&rows));
    pinned("compare.svg", &svg(&plan, &rows));
}

#[test]
fn atomic_bw_is_optional_and_runs_at_8_bytes_only() {
    let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
    let plan = parse_args(args("")).unwrap().unwrap();
    assert!(!plan.tests.iter().any(|t| t == "atomic_bw"));
    let plan = parse_args(args("--tests atomic_bw,write_bw --sizes 2,65536 --reps 1"))
        .unwrap()
        .unwrap();
    assert_eq!(plan.tests, ["atomic_bw", "write_bw"]);
    assert_eq!(sizes_for(&plan, "atomic_bw"), [8]);
    assert_eq!(sizes_for(&plan, "write_bw"), [2, 65536]);
    assert_eq!(combinations(&plan), 3);
    let s = script(&plan);
    let ok = Command::new("sh").args(["-n", "-c", &s]).status();
    assert!(ok.is_ok_and(|st| st.success()), "{s}");
    assert_eq!(s.matches("\njob atomic_bw_").count(), 3);
    assert!(s.contains("job atomic_bw_8_perftest_0 perftest atomic_bw 8 5000"));
    assert!(s.contains("job atomic_bw_8_safe_0 safe atomic_bw 8 5000"));
    assert!(s.contains("job atomic_bw_8_raw_0 raw atomic_bw 8 5000"));
    assert!(!s.contains("atomic_bw_2_"));
    assert!(parse_args(args("--tests atomic_lat")).is_err());
}

#[test]
fn iterations_scale_with_size() {
    assert_eq!(iters("write_bw", 2), 5000);
    assert_eq!(iters("read_bw", 1 << 20), 64);
    assert_eq!(iters("send_lat", 1 << 20), 20);
    assert_eq!(iters("send_lat", 4096), 1000);
}

#[test]
fn a_missing_repetition_warns_and_a_missing_combination_fails() {
    let args = |s: &str| s.split_whitespace().map(OsString::from).collect();
    let plan = parse_args(args("--reps 3 --tests write_bw --sizes 2 --paths safe,raw"))
        .unwrap()
        .unwrap();
    let mut results = Results::new();
    // The second repetition of `raw` gave no result: the median uses the other two.
    for (imp, reps) in [("perftest", 3), ("safe", 3), ("raw", 2)] {
        let n = vec![[1.0, 0.5]; reps];
        results.insert(("write_bw".to_owned(), 2, imp.to_owned()), n);
    }
    let failed = vec!["write_bw_2_raw_1".to_owned()];
    let v = judge(&plan, &rows(&plan, &results), &failed, 0);
    assert_eq!(v.code, 0, "{v:?}");
    assert_eq!(
        v.lines,
        [
            "warning: 1 run(s) produced no result (medians use the other repetitions): write_bw_2_raw_1"
        ]
    );

    // No repetition of `raw` gave a result: that combination has no median.
    results.remove(&("write_bw".to_owned(), 2, "raw".to_owned()));
    let failed: Vec<String> = (0..3).map(|r| format!("write_bw_2_raw_{r}")).collect();
    let v = judge(&plan, &rows(&plan, &results), &failed, 0);
    assert_eq!(v.code, 1, "{v:?}");
    assert_eq!(v.lines.len(), 2);
    assert!(v.lines[0].starts_with("warning: 3 run(s) produced no result"));
    assert_eq!(
        v.lines[1],
        "error: 1 (test, size, path) combinations have no result"
    );

    // Every combination has a median, but the guest script did not finish.
    let v = judge(&plan, &rows(&plan, &results_all(&plan)), &[], 137);
    assert_eq!((v.code, v.lines.len()), (1, 0));
    // ... and all is well when it did.
    assert_eq!(
        judge(&plan, &rows(&plan, &results_all(&plan)), &[], 0),
        Verdict {
            lines: vec![],
            code: 0
        }
    );
}

/// A result for every repetition of every implementation `plan` runs.
fn results_all(plan: &Plan) -> Results {
    let mut results = Results::new();
    for test in &plan.tests {
        for &size in sizes_for(plan, test) {
            for imp in impls_for(plan, test) {
                let n = vec![[1.0, 0.5]; plan.reps as usize];
                results.insert((test.clone(), size, imp.to_owned()), n);
            }
        }
    }
    results
}
