//! The cache itself: the entries, the map decisions, commits and writeback.
//!
//! One mutex guards the bookkeeping and is never held across I/O. Request
//! threads decide under it where each block goes and issue the I/O themselves;
//! the writer thread commits (autocommit by count and time, FLUSH, FUA in pmem
//! mode, discards) and the writeback thread copies committed blocks to the
//! origin. A commit snapshots the dirty metadata under the lock, then writes it,
//! waits for the cache I/O issued before the snapshot (an epoch counter, as
//! SRCU; if one of them failed, nothing is committed), flushes the cache
//! device and writes the superblock with FUA.
//!
//! Freed entries (written back, discarded, or older duplicates) are not reused
//! until their free state is on disk and no read issued before can still be
//! reading them: a crash never finds a committed entry whose block holds
//! another sector's data.

use crate::mapper::TargetError;
use super::format::{self, Superblock, FREE};
use super::Options;
use crate::copier::Copier;
use crate::io::mapped::Mapped;
use crate::io::restart_log::{Previous, Record, RestartLog};
use crate::io::{errno, BackingFile, EndIo, LeafKind, Op, SECTOR};
use crate::mapper::devio;
use crate::mapper::engine::{Dest, Pending};
use crate::mapper::{Bio, DevRef, MapCtx, MapErr};
use crate::sync::Unpoison;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const NIL: u32 = u32::MAX;
/// Dirty-metadata granularity of ssd commits (the kernel's BITMAP_GRANULARITY).
const REGION: usize = 64 << 10;
/// Longest run written back as one I/O (BIO_MAX_VECS blocks).
const MAX_RUN: usize = 256;
/// Blocks selected for writeback per pass (then the origin is flushed and the
/// entries freed): bounds how long freed space waits.
const PASS_BLOCKS: usize = 8192;

#[derive(Clone, Copy)]
struct Entry {
    /// Original sector (relative to the target), FREE when free.
    sector: u64,
    seq: u64,
    /// Order among entries of one sector in the tree: the newest is the largest.
    key: u64,
    prev: u32,
    next: u32,
    writeback: bool,
    /// Cache writes in flight to the block.
    writes: u32,
    /// When the block was allocated (ms since the cache opened), for max_age.
    born: u64,
    /// In the restart log or committed: a daemon started after a kill finds it.
    logged: bool,
}

const FREE_ENTRY: Entry = Entry {
    sector: FREE,
    seq: FREE,
    key: 0,
    prev: NIL,
    next: NIL,
    writeback: false,
    writes: 0,
    born: 0,
    logged: false,
};

/// Restart-log records (`io::restart_log`): entry `a` holds sector `b` with seq
/// `c` (its data has landed); entry `a` of seq `c` was freed.
const ALLOCATED: u32 = 1;
const FREED: u32 = 2;

/// Free entries: ssd allocates by index from a wrapping cursor (so new blocks go
/// to the cache device sequentially); pmem first in, first out.
enum FreeList {
    Ssd { set: BTreeSet<u32>, cursor: u32 },
    Pmem(VecDeque<u32>),
}

impl FreeList {
    fn pop(&mut self) -> Option<u32> {
        match self {
            FreeList::Ssd { set, cursor } => {
                let i = set
                    .range(*cursor..)
                    .next()
                    .or_else(|| set.iter().next())
                    .copied()?;
                set.remove(&i);
                *cursor = i + 1;
                Some(i)
            }
            FreeList::Pmem(q) => q.pop_front(),
        }
    }
    fn push(&mut self, i: u32) {
        match self {
            FreeList::Ssd { set, .. } => {
                set.insert(i);
            }
            FreeList::Pmem(q) => q.push_back(i),
        }
    }
    /// Take the blocks of `these` off the list.
    fn take_all(&mut self, these: &std::collections::HashSet<u32>) {
        if these.is_empty() {
            return;
        }
        match self {
            FreeList::Ssd { set, .. } => set.retain(|i| !these.contains(i)),
            FreeList::Pmem(q) => q.retain(|i| !these.contains(i)),
        }
    }
    fn len(&self) -> usize {
        match self {
            FreeList::Ssd { set, .. } => set.len(),
            FreeList::Pmem(q) => q.len(),
        }
    }
}

/// The counters of `dmsetup status` fields 5–14.
#[derive(Clone, Copy, Default)]
pub struct Stats {
    pub reads: u64,
    pub read_hits: u64,
    pub writes: u64,
    pub write_hits_uncommitted: u64,
    pub write_hits_committed: u64,
    pub writes_around: u64,
    pub writes_allocate: u64,
    pub writes_blocked_on_freelist: u64,
    pub flushes: u64,
    pub discards: u64,
}

/// The devices a table maps onto.
#[derive(Clone, Copy)]
pub struct Devs<'a> {
    pub origin: &'a DevRef,
    pub cache: &'a DevRef,
}

/// One piece of a request's plan: `n` sectors from `s`, at cache block `at` (and
/// on) or on the origin; `epoch` of the cache I/O it counts in.
struct Step {
    s: u64,
    n: u64,
    at: Option<u32>,
    epoch: usize,
}

/// Work for the writer thread.
enum Job {
    /// Commit, then send the flush on to the origin (or complete it).
    Flush(Pending),
    /// Commit, then complete (a pmem FUA write, already copied).
    Commit(Pending),
    /// Free the cached blocks of the range, then pass it to the origin.
    Discard(Pending),
}

struct State {
    loaded: bool,
    entries: Vec<Entry>,
    tree: BTreeMap<(u64, u64), u32>,
    /// The newest entry of each cached sector (the last of its run in `tree`):
    /// the lookup of every read and write, a hash probe instead of a tree range.
    newest: HashMap<u64, u32>,
    next_key: u64,
    /// LRU: newest at head.
    head: u32,
    tail: u32,
    free: FreeList,
    /// Removed from the tree; free once a metadata write says so.
    freeing: Vec<u32>,
    /// The superblock's seq_count once the commit under way (if any) lands; new
    /// entries carry it and are uncommitted.
    seq: u64,
    /// Entries allocated since the last commit snapshot.
    uncommitted: Vec<u32>,
    overwrote_committed: bool,
    /// The metadata image (superblock and entries) and its dirty regions.
    image: Vec<u8>,
    dirty: Vec<bool>,
    dirty_list: Vec<u32>,
    /// pmem: data blocks written since the last commit snapshot.
    dirty_data: Vec<u32>,
    wb_size: u64,
    wb_all: u32,
    wb_cursor: u64,
    /// Watermark writeback was triggered and runs until below the low mark.
    wb_triggered: bool,
    commit_deadline: Option<Instant>,
    commit_now: bool,
    jobs: Vec<Job>,
    free_waiters: Vec<Pending>,
    read_waiters: Vec<Pending>,
    /// Counts the moments waiters were let go (a block freed or the log made
    /// room; a write landed): a piece that decided to wait under the lock and
    /// parks after it was let go goes on at once, instead of waiting for the
    /// next such moment, which may never come.
    wakes: u64,
    error: bool,
    suspended: bool,
    stop: bool,
    cleaner: bool,
    flush_on_suspend: bool,
    high_free: u64,
    low_free: u64,
    stats: Stats,
    /// The entries whose data landed since the commit before last, by their seq's
    /// parity: a commit under way keeps its entries' log while the next
    /// entries start the other (`io::restart_log`).
    restart: [Option<RestartLog>; 2],
    /// Records each log keeps room for: two per allocation of its seq (the
    /// entry, and its freeing within the seq), one given back when the entry is
    /// recorded, the rest when the log begins its next generation.
    log_reserved: [usize; 2],
    /// A write found no room in the log of its seq: it waits for the commit
    /// that begins a new one (never acknowledged unrecorded).
    log_full: bool,
}

