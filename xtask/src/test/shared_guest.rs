//! The device test binaries in one guest, instead of one guest boot per binary.
//!
//! cargo builds the device tests and runs each binary through a recording runner
//! ([`Recorder`]): a small shell script that writes down what it was asked to run (the
//! binary, its arguments, the working directory and the environment) and exits 0. Then one
//! guest runs every recorded binary in turn ([`run_recorded`]), each as `vm-exec` would have
//! run it: in its working directory, with the variables that pass into a guest plus the
//! guest's device variables, under the same time limit. Between binaries, what a binary
//! left running is killed and the RDMA port must be ACTIVE again, as after a fresh boot.
//!
//! On a host with an RDMA device the same script runs on the host (as `vm-exec` would run
//! each binary there), and each binary gets the same variables as in a guest rather than
//! the whole host environment.
//!
//! cargo keeps its own meaning of every argument (filters, `--` harness arguments,
//! `--no-fail-fast`), since it is cargo that decides what to run; only where it runs changes.

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rdma_verbs_vm::EXIT_TIMEOUT;
use rdma_verbs_vm::cmd::push_quoted;
use rdma_verbs_vm::run::passes_to_guest;
use rdma_verbs_vm::vm::Topology;

use super::{Counts, cargo_test_in_guests};
use crate::{Context, Error, Result};

/// The line the guest script prints on stdout after each binary:
/// `EXIT_MARKER <index> <exit status>`.
pub const EXIT_MARKER: &str = "@@xtask-device-binary-exit";

/// Seconds between the TERM and the KILL that end a binary past its time limit.
const KILL_GRACE_SECS: u64 = 10;

/// One test binary run, as cargo asked for it.
pub struct RecordedRun {
    /// The binary's file name, for messages.
    pub label: String,
    /// The working directory cargo gave it.
    cwd: PathBuf,
    /// The binary and its arguments.
    argv: Vec<OsString>,
    /// The variables of cargo's environment that pass into a guest.
    env: Vec<(OsString, OsString)>,
}

/// A directory that collects recorded runs, and the runner script that fills it.
pub struct Recorder {
    /// One subdirectory per run, named by its position (`0000`, `0001`, ...).
    queue: PathBuf,
    /// The recording runner.
    script: PathBuf,
}

