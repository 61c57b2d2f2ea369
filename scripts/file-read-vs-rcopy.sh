#!/bin/sh
# Times examples/file_read (the client READs a memory-mapped file, checksums it and
# writes it out) against librdmacm's rcopy (rsockets: the client streams the file, the
# server writes it) moving the same file, in one soft-RoCE guest, REPS times each.
#
# Run inside the guest, after `cargo build --release --features memmap2 --example file_read`:
#   cargo xtask run -- sh scripts/file-read-vs-rcopy.sh
# EXAMPLES=DIR picks another build (default target/release/examples, or
# $CARGO_TARGET_DIR/release/examples); SIZE=BYTES (default 64 MiB), REPS=N (default 3).
# Prints one line per copy: the tool, the seconds of the client's whole run (connect,
# registration, transfer, writing the copy), MB/s, and whether the copy equals the source.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
ex=${EXAMPLES:-${CARGO_TARGET_DIR:-$root/target}/release/examples}
size=${SIZE:-67108864}
reps=${REPS:-3}
addr=${RDMA_VERBS_ADDR:-10.99.0.1}
src=/tmp/file-read-vs-rcopy.src
head -c "$size" /dev/urandom > "$src"
now() { date +%s.%N; }
# report TOOL START END COPY
report() {
    if cmp -s "$src" "$4"; then same=equal; else same=DIFFERENT; fi
    awk -v tool="$1" -v a="$2" -v b="$3" -v n="$size" -v same="$same" \
        'BEGIN { s = b - a; printf "%-9s %7.3f s  %8.1f MB/s  copy %s\n", tool, s, n / s / 1e6, same }'
    rm -f "$4"
}
echo "copying $size bytes, $reps times each ($(uname -r), $(nproc) CPUs)"
for i in $(seq "$reps"); do
    "$ex/file_read" --server "$src" --port 19990 > /tmp/file-read.server 2>&1 &
    server=$!
    # The server maps and checksums the file before it listens.
    sleep 3
    t0=$(now)
    "$ex/file_read" --client "$addr" --port 19990 --out /tmp/file-read.copy > /tmp/file-read.client 2>&1
    t1=$(now)
    wait "$server"
    report file_read "$t0" "$t1" /tmp/file-read.copy

    rcopy -p 19991 > /tmp/rcopy.server 2>&1 &
    server=$!
    sleep 1
    t0=$(now)
    rcopy "$src" "$addr:/tmp/rcopy.copy" -p 19991 > /tmp/rcopy.client 2>&1
    t1=$(now)
    kill "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
    report rcopy "$t0" "$t1" /tmp/rcopy.copy
done
echo "file_read's own line (the last run):"
grep '^client: read' /tmp/file-read.client || cat /tmp/file-read.client
rm -f "$src"
