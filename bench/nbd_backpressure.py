#!/usr/bin/env python3
"""Memory of a daemon whose NBD clients send reads and never read the replies.

bench/nbd_backpressure.py [--bin target/release/dmkit] [--clients 8] [--reads 2000]

Starts `dmkit serve` in a scratch directory with a 64 MiB linear device over a
file, connects CLIENTS raw-socket clients (fixed newstyle, NBD_OPT_GO, simple
replies), each of which sends READS requests of 1 MiB from a thread of its own
and reads nothing; samples the daemon's VmRSS for 3 s, then has every client read
and check all its replies. Prints the baseline, the peak growth and how many
requests the daemon had taken off the sockets (sent minus still queued can't be
seen from here, so it prints how many each writer got out before the sample).
"""
import argparse, os, socket, struct, subprocess, tempfile, threading, time

MIB = 1 << 20


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def recv_exact(s, n):
    b = bytearray()
    while len(b) < n:
        c = s.recv(min(n - len(b), 1 << 20))
        if not c:
            raise EOFError("server closed")
        b += c
    return bytes(b)


def connect(sock, name):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    assert recv_exact(s, 18)[:16] == b"NBDMAGICIHAVEOPT"
    s.sendall(struct.pack(">I", 3))
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", 0x49484156454F5054, 7, len(data)) + data)
    while True:
        _, _, typ, ln = struct.unpack(">QIII", recv_exact(s, 20))
        recv_exact(s, ln)
        if typ == 1:
            return s
        assert typ == 3, hex(typ)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/dmkit")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--reads", type=int, default=2000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dmkit-bp-") as tmp:
        disk = os.path.join(tmp, "disk")
        content = bytes((i * 131 + 7) & 0xFF for i in range(MIB)) * 64
        with open(disk, "wb") as f:
            f.write(content)
        run = os.path.join(tmp, "run")
        d = subprocess.Popen([a.bin, "serve", "--run-dir", run], stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(os.path.join(run, "nbd.sock")):
                time.sleep(0.05)
            subprocess.run([a.bin, "--run-dir", run, "create", "d", "--table",
                            f"0 {64 * MIB // 512} linear {disk} 0"], check=True)
            sock = os.path.join(run, "nbd.sock")
            warm = connect(sock, b"d")
            for i in range(8):
                warm.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, i, i * MIB, MIB))
                recv_exact(warm, 16 + MIB)
            time.sleep(0.5)
            base = rss_kib(d.pid)
            clients = [connect(sock, b"d") for _ in range(a.clients)]
            sent = [0] * a.clients

            def writer(k):
                s = clients[k]
                for i in range(a.reads):
                    s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, i, (i % 64) * MIB, MIB))
                    sent[k] += 1

            ws = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(a.clients)]
            for w in ws:
                w.start()
            peak = 0
            t0 = time.time()
            while time.time() - t0 < 3:
                time.sleep(0.1)
                peak = max(peak, rss_kib(d.pid) - base)
            held = list(sent)
            for k, s in enumerate(clients):
                for _ in range(a.reads):
                    magic, err, cookie = struct.unpack(">IIQ", recv_exact(s, 16))
                    assert (magic, err) == (0x67446698, 0), (magic, err)
                    off = (cookie % 64) * MIB
                    assert recv_exact(s, MIB) == content[off:off + MIB], f"client {k} cookie {cookie}"
            for w in ws:
                w.join()
            print(f"{a.bin}: {a.clients} clients x {a.reads} unread 1 MiB reads: baseline {base // 1024} MiB, "
                  f"peak growth {peak / 1024:.1f} MiB; requests written before the sample ended: {held}; "
                  f"all {a.clients * a.reads} replies then read and checked")
        finally:
            d.terminate()
            d.wait()


if __name__ == "__main__":
    main()
