//! Cache policies, behind one small trait so the target never knows which one
//! runs: `smq` (the kernel's stochastic multiqueue; `mq` and `default` are its
//! aliases, as in the kernel) and `cleaner` (writes every dirty block back and
//! promotes nothing: how LVM retires a cache).
//!
//! smq keeps every cache block's entry in one of two multiqueues (clean and
//! dirty) of 64 levels, a block moving up a level on its first hit of a cache
//! period; a hotspot queue (also 64 levels) tracks regions of the origin that
//! are not cached, each miss lifting its region by the level jump once a tick.
//! Once a second the hotspot queue is redistributed across its levels (the
//! hottest regions end up at the top) and the promotion level follows how well
//! the hotspot queue predicts (poor: only its top quarter, fair: top half,
//! well: anything); every minute the cache queues are redistributed. A miss on
//! a hot enough region queues a promotion into a free block; with none free,
//! a demotion of the coldest clean block (from the bottom half of the levels)
//! until a quarter of the cache is free. When idle, dirty blocks are written
//! back, coldest first; under pressure only those not written to since the
//! writeback sentinels last moved (two sets a level, one of them moved to the
//! end of its level every 10 s; the demotion sentinels every minute). A hit
//! lifts a block a level and drops the first block of that level into its
//! place. A block's level is its hint, saved on a clean shutdown and loaded
//! again, so a restarted cache keeps its hot set.

use crate::mapper::TargetError;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

/// Levels of each multiqueue (the kernel's NR_CACHE_LEVELS, NR_HOTSPOT_LEVELS).
pub const NR_LEVELS: usize = 64;
const NIL: u32 = u32::MAX;
/// Background work queued at most (the kernel's background tracker size).
const MAX_WORK: usize = 4096;
/// Free blocks (with demotions queued) a full cache aims for, in percent.
const FREE_TARGET: u64 = 25;
const HOTSPOT_UPDATE_MS: u64 = 1000;
/// How often the writeback and demotion sentinels move (the kernel's
/// WRITEBACK_PERIOD, DEMOTE_PERIOD).
const WRITEBACK_PERIOD_MS: u64 = 10_000;
const DEMOTE_PERIOD_MS: u64 = 60_000;
const CACHE_UPDATE_MS: u64 = 60_000;
/// Fixed point of the hotspot queue's confidence.
const FP_SHIFT: u32 = 8;

/// What a policy asks the target to do in the background.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Copy the origin block into the (free, reserved) cache block and map it.
    Promote,
    /// Unmap the (clean) cache block.
    Demote,
    /// Copy the dirty cache block to the origin; it is clean afterwards.
    Writeback,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Work {
    pub op: Op,
    pub oblock: u64,
    pub cblock: u32,
}

/// A cache policy: it decides what is promoted, demoted and written back; the
/// target keeps the mappings and does the copies.
pub trait Policy: Send {
    /// The name the status and the metadata give it.
    fn name(&self) -> &'static str;
    fn version(&self) -> [u32; 3];
    /// An I/O to `oblock`, cached in `hit` (if it is): returns whether
    /// background work was queued. `fast`: a writeback-mode write that covers
    /// the whole block or lands on a discarded one (the kernel's optimisable
    /// bio), promoted at once while free cache blocks remain.
    fn lookup(&mut self, oblock: u64, hit: Option<u32>, write: bool, fast: bool) -> bool;
    /// The next background work; `idle`: the device has had no I/O for a second.
    fn background_work(&mut self, idle: bool) -> Option<Work>;
    /// `w` is done (`ok`) or abandoned.
    fn complete(&mut self, w: Work, ok: bool);
    fn set_dirty(&mut self, cblock: u32, dirty: bool);
    /// A mapping found in the metadata, with its saved hint if it is valid.
    fn load_mapping(&mut self, oblock: u64, cblock: u32, dirty: bool, hint: Option<u32>);
    /// Forget a mapping (the target unmapped it).
    fn invalidate(&mut self, cblock: u32);
    /// What to save for `cblock` on a clean shutdown.
    fn hint(&self, cblock: u32) -> u32;
    /// Cache blocks in use (promotions under way included).
    fn residency(&self) -> u32;
    /// Time passes (`now_ms` since the cache started).
    fn tick(&mut self, now_ms: u64);
    /// A `<key> <value>` tunable (table or message): whether it is one of its own.
    fn set_config(&mut self, key: &str, value: &str) -> bool;
    /// The policy's arguments in the status: `<#args> <args>*`.
    fn emit_config(&self) -> String;
    fn allow_migrations(&mut self, allow: bool);
}

/// The policy named in a table line for a cache of `nr_cache` blocks over
/// `origin_sectors` in blocks of `block_sectors`.
pub fn create(
    name: &str,
    nr_cache: u32,
    origin_sectors: u64,
    block_sectors: u64,
) -> Result<Box<dyn Policy>, TargetError> {
    match name {
        "smq" | "default" => Ok(Box::new(Smq::new(nr_cache, origin_sectors, block_sectors, false)?)),
        "mq" => Ok(Box::new(Smq::new(nr_cache, origin_sectors, block_sectors, true)?)),
        "cleaner" => Ok(Box::new(Cleaner::new(nr_cache)?)),
        _ => Err(format!("unknown policy '{name}' (smq, mq, default, cleaner)").into()),
    }
}

