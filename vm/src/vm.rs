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

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::cmd::{self, Waited};
use crate::run::Invocation;
use crate::setup::VmAssets;
use crate::{Context, EXIT_TIMEOUT, Error, Result, TIMEOUT_ENV};

mod pair;
mod scripts;
pub use pair::run_pair;
use scripts::{command_script, stage2_script};

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

/// How a guest is wired. The network setup, the QEMU network devices and the addresses the
/// command is told about all come from here.
#[derive(Clone, Copy, Debug)]
pub enum Topology {
    /// One guest, one veth pair (veth0 = 10.99.0.1/24), rxe0 on veth0; client and server run
    /// in the same guest and share rxe0, which loops packets back to itself.
    Loopback,
    /// One of two guests on a virtual wire (see [`run_pair`]): a virtio-net NIC (eth0 =
    /// 10.99.1.`node`/24) joined to the other guest's by QEMU's UDP socket netdev on
    /// 127.0.0.1, rxe0 on eth0. RoCE v2 packets cross both guests' network stacks, so
    /// `tc qdisc ... netem` and `ip link set eth0 down` on either side act on them.
    Wire {
        /// 1 or 2.
        node: u8,
        /// The UDP port on 127.0.0.1 this guest's NIC receives on.
        local_port: u16,
        /// The UDP port on 127.0.0.1 the other guest's NIC receives on.
        peer_port: u16,
    },
}

/// The address of node `node` (1 or 2) of a two-guest wire.
pub fn wire_addr(node: u8) -> String {
    format!("10.99.1.{node}")
}

impl Topology {
    /// Extra QEMU arguments for the guest's network devices: none for [`Topology::Loopback`]
    /// (`-nic none` stays), one virtio-net NIC on the UDP socket wire for [`Topology::Wire`]
    /// (only ever to 127.0.0.1, never to the outside).
    fn qemu_net_args(self) -> Vec<String> {
        match self {
            Topology::Loopback => Vec::new(),
            Topology::Wire {
                node,
                local_port,
                peer_port,
            } => vec![
                "-netdev".into(),
                format!("socket,id=n0,udp=127.0.0.1:{peer_port},localaddr=127.0.0.1:{local_port}"),
                "-device".into(),
                format!("virtio-net-pci,netdev=n0,romfile=,mac=52:54:00:99:01:{node:02x}"),
            ],
        }
    }

    /// CPUs of the guest: two for the lone guest, one each for two guests on a wire (the
    /// 2-core hosts this runs on would otherwise be oversubscribed).
    fn cpus(self) -> &'static str {
        match self {
            Topology::Loopback => "2",
            Topology::Wire { .. } => "1",
        }
    }

    /// `network.sh`: run by busybox sh in the initramfs before the command; brings the RDMA
    /// device up. Busybox does what it can (its static binary starts much faster under
    /// emulation than the host's dynamic ones); creating the veth pair (busybox's `ip` cannot)
    /// and the rxe link (rxe turns ACTIVE when its netdev goes up later) use the host's
    /// iproute2 through one chroot. Output goes to the console log.
    fn setup_script(self) -> String {
        let wait_active = "i=0\n\
             until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state; do\n\
             \x20 i=$((i + 1)); [ $i -lt 50 ] || { echo 'rxe0 port 1 is not ACTIVE'; exit 1; }\n\
             \x20 sleep 0.1\n\
             done\n";
        match self {
            Topology::Loopback => format!(
                "set -e\n\
                 ip link set lo up\n\
                 chroot /host /bin/sh -ec 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\n\
                 \x20 ip link add veth0 type veth peer name veth1\n\
                 \x20 rdma link add rxe0 type rxe netdev veth0'\n\
                 ip addr add 10.99.0.1/24 dev veth0\n\
                 ip link set veth0 up\n\
                 ip link set veth1 up\n\
                 {wait_active}"
            ),
            Topology::Wire { node, .. } => format!(
                "set -e\n\
                 ip link set lo up\n\
                 i=0\n\
                 until [ -e /sys/class/net/eth0 ]; do\n\
                 \x20 i=$((i + 1)); [ $i -lt 50 ] || {{ echo 'no eth0'; exit 1; }}\n\
                 \x20 sleep 0.1\n\
                 done\n\
                 chroot /host /bin/sh -ec 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\n\
                 \x20 rdma link add rxe0 type rxe netdev eth0'\n\
                 ip addr add {}/24 dev eth0\n\
                 ip link set eth0 up\n\
                 {wait_active}",
                wire_addr(node)
            ),
        }
    }

    /// Environment the command gets to find the device: name and local address, and on a
    /// wire the node number and the peer's address.
    pub fn guest_env(self) -> Vec<(&'static str, String)> {
        match self {
            Topology::Loopback => vec![
                ("RDMA_VERBS_DEVICE", "rxe0".into()),
                ("RDMA_VERBS_ADDR", "10.99.0.1".into()),
            ],
            Topology::Wire { node, .. } => vec![
                ("RDMA_VERBS_DEVICE", "rxe0".into()),
                ("RDMA_VERBS_NODE", node.to_string()),
                ("RDMA_VERBS_ADDR", wire_addr(node)),
                ("RDMA_VERBS_PEER", wire_addr(3 - node)),
            ],
        }
    }
}