pub struct Cache {
    pub o: Options,
    pub n_blocks: u64,
    meta_bytes: u64,
    origin: Dest,
    cache: Dest,
    origin_file: Option<Arc<BackingFile>>,
    cache_file: Option<Arc<BackingFile>>,
    /// pmem mode: where the data lives, the cache file mapped shared. A block is
    /// written only by the request that owns it in that moment, and read by
    /// writeback only while it is under writeback (decided under the state lock).
    map: Option<Mapped>,
    /// Write back in the pre-2019 order (LRU tail) instead of the sorted walk
    /// (`Config::writecache_lru_writeback`), for benchmarks of the two.
    lru_writeback: bool,
    st: Mutex<State>,
    /// Wakes the writer thread.
    work: crate::sync::Cond,
    /// Wakes the writeback thread.
    wb: crate::sync::Cond,
    /// Wakes whoever waits for writeback progress (flush message, suspend).
    progress: crate::sync::Cond,
    commit_lock: Mutex<()>,
    epoch: AtomicU64,
    inflight: [AtomicU64; 2],
    drain_waiting: AtomicBool,
    drain_lock: Mutex<()>,
    drained: crate::sync::Cond,
    opened: Instant,
    last_io: AtomicU64,
    copier: Copier,
    threads: Mutex<Vec<crate::sync::Thread<()>>>,
    weak: std::sync::Weak<Cache>,
    /// The two restart logs' paths, when kept (a cache on a file, a run directory).
    restart: Option<[std::path::PathBuf; 2]>,
    /// Tests only: the records a restart log holds (`serve --test-restart-log-records`).
    log_records: Option<usize>,
}

/// The cache's state, locked; a lock a panicking thread left behind ends the
/// daemon, as the state may be half changed (crate::panics).
fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock()
        .unwrap_or_else(|_| crate::panics::poisoned("a writecache's state"))
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(errno::EIO)
}


/// The whole cache file mapped (pmem mode).
fn map_pmem(cache_file: Option<&Arc<BackingFile>>) -> Result<Mapped, TargetError> {
    let f = cache_file.ok_or("Unable to map persistent memory for cache: the cache must be a file or block device")?;
    let len = f
        .size()
        .map_err(|e| format!("Unable to map persistent memory for cache: {e}"))?;
    let len = usize::try_from(len).map_err(|_| "Unable to map persistent memory for cache")?;
    let file = f
        .file()
        .ok_or("Unable to map persistent memory for cache: not a file or block device")?;
    Mapped::new(file, len).map_err(|e| TargetError::from(format!("Unable to map persistent memory for cache: {e}")))
}

impl State {
    /// A cache's state before its metadata is loaded (at its first resume):
    /// suspended, nothing cached.
    fn new(o: &Options, n_blocks: u64, meta_bytes: u64) -> State {
        let free = if o.pmem {
            FreeList::Pmem(VecDeque::new())
        } else {
            FreeList::Ssd {
                set: BTreeSet::new(),
                cursor: 0,
            }
        };
        let regions = (meta_bytes as usize).div_ceil(REGION);
        let (high_free, low_free) = o.free_marks(n_blocks);
        State {
            loaded: false,
            entries: Vec::new(),
            tree: BTreeMap::new(),
            newest: HashMap::new(),
            next_key: 0,
            head: NIL,
            tail: NIL,
            free,
            freeing: Vec::new(),
            seq: 0,
            uncommitted: Vec::new(),
            overwrote_committed: false,
            image: Vec::new(),
            dirty: vec![false; regions],
            dirty_list: Vec::new(),
            dirty_data: Vec::new(),
            wb_size: 0,
            wb_all: 0,
            wb_cursor: 0,
            wb_triggered: false,
            commit_deadline: None,
            commit_now: false,
            jobs: Vec::new(),
            free_waiters: Vec::new(),
            read_waiters: Vec::new(),
            wakes: 0,
            error: false,
            suspended: true,
            stop: false,
            cleaner: o.cleaner,
            flush_on_suspend: o.cleaner,
            high_free,
            low_free,
            stats: Stats::default(),
            restart: [None, None],
            log_reserved: [0, 0],
            log_full: false,
        }
    }
}

impl Cache {
    /// Open the cache described by `o` (its superblock already checked or written
    /// by the constructor).
    pub fn new(
        o: Options,
        n_blocks: u64,
        origin: Dest,
        cache: Dest,
        origin_file: Option<Arc<BackingFile>>,
        cache_file: Option<Arc<BackingFile>>,
        config: &crate::mapper::config::Config,
    ) -> Result<Arc<Cache>, TargetError> {
        let restart = match (config.restart_logs.as_deref(), &cache_file) {
            (Some(dir), Some(f)) => {
                Some([0, 1].map(|k| RestartLog::path(dir, &format!("writecache{k}"), f.identity)))
            }
            _ => None,
        };
        let bs = u64::from(o.block_size);
        let meta_bytes = format::metadata_bytes(n_blocks, bs).ok_or("Overflow in size calculation")?;
        let map = match o.pmem {
            true => Some(map_pmem(cache_file.as_ref())?),
            false => None,
        };
        let st = State::new(&o, n_blocks, meta_bytes);
        Ok(Arc::new_cyclic(|weak| Cache {
            weak: weak.clone(),
            lru_writeback: config.writecache_lru_writeback,
            n_blocks,
            meta_bytes,
            origin,
            cache,
            origin_file,
            cache_file,
            map,
            st: Mutex::new(st),
            work: crate::sync::Cond::new(),
            wb: crate::sync::Cond::new(),
            progress: crate::sync::Cond::new(),
            commit_lock: Mutex::new(()),
            epoch: AtomicU64::new(0),
            inflight: [AtomicU64::new(0), AtomicU64::new(0)],
            drain_waiting: AtomicBool::new(false),
            drain_lock: Mutex::new(()),
            drained: crate::sync::Cond::new(),
            opened: crate::sync::now(),
            last_io: AtomicU64::new(0),
            copier: Copier::new(0, 16),
            threads: Mutex::new(Vec::new()),
            restart,
            log_records: config.restart_log_records,
            o,
        }))
    }

    fn bs_sectors(&self) -> u64 {
        u64::from(self.o.block_size) / SECTOR
    }

    fn meta_sectors(&self) -> u64 {
        self.meta_bytes / SECTOR
    }

    /// Sector of block `i`'s data on the cache device.
    fn data_sector(&self, i: u32) -> u64 {
        self.o.start_sector + self.meta_sectors() + u64::from(i) * self.bs_sectors()
    }

    fn now_ms(&self) -> u64 {
        crate::sync::since(self.opened).as_millis() as u64
    }

    // ---- metadata I/O ----

    fn read_meta(&self, buf: &mut [u8]) -> io::Result<()> {
        match &self.map {
            Some(_) => {
                let off = (self.o.start_sector * SECTOR) as usize;
                self.mapped_read(off, buf).then_some(()).ok_or_else(eio)
            }
            None => devio::read(&self.cache, self.o.start_sector, buf),
        }
    }

    /// Write `bytes` at byte `off` of the metadata; `sync`: durable on return.
    fn write_meta(&self, off: usize, bytes: &[u8], sync: bool) -> io::Result<()> {
        match &self.map {
            Some(_) => {
                let at = (self.o.start_sector * SECTOR) as usize + off;
                if !self.mapped_write(at, bytes) {
                    return Err(eio());
                }
                if sync {
                    self.msync(at, bytes.len())?;
                }
                Ok(())
            }
            None => devio::write(
                &self.cache,
                self.o.start_sector + (off as u64) / SECTOR,
                bytes,
                sync,
            ),
        }
    }

    fn flush_cache(&self) -> io::Result<()> {
        match &self.map {
            Some(_) => Ok(()),
            None => devio::flush(&self.cache),
        }
    }

    /// Copy `dst.len()` bytes at byte `off` out of the mapping (false: none,
    /// or out of it).
    fn mapped_read(&self, off: usize, dst: &mut [u8]) -> bool {
        self.map.as_ref().is_some_and(|m| m.read_at(off, dst))
    }

    /// Copy `src` into the mapping at byte `off`: the block (or metadata range)
    /// is written only by its owner of the moment, decided under the state lock.
    fn mapped_write(&self, off: usize, src: &[u8]) -> bool {
        self.map.as_ref().is_some_and(|m| m.write_at(off, src))
    }

    fn msync(&self, off: usize, len: usize) -> io::Result<()> {
        match self.map.as_ref() {
            Some(m) => m.msync(off, len),
            None => Ok(()),
        }
    }

    fn block_in_map(&self, i: u32) -> usize {
        (self.data_sector(i) * SECTOR) as usize
    }

