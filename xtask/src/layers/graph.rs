//! The file-level import graph of a crate's `src/`: which file names a path that resolves
//! to which other file, and the strongly connected components (circles) of that graph.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::Path;

use super::scan::{self, UsePath};
use crate::{Error, Result};

/// One source file of the crate.
pub struct SourceFile {
    /// The path below `src/`, with `/` separators, e.g. `qp/mod.rs`.
    pub rel: String,
    /// Its module path: `qp/scope/post.rs` is `["qp", "scope", "post"]`, `lib.rs` is empty.
    pub module: Vec<String>,
    /// Its code: comments, literals' contents and test modules removed.
    code: String,
}

impl SourceFile {
    /// The path as shown in reports, e.g. `src/qp/mod.rs`.
    pub fn shown(&self) -> String {
        format!("src/{}", self.rel)
    }
}

/// One import: the first path by which `from` names something in `to`.
pub struct Edge {
    /// The importing file (an index into [`ImportGraph::files`]).
    pub from: usize,
    /// The imported file.
    pub to: usize,
    /// The path as written, e.g. `crate::cq::WcStatus`.
    pub path: String,
}

/// The files of a crate and the imports between them.
pub struct ImportGraph {
    /// Every file, sorted by path.
    pub files: Vec<SourceFile>,
    /// Every import, one per (from, to) pair, sorted.
    pub edges: Vec<Edge>,
}

/// Whether `name` is a generated bindings file, which the graph leaves out.
fn is_generated(name: &str) -> bool {
    name.starts_with("bindings_")
}

/// Every `.rs` file below `dir`, as paths relative to `base`, sorted.
fn rust_files(base: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let entries = fs::read_dir(dir).map_err(|e| Error::new(format!("{}: {e}", dir.display())))?;
    let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            rust_files(base, &path, out)?;
        } else if name.ends_with(".rs") && !is_generated(name) {
            let rel = path.strip_prefix(base).unwrap_or(&path);
            let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into()).collect();
            out.push(parts.join("/"));
        }
    }
    Ok(())
}

/// The module path of the file at `rel` (below `src/`).
fn module_of(rel: &str) -> Vec<String> {
    let stem = rel.strip_suffix(".rs").unwrap_or(rel);
    let mut module: Vec<String> = stem.split('/').map(str::to_owned).collect();
    if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
        module.pop();
    }
    module
}

impl ImportGraph {
    /// Reads `src` (a crate's source folder) and builds its graph. Files that are declared
    /// only as `#[cfg(test)] mod name;` are test code and left out.
    pub fn read(src: &Path) -> Result<ImportGraph> {
        let mut rels = Vec::new();
        rust_files(src, src, &mut rels)?;
        let mut files = Vec::new();
        let mut test_modules: Vec<Vec<String>> = Vec::new();
        for rel in rels {
            let path = src.join(&rel);
            let text = fs::read_to_string(&path)
                .map_err(|e| Error::new(format!("{}: {e}", path.display())))?;
            let (code, declared) = scan::without_test_modules(&scan::code_only(&text));
            let module = module_of(&rel);
            test_modules.extend(declared.into_iter().map(|name| {
                let mut child = module.clone();
                child.push(name);
                child
            }));
            files.push(SourceFile { rel, module, code });
        }
        files.retain(|f| !test_modules.iter().any(|t| f.module.starts_with(t)));
        Ok(ImportGraph::from_files(files))
    }

    fn from_files(files: Vec<SourceFile>) -> ImportGraph {
        let resolver = Resolver::new(&files);
        let mut found: BTreeMap<(usize, usize), String> = BTreeMap::new();
        for (from, file) in files.iter().enumerate() {
            let uses = scan::use_paths(&file.code).into_iter().map(|u| u.segments);
            for segments in uses.chain(scan::inline_paths(&file.code)) {
                if let Some(to) = resolver.resolve(&file.module, &segments)
                    && to != from
                {
                    found
                        .entry((from, to))
                        .or_insert_with(|| segments.join("::"));
                }
            }
        }
        let edges = found
            .into_iter()
            .map(|((from, to), path)| Edge { from, to, path })
            .collect();
        ImportGraph { files, edges }
    }

    /// The strongly connected components with more than one file, largest first (files
    /// sorted by path within each; ties by their first file).
    pub fn circles(&self) -> Vec<Vec<usize>> {
        let mut next: Vec<Vec<usize>> = vec![Vec::new(); self.files.len()];
        for e in &self.edges {
            next[e.from].push(e.to);
        }
        let mut sccs: Vec<Vec<usize>> = tarjan(&next)
            .into_iter()
            .filter(|c| c.len() > 1)
            .map(|mut c| {
                c.sort_unstable();
                c
            })
            .collect();
        sccs.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        sccs
    }
}

/// Maps a path named in one file to the file that defines what it names.
struct Resolver {
    /// Module path -> file.
    modules: HashMap<Vec<String>, usize>,
    /// A name the crate root re-exports (`pub use mr::Mr;`) -> the file it comes from.
    root_exports: HashMap<String, usize>,
}

