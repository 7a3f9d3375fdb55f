#!/usr/bin/env python3
"""dm-crypt, side by side (issue 33): the crypt target's cipher against
`openssl speed` on the same machine in the same run, then a crypt device
(aes-xts-plain64, 512-bit key) against a linear device on the same file, both
in one dmkit daemon, through fio's nbd engine. Medians of the reps, interleaved
(rep 1 of every cell, then rep 2, ...). Writes BENCHMARKS.md, section `crypt`.

Usage: bench/crypt.py [--reps 3] [--runtime 3] [--dir /dev/shm]
       bench/crypt.py --before OLD_DMKIT [--reps 5] [...]: the devices only, each
           cell run with the old binary and this build in turn (the order
           alternating by rep), in one sitting; writes section `crypt-before-after`.
Needs: a release build with examples (`cargo build --release --examples`), fio, openssl.
"""
import argparse, os, re, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402

SPEED = os.path.join(os.path.dirname(run.DMKIT), "examples", "crypt_speed")
KEY512 = "".join(f"{(i * 37 + 11) % 256:02x}" for i in range(64))
CIPHERS = [
    # dmkit's spelling, its key, openssl's EVP name (the same transform per sector)
    ("aes-xts-plain64", KEY512, "aes-256-xts"),
    ("aes-xts-plain64", KEY512[:64], "aes-128-xts"),
    ("aes-cbc-plain64", KEY512[:64], "aes-256-cbc"),
]
SIZE = 1 << 30
WORKLOADS = [
    ("randread 4k qd32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    ("randwrite 4k qd32", ["--rw=randwrite", "--bs=4k", "--iodepth=32"]),
    ("read 1M qd8", ["--rw=read", "--bs=1M", "--iodepth=8"]),
    ("write 1M qd8", ["--rw=write", "--bs=1M", "--iodepth=8"]),
]


def openssl_rate(evp, sector, secs):
    out = subprocess.run(["openssl", "speed", "-evp", evp, "-bytes", str(sector), "-seconds", str(secs)],
                         capture_output=True, text=True, check=True).stdout
    m = re.search(r"^\S+\s+([\d.]+)k\s*$", out.strip().splitlines()[-1])
    return float(m.group(1)) * 1000 if m else None


def dmkit_rate(cipher, key, sector, secs):
    out = subprocess.run([SPEED, cipher, key, str(sector), str(secs)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def spread(rs):
    """(max - min) / median of the IOPS of the reps."""
    v = [r[0] for r in rs]
    return (max(v) - min(v)) / run.med(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--before", help="an older dmkit binary to compare this build with")
    a = ap.parse_args()
    if a.before:
        return before_after(a)
    cmd = f"bench/crypt.py --reps {a.reps} --runtime {a.runtime} --dir {a.dir}"
    commit = subprocess.run(["git", "-C", run.ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    day = subprocess.run(["date", "-u", "+%Y-%m-%d"], capture_output=True, text=True).stdout.strip()
    lines = ["## dm-crypt (bench/crypt.py)", "",
             f"`{cmd}` (after `cargo build --release --examples`). The machine's 2 cores are shared "
             "with the client and were not idle; read each ratio as ±10–20%. "
             f"Run {day} on {commit}; load average at the start {os.getloadavg()[0]:.1f}, at the end LOAD_END.", "",
             "**Cipher alone** (one core): `examples/crypt_speed.rs` encrypts a 1 MiB buffer sector by "
             "sector as the target does (IV per sector), against `openssl speed -evp NAME -bytes SECTOR` "
             "(OpenSSL's assembly; the same transform per sector). Both count bytes per second of the "
             "process's CPU time (openssl speed its user time), so a loaded machine's waits do not count. "
             "MB/s (10^6 bytes), medians of "
             f"{a.reps} runs of {a.runtime} s, alternating; the spread is (max − min) / median of each side.",
             "", "| cipher | sector | dmkit MB/s | openssl MB/s | dmkit/openssl | spread dmkit / openssl |",
             "|---|---|---|---|---|---|"]
    for cipher, key, evp in CIPHERS:
        for sector in (512, 4096):
            d, o = [], []
            for _ in range(a.reps):
                d.append(dmkit_rate(cipher, key, sector, a.runtime))
                o.append(openssl_rate(evp, sector, a.runtime))
            dm, om = run.med(d), run.med(o)
            lines.append(f"| {cipher} ({len(key) * 4}-bit key) / {evp} | {sector} | {dm / 1e6:,.0f} | "
                         f"{om / 1e6:,.0f} | **{dm / om:.2f}** | ±{(max(d) - min(d)) / dm:.2f} / "
                         f"±{(max(o) - min(o)) / om:.2f} |")
            print(lines[-1], file=sys.stderr)
    tmp = tempfile.mkdtemp(prefix="dmkit-crypt-", dir=a.dir)
    f = os.path.join(tmp, "disk.img")
    subprocess.run(["fio", "--name=fill", "--rw=write", "--bs=1M", f"--size={SIZE}", f"--filename={f}"],
                   capture_output=True, check=True)
    d = run.Dmkit(tmp, tables(f), extra=("--buffered",))
    res = {}
    try:
        for _ in range(a.reps):
            for wl, args in WORKLOADS:
                for dev in ("lin", "cr", "cr512"):
                    r = run.fio_cpu(d, d.uri(dev), [f"--size={SIZE}"] + args, a.runtime)
                    res.setdefault((wl, dev), []).append(r)
                    print(f"{wl} {dev}: {r[0]:,.0f} IOPS {r[1]:,.0f} MiB/s {r[2]:.2f} us/req", file=sys.stderr)
    finally:
        d.stop()
        subprocess.run(["rm", "-rf", tmp])
    lines += ["", "**Devices**: `crypt aes-xts-plain64` (512-bit key) with `sector_size:4096` and with the "
              "default 512-byte sectors (cryptsetup's plain mode and LUKS1), and `linear`, over "
              f"the same 1 GiB file on `{a.dir}`, in one `dmkit serve --buffered`, fio's nbd engine, one "
              "connection; server CPU per request in µs (all its threads).", "",
              "| workload | linear IOPS | crypt IOPS (4096 / 512) | crypt/linear (4096 / 512) | linear MiB/s | "
              "crypt MiB/s (4096 / 512) | linear µs/req | crypt µs/req (4096 / 512) | IOPS spread linear / crypt "
              "(4096 / 512) |", "|---|---|---|---|---|---|---|---|---|"]
    for wl, _ in WORKLOADS:
        lm = [run.med([r[i] for r in res[(wl, "lin")]]) for i in range(3)]
        cm = [run.med([r[i] for r in res[(wl, "cr")]]) for i in range(3)]
        sm = [run.med([r[i] for r in res[(wl, "cr512")]]) for i in range(3)]
        lines.append(f"| {wl} | {lm[0]:,.0f} | {cm[0]:,.0f} / {sm[0]:,.0f} | **{cm[0] / lm[0]:.2f}** / "
                     f"**{sm[0] / lm[0]:.2f}** | {lm[1]:,.0f} | {cm[1]:,.0f} / {sm[1]:,.0f} | {lm[2]:.2f} | "
                     f"{cm[2]:.2f} / {sm[2]:.2f} | ±{spread(res[(wl, 'lin')]):.2f} / "
                     f"±{spread(res[(wl, 'cr')]):.2f} / ±{spread(res[(wl, 'cr512')]):.2f} |")
    lines = [ln.replace("LOAD_END", f"{os.getloadavg()[0]:.1f}") for ln in lines]
    run.write_section(os.path.join(run.ROOT, "BENCHMARKS.md"), "crypt", lines)
    print("\n".join(lines))


def tables(f):
    sectors = SIZE // 512
    return [("lin", f"0 {sectors} linear {f} 0"),
            ("cr", f"0 {sectors} crypt aes-xts-plain64 {KEY512} 0 {f} 0 1 sector_size:4096"),
            ("cr512", f"0 {sectors} crypt aes-xts-plain64 {KEY512} 0 {f} 0")]


def before_after(a):
    # private copies, so a rebuild during the run cannot mix binaries
    d = tempfile.mkdtemp(prefix="dmkit-crypt-bins-")
    bins = {"before": os.path.join(d, "dmkit-before"), "after": os.path.join(d, "dmkit-after")}
    subprocess.run(["cp", a.before, bins["before"]], check=True)
    subprocess.run(["cp", run.DMKIT, bins["after"]], check=True)
    tmp = tempfile.mkdtemp(prefix="dmkit-crypt-", dir=a.dir)
    ds = {}
    for b, p in bins.items():
        # a file each: a daemon holds its devices' files exclusively
        f = os.path.join(tmp, f"disk-{b}.img")
        subprocess.run(["fio", "--name=fill", "--rw=write", "--bs=1M", f"--size={SIZE}", f"--filename={f}"],
                       capture_output=True, check=True)
        ds[b] = run.Dmkit(tmp, tables(f), extra=("--buffered",), binary=p)
    devs = ("lin", "cr", "cr512")
    res = {}
    try:
        for rep in range(a.reps):
            order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
            for wl, args in WORKLOADS:
                for b in order:
                    for dev in devs:
                        r = run.fio_cpu(ds[b], ds[b].uri(dev), [f"--size={SIZE}"] + args, a.runtime)
                        res.setdefault((wl, dev, b), []).append(r)
                        print(f"rep {rep} {wl} {dev} {b}: {r[0]:,.0f} IOPS {r[2]:.2f} us/req", file=sys.stderr)
    finally:
        for x in ds.values():
            x.stop()
        subprocess.run(["rm", "-rf", tmp, d])
    m = {k: (run.med([r[0] for r in v]), run.med([r[2] for r in v])) for k, v in res.items()}
    lines = ["## dm-crypt before and after a change (bench/crypt.py --before)", "",
             f"`bench/crypt.py --before OLD --reps {a.reps} --runtime {a.runtime} --dir {a.dir}`: the "
             "devices of the section above (linear, crypt with 4096- and 512-byte sectors, one daemon "
             "per binary, each over a 1 GiB file of its own), each cell run with the old binary and this build in turn, the order "
             "alternating by rep; medians of the reps. crypt/linear is each binary's own ratio; "
             "µs/req is the server's CPU per request (all its threads).", "",
             "| workload | device | IOPS before | IOPS after | after/before | crypt/linear before | "
             "crypt/linear after | µs/req before | µs/req after |", "|---|---|---|---|---|---|---|---|---|"]
    for wl, _ in WORKLOADS:
        for dev in devs:
            b, af = m[(wl, dev, "before")], m[(wl, dev, "after")]
            lb, la = m[(wl, "lin", "before")], m[(wl, "lin", "after")]
            rel = "—" if dev == "lin" else f"**{b[0] / lb[0]:.2f}**"
            rela = "—" if dev == "lin" else f"**{af[0] / la[0]:.2f}**"
            lines.append(f"| {wl} | {dev} | {b[0]:,.0f} | {af[0]:,.0f} | **{af[0] / b[0]:.2f}** | {rel} | "
                         f"{rela} | {b[1]:.2f} | {af[1]:.2f} |")
    run.write_section(os.path.join(run.ROOT, "BENCHMARKS.md"), "crypt-before-after", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