    // ---- loading ----

    /// Read the metadata and rebuild the entries (the kernel's resume): drop
    /// uncommitted entries, keep the newest committed one of each sector, and
    /// write back what changed.
    pub fn load(&self) -> Result<(), TargetError> {
        let _c = crate::sync::lock(&self.commit_lock);
        let mut image = vec![0u8; self.meta_bytes as usize];
        self.read_meta(&mut image)
            .map_err(|e| format!("Unable to read metadata: {e}"))?;
        let sb = Superblock::parse(&image)?;
        if sb.magic != format::MAGIC || sb.n_blocks != self.n_blocks {
            return Err("Invalid magic in the superblock".into());
        }
        // an origin whose size cannot be read bounds nothing but the byte address
        let origin_sectors = match devio::size_sectors(&self.origin) {
            0 => u64::MAX / SECTOR,
            n => n,
        };
        let loaded = format::load(
            &image,
            self.n_blocks,
            sb.seq_count,
            self.bs_sectors(),
            origin_sectors,
        )?;
        for &i in &loaded.cleared {
            let (sector, _) = format::entry(&image, i);
            format::set_entry(&mut image, i, sector, FREE);
        }
        if !loaded.cleared.is_empty() {
            self.write_meta(0, &image, false)
                .and_then(|()| self.flush_cache())
                .map_err(|e| format!("Unable to write metadata: {e}"))?;
        }
        let mut st = lock(&self.st);
        st.entries = vec![FREE_ENTRY; self.n_blocks as usize];
        st.tree.clear();
        st.newest.clear();
        st.head = NIL;
        st.tail = NIL;
        st.freeing.clear();
        st.uncommitted.clear();
        st.dirty_list.clear();
        st.dirty.iter_mut().for_each(|d| *d = false);
        st.dirty_data.clear();
        st.wb_size = 0;
        st.seq = sb.seq_count;
        let mut used = vec![false; self.n_blocks as usize];
        let now = self.now_ms();
        for &(i, sector, seq) in &loaded.used {
            used[i as usize] = true;
            let key = st.next_key;
            st.next_key += 1;
            st.entries[i as usize] = Entry {
                sector,
                seq,
                key,
                born: now,
                logged: true,
                ..FREE_ENTRY
            };
            st.tree.insert((sector, key), i as u32);
            st.newest.insert(sector, i as u32);
            lru_push_head(&mut st, i as u32);
        }
        st.free = match st.free {
            FreeList::Pmem(_) => FreeList::Pmem(VecDeque::new()),
            FreeList::Ssd { .. } => FreeList::Ssd {
                set: BTreeSet::new(),
                cursor: 0,
            },
        };
        for (i, u) in used.iter().enumerate() {
            if !u {
                st.free.push(i as u32);
            }
        }
        st.image = image;
        let replayed = self.replay_restart_log(&mut st, origin_sectors)?;
        st.loaded = true;
        drop(st);
        drop(_c);
        if replayed > 0 {
            self.persist(true)
                .map_err(|e| format!("committing the writes the previous daemon acknowledged: {e}"))?;
            tracing::info!(
                "writecache: committed {replayed} blocks the previous daemon had acknowledged before it was killed"
            );
        }
        Ok(())
    }

    /// Open the restart logs after a load, and take back the entries a killed
    /// daemon acknowledged on top of the metadata as committed now: their data
    /// is in the cache, their entries were not yet committed. Returns how many;
    /// a record that does not fit is an error naming the log.
    fn replay_restart_log(&self, st: &mut State, origin_sectors: u64) -> Result<usize, TargetError> {
        let refuse = refuse_replay;
        let Some(paths) = &self.restart else {
            return Ok(0);
        };
        let seq = st.seq;
        let (mut slots, order) = self.logged_entries(paths, seq, origin_sectors)?;
        // room for every block allocated and freed again in one generation
        let cap = self
            .log_records
            // an allocation reserves two records: a smaller log would never
            // have room, and its writes would wait for ever
            .map(|n| n.max(2))
            .unwrap_or_else(|| (self.n_blocks as usize).saturating_mul(4).max(4096));
        let sim = self.cache_file.as_ref().and_then(|f| f.sim().cloned());
        let mut logs = [0, 1].map(|k| RestartLog::create_on(&paths[k], cap, sim.clone()));
        let mut take = Vec::with_capacity(slots.len());
        for slot in order {
            if let Some(sector) = slots.remove(&slot) {
                if st.entries[slot as usize].sector != FREE {
                    return Err(refuse(
                        &paths[(seq % 2) as usize],
                        format!("cache block {slot} is in use in the committed metadata"),
                    ).into());
                }
                take.push((slot, sector));
            }
        }
        st.free.take_all(&take.iter().map(|&(i, _)| i).collect());
        for &(slot, sector) in &take {
            self.allocate(st, slot, sector);
        }
        let replayed = take.len();
        for (k, l) in logs.iter_mut().enumerate() {
            match l {
                Ok(l) => {
                    if k as u64 == seq % 2 {
                        l.begin(seq);
                    }
                }
                Err(e) => tracing::warn!(
                    "writecache: no restart log ({}: {e}): writes acknowledged and not yet committed are lost if the daemon is killed",
                    paths[k].display()
                ),
            }
        }
        st.restart = logs.map(Result::ok);
        // what was taken back is logged again, in case this daemon dies too (a
        // log that breaks meanwhile asks for the commit that makes it moot)
        for i in st.uncommitted.clone() {
            let _ = log_allocated(st, i);
        }
        Ok(replayed)
    }

    /// The entries of each cache block as the restart logs `paths` leave them
    /// (block -> origin sector, and the blocks in the order allocated): those
    /// of seq `seq`, then those of `seq + 1` if a commit was under way (entries
    /// allocated after its snapshot, acknowledged before it landed).
    fn logged_entries(
        &self,
        paths: &[std::path::PathBuf; 2],
        seq: u64,
        origin_sectors: u64,
    ) -> Result<(HashMap<u32, u64>, Vec<u32>), TargetError> {
        let refuse = refuse_replay;
        let mut slots: HashMap<u32, u64> = HashMap::new();
        let mut by_sector: HashMap<u64, u32> = HashMap::new();
        let mut order: Vec<u32> = Vec::new();
        for want in [seq, seq + 1] {
            let path = &paths[(want % 2) as usize];
            let records = match RestartLog::previous(path) {
                Previous::Records { identity, records } if identity == want => records,
                Previous::Overflowed { identity } if identity == want => {
                    tracing::warn!(
                        "writecache: the previous daemon acknowledged more writes than its restart log {} holds and was killed before committing them: they are lost",
                        path.display()
                    );
                    continue;
                }
                _ => continue,
            };
            for (n, r) in records.iter().enumerate() {
                let slot = u32::try_from(r.a)
                    .ok()
                    .filter(|&i| u64::from(i) < self.n_blocks)
                    .ok_or_else(|| refuse(path, format!("record {n}: no cache block {}", r.a)))?;
                if r.c != want {
                    return Err(refuse(
                        path,
                        format!("record {n}: seq {} in the log of seq {want}", r.c),
                    ).into());
                }
                if let Some(old) = slots.remove(&slot) {
                    if by_sector.get(&old) == Some(&slot) {
                        by_sector.remove(&old);
                    }
                }
                match r.kind {
                    ALLOCATED => {
                        if r.b % self.bs_sectors() != 0 || r.b >= origin_sectors {
                            return Err(refuse(
                                path,
                                format!("record {n}: sector {} is not a block of the origin", r.b),
                            ).into());
                        }
                        if let Some(j) = by_sector.insert(r.b, slot) {
                            slots.remove(&j);
                        }
                        slots.insert(slot, r.b);
                        order.push(slot);
                    }
                    FREED => {}
                    k => return Err(refuse(path, format!("record {n}: unknown kind {k}")).into()),
                }
            }
        }
        Ok((slots, order))
    }

    // ---- lifecycle ----