impl Resolver {
    fn new(files: &[SourceFile]) -> Resolver {
        let modules: HashMap<Vec<String>, usize> = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.clone(), i))
            .collect();
        let mut resolver = Resolver {
            modules,
            root_exports: HashMap::new(),
        };
        if let Some(root) = files.iter().find(|f| f.module.is_empty()) {
            resolver.root_exports = resolver.exports_of(root);
        }
        resolver
    }

    /// The names the crate root re-exports from its modules, and the file of each.
    fn exports_of(&self, root: &SourceFile) -> HashMap<String, usize> {
        let mut exports = HashMap::new();
        for UsePath {
            segments,
            name,
            public,
        } in scan::use_paths(&root.code)
        {
            let path = match segments.first().map(String::as_str) {
                Some("crate" | "self") => &segments[1..],
                _ => &segments[..],
            };
            if let Some(file) = public.then(|| self.longest_module(path)).flatten() {
                exports.insert(name, file);
            }
        }
        exports
    }

    /// The file of the longest non-root module that is a prefix of `path`.
    fn longest_module(&self, path: &[String]) -> Option<usize> {
        (1..=path.len())
            .rev()
            .find_map(|k| self.modules.get(&path[..k]).copied())
    }

    /// The file that `segments`, named in module `from`, resolves to: the longest existing
    /// module prefix of the path made absolute, a root re-export's own module, or the root.
    /// `None` for paths that do not start with `crate`, `super` or `self`.
    fn resolve(&self, from: &[String], segments: &[String]) -> Option<usize> {
        let absolute = absolute_path(from, segments)?;
        if let Some(file) = self.longest_module(&absolute) {
            return Some(file);
        }
        absolute
            .first()
            .and_then(|name| self.root_exports.get(name).copied())
            .or_else(|| self.modules.get(&[][..]).copied())
    }
}

/// `segments` as a path from the crate root, when it starts with `crate`, `super` (relative
/// to the parent of `from`) or `self` (relative to `from`).
fn absolute_path(from: &[String], segments: &[String]) -> Option<Vec<String>> {
    let (head, rest) = segments.split_first()?;
    match head.as_str() {
        "crate" => Some(rest.to_vec()),
        "self" => Some([from, rest].concat()),
        "super" => {
            let mut base = &from[..from.len().saturating_sub(1)];
            let mut rest = rest;
            while let Some(("super", tail)) = rest.split_first().map(|(h, t)| (h.as_str(), t)) {
                base = &base[..base.len().saturating_sub(1)];
                rest = tail;
            }
            Some([base, rest].concat())
        }
        _ => None,
    }
}

/// Tarjan's strongly connected components of the graph `next` (node -> successors).
fn tarjan(next: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        next: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on_stack: BTreeSet<usize>,
        counter: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.counter);
        s.low[v] = s.counter;
        s.counter += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        for &w in s.next[v].iter() {
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack.contains(&w) => s.low[v] = s.low[v].min(iw),
                Some(_) => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(&w);
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.out.push(component);
        }
    }
    let mut state = State {
        next,
        index: vec![None; next.len()],
        low: vec![0; next.len()],
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        counter: 0,
        out: Vec::new(),
    };
    for v in 0..next.len() {
        if state.index[v].is_none() {
            visit(&mut state, v);
        }
    }
    state.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(files: &[(&str, &str)]) -> ImportGraph {
        let mut files: Vec<(&str, &str)> = files.to_vec();
        files.sort();
        let files = files
            .iter()
            .map(|(rel, text)| SourceFile {
                rel: rel.to_string(),
                module: module_of(rel),
                code: scan::without_test_modules(&scan::code_only(text)).0,
            })
            .collect();
        ImportGraph::from_files(files)
    }

    fn edges(g: &ImportGraph) -> Vec<String> {
        g.edges
            .iter()
            .map(|e| {
                format!(
                    "{} -> {} ({})",
                    g.files[e.from].rel, g.files[e.to].rel, e.path
                )
            })
            .collect()
    }

    #[test]
    fn paths_resolve_to_the_longest_module() {
        let g = graph(&[
            ("lib.rs", "pub use a::b::{Thing as Other};\nmod a;"),
            (
                "a/mod.rs",
                "pub mod b; use self::b::Thing; fn f() { super::c::g(); }",
            ),
            ("a/b.rs", "use super::super::c; pub struct Thing;"),
            ("c.rs", "use crate::Other; fn g() { crate::a::b::Thing; }"),
        ]);
        assert_eq!(
            edges(&g),
            [
                "a/b.rs -> c.rs (super::super::c)",
                "a/mod.rs -> a/b.rs (self::b::Thing)",
                "a/mod.rs -> c.rs (super::c::g)",
                "c.rs -> a/b.rs (crate::Other)",
            ]
        );
        let circles: Vec<Vec<&str>> = g
            .circles()
            .iter()
            .map(|c| c.iter().map(|&i| g.files[i].rel.as_str()).collect())
            .collect();
        assert_eq!(circles, [["a/b.rs", "c.rs"]]);
    }

    #[test]
    fn unknown_root_names_resolve_to_the_root() {
        let g = graph(&[("lib.rs", "macro_rules! m {}"), ("a.rs", "crate::m!();")]);
        assert_eq!(edges(&g), ["a.rs -> lib.rs (crate::m)"]);
    }

    #[test]
    fn test_only_files_are_left_out() {
        let dir = std::env::temp_dir().join(format!("xtask-graph-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("a")).unwrap();
        fs::write(dir.join("lib.rs"), "mod a;").unwrap();
        fs::write(dir.join("a/mod.rs"), "#[cfg(test)]\nmod checks;").unwrap();
        fs::write(dir.join("a/checks.rs"), "use crate::b;").unwrap();
        fs::write(dir.join("a/bindings_x.rs"), "use crate::b;").unwrap();
        fs::write(dir.join("b.rs"), "").unwrap();
        let g = ImportGraph::read(&dir).unwrap();
        let rels: Vec<&str> = g.files.iter().map(|f| f.rel.as_str()).collect();
        assert_eq!(rels, ["a/mod.rs", "b.rs", "lib.rs"]);
        assert!(g.edges.is_empty());
        let _ = fs::remove_dir_all(&dir);
    }
}
