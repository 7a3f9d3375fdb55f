//! Growing a full thin pool under I/O, as LVM's `lvextend` of a full pool does
//! (issue 29, item 2): the pool is suspended while a write waits for data space,
//! its data device grows, the pool is reloaded with the longer table and resumed,
//! and the waiting write completes. The kernel's pool presuspend suspends the
//! pool's active thins internally (noflush), which sends what waits for space back
//! to wait for the resume (`pool_suspend_active_thins` in dm-thin.c); the pool's
//! resume resumes them.

use crate::common;
use crate::thin_util;

use common::nbd::Client;
use common::{need, Daemon, Scratch};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KIB: u64 = 1024;
use common::MIB;
/// The pool's data block: 64 KiB (128 sectors).
const B: u64 = 64 * KIB;
/// The thin's size: 16 blocks.
const THIN: u64 = 16 * B;

struct Pool {
    meta: PathBuf,
    data: PathBuf,
    features: &'static [&'static str],
}

impl Pool {
    fn table(&self, blocks: u64) -> String {
        let mut t = format!(
            "0 {} thin-pool {} {} {} 0",
            blocks * B / 512,
            self.meta.display(),
            self.data.display(),
            B / 512
        );
        if !self.features.is_empty() {
            t.push_str(&format!(" {} {}", self.features.len(), self.features.join(" ")));
        }
        t
    }
}

