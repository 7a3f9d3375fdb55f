//! The `raid` target's striped levels through the real daemon and NBD:
//! raid0, raid10 (near, far, offset), raid4, raid5 (every layout) and raid6.
//! For each: a new array syncs, takes random writes across chunk boundaries
//! and reads them back; its parity holds on the legs' bytes (raid4/5: the
//! XOR of every leg is zero) and `check` finds no mismatch; with legs lost
//! (an `error` table under them, as many as the level survives) every sector
//! still reads back, rebuilt from the others, and writes go on; the legs,
//! back in a new table, get what they missed, so losing other legs then
//! still reads everything; a corrupted parity block counts 8 sectors in
//! `check` and `repair` mends it. Placement on the legs is md's: the kernel
//! oracle (tests/raid_guest.rs) reads these arrays in the kernel.

use crate::common;

use common::nbd::{Client, WRITE_ZEROES};
use common::{assert_same, pattern, read_all, Daemon, Rng};
use std::time::Duration;

use common::MIB;
/// Each leg's data: 2 MiB; chunks of 64 KiB, regions of 256 KiB.
const LEG: u64 = 4096;
const CHUNK: u64 = 128;

struct Case {
    ty: &'static str,
    legs: usize,
    /// The array's sectors: the data legs' (raid10: the legs' over the copies).
    sectors: u64,
    opts: &'static [&'static str],
    /// Lost first, then (after they come back) lost instead.
    lose: &'static [usize],
    lose_after: &'static [usize],
    /// What the status line names the level.
    status: &'static str,
}

fn leg_dev(i: usize) -> String {
    format!("/dev/mapper/l{i}")
}

fn table(c: &Case, sectors: u64) -> String {
    let mut p = vec![CHUNK.to_string()];
    if c.ty != "raid0" {
        p.extend(["region_size".to_string(), "512".to_string()]);
    }
    p.extend(c.opts.iter().map(|s| s.to_string()));
    let mut t = format!("0 {sectors} raid {} {} {} {}", c.ty, p.len(), p.join(" "), c.legs);
    for i in 0..c.legs {
        t.push_str(&format!(" /dev/mapper/m{i} {}", leg_dev(i)));
    }
    t
}

fn status_of(c: &Case, sectors: u64, health: &str, mismatches: u64) -> String {
    // the total: each leg's sectors for raid0 and raid4/5/6, the array's for raid10
    let total = if c.ty.starts_with("raid10") { sectors } else { LEG };
    format!(
        "0 {sectors} raid {} {} {health} {total}/{total} idle {mismatches} 0 -",
        c.status, c.legs
    )
}

/// Random writes (512 B to 3 chunks, anywhere) through `cl`, kept in `model`.
fn scribble(cl: &mut Client, model: &mut [u8], rng: &mut Rng, n: usize) {
    let size = model.len() as u64;
    for _ in 0..n {
        let len = (1 + rng.below(3 * CHUNK)) * 512;
        let off = rng.below((size - len) / 512) * 512;
        let data = pattern(rng.next(), len as usize);
        cl.write(off, &data);
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
    }
    // two whole rows (raid4/5/6 write them without reading), at a row's start
    let width = model.len() as u64 / (LEG * 512) * CHUNK * 512;
    let off = rng.below(size / width - 2) * width;
    let data = pattern(rng.next(), 2 * width as usize);
    cl.write(off, &data);
    model[off as usize..(off + 2 * width) as usize].copy_from_slice(&data);
    // and a zeroing across chunks
    let off = rng.below(size / 512 - 3 * CHUNK) * 512;
    let len = 2 * CHUNK * 512 + 4096;
    assert_eq!(cl.call(WRITE_ZEROES, 0, off, len as u32, &[]), 0, "write zeroes");
    model[off as usize..(off + len) as usize].fill(0);
}

fn set_legs(d: &Daemon, c: &Case, lost: &[usize]) {
    for i in 0..c.legs {
        let t = if lost.contains(&i) {
            format!("0 {LEG} error")
        } else {
            format!("0 {LEG} linear {} 0", d.dir.path(&format!("data{i}")).display())
        };
        d.reload(&format!("l{i}"), &t);
    }
}

fn health(c: &Case, lost: &[usize]) -> String {
    (0..c.legs)
        .map(|i| if lost.contains(&i) { 'D' } else { 'A' })
        .collect()
}

