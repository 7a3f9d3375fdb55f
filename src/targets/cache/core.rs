//! The cache's running state: which origin block each cache block holds, the
//! blocks under migration (the kernel's bio prison: I/O to one waits), the
//! copies, and the metadata.
//!
//! The request path is a lookup and a remap under one lock: a hit goes to the
//! cache device, a miss to the origin. Every write, and every read of the
//! cache device, is counted in the current epoch (a hook made once, so the
//! path allocates nothing of its own); a migration locks its block, then waits
//! for the epoch it started in to drain, so it never copies under a write in
//! flight nor reuses a block a read is still reading.
//!
//! Commit rules, as the kernel's: a promotion, demotion or invalidation is
//! committed (after the device it copied to is flushed) before its block is
//! unlocked, so any mapping I/O can see is durable; dirty bits, hints and
//! statistics reach the metadata at a clean shutdown (suspend), which sets
//! the clean-shutdown flag; the first resume clears it. Opened after a dirty
//! shutdown, every mapped block counts as dirty and the hints are not used.

use crate::mapper::TargetError;
use super::policy::{vec_of, Op, Policy, Work};
use super::Features;
use crate::cache::CacheMetadata;
use crate::copier::Copier;
use crate::io::{errno, EndIo, Op as IoOp};
use crate::mapper::devio;
use crate::mapper::engine::{Dest, Pending};
use crate::mapper::{Bio, DevRef, MapCtx, MapErr};
use crate::sync::Unpoison;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How writes are cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoMode {
    /// To the cache only; the block is dirty until written back.
    Writeback,
    /// To the cache and the origin, completing when both have it.
    Writethrough,
    /// To the origin only; a cached copy is invalidated.
    Passthrough,
}

/// The longest the worker sleeps (the kernel's waker: policy tick, commit).
const WAKE_PERIOD: Duration = Duration::from_secs(1);
/// The device is idle once it has had no I/O for this long.
const IDLE_MS: u64 = 1000;
/// Discard blocks across the origin at most (the kernel's MAX_DISCARD_BLOCKS).
const MAX_DISCARD_BLOCKS: u64 = 1 << 14;

#[derive(Clone, Copy, Default)]
struct CEntry {
    oblock: u64,
    mapped: bool,
    dirty: bool,
}

#[derive(Clone, Copy, Default)]
struct Stats {
    read_hit: u32,
    read_miss: u32,
    write_hit: u32,
    write_miss: u32,
    demotion: u32,
    promotion: u32,
}

/// What is behind the lock the request path takes.
pub struct Core {
    map: HashMap<u64, u32>,
    entries: Vec<CEntry>,
    /// Origin blocks under migration, with the I/O waiting for them.
    locked: HashMap<u64, Vec<Pending>>,
    policy: Box<dyn Policy>,
    stats: Stats,
    nr_dirty: u64,
    /// Origin blocks known to be discarded, in discard blocks.
    discarded: Vec<u64>,
    discard_sectors: u64,
    nr_discard: u64,
    /// Passthrough writes to cached blocks: (origin block, cache block) to unmap.
    invalidations: Vec<(u64, u32)>,
    last_tick: u64,
    loaded: bool,
}

impl Core {
    pub fn new(
        policy: Box<dyn Policy>,
        nr_cache: u32,
        origin_sectors: u64,
        bs: u64,
    ) -> Result<Core, TargetError> {
        let n = nr_cache as usize;
        let mut map = HashMap::new();
        map.try_reserve(n)
            .map_err(|_| format!("no memory for {n} cache mappings"))?;
        // discard blocks: the cache block size, doubled while there are too many
        let mut ds = bs;
        while origin_sectors / ds > MAX_DISCARD_BLOCKS {
            ds *= 2;
        }
        let nr_discard = origin_sectors.div_ceil(ds);
        Ok(Core {
            map,
            entries: vec_of(n, CEntry::default(), "cache entries")?,
            locked: HashMap::new(),
            policy,
            stats: Stats::default(),
            nr_dirty: 0,
            discarded: vec_of(nr_discard.div_ceil(64) as usize, 0, "discard bits")?,
            discard_sectors: ds,
            nr_discard,
            invalidations: Vec::new(),
            last_tick: 0,
            loaded: false,
        })
    }

