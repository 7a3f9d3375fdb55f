#!/usr/bin/env python3
"""Connection scaling, side by side: dmkit (linear, and a provisioned thin),
`nbdkit file`, `qemu-nbd`, `nbdkit null` (the client's own bound) and
`examples/nbd_floor` (the least a server can spend), 1..16 NBD
connections (fio --numjobs, one connection each) x randread/randwrite/randrw x
4 KiB/64 KiB at QD32 per connection. Every server works through the page cache
(like with like: dmkit --buffered, nbdkit file, qemu-nbd --cache=writeback). Records
IOPS and the server's CPU per request (utime+stime of all its threads over the
run / requests) in BENCHMARKS.md, section `scaling`.

Usage: bench/scaling.py [--conns 1,2,4,8,16] [--rw randread,randwrite,randrw]
                        [--bs 4k,64k] [--reps 3] [--runtime 3] [--dir /dev/shm]
       bench/scaling.py --before OLD_DMKIT [...]: dmkit's two servers only (linear and
                        thin), run with OLD_DMKIT and with this tree's build in turn, cell
                        by cell, in one sitting; writes section `scaling-before-after`
                        with both binaries' medians, the after/before ratios and the
                        run-to-run noise (the spread of the reps of one binary), and
                        draws the curves (bench/results/scaling-before-after.svg;
                        needs matplotlib); --name NAME writes section NAME and
                        bench/results/NAME.* instead.
       bench/scaling.py --plot bench/results/scaling-before-after.json: redraw them.
"""
import argparse, json, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (the shared helpers of bench/run.py)

SIZE = run.SIZE


class Thin:
    """dmkit serving a thin device whose every block is provisioned, over a pool
    on `data` (buffered, as the other servers here)."""

    def __init__(self, tmp, data, meta):
        self.kind = "dmkit-thin"
        Thin.n = getattr(Thin, "n", 0) + 1
        self.run = os.path.join(tmp, f"thin-run-{Thin.n}")
        self.p = subprocess.Popen([run.DMKIT, "serve", "--run-dir", self.run, "--buffered"],
                                  stderr=subprocess.DEVNULL)
        run.wait_for(os.path.join(self.run, "control.sock"))
        fresh = not os.path.exists(meta)
        if fresh:
            with open(meta, "wb") as f:
                f.truncate(64 << 20)
        cli = [run.DMKIT, "--run-dir", self.run]
        pool = f"0 {SIZE // 512} thin-pool {meta} {data} 128 0"
        subprocess.run(cli + ["create", "pool", "--table", pool], check=True)
        if fresh:
            subprocess.run(cli + ["message", "pool", "0", "create_thin", "0"], check=True)
        subprocess.run(cli + ["create", "bench", "--table", f"0 {SIZE // 512} thin /dev/mapper/pool 0"],
                       check=True)
        self.uri = f"nbd+unix:///bench?socket={self.run}/nbd.sock"
        if fresh:
            # provision every block once
            subprocess.run(["fio", "--name=fill", "--ioengine=nbd", f"--uri={self.uri}", "--rw=write",
                            "--bs=1M", "--iodepth=8", f"--size={SIZE}"], capture_output=True, check=True)

    def cpu(self):
        return run.proc_cpu(self.p.pid)

    def stop(self):
        hwm = run.proc_hwm_kib(self.p.pid)
        self.p.terminate()
        self.p.wait(30)
        subprocess.run(["rm", "-rf", self.run])
        return hwm


class QemuCached(run.Server):
    def __init__(self, backing, tmp):
        self.kind, self.tmp = "qemu-nbd-cache", tmp
        run.Server.n = getattr(run.Server, "n", 0) + 1
        self.sock = os.path.join(tmp, f"qemu-{run.Server.n}.sock")
        self.p = subprocess.Popen(["qemu-nbd", "-f", "raw", "--cache=writeback", "--aio=threads",
                                   "--persistent", "--shared=16", "-k", self.sock, backing],
                                  stderr=subprocess.DEVNULL)
        run.wait_for(self.sock)
        self.uri = f"nbd+unix:///?socket={self.sock}"
        time.sleep(0.2)


def prepare(tmp):
    """The linear server's file and the thin pool's data file, written whole, in
    `tmp`: (linear file, (thin data, thin metadata))."""
    backing = os.path.join(tmp, "linear.img")
    thin_data = os.path.join(tmp, "thin-data.img")
    for f in (backing, thin_data):
        subprocess.run(["fio", "--name=fill", "--ioengine=psync", "--rw=write", "--bs=1M",
                        f"--size={SIZE}", f"--filename={f}"], capture_output=True, check=True)
    return backing, (thin_data, os.path.join(tmp, "thin-meta.img"))


