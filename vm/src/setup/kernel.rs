//! The guest kernel: Debian's current kernel package, downloaded and unpacked, and the
//! uncompressed ELF kernel QEMU boots through PVH.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;

use super::apt::AptSource;
use super::{file_name, private_name};
use crate::cmd::{output_checked, require_tool, run_checked};
use crate::{Context, Error, Result};

/// The Debian metapackage that depends on the current kernel package.
const KERNEL_METAPACKAGE: &str = "linux-image-amd64";

/// The kernel package already in the cache (the newest one if several are).
pub(super) fn cached_kernel_deb(dir: &Path) -> Result<Option<PathBuf>> {
    let mut debs: Vec<(std::time::SystemTime, PathBuf)> = fs::read_dir(dir)
        .context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = file_name(p);
            name.starts_with("linux-image-")
                && !name.starts_with(&format!("{KERNEL_METAPACKAGE}_"))
                && name.ends_with(".deb")
        })
        .map(|p| (p.metadata().and_then(|m| m.modified()).ok(), p))
        .filter_map(|(t, p)| t.map(|t| (t, p)))
        .collect();
    debs.sort();
    Ok(debs.pop().map(|(_, p)| p))
}

/// Downloads the package that [`KERNEL_METAPACKAGE`] (as `source` has it) depends on into
/// `dir`.
pub(super) fn download_kernel(dir: &Path, source: &AptSource) -> Result<PathBuf> {
    let download = dir.join(private_name("download"));
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).context(|| format!("cannot create {}", download.display()))?;

    eprintln!("rdma-verbs-vm setup: downloading {KERNEL_METAPACKAGE} to find the current kernel");
    let meta = source.download(&download, KERNEL_METAPACKAGE)?;
    let depends = output_checked(Command::new("dpkg-deb").arg("-f").arg(&meta).arg("Depends"))?;
    let depends = String::from_utf8_lossy(&depends.stdout);
    let package = kernel_dependency(&depends).ok_or_else(|| {
        Error::new(format!(
            "{KERNEL_METAPACKAGE} does not depend on a linux-image-<ver>-amd64 package \
             (Depends: {})",
            depends.trim()
        ))
    })?;

    eprintln!("rdma-verbs-vm setup: downloading {package}");
    let deb = source.download(&download, package)?;
    let cached = dir.join(file_name(&deb));
    fs::rename(&deb, &cached).context(|| format!("cannot move {}", deb.display()))?;
    let _ = fs::remove_dir_all(&download);
    Ok(cached)
}

/// The `linux-image-<ver>-amd64` entry of a Depends field.
fn kernel_dependency(depends: &str) -> Option<&str> {
    depends
        .split([',', '|'])
        .filter_map(|dep| dep.split_whitespace().next())
        .find(|name| {
            name.starts_with("linux-image-")
                && name.ends_with("-amd64")
                && *name != KERNEL_METAPACKAGE
        })
}

/// A kernel package unpacked with `dpkg -x` into `<cache>/unpack-<pid>`, removed on drop (it is
/// hundreds of MB; the .deb stays cached).
pub(super) struct Unpacked {
    /// Where the package is unpacked.
    pub(super) root: PathBuf,
    /// The kernel release, the name of the directory under lib/modules.
    pub(super) release: String,
}

impl Unpacked {
    /// Unpacks `deb` under `dir`.
    pub(super) fn new(dir: &Path, deb: &Path) -> Result<Self> {
        let root = dir.join(private_name("unpack"));
        let _ = fs::remove_dir_all(&root);
        eprintln!("rdma-verbs-vm setup: unpacking {}", file_name(deb));
        run_checked(Command::new("dpkg").arg("-x").arg(deb).arg(&root))?;
        let mut tree = Self {
            root,
            release: String::new(),
        };
        // Newer Debian ships modules under usr/lib; depmod -b and modprobe -d read lib/.
        let lib_modules = tree.root.join("lib/modules");
        if !lib_modules.exists() && tree.root.join("usr/lib/modules").exists() {
            std::os::unix::fs::symlink("usr/lib", tree.root.join("lib"))
                .context(|| "cannot link lib -> usr/lib in the unpacked kernel".into())?;
        }
        tree.release = fs::read_dir(&lib_modules)
            .context(|| format!("{} has no lib/modules", file_name(deb)))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .next()
            .ok_or_else(|| Error::new(format!("{} has no kernel modules", file_name(deb))))?;
        Ok(tree)
    }

