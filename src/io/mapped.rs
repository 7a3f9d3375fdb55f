//! A file mapped shared into memory: stores land in the kernel's page cache at
//! once, with no system call, and outlive the process (a writecache's pmem mode,
//! the restart logs).
//!
//! A mapped file can shrink under the daemon (another process truncates it):
//! touching a page past its new end raises SIGBUS, which would kill the daemon
//! and every device in it. Every copy in or out of a mapping is therefore
//! guarded: the thread notes the range it copies, and a SIGBUS inside that
//! range puts an anonymous zero page over the faulting page and lets the copy
//! finish; the copy then reports failure and the mapping refuses every later
//! copy (its pages are no longer the file's). A SIGBUS anywhere else takes the
//! action that was in place before (by default the process dies, as without
//! this). Measured against `pread`/`pwrite` in BENCHMARKS.md ("A mapped copy,
//! guarded"): the guard adds two thread-local stores and a load per copy.

use std::cell::Cell;
use std::io;
use std::os::fd::AsFd;
use std::sync::atomic::{compiler_fence, AtomicBool, Ordering};
use std::sync::OnceLock;

pub struct Mapped {
    ptr: *mut u8,
    len: usize,
    /// A copy met a page the file no longer has: nothing is copied any more.
    broken: AtomicBool,
}

/// What a thread is copying: the address range and its mapping's `broken`.
#[derive(Clone, Copy)]
struct Copying {
    start: usize,
    end: usize,
    broken: *const AtomicBool,
}

const IDLE: Copying = Copying {
    start: 0,
    end: 0,
    broken: std::ptr::null(),
};

thread_local! {
    static COPYING: Cell<Copying> = const { Cell::new(IDLE) };
}

