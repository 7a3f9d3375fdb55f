#!/usr/bin/env python3
"""`dmkit lvmd` at scale: the latency of CreateLV and CreateLVSnapshot (as
TopoLVM's node plugin calls them, over lvmd's unix socket) with 10, 1,000 and
10,000 volumes already in the pool.
One dmkit daemon, one pool (metadata and data files on --dir), lvmd with
--no-attach (records on --dir too, each change fsynced as on a node).

Usage: bench/lvmd.py [--levels 10,1000,10000] [--samples 50] [--dir /dev/shm]
                     [--lvm-levels 10,1000]
Prints a markdown table for BENCHMARKS.md ("Kubernetes nodes: lvmd").

The anchor (--lvm-levels, empty for none): what TopoLVM's own lvmd does for the
same requests, Debian's `lvm lvcreate` run once a request (`-V 64M -T VG/pool`,
and `-s -kn VG/origin` for an active thin snapshot), on a loop device over a file
on --dir, in the same run. This machine has no kernel device-mapper, so LVM
drives a second dmkit daemon through the dm ioctl door (`dmkit exec`); its
times include the door's. LVM's metadata backups are off (fewer writes than a
node's default, so the anchor is, if anything, fast). The volumes that make up a
level are created through one `lvm` shell (the times are only of the samples).
"""
import argparse, os, statistics, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import DMKIT, Dmkit, wait_for  # noqa: E402

sys.path.insert(0, os.path.join(HERE, "..", "tests", "lvmd"))
import client  # noqa: E402  (generates the stubs from proto/ with grpcio-tools)


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="10,1000,10000")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--lvm-levels", default="10,1000")
    a = ap.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    lvm_levels = [int(x) for x in a.lvm_levels.split(",") if x]
    client.generate()
    import grpc
    import lvmd_pb2 as pb
    import lvmd_pb2_grpc as g

    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        meta, data = os.path.join(tmp, "meta.img"), os.path.join(tmp, "data.img")
        for p, n in ((meta, 1 << 30), (data, 64 << 30)):
            with open(p, "wb") as h:
                h.truncate(n)
        d = Dmkit(tmp)
        d.cli("create", "pool", "--table", f"0 {(64 << 30) // 512} thin-pool {meta} {data} 128 0")
        cfg = os.path.join(tmp, "lvmd.yaml")
        sock, sm = os.path.join(tmp, "lvmd.sock"), os.path.join(tmp, "sm.sock")
        with open(cfg, "w") as h:
            h.write(f"socket-name: {sock}\ndevice-classes:\n  - name: thin\n    default: true\n"
                    "    spare-gb: 0\n    type: thin\n    thin-pool: {name: pool, overprovision-ratio: 10000.0}\n")
        lvmd = subprocess.Popen([DMKIT, "lvmd", "--run-dir", d.run, "--config", cfg, "--no-attach",
                                 "--state", os.path.join(tmp, "lvmd.d"), "--snapshot-metadata", f"unix:{sm}"],
                                stderr=subprocess.DEVNULL)
        try:
            wait_for(sm)
            opts = [("grpc.default_authority", "localhost")]
            ch = grpc.insecure_channel(f"unix://{sock}", options=opts)
            lv = g.LVServiceStub(ch)
            have = 0
            lv.CreateLV(pb.CreateLVRequest(name="origin", size_bytes=1 << 30))
            have += 1
            for level in levels:
                while have < level:
                    lv.CreateLV(pb.CreateLVRequest(name=f"fill{have}", size_bytes=64 << 20))
                    have += 1
                create, snap = [], []
                for i in range(a.samples):
                    t = time.perf_counter()
                    lv.CreateLV(pb.CreateLVRequest(name=f"m{level}-{i}", size_bytes=64 << 20))
                    create.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    lv.CreateLVSnapshot(pb.CreateLVSnapshotRequest(name=f"s{level}-{i}", source_volume="origin"))
                    snap.append(time.perf_counter() - t)
                # back to `level` volumes for the next level's count
                for i in range(a.samples):
                    lv.RemoveLV(pb.RemoveLVRequest(name=f"m{level}-{i}"))
                    lv.RemoveLV(pb.RemoveLVRequest(name=f"s{level}-{i}"))
                rows.append((level, ms(create), ms(snap)))
                print(f"{level} volumes: CreateLV {ms(create)} ms, CreateLVSnapshot {ms(snap)} ms", file=sys.stderr)
        finally:
            lvmd.terminate()
            lvmd.wait(30)
            d.stop()
    anchor = {level: (c, s) for level, c, s in lvm_anchor(a.dir, lvm_levels, a.samples)}
    print(f"`bench/lvmd.py --levels {a.levels} --samples {a.samples} --dir {a.dir} --lvm-levels {a.lvm_levels}`\n")
    print("| volumes in the pool | CreateLV median / p99 (ms) | CreateLVSnapshot median / p99 (ms) "
          "| anchor: `lvm lvcreate -V` median / p99 (ms) | anchor: `lvm lvcreate -s` median / p99 (ms) |")
    print("|---|---|---|---|---|")
    for level, c, s in rows:
        lc, ls = anchor.get(level, ("not run", "not run"))
        print(f"| {level:,} | {c} | {s} | {lc} | {ls} |")


