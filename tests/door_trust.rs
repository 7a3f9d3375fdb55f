//! What a program behind the door sees of everything that is not a dmkit
//! device: exactly what it sees without the door. Descriptors are known by what
//! they are, not by their number; the kernel's nodes (another driver's major,
//! the kernel's own device-mapper major) and /proc lines pass through; dmkit's
//! nodes name one device for ever, across restarts; an open ends with its open
//! file description, not with a child's exit.

use crate::common;
use common::{Daemon, Scratch};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// What a command printed (stdout, stderr) and how it ended, to compare runs
/// with and without the door.
type Outcome = (String, String, Option<i32>);

fn outcome(o: &Output) -> Outcome {
    (text(&o.stdout), text(&o.stderr), o.status.code())
}

/// `sh -c SCRIPT` without the door and behind it: their outcomes.
fn both(d: &Daemon, dev_dir: &Path, script: &str) -> (Outcome, Outcome) {
    let plain = Command::new("sh")
        .args(["-c", script])
        .env("LC_ALL", "C")
        .output()
        .expect("sh");
    let door = d
        .exec()
        .args(["sh", "-c", script])
        .env("DM_DEV_DIR", dev_dir)
        .output()
        .expect("dmkit exec sh");
    (outcome(&plain), outcome(&door))
}

fn mknod_block(path: &Path, major: u32, minor: u32) {
    common::run(
        Command::new("mknod")
            .arg(path)
            .arg("b")
            .arg(major.to_string())
            .arg(minor.to_string()),
    );
}

/// A daemon with one linear device `name` over a sparse file of `bytes`.
fn linear_daemon(tag: &str, name: &str, bytes: u64) -> Daemon {
    let d = Daemon::start(tag);
    let back = d.dir.sparse("back", bytes);
    d.create(name, &format!("0 {} linear {} 0", bytes / 512, back.display()));
    d
}

/// A 1 MiB file of 'x' (the door must never take it for a device).
fn plain_file(s: &Scratch) -> std::path::PathBuf {
    let p = s.path("plain");
    std::fs::write(&p, vec![b'x'; 1 << 20]).expect("plain file");
    p
}

/// The regression the door had (an ordinary file lost its blocks to a
/// BLKDISCARD meant for a device whose number it reused): a C program closes a
/// device's descriptor every way a program can (close_range, dup2 over it,
/// fclose, a control node's number too), opens an ordinary file on the same
/// number, and finds it ordinary; a device's duplicates stay the device; the
/// same from 16 threads at once (`tests/door/reuse.c`).
#[test]
fn a_reused_descriptor_is_the_file_it_now_is() {
    common::need_all(&["cc"]);
    let d = linear_daemon("fdreuse", "dlin", 1 << 20);
    let plain = plain_file(&d.dir);
    let blocks = std::fs::metadata(&plain).expect("plain").blocks();
    let exe = common::build_c(&d, "reuse");
    let o = d
        .exec()
        .arg(&exe)
        .args(["/dev/mapper/dlin"])
        .arg(&plain)
        .arg("/dev/mapper/control")
        .output()
        .expect("run reuse");
    assert_eq!(
        (
            text(&o.stdout).as_str(),
            text(&o.stderr).as_str(),
            o.status.code()
        ),
        (
            "ok device\nok close_range\nok dup2\nok fclose\nok duplicates\nok control\nok threads\n",
            "",
            Some(0)
        )
    );
    let m = std::fs::metadata(&plain).expect("plain");
    assert_eq!(
        (m.len(), m.blocks()),
        (1 << 20, blocks),
        "the ordinary file kept its blocks"
    );
    assert!(std::fs::read(&plain).expect("read").iter().all(|&b| b == b'x'));
}

/// Python's subprocess (close_range in the child) and bash's redirections
/// (dup2) behind the door: the parent's device descriptor stays the device,
/// and a number used again is the new file's.
#[test]
fn python_and_bash_descriptors_behind_the_door() {
    common::need_all(&["python3", "bash"]);
    let d = linear_daemon("fdpython", "dpy", 1 << 20);
    let plain = plain_file(&d.dir);
    let script = r#"
import errno, fcntl, os, struct, subprocess, sys
BLKGETSIZE64, BLKDISCARD = 0x80081272, 0x1277
fd = os.open("/dev/mapper/dpy", os.O_RDWR)
subprocess.run(["true"], check=True)
size = struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0]
print("device after a subprocess:", size)
os.close(fd)
f = os.open(sys.argv[1], os.O_RDWR)
print("same number:", f == fd)
try:
    fcntl.ioctl(f, BLKDISCARD, struct.pack("QQ", 0, 1 << 20))
    print("discard answered")
