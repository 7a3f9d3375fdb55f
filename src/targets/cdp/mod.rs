//! `cdp <data_dev> <journal_dev> [<#feature args> <arg>...]`: continuous data
//! protection. Every flush (and every FUA write) the device acknowledges is a
//! point in time, and any point kept can be read again: as the read-only
//! device `cdp-point <cdp dev> <flush:N|mark:LABEL|time:RFC3339>`, made by
//! hand or by an NBD client asking for the export `NAME@flush:N` (and
//! `@mark:`, `@time:`), and as a writable thin snapshot through a thin
//! device's external origin. docs/design/cdp.md has the design.
//!
//! The data device is a store of blocks (`block_size`, 4 KiB unless said): a
//! write goes to a free block and the index (`state`) points the device's
//! block there, so data is written once. The index lives in memory; each flush
//! makes the written data durable, then appends what changed to the journal
//! device (`journal`) and makes that durable, and only then is acknowledged:
//! a point acknowledged is a point kept, across crashes. Older versions stay
//! while a kept point reads them; retention drops points by age
//! (`keep AGE:EVERY`, a schedule), count (`max_points`) and, when the data
//! device runs short, oldest first.

pub mod format;
pub mod journal;
pub mod state;

use crate::mapper::TargetError;
use crate::io::{errno, EndIo, LeafKind, Op, SECTOR};
use crate::mapper::devio;
use crate::mapper::engine::{Dest, Pending};
use crate::mapper::{arg_dev, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use crate::sync::{Cond, Unpoison};
use crate::io::restart_log::{Previous, Record, RestartLog};
use format::MAX_LABEL;
use state::{Garbage, Index, Point, Version, ZEROES};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

/// The `cdp` target type.
pub const TYPE: TargetType = TargetType {
    name: "cdp",
    version: [1, 0, 0],
    new: |args, len, r| Ok(Box::new(Cdp::new(args, len, r)?)),
    sync: None,
};

/// The `cdp-point` target type: one kept point of a cdp device, read-only.
pub const POINT_TYPE: TargetType = TargetType {
    name: "cdp-point",
    version: [1, 0, 0],
    new: |args, len, r| Ok(Box::new(PointView::new(args, len, r)?)),
    sync: None,
};

const DEFAULT_BLOCK_SECTORS: u64 = 8;
const DEFAULT_MAX_POINTS: u64 = 16_384;
const MAX_MAX_POINTS: u64 = 1 << 22;
/// Retention by age runs at most this often.
const THIN_EVERY: Duration = Duration::from_secs(1);

/// How points age: `tiers` (up to an age, one point per `every`; 0 = all),
/// none kept past the last tier's age; at most `max_points`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Retention {
    tiers: Vec<(Duration, Duration)>,
    max_points: u64,
}

enum Req {
    Flush(u64, Pending),
    Fua { block: u64, data: Vec<u8>, p: Pending },
    /// A mark; `flush`: its flush number, once it has one (the answer).
    Mark {
        label: String,
        flush: u64,
        reply: crate::sync::ReplyTx<Result<u64, TargetError>>,
    },
}

struct St {
    ix: Index,
    /// Point numbers issued (a client's flush, FUA write or mark, or a commit
    /// for room), and committed.
    issued: u64,
    committed: u64,
    /// The client's flushes (and FUA writes and marks) counted: their
    /// numbers name the points (`flush:N`); issued, and committed.
    flushes: u64,
    flushes_committed: u64,
    /// Points issued and not committed: their flush number and label.
    pending: BTreeMap<u64, (u64, Option<String>)>,
    queue: Vec<Req>,
    /// Versions installed and not yet journaled, in order.
    unjournaled: Vec<(u64, Version)>,
    /// Journaled versions no point reads: free once their flush point commits.
    after_commit: Vec<(u64, u64)>,
    /// Reads in flight, by phase; blocks freed in the current phase wait in
    /// `limbo`, and those of the previous phase in `retiring` until its reads end.
    phase: usize,
    reads: [u64; 2],
    limbo: Vec<u64>,
    retiring: Vec<u64>,
    /// Writes waiting for a free data block.
    waiting: Vec<Pending>,
    pins: HashMap<u64, u32>,
    pos: journal::Pos,
    retention: Retention,
    last_thin: std::time::Instant,
    failed: Option<String>,
    stop: bool,
    /// Journal bytes written since the table was made, and data bytes.
    journal_bytes: u64,
    data_bytes: u64,
    /// Bytes of a block.
    block_bytes: u64,
    /// Versions installed and not journaled, for a daemon that follows a
    /// kill of this one (`io::restart_log`); none without a run directory.
    restart: Option<RestartLog>,
}

struct Inner {
    st: Mutex<St>,
    wake: Cond,
    data: Dest,
    journal: Dest,
    sup: format::Super,
    block_sectors: u64,
    /// Free data blocks below which retention drops the oldest points.
    low_water: u64,
}

fn now_ns() -> u64 {
    crate::sync::wall_ns()
}

impl St {
    /// The next point number.
    fn take_number(&mut self) -> u64 {
        self.issued += 1;
        self.issued
    }

    /// A new point for a client's flush, FUA write or mark: its number and
    /// its flush number.
    fn issue_point(&mut self, label: Option<String>) -> (u64, u64) {
        let n = self.take_number();
        self.flushes += 1;
        self.pending.insert(n, (self.flushes, label));
        (n, self.flushes)
    }

    /// Point (or number) `n` goes: what it kept is kept by an older point, or
    /// is garbage.
    fn drop_point(&mut self, n: u64) {
        let mut g = Vec::new();
        self.ix.drop_point(n, &mut g);
        for x in g {
            self.garbage(Some(x));
        }
    }

