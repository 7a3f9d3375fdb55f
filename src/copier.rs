//! kcopyd: the engine targets use to copy and zero regions of backing files (thin-pool
//! sharing breaks, snapshot COW copies, writecache writeback).
//!
//! Targets hand work to the copier's own threads ([`Copier::spawn`], kcopyd's model)
//! and are called back when it is done, so no thread serving requests waits on a
//! copy. A job (`copy`, `zero`) blocks the thread that runs it, and its I/O goes
//! through a thread-local io_uring that belongs to the copier, never a request
//! engine's ring. A job larger than one sub-job is split; up to `in_flight` sub-jobs
//! run at once, each taking the next piece when its writes complete.

use crate::io::backing::FileHandle;
use crate::io::queue::{IoQueue, Sqe};
use crate::io::sim::SimRef;
use crate::io::{AlignedBuf, BackingFile};
use std::cell::RefCell;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Work for the copier's threads: it runs jobs on the copier it is given and calls
/// back whoever submitted it.
pub type Work = Box<dyn FnOnce(&Copier) + Send>;
/// Threads running copier work (each blocks on one job at a time; their I/O is
/// asynchronous within a job).
const SERVICE_THREADS: usize = 4;

/// Sub-job size since Linux 5.3 ("dm kcopyd: Increase default sub-job size to 512KB").
pub const DEFAULT_SUBJOB_BYTES: usize = 512 << 10;
/// The kernel clamps `dm_mod.kcopyd_subjob_size_kb` to 1024.
pub const MAX_SUBJOB_BYTES: usize = 1 << 20;
/// Smallest sub-job; sub-jobs are whole multiples of it (keeps pieces O_DIRECT-aligned).
pub const MIN_SUBJOB_BYTES: usize = 4 << 10;
/// The kernel's SPLIT_COUNT.
pub const DEFAULT_IN_FLIGHT: usize = 8;
const MAX_IN_FLIGHT: usize = 64;
/// Destinations per job, as in the kernel.
pub const MAX_DESTS: usize = 8;
const RING_ENTRIES: u32 = 128;
/// user_data = segment << 24 | slot << 8 | tag; a tag below MAX_DESTS is a write to
/// that destination, TAG_READ a read of the slot's segment.
const TAG_READ: u64 = 0xFF;

/// What failed in a job; carried inside the returned `io::Error` (see [`errno_of`]).
#[derive(Debug, thiserror::Error)]
#[error("kcopyd: {op} {} {path:?} at byte {offset} failed: {}", who(*.dest), io::Error::from_raw_os_error(*.errno))]
pub struct CopyError {
    /// "read", "write" or "zero".
    pub op: &'static str,
    /// None: the source; Some(i): destination `i` of the job.
    pub dest: Option<usize>,
    pub path: PathBuf,
    /// Byte offset in that file where the failed I/O started.
    pub offset: u64,
    pub errno: i32,
}

fn who(dest: Option<usize>) -> String {
    dest.map_or_else(|| "of source".to_string(), |d| format!("of destination {d}"))
}

/// The errno of an error returned by [`Copier`] (EIO where none is known).
pub fn errno_of(e: &io::Error) -> i32 {
    e.raw_os_error()
        .or_else(|| e.get_ref()?.downcast_ref::<CopyError>().map(|c| c.errno))
        .unwrap_or(libc::EIO)
}

fn fail(op: &'static str, dest: Option<usize>, file: &BackingFile, offset: u64, errno: i32) -> io::Error {
    let kind = io::Error::from_raw_os_error(errno).kind();
    let path = file.path.clone();
    io::Error::new(
        kind,
        CopyError {
            op,
            dest,
            path,
            offset,
            errno,
        },
    )
}

/// kcopyd: copies and zeroes regions of backing files in sub-jobs, a bounded number in flight.
pub struct Copier {
    subjob: usize,
    in_flight: usize,
    /// Execute with plain system calls instead of io_uring (tests of the fallback).
    sync: bool,
    /// Try fallocate(ZERO_RANGE) before writing zeroes.
    falloc: bool,
    jobs: AtomicU64,
    subjobs: AtomicU64,
    copied: AtomicU64,
    zeroed: AtomicU64,
    service: crate::sync::Workers,
}

impl Copier {
    /// `subjob_bytes`: size of one sub-job (0 → 512 KiB; clamped to 4 KiB..=1 MiB and rounded
    /// down to a multiple of 4 KiB). `in_flight`: sub-jobs in flight per job (0 → 8; at most 64).
    pub fn new(subjob_bytes: usize, in_flight: usize) -> Copier {
        let b = if subjob_bytes == 0 {
            DEFAULT_SUBJOB_BYTES
        } else {
            subjob_bytes.clamp(MIN_SUBJOB_BYTES, MAX_SUBJOB_BYTES)
        };
        let in_flight = if in_flight == 0 {
            DEFAULT_IN_FLIGHT
        } else {
            in_flight
        };
        Copier {
            subjob: b & !(MIN_SUBJOB_BYTES - 1),
            in_flight: in_flight.min(MAX_IN_FLIGHT),
            sync: false,
            falloc: true,
            jobs: AtomicU64::new(0),
            subjobs: AtomicU64::new(0),
            copied: AtomicU64::new(0),
            zeroed: AtomicU64::new(0),
            service: crate::sync::Workers::new("kcopyd", SERVICE_THREADS),
        }
    }

