//! `rdma-verbs-vm setup`: host packages, the guest kernel and the guest initramfs.
//!
//! Everything is cached in [`vm_dir`] and rebuilt only when missing or when its
//! recipe changed (each artifact has a `.stamp` file holding the inputs it was built from):
//!
//! ```text
//! linux-image-<ver>-amd64_<debver>_amd64.deb   Debian's kernel package, as downloaded
//! vmlinux, vmlinux.stamp                       the uncompressed kernel (QEMU boots it as PVH)
//! initramfs.cpio, initramfs.stamp              busybox + modules + the generic /init
//! runs/<pid>-<n>/                              one directory per guest run (see `vm`)
//! ```

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::thread;

use crate::cmd::{self, output_checked, require_tool, run_checked};
use crate::cpio::Archive;
use crate::{Context, Error, Result, vm};

/// Debian packages the host needs: QEMU and busybox for the guest, kmod and xz for building
/// it, rdma-core and the perftest/rdmacm tools that run inside it, and the headers, clang and
/// pkg-config that the `rdma-verbs` crate's build script needs.
pub const PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "kmod",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "rdmacm-utils",
    "perftest",
    "libibverbs-dev",
    "librdmacm-dev",
    "libclang-dev",
    "clang",
    "pkg-config",
    "iproute2",
    "util-linux",
    "xz-utils",
];

/// Kernel modules the guest loads, in this order, each after its own dependencies (resolved
/// with `modprobe --show-depends`). `crc32_generic` comes first: rdma_rxe asks the crypto API
/// for "crc32" by name, which no symbol dependency pulls in, and without it `rdma link add`
/// fails with "No such file or directory".
pub const GUEST_MODULES: &[&str] = &[
    "crc32_generic",
    // host shares and the output channels
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    "virtio_console",
    // the link rxe runs on: veth (one guest), virtio-net (two guests on a wire)
    "veth",
    "virtio_net",
    // fault injection on the wire (tc qdisc ... netem)
    "sch_netem",
    "udp_tunnel",
    "ip6_udp_tunnel",
    // verbs
    "ib_core",
    "ib_uverbs",
    "rdma_rxe",
    // rdma_cm
    "configfs",
    "ib_cm",
    "iw_cm",
    "rdma_cm",
    "rdma_ucm",
];

/// The Debian metapackage that depends on the current kernel package.
const KERNEL_METAPACKAGE: &str = "linux-image-amd64";

/// How much `setup` says.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verbosity {
    /// Print only when work is done (the mode every other command uses).
    Quiet,
    /// Also print a summary of the cached artifacts.
    Report,
}

/// The guest image, ready to boot.
pub struct VmAssets {
    /// The cache directory, [`vm_dir`].
    pub dir: PathBuf,
    /// Uncompressed ELF kernel, booted through PVH.
    pub vmlinux: PathBuf,
    /// Uncompressed newc initramfs.
    pub initramfs: PathBuf,
}

/// Environment variable naming the cache directory.
pub const DIR_ENV: &str = "RDMA_VERBS_VM_DIR";

/// The cache directory when [`DIR_ENV`] is unset, if a program set one (see
/// [`set_default_dir`]).
static DEFAULT_DIR: OnceLock<PathBuf> = OnceLock::new();

/// Sets the cache directory to use when [`DIR_ENV`] is unset, instead of the user's cache
/// directory; only the first call counts. (This project's `cargo xtask` keeps its guest image
/// under its own `target/rxe-vm`.)
pub fn set_default_dir(dir: PathBuf) {
    let _ = DEFAULT_DIR.set(dir);
}

/// The cache directory: `$RDMA_VERBS_VM_DIR` (relative to the current directory), else the
/// one given to [`set_default_dir`], else `$XDG_CACHE_HOME/rdma-verbs-vm`, else
/// `$HOME/.cache/rdma-verbs-vm`, else `<temp dir>/rdma-verbs-vm-<uid>`.
pub fn vm_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(DIR_ENV).filter(|d| !d.is_empty()) {
        return absolute(PathBuf::from(dir));
    }
    if let Some(dir) = DEFAULT_DIR.get() {
        return dir.clone();
    }
    let absolute_var = |name| {
        std::env::var_os(name)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    if let Some(cache) = absolute_var("XDG_CACHE_HOME") {
        return cache.join("rdma-verbs-vm");
    }
    if let Some(home) = absolute_var("HOME") {
        return home.join(".cache/rdma-verbs-vm");
    }
    std::env::temp_dir().join(format!("rdma-verbs-vm-{}", cmd::uid().unwrap_or(0)))
}

