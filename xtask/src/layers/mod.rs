//! `cargo xtask layers`: holds the code of `src/` to the layer table of `ARCHITECTURE.md`.
//!
//! The table (under the heading `## Layers`) has a row per layer: the first cell `L<n>`,
//! the second its name, the third the crate's modules in it (crate paths in backticks,
//! comma separated). A file belongs to the layer of the longest listed module path that is
//! a prefix of its own module path; the crate root (`src/lib.rs`, re-exports only) is
//! exempt. The check fails on
//! - a file whose module no row lists;
//! - an import from a file to a module of a higher layer;
//! - a circle (strongly connected component) of more than [`MAX_CIRCLE`] files that spans
//!   more than one top-level module (a module and its own submodules may refer to each
//!   other).
//!
//! Imports are read from the code alone ([`graph`]): comments (doc links among them) and
//! `#[cfg(test)]` modules do not count.

mod graph;
mod scan;

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

use crate::{Error, Result};
use graph::ImportGraph;

/// The largest circle of files across top-level modules that passes.
pub const MAX_CIRCLE: usize = 3;

/// `cargo xtask layers --help`.
const USAGE: &str = "\
usage: cargo xtask layers [--edges]

Checks the import graph of src/ against the layer table of ARCHITECTURE.md: no import of a
higher layer, every module in the table, no circle of more than 3 files across top-level
modules. --edges also prints every file's imports.";

/// One row of the layer table.
#[derive(Debug, PartialEq)]
pub struct Layer {
    /// The number after `L`.
    pub level: u32,
    /// The layer's name, e.g. `values`.
    pub name: String,
    /// The module paths it holds, e.g. `[["qp"], ["cq"]]`.
    pub modules: Vec<Vec<String>>,
}

impl Layer {
    fn shown(&self) -> String {
        format!("L{} {}", self.level, self.name)
    }
}

/// Parses the table under `## Layers` of `text` (ARCHITECTURE.md).
pub fn parse_table(text: &str) -> Result<Vec<Layer>> {
    let mut layers = Vec::new();
    let section = text
        .split_once("\n## Layers")
        .map(|(_, rest)| rest)
        .ok_or_else(|| Error::new("ARCHITECTURE.md has no `## Layers` section"))?;
    for line in section.lines().skip(1) {
        if line.starts_with("## ") {
            break;
        }
        let cells: Vec<&str> = line
            .trim()
            .trim_matches('|')
            .split('|')
            .map(str::trim)
            .collect();
        let Some(level) = cells.first().and_then(|c| c.strip_prefix('L')) else {
            continue;
        };
        let (Ok(level), Some(name), Some(modules)) = (level.parse(), cells.get(1), cells.get(2))
        else {
            continue;
        };
        let modules = modules
            .split('`')
            .skip(1)
            .step_by(2)
            .flat_map(|m| m.split(','))
            .map(|m| m.trim().split("::").map(str::to_owned).collect())
            .collect();
        layers.push(Layer {
            level,
            name: (*name).to_owned(),
            modules,
        });
    }
    if layers.is_empty() {
        return Err(Error::new(
            "ARCHITECTURE.md's `## Layers` has no `L<n>` rows",
        ));
    }
    Ok(layers)
}

/// The layer of module path `module`: the one listing its longest prefix.
fn layer_of<'a>(layers: &'a [Layer], module: &[String]) -> Option<&'a Layer> {
    layers
        .iter()
        .flat_map(|l| l.modules.iter().map(move |m| (l, m)))
        .filter(|(_, m)| module.starts_with(m))
        .max_by_key(|(_, m)| m.len())
        .map(|(l, _)| l)
}

/// What the check found.
pub struct Report {
    /// Files of the graph.
    pub files: usize,
    /// Imports between files.
    pub edges: usize,
    /// Rows of the table.
    pub layers: usize,
    /// The largest circle, as file paths (empty when there is none).
    pub largest_circle: Vec<String>,
    /// One line per problem: an unlisted module, an upward import, a circle.
    pub problems: Vec<String>,
}

