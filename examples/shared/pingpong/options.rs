//! The ports' command line: getopt_long with GNU permutation, `strtol`
//! numbers, the options every port takes, and the `main` they share.

use std::process::ExitCode;

use rdma_verbs::device::Mtu;

/// `strtol(s, NULL, 0)`: decimal, `0x` hex or `0` octal, optional sign.
pub fn c_long(s: &str) -> Option<i64> {
    let s = s.trim_start();
    let (neg, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let v = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        i64::from_str_radix(h, 16).ok()?
    } else if s.len() > 1 && s.starts_with('0') {
        i64::from_str_radix(&s[1..], 8).ok()?
    } else {
        s.parse::<i64>().ok()?
    };
    Some(if neg { -v } else { v })
}

/// The value of option `-opt` as a `T`, or an error naming it.
pub fn num<T: TryFrom<i64>>(opt: char, v: &str) -> Result<T, String> {
    c_long(v)
        .and_then(|n| T::try_from(n).ok())
        .ok_or_else(|| format!("invalid value `{v}` for -{opt}"))
}

/// One long option: its name, its short letter, whether it takes a value.
pub type LongOpt = (&'static str, char, bool);

/// The options every `ibv_*_pingpong` takes, with the C programs' defaults.
pub struct Common {
    /// `-p`: TCP port (18515).
    pub port: u16,
    /// `-d`: device (the first found).
    pub ib_devname: Option<String>,
    /// `-i`: device port (1).
    pub ib_port: u8,
    /// `-s`: message size.
    pub size: usize,
    /// `-m`: path MTU (1024; UD has no `-m`).
    pub mtu: Mtu,
    /// `-r`: receives posted at a time (500).
    pub rx_depth: u32,
    /// `-n`: exchanges (1000).
    pub iters: u32,
    /// `-l`: service level (0).
    pub sl: u8,
    /// `-e`: sleep on CQ events.
    pub use_event: bool,
    /// `-g`: GID index (none).
    pub gidx: Option<u8>,
    /// The server to connect to (none: be the server).
    pub servername: Option<String>,
}

impl Common {
    /// The C programs' defaults, with message size `size`.
    pub fn new(size: usize) -> Common {
        Common {
            port: rdma_verbs::exchange::DEFAULT_PORT,
            ib_devname: None,
            ib_port: 1,
            size,
            mtu: Mtu::Mtu1024,
            rx_depth: 500,
            iters: 1000,
            sl: 0,
            use_event: false,
            gidx: None,
            servername: None,
        }
    }

    /// Applies option `-c` with value `v`; `Ok(false)` if it is not a common one.
    pub fn apply(&mut self, c: char, v: &str) -> Result<bool, String> {
        match c {
            'p' => self.port = num('p', v)?,
            'd' => self.ib_devname = Some(v.to_owned()),
            'i' => {
                self.ib_port = num('i', v)?;
                if self.ib_port < 1 {
                    return Err("-i must be at least 1".into());
                }
            }
            's' => self.size = num('s', v)?,
            'm' => {
                let bytes: u32 = num('m', v)?;
                self.mtu = Mtu::from_bytes(bytes)
                    .ok_or_else(|| format!("invalid MTU {v} (256, 512, 1024, 2048 or 4096)"))?;
            }
            'r' => self.rx_depth = num('r', v)?,
            'n' => self.iters = num('n', v)?,
            'l' => self.sl = num('l', v)?,
            'e' => self.use_event = true,
            // A negative index is the C programs' "none".
            'g' => {
                let g = num::<i64>('g', v)?;
                self.gidx = match u8::try_from(g) {
                    Ok(g) => Some(g),
                    Err(_) if g < 0 => None,
                    Err(_) => return Err(format!("invalid -g {g}: a GID index is 0 to 255")),
                };
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// Takes the server name from the positional arguments and checks the rest.
    pub fn finish(&mut self, mut positional: Vec<String>) -> Result<(), String> {
        match positional.len() {
            0 => {}
            1 => self.servername = positional.pop(),
            _ => return Err("too many arguments".into()),
        }
        if self.rx_depth == 0 {
            return Err("-r must be at least 1".into());
        }
        Ok(())
    }
}

/// The command line of a port that takes only common options: those named
/// by `letters`, with message size `size` by default.
#[allow(dead_code)] // rc_pingpong and srq_pingpong take options of their own
pub fn parse_common(args: &[String], letters: &str, size: usize) -> Result<Common, String> {
    let long = long_opts(letters, &[]);
    let (opts, positional) = getopt(args, &long)?;
    let mut o = Common::new(size);
    for (c, v) in opts {
        if !o.apply(c, &v)? {
            return Err(format!("invalid option -- '{c}'"));
        }
    }
    o.finish(positional)?;
    Ok(o)
}

/// A port's `main`: `-h`/`--help` prints `usage` and exits 0; options that do
/// not parse print the error and `usage` and exit 1; so does a failing `run`.
pub fn main_with<O>(
    name: &str,
    usage: fn(&str),
    parse: fn(&[String]) -> Result<O, String>,
    run: fn(&O) -> Result<(), String>,
) -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let argv0 = args.first().map_or(name, String::as_str).to_owned();
    if args.iter().skip(1).any(|a| a == "-h" || a == "--help") {
        usage(&argv0);
        return ExitCode::SUCCESS;
    }
    let o = match parse(&args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{argv0}: {e}");
            usage(&argv0);
            return ExitCode::from(1);
        }
    };
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(1)
        }
    }
}

