#!/usr/bin/env python3
"""Write the seed corpora of the protocol and text fuzz targets (fuzz/corpus/).
The metadata targets' seeds are images dmkit itself wrote (see README.md)."""
import os, struct

HERE = os.path.dirname(os.path.abspath(__file__))
IHAVEOPT = 0x49484156454F5054
REQ = 0x25609513


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def opt(o, payload=b""):
    return struct.pack(">QII", IHAVEOPT, o, len(payload)) + payload


def name(n):
    return struct.pack(">I", len(n)) + n


def go(n, infos=()):
    return name(n) + struct.pack(">H", len(infos)) + b"".join(struct.pack(">H", i) for i in infos)


def meta(export, queries):
    return name(export) + struct.pack(">I", len(queries)) + b"".join(name(q) for q in queries)


flags = struct.pack(">I", 3)
put("nbd_handshake", "go", flags + opt(7, go(b"z")))
put("nbd_handshake", "structured_go", flags + opt(8) + opt(7, go(b"lin", [0, 1, 2, 3])))
put("nbd_handshake", "list_info_abort", flags + opt(3) + opt(6, go(b"thin", [3])) + opt(2))
put("nbd_handshake", "meta", flags + opt(8) + opt(10, meta(b"thin", [b"base:allocation", b"qemu:dirty-bitmap:1"]))
    + opt(9, meta(b"thin", [b"base:"])) + opt(7, go(b"thin")))
put("nbd_handshake", "starttls_unknown", flags + opt(5) + opt(99, b"xx") + opt(1, b"z"))
put("nbd_handshake", "extended", flags + opt(11) + opt(8) + opt(7, go(b"wc")))


def req(cmd, off, length, flags=0, handle=1, payload=b""):
    return struct.pack(">IHHQQI", REQ, flags, cmd, handle, off, length) + payload


READ, WRITE, DISC, FLUSH, TRIM, CACHE, ZEROES, BS = 0, 1, 2, 3, 4, 5, 6, 7
for pick, dev in enumerate(["z", "lin", "thin", "wc"]):
    s = bytes([pick])
    put("nbd_requests", f"{dev}_rw", s + req(WRITE, 4096, 8192, 1, 1, b"\xab" * 8192) + req(READ, 0, 16384, 0, 2)
        + req(FLUSH, 0, 0, 0, 3) + req(DISC, 0, 0))
    put("nbd_requests", f"{dev}_trim_zero_bs", s + req(TRIM, 0, 65536) + req(ZEROES, 65536, 65536, 2)
        + req(ZEROES, 0, 4096, 0x10) + req(BS, 0, 1 << 20, 0, 4) + req(CACHE, 0, 4096))
    put("nbd_requests", f"{dev}_bad", s + req(READ, 1 << 40, 512) + req(WRITE, 0, 0) + req(77, 0, 0, 0xff)
        + req(READ, 0, 0xFFFFFFFF))
    # bits 2-3 of the first byte: 1 simple replies, 2 base:allocation, 3 and qemu:dirty-bitmap:1
    put("nbd_requests", f"{dev}_simple", bytes([pick | 4]) + req(WRITE, 0, 4096, 1, 1, b"\xcd" * 4096)
        + req(READ, 0, 4096, 4, 2) + req(BS, 0, 4096) + req(READ, 0, 0) + req(DISC, 0, 0))
    for mode in (2, 3):
        put("nbd_requests", f"{dev}_status{mode}", bytes([pick | mode << 2]) + req(WRITE, 65536, 65536, 0, 1, b"\x11" * 65536)
            + req(BS, 0, 1 << 20, 0, 2) + req(BS, 0, 1 << 20, 8, 3) + req(BS, 4096, 512, 8, 4) + req(BS, 0, 0, 0, 5)
            + req(BS, 0, 0xFFFFFE00, 0, 6) + req(BS, 1 << 40, 512, 8, 7) + req(READ, 0, 0, 0, 8))
# A zero-length WRITE waited for a payload of nothing, and left every later
# request on its connection unanswered (issue 29).
put("nbd_requests", "regress-zero-length-write", bytes([1]) + req(WRITE, 0, 0) + req(READ, 0, 512, 0, 2)
    + req(WRITE, 512, 0, 1, 3) + req(FLUSH, 0, 0, 0, 4))
