//! Kernel oracle for dm-cache: Linux 6.12's dm-cache (with dm-cache-smq),
//! booted under qemu (tests/oracle/run.sh), opens caches dmkit left with dirty
//! blocks (metadata version 1 after a clean shutdown, version 2 after a
//! SIGKILL), reads the same data as dmkit showed, and its `cleaner` writes the
//! dirty blocks back so the origin alone holds that data; and dmkit opens a
//! cache the kernel made and left dirty, reads the kernel's data, and its own
//! cleaner makes the origin match. The reference tools check both.
//!
//! And ext4 mounted through dmkit's cache in the guest (ublk): files, md5s,
//! `e2fsck -fn` clean; then `cleaner` until nothing is dirty, the cache retired
//! to a linear over the origin as `lvconvert --splitcache` does, and the bare
//! origin mounted: the same files, clean.
//!
//! A missing tool or a failed kernel download fails the test (ci/install.sh
//! installs and fetches them).

use crate::common;
use crate::oracle;
use crate::thin_util;

use common::nbd::Client;
use common::{pattern, read_all, tool_path, Daemon, Rng, Scratch, BIN};
use oracle::{marker, markers, md5, DMKIT_GUEST, EXT4_UBLK_MODULES, GUEST_HELPERS};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::MIB;
const BLOCK: u64 = 64 << 10;
const ORIGIN: u64 = 32 * MIB;
const SECTORS: u64 = ORIGIN / 512;
const HOT: [u64; 8] = [3, 4, 5, 40, 41, 100, 200, 201];

