//! The guest initramfs: busybox, the generic `/init` and the kernel modules in load order.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::kernel::Unpacked;
use super::siw::SIW_DEPENDENCIES;
use super::{GUEST_MODULES, file_name, private_name};
use crate::cmd::{output_checked, require_tool};
use crate::cpio::Archive;
use crate::{Context, Error, Result, vm};

/// Builds the initramfs: busybox, the generic `/init`, and the [`GUEST_MODULES`] with their
/// dependencies under `/mods` plus their load order in `/mods/order`. With `siw` (a module
/// built for this kernel), also the [`SIW_DEPENDENCIES`] and then siw itself, last.
pub(super) fn build_initramfs(
    tree: &Unpacked,
    busybox: &Path,
    siw: Option<&Path>,
    out: &Path,
) -> Result<()> {
    let mut wanted: Vec<&str> = GUEST_MODULES.to_vec();
    if siw.is_some() {
        wanted.extend_from_slice(SIW_DEPENDENCIES);
    }
    let mut modules = resolve_modules(tree, &wanted)?;
    modules.extend(siw.map(Path::to_path_buf));
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
fn resolve_modules(tree: &Unpacked, wanted: &[&str]) -> Result<Vec<PathBuf>> {
    let depmod = require_tool("depmod", "kmod")?;
    let modprobe = require_tool("modprobe", "kmod")?;
    output_checked(
        Command::new(depmod)
            .arg("-b")
            .arg(&tree.root)
            .arg(&tree.release),
    )?;
    let mut order: Vec<PathBuf> = Vec::new();
    for module in wanted {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_insmod_lines() {
        assert_eq!(module_path("/m/a.ko"), "/m/a.ko");
        assert_eq!(module_path("/m/a.ko.xz opt=1"), "/m/a.ko.xz");
        assert_eq!(
            module_name(Path::new("/m/crc32_generic.ko.zst")),
            "crc32_generic"
        );
    }
}
