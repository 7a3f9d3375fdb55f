#!/usr/bin/env bash
# The dm ioctl door's cost per operation against dmkit's own CLI, same daemon:
# N create+remove pairs of a zero device (dmsetup through `dmkit exec` vs
# `dmkit create`/`dmkit remove`), then `status` of 100 devices, 3 runs each.
# Process start (dmkit exec + dmsetup, or the dmkit client) is included, as a
# user sees it. Usage: bench/door_ops.sh [N]  (default 50)
set -euo pipefail
cd "$(dirname "$0")/.."
D=$PWD/target/release/dmkit
work=$(mktemp -d)
export DMKIT_RUN_DIR=$work/run LC_ALL=C
N=${1:-50}
"$D" serve --background >/dev/null
trap '"$D" --run-dir "$work/run" version >/dev/null 2>&1 && kill "$(cat "$work/run/serve.pid")"; sleep 0.3; rm -rf "$work"' EXIT
for run in 1 2 3; do
  t0=$(date +%s%N)
  for i in $(seq "$N"); do "$D" exec -- dmsetup create "d$i" --table "0 100 zero"; "$D" exec -- dmsetup remove "d$i"; done
  t1=$(date +%s%N)
  for i in $(seq "$N"); do "$D" create "c$i" --table "0 100 zero"; "$D" remove "c$i"; done
  t2=$(date +%s%N)
  echo "run $run: create+remove: dmsetup through the door $(( (t1 - t0) / N / 1000 )) us, dmkit CLI $(( (t2 - t1) / N / 1000 )) us"
done
for i in $(seq 100); do "$D" create "s$i" --table "0 100 zero"; done
for run in 1 2 3; do
  t0=$(date +%s%N); for _ in $(seq 20); do "$D" exec -- dmsetup status >/dev/null; done; t1=$(date +%s%N)
  for _ in $(seq 20); do "$D" status >/dev/null; done; t2=$(date +%s%N)
  echo "run $run: status of 100 devices: dmsetup through the door $(( (t1 - t0) / 20 / 1000 )) us, dmkit CLI $(( (t2 - t1) / 20 / 1000 )) us"
done