    fn garbage(&mut self, g: Option<Garbage>) {
        match g {
            Some(Garbage::Now(s)) => self.limbo.push(s),
            Some(Garbage::After(fp, s)) => self.after_commit.push((fp, s)),
            None => {}
        }
    }

    fn install(&mut self, block: u64, slot: u64) {
        let v = Version {
            fp: self.issued + 1,
            slot,
        };
        let g = self.ix.install(block, v, self.committed, self.issued);
        self.garbage(g);
        self.unjournaled.push((block, v));
        self.log(block, v);
        if slot != ZEROES {
            self.data_bytes += self.block_bytes;
        }
    }

    /// Record version `v` of `block` in the restart log before it is acknowledged.
    fn log(&mut self, block: u64, v: Version) {
        if let Some(l) = &mut self.restart {
            let r = Record {
                kind: LOG_VERSION,
                a: block,
                b: v.slot,
                c: v.fp,
                d: 0,
            };
            if !l.append(r) && !l.is_empty() {
                tracing::warn!("cdp: the restart log is full: writes acknowledged until the next commit are lost if the daemon is killed");
            }
        }
    }

    /// The restart log is past half full: a commit begins it again.
    fn log_pressure(&self) -> bool {
        self.restart.as_ref().is_some_and(|l| l.len() > l.room())
    }

    /// The records of a commit up to point `hi`, at time `now`, and where they
    /// go in the journal (a batch, or a checkpoint when the area is full);
    /// `None` when there is nothing to write. The index takes the points, and
    /// retention's drops, now; the restart log begins again.
    fn journal_round(&mut self, hi: u64, now: u64, low_water: u64, sup: &format::Super) -> Option<(u64, Vec<u8>)> {
        let hi = hi.max(self.committed);
        let first = self.committed + 1;
        let mut recs = Vec::new();
        self.points_committed(first, hi, now, &mut recs);
        let present = self.versions_committed(hi, &mut recs);
        // the restart log begins again, for this commit, before the journal
        // is written: with every version not yet committed, those this
        // commit journals among them (a kill before it lands replays them)
        if let Some(l) = &mut self.restart {
            l.begin(hi);
            let later = std::mem::take(&mut self.unjournaled);
            for &(block, v) in present.iter().chain(&later) {
                self.log(block, v);
            }
            self.unjournaled = later;
        }
        // numbers taken for room are no points: what they kept is looked at again
        for n in first..=hi {
            if !self.ix.points.contains_key(&n) {
                self.drop_point(n);
            }
        }
        self.thin(now, low_water, &mut recs);
        if recs.is_empty() {
            return None;
        }
        let mut pos = self.pos;
        let c = (hi, self.flushes_committed);
        let (off, bytes) = match journal::batch(&recs, c, &mut pos, sup) {
            Some(b) => b,
            None => journal::checkpoint(&self.ix, c, &mut pos, sup),
        };
        self.pos = pos;
        self.journal_bytes += bytes.len() as u64;
        Some((off, bytes))
    }

    /// The points issued in `first..=hi`, kept from now on and recorded (a
    /// flush mapped since the queue was taken may be among them: its request
    /// acknowledges it later).
    fn points_committed(&mut self, first: u64, hi: u64, now: u64, recs: &mut Vec<u8>) {
        let now_points: Vec<_> = self.pending.range(first..hi + 1).map(|(&n, _)| n).collect();
        for n in now_points {
            let Some((flush, label)) = self.pending.remove(&n) else { continue };
            format::Record::Point {
                n,
                flush,
                time_ns: now,
                label: label.clone(),
            }
            .encode(recs);
            self.ix.points.insert(
                n,
                Point {
                    flush,
                    time_ns: now,
                    label,
                },
            );
            self.flushes_committed = self.flushes_committed.max(flush);
        }
    }

    /// The versions of the points up to `hi` that the index still holds,
    /// recorded; returned for the restart log.
    fn versions_committed(&mut self, hi: u64, recs: &mut Vec<u8>) -> Vec<(u64, Version)> {
        let all = std::mem::take(&mut self.unjournaled);
        let (now_v, later): (Vec<_>, Vec<_>) = all.into_iter().partition(|(_, v)| v.fp <= hi);
        self.unjournaled = later;
        let mut present = Vec::with_capacity(now_v.len());
        for (block, v) in now_v {
            if self.ix.at_point(block, v.fp) == v {
                format::Record::Version {
                    block,
                    fp: v.fp,
                    slot: v.slot,
                }
                .encode(recs);
                present.push((block, v));
            }
        }
        present
    }

    /// The journal holds everything up to point `hi`: what waited for that is
    /// on its way to being free.
    fn committed_to(&mut self, hi: u64) {
        self.committed = self.committed.max(hi);
        let c = self.committed;
        let (ready, wait): (Vec<_>, Vec<_>) = std::mem::take(&mut self.after_commit).into_iter().partition(|(fp, _)| *fp <= c);
        self.after_commit = wait;
        self.limbo.extend(ready.into_iter().map(|(_, s)| s));
        self.retire();
    }

    /// Start retiring what waits in limbo, if the last retirement is over.
    fn retire(&mut self) {
        if self.retiring.is_empty() && !self.limbo.is_empty() {
            self.retiring = std::mem::take(&mut self.limbo);
            self.phase ^= 1;
        }
        self.settle();
    }

    /// The previous phase's reads are over: what it retired is free.
    fn settle(&mut self) {
        if self.reads[self.phase ^ 1] == 0 {
            for s in std::mem::take(&mut self.retiring) {
                self.ix.release(s);
            }
        }
    }

    /// Blocks on their way to being free.
    fn freeing(&self) -> u64 {
        (self.after_commit.len() + self.limbo.len() + self.retiring.len()) as u64
    }

    fn pinned(&self, n: u64) -> bool {
        self.pins.get(&n).is_some_and(|&c| c > 0)
    }

