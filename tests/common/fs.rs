//! Block devices and filesystems from tests: run commands with a time limit,
//! attach an export through nbdfuse and a loop device, mount ext4 on it, and
//! write and check files of known content.

use super::{pattern, Daemon};

/// What a test needs to put ext4 on an export: nbdfuse, a loop device, mkfs
/// and fsck (with `need_all`).
pub const FS_TOOLS: &[&str] = &["nbdfuse", "fusermount3", "losetup", "mkfs.ext4", "e2fsck"];
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Run `cmd` with a time limit; returns (success, stdout, stderr). A command
/// still running at the limit is killed and the test fails.
pub fn run_t(cmd: &mut Command, secs: u64) -> (bool, String, String) {
    let mut c = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    // Drain both pipes on threads so a chatty command cannot block on them.
    let mut so = c.stdout.take().unwrap();
    let mut se = c.stderr.take().unwrap();
    let to = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let te = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = c.try_wait().expect("wait") {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(secs) {
            let _ = c.kill();
            let _ = c.wait();
            panic!("{cmd:?} did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (
        status.success(),
        to.join().unwrap_or_default(),
        te.join().unwrap_or_default(),
    )
}

/// Run with a time limit and require success; returns stdout.
pub fn must(cmd: &mut Command, secs: u64) -> String {
    let what = format!("{cmd:?}");
    let (ok, so, se) = run_t(cmd, secs);
    assert!(ok, "{what} failed:\nstdout: {so}\nstderr: {se}");
    so
}

pub fn cmd(prog: &str, args: &[&str]) -> Command {
    let mut c = Command::new(prog);
    c.args(args);
    c
}

/// An export attached through nbdfuse and a loop device, optionally mounted.
/// Dropping it unmounts, detaches and unmounts the FUSE file, also on failure.
pub struct Attach {
    fuse_dir: PathBuf,
    fuse: Option<Child>,
    loopdev: Option<String>,
    pub mnt: PathBuf,
    mounted: bool,
}

impl Attach {
    pub fn new(d: &Daemon, base: &Path, export: &str, ro: bool) -> Attach {
        let fuse_dir = base.join(format!("fuse-{export}"));
        let mnt = base.join(format!("mnt-{export}"));
        std::fs::create_dir_all(&fuse_dir).unwrap();
        std::fs::create_dir_all(&mnt).unwrap();
        let pidfile = base.join(format!("nbdfuse-{export}.pid"));
        let _ = std::fs::remove_file(&pidfile);
        let mut c = Command::new("nbdfuse");
        if ro {
            c.arg("-r");
        }
        let fuse = c
            .arg("-P")
            .arg(&pidfile)
            .arg(&fuse_dir)
            .arg(d.uri(export))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(base.join(format!("nbdfuse-{export}.log"))).unwrap(),
            ))
            .spawn()
            .expect("spawn nbdfuse");
        let mut a = Attach {
            fuse_dir,
            fuse: Some(fuse),
            loopdev: None,
            mnt,
            mounted: false,
        };
        let file = a.fuse_dir.join("nbd");
        let t0 = Instant::now();
        while !(std::fs::metadata(&pidfile).is_ok_and(|m| m.len() > 0) && file.exists()) {
            if let Some(st) = a.fuse.as_mut().unwrap().try_wait().unwrap() {
                panic!("nbdfuse for {export} exited: {st}");
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "nbdfuse did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mut args = vec!["--show", "-f"];
        if ro {
            args.push("-r");
        }
        let f = file.to_str().unwrap().to_string();
        args.push(&f);
        let dev = must(&mut cmd("losetup", &args), 30).trim().to_string();
        assert!(dev.starts_with("/dev/loop"), "losetup said {dev}");
        a.loopdev = Some(dev);
        a
    }

    pub fn dev(&self) -> &str {
        self.loopdev.as_deref().unwrap()
    }

    pub fn mount(&mut self, opts: &str) {
        let m = self.mnt.to_str().unwrap().to_string();
        must(&mut cmd("mount", &["-t", "ext4", "-o", opts, self.dev(), &m]), 60);
        self.mounted = true;
    }

    pub fn umount(&mut self) {
        if self.mounted {
            must(&mut cmd("umount", &[self.mnt.to_str().unwrap()]), 60);
            self.mounted = false;
        }
    }

    /// Flush this filesystem to the device (syncfs).
    pub fn sync(&self) {
        must(&mut cmd("sync", &["-f", self.mnt.to_str().unwrap()]), 60);
    }

    pub fn fsck(&self) {
        let (ok, so, se) = run_t(&mut cmd("e2fsck", &["-fn", self.dev()]), 120);
        assert!(ok, "e2fsck -fn {} failed:\n{so}\n{se}", self.dev());
    }
}

impl Drop for Attach {
    fn drop(&mut self) {
        let q = |c: &mut Command| {
            let _ = c.stdout(Stdio::null()).stderr(Stdio::null()).status();
        };
        if self.mounted {
            let m = self.mnt.to_str().unwrap().to_string();
            q(&mut cmd("fsfreeze", &["-u", &m]));
            let ok = Command::new("umount")
                .arg(&m)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                q(&mut cmd("umount", &["-l", &m]));
            }
        }
        if let Some(l) = self.loopdev.take() {
            q(&mut cmd("losetup", &["-d", &l]));
        }
        if let Some(mut f) = self.fuse.take() {
            q(&mut cmd("fusermount3", &["-u", self.fuse_dir.to_str().unwrap()]));
            let t0 = Instant::now();
            while matches!(f.try_wait(), Ok(None)) && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(f.try_wait(), Ok(None)) {
                q(&mut cmd("fusermount3", &["-uz", self.fuse_dir.to_str().unwrap()]));
                let _ = f.kill();
            }
            let _ = f.wait();
        }
    }
}

/// Files with known content: (relative path, seed, length).
pub type FileSet = Vec<(String, u64, usize)>;

pub fn write_files(root: &Path, files: &FileSet) {
    for (name, seed, len) in files {
        let p = root.join(name);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(&p, pattern(*seed, *len)).unwrap_or_else(|e| panic!("write {name}: {e}"));
    }
}

/// Every file of `files` has exactly its content under `root`.
pub fn check_files(root: &Path, files: &FileSet, what: &str) {
    for (name, seed, len) in files {
        let got = std::fs::read(root.join(name)).unwrap_or_else(|e| panic!("{what}: read {name}: {e}"));
        assert_eq!(got.len(), *len, "{what}: {name} has the wrong length");
        assert!(
            got == pattern(*seed, *len),
            "{what}: {name} has the wrong content"
        );
    }
}
