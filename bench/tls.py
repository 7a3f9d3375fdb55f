#!/usr/bin/env python3
"""NBD over TLS: dmkit against nbdkit with the same pre-shared key, in one run.

Both serve one 1 GiB file (dmkit: a linear device over it, --buffered; nbdkit: its
file plugin, through the page cache likewise) on a unix socket with the same X.509
certificate (dmkit `--tls on`, nbdkit `--tls=require`); fio's nbd engine (libnbd,
GnuTLS) connects with nbds+unix:// and the client certificate in
$HOME/.pki/libnbd (fio's engine refuses a URI's tls-psk-file=, so no PSK here).
Plain clients of the same dmkit daemon run beside them for the cost of TLS itself. Workloads: 4 KiB random reads at QD32 and 1 MiB
sequential reads at QD8, one connection. The servers take turns, cell by cell, rep
by rep. Records the medians (IOPS, MiB/s, the server's CPU per request) and the
dmkit/nbdkit ratios in BENCHMARKS.md, section `tls`.

Usage: bench/tls.py [--reps 5] [--runtime 4] [--dir /dev/shm] [--out BENCHMARKS.md]
Needs: fio, nbdkit, openssl (ci/install.sh installs them), a release build.
"""
import argparse, os, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run  # noqa: E402  (the shared helpers of bench/run.py)

# a CA, a server certificate ($1: ca-cert.pem, server-cert.pem, server-key.pem)
# and a client certificate ($2: ca-cert.pem, client-cert.pem, client-key.pem)
CREDS = r"""
set -e
mkdir -p "$1" "$2"
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
openssl req -x509 $ec -days 2 -subj /CN=bench-ca -keyout ca-key.pem -out "$1/ca-cert.pem"
cp "$1/ca-cert.pem" "$2/"
openssl req $ec -subj /CN=localhost -keyout "$1/server-key.pem" -out server.csr
openssl x509 -req -in server.csr -CA "$1/ca-cert.pem" -CAkey ca-key.pem -CAcreateserial -days 2 \
  -extfile <(echo subjectAltName=DNS:localhost) -out "$1/server-cert.pem"
openssl req $ec -subj /CN=bench -keyout "$2/client-key.pem" -out client.csr
openssl x509 -req -in client.csr -CA "$1/ca-cert.pem" -CAkey ca-key.pem -CAcreateserial -days 2 \
  -out "$2/client-cert.pem"
"""

WORKLOADS = [
    ("randread 4k qd32", ["--rw=randread", "--bs=4k", "--iodepth=32"]),
    ("seq read 1M qd8", ["--rw=read", "--bs=1M", "--iodepth=8"]),
]


class Nbdkit:
    """`nbdkit file` on a unix socket with `extra` arguments."""

    def __init__(self, tmp, backing, extra):
        self.sock = os.path.join(tmp, "nbdkit.sock")
        self.p = subprocess.Popen(["nbdkit", "-f", "-U", self.sock, *extra, "file", backing],
                                  stderr=subprocess.DEVNULL)
        run.wait_for(self.sock)

    def cpu(self):
        return run.proc_cpu(self.p.pid)

    def stop(self):
        self.p.terminate()
        self.p.wait(30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runtime", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default=os.path.join(run.ROOT, "BENCHMARKS.md"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dmkit-tls-bench-")
    backing = os.path.join(a.dir, "dmkit-tls-bench.img")
    subprocess.run(["fio", "--name=fill", "--ioengine=psync", "--rw=write", "--bs=1M",
                    f"--size={run.SIZE}", f"--filename={backing}"], capture_output=True, check=True)
    # fio's nbd engine refuses the URI's tls-psk-file= (libnbd's "local file
    # access"): it takes X.509 credentials from $HOME/.pki/libnbd instead
    server, client = os.path.join(tmp, "server"), os.path.join(tmp, "home", ".pki", "libnbd")
    subprocess.run(["bash", "-c", CREDS, "creds", server, client], cwd=tmp, capture_output=True, check=True)
    os.environ["HOME"] = os.path.join(tmp, "home")
    table = f"0 {run.SIZE // 512} linear {backing} 0\n"
    # one daemon (a backing file is opened by one daemon at a time): `--tls on`
    # serves the TLS and the plain clients
    dm = run.Dmkit(tmp, [("bench", table)], ["--buffered", "--tls", "on", "--tls-certificates", server])
    kit = Nbdkit(tmp, backing, ["--tls=require", f"--tls-certificates={server}"])
    servers = [
        ("dmkit TLS", dm, f"nbds+unix:///bench?socket={dm.run}/nbd.sock"),
        ("nbdkit TLS", kit, f"nbds+unix:///?socket={kit.sock}"),
        ("dmkit plain", dm, dm.uri("bench")),
    ]
    res = {}
    try:
        for wl, args in WORKLOADS:
            for rep in range(a.reps):
                order = servers if rep % 2 == 0 else servers[::-1]
                for name, srv, uri in order:
                    r = run.fio_cpu(srv, uri, args + [f"--size={run.SIZE}"], a.runtime)
                    res.setdefault((wl, name), []).append(r)
                    print(f"{wl} {name} rep {rep}: {r[0]:,.0f} IOPS {r[1]:,.0f} MiB/s", file=sys.stderr)
    finally:
        dm.stop()
        kit.stop()
        os.unlink(backing)
    med = {k: tuple(run.med([r[i] for r in v]) for i in range(3)) for k, v in res.items()}
    commit = subprocess.run(["git", "-C", run.ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    date = subprocess.run(["date", "-u", "+%Y-%m-%d"], capture_output=True, text=True).stdout.strip()
    lines = [
        "## NBD over TLS (bench/tls.py)",
        "",
        f"`bench/tls.py --reps {a.reps} --runtime {a.runtime} --dir {a.dir}` ({date}, commit {commit}): "
        "dmkit (linear over a 1 GiB file, `--buffered`, `--tls on`) and `nbdkit file` "
        "(`--tls=require`) on unix sockets with the same X.509 certificate (ECDSA P-256), fio's nbd "
        "engine (libnbd/GnuTLS, TLS 1.3) on one connection; plain clients of the same dmkit beside "
        "them. (fio's engine refuses a URI's `tls-psk-file=`, so the run uses certificates.) Medians of the reps, the servers taking turns; "
        "µs/req is the server's CPU per request (all threads).",
        "",
        "| workload | dmkit TLS IOPS | nbdkit TLS IOPS | dmkit/nbdkit | dmkit TLS MiB/s | nbdkit TLS MiB/s "
        "| dmkit plain IOPS | TLS/plain | µs/req dmkit TLS | µs/req nbdkit TLS | µs/req dmkit plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for wl, _ in WORKLOADS:
        d, k, p = med[(wl, "dmkit TLS")], med[(wl, "nbdkit TLS")], med[(wl, "dmkit plain")]
        lines.append(
            f"| {wl} | {run.fmt(d[0])} | {run.fmt(k[0])} | **{d[0] / k[0]:.2f}** | {run.fmt(d[1])} "
            f"| {run.fmt(k[1])} | {run.fmt(p[0])} | **{d[0] / p[0]:.2f}** | {run.fmt(d[2], 2)} "
            f"| {run.fmt(k[2], 2)} | {run.fmt(p[2], 2)} |")
    run.write_section(a.out, "tls", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
