//! The `integrity` target through the daemon: integritysetup formats, opens,
//! reports and closes through the door; a corrupted block fails with EILSEQ
//! and is counted; journal and bitmap modes keep every flushed write across a
//! kill; `recalculate` makes a blank device readable; recovery mode reads
//! unchecked and takes no write; discards; bad tables and lying superblocks
//! get the kernel's words. (The kernel's dm-integrity opening dmkit's devices
//! and the other way: tests/integrity_guest.rs.)

use crate::common;

use common::nbd::{Client, FLUSH, READ, TRIM};
use common::{pattern, Daemon, Scratch};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::MIB;
pub(crate) const J: &str =
    "4 J 5 journal_sectors:2048 block_size:512 internal_hash:crc32c fix_padding fix_hmac";

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub(crate) fn provided(img: &Path) -> u64 {
    let b = std::fs::read(img).expect("image");
    u64::from_le_bytes(b[16..24].try_into().unwrap())
}

/// Format `img` with `opts` (an 8-sector table, as integritysetup does) and
/// make `name` over all of it.
pub(crate) fn make(d: &Daemon, name: &str, img: &Path, opts: &str) -> u64 {
    d.create("fmt", &format!("0 8 integrity {} 0 {opts}", img.display()));
    d.ok(&["remove", "fmt"]);
    let p = provided(img);
    d.create(name, &format!("0 {p} integrity {} 0 {opts}", img.display()));
    p
}

/// The home sector of logical sector `l` (tag 4, 512-byte blocks,
/// fix_padding, first area).
pub(crate) fn home(img: &Path, l: u64) -> u64 {
    let b = std::fs::read(img).expect("image");
    let js = u64::from(u32::from_le_bytes(b[12..16].try_into().unwrap()));
    8 + js * 176 + 256 + l
}

#[test]
fn integritysetup_formats_opens_reports_and_closes_through_the_door() {
    let s = Scratch::new("integrity-door");
    let img = s.sparse("i.img", 32 * MIB);
    let d = Daemon::start("integrity-door");
    let i = img.to_str().expect("utf-8");
    let run = |args: &[&str]| {
        let mut a = vec!["exec", "--", "integritysetup"];
        a.extend_from_slice(args);
        let o = d.cli(&a);
        assert!(o.status.success(), "integritysetup {args:?}: {}", text(&o.stderr));
        text(&o.stdout)
    };
    run(&["format", "--batch-mode", i]);
    let dump = text(
        &Command::new("integritysetup")
            .args(["dump", i])
            .output()
            .expect("integritysetup dump")
            .stdout,
    );
    let p = provided(&img);
    for want in [
        "superblock_version 5",
        "integrity_tag_size 4",
        &format!("provided_data_sectors {p}"),
        "flags fix_padding fix_hmac",
    ] {
        assert!(dump.contains(want), "integritysetup dump: {want} in {dump}");
    }
    run(&["open", i, "ig"]);
    let table = d.ok(&["table", "ig"]);
    let fields: Vec<&str> = table.trim().split(' ').collect();
    assert!(fields[3].starts_with("7:"), "a loop device: {table}");
    assert_eq!(
        fields[4..].join(" "),
        "0 4 J 8 journal_sectors:352 interleave_sectors:32768 buffer_sectors:128 journal_watermark:50 \
         commit_time:10000 fix_padding fix_hmac internal_hash:crc32c",
        "the table integritysetup's open loads"
    );
    // the format wiped every block: the whole device reads (zeroes)
    let mut c = Client::connect(&d.sock(), "ig");
    assert!(c.read(0, (p * 512) as usize).iter().all(|&b| b == 0));
    let data = pattern(5, 1 << 20);
    c.write(3 * MIB, &data);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    assert!(c.read(3 * MIB, data.len()) == data, "the write reads back");
    drop(c);
    d.wait_open_count("ig", 0);
    let st = run(&["status", "ig"]);
    for want in [
        "type:    INTEGRITY",
        "integrity: crc32c",
        "failures: 0",
        "journal watermark: 50%",
    ] {
        assert!(st.contains(want), "integritysetup status: {want} in {st}");
    }
    run(&["close", "ig"]);
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
}

