//! Unit tests of the fault matrix's bounds and of the pinned renderers.

use std::time::Duration;

use super::Row;
use super::cases::*;
use super::render::*;
use super::verdict::add_throughput;

#[test]
fn retry_bound_is_the_spec_formula() {
    // 4.096 us x 2^timeout x (retry_cnt + 1)
    assert!((retry_bound(14, 6).as_secs_f64() - 0.4697).abs() < 1e-3);
    assert!((retry_bound(16, 3).as_secs_f64() - 1.0737).abs() < 1e-3);
    assert!((retry_bound(18, 6).as_secs_f64() - 7.5162).abs() < 1e-3);
}

#[test]
fn rnr_timer_is_the_spec_table() {
    assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
    assert_eq!(rnr_timer(1), Duration::from_micros(10));
    assert_eq!(rnr_timer(12), Duration::from_micros(640));
    assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
    // rnr_retry x timer + slack
    assert_eq!(rnr_bound(0, 12), RNR_SLACK);
    assert_eq!(
        rnr_bound(6, 31),
        Duration::from_micros(6 * 491_520) + RNR_SLACK
    );
}

fn row(scenario: &str, program: &str, pass: bool, client_s: f64) -> Row {
    Row {
        scenario: scenario.into(),
        program: program.into(),
        expected: "both exit 0".into(),
        observed: "server exit 0 after 1.0 s".into(),
        time_to_error_s: None,
        messages: String::new(),
        verified_zero: pass,
        leaked: Some(0),
        pass,
        client_s,
    }
}

#[test]
fn renderers_are_pinned() {
    let mut rows = vec![
        row("clean", "send_recv (verified)", true, 2.0),
        row("netem loss 1%", "send_recv (verified)", true, 4.0),
        Row {
            time_to_error_s: Some(1.23456),
            messages: "Error: \"peer\" gone\tnow".into(),
            leaked: None,
            ..row("kill server", "rping", false, 0.5)
        },
    ];
    add_throughput(&mut rows);
    crate::pinned::assert_pinned("faults.table.txt", &table(&rows));
    crate::pinned::assert_pinned("faults.json", &to_json(&rows));
}

#[test]
fn json_is_escaped() {
    assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
}
