//! Device lifecycle: load/suspend/resume, removal rules, table cycles, and the
//! timing targets (delay, flakey) as seen through NBD.

use crate::common;

use common::nbd::{self, Client, FLUSH, READ, WRITE};
use common::{need, pattern, read_at, Daemon};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EIO: u32 = 5;
use common::MIB;

/// A sparse file of `mib` MiB whose first `fill` bytes are `pattern(seed)`.
fn file_with(d: &Daemon, name: &str, mib: u64, seed: u64, fill: usize) -> PathBuf {
    let p = d.dir.sparse(name, mib * MIB);
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&pattern(seed, fill), 0).unwrap();
    p
}

/// Wait (up to 3 s) until `f` holds.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn load_keeps_live_table_until_resume() {
    let mut d = Daemon::start("load");
    let a = file_with(&d, "a", 4, 1, MIB as usize);
    let b = file_with(&d, "b", 8, 2, MIB as usize);
    d.create("dev", &format!("0 8192 linear {} 0", a.display()));
    let mut c = Client::connect(&d.sock(), "dev");
    assert_eq!(c.size, 4 * MIB);
    assert_eq!(d.info_line("dev", "Tables present:"), "Tables present:    LIVE");

    d.ok(&[
        "load",
        "dev",
        "--table",
        &format!("0 16384 linear {} 0", b.display()),
    ]);
    assert_eq!(
        d.info_line("dev", "Tables present:"),
        "Tables present:    LIVE & INACTIVE"
    );
    assert_eq!(
        d.ok(&["table", "dev"]),
        format!("0 8192 linear {} 0\n", a.display())
    );
    // The live table still serves: reads come from a, writes go to a.
    assert_eq!(c.read(0, 4096), pattern(1, 4096));
    c.write(2 * MIB, &[0xA1; 4096]);
    assert_eq!(read_at(&a, 2 * MIB, 4096), vec![0xA1; 4096]);
    assert_eq!(read_at(&b, 2 * MIB, 4096), vec![0; 4096]);
    assert_eq!(
        Client::connect(&d.sock(), "dev").size,
        4 * MIB,
        "size changed before resume"
    );

    d.ok(&["resume", "dev"]);
    assert_eq!(d.info_line("dev", "Tables present:"), "Tables present:    LIVE");
    assert_eq!(
        d.ok(&["table", "dev"]),
        format!("0 16384 linear {} 0\n", b.display())
    );
    // The same connection now reads b; a new one sees the new size.
    assert_eq!(c.read(0, 4096), pattern(2, 4096));
    let mut c2 = Client::connect(&d.sock(), "dev");
    assert_eq!(c2.size, 8 * MIB);
    c2.write(6 * MIB, &[0xB2; 4096]);
    assert_eq!(read_at(&b, 6 * MIB, 4096), vec![0xB2; 4096]);
    assert!(d.alive());
}

#[test]
fn io_waits_while_suspended() {
    let mut d = Daemon::start("susp");
    let f = d.dir.sparse("disk", 4 * MIB);
    d.create("dev", &format!("0 8192 linear {} 0", f.display()));
    let mut c = Client::connect(&d.sock(), "dev");
    c.write(0, &pattern(3, 4096));

    // A write sent while suspended is held, not lost.
    d.ok(&["suspend", "dev"]);
    assert_eq!(d.info_line("dev", "State:"), "State:             SUSPENDED");
    let data = pattern(4, 8192);
    c.send(WRITE, 0, 21, MIB, data.len() as u32, &data);
    assert!(
        !nbd::reply_ready(&c, Duration::from_millis(300)),
        "write completed while suspended"
    );
    assert_eq!(
        read_at(&f, MIB, 8192),
        vec![0; 8192],
        "write reached the file while suspended"
    );
    d.ok(&["resume", "dev"]);
    assert_eq!(d.info_line("dev", "State:"), "State:             ACTIVE");
    assert_eq!(c.reply(None), (21, 0));
    assert_eq!(read_at(&f, MIB, 8192), data);

    // So is a read, and a flush, with --noflush too.
    d.ok(&["suspend", "--noflush", "dev"]);
    c.send(READ, 0, 22, 0, 4096, &[]);
    assert!(
        !nbd::reply_ready(&c, Duration::from_millis(300)),
        "read completed while suspended"
    );
    d.ok(&["resume", "dev"]);
    let mut buf = vec![0u8; 4096];
    assert_eq!(c.reply(Some(&mut buf)), (22, 0));
    assert_eq!(buf, pattern(3, 4096));
    d.ok(&["suspend", "dev"]);
    c.send(FLUSH, 0, 23, 0, 0, &[]);
    assert!(
        !nbd::reply_ready(&c, Duration::from_millis(300)),
        "flush completed while suspended"
    );
    d.ok(&["resume", "dev"]);
    assert_eq!(c.reply(None), (23, 0));
    assert!(d.alive());
}