/// A vector of `n` copies of `v`, or an error naming `what` when memory
/// cannot hold it (never an abort).
pub(crate) fn vec_of<T: Clone>(n: usize, v: T, what: &str) -> Result<Vec<T>, TargetError> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| format!("no memory for {n} {what}"))?;
    out.resize(n, v);
    Ok(out)
}

// ---- the multiqueue ----

/// The links of a pool of entries, shared by the queues they move between;
/// entries from `sentinel_from` on are sentinels (they mark a place in a
/// level and are not counted).
struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
    level: Vec<u8>,
    sentinel_from: u32,
}

impl Links {
    fn new(n: usize, sentinels: usize, what: &str) -> Result<Links, TargetError> {
        let all = n + sentinels;
        Ok(Links {
            prev: vec_of(all, NIL, what)?,
            next: vec_of(all, NIL, what)?,
            level: vec_of(all, 0, what)?,
            sentinel_from: n as u32,
        })
    }

    fn sentinel(&self, e: u32) -> bool {
        e >= self.sentinel_from
    }
}

/// Entries in levels 0 (coldest) to NR_LEVELS - 1, each level a list.
struct MQueue {
    head: [u32; NR_LEVELS],
    tail: [u32; NR_LEVELS],
    /// Entries (sentinels not counted) of each level, and of all.
    count: [u32; NR_LEVELS],
    nr: u32,
}

impl MQueue {
    fn new() -> MQueue {
        MQueue {
            head: [NIL; NR_LEVELS],
            tail: [NIL; NR_LEVELS],
            count: [0; NR_LEVELS],
            nr: 0,
        }
    }

    fn counted(&mut self, l: &Links, e: u32, lv: usize, add: bool) {
        if l.sentinel(e) {
            return;
        }
        if add {
            self.count[lv] += 1;
            self.nr += 1;
        } else {
            self.count[lv] -= 1;
            self.nr -= 1;
        }
    }

    fn push_at(&mut self, l: &mut Links, e: u32, front: bool) {
        let lv = l.level[e as usize] as usize;
        let i = e as usize;
        if front {
            l.prev[i] = NIL;
            l.next[i] = self.head[lv];
            match self.head[lv] {
                NIL => self.tail[lv] = e,
                h => l.prev[h as usize] = e,
            }
            self.head[lv] = e;
        } else {
            l.next[i] = NIL;
            l.prev[i] = self.tail[lv];
            match self.tail[lv] {
                NIL => self.head[lv] = e,
                t => l.next[t as usize] = e,
            }
            self.tail[lv] = e;
        }
        self.counted(l, e, lv, true);
    }

    fn push(&mut self, l: &mut Links, e: u32) {
        self.push_at(l, e, false)
    }

    /// Put `e` just before `at`, in `at`'s level.
    fn push_before(&mut self, l: &mut Links, at: u32, e: u32) {
        let lv = l.level[at as usize] as usize;
        l.level[e as usize] = lv as u8;
        let p = l.prev[at as usize];
        l.prev[e as usize] = p;
        l.next[e as usize] = at;
        l.prev[at as usize] = e;
        match p {
            NIL => self.head[lv] = e,
            p => l.next[p as usize] = e,
        }
        self.counted(l, e, lv, true);
    }

    fn del(&mut self, l: &mut Links, e: u32) {
        let i = e as usize;
        let lv = l.level[i] as usize;
        let (p, n) = (l.prev[i], l.next[i]);
        match p {
            NIL => self.head[lv] = n,
            p => l.next[p as usize] = n,
        }
        match n {
            NIL => self.tail[lv] = p,
            n => l.prev[n as usize] = p,
        }
        l.prev[i] = NIL;
        l.next[i] = NIL;
        self.counted(l, e, lv, false);
    }

    /// The oldest entry of the lowest level below `max_level`; without
    /// `cross`, a level is looked at only up to its first sentinel (the
    /// entries not touched since it was placed).
    fn peek(&self, l: &Links, max_level: usize, cross: bool) -> Option<u32> {
        for lv in 0..max_level.min(NR_LEVELS) {
            let mut e = self.head[lv];
            while e != NIL {
                if !l.sentinel(e) {
                    return Some(e);
                }
                if !cross {
                    break;
                }
                e = l.next[e as usize];
            }
        }
        None
    }

    fn pop(&mut self, l: &mut Links) -> Option<u32> {
        let e = self.peek(l, NR_LEVELS, true)?;
        self.del(l, e);
        Some(e)
    }

    /// Move `e` up `extra` levels, swapping the first entry of its new level
    /// down into its old one (placed before the sentinel `before` of the old
    /// level names, for each sentinel passed, when the queue has them).
    fn requeue(&mut self, l: &mut Links, e: u32, extra: usize, before: Option<(u32, u32)>) {
        let old = l.level[e as usize] as usize;
        let new = (old + extra).min(NR_LEVELS - 1);
        if extra > 0 && old < NR_LEVELS - 1 {
            let mut de = self.head[new];
            let mut passed = 0;
            while de != NIL && l.sentinel(de) {
                passed += 1;
                de = l.next[de as usize];
            }
            if de != NIL {
                self.del(l, de);
                l.level[de as usize] = old as u8;
                match (before, passed) {
                    (Some((s1, _)), 0) => self.push_before(l, s1, de),
                    (Some((_, s2)), 1) => self.push_before(l, s2, de),
                    _ => self.push(l, de),
                }
            }
        }
        self.del(l, e);
        l.level[e as usize] = new as u8;
        self.push(l, e);
    }

