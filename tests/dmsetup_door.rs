//! The dm ioctl door: Debian's unmodified `dmsetup` (/usr/sbin/dmsetup, through
//! libdevmapper) driving the real daemon through `dmkit exec`, its output
//! compared with what dmkit's own CLI prints for the same devices, the daemon's
//! state checked with dmkit afterwards; and hostile buffers sent straight to the
//! door's socket.

use crate::common;
use common::{nbd, read_at, Daemon};
use dmkit::control::dmioctl::{self as dm, Cmd};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Output, Stdio};

/// Where dmsetup's output differs from dmkit's on purpose: (what, why).
const DELIBERATE: &[(&str, &str)] = &[
    (
        "version",
        "dmsetup prints libdevmapper's and the driver's (the door's 4.48.0) versions; `dmkit version` prints dmkit's",
    ),
    (
        "deps of a device over a file",
        "a regular file has no device number: the door reports (0, 0) as its dm_target_deps entry; \
         dmkit's deps names the file",
    ),
    (
        "ls --tree over a file",
        "the same: dmsetup draws the file as (0:0), dmkit draws its path",
    ),
];

fn deliberate(what: &str) {
    assert!(
        DELIBERATE.iter().any(|(w, _)| *w == what),
        "{what}: not in DELIBERATE"
    );
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `dmkit exec -- dmsetup ARGS` against `d`, stdin fed in, in the C locale.
fn dmsetup_in(d: &Daemon, args: &[&str], stdin: &str) -> Output {
    tool_in(d, "dmsetup", args, stdin)
}

/// `dmkit exec -- TOOL ARGS` (dmsetup, or dmsetup under another name).
fn tool_in(d: &Daemon, tool: &str, args: &[&str], stdin: &str) -> Output {
    let mut c = d
        .exec()
        .arg(common::tool_path(tool))
        .args(args)
        .env_remove("DM_DEV_DIR")
        .current_dir(&d.dir.0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dmkit exec");
    {
        let mut i = c.stdin.take().expect("stdin");
        let _ = i.write_all(stdin.as_bytes());
    }
    c.wait_with_output().expect("dmsetup output")
}

/// dmsetup ARGS must succeed with nothing on stderr; its stdout.
fn dmsetup(d: &Daemon, args: &[&str]) -> String {
    dmsetup_ok(d, args, "")
}

fn dmsetup_ok(d: &Daemon, args: &[&str], stdin: &str) -> String {
    let o = dmsetup_in(d, args, stdin);
    assert!(
        o.status.success() && o.stderr.is_empty(),
        "dmsetup {args:?}: {}\nstderr: {}\nstdout: {}",
        o.status,
        text(&o.stderr),
        text(&o.stdout)
    );
    text(&o.stdout)
}

/// dmsetup and dmkit print the same for ARGS; returns it.
fn same(d: &Daemon, args: &[&str]) -> String {
    let door = dmsetup(d, args);
    let cli = d.ok(args);
    assert_eq!(door, cli, "dmsetup {args:?} and dmkit {args:?} differ");
    door
}

#[test]
fn dmsetup_verbs_through_the_door_match_dmkit() {
    let d = Daemon::start("door");
    let a = d.dir.sparse("a.img", 8 << 20);
    let a = a.display().to_string();

    // version: the driver's version is the door's
    let v = dmsetup(&d, &["version"]);
    let lines: Vec<&str> = v.lines().collect();
    assert_eq!(lines.len(), 2, "{v}");
    assert!(lines[0].starts_with("Library version:   1.02."), "{v}");
    assert_eq!(lines[1], "Driver version:    4.48.0");
    deliberate("version");
    assert!(d.ok(&["version"]).starts_with("dmkit version:"));

    same(&d, &["targets"]);
    assert_eq!(dmsetup(&d, &["ls"]), "No devices found\n");
    assert_eq!(d.ok(&["ls"]), "No devices found\n");

    // create: linear and zero, from --table and from stdin, with a uuid
    assert_eq!(
        dmsetup(&d, &["create", "lin", "--table", &format!("0 8192 linear {a} 0")]),
        ""
    );
    assert_eq!(
        dmsetup_ok(&d, &["create", "zer", "-u", "UUID-ZER"], "0 100 zero\n"),
        ""
    );
    assert_eq!(
        dmsetup_ok(
            &d,
            &["create", "two"],
            "0 64 zero\n64 64 linear /dev/mapper/lin 8\n"
        ),
        ""
    );
    // a read-only table (-r): the device is read-only once it is live
    assert_eq!(dmsetup(&d, &["create", "ro", "-r", "--table", "0 100 zero"]), "");
    assert!(d.ok(&["info", "ro"]).contains("ACTIVE (READ-ONLY)"));
    assert_eq!(dmsetup(&d, &["remove", "ro"]), "");
    // the tables dmkit holds are the ones dmsetup loaded
    assert_eq!(d.ok(&["table", "lin"]), format!("0 8192 linear {a} 0\n"));
    assert_eq!(d.ok(&["table", "zer"]), "0 100 zero \n");
    assert_eq!(d.ok(&["table", "two"]), "0 64 zero \n64 64 linear 511:0 8\n");
    assert_eq!(d.info_line("zer", "UUID"), "UUID: UUID-ZER");

    let ls = same(&d, &["ls"]);
    assert_eq!(ls, "lin\t(511:0)\ntwo\t(511:2)\nzer\t(511:1)\n");
    same(&d, &["table"]);
    // listed by target type dmsetup prints `(major, minor)` (dmkit printed
    // `(major:minor)` until this test)
    assert_eq!(
        same(&d, &["ls", "--target", "zero"]),
        "two\t(511, 2)\nzer\t(511, 1)\n"
    );
    same(&d, &["status", "--target", "linear"]);
    same(&d, &["table", "two"]);
    same(&d, &["status"]);
    same(&d, &["status", "lin"]);
    same(&d, &["info"]);
    let info = same(&d, &["info", "zer"]);
    assert!(info.contains("State:             ACTIVE\n"), "{info}");
    same(&d, &["info", "-c"]);
    same(&d, &["info", "-c", "-o", "name,uuid,attr,events,open,segments"]);
    same(&d, &["info", "-c", "--noheadings", "-o", "name,major,minor"]);
    // deps: a device over a dm device is the same; over a file, deliberately not
    assert_eq!(same(&d, &["deps", "two"]), "1 dependencies\t: (511, 0)\n");
    same(&d, &["deps", "zer"]);
    assert_eq!(dmsetup(&d, &["deps", "lin"]), "1 dependencies\t: (0, 0)\n");
    assert_eq!(d.ok(&["deps", "lin"]), format!("1 dependencies\t: ({a})\n"));
    deliberate("deps of a device over a file");
    assert_eq!(
        dmsetup(&d, &["ls", "--tree"]),
        "two (511:2)\n `-lin (511:0)\n    `- (0:0)\nzer (511:1)\n"
    );
    assert_eq!(
        d.ok(&["ls", "--tree"]),
        format!("two (511:2)\n `-lin (511:0)\n    `- ({a})\nzer (511:1)\n")
    );
    deliberate("ls --tree over a file");

    // suspend / resume
    assert_eq!(dmsetup(&d, &["suspend", "zer"]), "");
    assert_eq!(d.info_line("zer", "State"), "State:             SUSPENDED");
    same(&d, &["info", "zer"]);
    assert_eq!(dmsetup(&d, &["resume", "zer"]), "");
    assert_eq!(d.info_line("zer", "State"), "State:             ACTIVE");

    // reload, then resume
    assert_eq!(dmsetup(&d, &["reload", "zer", "--table", "0 200 zero"]), "");
    assert_eq!(d.ok(&["table", "zer", "--inactive"]), "0 200 zero \n");
    same(&d, &["table", "zer", "--inactive"]);
    assert_eq!(d.info_line("zer", "Tables"), "Tables present:    LIVE & INACTIVE");
    same(&d, &["info", "zer"]);
    assert_eq!(dmsetup(&d, &["resume", "zer"]), "");
    assert_eq!(d.ok(&["table", "zer"]), "0 200 zero \n");
    assert_eq!(d.info_line("zer", "Tables"), "Tables present:    LIVE");

    // wait: returns once the event counter passes the number given (a new uuid
    // is an event)
    let mut w = d
        .exec()
        .arg(common::tool_path("dmsetup"))
        .args(["wait", "lin", "0"])
        .env_remove("DM_DEV_DIR")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dmsetup wait");
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(
        w.try_wait().expect("wait status").is_none(),
        "dmsetup wait returned before an event"
    );
    assert_eq!(dmsetup(&d, &["rename", "lin", "--setuuid", "UUID-LIN"]), "");
    let o = w.wait_with_output().expect("dmsetup wait");
    assert!(
        o.status.success() && o.stdout.is_empty() && o.stderr.is_empty(),
        "{o:?}"
    );
    assert_eq!(d.info_line("lin", "Event"), "Event number:      1");
    same(&d, &["info", "lin"]);

    // rename, and a uuid for a device without one
    assert_eq!(dmsetup(&d, &["rename", "zer", "zed"]), "");
    assert_eq!(d.ok(&["ls"]), "lin\t(511:0)\ntwo\t(511:2)\nzed\t(511:1)\n");
    assert_eq!(dmsetup(&d, &["rename", "two", "--setuuid", "UUID-TWO"]), "");
    assert_eq!(d.info_line("two", "UUID"), "UUID: UUID-TWO");
    same(&d, &["info", "-c", "-o", "name,uuid,events"]);

    // data written through NBD to a device dmsetup created lands in the file
    let data = common::pattern(7, 4096);
    let mut c = nbd::Client::connect(&d.sock(), "lin");
    c.write(4096, &data);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0);
    drop(c);
    assert_eq!(read_at(std::path::Path::new(&a), 4096, 4096), data);

    // remove: a device in another's table is busy, as the kernel's
    let o = dmsetup_in(&d, &["remove", "lin"], "");
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("device-mapper: remove ioctl on lin  failed: Device or resource busy"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(dmsetup(&d, &["remove", "two"]), "");
    assert_eq!(d.ok(&["ls"]), "lin\t(511:0)\nzed\t(511:1)\n");
    assert_eq!(dmsetup(&d, &["remove_all"]), "");
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
    // no device left in the state file either
    assert!(!d.log().contains("panicked"), "{}", d.log());
}

#[test]
fn a_thin_pool_message_through_the_door() {
    let d = Daemon::start("door-thin");
    let meta = d.dir.sparse("meta", 4 << 20);
    let data = d.dir.sparse("data", 16 << 20);
    let pool = format!("0 32768 thin-pool {} {} 128 0", meta.display(), data.display());
    assert_eq!(dmsetup(&d, &["create", "pool", "--table", &pool]), "");
    assert_eq!(dmsetup(&d, &["message", "pool", "0", "create_thin 0"]), "");
    assert_eq!(dmsetup(&d, &["message", "pool", "0", "create_thin", "1"]), "");
    assert_eq!(
        dmsetup(
            &d,
            &["create", "thin0", "--table", "0 8192 thin /dev/mapper/pool 0"]
        ),
        ""
    );
    assert_eq!(d.ok(&["table", "thin0"]), "0 8192 thin 511:0 0\n");
    same(&d, &["status", "pool"]);
    same(&d, &["table", "pool"]);
    same(&d, &["status", "thin0"]);
    // a message the pool refuses: dmsetup reports the ioctl's failure, and the
    // door's reason is on stderr
    let o = dmsetup_in(&d, &["message", "pool", "0", "create_thin 0"], "");
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.contains("dmkit: ") && err.contains("device-mapper: message ioctl on pool  failed: File exists"),
        "{err}"
    );
    // data through the thin lands in the pool: its status counts a block
    let mut c = nbd::Client::connect(&d.sock(), "thin0");
    c.write(0, &common::pattern(3, 65536));
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0);
    drop(c);
    let st = dmsetup(&d, &["status", "thin0"]);
    assert_eq!(st, d.ok(&["status", "thin0"]));
    assert!(st.starts_with("0 8192 thin 128 "), "{st}");
    assert_eq!(dmsetup(&d, &["remove", "thin0"]), "");
    assert_eq!(dmsetup(&d, &["remove", "pool"]), "");
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
}

