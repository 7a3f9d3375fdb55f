//! Device files: every device as a regular file `<run dir>/block/MAJOR:MINOR`, in
//! a FUSE filesystem the daemon serves, so a program run through the dm ioctl
//! door (`dmkit exec`) can open `/dev/mapper/NAME` where no kernel block device
//! backs it: the door's preloaded library opens the device's file instead of a
//! node whose major has no driver here, and answers the block-device ioctls and
//! `fstat` on it (src/control/preload.c). That is how LVM wipes a new thin pool's
//! metadata, `mkfs` makes a filesystem and `dd` copies, on a machine without
//! ublk. Where ublk exists, its block devices are the faster way (`dmkit attach`).
//!
//! Mounted the first time `dmkit exec` asks (most daemons never need it), with
//! FUSE's `auto_unmount`, so the mount goes with the daemon even when it is
//! killed. Reads and writes go through the device's table like any request
//! (`devio`, on the FUSE session's own threads); an open counts in the device's
//! open count as a block device's does, and its I/O goes to the device it
//! opened (ENXIO once that is removed, whatever has its number since); a read-only device opens for reading
//! only (EACCES otherwise, as a read-only block device). `fuser` speaks the FUSE
//! protocol: a well-kept crate that needs no libfuse.

use crate::mapper::engine::Dest;
use crate::mapper::registry::Registry;
use crate::mapper::{devio, Device};
use crate::sync::Unpoison;
use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, KernelConfig,
    LockOwner, MountOption, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, ReplyXattr, Request, SessionACL, WriteFlags,
};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::mapper::DM_MAJOR;
/// The folder under the run directory.
pub const DIR: &str = "block";
const ROOT: u64 = 1;
/// A device's inode: this plus its minor.
const DEV_INO: u64 = 1 << 32;
/// Largest transfer one FUSE request carries (the kernel's own cap is lower).
const MAX_IO: usize = 4 << 20;
/// Attributes are asked for again at once: a device's size changes with its table.
const TTL: Duration = Duration::ZERO;
const SECTOR: u64 = 512;
/// The attribute that carries a device's logical block size (src/control/preload.c).
const LBS_XATTR: &str = "user.dmkit.logical_block_size";

/// The mounted filesystem, once asked for.
#[derive(Default)]
pub struct DeviceFiles {
    session: Mutex<Option<(PathBuf, fuser::BackgroundSession)>>,
    disabled: bool,
    /// The group the daemon's sockets are shared with (`serve --group`): its
    /// members open the device files too (mode 0660, as a disk's node).
    group: std::sync::atomic::AtomicU32,
}

impl DeviceFiles {
    /// One that never mounts (fuzzing the protocol).
    pub fn disabled() -> DeviceFiles {
        DeviceFiles {
            disabled: true,
            ..DeviceFiles::default()
        }
    }

    /// Share the device files with group `gid` (`serve --group`).
    pub fn set_group(&self, gid: u32) {
        self.group.store(gid, Ordering::Relaxed);
    }

    /// Mount the device files under `run_dir` if they are not yet: their folder.
    pub fn ensure(&self, reg: &Arc<Registry>, run_dir: &Path) -> Result<PathBuf, String> {
        if self.disabled {
            return Err("device files are off in this daemon".into());
        }
        let mut s = self.session.lock().unpoisoned();
        if let Some((dir, _)) = &*s {
            return Ok(dir.clone());
        }
        let dir = run_dir.join(DIR);
        // a killed daemon's mount that auto_unmount has not taken away yet
        let _ = nix_detach(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("dmkit".into()),
            MountOption::Subtype("dmkit".into()),
            MountOption::AutoUnmount,
            MountOption::DefaultPermissions,
        ];
        config.acl = SessionACL::All;
        config.n_threads = Some(4);
        let fs = Files {
            reg: reg.clone(),
            opens: Default::default(),
            next_fh: 1.into(),
            group: self.group.load(Ordering::Relaxed),
        };
        let session = fuser::spawn_mount(fs, &dir, &config)
            .map_err(|e| format!("mounting the device files at {}: {e}", dir.display()))?;
        *s = Some((dir.clone(), session));
        Ok(dir)
    }
}

impl DeviceFiles {
    /// Take the device files away (the daemon is leaving): detached at once, so a
    /// program that still holds one open cannot keep the daemon from exiting.
    pub fn unmount(&self) {
        if let Some((dir, session)) = self.session.lock().unpoisoned().take() {
            if let Err(e) = nix_detach(&dir) {
                tracing::warn!("unmounting the device files at {}: {e}", dir.display());
            }
            // its threads end with the process; joining them could wait on a client
            std::mem::forget(session);
        }
    }
}

/// Detach whatever is mounted at `dir` (nothing happens if nothing is).
fn nix_detach(dir: &Path) -> std::io::Result<()> {
    rustix::mount::unmount(dir, rustix::mount::UnmountFlags::DETACH).map_err(std::io::Error::from)
}

