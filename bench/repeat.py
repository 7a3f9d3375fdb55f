#!/usr/bin/env python3
"""Repeatability (issue 52): the same fio job against the same dmkit device, run
after run in one daemon, with what each run's placement and machine were: the
connections each reactor served and how many of them had their client on the
reactor's CPU (`dmkit stats --server` during the run: `per_reactor`, `local`),
the CPU each reactor thread used, and the machine's steal time (a virtual
machine's cores taken by its host). Writes BENCHMARKS.md, section `repeat`.

The job is the one whose results were seen to jump between two levels: 4 jobs,
QD1, 4 KiB random writes each followed by a flush (fio's nbd engine, one
connection a job), on a linear device over a file on --dir, prefilled so no run
pays for the file's first writes.

Usage: bench/repeat.py [--runs 10] [--runtime 3] [--dir /dev/shm] [--before OLD_DMKIT]
  --before: the same runs with an older binary too, one daemon each, the two
            taking turns run by run; both series in the section.
Needs: fio, a release build.
"""
import argparse, glob, os, statistics, subprocess, sys, tempfile, threading, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

SIZE = 1 << 30


def steal_ticks():
    with open("/proc/stat") as f:
        return int(f.readline().split()[8])


def reactor_ticks(pid):
    out = {}
    for t in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(t + "/comm") as f:
                name = f.read().strip()
            if name.startswith("nbd-reactor"):
                with open(t + "/stat") as f:
                    x = f.read().rsplit(")", 1)[1].split()
                out[name] = int(x[11]) + int(x[12])
        except FileNotFoundError:
            pass
    return out


def one_run(d, runtime):
    """One run of the job on daemon `d`: (IOPS, µs/req, per_reactor, local, reactor ticks, steal)."""
    stats = {}

    def sample():
        time.sleep(1.5)  # fio's ramp: every job connected
        line = d.cli("stats", "--server")
        stats.update(kv.split("=", 1) for kv in line.split() if "=" in kv)

    s = threading.Thread(target=sample)
    r0, st0, t0 = reactor_ticks(d.p.pid), steal_ticks(), time.time()
    s.start()
    iops, _, cpu = run.fio_cpu(d, d.uri("lin"), ["--rw=randwrite", "--bs=4k", "--iodepth=1", "--numjobs=4",
                                                 "--fsync=1", f"--size={SIZE}"], runtime)
    s.join()
    r1, st1, wall = reactor_ticks(d.p.pid), steal_ticks(), time.time() - t0
    split = [r1[k] - r0.get(k, 0) for k in sorted(r1)]
    steal = (st1 - st0) / run.TICK / wall / os.cpu_count()
    # a binary from before `local` was counted shows none
    return iops, cpu, stats.get("per_reactor", "?"), stats.get("local", "-"), split, steal


def summary(ios):
    med = statistics.median(ios)
    return (f"min / median / max: {min(ios):,.0f} / {med:,.0f} / {max(ios):,.0f} IOPS; spread "
            f"(max − min) / median {(max(ios) - min(ios)) / med:.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--before", help="an older dmkit binary to run the same series with")
    a = ap.parse_args()
    cmd = "bench/repeat.py " + " ".join(sys.argv[1:]).replace(a.before or "\0", "OLD")
    tmp = tempfile.mkdtemp(prefix="dmkit-repeat-", dir=a.dir)
    kinds = ["after"] + (["before"] if a.before else [])
    daemons = {}
    rows = {k: [] for k in kinds}
    try:
        for k in kinds:
            # a file each: a daemon holds its backing files exclusively
            f = os.path.join(tmp, f"{k}.img")
            subprocess.run(["fio", "--name=fill", "--rw=write", "--bs=1M", f"--size={SIZE}", f"--filename={f}"],
                           capture_output=True, check=True)
            daemons[k] = run.Dmkit(tmp, [("lin", f"0 {SIZE // 512} linear {f} 0")],
                                   binary=a.before if k == "before" else None)
        for i in range(a.runs):
            for k in (kinds if i % 2 == 0 else kinds[::-1]):
                rows[k].append(one_run(daemons[k], a.runtime))
                iops, cpu, per, local, split, steal = rows[k][-1]
                print(f"{k} run {i + 1}: {iops:,.0f} IOPS, {cpu:.2f} us/req, per_reactor={per}, local={local}, "
                      f"reactor ticks {split}, steal {steal:.0%}", file=sys.stderr)
    finally:
        for d in daemons.values():
            d.stop()
        subprocess.run(["rm", "-rf", tmp])
    day = time.strftime("%Y-%m-%d")
    commit = subprocess.run(["git", "-C", run.ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = ["## Repeatability: the same job, run after run (bench/repeat.py)", "",
             f"`{cmd.strip()}`, {day}, on {commit}"
             + (" (after), beside OLD (before), the two daemons taking turns run by run" if a.before else "")
             + f". One `dmkit serve` (one reactor per core), a linear "
             f"device over a prefilled 1 GiB file on `{a.dir}`; fio's nbd engine, 4 jobs (one connection "
             "each), QD1, 4 KiB random writes each followed by a flush (`--fsync=1`), "
             f"{a.runtime} s after a 1 s ramp, {a.runs} runs in a row. Per run: the connections each "
             "reactor served and how many of them had their client on the reactor's CPU "
             "(`dmkit stats --server` during the run: `per_reactor`, `local`), each reactor thread's CPU "
             "ticks, and the machine's steal time (share of its cores' time its host took).", ""]
    for k in kinds:
        if a.before:
            lines += [f"**{k}**", ""]
        lines += ["| run | IOPS | server µs/req | per_reactor | local | reactor CPU ticks | steal |",
                  "|---|---|---|---|---|---|---|"]
        for i, (iops, cpu, per, local, split, steal) in enumerate(rows[k]):
            lines.append(f"| {i + 1} | {iops:,.0f} | {cpu:.2f} | {per} | {local} | "
                         f"{' / '.join(map(str, split))} | {steal:.0%} |")
        label = f"{k}: " if a.before else ""
        lines += ["", f"**{label}{summary([r[0] for r in rows[k]])}** (issue 52's goal ≤ 0.10).", ""]
    run.write_section(os.path.join(run.ROOT, "BENCHMARKS.md"), "repeat", lines[:-1])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
