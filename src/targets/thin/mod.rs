//! dm-thin: the `thin-pool` and `thin` targets over the kernel's metadata format.
//!
//! A [`Pool`] is the state shared by a pool device and its thin devices: the metadata
//! (behind one lock), the bio prison of blocks being provisioned, the data device and
//! the copy engine. It outlives table reloads (found again by its metadata device, as
//! the kernel finds its pools). Commits run on the pool's own thread, at least every
//! second and whenever a flush needs one: before each, it waits until every I/O that
//! entered the pool device earlier has finished, so a data block freed in a transaction
//! is never handed out again while an old write to it could still land.

use crate::mapper::TargetError;
use crate::sync::Unpoison;
pub mod device;
mod fast;
pub mod pool;

use crate::copier::Copier;
use crate::io::restart_log::{Previous, Record, RestartLog};
use crate::mapper::devio::{self, describe, identity};
use crate::mapper::engine::{Dest, Pending};
use crate::mapper::config::Config;
use crate::mapper::Device;
use crate::pdata::PdataError;
use crate::thin::{FormatOptions, ThinError, ThinPoolMetadata};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use crate::sync::Cond;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

/// Why a commit did not start: the I/O that entered the pool before it did not
/// drain in time.
const POSTPONED: &str = "I/O in flight did not drain (queued for space?); commit postponed";
/// Commits postponed in a row for this long are logged as a warning.
const POSTPONED_WARN_AFTER: Duration = Duration::from_secs(10);

/// Metadata blocks the block cache may hold (4 KiB each): 64 MiB.
const CACHE_BLOCKS: usize = 16384;
/// Keys of the bio prison: a virtual block of a thin, or a data block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    Virtual(u64, u64),
    Data(u64),
}

/// What the pool does now (status shows it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Write,
    OutOfDataSpace,
    ReadOnly,
}

/// The pool's features from its table line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    pub zero_new_blocks: bool,
    pub discard_enabled: bool,
    pub discard_passdown: bool,
    pub read_only: bool,
    pub error_if_no_space: bool,
}

impl Default for Features {
    fn default() -> Features {
        Features {
            zero_new_blocks: true,
            discard_enabled: true,
            discard_passdown: true,
            read_only: false,
            error_if_no_space: false,
        }
    }
}

/// Everything behind the pool's lock.
pub struct PoolMd {
    pub md: ThinPoolMetadata,
    /// Blocks whose provisioning or copy is under way, with the pieces waiting for
    /// them (requeued when the cell is released).
    pub prison: HashMap<Key, Vec<Pending>>,
    /// Pieces waiting for data space (requeued when space comes, at the no-space
    /// timeout, when the pool fails, and at suspend).
    pub no_space: Vec<Pending>,
    /// Flushes waiting for a commit: the commit count that covers them, the thin
    /// they came from, and the pool device they go on to once it is reached.
    pub flush_waiters: Vec<(u64, u64, Pending, Dest)>,
    /// Changes since the last commit.
    pub dirty: bool,
    pub mode: Mode,
    pub features: Features,
    pub low_water: u64,
    pub low_water_hit: bool,
    /// When the pool ran out of data space (queued I/O fails after the timeout).
    pub out_of_space_since: Option<Instant>,
    /// The thin targets built on the pool (live or loaded): the thin id (which
    /// cannot be deleted) and the device whose table holds it (suspended with the
    /// pool). One entry per target.
    pub active: Vec<(u64, Weak<Device>)>,
    /// Discards of mapped blocks waiting for the I/O already in flight to the
    /// pool (which may still read or write those blocks) before they unmap.
    pub discards: Vec<Discard>,
    /// Each active thin's lock-free cache of mapped, unshared blocks.
    pub fast: HashMap<u64, Arc<fast::FastMap>>,
    /// The mappings inserted since the last commit, for a daemon started after
    /// this one is killed (`io::restart_log`); none without a run directory.
    restart: Option<RestartLog>,
    /// Records the restart log keeps room for: a mapping for each provisioning
    /// under way (written when its data has landed, before it is acknowledged).
    log_reserved: usize,
    /// Writes that found no room in the restart log: they wait for the commit
    /// that empties it (requeued after each commit, and where `no_space` is),
    /// so no write is acknowledged unrecorded.
    pub log_waiters: Vec<Pending>,
    /// Thins that had changes in a transaction a metadata failure aborted (the
    /// kernel's dm_thin_aborted_changes): what they wrote since the commit before
    /// is gone, so none of their flushes, nor the commit a FUA write asks for,
    /// may pass from then on, or a write whose mapping was dropped would be
    /// acknowledged as durable.
    pub aborted: std::collections::HashSet<u64>,
    /// Transactions a metadata failure dropped so far: a pool message whose
    /// commit is done by another thread learns from it whether its change was
    /// committed or rolled back (the pool is read-only either way then).
    pub aborts: u64,
}

impl PoolMd {
    /// The cache of thin `id`, made on first use with a slot per block of its
    /// `blocks` (up to a bound), and dropped with the thin's last table.
    pub fn fast_map(&mut self, id: u64, blocks: u64) -> Arc<fast::FastMap> {
        self.fast
            .entry(id)
            .or_insert_with(|| Arc::new(fast::FastMap::new(blocks)))
            .clone()
    }

    /// Forget the cached mapping of `vblock` of thin `id` (it is about to change).
    pub fn forget_block(&self, id: u64, vblock: u64) {
        if let Some(f) = self.fast.get(&id) {
            f.forget(vblock);
        }
    }

    /// Keep room in the restart log for the mapping of a provisioning about to
    /// start; false when there is none (the write waits for a commit).
    pub fn reserve_log_record(&mut self) -> bool {
        if self.log_room() == 0 {
            return false;
        }
        if self.restart.is_some() {
            self.log_reserved += 1;
        }
        true
    }

