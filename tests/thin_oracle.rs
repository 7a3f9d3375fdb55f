//! Kernel oracle for the dm-thin metadata format: a stock Debian kernel, booted
//! under qemu (tests/oracle/run.sh), reads pools that dmkit wrote and writes
//! pools that dmkit then reads. Both directions must agree byte for byte on the
//! contents of every thin device.
//!
//! A missing tool or a failed kernel download fails the test (ci/install.sh
//! installs and fetches them).

use crate::oracle;
use crate::thin_util;
use oracle::{marker, markers, md5, GUEST_HELPERS};
use thin_util::*;

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

const BLOCK_SECTORS: u32 = 128; // 64 KiB data blocks
const BLOCK_BYTES: u64 = BLOCK_SECTORS as u64 * 512;
const META_BLOCKS: u64 = 2048; // 8 MiB metadata
const DATA_BLOCKS: u64 = 256; // 16 MiB data
const THIN_BLOCKS: u64 = 128; // each thin device: 8 MiB
const THIN_SECTORS: u64 = THIN_BLOCKS * BLOCK_SECTORS as u64;
const POOL_SECTORS: u64 = DATA_BLOCKS * BLOCK_SECTORS as u64;

fn file_of(s: &Scratch, name: &str, bytes: u64) -> PathBuf {
    let p = s.path(name);
    std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
    p
}

fn read_data_block(data: &Path, b: u64) -> Vec<u8> {
    let mut f = std::fs::File::open(data).unwrap();
    let mut buf = vec![0u8; BLOCK_BYTES as usize];
    f.seek(SeekFrom::Start(b * BLOCK_BYTES)).unwrap();
    f.read_exact(&mut buf).unwrap();
    buf
}

fn write_data_block(data: &Path, b: u64, buf: &[u8]) {
    let mut f = std::fs::OpenOptions::new().write(true).open(data).unwrap();
    f.seek(SeekFrom::Start(b * BLOCK_BYTES)).unwrap();
    f.write_all(buf).unwrap();
}

fn pattern(seed: u64) -> Vec<u8> {
    let mut r = Rng::new(seed);
    (0..BLOCK_BYTES / 8)
        .flat_map(|_| r.next().to_le_bytes())
        .collect()
}

/// A thin device's contents as dmkit's mappings say: each mapped virtual block
/// read from the data image, unmapped ones zero. Uses `lookup` and checks it
/// against `mappings_in`.
fn contents(md: &mut dmkit::thin::ThinPoolMetadata, data: &Path, dev: u64) -> Vec<u8> {
    let mut walked = BTreeMap::new();
    md.mappings_in(dev, 0, u64::MAX, &mut |v, b, _| {
        walked.insert(v, b);
    })
    .unwrap();
    assert!(
        walked.keys().all(|&v| v < THIN_BLOCKS),
        "dev {dev} maps beyond the thin size: {walked:?}"
    );
    let mut out = Vec::with_capacity((THIN_BLOCKS * BLOCK_BYTES) as usize);
    let mut looked = BTreeMap::new();
    for v in 0..THIN_BLOCKS {
        match md.lookup(dev, v).unwrap() {
            Some(m) => {
                looked.insert(v, m.data_block);
                out.extend(read_data_block(data, m.data_block));
            }
            None => out.extend(std::iter::repeat_n(0u8, BLOCK_BYTES as usize)),
        }
    }
    assert_eq!(looked, walked, "lookup and mappings_in disagree for dev {dev}");
    out
}

/// `dmsetup status` of a thin as dmkit's device details and mappings imply.
fn thin_status(md: &mut dmkit::thin::ThinPoolMetadata, dev: u64) -> String {
    let mapped = md.mapped_blocks(dev).unwrap() * BLOCK_SECTORS as u64;
    let highest = match md.highest_mapped(dev).unwrap() {
        Some(v) => ((v + 1) * BLOCK_SECTORS as u64 - 1).to_string(),
        None => "-".to_string(),
    };
    format!("0 {THIN_SECTORS} thin {mapped} {highest}")
}

/// The counters of the pool's `dmsetup status` (transaction id, used/total
/// metadata blocks, used/total data blocks) as dmkit's space maps imply.
fn pool_counters(md: &dmkit::thin::ThinPoolMetadata) -> String {
    let total = md.nr_metadata_blocks();
    let reserve = (total / 10).min(4096);
    let used_meta = total - md.nr_free_metadata_blocks().saturating_sub(reserve);
    let data_total = md.nr_data_blocks();
    let used_data = data_total - md.nr_free_data_blocks();
    format!(
        "{} {used_meta}/{total} {used_data}/{data_total}",
        md.transaction_id()
    )
}

/// The same counters cut from a kernel pool status line.
fn kernel_pool_counters(status: &str) -> String {
    let f: Vec<&str> = status.split_whitespace().collect();
    assert_eq!(f.get(2), Some(&"thin-pool"), "not a pool status: {status}");
    f[3..6].join(" ")
}