except OSError as e:
    print("discard on the file:", errno.errorcode[e.errno])
"#;
    let o = d
        .exec()
        .args(["python3", "-c", script])
        .arg(&plain)
        .output()
        .expect("python3");
    assert_eq!(
        (text(&o.stdout).as_str(), text(&o.stderr).as_str()),
        (
            "device after a subprocess: 1048576\nsame number: True\ndiscard on the file: ENOTTY\n",
            ""
        )
    );
    // bash: a device on 3, then 3 made the file by a redirection
    let o = d
        .exec()
        .args([
            "bash",
            "-c",
            "exec 3<>/dev/mapper/dpy; exec 3<>\"$1\"; blockdev --getsize64 /dev/fd/3 2>&1; \
             python3 -c 'import fcntl,struct; fcntl.ioctl(3, 0x1277, struct.pack(\"QQ\", 0, 1<<20))' 2>&1 | tail -1",
            "bash",
        ])
        .arg(&plain)
        .output()
        .expect("bash");
    let out = text(&o.stdout);
    assert!(
        out.contains("Inappropriate ioctl for device") && !out.contains("1048576"),
        "{out}"
    );
    assert!(std::fs::read(&plain).expect("read").iter().all(|&b| b == b'x'));
}

/// /proc/devices behind the door is the kernel's, every line, but for the
/// device-mapper block line: dmkit's (its own major, never the kernel's) in
/// place of the kernel's if it has one (libdevmapper reads the first such line,
/// LVM the last: two would set them against each other). /proc/misc is the
/// kernel's with the control node's line where the kernel has none.
#[test]
fn proc_devices_is_the_kernels_with_dmkits_line() {
    let d = Daemon::start("procdev");
    let major: u32 = std::fs::read_to_string(d.run.join("major"))
        .expect("RUN_DIR/major")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(
        major, 511,
        "no block major from 260 to 511 is taken on the hosts the tests run on"
    );
    let real = std::fs::read_to_string("/proc/devices").expect("/proc/devices");
    let mut want = String::new();
    let mut block = false;
    let mut added = false;
    let line = format!("{major:3} device-mapper\n");
    for l in real.split_inclusive('\n') {
        let n: Option<u32> = l.split_whitespace().next().and_then(|w| w.parse().ok());
        if block && !added && n.is_none_or(|n| n > major) {
            want.push_str(&line);
            added = true;
        }
        if !(block && l.trim_end().ends_with(" device-mapper")) {
            want.push_str(l);
        }
        block |= l.starts_with("Block devices:");
    }
    if !added {
        want.push_str(&line);
    }
    let got = common::run(d.exec().args(["cat", "/proc/devices"]));
    assert_eq!(got, want);
    let misc = std::fs::read_to_string("/proc/misc").expect("/proc/misc");
    let want_misc = if misc.lines().any(|l| l.ends_with(" device-mapper")) {
        misc
    } else {
        format!("{misc}236 device-mapper\n")
    };
    assert_eq!(common::run(d.exec().args(["cat", "/proc/misc"])), want_misc);
    // ordinary programs on ordinary files: the same with and without the door
    let f = plain_file(&d.dir);
    let script = format!(
        "f={}; exec 3<>\"$f\"; echo hi >&3; exec 3>&-; head -c 4 \"$f\"; cp \"$f\" \"$f.copy\"; \
         cmp \"$f\" \"$f.copy\" && echo same; stat -c '%F %s' \"$f\"; dd if=\"$f\" bs=4k count=1 status=none | wc -c; \
         cat /proc/partitions | wc -l; rm \"$f.copy\"",
        f.display()
    );
    let (plain, door) = both(&d, &d.dir.path("nodes"), &script);
    assert_eq!(plain, door);
    assert!(
        plain.0.starts_with("hi\nxsame\nregular file 1048576\n4096\n") && plain.1.is_empty(),
        "{plain:?}"
    );
}

