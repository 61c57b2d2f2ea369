//! `cargo xtask gpu-check`: the GPUDirect check for a machine with an NVIDIA GPU.
//!
//! Builds and runs `examples/gpu_check.rs` (feature `gdr`) directly on the host: the
//! soft-RoCE guest has no GPU. Exit status is the example's: 0 all checks that could run
//! passed, 1 a check failed, 2 no CUDA driver or GPU.

use std::ffi::OsString;
use std::process::Command;

use crate::{Error, Result};

/// Runs the check, passing `args` to the example.
pub fn gpu_check_command(args: Vec<OsString>) -> Result<u8> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .args([
            "run",
            "--release",
            "--features",
            "gdr",
            "--example",
            "gpu_check",
            "--",
        ])
        .args(args)
        .status()
        .map_err(|e| Error::new(format!("could not run cargo: {e}")))?;
    Ok(status
        .code()
        .map_or(crate::EXIT_INFRA, |c| u8::try_from(c).unwrap_or(1)))
}
