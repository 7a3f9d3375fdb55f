//! Changed blocks between thin snapshots (issue 14): `dmkit thin ls|delta` on a
//! live pool through the daemon, and the `qemu:dirty-bitmap:BASE` NBD context an
//! incremental backup reads, with real clients: nbdinfo maps the changed blocks,
//! nbdfuse reads them, nbdcopy makes the full copies they are checked against.

use crate::common;
use crate::thin_util;
use common::{need, Daemon};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::MIB;

/// A pool with volume 0 (256 MiB, its first 64 MiB written), snapshot 1 of it,
/// then writes to the volume, then snapshot 2; devices vol, s1, s2. Returns the
/// bytes written between the snapshots.
fn pool_with_history(d: &Daemon) -> u64 {
    let meta = d.dir.path("meta.img");
    let data = d.dir.path("data.img");
    std::fs::File::create(&meta).unwrap().set_len(16 * MIB).unwrap();
    std::fs::File::create(&data).unwrap().set_len(1024 * MIB).unwrap();
    d.create(
        "pool",
        &format!("0 2097152 thin-pool {} {} 128 0", meta.display(), data.display()),
    );
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("vol", "0 524288 thin /dev/mapper/pool 0");
    let raw = d.dir.path("first.raw");
    let bytes: Vec<u8> = (0..64 * MIB).map(|i| ((i * 2654435761) >> 13) as u8).collect();
    std::fs::write(&raw, &bytes).unwrap();
    common::run(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&raw)
            .arg(d.uri("vol")),
    );
    snapshot(d, 1, "s1");
    // 1 MiB inside the written part, 64 KiB more, and 512 KiB never written before
    let mut changed = 0;
    for (off, len) in [
        (10 * MIB, MIB),
        (40 * MIB + 3 * 65536, 65536),
        (200 * MIB, 512 * 1024),
    ] {
        common::run(
            Command::new("qemu-io")
                .args(["-f", "raw", "-c", &format!("write -P 0x5a {off} {len}")])
                .arg(d.uri("vol")),
        );
        changed += len;
    }
    snapshot(d, 2, "s2");
    changed
}

fn snapshot(d: &Daemon, id: u64, name: &str) {
    d.ok(&["suspend", "vol"]);
    d.ok(&["message", "pool", "0", &format!("create_snap {id} 0")]);
    d.ok(&["resume", "vol"]);
    d.create(name, &format!("0 524288 thin /dev/mapper/pool {id}"));
}

/// nbdinfo's map of `context` on `export`: (offset, length, type).
fn map(d: &Daemon, export: &str, context: &str) -> Result<Vec<(u64, u64, u32)>, String> {
    let o = Command::new("nbdinfo")
        .arg(format!("--map={context}"))
        .arg(d.uri(export))
        .output()
        .unwrap();
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.parse().ok()?,
                f.get(1)?.parse().ok()?,
                f.get(2)?.parse().ok()?,
            ))
        })
        .collect())
}

/// nbdfuse serving `export` as a file, until dropped.
struct Fuse {
    child: Child,
    dir: std::path::PathBuf,
}