    /// Run `work` on one of the copier's threads; the caller goes on at once.
    /// Work that cannot be started (no thread could be created) runs here.
    pub fn spawn(self: &Arc<Self>, work: Work) {
        // The jobs hold the copier weakly: its threads belong to it and end
        // with it (holding it would keep it, and them, alive for ever).
        let me = Arc::downgrade(self);
        self.service.run(Box::new(move || {
            if let Some(c) = me.upgrade() {
                work(&c)
            }
        }));
    }

    pub fn subjob_bytes(&self) -> usize {
        self.subjob
    }

    /// Copy `len` bytes from `src` at byte `src_off` to every destination `(file, byte offset)`
    /// (1..=8 of them), returning when all of it is written (not necessarily durable).
    /// Reads past the source's end yield zeroes. Overlapping source and destination ranges of
    /// one file are not supported.
    pub fn copy(
        &self,
        src: &BackingFile,
        src_off: u64,
        dests: &[(&BackingFile, u64)],
        len: u64,
    ) -> io::Result<()> {
        check(dests, len, Some(src_off))?;
        self.jobs.fetch_add(1, Ordering::Relaxed);
        if len == 0 {
            return Ok(());
        }
        let whole = [Region { src: 0, dst: 0, len }];
        let job = Job::new(
            Some((src, src_off)),
            dests,
            (1 << dests.len()) - 1,
            &whole,
            self.subjob,
        );
        self.execute(&job, &self.copied)
    }

    /// Copy many regions of `src` to `dst` as one job (dm-writecache's writeback):
    /// `(source byte offset, destination byte offset, length)` each. Regions that
    /// follow each other on the destination are gathered: their pieces are read
    /// from wherever they are and written as one I/O (up to a sub-job), so a run of
    /// consecutive origin blocks is one write whatever cache blocks hold it. Pieces
    /// are no larger than the longest such run; as many run at once as fill
    /// `in_flight` whole sub-jobs (at most 64), in the order given. With `fua`
    /// every write carries FUA (pmem writecache's writeback without `nofua`).
    pub fn copy_regions(
        &self,
        src: &BackingFile,
        dst: &BackingFile,
        regions: &[(u64, u64, u64)],
        fua: bool,
    ) -> io::Result<()> {
        let regions: Vec<Region> = regions
            .iter()
            .filter(|r| r.2 > 0)
            .map(|&(src, dst, len)| Region { src, dst, len })
            .collect();
        for r in &regions {
            check(&[(dst, r.dst)], r.len, Some(r.src))?;
        }
        self.jobs.fetch_add(1, Ordering::Relaxed);
        if regions.is_empty() {
            return Ok(());
        }
        let mut largest = 0u64;
        let mut run = 0u64;
        for (k, r) in regions.iter().enumerate() {
            let joins = k > 0 && regions[k - 1].dst + regions[k - 1].len == r.dst;
            run = if joins { run + r.len } else { r.len };
            largest = largest.max(run);
        }
        let piece = self
            .subjob
            .min((largest as usize).next_multiple_of(MIN_SUBJOB_BYTES));
        let dests = [(dst, 0)];
        let mut job = Job::new(Some((src, 0)), &dests, 1, &regions, piece);
        job.gather = true;
        job.fua = fua;
        let in_flight = (self.in_flight * self.subjob / piece.max(1)).min(MAX_IN_FLIGHT);
        self.execute_with(&job, &self.copied, in_flight)
    }

    /// Zero `len` bytes at each destination: fallocate(ZERO_RANGE|KEEP_SIZE) where the file
    /// supports it, else writes from a zero buffer in sub-jobs.
    pub fn zero(&self, dests: &[(&BackingFile, u64)], len: u64) -> io::Result<()> {
        check(dests, len, None)?;
        self.jobs.fetch_add(1, Ordering::Relaxed);
        if len == 0 {
            return Ok(());
        }
        let mut mask = (1u32 << dests.len()) - 1;
        if self.falloc {
            self.subjobs.fetch_add(1, Ordering::Relaxed);
            mask = with_local(|l| fallocate_all(l, dests, len, self.sync))?;
            if mask == 0 {
                self.zeroed.fetch_add(len, Ordering::Relaxed);
                return Ok(());
            }
        }
        let whole = [Region { src: 0, dst: 0, len }];
        let job = Job::new(None, dests, mask, &whole, self.subjob);
        self.execute(&job, &self.zeroed)
    }

    /// Totals since creation: (jobs, sub-jobs issued, bytes copied, bytes zeroed). Bytes count
    /// each job's region once, however many destinations it has.
    pub fn stats(&self) -> (u64, u64, u64, u64) {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        (g(&self.jobs), g(&self.subjobs), g(&self.copied), g(&self.zeroed))
    }

