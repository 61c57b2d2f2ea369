//! Another rdma-core for the guest: Debian 13's rdma-core 56, downloaded through a private apt
//! configuration, unpacked under `<cache>/rdma-core-56/root`, and laid over the host's files of
//! the same names inside the guest (bind mounts in `stage2.sh`).
//!
//! Debian 13 builds its libraries against glibc 2.41, and libibverbs and librdmacm ask for
//! `GLIBC_2.38` (`__isoc23_strtol` and friends), which Debian 12's glibc (2.36) lacks: the
//! unpacked tree therefore carries Debian 13's `libc6` too, and the guest runs that C library
//! in place of the host's (glibc keeps old binaries working, so the host's programs run on it
//! unchanged). Only names the host already has are covered, each on its own real file, so the
//! loader, the providers' directory (`/usr/lib/x86_64-linux-gnu/libibverbs`) and the driver
//! files (`/etc/libibverbs.d`) are rdma-core 56's where libibverbs looks for them, with no
//! `LD_LIBRARY_PATH` a child process could lose.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::apt::AptSource;
use super::{file_name, is_current, private_name, write_stamp};
use crate::choice::RdmaCore;
use crate::cmd::run_checked;
use crate::{Context, Error, Result};

/// The packages of the rdma-core 56 tree, with the C library its libraries need and that
/// library's detached symbols (valgrind needs the loader's, see [`VALGRIND_DEBUGINFO`]).
const DEB13_PACKAGES: &[&str] = &[
    "libc6",
    "libc6-dbg",
    "libibverbs1",
    "ibverbs-providers",
    "librdmacm1t64",
    "ibverbs-utils",
    "rdmacm-utils",
];

/// The directories of the tree whose files cover the host's: (directory, only names with
/// `.so` in them).
const OVERLAID_DIRS: &[(&str, bool)] = &[
    ("usr/lib/x86_64-linux-gnu", true),
    ("usr/lib/x86_64-linux-gnu/libibverbs", true),
    ("usr/bin", false),
    ("etc/libibverbs.d", false),
];

/// The directory, beside the tree, where valgrind finds the tree's C library symbols
/// (`--extra-debuginfo-path`). Valgrind refuses to start without the loader's `strlen`, and
/// the host's `/usr/lib/debug` holds the symbols of the host's loader, not of this one. It
/// looks a detached file up there by the object's directory and its `.gnu_debuglink` name,
/// which on Debian is the file's name under `.build-id/`: each is linked from the
/// directories the loader and the C library are loaded from.
pub const VALGRIND_DEBUGINFO: &str = "debuginfo";

/// The directories, as the guest's programs load them, of the libraries whose symbols
/// [`VALGRIND_DEBUGINFO`] carries.
const LIBRARY_DIRS: &[&str] = &["lib64", "lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"];

/// One file of the tree laid over one of the host's: both paths are canonical (no symlink
/// left), so the guest's mount of `source` on `/host` + `target` stays inside the host root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overlay {
    /// The tree's file.
    pub source: PathBuf,
    /// The host's file it replaces.
    pub target: PathBuf,
}

/// The rdma-core release the overlays lay over the host's (`56.1`, from the name of its
/// libibverbs, `libibverbs.so.1.<abi>.<release>`), if they carry one.
pub fn overlaid_release(overlays: &[Overlay]) -> Option<String> {
    overlays.iter().find_map(|o| {
        let name = o.source.file_name()?.to_str()?;
        let rest = name.strip_prefix("libibverbs.so.1.")?;
        rest.split_once('.').map(|(_, release)| release.to_owned())
    })
}

/// The overlays of `rdma_core` (none for the host's own), fetching and unpacking its tree
/// under `dir` the first time.
pub(super) fn ensure_userland(dir: &Path, rdma_core: RdmaCore) -> Result<Vec<Overlay>> {
    let Some(suite) = rdma_core.suite() else {
        return Ok(Vec::new());
    };
    let set_dir = dir.join(format!("rdma-core-{rdma_core}"));
    fs::create_dir_all(&set_dir).context(|| format!("cannot create {}", set_dir.display()))?;
    let root = set_dir.join("root");
    let stamp = format!("{suite} {DEB13_PACKAGES:?} {LIBRARY_DIRS:?}\n");
    if !is_current(&root, &stamp) {
        unpack_set(&set_dir, suite, &root)?;
        link_debuginfo(&root, &set_dir.join(VALGRIND_DEBUGINFO))?;
        write_stamp(&root, &stamp)?;
    }
    overlays(&root, Path::new("/"))
}

/// Downloads the packages of `suite` and unpacks them into `root` (replacing it whole).
fn unpack_set(set_dir: &Path, suite: &'static str, root: &Path) -> Result<()> {
    let source = AptSource::new(set_dir, Some(suite));
    let debs = set_dir.join(private_name("download"));
    let scratch = set_dir.join(private_name("unpack"));
    for d in [&debs, &scratch] {
        let _ = fs::remove_dir_all(d);
        fs::create_dir_all(d).context(|| format!("cannot create {}", d.display()))?;
    }
    for package in DEB13_PACKAGES {
        eprintln!("rdma-verbs-vm setup: downloading {package} ({suite})");
        let deb = source.download(&debs, package)?;
        eprintln!("rdma-verbs-vm setup: unpacking {}", file_name(&deb));
        run_checked(Command::new("dpkg").arg("-x").arg(&deb).arg(&scratch))?;
    }
    let _ = fs::remove_dir_all(root);
    fs::rename(&scratch, root).context(|| format!("cannot move the tree to {}", root.display()))?;
    let _ = fs::remove_dir_all(&debs);
    Ok(())
}

