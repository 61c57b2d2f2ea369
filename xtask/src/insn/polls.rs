//! The receiver's polls (`--side server`): how many times each run called the provider's
//! poll function, and the receiver's instructions per message with the cost of its poll
//! calls taken out.
//!
//! A receiver busy-polls its CQ while it waits for the sender, so its instruction count
//! holds a number of poll calls that depends on timing, not on the message count: one
//! more empty poll per wait. The cost of a run is modelled as I = a + b·N + c·P (N
//! messages, P poll calls; a: start-up and teardown; b: the work of a message, its
//! completion's share of a poll included; c: the fixed cost of one poll call, the
//! provider's lock/check/unlock and the caller's loop around it, the same for an empty
//! and a non-empty poll). P is counted the same way for every program, perftest included:
//! callgrind's call count of the function `ibv_poll_cq` lands in (`perf` prints its place
//! in the provider library in its banner; perftest loads the same library). a, b and c
//! are fitted by least squares over a program's runs (two iteration counts, several
//! repetitions: timing moves P independently of N). The figure without empty polls is
//! b + c/16: every poll takes a full batch of 16 completions (perftest's and `perf`'s
//! batch), the fewest polls N messages need. A configuration whose runs all polled that
//! few times (within 1%) has no empty polls to take out (and no spread to fit c from): its plain
//! figure is that one.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use super::Key;

/// The banner line of `perf` that names the provider's poll function.
const BANNER: &str = " Poll function   : ";

/// The provider's poll function as a `perf` run's output names it: (library file name,
/// offset in it). Any `perf` run in `work` will do: all use the same library.
pub(super) fn find_poll_fn(work: &Path) -> Option<(String, u64)> {
    let entries = fs::read_dir(work).ok()?;
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".txt"))
        .find_map(|e| poll_fn(&fs::read_to_string(e.path()).ok()?))
}

/// [`find_poll_fn`] of one output: `" Poll function   : librxe-rdmav34.so+0x3cc0"`.
pub(super) fn poll_fn(output: &str) -> Option<(String, u64)> {
    let line = output.lines().find_map(|l| l.strip_prefix(BANNER))?;
    let (file, offset) = line.trim().rsplit_once("+0x")?;
    Some((file.to_owned(), u64::from_str_radix(offset, 16).ok()?))
}

/// The calls of the function at `offset` of library `file`, from
/// `callgrind_annotate --tree=caller` output: the sum of its callers' call counts. A
/// library without symbols names it `???:0x<offset, 16 digits> [<path>/<file>]`. `None`
/// when the profile has no such function.
pub(super) fn calls(annotate: &str, file: &str, offset: u64) -> Option<u64> {
    let me = format!("0x{offset:016x} [");
    let in_file = format!("/{file}]");
    for block in annotate.split("\n\n") {
        let mut sum = 0u64;
        for line in block.lines() {
            // `COST (PCT)  < CALLER (Nx) [OBJ]` or `COST (PCT)  *  FUNCTION [OBJ]`.
            let rest = line.split_once(')').map_or("", |(_, r)| r).trim_start();
            if let Some(caller) = rest.strip_prefix('<') {
                let count = caller
                    .rsplit_once(" (")
                    .and_then(|(_, c)| c.split_once("x)"))
                    .and_then(|(n, _)| n.replace(',', "").parse::<u64>().ok());
                sum += count.unwrap_or(0);
            } else if let Some(f) = rest.strip_prefix('*')
                && f.contains(&me)
                && f.trim_end().ends_with(&in_file)
            {
                return Some(sum);
            }
        }
    }
    None
}

/// One run of a receiver: messages, instructions, poll calls.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Run {
    pub(super) n: f64,
    pub(super) insn: f64,
    pub(super) polls: f64,
}

/// Poll calls that must vary independently of N across a configuration's runs (the
/// root of the residual sum of squares of P on N) for the fit to determine c: runs
/// agree within about 900 instructions, so c is then good to about 10.
const MIN_SPREAD: f64 = 100.0;

