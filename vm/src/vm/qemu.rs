//! The QEMU command line of a guest and the kernel command line it boots with.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::shares::{share_tag, writable_tag};
use super::{ERR_PORT, OUT_PORT, RUN_SHARE_TAG, Topology};
use crate::setup::VmAssets;

/// Guest memory in MiB: `RDMA_VERBS_VM_MEM_MB` (at least 1024), else the topology's
/// default ([`Topology::default_memory_mb`]). More lets `benches/mr_reg.rs` register 1 GiB.
fn memory_mb(topology: Topology) -> String {
    std::env::var("RDMA_VERBS_VM_MEM_MB")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|&mb| mb >= 1024)
        .unwrap_or_else(|| topology.default_memory_mb())
        .to_string()
}

/// The QEMU command line: TCG, q35, no outside NIC, PVH boot of the uncompressed kernel,
/// the 9p shares and the two output ports.
pub(super) fn qemu_args(
    assets: &VmAssets,
    run_dir: &Path,
    shared: &[&str],
    writable: &[PathBuf],
    topology: Topology,
) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-accel",
        "tcg",
        "-machine",
        "q35",
        "-m",
        &memory_mb(topology),
        "-smp",
        topology.cpus(),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-nic",
        "none",
        "-no-reboot",
        "-append",
        kernel_cmdline(),
    ]
    .map(OsString::from)
    .into();
    args.push("-kernel".into());
    args.push(assets.vmlinux.clone().into());
    args.push("-initrd".into());
    args.push(assets.initramfs.clone().into());
    args.push("-serial".into());
    args.push(concat(&[
        "file:".as_ref(),
        run_dir.join("console.log").as_os_str(),
    ]));
    args.extend(share_args(run_dir, shared, writable));
    args.extend(output_port_args());
    args.extend(topology.qemu_net_args().into_iter().map(OsString::from));
    args
}

/// `-virtfs` options: the host root (read-only), the per-run directory, the host's `/tmp`
/// or `/run` when `shared` names them, and the `writable` directories.
fn share_args(run_dir: &Path, shared: &[&str], writable: &[PathBuf]) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "-virtfs".into(),
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap".into(),
        "-virtfs".into(),
        concat(&[
            "local,path=".as_ref(),
            &escape_commas(run_dir.as_os_str()),
            ",mount_tag=".as_ref(),
            RUN_SHARE_TAG.as_ref(),
            ",security_model=none".as_ref(),
        ]),
    ];
    for dir in shared {
        args.push("-virtfs".into());
        args.push(
            format!(
                "local,path={dir},mount_tag={},security_model=none,multidevs=remap",
                share_tag(dir)
            )
            .into(),
        );
    }
    for (i, dir) in writable.iter().enumerate() {
        args.push("-virtfs".into());
        args.push(concat(&[
            "local,path=".as_ref(),
            &escape_commas(dir.as_os_str()),
            format!(
                ",mount_tag={},security_model=none,multidevs=remap",
                writable_tag(i)
            )
            .as_ref(),
        ]));
    }
    args
}

/// The virtio-serial ports of the command's stdout (QEMU's stdout) and stderr (QEMU's
/// stderr, a pipe to the forwarding thread).
fn output_port_args() -> Vec<OsString> {
    [
        "-device",
        "virtio-serial-pci,id=vser",
        "-chardev",
        "stdio,id=xout",
        "-device",
        &format!("virtserialport,bus=vser.0,chardev=xout,name={OUT_PORT}"),
        // /proc/self/fd/2 is the pipe to the forwarding thread. (Reopening our own stderr
        // instead would be unsafe: a reopened file gets its own offset and could
        // overwrite what stdout writes through the shared one.)
        "-chardev",
        "file,id=xerr,path=/proc/self/fd/2,append=on",
        "-device",
        &format!("virtserialport,bus=vser.0,chardev=xerr,name={ERR_PORT}"),
    ]
    .map(OsString::from)
    .into()
}

/// Set to anything to boot the guest with all kernel messages in console.log (and to keep the
/// run directory), for debugging the guest itself.
pub const DEBUG_ENV: &str = "RDMA_VERBS_VM_DEBUG";
/// The older name of [`DEBUG_ENV`] (from this project's `cargo xtask`), still read.
pub const DEBUG_ENV_OLD: &str = "XTASK_VM_DEBUG";

/// Whether [`DEBUG_ENV`] (or [`DEBUG_ENV_OLD`]) is set.
pub(super) fn debug() -> bool {
    crate::env_or_old(DEBUG_ENV, DEBUG_ENV_OLD).is_some()
}

/// The kernel command line: console on ttyS0 (the log file), quiet unless [`DEBUG_ENV`] is
/// set; no CPU vulnerability mitigations (a throwaway test guest; they slow emulation down).
fn kernel_cmdline() -> &'static str {
    if debug() {
        "console=ttyS0 loglevel=7 panic=-1 mitigations=off"
    } else {
        "console=ttyS0 quiet loglevel=4 panic=-1 mitigations=off"
    }
}

/// The concatenation of OS strings.
pub(super) fn concat(parts: &[&OsStr]) -> OsString {
    let mut s = OsString::new();
    for part in parts {
        s.push(part);
    }
    s
}

/// Doubles each comma, QEMU's escape inside an option value.
pub(super) fn escape_commas(s: &OsStr) -> OsString {
    let mut out = Vec::new();
    for &b in s.as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}
