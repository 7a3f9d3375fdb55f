//! Metadata that lies with a valid checksum: a pool made by the daemon, then one
//! size or count in its superblock or in a btree node header edited and the
//! block's checksum re-sealed, so only the structure parsers can catch it. A
//! `create` of a pool over it fails with one line naming the field and the
//! block, and the daemon keeps serving the device made before; every thin tool
//! exits with its error status (64), never aborts (134).

use crate::common;
use common::*;
use dmkit::pdata::cache::seal;
use dmkit::pdata::{BlockKind, BLOCK_SIZE};
use std::path::Path;
use std::process::Command;

const META_BLOCKS: u64 = 1024;
const POOL_SECTORS: u64 = 131_072;

/// A daemon serving `keeper` (a linear device over a file of known bytes), and
/// the metadata image of a pool it made, with thin 1 holding 1 MiB of data;
/// the pool is removed again so the file is free to edit.
fn setup() -> (Daemon, Vec<u8>) {
    let d = Daemon::start("lying");
    let keep = image(&d.dir, "keep", 1 << 20, Some(7));
    d.create("keeper", &format!("0 2048 linear {} 0\n", keep.display()));
    let meta = d.dir.sparse("meta", META_BLOCKS * BLOCK_SIZE as u64);
    let data = d.dir.sparse("data", POOL_SECTORS * 512);
    d.create(
        "pool",
        &format!(
            "0 {POOL_SECTORS} thin-pool {} {} 128 10\n",
            meta.display(),
            data.display()
        ),
    );
    d.ok(&["message", "pool", "0", "create_thin 1"]);
    d.create("thin", "0 65536 thin /dev/mapper/pool 1\n");
    {
        let mut c = nbd::Client::connect(&d.sock(), "thin");
        c.write(0, &pattern(3, 1 << 20));
    }
    d.remove_closed("thin");
    d.ok(&["remove", "pool"]);
    let img = std::fs::read(&meta).expect("read metadata");
    (d, img)
}

fn le64(img: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(img[off..off + 8].try_into().expect("8 bytes"))
}

/// `img` with `bytes` written at `off` of block `block`, the block re-sealed.
fn lie(img: &[u8], block: u64, kind: BlockKind, off: usize, bytes: &[u8]) -> Vec<u8> {
    let mut out = img.to_vec();
    let at = block as usize * BLOCK_SIZE;
    let b: &mut [u8; BLOCK_SIZE] = (&mut out[at..at + BLOCK_SIZE]).try_into().expect("block");
    b[off..off + bytes.len()].copy_from_slice(bytes);
    seal(block, kind, b);
    out
}

