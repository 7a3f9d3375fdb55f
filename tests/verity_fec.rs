//! dm-verity's forward error correction (`use_fec_from_device`, `fec_roots`,
//! `fec_blocks`, `fec_start`) on FEC data `veritysetup format --fec-device
//! --fec-roots 2` writes: bytes changed in a data block and in a hash block
//! are corrected and the data reads right (the status turns `C`, as the
//! 6.12 kernel's does once it corrected a block); the same bytes changed in
//! three blocks of one codeword group
//! (more than two roots fix) fail exactly those blocks with EIO and the
//! status says `C`; data blocks that cannot be read at all (the file cut
//! short under the device: the FEC data's reads of them fail), two in each
//! codeword group, are rebuilt as erasures; FEC parameters that lie are
//! refused naming the parameter.

use crate::common;

use common::nbd::{Client, READ};
use common::{image, need, run, Daemon, Scratch, BIN};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

const BS: u64 = 4096;
const BLOCKS: u64 = 1024;
const SIZE: u64 = BS * BLOCKS;
/// The hash file: 256 blocks, the superblock first.
const HASH_BYTES: u64 = 1 << 20;
/// What veritysetup covers: the data and the hash file after its superblock.
const FEC_BLOCKS: u64 = BLOCKS + HASH_BYTES / BS - 1;
/// ceil(FEC_BLOCKS / (255 - 2)): blocks between a codeword's bytes.
const ROUNDS: u64 = 6;

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Overwrite `len` bytes at `off` of `p` with their complement.
fn smash(p: &Path, off: u64, len: usize) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .expect("open");
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, off).expect("read");
    b.iter_mut().for_each(|x| *x = !*x);
    f.write_all_at(&b, off).expect("write");
}

struct Setup {
    _sc: Scratch,
    d: Daemon,
    data: std::path::PathBuf,
    hash: std::path::PathBuf,
    want: Vec<u8>,
    /// `dmkit verity table`'s line, without the FEC options.
    table: String,
    fec: std::path::PathBuf,
}

fn setup(tag: &str) -> Setup {
    need("veritysetup");
    let sc = Scratch::new(tag);
    let data = image(&sc, "data.img", SIZE, Some(91));
    let hash = sc.sparse("hash.img", HASH_BYTES);
    let fec = sc.path("fec.img");
    let out = run(Command::new("veritysetup")
        .args([
            "format",
            "--fec-device",
            s(&fec),
            "--fec-roots",
            "2",
            "--salt",
            "abcdef01",
        ])
        .arg(&data)
        .arg(&hash));
    let root = out
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .map(|h| h.trim().to_string())
        .expect("root hash");
    let blocks = out
        .lines()
        .find_map(|l| l.strip_prefix("FEC blocks:"))
        .map(|v| v.trim().to_string());
    assert_eq!(
        blocks.as_deref(),
        Some("12"),
        "FEC blocks: {ROUNDS} rounds of 2 roots"
    );
    let o = Command::new(BIN)
        .args(["verity", "table", s(&data), s(&hash), &root])
        .output()
        .expect("dmkit");
    assert_eq!(text(&o.stderr), "");
    let table = text(&o.stdout).trim_end().to_string();
    let want = std::fs::read(&data).expect("data");
    Setup {
        d: Daemon::start(tag),
        _sc: sc,
        data,
        hash,
        want,
        table,
        fec,
    }
}

impl Setup {
    fn fec_opts(&self, roots: &str, blocks: &str, start: &str) -> String {
        format!(
            "{} 8 use_fec_from_device {} fec_blocks {blocks} fec_start {start} fec_roots {roots}",
            self.table,
            s(&self.fec)
        )
    }
}

