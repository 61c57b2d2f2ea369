//! The command line: perftest's flags where they apply, with perftest's defaults
//! and its `force_dependecies` rules, so that the same flags give the same work.

use std::path::PathBuf;

/// Which benchmark to run (the subcommand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// RDMA WRITE bandwidth (`ib_write_bw`).
    WriteBw,
    /// RDMA READ bandwidth (`ib_read_bw`).
    ReadBw,
    /// SEND bandwidth (`ib_send_bw`).
    SendBw,
    /// RDMA WRITE ping-pong latency (`ib_write_lat`).
    WriteLat,
    /// SEND ping-pong latency (`ib_send_lat`).
    SendLat,
    /// RDMA READ latency (`ib_read_lat`).
    ReadLat,
    /// Atomic bandwidth (`ib_atomic_bw`): 8-byte fetch-and-add or compare-and-swap.
    AtomicBw,
}

/// The operation a test posts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// RDMA WRITE.
    Write,
    /// RDMA READ.
    Read,
    /// SEND / RECV.
    Send,
    /// Atomic fetch-and-add / compare-and-swap (READ-like: the NIC writes the
    /// old value into a local 8-byte buffer).
    Atomic,
}

impl Verb {
    /// True for READ and atomics: the NIC writes their local buffers (owned
    /// destinations on the safe path), and they count against `-o`.
    pub fn writes_local(self) -> bool {
        matches!(self, Verb::Read | Verb::Atomic)
    }
}

/// `-A`: which atomic operation `atomic_bw` posts (perftest's `atomicType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// `FETCH_AND_ADD` (the default): adds 1 (perftest's `ATOMIC_ADD_VALUE`).
    FetchAdd,
    /// `CMP_AND_SWAP`: compare 0, swap 0 (perftest's zeroed `compare_add` and
    /// `ATOMIC_SWAP_VALUE`).
    CmpSwap,
}

impl AtomicOp {
    /// perftest's name of the operation.
    pub fn name(self) -> &'static str {
        match self {
            AtomicOp::FetchAdd => "FETCH_AND_ADD",
            AtomicOp::CmpSwap => "CMP_AND_SWAP",
        }
    }
}

/// perftest's `DEF_SIZE_ATOMIC`: atomics always move 8 bytes.
pub const ATOMIC_SIZE: usize = 8;

impl Test {
    /// Every test, in the order of the usage text.
    pub const ALL: [Test; 7] = [
        Test::WriteBw,
        Test::ReadBw,
        Test::SendBw,
        Test::WriteLat,
        Test::SendLat,
        Test::ReadLat,
        Test::AtomicBw,
    ];

    /// The subcommand name, e.g. `write_bw`.
    pub fn name(self) -> &'static str {
        match self {
            Test::WriteBw => "write_bw",
            Test::ReadBw => "read_bw",
            Test::SendBw => "send_bw",
            Test::WriteLat => "write_lat",
            Test::SendLat => "send_lat",
            Test::ReadLat => "read_lat",
            Test::AtomicBw => "atomic_bw",
        }
    }

    /// The banner title perftest prints.
    pub fn title(self) -> &'static str {
        match self {
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadBw => "RDMA_Read BW Test",
            Test::SendBw => "Send BW Test",
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::SendLat => "Send Latency Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::AtomicBw => "Atomic BW Test",
        }
    }

    /// True for the bandwidth tests.
    pub fn is_bw(self) -> bool {
        matches!(
            self,
            Test::WriteBw | Test::ReadBw | Test::SendBw | Test::AtomicBw
        )
    }

    /// The verb the test posts.
    pub fn verb(self) -> Verb {
        match self {
            Test::WriteBw | Test::WriteLat => Verb::Write,
            Test::ReadBw | Test::ReadLat => Verb::Read,
            Test::SendBw | Test::SendLat => Verb::Send,
            Test::AtomicBw => Verb::Atomic,
        }
    }
}