    /// The first (`head`) or last entry of level `lv`, sentinels skipped.
    fn first_of(&self, l: &Links, lv: usize, head: bool) -> Option<u32> {
        let mut e = if head { self.head[lv] } else { self.tail[lv] };
        while e != NIL && l.sentinel(e) {
            e = if head { l.next[e as usize] } else { l.prev[e as usize] };
        }
        (e != NIL).then_some(e)
    }

    /// Spread the entries evenly over the levels, keeping their order (the
    /// remainder goes to the lowest levels); sentinels stay where they are.
    fn redistribute(&mut self, l: &mut Links) {
        let per = self.nr / NR_LEVELS as u32;
        let rem = self.nr % NR_LEVELS as u32;
        for lv in 0..NR_LEVELS - 1 {
            let target = per + u32::from((lv as u32) < rem);
            while self.count[lv] < target {
                let Some(e) = (lv + 1..NR_LEVELS).find_map(|s| self.first_of(l, s, true)) else {
                    break;
                };
                self.del(l, e);
                l.level[e as usize] = lv as u8;
                self.push(l, e);
            }
            while self.count[lv] > target {
                let Some(e) = self.first_of(l, lv, false) else { break };
                self.del(l, e);
                l.level[e as usize] = (lv + 1) as u8;
                self.push_at(l, e, true);
            }
        }
    }
}

/// How often accesses land in the top quarter of a queue's levels.
#[derive(Default)]
struct Stats {
    hits: u32,
    misses: u32,
}

#[derive(PartialEq, Eq, Debug)]
enum Assessment {
    Poor,
    Fair,
    Well,
}

impl Stats {
    fn accessed(&mut self, level: u8) {
        if level as usize >= NR_LEVELS * 3 / 4 {
            self.hits = self.hits.saturating_add(1);
        } else {
            self.misses = self.misses.saturating_add(1);
        }
    }

    fn miss(&mut self) {
        self.misses = self.misses.saturating_add(1);
    }

    fn assess(&self) -> Assessment {
        let total = u64::from(self.hits) + u64::from(self.misses);
        let confidence = (u64::from(self.hits) << FP_SHIFT).checked_div(total).unwrap_or(0);
        if confidence < 1 << (FP_SHIFT - 4) {
            Assessment::Poor
        } else if confidence < 1 << (FP_SHIFT - 3) {
            Assessment::Fair
        } else {
            Assessment::Well
        }
    }
}

// ---- smq ----

struct Smq {
    mimic_mq: bool,
    nr_cache: u32,
    links: Links,
    oblock: Vec<u64>,
    allocated: Vec<bool>,
    dirty: Vec<bool>,
    pending: Vec<bool>,
    /// Free cache blocks, lowest on top (an entry may be there twice, once
    /// stale: skipped when it is allocated).
    free: Vec<u32>,
    nr_allocated: u32,
    clean: MQueue,
    dirtyq: MQueue,
    /// Cache blocks hit this cache period.
    cache_hit: Vec<u64>,
    cache_stats: Stats,

    hs_links: Links,
    hs_block: Vec<u64>,
    hs_table: HashMap<u64, u32>,
    hs_allocated: u32,
    nr_hotspot: u32,
    hotspot: MQueue,
    hs_hit: Vec<u64>,
    hs_stats: Stats,
    blocks_per_hotspot: u64,
    level_jump: usize,
    read_promote_level: usize,
    write_promote_level: usize,

    queued: VecDeque<Work>,
    promoting: HashSet<u64>,
    demotions_queued: u32,
    migrations_allowed: bool,
    next_hotspot_period: u64,
    next_cache_period: u64,
    /// Which set of sentinels moves next, and when.
    current_wb: bool,
    current_demote: bool,
    next_wb_period: u64,
    next_demote_period: u64,
}

fn test_and_set(bits: &mut [u64], i: usize) -> bool {
    let (w, m) = (i / 64, 1u64 << (i % 64));
    match bits.get_mut(w) {
        Some(word) => {
            let had = *word & m != 0;
            *word |= m;
            had
        }
        None => true,
    }
}

/// The kernel's hash_32(v, 9), masked to a level: where a block without a
/// valid hint starts.
fn random_level(cblock: u32) -> u8 {
    ((cblock.wrapping_mul(0x61C8_8647) >> (32 - 9)) as usize & (NR_LEVELS - 1)) as u8
}

