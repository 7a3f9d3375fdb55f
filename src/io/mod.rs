//! The request model and the backends that take I/O.
//!
//! A request travels as a [`Bio`]: an operation on a range of 512-byte sectors of a
//! device. Mapping turns it into [`Leaf`] I/Os on backing files; the per-thread
//! [`queue::IoQueue`] executes leaves through io_uring (or synchronously where io_uring
//! is not available).

pub mod backing;
pub mod buf;
pub mod queue;

pub use backing::BackingFile;
pub use buf::AlignedBuf;

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
    /// Not mappable now (a block is being provisioned, a commit is awaited...): map
    /// this piece again later. The piece is `len` sectors at sector `offset` of the
    /// device held at `origin.0`, with operation `op`; `done` carries the target's
    /// wait token.
    Deferred {
        op: Op,
        punch: bool,
    },
}

/// Run when a leaf's I/O has finished (`true` on success), before the request
/// completes: how a target finishes work that must follow the data, as the
/// kernel's end_io does (e.g. dm-thin inserts a new mapping only once the data
/// block is written).
pub type AfterIo = std::sync::Arc<dyn Fn(bool) + Send + Sync>;

/// An action applied to a piece after (reads) or before (writes) its I/O: flakey's
/// corruption features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Corrupt {
    #[default]
    None,
    /// Set byte `index` (0-based, within this piece) to `value`.
    Byte { index: u64, value: u8 },
}

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
    /// Byte offset of this piece in the request buffer (Read/Write).
    pub buf_off: usize,
    /// Durable before completion (REQ_FUA).
    pub fua: bool,
    /// Held this long before it is issued (the delay target).
    pub delay_ms: u32,
    /// The delay class counting this leaf while it is held.
    pub held: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// Set while the delay target that holds this leaf is suspending: issue it now.
    pub release: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    pub corrupt: Corrupt,
    /// Bytes of this leaf already done (short transfers are resumed).
    pub done: u64,
    /// (hold index, target index, target tag) of the target that issued it.
    pub origin: (u16, u32, u16),
    /// Run once this leaf's I/O has finished.
    pub after: Option<AfterIo>,
}

impl Leaf {
    pub fn new(kind: LeafKind, len: u64, buf_off: usize) -> Leaf {
        Leaf {
            kind,
            file: None,
            offset: 0,
            len,
            buf_off,
            fua: false,
            delay_ms: 0,
            held: None,
            release: None,
            corrupt: Corrupt::None,
            done: 0,
            origin: (0, 0, 0),
            after: None,
        }
    }
}
