//! `cargo xtask demo`: build the examples, then run them, in order, in one guest.
//!
//! The steps are the [`STEPS`] list; add an example there.

use std::ffi::OsString;
use std::path::Path;
use std::process::Command;

use crate::cmd::{self, quoted, run_checked};
use crate::run::{self, Invocation};
use crate::{Result, setup};

/// One step of the demo.
enum Step {
    /// Run `examples/<example> <args>`; the demo fails if it fails or was not built.
    Single {
        example: &'static str,
        args: &'static [&'static str],
    },
    /// Start `<example> --server --port <port>` in the background, wait a second, run
    /// `<example> --client $RDMA_VERBS_ADDR --port <port>`, then wait for the server. Both must
    /// succeed (a failed client gets its server killed after 2 s); skipped (with a note) if
    /// the example was not built. Output lines are prefixed with `[<example> server]` /
    /// `[<example> client]`.
    ClientServer { example: &'static str, port: u16 },
}

/// The demo, in order.
const STEPS: &[Step] = &[
    Step::Single {
        example: "devinfo",
        args: &[],
    },
    Step::ClientServer {
        example: "send_recv",
        port: 18515,
    },
    Step::ClientServer {
        example: "rdma_write",
        port: 18516,
    },
];

/// Time limit of each side of a client/server step inside the guest, in seconds, so that a
/// client that never connects cannot leave its server waiting until the overall timeout.
const SIDE_TIMEOUT_SECS: u32 = 120;

/// Builds the examples on the host and runs [`STEPS`] in one guest.
pub fn demo_command() -> Result<u8> {
    crate::setup_vm(setup::Verbosity::Quiet)?;
    let root = crate::workspace_root();
    let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    build.args(["build", "--examples"]).current_dir(root);
    eprintln!("xtask demo: {}", cmd::display(&build));
    run_checked(&mut build)?;

    let examples = crate::target_dir().join("debug/examples");
    let script = script(&examples);
    let mut inv = Invocation::new("sh".into(), vec!["-c".into(), OsString::from(script)])?;
    inv.cwd = root.to_path_buf();
    let code = run::execute(inv, crate::timeout_from_env()?)?;
    if code == 0 {
        say!("xtask demo: all steps passed");
    } else {
        say!("xtask demo: FAILED (exit status {code})");
    }
    Ok(code)
}

/// The shell script that runs [`STEPS`] with the examples in `examples`; it exits non-zero
/// when a step failed.
fn script(examples: &Path) -> String {
    let mut s = format!(
        "ex={}\nstatus=0\nrcdir=$(mktemp -d)\n",
        quoted(examples.as_os_str())
    );
    for step in STEPS {
        match step {
            Step::Single { example, args } => {
                let args: String = args.iter().map(|a| format!(" {}", quoted(a))).collect();
                s += &format!(
                    "echo '=== {example}'\n\
                     if \"$ex/{example}\"{args}; then echo '=== {example}: ok'\n\
                     else echo \"=== {example}: FAILED ($?)\"; status=1; fi\n"
                );
            }
            Step::ClientServer { example, port } => {
                let t = SIDE_TIMEOUT_SECS;
                let rc = format!("\"$rcdir/{example}\"");
                s += &format!(
                    "echo '=== {example}: server and client on port {port}'\n\
                     if [ -x \"$ex/{example}\" ]; then\n\
                     \x20 (timeout {t} \"$ex/{example}\" --server --port {port} 2>&1 &\n\
                     \x20  echo $! >{rc}.pid; wait $!; echo $? >{rc}.server\n\
                     \x20 ) | sed -u 's/^/[{example} server] /' &\n\
                     \x20 server=$!\n\
                     \x20 sleep 1\n\
                     \x20 (timeout {t} \"$ex/{example}\" --client \"$RDMA_VERBS_ADDR\" --port {port} 2>&1;\n\
                     \x20  echo $? >{rc}.client\n\
                     \x20 ) | sed -u 's/^/[{example} client] /'\n\
                     \x20 if [ \"$(cat {rc}.client)\" != 0 ]; then\n\
                     \x20   sleep 2; kill \"$(cat {rc}.pid)\" 2>/dev/null\n\
                     \x20 fi\n\
                     \x20 wait $server\n\
                     \x20 if [ \"$(cat {rc}.server)\" = 0 ] && [ \"$(cat {rc}.client)\" = 0 ]; then\n\
                     \x20   echo '=== {example}: ok'\n\
                     \x20 else\n\
                     \x20   echo \"=== {example}: FAILED (server $(cat {rc}.server), client $(cat {rc}.client))\"\n\
                     \x20   status=1\n\
                     \x20 fi\n\
                     else\n\
                     \x20 echo '=== {example}: not built, skipped'\n\
                     fi\n"
                );
            }
        }
    }
    s += "exit $status\n";
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_is_valid_shell() {
        let s = script(Path::new("/x/it's/examples"));
        let ok = Command::new("sh").args(["-n", "-c", &s]).status();
        assert!(ok.is_ok_and(|st| st.success()), "{s}");
    }
}