    fn discarded(&self, oblock: u64, bs: u64) -> bool {
        let d = oblock * bs / self.discard_sectors;
        self.discarded
            .get((d / 64) as usize)
            .is_some_and(|w| w & (1u64 << (d % 64)) != 0)
    }

    fn clear_discard(&mut self, oblock: u64, bs: u64) {
        let d = oblock * bs / self.discard_sectors;
        if let Some(w) = self.discarded.get_mut((d / 64) as usize) {
            *w &= !(1u64 << (d % 64));
        }
    }

    fn set_dirty(&mut self, c: u32, dirty: bool) {
        let Some(e) = self.entries.get_mut(c as usize) else {
            return;
        };
        if e.dirty != dirty {
            e.dirty = dirty;
            if dirty {
                self.nr_dirty += 1;
            } else {
                self.nr_dirty -= 1;
            }
            self.policy.set_dirty(c, dirty);
        }
    }

    fn unmap(&mut self, c: u32) {
        if let Some(e) = self.entries.get_mut(c as usize) {
            if e.mapped {
                self.map.remove(&e.oblock);
                if e.dirty {
                    self.nr_dirty -= 1;
                }
                *e = CEntry::default();
            }
        }
    }
}

/// The metadata and what the target knows of it.
struct Md {
    md: Option<CacheMetadata>,
    /// Dirty bits as the metadata has them.
    on_disk_dirty: Vec<bool>,
    failed: bool,
}

#[derive(Default)]
struct Signal {
    kick: bool,
    stop: bool,
}

/// The figures of a status line.
pub struct Counters {
    pub residency: u32,
    pub nr_cache: u64,
    pub read_hit: u32,
    pub read_miss: u32,
    pub write_hit: u32,
    pub write_miss: u32,
    pub demotion: u32,
    pub promotion: u32,
    pub nr_dirty: u64,
    pub policy_name: &'static str,
    pub policy_config: String,
    pub needs_check: bool,
    /// Writes fail since a metadata update failed (the kernel's read-only mode).
    pub read_only: bool,
}

pub struct Shared {
    core: Mutex<Core>,
    md: Mutex<Md>,
    signal: Mutex<Signal>,
    wake: crate::sync::Cond,
    /// Held by the worker while it migrates; a suspend waits for it.
    run: Mutex<()>,
    pub features: Features,
    pub bs: u64,
    origin_blocks: u64,
    nr_cache: u32,
    threshold: AtomicU64,
    origin: Dest,
    cache: Dest,
    copier: Copier,
    epoch: AtomicU64,
    inflight: [AtomicU64; 2],
    drain_lock: Mutex<()>,
    drained: crate::sync::Cond,
    /// The end-of-I/O hooks of the two epochs, made once.
    hooks: [EndIo; 2],
    start: Instant,
    last_io: AtomicU64,
    suspended: AtomicBool,
    failed: AtomicBool,
    /// Blocks were written back since the origin was last flushed.
    wb_unflushed: AtomicBool,
    worker: Mutex<Option<crate::sync::Thread<()>>>,
}

