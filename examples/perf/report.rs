//! Results: perftest's formulas (`print_report_bw`, `print_report_lat`), its
//! table layout and units, and a JSON file for tools.

use std::fmt::Write as _;
use std::io::{Read, Write};

use rdma_verbs::exchange::WireMessage;
use rdma_verbs::prelude::*;
use rdma_verbs::qp::SendApi;

use crate::clock::Rate;
use crate::conn::Device;
use crate::opts::{Opts, Test, Verb};

/// perftest's `RESULT_LINE`.
pub const LINE: &str =
    "---------------------------------------------------------------------------------------";

/// One row of a bandwidth table.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BwRow {
    /// Message size in bytes.
    pub size: u64,
    /// Messages counted.
    pub iters: u64,
    /// Peak bandwidth (MiB/s, or Gb/s with `--report_gbits`).
    pub bw_peak: f64,
    /// Average bandwidth (same unit).
    pub bw_avg: f64,
    /// Average message rate in millions of messages per second.
    pub msg_rate: f64,
}

impl BwRow {
    /// Adds the other direction of a bidirectional run: perftest sums the
    /// rates and prints one side's iterations.
    pub fn plus(self, other: BwRow) -> BwRow {
        BwRow {
            size: self.size,
            iters: self.iters,
            bw_peak: self.bw_peak + other.bw_peak,
            bw_avg: self.bw_avg + other.bw_avg,
            msg_rate: self.msg_rate + other.msg_rate,
        }
    }
}

/// What a bandwidth run recorded, in ticks.
pub struct BwSamples<'a> {
    /// Message size.
    pub size: usize,
    /// Messages counted (all QPs).
    pub iters: u64,
    /// WRs per post call (the peak search steps by it).
    pub post_list: u64,
    /// CQ moderation (the peak search steps by it).
    pub cq_mod: u64,
    /// Post time of each message; only `[0]` without peak.
    pub tposted: &'a [u64],
    /// Completion time of each signaled message; only `[0]` without peak.
    pub tcompleted: &'a [u64],
    /// No peak search: `tposted[0]`/`tcompleted[0]` bound the run.
    pub no_peak: bool,
}

/// A row of `iters` messages of `size` bytes over the ticks `start` to
/// `end`, without a peak (duration mode, a receiver, a periodic report).
pub fn span_row(size: usize, iters: u64, start: u64, end: u64, rate: &Rate, gbits: bool) -> BwRow {
    let s = BwSamples {
        size,
        iters,
        post_list: 1,
        cq_mod: 1,
        tposted: &[start],
        tcompleted: &[end],
        no_peak: true,
    };
    bw_row(&s, rate, gbits)
}

/// perftest's `print_report_bw` arithmetic.
pub fn bw_row(s: &BwSamples<'_>, rate: &Rate, gbits: bool) -> BwRow {
    let n = s.iters as usize;
    let mut opt_delta = s.tcompleted[0].wrapping_sub(s.tposted[0]);
    if !s.no_peak && n > 0 {
        opt_delta = opt_delta.min(peak_delta(s, n));
    }
    let cycles_to_units = rate.per_sec();
    let format_factor = if gbits { 125_000_000.0 } else { 1_048_576.0 };
    let last = if s.no_peak { 0 } else { n.saturating_sub(1) };
    let cycles = s.tcompleted[last].wrapping_sub(s.tposted[0]) as f64;
    let tsize = s.size as f64;
    let bw_avg = tsize * s.iters as f64 * cycles_to_units / (cycles * format_factor);
    let msg_rate = s.iters as f64 * cycles_to_units / (cycles * 1e6);
    let bw_peak = if s.no_peak || opt_delta == 0 {
        0.0
    } else {
        tsize * cycles_to_units / (opt_delta as f64 * format_factor)
    };
    BwRow {
        size: s.size as u64,
        iters: s.iters,
        bw_peak: finite(bw_peak),
        bw_avg: finite(bw_avg),
        msg_rate: finite(msg_rate),
    }
}

fn finite(v: f64) -> f64 {
    if v.is_finite() { v } else { 0.0 }
}

