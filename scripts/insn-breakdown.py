#!/usr/bin/env python3
"""Where a `cargo xtask insn` configuration's instructions per message go.

Takes the callgrind profiles of the two runs of one configuration (N1 and N2
messages; `cargo xtask insn` keeps them in target/compare/insn-runs for the
async paths, and for every path with RDMA_VERBS_INSN_KEEP_CG=1), annotates
both with callgrind_annotate (self cost of every function, split by source
file where code was inlined), and prints (cost(N2) - cost(N1)) / (N2 - N1)
grouped by what the code does: the async layer's bookkeeping (src/tokio), its
driver task and completion channel, tokio's scheduler, reactor and Notify,
memcpy, malloc, the synchronous data path (post, poll, ledger: the work the
safe path does too), the provider, and the perf loop.

    scripts/insn-breakdown.py A_1000.cg A_3000.cg 2000 [--top N]

--top N lists the N largest functions of each group.
"""
import collections
import re
import subprocess
import sys


def costs(path):
    out = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--auto=no", path],
        capture_output=True, text=True, check=True,
    ).stdout
    d = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$", line)
        if not m or m.group(2).startswith(("=>", "<", "*")):
            continue
        if "PROGRAM TOTALS" in m.group(2):
            continue
        d[m.group(2)] += int(m.group(1).replace(",", ""))
    return d


def group(name):
    file, _, fn = name.partition(":")
    fn = re.sub(r" \[.*\]$", "", fn)
    if re.search(r"memcpy|memmove|mempcpy", fn):
        return "memcpy (requests and completions moved)"
    if re.search(r"malloc|_int_free|^free$|cfree|realloc|finish_grow", fn) or "raw_vec" in file:
        return "malloc/free"
    if ("/src/tokio/driver.rs" in file or "/src/channel" in file
            or re.search(r"ibv_get_cq_event|ibv_ack_cq|req_notify", fn)):
        return "crate driver task and completion channel"
    if "/src/tokio/" in file or "hashbrown" in file or "/hash/" in file:
        return "crate async bookkeeping (src/tokio)"
    if "/tokio-1" in file:
        if "/sync/" in file:
            return "tokio::sync (Notify)"
        if re.search(r"/runtime/(io|time|driver)", file):
            return "tokio reactor (IO driver)"
        return "tokio scheduler and wakers"
    if "mio-" in file or "epoll" in fn:
        return "tokio reactor (IO driver)"
    if re.search(r"/src/(ledger|qp|cq|mr|values|sys)/", file):
        return "sync data path (post, poll, ledger)"
    if "/rustc/" in file or file.startswith("/rust/"):
        # Inlined standard-library code: counted with the function it is in.
        if "rdma_verbs::tokio::driver" in fn:
            return "crate driver task and completion channel"
        if "rdma_verbs::tokio" in fn or "hashbrown" in fn:
            return "crate async bookkeeping (src/tokio)"
        if re.search(r"rdma_verbs::(ledger|qp|cq|mr)", fn):
            return "sync data path (post, poll, ledger)"
        if "PollFn" in fn or "perf::" in fn:
            return "the perf loop"
        if "tokio::" in fn:
            return "tokio scheduler and wakers"
    if "examples/perf" in file:
        return "the perf loop"
    if file.startswith("???") or "librxe" in name or "libibverbs" in name:
        return "provider and libibverbs"
    return "other (std, libc)"


def main():
    args = sys.argv[1:]
    top = 0
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 3:
        sys.exit(__doc__)
    a, b, messages = costs(args[0]), costs(args[1]), float(args[2])
    totals = collections.Counter()
    members = collections.defaultdict(list)
    for name in set(a) | set(b):
        per_msg = (b[name] - a[name]) / messages
        totals[group(name)] += per_msg
        members[group(name)].append((per_msg, name))
    for g, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"{v:9.1f}  {g}")
        for per_msg, name in sorted(members[g], reverse=True)[:top]:
            print(f"           {per_msg:8.1f}  {name[-120:]}")
    print(f"{sum(totals.values()):9.1f}  total")


if __name__ == "__main__":
    main()