#[test]
fn a_corrupted_block_fails_with_eilseq_is_counted_and_its_neighbours_read() {
    let s = Scratch::new("integrity-bad");
    let img = s.sparse("i.img", 16 * MIB);
    let d = Daemon::start("integrity-bad");
    let p = make(&d, "i", &img, J);
    let data = pattern(6, 65536);
    let mut c = Client::connect(&d.sock(), "i");
    c.write(MIB, &data);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    drop(c);
    d.remove_closed("i");
    // one byte of the block at 1 MiB + 4 KiB, in place
    let bad = MIB / 512 + 8;
    let at = home(&img, bad) * 512 + 100;
    let mut b = std::fs::read(&img).expect("image");
    b[at as usize] ^= 0x40;
    std::fs::write(&img, &b).expect("write");
    d.create("i", &format!("0 {p} integrity {} 0 {J}", img.display()));
    let mut c = Client::connect(&d.sock(), "i");
    assert_eq!(c.read(MIB, 4096), data[..4096], "the block before reads");
    assert_eq!(
        c.read(MIB + 4608, 4096),
        data[4608..8704],
        "the block after reads"
    );
    assert_ne!(c.call(READ, 0, MIB + 4096, 512, &[]), 0, "the bad block fails");
    drop(c);
    assert_eq!(d.ok(&["status", "i"]).trim(), format!("0 {p} integrity 1 {p} -"));
    assert!(
        d.log().contains(&format!("Checksum failed at sector {bad:#x}")),
        "the log names the sector"
    );
    // the door's device file: the reader sees EILSEQ
    d.read_fails_with_eilseq("i", 512, bad);
    d.remove_closed("i");
}

#[test]
fn journal_and_bitmap_modes_keep_flushed_writes_across_a_kill() {
    let s = Scratch::new("integrity-kill");
    let jimg = s.sparse("j.img", 16 * MIB);
    let bimg = s.sparse("b.img", 16 * MIB);
    let d = Daemon::start("integrity-kill");
    let b_opts =
        "4 B 5 block_size:512 internal_hash:sha256 fix_padding fix_hmac bitmap_flush_interval:600000";
    let pj = make(&d, "j", &jimg, J);
    let pb = make(&d, "b", &bimg, b_opts);
    let dj = pattern(7, 3 * 65536);
    let db = pattern(8, 3 * 65536);
    for (name, data) in [("j", &dj), ("b", &db)] {
        let mut c = Client::connect(&d.sock(), name);
        c.write(MIB, data);
        c.write(5 * MIB, &data[..4096]);
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
        drop(c);
        d.wait_open_count(name, 0);
    }
    let d = d.kill9_and_restore();
    for (name, data, p) in [("j", &dj, pj), ("b", &db, pb)] {
        let mut c = Client::connect(&d.sock(), name);
        assert!(c.read(MIB, data.len()) == *data, "{name}: the flushed write");
        assert!(c.read(5 * MIB, 4096) == data[..4096], "{name}: the second");
        drop(c);
        assert_eq!(d.ok(&["status", name]).trim(), format!("0 {p} integrity 0 {p} -"));
        d.remove_closed(name);
    }
    assert!(
        d.log()
            .contains("the bitmap was dirty: tags of 1 regions recalculated"),
        "the bitmap's regions recomputed: {}",
        d.log()
    );
}

