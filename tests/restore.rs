//! `serve --restore` brings back every device the daemon held: tables over paths
//! with white space (printed escaped, so `table | load` and the state file read
//! them back), the state messages set (writecache `cleaner`,
//! `flush_on_suspend`), and a device that cannot come back is reported by name
//! while the others do. (A lost device's ublk block device is stopped; that runs
//! only where ublk does, in the oracle guest: see `Frontend::fail`.)

use crate::common;

use common::fs::{cmd, run_t};
use common::nbd::{Client, FLUSH, TRIM, WRITE};
use common::{assert_same, image, pattern, read_all, Daemon};
use std::time::{Duration, Instant};

use common::MIB;
const EIO: u32 = 5;

/// `path` as a table line carries it.
fn esc(path: &std::path::Path) -> String {
    let mut out = String::new();
    for c in path.to_string_lossy().chars() {
        if c == '\\' || c.is_whitespace() {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// `name`'s table with dmkit devices named instead of numbered (a restored
/// device may get another minor).
fn table_by_name(d: &Daemon, name: &str) -> String {
    let ls = d.ok(&["ls"]);
    let mut t = d.ok(&["table", name]);
    for l in ls.lines() {
        let mut f = l.split('\t');
        if let (Some(n), Some(num)) = (f.next(), f.next()) {
            let num = num.trim_matches(|c| c == '(' || c == ')');
            t = t.replace(&format!(" {num} "), &format!(" <{n}> "));
        }
    }
    t
}

/// The devices `ls` lists, by name.
fn names(d: &Daemon) -> Vec<String> {
    d.ok(&["ls"])
        .lines()
        .filter_map(|l| l.split('\t').next().map(str::to_string))
        .collect()
}

#[test]
fn white_space_paths_round_trip_through_table_load_and_restore() {
    let d = Daemon::start("ws");
    let dir = d.dir.path("my dir");
    std::fs::create_dir_all(&dir).expect("dir");
    let disk = image(&d.dir, "my dir/my disk.img", 4 * MIB, Some(29));
    let odd = image(&d.dir, "my dir/back\\slash\ttab.img", 4 * MIB, Some(30));
    let sectors = 4 * MIB / 512;
    d.create("lin", &format!("0 {sectors} linear {} 0", esc(&disk)));
    d.create(
        "two",
        &format!(
            "0 {sectors} linear {} 0\n{sectors} {sectors} linear {} 0",
            esc(&odd),
            esc(&disk)
        ),
    );
    // a device with a space in its name, stacked: the state file names it by path
    d.create("my dev", &format!("0 {sectors} linear /dev/mapper/lin 0"));
    d.create("top", &format!("0 {sectors} linear /dev/mapper/my\\ dev 0"));

    let want_lin = format!("0 {sectors} linear {} 0\n", esc(&disk));
    assert_eq!(d.ok(&["table", "lin"]), want_lin);
    assert!(want_lin.contains("my\\ dir/my\\ disk.img"), "{want_lin}");
    let two = d.ok(&["table", "two"]);
    assert!(two.contains("back\\\\slash\\\ttab.img"), "{two}");

    // table | load | resume gives the same table, on every device
    for name in ["lin", "two", "my dev", "top"] {
        let t = d.ok(&["table", name]);
        let o = d.cli_in(&["load", name], &t);
        assert!(
            o.status.success(),
            "load {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        d.ok(&["resume", name]);
        assert_eq!(d.ok(&["table", name]), t, "{name} after table | load");
    }
    let before: Vec<String> = ["lin", "two", "my dev", "top"]
        .iter()
        .map(|n| table_by_name(&d, n))
        .collect();
    assert_eq!(before[3], format!("0 {sectors} linear <my dev> 0\n"));

    // SIGKILL, then --restore: everything comes back, as it was
    let d = d.kill9_and_restore();
    let log = d.log();
    assert!(log.contains("restored 4 devices ("), "{log}");
    assert!(!log.contains("errors, see the log"), "{log}");
    for (n, t) in ["lin", "two", "my dev", "top"].iter().zip(&before) {
        assert_eq!(&table_by_name(&d, n), t, "{n} after restore");
    }
    let mut c = Client::connect(&d.sock(), "top");
    assert_same(
        &read_all(&mut c, 4 * MIB),
        &pattern(29, (4 * MIB) as usize),
        "top",
    );
    let mut c = Client::connect(&d.sock(), "two");
    let mut want = pattern(30, (4 * MIB) as usize);
    want.extend(pattern(29, (4 * MIB) as usize));
    assert_same(&read_all(&mut c, 8 * MIB), &want, "two");
}

/// Status fields of a writecache: (blocks, free, writeback).
fn wc_status(d: &Daemon) -> (u64, u64, u64) {
    let s = d.ok(&["status", "wc"]);
    let f: Vec<u64> = s
        .split_whitespace()
        .skip(3)
        .map(|x| x.parse().expect("number"))
        .collect();
    (f[1], f[2], f[3])
}

/// 1 MiB written through NBD and flushed (so the cache's metadata holds it).
fn write_dirty(d: &Daemon, seed: u64) {
    let mut c = Client::connect(&d.sock(), "wc");
    c.write(0, &pattern(seed, MIB as usize));
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
}

fn wc_daemon(tag: &str) -> (Daemon, String) {
    let d = Daemon::start(tag);
    let origin = image(&d.dir, "slow disk.img", 16 * MIB, None);
    let cache = image(&d.dir, "fast.img", 8 * MIB, None);
    let table = format!(
        "0 {} writecache s {} {} 4096 0",
        16 * MIB / 512,
        esc(&origin),
        esc(&cache)
    );
    d.create("wc", &table);
    (d, table)
}

#[test]
fn writecache_cleaner_set_by_message_survives_kill_and_restore() {
    let (d, table) = wc_daemon("cleaner");
    d.ok(&["message", "wc", "0", "cleaner"]);
    // the kernel's table line does not show a cleaner set by message: the
    // state file records the message itself
    assert_eq!(d.ok(&["table", "wc"]).trim_end(), table);

    let d = d.kill9_and_restore();
    assert!(d.log().contains("restored 1 devices ("), "{}", d.log());
    // 1 MiB of 8 is below the high watermark: only a cleaner writes it back,
    // and the README's retire recipe (`progress`) returns once it has
    write_dirty(&d, 7);
    let (ok, out, err) = run_t(
        &mut cmd(
            common::BIN,
            &["--run-dir", d.run.to_str().expect("utf-8"), "progress", "wc"],
        ),
        60,
    );
    assert!(ok, "progress: {out}{err}");
    assert!(out.contains("wc: nothing left to write back"), "{out}");
    let (blocks, free, wb) = wc_status(&d);
    assert_eq!((free, wb), (blocks, 0), "everything written back");
    common::assert_same(
        &common::read_at(&d.dir.path("slow disk.img"), 0, MIB as usize),
        &pattern(7, MIB as usize),
        "origin after writeback",
    );
    let state = std::fs::read_to_string(d.run.join("devices.state")).expect("state");
    assert!(state.contains("\n\nmessage\nwc\n0\ncleaner\n\n"), "{state}");
}

#[test]
fn writecache_flush_on_suspend_survives_kill_and_restore() {
    let (d, _) = wc_daemon("fos");
    write_dirty(&d, 8);
    d.ok(&["message", "wc", "0", "flush_on_suspend"]);
    let d = d.kill9_and_restore();
    let (blocks, free, _) = wc_status(&d);
    assert!(free < blocks, "dirty blocks came back: {free}/{blocks}");
    // the restored cache writes everything back at its next suspend
    d.ok(&["suspend", "wc"]);
    let (blocks, free, wb) = wc_status(&d);
    assert_eq!((free, wb), (blocks, 0), "written back at suspend");
    d.ok(&["resume", "wc"]);
    common::assert_same(
        &common::read_at(&d.dir.path("slow disk.img"), 0, MIB as usize),
        &pattern(8, MIB as usize),
        "origin after the suspend",
    );
    // one-shot, as the kernel's: recorded no more after the suspend used it
    let state = std::fs::read_to_string(d.run.join("devices.state")).expect("state");
    let replayed = dmkit::control::state::parse(&state);
    assert!(
        !replayed.iter().flatten().any(|w| w == "flush_on_suspend"),
        "{replayed:?}\n(the file: {state})"
    );
}

#[test]
fn a_device_that_cannot_be_restored_is_reported_and_the_others_come_back() {
    let d = Daemon::start("lost");
    let keep = image(&d.dir, "keep.img", 2 * MIB, Some(1));
    let gone = image(&d.dir, "gone.img", 2 * MIB, Some(2));
    let s = 2 * MIB / 512;
    d.create("keep", &format!("0 {s} linear {} 0", keep.display()));
    d.create("gone", &format!("0 {s} linear {} 0", gone.display()));
    d.create("ontop", &format!("0 {s} linear /dev/mapper/gone 0"));
    d.create("after", &format!("0 {s} linear /dev/mapper/keep 0"));
    let mut d = d;
    d.kill9();
    std::fs::remove_file(&gone).expect("remove the backing file");
    let d = d.kill9_and_restore();
    let log = restored(&d);
    let line = |what: &str| {
        log.lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no '{what}' in the log:\n{log}"))
            .to_string()
    };
    let g = line("device 'gone' not restored");
    assert!(g.contains("No such file or directory"), "{g}");
    assert!(g.contains("gone.img"), "{g}");
    let o = line("device 'ontop' not restored");
    assert!(o.contains("no dmkit device named 'gone'"), "{o}");
    assert!(
        line("restored 2 devices (").contains("; 2 errors, see the log"),
        "{log}"
    );
    assert_eq!(names(&d), vec!["after", "keep"]);
    let mut c = Client::connect(&d.sock(), "after");
    assert_same(
        &read_all(&mut c, 2 * MIB),
        &pattern(1, (2 * MIB) as usize),
        "after",
    );
    // the record of what was lost is kept beside the new one
    let prev = std::fs::read_to_string(d.run.join("devices.prev")).expect("devices.prev");
    assert!(prev.contains("\nontop\n"), "{prev}");
    let now = std::fs::read_to_string(d.run.join("devices.state")).expect("state");
    assert!(!now.contains("gone"), "{now}");
}

/// Wait for the restarted daemon's "restored N devices" line; the log then.
fn restored(d: &Daemon) -> String {
    let t0 = Instant::now();
    while !d.log().contains("restored ") {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no restore line: {}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    d.log()
}

/// The one thin-pool restart log in `d`'s run directory.
fn thin_pool_restart_log(d: &Daemon) -> std::path::PathBuf {
    let logs: Vec<_> = std::fs::read_dir(d.run.join("uncommitted"))
        .expect("the restart logs")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("thin-pool-"))
        })
        .collect();
    assert_eq!(logs.len(), 1, "{logs:?}");
    logs.into_iter().next().expect("one log")
}

/// `pool` on `meta.img` and `data.img`, and thin 0 (made first when `new`) as
/// `thin`.
fn pool_and_thin(d: &Daemon, new: bool) {
    let (meta, data) = (d.dir.path("meta.img"), d.dir.path("data.img"));
    d.create(
        "pool",
        &format!(
            "0 {} thin-pool {} {} 128 0",
            64 * MIB / 512,
            meta.display(),
            data.display()
        ),
    );
    if new {
        d.ok(&["message", "pool", "0", "create_thin 0"]);
    }
    d.create("thin", &format!("0 {} thin /dev/mapper/pool 0", 32 * MIB / 512));
}

/// A pool (commits only on flush: the period is an hour) with thin 0 on
/// `thin`; 4 MiB of pattern 1 written and a partial block at 8 MiB + 4 KiB,
/// flushed; then snapshot 1 of it, and pattern 2 over its first MiB, not
/// flushed (16 blocks whose sharing breaks: new mappings replacing old ones).
/// Returns thin 0's expected first 9 MiB.
fn thin_acked_unflushed(d: &Daemon) -> Vec<u8> {
    image(&d.dir, "meta.img", 4 * MIB, None);
    image(&d.dir, "data.img", 64 * MIB, None);
    pool_and_thin(d, true);
    let mut c = Client::connect(&d.sock(), "thin");
    let mut want = vec![0u8; 9 * MIB as usize];
    want[..4 * MIB as usize].copy_from_slice(&pattern(1, 4 * MIB as usize));
    c.write(0, &want[..4 * MIB as usize]);
    let at = (8 * MIB + 4096) as usize;
    want[at..at + 8192].copy_from_slice(&pattern(3, 8192));
    c.write(at as u64, &want[at..at + 8192]);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
    d.ok(&["message", "pool", "0", "create_snap 1 0"]);
    want[..MIB as usize].copy_from_slice(&pattern(2, MIB as usize));
    c.write(0, &want[..MIB as usize]);
    want
}

/// A writecache `name` of mode `mode` over 16 MiB of origin and 8 MiB of cache
/// that commits only on flush (or when its log fills), and a client of it.
fn wc_committing_on_flush(d: &Daemon, name: &str, mode: &str) -> Client {
    let origin = image(&d.dir, &format!("{name}-origin.img"), 16 * MIB, None);
    let cache = image(&d.dir, &format!("{name}-cache.img"), 8 * MIB, None);
    d.create(
        name,
        &format!(
            "0 {} writecache {mode} {} {} 4096 4 autocommit_blocks 1000000 autocommit_time 3600000",
            16 * MIB / 512,
            origin.display(),
            cache.display()
        ),
    );
    Client::connect(&d.sock(), name)
}

/// A writecache that commits only on flush (or when its log fills), on
/// `name`, of mode `mode`, with 2 MiB of pattern `seed` written over it and
/// not flushed, then its first 64 KiB written again (in place: uncommitted).
fn wc_acked_unflushed(d: &Daemon, name: &str, mode: &str, seed: u64) -> Vec<u8> {
    let mut c = wc_committing_on_flush(d, name, mode);
    let mut want = pattern(seed, 2 * MIB as usize);
    c.write(0, &want);
    want[..65536].copy_from_slice(&pattern(seed + 10, 65536));
    c.write(0, &want[..65536]);
    want
}

/// Writes a thin pool or a writecache acknowledged and had not committed (no
/// flush came) are there after a SIGKILL and `serve --restore`, as after a
/// SIGTERM: a filesystem mounted over ublk lives through the kill and trusts
/// them (`io::restart_log`). Before, the thin's new mappings and the caches'
/// new entries were lost, and the filesystem's blocks read back stale.
#[test]
fn writes_acknowledged_before_a_kill_9_are_there_after_restore() {
    let d = Daemon::start_with("acked", &["--test-thin-commit-period-ms", "3600000"], &[]);
    let thin = thin_acked_unflushed(&d);
    let ssd = wc_acked_unflushed(&d, "wcs", "s", 40);
    let pmem = wc_acked_unflushed(&d, "wcp", "p", 50);
    let d = d.kill9_and_restore();
    let log = restored(&d);
    assert!(log.contains("restored 4 devices ("), "{log}");
    // replayed, not committed before the kill by chance
    assert!(
        log.contains("committed 16 block mappings and unmappings the previous daemon had acknowledged"),
        "{log}"
    );
    assert_eq!(
        log.matches("writecache: committed 512 blocks the previous daemon had acknowledged")
            .count(),
        2,
        "{log}"
    );
    d.create("snap", &format!("0 {} thin /dev/mapper/pool 1", 32 * MIB / 512));
    let check = |d: &Daemon, what: &str| {
        let mut c = Client::connect(&d.sock(), "thin");
        assert_same(&c.read(0, 9 * MIB as usize), &thin, &format!("thin {what}"));
        let mut s = Client::connect(&d.sock(), "snap");
        let mut old = thin.clone();
        old[..MIB as usize].copy_from_slice(&pattern(1, MIB as usize));
        assert_same(&s.read(0, 9 * MIB as usize), &old, &format!("snapshot {what}"));
        for (name, want) in [("wcs", &ssd), ("wcp", &pmem)] {
            let mut c = Client::connect(&d.sock(), name);
            assert_same(&c.read(0, 2 * MIB as usize), want, &format!("{name} {what}"));
        }
    };
    check(&d, "after the kill");
    // what was replayed is committed: a second kill at once loses nothing
    let d = d.kill9_and_restore();
    let log = restored(&d);
    assert!(log.contains("restored 5 devices ("), "{log}");
    check(&d, "after a second kill");
    // removed with everything committed, a pool or a cache takes its restart
    // log along
    for name in ["snap", "thin", "pool", "wcs", "wcp"] {
        d.ok(&["remove", name]);
    }
    let left: Vec<_> = std::fs::read_dir(d.run.join("uncommitted"))
        .expect("the restart logs' directory")
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "restart logs left: {left:?}");
    // the pool's metadata is as the reference sees it: consistent
    let mut d = d;
    d.kill9();
    let (ok, out, err) = run_t(
        &mut cmd(
            &common::tool_path("thin_check"),
            &[d.dir.path("meta.img").to_str().expect("utf-8")],
        ),
        60,
    );
    assert!(ok, "thin_check: {out}{err}");
}

/// A restart log that lies (a valid checksum, a record naming a data block
/// the committed metadata uses) is refused with an error naming it; the pool
/// is not made, the metadata is not touched, and without the log it opens.
#[test]
fn a_restart_log_that_lies_is_refused_and_named() {
    let d = Daemon::start_with("lying-log", &["--test-thin-commit-period-ms", "3600000"], &[]);
    thin_acked_unflushed(&d);
    let mut d = d;
    d.kill9();
    let log_file = thin_pool_restart_log(&d);
    let mut bytes = std::fs::read(&log_file).expect("log");
    // record 0 (at 128, 48 bytes): its data block (word c, at 32) becomes 0,
    // mapped since the flush; the checksum (at 12) sealed again
    let r = &mut bytes[128..176];
    r[32..40].copy_from_slice(&0u64.to_le_bytes());
    let c = crc32c::crc32c_append(crc32c::crc32c(&r[..12]), &r[16..]);
    r[12..16].copy_from_slice(&c.to_le_bytes());
    std::fs::write(&log_file, &bytes).expect("write log");
    let meta_before = std::fs::read(d.dir.path("meta.img")).expect("meta");
    let d = d.kill9_and_restore();
    let log = restored(&d);
    let line = log
        .lines()
        .find(|l| l.contains("device 'pool' not restored"))
        .unwrap_or_else(|| panic!("no error for the pool:\n{log}"));
    assert!(line.contains("restart log record 0"), "{line}");
    assert!(line.contains("data block is out of range or in use"), "{line}");
    assert!(line.contains(&format!("remove {}", log_file.display())), "{line}");
    assert!(
        std::fs::read(d.dir.path("meta.img")).expect("meta") == meta_before,
        "metadata untouched"
    );
    std::fs::remove_file(&log_file).expect("remove the log");
    pool_and_thin(&d, false);
    // without the log: what was flushed (pattern 1), not the unflushed MiB
    let mut c = Client::connect(&d.sock(), "thin");
    assert_same(
        &c.read(0, 2 * MIB as usize),
        &pattern(1, 2 * MIB as usize),
        "thin without the log",
    );
}

/// A thin pool whose restart log holds 4 records (a test option; the daemon's
/// holds twice the pool's data blocks). Discards acknowledged after the last
/// commit are recorded and replayed: the blocks do not come back after a kill.
/// Writes beyond what the log holds wait for the commit that makes room for
/// their record, never acknowledged unrecorded: after a kill every one reads
/// back.
#[test]
fn a_full_restart_log_holds_writes_back_until_a_commit_and_discards_are_recorded() {
    const BLOCK: usize = 64 << 10;
    let start = |tag: &str| {
        let d = Daemon::start_with(
            tag,
            &[
                "--test-thin-commit-period-ms",
                "3600000",
                "--test-restart-log-records",
                "4",
            ],
            &[],
        );
        image(&d.dir, "meta.img", 4 * MIB, None);
        image(&d.dir, "data.img", 64 * MIB, None);
        pool_and_thin(&d, true);
        d
    };
    // (no `status pool` here: a pool's status commits first, as the kernel's)

    // discards: blocks 30 and 31 written and committed, then discarded, then
    // blocks 0 and 1 written: four records, nothing committed after the flush
    let d = start("logdiscard");
    let mut c = Client::connect(&d.sock(), "thin");
    let mut want = vec![0u8; 32 * BLOCK];
    for b in [30usize, 31] {
        c.write((b * BLOCK) as u64, &pattern(b as u64, BLOCK));
    }
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
    for b in [30u64, 31] {
        assert_eq!(c.call(TRIM, 0, b * BLOCK as u64, BLOCK as u32, &[]), 0, "trim");
    }
    for b in [0usize, 1] {
        want[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&pattern(50 + b as u64, BLOCK));
        c.write((b * BLOCK) as u64, &want[b * BLOCK..(b + 1) * BLOCK]);
    }
    drop(c);
    let d = d.kill9_and_restore();
    let log = restored(&d);
    assert!(
        log.contains("committed 4 block mappings and unmappings the previous daemon had acknowledged"),
        "{log}"
    );
    let mut c = Client::connect(&d.sock(), "thin");
    assert_same(
        &c.read(0, 32 * BLOCK),
        &want,
        "the discarded blocks stay discarded",
    );
    drop(c);
    drop(d);

    // writes: 24 new blocks through a log of 4
    let d = start("logfull");
    let mut c = Client::connect(&d.sock(), "thin");
    let mut want = vec![0u8; 32 * BLOCK];
    for b in 0..24 {
        want[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&pattern(100 + b as u64, BLOCK));
        c.write((b * BLOCK) as u64, &want[b * BLOCK..(b + 1) * BLOCK]);
    }
    drop(c);
    let d = d.kill9_and_restore();
    let log = restored(&d);
    assert!(!log.contains("they are lost"), "{log}");
    // what the last generation recorded was replayed (at most the log's 4);
    // the rest had been committed to make room
    let replayed: u64 = log
        .split("committed ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no replay line: {log}"));
    assert!((1..=4).contains(&replayed), "{replayed} records replayed: {log}");
    let mut c = Client::connect(&d.sock(), "thin");
    assert_same(&c.read(0, 32 * BLOCK), &want, "every acknowledged write");
}

