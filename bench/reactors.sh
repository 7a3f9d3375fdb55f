#!/bin/sh
# How the NBD server's thread count moves its share of a 2-core machine it
# shares with its client: fio's nbd engine, 16 jobs (one connection each) of
# 64 KiB random writes at QD32 on a linear device over a 1 GiB file in
# /dev/shm (--buffered), against this build with --nbd-reactors 2 and 16 and
# against an older build (thread per connection), taking turns, REPS times.
# Prints one line per run: the server, IOPS.
# Usage: bench/reactors.sh OLD_DMKIT [REPS]
set -e
old=$1; reps=${2:-3}
new=$(dirname "$0")/../target/release/dmkit
dir=$(mktemp -d /dev/shm/reactors.XXXXXX)
trap 'rm -rf "$dir"' EXIT
truncate -s 1G "$dir/f"
one() { # name binary serve-args...
    name=$1; bin=$2; shift 2
    rd="$dir/run-$name"; rm -rf "$rd"
    "$bin" serve --run-dir "$rd" --buffered "$@" 2>/dev/null &
    p=$!
    while [ ! -S "$rd/control.sock" ]; do sleep 0.05; done
    "$bin" --run-dir "$rd" create b --table "0 2097152 linear $dir/f 0"
    fio --name=b --output-format=json --runtime=3 --time_based --ramp_time=1 --group_reporting \
        --ioengine=nbd --uri="nbd+unix:///b?socket=$rd/nbd.sock" --rw=randwrite --bs=64k \
        --iodepth=32 --numjobs=16 --size=1G 2>/dev/null |
        python3 -c "import json,sys; d=sys.stdin.read(); j=json.loads(d[d.index('{'):])['jobs'][0]; print('$name', int(j['write']['iops']))"
    kill $p; wait $p 2>/dev/null || true
}
i=0
while [ $i -lt "$reps" ]; do
    one old "$old"
    one reactors-2 "$new" --nbd-reactors 2
    one reactors-16 "$new" --nbd-reactors 16
    i=$((i + 1))
done
