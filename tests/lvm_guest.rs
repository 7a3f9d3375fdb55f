//! Issue 32's guest proof: Debian's unmodified `lvm2` and `dmeventd` in the 6.12
//! kernel with `ublk_drv` and **without device-mapper** (dm-mod not loaded),
//! through `dmkit exec`, with the daemon making every device a ublk block device
//! at its resume (`serve --attach`): PVs on virtio disks, linear, striped, thin
//! pool + thin + thin snapshot, classic snapshot and its merge, writecache
//! attached and split off, ext4 made and mounted on LVs, `vgchange -an`/`-ay`,
//! and a thin pool grown by dmeventd past its autoextend threshold. Then, in the
//! same boot, dm-mod is loaded and the same script runs against the kernel's own
//! device-mapper: the `dmsetup table` lines (device numbers aside), the `lvs`
//! report and the data must be the same (tests/lvm_guest/scenario.sh). Last,
//! the kernel's device-mapper and a dmkit daemon side by side: each lists its
//! own devices, and behind the door the kernel's node opens the kernel's device.
//!
//! A missing tool or kernel fails the test (ci/install.sh installs them).

use crate::common;
use crate::oracle;
use common::{pattern, tool_path, Scratch, BIN};

use common::MIB;

#[test]
fn lvm_and_dmeventd_in_a_kernel_without_device_mapper_match_the_kernels_own() {
    let s = Scratch::new("lvmguest");
    let pv_a = s.sparse("pv-a.img", 128 * MIB);
    let pv_b = s.sparse("pv-b.img", 128 * MIB);
    let data = pattern(32, (16 * MIB) as usize);
    let pat = s.path("pattern.img");
    std::fs::write(&pat, &data).expect("pattern");
    let md5_8 = oracle::md5(&data[..(8 * MIB) as usize]);
    let bins = [
        BIN.to_string(),
        tool_path("lvm"),
        tool_path("dmeventd"),
        tool_path("mke2fs"),
        tool_path("e2fsck"),
    ]
    .join(" ");
    // where dmeventd finds it (the guest has no ld.so.cache)
    // and Debian's dd and cat (the guest's own are busybox, static: the door
    // does not reach them) for the side-by-side part
    let files = "/lib/x86_64-linux-gnu/libdevmapper-event-lvm2thin.so /lib/x86_64-linux-gnu/libdevmapper-event-lvm2snapshot.so /usr/bin/dd /usr/bin/cat";
    let script = include_str!("lvm_guest/scenario.sh");
    let serial = oracle::run_env(
        &s.0,
        script,
        &[&pv_a, &pv_b, &pat],
        &[
            ("ORACLE_BINS", bins.as_str()),
            ("ORACLE_FILES", files),
            ("ORACLE_MODULES", oracle::EXT4_UBLK_MODULES),
            ("ORACLE_DM_LATE", "1"),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
            ("DMKIT_ORACLE_TIMEOUT", "1200"),
            ("ORACLE_MEM", "1024"),
        ],
    );
    let m = oracle::markers(&serial);
    let get = |k: &str| oracle::marker(&m, k).to_string();
    assert_eq!(get("dm-before"), "0 0", "no device-mapper in the kernel before");
    assert_eq!(get("dm-during"), "0", "nor while dmkit served LVM");
    assert_eq!(get("d-log-errors"), "0", "the daemon logged no error");
    for side in ["d", "k"] {
        for what in [
            "lin",
            "str",
            "th",
            "thsnap",
            "csnap",
            "merged",
            "thfile",
            "wcfile",
            "thfile-again",
            "str-again",
        ] {
            assert_eq!(
                get(&format!("{side}-md5-{what}")),
                md5_8,
                "{side}: {what} holds the pattern"
            );
        }
        for fs in ["th", "wlv"] {
            assert_eq!(
                get(&format!("{side}-fsck-{fs}")),
                "clean",
                "{side}: e2fsck of {fs}"
            );
        }
        assert_eq!(
            get(&format!("{side}-monitor")),
            "monitored",
            "{side}: dmeventd monitors the pool"
        );
        assert!(
            get(&format!("{side}-autoextend")).starts_with("48.00m_"),
            "{side}: the pool grew by 50%: {}",
            get(&format!("{side}-autoextend"))
        );
        assert_eq!(
            get(&format!("{side}-left")),
            "No_devices_found;",
            "{side}: nothing left"
        );
        assert_eq!(
            get(&format!("{side}-autoextend-writer")),
            "ok",
            "{side}: the writer filling the pool"
        );
        let secs: u32 = get(&format!("{side}-autoextend-secs")).parse().expect("seconds");
        assert!(
            secs <= 30,
            "{side}: the pool grew within 30 s of passing the threshold ({secs} s)"
        );
    }
    // The one difference: the thin's data, after mkfs.ext4 and a file. mke2fs
    // zeroes the 4 MiB journal with BLKZEROOUT; dmkit's thin takes WRITE_ZEROES
    // (the ublk device offers it) and leaves unprovisioned blocks unprovisioned,
    // while the kernel's dm-thin has no WRITE_ZEROES and the block layer writes
    // zero pages, which provision 4 MiB (6.25% of the 64 MiB thin). The pool and
    // the snapshot agree otherwise.
    let usage = |side: &str| -> Vec<f64> {
        get(&format!("{side}-usage"))
            .split_whitespace()
            .map(|v| v.parse().expect("a percentage"))
            .collect()
    };
    let (d, k) = (usage("d"), usage("k"));
    assert_eq!((d.len(), k.len()), (3, 3), "pool, th, thsnap: {d:?} {k:?}");
    let mib = |pct: f64, of_mib: f64| pct * of_mib / 100.0;
    assert!(
        (mib(k[1] - d[1], 64.0) - 4.0).abs() < 0.02,
        "th: 4 MiB more on the kernel's: {d:?} {k:?}"
    );
    assert!(
        (mib(k[0] - d[0], 48.0) - 4.0).abs() < 0.03,
        "pool: the same 4 MiB: {d:?} {k:?}"
    );
    assert_eq!(d[2], k[2], "thsnap: {d:?} {k:?}");
    for what in ["lvs", "tables", "wc-table", "inactive", "autoextend"] {
        assert_eq!(
            get(&format!("d-{what}")),
            get(&format!("k-{what}")),
            "{what}: dmkit's answer (first) differs from the kernel's"
        );
    }
    // side by side with the kernel's device-mapper (issue 45): each side lists
    // its own devices, and behind the door the kernel's node reads the kernel's
    // device, dmkit's name dmkit's
    assert_eq!(
        get("side-kernel-ls"),
        "kd;",
        "plain dmsetup lists the kernel's devices"
    );
    assert_eq!(
        get("side-door-ls"),
        "dz;",
        "dmsetup behind the door lists dmkit's"
    );
    assert_eq!(get("side-kd-plain"), md5_8, "the kernel's kd without the door");
    assert_eq!(get("side-kd-door"), md5_8, "the kernel's kd behind the door");
    assert_eq!(
        get("side-dz-door"),
        oracle::md5(&data[(8 * MIB) as usize..]),
        "dmkit's dz behind the door"
    );
    assert_eq!(
        get("side-dm-lines"),
        "1 511_device-mapper;",
        "the kernel's one device-mapper line; behind the door dmkit's in its place"
    );
}
