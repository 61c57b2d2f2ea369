//! Soft-iWARP for the guest. Debian's kernels do not build `siw` (`# CONFIG_RDMA_SIW is not
//! set` in 6.1 and in bookworm-backports' 6.12), so `setup` compiles it as an out-of-tree
//! module: the driver's source from the kernel's `linux-source-<major.minor>` package of the
//! very same version, against that kernel's headers package (`linux-headers-<release>`,
//! its `-common` part and `linux-kbuild`), with the host's gcc (Debian 12's gcc-12 builds
//! both kernels). The module is cached as `siw.ko` next to the kernel it was built for.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::apt::AptSource;
use super::{file_name, is_current, private_name, write_stamp};
use crate::cmd::{output_checked, require_tool, run_checked};
use crate::{Context, Error, Result};

/// Where the driver's source lies inside the kernel tree.
const SIW_SOURCE_DIR: &str = "drivers/infiniband/sw/siw";

/// The kernel modules siw needs besides the [`GUEST_MODULES`](super::GUEST_MODULES), in
/// load order: the crc32c that siw and libcrc32c ask the crypto API for by name (no symbol
/// dependency pulls it in), and libcrc32c.
pub const SIW_DEPENDENCIES: &[&str] = &["crc32c_generic", "libcrc32c"];

/// A kernel package's name, version and release, from its file name
/// (`linux-image-<release>_<version>_amd64.deb`).
struct KernelPackage {
    /// As `6.1.0-57-amd64`.
    release: String,
    /// As `6.1.192-3`.
    version: String,
    /// As `6.1`: the suffix of `linux-source-<series>`.
    series: String,
}

impl KernelPackage {
    /// Parses the file name of the kernel package `deb`.
    fn from_deb(deb: &Path) -> Result<Self> {
        let name = file_name(deb);
        let parse = || {
            let mut fields = name.strip_suffix(".deb")?.split('_');
            let release = fields.next()?.strip_prefix("linux-image-")?.to_string();
            let version = fields.next()?.replace("%3a", ":");
            let mut numbers = version.split(['.', '-']);
            let series = format!("{}.{}", numbers.next()?, numbers.next()?);
            Some(Self {
                release,
                version,
                series,
            })
        };
        parse().ok_or_else(|| Error::new(format!("cannot read a kernel version from {name}")))
    }
}

/// The `siw.ko` built for the kernel package `deb` (cached in `kernel_dir`, rebuilt when the
/// kernel changes), with debug information stripped.
pub(super) fn ensure_siw(kernel_dir: &Path, deb: &Path, source: &AptSource) -> Result<PathBuf> {
    let out = kernel_dir.join("siw.ko");
    let stamp = format!("{}\nsiw from linux-source, stripped\n", file_name(deb));
    if is_current(&out, &stamp) {
        return Ok(out);
    }
    let make = require_tool("make", "make")?;
    let strip = require_tool("strip", "binutils")?;
    require_tool("gcc", "gcc")?;
    let kernel = KernelPackage::from_deb(deb)?;
    eprintln!(
        "rdma-verbs-vm setup: Debian's kernel {} has no siw module; building it from \
         linux-source-{} (once, about 20 s)",
        kernel.release, kernel.series
    );
    let work = kernel_dir.join(private_name("siw-build"));
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).context(|| format!("cannot create {}", work.display()))?;
    let built = build(&work, &kernel, source, &make);
    let result = built.and_then(|ko| {
        let tmp = out.with_extension(private_name("tmp"));
        fs::copy(&ko, &tmp).context(|| format!("cannot write {}", tmp.display()))?;
        run_checked(Command::new(&strip).arg("--strip-debug").arg(&tmp))?;
        fs::rename(&tmp, &out).context(|| format!("cannot write {}", out.display()))?;
        write_stamp(&out, &stamp)
    });
    let _ = fs::remove_dir_all(&work);
    result.map(|()| out)
}

