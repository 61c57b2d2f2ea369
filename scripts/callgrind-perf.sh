#!/bin/sh
# Instruction counts of the `perf` example's client under callgrind, for
# comparing the safe and raw data paths deterministically (timing under TCG
# is too noisy to resolve a few hundred instructions).
#
# Run inside the soft-RoCE guest, after `cargo build --release --example perf --all-features`:
#   cargo xtask run -- sh scripts/callgrind-perf.sh safe write_bw 2
#   cargo xtask run -- sh scripts/callgrind-perf.sh raw write_bw 2 -l 8
# Prints the inclusive cost of the test loop (bw::run / lat::run) and the
# busiest functions. Per message: (loop total - the report's own cost, shown
# as report::bw_row) / messages. The report lands in the guest's /tmp (valgrind
# cannot create its pipes on the read-only or 9p file systems).
set -eu
path=${1:?usage: callgrind-perf.sh safe|raw TEST SIZE [PERF FLAGS...]}
test=${2:?test}
size=${3:?size}
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
perf="$root/target/release/examples/perf"
n=${N:-6000}
port=${PORT:-19900}
out=/tmp/callgrind.perf.out
"$perf" "$test" -s "$size" -n "$n" --"$path" -p "$port" "$@" >/dev/null 2>&1 &
server=$!
sleep 2
valgrind --tool=callgrind --vgdb=no --callgrind-out-file="$out" \
    "$perf" "$test" -s "$size" -n "$n" --"$path" -p "$port" "$@" 10.99.0.1 >/dev/null 2>/tmp/callgrind.perf.err
wait "$server"
echo "$path $test -s $size -n $n $*"
callgrind_annotate --auto=no --inclusive=yes "$out" 2>/dev/null | sed -n '/file:function/,$p' |
    grep -E 'perf::(bw|lat)::run( |$)|report::bw_row( |$)|memcpy|Qp<.*post|Cq::poll' | head -20
