//! dmsetup and kernel behaviour, item by item: what the kernel's device-mapper
//! and real `dmsetup` do on the same tables, through the real daemon and CLI.

use crate::common;

use common::nbd::{Client, READ, TRIM, WRITE};
use common::{pattern, Daemon};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::MIB;
const EIO: u32 = 5;
const EINVAL: u32 = 22;
const TF_SEND_TRIM: u16 = 0x0020;
const TF_SEND_FAST_ZERO: u16 = 0x0800;

/// A pool `name` over fresh files: 64 KiB blocks, `blocks` of them.
fn pool(d: &Daemon, name: &str, blocks: u64, features: &[&str]) -> (PathBuf, PathBuf) {
    let meta = d.dir.sparse(&format!("{name}.meta"), 4 * MIB);
    let data = d.dir.sparse(&format!("{name}.data"), blocks * 64 * 1024);
    let mut t = format!(
        "0 {} thin-pool {} {} 128 0",
        blocks * 128,
        meta.display(),
        data.display()
    );
    if !features.is_empty() {
        t.push_str(&format!(" {} {}", features.len(), features.join(" ")));
    }
    d.create(name, &t);
    (meta, data)
}

/// Item 1: message words are split on white space and matched without case.
#[test]
fn messages_split_on_white_space_and_ignore_case() {
    let d = Daemon::start("compat-msg");
    pool(&d, "pool", 64, &[]);
    d.ok(&["message", "pool", "0", "create_thin 2"]);
    d.ok(&["message", "pool", "0", " create_thin  4 "]);
    d.ok(&["message", "pool", "0", "CREATE_THIN", "5"]);
    d.ok(&["message", "pool", "0", "Create_Snap", "6", "2"]);
    d.ok(&["message", "pool", "0", "set_transaction_id 0 7"]);
    d.ok(&["message", "pool", " 0", "delete 4"]);
    let st = d.ok(&["status", "pool"]);
    assert_eq!(st.split(' ').nth(3), Some("7"), "transaction id: {st}");
    // The devices exist: thins can be made of them (4 was deleted).
    for id in ["2", "5", "6"] {
        d.create(&format!("t{id}"), &format!("0 128 thin /dev/mapper/pool {id}"));
    }
    let e = d.fails(&["create", "t4", "--table", "0 128 thin /dev/mapper/pool 4"]);
    assert!(e.contains("thin device 4 does not exist"), "{e}");
    let e = d.fails(&["message", "pool", "0", "create_thin"]);
    assert!(
        e.contains("unknown or malformed thin-pool message 'create_thin'"),
        "{e}"
    );
}

/// Item 2: capabilities compose down the stack; an ignore_discard pool's thins do
/// not offer TRIM (the kernel: "Operation not supported"), nor does a device
/// stacked on one; FAST_ZERO only where zeroing is native.
#[test]
fn exports_offer_only_what_the_stack_honours() {
    let d = Daemon::start("compat-caps");
    pool(&d, "pool", 64, &[]);
    pool(&d, "nodisc", 64, &["ignore_discard"]);
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.ok(&["message", "nodisc", "0", "create_thin 0"]);
    d.create("t", "0 2048 thin /dev/mapper/pool 0");
    d.create("u", "0 2048 thin /dev/mapper/nodisc 0");
    d.create("over-u", "0 2048 linear /dev/mapper/u 0");
    d.create(
        "mixed",
        "0 2048 linear /dev/mapper/t 0\n2048 2048 linear /dev/mapper/u 0",
    );
    d.create("err", "0 2048 error");
    let flags = |n: &str| Client::connect(&d.sock(), n).flags;
    assert_ne!(flags("t") & TF_SEND_TRIM, 0, "thin offers TRIM");
    for n in ["u", "over-u", "mixed"] {
        assert_eq!(flags(n) & TF_SEND_TRIM, 0, "{n} offers TRIM");
    }
    assert_eq!(flags("err") & TF_SEND_FAST_ZERO, 0, "error offers FAST_ZERO");
    // nbdinfo, a real client, agrees.
    let out = common::run(std::process::Command::new("nbdinfo").arg(d.uri("u")));
    assert!(out.contains("can_trim: false"), "{out}");
    let out = common::run(std::process::Command::new("nbdinfo").arg(d.uri("t")));
    assert!(out.contains("can_trim: true"), "{out}");
    // A TRIM sent anyway is refused and changes nothing.
    let mut c = Client::connect(&d.sock(), "u");
    let data = pattern(3, 64 * 1024);
    assert_eq!(c.call(WRITE, 0, 0, data.len() as u32, &data), 0);
    assert_eq!(c.call(TRIM, 0, 0, data.len() as u32, &[]), EINVAL);
    assert_eq!(c.read(0, data.len()), data);
}

