#!/usr/bin/env python3
"""Snapshot benchmarks (issue 12), side by side in one run, medians of --reps:

1. seed 002 through the snapshot stack: `snapshot-origin` over a 1024-segment vs a
   1-segment linear origin with an active snapshot, randwrite 4 KiB with a FLUSH
   after every write, 16 jobs;
2. writes to a snapshot (64 KiB chunks, so each first partial write copies) vs
   writes to a qcow2 overlay (64 KiB clusters) over the same raw base, served by
   qemu-nbd: 4 KiB random and 64 KiB sequential;
3. origin randwrite 4 KiB with one active snapshot whose chunks are all copied
   already, vs the origin with no snapshot;
4. merge rate vs a plain sequential copy of the same bytes (dd, 1 MiB blocks).

Every server works through the page cache (dmkit --buffered, qemu-nbd
--cache=writeback). Writes BENCHMARKS.md, section `snapshot`.

Usage: bench/snapshot.py [--reps 3] [--runtime 3] [--dir /dev/shm] [--size-mib 1024]
"""
import argparse, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

MIB = 1 << 20


def Dmkit(tmp, devices):
    """A dmkit daemon through the page cache, as qemu-nbd --cache=writeback."""
    return run.Dmkit(tmp, devices, ["--buffered"])


class QemuOverlay:
    def __init__(self, tmp, overlay):
        self.sock = os.path.join(tmp, "qemu.sock")
        self.p = subprocess.Popen(["qemu-nbd", "-f", "qcow2", "--cache=writeback", "--persistent",
                                   "--shared=16", "-k", self.sock, overlay], stderr=subprocess.DEVNULL)
        run.wait_for(self.sock)
        time.sleep(0.2)

    def uri(self, _name):
        return f"nbd+unix:///?socket={self.sock}"

    def cpu(self):
        return run.proc_cpu(self.p.pid)

    def stop(self):
        self.p.terminate()
        self.p.wait(10)


def fio_on(server, name, size, args, runtime):
    ios, _, cpu = run.fio_cpu(server, server.uri(name), [f"--size={size}"] + args, runtime)
    return ios, cpu


def fill(path, size, seed_byte=0x5a):
    with open(path, "wb") as f:
        f.truncate(size)
    subprocess.run(["fio", "--name=fill", "--ioengine=psync", "--rw=write", "--bs=1M", f"--size={size}",
                    f"--filename={path}", "--buffer_pattern=0x5a", "--end_fsync=0"],
                   capture_output=True, check=True)


def sparse(path, size):
    if os.path.exists(path):
        os.unlink(path)
    with open(path, "wb") as f:
        f.truncate(size)


def seed002(d, tmp, reps, runtime):
    """1024 vs 1 linear segments under snapshot-origin with an active snapshot."""
    size = 1024 * 8000 * 512
    base = os.path.join(d, "snap-seed.img")
    cow = os.path.join(d, "snap-seed.cow")
    res = {"1": [], "1024": []}
    for _ in range(reps):
        for label in ("1", "1024"):
            sparse(base, size)
            sparse(cow, size + 64 * MIB)
            if label == "1":
                lin = f"0 {size // 512} linear {base} 0\n"
            else:
                lin = "".join(f"{8000 * i} 8000 linear {base} {8000 * i}\n" for i in range(1024))
            s = Dmkit(tmp, [("real", lin),
                            ("lv", f"0 {size // 512} snapshot-origin /dev/mapper/real"),
                            ("snap", f"0 {size // 512} snapshot /dev/mapper/real {cow} P 8")])
            try:
                r = fio_on(s, "lv", size, ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--numjobs=16",
                                            "--fsync=1"], runtime)
            finally:
                s.stop()
            res[label].append(r)
            print(f"  seed002 {label}: {r[0]:,.0f} IOPS", file=sys.stderr)
    os.unlink(base)
    os.unlink(cow)
    return {k: (run.med([x[0] for x in v]), run.med([x[1] for x in v])) for k, v in res.items()}


