//! Bad input to the examples is refused up front, with a message that names
//! the problem, and never after waiting for a peer or by the OOM killer:
//! a GID index with no GID behind it (server and client, and `perf -x`), a
//! `--size` no allocation can hold, and buffers larger than the guest's memory.
//! Nothing listens on the ports used, so a side that waited for a peer would
//! run into [`LIMIT`] and fail the test.
mod common;

use common::procs::{Proc, example};

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

/// Every case must be refused well before any exchange timeout (30 s).
const LIMIT: Duration = Duration::from_secs(10);

/// Runs example `name` with `args`; asserts it exits with status 1 (an error,
/// not usage 2, not a signal) within [`LIMIT`] and printed `says`.
fn refused(name: &str, args: &[&str], says: &str) {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let tag = format!("{name}-{}", args.join("_").replace(['/', '.'], "-"));
    let mut p = Proc::spawn(name, &example(name), &args, &tag);
    let t = Instant::now();
    let status = p.wait_until(t + LIMIT);
    let out = p.output();
    let status = status.unwrap_or_else(|| panic!("`{}` still ran after {LIMIT:?}:\n{out}", p.name));
    assert_eq!(
        status.signal(),
        None,
        "`{}` was killed by a signal:\n{out}",
        p.name
    );
    assert_eq!(status.code(), Some(1), "`{}`: {status}\n{out}", p.name);
    assert!(
        out.contains(says),
        "`{}` did not say {says:?}:\n{out}",
        p.name
    );
    assert!(!out.contains("panicked"), "`{}` panicked:\n{out}", p.name);
}

fn addr() -> String {
    std::env::var("RDMA_VERBS_ADDR").unwrap_or_else(|_| "10.99.0.1".into())
}

#[test]
fn bad_gid_index_on_the_server_fails_before_waiting() {
    for name in ["send_recv", "rdma_write", "rdma_read"] {
        refused(
            name,
            &["--server", "--port", "18811", "--gid-index", "200"],
            "no GID at index 200",
        );
    }
}

#[test]
fn bad_gid_index_on_the_client_is_reported_on_the_client() {
    let a = addr();
    refused(
        "send_recv",
        &["--client", &a, "--port", "18812", "--gid-index", "200"],
        "no GID at index 200",
    );
}

#[test]
fn perf_bad_gid_index_fails_before_waiting() {
    refused(
        "perf",
        &["write_bw", "-x", "99", "-p", "18813"],
        "no GID at index 99",
    );
}

#[test]
fn absurd_size_is_refused_with_a_message() {
    refused(
        "send_recv",
        &[
            "--server",
            "--port",
            "18814",
            "--size",
            "9223372036854775807",
        ],
        "use a smaller --size",
    );
}

/// MemAvailable of this machine, in bytes.
fn mem_available() -> u64 {
    let m = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let kib: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("MemAvailable");
    kib * 1024
}

#[test]
fn buffers_larger_than_memory_are_refused_not_oom_killed() {
    // rdma_read's server holds two buffers of --size (the region and the
    // expected pattern): together twice what is available (1.5 GB in a 2 GiB
    // guest was OOM-killed before).
    let size = mem_available().to_string();
    refused(
        "rdma_read",
        &["--server", "--port", "18815", "--size", &size],
        "use a smaller --size",
    );
}