fn ok(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Both checks pass on `meta`.
fn checks_pass(meta: &Path) {
    ok(Command::new(BIN).args(["cache", "check"]).arg(meta));
    ok(Command::new(thin_util::tool("cache_check")).arg(meta));
}

/// Both checks pass and both dumps agree on `meta`.
fn tools_agree(meta: &Path) {
    checks_pass(meta);
    let ours = ok(Command::new(BIN).args(["cache", "dump"]).arg(meta));
    let theirs = ok(Command::new(thin_util::tool("cache_dump")).arg(meta));
    assert_eq!(ours, theirs, "cache_dump of {}", meta.display());
}

/// (used cache blocks, dirty) of a status line `0 <len> cache ...`.
fn used_dirty(status: &str) -> (u64, u64) {
    let f: Vec<&str> = status.split_whitespace().collect();
    assert_eq!(f.get(2), Some(&"cache"), "status: {status}");
    let used = f[6].split_once('/').expect("used/total").0.parse().expect("used");
    (used, f[13].parse().expect("dirty"))
}

fn table(meta: &Path, cache: &Path, origin: &Path, features: &str, policy: &str) -> String {
    format!(
        "0 {SECTORS} cache {} {} {} 128 {features} {policy}",
        meta.display(),
        cache.display(),
        origin.display()
    )
}

/// A cache dmkit fills: the hot set promoted and partly rewritten (dirty),
/// then removed (`kill`: SIGKILLed instead). What it showed, and (mapped
/// blocks the metadata holds, dirty blocks).
fn dmkit_leaves_dirty(s: &Scratch, tag: &str, features: &str, kill: bool) -> (Vec<u8>, (u64, u64)) {
    let meta = s.sparse(&format!("{tag}-meta"), 4 * MIB);
    let cache = s.sparse(&format!("{tag}-cache"), 4 * MIB);
    let origin = s.path(&format!("{tag}-origin"));
    let mut view = pattern(31, ORIGIN as usize);
    std::fs::write(&origin, &view).unwrap();
    let mut d = Daemon::start(tag);
    d.create("c", &table(&meta, &cache, &origin, features, "smq 0"));
    let mut c = Client::connect(&d.sock(), "c");
    let mut rng = Rng(0x0c0ffee);
    let t0 = Instant::now();
    // warm until as many blocks as the hot set are cached, then rewrite part
    // of each hot block; again while fewer of them turned dirty (the blocks
    // promoted first may be cold ones, or still on their way)
    let st = loop {
        let st = used_dirty(&d.ok(&["status", "c"]));
        assert!(t0.elapsed() < Duration::from_secs(30), "not promoted: {st:?}");
        if st.0 < HOT.len() as u64 {
            for _ in 0..40 {
                c.read(rng.below(ORIGIN / BLOCK) * BLOCK, 4096);
            }
            for &b in &HOT {
                c.read(b * BLOCK, 4096);
            }
            std::thread::sleep(Duration::from_millis(30));
            continue;
        }
        for (i, &b) in HOT.iter().enumerate() {
            let (off, data) = (b * BLOCK + 8192, pattern(900 + i as u64, 4096));
            c.write(off, &data);
            view[off as usize..off as usize + 4096].copy_from_slice(&data);
        }
        assert_eq!(c.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
        let st = used_dirty(&d.ok(&["status", "c"]));
        if st.1 >= HOT.len() as u64 {
            break st;
        }
        for &b in &HOT {
            c.read(b * BLOCK, 4096);
        }
        std::thread::sleep(Duration::from_millis(30));
    };
    assert!(st.1 >= HOT.len() as u64, "{tag}: dirty blocks {st:?}");
    // (no more reads: on a full cache they would promote, and demote, and
    // write dirty blocks back to make room)
    for &b in &HOT {
        assert!(c.read(b * BLOCK, BLOCK as usize) == view[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize]);
    }
    drop(c);
    if kill {
        d.kill9();
        // never shut down cleanly: no hints saved yet, which 1.x's cache_dump
        // cannot read (as on the kernel's); the checks pass
        checks_pass(&meta);
    } else {
        d.ok(&["remove", "c"]);
        tools_agree(&meta);
    }
    // what the metadata holds: (mapped, marked dirty)
    let dump = ok(Command::new(BIN).args(["cache", "dump"]).arg(&meta));
    let held = (
        dump.matches("<mapping ").count() as u64,
        dump.matches("dirty=\"true\"").count() as u64,
    );
    assert!(held.0 >= st.0, "{tag}: {held:?} mapped, {st:?} before");
    // killed: the dirty bits on disk are the last clean shutdown's (none), and
    // every mapped block counts as dirty; the live count says what was dirty
    (view, if kill { (held.0, st.1) } else { held })
}

#[test]
fn the_kernel_and_dmkit_open_each_others_dirty_caches() {
    let s = Scratch::new("cache-oracle");
    let (view1, st1) = dmkit_leaves_dirty(&s, "v1", "1 writeback", false);
    let (view2, st2) = dmkit_leaves_dirty(&s, "v2", "2 metadata2 writeback", true);
    let meta3 = s.sparse("k-meta", 4 * MIB);
    let cache3 = s.sparse("k-cache", 4 * MIB);
    let origin3 = s.path("k-origin");
    std::fs::write(&origin3, pattern(32, ORIGIN as usize)).unwrap();
    let p = |n: &str| s.path(n);
    let disks = [
        p("v1-meta"),
        p("v1-cache"),
        p("v1-origin"),
        p("v2-meta"),
        p("v2-cache"),
        p("v2-origin"),
        meta3.clone(),
        cache3.clone(),
        origin3.clone(),
    ];
    let hot = HOT.map(|b| b.to_string()).join(" ");
    let script = format!(
        r#"{GUEST_HELPERS}
dirty() {{ dmsetup status "$1" | cut -d' ' -f14; }}
clean() {{
  dmsetup reload "$1" --table "$2"
  dmsetup suspend "$1"; dmsetup resume "$1"
  n=0; while [ "$(dirty "$1")" != 0 ] && [ $n -lt 300 ]; do sleep 1; n=$((n+1)); done
}}
for v in 1 2; do
  if [ $v = 1 ]; then M=/dev/vda; C=/dev/vdb; O=/dev/vdc; F="1 writeback"; else M=/dev/vdd; C=/dev/vde; O=/dev/vdf; F="2 metadata2 writeback"; fi
  mk c$v "0 {SECTORS} cache $M $C $O 128 $F smq 0"
  echo "ORACLE status-$v $(dmsetup status c$v)"
  echo "ORACLE view-$v $(sum /dev/mapper/c$v)"
  clean c$v "0 {SECTORS} cache $M $C $O 128 $F cleaner 0"
  echo "ORACLE clean-$v $(dirty c$v)"
  dmsetup remove c$v
  echo "ORACLE origin-$v $(sum $O)"
done
mk k "0 {SECTORS} cache /dev/vdg /dev/vdh /dev/vdi 128 1 writeback smq 0"
for i in 1 2 3 4 5 6 7 8; do
  for b in {hot}; do dd if=/dev/mapper/k of=/dev/null bs=65536 skip=$b count=1 2>/dev/null; done
  echo 3 > /proc/sys/vm/drop_caches; sleep 1
done
for b in {hot}; do dd if=/dev/urandom of=/dev/mapper/k bs=4096 seek=$((b*16+3)) count=1 conv=notrunc 2>/dev/null; done
sync
echo "ORACLE view-k $(sum /dev/mapper/k)"
# suspended, smq writes nothing back any more and the metadata is committed:
# the status is then what the metadata holds at the remove
dmsetup suspend k
echo "ORACLE status-k $(dmsetup status k)"
dmsetup remove k
echo "ORACLE removed yes"
"#
    );
    let refs: Vec<&Path> = disks.iter().map(|d| d.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &refs,
        &[
            (
                "ORACLE_MODULES",
                "drivers/md/dm-cache.ko drivers/md/dm-cache-smq.ko",
            ),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "900"),
        ],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "removed"), "yes", "{serial}");

    // dmkit's caches in the kernel: the same blocks cached, the same data, and
    // after its cleaner the origin alone holds it
    for (v, view, st) in [("1", &view1, st1), ("2", &view2, st2)] {
        let (used, dirty) = used_dirty(marker(&m, &format!("status-{v}")));
        assert_eq!(used, st.0, "v{v}: the kernel's used blocks");
        // (the kernel's device is idle from the start: its smq may already be
        // writing dirty blocks back when the status is taken; that the dirty
        // ones were taken as dirty shows in the origin after its cleaner)
        assert!(st.1 >= HOT.len() as u64, "v{v}: dmkit left dirty blocks: {st:?}");
        assert!(
            dirty <= if v == "1" { st.1 } else { used },
            "v{v}: the kernel's dirty count {dirty}"
        );
        assert_eq!(
            marker(&m, &format!("view-{v}")),
            md5(view),
            "v{v}: the kernel reads dmkit's data"
        );
        assert_eq!(marker(&m, &format!("clean-{v}")), "0");
        assert_eq!(
            marker(&m, &format!("origin-{v}")),
            md5(view),
            "v{v}: the origin after the kernel's cleaner"
        );
        tools_agree(&s.path(&format!("v{v}-meta")));
    }

    // the kernel's cache in dmkit: the same blocks and dirty bits, the same
    // data (its status taken suspended, when smq writes nothing back any more);
    // dmkit's cleaner makes the origin hold it
    tools_agree(&meta3);
    let kst = used_dirty(marker(&m, "status-k"));
    let d = Daemon::start("cache-oracle-k");
    d.create("c", &table(&meta3, &cache3, &origin3, "1 writeback", "smq 0"));
    assert_eq!(
        used_dirty(&d.ok(&["status", "c"])),
        kst,
        "the kernel's cache in dmkit"
    );
    let mut c = Client::connect(&d.sock(), "c");
    assert_eq!(
        md5(&read_all(&mut c, ORIGIN)),
        marker(&m, "view-k"),
        "dmkit reads the kernel's data"
    );
    drop(c);
    d.ok(&[
        "load",
        "c",
        "--table",
        &table(&meta3, &cache3, &origin3, "1 writeback", "cleaner 0"),
    ]);
    d.ok(&["suspend", "c"]);
    d.ok(&["resume", "c"]);
    let t0 = Instant::now();
    while used_dirty(&d.ok(&["status", "c"])).1 != 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "dmkit's cleaner");
        std::thread::sleep(Duration::from_millis(50));
    }
    d.ok(&["remove", "c"]);
    assert_eq!(
        md5(&std::fs::read(&origin3).unwrap()),
        marker(&m, "view-k"),
        "the origin after dmkit's cleaner"
    );
    tools_agree(&meta3);
}

