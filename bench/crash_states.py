#!/usr/bin/env python3
"""How fast `dmkit replay --crash-states` tries crash states (issue 50: at
least 10^4 states a second on 2 cores for a 1 GiB device).

A log of a 1 GiB log-writes device: fio's 4 KiB random writes over NBD at QD1
with an fsync every 8 (so each flush epoch holds 8 writes: 256 states, 64 of
them tried with --max-states 64). Then the states are tried on a 1 GiB image,
each built on it by writing the chosen entries and undone after its check,
with three judges: `--check true` (a process per state, the shell's builtin),
`--judge` with a shell loop answering `ok`, and `--judge` with a Python judge
that opens the image and reads its first 4 KiB for every state. Medians of
`--reps` runs; files on `--dir`.

Usage: bench/crash_states.py [--reps 3] [--writes 8000] [--dir /dev/shm]
Prints a markdown table for BENCHMARKS.md ("Recording every write").
"""
import argparse, os, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import DMKIT, Dmkit  # noqa: E402

GIB = 1 << 30
JUDGE_PY = """import sys
for line in sys.stdin:
    with open(line[:-1], "rb") as f:
        f.read(4096)
    print("ok", flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--writes", type=int, default=8000)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        data, log, image = (os.path.join(tmp, n) for n in ("data.img", "log.img", "image.img"))
        for p, size in ((data, GIB), (log, 2 * GIB), (image, GIB)):
            with open(p, "wb") as h:
                h.truncate(size)
        d = Dmkit(tmp)
        try:
            d.cli("create", "lw", input=f"0 {GIB // 512} log-writes {data} {log}\n")
            subprocess.run(["fio", "--name=epochs", "--ioengine=nbd", f"--uri={d.uri('lw')}",
                            "--rw=randwrite", "--bs=4k", f"--size={GIB}", "--iodepth=1", "--fsync=8",
                            f"--number_ios={a.writes}", "--norandommap"], check=True, capture_output=True)
            d.cli("remove", "lw")
        finally:
            d.stop()
        judge_py = os.path.join(tmp, "judge.py")
        with open(judge_py, "w") as h:
            h.write(JUDGE_PY)
        judges = [
            ("`--check true` (a process a state)", ["--check", "true"]),
            ("`--judge 'while read p; do echo ok; done'`", ["--judge", "while read p; do echo ok; done"]),
            ("`--judge` in Python, reading 4 KiB of the image a state", ["--judge", f"python3 {judge_py}"]),
        ]
        for name, args in judges:
            rates, states = [], 0
            for _ in range(a.reps):
                t0 = time.perf_counter()
                out = subprocess.run([DMKIT, "replay", log, image, "--crash-states", "--max-states", "64",
                                      *args], check=True, capture_output=True, text=True).stdout
                took = time.perf_counter() - t0
                states = int(out.split()[1])
                rates.append(states / took)
            rows.append((name, states, statistics.median(rates), min(rates), max(rates)))
    print(f"`bench/crash_states.py --reps {a.reps} --writes {a.writes} --dir {a.dir}`: a 1 GiB device, "
          f"{a.writes} random 4 KiB writes with a flush every 8, 64 states tried an epoch.\n")
    print("| judge | states | states a second (median) | range |")
    print("|---|---|---|---|")
    for name, states, med, lo, hi in rows:
        print(f"| {name} | {states:,} | {med:,.0f} | {lo:,.0f}–{hi:,.0f} |")


if __name__ == "__main__":
    main()
