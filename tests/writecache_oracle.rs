//! Kernel oracle for the writecache format (D.11): one boot of a stock Debian
//! kernel (tests/oracle/run.sh). The kernel's dm-writecache opens caches that
//! dmkit left dirty (written in ssd mode, and in pmem mode, whose layout is the
//! same; the guest has no persistent memory, so it opens both as `s`), reads the
//! same data through them and writes it back to the origin on `flush`; and it
//! leaves a cache dirty that dmkit then opens, serves and writes back.

use crate::common;
use crate::oracle;

use common::nbd::{Client, FLUSH};
use common::{image, pattern, read_all, read_at, Daemon, Scratch};
use oracle::{marker, markers, md5, GUEST_HELPERS};
use std::path::Path;

use common::MIB;
const SIZE: u64 = 8 * MIB;
const SECTORS: u64 = SIZE / 512;
const BS: u64 = 4096;

/// The first four status fields: error, total blocks, free blocks, blocks
/// under writeback (the rest are counters of this instance's I/O).
fn state(status: &str) -> Vec<String> {
    let f: Vec<&str> = status.split_whitespace().collect();
    assert!(f.len() >= 7, "writecache status: {status}");
    f[3..7].iter().map(|s| s.to_string()).collect()
}

/// Leave a cache dirty with dmkit in `mode`: scattered and overwritten blocks,
/// runs of several blocks, all flushed, then SIGKILL. What the device reads as.
fn dmkit_dirty(origin: &Path, cache: &Path, mode: &str, seed: u64) -> (Vec<u8>, String) {
    let mut d = Daemon::start(&format!("wc-oracle-{mode}"));
    d.create(
        "wc",
        &format!(
            "0 {SECTORS} writecache {mode} {} {} 4096 0",
            origin.display(),
            cache.display()
        ),
    );
    let mut c = Client::connect(&d.sock(), "wc");
    let nb = SIZE / BS;
    for i in 0..200u64 {
        let b = (i * 7919 + seed) % (nb - 4);
        let n = 1 + i % 3;
        c.write(b * BS, &pattern(seed * 1000 + i, (n * BS) as usize));
        if i % 40 == 0 {
            assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
        }
    }
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    let data = read_all(&mut c, SIZE);
    let st = d.ok(&["status", "wc"]).trim().to_string();
    let s = state(&st);
    assert_ne!(s[1], s[2], "dmkit holds dirty blocks: {st}");
    drop(c);
    d.kill9();
    (data, st)
}

#[test]
fn caches_cross_between_dmkit_and_the_kernel() {
    let s = Scratch::new("wc-oracle");
    // A and P: dmkit leaves a cache dirty (ssd, pmem); the kernel reads and flushes
    let oa = image(&s, "oa.img", SIZE, Some(21));
    let ca = image(&s, "ca.img", 4 * MIB, None);
    let op = image(&s, "op.img", SIZE, Some(22));
    let cp = image(&s, "cp.img", 4 * MIB, None);
    // K: the kernel leaves a cache dirty, dmkit reads and flushes
    let ok = image(&s, "ok.img", SIZE, Some(23));
    let ck = image(&s, "ck.img", 4 * MIB, None);

    let (a_data, a_status) = dmkit_dirty(&oa, &ca, "s", 1);
    let (p_data, p_status) = dmkit_dirty(&op, &cp, "p", 2);
    let a_origin = md5(&read_at(&oa, 0, SIZE as usize));
    assert_ne!(a_origin, md5(&a_data), "the dirty data is only in the cache");

    let script = format!(
        r#"{GUEST_HELPERS}
check() {{
  n=$1; o=$2; c=$3
  mk w$n "0 {SECTORS} writecache s /dev/$o /dev/$c 4096 0"
  echo "ORACLE $n-status $(dmsetup status w$n)"
  echo "ORACLE $n-data $(sum /dev/mapper/w$n)"
  dmsetup message w$n 0 flush
  echo "ORACLE $n-flushed $(dmsetup status w$n)"
  dmsetup remove w$n
  echo "ORACLE $n-origin $(sum /dev/$o)"
}}
check a vda vdb
check p vdc vdd
mk wk "0 {SECTORS} writecache s /dev/vde /dev/vdf 4096 0"
i=0
while [ $i -lt 150 ]; do
  dd if=/dev/urandom of=/dev/mapper/wk bs=4096 seek=$((i*13 % 2040)) count=$((1 + i % 3)) conv=notrunc 2>/dev/null
  i=$((i+1))
done
sync
echo "ORACLE k-data $(sum /dev/mapper/wk)"
echo "ORACLE k-status $(dmsetup status wk)"
dmsetup remove wk
echo "ORACLE k-origin $(sum /dev/vde)"
echo "ORACLE done yes"
"#
    );
    let disks: Vec<&Path> = vec![&oa, &ca, &op, &cp, &ok, &ck];
    let serial = oracle::run(&s.0, &script, &disks);
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    for (n, data, st, origin) in [("a", &a_data, &a_status, &oa), ("p", &p_data, &p_status, &op)] {
        // the kernel finds the same blocks dirty and reads the same device
        assert_eq!(
            state(marker(&m, &format!("{n}-status"))),
            state(st),
            "{n}: the kernel's status of dmkit's cache"
        );
        assert_eq!(
            marker(&m, &format!("{n}-data")),
            md5(data),
            "{n}: the kernel reads dmkit's cache differently"
        );
        // and writes it all back
        let f = state(marker(&m, &format!("{n}-flushed")));
        assert_eq!(f[1], f[2], "{n}: dirty blocks left after the kernel's flush");
        assert_eq!(
            marker(&m, &format!("{n}-origin")),
            md5(data),
            "{n}: origin in the guest"
        );
        assert_eq!(
            md5(&read_at(origin, 0, SIZE as usize)),
            md5(data),
            "{n}: origin image"
        );
    }

    // K: dmkit opens the cache the kernel left dirty
    let k_data = marker(&m, "k-data").to_string();
    assert_ne!(marker(&m, "k-origin"), k_data, "the kernel left blocks dirty");
    let d = Daemon::start("wc-oracle-k");
    d.create(
        "wk",
        &format!(
            "0 {SECTORS} writecache s {} {} 4096 0",
            ok.display(),
            ck.display()
        ),
    );
    let st = d.ok(&["status", "wk"]);
    assert_eq!(
        state(&st),
        state(marker(&m, "k-status")),
        "status of the kernel's cache"
    );
    let mut c = Client::connect(&d.sock(), "wk");
    assert_eq!(
        md5(&read_all(&mut c, SIZE)),
        k_data,
        "dmkit reads the kernel's cache"
    );
    d.ok(&["message", "wk", "0", "flush"]);
    let st = state(&d.ok(&["status", "wk"]));
    assert_eq!(st[1], st[2], "dirty blocks after dmkit's flush");
    assert_eq!(
        md5(&read_at(&ok, 0, SIZE as usize)),
        k_data,
        "origin after dmkit's flush"
    );
}