impl Fuse {
    fn new(d: &Daemon, export: &str) -> Fuse {
        let dir = d.dir.path(&format!("fuse-{export}"));
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new("nbdfuse")
            .arg("-r")
            .arg(&dir)
            .arg(d.uri(export))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nbdfuse");
        let f = Fuse { child, dir };
        let t0 = Instant::now();
        while std::fs::metadata(f.file()).map(|m| m.len()).unwrap_or(0) == 0 {
            assert!(t0.elapsed() < Duration::from_secs(10), "nbdfuse did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        f
    }
    fn file(&self) -> std::path::PathBuf {
        self.dir.join("nbd")
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(&self.dir).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nbdcopy(d: &Daemon, export: &str, to: &Path) {
    common::run(Command::new("nbdcopy").arg(d.uri(export)).arg(to));
}

#[test]
fn incremental_backup_copies_only_changed_blocks() {
    for t in [
        "nbdinfo",
        "nbdcopy",
        "nbdfuse",
        "qemu-img",
        "qemu-io",
        "fusermount3",
    ] {
        need(t);
    }
    let d = Daemon::start("cbt-backup");
    let changed = pool_with_history(&d);

    // the full backup of snapshot 1, then only what changed up to snapshot 2
    let backup = d.dir.path("backup.raw");
    nbdcopy(&d, "s1", &backup);
    let dirty: Vec<(u64, u64)> = map(&d, "s2", "qemu:dirty-bitmap:1")
        .unwrap()
        .into_iter()
        .filter(|e| e.2 & 1 == 1)
        .map(|e| (e.0, e.1))
        .collect();
    let moved: u64 = dirty.iter().map(|e| e.1).sum();
    assert_eq!(moved, changed, "changed extents {dirty:?}");
    let before = std::fs::read(&backup).unwrap();
    {
        let fuse = Fuse::new(&d, "s2");
        let src = std::fs::File::open(fuse.file()).unwrap();
        let dst = std::fs::OpenOptions::new().write(true).open(&backup).unwrap();
        for (off, len) in &dirty {
            let mut buf = vec![0u8; *len as usize];
            src.read_exact_at(&mut buf, *off).unwrap();
            dst.write_all_at(&buf, *off).unwrap();
        }
    }
    // equals a full copy of snapshot 2
    let full2 = d.dir.path("full2.raw");
    nbdcopy(&d, "s2", &full2);
    let full2 = std::fs::read(&full2).unwrap();
    assert!(
        std::fs::read(&backup).unwrap() == full2,
        "the incremental backup differs from a full copy of snapshot 2"
    );
    assert!(before != full2, "snapshot 1 and 2 should differ");
    // the live volume against snapshot 2: nothing changed since
    let since: u64 = map(&d, "vol", "qemu:dirty-bitmap:2")
        .unwrap()
        .iter()
        .filter(|e| e.2 & 1 == 1)
        .map(|e| e.1)
        .sum();
    assert_eq!(since, 0);
    // base:allocation still answers beside it
    assert!(map(&d, "s2", "base:allocation").unwrap().iter().any(|e| e.2 == 0));
}

#[test]
fn unknown_contexts_and_unrelated_bases_are_refused() {
    need("nbdinfo");
    let d = Daemon::start("cbt-refuse");
    pool_with_history(&d);
    // an unrelated volume with data of its own
    d.ok(&["message", "pool", "0", "create_thin 7"]);
    d.create("other", "0 524288 thin /dev/mapper/pool 7");
    common::run(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write -P 1 0 1M"])
            .arg(d.uri("other")),
    );
    for (ctx, why) in [
        ("qemu:dirty-bitmap:9", "thin device 9 does not exist"),
        ("qemu:dirty-bitmap:7", "not an ancestor"),
        ("qemu:dirty-bitmap:2", "the device itself"),
        ("qemu:dirty-bitmap:x", "not a thin device id"),
    ] {
        let e = map(&d, "s2", ctx).unwrap_err();
        assert!(e.contains("does not support"), "{ctx}: {e}");
        assert!(
            d.log().contains(&format!("meta context '{ctx}' refused")) && d.log().contains(why),
            "{ctx}: no log line saying '{why}':\n{}",
            d.log()
        );
    }
    let e = map(&d, "s2", "foo:bar").unwrap_err();
    assert!(e.contains("does not support"), "{e}");
    assert!(d.log().contains("unknown meta context 'foo:bar'"));
    // a linear device keeps no changed blocks
    let lin = d.dir.path("lin.img");
    std::fs::File::create(&lin).unwrap().set_len(MIB).unwrap();
    d.create("lin", &format!("0 2048 linear {} 0", lin.display()));
    assert!(map(&d, "lin", "qemu:dirty-bitmap:1").is_err());
}

#[test]
fn online_ls_and_delta_match_the_reference() {
    need("qemu-io");
    let d = Daemon::start("cbt-online");
    pool_with_history(&d);
    let meta = d.dir.path("meta.img");
    let fields =
        "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS,HIGHEST_BLOCK,TRANSACTION,CREATE_TIME,SNAP_TIME";
    let online = |args: &[&str]| {
        let mut a = vec!["thin"];
        a.extend_from_slice(args);
        a.push("/dev/mapper/pool");
        let o = Command::new(env!("CARGO_BIN_EXE_dmkit"))
            .args(&a)
            .env("DMKIT_RUN_DIR", &d.run)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{a:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    };
    let ls = online(&["ls", "-o", fields]);
    let delta = online(&["delta", "--snap1", "1", "--snap2", "2", "--verbose"]);
    let delta_vol = online(&["delta", "--snap1", "2", "--snap2", "0"]);
    // the pool committed for them; suspended, the file is what the reference reads
    d.ok(&["suspend", "pool"]);
    let reference = |tool: &str, args: &[&str]| {
        let o = Command::new(thin_util::tool(tool))
            .args(args)
            .arg(&meta)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{tool}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    };
    assert_eq!(ls, reference("thin_ls", &["-o", fields]));
    assert_eq!(
        delta,
        reference("thin_delta", &["--snap1", "1", "--snap2", "2", "--verbose"])
    );
    assert_eq!(
        delta_vol,
        reference("thin_delta", &["--snap1", "2", "--snap2", "0"])
    );
    d.ok(&["resume", "pool"]);
    assert!(ls.lines().count() == 4, "{ls}");
    // an unknown device: the reference's words
    let o = Command::new(env!("CARGO_BIN_EXE_dmkit"))
        .args([
            "thin",
            "delta",
            "--snap1",
            "1",
            "--snap2",
            "9",
            "/dev/mapper/pool",
        ])
        .env("DMKIT_RUN_DIR", &d.run)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim_end(),
        "Unable to find mapping tree for snap2 (9)"
    );
}

/// A metadata error met by block status fails the request, names the block in
/// the log, and puts the pool in the kernel's failure mode (read-only,
/// needs_check): never a "hole" a copy would skip.
#[test]
fn block_status_on_damaged_metadata_fails_the_request_and_the_pool() {
    need("nbdinfo");
    let d = Daemon::start("cbt-damage");
    pool_with_history(&d);
    for n in ["s2", "s1", "vol", "pool"] {
        d.ok(&["remove", n]);
    }
    // a fresh daemon on a copy: nothing of the pool cached
    let d2 = Daemon::start("cbt-damage2");
    for f in ["meta.img", "data.img"] {
        std::fs::copy(d.dir.path(f), d2.dir.path(f)).unwrap();
    }
    drop(d);
    let d = d2;
    // the root of volume 0's mapping tree (an internal node: 1,000+ mappings)
    let meta = d.dir.path("meta.img");
    let root = {
        let mut tm =
            dmkit::pdata::tm::reader(Box::new(dmkit::pdata::FileDev::open(&meta, false).unwrap()), 64);
        let sb = dmkit::thin::metadata::read_superblock(&mut tm.cache).unwrap();
        let plan = dmkit::thin::ir::plan_of(&mut tm, &sb).unwrap();
        plan.devices.iter().find(|x| x.0 == 0).unwrap().2
    };
    let f = std::fs::OpenOptions::new().write(true).open(&meta).unwrap();
    f.write_all_at(&[0xff; 16], root * 4096 + 64).unwrap();
    drop(f);
    let data = d.dir.path("data.img");
    d.create(
        "pool",
        &format!("0 2097152 thin-pool {} {} 128 0", meta.display(), data.display()),
    );
    d.create("vol", "0 524288 thin /dev/mapper/pool 0");
    let e = map(&d, "vol", "base:allocation").unwrap_err();
    assert!(!e.is_empty());
    let status = d.ok(&["status", "pool"]);
    assert!(
        status.contains(" ro ") && status.contains("needs_check"),
        "{status}"
    );
    let log = d.log();
    assert!(
        log.contains("block status") && log.contains(&format!("metadata block {root}")),
        "{log}"
    );
}
