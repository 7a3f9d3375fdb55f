#!/usr/bin/env python3
"""The raid target where the legs are the limit (issue 47): each leg is a loop
device over a file in /dev/shm, throttled for the daemon by the kernel's blkio
controller (cgroup v1 `blkio.throttle.*`: IOPS and bytes per second per
device), so a leg behaves as a slow disk of known speed and the question is
what the target makes of its legs. Side by side in one daemon, medians of the
reps, interleaved:

- raid1 of 2 legs against one leg alone (a linear device over it): random 4 KiB
  reads (spread over the legs) and writes (on both);
- raid5 of 4 legs (3 data, chunks of 64 KiB) against a striped device over 3
  legs with the same chunk: writes of whole rows (192 KiB, aligned), which
  raid5 writes without reading, P computed from the row;
- recovery: a raid1 leg away (an `error` table under it) while 64 KiB writes
  land, then back: the bytes the recovery wrote to it against the bytes written
  while it was away (blkio's per-device byte count);
- a full resync of a new raid1 against `dd` copying one leg to the other under
  the same throttle.

Usage: bench/raid.py [--reps 3] [--runtime 5] [--iops 3000] [--mibs 100]
Needs: root, cgroup v1 blkio, losetup, fio with the nbd engine, a release build.
Writes BENCHMARKS.md, section `raid`.
"""
import argparse, os, re, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

CG = "/sys/fs/cgroup/blkio/dmkit-raid-bench"
LEG_MIB = 256
CHUNK = 128  # sectors


def sh(*a, **k):
    return subprocess.run(a, check=True, capture_output=True, text=True, **k).stdout


def majmin(dev):
    return sh("lsblk", "-dno", "MAJ:MIN", dev).strip()


def throttle(loops, iops, mibs):
    os.makedirs(CG, exist_ok=True)
    for l in loops:
        mm = majmin(l)
        for f, v in (("read_iops_device", iops), ("write_iops_device", iops),
                     ("read_bps_device", mibs << 20), ("write_bps_device", mibs << 20)):
            with open(f"{CG}/blkio.throttle.{f}", "w") as fh:
                fh.write(f"{mm} {v}\n")


def join_cgroup(pid):
    with open(f"{CG}/cgroup.procs", "w") as fh:
        fh.write(str(pid))


def written_bytes(dev):
    """Bytes written to `dev` by the cgroup so far."""
    mm = majmin(dev)
    with open(f"{CG}/blkio.throttle.io_service_bytes") as fh:
        for line in fh:
            w = line.split()
            if len(w) == 3 and w[0] == mm and w[1] == "Write":
                return int(w[2])
    return 0


