//! The `thin-pool` and `thin` targets, black-box through the CLI and NBD, after
//! the kernel's device-mapper test suite for thin provisioning: snapshot pattern
//! stomps, space accounting, many snapshots, running out of data and metadata
//! space, metadata snapshots, discards, transaction ids, external origins,
//! table/status formats, and FUA/flush durability across a SIGKILL. Every test
//! ends by stopping the daemon and running the real `thin_check` on the pool's
//! metadata.

use crate::common;

use common::nbd::{reply_ready, Client, FLAG_FUA, FLUSH, TRIM, WRITE};
use common::{assert_same, need, pattern, read_at, Daemon, Scratch};
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const EIO: u32 = 5;
const ENOSPC: u32 = 28;
const EINVAL: u32 = 22;
const TF_SEND_TRIM: u16 = 0x0020;
const KIB: u64 = 1024;
use common::MIB;
/// Data block size in sectors (64 KiB, the smallest the kernel allows).
const BS: u64 = 128;
/// Data block size in bytes.
const B: u64 = BS * 512;

/// A pool's metadata and data files, in a directory that outlives the daemon
/// (so the metadata can be checked after it stops, or reopened by a new one).
struct Files {
    s: Scratch,
    meta: PathBuf,
    data: PathBuf,
}

impl Files {
    fn new(tag: &str, meta_bytes: u64, data_bytes: u64) -> Files {
        let s = Scratch::new(tag);
        let meta = s.sparse("meta", meta_bytes);
        let data = s.sparse("data", data_bytes);
        Files { s, meta, data }
    }

    /// A pool table over these files with `blocks` data blocks.
    fn table(&self, blocks: u64, low_water: u64, features: &[&str]) -> String {
        let mut t = format!(
            "0 {} thin-pool {} {} {BS} {low_water}",
            blocks * BS,
            self.meta.display(),
            self.data.display()
        );
        if !features.is_empty() {
            t += &format!(" {} {}", features.len(), features.join(" "));
        }
        t
    }
}

