//! Kernel oracle for dm-verity (one boot of Debian's Linux 6.12 under qemu,
//! tests/oracle/run.sh, with dm-verity loaded): on the same images, made by
//! `veritysetup format` here, the kernel's dm-verity and dmkit's `verity`
//! with the same table read the same bytes, fail the same blocks for a
//! corrupted data block and a corrupted level-0 hash block, print the same
//! status (`V`, `C`) and the same table line.

mod common;
mod oracle;

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
