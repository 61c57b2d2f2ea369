//! What `compare` shows: the rows of medians, the printed table, compare.json and the SVG
//! plot.

use std::fmt::Write as _;
use std::path::Path;

use super::runner::Results;
use super::{ATOMIC_SIZE, Plan, is_bw, paths_for, sizes_for};

/// One row of compare.json.
pub(super) struct Row {
    pub(super) test: String,
    pub(super) path: &'static str,
    pub(super) size: u64,
    pub(super) unit: &'static str,
    pub(super) ours: f64,
    pub(super) perftest: f64,
    /// perftest's own spread over the repetitions: (max - min) / median.
    pub(super) perftest_spread: f64,
    /// The metric the plot shows (bandwidth, or typical latency).
    pub(super) primary: bool,
}

impl Row {
    pub(super) fn ratio(&self) -> f64 {
        self.ours / self.perftest
    }
}

pub(super) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// (max - min) / median: how much one implementation varies between repetitions.
pub(super) fn spread(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    let min = v.iter().copied().fold(f64::MAX, f64::min);
    (max - min) / median(v)
}

pub(super) fn rows(plan: &Plan, results: &Results) -> Vec<Row> {
    let mut rows = Vec::new();
    for test in &plan.tests {
        let units: [&'static str; 2] = if is_bw(test) {
            ["MB/sec", "Mpps"]
        } else {
            ["t_typical usec", "p99 usec"]
        };
        for &size in sizes_for(plan, test) {
            let Some(pt) = results.get(&(test.clone(), size, "perftest".to_string())) else {
                continue;
            };
            for path in paths_for(plan, test) {
                let Some(ours) = results.get(&(test.clone(), size, path.to_string())) else {
                    continue;
                };
                for (m, unit) in units.iter().enumerate() {
                    let o: Vec<f64> = ours.iter().map(|n| n[m]).collect();
                    let p: Vec<f64> = pt.iter().map(|n| n[m]).collect();
                    rows.push(Row {
                        test: test.clone(),
                        path,
                        size,
                        unit,
                        ours: median(&o),
                        perftest: median(&p),
                        perftest_spread: spread(&p),
                        primary: m == 0,
                    });
                }
            }
        }
    }
    rows
}

pub(super) fn find<'a>(
    rows: &'a [Row],
    test: &str,
    path: &str,
    size: u64,
    unit: &str,
) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.test == test && r.path == path && r.size == size && r.unit == unit)
}

/// The ratio columns between two of our paths (`a/b`) the table shows, of those `--paths`
/// names.
pub(super) fn path_pairs(plan: &Plan) -> Vec<(&'static str, &'static str)> {
    [("safe", "raw"), ("scoped", "safe"), ("scoped", "raw")]
        .into_iter()
        .filter(|(a, b)| plan.paths.contains(a) && plan.paths.contains(b))
        .collect()
}

/// Prints [`table`].
pub(super) fn print_table(plan: &Plan, rows: &[Row], runs_dir: &Path) {
    let text = table(plan, rows, runs_dir);
    say!("{}", text.strip_suffix('\n').unwrap_or(&text));
}

