//! The `log-writes` target (the kernel's dm-log-writes) through the real daemon
//! and NBD, and `dmkit replay`: the log's entries, read here by a parser of the
//! kernel's format written from its description (not dmkit's), in the order the
//! kernel's rules give; replays to a mark, a flush and the end equal the device
//! as it was then; QEMU's blklogwrites, an independent writer of the format,
//! replays to the bytes it wrote; a full log device stops the logging, not the
//! writes; a log that lies is refused with the entry and byte named. In the
//! 6.12 guest: the kernel's own dm-log-writes and dmkit's (as a ublk block
//! device) write the same log for the same requests, and an ext4 file system
//! over each is found consistent at every FUA write its log holds
//! (xfstests' generic/482, replayed and checked by `dmkit replay --check-at`).

use crate::common;
use crate::oracle;

use common::nbd::{Client, FLAG_FUA, FLUSH, TRIM, WRITE};
use common::{pattern, run, Daemon, BIN};
use std::path::Path;
use std::process::Command;

use common::MIB;

/// One entry as the kernel's format has it: (flags, sector, count, mark text,
/// data).
#[derive(Debug, PartialEq, Eq)]
struct Ent {
    flags: u64,
    sector: u64,
    count: u64,
    mark: String,
    data: Vec<u8>,
}

/// The entries the super counts, read straight from the bytes (512-byte blocks
/// here: the backing files' logical block size).
fn entries(log: &[u8]) -> Vec<Ent> {
    let u64_at = |at: usize| u64::from_le_bytes(log[at..at + 8].try_into().expect("8 bytes"));
    assert_eq!(&log[0..8], b"rhswfsj\0", "the super's magic");
    assert_eq!(u64_at(8), 1, "version");
    let ss = u32::from_le_bytes(log[24..28].try_into().expect("4 bytes")) as usize;
    assert_eq!(ss, 512, "sectorsize");
    let n = u64_at(16);
    let mut pos = ss;
    let mut out = Vec::new();
    for _ in 0..n {
        let (sector, count, flags, len) = (u64_at(pos), u64_at(pos + 8), u64_at(pos + 16), u64_at(pos + 24));
        let mark = if flags & 8 != 0 {
            String::from_utf8(log[pos + 32..pos + 32 + len as usize].to_vec()).expect("mark text")
        } else {
            assert_eq!(len, 0, "a write's data_len");
            String::new()
        };
        pos += ss;
        let data = if flags & (4 | 8) == 0 {
            let d = log[pos..pos + count as usize * ss].to_vec();
            pos += count as usize * ss;
            d
        } else {
            Vec::new()
        };
        out.push(Ent {
            flags,
            sector,
            count,
            mark,
            data,
        });
    }
    out
}

fn ent(flags: u64, sector: u64, count: u64, mark: &str, data: Vec<u8>) -> Ent {
    Ent {
        flags,
        sector,
        count,
        mark: mark.into(),
        data,
    }
}

