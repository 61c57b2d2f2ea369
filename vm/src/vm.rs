//! Booting a soft-RoCE guest under QEMU and running one command in it.
//!
//! The guest is a Debian kernel with a busybox initramfs (see [`crate::setup`]). It sees the
//! host's files at the same paths, so host-built programs run unchanged:
//!
//! ```text
//! host                                  guest
//! /               9p "hostroot", ro  -> /host, then chroot /host
//! <run dir>       9p "xrun", rw      -> /xrun, and bound at <run dir> inside /host
//! /tmp, /run      9p, rw, only when a path the command needs lies there; tmpfs otherwise
//! $RDMA_VERBS_VM_WRITABLE dirs  9p, rw  -> the same paths inside /host
//! our stdout      virtio port "vm-out"  <- the command's stdout
//! our stderr      virtio port "vm-err"  <- the command's stderr (via a pipe and a thread)
//! <run dir>/console.log  ttyS0: kernel and init messages, shown only when something fails
//! ```
//!
//! Boot sequence: the cached, generic [`INIT_SCRIPT`] loads the modules, mounts the per-run
//! share and runs `stage2.sh` from it. `stage2.sh`, written here for each run, mounts the host,
//! sets up the network of the [`Topology`], creates `started` in the share, runs `command.sh`
//! chrooted into the host with its output on the two virtio ports, writes the exit status to
//! `exit-status` in the share and powers off. The host then reads that file: no file means
//! the guest never got that far.
//!
//! A guest that has not created `started` within the boot timeout ([`BOOT_TIMEOUT_ENV`]) is
//! killed and booted once more (a boot takes seconds; a rare one hangs), so a stuck boot
//! costs minutes, not the command's whole time limit. The command's time limit counts from
//! `started`. Whenever a run fails, its directory (with `console.log`) is kept and the
//! console's last lines are shown.
//!
//! The command's output never mixes with kernel messages (those go to console.log), and the
//! virtio ports are byte-clean (no tty layer adding `\r`).

use std::ffi::OsString;
use std::fs;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::cmd::{self, Waited};
use crate::run::Invocation;
use crate::setup::VmAssets;
use crate::{Context, EXIT_TIMEOUT, Error, Result, TIMEOUT_ENV};

mod nodes;
mod output;
mod qemu;
mod run_dir;
mod scripts;
mod shares;
mod switch;
mod topology;
pub use nodes::{MAX_NODES, Outcome, run_nodes, run_pair};
use output::{Output, forward};
use qemu::qemu_args;
pub use qemu::{DEBUG_ENV, DEBUG_ENV_OLD};
use run_dir::{RunDir, console_tail};
use scripts::{command_script, stage2_script};

use crate::choice::{RDMA_CORE_ENV, RdmaCore};
pub use shares::WRITABLE_ENV;
use shares::{host_dirs_to_share, writable_dirs};
pub use topology::{Topology, wire_addr};

/// Where the initramfs mounts the per-run share (9p tag `xrun`).
pub const RUN_SHARE_DIR: &str = "/xrun";
/// 9p tag of the per-run share.
const RUN_SHARE_TAG: &str = "xrun";
/// File in the per-run share that holds the command's exit status when it has finished.
const EXIT_STATUS_FILE: &str = "exit-status";
/// File in the per-run share that `stage2.sh` creates right before it runs the command.
const STARTED_FILE: &str = "started";
/// How long a guest may take to boot and start the command before it counts as stuck
/// (`RDMA_VERBS_VM_BOOT_TIMEOUT`, seconds). A boot takes about 3 s under TCG on a 2-core
/// host; the default leaves room for a heavily loaded one.
pub const BOOT_TIMEOUT_ENV: &str = "RDMA_VERBS_VM_BOOT_TIMEOUT";
/// Default of [`BOOT_TIMEOUT_ENV`].
const DEFAULT_BOOT_TIMEOUT: Duration = Duration::from_secs(120);
/// Boots tried before a guest that never starts the command is reported as a boot failure.
const BOOT_ATTEMPTS: u32 = 2;
/// virtio-serial port name of the command's stdout.
const OUT_PORT: &str = "vm-out";
/// virtio-serial port name of the command's stderr.
const ERR_PORT: &str = "vm-err";
/// 9p options: version 9p2000.L over virtio, with the largest message size 6.1's virtio
/// transport takes (fewer round trips when loading large test binaries).
const NINEP_OPTS: &str = "trans=virtio,version=9p2000.L,msize=512000";