def snapshot_writes(d, tmp, size, reps, runtime):
    """dmkit snapshot (64 KiB chunks) vs qcow2 overlay (64 KiB clusters)."""
    base = os.path.join(d, "snap-base.img")
    fill(base, size)
    cow = os.path.join(d, "snap.cow")
    ovl = os.path.join(d, "snap-overlay.qcow2")
    workloads = [("randwrite 4k qd32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"]),
                 ("seq write 64k qd8", ["--rw=write", "--bs=64k", "--iodepth=8"])]
    res = {(w, k): [] for w, _ in workloads for k in ("dmkit", "qemu")}
    for _ in range(reps):
        for w, args in workloads:
            sparse(cow, size + 64 * MIB)
            s = Dmkit(tmp, [("snap", f"0 {size // 512} snapshot {base} {cow} P 128")])
            try:
                res[(w, "dmkit")].append(fio_on(s, "snap", size, args, runtime))
            finally:
                s.stop()
            if os.path.exists(ovl):
                os.unlink(ovl)
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "raw",
                            "-o", "cluster_size=65536", ovl], check=True)
            q = QemuOverlay(tmp, ovl)
            try:
                res[(w, "qemu")].append(fio_on(q, "", size, args, runtime))
            finally:
                q.stop()
            print(f"  {w}: dmkit {res[(w, 'dmkit')][-1][0]:,.0f} qemu {res[(w, 'qemu')][-1][0]:,.0f}",
                  file=sys.stderr)
    for p in (cow, ovl):
        if os.path.exists(p):
            os.unlink(p)
    return workloads, {k: (run.med([x[0] for x in v]), run.med([x[1] for x in v])) for k, v in res.items()}, base


def origin_after_copy(d, tmp, base, size, reps, runtime):
    """Origin randwrite with an active snapshot whose chunks are all copied, vs none."""
    cow = os.path.join(d, "snap-full.cow")
    args = ["--rw=randwrite", "--bs=4k", "--iodepth=32"]
    res = {"none": [], "snap": []}
    for _ in range(reps):
        s = Dmkit(tmp, [("lv", f"0 {size // 512} snapshot-origin {base}")])
        try:
            res["none"].append(fio_on(s, "lv", size, args, runtime))
        finally:
            s.stop()
        sparse(cow, size + 64 * MIB)
        s = Dmkit(tmp, [("lv", f"0 {size // 512} snapshot-origin {base}"),
                        ("snap", f"0 {size // 512} snapshot {base} {cow} P 16")])
        try:
            # every chunk copied once: one sequential pass over the origin
            subprocess.run(["fio", "--name=pre", "--ioengine=nbd", f"--uri={s.uri('lv')}", "--rw=write",
                            "--bs=1M", "--iodepth=8", f"--size={size}"], capture_output=True, check=True)
            res["snap"].append(fio_on(s, "lv", size, args, runtime))
        finally:
            s.stop()
        print(f"  origin: none {res['none'][-1][0]:,.0f} snap {res['snap'][-1][0]:,.0f}", file=sys.stderr)
    os.unlink(cow)
    return {k: (run.med([x[0] for x in v]), run.med([x[1] for x in v])) for k, v in res.items()}