    /// A provisioning's reserved record is no longer needed (it was written,
    /// or the provisioning failed).
    pub fn release_log_record(&mut self) {
        if self.restart.is_some() {
            self.log_reserved = self.log_reserved.saturating_sub(1);
        }
    }

    /// Records that fit in the restart log besides those reserved (unbounded
    /// without a log).
    fn log_room(&self) -> usize {
        self.restart
            .as_ref()
            .map_or(usize::MAX, |l| l.room().saturating_sub(self.log_reserved))
    }

    /// Record an unmapping (a discard) about to be acknowledged, uncommitted.
    fn log_unmapping(&mut self, id: u64, vblock: u64, block: u64) -> bool {
        if self.log_room() == 0 {
            // inside a commit whose log is full: the commit makes it durable
            // before it is acknowledged, and a failed append would mark the log
            // overflowed, dropping the generation's other records
            return false;
        }
        match &mut self.restart {
            Some(l) => l.append(Record {
                kind: UNMAPPED,
                a: id,
                b: vblock,
                c: block,
                d: 0,
            }),
            None => true,
        }
    }

    /// Record a mapping about to be acknowledged, uncommitted (`io::restart_log`).
    /// False when the log is full (room was reserved for it: it is not).
    pub fn log_mapping(&mut self, id: u64, vblock: u64, block: u64) -> bool {
        let time = u64::from(self.md.time());
        // a commit between the block's allocation and its mapping committed the
        // allocation: the replay takes that reference over instead of a new one
        let kind = if self.md.data_block_in_use_at_commit(block) {
            MAPPED_ALLOCATED_BEFORE
        } else {
            MAPPED
        };
        match &mut self.restart {
            Some(l) => l.append(Record {
                kind,
                a: id,
                b: vblock,
                c: block,
                d: time,
            }),
            None => true,
        }
    }

    /// A commit landed: the restart log starts over on top of it.
    fn committed(&mut self) {
        let identity = self.md.committed_identity();
        if let Some(l) = &mut self.restart {
            l.begin(identity);
        }
    }

    /// Forget every cached mapping: a message changed the metadata (create_snap
    /// shares every block of its origin), or it was rolled back.
    pub fn forget_fast(&self) {
        for f in self.fast.values() {
            f.clear();
        }
    }
}

/// What a commit finishes once the pool lock is dropped.
enum Finish {
    /// Pieces that waited in a released cell.
    Requeue(Vec<Pending>),
    /// A deferred discard: passed down to the data block, done, or failed.
    Discard(Discard, Result<Option<u64>, i32>),
}

/// A discard of a mapped block, held in the prison (I/O arriving for the block
/// waits) until the pool's thread has drained the I/O that may still use the
/// block, then unmapped (the kernel waits on its all_io deferred set the same way).
pub struct Discard {
    pub id: u64,
    pub vblock: u64,
    pub piece: Pending,
    /// Where a passdown goes (the pool device).
    pub pool_dev: Dest,
}

/// A discard's passdown on its way to the data device: its data block, unmapped
/// and free in the metadata, is held out of allocation (in memory only, never
/// committed) until the passdown has finished, failed or been dropped unsent,
/// whichever the engine reports first; dropping the hold releases it too, so a
/// passdown that is never issued cannot keep its block forever.
struct PassdownHold {
    pool: Weak<Pool>,
    block: u64,
    released: AtomicBool,
}

impl PassdownHold {
    /// Never called with the pool lock held: the engine runs end_io hooks outside
    /// the targets' locks (as it does `device::Cell::finish`).
    fn release(&self) {
        if self.released.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(pool) = self.pool.upgrade() {
            let mut m = pool.lock();
            m.md.unhold_data_block(self.block);
            // what waited for space may have been waiting for this block
            pool.space_returned(&mut m);
        }
    }
}

impl Drop for PassdownHold {
    fn drop(&mut self) {
        self.release();
    }
}

pub struct Pool {
    /// Itself, for the holds of passdowns in flight.
    me: Weak<Pool>,
    /// Its timings, from the daemon's configuration.
    timing: Timing,
    md: Mutex<PoolMd>,
    /// The data device: a file, or a dmkit device (LVM's `_tdata`).
    pub data: Dest,
    /// The metadata device (named in messages, its size, a second handle for
    /// thin_ls): a file, or a dmkit device (LVM's `_tmeta`).
    pub metadata: Dest,
    pub block_sectors: u64,
    pub copier: Arc<Copier>,
    /// One commit at a time (the commit thread, control operations).
    commit_lock: Mutex<()>,
    /// Commits started (counted under the metadata lock) and completed so far.
    started: AtomicU64,
    commits: AtomicU64,
    /// Wakes the commit thread; apart from the pool so the thread waits on it
    /// without keeping the pool alive.
    commit_signal: Arc<CommitSignal>,
    /// The pool device, whose in-flight epochs a commit drains.
    pool_dev: Mutex<Weak<Device>>,
    /// Raised on low water and mode changes: the pool device's event counter.
    pub events: AtomicU64,
    stop: AtomicBool,
    /// The thin devices the pool's suspend suspended internally, for its resume.
    held_thins: Mutex<Vec<Arc<Device>>>,
}

/// A request for a commit, or for the commit thread to stop.
#[derive(Default)]
struct CommitSignal {
    /// (a commit is wanted, deferred unmaps wait)
    wanted: Mutex<(bool, bool)>,
    cv: Cond,
}

/// A pool's timings (`Config::thin_commit_period` and the rest), fixed when
/// it is made.
#[derive(Clone, Copy, Debug)]
struct Timing {
    commit_period: Duration,
    no_space_timeout: Duration,
    passdown_delay: Duration,
    discard_delay: Duration,
}