#[test]
fn recalculate_makes_a_blank_device_readable_and_recovery_mode_reads_unchecked() {
    let s = Scratch::new("integrity-recalc");
    let img = s.sparse("i.img", 16 * MIB);
    std::fs::write(&img, {
        let mut b = pattern(9, (16 * MIB) as usize);
        b[..4096].fill(0);
        b
    })
    .expect("image");
    let d = Daemon::start("integrity-recalc");
    let opts = "4 D 4 internal_hash:crc32c fix_padding fix_hmac recalculate";
    let p = make(&d, "i", &img, opts);
    let st = d.wait_status("i", &format!(" {p} {p}"), Duration::from_secs(60));
    assert_eq!(st, format!("0 {p} integrity 0 {p} {p}"));
    assert!(d.ok(&["table", "i"]).contains(" recalculate "));
    let mut c = Client::connect(&d.sock(), "i");
    let all = c.read(0, (p * 512) as usize);
    drop(c);
    d.remove_closed("i");
    // without recalculate now: every tag is there
    d.create(
        "i",
        &format!(
            "0 {p} integrity {} 0 4 D 3 internal_hash:crc32c fix_padding fix_hmac",
            img.display()
        ),
    );
    let mut c = Client::connect(&d.sock(), "i");
    assert!(c.read(0, (p * 512) as usize) == all, "every block reads");
    drop(c);
    d.remove_closed("i");
    // a wrong hash: every read fails; recovery mode reads the data unchecked
    d.create(
        "w",
        &format!("0 {p} integrity {} 0 4 D 1 internal_hash:crc32", img.display()),
    );
    let mut c = Client::connect(&d.sock(), "w");
    assert_ne!(c.call(READ, 0, 0, 4096, &[]), 0, "a wrong hash fails the read");
    drop(c);
    d.remove_closed("w");
    d.create(
        "r",
        &format!("0 {p} integrity {} 0 4 R 1 internal_hash:crc32", img.display()),
    );
    let mut c = Client::connect(&d.sock(), "r");
    assert!(c.read(0, 65536) == all[..65536], "recovery mode reads unchecked");
    assert_ne!(
        c.try_call(common::nbd::WRITE, 0, &[1u8; 512]).unwrap_or(1),
        0,
        "recovery mode takes no write"
    );
    drop(c);
    d.remove_closed("r");
}

#[test]
fn discarded_blocks_read_without_a_checksum_failure() {
    let s = Scratch::new("integrity-discard");
    let img = s.sparse("i.img", 16 * MIB);
    let d = Daemon::start("integrity-discard");
    let opts = "4 J 5 internal_hash:crc32c fix_padding fix_hmac allow_discards journal_sectors:2048";
    let p = make(&d, "i", &img, opts);
    let mut c = Client::connect(&d.sock(), "i");
    c.write(0, &pattern(10, 131072));
    assert_eq!(c.call(TRIM, 0, 0, 65536, &[]), 0, "discard");
    assert_eq!(c.call(READ, 0, 0, 131072, &[]), 0, "the discarded blocks read");
    drop(c);
    assert_eq!(d.ok(&["status", "i"]).trim(), format!("0 {p} integrity 0 {p} -"));
    d.remove_closed("i");
}