/// dm statistics through the door: Debian's `dmstats` (dmsetup under another
/// name) makes a region of four areas; requests through NBD count in the areas
/// they touch as the kernel's dm-stats counts them (a read starting where the
/// last one ended counts as merged), in `@stats_print` and in `dmstats report`;
/// an empty `@stats_list` is still an answer; an unknown region is ENOENT.
#[test]
fn dmstats_counts_io_per_area_through_the_door() {
    let d = Daemon::start("door-stats");
    let img = d.dir.sparse("st.img", 4 << 20);
    let table = format!("0 8192 linear {} 0", img.display());
    assert_eq!(dmsetup(&d, &["create", "st", "--table", &table]), "");
    let ok = |args: &[&str]| {
        let o = tool_in(&d, "dmstats", args, "");
        assert!(o.status.success(), "dmstats {args:?}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    assert_eq!(
        ok(&["create", "--areas", "4", "st"]),
        "st: Created new region with 4 area(s) as region ID 0\n"
    );
    let mut c = nbd::Client::connect(&d.sock(), "st");
    c.write(0, &common::pattern(4, 65536));
    c.read(3 << 20, 8192);
    c.read((3 << 20) + 8192, 4096);
    drop(c);
    let print = dmsetup(&d, &["message", "st", "0", "@stats_print", "0"]);
    let counts: Vec<(String, Vec<u64>)> = print
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            assert_eq!(f.len(), 14, "the range and 13 counters: {l}");
            let n = f[1..].iter().map(|x| x.parse().unwrap()).collect::<Vec<u64>>();
            // reads, merged, sectors; writes, merged, sectors; in flight
            (f[0].to_string(), vec![n[0], n[1], n[2], n[4], n[5], n[6], n[8]])
        })
        .collect();
    assert_eq!(
        counts,
        vec![
            ("0+2048".to_string(), vec![0, 0, 0, 1, 0, 128, 0]),
            ("2048+2048".to_string(), vec![0; 7]),
            ("4096+2048".to_string(), vec![0; 7]),
            ("6144+2048".to_string(), vec![2, 1, 24, 0, 0, 0, 0]),
        ],
        "{print}"
    );
    let report = ok(&[
        "report",
        "-o",
        "area_id,read_count,write_count,read_sector_count,write_sector_count",
        "--areas",
        "st",
    ]);
    let rows: Vec<Vec<String>> = report
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    assert_eq!(
        rows,
        [
            vec!["ArID", "#Reads", "#Writes", "#RdSectors", "#WrSectors"],
            vec!["0", "0", "1", "0", "128"],
            vec!["1", "0", "0", "0", "0"],
            vec!["2", "0", "0", "0", "0"],
            vec!["3", "2", "0", "24", "0"],
            // the region's own row: its areas summed
            vec!["0", "2", "1", "24", "128"],
        ]
        .map(|r| r.iter().map(|x| x.to_string()).collect::<Vec<_>>()),
        "{report}"
    );
    let o = dmsetup_in(&d, &["message", "st", "0", "@stats_print", "7"], "");
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("No such file or directory"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(ok(&["delete", "--allregions", "st"]), "");
    assert_eq!(ok(&["list"]), "");
    assert_eq!(dmsetup(&d, &["message", "st", "0", "@stats_list"]), "");
    assert_eq!(dmsetup(&d, &["remove", "st"]), "");
}