    /// The compressed kernel image.
    pub(super) fn vmlinuz(&self) -> Result<PathBuf> {
        let path = self.root.join(format!("boot/vmlinuz-{}", self.release));
        if path.exists() {
            Ok(path)
        } else {
            Err(Error::new(format!("{} is missing", path.display())))
        }
    }
}

impl Drop for Unpacked {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Compressed streams a bzImage may carry its kernel in: (magic, tool, its package).
/// Debian's 6.1 uses xz, bookworm-backports' 6.12 zstd.
const COMPRESSIONS: &[(&[u8], &str, &str)] = &[
    (b"\xfd7zXZ\x00", "xz", "xz-utils"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstd"),
];

/// Writes the ELF kernel inside `vmlinuz` to `out`.
///
/// A bzImage carries the real kernel as a compressed stream (xz or zstd, found by its
/// magic) after its decompressor; QEMU can boot that ELF directly through the PVH entry
/// point, which skips the slow in-guest decompression under TCG.
pub(super) fn extract_vmlinux(vmlinuz: &Path, out: &Path) -> Result<()> {
    let image = fs::read(vmlinuz).context(|| format!("cannot read {}", vmlinuz.display()))?;
    for (magic, tool, package) in COMPRESSIONS {
        let starts: Vec<usize> = image
            .windows(magic.len())
            .enumerate()
            .filter(|(_, w)| w == magic)
            .map(|(i, _)| i)
            .collect();
        if starts.is_empty() {
            continue;
        }
        let tool = require_tool(tool, package)?;
        for start in starts {
            if let Some(elf) = decompress(&tool, &image[start..])? {
                let tmp = out.with_extension(private_name("tmp"));
                fs::write(&tmp, &elf).context(|| format!("cannot write {}", tmp.display()))?;
                return fs::rename(&tmp, out).context(|| format!("cannot write {}", out.display()));
            }
        }
    }
    Err(Error::new(format!(
        "no xz- or zstd-compressed ELF kernel found inside {}",
        vmlinuz.display()
    )))
}

/// What `tool -dc` makes of `stream` (which may have trailing bytes: the tool's complaint
/// about them is ignored), if that is an ELF file.
fn decompress(tool: &Path, stream: &[u8]) -> Result<Option<Vec<u8>>> {
    let mut child = Command::new(tool)
        .arg("-dc")
        .args(tool.ends_with("xz").then_some("--single-stream"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context(|| format!("cannot run {}", tool.display()))?;
    let Some(mut stdin) = child.stdin.take() else {
        return Ok(None);
    };
    let output = thread::scope(|s| {
        // Feed the tool from a second thread so neither pipe fills up and blocks the other.
        s.spawn(move || {
            let _ = stdin.write_all(stream);
        });
        child.wait_with_output()
    })
    .context(|| format!("cannot run {}", tool.display()))?;
    Ok(output
        .stdout
        .starts_with(b"\x7fELF")
        .then_some(output.stdout))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_kernel_dependency() {
        assert_eq!(
            kernel_dependency("linux-image-6.1.0-57-amd64 (= 6.1.192-3)"),
            Some("linux-image-6.1.0-57-amd64")
        );
        assert_eq!(
            kernel_dependency("foo, linux-image-6.12.1-amd64-unsigned | linux-image-6.12.1-amd64"),
            Some("linux-image-6.12.1-amd64")
        );
        assert_eq!(kernel_dependency("initramfs-tools"), None);
    }
}