/// Live pools by their metadata file's identity.
type PoolList = Vec<((u64, u64), Weak<Pool>)>;

/// Live pools by their metadata file's identity, and the copy engine they share
/// (sub-job size from `--copy-subjob-kb`): part of the registry's shared state.
#[derive(Default)]
pub struct Pools {
    list: Mutex<PoolList>,
    copier: OnceLock<Arc<Copier>>,
}

impl Pools {
    /// The pools' copy engine (`subjob_bytes` from the first caller's config).
    fn copier(&self, subjob_bytes: usize) -> Arc<Copier> {
        self.copier
            .get_or_init(|| Arc::new(Copier::new(subjob_bytes, 8)))
            .clone()
    }

    fn list(&self) -> MutexGuard<'_, PoolList> {
        self.list.lock().unpoisoned()
    }

    /// The pool whose device is `dev` (what a thin's table names).
    pub fn owned_by(&self, dev: &Arc<Device>) -> Option<Arc<Pool>> {
        self.list().iter().filter_map(|(_, w)| w.upgrade()).find(|p| {
            let o = p.pool_dev.lock().unpoisoned().upgrade();
            o.is_some_and(|o| Arc::ptr_eq(&o, dev))
        })
    }

    /// Commit every live pool (daemon shutdown).
    pub fn commit_all(&self) {
        let all: Vec<Arc<Pool>> = self.list().iter().filter_map(|(_, w)| w.upgrade()).collect();
        for p in all {
            if let Err(e) = p.commit_now() {
                tracing::warn!("thin-pool {}: final commit failed: {e}", describe(&p.metadata));
            }
        }
    }
}

fn is_zeroed(d: &Dest) -> std::io::Result<bool> {
    let mut b = vec![0u8; 4096];
    devio::read(d, 0, &mut b)?;
    Ok(b.iter().all(|&x| x == 0))
}

impl Pool {
    /// The pool on `metadata` for the pool device `owner` (an existing one, after a
    /// table reload of that device), or a new one: opened from its superblock, or
    /// formatted when the metadata starts with a zeroed block (never with `read_only`).
    /// Another device's pool on the same metadata or data is refused (EBUSY in the
    /// kernel), and so is a reload that changes discard support.
    #[allow(clippy::too_many_arguments)]
    pub fn get(
        pools: &Pools,
        owner: &Arc<Device>,
        metadata: &Dest,
        data: &Dest,
        block_sectors: u64,
        nr_blocks: u64,
        features: Features,
        low_water: u64,
        config: &Config,
    ) -> Result<Arc<Pool>, TargetError> {
        let key = identity(metadata);
        wait_for_orphan(pools, key);
        let mut all = pools.list();
        all.retain(|(_, w)| w.strong_count() > 0);
        if let Some(p) = Self::existing(&all, owner, key, data, features, block_sectors)? {
            return Ok(p);
        }
        let mut md = Self::open_metadata(metadata, block_sectors, nr_blocks, features)?;
        let mode = if features.read_only || md.needs_check() {
            Mode::ReadOnly
        } else {
            Mode::Write
        };
        let restart = match config.restart_logs.as_deref() {
            Some(dir) if mode == Mode::Write => restart_log(&mut md, metadata, data, dir, key, config)?,
            _ => None,
        };
        let pool = Arc::new_cyclic(|me| Pool {
            me: me.clone(),
            md: Mutex::new(PoolMd {
                md,
                prison: HashMap::new(),
                no_space: Vec::new(),
                flush_waiters: Vec::new(),
                dirty: false,
                mode,
                features,
                low_water,
                low_water_hit: false,
                out_of_space_since: None,
                active: Vec::new(),
                discards: Vec::new(),
                fast: HashMap::new(),
                restart,
                log_reserved: 0,
                log_waiters: Vec::new(),
                aborted: std::collections::HashSet::new(),
                aborts: 0,
            }),
            data: data.clone(),
            metadata: metadata.clone(),
            block_sectors,
            copier: pools.copier(config.copy_subjob_bytes()),
            timing: Timing {
                commit_period: config.thin_commit_period,
                no_space_timeout: config.thin_no_space_timeout,
                passdown_delay: config.thin_passdown_delay,
                discard_delay: config.thin_discard_delay,
            },
            commit_lock: Mutex::new(()),
            started: AtomicU64::new(0),
            commits: AtomicU64::new(0),
            commit_signal: Arc::new(CommitSignal::default()),
            pool_dev: Mutex::new(Arc::downgrade(owner)),
            events: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            held_thins: Mutex::new(Vec::new()),
        });
        let (weak, signal) = (Arc::downgrade(&pool), pool.commit_signal.clone());
        crate::sync::spawn("thin-pool-commit", move || commit_worker(weak, signal))
            .map_err(|e| format!("starting the commit thread: {e}"))?;
        all.push((key, Arc::downgrade(&pool)));
        Ok(pool)
    }