/// perftest's peak: the least `(tcompleted[j] - tposted[i]) / (j - i + 1)`
/// (integer division) over `i` in steps of the post list and `j >= i` on the
/// CQ-moderation grid (plus the last message). perftest tries every pair,
/// O(n²); this finds the same minimum in O(n log n) when no difference
/// wraps (each completion used is no earlier than every post before it, as
/// in a real run), and falls back to the pairs otherwise.
fn peak_delta(s: &BwSamples<'_>, n: usize) -> u64 {
    let step_i = s.post_list.max(1) as usize;
    let step_j = s.cq_mod.max(1) as usize;
    let (mut latest_post, mut next_i) = (0, 0);
    let no_wrap = peak_js(step_j, n).all(|j| {
        while next_i <= j {
            latest_post = latest_post.max(s.tposted[next_i]);
            next_i += step_i;
        }
        s.tcompleted[j] >= latest_post
    });
    if no_wrap {
        peak_delta_hull(s, n)
    } else {
        peak_delta_pairs(s, n)
    }
}

/// The `j`s of the peak search: every `step_j`-th message's completion, and
/// the last message's when `n` is not a multiple of `step_j`.
fn peak_js(step_j: usize, n: usize) -> impl Iterator<Item = usize> {
    let last = (n % step_j != 0).then_some(n - 1);
    (step_j - 1..n).step_by(step_j).chain(last)
}

/// perftest's quadratic search, as it is written there.
fn peak_delta_pairs(s: &BwSamples<'_>, n: usize) -> u64 {
    let step_i = s.post_list.max(1) as usize;
    let step_j = s.cq_mod.max(1) as usize;
    let mut opt_delta = u64::MAX;
    let mut i = 0;
    while i < n {
        let mut j = (i + 1).div_ceil(step_j) * step_j - 1;
        while j < n {
            let t = s.tcompleted[j].wrapping_sub(s.tposted[i]) / (j - i + 1) as u64;
            opt_delta = opt_delta.min(t);
            j += step_j;
        }
        if n % step_j != 0 {
            let j = n - 1;
            let t = s.tcompleted[j].wrapping_sub(s.tposted[i]) / (j - i + 1) as u64;
            opt_delta = opt_delta.min(t);
        }
        i += step_i;
    }
    opt_delta
}