impl Report {
    /// Whether the code keeps to the table.
    pub fn passed(&self) -> bool {
        self.problems.is_empty()
    }

    /// The report as printed: problems, then the summary lines.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for problem in &self.problems {
            let _ = writeln!(out, "{problem}");
        }
        let _ = writeln!(
            out,
            "layers: {} files, {} imports, {} layers",
            self.files, self.edges, self.layers
        );
        let _ = match self.largest_circle.len() {
            0 => writeln!(out, "layers: no circle"),
            n => writeln!(
                out,
                "layers: largest circle: {n} files: {}",
                self.largest_circle.join(", ")
            ),
        };
        let verdict = if self.passed() { "OK" } else { "FAILED" };
        let _ = writeln!(out, "layers: {verdict} ({} problems)", self.problems.len());
        out
    }
}

/// Checks `<root>/src` against `<root>/ARCHITECTURE.md`.
pub fn check_tree(root: &Path) -> Result<(Report, ImportGraph)> {
    let table_path = root.join("ARCHITECTURE.md");
    let text = fs::read_to_string(&table_path)
        .map_err(|e| Error::new(format!("{}: {e}", table_path.display())))?;
    let layers = parse_table(&text)?;
    let graph = ImportGraph::read(&root.join("src"))?;
    let mut problems = unlisted_files(&graph, &layers);
    problems.extend(upward_imports(&graph, &layers));
    let circles = graph.circles();
    problems.extend(circles.iter().filter_map(|c| circle_problem(&graph, c)));
    let report = Report {
        files: graph.files.len(),
        edges: graph.edges.len(),
        layers: layers.len(),
        largest_circle: circles.first().map_or_else(Vec::new, |c| {
            c.iter().map(|&i| graph.files[i].shown()).collect()
        }),
        problems,
    };
    Ok((report, graph))
}

/// A line for each file (the crate root aside) whose module no row lists.
fn unlisted_files(graph: &ImportGraph, layers: &[Layer]) -> Vec<String> {
    graph
        .files
        .iter()
        .filter(|f| !f.module.is_empty() && layer_of(layers, &f.module).is_none())
        .map(|f| {
            format!(
                "unlisted: {} (module {}) is in no layer: add it to the table",
                f.shown(),
                f.module.join("::")
            )
        })
        .collect()
}

/// A line for each import of a module of a higher layer than the importer's.
fn upward_imports(graph: &ImportGraph, layers: &[Layer]) -> Vec<String> {
    let layer = |i: usize| layer_of(layers, &graph.files[i].module);
    graph
        .edges
        .iter()
        .filter(|e| !graph.files[e.from].module.is_empty())
        .filter_map(|e| {
            let (from, to) = (layer(e.from)?, layer(e.to)?);
            (to.level > from.level).then(|| {
                format!(
                    "upward: {} ({}) imports {} from {} ({})",
                    graph.files[e.from].shown(),
                    from.shown(),
                    e.path,
                    graph.files[e.to].shown(),
                    to.shown()
                )
            })
        })
        .collect()
}

/// The problem line of `circle`, when it is too large and spans top-level modules.
fn circle_problem(graph: &ImportGraph, circle: &[usize]) -> Option<String> {
    let top = |i: usize| graph.files[i].module.first().cloned();
    let one_module = top(circle[0]).is_some() && circle.iter().all(|&i| top(i) == top(circle[0]));
    if circle.len() <= MAX_CIRCLE || one_module {
        return None;
    }
    let files: Vec<String> = circle.iter().map(|&i| graph.files[i].shown()).collect();
    Some(format!(
        "circle: {} files across modules import each other (at most {MAX_CIRCLE}): {}",
        circle.len(),
        files.join(", ")
    ))
}