/// Item 3: discard support is fixed at a pool's first load, both ways.
#[test]
fn pool_reload_cannot_change_discard_support() {
    let d = Daemon::start("compat-discard");
    let (meta, data) = pool(&d, "pool", 64, &[]);
    let t = |f: &str| format!("0 8192 thin-pool {} {} 128 0{f}", meta.display(), data.display());
    let e = d.fails(&["load", "pool", "--table", &t(" 1 ignore_discard")]);
    assert!(
        e.contains("Discard support cannot be disabled once enabled"),
        "{e}"
    );
    d.ok(&["load", "pool", "--table", &t(" 1 no_discard_passdown")]);
    d.ok(&["resume", "pool"]);
    assert!(d.ok(&["table", "pool"]).contains("no_discard_passdown"));
    let (m2, d2) = pool(&d, "nodisc", 64, &["ignore_discard"]);
    let e = d.fails(&[
        "load",
        "nodisc",
        "--table",
        &format!("0 8192 thin-pool {} {} 128 0", m2.display(), d2.display()),
    ]);
    assert!(
        e.contains("Discard support cannot be disabled once enabled"),
        "{e}"
    );
}

/// Item 4: minors in order; failed creates use none. Unlike the kernel's (the
/// lowest free), a removed device's minor is not given to the next device: with
/// no udev to take a removed device's node away, the node must open nothing
/// rather than the next device (`tests/door_trust.rs`).
#[test]
fn minors_are_given_in_order_and_not_again_at_once() {
    let d = Daemon::start("compat-minor");
    let f = d.dir.sparse("disk", MIB);
    for n in ["a", "b", "c"] {
        d.create(n, "0 8 zero");
    }
    for _ in 0..5 {
        d.fails(&["create", "bad", "--table", "0 8 linear /nonexistent 0"]);
    }
    d.create("d", &format!("0 8 linear {} 0", f.display()));
    assert!(d.ok(&["ls"]).contains("d\t(511:3)"), "{}", d.ok(&["ls"]));
    d.ok(&["remove", "b"]);
    d.create("e", "0 8 zero");
    assert!(d.ok(&["ls"]).contains("e\t(511:4)"), "{}", d.ok(&["ls"]));
    d.create("g", "0 8 zero");
    assert!(d.ok(&["ls"]).contains("g\t(511:5)"), "{}", d.ok(&["ls"]));
}

/// Item 5: read-ahead is twice the optimal I/O size, at least 256 sectors.
#[test]
fn read_ahead_follows_the_kernel() {
    let d = Daemon::start("compat-ra");
    let a = d.dir.sparse("a", 4 * MIB);
    let b = d.dir.sparse("b", 4 * MIB);
    let (a, b) = (a.display(), b.display());
    d.create("lin", &format!("0 8192 linear {a} 0"));
    d.create("s2", &format!("0 8192 striped 2 128 {a} 0 {b} 0"));
    d.create(
        "s4",
        &format!("0 8192 striped 4 256 {a} 4096 {b} 4096 {a} 6144 {b} 6144"),
    );
    d.create("over", "0 8192 linear /dev/mapper/s2 0");
    pool(&d, "small", 64, &[]);
    let meta = d.dir.sparse("big.meta", 4 * MIB);
    let data = d.dir.sparse("big.data", 16 * MIB);
    d.create(
        "big",
        &format!("0 32768 thin-pool {} {} 2048 0", meta.display(), data.display()),
    );
    d.ok(&["message", "big", "0", "create_thin 0"]);
    d.create("bt", "0 4096 thin /dev/mapper/big 0");
    for (n, ra) in [
        ("lin", 256),
        ("s2", 512),
        ("s4", 2048),
        ("over", 512),
        ("small", 256),
        ("big", 4096),
        ("bt", 4096),
    ] {
        assert_eq!(
            d.info_line(n, "Read Ahead:"),
            format!("Read Ahead:        {ra}"),
            "{n}"
        );
    }
}

