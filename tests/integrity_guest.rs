//! dmkit's integrity target and the kernel's dm-integrity (6.12 guest) open
//! each other's devices: formatted by one, written by it, read by the other
//! with no checksum failure, in journal mode (crc32c, 512-byte blocks) and
//! bitmap mode (hmac(sha256), 4 KiB blocks); and a journal one of them
//! committed, its blocks not yet in place (the image copied while the
//! device was live, the blocks' home sectors then zeroed), is replayed by
//! the other.

use crate::common;
use crate::oracle;

use common::nbd::{Client, FLUSH};
use common::{pattern, Daemon};
use std::path::{Path, PathBuf};

use common::MIB;
const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

fn journal_opts() -> String {
    "4 J 5 journal_sectors:2048 block_size:512 internal_hash:crc32c fix_padding fix_hmac".to_string()
}

/// The tags on a device of their own (vdX data, the next disk metadata).
fn meta_opts(meta: &str) -> String {
    format!("4 J 4 block_size:512 internal_hash:sha256 fix_hmac meta_device:{meta}")
}

fn bitmap_opts() -> String {
    format!("- B 4 block_size:4096 internal_hash:hmac(sha256):{KEY} fix_padding fix_hmac")
}

/// The provided sectors, from the superblock.
fn provided(img: &Path) -> u64 {
    let b = std::fs::read(img).expect("image");
    assert_eq!(&b[..8], b"integrt\0", "{} has a superblock", img.display());
    u64::from_le_bytes(b[16..24].try_into().unwrap())
}

/// Zero the home sectors of `[sector, sector + n)` of a journal-mode image
/// (tag 4, 512-byte blocks, fix_padding, one interleave area): what is left
/// of those blocks is in the journal alone.
fn zero_home(img: &Path, sector: u64, n: u64) {
    let mut b = std::fs::read(img).expect("image");
    let js = u64::from(u32::from_le_bytes(b[12..16].try_into().unwrap()));
    // 176-sector sections; a 256-sector tag run before the area's data
    let home = 8 + js * 176 + 256 + sector;
    let (a, z) = ((home * 512) as usize, ((home + n) * 512) as usize);
    b[a..z].fill(0);
    std::fs::write(img, b).expect("write image");
}

/// A table line (words joined by `_`) without its `meta_device:` word.
fn without_meta(t: &str) -> String {
    match t.find("meta_device:") {
        Some(i) => {
            let at = i + "meta_device:".len();
            let end = t[at..].find('_').map_or(t.len(), |e| at + e + 1);
            format!("{}{}", &t[..i], &t[end..])
        }
        None => t.to_string(),
    }
}

/// The image holding the superblock: the metadata device's when `opts`
/// names one.
fn sb_image(img: &Path, opts: &str) -> PathBuf {
    match opts.split_once("meta_device:") {
        Some((_, m)) => PathBuf::from(m.split(' ').next().unwrap_or(m)),
        None => img.to_path_buf(),
    }
}

/// dmkit formats `img` with `opts`, writes `data` at 1 MiB and flushes;
/// `copy`: the image as it is then (the journal committed) is copied there.
fn dmkit_writes(tag: &str, img: &Path, opts: &str, data: &[u8], copy: Option<&Path>) {
    let d = Daemon::start(tag);
    d.create("f", &format!("0 8 integrity {} 0 {opts}", img.display()));
    d.ok(&["remove", "f"]);
    let p = provided(&sb_image(img, opts));
    d.create("i", &format!("0 {p} integrity {} 0 {opts}", img.display()));
    let mut c = Client::connect(&d.sock(), "i");
    c.write(MIB, data);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
    if let Some(to) = copy {
        std::fs::copy(img, to).expect("copy the live image");
    }
    assert_eq!(c.read(MIB, data.len()), data, "dmkit reads its write back");
    drop(c);
    d.remove_closed("i");
}

/// dmkit opens `img` with `opts` and reads 64 KiB at 1 MiB; the md5 and the
/// status.
fn dmkit_reads(tag: &str, img: &Path, opts: &str) -> (String, String, String) {
    let d = Daemon::start(tag);
    let p = provided(&sb_image(img, opts));
    d.create("i", &format!("0 {p} integrity {} 0 {opts}", img.display()));
    let mut c = Client::connect(&d.sock(), "i");
    let got = oracle::md5(&c.read(MIB, 65536));
    drop(c);
    let status = d.ok(&["status", "i"]).trim().to_string();
    let table = d.ok(&["table", "i"]).trim().to_string();
    d.remove_closed("i");
    (got, status, table)
}