/// `path` made absolute against the current directory (unchanged if that cannot be read).
fn absolute(path: PathBuf) -> PathBuf {
    if path.is_absolute() {
        return path;
    }
    std::env::current_dir()
        .map(|cwd| cwd.join(&path))
        .unwrap_or(path)
}

/// Makes sure the packages ([`PACKAGES`] and `extra_packages`) are installed and the guest
/// image is built; idempotent.
pub fn setup(verbosity: Verbosity, extra_packages: &[&str]) -> Result<VmAssets> {
    ensure_packages(extra_packages)?;
    let dir = vm_dir();
    fs::create_dir_all(&dir).context(|| format!("cannot create {}", dir.display()))?;
    remove_abandoned_scratch(&dir);

    let busybox = busybox()?;
    let vmlinux = dir.join("vmlinux");
    let initramfs = dir.join("initramfs.cpio");
    let deb = match cached_kernel_deb(&dir)? {
        Some(deb) => deb,
        None => download_kernel(&dir)?,
    };
    let deb_name = file_name(&deb);
    let vmlinux_stamp = format!("{deb_name}\n");
    let initramfs_stamp = format!(
        "{deb_name}\nbusybox {} {} bytes\nmodules {GUEST_MODULES:?}\n{}",
        busybox.display(),
        busybox.metadata().map(|m| m.len()).unwrap_or(0),
        vm::INIT_SCRIPT
    );
    let need_vmlinux = !is_current(&vmlinux, &vmlinux_stamp);
    let need_initramfs = !is_current(&initramfs, &initramfs_stamp);

    if need_vmlinux || need_initramfs {
        let tree = Unpacked::new(&dir, &deb)?;
        if need_vmlinux {
            eprintln!("rdma-verbs-vm setup: extracting the uncompressed kernel");
            extract_vmlinux(&tree.vmlinuz()?, &vmlinux)?;
            write_stamp(&vmlinux, &vmlinux_stamp)?;
        }
        if need_initramfs {
            eprintln!("rdma-verbs-vm setup: building the initramfs");
            build_initramfs(&tree, &busybox, &initramfs)?;
            write_stamp(&initramfs, &initramfs_stamp)?;
        }
    }

    if verbosity == Verbosity::Report {
        say!(
            "rdma-verbs-vm setup: all {} packages installed",
            PACKAGES.len() + extra_packages.len()
        );
        say!("  cache           {}", dir.display());
        say!("  kernel package  {}", deb.display());
        say!("  kernel          {}", vmlinux.display());
        say!("  initramfs       {}", initramfs.display());
    }
    Ok(VmAssets {
        dir,
        vmlinux,
        initramfs,
    })
}

/// Installs the [`PACKAGES`] and `extra` that `dpkg-query` does not report as installed.
fn ensure_packages(extra: &[&str]) -> Result<()> {
    let wanted: Vec<&str> = PACKAGES.iter().chain(extra).copied().collect();
    let missing = missing_packages(&wanted)?;
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "rdma-verbs-vm setup: installing missing packages: {}",
        missing.join(" ")
    );
    run_checked(apt(&["update"]).stdout(Stdio::null()))?;
    run_checked(apt(&["install", "-y", "--no-install-recommends"]).args(&missing))?;
    let still = missing_packages(&wanted)?;
    if still.is_empty() {
        Ok(())
    } else {
        Err(Error::new(format!(
            "packages still missing after apt-get install: {}",
            still.join(" ")
        )))
    }
}

