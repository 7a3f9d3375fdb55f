//! Thin volumes under a real filesystem and under crashes.
//!
//! - ext4 on a thin volume through nbdfuse and a loop device: a snapshot taken
//!   with the filesystem frozen and the origin suspended keeps the files as they
//!   were while the origin changes; both pass `e2fsck -fn`.
//! - fstrim on the mounted origin gives data blocks back to the pool (discards
//!   pass through loop → FUSE punch hole → NBD TRIM → thin), except the blocks a
//!   snapshot still shares; deleting the snapshot gives those back.
//! - SIGKILL of the daemon at seeded random moments under a pipelined raw-NBD
//!   write load with periodic flushes: after a restart every write acknowledged
//!   before the last completed flush reads back, every 4 KiB block holds one of
//!   the versions it may hold (never another block's data, never a torn block),
//!   snapshots are intact, and the metadata passes `thin_check`.
//!
//! Every test leaves metadata that passes `thin_check` once the daemon stopped.

use crate::common;

use common::fs::{check_files, cmd, must, run_t, write_files, Attach, FileSet, FS_TOOLS};
use common::nbd::Client;
use common::{need_all, pattern, Daemon, Scratch};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::MIB;
/// Pool data block: 64 KiB.
const POOL_BLOCK_SECTORS: u64 = 128;
const POOL_BLOCK_BYTES: u64 = POOL_BLOCK_SECTORS * 512;

// ---------------------------------------------------------------------------
// Small helpers

const THIN_CHECK_PROGRESS: [&str; 4] = [
    "examining superblock",
    "examining devices tree",
    "examining mapping tree",
    "checking space map counts",
];

/// The real thin_check must pass on `meta` with no complaint (progress lines aside).
fn assert_thin_check(meta: &Path, when: &str) {
    let (ok, so, se) = run_t(&mut cmd("thin_check", &[meta.to_str().unwrap()]), 60);
    let complaints: Vec<&str> = se
        .lines()
        .filter(|l| !THIN_CHECK_PROGRESS.contains(&l.trim()) && !l.trim().is_empty())
        .collect();
    assert!(
        ok && complaints.is_empty() && so.contains("TRANSACTION_ID="),
        "thin_check {when} failed:\nstdout:\n{so}\nstderr:\n{se}"
    );
}

/// Used data blocks of the pool (status field 5: `<used>/<total>`).
fn used_data(d: &Daemon) -> u64 {
    let s = d.ok(&["status", "pool"]);
    let f: Vec<&str> = s.split_whitespace().collect();
    assert_eq!(f.get(2), Some(&"thin-pool"), "status: {s}");
    f[5].split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|_| panic!("status: {s}"))
}

fn pool_table(meta: &Path, data: &Path, data_bytes: u64) -> String {
    format!(
        "0 {} thin-pool {} {} {POOL_BLOCK_SECTORS} 0",
        data_bytes / 512,
        meta.display(),
        data.display()
    )
}

fn thin_table(sectors: u64, id: u64) -> String {
    format!("0 {sectors} thin /dev/mapper/pool {id}")
}