/// A client that leaves while its writes wait for a suspended device: the
/// writes it sent are kept and carried out at the resume (as they would have
/// been had it stayed), its connection ends then and the device's open count
/// drops; meanwhile the other clients of the same reactor are served.
#[test]
fn a_client_leaving_while_its_io_waits_for_a_resume_is_served_then_let_go() {
    let d = Daemon::start_with("susp-leave", &["--nbd-reactors", "1"], &[]);
    let f = d.dir.sparse("disk", 4 * MIB);
    let g = d.dir.sparse("other", 4 * MIB);
    d.create("dev", &format!("0 8192 linear {} 0", f.display()));
    d.create("other", &format!("0 8192 linear {} 0", g.display()));
    let mut other = Client::connect(&d.sock(), "other");
    let mut c = Client::connect(&d.sock(), "dev");
    d.wait_open_count("dev", 1);
    d.ok(&["suspend", "dev"]);
    let data = pattern(6, 8192);
    c.send(WRITE, 0, 31, 0, data.len() as u32, &data);
    c.send(WRITE, 0, 32, MIB, data.len() as u32, &data);
    assert!(
        !nbd::reply_ready(&c, Duration::from_millis(200)),
        "write completed while suspended"
    );
    drop(c);
    // the same reactor serves the other device meanwhile
    other.write(0, &data);
    assert_eq!(other.read(0, 8192), data);
    assert_eq!(
        read_at(&f, 0, 8192),
        vec![0; 8192],
        "a write reached the file while suspended"
    );
    d.ok(&["resume", "dev"]);
    d.wait_open_count("dev", 0);
    assert_eq!(read_at(&f, 0, 8192), data, "the first write after the resume");
    assert_eq!(read_at(&f, MIB, 8192), data, "the second write after the resume");
    d.ok(&["remove", "dev"]);
}

