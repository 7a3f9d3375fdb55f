//! Kernel oracle for the snapshot COW format (D.6): one boot of a stock Debian
//! kernel (tests/oracle/run.sh) reads a COW store dmkit wrote, finishes a merge
//! dmkit began (and was SIGKILLed in), and writes a COW store that dmkit then
//! reads. Contents are compared by md5, status lines as printed.

use crate::common;
use crate::oracle;

use common::nbd::{Client, FLUSH};
use common::{image, pattern, read_at, Daemon, Scratch};
use oracle::{marker, markers, md5, GUEST_HELPERS};
use std::path::Path;
use std::time::Duration;

use common::MIB;
const SIZE: u64 = 8 * MIB;
const SECTORS: u64 = SIZE / 512;

fn read_all(c: &mut Client) -> Vec<u8> {
    (0..SIZE / MIB)
        .flat_map(|i| c.read(i * MIB, MIB as usize))
        .collect()
}

fn status(d: &Daemon, name: &str) -> String {
    d.ok(&["status", name]).trim().to_string()
}

#[test]
fn cow_stores_cross_between_dmkit_and_the_kernel() {
    let s = Scratch::new("snap-oracle");
    // A: dmkit writes a store over several metadata areas (2 KiB chunks: 128
    // exceptions per area), the kernel reads it
    let oa = image(&s, "oa.img", SIZE, Some(11));
    let ca = image(&s, "ca.img", 4 * MIB, None);
    // B: dmkit starts a merge and dies; the kernel finishes it
    let ob = image(&s, "ob.img", SIZE, Some(12));
    let cb = image(&s, "cb.img", 4 * MIB, None);
    // C: the kernel writes a store, dmkit reads it
    let oc = image(&s, "oc.img", SIZE, Some(13));
    let cc = image(&s, "cc.img", 4 * MIB, None);

    let mut d = Daemon::start("snap-oracle");
    let (a_snap, a_status) = {
        d.create("lv", &format!("0 {SECTORS} snapshot-origin {}", oa.display()));
        d.create(
            "sn",
            &format!("0 {SECTORS} snapshot {} {} P 4", oa.display(), ca.display()),
        );
        let mut lv = Client::connect(&d.sock(), "lv");
        let mut sn = Client::connect(&d.sock(), "sn");
        for i in 0..450u64 {
            lv.write((i * 7919 % (SIZE / 2048)) * 2048, &pattern(100 + i, 2048));
        }
        for i in 0..30u64 {
            sn.write(((i * 104729) % (SIZE / 512 - 8)) * 512, &pattern(900 + i, 1024));
        }
        sn.write(6 * MIB, &pattern(999, 4096)); // whole chunks, no copy
        assert_eq!(sn.call(FLUSH, 0, 0, 0, &[]), 0);
        let snap = read_all(&mut sn);
        let st = status(&d, "sn");
        drop((lv, sn));
        d.remove_closed("sn");
        d.remove_closed("lv");
        (snap, st)
    };
    let b_model = {
        d.create("lv", &format!("0 {SECTORS} snapshot-origin {}", ob.display()));
        d.create(
            "sn",
            &format!("0 {SECTORS} snapshot {} {} P 8", ob.display(), cb.display()),
        );
        let mut lv = Client::connect(&d.sock(), "lv");
        let mut sn = Client::connect(&d.sock(), "sn");
        for i in 0..150u64 {
            lv.write(i * 8192, &pattern(300 + i, 4096));
        }
        sn.write(5 * MIB + 512, &pattern(301, 3072));
        assert_eq!(sn.call(FLUSH, 0, 0, 0, &[]), 0);
        let model = read_all(&mut sn);
        drop((lv, sn));
        d.create(
            "slow",
            &format!("0 {SECTORS} delay {o} 0 0 {o} 0 20", o = ob.display()),
        );
        d.remove_closed("sn");
        d.remove_closed("lv");
        d.create(
            "m",
            &format!("0 {SECTORS} snapshot-merge /dev/mapper/slow {} P 8", cb.display()),
        );
        std::thread::sleep(Duration::from_millis(600));
        let st = status(&d, "m");
        let f: Vec<&str> = st.split_whitespace().collect();
        let alloc: u64 = f[3].split('/').next().unwrap().parse().unwrap();
        assert!(
            alloc > f[4].parse::<u64>().unwrap(),
            "merge should be part-way: {st}"
        );
        d.kill9();
        model
    };

    let script = format!(
        r#"{GUEST_HELPERS}
mk sa "0 {SECTORS} snapshot /dev/vda /dev/vdb P 4"
echo "ORACLE a-status $(dmsetup status sa)"
echo "ORACLE a-snap $(sum /dev/mapper/sa)"
dmsetup remove sa
mk mb "0 {SECTORS} snapshot-merge /dev/vdc /dev/vdd P 8"
i=0
while [ $i -lt 600 ]; do
  set -- $(dmsetup status mb)
  [ "${{4%/*}}" = "$5" ] && break
  i=$((i+1)); sleep 0.1
done
echo "ORACLE b-status $(dmsetup status mb)"
echo "ORACLE b-merged $(sum /dev/mapper/mb)"
dmsetup remove mb
mk oc "0 {SECTORS} snapshot-origin /dev/vde"
mk sc "0 {SECTORS} snapshot /dev/vde /dev/vdf P 4"
# as LVM does: the origin resumes after a snapshot is added (its split size)
dmsetup suspend oc
dmsetup resume oc
i=0
while [ $i -lt 300 ]; do
  dd if=/dev/urandom of=/dev/mapper/oc bs=2048 seek=$((i*11)) count=1 conv=notrunc 2>/dev/null
  i=$((i+1))
done
dd if=/dev/urandom of=/dev/mapper/sc bs=1024 seek=7 count=1 conv=notrunc 2>/dev/null
dd if=/dev/urandom of=/dev/mapper/sc bs=2048 seek=3000 count=3 conv=notrunc 2>/dev/null
sync
echo "ORACLE c-origin $(sum /dev/mapper/oc)"
echo "ORACLE c-snap $(sum /dev/mapper/sc)"
echo "ORACLE c-status $(dmsetup status sc)"
dmsetup remove sc
dmsetup remove oc
echo "ORACLE done yes"
"#
    );
    let disks: Vec<&Path> = vec![&oa, &ca, &ob, &cb, &oc, &cc];
    let serial = oracle::run(&s.0, &script, &disks);
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    // A: the kernel reads dmkit's store as dmkit does
    assert_eq!(
        marker(&m, "a-snap"),
        md5(&a_snap),
        "kernel reads the dmkit snapshot differently"
    );
    assert_eq!(
        marker(&m, "a-status"),
        a_status,
        "status of dmkit's store in the kernel"
    );
    // B: the kernel finished dmkit's merge
    let b = marker(&m, "b-status");
    let f: Vec<&str> = b.split_whitespace().collect();
    assert_eq!(f[3].split('/').next(), Some(f[4]), "kernel merge incomplete: {b}");
    assert_eq!(marker(&m, "b-merged"), md5(&b_model), "merged device");
    assert_eq!(
        md5(&read_at(&ob, 0, SIZE as usize)),
        md5(&b_model),
        "merged origin image"
    );
    // C: dmkit reads the kernel's store as the kernel did
    let d = Daemon::start("snap-oracle2");
    d.create("oc", &format!("0 {SECTORS} snapshot-origin {}", oc.display()));
    d.create(
        "sc",
        &format!("0 {SECTORS} snapshot {} {} P 4", oc.display(), cc.display()),
    );
    assert_eq!(
        status(&d, "sc"),
        marker(&m, "c-status"),
        "status of the kernel's store"
    );
    let mut sc = Client::connect(&d.sock(), "sc");
    assert_eq!(
        md5(&read_all(&mut sc)),
        marker(&m, "c-snap"),
        "dmkit reads the kernel's snapshot differently"
    );
    let mut o = Client::connect(&d.sock(), "oc");
    assert_eq!(md5(&read_all(&mut o)), marker(&m, "c-origin"), "origin");
    // and the snapshot is still the origin as it was before the kernel's writes,
    // except for the kernel's own writes to the snapshot
    let before = pattern(13, SIZE as usize);
    let snap = read_all(&mut sc);
    let differs: Vec<usize> = (0..SIZE as usize / 2048)
        .filter(|&c| snap[c * 2048..(c + 1) * 2048] != before[c * 2048..(c + 1) * 2048])
        .collect();
    assert!(
        differs.len() <= 4,
        "{} chunks of the snapshot differ from the old origin: {:?}",
        differs.len(),
        &differs[..differs.len().min(20)]
    );
}