/// The SIGBUS action in place before ours, taken again for faults not ours.
static PREVIOUS: OnceLock<Option<libc::sigaction>> = OnceLock::new();
/// The page size, read before any handler can run.
static PAGE: OnceLock<usize> = OnceLock::new();

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    // `const` thread-locals without a destructor are plain TLS: reading them
    // here takes no lock and allocates nothing
    let c = COPYING.with(Cell::get);
    if let (true, Some(&page)) = ((c.start..c.end).contains(&addr), PAGE.get()) {
        // SAFETY: `broken` is the mapping being copied, alive for the copy.
        // Marked before the page is replaced, so another thread that reads
        // the zero page afterwards sees it marked when its copy ends.
        unsafe { (*c.broken).store(true, Ordering::SeqCst) };
        // SAFETY: mmap is async-signal-safe; the page lies inside a live
        // mapping of ours that this thread is copying (its owner unmaps it only
        // on drop, which cannot run during the copy), so replacing it harms
        // nothing else.
        let r = unsafe {
            libc::mmap(
                (addr & !(page - 1)) as *mut libc::c_void,
                page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if r != libc::MAP_FAILED {
            return;
        }
    }
    // not a guarded copy: the previous action; the faulting access runs again
    // on return and meets it (a SIGBUS sent by kill meets it at the raise)
    let previous = PREVIOUS.get().copied().flatten();
    // SAFETY: sigaction and raise are async-signal-safe; a zeroed sigaction is
    // SIG_DFL with no flags.
    unsafe {
        let mut act: libc::sigaction = previous.unwrap_or_else(|| std::mem::zeroed());
        if previous.is_none() {
            act.sa_sigaction = libc::SIG_DFL;
        }
        libc::sigaction(sig, &act, std::ptr::null_mut());
        if (*info).si_code <= 0 {
            libc::raise(sig);
        }
    }
}

/// Install the SIGBUS guard once per process.
fn guard() {
    PAGE.get_or_init(rustix::param::page_size);
    PREVIOUS.get_or_init(|| {
        // SAFETY: a plain sigaction call with a handler that only does
        // async-signal-safe work; `old` receives the action it replaces.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigbus as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut act.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &act, &mut old) != 0 {
                tracing::warn!("no SIGBUS guard for mapped files: {}", io::Error::last_os_error());
                return None;
            }
            Some(old)
        }
    });
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
        guard();
        Ok(Mapped {
            ptr: ptr.cast(),
            len,
            broken: AtomicBool::new(false),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `len` bytes at `off` lie inside the mapping, and it is whole.
    fn holds(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|end| end <= self.len) && !self.is_broken()
    }

    /// A copy met a page past the file's end (it was truncated): every copy
    /// fails from then on.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
    }

    /// Run `copy` (which touches `len` bytes at `at`) guarded; false when a
    /// page of the mapping was found gone, by this copy or another.
    fn guarded(&self, at: *mut u8, len: usize, copy: impl FnOnce()) -> bool {
        let was = self.is_broken();
        COPYING.with(|c| {
            c.set(Copying {
                start: at as usize,
                end: at as usize + len,
                broken: &self.broken,
            })
        });
        compiler_fence(Ordering::SeqCst);
        copy();
        compiler_fence(Ordering::SeqCst);
        COPYING.with(|c| c.set(IDLE));
        let broken = self.broken.load(Ordering::SeqCst);
        if broken && !was {
            tracing::error!("a mapped file shrank under the daemon: its device's I/O fails from now on");
        }
        !broken
    }

    /// Copy `dst.len()` bytes at byte `off` out of the mapping; false when the
    /// range is not inside it (nothing copied) or the file no longer holds it
    /// (`dst` is then partly zeroes and must not be used).
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
        // exists to alias. A page gone from the file is replaced under the copy
        // (`guarded`).
        let at = unsafe { self.ptr.add(off) };
        self.guarded(at, dst.len(), || unsafe {
            std::ptr::copy_nonoverlapping(at, dst.as_mut_ptr(), dst.len())
        })
    }

    /// Copy `src` into the mapping at byte `off`; false when the range is not
    /// inside it (nothing copied) or the file no longer holds it. See
    /// [`Mapped::read_at`].
    pub fn write_at(&self, off: usize, src: &[u8]) -> bool {
        if !self.holds(off, src.len()) {
            return false;
        }
        // SAFETY: as in read_at, the other way.
        let at = unsafe { self.ptr.add(off) };
        self.guarded(at, src.len(), || unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), at, src.len())
        })
    }

    /// Write the pages holding `len` bytes at `off` to the file's device and wait.
    pub fn msync(&self, off: usize, len: usize) -> io::Result<()> {
        if self.is_broken() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A mapped file truncated under its mapping: the copy that meets the
    /// missing pages fails, every later one too, and the process lives; a
    /// second mapping of another file goes on working.
    #[test]
    fn a_file_shrunk_under_its_mapping_fails_copies_not_the_process() {
        let dir = std::env::temp_dir().join(format!("dmkit-mapped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let open = |name: &str| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join(name))
                .expect("file");
            f.set_len(64 << 10).expect("size");
            f
        };
        let (a, b) = (open("a"), open("b"));
        let (ma, mb) = (
            Mapped::new(&a, 64 << 10).expect("map"),
            Mapped::new(&b, 64 << 10).expect("map"),
        );
        assert!(ma.write_at(60 << 10, &[7; 4096]));
        assert!(mb.write_at(0, &[9; 4096]));
        a.set_len(8 << 10).expect("truncate");
        // within the file's new length: still fine
        let mut got = [0u8; 4096];
        assert!(ma.read_at(4096, &mut got));
        // past it: the copy fails instead of SIGBUS, both ways, and from then on
        assert!(!ma.read_at(60 << 10, &mut got));
        assert!(ma.is_broken());
        assert!(!ma.write_at(32 << 10, &[1; 4096]));
        assert!(!ma.read_at(0, &mut got));
        assert!(ma.msync(0, 4096).is_err());
        // the other mapping is untouched
        assert!(mb.read_at(0, &mut got));
        assert_eq!(got, [9; 4096]);
        drop((ma, mb));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
