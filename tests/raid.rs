//! The `raid` target (raid1) through the real daemon and NBD: a new array
//! copies its first leg to the others and then mirrors every write; its
//! metadata devices hold the kernel's dm-raid superblock and md bitmap
//! (read here from the bytes, by offsets written from the kernel's
//! description, not dmkit's code); a leg whose device fails is marked `D`,
//! recorded as failed in the other legs' superblocks, and the I/O goes on,
//! reads included; the leg, back in a new table, gets the regions written
//! meanwhile; check counts mismatches and repair mends them; bad tables are
//! refused with the kernel's words.

use crate::common;

use common::nbd::{Client, FLUSH};
use common::{pattern, Daemon};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::MIB;
/// The array: 8 MiB, regions of 64 KiB (128 sectors), 128 of them.
const SECTORS: u64 = 16384;

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Legs' files: (meta, data) each, data of leg 0 filled with a pattern.
fn legs(d: &Daemon, n: usize) -> Vec<(PathBuf, PathBuf)> {
    (0..n)
        .map(|i| {
            let meta = d.dir.sparse(&format!("meta{i}"), MIB);
            let data = d.dir.path(&format!("data{i}"));
            let bytes = if i == 0 {
                pattern(7, (SECTORS * 512) as usize)
            } else {
                vec![0u8; (SECTORS * 512) as usize]
            };
            std::fs::write(&data, bytes).expect("data file");
            (meta, data)
        })
        .collect()
}

fn table(opts: &[&str], legs: &[(String, String)]) -> String {
    let mut p = vec!["0".to_string()];
    p.extend(opts.iter().map(|s| s.to_string()));
    let mut t = format!(
        "0 {SECTORS} raid raid1 {} {} {}",
        p.len(),
        p.join(" "),
        legs.len()
    );
    for (m, dd) in legs {
        t.push_str(&format!(" {m} {dd}"));
    }
    t
}

fn names(l: &[(PathBuf, PathBuf)]) -> Vec<(String, String)> {
    l.iter()
        .map(|(m, d)| (m.display().to_string(), d.display().to_string()))
        .collect()
}

fn sb(meta: &Path) -> Vec<u8> {
    std::fs::read(meta).expect("meta")[..8192].to_vec()
}

#[test]
fn a_new_raid1_copies_its_first_leg_then_mirrors_every_write_with_the_kernels_metadata() {
    let d = Daemon::start("raid-new");
    let l = legs(&d, 2);
    let t = table(&["region_size", "128"], &names(&l));
    d.create("r", &t);
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(30)),
        format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle 0 0 -")
    );
    assert_eq!(
        d.ok(&["table", "r"]).trim(),
        t,
        "the table as the kernel prints it"
    );
    assert!(
        std::fs::read(&l[1].1).expect("leg 1") == std::fs::read(&l[0].1).expect("leg 0"),
        "the resync copied leg 0 to leg 1"
    );
    let mut c = Client::connect(&d.sock(), "r");
    c.write(3 * MIB + 4096, &pattern(9, 65536));
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
    for (i, (_, data)) in l.iter().enumerate() {
        let b = std::fs::read(data).expect("data");
        assert!(
            b[(3 * MIB + 4096) as usize..(3 * MIB + 4096 + 65536) as usize] == pattern(9, 65536)[..],
            "leg {i} has the write"
        );
    }
    assert_eq!(c.read(3 * MIB + 4096, 65536), pattern(9, 65536));
    drop(c);
    // the metadata, by the kernel's offsets
    for (i, (meta, _)) in l.iter().enumerate() {
        let b = sb(meta);
        assert_eq!(&b[0..4], b"DmRd", "leg {i}: dm-raid superblock magic");
        assert_eq!(u32_at(&b, 4), 1, "compat: v1.9.0 fields");
        assert_eq!(u32_at(&b, 8), 2, "num_devices");
        assert_eq!(u32_at(&b, 0x0c), i as u32, "array_position");
        assert_eq!(u64_at(&b, 0x18), 0, "no failed legs");
        assert_eq!(u64_at(&b, 0x20), u64::MAX, "disk in sync");
        assert_eq!(u64_at(&b, 0x28), u64::MAX, "array in sync");
        assert_eq!(u32_at(&b, 0x30), 1, "level");
        assert_eq!(u64_at(&b, 0x58), SECTORS, "array_sectors");
        assert_eq!(u64_at(&b, 0x70), SECTORS, "sectors");
        assert!(
            b[0x94..512].iter().all(|&x| x == 0),
            "the rest of the sector is zero"
        );
        assert_eq!(&b[4096..4100], b"bitm", "bitmap superblock magic");
        assert_eq!(u32_at(&b, 4100), 4, "bitmap version");
        assert_eq!(u32_at(&b, 4096 + 52), 65536, "chunksize: the region in bytes");
        assert_eq!(u32_at(&b, 4096 + 56), 5, "daemon_sleep: 5 s");
        assert_eq!(u64_at(&b, 4096 + 40), SECTORS, "sync_size");
        assert!(
            u64_at(&b, 4096 + 24) == u64_at(&b, 0x10),
            "the bitmap's events equal the superblock's"
        );
        // region 48 (3 MiB) was written: its bit is set, at least until the
        // daemon clears it two periods later
        assert!(
            b[4096 + 256 + 48 / 8] & (1 << (48 % 8)) != 0,
            "leg {i}: region 48's bit"
        );
    }
    d.remove_closed("r");
}