    /// Free data blocks wanting, below `low_water`, while a point could still
    /// be dropped to free some.
    fn short(&self, low_water: u64) -> u64 {
        let want = low_water.saturating_sub(self.ix.free_blocks() + self.freeing());
        if want > 0 && self.ix.points.keys().any(|&n| !self.pinned(n)) {
            want
        } else {
            0
        }
    }

    /// Retention, when it is due: drop the points past the schedule, over the
    /// count, or the oldest while the data device runs short, recording each.
    fn thin(&mut self, now: u64, low_water: u64, recs: &mut Vec<u8>) {
        let short = self.short(low_water);
        let due = (crate::sync::since(self.last_thin) >= THIN_EVERY && !self.retention.tiers.is_empty())
            || short > 0
            || self.ix.points.len() as u64 > self.retention.max_points;
        if !due {
            return;
        }
        self.last_thin = crate::sync::now();
        for n in self.to_drop(now, short) {
            self.drop_point(n);
            format::Record::Drop { n }.encode(recs);
        }
    }

    /// Which points retention drops now: past the schedule, over the count,
    /// or (`short` of them) the oldest.
    fn to_drop(&self, now: u64, short: u64) -> Vec<u64> {
        let mut drop = Vec::new();
        let r = &self.retention;
        if !r.tiers.is_empty() {
            let mut last_bucket: Vec<Option<u64>> = vec![None; r.tiers.len()];
            for (&n, p) in self.ix.points.iter().rev() {
                let age = Duration::from_nanos(now.saturating_sub(p.time_ns));
                let keep = match r.tiers.iter().position(|(upto, _)| age < *upto) {
                    None => false,
                    Some(t) => {
                        let every = r.tiers[t].1.as_nanos() as u64;
                        let bucket = p.time_ns.checked_div(every).unwrap_or(n);
                        let fresh = last_bucket[t] != Some(bucket);
                        last_bucket[t] = Some(bucket);
                        fresh || p.label.is_some()
                    }
                };
                if !keep && !self.pinned(n) {
                    drop.push(n);
                }
            }
        }
        let dropped: std::collections::HashSet<u64> = drop.iter().copied().collect();
        let left = self.ix.points.len() as u64 - drop.len() as u64;
        let mut more = left.saturating_sub(r.max_points).max(short);
        for &n in self.ix.points.keys() {
            if more == 0 {
                break;
            }
            if !self.pinned(n) && !dropped.contains(&n) {
                drop.push(n);
                more -= 1;
            }
        }
        drop
    }
}

impl Inner {
    fn block_of(&self, bio: &Bio) -> u64 {
        bio.sector / self.block_sectors
    }

    fn write_done(&self, block: u64, slot: u64, ok: bool) {
        let mut st = self.st.lock().unpoisoned();
        if ok {
            st.install(block, slot);
        } else {
            st.ix.release(slot);
        }
    }

    fn read_done(&self, phase: usize) {
        let mut st = self.st.lock().unpoisoned();
        st.reads[phase] -= 1;
        if st.reads[phase] == 0 && phase != st.phase && !st.retiring.is_empty() {
            st.settle();
            if !st.waiting.is_empty() {
                self.wake.notify_one();
            }
        }
    }

    /// Stop: every request waiting fails.
    fn fail(&self, st: &mut St, why: String) {
        tracing::error!("cdp: {why}: the device fails all I/O from now on");
        st.failed.get_or_insert(why);
        for r in st.queue.drain(..) {
            match r {
                Req::Flush(_, p) | Req::Fua { p, .. } => p.fail(errno::EIO),
                Req::Mark { reply, .. } => reply.send(Err("the cdp device has failed".into())),
            }
        }
        for p in st.waiting.drain(..) {
            p.fail(errno::EIO);
        }
    }

    /// The committer: each round takes what is queued, makes the data durable,
    /// journals it and makes the journal durable, then acknowledges.
    fn committer(&self) {
        let mut st = self.st.lock().unpoisoned();
        loop {
            if st.failed.is_some() {
                if st.stop {
                    return;
                }
                st = self.wake.wait(&self.st, st);
                continue;
            }
            let room = !st.waiting.is_empty() || st.short(self.low_water) > 0 || st.log_pressure();
            let thin_due = crate::sync::since(st.last_thin) >= THIN_EVERY && !st.retention.tiers.is_empty();
            if st.queue.is_empty() && !room && !thin_due {
                if st.stop {
                    // the table goes (removed, or the daemon stops): what was
                    // written and no flush took is journaled too, as a number
                    // that is no point
                    if !st.unjournaled.is_empty() {
                        let n = st.take_number();
                        drop(st);
                        if let Err(e) = self.commit(Vec::new(), Some(n)) {
                            tracing::error!("cdp: the last commit failed: {e}");
                        }
                        st = self.st.lock().unpoisoned();
                    }
                    // everything journaled: no restart log is needed
                    if st.unjournaled.is_empty() && st.failed.is_none() {
                        if let Some(l) = &st.restart {
                            l.remove();
                        }
                    }
                    return;
                }
                st = self.wake.wait_timeout(&self.st, st, THIN_EVERY).0;
                continue;
            }
            let reqs = std::mem::take(&mut st.queue);
            // a commit for room journals the writes no flush has taken yet, as
            // a point number of its own that is no point (taken with the queue:
            // every number up to it is committed by this round)
            let room = (room && !st.unjournaled.is_empty()).then(|| st.take_number());
            drop(st);
            let r = self.commit(reqs, room);
            st = self.st.lock().unpoisoned();
            if let Err(e) = r {
                self.fail(&mut st, e.to_string());
                continue;
            }
            // writes that waited for room map again, or fail if none can come
            if !st.waiting.is_empty() && st.ix.free_blocks() + st.freeing() > 0 {
                for p in std::mem::take(&mut st.waiting) {
                    p.requeue();
                }
            } else if !st.waiting.is_empty() && st.short(self.low_water) == 0 {
                tracing::error!("cdp: the data device is full and no point is left to drop: writes fail with ENOSPC");
                for p in std::mem::take(&mut st.waiting) {
                    p.fail(libc::ENOSPC);
                }
            }
        }
    }

