//! The soak's memory check: anonymous memory of the process, in all and per
//! mapping, sampled while the lanes run.

use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use super::Gate;

/// Anonymous memory of this process (heap, stacks, registered buffers), KiB: the
/// `Anonymous` total of `/proc/self/smaps_rollup`, counted by walking the page tables.
/// (`RssAnon` of `/proc/self/status` is not exact: Linux 6.1 folds each thread's count
/// into it only every 64 page faults, so it can lag by 256 KiB per thread.)
fn anon_kib() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Anonymous:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Anonymous KiB of each mapping (`/proc/self/smaps`), by its address range and name: what
/// the soak prints for the mappings that grew when it fails the memory check.
fn anon_by_mapping() -> Vec<(String, u64)> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut out = Vec::new();
    let mut mapping = None;
    for l in smaps.lines() {
        if let Some(v) = l.strip_prefix("Anonymous:") {
            if let Some(m) = mapping.take() {
                out.push((
                    m,
                    v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0),
                ));
            }
        } else if !l.split_whitespace().next().unwrap_or(":").ends_with(':') {
            // A mapping's header: range, perms, offset, device, inode, [name].
            let f: Vec<&str> = l.split_whitespace().collect();
            mapping = Some(format!("{} {}", f[0], f.get(5).unwrap_or(&"[anon]")));
        }
    }
    out
}

/// Most growth of anonymous memory allowed between the end of warm-up and the end (KiB).
pub const GROWTH_LIMIT_KIB: u64 = 1024;

/// Anonymous memory after warm-up, at its peak and at the end (KiB), with
/// the per-mapping lists of the first and the last.
pub struct Memory {
    pub start: u64,
    pub peak: u64,
    pub end: u64,
    mappings_start: Vec<(String, u64)>,
    mappings_end: Vec<(String, u64)>,
}

impl Memory {
    /// The mappings that grew, one line each.
    pub fn print_growth(&self, role: &str) {
        let before: std::collections::HashMap<&str, u64> = self
            .mappings_start
            .iter()
            .map(|(m, kib)| (m.as_str(), *kib))
            .collect();
        for (mapping, kib) in &self.mappings_end {
            let was = before.get(mapping.as_str()).copied().unwrap_or(0);
            if *kib > was {
                eprintln!("soak {role}: grew: {mapping}: {was} -> {kib} KiB");
            }
        }
    }
}

/// Samples the memory every 5 s until the lanes are done, then once more
/// while every lane's thread, QP and buffers still exist; then lets the
/// lanes' threads end.
pub fn watch_memory<T>(gate: &Gate, handles: &[thread::JoinHandle<T>]) -> Memory {
    // The per-mapping list first: reading it grows the main thread's heap, which is then
    // counted both here and at the end.
    let mappings_start = anon_by_mapping();
    let start = anon_kib();
    let mut peak = start;
    let mut sample = Instant::now();
    while gate.done.load(Ordering::SeqCst) < handles.len()
        && !handles.iter().any(|h| h.is_finished())
    {
        thread::sleep(Duration::from_millis(100));
        if sample.elapsed() >= Duration::from_secs(5) {
            peak = peak.max(anon_kib());
            sample = Instant::now();
        }
    }
    let (end, mappings_end) = (anon_kib(), anon_by_mapping());
    peak = peak.max(end);
    gate.measured.store(true, Ordering::SeqCst);
    Memory {
        start,
        peak,
        end,
        mappings_start,
        mappings_end,
    }
}
