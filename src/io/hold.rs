//! Exclusive holds on the files and block devices tables map onto.
//!
//! The kernel's `dm_get_device` claims every device a table names exclusively,
//! with one holder for all of device-mapper: two tables may share a device, any
//! other exclusive opener (mkfs, thin_repair, a second kernel) gets EBUSY. dmkit
//! does the same per process: the daemon takes one [`Hold`] per file, shared by
//! every table that names it, and a tool that writes metadata [`claim`]s the same
//! lock, so it fails with EBUSY instead of overwriting what a live pool commits.
//!
//! A block device is opened with O_EXCL (the kernel's own claim, which other
//! programs honour) and, like a regular file, locked with `flock(LOCK_EX)`,
//! whose owner `/proc/locks` names. A block device a mounted filesystem holds is
//! shared with a warning (O_EXCL would refuse it).

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use thiserror::Error;

/// Whether the block device at `path` is held: an exclusive open of it fails
/// because a filesystem or another exclusive holder has it.
pub fn held(path: impl AsRef<Path>) -> bool {
    matches!(
        rustix::fs::open(
            path.as_ref(),
            rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::EXCL | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        ),
        Err(rustix::io::Errno::BUSY)
    )
}

/// (st_dev, st_ino) of a regular file, (0, st_rdev) of a block device: the
/// same key as [`super::BackingFile::identity`].
pub type Identity = (u64, u64);

/// An exclusive hold on one file; dropping it lets go.
#[derive(Debug)]
pub struct Hold {
    /// The descriptor the lock is on (None: shared with a mounted filesystem).
    _fd: Option<File>,
    pub path: PathBuf,
    pub identity: Identity,
}

/// Who holds a file: the process (from the lock) and, if its daemon says, the
/// dmkit device whose table names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub pid: u32,
    pub comm: String,
    pub device: Option<String>,
}

#[derive(Debug, Error)]
pub enum HoldError {
    #[error("{}: Device or resource busy (EBUSY): {}", path.display(), describe(owner.as_ref()))]
    Busy { path: PathBuf, owner: Option<Owner> },
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
}

fn describe(o: Option<&Owner>) -> String {
    match o {
        Some(Owner {
            pid,
            comm,
            device: Some(d),
        }) => format!("held by dmkit device '{d}', process {pid} ({comm})"),
        Some(Owner { pid, comm, .. }) => format!("held by process {pid} ({comm})"),
        None => "held by another program".into(),
    }
}

/// The holds this process has, by identity: one per file however many tables
/// name it. Process-wide on purpose: the kernel's claim on a block device is
/// per holder and dmkit's holder is the process (an flock and O_EXCL belong to
/// the open file, so a second registry in the same process must share the hold,
/// not take a second one and be refused by its own first).
static HOLDS: Mutex<Vec<(Identity, Weak<Hold>)>> = Mutex::new(Vec::new());

/// The daemon's hold on `path`: the one this process has already, or a new one.
pub fn hold(path: &Path) -> Result<Arc<Hold>, HoldError> {
    let identity = identity(path)?;
    super::shared(&HOLDS, identity, || take(path, identity, true))
}

/// A tool's claim on `path` before it writes there: refused while a daemon (or
/// another tool) holds it.
pub fn claim(path: &Path) -> Result<Hold, HoldError> {
    let identity = identity(path)?;
    take(path, identity, false)
}

fn io_err(path: &Path, err: std::io::Error) -> HoldError {
    HoldError::Io {
        path: path.to_path_buf(),
        err,
    }
}

pub fn identity(path: &Path) -> Result<Identity, HoldError> {
    let m = std::fs::metadata(path).map_err(|e| io_err(path, e))?;
    Ok(if m.file_type().is_block_device() {
        (0, m.rdev())
    } else {
        (m.dev(), m.ino())
    })
}

fn take(path: &Path, identity: Identity, share_mounted: bool) -> Result<Hold, HoldError> {
    let m = std::fs::metadata(path).map_err(|e| io_err(path, e))?;
    let busy = || HoldError::Busy {
        path: path.to_path_buf(),
        owner: owner(path),
    };
    let fd = if m.file_type().is_block_device() {
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                if share_mounted && mounted(m.rdev()) {
                    tracing::warn!(
                        "{}: a mounted filesystem holds it; shared, not held exclusively",
                        path.display()
                    );
                    return Ok(Hold {
                        _fd: None,
                        path: path.to_path_buf(),
                        identity,
                    });
                }
                return Err(busy());
            }
            Err(e) => return Err(io_err(path, e)),
        }
    } else {
        File::open(path).map_err(|e| io_err(path, e))?
    };
    match rustix::fs::flock(&fd, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(Hold {
            _fd: Some(fd),
            path: path.to_path_buf(),
            identity,
        }),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(busy()),
        Err(e) => Err(io_err(path, e.into())),
    }
}

