#!/usr/bin/env python3
"""vhost-user-blk (issue 48): dmkit's backend beside qemu-storage-daemon's, QEMU's
NBD client to dmkit, and QEMU's own virtio-blk on a raw file, all as disks of one
guest (the kernel oracle's, tests/oracle/run.sh: Debian's 6.1 under qemu, TCG on
this machine, so only the ratios taken in the same run count).

The disks (each a 512 MiB file on --dir, written in full first, one file each so
no two servers share a file; num-queues 2 on every one):

- dmkit: a `linear` device over its file, `dmkit attach --vhost-user`;
- qsd: `qemu-storage-daemon --export type=vhost-user-blk` over a raw file with
  `cache.direct=on` and `aio=io_uring` (the same O_DIRECT as dmkit's);
- nbd: the same dmkit device through QEMU's NBD client (`driver=nbd` over dmkit's
  unix socket) on a virtio-blk-pci disk;
- raw: QEMU's virtio-blk-pci on a raw file, `cache.direct=on`, `aio=io_uring`:
  no server outside QEMU.

The same fio job in the guest on each (4 KiB random read, then write, QD32, libaio,
O_DIRECT, with each of --jobs jobs); the kinds in a rotated order per rep; medians of
--reps. Around
each run the guest waits on a mailbox disk while the host reads the server's CPU time
(utime + stime of every thread, /proc/PID/stat): server CPU per request is that over
the requests fio completed. QEMU's own CPU is not a server's (it runs the guest).

Writes BENCHMARKS.md, section `vhost-user-blk`.

Usage: bench/vhost_user.py [--reps 3] [--runtime 8] [--jobs 1,4] [--dir /var/tmp]
"""
import argparse, os, re, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