def one(kind, backing, tmp, thin_files, conns, fio_args, runtime, binary=None):
    if binary:
        run.DMKIT = binary
    if kind == "dmkit-thin":
        s = Thin(tmp, *thin_files)
    elif kind == "qemu-nbd-cache":
        s = QemuCached(backing, tmp)
    else:
        s = run.Server(kind, backing, tmp)
    try:
        ios, _, cpu = run.fio_cpu(s, s.uri, [f"--size={SIZE}", f"--numjobs={conns}"] + fio_args, runtime)
        return ios, cpu
    finally:
        s.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--conns", default="1,2,4,8,16")
    ap.add_argument("--rw", default="randread,randwrite,randrw")
    ap.add_argument("--bs", default="4k,64k")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    ap.add_argument("--before", help="an older dmkit binary to compare this build with")
    ap.add_argument("--plot", help="only draw the picture of an earlier --before run's JSON")
    ap.add_argument("--name", default="scaling-before-after",
                    help="with --before: the BENCHMARKS.md section and bench/results files it writes")
    a = ap.parse_args()
    if a.plot:
        return print(plot(a.plot))
    if a.before:
        return before_after(a)
    kinds = ["dmkit-buffered", "dmkit-thin", "nbdkit", "qemu-nbd-cache", "nbdkit-null", "floor"]
    conns = [int(x) for x in a.conns.split(",")]
    rws, bss = a.rw.split(","), a.bs.split(",")
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        backing, thin_files = prepare(tmp)
        res = {}
        for rep in range(a.reps):
            for rw in rws:
                for bs in bss:
                    for n in conns:
                        args = [f"--rw={rw}", f"--bs={bs}", "--iodepth=32"]
                        for k in kinds:
                            r = one(k, backing, tmp, thin_files, n, args, a.runtime)
                            res.setdefault((rw, bs, n, k), []).append(r)
                            print(f"rep {rep} {rw} {bs} x{n} {k}: {run.fmt(r[0])} IOPS "
                                  f"{run.fmt(r[1], 2)} µs/req", file=sys.stderr)
    med = {key: (run.med([r[0] for r in v]), run.med([r[1] for r in v])) for key, v in res.items()}
    ratio = lambda x, y: "—" if not x or not y else f"{x / y:.2f}"
    out = [
        "## Connection scaling (bench/scaling.py)",
        "",
        f"`bench/scaling.py --conns {a.conns} --rw {a.rw} --bs {a.bs} --reps {a.reps} --runtime {a.runtime} "
        f"--dir {a.dir}`: fio's nbd engine, QD32 per connection, 1 GiB file on `{a.dir}`, every "
        "server through the page cache. Medians of the reps; IOPS, then the server's CPU per request "
        "in µs (all threads, user+system). The machine's cores are shared by fio and the server. "
        "`floor` is `examples/nbd_floor.rs`: a server that only receives, does a plain pread/pwrite "
        "per request and sends all replies of a turn with one sendmsg (no validation, no mapping), "
        "so its CPU per request is what the kernel's part of the work costs on this machine.",
        "",
        "| rw | bs | conns | dmkit linear | dmkit thin | nbdkit file | qemu-nbd | nbdkit null | floor | "
        "linear/best anchor | thin/linear | µs/req dmkit linear | thin | nbdkit file | qemu-nbd | floor | "
        "nbdkit file/dmkit CPU | dmkit/floor CPU |",
        "|" + "---|" * 18,
    ]
    for rw in rws:
        for bs in bss:
            for n in conns:
                v = {k: med[(rw, bs, n, k)] for k in kinds}
                lin, thin, nk, qm, null, floor = (v[k] for k in kinds)
                best = max(nk[0] or 0, qm[0] or 0)
                out.append(
                    f"| {rw} | {bs} | {n} | {run.fmt(lin[0])} | {run.fmt(thin[0])} | {run.fmt(nk[0])} | "
                    f"{run.fmt(qm[0])} | {run.fmt(null[0])} | {run.fmt(floor[0])} | **{ratio(lin[0], best)}** | "
                    f"**{ratio(thin[0], lin[0])}** | {run.fmt(lin[1], 2)} | {run.fmt(thin[1], 2)} | "
                    f"{run.fmt(nk[1], 2)} | {run.fmt(qm[1], 2)} | {run.fmt(floor[1], 2)} | "
                    f"**{ratio(nk[1], lin[1])}** | **{ratio(lin[1], floor[1])}** |")
    run.write_section(a.out, "scaling", out)
    print("\n".join(out))


def spread(xs):
    """Run-to-run noise of one binary in one cell: (max - min) / median of its reps."""
    m = run.med(xs)
    return (max(xs) - min(xs)) / m if m else 0.0