/// The printed table, its targets and where the logs are.
pub(super) fn table(plan: &Plan, rows: &[Row], runs_dir: &Path) -> String {
    let mut out = String::new();
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "perftest vs rdma-verbs `perf` (soft-RoCE rxe0 in a TCG guest; median of {} repetition(s))",
        plan.reps
    );
    let pairs = path_pairs(plan);
    let mut header = format!(
        "{:<9} {:>8} {:<15} {:>12} {:>8}",
        "test", "size", "unit", "perftest", "spread"
    );
    for path in &plan.paths {
        let _ = write!(header, " {path:>12} {:>7}", "ratio");
    }
    for (a, b) in &pairs {
        let _ = write!(header, " {:>11}", format!("{a}/{b}"));
    }
    let _ = writeln!(out, "{header}");
    let mut misses = Vec::new();
    for test in &plan.tests {
        for &size in sizes_for(plan, test) {
            let units: &[&str] = if is_bw(test) {
                &["MB/sec", "Mpps"]
            } else {
                &["t_typical usec", "p99 usec"]
            };
            for unit in units {
                let ours: Vec<Option<&Row>> = plan
                    .paths
                    .iter()
                    .map(|p| find(rows, test, p, size, unit))
                    .collect();
                let any = ours.iter().flatten().next();
                let pt = any.map_or("-".to_owned(), |r| format!("{:.4}", r.perftest));
                let pt_spread = any.map_or("-".to_owned(), |r| {
                    format!("{:.0}%", r.perftest_spread * 100.0)
                });
                let mut line = format!("{test:<9} {size:>8} {unit:<15} {pt:>12} {pt_spread:>8}");
                for r in &ours {
                    let cell = r.map_or("-".to_owned(), |r| format!("{:.4}", r.ours));
                    let ratio = r.map_or("-".to_owned(), |r| format!("{:.2}", r.ratio()));
                    let _ = write!(line, " {cell:>12} {ratio:>7}");
                }
                for (a, b) in &pairs {
                    let cell = match (
                        find(rows, test, a, size, unit),
                        find(rows, test, b, size, unit),
                    ) {
                        (Some(a), Some(b)) => format!("{:.3}", a.ours / b.ours),
                        _ => "-".to_owned(),
                    };
                    let _ = write!(line, " {cell:>11}");
                }
                let _ = writeln!(out, "{line}");
                for r in ours.into_iter().flatten() {
                    let ok = if is_bw(test) {
                        r.ratio() >= 1.0
                    } else {
                        r.ratio() <= 1.0
                    };
                    if !ok {
                        misses.push(format!(
                            "{test} {size} B {unit} {}: ratio {:.2} (target {} 1.00)",
                            r.path,
                            r.ratio(),
                            if is_bw(test) { ">=" } else { "<=" }
                        ));
                    }
                }
            }
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "targets: bandwidth/message rate ours/perftest >= 1.00, latency <= 1.00, safe (and scoped) vs raw within 3% at 2 B"
    );
    if misses.is_empty() {
        let _ = writeln!(out, "  every ours/perftest target met");
    } else {
        let _ = writeln!(out, "  missed ({}):", misses.len());
        for m in &misses {
            let _ = writeln!(out, "    {m}");
        }
    }
    for test in plan.tests.iter().filter(|t| is_bw(t)) {
        let small = if test == "atomic_bw" { ATOMIC_SIZE } else { 2 };
        for path in ["safe", "scoped"] {
            if let (Some(s), Some(r)) = (
                find(rows, test, path, small, "Mpps"),
                find(rows, test, "raw", small, "Mpps"),
            ) {
                let d = (s.ours / r.ours - 1.0) * 100.0;
                let _ = writeln!(
                    out,
                    "  {test} {small} B {path} vs raw message rate: {d:+.1}% ({})",
                    if d.abs() <= 3.0 {
                        "within 3%"
                    } else {
                        "outside 3%"
                    }
                );
            }
        }
    }
    let lat: Vec<&str> = plan
        .tests
        .iter()
        .filter(|t| !is_bw(t))
        .map(String::as_str)
        .collect();
    if plan.paths.contains(&"scoped") && !lat.is_empty() {
        let _ = writeln!(
            out,
            "  no scoped runs for {} (perf --scoped runs the bandwidth tests only)",
            lat.join(", ")
        );
    }
    let _ = writeln!(out, "logs: {}", runs_dir.display());
    out
}

pub(super) fn to_json(rows: &[Row]) -> String {
    let mut s = String::from("[\n");
    for (i, r) in rows.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {{\"test\": \"{}\", \"path\": \"{}\", \"size\": {}, \"unit\": \"{}\", \"ours\": {}, \"perftest\": {}, \"ratio\": {}}}{}",
            r.test,
            r.path,
            r.size,
            r.unit,
            json_num(r.ours),
            json_num(r.perftest),
            json_num(r.ratio()),
            if i + 1 < rows.len() { "," } else { "" }
        );
    }
    s.push_str("]\n");
    s
}

pub(super) fn json_num(v: f64) -> String {
    if v.is_finite() {
        format!("{v}")
    } else {
        "null".to_owned()
    }
}

/// The plot's colour of each of `--paths`.
pub(super) fn path_colors(plan: &Plan) -> Vec<(&'static str, &'static str)> {
    [
        ("safe", "#1f77b4"),
        ("raw", "#ff7f0e"),
        ("scoped", "#2ca02c"),
    ]
    .into_iter()
    .filter(|(p, _)| plan.paths.contains(p))
    .collect()
}