    /// One commit of the requests `reqs` (flushes, FUA writes, marks), and of
    /// `room` (a number taken for room: writes wait for a data block, or few
    /// are free) so that what waits for a commit to be freed is freed.
    fn commit(&self, reqs: Vec<Req>, room: Option<u64>) -> Result<(), TargetError> {
        // the crash simulator places crashes at the flushes inside it
        let _window = crate::io::sim::commit_window(devio::sim_of(&self.journal).as_ref());
        let done = self.number(reqs);
        let hi = done.iter().map(|(n, _)| *n).chain(room).max().unwrap_or(0);
        let new_points = hi > self.st.lock().unpoisoned().committed;
        if new_points {
            devio::flush(&self.data).map_err(|e| format!("flushing the data device: {e}"))?;
        }
        let write = self.st.lock().unpoisoned().journal_round(hi, now_ns(), self.low_water, &self.sup);
        if let Some((off, bytes)) = write {
            devio::write(&self.journal, off / SECTOR, &bytes, false)
                .and_then(|()| devio::flush(&self.journal))
                .map_err(|e| format!("writing the journal: {e}"))?;
        }
        self.st.lock().unpoisoned().committed_to(hi);
        for (_, r) in done {
            match r {
                Req::Flush(_, p) | Req::Fua { p, .. } => p.done(),
                Req::Mark { flush, reply, .. } => reply.send(Ok(flush)),
            }
        }
        Ok(())
    }

    /// The point numbers of a commit's requests: a flush has its own; a FUA
    /// write's data goes to a free block first (or waits with the writes that
    /// wait for room), then it takes one, as a mark does.
    fn number(&self, reqs: Vec<Req>) -> Vec<(u64, Req)> {
        let bs = self.block_sectors;
        let mut done: Vec<(u64, Req)> = Vec::with_capacity(reqs.len());
        for r in reqs {
            match r {
                Req::Fua { block, data, p } => {
                    let slot = self.st.lock().unpoisoned().ix.alloc();
                    let Some(slot) = slot else {
                        self.st.lock().unpoisoned().waiting.push(p);
                        continue;
                    };
                    if let Err(e) = devio::write_data(&self.data, slot * bs, &data, false) {
                        self.st.lock().unpoisoned().ix.release(slot);
                        tracing::error!("cdp: a FUA write to the data device failed: {e}");
                        p.fail(errno::EIO);
                        continue;
                    }
                    let mut st = self.st.lock().unpoisoned();
                    st.install(block, slot);
                    let (n, _) = st.issue_point(None);
                    done.push((n, Req::Fua { block, data: Vec::new(), p }));
                }
                Req::Mark { label, reply, .. } => {
                    let (n, flush) = self.st.lock().unpoisoned().issue_point(Some(label.clone()));
                    done.push((n, Req::Mark { label, flush, reply }));
                }
                Req::Flush(n, p) => done.push((n, Req::Flush(n, p))),
            }
        }
        done
    }

    /// The point a view names: `flush:N`, `mark:LABEL` (the newest so
    /// labelled), `time:RFC3339` (the newest at or before it): its number
    /// and flush number, pinned (kept until [`Inner::unpin`] lets it go).
    fn resolve(&self, spec: &str) -> Result<(u64, u64), TargetError> {
        let mut st = self.st.lock().unpoisoned();
        let pts = &st.ix.points;
        let (kind, v) = spec
            .split_once(':')
            .ok_or_else(|| format!("point '{spec}': expected flush:N, mark:LABEL or time:RFC3339"))?;
        let n = match kind {
            "flush" => {
                let f: u64 = v.parse().map_err(|_| format!("point '{spec}': '{v}' is not a flush number"))?;
                pts.iter()
                    .rev()
                    .find(|(_, p)| p.flush == f)
                    .map(|(&n, _)| n)
                    .ok_or_else(|| format!("point '{spec}': flush {f} is not kept ({})", describe_points(&st.ix)))?
            }
            "mark" => pts
                .iter()
                .rev()
                .find(|(_, p)| p.label.as_deref() == Some(v))
                .map(|(&n, _)| n)
                .ok_or_else(|| format!("point '{spec}': no kept point is marked '{v}'"))?,
            "time" => {
                let t = humantime::parse_rfc3339_weak(v)
                    .map_err(|e| format!("point '{spec}': '{v}' is not an RFC 3339 time: {e}"))?;
                let t = t
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64);
                pts.iter()
                    .rev()
                    .find(|(_, p)| p.time_ns <= t)
                    .map(|(&n, _)| n)
                    .ok_or_else(|| format!("point '{spec}': no kept point is as old ({})", describe_points(&st.ix)))?
            }
            _ => return Err(format!("point '{spec}': expected flush:N, mark:LABEL or time:RFC3339").into()),
        };
        let flush = pts.get(&n).map_or(0, |p| p.flush);
        // pinned under the lock retention drops points under: nothing drops it
        // between the two
        *st.pins.entry(n).or_default() += 1;
        Ok((n, flush))
    }

    /// A view of point `n` goes: one pin fewer.
    fn unpin(&self, n: u64) {
        let mut st = self.st.lock().unpoisoned();
        let c = st.pins.entry(n).or_default();
        *c = c.saturating_sub(1);
        if *c == 0 {
            st.pins.remove(&n);
        }
    }

    /// The state, unless the device has failed (then I/O fails with EIO).
    fn live(&self) -> Result<std::sync::MutexGuard<'_, St>, MapErr> {
        let st = self.st.lock().unpoisoned();
        if st.failed.is_some() {
            return Err(MapErr::Errno(errno::EIO));
        }
        Ok(st)
    }

    /// Map a read of the device as it is (`point` None) or as it was at point
    /// `point`: to the block's data block (counted in the reads of the phase,
    /// so that block is not reused under it), or zeroes.
    fn map_read(self: &Arc<Self>, bio: Bio, point: Option<u64>, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let block = self.block_of(&bio);
        let mut st = self.live()?;
        let Some(&now) = st.ix.cur.get(block as usize) else {
            return Err(MapErr::Errno(errno::EIO));
        };
        let v = point.map_or(now, |n| st.ix.at_point(block, n));
        if v.slot == ZEROES {
            drop(st);
            ctx.complete(bio, LeafKind::ZeroFill);
            return Ok(());
        }
        let phase = st.phase;
        st.reads[phase] += 1;
        drop(st);
        let within = bio.sector % self.block_sectors;
        let dest = Bio {
            sector: v.slot * self.block_sectors + within,
            ..bio
        };
        let me = self.clone();
        let hook: EndIo = Arc::new(move |_, _: &mut [u8]| {
            me.read_done(phase);
            0
        });
        ctx.remap_dest_with(&self.data, dest, Some(hook))
    }
}

