#!/usr/bin/env python3
"""dm-cache's hit path (issue 34): a warm cache in front of an origin slowed by a
`delay` target (1 ms per I/O), 4 KiB random reads QD16 over a hot set that fits
the cache, against a linear device over the cache file alone (the same bytes, no
cache logic) and the slowed origin alone. Medians of --reps; all files on
/dev/shm. Writes BENCHMARKS.md, section `cache`.

With --writeback: the `cleaner`'s writeback rate instead. A cache (writeback,
smq, 64 KiB blocks) over an origin file, its hot set written whole (promoted at
once) then dirtied by random 4 KiB writes; switched to `cleaner` (load, suspend,
resume) and timed until its status shows no dirty block and a suspend (the
origin flushed) returned; against `dd` O_DIRECT
copying as many bytes from the cache file to the origin file (conv=fdatasync).
Files in --dir (O_DIRECT needs a real filesystem). Writes section
`cache-writeback`.

With --zipf: the policy on a Zipf trace (fio `zipf:1.2`, a fixed seed, 4 KiB
reads over a 320 MiB origin, a 64 MiB cache: 20% of it). In the 6.12 guest
(tests/oracle/run.sh, one boot): the same rate-limited trace through the
kernel's dm-cache + dm-cache-smq and through dmkit's cache attached with
ublk, each a fresh cache over its own virtio disks; the hit rate is the read
hits / (hits + misses) the status lines gained over the trace's second half.
On the host: the trace's IOPS (QD16, after a warm-up) through dmkit's cache
over an origin slowed by a `delay` target (1 ms) against the slowed origin
alone. Writes section `cache-zipf`.

Usage: bench/cache.py [--reps 3] [--runtime 5] [--hot-mib 16]
       bench/cache.py --zipf [--reps 3] [--runtime 10] [--ios 12000] [--rate 300]
       bench/cache.py --writeback [--reps 3] [--hot-mib 768] [--dir /var/tmp]
"""
import argparse, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

MIB = 1 << 20
ORIGIN_MIB = 256
CACHE_MIB = 64
# --writeback: a larger cache, so the fixed costs (a reload, a suspend) weigh little
WB_ORIGIN_MIB = 4096
WB_CACHE_MIB = 1024


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


def dirty_of(d, name):
    return int(d.cli("status", name).split()[13])


