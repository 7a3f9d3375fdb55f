//! The snapshot family: `snapshot-origin`, `snapshot` and `snapshot-merge`, over
//! the kernel's exception stores ([`store`]).
//!
//! A snapshot's state is a [`Core`]: its exception tables, its store, and the
//! pieces of requests waiting on it. Cores are registered against their origin
//! device ([`Origins`], the kernel's origin hash) so that a write through
//! `snapshot-origin` finds every snapshot it must copy the old data into first. A
//! second table naming the same COW device over the same origin shares the core
//! (the kernel's exception hand-over), and the table resumed last owns it.
//!
//! Copies run on the snapshot copy engine's threads; a piece that must wait for a
//! copy is held as a [`Pending`] on the exception and requeued once the exception
//! is committed, so no request engine thread ever waits. Exceptions complete in
//! allocation order, are committed to the store (preflush, then the metadata area
//! with FUA), and only then release what waits for them.

use crate::mapper::TargetError;
use crate::sync::Unpoison;
pub mod store;
mod target;

pub use target::{OriginTarget, SnapshotTarget, MERGE_TYPE, ORIGIN_TYPE, SNAPSHOT_TYPE};

use crate::copier::Copier;
use crate::io::{LeafKind, Op};
use crate::mapper::devio;
use crate::mapper::engine::{Dest, Pending};
use crate::mapper::{Bio, DevRef, MapCtx, MapErr};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Duration;
use store::{Persistent, Transient};

/// Chunk copies in flight per snapshot before origin writes wait (the kernel's
/// `snapshot_cow_threshold`).
const COW_THRESHOLD: u32 = 2048;

/// A device as snapshots pair on it: a file's identity or a dmkit device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DevKey {
    File(u64, u64),
    Dm(usize),
}

pub fn dev_key(d: &DevRef) -> DevKey {
    match d {
        DevRef::File(f) => DevKey::File(f.identity.0, f.identity.1),
        DevRef::Dm(h) => DevKey::Dm(Arc::as_ptr(&h.0) as usize),
    }
}

/// The copy engine of snapshots (COW copies, merges), one per registry in its
/// shared state: apart from thin's, so a snapshot over a thin device never waits
/// for a thread its own copy holds.
#[derive(Default)]
pub struct SnapCopier(std::sync::OnceLock<Arc<crate::copier::Copier>>);

impl SnapCopier {
    /// The engine, started the first time it is asked for, with sub-jobs of
    /// `subjob_bytes` ([`crate::mapper::config::Config::copy_subjob_bytes`]).
    pub fn get(&self, subjob_bytes: usize) -> Arc<crate::copier::Copier> {
        self.0
            .get_or_init(|| Arc::new(crate::copier::Copier::new(subjob_bytes, 8)))
            .clone()
    }
}

/// Every origin that has snapshots, by device (the kernel's `_origins`).
#[derive(Default)]
pub struct Origins {
    map: Mutex<HashMap<DevKey, Weak<OriginSnaps>>>,
}

impl Origins {
    /// The snapshots of origin `key` (an empty list the first time).
    pub fn get(&self, key: DevKey) -> Arc<OriginSnaps> {
        let mut m = self.map.lock().unpoisoned();
        m.retain(|_, w| w.strong_count() > 0);
        if let Some(o) = m.get(&key).and_then(Weak::upgrade) {
            return o;
        }
        let o = Arc::new(OriginSnaps::default());
        m.insert(key, Arc::downgrade(&o));
        o
    }
}

/// The snapshots registered against one origin device.
#[derive(Default)]
pub struct OriginSnaps {
    cores: RwLock<Vec<Weak<Core>>>,
}

impl OriginSnaps {
    /// The cores alive now.
    pub fn live(&self) -> Vec<Arc<Core>> {
        let l = self.cores.read().unpoisoned();
        l.iter().filter_map(Weak::upgrade).collect()
    }

    fn register(&self, c: &Arc<Core>) {
        let mut l = self.cores.write().unpoisoned();
        l.retain(|w| w.strong_count() > 0);
        l.push(Arc::downgrade(c));
    }

    /// The core using COW device `cow`, if one is alive (hand-over).
    fn by_cow(&self, cow: DevKey) -> Option<Arc<Core>> {
        self.live().into_iter().find(|c| c.cow_key == cow)
    }

    /// The smallest chunk size of the snapshots origin writes copy into: writes are
    /// split there. None: no snapshot to copy into.
    pub fn min_chunk(&self) -> Option<u64> {
        let l = self.cores.read().unpoisoned();
        l.iter()
            .filter_map(Weak::upgrade)
            .filter(|c| c.copies_from_origin())
            .map(|c| c.chunk)
            .min()
    }
}

/// Which store a snapshot uses.
#[derive(Debug)]
pub enum Store {
    Persistent(Persistent),
    Transient(Transient),
}