/// Run `dmkit thin VERB args...`; (exit code, stderr).
fn tool(verb: &str, args: &[&str]) -> (Option<i32>, String) {
    let o = Command::new(BIN)
        .arg("thin")
        .arg(verb)
        .args(args)
        .output()
        .expect("spawn dmkit thin");
    (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The error lines of a tool's stderr (`check` and `ls` also print what they
/// are examining there).
fn error_lines(stderr: &str) -> Vec<&str> {
    const PROGRESS: [&str; 7] = [
        "Checking thin metadata",
        "device details tree",
        "mapping tree",
        "data space map",
        "metadata space map",
        "Scanning data mappings",
        "examining",
    ];
    stderr
        .lines()
        .filter(|l| !l.is_empty() && !PROGRESS.iter().any(|p| l.trim() == *p))
        .collect()
}

/// A pool `create` over `path` in `d` fails with one line naming `want` and the
/// target, leaves no device, and the daemon still serves `keeper`.
fn create_is_refused(d: &Daemon, path: &Path, want: &str, what: &str) {
    let data = d.dir.path("data");
    let e = d.fails(&[
        "create",
        "lying",
        "--table",
        &format!(
            "0 {POOL_SECTORS} thin-pool {} {} 128 10",
            path.display(),
            data.display()
        ),
    ]);
    assert!(e.contains(want), "{what}: create error does not name it: {e}");
    assert!(
        e.contains("thin-pool"),
        "{what}: create error does not name the target: {e}"
    );
    assert!(
        d.ok(&["ls"]).lines().all(|l| !l.starts_with("lying")),
        "{what}: a failed create left a device"
    );
    let mut c = nbd::Client::connect(&d.sock(), "keeper");
    assert_same(
        &c.read(0, 1 << 20),
        &pattern(7, 1 << 20),
        &format!("{what}: keeper after the refused create"),
    );
}

/// `path` is refused: by a pool `create` in `d` (one line containing `want`; the
/// daemon still serves `keeper`), and by each thin tool (exit 64, one error line
/// containing `want`). `repair`: None if repair rebuilds without the lying
/// field, else what its error says.
fn refused_everywhere(d: &Daemon, path: &Path, want: &str, repair: Option<&str>, what: &str) {
    create_is_refused(d, path, want, what);

    let p = path.to_str().expect("utf-8 path");
    let out = d.dir.sparse("repaired", META_BLOCKS * BLOCK_SIZE as u64);
    let cases: [(&str, Vec<&str>); 6] = [
        ("check", vec![p]),
        ("ls", vec![p]),
        ("dump", vec![p]),
        ("rmap", vec!["--region", "0..10", p]),
        ("delta", vec!["--snap1", "1", "--snap2", "1", p]),
        ("repair", vec!["-i", p, "-o", out.to_str().expect("utf-8 path")]),
    ];
    for (verb, args) in cases {
        let (code, err) = tool(verb, &args);
        let want = match (verb, repair) {
            ("repair", None) => {
                assert_eq!(code, Some(0), "{what}: thin repair: {err}");
                continue;
            }
            ("repair", Some(r)) => r,
            _ => want,
        };
        assert_eq!(code, Some(64), "{what}: thin {verb} exit status: {err}");
        let lines = error_lines(&err);
        assert_eq!(lines.len(), 1, "{what}: thin {verb}: one line of error: {err}");
        assert!(
            lines[0].contains(want),
            "{what}: thin {verb} does not name it: {err}"
        );
    }
}

/// What is edited, at which superblock offset, to which bytes; what the errors
/// say, and what repair says (None: it rebuilds; "": the same as the others).
type Lie = (&'static str, usize, Vec<u8>, String, Option<&'static str>);

#[test]
fn lying_superblock_sizes_are_refused_by_name() {
    let (d, good) = setup();
    let path = d.dir.path("lie");
    let max = META_BLOCKS * 16320;
    // repair rebuilds the metadata space map; it keeps the data size, and says
    // "invalid data block size" as 1.x does
    let same = Some("");
    let cases: [Lie; 6] = [
        (
            "data space map nr_blocks, 2^40 (a terabyte of counts)",
            64,
            (1u64 << 40).to_le_bytes().to_vec(),
            "metadata block 0: data space map nr_blocks is 1099511627776, more than".into(),
            same,
        ),
        (
            "data space map nr_blocks, just past what the metadata's bitmaps can describe",
            64,
            (max + 1).to_le_bytes().to_vec(),
            format!(
                "metadata block 0: data space map nr_blocks is {}, more than the bitmaps a metadata device of {META_BLOCKS} blocks can hold describe ({max})",
                max + 1
            ),
            same,
        ),
        (
            "data space map nr_blocks, 2^64-1",
            64,
            u64::MAX.to_le_bytes().to_vec(),
            "metadata block 0: data space map nr_blocks is 18446744073709551615, more than a mapping's 40-bit block number can address (1099511627776)".into(),
            same,
        ),
        (
            "metadata space map nr_blocks, one past the device",
            192,
            (META_BLOCKS + 1).to_le_bytes().to_vec(),
            format!("metadata block 0: metadata space map nr_blocks is {}, more than the metadata device's blocks ({META_BLOCKS})", META_BLOCKS + 1),
            None,
        ),
        (
            "metadata space map nr_blocks, 2^48",
            192,
            (1u64 << 48).to_le_bytes().to_vec(),
            "metadata block 0: metadata space map nr_blocks is 281474976710656, more than the 255 bitmaps of the metadata index block describe (4161600)".into(),
            None,
        ),
        (
            "data_block_size 2^32-1",
            336,
            u32::MAX.to_le_bytes().to_vec(),
            "superblock: data_block_size is 4294967295 sectors".into(),
            Some("invalid data block size"),
        ),
    ];
    for (what, off, bytes, want, repair) in cases {
        std::fs::write(&path, lie(&good, 0, BlockKind::Superblock, off, &bytes)).expect("write");
        let repair = repair.map(|r| if r.is_empty() { want.as_str() } else { r });
        refused_everywhere(&d, &path, &want, repair, what);
    }
    // and the untouched image still makes a pool whose thin reads back
    std::fs::write(&path, &good).expect("write");
    d.create(
        "again",
        &format!(
            "0 {POOL_SECTORS} thin-pool {} {} 128 10\n",
            path.display(),
            d.dir.path("data").display()
        ),
    );
    d.create("t1", "0 65536 thin /dev/mapper/again 1\n");
    let mut c = nbd::Client::connect(&d.sock(), "t1");
    assert_same(
        &c.read(0, 1 << 20),
        &pattern(3, 1 << 20),
        "thin 1 over the untouched metadata",
    );
}

#[test]
fn lying_btree_node_headers_are_refused_by_name() {
    let (d, good) = setup();
    let path = d.dir.path("lie");
    // the device-details tree's root: a leaf of one entry
    let details = le64(&good, 328);
    let cases: [(&str, usize, u32, String); 3] = [
        (
            "nr_entries 2^32-1",
            16,
            u32::MAX,
            format!("metadata block {details}: btree node has 4294967295 entries, more than max_entries 126"),
        ),
        (
            "nr_entries one past max_entries",
            16,
            127,
            format!("metadata block {details}: btree node has 127 entries, more than max_entries 126"),
        ),
        (
            "max_entries 2^32-1",
            20,
            u32::MAX,
            format!("metadata block {details}: btree node has max_entries 4294967295, expected 126"),
        ),
    ];
    for (what, off, v, want) in cases {
        std::fs::write(
            &path,
            lie(&good, details, BlockKind::BtreeNode, off, &v.to_le_bytes()),
        )
        .expect("write");
        create_is_refused(&d, &path, &want, what);
        let p = path.to_str().expect("utf-8 path");
        for (verb, args) in [
            ("check", vec![p]),
            ("ls", vec![p]),
            ("dump", vec![p]),
            ("delta", vec!["--snap1", "1", "--snap2", "1", p]),
        ] {
            let (code, err) = tool(verb, &args);
            assert_eq!(code, Some(64), "{what}: thin {verb} exit status: {err}");
            assert!(
                err.contains(&format!("{details}")),
                "{what}: thin {verb} does not name the block: {err}"
            );
        }
    }
}

/// A tree whose internal nodes each point at the same child 252 times: every
/// node is sound on its own, but a walk would visit 252^6 leaves. It is refused
/// once a walk reaches more nodes than the device has blocks.
#[test]
fn a_tree_that_reaches_one_node_many_times_is_refused() {
    let (d, good) = setup();
    let details = le64(&good, 328);
    let mut img = good.clone();
    // six internal nodes in blocks the pool never used, the last pointing at the real leaf
    let first = 1000u64;
    for (i, b) in (first..first + 6).enumerate() {
        let child = if i == 5 { details } else { b + 1 };
        let mut n = [0u8; BLOCK_SIZE];
        n[4..8].copy_from_slice(&1u32.to_le_bytes()); // internal
        n[16..20].copy_from_slice(&252u32.to_le_bytes());
        n[20..24].copy_from_slice(&252u32.to_le_bytes());
        n[24..28].copy_from_slice(&8u32.to_le_bytes());
        for k in 0..252usize {
            n[32 + 8 * k..40 + 8 * k].copy_from_slice(&(k as u64).to_le_bytes());
            let v = 32 + 8 * 252 + 8 * k;
            n[v..v + 8].copy_from_slice(&child.to_le_bytes());
        }
        seal(b, BlockKind::BtreeNode, &mut n);
        img[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].copy_from_slice(&n);
    }
    let img = lie(&img, 0, BlockKind::Superblock, 328, &first.to_le_bytes());
    let path = d.dir.path("lie");
    std::fs::write(&path, img).expect("write");
    let t0 = std::time::Instant::now();
    create_is_refused(
        &d,
        &path,
        &format!(
            "metadata block {first}: btree reaches more nodes than the metadata device has blocks ({META_BLOCKS})"
        ),
        "a tree reaching one node many times",
    );
    let p = path.to_str().expect("utf-8 path");
    for verb in ["check", "ls", "dump"] {
        let (code, err) = tool(verb, &[p]);
        assert_eq!(code, Some(64), "thin {verb} exit status: {err}");
    }
    assert!(t0.elapsed().as_secs() < 30, "took {:?}", t0.elapsed());
}