/// The guest's `/init`: generic, cached in the initramfs; everything specific to one run lives
/// in the `stage2.sh` that [`run`] writes into the per-run share.
pub const INIT_SCRIPT: &str = r#"#!/bin/busybox sh
# xtask guest init: load the modules, mount the per-run share, run its stage2.sh, power off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /mods/order); do
  insmod /mods/$m || echo "xtask-init: insmod $m failed"
done
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 xrun /xrun
then
  sh /xrun/stage2.sh
  echo "xtask-init: stage2.sh ended with status $?"
else
  echo "xtask-init: cannot mount the per-run share"
fi
poweroff -f
"#;

/// Why a guest run failed, for callers that keep count (see `XTASK_VM_REPORT` in `run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The time limit passed; QEMU was killed.
    Timeout,
    /// QEMU did not start, or the guest did not get as far as reporting an exit status.
    Boot,
}

/// A started guest: QEMU and the threads that forward its output.
struct Guest {
    child: Child,
    run_dir: RunDir,
    /// Kept open while the guest runs: at EOF QEMU would mark the stdio chardev closed.
    stdin: Option<ChildStdin>,
    forwarders: Vec<thread::JoinHandle<()>>,
}

/// Points valgrind at the symbols of the C library another rdma-core brings (see
/// `setup::VALGRIND_DEBUGINFO`), after any `VALGRIND_OPTS` of the caller's.
fn valgrind_finds_debuginfo(env: &mut Vec<(OsString, OsString)>, assets: &VmAssets) {
    let dir = assets
        .dir
        .join(format!("rdma-core-{}", assets.choice.rdma_core))
        .join(crate::setup::VALGRIND_DEBUGINFO);
    if !dir.is_dir() {
        return;
    }
    let mut opts = env
        .iter()
        .find(|(n, _)| n == "VALGRIND_OPTS")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    env.retain(|(n, _)| n != "VALGRIND_OPTS");
    if !opts.is_empty() {
        opts.push(" ");
    }
    opts.push("--extra-debuginfo-path=");
    opts.push(dir.as_os_str());
    env.push(("VALGRIND_OPTS".into(), opts));
}

/// Writes the per-run scripts and starts QEMU for `inv` on `topology`.
fn start(
    assets: &VmAssets,
    inv: &Invocation,
    topology: Topology,
    output: Output,
) -> std::result::Result<Guest, (Failure, Error)> {
    let boot = |e: Error| (Failure::Boot, e);
    let run_dir = RunDir::create(&assets.dir).map_err(boot)?;
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| inv.cwd.clone(), |d| inv.cwd.join(d));
    let shared = host_dirs_to_share(inv, &target_dir);
    let writable = writable_dirs().map_err(boot)?;

    let mut env = inv.env.clone();
    for (name, value) in topology.guest_env(assets.choice.provider) {
        env.retain(|(n, _)| n != name);
        env.push((name.into(), value.into()));
    }
    if assets.choice.rdma_core != RdmaCore::Host {
        // Tells the guest's tests which userland they run on.
        env.retain(|(n, _)| n != RDMA_CORE_ENV);
        env.push((
            RDMA_CORE_ENV.into(),
            assets.choice.rdma_core.to_string().into(),
        ));
        valgrind_finds_debuginfo(&mut env, assets);
    }
    write(&run_dir.path.join("command.sh"), &command_script(inv, &env)).map_err(boot)?;
    write(
        &run_dir.path.join("network.sh"),
        topology.setup_script(assets.choice.provider).as_bytes(),
    )
    .map_err(boot)?;
    write(
        &run_dir.path.join("stage2.sh"),
        &stage2_script(&run_dir.path, &shared, &writable, &assets.overlays),
    )
    .map_err(boot)?;

    let mut qemu = Command::new("qemu-system-x86_64");
    // stdin is a pipe that stays open and silent: at EOF (say, from /dev/null) QEMU would mark
    // the stdio chardev closed, and the guest's writes to the stdout port would block forever.
    qemu.args(qemu_args(
        assets,
        &run_dir.path,
        &shared,
        &writable,
        topology,
    ))
    .stdin(Stdio::piped())
    .stderr(Stdio::piped());
    match output {
        Output::Inherit => qemu.stdout(Stdio::inherit()),
        Output::Prefixed(_) => qemu.stdout(Stdio::piped()),
    };
    let mut child = qemu.spawn().map_err(|e| {
        boot(Error::new(format!(
            "cannot start qemu-system-x86_64 (package qemu-system-x86): {e}"
        )))
    })?;
    let mut forwarders = Vec::new();
    // QEMU's stderr carries the command's stderr port and QEMU's own messages.
    if let Some(from) = child.stderr.take() {
        forwarders.push(forward(from, output.clone(), false));
    }
    if let Some(from) = child.stdout.take() {
        forwarders.push(forward(from, output, true));
    }
    let stdin = child.stdin.take();
    Ok(Guest {
        child,
        run_dir,
        stdin,
        forwarders,
    })
}

