#!/usr/bin/env python3
"""dm-cache's hit path (issue 34): a warm cache in front of an origin slowed by a
`delay` target (1 ms per I/O), 4 KiB random reads QD16 over a hot set that fits
the cache, against a linear device over the cache file alone (the same bytes, no
cache logic) and the slowed origin alone. Medians of --reps; all files on
/dev/shm. Writes BENCHMARKS.md, section `cache`.

Usage: bench/cache.py [--reps 3] [--runtime 5] [--hot-mib 16]
"""
import argparse, os, shutil, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

MIB = 1 << 20
ORIGIN_MIB = 256
CACHE_MIB = 64


def sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)


def status(d, name):
    f = d.cli("status", name).split()
    return int(f[6].split("/")[0]), int(f[12])  # cached blocks, promotions


def one(tmp, shm, kind, hot, runtime):
    """(IOPS, server µs CPU per read, cached blocks) of one cell."""
    meta, cache, origin = (os.path.join(shm, n) for n in ("meta.img", "cache.img", "origin.img"))
    for p, size in ((meta, 8 * MIB), (cache, CACHE_MIB * MIB), (origin, ORIGIN_MIB * MIB)):
        sparse(p, size)
    with open(origin, "r+b") as f:
        f.write(os.urandom(hot))
    sec = ORIGIN_MIB * MIB // 512
    d = run.Dmkit(tmp)
    try:
        cached = None
        if kind == "linear over the cache file":
            d.cli("create", "dev", "--table", f"0 {CACHE_MIB * MIB // 512} linear {cache} 0")
        else:
            d.cli("create", "slow", "--table", f"0 {sec} delay {origin} 0 1")
            if kind == "cache (warm) over the slowed origin":
                d.cli("create", "dev", "--table", f"0 {sec} cache {meta} {cache} /dev/mapper/slow 128 0 smq 0")
                # warm: read the hot set until every block of it is cached
                want = hot // (64 << 10)
                t0 = time.time()
                while status(d, "dev")[0] < want:
                    if time.time() - t0 > 120:
                        raise RuntimeError(f"not warm after 120 s: {d.cli('status', 'dev')}")
                    run.fio(["--ioengine=nbd", f"--uri={d.uri('dev')}", "--rw=randread", "--bs=4k",
                             "--iodepth=16", f"--size={hot}"], 2)
                cached = status(d, "dev")[0]
            else:
                d.cli("create", "dev", "--table", f"0 {sec} linear /dev/mapper/slow 0")
        ios, _, cpu = run.fio_cpu(d, d.uri("dev"), ["--rw=randread", "--bs=4k", "--iodepth=16", f"--size={hot}"],
                                  runtime)
        return ios, cpu, cached
    finally:
        d.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--hot-mib", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    cmd = f"python3 bench/cache.py --reps {a.reps} --runtime {a.runtime} --hot-mib {a.hot_mib}"
    hot = a.hot_mib * MIB
    cells = ["linear over the cache file", "cache (warm) over the slowed origin", "the slowed origin alone"]
    res = {k: [] for k in cells}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for _ in range(a.reps):
            for k in cells:
                shm = tempfile.mkdtemp(dir="/dev/shm")
                try:
                    res[k].append(one(tmp, shm, k, hot, a.runtime))
                finally:
                    shutil.rmtree(shm, ignore_errors=True)
                print(f"  {k}: {run.fmt(res[k][-1][0])} IOPS", file=sys.stderr)
    med = {k: (run.med([r[0] for r in v]), run.med([r[1] for r in v])) for k, v in res.items()}
    lin = med[cells[0]][0]
    cached = run.med([r[2] for r in res[cells[1]]])
    lines = ["## dm-cache hit path (issue 34, bench/cache.py)\n",
             f"`{cmd}`; medians of the reps. fio randread 4 KiB QD16 over a {a.hot_mib} MiB hot set; "
             f"cache: {CACHE_MIB} MiB cache file, 64 KiB blocks, `smq`, in front of a {ORIGIN_MIB} MiB origin "
             "behind a `delay` target (1 ms per I/O), warmed until the whole hot set is cached "
             f"({run.fmt(cached)} blocks); all files on /dev/shm.\n",
             "| device | IOPS | dmkit µs CPU/read | vs linear over the cache file |",
             "|---|---|---|---|"]
    for k in cells:
        i, c = med[k]
        lines.append(f"| {k} | {run.fmt(i)} | {run.fmt(c, 2)} | **{i / lin:.2f}** |")
    lines.append("\nGoal: the warm cache ≥ 0.9× the linear device over the cache file alone.\n")
    run.write_section(a.out, "cache", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