def ms(xs):
    return f"{statistics.median(xs) * 1e3:.1f} / {pct(xs, 99) * 1e3:.1f}"


def lvm_anchor(where, levels, samples):
    """LVM's own lvcreate at each level: (level, create, snapshot) rows."""
    if not levels:
        return []
    rows = []
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        img = os.path.join(tmp, "pv.img")
        with open(img, "wb") as h:
            h.truncate(80 << 30)
        loop = subprocess.run(["losetup", "-f", "--show", img], check=True, capture_output=True,
                              text=True).stdout.strip()
        d = Dmkit(tmp)
        vg = "dmkitbench"
        cfg = "backup/backup=0 backup/archive=0 activation/monitoring=0"

        def lvm(*args):
            t = time.perf_counter()
            subprocess.run([DMKIT, "--run-dir", d.run, "exec", "--", "lvm", args[0], "--devices", loop,
                            "--config", cfg, *args[1:]], check=True, capture_output=True)
            return time.perf_counter() - t

        def shell(commands):
            text = "".join(f"{c} --devices {loop} --config \"{cfg}\"\n" for c in commands)
            subprocess.run([DMKIT, "--run-dir", d.run, "exec", "--", "lvm"], input=text, text=True,
                           check=True, capture_output=True)

        try:
            lvm("pvcreate", "--metadatasize", "64m", loop)
            lvm("vgcreate", vg, loop)
            lvm("lvcreate", "-y", "--type", "thin-pool", "-L", "64G", "--poolmetadatasize", "1G", "-n", "pool", vg)
            lvm("lvcreate", "-y", "-V", "1G", "-T", f"{vg}/pool", "-n", "origin")
            have = 1
            for level in levels:
                shell(f"lvcreate -y -V 64M -T {vg}/pool -n fill{i}" for i in range(have, level))
                have = max(have, level)
                create, snap = [], []
                for i in range(samples):
                    create.append(lvm("lvcreate", "-y", "-V", "64M", "-T", f"{vg}/pool", "-n", f"m{level}-{i}"))
                    snap.append(lvm("lvcreate", "-y", "-s", "-kn", f"{vg}/origin", "-n", f"s{level}-{i}"))
                shell(f"lvremove -y {vg}/{p}{level}-{i}" for i in range(samples) for p in "ms")
                rows.append((level, ms(create), ms(snap)))
                print(f"{level} volumes: lvm lvcreate -V {ms(create)} ms, lvcreate -s {ms(snap)} ms", file=sys.stderr)
        finally:
            try:
                shell([f"vgchange -an {vg}"])
            except subprocess.CalledProcessError:
                pass
            d.stop()
            subprocess.run(["losetup", "-d", loop])
    return rows


if __name__ == "__main__":
    main()