/// Links every detached symbol file of the tree at `root` (`usr/lib/debug/.build-id/*/*`)
/// into each of [`LIBRARY_DIRS`] under `out` (replaced whole), by its own name.
fn link_debuginfo(root: &Path, out: &Path) -> Result<()> {
    let _ = fs::remove_dir_all(out);
    let ids = root.join("usr/lib/debug/.build-id");
    let mut files = Vec::new();
    for prefix in fs::read_dir(&ids).context(|| format!("cannot read {}", ids.display()))? {
        let Ok(prefix) = prefix else { continue };
        let Ok(entries) = fs::read_dir(prefix.path()) else {
            continue;
        };
        files.extend(
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "debug") && p.is_file()),
        );
    }
    for dir in LIBRARY_DIRS {
        let d = out.join(dir);
        fs::create_dir_all(&d).context(|| format!("cannot create {}", d.display()))?;
        for f in &files {
            let link = d.join(f.file_name().unwrap_or_default());
            std::os::unix::fs::symlink(f, &link)
                .context(|| format!("cannot link {}", link.display()))?;
        }
    }
    Ok(())
}

/// The overlays of the tree at `root` on the system at `host` (`/`, or a test's directory):
/// every file of `usr/lib/x86_64-linux-gnu` and its `libibverbs/` with `.so` in its name,
/// of `usr/bin` and of `etc/libibverbs.d` (a symlink counts as the file it names) whose path
/// also exists on the host, on the host's real file; one per host file, the first name wins.
pub fn overlays(root: &Path, host: &Path) -> Result<Vec<Overlay>> {
    let mut by_target = BTreeMap::new();
    for (dir, only_libraries) in OVERLAID_DIRS {
        let Ok(entries) = fs::read_dir(root.join(dir)) else {
            continue;
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !only_libraries || n.contains(".so"))
            .collect();
        names.sort();
        for name in names {
            let rel = Path::new(dir).join(&name);
            let Ok(source) = root.join(&rel).canonicalize() else {
                continue;
            };
            if !source.is_file() || !source.starts_with(root.canonicalize().unwrap_or_default()) {
                continue;
            }
            let Ok(target) = host.join(&rel).canonicalize() else {
                continue;
            };
            if target.is_file() {
                by_target
                    .entry(target.clone())
                    .or_insert(Overlay { source, target });
            }
        }
    }
    if by_target.is_empty() {
        return Err(Error::new(format!(
            "{} covers none of the host's files: an empty or broken rdma-core tree",
            root.display()
        )));
    }
    Ok(by_target.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn overlays_cover_the_hosts_real_files_only() {
        let t = std::env::temp_dir().join(format!("rdma-verbs-vm-overlay-{}", std::process::id()));
        let _ = fs::remove_dir_all(&t);
        let (root, host) = (t.join("root"), t.join("host"));
        let lib = "usr/lib/x86_64-linux-gnu";
        for d in [&root, &host] {
            fs::create_dir_all(d.join(lib).join("libibverbs")).unwrap();
            fs::create_dir_all(d.join("usr/bin")).unwrap();
        }
        fs::write(root.join(lib).join("libibverbs.so.1.14.56.1"), "56").unwrap();
        symlink(
            "libibverbs.so.1.14.56.1",
            root.join(lib).join("libibverbs.so.1"),
        )
        .unwrap();
        fs::write(root.join(lib).join("libc.so.6"), "2.41").unwrap();
        fs::write(root.join(lib).join("libnew.so.1"), "new").unwrap();
        fs::write(root.join(lib).join("README"), "doc").unwrap();
        fs::write(root.join("usr/bin/ibv_devinfo"), "56").unwrap();
        fs::write(host.join(lib).join("libibverbs.so.1.14.44.0"), "44").unwrap();
        symlink(
            "libibverbs.so.1.14.44.0",
            host.join(lib).join("libibverbs.so.1"),
        )
        .unwrap();
        fs::write(host.join(lib).join("libc.so.6"), "2.36").unwrap();
        fs::write(host.join(lib).join("README"), "doc").unwrap();
        fs::write(host.join("usr/bin/ibv_devinfo"), "44").unwrap();

        let got = overlays(&root, &host).unwrap();
        let pairs: Vec<(String, String)> = got
            .iter()
            .map(|o| (file_name(&o.source), file_name(&o.target)))
            .collect();
        assert_eq!(
            pairs,
            [
                ("ibv_devinfo".into(), "ibv_devinfo".into()),
                ("libc.so.6".into(), "libc.so.6".into()),
                (
                    "libibverbs.so.1.14.56.1".into(),
                    "libibverbs.so.1.14.44.0".into()
                ),
            ]
        );
        assert!(
            got.iter()
                .all(|o| o.target.starts_with(host.canonicalize().unwrap()))
        );
        assert_eq!(overlaid_release(&got).as_deref(), Some("56.1"));
        let _ = fs::remove_dir_all(&t);
    }
}
