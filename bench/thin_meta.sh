#!/bin/sh
# dm-thin metadata benchmark: API inserts/lookups, open time, check times,
# metadata size against thin_restore. Usage: bench/thin_meta.sh [mappings]
set -eu
cd "$(dirname "$0")/.."
N=${1:-16777216}
export CARGO_BUILD_JOBS=1
nice -n 10 cargo build --release --quiet
out=$(THIN_BENCH_MAPPINGS=$N nice -n 10 cargo test --release --quiet --test thin_bench -- --ignored --nocapture 2>&1)
echo "$out" | grep BENCH | grep -v BENCH_FILE
f=$(echo "$out" | sed -n 's/^BENCH_FILE //p')
t0=$(date +%s.%N); ./target/release/dmkit thin check -q "$f"; t1=$(date +%s.%N)
echo "BENCH dmkit thin check: $(echo "$t1 - $t0" | bc) s"
t0=$(date +%s.%N); thin_check -q "$f"; t1=$(date +%s.%N)
echo "BENCH thin_check: $(echo "$t1 - $t0" | bc) s"
./target/release/dmkit thin dump "$f" > "$f.xml"
cp --sparse=always /dev/null "$f.tr" 2>/dev/null || true
truncate -s 1G "$f.tr"
thin_restore -i "$f.xml" -o "$f.tr"
echo "BENCH thin_restore metadata: $(./target/release/dmkit thin check "$f.tr" | sed -n 's/METADATA_FREE_BLOCKS=//p') free of 262144 blocks"
echo "BENCH dmkit metadata:        $(./target/release/dmkit thin check "$f" | sed -n 's/METADATA_FREE_BLOCKS=//p') free of 262144 blocks"
rm -f "$f" "$f.xml" "$f.tr"