/// The flush numbers of the oldest and the newest point kept.
fn flush_range(ix: &Index) -> Option<(u64, u64)> {
    Some((ix.points.first_key_value()?.1.flush, ix.points.last_key_value()?.1.flush))
}

fn describe_points(ix: &Index) -> String {
    match flush_range(ix) {
        Some((a, b)) => format!("{} kept, flush {a} to {b}", ix.points.len()),
        None => "none kept".into(),
    }
}

/// The committer thread and the state it works on; the last table to let go
/// of it stops the thread.
struct Owner {
    inner: Arc<Inner>,
    thread: Mutex<Option<crate::sync::Thread<()>>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.inner.st.lock().unpoisoned().stop = true;
        self.inner.wake.notify_all();
        if let Some(t) = self.thread.lock().unpoisoned().take() {
            let _ = t.join();
        }
    }
}

/// The cdp devices open in this daemon: by journal device (a reload of the
/// table goes on with the same state) and by the dmkit device they are the
/// table of (for views).
#[derive(Default)]
struct Open {
    by_journal: Mutex<HashMap<(u64, u64), Weak<Owner>>>,
    by_device: Mutex<HashMap<u32, Weak<Owner>>>,
}

fn parse_duration(s: &str, what: &str) -> Result<Duration, TargetError> {
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(s).map_err(|e| TargetError::from(format!("{what} '{s}': {e} (for example 90s, 15m, 1h, 7d)")))
}

/// The table's feature arguments: block size and retention.
fn features(args: &[String]) -> Result<(u64, Retention), TargetError> {
    let mut block_sectors = DEFAULT_BLOCK_SECTORS;
    let mut r = Retention {
        tiers: Vec::new(),
        max_points: DEFAULT_MAX_POINTS,
    };
    let mut i = 0;
    let value = |i: usize, name: &str| {
        args.get(i + 1)
            .ok_or_else(|| format!("feature '{name}' needs a value"))
    };
    while i < args.len() {
        let name = args[i].as_str();
        match name {
            "block_size" => {
                let v = value(i, name)?;
                block_sectors = v.parse().map_err(|_| format!("invalid block_size '{v}'"))?;
                if !block_sectors.is_power_of_two() || !(8..=2048).contains(&block_sectors) {
                    return Err(format!(
                        "block_size {block_sectors}: a power of two from 8 to 2048 sectors (4 KiB to 1 MiB)"
                    ).into());
                }
            }
            "max_points" => {
                let v = value(i, name)?;
                r.max_points = v.parse().map_err(|_| format!("invalid max_points '{v}'"))?;
                if !(1..=MAX_MAX_POINTS).contains(&r.max_points) {
                    return Err(format!("max_points {}: from 1 to {MAX_MAX_POINTS}", r.max_points).into());
                }
            }
            "keep" => {
                let v = value(i, name)?;
                let (upto, every) = v
                    .split_once(':')
                    .ok_or_else(|| format!("keep '{v}': expected AGE:EVERY (keep 1h:0 keeps every point for an hour)"))?;
                let (upto, every) = (parse_duration(upto, "keep age")?, parse_duration(every, "keep interval")?);
                if upto.is_zero() || r.tiers.last().is_some_and(|(u, _)| *u >= upto) {
                    return Err(format!("keep '{v}': each age must be longer than the one before").into());
                }
                r.tiers.push((upto, every));
            }
            _ => return Err(format!("Unrecognised cdp feature requested: {}", crate::table::bounded(name)).into()),
        }
        i += 2;
    }
    Ok((block_sectors, r))
}

fn fmt_duration(d: Duration) -> String {
    if d.is_zero() {
        "0".into()
    } else {
        humantime::format_duration(d).to_string().replace(' ', "")
    }
}

pub struct Cdp {
    data: DevRef,
    journal: DevRef,
    owner: Arc<Owner>,
    retention: Retention,
}