# A client that half-closed after a 4 MiB read and a 9.3 MiB one had every reply
# dropped: back-pressure (8 MiB held) left the second request unparsed in the
# buffer, and the end of the stream then looked like a request cut short.
put("nbd_requests", "regress-half-close-behind-back-pressure", bytes([9]) + req(READ, 0, 4 << 20, 0, 1)
    + req(READ, 0, 0x951300, 8, 2))
put("nbd_requests", "regress-zero-length-read-structured", bytes([1 | 2 << 2]) + req(READ, 0, 0) + req(BS, 0, 0, 8, 2))
# A TRIM of a mapped thin block, then writes of zeroes over it and the next
# block: each write held the pool device (its piece on the next block went
# through it) while its piece on the trimmed block waited for the discard, which
# waited for the pool device to drain. CI on 41830ba; the connection never closed.
put("nbd_requests", "regress-discard-waits-for-a-write-waiting-for-it", bytes([2]) + req(WRITE, 0, 131072, 0, 1, b"\x5a" * 131072)
    + req(TRIM, 0, 65536, 0, 2) + req(ZEROES, 2560, 65536, 2, 3) + req(ZEROES, 0, 1 << 20, 0x10, 4) + req(FLUSH, 0, 0, 0, 5))

D = "/dev/shm/dmkit-fuzz-table/"
for n, t in {
    "zero": "0 1024 zero",
    "error": "0 1024 error",
    "linear": f"0 1024 linear {D}lin 0\n1024 1024 linear /dev/mapper/lin 8",
    "striped": f"0 2048 striped 2 8 {D}lin 0 /dev/mapper/lin 0",
    "flakey": f"0 1024 flakey {D}lin 0 1 1 3 corrupt_bio_byte 32 w 1 1 drop_writes",
    "delay": f"0 1024 delay {D}lin 0 10 {D}lin 0 20",
    "thin_pool": f"0 4096 thin-pool {D}tmeta {D}tdata 128 0 2 skip_block_zeroing error_if_no_space",
    "thin": "0 4096 thin /dev/mapper/pool 0",
    "writecache": f"0 1024 writecache s {D}lin {D}cache 4096 4 high_watermark 50 low_watermark 10",
    "snapshot": f"0 1024 snapshot {D}lin {D}cow P 8",
    "origin": f"0 1024 snapshot-origin {D}lin",
    "bad": "0 x linear\n10 10 nosuch a b",
    "crypt_xts": f"0 1024 crypt aes-xts-plain64 {'0123456789abcdef' * 8} 7 {D}lin 0 2 sector_size:4096 iv_large_sectors",
    "crypt_essiv": f"0 1024 crypt capi:cbc(aes)-essiv:sha256 {'00ff' * 8} 0 /dev/mapper/lin 8 1 allow_discards",
    "crypt_null": f"0 1024 crypt cipher_null-ecb - 0 {D}lin 0",
    "verity": f"0 1024 verity 1 {D}lin {D}cache 4096 4096 128 1 sha256 {'ab' * 32} 00ff 2 ignore_zero_blocks check_at_most_once",
    "verity_v0_sha1": f"0 1024 verity 0 /dev/mapper/lin {D}cow 512 1024 1024 0 sha1 {'01' * 20} - 1 ignore_corruption",
    "log_writes": f"0 1024 log-writes {D}lin {D}cow",
}.items():
    put("table", n, t.encode())

for n, (pick, m) in {
    "create_thin": (2, "create_thin 7"),
    "create_snap": (2, "create_snap 8 0"),
    "delete": (2, "delete 7"),
    "trans": (2, "set_transaction_id 0 1"),
    "reserve": (2, "reserve_metadata_snap"),
    "release": (2, "release_metadata_snap"),
    "wc_flush": (4, "flush"),
    "wc_flush_on_suspend": (4, "flush_on_suspend"),
    "wc_cleaner": (4, "cleaner"),
    "wc_clear_stats": (4, "clear_stats"),
    "bad": (0, "@cancel_deferred_remove"),
    "flakey": (1, "corrupt_bio_byte 1 r 0 0"),
    "thin_ls": (2, "thin_ls -o DEV,MAPPED,EXCLUSIVE_BLOCKS --no-headers -m"),
    "thin_delta": (2, "thin_delta --thin1 0 --root2 5 --verbose"),
    "crypt_key_wipe": (5, "key wipe"),
    "crypt_key_set": (5, "key set " + "00" * 32),
    "lw_mark": (6, "mark m1"),
    "lw_bad": (6, "mark"),
    # dm-stats: a create with both features, then the verbs that read it
    "stats_create": (1, "@stats_create - /4 2 precise_timestamps histogram:1,10,100 dmstats aux"),
    "stats_print": (1, "@stats_print 0 0 4"),
    "stats_list": (0, "@stats_list dmstats"),
}.items():
    put("message", n, bytes([pick]) + m.encode())


