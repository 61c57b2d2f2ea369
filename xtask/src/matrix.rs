//! `cargo xtask matrix`: the crate's host tests against several rdma-core releases and
//! libclang versions.
//!
//! * rdma-core sets: Debian 11's (33), 12's (44, the bindings' baseline) and 13's (56)
//!   `libibverbs-dev libibverbs1 librdmacm-dev librdmacm1 ibverbs-providers`, fetched with
//!   `apt-get download` through a private apt configuration (the host's own Debian
//!   sources with the suite swapped, lists under `target/matrix/apt/`) and unpacked with
//!   `dpkg -x` into `target/matrix/<set>/root`. Each set is built with pkg-config
//!   pointed at it (`PKG_CONFIG_PATH` + `PKG_CONFIG_SYSROOT_DIR`: headers for the shim,
//!   `-L` for linking) and its tests run with `LD_LIBRARY_PATH` on its libraries. A set
//!   whose libraries need a newer glibc than the host's is build-only.
//! * `deb12-on-deb11-lib`: the Debian 12 build's test binaries run against Debian 11's
//!   libraries (a binary built on a newer rdma-core loading an older libibverbs).
//! * libclang: the `bindgen` feature with `LIBCLANG_PATH` on each installed
//!   `/usr/lib/llvm-<N>/lib` (Debian 12: `libclang-14-dev`, `libclang-16-dev`), against
//!   the host's headers; also says whether the regenerated bindings equal the checked-in
//!   ones.
//!
//! Every cell builds in its own `target/matrix/<cell>/target`. Prints a table and writes
//! `target/matrix/matrix.json`.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::cmd;
use crate::{Context as _, Error, Result, target_dir, workspace_root};

/// (cell name, Debian suite).
const SETS: &[(&str, &str)] = &[
    ("deb11", "bullseye"),
    ("deb12", "bookworm"),
    ("deb13", "trixie"),
];
/// Packages of one set; the first name that exists is taken (trixie renamed librdmacm1).
const PACKAGES: &[&[&str]] = &[
    &["libibverbs-dev"],
    &["libibverbs1"],
    &["librdmacm-dev"],
    &["librdmacm1", "librdmacm1t64"],
    &["ibverbs-providers"],
];
const MULTIARCH_LIB: &str = "usr/lib/x86_64-linux-gnu";
/// libclang versions tried for the `bindgen` feature (those installed).
const LLVM_VERSIONS: &[u32] = &[14, 15, 16, 17, 18, 19];

/// One row of the table.
struct Cell {
    name: String,
    what: String,
    build: Outcome,
    test: Outcome,
    note: String,
    secs: u64,
}

#[derive(Clone)]
enum Outcome {
    Pass(String),
    Fail(String),
    Skipped(String),
}

impl Outcome {
    fn word(&self) -> &str {
        match self {
            Outcome::Pass(_) => "pass",
            Outcome::Fail(_) => "FAIL",
            Outcome::Skipped(_) => "skip",
        }
    }
    fn detail(&self) -> &str {
        match self {
            Outcome::Pass(d) | Outcome::Fail(d) | Outcome::Skipped(d) => d,
        }
    }
}

/// `cargo xtask matrix [--no-fetch]`.
pub fn matrix_command(args: Vec<OsString>) -> Result<u8> {
    let mut fetch = true;
    for a in &args {
        match a.to_str() {
            Some("--no-fetch") => fetch = false,
            _ => return Err(Error::usage(format!("matrix: unknown argument {a:?}"))),
        }
    }
    let root = workspace_root();
    let dir = target_dir().join("matrix");
    fs::create_dir_all(&dir).context(|| format!("cannot create {}", dir.display()))?;
    let started = Instant::now();
    let host_tests = host_tests(&root.join("tests"))?;
    let mut cells = Vec::new();

    for (name, suite) in SETS {
        let set_root = dir.join(name).join("root");
        if fetch && !set_root.join(MULTIARCH_LIB).join("libibverbs.so").exists() {
            fetch_set(&dir, name, suite, &set_root)?;
        }
        cells.push(set_cell(root, &dir, name, suite, &set_root, &host_tests));
    }
    cells.push(old_lib_cell(&dir, &host_tests));
    for v in LLVM_VERSIONS {
        let lib = PathBuf::from(format!("/usr/lib/llvm-{v}/lib"));
        if lib.join(format!("libclang-{v}.so")).exists() || lib.join("libclang.so").exists() {
            cells.push(clang_cell(root, &dir, *v, &lib));
        }
    }

    let total = started.elapsed().as_secs();
    let table = render(&cells, total);
    say!("{table}");
    let json = dir.join("matrix.json");
    fs::write(&json, to_json(&cells, total))
        .context(|| format!("cannot write {}", json.display()))?;
    say!("wrote {}", json.display());
    let failed = cells
        .iter()
        .any(|c| matches!(c.build, Outcome::Fail(_)) || matches!(c.test, Outcome::Fail(_)));
    Ok(u8::from(failed))
}