#[test]
fn bad_tables_and_lying_superblocks_get_the_kernels_words() {
    let s = Scratch::new("integrity-tables");
    let img = s.sparse("i.img", 16 * MIB);
    let d = Daemon::start("integrity-tables");
    let i = img.display().to_string();
    let fails = |table: &str, want: &str| {
        let e = d.fails(&["create", "x", "--table", table]);
        assert!(e.contains(want), "{table}: {want} in {e}");
    };
    fails(&format!("0 8 integrity {i} 0 4"), "Invalid argument count");
    fails(
        &format!("0 8 integrity {i} 0 4 Q 0"),
        "Invalid mode (expecting J, B, D, R, I)",
    );
    fails(
        &format!("0 8 integrity {i} 0 0 J 1 internal_hash:crc32c"),
        "Invalid tag size",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 journal_watermark:101"),
        "Invalid argument",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 block_size:1000"),
        "Invalid block_size argument",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 internal_hash:md5"),
        "Invalid internal hash",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 internal_hash:hmac(sha256):zz"),
        "Invalid internal_hash argument",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 internal_hash:hmac(sha256):0000"),
        "the key is all zeroes",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 2 internal_hash:crc32c"),
        "Not enough feature arguments",
    );
    // no internal_hash: the tags are a device above's, of the size given
    fails(&format!("0 8 integrity {i} 0 - J 0"), "Unknown tag size");
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 recalculate"),
        "Recalculate can only be specified with internal_hash",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 2 internal_hash:crc32c meta_device:/nonexistent"),
        "Device lookup failed",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 I 1 internal_hash:crc32c"),
        "not supported",
    );
    fails(
        &format!("0 8 integrity {i} 0 256 J 1 internal_hash:crc32c"),
        "Too big tag size",
    );
    // something that is not a superblock is not formatted over
    std::fs::write(&img, pattern(11, (16 * MIB) as usize)).expect("image");
    fails(
        &format!("0 8 integrity {i} 0 4 J 1 internal_hash:crc32c"),
        "The device is not initialized",
    );
    std::fs::write(&img, vec![0u8; (16 * MIB) as usize]).expect("image");
    let p = make(&d, "ok", &img, J);
    d.ok(&["remove", "ok"]);
    fails(
        &format!("0 8 integrity {i} 0 8 J 1 internal_hash:crc32c"),
        "Tag size doesn't match the information in superblock",
    );
    fails(
        &format!("0 8 integrity {i} 0 4 J 2 internal_hash:crc32c block_size:4096"),
        "Block size doesn't match",
    );
    fails(
        &format!("0 {} integrity {i} 0 {J}", p + 8),
        "Not enough provided sectors for requested mapping size",
    );
    // superblocks that lie, their fields one at a time
    let good = std::fs::read(&img).expect("image");
    for (at, bytes, want) in [
        (8usize, vec![9u8], "Unknown version"),
        (
            12,
            vec![0, 0, 0, 0],
            "Corrupted superblock, journal_sections is 0",
        ),
        (12, vec![0xff, 0xff, 0xff, 0xff], "The device is too small"),
        (9, vec![40], "Invalid interleave_sectors in the superblock"),
        (24, vec![0x19, 0, 0, 0], "Journal mac mismatch"),
        (24, vec![0x38, 0, 0, 0], "Inline flag mismatch"),
    ] {
        let mut b = good.clone();
        b[at..at + bytes.len()].copy_from_slice(&bytes);
        std::fs::write(&img, &b).expect("image");
        fails(&format!("0 8 integrity {i} 0 {J}"), want);
    }
    // a dirty bitmap whose blocks per bit lie beyond 64 bits (found by the fuzzer)
    let mut b = good.clone();
    b[24] |= 0x04;
    b[29] = 200;
    std::fs::write(&img, &b).expect("image");
    fails(
        &format!("0 8 integrity {i} 0 {J}"),
        "the superblock's blocks per bitmap bit (2^200) are out of range",
    );
    // a journal sector whose commit id matches no sequence: the device is refused at resume
    let mut b = good.clone();
    b[4096 + 511] ^= 1;
    std::fs::write(&img, &b).expect("image");
    fails(
        &format!("0 8 integrity {i} 0 {J}"),
        "journal commit id: section 0 sector 0 matches no sequence",
    );
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
}

/// A table keyed with `hmac(sha256)` never puts its key on disk: the state
/// file holds it zeroed, and `serve --restore` does not make the device
/// again with that (it says to load the table with its key), while an
/// unkeyed device beside it comes back.
#[test]
fn a_keyed_table_is_not_restored_with_its_key_zeroed() {
    let s = Scratch::new("integrity-keyed");
    let kimg = s.sparse("k.img", 16 * MIB);
    let pimg = s.sparse("p.img", 16 * MIB);
    let d = Daemon::start("integrity-keyed");
    let key = "5a".repeat(32);
    let keyed = format!("4 J 3 internal_hash:hmac(sha256):{key} fix_padding fix_hmac");
    make(&d, "k", &kimg, &keyed);
    make(&d, "p", &pimg, J);
    let state = std::fs::read_to_string(d.run.join("devices.state")).expect("state file");
    assert!(!state.contains(&key), "the key is not in the state file");
    let d = d.kill9_and_restore();
    let ls = d.ok(&["ls"]);
    assert!(
        ls.starts_with("p\t(511:") && ls.lines().count() == 1,
        "the unkeyed device came back, the keyed one did not: {ls}"
    );
    assert!(
        d.log().contains("load the table again with its key"),
        "the log says why: {}",
        d.log()
    );
    d.ok(&["remove", "p"]);
}
