//! writecache through the real daemon and NBD, in both modes: table and status
//! lines, the kernel's error texts, alignment, a model of every block under
//! watermark writeback with SIGKILL rounds, fio verify through the cache and then
//! on the bare origin, and retiring a cache (cleaner, then linear).

use crate::common;

use common::fs::{check_files, cmd, must, write_files, Attach, FileSet, FS_TOOLS};
use common::nbd::{Client, FLUSH, READ, WRITE};
use common::{
    accept, assert_same, need, need_all, pattern, read_all, read_at, run, settle, write_until_killed, Daemon,
    Rng, Scratch,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::MIB;
const BS: u64 = 4096;
const EIO: u32 = 5;

fn status(d: &Daemon, name: &str) -> Vec<u64> {
    let s = d.ok(&["status", name]);
    let f: Vec<&str> = s.split_whitespace().collect();
    assert_eq!(f.len(), 17, "status has 14 fields: {s}");
    f[3..].iter().map(|x| x.parse().expect("number")).collect()
}

/// Wait (at most a minute) until `name` holds no dirty block.
fn wait_clean(d: &Daemon, name: &str) {
    let t0 = Instant::now();
    loop {
        let s = status(d, name);
        if s[2] == s[1] && s[3] == 0 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "cache did not empty: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A 4 KiB-block model of a device: what each block must read as.
struct Model {
    blocks: Vec<Vec<u8>>,
}

impl Model {
    fn new(origin: &[u8]) -> Model {
        Model {
            blocks: origin.chunks(BS as usize).map(<[u8]>::to_vec).collect(),
        }
    }
    fn bytes(&self) -> Vec<u8> {
        self.blocks.concat()
    }
}

fn file_with(s: &Scratch, name: &str, data: &[u8]) -> PathBuf {
    let p = s.sparse(name, data.len() as u64);
    std::fs::write(&p, data).expect("write");
    p
}

fn table(mode: &str, origin: &Path, cache: &Path, sectors: u64, opts: &str) -> String {
    let n = opts.split_whitespace().count();
    format!(
        "0 {sectors} writecache {mode} {} {} 4096 {n} {opts}",
        origin.display(),
        cache.display()
    )
}

#[test]
fn lines_errors_alignment_and_messages() {
    let d = Daemon::start("wc-lines");
    let s = &d.dir;
    let origin = s.sparse("origin", 16 * MIB);
    let cache = s.sparse("cache", MIB);
    let sectors = 16 * MIB / 512;
    let (o, c) = (origin.display(), cache.display());
    d.create(
        "wc",
        &table(
            "s",
            &origin,
            &cache,
            sectors,
            "pause_writeback 0 LOW_WATERMARK 10 high_watermark 60 autocommit_time 100",
        ),
    );
    assert_eq!(
        d.ok(&["table", "wc"]).trim(),
        format!("0 {sectors} writecache s {o} {c} 4096 8 high_watermark 60 low_watermark 10 autocommit_time 100 pause_writeback 0")
    );
    // 1 MiB of 4 KiB blocks: 254 blocks after 8 KiB of metadata
    assert_eq!(
        d.ok(&["status", "wc"]).trim(),
        format!("0 {sectors} writecache 0 254 254 0 0 0 0 0 0 0 0 0 0 0")
    );
    let pm = s.sparse("pcache", MIB);
    d.create(
        "wp",
        &table(
            "P",
            &origin,
            &pm,
            sectors,
            "nofua cleaner max_age 5000 start_sector 8 metadata_only",
        ),
    );
    assert_eq!(
        d.ok(&["table", "wp"]).trim(),
        format!(
            "0 {sectors} writecache p {o} {} 4096 7 start_sector 8 max_age 5000 cleaner nofua metadata_only",
            pm.display()
        )
    );
    // every option at once, given in reverse: the table prints D.13's order
    for (mode, opts, want) in [
        (
            "s",
            "pause_writeback 100 metadata_only cleaner max_age 9000 autocommit_time 50 \
             autocommit_blocks 16 writeback_jobs 32 low_watermark 5 high_watermark 70 start_sector 16",
            "start_sector 16 high_watermark 70 low_watermark 5 writeback_jobs 32 autocommit_blocks 16 \
             autocommit_time 50 max_age 9000 cleaner metadata_only pause_writeback 100",
        ),
        (
            "p",
            "metadata_only fua cleaner max_age 9000 autocommit_time 50 autocommit_blocks 16 \
             writeback_jobs 32 low_watermark 5 high_watermark 70 start_sector 16",
            "start_sector 16 high_watermark 70 low_watermark 5 writeback_jobs 32 autocommit_blocks 16 \
             autocommit_time 50 max_age 9000 cleaner fua metadata_only",
        ),
    ] {
        let c = s.sparse(&format!("all-{mode}"), MIB);
        let name = format!("all{mode}");
        d.create(&name, &table(mode, &origin, &c, sectors, opts));
        let n = want.split_whitespace().count();
        assert_eq!(
            d.ok(&["table", &name]).trim(),
            format!(
                "0 {sectors} writecache {mode} {o} {} 4096 {n} {want}",
                c.display()
            )
        );
        d.ok(&["remove", &name]);
    }
    assert!(
        d.ok(&["targets"]).contains("writecache       v1.6.0"),
        "{}",
        d.ok(&["targets"])
    );

    // bad tables, each refused with the kernel's words and the culprit
    let garbage = file_with(s, "garbage", &pattern(3, MIB as usize));
    let tiny = s.sparse("tiny", 4096);
    let bad = [
        (
            format!("0 {sectors} writecache x {o} {c} 4096 0"),
            "mode 'x' is neither p nor s",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 3000 0"),
            "Invalid block size '3000'",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 8192 0"),
            "Invalid block size '8192'",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 4096 1 bogus"),
            "Invalid optional argument: 'bogus'",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 4096 1 fua"),
            "Invalid optional argument: 'fua'",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 4096 2 high_watermark 101"),
            "Invalid optional argument: 'high_watermark 101'",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 4096 4 high_watermark 10 low_watermark 20"),
            "High watermark must be greater than or equal to low watermark",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 4096 3 cleaner"),
            "Invalid number of feature args '3'",
        ),
        (
            format!("0 {sectors} writecache s {o} {} 4096 0", tiny.display()),
            "Invalid device size",
        ),
        (
            format!("0 {sectors} writecache s {o} {} 4096 0", garbage.display()),
            "Invalid magic in the superblock",
        ),
        (
            format!("0 {sectors} writecache s {o} {c} 512 0"),
            "Block size does not match superblock (512 in the table, 4096 on disk)",
        ),
        (
            format!("0 {} writecache s {o} {c} 4096 0", sectors * 2),
            "Origin data device lookup failed",
        ),
    ];
    for (t, want) in &bad {
        let e = d.fails(&["create", "bad", "--table", t]);
        assert!(e.contains(want), "table {t}: wanted '{want}' in: {e}");
    }
    // version ≠ 1
    let mut v2 = read_at(&cache, 0, 4096);
    v2[4] = 2;
    let v2f = file_with(s, "v2", &[v2, vec![0; MIB as usize - 4096]].concat());
    let e = d.fails(&[
        "create",
        "bad",
        "--table",
        &table("s", &origin, &v2f, sectors, ""),
    ]);
    assert!(e.contains("Invalid version in the superblock (2)"), "{e}");

    // the device serves on; I/O not aligned to the block size fails
    assert!(
        run(Command::new("nbdinfo").arg(d.uri("wc"))).contains("block_size_minimum: 4096"),
        "the export advertises the cache block size"
    );
    d.ok(&["message", "wc", "0", "clear_stats"]);
    let mut cl = Client::connect(&d.sock(), "wc");
    assert_eq!(cl.call(WRITE, 0, 512, 512, &[7u8; 512]), EIO, "unaligned write");
    assert_eq!(cl.call(WRITE, 0, 4096, 4096, &[7u8; 4096]), 0);
    assert_eq!(cl.read(4096, 4096), vec![7u8; 4096]);
    let st = status(&d, "wc");
    assert_eq!(
        (st[2], st[6], st[10], st[4], st[5]),
        (253, 1, 1, 1, 1),
        "one block cached, read hit: {st:?}"
    );

    // messages
    let e = d.fails(&["message", "wc", "0", "bogus"]);
    assert!(e.contains("unrecognised message received: 'bogus'"), "{e}");
    d.ok(&["message", "wc", "0", "clear_stats"]);
    assert_eq!(status(&d, "wc")[4..], [0u64; 10]);
    d.ok(&["message", "wc", "0", "flush"]);
    assert_eq!(status(&d, "wc")[2], 254, "flush wrote everything back");
    assert_eq!(read_at(&origin, 4096, 4096), vec![7u8; 4096]);
}

/// `fua` / `nofua` do what the kernel's do (dm-writecache.c, WC_MODE_FUA): in
/// pmem mode, by default and with `fua`, each writeback write to the origin
/// carries FUA and no flush of the origin follows; with `nofua` the writes are
/// plain and one flush of the origin follows them. ssd mode (which refuses both
/// words) always writes back with plain writes and a flush. `dmkit stats` counts
/// both per backing file; the origin holds the data after the writeback.
#[test]
fn writeback_fua_and_nofua() {
    for (mode, opts, fua) in [
        ("p", "", true),
        ("p", "fua", true),
        ("p", "nofua", false),
        ("s", "", false),
    ] {
        let tag = format!("wc-fua-{mode}-{}", if opts.is_empty() { "default" } else { opts });
        let s = Scratch::new(&tag);
        let origin = file_with(&s, "origin", &vec![0u8; (8 * MIB) as usize]);
        let cache = s.sparse("cache", 4 * MIB);
        let d = Daemon::start(&tag);
        d.create("wc", &table(mode, &origin, &cache, 8 * MIB / 512, opts));
        let mut c = Client::connect(&d.sock(), "wc");
        let data = pattern(11, 65536);
        c.write(0, &data);
        c.write(MIB, &data);
        let (f0, w0) = (d.flushes("wc", &origin), d.fua_writes("wc", &origin));
        d.ok(&["message", "wc", "0", "flush"]);
        let st = status(&d, "wc");
        assert_eq!(
            st[2], st[1],
            "{tag}: the flush message wrote everything back: {st:?}"
        );
        let (f1, w1) = (d.flushes("wc", &origin), d.fua_writes("wc", &origin));
        if fua {
            assert!(w1 > w0, "{tag}: no FUA write reached the origin ({w0} -> {w1})");
            assert_eq!(f1, f0, "{tag}: the origin was flushed after FUA writes");
        } else {
            assert_eq!(w1, w0, "{tag}: writeback wrote with FUA");
            assert!(
                f1 > f0,
                "{tag}: the origin was not flushed after writeback ({f0} -> {f1})"
            );
        }
        assert!(read_at(&origin, 0, 65536) == data, "{tag}: origin block 0");
        assert!(read_at(&origin, MIB, 65536) == data, "{tag}: origin at 1 MiB");
    }
}

/// Random writes of 1–4 blocks against a model, with flushes, through a cache a
/// quarter of the written region so watermark writeback runs under the load;
/// then SIGKILL rounds: every flushed write reads back after restart, unflushed
/// ones read as either their old or their new data, never anything else.
fn model_and_kill_rounds(mode: &str, tag: &str) {
    const SIZE: u64 = 8 * MIB;
    let s = Scratch::new(tag);
    let base = pattern(11, SIZE as usize);
    let origin = file_with(&s, "origin", &base);
    let cache = s.sparse("cache", 2 * MIB);
    let sectors = SIZE / 512;
    let opts = if mode == "s" {
        "high_watermark 30 low_watermark 20 pause_writeback 0 autocommit_blocks 100"
    } else {
        "high_watermark 30 low_watermark 20"
    };
    let t = table(mode, &origin, &cache, sectors, opts);
    let mut model = Model::new(&base);
    let nb = SIZE / BS;
    let mut rng = Rng(0x1234_5678 + mode.len() as u64);
    let mut seed = 100;
    for round in 0..3 {
        let mut d = Daemon::start(&format!("{tag}-{round}"));
        d.create("wc", &t);
        let mut c = Client::connect(&d.sock(), "wc");
        assert_same(
            &read_all(&mut c, SIZE),
            &model.bytes(),
            &format!("round {round}: after restart"),
        );
        // flushed load
        for i in 0..600 {
            let b = rng.below(nb - 4);
            let n = 1 + rng.below(4);
            seed += 1;
            let data = pattern(seed, (n * BS) as usize);
            c.write(b * BS, &data);
            for k in 0..n {
                model.blocks[(b + k) as usize] = data[(k * BS) as usize..((k + 1) * BS) as usize].to_vec();
            }
            if i % 50 == 0 {
                assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
            }
            if i % 97 == 0 {
                let r = rng.below(nb - 8);
                let got = c.read(r * BS, (8 * BS) as usize);
                assert_same(
                    &got,
                    &model.blocks[r as usize..r as usize + 8].concat(),
                    "read under load",
                );
            }
        }
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
        assert_same(
            &read_all(&mut c, SIZE),
            &model.bytes(),
            &format!("round {round}: after load"),
        );
        let st = status(&d, "wc");
        assert!(st[0] == 0 && st[2] <= st[1] && st[3] <= st[1], "status: {st:?}");
        assert!(
            st[10] > st[1],
            "more blocks went through the cache than it holds: {st:?}"
        );
        // Unflushed writes, then SIGKILL. A block written twice may come back
        // with either version: an autocommit between the two writes makes the
        // first durable and leaves the second unflushed.
        let mut after: Vec<Vec<Vec<u8>>> = vec![Vec::new(); nb as usize];
        for _ in 0..100 {
            let b = rng.below(nb);
            seed += 1;
            let data = pattern(seed, BS as usize);
            c.write(b * BS, &data);
            after[b as usize].push(data);
        }
        d.kill9();
        drop(c);
        let d = Daemon::start(&format!("{tag}-{round}-after"));
        d.create("wc", &t);
        let st = status(&d, "wc");
        assert!(
            st[0] == 0 && st[2] <= st[1] && st[3] == 0,
            "status after restart: {st:?}"
        );
        let mut c = Client::connect(&d.sock(), "wc");
        let got = read_all(&mut c, SIZE);
        for (i, blk) in got.chunks(BS as usize).enumerate() {
            let ok = blk == model.blocks[i].as_slice() || after[i].iter().any(|a| a == blk);
            assert!(
                ok,
                "round {round}: block {i} is neither its flushed nor its unflushed data"
            );
            model.blocks[i] = blk.to_vec();
        }
    }
    // retire the cache: ssd with the flush message, pmem as users retire it
    let d = Daemon::start(&format!("{tag}-retire"));
    d.create("wc", &t);
    if mode == "s" {
        d.ok(&["message", "wc", "0", "flush"]);
    } else {
        d.ok(&["message", "wc", "0", "cleaner"]);
        wait_clean(&d, "wc");
    }
    let st = status(&d, "wc");
    assert_eq!((st[2], st[3]), (st[1], 0), "nothing dirty: {st:?}");
    d.ok(&[
        "load",
        "wc",
        "--table",
        &format!("0 {sectors} linear {} 0", origin.display()),
    ]);
    d.ok(&["suspend", "wc"]);
    d.ok(&["resume", "wc"]);
    assert!(d.ok(&["table", "wc"]).contains(" linear "));
    assert_same(
        &std::fs::read(&origin).expect("origin"),
        &model.bytes(),
        "the bare origin",
    );
}

#[test]
fn ssd_model_writeback_and_sigkill() {
    model_and_kill_rounds("s", "wc-model-s");
}

#[test]
fn pmem_model_writeback_and_sigkill() {
    model_and_kill_rounds("p", "wc-model-p");
}

/// fio writes and verifies (crc32c) through a cache an eighth of the region, in
/// both modes; after `flush`, the same verify passes on a linear device over the
/// bare origin.
#[test]
fn fio_verify_through_cache_then_origin() {
    need("fio");
    let d = Daemon::start("wc-fio");
    let s = &d.dir;
    for (mode, opts) in [("s", "pause_writeback 0"), ("p", "")] {
        let origin = s.sparse(&format!("origin-{mode}"), 32 * MIB);
        let cache = s.sparse(&format!("cache-{mode}"), 4 * MIB);
        let sectors = 32 * MIB / 512;
        let name = format!("wc{mode}");
        d.create(&name, &table(mode, &origin, &cache, sectors, opts));
        let fio = |uri: &str, verify_only: bool| {
            let mut cmd = Command::new("fio");
            cmd.args([
                "--name=wc",
                "--ioengine=nbd",
                &format!("--uri={uri}"),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=16",
                "--size=32M",
                "--verify=crc32c",
                "--verify_fatal=1",
                "--randseed=42",
            ]);
            if verify_only {
                cmd.arg("--verify_only=1");
            }
            run(&mut cmd)
        };
        fio(&d.uri(&name), false);
        let st = status(&d, &name);
        assert!(
            st[10] > st[0] + st[1],
            "more blocks were cached than the cache holds: {st:?}"
        );
        d.ok(&["message", &name, "0", "flush"]);
        let lin = format!("lin{mode}");
        d.create(&lin, &format!("0 {sectors} linear {} 0", origin.display()));
        fio(&d.uri(&lin), true);
    }
}

/// The seed's own check: ext4 on the cache through nbdfuse and a loop device,
/// files written and synced while watermark writeback runs (the cache is smaller
/// than the files), then the cache retired while mounted — the `flush` message
/// (ssd) or `cleaner` (pmem), a linear table over the origin, suspend, resume —
/// and every file reads back from the bare origin, which passes e2fsck.
#[test]
fn ext4_files_survive_retiring_the_cache() {
    need_all(FS_TOOLS);
    let d = Daemon::start("wc-ext4");
    let base = d.dir.0.clone();
    const SIZE: u64 = 64 * MIB;
    let sectors = SIZE / 512;
    for mode in ["s", "p"] {
        let origin = d.dir.sparse(&format!("origin-{mode}"), SIZE);
        let cache = d.dir.sparse(&format!("cache-{mode}"), 6 * MIB);
        let name = format!("wc{mode}");
        d.create(
            &name,
            &table(
                mode,
                &origin,
                &cache,
                sectors,
                "high_watermark 40 low_watermark 30",
            ),
        );
        let files: FileSet = (0..24u64)
            .map(|i| (format!("d{}/f{i}", i % 4), 500 + i, (i as usize * 7 + 5) * 9_973))
            .collect();
        let mut fs = Attach::new(&d, &base, &name, false);
        must(&mut cmd("mkfs.ext4", &["-q", "-F", "-b", "4096", fs.dev()]), 60);
        fs.mount("rw");
        write_files(&fs.mnt, &files);
        fs.sync();
        let st = status(&d, &name);
        assert!(
            st[10] > st[1] && st[2] < st[1],
            "{mode}: more was written than the cache holds, and some is cached: {st:?}"
        );
        if mode == "s" {
            d.ok(&["message", &name, "0", "flush"]);
        } else {
            d.ok(&["message", &name, "0", "cleaner"]);
            wait_clean(&d, &name);
        }
        d.ok(&[
            "load",
            &name,
            "--table",
            &format!("0 {sectors} linear {} 0", origin.display()),
        ]);
        d.ok(&["suspend", &name]);
        d.ok(&["resume", &name]);
        check_files(&fs.mnt, &files, &format!("{mode}: on the retired device"));
        fs.umount();
        drop(fs);
        // the bare origin, through a device of its own
        let bare = format!("bare{mode}");
        d.create(&bare, &format!("0 {sectors} linear {} 0", origin.display()));
        let mut fs = Attach::new(&d, &base, &bare, false);
        fs.fsck();
        fs.mount("ro,noload");
        check_files(&fs.mnt, &files, &format!("{mode}: on the bare origin"));
        fs.umount();
    }
}

/// A block size below a device's logical block size is refused, naming both: the
/// cache is a loop device with 4 KiB sectors.
#[test]
fn block_size_below_the_devices_logical_block_size_is_refused() {
    need_all(&["losetup"]);
    let d = Daemon::start("wc-lbs");
    let origin = d.dir.sparse("origin", 16 * MIB);
    let backing = d.dir.sparse("cache4k", 4 * MIB);
    let lo = must(
        &mut cmd(
            "losetup",
            &["-b", "4096", "--show", "-f", backing.to_str().expect("path")],
        ),
        30,
    )
    .trim()
    .to_string();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }
    let _lo = Detach(lo.clone());
    let sectors = 16 * MIB / 512;
    let e = d.fails(&[
        "create",
        "wc",
        "--table",
        &format!("0 {sectors} writecache s {} {lo} 512 0", origin.display()),
    ]);
    assert!(
        e.contains("Block size is smaller than device logical block size (512 < 4096)"),
        "{e}"
    );
    // 4096 is taken, and the export's minimum block size follows it
    d.create(
        "wc",
        &format!("0 {sectors} writecache s {} {lo} 4096 0", origin.display()),
    );
    assert!(run(Command::new("nbdinfo").arg(d.uri("wc"))).contains("block_size_minimum: 4096"));
}

/// SIGKILL while a thread writes (with a flush every 25 writes) through a cache
/// a quarter of the region, so commits and watermark writeback run when the
/// daemon dies: after each restart the status is consistent, every write
/// acknowledged before the last completed flush reads back, and every other
/// block holds its flushed data or a later write.
fn sigkill_under_load(mode: &str, tag: &str) {
    const SIZE: u64 = 8 * MIB;
    let nb = (SIZE / BS) as usize;
    let s = Scratch::new(tag);
    let base = pattern(12, SIZE as usize);
    let origin = file_with(&s, "origin", &base);
    let cache = s.sparse("cache", 2 * MIB);
    // writeback under the load, from the high watermark on (pause_writeback is ssd's)
    let opts = match mode {
        "s" => "high_watermark 30 low_watermark 20 pause_writeback 0",
        _ => "high_watermark 30 low_watermark 20",
    };
    let t = table(mode, &origin, &cache, SIZE / 512, opts);
    let mut state = vec![base.chunks(BS as usize).map(<[u8]>::to_vec).collect::<Vec<_>>()];
    let mut rng = Rng(0x5eed + mode.len() as u64);
    let mut seed = 1u64 << 30;
    for round in 0..3 {
        let mut d = Daemon::start(&format!("{tag}-{round}"));
        d.create("wc", &t);
        let load = write_until_killed(d.sock(), &["wc"], |_: &mut Rng| 0, nb, BS, Rng(rng.next()), seed);
        // the kill lands after a number of flushed writes the round chooses
        let n = 50 + rng.below(200) as usize;
        let ran = load.wait_flushed(n, Duration::from_secs(60));
        d.kill9();
        let log = load.finish();
        assert!(
            ran,
            "round {round}: {} writes covered by a flush, not {n}, within 60 s",
            log.1
        );
        seed = log.0.last().map_or(seed, |x| x.2) + 1;
        let allowed = settle(&mut state, &log, BS);
        let d = Daemon::start(&format!("{tag}-{round}-after"));
        d.create("wc", &t);
        let st = status(&d, "wc");
        // (writeback may already be under way again)
        assert!(
            st[0] == 0 && st[2] <= st[1] && st[3] <= st[1] - st[2],
            "round {round}: status after restart: {st:?}"
        );
        let mut c = Client::connect(&d.sock(), "wc");
        let got = read_all(&mut c, SIZE);
        accept(
            &got,
            &mut state[0],
            &allowed[0],
            BS,
            &format!("{mode} round {round}"),
        );
    }
}

#[test]
fn ssd_sigkill_under_load() {
    sigkill_under_load("s", "wc-kill-load-s");
}

#[test]
fn pmem_sigkill_under_load() {
    sigkill_under_load("p", "wc-kill-load-p");
}

/// A pmem cache file truncated by another process under the daemon (issue 45):
/// the device's I/O fails with EIO and it enters the error state (status's
/// first field), while the daemon and its other devices go on; the kernel
/// would report a pmem media error the same way.
#[test]
fn pmem_cache_file_truncated_under_the_daemon_fails_its_io_only() {
    let mut d = Daemon::start("wc-shrunk");
    let s = &d.dir;
    let origin = s.sparse("origin", 8 * MIB);
    let cache = s.sparse("cache", 4 * MIB);
    d.create("wc", &table("p", &origin, &cache, 8 * MIB / 512, ""));
    let other = s.sparse("other", MIB);
    d.create("other", &format!("0 {} linear {} 0", MIB / 512, other.display()));
    let mut c = Client::connect(&d.sock(), "wc");
    assert_eq!(c.call(WRITE, 0, 0, 65536, &pattern(1, 65536)), 0);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    assert_eq!(c.read(0, 65536), pattern(1, 65536));
    assert_eq!(status(&d, "wc")[0], 0, "not in the error state yet");

    std::fs::OpenOptions::new()
        .write(true)
        .open(&cache)
        .and_then(|f| f.set_len(4096))
        .expect("truncate the cache file");
    assert_eq!(c.call(READ, 0, 0, 4096, &[]), EIO, "a cached block's read");
    assert_eq!(c.call(WRITE, 0, 8192, 4096, &[3; 4096]), EIO, "a write");
    assert!(d.alive(), "the daemon survived the truncation");
    assert_eq!(status(&d, "wc")[0], 1, "the cache is in the error state");
    assert!(
        d.log().contains("a mapped file shrank under the daemon"),
        "the log says why: {}",
        d.log()
    );
    let mut o = Client::connect(&d.sock(), "other");
    assert_eq!(o.call(WRITE, 0, 0, 4096, &[5; 4096]), 0);
    assert_eq!(o.read(0, 4096), vec![5u8; 4096], "another device goes on");
    // and the broken device can be taken down
    drop(c);
    d.ok(&["remove", "--force", "wc"]);
}
