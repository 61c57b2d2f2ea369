//! perftest's defaults (`init_perftest_params`) and dependency rules
//! (`force_dependecies`): from what the command line said to [`Opts`].

use std::path::PathBuf;

use super::{
    ATOMIC_SIZE, AsyncShape, AtomicOp, DataPath, MAX_CQ_MOD, MAX_DURATION_SECS, MAX_INLINE,
    MAX_ITERS, MAX_MSG_SIZE, MAX_QPS, MAX_RX_DEPTH, MAX_SIZE, MAX_TX_DEPTH, MSG_SIZE_CQ_MOD_LIMIT,
    Opts, PEAK_ITERS_LIMIT, Test, Verb,
};

/// perftest's default JSON file (`--out_json` without `--out_json_file`).
const JSON_FILE: &str = "perftest_out.json";

/// What the command line said, before defaults and dependencies.
#[derive(Default)]
pub struct RawArgs {
    pub host: Option<String>,
    pub device: Option<String>,
    pub ib_port: Option<u8>,
    pub gid_index: Option<u8>,
    pub port: Option<u16>,
    pub size: Option<usize>,
    pub iters: Option<u64>,
    pub duration: Option<u64>,
    pub tx_depth: Option<u32>,
    pub rx_depth: Option<u32>,
    pub num_qps: Option<u32>,
    pub post_list: Option<u32>,
    pub cq_mod: Option<u32>,
    pub inline_size: Option<u32>,
    pub outs: Option<u32>,
    pub atomic: Option<AtomicOp>,
    pub out_json: Option<PathBuf>,
    pub json: bool,
    pub all: bool,
    pub events: bool,
    pub bidir: bool,
    pub no_peak: bool,
    pub report_gbits: bool,
    pub run_infinitely: bool,
    pub old_post_send: bool,
    pub path: Option<DataPath>,
    pub inflight: Option<u32>,
    pub async_shape: AsyncShape,
    pub rx_burst: bool,
}

/// perftest's defaults (`init_perftest_params`) and rules (`force_dependecies`).
pub fn resolve(test: Test, a: RawArgs) -> Result<Opts, String> {
    let bw = test.is_bw();
    let verb = test.verb();
    check_test_flags(verb, &a)?;
    let size = message_size(verb, bw, &a)?;
    let mut iters = iterations(test, &a)?;
    check_verb_features(verb, &a)?;
    let mut d = depths(verb, bw, &a)?;
    check_modes(verb, bw, d.num_qps, &a)?;
    let duration = duration(&a)?;
    let iterations_mode = duration.is_none();
    fit_to_run(&mut d, verb, bw, size, iters, iterations_mode, &a)?;
    let inline_size = a.inline_size.unwrap_or(0);
    let mut no_peak = a.no_peak;
    if !iterations_mode {
        iters = 0;
        no_peak = true;
    } else if iters > PEAK_ITERS_LIMIT {
        no_peak = true;
    }
    let path = data_path(bw, duration, inline_size, &a)?;
    check_async(test, &d, duration, inline_size, &a)?;
    if a.rx_burst {
        check_rx_burst(test, &mut d, iters, duration, &a)?;
    }
    Ok(Opts {
        test,
        path,
        host: a.host,
        device: a.device.or_else(|| std::env::var("RDMA_VERBS_DEVICE").ok()),
        ib_port: a.ib_port.unwrap_or(1),
        gid_index: a.gid_index,
        port: a.port.unwrap_or(18515),
        sizes: sizes(size, a.all),
        all: a.all,
        iters,
        duration,
        // perftest's margin: a quarter of -D, in whole seconds (`duration / 4`
        // on integers: none below -D 4).
        margin: duration.map_or(0.0, |d| (d / 4) as f64),
        tx_depth: d.tx_depth,
        rx_depth: d.rx_depth,
        num_qps: d.num_qps,
        post_list: d.post_list,
        cq_mod: d.cq_mod,
        inline_size,
        events: a.events,
        bidir: a.bidir,
        report_gbits: a.report_gbits,
        out_json: a
            .out_json
            .or_else(|| a.json.then(|| PathBuf::from(JSON_FILE))),
        run_infinitely: a.run_infinitely,
        no_peak,
        old_post_send: a.old_post_send,
        atomic: a.atomic.unwrap_or(AtomicOp::FetchAdd),
        outs: a.outs,
        inflight: a.inflight,
        async_shape: a.async_shape,
        rx_burst: a.rx_burst,
    })
}

/// `--rx-burst`: send_bw with `-n` only, one way; every receive of the run is
/// posted before it (`-r` is `-n`, not given or given as that).
fn check_rx_burst(
    test: Test,
    d: &mut Depths,
    iters: u64,
    duration: Option<u64>,
    a: &RawArgs,
) -> Result<(), String> {
    if test != Test::SendBw || duration.is_some() || a.bidir || a.events {
        return Err("--rx-burst applies to send_bw with -n, without -D, -b or -e".into());
    }
    let all = u32::try_from(iters).unwrap_or(u32::MAX);
    if a.rx_depth.is_some_and(|r| r != all) || all > MAX_RX_DEPTH {
        return Err(format!(
            "--rx-burst posts every receive before the run: -r is -n, at most {MAX_RX_DEPTH}"
        ));
    }
    d.rx_depth = all;
    Ok(())
}