/// The least-squares fit of I = a + b·N + c·P over `runs`: (b, c). `None` with fewer
/// than four runs or when P hardly varies independently of N (fewer than
/// [`MIN_SPREAD`] polls), which leaves b and c undetermined.
pub(super) fn fit(runs: &[Run]) -> Option<(f64, f64)> {
    if runs.len() < 4 {
        return None;
    }
    // Centred normal equations: a drops out.
    let k = runs.len() as f64;
    let mean = |f: fn(&Run) -> f64| runs.iter().map(f).sum::<f64>() / k;
    let (mn, mi, mp) = (mean(|r| r.n), mean(|r| r.insn), mean(|r| r.polls));
    let (mut snn, mut spp, mut snp, mut sni, mut spi) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for r in runs {
        let (n, p, i) = (r.n - mn, r.polls - mp, r.insn - mi);
        snn += n * n;
        spp += p * p;
        snp += n * p;
        sni += n * i;
        spi += p * i;
    }
    let det = snn * spp - snp * snp;
    // det / snn: what of P's spread N does not explain.
    if snn <= 0.0 || det / snn < MIN_SPREAD * MIN_SPREAD {
        return None;
    }
    let b = (sni * spp - spi * snp) / det;
    let c = (spi * snn - sni * snp) / det;
    Some((b, c))
}

/// Completions one poll asks for: perftest's `CTX_POLL_BATCH` and `perf`'s `POLL_BATCH`.
const POLL_BATCH: f64 = 16.0;

/// A configuration's receiver figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Figures {
    /// Poll calls per message: the smallest and the largest of its runs.
    pub(super) polls_per_msg: (f64, f64),
    /// The fit's (b, c): instructions per message with the poll calls out, and per poll
    /// call; `None` when the runs do not determine them.
    pub(super) fit: Option<(f64, f64)>,
    /// Instructions per message without empty polls: every poll takes a full batch
    /// (b + c / 16). Where the fit is undetermined because every run polled that often
    /// (within 1%), the plain figure is that already.
    pub(super) full_batches: Option<f64>,
}

/// [`Figures`] of one configuration's runs; `plain`: its (I(N2) − I(N1)) / (N2 − N1).
pub(super) fn figures(runs: &[Run], plain: Option<f64>) -> Option<Figures> {
    let per_msg = runs.iter().map(|r| r.polls / r.n);
    let lo = per_msg.clone().fold(f64::INFINITY, f64::min);
    let hi = per_msg.fold(f64::NEG_INFINITY, f64::max);
    let fit = fit(runs);
    // The fewest polls, give or take 1% (an extra poll costs ~c/N per message).
    let full = |r: &Run| r.polls <= ((r.n / POLL_BATCH).ceil() * 1.01).ceil();
    let full_batches = match fit {
        Some((b, c)) => Some(b + c / POLL_BATCH),
        None if runs.iter().all(full) => plain,
        None => None,
    };
    (!runs.is_empty()).then_some(Figures {
        polls_per_msg: (lo, hi),
        fit,
        full_batches,
    })
}

/// Prints the receiver's poll figures of every configuration with counted runs; `plain`:
/// each one's (I(N2) − I(N1)) / (N2 − N1).
pub(super) fn print_table(runs: &BTreeMap<Key, Vec<Run>>, plain: &BTreeMap<Key, f64>) {
    say!(
        "receiver polls (I = a + b*N + c*P fitted over each configuration's runs; \
         no empty polls: b + c/16, every poll a full batch):"
    );
    say!(
        "{:<10} {:>8} {:>3} {:<9} {:>5} {:>15} {:>10} {:>10} {:>15}",
        "test",
        "size",
        "-l",
        "path",
        "runs",
        "polls/msg",
        "insn/poll",
        "b",
        "no empty polls"
    );
    let num = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}"));
    for (k, r) in runs {
        let Some(f) = figures(r, plain.get(k).copied()) else {
            continue;
        };
        say!(
            "{:<10} {:>8} {:>3} {:<9} {:>5} {:>15} {:>10} {:>10} {:>15}",
            k.test,
            k.size,
            k.post_list,
            k.path,
            r.len(),
            format!("{:.3}..{:.3}", f.polls_per_msg.0, f.polls_per_msg.1),
            num(f.fit.map(|(_, c)| c)),
            num(f.fit.map(|(b, _)| b)),
            num(f.full_batches)
        );
    }
}

