//! Unit tests of `scale`: arguments, the guest script, parsing the runs' output, rows.

use std::time::Duration;

use super::report::{
    Row, canonical_steps, parse_ops, parse_rss, parse_steps, rows, table, to_json,
};
use super::script::script;
use super::*;

fn args(a: &[&str]) -> Vec<OsString> {
    a.iter().map(OsString::from).collect()
}

#[test]
fn parses_the_command_line() {
    let Asked::Run(p) =
        parse_args(args(&["--only", "rate,setup", "--reps=2", "--n", "8,16"])).unwrap()
    else {
        panic!("a run was asked for");
    };
    assert_eq!(p.parts, ["setup", "rate"]);
    assert_eq!((p.reps, p.conns.as_slice()), (2, &[8, 16][..]));
    assert_eq!(p.timeout, Duration::from_secs(2400));
    assert_eq!(parse_args(args(&["--render"])).unwrap(), Asked::Render);
    for bad in [
        &["--only", "nope"][..],
        &["--n", "1"],
        &["--reps", "0"],
        &["--what"],
        &["--n"],
    ] {
        let e = parse_args(args(bad)).unwrap_err();
        assert_eq!(e.code, crate::EXIT_USAGE, "{bad:?}");
    }
}

#[test]
fn script_runs_every_part_and_alternates_the_order() {
    let Asked::Run(p) = parse_args(args(&["--reps", "2", "--n", "8"])).unwrap() else {
        panic!("a run was asked for");
    };
    let s = script(&p);
    // n = 1 (the memory baseline) and 8, five implementations, two repetitions.
    assert_eq!(s.matches("\ncm cm_").count(), 2 * 5 * 2);
    assert!(s.contains("cm cm_cserial_8_0 cserial 8 "));
    assert!(s.contains("peak $name.client $CLOOP cm $ADDR $port $n"));
    assert!(s.contains("cm cm_c_8_0 c 8 "));
    assert!(s.contains("cm cm_batch_8_1 batch 8 "));
    assert!(s.contains("= batch ] && smode=--batch && cmode=--batch"));
    assert!(s.contains("one reg_c_4096_0 $CLOOP reg 4096 2000\none reg_ours_4096_0 $SCALE reg --size 4096 --iters 2000"));
    assert!(s.contains(
        "one reg_ours_67108864_1 $SCALE reg --size 67108864 --iters 8\none reg_c_67108864_1"
    ));
    assert!(s.contains("one qp_ours_1 $SCALE qp --iters 200\none qp_c_1 $CLOOP qp 200 1"));
    assert!(s.contains("job rate_send_bw_256_perftest_0 perftest send_bw 2 100 -q 256"));
    assert!(s.contains("job rate_write_bw_16_scoped_1 scoped write_bw 2 1562 -q 16"));
    // Every connection run has a port of its own.
    let ports: std::collections::BTreeSet<&str> = s
        .lines()
        .filter(|l| l.starts_with("cm cm_"))
        .filter_map(|l| l.split_whitespace().nth(4))
        .collect();
    assert_eq!(ports.len(), 20);
}

const CMTIME: &str = "creating id\nstep              total ms     max ms     min us  us / conn
create id    :        1.75       0.36       8.00      27.42
resolve addr :        9.46       8.72    6262.00     147.88
resolve route:        2.56       1.46      16.00      40.03
create qp    :       14.62       4.76      91.00     228.41
connect      :       72.02      39.51   18787.00    1125.25
disconnect   :       44.48      13.31    1032.00     695.03
destroy      :        1.30       0.21       8.00      20.31
";

#[test]
fn reads_cmtime_and_the_example() {
    let c = canonical_steps(&parse_steps(CMTIME)).unwrap();
    assert!((c["resolve"] - 13_770.0).abs() < 1e-6);
    assert!((c["setup"] - (13_770.0 + 14_620.0 + 72_020.0)).abs() < 1e-6);
    assert!((c["destroy"] - 1300.0).abs() < 1e-6);
    let ours = "step resolve 100\nstep create_qp 20\nstep connect 300\nstep disconnect 40\nstep destroy 5\nconns 16\n";
    let o = canonical_steps(&parse_steps(ours)).unwrap();
    assert_eq!((o["resolve"], o["setup"]), (100.0, 420.0));
    assert!(canonical_steps(&parse_steps("step resolve 100\n")).is_none());
    // connect_all's run: the setup as one step.
    let batch = canonical_steps(&parse_steps(
        "step setup 300\nstep disconnect 40\nstep destroy 5\n",
    ))
    .unwrap();
    assert_eq!((batch["setup"], batch.get("resolve")), (300.0, None));
    assert_eq!(
        parse_rss("Command exited with non-zero status 1\nmaxrss_kib 5600\n"),
        Some(5600.0)
    );
    assert_eq!(parse_ops("iters 200\nops_per_s 13768.5\n"), Some(13768.5));
    assert_eq!(parse_ops("ops_per_s 0\n"), None);
}