impl Shared {
    pub fn new(
        core: Core,
        features: Features,
        bs: u64,
        origin_blocks: u64,
        threshold: u64,
        origin: Dest,
        cache: Dest,
    ) -> Result<Arc<Shared>, TargetError> {
        let nr_cache = core.entries.len() as u32;
        let st = Arc::new_cyclic(|me: &Weak<Shared>| Shared {
            core: Mutex::new(core),
            md: Mutex::new(Md {
                md: None,
                on_disk_dirty: Vec::new(),
                failed: false,
            }),
            signal: Mutex::new(Signal::default()),
            wake: crate::sync::Cond::new(),
            run: Mutex::new(()),
            features,
            bs,
            origin_blocks,
            nr_cache,
            threshold: AtomicU64::new(threshold),
            origin,
            cache,
            copier: Copier::new(0, 0),
            epoch: AtomicU64::new(0),
            inflight: [AtomicU64::new(0), AtomicU64::new(0)],
            drain_lock: Mutex::new(()),
            drained: crate::sync::Cond::new(),
            hooks: {
                let hook = |e: usize| -> EndIo {
                    let me = me.clone();
                    Arc::new(move |_ok, _d: &mut [u8]| {
                        if let Some(s) = me.upgrade() {
                            s.leave(e);
                        }
                        0
                    })
                };
                [hook(0), hook(1)]
            },
            start: crate::sync::now(),
            last_io: AtomicU64::new(0),
            suspended: AtomicBool::new(true),
            failed: AtomicBool::new(false),
            wb_unflushed: AtomicBool::new(false),
            worker: Mutex::new(None),
        });
        let s = Arc::downgrade(&st);
        let h = crate::sync::spawn("dmkit-cache", move || work(s))
            .map_err(|e| format!("could not create the cache worker: {e}"))?;
        *st.worker.lock().unpoisoned() = Some(h);
        Ok(st)
    }

    fn now_ms(&self) -> u64 {
        crate::sync::since(self.start).as_millis() as u64
    }

    pub fn migration_threshold(&self) -> u64 {
        self.threshold.load(Ordering::Relaxed)
    }

    fn kick(&self) {
        self.signal.lock().unpoisoned().kick = true;
        self.wake.notify_one();
    }

    /// Count `n` I/Os in the current epoch (call with the core locked): the
    /// epoch, and the hook that ends one of them.
    fn enter(&self, n: u64) -> (usize, EndIo) {
        let e = (self.epoch.load(Ordering::SeqCst) & 1) as usize;
        self.inflight[e].fetch_add(n, Ordering::SeqCst);
        (e, self.hooks[e].clone())
    }

    fn leave(&self, e: usize) {
        if self.inflight[e].fetch_sub(1, Ordering::SeqCst) == 1 {
            let _g = self.drain_lock.lock().unpoisoned();
            self.drained.notify_all();
        }
    }

    /// Start a new epoch and wait until every I/O of the previous one is done.
    fn drain_epoch(&self) {
        let old = (self.epoch.fetch_add(1, Ordering::SeqCst) & 1) as usize;
        let mut g = self.drain_lock.lock().unpoisoned();
        while self.inflight[old].load(Ordering::SeqCst) != 0 {
            g = self
                .drained
                .wait_timeout(&self.drain_lock, g, Duration::from_millis(10))
                .0;
        }
    }

    // ---- the request path ----

