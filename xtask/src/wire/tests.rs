//! Unit tests of the case sets, the result files and the leak count.

use super::agent::leaked;
use super::{NodeResult, cases};

#[test]
fn node_results_round_trip() {
    let r = NodeResult {
        status: Some(1),
        early: true,
        elapsed_s: 2.5,
        tte_s: Some(0.25),
        leaked: Some(0),
        samples: vec![12, 0, 7],
        problem: Some("a\nb".into()),
        ..NodeResult::default()
    };
    let back = NodeResult::parse(&r.to_text());
    assert_eq!(back.status, Some(1));
    assert!(back.early && !back.hung && !back.killed);
    assert_eq!(back.tte_s, Some(0.25));
    assert_eq!(back.leaked, Some(0));
    assert_eq!(back.samples, vec![12, 0, 7]);
    assert_eq!(back.problem.as_deref(), Some("a b"));
}

#[test]
fn leaks_count_only_growth() {
    let before = vec![("qp".to_string(), 1), ("pd".to_string(), 1)];
    let after = vec![
        ("qp".to_string(), 3),
        ("pd".to_string(), 0),
        ("mr".to_string(), 2),
    ];
    assert_eq!(leaked(&before, &after), 4);
}

#[test]
fn every_set_has_cases_with_clients() {
    for set in [
        "interop",
        "faults-short",
        "ci",
        "faults",
        "faults:RNR",
        "interop:mcast",
        "interop:ud_cm",
    ] {
        let cases = cases(set).unwrap_or_default();
        assert!(!cases.is_empty(), "{set}");
        for c in &cases {
            assert!(!c.client.is_empty(), "{set}: {} has no client", c.program);
        }
    }
    assert!(cases("nope").is_err());
    assert!(cases("faults:no such row").is_err());
    assert!(cases("interop:no such row").is_err());
    assert_eq!(cases("interop:mcast").map(|c| c.len()).ok(), Some(2));
    assert_eq!(cases("interop:ud_cm").map(|c| c.len()).ok(), Some(2));
}