/// An exception being made: its COW chunk, its place in allocation order, and
/// what waits for it.
struct Pe {
    new: u64,
    seq: u64,
    /// Pieces to requeue once it is committed.
    waiters: Vec<Pending>,
    /// A write covering the whole chunk went straight to the COW chunk: it is done
    /// once the exception is committed.
    full: Option<Pending>,
}

struct State {
    valid: bool,
    overflow: bool,
    merge_failed: bool,
    complete: HashMap<u64, u64>,
    pending: HashMap<u64, Pe>,
    store: Store,
    next_seq: u64,
    /// The next sequence number to complete; finished ones wait here until then.
    done_seq: u64,
    /// (chunk, data in place, it was a copy) by sequence number.
    finished: BTreeMap<u64, (u64, bool, bool)>,
    /// Chunks appended to the store and not yet written (their waiters wait).
    unwritten: Vec<u64>,
    /// I/O in flight per chunk that an exception completion or merge must wait out
    /// (origin reads of a snapshot; COW writes of a merging one).
    tracked: HashMap<u64, u32>,
    copies: u32,
    throttled: Vec<Pending>,
    /// Chunks a merge step is copying back: writes to them wait in `merge_queue`.
    merging: (u64, u64),
    merge_queue: Vec<Pending>,
    /// Invalidated, and the header saying so is not yet durable: origin writes
    /// wait here, or a crash could bring back a valid snapshot whose exceptions
    /// miss the chunks they changed.
    invalidating: bool,
    after_invalidate: Vec<Pending>,
}

/// One snapshot's state, shared by the tables that name its COW device.
pub struct Core {
    pub origin: Dest,
    pub cow: Dest,
    cow_key: DevKey,
    /// Chunk size in sectors, and its log2.
    pub chunk: u64,
    shift: u32,
    /// Size of the snapshot in sectors: origin writes beyond it copy nothing.
    len: u64,
    pub persistent: bool,
    /// `PO`: a full store overflows a snapshot write instead of invalidating.
    pub overflow_ok: bool,
    st: Mutex<State>,
    /// Serialises store writes, so areas reach the disk in commit order. Taken
    /// before `st`.
    io: Mutex<()>,
    /// The target that owns it (the table resumed last); 0: none yet.
    owner: AtomicU64,
    active: AtomicBool,
    /// Owned by a snapshot-merge target: origin writes copy nothing into it.
    merging: AtomicBool,
    events: AtomicU64,
    copier: Arc<Copier>,
    merge: Mutex<Option<MergeThread>>,
}

struct MergeThread {
    stop: Arc<AtomicBool>,
    handle: crate::sync::Thread<()>,
}

/// A snapshot's state, locked; a lock a panicking thread left behind ends the
/// daemon, as the state may be half changed (crate::panics).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
        .unwrap_or_else(|_| crate::panics::poisoned("a snapshot's exception store"))
}

/// What opening a store found.
pub struct Opened {
    pub store: Store,
    pub chunk: u64,
    pub valid: bool,
    pub complete: HashMap<u64, u64>,
}

/// The kernel's words for a COW device whose metadata cannot be used, and why.
fn metadata_failed(why: String) -> String {
    format!("Failed to read snapshot metadata: {why}")
}

/// Read (or create) the store on `cow`. `chunk`: the table's chunk size (0: the
/// header's, else the default); a persistent header's chunk size wins over it.
pub fn open_store(cow: &Dest, persistent: bool, chunk: u64, cow_lbs: u64) -> Result<Opened, TargetError> {
    let cow_sectors = devio::size_sectors(cow);
    if !persistent {
        if chunk == 0 {
            return Err("Chunk size not set".into());
        }
        return Ok(Opened {
            store: Store::Transient(Transient { chunk, next_free: 0 }),
            chunk,
            valid: true,
            complete: HashMap::new(),
        });
    }
    let failed = metadata_failed;
    let mut hdr = vec![0u8; 512];
    devio::read(cow, 0, &mut hdr).map_err(|e| failed(format!("reading the header: {e}")))?;
    let h = store::Header::parse(&hdr);
    if h.magic == 0 {
        return new_store(cow, chunk, cow_lbs, cow_sectors);
    }
    if h.magic != store::SNAP_MAGIC {
        return Err(failed(format!(
            "Invalid or corrupt snapshot (magic {:#010x} at byte 0 of the COW device, expected {:#010x})",
            h.magic,
            store::SNAP_MAGIC
        )).into());
    }
    if h.version != store::DISK_VERSION {
        return Err(failed(format!(
            "unable to handle snapshot disk version {}",
            h.version
        )).into());
    }
    let disk_chunk = u64::from(h.chunk_size);
    if disk_chunk == 0 || !disk_chunk.is_power_of_two() || !disk_chunk.is_multiple_of(cow_lbs) {
        return Err(failed(format!("invalid on-disk chunk size {disk_chunk}")).into());
    }
    // the kernel's bound (INT_MAX bytes), and room for the header and one area
    if disk_chunk > (i32::MAX as u64) >> 9 || disk_chunk * 2 > cow_sectors {
        return Err(failed(format!(
            "on-disk chunk size {disk_chunk} is too high for a COW device of {cow_sectors} sectors"
        )).into());
    }
    if chunk != 0 && chunk != disk_chunk {
        tracing::warn!(
            "snapshot: chunk size {disk_chunk} in device metadata overrides table chunk size of {chunk}"
        );
    }
    let p = read_areas(cow, disk_chunk, cow_sectors)?;
    let complete = p.entries.iter().copied().collect();
    Ok(Opened {
        store: Store::Persistent(p),
        chunk: disk_chunk,
        valid: h.valid != 0,
        complete,
    })
}