/// getopt_long with GNU permutation over `args` (`args[0]` is the program):
/// the options in order, as (letter, value), and the positional arguments.
#[allow(clippy::type_complexity)]
pub fn getopt(
    args: &[String],
    long: &[LongOpt],
) -> Result<(Vec<(char, String)>, Vec<String>), String> {
    let mut opts = Vec::new();
    let positional = getopt_each(args, long, |c, v| {
        opts.push((c, v));
        Ok(())
    })?;
    Ok((opts, positional))
}

/// [`getopt`] that hands each option to `on_option` as soon as it is read
/// (an error from it ends the parse) and returns the positional arguments.
/// A switch takes an empty value.
pub fn getopt_each(
    args: &[String],
    long: &[LongOpt],
    mut on_option: impl FnMut(char, String) -> Result<(), String>,
) -> Result<Vec<String>, String> {
    let mut positional = Vec::new();
    let mut it = args.iter().skip(1);
    let mut only_positional = false;
    while let Some(arg) = it.next() {
        if only_positional || arg == "-" || !arg.starts_with('-') {
            positional.push(arg.clone());
        } else if arg == "--" {
            only_positional = true;
        } else if let Some(body) = arg.strip_prefix("--") {
            let (c, val) = long_option(body, long, &mut it)?;
            on_option(c, val)?;
        } else {
            short_options(&arg[1..], long, &mut it, &mut on_option)?;
        }
    }
    Ok(positional)
}

/// `--name`, `--name=value` or `--name value` (`body` without the dashes):
/// its letter and value; `rest` gives the separate value.
fn long_option<'a>(
    body: &str,
    long: &[LongOpt],
    rest: &mut impl Iterator<Item = &'a String>,
) -> Result<(char, String), String> {
    let (name, val) = match body.split_once('=') {
        Some((n, v)) => (n, Some(v.to_owned())),
        None => (body, None),
    };
    let Some(&(_, c, has_arg)) = long.iter().find(|l| l.0 == name) else {
        return Err(format!("unrecognized option '--{name}'"));
    };
    let val = match (has_arg, val) {
        (true, Some(v)) => v,
        (true, None) => rest
            .next()
            .cloned()
            .ok_or_else(|| format!("option '--{name}' requires an argument"))?,
        (false, Some(_)) => {
            return Err(format!("option '--{name}' doesn't allow an argument"));
        }
        (false, None) => String::new(),
    };
    Ok((c, val))
}

/// A cluster of short options (`-eg1`, `body` without the dash): switches
/// until one that takes a value, which is the cluster's rest or the next
/// argument from `rest`.
fn short_options<'a>(
    body: &str,
    long: &[LongOpt],
    rest: &mut impl Iterator<Item = &'a String>,
    on_option: &mut impl FnMut(char, String) -> Result<(), String>,
) -> Result<(), String> {
    let takes_arg = |c: char| long.iter().find(|l| l.1 == c).map(|l| l.2);
    for (i, c) in body.char_indices() {
        match takes_arg(c) {
            None => return Err(format!("invalid option -- '{c}'")),
            Some(false) => on_option(c, String::new())?,
            Some(true) => {
                let attached = &body[i + c.len_utf8()..];
                let v = if attached.is_empty() {
                    rest.next()
                        .cloned()
                        .ok_or_else(|| format!("option requires an argument -- '{c}'"))?
                } else {
                    attached.to_owned()
                };
                return on_option(c, v);
            }
        }
    }
    Ok(())
}

/// The long options the C programs share, by letter.
const COMMON_LONG: [LongOpt; 10] = [
    ("port", 'p', true),
    ("ib-dev", 'd', true),
    ("ib-port", 'i', true),
    ("size", 's', true),
    ("mtu", 'm', true),
    ("rx-depth", 'r', true),
    ("iters", 'n', true),
    ("sl", 'l', true),
    ("events", 'e', false),
    ("gid-idx", 'g', true),
];

/// A port's long options: the common ones named by `letters`, then `extra`.
pub fn long_opts(letters: &str, extra: &[LongOpt]) -> Vec<LongOpt> {
    COMMON_LONG
        .into_iter()
        .filter(|l| letters.contains(l.1))
        .chain(extra.iter().copied())
        .collect()
}

/// The C programs' usage text up to their option lines.
pub fn print_usage_head(argv0: &str) {
    println!("Usage:");
    println!("  {argv0}            start a server and wait for connection");
    println!("  {argv0} <host>     connect to server at <host>");
    println!();
    println!("Options:");
}

/// The C programs' help line of each common option in `letters`, in that
/// order (`h`: `--help`); `-s` names `default_size`.
pub fn print_option_lines(letters: &str, default_size: usize) {
    for c in letters.chars() {
        match c {
            'p' => println!(
                "  -p, --port=<port>      listen on/connect to port <port> (default 18515)"
            ),
            'd' => println!(
                "  -d, --ib-dev=<dev>     use IB device <dev> (default first device found)"
            ),
            'i' => println!("  -i, --ib-port=<port>   use port <port> of IB device (default 1)"),
            's' => println!(
                "  -s, --size=<size>      size of message to exchange (default {default_size})"
            ),
            'm' => println!("  -m, --mtu=<size>       path MTU (default 1024)"),
            'r' => println!(
                "  -r, --rx-depth=<dep>   number of receives to post at a time (default 500)"
            ),
            'n' => println!("  -n, --iters=<iters>    number of exchanges (default 1000)"),
            'l' => println!("  -l, --sl=<sl>          service level value"),
            'e' => println!("  -e, --events           sleep on CQ events (default poll)"),
            'g' => println!("  -g, --gid-idx=<gid index> local port gid index"),
            'h' => println!("  -h, --help             print this help"),
            other => unreachable!("no common option -{other}"),
        }
    }
}