impl Smq {
    fn new(nr_cache: u32, origin_sectors: u64, block_sectors: u64, mimic_mq: bool) -> Result<Smq, TargetError> {
        let n = nr_cache as usize;
        // the hotspot regions: 16 cache blocks each, halved while there would be
        // fewer of them than max(cache blocks / 4, 1024)
        let nr_hotspot = (nr_cache / 4).max(1024);
        let mut hs_sectors = block_sectors * 16;
        while hs_sectors > block_sectors && origin_sectors / hs_sectors < u64::from(nr_hotspot) {
            hs_sectors /= 2;
        }
        let nh = nr_hotspot as usize;
        let mut free = Vec::new();
        free.try_reserve_exact(2 * n)
            .map_err(|_| format!("no memory for {n} free cache blocks"))?;
        free.extend((0..nr_cache).rev());
        let mut hs_table = HashMap::new();
        hs_table
            .try_reserve(nh)
            .map_err(|_| format!("no memory for {nh} hotspot blocks"))?;
        let mut promoting = HashSet::new();
        promoting
            .try_reserve(MAX_WORK)
            .map_err(|_| "no memory for the background work".to_string())?;
        let mut queued = VecDeque::new();
        queued
            .try_reserve(MAX_WORK)
            .map_err(|_| "no memory for the background work".to_string())?;
        Ok(Smq {
            mimic_mq,
            nr_cache,
            // two sets of sentinels a level for each of the two queues
            links: Links::new(n, 4 * NR_LEVELS, "cache entries")?,
            oblock: vec_of(n, 0, "cache entries")?,
            allocated: vec_of(n, false, "cache entries")?,
            dirty: vec_of(n, false, "cache entries")?,
            pending: vec_of(n, false, "cache entries")?,
            free,
            nr_allocated: 0,
            clean: MQueue::new(),
            dirtyq: MQueue::new(),
            cache_hit: vec_of(n.div_ceil(64), 0, "cache hit bits")?,
            cache_stats: Stats::default(),
            hs_links: Links::new(nh, 0, "hotspot entries")?,
            hs_block: vec_of(nh, 0, "hotspot entries")?,
            hs_table,
            hs_allocated: 0,
            nr_hotspot,
            hotspot: MQueue::new(),
            hs_hit: vec_of(nh.div_ceil(64), 0, "hotspot hit bits")?,
            hs_stats: Stats::default(),
            blocks_per_hotspot: (hs_sectors / block_sectors.max(1)).max(1),
            level_jump: 1,
            read_promote_level: NR_LEVELS,
            write_promote_level: NR_LEVELS,
            queued,
            promoting,
            demotions_queued: 0,
            migrations_allowed: true,
            next_hotspot_period: HOTSPOT_UPDATE_MS,
            next_cache_period: CACHE_UPDATE_MS,
            current_wb: false,
            current_demote: false,
            next_wb_period: WRITEBACK_PERIOD_MS,
            next_demote_period: DEMOTE_PERIOD_MS,
        }
        .with_sentinels())
    }

    /// The writeback sentinel of set `set` at level `lv` (in the dirty queue).
    fn wb_sentinel(&self, set: bool, lv: usize) -> u32 {
        self.nr_cache + (usize::from(set) * NR_LEVELS + lv) as u32
    }

    /// The demotion sentinel of set `set` at level `lv` (in the clean queue).
    fn demote_sentinel(&self, set: bool, lv: usize) -> u32 {
        self.nr_cache + ((2 + usize::from(set)) * NR_LEVELS + lv) as u32
    }

    /// Both sets of sentinels in each level of their queues.
    fn with_sentinels(mut self) -> Smq {
        for set in [false, true] {
            for lv in 0..NR_LEVELS {
                let (w, d) = (self.wb_sentinel(set, lv), self.demote_sentinel(set, lv));
                self.links.level[w as usize] = lv as u8;
                self.links.level[d as usize] = lv as u8;
                self.dirtyq.push(&mut self.links, w);
                self.clean.push(&mut self.links, d);
            }
        }
        self
    }

    /// Move the current set of sentinels to the end of their levels, once a
    /// period: what is ahead of them was not touched since.
    fn update_sentinels(&mut self, now_ms: u64) {
        if now_ms >= self.next_wb_period {
            self.next_wb_period = now_ms + WRITEBACK_PERIOD_MS;
            self.current_wb = !self.current_wb;
            for lv in 0..NR_LEVELS {
                let e = self.wb_sentinel(self.current_wb, lv);
                self.dirtyq.del(&mut self.links, e);
                self.dirtyq.push(&mut self.links, e);
            }
        }
        if now_ms >= self.next_demote_period {
            self.next_demote_period = now_ms + DEMOTE_PERIOD_MS;
            self.current_demote = !self.current_demote;
            for lv in 0..NR_LEVELS {
                let e = self.demote_sentinel(self.current_demote, lv);
                self.clean.del(&mut self.links, e);
                self.clean.push(&mut self.links, e);
            }
        }
    }

    fn queue_of(&mut self, c: u32) -> &mut MQueue {
        if self.dirty[c as usize] {
            &mut self.dirtyq
        } else {
            &mut self.clean
        }
    }

    fn push_queue(&mut self, c: u32, front: bool) {
        let mut q = std::mem::replace(self.queue_of(c), MQueue::new());
        q.push_at(&mut self.links, c, front);
        *self.queue_of(c) = q;
    }

    fn del_queue(&mut self, c: u32) {
        let mut q = std::mem::replace(self.queue_of(c), MQueue::new());
        q.del(&mut self.links, c);
        *self.queue_of(c) = q;
    }

    fn alloc(&mut self) -> Option<u32> {
        while let Some(c) = self.free.pop() {
            if !self.allocated[c as usize] {
                self.allocated[c as usize] = true;
                self.nr_allocated += 1;
                return Some(c);
            }
        }
        None
    }