/// ext4 through dmkit's cache (writeback, smq) attached with ublk in the 6.12
/// guest: mkfs, files written and read back, `e2fsck -fn` clean; `cleaner`
/// loaded until nothing is dirty; the table replaced by a linear over the
/// origin (`lvconvert --splitcache`) and the filesystem mounted through it;
/// then the origin disk alone mounted: the same files, and clean.
#[test]
fn ext4_through_the_cache_then_retired_to_the_bare_origin() {
    let s = Scratch::new("cache-ext4");
    let origin_bytes = 128 * MIB;
    let disks = [
        s.sparse("meta.img", 8 * MIB),
        s.sparse("cache.img", 16 * MIB),
        s.sparse("origin.img", origin_bytes),
    ];
    let bins = [BIN.to_string(), tool_path("mke2fs"), tool_path("e2fsck")].join(" ");
    let sectors = origin_bytes / 512;
    let cache =
        |policy: &str| format!("0 {sectors} cache /dev/vda /dev/vdb /dev/vdc 128 1 writeback {policy} 0");
    let (smq, cleaner) = (cache("smq"), cache("cleaner"));
    let script = format!(
        r#"
set -e
{DMKIT_GUEST}
start
dirty() {{ $D status c | cut -d' ' -f14; }}
fsck() {{ e2fsck -fn $1 > /tmp/fsck 2>&1 && echo clean || {{ echo dirty; cat /tmp/fsck >&2; }}; }}
same() {{ echo 3 > /proc/sys/vm/drop_caches; (cd /mnt && md5sum -c /tmp/sums > /dev/null 2>&1) && echo same || echo differ; }}
reload() {{ $D load c --table "$1"; $D suspend c; $D resume c; }}
$D create c --table "{smq}"
echo "ORACLE attached $($D attach c)"
mkfs.ext4 -q -F /dev/mapper/c
mount -t ext4 /dev/mapper/c /mnt
for f in 1 2 3 4 5 6; do dd if=/dev/urandom of=/mnt/f$f bs=64k count=$((f * 16)) 2>/dev/null; done
sync
(cd /mnt && md5sum f1 f2 f3 f4 f5 f6) > /tmp/sums
# rewrite part of two files in place: blocks already cached turn dirty
dd if=/dev/urandom of=/mnt/f1 bs=4k count=16 seek=3 conv=notrunc,fsync 2>/dev/null
dd if=/dev/urandom of=/mnt/f2 bs=4k count=16 seek=40 conv=notrunc,fsync 2>/dev/null
(cd /mnt && md5sum f1 f2 f3 f4 f5 f6) > /tmp/sums
echo "ORACLE md5-written $(same)"
umount /mnt
echo "ORACLE status-cache $($D status c)"
echo "ORACLE fsck-cache $(fsck /dev/mapper/c)"
mount -t ext4 /dev/mapper/c /mnt
echo "ORACLE md5-cache $(same)"
umount /mnt
reload "{cleaner}"
n=0; while [ "$(dirty)" != 0 ] && [ $n -lt 600 ]; do sleep 0.2; n=$((n+1)); done
echo "ORACLE cleaned $(dirty) $($D status c | cut -d' ' -f20)"
reload "0 {sectors} linear /dev/vdc 0"
echo "ORACLE retired $($D table c)"
mount -t ext4 /dev/mapper/c /mnt
echo "ORACLE md5-linear $(same)"
umount /mnt
$D detach c
$D remove c
mount -t ext4 /dev/vdc /mnt
echo "ORACLE md5-origin $(same)"
umount /mnt
echo "ORACLE fsck-origin $(fsck /dev/vdc)"
echo "ORACLE log-errors $(grep -ci "panic\|error" /tmp/dmkit.log)"
"#
    );
    let env = [
        ("ORACLE_BINS", bins.as_str()),
        ("ORACLE_MODULES", EXT4_UBLK_MODULES),
        ("DMKIT_ORACLE_KERNEL", "6.12"),
        ("DMKIT_ORACLE_TIMEOUT", "600"),
    ];
    let paths: Vec<&Path> = disks.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(&s.0, &script, &paths, &env);
    let m = markers(&serial);
    assert!(
        marker(&m, "attached").starts_with("/dev/ublkb"),
        "{}",
        marker(&m, "attached")
    );
    for (k, want) in [
        ("md5-written", "same"),
        ("fsck-cache", "clean"),
        ("md5-cache", "same"),
        ("md5-linear", "same"),
        ("md5-origin", "same"),
        ("fsck-origin", "clean"),
        ("log-errors", "0"),
    ] {
        assert_eq!(marker(&m, k), want, "{k}");
    }
    // the filesystem went through the cache: blocks promoted, some dirty
    let (used, dirty) = used_dirty(marker(&m, "status-cache"));
    let f: Vec<&str> = marker(&m, "status-cache").split_whitespace().collect();
    let promotions: u64 = f[12].parse().expect("promotions");
    assert!(
        used > 0 && promotions > 0 && dirty > 0,
        "status with the filesystem written: {f:?}"
    );
    // the cleaner left nothing dirty, and said so as the cleaner
    assert_eq!(marker(&m, "cleaned"), "0 cleaner", "after the cleaner");
    // a linear over the origin disk (vdc: minor 32 of virtio_blk's major)
    let retired = marker(&m, "retired");
    assert!(
        retired.starts_with(&format!("0 {sectors} linear ")) && retired.ends_with(":32 0"),
        "the retired table: {retired}"
    );
}