def control(args, stdin=b""):
    return struct.pack(">I", len(args)) + b"".join(name(a) for a in args) + name(stdin)


for n, c in {
    "ls": control([b"ls"]),
    "status": control([b"status"]),
    "table": control([b"table", b"pool"]),
    "info": control([b"info", b"-c", b"-o", b"name,open"]),
    "create_stdin": control([b"create", b"x"], b"0 8 zero"),
    "message": control([b"message", b"pool", b"0", b"create_thin", b"3"]),
    "suspend_resume": control([b"suspend", b"lin"]) ,
    "resume": control([b"resume", b"lin"]),
    "remove": control([b"remove", b"--force", b"z"]),
    "deps": control([b"deps", b"-o", b"devname"]),
}.items():
    put("control", n, c)

# thin metadata: a few patches (offset, byte) of the base image
for n, patches in {
    "superblock": [(0, 0xff)],
    "node": [(16 * 4096 + 40, 7), (16 * 4096 + 41, 0)],
    "bitmap": [(4096 + 100, 0)],
    "none": [],
}.items():
    put("thin_metadata", n, b"".join(struct.pack("<IB", o, v) for o, v in patches))

# thin delta: the patches' first byte, the thin block to start from (2 bytes),
# the most runs, the choices (bit 0: in the metadata snapshot, bit 1: sides by
# root block, the two bytes after naming them), then patches of the base image
for n, (head, patches) in {
    "all": (struct.pack("<BHBBBB", 0, 0, 255, 0, 0, 0), []),
    "from_1500_three_runs": (struct.pack("<BHBBBB", 0, 1500, 3, 0, 0, 0), []),
    "metadata_snap": (struct.pack("<BHBBBB", 0, 0, 255, 1, 0, 0), []),
    "roots": (struct.pack("<BHBBBB", 0, 0, 255, 2, 20, 30), []),
    "node": (struct.pack("<BHBBBB", 0, 0, 255, 0, 0, 0), [(16 * 4096 + 40, 7), (16 * 4096 + 41, 0)]),
}.items():
    put("thin_delta", n, head + b"".join(struct.pack("<IB", o, v) for o, v in patches))

# era metadata: the same, over the base era image (superblock fields, a tree
# node, an array block)
for n, patches in {
    "none": [],
    "superblock": [(60, 0x7f), (61, 0xff)],
    "block1": [(4096 + 24, 0xff)],
    "block9": [(9 * 4096 + 40, 3), (9 * 4096 + 41, 0)],
}.items():
    put("era_metadata", n, b"".join(struct.pack("<IB", o, v) for o, v in patches))

# LUKS headers: the first byte picks (see fuzz_targets/luks_header.rs); patches
# of the cryptsetup-written LUKS2 and LUKS1 headers, and the LUKS2 JSON area as text
with open(os.path.join(HERE, "seeds", "luks_header", "luks2"), "rb") as f:
    luks2 = f.read()
luks2_json = luks2[4096:16384].rstrip(b"\0")
for n, (mode, patches) in {
    "luks2": (0, []),
    "luks2-hdr-size": (0, [(8 + 5, 0x7f)]),
    "luks2-no-checksum": (4, [(4096 + 2, 0x20)]),
    "luks1": (1, []),
    "luks1-stripes": (1, [(208 + 44, 0xff)]),
}.items():
    put("luks_header", n, bytes([mode]) + b"".join(struct.pack("<IB", o, v) for o, v in patches))
put("luks_header", "luks2-json", bytes([2]) + luks2_json)
put("luks_header", "luks2-json-lying", bytes([2]) + luks2_json.replace(b'"stripes":4000', b'"stripes":4000000'))