#[test]
fn fec_corrects_data_and_hash_blocks_and_fails_exactly_what_it_cannot() {
    let t = setup("verity-fec");
    let table = t.fec_opts("2", &FEC_BLOCKS.to_string(), "0");
    // eight bytes of data block 5, four of hash block 3 (level 0, data
    // blocks 128..255), before anything is read
    smash(&t.data, 5 * BS + 100, 8);
    smash(&t.hash, 3 * BS + 10, 4);
    let o = t.d.cli_in(&["create", "--readonly", "vf"], &table);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    assert_eq!(t.d.ok(&["table", "vf"]), format!("{table}\n"));
    let mut c = Client::connect(&t.d.sock(), "vf");
    assert_eq!(t.d.ok(&["status", "vf"]), format!("0 {} verity V\n", SIZE / 512));
    assert!(c.read(0, SIZE as usize) == t.want, "the data, corrected");
    // as the 6.12 kernel's: C once a block needed correcting
    assert_eq!(t.d.ok(&["status", "vf"]), format!("0 {} verity C\n", SIZE / 512));

    // the same two bytes of blocks 7, 7 + ROUNDS, 7 + 2 ROUNDS: three wrong
    // bytes in each of their codewords, two roots fix one
    for b in [7, 7 + ROUNDS, 7 + 2 * ROUNDS] {
        smash(&t.data, b * BS + 50, 2);
    }
    let failing: Vec<u64> = (0..BLOCKS)
        .filter(|b| c.call(READ, 0, b * BS, BS as u32, &[]) != 0)
        .collect();
    assert_eq!(failing, vec![7, 7 + ROUNDS, 7 + 2 * ROUNDS]);
    assert_eq!(t.d.ok(&["status", "vf"]), format!("0 {} verity C\n", SIZE / 512));
    for b in (0..BLOCKS).filter(|b| ![7, 7 + ROUNDS, 7 + 2 * ROUNDS].contains(b)) {
        let r = (b * BS) as usize..((b + 1) * BS) as usize;
        assert!(c.read(b * BS, BS as usize) == t.want[r], "block {b}");
    }
}

/// Blocks whose reads fail are erasures: the data file loses its last 12
/// blocks (after the device is made), two in each of the 6 codeword groups,
/// more than the one unknown wrong byte two roots fix, and they still read
/// back, each alone and in one request.
#[test]
fn unreadable_data_blocks_are_rebuilt_as_erasures() {
    let t = setup("verity-fec-eras");
    let table = t.fec_opts("2", &FEC_BLOCKS.to_string(), "0");
    let o = t.d.cli_in(&["create", "--readonly", "ve"], &table);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let lost = BLOCKS - 2 * ROUNDS;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&t.data)
        .expect("open")
        .set_len(lost * BS)
        .expect("truncate");
    let mut c = Client::connect(&t.d.sock(), "ve");
    for b in lost..BLOCKS {
        let r = (b * BS) as usize..((b + 1) * BS) as usize;
        assert!(c.read(b * BS, BS as usize) == t.want[r], "block {b}");
    }
    let tail = (lost * BS) as usize..SIZE as usize;
    assert!(
        c.read(lost * BS, tail.len()) == t.want[tail],
        "the lost blocks in one read"
    );
    assert!(c.read(0, SIZE as usize) == t.want, "the whole device");
    assert_eq!(t.d.ok(&["status", "ve"]), format!("0 {} verity C\n", SIZE / 512));
}

#[test]
fn lying_fec_parameters_are_refused_by_name() {
    let t = setup("verity-fec-lies");
    let fb = FEC_BLOCKS.to_string();
    let cases = [
        (t.fec_opts("25", &fb, "0"), "Invalid fec_roots '25' (2 to 24)".to_string()),
        (t.fec_opts("0", &fb, "0"), "Invalid fec_roots '0' (2 to 24)".into()),
        (t.fec_opts("2", "x", "0"), "Invalid fec_blocks 'x'".into()),
        (t.fec_opts("2", "1000", "0"), "Invalid fec_blocks '1000' (fewer than the 1024 data blocks and 9 hash blocks)".into()),
        (t.fec_opts("2", "4503599627370496", "0"), "Invalid fec_blocks '4503599627370496'".into()),
        (t.fec_opts("2", "2000", "0"), "Hash device is too small for fec_blocks (976 blocks from block 1, the device holds 256)".into()),
        (
            t.fec_opts("2", &fb, "1"),
            format!("FEC device {} is too small: 49152 bytes, fec_start 1 and 6 rounds of 2 parity blocks need more", s(&t.fec)),
        ),
        (
            format!("{} 6 use_fec_from_device {} fec_roots 2 fec_start 0", t.table, s(&t.fec)),
            "Missing fec_blocks".into(),
        ),
        (
            format!("{} 4 use_fec_from_device {} fec_blocks {fb}", t.table, s(&t.fec)),
            "Missing fec_roots".into(),
        ),
        (format!("{} 2 fec_roots 2", t.table), "FEC feature arguments (fec_roots, fec_blocks, fec_start) without use_fec_from_device".into()),
        (format!("{} 1 fec_roots", t.table), "FEC feature arguments: fec_roots without its value".into()),
    ];
    for (table, want) in cases {
        let o = t.d.cli_in(&["create", "--readonly", "bad"], &table);
        let e = text(&o.stderr);
        assert!(!o.status.success(), "{table} was accepted");
        assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
        assert!(e.trim_end().ends_with(&want), "{table}: {e}");
    }
}
