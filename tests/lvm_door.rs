//! LVM through the dm ioctl door: Debian's unmodified `lvm` (through libdevmapper)
//! drives the real daemon by `dmkit exec`, on loop devices over files. What dmkit
//! holds is checked against what LVM's own metadata says (`lvs --segments`), and
//! data written through a dmkit device over NBD is read back from the loop files
//! at the place that metadata names.

use crate::common;
use common::{nbd, pattern, read_at, Daemon};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Command, Output};

use common::MIB;

/// Lines LVM may print on stderr here, each with why; any other line fails.
const EXPECTED_STDERR: &[(&str, &str)] = &[
    (
        "WARNING: Logical volume",
        "`lvcreate -Zn -Wn` skips zeroing, as asked (the first test leaves it out; the second has LVM zero through the device files)",
    ),
    (
        "WARNING: Detected error segment type does not match expected type striped",
        "the repair test fails a leg by loading an `error` table over its image (what a dead PV looks like \
         to dm-raid); LVM notices that table before it replaces the image",
    ),
    (
        ": mknod for ",
        "libdevmapper makes /dev/mapper nodes itself under DM_DISABLE_UDEV; without ublk a dmkit \
         device has no block device and this host has no /dev/mapper (docs/manual/door.md says so)",
    ),
];

/// Loop devices over files, detached at the end.
struct Loops(Vec<String>);

impl Drop for Loops {
    fn drop(&mut self) {
        for l in &self.0 {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
    }
}

struct Lvm<'a> {
    d: &'a Daemon,
    devices: String,
    /// `--config` for every command (empty: none).
    config: String,
}

impl Lvm<'_> {
    fn run(&self, args: &[&str]) -> Output {
        common::only_std_fds(&mut self.d.exec())
            .arg(common::tool_path("lvm"))
            .arg(args[0])
            .args(["--devices", &self.devices])
            .args(if self.config.is_empty() {
                vec![]
            } else {
                vec!["--config", self.config.as_str()]
            })
            .args(&args[1..])
            .output()
            .expect("spawn dmkit exec lvm")
    }

    /// `lvm ARGS` must succeed with no stderr line but the expected ones; its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            o.status.success(),
            "lvm {args:?}: {}\nstderr: {err}\nstdout: {}",
            o.status,
            String::from_utf8_lossy(&o.stdout)
        );
        for line in err.lines() {
            assert!(
                EXPECTED_STDERR.iter().any(|(w, _)| line.contains(w)),
                "lvm {args:?}: unexpected on stderr: {line}\n(all of stderr: {err})"
            );
        }
        String::from_utf8_lossy(&o.stdout).into_owned()
    }
}

/// "major:minor" of a block device node.
fn rdev(node: &str) -> String {
    let m = std::fs::metadata(node).expect("stat loop device");
    let r = m.rdev();
    format!("{}:{}", libc::major(r), libc::minor(r))
}

/// Where LVM's metadata says the LVs of `vg` lie: the table each should have, built
/// from `lvs --segments` (segment start and size in extents, stripes, stripe size,
/// PE ranges), the PVs' first extent and the extent size: (dm name, table lines).
fn tables_from_metadata(lvm: &Lvm, vg: &str, loops: &[String]) -> Vec<(String, String)> {
    let ext = lvm.ok(&[
        "vgs",
        "--noheadings",
        "--units",
        "s",
        "--nosuffix",
        "-o",
        "vg_extent_size",
        vg,
    ]);
    let ext: u64 = ext.trim().parse().expect("extent size");
    let mut pe_start = std::collections::HashMap::new();
    for l in lvm
        .ok(&[
            "pvs",
            "--noheadings",
            "--units",
            "s",
            "--nosuffix",
            "-o",
            "pv_name,pe_start",
        ])
        .lines()
    {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.len() == 2 {
            pe_start.insert(w[0].to_string(), w[1].parse::<u64>().expect("pe_start"));
        }
    }
    let segs = lvm.ok(&[
        "lvs",
        "--segments",
        "--noheadings",
        "--units",
        "s",
        "--nosuffix",
        "--separator",
        ";",
        "-o",
        "lv_name,seg_start_pe,seg_size_pe,stripes,stripe_size,seg_pe_ranges",
        vg,
    ]);
    let mut out: Vec<(String, String)> = Vec::new();
    for l in segs.lines() {
        let w: Vec<&str> = l.trim().split(';').collect();
        assert_eq!(w.len(), 6, "lvs line: {l}");
        let name = format!("{vg}-{}", w[0]);
        let start: u64 = w[1].parse().expect("seg_start_pe");
        let size: u64 = w[2].parse().expect("seg_size_pe");
        let stripes: u64 = w[3].parse().expect("stripes");
        let mut devs = Vec::new();
        for r in w[5].split_whitespace() {
            let (pv, range) = r.rsplit_once(':').expect("pv:range");
            let first: u64 = range
                .split('-')
                .next()
                .and_then(|x| x.parse().ok())
                .expect("first pe");
            assert!(
                loops.iter().any(|x| x == pv),
                "segment on {pv}, not one of {loops:?}"
            );
            devs.push(format!("{} {}", rdev(pv), pe_start[pv] + first * ext));
        }
        let target = if stripes == 1 {
            format!("linear {}", devs[0])
        } else {
            let chunk: u64 = w[4].parse().expect("stripe_size");
            format!("striped {stripes} {chunk} {}", devs.join(" "))
        };
        let line = format!("{} {} {target}", start * ext, size * ext);
        match out.iter_mut().find(|(n, _)| *n == name) {
            Some((_, t)) => {
                t.push('\n');
                t.push_str(&line);
            }
            None => out.push((name, line)),
        }
    }
    out.sort();
    out
}

/// Every device dmkit holds and its table, as `dmkit table` prints them.
fn dmkit_tables(d: &Daemon) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let all = d.ok(&["table"]);
    if all.trim() == "No devices found" {
        return out;
    }
    for l in all.lines() {
        let (name, line) = l.split_once(": ").expect("NAME: table line");
        match out.iter_mut().find(|(n, _)| n == name) {
            Some((_, t)) => {
                t.push('\n');
                t.push_str(line);
            }
            None => out.push((name.to_string(), line.to_string())),
        }
    }
    out.sort();
    out
}

/// The bytes at `sector` of loop device `node`, read from the file under it.
fn on_loop(files: &[(String, PathBuf)], node: &str, sector: u64, len: usize) -> Vec<u8> {
    let f = &files.iter().find(|(l, _)| l == node).expect("loop file").1;
    read_at(f, sector * 512, len)
}

fn loop_of(files: &[(String, PathBuf)], rdev_s: &str) -> String {
    files
        .iter()
        .find(|(l, _)| rdev(l) == rdev_s)
        .map(|(l, _)| l.clone())
        .expect("loop device of the table")
}

/// Write a pattern at the start of each of `vg`'s LVs over NBD (flushed), and check
/// each stripe chunk or extent landed on the loop file where the table (equal to
/// LVM's metadata) puts it.
fn write_and_find(d: &Daemon, tables: &[(String, String)], files: &[(String, PathBuf)], seed: u64) {
    for (i, (name, table)) in tables.iter().enumerate() {
        let data = pattern(seed + i as u64, 256 * 1024);
        let mut c = nbd::Client::connect(&d.sock(), name);
        c.write(0, &data);
        assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush of {name}");
        // the first segment covers the first 256 KiB of every LV made here
        let w: Vec<&str> = table.lines().next().expect("a line").split_whitespace().collect();
        match w[2] {
            "linear" => {
                let got = on_loop(
                    files,
                    &loop_of(files, w[3]),
                    w[4].parse().expect("offset"),
                    data.len(),
                );
                assert!(
                    got == data,
                    "{name}: the data is not where LVM's metadata puts it"
                );
            }
            "striped" => {
                let (n, chunk): (usize, u64) = (w[3].parse().expect("stripes"), w[4].parse().expect("chunk"));
                let cb = (chunk * 512) as usize;
                for (k, piece) in data.chunks(cb).enumerate() {
                    let s = k % n;
                    let node = loop_of(files, w[5 + 2 * s]);
                    let off: u64 = w[6 + 2 * s].parse().expect("offset");
                    let got = on_loop(files, &node, off + (k / n) as u64 * chunk, piece.len());
                    assert!(
                        got == piece,
                        "{name}: stripe chunk {k} is not where LVM's metadata puts it"
                    );
                }
            }
            other => panic!("{name}: unexpected target {other}"),
        }
    }
}