# cache metadata: the same, over the base cache images (first byte: bit 1
# picks version 2; even, so the patched blocks are re-sealed)
for n, patches in {
    "none-v1": (0, []),
    "none-v2": (2, []),
    "cache-blocks": (2, [(240, 0xff), (241, 0xff)]),
    "hint-size": (0, [(60, 8)]),
    "block3": (2, [(3 * 4096 + 24, 0xff)]),
    "mapping-flags": (0, [(5 * 4096 + 24, 0x06)]),
}.items():
    first, p = patches
    put("cache_metadata", n, bytes([first]) + b"".join(struct.pack("<IB", o, v) for o, v in p))

# Metadata images: `seeds/*/fresh` are what dmkit wrote on an empty device (see
# README.md); here variants with content are derived from them.
def seeded(target):
    p = os.path.join(HERE, "seeds", target, "fresh")
    with open(p, "rb") as f:
        b = bytearray(f.read())
    put(target, "fresh", bytes(b))
    return b


wc = seeded("writecache_metadata")
struct.pack_into("<Q", wc, 24, 6)  # superblock seq_count
for i, (sector, seq) in enumerate([(0, 1), (8, 2), (0, 3), (16, 5), (24, 9)]):
    struct.pack_into("<QQ", wc, 64 + 16 * i, sector, seq)  # the last is uncommitted
put("writecache_metadata", "entries", bytes(wc))
struct.pack_into("<QQ", wc, 64 + 16, 0, 3)  # two committed entries with one seq
put("writecache_metadata", "duplicate_seq", bytes(wc))

sn = seeded("snapshot_store")
for i in range(5):
    struct.pack_into("<QQ", sn, 4096 + 16 * i, 10 + i, 2 + i)
put("snapshot_store", "exceptions", bytes(sn))
struct.pack_into("<QQ", sn, 4096 + 16 * 5, 12, 1)  # an exception pointing at the area
put("snapshot_store", "bad_exception", bytes(sn))


# dm ioctl door (fuzz_targets/dm_ioctl.rs): request ^ DM_VERSION's number, then
# the dm_ioctl buffer as libdevmapper lays it out (x86-64, little-endian)
DM_REQ = 0xC138FD00


def dm(cmd, name=b"", uuid=b"", flags=0, data=b"", size=1024, count=0, start=312, event_nr=0, dev=0):
    size = max(size, 312 + len(data))
    h = struct.pack("<3IIIIiIIIQ128s129s7s", 4, 0, 0, size, start, count, 0, flags, event_nr, 0, dev,
                    name, uuid, b"")
    assert len(h) == 312
    b = h + data
    return struct.pack("<I", (DM_REQ | cmd) ^ DM_REQ) + b + b"\0" * (size - len(b))


def spec(start, length, ty, params):
    p = params + b"\0"
    p += b"\0" * ((-(40 + len(p))) % 8)
    return struct.pack("<QQiI16s", start, length, 0, 40 + len(p), ty) + p


def msg(sector, text):
    return struct.pack("<Q", sector) + text + b"\0"


put("dm_ioctl", "version", dm(0))
put("dm_ioctl", "list_devices_uuid", dm(2, flags=1 << 14))
put("dm_ioctl", "list_small", dm(2, size=320))
put("dm_ioctl", "create", dm(3, b"fz", b"UUID-FZ"))
put("dm_ioctl", "load_zero", dm(9, b"fz", data=spec(0, 64, b"zero", b""), count=1))
put("dm_ioctl", "load_two", dm(9, b"z", data=spec(0, 8, b"zero", b"") + spec(8, 8, b"error", b""), count=2))
put("dm_ioctl", "load_linear", dm(9, b"fz", data=spec(0, 8, b"linear", b"/dev/mapper/z 0"), count=1))
put("dm_ioctl", "suspend", dm(6, b"z", flags=(1 << 1) | (1 << 11)))
put("dm_ioctl", "resume", dm(6, b"z"))
put("dm_ioctl", "status", dm(7, b"lin"))
put("dm_ioctl", "status_by_dev", dm(7, dev=0xFD00))
put("dm_ioctl", "wait", dm(8, b"z", event_nr=5))
put("dm_ioctl", "clear", dm(10, b"z"))
put("dm_ioctl", "deps", dm(11, b"thin", flags=1 << 12))
put("dm_ioctl", "table", dm(12, b"pool", flags=1 << 4))
put("dm_ioctl", "table_status", dm(12, b"pool"))
put("dm_ioctl", "versions", dm(13))
put("dm_ioctl", "message", dm(14, b"pool", data=msg(0, b"create_thin 9")))
put("dm_ioctl", "rename", dm(5, b"fz", data=b"fz2\0"))
put("dm_ioctl", "set_uuid", dm(5, b"z", flags=1 << 14, data=b"U-Z\0"))
put("dm_ioctl", "geometry", dm(15, b"z", data=b"100 16 63 0\0"))
put("dm_ioctl", "target_version", dm(17, b"linear"))
put("dm_ioctl", "remove", dm(4, b"fz", flags=1 << 17))
put("dm_ioctl", "remove_all", dm(1))