    pub fn start(self: &Arc<Self>) {
        {
            let mut st = lock(&self.st);
            st.suspended = false;
            st.stop = false;
            st.wb_triggered = true;
        }
        let mut th = self.threads.lock().unpoisoned();
        for (name, f) in [
            ("wc-writer", Cache::writer as fn(&Cache)),
            ("wc-writeback", Cache::writeback as fn(&Cache)),
        ] {
            let me = self.clone();
            match crate::sync::spawn(name, move || f(&me))
            {
                Ok(h) => th.push(h),
                Err(e) => {
                    tracing::error!("writecache: cannot start {name}: {e}");
                    lock(&self.st).error = true;
                }
            }
        }
    }

    /// Presuspend: pieces waiting for a free block go back to the engine, which
    /// holds them until resume.
    pub fn presuspend(&self) {
        let mut st = lock(&self.st);
        st.suspended = true;
        let mut w = std::mem::take(&mut st.free_waiters);
        w.append(&mut st.read_waiters);
        drop(st);
        w.into_iter().for_each(Pending::requeue);
    }

    /// Postsuspend: commit, write everything back if asked, wait for writeback,
    /// stop the threads.
    pub fn postsuspend(&self) {
        if !lock(&self.st).loaded {
            return;
        }
        if let Err(e) = self.persist(true) {
            tracing::error!("writecache: commit at suspend failed: {e}");
        }
        let all = std::mem::take(&mut lock(&self.st).flush_on_suspend);
        if all {
            let _ = self.write_back_all();
            let mut st = lock(&self.st);
            st.flush_on_suspend = st.cleaner;
        }
        let mut st = lock(&self.st);
        while st.wb_size > 0 && !st.error {
            st = self.progress.wait(&self.st, st);
        }
        drop(st);
        self.stop_threads();
    }

    pub fn stop_threads(&self) {
        {
            let mut st = lock(&self.st);
            st.stop = true;
        }
        self.work.notify_all();
        self.wb.notify_all();
        self.progress.notify_all();
        let th: Vec<_> = self.threads.lock().unpoisoned().drain(..).collect();
        for h in th {
            let _ = h.join();
        }
    }

    /// The target goes: if everything is committed, its restart logs have
    /// nothing to give and are removed (unless a new table's cache replaced them).
    pub fn remove_restart_logs(&self) {
        let st = lock(&self.st);
        if st.loaded && st.uncommitted.is_empty() && !st.error {
            st.restart.iter().flatten().for_each(RestartLog::remove);
        }
    }

    pub fn is_running(&self) -> bool {
        !self.threads.lock().unpoisoned().is_empty()
    }

    // ---- status and messages ----

    pub fn status(&self) -> String {
        let st = lock(&self.st);
        let s = st.stats;
        format!(
            "{} {} {} {} {} {} {} {} {} {} {} {} {} {}",
            u8::from(st.error),
            self.n_blocks,
            st.free.len(),
            st.wb_size,
            s.reads,
            s.read_hits,
            s.writes,
            s.write_hits_uncommitted,
            s.write_hits_committed,
            s.writes_around,
            s.writes_allocate,
            s.writes_blocked_on_freelist,
            s.flushes,
            s.discards
        )
    }

    pub fn clear_stats(&self) {
        lock(&self.st).stats = Stats::default();
    }

    pub fn set_cleaner(&self) {
        let mut st = lock(&self.st);
        st.cleaner = true;
        st.flush_on_suspend = true;
        st.high_free = self.n_blocks;
        st.low_free = self.n_blocks;
        st.wb_triggered = true;
        drop(st);
        self.wb.notify_all();
    }

    pub fn set_flush_on_suspend(&self) {
        lock(&self.st).flush_on_suspend = true;
    }

    /// The messages that set the state this cache has beyond its table's
    /// arguments (`cleaner` implies `flush_on_suspend`).
    pub fn replay_messages(&self) -> Vec<String> {
        let st = lock(&self.st);
        if st.cleaner && !self.o.cleaner {
            vec!["cleaner".into()]
        } else if st.flush_on_suspend && !st.cleaner {
            vec!["flush_on_suspend".into()]
        } else {
            Vec::new()
        }
    }

    /// The `flush` message: commit, write back every block, return when the cache
    /// is empty.
    pub fn flush_message(&self) -> Result<(), TargetError> {
        {
            let st = lock(&self.st);
            if st.suspended || !st.loaded {
                return Err(TargetError::busy("Device or resource busy: the device is suspended"));
            }
            if st.error {
                return Err("Input/output error: the cache is in the error state".into());
            }
        }
        self.persist(true)
            .map_err(|e| format!("Input/output error: commit failed: {e}"))?;
        self.write_back_all()
    }

    fn write_back_all(&self) -> Result<(), TargetError> {
        let mut st = lock(&self.st);
        st.wb_all += 1;
        self.wb.notify_all();
        while !(st.error || st.stop || (st.tree.is_empty() && st.wb_size == 0)) {
            st = self
                .progress
                .wait_timeout(&self.st, st, Duration::from_millis(200))
                .0;
        }
        st.wb_all -= 1;
        if st.error {
            return Err("Input/output error: the cache is in the error state".into());
        }
        Ok(())
    }

    // ---- the request path ----

    pub fn map(&self, bio: Bio, ctx: &mut MapCtx, devs: Devs) -> Result<(), MapErr> {
        match bio.op {
            Op::Flush => {
                lock(&self.st).stats.flushes += 1;
                let p = ctx.submit(bio);
                self.queue(Job::Flush(p));
                return Ok(());
            }
            Op::Read | Op::Write | Op::Discard | Op::WriteZeroes => {}
        }
        let bs = self.bs_sectors();
        if !bio.sector.is_multiple_of(bs) || !bio.nr_sectors.is_multiple_of(bs) {
            tracing::debug!(
                "writecache: I/O is not aligned, sector {}, size {} bytes, block size {}",
                bio.sector,
                bio.bytes(),
                self.o.block_size
            );
            return Err(MapErr::Errno(errno::EIO));
        }
        if matches!(bio.op, Op::Discard | Op::WriteZeroes) {
            if bio.op == Op::Discard {
                lock(&self.st).stats.discards += bio.nr_sectors / bs;
            }
            let p = ctx.submit(bio);
            self.queue(Job::Discard(p));
            return Ok(());
        }
        self.last_io.store(self.now_ms(), Ordering::Relaxed);
        if bio.op == Op::Read {
            self.map_read(bio, ctx, devs)
        } else {
            self.map_write(bio, ctx, devs)
        }
    }

    fn queue(&self, j: Job) {
        lock(&self.st).jobs.push(j);
        self.work.notify_one();
    }

    /// Count a cache I/O in the current epoch; the returned hook ends it.
    fn enter(&self) -> usize {
        let e = (self.epoch.load(Ordering::SeqCst) & 1) as usize;
        self.inflight[e].fetch_add(1, Ordering::SeqCst);
        e
    }

    fn leave(&self, e: usize) {
        if self.inflight[e].fetch_sub(1, Ordering::SeqCst) == 1 && self.drain_waiting.load(Ordering::SeqCst) {
            let _g = self.drain_lock.lock().unpoisoned();
            self.drained.notify_all();
        }
    }

    /// Start a new epoch and wait for every cache I/O of the previous one.
    fn drain_epoch(&self) {
        let old = (self.epoch.fetch_add(1, Ordering::SeqCst) & 1) as usize;
        if self.inflight[old].load(Ordering::SeqCst) == 0 {
            return;
        }
        self.drain_waiting.store(true, Ordering::SeqCst);
        let mut g = self.drain_lock.lock().unpoisoned();
        while self.inflight[old].load(Ordering::SeqCst) != 0 {
            g = self
                .drained
                .wait_timeout(&self.drain_lock, g, Duration::from_millis(10))
                .0;
        }
        self.drain_waiting.store(false, Ordering::SeqCst);
    }