/// An open of a device file: its device, and whether it still counts in the
/// device's open count.
struct Open {
    dev: Arc<Device>,
    /// A close of it has been seen (a flush) and its end not yet.
    closing: bool,
}

struct Files {
    reg: Arc<Registry>,
    /// Each open's device, by its file handle: I/O goes to the device that was
    /// opened, whatever has the number since.
    opens: Mutex<std::collections::HashMap<u64, Open>>,
    next_fh: std::sync::atomic::AtomicU64,
    /// The group the files belong to (0: root's alone).
    group: u32,
}

impl Files {
    fn device(&self, ino: INodeNo) -> Option<Arc<Device>> {
        let minor = u32::try_from(ino.0.checked_sub(DEV_INO)?).ok()?;
        self.reg.by_minor(minor)
    }

    /// An open ends (its release).
    fn uncount(&self, o: Open) {
        let _ = o
            .dev
            .open_count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if o.closing {
            o.dev.close_ended();
        }
        self.reg.closed(&o.dev);
    }

    /// The device an open is on (None: not open, or removed since).
    fn opened(&self, fh: FileHandle) -> Option<Arc<Device>> {
        let d = self.opens.lock().unpoisoned().get(&fh.0).map(|o| o.dev.clone())?;
        (!d.removed.load(Ordering::SeqCst)).then_some(d)
    }

    fn by_name(&self, name: &OsStr) -> Option<Arc<Device>> {
        let (major, minor) = name.to_str()?.split_once(':')?;
        if major.parse::<u32>().ok()? != DM_MAJOR {
            return None;
        }
        self.reg.by_minor(minor.parse().ok()?)
    }
}