/// The JSON fields of [`Figures`], to append to a row of `insn-server.json`.
pub(super) fn json_fields(f: &Figures) -> String {
    let mut s = format!(
        ", \"polls_per_msg_min\": {:.4}, \"polls_per_msg_max\": {:.4}",
        f.polls_per_msg.0, f.polls_per_msg.1
    );
    if let Some((b, c)) = f.fit {
        s.push_str(&format!(
            ", \"insn_per_msg_polls_out\": {b:.1}, \"insn_per_poll\": {c:.1}"
        ));
    }
    if let Some(v) = f.full_batches {
        s.push_str(&format!(", \"insn_per_msg_no_empty_polls\": {v:.1}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_banner_names_the_poll_function() {
        let out = " Events          : OFF\n Poll function   : librxe-rdmav34.so+0x3cc0\n";
        assert_eq!(poll_fn(out), Some(("librxe-rdmav34.so".to_owned(), 0x3cc0)));
        assert_eq!(poll_fn(" Events          : OFF\n"), None);
    }

    #[test]
    fn calls_are_the_sum_of_the_callers_counts() {
        let annotate = "\
  553,475 (10.88%)  < ???:0x0000000000028a30 (1x) [/usr/bin/ib_send_bw]
  553,475 (10.88%)  *  ???:0x0000000000028690 [/usr/bin/ib_send_bw]

  120,000 ( 2.36%)  < ???:0x000000000001ea90 (3,000x) [/usr/bin/ib_send_bw]
   12,000 ( 0.24%)  < ???:0x000000000001eb00 (300x) [/usr/bin/ib_send_bw]
  132,000 ( 2.60%)  *  ???:0x0000000000003cc0 [/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so]
";
        assert_eq!(calls(annotate, "librxe-rdmav34.so", 0x3cc0), Some(3300));
        assert_eq!(calls(annotate, "librxe-rdmav34.so", 0x3cc4), None);
        assert_eq!(calls(annotate, "libmlx5.so.1", 0x3cc0), None);
    }

    #[test]
    fn the_fit_recovers_the_cost_of_a_message_and_of_a_poll() {
        // I = 1e6 + 250·N + 80·P, with polls per message moving between runs.
        let run = |n: f64, polls: f64| Run {
            n,
            insn: 1e6 + 250.0 * n + 80.0 * polls,
            polls,
        };
        let runs = [
            run(2000.0, 900.0),
            run(2000.0, 1500.0),
            run(8000.0, 4100.0),
            run(8000.0, 3000.0),
        ];
        let (b, c) = fit(&runs).unwrap();
        assert!(
            (b - 250.0).abs() < 1e-6 && (c - 80.0).abs() < 1e-6,
            "{b} {c}"
        );
        // The same polls per message everywhere: b and c cannot be told apart.
        let same = [
            run(2000.0, 1000.0),
            run(2000.0, 1000.0),
            run(8000.0, 4000.0),
            run(8000.0, 4000.0),
        ];
        assert_eq!(fit(&same), None);
        // One poll more in one run: too little spread to tell c.
        let one_more = [same[0], same[1], same[2], run(8000.0, 4001.0)];
        assert_eq!(fit(&one_more), None);
        assert_eq!(fit(&runs[..3]), None);

        // No empty polls: b + c/16.
        let f = figures(&runs, Some(999.0)).unwrap();
        assert!((f.full_batches.unwrap() - 255.0).abs() < 1e-6, "{f:?}");
        assert_eq!(f.polls_per_msg, (0.375, 0.75));
        // Every run at the fewest polls (a full batch each): the plain figure.
        let full = [run(1000.0, 63.0), run(1000.0, 64.0), run(3000.0, 188.0)];
        assert_eq!(
            figures(&full, Some(300.0)).unwrap().full_batches,
            Some(300.0)
        );
        // Too few runs to fit, and empty polls among them: nothing to say.
        assert_eq!(figures(&runs[..3], Some(300.0)).unwrap().full_batches, None);
        assert_eq!(figures(&[], Some(300.0)), None);
    }
}