def before_after(a):
    # private copies, so a rebuild during the run cannot mix binaries
    d = tempfile.mkdtemp(prefix="dmkit-bench-")
    bins = {"before": os.path.join(d, "dmkit-before"), "after": os.path.join(d, "dmkit-after")}
    subprocess.run(["cp", a.before, bins["before"]], check=True)
    subprocess.run(["cp", run.DMKIT, bins["after"]], check=True)
    kinds = ["dmkit-buffered", "dmkit-thin"]
    conns = [int(x) for x in a.conns.split(",")]
    rws, bss = a.rw.split(","), a.bs.split(",")
    res = {}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        backing, thin_files = prepare(tmp)
        for rep in range(a.reps):
            for rw in rws:
                for bs in bss:
                    for n in conns:
                        args = [f"--rw={rw}", f"--bs={bs}", "--iodepth=32"]
                        for k in kinds:
                            # alternate which binary goes first, so neither always runs warm
                            order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
                            for b in order:
                                r = one(k, backing, tmp, thin_files, n, args, a.runtime, bins[b])
                                res.setdefault((rw, bs, n, k, b), []).append(r)
                                print(f"rep {rep} {rw} {bs} x{n} {k} {b}: {run.fmt(r[0])} IOPS "
                                      f"{run.fmt(r[1], 2)} µs/req", file=sys.stderr)
    out = [
        "## Before and after a change (bench/scaling.py --before)",
        "",
        f"`bench/scaling.py --before OLD{'' if a.name == 'scaling-before-after' else ' --name ' + a.name} --conns {a.conns} --rw {a.rw} --bs {a.bs} --reps {a.reps} "
        f"--runtime {a.runtime} --dir {a.dir}`: dmkit's linear (`--buffered`) and provisioned-thin "
        "servers, each cell run with the old binary and this build in turn (the order alternating "
        "by rep), fio's nbd engine at QD32 per connection. Medians of the reps; µs/req is the "
        "server's CPU per request. Noise is the larger of the two binaries' spreads in that cell, "
        "(max − min) / median over the reps: an after/before ratio inside 1 ± noise is no change.",
        "",
        "| rw | bs | conns | server | IOPS before | IOPS after | after/before | IOPS noise | "
        "µs/req before | µs/req after | after/before | CPU noise |",
        "|" + "---|" * 12,
    ]
    for rw in rws:
        for bs in bss:
            for n in conns:
                for k in kinds:
                    b, f = res[(rw, bs, n, k, "before")], res[(rw, bs, n, k, "after")]
                    ib, ia = run.med([r[0] for r in b]), run.med([r[0] for r in f])
                    cb, ca = run.med([r[1] for r in b]), run.med([r[1] for r in f])
                    ni = max(spread([r[0] for r in b]), spread([r[0] for r in f]))
                    nc = max(spread([r[1] for r in b]), spread([r[1] for r in f]))
                    out.append(
                        f"| {rw} | {bs} | {n} | {k.replace('dmkit-buffered', 'linear').replace('dmkit-', '')} | "
                        f"{run.fmt(ib)} | {run.fmt(ia)} | **{ia / ib:.2f}** | ±{ni:.2f} | "
                        f"{run.fmt(cb, 2)} | {run.fmt(ca, 2)} | **{ca / cb:.2f}** | ±{nc:.2f} |")
    med = {"|".join(map(str, k)): [run.med([r[0] for r in v]), run.med([r[1] for r in v])] for k, v in res.items()}
    data = os.path.join(run.ROOT, "bench", "results", f"{a.name}.json")
    os.makedirs(os.path.dirname(data), exist_ok=True)
    with open(data, "w") as f:
        json.dump({"conns": conns, "rw": rws, "bs": bss, "kinds": kinds, "median": med}, f, indent=1)
    try:
        svg = plot(data)
        out += ["", f"![IOPS and CPU per request against connections, before and after]({os.path.relpath(svg, run.ROOT)})",
                "", f"(the picture: `python3 bench/scaling.py --plot {os.path.relpath(data, run.ROOT)}`)"]
    except SystemExit as e:  # no matplotlib: the table without its picture
        print(e, file=sys.stderr)
    run.write_section(a.out, a.name, out)
    print("\n".join(out))


def plot(data):
    """Draw the before/after curves of a `--before` run's results (JSON) as an SVG
    beside them: IOPS and server CPU per request against connections, one panel
    pair per (rw, bs), linear and thin, before dashed and after solid."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("the picture needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(data) as f:
        d = json.load(f)
    cells = [(rw, bs) for rw in d["rw"] for bs in d["bs"]]
    fig, axes = plt.subplots(2, len(cells), figsize=(4 * len(cells), 6.5), squeeze=False)
    for j, (rw, bs) in enumerate(cells):
        for k in d["kinds"]:
            name = k.replace("dmkit-buffered", "linear").replace("dmkit-", "")
            for b, style in (("before", "--"), ("after", "-")):
                ys = [d["median"].get(f"{rw}|{bs}|{n}|{k}|{b}", [None, None]) for n in d["conns"]]
                axes[0][j].plot(d["conns"], [y[0] for y in ys], style, marker="o", label=f"{name} {b}")
                axes[1][j].plot(d["conns"], [y[1] for y in ys], style, marker="o", label=f"{name} {b}")
        axes[0][j].set_title(f"{rw} {bs}, QD32 per connection")
        axes[0][j].set_ylabel("IOPS")
        axes[1][j].set_ylabel("server CPU µs per request")
        for i in (0, 1):
            axes[i][j].set_xscale("log", base=2)
            axes[i][j].set_xticks(d["conns"], [str(n) for n in d["conns"]])
            axes[i][j].set_xlabel("connections")
            axes[i][j].set_ylim(bottom=0)
            axes[i][j].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    svg = os.path.splitext(data)[0] + ".svg"
    fig.savefig(svg)
    return svg


if __name__ == "__main__":
    main()
