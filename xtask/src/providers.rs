//! `cargo xtask providers`: the device test binaries on each cell (guest kernel × provider ×
//! rdma-core: the host's, which the guest runs by default, or Debian 13's 56 laid over it),
//! one guest per cell, and one row per test in `target/providers/providers.json`: `{kernel,
//! rdma_core, provider, test, outcome}`.
//!
//! Outcomes: `pass`; `unsupported` (the test failed with the crate's `Error::Unsupported`,
//! "... is not supported: ...", naming what the provider lacks); `deviation` (the test
//! passed asserting the behaviour of the provider it ran on, which differs from what
//! docs/soundness.md assumes while the crate stays sound: its output holds a line
//! `DEVIATION: <what>`, printed by `tests/common`'s `deviation`); `fail` (anything else, a
//! hang past the per-binary limit included: the test that was running is the failure).
//! The binaries run with `--show-output`, so a passing test's output reaches the log.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use rdma_verbs_vm::choice::{Choice, GuestKernel, Provider, RdmaCore};

use crate::{Context as _, Error, Result, cmd, target_dir, workspace_root};

pub(crate) mod render;

/// The cells run without `--cells`.
const CELLS: &[(GuestKernel, Provider)] = &[
    (GuestKernel::Stable, Provider::Rxe),
    (GuestKernel::Backports, Provider::Rxe),
    (GuestKernel::Stable, Provider::Siw),
    (GuestKernel::Backports, Provider::Siw),
];

/// Seconds each test binary may run in a cell before it counts as hung.
const DEFAULT_LIMIT_SECS: u64 = 120;

/// One row of providers.json.
struct Row {
    kernel: String,
    /// The rdma-core version the guest ran (`44.0-2`: the host's package; `56.1`: the
    /// unpacked tree's libibverbs).
    rdma_core: String,
    provider: Provider,
    test: String,
    outcome: &'static str,
}

/// `providers [--cells K/P,...] [--limit SECS] [--tests vm_a,vm_b]`, `providers --render`
/// (docs/providers.md's tables from providers.json, see [`render`]), or `providers
/// --suite-cell` (the short cell `cargo xtask test` runs, see [`suite_cell`]).
pub fn providers_command(args: Vec<OsString>) -> Result<u8> {
    let mut cells: Vec<Choice> = CELLS
        .iter()
        .map(|&(kernel, provider)| Choice {
            kernel,
            provider,
            rdma_core: RdmaCore::Host,
        })
        .collect();
    let mut limit = DEFAULT_LIMIT_SECS;
    let mut only: Option<Vec<String>> = None;
    let mut args = args.into_iter().map(|a| a.to_string_lossy().into_owned());
    while let Some(flag) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| Error::usage(format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--cells" => cells = parse_cells(&value()?)?,
            "--limit" => {
                limit = crate::parse_secs(&value()?)
                    .map_err(Error::usage)?
                    .as_secs()
            }
            "--tests" => only = Some(value()?.split(',').map(str::to_owned).collect()),
            "--render" => {
                render::render(&target_dir().join("providers").join("providers.json"))?;
                return Ok(0);
            }
            "--suite-cell" => {
                let c = suite_cell()?;
                say!(
                    "providers: the suite's cell: {} passed, {} failed in {} s",
                    c.passed,
                    c.failed,
                    c.secs
                );
                return Ok(u8::from(c.failed > 0));
            }
            other => {
                return Err(Error::usage(format!(
                    "unknown option {other:?} for providers"
                )));
            }
        }
    }
    let binaries = build_device_tests(only.as_deref())?;
    let dir = target_dir().join("providers");
    fs::create_dir_all(&dir).context(|| format!("cannot create {}", dir.display()))?;
    let mut rows = Vec::new();
    for choice in cells {
        let assets = crate::setup::setup_choice(
            crate::setup::Verbosity::Quiet,
            crate::EXTRA_PACKAGES,
            choice,
        )?;
        let kernel = kernel_release(&assets.kernel_package);
        let rdma_core = match choice.rdma_core {
            RdmaCore::Host => host_rdma_core(),
            _ => rdma_verbs_vm::setup::overlaid_release(&assets.overlays)
                .unwrap_or_else(|| choice.rdma_core.to_string()),
        };
        say!(
            "providers: {kernel} / {} / rdma-core {rdma_core} ({} binaries)",
            choice.provider,
            binaries.len()
        );
        let started = std::time::Instant::now();
        let log = dir.join(format!("{}.log", cell_file(choice)));
        let output = run_cell(&dir, &log, choice, &binaries, limit)?;
        let took = started.elapsed().as_secs();
        for (test, outcome) in classify(&output) {
            rows.push(Row {
                kernel: kernel.clone(),
                rdma_core: rdma_core.clone(),
                provider: choice.provider,
                test,
                outcome,
            });
        }
        summarize(&rows, &kernel, &rdma_core, choice.provider);
        say!("providers: {kernel} / {} took {took} s", choice.provider);
    }
    let json = dir.join("providers.json");
    let kept = kept_rows(&json, &rows);
    fs::write(&json, to_json(&kept, &rows))
        .context(|| format!("cannot write {}", json.display()))?;
    say!("providers: wrote {}", json.display());
    Ok(u8::from(rows.iter().any(|r| r.outcome == "fail")))
}