/// Work-queue sizes and moderation, with perftest's defaults and limits.
struct Depths {
    tx_depth: u32,
    rx_depth: u32,
    num_qps: u32,
    post_list: u32,
    cq_mod: u32,
}

/// What the atomic tests and `-o` allow.
fn check_test_flags(verb: Verb, a: &RawArgs) -> Result<(), String> {
    if verb == Verb::Atomic {
        // perftest: "Message size cannot be changed for Atomic tests" (-a too).
        if a.all || a.size.is_some_and(|s| s != ATOMIC_SIZE) {
            return Err(format!(
                "the message size cannot be changed for atomic tests (always {ATOMIC_SIZE} \
                 bytes: no -a, and -s only as -s {ATOMIC_SIZE})"
            ));
        }
    } else if a.atomic.is_some() {
        return Err("-A applies to the atomic tests only".into());
    }
    if a.outs.is_some() && !verb.writes_local() {
        return Err("-o (outstanding reads) applies to the READ and atomic tests only".into());
    }
    Ok(())
}

/// `-s`, or the test's default size.
fn message_size(verb: Verb, bw: bool, a: &RawArgs) -> Result<usize, String> {
    let size = a.size.unwrap_or(match (verb, bw) {
        (Verb::Atomic, _) => ATOMIC_SIZE,
        (_, true) => 65536,
        (_, false) => 2,
    });
    if size == 0 {
        return Err("-s must be at least 1".into());
    }
    if size > MAX_MSG_SIZE {
        return Err(format!("-s must be between 1 and {MAX_MSG_SIZE}"));
    }
    Ok(size)
}

/// `-n`, or the test's default count.
fn iterations(test: Test, a: &RawArgs) -> Result<u64, String> {
    let iters = a
        .iters
        .unwrap_or(if test == Test::WriteBw { 5000 } else { 1000 });
    if a.iters.is_some() && !(5..=MAX_ITERS).contains(&iters) {
        return Err(format!("-n must be between 5 and {MAX_ITERS}"));
    }
    Ok(iters)
}

/// perftest's refusals of features a verb lacks, in its words.
fn check_verb_features(verb: Verb, a: &RawArgs) -> Result<(), String> {
    if verb != Verb::Send && a.rx_depth.is_some_and(|r| r != 1) {
        return Err("On RDMA verbs rx depth can be only 1".into());
    }
    if verb.writes_local() && a.inline_size.is_some_and(|i| i > 0) {
        return Err("Inline feature not available on READ/Atomic verbs".into());
    }
    if verb == Verb::Write && a.events {
        return Err("Events feature not available on WRITE verb".into());
    }
    Ok(())
}

/// `-t`, `-r`, `-q`, `-l` and `-Q` with their defaults, each at least 1 and
/// within perftest's limit (`-I` too).
fn depths(verb: Verb, bw: bool, a: &RawArgs) -> Result<Depths, String> {
    let d = Depths {
        tx_depth: a.tx_depth.unwrap_or(if bw { 128 } else { 1 }),
        rx_depth: a
            .rx_depth
            .unwrap_or(if verb == Verb::Send { 512 } else { 1 }),
        num_qps: a.num_qps.unwrap_or(1),
        post_list: a.post_list.unwrap_or(1),
        cq_mod: a.cq_mod.unwrap_or(100),
    };
    if d.tx_depth == 0 || d.rx_depth == 0 || d.num_qps == 0 || d.post_list == 0 || d.cq_mod == 0 {
        return Err("-t, -r, -q, -l and -Q must be at least 1".into());
    }
    for (flag, value, max) in [
        ("-t", d.tx_depth, MAX_TX_DEPTH),
        ("-r", d.rx_depth, MAX_RX_DEPTH),
        ("-q", d.num_qps, MAX_QPS),
        ("-Q", d.cq_mod, MAX_CQ_MOD),
        ("-I", a.inline_size.unwrap_or(0), MAX_INLINE),
    ] {
        if value > max {
            return Err(format!("{flag} must be at most {max} (perftest's limit)"));
        }
    }
    Ok(d)
}

/// The combinations of `-e`, `-b`, `-q` and `--run_infinitely` that run.
fn check_modes(verb: Verb, bw: bool, num_qps: u32, a: &RawArgs) -> Result<(), String> {
    if a.events && a.bidir {
        return Err(
            "-e with -b is not supported: one thread cannot sleep on the send and the receive \
             channel at once"
                .into(),
        );
    }
    if a.run_infinitely && a.bidir && verb == Verb::Send {
        // perftest's words.
        return Err("run_infinitely mode is not supported in SEND Bidirectional BW test".into());
    }
    if !bw {
        if num_qps > 1 {
            return Err("-q applies to the bandwidth tests only".into());
        }
        if a.bidir {
            return Err("-b applies to the bandwidth tests only".into());
        }
        if a.run_infinitely {
            return Err("--run_infinitely applies to the bandwidth tests only".into());
        }
    }
    if a.run_infinitely && a.all {
        return Err("--run_infinitely does not run all sizes".into());
    }
    Ok(())
}

