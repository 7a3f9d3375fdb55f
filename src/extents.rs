//! A file as a `linear` table over the block device that holds it: the file's
//! extents (FIEMAP) become one segment each, as seed 002 builds its 1024-segment
//! device. Writes through such a device land in the file's blocks without the
//! filesystem, so the file must be fully allocated (`fallocate`) and stay so.
//!
//! FIEMAP is one ioctl with a variable-length reply; rustix does not wrap it,
//! so it is called here through libc.

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
/// Extent flags that mean "no fixed place on the device": unknown location,
/// delayed allocation, encoded (compressed/encrypted), data inline in metadata,
/// not block-aligned, tail-packed.
const NOT_ADDRESSABLE: u32 = 0x2 | 0x4 | 0x8 | 0x80 | 0x100 | 0x200 | 0x400;
/// Extents asked for per call.
const BATCH: usize = 256;

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapExtent {
    logical: u64,
    physical: u64,
    length: u64,
    reserved64: [u64; 2],
    flags: u32,
    reserved: [u32; 3],
}

#[repr(C)]
struct Fiemap {
    start: u64,
    length: u64,
    flags: u32,
    mapped_extents: u32,
    extent_count: u32,
    reserved: u32,
    extents: [FiemapExtent; BATCH],
}

/// One extent of a file: byte offset in the file, byte offset on the device,
/// length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub logical: u64,
    pub physical: u64,
    pub length: u64,
}

/// The extents of `path` in file order, adjacent ones merged; an error names a
/// hole or an extent without a fixed place on the device.
pub fn file_extents(path: &Path) -> Result<Vec<Extent>> {
    let f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let size = f.metadata()?.len();
    let mut out: Vec<Extent> = Vec::new();
    let mut start = 0u64;
    let mut flags = FIEMAP_FLAG_SYNC;
    'calls: while start < size {
        let mut fm = Box::new(Fiemap {
            start,
            length: u64::MAX - start,
            flags,
            mapped_extents: 0,
            extent_count: BATCH as u32,
            reserved: 0,
            extents: [FiemapExtent::default(); BATCH],
        });
        flags = 0; // sync once
                   // SAFETY: FS_IOC_FIEMAP reads the header and writes at most
                   // `extent_count` extents into the array that follows it; `fm` is a live,
                   // exclusively borrowed allocation of exactly that layout.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), FS_IOC_FIEMAP, &mut *fm as *mut Fiemap) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            bail!(
                "{}: the filesystem does not report file extents (FIEMAP: {e}); \
                 the file must live on a block-device filesystem such as ext4 or xfs",
                path.display()
            );
        }
        let n = (fm.mapped_extents as usize).min(BATCH);
        if n == 0 {
            break;
        }
        for x in &fm.extents[..n] {
            if x.flags & NOT_ADDRESSABLE != 0 {
                bail!(
                    "{}: the extent at byte {} has no fixed place on the device (flags {:#x}); \
                     preallocate the file with fallocate",
                    path.display(),
                    x.logical,
                    x.flags
                );
            }
            let e = Extent {
                logical: x.logical,
                physical: x.physical,
                length: x.length.min(size.saturating_sub(x.logical)),
            };
            match out.last_mut() {
                Some(l) if l.logical + l.length == e.logical && l.physical + l.length == e.physical => {
                    l.length += e.length
                }
                _ => out.push(e),
            }
            start = x.logical + x.length;
            if x.flags & FIEMAP_EXTENT_LAST != 0 {
                break 'calls;
            }
        }
    }
    let mut at = 0;
    for e in &out {
        if e.logical != at {
            bail!(
                "{}: a hole at byte {at} (no blocks up to byte {}); preallocate the file with fallocate",
                path.display(),
                e.logical
            );
        }
        at += e.length;
    }
    if at < size {
        bail!(
            "{}: a hole at byte {at} (no blocks up to the end, byte {size}); preallocate the file with fallocate",
            path.display()
        );
    }
    Ok(out)
}

/// The block device node holding `path` (from its st_dev, through sysfs).
pub fn holding_device(path: &Path) -> Result<PathBuf> {
    let m = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
    let (maj, min) = (libc::major(m.dev()), libc::minor(m.dev()));
    let uevent = format!("/sys/dev/block/{maj}:{min}/uevent");
    let text = std::fs::read_to_string(&uevent).with_context(|| {
        format!(
            "{}: its filesystem is on device {maj}:{min}, which is not a block device ({uevent})",
            path.display()
        )
    })?;
    let name = text
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .with_context(|| format!("{uevent} names no device"))?;
    Ok(PathBuf::from("/dev").join(name))
}

/// A `linear` table mapping a device onto the extents of `path`, one line per
/// extent, in 512-byte sectors.
pub fn linear_table(path: &Path) -> Result<String> {
    let dev = holding_device(path)?;
    let extents = file_extents(path)?;
    if extents.is_empty() {
        bail!("{}: the file is empty", path.display());
    }
    let mut out = String::new();
    for e in &extents {
        if e.logical % 512 != 0 || e.physical % 512 != 0 || e.length % 512 != 0 {
            bail!(
                "{}: the extent at byte {} is not in whole 512-byte sectors",
                path.display(),
                e.logical
            );
        }
        out.push_str(&format!(
            "{} {} linear {} {}\n",
            e.logical / 512,
            e.length / 512,
            dev.display(),
            e.physical / 512
        ));
    }
    Ok(out)
}
