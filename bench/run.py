#!/usr/bin/env python3
"""Side-by-side NBD benchmarks: dmkit vs nbdkit, qemu-nbd and fio's own io_uring
engine on the same backing file, same fio jobs, in one run. Writes BENCHMARKS.md.

Usage: bench/run.py [--reps N] [--runtime S] [--backing DIR ...] [--out FILE]
Needs: fio, nbdkit, qemu-nbd (bench/setup.sh installs them), a release build.
"""
import argparse, json, os, shutil, signal, statistics, subprocess, sys, tempfile, time

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


def fio_cpu(server, uri, args, runtime):
    """fio's nbd engine on `uri` while measuring `server`'s CPU: (IOPS, MiB/s,
    server µs CPU per I/O or None when nothing completed)."""
    c0, t0 = server.cpu(), time.time()
    ios, bw = fio(["--ioengine=nbd", f"--uri={uri}"] + list(args), runtime)
    cpu = server.cpu() - c0
    total = ios * (time.time() - t0 - 1)  # fio ramps for 1 s before counting
    return ios, bw, (cpu / total * 1e6 if total > 0 else None)


class Dmkit:
    """A dmkit daemon (`serve` with `extra` arguments) with devices created from
    (name, table) pairs; run directories numbered under `tmp`."""

    n = 0

    def __init__(self, tmp, devices=(), extra=(), binary=None):
        Dmkit.n += 1
        self.bin = binary or DMKIT
        self.run = os.path.join(tmp, f"run-{Dmkit.n}")
        self.p = subprocess.Popen([self.bin, "serve", "--run-dir", self.run, *extra],
                                  stderr=subprocess.DEVNULL)
        try:
            wait_for(os.path.join(self.run, "control.sock"))
            for name, table in devices:
                self.cli("create", name, input=table)
        except BaseException:
            self.p.kill()  # no daemon left behind by a failed start
            self.p.wait()
            raise

    def cli(self, *args, input=None):
        return subprocess.run([self.bin, "--run-dir", self.run, *args], input=input, text=True,
                              check=True, capture_output=True).stdout

    def uri(self, name):
        return f"nbd+unix:///{name}?socket={self.run}/nbd.sock"

    def cpu(self):
        return proc_cpu(self.p.pid)

    def stop(self):
        self.p.terminate()
        self.p.wait(30)
        shutil.rmtree(self.run, ignore_errors=True)


