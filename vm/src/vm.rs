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
//! sets up the network of the [`Topology`], runs `command.sh` chrooted into the host with its
//! output on the two virtio ports, writes the exit status to `exit-status` in the share and
//! powers off. The host then reads that file: no file means the guest never got that far.
//!
//! The command's output never mixes with kernel messages (those go to console.log), and the
//! virtio ports are byte-clean (no tty layer adding `\r`).

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;
use std::time::Duration;

use crate::cmd::{self, Waited, push_quoted};
use crate::run::Invocation;
use crate::setup::VmAssets;
use crate::{Context, EXIT_TIMEOUT, Error, Result};

/// Where the initramfs mounts the per-run share (9p tag `xrun`).
pub const RUN_SHARE_DIR: &str = "/xrun";
/// 9p tag of the per-run share.
const RUN_SHARE_TAG: &str = "xrun";
/// File in the per-run share that holds the command's exit status when it has finished.
const EXIT_STATUS_FILE: &str = "exit-status";
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

/// How the guest (or, later, guests) are wired. The network setup, the QEMU network devices
/// and the address the command is told about all come from here.
///
/// Only one topology exists. A two-guest mode (real traffic between two kernels, see
/// "Two guests on a virtual wire" in RXE-VM.md) would add a variant here whose
/// `qemu_net_args` adds a `virtio-net-pci` joined to the peer by a
/// `-netdev socket,udp=127.0.0.1:...` pair, whose `setup_script` puts rxe
/// on eth0, and a caller that boots both guests and waits for both.
#[derive(Clone, Copy, Debug)]
pub enum Topology {
    /// One guest, one veth pair (veth0 = 10.99.0.1/24), rxe0 on veth0; client and server run
    /// in the same guest and share rxe0, which loops packets back to itself.
    Loopback,
}

impl Topology {
    /// Extra QEMU arguments for the guest's network devices (none: `-nic none` stays).
    fn qemu_net_args(self) -> Vec<String> {
        match self {
            Topology::Loopback => Vec::new(),
        }
    }

