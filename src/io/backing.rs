//! Backing files and block devices.

use rustix::fs::SeekFrom;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::queue::Sqe;
use super::rbd::{RbdImage, RbdOp, RbdRef, RbdSpec};
use super::sim::{SimDisk, SimRef};
use std::sync::Arc;

/// What a [`BackingFile`]'s I/O goes to.
#[derive(Debug)]
enum Backend {
    /// A regular file or block device, opened twice: with O_DIRECT (when the
    /// file system allows it) for aligned I/O, and buffered for the rest.
    File { buffered: File, direct: Option<File> },
    /// A file under a simulated disk (`io::sim`, crash trials): every operation
    /// passes the disk's hooks.
    Sim {
        buffered: File,
        direct: Option<File>,
        disk: Arc<SimDisk>,
    },
    /// An RBD image through librbd (`io::rbd`).
    Rbd(RbdImage),
}

/// Something tables map onto and metadata lives on: a regular file, a block
/// device or an RBD image; the one type every target and the metadata layer
/// (`pdata::dev`) do their I/O through.
#[derive(Debug)]
pub struct BackingFile {
    /// The path, or for an RBD image its `rbd:` name.
    pub path: PathBuf,
    backend: Backend,
    /// Alignment (bytes) O_DIRECT needs for offsets, lengths and memory.
    pub dio_align: u32,
    /// Logical block size in bytes (512 for regular files).
    pub logical_block_size: u32,
    pub is_block_device: bool,
    /// (st_dev, st_ino) for regular files, (0, st_rdev) for block devices: two
    /// paths to one file share it, so flushes are sent once per real file.
    pub identity: (u64, u64),
    pub rdev: Option<(u32, u32)>,
    pub read_only: bool,
    /// A file of a memory filesystem (tmpfs, ramfs): its I/O never waits for a
    /// device, so the engine does it inline rather than through io_uring, which
    /// would hand buffered writes and flushes to its worker threads.
    pub in_memory: bool,
    /// Empty flushes sent to this file (`dmkit stats` shows them).
    pub flushes: std::sync::atomic::AtomicU64,
    /// The exclusive hold a table keeps on the file (`io::hold`).
    pub hold: Option<std::sync::Arc<super::hold::Hold>>,
    /// Writes with FUA sent to this file (`dmkit stats` shows them): mapped
    /// requests', the copy engine's, and synchronous ones.
    pub fua_writes: std::sync::atomic::AtomicU64,
}

/// What the fast path needs of a backing file: copyable, no reference count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileHandle {
    pub to: HandleTo,
    pub dio_align: u32,
    /// See [`BackingFile::in_memory`].
    pub in_memory: bool,
    /// The simulated disk the file is on, if any: its operations go to an I/O
    /// queue through [`IoQueue::push_sim`](super::queue::IoQueue::push_sim).
    pub sim: Option<SimRef>,
}

/// Where a [`FileHandle`]'s operations go (its [`BackingFile`]'s backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandleTo {
    /// A file's descriptors: buffered, and O_DIRECT (-1 where there is none).
    Fd { buffered: RawFd, direct: RawFd },
    /// An RBD image.
    Rbd(RbdRef),
}

impl FileHandle {
    /// The descriptor to use for an I/O at `offset` of `len` bytes from `addr`:
    /// O_DIRECT when everything is aligned, else the buffered one.
    #[inline]
    fn fd_for(&self, buffered: RawFd, direct: RawFd, addr: usize, offset: u64, len: u64) -> RawFd {
        let mask = self.dio_align as u64 - 1;
        if direct >= 0 && (addr as u64 | offset | len) & mask == 0 {
            direct
        } else {
            buffered
        }
    }

    /// Whether every I/O through it is buffered: a file without an O_DIRECT
    /// descriptor, or on a memory filesystem (not an RBD image).
    pub fn buffered_only(&self) -> bool {
        match self.to {
            HandleTo::Fd { direct, .. } => direct < 0 || self.in_memory,
            HandleTo::Rbd(_) => false,
        }
    }