    fn execute(&self, job: &Job, bytes: &AtomicU64) -> io::Result<()> {
        self.execute_with(job, bytes, self.in_flight)
    }

    fn execute_with(&self, job: &Job, bytes: &AtomicU64, in_flight: usize) -> io::Result<()> {
        let mut eng = Engine {
            job,
            // Buffered or in-memory files: io_uring would hand most of these to
            // its worker threads (a buffered write cannot be done without
            // blocking), which costs more than the copy of a cached piece; plain
            // calls on this thread are quicker (merge 0.81x of dd instead of 0.68x
            // on tmpfs).
            sync: self.sync || job.no_direct_io(),
            region: 0,
            next: 0,
            err: None,
            subjobs: 0,
            bytes: 0,
        };
        let r = with_local(|l| eng.run(l, in_flight));
        self.subjobs.fetch_add(eng.subjobs, Ordering::Relaxed);
        bytes.fetch_add(eng.bytes, Ordering::Relaxed);
        r
    }
}

fn check(dests: &[(&BackingFile, u64)], len: u64, src_off: Option<u64>) -> io::Result<()> {
    let bad = |m: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("kcopyd: {m}"),
        ))
    };
    if dests.is_empty() || dests.len() > MAX_DESTS {
        return bad("a job needs 1 to 8 destinations");
    }
    let offs = dests.iter().map(|d| d.1).chain(src_off);
    if offs
        .into_iter()
        .any(|o| o.checked_add(len).is_none_or(|e| e > i64::MAX as u64))
    {
        return bad("region past the largest file offset");
    }
    Ok(())
}

/// A region of a job: offsets added to the source's and each destination's offset.
#[derive(Clone, Copy)]
struct Region {
    src: u64,
    dst: u64,
    len: u64,
}

/// One job: an optional source, the destinations, which of them to write (bit i =
/// destination i), the regions to copy and the piece (sub-job) size.
struct Job<'a> {
    src: Option<(&'a BackingFile, FileHandle, u64)>,
    dests: &'a [(&'a BackingFile, u64)],
    handles: [Option<FileHandle>; MAX_DESTS],
    mask: u32,
    regions: &'a [Region],
    piece: u64,
    /// Regions adjacent on the destination share pieces (see `copy_regions`).
    gather: bool,
    /// Writes carry FUA (durable when done).
    fua: bool,
}

impl<'a> Job<'a> {
    fn new(
        src: Option<(&'a BackingFile, u64)>,
        dests: &'a [(&'a BackingFile, u64)],
        mask: u32,
        regions: &'a [Region],
        piece: usize,
    ) -> Job<'a> {
        let mut handles = [None; MAX_DESTS];
        for (h, d) in handles.iter_mut().zip(dests) {
            *h = Some(d.0.handle());
        }
        Job {
            src: src.map(|(f, o)| (f, f.handle(), o)),
            dests,
            handles,
            mask,
            regions,
            piece: piece as u64,
            gather: false,
            fua: false,
        }
    }
}

impl Job<'_> {
    /// No file of the job does direct I/O: each is buffered (no O_DIRECT
    /// descriptor) or on a memory filesystem.
    fn no_direct_io(&self) -> bool {
        let buffered = |h: &FileHandle| h.buffered_only();
        self.src.is_none_or(|(_, h, _)| buffered(&h)) && self.handles.iter().flatten().all(buffered)
    }
}

/// A sub-job in progress: one piece of the job being read, then written to every destination.
#[derive(Clone, Copy)]
struct Slot {
    /// The piece's data: this slot's thread-local buffer, or the zero buffer.
    base: *mut u8,
    /// Offset of the piece from the destinations' offsets, its length, bytes read
    /// so far (its source segments are in `Local::segs`).
    dst: u64,
    len: u64,
    rdone: u64,
    /// Bytes written so far to each destination.
    wdone: [u64; MAX_DESTS],
    /// Operations of this slot not yet completed.
    pending: u32,
}

impl Slot {
    const EMPTY: Slot = Slot {
        base: std::ptr::null_mut(),
        dst: 0,
        len: 0,
        rdone: 0,
        wdone: [0; MAX_DESTS],
        pending: 0,
    };
}

/// A source segment of a piece: where it goes in the piece's buffer, where it
/// comes from (offset from the source's offset), its length, bytes read so far.
#[derive(Clone, Copy)]
struct Seg {
    buf: u64,
    src: u64,
    len: u64,
    done: u64,
}

/// Per-thread state, allocated on a thread's first job and reused, so a job allocates
/// nothing in steady state.
struct Local {
    /// The copier's own ring (created lazily; falls back to synchronous calls by itself
    /// when io_uring is unavailable or `serve --no-io-uring` turned it off).
    queue: Option<IoQueue>,
    /// The synchronous queue, for copiers made to avoid io_uring (tests of that path).
    sync_queue: Option<IoQueue>,
    cq: Vec<(u64, i32)>,
    bufs: Vec<AlignedBuf>,
    /// All zeroes, never written: the data of zeroing writes.
    zero: AlignedBuf,
    slots: Vec<Slot>,
    /// Per slot, the source segments of its piece.
    segs: Vec<Vec<Seg>>,
    /// The ring failed with operations in flight: leak this state rather than reuse or free
    /// memory the kernel may still access.
    broken: bool,
}

