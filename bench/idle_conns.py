#!/usr/bin/env python3
"""Many idle NBD connections beside a few busy ones, on one daemon over TCP.

Four busy clients (fio's nbd engine, --numjobs=4, one connection each, 4 KiB
random reads at QD1 over a 1 GiB file through the page cache) are measured with
no other connection, then with N idle connections (each past its handshake,
NBD_OPT_GO, then silent), alternating, --reps times. Records the daemon's
threads and resident memory idle, with the idle connections, and after they
closed; the busy clients' IOPS and p99 completion latency in both cases (medians
over the reps). With --before OLD_DMKIT the same is run with that binary too,
in the same sitting. Writes section `idle-connections` of BENCHMARKS.md.

Usage: bench/idle_conns.py [--idle 10000] [--reps 3] [--runtime 5] [--before OLD_DMKIT]
"""
import argparse, json, os, resource, socket, struct, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


def status(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def attach(addr, export=b"bench"):
    s = socket.create_connection(addr)
    g = b""
    while len(g) < 18:
        g += s.recv(18 - len(g))
    s.sendall(struct.pack(">I", 3))
    opt = struct.pack(">I", len(export)) + export + struct.pack(">H", 0)
    s.sendall(b"IHAVEOPT" + struct.pack(">II", 7, len(opt)) + opt)
    while True:
        h = b""
        while len(h) < 20:
            h += s.recv(20 - len(h))
        _, _, typ, ln = struct.unpack(">QIII", h)
        d = b""
        while len(d) < ln:
            d += s.recv(ln - len(d))
        if typ & 0x80000000:
            raise RuntimeError(f"GO refused: {typ:#x}")
        if typ == 1:
            return s


def busy(port, runtime):
    """fio, 4 jobs of 4 KiB random reads at QD1: (IOPS, p99 µs)."""
    cmd = ["fio", "--name=b", "--output-format=json", f"--runtime={runtime}", "--time_based",
           "--ramp_time=1", "--group_reporting", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}/bench",
           "--rw=randread", "--bs=4k", "--iodepth=1", "--numjobs=4", f"--size={run.SIZE}"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    j = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    return j["iops"], j["clat_ns"]["percentile"]["99.000000"] / 1000


def one(binary, tmp, backing, idle, runtime):
    rd = tempfile.mkdtemp(dir=tmp)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([binary, "serve", "--run-dir", rd, "--buffered", "--nbd-listen", f"127.0.0.1:{port}"],
                         stderr=subprocess.DEVNULL)
    try:
        run.wait_for(os.path.join(rd, "control.sock"))
        subprocess.run([binary, "--run-dir", rd, "create", "bench", "--table",
                        f"0 {run.SIZE // 512} linear {backing} 0"], check=True)
        time.sleep(0.5)
        r = {"threads_idle": status(p.pid, "Threads"), "rss_idle": status(p.pid, "VmRSS")}
        r["iops_alone"], r["p99_alone"] = busy(port, runtime)
        t0 = time.time()
        conns = [attach(("127.0.0.1", port)) for _ in range(idle)]
        r["attach_s"] = time.time() - t0
        time.sleep(1)
        r["threads_with"], r["rss_with"] = status(p.pid, "Threads"), status(p.pid, "VmRSS")
        r["iops_with"], r["p99_with"] = busy(port, runtime)
        for c in conns:
            c.close()
        time.sleep(2)
        r["threads_after"], r["rss_after"] = status(p.pid, "Threads"), status(p.pid, "VmRSS")
        return r
    finally:
        p.terminate()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=10000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=5)
    ap.add_argument("--before")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < a.idle + 1000:
        sys.exit(f"{a.idle} connections need more open files than the hard limit ({hard})")
    bins = [("this build" if not a.before else "after", run.DMKIT)] + ([("before", a.before)] if a.before else [])
    tmp = tempfile.mkdtemp(dir=a.dir)
    backing = os.path.join(tmp, "backing")
    with open(backing, "wb") as f:
        f.truncate(run.SIZE)
    subprocess.run(["dd", "if=/dev/urandom", f"of={backing}", "bs=1M", f"count={run.SIZE >> 20}",
                    "conv=notrunc"], capture_output=True, check=True)
    runs = {k: [] for k, _ in bins}
    for rep in range(a.reps):
        for k, b in bins:
            r = one(b, tmp, backing, a.idle, a.runtime)
            print(f"rep {rep} {k}: {r}", file=sys.stderr)
            runs[k].append(r)
    subprocess.run(["rm", "-rf", tmp])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=run.ROOT).stdout.strip()
    lines = [f"## Idle connections (`python3 bench/idle_conns.py --idle {a.idle} --reps {a.reps} "
             f"--runtime {a.runtime}{' --before OLD' if a.before else ''}`, {head}, {time.strftime('%Y-%m-%d')})",
             "",
             f"{a.idle} NBD connections over TCP on loopback, each past NBD_OPT_GO and then silent, beside four "
             "busy clients (fio nbd engine, 4 jobs x 4 KiB random reads at QD1, 1 GiB file through the page "
             "cache). Medians of the reps; RSS in MiB, latency in µs.",
             "",
             "| binary | threads idle / with / after | RSS idle / with / after | busy IOPS alone / with | "
             "busy p99 alone / with | with/alone p99 |",
             "|---|---|---|---|---|---|"]
    for k, _ in bins:
        m = {f: run.med([r[f] for r in runs[k]]) for f in runs[k][0]}
        lines.append(
            f"| {k} | {m['threads_idle']:.0f} / {m['threads_with']:.0f} / {m['threads_after']:.0f} | "
            f"{m['rss_idle'] / 1024:.0f} / {m['rss_with'] / 1024:.0f} / {m['rss_after'] / 1024:.0f} | "
            f"{m['iops_alone']:,.0f} / {m['iops_with']:,.0f} | {m['p99_alone']:.0f} / {m['p99_with']:.0f} | "
            f"{m['p99_with'] / m['p99_alone']:.2f} |")
    run.write_section(a.out, "idle-connections", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
