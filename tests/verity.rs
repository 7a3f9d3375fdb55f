//! dm-verity (`verity`) through the real daemon, the CLI and NBD, on trees
//! `veritysetup format` builds: the data reads back; a flipped byte in a data
//! block fails exactly that block's reads (a long read's too) and the status says `C`; a flipped
//! byte in a level-0 hash block fails exactly the data blocks it covers;
//! `ignore_corruption` serves and reports; a wrong root hash fails every read;
//! `veritysetup verify` agrees on each image; bad tables fail with one line;
//! a daemon killed and restored brings the device back read-only, verifying.

use crate::common;
use common::nbd::{Client, READ, TRIM, WRITE};
use common::verity::{flip, Format};
use common::{image, Daemon, Scratch};
use std::path::Path;

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 1024;
const SIZE: u64 = BLOCK * BLOCKS;

const FMT: Format = Format {
    version: 1,
    data_block: 4096,
    hash_block: 4096,
    hash: "sha256",
    salt: "5eed0123456789abcdef",
    superblock: true,
};

fn create_ro(d: &Daemon, name: &str, table: &str) {
    let o = d.cli_in(&["create", "--readonly", name], table);
    assert!(
        o.status.success(),
        "create {name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn verity_line(f: &Format, data: &Path, hash: &Path, root: &str, opts: &str) -> String {
    format!(
        "0 {} verity {}",
        SIZE / 512,
        f.table(
            &data.display().to_string(),
            &hash.display().to_string(),
            BLOCKS,
            root,
            opts
        )
    )
}

/// Which 4 KiB blocks fail to read.
fn failing(c: &mut Client) -> Vec<u64> {
    (0..BLOCKS)
        .filter(|b| c.call(READ, 0, b * BLOCK, BLOCK as u32, &[]) != 0)
        .collect()
}

fn status(d: &Daemon, name: &str) -> String {
    d.ok(&["status", name]).trim_end().to_string()
}

#[test]
fn veritysetup_trees_serve_their_data_and_fail_exactly_the_corrupted_blocks() {
    let s = Scratch::new("verity");
    let d = Daemon::start("verity");
    let data = image(&s, "data.img", SIZE, Some(33));
    let hash = s.sparse("hash.img", 64 << 10);
    let root = FMT.run(&data, &hash);
    assert!(FMT.verify(&data, &hash, &root));
    let want = std::fs::read(&data).expect("data");

    // intact: every byte as written, status V, the table as given
    let table = verity_line(&FMT, &data, &hash, &root, "");
    create_ro(&d, "v", &table);
    assert_eq!(d.ok(&["table", "v"]), format!("{table}\n"));
    let mut c = Client::connect(&d.sock(), "v");
    assert!(c.read(0, SIZE as usize) == want, "the data through verity");
    assert!(c.read(0, SIZE as usize) == want, "warm");
    assert_eq!(status(&d, "v"), format!("0 {} verity V", SIZE / 512));
    assert_ne!(c.call(WRITE, 0, 0, 4096, &[0; 4096]), 0, "a write fails");
    assert_ne!(c.call(TRIM, 0, 0, 4096, &[]), 0, "a discard fails");
    assert_eq!(status(&d, "v"), format!("0 {} verity V", SIZE / 512));

    // a flipped byte in data blocks 5 and 900: their reads fail, no other's
    let bad = s.0.join("bad.img");
    std::fs::copy(&data, &bad).expect("copy");
    flip(&bad, 5 * BLOCK + 100);
    flip(&bad, 900 * BLOCK + 9);
    assert!(!FMT.verify(&bad, &hash, &root), "veritysetup verify finds it too");
    create_ro(&d, "c", &verity_line(&FMT, &bad, &hash, &root, ""));
    let mut c = Client::connect(&d.sock(), "c");
    assert_eq!(failing(&mut c), vec![5, 900]);
    assert_ne!(c.call(READ, 0, 0, 64 << 10, &[]), 0, "a read spanning it fails");
    // long reads: a bad block anywhere in them fails the read
    let long = (512 * BLOCK) as u32;
    assert_ne!(
        c.call(READ, 0, 512 * BLOCK, long, &[]),
        0,
        "blocks 512..1024 hold 900"
    );
    assert_eq!(
        c.call(READ, 0, 8 * BLOCK, long, &[]),
        0,
        "blocks 8..520 are whole"
    );
    assert_eq!(status(&d, "c"), format!("0 {} verity C", SIZE / 512));

    // ignore_corruption: served as it is on disk, reported
    create_ro(
        &d,
        "i",
        &verity_line(&FMT, &bad, &hash, &root, "1 ignore_corruption"),
    );
    let mut c = Client::connect(&d.sock(), "i");
    assert_eq!(status(&d, "i"), format!("0 {} verity V", SIZE / 512));
    assert!(c.read(0, SIZE as usize) == std::fs::read(&bad).expect("bad"));
    assert_eq!(status(&d, "i"), format!("0 {} verity C", SIZE / 512));

    // a flipped byte in level-0 hash block 3 (superblock, top block, then
    // level 0 from hash block 2): the 128 data blocks it covers fail
    let badh = s.0.join("badh.img");
    std::fs::copy(&hash, &badh).expect("copy");
    flip(&badh, (2 + 3) * BLOCK + 7);
    assert!(!FMT.verify(&data, &badh, &root));
    create_ro(&d, "h", &verity_line(&FMT, &data, &badh, &root, ""));
    let mut c = Client::connect(&d.sock(), "h");
    assert_eq!(failing(&mut c), (3 * 128..4 * 128).collect::<Vec<_>>());
    assert_eq!(status(&d, "h"), format!("0 {} verity C", SIZE / 512));

    // a wrong root hash: every read fails (the table is taken, as the kernel's)
    let mut wrong = root.clone().into_bytes();
    wrong[0] = if wrong[0] == b'0' { b'1' } else { b'0' };
    let wrong = String::from_utf8(wrong).expect("hex");
    create_ro(&d, "w", &verity_line(&FMT, &data, &hash, &wrong, ""));
    let mut c = Client::connect(&d.sock(), "w");
    assert_eq!(failing(&mut c).len() as u64, BLOCKS);
    assert!(!FMT.verify(&data, &hash, &wrong));
}

#[test]
fn other_formats_sha512_sha1_sha224_version_0_small_blocks_zero_blocks() {
    let s = Scratch::new("verity-fmt");
    let d = Daemon::start("verity-fmt");
    let data = image(&s, "data.img", SIZE, Some(5));
    let want = std::fs::read(&data).expect("data");
    let formats = [
        Format {
            version: 1,
            data_block: 512,
            hash_block: 1024,
            hash: "sha512",
            salt: "-",
            superblock: false,
        },
        Format {
            version: 0,
            data_block: 4096,
            hash_block: 4096,
            hash: "sha256",
            salt: "abcdef",
            superblock: false,
        },
        Format {
            version: 0,
            data_block: 1024,
            hash_block: 512,
            hash: "sha1",
            salt: "0f1e2d",
            superblock: false,
        },
        Format {
            version: 1,
            data_block: 1024,
            hash_block: 512,
            hash: "sha224",
            salt: "00",
            superblock: false,
        },
    ];
    for (i, f) in formats.iter().enumerate() {
        let hash = s.sparse(&format!("hash{i}.img"), 1 << 20);
        let root = f.run(&data, &hash);
        let blocks = SIZE / u64::from(f.data_block);
        let table = format!(
            "0 {} verity {}",
            SIZE / 512,
            f.table(
                &data.display().to_string(),
                &hash.display().to_string(),
                blocks,
                &root,
                "2 ignore_zero_blocks check_at_most_once"
            )
        );
        let name = format!("f{i}");
        create_ro(&d, &name, &table);
        assert_eq!(d.ok(&["table", &name]), format!("{table}\n"));
        let mut c = Client::connect(&d.sock(), &name);
        assert!(c.read(0, SIZE as usize) == want, "format {i} reads back");
        assert!(
            c.read(0, SIZE as usize) == want,
            "format {i} again (checked once)"
        );
        assert_eq!(status(&d, &name), format!("0 {} verity V", SIZE / 512));
    }

    // ignore_zero_blocks: a block the tree says is zeroes reads as zeroes
    // without being read; without the option, its changed contents fail
    let z = s.sparse("zero.img", SIZE);
    let hash = s.sparse("zhash.img", 64 << 10);
    let root = FMT.run(&z, &hash);
    flip(&z, 9 * BLOCK);
    create_ro(
        &d,
        "z",
        &verity_line(&FMT, &z, &hash, &root, "1 ignore_zero_blocks"),
    );
    let mut c = Client::connect(&d.sock(), "z");
    assert!(c.read(0, SIZE as usize).iter().all(|b| *b == 0));
    assert_eq!(status(&d, "z"), format!("0 {} verity V", SIZE / 512));
    create_ro(&d, "nz", &verity_line(&FMT, &z, &hash, &root, ""));
    let mut c = Client::connect(&d.sock(), "nz");
    assert_eq!(failing(&mut c), vec![9]);
}

#[test]
fn bad_tables_fail_with_one_clear_line() {
    let s = Scratch::new("verity-bad");
    let d = Daemon::start("verity-bad");
    let data = image(&s, "data.img", SIZE, Some(1));
    let hash = s.sparse("hash.img", 64 << 10);
    let small = s.sparse("small.img", 8192);
    let root = FMT.run(&data, &hash);
    let (p, h, sm) = (data.display(), hash.display(), small.display());
    let n = SIZE / 512;
    let good = format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 00");
    let o = d.cli_in(&["create", "rw"], &good);
    assert!(!o.status.success(), "a writable verity device was created");
    assert!(String::from_utf8_lossy(&o.stderr).contains("Device must be readonly"));
    for (table, want) in [
        (format!("0 {n} verity 2 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 00"), "Invalid version"),
        (format!("0 {n} verity 1 {p} {h} 3000 4096 {BLOCKS} 1 sha256 {root} 00"), "Invalid data device block size"),
        (format!("0 {n} verity 1 {p} {h} 8192 4096 {BLOCKS} 1 sha256 {root} 00"), "Invalid data device block size"),
        (format!("0 {n} verity 1 {p} {h} 4096 0 {BLOCKS} 1 sha256 {root} 00"), "Invalid hash device block size"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 1000 1 sha256 {root} 00"), "Data device is too small"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 x 1 sha256 {root} 00"), "Invalid data blocks"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} -1 sha256 {root} 00"), "Invalid hash start"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 md5 {root} 00"), "Cannot initialize hash function"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root}00 00"), "Invalid root digest"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {} 00", &root[..63]), "Invalid root digest"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 0g"), "Invalid salt"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 012"), "Invalid salt"),
        (format!("0 {n} verity 1 {p} {sm} 4096 4096 {BLOCKS} 1 sha256 {root} 00"), "Hash device is too small"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 00 1 bogus"), "Unrecognized verity feature request"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 00 2 fec_roots 2"), "FEC feature arguments (fec_roots, fec_blocks, fec_start) without use_fec_from_device"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 00 2 ignore_corruption panic_on_corruption"), "Conflicting error handling parameters"),
        (format!("0 {n} verity 1 {p} {h} 4096 4096 {BLOCKS} 1 sha256 {root}"), "Not enough arguments"),
    ] {
        let o = d.cli_in(&["create", "--readonly", "bad"], &table);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{table} was accepted");
        assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
        assert!(e.contains(want), "{table}: {e}");
    }
}

#[test]
fn a_restarted_daemon_restores_verity_read_only_and_verifying() {
    let d = Daemon::start("verity-restore");
    let data = d.dir.path("data.img");
    std::fs::write(&data, common::pattern(8, SIZE as usize)).expect("data");
    let hash = d.dir.sparse("hash.img", 64 << 10);
    let root = FMT.run(&data, &hash);
    let table = verity_line(&FMT, &data, &hash, &root, "1 check_at_most_once");
    create_ro(&d, "v", &table);
    let want = std::fs::read(&data).expect("data");
    assert!(Client::connect(&d.sock(), "v").read(0, SIZE as usize) == want);
    flip(&data, 77 * BLOCK + 1);
    let d = d.kill9_and_restore();
    assert_eq!(d.ok(&["table", "v"]), format!("{table}\n"));
    let mut c = Client::connect(&d.sock(), "v");
    assert_ne!(c.call(WRITE, 0, 0, 4096, &[0; 4096]), 0, "still read-only");
    // the restored device verifies afresh: the byte changed since fails
    assert_eq!(failing(&mut c), vec![77]);
    assert_eq!(status(&d, "v"), format!("0 {} verity C", SIZE / 512));
}