    /// Read `len` bytes at `offset` into `buf`.
    #[inline]
    pub fn read(&self, buf: *mut u8, len: u64, offset: u64) -> Sqe {
        match self.to {
            HandleTo::Rbd(img) => Sqe::Rbd {
                img,
                op: RbdOp::Read,
                buf,
                len,
                offset,
            },
            HandleTo::Fd { buffered, direct } => Sqe::Read {
                fd: self.fd_for(buffered, direct, buf as usize, offset, len),
                buf,
                len: len as u32,
                offset,
            },
        }
    }

    /// Write `len` bytes from `buf` at `offset`; `fua`: durable before completion.
    #[inline]
    pub fn write(&self, buf: *const u8, len: u64, offset: u64, fua: bool) -> Sqe {
        match self.to {
            HandleTo::Rbd(img) => Sqe::Rbd {
                img,
                op: RbdOp::Write { fua },
                buf: buf.cast_mut(),
                len,
                offset,
            },
            HandleTo::Fd { buffered, direct } => Sqe::Write {
                fd: self.fd_for(buffered, direct, buf as usize, offset, len),
                buf,
                len: len as u32,
                offset,
                dsync: fua,
            },
        }
    }

    /// Make completed writes durable.
    pub fn flush(&self) -> Sqe {
        match self.to {
            HandleTo::Rbd(img) => Sqe::Rbd {
                img,
                op: RbdOp::Flush,
                buf: std::ptr::null_mut(),
                len: 0,
                offset: 0,
            },
            HandleTo::Fd { buffered, .. } => Sqe::Fsync { fd: buffered },
        }
    }

    /// Deallocate a range (a file's hole reads as zeroes; an image's discard
    /// promises nothing about the data).
    pub fn discard(&self, offset: u64, len: u64) -> Sqe {
        self.range(RbdOp::Discard, PUNCH, offset, len)
    }

    /// Zero a range; `punch` lets a file deallocate it.
    pub fn zero(&self, punch: bool, offset: u64, len: u64) -> Sqe {
        let mode = if punch { PUNCH } else { ZERO_RANGE };
        self.range(RbdOp::WriteZeroes, mode, offset, len)
    }

    fn range(&self, op: RbdOp, mode: i32, offset: u64, len: u64) -> Sqe {
        match self.to {
            HandleTo::Rbd(img) => Sqe::Rbd {
                img,
                op,
                buf: std::ptr::null_mut(),
                len,
                offset,
            },
            HandleTo::Fd { buffered, .. } => Sqe::Fallocate {
                fd: buffered,
                mode,
                offset,
                len,
            },
        }
    }
}

const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;

