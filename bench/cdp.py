#!/usr/bin/env python3
"""What keeping every flush costs (issue 50): fio 4 KiB random writes over NBD
to a `cdp` device and to a `linear` device of the same size, in one daemon, side
by side, interleaved, medians; the daemon's CPU per write; write amplification
(data and journal bytes written per byte the client wrote, from the cdp status
line); and how long opening a point takes (`nbdinfo --size` of `vol@flush:N`
against the same of `vol`). A fresh cdp device (data and journal files made
again) for every run. Files on `--dir`.

Usage: bench/cdp.py [--reps 5] [--runtime 5] [--dir /dev/shm]
Prints markdown tables for BENCHMARKS.md ("Every flush a point in time").
"""
import argparse, os, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import Dmkit, fio_cpu  # noqa: E402

SIZE = 1 << 30
DATA = SIZE * 3 // 2  # the device and half as much again for older points
JOURNAL = 128 << 20
WORKLOADS = [
    ("randwrite QD16", ["--rw=randwrite", "--bs=4k", "--iodepth=16"]),
    ("randwrite QD16, fsync every 32", ["--rw=randwrite", "--bs=4k", "--iodepth=16", "--fsync=32"]),
    ("randwrite QD1, fsync every write", ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--fsync=1"]),
    ("randread QD16", ["--rw=randread", "--bs=4k", "--iodepth=16"]),
]


def sparse(path, size):
    with open(path, "wb") as h:
        h.truncate(0)
        h.truncate(size)


def timed(cmd, n=10):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    got = {(w, k): [] for w, _ in WORKLOADS for k in ("linear", "cdp")}
    cpu = {(w, k): [] for w, _ in WORKLOADS for k in ("linear", "cdp")}
    amp, opens = [], []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        lin = os.path.join(tmp, "lin.img")
        sparse(lin, SIZE)
        data, journal = os.path.join(tmp, "data.img"), os.path.join(tmp, "journal.img")
        d = Dmkit(tmp)
        try:
            d.cli("create", "lin", input=f"0 {SIZE // 512} linear {lin} 0\n")
            for rep in range(a.reps):
                sparse(data, DATA)
                sparse(journal, JOURNAL)
                d.cli("create", "vol", input=f"0 {SIZE // 512} cdp {data} {journal}\n")
                order = ("linear", "cdp") if rep % 2 == 0 else ("cdp", "linear")
                for w, args in WORKLOADS:
                    for k in order:
                        dev = "lin" if k == "linear" else "vol"
                        ios, _, us = fio_cpu(d, d.uri(dev), args + [f"--size={SIZE}"], a.runtime)
                        got[(w, k)].append(ios)
                        cpu[(w, k)].append(us)
                st = d.cli("status", "vol").split()
                journal_b, data_b = (int(x) for x in st[-1].split("/"))
                amp.append((data_b + journal_b) / data_b)
                last = d.cli("message", "vol", "0", "points", "1").split()[0]
                opens.append((timed(["nbdinfo", "--size", d.uri(f"vol@{last}")]),
                              timed(["nbdinfo", "--size", d.uri("vol")])))
                d.cli("remove", "vol")
        finally:
            d.stop()
    print(f"`bench/cdp.py --reps {a.reps} --runtime {a.runtime} --dir {a.dir}`: 1 GiB devices, fio's nbd "
          "engine, 4 KiB, medians of the reps (linear and cdp alternating first), a new cdp device each rep.\n")
    print("| workload | linear IOPS | cdp IOPS | cdp / linear | range cdp / linear | server CPU µs a request, linear / cdp |")
    print("|---|---|---|---|---|---|")
    for w, _ in WORKLOADS:
        lm, cm = statistics.median(got[(w, "linear")]), statistics.median(got[(w, "cdp")])
        ratios = [c / l for c, l in zip(got[(w, "cdp")], got[(w, "linear")])]
        print(f"| {w} | {lm:,.0f} | {cm:,.0f} | {cm / lm:.2f} | {min(ratios):.2f}–{max(ratios):.2f} | "
              f"{statistics.median(cpu[(w, 'linear')]):.1f} / {statistics.median(cpu[(w, 'cdp')]):.1f} |")
    print()
    print(f"Write amplification (data + journal bytes over data bytes written, each rep's whole run): "
          f"median {statistics.median(amp):.3f}, range {min(amp):.3f}–{max(amp):.3f}.")
    po = statistics.median(o[0] for o in opens) * 1000
    pd = statistics.median(o[1] for o in opens) * 1000
    print(f"Opening a point (`nbdinfo --size` of `vol@flush:N`, the newest, median of 10 a rep): {po:.1f} ms; "
          f"of the device itself: {pd:.1f} ms.")


if __name__ == "__main__":
    main()