/// Nodes of other drivers, and of the kernel's device-mapper major, pass
/// through the door; only dmkit's major is dmkit's. On the machines the tests
/// run on, block major 253 is zram's (elsewhere the kernel's device-mapper's):
/// behind the door a 253:0 node opens what it opens without the door, never a
/// dmkit device, and a node of dmkit's major opens dmkit's device (which
/// without the door opens nothing).
#[test]
fn kernel_nodes_pass_through_and_dmkits_nodes_are_dmkits() {
    let d = Daemon::start("kernnodes");
    let back = common::image(&d.dir, "back", 1 << 20, Some(7));
    d.create("dz", &format!("0 2048 linear {} 0", back.display()));
    let nodes = d.dir.path("nodes");
    std::fs::create_dir_all(nodes.join("mapper")).expect("nodes");
    mknod_block(&nodes.join("mapper/kd"), 253, 0);
    mknod_block(&nodes.join("loop"), 7, 0);
    mknod_block(&nodes.join("mapper/dz"), 511, 0);
    for n in ["mapper/kd", "loop"] {
        let script = format!(
            "stat -c '%F %t:%T' {p}; dd if={p} bs=512 count=1 status=none | od -c | head -2; echo $?",
            p = nodes.join(n).display()
        );
        let (plain, door) = both(&d, &nodes, &script);
        assert_eq!(plain, door, "{n}");
    }
    let script = format!(
        "dd if={} bs=4096 count=1 status=none | md5sum",
        nodes.join("mapper/dz").display()
    );
    let (plain, door) = both(&d, &nodes, &script);
    let want = common::run(Command::new("sh").arg("-c").arg(format!(
        "dd if={} bs=4096 count=1 status=none | md5sum",
        back.display()
    )));
    assert_eq!(door.0, want, "dmkit's node behind the door: its device");
    assert!(plain.1.contains("No such device or address"), "{plain:?}");
}

/// `/dev/mapper/NAME` behind the door for a device made with `dmkit create`
/// (no node anywhere): mkfs and fsck on it, stat says it is dmkit's block
/// device; nothing is made in the host's /dev; a name the daemon does not have
/// fails as it does without the door.
#[test]
fn dev_mapper_name_works_behind_the_door_for_any_device() {
    common::need_all(&["mkfs.ext4", "e2fsck"]);
    let d = linear_daemon("mappername", "mkx", 64 << 20);
    assert!(!Path::new("/dev/mapper/mkx").exists());
    common::run(d.exec().args(["mkfs.ext4", "-q", "-F", "/dev/mapper/mkx"]));
    common::run(d.exec().args(["e2fsck", "-fn", "/dev/mapper/mkx"]));
    assert_eq!(
        common::run(d.exec().args(["stat", "-c", "%F %t:%T", "/dev/mapper/mkx"])),
        "block special file 1ff:0\n"
    );
    assert!(
        !Path::new("/dev/mapper/mkx").exists(),
        "nothing made in the host's /dev"
    );
    let (plain, door) = both(
        &d,
        &d.dir.path("nodes"),
        "cat /dev/mapper/nosuch; stat /dev/mapper/nosuch; echo $?",
    );
    assert_eq!(plain, door);
}

/// The open count follows open file descriptions: a child's exit, a `$(...)`
/// or a closed duplicate does not end what the shell still holds open, so
/// `remove` says the device is in use; after the shell's own close it goes.
#[test]
fn a_childs_exit_does_not_end_its_parents_open() {
    let d = linear_daemon("childexit", "held", 1 << 20);
    let dmkit = format!("{} --run-dir {}", common::BIN, d.run.display());
    let script = format!(
        "exec 3<>/dev/mapper/held; /bin/true; x=$(cat /dev/null); exec 4<&3; exec 4<&-; \
         {dmkit} info held | grep Open; {dmkit} remove held 2>&1; exec 3>&-; {dmkit} remove held && echo removed"
    );
    let o = d.exec().args(["bash", "-c", &script]).output().expect("bash");
    assert_eq!(
        text(&o.stdout),
        "Open count:        1\n\
         dmkit remove: held: Device or resource busy: open count 1\n\
         removed\n"
    );
}