/// Snapshot `origin_id` (active as device `origin`) as `snap_id` the safe way:
/// no client I/O may be held by the suspend, so a mounted filesystem is frozen
/// first (`freeze`), the origin suspended, the snapshot created, then everything
/// resumed. Nothing in between panics, so nothing is left frozen or suspended.
fn snapshot(d: &Daemon, origin: &str, origin_id: u64, snap_id: u64, freeze: Option<&Path>) {
    let fz = freeze.map(|m| run_t(&mut cmd("fsfreeze", &["-f", m.to_str().unwrap()]), 30));
    let s = d.cli(&["suspend", origin]);
    let (sid, oid) = (snap_id.to_string(), origin_id.to_string());
    let m = d.cli(&["message", "pool", "0", "create_snap", &sid, &oid]);
    let r = d.cli(&["resume", origin]);
    let th = freeze.map(|m| run_t(&mut cmd("fsfreeze", &["-u", m.to_str().unwrap()]), 30));
    if let Some((ok, _, e)) = fz {
        assert!(ok, "fsfreeze -f: {e}");
    }
    for (what, o) in [("suspend", s), ("create_snap", m), ("resume", r)] {
        assert!(
            o.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    if let Some((ok, _, e)) = th {
        assert!(ok, "fsfreeze -u: {e}");
    }
}

/// Seeded choices (failing seeds replay): dmkit's generator.
struct Rng(dmkit::rng::XorShift);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(dmkit::rng::XorShift::seeded(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }
}

/// A pool on new files in `files` (which outlive the daemon), with thin 0 created.
fn start_pool(d: &Daemon, files: &Scratch, meta_mib: u64, data_mib: u64) -> (PathBuf, PathBuf) {
    let meta = files.sparse("meta", meta_mib * MIB);
    let data = files.sparse("data", data_mib * MIB);
    d.create("pool", &pool_table(&meta, &data, data_mib * MIB));
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    (meta, data)
}

// ---------------------------------------------------------------------------
// 1. ext4 + snapshot

#[test]
fn ext4_snapshot_keeps_files_while_origin_changes() {
    need_all(FS_TOOLS);
    need_all(&["fsfreeze", "thin_check"]);
    let t0 = Instant::now();
    let files = Scratch::new("thinfs-snap-files");
    let d = Daemon::start("thinfs-snap");
    let (meta, _data) = start_pool(&d, &files, 16, 512);
    let thin_sectors = 256 * MIB / 512;
    d.create("thin0", &thin_table(thin_sectors, 0));
    let base = d.dir.path("attach");

    // Originals: a few MiB of files of assorted sizes, some in a subdirectory.
    let originals: FileSet = (0..14u64)
        .map(|i| {
            let len = [4096, 1, 65536 + 17, 300_000, MIB as usize, 1536 * 1024][i as usize % 6];
            let name = if i % 3 == 0 {
                format!("dir/sub{i}/f{i}")
            } else {
                format!("f{i}")
            };
            (name, 1000 + i, len)
        })
        .collect();
    let total: usize = originals.iter().map(|f| f.2).sum();
    assert!(total > 4 * MIB as usize);

    {
        let mut origin = Attach::new(&d, &base, "thin0", false);
        must(&mut cmd("mkfs.ext4", &["-q", "-F", origin.dev()]), 60);
        origin.mount("rw");
        write_files(&origin.mnt, &originals);
        origin.sync();

        snapshot(&d, "thin0", 0, 1, Some(&origin.mnt));

        // Change the origin: delete, overwrite in place, truncate, create.
        let mut changed = originals.clone();
        for (i, f) in changed.iter_mut().enumerate() {
            let p = origin.mnt.join(&f.0);
            match i % 4 {
                0 => {
                    std::fs::remove_file(&p).unwrap();
                    f.2 = usize::MAX; // deleted
                }
                1 => {
                    f.1 += 500; // rewritten whole
                    std::fs::write(&p, pattern(f.1, f.2)).unwrap();
                }
                2 => {
                    // overwrite 4 KiB in the middle without truncating
                    use std::os::unix::fs::FileExt;
                    let fh = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                    let at = (f.2 / 2) as u64;
                    fh.write_all_at(&[0xEE; 4096], at).unwrap();
                    f.1 = u64::MAX; // checked below by hand
                }
                _ => {}
            }
        }
        let new_files: FileSet = (0..6u64)
            .map(|i| (format!("new/n{i}"), 2000 + i, (i as usize + 1) * 200_000))
            .collect();
        write_files(&origin.mnt, &new_files);
        origin.sync();

        // The snapshot, through its own nbdfuse and loop device, read-only.
        d.create("snap1", &thin_table(thin_sectors, 1));
        let mut snap = Attach::new(&d, &base, "snap1", true);
        snap.fsck();
        snap.mount("ro,noload");
        check_files(&snap.mnt, &originals, "snapshot");
        assert!(
            !snap.mnt.join("new").exists(),
            "files created on the origin after the snapshot appear in it"
        );
        snap.umount();
        drop(snap);

        // The origin, re-attached from scratch (no cached pages), holds the changes.
        origin.umount();
        drop(origin);
        let mut origin = Attach::new(&d, &base, "thin0", false);
        origin.fsck();
        origin.mount("ro,noload");
        let kept: FileSet = changed
            .iter()
            .filter(|f| f.2 != usize::MAX && f.1 != u64::MAX)
            .cloned()
            .collect();
        check_files(&origin.mnt, &kept, "origin");
        check_files(&origin.mnt, &new_files, "origin new files");
        for (c, o) in changed.iter().zip(&originals) {
            let p = origin.mnt.join(&c.0);
            if c.2 == usize::MAX {
                assert!(!p.exists(), "deleted {} still on the origin", c.0);
            } else if c.1 == u64::MAX {
                let mut want = pattern(o.1, o.2);
                let at = o.2 / 2;
                let end = (at + 4096).max(o.2);
                want.resize(end, 0);
                want[at..at + 4096].fill(0xEE);
                assert!(std::fs::read(&p).unwrap() == want, "origin: {} patch lost", c.0);
            }
        }
        origin.umount();
    }
    d.ok(&["remove", "snap1"]);
    d.ok(&["remove", "thin0"]);
    d.ok(&["remove", "pool"]);
    drop(d); // SIGTERM: the daemon's final commit
    assert_thin_check(&meta, "after the ext4 snapshot test");
    eprintln!("ext4 snapshot test: {:.1} s", t0.elapsed().as_secs_f64());
}

// ---------------------------------------------------------------------------
// 2. fstrim

/// Bytes of the file actually allocated.
fn allocated(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().blocks() * 512
}

#[test]
fn fstrim_returns_unshared_blocks_and_snapshot_delete_the_rest() {
    need_all(FS_TOOLS);
    need_all(&["fsfreeze", "fstrim", "thin_check"]);
    let t0 = Instant::now();
    let files = Scratch::new("thinfs-trim-files");
    let d = Daemon::start("thinfs-trim");
    let (meta, data) = start_pool(&d, &files, 16, 512);
    let thin_sectors = 256 * MIB / 512;
    d.create("thin0", &thin_table(thin_sectors, 0));
    let base = d.dir.path("attach");
    let blocks_of = |bytes: u64| bytes / POOL_BLOCK_BYTES;

    let a_files: FileSet = (0..12u64)
        .map(|i| (format!("a/a{i}"), 3000 + i, 2 * MIB as usize))
        .collect();
    let b_files: FileSet = (0..8u64)
        .map(|i| (format!("b/b{i}"), 4000 + i, MIB as usize))
        .collect();
    let c_files: FileSet = (0..8u64)
        .map(|i| (format!("c/c{i}"), 5000 + i, 2 * MIB as usize))
        .collect();
    let (used0, used1, used2, used3, alloc1, alloc2, trimmed);
    {
        let mut fs = Attach::new(&d, &base, "thin0", false);
        must(&mut cmd("mkfs.ext4", &["-q", "-F", fs.dev()]), 60);
        fs.mount("rw");
        write_files(&fs.mnt, &a_files);
        fs.sync();
        used0 = used_data(&d);
        assert!(
            used0 >= blocks_of(24 * MIB),
            "24 MiB written, {used0} blocks used"
        );

        // The snapshot shares everything written so far.
        snapshot(&d, "thin0", 0, 1, Some(&fs.mnt));
        write_files(&fs.mnt, &b_files);
        fs.sync();
        used1 = used_data(&d);
        alloc1 = allocated(&data);
        assert!(
            used1 >= used0 + blocks_of(8 * MIB),
            "8 MiB more written: {used0} → {used1} blocks"
        );

        // Delete all but a0 and b0, then trim the free space.
        for f in a_files.iter().skip(1).chain(b_files.iter().skip(1)) {
            std::fs::remove_file(fs.mnt.join(&f.0)).unwrap();
        }
        fs.sync();
        let out = must(&mut cmd("fstrim", &["-v", fs.mnt.to_str().unwrap()]), 120);
        trimmed = out
            .split('(')
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("fstrim -v said: {out}"));
        assert!(trimmed >= 30 * MIB, "fstrim trimmed only {trimmed} bytes: {out}");
        used2 = used_data(&d);
        alloc2 = allocated(&data);
        // b1..b7 (7 MiB, unshared) come back; a1..a11 stay: the snapshot holds them.
        assert!(
            used1 - used2.min(used1) >= blocks_of(7 * MIB) * 9 / 10,
            "fstrim gave back too little: {used1} → {used2} blocks (trimmed {trimmed} bytes)"
        );
        assert!(
            used2 >= used0,
            "blocks shared with the snapshot were freed: {used0} at snapshot, {used2} now"
        );
        // Passdown: the freed blocks were punched out of the data file.
        assert!(
            alloc1 - alloc2.min(alloc1) >= 7 * MIB * 9 / 10,
            "data file allocation {alloc1} → {alloc2}: discards not passed down"
        );

        // Deleting the snapshot frees what only it still held (a1..a11).
        d.ok(&["message", "pool", "0", "delete", "1"]);
        used3 = used_data(&d);
        assert!(
            used2 - used3.min(used2) >= blocks_of(22 * MIB) * 9 / 10,
            "deleting the snapshot gave back too little: {used2} → {used3} blocks"
        );

        // Reuse the freed space, then check everything from a fresh attachment.
        write_files(&fs.mnt, &c_files);
        fs.sync();
        fs.umount();
        drop(fs);
        let mut fs = Attach::new(&d, &base, "thin0", false);
        fs.fsck();
        fs.mount("ro,noload");
        check_files(&fs.mnt, &a_files[..1].to_vec(), "a0");
        check_files(&fs.mnt, &b_files[..1].to_vec(), "b0");
        check_files(&fs.mnt, &c_files, "c files");
        for f in a_files.iter().skip(1).chain(b_files.iter().skip(1)) {
            assert!(!fs.mnt.join(&f.0).exists(), "{} came back", f.0);
        }
        fs.umount();
    }
    eprintln!(
        "fstrim: used blocks {used0} → snapshot + 8 MiB {used1} → fstrim {used2} → delete snap {used3}; \
         trimmed {trimmed} bytes; data file allocated {alloc1} → {alloc2}"
    );
    d.ok(&["remove", "thin0"]);
    d.ok(&["remove", "pool"]);
    drop(d);
    assert_thin_check(&meta, "after the fstrim test");
    eprintln!("fstrim test: {:.1} s", t0.elapsed().as_secs_f64());
}

// ---------------------------------------------------------------------------
// 3. SIGKILL under a write load with flushes

const BLK: u64 = 4096;
/// 4 KiB blocks written before the first snapshot (16 MiB): writes to them
/// break sharing with the snapshot taken at the start of each round.
const PRE: usize = 4096;
/// Never-written 4 KiB blocks each round gets (8 MiB): writes provision.
const FRESH: usize = 2048;
const ROUNDS: usize = 3;
const NBLK: usize = PRE + ROUNDS * FRESH;
const DEPTH: usize = 8;
const FLUSH_EVERY: u32 = 16;
const MAGIC: &[u8; 8] = b"DMKCRASH";

/// What a 4 KiB block holds: zeroes, or the unique write `seq`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum C {
    Zero,
    V(u64),
}

