//! Step 4's pieces: the runner crate's tests, run as a user's would, and the runner's
//! boot watchdog.

use std::path::Path;
use std::process::Command;

use rdma_verbs_vm::vm::BOOT_TIMEOUT_ENV;

use super::{Counts, RUNNER_CRATE, cargo, cargo_build, cargo_test_in_guests, runner_env_var};
use crate::EXIT_INFRA;
use crate::cmd;
use crate::setup;
use crate::{Context, Result};

/// `cargo test` in [`RUNNER_CRATE`], with the freshly built `rdma-verbs-vm` first on PATH
/// (its `.cargo/config.toml` names the runner by name, as a user's would).
pub(super) fn runner_crate_step(root: &Path, problems: &mut Vec<String>) -> Result<Counts> {
    let built = cargo_build(&mut runner_build(root))?;
    if !built.success {
        return Ok(built);
    }
    cargo_test_in_guests(&mut runner_crate_test(root)?, problems, &mut Vec::new())
}

/// `cargo build` of the runner, `rdma-verbs-vm`.
pub(super) fn runner_build(root: &Path) -> Command {
    let mut build = cargo(root);
    build.args([
        "build",
        "--package",
        "rdma-verbs-vm",
        "--bin",
        "rdma-verbs-vm",
    ]);
    build
}

/// `cargo test` in [`RUNNER_CRATE`], with target/debug (the runner) first on PATH.
pub(super) fn runner_crate_test(root: &Path) -> Result<Command> {
    let target = crate::target_dir();
    let bin_dir = target.join("debug");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let path =
        std::env::join_paths(std::iter::once(bin_dir.clone()).chain(std::env::split_paths(&path)))
            .context(|| format!("cannot put {} on PATH", bin_dir.display()))?;

    let mut test = cargo(&root.join(RUNNER_CRATE));
    test.args(["test", "--no-fail-fast"])
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", target.join("vm-runner-crate"))
        // The guest image xtask already built, rather than a second one in ~/.cache.
        .env(setup::DIR_ENV, setup::vm_dir())
        // The crate's own config must choose the runner, not an inherited override.
        .env_remove(runner_env_var()?);
    Ok(test)
}

/// The runner's boot watchdog: with a 1 s boot timeout (a boot takes ~3 s) `rdma-verbs-vm
/// run` must give up on the first boot, boot once more, give up again and exit with the boot
/// failure status, showing both consoles. Counted as one test.
pub(super) fn stuck_boot_check() -> Result<Counts> {
    let bin = crate::target_dir().join("debug").join("rdma-verbs-vm");
    eprintln!("xtask test: a stuck boot is retried once ({BOOT_TIMEOUT_ENV}=1)");
    let out = Command::new(&bin)
        .args(["run", "--", "/bin/true"])
        .env(BOOT_TIMEOUT_ENV, "1")
        .env(setup::DIR_ENV, setup::vm_dir())
        .output()
        .context(|| format!("cannot run {}", bin.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let gave_up = stderr
        .matches("did not start the command within 1 s")
        .count();
    let rebooted = stderr.matches("booting again").count();
    let ok = out.status.code() == Some(i32::from(EXIT_INFRA)) && gave_up == 2 && rebooted == 1;
    if !ok {
        eprintln!(
            "xtask test: FAILED: expected exit status {EXIT_INFRA}, two boots given up and one \
             retry; got {}, {gave_up}, {rebooted}:\n{stderr}",
            cmd::describe(out.status)
        );
    }
    Ok(Counts {
        passed: u64::from(ok),
        failed: u64::from(!ok),
        success: true,
    })
}
