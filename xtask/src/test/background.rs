//! Builds the suite's later steps need, run while the device tests run in their guest.
//!
//! The guest leaves part of the host's two cores idle (its tests wait on the wire, on
//! timeouts and on each other), and the later steps each began with a build of their own:
//! the instruction guard's release `perf`, the runner crate's tests in their own target
//! directory, siw's module and initramfs for the provider cell. [`Background`] runs those
//! builds one after the other under the idle scheduling policy (`chrt --idle 0`: they run
//! only on a CPU nothing else wants, so the guest's virtual CPUs keep the host's cores when
//! they need them, which tests of concurrency in the guest rely on); the steps themselves
//! run the same builds again, which then find everything current, and report any failure as
//! their own.

use std::fs::{self, File};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::cmd;

/// The background builds, one after the other on a thread of their own.
pub struct Background {
    /// The thread; it returns the commands that failed.
    thread: Option<JoinHandle<Vec<String>>>,
    /// Where every command's output goes.
    log: PathBuf,
}

impl Background {
    /// Starts `commands` in order, each under `chrt --idle 0`, their output in `log`.
    pub fn start(commands: Vec<Command>, log: PathBuf) -> Self {
        let file = File::create(&log).ok();
        let started = Instant::now();
        let thread = std::thread::spawn(move || {
            let mut failed = Vec::new();
            for command in commands {
                let mut idle = at_idle_priority(&command);
                idle.stdin(Stdio::null())
                    .stdout(to_log(&file))
                    .stderr(to_log(&file));
                let failure = match idle.status() {
                    Ok(s) if s.success() => continue,
                    Ok(s) => s.to_string(),
                    Err(e) => format!("cannot run it: {e}"),
                };
                let shown = cmd::display(&command);
                if let Some(mut f) = file.as_ref().and_then(|f| f.try_clone().ok()) {
                    let _ = writeln!(f, "xtask test: `chrt --idle 0 {shown}`: {failure}");
                }
                failed.push(shown);
            }
            eprintln!(
                "xtask test: the background builds ended after {} s",
                started.elapsed().as_secs()
            );
            failed
        });
        eprintln!(
            "xtask test: building what later steps need beside the device tests (idle \
             priority; output in {})",
            log.display()
        );
        Self {
            thread: Some(thread),
            log,
        }
    }

    /// Waits for the builds. A failed one is only reported: the step that needs it runs the
    /// build again and fails with the build's own message.
    pub fn finish(mut self) {
        self.wait();
    }

    /// Joins the thread and reports failed commands.
    fn wait(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        let failed = thread
            .join()
            .unwrap_or_else(|_| vec!["(the thread)".into()]);
        for command in &failed {
            eprintln!(
                "xtask test: the background build `{command}` failed (its step builds again; \
                 output in {})",
                self.log.display()
            );
        }
        if failed.is_empty() {
            let _ = fs::remove_file(&self.log);
        }
    }
}

impl Drop for Background {
    /// A suite that ends early still waits for its builds, so no cargo outlives it.
    fn drop(&mut self) {
        self.wait();
    }
}

/// `command` (program, arguments, directory, environment) under `chrt --idle 0`.
fn at_idle_priority(command: &Command) -> Command {
    let mut idle = Command::new("chrt");
    idle.args(["--idle", "0"])
        .arg(command.get_program())
        .args(command.get_args());
    if let Some(dir) = command.get_current_dir() {
        idle.current_dir(dir);
    }
    for (name, value) in command.get_envs() {
        match value {
            Some(value) => idle.env(name, value),
            None => idle.env_remove(name),
        };
    }
    idle
}

/// An output that writes to the log, or nowhere when the log could not be created.
fn to_log(file: &Option<File>) -> Stdio {
    file.as_ref()
        .and_then(|f| f.try_clone().ok())
        .map_or_else(Stdio::null, Stdio::from)
}