/// Item 6: the error target takes any arguments (replacing any line in place) and
/// prints none.
#[test]
fn error_target_takes_any_arguments() {
    let d = Daemon::start("compat-error");
    let f = d.dir.sparse("disk", MIB);
    d.create("e0", "0 8 error");
    d.create("e2", &format!("0 8 error {} 0", f.display()));
    d.create("e5", "0 8 error striped 2 8 whatever 0");
    for n in ["e0", "e2", "e5"] {
        assert_eq!(d.ok(&["table", n]), "0 8 error \n");
        assert_eq!(Client::connect(&d.sock(), n).call(READ, 0, 0, 512, &[]), EIO);
    }
}

/// Item 7: corrupt_bio_byte's flags select bios by their request flags: with
/// REQ_FUA|REQ_SYNC (0x20800) only FUA writes are corrupted.
#[test]
fn flakey_corrupt_flags_select_fua_writes() {
    let d = Daemon::start("compat-flakey");
    let f = d.dir.sparse("disk", MIB);
    d.create(
        "fl",
        &format!(
            "0 2048 flakey {} 0 0 1 5 corrupt_bio_byte 1 w 65 133120",
            f.display()
        ),
    );
    assert!(d
        .ok(&["table", "fl"])
        .ends_with("corrupt_bio_byte 1 w 65 133120\n"));
    let mut c = Client::connect(&d.sock(), "fl");
    let data = vec![7u8; 4096];
    assert_eq!(c.call(WRITE, 0, 0, 4096, &data), 0);
    assert_eq!(common::read_at(&f, 0, 4096), data, "plain write corrupted");
    assert_eq!(c.call(WRITE, common::nbd::FLAG_FUA, 4096, 4096, &data), 0);
    let got = common::read_at(&f, 4096, 4096);
    assert_eq!(got[0], 65, "FUA write not corrupted");
    assert_eq!(&got[1..], &data[1..]);
}

/// Item 8: a second pool over metadata (or data) in use is refused, as is a
/// duplicate uuid.
#[test]
fn busy_metadata_and_duplicate_uuid_are_refused() {
    let d = Daemon::start("compat-busy");
    let (meta, data) = pool(&d, "pool", 64, &[]);
    let other = d.dir.sparse("other.data", 64 * 64 * 1024);
    let e = d.fails(&[
        "create",
        "pool2",
        "--table",
        &format!("0 8192 thin-pool {} {} 128 0", meta.display(), other.display()),
    ]);
    assert!(e.contains("metadata device already in use by a pool"), "{e}");
    let meta2 = d.dir.sparse("other.meta", 4 * MIB);
    let e = d.fails(&[
        "create",
        "pool3",
        "--table",
        &format!("0 8192 thin-pool {} {} 128 0", meta2.display(), data.display()),
    ]);
    assert!(e.contains("data device already in use"), "{e}");
    assert!(!d.ok(&["ls"]).contains("pool2"));
    d.ok(&["create", "a", "-u", "UUID-X", "--table", "0 8 zero"]);
    let e = d.fails(&["create", "b", "-u", "UUID-X", "--table", "0 8 zero"]);
    assert!(e.contains("uuid 'UUID-X' is in use by device 'a'"), "{e}");
    d.ok(&["create", "b", "--table", "0 8 zero"]);
    let e = d.fails(&["rename", "b", "--setuuid", "UUID-X"]);
    assert!(e.contains("in use by device 'a'"), "{e}");
    d.ok(&["rename", "b", "--setuuid", "UUID-Y"]);
    let e = d.fails(&["rename", "b", "--setuuid", "UUID-Z"]);
    assert!(e.contains("already has uuid 'UUID-Y'"), "{e}");
}

/// Item 9 lives in tests/lifecycle.rs (remove_rules). Here: rename keeps an open
/// connection working and moves the export name.
#[test]
fn rename_moves_the_export() {
    let d = Daemon::start("compat-rename");
    let f = d.dir.sparse("disk", MIB);
    std::fs::write(&f, pattern(5, 4096)).unwrap();
    d.create("old", &format!("0 8 linear {} 0", f.display()));
    let mut c = Client::connect(&d.sock(), "old");
    d.ok(&["rename", "old", "new"]);
    assert_eq!(c.read(0, 4096), pattern(5, 4096));
    assert!(d.ok(&["ls"]).starts_with("new\t(511:0)"));
    assert_eq!(Client::connect(&d.sock(), "new").read(0, 512), pattern(5, 512));
    d.fails(&["rename", "nope", "x"]);
    d.create("x", "0 8 zero");
    assert!(d
        .fails(&["rename", "x", "new"])
        .contains("Device or resource busy"));
}