/// A plot of ours/perftest against size: one panel per test, a line per data path
/// (bandwidth tests: MiB/s ratio, higher is better; latency: typical-latency ratio, lower
/// is better), a dashed line at parity.
pub(super) fn svg(plan: &Plan, rows: &[Row]) -> String {
    const PW: f64 = 420.0;
    const PH: f64 = 260.0;
    const M: f64 = 50.0;
    let cols = 2usize;
    let panels = plan.tests.len().max(1);
    let nrows = panels.div_ceil(cols);
    let (w, h) = (
        cols as f64 * (PW + M) + M,
        nrows as f64 * (PH + 2.0 * M) + 40.0,
    );
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{M}\" y=\"24\" font-size=\"15\">rdma-verbs perf / perftest (soft-RoCE, TCG guest; median of {} runs)</text>\n",
        plan.reps
    );
    let all_sizes = || plan.tests.iter().flat_map(|t| sizes_for(plan, t)).copied();
    let (lo_size, hi_size) = (
        all_sizes().min().unwrap_or(2).max(1) as f64,
        all_sizes().max().unwrap_or(2).max(2) as f64,
    );
    let span = (hi_size.log2() - lo_size.log2()).max(1.0);
    for (i, test) in plan.tests.iter().enumerate() {
        let (x0, y0) = (
            M + (i % cols) as f64 * (PW + M),
            40.0 + M + (i / cols) as f64 * (PH + 2.0 * M),
        );
        let unit = if is_bw(test) {
            "MB/sec"
        } else {
            "t_typical usec"
        };
        let pts: Vec<&Row> = rows
            .iter()
            .filter(|r| &r.test == test && r.unit == unit)
            .collect();
        let ratios: Vec<f64> = pts
            .iter()
            .map(|r| r.ratio())
            .filter(|v| v.is_finite())
            .collect();
        let ymin = ratios.iter().copied().fold(0.8f64, f64::min).min(0.8) - 0.05;
        let ymax = ratios.iter().copied().fold(1.2f64, f64::max).max(1.2) + 0.05;
        let x = |size: f64| x0 + (size.log2() - lo_size.log2()) / span * PW;
        let y = |v: f64| y0 + PH - (v - ymin) / (ymax - ymin) * PH;
        let better = if is_bw(test) {
            "higher is better"
        } else {
            "lower is better"
        };
        let _ = writeln!(
            s,
            "<text x=\"{x0}\" y=\"{}\" font-size=\"13\">{test}: {unit} ours/perftest ({better})</text>\n\
             <rect x=\"{x0}\" y=\"{y0}\" width=\"{PW}\" height=\"{PH}\" fill=\"none\" stroke=\"#888\"/>\n\
             <line x1=\"{x0}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"#444\" stroke-dasharray=\"4 3\"/>",
            y0 - 8.0,
            y(1.0),
            x0 + PW,
            y(1.0)
        );
        // y ticks
        let mut t = (ymin * 10.0).ceil() / 10.0;
        while t <= ymax {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{t:.1}</text>",
                x0 - 4.0,
                y(t) + 4.0
            );
            t += if ymax - ymin > 2.0 { 0.5 } else { 0.1 };
        }
        // x ticks
        for &size in sizes_for(plan, test) {
            let label = if size >= 1 << 20 {
                format!("{}M", size >> 20)
            } else if size >= 1024 {
                format!("{}K", size >> 10)
            } else {
                size.to_string()
            };
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{label}</text>",
                x(size as f64),
                y0 + PH + 14.0
            );
        }
        for (path, color) in path_colors(plan) {
            let line: Vec<String> = pts
                .iter()
                .filter(|r| r.path == path && r.ratio().is_finite())
                .map(|r| format!("{:.1},{:.1}", x(r.size as f64), y(r.ratio())))
                .collect();
            if !line.is_empty() {
                let _ = writeln!(
                    s,
                    "<polyline points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"/>",
                    line.join(" ")
                );
                for p in &line {
                    let (px, py) = p.split_once(',').unwrap_or(("0", "0"));
                    let _ = writeln!(
                        s,
                        "<circle cx=\"{px}\" cy=\"{py}\" r=\"3\" fill=\"{color}\"/>"
                    );
                }
            }
        }
    }
    let ly = h - 14.0;
    let mut lx = M;
    for (path, color) in path_colors(plan) {
        let _ = writeln!(
            s,
            "<rect x=\"{lx}\" y=\"{}\" width=\"12\" height=\"4\" fill=\"{color}\"/><text x=\"{}\" y=\"{ly}\">{path} path</text>",
            ly - 4.0,
            lx + 16.0
        );
        lx += 90.0;
    }
    let _ = writeln!(
        s,
        "<text x=\"{lx}\" y=\"{ly}\">x: message size (bytes, log scale); dashed: parity</text>"
    );
    s.push_str("</svg>\n");
    s
}