    fn map_read(&self, bio: Bio, ctx: &mut MapCtx, devs: Devs) -> Result<(), MapErr> {
        let bs = self.bs_sectors();
        let end = bio.sector + bio.nr_sectors;
        let mut plan: Vec<Step> = Vec::new();
        let mut wait_from = None;
        let mut st = lock(&self.st);
        st.stats.reads += bio.nr_sectors / bs;
        let mut s = bio.sector;
        while s < end {
            match newest(&st, s) {
                Some(i) if st.entries[i as usize].writes > 0 => {
                    // A write to this block is in flight: read once it has landed.
                    wait_from = Some((s, st.wakes));
                    break;
                }
                Some(i) => {
                    st.stats.read_hits += 1;
                    if self.map.is_some() {
                        // copied under the lock: the block cannot be freed and reused meanwhile
                        let piece = bio.sub(s - bio.sector, bs, s);
                        let at = self.block_in_map(i);
                        let dst = ctx.data_of(&piece);
                        if dst.len() != bs as usize * SECTOR as usize || !self.mapped_read(at, dst) {
                            // the cache file shrank under us (`io::mapped`): as
                            // the kernel's pmem read error, the error state
                            self.fail(&mut st);
                            return Err(MapErr::Errno(errno::EIO));
                        }
                    }
                    self.plan_push(&mut plan, s, Some(i));
                    s += bs;
                }
                None => {
                    let next = st
                        .tree
                        .range((s + 1, 0)..)
                        .next()
                        .map_or(end, |(&(sec, _), _)| sec.min(end));
                    plan.push(Step {
                        s,
                        n: next - s,
                        at: None,
                        epoch: 0,
                    });
                    s = next;
                }
            }
        }
        drop(st);
        self.issue(&plan, bio, ctx, devs, wait_from)
    }

    /// Add block `s` (at cache block `at`, or the origin) to the plan, extending
    /// the last step where both sides are contiguous. A new cache step counts as
    /// one cache I/O of the current epoch: call with the state locked.
    fn plan_push(&self, plan: &mut Vec<Step>, s: u64, at: Option<u32>) {
        let bs = self.bs_sectors();
        if let Some(l) = plan.last_mut() {
            if l.s + l.n == s {
                match (l.at, at) {
                    (None, None) => {
                        l.n += bs;
                        return;
                    }
                    (Some(a), Some(b)) if u64::from(a) + l.n / bs == u64::from(b) => {
                        l.n += bs;
                        return;
                    }
                    _ => {}
                }
            }
        }
        let epoch = match at {
            Some(_) if self.map.is_none() => self.enter(),
            _ => 0,
        };
        plan.push(Step { s, n: bs, at, epoch });
    }

    /// Hold a piece until a block is free (write) or a write has landed (read);
    /// while suspending, the engine holds it instead. `wakes`: the count when it
    /// decided to wait; if waiters were let go since, it goes on now.
    fn park(&self, p: Pending, write: bool, wakes: u64) {
        let mut st = lock(&self.st);
        if st.suspended || st.wakes != wakes {
            drop(st);
            return p.requeue();
        }
        if st.error && write {
            drop(st);
            return p.fail(errno::EIO);
        }
        if write {
            st.free_waiters.push(p);
        } else {
            st.read_waiters.push(p);
        }
    }

    /// Send the planned steps: origin steps remapped, cache steps remapped to the
    /// cache device (ssd) or copied from/to the mapping (pmem); the rest of the
    /// bio from sector `wait_from` (if any, with the wake count then) is parked.
    fn issue(
        &self,
        plan: &[Step],
        bio: Bio,
        ctx: &mut MapCtx,
        devs: Devs,
        wait_from: Option<(u64, u64)>,
    ) -> Result<(), MapErr> {
        let bs = self.bs_sectors();
        for st in plan {
            let piece = bio.sub(st.s - bio.sector, st.n, st.s);
            let Some(i) = st.at else {
                ctx.remap(devs.origin, piece, 0)?;
                continue;
            };
            if self.map.is_some() {
                if bio.op == Op::Read || !bio.fua {
                    // copied under the lock already
                    ctx.complete(piece, LeafKind::Drop);
                } else {
                    // pmem FUA: complete once committed
                    let p = ctx.submit(piece);
                    self.queue(Job::Commit(p));
                }
                continue;
            }
            let (me, e, write) = (self.arc(), st.epoch, bio.op == Op::Write);
            let blocks = (st.n / bs) as u32;
            let hook: EndIo = Arc::new(move |ok, _: &mut [u8]| {
                if let Some(c) = &me {
                    if write {
                        if !ok {
                            // The block's entry now names bytes that were never
                            // written: nothing more may be committed (it would
                            // point another sector's old data at this one).
                            c.fail(&mut lock(&c.st));
                        }
                        let recorded = c.write_done(i, blocks, ok);
                        c.leave(e);
                        // a block that could not be recorded is not acknowledged
                        return if recorded { 0 } else { errno::EIO };
                    }
                    c.leave(e);
                }
                0
            });
            let b = Bio {
                sector: self.data_sector(i),
                ..piece
            };
            ctx.remap_with(devs.cache, b, 1, hook)?;
        }
        if let Some((ws, wakes)) = wait_from {
            let end = bio.sector + bio.nr_sectors;
            let p = ctx.submit(bio.sub(ws - bio.sector, end - ws, ws));
            self.park(p, bio.op == Op::Write, wakes);
        }
        Ok(())
    }

    // Long: the write path of every write (a hit, a new block, pmem and ssd
    // modes, a wait for room); not split until the writecache bench shows
    // that a split costs nothing here.
    fn map_write(&self, bio: Bio, ctx: &mut MapCtx, devs: Devs) -> Result<(), MapErr> {
        let bs = self.bs_sectors();
        let end = bio.sector + bio.nr_sectors;
        let pmem = self.o.pmem;
        let mut plan: Vec<Step> = Vec::new();
        let mut wait_from = None;
        let mut st = lock(&self.st);
        if st.error {
            return Err(MapErr::Errno(errno::EIO));
        }
        let mut s = bio.sector;
        let (mut triggered, mut commit) = (false, false);
        while s < end {
            let old = newest(&st, s);
            let mut target = None;
            if let Some(i) = old {
                let e = st.entries[i as usize];
                if e.seq >= st.seq && !e.writeback {
                    st.stats.write_hits_uncommitted += 1;
                    target = Some(Some(i));
                } else if !pmem && !e.writeback {
                    st.stats.write_hits_committed += 1;
                    st.overwrote_committed = true;
                    target = Some(Some(i));
                }
            }
            let target = match target {
                Some(t) => t,
                None if old.is_none() && (st.cleaner || self.o.metadata_only) => {
                    st.stats.writes_around += 1;
                    None
                }
                None if !reserve_log_records(&mut st) => {
                    // the restart log of this seq has no room for the entry:
                    // the rest of the write waits for the commit that begins a
                    // new one
                    st.log_full = true;
                    commit = true;
                    wait_from = Some((s, st.wakes));
                    break;
                }
                None => match st.free.pop() {
                    Some(i) => {
                        st.stats.writes_allocate += 1;
                        self.allocate(&mut st, i, s);
                        triggered |= st.free.len() as u64 + st.wb_size <= st.high_free;
                        commit |= st.uncommitted.len() as u64 >= u64::from(self.o.autocommit_blocks());
                        Some(i)
                    }
                    None if !pmem && old.is_none() => {
                        unreserve_log_records(&mut st, 2);
                        st.stats.writes_around += 1;
                        triggered = true;
                        None
                    }
                    None => {
                        unreserve_log_records(&mut st, 2);
                        st.stats.writes_blocked_on_freelist += 1;
                        triggered = true;
                        wait_from = Some((s, st.wakes));
                        break;
                    }
                },
            };
            if let Some(i) = target {
                if pmem {
                    st.dirty_data.push(i);
                } else {
                    st.entries[i as usize].writes += 1;
                }
            }
            st.stats.writes += 1;
            self.plan_push(&mut plan, s, target);
            s += bs;
        }
        if pmem {
            // copied under the lock: writeback never takes an uncommitted block,
            // and a committed one is never written in place in pmem mode
            for step in &plan {
                if let Some(i) = step.at {
                    let piece = bio.sub(step.s - bio.sector, step.n, step.s);
                    let src = ctx.data_of(&piece);
                    if !self.mapped_write(self.block_in_map(i), src) {
                        // the cache file shrank under us (`io::mapped`): the
                        // error state, and this write fails unacknowledged
                        self.fail(&mut st);
                        return Err(MapErr::Errno(errno::EIO));
                    }
                    for b in i..i + (step.n / bs) as u32 {
                        if !log_allocated(&mut st, b) {
                            return Err(MapErr::Errno(errno::EIO));
                        }
                    }
                }
            }
        }
        if !st.uncommitted.is_empty() && st.commit_deadline.is_none() {
            st.commit_deadline = Some(crate::sync::now() + self.o.autocommit_time());
            self.work.notify_one();
        }
        if commit {
            st.commit_now = true;
            self.work.notify_one();
        }
        if triggered && !st.wb_triggered {
            st.wb_triggered = true;
            self.wb.notify_one();
        }
        drop(st);
        self.issue(&plan, bio, ctx, devs, wait_from)
    }