/// The same minimum as a least-slope search: the ratio is the slope from
/// `(i, tposted[i])` to `(j + 1, tcompleted[j])`, and for each `j` the
/// least slope from the points left of it lies on their upper convex hull,
/// found by binary search. floor(min) = min(floor), so the result is exact.
fn peak_delta_hull(s: &BwSamples<'_>, n: usize) -> u64 {
    let step_i = s.post_list.max(1) as usize;
    let step_j = s.cq_mod.max(1) as usize;
    let pt = |i: usize| (i as i128, i128::from(s.tposted[i]));
    // (b - a) x (c - a): > 0 when a, b, c turn counter-clockwise.
    let cross = |a: (i128, i128), b: (i128, i128), c: (i128, i128)| {
        (b.0 - a.0) * (c.1 - a.1) - (b.1 - a.1) * (c.0 - a.0)
    };
    let mut hull: Vec<(i128, i128)> = Vec::new();
    let mut next_i = 0;
    let mut best = u64::MAX;
    for j in peak_js(step_j, n) {
        while next_i <= j {
            let r = pt(next_i);
            while hull.len() >= 2 && cross(hull[hull.len() - 2], hull[hull.len() - 1], r) >= 0 {
                hull.pop();
            }
            hull.push(r);
            next_i += step_i;
        }
        let p = ((j + 1) as i128, i128::from(s.tcompleted[j]));
        // The first hull edge that P is not below ends at the best point.
        let (mut lo, mut hi) = (0, hull.len() - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if cross(hull[mid], hull[mid + 1], p) < 0 {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let q = hull[lo];
        let t = ((p.1 - q.1) / (p.0 - q.0)) as u64;
        best = best.min(t);
    }
    best
}

/// One row of a latency table (iterations mode), in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatRow {
    /// Message size.
    pub size: u64,
    /// Iterations.
    pub iters: u64,
    /// Smallest sample.
    pub t_min: f64,
    /// Largest sample (after dropping the top two, as perftest does).
    pub t_max: f64,
    /// Median.
    pub t_typical: f64,
    /// Mean.
    pub t_avg: f64,
    /// Standard deviation.
    pub t_stdev: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p99_9: f64,
}

/// perftest's `LAT_MEASURE_TAIL`: the largest samples it drops.
const LAT_MEASURE_TAIL: usize = 2;

/// perftest's `print_report_lat` arithmetic. `deltas` are the differences
/// between consecutive post times, in ticks (sorted here); `rtt_factor` is 2
/// for ping-pong tests (half a round trip) and 1 for READ.
pub fn lat_row(
    size: usize,
    iters: u64,
    deltas: &mut [u64],
    rate: &Rate,
    rtt_factor: f64,
) -> LatRow {
    deltas.sort_unstable();
    if deltas.len() <= LAT_MEASURE_TAIL + 1 {
        return LatRow {
            size: size as u64,
            iters,
            ..LatRow::default()
        };
    }
    let m = deltas.len() - LAT_MEASURE_TAIL;
    let q = rate.per_us * rtt_factor;
    let median = if (m - 1) % 2 != 0 {
        (deltas[m / 2] + deltas[m / 2 - 1]) / 2
    } else {
        deltas[m / 2]
    };
    let avg = deltas[..m].iter().map(|&d| d as f64 / q).sum::<f64>() / m as f64;
    let var = deltas[..m]
        .iter()
        .map(|&d| (avg - d as f64 / q).powi(2))
        .sum::<f64>()
        / m as f64;
    let at = |f: f64| deltas[((m as f64 * f).ceil() as usize).min(deltas.len() - 1)] as f64 / q;
    LatRow {
        size: size as u64,
        iters,
        t_min: deltas[0] as f64 / q,
        t_max: deltas[m] as f64 / q,
        t_typical: median as f64 / q,
        t_avg: avg,
        t_stdev: var.sqrt(),
        p99: at(0.99),
        p99_9: at(0.999),
    }
}

/// A latency row of duration mode: mean latency and transactions per second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatDurRow {
    /// Message size.
    pub size: u64,
    /// Iterations counted.
    pub iters: u64,
    /// Mean latency in microseconds.
    pub t_avg: f64,
    /// Iterations per second.
    pub tps: f64,
}

/// A finished table.
#[derive(Debug, Clone, Default)]
pub struct Table {
    /// Bandwidth rows.
    pub bw: Vec<BwRow>,
    /// Latency rows.
    pub lat: Vec<LatRow>,
    /// Duration-mode latency rows.
    pub lat_dur: Vec<LatDurRow>,
}

/// Prints the banner perftest prints before a test; `api`: how the QPs post
/// their sends (perftest's "ibv_wr* API" line).
pub fn banner(o: &Opts, dev: &Device, rate: &Rate, api: Option<SendApi>) {
    let (device, mtu, gid_index) = (dev.ctx.name(), dev.mtu, dev.gid_index);
    println!("{LINE}");
    println!("                    {}", title(o));
    println!(
        " Data path       : {}\t\tDevice         : {device}",
        o.path.name()
    );
    println!(" Number of qps   : {}\t\tTransport type : IB", o.num_qps);
    println!(" Connection type : RC\t\tUsing SRQ      : OFF");
    if o.test.is_bw() {
        println!(" TX depth        : {}", o.tx_depth);
        println!(" CQ Moderation   : {}", o.cq_mod);
        println!(" Post List       : {}", o.post_list);
    } else {
        println!(" TX depth        : {}", o.tx_depth);
    }
    if o.test.verb() == Verb::Send {
        println!(" RX depth        : {}", o.rx_depth);
    }
    if o.test.verb().writes_local() {
        println!(" Outstand reads  : {}", dev.max_rd_atomic);
    }
    println!(" Mtu             : {mtu}[B]");
    println!(" Link type       : Ethernet");
    println!(" GID index       : {gid_index}");
    println!(" Max inline data : {}[B]", o.inline_size);
    if let Some(api) = api {
        let on = if api == SendApi::Extended {
            "ON"
        } else {
            "OFF"
        };
        println!(" ibv_wr* API     : {on}");
    }
    println!(" Events          : {}", if o.events { "ON" } else { "OFF" });
    if let Some((file, offset)) = dev.poll_fn() {
        println!(" Poll function   : {file}+{offset:#x}");
    }
    let cpuinfo = rate
        .cpuinfo_mhz
        .map_or("unknown".to_owned(), |m| format!("{m:.3}"));
    println!(
        " Clock           : {:.3} MHz measured (cpuinfo {cpuinfo} MHz)",
        rate.per_us
    );
    if let Some(d) = o.duration {
        println!(" Duration        : {d} s (margin {:.2} s)", o.margin);
    }
    println!("{LINE}");
}