/// fio randwrite+verify over NBD while another thread suspends and resumes.
fn fio_under_suspend_cycles(d: &Daemon, name: &str) {
    let mut fio = Command::new("fio")
        .args([
            "--name=cycles",
            "--ioengine=nbd",
            &format!("--uri={}", d.uri(name)),
            "--rw=randwrite",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--iodepth=16",
            "--bs=4k",
            "--size=32M",
            "--numjobs=2",
            "--offset_increment=32M",
            "--group_reporting",
            "--verify_state_save=0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fio");
    // Let fio connect and start writing, then cycle.
    wait_for("fio connections", || {
        let l = d.info_line(name, "Open count:");
        l["Open count:".len()..].trim().parse::<u32>().unwrap_or(0) >= 1
    });
    let mut cycled_while_running = 0;
    for i in 0..20 {
        let noflush = if i % 2 == 1 { "--noflush" } else { "" };
        let args: Vec<&str> = ["suspend", noflush, name]
            .into_iter()
            .filter(|a| !a.is_empty())
            .collect();
        d.ok(&args);
        std::thread::sleep(Duration::from_millis(10));
        d.ok(&["resume", name]);
        if matches!(fio.try_wait(), Ok(None)) {
            cycled_while_running += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = fio.wait_with_output().expect("fio");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "fio failed: {}\n{so}\n{se}", out.status);
    assert!(so.contains("err= 0"), "fio reported errors:\n{so}\n{se}");
    assert!(
        !so.contains("verify") && !se.contains("verify"),
        "verify trouble:\n{so}\n{se}"
    );
    eprintln!("{name}: {cycled_while_running} of 20 suspend/resume cycles overlapped fio");
    assert!(
        cycled_while_running >= 5,
        "only {cycled_while_running} cycles overlapped fio"
    );
}

#[test]
fn suspend_cycles_under_fio_linear() {
    need("fio");
    let d = Daemon::start("fiolin");
    let f = d.dir.sparse("disk", 64 * MIB);
    d.create("lin", &format!("0 131072 linear {} 0", f.display()));
    fio_under_suspend_cycles(&d, "lin");
}

#[test]
fn suspend_cycles_under_fio_striped() {
    need("fio");
    let d = Daemon::start("fiostripe");
    let a = d.dir.sparse("a", 32 * MIB);
    let b = d.dir.sparse("b", 32 * MIB);
    d.create(
        "st",
        &format!("0 131072 striped 2 128 {} 0 {} 0", a.display(), b.display()),
    );
    fio_under_suspend_cycles(&d, "st");
}

#[test]
fn remove_rules() {
    let mut d = Daemon::start("remove");
    let f = file_with(&d, "disk", 4, 9, 4096);
    let base_table = format!("0 8192 linear {} 0", f.display());
    d.create("base", &base_table);
    d.create("top", "0 8192 linear /dev/mapper/base 0");

    // Held by another table: refused, naming the user.
    let e = d.fails(&["remove", "base"]);
    assert!(e.contains("top"), "error should name the user: {e}");
    assert!(d.ok(&["ls"]).contains("base"));

    // Open through NBD: refused without --force.
    let mut c = Client::connect(&d.sock(), "top");
    assert_eq!(c.read(0, 4096), pattern(9, 4096));
    d.wait_open_count("top", 1);
    d.fails(&["remove", "top"]);
    assert_eq!(
        c.read(0, 4096),
        pattern(9, 4096),
        "device still serves after a refused remove"
    );
    // --force on an open device, as dmsetup's: the table is replaced by `error`
    // (later I/O fails), the remove itself fails busy, and the device stays.
    let e = d.fails(&["remove", "--force", "top"]);
    assert!(e.contains("top: Device or resource busy: open count 1"), "{e}");
    assert!(d.ok(&["ls"]).contains("top"), "top gone while open");
    assert_eq!(d.ok(&["table", "top"]), "0 8192 error \n");
    assert_eq!(c.call(READ, 0, 0, 4096, &[]), EIO, "I/O after remove --force");
    // --deferred: accepted while open, shown in info, cancelled by the message...
    d.ok(&["remove", "--deferred", "top"]);
    assert_eq!(
        d.info_line("top", "State:"),
        "State:             ACTIVE (DEFERRED REMOVE)"
    );
    d.ok(&["message", "top", "0", "@cancel_deferred_remove"]);
    assert_eq!(d.info_line("top", "State:"), "State:             ACTIVE");
    // With nothing pending it still succeeds, as the kernel's.
    d.ok(&["message", "top", "0", "@cancel_deferred_remove"]);
    // ...and carried out at the last close.
    d.ok(&["remove", "--deferred", "top"]);
    assert!(d.ok(&["ls"]).contains("top"));
    drop(c);
    let t0 = Instant::now();
    while d.ok(&["ls"]).contains("top") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "deferred remove never happened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // top's table is gone, so base is free now.
    d.ok(&["remove", "base"]);
    assert!(d.ok(&["ls"]).contains("No devices found"));

    // The names can be used again.
    d.create("base", &base_table);
    d.create("top", "0 8192 linear /dev/mapper/base 0");
    assert_eq!(Client::connect(&d.sock(), "top").read(0, 4096), pattern(9, 4096));
    assert!(d.alive());
}

#[test]
fn tables_cannot_form_cycles() {
    let mut d = Daemon::start("cycle");
    let f = d.dir.sparse("disk", 4 * MIB);
    d.create("A", &format!("0 8192 linear {} 0", f.display()));
    d.fails(&["load", "A", "--table", "0 8192 linear /dev/mapper/A 0"]);
    d.create("B", "0 8192 linear /dev/mapper/A 0");
    d.fails(&["load", "A", "--table", "0 8192 linear /dev/mapper/B 0"]);
    // Longer cycle, and through a striped table.
    d.create("C", "0 8192 linear /dev/mapper/B 0");
    d.fails(&[
        "load",
        "A",
        "--table",
        "0 8192 striped 2 8 /dev/mapper/C 0 /dev/mapper/B 0",
    ]);
    // A device cannot be created on top of itself either.
    d.fails(&["create", "D", "--table", "0 8192 linear /dev/mapper/D 0"]);
    // Nothing was loaded, and the stack still works.
    assert_eq!(d.info_line("A", "Tables present:"), "Tables present:    LIVE");
    let mut c = Client::connect(&d.sock(), "C");
    c.write(0, &[0x3C; 4096]);
    assert_eq!(read_at(&f, 0, 4096), vec![0x3C; 4096]);
    assert!(d.alive());
}

fn status(d: &Daemon, name: &str) -> String {
    d.ok(&["status", name]).trim_end().to_string()
}

#[test]
fn delay_holds_io_and_suspend_releases_it() {
    let mut d = Daemon::start("delay");
    let f = file_with(&d, "disk", 4, 7, 4096);
    d.create("dl", &format!("0 8192 delay {} 0 2000", f.display()));
    assert_eq!(status(&d, "dl"), "0 8192 delay 0 0 0");
    let mut c = Client::connect(&d.sock(), "dl");

    // A held read shows in status, and suspending lets it go at once.
    let t0 = Instant::now();
    c.send(READ, 0, 31, 0, 4096, &[]);
    wait_for("held read in status", || status(&d, "dl") == "0 8192 delay 1 0 0");
    assert!(
        !nbd::reply_ready(&c, Duration::from_millis(100)),
        "read not delayed"
    );
    d.ok(&["suspend", "dl"]);
    let mut buf = vec![0u8; 4096];
    assert_eq!(c.reply(Some(&mut buf)), (31, 0));
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(1500),
        "suspend did not release held I/O ({took:?})"
    );
    assert_eq!(buf, pattern(7, 4096));
    assert_eq!(status(&d, "dl"), "0 8192 delay 0 0 0");
    d.ok(&["resume", "dl"]);

    // After resume delaying is back: a write is held, counted, then completes.
    let t0 = Instant::now();
    c.send(WRITE, 0, 32, 4096, 4096, &[0xD1; 4096]);
    wait_for("held write in status", || {
        status(&d, "dl") == "0 8192 delay 0 1 0"
    });
    assert_eq!(c.reply(None), (32, 0));
    assert!(
        t0.elapsed() >= Duration::from_millis(1900),
        "write not delayed: {:?}",
        t0.elapsed()
    );
    assert_eq!(read_at(&f, 4096, 4096), vec![0xD1; 4096]);
    assert_eq!(status(&d, "dl"), "0 8192 delay 0 0 0");
    assert!(d.alive());
}

fn flakey_dev(d: &Daemon, name: &str, file: &Path, rest: &str) {
    d.create(name, &format!("0 8192 flakey {} 0 {rest}", file.display()));
}

#[test]
fn flakey_down_fails_io() {
    let d = Daemon::start("flakey-err");
    let f = file_with(&d, "disk", 4, 11, 4096);
    flakey_dev(&d, "fl", &f, "0 5");
    assert_eq!(
        d.ok(&["table", "fl"]),
        format!("0 8192 flakey {} 0 0 5 2 error_reads error_writes\n", f.display())
    );
    let mut c = Client::connect(&d.sock(), "fl");
    assert_eq!(c.call(READ, 0, 0, 4096, &[]), EIO);
    assert_eq!(c.call(WRITE, 0, 0, 4096, &[0xEE; 4096]), EIO);
    assert_eq!(
        read_at(&f, 0, 4096),
        pattern(11, 4096),
        "failed write reached the file"
    );
    // Up the whole time: plain linear.
    flakey_dev(&d, "up", &f, "5 0");
    let mut u = Client::connect(&d.sock(), "up");
    assert_eq!(u.read(0, 4096), pattern(11, 4096));
}

#[test]
fn flakey_drop_writes() {
    let d = Daemon::start("flakey-drop");
    let f = file_with(&d, "disk", 4, 12, 8192);
    flakey_dev(&d, "fl", &f, "0 5 1 drop_writes");
    assert_eq!(
        d.ok(&["table", "fl"]),
        format!("0 8192 flakey {} 0 0 5 1 drop_writes\n", f.display())
    );
    let mut c = Client::connect(&d.sock(), "fl");
    c.write(0, &[0xDD; 8192]);
    assert_eq!(c.call(WRITE, 1, 8192, 4096, &[0xDD; 4096]), 0, "FUA write");
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    assert_eq!(
        read_at(&f, 0, 8192),
        pattern(12, 8192),
        "dropped write reached the file"
    );
    assert_eq!(read_at(&f, 8192, 4096), vec![0; 4096]);
    assert_eq!(c.read(0, 8192), pattern(12, 8192), "reads pass through");
}

#[test]
fn flakey_corrupt_read_byte() {
    let d = Daemon::start("flakey-corrupt");
    let f = file_with(&d, "disk", 4, 13, 8192);
    let orig = pattern(13, 8192);
    assert_ne!(orig[0], 255);
    flakey_dev(&d, "fl", &f, "0 5 5 corrupt_bio_byte 1 r 255 0");
    assert_eq!(
        d.ok(&["table", "fl"]),
        format!(
            "0 8192 flakey {} 0 0 5 5 corrupt_bio_byte 1 r 255 0\n",
            f.display()
        )
    );
    let mut c = Client::connect(&d.sock(), "fl");
    let got = c.read(0, 8192);
    assert_eq!(got[0], 255, "byte 1 of the read not corrupted");
    assert_eq!(got[1..], orig[1..], "other bytes changed");
    // The corruption is in the reply only; writes pass through untouched.
    assert_eq!(read_at(&f, 0, 8192), orig);
    c.write(MIB, &[0x42; 4096]);
    assert_eq!(read_at(&f, MIB, 4096), vec![0x42; 4096]);
    assert_eq!(c.read(MIB, 4096)[0], 255);
}

/// A panic while a device's request is mapped (armed by the test-only `__panic`
/// message, which `serve --test-panics` enables) fails that request and every
/// later one on the device with EIO, is logged with the thread, the device and
/// the location, and leaves the daemon and its other devices (a linear, a thin
/// on a pool) serving. A panic where it cannot be caught safely (the control
/// path) ends the daemon, logged the same way. Without the variable the message
/// is an unknown message.
#[test]
fn a_panicking_worker_fails_its_device_only() {
    let mut d = Daemon::start_with("panic", &["--test-panics"], &[]);
    let a = file_with(&d, "a", 4, 1, MIB as usize);
    let b = file_with(&d, "b", 4, 2, MIB as usize);
    let meta = d.dir.sparse("meta", 4 * MIB);
    let data = d.dir.sparse("data", 16 * MIB);
    d.create("bad", &format!("0 8192 linear {} 0", a.display()));
    d.create("good", &format!("0 8192 linear {} 0", b.display()));
    d.create(
        "pool",
        &format!("0 32768 thin-pool {} {} 128 0", meta.display(), data.display()),
    );
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("thin", "0 8192 thin /dev/mapper/pool 0");
    let mut bad = Client::connect(&d.sock(), "bad");
    let mut good = Client::connect(&d.sock(), "good");
    let mut thin = Client::connect(&d.sock(), "thin");
    assert_eq!(bad.read(0, 4096), pattern(1, 4096));

    d.ok(&["message", "bad", "0", "__panic"]);
    let w = pattern(9, 4096);
    assert_eq!(
        bad.call(WRITE, 0, 8192, 4096, &w),
        EIO,
        "the request that panicked"
    );
    assert_eq!(
        bad.call(READ, 0, 0, 4096, &[]),
        EIO,
        "the device fails after a panic"
    );
    let mut again = Client::connect(&d.sock(), "bad");
    assert_eq!(again.call(READ, 0, 0, 4096, &[]), EIO, "a new connection too");
    assert_eq!(read_at(&a, 8192, 4096), pattern(1, MIB as usize)[8192..12288]);
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("panic in thread"))
        .unwrap_or_else(|| panic!("no panic logged:\n{log}"));
    assert!(
        line.contains("panic in thread nbd-reactor-")
            && line.contains(" serving device bad at src/mapper/mod.rs:")
            && line.contains("bad: the panic armed by the __panic message")
            && line.contains("fails with EIO"),
        "{line}"
    );

    // the others serve on, through the connections they had and new ones
    good.write(4096, &w);
    assert_eq!(good.read(4096, 4096), w);
    thin.write(0, &w);
    assert_eq!(thin.read(0, 4096), w);
    let mut fresh = Client::connect(&d.sock(), "good");
    assert_eq!(fresh.read(0, 4096), pattern(2, 4096));
    assert_eq!(read_at(&b, 4096, 4096), w);
    let ls = d.ok(&["ls"]);
    for name in ["bad", "good", "pool", "thin"] {
        assert!(ls.lines().any(|l| l.starts_with(name)), "{name} in ls:\n{ls}");
    }
    assert!(d.alive());
    drop((bad, again));
    d.remove_closed("bad");
    d.create("bad", &format!("0 8192 linear {} 0", a.display()));
    assert_eq!(
        Client::connect(&d.sock(), "bad").read(0, 4096),
        pattern(1, 4096),
        "made again"
    );

    // where a panic cannot be caught safely, the daemon ends, and says why
    let o = d.cli(&["message", "good", "0", "__panic", "control"]);
    assert!(!o.status.success());
    wait_for("the daemon to exit", || !d.alive());
    let log = d.log();
    assert!(
        log.lines().any(|l| l
            .contains("panic in thread control-conn serving no device at src/mapper/registry.rs:")
            && l.contains("the daemon exits so nothing half changed is committed")),
        "{log}"
    );

    // not enabled: an unknown message
    let d = Daemon::start("panic-off");
    let c = file_with(&d, "c", 4, 3, 0);
    d.create("c", &format!("0 8192 linear {} 0", c.display()));
    let e = d.fails(&["message", "c", "0", "__panic"]);
    assert!(e.contains("message '__panic' refused"), "{e}");
    let mut cl = Client::connect(&d.sock(), "c");
    cl.write(0, &w);
    assert_eq!(cl.read(0, 4096), w);
}