    fn free_entry(&mut self, c: u32) {
        let i = c as usize;
        if self.allocated[i] {
            self.allocated[i] = false;
            self.dirty[i] = false;
            self.pending[i] = false;
            self.nr_allocated -= 1;
            if self.free.len() < self.free.capacity() {
                self.free.push(c);
            }
        }
    }

    fn allocator_empty(&self) -> bool {
        self.nr_allocated >= self.nr_cache
    }

    fn free_target_met(&self) -> bool {
        let nr_free = u64::from(self.nr_cache - self.nr_allocated.min(self.nr_cache));
        nr_free + u64::from(self.demotions_queued) >= u64::from(self.nr_cache) * FREE_TARGET / 100
    }

    fn queue_work(&mut self, w: Work) -> bool {
        if self.queued.len() >= MAX_WORK {
            return false;
        }
        self.queued.push_back(w);
        true
    }

    /// Write back the coldest dirty block: when busy, only one not written
    /// to since the writeback sentinels last moved.
    fn queue_writeback(&mut self, idle: bool) {
        if let Some(c) = self.dirtyq.peek(&self.links, NR_LEVELS, idle) {
            self.dirtyq.del(&mut self.links, c);
            self.pending[c as usize] = true;
            let w = Work {
                op: Op::Writeback,
                oblock: self.oblock[c as usize],
                cblock: c,
            };
            if !self.queue_work(w) {
                self.pending[c as usize] = false;
                self.dirtyq.push_at(&mut self.links, c, true);
            }
        }
    }

    fn queue_demotion(&mut self) {
        if !self.migrations_allowed {
            return;
        }
        let Some(c) = self.clean.peek(&self.links, NR_LEVELS / 2, true) else {
            if self.dirtyq.nr > 0 {
                self.queue_writeback(false);
            }
            return;
        };
        self.clean.del(&mut self.links, c);
        self.pending[c as usize] = true;
        let w = Work {
            op: Op::Demote,
            oblock: self.oblock[c as usize],
            cblock: c,
        };
        if self.queue_work(w) {
            self.demotions_queued += 1;
        } else {
            self.pending[c as usize] = false;
            self.clean.push_at(&mut self.links, c, true);
        }
    }

    fn queue_promotion(&mut self, oblock: u64) {
        if !self.migrations_allowed {
            return;
        }
        if self.allocator_empty() {
            // always demote a little under a continuous load
            if !self.free_target_met() {
                self.queue_demotion();
            }
            return;
        }
        if self.promoting.contains(&oblock) || self.promoting.len() >= MAX_WORK {
            return;
        }
        let Some(c) = self.alloc() else { return };
        self.pending[c as usize] = true;
        let w = Work {
            op: Op::Promote,
            oblock,
            cblock: c,
        };
        if self.queue_work(w) {
            self.promoting.insert(oblock);
        } else {
            self.free_entry(c);
        }
    }

    /// The hotspot region of `oblock` was missed: lift it (once a tick), or
    /// take the coldest region's entry for it. Its level, if it has one.
    fn update_hotspot(&mut self, oblock: u64) -> Option<u8> {
        let hb = oblock / self.blocks_per_hotspot;
        if let Some(&e) = self.hs_table.get(&hb) {
            let lv = self.hs_links.level[e as usize];
            self.hs_stats.accessed(lv);
            let jump = if test_and_set(&mut self.hs_hit, e as usize) {
                0
            } else {
                self.level_jump
            };
            self.hotspot.requeue(&mut self.hs_links, e, jump, None);
            return Some(self.hs_links.level[e as usize]);
        }
        self.hs_stats.miss();
        let e = if self.hs_allocated < self.nr_hotspot {
            self.hs_allocated += 1;
            self.hs_allocated - 1
        } else {
            let e = self.hotspot.pop(&mut self.hs_links)?;
            self.hs_table.remove(&self.hs_block[e as usize]);
            let (w, m) = (e as usize / 64, 1u64 << (e % 64));
            if let Some(word) = self.hs_hit.get_mut(w) {
                *word &= !m;
            }
            e
        };
        self.hs_block[e as usize] = hb;
        self.hs_links.level[e as usize] = 0;
        self.hotspot.push(&mut self.hs_links, e);
        self.hs_table.insert(hb, e);
        Some(0)
    }

    fn update_promote_levels(&mut self) {
        // the kernel takes the larger of its default level and NR_LEVELS: all
        // of them, cut by how well the hotspot queue predicts
        let threshold = match self.hs_stats.assess() {
            Assessment::Poor => NR_LEVELS / 4,
            Assessment::Fair => NR_LEVELS / 2,
            Assessment::Well => NR_LEVELS,
        };
        self.read_promote_level = NR_LEVELS - threshold;
        self.write_promote_level = NR_LEVELS - threshold;
    }
}