/// `check` on the array, then idle with `mismatches` counted and every leg `A`.
fn check(d: &Daemon, c: &Case, mismatches: u64, what: &str) {
    d.ok(&["message", "r", "0", "check"]);
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(60)),
        status_of(c, c.sectors, &health(c, &[]), mismatches),
        "{}: {what}",
        c.ty
    );
}

fn exercise(d: &Daemon, c: &Case, seed: u64) {
    let sectors = c.sectors;
    let size = sectors * 512;
    for i in 0..c.legs {
        d.dir.sparse(&format!("meta{i}"), MIB);
        std::fs::write(d.dir.path(&format!("data{i}")), vec![0u8; (LEG * 512) as usize]).expect("leg file");
        d.create(
            &format!("m{i}"),
            &format!("0 2048 linear {} 0", d.dir.path(&format!("meta{i}")).display()),
        );
        d.create(
            &format!("l{i}"),
            &format!("0 {LEG} linear {} 0", d.dir.path(&format!("data{i}")).display()),
        );
    }
    let t = table(c, sectors);
    d.create("r", &t);
    let all = health(c, &[]);
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(60)),
        status_of(c, sectors, &all, 0),
        "{}: a new array in sync",
        c.ty
    );
    let mut rng = Rng(seed);
    let mut model = vec![0u8; size as usize];
    let mut cl = Client::connect(&d.sock(), "r");
    scribble(&mut cl, &mut model, &mut rng, 200);
    assert_same(&read_all(&mut cl, size), &model, &format!("{}: read back", c.ty));
    drop(cl);
    d.wait_open_count("r", 0);
    if c.ty.starts_with("raid5") || c.ty == "raid4" {
        // raid4/5: P is the XOR of the data, so every leg XORs to zero
        let mut x = vec![0u8; (LEG * 512) as usize];
        for i in 0..c.legs {
            for (a, b) in x
                .iter_mut()
                .zip(std::fs::read(d.dir.path(&format!("data{i}"))).expect("leg"))
            {
                *a ^= b;
            }
        }
        assert!(x.iter().all(|&b| b == 0), "{}: the legs XOR to zero", c.ty);
    }
    if c.ty == "raid0" {
        // raid0: no redundancy and no messages; chunk 1 is leg 1's first
        let leg1 = std::fs::read(d.dir.path("data1")).expect("leg 1");
        let chunk = (CHUNK * 512) as usize;
        assert!(
            leg1[..chunk] == model[chunk..2 * chunk],
            "raid0: array chunk 1 is leg 1's chunk 0"
        );
        let e = d.fails(&["message", "r", "0", "check"]);
        assert!(e.contains("invalid argument"), "{e}");
        d.remove_closed("r");
        return;
    }
    check(d, c, 0, "check finds nothing");

    // legs lost: everything reads, rebuilt; writes go on
    set_legs(d, c, c.lose);
    let mut cl = Client::connect(&d.sock(), "r");
    assert_same(
        &read_all(&mut cl, size),
        &model,
        &format!("{}: read with legs {:?} lost", c.ty, c.lose),
    );
    scribble(&mut cl, &mut model, &mut rng, 100);
    assert_same(
        &read_all(&mut cl, size),
        &model,
        &format!("{}: degraded writes read back", c.ty),
    );
    drop(cl);
    d.wait_open_count("r", 0);
    let s = d.ok(&["status", "r"]);
    assert!(
        s.contains(&format!(" {} ", health(c, c.lose))),
        "{}: lost legs marked D: {s}",
        c.ty
    );

    // back, in a new table: they get what they missed
    set_legs(d, c, &[]);
    d.reload("r", &t);
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(60)),
        status_of(c, sectors, &all, 0),
        "{}: the legs came back and recovered",
        c.ty
    );
    check(d, c, 0, "no mismatch after the recovery");
    // other legs lost: what the first ones got must be right
    set_legs(d, c, c.lose_after);
    let mut cl = Client::connect(&d.sock(), "r");
    assert_same(
        &read_all(&mut cl, size),
        &model,
        &format!(
            "{}: read with legs {:?} lost after the recovery",
            c.ty, c.lose_after
        ),
    );
    drop(cl);
    d.wait_open_count("r", 0);
    set_legs(d, c, &[]);
    d.reload("r", &t);
    d.wait_status("r", &format!(" {all} "), Duration::from_secs(60));
    d.wait_status("r", " idle ", Duration::from_secs(60));

    // a wrong byte on a leg: check counts its 4 KiB row (8 sectors; raid10 the
    // chunk's piece it compared, 128), repair mends it
    let counted = if c.ty.starts_with("raid10") { CHUNK } else { 8 };
    let leg0 = d.dir.path("data0");
    let mut b = std::fs::read(&leg0).expect("leg 0");
    b[70_000] ^= 0x5a;
    std::fs::write(&leg0, &b).expect("leg 0");
    check(d, c, counted, "check counts the row");
    d.ok(&["message", "r", "0", "repair"]);
    d.wait_status("r", " idle ", Duration::from_secs(60));
    check(d, c, 0, "repaired");
    d.ok(&["remove", "r"]);
    for i in 0..c.legs {
        d.ok(&["remove", &format!("l{i}")]);
        d.ok(&["remove", &format!("m{i}")]);
    }
}

