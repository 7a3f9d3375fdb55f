//! Kernel oracle for dm-verity (one boot of Debian's Linux 6.12 under qemu,
//! tests/oracle/run.sh, with dm-verity loaded): on the same images, made by
//! `veritysetup format` here, the kernel's dm-verity and dmkit's `verity`
//! with the same table read the same bytes, fail the same blocks for a
//! corrupted data block and a corrupted level-0 hash block, print the same
//! status (`V`, `C`) and the same table line.

use crate::common;
use crate::oracle;

use common::nbd::{Client, READ};
use common::verity::{flip, Format};
use common::{image, Daemon, Scratch};
use oracle::{marker, markers, md5, GUEST_HELPERS};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 1024;
const SIZE: u64 = BLOCK * BLOCKS;

/// dm-verity's module (dm-bufio is loaded with the thin modules; the
/// reed-solomon code is for its FEC).
const MODULES: &str = "lib/reed_solomon/reed_solomon.ko drivers/md/dm-verity.ko";

const FMT: Format = Format {
    version: 1,
    data_block: 4096,
    hash_block: 4096,
    hash: "sha256",
    salt: "0123456789abcdef0123456789abcdef",
    superblock: true,
};

/// (name, data disk, hash disk, options)
const CASES: [(&str, usize, usize, &str); 4] = [
    ("good", 0, 1, ""),
    ("data", 2, 1, ""),
    ("hash", 0, 3, ""),
    ("ignore", 2, 1, "2 ignore_corruption check_at_most_once"),
];

fn table(data: &str, hash: &str, root: &str, opts: &str) -> String {
    format!(
        "0 {} verity {}",
        SIZE / 512,
        FMT.table(data, hash, BLOCKS, root, opts)
    )
}

/// The table line without its two device fields.
fn without_devices(line: &str) -> Vec<String> {
    let mut f: Vec<String> = line.split_whitespace().map(str::to_string).collect();
    if f.len() > 5 {
        f.drain(4..6);
    }
    f
}