    pub fn map_io(&self, bio: Bio, ctx: &mut MapCtx, origin: &DevRef, cache: &DevRef) -> Result<(), MapErr> {
        let bs = self.bs;
        let b = bio.sector / bs;
        let write = bio.op == IoOp::Write;
        if b >= self.origin_blocks {
            // the partial block at the origin's end is never cached
            return ctx.remap(origin, bio, 0);
        }
        if write && self.failed.load(Ordering::Relaxed) {
            return Err(MapErr::Errno(errno::EIO));
        }
        let now = self.now_ms();
        self.last_io.store(now, Ordering::Relaxed);
        let mut core = self.core.lock().unpoisoned();
        if let Some(waiters) = core.locked.get_mut(&b) {
            waiters.push(ctx.submit(bio));
            return Ok(());
        }
        if now > core.last_tick {
            core.last_tick = now;
            core.policy.tick(now);
        }
        let hit = core.map.get(&b).copied();
        // the kernel's optimisable bio: promoted at once while blocks are free
        let fast = write
            && self.features.mode == IoMode::Writeback
            && ((bio.sector.is_multiple_of(bs) && bio.nr_sectors == bs) || core.discarded(b, bs));
        let queued = core.policy.lookup(b, hit, write, fast);
        let Some(c) = hit else {
            if write {
                core.stats.write_miss = core.stats.write_miss.wrapping_add(1);
                core.clear_discard(b, bs);
            } else {
                core.stats.read_miss = core.stats.read_miss.wrapping_add(1);
            }
            let hook = write.then(|| self.enter(1).1);
            drop(core);
            if queued {
                self.kick();
            }
            return match hook {
                Some(h) => ctx.remap_with(origin, bio, 0, h),
                None => ctx.remap(origin, bio, 0),
            };
        };
        if write {
            core.stats.write_hit = core.stats.write_hit.wrapping_add(1);
            core.clear_discard(b, bs);
        } else {
            core.stats.read_hit = core.stats.read_hit.wrapping_add(1);
        }
        let to_cache = Bio {
            sector: u64::from(c) * bs + bio.sector % bs,
            ..bio
        };
        let dirty = core.entries[c as usize].dirty;
        match self.features.mode {
            IoMode::Passthrough if write => {
                // unmapped (and committed) before the write goes to the origin
                core.stats.demotion = core.stats.demotion.wrapping_add(1);
                let p = ctx.submit(bio);
                core.locked.insert(b, vec![p]);
                core.invalidations.push((b, c));
                drop(core);
                self.kick();
                Ok(())
            }
            IoMode::Passthrough => {
                drop(core);
                ctx.remap(origin, bio, 0)
            }
            IoMode::Writethrough if write && !dirty => {
                // to both, completing when both have it: two shares of the epoch
                let (e, hook) = self.enter(2);
                drop(core);
                if let Err(err) = ctx.remap_with(origin, bio, 0, hook.clone()) {
                    // the cache's share is never issued
                    self.leave(e);
                    return Err(err);
                }
                ctx.remap_with(cache, to_cache, 1, hook)
            }
            _ => {
                if write && !dirty {
                    core.set_dirty(c, true);
                }
                let (_, hook) = self.enter(1);
                drop(core);
                if queued {
                    self.kick();
                }
                ctx.remap_with(cache, to_cache, 1, hook)
            }
        }
    }

    /// A discard: the discard blocks it covers whole are discarded.
    pub fn discard(&self, bio: &Bio) {
        let mut core = self.core.lock().unpoisoned();
        let ds = core.discard_sectors;
        let first = bio.sector.div_ceil(ds);
        let end = ((bio.sector + bio.nr_sectors) / ds).min(core.nr_discard);
        for d in first..end {
            if let Some(w) = core.discarded.get_mut((d / 64) as usize) {
                *w |= 1u64 << (d % 64);
            }
        }
    }

    // ---- status and messages ----

    pub fn metadata_usage(&self) -> Option<(u64, u64)> {
        let m = self.md.lock().unpoisoned();
        if m.failed {
            return None;
        }
        let md = m.md.as_ref()?;
        Some((md.nr_allocated(), md.nr_metadata_blocks()))
    }

    pub fn counters(&self) -> Counters {
        let needs_check = {
            let m = self.md.lock().unpoisoned();
            m.md.as_ref().is_some_and(|md| md.superblock().flags & crate::cache::superblock::NEEDS_CHECK != 0)
        };
        let core = self.core.lock().unpoisoned();
        let s = core.stats;
        Counters {
            residency: core.policy.residency(),
            nr_cache: u64::from(self.nr_cache),
            read_hit: s.read_hit,
            read_miss: s.read_miss,
            write_hit: s.write_hit,
            write_miss: s.write_miss,
            demotion: s.demotion,
            promotion: s.promotion,
            nr_dirty: core.nr_dirty,
            policy_name: core.policy.name(),
            policy_config: core.policy.emit_config(),
            needs_check,
            read_only: self.failed.load(Ordering::SeqCst),
        }
    }

    pub fn set_config(&self, key: &str, value: &str) -> Result<(), TargetError> {
        let mut core = self.core.lock().unpoisoned();
        let mut t = self.migration_threshold();
        super::set_config_value(&mut t, core.policy.as_mut(), key, value)?;
        self.threshold.store(t, Ordering::Relaxed);
        drop(core);
        self.kick();
        Ok(())
    }

