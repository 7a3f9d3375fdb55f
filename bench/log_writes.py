#!/usr/bin/env python3
"""What recording every write costs: fio 4 KiB random writes over NBD to a
`log-writes` device and to a `linear` device over the same data file, in one
daemon, side by side; with an fsync every N writes (`--fsync`, default 32) so
the log is written as the kernel's rules say (a write is recorded when a later
flush completes). Data and log files on `--dir`. Interleaved runs, medians, and
the daemon's CPU per write.

Usage: bench/log_writes.py [--reps 5] [--runtime 5] [--qd 16] [--fsync 32]
       [--dir /dev/shm]
Prints a markdown table for BENCHMARKS.md ("Recording every write").
"""
import argparse, os, statistics, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import Dmkit, fio_cpu  # noqa: E402

DATA = 1 << 30
LOG = 24 << 30  # sparse: holds every write of a run with its entry block


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--qd", type=int, default=16)
    ap.add_argument("--fsync", type=int, default=32)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    got = {"linear": [], "log-writes": []}
    cpu = {"linear": [], "log-writes": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        data = os.path.join(tmp, "data.img")
        with open(data, "wb") as h:
            h.truncate(DATA)
        log = os.path.join(tmp, "log.img")
        d = Dmkit(tmp)
        try:
            d.cli("create", "lin", input=f"0 {DATA // 512} linear {data} 0\n")
            for _ in range(a.reps):
                for name in ("linear", "log-writes"):
                    dev = "lin"
                    if name == "log-writes":
                        # a fresh log each run: the table starts it again
                        with open(log, "wb") as h:
                            h.truncate(0)
                            h.truncate(LOG)
                        d.cli("create", "lw", input=f"0 {DATA // 512} log-writes {data} {log}\n")
                        dev = "lw"
                    ios, _, us = fio_cpu(d, d.uri(dev), ["--rw=randwrite", "--bs=4k", f"--iodepth={a.qd}",
                                                         f"--fsync={a.fsync}", f"--size={DATA}"], a.runtime)
                    got[name].append(ios)
                    cpu[name].append(us)
                    if name == "log-writes":
                        status = d.cli("status", "lw").strip()
                        d.cli("remove", "lw")
                        if "logging_disabled" in status:
                            raise RuntimeError(f"the log filled up: {status}")
        finally:
            d.stop()
    base = statistics.median(got["linear"])
    print(f"| device | 4 KiB randwrite IOPS, QD{a.qd}, fsync every {a.fsync} (median of {a.reps}) | "
          "range | vs linear | server CPU per write (µs) |")
    print("|---|---|---|---|---|")
    for name in ("linear", "log-writes"):
        m = statistics.median(got[name])
        print(f"| {name} | {m:,.0f} | {min(got[name]):,.0f}–{max(got[name]):,.0f} | {m / base:.2f} | "
              f"{statistics.median(cpu[name]):.1f} |")


if __name__ == "__main__":
    main()