    fn allocate(&self, st: &mut State, i: u32, sector: u64) {
        let key = st.next_key;
        st.next_key += 1;
        let seq = st.seq;
        st.entries[i as usize] = Entry {
            sector,
            seq,
            key,
            born: self.now_ms(),
            ..FREE_ENTRY
        };
        st.tree.insert((sector, key), i);
        st.newest.insert(sector, i);
        lru_push_head(st, i);
        st.uncommitted.push(i);
        set_meta(st, i, sector, seq);
    }

    /// A write to cache blocks `first..first + blocks` ended; false when one of
    /// them could not be recorded in the restart log (the write then fails).
    fn write_done(&self, first: u32, blocks: u32, ok: bool) -> bool {
        let mut st = lock(&self.st);
        let (mut wake, mut recorded) = (false, true);
        for i in first..first + blocks {
            if let Some(e) = st.entries.get_mut(i as usize) {
                e.writes = e.writes.saturating_sub(1);
                wake |= e.writes == 0;
            }
            if ok {
                // landed, about to be acknowledged
                recorded &= log_allocated(&mut st, i);
            }
        }
        if wake {
            st.wakes += 1;
        }
        let w = if wake && !st.read_waiters.is_empty() {
            std::mem::take(&mut st.read_waiters)
        } else {
            Vec::new()
        };
        drop(st);
        w.into_iter().for_each(Pending::requeue);
        recorded
    }

    fn arc(&self) -> Option<Arc<Cache>> {
        self.weak.upgrade()
    }

    // ---- commits ----

    /// Write the dirty metadata; with `commit`, also commit every uncommitted
    /// entry (metadata, wait for cache writes, flush, superblock with FUA). Freed
    /// entries become free once on disk; older duplicates of the entries just
    /// committed are freed and persisted too.
    pub fn persist(&self, commit: bool) -> io::Result<()> {
        let _c = crate::sync::lock(&self.commit_lock);
        let _window = crate::io::sim::commit_window(self.cache_file.as_ref().and_then(|f| f.sim()));
        let mut commit = commit;
        loop {
            let mut st = lock(&self.st);
            if !st.loaded {
                return Ok(());
            }
            if st.error {
                return Err(eio());
            }
            if commit {
                st.commit_deadline = None;
                st.commit_now = false;
            }
            // a write waiting for room in the log needs a new seq even where
            // nothing new is to be committed
            let committing = commit && (!st.uncommitted.is_empty() || st.log_full);
            let overwrote = commit && std::mem::take(&mut st.overwrote_committed);
            if !committing && !overwrote && st.freeing.is_empty() && st.dirty_list.is_empty() {
                return Ok(());
            }
            let freeing = std::mem::take(&mut st.freeing);
            let dirty_data = std::mem::take(&mut st.dirty_data);
            let (regions, newly, sb_block) = self.snapshot(&mut st, committing);
            drop(st);
            let pmem = self.map.is_some();
            let r = (|| {
                for (off, b) in &regions {
                    self.write_meta(*off, b, pmem)?;
                }
                for &i in &dirty_data {
                    self.msync(self.block_in_map(i), self.o.block_size as usize)?;
                }
                self.drain_epoch();
                // A cache write counted in the drained epoch may have failed
                // while we waited: its end-io hook entered the error state
                // before it left the epoch. Its entry is among `newly`, naming a
                // block that may hold another sector's old data: commit nothing.
                if lock(&self.st).error {
                    return Err(eio());
                }
                if !regions.is_empty() || overwrote || committing {
                    self.flush_cache()?;
                }
                if let Some(sb) = &sb_block {
                    self.write_meta(0, sb, true)?;
                }
                Ok(())
            })();
            let mut st = lock(&self.st);
            if let Err(e) = r {
                tracing::error!("writecache: commit failed: {e}");
                self.fail(&mut st);
                return Err(e);
            }
            for &i in &freeing {
                st.entries[i as usize] = FREE_ENTRY;
                st.free.push(i);
            }
            let log_was_full = committing && std::mem::take(&mut st.log_full);
            let waiters = if freeing.is_empty() && !log_was_full {
                Vec::new()
            } else {
                st.wakes += 1;
                std::mem::take(&mut st.free_waiters)
            };
            // older duplicates of what was just committed are stale now
            for &i in &newly {
                let e = st.entries[i as usize];
                if e.sector == FREE || e.seq >= st.seq || !st.tree.contains_key(&(e.sector, e.key)) {
                    continue;
                }
                let older = st
                    .tree
                    .range((e.sector, 0)..(e.sector, e.key))
                    .next_back()
                    .map(|(_, &j)| j);
                if let Some(j) = older {
                    let o = st.entries[j as usize];
                    if !o.writeback && o.writes == 0 && o.seq < st.seq {
                        remove_entry(&mut st, j);
                    }
                }
            }
            let again = !st.freeing.is_empty();
            drop(st);
            waiters.into_iter().for_each(Pending::requeue);
            if !again {
                return Ok(());
            }
            commit = false;
        }
    }

    /// Under the lock: the dirty metadata regions' bytes, the entries being
    /// committed, and (committing) the superblock block with the next seq_count.
    #[allow(clippy::type_complexity)]
    fn snapshot(
        &self,
        st: &mut State,
        committing: bool,
    ) -> (Vec<(usize, Vec<u8>)>, Vec<u32>, Option<Vec<u8>>) {
        let mut regions = Vec::with_capacity(st.dirty_list.len());
        for r in st.dirty_list.drain(..) {
            st.dirty[r as usize] = false;
            let a = r as usize * REGION;
            let b = (a + REGION).min(st.image.len());
            regions.push((a, st.image[a..b].to_vec()));
        }
        let newly = if committing {
            std::mem::take(&mut st.uncommitted)
        } else {
            Vec::new()
        };
        let sb_block = if committing {
            st.seq += 1;
            let s = st.seq;
            if let Some(l) = &mut st.restart[(s % 2) as usize] {
                l.begin(s);
            }
            st.log_reserved[(s % 2) as usize] = 0;
            // the image is the whole metadata, never shorter than its superblock
            if let Ok(mut sb) = Superblock::parse(&st.image) {
                sb.seq_count = st.seq;
                sb.store(&mut st.image);
            }
            let n = (u64::from(self.o.block_size).max(4096)).min(self.meta_bytes) as usize;
            Some(st.image[..n].to_vec())
        } else {
            None
        };
        (regions, newly, sb_block)
    }

    /// Enter the error state: writes fail, writeback stops, waiters are failed.
    fn fail(&self, st: &mut State) {
        st.error = true;
        let w: Vec<Pending> = st.free_waiters.drain(..).collect();
        w.into_iter().for_each(|p| p.fail(errno::EIO));
        self.progress.notify_all();
        self.wb.notify_all();
    }

    /// The writer thread: autocommit by count and time, FLUSH, pmem FUA, discards.
    fn writer(&self) {
        loop {
            let mut st = lock(&self.st);
            let due = loop {
                if st.stop {
                    return;
                }
                if !st.jobs.is_empty() || st.commit_now {
                    break st.commit_now;
                }
                match st.commit_deadline {
                    Some(d) if crate::sync::now() >= d => break true,
                    Some(d) => {
                        let t = d.saturating_duration_since(crate::sync::now());
                        st = self.work.wait_timeout(&self.st, st, t).0;
                    }
                    None => st = self.work.wait(&self.st, st),
                }
            };
            let jobs = std::mem::take(&mut st.jobs);
            let (cleaner, error) = (st.cleaner, st.error);
            drop(st);
            let need = due || jobs.iter().any(|j| !matches!(j, Job::Discard(_)));
            let ok = !error && (!need || self.persist(true).is_ok());
            for j in jobs {
                match j {
                    Job::Flush(p) if !ok => p.fail(errno::EIO),
                    Job::Flush(p) => {
                        if self.o.pmem && !cleaner && !self.o.metadata_only {
                            p.done();
                        } else {
                            let b = p.bio();
                            p.remap(self.origin.clone(), b, None);
                        }
                    }
                    Job::Commit(p) if ok => p.done(),
                    Job::Commit(p) => p.fail(errno::EIO),
                    Job::Discard(p) => self.discard(p),
                }
            }
        }
    }