fn run(tag: &str, cases: &[Case]) {
    let d = Daemon::start(tag);
    for (k, c) in cases.iter().enumerate() {
        exercise(&d, c, 1000 + k as u64);
    }
}

#[test]
fn raid5_and_raid4_in_every_layout_survive_a_lost_leg_and_recover_it() {
    let mut cases = Vec::new();
    for (ty, status) in [
        ("raid4", "raid4"),
        ("raid5_la", "raid5_la"),
        ("raid5_ra", "raid5_ra"),
        ("raid5_ls", "raid5_ls"),
        ("raid5_rs", "raid5_rs"),
        ("raid5_n", "raid5_n"),
    ] {
        cases.push(Case {
            ty,
            legs: 4,
            sectors: 3 * LEG,
            opts: &[],
            lose: &[1],
            lose_after: &[2],
            status,
        });
    }
    run("raid5", &cases);
}

#[test]
fn raid6_survives_two_lost_legs_in_every_layout() {
    let mut cases = Vec::new();
    for ty in [
        "raid6_zr",
        "raid6_nr",
        "raid6_nc",
        "raid6_n_6",
        "raid6_la_6",
        "raid6_ra_6",
        "raid6_ls_6",
        "raid6_rs_6",
    ] {
        cases.push(Case {
            ty,
            legs: 5,
            sectors: 3 * LEG,
            opts: &[],
            lose: &[0, 3],
            lose_after: &[1, 4],
            status: ty,
        });
    }
    run("raid6", &cases);
}

#[test]
fn raid10_near_far_and_offset_keep_two_copies_and_raid0_stripes() {
    run(
        "raid10",
        &[
            Case {
                ty: "raid10",
                legs: 4,
                sectors: 2 * LEG,
                opts: &["raid10_copies", "2"],
                lose: &[0, 2],
                lose_after: &[1, 3],
                status: "raid10",
            },
            Case {
                ty: "raid10",
                legs: 3,
                sectors: 3 * LEG / 2,
                opts: &[],
                lose: &[1],
                lose_after: &[2],
                status: "raid10",
            },
            Case {
                ty: "raid10",
                legs: 4,
                sectors: 2 * LEG,
                opts: &["raid10_format", "far"],
                lose: &[0, 2],
                lose_after: &[1, 3],
                status: "raid10_far",
            },
            Case {
                ty: "raid10",
                legs: 4,
                sectors: 2 * LEG,
                opts: &["raid10_format", "offset"],
                lose: &[1, 3],
                lose_after: &[0, 2],
                status: "raid10_offset",
            },
            Case {
                ty: "raid0",
                legs: 3,
                sectors: 3 * LEG,
                opts: &[],
                lose: &[],
                lose_after: &[],
                status: "raid0",
            },
        ],
    );
}

