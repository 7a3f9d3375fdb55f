#!/usr/bin/env python3
"""The thin tools against thin-provisioning-tools 1.x (issues 16 and 14).

Metadata with 10^6 mappings in one volume and 100 snapshots of it (the volume
overwrites 0.1% of its blocks after each snapshot; examples/thin_gen.rs). On that
file, `dmkit thin check|dump|restore|repair` and the 1.x reference (ci/fetch-tpt-ref.sh)
alternate: check, dump (the def/ref XML), restore of the reference's dump into a
fresh file, repair into a fresh file. Wall time medians and peak RSS (wait4's
ru_maxrss of each run); ratios reference/dmkit. Writes the "thin-tools" section of
BENCHMARKS.md.

Usage: bench/thin_tools.py [--reps N] [--mappings N] [--snapshots N] [--dir DIR]
"""
import argparse, os, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as nb  # noqa: E402

ROOT = nb.ROOT
REF = os.path.join(os.environ.get("TPT_REF", "/opt/dmkit-ref/thin-provisioning-tools"), "usr/sbin")


def timed(cmd, stdout=subprocess.DEVNULL):
    t = time.monotonic()
    p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.monotonic() - t
    err = p.stderr.read().decode()
    p.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed: {err}")
    return dt, ru.ru_maxrss / 1024.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mappings", type=int, default=1_000_000)
    ap.add_argument("--snapshots", type=int, default=100)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    env = dict(os.environ, CARGO_BUILD_JOBS="1")
    subprocess.run(["cargo", "build", "--release", "--quiet", "--examples"], cwd=ROOT, env=env, check=True)
    gen = os.path.join(ROOT, "target/release/examples/thin_gen")
    with tempfile.TemporaryDirectory(dir=a.dir) as t:
        meta = os.path.join(t, "meta")
        made = subprocess.run([gen, meta, str(a.mappings), str(a.snapshots)], check=True,
                              capture_output=True, text=True).stdout.strip()
        xml = os.path.join(t, "ref.xml")
        with open(xml, "w") as f:
            subprocess.run([os.path.join(REF, "thin_dump"), meta], stdout=f, check=True)
        size = os.path.getsize(meta)

        def fresh(name):
            p = os.path.join(t, name)
            with open(p, "wb") as f:
                f.truncate(size)
            return p

        tools = {
            "check": lambda d: ([d("thin_check"), "-q", meta], None),
            "dump": lambda d: ([d("thin_dump"), meta], None),
            "restore": lambda d: ([d("thin_restore"), "-q", "-i", xml, "-o", fresh("r")], None),
            "repair": lambda d: ([d("thin_repair"), "-q", "-i", meta, "-o", fresh("p")], None),
            "ls (usage per device)": lambda d: ([d("thin_ls"), "-o", "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS", meta], None),
            "delta (oldest vs newest snapshot)": lambda d: ([d("thin_delta"), "--snap1", "1", "--snap2", str(a.snapshots), meta], None),
        }
        sides = {
            "dmkit": lambda name: os.path.join(t, "bin", name),
            "1.x": lambda name: os.path.join(REF, name),
        }
        os.makedirs(os.path.join(t, "bin"))
        subprocess.run([nb.DMKIT, "thin", "links", os.path.join(t, "bin")], check=True, capture_output=True)
        res = {(tool, side): [] for tool in tools for side in sides}
        for i in range(a.reps):
            for tool, mk in tools.items():
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                for side in order:
                    cmd, _ = mk(sides[side])
                    res[(tool, side)].append(timed(cmd))
    rows = []
    for tool in tools:
        d = [x for x in res[(tool, "dmkit")]]
        r = [x for x in res[(tool, "1.x")]]
        dt, rt = nb.med([x[0] for x in d]), nb.med([x[0] for x in r])
        dm, rm = max(x[1] for x in d), max(x[1] for x in r)
        rows.append(f"| {tool} | {dt:.2f} s | {rt:.2f} s | **{rt / dt:.1f}×** | {dm:,.0f} MiB | {rm:,.0f} MiB |")
    out = [
        f"## The thin tools vs thin-provisioning-tools 1.x (issues 16, 14): {a.mappings:,} mappings, {a.snapshots} snapshots",
        "",
        f"Produced by `{' '.join(['bench/thin_tools.py'] + sys.argv[1:])}` on `{a.dir}`. The metadata: {made.split(': ', 1)[-1]} "
        f"(`examples/thin_gen.rs`: one volume, a snapshot after every 0.1% of overwrites). "
        f"Reference: Debian trixie's thin-provisioning-tools 1.1.0 (`ci/fetch-tpt-ref.sh`). "
        f"dmkit and the reference alternate, {a.reps} runs each; medians of wall time, the highest peak RSS. "
        "restore reads the reference's own dump (the `<def>`/`<ref>` form); repair writes into a fresh file.",
        f"Machine: {os.uname().release}, {os.cpu_count()} cores. Date: {time.strftime('%Y-%m-%d')}. Goal: ≥ 3× faster, peak memory ≤ the reference's.",
        "",
        "| tool | dmkit | 1.x | **1.x / dmkit** | dmkit peak RSS | 1.x peak RSS |",
        "|---|---|---|---|---|---|",
    ] + rows
    nb.write_section(a.out, "thin-tools", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
