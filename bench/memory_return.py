#!/usr/bin/env python3
"""Memory given back: the daemon's resident memory (VmRSS) before, during and
after a table of 10^6 linear targets, and before, during and after 10^4 zero
devices, in one run of one daemon; then the same with the trim turned off
(`serve --test-no-memory-trim`), side by side. Each step is measured once the
daemon has answered the verb (a `version` request first lets any deferred
frees finish).

Usage: bench/memory_return.py [--targets 1000000] [--devices 10000] [--bin DMKIT]
Prints a markdown table for BENCHMARKS.md ("Memory given back").
"""
import argparse, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from control_scaling import call, must  # noqa: E402


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise SystemExit("no VmRSS")


def one(binary, extra, targets, devices):
    d = tempfile.mkdtemp(prefix="dmkit-mem-")
    run_dir = os.path.join(d, "run")
    back = os.path.join(d, "back.img")
    with open(back, "wb") as f:
        f.truncate(targets * 8 * 512)
    p = subprocess.Popen([binary, "serve", "--run-dir", run_dir] + extra,
                         stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "log"), "w"))
    sock = os.path.join(run_dir, "control.sock")
    t0 = time.time()
    while not os.path.exists(os.path.join(run_dir, "serve.pid")):
        if time.time() - t0 > 20:
            raise SystemExit("daemon did not start")
        time.sleep(0.05)
    rows = []

    def step(what):
        must(sock, ["version"])
        time.sleep(0.5)
        rows.append((what, rss_mib(p.pid)))

    step("started")
    table = "".join(f"{i * 8} 8 linear {back} {i * 8}\n" for i in range(targets))
    ok, _, err = call(sock, ["create", "big", "--cwd", d], table.encode())
    if not ok:
        raise SystemExit(err)
    del table
    step(f"a table of {targets:,} targets")
    must(sock, ["remove", "big"])
    step("removed")
    for i in range(devices):
        ok, _, err = call(sock, ["create", f"z{i}", "--table", "0 8 zero"])
        if not ok:
            raise SystemExit(err)
    step(f"{devices:,} devices")
    must(sock, ["remove_all"])
    step("all removed")
    p.terminate()
    p.wait()
    subprocess.run(["rm", "-rf", d])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", type=int, default=1_000_000)
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "target/release/dmkit"))
    a = ap.parse_args()
    trimmed = one(a.bin, [], a.targets, a.devices)
    kept = one(a.bin, ["--test-no-memory-trim"], a.targets, a.devices)
    print("| step | RSS, trim after changes (MiB) | RSS, no trim (MiB) |")
    print("|---|---|---|")
    for (what, r1), (_, r2) in zip(trimmed, kept):
        print(f"| {what} | {r1:.0f} | {r2:.0f} |")


if __name__ == "__main__":
    main()