/// The content write `seq` puts in block `b`: a header naming both, then a
/// pattern of them — a block from elsewhere, a torn or a stale block is told apart.
fn block_bytes(b: usize, seq: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(BLK as usize);
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&(b as u64).to_le_bytes());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&pattern(
        seq.wrapping_mul(1_000_003) ^ b as u64,
        BLK as usize - 24,
    ));
    v
}

fn identify(b: usize, buf: &[u8]) -> Result<C, String> {
    if buf.iter().all(|&x| x == 0) {
        return Ok(C::Zero);
    }
    if &buf[0..8] != MAGIC {
        return Err(format!("block {b}: garbage (no header): {:02x?}", &buf[0..24]));
    }
    let owner = u64::from_le_bytes(buf[8..16].try_into().unwrap()) as usize;
    let seq = u64::from_le_bytes(buf[16..24].try_into().unwrap());
    if owner != b {
        return Err(format!("block {b}: holds block {owner}'s data (write {seq})"));
    }
    if buf != block_bytes(b, seq).as_slice() {
        return Err(format!("block {b}: write {seq} is torn or corrupt"));
    }
    Ok(C::V(seq))
}

fn request(cmd: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(28 + payload.len());
    r.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&cmd.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    r.extend_from_slice(payload);
    r
}

