//! Misuse of the QP state machine, of posted buffers and of typed device
//! memory does not compile. Host-only (no device needed).
//!
//! Each `tests/ui/*.rs` is checked with `rustc --emit=metadata` against the
//! library exactly as cargo built it for this test (same features, profile and
//! target directory; found with `cargo test --no-run --message-format=json`,
//! which is a no-op by then). rustc's exact wording and layout change between
//! versions, so instead of comparing whole outputs, a case lists in its header
//! what must go wrong:
//!
//! ```text
//! //~ ERROR E0599 no method named `post_send`
//! //@ needs-feature: gdr      (skipped unless the test is built with it)
//! //@ check-pass              (must compile: a control case)
//! ```
//!
//! A `//~ ERROR <code> <phrase>` line expects an error with that code whose
//! diagnostic (message, labels and notes) contains the phrase. The case passes
//! only when rustc fails, every expectation is met, and every error it printed
//! matches one of them: an error for any other reason (an unresolved import, a
//! typo, a different code) fails the test.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

const UI: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/ui");

/// The library rlib this test was built against and its dependency directory.
struct Lib {
    rlib: PathBuf,
    deps: PathBuf,
}

#[derive(Debug)]
struct Expected {
    code: String,
    phrase: String,
}

struct Case {
    path: PathBuf,
    expected: Vec<Expected>,
    check_pass: bool,
    needs_features: Vec<String>,
}

/// One error diagnostic: its code (if any) and all its text.
#[derive(Debug)]
struct Diag {
    code: Option<String>,
    text: String,
}

fn enabled(feature: &str) -> bool {
    feature == "gdr" && cfg!(feature = "gdr")
}

fn parse_case(path: &Path) -> Result<Case, String> {
    let src = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut case = Case {
        path: path.to_path_buf(),
        expected: Vec::new(),
        check_pass: false,
        needs_features: Vec::new(),
    };
    for line in src.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("//~ ERROR ") {
            let rest = rest.trim();
            let (code, phrase) = rest.split_once(' ').unwrap_or((rest, ""));
            let ok = code.len() == 5
                && code.starts_with('E')
                && code[1..].bytes().all(|b| b.is_ascii_digit());
            if !ok || phrase.trim().is_empty() {
                return Err(format!(
                    "{}: `{line}`: want `//~ ERROR E<4 digits> <phrase>`",
                    path.display()
                ));
            }
            case.expected.push(Expected {
                code: code.to_string(),
                phrase: phrase.trim().to_string(),
            });
        } else if let Some(rest) = line.strip_prefix("//@ needs-feature:") {
            case.needs_features.push(rest.trim().to_string());
        } else if line == "//@ check-pass" {
            case.check_pass = true;
        }
    }
    if case.check_pass != case.expected.is_empty() {
        return Err(format!(
            "{}: a case needs `//~ ERROR` lines or `//@ check-pass` (not both)",
            path.display()
        ));
    }
    Ok(case)
}

