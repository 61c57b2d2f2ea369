//! `rdma-verbs-vm setup`: host packages, the guest kernel and the guest initramfs.
//!
//! Everything is cached in [`vm_dir`] and rebuilt only when missing or when its
//! recipe changed (each artifact has a `.stamp` file holding the inputs it was built from):
//!
//! ```text
//! linux-image-<ver>-amd64_<debver>_amd64.deb   Debian's kernel package, as downloaded
//! vmlinux, vmlinux.stamp                       the uncompressed kernel (QEMU boots it as PVH)
//! initramfs.cpio, initramfs.stamp              busybox + modules + the generic /init
//! siw.ko, initramfs-siw.cpio (+ stamps)        soft-iWARP, built on first use (`siw`)
//! bpo/                                         the same files for the backports kernel,
//!   apt/                                       with its private apt lists and cache
//! rdma-core-56/root, root.stamp                Debian 13's rdma-core and C library (`userland`)
//!   apt/                                       with its private apt lists and cache
//! runs/<pid>-<n>/                              one directory per guest run (see `vm`)
//! ```
//!
//! Which kernel, provider and rdma-core a guest gets is a [`Choice`]: the default (Debian 12's
//! 6.1 kernel, rxe, the host's rdma-core) keeps the files at the top level exactly as before.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::choice::{Choice, Provider};
use crate::{Context, Result, cmd, vm};

mod apt;
mod initramfs;
mod kernel;
mod packages;
mod siw;
mod userland;
use apt::AptSource;
use initramfs::build_initramfs;
use kernel::{Unpacked, cached_kernel_deb, download_kernel, extract_vmlinux};
use packages::{busybox, ensure_packages};
pub use siw::SIW_DEPENDENCIES;
pub use userland::{Overlay, VALGRIND_DEBUGINFO, overlaid_release, overlays};

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
    /// The cache directory, [`vm_dir`] (run directories go under its `runs/`).
    pub dir: PathBuf,
    /// The kernel and the provider this image boots and brings up.
    pub choice: Choice,
    /// The kernel package the image was built from (its file name).
    pub kernel_package: String,
    /// Uncompressed ELF kernel, booted through PVH.
    pub vmlinux: PathBuf,
    /// Uncompressed newc initramfs.
    pub initramfs: PathBuf,
    /// The files of another rdma-core laid over the host's in the guest (none for the
    /// host's own, [`RdmaCore::Host`](crate::choice::RdmaCore::Host)).
    pub overlays: Vec<Overlay>,
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
/// image of the [`Choice`] the environment makes is built; idempotent.
pub fn setup(verbosity: Verbosity, extra_packages: &[&str]) -> Result<VmAssets> {
    setup_choice(verbosity, extra_packages, Choice::from_env()?)
}

/// [`setup`] for an explicit kernel and provider.
pub fn setup_choice(
    verbosity: Verbosity,
    extra_packages: &[&str],
    choice: Choice,
) -> Result<VmAssets> {
    ensure_packages(extra_packages)?;
    let dir = vm_dir();
    fs::create_dir_all(&dir).context(|| format!("cannot create {}", dir.display()))?;
    remove_abandoned_scratch(&dir);
    let kernel_dir = match choice.kernel.subdir() {
        Some(sub) => {
            let kernel_dir = dir.join(sub);
            fs::create_dir_all(&kernel_dir)
                .context(|| format!("cannot create {}", kernel_dir.display()))?;
            remove_abandoned_scratch(&kernel_dir);
            kernel_dir
        }
        None => dir.clone(),
    };
    let source = AptSource::new(&kernel_dir, choice.kernel.suite());

    let busybox = busybox()?;
    let deb = match cached_kernel_deb(&kernel_dir)? {
        Some(deb) => deb,
        None => download_kernel(&kernel_dir, &source)?,
    };
    let siw = match choice.provider {
        Provider::Rxe => None,
        Provider::Siw => Some(siw::ensure_siw(&kernel_dir, &deb, &source)?),
    };
    let vmlinux = kernel_dir.join("vmlinux");
    let initramfs = kernel_dir.join(match choice.provider {
        Provider::Rxe => "initramfs.cpio",
        Provider::Siw => "initramfs-siw.cpio",
    });
    let deb_name = file_name(&deb);
    let vmlinux_stamp = format!("{deb_name}\n");
    // The rxe image's stamp is what it always was, so an existing cache stays valid.
    let siw_line = match &siw {
        Some(_) => format!("siw {SIW_DEPENDENCIES:?} + siw.ko\n"),
        None => String::new(),
    };
    let initramfs_stamp = format!(
        "{deb_name}\nbusybox {} {} bytes\nmodules {GUEST_MODULES:?}\n{siw_line}{}",
        busybox.display(),
        busybox.metadata().map(|m| m.len()).unwrap_or(0),
        vm::INIT_SCRIPT
    );
    let need_vmlinux = !is_current(&vmlinux, &vmlinux_stamp);
    let need_initramfs = !is_current(&initramfs, &initramfs_stamp);

    if need_vmlinux || need_initramfs {
        let tree = Unpacked::new(&kernel_dir, &deb)?;
        if need_vmlinux {
            eprintln!("rdma-verbs-vm setup: extracting the uncompressed kernel");
            extract_vmlinux(&tree.vmlinuz()?, &vmlinux)?;
            write_stamp(&vmlinux, &vmlinux_stamp)?;
        }
        if need_initramfs {
            eprintln!("rdma-verbs-vm setup: building the initramfs");
            build_initramfs(&tree, &busybox, siw.as_deref(), &initramfs)?;
            write_stamp(&initramfs, &initramfs_stamp)?;
        }
    }

    let overlays = userland::ensure_userland(&dir, choice.rdma_core)?;

    if verbosity == Verbosity::Report {
        say!(
            "rdma-verbs-vm setup: all {} packages installed",
            PACKAGES.len() + extra_packages.len()
        );
        say!("  cache           {}", dir.display());
        say!(
            "  guest           kernel {}, provider {}, rdma-core {} ({} files laid over the \
             host's)",
            choice.kernel,
            choice.provider,
            choice.rdma_core,
            overlays.len()
        );
        say!("  kernel package  {}", deb.display());
        say!("  kernel          {}", vmlinux.display());
        say!("  initramfs       {}", initramfs.display());
    }
    Ok(VmAssets {
        dir,
        choice,
        kernel_package: deb_name,
        vmlinux,
        initramfs,
        overlays,
    })
}

/// `name-<pid>`: a scratch name no concurrent setup uses, so two cold setups racing each other
/// both finish (the last rename into place wins, and both results are complete).
pub(super) fn private_name(name: &str) -> String {
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
        let scratch =
            base == "download" || base == "unpack" || base == "siw-build" || base.ends_with(".tmp");
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
pub(super) fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}