/// The cell `cargo xtask test` adds to its default one (6.1/rxe): soft-iWARP on the
/// default kernel, with the binaries that pair every QP through rdma_cm
/// ([`SUITE_CELL_TESTS`]), in one guest boot.
pub const SUITE_CELL: (GuestKernel, Provider) = (GuestKernel::Stable, Provider::Siw);

/// The binaries of [`SUITE_CELL`]: the core provider assumptions over rdma_cm and what
/// iWARP refuses.
pub const SUITE_CELL_TESTS: &[&str] = &["vm_cm_core", "vm_provider_caps"];

/// Seconds each binary of [`SUITE_CELL`] may run (each takes a few seconds).
const SUITE_CELL_LIMIT_SECS: u64 = 60;

/// Outcome counts of a cell run for `cargo xtask test`.
pub struct CellCounts {
    /// Tests that passed, were unsupported or reported a deviation.
    pub passed: u64,
    /// Tests that failed (or hung).
    pub failed: u64,
    /// Seconds the cell took, guest boot included.
    pub secs: u64,
}

/// Runs [`SUITE_CELL`] (setting it up first: siw's module is built on first use) and
/// counts its outcomes; the log goes to `target/providers/suite-<cell>.log`, and
/// providers.json is left alone.
pub fn suite_cell() -> Result<CellCounts> {
    let (kernel, provider) = SUITE_CELL;
    let choice = Choice {
        kernel,
        provider,
        rdma_core: RdmaCore::Host,
    };
    let only: Vec<String> = SUITE_CELL_TESTS.iter().map(|&t| t.to_owned()).collect();
    let binaries = build_device_tests(Some(&only))?;
    crate::setup::setup_choice(
        crate::setup::Verbosity::Quiet,
        crate::EXTRA_PACKAGES,
        choice,
    )?;
    let dir = target_dir().join("providers");
    fs::create_dir_all(&dir).context(|| format!("cannot create {}", dir.display()))?;
    let log = dir.join(format!("suite-{kernel}-{provider}.log"));
    let started = std::time::Instant::now();
    let output = run_cell(&dir, &log, choice, &binaries, SUITE_CELL_LIMIT_SECS)?;
    let rows = classify(&output);
    let failed = rows.iter().filter(|(_, o)| *o == "fail").count() as u64;
    for (test, _) in rows.iter().filter(|(_, o)| *o == "fail") {
        say!(
            "providers: {kernel}/{provider}: {test} failed (see {})",
            log.display()
        );
    }
    if rows.is_empty() {
        return Err(Error::new(format!(
            "the {kernel}/{provider} cell ran no test (see {})",
            log.display()
        )));
    }
    Ok(CellCounts {
        passed: rows.len() as u64 - failed,
        failed,
        secs: started.elapsed().as_secs(),
    })
}

/// `6.1/rxe,6.12/siw,6.12/rxe/56`: kernel / provider [/ rdma-core, the host's if left out].
fn parse_cells(value: &str) -> Result<Vec<Choice>> {
    value
        .split(',')
        .map(|cell| {
            let parts: Vec<&str> = cell.split('/').collect();
            let (kernel, provider, core) = match parts[..] {
                [k, p] => (k, p, "host"),
                [k, p, r] => (k, p, r),
                _ => {
                    return Err(Error::usage(format!(
                        "--cells: expected KERNEL/PROVIDER[/RDMA_CORE], got {cell:?}"
                    )));
                }
            };
            Ok(Choice {
                kernel: GuestKernel::parse(kernel)?,
                provider: Provider::parse(provider)?,
                rdma_core: RdmaCore::parse(core)?,
            })
        })
        .collect()
}