impl Cdp {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Cdp, TargetError> {
        if args.len() < 2 {
            return Err(format!(
                "Invalid argument count: cdp takes <data_dev> <journal_dev> [<#feature args> <arg>...], got {}",
                args.len()
            ).into());
        }
        let feats = match args.get(2) {
            None => &args[2..],
            Some(n) => {
                let n: usize = n.parse().map_err(|_| format!("invalid number of feature arguments '{n}'"))?;
                if args.len() != 3 + n {
                    return Err(format!("{n} feature arguments announced, {} given", args.len() - 3).into());
                }
                &args[3..]
            }
        };
        let (block_sectors, retention) = features(feats)?;
        if len == 0 || !len.is_multiple_of(block_sectors) {
            return Err(format!("length {len} sectors is not a whole number of {block_sectors}-sector blocks").into());
        }
        let data = r.open(&args[0]).map_err(|e| format!("data device '{}': {e}", args[0]))?;
        let journal = r.open(&args[1]).map_err(|e| format!("journal device '{}': {e}", args[1]))?;
        let (dd, jd) = (data.dest(), journal.dest());
        if devio::identity(&dd) == devio::identity(&jd) {
            return Err("the data and journal devices are the same device".into());
        }
        let dev_blocks = len / block_sectors;
        let data_blocks = data.size_sectors() / block_sectors;
        // room for every block of the device, and some to write into
        let margin = (dev_blocks / 64).max(64);
        if data_blocks < dev_blocks + margin {
            return Err(format!(
                "data device '{}' holds {data_blocks} blocks of {block_sectors} sectors: a {dev_blocks}-block device needs at least {} (its size and {margin} to write into; what more it has keeps older points)",
                args[0],
                dev_blocks + margin
            ).into());
        }
        let need = journal::needed(data_blocks, dev_blocks, retention.max_points);
        let jsize = journal.size_sectors() * SECTOR;
        if jsize < need {
            return Err(format!(
                "journal device '{}' holds {jsize} bytes: {data_blocks} data blocks and {} points need {need} ({} MiB)",
                args[1],
                retention.max_points,
                need.div_ceil(1 << 20)
            ).into());
        }
        let mem = dev_blocks.saturating_mul(std::mem::size_of::<Version>() as u64);
        if mem > crate::pdata::bounds::memory_limit() {
            return Err(format!("a {dev_blocks}-block device needs {mem} bytes of index, more than this machine allows").into());
        }
        let open = r.shared().get_or_init::<Open>();
        let key = devio::identity(&jd);
        let existing = open.by_journal.lock().unpoisoned().get(&key).and_then(Weak::upgrade);
        let owner = match existing {
            Some(o) => {
                let s = &o.inner.sup;
                if devio::identity(&o.inner.data) != devio::identity(&dd) || u64::from(s.block_sectors) != block_sectors || s.dev_blocks != dev_blocks {
                    return Err("the journal device is in use by a cdp table with another data device or geometry".into());
                }
                o
            }
            None => {
                let logs = r.shared().restart_logs.clone();
                let o = start(dd, jd, (block_sectors, data_blocks, dev_blocks), retention.clone(), logs.as_deref())?;
                open.by_journal.lock().unpoisoned().insert(key, Arc::downgrade(&o));
                o
            }
        };
        open.by_device
            .lock()
            .unpoisoned()
            .insert(r.device().minor, Arc::downgrade(&owner));
        Ok(Cdp {
            data,
            journal,
            owner,
            retention,
        })
    }

    fn inner(&self) -> &Arc<Inner> {
        &self.owner.inner
    }
}

/// What a killed daemon acknowledged and had not journaled, from its restart
/// log (`io::restart_log`) at `path`: installed on top of the journal's index
/// as writes no flush took. The log follows a commit: the one journaled
/// (records of points it committed are in the journal already), or the one
/// under way at the kill (the log is begun again before the journal is
/// written, with every version not yet committed).
fn replay_restart_log(path: &std::path::Path, o: &mut journal::Opened, unjournaled: &mut Vec<(u64, Version)>) {
    let c = o.committed;
    let records = match RestartLog::previous(path) {
        Previous::Records { identity, records } if identity >= c => records,
        Previous::Overflowed { identity } if identity >= c => {
            tracing::error!(
                "cdp: the previous daemon acknowledged more writes than its restart log holds and was killed before journaling them: they are lost"
            );
            return;
        }
        _ => return,
    };
    let dev_blocks = o.index.cur.len() as u64;
    for (i, r) in records.iter().enumerate() {
        if r.kind != LOG_VERSION || r.a >= dev_blocks || !o.index.slot_ok(r.b) {
            tracing::error!("cdp: restart log record {i} names block {} and data block {}, outside the device: the rest is not replayed", r.a, r.b);
            break;
        }
        if r.c <= c {
            continue;
        }
        let v = Version { fp: c + 1, slot: r.b };
        o.index.install(r.a, v, c, c);
        unjournaled.push((r.a, v));
    }
    if !unjournaled.is_empty() {
        tracing::info!(
            "cdp: {} writes the previous daemon acknowledged and had not journaled, from its restart log",
            unjournaled.len()
        );
    }
}

/// A restart log record: a version installed (block, data block, point).
const LOG_VERSION: u32 = 1;

