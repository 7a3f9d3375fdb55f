#!/usr/bin/env bash
# dm-verity's cost through dmkit: the same 1 GiB file served by `linear` and by
# `verity` (sha256, 4 KiB blocks, a tree from veritysetup format), read with
# fio's nbd engine: a sequential 1 MiB read of the whole device right after
# create (verity's hash cache cold; the file in the page cache for both, so the
# difference is the hashing and the tree), then 4 KiB random reads for 20 s once
# warm (every hash block verified and cached: one hash per read).
# Usage: bench/verity.sh [SIZE_MIB]  (needs fio, veritysetup; a release build)
set -euo pipefail
MIB=${1:-1024}
ROOTDIR=$(cd "$(dirname "$0")/.." && pwd)
BIN=$ROOTDIR/target/release/dmkit
W=$(mktemp -d /tmp/dmkit-verity-bench.XXXXXX)
export DMKIT_RUN_DIR=$W/run
trap 'kill $(cat $DMKIT_RUN_DIR/serve.pid 2>/dev/null) 2>/dev/null || true; rm -rf "$W"' EXIT
cd "$W"
head -c $((MIB << 20)) /dev/urandom > data.img
truncate -s $((MIB << 20)) hash.img
ROOT=$(veritysetup format --data-block-size 4096 --hash-block-size 4096 --salt 00ff data.img hash.img |
       sed -n 's/^Root hash:[[:space:]]*//p')
"$BIN" serve --background >/dev/null
SECT=$((MIB * 2048))
BLOCKS=$((MIB * 256))
fio_run() { # name device rw bs [runtime]
  local extra=()
  [ -n "${5:-}" ] && extra=(--time_based --runtime="$5")
  fio --name="$1" --ioengine=nbd --uri="nbd+unix:///$2?socket=$DMKIT_RUN_DIR/nbd.sock" \
      --rw="$3" --bs="$4" --size=$((MIB << 20)) --iodepth=16 --numjobs=1 "${extra[@]}" \
      --output-format=terse --terse-version=3 | awk -F';' -v n="$1" \
      '/^3;/ { printf "%-22s %9.1f MiB/s %9.0f IOPS\n", n, $7/1024, $8 }'
}
"$BIN" create --readonly lin --table "0 $SECT linear $W/data.img 0"
"$BIN" create --readonly ver --table "0 $SECT verity 1 $W/data.img $W/hash.img 4096 4096 $BLOCKS 1 sha256 $ROOT 00ff"
cat data.img > /dev/null
fio_run linear-seq-1M lin read 1M
fio_run verity-seq-1M-cold ver read 1M
fio_run linear-rand-4k lin randread 4k 20
fio_run verity-rand-4k-warm ver randread 4k 20
"$BIN" status ver
