#!/usr/bin/env python3
"""Side-by-side NBD benchmarks: dmkit vs nbdkit, qemu-nbd and fio's own io_uring
engine on the same backing file, same fio jobs, in one run. Writes BENCHMARKS.md.

Usage: bench/run.py [--reps N] [--runtime S] [--backing DIR ...] [--out FILE]
Needs: fio, nbdkit, qemu-nbd (bench/setup.sh installs them), a release build.
"""
import argparse, json, os, signal, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DMKIT = os.path.join(ROOT, "target", "release", "dmkit")
TICK = os.sysconf("SC_CLK_TCK")
SIZE = 1 << 30  # backing file bytes

WORKLOADS = [
    # name, fio args
    ("randread 4k qd32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    ("randwrite 4k qd32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"]),
    ("seq read 512k", ["--rw=read", "--bs=512k", "--iodepth=8"]),
    ("seq write 512k", ["--rw=write", "--bs=512k", "--iodepth=8"]),
]


def proc_cpu(pid):
    """utime+stime of a process and its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def wait_for(path, timeout=10):
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout:
            raise RuntimeError(f"{path} did not appear")
        time.sleep(0.02)


def fio(args, runtime):
    cmd = ["fio", "--name=b", "--output-format=json", f"--runtime={runtime}", "--time_based",
           "--ramp_time=1", "--group_reporting", "--verify=0"] + args
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")
    out = p.stdout
    j = json.loads(out[out.index("{"):])["jobs"][0]
    ios = j["read"]["iops"] + j["write"]["iops"]
    bw = (j["read"]["bw_bytes"] + j["write"]["bw_bytes"]) / (1 << 20)
    return ios, bw


class Server:
    """A server process exporting the backing file over a unix socket."""

    def __init__(self, kind, backing, tmp, table=None):
        self.kind, self.tmp = kind, tmp
        Server.n = getattr(Server, "n", 0) + 1
        self.sock = os.path.join(tmp, f"{kind}-{Server.n}.sock")
        sectors = SIZE // 512
        if kind == "dmkit":
            run = self.run = os.path.join(tmp, f"run-{Server.n}")
            self.p = subprocess.Popen([DMKIT, "serve", "--run-dir", run], stderr=subprocess.DEVNULL)
            wait_for(os.path.join(run, "control.sock"))
            t = table or f"0 {sectors} linear {backing} 0"
            subprocess.run([DMKIT, "--run-dir", run, "create", "bench"], input=t, text=True, check=True)
            self.uri = f"nbd+unix:///bench?socket={run}/nbd.sock"
        elif kind == "nbdkit":
            self.p = subprocess.Popen(["nbdkit", "-f", "-U", self.sock, "--threads=16", "file", backing],
                                      stderr=subprocess.DEVNULL)
            wait_for(self.sock)
            self.uri = f"nbd+unix:///?socket={self.sock}"
        elif kind == "qemu-nbd":
            self.p = subprocess.Popen(["qemu-nbd", "-f", "raw", "--cache=none", "--aio=io_uring",
                                       "--persistent", "--shared=16", "-k", self.sock, backing],
                                      stderr=subprocess.DEVNULL)
            wait_for(self.sock)
            self.uri = f"nbd+unix:///?socket={self.sock}"
        time.sleep(0.2)

    def cpu(self):
        return proc_cpu(self.p.pid)

    def stop(self):
        hwm = proc_hwm_kib(self.p.pid)
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        if self.kind == "dmkit":
            subprocess.run(["rm", "-rf", self.run])
        return hwm


def measure(kind, backing, tmp, wl_args, runtime, extra_fio=(), table=None):
    """One run: (iops, MiB/s, daemon µs CPU per I/O, peak RSS MiB)."""
    if kind == "fio-io_uring":
        ios, bw = fio(["--ioengine=io_uring", "--direct=1", f"--filename={backing}", f"--size={SIZE}"]
                      + wl_args + list(extra_fio), runtime)
        return ios, bw, None, None
    s = Server(kind, backing, tmp, table)
    try:
        c0, t0 = s.cpu(), time.time()
        ios, bw = fio(["--ioengine=nbd", f"--uri={s.uri}", f"--size={SIZE}"] + wl_args + list(extra_fio), runtime)
        cpu = s.cpu() - c0
        total = ios * (time.time() - t0 - 1)  # fio ramps for 1 s before counting
        return ios, bw, (cpu / total * 1e6 if total > 0 else None), None
    finally:
        hwm = s.stop()
        measure.last_hwm = hwm / 1024


def median_runs(kind, backing, tmp, wl_args, runtime, reps, **kw):
    rows = []
    for _ in range(reps):
        r = measure(kind, backing, tmp, wl_args, runtime, **kw)
        rows.append((r[0], r[1], r[2], getattr(measure, "last_hwm", None) if kind != "fio-io_uring" else None))
    med = lambda xs: statistics.median([x for x in xs if x is not None]) if any(x is not None for x in xs) else None
    return tuple(med([r[i] for r in rows]) for i in range(4))


def fmt(v, nd=0):
    return "—" if v is None else f"{v:,.{nd}f}"


def throughput(backing_dir, reps, runtime, out):
    backing = os.path.join(backing_dir, "dmkit-bench.img")
    subprocess.run(["fio", "--name=fill", "--ioengine=io_uring", "--direct=1", "--rw=write", "--bs=1M",
                    f"--size={SIZE}", f"--filename={backing}"], capture_output=True, check=True)
    kinds = ["dmkit", "nbdkit", "qemu-nbd", "fio-io_uring"]
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in WORKLOADS:
            for k in kinds:
                res[(name, k)] = median_runs(k, backing, tmp, args, runtime, reps)
                print(f"  {backing_dir} {name} {k}: {fmt(res[(name, k)][0])} IOPS", file=sys.stderr)
    os.unlink(backing)
    out.append(f"\n### Backing file on `{backing_dir}`\n")
    out.append("| workload | dmkit IOPS | nbdkit IOPS | qemu-nbd IOPS | fio io_uring IOPS | dmkit/nbdkit | "
               "dmkit/qemu-nbd | dmkit/fio | dmkit CPU µs/IO | nbdkit CPU µs/IO | qemu-nbd CPU µs/IO | "
               "dmkit peak RSS MiB | nbdkit RSS | qemu-nbd RSS |")
    out.append("|" + "---|" * 14)
    for name, _ in WORKLOADS:
        d, n, q, f = (res[(name, k)] for k in kinds)
        r = lambda a, b: "—" if not a or not b else f"{a / b:.2f}"
        out.append(f"| {name} | {fmt(d[0])} | {fmt(n[0])} | {fmt(q[0])} | {fmt(f[0])} | **{r(d[0], n[0])}** | "
                   f"**{r(d[0], q[0])}** | **{r(d[0], f[0])}** | {fmt(d[2], 2)} | {fmt(n[2], 2)} | {fmt(q[2], 2)} | "
                   f"{fmt(d[3], 1)} | {fmt(n[3], 1)} | {fmt(q[3], 1)} |")


def flush_seed(backing_dir, reps, runtime, out):
    """Seed 002: 1024 linear segments over one file vs one segment, randwrite with
    fdatasync after every write, several jobs."""
    backing = os.path.join(backing_dir, "dmkit-flush.img")
    with open(backing, "wb") as f:
        f.truncate(1024 * 16384 * 512)
    seg = "".join(f"{8000 * i} 8000 linear {backing} {16384 * i}\n" for i in range(1024))
    one = f"0 {8000 * 1024} linear {backing} 0\n"
    args = ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--numjobs=4", "--fsync=1"]
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, table in (("1 segment", one), ("1024 segments", seg)):
            global SIZE
            saved, SIZE = SIZE, 8000 * 1024 * 512
            try:
                res[label] = median_runs("dmkit", backing, tmp, args, runtime, reps, table=table)
            finally:
                SIZE = saved
            print(f"  flush seed {label}: {fmt(res[label][0])} IOPS", file=sys.stderr)
    os.unlink(backing)
    a, b = res["1 segment"], res["1024 segments"]
    out.append(f"\n### One flush per underlying device (seed 002), backing on `{backing_dir}`\n")
    out.append("fio nbd engine, randwrite 4 KiB, `--fsync=1` (an NBD FLUSH after every write; fio 3.33's nbd engine refuses `--fdatasync`), 4 jobs, iodepth 1.\n")
    out.append("| table | write IOPS (each followed by a flush) | dmkit CPU µs/IO |")
    out.append("|---|---|---|")
    out.append(f"| 1 linear segment | {fmt(a[0])} | {fmt(a[2], 2)} |")
    out.append(f"| 1024 linear segments, one file | {fmt(b[0])} | {fmt(b[2], 2)} |")
    out.append(f"\n**1024-segment / 1-segment ratio: {b[0] / a[0]:.2f}** (goal ≥ 0.95)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--backing", action="append")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    backings = a.backing or ["/dev/shm", "/var/tmp"]
    cmdline = "bench/run.py " + " ".join(sys.argv[1:])
    out = ["# Benchmarks", "",
           f"Produced by `{cmdline.strip()}` (after `cargo build --release`; `bench/setup.sh` installs "
           "fio, nbdkit and qemu-utils). Every figure is the median of "
           f"{a.reps} runs of {a.runtime} s (after 1 s ramp); all servers run in the same invocation, one "
           "after another, on the same backing file with the same fio job (`--ioengine=nbd` over a unix "
           "socket; fio's own `io_uring` engine with `--direct=1` directly on the file as the machine's "
           "limit). The machine has 2 cores shared by fio and the server, so ratios matter, not absolute "
           "figures.", "",
           "Servers: dmkit `linear` table over the file (O_DIRECT, io_uring); `nbdkit --threads=16 file` "
           "(nbdkit 1.32 has no O_DIRECT mode: page cache is its fastest); `qemu-nbd --cache=none "
           "--aio=io_uring --shared=16` (O_DIRECT). CPU µs/IO is the server's user+system CPU time over "
           "the run divided by the I/Os completed; peak RSS is the server's VmHWM.", "",
           f"Machine: {os.uname().release}, {os.cpu_count()} cores. Date: {time.strftime('%Y-%m-%d')}."]
    for b in backings:
        throughput(b, a.reps, a.runtime, out)
    flush_seed(backings[-1], a.reps, a.runtime, out)
    with open(a.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
