//! The host side of `setup`: the Debian packages it needs and the static busybox.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::PACKAGES;
use crate::cmd::{self, run_checked};
use crate::{Context, Error, Result};

/// Installs the [`PACKAGES`] and `extra` that `dpkg-query` does not report as installed.
pub(super) fn ensure_packages(extra: &[&str]) -> Result<()> {
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
pub(super) fn apt(args: &[&str]) -> Command {
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
pub(super) fn busybox() -> Result<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