#[test]
fn dmkit_and_the_kernels_dm_verity_serve_and_fail_the_same_blocks() {
    let s = Scratch::new("verity-oracle");
    let data = image(&s, "data.img", SIZE, Some(61));
    let hash = s.sparse("hash.img", 64 << 10);
    let root = FMT.run(&data, &hash);
    let bad = s.path("bad.img");
    std::fs::copy(&data, &bad).expect("copy");
    flip(&bad, 700 * BLOCK + 1234);
    let badh = s.path("badh.img");
    std::fs::copy(&hash, &badh).expect("copy");
    // level 0 starts at hash block 2 (superblock, top block)
    flip(&badh, (2 + 6) * BLOCK + 5);
    let disks = [data.as_path(), hash.as_path(), bad.as_path(), badh.as_path()];
    let vd = ["/dev/vda", "/dev/vdb", "/dev/vdc", "/dev/vdd"];

    let mut script = String::from(GUEST_HELPERS);
    script += "fails() { i=0; out=x; while [ $i -lt 1024 ]; do \
               dd if=$1 of=/dev/null bs=4096 skip=$i count=1 iflag=direct 2>/dev/null || out=\"$out $i\"; \
               i=$((i+1)); done; echo \"$out\"; }\n";
    for (n, di, hi, opts) in CASES {
        script += &format!(
            "dmsetup create {n} --readonly --table \"{}\"\ndmsetup mknodes\n",
            table(vd[di], vd[hi], &root, opts)
        );
        script += &format!("echo \"ORACLE {n}-table $(dmsetup table {n})\"\n");
        script += &format!("echo \"ORACLE {n}-fail $(fails /dev/mapper/{n})\"\n");
        script += &format!("echo \"ORACLE {n}-status $(dmsetup status {n})\"\n");
    }
    script += "echo \"ORACLE good-md5 $(sum /dev/mapper/good)\"\n";
    script += "echo \"ORACLE ignore-md5 $(sum /dev/mapper/ignore)\"\n";
    script += "echo \"ORACLE done yes\"\n";
    let serial = oracle::run_env(
        &s.0,
        &script,
        &disks,
        &[("ORACLE_MODULES", MODULES), ("DMKIT_ORACLE_KERNEL", "6.12")],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    assert_eq!(
        marker(&m, "data-fail"),
        "x 700",
        "the kernel fails the corrupted block"
    );
    assert_eq!(
        marker(&m, "hash-fail"),
        format!(
            "x {}",
            (6 * 128..7 * 128)
                .map(|b: u64| b.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        "the kernel fails the blocks the corrupted hash block covers"
    );

    let d = Daemon::start("verity-oracle");
    for (n, di, hi, opts) in CASES {
        let t = table(
            &disks[di].display().to_string(),
            &disks[hi].display().to_string(),
            &root,
            opts,
        );
        let o = d.cli_in(&["create", "--readonly", n], &t);
        assert!(o.status.success(), "{n}: {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(
            without_devices(&d.ok(&["table", n])),
            without_devices(marker(&m, &format!("{n}-table"))),
            "{n}: the table lines differ (devices aside)"
        );
        let mut c = Client::connect(&d.sock(), n);
        let mut fails = String::from("x");
        for b in 0..BLOCKS {
            if c.call(READ, 0, b * BLOCK, BLOCK as u32, &[]) != 0 {
                fails += &format!(" {b}");
            }
        }
        assert_eq!(fails, marker(&m, &format!("{n}-fail")), "{n}: the failing blocks");
        assert_eq!(
            d.ok(&["status", n]).trim_end(),
            marker(&m, &format!("{n}-status")),
            "{n}: the status"
        );
        if n == "good" || n == "ignore" {
            let got = c.read(0, SIZE as usize);
            assert_eq!(
                md5(&got),
                marker(&m, &format!("{n}-md5")),
                "{n}: the bytes served"
            );
        }
    }
    assert_eq!(marker(&m, "good-md5"), md5(&std::fs::read(&data).expect("data")));
    assert_eq!(
        marker(&m, "ignore-md5"),
        md5(&std::fs::read(&bad).expect("bad")),
        "ignore_corruption serves the corrupted block"
    );
}

/// With FEC (`veritysetup format --fec-device --fec-roots 2`): eight bytes
/// changed in data block 5 and four in level-0 hash block 3 are corrected
/// by the kernel and by dmkit alike (the same bytes; the 6.12 kernel's status
/// says `C` once a block needed correcting, and so does dmkit's); the same
/// two bytes changed in blocks 7, 13 and 19 (one codeword group: three
/// wrong bytes a codeword, beyond two roots) fail exactly those blocks in
/// both, and the status says `C`; the table lines are the same.
#[test]
fn dmkit_and_the_kernels_dm_verity_correct_and_fail_the_same_blocks_with_fec() {
    use std::os::unix::fs::FileExt;
    let s = Scratch::new("verity-oracle-fec");
    let data = image(&s, "data.img", SIZE, Some(62));
    let hash = s.sparse("hash.img", 1 << 20);
    let fec = s.path("fec.img");
    let out = common::run(
        std::process::Command::new("veritysetup")
            .args(["format", "--fec-device"])
            .arg(&fec)
            .args(["--fec-roots", "2", "--salt", "0123abcd"])
            .arg(&data)
            .arg(&hash),
    );
    let root = out
        .lines()
        .find_map(|l| l.strip_prefix("Root hash:"))
        .map(|h| h.trim().to_string())
        .expect("root hash");
    let want = std::fs::read(&data).expect("data");
    let smash = |p: &std::path::Path, off: u64, len: usize| {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p)
            .expect("open");
        let mut b = vec![0u8; len];
        f.read_exact_at(&mut b, off).expect("read");
        b.iter_mut().for_each(|x| *x = !*x);
        f.write_all_at(&b, off).expect("write");
    };
    smash(&data, 5 * BLOCK + 100, 8);
    smash(&hash, 3 * BLOCK + 10, 4);
    for b in [7, 13, 19] {
        smash(&data, b * BLOCK + 50, 2);
    }
    let opts = |f: &str| format!("8 use_fec_from_device {f} fec_roots 2 fec_blocks 1279 fec_start 0");
    let t = |d: &str, h: &str, f: &str| {
        format!(
            "0 {} verity 1 {d} {h} 4096 4096 {BLOCKS} 1 sha256 {root} 0123abcd {}",
            SIZE / 512,
            opts(f)
        )
    };
    let disks = [data.as_path(), hash.as_path(), fec.as_path()];
    let mut script = String::from(GUEST_HELPERS);
    script += "fails() { i=0; out=x; while [ $i -lt 1024 ]; do \
               dd if=$1 of=/dev/null bs=4096 skip=$i count=1 iflag=direct 2>/dev/null || out=\"$out $i\"; \
               i=$((i+1)); done; echo \"$out\"; }\n";
    script +=
        "blk() { dd if=$1 bs=4096 skip=$2 count=1 iflag=direct 2>/dev/null | md5sum | cut -d' ' -f1; }\n";
    script += &format!(
        "dmsetup create vf --readonly --table \"{}\"\ndmsetup mknodes\n",
        t("/dev/vda", "/dev/vdb", "/dev/vdc")
    );
    script += "echo \"ORACLE table $(dmsetup table vf)\"\n";
    script += &format!(
        "dmsetup create vh --readonly --table \"{}\"\ndmsetup mknodes\n",
        t("/dev/vda", "/dev/vdb", "/dev/vdc")
    );
    script += "echo \"ORACLE h200 $(blk /dev/mapper/vh 200)\"\n";
    script += "echo \"ORACLE hstatus $(dmsetup status vh)\"\n";
    script += "echo \"ORACLE b5 $(blk /dev/mapper/vf 5)\"\n";
    script += "echo \"ORACLE status0 $(dmsetup status vf)\"\n";
    script += "echo \"ORACLE b200 $(blk /dev/mapper/vf 200)\"\n";
    script += "echo \"ORACLE status1 $(dmsetup status vf)\"\n";
    script += "echo \"ORACLE fail $(fails /dev/mapper/vf)\"\n";
    script += "echo \"ORACLE status2 $(dmsetup status vf)\"\n";
    script += "echo \"ORACLE done yes\"\n";
    let serial = oracle::run_env(
        &s.0,
        &script,
        &disks,
        &[("ORACLE_MODULES", MODULES), ("DMKIT_ORACLE_KERNEL", "6.12")],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "done"), "yes");
    let block = |b: u64| md5(&want[(b * BLOCK) as usize..((b + 1) * BLOCK) as usize]);
    assert_eq!(marker(&m, "b5"), block(5), "the kernel corrects the data block");
    let c = format!("0 {} verity C", SIZE / 512);
    assert_eq!(
        marker(&m, "status0"),
        c,
        "the kernel says C once it corrected a data block"
    );
    assert_eq!(
        marker(&m, "h200"),
        block(200),
        "the kernel corrects the hash block"
    );
    assert_eq!(
        marker(&m, "hstatus"),
        c,
        "the kernel says C once it corrected a hash block"
    );
    assert_eq!(
        marker(&m, "b200"),
        block(200),
        "the kernel corrects the hash block"
    );
    assert_eq!(marker(&m, "status1"), c);
    assert_eq!(
        marker(&m, "fail"),
        "x 7 13 19",
        "the kernel fails the group beyond repair"
    );
    assert_eq!(marker(&m, "status2"), format!("0 {} verity C", SIZE / 512));

    let d = Daemon::start("verity-oracle-fec");
    let (ds, hs, fs) = (
        data.display().to_string(),
        hash.display().to_string(),
        fec.display().to_string(),
    );
    let o = d.cli_in(&["create", "--readonly", "vf"], &t(&ds, &hs, &fs));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut kernel: Vec<String> = marker(&m, "table")
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let mut ours: Vec<String> = d
        .ok(&["table", "vf"])
        .split_whitespace()
        .map(str::to_string)
        .collect();
    for f in [&mut kernel, &mut ours] {
        // the devices aside
        f[4].clear();
        f[5].clear();
        f[15].clear();
    }
    assert_eq!(ours, kernel, "the table lines differ (devices aside)");
    let mut c = Client::connect(&d.sock(), "vf");
    assert_eq!(md5(&c.read(5 * BLOCK, BLOCK as usize)), marker(&m, "b5"));
    assert_eq!(md5(&c.read(200 * BLOCK, BLOCK as usize)), marker(&m, "b200"));
    assert_eq!(d.ok(&["status", "vf"]).trim_end(), marker(&m, "status1"));
    let mut fails = String::from("x");
    for b in 0..BLOCKS {
        if c.call(READ, 0, b * BLOCK, BLOCK as u32, &[]) != 0 {
            fails += &format!(" {b}");
        }
    }
    assert_eq!(fails, marker(&m, "fail"), "the failing blocks");
    assert_eq!(d.ok(&["status", "vf"]).trim_end(), marker(&m, "status2"));
}