/// A chosen minor number (DM_PERSISTENT_DEV_FLAG: `dmsetup create -j 511 -m N`,
/// as LVM's `lvchange --persistent y --minor N` asks): the device gets it, a
/// second device asking for it gets EBUSY, one out of range EINVAL, the others
/// still get the lowest free number, and a restart gives each the same again.
#[test]
fn a_chosen_minor_is_given_refused_when_taken_and_kept_across_a_restart() {
    let d = Daemon::start("door-minor");
    let create = |d: &Daemon, name: &str, minor: &str| {
        dmsetup_in(
            d,
            &["create", name, "-j", "511", "-m", minor, "--table", "0 8 zero"],
            "",
        )
    };
    let o = create(&d, "pm", "77");
    assert!(o.status.success(), "{}", text(&o.stderr));
    for (minor, why) in [("77", "Device or resource busy"), ("1048576", "Invalid argument")] {
        let o = create(&d, "pm2", minor);
        let err = text(&o.stderr);
        assert!(
            !o.status.success() && err.contains(&format!("failed: {why}")),
            "minor {minor}: {err}"
        );
    }
    d.ok(&["create", "q", "--minor", "78", "--table", "0 8 zero"]);
    d.ok(&["create", "r", "--table", "0 8 zero"]);
    let ls = "pm\t(511:77)\nq\t(511:78)\nr\t(511:0)\n";
    assert_eq!(dmsetup(&d, &["ls"]), ls);
    let d = d.kill9_and_restore();
    assert_eq!(dmsetup(&d, &["ls"]), ls, "after a restart");
}