def writeback_once(tmp, dirn, hot):
    """(seconds the cleaner took, bytes it wrote back, seconds dd took for them)."""
    shm = tempfile.mkdtemp(dir=dirn)
    try:
        meta, cache, origin = (os.path.join(shm, n) for n in ("meta.img", "cache.img", "origin.img"))
        for p, size in ((meta, 8 * MIB), (cache, WB_CACHE_MIB * MIB), (origin, WB_ORIGIN_MIB * MIB)):
            sparse(p, size)
        sec = WB_ORIGIN_MIB * MIB // 512
        table = lambda policy: f"0 {sec} cache {meta} {cache} {origin} 128 1 writeback {policy} 0"  # noqa: E731
        d = run.Dmkit(tmp)
        try:
            d.cli("create", "c", "--table", table("smq"))
            uri = d.uri("c")
            # whole 64 KiB blocks written: promoted at once while blocks are free
            t0 = time.time()
            while status(d, "c")[0] < hot // (64 << 10):
                if time.time() - t0 > 120:
                    raise RuntimeError(f"hot set not cached after 120 s: {d.cli('status', 'c')}")
                run.fio(["--ioengine=nbd", f"--uri={uri}", "--rw=write", "--bs=64k", "--iodepth=16",
                         f"--size={hot}"], 1)
            run.fio(["--ioengine=nbd", f"--uri={uri}", "--rw=randwrite", "--bs=4k", "--iodepth=16",
                     f"--size={hot}"], 3)
            dirty = dirty_of(d, "c")
            d.cli("load", "c", "--table", table("cleaner"))
            d.cli("suspend", "c")
            t0 = time.time()
            d.cli("resume", "c")
            while dirty_of(d, "c") > 0:
                if time.time() - t0 > 300:
                    raise RuntimeError(f"the cleaner did not finish in 300 s: {d.cli('status', 'c')}")
                time.sleep(0.01)  # (each poll is a process: few, to leave the CPUs to the cleaner)
            # what it wrote made durable, as before lvconvert retires the cache
            d.cli("suspend", "c")
            t_clean = time.time() - t0
        finally:
            d.stop()
        nbytes = dirty * (64 << 10)
        t0 = time.time()
        subprocess.run(["dd", f"if={cache}", f"of={origin}", "bs=1M", f"count={nbytes // MIB}", "iflag=direct",
                        "oflag=direct", "conv=notrunc,fdatasync", "status=none"], check=True)
        t_dd = time.time() - t0
        return t_clean, nbytes, t_dd
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def writeback_main(a):
    cmd = f"python3 bench/cache.py --writeback --reps {a.reps} --hot-mib {a.hot_mib} --dir {a.dir}"
    res = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for _ in range(a.reps):
            res.append(writeback_once(tmp, a.dir, a.hot_mib * MIB))
            t, n, t_dd = res[-1]
            print(f"  cleaner {n / MIB / t:.0f} MiB/s ({n // (64 << 10)} blocks in {t:.3f} s), "
                  f"dd {n / MIB / t_dd:.0f} MiB/s", file=sys.stderr)
    t = run.med([r[0] for r in res])
    n = run.med([r[1] for r in res])
    t_dd = run.med([r[2] for r in res])
    ratio = run.med([r[2] / r[0] for r in res])
    lines = ["## dm-cache `cleaner` writeback rate (issue 34, bench/cache.py --writeback)\n",
             f"`{cmd}`; medians of the reps. A {WB_CACHE_MIB} MiB cache (64 KiB blocks, writeback, `smq`) over a "
             f"{WB_ORIGIN_MIB} MiB origin file, files in {a.dir}: the first {a.hot_mib} MiB of the origin written in "
             "whole blocks (promoted at once), then fio randwrite 4 KiB QD16 over them for 3 s (every cached "
             "block dirty); then the table reloaded with `cleaner` and timed from the resume until the status "
             "shows no dirty block and a suspend (which flushes the origin before the metadata calls the blocks "
             "clean) has returned. Against `dd bs=1M iflag=direct oflag=direct conv=fdatasync` of as many bytes "
             "from the cache file to the origin file.\n",
             "| | bytes | seconds | MiB/s | vs dd |",
             "|---|---|---|---|---|",
             f"| cleaner writeback | {run.fmt(n / MIB)} MiB | {t:.3f} | {run.fmt(n / MIB / t)} | **{ratio:.2f}** |",
             f"| dd O_DIRECT copy | {run.fmt(n / MIB)} MiB | {t_dd:.3f} | {run.fmt(n / MIB / t_dd)} | 1.00 |",
             "\nGoal: the cleaner ≥ 0.8× the sequential copy's rate.\n"]
    run.write_section(a.out, "cache-writeback", lines)
    print("\n".join(lines))


ZIPF_ORIGIN_MIB = 320
ZIPF_CACHE_MIB = 64
ZIPF_TRACE = ["--rw=randread", "--bs=4k", "--random_distribution=zipf:1.2", f"--size={ZIPF_ORIGIN_MIB}M"]
ZIPF = ZIPF_TRACE + ["--randseed=34"]


def read_hits(status_line):
    """(read hits, read misses) of a cache status line `0 <len> cache ...`."""
    f = status_line.split()
    return int(f[7]), int(f[8])