#[test]
fn a_failed_leg_is_marked_d_and_recorded_the_io_goes_on_and_the_leg_comes_back() {
    let d = Daemon::start("raid-fail");
    let l = legs(&d, 2);
    // leg 1's data through a device that can fail
    let lin1 = format!("0 {SECTORS} linear {} 0", l[1].1.display());
    d.create("leg1", &lin1);
    let mut n = names(&l);
    n[1].1 = "/dev/mapper/leg1".into();
    let t = table(&["region_size", "128"], &n);
    d.create("r", &t);
    d.wait_status("r", " idle ", Duration::from_secs(30));
    d.reload("leg1", &format!("0 {SECTORS} error"));
    let mut c = Client::connect(&d.sock(), "r");
    c.write(MIB, &pattern(11, 8192));
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
    assert_eq!(c.read(MIB, 8192), pattern(11, 8192), "read back from leg 0");
    let s = d.ok(&["status", "r"]);
    assert!(s.contains(" raid1 2 AD "), "leg 1 failed: {s}");
    let b = sb(&l[0].0);
    assert_eq!(u64_at(&b, 0x18) & 2, 2, "leg 0's superblock records leg 1 failed");
    // reads spread over the legs all come from leg 0 now
    for i in 0..16u64 {
        assert_eq!(c.read(i * 512 * 1024, 4096).len(), 4096);
    }
    drop(c);
    d.wait_open_count("r", 0);
    // the leg comes back: a new table (as `lvchange --refresh` makes)
    d.reload("leg1", &lin1);
    d.reload("r", &t);
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(30)),
        format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle 0 0 -")
    );
    assert!(
        std::fs::read(&l[1].1).expect("leg 1") == std::fs::read(&l[0].1).expect("leg 0"),
        "the regions written while leg 1 was gone were copied to it"
    );
    assert_eq!(u64_at(&sb(&l[1].0), 0x18), 0, "no leg failed any more");
    d.ok(&["remove", "r"]);
    d.ok(&["remove", "leg1"]);
}

#[test]
fn a_read_that_fails_goes_to_the_other_leg() {
    let d = Daemon::start("raid-read");
    let l = legs(&d, 2);
    let lin0 = format!("0 {SECTORS} linear {} 0", l[0].1.display());
    d.create("leg0", &lin0);
    let mut n = names(&l);
    n[0].1 = "/dev/mapper/leg0".into();
    d.create("r", &table(&["region_size", "128"], &n));
    d.wait_status("r", " idle ", Duration::from_secs(30));
    d.reload("leg0", &format!("0 {SECTORS} error"));
    let mut c = Client::connect(&d.sock(), "r");
    let want = pattern(7, (SECTORS * 512) as usize);
    for i in 0..8u64 {
        let off = i * MIB;
        assert!(
            c.read(off, 65536) == want[off as usize..(off + 65536) as usize],
            "read at {off} from the leg that works"
        );
    }
    // the region written back to leg 0 from leg 1 (md's correction) fails
    // too: then the leg fails
    let s = d.wait_status("r", " raid1 2 DA ", Duration::from_secs(30));
    assert!(s.contains(" raid1 2 DA "), "leg 0 failed on a read: {s}");
    assert!(d
        .log()
        .contains("read from another leg, the region to be written again"));
    drop(c);
    d.remove_closed("r");
    d.ok(&["remove", "leg0"]);
}

#[test]
fn check_counts_mismatches_and_repair_mends_them() {
    let d = Daemon::start("raid-check");
    let l = legs(&d, 2);
    d.create("r", &table(&["region_size", "128", "nosync"], &names(&l)));
    // nosync: leg 1 still holds zeroes where leg 0 has the pattern
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(30)),
        format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle 0 0 -")
    );
    d.ok(&["message", "r", "0", "check"]);
    let s = d.wait_status("r", " idle ", Duration::from_secs(30));
    assert_eq!(
        s,
        format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle {SECTORS} 0 -")
    );
    assert!(
        std::fs::read(&l[1].1).expect("leg 1").iter().all(|&x| x == 0),
        "check writes nothing"
    );
    d.ok(&["message", "r", "0", "repair"]);
    d.wait_status("r", " idle ", Duration::from_secs(30));
    assert!(
        std::fs::read(&l[1].1).expect("leg 1") == std::fs::read(&l[0].1).expect("leg 0"),
        "repair made the legs equal"
    );
    d.ok(&["message", "r", "0", "check"]);
    let s = d.wait_status("r", " idle ", Duration::from_secs(30));
    assert!(s.ends_with(" idle 0 0 -"), "no mismatch after the repair: {s}");
    let e = d.fails(&["message", "r", "0", "frobnicate"]);
    assert!(e.contains("invalid argument"), "{e}");
    d.ok(&["remove", "r"]);
}