/// thin_check, `dmkit thin check`, and thin_dump == `dmkit thin dump`.
fn assert_tools_agree(meta: &Path) {
    assert_thin_check_clean(meta);
    let st = Command::new(env!("CARGO_BIN_EXE_dmkit"))
        .args(["thin", "check"])
        .arg(meta)
        .output()
        .expect("dmkit thin check");
    assert!(
        st.status.success(),
        "dmkit thin check failed: {}",
        String::from_utf8_lossy(&st.stderr)
    );
    let ours = Command::new(env!("CARGO_BIN_EXE_dmkit"))
        .args(["thin", "dump"])
        .arg(meta)
        .output()
        .expect("dmkit thin dump");
    assert!(ours.status.success(), "dmkit thin dump failed");
    {
        let theirs = thin_dump(meta, false);
        assert_eq!(
            String::from_utf8(ours.stdout).unwrap(),
            theirs,
            "dmkit thin dump != thin_dump"
        );
    }
}

/// dmkit writes a pool (origin, snapshot, writes after the snapshot on both);
/// the kernel must read exactly the implied contents, then its own writes to
/// the pool must leave metadata that dmkit and thin_check read back.
#[test]
fn dmkit_pool_read_and_written_by_kernel() {
    let s = Scratch::new("oracle-d2k");
    let meta = file_of(&s, "meta.img", META_BLOCKS * 4096);
    let data = file_of(&s, "data.img", DATA_BLOCKS * BLOCK_BYTES);
    let mut md = format_file(&meta, DATA_BLOCKS);
    let mut seed = 1000;
    let mut put = |md: &mut dmkit::thin::ThinPoolMetadata, dev: u64, v: u64| {
        let b = md.alloc_data_block().unwrap();
        md.insert(dev, v, b).unwrap();
        seed += 1;
        write_data_block(&data, b, &pattern(seed));
    };
    md.create_thin(0).unwrap();
    for v in [0, 1, 2, 3, 4, 5, 6, 7, 31, 64, 127] {
        put(&mut md, 0, v);
    }
    md.commit().unwrap();
    md.create_snap(1, 0).unwrap();
    put(&mut md, 0, 3); // origin overwritten after the snapshot
    put(&mut md, 0, 90); // new in the origin only
    put(&mut md, 1, 5); // snapshot overwritten
    put(&mut md, 1, 100); // new in the snapshot only
    md.commit().unwrap();
    assert!(md.lookup(0, 0).unwrap().unwrap().shared);
    assert!(!md.lookup(0, 3).unwrap().unwrap().shared);
    let want0 = md5(&contents(&mut md, &data, 0));
    let want1 = md5(&contents(&mut md, &data, 1));
    let status0 = thin_status(&mut md, 0);
    let status1 = thin_status(&mut md, 1);
    let counters = pool_counters(&md);
    drop(md);
    assert_tools_agree(&meta);

    let script = format!(
        r#"{GUEST_HELPERS}
mk pool "0 {POOL_SECTORS} thin-pool /dev/vda /dev/vdb {BLOCK_SECTORS} 0 1 skip_block_zeroing"
mk thin0 "0 {THIN_SECTORS} thin /dev/mapper/pool 0"
mk thin1 "0 {THIN_SECTORS} thin /dev/mapper/pool 1"
echo "ORACLE md5-0 $(sum /dev/mapper/thin0)"
echo "ORACLE md5-1 $(sum /dev/mapper/thin1)"
echo "ORACLE status-0 $(dmsetup status thin0)"
echo "ORACLE status-1 $(dmsetup status thin1)"
echo "ORACLE pool-before $(dmsetup status pool)"
# the kernel now writes into the dmkit pool: a new block, a full overwrite of a
# shared block and a partial write into a shared block (copy then overwrite)
dd if=/dev/urandom of=/dev/mapper/thin0 bs=65536 seek=10 count=1 conv=notrunc 2>/dev/null
dd if=/dev/urandom of=/dev/mapper/thin1 bs=65536 seek=0 count=1 conv=notrunc 2>/dev/null
dd if=/dev/urandom of=/dev/mapper/thin1 bs=4096 seek=$((7*16+3)) count=1 conv=notrunc 2>/dev/null
sync
echo "ORACLE after-0 $(sum /dev/mapper/thin0)"
echo "ORACLE after-1 $(sum /dev/mapper/thin1)"
echo "ORACLE pool-after $(dmsetup status pool)"
dmsetup remove thin0
dmsetup remove thin1
dmsetup remove pool
echo "ORACLE removed yes"
"#
    );
    let serial = oracle::run(&s.dir, &script, &[&meta, &data]);
    let m = markers(&serial);
    assert_eq!(marker(&m, "md5-0"), want0, "kernel reads thin 0 differently");
    assert_eq!(marker(&m, "md5-1"), want1, "kernel reads thin 1 differently");
    assert_eq!(marker(&m, "status-0"), status0);
    assert_eq!(marker(&m, "status-1"), status1);
    assert_eq!(kernel_pool_counters(marker(&m, "pool-before")), counters);
    assert_eq!(marker(&m, "removed"), "yes");

    // and back: the kernel's updates to the dmkit pool
    assert_tools_agree(&meta);
    let mut md = open_file(&meta);
    assert_eq!(md.devices(), vec![0, 1]);
    assert_eq!(md5(&contents(&mut md, &data, 0)), marker(&m, "after-0"));
    assert_eq!(md5(&contents(&mut md, &data, 1)), marker(&m, "after-1"));
    assert_eq!(md.mapped_blocks(0).unwrap(), 13);
    assert_eq!(md.mapped_blocks(1).unwrap(), 12);
    assert!(!md.lookup(1, 0).unwrap().unwrap().shared);
    assert_eq!(pool_counters(&md), kernel_pool_counters(marker(&m, "pool-after")));
}