fn replay(log: &Path, target: &Path, until: &str) -> String {
    let mut c = Command::new(BIN);
    c.arg("replay").arg(log).arg(target);
    if !until.is_empty() {
        c.args(["--until", until]);
    }
    let out = c.output().expect("dmkit replay");
    assert!(
        out.status.success(),
        "replay {until}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Writes, a FUA write, flushes, a mark and a discard through a log-writes
/// device: the log holds them in the kernel's order (a write once a later flush
/// completes, a FUA write at once, a mark at once, what no flush took and the
/// end mark when the table goes), each replay equals the device as it was at
/// that point, and the status and messages are the kernel's.
#[test]
fn the_log_follows_the_kernels_order_and_replays_to_each_point() {
    let d = Daemon::start("lw");
    let s = &d.dir;
    let data = s.sparse("data.img", MIB);
    let log = s.sparse("log.img", 4 * MIB);
    d.create(
        "lw",
        &format!("0 {} log-writes {} {}", MIB / 512, data.display(), log.display()),
    );
    assert_eq!(
        d.ok(&["table", "lw"]),
        format!("0 2048 log-writes {} {}\n", data.display(), log.display())
    );
    assert_eq!(
        d.ok(&["status", "lw"]),
        "0 2048 log-writes 0 0\n",
        "nothing logged yet"
    );
    let (a, b, c, dd, e) = (
        pattern(1, 4096),
        pattern(2, 8192),
        pattern(3, 4096),
        pattern(4, 512),
        pattern(5, 4096),
    );
    let mut cl = Client::connect(&d.sock(), "lw");
    assert_eq!(cl.call(WRITE, 0, 0, 4096, &a), 0);
    assert_eq!(cl.call(WRITE, 0, 8192, 8192, &b), 0);
    assert_eq!(cl.call(FLUSH, 0, 0, 0, &[]), 0);
    let at_flush1 = std::fs::read(&data).expect("data");
    assert_eq!(cl.call(WRITE, FLAG_FUA, 65536, 4096, &c), 0);
    assert_eq!(cl.call(WRITE, 0, 4096, 512, &dd), 0);
    d.ok(&["message", "lw", "0", "mark", "m1"]);
    let mut at_m1 = std::fs::read(&data).expect("data");
    // the mark was taken before D, which no flush has taken yet
    at_m1[4096..4608].fill(0);
    assert_eq!(cl.call(TRIM, 0, 8192, 4096, &[]), 0);
    assert_eq!(cl.call(FLUSH, 0, 0, 0, &[]), 0);
    assert_eq!(cl.call(WRITE, 0, 131072, 4096, &e), 0);
    // what the status says before the table goes: A B FLUSH C m1 D DISCARD FLUSH
    // logged (E waits for a flush); the log's next free sector less one
    let used = 1 + (1 + 8) + (1 + 16) + 1 + (1 + 8) + 1 + (1 + 1) + 1 + 1;
    assert_eq!(
        d.ok(&["status", "lw"]),
        format!("0 2048 log-writes 8 {}\n", used - 1)
    );
    // the kernel's message errors
    let e1 = d.fails(&["message", "lw", "0", "mark"]);
    assert!(
        e1.contains("Invalid log-writes message arguments, expect 2 arguments, got 1"),
        "{e1}"
    );
    let e2 = d.fails(&["message", "lw", "0", "bogus", "x"]);
    assert!(
        e2.contains("Unrecognised log writes target message received: bogus"),
        "{e2}"
    );
    drop(cl);
    let final_data = std::fs::read(&data).expect("data");
    d.remove_closed("lw");

    let got = entries(&std::fs::read(&log).expect("log"));
    let want = vec![
        ent(0, 0, 8, "", a.clone()),
        ent(0, 16, 16, "", b.clone()),
        ent(1, 0, 0, "", vec![]),
        ent(2, 128, 8, "", c.clone()),
        ent(8, 0, 0, "m1", vec![]),
        ent(0, 8, 1, "", dd.clone()),
        ent(4, 16, 8, "", vec![]),
        ent(1, 0, 0, "", vec![]),
        ent(0, 256, 8, "", e.clone()),
        ent(8, 0, 0, "dm-log-writes-end", vec![]),
    ];
    assert_eq!(got, want, "the log's entries");

    // replays: to the first flush, to the mark, to the end
    for (until, want) in [("flush:1", &at_flush1), ("mark:m1", &at_m1), ("", &final_data)] {
        let target = s.sparse(&format!("replay-{}", until.replace(':', "-")), MIB);
        let said = replay(&log, &target, until);
        assert!(said.starts_with("replayed "), "{said}");
        assert!(
            std::fs::read(&target).expect("replay") == *want,
            "replay {until:?} differs"
        );
    }
    let all = s.sparse("replay-entry", MIB);
    assert_eq!(
        replay(&log, &all, "entry:4"),
        "replayed 4 entries: 3 writes, 0 discards, 1 flushes, 0 marks\n"
    );
    let listed = run(Command::new(BIN).arg("replay").arg(&log).arg("--list"));
    assert_eq!(listed.lines().count(), 10, "{listed}");
    assert!(
        listed.contains("\n3 fua sector 128 count 8\n4 mark sector 0 count 0 m1\n"),
        "{listed}"
    );
    // a mark the log does not have: the replay says it was not reached
    let out = Command::new(BIN)
        .arg("replay")
        .arg(&log)
        .arg(&all)
        .args(["--until", "mark:nope"])
        .output()
        .expect("replay");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("the log ended after 10 entries without reaching mark:nope"),
        "{err}"
    );
}

/// QEMU's blklogwrites writes the same format: dmkit's replay of its log gives
/// the bytes QEMU wrote.
#[test]
fn a_qemu_blklogwrites_log_replays_to_the_bytes_qemu_wrote() {
    let d = Daemon::start("lw-qemu");
    let s = &d.dir;
    let data = s.sparse("qdata.img", MIB);
    let log = s.sparse("qlog.img", 8 * MIB);
    let mut cmd = Command::new("qemu-io");
    cmd.arg("--image-opts").arg(format!(
        "driver=blklogwrites,file.driver=file,file.filename={},log.driver=file,log.filename={},log-sector-size=512,log-append=off",
        data.display(),
        log.display()
    ));
    for i in 0..40u64 {
        let off = (i * 7919 * 512) % (MIB - 8192);
        cmd.args(["-c", &format!("write -P {} {off} {}", i + 1, 512 * (1 + i % 16))]);
        if i % 5 == 4 {
            cmd.args(["-c", "flush"]);
        }
        if i % 9 == 8 {
            cmd.args(["-c", &format!("discard {} 4096", (i * 4096) % (MIB / 2))]);
        }
    }
    run(&mut cmd);
    let target = s.sparse("qreplay.img", MIB);
    let said = replay(&log, &target, "");
    assert!(said.contains(" 40 writes, 4 discards, "), "{said}");
    assert!(
        std::fs::read(&target).expect("replay") == std::fs::read(&data).expect("data"),
        "the replay of QEMU's log is what QEMU wrote"
    );
}

/// A log device too small for what is written: logging stops (status
/// `logging_disabled`, an error in the log), the writes go on; a table smaller
/// than a super and an entry is refused.
#[test]
fn a_full_log_device_stops_logging_not_writes() {
    let d = Daemon::start("lw-full");
    let s = &d.dir;
    let data = s.sparse("data.img", MIB);
    let log = s.sparse("log.img", 64 * 1024);
    d.create(
        "lw",
        &format!("0 {} log-writes {} {}", MIB / 512, data.display(), log.display()),
    );
    let mut cl = Client::connect(&d.sock(), "lw");
    for i in 0..32u64 {
        assert_eq!(
            cl.call(WRITE, 0, i * 4096, 4096, &pattern(i, 4096)),
            0,
            "write {i}"
        );
    }
    assert_eq!(cl.call(FLUSH, 0, 0, 0, &[]), 0);
    assert_eq!(cl.read(31 * 4096, 4096), pattern(31, 4096), "the writes went on");
    // the 127 sectors after the super take 14 entries of 9 sectors; the 15th
    // moved the next sector to 136 before it was found not to fit, as the
    // kernel's does
    let st = d.ok(&["status", "lw"]);
    assert_eq!(st, "0 2048 log-writes 14 135 logging_disabled\n");
    assert!(
        d.log()
            .contains("log-writes: the log device is full: logging stops"),
        "{}",
        d.log()
    );
    drop(cl);
    d.remove_closed("lw");
    let tiny = s.sparse("tiny.img", 512);
    let e = d.fails(&[
        "create",
        "lw2",
        "--table",
        &format!("0 2048 log-writes {} {}", data.display(), tiny.display()),
    ]);
    assert!(e.contains("not even a super and one entry of 512 bytes"), "{e}");
}

/// Logs that lie: the replay refuses them, naming the entry and where it is.
#[test]
fn a_log_that_lies_is_refused_with_the_entry_named() {
    let d = Daemon::start("lw-lies");
    let s = &d.dir;
    let target = s.sparse("t.img", MIB);
    let refused = |name: &str, bytes: &[u8], want: &str| {
        let p = s.path(name);
        std::fs::write(&p, bytes).expect("log");
        let out = Command::new(BIN)
            .arg("replay")
            .arg(&p)
            .arg(&target)
            .output()
            .expect("replay");
        assert!(!out.status.success(), "{name}: accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{name}: {err}");
    };
    let mut sup = vec![0u8; 512];
    sup[0..8].copy_from_slice(b"rhswfsj\0");
    sup[8] = 1;
    sup[24..28].copy_from_slice(&512u32.to_le_bytes());
    // more entries than the log could hold
    let mut b = sup.clone();
    b[16..24].copy_from_slice(&1000u64.to_le_bytes());
    b.resize(4096, 0);
    refused(
        "many",
        &b,
        "the super counts 1000 entries, more than the log's 4096 bytes can hold",
    );
    // an entry whose data runs past the end
    let mut b = sup.clone();
    b[16] = 1;
    let mut e = vec![0u8; 512];
    e[8..16].copy_from_slice(&100u64.to_le_bytes());
    b.extend_from_slice(&e);
    b.resize(2048, 0);
    refused(
        "short",
        &b,
        "entry 0 at byte 512: its 51200 bytes of data lie past the log's end (2048)",
    );
    // a mark longer than its block
    let mut b = sup.clone();
    b[16] = 1;
    let mut e = vec![0u8; 512];
    e[16] = 8;
    e[24..32].copy_from_slice(&600u64.to_le_bytes());
    b.extend_from_slice(&e);
    refused(
        "mark",
        &b,
        "entry 0 at byte 512: a mark of 600 bytes does not fit its block",
    );
    // a sector that overflows
    let mut b = sup.clone();
    b[16] = 1;
    let mut e = vec![0u8; 512];
    e[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
    e[8] = 1;
    b.extend_from_slice(&e);
    b.resize(2048, 0);
    refused(
        "overflow",
        &b,
        "entry 0 at byte 512: sector 18446744073709551615 overflows",
    );
    // not a log at all; a block size the format does not have
    refused("magic", &[0u8; 512], "not a log-writes log: magic 0x0 at byte 0");
    let mut b = sup.clone();
    b[24..28].copy_from_slice(&1000u32.to_le_bytes());
    refused(
        "ss",
        &b,
        "sectorsize 1000 (byte 24) is not a power of two from 512 to 65536",
    );
}

/// The kernel's own dm-log-writes and dmkit's, side by side in the 6.12
/// guest: the same writes, flushes, a mark and a discard, issued one at a time
/// (`dd oflag=direct`, a `conv=fsync` flush, `blkdiscard`) to the kernel's
/// device over two virtio disks and to dmkit's over two others as a ublk block
/// device, give the same status and logs equal byte for byte.
#[test]
fn the_kernels_log_writes_and_dmkits_write_the_same_log() {
    let s = common::Scratch::new("lw-guest");
    let disks: Vec<std::path::PathBuf> = ["kdata", "klog", "ddata", "dlog"]
        .iter()
        .map(|n| {
            s.sparse(
                &format!("{n}.img"),
                if n.ends_with("log") { 4 * MIB } else { MIB },
            )
        })
        .collect();
    let script = format!(
        "{}{}",
        oracle::DMKIT_GUEST,
        r#"
set -e
dd if=/dev/urandom of=/tmp/pat bs=4096 count=16 2>/dev/null
DD=/usr/bin/dd
# the sequence, each step done before the next: $1 the device, $2 the mark command
steps() {
  $DD if=/tmp/pat of=$1 bs=4096 count=1 oflag=direct status=none
  $DD if=/tmp/pat of=$1 bs=4096 count=2 skip=1 seek=2 oflag=direct status=none
  $DD if=/dev/null of=$1 conv=fsync status=none
  $2 m1
  $DD if=/tmp/pat of=$1 bs=512 count=1 skip=40 seek=9 oflag=direct status=none
  /usr/sbin/blkdiscard -o 65536 -l 4096 $1
  $DD if=/dev/null of=$1 conv=fsync status=none
  $DD if=/tmp/pat of=$1 bs=4096 count=1 skip=5 seek=32 oflag=direct status=none
}
dmsetup create klw --table "0 2048 log-writes /dev/vda /dev/vdb"
dmsetup mknodes
steps /dev/mapper/klw "dmsetup message klw 0 mark"
echo "ORACLE k-status $(dmsetup status klw | tr ' ' '_')"
dmsetup remove klw
start
$D create dlw --table "0 2048 log-writes /dev/vdc /dev/vdd"
echo "ORACLE d-attach $($D attach dlw)"
steps /dev/ublkb0 "$D message dlw 0 mark"
echo "ORACLE d-status $($D status dlw | tr ' ' '_')"
$D detach dlw
$D remove dlw
kill $(cat /tmp/pid)
sync
"#
    );
    let refs: Vec<&Path> = disks.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &refs,
        &[
            ("ORACLE_BINS", BIN),
            // util-linux's and coreutils' (the guest's busybox has neither
            // blkdiscard nor dd's oflag=direct)
            ("ORACLE_FILES", "/usr/bin/dd /usr/sbin/blkdiscard"),
            (
                "ORACLE_MODULES",
                &format!("drivers/md/dm-log-writes.ko {}", oracle::EXT4_UBLK_MODULES),
            ),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "600"),
        ],
    );
    let m = oracle::markers(&serial);
    assert_eq!(oracle::marker(&m, "d-attach"), "/dev/ublkb0");
    assert_eq!(
        oracle::marker(&m, "k-status"),
        oracle::marker(&m, "d-status"),
        "the status lines"
    );
    let (klog, dlog) = (
        std::fs::read(&disks[1]).expect("kernel's log"),
        std::fs::read(&disks[3]).expect("dmkit's log"),
    );
    let (k, d) = (entries(&klog), entries(&dlog));
    // A, B's two blocks, the flush, m1, D, the discard, the flush, E, the end mark
    assert_eq!(k.len(), 10, "the kernel's entries: {k:?}");
    assert_eq!(
        d.iter()
            .map(|e| (e.flags, e.sector, e.count, &e.mark))
            .collect::<Vec<_>>(),
        k.iter()
            .map(|e| (e.flags, e.sector, e.count, &e.mark))
            .collect::<Vec<_>>(),
        "the entries"
    );
    assert!(dlog == klog, "the two logs differ in their bytes");
    assert!(
        std::fs::read(&disks[0]).expect("kdata") == std::fs::read(&disks[2]).expect("ddata"),
        "the data devices"
    );
}

