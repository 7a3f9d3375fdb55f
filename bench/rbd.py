#!/usr/bin/env python3
"""RBD benchmarks (issue 18), side by side in one run on one throw-away cluster
(ci/ceph-cluster.sh: one monitor and one OSD on this machine, memstore), medians
of --reps, the cells of each rep interleaved:

1. 4 KiB random read and write, QD32, on one 1 GiB image (written in full
   first): fio's own `rbd` engine (librbd in fio: the limit), dmkit `linear`
   over the image through NBD, and `qemu-nbd` serving the image (qemu's rbd
   driver) through NBD. Server CPU per request for the NBD servers.
   `rbd-nbd` needs the kernel's nbd driver (/dev/nbdN); where the machine cannot
   load it the row says so.
2. writecache with a local cache file (in --dir) over an image: 4 KiB random
   write IOPS against the bare image through dmkit linear; then a cache filled
   with writeback paused, `flush` timed in sorted order and in LRU order
   (`serve --writecache-lru-writeback`), against `rbd import` of as many bytes
   (one sequential stream: the limit).

Writes BENCHMARKS.md, section `rbd`.

Usage: bench/rbd.py [--reps 3] [--runtime 5] [--dir /var/tmp] [--cache-mib 64]
"""
import argparse, json, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402
import writecache  # noqa: E402

MIB = 1 << 20
IMAGE = 1 << 30
SCRIPT = os.path.join(run.ROOT, "ci", "ceph-cluster.sh")


class Cluster:
    def __init__(self, d):
        self.dir = d
        self.conf = subprocess.run(["bash", SCRIPT, "start", d, "--parent", str(os.getpid())], check=True,
                                   capture_output=True, text=True).stdout.strip()
        self.env = dict(os.environ, CEPH_CONF=self.conf)

    def rbd(self, *args):
        return subprocess.run(["rbd", "-c", self.conf, *args], check=True, capture_output=True,
                              text=True).stdout

    def create(self, name, size):
        subprocess.run(["rbd", "-c", self.conf, "rm", "--no-progress", f"rbd/{name}"], capture_output=True)
        self.rbd("create", "--size", f"{size // MIB}M", f"rbd/{name}")

    def dev(self, name):
        return f"rbd:rbd/{name}:conf={self.conf}"

    def stop(self):
        subprocess.run(["bash", SCRIPT, "stop", self.dir], check=True)


def fio_measured(args, runtime, env=None):
    """fio with `args`: (IOPS, MiB/s, requests, CPU seconds of fio and everything
    it ran, from wait4: librbd's threads too for the rbd engine)."""
    cmd = ["fio", "--name=b", "--output-format=json", f"--runtime={runtime}", "--time_based",
           "--ramp_time=1", "--group_reporting", "--verify=0", *args]
    with tempfile.TemporaryFile(mode="w+") as errf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        out = p.stdout.read()
        _, status, ru = os.wait4(p.pid, 0)  # not p.wait(): wait4 gives fio's rusage
        p.returncode = os.waitstatus_to_exitcode(status)
        p.stdout.close()
        if p.returncode != 0:
            errf.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {errf.read()[-2000:]}")
    j = json.loads(out[out.index("{"):])["jobs"][0]
    ios = j["read"]["iops"] + j["write"]["iops"]
    bw = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / MIB
    reqs = j["read"]["total_ios"] + j["write"]["total_ios"]
    return ios, bw, reqs, ru.ru_utime + ru.ru_stime


class QemuNbd:
    def __init__(self, c, image, tmp):
        self.sock = os.path.join(tmp, "qemu-nbd.sock")
        self.p = subprocess.Popen(["qemu-nbd", "-f", "raw", "--socket", self.sock, "-x", "b", "--persistent",
                                   "--shared=16", "--cache=writeback", "--discard=unmap",
                                   f"rbd:rbd/{image}:conf={c.conf}"], stderr=subprocess.DEVNULL)
        run.wait_for(self.sock, timeout=30)

    def uri(self):
        return f"nbd+unix:///b?socket={self.sock}"

    def cpu(self):
        return run.proc_cpu(self.p.pid)

    def stop(self):
        self.p.terminate()
        self.p.wait(30)