/// A new persistent store on `cow`: the header, then an empty area 0.
fn new_store(cow: &Dest, chunk: u64, cow_lbs: u64, cow_sectors: u64) -> Result<Opened, TargetError> {
    let failed = metadata_failed;
    let chunk = if chunk == 0 {
        store::DEFAULT_CHUNK_SECTORS.max(cow_lbs)
    } else {
        chunk
    };
    if cow_sectors < 2 * chunk {
        return Err(failed(format!(
            "the COW device ({cow_sectors} sectors) cannot hold the header and the first metadata area ({} sectors)",
            2 * chunk
        )).into());
    }
    let zero = vec![0u8; (chunk * 512) as usize];
    devio::write(cow, 0, &store::header_image(true, chunk), false)
        .and_then(|()| devio::write(cow, chunk, &zero, false))
        .and_then(|()| devio::flush(cow))
        .map_err(|e| failed(format!("writing a new header: {e}")))?;
    Ok(Opened {
        store: Store::Persistent(Persistent::new(chunk)),
        chunk,
        valid: true,
        complete: HashMap::new(),
    })
}

/// A persistent store's metadata areas, read in order until one that is not
/// full; an exception that points outside the COW device or into an area is
/// refused, naming it.
fn read_areas(cow: &Dest, chunk: u64, cow_sectors: u64) -> Result<Persistent, TargetError> {
    let failed = metadata_failed;
    let mut p = Persistent::new(chunk);
    let total_chunks = cow_sectors / chunk;
    let mut area = 0u64;
    // chunk is bounded by the device above; memory is asked, not assumed
    let mut buf: Vec<u8> =
        crate::pdata::bounds::zeroed_vec(0, "snapshot header chunk_size (in bytes)", chunk * 512)
            .map_err(|e| failed(e.to_string()))?;
    loop {
        let at = p.area_chunk(area);
        if at >= total_chunks {
            return Err(failed(format!(
                "metadata area {area} (chunk {at}) lies beyond the end of the COW device ({total_chunks} chunks)"
            )).into());
        }
        devio::read(cow, at * chunk, &mut buf)
            .map_err(|e| failed(format!("reading metadata area {area}: {e}")))?;
        let (list, full) = store::parse_area(&buf);
        for (i, &(old, new)) in list.iter().enumerate() {
            let stride = p.per_area + 1;
            if new >= total_chunks || new % stride == 1 {
                return Err(failed(format!(
                    "exception {i} of metadata area {area} maps origin chunk {old} to COW chunk {new}, which is {}",
                    if new >= total_chunks {
                        "beyond the end of the COW device"
                    } else {
                        "a metadata area"
                    }
                )).into());
            }
        }
        p.load_area(area, &list, full);
        if !full {
            return Ok(p);
        }
        area += 1;
    }
}

impl Core {
    pub fn new(
        origin: Dest,
        cow: Dest,
        cow_key: DevKey,
        len: u64,
        opened: Opened,
        overflow_ok: bool,
        copier: Arc<Copier>,
    ) -> Arc<Core> {
        let persistent = matches!(opened.store, Store::Persistent(_));
        if !opened.valid {
            tracing::warn!("snapshot: Snapshot is marked invalid.");
        }
        Arc::new(Core {
            origin,
            cow,
            cow_key,
            chunk: opened.chunk,
            shift: opened.chunk.trailing_zeros(),
            len,
            persistent,
            overflow_ok,
            st: Mutex::new(State {
                valid: opened.valid,
                overflow: false,
                merge_failed: false,
                complete: opened.complete,
                pending: HashMap::new(),
                store: opened.store,
                next_seq: 0,
                done_seq: 0,
                finished: BTreeMap::new(),
                unwritten: Vec::new(),
                tracked: HashMap::new(),
                copies: 0,
                throttled: Vec::new(),
                invalidating: false,
                after_invalidate: Vec::new(),
                merging: (0, 0),
                merge_queue: Vec::new(),
            }),
            io: Mutex::new(()),
            owner: AtomicU64::new(0),
            active: AtomicBool::new(false),
            merging: AtomicBool::new(false),
            events: AtomicU64::new(0),
            copier,
            merge: Mutex::new(None),
        })
    }

