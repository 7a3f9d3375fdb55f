//! The request model and the backends that take I/O.
//!
//! A request travels as a [`Bio`]: an operation on a range of 512-byte sectors of a
//! device. Mapping turns it into [`Leaf`] I/Os on backing files, which the request
//! engine (`mapper::engine`) executes through the per-thread [`queue::IoQueue`]:
//! io_uring, or synchronous calls where io_uring is not available.

use crate::sync::Unpoison;
pub mod backing;
pub mod buf;
pub mod hold;
pub mod mapped;
pub mod queue;
pub mod rbd;
pub mod restart_log;
pub mod sim;

pub use backing::BackingFile;
pub use buf::AlignedBuf;

/// The value open under `key` in `list` while anything still holds it, or a new
/// one from `open`, remembered weakly: one open file, image or cluster connection
/// however many tables name it. `open` runs with the list locked, so two callers
/// never open the same thing twice (an RBD image's exclusive lock would refuse
/// the second).
pub fn shared<K: PartialEq, V, E>(
    list: &std::sync::Mutex<Vec<(K, std::sync::Weak<V>)>>,
    key: K,
    open: impl FnOnce() -> Result<V, E>,
) -> Result<std::sync::Arc<V>, E> {
    let mut list = list.lock().unpoisoned();
    list.retain(|(_, w)| w.strong_count() > 0);
    if let Some(v) = list
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(v);
    }
    let v = std::sync::Arc::new(open()?);
    list.push((key, std::sync::Arc::downgrade(&v)));
    Ok(v)
}

/// This process's threads as `name state wait-channel`, with the kernel stack
/// of io_uring's workers (and of every thread if `stacks`), for a log line
/// about something that waits too long.
pub fn describe_threads(stacks: bool) -> String {
    let mut out = Vec::new();
    for t in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .take(256)
    {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = read("stat");
        // the state follows the name's closing parenthesis
        let state = stat
            .rsplit_once(')')
            .map_or("?", |(_, r)| r.trim_start())
            .get(..1)
            .unwrap_or("?")
            .to_string();
        let comm = read("comm");
        let mut line = format!("{} {state} {}", comm.trim(), read("wchan").trim());
        if stacks || comm.starts_with("iou-") {
            let stack: Vec<String> = read("stack").lines().take(8).map(str::to_string).collect();
            line.push_str(&format!(" [{}]", stack.join(" | ")));
        }
        out.push(line);
    }
    out.join(", ")
}

/// What this process's descriptor `fd` names now (a path, `pipe:[N]`,
/// `anon_inode:[eventfd]`), or why that cannot be read.
pub fn fd_target(fd: i32) -> String {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map_or_else(|e| e.to_string(), |p| p.display().to_string())
}