def zipf_guest(ios, rate):
    """{'kernel': hit rate, 'dmkit': hit rate} of the trace's second half in the guest."""
    sec = ZIPF_ORIGIN_MIB * MIB // 512
    table = lambda m, c, o: f"0 {sec} cache {m} {c} {o} 128 0 smq 0"  # noqa: E731
    half = ios // 2
    script = f"""
set -e
mkdir -p /run/dmkit /tmp
trace() {{
  fio --name=z --filename=$1 --ioengine=psync --direct=1 {' '.join(ZIPF_TRACE)} --randseed=$2 \\
      --number_ios={half} --rate_iops={rate} > /tmp/fio 2>&1 || {{ cat /tmp/fio; exit 1; }}
}}
dmsetup create k --table "{table('/dev/vda', '/dev/vdb', '/dev/vdc')}"
trace /dev/mapper/k 34
echo "ORACLE kernel-half $(dmsetup status k)"
trace /dev/mapper/k 35
echo "ORACLE kernel-end $(dmsetup status k)"
dmsetup remove k
D="dmkit --run-dir /run/dmkit"
dmkit serve --run-dir /run/dmkit > /tmp/dmkit.log 2>&1 &
i=0; while [ ! -S /run/dmkit/control.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
$D create c --table "{table('/dev/vdd', '/dev/vde', '/dev/vdf')}"
$D attach c > /dev/null
trace /dev/mapper/c 34
echo "ORACLE dmkit-half $($D status c)"
trace /dev/mapper/c 35
echo "ORACLE dmkit-end $($D status c)"
"""
    tmp = tempfile.mkdtemp(dir="/var/tmp")
    try:
        disks = []
        for who in ("k", "d"):
            for n, size in (("meta", 8), ("cache", ZIPF_CACHE_MIB), ("origin", ZIPF_ORIGIN_MIB)):
                p = os.path.join(tmp, f"{who}-{n}.img")
                sparse(p, size * MIB)
                disks.append(p)
        sp = os.path.join(tmp, "guest.sh")
        with open(sp, "w") as f:
            f.write(script)
        env = dict(os.environ, DMKIT_ORACLE_KERNEL="6.12", DMKIT_ORACLE_TIMEOUT="1800",
                   ORACLE_BINS=f"{run.DMKIT} {shutil.which('fio')}",
                   ORACLE_MODULES="drivers/md/dm-cache.ko drivers/md/dm-cache-smq.ko drivers/block/ublk_drv.ko")
        p = subprocess.run(["bash", os.path.join(run.ROOT, "tests/oracle/run.sh"), sp] + disks,
                           capture_output=True, text=True, env=env)
        marks = {}
        for line in p.stdout.splitlines():
            if line.startswith("ORACLE ") and " " in line[7:]:
                k, v = line[7:].split(" ", 1)
                marks[k] = v
        if p.returncode != 0 or "ORACLE-EXIT 0" not in p.stdout:
            raise RuntimeError(f"guest run failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-2000:]}")
        out = {}
        for who in ("kernel", "dmkit"):
            h0, m0 = read_hits(marks[f"{who}-half"])
            h1, m1 = read_hits(marks[f"{who}-end"])
            out[who] = (h1 - h0) / max(1, (h1 - h0) + (m1 - m0))
            print(f"  {who}: {marks[f'{who}-end']}", file=sys.stderr)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def zipf_host(tmp, kind, runtime, warm):
    """(IOPS, hit rate while measured or None) of the trace on the host."""
    shm = tempfile.mkdtemp(dir="/dev/shm")
    sec = ZIPF_ORIGIN_MIB * MIB // 512
    meta, cache, origin = (os.path.join(shm, n) for n in ("meta.img", "cache.img", "origin.img"))
    for p, size in ((meta, 8 * MIB), (cache, ZIPF_CACHE_MIB * MIB), (origin, ZIPF_ORIGIN_MIB * MIB)):
        sparse(p, size)
    d = run.Dmkit(tmp)
    try:
        d.cli("create", "slow", "--table", f"0 {sec} delay {origin} 0 1")
        hit = None
        if kind == "cache":
            d.cli("create", "dev", "--table", f"0 {sec} cache {meta} {cache} /dev/mapper/slow 128 0 smq 0")
            run.fio(["--ioengine=nbd", f"--uri={d.uri('dev')}", "--iodepth=16"] + ZIPF, warm)
            h0, m0 = read_hits(d.cli("status", "dev"))
        else:
            d.cli("create", "dev", "--table", f"0 {sec} linear /dev/mapper/slow 0")
        ios, _ = run.fio(["--ioengine=nbd", f"--uri={d.uri('dev')}", "--iodepth=16"] + ZIPF, runtime)
        if kind == "cache":
            h1, m1 = read_hits(d.cli("status", "dev"))
            hit = (h1 - h0) / max(1, (h1 - h0) + (m1 - m0))
        return ios, hit
    finally:
        d.stop()
        shutil.rmtree(shm, ignore_errors=True)


