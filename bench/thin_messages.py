#!/usr/bin/env python3
"""Thin-pool messages with many active thins: the latency of `create_thin`,
`create_snap` (of thin 0) and `delete` sent to a pool with
10, 2,000 and 10,000 thin devices, each with a live `thin` table over it (as
lvmd's volumes are), over the control socket. Pool files on --dir.

With --before BIN, the same run with another dmkit binary first (a build of an
older commit), so both are measured in one sitting.

Usage: bench/thin_messages.py [--levels 10,2000,10000] [--samples 20]
       [--dir /dev/shm] [--before OLD_DMKIT]
Prints a markdown table for BENCHMARKS.md ("Kubernetes nodes: lvmd").
"""
import argparse, os, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import DMKIT, wait_for  # noqa: E402
from control_scaling import must  # noqa: E402  (one control request, exits on failure)


def measure(binary, levels, samples, tmp):
    run = os.path.join(tmp, f"run-{os.path.basename(binary)}-{time.monotonic_ns()}")
    meta, data = os.path.join(tmp, "meta.img"), os.path.join(tmp, "data.img")
    for p, n in ((meta, 1 << 30), (data, 64 << 30)):
        with open(p, "wb") as h:
            h.truncate(0)
            h.truncate(n)
    d = subprocess.Popen([binary, "serve", "--run-dir", run], stderr=subprocess.DEVNULL)
    out = {}
    try:
        wait_for(os.path.join(run, "serve.pid"))
        sock = os.path.join(run, "control.sock")
        must(sock, ["create", "pool", "--table", f"0 {(64 << 30) // 512} thin-pool {meta} {data} 128 0"])
        have = 0
        for level in levels:
            while have < level:
                must(sock, ["message", "pool", "0", f"create_thin {have}"])
                must(sock, ["create", f"t{have}", "--table", f"0 131072 thin /dev/mapper/pool {have}"])
                have += 1
            t = {"create_thin": [], "create_snap": [], "delete": []}
            for i in range(samples):
                j = 1_000_000 + 2 * i
                for what, words in (("create_thin", f"create_thin {j}"), ("create_snap", f"create_snap {j + 1} 0"),
                                    ("delete", f"delete {j}")):
                    s = time.perf_counter()
                    must(sock, ["message", "pool", "0", words])
                    t[what].append(time.perf_counter() - s)
                must(sock, ["message", "pool", "0", f"delete {j + 1}"])
            out[level] = {k: statistics.median(v) * 1e3 for k, v in t.items()}
            print(f"{binary}: {level} thins: " + ", ".join(f"{k} {v:.2f} ms" for k, v in out[level].items()),
                  file=sys.stderr)
    finally:
        d.terminate()
        d.wait(60)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="10,2000,10000")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--before")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        runs = []
        if a.before:
            runs.append(("before", measure(a.before, levels, a.samples, tmp)))
        runs.append(("this build", measure(DMKIT, levels, a.samples, tmp)))
    before = f" --before {a.before}" if a.before else ""
    print(f"`bench/thin_messages.py --levels {a.levels} --samples {a.samples} --dir {a.dir}{before}`\n")
    print("| binary | active thins | create_thin (ms) | create_snap (ms) | delete (ms) |")
    print("|---|---|---|---|---|")
    for name, r in runs:
        for level in levels:
            m = r[level]
            print(f"| {name} | {level:,} | {m['create_thin']:.2f} | {m['create_snap']:.2f} | {m['delete']:.2f} |")


if __name__ == "__main__":
    main()