/// The verbs scripts use: info -c, deps, ls --tree, table --inactive.
#[test]
fn report_verbs() {
    let d = Daemon::start("compat-report");
    let a = d.dir.sparse("a", 4 * MIB);
    let b = d.dir.sparse("b", 4 * MIB);
    d.create(
        "fast",
        &format!("0 8192 striped 2 128 {} 0 {} 0", a.display(), b.display()),
    );
    d.ok(&[
        "create",
        "top",
        "-u",
        "U-1",
        "--table",
        "0 8192 linear /dev/mapper/fast 0",
    ]);
    let _c = Client::connect(&d.sock(), "top");
    let t0 = Instant::now();
    while !d.info_line("top", "Open count:").ends_with(" 1") {
        assert!(t0.elapsed() < Duration::from_secs(3));
        std::thread::sleep(Duration::from_millis(10));
    }
    // dmsetup pads every column, the last one (UUID, 32 wide) included.
    assert_eq!(
        d.ok(&["info", "-c"]),
        format!(
            "Name             Maj Min Stat Open Targ Event  UUID{u}\n\
             fast             511   0 L--w    1    1      0 {e}\n\
             top              511   1 L--w    1    1      0 U-1{v}\n",
            u = " ".repeat(28),
            e = " ".repeat(32),
            v = " ".repeat(29)
        )
    );
    assert_eq!(
        d.ok(&["info", "-c", "--noheadings"]),
        "fast:511:0:L--w:1:1:0:\ntop:511:1:L--w:1:1:0:U-1\n"
    );
    assert_eq!(
        d.ok(&[
            "info",
            "-c",
            "-o",
            "Name,DEVICE_COUNT,devnos_used",
            "--separator",
            ",",
            "top"
        ]),
        "Name,#Devs,DevNosUsed\ntop,1,511:0\n"
    );
    assert_eq!(
        d.ok(&["info", "-c", "--noheadings", "-o", "+read_ahead", "top"]),
        "top:511:1:L--w:1:1:0:U-1:512\n"
    );
    let e = d.fails(&["info", "-c", "-o", "name,bogus"]);
    assert!(e.contains("Unrecognised field: bogus"), "{e}");
    assert_eq!(d.ok(&["deps", "top"]), "1 dependencies\t: (511, 0)\n");
    assert_eq!(
        d.ok(&["deps"]),
        format!(
            "fast: 2 dependencies\t: ({}) ({})\ntop: 1 dependencies\t: (511, 0)\n",
            b.display(),
            a.display()
        )
    );
    assert_eq!(
        d.ok(&["ls", "--tree"]),
        format!(
            "top (511:1)\n `-fast (511:0)\n    |- ({})\n    `- ({})\n",
            b.display(),
            a.display()
        )
    );
    d.ok(&["load", "top", "--table", "0 8192 zero"]);
    assert_eq!(d.ok(&["table", "top", "--inactive"]), "0 8192 zero \n");
    assert_eq!(d.ok(&["table", "top"]), "0 8192 linear 511:0 0\n");
    assert_eq!(d.ok(&["ls", "--target", "striped"]), "fast\t(511, 0)\n");
}

/// The CLI a person expects: help per verb, a version, completions, and unknown
/// flags refused (by the thin tools too).
#[test]
fn cli_help_version_and_unknown_flags() {
    let run = |args: &[&str]| {
        std::process::Command::new(common::BIN)
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(&["--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    for verb in [
        "serve",
        "create",
        "reload",
        "stats",
        "rename",
        "deps",
        "thin",
        "completions",
    ] {
        assert!(help.contains(verb), "--help lacks {verb}:\n{help}");
    }
    let o = run(&["suspend", "--help"]);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stdout).contains("--noflush"));
    let o = run(&["--version"]);
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        format!("dmkit {}\n", env!("CARGO_PKG_VERSION"))
    );
    let o = run(&["completions", "bash"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("complete -F _dmkit"));
    for args in [
        &["thin", "check", "x", "--hedgehogs-only"][..],
        &["thin", "dump", "x", "--bogus"],
        &["thin", "restore", "-i", "x", "-o", "y", "--hedgehogs", "3"],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains("unexpected argument"), "{args:?}: {e}");
    }
    // conflicting options are usage errors; a missing input is a failure (64)
    let o = run(&["thin", "check", "/nonexistent", "--auto-repair", "-m"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot be used with"));
    let o = run(&["thin", "check", "/nonexistent", "--auto-repair"]);
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "Couldn't find input file '/nonexistent'\n"
    );
}