def rbd_nbd_available():
    return any(n.startswith("nbd") for n in os.listdir("/dev"))


def nbd_cell(c, kind, image, args, runtime, tmp):
    """(IOPS, MiB/s, server µs CPU/request, client µs CPU/request): the client is
    fio (with librbd in it for fio-rbd), its CPU over its whole run (ramp, open
    and close included) per request counted after the ramp."""
    if kind == "fio-rbd":
        ios, bw, reqs, ccpu = fio_measured(["--ioengine=rbd", "--clientname=admin", "--pool=rbd",
                                            f"--rbdname={image}", *args], runtime, c.env)
        return ios, bw, None, ccpu / reqs * 1e6
    if kind == "dmkit":
        server = run.Dmkit(tmp, [("b", f"0 {IMAGE // 512} linear {c.dev(image)} 0")])
        uri = server.uri("b")
    else:
        server = QemuNbd(c, image, tmp)
        uri = server.uri()
    try:
        s0 = server.cpu()
        ios, bw, reqs, ccpu = fio_measured(["--ioengine=nbd", f"--uri={uri}", *args], runtime)
        scpu = server.cpu() - s0
    finally:
        server.stop()
    return ios, bw, scpu / reqs * 1e6, ccpu / reqs * 1e6


def wc_iops(c, origin, cache, runtime, tmp):
    with open(cache, "wb") as f:
        f.truncate(1 << 30)
    d = run.Dmkit(tmp, [("wc", f"0 {IMAGE // 512} writecache s {c.dev(origin)} {cache} 4096 0")])
    try:
        # within 256 MiB: the cache never reaches its high watermark (50%)
        return run.fio_cpu(d, d.uri("wc"), ["--rw=randwrite", "--bs=4k", "--iodepth=32", "--size=256M"],
                           runtime)
    finally:
        d.stop()
        os.unlink(cache)


