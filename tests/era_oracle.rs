//! Kernel oracle for dm-era: Linux 6.12's dm-era, booted under qemu
//! (tests/oracle/run.sh), opens metadata dmkit's era target wrote and carries on
//! from its era; dmkit's era target opens metadata the kernel formatted and
//! wrote, metadata snapshot included. Both tools (dmkit's and the 1.x
//! reference) dump and list both alike, and date every block as written.
//!
//! A missing tool or a failed kernel download fails the test (ci/install.sh
//! installs and fetches them).

use crate::common;
use crate::oracle;
use crate::thin_util;

use common::nbd::Client;
use common::{pattern, Daemon, Scratch, BIN};
use oracle::{marker, markers, GUEST_HELPERS};
use std::path::Path;
use std::process::Command;

const BLOCK: u64 = 64 << 10;
const ORIGIN: u64 = 64 << 20;
const SECTORS: u64 = ORIGIN / 512;

fn ok(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Both tools agree on `meta` (dump, logical dump, check); the era of each block.
fn tools_agree(meta: &Path) -> Vec<u32> {
    for args in [&[][..], &["--logical"][..]] {
        let ours = ok(Command::new(BIN).args(["era", "dump"]).args(args).arg(meta));
        let theirs = ok(Command::new(thin_util::tool("era_dump")).args(args).arg(meta));
        assert_eq!(ours, theirs, "era_dump {args:?}");
    }
    ok(Command::new(BIN).args(["era", "check"]).arg(meta));
    ok(Command::new(thin_util::tool("era_check")).arg(meta));
    let logical = ok(Command::new(BIN).args(["era", "dump", "--logical"]).arg(meta));
    let md = dmkit::era::xml::parse(logical.as_bytes()).expect("dump parses");
    let mut e = md.eras;
    e.resize(md.sb.nr_blocks as usize, 0);
    e
}

fn invalidate(meta: &Path, since: u32) -> String {
    // a flag in dmkit (as 1.2.2 and later), a value in the 1.1 reference
    let a = ["--written-since", &since.to_string(), "--metadata-snapshot"];
    let ours = ok(Command::new(BIN).args(["era", "invalidate"]).args(a).arg(meta));
    let theirs = ok(Command::new(thin_util::tool("era_invalidate"))
        .args(a)
        .arg("1")
        .arg(meta));
    assert_eq!(ours, theirs, "era_invalidate {a:?}");
    ours
}

/// (era, snapshot) of an era status line.
fn era_and_snap(status: &str) -> (u32, String) {
    let f: Vec<&str> = status.split_whitespace().collect();
    assert_eq!(f.len(), 7, "status: {status}");
    assert_eq!(&f[2..4], ["era", "8"], "status: {status}");
    (f[5].parse().expect("era"), f[6].to_string())
}

#[test]
fn the_kernel_and_dmkit_open_each_others_era_metadata() {
    let s = Scratch::new("era-oracle");
    let meta1 = s.sparse("meta1", 4 << 20);
    let origin1 = s.sparse("origin1", ORIGIN);
    let meta2 = s.sparse("meta2", 4 << 20);
    let origin2 = s.sparse("origin2", ORIGIN);

    // dmkit writes eras 1 and 2 on meta1
    {
        let d = Daemon::start("era-oracle-1");
        d.create(
            "e",
            &format!("0 {SECTORS} era {} {} 128", meta1.display(), origin1.display()),
        );
        let mut c = Client::connect(&d.sock(), "e");
        for b in [1u64, 2, 40] {
            c.write(b * BLOCK, &pattern(b, 4096));
        }
        d.ok(&["message", "e", "0", "checkpoint"]);
        for b in [2u64, 41] {
            c.write(b * BLOCK, &pattern(b, 4096));
        }
        drop(c);
        d.remove_closed("e");
    }

    // the kernel opens it (era 3 from its resume) and writes; and formats meta2,
    // writes eras 1 and 2 there, and keeps a metadata snapshot
    let script = format!(
        r#"{GUEST_HELPERS}
w() {{ dd if=/dev/urandom of=/dev/mapper/$1 bs=65536 seek=$2 count=1 conv=notrunc 2>/dev/null; sync; }}
mk e1 "0 {SECTORS} era /dev/vda /dev/vdb 128"
echo "ORACLE status-1 $(dmsetup status e1)"
w e1 40
w e1 100
dmsetup remove e1
mk e2 "0 {SECTORS} era /dev/vdc /dev/vdd 128"
echo "ORACLE status-2a $(dmsetup status e2)"
w e2 0
w e2 7
dmsetup message e2 0 checkpoint
w e2 7
w e2 500
dmsetup message e2 0 take_metadata_snap
echo "ORACLE status-2b $(dmsetup status e2)"
dmsetup remove e2
echo "ORACLE removed yes"
"#
    );
    let serial = oracle::run_env(
        &s.0,
        &script,
        &[&meta1, &origin1, &meta2, &origin2],
        &[
            ("ORACLE_MODULES", "drivers/md/dm-era.ko"),
            ("DMKIT_ORACLE_KERNEL", "6.12"),
        ],
    );
    let m = markers(&serial);
    assert_eq!(marker(&m, "removed"), "yes");

    // the kernel carried on from dmkit's era 2, and dated its writes era 3
    assert_eq!(era_and_snap(marker(&m, "status-1")), (3, "-".to_string()));
    let eras = tools_agree(&meta1);
    assert_eq!(
        (eras[1], eras[2], eras[40], eras[41], eras[100], eras[3]),
        (1, 2, 3, 2, 3, 0)
    );

    // the kernel's own metadata: formatted, eras 1 and 2, a snapshot held
    assert_eq!(era_and_snap(marker(&m, "status-2a")), (1, "-".to_string()));
    let (era, snap) = era_and_snap(marker(&m, "status-2b"));
    assert_eq!(era, 3);
    let snap: u64 = snap.parse().expect("the kernel's snapshot block");
    let eras = tools_agree(&meta2);
    assert_eq!((eras[0], eras[7], eras[500], eras[1]), (1, 2, 2, 0));
    assert_eq!(
        invalidate(&meta2, 2),
        "<blocks>\n  <block block=\"7\"/>\n  <block block=\"500\"/>\n</blocks>"
    );
    assert_eq!(
        invalidate(&meta2, 1),
        "<blocks>\n  <block block=\"0\"/>\n  <block block=\"7\"/>\n  <block block=\"500\"/>\n</blocks>"
    );

    // dmkit opens the kernel's metadata: era 4 from its resume, the snapshot still held
    let d = Daemon::start("era-oracle-2");
    d.create(
        "e",
        &format!("0 {SECTORS} era {} {} 128", meta2.display(), origin2.display()),
    );
    assert_eq!(era_and_snap(&d.ok(&["status", "e"])), (4, snap.to_string()));
    let mut c = Client::connect(&d.sock(), "e");
    c.write(9 * BLOCK, &pattern(9, 4096));
    drop(c);
    d.ok(&["message", "e", "0", "drop_metadata_snap"]);
    d.ok(&["remove", "e"]);
    let eras = tools_agree(&meta2);
    assert_eq!((eras[0], eras[7], eras[9]), (1, 2, 4));
}