/// A program's data (4 KiB of `pattern(seed)`, for 64 KiB) and its commit
/// record (512 bytes for byte 0: "COMMIT" and the data's first 16 bytes), and
/// the judge of a state (`--check`): a record must match the data. The same
/// judge as one process asked about every state (`--judge`) is `judge-serve.py`.
fn commit_judge(s: &common::Scratch, seed: u64) -> (String, Vec<u8>, Vec<u8>) {
    let judge = s.path("judge.py");
    std::fs::write(
        &judge,
        "import sys\nb = open(sys.argv[1], 'rb').read()\n\
         sys.exit(0 if b[0:6] != b'COMMIT' or b[65536:65552] == b[6:22] else 1)\n",
    )
    .expect("judge");
    std::fs::write(
        s.path("judge-serve.py"),
        "import sys\nfor line in sys.stdin:\n    b = open(line[:-1], 'rb').read()\n    \
         print('ok' if b[0:6] != b'COMMIT' or b[65536:65552] == b[6:22] else 'no data for the record', flush=True)\n",
    )
    .expect("judge");
    let data = pattern(seed, 4096);
    let mut record = b"COMMIT".to_vec();
    record.extend_from_slice(&data[..16]);
    record.resize(512, 0);
    (format!("python3 {} {{}}", judge.display()), data, record)
}

