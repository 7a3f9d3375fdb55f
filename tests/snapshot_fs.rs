//! The snapshot family under a real filesystem, as users run it:
//! - ext4 on a `snapshot-origin` through nbdfuse and a loop device: a snapshot
//!   taken with the filesystem frozen keeps the files while the origin changes
//!   (e2fsck passes on it), and merging it back gives the origin those files.
//! - Seed 002's device: `dmkit extents` turns a fragmented, preallocated file
//!   into a `linear` table over the block device holding it, one segment per
//!   extent; the device reads and writes the file's bytes.

use crate::common;

use common::fs::{check_files, cmd, must, write_files, Attach, FileSet, FS_TOOLS};
use common::nbd::Client;
use common::{need_all, pattern, read_all, Daemon, Scratch};
use std::io::Write;
use std::process::Command;

use common::MIB;

fn files(first_seed: u64, n: u64) -> FileSet {
    (0..n)
        .map(|i| {
            (
                format!("d{}/f{i}", i % 3),
                first_seed + i,
                (i as usize * 5 + 3) * 7_919,
            )
        })
        .collect()
}

#[test]
fn ext4_snapshot_keeps_files_and_merges_back() {
    need_all(FS_TOOLS);
    need_all(&["fsfreeze"]);
    let d = Daemon::start("snap-ext4");
    let base = d.dir.0.clone();
    const SIZE: u64 = 64 * MIB;
    let sectors = SIZE / 512;
    let origin = d.dir.sparse("origin", SIZE);
    let cow = d.dir.sparse("cow", 32 * MIB);
    let (o, w) = (origin.display(), cow.display());
    d.create("lv", &format!("0 {sectors} snapshot-origin {o}"));
    let before = files(100, 20);
    let mut fs = Attach::new(&d, &base, "lv", false);
    must(&mut cmd("mkfs.ext4", &["-q", "-F", fs.dev()]), 60);
    fs.mount("rw");
    write_files(&fs.mnt, &before);
    fs.sync();
    // the snapshot, as lvcreate -s takes it: filesystem frozen, origin suspended
    let m = fs.mnt.to_str().expect("path").to_string();
    must(&mut cmd("fsfreeze", &["-f", &m]), 30);
    d.ok(&["suspend", "lv"]);
    d.create("snap", &format!("0 {sectors} snapshot {o} {w} P 16"));
    d.ok(&["resume", "lv"]);
    must(&mut cmd("fsfreeze", &["-u", &m]), 30);
    // the origin changes: files overwritten, removed, added
    let after = files(900, 12);
    write_files(&fs.mnt, &after);
    for (name, _, _) in &before[12..16] {
        std::fs::remove_file(fs.mnt.join(name)).expect("remove");
    }
    fs.sync();
    check_files(&fs.mnt, &after, "origin after the changes");
    let (alloc, meta) = {
        let st = d.ok(&["status", "snap"]);
        let f: Vec<&str> = st.split_whitespace().collect();
        let a: u64 = f[3]
            .split('/')
            .next()
            .and_then(|x| x.parse().ok())
            .expect("status");
        (a, f[4].parse::<u64>().expect("status"))
    };
    assert!(alloc > meta, "the origin's changes were copied to the snapshot");
    // the snapshot holds the files as they were, and is a clean filesystem
    {
        let mut sn = Attach::new(&d, &base, "snap", true);
        sn.fsck();
        sn.mount("ro,noload");
        check_files(&sn.mnt, &before, "snapshot");
        sn.umount();
    }
    // merge back: the origin, unmounted, takes the snapshot-merge table
    fs.umount();
    drop(fs);
    d.start_merge("lv", "snap", &format!("0 {sectors} snapshot-merge {o} {w} P 16"));
    d.remove_closed("snap");
    assert_eq!(d.ok(&["progress", "lv"]).trim(), "lv: merged");
    let mut fs = Attach::new(&d, &base, "lv", false);
    fs.fsck();
    fs.mount("rw");
    check_files(&fs.mnt, &before, "origin after the merge");
    for (name, _, _) in &after {
        if !before.iter().any(|b| &b.0 == name) {
            assert!(!fs.mnt.join(name).exists(), "{name} was made after the snapshot");
        }
    }
}