/// A table's mode is its own, as in the kernel: a table loaded read-only
/// (`dmsetup reload --readonly`, DM_READONLY_FLAG) makes the device read-only
/// at the resume that makes it live, a writable one writable again; a restart
/// keeps the live table's mode and the inactive table's.
#[test]
fn a_read_only_reload_makes_the_device_read_only_at_its_resume() {
    let d = Daemon::start("door-ro");
    let img = d.dir.sparse("ro.img", 1 << 20);
    let t = format!("0 2048 linear {} 0", img.display());
    let attr = |d: &Daemon| dmsetup(d, &["info", "-c", "-o", "attr", "--noheadings", "ro"]);
    assert_eq!(dmsetup(&d, &["create", "ro", "--table", &t]), "");
    assert_eq!(attr(&d), "L--w\n");
    assert_eq!(dmsetup(&d, &["reload", "--readonly", "ro", "--table", &t]), "");
    assert_eq!(attr(&d), "LI-w\n", "writable until the resume");
    assert_eq!(dmsetup(&d, &["resume", "ro"]), "");
    assert_eq!(attr(&d), "L--r\n");
    assert!(d.ok(&["info", "ro"]).contains("(READ-ONLY)"));
    let d = d.kill9_and_restore();
    assert_eq!(attr(&d), "L--r\n", "read-only after a restart");
    // a writable table loaded, not yet resumed, across a restart
    assert_eq!(dmsetup(&d, &["reload", "ro", "--table", &t]), "");
    let d = d.kill9_and_restore();
    assert_eq!(attr(&d), "LI-r\n");
    assert_eq!(dmsetup(&d, &["resume", "ro"]), "");
    assert_eq!(attr(&d), "L--w\n", "writable again");
    let mut c = nbd::Client::connect(&d.sock(), "ro");
    c.write(0, &common::pattern(9, 4096));
    assert_eq!(read_at(&img, 0, 4096), common::pattern(9, 4096));
}