/// The table header line.
pub fn header(o: &Opts) -> String {
    if o.test.is_bw() {
        let unit = if o.report_gbits { "Gb/sec" } else { "MB/sec" };
        format!(" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]")
    } else if o.duration.is_some() {
        " #bytes        #iterations       t_avg[usec]    tps average".to_owned()
    } else {
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
         t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] "
            .to_owned()
    }
}

/// One bandwidth line, in perftest's format (more decimals when small).
pub fn bw_line(r: &BwRow, gbits: bool) -> String {
    if gbits && r.bw_avg < 0.1 {
        format!(
            " {:<7}    {:<10}       {:<7.6}            {:<7.6}\t\t   {:<7.6}",
            r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate
        )
    } else {
        format!(
            " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
            r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate
        )
    }
}

/// The test's title as perftest prints it: the operation, then for the
/// bandwidth tests "Bidirectional" (`-b`) and "Post List" (`-l` > 1).
fn title(o: &Opts) -> String {
    let mut t = if o.test.verb() == Verb::Atomic {
        format!("Atomic {} BW Test", o.atomic.name())
    } else {
        o.test.title().to_owned()
    };
    if let Some(stem) = t.strip_suffix("BW Test") {
        let bidir = if o.bidir { "Bidirectional " } else { "" };
        let list = if o.post_list > 1 { "Post List " } else { "" };
        t = format!("{stem}{bidir}{list}BW Test");
    }
    t
}

/// One latency line, in perftest's format (`REPORT_FMT_LAT`: the iteration
/// count unpadded).
pub fn lat_line(r: &LatRow) -> String {
    format!(
        " {:<7} {}          {:<7.2}        {:<7.2}      {:<7.2}  \t       {:<7.2}     \t{:<7.2}\t\t{:<7.2} \t\t{:<7.2}",
        r.size, r.iters, r.t_min, r.t_max, r.t_typical, r.t_avg, r.t_stdev, r.p99, r.p99_9
    )
}

/// One duration-mode latency line, in perftest's format.
pub fn lat_dur_line(r: &LatDurRow) -> String {
    format!(
        " {:<7}       {}            {:<7.2}        {:<7.2}",
        r.size, r.iters, r.t_avg, r.tps
    )
}