/// How far a guest got within the boot timeout.
enum BootProgress {
    /// `stage2.sh` started the command.
    Started,
    /// QEMU exited first.
    Exited(std::process::ExitStatus),
    /// Neither: the guest is stuck before the command.
    Stuck,
}

/// The boot timeout: [`BOOT_TIMEOUT_ENV`] seconds, else [`DEFAULT_BOOT_TIMEOUT`].
fn boot_timeout() -> Result<Duration> {
    match std::env::var_os(BOOT_TIMEOUT_ENV) {
        Some(v) => crate::parse_secs(&v.to_string_lossy())
            .map_err(|e| Error::usage(format!("{BOOT_TIMEOUT_ENV}: {e}"))),
        None => Ok(DEFAULT_BOOT_TIMEOUT),
    }
}

impl Guest {
    /// Whether `stage2.sh` has started the command.
    fn started(&self) -> bool {
        self.run_dir.path.join(STARTED_FILE).exists()
    }

    /// Waits until the command has started, QEMU has exited, or `boot` has passed.
    fn wait_for_start(&mut self, boot: Duration) -> Result<BootProgress> {
        let deadline = Instant::now() + boot;
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .context(|| "cannot wait for QEMU".into())?
            {
                return Ok(BootProgress::Exited(status));
            }
            if self.started() {
                return Ok(BootProgress::Started);
            }
            if Instant::now() >= deadline {
                return Ok(BootProgress::Stuck);
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills QEMU (if it still runs) and waits for the output to drain.
    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        drop(self.stdin.take());
        for forwarder in self.forwarders.drain(..) {
            let _ = forwarder.join();
        }
    }

    /// Keeps the run directory and describes the console's last lines.
    fn keep_console(self) -> String {
        let console = self.run_dir.path.join("console.log");
        let tail = console_tail(&console, 40);
        self.run_dir.keep();
        format!("last console lines ({}):\n{tail}", console.display())
    }

    /// Kills a guest stuck before its command; the error shows its console.
    fn abandon(mut self, boot: Duration) -> Error {
        self.stop();
        Error::new(format!(
            "the guest did not start the command within {} s (set {BOOT_TIMEOUT_ENV} to wait \
             longer); {}",
            boot.as_secs(),
            self.keep_console()
        ))
    }

    /// The command's exit status once QEMU has exited (`status`), or why there is none.
    fn finish(
        mut self,
        waited: Waited,
        timeout: Duration,
    ) -> std::result::Result<u8, (Failure, Error)> {
        let boot = |e: Error| (Failure::Boot, e);
        self.stop();
        let status = match waited {
            Waited::TimedOut => {
                let started = if self.started() {
                    "the command had started"
                } else {
                    "the command had not started"
                };
                return Err((
                    Failure::Timeout,
                    Error {
                        message: format!(
                            "timed out after {} s (the guest was killed; {started}; --timeout \
                             SECS or {TIMEOUT_ENV}=SECS raises the limit); {}",
                            timeout.as_secs(),
                            self.keep_console()
                        ),
                        code: EXIT_TIMEOUT,
                    },
                ));
            }
            Waited::Exited(status) => status,
        };
        match fs::read_to_string(self.run_dir.path.join(EXIT_STATUS_FILE)) {
            Ok(s) => s
                .trim()
                .parse::<u8>()
                .map_err(|_| boot(Error::new(format!("bad exit status from the guest: {s:?}")))),
            Err(_) => Err(boot(Error::new(format!(
                "the guest did not report an exit status (QEMU: {}), so the command did not \
                 run to completion; {}",
                cmd::describe(status),
                self.keep_console()
            )))),
        }
    }
}

/// Boots one guest, runs `inv` in it with the [`Topology::guest_env`] variables added, and
/// returns its exit status. Its stdout and stderr stream to ours as they come. `timeout`
/// counts from the command's start; a guest stuck before it is booted again (see the
/// module documentation).
pub fn run(
    assets: &VmAssets,
    inv: &Invocation,
    topology: Topology,
    timeout: Duration,
) -> std::result::Result<u8, (Failure, Error)> {
    let boot = boot_timeout().map_err(|e| (Failure::Boot, e))?;
    let mut attempt = 1;
    loop {
        let mut guest = start(assets, inv, topology, Output::Inherit)?;
        match guest.wait_for_start(boot).map_err(|e| (Failure::Boot, e))? {
            BootProgress::Exited(status) => return guest.finish(Waited::Exited(status), timeout),
            BootProgress::Started => {
                let waited = cmd::wait_with_deadline(&mut guest.child, timeout)
                    .map_err(|e| (Failure::Boot, e))?;
                return guest.finish(waited, timeout);
            }
            BootProgress::Stuck => {
                let e = guest.abandon(boot);
                if attempt == BOOT_ATTEMPTS {
                    return Err((Failure::Boot, e));
                }
                eprintln!("rdma-verbs-vm: {}\nrdma-verbs-vm: booting again", e.message);
                attempt += 1;
            }
        }
    }
}

/// Writes a file, with the path in the error.
fn write(path: &Path, bytes: &[u8]) -> std::result::Result<(), Error> {
    fs::write(path, bytes).context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::qemu::escape_commas;
    use super::*;
    use crate::choice::Provider;
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    use std::path::PathBuf;

    fn inv(cwd: &str, program: &str) -> Invocation {
        Invocation {
            program: program.into(),
            args: vec!["--flag".into()],
            cwd: cwd.into(),
            env: vec![("RDMA_VERBS_X".into(), "it's".into())],
        }
    }

    #[test]
    fn shares_tmp_only_when_needed() {
        let share =
            |cwd, program, target: &str| host_dirs_to_share(&inv(cwd, program), target.as_ref());
        assert!(share("/work/x", "/usr/bin/true", "/work/x/target").is_empty());
        assert_eq!(share("/tmp/clone", "/usr/bin/true", "/work/t"), ["/tmp"]);
        assert_eq!(share("/", "/run/x/prog", "/work/t"), ["/run"]);
        assert_eq!(share("/", "true", "/tmp/target"), ["/tmp"]);
        assert!(share("/tmpfoo", "/usr/bin/true", "/work/t").is_empty());
    }

    #[test]
    fn command_script_quotes_everything() {
        let i = inv("/a b", "prog");
        let s = String::from_utf8(command_script(&i, &i.env)).unwrap_or_default();
        assert!(s.contains("cd '/a b' || exit 125"));
        assert!(s.contains("'RDMA_VERBS_X=it'\\''s'"));
        assert!(s.ends_with("'prog' '--flag'\n"));
    }

    #[test]
    fn scripts_are_valid_shell() {
        let sh_n = |script: &[u8]| {
            Command::new("sh")
                .args(["-n", "-c"])
                .arg(OsStr::from_bytes(script))
                .status()
                .is_ok_and(|st| st.success())
        };
        assert!(sh_n(INIT_SCRIPT.as_bytes()));
        assert!(sh_n(
            Topology::Loopback.setup_script(Provider::Rxe).as_bytes()
        ));
        let wire = Topology::Wire {
            node: 2,
            local_port: 1,
            peer_port: 2,
        };
        assert!(sh_n(wire.setup_script(Provider::Siw).as_bytes()));
        assert!(
            wire.setup_script(Provider::Siw)
                .contains("rdma link add siw0 type siw netdev eth0")
        );
        assert!(
            wire.setup_script(Provider::Rxe)
                .contains("ip addr add 10.99.1.2/24 dev eth0")
        );
        let switch = Topology::Switch {
            node: 3,
            nodes: 4,
            local_port: 1,
            switch_port: 2,
        };
        assert!(sh_n(switch.setup_script(Provider::Rxe).as_bytes()));
        assert!(
            switch
                .setup_script(Provider::Rxe)
                .contains("ip addr add 10.99.1.3/24 dev eth0")
        );
        let writable = [PathBuf::from("/w/it's"), PathBuf::from("/tmp/x")];
        for shared in [&[][..], &["/tmp"], &["/tmp", "/run"]] {
            let script = stage2_script(Path::new("/a b/it's"), shared, &writable, &[]);
            assert!(sh_n(&script), "{}", String::from_utf8_lossy(&script));
        }
    }

    /// Shared `/tmp` and the writable directories take `cache=mmap` (9p refuses
    /// a shared writable mapping without it); the read-only root does not.
    #[test]
    fn writable_shares_take_shared_writable_mappings() {
        let script = stage2_script(Path::new("/r"), &["/tmp"], &[PathBuf::from("/w")], &[]);
        let script = String::from_utf8_lossy(&script);
        let mounts: Vec<&str> = script.lines().filter(|l| l.contains("-t 9p")).collect();
        let with = |needle: &str| mounts.iter().find(|l| l.contains(needle)).copied();
        assert!(
            with(" host_tmp ").is_some_and(|l| l.contains("cache=mmap")),
            "{mounts:?}"
        );
        assert!(
            with(" rw0 ").is_some_and(|l| l.contains("cache=mmap")),
            "{mounts:?}"
        );
        assert!(
            with(" hostroot ").is_some_and(|l| !l.contains("cache=mmap")),
            "{mounts:?}"
        );
    }

    #[test]
    fn stage2_marks_the_start_right_before_the_command() {
        let script = stage2_script(Path::new("/r"), &[], &[], &[]);
        let script = String::from_utf8_lossy(&script);
        let lines: Vec<&str> = script.lines().collect();
        let marker = format!(": > {RUN_SHARE_DIR}/{STARTED_FILE}");
        let at = lines
            .iter()
            .position(|l| *l == marker)
            .expect("marker line");
        assert!(lines[at + 1].starts_with("chroot /host "), "{script}");
    }

    #[test]
    fn init_script_matches_the_constants() {
        let mount = format!("mount -t 9p -o {NINEP_OPTS} {RUN_SHARE_TAG} {RUN_SHARE_DIR}\n");
        assert!(INIT_SCRIPT.contains(&mount));
        assert!(INIT_SCRIPT.contains(&format!("sh {RUN_SHARE_DIR}/stage2.sh")));
    }

    #[test]
    fn nodes_are_told_their_peers() {
        let env = |t: Topology| t.guest_env(Provider::Rxe).into_iter().collect::<Vec<_>>();
        let get = |e: &[(&str, String)], n: &str| {
            e.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let switch = |node| Topology::Switch {
            node,
            nodes: 4,
            local_port: 1,
            switch_port: 2,
        };
        let third = env(switch(3));
        assert_eq!(get(&third, "RDMA_VERBS_ADDR"), "10.99.1.3");
        assert_eq!(get(&third, "RDMA_VERBS_PEER"), "10.99.1.4");
        assert_eq!(get(&third, "RDMA_VERBS_NODES"), "4");
        assert_eq!(
            get(&third, "RDMA_VERBS_PEERS"),
            "10.99.1.1 10.99.1.2 10.99.1.4"
        );
        assert_eq!(get(&env(switch(4)), "RDMA_VERBS_PEER"), "10.99.1.1");
        let wire = env(Topology::Wire {
            node: 2,
            local_port: 1,
            peer_port: 2,
        });
        assert_eq!(get(&wire, "RDMA_VERBS_PEER"), "10.99.1.1");
        assert_eq!(get(&wire, "RDMA_VERBS_PEERS"), "10.99.1.1");
        assert_eq!(get(&wire, "RDMA_VERBS_NODES"), "2");
    }

    #[test]
    fn commas_are_doubled() {
        assert_eq!(escape_commas(OsStr::new("/a,b")), "/a,,b");
    }
}