fn attr(ino: u64, kind: FileType, size: u64, perm: u16, gid: u32) -> FileAttr {
    let t = SystemTime::UNIX_EPOCH;
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size / SECTOR,
        atime: t,
        mtime: t,
        ctime: t,
        crtime: t,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid: 0,
        gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// A device's file: the owner's alone, or its group's too where the daemon's
/// sockets are shared with a group (`serve --group`), as a disk's node is.
fn dev_attr(d: &Device, gid: u32) -> FileAttr {
    let perm = match (d.read_only(), gid != 0) {
        (true, false) => 0o400,
        (true, true) => 0o440,
        (false, false) => 0o600,
        (false, true) => 0o660,
    };
    attr(
        DEV_INO + u64::from(d.minor),
        FileType::RegularFile,
        d.size_sectors() * SECTOR,
        perm,
        gid,
    )
}

fn errno(e: &std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

/// The whole logical blocks (`unit` bytes) around `len` bytes at `off`, within
/// `size` bytes: (first sector, bytes), or None past the end.
fn span(off: u64, len: usize, size: u64, unit: u64) -> Option<(u64, usize)> {
    if off >= size || len == 0 {
        return None;
    }
    let end = off.saturating_add(len as u64).min(size);
    let first = off / unit * unit;
    let last = end.div_ceil(unit).saturating_mul(unit).min(size);
    Some((first / SECTOR, (last - first) as usize))
}

/// A device's logical block size in bytes (512 at least).
fn unit(d: &Device) -> u64 {
    u64::from(d.logical_block_size()).max(SECTOR)
}

impl Filesystem for Files {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent.0 == ROOT).then(|| self.by_name(name)).flatten() {
            Some(d) => reply.entry(&TTL, &dev_attr(&d, self.group), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == ROOT {
            return reply.attr(&TTL, &attr(ROOT, FileType::Directory, 0, 0o755, 0));
        }
        match self.device(ino) {
            Some(d) => reply.attr(&TTL, &dev_attr(&d, self.group)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino.0 != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let mut devs = self.reg.list();
        devs.sort_by_key(|d| d.minor);
        let entries = [
            (ROOT, FileType::Directory, ".".to_string()),
            (ROOT, FileType::Directory, "..".to_string()),
        ]
        .into_iter()
        .chain(devs.iter().map(|d| {
            (
                DEV_INO + u64::from(d.minor),
                FileType::RegularFile,
                format!("{DM_MAJOR}:{}", d.minor),
            )
        }));
        for (i, (ino, kind, name)) in entries.enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let Some(d) = self.device(ino) else {
            return reply.error(Errno::ENOENT);
        };
        if d.read_only() && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EACCES);
        }
        d.open_count.fetch_add(1, Ordering::SeqCst);
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.opens.lock().unpoisoned().insert(
            fh,
            Open {
                dev: d,
                closing: false,
            },
        );
        reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let o = self.opens.lock().unpoisoned().remove(&fh.0);
        if let Some(o) = o {
            self.uncount(o);
        }
        reply.ok();
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(d) = self.opened(fh) else {
            return reply.error(Errno::ENXIO);
        };
        let bytes = d.size_sectors() * SECTOR;
        let Some((first, len)) = span(offset, (size as usize).min(MAX_IO), bytes, unit(&d)) else {
            return reply.data(&[]);
        };
        let mut buf = vec![0u8; len];
        if let Err(e) = devio::read(&Dest::Dm(d), first, &mut buf) {
            return reply.error(errno(&e));
        }
        let skip = (offset - first * SECTOR) as usize;
        let want = (size as usize).min(MAX_IO).min((bytes - offset) as usize);
        reply.data(&buf[skip..skip + want]);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(d) = self.opened(fh) else {
            return reply.error(Errno::ENXIO);
        };
        if d.read_only() {
            return reply.error(Errno::EROFS);
        }
        let bytes = d.size_sectors() * SECTOR;
        let Some((first, len)) = span(offset, data.len().min(MAX_IO), bytes, unit(&d)) else {
            return reply.error(Errno::ENOSPC);
        };
        let fua = flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0;
        let dest = Dest::Dm(d);
        let skip = (offset - first * SECTOR) as usize;
        let n = data.len().min(len - skip);
        let r = if skip == 0 && n == len {
            devio::write(&dest, first, &data[..n], fua)
        } else {
            // part of a sector: read the sectors around it, then write them whole
            let mut buf = vec![0u8; len];
            devio::read(&dest, first, &mut buf).and_then(|()| {
                buf[skip..skip + n].copy_from_slice(&data[..n]);
                devio::write(&dest, first, &buf, fua)
            })
        };
        match r {
            Ok(()) => reply.written(n as u32),
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// `user.dmkit.logical_block_size`: the device's logical block size, which
    /// the door reports as the block device's sector size (BLKSSZGET). No other
    /// attribute exists.
    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let Some(d) = (name == LBS_XATTR).then(|| self.device(ino)).flatten() else {
            return reply.error(Errno::NO_XATTR);
        };
        let v = unit(&d).to_string();
        match size {
            0 => reply.size(v.len() as u32),
            n if (n as usize) < v.len() => reply.error(Errno::ERANGE),
            _ => reply.data(v.as_bytes()),
        }
    }

    /// A close of a descriptor of this open: its end comes with the release
    /// (the last close of the open file description), which FUSE sends after
    /// `close()` has returned, while LVM asks for the open count of a device it
    /// has just closed. So the device is told a close may be ending the open
    /// ([`Device::settled_open_count`] waits for it a moment); the count itself
    /// follows the release, so a child's exit or a closed duplicate does not end
    /// an open its parent still holds.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        if let Some(o) = self.opens.lock().unpoisoned().get_mut(&fh.0) {
            let first = !std::mem::replace(&mut o.closing, true);
            o.dev.close_started(first);
        }
        reply.ok();
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.opened(fh).map(|d| devio::flush(&Dest::Dm(d))) {
            Some(Ok(())) => reply.ok(),
            Some(Err(e)) => reply.error(errno(&e)),
            None => reply.error(Errno::ENXIO),
        }
    }

    /// Discards (BLKDISCARD, `fallocate --punch-hole`) and zeroing (BLKZEROOUT,
    /// `--zero-range`) of whole sectors.
    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let Some(d) = self.opened(fh) else {
            return reply.error(Errno::ENXIO);
        };
        let bytes = d.size_sectors() * SECTOR;
        if !offset.is_multiple_of(unit(&d))
            || !length.is_multiple_of(unit(&d))
            || offset.saturating_add(length) > bytes
        {
            return reply.error(Errno::EINVAL);
        }
        let dest = Dest::Dm(d);
        let (first, n) = (offset / SECTOR, length / SECTOR);
        let r = if mode & libc::FALLOC_FL_PUNCH_HOLE != 0 {
            devio::discard(&dest, first, n)
        } else if mode & libc::FALLOC_FL_ZERO_RANGE != 0 {
            let zeros = vec![0u8; MAX_IO];
            let mut done = 0;
            let mut r = Ok(());
            while done < n && r.is_ok() {
                let k = (n - done).min(MAX_IO as u64 / SECTOR);
                r = devio::write(&dest, first + done, &zeros[..(k * SECTOR) as usize], false);
                done += k;
            }
            r
        } else {
            return reply.error(Errno::EOPNOTSUPP);
        };
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(&e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::span;

    #[test]
    fn spans_cover_whole_sectors_within_the_device() {
        assert_eq!(span(0, 4096, 1 << 20, 512), Some((0, 4096)));
        assert_eq!(span(100, 10, 1 << 20, 512), Some((0, 512)));
        assert_eq!(span(510, 4, 1 << 20, 512), Some((0, 1024)));
        assert_eq!(span(1024, 4096, 2048, 512), Some((2, 1024)));
        assert_eq!(span(2048, 1, 2048, 512), None);
        assert_eq!(span(0, 0, 2048, 512), None);
        assert_eq!(
            span(u64::MAX - 1, 4096, u64::MAX, 512),
            Some((u64::MAX / 512, 511))
        );
        // a device of 4 KiB logical blocks: whole blocks around the bytes
        assert_eq!(span(1024, 1024, 1 << 20, 4096), Some((0, 4096)));
        assert_eq!(span(4000, 200, 1 << 20, 4096), Some((0, 8192)));
        assert_eq!(span(8192, 4096, 1 << 20, 4096), Some((16, 4096)));
    }
}