#[test]
fn exec_without_a_daemon_says_where_it_looked() {
    let d = Daemon::start("door-none");
    let run = d.dir.path("nothing-here");
    let o = Command::new(common::BIN)
        .arg("--run-dir")
        .arg(&run)
        .args(["exec", "--"])
        .arg(common::tool_path("dmsetup"))
        .arg("version")
        .env("LC_ALL", "C")
        .env_remove("DM_DEV_DIR")
        .output()
        .expect("dmkit exec");
    assert!(!o.status.success());
    let err = text(&o.stderr);
    assert!(
        err.contains(&format!(
            "dmkit: no dmkit daemon answers at {}/dm-ioctl.sock",
            run.display()
        )),
        "{err}"
    );
    // dmsetup's own words for a missing driver follow
    assert!(
        err.contains("Failure to communicate with kernel device-mapper driver."),
        "{err}"
    );
}

/// One frame to the door carrying the whole buffer: (errno, the bytes copied
/// back).
fn door(s: &mut UnixStream, request: u32, buf: &[u8]) -> (i32, Vec<u8>) {
    door_part(s, request, buf.len(), buf)
}

/// One frame carrying the first bytes (`buf`) of a buffer of `len` bytes.
fn door_part(s: &mut UnixStream, request: u32, len: usize, buf: &[u8]) -> (i32, Vec<u8>) {
    let mut f = Vec::new();
    f.extend_from_slice(&request.to_le_bytes());
    f.extend_from_slice(&(len as u32).to_le_bytes());
    f.extend_from_slice(&(buf.len() as u32).to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(buf);
    s.write_all(&f).expect("send");
    let mut h = [0u8; 12];
    s.read_exact(&mut h).expect("reply");
    let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let mut out = vec![0u8; word(4) as usize];
    s.read_exact(&mut out).expect("reply bytes");
    let mut why = vec![0u8; word(8) as usize];
    s.read_exact(&mut why).expect("reason");
    (word(0) as i32, out)
}

#[test]
fn hostile_buffers_get_the_kernels_errnos_and_the_daemon_stays_up() {
    let d = Daemon::start("door-hostile");
    d.create("z", "0 64 zero");
    let mut s = UnixStream::connect(d.run.join("dm-ioctl.sock")).expect("door");
    let ok = dm::build(16384, "z", "", 0, &[]);
    assert_eq!(door(&mut s, Cmd::DevStatus.request(), &ok).0, 0);

    // truncated: shorter than the header, or than its data_size
    let (e, _) = door(&mut s, Cmd::DevStatus.request(), &ok[..200]);
    assert_eq!(e, libc::EFAULT);
    let (e, _) = door(&mut s, Cmd::TableStatus.request(), &ok[..1000]);
    assert_eq!(e, libc::EFAULT);
    // data_size smaller than the header, larger than the kernel takes, larger
    // than the door allocates
    for (size, want) in [
        (100u32, libc::EINVAL),
        (u32::MAX, libc::EINVAL),
        (200 << 20, libc::ENOMEM),
    ] {
        let mut b = ok.clone();
        dm::set_data_size(&mut b, size);
        assert_eq!(
            door(&mut s, Cmd::TableStatus.request(), &b).0,
            want,
            "data_size {size}"
        );
    }
    // a version the driver is older than: refused, the driver's version copied back
    let mut b = ok.clone();
    b[4..8].copy_from_slice(&99u32.to_ne_bytes());
    let (e, out) = door(&mut s, Cmd::DevStatus.request(), &b);
    assert_eq!((e, out.len()), (libc::EINVAL, 12));
    assert_eq!(dm::reply_header(&out).version, [4, 48, 0]);
    // unknown commands, another driver's ioctl
    assert_eq!(door(&mut s, 0xc138_fd30, &ok).0, libc::ENOTTY);
    assert_eq!(door(&mut s, 0x5401, &ok).0, libc::ENOTTY);
    // a table load whose first spec lies in the header, whose `next` points
    // outside the buffer, or is unaligned; a name list filter of a device that
    // is not there
    let specs = [
        dm::Spec {
            start: 0,
            len: 32,
            target_type: "zero".into(),
            params: String::new(),
        },
        dm::Spec {
            start: 32,
            len: 32,
            target_type: "zero".into(),
            params: String::new(),
        },
    ];
    let data = dm::table_data(&specs);
    let load = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = dm::build(dm::HEADER_SIZE + data.len(), "z", "", 0, &data);
        dm::set_target_count(&mut b, 2);
        f(&mut b);
        b
    };
    let good = load(&|_| {});
    let bad_start = load(&|b| dm::set_data_start(b, 40));
    let bad_next =
        load(&|b| b[dm::DATA_START + 20..dm::DATA_START + 24].copy_from_slice(&0x7fff_fff0u32.to_ne_bytes()));
    let odd_next =
        load(&|b| b[dm::DATA_START + 20..dm::DATA_START + 24].copy_from_slice(&44u32.to_ne_bytes()));
    let too_many = load(&|b| dm::set_target_count(b, 1000));
    for (what, b) in [
        ("data_start in the header", &bad_start),
        ("next outside the buffer", &bad_next),
        ("unaligned next", &odd_next),
        ("more targets than specs", &too_many),
    ] {
        assert_eq!(
            door(&mut s, Cmd::TableLoad.request(), b).0,
            libc::EINVAL,
            "{what}"
        );
    }
    // nothing of those reached the device
    assert_eq!(d.info_line("z", "Tables"), "Tables present:    LIVE");
    assert_eq!(door(&mut s, Cmd::TableLoad.request(), &good).0, 0);
    assert_eq!(d.ok(&["table", "z", "--inactive"]), "0 32 zero \n32 32 zero \n");
    // a message without its NUL, an empty one
    let mut m = dm::build(dm::HEADER_SIZE + 12, "z", "", 0, &[]);
    m[dm::DATA_START + 8..].copy_from_slice(b"abcd");
    assert_eq!(door(&mut s, Cmd::TargetMsg.request(), &m).0, libc::EINVAL);
    let m = dm::build(16384, "z", "", 0, &[0; 9]);
    assert_eq!(door(&mut s, Cmd::TargetMsg.request(), &m).0, libc::EINVAL);
    // a rename whose new name is in the header
    let mut r = dm::build(16384, "z", "", 0, b"y\0");
    dm::set_data_start(&mut r, 60);
    assert_eq!(door(&mut s, Cmd::DevRename.request(), &r).0, libc::EINVAL);
    // name and uuid both given
    assert_eq!(
        door(
            &mut s,
            Cmd::DevStatus.request(),
            &dm::build(16384, "z", "u", 0, &[])
        )
        .0,
        libc::EINVAL
    );
    // a list too small for the answer: BUFFER_FULL, as libdevmapper retries on
    let (e, out) = door(
        &mut s,
        Cmd::ListDevices.request(),
        &dm::build(320, "", "", 0, &[]),
    );
    assert_eq!(e, 0);
    assert_ne!(dm::reply_header(&out).flags & dm::BUFFER_FULL_FLAG, 0);
    // the header alone of a status request's buffer (as the library carries
    // it): the answer, no longer than the result; of a load's: EFAULT, as a
    // buffer the kernel cannot read
    let (e, out) = door_part(&mut s, Cmd::TableStatus.request(), 16384, &ok[..dm::HEADER_SIZE]);
    assert_eq!(e, 0);
    assert_eq!(out.len(), dm::reply_header(&out).data_size as usize);
    assert_eq!(
        dm::read_status(&out),
        vec![(0, 64, "zero".to_string(), String::new())]
    );
    let (e, _) = door_part(&mut s, Cmd::TableLoad.request(), 16384, &good[..dm::HEADER_SIZE]);
    assert_eq!(e, libc::EFAULT);
    // the same connection still answers
    let (e, out) = door(&mut s, Cmd::DevStatus.request(), &ok);
    assert_eq!((e, dm::reply_header(&out).name.as_str()), (0, "z"));

    // a frame larger than the door takes: that connection is closed, the
    // daemon goes on
    let mut f = Vec::new();
    f.extend_from_slice(&Cmd::TableLoad.request().to_le_bytes());
    f.extend_from_slice(&u32::MAX.to_le_bytes());
    f.extend_from_slice(&u32::MAX.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    s.write_all(&f).expect("send");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());
    // one that claims to carry more than the buffer holds: the same
    let mut s = UnixStream::connect(d.run.join("dm-ioctl.sock")).expect("door");
    let mut f = Vec::new();
    f.extend_from_slice(&Cmd::DevStatus.request().to_le_bytes());
    f.extend_from_slice(&(dm::HEADER_SIZE as u32).to_le_bytes());
    f.extend_from_slice(&(dm::HEADER_SIZE as u32 + 8).to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&[0; dm::HEADER_SIZE + 8]);
    s.write_all(&f).expect("send");
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());
    // garbage, then a hang-up in the middle of a frame
    let mut g = UnixStream::connect(d.run.join("dm-ioctl.sock")).expect("door");
    g.write_all(&[0xfd; 7]).expect("send");
    drop(g);
    let mut s = UnixStream::connect(d.run.join("dm-ioctl.sock")).expect("door");
    assert_eq!(door(&mut s, Cmd::DevStatus.request(), &ok).0, 0);
    assert_eq!(d.ok(&["ls"]), "z\t(511:0)\n");
    assert!(!d.log().contains("panicked"), "{}", d.log());
}