/// The `wanted` packages whose dpkg status is not "install ok installed".
fn missing_packages<'a>(wanted: &[&'a str]) -> Result<Vec<&'a str>> {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${Status}\\n"])
        .args(wanted)
        .stderr(Stdio::null())
        .output()
        .context(|| {
            format!(
                "cannot run dpkg-query (setup supports Debian and Ubuntu; elsewhere install \
                 the equivalents of: {})",
                wanted.join(" ")
            )
        })?;
    // dpkg-query exits 1 when some package is unknown; the installed ones are still listed.
    let listing = String::from_utf8_lossy(&out.stdout);
    let installed: Vec<&str> = listing
        .lines()
        .filter(|l| l.ends_with(" install ok installed"))
        .filter_map(|l| l.split_whitespace().next())
        .map(|name| name.split(':').next().unwrap_or(name))
        .collect();
    Ok(wanted
        .iter()
        .copied()
        .filter(|p| !installed.contains(p))
        .collect())
}

/// `apt-get ARGS` without questions, through sudo unless we are root (as `sudo env ...`, since
/// sudo drops the caller's environment).
fn apt(args: &[&str]) -> Command {
    let mut c = if cmd::is_root() {
        Command::new("env")
    } else {
        let mut c = Command::new("sudo");
        c.arg("env");
        c
    };
    c.args(["DEBIAN_FRONTEND=noninteractive", "apt-get"])
        .args(args);
    c
}

/// The static busybox binary (from busybox-static) that becomes the guest's userland.
fn busybox() -> Result<PathBuf> {
    for candidate in ["/bin/busybox", "/usr/bin/busybox"] {
        let path = Path::new(candidate);
        if let Ok(bytes) = fs::read(path) {
            if is_static_elf(&bytes) {
                return Ok(path.to_path_buf());
            }
            return Err(Error::new(format!(
                "{candidate} is dynamically linked; the guest needs busybox-static"
            )));
        }
    }
    Err(Error::new(
        "busybox not found; install busybox-static (rdma-verbs-vm setup does)",
    ))
}

