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

    /// Whether `len` bytes at `off` lie inside the mapping.
    fn holds(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Copy `dst.len()` bytes at byte `off` out of the mapping; false (nothing
    /// copied) when the range is not inside it.
    ///
    /// The mapping is shared memory another process may write too (it is a
    /// file's page cache), so it is only ever copied in and out: no reference
    /// into it exists, and which thread copies which range when is the owner's
    /// business (its locks; see the users).
    pub fn read_at(&self, off: usize, dst: &mut [u8]) -> bool {
        if !self.holds(off, dst.len()) {
            return false;
        }
        // SAFETY: the range is inside the live mapping (checked above) and `dst`
        // is a distinct buffer of the caller's; no reference into the mapping
        // exists to alias.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// Copy `src` into the mapping at byte `off`; false (nothing copied) when
    /// the range is not inside it. See [`Mapped::read_at`].
    pub fn write_at(&self, off: usize, src: &[u8]) -> bool {
        if !self.holds(off, src.len()) {
            return false;
        }
        // SAFETY: as in read_at, the other way.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) };
        true
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