impl Policy for Smq {
    fn name(&self) -> &'static str {
        "smq"
    }

    fn version(&self) -> [u32; 3] {
        [2, 0, 0]
    }

    fn lookup(&mut self, oblock: u64, hit: Option<u32>, write: bool, fast: bool) -> bool {
        if let Some(c) = hit {
            let i = c as usize;
            if i >= self.allocated.len() || !self.allocated[i] {
                return false;
            }
            let lv = self.links.level[i];
            self.cache_stats.accessed(lv);
            if !self.pending[i] && !test_and_set(&mut self.cache_hit, i) {
                // a dirty block stays behind the writeback sentinels it passed
                let before = self.dirty[i].then(|| {
                    let lv = lv as usize;
                    (self.wb_sentinel(!self.current_wb, lv), self.wb_sentinel(self.current_wb, lv))
                });
                let mut q = std::mem::replace(self.queue_of(c), MQueue::new());
                q.requeue(&mut self.links, c, 1, before);
                *self.queue_of(c) = q;
            }
            return false;
        }
        self.cache_stats.miss();
        let Some(level) = self.update_hotspot(oblock) else {
            return false;
        };
        let promote_level = if write {
            self.write_promote_level
        } else {
            self.read_promote_level
        };
        if (write && fast && !self.allocator_empty()) || level as usize >= promote_level {
            let before = self.queued.len();
            self.queue_promotion(oblock);
            return self.queued.len() != before;
        }
        false
    }

    fn background_work(&mut self, idle: bool) -> Option<Work> {
        if self.queued.is_empty() && idle && self.dirtyq.nr > 0 {
            self.queue_writeback(true);
        }
        let w = self.queued.pop_front()?;
        if w.op == Op::Demote {
            self.demotions_queued = self.demotions_queued.saturating_sub(1);
        }
        Some(w)
    }

    fn complete(&mut self, w: Work, ok: bool) {
        let c = w.cblock;
        let i = c as usize;
        if i >= self.allocated.len() {
            return;
        }
        match w.op {
            Op::Promote => {
                self.promoting.remove(&w.oblock);
                self.pending[i] = false;
                if ok {
                    self.oblock[i] = w.oblock;
                    self.links.level[i] = (NR_LEVELS - 1) as u8;
                    self.push_queue(c, false);
                } else {
                    self.free_entry(c);
                }
            }
            Op::Demote => {
                if ok {
                    self.free_entry(c);
                } else {
                    self.pending[i] = false;
                    self.push_queue(c, false);
                }
            }
            Op::Writeback => {
                self.pending[i] = false;
                if ok {
                    self.dirty[i] = false;
                }
                self.push_queue(c, false);
            }
        }
    }

    fn set_dirty(&mut self, cblock: u32, dirty: bool) {
        let i = cblock as usize;
        if i >= self.allocated.len() || !self.allocated[i] || self.dirty[i] == dirty {
            return;
        }
        if self.pending[i] {
            self.dirty[i] = dirty;
        } else {
            self.del_queue(cblock);
            self.dirty[i] = dirty;
            self.push_queue(cblock, false);
        }
    }

    fn load_mapping(&mut self, oblock: u64, cblock: u32, dirty: bool, hint: Option<u32>) {
        let i = cblock as usize;
        if i >= self.allocated.len() || self.allocated[i] {
            return;
        }
        self.allocated[i] = true;
        self.nr_allocated += 1;
        self.oblock[i] = oblock;
        self.dirty[i] = dirty;
        self.pending[i] = false;
        self.links.level[i] = match hint {
            Some(h) => h.min(NR_LEVELS as u32 - 1) as u8,
            None => random_level(cblock),
        };
        // ahead of the others, so demotion and cleaning may start at once
        self.push_queue(cblock, true);
    }

    fn invalidate(&mut self, cblock: u32) {
        let i = cblock as usize;
        if i >= self.allocated.len() || !self.allocated[i] || self.pending[i] {
            return;
        }
        self.del_queue(cblock);
        self.free_entry(cblock);
    }

    fn hint(&self, cblock: u32) -> u32 {
        let i = cblock as usize;
        if self.allocated.get(i).copied().unwrap_or(false) {
            u32::from(self.links.level[i])
        } else {
            0
        }
    }

    fn residency(&self) -> u32 {
        self.nr_allocated
    }

    fn tick(&mut self, now_ms: u64) {
        self.update_sentinels(now_ms);
        // the end of a hotspot period: every region may be lifted again
        self.hs_hit.iter_mut().for_each(|w| *w = 0);
        self.update_promote_levels();
        if now_ms >= self.next_hotspot_period {
            self.level_jump = match self.hs_stats.assess() {
                Assessment::Poor => 4,
                Assessment::Fair => 2,
                Assessment::Well => 1,
            };
            self.hotspot.redistribute(&mut self.hs_links);
            self.hs_stats = Stats::default();
            self.next_hotspot_period = now_ms + HOTSPOT_UPDATE_MS;
        }
        if now_ms >= self.next_cache_period {
            self.cache_hit.iter_mut().for_each(|w| *w = 0);
            self.dirtyq.redistribute(&mut self.links);
            self.clean.redistribute(&mut self.links);
            self.cache_stats = Stats::default();
            self.next_cache_period = now_ms + CACHE_UPDATE_MS;
        }
    }

    fn set_config(&mut self, key: &str, _value: &str) -> bool {
        // mq's tunables are still taken (and have no effect, as in the kernel)
        const MQ_TUNABLES: [&str; 5] = [
            "random_threshold",
            "sequential_threshold",
            "discard_promote_adjustment",
            "read_promote_adjustment",
            "write_promote_adjustment",
        ];
        if self.mimic_mq && MQ_TUNABLES.iter().any(|t| t.eq_ignore_ascii_case(key)) {
            tracing::warn!("tunable '{key}' no longer has any effect, mq policy is now an alias for smq");
            return true;
        }
        false
    }

    fn emit_config(&self) -> String {
        if self.mimic_mq {
            "10 random_threshold 0 sequential_threshold 0 discard_promote_adjustment 0 read_promote_adjustment 0 write_promote_adjustment 0".into()
        } else {
            "0".into()
        }
    }

    fn allow_migrations(&mut self, allow: bool) {
        self.migrations_allowed = allow;
    }
}

