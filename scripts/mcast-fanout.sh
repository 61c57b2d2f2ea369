#!/bin/sh
# One multicast sender and a receiver on every other guest, across guests on the
# virtual switch: node 1 sends COUNT datagrams to GROUP, node N (N >= 2) receives
# with the N-1th program of RECEIVERS. A program is `mcast` (this crate's example,
# which verifies every datagram and reports the lost ones) or `mckey` (librdmacm's,
# which exits 0 once all COUNT arrived). Every node exits 0 only if its part did.
#
# Built first: `cargo build --examples --features tokio` (the examples are looked up
# in $RDMA_VERBS_EXAMPLES, else $CARGO_TARGET_DIR/debug/examples, else
# target/debug/examples; `cargo xtask run` passes RDMA_VERBS_* and CARGO_* on).
# Then, on two guests:
#   cargo xtask run --nodes 2 -- sh scripts/mcast-fanout.sh mcast mckey
#   cargo xtask run --nodes 2 -- sh scripts/mcast-fanout.sh mckey mcast
# and with a receiver per node on more guests (`--nodes 3`):
#   cargo xtask run --nodes 3 -- sh scripts/mcast-fanout.sh mcast mcast mckey
set -eu
sender=${1:?usage: mcast-fanout.sh SENDER RECEIVER...}
shift
group=${GROUP:-239.1.3.1}
count=${COUNT:-20}
node=${RDMA_VERBS_NODE:?run by cargo xtask run --nodes N}
addr=${RDMA_VERBS_ADDR:?own address}
root=$(cd "$(dirname "$0")/.." && pwd)
ex=${RDMA_VERBS_EXAMPLES:-${CARGO_TARGET_DIR:-$root/target}/debug/examples}
prog() {
    case $1 in
    mcast) echo "$ex/mcast" ;;
    mckey) echo mckey ;;
    *) echo "unknown program $1 (mcast or mckey)" >&2; exit 2 ;;
    esac
}
if [ "$node" = 1 ]; then
    # The receivers join while this waits; the sender pauses 3 s after its own join too.
    sleep 4
    exec timeout 60 "$(prog "$sender")" -m "$group" -b "$addr" -s -C "$count"
fi
i=2
for r in "$@"; do
    if [ "$i" = "$node" ]; then
        exec timeout 60 "$(prog "$r")" -m "$group" -b "$addr" -C "$count"
    fi
    i=$((i + 1))
done
echo "node $node: no receiver given for it (receivers: $*)" >&2
exit 2