/// The same for a writecache (ssd and pmem) whose restart logs hold 8 records:
/// 64 new blocks written without a flush are all acknowledged, each once a
/// commit made room for its record; after a kill every one reads back.
#[test]
fn a_full_writecache_restart_log_holds_writes_back_until_a_commit() {
    let d = Daemon::start_with("wclogfull", &["--test-restart-log-records", "8"], &[]);
    let mut wants = Vec::new();
    for (name, mode, seed) in [("wcs", "s", 70u64), ("wcp", "p", 80)] {
        let mut c = wc_committing_on_flush(&d, name, mode);
        let want = pattern(seed, 64 * 4096);
        for b in 0..64 {
            c.write(b * 4096, &want[b as usize * 4096..(b as usize + 1) * 4096]);
        }
        wants.push((name, want));
    }
    let d = d.kill9_and_restore();
    let log = restored(&d);
    assert!(!log.contains("lost"), "{log}");
    for (name, want) in &wants {
        let mut c = Client::connect(&d.sock(), name);
        assert_same(
            &c.read(0, want.len()),
            want,
            &format!("{name}: every acknowledged write"),
        );
    }
}

/// A thin pool's restart log truncated under the daemon (issue 45): a write
/// that needs a record fails with EIO instead of being acknowledged unrecorded
/// (and instead of a SIGBUS ending the daemon); written blocks still read back,
/// and a flush commits.
#[test]
fn a_restart_log_truncated_under_the_daemon_fails_new_mappings_not_the_daemon() {
    let mut d = Daemon::start_with("shrunk-log", &["--test-thin-commit-period-ms", "3600000"], &[]);
    let want = thin_acked_unflushed(&d);
    let log_file = thin_pool_restart_log(&d);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log_file)
        .and_then(|f| f.set_len(0))
        .expect("truncate the log");
    let mut c = Client::connect(&d.sock(), "thin");
    // a block never written: it needs a new mapping, so a record
    assert_eq!(c.call(WRITE, 0, 16 * MIB, 4096, &[9; 4096]), EIO, "a new mapping");
    assert!(d.alive(), "the daemon survived");
    assert!(
        d.log().contains("could not be recorded in the restart log"),
        "the log says why: {}",
        d.log()
    );
    assert_eq!(c.read(0, 9 * MIB as usize), want, "what was written reads back");
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "a flush commits");
}