// ---- cleaner ----

/// Writes back every dirty block, lowest origin block first, and promotes
/// nothing.
struct Cleaner {
    oblock: Vec<u64>,
    allocated: Vec<bool>,
    dirty_set: BTreeSet<(u64, u32)>,
    dirty: Vec<bool>,
    pending: Vec<bool>,
    nr_allocated: u32,
}

impl Cleaner {
    fn new(nr_cache: u32) -> Result<Cleaner, TargetError> {
        let n = nr_cache as usize;
        Ok(Cleaner {
            oblock: vec_of(n, 0, "cache entries")?,
            allocated: vec_of(n, false, "cache entries")?,
            dirty_set: BTreeSet::new(),
            dirty: vec_of(n, false, "cache entries")?,
            pending: vec_of(n, false, "cache entries")?,
            nr_allocated: 0,
        })
    }
}

impl Policy for Cleaner {
    fn name(&self) -> &'static str {
        "cleaner"
    }

    fn version(&self) -> [u32; 3] {
        [1, 0, 0]
    }

    fn lookup(&mut self, _oblock: u64, _hit: Option<u32>, _write: bool, _fast: bool) -> bool {
        false
    }

    fn background_work(&mut self, _idle: bool) -> Option<Work> {
        let (oblock, cblock) = self.dirty_set.pop_first()?;
        self.pending[cblock as usize] = true;
        Some(Work {
            op: Op::Writeback,
            oblock,
            cblock,
        })
    }

    fn complete(&mut self, w: Work, ok: bool) {
        let i = w.cblock as usize;
        if i >= self.allocated.len() {
            return;
        }
        self.pending[i] = false;
        if w.op == Op::Writeback && ok {
            self.dirty[i] = false;
        } else if self.dirty[i] && self.allocated[i] {
            self.dirty_set.insert((self.oblock[i], w.cblock));
        }
    }

    fn set_dirty(&mut self, cblock: u32, dirty: bool) {
        let i = cblock as usize;
        if i >= self.allocated.len() || !self.allocated[i] || self.dirty[i] == dirty {
            return;
        }
        self.dirty[i] = dirty;
        if self.pending[i] {
            return;
        }
        if dirty {
            self.dirty_set.insert((self.oblock[i], cblock));
        } else {
            self.dirty_set.remove(&(self.oblock[i], cblock));
        }
    }

    fn load_mapping(&mut self, oblock: u64, cblock: u32, dirty: bool, _hint: Option<u32>) {
        let i = cblock as usize;
        if i >= self.allocated.len() || self.allocated[i] {
            return;
        }
        self.allocated[i] = true;
        self.nr_allocated += 1;
        self.oblock[i] = oblock;
        self.dirty[i] = false;
        self.set_dirty(cblock, dirty);
    }

    fn invalidate(&mut self, cblock: u32) {
        let i = cblock as usize;
        if i >= self.allocated.len() || !self.allocated[i] || self.pending[i] {
            return;
        }
        if self.dirty[i] {
            self.dirty_set.remove(&(self.oblock[i], cblock));
        }
        self.allocated[i] = false;
        self.dirty[i] = false;
        self.nr_allocated -= 1;
    }

    fn hint(&self, _cblock: u32) -> u32 {
        0
    }

    fn residency(&self) -> u32 {
        self.nr_allocated
    }

    fn tick(&mut self, _now_ms: u64) {}

    fn set_config(&mut self, _key: &str, _value: &str) -> bool {
        false
    }

    fn emit_config(&self) -> String {
        "0".into()
    }

    fn allow_migrations(&mut self, _allow: bool) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redistribute_spreads_in_order() {
        let mut l = Links::new(100, 0, "t").unwrap();
        let mut q = MQueue::new();
        for e in 0..100u32 {
            l.level[e as usize] = 0;
            q.push(&mut l, e);
        }
        q.redistribute(&mut l);
        // 100 over 64 levels: 2 in the lowest 36, 1 above; order kept
        assert_eq!((q.count[0], q.count[35], q.count[36], q.count[63]), (2, 2, 1, 1));
        assert_eq!(q.head[63], 99);
        assert_eq!(q.peek(&l, NR_LEVELS, true), Some(0));
        assert_eq!(q.nr, 100);
    }

    #[test]
    fn smq_promotes_a_hot_region_into_free_blocks_and_keeps_its_level_as_hint() {
        // 64 cache blocks of 128 sectors over 8192 origin blocks
        let mut p = create("smq", 64, 8192 * 128, 128).unwrap();
        let mut now = 0;
        let mut promoted = Vec::new();
        for round in 0..40 {
            for b in [7u64, 300, 301] {
                if p.lookup(b, None, false, false) {
                    while let Some(w) = p.background_work(false) {
                        assert_eq!(w.op, Op::Promote);
                        promoted.push(w.oblock);
                        p.complete(w, true);
                    }
                }
            }
            // cold traffic spread over the origin
            p.lookup(1000 + round * 97, None, false, false);
            now += 300;
            p.tick(now);
        }
        promoted.sort_unstable();
        assert!(promoted.contains(&7) && promoted.contains(&300), "{promoted:?}");
        assert_eq!(p.residency() as usize, promoted.len());
        // a new promotion sits at the top level: its hint says so
        assert_eq!(p.hint(0), NR_LEVELS as u32 - 1);
        assert_eq!(p.emit_config(), "0");
        assert!(!p.set_config("sequential_threshold", "1"));
        let mut mq = create("mq", 64, 8192 * 128, 128).unwrap();
        assert!(mq.set_config("sequential_threshold", "1"));
        assert_eq!(mq.name(), "smq");
    }

    /// A writeback-mode write over a whole block is promoted at once while a
    /// cache block is free (before any hotspot period), and not once the
    /// cache is full; a read or a partial write waits for its region's level.
    #[test]
    fn smq_promotes_a_whole_block_write_at_once_while_blocks_are_free() {
        let mut p = create("smq", 2, 1 << 20, 64).unwrap();
        assert!(!p.lookup(10, None, false, false), "a read miss");
        assert!(!p.lookup(11, None, true, false), "a partial write miss");
        let mut promoted = Vec::new();
        for b in [12u64, 13, 14] {
            if p.lookup(b, None, true, true) {
                let w = p.background_work(false).unwrap();
                assert_eq!((w.op, w.oblock), (Op::Promote, b));
                promoted.push(w.oblock);
                p.complete(w, true);
            }
        }
        assert_eq!(promoted, [12, 13], "the third found the cache full");
        assert_eq!(p.residency(), 2);
    }

    #[test]
    fn smq_writes_back_when_idle_and_demotes_clean_blocks_when_full() {
        let mut p = create("smq", 8, 1 << 20, 64).unwrap();
        for c in 0..8u32 {
            p.load_mapping(100 + u64::from(c), c, c == 3, Some(c));
        }
        assert_eq!(p.residency(), 8);
        assert_eq!(p.background_work(false), None, "busy: no writeback");
        let w = p.background_work(true).unwrap();
        assert_eq!((w.op, w.cblock), (Op::Writeback, 3));
        p.complete(w, true);
        assert_eq!(p.background_work(true), None, "all clean");
        // full: a promotion demotes the coldest clean block of the bottom half
        for _ in 0..200 {
            p.lookup(5000, None, false, false);
            p.tick(10_000);
        }
        let w = p.background_work(false).unwrap();
        assert_eq!((w.op, w.cblock), (Op::Demote, 0));
        p.complete(w, true);
        assert_eq!(p.residency(), 7);
        assert_eq!(p.hint(0), 0);
    }

    #[test]
    fn under_pressure_only_blocks_dirty_since_before_the_sentinels_are_written_back() {
        let mut p = Smq::new(8, 1 << 20, 64, false).unwrap();
        // all in the top half (nothing clean to demote), 3 dirtied now
        for c in 0..8u32 {
            p.load_mapping(100 + u64::from(c), c, false, Some(40));
        }
        p.set_dirty(3, true);
        p.queue_demotion();
        assert!(p.queued.is_empty(), "written to just now: not yet");
        // the sentinels move every 10 s: two moves put it ahead of both
        p.tick(10_000);
        p.queue_demotion();
        assert!(p.queued.is_empty(), "one period: not yet");
        p.tick(20_000);
        p.queue_demotion();
        let w = p.queued.pop_front().unwrap();
        assert_eq!((w.op, w.cblock), (Op::Writeback, 3));
        // when idle, the sentinels do not hold it back
        p.complete(w, true);
        p.set_dirty(5, true);
        assert_eq!(p.background_work(true).map(|w| w.cblock), Some(5));
        // the hit swaps its level with the first entry of the level above
        let mut q = Smq::new(8, 1 << 20, 64, false).unwrap();
        q.load_mapping(1, 0, false, Some(10));
        q.load_mapping(2, 1, false, Some(11));
        q.lookup(1, Some(0), false, false);
        assert_eq!((q.hint(0), q.hint(1)), (11, 10));
    }

    #[test]
    fn cleaner_writes_back_in_origin_order_and_promotes_nothing() {
        let mut p = create("cleaner", 8, 1 << 20, 64).unwrap();
        p.load_mapping(50, 0, true, None);
        p.load_mapping(10, 1, true, None);
        p.load_mapping(30, 2, false, None);
        assert!(!p.lookup(99, None, false, false));
        let a = p.background_work(false).unwrap();
        let b = p.background_work(false).unwrap();
        assert_eq!((a.oblock, b.oblock), (10, 50));
        p.complete(a, true);
        p.complete(b, false);
        // a failed writeback is tried again
        let b = p.background_work(false).unwrap();
        p.complete(b, true);
        assert_eq!(p.background_work(true), None);
        assert!(create("lru", 8, 1, 64).is_err());
    }
}
