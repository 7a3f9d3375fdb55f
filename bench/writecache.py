#!/usr/bin/env python3
"""Writecache benchmarks (issue 11, seed 001), side by side in one run, medians of --reps:

1. seed 001 scaled: fill a cache (ssd mode, writeback paused) with fio randwrite 4 KiB
   QD20 over an origin twice its size, then time `dmkit message mycache 0 flush`,
   sorted (the 2019 order) vs LRU order (`serve --writecache-lru-writeback`), with the
   origin on a disk-head model (bench/seekdisk.c: nbdkit cc plugin through nbdfuse;
   each request costs base_us + seek_ms x distance/size) and on the real disk;
2. the sorted flush vs writing the same bytes sequentially straight to the origin
   (dd oflag=direct, fdatasync), on the real disk;
3. 4 KiB randwrite QD16 IOPS into the cache (cache file on /dev/shm), ssd and pmem
   mode, vs a linear device over the same cache file; server CPU per request.

Needs nbdkit's cc plugin header (nbdkit-plugin-dev) for part 1's model.
Writes BENCHMARKS.md, section `writecache`.

Usage: bench/writecache.py [--reps 3] [--cache-mib 16] [--dir /var/tmp] [--seek-ms 8]
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


class SeekDisk:
    """The disk-head model over `path`, as a regular file (nbdfuse) under `mnt`."""

    def __init__(self, path, mnt, seek_ms, base_us):
        os.makedirs(mnt, exist_ok=True)
        self.mnt = mnt
        self.p = subprocess.Popen(["nbdfuse", mnt, "--command", "nbdkit", "-s", "cc",
                                   os.path.join(HERE, "seekdisk.c"), f"file={path}",
                                   f"seek_ms={seek_ms}", f"base_us={base_us}"],
                                  stderr=subprocess.DEVNULL)
        self.file = os.path.join(mnt, "nbd")
        run.wait_for(self.file, timeout=30)

    def stop(self):
        subprocess.run(["fusermount3", "-u", self.mnt], stderr=subprocess.DEVNULL)
        self.p.wait(30)


def sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)


def seed001_flush(tmp, origin, cache_dir, cache_mib, lru, size=None):
    """Fill a fresh cache over `origin` (a file, or any device name a table takes
    with its `size`), then time the flush message."""
    cache = os.path.join(cache_dir, "wc-cache.img")
    sparse(cache, cache_mib * MIB)
    size = size or os.path.getsize(origin)
    d = run.Dmkit(tmp, extra=["--writecache-lru-writeback"] if lru else [])
    try:
        d.cli("create", "mycache", "--table",
              f"0 {size // 512} writecache s {origin} {cache} 4096 2 pause_writeback 60000")
        blocks = int(d.cli("status", "mycache").split()[4])
        subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri={d.uri('mycache')}",
                        "--rw=randwrite", "--bs=4k", "--iodepth=20", f"--size={size}",
                        f"--io_size={blocks * 4096 * 9 // 10}", "--randseed=7", "--verify=0"],
                       check=True, capture_output=True)
        used = blocks - int(d.cli("status", "mycache").split()[5])
        t0 = time.time()
        d.cli("message", "mycache", "0", "flush")
        return time.time() - t0, used
    finally:
        d.stop()
        os.unlink(cache)


def dd_seq(origin, nbytes):
    t0 = time.time()
    subprocess.run(["dd", "if=/dev/zero", f"of={origin}", "bs=1M", f"count={max(1, nbytes // MIB)}",
                    "oflag=direct", "conv=notrunc,fdatasync"], check=True, capture_output=True)
    return time.time() - t0


def scattered(origin, nbytes):
    """The device's own limit for the flush, which reads each dirty block from the
    cache and writes it to a random place of the origin, on the same disk here: fio
    reading and writing as many 4 KiB blocks at random places, O_DIRECT, 64 in
    flight (seconds, fio's runtime)."""
    out = subprocess.run(["fio", "--name=limit", f"--filename={origin}", "--rw=randrw", "--rwmixread=50",
                          "--bs=4k", "--direct=1", "--ioengine=io_uring", "--iodepth=64", "--norandommap",
                          f"--size={os.path.getsize(origin)}", f"--io_size={2 * nbytes}",
                          "--output-format=json"], check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return max(job["read"]["runtime"], job["write"]["runtime"]) / 1000


def iops(tmp, table_of, name, runtime):
    d = run.Dmkit(tmp)
    try:
        d.cli("create", name, "--table", table_of)
        ios, _, cpu = run.fio_cpu(d, d.uri(name), ["--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=64M"],
                                  runtime)
        return ios, cpu
    finally:
        d.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--cache-mib", type=int, default=16)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--seek-ms", type=float, default=8)
    ap.add_argument("--base-us", type=float, default=100)
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    cmd = (f"bench/writecache.py --reps {a.reps} --runtime {a.runtime} --cache-mib {a.cache_mib} "
           f"--dir {a.dir} --seek-ms {a.seek_ms} --base-us {a.base_us}")
    res = {k: [] for k in ("model-sorted", "model-lru", "disk-sorted", "disk-lru", "dd", "limit")}
    used = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        origin = os.path.join(tmp, "origin.img")
        sparse(origin, 2 * a.cache_mib * MIB)
        disk = SeekDisk(origin, os.path.join(tmp, "mnt"), a.seek_ms, a.base_us)
        try:
            for rep in range(a.reps):
                for lru in (False, True):
                    k = "model-lru" if lru else "model-sorted"
                    t, used[k] = seed001_flush(tmp, disk.file, tmp, a.cache_mib, lru)
                    res[k].append(t)
                    print(f"  {k}: {t:.2f} s ({used[k]} blocks)", file=sys.stderr)
        finally:
            disk.stop()
        for rep in range(a.reps):
            for lru in (False, True):
                k = "disk-lru" if lru else "disk-sorted"
                t, used[k] = seed001_flush(tmp, origin, tmp, a.cache_mib, lru)
                res[k].append(t)
                print(f"  {k}: {t:.3f} s", file=sys.stderr)
            res["dd"].append(dd_seq(origin, used["disk-sorted"] * 4096))
            res["limit"].append(scattered(origin, used["disk-sorted"] * 4096))
        shm = tempfile.mkdtemp(dir="/dev/shm")
        try:
            cache = os.path.join(shm, "cache.img")
            sparse(cache, 256 * MIB)
            origin = os.path.join(tmp, "origin64.img")
            sparse(origin, 64 * MIB)
            sec = 64 * MIB // 512
            cells = {
                "linear over the cache file": f"0 {sec} linear {cache} 0",
                "writecache s": f"0 {sec} writecache s {origin} {cache} 4096 0",
                "writecache p": f"0 {sec} writecache p {origin} {cache} 4096 0",
            }
            ir = {k: [] for k in cells}
            for rep in range(a.reps):
                for k, t in cells.items():
                    with open(cache, "r+b") as f:
                        f.write(b"\0" * 4096)
                    ir[k].append(iops(tmp, t, "b", a.runtime))
                    print(f"  {k}: {ir[k][-1][0]:.0f} IOPS", file=sys.stderr)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    m = {k: run.med(v) for k, v in res.items()}
    lines = ["## Writecache (issue 11, seed 001)\n",
             f"`{cmd}`; medians of the reps.\n",
             "### Seed 001: `flush` after filling the cache, sorted vs LRU writeback order\n",
             f"ssd mode, {a.cache_mib} MiB cache over a {2 * a.cache_mib} MiB origin, filled to ~90% with fio "
             "randwrite 4 KiB QD20 (writeback paused), then `dmkit message mycache 0 flush` timed. The seek "
             f"model charges {a.base_us:g} µs + {a.seek_ms:g} ms × distance/size per request, one at a time.\n",
             "| origin | blocks | sorted (s) | LRU order (s) | LRU / sorted |",
             "|---|---|---|---|---|",
             f"| disk-head model | {used.get('model-sorted')} | {m['model-sorted']:.2f} | {m['model-lru']:.2f} | "
             f"**{m['model-lru'] / m['model-sorted']:.2f}** |",
             f"| real disk ({a.dir}) | {used.get('disk-sorted')} | {m['disk-sorted']:.3f} | {m['disk-lru']:.3f} | "
             f"{m['disk-lru'] / m['disk-sorted']:.2f} |",
             "\nGoal: sorted ≥ 2× faster than LRU order on the model (kernel: 99 s → 44 s, 2.25×).\n",
             "### Flush vs a sequential write of the same bytes to the origin (real disk)\n",
             f"sorted flush {m['disk-sorted']:.3f} s, `dd oflag=direct conv=fdatasync` {m['dd']:.3f} s: "
             f"**{m['disk-sorted'] / m['dd']:.2f}×** (goal ≤ 1.25×). The blocks are scattered over the "
             "origin (a random fill of half its size leaves runs of about two blocks), so the device's own "
             "limit is its random I/O rate, not its sequential one: fio reading and writing as many 4 KiB "
             "blocks at random places (the flush reads each block from the cache, on the same disk here), "
             f"O_DIRECT, 64 in flight, takes {m['limit']:.3f} s; flush / that: "
             f"**{m['disk-sorted'] / m['limit']:.2f}×**.\n",
             "### 4 KiB randwrite QD16 into the cache (cache file on /dev/shm)\n",
             "| device | IOPS | dmkit µs CPU/request | vs linear |",
             "|---|---|---|---|"]
    lin = run.med([x[0] for x in ir["linear over the cache file"]])
    for k, v in ir.items():
        i, c = run.med([x[0] for x in v]), run.med([x[1] for x in v])
        lines.append(f"| {k} | {run.fmt(i)} | {run.fmt(c, 2)} | **{i / lin:.2f}** |")
    lines.append("\nGoal: writecache s ≥ 0.9× linear.\n")
    run.write_section(a.out, "writecache", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
