#!/usr/bin/env python3
"""The ublk frontend against the kernel's nbd client and loop device (issue 17).

Runs inside the kernel oracle's guest (tests/oracle/run.sh, Debian's 6.12
series, which has ublk_drv), since this machine cannot load modules: under TCG
every absolute figure is inflated, so only the ratios taken in the same guest
run count. The script runs unchanged on any kernel with ublk_drv (set
DMKIT_ORACLE_KERNEL to its series).

In one boot, over one 256 MiB RAM disk (brd, written in full first: the backing
costs next to nothing, so the frontends' costs show), with the same fio job
(4 KiB random read, then write, QD32, io_uring, O_DIRECT):

- ublk: dmkit `linear` over /dev/ram0, `dmkit attach` -> /dev/ublkb0;
- kernel nbd: the same dmkit device through `nbd-client -unix` (netlink, one
  connection per guest CPU) -> /dev/nbd0;
- loop: the kernel's loop device with direct I/O over /dev/ram0;
- the RAM disk itself (the limit).

The cells of each rep run in a rotated order; medians of --reps. Server CPU per
request is dmkit's (utime + stime from /proc, all threads: for ublk that
includes the driver's work done in its queue threads) over the requests fio
completed.

Writes BENCHMARKS.md, section `ublk`.

With --here the same shell script runs on this machine instead (root, and a
kernel with ublk_drv, nbd, loop and brd as modules; it replaces any brd RAM
disks). Not run on the development machine, which cannot load modules.

Usage: bench/ublk.py [--reps 3] [--runtime 8] [--smp 2] [--here]
"""
import argparse, os, statistics, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