/// Open (or make) the journal and start the committer; `logs`: the directory
/// of restart logs.
fn start(
    data: Dest,
    journal: Dest,
    geometry: (u64, u64, u64),
    retention: Retention,
    logs: Option<&std::path::Path>,
) -> Result<Arc<Owner>, TargetError> {
    let (block_sectors, data_blocks, dev_blocks) = geometry;
    let mut o = journal::open(&journal, block_sectors as u32, data_blocks, dev_blocks)
        .map_err(|e| format!("cdp journal: {e}"))?;
    let log_path = logs.map(|d| {
        RestartLog::path(d, &format!("cdp-{:016x}", o.sup.nonce), devio::identity(&journal))
    });
    let mut unjournaled = Vec::new();
    if let Some(p) = &log_path {
        replay_restart_log(p, &mut o, &mut unjournaled);
    }
    o.index.rebuild_free();
    tracing::info!(
        "cdp: journal {} ({} points kept, flush {} committed)",
        if o.made { "made" } else { "replayed" },
        o.index.points.len(),
        o.committed
    );
    let low_water = (o.sup.data_blocks / 100).max(64);
    let inner = Arc::new(Inner {
        st: Mutex::new(St {
            ix: o.index,
            issued: o.committed,
            committed: o.committed,
            flushes: o.flushes,
            flushes_committed: o.flushes,
            pending: BTreeMap::new(),
            queue: Vec::new(),
            unjournaled,
            after_commit: Vec::new(),
            phase: 0,
            reads: [0; 2],
            limbo: Vec::new(),
            retiring: Vec::new(),
            waiting: Vec::new(),
            pins: HashMap::new(),
            pos: o.pos,
            retention,
            last_thin: crate::sync::now(),
            failed: None,
            stop: false,
            journal_bytes: 0,
            data_bytes: 0,
            block_bytes: block_sectors * SECTOR,
            restart: None,
        }),
        wake: Cond::new(),
        data,
        journal,
        sup: o.sup,
        block_sectors,
        low_water,
    });
    // what the restart log gave, journaled before a new log replaces it
    let replayed = {
        let mut st = inner.st.lock().unpoisoned();
        (!st.unjournaled.is_empty()).then(|| st.take_number())
    };
    if let Some(n) = replayed {
        inner.commit(Vec::new(), Some(n)).map_err(|e| format!("cdp: journaling the restart log's writes: {e}"))?;
    }
    if let Some(p) = &log_path {
        let sim = devio::sim_of(&inner.journal);
        // a generation holds at most a record a data block and a device block
        // before a commit for room begins the next (at half full)
        let cap = usize::try_from(2 * (data_blocks + dev_blocks)).unwrap_or(usize::MAX);
        match RestartLog::create_on(p, cap, sim) {
            Ok(mut l) => {
                let mut st = inner.st.lock().unpoisoned();
                l.begin(st.committed);
                st.restart = Some(l);
            }
            Err(e) => tracing::warn!(
                "cdp: no restart log ({}: {e}): writes acknowledged and not yet flushed are lost if the daemon is killed",
                p.display()
            ),
        }
    }
    let i = inner.clone();
    let t = crate::sync::spawn("cdp-commit", move || {
        i.committer();
        devio::release_thread_engine();
    })
    .map_err(|e| format!("Couldn't start the commit thread: {e}"))?;
    Ok(Arc::new(Owner {
        inner,
        thread: Mutex::new(Some(t)),
    }))
}

impl Target for Cdp {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let inner = self.inner();
        let bs = inner.block_sectors;
        let block = inner.block_of(&bio);
        // a write or a zeroing of part of a block: refused, as the block layer
        // refuses I/O below the logical block size (the device's is the block's)
        let whole = bio.sector.is_multiple_of(bs) && bio.nr_sectors.is_multiple_of(bs);
        if matches!(bio.op, Op::Write | Op::WriteZeroes) && !whole {
            return Err(MapErr::Errno(errno::EINVAL));
        }
        match bio.op {
            Op::Read => inner.map_read(bio, None, ctx),
            Op::Write if bio.fua => {
                let data = ctx.data_of(&bio).to_vec();
                let mut st = inner.live()?;
                let p = ctx.submit(bio);
                st.queue.push(Req::Fua { block, data, p });
                inner.wake.notify_one();
                Ok(())
            }
            Op::Write => {
                let mut st = inner.live()?;
                let Some(slot) = st.ix.alloc() else {
                    st.waiting.push(ctx.submit(bio));
                    inner.wake.notify_one();
                    return Ok(());
                };
                if st.ix.free_blocks() < inner.low_water {
                    inner.wake.notify_one();
                }
                drop(st);
                let me = inner.clone();
                let hook: EndIo = Arc::new(move |ok, _: &mut [u8]| {
                    me.write_done(block, slot, ok);
                    0
                });
                let dest = Bio {
                    sector: slot * bs,
                    ..bio
                };
                ctx.remap_dest_with(&inner.data, dest, Some(hook))
            }
            Op::Discard | Op::WriteZeroes => {
                let mut st = inner.live()?;
                let first = bio.sector.div_ceil(bs);
                let end = (bio.sector + bio.nr_sectors) / bs;
                for b in first..end {
                    if st.ix.cur[b as usize].slot != ZEROES {
                        st.install(b, ZEROES);
                    }
                }
                drop(st);
                ctx.complete(bio, LeafKind::Drop);
                Ok(())
            }
            Op::Flush => {
                let mut st = inner.live()?;
                let (n, _) = st.issue_point(None);
                let p = ctx.submit(bio);
                st.queue.push(Req::Flush(n, p));
                inner.wake.notify_one();
                Ok(())
            }
        }
    }

    fn table_params(&self) -> String {
        let mut f: Vec<String> = Vec::new();
        let bs = self.inner().block_sectors;
        if bs != DEFAULT_BLOCK_SECTORS {
            f.extend(["block_size".into(), bs.to_string()]);
        }
        for (upto, every) in &self.retention.tiers {
            f.extend(["keep".into(), format!("{}:{}", fmt_duration(*upto), fmt_duration(*every))]);
        }
        if self.retention.max_points != DEFAULT_MAX_POINTS {
            f.extend(["max_points".into(), self.retention.max_points.to_string()]);
        }
        let mut s = format!("{} {}", self.data.table_name(), self.journal.table_name());
        if !f.is_empty() {
            s.push_str(&format!(" {} {}", f.len(), f.join(" ")));
        }
        s
    }

    /// `<used data blocks>/<data blocks> <older versions kept> <points kept>
    /// <first point>-<last point>|- <last flush committed> <journal bytes
    /// written>/<data bytes written>`, then `fail` once the device has failed.
    fn status_params(&self) -> String {
        let st = self.inner().st.lock().unpoisoned();
        let range = flush_range(&st.ix).map_or_else(|| "-".into(), |(a, b)| format!("{a}-{b}"));
        let mut s = format!(
            "{}/{} {} {} {} {} {}/{}",
            st.ix.used,
            self.inner().sup.data_blocks,
            st.ix.kept_versions,
            st.ix.points.len(),
            range,
            st.flushes_committed,
            st.journal_bytes,
            st.data_bytes
        );
        if st.failed.is_some() {
            s.push_str(" fail");
        }
        s
    }

    /// `mark LABEL`: a point now, labelled (answers its flush number);
    /// `points [N]`: the last N points kept (20 unless said), one a line.
    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        let inner = self.inner();
        match words.first().map(|w| w.to_ascii_lowercase()).as_deref() {
            Some("mark") if words.len() == 2 => {
                let label = &words[1];
                let ok = |c: char| c.is_ascii_alphanumeric() || "._-+".contains(c);
                if label.is_empty() || label.len() > MAX_LABEL || !label.chars().all(ok) {
                    return Err(format!(
                        "mark: a label of 1 to {MAX_LABEL} letters, digits and . _ - +, got '{}'",
                        crate::table::bounded(label)
                    ).into());
                }
                let (tx, rx) = crate::sync::reply();
                {
                    let mut st = inner.st.lock().unpoisoned();
                    if st.failed.is_some() {
                        return Err("the cdp device has failed".into());
                    }
                    st.queue.push(Req::Mark {
                        label: label.clone(),
                        flush: 0,
                        reply: tx,
                    });
                }
                inner.wake.notify_one();
                let flush = rx.recv().ok_or("the commit thread went away")??;
                Ok(format!("flush:{flush}"))
            }
            Some("points") if words.len() <= 2 => {
                let n: usize = match words.get(1) {
                    Some(w) => w.parse().map_err(|_| format!("points: '{}' is not a count", crate::table::bounded(w)))?,
                    None => 20,
                };
                let st = inner.st.lock().unpoisoned();
                let mut out: Vec<String> = st
                    .ix
                    .points
                    .iter()
                    .rev()
                    .take(n.min(10_000))
                    .map(|(_, p)| {
                        let t = std::time::UNIX_EPOCH + Duration::from_nanos(p.time_ns);
                        let l = p.label.as_deref().map(|l| format!(" mark:{l}")).unwrap_or_default();
                        format!("flush:{} time:{}{l}", p.flush, humantime::format_rfc3339_nanos(t))
                    })
                    .collect();
                out.reverse();
                Ok(out.join("\n"))
            }
            _ => Err(format!(
                "Unrecognised cdp message: '{}' (mark LABEL, points [N])",
                crate::table::bounded(&words.join(" "))
            ).into()),
        }
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.data, &self.journal]
    }

    fn max_io_len(&self) -> u64 {
        self.inner().block_sectors
    }

    fn logical_block_size(&self) -> u32 {
        (self.inner().block_sectors * SECTOR) as u32
    }

    fn limits(&self) -> Limits {
        Limits {
            discard: true,
            write_zeroes: true,
            ..Limits::stacked(&[&self.data])
        }
    }

    fn view_type(&self) -> Option<&'static str> {
        Some(POINT_TYPE.name)
    }

    fn resume(&self) {
        let mut st = self.inner().st.lock().unpoisoned();
        st.retention = self.retention.clone();
    }
}