    /// Origin writes copy into it: active and not merging (and valid, which
    /// [`Core::cow_for_origin`] checks under its lock).
    fn takes_origin_copies(&self) -> bool {
        self.active.load(Ordering::Acquire) && !self.merging.load(Ordering::Acquire)
    }

    /// Origin writes must come through this snapshot: it is valid, or its
    /// invalidation is not yet durable (they wait for that).
    fn copies_from_origin(&self) -> bool {
        self.takes_origin_copies() && {
            let st = lock(&self.st);
            st.valid || st.invalidating
        }
    }

    fn chunk_of(&self, sector: u64) -> u64 {
        sector >> self.shift
    }

    /// `dmsetup status` parameters.
    pub fn status(&self) -> String {
        let st = lock(&self.st);
        if !st.valid {
            return "Invalid".into();
        }
        if st.merge_failed {
            return "Merge failed".into();
        }
        if st.overflow {
            return "Overflow".into();
        }
        let total = devio::size_sectors(&self.cow);
        let (alloc, meta) = match &st.store {
            Store::Persistent(p) => p.usage(),
            Store::Transient(t) => (t.next_free, 0),
        };
        format!("{alloc}/{total} {meta}")
    }

    /// Invalidate (D.4): I/O to the snapshot fails from now on, origin writes copy
    /// nothing into it, and a persistent header is rewritten with valid = 0.
    fn invalidate(self: &Arc<Self>, st: &mut State, why: &str) {
        if !st.valid {
            return;
        }
        tracing::error!("snapshot: invalidating snapshot: {why}");
        st.valid = false;
        self.events.fetch_add(1, Ordering::Relaxed);
        if self.persistent {
            st.invalidating = true;
            let me = self.clone();
            self.copier.spawn(Box::new(move |_| {
                {
                    let _io = crate::sync::lock(&me.io);
                    let img = store::header_image(false, me.chunk);
                    if let Err(e) = devio::write(&me.cow, 0, &img, true) {
                        tracing::error!("snapshot: writing the invalidated header failed: {e}");
                    }
                }
                let held = {
                    let mut st = lock(&me.st);
                    st.invalidating = false;
                    std::mem::take(&mut st.after_invalidate)
                };
                for p in held {
                    p.requeue();
                }
            }));
        }
    }

    /// Hand out a COW chunk for origin chunk `chunk` and record the pending
    /// exception; None when the store is full.
    fn allocate(&self, st: &mut State, chunk: u64) -> Option<u64> {
        let cow_sectors = devio::size_sectors(&self.cow);
        let new = match &mut st.store {
            Store::Persistent(p) => p.prepare(cow_sectors)?,
            Store::Transient(t) => t.prepare(cow_sectors)?,
        };
        let seq = st.next_seq;
        st.next_seq += 1;
        st.copies += 1;
        st.pending.insert(
            chunk,
            Pe {
                new,
                seq,
                waiters: Vec::new(),
                full: None,
            },
        );
        Some(new)
    }

    /// Copy origin chunk `chunk` to COW chunk `new` on the copy engine, then finish
    /// the exception.
    fn start_copy(self: &Arc<Self>, chunk: u64, new: u64) {
        let me = self.clone();
        self.copier.spawn(Box::new(move |c: &Copier| {
            let start = chunk << me.shift;
            let size = devio::size_sectors(&me.origin);
            let n = me.chunk.min(size.saturating_sub(start));
            let r = if n == 0 {
                Ok(())
            } else {
                devio::copy(c, &me.origin, start, &me.cow, new << me.shift, n, false)
            };
            if let Err(e) = &r {
                tracing::error!("snapshot: copying origin chunk {chunk} to COW chunk {new} failed: {e}");
            }
            me.finish(chunk, r.is_ok(), true);
        }));
    }

