#!/usr/bin/env python3
"""What a full restart log costs a thin pool's writes: fio 4 KiB random writes at
QD16 over NBD to a fresh thin (every write provisions a block, so every write
needs a record), with the daemon's own log size (twice the pool's data blocks:
it never fills) and with a log of N records (`serve
--test-restart-log-records N`: every Nth provisioning waits for a commit), the
thin pool's commit period left at its 1 s. Interleaved runs, medians.

Usage: bench/restart_log_wait.py [--reps 3] [--runtime 5] [--records 64,1024]
       [--dir /dev/shm]
Prints a markdown table for BENCHMARKS.md ("A full restart log").
"""
import argparse, os, statistics, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import Dmkit, fio  # noqa: E402

BLOCK = 64 << 10
DATA = 64 << 30  # sparse: each write fills 4 KiB of its block


def once(tmp, records, runtime):
    meta = os.path.join(tmp, "meta.img")
    data = os.path.join(tmp, "data.img")
    for f, n in ((meta, 256 << 20), (data, DATA)):
        with open(f, "wb") as h:
            h.truncate(0)
            h.truncate(n)
    extra = [] if records is None else ["--test-restart-log-records", str(records)]
    d = Dmkit(tmp, extra=extra)
    try:
        d.cli("create", "pool",
              input=f"0 {DATA // 512} thin-pool {meta} {data} {BLOCK // 512} 0 1 skip_block_zeroing\n")
        d.cli("message", "pool", "0", "create_thin 0")
        d.cli("create", "thin", input=f"0 {DATA // 512} thin /dev/mapper/pool 0\n")
        # 4 KiB writes 60 KiB apart: each one provisions a new block
        iops, _ = fio(["--ioengine=nbd", f"--uri={d.uri('thin')}", f"--rw=write:{BLOCK - 4096}",
                       "--bs=4k", "--iodepth=16", f"--size={DATA}"], runtime)
        return iops
    finally:
        d.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--records", default="64,1024")
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    sizes = [None] + [int(x) for x in a.records.split(",")]
    got = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        for _ in range(a.reps):
            for s in sizes:
                got[s].append(once(tmp, s, a.runtime))
    base = statistics.median(got[None])
    print("| restart log | new-block writes/s (median) | vs the daemon's own size |")
    print("|---|---|---|")
    for s in sizes:
        m = statistics.median(got[s])
        name = "the daemon's (2^20 records: 2 x the pool's blocks, bounded)" if s is None else f"{s} records"
        print(f"| {name} | {m:,.0f} | {m / base:.2f} |")


if __name__ == "__main__":
    main()