def header_only(seed):
    """The seed with bit 16 of its request number set: the target then carries
    the header alone of a buffer twice as long, as the door's library does for
    a command that reads no data."""
    r = struct.unpack("<I", seed[:4])[0] | (1 << 16)
    return struct.pack("<I", r) + seed[4:]


put("dm_ioctl", "status_table_header_only", header_only(dm(12, b"pool", flags=1 << 4, size=16384)))
put("dm_ioctl", "list_header_only", header_only(dm(2, flags=1 << 14, size=16384)))
put("dm_ioctl", "deps_header_only", header_only(dm(11, b"thin", size=16384)))
put("dm_ioctl", "load_header_only", header_only(dm(9, b"fz", data=spec(0, 64, b"zero", b""), count=1)))

# the XML readers: a byte choosing thin (0), cache (1) or era (2), then the text
put("metadata_xml", "thin", b"\x00" + b'<superblock uuid="" time="1" transaction="2" flags="0" version="2" '
    b'data_block_size="128" nr_data_blocks="100">\n  <device dev_id="0" mapped_blocks="2" transaction="0" '
    b'creation_time="0" snap_time="0">\n    <range_mapping origin_begin="0" data_begin="0" length="2" time="0"/>\n'
    b'  </device>\n</superblock>\n')
put("metadata_xml", "cache", b"\x01" + b'<superblock uuid="" block_size="128" nr_cache_blocks="16" policy="smq" '
    b'hint_width="4">\n  <mappings>\n    <mapping cache_block="0" origin_block="3" dirty="true"/>\n  </mappings>\n'
    b'</superblock>\n')
put("metadata_xml", "era", b"\x02" + b'<superblock uuid="" block_size="128" nr_blocks="64" current_era="3">\n'
    b'  <writeset era="2" nr_bits="64">\n    <bit block="1" value="true"/>\n  </writeset>\n'
    b'  <era_array>\n    <era block="0" era="1"/>\n  </era_array>\n</superblock>\n')
# a verity superblock as veritysetup writes it (sha256, 4 KiB blocks, 2048 data blocks)
sb = (b"verity\x00\x00" + struct.pack("<II", 1, 1) + bytes(16) + b"sha256".ljust(32, b"\x00")
      + struct.pack("<IIQH", 4096, 4096, 2048, 4) + bytes(6) + b"\x01\x23\xab\xcd".ljust(256, b"\x00"))
put("verity_superblock", "sha256", sb.ljust(512, b"\x00"))
# a restart log: a header of another boot's (nothing), and garbage
put("restart_log", "header", b"DMKRLOG1" + bytes(120) + bytes(48 * 4))
put("restart_log", "short", b"DMKRLOG1")

# the door's frames as its C library sends them: DM_VERSION with the header
# alone carried, then DM_LIST_DEVICES, then a table load of a zero device
def frame(request, buf, length=None, carried=None, cwd=b""):
    length = len(buf) if length is None else length
    carried = len(buf) if carried is None else carried
    return struct.pack("<IIII", request, length, carried, len(cwd)) + buf[:carried] + cwd

hdr = struct.pack("<III", 4, 0, 0) + struct.pack("<I", 16384) + struct.pack("<I", 312) + bytes(292)
put("door_frames", "version_list", frame(0xc138fd00, hdr, 16384, 312) + frame(0xc138fd02, hdr, 16384, 312))
put("door_frames", "garbage", b"\xfd" * 7)