/// Downloads and unpacks the headers and the source into `work`, builds the module there
/// and returns its path.
fn build(work: &Path, kernel: &KernelPackage, source: &AptSource, make: &Path) -> Result<PathBuf> {
    let debs = work.join("debs");
    let root = work.join("root");
    fs::create_dir_all(&debs).context(|| format!("cannot create {}", debs.display()))?;
    let headers_name = format!("linux-headers-{}", kernel.release);
    let headers = source.download(&debs, &format!("{headers_name}={}", kernel.version))?;
    let depends = output_checked(
        Command::new("dpkg-deb")
            .arg("-f")
            .arg(&headers)
            .arg("Depends"),
    )?;
    let depends = String::from_utf8_lossy(&depends.stdout).into_owned();
    let mut debs_to_unpack = vec![headers];
    for dep in depends
        .split(',')
        .filter_map(|d| d.split_whitespace().next())
        .filter(|d| d.starts_with("linux-headers-") || d.starts_with("linux-kbuild-"))
    {
        debs_to_unpack.push(source.download(&debs, &format!("{dep}={}", kernel.version))?);
    }
    let source_name = format!("linux-source-{}", kernel.series);
    let source_deb = source.download(&debs, &format!("{source_name}={}", kernel.version))?;
    for deb in &debs_to_unpack {
        run_checked(Command::new("dpkg").arg("-x").arg(deb).arg(&root))?;
    }
    let tree = root.join("usr/src").join(&headers_name);
    // The headers' Makefile includes the -common part by its absolute /usr/src path.
    let makefile = tree.join("Makefile");
    let text =
        fs::read_to_string(&makefile).context(|| format!("cannot read {}", makefile.display()))?;
    let prefix = format!("include {}/usr/", root.display());
    fs::write(&makefile, text.replace("include /usr/", &prefix))
        .context(|| format!("cannot write {}", makefile.display()))?;

    let src = unpack_driver_source(work, &source_deb, &source_name)?;
    output_checked(
        Command::new(make)
            .arg("-C")
            .arg(&tree)
            .arg(format!("M={}", src.display()))
            // BTF for an out-of-tree module needs pahole and the vmlinux; the guest needs neither.
            .args([
                "CONFIG_RDMA_SIW=m",
                "CONFIG_DEBUG_INFO_BTF_MODULES=",
                "modules",
            ]),
    )?;
    Ok(src.join("siw.ko"))
}

/// Extracts only the siw directory from the source package's tarball (`usr/src/<name>.tar.xz`
/// inside the .deb) into `work`; returns it. `--occurrence` stops reading once the directory
/// is out: it sits halfway into the tarball, whose decompression is most of this step's time
/// (8.5 s for all of 6.1's, 3.4 s up to siw). The stages before the inner `tar` then end on
/// a closed pipe, which is expected; the inner `tar`'s status is the pipeline's.
fn unpack_driver_source(work: &Path, source_deb: &Path, source_name: &str) -> Result<PathBuf> {
    let tarball = format!("./usr/src/{source_name}.tar.xz");
    let member = format!("{source_name}/{SIW_SOURCE_DIR}");
    let script = "dpkg-deb --fsys-tarfile \"$1\" 2>/dev/null | tar -xO \"$2\" 2>/dev/null | \
                  tar -xJ --occurrence=1 -C \"$3\" \"$4\"";
    run_checked(
        Command::new("sh")
            .args(["-ec", script, "sh"])
            .arg(source_deb)
            .arg(&tarball)
            .arg(work)
            .arg(&member),
    )?;
    Ok(work.join(member))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kernel_versions_from_package_names() {
        let k = KernelPackage::from_deb(Path::new(
            "/c/linux-image-6.12.95+deb12-amd64_6.12.95-1~bpo12+1_amd64.deb",
        ))
        .unwrap();
        assert_eq!(k.release, "6.12.95+deb12-amd64");
        assert_eq!(k.version, "6.12.95-1~bpo12+1");
        assert_eq!(k.series, "6.12");
        let k =
            KernelPackage::from_deb(Path::new("linux-image-6.1.0-57-amd64_6.1.192-3_amd64.deb"))
                .unwrap();
        assert_eq!(
            (k.release.as_str(), k.series.as_str()),
            ("6.1.0-57-amd64", "6.1")
        );
        assert!(KernelPackage::from_deb(Path::new("vmlinux")).is_err());
    }
}
