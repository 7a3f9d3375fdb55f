#!/usr/bin/env bash
# dm-verity against linear over the same file (issue 33): bench/verity.py does
# the work (reps, medians, spreads, server CPU per request) and writes
# BENCHMARKS.md's verity section.
# Usage: bench/verity.sh [--mib 1024] [--reps 3] [--runtime 10] [--dir /dev/shm]
exec python3 "$(dirname "$0")/verity.py" "$@"