/// The kernel makes a pool from zeroed metadata (thin, writes, snapshot,
/// writes that break sharing); dmkit must read the same contents from it.
#[test]
fn kernel_pool_read_by_dmkit() {
    let s = Scratch::new("oracle-k2d");
    let meta = file_of(&s, "meta.img", META_BLOCKS * 4096);
    let data = file_of(&s, "data.img", DATA_BLOCKS * BLOCK_BYTES);
    let script = format!(
        r#"{GUEST_HELPERS}
w() {{ dd if=/dev/urandom of=/dev/mapper/thin0 bs=$1 seek=$2 count=$3 conv=notrunc 2>/dev/null; }}
mk pool "0 {POOL_SECTORS} thin-pool /dev/vda /dev/vdb {BLOCK_SECTORS} 0 0"
dmsetup message pool 0 "create_thin 0"
mk thin0 "0 {THIN_SECTORS} thin /dev/mapper/pool 0"
w 65536 0 10
w 65536 20 1
w 65536 50 10
w 4096 $((100*16+5)) 1
sync
echo "ORACLE before-0 $(sum /dev/mapper/thin0)"
dmsetup suspend thin0
dmsetup message pool 0 "create_snap 1 0"
dmsetup resume thin0
w 65536 5 1
w 4096 $((55*16+3)) 1
w 65536 70 1
sync
mk thin1 "0 {THIN_SECTORS} thin /dev/mapper/pool 1"
echo "ORACLE md5-0 $(sum /dev/mapper/thin0)"
echo "ORACLE md5-1 $(sum /dev/mapper/thin1)"
echo "ORACLE status-0 $(dmsetup status thin0)"
echo "ORACLE status-1 $(dmsetup status thin1)"
echo "ORACLE pool $(dmsetup status pool)"
dmsetup remove thin1
dmsetup remove thin0
dmsetup remove pool
echo "ORACLE removed yes"
"#
    );
    let serial = oracle::run(&s.dir, &script, &[&meta, &data]);
    let m = markers(&serial);
    assert_eq!(marker(&m, "removed"), "yes");
    assert_eq!(
        marker(&m, "md5-1"),
        marker(&m, "before-0"),
        "snapshot differs from the origin it was taken of"
    );

    assert_tools_agree(&meta);
    let mut md = open_file(&meta);
    assert_eq!(md.devices(), vec![0, 1]);
    assert_eq!(md.data_block_size(), BLOCK_SECTORS);
    assert_eq!(md.nr_data_blocks(), DATA_BLOCKS);
    assert_eq!(md.mapped_blocks(0).unwrap(), 23);
    assert_eq!(md.mapped_blocks(1).unwrap(), 22);
    assert_eq!(
        md5(&contents(&mut md, &data, 0)),
        marker(&m, "md5-0"),
        "dmkit reads thin 0 differently"
    );
    assert_eq!(
        md5(&contents(&mut md, &data, 1)),
        marker(&m, "md5-1"),
        "dmkit reads thin 1 differently"
    );
    assert_eq!(thin_status(&mut md, 0), marker(&m, "status-0"));
    assert_eq!(thin_status(&mut md, 1), marker(&m, "status-1"));
    assert_eq!(pool_counters(&md), kernel_pool_counters(marker(&m, "pool")));
    // blocks the snapshot still shares with the origin, and the ones broken
    for v in [0, 20, 50, 100] {
        let a = md.lookup(0, v).unwrap().unwrap();
        let b = md.lookup(1, v).unwrap().unwrap();
        assert_eq!(a.data_block, b.data_block, "vblock {v} should still be shared");
        assert!(md.is_data_block_shared(a.data_block));
    }
    for v in [5, 55] {
        let a = md.lookup(0, v).unwrap().unwrap();
        let b = md.lookup(1, v).unwrap().unwrap();
        assert_ne!(a.data_block, b.data_block, "vblock {v} should have been unshared");
        assert!(!a.shared);
    }
    assert!(md.lookup(1, 70).unwrap().is_none());

    // dmkit can go on from the kernel's metadata: a write that breaks sharing
    let b = md.alloc_data_block().unwrap();
    md.insert(1, 0, b).unwrap();
    md.commit().unwrap();
    drop(md);
    assert_tools_agree(&meta);
}
