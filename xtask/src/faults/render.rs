//! The rows as faults.json and as the printed table.

use std::fmt::Write as _;

use super::Row;

pub(super) fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// faults.json: a list of rows.
pub(crate) fn to_json(rows: &[Row]) -> String {
    let zero = |ok: bool| {
        if ok {
            "0".to_string()
        } else {
            "null".to_string()
        }
    };
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "  {{\"scenario\": {}, \"program\": {}, \"expected\": {}, \"observed\": {}, \
                 \"time_to_error_s\": {}, \"messages\": {}, \"lost\": {}, \"duplicated\": {}, \
                 \"corrupted\": {}, \"leaked_objects\": {}, \"verdict\": {}}}",
                json_str(&r.scenario),
                json_str(&r.program),
                json_str(&r.expected),
                json_str(&r.observed),
                r.time_to_error_s
                    .map_or("null".into(), |t| format!("{t:.3}")),
                json_str(&r.messages),
                zero(r.verified_zero),
                zero(r.verified_zero),
                zero(r.verified_zero),
                r.leaked.map_or("null".into(), |n| n.to_string()),
                json_str(if r.pass { "pass" } else { "fail" }),
            )
        })
        .collect();
    format!("[\n{}\n]\n", items.join(",\n"))
}

/// Prints the table ([`table`]).
pub fn print_table(rows: &[Row]) {
    let text = table(rows);
    say!("{}", text.strip_suffix('\n').unwrap_or(&text));
}

/// The table: a line per row, with a failed row's messages under it.
pub(super) fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<4} {:<30} {:<50} {:>6}  observed",
        "", "scenario", "program", "tte_s"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "{:<4} {:<30} {:<50} {:>6}  {}",
            if r.pass { "ok" } else { "FAIL" },
            r.scenario,
            r.program,
            r.time_to_error_s.map_or("-".into(), |t| format!("{t:.2}")),
            r.observed
        );
        if !r.pass && !r.messages.is_empty() {
            let _ = writeln!(out, "     messages: {}", r.messages);
        }
    }
    out
}