/// This process's open descriptors and what they name (`N -> target`).
pub fn describe_fds() -> String {
    let mut fds: Vec<i32> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .take(1024)
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    fds.sort_unstable();
    fds.iter()
        .map(|&n| format!("{n} -> {}", fd_target(n)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Bytes per sector: the unit of every table, status line and message.
pub const SECTOR: u64 = 512;
pub const SECTOR_SHIFT: u32 = 9;

/// The operations a device takes, as the kernel's block layer names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read,
    Write,
    /// An empty flush (REQ_PREFLUSH without data).
    Flush,
    Discard,
    WriteZeroes,
}

impl Op {
    /// Write-direction operations (the kernel's op_is_write), which includes flushes.
    pub fn is_write(self) -> bool {
        !matches!(self, Op::Read)
    }
    /// Operations that carry data in the request buffer.
    pub fn has_data(self) -> bool {
        matches!(self, Op::Read | Op::Write)
    }
}

/// Linux errno values used on the I/O path (positive).
pub mod errno {
    pub const EPERM: i32 = libc::EPERM;
    pub const EIO: i32 = libc::EIO;
    pub const ENOSPC: i32 = libc::ENOSPC;
    pub const EINVAL: i32 = libc::EINVAL;
    pub const EOPNOTSUPP: i32 = libc::EOPNOTSUPP;
    pub const ESHUTDOWN: i32 = libc::ESHUTDOWN;
}

/// What mapping produced for one piece of a request: an I/O on a backing file, or a
/// piece completed without one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeafKind {
    Read,
    Write,
    /// fdatasync of the file.
    Flush,
    /// Punch a hole (discard); the range reads as zeroes afterwards on files.
    Discard,
    /// Zero the range; `punch` allows deallocating it.
    WriteZeroes {
        punch: bool,
    },
    /// Zero the range by writing zeroes (for files that cannot fallocate).
    ZeroWrite,
    /// Fill this part of the read buffer with zeroes.
    ZeroFill,
    /// Complete this piece with an error.
    Fail(i32),
    /// Complete this piece successfully without doing anything.
    Drop,
}

/// A target's end-of-I/O hook (the kernel's end_io), run on the engine's thread
/// once a leaf's I/O has finished (`true` on success), before the request
/// completes, with the leaf's part of the request buffer (empty for operations
/// without data). dm-thin inserts a new mapping here once the data block is
/// written; flakey corrupts read data here. A leaf that is dropped without being
/// issued (its request is requeued) runs it with `false`, so a target can undo.
/// Returns 0, or an errno that fails the request although its I/O succeeded
/// (dm-thin: the pool failed before the new block could be mapped), or
/// [`REMAP`].
pub type EndIo = std::sync::Arc<dyn Fn(bool, &mut [u8]) -> i32 + Send + Sync>;

/// What an end-of-I/O hook returns to have its request mapped again from the
/// top once everything under way for it is done, instead of completing (raid1:
/// a read from a leg that failed goes to another leg; a write that lost a leg
/// waits for the superblock that records the loss). Not an errno: negative.
pub const REMAP: i32 = -1;

/// One unit of work on a backing file (or a completion without one).
#[derive(Clone)]
pub struct Leaf {
    pub kind: LeafKind,
    /// The file, or None for ZeroFill/Fail/Drop. A plain handle: the table that owns
    /// the file outlives every request mapped through it (tables are only swapped once
    /// their device has drained), so the fast path clones no reference count.
    pub file: Option<backing::FileHandle>,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// Byte offset of this piece in the request buffer (Read/Write), or in the
    /// target's own buffer `owned`.
    pub buf_off: usize,
    /// The buffer a target allocated for this leaf's data (an index among the
    /// request's owned buffers), instead of the request's (`MapCtx::remap_owned`).
    pub owned: Option<u32>,
    /// Durable before completion (REQ_FUA).
    pub fua: bool,
    /// Bytes of this leaf already done (short transfers are resumed).
    pub done: u64,
    /// (hold index, target index, target tag) of the target that issued it.
    pub origin: (u16, u32, u16),
    /// Run once this leaf's I/O has finished.
    pub end_io: Option<EndIo>,
    /// What `end_io` changes must be made durable by a flush after a FUA
    /// request (dm-thin's mappings); false for hooks that only note a
    /// completion (log-writes').
    pub hook_needs_flush: bool,
    /// A failure of this leaf only reaches its `end_io`, which decides the
    /// request's outcome: it does not fail the request (a raid1 leg's,
    /// `MapCtx::remap_tolerant`).
    pub tolerant: bool,
}

/// Merge runs of plain reads or writes that continue each other in the same file
/// and in the request buffer, once a request is fully mapped: a request that a
/// target split at its block boundaries onto contiguous blocks (a thin device
/// over sequentially provisioned data) goes out as one I/O again.
pub fn coalesce(leaves: &mut Vec<Leaf>) {
    if leaves.len() < 2 {
        return;
    }
    let mut w = 0;
    for r in 1..leaves.len() {
        if leaves[w].continued_by(&leaves[r]) {
            leaves[w].len += leaves[r].len;
        } else {
            w += 1;
            leaves.swap(w, r);
        }
    }
    leaves.truncate(w + 1);
}

impl Leaf {
    /// Nothing but I/O: no completion hook or progress.
    fn plain(&self) -> bool {
        matches!(self.kind, LeafKind::Read | LeafKind::Write)
            && self.end_io.is_none()
            && self.owned.is_none()
            && self.done == 0
    }

    fn continued_by(&self, next: &Leaf) -> bool {
        self.plain()
            && next.plain()
            && self.kind == next.kind
            && self.file.is_some()
            && self.file == next.file
            && self.fua == next.fua
            && self.origin == next.origin
            && self.offset + self.len == next.offset
            && self.buf_off + self.len as usize == next.buf_off
    }

    pub fn new(kind: LeafKind, len: u64, buf_off: usize) -> Leaf {
        Leaf {
            kind,
            file: None,
            offset: 0,
            len,
            buf_off,
            owned: None,
            fua: false,
            done: 0,
            origin: (0, 0, 0),
            end_io: None,
            hook_needs_flush: false,
            tolerant: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_are_described_by_what_they_name() {
        use std::os::fd::AsRawFd;
        let p = std::env::temp_dir().join(format!("dmkit-fd-target-{}", std::process::id()));
        let f = std::fs::File::create(&p).expect("create");
        let fd = f.as_raw_fd();
        assert_eq!(fd_target(fd), p.display().to_string());
        assert!(
            describe_fds().contains(&format!("{fd} -> {}", p.display())),
            "{}",
            describe_fds()
        );
        drop(f);
        let _ = std::fs::remove_file(&p);
        assert!(fd_target(-1).contains("No such file"), "{}", fd_target(-1));
    }

    fn leaf(kind: LeafKind, offset: u64, len: u64, buf_off: usize) -> Leaf {
        Leaf {
            file: Some(backing::FileHandle {
                to: backing::HandleTo::Fd {
                    buffered: 3,
                    direct: -1,
                },
                dio_align: 512,
                in_memory: false,
                sim: None,
            }),
            offset,
            ..Leaf::new(kind, len, buf_off)
        }
    }

    #[test]
    fn coalesce_merges_only_continuing_plain_io() {
        let mut v = vec![
            leaf(LeafKind::Write, 0, 4096, 0),
            leaf(LeafKind::Write, 4096, 4096, 4096),
            leaf(LeafKind::Write, 8192, 4096, 8192),
            // a gap in the file: a new I/O
            leaf(LeafKind::Write, 65536, 4096, 12288),
            // a completion hook: never merged
            Leaf {
                end_io: Some(std::sync::Arc::new(|_, _| 0)),
                ..leaf(LeafKind::Write, 69632, 4096, 16384)
            },
            leaf(LeafKind::Write, 73728, 4096, 20480),
        ];
        coalesce(&mut v);
        let got: Vec<(u64, u64)> = v.iter().map(|l| (l.offset, l.len)).collect();
        assert_eq!(got, [(0, 12288), (65536, 4096), (69632, 4096), (73728, 4096)]);
        let mut v = vec![
            leaf(LeafKind::Read, 0, 4096, 0),
            leaf(LeafKind::Write, 4096, 4096, 4096),
        ];
        coalesce(&mut v);
        assert_eq!(v.len(), 2, "a read and a write stay apart");
        let mut v = vec![
            leaf(LeafKind::Read, 0, 4096, 0),
            Leaf {
                fua: true,
                ..leaf(LeafKind::Read, 4096, 4096, 4096)
            },
            Leaf {
                origin: (1, 0, 0),
                ..leaf(LeafKind::Read, 8192, 4096, 8192)
            },
        ];
        coalesce(&mut v);
        assert_eq!(v.len(), 3, "different FUA or origin stay apart");
    }
}