KINDS = ["ublk", "nbd", "loop", "ram"]
RWS = ["randread", "randwrite"]
GUEST = r"""
set -e
mkdir -p RUNDIR /tmp
# one RAM disk of 256 MiB (in the guest run.sh loaded brd with its defaults)
if [ -f /mod/brd.ko ]; then
  rmmod brd; insmod /mod/brd.ko rd_nr=1 rd_size=262144
else
  modprobe -r brd 2>/dev/null || true
  modprobe brd rd_nr=1 rd_size=262144 && modprobe ublk_drv && modprobe nbd && modprobe loop
fi
echo "ORACLE kernel $(uname -r)"
[ -b /dev/ram0 ] || { echo "ORACLE error no-brd"; exit 1; }
fio --name=fill --filename=/dev/ram0 --rw=write --bs=1M --direct=1 --ioengine=psync > /dev/null
dmkit serve --run-dir RUNDIR > /tmp/dmkit.log 2>&1 &
PID=$!
i=0; while [ ! -S RUNDIR/control.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
D="dmkit --run-dir RUNDIR"
$D create lin --table "0 524288 linear /dev/ram0 0"
$D attach lin > /dev/null
nbd-client -unix RUNDIR/nbd.sock /dev/nbd0 -name lin -connections $(nproc) > /dev/null
LOOP=$(ul-losetup --direct-io=on -f --show /dev/ram0)
echo "ORACLE loop-dio $(cat /sys/block/${LOOP#/dev/}/loop/dio)"
echo "ORACLE cpus $(nproc)"
ticks() { awk '{print $14 + $15}' /proc/$PID/stat; }
dev() { case $1 in ublk) echo /dev/ublkb0;; nbd) echo /dev/nbd0;; loop) echo $LOOP;; ram) echo /dev/ram0;; esac; }
for rep in $(seq REPS); do
  for k in $(echo KINDS | tr ' ' '\n' | awk -v r=$rep '{a[NR]=$0} END {for (i = 0; i < NR; i++) print a[(i + r - 1) % NR + 1]}'); do
    for rw in RWS; do
      t0=$(ticks)
      out=$(fio --name=b --filename=$(dev $k) --rw=$rw --bs=4k --iodepth=32 --ioengine=io_uring --direct=1 \
            --runtime=RUNTIME --time_based --ramp_time=1 --size=256M --minimal)
      t1=$(ticks)
      if [ $rw = randread ]; then iops=$(echo "$out" | cut -d';' -f8); else iops=$(echo "$out" | cut -d';' -f49); fi
      echo "ORACLE r$rep-$k-$rw $iops $((t1 - t0))"
    done
  done
done
nbd-client -d /dev/nbd0 > /dev/null
$D detach lin
ul-losetup -d $LOOP
kill $PID
echo "ORACLE clk $(getconf CLK_TCK 2>/dev/null || echo 100)"
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=8)
    ap.add_argument("--smp", type=int, default=2)
    ap.add_argument("--here", action="store_true", help="run on this machine, not in the oracle's guest")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    dmkit = os.path.join(run.ROOT, "target", "release", "dmkit")
    with tempfile.TemporaryDirectory() as tmp:
        # util-linux's losetup (direct I/O) under a name busybox has no applet for
        losetup = os.path.join(tmp, "ul-losetup")
        os.symlink("/usr/sbin/losetup", losetup)
        script = (GUEST.replace("REPS", str(a.reps)).replace("KINDS", " ".join(KINDS))
                  .replace("RWS", " ".join(RWS)).replace("RUNTIME", str(a.runtime))
                  .replace("RUNDIR", os.path.join(tmp, "run") if a.here else "/run/dmkit"))
        sp = os.path.join(tmp, "guest.sh")
        open(sp, "w").write(script)
        bins = " ".join([dmkit, "/usr/bin/fio", "/usr/sbin/nbd-client", losetup, "/usr/bin/getconf"])
        env = dict(os.environ, ORACLE_BINS=bins, DMKIT_ORACLE_KERNEL=os.environ.get("DMKIT_ORACLE_KERNEL", "6.12"),
                   ORACLE_MODULES="drivers/block/ublk_drv.ko drivers/block/nbd.ko drivers/block/loop.ko "
                                  "drivers/block/brd.ko",
                   ORACLE_SMP=str(a.smp), ORACLE_MEM="1024",
                   DMKIT_ORACLE_TIMEOUT=str(600 + a.reps * len(KINDS) * len(RWS) * (a.runtime + 4) * 3))
        if a.here:
            env["PATH"] = f"{os.path.dirname(dmkit)}:{tmp}:{env['PATH']}"
            r = subprocess.run(["sh", sp], env=env, capture_output=True, text=True)
        else:
            r = subprocess.run(["bash", os.path.join(run.ROOT, "tests", "oracle", "run.sh"), sp],
                               env=env, capture_output=True, text=True)
    serial = r.stdout
    marks = {}
    for line in serial.splitlines():
        line = line.strip()
        if line.startswith("ORACLE "):
            k, _, v = line[7:].partition(" ")
            marks[k] = v
    if (r.returncode != 0 and not a.here) or "clk" not in marks:
        sys.exit(f"guest run failed ({r.returncode}):\n{serial}\n{r.stderr}")
    clk = int(marks["clk"])
    res = {}
    for k in KINDS:
        for rw in RWS:
            iops, us = [], []
            for rep in range(1, a.reps + 1):
                v, ticks = marks[f"r{rep}-{k}-{rw}"].split()
                v = float(v)
                iops.append(v)
                reqs = v * a.runtime
                us.append(int(ticks) / clk * 1e6 / reqs if reqs else 0.0)
            res[(k, rw)] = (statistics.median(iops), statistics.median(us))
            print(f"{k:5} {rw:9} {res[(k, rw)][0]:10,.0f} IOPS  {res[(k, rw)][1]:6.1f} us server CPU/req", flush=True)
    lines = [
        "## ublk frontend vs the kernel's nbd client and loop device (issue 17)",
        "",
        (f"`bench/ublk.py --reps {a.reps} --runtime {a.runtime} --here`: on kernel {marks.get('kernel')}, "
         f"{marks['cpus']} CPUs, medians of the reps. " if a.here else
         f"`bench/ublk.py --reps {a.reps} --runtime {a.runtime} --smp {a.smp}`: inside the kernel oracle's guest "
         f"(Debian's kernel {marks.get('kernel', '6.12')} under qemu TCG, {marks['cpus']} vCPUs, on this 2-core "
         "machine), one boot, medians of the reps. TCG inflates every absolute figure: only the ratios, taken in "
         "the same run, count. ")
        + "The backing is one 256 MiB RAM disk (brd, written in full first); "
        "the same fio job on each block device: 4 KiB, QD32, io_uring, O_DIRECT.",
        "",
        "| rw | ublk (dmkit linear) IOPS | kernel nbd (same dmkit device) IOPS | loop, direct I/O IOPS | RAM disk IOPS "
        "| ublk / nbd | ublk / loop | dmkit CPU/req, ublk (µs) | dmkit CPU/req, nbd (µs) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rw in RWS:
        u, n, lo, ram = (res[(k, rw)] for k in KINDS)
        lines.append(
            f"| {rw} | {u[0]:,.0f} | {n[0]:,.0f} | {lo[0]:,.0f} | {ram[0]:,.0f} | **{u[0] / n[0]:.2f}** "
            f"| **{u[0] / lo[0]:.2f}** | {u[1]:.1f} | {n[1]:.1f} |")
    lines += [
        "",
        "The nbd client runs with one connection per vCPU (netlink mode), dmkit's best case for it; "
        f"the loop device reports direct I/O on ({marks.get('loop-dio', '?')}). dmkit's CPU per request "
        "counts all its threads: for ublk that includes the driver's work done in the queue threads' "
        "io_uring task work; for nbd, the socket work.",
    ]
    run.write_section(a.out, "ublk", lines)


if __name__ == "__main__":
    main()