/// Fill `p` (its current length) with a non-zero byte, so that any part of a
/// data block that should have been zeroed or copied but was not shows up.
fn fill_garbage(p: &Path) {
    let len = std::fs::metadata(p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
    f.write_all_at(&vec![0xEE; len as usize], 0).unwrap();
}

fn words(s: &str) -> Vec<&str> {
    s.split_whitespace().collect()
}

/// `dmkit message <dev> 0 <msg>`, required to succeed.
fn msg(d: &Daemon, dev: &str, m: &str) {
    let mut a = vec!["message", dev, "0"];
    a.extend(words(m));
    d.ok(&a);
}

/// `dmkit message <dev> 0 <msg>`, required to fail with a one-line error.
fn msg_fails(d: &Daemon, dev: &str, m: &str) -> String {
    let mut a = vec!["message", dev, "0"];
    a.extend(words(m));
    d.fails(&a)
}

/// The target-specific status fields of a one-target device.
fn status(d: &Daemon, dev: &str) -> Vec<String> {
    let out = d.ok(&["status", dev]);
    let line = out.strip_suffix('\n').unwrap_or(&out);
    line.split(' ').skip(3).map(str::to_string).collect()
}

/// The raw status line (trailing space kept).
fn status_line(d: &Daemon, dev: &str) -> String {
    let out = d.ok(&["status", dev]);
    out.strip_suffix('\n').unwrap_or(&out).to_string()
}

#[derive(Debug)]
struct PoolStatus {
    txn: u64,
    used_meta: u64,
    total_meta: u64,
    used_data: u64,
    total_data: u64,
    held: String,
    mode: String,
    discard: String,
    space: String,
    check: String,
}

fn frac(s: &str) -> (u64, u64) {
    let (a, b) = s.split_once('/').unwrap_or_else(|| panic!("not a/b: {s}"));
    (a.parse().unwrap(), b.parse().unwrap())
}

fn pool_status_of(d: &Daemon, pool: &str) -> PoolStatus {
    let f = status(d, pool);
    assert!(f.len() >= 9, "short pool status {f:?}");
    let (used_meta, total_meta) = frac(&f[1]);
    let (used_data, total_data) = frac(&f[2]);
    PoolStatus {
        txn: f[0].parse().unwrap(),
        used_meta,
        total_meta,
        used_data,
        total_data,
        held: f[3].clone(),
        mode: f[4].clone(),
        discard: f[5].clone(),
        space: f[6].clone(),
        check: f[7].clone(),
    }
}

fn pool_status(d: &Daemon) -> PoolStatus {
    pool_status_of(d, "pool")
}

fn used_data(d: &Daemon) -> u64 {
    pool_status(d).used_data
}

/// Thin status: (mapped sectors, highest mapped sector or "-").
fn thin_status(d: &Daemon, dev: &str) -> (u64, String) {
    let f = status(d, dev);
    assert_eq!(f.len(), 2, "thin status {f:?}");
    (f[0].parse().unwrap(), f[1].clone())
}

fn mapped_blocks(d: &Daemon, dev: &str) -> u64 {
    let (s, _) = thin_status(d, dev);
    assert_eq!(s % BS, 0);
    s / BS
}

/// Activate thin `id` of pool "pool" as `name`, `bytes` long.
fn thin(d: &Daemon, name: &str, id: u64, bytes: u64) {
    d.create(name, &format!("0 {} thin /dev/mapper/pool {id}", bytes / 512));
}

/// `dmkit remove`, retried while the device is still open: a dropped NBD
/// connection is noticed by the server a moment later.
fn remove(d: &Daemon, name: &str) {
    let t0 = Instant::now();
    loop {
        let o = d.cli(&["remove", name]);
        if o.status.success() {
            return;
        }
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            e.contains("busy") && t0.elapsed() < Duration::from_secs(5),
            "remove {name}: {e}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `create_snap new origin` the kernel way: the active origin is suspended
/// around the message.
fn snap(d: &Daemon, origin_dev: Option<&str>, new: u64, origin: u64) {
    if let Some(o) = origin_dev {
        d.ok(&["suspend", o]);
    }
    msg(d, "pool", &format!("create_snap {new} {origin}"));
    if let Some(o) = origin_dev {
        d.ok(&["resume", o]);
    }
}

fn read_all(c: &mut Client, off: u64, len: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len as usize);
    let mut o = off;
    while o < off + len {
        let n = (off + len - o).min(256 * KIB);
        v.extend(c.read(o, n as usize));
        o += n;
    }
    v
}

fn write_all(c: &mut Client, off: u64, data: &[u8]) {
    for (i, ch) in data.chunks(256 * KIB as usize).enumerate() {
        c.write(off + i as u64 * 256 * KIB, ch);
    }
}

/// The real thin_check must accept the metadata (exit 0).
fn thin_check(meta: &Path) {
    need("thin_check");
    let o = Command::new("thin_check")
        .arg(meta)
        .output()
        .expect("run thin_check");
    assert!(
        o.status.success(),
        "thin_check {} failed:\n{}\n{}",
        meta.display(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Stop the daemon (its shutdown commits the pool) and check the metadata.
fn stop_and_check(d: Daemon, f: &Files) {
    drop(d);
    thin_check(&f.meta);
}

fn thin_dump(meta: &Path, held: bool) -> String {
    need("thin_dump");
    let mut c = Command::new("thin_dump");
    if held {
        c.arg("-m");
    }
    let o = c.arg(meta).output().expect("run thin_dump");
    assert!(
        o.status.success(),
        "thin_dump {}failed: {}",
        if held { "-m " } else { "" },
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// A pool "pool" with the given geometry in a fresh daemon.
fn pool_daemon(
    tag: &str,
    meta_bytes: u64,
    data_blocks: u64,
    features: &[&str],
    serve_args: &[&str],
) -> (Daemon, Files) {
    let f = Files::new(tag, meta_bytes, data_blocks * B);
    let d = Daemon::start_with(tag, serve_args, &[]);
    d.create("pool", &f.table(data_blocks, 0, features));
    (d, f)
}

// ---------------------------------------------------------------------------
// 1. Pattern stomp over origin → snap1 → snap2 → snap3.

/// What every level must read, and which data block each mapped virtual block
/// uses (ids only: used data = the number of distinct ids still referenced).
struct Model {
    data: Vec<Vec<u8>>,
    map: Vec<BTreeMap<u64, u64>>,
    next_id: u64,
}

impl Model {
    fn refs(&self, id: u64) -> usize {
        self.map.iter().filter(|m| m.values().any(|&x| x == id)).count()
    }
    fn write(&mut self, lvl: usize, off: u64, data: &[u8]) {
        self.data[lvl][off as usize..off as usize + data.len()].copy_from_slice(data);
        for vb in off / B..=(off + data.len() as u64 - 1) / B {
            let shared = match self.map[lvl].get(&vb) {
                Some(&id) => self.refs(id) > 1,
                None => true,
            };
            if shared {
                self.next_id += 1;
                self.map[lvl].insert(vb, self.next_id);
            }
        }
    }
    fn snapshot(&mut self, of: usize) {
        self.data.push(self.data[of].clone());
        self.map.push(self.map[of].clone());
    }
    fn used(&self) -> u64 {
        let ids: BTreeSet<u64> = self.map.iter().flat_map(|m| m.values().copied()).collect();
        ids.len() as u64
    }
}

#[test]
fn pattern_stomp_three_levels_of_snapshots() {
    const SIZE: u64 = MIB; // 16 blocks per thin
    let (d, f) = pool_daemon("stomp", 4 * MIB, 128, &[], &[]);
    fill_garbage(&f.data);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, SIZE);
    let mut conns = vec![Client::connect(&d.sock(), "t0")];
    let mut m = Model {
        data: vec![vec![0; SIZE as usize]],
        map: vec![BTreeMap::new()],
        next_id: 0,
    };
    // (level, offset, length) per phase; phase k runs with levels 0..=k.
    let phases: [&[(usize, u64, u64)]; 4] = [
        &[
            (0, 0, B),
            (0, B, B),
            (0, 2 * B + 4096, 8192),
            (0, 4 * B - 4096, 8192),
            (0, 6 * B, B),
            (0, 9 * B + 512, 512),
        ],
        &[
            (0, 512, 1024),
            (1, B + 8192, 4096),
            (0, B, B),
            (1, 2 * B + 32768, 4096),
            (1, 7 * B, B),
            (0, 8 * B, B),
            (1, 4 * B - 2048, 4096),
            (0, 6 * B + 1024, 2048),
            (1, 6 * B + 1024, 2048),
        ],
        &[
            (2, 0, 4096),
            (1, 0, 4096),
            (0, 0, 4096),
            (2, 7 * B + 51200, 8192),
            (1, 7 * B, 512),
            (2, 10 * B, B),
            (0, 2 * B, 3 * B),
            (2, 9 * B, 1024),
            (1, 11 * B + 4096, 4096),
        ],
        &[
            (3, 0, B),
            (3, 5 * B + 512, 1024),
            (2, 5 * B, 512),
            (1, 9 * B + 512, 512),
            (0, 15 * B, B),
            (3, 14 * B - 1024, 2048),
            (2, 0, 512),
            (0, 7 * B, 4096),
            (1, 15 * B - 512, 512),
            (3, 9 * B + 1024, 512),
            (3, 7 * B + 51200, 4096),
        ],
    ];
    let mut seed = 100;
    for (k, writes) in phases.iter().enumerate() {
        if k > 0 {
            // snapk is a snapshot of level k-1 (the origin for k = 1).
            snap(&d, Some(&format!("t{}", k - 1)), k as u64, k as u64 - 1);
            m.snapshot(k - 1);
            thin(&d, &format!("t{k}"), k as u64, SIZE);
            conns.push(Client::connect(&d.sock(), &format!("t{k}")));
        }
        for &(lvl, off, len) in writes.iter() {
            seed += 1;
            let p = pattern(seed, len as usize);
            conns[lvl].write(off, &p);
            m.write(lvl, off, &p);
        }
        for (lvl, c) in conns.iter_mut().enumerate() {
            let got = read_all(c, 0, SIZE);
            if got != m.data[lvl] {
                let first = got.iter().zip(&m.data[lvl]).position(|(a, b)| a != b);
                panic!("phase {k}: level {lvl} differs from its model, first at byte {first:?}");
            }
            assert_eq!(
                mapped_blocks(&d, &format!("t{lvl}")),
                m.map[lvl].len() as u64,
                "phase {k}: mapped blocks of level {lvl}"
            );
        }
        assert_eq!(used_data(&d), m.used(), "phase {k}: used data blocks");
    }
    // Reactivated devices still see their own data.
    drop(conns);
    for lvl in 0..4 {
        remove(&d, &format!("t{lvl}"));
    }
    for lvl in 0..4 {
        thin(&d, &format!("t{lvl}"), lvl as u64, SIZE);
        let mut c = Client::connect(&d.sock(), &format!("t{lvl}"));
        assert!(
            read_all(&mut c, 0, SIZE) == m.data[lvl],
            "level {lvl} after reactivation"
        );
    }
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 2. Space use.

#[test]
fn writing_thin_then_snapshot_fully_doubles_used_data() {
    const SIZE: u64 = 4 * MIB; // 64 blocks
    let (d, f) = pool_daemon("space", 4 * MIB, 256, &[], &[]);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, SIZE);
    assert_eq!(used_data(&d), 0);
    let mut c0 = Client::connect(&d.sock(), "t0");
    let a = pattern(1, SIZE as usize);
    write_all(&mut c0, 0, &a);
    assert_eq!(used_data(&d), 64);
    assert_eq!(thin_status(&d, "t0"), (64 * BS, (64 * BS - 1).to_string()));

    snap(&d, Some("t0"), 1, 0);
    assert_eq!(used_data(&d), 64, "a snapshot takes no data space");
    thin(&d, "t1", 1, SIZE);
    let mut c1 = Client::connect(&d.sock(), "t1");
    let b = pattern(2, SIZE as usize);
    write_all(&mut c1, 0, &b);
    assert_eq!(used_data(&d), 128, "writing the snapshot fully doubles used data");
    assert_eq!(mapped_blocks(&d, "t1"), 64);
    assert!(
        read_all(&mut c0, 0, SIZE) == a,
        "origin changed by snapshot writes"
    );
    assert!(read_all(&mut c1, 0, SIZE) == b);

    // Rewriting the origin: its old blocks are no longer shared once replaced,
    // so they are freed again and used data stays at 128.
    let c = pattern(3, SIZE as usize);
    write_all(&mut c0, 0, &c);
    assert_eq!(used_data(&d), 128, "old origin blocks freed after rewrite");
    assert!(read_all(&mut c0, 0, SIZE) == c);
    assert!(read_all(&mut c1, 0, SIZE) == b);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 3. Many snapshots.

#[test]
fn thousand_snapshots_of_one_thin() {
    const SIZE: u64 = MIB;
    let (d, f) = pool_daemon("snap1000", 16 * MIB, 256, &[], &[]);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, SIZE);
    let mut c0 = Client::connect(&d.sock(), "t0");
    let a = pattern(7, SIZE as usize);
    write_all(&mut c0, 0, &a);
    let t0 = Instant::now();
    d.ok(&["suspend", "t0"]);
    for id in 1..=1000u64 {
        msg(&d, "pool", &format!("create_snap {id} 0"));
    }
    d.ok(&["resume", "t0"]);
    eprintln!("1000 create_snap messages took {:?}", t0.elapsed());
    assert_eq!(used_data(&d), 16, "snapshots take no data space");
    msg_fails(&d, "pool", "create_snap 500 0");

    // Break sharing on the origin, then check one snapshot (the only one active).
    let b = pattern(8, B as usize);
    c0.write(0, &b);
    thin(&d, "s500", 500, SIZE);
    let mut c = Client::connect(&d.sock(), "s500");
    assert!(
        read_all(&mut c, 0, SIZE) == a,
        "snapshot 500 sees the origin at snapshot time"
    );
    let s = pattern(9, 8192);
    c.write(3 * B + 4096, &s);
    let mut want_snap = a.clone();
    want_snap[(3 * B + 4096) as usize..(3 * B + 4096 + 8192) as usize].copy_from_slice(&s);
    assert!(read_all(&mut c, 0, SIZE) == want_snap);
    let mut want_origin = a.clone();
    want_origin[..B as usize].copy_from_slice(&b);
    assert!(
        read_all(&mut c0, 0, SIZE) == want_origin,
        "origin sees snapshot writes"
    );
    assert_eq!(used_data(&d), 18);
    assert_eq!(mapped_blocks(&d, "s500"), 16);
    // Another snapshot, activated later, is untouched by both.
    drop(c);
    remove(&d, "s500");
    thin(&d, "s999", 999, SIZE);
    let mut c = Client::connect(&d.sock(), "s999");
    assert!(read_all(&mut c, 0, SIZE) == a);
    drop(c);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 4. Out of data space.

#[test]
fn out_of_data_space_error_if_no_space_then_delete_frees() {
    let (d, f) = pool_daemon("nospace-err", 4 * MIB, 8, &["error_if_no_space"], &[]);
    assert_eq!(pool_status(&d).space, "error_if_no_space");
    msg(&d, "pool", "create_thin 0");
    msg(&d, "pool", "create_thin 1");
    thin(&d, "t0", 0, MIB);
    thin(&d, "t1", 1, MIB);
    let mut c1 = Client::connect(&d.sock(), "t1");
    write_all(&mut c1, 0, &pattern(1, 2 * B as usize));
    drop(c1);
    let mut c0 = Client::connect(&d.sock(), "t0");
    let a = pattern(2, 6 * B as usize);
    write_all(&mut c0, 0, &a);
    assert_eq!(used_data(&d), 8);

    // The pool is full: a write needing a new block fails at once with ENOSPC.
    let p = pattern(3, 4096);
    assert_eq!(c0.call(WRITE, 0, 6 * B, 4096, &p), ENOSPC);
    assert_eq!(c0.call(WRITE, 0, 15 * B, 4096, &p), ENOSPC);
    let st = pool_status(&d);
    assert_eq!(
        (st.mode.as_str(), st.used_data, st.total_data),
        ("out_of_data_space", 8, 8)
    );
    // Mapped blocks stay writable and readable; the failed block stays unmapped.
    c0.write(4096, &p);
    let mut want = a.clone();
    want[4096..8192].copy_from_slice(&p);
    assert!(read_all(&mut c0, 0, 6 * B) == want);
    assert_eq!(c0.read(6 * B, B as usize), vec![0; B as usize]);
    assert_eq!(mapped_blocks(&d, "t0"), 6);

    // An active thin cannot be deleted; once removed it can, and that frees space.
    msg_fails(&d, "pool", "delete 1");
    remove(&d, "t1");
    msg(&d, "pool", "delete 1");
    let st = pool_status(&d);
    assert_eq!((st.mode.as_str(), st.used_data), ("rw", 6), "{st:?}");
    c0.write(6 * B, &p);
    assert_eq!(c0.read(6 * B, 4096), p);
    assert_eq!(used_data(&d), 7);
    drop(c0);
    stop_and_check(d, &f);
}

fn event_nr(d: &Daemon, dev: &str) -> u64 {
    let out = d.ok(&["info", dev]);
    let l = out
        .lines()
        .find(|l| l.starts_with("Event number:"))
        .unwrap_or_else(|| panic!("no Event number in {out}"));
    l["Event number:".len()..].trim().parse().unwrap()
}

/// The kernel raises a device event (`dm_table_event`: the event number in
/// `info`, what `dmsetup wait` waits for) once when free data blocks reach the
/// low water mark, and on each pool mode change.
#[test]
fn low_water_mark_and_mode_changes_raise_events() {
    let f = Files::new("events", 4 * MIB, 8 * B);
    let d = Daemon::start("events");
    d.create("pool", &f.table(8, 3, &["error_if_no_space"]));
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    write_all(&mut c, 0, &pattern(1, 4 * B as usize));
    assert_eq!(event_nr(&d, "pool"), 0, "event before the low water mark");
    c.write(4 * B, &pattern(2, B as usize)); // 3 free: low water
    assert_eq!(event_nr(&d, "pool"), 1, "no event at the low water mark");
    write_all(&mut c, 5 * B, &pattern(3, 3 * B as usize));
    assert_eq!(event_nr(&d, "pool"), 1, "low water event raised again");
    assert_eq!(c.call(WRITE, 0, 8 * B, 4096, &[1; 4096]), ENOSPC);
    assert_eq!(pool_status(&d).mode, "out_of_data_space");
    assert_eq!(
        event_nr(&d, "pool"),
        2,
        "no event on the switch to out_of_data_space"
    );
    drop(c);
    stop_and_check(d, &f);
}

/// Fill a 4-block pool through thin 0 ("t0", 1 MiB); returns the connection.
fn fill_four(d: &Daemon) -> Client {
    msg(d, "pool", "create_thin 0");
    thin(d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    write_all(&mut c, 0, &pattern(11, 4 * B as usize));
    assert_eq!(used_data(d), 4);
    c
}

/// The kernel (since 4.6; `do_no_space_timeout` in dm-thin.c) fails the queued
/// I/O with ENOSPC when the no-space timeout fires, and switches the pool to
/// `error_if_no_space`, which its status then shows (the table line keeps the
/// requested features).
#[test]
fn no_space_timeout_behaves_like_the_kernel() {
    let (d, f) = pool_daemon(
        "nospace-kernel",
        4 * MIB,
        4,
        &[],
        &["--thin-no-space-timeout", "1"],
    );
    let mut c = fill_four(&d);
    let p = pattern(14, 4096);
    assert_eq!(
        c.call(WRITE, 0, 4 * B, 4096, &p),
        ENOSPC,
        "queued write after the timeout"
    );
    let st = pool_status(&d);
    assert_eq!(
        (st.mode.as_str(), st.space.as_str()),
        ("out_of_data_space", "error_if_no_space")
    );
    assert!(d.ok(&["table", "pool"]).ends_with(" 0 0 \n"));
    assert_eq!(c.call(WRITE, 0, 5 * B, 4096, &p), ENOSPC);
    drop(c);
    stop_and_check(d, &f);
}

#[test]
fn out_of_data_space_growing_pool_completes_queued_write() {
    let (d, f) = pool_daemon("nospace-grow", 4 * MIB, 4, &[], &[]);
    let mut c = fill_four(&d);
    let p = pattern(13, 8192);
    let writer = {
        let sock = d.sock();
        let p = p.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect(&sock, "t0");
            let t = Instant::now();
            let e = c.call(WRITE, 0, 4 * B + 4096, 8192, &p);
            (e, t.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    assert!(!writer.is_finished(), "write to a full pool completed at once");
    assert_eq!(pool_status(&d).mode, "out_of_data_space");

    // Grow the data device: a larger file, a longer table, suspend/resume.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.data)
        .unwrap()
        .set_len(16 * B)
        .unwrap();
    d.ok(&["load", "pool", "--table", &f.table(16, 0, &[])]);
    assert!(!writer.is_finished(), "queued write completed before the resume");
    d.ok(&["suspend", "pool"]);
    d.ok(&["resume", "pool"]);
    let (e, took) = writer.join().unwrap();
    assert_eq!(e, 0, "queued write failed after the pool grew");
    assert!(took < Duration::from_secs(30));
    let st = pool_status(&d);
    assert_eq!(
        (st.mode.as_str(), st.used_data, st.total_data),
        ("rw", 5, 16),
        "{st:?}"
    );
    let mut want = vec![0; B as usize];
    want[4096..4096 + 8192].copy_from_slice(&p);
    assert_eq!(c.read(4 * B, B as usize), want);
    c.write(9 * B, &p);
    assert_eq!(c.read(9 * B, 8192), p);
    drop(c);
    stop_and_check(d, &f);

    // The growth is persistent: the old, shorter table is now refused.
    let d = Daemon::start("nospace-grow2");
    let e = d.fails(&["create", "pool", "--table", &f.table(4, 0, &[])]);
    assert!(!e.is_empty());
    d.create("pool", &f.table(16, 0, &[]));
    let st = pool_status(&d);
    assert_eq!(
        (st.mode.as_str(), st.used_data, st.total_data),
        ("rw", 6, 16),
        "{st:?}"
    );
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 5. Metadata exhaustion.

#[test]
fn metadata_exhaustion_turns_pool_read_only_with_needs_check() {
    // 128 KiB of metadata (32 blocks), plenty of data, no zeroing (small writes).
    let f = Files::new("metafull", 128 * KIB, 16384 * B);
    let table = f.table(16384, 0, &["skip_block_zeroing"]);
    let d = Daemon::start("metafull");
    d.create("pool", &table);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, 16384 * B);
    let mut c = Client::connect(&d.sock(), "t0");
    let vb_of = |i: u64| (i * 7919) % 16384;
    let mut failed_at = None;
    // Scattered blocks (not sequential): many btree leaves fill the metadata.
    // The first 200 are flushed, so committed.
    const FLUSHED: u64 = 200;
    for i in 0..16384u64 {
        let vb = vb_of(i);
        let e = c.call(WRITE, 0, vb * B, 512, &pattern(vb, 512));
        if e != 0 {
            assert_eq!(e, EIO, "write once metadata is exhausted");
            failed_at = Some(i);
            break;
        }
        if i + 1 == FLUSHED {
            assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
        }
    }
    let failed_at = failed_at.expect("32 metadata blocks never ran out");
    assert!(
        failed_at > FLUSHED,
        "metadata ran out after only {failed_at} mappings"
    );
    let st = pool_status(&d);
    eprintln!(
        "metadata exhausted after {failed_at} mappings; status {st:?}; thin 0 keeps {} mapped",
        mapped_blocks(&d, "t0")
    );
    assert_eq!(
        (st.mode.as_str(), st.check.as_str()),
        ("ro", "needs_check"),
        "{st:?}"
    );
    // Read-only: no messages, no new mappings; committed data reads back.
    msg_fails(&d, "pool", "create_thin 1");
    let vb = vb_of(failed_at + 1);
    assert_eq!(c.call(WRITE, 0, vb * B, 512, &[1; 512]), EIO);
    let check_flushed = |c: &mut Client| {
        for i in 0..FLUSHED {
            let vb = vb_of(i);
            assert_eq!(c.read(vb * B, 512), pattern(vb, 512), "flushed block {vb} lost");
        }
    };
    check_flushed(&mut c);
    assert!(mapped_blocks(&d, "t0") >= FLUSHED);
    drop(c);
    remove(&d, "t0");
    drop(d);
    thin_check(&f.meta);

    // After a restart the pool comes back read-only and still needs_check.
    let d = Daemon::start("metafull2");
    d.create("pool", &table);
    let st = pool_status(&d);
    assert_eq!(
        (st.mode.as_str(), st.check.as_str()),
        ("ro", "needs_check"),
        "{st:?}"
    );
    msg_fails(&d, "pool", "create_thin 1");
    thin(&d, "t0", 0, 16384 * B);
    let mut c = Client::connect(&d.sock(), "t0");
    check_flushed(&mut c);
    assert_eq!(c.call(WRITE, 0, vb * B, 512, &[1; 512]), EIO);
    drop(c);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 6. Metadata snapshots.

#[test]
fn reserve_and_release_metadata_snap() {
    let (d, f) = pool_daemon("metasnap", 4 * MIB, 64, &[], &[]);
    msg_fails(&d, "pool", "release_metadata_snap");
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    let a = pattern(21, B as usize);
    c.write(0, &a);
    assert_eq!(pool_status(&d).held, "-");

    msg(&d, "pool", "reserve_metadata_snap");
    let held = pool_status(&d).held;
    assert!(held.parse::<u64>().is_ok_and(|h| h > 0), "held root {held}");
    msg_fails(&d, "pool", "reserve_metadata_snap");
    assert_eq!(pool_status(&d).held, held, "failed reserve changed the held root");

    // Changes after the reserve: a new mapping, an overwrite, a new thin.
    c.write(5 * B, &pattern(22, B as usize));
    c.write(0, &pattern(23, 4096));
    msg(&d, "pool", "create_thin 1");
    let st = pool_status(&d); // commits
    assert_eq!(st.held, held);
    {
        let x = thin_dump(&f.meta, true);
        assert!(x.contains("<device dev_id=\"0\""), "{x}");
        assert!(
            !x.contains("dev_id=\"1\""),
            "thin 1 is newer than the snapshot:\n{x}"
        );
        assert!(x.contains("mapped_blocks=\"1\""), "{x}");
        assert!(x.contains("origin_block=\"0\""), "{x}");
        assert!(
            !x.contains("origin_block=\"5\""),
            "block 5 is newer than the snapshot:\n{x}"
        );
    }
    {
        let x = thin_dump(&f.meta, false);
        assert!(
            x.contains("dev_id=\"1\"") && x.contains("origin_block=\"5\""),
            "{x}"
        );
    }
    // Deleting thin 0 while the snapshot is held: the snapshot keeps its trees,
    // the metadata stays consistent, and the data block of vblock 0 stays in use.
    drop(c);
    remove(&d, "t0");
    msg(&d, "pool", "delete 0");
    assert_eq!(
        used_data(&d),
        1,
        "the held snapshot still references vblock 0's data block"
    );
    d.ok(&["suspend", "pool"]);
    thin_check(&f.meta);
    {
        let x = thin_dump(&f.meta, true);
        assert!(
            x.contains("<device dev_id=\"0\"") && x.contains("origin_block=\"0\""),
            "{x}"
        );
    }
    {
        let x = thin_dump(&f.meta, false);
        assert!(!x.contains("dev_id=\"0\""), "{x}");
    }
    d.ok(&["resume", "pool"]);
    msg(&d, "pool", "release_metadata_snap");
    assert_eq!(pool_status(&d).held, "-");
    assert_eq!(used_data(&d), 0, "releasing the snapshot frees its data block");
    msg_fails(&d, "pool", "release_metadata_snap");
    need("thin_dump");
    {
        let o = Command::new("thin_dump").arg("-m").arg(&f.meta).output().unwrap();
        assert!(!o.status.success(), "thin_dump -m works with no held root");
    }
    // A second reserve/release cycle works.
    msg(&d, "pool", "reserve_metadata_snap");
    assert_ne!(pool_status(&d).held, "-");
    msg(&d, "pool", "release_metadata_snap");
    assert_eq!(pool_status(&d).held, "-");
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 7. Discards.

/// The data block of `f.data` holding `content` (one whole block).
fn find_block(data: &Path, nr_blocks: u64, content: &[u8]) -> u64 {
    (0..nr_blocks)
        .find(|&b| read_at(data, b * B, B as usize) == content)
        .expect("block content not found in the data file")
}

#[test]
fn discard_shared_block_keeps_data_then_frees_after_snapshot_delete() {
    let (d, f) = pool_daemon("discard", 4 * MIB, 64, &[], &[]);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    let (a, b) = (pattern(31, B as usize), pattern(32, B as usize));
    c.write(0, &a);
    c.write(B, &b);
    assert_eq!(used_data(&d), 2);
    let (da, db) = (find_block(&f.data, 64, &a), find_block(&f.data, 64, &b));

    snap(&d, Some("t0"), 1, 0);
    // TRIM of shared block 0 on the origin: unmapped there, data kept.
    assert_eq!(c.call(TRIM, 0, 0, B as u32, &[]), 0);
    assert_eq!(used_data(&d), 2, "a shared block is not freed by a discard");
    assert_eq!(
        read_at(&f.data, da * B, B as usize),
        a,
        "discard of a shared block passed down"
    );
    assert_eq!(c.read(0, B as usize), vec![0; B as usize]);
    assert_eq!(mapped_blocks(&d, "t0"), 1);
    thin(&d, "t1", 1, MIB);
    let mut s = Client::connect(&d.sock(), "t1");
    assert_eq!(s.read(0, B as usize), a, "the snapshot lost its data");
    assert_eq!(s.read(B, B as usize), b);
    drop(s);

    // Delete the snapshot: block 0 (now only the snapshot's) is freed.
    remove(&d, "t1");
    msg(&d, "pool", "delete 1");
    assert_eq!(used_data(&d), 1);
    // Block 1 is now the origin's alone: a TRIM frees it and passes down.
    assert_eq!(c.call(TRIM, 0, B, B as u32, &[]), 0);
    assert_eq!(used_data(&d), 0);
    assert_eq!(mapped_blocks(&d, "t0"), 0);
    assert_eq!(thin_status(&d, "t0").1, "-");
    assert_eq!(
        read_at(&f.data, db * B, B as usize),
        vec![0; B as usize],
        "discard of an unshared block was not passed down"
    );
    assert_eq!(c.read(B, B as usize), vec![0; B as usize]);
    // A partial-block TRIM is advisory: nothing is unmapped. A TRIM over parts
    // of blocks 2 and 4 and all of block 3 unmaps block 3 only.
    for vb in 2..5 {
        c.write(vb * B, &a);
    }
    assert_eq!(c.call(TRIM, 0, 2 * B, 4096, &[]), 0);
    assert_eq!(used_data(&d), 3);
    assert_eq!(c.read(2 * B, B as usize), a);
    assert_eq!(c.call(TRIM, 0, 2 * B + 4096, (2 * B) as u32, &[]), 0);
    assert_eq!(used_data(&d), 2);
    assert_eq!(mapped_blocks(&d, "t0"), 2);
    assert_eq!(c.read(2 * B, B as usize), a);
    assert_eq!(c.read(3 * B, B as usize), vec![0; B as usize]);
    assert_eq!(c.read(4 * B, B as usize), a);
    drop(c);
    stop_and_check(d, &f);
}

/// A discard passed down to the data device holds its data block until the
/// passdown has landed (the kernel's process_prepared_discard_passdown_pt1/pt2
/// raise and drop its count around the passdown): a block freed by the unmap and
/// made allocatable by a commit must not be given to a new write while the
/// passdown can still punch it, or an acknowledged write reads back as zeroes.
/// The passdown is made slow (`serve --test-passdown-delay-ms`) and the pool full,
/// so the discarded block is the only one a new write could get.
#[test]
fn discard_passdown_in_flight_holds_its_block() {
    let (d, f) = pool_daemon(
        "passdown-hold",
        4 * MIB,
        4,
        &[],
        &["--test-passdown-delay-ms", "1500"],
    );
    let mut c = fill_four(&d);
    let old = pattern(11, 4 * B as usize);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    let trimmer = {
        let sock = d.sock();
        std::thread::spawn(move || {
            let mut t = Client::connect(&sock, "t0");
            let t0 = Instant::now();
            let e = t.call(TRIM, 0, 0, B as u32, &[]);
            (e, t0.elapsed())
        })
    };
    // the pool's thread unmaps the block at once; its passdown waits 1.5 s
    std::thread::sleep(Duration::from_millis(300));
    assert!(!trimmer.is_finished(), "the TRIM completed before its passdown");
    let used_while_held = used_data(&d);
    // a commit: the unmapped block is free in the metadata from now on
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    let new = pattern(12, B as usize);
    let t0 = Instant::now();
    c.write(5 * B, &new);
    let write_took = t0.elapsed();
    let (e, trim_took) = trimmer.join().unwrap();
    assert_eq!(e, 0, "TRIM");
    assert!(
        trim_took >= Duration::from_millis(1400),
        "TRIM took {trim_took:?}"
    );
    assert_same(
        &c.read(5 * B, B as usize),
        &new,
        "an acknowledged write to the discarded block, after its passdown",
    );
    assert_same(
        &c.read(0, B as usize),
        &vec![0; B as usize],
        "the discarded block",
    );
    assert_same(&c.read(B, 3 * B as usize), &old[B as usize..], "blocks 1-3");
    assert_eq!(
        used_while_held, 4,
        "a block held by its passdown counts as used (the kernel's inc_data_range)"
    );
    assert!(
        write_took >= Duration::from_millis(800),
        "the write got a block while the only free one was held by a passdown ({write_took:?})"
    );
    let st = pool_status(&d);
    assert_eq!((st.mode.as_str(), st.used_data), ("rw", 4), "{st:?}");
    drop(c);
    stop_and_check(d, &f);
}

/// Writes over the end of a block being discarded and the start of a mapped
/// one: the piece on the first waits in the prison for the discard, the other
/// goes through the pool device, and the discard waits for the pool device's
/// I/O to drain. Once only its waiting piece is left, a request must not hold
/// the pool device, or the write and the discard wait for each other: for ever
/// once two such writes count in the two epochs the drains alternate between
/// (found by the nbd_requests fuzzer in CI on 41830ba: a TRIM, then two
/// WRITE_ZEROES over two blocks). The discards are made slow
/// (`serve --test-discard-delay-ms`) so that the first write arrives before the
/// pool's thread starts draining, the second after its first drain began.
#[test]
fn writes_over_blocks_being_discarded_and_mapped_ones_complete() {
    let (d, f) = pool_daemon(
        "discard-span",
        4 * MIB,
        16,
        &[],
        &["--test-discard-delay-ms", "700"],
    );
    let mut c = fill_four(&d);
    let old = pattern(11, 4 * B as usize);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    let mut t = Client::connect(&d.sock(), "t0");
    let t0 = Instant::now();
    t.send(TRIM, 0, 1, 0, B as u32, &[]);
    t.send(TRIM, 0, 2, 2 * B, B as u32, &[]);
    std::thread::sleep(Duration::from_millis(200));
    let (w1, w2) = (pattern(13, 8 * KIB as usize), pattern(14, 8 * KIB as usize));
    c.send(WRITE, 0, 3, B - 4 * KIB, w1.len() as u32, &w1);
    assert!(
        !reply_ready(&c, Duration::from_millis(200)),
        "the first write was answered before the discard of its first block"
    );
    std::thread::sleep(Duration::from_millis(1400).saturating_sub(t0.elapsed()));
    let mut c2 = Client::connect(&d.sock(), "t0");
    c2.send(WRITE, 0, 4, 3 * B - 4 * KIB, w2.len() as u32, &w2);
    for (k, cookie) in [(0, 1), (0, 2), (1, 3), (2, 4)] {
        let k = [&mut t, &mut c, &mut c2].into_iter().nth(k).unwrap();
        assert!(
            reply_ready(k, Duration::from_secs(10)),
            "request {cookie} was never answered"
        );
        assert_eq!(k.reply(None), (cookie, 0), "request {cookie}");
    }
    let mut want = old.clone();
    want[..B as usize].fill(0);
    want[2 * B as usize..3 * B as usize].fill(0);
    want[(B - 4 * KIB) as usize..(B + 4 * KIB) as usize].copy_from_slice(&w1);
    want[(3 * B - 4 * KIB) as usize..(3 * B + 4 * KIB) as usize].copy_from_slice(&w2);
    assert_same(&c.read(0, 4 * B as usize), &want, "blocks 0-3");
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    drop((c, c2, t));
    stop_and_check(d, &f);
}

#[test]
fn discard_features_no_passdown_and_ignore() {
    let f = Files::new("discard-feat", 4 * MIB, 64 * B);
    let g = Files::new("discard-feat2", 4 * MIB, 64 * B);
    let d = Daemon::start("discard-feat");
    d.create("pool", &f.table(64, 0, &["no_discard_passdown"]));
    d.create("pool2", &g.table(64, 0, &["ignore_discard"]));
    msg(&d, "pool", "create_thin 0");
    msg(&d, "pool2", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    d.create("u0", &format!("0 {} thin /dev/mapper/pool2 0", MIB / 512));
    let a = pattern(41, B as usize);

    // no_discard_passdown: unmapped and freed, but the data device keeps it.
    let mut c = Client::connect(&d.sock(), "t0");
    c.write(0, &a);
    let da = find_block(&f.data, 64, &a);
    assert_eq!(used_data(&d), 1);
    assert_eq!(c.call(TRIM, 0, 0, B as u32, &[]), 0);
    assert_eq!(used_data(&d), 0);
    assert_eq!(c.read(0, B as usize), vec![0; B as usize]);
    assert_eq!(read_at(&f.data, da * B, B as usize), a, "discard passed down");

    // ignore_discard: the thin cannot discard (the kernel's "Operation not
    // supported"), so its export does not offer TRIM, and a TRIM sent anyway is
    // refused as the protocol asks for an unadvertised command.
    let mut u = Client::connect(&d.sock(), "u0");
    assert_eq!(c.flags & TF_SEND_TRIM, TF_SEND_TRIM, "t0 offers TRIM");
    assert_eq!(
        u.flags & TF_SEND_TRIM,
        0,
        "u0 offers TRIM in an ignore_discard pool"
    );
    u.write(0, &a);
    assert_eq!(pool_status_of(&d, "pool2").used_data, 1);
    assert_eq!(
        u.call(TRIM, 0, 0, B as u32, &[]),
        EINVAL,
        "TRIM on ignore_discard"
    );
    assert_eq!(pool_status_of(&d, "pool2").used_data, 1);
    assert_eq!(u.read(0, B as usize), a);
    drop((c, u));
    drop(d);
    thin_check(&f.meta);
    thin_check(&g.meta);
}

// ---------------------------------------------------------------------------
// 8. Transaction ids.

#[test]
fn set_transaction_id_is_compare_and_swap() {
    let (d, f) = pool_daemon("txn", 4 * MIB, 16, &[], &[]);
    assert_eq!(pool_status(&d).txn, 0);
    msg(&d, "pool", "set_transaction_id 0 5");
    assert_eq!(pool_status(&d).txn, 5);
    let e = msg_fails(&d, "pool", "set_transaction_id 0 6");
    assert!(!e.trim().is_empty());
    assert_eq!(pool_status(&d).txn, 5, "failed CAS changed the id");
    msg(&d, "pool", "set_transaction_id 5 6");
    assert_eq!(pool_status(&d).txn, 6);
    msg_fails(&d, "pool", "set_transaction_id 6");
    msg_fails(&d, "pool", "set_transaction_id x 7");
    assert_eq!(pool_status(&d).txn, 6);
    drop(d);
    thin_check(&f.meta);
    // The id is persistent.
    let d = Daemon::start("txn2");
    d.create("pool", &f.table(16, 0, &[]));
    assert_eq!(pool_status(&d).txn, 6);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 9. External origins.

#[test]
fn external_origin_smaller_equal_larger() {
    const SIZE: u64 = MIB; // 16 blocks
    let (d, f) = pool_daemon("extorig", 4 * MIB, 128, &[], &[]);
    fill_garbage(&f.data);
    // Smaller with a fractional tail, equal, larger with a fractional tail.
    let cases = [5 * B + 7 * 512, SIZE, SIZE + 2 * B + 3 * 512];
    for (i, &osize) in cases.iter().enumerate() {
        let id = i as u64;
        let orig = pattern(50 + id, osize as usize);
        let op = f.s.path(&format!("origin{i}"));
        std::fs::write(&op, &orig).unwrap();
        msg(&d, "pool", &format!("create_thin {id}"));
        let name = format!("e{i}");
        d.create(
            &name,
            &format!("0 {} thin /dev/mapper/pool {id} {}", SIZE / 512, op.display()),
        );
        let mut c = Client::connect(&d.sock(), &name);
        let mut want = vec![0u8; SIZE as usize];
        let n = osize.min(SIZE) as usize;
        want[..n].copy_from_slice(&orig[..n]);
        assert!(
            read_all(&mut c, 0, SIZE) == want,
            "case {i}: unmapped reads are not origin-then-zeroes"
        );
        // Partial writes: inside the origin, in the block holding its end (or
        // the last block), beyond its end, and one whole block.
        let tail_block = if osize < SIZE { osize / B } else { SIZE / B - 1 };
        let writes = [
            (2 * B + 1024, 3072),
            (tail_block * B, 4096),
            (12 * B + 512, 1024),
            (B, B),
        ];
        let mut blocks = BTreeSet::new();
        for (k, &(off, len)) in writes.iter().enumerate() {
            let p = pattern(60 + id * 10 + k as u64, len as usize);
            c.write(off, &p);
            want[off as usize..(off + len) as usize].copy_from_slice(&p);
            blocks.insert(off / B);
        }
        let got = read_all(&mut c, 0, SIZE);
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
            panic!(
                "case {i} (origin {osize} bytes): first difference at byte {first} (block {}, offset {})",
                first as u64 / B,
                first as u64 % B
            );
        }
        assert_eq!(mapped_blocks(&d, &name), blocks.len() as u64);
        assert_eq!(std::fs::read(&op).unwrap(), orig, "case {i}: origin modified");
        // Reactivated, the same view.
        drop(c);
        remove(&d, &name);
        d.create(
            &name,
            &format!("0 {} thin /dev/mapper/pool {id} {}", SIZE / 512, op.display()),
        );
        let mut c = Client::connect(&d.sock(), &name);
        assert!(read_all(&mut c, 0, SIZE) == want, "case {i} after reactivation");

        // A snapshot of it, over the same origin: same view; its own partial
        // write into an unmapped block copies from the origin too.
        let sid = 10 + id;
        let sname = format!("s{i}");
        snap(&d, Some(&name), sid, id);
        d.create(
            &sname,
            &format!("0 {} thin /dev/mapper/pool {sid} {}", SIZE / 512, op.display()),
        );
        let mut s = Client::connect(&d.sock(), &sname);
        assert!(read_all(&mut s, 0, SIZE) == want, "case {i}: snapshot view");
        let mut swant = want.clone();
        let p = pattern(90 + id, 2048);
        s.write(4 * B + 1024, &p);
        swant[(4 * B + 1024) as usize..(4 * B + 3072) as usize].copy_from_slice(&p);
        assert!(
            read_all(&mut s, 0, SIZE) == swant,
            "case {i}: snapshot after write"
        );
        assert!(
            read_all(&mut c, 0, SIZE) == want,
            "case {i}: origin after snapshot write"
        );

        // A whole-block TRIM unmaps: the external origin shows through again.
        assert_eq!(c.call(TRIM, 0, B, B as u32, &[]), 0);
        let n = (osize.min(2 * B) as usize).max(B as usize);
        want[B as usize..2 * B as usize].fill(0);
        want[B as usize..n].copy_from_slice(&orig[B as usize..n]);
        assert!(read_all(&mut c, 0, SIZE) == want, "case {i}: after TRIM");
        assert_eq!(mapped_blocks(&d, &name), blocks.len() as u64 - 1);
        assert!(
            read_all(&mut s, 0, SIZE) == swant,
            "case {i}: snapshot after origin TRIM"
        );
        assert_eq!(std::fs::read(&op).unwrap(), orig, "case {i}: origin modified");
    }
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// Metadata device growth.

#[test]
fn metadata_device_grows_on_reload() {
    let (d, f) = pool_daemon("metagrow", 256 * KIB, 64, &[], &[]);
    assert_eq!(pool_status(&d).total_meta, 64);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    let a = pattern(95, 2 * B as usize);
    c.write(0, &a);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.meta)
        .unwrap()
        .set_len(MIB)
        .unwrap();
    let t = f.table(64, 0, &[]);
    d.reload("pool", &t);
    let st = pool_status(&d);
    assert_eq!((st.total_meta, st.mode.as_str()), (256, "rw"), "{st:?}");
    assert_eq!(status(&d, "pool")[8], "64", "metadata low watermark = blocks / 4");
    c.write(5 * B, &a);
    assert_eq!(read_all(&mut c, 0, 2 * B), a);
    assert_eq!(read_all(&mut c, 5 * B, 2 * B), a);
    drop(c);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 10. Table and status formats, bad tables.

fn minor_of(d: &Daemon, dev: &str) -> String {
    let out = d.ok(&["info", dev]);
    let l = out
        .lines()
        .find(|l| l.starts_with("Major, minor:"))
        .unwrap_or_else(|| panic!("no Major, minor in {out}"));
    let v: Vec<&str> = l["Major, minor:".len()..].split(',').map(str::trim).collect();
    format!("{}:{}", v[0], v[1])
}

#[test]
fn table_and_status_formats() {
    let f = Files::new("formats", 4 * MIB, 64 * B);
    let d = Daemon::start("formats");
    d.create("pool", &f.table(64, 10, &[]));
    assert_eq!(
        d.ok(&["table", "pool"]),
        format!(
            "0 {} thin-pool {} {} {BS} 10 0 \n",
            64 * BS,
            f.meta.display(),
            f.data.display()
        )
    );
    let st = status_line(&d, "pool");
    let total_meta = 4 * MIB / 4096;
    let lw = (total_meta / 4).min(1024);
    let ps = pool_status(&d);
    let used_meta = ps.used_meta;
    assert_eq!(ps.total_meta, total_meta);
    assert!(used_meta > 0 && used_meta < total_meta);
    assert_eq!(
        st,
        format!(
            "0 {} thin-pool 0 {used_meta}/{total_meta} 0/64 - rw discard_passdown queue_if_no_space - {lw} ",
            64 * BS
        )
    );
    msg(&d, "pool", "create_thin 7");
    thin(&d, "t7", 7, MIB);
    assert_eq!(
        d.ok(&["table", "t7"]),
        format!("0 {} thin {} 7\n", MIB / 512, minor_of(&d, "pool"))
    );
    assert_eq!(status_line(&d, "t7"), format!("0 {} thin 0 -", MIB / 512));
    let mut c = Client::connect(&d.sock(), "t7");
    c.write(3 * B + 512, &[9; 512]);
    assert_eq!(thin_status(&d, "t7"), (BS, (4 * BS - 1).to_string()));
    drop(c);

    // Features: echoed in the kernel's order with a count, reflected in status.
    let g = Files::new("formats2", 4 * MIB, 64 * B);
    let h = Files::new("formats3", 4 * MIB, 64 * B);
    d.create(
        "p2",
        &g.table(
            64,
            5,
            &["error_if_no_space", "no_discard_passdown", "skip_block_zeroing"],
        ),
    );
    assert_eq!(
        d.ok(&["table", "p2"]),
        format!(
            "0 {} thin-pool {} {} {BS} 5 3 skip_block_zeroing no_discard_passdown error_if_no_space \n",
            64 * BS,
            g.meta.display(),
            g.data.display()
        )
    );
    let s2 = pool_status_of(&d, "p2");
    assert_eq!(
        (s2.discard.as_str(), s2.space.as_str()),
        ("no_discard_passdown", "error_if_no_space")
    );
    d.create("p3", &h.table(64, 0, &["IGNORE_DISCARD"]));
    assert_eq!(pool_status_of(&d, "p3").discard, "ignore_discard");
    assert!(d.ok(&["table", "p3"]).ends_with(" 0 1 ignore_discard \n"));

    // Bad tables: one-line errors, nothing created.
    let k = Files::new("formats4", 4 * MIB, 64 * B);
    let meta = k.meta.display().to_string();
    let data = k.data.display().to_string();
    let lin = f.s.sparse("lin", MIB);
    d.create("lin", &format!("0 2048 linear {} 0", lin.display()));
    let bad = [
        format!("0 8192 thin-pool {meta} {data} 100 0"),
        format!("0 8192 thin-pool {meta} {data} 192 0"),
        format!("0 8192 thin-pool {meta} {data} 128 0 1 frobnicate"),
        format!("0 8192 thin-pool {meta} {data} 128 0 2 skip_block_zeroing"),
        format!("0 8192 thin-pool {meta} {data} 128 0 1 read_only"),
        format!("0 8192 thin-pool {meta} {data} 128"),
        "0 8192 thin /dev/mapper/pool 99".to_string(),
        "0 8192 thin /dev/mapper/lin 0".to_string(),
        "0 8192 thin /dev/mapper/nosuch 0".to_string(),
        format!("0 8192 thin /dev/mapper/pool {}", 1u64 << 24),
    ];
    for t in &bad {
        let o = d.cli_in(&["create", "bad"], t);
        assert!(!o.status.success(), "table accepted: {t}");
        let e = String::from_utf8_lossy(&o.stderr);
        assert_eq!(e.trim_end().lines().count(), 1, "error should be one line: {e}");
        d.fails(&["info", "bad"]);
    }
    // A reload with another block size is refused; the pool keeps working.
    let other = f.table(64, 10, &[]).replace(&format!(" {BS} 10"), " 256 10");
    d.fails(&["load", "pool", "--table", &other]);
    assert_eq!(pool_status(&d).mode, "rw");
    drop(d);
    for x in [&f, &g, &h] {
        thin_check(&x.meta);
    }
}

// ---------------------------------------------------------------------------
// 11. FUA and flush across SIGKILL.

#[test]
fn fua_and_flush_survive_sigkill() {
    let f = Files::new("fua", 4 * MIB, 64 * B);
    let table = f.table(64, 0, &[]);
    let mut d = Daemon::start("fua");
    d.create("pool", &table);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    assert_ne!(c.flags & (1 << 3), 0, "thin export does not advertise FUA");
    assert_ne!(c.flags & (1 << 2), 0, "thin export does not advertise FLUSH");
    // Let the metadata settle (create_thin was committed), then a FUA write to an
    // unprovisioned block, and kill at once: well within the 1 s commit period.
    let a = pattern(71, 8192);
    assert_eq!(c.call(WRITE, FLAG_FUA, 3 * B + 4096, 8192, &a), 0);
    d.kill9();
    drop(c);
    drop(d);
    thin_check(&f.meta);

    let mut d = Daemon::start("fua2");
    d.create("pool", &table);
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    let mut want = vec![0u8; B as usize];
    want[4096..4096 + 8192].copy_from_slice(&a);
    assert_eq!(c.read(3 * B, B as usize), want, "FUA write lost by SIGKILL");
    assert_eq!(mapped_blocks(&d, "t0"), 1);

    // Write + FLUSH, then SIGKILL.
    let b = pattern(72, B as usize);
    c.write(6 * B, &b);
    c.write(3 * B, &b[..4096]);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    d.kill9();
    drop(c);
    drop(d);
    thin_check(&f.meta);

    let d = Daemon::start("fua3");
    d.create("pool", &table);
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    assert_eq!(c.read(6 * B, B as usize), b, "flushed write lost by SIGKILL");
    want[..4096].copy_from_slice(&b[..4096]);
    assert_eq!(c.read(3 * B, B as usize), want);
    assert_eq!(mapped_blocks(&d, "t0"), 2);
    drop(c);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 12. read_only by table: the mode follows the pool table (at resume).

/// Checks a pool "pool" in read-only mode with thin 0 active on `c`, block 0
/// mapped.
fn assert_read_only(d: &Daemon, c: &mut Client) {
    let st = pool_status(d);
    assert_eq!((st.mode.as_str(), st.check.as_str()), ("ro", "-"), "{st:?}");
    msg_fails(d, "pool", "create_thin 1");
    // Mapped, unshared blocks stay writable; new mappings are refused.
    let p = pattern(82, 4096);
    assert_eq!(c.call(WRITE, 0, 0, 4096, &p), 0);
    assert_eq!(c.read(0, 4096), p);
    assert_eq!(c.call(WRITE, 0, 5 * B, 4096, &p), EIO);
    assert_eq!(mapped_blocks(d, "t0"), 1);
}

fn reload(d: &Daemon, table: &str) {
    d.reload("pool", table);
}

#[test]
fn live_pool_reloaded_read_only_and_back() {
    let (d, f) = pool_daemon("readonly", 4 * MIB, 64, &[], &[]);
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    c.write(0, &pattern(81, B as usize));
    reload(&d, &f.table(64, 0, &["read_only"]));
    assert!(d.ok(&["table", "pool"]).ends_with(" 0 1 read_only \n"));
    assert_read_only(&d, &mut c);
    reload(&d, &f.table(64, 0, &[]));
    assert_eq!(pool_status(&d).mode, "rw");
    let p = pattern(83, 4096);
    c.write(5 * B, &p);
    assert_eq!(c.read(5 * B, 4096), p);
    msg(&d, "pool", "create_thin 1");
    drop(c);
    stop_and_check(d, &f);
}

#[test]
fn read_only_pool_reloaded_writable() {
    let f = Files::new("readonly2", 4 * MIB, 64 * B);
    let d = Daemon::start("readonly2");
    // read_only never formats.
    let e = d.fails(&["create", "pool", "--table", &f.table(64, 0, &["read_only"])]);
    assert!(!e.is_empty());
    d.create("pool", &f.table(64, 0, &[]));
    msg(&d, "pool", "create_thin 0");
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    c.write(0, &pattern(81, B as usize));
    drop(c);
    drop(d);
    thin_check(&f.meta);

    let d = Daemon::start("readonly3");
    d.create("pool", &f.table(64, 0, &["read_only"]));
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    assert_read_only(&d, &mut c);
    reload(&d, &f.table(64, 0, &[]));
    assert_eq!(
        pool_status(&d).mode,
        "rw",
        "pool stays read-only after a writable reload"
    );
    let p = pattern(83, 4096);
    c.write(5 * B, &p);
    assert_eq!(c.read(5 * B, 4096), p);
    msg(&d, "pool", "create_thin 1");
    drop(c);
    stop_and_check(d, &f);
}

// ---------------------------------------------------------------------------
// 13. Message argument rules.

#[test]
fn pool_message_rules() {
    let (d, f) = pool_daemon("messages", 4 * MIB, 16, &[], &[]);
    msg(&d, "pool", "create_thin 0");
    msg_fails(&d, "pool", "create_thin 0");
    msg_fails(&d, "pool", &format!("create_thin {}", 1u64 << 24));
    msg(&d, "pool", &format!("create_thin {}", (1u64 << 24) - 1));
    msg_fails(&d, "pool", "create_snap 1 9");
    msg_fails(&d, "pool", "create_snap 0 0");
    msg(&d, "pool", "create_snap 1 0");
    msg_fails(&d, "pool", "delete 9");
    msg_fails(&d, "pool", "create_thin");
    msg_fails(&d, "pool", "frobnicate 1");
    // Deleting the origin leaves its snapshot usable.
    thin(&d, "t0", 0, MIB);
    let mut c = Client::connect(&d.sock(), "t0");
    let a = pattern(91, B as usize);
    c.write(0, &a);
    drop(c);
    snap(&d, Some("t0"), 2, 0);
    remove(&d, "t0");
    msg(&d, "pool", "delete 0");
    thin(&d, "t2", 2, MIB);
    let mut c = Client::connect(&d.sock(), "t2");
    assert_eq!(c.read(0, B as usize), a);
    assert_eq!(used_data(&d), 1);
    drop(c);
    remove(&d, "t2");
    msg(&d, "pool", "delete 2");
    assert_eq!(used_data(&d), 0);
    stop_and_check(d, &f);
}