    /// `network.sh`: run by busybox sh in the initramfs before the command; brings the RDMA
    /// device up. Busybox does what it can (its static binary starts much faster under
    /// emulation than the host's dynamic ones); creating the veth pair (busybox's `ip` cannot)
    /// and the rxe link (rxe turns ACTIVE when veth0 goes up later) use the host's iproute2
    /// through one chroot. Output goes to the console log.
    fn setup_script(self) -> &'static str {
        match self {
            Topology::Loopback => {
                "set -e\n\
                 ip link set lo up\n\
                 chroot /host /bin/sh -ec 'PATH=/usr/sbin:/usr/bin:/sbin:/bin\n\
                 \x20 ip link add veth0 type veth peer name veth1\n\
                 \x20 rdma link add rxe0 type rxe netdev veth0'\n\
                 ip addr add 10.99.0.1/24 dev veth0\n\
                 ip link set veth0 up\n\
                 ip link set veth1 up\n\
                 i=0\n\
                 until grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state; do\n\
                 \x20 i=$((i + 1)); [ $i -lt 50 ] || { echo 'rxe0 port 1 is not ACTIVE'; exit 1; }\n\
                 \x20 sleep 0.1\n\
                 done\n"
            }
        }
    }

    /// Environment the command gets to find the device: name and local address.
    pub fn guest_env(self) -> [(&'static str, &'static str); 2] {
        match self {
            Topology::Loopback => [
                ("RDMA_VERBS_DEVICE", "rxe0"),
                ("RDMA_VERBS_ADDR", "10.99.0.1"),
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

/// Boots one guest, runs `inv` in it with the [`Topology::guest_env`] variables added, and
/// returns its exit status. Its stdout and stderr stream to ours as they come.
pub fn run(
    assets: &VmAssets,
    inv: &Invocation,
    topology: Topology,
    timeout: Duration,
) -> std::result::Result<u8, (Failure, Error)> {
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
    .stdout(Stdio::inherit())
    .stderr(Stdio::piped());
    let mut child = qemu.spawn().map_err(|e| {
        boot(Error::new(format!(
            "cannot start qemu-system-x86_64 (package qemu-system-x86): {e}"
        )))
    })?;
    // QEMU's stderr carries the command's stderr port and QEMU's own messages.
    let forward = child.stderr.take().map(|mut from| {
        thread::spawn(move || {
            let _ = io::copy(&mut from, &mut io::stderr());
        })
    });
    let stdin = child.stdin.take();
    let waited = cmd::wait_with_deadline(&mut child, timeout).map_err(boot)?;
    drop(stdin);
    if let Some(forward) = forward {
        let _ = forward.join();
    }

    let status = match waited {
        Waited::TimedOut => {
            return Err((
                Failure::Timeout,
                Error {
                    message: format!(
                        "timed out after {} s (the guest was killed)",
                        timeout.as_secs()
                    ),
                    code: EXIT_TIMEOUT,
                },
            ));
        }
        Waited::Exited(status) => status,
    };
    match fs::read_to_string(run_dir.path.join(EXIT_STATUS_FILE)) {
        Ok(s) => s
            .trim()
            .parse::<u8>()
            .map_err(|_| boot(Error::new(format!("bad exit status from the guest: {s:?}")))),
        Err(_) => {
            let console = run_dir.path.join("console.log");
            let tail = console_tail(&console, 40);
            run_dir.keep();
            Err(boot(Error::new(format!(
                "the guest did not report an exit status (QEMU: {}), so the command did not \
                 run to completion; last console lines ({}):\n{tail}",
                cmd::describe(status),
                console.display()
            ))))
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
        "2",
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

/// `command.sh`: run by the host's /bin/sh inside the chroot. Goes to the working directory,
/// lifts the memlock limit and executes the command with exactly `env`.
fn command_script(inv: &Invocation, env: &[(OsString, OsString)]) -> Vec<u8> {
    let mut s = b"# generated by rdma-verbs-vm: the command of one guest run\ncd ".to_vec();
    push_quoted(&mut s, inv.cwd.as_os_str());
    s.extend_from_slice(b" || exit 125\nulimit -l unlimited\nexec /usr/bin/env -i");
    for (name, value) in env {
        s.extend_from_slice(b" \\\n  ");
        push_quoted(&mut s, &concat(&[name, "=".as_ref(), value]));
    }
    s.extend_from_slice(b" \\\n  ");
    push_quoted(&mut s, &inv.program);
    for arg in &inv.args {
        s.push(b' ');
        push_quoted(&mut s, arg);
    }
    s.push(b'\n');
    s
}

/// `stage2.sh`: run by busybox sh in the initramfs; see the module documentation.
fn stage2_script(run_dir: &Path, shared: &[&str], writable: &[PathBuf]) -> Vec<u8> {
    let mut s = Vec::new();
    let mut line = |parts: &[&[u8]]| {
        for p in parts {
            s.extend_from_slice(p);
        }
        s.push(b'\n');
    };
    let opts = NINEP_OPTS.as_bytes();
    let mut host_run_dir = b"/host".to_vec();
    host_run_dir.extend_from_slice(run_dir.as_os_str().as_bytes());
    let mut q_host_run_dir = Vec::new();
    push_quoted(&mut q_host_run_dir, OsStr::from_bytes(&host_run_dir));
    let mut q_run_dir = Vec::new();
    push_quoted(&mut q_run_dir, run_dir.as_os_str());

    line(&[b"# generated by rdma-verbs-vm for one guest run"]);
    line(&[b"export PATH=/bin"]);
    line(&[b"fail() { echo \"vm-stage2: $*\"; exit 1; }"]);
    line(&[
        b"mount -t 9p -o ro,cache=loose,",
        opts,
        b" hostroot /host || fail 'cannot mount the host root'",
    ]);
    line(&[b"mount -t proc proc /host/proc"]);
    line(&[b"mount -t sysfs sys /host/sys"]);
    line(&[b"mount -t devtmpfs dev /host/dev"]);
    line(&[b"mkdir -p /host/dev/pts /host/dev/shm"]);
    line(&[b"mount -t devpts devpts /host/dev/pts"]);
    line(&[b"mount -t tmpfs tmpfs /host/dev/shm"]);
    for dir in ["/tmp", "/run"] {
        if shared.contains(&dir) {
            line(&[
                b"mount -t 9p -o ",
                opts,
                b" ",
                share_tag(dir).as_bytes(),
                b" /host",
                dir.as_bytes(),
                b" || fail 'cannot mount the host directory ",
                dir.as_bytes(),
                b"'",
            ]);
        } else {
            line(&[b"mount -t tmpfs tmpfs /host", dir.as_bytes()]);
            line(&[b"chmod 1777 /host", dir.as_bytes()]);
        }
    }
    for (i, dir) in writable.iter().enumerate() {
        let mut host_dir = b"/host".to_vec();
        host_dir.extend_from_slice(dir.as_os_str().as_bytes());
        let mut q_host_dir = Vec::new();
        push_quoted(&mut q_host_dir, OsStr::from_bytes(&host_dir));
        // mkdir only matters below a tmpfs (/tmp, /run); elsewhere the directory exists.
        line(&[b"mkdir -p ", &q_host_dir, b" 2>/dev/null"]);
        line(&[
            b"mount -t 9p -o ",
            opts,
            b" ",
            writable_tag(i).as_bytes(),
            b" ",
            &q_host_dir,
            b" || fail 'cannot mount a writable directory'",
        ]);
    }
    line(&[b"mkdir -p ", &q_host_run_dir]);
    line(&[
        b"mount -o bind /xrun ",
        &q_host_run_dir,
        b" || fail 'cannot bind the run directory'",
    ]);
    line(&[b"sh /xrun/network.sh || fail 'network setup failed'"]);
    // The ports appear shortly after virtio_console probes; find them by name.
    line(&[b"out=; err=; i=0"]);
    line(&[b"while [ -z \"$out\" ] || [ -z \"$err\" ]; do"]);
    line(&[b"  for p in /sys/class/virtio-ports/*; do"]);
    line(&[b"    case \"$(cat $p/name 2>/dev/null)\" in"]);
    line(&[b"      ", OUT_PORT.as_bytes(), b") out=/dev/${p##*/} ;;"]);
    line(&[b"      ", ERR_PORT.as_bytes(), b") err=/dev/${p##*/} ;;"]);
    line(&[b"    esac"]);
    line(&[b"  done"]);
    line(&[b"  i=$((i + 1)); [ $i -lt 50 ] || fail 'virtio output ports missing'"]);
    line(&[b"  [ -n \"$out\" ] && [ -n \"$err\" ] || sleep 0.1"]);
    line(&[b"done"]);
    line(&[
        b"chroot /host /bin/sh ",
        &q_run_dir,
        b"/command.sh </dev/null >\"$out\" 2>\"$err\"",
    ]);
    line(&[b"echo $? > /xrun/", EXIT_STATUS_FILE.as_bytes()]);
    s
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
        let writable = [PathBuf::from("/w/it's"), PathBuf::from("/tmp/x")];
        for shared in [&[][..], &["/tmp"], &["/tmp", "/run"]] {
            let script = stage2_script(Path::new("/a b/it's"), shared, &writable);
            assert!(sh_n(&script), "{}", String::from_utf8_lossy(&script));
        }
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