    /// Free the cached blocks of a discard (or zeroing) and pass it to the origin
    /// once that is on disk; blocks under writeback are waited for first, so
    /// their old data cannot land on the origin after the range is cleared.
    fn discard(&self, p: Pending) {
        let bio = p.bio();
        let (a, b) = (bio.sector, bio.sector + bio.nr_sectors);
        let mut st = lock(&self.st);
        loop {
            if st.error {
                drop(st);
                return p.fail(errno::EIO);
            }
            let busy = st
                .tree
                .range((a, 0)..(b, 0))
                .any(|(_, &i)| st.entries[i as usize].writeback);
            if !busy {
                break;
            }
            st = self
                .progress
                .wait_timeout(&self.st, st, Duration::from_millis(10))
                .0;
        }
        let gone: Vec<u32> = st.tree.range((a, 0)..(b, 0)).map(|(_, &i)| i).collect();
        for i in gone {
            remove_entry(&mut st, i);
        }
        drop(st);
        match self.persist(false) {
            Ok(()) => p.remap(self.origin.clone(), bio, None),
            Err(_) => p.fail(errno::EIO),
        }
    }

    // ---- writeback ----

    fn should_write_back(&self, st: &mut State) -> bool {
        if st.tree.is_empty() || st.error {
            st.wb_triggered = false;
            return false;
        }
        if st.wb_all > 0 {
            return true;
        }
        if self.aged(st) {
            return true;
        }
        let free = st.free.len() as u64 + st.wb_size;
        if st.wb_triggered && free <= st.low_free {
            return true;
        }
        st.wb_triggered = false;
        false
    }

    /// The oldest block is past max_age (less a sixteenth, as the kernel's timer).
    fn aged(&self, st: &State) -> bool {
        let Some(max) = self.o.max_age else { return false };
        let max = u64::from(max);
        st.tail != NIL && self.now_ms().saturating_sub(st.entries[st.tail as usize].born) >= max - max / 16
    }

    fn writeback(&self) {
        loop {
            let mut st = lock(&self.st);
            loop {
                if st.stop {
                    return;
                }
                if self.should_write_back(&mut st) {
                    break;
                }
                let tick = self
                    .o
                    .max_age
                    .map_or(1000, |m| (u64::from(m) / 16).clamp(10, 1000));
                st = self
                    .wb
                    .wait_timeout(&self.st, st, Duration::from_millis(tick))
                    .0;
            }
            if let Some(pause) = self.o.pause.filter(|&p| p > 0 && !self.o.pmem) {
                if !st.cleaner && st.wb_all == 0 && !st.suspended {
                    let idle = self.now_ms().saturating_sub(self.last_io.load(Ordering::Relaxed));
                    if idle < u64::from(pause) {
                        let t = (u64::from(pause) - idle).min(1000);
                        drop(self.wb.wait_timeout(&self.st, st, Duration::from_millis(t)));
                        continue;
                    }
                }
            }
            let sorted = st.wb_all > 0 && !self.lru_writeback;
            if st.wb_all > 0 && !st.uncommitted.is_empty() {
                drop(st);
                let _ = self.persist(true);
                continue;
            }
            let budget = match self.o.writeback_jobs() {
                0 => PASS_BLOCKS,
                j => (j as usize).saturating_sub(st.wb_size as usize).min(PASS_BLOCKS),
            };
            let runs = if sorted {
                select_sorted(&mut st, budget, self.bs_sectors())
            } else {
                match self.select_lru(&mut st, budget) {
                    Some(r) => r,
                    None => {
                        drop(st);
                        let _ = self.persist(true);
                        continue;
                    }
                }
            };
            if runs.is_empty() {
                // everything left is under writeback, being written, or uncommitted
                drop(
                    self.progress
                        .wait_timeout(&self.st, st, Duration::from_millis(2)),
                );
                continue;
            }
            let n: usize = runs.iter().map(|r| r.1.len()).sum();
            for (_, idx) in &runs {
                for &i in idx {
                    st.entries[i as usize].writeback = true;
                }
            }
            st.wb_size += n as u64;
            drop(st);
            // pmem with `fua` (its default): each write to the origin carries FUA
            // and nothing follows; `nofua` and ssd mode: plain writes, then one
            // flush of the origin before the blocks are freed (the kernel's
            // WC_MODE_FUA in writeback and in __writecache_endio_pmem/ssd)
            let fua = self.o.writeback_fua();
            let r =
                self.copy_runs(&runs, fua)
                    .and_then(|()| if fua { Ok(()) } else { devio::flush(&self.origin) });
            let mut st = lock(&self.st);
            st.wb_size -= n as u64;
            for (_, idx) in &runs {
                for &i in idx {
                    st.entries[i as usize].writeback = false;
                    if r.is_ok() {
                        retire(&mut st, i);
                    }
                }
            }
            if let Err(e) = &r {
                tracing::error!("writecache: writeback failed: {e}");
                self.fail(&mut st);
            }
            drop(st);
            let _ = self.persist(false);
            self.progress.notify_all();
        }
    }

    /// The pre-2019 order: from the LRU tail (oldest first), each run extended by
    /// tree successors. None: the oldest block is uncommitted (commit first).
    fn select_lru(&self, st: &mut State, budget: usize) -> Option<Vec<(u64, Vec<u32>)>> {
        let bs = self.bs_sectors();
        let mut runs: Vec<(u64, Vec<u32>)> = Vec::new();
        // sectors taken in this pass: one entry per sector, whatever its duplicates
        let mut taken: std::collections::HashSet<u64> = std::collections::HashSet::new();
        let mut n = 0;
        let mut cur = st.tail;
        while cur != NIL && n < budget {
            let free = st.free.len() as u64 + st.wb_size + n as u64;
            if !(st.wb_all > 0 || free <= st.low_free || self.aged(st)) {
                break;
            }
            let e = st.entries[cur as usize];
            let prev = e.prev;
            if e.writeback || e.writes > 0 || taken.contains(&e.sector) {
                cur = prev;
                continue;
            }
            if e.seq >= st.seq {
                if runs.is_empty() {
                    return None;
                }
                break;
            }
            let Some(c) = pick(st, e.sector) else {
                cur = prev;
                continue;
            };
            let mut run = vec![c];
            taken.insert(e.sector);
            let mut sec = e.sector + bs;
            while run.len() < MAX_RUN && n + run.len() < budget && !taken.contains(&sec) {
                let Some(j) = pick(st, sec) else { break };
                run.push(j);
                taken.insert(sec);
                sec += bs;
            }
            n += run.len();
            runs.push((e.sector, run));
            cur = prev;
        }
        Some(runs)
    }

    fn copy_runs(&self, runs: &[(u64, Vec<u32>)], fua: bool) -> io::Result<()> {
        let bsb = u64::from(self.o.block_size);
        let mut regions: Vec<(u64, u64, u64)> = Vec::new();
        for (sector, idx) in runs {
            for (k, &i) in idx.iter().enumerate() {
                let src = self.data_sector(i) * SECTOR;
                let dst = (sector + k as u64 * self.bs_sectors()) * SECTOR;
                match regions.last_mut() {
                    Some(r) if r.0 + r.2 == src && r.1 + r.2 == dst => r.2 += bsb,
                    _ => regions.push((src, dst, bsb)),
                }
            }
        }
        match (&self.cache_file, &self.origin_file) {
            (Some(c), Some(o)) => self.copier.copy_regions(c, o, &regions, fua),
            _ => {
                for &(s, d, len) in &regions {
                    devio::copy(
                        &self.copier,
                        &self.cache,
                        s / SECTOR,
                        &self.origin,
                        d / SECTOR,
                        len / SECTOR,
                        fua,
                    )?;
                }
                Ok(())
            }
        }
    }
}

