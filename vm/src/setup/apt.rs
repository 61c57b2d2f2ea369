//! Fetching Debian packages: from the host's own apt sources, or from another suite through
//! a private apt configuration (sources, lists and cache under the kernel's cache
//! directory; the host's apt state is never touched).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::file_name;
use super::packages::apt;
use crate::cmd::run_checked;
use crate::{Context, Error, Result};

/// The Debian archive a private configuration fetches from.
const DEBIAN_ARCHIVE: &str = "http://deb.debian.org/debian";
/// The keyring that signs it (package debian-archive-keyring).
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// Where packages come from.
pub(super) enum AptSource {
    /// The host's apt sources (`apt-get download` as the host is configured).
    Host,
    /// One suite of the Debian archive, with its own lists and cache under `dir`.
    Private {
        /// The private configuration's root (`<kernel dir>/apt`).
        dir: PathBuf,
        /// The suite, as `bookworm-backports`.
        suite: &'static str,
    },
}

impl AptSource {
    /// The host's sources for `suite == None`, else a private configuration of `suite` under
    /// `kernel_dir/apt`.
    pub(super) fn new(kernel_dir: &Path, suite: Option<&'static str>) -> Self {
        match suite {
            None => Self::Host,
            Some(suite) => Self::Private {
                dir: kernel_dir.join("apt"),
                suite,
            },
        }
    }

    /// `apt-get` with the private configuration's options, if any.
    fn apt_get(&self) -> Command {
        let mut c = Command::new("apt-get");
        if let Self::Private { dir, .. } = self {
            for (key, value) in [
                ("Dir::Etc::SourceList", PathBuf::from("/dev/null")),
                ("Dir::Etc::SourceParts", dir.join("sources.list.d")),
                ("Dir::State::Lists", dir.join("lists")),
                ("Dir::State::status", dir.join("status")),
                ("Dir::Cache", dir.join("cache")),
            ] {
                c.arg("-o").arg(format!("{key}={}", value.display()));
            }
            c.args(["-o", "Debug::NoLocking=1"]);
        }
        c
    }

    /// Refreshes the package lists: the host's through sudo, a private one as this user.
    fn update(&self) -> Result<()> {
        match self {
            Self::Host => run_checked(apt(&["update"]).stdout(Stdio::null())),
            Self::Private { dir, suite } => {
                for d in ["sources.list.d", "lists/partial", "cache/archives/partial"] {
                    let d = dir.join(d);
                    fs::create_dir_all(&d).context(|| format!("cannot create {}", d.display()))?;
                }
                let status = dir.join("status");
                fs::write(&status, "").context(|| format!("cannot write {}", status.display()))?;
                let sources = dir.join("sources.list.d/debian.sources");
                let stanza = format!(
                    "Types: deb\nURIs: {DEBIAN_ARCHIVE}\nSuites: {suite}\nComponents: main\n\
                     Signed-By: {DEBIAN_KEYRING}\n"
                );
                fs::write(&sources, stanza)
                    .context(|| format!("cannot write {}", sources.display()))?;
                eprintln!("rdma-verbs-vm setup: fetching the package lists of {suite}");
                run_checked(self.apt_get().args(["-q", "update"]).stdout(Stdio::null()))
            }
        }
    }

    /// Whether a private configuration has fetched its lists yet.
    fn has_lists(&self) -> bool {
        match self {
            Self::Host => true,
            Self::Private { dir, .. } => fs::read_dir(dir.join("lists")).is_ok_and(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .any(|e| file_name(&e.path()).contains("_Packages"))
            }),
        }
    }

    /// `apt-get download PACKAGE` (which may be `name=version`) in `dir`, refreshing the
    /// package lists once if that fails (a fresh machine may have none); returns the
    /// downloaded file.
    pub(super) fn download(&self, dir: &Path, package: &str) -> Result<PathBuf> {
        if !self.has_lists() {
            self.update()?;
        }
        let download = || {
            self.apt_get()
                .args(["download", package])
                .current_dir(dir)
                .output()
        };
        let out = download().context(|| "cannot run apt-get".into())?;
        let out = if out.status.success() {
            out
        } else {
            eprintln!(
                "rdma-verbs-vm setup: apt-get download {package} failed; refreshing the \
                 package lists"
            );
            self.update()?;
            download().context(|| "cannot run apt-get".into())?
        };
        if !out.status.success() {
            return Err(Error::new(format!(
                "apt-get download {package} failed:\n{}",
                String::from_utf8_lossy(&out.stderr).trim_end()
            )));
        }
        let name = package.split('=').next().unwrap_or(package);
        fs::read_dir(dir)
            .context(|| format!("cannot list {}", dir.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| file_name(p).starts_with(&format!("{name}_")))
            .ok_or_else(|| Error::new(format!("apt-get download {package} left no .deb behind")))
    }
}