enum Pending {
    Write(usize),
    Trim(usize),
    /// The acknowledged counts when the flush was sent.
    Flush(Vec<u32>),
}

/// The record of one round's load. For block `b`, `hist[b][0]` is its content
/// at the start and `hist[b][1..]` the writes sent to it in order (TRIM of a
/// 64 KiB block counts as a zero write to each of its 4 KiB blocks); there is
/// never more than one in flight per block, so they land in that order.
/// `acked[b]` entries of `hist[b]` are acknowledged, `durable[b]` were acknowledged
/// before a flush that completed was sent: after a crash the block must hold
/// `hist[b][durable[b] - 1]` or something written later.
struct Load {
    hist: Vec<Vec<C>>,
    acked: Vec<u32>,
    durable: Vec<u32>,
    writes: u64,
    trims: u64,
    flushes: u64,
    error: Option<String>,
    ended: String,
}

fn run_load(mut c: Client, start: &[C], round: usize, seed: u64) -> Load {
    let mut l = Load {
        hist: start.iter().map(|&x| vec![x]).collect(),
        acked: vec![1; NBLK],
        durable: vec![1; NBLK],
        writes: 0,
        trims: 0,
        flushes: 0,
        error: None,
        ended: String::new(),
    };
    let mut rng = Rng::new(seed);
    let mut busy = vec![false; NBLK];
    let mut inflight: HashMap<u64, Pending> = HashMap::new();
    let mut cookie = 1u64;
    let mut seq = ((round as u64) + 1) << 40;
    let mut since_flush = 0;
    let fresh0 = PRE + round * FRESH;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        while inflight.len() < DEPTH {
            let (bytes, p) = if since_flush >= FLUSH_EVERY {
                since_flush = 0;
                (
                    request(common::nbd::FLUSH, cookie, 0, 0, &[]),
                    Pending::Flush(l.acked.clone()),
                )
            } else if rng.below(32) == 0 {
                // TRIM a whole 64 KiB pool block among the written ones.
                let b0 = rng.below((PRE / 16) as u64) as usize * 16;
                if (b0..b0 + 16).any(|b| busy[b]) {
                    break;
                }
                for (bz, h) in busy[b0..b0 + 16].iter_mut().zip(&mut l.hist[b0..b0 + 16]) {
                    *bz = true;
                    h.push(C::Zero);
                }
                since_flush += 1;
                (
                    request(
                        common::nbd::TRIM,
                        cookie,
                        b0 as u64 * BLK,
                        POOL_BLOCK_BYTES as u32,
                        &[],
                    ),
                    Pending::Trim(b0),
                )
            } else {
                // Half to shared (or once shared) blocks, half to unprovisioned ones.
                let pick = (0..16)
                    .map(|_| {
                        if rng.below(2) == 0 {
                            rng.below(PRE as u64) as usize
                        } else {
                            fresh0 + rng.below(FRESH as u64) as usize
                        }
                    })
                    .find(|&b| !busy[b]);
                let Some(b) = pick else { break };
                seq += 1;
                busy[b] = true;
                l.hist[b].push(C::V(seq));
                since_flush += 1;
                (
                    request(
                        common::nbd::WRITE,
                        cookie,
                        b as u64 * BLK,
                        BLK as u32,
                        &block_bytes(b, seq),
                    ),
                    Pending::Write(b),
                )
            };
            inflight.insert(cookie, p);
            cookie += 1;
            if let Err(e) = c.s.write_all(&bytes) {
                l.ended = format!("send: {e}");
                return l;
            }
        }
        let mut h = [0u8; 16];
        if let Err(e) = c.s.read_exact(&mut h) {
            l.ended = format!("reply: {e}");
            return l;
        }
        if u32::from_be_bytes(h[0..4].try_into().unwrap()) != 0x6744_6698 {
            l.error = Some(format!("bad reply magic {:02x?}", &h[0..4]));
            return l;
        }
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let ck = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let Some(p) = inflight.remove(&ck) else {
            l.error = Some(format!("reply for unknown cookie {ck}"));
            return l;
        };
        if err != 0 {
            let what = match p {
                Pending::Write(b) => format!("write to block {b}"),
                Pending::Trim(b) => format!("trim at block {b}"),
                Pending::Flush(_) => "flush".into(),
            };
            l.error = Some(format!("{what} failed with error {err}"));
            return l;
        }
        match p {
            Pending::Write(b) => {
                l.acked[b] += 1;
                busy[b] = false;
                l.writes += 1;
            }
            Pending::Trim(b0) => {
                for (a, bz) in l.acked[b0..b0 + 16].iter_mut().zip(&mut busy[b0..b0 + 16]) {
                    *a += 1;
                    *bz = false;
                }
                l.trims += 1;
            }
            Pending::Flush(snap) => {
                for (d, s) in l.durable.iter_mut().zip(&snap) {
                    *d = (*d).max(*s);
                }
                l.flushes += 1;
            }
        }
        if Instant::now() > deadline {
            l.ended = "deadline (the daemon was not killed)".into();
            return l;
        }
    }
}

