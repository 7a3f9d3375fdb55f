//! dmkit's raid1 and the kernel's dm-raid (6.12 guest) open each other's
//! arrays: an array dmkit made and wrote is assembled by the kernel in sync
//! (`AA`, idle) with dmkit's data; an array the kernel made and wrote is
//! assembled by dmkit in sync with the kernel's data, its two legs equal.

use crate::common;
use crate::oracle;

use common::nbd::{Client, FLUSH};
use common::{pattern, Daemon};
use std::time::Duration;

use common::MIB;

/// Guest shell: `wait_idle DEV` waits (up to 2 minutes) for its raid status to say idle.
const WAIT_IDLE: &str = r#"
wait_idle() {
  i=0
  while [ $i -lt 1200 ]; do
    case "$(dmsetup status $1)" in *" idle "*) return 0;; esac
    sleep 0.1; i=$((i+1))
  done
  return 1
}
"#;
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
        "{}{WAIT_IDLE}{}",
        oracle::GUEST_HELPERS,
        r#"
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

/// One striped array of the guest test: its type, options and legs.
struct Level {
    name: &'static str,
    ty: &'static str,
    opts: &'static str,
    legs: usize,
    /// The array's sectors.
    sectors: u64,
}

/// Each leg: 1 MiB of metadata, then 2 MiB of data; every array's legs in
/// one image, five legs' room per array.
const LEG: u64 = 4096;
const SLOT: u64 = 2048 + LEG;

const LEVELS: &[Level] = &[
    Level {
        name: "r0",
        ty: "raid0",
        opts: "",
        legs: 3,
        sectors: 3 * LEG,
    },
    Level {
        name: "r4",
        ty: "raid4",
        opts: " region_size 1024",
        legs: 3,
        sectors: 2 * LEG,
    },
    Level {
        name: "r5ls",
        ty: "raid5_ls",
        opts: " region_size 1024",
        legs: 3,
        sectors: 2 * LEG,
    },
    Level {
        name: "r5la",
        ty: "raid5_la",
        opts: " region_size 1024",
        legs: 4,
        sectors: 3 * LEG,
    },
    Level {
        name: "r6zr",
        ty: "raid6_zr",
        opts: " region_size 1024",
        legs: 5,
        sectors: 3 * LEG,
    },
    Level {
        name: "r6nc",
        ty: "raid6_nc",
        opts: " region_size 1024",
        legs: 5,
        sectors: 3 * LEG,
    },
    Level {
        name: "r6ls",
        ty: "raid6_ls_6",
        opts: " region_size 1024",
        legs: 5,
        sectors: 3 * LEG,
    },
    Level {
        name: "r10n",
        ty: "raid10",
        opts: " region_size 1024 raid10_copies 2",
        legs: 4,
        sectors: 2 * LEG,
    },
    Level {
        name: "r10f",
        ty: "raid10",
        opts: " region_size 1024 raid10_format far",
        legs: 4,
        sectors: 2 * LEG,
    },
    Level {
        name: "r10o",
        ty: "raid10",
        opts: " region_size 1024 raid10_format offset",
        legs: 4,
        sectors: 2 * LEG,
    },
];

/// The table of `l` with its legs `dev`-prefixed devices (`<dev>m<i>`, `<dev>d<i>`).
fn striped_table(l: &Level, dev: &str) -> String {
    let params = 1 + l.opts.split_whitespace().count();
    let mut t = format!("0 {} raid {} {params} 128{} {}", l.sectors, l.ty, l.opts, l.legs);
    for i in 0..l.legs {
        t.push_str(&format!(" {dev}{}m{i} {dev}{}d{i}", l.name, l.name));
    }
    t
}

/// Leg tables of array `k` over `disk`: (name, table).
fn leg_tables(k: usize, l: &Level, disk: &str) -> Vec<(String, String)> {
    let base = k as u64 * 5 * SLOT;
    (0..l.legs)
        .flat_map(|i| {
            let at = base + i as u64 * SLOT;
            [
                (format!("{}m{i}", l.name), format!("0 2048 linear {disk} {at}")),
                (
                    format!("{}d{i}", l.name),
                    format!("0 {LEG} linear {disk} {}", at + 2048),
                ),
            ]
        })
        .collect()
}