/// Writes the results as JSON (a proper JSON object; see the module docs of `perf`).
pub fn write_json(o: &Opts, device: &str, rate: &Rate, t: &Table) -> std::io::Result<()> {
    let Some(path) = &o.out_json else {
        return Ok(());
    };
    let mut s = String::new();
    let unit = if o.report_gbits { "Gb/sec" } else { "MB/sec" };
    let _ = write!(
        s,
        "{{\n  \"tool\": \"rdma-verbs perf\",\n  \"test\": \"{}\",\n  \"path\": \"{}\",\n  \
         \"device\": \"{}\",\n  \"num_qps\": {},\n  \"tx_depth\": {},\n  \"rx_depth\": {},\n  \
         \"cq_mod\": {},\n  \"post_list\": {},\n  \"inline_size\": {},\n  \"events\": {},\n  \
         \"bidirectional\": {},\n  \"duration_s\": {},\n  \"tsc_mhz\": {:.3},\n  \"bw_unit\": \"{unit}\",\n  \
         \"results\": [",
        o.test.name(),
        o.path.name(),
        json_escape(device),
        o.num_qps,
        o.tx_depth,
        o.rx_depth,
        o.cq_mod,
        o.post_list,
        o.inline_size,
        o.events,
        o.bidir,
        o.duration.map_or("null".to_owned(), |d| d.to_string()),
        rate.per_us,
    );
    let mut first = true;
    let mut sep = |s: &mut String| {
        s.push_str(if first { "\n    " } else { ",\n    " });
        first = false;
    };
    for r in &t.bw {
        sep(&mut s);
        let _ = write!(
            s,
            "{{\"size\": {}, \"iters\": {}, \"bw_peak\": {}, \"bw_avg\": {}, \"msg_rate_mpps\": {}}}",
            r.size, r.iters, r.bw_peak, r.bw_avg, r.msg_rate
        );
    }
    for r in &t.lat {
        sep(&mut s);
        let _ = write!(
            s,
            "{{\"size\": {}, \"iters\": {}, \"t_min\": {}, \"t_max\": {}, \"t_typical\": {}, \
             \"t_avg\": {}, \"t_stdev\": {}, \"p99\": {}, \"p99_9\": {}}}",
            r.size, r.iters, r.t_min, r.t_max, r.t_typical, r.t_avg, r.t_stdev, r.p99, r.p99_9
        );
    }
    for r in &t.lat_dur {
        sep(&mut s);
        let _ = write!(
            s,
            "{{\"size\": {}, \"iters\": {}, \"t_avg\": {}, \"tps\": {}}}",
            r.size, r.iters, r.t_avg, r.tps
        );
    }
    s.push_str("\n  ]\n}\n");
    std::fs::write(path, s)
}

fn json_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
            c => vec![c],
        })
        .collect()
}

/// A bandwidth row on the wire (sent to the peer, which prints it too):
/// `"bwr1:"` and five 16-digit hex fields (`f64` bits for the rates), NUL-ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WireRow(pub Option<BwRow>);

const WIRE_ROW_LEN: usize = 5 + 1 + 5 * 17;

impl WireMessage for WireRow {
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()> {
        let r = self.0.unwrap_or_default();
        let mut s = format!(
            "bwr1:{}:{:016x}:{:016x}:{:016x}:{:016x}:{:016x}",
            u8::from(self.0.is_some()),
            r.size,
            r.iters,
            r.bw_peak.to_bits(),
            r.bw_avg.to_bits(),
            r.msg_rate.to_bits()
        )
        .into_bytes();
        s.resize(WIRE_ROW_LEN, 0);
        w.write_all(&s)
            .and_then(|()| w.flush())
            .map_err(|source| Error::Io {
                what: "sending the results to the peer",
                source,
            })
    }

    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<WireRow> {
        let mut buf = [0u8; WIRE_ROW_LEN];
        r.read_exact(&mut buf).map_err(|source| Error::Io {
            what: "receiving the peer's results",
            source,
        })?;
        let text = std::str::from_utf8(&buf)
            .map_err(|_| Error::Protocol("results message is not text".into()))?
            .trim_end_matches('\0');
        let bad = || Error::Protocol(format!("malformed results message {text:?}"));
        let mut f = text.strip_prefix("bwr1:").ok_or_else(bad)?.split(':');
        let present = f.next().ok_or_else(bad)? == "1";
        let mut next = || -> Result<u64> {
            u64::from_str_radix(f.next().ok_or_else(bad)?, 16).map_err(|_| bad())
        };
        let row = BwRow {
            size: next()?,
            iters: next()?,
            bw_peak: f64::from_bits(next()?),
            bw_avg: f64::from_bits(next()?),
            msg_rate: f64::from_bits(next()?),
        };
        Ok(WireRow(present.then_some(row)))
    }
}

/// The test-parameter fingerprint on the wire: 4-digit length, then the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(pub String);

impl WireMessage for Fingerprint {
    fn write_to<W: Write + ?Sized>(&self, w: &mut W) -> Result<()> {
        let msg = format!("{:04x}{}", self.0.len().min(0xffff), self.0);
        w.write_all(msg.as_bytes())
            .and_then(|()| w.flush())
            .map_err(|source| Error::Io {
                what: "sending the test parameters",
                source,
            })
    }