    /// Unmap the cache blocks of `range` (passthrough), committed.
    pub fn invalidate_cblocks(&self, range: std::ops::Range<u32>) -> Result<(), TargetError> {
        let mut m = self.md.lock().unpoisoned();
        let mut core = self.core.lock().unpoisoned();
        for c in range {
            let e = core.entries[c as usize];
            if !e.mapped || core.locked.contains_key(&e.oblock) {
                continue;
            }
            if let Some(md) = m.md.as_mut() {
                md.remove(u64::from(c))
                    .map_err(|e| format!("invalidation failed; couldn't update on disk metadata: {e}"))?;
            }
            if let Some(d) = m.on_disk_dirty.get_mut(c as usize) {
                *d = false;
            }
            core.policy.invalidate(c);
            core.unmap(c);
        }
        drop(core);
        commit(&mut m, false)
    }

    // ---- resume, suspend ----

    pub fn preresume(&self, open: impl FnOnce() -> Result<CacheMetadata, TargetError>, cache_dev: &DevRef) -> Result<(), TargetError> {
        let mut m = self.md.lock().unpoisoned();
        let mut core = self.core.lock().unpoisoned();
        if !core.loaded {
            let csize = cache_dev.size_sectors() / self.bs;
            if csize != u64::from(self.nr_cache) {
                return Err(format!(
                    "unable to resize the cache from {} to {csize} blocks without a table reload",
                    self.nr_cache
                ).into());
            }
            // what a table before this one committed counts
            let mut md = open().map_err(|e| format!("could not load cache mappings: {e}"))?;
            load(&mut core, &mut md, &mut m.on_disk_dirty, self.nr_cache, self.origin_blocks)?;
            md.resize_discards(core.discard_sectors, core.nr_discard)
                .map_err(|e| format!("could not resize on-disk discard bitset: {e}"))?;
            m.md = Some(md);
            core.loaded = true;
        }
        drop(core);
        // running: the metadata no longer says the shutdown was clean
        commit(&mut m, false)?;
        m.failed = false;
        self.failed.store(false, Ordering::SeqCst);
        self.suspended.store(false, Ordering::SeqCst);
        drop(m);
        self.kick();
        Ok(())
    }

    pub fn postsuspend(&self) {
        self.suspended.store(true, Ordering::SeqCst);
        // the worker's batch under way finishes first
        let _run = crate::sync::lock(&self.run);
        self.sync_metadata();
    }

    /// Dirty bits, discards, statistics and hints to the metadata, and a
    /// commit that says the shutdown was clean (unless one of them failed).
    fn sync_metadata(&self) {
        let mut m = self.md.lock().unpoisoned();
        if m.failed || m.md.is_none() {
            return;
        }
        // the blocks written back are on the origin before the metadata says
        // they are clean
        if self.wb_unflushed.swap(false, Ordering::SeqCst) {
            if let Err(e) = devio::flush(&self.origin) {
                tracing::error!("cache: flushing the origin after writebacks failed: {e}");
                self.wb_unflushed.store(true, Ordering::SeqCst);
                if let Err(e) = commit(&mut m, false) {
                    tracing::error!("cache: could not write cache metadata: {e}");
                }
                return;
            }
        }
        let core = self.core.lock().unpoisoned();
        let r = (|| -> Result<(), TargetError> {
            let Md { md, on_disk_dirty, .. } = &mut *m;
            let Some(md) = md.as_mut() else { return Ok(()) };
            for (c, e) in core.entries.iter().enumerate() {
                if e.mapped && on_disk_dirty.get(c).copied() != Some(e.dirty) {
                    md.set_dirty(c as u64, e.dirty)
                        .map_err(|e| format!("could not write dirty bitset: {e}"))?;
                    if let Some(d) = on_disk_dirty.get_mut(c) {
                        *d = e.dirty;
                    }
                }
            }
            for d in 0..core.nr_discard {
                let bit = core.discarded.get((d / 64) as usize).is_some_and(|w| w & (1 << (d % 64)) != 0);
                md.set_discard(d, bit)
                    .map_err(|e| format!("could not write discard bitset: {e}"))?;
            }
            let s = core.stats;
            md.set_stats([s.read_hit, s.read_miss, s.write_hit, s.write_miss]);
            let hints: Vec<u32> = (0..self.nr_cache).map(|c| core.policy.hint(c)).collect();
            md.save_hints(core.policy.name(), core.policy.version(), Some(&hints))
                .map_err(|e| format!("could not write hints: {e}"))?;
            Ok(())
        })();
        drop(core);
        if let Err(e) = &r {
            tracing::error!("cache: {e}");
        }
        if let Err(e) = commit(&mut m, r.is_ok()) {
            tracing::error!("cache: could not write cache metadata: {e}");
        }
    }

