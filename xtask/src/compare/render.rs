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

/// The median of `v` (the mean of the middle two for an even count; `v` not empty).
pub(crate) fn median(v: &[f64]) -> f64 {
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
        let units = units(test);
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

/// The units of `test`'s two numbers.
fn units(test: &str) -> [&'static str; 2] {
    if is_bw(test) {
        ["MB/sec", "Mpps"]
    } else {
        ["t_typical usec", "p99 usec"]
    }
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
    let _ = writeln!(out, "{}", table_header(plan, &pairs));
    let mut misses = Vec::new();
    for test in &plan.tests {
        for &size in sizes_for(plan, test) {
            for unit in units(test) {
                let ours: Vec<Option<&Row>> = plan
                    .paths
                    .iter()
                    .map(|p| find(rows, test, p, size, unit))
                    .collect();
                let cells = Cells {
                    rows,
                    test,
                    size,
                    unit,
                };
                let _ = writeln!(out, "{}", cells.line(&ours, &pairs));
                misses.extend(ours.into_iter().flatten().filter_map(missed_target));
            }
        }
    }
    let _ = writeln!(out);
    targets_summary(&mut out, plan, rows, &misses);
    let _ = writeln!(out, "logs: {}", runs_dir.display());
    out
}

/// The table's header line: perftest's columns, a value and ratio per path, the path pairs.
fn table_header(plan: &Plan, pairs: &[(&str, &str)]) -> String {
    let mut header = format!(
        "{:<9} {:>8} {:<15} {:>12} {:>8}",
        "test", "size", "unit", "perftest", "spread"
    );
    for path in &plan.paths {
        let _ = write!(header, " {path:>12} {:>7}", "ratio");
    }
    for (a, b) in pairs {
        let _ = write!(header, " {:>11}", format!("{a}/{b}"));
    }
    header
}

/// One (test, size, unit) line of the table.
struct Cells<'a> {
    rows: &'a [Row],
    test: &'a str,
    size: u64,
    unit: &'a str,
}

impl Cells<'_> {
    /// The line: perftest's median and spread, each path's value and ratio (`ours`, in
    /// `--paths` order), each pair's ratio.
    fn line(&self, ours: &[Option<&Row>], pairs: &[(&str, &str)]) -> String {
        let Cells {
            rows,
            test,
            size,
            unit,
        } = *self;
        let any = ours.iter().flatten().next();
        let pt = any.map_or("-".to_owned(), |r| format!("{:.4}", r.perftest));
        let pt_spread = any.map_or("-".to_owned(), |r| {
            format!("{:.0}%", r.perftest_spread * 100.0)
        });
        let mut line = format!("{test:<9} {size:>8} {unit:<15} {pt:>12} {pt_spread:>8}");
        for r in ours {
            let cell = r.map_or("-".to_owned(), |r| format!("{:.4}", r.ours));
            let ratio = r.map_or("-".to_owned(), |r| format!("{:.2}", r.ratio()));
            let _ = write!(line, " {cell:>12} {ratio:>7}");
        }
        for (a, b) in pairs {
            let cell = match (
                find(rows, test, a, size, unit),
                find(rows, test, b, size, unit),
            ) {
                (Some(a), Some(b)) => format!("{:.3}", a.ours / b.ours),
                _ => "-".to_owned(),
            };
            let _ = write!(line, " {cell:>11}");
        }
        line
    }
}

/// The line of a row that misses its target (ours/perftest at least 1 for bandwidth, at
/// most 1 for latency).
fn missed_target(r: &Row) -> Option<String> {
    let ok = if is_bw(&r.test) {
        r.ratio() >= 1.0
    } else {
        r.ratio() <= 1.0
    };
    (!ok).then(|| {
        format!(
            "{} {} B {} {}: ratio {:.2} (target {} 1.00)",
            r.test,
            r.size,
            r.unit,
            r.path,
            r.ratio(),
            if is_bw(&r.test) { ">=" } else { "<=" }
        )
    })
}