class Server:
    """A server process exporting the backing file over a unix socket."""

    def __init__(self, kind, backing, tmp, table=None):
        self.kind, self.tmp = kind, tmp
        Server.n = getattr(Server, "n", 0) + 1
        self.sock = os.path.join(tmp, f"{kind}-{Server.n}.sock")
        sectors = SIZE // 512
        if kind in ("dmkit", "dmkit-buffered"):
            run = self.run = os.path.join(tmp, f"run-{Server.n}")
            opts = ["--buffered"] if kind == "dmkit-buffered" else []
            self.p = subprocess.Popen([DMKIT, "serve", "--run-dir", run] + opts, stderr=subprocess.DEVNULL)
            wait_for(os.path.join(run, "control.sock"))
            t = table or f"0 {sectors} linear {backing} 0"
            subprocess.run([DMKIT, "--run-dir", run, "create", "bench"], input=t, text=True, check=True)
            self.uri = f"nbd+unix:///bench?socket={run}/nbd.sock"
        elif kind == "nbdkit":
            self.p = subprocess.Popen(["nbdkit", "-f", "-U", self.sock, "--threads=16", "file", backing],
                                      stderr=subprocess.DEVNULL)
            wait_for(self.sock)
            self.uri = f"nbd+unix:///?socket={self.sock}"
        elif kind == "floor":
            # examples/nbd_floor.rs: the least a server can spend (cargo build --release --examples)
            self.p = subprocess.Popen([os.path.join(os.path.dirname(DMKIT), "examples", "nbd_floor"),
                                       self.sock, backing], stderr=subprocess.DEVNULL)
            wait_for(self.sock)
            self.uri = f"nbd+unix:///?socket={self.sock}"
        elif kind == "nbdkit-null":
            self.p = subprocess.Popen(["nbdkit", "-f", "-U", self.sock, "--threads=16", "null", f"size={SIZE}"],
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
        if self.kind.startswith("dmkit"):
            subprocess.run(["rm", "-rf", self.run])
        return hwm


def measure(kind, backing, tmp, wl_args, runtime, extra_fio=(), table=None):
    """One run: (iops, MiB/s, daemon µs CPU per I/O, peak RSS MiB)."""
    if kind == "fio-io_uring":
        ios, bw = fio(["--ioengine=io_uring", "--direct=1", f"--filename={backing}", f"--size={SIZE}"]
                      + wl_args + list(extra_fio), runtime)
        return ios, bw, None, None
    if kind in ("dmkit-buffered", "nbdkit"):
        # Page-cache servers start with the file cached, whichever ran before them
        # (O_DIRECT writes of the previous server drop cached pages).
        subprocess.run(["dd", f"if={backing}", "of=/dev/null", "bs=1M"], capture_output=True)
    s = Server(kind, backing, tmp, table)
    try:
        return *fio_cpu(s, s.uri, [f"--size={SIZE}"] + wl_args + list(extra_fio), runtime), None
    finally:
        hwm = s.stop()
        measure.last_hwm = hwm / 1024


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def interleaved(cells, reps, runtime, tmp):
    """cells: {key: (kind, backing, fio args, table)}. Runs rep 1 of every cell, then
    rep 2, ... so that noise on the shared machine falls on all of them alike; returns
    {key: (median IOPS, median MiB/s, median CPU µs/IO, median peak RSS MiB)}."""
    runs = {k: [] for k in cells}
    for _ in range(reps):
        for k, (kind, backing, args, table) in cells.items():
            r = measure(kind, backing, tmp, args, runtime, table=table)
            hwm = getattr(measure, "last_hwm", None) if kind not in ("fio-io_uring",) else None
            runs[k].append((r[0], r[1], r[2], hwm))
            print(f"  {k}: {fmt(r[0])} IOPS", file=sys.stderr)
    return {k: tuple(med([r[i] for r in v]) for i in range(4)) for k, v in runs.items()}


def write_section(path, name, lines):
    """Replace (or append) the part of `path` between <!-- NAME --> markers, so each
    benchmark script owns its section of BENCHMARKS.md."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    block = begin + "\n" + "\n".join(lines) + "\n" + end
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(new)


def fmt(v, nd=0):
    return "—" if v is None else f"{v:,.{nd}f}"


def throughput(backing_dir, reps, runtime, out):
    backing = os.path.join(backing_dir, "dmkit-bench.img")
    subprocess.run(["fio", "--name=fill", "--ioengine=io_uring", "--direct=1", "--rw=write", "--bs=1M",
                    f"--size={SIZE}", f"--filename={backing}"], capture_output=True, check=True)
    kinds = ["dmkit", "dmkit-buffered", "nbdkit", "qemu-nbd", "fio-io_uring", "nbdkit-null"]
    with tempfile.TemporaryDirectory() as tmp:
        cells = {(name, k): (k, backing, args, None) for name, args in WORKLOADS for k in kinds}
        res = interleaved(cells, reps, runtime, tmp)
    os.unlink(backing)
    r = lambda a, b: "—" if not a or not b else f"{a / b:.2f}"
    out.append(f"\n### Backing file on `{backing_dir}`\n")
    out.append("IOPS (median), and each server's CPU time per I/O in µs (user+system, all its threads).\n")
    out.append("| workload | dmkit O_DIRECT | qemu-nbd O_DIRECT | fio io_uring O_DIRECT | dmkit buffered | "
               "nbdkit (page cache) | nbdkit null (no I/O: the client's bound) | dmkit/qemu-nbd | dmkit/fio | "
               "dmkit buffered/nbdkit | dmkit/null |")
    out.append("|" + "---|" * 11)
    for name, _ in WORKLOADS:
        d, db, n, q, f, z = (res[(name, k)] for k in kinds)
        out.append(f"| {name} | {fmt(d[0])} | {fmt(q[0])} | {fmt(f[0])} | {fmt(db[0])} | {fmt(n[0])} | {fmt(z[0])} | "
                   f"**{r(d[0], q[0])}** | **{r(d[0], f[0])}** | **{r(db[0], n[0])}** | **{r(max(d[0], db[0]), z[0])}** |")
    out.append("\n| workload | dmkit µs/IO | dmkit buffered µs/IO | qemu-nbd µs/IO | nbdkit µs/IO | "
               "nbdkit/dmkit buffered CPU | qemu-nbd/dmkit CPU | dmkit peak RSS MiB | nbdkit | qemu-nbd |")
    out.append("|" + "---|" * 10)
    for name, _ in WORKLOADS:
        d, db, n, q, f, z = (res[(name, k)] for k in kinds)
        out.append(f"| {name} | {fmt(d[2], 2)} | {fmt(db[2], 2)} | {fmt(q[2], 2)} | {fmt(n[2], 2)} | "
                   f"**{r(n[2], db[2])}** | **{r(q[2], d[2])}** | {fmt(max(d[3] or 0, db[3] or 0), 1)} | "
                   f"{fmt(n[3], 1)} | {fmt(q[3], 1)} |")


def flush_seed(backing_dir, reps, runtime, out):
    """Seed 002: 1024 linear segments over one file vs one segment, randwrite with
    fdatasync after every write, several jobs."""
    backing = os.path.join(backing_dir, "dmkit-flush.img")
    with open(backing, "wb") as f:
        f.truncate(1024 * 8000 * 512)
    # Segments contiguous in the file, so both tables put data at the same file offsets
    # and only the number of targets differs.
    seg = "".join(f"{8000 * i} 8000 linear {backing} {8000 * i}\n" for i in range(1024))
    one = f"0 {8000 * 1024} linear {backing} 0\n"
    args = ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--numjobs=4", "--fsync=1"]
    global SIZE
    saved, SIZE = SIZE, 8000 * 1024 * 512
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cells = {label: ("dmkit", backing, args, table) for label, table in (("1 segment", one), ("1024 segments", seg))}
            res = interleaved(cells, reps, runtime, tmp)
    finally:
        SIZE = saved
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
    global DMKIT
    # Run a private copy of the binary, so a rebuild during the run cannot mix binaries.
    snap = os.path.join(tempfile.mkdtemp(prefix="dmkit-bench-"), "dmkit")
    subprocess.run(["cp", DMKIT, snap], check=True)
    DMKIT = snap
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--backing", action="append")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    backings = a.backing or ["/dev/shm", "/var/tmp"]
    cmdline = "bench/run.py " + " ".join(sys.argv[1:])
    out = ["## NBD export: dmkit vs nbdkit, qemu-nbd and fio", "",
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
    write_section(a.out, "nbd", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