/// Which data path the test uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataPath {
    /// `post_send_list` with `SharedMr`/`Mr` buffers and `Cq::poll`.
    Safe,
    /// `unsafe post_send_raw` with C `ibv_send_wr` lists and `Cq::poll_raw`.
    Raw,
    /// `Cq::scope`: requests borrow their buffers, light completions.
    Scoped,
}

impl DataPath {
    /// `safe` or `raw`.
    pub fn name(self) -> &'static str {
        match self {
            DataPath::Safe => "safe",
            DataPath::Raw => "raw",
            DataPath::Scoped => "scoped",
        }
    }
}

/// How `--async`'s client keeps its requests in flight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AsyncShape {
    /// `--async N`: one task, a window of N awaited operations (`AsyncQp::post`).
    #[default]
    Window,
    /// `--async-tasks N`: N tasks awaiting one operation at a time each.
    Tasks,
    /// `--async-stream N`: one task posting with `AsyncQp::post_send`, N in
    /// flight, and taking completions in batches (`AsyncCq::next_batch`).
    Stream,
}

/// perftest's `MSG_SIZE_CQ_MOD_LIMIT`: above it, CQ moderation is off unless `-Q` is given.
const MSG_SIZE_CQ_MOD_LIMIT: usize = 8192;
/// perftest's `MAX_SIZE` (the largest size of `-a`).
pub const MAX_SIZE: usize = 1 << 23;
/// Above this many iterations (per QP) perftest does not compute the peak
/// (its O(n²) search).
const PEAK_ITERS_LIMIT: u64 = 20000;
/// perftest's ranges (`MIN_ITER`..`MAX_ITER`, `MAX_SIZE` of `-s`, `MAX_TX`,
/// `MAX_RX`, `MAX_QP_NUM`, `MAX_CQ_MOD`, `MAX_INLINE`), refused outside them
/// as perftest refuses them.
const MAX_ITERS: u64 = 100_000_000;
const MAX_MSG_SIZE: usize = 0x7fff_ffff;
const MAX_TX_DEPTH: u32 = 15000;
const MAX_RX_DEPTH: u32 = 16384;
const MAX_QPS: u32 = 16384;
const MAX_CQ_MOD: u32 = 1024;
const MAX_INLINE: u32 = 912;
/// The longest `-D` (a year).
const MAX_DURATION_SECS: u64 = 365 * 24 * 3600;

