//! dmkit's raid1 and the kernel's dm-raid (6.12 guest) open each other's
//! arrays: an array dmkit made and wrote is assembled by the kernel in sync
//! (`AA`, idle) with dmkit's data; an array the kernel made and wrote is
//! assembled by dmkit in sync with the kernel's data, its two legs equal.

mod common;
mod oracle;

use common::nbd::{Client, FLUSH};
use common::{pattern, Daemon};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const SECTORS: u64 = 16384;

#[test]
fn the_kernels_dm_raid_and_dmkit_open_each_others_raid1() {
    let s = common::Scratch::new("raid-guest");
    // kernel-made: vda..vdd; dmkit-made: vde..vdh (meta, data, meta, data)
    let names = [
        "kmeta0", "kdata0", "kmeta1", "kdata1", "dmeta0", "ddata0", "dmeta1", "ddata1",
    ];
    let disks: Vec<std::path::PathBuf> = names
        .iter()
        .map(|n| {
            s.sparse(
                &format!("{n}.img"),
                if n.contains("meta") { MIB } else { 8 * MIB },
            )
        })
        .collect();
    std::fs::write(&disks[5], pattern(3, (8 * MIB) as usize)).expect("ddata0");
    let table = |l: &[std::path::PathBuf]| {
        format!(
            "0 {SECTORS} raid raid1 3 0 region_size 128 2 {} {} {} {}",
            l[0].display(),
            l[1].display(),
            l[2].display(),
            l[3].display()
        )
    };
    // dmkit makes its array and writes 64 KiB at 1 MiB
    let written = pattern(21, 65536);
    {
        let d = Daemon::start("raid-guest-d");
        d.create("r", &table(&disks[4..8]));
        assert_eq!(
            d.wait_status("r", " idle ", Duration::from_secs(30)),
            format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle 0 0 -")
        );
        let mut c = Client::connect(&d.sock(), "r");
        c.write(MIB, &written);
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
        drop(c);
        d.remove_closed("r");
    }
    let script = format!(
        "{}{}",
        oracle::GUEST_HELPERS,
        r#"
wait_idle() {
  i=0
  while [ $i -lt 1200 ]; do
    case "$(dmsetup status $1)" in *" idle "*) return 0;; esac
    sleep 0.1; i=$((i+1))
  done
  return 1
}
mk kr "0 16384 raid raid1 3 0 region_size 128 2 /dev/vda /dev/vdb /dev/vdc /dev/vdd"
wait_idle kr
echo "ORACLE k-status $(dmsetup status kr | tr ' ' '_')"
dd if=/dev/urandom of=/tmp/pat bs=65536 count=1 2>/dev/null
dd if=/tmp/pat of=/dev/mapper/kr bs=65536 seek=32 conv=fsync 2>/dev/null
echo "ORACLE k-written $(md5sum < /tmp/pat | cut -d' ' -f1)"
dmsetup remove kr
mk dr "0 16384 raid raid1 3 0 region_size 128 2 /dev/vde /dev/vdf /dev/vdg /dev/vdh"
wait_idle dr
echo "ORACLE d-status $(dmsetup status dr | tr ' ' '_')"
echo "ORACLE d-read $(dd if=/dev/mapper/dr bs=65536 skip=16 count=1 2>/dev/null | md5sum | cut -d' ' -f1)"
dmsetup remove dr
sync
"#
    );
    let refs: Vec<&std::path::Path> = disks.iter().map(|p| p.as_path()).collect();
    let serial = oracle::run_env(
        &s.0,
        &script,
        &refs,
        &[
            ("ORACLE_MODULES", oracle::RAID_MODULES),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "600"),
        ],
    );
    let m = oracle::markers(&serial);
    let in_sync = format!("0_{SECTORS}_raid_raid1_2_AA_{SECTORS}/{SECTORS}_idle_0_0_-");
    assert_eq!(oracle::marker(&m, "k-status"), in_sync, "the kernel's own array");
    assert_eq!(
        oracle::marker(&m, "d-status"),
        in_sync,
        "the kernel assembles dmkit's array in sync"
    );
    assert_eq!(
        oracle::marker(&m, "d-read"),
        oracle::md5(&written),
        "the kernel reads dmkit's write"
    );
    // dmkit assembles the kernel's array
    let (k0, k1) = (
        std::fs::read(&disks[1]).expect("kdata0"),
        std::fs::read(&disks[3]).expect("kdata1"),
    );
    assert!(k0 == k1, "the kernel mirrored its write");
    let at = (2 * MIB) as usize;
    assert_eq!(
        oracle::md5(&k0[at..at + 65536]),
        oracle::marker(&m, "k-written"),
        "the kernel's write is on its legs"
    );
    let d = Daemon::start("raid-guest-k");
    d.create("k", &table(&disks[0..4]));
    assert_eq!(
        d.wait_status("k", " idle ", Duration::from_secs(30)),
        format!("0 {SECTORS} raid raid1 2 AA {SECTORS}/{SECTORS} idle 0 0 -"),
        "dmkit assembles the kernel's array in sync"
    );
    let mut c = Client::connect(&d.sock(), "k");
    assert_eq!(
        oracle::md5(&c.read(2 * MIB, 65536)),
        oracle::marker(&m, "k-written"),
        "dmkit reads the kernel's write"
    );
    drop(c);
    d.remove_closed("k");
}