/// Asks cargo (a no-op rebuild) which rlib of this crate this test links.
fn built_lib() -> Lib {
    let exe = std::env::current_exe().expect("current_exe");
    // <target>[/<triple>]/<profile>/deps/compile_fail-<hash>
    let deps_dir = exe.parent().expect("deps dir");
    let profile_dir = deps_dir.parent().expect("profile dir");
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug");
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args([
        "test",
        "--no-run",
        "--message-format=json",
        "--test",
        "compile_fail",
    ])
    .arg("--manifest-path")
    .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
    .args(["--package", env!("CARGO_PKG_NAME")]);
    let features: Vec<&str> = ["gdr"].into_iter().filter(|f| enabled(f)).collect();
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    if let Some(up) = profile_dir.parent() {
        if up.join("CACHEDIR.TAG").exists() {
            cmd.arg("--target-dir").arg(up);
        } else if let Some(target_dir) = up.parent().filter(|t| t.join("CACHEDIR.TAG").exists()) {
            let triple = up.file_name().and_then(|n| n.to_str()).expect("triple");
            cmd.arg("--target-dir")
                .arg(target_dir)
                .args(["--target", triple]);
        }
    }
    let out = cmd.output().expect("running cargo");
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lib_name = env!("CARGO_PKG_NAME").replace('-', "_");
    let rlib = stdout
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#))
        .filter(|l| {
            l.contains(&format!(r#""name":"{lib_name}""#)) && l.contains(r#""kind":["lib"]"#)
        })
        .flat_map(json_filenames)
        .find(|f| f.extension().is_some_and(|e| e == "rlib"))
        .unwrap_or_else(|| panic!("no rlib of {lib_name} in the output of {cmd:?}:\n{stdout}"));
    let deps = rlib.parent().expect("rlib dir").to_path_buf();
    Lib { rlib, deps }
}

/// The `"filenames":[...]` of one cargo JSON message.
fn json_filenames(line: &str) -> Vec<PathBuf> {
    let Some(start) = line.find(r#""filenames":["#) else {
        return Vec::new();
    };
    let rest = &line[start + r#""filenames":["#.len()..];
    let mut names = Vec::new();
    let mut chars = rest.chars();
    let mut cur: Option<String> = None;
    while let Some(c) = chars.next() {
        match (c, cur.as_mut()) {
            (']', None) => break,
            ('"', None) => cur = Some(String::new()),
            ('"', Some(_)) => names.push(PathBuf::from(cur.take().unwrap_or_default())),
            ('\\', Some(s)) => {
                if let Some(e) = chars.next() {
                    s.push(e);
                }
            }
            (c, Some(s)) => s.push(c),
            _ => {}
        }
    }
    names
}

/// Splits rustc's human-readable output into error diagnostics.
fn errors(stderr: &str) -> Vec<Diag> {
    let mut diags: Vec<Diag> = Vec::new();
    let mut in_error = false;
    for line in stderr.lines() {
        let header = line
            .strip_prefix("error")
            .filter(|r| r.starts_with('[') || r.starts_with(':'));
        if let Some(rest) = header {
            if rest.starts_with(": aborting due to") {
                in_error = false;
                continue;
            }
            let code = rest
                .strip_prefix('[')
                .and_then(|r| r.split_once(']'))
                .map(|(c, _)| c.to_string());
            diags.push(Diag {
                code,
                text: line.to_string(),
            });
            in_error = true;
        } else if line.starts_with("warning")
            || line.starts_with("Some errors have")
            || line.starts_with("For more information")
        {
            in_error = false;
        } else if in_error {
            let d = diags.last_mut().expect("in an error");
            d.text.push('\n');
            d.text.push_str(line);
        }
    }
    diags
}

/// Compiles one case; `Err` says why it did not behave as its header says.
fn check(lib: &Lib, case: &Case, out_dir: &Path) -> Result<(), String> {
    let stem = case
        .path
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("stem");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let mut extern_arg = std::ffi::OsString::from("rdma_verbs=");
    extern_arg.push(&lib.rlib);
    let mut dep_arg = std::ffi::OsString::from("dependency=");
    dep_arg.push(&lib.deps);
    let out = Command::new(rustc)
        .args([
            "--edition",
            "2024",
            "--crate-type",
            "bin",
            "--emit=metadata",
        ])
        .args(["--crate-name", &format!("ui_{stem}")])
        .args(["--error-format=human", "--color=never", "--cap-lints=allow"])
        .arg("--extern")
        .arg(extern_arg)
        .arg("-L")
        .arg(dep_arg)
        .arg("-o")
        .arg(out_dir.join(format!("{stem}.rmeta")))
        .arg(&case.path)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .map_err(|e| format!("running rustc: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errs = errors(&stderr);
    let fail = |why: String| Err(format!("{why}\n--- rustc output ---\n{stderr}"));
    if case.check_pass {
        if !out.status.success() || !errs.is_empty() {
            return fail("expected to compile, but it failed".into());
        }
        return Ok(());
    }
    if out.status.success() {
        return fail("expected to fail, but it compiled".into());
    }
    let matches =
        |e: &Expected, d: &Diag| d.code.as_deref() == Some(&e.code) && d.text.contains(&e.phrase);
    for d in &errs {
        if !case.expected.iter().any(|e| matches(e, d)) {
            return fail(format!(
                "unexpected error (expected only {:?}):\n{}",
                case.expected, d.text
            ));
        }
    }
    for e in &case.expected {
        if !errs.iter().any(|d| matches(e, d)) {
            return fail(format!("no error {} containing {:?}", e.code, e.phrase));
        }
    }
    if errs.is_empty() {
        return fail("rustc failed without an error diagnostic".into());
    }
    Ok(())
}

#[test]
fn misuse_does_not_compile() {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(UI)
        .expect("tests/ui")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    paths.sort();
    let cases: Vec<Case> = paths
        .iter()
        .map(|p| parse_case(p).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let (cases, skipped): (Vec<Case>, Vec<Case>) = cases
        .into_iter()
        .partition(|c| c.needs_features.iter().all(|f| enabled(f)));
    for c in &skipped {
        eprintln!(
            "skipped {} (needs features {:?})",
            c.path.display(),
            c.needs_features
        );
    }
    assert!(!cases.is_empty(), "no cases in {UI}");

    let lib = built_lib();
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("compile_fail");
    std::fs::create_dir_all(&out_dir).expect("creating the output dir");
    let next = Mutex::new(cases.iter());
    let failures = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let Some(case) = next.lock().unwrap().next() else {
                        break;
                    };
                    match check(&lib, case, &out_dir) {
                        Ok(()) => eprintln!("ok {}", case.path.display()),
                        Err(why) => failures
                            .lock()
                            .unwrap()
                            .push(format!("{}: {why}", case.path.display())),
                    }
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} cases misbehaved:\n\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n\n")
    );
}