/// `dmkit replay --crash-states`: a program that writes its data and then a
/// commit record naming it with no flush between them leaves a state with the
/// record and without the data, which the check refuses, and the command it
/// prints rebuilds that state; the same program with a flush between passes in
/// every state; an epoch with too many states is sampled.
#[test]
fn crash_states_find_a_commit_record_written_before_its_data_was_flushed() {
    let d = Daemon::start("lw-states");
    let s = &d.dir;
    let (check, data, record) = commit_judge(s, 9);
    let run_program = |name: &str, flush_between: bool| -> std::path::PathBuf {
        let dev = s.sparse(&format!("{name}-dev.img"), MIB);
        let log = s.sparse(&format!("{name}-log.img"), 4 * MIB);
        d.create(
            name,
            &format!("0 {} log-writes {} {}", MIB / 512, dev.display(), log.display()),
        );
        let mut c = Client::connect(&d.sock(), name);
        assert_eq!(c.call(WRITE, 0, 65536, 4096, &data), 0);
        if flush_between {
            assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
        }
        assert_eq!(c.call(WRITE, 0, 0, 512, &record), 0);
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
        drop(c);
        d.remove_closed(name);
        log
    };
    let states = |log: &Path, extra: &[&str]| {
        let image = s.sparse("state.img", MIB);
        let out = Command::new(BIN)
            .arg("replay")
            .arg(log)
            .arg(&image)
            .args(["--crash-states", "--check", &check])
            .args(extra)
            .output()
            .expect("replay --crash-states");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };

    let bad = run_program("bad", false);
    let (code, out) = states(&bad, &[]);
    assert_eq!(code, Some(1), "{out}");
    // the same judge started once and asked about each state
    let serve = format!("python3 {}", s.path("judge-serve.py").display());
    let judged = Command::new(BIN)
        .arg("replay")
        .arg(&bad)
        .arg(s.sparse("judged.img", MIB))
        .args(["--crash-states", "--judge", &serve])
        .output()
        .expect("replay --judge");
    let said = String::from_utf8_lossy(&judged.stdout);
    assert_eq!(judged.status.code(), Some(1), "{said}");
    assert!(
        said.starts_with(
            "the check refused a crash state: before the first flush, with entries [1] of the 2 written since and without [0]: the judge answered: no data for the record\n"
        ),
        "{said}"
    );
    assert!(
        said.ends_with("checked 3 crash states in 1 epochs: one refused\n"),
        "{said}"
    );
    // a judge that does not answer is an error, not a verdict
    let mute = Command::new(BIN)
        .arg("replay")
        .arg(&bad)
        .arg(s.sparse("mute.img", MIB))
        .args(["--crash-states", "--judge", "exit 3"])
        .output()
        .expect("replay --judge");
    let err = String::from_utf8_lossy(&mute.stderr);
    assert_eq!(mute.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("dmkit: replay: the judge 'exit 3' ")
            && (err.contains("ended without answering") || err.contains("stopped reading its questions")),
        "{err}"
    );
    assert!(
        out.contains(
            "the check refused a crash state: before the first flush, with entries [1] of the 2 written since and without [0]: exit status: 1"
        ),
        "{out}"
    );
    assert!(
        out.ends_with("checked 3 crash states in 1 epochs: one refused\n"),
        "{out}"
    );
    // the command it prints rebuilds the refused state
    let rebuild = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("rebuild it: dmkit replay "))
        .expect("a rebuild command");
    assert_eq!(
        rebuild,
        format!("{} IMAGE --until entry:0 --with-entries 1", bad.display())
    );
    let image = s.sparse("rebuilt.img", MIB);
    run(Command::new(BIN).arg("replay").arg(&bad).arg(&image).args([
        "--until",
        "entry:0",
        "--with-entries",
        "1",
    ]));
    let rebuilt = std::fs::read(&image).expect("image");
    assert_eq!(&rebuilt[..512], &record[..], "the record is there");
    assert_eq!(&rebuilt[65536..69632], &[0u8; 4096][..], "its data is not");

    let good = run_program("good", true);
    let (code, out) = states(&good, &[]);
    assert_eq!(code, Some(0), "{out}");
    // [data] then [record] then nothing after the last flush: 2 + 2 + 1 states
    assert_eq!(out, "checked 5 crash states in 3 epochs: all accepted\n");

    // twelve writes in one epoch: 4096 states, 64 of them tried
    let dev = s.sparse("many-dev.img", MIB);
    let log = s.sparse("many-log.img", 4 * MIB);
    d.create(
        "many",
        &format!("0 {} log-writes {} {}", MIB / 512, dev.display(), log.display()),
    );
    let mut c = Client::connect(&d.sock(), "many");
    for i in 0..12u64 {
        assert_eq!(c.call(WRITE, 0, 131072 + i * 4096, 4096, &pattern(i, 4096)), 0);
    }
    drop(c);
    d.remove_closed("many");
    let (code, out) = states(&log, &["--max-states", "64", "--seed", "7"]);
    assert_eq!(code, Some(0), "{out}");
    assert_eq!(
        out,
        "checked 64 crash states in 1 epochs (1 of them sampled with --seed 7): all accepted\n"
    );
}