    /// The data of the exception for `chunk` is in place (`ok`) or not: complete
    /// exceptions in allocation order, commit them, and release what waits. A
    /// failed copy invalidates the snapshot; a whole-chunk write that failed (or
    /// was never issued: its request went back to wait for a resume) only gives the
    /// exception up, the chunk still reading from the origin. Runs on a
    /// copy-engine thread (it blocks on store writes).
    fn finish(self: &Arc<Self>, chunk: u64, ok: bool, copy: bool) {
        let _io = crate::sync::lock(&self.io);
        let mut st = lock(&self.st);
        let Some(seq) = st.pending.get(&chunk).map(|pe| pe.seq) else {
            return;
        };
        st.finished.insert(seq, (chunk, ok, copy));
        st.copies = st.copies.saturating_sub(1);
        let mut release: Vec<Pending> = std::mem::take(&mut st.throttled);
        // Area writes the commits asked for, in order; and how many of the
        // entries appended so far (`st.unwritten`) an area written here holds:
        // an area is written when it fills or when nothing else is pending, so
        // a write holds every entry appended before it. Entries appended after
        // the last write (to the next area, others still pending) wait for the
        // commit that writes them: releasing them with the rest let an origin
        // write go ahead of its chunk's exception on disk, and a crash then
        // lost the exception (the sim's snapshot seed 24).
        let mut writes = Vec::new();
        let mut covered = 0usize;
        loop {
            let next = st.done_seq;
            let Some((chunk, ok, copy)) = st.finished.remove(&next) else {
                break;
            };
            st.done_seq += 1;
            // Reads of the snapshot that went to the origin must finish before
            // origin writes waiting on this exception go ahead.
            while st.tracked.get(&chunk).is_some_and(|&n| n > 0) {
                drop(st);
                crate::sync::sleep(Duration::from_micros(200));
                st = lock(&self.st);
            }
            if !ok || !st.valid {
                if !ok && copy {
                    self.invalidate(&mut st, "a copy to the COW device failed");
                }
                if let Store::Persistent(p) = &mut st.store {
                    let io = p.abandon();
                    if io.area.is_some() {
                        covered = st.unwritten.len();
                    }
                    writes.push(io);
                }
                if let Some(pe) = st.pending.remove(&chunk) {
                    release.extend(pe.waiters);
                    if let Some(f) = pe.full {
                        f.fail(crate::io::errno::EIO);
                    }
                }
                continue;
            }
            let new = st.pending.get(&chunk).map_or(0, |pe| pe.new);
            st.unwritten.push(chunk);
            let io = match &mut st.store {
                Store::Persistent(p) => Some(p.commit(chunk, new)),
                Store::Transient(_) => None,
            };
            // a transient store commits at once
            if io.as_ref().is_none_or(|io| io.area.is_some()) {
                covered = st.unwritten.len();
            }
            writes.extend(io);
        }
        // The store lock (`io`) keeps other commits behind these writes.
        let mut written = true;
        for io in writes.iter().filter(|io| io.area.is_some()) {
            drop(st);
            let r = self.write_commit(io);
            st = lock(&self.st);
            if let Err(e) = r {
                self.invalidate(&mut st, &format!("writing the exception store failed: {e}"));
                written = false;
            }
        }
        if covered > 0 {
            let keep = covered.min(st.unwritten.len());
            let rest = st.unwritten.split_off(keep);
            for chunk in std::mem::replace(&mut st.unwritten, rest) {
                let Some(pe) = st.pending.remove(&chunk) else {
                    continue;
                };
                if written && st.valid {
                    st.complete.insert(chunk, pe.new);
                    if let Some(f) = pe.full {
                        f.done();
                    }
                } else if let Some(f) = pe.full {
                    f.fail(crate::io::errno::EIO);
                }
                release.extend(pe.waiters);
            }
        }
        drop(st);
        for p in release {
            p.requeue();
        }
    }

    fn write_commit(&self, io: &store::CommitIo) -> std::io::Result<()> {
        let sim = match &self.cow {
            Dest::File(f) => f.sim(),
            Dest::Dm(_) => None,
        };
        let _window = crate::io::sim::commit_window(sim);
        if let Some(z) = io.zero_chunk {
            devio::write(
                &self.cow,
                z * self.chunk,
                &vec![0u8; (self.chunk * 512) as usize],
                false,
            )?;
        }
        if let Some((at, img)) = &io.area {
            // preflush: the copied data is durable before the area that points at it
            devio::flush(&self.cow)?;
            devio::write(&self.cow, at * self.chunk, img, true)?;
        }
        Ok(())
    }

    /// Make sure origin chunk `chunk` is being or has been copied: allocate and
    /// start the copy if neither. Returns whether the exception is still pending,
    /// handing `waiter` (made once, if given) to it; `throttled` when too many
    /// copies are in flight and the waiter was queued for that instead.
    fn cow_for_origin(
        self: &Arc<Self>,
        chunk: u64,
        waiter: &mut Option<&mut dyn FnMut() -> Pending>,
    ) -> bool {
        let mut st = lock(&self.st);
        if st.invalidating {
            if let Some(w) = waiter.take() {
                st.after_invalidate.push(w());
            }
            return true;
        }
        if !st.valid || st.complete.contains_key(&chunk) {
            return false;
        }
        if let Some(pe) = st.pending.get_mut(&chunk) {
            if let Some(w) = waiter.take() {
                pe.waiters.push(w());
            }
            return true;
        }
        if st.copies >= COW_THRESHOLD {
            if let Some(w) = waiter.take() {
                st.throttled.push(w());
            }
            return true;
        }
        let Some(new) = self.allocate(&mut st, chunk) else {
            self.invalidate(&mut st, "the COW device is full");
            return false;
        };
        if let Some(w) = waiter.take() {
            if let Some(pe) = st.pending.get_mut(&chunk) {
                pe.waiters.push(w());
            }
        }
        drop(st);
        self.start_copy(chunk, new);
        true
    }