    /// The live pool on `key`'s metadata, if there is one and `owner` may take
    /// it (a table reload of its device); Err if another device's pool holds
    /// that metadata or `data`, or the reload changes what cannot change.
    fn existing(
        all: &PoolList,
        owner: &Arc<Device>,
        key: (u64, u64),
        data: &Dest,
        features: Features,
        block_sectors: u64,
    ) -> Result<Option<Arc<Pool>>, TargetError> {
        let owned_elsewhere = |p: &Pool| {
            let o = p.pool_dev.lock().unpoisoned().upgrade();
            o.filter(|o| !Arc::ptr_eq(o, owner)).map(|o| o.name())
        };
        for (_, p) in all.iter().filter(|(k, _)| *k != key) {
            let Some(p) = p.upgrade().filter(|p| identity(&p.data) == identity(data)) else {
                continue;
            };
            if let Some(other) = owned_elsewhere(&p) {
                return Err(TargetError::busy(format!(
                    "Device or resource busy: data device already in use by the pool of device '{other}'"
                )));
            }
        }
        let Some(p) = all.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) else {
            return Ok(None);
        };
        if let Some(other) = owned_elsewhere(&p) {
            return Err(TargetError::busy(format!(
                "Device or resource busy: metadata device already in use by a pool (device '{other}')"
            )));
        }
        if p.lock().features.discard_enabled != features.discard_enabled {
            return Err("Discard support cannot be disabled once enabled".into());
        }
        // A reload: the new features, size and low water take effect at resume.
        if p.block_sectors != block_sectors {
            return Err(format!(
                "data block size {block_sectors} does not match the pool's {}",
                p.block_sectors
            ).into());
        }
        Ok(Some(p))
    }

    /// A new pool's metadata: opened from its superblock, or formatted when it
    /// starts with a zeroed block (never with `read_only`), and checked against
    /// the table's block size and data blocks.
    fn open_metadata(
        metadata: &Dest,
        block_sectors: u64,
        nr_blocks: u64,
        features: Features,
    ) -> Result<ThinPoolMetadata, TargetError> {
        // Writable whenever the file allows, so a read_only pool can be reloaded
        // read-write; read_only itself is the pool's mode.
        let dev = devio::metadata_dev(metadata).map_err(|e| format!("metadata device: {e}"))?;
        let fresh = is_zeroed(metadata).map_err(|e| format!("metadata device: {e}"))?;
        let md = if fresh {
            if features.read_only {
                return Err("read_only pool with unformatted metadata".into());
            }
            let opts = FormatOptions {
                data_block_size: block_sectors as u32,
                nr_data_blocks: nr_blocks,
                cache_blocks: CACHE_BLOCKS,
            };
            ThinPoolMetadata::format(dev, opts).map_err(|e| format!("formatting metadata: {e}"))?
        } else {
            ThinPoolMetadata::open(dev, CACHE_BLOCKS).map_err(|e| format!("opening metadata: {e}"))?
        };
        if u64::from(md.data_block_size()) != block_sectors {
            return Err(format!(
                "data block size {block_sectors} does not match the metadata's {}",
                md.data_block_size()
            ).into());
        }
        if nr_blocks < md.nr_data_blocks() {
            return Err(format!(
                "pool target ({nr_blocks} blocks) too small: the metadata has {} data blocks",
                md.nr_data_blocks()
            ).into());
        }
        Ok(md)
    }

    /// The metadata, locked. A lock a panicking thread left behind ends the
    /// daemon: the metadata may be half changed (crate::panics).
    pub fn lock(&self) -> MutexGuard<'_, PoolMd> {
        self.md
            .lock()
            .unwrap_or_else(|_| crate::panics::poisoned("a thin pool's metadata"))
    }

    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::SeqCst)
    }

    /// Ask the commit thread for a commit. Called with the metadata lock held (`_m`),
    /// so every change made so far is in the next commit to start; returns the commit
    /// count that, once reached, covers them.
    pub fn request_commit(&self, _m: &PoolMd) -> u64 {
        self.signal(|w| w.0 = true);
        self.started.load(Ordering::SeqCst) + 1
    }

    /// Queue the discard of a mapped block (the caller holds its prison cell) for
    /// the pool's thread.
    pub fn queue_discard(&self, m: &mut PoolMd, d: Discard) {
        m.forget_block(d.id, d.vblock);
        m.discards.push(d);
        self.signal(|w| w.1 = true);
    }

    /// Mark what the pool's thread is wanted for, and wake it.
    fn signal(&self, mark: impl FnOnce(&mut (bool, bool))) {
        let mut w = self.commit_signal.wanted.lock().unpoisoned();
        mark(&mut w);
        self.commit_signal.cv.notify_one();
    }

    /// Take the deferred discards and wait for the I/O that entered the pool
    /// device before: None (the discards put back) if it did not drain in time.
    fn take_drained_discards(&self) -> Option<Vec<Discard>> {
        let discards = std::mem::take(&mut self.lock().discards);
        if !discards.is_empty() && !self.timing.discard_delay.is_zero() {
            // a test hook: I/O arriving meanwhile meets the discards' prison cells
            crate::sync::sleep(self.timing.discard_delay);
        }
        let dev = self.pool_dev.lock().unpoisoned().upgrade();
        if dev.is_some_and(|d| !d.drain_epoch(Duration::from_millis(500))) {
            self.lock().discards.extend(discards);
            return None;
        }
        Some(discards)
    }

    /// Carry out the deferred discards without a commit (the next one, at most a
    /// period later, records them): a discard costs a drain of the I/O in flight,
    /// not a metadata commit. Pool's thread, or the control path.
    pub fn discard_now(&self) {
        let one = crate::sync::lock(&self.commit_lock);
        {
            let m = self.lock();
            if m.discards.is_empty() {
                return;
            }
            if m.log_room() < m.discards.len() {
                // no room to record the unmappings: a commit makes them durable
                // before they are acknowledged instead
                drop(m);
                drop(one);
                if let Err(e) = self.commit_now() {
                    tracing::warn!("thin-pool {}: commit for discards: {e}", describe(&self.metadata));
                }
                return;
            }
        }
        // not drained: tried again at the next commit or period
        if let Some(discards) = self.take_drained_discards() {
            let mut m = self.lock();
            let after = self.apply_deferred(&mut m, discards);
            drop(m);
            self.finish_deferred(after);
        }
    }

    /// Carry out deferred discards once the I/O that entered the pool device before
    /// they were deferred has finished: nothing then reads or writes the blocks
    /// they free (later I/O waits in the prison), so a block freed here and handed
    /// out again after a commit holds no stale I/O. Returns what to finish once
    /// the lock is dropped.
    fn apply_deferred(&self, m: &mut PoolMd, discards: Vec<Discard>) -> Vec<Finish> {
        let mut after = Vec::with_capacity(2 * discards.len());
        for j in discards {
            let waiters = m.prison.remove(&Key::Virtual(j.id, j.vblock));
            after.push(Finish::Requeue(waiters.unwrap_or_default()));
            if m.mode == Mode::ReadOnly || !m.md.devices().contains(&j.id) {
                // the pool failed meanwhile: the metadata takes no change (advisory)
                after.push(Finish::Discard(j, Ok(None)));
                continue;
            }
            let res = m.md.lookup(j.id, j.vblock).and_then(|found| {
                let Some(map) = found else { return Ok(None) };
                m.md.remove(j.id, j.vblock)?;
                Ok(Some(map.data_block))
            });
            let res = match res {
                Ok(Some(b)) => {
                    m.dirty = true;
                    // before the discard is acknowledged (a commit after this,
                    // if any, makes the record moot): a daemon started after this
                    // one is killed unmaps it again. discard_now saw the room.
                    m.log_unmapping(j.id, j.vblock, b);
                    // The data device may forget the block only if nothing else
                    // shares it, and the block is held out of allocation until the
                    // passdown has landed (PassdownHold): once a commit frees it, a
                    // new write could be given it, and a passdown arriving after
                    // that write would wipe it (the kernel's inc_data_range in
                    // process_prepared_discard_passdown_pt1).
                    let freed = m.md.data_block_ref_count(b) == 0;
                    let pass = freed && m.features.discard_passdown && m.md.hold_data_block(b);
                    Ok(pass.then_some(b))
                }
                Ok(None) => Ok(None),
                Err(e) => {
                    self.metadata_failed(m, &e);
                    Err(crate::io::errno::EIO)
                }
            };
            after.push(Finish::Discard(j, res));
        }
        self.space_returned(m);
        after
    }

    fn finish_deferred(&self, after: Vec<Finish>) {
        for f in after {
            match f {
                Finish::Requeue(waiters) => waiters.into_iter().for_each(Pending::requeue),
                Finish::Discard(j, Ok(Some(b))) => {
                    let bio = j.piece.bio();
                    let sector = b * self.block_sectors + bio.sector % self.block_sectors;
                    let bio = crate::mapper::Bio { sector, ..bio };
                    let hold = PassdownHold {
                        pool: self.me.clone(),
                        block: b,
                        released: AtomicBool::new(false),
                    };
                    let end_io: crate::io::EndIo = Arc::new(move |_, _: &mut [u8]| {
                        hold.release();
                        0
                    });
                    let delay = self.timing.passdown_delay;
                    if delay.is_zero() {
                        j.piece.remap(j.pool_dev, bio, Some(end_io));
                    } else {
                        let _ = crate::sync::spawn("thin-passdown", move || {
                            crate::sync::sleep(delay);
                            j.piece.remap(j.pool_dev, bio, Some(end_io));
                        });
                    }
                }
                Finish::Discard(j, Ok(None)) => j.piece.done(),
                Finish::Discard(j, Err(e)) => j.piece.fail(e),
            }
        }
    }

    /// Commit now, on this thread (control path, commit thread). Waits for the I/O
    /// that entered the pool before; never call it from an NBD connection thread.
    pub fn commit_now(&self) -> Result<(), TargetError> {
        match self.try_commit()? {
            true => Ok(()),
            false => Err(POSTPONED.into()),
        }
    }

    /// [`Pool::commit_now`], but a commit the I/O in flight keeps from starting
    /// (it did not drain in time) is Ok(false): postponed, not failed.
    fn try_commit(&self) -> Result<bool, TargetError> {
        let _one = crate::sync::lock(&self.commit_lock);
        // The discards deferred so far are carried out by this commit, after its drain.
        let Some(discards) = self.take_drained_discards() else {
            return Ok(false);
        };
        let mut m = self.lock();
        self.started.fetch_add(1, Ordering::SeqCst);
        let after = self.apply_deferred(&mut m, discards);
        let r = if !m.dirty || m.mode == Mode::ReadOnly {
            Ok(())
        } else if let Err(e) = devio::flush(&self.data) {
            // Zeroed and copied data must be on disk before the mappings that expose it.
            Err(format!("flushing the data device: {e}"))
        } else {
            match m.md.commit() {
                Ok(()) => {
                    m.dirty = false;
                    m.committed();
                    Ok(())
                }
                Err(e) => {
                    let msg = e.to_string();
                    self.metadata_failed(&mut m, &e);
                    Err(msg)
                }
            }
        };
        let done = self.commits.fetch_add(1, Ordering::SeqCst) + 1;
        // the restart log began a new generation: writes waiting for room go again
        let log_waiters = std::mem::take(&mut m.log_waiters);
        // Flushes this commit covers go on to the pool device (or fail with it).
        let (covered, later): (Vec<_>, Vec<_>) = std::mem::take(&mut m.flush_waiters)
            .into_iter()
            .partition(|w| w.0 <= done);
        m.flush_waiters = later;
        // A flush whose thin's changes a metadata failure dropped since it was
        // queued (the pool is read-only now, so this "commit" wrote nothing) fails.
        let covered: Vec<_> = covered
            .into_iter()
            .map(|(_, id, p, dest)| (!m.aborted.contains(&id), p, dest))
            .collect();
        drop(m);
        self.finish_deferred(after);
        log_waiters.into_iter().for_each(Pending::requeue);
        for (kept, p, dest) in covered {
            if r.is_ok() && kept {
                let bio = p.bio();
                p.remap(dest, bio, None);
            } else {
                p.fail(crate::io::errno::EIO);
            }
        }
        r.map(|()| true).map_err(TargetError::from)
    }

    /// Send every piece waiting for data space back to be mapped again: space came,
    /// the pool changed mode, or a device is suspending.
    pub fn requeue_no_space(&self) {
        let waiters = {
            let mut m = self.lock();
            let mut w = std::mem::take(&mut m.no_space);
            w.append(&mut m.log_waiters);
            w
        };
        for p in waiters {
            p.requeue();
        }
    }

    /// A metadata operation failed: out of metadata space or an I/O error turns the
    /// pool read-only with needs_check set (persisted if a commit still can).
    pub fn metadata_failed(&self, m: &mut PoolMd, e: &ThinError) {
        tracing::warn!(
            "thin-pool {}: metadata failure: {e}; switching to read-only",
            describe(&self.metadata)
        );
        if m.mode != Mode::ReadOnly {
            m.mode = Mode::ReadOnly;
            self.events.fetch_add(1, Ordering::Relaxed);
        }
        m.forget_fast();
        // (td->aborted_with_changes = td->changed, before the abort forgets them)
        let changed: Vec<u64> = m.md.devices().into_iter().filter(|&d| m.md.changed(d)).collect();
        m.aborted.extend(changed);
        m.aborts += 1;
        let _ = m.md.abort();
        m.md.set_needs_check(true);
        let _ = m.md.commit();
        m.dirty = false;
        // pieces waiting for space fail now (the pool takes no writes)
        for p in m.no_space.drain(..) {
            p.requeue();
        }
    }

    /// A data block for a new mapping. Err(true): out of space, wait; Err(false): fail.
    pub fn alloc(&self, m: &mut PoolMd) -> Result<u64, bool> {
        match m.md.alloc_data_block() {
            Ok(b) => {
                m.out_of_space_since = None;
                let free = m.md.nr_free_data_blocks();
                if free <= m.low_water && !m.low_water_hit {
                    m.low_water_hit = true;
                    self.events.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        "thin-pool {}: reached low water mark ({free} free data blocks)",
                        describe(&self.metadata)
                    );
                }
                Ok(b)
            }
            Err(ThinError::Pdata(PdataError::NoDataSpace { .. })) => {
                if m.mode == Mode::Write {
                    m.mode = Mode::OutOfDataSpace;
                    self.events.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("thin-pool {}: out of data space", describe(&self.metadata));
                }
                let since = *m.out_of_space_since.get_or_insert_with(crate::sync::now);
                if !m.features.error_if_no_space && crate::sync::since(since) >= self.timing.no_space_timeout {
                    // As the kernel's no_space_timeout: stop queueing, fail with
                    // ENOSPC from now on, and say so in the status.
                    m.features.error_if_no_space = true;
                    self.events.fetch_add(1, Ordering::Relaxed);
                }
                Err(!m.features.error_if_no_space)
            }
            Err(e) => {
                self.metadata_failed(m, &e);
                Err(false)
            }
        }
    }

    /// At the pool's suspend, before its own I/O drains: suspend every device with
    /// a thin target on this pool internally, without flushing (the kernel's
    /// pool_suspend_active_thins). Their presuspend sends the pieces waiting for
    /// space back to wait for the resume at the top, holding nothing, so neither
    /// suspend waits for space, whatever part of a request already went through
    /// the pool device. The user's suspend state of the thins does not change.
    pub fn suspend_active_thins(&self) {
        let mut devs: Vec<Arc<Device>> = Vec::new();
        for d in self.lock().active.iter().filter_map(|(_, w)| w.upgrade()) {
            if !devs.iter().any(|x| Arc::ptr_eq(x, &d)) {
                devs.push(d);
            }
        }
        // without the pool lock: the thins' presuspend and drain take it
        for d in &devs {
            d.internal_suspend_noflush();
        }
        self.held_thins.lock().unpoisoned().extend(devs);
    }

    /// At the pool's resume, once space has grown and what waited for it is
    /// requeued: resume the thins its suspend held (pool_resume_active_thins).
    pub fn resume_active_thins(&self) {
        let devs = std::mem::take(&mut *self.held_thins.lock().unpoisoned());
        for d in devs {
            d.internal_resume();
        }
    }

    /// At resume: the table's features and low water apply, the mode follows them
    /// (read_only, or back to read-write unless needs_check holds it), and the data and
    /// metadata space grow to the table's and the file's sizes (the kernel's
    /// maybe_resize_data_dev and maybe_resize_metadata_dev), committed at once.
    pub fn apply(&self, features: Features, low_water: u64, nr_blocks: u64) {
        {
            let mut m = self.lock();
            m.features = features;
            m.low_water = low_water;
            let mode = if features.read_only || m.md.needs_check() {
                Mode::ReadOnly
            } else if m.mode == Mode::ReadOnly {
                Mode::Write
            } else {
                m.mode
            };
            if mode != m.mode {
                m.mode = mode;
                self.events.fetch_add(1, Ordering::Relaxed);
            }
        }
        if self.grow(nr_blocks) {
            if let Err(e) = self.commit_now() {
                tracing::warn!(
                    "thin-pool {}: commit after growing: {e}",
                    describe(&self.metadata)
                );
            }
        }
        self.requeue_no_space();
    }

    /// Grow the data space to `nr_blocks` (a reloaded, larger pool table), and the
    /// metadata space to the metadata file's size; whether either grew.
    fn grow(&self, nr_blocks: u64) -> bool {
        let mut m = self.lock();
        if m.mode == Mode::ReadOnly {
            return false;
        }
        let mut grew = false;
        if nr_blocks > m.md.nr_data_blocks() {
            if m.md.needs_check() {
                tracing::warn!("thin-pool: not growing the data device: needs_check is set");
                return false;
            }
            match m.md.resize_data_dev(nr_blocks) {
                Ok(()) => {
                    m.dirty = true;
                    grew = true;
                    m.low_water_hit = false;
                    if m.mode == Mode::OutOfDataSpace {
                        m.mode = Mode::Write;
                        m.out_of_space_since = None;
                    }
                }
                Err(e) => self.metadata_failed(&mut m, &e),
            }
        }
        // A bigger metadata file grows the metadata space too.
        // (at most the largest metadata space, as the kernel uses only that much of
        // a bigger device)
        let meta_blocks = (devio::size_sectors(&self.metadata) / 8).min(crate::pdata::space_map::MAX_METADATA_BLOCKS);
        if meta_blocks > m.md.nr_metadata_blocks() {
            if let Err(e) = m.md.resize_metadata_dev(meta_blocks) {
                self.metadata_failed(&mut m, &e);
            } else {
                m.dirty = true;
                grew = true;
            }
        }
        grew
    }

    /// Free space came back (a delete, a discard): leave out-of-space mode.
    pub fn space_returned(&self, m: &mut PoolMd) {
        if m.mode == Mode::OutOfDataSpace && m.md.nr_free_data_blocks() > 0 {
            m.mode = Mode::Write;
            m.out_of_space_since = None;
            self.events.fetch_add(1, Ordering::Relaxed);
        }
        if !m.no_space.is_empty() && m.md.nr_free_data_blocks() > 0 {
            for p in m.no_space.drain(..) {
                // only posts to the waiting engines: safe under the lock
                p.requeue();
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.commit_signal.cv.notify_one();
        let m = self.md.get_mut().unpoisoned();
        let mut clean = !m.dirty;
        if m.dirty && m.mode != Mode::ReadOnly {
            clean = devio::flush(&self.data).is_ok() && m.md.commit().is_ok();
        }
        // everything committed: the pool's restart log has nothing to give
        if let Some(l) = m.restart.as_ref().filter(|_| clean) {
            l.remove();
        }
    }
}

/// Restart-log records: thin `a`'s block `b` mapped to data block `c` at time
/// `d`, the block allocated since the last commit (free in it) or before it
/// (committed as allocated and mapped by nothing).
const MAPPED: u32 = 1;
const MAPPED_ALLOCATED_BEFORE: u32 = 2;
/// Thin `a`'s block `b`, mapped to data block `c`, unmapped by a discard.
const UNMAPPED: u32 = 3;

/// A writable pool's restart log under `dir`: the last daemon's replayed into
/// `md` first, then a new one begun (None, with a warning, if it cannot be made).
fn restart_log(
    md: &mut ThinPoolMetadata,
    metadata: &Dest,
    data: &Dest,
    dir: &std::path::Path,
    key: (u64, u64),
    config: &Config,
) -> Result<Option<RestartLog>, TargetError> {
    let path = RestartLog::path(dir, "thin-pool", key);
    replay_restart_log(md, data, &path, &describe(metadata))?;
    // a generation maps each data block at most once (a block freed is not
    // handed out again before a commit) and unmaps at most each mapped block
    // once: twice the data blocks never waits
    let cap = config.restart_log_records.unwrap_or_else(|| {
        usize::try_from(md.nr_data_blocks())
            .unwrap_or(usize::MAX)
            .saturating_mul(2)
    });
    match RestartLog::create_on(&path, cap, devio::sim_of(metadata)) {
        Ok(mut l) => {
            l.begin(md.committed_identity());
            Ok(Some(l))
        }
        Err(e) => {
            tracing::warn!(
                "thin-pool {}: no restart log ({}: {e}): writes acknowledged and not yet committed are lost if the daemon is killed",
                describe(metadata),
                path.display()
            );
            Ok(None)
        }
    }
}

/// Map again what a killed daemon acknowledged and had not committed, when its
/// restart log follows the metadata as committed now, and commit it. A record
/// that does not fit (a device that does not exist, a data block out of range or
/// in use) is an error naming it, and nothing is replayed.
fn replay_restart_log(
    md: &mut ThinPoolMetadata,
    data: &Dest,
    log: &std::path::Path,
    path: &str,
) -> Result<(), TargetError> {
    let here = md.committed_identity();
    let records = match RestartLog::previous(log) {
        Previous::Records { identity, records } if identity == here && !records.is_empty() => records,
        Previous::Overflowed { identity } if identity == here => {
            tracing::warn!(
                "thin-pool {}: the previous daemon acknowledged more writes than its restart log holds and was killed before committing them: they are lost",
                path
            );
            return Ok(());
        }
        _ => return Ok(()),
    };
    let n = records.len();
    let apply = |md: &mut ThinPoolMetadata| -> Result<(), TargetError> {
        // blocks committed as allocated must be mapped by nothing yet
        let before: std::collections::HashSet<u64> = records
            .iter()
            .filter(|r| r.kind == MAPPED_ALLOCATED_BEFORE)
            .map(|r| r.c)
            .collect();
        if !before.is_empty() {
            let mut mapped = None;
            for dev in md.devices() {
                md.mappings_in(dev, 0, u64::MAX, &mut |v, d, _| {
                    if mapped.is_none() && before.contains(&d) {
                        mapped = Some((dev, v, d));
                    }
                })
                .map_err(|e| format!("reading thin {dev}'s mappings: {e}"))?;
            }
            if let Some((dev, v, d)) = mapped {
                return Err(format!(
                    "a record maps data block {d}, which thin {dev} maps already (its block {v})"
                ).into());
            }
        }
        for (i, r) in records.iter().enumerate() {
            let at = || {
                format!(
                    "restart log record {i} (thin {} block {} -> data block {})",
                    r.a, r.b, r.c
                )
            };
            if md.device_details(r.a).is_err() {
                return Err(format!("{}: no such thin device", at()).into());
            }
            let time = u32::try_from(r.d).map_err(|_| format!("{}: bad time {}", at(), r.d))?;
            let count = if r.c < md.nr_data_blocks() {
                md.data_block_ref_count(r.c)
            } else {
                u32::MAX
            };
            if r.kind == UNMAPPED {
                match md.lookup(r.a, r.b).map_err(|e| format!("{}: {e}", at()))? {
                    Some(m) if m.data_block == r.c => {
                        md.remove(r.a, r.b).map_err(|e| format!("{}: {e}", at()))?;
                        continue;
                    }
                    _ => return Err(format!("{}: unmapped, but the block does not map there", at()).into()),
                }
            }
            match (r.kind, count) {
                (MAPPED, 0) => md.insert_shared(r.a, r.b, r.c, time),
                (MAPPED_ALLOCATED_BEFORE, 1) => md.insert_with_time(r.a, r.b, r.c, time),
                (MAPPED | MAPPED_ALLOCATED_BEFORE, _) => {
                    return Err(format!("{}: the data block is out of range or in use", at()).into())
                }
                (k, _) => return Err(format!("{}: unknown kind {k}", at()).into()),
            }
            .map_err(|e| format!("{}: {e}", at()))?;
        }
        devio::flush(data).map_err(|e| format!("flushing the data device: {e}"))?;
        md.commit().map_err(|e| TargetError::from(format!("committing: {e}")))
    };
    if let Err(e) = apply(md) {
        let _ = md.abort();
        return Err(format!(
            "replaying the writes the previous daemon acknowledged: {e} (remove {} to open the pool without them)",
            log.display()
        ).into());
    }
    tracing::info!(
        "thin-pool {}: committed {n} block mappings and unmappings the previous daemon had acknowledged before it was killed",
        path
    );
    Ok(())
}

/// A pool on `key` whose device is gone is on its way out: something (an I/O
/// finishing, the commit thread at work) still holds it for a moment, and its
/// drop commits it one last time. Wait for that rather than take it up again:
/// a pool created anew on the same metadata (after thin_restore or a repair
/// swapped it) must read what is there then.
fn wait_for_orphan(pools: &Pools, key: (u64, u64)) {
    let orphan = || {
        pools
            .list()
            .iter()
            .filter(|(k, _)| *k == key)
            .filter_map(|(_, w)| w.upgrade())
            .any(|p| {
                let owner = p.pool_dev.lock().unpoisoned().upgrade();
                owner.is_none_or(|d| d.removed.load(Ordering::SeqCst))
            })
    };
    let t = crate::sync::now();
    while orphan() {
        if crate::sync::since(t) > Duration::from_secs(5) {
            tracing::warn!("thin-pool: a removed pool on the same metadata is still held after 5 s");
            return;
        }
        crate::sync::sleep(Duration::from_millis(1));
    }
}

/// The commit thread. It holds the pool only while it works, never while it
/// waits, so the pool goes (and commits for the last time) when its device's
/// table does, not up to a period later on this thread.
fn commit_worker(weak: Weak<Pool>, signal: Arc<CommitSignal>) {
    let dev = weak.upgrade().and_then(|p| {
        let d = p.pool_dev.lock().unpoisoned().upgrade();
        d
    });
    if let Some(d) = dev {
        // named in the log of a panic on this thread
        crate::panics::set_device(&d.name());
    }
    let mut last = crate::sync::now();
    // commits postponed in a row since (the I/O in flight did not drain in
    // time: slow I/O, or writes queued for space), and whether that was said
    let mut postponed: Option<(Instant, bool)> = None;
    loop {
        // a discard only wakes the thread: `discard_now` finds the work itself
        let (wanted, _) = {
            let mut w = signal.wanted.lock().unpoisoned();
            if *w == (false, false) {
                w = signal.cv.wait_timeout(&signal.wanted, w, Duration::from_millis(100)).0;
            }
            std::mem::take(&mut *w)
        };
        let Some(pool) = weak.upgrade() else { return };
        if pool.stop.load(Ordering::SeqCst) {
            return;
        }
        let (periodic, give_up) = {
            let m = pool.lock();
            // Pieces queued for space past the timeout go again, to fail (alloc
            // switches the pool to error_if_no_space).
            let expired = m
                .out_of_space_since
                .is_some_and(|t| crate::sync::since(t) >= pool.timing.no_space_timeout);
            (
                crate::sync::since(last) >= pool.timing.commit_period && m.dirty,
                !m.no_space.is_empty() && (expired || m.mode != Mode::OutOfDataSpace),
            )
        };
        if give_up {
            pool.requeue_no_space();
        }
        if wanted || periodic {
            match pool.try_commit() {
                Ok(true) => postponed = None,
                // one postponement is the next round's work; a run of them that
                // lasts is worth a warning, once
                Ok(false) => {
                    let (since, said) = postponed.get_or_insert((crate::sync::now(), false));
                    if !*said && crate::sync::since(*since) >= POSTPONED_WARN_AFTER {
                        *said = true;
                        tracing::warn!(
                            "thin-pool {}: commits postponed for {:?}: {POSTPONED}",
                            describe(&pool.metadata),
                            crate::sync::since(*since)
                        );
                    } else {
                        tracing::debug!("thin-pool {}: {POSTPONED}", describe(&pool.metadata));
                    }
                }
                Err(e) => tracing::warn!("thin-pool {}: commit failed: {e}", describe(&pool.metadata)),
            }
            last = crate::sync::now();
        } else {
            pool.discard_now();
        }
    }
}