def merge_rate(d, tmp, base, size, reps):
    """Merge `size` bytes of exceptions back vs dd of as many bytes."""
    cow = os.path.join(d, "snap-merge.cow")
    merge, copy = [], []
    for _ in range(reps):
        sparse(cow, size + 64 * MIB)
        s = Dmkit(tmp, [("lv", f"0 {size // 512} snapshot-origin {base}"),
                        ("snap", f"0 {size // 512} snapshot {base} {cow} P 16")])
        try:
            # writes to the snapshot: consecutive exceptions, as a merge meets them
            subprocess.run(["fio", "--name=pre", "--ioengine=nbd", f"--uri={s.uri('snap')}", "--rw=write",
                            "--bs=1M", "--iodepth=8", f"--size={size}"], capture_output=True, check=True)
            s.cli("suspend", "lv")
            s.cli("suspend", "snap")
            s.cli("load", "lv", "--table", f"0 {size // 512} snapshot-merge {base} {cow} P 16")
            t0 = time.time()
            s.cli("resume", "lv")
            while True:
                f = s.cli("status", "lv").split()
                if f[3].split("/")[0] == f[4]:
                    break
                time.sleep(0.005)
            merge.append(size / (time.time() - t0) / MIB)
        finally:
            s.stop()
        t0 = time.time()
        subprocess.run(["dd", f"if={cow}", f"of={base}", "bs=1M", f"count={size // MIB}", "skip=1",
                        "conv=notrunc,fdatasync"], capture_output=True, check=True)
        copy.append(size / (time.time() - t0) / MIB)
        print(f"  merge {merge[-1]:,.0f} MiB/s, dd {copy[-1]:,.0f} MiB/s", file=sys.stderr)
    os.unlink(cow)
    return run.med(merge), run.med(copy)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    size = a.size_mib * MIB
    cmd = f"bench/snapshot.py --reps {a.reps} --runtime {a.runtime} --dir {a.dir} --size-mib {a.size_mib}"
    lines = [f"## Snapshots (issue 12)\n", f"`{cmd}`; backing files on `{a.dir}`, every server through the page "
             "cache (dmkit `--buffered`, qemu-nbd `--cache=writeback`); medians of the reps, CPU per request "
             "is the server's user+system time over the run / requests.\n"]
    with tempfile.TemporaryDirectory() as tmp:
        s2 = seed002(a.dir, tmp, a.reps, a.runtime)
        lines.append("### Seed 002 through `snapshot-origin` with an active snapshot\n")
        lines.append("fio nbd, randwrite 4 KiB, `--fsync=1` (a FLUSH after every write), 16 jobs, QD1; chunk 4 KiB.\n")
        lines.append("| origin | IOPS | dmkit µs CPU/request |")
        lines.append("|---|---|---|")
        lines.append(f"| 1 linear segment | {run.fmt(s2['1'][0])} | {run.fmt(s2['1'][1], 2)} |")
        lines.append(f"| 1024 linear segments | {run.fmt(s2['1024'][0])} | {run.fmt(s2['1024'][1], 2)} |")
        lines.append(f"\n**1024 / 1 segments: {s2['1024'][0] / s2['1'][0]:.2f}** (goal ≥ 0.95)\n")
        wls, sw, base = snapshot_writes(a.dir, tmp, size, a.reps, a.runtime)
        lines.append("### Writes to a snapshot vs a qcow2 overlay (qemu-nbd)\n")
        lines.append(f"Fresh COW / overlay each rep over a {a.size_mib} MiB raw base; chunk = cluster = 64 KiB, so "
                     "each first 4 KiB write to a chunk copies it.\n")
        lines.append("| workload | dmkit IOPS | qemu-nbd IOPS | dmkit/qemu-nbd | dmkit µs CPU/req | qemu-nbd µs CPU/req |")
        lines.append("|---|---|---|---|---|---|")
        for w, _ in wls:
            dd, qq = sw[(w, "dmkit")], sw[(w, "qemu")]
            lines.append(f"| {w} | {run.fmt(dd[0])} | {run.fmt(qq[0])} | **{dd[0] / qq[0]:.2f}** | "
                         f"{run.fmt(dd[1], 2)} | {run.fmt(qq[1], 2)} |")
        lines.append("\nGoal: dmkit ≥ 1.5× on both.\n")
        oc = origin_after_copy(a.dir, tmp, base, size, a.reps, a.runtime)
        lines.append("### Origin writes once every chunk is copied\n")
        lines.append("randwrite 4 KiB QD32 to `snapshot-origin`; with one snapshot (chunk 8 KiB) after a full "
                     "sequential pass has copied every chunk, vs no snapshot.\n")
        lines.append("| origin | IOPS | dmkit µs CPU/request |")
        lines.append("|---|---|---|")
        lines.append(f"| no snapshot | {run.fmt(oc['none'][0])} | {run.fmt(oc['none'][1], 2)} |")
        lines.append(f"| one snapshot, all copied | {run.fmt(oc['snap'][0])} | {run.fmt(oc['snap'][1], 2)} |")
        lines.append(f"\n**with / without: {oc['snap'][0] / oc['none'][0]:.2f}** (goal ≥ 0.9)\n")
        m, c = merge_rate(a.dir, tmp, base, size, a.reps)
        lines.append("### Merge rate\n")
        lines.append(f"{a.size_mib} MiB of exceptions (written to the snapshot in 1 MiB writes, so the merge "
                     "meets runs of consecutive chunks), merged back through `snapshot-merge`, vs `dd bs=1M "
                     "conv=fdatasync` copying as many bytes COW → origin.\n")
        lines.append("| merge MiB/s | dd MiB/s | merge/dd |")
        lines.append("|---|---|---|")
        lines.append(f"| {run.fmt(m)} | {run.fmt(c)} | **{m / c:.2f}** |")
        lines.append("\nGoal: ≥ 0.8.")
        os.unlink(base)
    run.write_section(a.out, "snapshot", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