/// The targets, the rows that missed them, the message rates against raw at the smallest
/// size, and the tests that had no scoped run.
fn targets_summary(out: &mut String, plan: &Plan, rows: &[Row], misses: &[String]) {
    let _ = writeln!(
        out,
        "targets: bandwidth/message rate ours/perftest >= 1.00, latency <= 1.00, safe (and scoped) vs raw within 3% at 2 B"
    );
    if misses.is_empty() {
        let _ = writeln!(out, "  every ours/perftest target met");
    } else {
        let _ = writeln!(out, "  missed ({}):", misses.len());
        for m in misses {
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

/// A JSON number, `null` for NaN and infinities.
pub(crate) fn json_num(v: f64) -> String {
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
    let panels = plan.tests.len().max(1);
    let nrows = panels.div_ceil(COLUMNS);
    let (w, h) = (
        COLUMNS as f64 * (PW + M) + M,
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
            M + (i % COLUMNS) as f64 * (PW + M),
            40.0 + M + (i / COLUMNS) as f64 * (PH + 2.0 * M),
        );
        let unit = units(test)[0];
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
        let panel = Panel {
            x0,
            y0,
            ymin,
            ymax,
            lo_log: lo_size.log2(),
            span,
        };
        panel.frame(&mut s, test, unit);
        panel.x_ticks(&mut s, sizes_for(plan, test));
        for (path, color) in path_colors(plan) {
            panel.line(&mut s, &pts, path, color);
        }
    }
    legend(&mut s, plan, h);
    s.push_str("</svg>\n");
    s
}

/// Width of one panel of the plot.
const PW: f64 = 420.0;
/// Height of one panel of the plot.
const PH: f64 = 260.0;
/// Margin around the panels.
const M: f64 = 50.0;
/// Panels side by side.
const COLUMNS: usize = 2;

/// One test's panel of the plot: its place and its axes' ranges.
struct Panel {
    /// Left edge.
    x0: f64,
    /// Top edge.
    y0: f64,
    /// The ratio at the bottom edge.
    ymin: f64,
    /// The ratio at the top edge.
    ymax: f64,
    /// log2 of the smallest size, at the left edge.
    lo_log: f64,
    /// log2 of the sizes' range, the panel's width.
    span: f64,
}

impl Panel {
    /// The x coordinate of `size`.
    fn x(&self, size: f64) -> f64 {
        self.x0 + (size.log2() - self.lo_log) / self.span * PW
    }

    /// The y coordinate of ratio `v`.
    fn y(&self, v: f64) -> f64 {
        self.y0 + PH - (v - self.ymin) / (self.ymax - self.ymin) * PH
    }

    /// The title, the frame, the dashed parity line and the ratio ticks.
    fn frame(&self, s: &mut String, test: &str, unit: &str) {
        let (x0, y0, ymin, ymax) = (self.x0, self.y0, self.ymin, self.ymax);
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
            self.y(1.0),
            x0 + PW,
            self.y(1.0)
        );
        let mut t = (ymin * 10.0).ceil() / 10.0;
        while t <= ymax {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{t:.1}</text>",
                x0 - 4.0,
                self.y(t) + 4.0
            );
            t += if ymax - ymin > 2.0 { 0.5 } else { 0.1 };
        }
    }

    /// A label under each of `sizes` (`2`, `4K`, `1M`).
    fn x_ticks(&self, s: &mut String, sizes: &[u64]) {
        for &size in sizes {
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
                self.x(size as f64),
                self.y0 + PH + 14.0
            );
        }
    }

    /// The line and dots of `path`'s finite ratios among `pts`.
    fn line(&self, s: &mut String, pts: &[&Row], path: &str, color: &str) {
        let line: Vec<String> = pts
            .iter()
            .filter(|r| r.path == path && r.ratio().is_finite())
            .map(|r| format!("{:.1},{:.1}", self.x(r.size as f64), self.y(r.ratio())))
            .collect();
        if line.is_empty() {
            return;
        }
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

/// The legend at the bottom of a plot of height `h`: a swatch per path, the axes' note.
fn legend(s: &mut String, plan: &Plan, h: f64) {
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
}