    pub fn shut_down(&self) {
        if !self.suspended.load(Ordering::SeqCst) {
            self.postsuspend();
        }
        self.signal.lock().unpoisoned().stop = true;
        self.wake.notify_all();
        if let Some(h) = self.worker.lock().unpoisoned().take() {
            let _ = h.join();
        }
    }

    // ---- the worker ----

    /// Passthrough writes waiting for their block to be unmapped.
    fn run_invalidations(&self) {
        let mut core = self.core.lock().unpoisoned();
        if core.invalidations.is_empty() {
            return;
        }
        let inv = std::mem::take(&mut core.invalidations);
        drop(core);
        let mut m = self.md.lock().unpoisoned();
        let mut ok = true;
        for &(_, c) in &inv {
            if let Some(md) = m.md.as_mut() {
                if let Err(e) = md.remove(u64::from(c)) {
                    tracing::error!("cache: invalidation failed; couldn't update on disk metadata: {e}");
                    ok = false;
                }
            }
            if let Some(d) = m.on_disk_dirty.get_mut(c as usize) {
                *d = false;
            }
        }
        ok = ok && commit(&mut m, false).is_ok();
        drop(m);
        let mut core = self.core.lock().unpoisoned();
        let mut waiters = Vec::new();
        for (b, c) in inv {
            if ok {
                core.policy.invalidate(c);
                core.unmap(c);
            }
            waiters.extend(core.locked.remove(&b).unwrap_or_default());
        }
        drop(core);
        self.finish_waiters(waiters, ok);
    }

    fn finish_waiters(&self, waiters: Vec<Pending>, ok: bool) {
        if !ok {
            self.failed.store(true, Ordering::SeqCst);
        }
        for p in waiters {
            if ok || p.bio().op != IoOp::Write {
                p.requeue();
            } else {
                p.fail(errno::EIO);
            }
        }
    }

