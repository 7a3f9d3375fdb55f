#!/usr/bin/env python3
"""dm-verity's cost through dmkit (issue 33): the same file served by `linear`
and by `verity` (sha256, 4 KiB data and hash blocks, a tree from
`veritysetup format`), in one `dmkit serve`, read with fio's nbd engine at QD16:
a sequential 1 MiB read of the whole device right after the verity device is
created (its hash cache cold; the files in the page cache for both, so the
difference is the hashing and the tree), then 4 KiB random reads once warm
(every hash block verified and cached: one hash per read). Each rep creates
both devices afresh and runs linear and verity in turn (the order alternating
by rep); medians of the reps, the spread (max - min) / median, the server's
CPU per request (all its threads). Writes BENCHMARKS.md, section `verity`.

Usage: bench/verity.py [--mib 1024] [--reps 3] [--runtime 10] [--dir /dev/shm]
Needs: fio, veritysetup, a release build.
"""
import argparse, json, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402


def fio_once(d, dev, args):
    """One fio run of `args` on `dev`: (IOPS, MiB/s, server µs CPU per request)."""
    c0 = d.cpu()
    p = subprocess.run(["fio", "--name=v", "--ioengine=nbd", f"--uri={d.uri(dev)}", "--iodepth=16",
                        "--numjobs=1", "--output-format=json"] + args, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"fio on {dev} failed: {p.stderr[-2000:]}")
    cpu = d.cpu() - c0
    j = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    return j["iops"], j["bw_bytes"] / (1 << 20), cpu / j["total_ios"] * 1e6 if j["total_ios"] else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=10)
    ap.add_argument("--dir", default="/dev/shm")
    a = ap.parse_args()
    commit = subprocess.run(["git", "-C", run.ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load0 = os.getloadavg()[0]
    tmp = tempfile.mkdtemp(prefix="dmkit-verity-", dir=a.dir)
    data, hashf = os.path.join(tmp, "data.img"), os.path.join(tmp, "hash.img")
    size = a.mib << 20
    with open(data, "wb") as f:
        for _ in range(a.mib):
            f.write(os.urandom(1 << 20))
    with open(hashf, "wb") as f:
        f.truncate(size)
    out = subprocess.run(["veritysetup", "format", "--data-block-size", "4096", "--hash-block-size", "4096",
                          "--salt", "00ff", data, hashf], capture_output=True, text=True, check=True).stdout
    root = next(ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Root hash:"))
    sect, blocks = a.mib * 2048, a.mib * 256
    tables = {"lin": f"0 {sect} linear {data} 0",
              "ver": f"0 {sect} verity 1 {data} {hashf} 4096 4096 {blocks} 1 sha256 {root} 00ff"}
    d = run.Dmkit(tmp)
    seq = ["--rw=read", "--bs=1M", f"--size={size}"]
    rand = ["--rw=randread", "--bs=4k", f"--size={size}", "--time_based", f"--runtime={a.runtime}",
            "--ramp_time=1"]
    res = {}
    try:
        for rep in range(a.reps):
            for dev in ("lin", "ver"):
                d.cli("create", "--readonly", dev, "--table", tables[dev])
            order = ("lin", "ver") if rep % 2 == 0 else ("ver", "lin")
            for wl, args in (("seq", seq), ("rand", rand)):
                for dev in order:
                    r = fio_once(d, dev, args)
                    res.setdefault((wl, dev), []).append(r)
                    print(f"rep {rep + 1} {wl} {dev}: {r[0]:,.0f} IOPS {r[1]:,.0f} MiB/s {r[2]:.2f} us/req",
                          file=sys.stderr)
            status = d.cli("status", "ver").strip()
            if not status.endswith("V"):
                raise RuntimeError(f"verity's status after the reads: {status}")
            d.cli("remove", "lin", "ver")
    finally:
        d.stop()
        subprocess.run(["rm", "-rf", tmp])

    def m(wl, dev, i):
        return run.med([r[i] for r in res[(wl, dev)]])

    def spread(wl, dev, i):
        v = [r[i] for r in res[(wl, dev)]]
        return (max(v) - min(v)) / run.med(v)

    lines = ["## dm-verity vs linear over the same file (issue 33, bench/verity.sh)", "",
             f"`bench/verity.sh --mib {a.mib} --reps {a.reps} --runtime {a.runtime} --dir {a.dir}` "
             f"(bench/verity.py; a release build), {time.strftime('%Y-%m-%d', time.gmtime())} on {commit}, "
             f"load average {load0:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (2 cores, "
             "shared with fio and other work). A file of random bytes, its sha256 tree from `veritysetup "
             "format` (4 KiB data and hash blocks), both in the page cache, served read-only by `linear` and "
             "by `verity` in one `dmkit serve`; fio's nbd engine at QD16. Each rep creates both devices "
             "afresh: the sequential read is verity's first pass (every hash block read from the hash file "
             "and checked up to the root); the random reads follow it, every hash block cached, so each "
             f"costs one sha256 of its 4 KiB block. Medians of {a.reps} reps, linear and verity in turn (the "
             "order alternating by rep); spread = (max − min) / median; µs/req is the server's CPU per "
             "request (all its threads).", "",
             "| read | linear | verity | verity/linear | spread linear / verity | µs/req linear | µs/req verity |",
             "|---|---|---|---|---|---|---|"]
    for wl, name, i, unit in (("seq", "sequential 1 MiB, verity cold", 1, "MiB/s"),
                              ("rand", "random 4 KiB, verity warm", 0, "IOPS")):
        lv, vv = m(wl, "lin", i), m(wl, "ver", i)
        lines.append(f"| {name} | {lv:,.0f} {unit} | {vv:,.0f} {unit} | **{vv / lv:.2f}** | "
                     f"±{spread(wl, 'lin', i):.2f} / ±{spread(wl, 'ver', i):.2f} | {m(wl, 'lin', 2):.2f} | "
                     f"{m(wl, 'ver', 2):.2f} |")
    run.write_section(os.path.join(run.ROOT, "BENCHMARKS.md"), "verity", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
