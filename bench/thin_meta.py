#!/usr/bin/env python3
"""dm-thin metadata benchmark (issue 3): 2^24 mappings across 4 thins, 64 MiB block cache.

Builds the pool once through the API (inserts, committing every 1000), then repeats
the read-side phases of `tests/thin_bench.rs` (open, warm/sequential/cold lookups,
peak RSS) on that file, and times `dmkit thin check` and `thin_check` on it,
alternating the two. Reports medians; writes the "thin-meta" section of BENCHMARKS.md.

Usage: bench/thin_meta.py [--reps N] [--mappings N] [--dir DIR]
"""
import argparse, glob, os, re, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as nb  # noqa: E402

ROOT = nb.ROOT


def bench_binary():
    env = dict(os.environ, CARGO_BUILD_JOBS="1")
    subprocess.run(["nice", "-n", "10", "cargo", "build", "--release", "--quiet", "--tests"],
                   cwd=ROOT, env=env, check=True)
    cands = [p for p in glob.glob(os.path.join(ROOT, "target/release/deps/thin_bench-*"))
             if not p.endswith(".d")]
    return max(cands, key=os.path.getmtime)


def run_bench(binary, mappings, d):
    env = dict(os.environ, THIN_BENCH_MAPPINGS=str(mappings), THIN_BENCH_DIR=d, THIN_BENCH_REUSE="1")
    out = subprocess.run([binary, "--ignored", "--nocapture"], env=env, capture_output=True,
                         text=True, check=True).stdout
    vals = {}
    for line in out.splitlines():
        m = re.match(r"BENCH (.+?): (.*)", line)
        if m:
            vals[m.group(1)] = m.group(2)
    return vals


def first_number(s):
    return float(re.search(r"[\d.]+(?:e[-+]?\d+)?", s.split("=")[-1]).group(0))


def timed(cmd):
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{cmd} failed: {r.stderr}")
    return time.monotonic() - t


def free_blocks(path):
    out = subprocess.run([nb.DMKIT, "thin", "check", path], capture_output=True, text=True).stdout
    return int(re.search(r"METADATA_FREE_BLOCKS=(\d+)", out).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mappings", type=int, default=1 << 24)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    binary = bench_binary()
    meta = os.path.join(a.dir, f"dmkit-bench-meta-{a.mappings}")
    if os.path.exists(meta):
        os.remove(meta)
    try:
        build = run_bench(binary, a.mappings, a.dir)
        runs = [run_bench(binary, a.mappings, a.dir) for _ in range(a.reps)]
        checks = {"dmkit thin check": [], "thin_check": []}
        for _ in range(a.reps):
            checks["dmkit thin check"].append(timed([nb.DMKIT, "thin", "check", "-q", meta]))
            checks["thin_check"].append(timed(["thin_check", "-q", meta]))
        with tempfile.TemporaryDirectory(dir=a.dir) as t:
            xml, restored = os.path.join(t, "m.xml"), os.path.join(t, "restored")
            with open(xml, "w") as f:
                subprocess.run([nb.DMKIT, "thin", "dump", meta], stdout=f, check=True)
            with open(restored, "wb") as f:
                f.truncate(os.path.getsize(meta))
            subprocess.run(["thin_restore", "-i", xml, "-o", restored], capture_output=True, check=True)
            restore_free, dmkit_free = free_blocks(restored), free_blocks(meta)
    finally:
        if os.path.exists(meta):
            os.remove(meta)

    def med(key):
        vals = [first_number(r[key]) for r in runs]
        return nb.med(vals), min(vals), max(vals)

    def row(name, key, unit, goal, scale=1.0, nd=0):
        m, lo, hi = (v * scale for v in med(key))
        return f"| {name} | {m:,.{nd}f} {unit} | {lo:,.{nd}f}–{hi:,.{nd}f} | {goal} |"

    cm = {k: nb.med(v) for k, v in checks.items()}
    warm_key = next(k for k in runs[0] if k.startswith("warm random lookups"))
    cold_key = next(k for k in runs[0] if k.startswith("random lookups over all"))
    blocks = 262144
    out = [
        f"## dm-thin metadata (issue 3): {a.mappings:,} mappings across 4 thins, 64 MiB block cache",
        "",
        f"Produced by `{' '.join(['bench/thin_meta.py'] + sys.argv[1:])}` on `{a.dir}`: the pool is "
        f"built once through the API, then the read-side phases of `tests/thin_bench.rs` run "
        f"{a.reps} times on it and `dmkit thin check` and `thin_check` alternate {a.reps} times. "
        "Medians, with the range.",
        f"Machine: {os.uname().release}, {os.cpu_count()} cores. Date: {time.strftime('%Y-%m-%d')}.",
        "",
        "| measurement | median | range | goal |",
        "|---|---|---|---|",
        f"| inserts, commit every 1000 (one build) | {build['inserts']} | — | — |",
        f"| metadata used | {build['metadata used']} | — | ≈ thin_restore |",
        row("open", "open", "ms", "≤ 100 ms", 1000.0, 1),
        row(warm_key.replace("warm random lookups", "warm random lookups/s"), warm_key, "", "≥ 5 M/s"),
        row("sequential lookups/s", "sequential lookups", "", ""),
        row(cold_key.replace("random lookups over all", "random lookups/s over all"), cold_key, "", ""),
        row("peak RSS", "peak RSS", "MiB", "≤ 128 MiB"),
        f"| dmkit thin check | {cm['dmkit thin check']:.2f} s | "
        f"{min(checks['dmkit thin check']):.2f}–{max(checks['dmkit thin check']):.2f} | faster than thin_check |",
        f"| thin_check | {cm['thin_check']:.2f} s | "
        f"{min(checks['thin_check']):.2f}–{max(checks['thin_check']):.2f} | (anchor) |",
        f"| thin_check time / dmkit thin check time | {cm['thin_check'] / cm['dmkit thin check']:.1f}× | — | > 1 |",
        f"| metadata blocks in use: dmkit / thin_restore of the same XML | {blocks - dmkit_free} / "
        f"{blocks - restore_free} | — | ≈ 1 |",
        "",
        "Warm lookups are answered by the metadata library's exact lookup cache "
        "(`src/thin/map_cache.rs`: 4-way sets of one cache line, half the block cache's memory, "
        "updated by every insert, remove and delete), so a hit costs one memory access instead of "
        "a walk through four btree levels. Cold lookups over the whole tree read 4 KiB nodes "
        "through the 64 MiB block cache and are bound by that. Opening decodes the space-map "
        "bitmaps 32 entries per word and scans nothing else. The checker reads each node once, "
        "uncached, and recounts references in flat arrays.",
    ]
    nb.write_section(a.out, "thin-meta", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