    /// One batch of background work: lock the blocks, drain, copy, flush,
    /// update and commit the metadata, unlock. Whether there was any.
    // Long: one batch from lock to unlock, in the order a crash must see it
    // (lock, drain, copy, flush, update, commit, unlock), every step on the
    // batch's own state.
    fn migrate(&self) -> bool {
        let idle = self.now_ms().saturating_sub(self.last_io.load(Ordering::Relaxed)) >= IDLE_MS;
        let budget = (self.migration_threshold() / self.bs).max(1) as usize;
        let mut batch: Vec<Work> = Vec::new();
        {
            let mut core = self.core.lock().unpoisoned();
            while batch.len() < budget {
                let Some(w) = core.policy.background_work(idle) else {
                    break;
                };
                let e = core.entries.get(w.cblock as usize).copied().unwrap_or_default();
                let valid = match w.op {
                    Op::Promote => !core.map.contains_key(&w.oblock) && !e.mapped && w.oblock < self.origin_blocks,
                    Op::Demote => e.mapped && e.oblock == w.oblock && !e.dirty,
                    Op::Writeback => e.mapped && e.oblock == w.oblock && e.dirty,
                };
                if !valid || core.locked.contains_key(&w.oblock) {
                    core.policy.complete(w, false);
                    continue;
                }
                core.locked.insert(w.oblock, Vec::new());
                batch.push(w);
            }
        }
        if batch.is_empty() {
            return false;
        }
        self.drain_epoch();
        let bs = self.bs;
        // the writebacks as one copy, in the policy's order (the cleaner's is
        // by origin block): runs of origin blocks become large writes
        let wbs: Vec<(u64, u64, u64)> = batch
            .iter()
            .filter(|w| w.op == Op::Writeback)
            .map(|w| (u64::from(w.cblock) * bs, w.oblock * bs, bs))
            .collect();
        let wb_ok = wbs.is_empty()
            || devio::copy_regions(&self.copier, &self.cache, &self.origin, &wbs)
                .map_err(|e| tracing::error!("cache: writing back {} blocks failed: {e}", wbs.len()))
                .is_ok();
        let mut done: Vec<(Work, bool)> = Vec::with_capacity(batch.len());
        let (mut promoted, mut written, mut unmapped) = (false, false, false);
        for w in batch {
            let (o, c) = (w.oblock * bs, u64::from(w.cblock) * bs);
            let r = match w.op {
                Op::Promote => devio::copy(&self.copier, &self.origin, o, &self.cache, c, bs, false),
                Op::Writeback => Ok(()),
                Op::Demote => Ok(()),
            };
            if let Err(e) = &r {
                tracing::error!("cache: {:?} of origin block {} failed: {e}", w.op, w.oblock);
            }
            let ok = r.is_ok() && (w.op != Op::Writeback || wb_ok);
            promoted |= ok && w.op == Op::Promote;
            written |= ok && w.op == Op::Writeback;
            unmapped |= w.op == Op::Demote;
            done.push((w, ok));
        }
        // what the metadata will point at is durable first
        if promoted {
            if let Err(e) = devio::flush(&self.cache) {
                tracing::error!("cache: flushing the cache device failed: {e}");
                done.iter_mut().filter(|d| d.0.op == Op::Promote).for_each(|d| d.1 = false);
            }
        }
        if written {
            // flushed before a metadata commit that relies on it: a demotion's
            // (below) or the clean shutdown's (sync_metadata); until then the
            // metadata still has the block dirty, or every block is taken as
            // dirty after a crash
            self.wb_unflushed.store(true, Ordering::SeqCst);
        }
        if unmapped {
            if let Err(e) = devio::flush(&self.origin) {
                tracing::error!("cache: flushing the origin failed: {e}");
                done.iter_mut()
                    .filter(|d| d.0.op != Op::Promote)
                    .for_each(|d| d.1 = false);
            }
        }
        let mut m = self.md.lock().unpoisoned();
        let mut md_ok = true;
        let mut changed = false;
        for (w, ok) in done.iter_mut() {
            if !*ok {
                continue;
            }
            let Some(md) = m.md.as_mut() else {
                *ok = false;
                continue;
            };
            let r = match w.op {
                Op::Promote => md.insert(u64::from(w.cblock), w.oblock),
                Op::Demote => md.remove(u64::from(w.cblock)),
                Op::Writeback => Ok(()),
            };
            if let Err(e) = r {
                tracing::error!("cache: metadata update for origin block {} failed: {e}", w.oblock);
                *ok = false;
                md_ok = false;
                continue;
            }
            if w.op != Op::Writeback {
                changed = true;
                if let Some(d) = m.on_disk_dirty.get_mut(w.cblock as usize) {
                    *d = false;
                }
            }
        }
        if changed && commit(&mut m, false).is_err() {
            md_ok = false;
            done.iter_mut().filter(|d| d.0.op != Op::Writeback).for_each(|d| d.1 = false);
        }
        if !md_ok {
            m.failed = true;
        }
        drop(m);
        let mut core = self.core.lock().unpoisoned();
        let mut waiters = Vec::new();
        for (w, ok) in done {
            if ok {
                match w.op {
                    Op::Promote => {
                        core.entries[w.cblock as usize] = CEntry {
                            oblock: w.oblock,
                            mapped: true,
                            dirty: false,
                        };
                        core.map.insert(w.oblock, w.cblock);
                        core.stats.promotion = core.stats.promotion.wrapping_add(1);
                    }
                    Op::Demote => {
                        core.unmap(w.cblock);
                        core.stats.demotion = core.stats.demotion.wrapping_add(1);
                    }
                    Op::Writeback => {
                        let e = &mut core.entries[w.cblock as usize];
                        if e.dirty {
                            e.dirty = false;
                            core.nr_dirty -= 1;
                        }
                    }
                }
            }
            core.policy.complete(w, ok);
            waiters.extend(core.locked.remove(&w.oblock).unwrap_or_default());
        }
        drop(core);
        self.finish_waiters(waiters, md_ok);
        true
    }
}