/// Read blocks `0..NBLK` of `export`.
fn read_all(d: &Daemon, export: &str) -> Vec<Vec<u8>> {
    let mut c = Client::connect(&d.sock(), export);
    let per = (MIB / BLK) as usize;
    let mut out = Vec::with_capacity(NBLK);
    for first in (0..NBLK).step_by(per) {
        let n = per.min(NBLK - first);
        let buf = c.read(first as u64 * BLK, n * BLK as usize);
        out.extend(buf.chunks(BLK as usize).map(|b| b.to_vec()));
    }
    out
}

/// The pool, thin 0 and the snapshots `1..=snaps`, on existing files.
fn activate(d: &Daemon, meta: &Path, data: &Path, data_bytes: u64, snaps: usize) {
    d.create("pool", &pool_table(meta, data, data_bytes));
    let sectors = 64 * MIB / 512;
    d.create("thin0", &thin_table(sectors, 0));
    for s in 1..=snaps {
        d.create(&format!("snap{s}"), &thin_table(sectors, s as u64));
    }
}

#[test]
fn sigkill_under_write_load_keeps_flushed_writes() {
    need_all(&["thin_check"]);
    let seed: u64 = std::env::var("DMKIT_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x7417_C4A5);
    eprintln!("crash seed {seed} (DMKIT_CRASH_SEED replays)");
    let t0 = Instant::now();
    let mut rng = Rng::new(seed);
    let files = Scratch::new("thinfs-crash-files");
    let data_bytes = 256 * MIB;
    let meta = files.sparse("meta", 16 * MIB);
    let data = files.sparse("data", data_bytes);
    let mut d = Daemon::start("thinfs-crash");
    d.create("pool", &pool_table(&meta, &data, data_bytes));
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create("thin0", &thin_table(64 * MIB / 512, 0));

    // Write the first 16 MiB (every block its own write number), flush.
    let mut contents = vec![C::Zero; NBLK];
    {
        let mut c = Client::connect(&d.sock(), "thin0");
        let per = (MIB / BLK) as usize;
        for first in (0..PRE).step_by(per) {
            let mut buf = Vec::with_capacity(MIB as usize);
            for (b, c) in contents.iter_mut().enumerate().skip(first).take(per) {
                buf.extend(block_bytes(b, b as u64 + 1));
                *c = C::V(b as u64 + 1);
            }
            c.write(first as u64 * BLK, &buf);
        }
        assert_eq!(c.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    }

    let mut snaps: Vec<Vec<C>> = Vec::new();
    for round in 0..ROUNDS {
        // A new snapshot each round: its blocks are shared again.
        snapshot(&d, "thin0", 0, round as u64 + 1, None);
        snaps.push(contents.clone());

        let c = Client::connect(&d.sock(), "thin0");
        let start = contents.clone();
        let lseed = rng.next();
        let load = std::thread::spawn(move || run_load(c, &start, round, lseed));
        let delay = Duration::from_millis(300 + rng.below(1200));
        std::thread::sleep(delay);
        d.kill9();
        let tk = Instant::now();
        let l = load.join().expect("load thread");
        assert!(
            l.error.is_none(),
            "round {round}: {}\n{}",
            l.error.unwrap(),
            d.log()
        );
        assert!(
            l.writes >= 50 && l.flushes >= 2,
            "round {round}: load too small to mean anything ({} writes, {} flushes; ended: {})",
            l.writes,
            l.flushes,
            l.ended
        );
        // What the killed daemon left on disk is a committed transaction.
        assert_thin_check(&meta, &format!("after SIGKILL in round {round}"));
        let t_check = tk.elapsed();

        d = Daemon::start("thinfs-crash");
        activate(&d, &meta, &data, data_bytes, round + 1);
        let t_restart = tk.elapsed();
        let got = read_all(&d, "thin0");
        let (mut newer, mut at_durable, mut sent_unacked) = (0, 0, 0);
        for b in 0..NBLK {
            let c = identify(b, &got[b]).unwrap_or_else(|e| panic!("round {round}: thin0 {e}"));
            let h = &l.hist[b];
            let from = l.durable[b] as usize - 1;
            let Some(i) = h[from..].iter().position(|&x| x == c) else {
                panic!(
                    "round {round}: block {b} holds {c:?}, but after the last completed flush it must \
                     hold {:?} or a later write of {:?} (acked {} of {})",
                    h[from],
                    &h[from + 1..],
                    l.acked[b],
                    h.len()
                );
            };
            if i > 0 {
                newer += 1;
            } else if h.len() > 1 {
                at_durable += 1;
            }
            if from + i >= l.acked[b] as usize {
                sent_unacked += 1;
            }
            contents[b] = c;
        }
        for (i, want) in snaps.iter().enumerate() {
            let name = format!("snap{}", i + 1);
            let got = read_all(&d, &name);
            for b in 0..NBLK {
                let c = identify(b, &got[b]).unwrap_or_else(|e| panic!("round {round}: {name} {e}"));
                assert_eq!(c, want[b], "round {round}: {name} block {b} changed");
            }
            d.ok(&["remove", &name]);
        }
        eprintln!(
            "round {round}: killed after {} ms: {} writes, {} trims, {} flushes acked; \
             written blocks at their flushed version {at_durable}, later {newer} ({sent_unacked} unacknowledged); \
             thin_check done {:.1} s, restarted {:.1} s, verified {:.1} s after the kill",
            delay.as_millis(),
            l.writes,
            l.trims,
            l.flushes,
            t_check.as_secs_f64(),
            t_restart.as_secs_f64(),
            tk.elapsed().as_secs_f64()
        );
    }
    d.ok(&["remove", "thin0"]);
    d.ok(&["remove", "pool"]);
    drop(d);
    assert_thin_check(&meta, "at the end");
    eprintln!("crash test: {:.1} s", t0.elapsed().as_secs_f64());
}
