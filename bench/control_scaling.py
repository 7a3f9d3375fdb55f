#!/usr/bin/env python3
"""The control path's cost as devices accumulate: with N zero devices present
(N = 10, 100, 1,000, 10,000), the time of each verb on one more device, measured
at the daemon's control socket (no client process start: this script speaks the
socket's protocol), and the daemon's CPU per verb (utime+stime of all its threads).
LVM and dmeventd issue many control operations against daemons holding many
devices; the cost must not grow with their number.

With `--before OLD_DMKIT`, the same with an older binary, in the same sitting, up
to the counts of `--before-counts` (an old binary whose cost grows with the
devices may take hours to reach 10,000).

Usage: bench/control_scaling.py [--counts 10,100,1000,10000] [--reps 200]
                                [--before OLD --before-counts 10,100,1000]
Writes section `control-scaling` of BENCHMARKS.md.
"""
import argparse, os, socket, statistics, struct, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def put(b):
    return struct.pack(">I", len(b)) + b


def call(sock, args, stdin=b""):
    """One control request (the framing of control::call); (ok, out, err)."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.sendall(struct.pack(">I", len(args)) + b"".join(put(a.encode()) for a in args) + put(stdin))
    data = b""
    while True:
        c = s.recv(1 << 16)
        if not c:
            break
        data += c
    s.close()
    ok = data[0] == 0
    n = struct.unpack(">I", data[1:5])[0]
    out = data[5:5 + n]
    m = struct.unpack(">I", data[5 + n:9 + n])[0]
    err = data[9 + n:9 + n + m]
    return ok, out.decode(errors="replace"), err.decode(errors="replace")


def must(sock, args):
    ok, out, err = call(sock, args)
    if not ok:
        raise SystemExit(f"{args}: {err}")
    return out


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        w = f.read().rsplit(")", 1)[1].split()
    return int(w[11]) + int(w[12])  # utime, stime of the whole process


# verb name -> the requests of one trial i (run in order; the first is the one timed
# when a verb needs set-up, the rest undo it)
VERBS = {
    "create": lambda i: [["create", f"p{i}", "--table", "0 8 zero"]],
    "remove": lambda i: [["remove", f"p{i}"]],
    "table": lambda i: [["table", "z0"]],
    "status": lambda i: [["status", "z0"]],
    "info": lambda i: [["info", "z0"]],
    "load+resume": lambda i: [["load", "z0", "--table", f"0 {8 + i % 2 * 8} zero"], ["resume", "z0"]],
    "suspend+resume": lambda i: [["suspend", "z0"], ["resume", "z0"]],
    "rename+back": lambda i: [["rename", "z0", "zr"], ["rename", "zr", "z0"]],
}


def measure(binary, counts, reps, tmp, tag):
    """{(count, verb): (median ms wall, daemon CPU ms per trial)}"""
    rund = os.path.join(tmp, f"run-{tag}")
    p = subprocess.Popen([binary, "serve", "--run-dir", rund], stderr=subprocess.DEVNULL)
    sock = os.path.join(rund, "control.sock")
    run.wait_for(sock)
    res = {}
    have = 0
    try:
        for n in counts:
            while have < n:
                must(sock, ["create", f"z{have}", "--table", "0 8 zero"])
                have += 1
            for verb, reqs in VERBS.items():
                if verb == "remove":
                    continue
                times = []
                c0 = cpu_ticks(p.pid)
                for i in range(reps):
                    t0 = time.perf_counter()
                    for r in reqs(i):
                        must(sock, r)
                    times.append(time.perf_counter() - t0)
                    if verb == "create":
                        # the remove is a verb of its own
                        t1 = time.perf_counter()
                        must(sock, ["remove", f"p{i}"])
                        res.setdefault((n, "remove"), []).append(time.perf_counter() - t1)
                cpu = (cpu_ticks(p.pid) - c0) / TICK / reps * 1000
                if verb == "create":
                    cpu /= 2  # create and remove shared these ticks
                    rm = res.pop((n, "remove"))
                    res[(n, "remove")] = (statistics.median(rm) * 1000, cpu)
                res[(n, verb)] = (statistics.median(times) * 1000, cpu)
                print(f"{tag} {n} devices: {verb}: {res[(n, verb)][0]:.3f} ms, daemon CPU "
                      f"{res[(n, verb)][1]:.3f} ms", file=sys.stderr)
    finally:
        p.terminate()
        p.wait(60)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="10,100,1000,10000")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--before")
    ap.add_argument("--before-counts", default="10,100,1000")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    counts = [int(x) for x in a.counts.split(",")]
    bcounts = [int(x) for x in a.before_counts.split(",")]
    d = tempfile.mkdtemp(prefix="dmkit-bench-")
    after = os.path.join(d, "dmkit")
    subprocess.run(["cp", run.DMKIT, after], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = measure(after, counts, a.reps, tmp, "after")
        old = {}
        if a.before:
            before = os.path.join(d, "dmkit-before")
            subprocess.run(["cp", a.before, before], check=True)
            old = measure(before, bcounts, a.reps, tmp, "before")
    verbs = ["create", "remove", "table", "status", "info", "load+resume", "suspend+resume", "rename+back"]
    cmd = "bench/control_scaling.py " + " ".join(sys.argv[1:])
    out = ["## Control path as devices accumulate (bench/control_scaling.py)", "",
           f"`{cmd.strip()}` (after `cargo build --release`): with N zero devices present, "
           f"the median of {a.reps} trials of each verb on one device, at the daemon's control "
           "socket (no client process start), then the daemon's CPU per trial (all threads, "
           "user+system). The daemon records its devices (`devices.state`) after every change, "
           "as it always does. `x N/first` is the cost at the largest N over the cost at the smallest.", ""]
    hdr = "| verb | " + " | ".join(f"{n:,} devices ms (CPU ms)" for n in counts) + f" | x {counts[-1]:,}/{counts[0]} |"
    out += [hdr, "|" + "---|" * (len(counts) + 2)]
    for v in verbs:
        cells = [f"{res[(n, v)][0]:.3f} ({res[(n, v)][1]:.3f})" for n in counts]
        out.append(f"| {v} | " + " | ".join(cells) + f" | **{res[(counts[-1], v)][0] / res[(counts[0], v)][0]:.2f}** |")
    if old:
        out += ["", f"The binary before (`--before`), same sitting:", "",
                "| verb | " + " | ".join(f"{n:,} devices ms (CPU ms)" for n in bcounts)
                + f" | x {bcounts[-1]:,}/{bcounts[0]} |", "|" + "---|" * (len(bcounts) + 2)]
        for v in verbs:
            cells = [f"{old[(n, v)][0]:.3f} ({old[(n, v)][1]:.3f})" for n in bcounts]
            out.append(f"| {v} | " + " | ".join(cells)
                       + f" | **{old[(bcounts[-1], v)][0] / old[(bcounts[0], v)][0]:.2f}** |")
    run.write_section(a.out, "control-scaling", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