#[test]
fn rows_from_logs_with_a_failed_run_note_why() {
    let dir = std::env::temp_dir().join(format!("xtask-scale-test.{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let w = |f: &str, t: &str| fs::write(dir.join(f), t).unwrap();
    w(
        "status",
        "qp_c_0 0\nqp_ours_0 1\ncm_c_1_0 0 143\ncm_c_4_0 0 143\ncm_blocking_1_0 0 0\ncm_blocking_4_0 0 0\n\
         cm_cserial_1_0 0 0\ncm_cserial_4_0 0 0\n",
    );
    w("qp_c_0.txt", "iters 200\nops_per_s 1000\n");
    w("qp_ours_0.txt", "scale: ibv_create_qp failed\n");
    w("cm_c_1_0.client.txt", CMTIME);
    w("cm_c_4_0.client.txt", CMTIME);
    let ours = "step create_id 10\nstep resolve_addr 20\nstep resolve_route 30\nstep create_qp 40\nstep connect 400\nstep disconnect 50\nstep destroy 5\n";
    w("cm_blocking_1_0.client.txt", ours);
    w("cm_blocking_4_0.client.txt", ours);
    let serial = "step create_id 5\nstep resolve_addr 25\nstep resolve_route 30\nstep create_qp 40\nstep connect 300\nstep disconnect 50\nstep destroy 5\nconns 4\n";
    w("cm_cserial_1_0.client.txt", serial);
    w("cm_cserial_4_0.client.txt", serial);
    for (f, kib) in [
        ("cm_c_1_0", 1000),
        ("cm_c_4_0", 1300),
        ("cm_blocking_1_0", 2000),
        ("cm_blocking_4_0", 2600),
        ("cm_cserial_1_0", 1000),
        ("cm_cserial_4_0", 1600),
    ] {
        w(&format!("{f}.client.rss"), &format!("maxrss_kib {kib}\n"));
        w(&format!("{f}.server.rss"), &format!("maxrss_kib {kib}\n"));
    }
    let plan = Plan {
        parts: vec!["setup", "qp"],
        reps: 1,
        conns: vec![4],
        timeout: Duration::from_secs(1),
    };
    let rows = rows(&plan, &dir);
    let _ = fs::remove_dir_all(&dir);
    let find = |t: &str| rows.iter().find(|r| r.test == t).unwrap();
    let qp = find("qp_lifecycle");
    assert!(qp.ours.is_nan() && qp.c == 1000.0);
    assert_eq!(
        qp.note.as_deref(),
        Some("qp_ours_0: exit [1]: scale: ibv_create_qp failed")
    );
    let setup = find("cm_setup_blocking");
    assert!((setup.ours - 4.0 / 500e-6).abs() < 1e-6, "{setup:?}");
    assert!((setup.c - 4.0 / 100.41e-3).abs() < 1e-6, "{setup:?}");
    let mem = find("cm_mem_client_blocking");
    assert_eq!((mem.ours, mem.c, mem.ratio()), (200.0, 100.0, 0.5));
    // The blocking client against the C loop's serial client, on the same server.
    let serial = find("cm_setup_blocking_serial");
    assert!((serial.ours - 4.0 / 500e-6).abs() < 1e-6, "{serial:?}");
    assert!((serial.c - 4.0 / 400e-6).abs() < 1e-6, "{serial:?}");
    let mem = find("cm_mem_client_blocking_serial");
    assert_eq!((mem.ours, mem.c, mem.ratio()), (200.0, 200.0, 1.0));
    assert!(
        !rows
            .iter()
            .any(|r| r.test == "cm_mem_server_blocking_serial")
    );
    assert!(
        find("cm_setup_tokio")
            .note
            .as_deref()
            .unwrap()
            .starts_with("cm_tokio_4_0: did not run")
    );
    let json = to_json(&rows);
    assert!(json.contains("{\"test\": \"qp_lifecycle\", \"n\": 200, \"ours\": null, \"c\": 1000, \"unit\": \"ops/s\", \"ratio\": null, \"note\": \"qp_ours_0: exit [1]: scale: ibv_create_qp failed\"}"));
    let md = table(&rows);
    assert!(
        md.contains(
            "| `cm_mem_client_blocking` | 4 | 200 | 100 | KiB/conn | 0.5000 | below target |"
        ),
        "{md}"
    );
}

#[test]
fn ratio_is_a_rate_for_rates_and_costs() {
    let r = |rate| Row {
        test: "reg".into(),
        n: 1,
        ours: 2.0,
        c: 4.0,
        unit: "x",
        rate,
        note: None,
    };
    assert_eq!(r(true).ratio(), 0.5);
    assert_eq!(r(false).ratio(), 2.0);
}