def wait_idle(d, name, timeout=600):
    t0 = time.time()
    while time.time() - t0 < timeout:
        st = d.cli("status", name)
        if " idle " in st:
            return st
        time.sleep(0.05)
    raise RuntimeError(f"{name} not idle: {st}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--iops", type=int, default=3000)
    ap.add_argument("--mibs", type=int, default=100)
    a = ap.parse_args()
    cmd = f"bench/raid.py --reps {a.reps} --runtime {a.runtime} --iops {a.iops} --mibs {a.mibs}"
    tmp = tempfile.mkdtemp(prefix="raid-bench-", dir="/dev/shm")
    files, loops = [], []
    for i in range(4):
        f = os.path.join(tmp, f"leg{i}")
        with open(f, "wb") as fh:
            fh.truncate(LEG_MIB << 20)
        files.append(f)
        loops.append(sh("losetup", "-f", "--show", f).strip())
    metas = []
    for i in range(4):
        m = os.path.join(tmp, f"meta{i}")
        with open(m, "wb") as fh:
            fh.truncate(1 << 20)
        metas.append(m)
    throttle(loops, a.iops, a.mibs)
    leg_sectors = (LEG_MIB << 20) // 512
    d = run.Dmkit(tmp)
    join_cgroup(d.p.pid)
    rows = []
    try:
        # --- raid1 against one leg ---
        d.cli("create", "one", input=f"0 {leg_sectors} linear {loops[0]} 0")
        t = (f"0 {leg_sectors} raid raid1 4 0 nosync region_size 8192 2 "
             f"{metas[0]} {loops[0]} {metas[1]} {loops[1]}")
        d.cli("create", "r1", input=t)
        wait_idle(d, "r1")
        for label, args in (("random 4 KiB reads, QD32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
                            ("random 4 KiB writes, QD32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"])):
            one, mir = [], []
            for _ in range(a.reps):
                one.append(run.fio(["--ioengine=nbd", f"--uri={d.uri('one')}"] + args, a.runtime)[0])
                mir.append(run.fio(["--ioengine=nbd", f"--uri={d.uri('r1')}"] + args, a.runtime)[0])
            rows.append((f"raid1 (2 legs) / one leg: {label}", f"{run.med(mir):,.0f} IOPS",
                         f"{run.med(one):,.0f} IOPS", run.med(mir) / run.med(one)))
        d.cli("remove", "r1")
        d.cli("remove", "one")
        # --- raid5 full rows against striped over the data legs ---
        for m in metas:
            with open(m, "wb") as fh:
                fh.truncate(0)
                fh.truncate(1 << 20)
        t = f"0 {3 * leg_sectors} striped 3 {CHUNK} {loops[0]} 0 {loops[1]} 0 {loops[2]} 0"
        d.cli("create", "st", input=t)
        t = (f"0 {3 * leg_sectors} raid raid5_ls 4 {CHUNK} nosync region_size 8192 4 "
             + " ".join(f"{metas[i]} {loops[i]}" for i in range(4)))
        d.cli("create", "r5", input=t)
        wait_idle(d, "r5")
        row = 3 * CHUNK * 512
        args = ["--rw=write", f"--bs={row}", "--iodepth=8", f"--size={3 * (LEG_MIB << 20) // row * row}"]
        st, r5 = [], []
        for _ in range(a.reps):
            st.append(run.fio(["--ioengine=nbd", f"--uri={d.uri('st')}"] + args, a.runtime)[1])
            r5.append(run.fio(["--ioengine=nbd", f"--uri={d.uri('r5')}"] + args, a.runtime)[1])
        rows.append(("raid5 (4 legs) / striped over 3: writes of whole rows (192 KiB), QD8",
                     f"{run.med(r5):,.0f} MiB/s", f"{run.med(st):,.0f} MiB/s", run.med(r5) / run.med(st)))
        d.cli("message", "r5", "0", "check")
        chk = wait_idle(d, "r5")
        assert chk.split()[-3] == "0", f"raid5 parity after the writes: {chk}"
        d.cli("remove", "r5")
        d.cli("remove", "st")
        # --- recovery copies what the bitmap names ---
        d.cli("create", "leg1", input=f"0 {leg_sectors} linear {loops[1]} 0")
        # a daemon period of 100 ms (25 jiffies): the bits a new array starts
        # with are cleared before the leg goes
        t = (f"0 {leg_sectors} raid raid1 6 0 nosync region_size 128 daemon_sleep 25 2 "
             f"{metas[0]} {loops[0]} {metas[1]} /dev/mapper/leg1")
        for m in metas[:2]:
            with open(m, "wb") as fh:
                fh.truncate(1 << 20)
        d.cli("create", "r1", input=t)
        wait_idle(d, "r1")
        time.sleep(1)
        d.cli("load", "leg1", input=f"0 {leg_sectors} error")
        d.cli("suspend", "leg1")
        d.cli("resume", "leg1")
        away_mib = 64
        subprocess.run(["fio", "--name=away", "--ioengine=nbd", f"--uri={d.uri('r1')}", "--rw=randwrite",
                        "--bs=64k", "--iodepth=8", f"--io_size={away_mib}m", "--output-format=json"],
                       check=True, capture_output=True)
        st = d.cli("status", "r1")
        assert " AD " in st, f"leg 1 away: {st}"
        d.cli("load", "leg1", input=f"0 {leg_sectors} linear {loops[1]} 0")
        d.cli("suspend", "leg1")
        d.cli("resume", "leg1")
        before = written_bytes(loops[1])
        t0 = time.time()
        d.cli("load", "r1", input=t)
        d.cli("suspend", "r1")
        d.cli("resume", "r1")
        st = wait_idle(d, "r1")
        took = time.time() - t0
        copied = written_bytes(loops[1]) - before
        assert " AA " in st, st
        rows.append((f"recovery after {away_mib} MiB of random 64 KiB writes with leg 1 away "
                     f"(regions of 64 KiB): bytes written to the leg / bytes written while away",
                     f"{copied / (1 << 20):,.1f} MiB in {took:.1f} s", f"{away_mib} MiB", copied / (away_mib << 20)))
        d.cli("remove", "r1")
        d.cli("remove", "leg1")
        # --- a full resync against dd ---
        rs, dd = [], []
        size_mib = 128
        sectors = (size_mib << 20) // 512
        for _ in range(a.reps):
            for m in metas[:2]:
                with open(m, "wb") as fh:
                    fh.truncate(1 << 20)
            t0 = time.time()
            d.cli("create", "new", input=f"0 {sectors} raid raid1 1 0 2 {metas[0]} {loops[0]} {metas[1]} {loops[1]}")
            wait_idle(d, "new")
            rs.append(time.time() - t0)
            d.cli("remove", "new")
            t0 = time.time()
            subprocess.run(["sh", "-c", f"echo $$ > {CG}/cgroup.procs; exec dd if={loops[0]} of={loops[1]} "
                            f"bs=1M count={size_mib} iflag=direct oflag=direct"], check=True, capture_output=True)
            dd.append(time.time() - t0)
        rows.append((f"full resync of a new raid1 ({size_mib} MiB) / dd of a leg to the other",
                     f"{size_mib / run.med(rs):,.0f} MiB/s", f"{size_mib / run.med(dd):,.0f} MiB/s",
                     run.med(dd) / run.med(rs)))
    finally:
        d.stop()
        for l in loops:
            subprocess.run(["losetup", "-d", l])
        subprocess.run(["rm", "-rf", tmp])
    commit = sh("git", "-C", run.ROOT, "rev-parse", "--short", "HEAD").strip()
    day = sh("date", "-u", "+%Y-%m-%d").strip()
    lines = ["## raid (bench/raid.py)", "",
             f"`{cmd}`, run {day} on {commit}. Each leg is a loop device over a file in /dev/shm, "
             f"throttled for the daemon by the blkio controller to {a.iops} IOPS and {a.mibs} MiB/s each way, "
             "so the legs are the limit (a `delay` table would not be: it delays each I/O but takes any number "
             f"at once). fio's nbd engine, medians of {a.reps} runs of {a.runtime} s, interleaved; metadata "
             "devices are unthrottled files.", "",
             "| what | dmkit raid | against | ratio |", "|---|---|---|---|"]
    for what, x, y, r in rows:
        lines.append(f"| {what} | {x} | {y} | {r:.2f}× |")
    lines.append("")
    for l in lines:
        print(l)
    run.write_section(os.path.join(run.ROOT, "BENCHMARKS.md"), "raid", lines)


if __name__ == "__main__":
    main()