/// A loop device over `f`: its node.
fn losetup(f: &std::path::Path) -> String {
    common::run(Command::new("losetup").args(["-f", "--show"]).arg(f))
        .trim()
        .to_string()
}

/// Two loop devices over 64 MiB files of the daemon's scratch folder (filled with
/// `fill` when given), each with its file.
fn loop_files(d: &Daemon, fill: Option<u8>) -> (Loops, Vec<(String, PathBuf)>) {
    loop_files_n(d, fill, 2)
}

/// `n` loop devices over files of 64 MiB (filled with `fill`, or sparse).
fn loop_files_n(d: &Daemon, fill: Option<u8>, n: usize) -> (Loops, Vec<(String, PathBuf)>) {
    let mut files = Vec::new();
    let mut loops = Loops(Vec::new());
    for n in (0..n).map(|i| format!("pv{i}")) {
        let f = d.dir.sparse(&n, 64 * MIB);
        if let Some(b) = fill {
            std::fs::write(&f, vec![b; (64 * MIB) as usize]).expect("fill the loop file");
        }
        let node = losetup(&f);
        loops.0.push(node.clone());
        files.push((node, f));
    }
    (loops, files)
}

/// `dmkit exec -- ARGS` must succeed; its stdout.
fn door_ok(d: &Daemon, args: &[&str]) -> String {
    let o = d.exec().args(args).output().expect("spawn dmkit exec");
    assert!(
        o.status.success(),
        "{args:?}: {}\nstderr: {}\nstdout: {}",
        o.status,
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn lvm_linear_and_striped_through_the_door() {
    common::need_all(&["losetup", "lvm"]);
    let d = Daemon::start("lvm");
    let (loops, files) = loop_files(&d, None);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: String::new(),
    };
    let vg = new_vg(&lvm, &loops, "dmkit");

    lvm.ok(&["lvcreate", "-Zn", "-Wn", "-L", "16M", "-n", "lin", &vg]);
    lvm.ok(&[
        "lvcreate", "-Zn", "-Wn", "-i2", "-I64", "-L", "16M", "-n", "str", &vg,
    ]);
    let want = tables_from_metadata(&lvm, &vg, &loops.0);
    assert_eq!(want.len(), 2, "two LVs in {want:?}");
    assert_eq!(
        dmkit_tables(&d),
        want,
        "the tables dmkit holds are the ones LVM's metadata describes"
    );
    assert!(
        want[1].1.contains(" striped 2 128 "),
        "str is striped over both PVs: {want:?}"
    );
    write_and_find(&d, &want, &files, 1);
    let lvs = lvm.ok(&["lvs", "--noheadings", "-o", "lv_name,lv_attr", &vg]);
    for l in lvs.lines() {
        let attr = l.split_whitespace().nth(1).expect("lv_attr");
        assert_eq!(attr.as_bytes()[4], b'a', "LVM sees every LV active: {lvs}");
    }

    // grow: a second segment, loaded and resumed through the door
    lvm.ok(&["lvextend", "-L", "+8M", &format!("{vg}/lin")]);
    let want = tables_from_metadata(&lvm, &vg, &loops.0);
    assert_eq!(
        want[0].1.lines().count(),
        2,
        "lin has two segments after lvextend: {want:?}"
    );
    assert_eq!(dmkit_tables(&d), want, "after lvextend");
    let lin_sectors: u64 = want[0]
        .1
        .lines()
        .map(|l| {
            l.split_whitespace()
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .expect("length")
        })
        .sum();
    assert_eq!(lin_sectors, 24 * MIB / 512, "lin grew to 24 MiB: {want:?}");

    lvm.ok(&["lvrename", &vg, "str", "str2"]);
    let want = tables_from_metadata(&lvm, &vg, &loops.0);
    assert_eq!(dmkit_tables(&d), want, "after lvrename");

    // deactivate: every device goes; activate: they come back with the data
    lvm.ok(&["vgchange", "-an", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgchange -an removed every device");
    lvm.ok(&["vgchange", "-ay", &vg]);
    assert_eq!(dmkit_tables(&d), want, "after vgchange -ay");
    for (i, (name, _)) in want.iter().enumerate() {
        let mut c = nbd::Client::connect(&d.sock(), name);
        assert!(
            c.read(0, 256 * 1024) == pattern(1 + i as u64, 256 * 1024),
            "{name}: data read back after vgchange -an/-ay"
        );
    }
    write_and_find(&d, &want, &files, 7);

    lvm.ok(&["lvremove", "-y", &format!("{vg}/lin")]);
    assert_eq!(dmkit_tables(&d).len(), 1, "lvremove removed lin's device");
    lvm.ok(&["vgremove", "-y", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgremove removed every device");
    let mut args = vec!["pvremove", "-y"];
    args.extend(loops.0.iter().map(String::as_str));
    lvm.ok(&args);
}

/// Without ublk, an LV still opens as a block device behind the door: the door
/// opens the device's file the daemon serves (src/export/files.rs). So LVM zeroes
/// a new LV's start itself (no `-Zn -Wn`), `mkfs.ext4`, `debugfs` and `e2fsck`
/// work on `/dev/VG/LV`, and an open counts in the device's open count, as
/// LVM's "in use" check expects.
#[test]
fn lvm_volumes_open_as_block_devices_through_the_door() {
    common::need_all(&["losetup", "lvm", "mkfs.ext4", "debugfs", "e2fsck", "blockdev"]);
    let d = Daemon::start("lvmfiles");
    // every byte of the PVs is 0xa5 before LVM starts: zeroes come from LVM
    let (loops, files) = loop_files(&d, Some(0xa5));
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: String::new(),
    };
    let vg = new_vg(&lvm, &loops, "dmkitf");
    lvm.ok(&["lvcreate", "-y", "-L", "16M", "-n", "fs", &vg]);
    let want = tables_from_metadata(&lvm, &vg, &loops.0);
    assert_eq!(dmkit_tables(&d), want, "the table LVM's metadata describes");
    let w: Vec<&str> = want[0].1.split_whitespace().collect();
    assert_eq!(w[2], "linear", "{want:?}");
    let (node, start) = (loop_of(&files, w[3]), w[4].parse::<u64>().expect("offset"));
    assert!(
        on_loop(&files, &node, start, 4096).iter().all(|&b| b == 0),
        "LVM zeroed the new LV's first 4 KiB through the door, on the loop device where its metadata puts it"
    );

    let lv = format!("/dev/{vg}/fs");
    assert_eq!(
        door_ok(&d, &["blockdev", "--getsize64", "--getss", &lv]),
        format!("{}\n512\n", 16 * MIB),
        "the LV's size and sector size, as block device ioctls answer them"
    );
    door_ok(&d, &["mkfs.ext4", "-q", &lv]);
    let host = d.dir.path("hello.txt");
    std::fs::write(&host, "hello through the door\n").expect("write hello.txt");
    door_ok(
        &d,
        &[
            "debugfs",
            "-w",
            "-R",
            &format!("write {} hello", host.display()),
            &lv,
        ],
    );
    door_ok(&d, &["e2fsck", "-fn", &lv]);
    assert_eq!(
        door_ok(&d, &["debugfs", "-R", "cat hello", &lv]),
        "hello through the door\n",
        "the file written into the filesystem on the LV reads back"
    );
    // the filesystem is on the loop device, at the LV's place: its superblock magic
    let sb = on_loop(&files, &node, start + 2, 1024);
    assert_eq!(
        &sb[56..58],
        &[0x53, 0xef],
        "ext4's magic at the LV's byte 1080 on the PV"
    );

    // an open holds the LV: LVM refuses to remove it while it is open
    let dm_name = want[0].0.clone();
    let mut holder = Command::new(common::BIN)
        .arg("--run-dir")
        .arg(&d.run)
        .args([
            "exec",
            "--",
            "sh",
            "-c",
            &format!("exec 3<{lv}; echo held; exec sleep 60"),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the holder");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(holder.stdout.take().expect("holder stdout")),
        &mut line,
    )
    .expect("holder says held");
    assert_eq!(line, "held\n");
    d.wait_open_count(&dm_name, 1);
    let o = lvm.run(&["lvremove", "-y", &format!("{vg}/fs")]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("in use"),
        "lvremove of an open LV is refused as in use: {err}"
    );
    let _ = holder.kill();
    let _ = holder.wait();
    d.wait_open_count(&dm_name, 0);
    lvm.ok(&["lvremove", "-y", &format!("{vg}/fs")]);
    assert_eq!(dmkit_tables(&d), vec![], "lvremove removed the device");
    remove_vg(&lvm, &loops, &vg);
}

/// LVM's thin pools through the door without ublk: the pool's metadata and data
/// are LVM's `_tmeta` and `_tdata`, dmkit devices under the `thin-pool` target
/// (read and written through their tables); LVM runs dmkit's `thin_check` on
/// `_tmeta` (through the door too) at every activation; a thin, a thin snapshot,
/// `lvextend` of the pool (its `_tdata` grows a second segment while the pool's
/// stack is loaded before it is resumed, as libdevmapper does), `vgchange -an`
/// and `-ay`, with the data read back through the LVs' block devices.
#[test]
fn lvm_thin_pools_and_snapshots_through_the_door() {
    common::need_all(&["losetup", "lvm", "dd", "cmp"]);
    let d = Daemon::start("lvmthin");
    let (loops, _files) = loop_files(&d, None);
    // LVM's thin_check is dmkit's (the multi-call name), through a script that
    // records each run
    let bin = d.dir.path("bin");
    std::fs::create_dir_all(&bin).expect("bin dir");
    let link = bin.join("dmkit-thin_check");
    std::fs::create_dir_all(&link).expect("link dir");
    std::os::unix::fs::symlink(
        std::fs::canonicalize(common::BIN).expect("dmkit path"),
        link.join("thin_check"),
    )
    .expect("thin_check link");
    let runs = d.dir.path("thin_check.runs");
    let script = bin.join("thin_check");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n{}/thin_check \"$@\"\nrc=$?\necho \"$* rc=$rc\" >> {}\nexit $rc\n",
            link.display(),
            runs.display()
        ),
    )
    .expect("script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).expect("chmod");
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        // no monitoring: the machine has one dmeventd, and
        // dmeventd_grows_a_thin_pool_past_its_autoextend_threshold has it
        config: format!(
            "global/thin_check_executable=\"{}\" activation/monitoring=0",
            script.display()
        ),
    };
    let vg = new_vg(&lvm, &loops, "dmkitt");
    lvm.ok(&[
        "lvcreate",
        "-y",
        "--type",
        "thin-pool",
        "-L",
        "64M",
        "-n",
        "pool",
        &vg,
    ]);
    lvm.ok(&[
        "lvcreate",
        "-y",
        "-V",
        "24M",
        "-T",
        &format!("{vg}/pool"),
        "-n",
        "th1",
    ]);
    let tables = dmkit_tables(&d);
    let pool = tables
        .iter()
        .find(|(n, _)| n.ends_with("-tpool"))
        .unwrap_or_else(|| panic!("a -tpool device in {tables:?}"));
    let w: Vec<&str> = pool.1.split_whitespace().collect();
    assert_eq!(w[2], "thin-pool", "{pool:?}");
    let num = |suffix: &str| -> String {
        let name = format!("{vg}-pool{suffix}");
        let info = d.ok(&["info", &name]);
        let l = info
            .lines()
            .find(|l| l.starts_with("Major, minor"))
            .unwrap_or_else(|| panic!("{info}"));
        let (_, mm) = l.split_once(':').expect("Major, minor: M, N");
        mm.trim().replace(", ", ":")
    };
    assert_eq!(
        (w[3].to_string(), w[4].to_string()),
        (num("_tmeta"), num("_tdata")),
        "the pool's metadata and data are LVM's _tmeta and _tdata devices"
    );
    let ran = std::fs::read_to_string(&runs).unwrap_or_default();
    assert!(
        ran.lines()
            .any(|l| l.contains(&format!("{vg}-pool_tmeta")) && l.ends_with("rc=0")),
        "LVM ran dmkit's thin_check on _tmeta, which passed: {ran:?}"
    );

    let dir = d.dir.path("");
    let (a, b) = (dir.join("a"), dir.join("b"));
    std::fs::write(&a, pattern(1, 4 << 20)).expect("pattern a");
    std::fs::write(&b, pattern(2, 1 << 20)).expect("pattern b");
    let th1 = format!("/dev/{vg}/th1");
    let snap = format!("/dev/{vg}/snap1");
    let a_s = a.display().to_string();
    let b_s = b.display().to_string();
    door_ok(
        &d,
        &[
            "dd",
            &format!("if={a_s}"),
            &format!("of={th1}"),
            "bs=1M",
            "oflag=direct",
            "conv=fsync",
        ],
    );
    lvm.ok(&["lvcreate", "-y", "-s", "-n", "snap1", &format!("{vg}/th1")]);
    lvm.ok(&["lvchange", "-ay", "-K", &format!("{vg}/snap1")]);
    door_ok(
        &d,
        &[
            "dd",
            &format!("if={b_s}"),
            &format!("of={th1}"),
            "bs=1M",
            "oflag=direct",
            "conv=fsync",
        ],
    );
    let check = |d: &Daemon, when: &str| {
        door_ok(d, &["cmp", "-n", &(4u64 << 20).to_string(), &a_s, &snap]);
        door_ok(d, &["cmp", "-n", &(1u64 << 20).to_string(), &b_s, &th1]);
        door_ok(
            d,
            &[
                "cmp",
                "-n",
                &(3u64 << 20).to_string(),
                "-i",
                &(1u64 << 20).to_string(),
                &a_s,
                &th1,
            ],
        );
        let _ = when;
    };
    check(&d, "after the snapshot");

    // grow the pool: _tdata grows (a segment more, or a longer one)
    let tdata_sectors = |tables: &[(String, String)]| -> u64 {
        tables
            .iter()
            .find(|(n, _)| n.ends_with("pool_tdata"))
            .map(|(_, t)| {
                t.lines()
                    .map(|l| {
                        l.split_whitespace()
                            .nth(1)
                            .and_then(|x| x.parse::<u64>().ok())
                            .expect("length")
                    })
                    .sum()
            })
            .unwrap_or_else(|| panic!("{tables:?}"))
    };
    assert_eq!(
        tdata_sectors(&dmkit_tables(&d)),
        131072,
        "_tdata is the pool's 64 MiB"
    );
    lvm.ok(&["lvextend", "-L", "+32M", &format!("{vg}/pool")]);
    let size = lvm.ok(&[
        "lvs",
        "--noheadings",
        "--units",
        "m",
        "--nosuffix",
        "-o",
        "lv_size",
        &format!("{vg}/pool"),
    ]);
    assert_eq!(size.trim(), "96.00", "the pool grew");
    let tables = dmkit_tables(&d);
    assert_eq!(
        tdata_sectors(&tables),
        196608,
        "_tdata grew to 96 MiB: {tables:?}"
    );
    let pool = tables.iter().find(|(n, _)| n.ends_with("-tpool")).expect("tpool");
    assert!(
        pool.1.starts_with("0 196608 thin-pool "),
        "the pool's table grew with it: {pool:?}"
    );
    check(&d, "after lvextend");

    lvm.ok(&["vgchange", "-an", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgchange -an removed every device");
    lvm.ok(&["vgchange", "-ay", &vg]);
    lvm.ok(&["lvchange", "-ay", "-K", &format!("{vg}/snap1")]);
    check(&d, "after vgchange -an/-ay");
    let ran = std::fs::read_to_string(&runs).unwrap_or_default();
    assert!(
        ran.lines().filter(|l| l.ends_with("rc=0")).count() >= 2
            && !ran.lines().any(|l| !l.ends_with("rc=0")),
        "thin_check ran at each activation and passed: {ran:?}"
    );
    lvm.ok(&["lvremove", "-y", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "lvremove removed every device");
    remove_vg(&lvm, &loops, &vg);
}

/// The dmeventd processes running here whose environment carries the door (ours,
/// left by an earlier run), and whether another one runs.
fn dmeventds() -> (Vec<u32>, bool) {
    let mut ours = Vec::new();
    let mut foreign = false;
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if comm.trim() != "dmeventd" {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if env.windows(17).any(|w| w == b"DMKIT_DOOR_SOCKET") {
            ours.push(pid);
        } else if std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z ")) {
            foreign = true;
        }
    }
    (ours, foreign)
}

/// A dead PV under the dmkit device `name`: its table replaced by an `error`
/// table of the same length (as its I/O would fail).
fn fail_device(d: &Daemon, name: &str) {
    let t = d.ok(&["table", name]);
    let len = t.split_whitespace().nth(1).expect("its length").to_string();
    d.reload(name, &format!("0 {len} error"));
}

/// One dmeventd per machine: the tests that start one take turns (this lock
/// under `cargo test`; under nextest, whose tests are processes, the
/// `host-dmeventd` test group in .config/nextest.toml).
static DMEVENTD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn stop_our_dmeventds() {
    for pid in dmeventds().0 {
        let _ = Command::new("kill").arg(pid.to_string()).status();
    }
    for _ in 0..50 {
        if dmeventds().0.is_empty() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// LVM's thin-pool autoextend through the door: LVM starts Debian's unmodified
/// dmeventd to monitor the pool (it inherits the door from `dmkit exec`); its
/// thin plugin, woken by the timeouts that interrupt its DM_DEV_WAIT (EINTR, as
/// the kernel's), reads the pool's status through the door, finds it past
/// `thin_pool_autoextend_threshold` and runs `lvextend --use-policies`, which
/// grows `_tdata` and the pool, all without a kernel device-mapper.
#[test]
fn dmeventd_grows_a_thin_pool_past_its_autoextend_threshold() {
    common::need_all(&["losetup", "lvm", "dmeventd", "dd"]);
    let _one = DMEVENTD.lock().unwrap_or_else(|e| e.into_inner());
    stop_our_dmeventds();
    assert!(
        !dmeventds().1,
        "a dmeventd that dmkit's tests did not start is running: LVM would talk to it (one per machine); stop it first"
    );
    let d = Daemon::start("lvmevents");
    let f = d.dir.sparse("pv", 256 * MIB);
    let node = losetup(&f);
    let _loops = Loops(vec![node.clone()]);
    // the configuration dmeventd's plugin and the lvextend it runs read too
    let sys = d.dir.path("lvm");
    std::fs::create_dir_all(&sys).expect("lvm dir");
    let link = d.dir.path("tools");
    std::fs::create_dir_all(&link).expect("tools dir");
    std::os::unix::fs::symlink(
        std::fs::canonicalize(common::BIN).expect("dmkit"),
        link.join("thin_check"),
    )
    .expect("thin_check link");
    std::fs::write(
        sys.join("lvm.conf"),
        format!(
            "devices {{ global_filter = [ \"a|^{node}$|\", \"r|.*|\" ] }}\n\
             global {{ thin_check_executable = \"{}\" }}\n\
             activation {{ monitoring = 1 thin_pool_autoextend_threshold = 60 thin_pool_autoextend_percent = 50 }}\n",
            link.join("thin_check").display()
        ),
    )
    .expect("lvm.conf");
    let run = |args: &[&str]| -> String {
        let o = common::only_std_fds(&mut d.exec())
            .arg(common::tool_path("lvm"))
            .args(args)
            .env("LVM_SYSTEM_DIR", &sys)
            .output()
            .expect("spawn lvm");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "lvm {args:?}: {}\nstderr: {err}", o.status);
        // LVM's own check of descriptors leaked into it (the door's would be)
        assert!(!err.contains("leaked on lvm invocation"), "lvm {args:?}: {err}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let vg = format!("dmkite{}", std::process::id());
    run(&["pvcreate", &node]);
    run(&["vgcreate", &vg, &node]);
    run(&[
        "lvcreate",
        "-y",
        "--type",
        "thin-pool",
        "-L",
        "32M",
        "-n",
        "pool",
        &vg,
    ]);
    run(&[
        "lvcreate",
        "-y",
        "-V",
        "64M",
        "-T",
        &format!("{vg}/pool"),
        "-n",
        "th",
    ]);
    let pool = format!("{vg}/pool");
    assert_eq!(
        run(&["lvs", "--noheadings", "-o", "seg_monitor", &pool]).trim(),
        "monitored",
        "LVM has dmeventd monitor the pool"
    );
    assert_eq!(dmeventds().0.len(), 1, "LVM started one dmeventd, with the door");
    // 24 of the pool's 32 MiB: 75%, past the 60% threshold
    let th = format!("/dev/{vg}/th");
    door_ok(
        &d,
        &[
            "dd",
            "if=/dev/urandom",
            &format!("of={th}"),
            "bs=1M",
            "count=24",
            "oflag=direct",
            "conv=fsync",
        ],
    );
    let size = || -> String {
        run(&[
            "lvs",
            "--noheadings",
            "--units",
            "m",
            "--nosuffix",
            "-o",
            "lv_size",
            &pool,
        ])
        .trim()
        .to_string()
    };
    let start = std::time::Instant::now();
    while size() == "32.00" && start.elapsed() < std::time::Duration::from_secs(60) {
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    assert_eq!(size(), "48.00", "dmeventd grew the pool by 50% within 60 s");
    let tables = dmkit_tables(&d);
    let tpool = tables.iter().find(|(n, _)| n.ends_with("-tpool")).expect("tpool");
    assert!(
        tpool.1.starts_with("0 98304 thin-pool "),
        "the pool's table is 48 MiB: {tpool:?}"
    );
    let used = run(&["lvs", "--noheadings", "-o", "data_percent", &pool]);
    assert_eq!(used.trim(), "50.00", "24 of 48 MiB used");

    run(&["vgchange", "-an", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgchange -an removed every device");
    run(&["vgremove", "-y", &vg]);
    run(&["pvremove", "-y", &node]);
    stop_our_dmeventds();
}

/// dmeventd's raid plugin through the door (`raid_fault_policy = "allocate"`):
/// LVM has dmeventd monitor a raid1 LV; when a leg's image fails (an `error`
/// table over it) and a write marks it `D`, the event wakes the plugin, which
/// reads dmkit's status and runs `lvconvert --repair --use-policies` itself:
/// the image is replaced on the third PV and rebuilt, the array is `AA`, the
/// data is there.
#[test]
fn dmeventd_replaces_a_failed_raid1_leg_by_itself() {
    common::need_all(&["losetup", "lvm", "dmeventd"]);
    let _one = DMEVENTD.lock().unwrap_or_else(|e| e.into_inner());
    stop_our_dmeventds();
    assert!(
        !dmeventds().1,
        "a dmeventd that dmkit's tests did not start is running: LVM would talk to it (one per machine); stop it first"
    );
    let d = Daemon::start("lvmraidev");
    let (loops, _files) = loop_files_n(&d, None, 3);
    let sys = d.dir.path("lvm");
    std::fs::create_dir_all(&sys).expect("lvm dir");
    let filter: Vec<String> = loops.0.iter().map(|l| format!("\"a|^{l}$|\"")).collect();
    std::fs::write(
        sys.join("lvm.conf"),
        format!(
            "devices {{ global_filter = [ {}, \"r|.*|\" ] }}\n\
             activation {{ monitoring = 1 raid_fault_policy = \"allocate\" }}\n",
            filter.join(", ")
        ),
    )
    .expect("lvm.conf");
    let run = |args: &[&str]| -> String {
        let o = common::only_std_fds(&mut d.exec())
            .arg(common::tool_path("lvm"))
            .args(args)
            .env("LVM_SYSTEM_DIR", &sys)
            .output()
            .expect("spawn lvm");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "lvm {args:?}: {}\nstderr: {err}", o.status);
        assert!(!err.contains("leaked on lvm invocation"), "lvm {args:?}: {err}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let vg = format!("dmkitev{}", std::process::id());
    let mut a = vec!["pvcreate"];
    a.extend(loops.0.iter().map(String::as_str));
    run(&a);
    let mut a = vec!["vgcreate", vg.as_str()];
    a.extend(loops.0.iter().map(String::as_str));
    run(&a);
    run(&[
        "lvcreate",
        "-y",
        "--type",
        "raid1",
        "-m1",
        "-L",
        "8M",
        "-n",
        "ev",
        &vg,
        &loops.0[0],
        &loops.0[1],
    ]);
    let lv = format!("{vg}/ev");
    let top = format!("{vg}-ev");
    assert_eq!(
        run(&["lvs", "--noheadings", "-o", "seg_monitor", &lv]).trim(),
        "monitored",
        "LVM has dmeventd monitor the raid LV"
    );
    d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
    let data = pattern(45, 128 * 1024);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(MIB, &data);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    drop(c);
    d.wait_open_count(&top, 0);
    let img1 = format!("{vg}-ev_rimage_1");
    fail_device(&d, &img1);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(3 * MIB, &data);
    assert_eq!(
        c.call(nbd::FLUSH, 0, 0, 0, &[]),
        0,
        "the write goes on without the leg"
    );
    drop(c);
    d.wait_open_count(&top, 0);
    let start = std::time::Instant::now();
    let on_third = || {
        run(&["lvs", "-a", "--noheadings", "-o", "name,devices", &vg])
            .lines()
            .any(|l| l.contains("[ev_rimage_1]") && l.contains(loops.0[2].as_str()))
    };
    while !on_third() && start.elapsed() < std::time::Duration::from_secs(90) {
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    assert!(
        on_third(),
        "dmeventd replaced the failed image within 90 s: {}",
        d.log()
    );
    assert_eq!(
        d.wait_status(&top, " idle ", std::time::Duration::from_secs(60)),
        "0 16384 raid raid1 2 AA 16384/16384 idle 0 0 -"
    );
    let mut c = nbd::Client::connect(&d.sock(), &img1);
    assert!(c.read(MIB, data.len()) == data, "the new image: the first write");
    assert!(
        c.read(3 * MIB, data.len()) == data,
        "the new image: the write made without it"
    );
    drop(c);
    d.wait_open_count(&img1, 1);
    run(&["vgchange", "-an", &vg]);
    run(&["vgremove", "-y", &vg]);
    let mut a = vec!["pvremove", "-y"];
    a.extend(loops.0.iter().map(String::as_str));
    run(&a);
    stop_our_dmeventds();
}

/// LVM's classic snapshot and its merge through the door: `lvcreate -s` stacks
/// `snapshot-origin` over `LV-real` and `snapshot` over `-real` and `-cow` (the
/// snapshot's table loaded before `-real` is resumed, so its size is checked at
/// resume); the snapshot keeps the old data while the origin changes, and
/// `lvconvert --merge` runs `snapshot-merge` to the end, after which LVM removes
/// the snapshot and the origin holds the old data again.
#[test]
fn lvm_classic_snapshot_and_merge_through_the_door() {
    common::need_all(&["losetup", "lvm", "dd", "cmp"]);
    let d = Daemon::start("lvmsnap");
    let (loops, _files) = loop_files(&d, None);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: "activation/monitoring=0 global/use_lvmpolld=0".into(),
    };
    let vg = new_vg(&lvm, &loops, "dmkits");
    lvm.ok(&["lvcreate", "-y", "-L", "32M", "-n", "lin", &vg]);
    let dir = d.dir.path("");
    let (a, b) = (dir.join("a"), dir.join("b"));
    std::fs::write(&a, pattern(3, 8 << 20)).expect("pattern a");
    std::fs::write(&b, pattern(4, 1 << 20)).expect("pattern b");
    let (a_s, b_s) = (a.display().to_string(), b.display().to_string());
    let lin = format!("/dev/{vg}/lin");
    let snap = format!("/dev/{vg}/snap");
    door_ok(
        &d,
        &[
            "dd",
            &format!("if={a_s}"),
            &format!("of={lin}"),
            "bs=1M",
            "oflag=direct",
            "conv=fsync",
        ],
    );
    lvm.ok(&[
        "lvcreate",
        "-y",
        "-s",
        "-L",
        "16M",
        "-n",
        "snap",
        &format!("{vg}/lin"),
    ]);
    let tables = dmkit_tables(&d);
    let types: Vec<(String, String)> = tables
        .iter()
        .map(|(n, t)| {
            (
                n.trim_start_matches(&format!("{vg}-")).to_string(),
                t.split_whitespace().nth(2).unwrap_or("").to_string(),
            )
        })
        .collect();
    assert_eq!(
        types,
        vec![
            ("lin".to_string(), "snapshot-origin".to_string()),
            ("lin-real".to_string(), "linear".to_string()),
            ("snap".to_string(), "snapshot".to_string()),
            ("snap-cow".to_string(), "linear".to_string()),
        ],
        "LVM's snapshot stack: {tables:?}"
    );
    door_ok(
        &d,
        &[
            "dd",
            &format!("if={b_s}"),
            &format!("of={lin}"),
            "bs=1M",
            "oflag=direct",
            "conv=fsync",
        ],
    );
    door_ok(&d, &["cmp", "-n", &(8u64 << 20).to_string(), &a_s, &snap]);
    door_ok(&d, &["cmp", "-n", &(1u64 << 20).to_string(), &b_s, &lin]);
    let o = lvm.run(&["lvconvert", "-y", "--merge", &format!("{vg}/snap")]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && out.contains("has finished"),
        "lvconvert --merge: {}\n{out}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    let tables = dmkit_tables(&d);
    assert_eq!(
        tables.len(),
        1,
        "only the origin is left, linear again: {tables:?}"
    );
    assert!(tables[0].1.contains(" linear "), "{tables:?}");
    door_ok(&d, &["cmp", "-n", &(8u64 << 20).to_string(), &a_s, &lin]);
    remove_vg(&lvm, &loops, &vg);
}

/// `vgremove` of `vg`, then `pvremove` of its loop devices.
fn remove_vg(lvm: &Lvm, loops: &Loops, vg: &str) {
    lvm.ok(&["vgremove", "-y", vg]);
    let mut args = vec!["pvremove", "-y"];
    args.extend(loops.0.iter().map(String::as_str));
    lvm.ok(&args);
}

/// A new VG over two loop devices (named `prefix` + this process's id).
fn new_vg(lvm: &Lvm, loops: &Loops, prefix: &str) -> String {
    let vg = format!("{prefix}{}", std::process::id());
    let mut args = vec!["pvcreate"];
    args.extend(loops.0.iter().map(String::as_str));
    lvm.ok(&args);
    let mut args = vec!["vgcreate", vg.as_str()];
    args.extend(loops.0.iter().map(String::as_str));
    lvm.ok(&args);
    vg
}

/// A cache of LVM's kind `kind` attached to an LV holding an ext4 and split off
/// again: the top of the LV is the `target` table (over the devices `parts` end
/// with), a file written before the attach reads back through the cache, one
/// written through it survives the split, and the filesystem is clean on the
/// cache and on the bare LV after the split, which leaves it linear again.
fn cache_attach_and_split(
    tag: &str,
    kind: &str,
    target: &str,
    parts: &[&str],
    config: &str,
    attached: &str,
    split: &str,
) {
    common::need_all(&["losetup", "lvm", "mkfs.ext4", "debugfs", "e2fsck"]);
    let d = Daemon::start(tag);
    let (loops, _files) = loop_files(&d, None);
    let link = d.dir.path("tools");
    std::fs::create_dir_all(&link).expect("tools dir");
    std::os::unix::fs::symlink(
        std::fs::canonicalize(common::BIN).expect("dmkit"),
        link.join("cache_check"),
    )
    .expect("cache_check link");
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: format!(
            "activation/monitoring=0 global/use_lvmpolld=0 global/cache_check_executable=\"{}\" {config}",
            link.join("cache_check").display()
        ),
    };
    let vg = new_vg(&lvm, &loops, tag);
    lvm.ok(&["lvcreate", "-y", "-L", "32M", "-n", "lin", &vg, &loops.0[0]]);
    lvm.ok(&[
        "lvcreate",
        "-y",
        "-an",
        "-L",
        "16M",
        "-n",
        "fast",
        &vg,
        &loops.0[1],
    ]);
    let lv = format!("/dev/{vg}/lin");
    door_ok(&d, &["mkfs.ext4", "-q", "-b", "4096", &lv]);
    let files = [
        ("before", "written before the cache\n"),
        ("through", "written through the cache\n"),
    ];
    let put = |(name, text): (&str, &str)| {
        let host = d.dir.path(name);
        std::fs::write(&host, text).expect("write");
        door_ok(
            &d,
            &[
                "debugfs",
                "-w",
                "-R",
                &format!("write {} {name}", host.display()),
                &lv,
            ],
        );
    };
    let cat = |name: &str| door_ok(&d, &["debugfs", "-R", &format!("cat {name}"), &lv]);
    let top = |want: &str| {
        let tables = dmkit_tables(&d);
        let t = tables
            .iter()
            .find(|(n, _)| *n == format!("{vg}-lin"))
            .expect("lin");
        assert!(t.1.contains(&format!(" {want} ")), "lin is {want}: {tables:?}");
        tables
    };
    let run = |args: &[&str], says: &str| {
        let o = lvm.run(args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && out.contains(says),
            "lvm {args:?}: {out}\n{}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    put(files[0]);
    run(
        &[
            "lvconvert",
            "-y",
            "--type",
            kind,
            "--cachevol",
            "fast",
            &format!("{vg}/lin"),
        ],
        attached,
    );
    let tables = top(target);
    for p in parts {
        assert!(
            tables.iter().any(|(n, _)| n.ends_with(p)),
            "a {p} device: {tables:?}"
        );
    }
    assert_eq!(cat(files[0].0), files[0].1, "read through the cache");
    put(files[1]);
    door_ok(&d, &["e2fsck", "-fn", &lv]);
    run(&["lvconvert", "-y", "--splitcache", &format!("{vg}/lin")], split);
    top("linear");
    door_ok(&d, &["e2fsck", "-fn", &lv]);
    for (name, text) in files {
        assert_eq!(cat(name), text, "{name} after the split");
    }
    remove_vg(&lvm, &loops, &vg);
}

/// LVM's writecache through the door: `lvconvert --type writecache --cachevol`
/// stacks `writecache s` over `LV_wcorig` and the cache volume `_cvol` (both
/// dmkit devices), and `lvconvert --splitcache` (the `cleaner` message, then
/// waiting for the dirty blocks to drain, as LVM does) leaves it linear.
#[test]
fn lvm_writecache_attach_and_split_through_the_door() {
    cache_attach_and_split(
        "dmkitw",
        "writecache",
        "writecache s",
        &["_wcorig", "_cvol"],
        "",
        "now has writecache",
        "has been detached",
    );
}

/// LVM's cache (lvmcache) through the door: `lvconvert --type cache --cachevol`
/// splits the cache volume into `-cmeta` and `-cdata` and stacks the `cache`
/// target over them and `LV_corig`, all dmkit devices (the cache's metadata read
/// and written through `-cmeta`'s table), and `lvconvert --splitcache` leaves it
/// linear. LVM asks modprobe for dm-cache-smq: where there is none, it says so
/// and asks for `mq`, which dmkit's cache takes as smq, as the kernel's does.
#[test]
fn lvm_cache_attach_and_split_through_the_door() {
    cache_attach_and_split(
        "dmkitc",
        "cache",
        "cache",
        &["_corig", "-cmeta", "-cdata"],
        "",
        "is now cached",
        "is not cached",
    );
}

/// `lvcreate --type raid1 -m1` through the door: LVM's rmeta and rimage
/// subvolumes and the raid table over them are dmkit devices, the array syncs
/// and LVM reads its progress from dmkit's status (`sync_percent` 100.00), a
/// write lands on both legs where LVM's tables put them, `--syncaction check`
/// reaches the target as a message and LVM reads its mismatch count, and the
/// data survives `vgchange -an` / `-ay`.
/// `lvchange --syncaction check` on raid LV `lv` (device `top`): LVM reads a
/// mismatch count of 0 from dmkit's status once it is idle.
fn check_finds_nothing(lvm: &Lvm, lv: &str, top: &str) {
    lvm.ok(&["lvchange", "--syncaction", "check", lv]);
    lvm.d
        .wait_status(top, " idle ", std::time::Duration::from_secs(60));
    let mm = lvm.ok(&["lvs", "--noheadings", "-o", "raid_mismatch_count", lv]);
    assert_eq!(mm.trim(), "0", "{top}: LVM reads the check's mismatch count");
}

#[test]
fn lvm_raid1_through_the_door() {
    common::need_all(&["losetup", "lvm"]);
    let d = Daemon::start("lvm-raid");
    let (loops, files) = loop_files(&d, None);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: "activation/monitoring=0 global/use_lvmpolld=0".into(),
    };
    let vg = new_vg(&lvm, &loops, "dmkitraid");
    lvm.ok(&[
        "lvcreate", "-y", "--type", "raid1", "-m1", "-L", "16M", "-n", "mir", &vg,
    ]);
    let top = format!("{vg}-mir");
    let tables = dmkit_tables(&d);
    let raid = &tables.iter().find(|(n, _)| *n == top).expect("the raid LV").1;
    assert!(raid.contains(" raid raid1 "), "{top}: {raid}");
    for sub in ["mir_rmeta_0", "mir_rmeta_1", "mir_rimage_0", "mir_rimage_1"] {
        let n = format!("{vg}-{sub}");
        let t = &tables.iter().find(|(x, _)| *x == n).expect("a sub-LV").1;
        assert!(t.contains(" linear "), "{n}: {t}");
    }
    assert_eq!(
        d.wait_status(&top, " idle ", std::time::Duration::from_secs(60)),
        format!("0 32768 raid raid1 2 AA 32768/32768 idle 0 0 -")
    );
    let pct = lvm.ok(&["lvs", "--noheadings", "-o", "sync_percent", &format!("{vg}/mir")]);
    assert_eq!(pct.trim(), "100.00", "LVM reads the sync from dmkit's status");
    let data = pattern(31, 256 * 1024);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(MIB, &data);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    drop(c);
    for leg in ["mir_rimage_0", "mir_rimage_1"] {
        let n = format!("{vg}-{leg}");
        let t = &tables.iter().find(|(x, _)| *x == n).expect("rimage").1;
        let w: Vec<&str> = t.split_whitespace().collect();
        let got = on_loop(
            &files,
            &loop_of(&files, w[3]),
            w[4].parse::<u64>().expect("offset") + MIB / 512,
            data.len(),
        );
        assert!(got == data, "{n}: the write is on this leg where LVM put it");
    }
    d.wait_open_count(&top, 0);
    check_finds_nothing(&lvm, &format!("{vg}/mir"), &top);
    lvm.ok(&["vgchange", "-an", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgchange -an removed every device");
    lvm.ok(&["vgchange", "-ay", &vg]);
    d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
    let mut c = nbd::Client::connect(&d.sock(), &top);
    assert!(c.read(MIB, data.len()) == data, "the data after vgchange -an/-ay");
    drop(c);
    d.wait_open_count(&top, 0);
    remove_vg(&lvm, &loops, &vg);
}

/// `lvcreate --type raid1 -m1 --raidintegrity y` (and raid5 `-i2`): LVM puts an integrity
/// device (its tags on an `_imeta` LV, `meta_device`) under each image, dmkit
/// formats them as the kernel would, the mirror syncs through them, LVM
/// reads the health and sync from dmkit's status lines, a write reads back
/// and survives `vgchange -an`/`-ay`.
#[test]
fn lvm_raid1_with_integrity_through_the_door() {
    common::need_all(&["losetup", "lvm"]);
    let d = Daemon::start("lvm-raidint");
    let (loops, files) = loop_files_n(&d, None, 3);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: "activation/monitoring=0 global/use_lvmpolld=0".into(),
    };
    let vg = new_vg(&lvm, &loops, "dmkitrint");
    lvm.ok(&[
        "lvcreate",
        "-y",
        "--type",
        "raid1",
        "-m1",
        "--raidintegrity",
        "y",
        "-L",
        "16M",
        "-n",
        "mi",
        &vg,
    ]);
    let top = format!("{vg}-mi");
    let tables = dmkit_tables(&d);
    for leg in ["mi_rimage_0", "mi_rimage_1"] {
        let n = format!("{vg}-{leg}");
        let t = &tables
            .iter()
            .find(|(x, _)| *x == n)
            .expect("an integrity image")
            .1;
        assert!(
            t.contains(" integrity ") && t.contains(" meta_device:") && t.contains("internal_hash:crc32c"),
            "{n}: {t}"
        );
    }
    assert_eq!(
        d.wait_status(&top, " idle ", std::time::Duration::from_secs(60)),
        "0 32768 raid raid1 2 AA 32768/32768 idle 0 0 -"
    );
    let lvs = lvm.ok(&[
        "lvs",
        "--noheadings",
        "-o",
        "segtype,sync_percent,raid_mismatch_count,lv_health_status",
        &format!("{vg}/mi"),
    ]);
    let f: Vec<&str> = lvs.split_whitespace().collect();
    assert_eq!(&f[..3], &["raid1", "100.00", "0"], "lvs: {lvs}");
    let data = pattern(37, 256 * 1024);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(MIB, &data);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    assert!(c.read(MIB, data.len()) == data, "the write reads back");
    drop(c);
    d.wait_open_count(&top, 0);
    // a byte of the first image's data changes on its PV, under its
    // integrity device: the mirror reads that block from the other image,
    // counts nothing against the leg, and writes the region back to the
    // first image (md's read-error correction)
    let iorig = format!("{vg}-mi_rimage_0_iorig");
    let t: Vec<String> = dmkit_tables(&d)
        .into_iter()
        .find(|(n, _)| *n == iorig)
        .expect("the first image's data LV")
        .1
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let node = loop_of(&files, &t[3]);
    let bad = t[4].parse::<u64>().expect("offset") + MIB / 512 + 8;
    let mut sector = on_loop(&files, &node, bad, 512);
    sector[100] ^= 0x20;
    let patch = d.dir.path("patch");
    std::fs::write(&patch, &sector).expect("patch");
    common::run(Command::new("dd").args([
        &format!("if={}", patch.display()),
        &format!("of={node}"),
        "bs=512",
        &format!("seek={bad}"),
        "count=1",
        "oflag=direct",
        "conv=notrunc",
        "status=none",
    ]));
    let mut c = nbd::Client::connect(&d.sock(), &top);
    assert!(
        c.read(MIB, data.len()) == data,
        "the mirror reads the bad block from the other image"
    );
    drop(c);
    d.wait_open_count(&top, 0);
    let img0 = format!("{vg}-mi_rimage_0");
    assert!(
        d.ok(&["status", &img0]).contains(" integrity 1 "),
        "the first image's integrity counted the bad block"
    );
    let start = std::time::Instant::now();
    while !d.log().contains("raid: read error corrected")
        && start.elapsed() < std::time::Duration::from_secs(30)
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(d.log().contains("raid: read error corrected"), "{}", d.log());
    assert_eq!(
        d.wait_status(&top, " idle ", std::time::Duration::from_secs(60)),
        "0 32768 raid raid1 2 AA 32768/32768 idle 0 0 -",
        "no leg failed"
    );
    let mut c = nbd::Client::connect(&d.sock(), &img0);
    assert!(
        c.read(MIB, data.len()) == data,
        "the first image holds the block again"
    );
    drop(c);
    d.wait_open_count(&img0, 1);
    lvm.ok(&["vgchange", "-an", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgchange -an removed every device");
    lvm.ok(&["vgchange", "-ay", &vg]);
    d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
    let mut c = nbd::Client::connect(&d.sock(), &top);
    assert!(c.read(MIB, data.len()) == data, "the data after vgchange -an/-ay");
    drop(c);
    d.wait_open_count(&top, 0);
    for leg in ["mi_rimage_0", "mi_rimage_1"] {
        let n = format!("{vg}-{leg}");
        let st = d.ok(&["status", &n]);
        assert!(st.contains(" integrity 0 "), "{n}: no mismatch: {st}");
    }
    // raid5 with integrity under its three images
    lvm.ok(&[
        "lvcreate",
        "-y",
        "--type",
        "raid5",
        "-i2",
        "--raidintegrity",
        "y",
        "-L",
        "8M",
        "-n",
        "r5",
        &vg,
    ]);
    let r5 = format!("{vg}-r5");
    assert_eq!(
        d.wait_status(&r5, " idle ", std::time::Duration::from_secs(60)),
        "0 16384 raid raid5_ls 3 AAA 8192/8192 idle 0 0 -"
    );
    let mut c = nbd::Client::connect(&d.sock(), &r5);
    c.write(MIB, &data);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    assert!(c.read(MIB, data.len()) == data, "raid5 over integrity reads back");
    drop(c);
    d.wait_open_count(&r5, 0);
    remove_vg(&lvm, &loops, &vg);
}

/// LVM's conversions of a raid1 LV through the door: `lvconvert -m+1` (a
/// third leg, rebuilt from the others), `lvextend` (every leg grows, the new
/// part synced), `lvconvert -m-1` (back to two legs); the data stays.
#[test]
fn lvm_raid1_conversions_through_the_door() {
    common::need_all(&["losetup", "lvm"]);
    let d = Daemon::start("lvm-raidconv");
    let (loops, _files) = loop_files_n(&d, None, 3);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: "activation/monitoring=0 global/use_lvmpolld=0".into(),
    };
    let vg = new_vg(&lvm, &loops, "dmkitrconv");
    lvm.ok(&[
        "lvcreate", "-y", "--type", "raid1", "-m1", "-L", "8M", "-n", "cv", &vg,
    ]);
    let top = format!("{vg}-cv");
    d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
    let data = pattern(41, 256 * 1024);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(MIB, &data);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    drop(c);
    d.wait_open_count(&top, 0);
    let lv = format!("{vg}/cv");
    let legs = |n: usize| {
        let st = d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
        assert!(
            st.contains(&format!(" raid1 {n} {} ", "A".repeat(n))),
            "{n} legs in sync: {st}"
        );
        let mut c = nbd::Client::connect(&d.sock(), &top);
        assert!(c.read(MIB, data.len()) == data, "the data with {n} legs");
        drop(c);
        d.wait_open_count(&top, 0);
        st
    };
    lvm.ok(&["lvconvert", "-y", "-m", "+1", &lv]);
    legs(3);
    lvm.ok(&["lvextend", "-y", "-L", "16M", &lv]);
    let st = legs(3);
    assert!(
        st.starts_with("0 32768 raid raid1 3 AAA 32768/32768 idle "),
        "extended: {st}"
    );
    lvm.ok(&["lvconvert", "-y", "-m", "-1", &lv]);
    legs(2);
    remove_vg(&lvm, &loops, &vg);
}

/// `lvconvert --repair` of a raid1 LV behind the door: a leg whose image
/// fails (an `error` table loaded over it, as a dead PV's I/O fails) is marked
/// `D` by the next write, `lvs` says the LV needs a refresh, and LVM replaces
/// the image with one on the third PV; dmkit rebuilds it, the array is `AA`
/// again, and the new image holds the data, the write made while it was
/// failed included.
#[test]
fn lvm_raid1_repair_through_the_door() {
    common::need_all(&["losetup", "lvm"]);
    let d = Daemon::start("lvm-raidrep");
    let (loops, _files) = loop_files_n(&d, None, 3);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: "activation/monitoring=0 global/use_lvmpolld=0".into(),
    };
    let vg = new_vg(&lvm, &loops, "dmkitrrep");
    lvm.ok(&[
        "lvcreate",
        "-y",
        "--type",
        "raid1",
        "-m1",
        "-L",
        "8M",
        "-n",
        "rp",
        &vg,
        &loops.0[0],
        &loops.0[1],
    ]);
    let top = format!("{vg}-rp");
    d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
    let first = pattern(43, 128 * 1024);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(MIB, &first);
    assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
    drop(c);
    d.wait_open_count(&top, 0);
    // the second image's PV dies
    let img1 = format!("{vg}-rp_rimage_1");
    fail_device(&d, &img1);
    let second = pattern(44, 128 * 1024);
    let mut c = nbd::Client::connect(&d.sock(), &top);
    c.write(3 * MIB, &second);
    assert_eq!(
        c.call(nbd::FLUSH, 0, 0, 0, &[]),
        0,
        "the write goes on without the leg"
    );
    drop(c);
    d.wait_open_count(&top, 0);
    let st = d.ok(&["status", &top]);
    assert!(st.contains(" raid1 2 AD "), "the failed leg is marked: {st}");
    let health = lvm.ok(&[
        "lvs",
        "--noheadings",
        "-o",
        "lv_health_status",
        &format!("{vg}/rp"),
    ]);
    assert_eq!(
        health.trim(),
        "refresh needed",
        "LVM reads the failure from dmkit's status"
    );
    lvm.ok(&["lvconvert", "-y", "--repair", &format!("{vg}/rp")]);
    assert_eq!(
        d.wait_status(&top, " idle ", std::time::Duration::from_secs(60)),
        "0 16384 raid raid1 2 AA 16384/16384 idle 0 0 -"
    );
    let devs = lvm.ok(&["lvs", "-a", "--noheadings", "-o", "name,devices", &vg]);
    let img1_dev = devs
        .lines()
        .find(|l| l.contains("[rp_rimage_1]"))
        .unwrap_or_else(|| panic!("the new image: {devs}"));
    assert!(
        img1_dev.contains(&loops.0[2]),
        "the new image is on the third PV: {devs}"
    );
    // the image's open count: the raid's hold on it
    for (name, what, held) in [(top.as_str(), "the LV", 0), (img1.as_str(), "the new image", 1)] {
        let mut c = nbd::Client::connect(&d.sock(), name);
        assert!(c.read(MIB, first.len()) == first, "{what}: the first write");
        assert!(
            c.read(3 * MIB, second.len()) == second,
            "{what}: the write made while the leg was failed"
        );
        drop(c);
        d.wait_open_count(name, held);
    }
    remove_vg(&lvm, &loops, &vg);
}

#[test]
fn lvm_raid5_raid6_raid10_and_raid0_through_the_door() {
    common::need_all(&["losetup", "lvm"]);
    let d = Daemon::start("lvm-raid-levels");
    let (loops, _files) = loop_files_n(&d, None, 5);
    let lvm = Lvm {
        d: &d,
        devices: loops.0.join(","),
        config: "activation/monitoring=0 global/use_lvmpolld=0".into(),
    };
    let vg = new_vg(&lvm, &loops, "dmkitlevels");
    // LVM's type, its arguments, the kernel type LVM's table names, legs
    let cases: [(&str, &[&str], &str, usize); 4] = [
        ("r5", &["--type", "raid5", "-i", "2"], "raid5_ls", 3),
        ("r6", &["--type", "raid6", "-i", "3"], "raid6_zr", 5),
        ("r10", &["--type", "raid10", "-i", "2", "-m", "1"], "raid10", 4),
        ("r0", &["--type", "raid0", "-i", "2"], "raid0", 2),
    ];
    let data = pattern(33, 512 * 1024);
    for (name, args, ty, legs) in cases {
        let mut a = vec!["lvcreate", "-y"];
        a.extend(args);
        a.extend(["-L", "12M", "-n", name, &vg]);
        lvm.ok(&a);
        let top = format!("{vg}-{name}");
        let tables = dmkit_tables(&d);
        let raid = &tables.iter().find(|(n, _)| *n == top).expect("the raid LV").1;
        assert!(raid.contains(&format!(" raid {ty} ")), "{top}: {raid}");
        let w: Vec<&str> = raid.split_whitespace().collect();
        let len: u64 = w[1].parse().expect("the LV's length");
        let status = d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
        let health: String = "A".repeat(legs);
        assert!(
            status.starts_with(&format!("0 {len} raid {ty} {legs} {health} "))
                && status.ends_with(" idle 0 0 -"),
            "{top}: {status}"
        );
        let pct = lvm.ok(&[
            "lvs",
            "--noheadings",
            "-o",
            "sync_percent",
            &format!("{vg}/{name}"),
        ]);
        let want = if ty == "raid0" { "" } else { "100.00" };
        assert_eq!(pct.trim(), want, "{top}: LVM reads the sync from dmkit's status");
        let mut c = nbd::Client::connect(&d.sock(), &top);
        c.write(MIB + 4096, &data);
        assert_eq!(c.call(nbd::FLUSH, 0, 0, 0, &[]), 0, "flush");
        assert!(
            c.read(MIB + 4096, data.len()) == data,
            "{top}: the write reads back"
        );
        drop(c);
        d.wait_open_count(&top, 0);
        if ty != "raid0" {
            check_finds_nothing(&lvm, &format!("{vg}/{name}"), &top);
        }
    }
    lvm.ok(&["vgchange", "-an", &vg]);
    assert_eq!(dmkit_tables(&d), vec![], "vgchange -an removed every device");
    lvm.ok(&["vgchange", "-ay", &vg]);
    for (name, _, _, _) in cases {
        let top = format!("{vg}-{name}");
        d.wait_status(&top, " idle ", std::time::Duration::from_secs(60));
        let mut c = nbd::Client::connect(&d.sock(), &top);
        assert!(
            c.read(MIB + 4096, data.len()) == data,
            "{top}: the data after vgchange -an/-ay"
        );
        drop(c);
        d.wait_open_count(&top, 0);
    }
    remove_vg(&lvm, &loops, &vg);
}