def rbd_import(c, nbytes, tmp):
    src = os.path.join(tmp, "import.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(nbytes))  # random: `rbd import` skips zeroes
    subprocess.run(["rbd", "-c", c.conf, "rm", "--no-progress", "rbd/imported"], capture_output=True)
    t0 = time.time()
    c.rbd("import", "--no-progress", src, "rbd/imported")
    t = time.time() - t0
    os.unlink(src)
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--cache-mib", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    cmd = f"bench/rbd.py --reps {a.reps} --runtime {a.runtime} --dir {a.dir} --cache-mib {a.cache_mib}"
    tmp = tempfile.mkdtemp(dir=a.dir)
    c = Cluster(tempfile.mkdtemp(prefix="ceph-", dir="/tmp"))
    try:
        c.create("bench", IMAGE)
        subprocess.run(["fio", "--name=fill", "--ioengine=rbd", "--clientname=admin", "--pool=rbd",
                        "--rbdname=bench", "--rw=write", "--bs=1M", "--iodepth=8", f"--size={IMAGE}"],
                       check=True, capture_output=True, env=c.env)
        kinds = ["fio-rbd", "dmkit", "qemu-nbd"]
        wls = {"randread": ["--rw=randread", "--bs=4k", "--iodepth=32"],
               "randwrite": ["--rw=randwrite", "--bs=4k", "--iodepth=32"]}
        res = {(k, w): [] for k in kinds for w in wls}
        for rep in range(a.reps):
            for w, args in wls.items():
                # the cluster slows as it ages: each rep starts with another server
                for k in kinds[rep % 3:] + kinds[:rep % 3]:
                    r = nbd_cell(c, k, "bench", args, a.runtime, tmp)
                    res[(k, w)].append(r)
                    print(f"  {rep} {w} {k}: {r[0]:,.0f} IOPS", file=sys.stderr)
        # writecache over an image
        c.create("wc-origin", IMAGE)
        cache = os.path.join(tmp, "cache.img")
        wc = []
        flush = {False: [], True: []}
        used = 0
        imp = []
        for rep in range(a.reps):
            wc.append(wc_iops(c, "wc-origin", cache, a.runtime, tmp))
            print(f"  {rep} writecache: {wc[-1][0]:,.0f} IOPS", file=sys.stderr)
            for lru in (False, True):
                c.create("wc-flush", 2 * a.cache_mib * MIB)
                t, used = writecache.seed001_flush(tmp, c.dev("wc-flush"), tmp, a.cache_mib, lru,
                                                   size=2 * a.cache_mib * MIB)
                flush[lru].append(t)
                print(f"  {rep} flush lru={lru}: {t:.2f} s ({used} blocks)", file=sys.stderr)
            imp.append(rbd_import(c, used * 4096, tmp))
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    def m(k, w, i):
        return run.med([r[i] for r in res[(k, w)]])

    lines = ["## RBD backing devices (issue 18)\n",
             f"`{cmd}`; medians of the reps. One monitor and one OSD (memstore) on this 2-core machine, "
             "sharing it with the client and the server: absolute figures are the cluster's; the ratios "
             "compare the servers on the same cluster in the same run.\n",
             "### 4 KiB random I/O, QD32, one 1 GiB image\n",
             "| rw | fio rbd engine IOPS | dmkit linear IOPS | qemu-nbd IOPS | dmkit / fio rbd | "
             "dmkit / qemu-nbd |",
             "|---|---|---|---|---|---|"]
    for w in wls:
        f, d, q = m("fio-rbd", w, 0), m("dmkit", w, 0), m("qemu-nbd", w, 0)
        lines.append(f"| {w} | {run.fmt(f)} | {run.fmt(d)} | {run.fmt(q)} | **{d / f:.2f}** | **{d / q:.2f}** |")
    lines += ["\nCPU per request, µs (server: the NBD server process, librbd's threads included; client: "
              "fio, with librbd inside it for the rbd engine):\n",
              "| rw | fio rbd engine (client) | dmkit server | fio nbd client of dmkit | dmkit + its client | "
              "qemu-nbd server | fio nbd client of qemu-nbd |",
              "|---|---|---|---|---|---|---|"]
    for w in wls:
        ds, dc = m("dmkit", w, 2), m("dmkit", w, 3)
        lines.append(f"| {w} | {run.fmt(m('fio-rbd', w, 3), 1)} | {run.fmt(ds, 1)} | {run.fmt(dc, 1)} | "
                     f"{run.fmt(ds + dc if ds and dc else None, 1)} | {run.fmt(m('qemu-nbd', w, 2), 1)} | "
                     f"{run.fmt(m('qemu-nbd', w, 3), 1)} |")
    lines.append("\nOn the development machine (2026-11-24) qemu-nbd's 4 KiB reads took at least 6 ms each "
                 "(fio's minimum latency) with `--cache=writeback` and `--cache=none` alike, while its writes "
                 "ran at 3.6-3.9K IOPS; its rbd driver was not investigated further.\n")
    if not rbd_nbd_available():
        lines.append("\n`rbd-nbd` was not run: it attaches images to the kernel's nbd driver, and this "
                     "machine has no /dev/nbd* and cannot load modules.\n")
    wi = run.med([x[0] for x in wc])
    bare = m("dmkit", "randwrite", 0)
    lines += ["### writecache with a local cache file over an image\n",
              f"4 KiB randwrite QD32 within 256 MiB of a writecache (1 GiB cache file in {a.dir}) over an "
              f"image: {run.fmt(wi)} IOPS, {run.fmt(run.med([x[2] for x in wc]), 1)} µs server CPU/req; the bare "
              f"image through dmkit linear: {run.fmt(bare)} IOPS: **{wi / bare:.1f}×**.\n",
              f"`flush` of a {a.cache_mib} MiB cache filled to ~90% ({used} blocks of 4 KiB, written at random "
              f"over a {2 * a.cache_mib} MiB image, writeback paused), to the image:\n",
              "| order | seconds | vs sorted |",
              "|---|---|---|",
              f"| sorted (seed 001) | {run.med(flush[False]):.2f} | 1.00 |",
              f"| LRU | {run.med(flush[True]):.2f} | {run.med(flush[True]) / run.med(flush[False]):.2f} |",
              f"| `rbd import` of as many bytes (one sequential stream) | {run.med(imp):.2f} | "
              f"{run.med(imp) / run.med(flush[False]):.2f} |",
              ""]
    run.write_section(a.out, "rbd", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