/// Everything the command line sets, after perftest's dependency rules.
#[derive(Debug, Clone)]
pub struct Opts {
    /// The test.
    pub test: Test,
    /// Safe or raw data path.
    pub path: DataPath,
    /// `None`: server; `Some`: client of that host.
    pub host: Option<String>,
    /// `-d`: device name (default `$RDMA_VERBS_DEVICE`, else the first).
    pub device: Option<String>,
    /// `-i`: port of the device.
    pub ib_port: u8,
    /// `-x`: GID index (default: the RoCE v2 IPv4-mapped GID, else 0).
    pub gid_index: Option<u8>,
    /// `-p`: TCP port of the exchange.
    pub port: u16,
    /// Message sizes: one, or 2..8 MiB with `-a`.
    pub sizes: Vec<usize>,
    /// `-a` given.
    pub all: bool,
    /// `-n`: iterations per QP (0 in duration mode).
    pub iters: u64,
    /// `-D`: duration in seconds (`None`: iterations mode).
    pub duration: Option<u64>,
    /// Warm-up / cool-down margin of duration mode, in seconds.
    pub margin: f64,
    /// `-t`: send queue depth (work requests in flight per QP).
    pub tx_depth: u32,
    /// `-r`: receive queue depth.
    pub rx_depth: u32,
    /// `-q`: number of QPs.
    pub num_qps: u32,
    /// `-l`: work requests per `post_send` call.
    pub post_list: u32,
    /// `-Q`: one signaled completion every `cq_mod` work requests.
    pub cq_mod: u32,
    /// `-I`: largest size sent inline (0: never).
    pub inline_size: u32,
    /// `-e`: sleep on a completion channel instead of busy polling.
    pub events: bool,
    /// `-b`: both sides send.
    pub bidir: bool,
    /// `--report_gbits`: Gb/s instead of MiB/s.
    pub report_gbits: bool,
    /// `--out_json` (and `--out_json_file=FILE`): the JSON report's file.
    pub out_json: Option<PathBuf>,
    /// `--run_infinitely`: report every `-D` seconds (default 5), forever.
    pub run_infinitely: bool,
    /// `-N` or too many iterations: no peak bandwidth.
    pub no_peak: bool,
    /// `--use_old_post_send`: post sends with `ibv_post_send` even where the
    /// provider has the extended work request API.
    pub old_post_send: bool,
    /// `-A`: the atomic operation (atomic_bw).
    pub atomic: AtomicOp,
    /// `-o`: outstanding READs/atomics per QP (`max_rd_atomic` and
    /// `max_dest_rd_atomic`); `None` or 0: the device's `max_qp_rd_atom`.
    pub outs: Option<u32>,
    /// `--async N`: the client streams through `rdma_verbs::tokio::AsyncQp`
    /// with N requests in flight (the server runs the safe path).
    pub inflight: Option<u32>,
    /// `--async-tasks N`, `--async-stream N`: the shape of `--async`'s stream.
    pub async_shape: AsyncShape,
    /// `--rx-burst`: the send_bw receiver posts every receive before the run
    /// and reads them only once the sender is done (no empty polls).
    pub rx_burst: bool,
}

/// The usage text.
pub fn usage() -> String {
    let tests: Vec<&str> = Test::ALL.iter().map(|t| t.name()).collect();
    format!(
        "usage: perf <{}> [options] [host]\n\
         \n\
         Without a host: server; with one: client of that host. Both sides take the same options.\n\
         \n\
         options (perftest's, where they apply):\n\
         \x20 -d, --ib-dev=DEV          device (default $RDMA_VERBS_DEVICE, else the first)\n\
         \x20 -i, --ib-port=PORT        device port (default 1)\n\
         \x20 -x, --gid-index=IDX       GID index (default: the RoCE v2 IPv4-mapped GID)\n\
         \x20 -p, --port=PORT           TCP port of the endpoint exchange (default 18515)\n\
         \x20 -c, --connection=RC       connection type: RC (the only one perf runs)\n\
         \x20 -s, --size=BYTES          message size (default 65536 for bw, 2 for lat;\n\
         \x20                           atomic_bw: always 8, other sizes are refused)\n\
         \x20 -a, --all                 sizes 2 to 2^23 (not with atomic_bw)\n\
         \x20 -A, --atomic_type=TYPE    atomic_bw: CMP_AND_SWAP or FETCH_AND_ADD (default)\n\
         \x20 -o, --outs=N              outstanding READs/atomics per QP (read and atomic\n\
         \x20                           tests; default and ceiling: the device's maximum)\n\
         \x20 -n, --iters=N             iterations (default 5000 for write_bw, else 1000)\n\
         \x20 -D, --duration=SECS       run for SECS seconds instead of -n\n\
         \x20 -t, --tx-depth=N          send queue depth (default 128 for bw, 1 for lat)\n\
         \x20 -r, --rx-depth=N          receive queue depth (default 512 for send tests)\n\
         \x20 -q, --qp=N                number of QPs (bw tests; default 1)\n\
         \x20 -l, --post_list=N         work requests per post call (bw tests; default 1)\n\
         \x20 -Q, --cq-mod=N            one completion every N work requests (default 100,\n\
         \x20                           1 above 8 KiB unless given)\n\
         \x20 -I, --inline_size=BYTES   send messages up to BYTES inline (default 0)\n\
         \x20 -e, --events              sleep on a completion channel instead of polling\n\
         \x20                           (not with -b)\n\
         \x20 -b, --bidirectional       both sides send (bw tests)\n\
         \x20 -N, --noPeak              do not compute the peak bandwidth\n\
         \x20 -F, --CPU-freq            accepted for compatibility (no effect)\n\
         \x20     --use_old_post_send   post sends with ibv_post_send (default: the extended\n\
         \x20                           ibv_wr_* API where the provider has it; the banner's\n\
         \x20                           \"ibv_wr* API\" line says which; Debian 12's perftest 4.5\n\
         \x20                           prints OFF there on rxe)\n\
         \x20     --report_gbits        bandwidth in Gb/s instead of MiB/s\n\
         \x20     --out_json            also write the results as JSON (our schema: a list\n\
         \x20                           of rows) to perftest_out.json, or to:\n\
         \x20     --out_json_file=FILE  the JSON file (implies --out_json)\n\
         \x20     --run_infinitely      bw tests: report every -D seconds (default 5), forever\n\
         \x20     --safe                safe data path: post_send_list + SharedMr/Mr + Cq::poll\n\
         \x20                           (default)\n\
         \x20     --raw                 raw data path: unsafe post_send_raw + Cq::poll_raw\n\
         \x20     --scoped              scoped safe path (bw tests): Cq::scope, borrowed buffers,\n\
         \x20                           light completions; not with -b, -D, -e, -I, --run_infinitely\n\
         \x20     --async=N             client of write_bw/send_bw through rdma_verbs::tokio (built\n\
         \x20                           with --features tokio) on a current-thread runtime: one\n\
         \x20                           task, N awaited (signaled) requests in flight (-Q unused);\n\
         \x20                           one QP, -l 1, -n only; the server runs the safe path\n\
         \x20     --async-tasks=N       the same with N tasks of one request at a time each\n\
         \x20     --async-stream=N      the same with one task posting (AsyncQp::post_send) and\n\
         \x20                           taking completions in batches (AsyncCq::next_batch)\n\
         \x20     --rx-burst            send_bw with -n: the receiver posts all -n receives before\n\
         \x20                           the run and polls only once the sender is done, so it\n\
         \x20                           never polls an empty CQ (cargo xtask insn's receiver guard)\n\
         \x20 -h, --help                this text",
        tests.join("|")
    )
}