    // ---- the merge ----

    fn start_merge(self: &Arc<Self>, snaps: Arc<OriginSnaps>) {
        let mut m = lock(&self.merge);
        if m.as_ref().is_some_and(|t| !t.handle.is_finished()) {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (me, s) = (self.clone(), stop.clone());
        let handle = crate::sync::spawn("snapshot-merge", move || me.merge_loop(&snaps, &s));
        match handle {
            Ok(handle) => *m = Some(MergeThread { stop, handle }),
            Err(e) => {
                tracing::error!("snapshot-merge: cannot start the merge thread: {e}");
                lock(&self.st).merge_failed = true;
            }
        }
    }

    /// Stop merging after the step under way (presuspend).
    fn stop_merge(&self) {
        let t = lock(&self.merge).take();
        if let Some(t) = t {
            t.stop.store(true, Ordering::SeqCst);
            let _ = t.handle.join();
        }
    }

    fn merge_loop(self: &Arc<Self>, snaps: &OriginSnaps, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            match self.merge_step(snaps, stop) {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!("snapshot-merge: merge complete");
                    return;
                }
                Err(why) => {
                    tracing::error!("snapshot-merge: {why}: shutting down merge");
                    let mut st = lock(&self.st);
                    st.merge_failed = true;
                    st.merging = (0, 0);
                    let q = std::mem::take(&mut st.merge_queue);
                    drop(st);
                    for p in q {
                        p.requeue();
                    }
                    self.events.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    /// One merge step (D.6): the trailing run of consecutive exceptions copied
    /// back to the origin, the origin flushed, the entries cleared on disk. Ok(false)
    /// when nothing is left.
    fn merge_step(self: &Arc<Self>, snaps: &OriginSnaps, stop: &AtomicBool) -> Result<bool, TargetError> {
        let step = {
            let _io = crate::sync::lock(&self.io);
            let mut st = lock(&self.st);
            if !st.valid || st.merge_failed {
                return Ok(false);
            }
            match &mut st.store {
                Store::Persistent(p) => p.prepare_merge(),
                Store::Transient(_) => None,
            }
        };
        let Some((old, new, n)) = step else {
            return Ok(false);
        };
        let (start, len) = (old << self.shift, n << self.shift);
        // The origin range is about to change: the other snapshots copy it first.
        loop {
            let mut pending = false;
            for c in snaps.live() {
                if Arc::ptr_eq(&c, self) || !c.takes_origin_copies() {
                    continue;
                }
                let mut s = start;
                while s < start + len && s < c.len {
                    pending |= c.cow_for_origin(c.chunk_of(s), &mut None);
                    s = ((s >> c.shift) + 1) << c.shift;
                }
            }
            if !pending {
                break;
            }
            if stop.load(Ordering::SeqCst) {
                return Ok(true);
            }
            crate::sync::sleep(Duration::from_millis(1));
        }
        lock(&self.st).merging = (old, n);
        // Writes already under way to those chunks finish first.
        loop {
            let busy = {
                let st = lock(&self.st);
                (old..old + n).any(|c| st.tracked.get(&c).is_some_and(|&k| k > 0))
            };
            if !busy {
                break;
            }
            crate::sync::sleep(Duration::from_micros(200));
        }
        let size = devio::size_sectors(&self.origin);
        let count = len.min(size.saturating_sub(start));
        if count > 0 {
            devio::copy(
                &self.copier,
                &self.cow,
                new << self.shift,
                &self.origin,
                start,
                count,
                false,
            )
            .map_err(|e| format!("copying COW chunks {new}.. to origin chunk {old} failed: {e}"))?;
        }
        devio::flush(&self.origin).map_err(|e| format!("Flush after merge failed: {e}"))?;
        let _io = crate::sync::lock(&self.io);
        let (at, img) = match &mut lock(&self.st).store {
            Store::Persistent(p) => p.commit_merge(n),
            Store::Transient(_) => return Ok(false),
        };
        devio::flush(&self.cow)
            .and_then(|()| devio::write(&self.cow, at * self.chunk, &img, true))
            .map_err(|e| format!("Write error in exception store: {e}"))?;
        let mut st = lock(&self.st);
        for c in old..old + n {
            st.complete.remove(&c);
        }
        st.merging = (0, 0);
        let q = std::mem::take(&mut st.merge_queue);
        drop(st);
        for p in q {
            p.requeue();
        }
        Ok(true)
    }
}

/// Copy-on-write for an origin write at `sector` (origin sectors, within one
/// chunk of the smallest size): every snapshot of `snaps` that needs the chunk
/// copied starts the copy. If any copy is pending, the piece (made by `submit`) is
/// queued on one of them and true is returned; the piece is requeued once that
/// exception is committed, and checks again.
fn origin_write(
    snaps: &OriginSnaps,
    sector: u64,
    skip: Option<&Arc<Core>>,
    submit: &mut dyn FnMut() -> Pending,
) -> bool {
    let mut waiter: Option<&mut dyn FnMut() -> Pending> = Some(submit);
    let mut queued = false;
    for c in snaps.live() {
        if skip.is_some_and(|s| Arc::ptr_eq(s, &c)) || sector >= c.len || !c.takes_origin_copies() {
            continue;
        }
        if c.cow_for_origin(c.chunk_of(sector), &mut waiter) {
            queued |= waiter.is_none();
        }
    }
    queued
}

/// Count an I/O on `chunk` that exception completion or a merge must wait out;
/// the hook that uncounts it when the I/O is done.
fn track(core: &Arc<Core>, st: &mut State, chunk: u64) -> crate::io::EndIo {
    *st.tracked.entry(chunk).or_default() += 1;
    let c = core.clone();
    Arc::new(move |_, _| {
        let mut st = lock(&c.st);
        if let Some(n) = st.tracked.get_mut(&chunk) {
            *n -= 1;
            if *n == 0 {
                st.tracked.remove(&chunk);
            }
        }
        0
    })
}

/// What a snapshot target maps a piece of one chunk to.
// Long: every case of a chunk as the kernel's snapshot_map has them (an
// exception, the origin, a copy under way, a new exception, a full or
// invalid snapshot), on the I/O path.
pub(crate) fn map_snapshot_chunk(
    core: &Arc<Core>,
    tgt: &target::Features,
    origin: &DevRef,
    cow: &DevRef,
    bio: Bio,
    ctx: &mut MapCtx,
) -> Result<(), MapErr> {
    let chunk = core.chunk_of(bio.sector);
    let off = bio.sector & (core.chunk - 1);
    let to_cow = |new: u64| bio.sub(0, bio.nr_sectors, (new << core.shift) + off);
    let mut st = lock(&core.st);
    if !st.valid {
        drop(st);
        ctx.complete(bio, LeafKind::Fail(crate::io::errno::EIO));
        return Ok(());
    }
    match bio.op {
        Op::Read => {
            if let Some(&new) = st.complete.get(&chunk) {
                drop(st);
                return ctx.remap(cow, to_cow(new), 0);
            }
            let hook = track(core, &mut st, chunk);
            drop(st);
            ctx.remap_with(origin, bio, 0, hook)
        }
        Op::Write => {
            if st.overflow {
                drop(st);
                ctx.complete(bio, LeafKind::Fail(crate::io::errno::EIO));
                return Ok(());
            }
            if let Some(&new) = st.complete.get(&chunk) {
                drop(st);
                return ctx.remap(cow, to_cow(new), 0);
            }
            if let Some(pe) = st.pending.get_mut(&chunk) {
                pe.waiters.push(ctx.submit(bio));
                return Ok(());
            }
            let Some(new) = core.allocate(&mut st, chunk) else {
                if core.overflow_ok {
                    st.overflow = true;
                    core.events.fetch_add(1, Ordering::Relaxed);
                } else {
                    core.invalidate(&mut st, "the COW device is full");
                }
                drop(st);
                ctx.complete(bio, LeafKind::Fail(crate::io::errno::EIO));
                return Ok(());
            };
            let whole = off == 0 && bio.nr_sectors == core.chunk;
            if whole {
                // No copy: the write itself fills the chunk, and completes once the
                // exception is committed.
                let p = ctx.submit(bio);
                if let Some(pe) = st.pending.get_mut(&chunk) {
                    pe.full = Some(p);
                }
                drop(st);
                let c = core.clone();
                let hook: crate::io::EndIo = Arc::new(move |ok, _| {
                    let c2 = c.clone();
                    c.copier.spawn(Box::new(move |_| c2.finish(chunk, ok, false)));
                    0
                });
                return ctx.remap_with(cow, to_cow(new), 0, hook);
            }
            if let Some(pe) = st.pending.get_mut(&chunk) {
                pe.waiters.push(ctx.submit(bio));
            }
            drop(st);
            core.start_copy(chunk, new);
            Ok(())
        }
        Op::Discard => {
            // only with discard_zeroes_cow (else discards are not offered)
            let whole = off == 0 && bio.nr_sectors == core.chunk;
            let new = st.complete.get(&chunk).copied();
            drop(st);
            if tgt.discard_passdown_origin {
                ctx.remap(origin, bio, 0)?;
            }
            match new {
                Some(new) if whole && tgt.discard_zeroes_cow => ctx.remap(
                    cow,
                    Bio {
                        op: Op::WriteZeroes,
                        punch: false,
                        ..to_cow(new)
                    },
                    0,
                ),
                _ => {
                    if !tgt.discard_passdown_origin {
                        ctx.complete(bio, LeafKind::Drop);
                    }
                    Ok(())
                }
            }
        }
        Op::WriteZeroes | Op::Flush => {
            drop(st);
            ctx.complete(bio, LeafKind::Fail(crate::io::errno::EOPNOTSUPP));
            Ok(())
        }
    }
}

/// What a merging snapshot maps a piece of one chunk to (D.8).
pub(crate) fn map_merge_chunk(
    core: &Arc<Core>,
    snaps: &OriginSnaps,
    origin: &DevRef,
    cow: &DevRef,
    bio: Bio,
    ctx: &mut MapCtx,
) -> Result<(), MapErr> {
    let chunk = core.chunk_of(bio.sector);
    let off = bio.sector & (core.chunk - 1);
    let mut st = lock(&core.st);
    if st.valid {
        if let Some(&new) = st.complete.get(&chunk) {
            let write = bio.op == Op::Write;
            if write && chunk >= st.merging.0 && chunk < st.merging.0 + st.merging.1 {
                st.merge_queue.push(ctx.submit(bio));
                return Ok(());
            }
            let to_cow = bio.sub(0, bio.nr_sectors, (new << core.shift) + off);
            if !write {
                drop(st);
                return ctx.remap(cow, to_cow, 0);
            }
            let hook = track(core, &mut st, chunk);
            drop(st);
            return ctx.remap_with(cow, to_cow, 0, hook);
        }
    }
    drop(st);
    if bio.op == Op::Write && origin_write(snaps, bio.sector, Some(core), &mut || ctx.submit(bio)) {
        return Ok(());
    }
    ctx.remap(origin, bio, 0)
}

/// An origin write piece: copy-on-write first, then on to the origin.
pub(crate) fn map_origin_write(
    snaps: &OriginSnaps,
    origin: &DevRef,
    bio: Bio,
    ctx: &mut MapCtx,
) -> Result<(), MapErr> {
    if origin_write(snaps, bio.sector, None, &mut || ctx.submit(bio)) {
        return Ok(());
    }
    ctx.remap(origin, bio, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::BackingFile;

    /// Exceptions completing out of order across an area boundary (the sim's
    /// snapshot seed 24): the copy that fills area 0 finishes after the first
    /// copy of area 1; area 0 is written, area 1 is not yet (an exception is
    /// still pending), so the area-1 exception must not be complete (its
    /// origin write would go ahead of it on disk) until the commit that writes
    /// area 1. Fails before the fix: everything finished in the call was
    /// released once area 0 was written.
    #[test]
    fn an_exception_is_complete_only_once_its_area_is_written() {
        let dir = std::env::temp_dir().join(format!("dmkit-snap-areas-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = |name: &str, len: u64| {
            let p = dir.join(name);
            std::fs::write(&p, vec![0u8; len as usize]).expect("file");
            Arc::new(BackingFile::open(&p, false, false).expect("open"))
        };
        let (origin, cow) = (file("origin", 1 << 20), file("cow", 1 << 20));
        let key = dev_key(&DevRef::File(cow.clone()));
        let (origin, cow) = (Dest::File(origin), Dest::File(cow));
        // 2-sector chunks: 64 exceptions per metadata area
        let opened = open_store(&cow, true, 2, 512).expect("store");
        let copier = Arc::new(crate::copier::Copier::new(64 << 10, 4));
        let core = Core::new(origin, cow, key, 2048, opened, false, copier);
        let per_area = 64;
        {
            let mut st = lock(&core.st);
            for c in 0..per_area + 2 {
                core.allocate(&mut st, c).expect("a COW chunk");
            }
        }
        for c in 0..per_area - 1 {
            core.finish(c, true, false);
        }
        assert!(lock(&core.st).complete.is_empty(), "nothing written yet, nothing complete");
        // the first exception of area 1 finishes before the one that fills area 0
        core.finish(per_area, true, false);
        core.finish(per_area - 1, true, false);
        {
            let st = lock(&core.st);
            assert_eq!(st.complete.len() as u64, per_area, "area 0 is written: its exceptions are complete");
            assert!(
                !st.complete.contains_key(&per_area),
                "origin chunk {per_area}'s exception is in area 1, not yet written"
            );
        }
        // the last one: nothing pending, area 1 is written
        core.finish(per_area + 1, true, false);
        let st = lock(&core.st);
        assert!(st.complete.contains_key(&per_area) && st.complete.contains_key(&(per_area + 1)));
        drop(st);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
