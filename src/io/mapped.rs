//! A file mapped shared into memory: stores land in the kernel's page cache at
//! once, with no system call, and outlive the process (a writecache's pmem mode,
//! the restart logs).

use std::io;
use std::os::fd::AsFd;

pub struct Mapped {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory owned by this value; which parts are
// accessed by whom is decided by the owner's locks (see the users' comments).
unsafe impl Send for Mapped {}
// SAFETY: as Send.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Map the first `len` bytes of `file`, readable and writable, shared.
    pub fn new(file: impl AsFd, len: usize) -> io::Result<Mapped> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "nothing to map"));
        }
        // SAFETY: a fresh shared mapping; no reference into it outlives this
        // value, which unmaps it on drop.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                file,
                0,
            )
        }?;
        Ok(Mapped { ptr: ptr.cast(), len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `len` bytes at byte `off`, if in bounds.
    pub fn bytes(&self, off: usize, len: usize) -> Option<&[u8]> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: in bounds of the live mapping; writers of the range are kept
        // apart from its readers by the owner's locks.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) })
    }

    /// `len` bytes at byte `off` to write, if in bounds. The caller owns the
    /// range for as long as it holds the slice (decided under its own lock).
    #[allow(clippy::mut_from_ref)]
    pub fn bytes_mut(&self, off: usize, len: usize) -> Option<&mut [u8]> {
        if off.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: in bounds of the live mapping; only the range's owner of the
        // moment writes it (the caller's contract above).
        Some(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) })
    }

    /// Write the pages holding `len` bytes at `off` to the file's device and wait.
    pub fn msync(&self, off: usize, len: usize) -> io::Result<()> {
        let page = 4096usize;
        let start = (off & !(page - 1)).min(self.len);
        let end = off.saturating_add(len).min(self.len);
        if end <= start {
            return Ok(());
        }
        // SAFETY: a page-aligned range inside the live mapping.
        unsafe {
            rustix::mm::msync(
                self.ptr.add(start).cast(),
                end - start,
                rustix::mm::MsyncFlags::SYNC,
            )
        }
        .map_err(io::Error::from)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing uses them after drop.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}