def zipf_main(a):
    cmd = (f"python3 bench/cache.py --zipf --reps {a.reps} --runtime {a.runtime} --warm {a.warm} "
           f"--ios {a.ios} --rate {a.rate}")
    res = {"cache": [], "origin": []}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for _ in range(a.reps):
            for k in res:
                res[k].append(zipf_host(tmp, k, a.runtime, a.warm))
                print(f"  {k}: {run.fmt(res[k][-1][0])} IOPS, hit rate {res[k][-1][1]}", file=sys.stderr)
    guest = zipf_guest(a.ios, a.rate)
    c, o = run.med([r[0] for r in res["cache"]]), run.med([r[0] for r in res["origin"]])
    hit_host = run.med([r[1] for r in res["cache"]])
    k, d = guest["kernel"], guest["dmkit"]
    lines = ["## dm-cache policy on a Zipf trace (issue 34, bench/cache.py --zipf)\n",
             f"`{cmd}`. The trace: fio randread 4 KiB, `--random_distribution=zipf:1.2 --randseed=34`, over a "
             f"{ZIPF_ORIGIN_MIB} MiB origin; the cache {ZIPF_CACHE_MIB} MiB (20% of it), 64 KiB blocks, `smq`.\n",
             f"Hit rate, Linux 6.12 guest (one boot, tests/oracle/run.sh, qemu TCG): {a.ios} reads at {a.rate} IOPS "
             "(psync, O_DIRECT), the first half with seed 34 as warm-up, the second with seed 35; read hits / "
             "(hits + misses) gained by the status line over the second half. The kernel's dm-cache over three "
             "virtio disks, then dmkit's cache (attached with ublk) over three fresh ones.\n",
             "| cache | hit rate, second half | vs the kernel |",
             "|---|---|---|",
             f"| kernel dm-cache + dm-cache-smq | {k:.3f} | 1.00 |",
             f"| dmkit cache (smq) | {d:.3f} | **{d / k if k else 0:.2f}** |",
             "\nGoal: dmkit ≥ 0.95× the kernel's hit rate.\n",
             f"IOPS on the host, medians of {a.reps} reps: fio's nbd engine, QD16, the trace for {a.warm} s "
             f"(warm-up), then {a.runtime} s measured; origin behind a `delay` target (1 ms per I/O); "
             "files on /dev/shm.\n",
             "| device | IOPS | hit rate while measured | vs the slowed origin alone |",
             "|---|---|---|---|",
             f"| cache over the slowed origin | {run.fmt(c)} | {hit_host:.3f} | **{c / o:.2f}** |",
             f"| the slowed origin alone | {run.fmt(o)} | — | 1.00 |",
             "\nGoal: ≥ 5× the slowed origin alone.\n"]
    run.write_section(a.out, "cache-zipf", lines)
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--hot-mib", type=int, default=None)
    ap.add_argument("--writeback", action="store_true")
    ap.add_argument("--zipf", action="store_true")
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--ios", type=int, default=12000)
    ap.add_argument("--rate", type=int, default=300)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    if a.zipf:
        return zipf_main(a)
    if a.writeback:
        a.hot_mib = a.hot_mib or 768
        return writeback_main(a)
    a.hot_mib = a.hot_mib or 16
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
