//! The host directories a guest sees besides the read-only host root: `/tmp` or `/run` when
//! the command needs them, and the [`WRITABLE_ENV`] directories.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use crate::run::Invocation;
use crate::{Context, Error, Result};

/// 9p tag for a shared host directory: `host_tmp` for /tmp.
pub(super) fn share_tag(dir: &str) -> String {
    format!("host_{}", dir.trim_start_matches('/'))
}

/// Environment variable: colon-separated host directories the guest may write to.
pub const WRITABLE_ENV: &str = "RDMA_VERBS_VM_WRITABLE";

/// 9p tag of the `i`-th [`WRITABLE_ENV`] directory.
pub(super) fn writable_tag(i: usize) -> String {
    format!("rw{i}")
}

/// The [`WRITABLE_ENV`] directories, canonical, without duplicates, parents first (so a
/// directory shared inside another one is mounted over it).
pub(super) fn writable_dirs() -> Result<Vec<PathBuf>> {
    let Some(value) = std::env::var_os(WRITABLE_ENV) else {
        return Ok(Vec::new());
    };
    let mut dirs = Vec::new();
    for dir in std::env::split_paths(&value).filter(|d| !d.as_os_str().is_empty()) {
        let canonical = dir.canonicalize().context(|| {
            format!(
                "{WRITABLE_ENV}: cannot share {} with the guest",
                dir.display()
            )
        })?;
        if !canonical.is_dir() {
            return Err(Error::new(format!(
                "{WRITABLE_ENV}: {} is not a directory",
                dir.display()
            )));
        }
        if !dirs.contains(&canonical) {
            dirs.push(canonical);
        }
    }
    dirs.sort_by_key(|d: &PathBuf| d.components().count());
    Ok(dirs)
}

/// Host directories that the guest normally covers with a tmpfs (`/tmp`, `/run`) but must
/// share instead, because the working directory, the program, cargo's target directory, an
/// absolute-path argument or an environment value lies inside them (e.g. a clone under /tmp).
pub(super) fn host_dirs_to_share(inv: &Invocation, target_dir: &Path) -> Vec<&'static str> {
    let mut needed: Vec<&OsStr> = vec![
        inv.cwd.as_os_str(),
        inv.program.as_os_str(),
        target_dir.as_os_str(),
    ];
    let resolved = inv.resolved_program();
    if let Some(p) = &resolved {
        needed.push(p.as_os_str());
    }
    needed.extend(inv.args.iter().map(OsString::as_os_str));
    needed.extend(inv.env.iter().map(|(_, v)| v.as_os_str()));
    ["/tmp", "/run"]
        .into_iter()
        .filter(|dir| needed.iter().any(|p| Path::new(p).starts_with(dir)))
        .collect()
}
