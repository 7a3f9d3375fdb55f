#!/usr/bin/env python3
"""The cache tools against thin-provisioning-tools 1.x (issue 34).

Cache metadata of 10^6 cache blocks, every one mapped (to a scattered origin
block), every 100th dirty, each with a hint: the XML is written by this script,
restored by the reference (version 2). On that file, `dmkit cache
check|dump|restore|repair|writeback|metadata_size` and the 1.x reference
(ci/fetch-tpt-ref.sh) alternate through their multi-call names: check, dump,
restore of the XML into a fresh file, repair into a fresh file, writeback of the
10^4 dirty 32 KiB blocks (a fresh copy of the metadata each run, sparse fast and
origin files on DATA_DIR, O_DIRECT-capable for the reference). Wall time medians
and peak RSS as `/usr/bin/time -v` reports it; ratios reference/dmkit. Writes
the "cache-tools" section of BENCHMARKS.md.

Usage: bench/cache_tools.py [--reps N] [--blocks N] [--dir DIR] [--data-dir DIR]
"""
import argparse, os, shutil, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as nb  # noqa: E402

ROOT = nb.ROOT
REF = os.path.join(os.environ.get("TPT_REF", "/opt/dmkit-ref/thin-provisioning-tools"), "usr/sbin")
BLOCK_SECTORS = 64


def timed(cmd, before=None):
    if before:
        before()
    t = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-v"] + cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"{cmd} failed: {p.stderr}")
    rss = [l for l in p.stderr.splitlines() if "Maximum resident set size" in l]
    return dt, int(rss[0].split(":")[1]) / 1024.0


def write_xml(path, n):
    """n cache blocks, all mapped, origin block c * 7 mod 2n + (c odd), every
    100th dirty; hints the cache block's number."""
    import base64
    with open(path, "w") as f:
        f.write(f'<superblock uuid="" block_size="{BLOCK_SECTORS}" nr_cache_blocks="{n}" policy="smq" hint_width="4">\n  <mappings>\n')
        for c in range(n):
            o = (c * 7919) % (2 * n)
            f.write(f'    <mapping cache_block="{c}" origin_block="{o}" dirty="{"true" if c % 100 == 0 else "false"}"/>\n')
        f.write("  </mappings>\n  <hints>\n")
        for c in range(n):
            f.write(f'    <hint cache_block="{c}" data="{base64.b64encode(c.to_bytes(4, "little")).decode()}"/>\n')
        f.write("  </hints>\n</superblock>")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--data-dir", default="/var/tmp")
    ap.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    n = a.blocks
    if n % 7919 == 0:
        raise SystemExit("--blocks must not be a multiple of 7919 (origin blocks would repeat)")
    with tempfile.TemporaryDirectory(dir=a.dir) as t, tempfile.TemporaryDirectory(dir=a.data_dir) as dd:
        xml = os.path.join(t, "cache.xml")
        write_xml(xml, n)
        size = 64 << 20

        def fresh(name):
            p = os.path.join(t, name)
            with open(p, "wb") as f:
                f.truncate(size)
            return p

        meta = fresh("meta")
        subprocess.run([os.path.join(REF, "cache_restore"), "-i", xml, "-o", meta], check=True)
        used = subprocess.run([nb.DMKIT, "cache", "dump", meta], capture_output=True, check=True).stdout.count(b'dirty="true"')
        fast, origin = os.path.join(dd, "fast"), os.path.join(dd, "origin")
        for p, blocks in ((fast, n), (origin, 2 * n)):
            with open(p, "wb") as f:
                f.truncate(blocks * BLOCK_SECTORS * 512)
        wb_meta = os.path.join(t, "wb_meta")

        def copy_meta():
            shutil.copyfile(meta, wb_meta)

        tools = {
            "check": lambda d: ([d("cache_check"), "-q", meta], None),
            "dump": lambda d: ([d("cache_dump"), meta], None),
            "restore": lambda d: ([d("cache_restore"), "-q", "-i", xml, "-o", fresh("r")], None),
            "repair": lambda d: ([d("cache_repair"), "-q", "-i", meta, "-o", fresh("p")], None),
            f"writeback ({used:,} dirty blocks of 32 KiB)": lambda d: (
                [d("cache_writeback"), "-q", "--metadata-device", wb_meta, "--origin-device", origin, "--fast-device", fast],
                copy_meta,
            ),
            "metadata_size": lambda d: ([d("cache_metadata_size"), "--nr-blocks", str(n)], None),
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
                    cmd, before = mk(sides[side])
                    res[(tool, side)].append(timed(cmd, before))
    rows = []
    for tool in tools:
        d, r = res[(tool, "dmkit")], res[(tool, "1.x")]
        dt, rt = nb.med([x[0] for x in d]), nb.med([x[0] for x in r])
        dm, rm = max(x[1] for x in d), max(x[1] for x in r)
        rows.append(f"| {tool} | {dt:.3f} s | {rt:.3f} s | **{rt / dt:.1f}×** | {dm:,.1f} MiB | {rm:,.1f} MiB |")
    load = os.getloadavg()[0]
    out = [
        f"## The cache tools vs thin-provisioning-tools 1.x (issue 34): {n:,} cache blocks",
        "",
        f"Produced by `{' '.join(['bench/cache_tools.py'] + sys.argv[1:])}`, metadata on `{a.dir}`, the writeback's fast and origin files (sparse) on `{a.data_dir}`. "
        f"The metadata: {n:,} cache blocks of {BLOCK_SECTORS} sectors, every one mapped, every 100th dirty, each with a hint; "
        "the XML written by the script, restored by the reference's `cache_restore` (version 2). "
        f"dmkit (through its multi-call links) and the reference alternate, {a.reps} runs each; medians of wall time, "
        "the highest peak RSS (`/usr/bin/time -v`). restore reads the XML into a fresh file, repair writes into a fresh file, "
        "writeback gets a fresh copy of the metadata each run and clears the dirty bits.",
        f"Machine: {os.uname().release}, {os.cpu_count()} cores, load average {load:.1f} at the end. Date: {time.strftime('%Y-%m-%d')}. "
        "Goal: ≥ 1.5× faster, peak memory ≤ the reference's.",
        "",
        "| tool | dmkit | 1.x | **1.x / dmkit** | dmkit peak RSS | 1.x peak RSS |",
        "|---|---|---|---|---|---|",
    ] + rows
    nb.write_section(a.out, "cache-tools", out)
    print("\n".join(out))


if __name__ == "__main__":
    main()