#[test]
fn bad_raid_tables_are_refused_with_the_kernels_words() {
    let d = Daemon::start("raid-bad");
    let l = legs(&d, 2);
    let n = names(&l);
    let cases: &[(String, &str)] = &[
        (format!("0 {SECTORS} raid"), "No arguments"),
        (
            format!("0 {SECTORS} raid raid9 1 0 1 - {}", n[0].1),
            "Unrecognised raid_type",
        ),
        (
            format!(
                "0 {SECTORS} raid raid5_ls 1 0 2 {} {} {} {}",
                n[0].0, n[0].1, n[1].0, n[1].1
            ),
            "Chunk size must be a power of 2",
        ),
        (
            table(&["sync", "nosync"], &n),
            "sync and nosync are mutually exclusive",
        ),
        (
            table(&["region_size", "100"], &n),
            "Region size is not a power of 2",
        ),
        (table(&["rebuild", "2"], &n), "Invalid rebuild index given"),
        (
            table(&["write_mostly", "0", "write_mostly", "1"], &n),
            "Can't set all raid1 devices to write_mostly",
        ),
        (
            table(&["stripe_cache", "256"], &n),
            "Inappropriate argument: stripe_cache",
        ),
        (table(&["frob"], &n), "Unable to parse RAID parameter: frob"),
        (
            format!(
                "0 {SECTORS} raid raid10 3 128 raid10_copies 258 2 {} {} {} {}",
                n[0].0, n[0].1, n[1].0, n[1].1
            ),
            "Bad value for 'raid10_copies'",
        ),
        (
            format!(
                "0 {SECTORS} raid raid5_ls 1 {} 2 {} {} {} {}",
                1u64 << 30,
                n[0].0,
                n[0].1,
                n[1].0,
                n[1].1
            ),
            "not a multiple of the chunk",
        ),
        (
            format!(
                "0 {SECTORS} raid raid1 7 0 {} {} {} {}",
                n[0].0, n[0].1, n[1].0, n[1].1
            ),
            "Cannot understand number of raid",
        ),
    ];
    for (t, want) in cases {
        let o = d.cli_in(&["create", "bad"], t);
        assert!(!o.status.success(), "{t} was taken");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(want), "{t}: {e}");
    }
    assert!(!d.ok(&["ls"]).contains("bad"), "no device was made");
}

#[test]
fn metadata_that_lies_is_refused_with_what_is_wrong() {
    let d = Daemon::start("raid-lies");
    let l = legs(&d, 2);
    let t = table(&["region_size", "128", "nosync"], &names(&l));
    d.create("r", &t);
    d.wait_status("r", " idle ", Duration::from_secs(30));
    d.ok(&["remove", "r"]);
    let good: Vec<Vec<u8>> = l.iter().map(|(m, _)| std::fs::read(m).expect("meta")).collect();
    let try_with = |edit: &dyn Fn(&mut Vec<u8>), both: bool, want: &str| {
        for (i, (m, _)) in l.iter().enumerate() {
            let mut b = good[i].clone();
            if both || i == 1 {
                edit(&mut b);
            }
            std::fs::write(m, b).expect("meta");
        }
        let o = d.cli_in(&["create", "r"], &t);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(want), "{want}: {e}");
    };
    try_with(
        &|b| b[4096] = b'x',
        true,
        "invalid bitmap file superblock: bad magic",
    );
    try_with(
        &|b| b[4096 + 56..4096 + 60].fill(0),
        true,
        "daemon sleep period out of range",
    );
    try_with(&|b| b[0x30] = 5, true, "takeover not possible");
    try_with(
        &|b| b[0x90] = 1,
        true,
        "No incompatible feature flags supported yet",
    );
    // an events counter at its end (found by the raid_metadata fuzzer: the
    // next superblock write overflowed) is taken, and stays there
    for (i, (m, _)) in l.iter().enumerate() {
        let mut b = good[i].clone();
        b[0x10..0x18].fill(0xff);
        b[4096 + 24..4096 + 32].fill(0xff);
        std::fs::write(m, b).expect("meta");
    }
    d.create("r", &t);
    d.wait_status("r", " idle ", Duration::from_secs(30));
    d.ok(&["remove", "r"]);
    assert_eq!(u64_at(&sb(&l[0].0), 0x10), u64::MAX, "events stay at their end");
    // leg 1's superblock gone, no rebuild asked: a new device injected
    try_with(&|b| b[..512].fill(0), false, "New device injected");
    // with `rebuild 1` it is taken, and leg 1 copied in full
    for (i, (m, _)) in l.iter().enumerate() {
        std::fs::write(m, &good[i]).expect("meta");
    }
    std::fs::write(&l[1].0, vec![0u8; MIB as usize]).expect("meta 1 wiped");
    d.create("r", &table(&["region_size", "128", "rebuild", "1"], &names(&l)));
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(30)),
        format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle 0 0 -")
    );
    assert!(
        std::fs::read(&l[1].1).expect("leg 1") == std::fs::read(&l[0].1).expect("leg 0"),
        "the rebuild copied leg 0 to leg 1"
    );
    d.ok(&["remove", "r"]);
}