/// A cell's name in file names: `6.1-rxe` (the host's rdma-core, as always), `6.12-rxe-56`.
fn cell_file(choice: Choice) -> String {
    match choice.rdma_core {
        RdmaCore::Host => format!("{}-{}", choice.kernel, choice.provider),
        core => format!("{}-{}-{core}", choice.kernel, choice.provider),
    }
}

/// `6.1.0-57-amd64` from `linux-image-6.1.0-57-amd64_6.1.192-3_amd64.deb`.
fn kernel_release(package: &str) -> String {
    package
        .strip_prefix("linux-image-")
        .and_then(|p| p.split('_').next())
        .unwrap_or(package)
        .to_owned()
}

/// The version of the host's libibverbs1 (the guest runs the host's userland).
fn host_rdma_core() -> String {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Version}", "libibverbs1"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".into())
}

/// Builds the `tests/vm_*.rs` binaries (all, or those `only` names) and returns their paths.
fn build_device_tests(only: Option<&[String]>) -> Result<Vec<PathBuf>> {
    let root = workspace_root();
    let mut names: Vec<String> = fs::read_dir(root.join("tests"))
        .context(|| "cannot list tests/".into())?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".rs")
                .map(str::to_owned)
        })
        .filter(|n| n.starts_with(crate::test::DEVICE_TEST_PREFIX))
        .filter(|n| only.is_none_or(|o| o.contains(n)))
        .collect();
    names.sort();
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build.current_dir(root).args([
        "test",
        "--features",
        crate::test::DEVICE_TEST_FEATURES,
        "--no-run",
        "--message-format=json",
    ]);
    for name in &names {
        build.args(["--test", name]);
    }
    let out = cmd::output_checked(&mut build)?;
    let text = String::from_utf8_lossy(&out.stdout);
    let binaries: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split_once("\"executable\":\"")?.1.split_once('"'))
        .map(|(path, _)| PathBuf::from(path))
        .collect();
    if binaries.is_empty() {
        return Err(Error::new("cargo built no device test binaries"));
    }
    Ok(binaries)
}