/// Whether a mounted filesystem is on block device `rdev`.
fn mounted(rdev: u64) -> bool {
    let want = format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev));
    std::fs::read_to_string("/proc/self/mountinfo")
        .is_ok_and(|t| t.lines().any(|l| l.split(' ').nth(2) == Some(want.as_str())))
}

/// The process whose `flock` holds `path`, and the dmkit device its daemon says
/// names it.
pub fn owner(path: &Path) -> Option<Owner> {
    let m = std::fs::metadata(path).ok()?;
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid = lock_owner(&locks, m.dev(), m.ino())?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| "?".into());
    let device = control_sockets(pid)
        .into_iter()
        .chain(std::iter::once(
            crate::client::default_run_dir().join("control.sock"),
        ))
        .find_map(|s| ask_holder(&s, path));
    Some(Owner { pid, comm, device })
}

/// The pid of the `flock` write lock on inode `ino` of filesystem `dev` in
/// `/proc/locks` text (`N: FLOCK ADVISORY WRITE PID MA:MI:INO 0 EOF`, the
/// device numbers in hex).
pub fn lock_owner(locks: &str, dev: u64, ino: u64) -> Option<u32> {
    let want = format!(
        "{:02x}:{:02x}:{ino}",
        rustix::fs::major(dev),
        rustix::fs::minor(dev)
    );
    locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // waiters are `N: -> FLOCK ...`
        match f.as_slice() {
            [_, "FLOCK", _, "WRITE", pid, id, ..] if *id == want => pid.parse().ok(),
            _ => None,
        }
    })
}

/// The control sockets process `pid` listens on (its unix sockets named
/// `control.sock`, from /proc/PID/fd and /proc/net/unix).
fn control_sockets(pid: u32) -> Vec<PathBuf> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    let inodes: Vec<String> = fds
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    let Ok(unix) = std::fs::read_to_string("/proc/net/unix") else {
        return Vec::new();
    };
    unix.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (inode, path) = (f.get(6)?, f.get(7)?);
            (inodes.iter().any(|i| i == inode) && path.ends_with("/control.sock"))
                .then(|| PathBuf::from(path))
        })
        .collect()
}

/// Ask the daemon at `sock` which of its devices holds `path`.
fn ask_holder(sock: &Path, path: &Path) -> Option<String> {
    let mut s = std::os::unix::net::UnixStream::connect(sock).ok()?;
    let t = Some(std::time::Duration::from_secs(5));
    s.set_read_timeout(t).ok()?;
    s.set_write_timeout(t).ok()?;
    let abs = std::path::absolute(path).ok()?;
    let args = ["holder".to_string(), abs.to_string_lossy().into_owned()];
    let (ok, out, _) = crate::client::call(&mut s, &args, &[]).ok()?;
    let name = out.trim_end_matches('\n');
    (ok && !name.is_empty()).then(|| name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_shared_in_a_process_and_claims_are_refused() {
        let dir = std::env::temp_dir().join(format!("dmkit-hold-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let f = dir.join("a file");
        std::fs::write(&f, b"x").expect("write");
        let link = dir.join("link");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&f, &link).expect("symlink");

        let a = hold(&f).expect("hold");
        // a second table naming the file (by another path) shares the hold
        let b = hold(&link).expect("hold again");
        assert!(Arc::ptr_eq(&a, &b));
        // a tool's claim (another open file description) is refused, naming us
        match claim(&f) {
            Err(HoldError::Busy { path, owner }) => {
                assert_eq!(path, f);
                let o = owner.expect("the owner from /proc/locks");
                assert_eq!(o.pid, std::process::id());
                let msg = HoldError::Busy { path, owner: Some(o) }.to_string();
                assert!(
                    msg.contains("a file: Device or resource busy (EBUSY): held by"),
                    "{msg}"
                );
            }
            other => panic!("claim of a held file: {other:?}"),
        }
        drop(a);
        assert!(claim(&f).is_err(), "still held by the second table");
        drop(b);
        let c = claim(&f).expect("free once the last table let go");
        drop(c);
        assert!(matches!(claim(&dir.join("missing")), Err(HoldError::Io { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn lock_owner_reads_proc_locks() {
        let dev = rustix::fs::makedev(0xfe, 0);
        let t = "1: OFDLCK ADVISORY  READ -1 fe:00:77 0 EOF\n\
                 2: FLOCK  ADVISORY  WRITE 4321 fe:00:77 0 EOF\n\
                 2: -> FLOCK  ADVISORY  WRITE 99 fe:00:77 0 EOF\n";
        assert_eq!(lock_owner(t, dev, 77), Some(4321));
        assert_eq!(lock_owner(t, dev, 78), None);
    }
}