/// Commit the metadata (if open); a failure fails the metadata from then on.
fn commit(m: &mut Md, clean: bool) -> Result<(), TargetError> {
    let Some(md) = m.md.as_mut() else { return Ok(()) };
    md.commit(clean).map_err(|e| {
        m.failed = true;
        format!("could not write cache metadata: {e}")
    }).map_err(TargetError::from)
}

/// Load the mappings of `md` into the core and its policy: dirty as the
/// metadata says after a clean shutdown (all of them otherwise), hints when
/// they were saved by this policy at a clean shutdown. Mappings past the
/// origin's end are dropped, unless dirty.
fn load(core: &mut Core, md: &mut CacheMetadata, on_disk: &mut Vec<bool>, nr_cache: u32, origin_blocks: u64) -> Result<(), TargetError> {
    if md.nr_cache_blocks() != u64::from(nr_cache) {
        md.resize(u64::from(nr_cache))
            .map_err(|e| format!("could not resize cache metadata: {e}"))?;
    }
    let sb = md.superblock().clone();
    let clean = sb.clean_shutdown();
    let hints = if clean
        && sb.policy() == core.policy.name()
        && sb.policy_version[0] == core.policy.version()[0]
        && sb.policy_hint_size == crate::cache::superblock::HINT_SIZE
    {
        md.hints().map_err(|e| format!("could not load hints: {e}"))?
    } else {
        Vec::new()
    };
    let hints_valid = hints.len() == nr_cache as usize;
    *on_disk = vec_of(nr_cache as usize, false, "dirty bits")?;
    let mappings = md.mappings().map_err(|e| e.to_string())?;
    core.stats = Stats::from_superblock(&sb);
    for m in mappings {
        let c = m.cblock as usize;
        if m.oblock >= origin_blocks {
            if m.dirty {
                return Err(format!("unable to shrink origin; cache block {} is dirty", m.cblock).into());
            }
            md.remove(c as u64)
                .map_err(|e| format!("invalidation failed; couldn't update on disk metadata: {e}"))?;
            continue;
        }
        on_disk[c] = m.dirty;
        let dirty = !clean || m.dirty;
        core.entries[c] = CEntry {
            oblock: m.oblock,
            mapped: true,
            dirty,
        };
        core.nr_dirty += u64::from(dirty);
        core.map.insert(m.oblock, m.cblock);
        let hint = hints_valid.then(|| hints[c]);
        core.policy.load_mapping(m.oblock, m.cblock, dirty, hint);
    }
    Ok(())
}

impl Stats {
    fn from_superblock(sb: &crate::cache::superblock::Superblock) -> Stats {
        Stats {
            read_hit: sb.read_hits,
            read_miss: sb.read_misses,
            write_hit: sb.write_hits,
            write_miss: sb.write_misses,
            ..Stats::default()
        }
    }
}

/// The worker: background work, invalidations, the policy's tick.
fn work(me: Weak<Shared>) {
    let mut last_tick = crate::sync::now();
    let mut busy = false;
    loop {
        let Some(st) = me.upgrade() else { return };
        {
            let mut g = st.signal.lock().unpoisoned();
            if !g.kick && !g.stop && !busy {
                g = st.wake.wait_timeout(&st.signal, g, WAKE_PERIOD).0;
            }
            if g.stop {
                return;
            }
            g.kick = false;
        }
        let _run = crate::sync::lock(&st.run);
        if st.suspended.load(Ordering::SeqCst) {
            busy = false;
            continue;
        }
        if crate::sync::since(last_tick) >= WAKE_PERIOD {
            last_tick = crate::sync::now();
            let now = st.now_ms();
            let mut core = st.core.lock().unpoisoned();
            core.last_tick = now;
            core.policy.tick(now);
        }
        st.run_invalidations();
        busy = st.migrate();
    }
}