    fn read_from<R: Read + ?Sized>(r: &mut R) -> Result<Fingerprint> {
        let io = |source| Error::Io {
            what: "receiving the peer's test parameters",
            source,
        };
        let mut len = [0u8; 4];
        r.read_exact(&mut len).map_err(io)?;
        let n = std::str::from_utf8(&len)
            .ok()
            .and_then(|s| usize::from_str_radix(s, 16).ok())
            .ok_or_else(|| Error::Protocol("the peer is not a `perf` of this crate".into()))?;
        let mut text = vec![0u8; n];
        r.read_exact(&mut text).map_err(io)?;
        Ok(Fingerprint(String::from_utf8_lossy(&text).into_owned()))
    }
}

/// True for the tests whose latency is half a round trip.
pub fn rtt_factor(test: Test) -> f64 {
    if test == Test::ReadLat { 1.0 } else { 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_peak_search_matches_perftests_pairs() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for case in 0..3000 {
            let n = 1 + rnd(300) as usize;
            let (mut tp, mut tc) = (Vec::with_capacity(n), Vec::with_capacity(n));
            let mut t = rnd(1 << 40);
            for _ in 0..n {
                t += rnd(if case % 3 == 0 { 5 } else { 1000 });
                tp.push(t);
            }
            for p in &tp {
                tc.push(p + rnd(if case % 5 == 0 { 3 } else { 100_000 }));
            }
            let (post_list, cq_mod) = (1 + rnd(8), 1 + rnd(120));
            if case % 2 == 0 {
                // As in a run: only signaled messages have a completion time.
                for (j, c) in tc.iter_mut().enumerate() {
                    if (j as u64 + 1) % cq_mod != 0 && j + 1 != n {
                        *c = 0;
                    }
                }
            }
            let s = BwSamples {
                size: 2,
                iters: n as u64,
                post_list,
                cq_mod,
                tposted: &tp,
                tcompleted: &tc,
                no_peak: false,
            };
            assert_eq!(
                peak_delta_hull(&s, n),
                peak_delta_pairs(&s, n),
                "case {case}: n {n}, post_list {}, cq_mod {}",
                s.post_list,
                s.cq_mod
            );
        }
    }

    #[test]
    fn latency_statistics_follow_perftest() {
        let rate = Rate {
            per_us: 1.0,
            cpuinfo_mhz: None,
        };
        // 10 samples; the two largest are dropped: m = 8.
        let mut d = vec![10, 2, 4, 6, 8, 12, 14, 16, 100, 200];
        let r = lat_row(2, 11, &mut d, &rate, 2.0);
        assert_eq!(r.t_min, 1.0);
        assert_eq!(r.t_max, 50.0); // delta[m] = 100
        assert_eq!(r.t_typical, 4.5); // (8 + 10) / 2 / 2
        assert_eq!(r.t_avg, 4.5);
    }

    #[test]
    fn bandwidth_average() {
        let rate = Rate {
            per_us: 1.0,
            cpuinfo_mhz: None,
        };
        let tposted = [0u64; 4];
        let tcompleted = [0, 0, 0, 1_000_000];
        let s = BwSamples {
            size: 1_048_576,
            iters: 4,
            post_list: 1,
            cq_mod: 4,
            tposted: &tposted,
            tcompleted: &tcompleted,
            no_peak: false,
        };
        let r = bw_row(&s, &rate, false);
        assert!((r.bw_avg - 4.0).abs() < 1e-9);
        assert!((r.msg_rate - 4e-6).abs() < 1e-12);
    }

    #[test]
    fn wire_row_roundtrip() {
        let row = BwRow {
            size: 2,
            iters: 5000,
            bw_peak: 0.5,
            bw_avg: 0.25,
            msg_rate: 0.125,
        };
        let mut v = Vec::new();
        WireRow(Some(row)).write_to(&mut v).unwrap();
        assert_eq!(v.len(), WIRE_ROW_LEN);
        assert_eq!(WireRow::read_from(&mut &v[..]).unwrap(), WireRow(Some(row)));
    }
}
