//! The snapshot family through the real daemon and NBD: copy-on-write against a
//! model, full COW stores, merging (with I/O during it, and across a SIGKILL),
//! persistence across restarts, table and status lines, and error texts.

use crate::common;

use common::nbd::{Client, FLUSH, READ, TRIM, WRITE};
use common::{
    accept, assert_same, pattern, read_all, read_at, settle, write_until_killed, Daemon, Rng, Scratch,
};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::MIB;
const EIO: u32 = 5;

fn write_file(p: &Path, off: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(p).expect("open");
    f.write_all_at(data, off).expect("write");
}

fn status(d: &Daemon, name: &str) -> String {
    d.ok(&["status", name]).trim().to_string()
}

/// The `<allocated>/<total> <metadata>` figures of a snapshot's status.
fn usage(d: &Daemon, name: &str) -> (u64, u64, u64) {
    let s = status(d, name);
    let f: Vec<&str> = s.split_whitespace().collect();
    let (a, t) = f[3].split_once('/').unwrap_or_else(|| panic!("status: {s}"));
    (a.parse().unwrap(), t.parse().unwrap(), f[4].parse().unwrap())
}

/// Wait (at most a minute) until the merge of `name` is done: allocated has
/// fallen to the metadata size.
fn wait_merged(d: &Daemon, name: &str) {
    let t0 = Instant::now();
    loop {
        let (alloc, _, meta) = usage(d, name);
        if alloc == meta {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "merge did not finish: {}",
            status(d, name)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A scratch origin file of `size` bytes filled with a pattern.
fn origin_file(s: &Scratch, size: u64, seed: u64) -> PathBuf {
    let p = s.sparse("origin", size);
    write_file(&p, 0, &pattern(seed, size as usize));
    p
}

/// Writes to the origin and to two snapshots of different chunk sizes,
/// interleaved, some pipelined, of partial and whole chunks, checked against a
/// model of every device; then the same after a SIGKILL following flushes.
#[test]
fn pattern_stomp_origin_and_two_snapshots() {
    const SIZE: u64 = 16 * MIB;
    let s = Scratch::new("snap-stomp");
    let origin = origin_file(&s, SIZE, 1);
    let cow1 = s.sparse("cow1", 8 * MIB);
    let cow2 = s.sparse("cow2", 8 * MIB);
    let cow3 = s.sparse("cow3", 8 * MIB);
    let sectors = SIZE / 512;
    let tables = [
        ("lv", format!("0 {sectors} snapshot-origin {}", origin.display())),
        (
            "s1",
            format!("0 {sectors} snapshot {} {} P 8", origin.display(), cow1.display()),
        ),
        (
            "s2",
            format!(
                "0 {sectors} snapshot {} {} P 64",
                origin.display(),
                cow2.display()
            ),
        ),
    ];
    let mut d = Daemon::start("snap-stomp");
    for (n, t) in &tables {
        d.create(n, t);
    }
    // a transient one too, checked while the daemon runs
    d.create(
        "s3",
        &format!(
            "0 {sectors} snapshot {} {} N 16",
            origin.display(),
            cow3.display()
        ),
    );
    let names = ["lv", "s1", "s2", "s3"];
    let mut models: Vec<Vec<u8>> = vec![pattern(1, SIZE as usize); 4];
    let mut conns: Vec<Client> = names.iter().map(|n| Client::connect(&d.sock(), n)).collect();
    let mut rng = Rng(0x5eed);
    // writes land in the first 4 MiB, so chunks are written many times over
    let region = 4 * MIB / 512;
    for round in 0..60 {
        // a batch of up to 8 writes per device, sent before any reply is read;
        // within one device they do not overlap
        let mut sent: Vec<(usize, u64, Vec<u8>)> = Vec::new();
        for dev in 0..4 {
            let n = rng.below(8);
            let mut taken: Vec<(u64, u64)> = Vec::new();
            for _ in 0..n {
                let len = match rng.below(4) {
                    0 => 512,
                    1 => 4096,
                    2 => 32768,
                    _ => 512 * (1 + rng.below(128)),
                };
                let off = rng.below(region - len / 512) * 512;
                if taken.iter().any(|&(a, l)| off < a + l && a < off + len) {
                    continue;
                }
                taken.push((off, len));
                let data = pattern(round * 1000 + dev as u64 * 100 + taken.len() as u64, len as usize);
                sent.push((dev, off, data));
            }
        }
        for (i, (dev, off, data)) in sent.iter().enumerate() {
            conns[*dev].send(WRITE, 0, i as u64, *off, data.len() as u32, data);
        }
        for (dev, c) in conns.iter_mut().enumerate() {
            for _ in sent.iter().filter(|w| w.0 == dev) {
                let (_, err) = c.reply(None);
                assert_eq!(err, 0, "round {round}: write to {} failed", names[dev]);
            }
        }
        for (dev, off, data) in &sent {
            let o = *off as usize;
            models[*dev][o..o + data.len()].copy_from_slice(data);
        }
        // every few rounds, a read of a random range of each device
        if round % 5 == 4 {
            for (dev, c) in conns.iter_mut().enumerate() {
                let off = rng.below(region - 256) * 512;
                let got = c.read(off, 128 << 10);
                let o = off as usize;
                assert_same(&got, &models[dev][o..o + (128 << 10)], names[dev]);
            }
        }
    }
    for (dev, c) in conns.iter_mut().enumerate() {
        let got = read_all(c, SIZE);
        assert_same(&got, &models[dev], names[dev]);
    }
    // the origin file holds exactly the origin's data
    assert_same(&read_at(&origin, 0, SIZE as usize), &models[0], "origin file");
    // flush every device, then SIGKILL: the persistent snapshots come back whole
    for c in conns.iter_mut() {
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    }
    let before: Vec<String> = ["s1", "s2"].iter().map(|n| status(&d, n)).collect();
    drop(conns);
    d.kill9();
    let d = Daemon::start("snap-stomp2");
    for (n, t) in &tables {
        d.create(n, t);
    }
    let after: Vec<String> = ["s1", "s2"].iter().map(|n| status(&d, n)).collect();
    assert_eq!(before, after, "usage after the restart");
    for (dev, n) in names.iter().enumerate().take(3) {
        let mut c = Client::connect(&d.sock(), n);
        assert_same(
            &read_all(&mut c, SIZE),
            &models[dev],
            &format!("{n} after SIGKILL"),
        );
    }
}

/// A COW store that fills up from origin writes invalidates the snapshot (EIO,
/// `Invalid`, also after a restart) while the origin goes on; with `PO`, a full
/// store from snapshot writes only overflows it, and reads keep working.
#[test]
fn full_cow_invalidates_or_overflows() {
    let s = Scratch::new("snap-full");
    let origin = origin_file(&s, 8 * MIB, 2);
    // chunk 8 sectors (4 KiB): header, area 0 and 10 data chunks
    let cow = s.sparse("cow", 12 * 4096);
    let cow_po = s.sparse("cow_po", 12 * 4096);
    let d = Daemon::start("snap-full");
    let o = origin.display();
    d.create("lv", &format!("0 16384 snapshot-origin {o}"));
    let t1 = format!("0 16384 snapshot {o} {} P 8", cow.display());
    d.create("snap", &t1);
    let mut lv = Client::connect(&d.sock(), "lv");
    let mut snap = Client::connect(&d.sock(), "snap");
    for i in 0..10u64 {
        lv.write(i * 4096, &pattern(100 + i, 4096));
    }
    assert_eq!(status(&d, "snap"), "0 16384 snapshot 96/96 16");
    let ev0: u64 = d
        .info_line("snap", "Event number")
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap();
    // the eleventh chunk does not fit: the snapshot goes invalid, the write lands
    lv.write(10 * 4096, &pattern(110, 4096));
    assert_eq!(lv.read(10 * 4096, 4096), pattern(110, 4096));
    assert_eq!(status(&d, "snap"), "0 16384 snapshot Invalid");
    assert_eq!(
        snap.call(READ, 0, 0, 4096, &[]),
        EIO,
        "reads of an invalid snapshot fail"
    );
    assert_eq!(snap.call(WRITE, 0, 0, 512, &[1; 512]), EIO);
    let ev1: u64 = d
        .info_line("snap", "Event number")
        .split_whitespace()
        .last()
        .unwrap()
        .parse()
        .unwrap();
    assert!(ev1 > ev0, "invalidation raises an event");
    // the header says so on disk: a new table loads it invalid
    let t0 = Instant::now();
    while read_at(&cow, 4, 4) != [0, 0, 0, 0] {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "header not rewritten with valid=0"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(snap);
    d.remove_closed("snap");
    d.create("snap", &t1);
    assert_eq!(status(&d, "snap"), "0 16384 snapshot Invalid");

    // PO: snapshot writes overflow it instead
    d.create("po", &format!("0 16384 snapshot {o} {} PO 8", cow_po.display()));
    assert_eq!(
        d.ok(&["table", "po"]).trim(),
        format!("0 16384 snapshot {o} {} PO 8", cow_po.display())
    );
    let mut po = Client::connect(&d.sock(), "po");
    let base = pattern(2, 8 * MIB as usize);
    for i in 0..10u64 {
        po.write(MIB + i * 4096, &pattern(200 + i, 4096));
    }
    assert_eq!(po.call(WRITE, 0, MIB + 10 * 4096, 4096, &pattern(210, 4096)), EIO);
    assert_eq!(status(&d, "po"), "0 16384 snapshot Overflow");
    assert_eq!(
        po.read(MIB, 4096),
        pattern(200, 4096),
        "written chunks still read"
    );
    let at = (2 * MIB) as usize;
    assert_eq!(
        po.read(2 * MIB, 4096),
        base[at..at + 4096],
        "origin chunks still read"
    );
    assert_eq!(
        po.call(WRITE, 0, MIB, 512, &[7; 512]),
        EIO,
        "no writes once overflowed"
    );
    assert_eq!(lv.read(0, 4096), pattern(100, 4096), "the origin is unaffected");
}

/// `lvconvert --merge` as device-mapper sees it: the origin's table becomes
/// `snapshot-merge`, the merge runs in the background while the device is used,
/// status shows it falling to the metadata size, and the origin ends up with the
/// snapshot's data plus what was written during the merge.
#[test]
fn merge_to_completion_with_io_during_it() {
    const SIZE: u64 = 16 * MIB;
    let s = Scratch::new("snap-merge");
    let origin = origin_file(&s, SIZE, 3);
    let cow = s.sparse("cow", 16 * MIB);
    let d = Daemon::start("snap-merge");
    let (o, w) = (origin.display(), cow.display());
    let sectors = SIZE / 512;
    d.create("lv", &format!("0 {sectors} snapshot-origin {o}"));
    d.create("snap", &format!("0 {sectors} snapshot {o} {w} P 8"));
    let mut snap_model = pattern(3, SIZE as usize);
    {
        let mut lv = Client::connect(&d.sock(), "lv");
        let mut sn = Client::connect(&d.sock(), "snap");
        // 700 scattered origin chunks: three metadata areas of 256 entries
        let mut rng = Rng(77);
        for i in 0..700u64 {
            let off = rng.below(SIZE / 4096) * 4096;
            lv.write(off, &pattern(1000 + i, 4096));
        }
        // and writes to the snapshot itself
        for i in 0..50u64 {
            let off = rng.below(SIZE / 512 - 64) * 512;
            let data = pattern(5000 + i, 8192);
            sn.write(off, &data);
            snap_model[off as usize..off as usize + 8192].copy_from_slice(&data);
        }
        assert_same(&read_all(&mut sn, SIZE), &snap_model, "snapshot before the merge");
    }
    let (alloc, _, meta) = usage(&d, "snap");
    assert!(
        alloc > meta + 600 * 8,
        "exceptions before the merge: {alloc} vs {meta}"
    );
    // the merge: suspend both, the origin takes the snapshot-merge table
    d.start_merge("lv", "snap", &format!("0 {sectors} snapshot-merge {o} {w} P 8"));
    d.ok(&["resume", "snap"]);
    let mut lv = Client::connect(&d.sock(), "lv");
    // the old snapshot device lost its exceptions to the merge
    assert_eq!(status(&d, "snap"), format!("0 {sectors} snapshot Invalid"));
    // I/O during the merge: writes anywhere, reads checked
    let mut model = snap_model.clone();
    let mut rng = Rng(99);
    for i in 0..200u64 {
        let off = rng.below(SIZE / 512 - 16) * 512;
        let data = pattern(9000 + i, 4096);
        lv.write(off, &data);
        model[off as usize..off as usize + 4096].copy_from_slice(&data);
        let r = rng.below(SIZE / 512 - 16) * 512;
        assert_same(
            &lv.read(r, 8192),
            &model[r as usize..r as usize + 8192],
            "read during the merge",
        );
    }
    wait_merged(&d, "lv");
    assert_same(&read_all(&mut lv, SIZE), &model, "merged device");
    drop(lv);
    // after the merge the origin file alone holds it all
    d.ok(&["suspend", "lv"]);
    d.ok(&["load", "lv", "--table", &format!("0 {sectors} linear {o} 0")]);
    d.ok(&["resume", "lv"]);
    assert_same(
        &read_at(&origin, 0, SIZE as usize),
        &model,
        "origin file after the merge",
    );
}

/// A merge stopped by SIGKILL part-way (each step is slowed by a `delay` device
/// in front of the origin) finishes after a restart from what is on disk.
#[test]
fn merge_interrupted_by_sigkill_finishes_after_restart() {
    const SIZE: u64 = 8 * MIB;
    let s = Scratch::new("snap-merge-kill");
    let origin = origin_file(&s, SIZE, 4);
    let cow = s.sparse("cow", 8 * MIB);
    let (o, w) = (origin.display(), cow.display());
    let sectors = SIZE / 512;
    let mut model = pattern(4, SIZE as usize);
    let mut d = Daemon::start("snap-merge-kill");
    d.create("lv", &format!("0 {sectors} snapshot-origin {o}"));
    d.create("snap", &format!("0 {sectors} snapshot {o} {w} P 8"));
    {
        let mut lv = Client::connect(&d.sock(), "lv");
        let mut sn = Client::connect(&d.sock(), "snap");
        // every other chunk: each merge step moves one chunk
        for i in 0..150u64 {
            lv.write(i * 8192, &pattern(300 + i, 4096));
        }
        for i in 0..10u64 {
            let data = pattern(700 + i, 4096);
            sn.write(i * 8192 + 4 * MIB, &data);
            let at = (i * 8192 + 4 * MIB) as usize;
            model[at..at + 4096].copy_from_slice(&data);
        }
        assert_eq!(sn.call(FLUSH, 0, 0, 0, &[]), 0);
    }
    // the origin behind a 20 ms write delay; the merge writes through it
    d.create("slow", &format!("0 {sectors} delay {o} 0 0 {o} 0 20"));
    d.ok(&["remove", "snap"]);
    d.ok(&["remove", "lv"]);
    d.create(
        "lv",
        &format!("0 {sectors} snapshot-merge /dev/mapper/slow {w} P 8"),
    );
    std::thread::sleep(Duration::from_millis(800));
    let (alloc, _, meta) = usage(&d, "lv");
    assert!(
        alloc > meta,
        "the merge should still be running: {alloc} vs {meta}"
    );
    d.kill9();
    let d = Daemon::start("snap-merge-kill2");
    d.create("lv", &format!("0 {sectors} snapshot-merge {o} {w} P 8"));
    wait_merged(&d, "lv");
    let mut lv = Client::connect(&d.sock(), "lv");
    assert_same(&read_all(&mut lv, SIZE), &model, "merged after the restart");
    assert_same(&read_at(&origin, 0, SIZE as usize), &model, "origin file");
}

/// Table and status lines as dmsetup prints them, and every refused table with
/// the kernel's words naming what is wrong; the daemon serves on.
#[test]
fn table_status_and_errors() {
    let s = Scratch::new("snap-lines");
    let origin = origin_file(&s, 4 * MIB, 5);
    let cow = s.sparse("cow", 4 * MIB);
    let bad = s.sparse("bad", 4 * MIB);
    write_file(&bad, 0, b"XXXXXXXXXXXXXXXX");
    let v2 = s.sparse("v2", 4 * MIB);
    write_file(
        &v2,
        0,
        &[0x53, 0x6e, 0x41, 0x70, 1, 0, 0, 0, 2, 0, 0, 0, 8, 0, 0, 0],
    );
    let d = Daemon::start("snap-lines");
    let (o, w) = (origin.display(), cow.display());
    d.create("lv", &format!("0 8192 snapshot-origin {o}"));
    d.create(
        "sn",
        &format!("0 8192 snapshot {o} {w} p 16 2 discard_zeroes_cow discard_passdown_origin"),
    );
    assert_eq!(
        d.ok(&["table", "lv"]).trim(),
        format!("0 8192 snapshot-origin {o}")
    );
    assert_eq!(
        d.ok(&["table", "sn"]).trim(),
        format!("0 8192 snapshot {o} {w} P 16 2 discard_zeroes_cow discard_passdown_origin")
    );
    assert_eq!(status(&d, "lv"), "0 8192 snapshot-origin");
    // header + area 0, nothing allocated: 2 chunks of 16 sectors
    assert_eq!(status(&d, "sn"), "0 8192 snapshot 32/8192 32");
    let targets = d.ok(&["targets"]);
    for t in [
        "snapshot-origin  v1.9.0",
        "snapshot         v1.16.0",
        "snapshot-merge   v1.5.0",
    ] {
        assert!(targets.contains(t), "targets lacks {t}:\n{targets}");
    }
    // the header has the chunk size; 0 takes it from there
    d.ok(&["remove", "sn"]);
    d.create("sn", &format!("0 8192 snapshot {o} {w} P 0"));
    assert_eq!(
        d.ok(&["table", "sn"]).trim(),
        format!("0 8192 snapshot {o} {w} P 16")
    );
    d.ok(&["remove", "sn"]);
    let refused = [
        (format!("{o} {w} P"), "requires 4 or more arguments"),
        (format!("{o} {w} X 8"), "Exception store type is not P or N"),
        (format!("{o} {w} PX 8"), "Unsupported persistent store option: X"),
        (format!("{o} {w} P 12"), "Chunk size is not a power of 2"),
        (format!("{o} {w} P abc"), "Invalid chunk size"),
        (format!("{o} {w} N 0"), "Chunk size not set"),
        (
            format!("{o} {o} P 8"),
            "COW device cannot be the same as origin device",
        ),
        (
            format!("{o} {} P 8", bad.display()),
            "Invalid or corrupt snapshot",
        ),
        (
            format!("{o} {} P 8", v2.display()),
            "unable to handle snapshot disk version 2",
        ),
        (
            format!("{o} {w} P 8 1 discard_passdown_origin"),
            "depends on discard_zeroes_cow",
        ),
        (
            format!("{o} {w} P 8 1 frobnicate"),
            "Unrecognised feature requested",
        ),
        (
            format!("{o} {w} P 8 3 a b c"),
            "Invalid number of feature arguments",
        ),
        (format!("/nonexistent {w} P 8"), "Cannot get origin device"),
    ];
    for (args, want) in &refused {
        let err = d.fails(&["create", "x", "--table", &format!("0 8192 snapshot {args}")]);
        assert!(err.contains(want), "table '{args}': expected '{want}' in: {err}");
    }
    let err = d.fails(&[
        "create",
        "x",
        "--table",
        &format!("0 8192 snapshot-merge {o} {w} N 8"),
    ]);
    assert!(err.contains("does not support snapshot-merge"), "{err}");
    let err = d.fails(&[
        "create",
        "x",
        "--table",
        &format!("0 8192 snapshot-origin {o} {w}"),
    ]);
    assert!(err.contains("origin: incorrect number of arguments"), "{err}");
    // still serving
    let mut c = Client::connect(&d.sock(), "lv");
    assert_eq!(c.read(0, 4096), pattern(5, 4 * MIB as usize)[..4096]);
}

/// Seed 002 through the snapshot stack: a FLUSH to the origin over a 1024-segment
/// linear device reaches its file once, and a FLUSH to the snapshot reaches the
/// COW file once.
#[test]
fn one_flush_per_file_through_snapshot_stack() {
    let d = Daemon::start("snap-flush");
    let f = d.dir.sparse("disk", 8 * MIB);
    let cow = d.dir.sparse("cow", 8 * MIB);
    let table: String = (0..1024)
        .map(|i| format!("{} 8 linear {} {}\n", i * 8, f.display(), (1023 - i) * 16))
        .collect();
    d.create("seg", &table);
    d.create("lv", "0 8192 snapshot-origin /dev/mapper/seg");
    d.create(
        "sn",
        &format!("0 8192 snapshot /dev/mapper/seg {} P 8", cow.display()),
    );
    let mut lv = Client::connect(&d.sock(), "lv");
    let mut sn = Client::connect(&d.sock(), "sn");
    lv.write(0, &pattern(1, 65536));
    sn.write(65536, &pattern(2, 4096));
    let (f0, c0) = (d.flushes("sn", &f), d.flushes("sn", &cow));
    for _ in 0..5 {
        assert_eq!(lv.call(FLUSH, 0, 0, 0, &[]), 0);
    }
    assert_eq!(d.flushes("sn", &f) - f0, 5, "origin FLUSH: once per file");
    assert_eq!(
        d.flushes("sn", &cow) - c0,
        0,
        "origin FLUSH does not touch the COW"
    );
    for _ in 0..3 {
        assert_eq!(sn.call(FLUSH, 0, 0, 0, &[]), 0);
    }
    assert_eq!(
        d.flushes("sn", &cow) - c0,
        3,
        "snapshot FLUSH: once to the COW file"
    );
    assert_eq!(
        d.flushes("sn", &f) - f0,
        5,
        "snapshot FLUSH does not touch the origin"
    );
    // discards are not offered by the origin, nor by a snapshot without features
    assert_ne!(lv.call(TRIM, 0, 0, 4096, &[]), 0);
}

/// SIGKILL rounds under a write load to the origin and to a snapshot, with a
/// flush of both every 25 writes: after each restart every write acknowledged
/// before the last completed flush reads back; a block written after it reads
/// as its flushed or one of its later versions; and a snapshot block never
/// written through the snapshot still holds what the origin held when the
/// snapshot was taken, whatever the origin received (an origin write is not
/// started before its copy is committed).
#[test]
fn sigkill_under_load_keeps_flushed_writes_and_the_snapshot() {
    const SIZE: u64 = 8 * MIB;
    const BS: u64 = 4096;
    let nb = (SIZE / BS) as usize;
    let s = Scratch::new("snap-kill-load");
    let origin = origin_file(&s, SIZE, 8);
    let cow = s.sparse("cow", 16 * MIB);
    let sectors = SIZE / 512;
    let (o, w) = (origin.display().to_string(), cow.display().to_string());
    let base = pattern(8, SIZE as usize);
    // what each 4 KiB block of the origin (0) and the snapshot (1) holds
    let mut state: Vec<Vec<Vec<u8>>> = vec![
        base.chunks(BS as usize).map(<[u8]>::to_vec).collect(),
        base.chunks(BS as usize).map(<[u8]>::to_vec).collect(),
    ];
    let mut written_to_snap = vec![false; nb];
    let mut rng = Rng(4242);
    let mut seed = 1u64 << 20;
    for round in 0..4 {
        let mut d = Daemon::start(&format!("snap-kill-load-{round}"));
        d.create("lv", &format!("0 {sectors} snapshot-origin {o}"));
        d.create("sn", &format!("0 {sectors} snapshot {o} {w} P 16"));
        let load = write_until_killed(
            d.sock(),
            &["lv", "sn"],
            |r: &mut Rng| usize::from(r.below(10) < 4),
            nb,
            BS,
            Rng(rng.next()),
            seed,
        );
        // a busy machine slows the writer: enough writes flushed first, then a
        // random moment
        let ran = load.wait_flushed(101, Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(rng.below(400)));
        d.kill9();
        let log = load.finish();
        let (ops, flushed) = (&log.0, log.1);
        assert!(
            ran && flushed > 100,
            "round {round}: only {flushed} writes before a flush"
        );
        eprintln!(
            "round {round}: {} writes, {flushed} before the last flush",
            ops.len()
        );
        seed = ops.last().map_or(seed, |x| x.2) + 1;
        for &(dev, b, _) in ops {
            if dev == 1 {
                written_to_snap[b] = true;
            }
        }
        let allowed = settle(&mut state, &log, BS);
        let d = Daemon::start(&format!("snap-kill-load-{round}-after"));
        d.create("lv", &format!("0 {sectors} snapshot-origin {o}"));
        d.create("sn", &format!("0 {sectors} snapshot {o} {w} P 16"));
        assert!(
            status(&d, "sn").contains(" snapshot ") && !status(&d, "sn").contains("Invalid"),
            "round {round}: {}",
            status(&d, "sn")
        );
        for (dev, name) in ["lv", "sn"].iter().enumerate() {
            let mut c = Client::connect(&d.sock(), name);
            let got = read_all(&mut c, SIZE);
            accept(
                &got,
                &mut state[dev],
                &allowed[dev],
                BS,
                &format!("round {round}: {name}"),
            );
            if dev == 1 {
                for (b, blk) in got.chunks(BS as usize).enumerate() {
                    assert!(
                        written_to_snap[b] || blk == &base[b * BS as usize..(b + 1) * BS as usize],
                        "round {round}: snapshot block {b} shows data the origin received later"
                    );
                }
            }
        }
    }
}

/// `discard_zeroes_cow`: a TRIM of a whole chunk with an exception zeroes it in
/// the COW (the snapshot reads zeroes there), a partial-chunk TRIM or one of a
/// chunk without exception changes nothing, and the origin is untouched; with
/// `discard_passdown_origin` too, the TRIM also reaches the origin's device.
/// A reload of the snapshot's table over the same COW takes its exceptions over.
#[test]
fn discards_and_exception_hand_over() {
    const SIZE: u64 = 4 * MIB;
    const CHUNK: u64 = 8192;
    let s = Scratch::new("snap-discard");
    let d = Daemon::start("snap-discard");
    let sectors = SIZE / 512;
    for passdown in [false, true] {
        let base = pattern(20 + u64::from(passdown), SIZE as usize);
        let origin = s.path(&format!("origin{passdown}"));
        std::fs::write(&origin, &base).expect("origin");
        let cow = s.sparse(&format!("cow{passdown}"), 4 * MIB);
        let (o, w) = (origin.display(), cow.display());
        let feats = if passdown {
            "2 discard_zeroes_cow discard_passdown_origin"
        } else {
            "1 discard_zeroes_cow"
        };
        let table = format!("0 {sectors} snapshot {o} {w} P 16 {feats}");
        // a device per case: a removal could race the client's disconnect
        let name = format!("sn{passdown}");
        d.create(&name, &table);
        let mut sn = Client::connect(&d.sock(), &name);
        let mut model = base.clone();
        // chunk 3 written whole (an exception), chunk 5 in part (an exception by copy)
        let x = pattern(77, CHUNK as usize);
        sn.write(3 * CHUNK, &x);
        model[3 * CHUNK as usize..4 * CHUNK as usize].copy_from_slice(&x);
        let y = pattern(78, 1024);
        sn.write(5 * CHUNK + 1024, &y);
        model[5 * CHUNK as usize + 1024..5 * CHUNK as usize + 2048].copy_from_slice(&y);
        assert_eq!(sn.call(TRIM, 0, 3 * CHUNK, CHUNK as u32, &[]), 0);
        assert_eq!(sn.call(TRIM, 0, 5 * CHUNK, 4096, &[]), 0);
        assert_eq!(sn.call(TRIM, 0, 9 * CHUNK, CHUNK as u32, &[]), 0);
        model[3 * CHUNK as usize..4 * CHUNK as usize].fill(0);
        let mut origin_model = base.clone();
        if passdown {
            // the origin's file is punched where the TRIMs went, so the
            // snapshot's chunks without an exception read zeroes there too
            for (off, len) in [(3 * CHUNK, CHUNK), (5 * CHUNK, 4096), (9 * CHUNK, CHUNK)] {
                origin_model[off as usize..(off + len) as usize].fill(0);
            }
            model[9 * CHUNK as usize..10 * CHUNK as usize].fill(0);
        }
        assert_same(
            &read_all(&mut sn, SIZE),
            &model,
            &format!("snapshot (passdown {passdown})"),
        );
        assert_same(
            &read_at(&origin, 0, SIZE as usize),
            &origin_model,
            &format!("origin (passdown {passdown})"),
        );
        // hand-over: the same table reloaded takes the exceptions over
        drop(sn);
        let before = status(&d, &name);
        d.reload(&name, &table);
        assert_eq!(status(&d, &name), before, "status after the hand-over");
        let mut sn = Client::connect(&d.sock(), &name);
        assert_same(&read_all(&mut sn, SIZE), &model, "snapshot after the hand-over");
    }
}