/// `dmkit replay --check CMD --check-at KIND`: the check runs on the target
/// after each entry of that kind, the first state refused is named with the
/// command that rebuilds it, and a check that never ran is an error, not a
/// pass (generic/482's replay to each FUA entry with fsck is this with
/// `--check-at fua`; `generic_482_ext4_is_consistent_at_every_fua_of_the_kernels_log_and_dmkits`
/// runs that).
#[test]
fn a_replay_checks_the_state_after_each_entry_of_a_kind() {
    let d = Daemon::start("lw-check-at");
    let s = &d.dir;
    let (check, data, record) = commit_judge(s, 3);
    // the record first, its data after, one flush for both
    let (dev, log) = (s.sparse("dev.img", MIB), s.sparse("log.img", 4 * MIB));
    d.create(
        "lw",
        &format!("0 {} log-writes {} {}", MIB / 512, dev.display(), log.display()),
    );
    let mut c = Client::connect(&d.sock(), "lw");
    assert_eq!(c.call(WRITE, 0, 0, 512, &record), 0);
    assert_eq!(c.call(WRITE, 0, 65536, 4096, &data), 0);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    drop(c);
    d.remove_closed("lw");
    let checked = |at: &str, extra: &[&str]| {
        let image = s.sparse("state.img", MIB);
        let out = Command::new(BIN)
            .arg("replay")
            .arg(&log)
            .arg(&image)
            .args(["--check", &check, "--check-at", at])
            .args(extra)
            .output()
            .expect("replay --check-at");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // entries: the record, the data, the flush, the end mark
    let (code, out, _) = checked("entry", &[]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.starts_with("the check refused the state after entry 0 (0 "),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "\n  rebuild it: dmkit replay {} IMAGE --until entry:1\n",
            log.display()
        )),
        "{out}"
    );
    assert!(out.ends_with("checked 1 states: one refused\n"), "{out}");
    // the state it names: the record without its data
    let image = s.sparse("rebuilt.img", MIB);
    run(Command::new(BIN)
        .arg("replay")
        .arg(&log)
        .arg(&image)
        .args(["--until", "entry:1"]));
    let rebuilt = std::fs::read(&image).expect("image");
    assert_eq!(&rebuilt[..512], &record[..]);
    assert_eq!(&rebuilt[65536..69632], &[0u8; 4096][..]);

    let (code, out, _) = checked("flush", &[]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "checked 1 states: all accepted\n")
    );
    let (code, out, _) = checked("entry", &["--check-from", "entry:2"]);
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "checked 2 states: all accepted\n")
    );
    let (code, out, err) = checked("fua", &[]);
    assert_eq!(code, Some(1), "{out}");
    assert_eq!(
        err,
        "dmkit: replay: no fua entry in the log: nothing was checked\n"
    );
    let (code, _, err) = checked("flush", &["--check-from", "mark:never"]);
    assert_eq!(code, Some(1));
    assert_eq!(
        err,
        "dmkit: replay: no flush entry after --check-from in the log: nothing was checked\n"
    );
}