/// The 2019 order (writeback_all): walk the tree by original sector from where
/// the last pass stopped, each run of consecutive sectors one write of up to 256
/// blocks to the origin, whatever cache blocks hold it (the copier gathers them).
/// Of each sector the newest committed entry is written; a sector with an entry
/// still under writeback waits.
fn select_sorted(st: &mut State, budget: usize, bs: u64) -> Vec<(u64, Vec<u32>)> {
    let mut runs: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut n = 0;
    let cursor = st.wb_cursor;
    let mut next_cursor = None;
    {
        let (tree, entries, seq) = (&st.tree, &st.entries, st.seq);
        let mut it = tree
            .range((cursor, 0)..)
            .chain(tree.range(..(cursor, 0)))
            .peekable();
        let end_run = |runs: &mut Vec<(u64, Vec<u32>)>| {
            if runs.last().is_some_and(|r| !r.1.is_empty()) {
                runs.push((0, Vec::new()));
            }
        };
        while let Some((&(sec, _), &i)) = it.next() {
            let mut group = vec![i];
            while let Some((&(s2, _), &j)) = it.peek() {
                if s2 != sec {
                    break;
                }
                group.push(j);
                it.next();
            }
            let Some(c) = pick_of(entries, seq, &group) else {
                end_run(&mut runs);
                continue;
            };
            match runs.last_mut() {
                Some((start, idx))
                    if !idx.is_empty() && idx.len() < MAX_RUN && *start + idx.len() as u64 * bs == sec =>
                {
                    idx.push(c)
                }
                Some((start, idx)) if idx.is_empty() => {
                    *start = sec;
                    idx.push(c);
                }
                _ => runs.push((sec, vec![c])),
            }
            n += 1;
            if n >= budget {
                next_cursor = Some(sec + bs);
                break;
            }
        }
    }
    runs.retain(|r| !r.1.is_empty());
    st.wb_cursor = next_cursor.unwrap_or(0);
    runs
}

/// The entry of sector `s` to write back: its newest committed one, unless an
/// entry of the sector is under writeback or being written (one copy per sector
/// at a time, or an older copy could land on the origin after a newer one).
fn pick(st: &State, s: u64) -> Option<u32> {
    let group: Vec<u32> = st.tree.range((s, 0)..=(s, u64::MAX)).map(|(_, &i)| i).collect();
    pick_of(&st.entries, st.seq, &group)
}

/// [`pick`] over a sector's entries, oldest first.
fn pick_of(entries: &[Entry], seq: u64, group: &[u32]) -> Option<u32> {
    if group
        .iter()
        .any(|&g| entries[g as usize].writeback || entries[g as usize].writes > 0)
    {
        return None;
    }
    group
        .iter()
        .rev()
        .copied()
        .find(|&g| entries[g as usize].seq < seq)
}

/// The newest entry for block `s`.
fn newest(st: &State, s: u64) -> Option<u32> {
    st.newest.get(&s).copied()
}

fn set_meta(st: &mut State, i: u32, sector: u64, seq: u64) {
    format::set_entry(&mut st.image, u64::from(i), sector, seq);
    let r = format::entry_offset(u64::from(i)) / REGION;
    if !st.dirty[r] {
        st.dirty[r] = true;
        st.dirty_list.push(r as u32);
    }
}

/// Entry `i` is on the origin: it leaves the cache. If older entries of its
/// sector are still there (a commit frees those only after its I/O, and
/// writeback may have been quicker), they leave now and `i` stays for a later
/// pass: were both freed in one metadata write, a crash tearing that write
/// could leave the older entry valid and the newer free, and the old data would
/// come back.
fn retire(st: &mut State, i: u32) {
    let e = st.entries[i as usize];
    let older: Vec<u32> = st
        .tree
        .range((e.sector, 0)..(e.sector, e.key))
        .map(|(_, &j)| j)
        .filter(|&j| !st.entries[j as usize].writeback)
        .collect();
    if older.is_empty() {
        remove_entry(st, i);
    }
    for j in older {
        remove_entry(st, j);
    }
}

/// Take entry `i` out of the cache; it becomes free once that is on disk.
fn remove_entry(st: &mut State, i: u32) {
    let e = st.entries[i as usize];
    if st.tree.remove(&(e.sector, e.key)).is_none() {
        debug_assert!(false, "writecache: entry {i} removed twice");
        return;
    }
    if e.logged {
        // a later record of the block may name another sector; this one must
        // not come back in a replay (a committed entry's log has moved on)
        if let Some(l) = st.restart[(e.seq % 2) as usize]
            .as_mut()
            .filter(|l| l.identity() == e.seq)
        {
            l.append(Record {
                kind: FREED,
                a: u64::from(i),
                b: e.sector,
                c: e.seq,
                d: 0,
            });
        }
    }
    if st.newest.get(&e.sector) == Some(&i) {
        match st.tree.range((e.sector, 0)..=(e.sector, u64::MAX)).next_back() {
            Some((_, &j)) => st.newest.insert(e.sector, j),
            None => st.newest.remove(&e.sector),
        };
    }
    lru_remove(st, i);
    set_meta(st, i, e.sector, FREE);
    st.entries[i as usize].sector = FREE;
    st.entries[i as usize].seq = FREE;
    st.freeing.push(i);
}

/// Keep room in the current seq's restart log for an allocation (its entry and
/// its freeing); false when there is none (the write waits for a commit).
fn reserve_log_records(st: &mut State) -> bool {
    let k = (st.seq % 2) as usize;
    match &st.restart[k] {
        Some(l) if l.room() < st.log_reserved[k] + 2 => false,
        Some(_) => {
            st.log_reserved[k] += 2;
            true
        }
        None => true,
    }
}

/// Give back `n` records reserved in the current seq's log (no allocation came).
fn unreserve_log_records(st: &mut State, n: usize) {
    let k = (st.seq % 2) as usize;
    st.log_reserved[k] = st.log_reserved[k].saturating_sub(n);
}

/// Entry `i`'s data has landed: record it in its seq's restart log before the
/// write is acknowledged, once (committed entries count as recorded). False
/// when the log is broken (a file truncated under the daemon): the write must
/// fail, and a commit is asked for.
fn log_allocated(st: &mut State, i: u32) -> bool {
    let Some(e) = st.entries.get(i as usize).copied() else {
        return true;
    };
    if e.logged || e.sector == FREE {
        return true;
    }
    st.entries[i as usize].logged = true;
    let k = (e.seq % 2) as usize;
    st.log_reserved[k] = st.log_reserved[k].saturating_sub(1);
    if let Some(l) = st.restart[k].as_mut().filter(|l| l.identity() == e.seq) {
        if !l.append(Record {
            kind: ALLOCATED,
            a: u64::from(i),
            b: e.sector,
            c: e.seq,
            d: 0,
        }) {
            // room was reserved at the allocation: only a broken log gets here
            tracing::error!("writecache: entry {i} could not be recorded in the restart log: the write fails");
            st.commit_now = true;
            return false;
        }
    }
    true
}

fn lru_push_head(st: &mut State, i: u32) {
    let old = st.head;
    st.entries[i as usize].prev = NIL;
    st.entries[i as usize].next = old;
    if old != NIL {
        st.entries[old as usize].prev = i;
    } else {
        st.tail = i;
    }
    st.head = i;
}

fn lru_remove(st: &mut State, i: u32) {
    let Entry { prev, next, .. } = st.entries[i as usize];
    if prev != NIL {
        st.entries[prev as usize].next = next;
    } else if st.head == i {
        st.head = next;
    }
    if next != NIL {
        st.entries[next as usize].prev = prev;
    } else if st.tail == i {
        st.tail = prev;
    }
    st.entries[i as usize].prev = NIL;
    st.entries[i as usize].next = NIL;
}

/// A restart log's replay refused: what, and how to open the cache without it.
fn refuse_replay(path: &std::path::Path, what: String) -> String {
    format!(
        "replaying the writes the previous daemon acknowledged: {what} (remove {} to open the cache without them)",
        path.display()
    )
}