/// Every file's imports, a line each: `src/a.rs -> src/b.rs (crate::b::X), ...`.
fn render_edges(graph: &ImportGraph) -> String {
    let mut out = String::new();
    for (i, file) in graph.files.iter().enumerate() {
        let targets: Vec<String> = graph
            .edges
            .iter()
            .filter(|e| e.from == i)
            .map(|e| format!("{} ({})", graph.files[e.to].shown(), e.path))
            .collect();
        let _ = writeln!(out, "{} -> {}", file.shown(), targets.join(", "));
    }
    out
}

/// Runs the check on the workspace and prints its report; whether it passed. `cargo xtask
/// test` runs this as a step.
pub fn check(root: &Path) -> Result<bool> {
    let (report, _) = check_tree(root)?;
    say!("{}", report.render().trim_end());
    Ok(report.passed())
}

/// `cargo xtask layers [--edges]`.
pub fn layers_command(args: Vec<OsString>) -> Result<u8> {
    let mut edges = false;
    for arg in &args {
        match arg.to_str() {
            Some("--edges") => edges = true,
            Some("-h" | "--help") => {
                say!("{USAGE}");
                return Ok(0);
            }
            _ => return Err(Error::usage(format!("layers: unexpected {arg:?}"))),
        }
    }
    let (report, graph) = check_tree(crate::workspace_root())?;
    if edges {
        say!("{}", render_edges(&graph).trim_end());
    }
    say!("{}", report.render().trim_end());
    Ok(if report.passed() { 0 } else { 1 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    const TABLE: &str = "# Architecture\n\nLayers.\n\n## Layers\n\n\
        | layer | name | modules | what |\n|---|---|---|---|\n\
        | L0 | sys | `ffi` | bindings |\n\
        | L1 | values | `error`, `values` | values |\n\
        | L2 | resources | `mr`, `pd`, `cq` | objects |\n\
        | L4 | data path | `qp` | queues |\n\
        | L5 | setup | `cm`, `qp::wire` | setup |\n\n## Next\n| L9 | x | `late` | no |\n";

    /// A fixture crate: ARCHITECTURE.md with [`TABLE`] and the given files under src/.
    struct Fixture(PathBuf);

    impl Fixture {
        fn new(name: &str, files: &[(&str, &str)]) -> Fixture {
            let dir =
                std::env::temp_dir().join(format!("xtask-layers-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("src")).unwrap();
            fs::write(dir.join("ARCHITECTURE.md"), TABLE).unwrap();
            for (rel, text) in files {
                let path = dir.join("src").join(rel);
                fs::create_dir_all(path.parent().unwrap()).unwrap();
                fs::write(path, text).unwrap();
            }
            Fixture(dir)
        }

        fn problems(&self) -> Vec<String> {
            check_tree(&self.0).unwrap().0.problems
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn the_table_is_parsed() {
        let layers = parse_table(TABLE).unwrap();
        let shown: Vec<String> = layers.iter().map(Layer::shown).collect();
        assert_eq!(
            shown,
            [
                "L0 sys",
                "L1 values",
                "L2 resources",
                "L4 data path",
                "L5 setup"
            ]
        );
        assert_eq!(layers[4].modules, [vec!["cm"], vec!["qp", "wire"]]);
        let module = |p: &str| p.split("::").map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(
            layer_of(&layers, &module("qp::wire::codec")).unwrap().level,
            5
        );
        assert_eq!(layer_of(&layers, &module("qp::post")).unwrap().level, 4);
        assert!(layer_of(&layers, &module("late")).is_none());
        assert!(parse_table("# no table\n").is_err());
    }

    #[test]
    fn an_upward_import_fails_and_a_downward_one_passes() {
        let f = Fixture::new(
            "up",
            &[
                ("lib.rs", "pub mod error; pub mod qp;"),
                ("error.rs", "use crate::qp::Qp;"),
                ("qp/mod.rs", "use crate::error::Error; pub struct Qp;"),
            ],
        );
        assert_eq!(
            f.problems(),
            [
                "upward: src/error.rs (L1 values) imports crate::qp::Qp from src/qp/mod.rs \
              (L4 data path)"
            ]
        );
        let f = Fixture::new(
            "down",
            &[("error.rs", ""), ("qp/mod.rs", "use crate::error::Error;")],
        );
        assert_eq!(f.problems(), Vec::<String>::new());
    }

    #[test]
    fn doc_links_and_test_modules_do_not_count() {
        let f = Fixture::new(
            "docs",
            &[
                (
                    "error.rs",
                    "//! See [`crate::qp::Qp`].\n/// [`crate::cm`]\nfn f() {}\n\
                              #[cfg(test)]\nmod tests { use crate::qp::Qp; }\n",
                ),
                ("qp/mod.rs", "pub struct Qp;"),
                ("cm.rs", ""),
            ],
        );
        assert_eq!(f.problems(), Vec::<String>::new());
    }

    #[test]
    fn grouped_uses_and_root_reexports_resolve_to_their_modules() {
        let f = Fixture::new(
            "grouped",
            &[
                (
                    "lib.rs",
                    "pub use qp::{Qp, wire::Endpoint};\npub use error::Error;",
                ),
                ("error.rs", "use crate::Error as E;"),
                ("mr.rs", "use crate::{error::{self, Error}, Qp};"),
                ("pd.rs", "fn f() -> crate::Endpoint { todo!() }"),
                ("qp/mod.rs", "pub struct Qp;"),
                ("qp/wire.rs", "pub struct Endpoint;"),
            ],
        );
        assert_eq!(
            f.problems(),
            [
                "upward: src/mr.rs (L2 resources) imports crate::Qp from src/qp/mod.rs \
                 (L4 data path)",
                "upward: src/pd.rs (L2 resources) imports crate::Endpoint from src/qp/wire.rs \
                 (L5 setup)",
            ]
        );
    }

    #[test]
    fn unlisted_modules_are_reported() {
        let f = Fixture::new("unlisted", &[("lib.rs", ""), ("late.rs", "")]);
        assert_eq!(
            f.problems(),
            ["unlisted: src/late.rs (module late) is in no layer: add it to the table"]
        );
    }

    #[test]
    fn a_circle_of_four_across_modules_fails_and_within_one_passes() {
        let ring = |names: [&str; 4], paths: [&str; 4]| -> Vec<(String, String)> {
            (0..4)
                .map(|i| {
                    (
                        names[i].to_owned(),
                        format!("use crate::{};", paths[(i + 1) % 4]),
                    )
                })
                .collect()
        };
        let across = ring(
            ["mr.rs", "pd.rs", "cq.rs", "error.rs"],
            ["mr", "pd", "cq", "error"],
        );
        let files: Vec<(&str, &str)> = across
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        let problems = Fixture::new("circle", &files).problems();
        let circles: Vec<&String> = problems
            .iter()
            .filter(|p| p.starts_with("circle"))
            .collect();
        assert_eq!(
            circles,
            [
                "circle: 4 files across modules import each other (at most 3): src/cq.rs, \
              src/error.rs, src/mr.rs, src/pd.rs"
            ]
        );
        let within = ring(
            ["qp/mod.rs", "qp/a.rs", "qp/b.rs", "qp/c/mod.rs"],
            ["qp", "qp::a", "qp::b", "qp::c"],
        );
        let files: Vec<(&str, &str)> = within
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        let f = Fixture::new("within", &files);
        let (report, _) = check_tree(&f.0).unwrap();
        assert_eq!(report.problems, Vec::<String>::new());
        assert_eq!(report.largest_circle.len(), 4);
        assert!(report.render().ends_with("layers: OK (0 problems)\n"));
    }
}