#[test]
fn the_kernels_dm_integrity_and_dmkit_open_each_others_devices_and_journals() {
    let s = common::Scratch::new("integrity-guest");
    let names = [
        "kj", "kj-copy", "kb", "dj", "dj-copy", "db", "km", "km-meta", "dm", "dm-meta",
    ];
    let disks: Vec<PathBuf> = names
        .iter()
        .map(|n| {
            s.sparse(
                &format!("{n}.img"),
                if n.ends_with("-meta") { MIB } else { 16 * MIB },
            )
        })
        .collect();
    // dmkit's side first: journal mode (a live copy too), bitmap mode, the
    // tags on a metadata device
    let dj_data = pattern(31, 65536);
    let db_data = pattern(32, 65536);
    dmkit_writes(
        "integrity-dj",
        &disks[3],
        &journal_opts(),
        &dj_data,
        Some(&disks[4]),
    );
    zero_home(&disks[4], MIB / 512, 128);
    dmkit_writes("integrity-db", &disks[5], &bitmap_opts(), &db_data, None);
    let dm_data = pattern(33, 65536);
    dmkit_writes(
        "integrity-dm",
        &disks[8],
        &meta_opts(&disks[9].display().to_string()),
        &dm_data,
        None,
    );

    let script = format!(
        "{}J='{}'\nB='{}'\nKM='{}'\nDM='{}'\n{}",
        oracle::GUEST_HELPERS,
        journal_opts(),
        bitmap_opts(),
        meta_opts("/dev/vdh"),
        meta_opts("/dev/vdj"),
        r#"
# mkfull NAME DEV OPTS: an 8-sector table first (it formats a blank device), then all of it
mkfull() {
  dmsetup create "$1-f" --table "0 8 integrity $2 0 $3"
  p=$(dmsetup status "$1-f" | cut -d' ' -f5)
  dmsetup remove "$1-f"
  mk "$1" "0 $p integrity $2 0 $3"
}
rd() { dd if=/dev/mapper/$1 bs=65536 skip=16 count=1 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1; }
st() { dmsetup status $1 | tr ' ' '_'; }
dd if=/dev/urandom of=/tmp/pj bs=65536 count=1 2>/dev/null
dd if=/dev/urandom of=/tmp/pb bs=65536 count=1 2>/dev/null
dd if=/dev/urandom of=/tmp/pm bs=65536 count=1 2>/dev/null
mkfull kj /dev/vda "$J"
dd if=/tmp/pj of=/dev/mapper/kj bs=65536 seek=16 oflag=direct conv=fsync 2>/dev/null
echo "ORACLE kj-written $(md5sum < /tmp/pj | cut -d' ' -f1)"
echo "ORACLE kj-table $(dmsetup table kj | cut -d' ' -f5- | tr ' ' '_')"
echo "ORACLE kj-read $(rd kj)"
dd if=/dev/vda of=/dev/vdb bs=1M iflag=direct conv=fsync 2>/dev/null
dmsetup remove kj
mkfull kb /dev/vdc "$B"
dd if=/tmp/pb of=/dev/mapper/kb bs=65536 seek=16 oflag=direct conv=fsync 2>/dev/null
echo "ORACLE kb-written $(md5sum < /tmp/pb | cut -d' ' -f1)"
echo "ORACLE kb-table $(dmsetup table kb | cut -d' ' -f5- | tr ' ' '_')"
dmsetup remove kb
mkfull km /dev/vdg "$KM"
dd if=/tmp/pm of=/dev/mapper/km bs=65536 seek=16 oflag=direct conv=fsync 2>/dev/null
echo "ORACLE km-written $(md5sum < /tmp/pm | cut -d' ' -f1)"
echo "ORACLE km-table $(dmsetup table km | cut -d' ' -f5- | tr ' ' '_')"
dmsetup remove km
for n in dj:vdd:J dj-copy:vde:J db:vdf:B dm:vdi:DM; do
  name=${n%%:*}; rest=${n#*:}; dev=${rest%%:*}; mode=${rest#*:}
  case $mode in J) o="$J";; B) o="$B";; DM) o="$DM";; esac
  mkfull $name /dev/$dev "$o"
  echo "ORACLE $name-read $(rd $name)"
  echo "ORACLE $name-status $(st $name)"
  dmsetup remove $name
done
sync
"#
    );
    let refs: Vec<&Path> = disks.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &refs,
        &[
            ("ORACLE_MODULES", oracle::INTEGRITY_MODULES),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "600"),
        ],
    );
    let m = oracle::markers(&serial);
    // the kernel reads dmkit's devices, the live copy's journal replayed
    for (n, data, sbi) in [
        ("dj", &dj_data, 3),
        ("dj-copy", &dj_data, 4),
        ("db", &db_data, 5),
        ("dm", &dm_data, 9),
    ] {
        let p = provided(&disks[sbi]);
        assert_eq!(
            oracle::marker(&m, &format!("{n}-read")),
            oracle::md5(data),
            "the kernel reads dmkit's {n}"
        );
        assert_eq!(
            oracle::marker(&m, &format!("{n}-status")),
            format!("0_{p}_integrity_0_{p}_-"),
            "the kernel's status of dmkit's {n}: no mismatch"
        );
    }
    assert_eq!(oracle::marker(&m, "kj-read"), oracle::marker(&m, "kj-written"));
    // dmkit reads the kernel's devices: the live copy only from its journal
    zero_home(&disks[1], MIB / 512, 128);
    let jt = oracle::marker(&m, "kj-table");
    let km = oracle::marker(&m, "km-table");
    let kb = oracle::marker(&m, "kb-table");
    assert!(
        kb.starts_with("0_32_B_")
            && kb.contains("_block_size:4096_")
            && kb.contains("_internal_hash:hmac(sha256):"),
        "the kernel's bitmap table: {kb}"
    );
    for (i, n, opts, written, ktable) in [
        (0, "kj", journal_opts(), "kj-written", Some(jt)),
        (1, "kj-copy", journal_opts(), "kj-written", None),
        (2, "kb", bitmap_opts(), "kb-written", Some(kb)),
        (
            6,
            "km",
            meta_opts(&disks[7].display().to_string()),
            "km-written",
            Some(km),
        ),
    ] {
        let p = provided(&sb_image(&disks[i], &opts));
        let (got, status, table) = dmkit_reads(&format!("integrity-{n}"), &disks[i], &opts);
        assert_eq!(got, oracle::marker(&m, written), "dmkit reads the kernel's {n}");
        assert_eq!(
            status,
            format!("0 {p} integrity 0 {p} -"),
            "dmkit's status of {n}"
        );
        if let Some(k) = ktable {
            // the same options printed back, the devices aside
            let mine: Vec<&str> = table.split(' ').skip(4).collect();
            assert_eq!(
                without_meta(&mine.join("_")),
                without_meta(k),
                "dmkit prints the table as the kernel does"
            );
        }
    }
}
