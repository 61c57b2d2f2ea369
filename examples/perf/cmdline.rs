//! Reading the command line into [`RawArgs`]: perftest's flags, short and
//! long, with attached (`-s64`, `--size=64`) or separate values.

use std::path::PathBuf;

use super::rules::{RawArgs, resolve};
use super::{AsyncShape, AtomicOp, DataPath, Opts, Test, usage};

/// Parses the command line (without the program name). `Err` carries the
/// message to print; `Ok(None)` means help was printed.
pub fn parse(args: &[String]) -> Result<Option<Opts>, String> {
    let mut it = args.iter();
    let Some(first) = it.next() else {
        return Err("missing the test name".into());
    };
    if first == "-h" || first == "--help" {
        println!("{}", usage());
        return Ok(None);
    }
    let test = Test::ALL
        .into_iter()
        .find(|t| t.name() == first)
        .ok_or_else(|| format!("unknown test `{first}`"))?;
    let mut raw = RawArgs::default();
    let rest: Vec<&String> = it.collect();
    let mut i = 0;
    while i < rest.len() {
        let arg = rest[i].as_str();
        i += 1;
        if !arg.starts_with('-') || arg == "-" {
            if raw.host.is_some() {
                return Err(format!("unexpected argument `{arg}` (host already given)"));
            }
            raw.host = Some(arg.to_owned());
            continue;
        }
        let (flag, mut inline_val) = split_flag(arg);
        let attached = inline_val.is_some();
        let mut value = |name: &str| -> Result<String, String> {
            if let Some(v) = inline_val.take() {
                return Ok(v);
            }
            let v = rest.get(i).ok_or_else(|| format!("{name} needs a value"))?;
            i += 1;
            Ok((*v).clone())
        };
        if read_flag(&flag, arg, attached, &mut value, &mut raw)? == Flag::Help {
            println!("{}", usage());
            return Ok(None);
        }
    }
    resolve(test, raw).map(Some)
}

/// Splits the `--long=value` and `-sVALUE` forms into the flag and its value.
fn split_flag(arg: &str) -> (String, Option<String>) {
    if let Some(long) = arg.strip_prefix("--") {
        match long.split_once('=') {
            Some((k, v)) => (format!("--{k}"), Some(v.to_owned())),
            None => (arg.to_owned(), None),
        }
    } else if arg.len() > 2 {
        (arg[..2].to_owned(), Some(arg[2..].to_owned()))
    } else {
        (arg.to_owned(), None)
    }
}

/// What a flag asked for beyond setting its field.
#[derive(PartialEq, Eq)]
enum Flag {
    Read,
    Help,
}

/// Records `flag` (written `arg` on the command line) in `raw`; `value` takes
/// its value, attached or the next argument. Switches refuse an attached value.
fn read_flag(
    flag: &str,
    arg: &str,
    attached: bool,
    value: &mut dyn FnMut(&str) -> Result<String, String>,
    raw: &mut RawArgs,
) -> Result<Flag, String> {
    match flag {
        "-d" | "--ib-dev" => raw.device = Some(value("-d")?),
        "-i" | "--ib-port" => raw.ib_port = Some(num(&value("-i")?, "-i")?),
        "-x" | "--gid-index" => raw.gid_index = Some(num(&value("-x")?, "-x")?),
        "-p" | "--port" => raw.port = Some(num(&value("-p")?, "-p")?),
        "-s" | "--size" => raw.size = Some(num(&value("-s")?, "-s")?),
        "-n" | "--iters" => raw.iters = Some(num(&value("-n")?, "-n")?),
        "-D" | "--duration" => raw.duration = Some(num(&value("-D")?, "-D")?),
        "-t" | "--tx-depth" => raw.tx_depth = Some(num(&value("-t")?, "-t")?),
        "-r" | "--rx-depth" => raw.rx_depth = Some(num(&value("-r")?, "-r")?),
        "-q" | "--qp" => raw.num_qps = Some(num(&value("-q")?, "-q")?),
        "-l" | "--post_list" => raw.post_list = Some(num(&value("-l")?, "-l")?),
        "-Q" | "--cq-mod" => raw.cq_mod = Some(num(&value("-Q")?, "-Q")?),
        "-I" | "--inline_size" => raw.inline_size = Some(num(&value("-I")?, "-I")?),
        // perftest's connection type: RC is what perf runs.
        "-c" | "--connection" => match value("-c")?.as_str() {
            "RC" => {}
            other => {
                return Err(format!(
                    "-c {other}: perf runs RC connections only (-c RC); perftest's UC, UD, \
                     XRC, DC and SRD are not supported"
                ));
            }
        },
        "-o" | "--outs" => raw.outs = Some(num(&value("-o")?, "-o")?),
        "-A" | "--atomic_type" => raw.atomic = Some(atomic_op(&value("-A")?)?),
        // As perftest: a switch, and the file's name apart.
        "--out_json" if !attached => raw.json = true,
        "--out_json_file" => raw.out_json = Some(PathBuf::from(value("--out_json_file")?)),
        "-a" | "--all" if !attached => raw.all = true,
        "-e" | "--events" if !attached => raw.events = true,
        "-b" | "--bidirectional" if !attached => raw.bidir = true,
        "-N" | "--noPeak" if !attached => raw.no_peak = true,
        "-F" | "--CPU-freq" if !attached => {}
        "--report_gbits" if !attached => raw.report_gbits = true,
        "--use_old_post_send" if !attached => raw.old_post_send = true,
        "--run_infinitely" if !attached => raw.run_infinitely = true,
        "--safe" if !attached => raw.path = Some(DataPath::Safe),
        "--raw" if !attached => raw.path = Some(DataPath::Raw),
        "--scoped" if !attached => raw.path = Some(DataPath::Scoped),
        "--rx-burst" if !attached => raw.rx_burst = true,
        "--async" => raw.inflight = Some(num(&value("--async")?, "--async")?),
        "--async-tasks" => {
            raw.inflight = Some(num(&value("--async-tasks")?, "--async-tasks")?);
            raw.async_shape = AsyncShape::Tasks;
        }
        "--async-stream" => {
            raw.inflight = Some(num(&value("--async-stream")?, "--async-stream")?);
            raw.async_shape = AsyncShape::Stream;
        }
        "-h" | "--help" => return Ok(Flag::Help),
        _ => return Err(format!("unknown option `{arg}`")),
    }
    Ok(Flag::Read)
}

/// `-A`'s value: perftest's names of the two atomic operations.
fn atomic_op(v: &str) -> Result<AtomicOp, String> {
    match v {
        "FETCH_AND_ADD" => Ok(AtomicOp::FetchAdd),
        "CMP_AND_SWAP" => Ok(AtomicOp::CmpSwap),
        other => Err(format!(
            "-A: invalid atomic type `{other}` (CMP_AND_SWAP or FETCH_AND_ADD)"
        )),
    }
}

fn num<T: std::str::FromStr>(v: &str, flag: &str) -> Result<T, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
}
