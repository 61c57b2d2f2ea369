//! Small helpers around child processes and shell text.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output};
use std::thread;
use std::time::{Duration, Instant};

use crate::{Context, Error, Result};

/// A command line for messages: the program's file name and its arguments, space separated.
pub fn display(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program());
    let mut s = program
        .file_name()
        .unwrap_or(program.as_os_str())
        .to_string_lossy()
        .into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Runs `cmd` with inherited stdio and fails unless it exits with status 0.
pub fn run_checked(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .context(|| format!("cannot start `{}`", display(cmd)))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::new(format!(
            "`{}` failed ({})",
            display(cmd),
            describe(status)
        )))
    }
}

/// Runs `cmd`, capturing its output, and fails (showing its stderr) unless it exits with 0.
pub fn output_checked(cmd: &mut Command) -> Result<Output> {
    let out = cmd
        .output()
        .context(|| format!("cannot start `{}`", display(cmd)))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(Error::new(format!(
            "`{}` failed ({}):\n{}",
            display(cmd),
            describe(out.status),
            String::from_utf8_lossy(&out.stderr).trim_end()
        )))
    }
}

/// "exit status N" or "killed by signal N".
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => status.to_string(),
    }
}

/// The exit status a shell would report: the code, or 128 + the signal number.
pub fn shell_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        // Exit codes are 0..=255 on Unix; the truncation mirrors the shell.
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(sig)) => (128 + (sig & 0x7f)) as u8,
        _ => crate::EXIT_INFRA,
    }
}

/// What [`wait_with_deadline`] saw.
pub enum Waited {
    /// The child exited by itself.
    Exited(ExitStatus),
    /// The deadline passed; the child was killed and reaped.
    TimedOut,
}

/// Waits for `child` until `timeout` has passed, then kills it.
pub fn wait_with_deadline(child: &mut Child, timeout: Duration) -> Result<Waited> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child
            .try_wait()
            .context(|| "cannot wait for child".into())?
        {
            return Ok(Waited::Exited(status));
        }
        if Instant::now() >= deadline {
            // It may have exited in between; either way it is gone afterwards.
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Waited::TimedOut);
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Appends `s` to `out` as one single-quoted POSIX shell word (any bytes allowed).
pub fn push_quoted(out: &mut Vec<u8>, s: &OsStr) {
    out.push(b'\'');
    for &b in s.as_bytes() {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
}

/// `s` as one single-quoted POSIX shell word.
pub fn quoted(s: impl AsRef<OsStr>) -> String {
    let mut out = Vec::new();
    push_quoted(&mut out, s.as_ref());
    String::from_utf8_lossy(&out).into_owned()
}

/// Finds an executable by name in `$PATH`, then in the sbin directories (which a non-root
/// user's `$PATH` often lacks).
pub fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// Whether `path` is a regular file with an execute bit.
pub fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Like [`find_tool`], but an error naming the package that provides it when missing.
pub fn require_tool(name: &str, package: &str) -> Result<PathBuf> {
    find_tool(name).ok_or_else(|| {
        Error::new(format!(
            "`{name}` not found; install the `{package}` package (rdma-verbs-vm setup does)"
        ))
    })
}

/// Whether this process runs as root (effective uid 0).
pub fn is_root() -> bool {
    uid() == Some(0)
}

/// This process's effective uid, read from /proc/self/status.
pub fn uid() -> Option<u32> {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|ids| ids.split_whitespace().nth(1).and_then(|e| e.parse().ok()))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_single_quotes() {
        assert_eq!(quoted("a b"), "'a b'");
        assert_eq!(quoted("it's"), "'it'\\''s'");
        assert_eq!(quoted(""), "''");
    }
}