/// Why a guest run failed, for callers that keep count (see `XTASK_VM_REPORT` in `run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The time limit passed; QEMU was killed.
    Timeout,
    /// QEMU did not start, or the guest did not get as far as reporting an exit status.
    Boot,
}

/// Where a guest's output goes.
#[derive(Clone, Debug)]
enum Output {
    /// Straight to our stdout and stderr.
    Inherit,
    /// To our stdout and stderr, each line prefixed (`[node1] `).
    Prefixed(String),
}

/// A started guest: QEMU and the threads that forward its output.
struct Guest {
    child: Child,
    run_dir: RunDir,
    /// Kept open while the guest runs: at EOF QEMU would mark the stdio chardev closed.
    stdin: Option<ChildStdin>,
    forwarders: Vec<thread::JoinHandle<()>>,
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
    for (name, value) in topology.guest_env() {
        env.retain(|(n, _)| n != name);
        env.push((name.into(), value.into()));
    }
    write(&run_dir.path.join("command.sh"), &command_script(inv, &env)).map_err(boot)?;
    write(
        &run_dir.path.join("network.sh"),
        topology.setup_script().as_bytes(),
    )
    .map_err(boot)?;
    write(
        &run_dir.path.join("stage2.sh"),
        &stage2_script(&run_dir.path, &shared, &writable),
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

/// A thread copying `from` to our stdout (`to_stdout`) or stderr, prefixing each line for
/// [`Output::Prefixed`]. A line is written with one call, so lines of two guests never mix.
fn forward(
    mut from: impl io::Read + Send + 'static,
    output: Output,
    to_stdout: bool,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let prefix = match output {
            Output::Inherit => {
                let _ = if to_stdout {
                    io::copy(&mut from, &mut io::stdout())
                } else {
                    io::copy(&mut from, &mut io::stderr())
                };
                return;
            }
            Output::Prefixed(prefix) => prefix,
        };
        let mut reader = io::BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match io::BufRead::read_until(&mut reader, b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let mut out = prefix.as_bytes().to_vec();
            out.extend_from_slice(&line);
            if !out.ends_with(b"\n") {
                out.push(b'\n');
            }
            let _ = if to_stdout {
                io::Write::write_all(&mut io::stdout().lock(), &out)
            } else {
                io::Write::write_all(&mut io::stderr().lock(), &out)
            };
        }
    })
}