/// The same operations in the real kernel (tests/oracle/run.sh boots Debian's under
/// qemu) and in dmkit give the same answers: read-ahead, minors, the error target's
/// arguments, message case and spacing, the discard reload refusal.
#[test]
fn kernel_oracle_agrees() {
    let script = |dev: &dyn Fn(usize) -> String, dm: &str| {
        format!(
            r#"
ra() {{ {dm} info "$1" | sed -n 's/^Read Ahead: *//p'; }}
minor() {{ {dm} info -c --noheadings -o minor "$1"; }}
{dm} create s2 --table "0 8192 striped 2 128 {a} 0 {b} 0"
echo "ORACLE ra-s2 $(ra s2)"
{dm} create s4 --table "0 8192 striped 4 256 {a} 4096 {b} 4096 {a} 6144 {b} 6144"
echo "ORACLE ra-s4 $(ra s4)"
{dm} create bad --table "0 8 linear /dev/nonexistent 0" 2>/dev/null
{dm} create bad --table "0 8 linear /dev/nonexistent 0" 2>/dev/null
{dm} create z --table "0 8 error"
echo "ORACLE minor-z $(minor z)"
{dm} remove s2
{dm} create y --table "0 8 error"
echo "ORACLE minor-y $(minor y)"
{dm} create e --table "0 8 error {a} 0 extra words"
echo "ORACLE error-create $?"
echo "ORACLE error-table $({dm} table e)"
{dm} create pool --table "0 32768 thin-pool {c} {d} 2048 0"
echo "ORACLE ra-pool $(ra pool)"
{dm} message pool 0 "CREATE_THIN 5"
echo "ORACLE msg-upper $?"
{dm} message pool 0 " create_thin  4 "
echo "ORACLE msg-space $?"
{dm} message pool 0 Create_Snap 6 5
echo "ORACLE msg-mixed $?"
{dm} mknodes 2>/dev/null
{dm} create t5 --table "0 4096 thin /dev/mapper/pool 5"
echo "ORACLE ra-thin $(ra t5)"
{dm} load pool --table "0 32768 thin-pool {c} {d} 2048 0 1 ignore_discard" 2>/dev/null
echo "ORACLE discard-reload $?"
"#,
            a = dev(0),
            b = dev(1),
            c = dev(2),
            d = dev(3),
        )
    };
    let d = Daemon::start("compat-oracle");
    let sizes = [4 * MIB, 4 * MIB, 4 * MIB, 16 * MIB];
    let disks = |tag: &str| -> Vec<PathBuf> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| d.dir.sparse(&format!("{tag}{i}"), n))
            .collect()
    };
    let (files, ours) = (disks("kernel"), disks("dmkit"));
    // The kernel's run: virtio disks /dev/vda.. in the guest.
    let guest = script(&|i| format!("/dev/vd{}", (b'a' + i as u8) as char), "dmsetup");
    let sp = d.dir.0.join("guest.sh");
    std::fs::write(&sp, &guest).unwrap();
    let out = std::process::Command::new("bash")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/oracle/run.sh"))
        .arg(&sp)
        .args(&files)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run tests/oracle/run.sh");
    let serial = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && serial.contains("ORACLE-EXIT"),
        "oracle failed:\n{serial}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // dmkit's run: the same script against the daemon, over the same-sized files.
    let dmkit = format!("{} --run-dir {}", common::BIN, d.run.display());
    let host = script(&|i| ours[i].display().to_string(), &dmkit);
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(&host)
        .output()
        .unwrap();
    let host_out = String::from_utf8_lossy(&o.stdout).into_owned();
    let markers = |s: &str| -> Vec<(String, String)> {
        s.lines()
            .filter_map(|l| l.trim().strip_prefix("ORACLE "))
            .filter_map(|l| l.split_once(' '))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect()
    };
    let (mut k, mut m) = (markers(&serial), markers(&host_out));
    assert_eq!(k.len(), 12, "kernel markers: {k:?}\n{serial}");
    // the one deliberate difference: the kernel gives a removed device's minor
    // to the next device (udev takes the old node away), dmkit does not (no
    // udev: a node left behind must open nothing)
    let minor_y = |v: &mut Vec<(String, String)>| {
        let i = v.iter().position(|(key, _)| key == "minor-y").expect("minor-y");
        v.remove(i).1
    };
    assert_eq!(
        (minor_y(&mut k), minor_y(&mut m)),
        ("0".to_string(), "3".to_string())
    );
    assert_eq!(m, k, "dmkit differs from the kernel");
}
