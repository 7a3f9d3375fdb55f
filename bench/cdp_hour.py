#!/usr/bin/env python3
"""Every flush kept for an hour (issue 50): what it costs in space.

A `cdp` device keeping every point for an hour (`keep 1h:0`), written whole
once, then rewritten at 10% of its size an hour: 4 KiB random writes, each
followed by a flush (fio's nbd engine, `--fsync=1`, a think time between
writes). Every `--every` seconds the status line is read: data blocks in use
(the device's own blocks and the older versions the points keep), points kept,
the oldest point's age. At the end the oldest point is opened over NBD.

The claim it checks: space used stays at or under 1.5 times the device's size
while no flush of the last hour is dropped (points kept = flushes of the last
hour, counted by the client).

Usage: bench/cdp_hour.py [--minutes 65] [--size-mib 64] [--dir /dev/shm]
Prints a markdown table for BENCHMARKS.md ("Every flush a point in time").
"""
import argparse, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import Dmkit  # noqa: E402

BLOCK = 4096


def sparse(path, size):
    with open(path, "wb") as h:
        h.truncate(size)


def status(d):
    """(data blocks used, data blocks, points, first point, last point)."""
    st = d.cli("status", "vol").split()
    used, total = (int(x) for x in st[3].split("/"))
    points = int(st[5])
    first, _, last = st[6].partition("-")
    return used, total, points, first, last


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=65)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--every", type=int, default=300)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    size = a.size_mib << 20
    writes_an_hour = size // 10 // BLOCK
    think_us = int(3600e6 / writes_an_hour)
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        data, journal = os.path.join(tmp, "data.img"), os.path.join(tmp, "journal.img")
        sparse(data, size * 2)
        sparse(journal, 64 << 20)
        d = Dmkit(tmp)
        try:
            d.cli("create", "vol", input=f"0 {size // 512} cdp {data} {journal} 2 keep 1h:0\n")
            uri = d.uri("vol")
            subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri={uri}", "--rw=write",
                            "--bs=1M", f"--size={size}", "--end_fsync=1"], check=True, capture_output=True)
            t0 = time.time()
            fio = subprocess.Popen(
                ["fio", "--name=tenth", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
                 f"--bs={BLOCK}", f"--size={size}", "--fsync=1", f"--thinktime={think_us}",
                 "--time_based", f"--runtime={int(a.minutes * 60)}", "--norandommap"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while fio.poll() is None:
                time.sleep(min(a.every, max(1.0, a.minutes * 60 - (time.time() - t0) + 2)))
                used, total, points, first, last = status(d)
                rows.append((time.time() - t0, used, points, first, last))
            if fio.returncode != 0:
                raise SystemExit(f"fio failed: {fio.returncode}")
            used, total, points, first, last = status(d)
            opened = subprocess.run(["nbdinfo", "--size", d.uri(f"vol@flush:{first}")], check=True,
                                    capture_output=True, text=True).stdout.strip()
        finally:
            d.stop()
    print(f"`bench/cdp_hour.py --minutes {a.minutes:g} --size-mib {a.size_mib} --dir {a.dir}`: a "
          f"{a.size_mib} MiB cdp device, `keep 1h:0`, written whole, then {writes_an_hour} random 4 KiB "
          f"writes an hour (10% of the device), each followed by a flush.\n")
    print("| minutes | data in use / device | points kept | oldest – newest | flushes in that span not kept |")
    print("|---|---|---|---|---|")
    for t, u, p, f, l in rows:
        print(f"| {t / 60:.1f} | {u * BLOCK / size:.3f} | {p:,} | {f} – {l} | {int(l) - int(f) + 1 - p} |")
    peak = max(u for _, u, _, _, _ in rows)
    print(f"\nPeak data in use: {peak * BLOCK / size:.3f} of the device's size (journal: 64 MiB file, "
          f"{total} data blocks available). The oldest point kept at the end (`vol@flush:{first}`) opened: "
          f"{opened} bytes.")


if __name__ == "__main__":
    main()