/// qemu-io writing `byte` over `[off, off+len)` of export `t`, as a child.
fn qemu_write(d: &Daemon, off: u64, len: u64, byte: u8) -> Child {
    Command::new("qemu-io")
        .args(["-f", "raw", "-c", &format!("write -P {byte} {off} {len}")])
        .arg(d.uri("t"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn qemu-io")
}

/// Wait (at most `limit`) for `c` to exit; its exit status, stdout and stderr.
fn finish(mut c: Child, limit: Duration) -> (bool, String, String) {
    let t0 = Instant::now();
    while c.try_wait().expect("qemu-io status").is_none() {
        if t0.elapsed() > limit {
            let _ = c.kill();
            let o = c.wait_with_output().expect("qemu-io output");
            panic!(
                "qemu-io did not finish within {limit:?}: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = c.wait_with_output().expect("qemu-io output");
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// A write qemu-io reported done in full.
fn assert_wrote(out: (bool, String, String), len: u64, what: &str) {
    let (ok, stdout, stderr) = out;
    assert!(ok, "{what}: qemu-io failed: {stdout}{stderr}");
    assert!(
        stdout.contains(&format!("wrote {len}/{len} bytes")) && !stdout.contains("failed"),
        "{what}: qemu-io says: {stdout}{stderr}"
    );
}

/// `dmkit status pool`'s (mode, used data blocks, total data blocks).
fn pool_space(d: &Daemon) -> (String, u64, u64) {
    let st = d.ok(&["status", "pool"]);
    let w: Vec<&str> = st.split_whitespace().collect();
    assert_eq!(w.get(2), Some(&"thin-pool"), "{st}");
    let (used, total) = w[5].split_once('/').expect("used/total data");
    (
        w[7].to_string(),
        used.parse().expect("used"),
        total.parse().expect("total"),
    )
}

fn grow_file(p: &Path, bytes: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .expect("open data file")
        .set_len(bytes)
        .expect("grow data file");
}

/// A pool of 4 data blocks (4 MiB of metadata), thin 0 of 16 blocks as `t`,
/// its first 4 blocks written with 0x11 by qemu-io: the pool is full.
fn full_pool(tag: &str, features: &'static [&'static str]) -> (Daemon, Pool, Scratch) {
    need("qemu-io");
    let s = Scratch::new(tag);
    let pool = Pool {
        meta: s.sparse("meta", 4 * MIB),
        data: s.sparse("data", 4 * B),
        features,
    };
    let d = Daemon::start(tag);
    d.create("pool", &pool.table(4));
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("t", &format!("0 {} thin /dev/mapper/pool 0", THIN / 512));
    assert_wrote(
        finish(qemu_write(&d, 0, 4 * B, 0x11), Duration::from_secs(10)),
        4 * B,
        "filling the pool",
    );
    assert_eq!(pool_space(&d), ("rw".to_string(), 4, 4));
    (d, pool, s)
}

/// `dmkit suspend ARGS` returns within two seconds.
fn suspend_at_once(d: &Daemon, args: &[&str]) {
    let t = Instant::now();
    d.ok(&[&["suspend"], args].concat());
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "suspend {args:?} took {:?}",
        t.elapsed()
    );
}

/// The pool's data file grows to 16 blocks; the pool is reloaded with the
/// longer table and resumed.
fn grow_pool(d: &Daemon, pool: &Pool) {
    grow_file(&pool.data, 16 * B);
    d.ok(&["load", "pool", "--table", &pool.table(16)]);
    d.ok(&["resume", "pool"]);
}

/// The thin's contents, read whole through NBD.
fn read_thin(d: &Daemon) -> Vec<u8> {
    let mut c = Client::connect(&d.sock(), "t");
    let got = c.read(0, THIN as usize);
    drop(c);
    d.wait_open_count("t", 0);
    got
}

/// Remove both devices and run the reference thin_check on the metadata.
fn remove_and_check(d: Daemon, pool: &Pool) {
    d.remove_closed("t");
    d.remove_closed("pool");
    drop(d);
    let (ok, out, err) = thin_util::thin_check(&pool.meta, &[]);
    assert!(ok, "reference thin_check failed: {out}{err}");
}

/// LVM's sequence with a write waiting for space: the write covers the last
/// written block and the next (unwritten) one, so part of it is already mapped
/// through the pool device when the rest waits for space. `dmkit suspend pool`
/// (`noflush`: with --noflush) returns within two seconds, the write still
/// waiting; the data file grows from 4 to 16 blocks, the pool is reloaded and
/// resumed, the write completes, the thin reads back what was written, the
/// pool's status shows 16 data blocks (6 used), a write to a new block works,
/// and the reference thin_check passes on the metadata afterwards.
fn grow_full_pool_under_io(tag: &str, noflush: bool) {
    let (d, pool, _s) = full_pool(tag, &[]);
    let waiting = qemu_write(&d, 3 * B, 2 * B, 0x22);
    std::thread::sleep(Duration::from_millis(500));
    let mut waiting = waiting;
    assert!(
        waiting.try_wait().expect("qemu-io status").is_none(),
        "a write to a full pool completed at once"
    );
    assert_eq!(pool_space(&d).0, "out_of_data_space");

    // with a write waiting for space
    suspend_at_once(
        &d,
        if noflush {
            &["pool", "--noflush"]
        } else {
            &["pool"]
        },
    );
    assert_eq!(d.info_line("pool", "State:"), "State:             SUSPENDED");
    // the thin is suspended for the pool's sake only: its state does not say so
    assert_eq!(d.info_line("t", "State:"), "State:             ACTIVE");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        waiting.try_wait().expect("qemu-io status").is_none(),
        "the waiting write completed while the pool was suspended"
    );

    grow_pool(&d, &pool);
    assert_wrote(
        finish(waiting, Duration::from_secs(10)),
        2 * B,
        "the write that waited for space",
    );
    assert_eq!(pool_space(&d), ("rw".to_string(), 5, 16));

    let mut want = vec![0u8; THIN as usize];
    want[..(3 * B) as usize].fill(0x11);
    want[(3 * B) as usize..(5 * B) as usize].fill(0x22);
    assert!(
        read_thin(&d) == want,
        "the thin does not read back what was written"
    );

    // a new block of the grown pool
    assert_wrote(
        finish(qemu_write(&d, 9 * B, B, 0x33), Duration::from_secs(10)),
        B,
        "a write after the growth",
    );
    want[(9 * B) as usize..(10 * B) as usize].fill(0x33);
    assert!(read_thin(&d) == want, "the thin does not read back the new block");
    assert_eq!(pool_space(&d), ("rw".to_string(), 6, 16));
    assert_eq!(d.info_line("t", "State:"), "State:             ACTIVE");
    remove_and_check(d, &pool);
}

#[test]
fn full_pool_grows_under_a_waiting_write() {
    grow_full_pool_under_io("grow-flush", false);
}

#[test]
fn full_pool_grows_under_a_waiting_write_noflush() {
    grow_full_pool_under_io("grow-noflush", true);
}

/// With `error_if_no_space` nothing waits: the write that needs a new block fails
/// at once with ENOSPC (the part of it on the mapped block lands), the pool
/// suspends at once, and after the growth the same write succeeds.
#[test]
fn error_if_no_space_fails_the_write_then_the_pool_grows() {
    let (d, pool, _s) = full_pool("grow-error", &["error_if_no_space"]);
    let (ok, out, err) = finish(qemu_write(&d, 3 * B, 2 * B, 0x22), Duration::from_secs(5));
    assert!(
        !ok || out.contains("failed"),
        "a write to a full error_if_no_space pool succeeded: {out}{err}"
    );
    assert!(
        format!("{out}{err}").contains("No space left on device"),
        "qemu-io did not see ENOSPC: {out}{err}"
    );
    suspend_at_once(&d, &["pool"]);
    grow_pool(&d, &pool);
    assert_eq!(pool_space(&d), ("rw".to_string(), 4, 16));
    assert_wrote(
        finish(qemu_write(&d, 3 * B, 2 * B, 0x22), Duration::from_secs(10)),
        2 * B,
        "the write after the growth",
    );
    let mut want = vec![0u8; THIN as usize];
    want[..(3 * B) as usize].fill(0x11);
    want[(3 * B) as usize..(5 * B) as usize].fill(0x22);
    assert!(
        read_thin(&d) == want,
        "the thin does not read back what was written"
    );
    assert_eq!(pool_space(&d), ("rw".to_string(), 5, 16));
    remove_and_check(d, &pool);
}

/// The user's suspend of a thin and its pool's internal one nest, as in the
/// kernel. LVM's order first, with a write waiting for space: `suspend t`, then
/// `suspend pool` (each within two seconds), grow, `resume pool`: the thin stays
/// suspended (its info says so) and the write still waits; `resume t`: the write
/// completes. Then the other way round: while the pool is suspended, a write to a
/// new block waits; `suspend t` and `resume t` return at once and the write still
/// waits for the pool; `resume pool`: it completes. The data reads back and the
/// reference thin_check passes.
#[test]
fn thin_and_pool_suspends_nest() {
    let (d, pool, _s) = full_pool("grow-nest", &[]);
    let mut waiting = qemu_write(&d, 3 * B, 2 * B, 0x22);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        waiting.try_wait().expect("qemu-io status").is_none(),
        "a write to a full pool completed at once"
    );
    for dev in ["t", "pool"] {
        suspend_at_once(&d, &[dev]);
    }
    grow_pool(&d, &pool);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        waiting.try_wait().expect("qemu-io status").is_none(),
        "the write completed while its thin was suspended"
    );
    assert_eq!(d.info_line("t", "State:"), "State:             SUSPENDED");
    d.ok(&["resume", "t"]);
    assert_wrote(
        finish(waiting, Duration::from_secs(10)),
        2 * B,
        "the write that waited for space",
    );

    d.ok(&["suspend", "pool"]);
    let mut second = qemu_write(&d, 8 * B, B, 0x44);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        second.try_wait().expect("qemu-io status").is_none(),
        "a write completed while the pool was suspended"
    );
    let t = Instant::now();
    d.ok(&["suspend", "t"]);
    assert_eq!(d.info_line("t", "State:"), "State:             SUSPENDED");
    d.ok(&["resume", "t"]);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "suspend and resume of the thin took {:?} with its pool suspended",
        t.elapsed()
    );
    assert_eq!(d.info_line("t", "State:"), "State:             ACTIVE");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        second.try_wait().expect("qemu-io status").is_none(),
        "the thin's resume let a write through while its pool was suspended"
    );
    d.ok(&["resume", "pool"]);
    assert_wrote(
        finish(second, Duration::from_secs(10)),
        B,
        "the write sent while the pool was suspended",
    );

    let mut want = vec![0u8; THIN as usize];
    want[..(3 * B) as usize].fill(0x11);
    want[(3 * B) as usize..(5 * B) as usize].fill(0x22);
    want[(8 * B) as usize..(9 * B) as usize].fill(0x44);
    assert!(
        read_thin(&d) == want,
        "the thin does not read back what was written"
    );
    assert_eq!(pool_space(&d), ("rw".to_string(), 6, 16));
    remove_and_check(d, &pool);
}