impl BackingFile {
    /// Open `path` read-write (or read-only). `direct` asks for O_DIRECT where possible.
    pub fn open(path: &Path, read_only: bool, direct: bool) -> io::Result<BackingFile> {
        let meta = std::fs::metadata(path)?;
        let ft = meta.file_type();
        let is_block_device = ft.is_block_device();
        if !is_block_device && !ft.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file or block device",
            ));
        }
        let mut opts = OpenOptions::new();
        opts.read(true).write(!read_only);
        let buffered = opts.open(path)?;
        let direct_file = if direct {
            let mut o = OpenOptions::new();
            o.read(true).write(!read_only).custom_flags(libc::O_DIRECT);
            o.open(path).ok()
        } else {
            None
        };
        Self::from_files(path, buffered, direct_file, read_only)
    }

    /// A backing file on `buffered` (opened from `path`, whatever its type) and
    /// its O_DIRECT twin if any.
    pub fn from_files(
        path: &Path,
        buffered: File,
        direct_file: Option<File>,
        read_only: bool,
    ) -> io::Result<BackingFile> {
        let meta = buffered.metadata()?;
        let is_block_device = meta.file_type().is_block_device();
        let logical_block_size = if is_block_device {
            block_size_of(&buffered).unwrap_or(512)
        } else {
            512
        };
        let dio_align = match &direct_file {
            Some(f) => dio_alignment(f).unwrap_or(logical_block_size.max(512)),
            None => 512,
        };
        let rdev = if is_block_device {
            let r = meta.rdev();
            Some((rustix::fs::major(r), rustix::fs::minor(r)))
        } else {
            None
        };
        const TMPFS_MAGIC: u64 = 0x0102_1994;
        const RAMFS_MAGIC: u64 = 0x8584_58f6;
        let in_memory = !is_block_device
            && rustix::fs::fstatfs(&buffered)
                .is_ok_and(|st| matches!(st.f_type as u64, TMPFS_MAGIC | RAMFS_MAGIC));
        let identity = if is_block_device {
            (0, meta.rdev())
        } else {
            (meta.dev(), meta.ino())
        };
        Ok(BackingFile {
            path: path.to_path_buf(),
            backend: Backend::File {
                buffered,
                direct: direct_file,
            },
            dio_align,
            logical_block_size,
            is_block_device,
            identity,
            rdev,
            read_only,
            in_memory,
            flushes: std::sync::atomic::AtomicU64::new(0),
            hold: None,
            fua_writes: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Open an RBD image (`rbd:` names); writable ones with the exclusive lock.
    pub fn open_rbd(spec: &RbdSpec, read_only: bool) -> Result<BackingFile, String> {
        let img = RbdImage::open(spec, read_only)?;
        Ok(BackingFile {
            path: PathBuf::from(spec.to_string()),
            backend: Backend::Rbd(img),
            dio_align: 512,
            logical_block_size: 512,
            is_block_device: false,
            identity: Self::rbd_identity(spec),
            rdev: None,
            read_only,
            in_memory: false,
            flushes: std::sync::atomic::AtomicU64::new(0),
            hold: None,
            fua_writes: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// An image's identity: one per image of one cluster, whatever user opens it.
    pub fn rbd_identity(spec: &RbdSpec) -> (u64, u64) {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&(&spec.conf, &spec.pool, &spec.image), &mut h);
        (u64::MAX, std::hash::Hasher::finish(&h))
    }

    /// The fast path's copy of what it needs of the file.
    pub fn handle(&self) -> FileHandle {
        FileHandle {
            to: match &self.backend {
                Backend::File { buffered, direct } | Backend::Sim { buffered, direct, .. } => HandleTo::Fd {
                    buffered: buffered.as_raw_fd(),
                    direct: direct.as_ref().map_or(-1, |f| f.as_raw_fd()),
                },
                Backend::Rbd(img) => HandleTo::Rbd(img.handle()),
            },
            dio_align: self.dio_align,
            in_memory: self.in_memory,
            sim: self.sim().map(|d| SimRef::to(d)),
        }
    }

    /// The same file under the simulated disk `disk` (an RBD image stays as it is).
    pub fn simulated(mut self, disk: Arc<SimDisk>) -> BackingFile {
        self.backend = match self.backend {
            Backend::File { buffered, direct } => Backend::Sim {
                buffered,
                direct,
                disk,
            },
            other => other,
        };
        self
    }

    /// The simulated disk the file is on, if any.
    pub fn sim(&self) -> Option<&Arc<SimDisk>> {
        match &self.backend {
            Backend::Sim { disk, .. } => Some(disk),
            _ => None,
        }
    }

    /// Whether this is an RBD image (no file of this host).
    pub fn is_rbd(&self) -> bool {
        matches!(self.backend, Backend::Rbd(_))
    }

    /// Size in bytes (block devices ask the kernel; files stat; images librbd).
    pub fn size(&self) -> io::Result<u64> {
        match &self.backend {
            Backend::Rbd(img) => img.size(),
            Backend::File { buffered, .. } | Backend::Sim { buffered, .. } if self.is_block_device => {
                use std::io::Seek;
                let mut f = buffered;
                f.seek(io::SeekFrom::End(0))
            }
            Backend::File { buffered, .. } | Backend::Sim { buffered, .. } => Ok(buffered.metadata()?.len()),
        }
    }

    /// The file itself, where there is one (not for an RBD image).
    pub fn file(&self) -> Option<&File> {
        match &self.backend {
            Backend::File { buffered, .. } | Backend::Sim { buffered, .. } => Some(buffered),
            Backend::Rbd(_) => None,
        }
    }

    /// Make everything written durable.
    pub fn sync(&self) -> io::Result<()> {
        self.flushes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match &self.backend {
            Backend::Rbd(img) => img.flush(),
            Backend::File { buffered, .. } => buffered.sync_data(),
            Backend::Sim { buffered, disk, .. } => {
                buffered.sync_data()?;
                disk.on_flush(buffered.as_raw_fd());
                Ok(())
            }
        }
    }

    /// Read at byte `off`, synchronously; past the end reads as zeroes.
    pub fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        if let Backend::Sim { buffered, disk, .. } = &self.backend {
            disk.on_read(buffered.as_raw_fd())
                .map_err(io::Error::from_raw_os_error)?;
        }
        let mut done = 0;
        while done < buf.len() {
            let at = off + done as u64;
            let n = match &self.backend {
                Backend::Rbd(img) => img.read_at(&mut buf[done..], at)?,
                Backend::File { buffered, .. } | Backend::Sim { buffered, .. } => {
                    buffered.read_at(&mut buf[done..], at)?
                }
            };
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }

    /// Read at byte `off`, synchronously, failing (UnexpectedEof) past the end
    /// of a file instead of reading zeroes there.
    pub fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        match &self.backend {
            Backend::File { buffered, .. } => buffered.read_exact_at(buf, off),
            Backend::Sim { buffered, disk, .. } => {
                disk.on_read(buffered.as_raw_fd())
                    .map_err(io::Error::from_raw_os_error)?;
                buffered.read_exact_at(buf, off)
            }
            Backend::Rbd(_) => self.read_at(buf, off),
        }
    }

    /// Write at byte `off`, synchronously; `fua`: durable before returning.
    pub fn write_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        if fua {
            self.fua_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        use std::os::unix::fs::FileExt;
        match &self.backend {
            Backend::Rbd(img) => {
                img.write_all_at(buf, off)?;
                if fua {
                    img.flush()?;
                }
            }
            Backend::File { buffered: f, .. } => {
                f.write_all_at(buf, off)?;
                if fua {
                    f.sync_data()?;
                }
            }
            Backend::Sim {
                buffered: f, disk, ..
            } => {
                let fd = f.as_raw_fd();
                disk.on_write(fd, off, buf, fua)
                    .map_err(io::Error::from_raw_os_error)?;
                f.write_all_at(buf, off)?;
                if fua {
                    f.sync_data()?;
                    disk.on_flush(fd);
                }
            }
        }
        Ok(())
    }

    /// The O_DIRECT descriptor for `len` bytes at `off`, if the file has one
    /// and both are aligned to it (memory is not: see the callers).
    fn direct_for(&self, off: u64, len: usize) -> Option<&File> {
        let mask = u64::from(self.dio_align.max(1)) - 1;
        match &self.backend {
            Backend::File { direct: Some(d), .. } if (off | len as u64) & mask == 0 => Some(d),
            _ => None,
        }
    }

    /// As [`read_at`](Self::read_at), but through O_DIRECT where the offset and
    /// length allow it (by way of an aligned bounce buffer when `buf` is not):
    /// for data a target reads synchronously beside its direct I/O (raid's
    /// stripes), so it neither fills the page cache nor waits behind it.
    pub fn read_direct_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let Some(d) = self.direct_for(off, buf.len()) else {
            return self.read_at(buf, off);
        };
        if (buf.as_ptr() as usize) & (super::buf::BUF_ALIGN - 1) == 0 {
            return d.read_exact_at(buf, off);
        }
        let mut b = super::buf::AlignedBuf::new(buf.len());
        d.read_exact_at(&mut b.as_mut_slice()[..buf.len()], off)?;
        buf.copy_from_slice(&b.as_slice()[..buf.len()]);
        Ok(())
    }

    /// As [`write_at`](Self::write_at), through O_DIRECT where the offset and
    /// length allow it (see [`read_direct_at`](Self::read_direct_at)).
    pub fn write_direct_at(&self, buf: &[u8], off: u64, fua: bool) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let Some(d) = self.direct_for(off, buf.len()) else {
            return self.write_at(buf, off, fua);
        };
        if fua {
            self.fua_writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if (buf.as_ptr() as usize) & (super::buf::BUF_ALIGN - 1) == 0 {
            d.write_all_at(buf, off)?;
        } else {
            let mut b = super::buf::AlignedBuf::new(buf.len());
            b.as_mut_slice()[..buf.len()].copy_from_slice(buf);
            d.write_all_at(&b.as_slice()[..buf.len()], off)?;
        }
        if fua {
            d.sync_data()?;
        }
        Ok(())
    }

    /// Discard a range, synchronously (a file gets a hole).
    pub fn discard_at(&self, off: u64, len: u64) -> io::Result<()> {
        match &self.backend {
            Backend::Rbd(img) => img.discard(off, len),
            Backend::File { buffered: f, .. } | Backend::Sim { buffered: f, .. } => {
                if let Some(d) = self.sim() {
                    d.on_zero(f.as_raw_fd(), off, len)
                        .map_err(io::Error::from_raw_os_error)?;
                }
                rustix::fs::fallocate(
                    f,
                    rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
                    off,
                    len,
                )?;
                Ok(())
            }
        }
    }

    /// Allocation of `[offset, offset+len)`: a list of (length, is_hole) covering it.
    /// Block devices and RBD images report everything as data. Holes of sparse files read as zeroes.
    pub fn extents(&self, offset: u64, len: u64, out: &mut Vec<(u64, bool)>) -> io::Result<()> {
        let end = offset + len;
        let Some(file) = self.file().filter(|_| !self.is_block_device) else {
            out.push((len, false));
            return Ok(());
        };
        let mut pos = offset;
        while pos < end {
            let data = seek(file, SeekFrom::Data(pos))?;
            let data = match data {
                Some(d) => d.min(end),
                None => end, // no data after pos: hole to the end
            };
            if data > pos {
                out.push((data - pos, true));
                pos = data;
                continue;
            }
            let hole = seek(file, SeekFrom::Hole(pos))?.unwrap_or(end).min(end);
            let hole = hole.max(pos + 1);
            out.push((hole - pos, false));
            pos = hole;
        }
        Ok(())
    }
}

/// lseek for SEEK_DATA/SEEK_HOLE; None where the answer is ENXIO (past the last data).
fn seek(f: &File, to: SeekFrom) -> io::Result<Option<u64>> {
    match rustix::fs::seek(f, to) {
        Ok(p) => Ok(Some(p)),
        Err(rustix::io::Errno::NXIO) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// BLKSSZGET: a block device's logical block size.
fn block_size_of(f: &File) -> Option<u32> {
    rustix::fs::ioctl_blksszget(f).ok().filter(|&v| v > 0)
}

/// The O_DIRECT alignment from statx(STATX_DIOALIGN), where the kernel reports it.
fn dio_alignment(f: &File) -> Option<u32> {
    use rustix::fs::{statx, AtFlags, StatxFlags};
    let stx = statx(f, c"", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).ok()?;
    if !StatxFlags::from_bits_retain(stx.stx_mask).contains(StatxFlags::DIOALIGN) {
        return None;
    }
    let a = stx.stx_dio_offset_align.max(stx.stx_dio_mem_align);
    (a > 0).then_some(a)
}