KINDS = ["dmkit", "qsd", "nbd", "raw"]
RWS = ["randread", "randwrite"]
SIZE = 512 << 20
GUEST = r"""
mb() { dd if=$MB bs=512 count=1 iflag=direct 2>/dev/null | head -c 8; }
dev_of() { for b in /sys/block/vd*; do s=$(cat $b/serial 2>/dev/null || true); [ "$s" = "$1" ] && echo /dev/${b##*/}; done; true; }
MB=$(dev_of "")
DMKIT=$(dev_of bench); NBD=$(dev_of nbd); RAW=$(dev_of raw)
for b in /sys/block/vd*; do d=/dev/${b##*/}; case " $MB $DMKIT $NBD $RAW " in *" $d "*) ;; *) QSD=$d;; esac; done
echo "ORACLE disks dmkit=$DMKIT qsd=$QSD nbd=$NBD raw=$RAW mailbox=$MB"
echo "ORACLE cpus $(nproc)"
dev() { case $1 in dmkit) echo $DMKIT;; qsd) echo $QSD;; nbd) echo $NBD;; raw) echo $RAW;; esac; }
n=0
for rep in $(seq REPS); do
  for k in $(echo KINDS | tr ' ' '\n' | awk -v r=$rep '{a[NR]=$0} END {for (i = 0; i < NR; i++) print a[(i + r - 1) % NR + 1]}'); do
    for rw in RWS; do
     for j in JOBS; do
      n=$((n+1)); tag=$(printf 'b%07d' $n)
      echo "ORACLE begin $tag $k"
      while [ "$(mb)" != "$tag" ]; do sleep 0.05; done
      out=$(fio --name=b --filename=$(dev $k) --rw=$rw --bs=4k --iodepth=32 --ioengine=libaio --direct=1 \
            --numjobs=$j --group_reporting --runtime=RUNTIME --time_based --ramp_time=1 --size=512M --minimal)
      if [ $rw = randread ]; then iops=$(echo "$out" | cut -d';' -f8); else iops=$(echo "$out" | cut -d';' -f49); fi
      tag=$(printf 'e%07d' $n)
      echo "ORACLE end $tag r$rep-$k-$rw-$j $iops"
      while [ "$(mb)" != "$tag" ]; do sleep 0.05; done
     done
    done
  done
done
echo "ORACLE finished"
"""


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=8)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--jobs", default="1,4", help="fio job counts, comma-separated")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    jobs = [int(j) for j in a.jobs.split(",")]
    dmkit = os.path.join(run.ROOT, "target", "release", "dmkit")
    clk = os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        files = {k: os.path.join(tmp, f"{k}.img") for k in ("dmkit", "qsd", "raw")}
        for p in files.values():
            subprocess.run(["dd", "if=/dev/zero", f"of={p}", "bs=1M", f"count={SIZE >> 20}", "conv=fsync"],
                           check=True, capture_output=True)
        mailbox = os.path.join(tmp, "mailbox.img")
        with open(mailbox, "wb") as h:
            h.truncate(1 << 20)
        rundir = os.path.join(tmp, "run")
        d = subprocess.Popen([dmkit, "serve", "--run-dir", rundir], stderr=subprocess.DEVNULL)
        qsd_sock, vu_sock = os.path.join(tmp, "qsd.sock"), os.path.join(tmp, "dmkit.sock")
        qsd = subprocess.Popen([
            "qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=f0,filename={files['qsd']},aio=io_uring,cache.direct=on",
            "--blockdev", "driver=raw,node-name=r0,file=f0",
            "--export", f"type=vhost-user-blk,id=e0,node-name=r0,addr.type=unix,addr.path={qsd_sock},"
                        "writable=on,num-queues=2"])
        try:
            run.wait_for(os.path.join(rundir, "serve.pid"))
            ctl = [dmkit, "--run-dir", rundir]
            subprocess.run(ctl + ["create", "bench", "--table", f"0 {SIZE // 512} linear {files['dmkit']} 0"],
                           check=True)
            subprocess.run(ctl + ["attach", "bench", "--vhost-user", vu_sock], check=True, capture_output=True)
            run.wait_for(qsd_sock)
            qemu = " ".join([
                f"-chardev socket,id=c0,path={vu_sock} -device vhost-user-blk-pci,chardev=c0,num-queues=2",
                f"-chardev socket,id=c1,path={qsd_sock} -device vhost-user-blk-pci,chardev=c1,num-queues=2",
                f"-blockdev driver=nbd,node-name=n0,server.type=unix,server.path={rundir}/nbd.sock,export=bench",
                "-device virtio-blk-pci,drive=n0,serial=nbd,num-queues=2",
                f"-blockdev driver=file,node-name=f1,filename={files['raw']},aio=io_uring,cache.direct=on",
                "-blockdev driver=raw,node-name=r1,file=f1 -device virtio-blk-pci,drive=r1,serial=raw,num-queues=2",
            ])
            script = (GUEST.replace("REPS", str(a.reps)).replace("KINDS", " ".join(KINDS))
                      .replace("RWS", " ".join(RWS)).replace("RUNTIME", str(a.runtime))
                      .replace("JOBS", " ".join(map(str, jobs))))
            sp = os.path.join(tmp, "guest.sh")
            open(sp, "w").write(script)
            serial = os.path.join(tmp, "serial.txt")
            env = dict(os.environ, ORACLE_BINS="/usr/bin/fio", ORACLE_SMP="2", ORACLE_MEM="1024",
                       ORACLE_QEMU_ARGS=qemu, ORACLE_SERIAL=serial,
                       DMKIT_ORACLE_TIMEOUT=str(600 + a.reps * len(KINDS) * len(RWS) * len(jobs) * (a.runtime + 6) * 3))
            result = {}

            def guest():
                result["r"] = subprocess.run(["bash", os.path.join(run.ROOT, "tests", "oracle", "run.sh"), sp,
                                              mailbox], env=env, capture_output=True, text=True)

            t = threading.Thread(target=guest)
            t.start()
            ticks, seen = {}, set()
            server = {"dmkit": d.pid, "nbd": d.pid, "qsd": qsd.pid}
            while t.is_alive():
                text = open(serial, errors="replace").read() if os.path.exists(serial) else ""
                for m in re.finditer(r"ORACLE (begin|end) ([be]\d{7}) ([^\r\n]+)\r?\n", text):
                    what, tag, rest = m.groups()
                    if tag in seen:
                        continue
                    seen.add(tag)
                    n = tag[1:]
                    if what == "begin":
                        pid = server.get(rest)
                        ticks[n] = (rest, pid, cpu_ticks(pid) if pid else None)
                    else:
                        kind, pid, t0 = ticks[n]
                        ticks[n] = (kind, pid, (cpu_ticks(pid) - t0) if pid else None, rest)
                    with open(mailbox, "r+b") as h:
                        h.write(tag.encode())
                        h.flush()
                        os.fsync(h.fileno())
                time.sleep(0.05)
            t.join()
            r = result["r"]
        finally:
            qsd.terminate()
            d.terminate()
            qsd.wait(30)
            d.wait(60)
    marks = {}
    for line in r.stdout.splitlines():
        line = line.strip()
        if line.startswith("ORACLE "):
            k, _, v = line[7:].partition(" ")
            marks.setdefault(k, []).append(v)
    if r.returncode != 0 or "finished" not in marks:
        sys.exit(f"guest run failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    iops, cpu = {}, {}
    for n, v in ticks.items():
        kind, pid, dt, label = v
        name, value = label.split()
        _, k, rw, j = name.split("-", 3)
        iops.setdefault((k, rw, j), []).append(float(value))
        reqs = float(value) * a.runtime
        if dt is not None and reqs:
            cpu.setdefault((k, rw, j), []).append(dt / clk * 1e6 / reqs)
    res = {key: (statistics.median(v), statistics.median(cpu[key]) if key in cpu else None)
           for key, v in iops.items()}
    for (k, rw, j), (i, c) in sorted(res.items()):
        print(f"{k:6} {rw:9} {j} jobs {i:10,.0f} IOPS  " + (f"{c:6.1f} us server CPU/req" if c else ""), flush=True)
    commit = subprocess.run(["git", "-C", run.ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [
        "## vhost-user-blk (issue 48, `bench/vhost_user.py`)",
        "",
        f"`python3 bench/vhost_user.py --reps {a.reps} --runtime {a.runtime} --jobs {a.jobs} --dir {a.dir}` on "
        f"{commit}: one "
        f"guest (Debian's 6.1 under qemu **TCG**, {marks['cpus'][0]} vCPUs, on this 2-core machine) with four "
        "disks, each over its own 512 MiB file (written in full first), num-queues 2: dmkit's vhost-user-blk "
        "(a `linear` device), qemu-storage-daemon's vhost-user-blk export (`cache.direct=on`, `aio=io_uring`), "
        "QEMU's NBD client to the same dmkit device, and QEMU's own virtio-blk on a raw file (`cache.direct=on`, "
        "`aio=io_uring`). fio in the guest: 4 KiB, QD32 a job, libaio, O_DIRECT; medians of the reps. "
        "**Under TCG the guest's emulation is the bottleneck and every absolute figure is meaningless: only the "
        "ratios and the server CPU per request count.** The issue's figures are for KVM, which this machine "
        "lacks.",
        "",
        "| rw, jobs | dmkit vhost-user IOPS | qsd vhost-user IOPS | QEMU NBD → dmkit IOPS | QEMU virtio-blk raw IOPS "
        "| dmkit / qsd | dmkit / NBD | dmkit / raw | dmkit CPU/req (µs) | qsd CPU/req (µs) | dmkit over NBD CPU/req (µs) "
        "| dmkit / qsd CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for rw, j in ((rw, j) for j in jobs for rw in RWS):
        dm, q, nb, raw = (res[(k, rw, str(j))] for k in KINDS)
        lines.append(
            f"| {rw}, {j} | {dm[0]:,.0f} | {q[0]:,.0f} | {nb[0]:,.0f} | {raw[0]:,.0f} | **{dm[0] / q[0]:.2f}** "
            f"| **{dm[0] / nb[0]:.2f}** | **{dm[0] / raw[0]:.2f}** | {dm[1]:.1f} | {q[1]:.1f} | {nb[1]:.1f} "
            f"| **{dm[1] / q[1]:.2f}** |")
    lines += [
        "",
        "Server CPU per request: the server process's utime + stime (all threads) over a run, read by the host "
        "while the guest waits on a mailbox disk before and after it, over the requests fio completed. dmkit "
        "through ublk is not in this run (ublk needs the 6.12 guest with dmkit inside it: `bench/ublk.py`).",
    ]
    run.write_section(a.out, "vhost-user-blk", lines)


if __name__ == "__main__":
    main()