/// xfstests' generic/482, as far as this machine carries it (xfstests is not
/// packaged in Debian; a shell workload stands in for its fsstress): in the
/// 6.12 guest, ext4 made on a log-writes device, marked `mkfs`, mounted, a
/// workload of creates, writes with fsync, renames, removes and syncs, marked
/// `last`, unmounted; once over the kernel's dm-log-writes, once over dmkit's
/// created and marked by Debian's dmsetup through the door (`dmkit exec`), a
/// ublk block device from its resume. On the host each log is replayed from
/// the start and, from the `mkfs` mark on, the file system is checked at every FUA write
/// (where a journal commit becomes durable) as generic/482 checks it: its
/// journal recovered on a copy, then `e2fsck -fn`. Both logs pass at every
/// such point, and each replayed to its end equals the device it recorded.
#[test]
fn generic_482_ext4_is_consistent_at_every_fua_of_the_kernels_log_and_dmkits() {
    const FS: u64 = 64 * MIB;
    let s = common::Scratch::new("lw-482");
    let disks: Vec<std::path::PathBuf> = ["kdata", "klog", "ddata", "dlog"]
        .iter()
        .map(|n| s.sparse(&format!("{n}.img"), if n.ends_with("log") { 8 * FS } else { FS }))
        .collect();
    let script = format!(
        "{}{}",
        oracle::DMKIT_GUEST,
        r#"
set -e
DD=/usr/bin/dd
MKFS="/usr/sbin/mke2fs -t ext4 -q -F -E nodiscard,lazy_itable_init=0,lazy_journal_init=0"
# generic/482's run on device $1, marks sent with $2
run() {
  $MKFS $1
  $2 mkfs
  mount -t ext4 $1 /mnt
  i=0
  while [ $i -lt 30 ]; do
    d=/mnt/d$((i % 5))
    mkdir -p $d
    $DD if=/dev/urandom of=$d/f$i bs=4096 count=$((i % 7 + 1)) conv=fsync status=none
    [ $((i % 3)) -ne 0 ] || mv $d/f$i /mnt/d$(((i + 1) % 5))/g$i 2>/dev/null || mv $d/f$i $d/g$i
    [ $((i % 4)) -ne 1 ] || rm -f /mnt/d*/f$((i - 4)) /mnt/d*/g$((i - 4))
    [ $((i % 5)) -ne 2 ] || sync
    i=$((i + 1))
  done
  $2 last
  umount /mnt
}
dmsetup create klw --table "0 131072 log-writes /dev/vda /dev/vdb"
dmsetup mknodes
run /dev/mapper/klw "dmsetup message klw 0 mark"
dmsetup remove klw
echo "ORACLE k-done yes"
# dmkit's through the door: Debian's dmsetup under `dmkit exec`, the device a
# ublk block device from its resume (serve --attach)
start --attach
DS="$D exec -- dmsetup"
$DS create dlw --table "0 131072 log-writes /dev/vdc /dev/vdd"
i=0; while [ "$(/usr/bin/dd if=/dev/mapper/dlw bs=4096 count=1 status=none 2>/dev/null | wc -c)" != 4096 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done
echo "ORACLE d-attach $($DS info -c --noheadings -o name dlw) $(readlink -f /dev/mapper/dlw)"
run /dev/mapper/dlw "$DS message dlw 0 mark"
$DS remove dlw
echo "ORACLE d-done yes"
kill $(cat /tmp/pid)
sync
"#
    );
    let refs: Vec<&Path> = disks.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &refs,
        &[
            ("ORACLE_BINS", BIN),
            ("ORACLE_FILES", "/usr/bin/dd /usr/sbin/mke2fs /etc/mke2fs.conf"),
            (
                "ORACLE_MODULES",
                &format!("drivers/md/dm-log-writes.ko {}", oracle::EXT4_UBLK_MODULES),
            ),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "900"),
        ],
    );
    let m = oracle::markers(&serial);
    assert_eq!(oracle::marker(&m, "k-done"), "yes");
    assert_eq!(oracle::marker(&m, "d-attach"), "dlw /dev/ublkb0");
    assert_eq!(oracle::marker(&m, "d-done"), "yes");
    let copy = s.path("state.img");
    let check = format!(
        "cp --sparse=always {{}} {c} && {{ e2fsck -E journal_only -y {c} >/dev/null 2>&1; e2fsck -fn {c}; }}",
        c = copy.display()
    );
    for (who, data, log) in [("kernel", &disks[0], &disks[1]), ("dmkit", &disks[2], &disks[3])] {
        let fuas = Command::new(BIN)
            .arg("replay")
            .arg(log)
            .arg("--list")
            .output()
            .expect("replay --list");
        let listed = String::from_utf8_lossy(&fuas.stdout).into_owned();
        assert!(fuas.status.success(), "{who}: {listed}");
        let fua_writes = listed
            .lines()
            .filter(|l| {
                l.split(' ')
                    .nth(1)
                    .is_some_and(|f| f.split('|').any(|f| f == "fua"))
            })
            .count();
        let image = s.sparse(&format!("{who}-replay.img"), FS);
        let out = Command::new(BIN)
            .arg("replay")
            .arg(log)
            .arg(&image)
            .args([
                "--check",
                &check,
                "--check-at",
                "fua",
                "--check-from",
                "mark:mkfs",
            ])
            .output()
            .expect("replay --check-at fua");
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{who}: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let checked: usize = said
            .strip_prefix("checked ")
            .and_then(|r| r.strip_suffix(" states: all accepted\n"))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{who}: {said}"));
        // a journal commit a fsync at least, and every FUA after mkfs's
        assert!(
            checked >= 30,
            "{who}: {checked} FUA writes checked of {fua_writes} in the log"
        );
        assert!(checked <= fua_writes, "{who}: {checked} of {fua_writes}");
        assert!(
            std::fs::read(&image).expect("replayed") == std::fs::read(data).expect("device"),
            "{who}: the log replayed to its end differs from the device"
        );
    }
}