/// Runs every binary in one guest of `choice` (each under `limit` seconds, with its
/// output framed by `@@binary NAME`) and returns the guest's output, which streams into
/// `log` as it comes (what a cell showed survives a run that stops half-way).
fn run_cell(
    dir: &Path,
    log: &Path,
    choice: Choice,
    binaries: &[PathBuf],
    limit: u64,
) -> Result<String> {
    let mut script = format!(
        "# generated by cargo xtask providers\ncd {}\n",
        cmd::quoted(workspace_root())
    );
    for binary in binaries {
        let name = binary_name(binary);
        let _ = writeln!(
            script,
            "echo '@@binary {name}'\n\
             timeout -k 5 {limit} env CARGO_MANIFEST_DIR={root} {bin} --test-threads 1 --show-output 2>&1\n\
             echo \"@@exit {name} $?\"",
            root = cmd::quoted(workspace_root()),
            bin = cmd::quoted(binary),
        );
    }
    let path = dir.join(format!("{}.sh", cell_file(choice)));
    fs::write(&path, script).context(|| format!("cannot write {}", path.display()))?;
    let exe = std::env::current_exe().context(|| "cannot find the xtask binary".into())?;
    let whole = (limit + 10) * u64::try_from(binaries.len()).unwrap_or(1) + 60;
    let file = fs::File::create(log).context(|| format!("cannot create {}", log.display()))?;
    Command::new(exe)
        .args(["run", "--kernel", &choice.kernel.to_string()])
        .args(["--provider", choice.provider.name()])
        .args(["--rdma-core", &choice.rdma_core.to_string()])
        .args(["--timeout", &whole.to_string(), "--", "sh"])
        .arg(&path)
        .stdout(file)
        .status()
        .context(|| "cannot run the guest".into())?;
    let out = fs::read(log).context(|| format!("cannot read {}", log.display()))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `vm_qp` for `.../vm_qp-0123abcd`.
fn binary_name(binary: &Path) -> String {
    let file = binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match file.rsplit_once('-') {
        Some((name, _)) => name.to_owned(),
        None => file,
    }
}

/// Each test's outcome from a cell's output: `binary::test` and pass, unsupported,
/// deviation or fail.
fn classify(output: &str) -> Vec<(String, &'static str)> {
    let mut rows: Vec<(String, &'static str)> = Vec::new();
    let mut binary = String::new();
    let mut running: Option<String> = None;
    let mut failure_of: Option<usize> = None;
    // Harnesses seen in this binary: a second one is a child's (a test that runs
    // the binary again, under valgrind), whose lines up to its `test result:`
    // are that test's output, not rows. A child cut short prints no result: its
    // output also ends where a section or a panic names a test the child did not
    // run (the parent's next failure), which is read as usual.
    let (mut harnesses, mut nested) = (0, false);
    let mut child_tests: Vec<String> = Vec::new();
    // A hung test's line ("test x ... ") has no newline before the exit marker.
    let output = output.replace("@@exit ", "\n@@exit ");
    for line in output.lines() {
        if nested && !line.starts_with("@@") {
            if line.starts_with("test result: ") {
                nested = false;
                continue;
            }
            if let Some((name, _)) = line
                .strip_prefix("test ")
                .and_then(|r| r.split_once(" ..."))
            {
                child_tests.push(name.trim().to_owned());
            }
            match named_test(line) {
                Some(name) if !child_tests.iter().any(|t| t == name) => nested = false,
                _ => continue,
            }
        }
        if is_harness_start(line) {
            harnesses += 1;
            nested = harnesses > 1;
            child_tests.clear();
            continue;
        }
        if let Some(name) = line.strip_prefix("@@binary ") {
            binary = name.trim().to_owned();
            failure_of = None;
            (harnesses, nested) = (0, false);
        } else if line.starts_with("@@exit ") {
            nested = false;
            // A test that started and never finished hung until the limit.
            if let Some(test) = running.take() {
                rows.push((test, "fail"));
            }
        } else if let Some(rest) = line.strip_prefix("test ") {
            let Some((name, result)) = rest.split_once(" ... ") else {
                if let Some(name) = rest.strip_suffix(" ...") {
                    running = Some(format!("{binary}::{name}"));
                }
                continue;
            };
            let test = format!("{binary}::{}", name.trim());
            running = None;
            match result.trim() {
                "ok" => rows.push((test, "pass")),
                // "Killed": the shell's word for a binary killed mid-test (the limit's
                // SIGKILL, or the guest's OOM killer).
                "FAILED" | "Killed" => rows.push((test, "fail")),
                "" => running = Some(test),
                r if r.starts_with("ignored") => {}
                // The test's own output (a child's, on stderr) came before its result,
                // which follows on a line of its own.
                _ => running = Some(test),
            }
        } else if let Some(outcome) = running.as_ref().and_then(|_| match line.trim() {
            "ok" => Some("pass"),
            "FAILED" | "Killed" => Some("fail"),
            _ => None,
        }) {
            if let Some(test) = running.take() {
                rows.push((test, outcome));
            }
        } else if let Some(name) = line
            .strip_prefix("---- ")
            .and_then(|l| l.strip_suffix(" stdout ----"))
        {
            let test = format!("{binary}::{name}");
            failure_of = rows.iter().position(|(t, _)| *t == test);
        } else if let Some(row) = failure_of.and_then(|i| rows.get_mut(i)) {
            // Only a failure is unsupported, only a pass a deviation: a test that
            // failed after reporting a deviation still failed.
            match row.1 {
                "fail" if is_unsupported(line) => row.1 = "unsupported",
                "pass" if line.starts_with(DEVIATION) => row.1 = "deviation",
                _ => {}
            }
        }
    }
    rows
}

/// The test a line names as a harness's failure section (`---- x stdout ----`) or as
/// a panicking test thread (`thread 'x' (N) panicked at ...`).
fn named_test(line: &str) -> Option<&str> {
    if let Some(name) = line
        .strip_prefix("---- ")
        .and_then(|l| l.strip_suffix(" stdout ----"))
    {
        return Some(name);
    }
    let rest = line.strip_prefix("thread '")?;
    let (name, tail) = rest.split_once('\'')?;
    tail.contains(" panicked at ").then_some(name)
}

/// How a test's output line starts when it reports a deviation (`tests/common`'s
/// `deviation` prints it).
const DEVIATION: &str = "DEVIATION: ";

/// Whether a line of a failed test's output shows the crate's `Error::Unsupported`: its
/// message (`... is not supported: ...`, from `{}`) or its `Debug` form (`Unsupported {
/// verb: ...`, from `unwrap`/`expect` on a `Result` holding it, also inside `PostError` or
/// `TransitionError`).
/// A test harness's first line: `running N test(s)`.
fn is_harness_start(line: &str) -> bool {
    line.strip_prefix("running ")
        .and_then(|l| l.strip_suffix(" tests").or_else(|| l.strip_suffix(" test")))
        .is_some_and(|n| n.parse::<u64>().is_ok())
}

fn is_unsupported(line: &str) -> bool {
    line.contains(" is not supported: ") || line.contains("Unsupported { verb: ")
}

/// Prints a cell's counts.
fn summarize(rows: &[Row], kernel: &str, rdma_core: &str, provider: Provider) {
    let count = |outcome: &str| {
        rows.iter()
            .filter(|r| {
                r.kernel == kernel
                    && r.rdma_core == rdma_core
                    && r.provider == provider
                    && r.outcome == outcome
            })
            .count()
    };
    say!(
        "providers: {kernel} / {provider} / {rdma_core}: {} pass, {} unsupported, {} \
         deviation, {} fail",
        count("pass"),
        count("unsupported"),
        count("deviation"),
        count("fail")
    );
}

/// The rows of an earlier providers.json for cells this run did not run (one row per
/// line, as [`to_json`] writes them), so cells can be run one at a time.
fn kept_rows(json: &Path, rows: &[Row]) -> Vec<String> {
    let ran: Vec<[String; 3]> = rows
        .iter()
        .map(|r| {
            [
                format!("\"kernel\": \"{}\"", esc(&r.kernel)),
                format!("\"rdma_core\": \"{}\"", esc(&r.rdma_core)),
                format!("\"provider\": \"{}\"", r.provider),
            ]
        })
        .collect();
    fs::read_to_string(json)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.trim_start().starts_with('{'))
        .filter(|l| !ran.iter().any(|keys| keys.iter().all(|k| l.contains(k))))
        .map(|l| l.trim().trim_end_matches(',').to_owned())
        .collect()
}

/// The rows (`kept` ones first, already JSON) as a JSON array, one row per line.
fn to_json(kept: &[String], rows: &[Row]) -> String {
    let mut lines: Vec<String> = kept.to_vec();
    for r in rows {
        lines.push(format!(
            "{{\"kernel\": \"{}\", \"rdma_core\": \"{}\", \"provider\": \"{}\", \"test\": \
             \"{}\", \"outcome\": \"{}\"}}",
            esc(&r.kernel),
            esc(&r.rdma_core),
            r.provider,
            esc(&r.test),
            r.outcome,
        ));
    }
    format!("[\n  {}\n]\n", lines.join(",\n  "))
}

/// JSON string escaping of quotes and backslashes (names hold nothing else special).
fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_pass_fail_unsupported_deviation_and_hangs() {
        let out = "@@binary vm_qp\n\
                   test a ... ok\n\
                   test b ... FAILED\n\
                   test c ... FAILED\n\
                   test d ... ignored\n\
                   test e ... FAILED\n\
                   test f ... ok\n\
                   test g ... ok\n\
                   ---- b stdout ----\n\
                   Unsupported: ibv_create_qp is not supported: siw0 is an iWARP device\n\
                   ---- c stdout ----\n\
                   EINVAL\n\
                   ---- e stdout ----\n\
                   called `Result::unwrap()` on an `Err` value: Transition { error: Unsupported { verb: \"ibv_modify_qp(RTR)\", hint: \"..\" } }\n\
                   successes:\n\
                   ---- f stdout ----\n\
                   DEVIATION: siw completes the READ after the SEND\n\
                   ---- g stdout ----\n\
                   note: Unsupported { verb: \"x\", hint: \"..\" } as expected\n\
                   @@exit vm_qp 101\n\
                   @@binary vm_cm\n\
                   test hangs ... \n\
                   @@exit vm_cm 124\n\
                   @@binary vm_lifecycle\n\
                   test walk ... Killed\n\
                   test valgrind ... ==1== Memcheck, a memory error detector\n\
                   valgrind:  Fatal error at startup\n\
                   FAILED\n\
                   test after ... ok\n\
                   @@exit vm_lifecycle 137\n";
        let rows = classify(out);
        assert_eq!(
            rows,
            [
                ("vm_qp::a".to_owned(), "pass"),
                ("vm_qp::b".to_owned(), "unsupported"),
                ("vm_qp::c".to_owned(), "fail"),
                ("vm_qp::e".to_owned(), "unsupported"),
                ("vm_qp::f".to_owned(), "deviation"),
                ("vm_qp::g".to_owned(), "pass"),
                ("vm_cm::hangs".to_owned(), "fail"),
                ("vm_lifecycle::walk".to_owned(), "fail"),
                ("vm_lifecycle::valgrind".to_owned(), "fail"),
                ("vm_lifecycle::after".to_owned(), "pass"),
            ]
        );
        assert_eq!(binary_name(Path::new("/t/vm_qp-0a1b")), "vm_qp");
        assert_eq!(
            kernel_release("linux-image-6.1.0-57-amd64_6.1.192-3_amd64.deb"),
            "6.1.0-57-amd64"
        );
        assert!(parse_cells("6.12/siw,6.1/rxe").is_ok_and(|c| c.len() == 2));
        assert!(parse_cells("6.12").is_err());
        let cells = parse_cells("6.12/rxe/56,6.1/siw").unwrap();
        assert_eq!(cells[0].rdma_core, RdmaCore::Deb13);
        assert_eq!(cells[1].rdma_core, RdmaCore::Host);
        assert_eq!(cell_file(cells[0]), "6.12-rxe-56");
        assert_eq!(cell_file(cells[1]), "6.1-siw");
        assert!(parse_cells("6.12/rxe/50").is_err());
    }

    #[test]
    fn a_child_harness_in_a_tests_output_adds_no_rows() {
        // The valgrind test runs the binary's walk again; the child's harness
        // lines, inline or in the test's captured output, are not rows.
        let out = "@@binary vm_lifecycle\n\
                   running 3 tests\n\
                   test walk ... FAILED\n\
                   test valgrind ... ==1== Memcheck\n\
                   running 1 test\n\
                   test walk ... FAILED\n\
                   failures:\n\
                   ---- walk stdout ----\n\
                   EINVAL\n\
                   test result: FAILED. 0 passed; 1 failed\n\
                   FAILED\n\
                   test after ... ok\n\
                   failures:\n\
                   ---- walk stdout ----\n\
                   connect: ibv_modify_qp(RTR) is not supported: siw0 is an iWARP device\n\
                   ---- valgrind stdout ----\n\
                   running 1 test\n\
                   test walk ... ok\n\
                   test result: ok. 1 passed\n\
                   the walk needs what the device lacks: x is not supported: y\n\
                   test result: FAILED. 1 passed; 2 failed\n\
                   @@exit vm_lifecycle 101\n";
        assert_eq!(
            classify(out),
            [
                ("vm_lifecycle::walk".to_owned(), "unsupported"),
                ("vm_lifecycle::valgrind".to_owned(), "unsupported"),
                ("vm_lifecycle::after".to_owned(), "pass"),
            ]
        );
    }

    #[test]
    fn a_child_cut_short_ends_at_the_parents_next_failure() {
        // The valgrind child's output stops before its `test result:` line; the
        // parent's panic and its next failure section are read as usual.
        let out = "@@binary vm_lifecycle\n\
                   running 3 tests\n\
                   test walk ... FAILED\n\
                   test valgrind ... FAILED\n\
                   test reset ... FAILED\n\
                   failures:\n\
                   ---- walk stdout ----\n\
                   thread 'walk' (5) panicked at x.rs:1:1:\n\
                   reset: Some(ibv_modify_qp(RESET) is not supported: siw0 is an iWARP device)\n\
                   ---- valgrind stdout ----\n\
                   running 1 test\n\
                   test walk ... lifecycle: seed=1\n\
                   thread 'walk' (7) panicked at x.rs:1:1:\n\
                   EINVAL\n\
                   thread 'valgrind' (6) panicked at x.rs:2:1:\n\
                   the walk needs what the device lacks: x is not supported: y\n\
                   ---- reset stdout ----\n\
                   PostError { error: ibv_post_recv is not supported: iWARP, unposted: 1 }\n\
                   test result: FAILED. 0 passed; 3 failed\n\
                   @@exit vm_lifecycle 101\n";
        assert_eq!(
            classify(out),
            [
                ("vm_lifecycle::walk".to_owned(), "unsupported"),
                ("vm_lifecycle::valgrind".to_owned(), "unsupported"),
                ("vm_lifecycle::reset".to_owned(), "unsupported"),
            ]
        );
    }
}
