//! Running the bundled examples (and rdma-core's C tools) as server/client
//! process pairs inside the guest, with a bound on every wait.

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// target/<profile>/examples/NAME, next to the test binary's deps/ directory.
pub fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary lives in target/<profile>/deps");
    let bin = dir.join("examples").join(name);
    assert!(
        bin.is_file(),
        "{} has not been built: run `cargo build --all-features --examples` first (cargo xtask test does)",
        bin.display()
    );
    bin
}

/// True when something listens on TCP `port` (/proc/net/tcp{,6}, state 0A).
/// Probing by connecting would consume the server's only accept().
pub fn listening(port: u16) -> bool {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|f| {
        fs::read_to_string(f)
            .unwrap_or_default()
            .lines()
            .skip(1)
            .any(|l| {
                let cols: Vec<&str> = l.split_whitespace().collect();
                cols.len() > 3 && cols[1].ends_with(&want) && cols[3] == "0A"
            })
    })
}

/// A running program, its stdout and stderr going to a file; killed on drop.
pub struct Proc {
    /// Program and arguments, for messages.
    pub name: String,
    child: Child,
    out: PathBuf,
}

impl Proc {
    /// Starts `bin args`; `name` names it in messages, `tag` its output file.
    pub fn spawn(name: &str, bin: &Path, args: &[String], tag: &str) -> Proc {
        let test = std::env::current_exe()
            .ok()
            .and_then(|e| e.file_stem().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_default();
        let out = std::env::temp_dir().join(format!("{test}-{}-{tag}.out", std::process::id()));
        let f = File::create(&out).expect("output file");
        let child = Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(f.try_clone().expect("dup"))
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        Proc {
            name: format!("{name} {}", args.join(" ")),
            child,
            out,
        }
    }

    /// Starts a server and waits until it listens on `port`, failing the test
    /// if it exits first or is not listening by `deadline`.
    pub fn server(name: &str, bin: &Path, args: &[String], port: u16, deadline: Instant) -> Proc {
        let mut server = Proc::spawn(name, bin, args, &format!("{port}-server"));
        while !listening(port) {
            if let Some(st) = server.child.try_wait().expect("try_wait") {
                panic!(
                    "`{}` exited with {st} before listening:\n{}",
                    server.name,
                    server.output()
                );
            }
            assert!(
                Instant::now() < deadline,
                "`{}` never listened on {port}",
                server.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    /// Everything the program printed so far.
    pub fn output(&self) -> String {
        fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// The exit status if the program has exited, without waiting.
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Waits until `deadline`; kills the process after that (`None`).
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = fs::remove_file(&self.out);
    }
}

/// Waits for `client`, then `server`, each until `deadline`, and fails the
/// test unless both exited 0; returns (server output, client output).
pub fn finish(mut server: Proc, mut client: Proc, deadline: Instant) -> (String, String) {
    let cst = client.wait_until(deadline);
    let sst = server.wait_until(deadline);
    let (sout, cout) = (server.output(), client.output());
    let status = |st: Option<ExitStatus>| match st {
        Some(st) => st.to_string(),
        None => "killed: not done in time".to_owned(),
    };
    assert!(
        cst.is_some_and(|s| s.success()) && sst.is_some_and(|s| s.success()),
        "a side failed or was not done in time:\nserver `{}`: {}\n{sout}\nclient `{}`: {}\n{cout}",
        server.name,
        status(sst),
        client.name,
        status(cst)
    );
    (sout, cout)
}