impl Recorder {
    /// An empty queue and its runner script under `work`.
    pub fn create(work: &Path) -> Result<Self> {
        let queue = work.join("queue");
        let _ = fs::remove_dir_all(&queue);
        fs::create_dir_all(&queue).context(|| format!("cannot create {}", queue.display()))?;
        let script = work.join("record.sh");
        let mut text = b"#!/bin/sh\n\
            # cargo xtask test: records one test binary run for the shared guest.\n\
            q="
        .to_vec();
        push_quoted(&mut text, queue.as_os_str());
        text.extend_from_slice(
            b"\nrun=\"$q/$(printf %04d \"$(ls \"$q\" | wc -l)\")\"\n\
            mkdir \"$run\" || exit 125\n\
            pwd -P > \"$run/cwd\" || exit 125\n\
            printf '%s\\0' \"$@\" > \"$run/argv\" || exit 125\n\
            env -0 > \"$run/env\" || exit 125\n\
            echo '       (recorded; it runs in the shared guest after the build)' >&2\n",
        );
        fs::write(&script, text).context(|| format!("cannot write {}", script.display()))?;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755))
            .context(|| format!("cannot make {} executable", script.display()))?;
        Ok(Self { queue, script })
    }

    /// The runner to give cargo (`CARGO_TARGET_<TRIPLE>_RUNNER`, which cargo splits on
    /// whitespace).
    pub fn runner(&self) -> Result<&str> {
        self.script
            .to_str()
            .filter(|s| !s.contains(char::is_whitespace))
            .ok_or_else(|| {
                Error::new(format!(
                    "cannot use {} as a cargo runner: cargo splits the runner on whitespace",
                    self.script.display()
                ))
            })
    }

    /// The recorded runs, in the order cargo made them.
    pub fn runs(&self) -> Result<Vec<RecordedRun>> {
        let mut dirs: Vec<PathBuf> = fs::read_dir(&self.queue)
            .context(|| format!("cannot list {}", self.queue.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        dirs.sort();
        dirs.iter().map(|dir| read_run(dir)).collect()
    }
}

/// Reads one run the recorder wrote into `dir`.
fn read_run(dir: &Path) -> Result<RecordedRun> {
    let read = |name: &str| {
        let path = dir.join(name);
        fs::read(&path).context(|| format!("cannot read {}", path.display()))
    };
    let mut cwd = read("cwd")?;
    if cwd.last() == Some(&b'\n') {
        cwd.pop();
    }
    let argv: Vec<OsString> = nul_separated(read("argv")?);
    let env = nul_separated(read("env")?)
        .into_iter()
        .filter_map(|pair| {
            let bytes = pair.into_vec();
            let eq = bytes.iter().position(|&b| b == b'=')?;
            let name = OsString::from_vec(bytes[..eq].to_vec());
            let value = OsString::from_vec(bytes[eq + 1..].to_vec());
            passes_to_guest(&name).then_some((name, value))
        })
        .collect();
    let label = argv
        .first()
        .and_then(|p| Path::new(p).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| Error::new(format!("{}: no program recorded", dir.display())))?;
    Ok(RecordedRun {
        label,
        cwd: PathBuf::from(OsString::from_vec(cwd)),
        argv,
        env,
    })
}

/// The items of a list where each item ends with a NUL byte (empty items included).
fn nul_separated(bytes: Vec<u8>) -> Vec<OsString> {
    let Some(items) = bytes.strip_suffix(&[0]) else {
        return Vec::new();
    };
    items
        .split(|&b| b == 0)
        .map(|item| OsString::from_vec(item.to_vec()))
        .collect()
}

/// The guest script: defines `run_binary`, then calls it once per recorded run. Each binary
/// gets `limit` (then TERM, then KILL after [`KILL_GRACE_SECS`]); the script itself always
/// exits 0, the outcomes travel in the [`EXIT_MARKER`] lines.
fn guest_script(runs: &[RecordedRun], limit: Duration) -> Vec<u8> {
    let limit = limit.as_secs();
    let mut s = format!(
        "# generated by cargo xtask test: the device test binaries, one after the other\n\
         # port_active: waits up to 10 s for port 1 of the device to be ACTIVE (a device\n\
         # this host does not list is left to the test binary to report).\n\
         port_active() {{\n\
         \x20 state=\"/sys/class/infiniband/${{RDMA_VERBS_DEVICE:-rxe0}}/ports/1/state\"\n\
         \x20 [ -e \"$state\" ] || return 0\n\
         \x20 i=0\n\
         \x20 until grep -qs ACTIVE \"$state\"; do\n\
         \x20   i=$((i + 1))\n\
         \x20   [ $i -lt 100 ] || {{ echo \"xtask test: port 1 of $RDMA_VERBS_DEVICE is not ACTIVE\" >&2; return 1; }}\n\
         \x20   sleep 0.1\n\
         \x20 done\n\
         }}\n\
         # run_binary INDEX LABEL DIR COMMAND...: COMMAND in DIR under the time limit; then\n\
         # kills what it left behind in its process group and prints the exit marker.\n\
         run_binary() {{\n\
         \x20 index=$1; label=$2; dir=$3; shift 3\n\
         \x20 echo \"     Running $label (in the shared guest)\" >&2\n\
         \x20 port_active\n\
         \x20 if cd \"$dir\"; then\n\
         \x20   timeout -k {KILL_GRACE_SECS} {limit} \"$@\" &\n\
         \x20   pid=$!\n\
         \x20   wait $pid; code=$?\n\
         \x20   env kill -KILL -- -$pid 2>/dev/null\n\
         \x20 else\n\
         \x20   code=125\n\
         \x20 fi\n\
         \x20 echo \"{EXIT_MARKER} $index $code\"\n\
         }}\n"
    )
    .into_bytes();
    // The device variables the guest (or, on a host with a device, the runner) sets; as
    // with `vm-exec`, they win over the recorded ones.
    let wire = Topology::Wire {
        node: 1,
        local_port: 0,
        peer_port: 0,
    };
    let device_vars: Vec<&str> = wire
        .guest_env(rdma_verbs_vm::choice::Provider::default())
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    for (index, run) in runs.iter().enumerate() {
        s.extend_from_slice(format!("run_binary {index} ").as_bytes());
        push_quoted(&mut s, OsStr::new(&run.label));
        s.push(b' ');
        push_quoted(&mut s, run.cwd.as_os_str());
        s.extend_from_slice(b" env -i");
        for (name, value) in &run.env {
            s.extend_from_slice(b" \\\n  ");
            let mut pair = name.clone();
            pair.push("=");
            pair.push(value);
            push_quoted(&mut s, &pair);
        }
        for name in &device_vars {
            s.extend_from_slice(format!(" \\\n  ${{{name}+\"{name}=${name}\"}}").as_bytes());
        }
        s.extend_from_slice(b" \\\n ");
        for arg in &run.argv {
            s.push(b' ');
            push_quoted(&mut s, arg);
        }
        s.push(b'\n');
    }
    s.extend_from_slice(b"exit 0\n");
    s
}

/// Runs `runs` in one guest (through `<this binary> run`), streaming their output; sums
/// their `test result:` lines. A binary that exits non-zero, timed out or never ran (the
/// guest stopped first) becomes a problem, as does a guest that did not boot.
pub fn run_recorded(
    runs: &[RecordedRun],
    work: &Path,
    limit: Duration,
    problems: &mut Vec<String>,
) -> Result<Counts> {
    let script = work.join("device-tests.sh");
    fs::write(&script, guest_script(runs, limit))
        .context(|| format!("cannot write {}", script.display()))?;
    let exe = std::env::current_exe().context(|| "cannot find the xtask binary".into())?;
    // The guest's own limit only guards against a guest that hangs as a whole: each binary
    // has its own.
    let per_binary = limit.as_secs() + KILL_GRACE_SECS + 30;
    let whole = per_binary * u64::try_from(runs.len()).unwrap_or(u64::MAX).max(1);
    let mut command = Command::new(exe);
    command
        .args(["run", "--timeout", &whole.to_string(), "--", "sh"])
        .arg(&script);
    eprintln!(
        "xtask test: {} test binaries in one guest ({} s each at most)",
        runs.len(),
        limit.as_secs()
    );
    let mut markers = Vec::new();
    let mut counts = cargo_test_in_guests(&mut command, problems, &mut markers)?;
    let exits = exit_statuses(&markers, runs.len());
    for (run, exit) in runs.iter().zip(&exits) {
        match exit {
            Some(0) => {}
            Some(code) if *code == EXIT_TIMEOUT => problems.push(format!(
                "device tests: {} timed out after {} s",
                run.label,
                limit.as_secs()
            )),
            Some(code) => problems.push(format!(
                "device tests: {} failed (exit status {code})",
                run.label
            )),
            None => problems.push(format!(
                "device tests: {} did not run (the guest stopped before it)",
                run.label
            )),
        }
    }
    // Every failure is a problem of its own; "cargo failed" would misname it.
    counts.success = true;
    Ok(counts)
}

/// The exit status of each of `count` binaries from the marker lines (`<index> <status>`);
/// `None` for one without a marker.
fn exit_statuses(markers: &[String], count: usize) -> Vec<Option<u8>> {
    let mut exits = vec![None; count];
    for marker in markers {
        let mut words = marker.split_whitespace();
        let index = words.next().and_then(|w| w.parse::<usize>().ok());
        let code = words.next().and_then(|w| w.parse::<u8>().ok());
        if let (Some(slot), Some(code)) = (index.and_then(|i| exits.get_mut(i)), code) {
            *slot = Some(code);
        }
    }
    exits
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    fn run(label: &str) -> RecordedRun {
        RecordedRun {
            label: label.into(),
            cwd: "/w/it's".into(),
            argv: vec!["/t/vm_a-1".into(), "--exact".into(), "a b".into()],
            env: vec![("CARGO_PKG_NAME".into(), "x'y".into())],
        }
    }

    #[test]
    fn guest_script_is_valid_shell_and_quotes_everything() {
        let script = guest_script(&[run("vm_a-1"), run("vm_b-2")], Duration::from_secs(900));
        let ok = Command::new("sh")
            .args(["-n", "-c"])
            .arg(OsStr::from_bytes(&script))
            .status()
            .is_ok_and(|s| s.success());
        let text = String::from_utf8_lossy(&script);
        assert!(ok, "{text}");
        assert!(text.contains("run_binary 1 'vm_b-2' '/w/it'\\''s' env -i"));
        assert!(text.contains("'CARGO_PKG_NAME=x'\\''y'"));
        assert!(text.contains("${RDMA_VERBS_DEVICE+\"RDMA_VERBS_DEVICE=$RDMA_VERBS_DEVICE\"}"));
        assert!(text.contains(" '/t/vm_a-1' '--exact' 'a b'\n"));
        assert!(text.contains("timeout -k 10 900 \"$@\" &"));
    }

    #[test]
    fn the_script_runs_each_binary_and_reports_its_status() {
        let dir = std::env::temp_dir().join(format!("xtask-shared-guest-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let mut runs = vec![run("true"), run("false")];
        runs[0].argv = vec!["sh".into(), "-c".into(), "echo $CARGO_PKG_NAME".into()];
        runs[1].argv = vec!["sh".into(), "-c".into(), "exit 3".into()];
        for r in &mut runs {
            r.cwd = dir.clone();
        }
        let out = Command::new("sh")
            .arg("-c")
            .arg(OsStr::from_bytes(&guest_script(
                &runs,
                Duration::from_secs(30),
            )))
            .env("RDMA_VERBS_DEVICE", "none")
            .output()
            .unwrap();
        let _ = fs::remove_dir_all(&dir);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            stdout,
            format!("x'y\n{EXIT_MARKER} 0 0\n{EXIT_MARKER} 1 3\n"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn exit_statuses_fill_in_by_index() {
        let markers = ["1 101".to_owned(), "0 0".to_owned(), "7 0".to_owned()];
        assert_eq!(exit_statuses(&markers, 3), [Some(0), Some(101), None]);
    }

    #[test]
    fn recorder_writes_what_cargo_asked_for() {
        let dir = std::env::temp_dir().join(format!("xtask-recorder-{}", std::process::id()));
        let recorder = Recorder::create(&dir).unwrap();
        let runner = recorder.runner().unwrap();
        let run = || {
            Command::new(runner)
                .args(["/t/vm_a-1", "--ignored", ""])
                .current_dir("/")
                .env("CARGO_PKG_NAME", "rdma-verbs")
                .env("NOT_PASSED", "1")
                .status()
        };
        // The script was just written by this process, whose other tests fork
        // at the same time: a child forked while the write was open holds the
        // file open until it execs, and exec then fails with ETXTBSY for a
        // moment (cargo, which runs the recorder for real, is another process).
        let mut tries = 0;
        let status = loop {
            match run() {
                Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 100 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => break other.unwrap(),
            }
        };
        assert!(status.success());
        let runs = recorder.runs().unwrap();
        let _ = fs::remove_dir_all(&dir);
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].label, "vm_a-1");
        assert_eq!(runs[0].cwd, Path::new("/"));
        assert_eq!(runs[0].argv, ["/t/vm_a-1", "--ignored", ""]);
        assert!(
            runs[0]
                .env
                .contains(&("CARGO_PKG_NAME".into(), "rdma-verbs".into()))
        );
        assert!(!runs[0].env.iter().any(|(n, _)| n == "NOT_PASSED"));
    }
}