thread_local! {
    static LOCAL: RefCell<Option<Box<Local>>> = const { RefCell::new(None) };
}

/// Run `f` with this thread's state (a temporary one if the thread-local is unavailable).
fn with_local<R>(f: impl FnOnce(&mut Local) -> io::Result<R>) -> io::Result<R> {
    let mut f = Some(f);
    let r = LOCAL.try_with(|cell| {
        let mut guard = cell.try_borrow_mut().ok()?;
        let local = guard.get_or_insert_with(|| Box::new(Local::new()));
        let r = (f.take()?)(local);
        if local.broken {
            std::mem::forget(guard.take());
        }
        Some(r)
    });
    if let Ok(Some(r)) = r {
        return r;
    }
    let f = f
        .take()
        .ok_or_else(|| io::Error::other("kcopyd: thread state unavailable"))?;
    let mut local = Local::new();
    let r = f(&mut local);
    if local.broken {
        std::mem::forget(local);
    }
    r
}

impl Local {
    fn new() -> Local {
        Local {
            queue: None,
            sync_queue: None,
            cq: Vec::new(),
            bufs: Vec::new(),
            zero: AlignedBuf::default(),
            slots: Vec::new(),
            segs: Vec::new(),
            broken: false,
        }
    }

    /// Queue `op` on this thread's ring, or (sync) execute it now; its completion is
    /// reported by [`Local::reap`] with `ud`.
    ///
    /// # Safety
    /// As [`IoQueue::push`]: the memory `op` names stays valid and untouched until reaped.
    unsafe fn push(&mut self, sync: bool, op: Sqe, ud: u64, sim: Option<SimRef>) {
        // RBD operations complete asynchronously whatever the queue: they go where
        // `reap` waits.
        let q = if sync && !matches!(op, Sqe::Rbd { .. }) {
            self.sync_queue.get_or_insert_with(IoQueue::synchronous)
        } else {
            self.queue.get_or_insert_with(|| IoQueue::new(RING_ENTRIES))
        };
        // SAFETY (both): our caller upholds push's contract.
        match sim {
            Some(sim) => unsafe { q.push_sim(op, ud, sim) },
            None => unsafe { q.push(op, ud) },
        }
    }

    /// Wait for at least one completion (none when nothing is queued) and collect every
    /// ready one into `self.cq`.
    fn reap(&mut self) -> io::Result<()> {
        self.cq.clear();
        if let Some(q) = self.sync_queue.as_mut() {
            let cq = &mut self.cq;
            q.drain(|u, r| cq.push((u, r)));
        }
        if let Some(q) = self.queue.as_mut() {
            if self.cq.is_empty() {
                q.wait(None)?;
            }
            let cq = &mut self.cq;
            q.drain(|u, r| cq.push((u, r)));
        }
        Ok(())
    }

    /// Wait for `ops` outstanding operations, passing each completion to `f`; `f` returns
    /// how many new operations it queued. On a failing ring, marks this state broken.
    fn complete_all(
        &mut self,
        mut ops: usize,
        mut f: impl FnMut(&mut Local, u64, i32) -> usize,
    ) -> io::Result<()> {
        let mut failures = 0;
        while ops > 0 {
            if let Err(e) = self.reap() {
                failures += 1;
                if failures > 8 {
                    self.broken = true;
                    return Err(e);
                }
                continue;
            }
            let cq = std::mem::take(&mut self.cq);
            for &(u, r) in &cq {
                ops = ops.saturating_sub(1) + f(self, u, r);
            }
            self.cq = cq;
        }
        Ok(())
    }
}

/// fallocate(ZERO_RANGE|KEEP_SIZE) on every destination at once. Returns the mask of
/// destinations that do not support it (to be zeroed by writes).
fn fallocate_all(l: &mut Local, dests: &[(&BackingFile, u64)], len: u64, sync: bool) -> io::Result<u32> {
    for (i, (f, off)) in dests.iter().enumerate() {
        let h = f.handle();
        let op = h.zero(false, *off, len);
        // SAFETY: fallocate names no memory.
        unsafe { l.push(sync, op, i as u64, h.sim) };
    }
    let (mut fallback, mut err) = (0u32, None);
    l.complete_all(dests.len(), |_, u, r| {
        let d = u as usize;
        match (-r, dests.get(d)) {
            (0, _) | (_, None) => {}
            (libc::EOPNOTSUPP | libc::EINVAL | libc::ENOSYS | libc::ENODEV, _) => fallback |= 1 << d,
            (e, Some(&(f, off))) => {
                err.get_or_insert_with(|| fail("zero", Some(d), f, off, e));
            }
        }
        0
    })?;
    err.map_or(Ok(fallback), Err)
}

/// The state of one job while it runs.
struct Engine<'j> {
    job: &'j Job<'j>,
    sync: bool,
    /// The region and the offset in it of the next piece to hand out.
    region: usize,
    next: u64,
    err: Option<io::Error>,
    subjobs: u64,
    /// Bytes of pieces completely written.
    bytes: u64,
}