mod cmdline;
mod rules;

pub use cmdline::parse;

impl Opts {
    /// True on the server side (no host given).
    pub fn is_server(&self) -> bool {
        self.host.is_none()
    }

    /// True when this side posts the test's work requests.
    pub fn sends(&self) -> bool {
        !self.is_server() || self.bidir || matches!(self.test, Test::WriteLat | Test::SendLat)
    }

    /// True when this side receives SENDs.
    pub fn receives(&self) -> bool {
        self.test.verb() == Verb::Send && (self.is_server() || self.bidir || !self.test.is_bw())
    }

    /// The largest message size of the run.
    pub fn max_size(&self) -> usize {
        self.sizes.iter().copied().max().unwrap_or(1)
    }

    /// What must match between the two sides, as text (sent in the handshake).
    pub fn fingerprint(&self) -> String {
        format!(
            "{} {} sizes={:?} a={} n={} D={:?} t={} r={} q={} l={} Q={} I={} e={} b={} inf={} \
             A={} o={:?} async={:?}/{:?} burst={}",
            self.test.name(),
            self.path.name(),
            self.sizes,
            self.all,
            self.iters,
            self.duration,
            self.tx_depth,
            self.rx_depth,
            self.num_qps,
            self.post_list,
            self.cq_mod,
            self.inline_size,
            self.events,
            self.bidir,
            self.run_infinitely,
            self.atomic.name(),
            self.outs,
            self.inflight,
            self.async_shape,
            self.rx_burst
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Opts {
        let args: Vec<String> = s.split_whitespace().map(str::to_owned).collect();
        parse(&args).unwrap().unwrap()
    }

    #[test]
    fn perftest_defaults() {
        let o = p("write_bw");
        assert_eq!(
            (o.sizes[0], o.iters, o.tx_depth, o.cq_mod),
            (65536, 5000, 128, 1)
        );
        let o = p("write_bw -s 2 -n 1000 10.0.0.1");
        assert_eq!(
            (o.tx_depth, o.cq_mod, o.host.as_deref()),
            (128, 100, Some("10.0.0.1"))
        );
        let o = p("send_bw -s 64 -n 100");
        assert_eq!((o.tx_depth, o.rx_depth, o.cq_mod), (100, 100, 100));
        let o = p("send_lat");
        assert_eq!(
            (o.sizes[0], o.tx_depth, o.cq_mod, o.rx_depth),
            (2, 1, 1, 512)
        );
        let o = p("read_bw -s2 --size=8 --raw");
        assert_eq!((o.sizes[0], o.inline_size, o.path), (8, 0, DataPath::Raw));
        let o = p("write_bw -l 4 -n 1000 -s 2");
        assert_eq!(o.cq_mod, 4);
        let o = p("write_bw -D 8");
        assert_eq!((o.iters, o.no_peak, o.margin), (0, true, 2.0));
        // Whole seconds, as perftest's integer division: -D 3 counts all 3.
        assert_eq!(
            (p("send_lat -D 3").margin, p("write_bw -D 20").margin),
            (0.0, 5.0)
        );
    }

    /// `--rx-burst` posts every receive of the run: `-r` becomes `-n`.
    #[test]
    fn rx_burst_posts_every_receive() {
        let o = p("send_bw -s 2 -n 3000 --rx-burst --scoped");
        assert_eq!((o.rx_depth, o.rx_burst), (3000, true));
        for bad in [
            "write_bw -n 1000 --rx-burst",
            "send_bw -n 1000 -r 512 --rx-burst",
            "send_bw -D 5 --rx-burst",
            "send_bw -n 1000 -b --rx-burst",
            "send_bw -n 20000 --rx-burst",
        ] {
            let args: Vec<String> = bad.split_whitespace().map(str::to_owned).collect();
            let e = parse(&args).expect_err(bad);
            assert!(e.contains("--rx-burst"), "{bad}: {e}");
        }
    }

    /// perftest's ranges and refusals (an outside comparison found them
    /// taken or refused late).
    #[test]
    fn perftest_limits_and_refusals() {
        let err = |s: &str| {
            let args: Vec<String> = s.split_whitespace().map(str::to_owned).collect();
            parse(&args).expect_err(s)
        };
        for (args, says) in [
            (
                "write_lat -n 100000001",
                "-n must be between 5 and 100000000",
            ),
            (
                "write_bw -s 2147483648",
                "-s must be between 1 and 2147483647",
            ),
            ("write_bw -t 15001", "-t must be at most 15000"),
            ("send_bw -r 16385", "-r must be at most 16384"),
            ("write_bw -q 16385", "-q must be at most 16384"),
            ("write_bw -Q 1025", "-Q must be at most 1024"),
            ("write_bw -I 913", "-I must be at most 912"),
            ("send_bw -e -b", "-e with -b is not supported"),
            (
                "send_bw --run_infinitely -b",
                "run_infinitely mode is not supported in SEND Bidirectional BW test",
            ),
            ("write_bw -c UD", "perf runs RC connections only"),
        ] {
            let e = err(args);
            assert!(e.contains(says), "{args}: {e}");
        }
        assert_eq!(
            p("write_bw -c RC -n 100000000 -t 15000 -I 912").iters,
            100_000_000
        );
        assert_eq!(p("write_bw --connection=RC").test, Test::WriteBw);
        // The peak is off above 20,000 iterations per QP, not in all.
        assert!(!p("write_bw -s 2 -n 15000 -q 2").no_peak);
        assert!(p("write_bw -s 2 -n 25000").no_peak);
    }

    #[test]
    fn atomic_bw_follows_perftest() {
        let o = p("atomic_bw");
        assert_eq!(
            (o.sizes.as_slice(), o.iters, o.tx_depth, o.cq_mod, o.atomic),
            (&[8][..], 1000, 128, 100, AtomicOp::FetchAdd)
        );
        assert_eq!(
            (o.inline_size, o.outs, o.test.verb()),
            (0, None, Verb::Atomic)
        );
        let o = p("atomic_bw -s 8 -A CMP_AND_SWAP -o 4 --raw");
        assert_eq!(
            (o.sizes[0], o.atomic, o.outs, o.inline_size),
            (8, AtomicOp::CmpSwap, Some(4), 0)
        );
        let o = p("atomic_bw --atomic_type=FETCH_AND_ADD -l 4 -n 1000");
        assert_eq!((o.atomic, o.cq_mod), (AtomicOp::FetchAdd, 4));
        assert_eq!(p("read_bw -o 2").outs, Some(2));
        assert!(p("atomic_bw -A CMP_AND_SWAP").fingerprint() != p("atomic_bw").fingerprint());
    }

    /// As perftest: `--out_json` is a switch (it took the next argument,
    /// the server's address, for a file name), `--out_json_file` the name.
    #[test]
    fn out_json_is_a_switch_and_the_file_apart() {
        let o = p("write_bw --out_json 10.99.0.1");
        assert_eq!(o.out_json, Some(PathBuf::from("perftest_out.json")));
        assert_eq!(o.host.as_deref(), Some("10.99.0.1"));
        let o = p("write_bw --out_json --out_json_file=/tmp/r.json");
        assert_eq!(o.out_json, Some(PathBuf::from("/tmp/r.json")));
        let o = p("write_bw --out_json_file /tmp/r.json");
        assert_eq!(o.out_json, Some(PathBuf::from("/tmp/r.json")));
        assert_eq!(p("write_bw").out_json, None);
    }

    #[test]
    #[cfg(feature = "tokio")]
    fn async_takes_its_count_and_shape() {
        let o = p("write_bw --async 16");
        assert_eq!((o.inflight, o.async_shape), (Some(16), AsyncShape::Window));
        let o = p("send_bw --async-tasks=4 -n 100");
        assert_eq!((o.inflight, o.async_shape), (Some(4), AsyncShape::Tasks));
        let o = p("send_bw --async-stream 8");
        assert_eq!((o.inflight, o.async_shape), (Some(8), AsyncShape::Stream));
        assert_ne!(
            p("write_bw --async 16").fingerprint(),
            p("write_bw --async-tasks 16").fingerprint()
        );
        assert_ne!(
            p("write_bw --async 16").fingerprint(),
            p("write_bw --async-stream 16").fingerprint()
        );
    }

    #[test]
    fn refuses_what_perftest_refuses() {
        for bad in [
            "write_lat -q 2",
            "send_bw -D 2 -e",
            "write_bw -l 3 -n 1000",
            "nope",
            "write_bw -s 0",
            "atomic_bw -s 16",
            "atomic_bw -a",
            "atomic_bw -A ADD",
            "write_bw -A FETCH_AND_ADD",
            "send_bw -o 4",
            "write_bw -D 18446744073709551615",
            "write_bw -D 31536001",
            "read_bw -I 64",
            "atomic_bw -I 8",
            "write_bw -r 10",
            "read_lat -r 2",
            "write_bw -e",
            "write_lat -e",
            "read_bw --async 16",
            "write_lat --async 1",
            "write_bw --async 16 -l 2",
            "write_bw --async 16 -q 2",
            "write_bw --async 16 -D 2",
            "send_bw --async 16 -I 8",
            "write_bw --async 0",
            "write_bw --async 200",
            "write_bw --async 16 --raw",
        ] {
            let args: Vec<String> = bad.split_whitespace().map(str::to_owned).collect();
            assert!(parse(&args).is_err(), "{bad}");
        }
    }
}