#[test]
fn the_kernels_dm_raid_and_dmkit_open_each_others_raid0_raid4_raid5_raid6_and_raid10() {
    let s = common::Scratch::new("raid-levels-guest");
    let bytes = LEVELS.len() as u64 * 5 * SLOT * 512;
    let kimg = s.sparse("k.img", bytes);
    let dimg = s.sparse("d.img", bytes);
    // dmkit makes and fills each array on d.img
    let d = Daemon::start("raid-levels-guest-d");
    let mut written = Vec::new();
    for (k, l) in LEVELS.iter().enumerate() {
        for (n, t) in leg_tables(k, l, &dimg.display().to_string()) {
            d.create(&n, &t);
        }
        d.create(l.name, &striped_table(l, "/dev/mapper/"));
        d.wait_status(l.name, " idle ", Duration::from_secs(60));
        let data = pattern(40 + k as u64, (l.sectors * 512) as usize);
        let mut c = Client::connect(&d.sock(), l.name);
        for (i, part) in data.chunks(MIB as usize).enumerate() {
            c.write(i as u64 * MIB, part);
        }
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "flush");
        drop(c);
        written.push(oracle::md5(&data));
        d.remove_closed(l.name);
        for (n, _) in leg_tables(k, l, "") {
            d.ok(&["remove", &n]);
        }
    }
    drop(d);
    let mut script = format!("{}{WAIT_IDLE}", oracle::GUEST_HELPERS);
    for (k, l) in LEVELS.iter().enumerate() {
        let sz = l.sectors * 512;
        // the kernel's own array, filled with random bytes
        for (n, t) in leg_tables(k, l, "/dev/vda") {
            script.push_str(&format!("mk k{n} \"{t}\"\n"));
        }
        script.push_str(&format!(
            "mk k{0} \"{1}\"\nwait_idle k{0}\necho \"ORACLE k-{0}-status $(dmsetup status k{0} | tr ' ' ',')\"\n\
             dd if=/dev/urandom of=/dev/mapper/k{0} bs=4096 count={2} conv=fsync 2>/dev/null\n\
             echo \"ORACLE k-{0}-sum $(sum /dev/mapper/k{0})\"\ndmsetup remove k{0}\n",
            l.name,
            striped_table(l, "/dev/mapper/k"),
            sz / 4096
        ));
        // dmkit's array: the kernel reads its bytes and checks its parity
        for (n, t) in leg_tables(k, l, "/dev/vdb") {
            script.push_str(&format!("mk d{n} \"{t}\"\n"));
        }
        script.push_str(&format!(
            "mk d{0} \"{1}\"\nwait_idle d{0}\necho \"ORACLE d-{0}-status $(dmsetup status d{0} | tr ' ' ',')\"\n\
             echo \"ORACLE d-{0}-sum $(sum /dev/mapper/d{0})\"\n",
            l.name,
            striped_table(l, "/dev/mapper/d"),
        ));
        if l.ty != "raid0" {
            script.push_str(&format!(
                "dmsetup message d{0} 0 check\nsleep 1\nwait_idle d{0}\n\
                 echo \"ORACLE d-{0}-check $(dmsetup status d{0} | tr ' ' ',')\"\n",
                l.name
            ));
        }
        script.push_str(&format!("dmsetup remove d{}\n", l.name));
    }
    script.push_str("sync\n");
    let serial = oracle::run_env(
        &s.0,
        &script,
        &[kimg.as_path(), dimg.as_path()],
        &[
            ("ORACLE_MODULES", oracle::RAID_MODULES),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "900"),
        ],
    );
    let m = oracle::markers(&serial);
    // dmkit assembles each of the kernel's arrays and checks its parity
    let d = Daemon::start("raid-levels-guest-k");
    for (k, l) in LEVELS.iter().enumerate() {
        // the guest prints a status with commas for spaces
        let status_of = |what: &str| oracle::marker(&m, &format!("d-{}-{what}", l.name)).replace(',', " ");
        let kstatus = oracle::marker(&m, &format!("k-{}-status", l.name)).replace(',', " ");
        assert_eq!(
            status_of("status"),
            kstatus,
            "{}: the kernel assembles dmkit's array as in sync as its own",
            l.ty
        );
        assert_eq!(
            oracle::marker(&m, &format!("d-{}-sum", l.name)),
            written[k],
            "{}: the kernel reads dmkit's bytes",
            l.ty
        );
        if l.ty != "raid0" {
            assert_eq!(
                status_of("check"),
                kstatus,
                "{}: the kernel's check finds dmkit's parity and copies right (0 mismatches)",
                l.ty
            );
        }
        for (n, t) in leg_tables(k, l, &kimg.display().to_string()) {
            d.create(&n, &t);
        }
        d.create(l.name, &striped_table(l, "/dev/mapper/"));
        let status = d.wait_status(l.name, " idle ", Duration::from_secs(60));
        assert_eq!(
            status, kstatus,
            "{}: dmkit assembles the kernel's array as the kernel did",
            l.ty
        );
        let mut c = Client::connect(&d.sock(), l.name);
        assert_eq!(
            oracle::md5(&common::read_all(&mut c, l.sectors * 512)),
            oracle::marker(&m, &format!("k-{}-sum", l.name)),
            "{}: dmkit reads the kernel's bytes",
            l.ty
        );
        drop(c);
        d.wait_open_count(l.name, 0);
        if l.ty != "raid0" {
            d.ok(&["message", l.name, "0", "check"]);
            assert_eq!(
                d.wait_status(l.name, " idle ", Duration::from_secs(60)),
                kstatus,
                "{}: dmkit's check finds the kernel's parity and copies right",
                l.ty
            );
        }
        d.ok(&["remove", l.name]);
    }
}