/// `cdp-point <cdp dev> <flush:N|mark:LABEL|time:RFC3339>`: the device as it
/// was at that point, read-only. The point is kept while the view exists.
pub struct PointView {
    base: DevRef,
    owner: Arc<Owner>,
    /// The point's number, and its flush number (how the table names it).
    n: u64,
    flush: u64,
}

impl PointView {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<PointView, TargetError> {
        if args.len() != 2 {
            return Err(format!(
                "Invalid argument count: cdp-point takes <cdp dev> <flush:N|mark:LABEL|time:RFC3339>, got {}",
                args.len()
            ).into());
        }
        let base = arg_dev(args, 0, 0, len, r)?;
        let DevRef::Dm(d) = &base else {
            return Err(format!("'{}' is not a dmkit device with a cdp table", args[0]).into());
        };
        let open = r.shared().get_or_init::<Open>();
        let owner = open
            .by_device
            .lock()
            .unpoisoned()
            .get(&d.0.minor)
            .and_then(Weak::upgrade)
            .ok_or_else(|| format!("'{}' is not a dmkit device with a cdp table", args[0]))?;
        let live_is_cdp = d.0.live.load().as_ref().is_some_and(|t| t.entries.len() == 1 && t.entries[0].target.type_name() == TYPE.name);
        if !live_is_cdp {
            return Err(format!("'{}' has no live cdp table", args[0]).into());
        }
        let (n, flush) = owner.inner.resolve(&args[1])?;
        Ok(PointView { base, owner, n, flush })
    }
}

impl Drop for PointView {
    fn drop(&mut self) {
        self.owner.inner.unpin(self.n);
    }
}

impl Target for PointView {
    fn type_name(&self) -> &'static str {
        POINT_TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let inner = &self.owner.inner;
        match bio.op {
            Op::Read => inner.map_read(bio, Some(self.n), ctx),
            Op::Flush => {
                ctx.complete(bio, LeafKind::Drop);
                Ok(())
            }
            _ => Err(MapErr::Errno(libc::EROFS)),
        }
    }

    fn table_params(&self) -> String {
        format!("{} flush:{}", self.base.table_name(), self.flush)
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.base]
    }

    fn max_io_len(&self) -> u64 {
        self.owner.inner.block_sectors
    }

    fn logical_block_size(&self) -> u32 {
        (self.owner.inner.block_sectors * SECTOR) as u32
    }

    fn limits(&self) -> Limits {
        Limits {
            read_only: true,
            discard: false,
            write_zeroes: false,
            ..Limits::stacked(&[&self.base])
        }
    }
}