/// The depths against the run: in iterations mode no deeper than `-n`; CQ
/// moderation off for large messages unless `-Q` is given, never above `-t`,
/// and the post list's rules.
fn fit_to_run(
    d: &mut Depths,
    verb: Verb,
    bw: bool,
    size: usize,
    iters: u64,
    iterations_mode: bool,
    a: &RawArgs,
) -> Result<(), String> {
    if iterations_mode {
        d.tx_depth = d.tx_depth.min(u32::try_from(iters).unwrap_or(u32::MAX));
        if verb == Verb::Send {
            d.rx_depth = d.rx_depth.min(u32::try_from(iters).unwrap_or(u32::MAX));
        }
    }
    if size > MSG_SIZE_CQ_MOD_LIMIT && !a.all && !a.events && a.cq_mod.is_none() {
        d.cq_mod = 1;
    }
    d.cq_mod = d.cq_mod.min(d.tx_depth);
    if d.post_list > 1 {
        if !bw {
            return Err("post list (-l) is supported in bw tests only".into());
        }
        if iterations_mode && iters % u64::from(d.post_list) != 0 {
            return Err("the number of iterations must be a multiple of the post list size".into());
        }
        if a.cq_mod.is_none() {
            d.cq_mod = d.post_list;
        } else if d.post_list % d.cq_mod != 0 {
            return Err("post list size must be a multiple of the CQ moderation".into());
        }
        if d.post_list > d.tx_depth {
            return Err("post list size must not exceed the tx depth (-t)".into());
        }
    }
    Ok(())
}

/// `-D` (default 5 with `--run_infinitely`); `None`: iterations mode.
fn duration(a: &RawArgs) -> Result<Option<u64>, String> {
    let duration = if a.run_infinitely {
        Some(a.duration.unwrap_or(5))
    } else {
        a.duration
    };
    if duration == Some(0) {
        return Err("-D must be at least 1 second".into());
    }
    // The run's clock counts ticks in a u64: far more than a year fits, not any u64 of seconds.
    if duration.is_some_and(|d| d > MAX_DURATION_SECS) {
        return Err(format!(
            "-D must be at most {MAX_DURATION_SECS} seconds (a year)"
        ));
    }
    if duration.is_some() {
        if a.all {
            return Err("duration mode does not run all sizes (-a)".into());
        }
        if a.events {
            return Err("duration mode does not work with events (-e)".into());
        }
    }
    Ok(duration)
}

/// The message sizes: `size`, or every power of two up to `MAX_SIZE` with `-a`.
fn sizes(size: usize, all: bool) -> Vec<usize> {
    if all {
        (1..=MAX_SIZE.trailing_zeros())
            .map(|p| 1usize << p)
            .collect()
    } else {
        vec![size]
    }
}

/// `--safe`, `--raw` or `--scoped`; the scoped loops run one mode only.
fn data_path(
    bw: bool,
    duration: Option<u64>,
    inline_size: u32,
    a: &RawArgs,
) -> Result<DataPath, String> {
    let path = a.path.unwrap_or(DataPath::Safe);
    if path == DataPath::Scoped
        && (!bw || a.bidir || a.events || duration.is_some() || inline_size > 0)
    {
        return Err(
            "--scoped runs the bandwidth tests one way, for -n iterations, polling, without \
             inline data (not with -b, -D, -e, -I or --run_infinitely)"
                .into(),
        );
    }
    Ok(path)
}

/// `--async N`: one stream of WRITEs or SENDs on one QP, one request per
/// future (so per post call), for `-n` iterations, at most `-t` in flight.
fn check_async(
    test: Test,
    d: &Depths,
    duration: Option<u64>,
    inline_size: u32,
    a: &RawArgs,
) -> Result<(), String> {
    let Some(n) = a.inflight else {
        return Ok(());
    };
    if !cfg!(feature = "tokio") {
        return Err("--async needs perf built with the tokio feature \
                    (cargo build --example perf --features tokio)"
            .into());
    }
    if !matches!(test, Test::WriteBw | Test::SendBw) {
        return Err("--async runs write_bw and send_bw only".into());
    }
    if a.path.is_some() {
        return Err("--async is a data path of its own: not with --safe, --raw or --scoped".into());
    }
    if d.num_qps != 1
        || d.post_list != 1
        || duration.is_some()
        || a.bidir
        || a.events
        || a.run_infinitely
    {
        return Err(
            "--async streams on one QP, one request per post, for -n iterations \
             (not with -q, -l, -D, -b, -e or --run_infinitely)"
                .into(),
        );
    }
    if inline_size > 0 {
        return Err("--async sends from registered memory (not with -I)".into());
    }
    if n == 0 || n > d.tx_depth {
        return Err(format!(
            "--async {n}: between 1 and the send queue depth -t ({})",
            d.tx_depth
        ));
    }
    Ok(())
}