/// `n` legs `l0..` over integrity devices `i0..` (journal mode, crc32c;
/// every block written once, so every tag is right, as a wipe leaves them),
/// with metadata devices `m0..`: their files.
fn integrity_legs(d: &Daemon, n: usize) -> Vec<std::path::PathBuf> {
    use crate::integrity::{make, J};
    let mut files = Vec::new();
    for i in 0..n {
        d.dir.sparse(&format!("meta{i}"), MIB);
        d.create(
            &format!("m{i}"),
            &format!("0 2048 linear {} 0", d.dir.path(&format!("meta{i}")).display()),
        );
        let img = d.dir.sparse(&format!("data{i}"), 4 * MIB);
        let p = make(d, &format!("i{i}"), &img, J);
        assert!(p >= LEG, "the integrity device holds a leg: {p}");
        let mut w = Client::connect(&d.sock(), &format!("i{i}"));
        w.write(0, &vec![0u8; (LEG * 512) as usize]);
        assert_eq!(w.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
        drop(w);
        d.wait_open_count(&format!("i{i}"), 0);
        d.create(&format!("l{i}"), &format!("0 {LEG} linear /dev/mapper/i{i} 0"));
        files.push(img);
    }
    files
}

/// md's read-error correction: a leg whose block at sector 8 fails to read
/// (a byte changed under its integrity device, as LVM's `--raidintegrity`
/// stacks them) stays in the array of `c`; the array reads right, `log`
/// says how the block was corrected, the leg's integrity counted one
/// failure, and the leg reads right again.
fn corrects_a_bad_block(tag: &str, c: &Case, log_line: &str) {
    use crate::integrity::home;
    let d = Daemon::start(tag);
    let files = integrity_legs(&d, c.legs);
    d.create("r", &table(c, c.sectors));
    let all = health(c, &[]);
    assert_eq!(
        d.wait_status("r", " idle ", Duration::from_secs(60)),
        status_of(c, c.sectors, &all, 0)
    );
    let data = pattern(44, MIB as usize);
    let mut cl = Client::connect(&d.sock(), "r");
    cl.write(0, &data);
    assert_eq!(cl.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
    drop(cl);
    d.wait_open_count("r", 0);
    // leg 0 holds array sector 8 at its sector 8 (raid5_ls's first row,
    // raid10 near's first copy)
    let at = home(&files[0], 8) * 512 + 100;
    let mut b = std::fs::read(&files[0]).expect("leg image");
    b[at as usize] ^= 0x10;
    std::fs::write(&files[0], &b).expect("write");
    let mut cl = Client::connect(&d.sock(), "r");
    assert!(cl.read(0, data.len()) == data, "{}: the array reads right", c.ty);
    drop(cl);
    d.wait_open_count("r", 0);
    let t0 = std::time::Instant::now();
    while !d.log().contains(log_line) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d.log().contains(log_line), "{}: {}", c.ty, d.log());
    assert!(
        d.ok(&["status", "i0"]).contains(" integrity 1 "),
        "{}: the leg's integrity counted the block",
        c.ty
    );
    assert_eq!(
        d.ok(&["status", "r"]).trim_end(),
        status_of(c, c.sectors, &all, 0),
        "{}: no leg failed",
        c.ty
    );
    let mut cl = Client::connect(&d.sock(), "i0");
    assert!(
        cl.read(8 * 512, 512) == data[8 * 512..9 * 512],
        "{}: the leg holds the block again",
        c.ty
    );
    drop(cl);
    let mut cl = Client::connect(&d.sock(), "r");
    assert!(
        cl.read(0, data.len()) == data,
        "{}: and the array reads it from there",
        c.ty
    );
}

/// raid5: the block is rebuilt from the other legs and written back (the
/// piece the read asked of the leg: its first chunk).
#[test]
fn raid5_rebuilds_a_block_that_fails_to_read_and_writes_it_back() {
    let c = Case {
        ty: "raid5_ls",
        legs: 3,
        sectors: 2 * LEG,
        opts: &[],
        lose: &[],
        lose_after: &[],
        status: "raid5_ls",
    };
    corrects_a_bad_block(
        "raid5-correct",
        &c,
        "raid: read error corrected: leg 0 at its sector 0 rebuilt from the other legs",
    );
}

/// raid10: the read goes to the other copy, and the region is written back
/// from it.
#[test]
fn raid10_reads_the_other_copy_of_a_block_that_fails_and_writes_it_back() {
    let c = Case {
        ty: "raid10",
        legs: 2,
        sectors: LEG,
        opts: &[],
        lose: &[],
        lose_after: &[],
        status: "raid10",
    };
    corrects_a_bad_block(
        "raid10-correct",
        &c,
        "raid: read error corrected: region 0 of leg 0 written again from another leg",
    );
}
