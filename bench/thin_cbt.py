#!/usr/bin/env python3
"""Incremental backup from thin snapshots (issue 14).

A 10 GiB thin volume written whole, snapshot 1, 1% of it overwritten in random
64 KiB blocks, snapshot 2. Then, alternating: a full `nbdcopy` of snapshot 2 into
a file, and the incremental way, onto a copy of the full backup of snapshot 1:
`nbdinfo --map=qemu:dirty-bitmap:1` lists the changed blocks and they are read
through nbdfuse (dd). Bytes moved, wall-time medians, and a check that both
results are equal. Data on --dir (default /var/tmp: 10 GiB does not fit in memory
twice). Writes the "thin-cbt" section of BENCHMARKS.md.

Usage: bench/thin_cbt.py [--reps N] [--gib N] [--percent P] [--dir DIR]
"""
import argparse, concurrent.futures, hashlib, os, random, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as nb  # noqa: E402

GIB = 1 << 30
BLOCK = 64 << 10


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def md5(path):
    h = hashlib.md5()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gib", type=int, default=10)
    ap.add_argument("--percent", type=float, default=1.0)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--out", default=os.path.join(nb.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=nb.ROOT, check=True)
    size = a.gib * GIB
    with tempfile.TemporaryDirectory(dir=a.dir) as t:
        run = os.path.join(t, "run")
        env = dict(os.environ, DMKIT_RUN_DIR=run)
        log = open(os.path.join(t, "daemon.log"), "w")
        daemon = subprocess.Popen([nb.DMKIT, "serve"], env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            nb.wait_for(os.path.join(run, "nbd.sock"))
            dm = lambda *args, stdin=None: sh([nb.DMKIT, *args], env=env, input=stdin)
            meta, data = os.path.join(t, "meta"), os.path.join(t, "data")
            with open(meta, "wb") as f:
                f.truncate(256 << 20)
            with open(data, "wb") as f:
                f.truncate(size + GIB)
            sectors = size // 512
            dm("create", "pool", "--table", f"0 {(size + GIB) // 512} thin-pool {meta} {data} 128 0")
            dm("message", "pool", "0", "create_thin 0")
            dm("create", "vol", "--table", f"0 {sectors} thin /dev/mapper/pool 0")
            uri = lambda n: f"nbd+unix:///{n}?socket={run}/nbd.sock"
            # every byte of the volume written (nbdkit's pattern plugin: non-zero data)
            sh(["nbdcopy", "--", "[", "nbdkit", "--exit-with-parent", "pattern", f"size={size}", "]", uri("vol")])

            def snap(i, name):
                dm("suspend", "vol")
                dm("message", "pool", "0", f"create_snap {i} 0")
                dm("resume", "vol")
                dm("create", name, "--table", f"0 {sectors} thin /dev/mapper/pool {i}")

            snap(1, "s1")
            base = os.path.join(t, "full1.raw")
            sh(["nbdcopy", uri("s1"), base])
            rng = random.Random(14)
            n = int(size // BLOCK * a.percent / 100)
            blocks = rng.sample(range(size // BLOCK), n)
            cmds = []
            for b in blocks:
                cmds += ["-c", f"write -P 0x5a {b * BLOCK} {BLOCK}"]
            for i in range(0, len(cmds), 2000):
                sh(["qemu-io", "-f", "raw", *cmds[i:i + 2000], uri("vol")])
            snap(2, "s2")
            fuse = os.path.join(t, "fuse")
            os.makedirs(fuse)
            fp = subprocess.Popen(["nbdfuse", "-r", fuse, uri("s2")], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
            while not (os.path.exists(os.path.join(fuse, "nbd")) and os.path.getsize(os.path.join(fuse, "nbd")) > 0):
                time.sleep(0.02)
            full_t, inc_t, map_t, moved = [], [], [], 0
            full2, inc = os.path.join(t, "full2.raw"), os.path.join(t, "inc.raw")
            for r in range(a.reps):
                for kind in (["full", "inc"] if r % 2 == 0 else ["inc", "full"]):
                    if kind == "full":
                        if os.path.exists(full2):
                            os.remove(full2)
                        t0 = time.monotonic()
                        sh(["nbdcopy", uri("s2"), full2])
                        fd = os.open(full2, os.O_WRONLY)
                        os.fsync(fd)
                        os.close(fd)
                        full_t.append(time.monotonic() - t0)
                    else:
                        shutil.copyfile(base, inc)  # the earlier full backup (not timed)
                        fd = os.open(inc, os.O_WRONLY)
                        os.fsync(fd)
                        os.close(fd)
                        t0 = time.monotonic()
                        out = sh(["nbdinfo", "--map=qemu:dirty-bitmap:1", uri("s2")])
                        map_t.append(time.monotonic() - t0)
                        ext = [(int(f[0]), int(f[1])) for f in (l.split() for l in out.splitlines())
                               if len(f) >= 3 and f[2] == "1"]
                        src = os.open(os.path.join(fuse, "nbd"), os.O_RDONLY)
                        dst = os.open(inc, os.O_WRONLY)
                        # 8 extents in flight (FUSE serves requests concurrently)
                        def one(e):
                            os.pwrite(dst, os.pread(src, e[1], e[0]), e[0])
                            return e[1]
                        with concurrent.futures.ThreadPoolExecutor(8) as pool:
                            moved = sum(pool.map(one, ext))
                        os.fsync(dst)
                        os.close(src)
                        os.close(dst)
                        inc_t.append(time.monotonic() - t0)
            same = md5(inc) == md5(full2)
            subprocess.run(["fusermount3", "-u", fuse])
            fp.wait()
        finally:
            daemon.terminate()
            daemon.wait()
    f, i = nb.med(full_t), nb.med(inc_t)
    print(f"map {nb.med(map_t):.3f} s of the incremental {i:.3f} s", file=sys.stderr)
    changed = n * BLOCK
    out = [
        f"## Incremental backup from thin snapshots (issue 14): {a.gib} GiB volume, {a.percent:g}% changed",
        "",
        f"Produced by `{' '.join(['bench/thin_cbt.py'] + sys.argv[1:])}` on `{a.dir}`. A {a.gib} GiB thin volume "
        f"(64 KiB blocks) written whole (nbdkit's pattern plugin through nbdcopy), snapshot 1, {n:,} random 64 KiB blocks overwritten ({changed >> 20} MiB), "
        "snapshot 2. Full: `nbdcopy` of snapshot 2 into a file, fsync included. Incremental: `nbdinfo --map=qemu:dirty-bitmap:1` "
        "on snapshot 2, then the changed extents read through `nbdfuse` (8 at a time) and written onto a copy of the full "
        f"backup of snapshot 1 (the copy, made and synced before, is not timed), fsync included. {a.reps} runs each, alternating; medians.",
        f"Machine: {os.uname().release}, {os.cpu_count()} cores. Date: {time.strftime('%Y-%m-%d')}. Goal: ≥ 20× less time.",
        "",
        "| copy | bytes moved | time | |",
        "|---|---|---|---|",
        f"| full `nbdcopy` | {size:,} | {f:.2f} s | |",
        f"| incremental (dirty bitmap) | {moved:,} | {i:.3f} s | **{f / i:.0f}× less time** |",
        "",
        f"The incremental result equals the full copy of snapshot 2: {'yes' if same else 'NO'} (md5). "
        f"Bytes moved / bytes changed: {moved / changed:.2f}.",
    ]
    nb.write_section(a.out, "thin-cbt", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