/// Whether `bytes` is a 64-bit little-endian ELF without a PT_INTERP program header.
fn is_static_elf(bytes: &[u8]) -> bool {
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        bytes
            .get(o..o + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if bytes.get(..6) != Some(b"\x7fELF\x02\x01") {
        return false;
    }
    let (Some(phoff), Some(entsize), Some(count)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..usize::from(count)).all(|i| {
        let at = usize::try_from(phoff).unwrap_or(usize::MAX);
        let off = at.saturating_add(i * usize::from(entsize));
        u32_at(off).is_some_and(|p_type| p_type != 3) // 3 = PT_INTERP
    })
}

/// The kernel package already in the cache (the newest one if several are).
fn cached_kernel_deb(dir: &Path) -> Result<Option<PathBuf>> {
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

/// Downloads the package that [`KERNEL_METAPACKAGE`] depends on into `dir`.
fn download_kernel(dir: &Path) -> Result<PathBuf> {
    let download = dir.join(private_name("download"));
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).context(|| format!("cannot create {}", download.display()))?;

    eprintln!("rdma-verbs-vm setup: downloading {KERNEL_METAPACKAGE} to find the current kernel");
    let meta = apt_download(&download, KERNEL_METAPACKAGE)?;
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
    let deb = apt_download(&download, package)?;
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

/// `apt-get download PACKAGE` in `dir`, refreshing the package lists once if that fails
/// (a fresh machine may have none); returns the downloaded file.
fn apt_download(dir: &Path, package: &str) -> Result<PathBuf> {
    let download = || {
        Command::new("apt-get")
            .args(["download", package])
            .current_dir(dir)
            .output()
    };
    let out = download().context(|| "cannot run apt-get".into())?;
    let out = if out.status.success() {
        out
    } else {
        eprintln!("rdma-verbs-vm setup: apt-get download {package} failed; running apt-get update");
        run_checked(apt(&["update"]).stdout(Stdio::null()))?;
        download().context(|| "cannot run apt-get".into())?
    };
    if !out.status.success() {
        return Err(Error::new(format!(
            "apt-get download {package} failed:\n{}",
            String::from_utf8_lossy(&out.stderr).trim_end()
        )));
    }
    fs::read_dir(dir)
        .context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| file_name(p).starts_with(&format!("{package}_")))
        .ok_or_else(|| Error::new(format!("apt-get download {package} left no .deb behind")))
}

/// A kernel package unpacked with `dpkg -x` into `<cache>/unpack-<pid>`, removed on drop (it is
/// hundreds of MB; the .deb stays cached).
struct Unpacked {
    root: PathBuf,
    /// The kernel release, the name of the directory under lib/modules.
    release: String,
}

impl Unpacked {
    /// Unpacks `deb` under `dir`.
    fn new(dir: &Path, deb: &Path) -> Result<Self> {
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
    fn vmlinuz(&self) -> Result<PathBuf> {
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

/// Writes the ELF kernel inside `vmlinuz` to `out`.
///
/// A bzImage carries the real kernel as an xz stream (magic `fd 37 7a 58 5a 00`) after its
/// decompressor; QEMU can boot that ELF directly through the PVH entry point, which skips the
/// slow in-guest decompression under TCG.
fn extract_vmlinux(vmlinuz: &Path, out: &Path) -> Result<()> {
    const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";
    let xz = require_tool("xz", "xz-utils")?;
    let image = fs::read(vmlinuz).context(|| format!("cannot read {}", vmlinuz.display()))?;
    let image = &image[..];
    let starts = image
        .windows(XZ_MAGIC.len())
        .enumerate()
        .filter(|(_, w)| *w == XZ_MAGIC)
        .map(|(i, _)| i);
    for start in starts {
        let mut child = Command::new(&xz)
            .args(["-dc", "--single-stream"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context(|| "cannot run xz".into())?;
        let Some(mut stdin) = child.stdin.take() else {
            continue;
        };
        let output = thread::scope(|s| {
            // Feed xz from a second thread so neither pipe fills up and blocks the other.
            s.spawn(move || {
                let _ = stdin.write_all(&image[start..]);
            });
            child.wait_with_output()
        })
        .context(|| "cannot run xz".into())?;
        if output.stdout.starts_with(b"\x7fELF") {
            let tmp = out.with_extension(private_name("tmp"));
            fs::write(&tmp, &output.stdout)
                .context(|| format!("cannot write {}", tmp.display()))?;
            return fs::rename(&tmp, out).context(|| format!("cannot write {}", out.display()));
        }
    }
    Err(Error::new(format!(
        "no xz-compressed ELF kernel found inside {}",
        vmlinuz.display()
    )))
}

/// Builds the initramfs: busybox, the generic `/init`, and the [`GUEST_MODULES`] with their
/// dependencies under `/mods` plus their load order in `/mods/order`.
fn build_initramfs(tree: &Unpacked, busybox: &Path, out: &Path) -> Result<()> {
    let modules = resolve_modules(tree)?;
    let mut a = Archive::new();
    for dir in [
        "bin",
        "dev",
        "proc",
        "sys",
        "mods",
        "tmp",
        "host",
        vm::RUN_SHARE_DIR,
    ] {
        a.dir(dir.trim_start_matches('/'));
    }
    // The kernel opens /dev/console for /init before anything is mounted.
    a.char_dev("dev/console", 5, 1);
    let busybox_bytes =
        fs::read(busybox).context(|| format!("cannot read {}", busybox.display()))?;
    a.file("bin/busybox", 0o755, &busybox_bytes);
    a.symlink("bin/sh", "busybox");
    a.file("init", 0o755, vm::INIT_SCRIPT.as_bytes());

    let mut order = String::new();
    for module in &modules {
        let name = module_name(module);
        a.file(&format!("mods/{name}.ko"), 0o644, &read_module(module)?);
        order.push_str(&format!("{name}.ko\n"));
    }
    a.file("mods/order", 0o644, order.as_bytes());

    let tmp = out.with_extension(private_name("tmp"));
    fs::write(&tmp, a.finish()).context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, out).context(|| format!("cannot write {}", out.display()))
}

/// The module files to load, in order, each after its dependencies, without duplicates.
fn resolve_modules(tree: &Unpacked) -> Result<Vec<PathBuf>> {
    let depmod = require_tool("depmod", "kmod")?;
    let modprobe = require_tool("modprobe", "kmod")?;
    output_checked(
        Command::new(depmod)
            .arg("-b")
            .arg(&tree.root)
            .arg(&tree.release),
    )?;
    let mut order: Vec<PathBuf> = Vec::new();
    for module in GUEST_MODULES {
        let out = output_checked(Command::new(&modprobe).arg("-d").arg(&tree.root).args([
            "-S",
            &tree.release,
            "--show-depends",
            module,
        ]))?;
        // Lines are "insmod /path/x.ko [options]" or "builtin x" (nothing to load).
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(rest) = line.strip_prefix("insmod ") else {
                continue;
            };
            let path = PathBuf::from(module_path(rest.trim_end()));
            if !order.contains(&path) {
                order.push(path);
            }
        }
    }
    Ok(order)
}

/// The module file at the start of an insmod line, up to its `.ko[.xz|.zst|.gz]` suffix.
fn module_path(insmod_args: &str) -> &str {
    let Some(ko) = insmod_args.rfind(".ko") else {
        return insmod_args;
    };
    let after = &insmod_args[ko + 3..];
    let ext = [".xz", ".zst", ".gz"]
        .iter()
        .find(|e| after.starts_with(*e))
        .map_or(0, |e| e.len());
    &insmod_args[..ko + 3 + ext]
}

/// `crc32_generic` for `.../crc32_generic.ko.xz`.
fn module_name(path: &Path) -> String {
    let name = file_name(path);
    name.split(".ko").next().unwrap_or(&name).to_string()
}

/// A module's bytes, decompressed (busybox insmod cannot load compressed modules).
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let name = file_name(path);
    let tool = if name.ends_with(".ko") {
        return fs::read(path).context(|| format!("cannot read {}", path.display()));
    } else if name.ends_with(".ko.xz") {
        ("xz", "xz-utils")
    } else if name.ends_with(".ko.zst") {
        ("zstd", "zstd")
    } else if name.ends_with(".ko.gz") {
        ("gzip", "gzip")
    } else {
        return Err(Error::new(format!(
            "unknown module format: {}",
            path.display()
        )));
    };
    let out = output_checked(
        Command::new(require_tool(tool.0, tool.1)?)
            .arg("-dc")
            .arg(path),
    )?;
    Ok(out.stdout)
}

/// `name-<pid>`: a scratch name no concurrent setup uses, so two cold setups racing each other
/// both finish (the last rename into place wins, and both results are complete).
fn private_name(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

/// Removes the [`private_name`] scratch files and directories of setups that were killed.
fn remove_abandoned_scratch(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((base, pid)) = name.rsplit_once('-') else {
            continue;
        };
        let scratch = base == "download" || base == "unpack" || base.ends_with(".tmp");
        if scratch && !crate::pid_alive(pid) {
            let path = entry.path();
            let _ = fs::remove_dir_all(&path).or_else(|_| fs::remove_file(&path));
        }
    }
}

/// Whether `artifact` exists and was built from `stamp`.
fn is_current(artifact: &Path, stamp: &str) -> bool {
    artifact.exists() && fs::read_to_string(stamp_path(artifact)).is_ok_and(|s| s == stamp)
}

/// Records that `artifact` was built from `stamp`.
fn write_stamp(artifact: &Path, stamp: &str) -> Result<()> {
    let path = stamp_path(artifact);
    fs::write(&path, stamp).context(|| format!("cannot write {}", path.display()))
}

/// `vmlinux.stamp` for `vmlinux`, `initramfs.stamp` for `initramfs.cpio`.
fn stamp_path(artifact: &Path) -> PathBuf {
    artifact.with_extension("stamp")
}

/// The last component of `path`, lossily as UTF-8.
fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
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

    #[test]
    fn parses_insmod_lines() {
        assert_eq!(module_path("/m/a.ko"), "/m/a.ko");
        assert_eq!(module_path("/m/a.ko.xz opt=1"), "/m/a.ko.xz");
        assert_eq!(
            module_name(Path::new("/m/crc32_generic.ko.zst")),
            "crc32_generic"
        );
    }

    #[test]
    fn busybox_is_checked_for_static_linking() {
        // This test binary is a dynamically linked Rust program.
        let exe = std::env::current_exe()
            .and_then(fs::read)
            .unwrap_or_default();
        assert!(!is_static_elf(&exe));
        assert!(!is_static_elf(b"not an elf"));
    }
}