#[test]
fn extents_table_over_a_fragmented_file() {
    need_all(&["losetup", "mkfs.ext4", "mount", "umount", "fallocate"]);
    let s = Scratch::new("extents");
    let img = s.sparse("fs.img", 64 * MIB);
    must(
        &mut cmd(
            "mkfs.ext4",
            &["-q", "-F", "-b", "4096", img.to_str().expect("path")],
        ),
        60,
    );
    let mnt = s.path("mnt");
    std::fs::create_dir_all(&mnt).expect("mkdir");
    let lo = must(
        &mut cmd("losetup", &["--show", "-f", img.to_str().expect("path")]),
        30,
    )
    .trim()
    .to_string();
    let mnt_s = mnt.to_str().expect("path").to_string();
    must(&mut cmd("mount", &[&lo, &mnt_s]), 30);
    struct Cleanup(String, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.1).status();
            let _ = Command::new("losetup").args(["-d", &self.0]).status();
        }
    }
    let _c = Cleanup(lo.clone(), mnt_s.clone());
    // fragment the free space: 600 small files, every other one removed
    for i in 0..600 {
        std::fs::write(mnt.join(format!("s{i}")), pattern(i, 16 * 1024)).expect("write");
    }
    must(&mut cmd("sync", &["-f", &mnt_s]), 30);
    // the rest of the free space taken, so the holes are all there is
    let avail: u64 = must(&mut cmd("df", &["--output=avail", "-B1", &mnt_s]), 30)
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .next()
        .expect("df avail");
    let filler = avail.saturating_sub(512 << 10).to_string();
    let fill_path = mnt.join("filler");
    must(
        &mut cmd("fallocate", &["-l", &filler, fill_path.to_str().expect("path")]),
        30,
    );
    for i in (0..600).step_by(2) {
        std::fs::remove_file(mnt.join(format!("s{i}"))).expect("rm");
    }
    must(&mut cmd("sync", &["-f", &mnt_s]), 30);
    let big = mnt.join("big");
    must(
        &mut cmd("fallocate", &["-l", "4M", big.to_str().expect("path")]),
        30,
    );
    // the file's bytes through the filesystem
    let data = pattern(77, 4 * MIB as usize);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&big)
        .and_then(|mut f| f.write_all(&data).and_then(|()| f.sync_all()))
        .expect("fill big");

    let d = Daemon::start("extents-d");
    let table = d.ok(&["extents", big.to_str().expect("path")]);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines.len() >= 64, "a fragmented file: {} extents", lines.len());
    let mut next = 0u64;
    for l in &lines {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert_eq!(
            (f[0].parse::<u64>().ok(), f[2], f[3]),
            (Some(next), "linear", lo.as_str()),
            "{l}"
        );
        next += f[1].parse::<u64>().expect("length");
    }
    assert_eq!(next, 4 * MIB / 512, "the table covers the file");
    let out = d.cli_in(&["create", "seg"], &table);
    assert!(out.status.success(), "create from stdin: {out:?}");
    let mut c = Client::connect(&d.sock(), "seg");
    assert!(
        read_all(&mut c, 4 * MIB) == data,
        "the device reads the file's bytes"
    );
    // a write through the device is the file's new content
    let new = pattern(78, 256 * 1024);
    c.write(MIB + 4096, &new);
    drop(c);
    d.remove_closed("seg");
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches");
    let got = std::fs::read(&big).expect("read big");
    assert!(
        got[MIB as usize + 4096..MIB as usize + 4096 + new.len()] == new[..],
        "the file holds what was written through the device"
    );
    // a file that is not fully allocated is refused, naming the hole
    let sparse = mnt.join("sparse");
    std::fs::File::create(&sparse)
        .and_then(|f| f.set_len(MIB))
        .expect("sparse");
    let e = d.fails(&["extents", sparse.to_str().expect("path")]);
    assert!(e.contains("a hole at byte 0"), "{e}");
}