/// Device numbers stay true: a device keeps its minor across a kill and
/// `serve --restore`, a removed device's minor is not given to the next device
/// (before or after the restart), so a node made for a device opens that device
/// or nothing.
#[test]
fn nodes_name_one_device_across_restarts() {
    let d = Daemon::start("minors");
    let files: Vec<_> = ["a", "b", "c", "d"]
        .iter()
        .enumerate()
        .map(|(i, n)| common::image(&d.dir, n, 1 << 20, Some(i as u64 + 1)))
        .collect();
    for (n, f) in ["zeta", "b", "alpha"].iter().zip(&files) {
        d.create(n, &format!("0 2048 linear {} 0", f.display()));
    }
    d.ok(&["remove", "b"]);
    d.create("d", &format!("0 2048 linear {} 0", files[3].display()));
    assert_eq!(d.ok(&["ls"]), "alpha\t(511:2)\nd\t(511:3)\nzeta\t(511:0)\n");
    let nodes = d.dir.path("nodes");
    std::fs::create_dir_all(nodes.join("mapper")).expect("nodes");
    for (n, m) in [("zeta", 0), ("b", 1), ("alpha", 2), ("d", 3)] {
        mknod_block(&nodes.join("mapper").join(n), 511, m);
    }
    let d = d.kill9_and_restore();
    assert_eq!(d.ok(&["ls"]), "alpha\t(511:2)\nd\t(511:3)\nzeta\t(511:0)\n");
    let sum = |p: &Path| {
        common::run(
            Command::new("sh")
                .arg("-c")
                .arg(format!("md5sum < {}", p.display())),
        )
    };
    for (n, f) in [("zeta", &files[0]), ("alpha", &files[2]), ("d", &files[3])] {
        let got = common::run(d.exec().env("DM_DEV_DIR", &nodes).args([
            "sh",
            "-c",
            &format!("md5sum < {}", nodes.join("mapper").join(n).display()),
        ]));
        assert_eq!(got, sum(f), "node {n} after the restart");
    }
    d.create("e", "0 8 zero");
    assert_eq!(d.info_line("e", "Major, minor:"), "Major, minor:      511, 4");
    let o = d
        .exec()
        .env("DM_DEV_DIR", &nodes)
        .args(["sh", "-c", &format!("cat {}", nodes.join("mapper/b").display())])
        .output()
        .expect("cat");
    assert!(
        !o.status.success() && text(&o.stderr).contains("No such device or address"),
        "a removed device's node opens nothing: {}",
        text(&o.stderr)
    );
}

/// readlink of /sys/dev/block/MAJOR:N: the kernel's links, the same behind the
/// door, for every device the host has; for a device of dmkit's major, the
/// kernel's form of a device-mapper device's link (`../../devices/virtual/block/dm-N`,
/// where cryptsetup finds the device a crypt table names), and a minor the
/// daemon has no device for fails as a number the kernel does not have.
#[test]
fn sys_dev_block_links_are_the_kernels_and_dmkits_devices_have_theirs() {
    let d = linear_daemon("syslinks", "dz", 1 << 20);
    let major = std::fs::read_to_string(d.run.join("major")).expect("major");
    let nodes = d.dir.path("nodes");
    std::fs::create_dir_all(&nodes).expect("nodes");
    let host = "for l in /sys/dev/block/*; do echo \"$l $(readlink $l)\"; done; echo $?";
    let (plain, door) = both(&d, &nodes, host);
    assert_eq!(plain, door, "the host's links");
    assert!(
        plain.0.lines().count() > 1,
        "the host has block devices: {plain:?}"
    );
    let ours = format!("readlink /sys/dev/block/{}:0; echo $?", major.trim());
    let (plain, door) = both(&d, &nodes, &ours);
    assert_eq!(
        door.0, "../../devices/virtual/block/dm-0\n0\n",
        "dz's link behind the door"
    );
    assert_eq!(plain.0, "1\n", "no such link without it");
    let missing = format!("readlink /sys/dev/block/{}:9; echo $?", major.trim());
    let (plain, door) = both(&d, &nodes, &missing);
    assert_eq!((plain.0.as_str(), door.0.as_str()), ("1\n", "1\n"), "no device 9");
}