/// How far a guest got within the boot timeout.
enum Boot {
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
    fn wait_for_start(&mut self, boot: Duration) -> Result<Boot> {
        let deadline = Instant::now() + boot;
        loop {
            if let Some(status) = self
                .child
                .try_wait()
                .context(|| "cannot wait for QEMU".into())?
            {
                return Ok(Boot::Exited(status));
            }
            if self.started() {
                return Ok(Boot::Started);
            }
            if Instant::now() >= deadline {
                return Ok(Boot::Stuck);
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
            Boot::Exited(status) => return guest.finish(Waited::Exited(status), timeout),
            Boot::Started => {
                let waited = cmd::wait_with_deadline(&mut guest.child, timeout)
                    .map_err(|e| (Failure::Boot, e))?;
                return guest.finish(waited, timeout);
            }
            Boot::Stuck => {
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

/// Guest memory in MiB: `RDMA_VERBS_VM_MEM_MB` (at least 1024), else 2048.
/// More lets `benches/mr_reg.rs` register 1 GiB.
fn memory_mb() -> String {
    std::env::var("RDMA_VERBS_VM_MEM_MB")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|&mb| mb >= 1024)
        .unwrap_or(2048)
        .to_string()
}

/// The QEMU command line: TCG, q35, no outside NIC, PVH boot of the uncompressed kernel.
fn qemu_args(
    assets: &VmAssets,
    run_dir: &Path,
    shared: &[&str],
    writable: &[PathBuf],
    topology: Topology,
) -> Vec<OsString> {
    let mut a: Vec<OsString> = [
        "-accel",
        "tcg",
        "-machine",
        "q35",
        "-m",
        &memory_mb(),
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
    a.push("-kernel".into());
    a.push(assets.vmlinux.clone().into());
    a.push("-initrd".into());
    a.push(assets.initramfs.clone().into());
    a.push("-serial".into());
    a.push(concat(&[
        "file:".as_ref(),
        run_dir.join("console.log").as_os_str(),
    ]));
    a.push("-virtfs".into());
    a.push(
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap".into(),
    );
    a.push("-virtfs".into());
    a.push(concat(&[
        "local,path=".as_ref(),
        &escape_commas(run_dir.as_os_str()),
        ",mount_tag=".as_ref(),
        RUN_SHARE_TAG.as_ref(),
        ",security_model=none".as_ref(),
    ]));
    for dir in shared {
        a.push("-virtfs".into());
        a.push(
            format!(
                "local,path={dir},mount_tag={},security_model=none,multidevs=remap",
                share_tag(dir)
            )
            .into(),
        );
    }
    for (i, dir) in writable.iter().enumerate() {
        a.push("-virtfs".into());
        a.push(concat(&[
            "local,path=".as_ref(),
            &escape_commas(dir.as_os_str()),
            format!(
                ",mount_tag={},security_model=none,multidevs=remap",
                writable_tag(i)
            )
            .as_ref(),
        ]));
    }
    a.extend(
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
        .map(OsString::from),
    );
    a.extend(topology.qemu_net_args().into_iter().map(OsString::from));
    a
}

/// Set to anything to boot the guest with all kernel messages in console.log (and to keep the
/// run directory), for debugging the guest itself.
pub const DEBUG_ENV: &str = "RDMA_VERBS_VM_DEBUG";
/// The older name of [`DEBUG_ENV`] (from this project's `cargo xtask`), still read.
pub const DEBUG_ENV_OLD: &str = "XTASK_VM_DEBUG";

/// Whether [`DEBUG_ENV`] (or [`DEBUG_ENV_OLD`]) is set.
fn debug() -> bool {
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
fn concat(parts: &[&OsStr]) -> OsString {
    let mut s = OsString::new();
    for part in parts {
        s.push(part);
    }
    s
}

/// Doubles each comma, QEMU's escape inside an option value.
fn escape_commas(s: &OsStr) -> OsString {
    let mut out = Vec::new();
    for &b in s.as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    OsString::from_vec(out)
}

/// 9p tag for a shared host directory: `host_tmp` for /tmp.
fn share_tag(dir: &str) -> String {
    format!("host_{}", dir.trim_start_matches('/'))
}

/// Environment variable: colon-separated host directories the guest may write to.
pub const WRITABLE_ENV: &str = "RDMA_VERBS_VM_WRITABLE";

/// 9p tag of the `i`-th [`WRITABLE_ENV`] directory.
fn writable_tag(i: usize) -> String {
    format!("rw{i}")
}

/// The [`WRITABLE_ENV`] directories, canonical, without duplicates, parents first (so a
/// directory shared inside another one is mounted over it).
fn writable_dirs() -> Result<Vec<PathBuf>> {
    let Some(value) = std::env::var_os(WRITABLE_ENV) else {
        return Ok(Vec::new());
    };
    let mut dirs = Vec::new();
    for dir in std::env::split_paths(&value).filter(|d| !d.as_os_str().is_empty()) {
        let canonical = dir.canonicalize().context(|| {
            format!(
                "{WRITABLE_ENV}: cannot share {} with the guest",
                dir.display()
            )
        })?;
        if !canonical.is_dir() {
            return Err(Error::new(format!(
                "{WRITABLE_ENV}: {} is not a directory",
                dir.display()
            )));
        }
        if !dirs.contains(&canonical) {
            dirs.push(canonical);
        }
    }
    dirs.sort_by_key(|d: &PathBuf| d.components().count());
    Ok(dirs)
}

/// Host directories that the guest normally covers with a tmpfs (`/tmp`, `/run`) but must
/// share instead, because the working directory, the program, cargo's target directory, an
/// absolute-path argument or an environment value lies inside them (e.g. a clone under /tmp).
fn host_dirs_to_share(inv: &Invocation, target_dir: &Path) -> Vec<&'static str> {
    let mut needed: Vec<&OsStr> = vec![
        inv.cwd.as_os_str(),
        inv.program.as_os_str(),
        target_dir.as_os_str(),
    ];
    let resolved = inv.resolved_program();
    if let Some(p) = &resolved {
        needed.push(p.as_os_str());
    }
    needed.extend(inv.args.iter().map(OsString::as_os_str));
    needed.extend(inv.env.iter().map(|(_, v)| v.as_os_str()));
    ["/tmp", "/run"]
        .into_iter()
        .filter(|dir| needed.iter().any(|p| Path::new(p).starts_with(dir)))
        .collect()
}

/// The last `n` lines of the console log, or a note that there is none.
fn console_tail(path: &Path, n: usize) -> String {
    match fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes).replace('\r', "");
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(n)..].join("\n");
            if tail.is_empty() {
                "(empty: the kernel printed nothing)".into()
            } else {
                tail
            }
        }
        Err(_) => "(no console log: QEMU did not start)".into(),
    }
}

/// Writes a file, with the path in the error.
fn write(path: &Path, bytes: &[u8]) -> std::result::Result<(), Error> {
    fs::write(path, bytes).context(|| format!("cannot write {}", path.display()))
}

/// A per-run directory `<cache>/runs/<pid>-<n>`, shared read-write with the guest; removed on
/// drop unless [`keep`](Self::keep) was called (then it stays until a later run cleans it).
struct RunDir {
    path: PathBuf,
    keep: bool,
}

impl RunDir {
    /// Creates a fresh run directory (after removing those of dead processes).
    fn create(cache: &Path) -> Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let runs = cache.join("runs");
        remove_stale_runs(&runs);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = runs.join(format!("{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { path, keep: false })
    }

    /// Leaves the directory in place for inspection.
    fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        if !self.keep && !debug() {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

/// Removes run directories whose process is gone.
fn remove_stale_runs(runs: &Path) {
    let Ok(entries) = fs::read_dir(runs) else {
        return;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !crate::pid_alive(name.split('-').next().unwrap_or_default()) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(sh_n(Topology::Loopback.setup_script().as_bytes()));
        let wire = Topology::Wire {
            node: 2,
            local_port: 1,
            peer_port: 2,
        };
        assert!(sh_n(wire.setup_script().as_bytes()));
        assert!(
            wire.setup_script()
                .contains("ip addr add 10.99.1.2/24 dev eth0")
        );
        let writable = [PathBuf::from("/w/it's"), PathBuf::from("/tmp/x")];
        for shared in [&[][..], &["/tmp"], &["/tmp", "/run"]] {
            let script = stage2_script(Path::new("/a b/it's"), shared, &writable);
            assert!(sh_n(&script), "{}", String::from_utf8_lossy(&script));
        }
    }

    #[test]
    fn stage2_marks_the_start_right_before_the_command() {
        let script = stage2_script(Path::new("/r"), &[], &[]);
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
    fn commas_are_doubled() {
        assert_eq!(escape_commas(OsStr::new("/a,b")), "/a,,b");
    }
}
