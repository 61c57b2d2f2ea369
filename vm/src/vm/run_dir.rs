//! The per-run directory shared read-write with a guest, and its console log.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::qemu::debug;
use crate::{Context, Result};

/// The last `n` lines of the console log, or a note that there is none.
pub(super) fn console_tail(path: &Path, n: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes).replace('\r', "");
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(n)..].join("\n");
            if tail.is_empty() {
                "(empty: the kernel printed nothing)".into()
            } else {
                tail
            }
        }
        Err(_) => "(no console log: QEMU did not start)".into(),
    }
}

/// A per-run directory `<cache>/runs/<pid>-<n>`, shared read-write with the guest; removed on
/// drop unless [`keep`](Self::keep) was called (then it stays until a later run cleans it).
pub(super) struct RunDir {
    /// The directory.
    pub(super) path: PathBuf,
    /// Whether it stays after the run.
    keep: bool,
}

impl RunDir {
    /// Creates a fresh run directory (after removing those of dead processes).
    pub(super) fn create(cache: &Path) -> Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let runs = cache.join("runs");
        remove_stale_runs(&runs);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = runs.join(format!("{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).context(|| format!("cannot create {}", path.display()))?;
        // The guest binds this path inside its view of the host before it chroots there, so
        // a symlink on the way (a cache directory that is a link) must be resolved here.
        let path = path
            .canonicalize()
            .context(|| format!("cannot resolve {}", path.display()))?;
        Ok(Self { path, keep: false })
    }

    /// Leaves the directory in place for inspection.
    pub(super) fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if !self.keep && !debug() {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Removes run directories whose process is gone.
fn remove_stale_runs(runs: &Path) {
    let Ok(entries) = fs::read_dir(runs) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !crate::pid_alive(name.split('-').next().unwrap_or_default()) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}