/// dmeventd's use of the control node: one thread waits in DM_DEV_WAIT while
/// the program's other threads go on with their own ioctls (each thread has its
/// own connection to the daemon, as each caller has its own turn in the
/// kernel), and a signal interrupts the wait with EINTR, as the kernel's does
/// (dmeventd stops a monitoring thread this way); the daemon then stops waiting
/// for it. `tests/door/waiter.c`, built here with the C compiler.
#[test]
fn a_waiting_thread_holds_up_no_other_and_a_signal_interrupts_it() {
    common::need_all(&["cc"]);
    let d = Daemon::start("doorwait");
    d.create("w", "0 8 zero");
    let exe = common::build_c(&d, "waiter");
    let o = d.exec().arg(&exe).arg("w").output().expect("run waiter");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "waiter: {}\n{out}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        out,
        "waiter still waiting: yes\n\
         version while it waits: ok in under 1 s\n\
         status while it waits: ok\n\
         waiter after the signal: EINTR\n\
         status after: ok\n"
    );
    // the daemon let the interrupted wait go: the device can be removed at once
    d.ok(&["remove", "w"]);
}

/// What libdevmapper and LVM read of a device in sysfs, `/sys/dev/block/511:N/dm/`
/// `name`, `uuid` and `suspended`, is the daemon's device's behind the door.
#[test]
fn sysfs_dm_attributes_are_the_daemons_behind_the_door() {
    let d = Daemon::start("doorsysfs");
    d.ok(&["create", "sy", "--uuid", "LVM-sysfs-test", "--table", "0 8 zero"]);
    // `ls`: "sy\t(511:N)"
    let ls = d.ok(&["ls"]);
    let num = ls
        .trim()
        .trim_start_matches("sy\t(")
        .trim_end_matches(')')
        .to_string();
    assert!(num.starts_with("511:"), "{ls}");
    let dir = format!("/sys/dev/block/{num}/dm");
    let cat = || -> String {
        let o = d
            .exec()
            .arg("cat")
            .args(["name", "uuid", "suspended"].map(|a| format!("{dir}/{a}")))
            .output()
            .expect("cat");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(cat(), "sy\nLVM-sysfs-test\n0\n");
    d.ok(&["suspend", "sy"]);
    assert_eq!(cat(), "sy\nLVM-sysfs-test\n1\n");
    d.ok(&["resume", "sy"]);
    d.ok(&["remove", "sy"]);
}

/// multipathd's use of the control node: DM_DEV_ARM_POLL, then `poll()` on the
/// same descriptor, which stays quiet until an event (a rename here) and then
/// is readable (POLLIN) until it is armed again, as the kernel's; the
/// descriptor's other ioctls go on meanwhile. `tests/door/poller.c`.
#[test]
fn dev_arm_poll_makes_the_control_descriptor_readable_at_an_event() {
    use std::io::{BufRead, BufReader, Read};
    common::need_all(&["cc"]);
    let d = Daemon::start("doorpoll");
    d.create("p", "0 8 zero");
    let exe = common::build_c(&d, "poller");
    let mut child = d
        .exec()
        .arg(&exe)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run poller");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut seen = String::new();
    while !seen.ends_with("armed\n") {
        let mut l = String::new();
        assert!(out.read_line(&mut l).expect("read") > 0, "poller ended: {seen}");
        seen.push_str(&l);
    }
    d.ok(&["rename", "p", "q"]);
    out.read_to_string(&mut seen).expect("read");
    assert!(child.wait().expect("wait").success(), "{seen}");
    assert_eq!(
        seen,
        "arm: ok\n\
         before an event: quiet\n\
         armed\n\
         after the event: POLLIN\n\
         still: POLLIN\n\
         version: ok\n\
         re-arm: ok\n\
         after re-arming: quiet\n"
    );
}

/// A dmkit device's node opens behind the door as its device file: bytes in
/// the middle of a sector are written as read-modify-write of whole sectors, a
/// write past the end fails with ENOSPC (dd: "No space left on device"), and a
/// read-only device does not open for writing (EACCES), as block devices do.
#[test]
fn device_nodes_open_as_the_devices_files_behind_the_door() {
    let d = Daemon::start("doorfiles");
    let f = d.dir.sparse("back", 1 << 20);
    std::fs::write(&f, vec![0x11u8; 1 << 20]).expect("fill");
    d.create("x", &format!("0 2048 linear {} 0", f.display()));
    d.ok(&[
        "create",
        "ro",
        "--readonly",
        "--table",
        &format!("0 2048 linear {} 0", f.display()),
    ]);
    let sh = |script: &str| -> Output { d.exec().args(["sh", "-c", script]).output().expect("sh") };
    let o = sh("dmsetup mknodes && printf hello | dd of=$DM_DEV_DIR/mapper/x bs=1 seek=1021 conv=notrunc status=none && \
                dd if=$DM_DEV_DIR/mapper/x bs=1 skip=1019 count=9 status=none");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        o.stdout, b"\x11\x11hello\x11\x11",
        "five bytes across a sector boundary, read back"
    );
    assert_eq!(
        &read_at(&f, 1019, 9),
        b"\x11\x11hello\x11\x11",
        "and on the file below"
    );
    let o = sh("printf x | dd of=$DM_DEV_DIR/mapper/x bs=1 seek=1048576 conv=notrunc status=none");
    assert!(!o.status.success(), "a write past the end fails");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("No space left on device"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = sh("printf x | dd of=$DM_DEV_DIR/mapper/ro bs=1 conv=notrunc status=none");
    assert!(
        !o.status.success(),
        "a read-only device does not open for writing"
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let o = sh("blockdev --getro --getsize64 $DM_DEV_DIR/mapper/ro");
    assert_eq!(
        String::from_utf8_lossy(&o.stdout),
        "1\n1048576\n",
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        d.info_line("x", "Open count").split_whitespace().last(),
        Some("0"),
        "every open was closed"
    );
}