/// `tests/<t>.rs` not named `vm_*` (the host tests, as `cargo xtask test` picks them).
fn host_tests(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for e in fs::read_dir(dir).context(|| format!("cannot read {}", dir.display()))? {
        let p = e.context(|| "read tests/".into())?.path();
        if p.extension().is_some_and(|x| x == "rs") {
            let n = p
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            if !n.starts_with("vm_") {
                names.push(n);
            }
        }
    }
    names.sort();
    Ok(names)
}

/// Downloads and unpacks one Debian suite's rdma-core packages.
fn fetch_set(dir: &Path, name: &str, suite: &str, set_root: &Path) -> Result<()> {
    let apt = dir.join("apt").join(suite);
    let parts = apt.join("sources.list.d");
    let debs = dir.join(name).join("debs");
    for d in [
        &parts,
        &apt.join("lists/partial"),
        &apt.join("cache/archives/partial"),
        &debs,
    ] {
        fs::create_dir_all(d).context(|| format!("cannot create {}", d.display()))?;
    }
    fs::write(apt.join("status"), "").context(|| "write apt status".into())?;
    // The host's Debian sources with the suite swapped: the first deb822 stanza.
    let template = fs::read_to_string("/etc/apt/sources.list.d/debian.sources").context(|| {
        "read /etc/apt/sources.list.d/debian.sources (a Debian host is needed)".into()
    })?;
    let stanza = template.split("\n\n").next().unwrap_or_default();
    let sources: String = stanza
        .lines()
        .map(|l| {
            if l.starts_with("Suites:") {
                format!("Suites: {suite}\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    fs::write(parts.join("debian.sources"), sources).context(|| "write sources".into())?;
    let opts = |c: &mut Command| {
        for (k, v) in [
            ("Dir::Etc::SourceList", "/dev/null".into()),
            ("Dir::Etc::SourceParts", parts.display().to_string()),
            ("Dir::State::Lists", apt.join("lists").display().to_string()),
            (
                "Dir::State::status",
                apt.join("status").display().to_string(),
            ),
            ("Dir::Cache", apt.join("cache").display().to_string()),
            ("Debug::NoLocking", "1".into()),
        ] {
            c.arg("-o").arg(format!("{k}={v}"));
        }
    };
    say!("matrix: fetching rdma-core of Debian {suite}");
    let mut update = Command::new("apt-get");
    opts(&mut update);
    cmd::run_checked(update.args(["-q", "update"]))?;
    for alternatives in PACKAGES {
        let mut ok = false;
        for pkg in *alternatives {
            let mut dl = Command::new("apt-get");
            opts(&mut dl);
            dl.args(["-q", "download", pkg]).current_dir(&debs);
            if dl.output().is_ok_and(|o| o.status.success()) {
                ok = true;
                break;
            }
        }
        if !ok {
            return Err(Error::new(format!(
                "apt-get download {alternatives:?} ({suite}) failed"
            )));
        }
    }
    for e in fs::read_dir(&debs).context(|| "read debs".into())? {
        let deb = e.context(|| "read debs".into())?.path();
        cmd::run_checked(Command::new("dpkg").arg("-x").arg(&deb).arg(set_root))?;
    }
    Ok(())
}

/// The environment that points pkg-config, the linker and the loader at a set.
fn set_env(c: &mut Command, set_root: &Path) {
    let lib = set_root.join(MULTIARCH_LIB);
    c.env("PKG_CONFIG_PATH", lib.join("pkgconfig"))
        .env("PKG_CONFIG_SYSROOT_DIR", set_root)
        .env("LD_LIBRARY_PATH", &lib);
}

fn cargo(root: &Path, target: &Path) -> Command {
    let mut c = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    c.current_dir(root)
        .env("CARGO_TARGET_DIR", target)
        .env_remove("RUSTFLAGS");
    c
}

fn test_args(c: &mut Command, host_tests: &[String]) {
    c.args(["test", "-p", "rdma-verbs", "--lib"]);
    for t in host_tests {
        c.args(["--test", t]);
    }
}

/// Runs a command, returning (success, combined output).
fn run(c: &mut Command) -> (bool, String) {
    eprintln!("matrix: {}", cmd::display(c));
    match c.output() {
        Ok(o) => {
            let mut s = String::from_utf8_lossy(&o.stdout).into_owned();
            s.push_str(&String::from_utf8_lossy(&o.stderr));
            (o.status.success(), s)
        }
        Err(e) => (false, e.to_string()),
    }
}

/// `N passed, M failed` summed over the `test result:` lines.
fn summary(out: &str) -> String {
    let (mut p, mut f) = (0u64, 0u64);
    for l in out.lines() {
        if let Some(rest) = l.trim().strip_prefix("test result: ") {
            for part in rest.split([';', '.']) {
                let part = part.trim();
                if let Some(n) = part.strip_suffix(" passed") {
                    p += n.trim().parse::<u64>().unwrap_or(0);
                } else if let Some(n) = part.strip_suffix(" failed") {
                    f += n.trim().parse::<u64>().unwrap_or(0);
                }
            }
        }
    }
    format!("{p} passed, {f} failed")
}

fn tail(out: &str) -> String {
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("error") || l.contains("panicked"))
        .collect();
    lines
        .iter()
        .rev()
        .take(3)
        .rev()
        .copied()
        .collect::<Vec<_>>()
        .join(" | ")
}

fn save_log(dir: &Path, cell: &str, out: &str) {
    let _ = fs::write(dir.join(format!("{cell}.log")), out);
}

fn set_cell(
    root: &Path,
    dir: &Path,
    name: &str,
    suite: &str,
    set_root: &Path,
    tests: &[String],
) -> Cell {
    let t0 = Instant::now();
    let version = rdma_core_version(set_root);
    let what = format!("Debian {suite} rdma-core {version} headers+libs");
    if !set_root.join("usr/include/infiniband/verbs.h").exists() {
        return Cell {
            name: name.into(),
            what,
            build: Outcome::Skipped("not fetched".into()),
            test: Outcome::Skipped(String::new()),
            note: String::new(),
            secs: 0,
        };
    }
    let target = dir.join(name).join("target");
    let mut build = cargo(root, &target);
    set_env(&mut build, set_root);
    test_args(&mut build, tests);
    build.arg("--no-run");
    let (ok, out) = run(&mut build);
    save_log(dir, &format!("{name}-build"), &out);
    let note = shim_note(&out);
    if !ok {
        return Cell {
            name: name.into(),
            what,
            build: Outcome::Fail(tail(&out)),
            test: Outcome::Skipped("build failed".into()),
            note,
            secs: t0.elapsed().as_secs(),
        };
    }
    let mut test = cargo(root, &target);
    set_env(&mut test, set_root);
    test_args(&mut test, tests);
    let (ok, out) = run(&mut test);
    save_log(dir, &format!("{name}-test"), &out);
    Cell {
        name: name.into(),
        what,
        build: Outcome::Pass(String::new()),
        test: test_outcome(ok, &out),
        note,
        secs: t0.elapsed().as_secs(),
    }
}

/// The rdma-core version of a fetched set: from its `libibverbs.so.1.<abi>.<version>`
/// (`?` when there is none).
fn rdma_core_version(set_root: &Path) -> String {
    fs::read_dir(set_root.join(MULTIARCH_LIB))
        .ok()
        .and_then(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .find_map(|n| {
                    n.strip_prefix("libibverbs.so.1.")
                        .map(|v| v.split_once('.').map_or(v, |x| x.1).to_owned())
                })
        })
        .unwrap_or_else(|| "?".into())
}

/// The cell's note from the build output: the functions the C shim leaves out
/// (`lack `NAME`` lines), if any.
fn shim_note(build_output: &str) -> String {
    let shim_note = build_output
        .lines()
        .filter_map(|l| l.split("lack `").nth(1).and_then(|r| r.split('`').next()))
        .collect::<Vec<_>>();
    if shim_note.is_empty() {
        String::new()
    } else {
        format!("shim leaves out {}", shim_note.join(", "))
    }
}

/// The test outcome of a cell from the test run's status and output: a run whose libraries
/// need a newer glibc than the host's is a build-only cell, not a failure.
fn test_outcome(ok: bool, out: &str) -> Outcome {
    if ok {
        Outcome::Pass(summary(out))
    } else if let Some(v) = out
        .split("version `GLIBC_")
        .nth(1)
        .and_then(|r| r.split('\'').next())
    {
        Outcome::Skipped(format!(
            "build only: its libraries need glibc {v}, newer than the host's"
        ))
    } else {
        Outcome::Fail(format!("{}; {}", summary(out), tail(out)))
    }
}

/// Runs the Debian 12 build's test binaries with Debian 11's libraries.
fn old_lib_cell(dir: &Path, tests: &[String]) -> Cell {
    let t0 = Instant::now();
    let name = "deb12-on-deb11-lib";
    let what = "built on Debian 12 (44), run with Debian 11's libibverbs (33)".to_owned();
    let old = dir.join("deb11/root");
    let new = dir.join("deb12/root");
    let target = dir.join("deb12/target");
    if !old.join(MULTIARCH_LIB).exists() || !target.exists() {
        return Cell {
            name: name.into(),
            what,
            build: Outcome::Skipped(String::new()),
            test: Outcome::Skipped("sets missing".into()),
            note: String::new(),
            secs: 0,
        };
    }
    // Same build environment as deb12 (no rebuild), older libraries at run time.
    let mut c = cargo(workspace_root(), &target);
    set_env(&mut c, &new);
    c.env("LD_LIBRARY_PATH", old.join(MULTIARCH_LIB))
        // rdma-core 33 predates it: tests/host_bindings.rs checks the typed error.
        .env("RDMA_VERBS_EXPECT_UNSUPPORTED", "ibv_reg_dmabuf_mr");
    test_args(&mut c, tests);
    let (ok, out) = run(&mut c);
    save_log(dir, name, &out);
    let rebuilt = out.contains("Compiling rdma-verbs");
    Cell {
        name: name.into(),
        what,
        build: Outcome::Skipped("reuses deb12's".into()),
        test: if ok {
            Outcome::Pass(summary(&out))
        } else {
            Outcome::Fail(format!("{}; {}", summary(&out), tail(&out)))
        },
        note: if rebuilt {
            "warning: cargo rebuilt".into()
        } else {
            String::new()
        },
        secs: t0.elapsed().as_secs(),
    }
}

/// The `bindgen` feature with one libclang, against the host's headers.
fn clang_cell(root: &Path, dir: &Path, v: u32, lib: &Path) -> Cell {
    let t0 = Instant::now();
    let name = format!("bindgen-clang{v}");
    let what = format!("--features bindgen, LIBCLANG_PATH={}", lib.display());
    let target = dir.join(&name).join("target");
    let tests = ["host_bindings".to_owned()];
    let mut c = cargo(root, &target);
    c.env("LIBCLANG_PATH", lib)
        .env_remove("RDMA_VERBS_UPDATE_BINDINGS");
    test_args(&mut c, &tests);
    c.args(["--features", "bindgen"]);
    let (ok, out) = run(&mut c);
    save_log(dir, &name, &out);
    let note = match (
        generated(&target),
        fs::read_to_string(root.join("src/ffi/bindings_x86_64.rs")),
    ) {
        (Some(g), Ok(checked_in)) if g == checked_in => "regenerated bindings == checked-in".into(),
        (Some(_), Ok(_)) => "regenerated bindings differ from checked-in".into(),
        _ => String::new(),
    };
    let compiled = out.contains("Running unittests") || out.contains("Running tests");
    Cell {
        name,
        what,
        build: if compiled {
            Outcome::Pass(String::new())
        } else {
            Outcome::Fail(tail(&out))
        },
        test: if ok {
            Outcome::Pass(summary(&out))
        } else if compiled {
            Outcome::Fail(format!("{}; {}", summary(&out), tail(&out)))
        } else {
            Outcome::Skipped("build failed".into())
        },
        note,
        secs: t0.elapsed().as_secs(),
    }
}

/// The newest `build/rdma-verbs-*/out/bindings.rs` under a target dir.
fn generated(target: &Path) -> Option<String> {
    let build = target.join("debug/build");
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for e in fs::read_dir(build).ok()?.flatten() {
        let p = e.path().join("out/bindings.rs");
        let newer = fs::metadata(&p)
            .and_then(|m| m.modified())
            .ok()
            .filter(|m| best.as_ref().is_none_or(|(t, _)| m > t));
        if let Some(m) = newer {
            best = Some((m, p));
        }
    }
    fs::read_to_string(best?.1).ok()
}

fn render(cells: &[Cell], total: u64) -> String {
    let mut s = String::from(
        "| cell | what | build | host tests | note | time |\n|---|---|---|---|---|---|\n",
    );
    for c in cells {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} {} | {} | {}s |",
            c.name,
            c.what,
            c.build.word(),
            c.test.word(),
            c.test.detail(),
            c.note,
            c.secs
        );
    }
    let _ = write!(s, "\nmatrix: {} cells in {total}s", cells.len());
    s
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', " ")
}

fn to_json(cells: &[Cell], total: u64) -> String {
    let mut s = format!("{{\"total_secs\": {total}, \"cells\": [\n");
    for (i, c) in cells.iter().enumerate() {
        let _ = write!(
            s,
            "  {{\"cell\": \"{}\", \"what\": \"{}\", \"build\": \"{}\", \"build_detail\": \"{}\", \"test\": \"{}\", \"test_detail\": \"{}\", \"note\": \"{}\", \"secs\": {}}}{}",
            esc(&c.name),
            esc(&c.what),
            c.build.word(),
            esc(c.build.detail()),
            c.test.word(),
            esc(c.test.detail()),
            esc(&c.note),
            c.secs,
            if i + 1 < cells.len() { "," } else { "" }
        );
        s.push('\n');
    }
    s.push_str("]}\n");
    s
}