impl Engine<'_> {
    fn run(&mut self, l: &mut Local, in_flight: usize) -> io::Result<()> {
        let piece = self.job.piece as usize;
        let pieces: u64 = self
            .job
            .regions
            .iter()
            .map(|r| r.len.div_ceil(self.job.piece))
            .sum();
        let n = pieces.min(in_flight as u64) as usize;
        if self.job.src.is_some() {
            if l.bufs.len() < n {
                l.bufs.resize_with(n, AlignedBuf::default);
            }
            l.bufs.iter_mut().take(n).for_each(|b| b.ensure(piece));
        } else {
            l.zero.ensure(piece);
        }
        l.slots.clear();
        l.slots.resize(n, Slot::EMPTY);
        if l.segs.len() < n {
            l.segs.resize_with(n, Vec::new);
        }
        let mut started = 0;
        for s in 0..n {
            started += self.start_piece(l, s);
        }
        let r = l.complete_all(started, |l, u, r| self.complete(l, u, r));
        r.and(self.err.take().map_or(Ok(()), Err))
    }

    /// Give slot `s` the next piece if there is one and no error occurred; returns the
    /// number of operations queued.
    fn start_piece(&mut self, l: &mut Local, s: usize) -> usize {
        while self
            .job
            .regions
            .get(self.region)
            .is_some_and(|r| self.next >= r.len)
        {
            self.region += 1;
            self.next = 0;
        }
        let Some(r) = self.job.regions.get(self.region) else {
            return 0;
        };
        if self.err.is_some() {
            return 0;
        }
        let off = self.next;
        let mut len = self.job.piece.min(r.len - off);
        self.next += len;
        self.subjobs += 1;
        let segs = &mut l.segs[s];
        segs.clear();
        segs.push(Seg {
            buf: 0,
            src: r.src + off,
            len,
            done: 0,
        });
        // gather the following regions while they continue this piece's destination
        while self.job.gather && len < self.job.piece && self.next >= r.len {
            let Some(nr) = self.job.regions.get(self.region + 1) else {
                break;
            };
            let cur = self.job.regions[self.region];
            if nr.dst != cur.dst + cur.len || nr.len == 0 {
                break;
            }
            self.region += 1;
            let take = nr.len.min(self.job.piece - len);
            segs.push(Seg {
                buf: len,
                src: nr.src,
                len: take,
                done: 0,
            });
            self.next = take;
            len += take;
            if take < nr.len {
                break;
            }
        }
        let nsegs = segs.len();
        let base = match self.job.src {
            // No operation of this slot is in flight, so no one else uses its buffer.
            Some(_) => l.bufs[s].as_mut_ptr(),
            // Only ever read from (a write's data).
            None => l.zero.as_ptr().cast_mut(),
        };
        l.slots[s] = Slot {
            base,
            dst: r.dst + off,
            len,
            ..Slot::EMPTY
        };
        if self.job.src.is_some() {
            (0..nsegs).map(|k| self.issue_read(l, s, k)).sum()
        } else {
            self.issue_writes(l, s)
        }
    }

    fn issue_read(&mut self, l: &mut Local, s: usize, k: usize) -> usize {
        let Some((_, h, src_off)) = self.job.src else {
            return 0;
        };
        let Some(&seg) = l.segs[s].get(k) else {
            return 0;
        };
        let slot = &mut l.slots[s];
        let addr = slot.base.wrapping_add((seg.buf + seg.done) as usize);
        let offset = src_off + seg.src + seg.done;
        let len = seg.len - seg.done;
        slot.pending += 1;
        let op = h.read(addr, len, offset);
        // SAFETY: `addr..addr+len` lies in buffer `s` of this thread, which nothing else
        // touches until this read is reaped: `run` reaps every operation before it returns,
        // and a failing ring leaks the buffers (`Local::broken`).
        unsafe {
            l.push(
                self.sync,
                op,
                (k as u64) << 24 | (s as u64) << 8 | TAG_READ,
                h.sim,
            )
        };
        1
    }

    fn issue_writes(&mut self, l: &mut Local, s: usize) -> usize {
        (0..self.job.dests.len())
            .filter(|d| self.job.mask & 1 << d != 0)
            .map(|d| self.issue_write(l, s, d))
            .sum()
    }

    fn issue_write(&mut self, l: &mut Local, s: usize, d: usize) -> usize {
        let Some(h) = self.job.handles[d] else { return 0 };
        let slot = &mut l.slots[s];
        let done = slot.wdone[d];
        let addr = slot.base.wrapping_add(done as usize);
        let offset = self.job.dests[d].1 + slot.dst + done;
        let len = slot.len - done;
        slot.pending += 1;
        if self.job.fua {
            self.job.dests[d].0.fua_writes.fetch_add(1, Ordering::Relaxed);
        }
        let op = h.write(addr, len, offset, self.job.fua);
        // SAFETY: `addr..addr+len` lies in buffer `s` (not written again until every write
        // of the piece is reaped) or the never-written zero buffer; see `issue_read`.
        unsafe { l.push(self.sync, op, (s as u64) << 8 | d as u64, h.sim) };
        1
    }

    /// Handle the completion `res` of operation `ud`; returns the number of operations queued.
    fn complete(&mut self, l: &mut Local, ud: u64, res: i32) -> usize {
        let (s, tag) = (((ud >> 8) & 0xFFFF) as usize, ud & 0xFF);
        if s >= l.slots.len() {
            return 0;
        }
        l.slots[s].pending = l.slots[s].pending.saturating_sub(1);
        let slot = l.slots[s];
        if tag == TAG_READ {
            let Some((f, _, src_off)) = self.job.src else {
                return 0;
            };
            let k = (ud >> 24) as usize;
            let Some(seg) = l.segs[s].get_mut(k) else {
                return 0;
            };
            if res < 0 {
                let e = fail("read", None, f, src_off + seg.src + seg.done, -res);
                self.err.get_or_insert(e);
                return 0;
            }
            let got = if res == 0 {
                // End of the source: the rest of the segment reads as zeroes.
                let (a, b) = ((seg.buf + seg.done) as usize, (seg.buf + seg.len) as usize);
                l.bufs[s].as_mut_slice()[a..b].fill(0);
                seg.len - seg.done
            } else {
                (res as u64).min(seg.len - seg.done)
            };
            seg.done += got;
            let more = seg.done < seg.len;
            l.slots[s].rdone += got;
            return if self.err.is_some() {
                0
            } else if more {
                self.issue_read(l, s, k)
            } else if l.slots[s].rdone < slot.len {
                0 // other segments are still being read
            } else {
                self.issue_writes(l, s)
            };
        }
        let d = tag as usize;
        if d >= self.job.dests.len() {
            return 0;
        }
        if res <= 0 {
            let (f, off) = self.job.dests[d];
            let errno = if res < 0 { -res } else { libc::EIO };
            self.err
                .get_or_insert_with(|| fail("write", Some(d), f, off + slot.dst + slot.wdone[d], errno));
        } else {
            l.slots[s].wdone[d] += res as u64;
            if l.slots[s].wdone[d] < slot.len && self.err.is_none() {
                return self.issue_write(l, s, d);
            }
        }
        if l.slots[s].pending > 0 || self.err.is_some() {
            return 0;
        }
        self.bytes += slot.len;
        self.start_piece(l, s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const K: u64 = 1024;

    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            Scratch::at(&std::env::temp_dir(), name)
        }
        fn at(base: &Path, name: &str) -> Scratch {
            let dir = base.join(format!("dmkit-copier-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
        /// A file holding `data`, opened read-write with O_DIRECT where possible.
        fn file(&self, name: &str, data: &[u8]) -> BackingFile {
            self.file_ro(name, data, false)
        }
        fn file_ro(&self, name: &str, data: &[u8], read_only: bool) -> BackingFile {
            let p = self.0.join(name);
            std::fs::write(&p, data).unwrap();
            BackingFile::open(&p, read_only, true).unwrap()
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn pattern(len: u64, seed: u64) -> Vec<u8> {
        crate::rng::pattern(seed, len as usize)
    }

    fn read(f: &BackingFile) -> Vec<u8> {
        std::fs::read(Path::new(&f.path)).unwrap()
    }

    /// The io_uring engine and the forced synchronous one.
    fn engines(subjob: usize, in_flight: usize) -> [Copier; 2] {
        let sync = Copier {
            sync: true,
            ..Copier::new(subjob, in_flight)
        };
        [Copier::new(subjob, in_flight), sync]
    }

    #[test]
    fn copy_spans_subjobs_to_two_dests() {
        let sc = Scratch::new("span");
        let src_data = pattern(1 << 20, 1);
        let src = sc.file("src", &src_data);
        for (i, c) in engines(64 << 10, 4).iter().enumerate() {
            let a = sc.file(&format!("a{i}"), &vec![0xEE; 2 << 20]);
            let b = sc.file(&format!("b{i}"), &[]);
            let len = 10 * 64 * K + 3000;
            c.copy(&src, 8192, &[(&a, 0), (&b, (1 << 20) + 4096)], len)
                .unwrap();
            let (s, l) = (8192usize, len as usize);
            let ra = read(&a);
            assert_eq!(&ra[..l], &src_data[s..s + l]);
            assert!(
                ra[l..].iter().all(|&x| x == 0xEE),
                "bytes past the copy untouched"
            );
            let rb = read(&b);
            assert_eq!(rb.len(), (1 << 20) + 4096 + l);
            assert_eq!(&rb[(1 << 20) + 4096..], &src_data[s..s + l]);
            assert_eq!(c.stats(), (1, 11, len, 0));
        }
    }

    /// Regions that follow each other on the destination are gathered into one
    /// piece (one write) from scattered sources; a run longer than a sub-job is
    /// split; a gap on the destination starts a new piece; bytes between the
    /// regions stay as they were.
    #[test]
    fn copy_regions_gathers_destination_runs() {
        let sc = Scratch::new("gather");
        let src_data = pattern(1 << 20, 9);
        let src = sc.file("src", &src_data);
        let b = 4 * K;
        // (source block, destination block): a 20-block destination run from
        // scattered sources, a gap, then 3 blocks, one of them 2 blocks long
        let mut regions: Vec<(u64, u64, u64)> = (0..20u64).map(|i| ((i * 37 % 200) * b, i * b, b)).collect();
        regions.extend([(150 * b, 30 * b, b), (10 * b, 31 * b, 2 * b), (99 * b, 33 * b, b)]);
        for (i, c) in engines(64 << 10, 8).iter().enumerate() {
            let d = sc.file(&format!("d{i}"), &vec![0xAB; 256 << 10]);
            c.copy_regions(&src, &d, &regions, false).unwrap();
            let got = read(&d);
            let mut want = vec![0xABu8; 256 << 10];
            for &(so, dofs, len) in &regions {
                want[dofs as usize..(dofs + len) as usize]
                    .copy_from_slice(&src_data[so as usize..(so + len) as usize]);
            }
            assert!(got == want, "engine {i}: gathered copy differs");
            // 20 blocks = 80 KiB: pieces of 64 KiB and 16 KiB, then one of 16 KiB
            let (jobs, subjobs, bytes, _) = c.stats();
            assert_eq!((jobs, subjobs, bytes), (1, 3, 24 * b), "engine {i}");
        }
    }

    #[test]
    fn unaligned_offsets() {
        let sc = Scratch::new("unaligned");
        let src_data = pattern(600 * K, 2);
        let src = sc.file("src", &src_data);
        for (i, c) in engines(4096, 3).iter().enumerate() {
            assert_eq!(c.subjob_bytes(), 4096);
            for (j, (so, d0, d1, len)) in [(512, 1536, 512, 300 * K), (1001, 7, 65537, 77777)]
                .into_iter()
                .enumerate()
            {
                let a = sc.file(&format!("a{i}{j}"), &vec![0x55; 400 << 10]);
                let b = sc.file(&format!("b{i}{j}"), &[]);
                c.copy(&src, so, &[(&a, d0), (&b, d1)], len).unwrap();
                let want = &src_data[so as usize..(so + len) as usize];
                let ra = read(&a);
                assert!(ra[..d0 as usize].iter().all(|&x| x == 0x55));
                assert_eq!(&ra[d0 as usize..(d0 + len) as usize], want);
                assert!(ra[(d0 + len) as usize..].iter().all(|&x| x == 0x55));
                assert_eq!(&read(&b)[d1 as usize..], want);
            }
        }
    }

    #[test]
    fn zero_over_existing_data() {
        let sc = Scratch::new("zero");
        let data = pattern(1 << 20, 3);
        // fallocate, the write fallback through io_uring, and the write fallback run synchronously.
        let [ring, sync] = engines(64 << 10, 8);
        let by_write = Copier {
            falloc: false,
            ..Copier::new(64 << 10, 8)
        };
        let sync_write = Copier {
            falloc: false,
            ..sync
        };
        for (i, c) in [ring, by_write, sync_write].iter().enumerate() {
            let a = sc.file(&format!("a{i}"), &data);
            let b = sc.file(&format!("b{i}"), &data);
            let (off, len) = (4096 + 512, 300 * K + 100);
            c.zero(&[(&a, off), (&b, 0)], len).unwrap();
            let (o, l) = (off as usize, len as usize);
            let ra = read(&a);
            assert_eq!(&ra[..o], &data[..o]);
            assert!(ra[o..o + l].iter().all(|&x| x == 0));
            assert_eq!(&ra[o + l..], &data[o + l..]);
            let rb = read(&b);
            assert!(rb[..l].iter().all(|&x| x == 0));
            assert_eq!(&rb[l..], &data[l..]);
            assert_eq!(c.stats().3, len);
        }
    }

    #[test]
    fn zero_falls_back_where_fallocate_is_unsupported() {
        // tmpfs has no FALLOC_FL_ZERO_RANGE (EOPNOTSUPP); ext4 in the default temp dir has.
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let tmpfs = Scratch::at(shm, "fallback");
        let disk = Scratch::new("fallback");
        let data = pattern(256 << 10, 11);
        for (i, c) in engines(64 << 10, 8).iter().enumerate() {
            let a = tmpfs.file(&format!("a{i}"), &data);
            let b = disk.file(&format!("b{i}"), &data);
            c.zero(&[(&a, 1000), (&b, 4096)], 200_000).unwrap();
            assert!(read(&a)[1000..201_000].iter().all(|&x| x == 0));
            assert_eq!(&read(&a)[201_000..], &data[201_000..]);
            assert!(read(&b)[4096..204_096].iter().all(|&x| x == 0));
            assert_eq!(c.stats(), (1, 5, 0, 200_000));
        }
    }

    #[test]
    fn short_source_zero_fills() {
        let sc = Scratch::new("short");
        let src_data = pattern(100_000, 4);
        let src = sc.file("src", &src_data);
        for (i, c) in engines(64 << 10, 2).iter().enumerate() {
            let a = sc.file(&format!("a{i}"), &vec![0xAA; 512 << 10]);
            c.copy(&src, 4096, &[(&a, 0)], 300 * K).unwrap();
            let ra = read(&a);
            let n = 100_000 - 4096;
            assert_eq!(&ra[..n], &src_data[4096..]);
            assert!(ra[n..300 * K as usize].iter().all(|&x| x == 0));
            assert!(ra[300 * K as usize..].iter().all(|&x| x == 0xAA));
        }
    }

    #[test]
    fn subjob_counts_and_clamps() {
        let sc = Scratch::new("count");
        let src = sc.file("src", &pattern(4 << 20, 5));
        for (sub, want) in [(64 << 10, 64), (512 << 10, 8)] {
            let a = sc.file(&format!("a{sub}"), &[]);
            let c = Copier::new(sub, 8);
            c.copy(&src, 0, &[(&a, 0)], 4 << 20).unwrap();
            assert_eq!(c.stats(), (1, want, 4 << 20, 0));
        }
        assert_eq!(Copier::new(0, 8).subjob_bytes(), 512 << 10);
        assert_eq!(Copier::new(4 << 20, 8).subjob_bytes(), 1 << 20);
        assert_eq!(Copier::new(100, 8).subjob_bytes(), 4096);
        assert_eq!(Copier::new(10_000, 8).subjob_bytes(), 8192);
    }

    #[test]
    fn sync_fallback_same_results() {
        let sc = Scratch::new("same");
        let src = sc.file("src", &pattern(3 << 20, 6));
        let outs: Vec<Vec<u8>> = engines(128 << 10, 8)
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let a = sc.file(&format!("a{i}"), &pattern(4 << 20, 7));
                c.copy(&src, 12288, &[(&a, 512)], (3 << 20) + 4096).unwrap();
                c.zero(&[(&a, 100_000)], 200_000).unwrap();
                assert_eq!(c.stats(), (2, 26, (3 << 20) + 4096, 200_000));
                read(&a)
            })
            .collect();
        assert!(outs[0] == outs[1]);
    }

    #[test]
    fn errors_are_reported() {
        let sc = Scratch::new("err");
        let src = sc.file("src", &pattern(1 << 20, 8));
        for (i, c) in engines(64 << 10, 8).iter().enumerate() {
            let ro = sc.file_ro(&format!("ro{i}"), &[0; 4096], true);
            let rw = sc.file(&format!("rw{i}"), &[]);
            let e = c.copy(&src, 0, &[(&rw, 0), (&ro, 0)], 1 << 20).unwrap_err();
            assert_eq!(errno_of(&e), libc::EBADF, "{e}");
            assert!(e.to_string().contains("write of destination 1"), "{e}");
            assert!(c.stats().2 < 1 << 20);
            let e = c.zero(&[(&ro, 0)], 8192).unwrap_err();
            assert_eq!(errno_of(&e), libc::EBADF, "{e}");
            let by_write = Copier {
                falloc: false,
                sync: c.sync,
                ..Copier::new(4096, 2)
            };
            assert!(by_write.zero(&[(&ro, 0)], 8192).is_err());
            let many: Vec<_> = (0..9).map(|_| (&rw, 0u64)).collect();
            let e = c.copy(&src, 0, &many, 10).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
            assert_eq!(
                c.copy(&src, u64::MAX, &[(&rw, 0)], 10).unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
            // The thread's state is still usable after failures.
            c.copy(&src, 0, &[(&rw, 0)], 200 << 10).unwrap();
        }
    }

    #[test]
    fn shared_between_threads() {
        fn is_send_sync<T: Send + Sync>() {}
        is_send_sync::<Copier>();
        let sc = Scratch::new("threads");
        let data = pattern(2 << 20, 9);
        let src = sc.file("src", &data);
        let c = std::sync::Arc::new(Copier::new(64 << 10, 8));
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let (c, src, sc, data) = (c.clone(), &src, &sc, &data);
                s.spawn(move || {
                    let a = sc.file(&format!("a{t}"), &[]);
                    for k in 0..4 {
                        c.copy(src, k * 4096, &[(&a, 0)], (1 << 20) + t * 512).unwrap();
                        let n = (1 << 20) + t as usize * 512;
                        assert_eq!(&read(&a)[..n], &data[k as usize * 4096..][..n]);
                    }
                });
            }
        });
        assert_eq!(c.stats().0, 16);
    }

    #[test]
    fn uses_own_ring() {
        let sc = Scratch::new("ring");
        let src = sc.file("src", &pattern(64 << 10, 10));
        Copier::new(0, 0)
            .copy(&src, 0, &[(&src, 1 << 20)], 64 << 10)
            .unwrap();
        let uring = LOCAL.with(|c| {
            c.borrow()
                .as_ref()
                .and_then(|l| l.queue.as_ref().map(|q| q.is_uring()))
        });
        assert_eq!(
            uring,
            Some(true),
            "the copier runs on its own io_uring (a test of it runs without --no-io-uring)"
        );
    }
}
