//! `thin <pool dev> <dev id> [<external origin dev>]`.
//!
//! A mapped, unshared block takes the fast path: a remap to the data block, FUA and
//! all, with nothing deferred (seed 000). Reads and non-FUA writes of a block the
//! thin's cache knows (`fast.rs`) take no lock; the rest look up under the pool
//! lock. Only I/O to an unmapped block, a write to a shared block, or I/O to a
//! block being provisioned takes the slow path, and it never blocks the thread that maps: the piece is taken
//! ([`Pending`](crate::mapper::engine::Pending)); the copy engine's threads prepare the new data block (copied from
//! the shared block or the origin, or zeroed); the write is then sent on to it, and
//! the mapping is inserted once the write has landed, so a crash never exposes
//! unwritten data. Pieces for a block being provisioned wait in the bio prison and
//! are requeued when it is mapped; pieces waiting for data space wait in the pool.

use crate::mapper::TargetError;
use super::{Key, Mode, Pool};
use crate::copier::Copier;
use crate::io::{errno, EndIo, LeafKind, Op, SECTOR};
use crate::mapper::devio;
use crate::mapper::engine::Dest;
use crate::mapper::Device;
use crate::mapper::{arg_u64, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use std::sync::{Arc, Weak};

pub struct ThinDev {
    pool: Arc<Pool>,
    /// Mapped, unshared blocks of this thin, read without the pool lock.
    fast: Arc<super::fast::FastMap>,
    /// The pool device: data I/O is remapped through it.
    pool_dev: DevRef,
    /// The device whose table this target is in (the pool suspends it with itself).
    dev: Weak<Device>,
    id: u64,
    origin: Option<(DevRef, Dest)>,
    bs: u64,
    discard: bool,
}

impl ThinDev {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<ThinDev, TargetError> {
        if !(2..=3).contains(&args.len()) {
            return Err(format!(
                "thin takes 2 or 3 arguments (<pool dev> <dev id> [<external origin dev>]), got {}",
                args.len()
            ).into());
        }
        let pool_dev = r
            .open(&args[0])
            .map_err(|e| format!("pool device '{}': {e}", args[0]))?;
        let DevRef::Dm(hold) = &pool_dev else {
            return Err(format!("'{}' is not a thin-pool device", args[0]).into());
        };
        // The pool is found in the registry's shared state by the device that owns
        // it; that device's live table must be a thin-pool now.
        let is_pool = hold.0.live.load_full().is_some_and(|t| {
            t.entries.len() == 1 && t.entries[0].target.type_name() == super::pool::TYPE.name
        });
        let pool = is_pool
            .then(|| r.shared().get_or_init::<super::Pools>().owned_by(&hold.0))
            .flatten()
            .ok_or_else(|| format!("'{}' is not a thin-pool device", args[0]))?;
        let id = arg_u64(args, 1, "device id")?;
        let origin = match args.get(2) {
            None => None,
            Some(o) => {
                // a file, a block device or a dmkit device (a cdp device's past,
                // `cdp-point`, makes a writable snapshot of a point so)
                let d = r.open(o).map_err(|e| format!("external origin '{o}': {e}"))?;
                let dest = d.dest();
                Some((d, dest))
            }
        };
        let (discard, fast) = {
            let mut m = pool.lock();
            if !m.md.devices().contains(&id) {
                return Err(format!(
                    "thin device {id} does not exist in the pool (create_thin first)"
                ).into());
            }
            m.active.push((id, Arc::downgrade(r.device())));
            (
                m.features.discard_enabled,
                m.fast_map(id, len.div_ceil(pool.block_sectors)),
            )
        };
        let bs = pool.block_sectors;
        Ok(ThinDev {
            pool,
            fast,
            pool_dev,
            dev: Arc::downgrade(r.device()),
            id,
            origin,
            bs,
            discard,
        })
    }

    /// Sectors of the external origin (0 without one).
    fn origin_sectors(&self) -> u64 {
        self.origin.as_ref().map_or(0, |(d, _)| d.size_sectors())
    }

    fn data_sector(&self, block: u64, off: u64) -> u64 {
        block * self.bs + off
    }

    fn fail(ctx: &mut MapCtx, bio: Bio, e: i32) -> Result<(), MapErr> {
        ctx.complete(bio, LeafKind::Fail(e));
        Ok(())
    }

    /// One piece within one block.
    fn map_piece(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (vblock, off) = (bio.sector / self.bs, bio.sector % self.bs);
        // The fast path without the pool lock: a read, or a write without FUA (a
        // FUA write asks whether the thin changed since the last commit), of a
        // block the cache knows mapped and unshared. The pool device is entered
        // first, so a discard that unmaps the block (it clears the cache entry
        // before it waits for the pool's I/O to drain) waits for this I/O too.
        if matches!(bio.op, Op::Read | Op::Write) && !bio.fua {
            if let DevRef::Dm(pd) = &self.pool_dev {
                let took = ctx.hold_device(&pd.0)?;
                if let Some(b) = self.fast.get(vblock) {
                    let sector = self.data_sector(b, off);
                    return self.remap_pool(Bio { sector, ..bio }, bio, ctx);
                }
                if let Some(h) = took {
                    // a miss: the slow path must not hold the pool's epoch while it
                    // waits (for space, in the prison)
                    ctx.release_hold(h);
                }
            }
        }
        let Some((m, found)) = self.lookup_locked(bio, vblock, ctx) else {
            return Ok(());
        };
        match (bio.op, found) {
            // The fast path: reads of any mapped block, writes to unshared ones.
            (Op::Read, Some(map)) | (Op::Write, Some(map @ crate::thin::Mapping { shared: false, .. })) => {
                if !map.shared {
                    self.fast.set(vblock, map.data_block);
                }
                // A FUA write is durable only with its mapping: if this thin
                // changed since the last commit, a flush (a commit) follows it
                // before it completes (the kernel's bio_triggers_commit). Seed
                // 000's fast path holds for the rest, a provisioned thin at rest.
                if bio.fua && m.md.changed(self.id) {
                    ctx.flush_after();
                }
                // Remapped (so counted in the pool device's epoch) before the lock
                // goes: a discard of this block and the commit that frees it for
                // reuse must wait for this I/O, and that commit waits only for I/O
                // that entered the pool device before it began.
                let sector = self.data_sector(map.data_block, off);
                let r = self.remap_pool(Bio { sector, ..bio }, bio, ctx);
                drop(m);
                r
            }
            (Op::Read, None) => {
                drop(m);
                self.read_unmapped(bio, ctx)
            }
            (Op::WriteZeroes, None) if self.origin.is_none() => {
                ctx.complete(bio, LeafKind::Drop); // already reads as zeroes
                Ok(())
            }
            (Op::WriteZeroes, Some(map @ crate::thin::Mapping { shared: false, .. })) => {
                // under the lock, as above
                let sector = self.data_sector(map.data_block, off);
                let r = self.remap_pool(Bio { sector, ..bio }, bio, ctx);
                drop(m);
                r
            }
            _ => self.provision(m, bio, found.map(|x| x.data_block), ctx),
        }
    }

    /// Under the pool lock: the mapping of `vblock`, unless the block is being
    /// provisioned (the piece waits in the prison for it) or the lookup failed (the
    /// piece fails), in which case None and the piece is taken care of.
    fn lookup_locked(
        &self,
        bio: Bio,
        vblock: u64,
        ctx: &mut MapCtx,
    ) -> Option<(
        std::sync::MutexGuard<'_, super::PoolMd>,
        Option<crate::thin::Mapping>,
    )> {
        let mut m = self.pool.lock();
        if let Some(waiters) = m.prison.get_mut(&Key::Virtual(self.id, vblock)) {
            waiters.push(ctx.submit(bio));
            return None;
        }
        match m.md.lookup(self.id, vblock) {
            Ok(found) => Some((m, found)),
            Err(e) => {
                self.pool.metadata_failed(&mut m, &e);
                drop(m);
                ctx.complete(bio, LeafKind::Fail(errno::EIO));
                None
            }
        }
    }

    /// Reads of an unmapped block: the external origin where it reaches, else zeroes.
    fn read_unmapped(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let limit = self.origin_sectors();
        let start = bio.sector;
        let in_origin = limit.saturating_sub(start).min(bio.nr_sectors);
        if let (Some((o, _)), true) = (&self.origin, in_origin > 0) {
            ctx.remap(o, bio.sub(0, in_origin, start), 0)?;
        }
        if in_origin < bio.nr_sectors {
            let rest = bio.nr_sectors - in_origin;
            ctx.complete(bio.sub(in_origin, rest, start + in_origin), LeafKind::ZeroFill);
        }
        Ok(())
    }

    /// The slow path for a write (or write-zeroes) to an unmapped or shared block:
    /// allocate, prepare the rest of the new block, write, map on completion. The
    /// preparation runs on the copy engine's threads while the piece waits.
    fn provision(
        &self,
        mut m: std::sync::MutexGuard<'_, super::PoolMd>,
        bio: Bio,
        old: Option<u64>,
        ctx: &mut MapCtx,
    ) -> Result<(), MapErr> {
        if m.mode == Mode::ReadOnly {
            return Self::fail(ctx, bio, errno::EIO);
        }
        if !m.reserve_log_record() {
            // the restart log holds as many uncommitted mappings as it can: the
            // write waits for the commit that empties it (never acknowledged
            // unrecorded)
            m.log_waiters.push(ctx.submit(bio));
            self.pool.request_commit(&m);
            return Ok(());
        }
        let new = match self.pool.alloc(&mut m) {
            Ok(b) => b,
            Err(true) => {
                m.release_log_record();
                // queued until the pool grows, space comes back, the timeout, or a suspend
                m.no_space.push(ctx.submit(bio));
                return Ok(());
            }
            Err(false) => {
                m.release_log_record();
                let e = if m.features.error_if_no_space {
                    errno::ENOSPC
                } else {
                    errno::EIO
                };
                return Self::fail(ctx, bio, e);
            }
        };
        let (vblock, off) = (bio.sector / self.bs, bio.sector % self.bs);
        let key = Key::Virtual(self.id, vblock);
        m.prison.insert(key, Vec::new());
        let zero_new = m.features.zero_new_blocks;
        drop(m);
        let range = (off * SECTOR, bio.nr_sectors * SECTOR);
        let zeroes = bio.op == Op::WriteZeroes;
        let written = if zeroes { (0, 0) } else { range };
        let mut jobs = self.prepare_jobs(new, old, vblock, written, zero_new);
        if zeroes {
            // the zeroed range itself, then the block is mapped: nothing to write
            let at = self.data_sector(new, 0) * SECTOR + range.0;
            jobs.push(Job::Zero(self.pool.data.clone(), at, range.1));
        }
        let cell = Cell {
            pool: self.pool.clone(),
            id: self.id,
            new,
            vblock,
        };
        let data = Bio {
            sector: self.data_sector(new, off),
            ..bio
        };
        if jobs.is_empty() {
            // Nothing to prepare (the write covers the block, or zeroing is off):
            // write now, map once it has landed.
            return ctx.remap_with(&self.pool_dev, data, 0, cell.end_io());
        }
        let pending = ctx.submit(bio);
        let dest = self.pool_dev.dest();
        self.pool
            .copier
            .spawn(Box::new(move |c: &Copier| match run_jobs(c, &jobs) {
                Err(e) => {
                    tracing::warn!("thin {}: preparing data block {}: {e}", cell.id, cell.new);
                    let _ = cell.finish(false);
                    pending.fail(errno::EIO);
                }
                Ok(()) if zeroes => match cell.finish(true) {
                    0 => pending.done(),
                    e => pending.fail(e),
                },
                Ok(()) => pending.remap(dest, data, Some(cell.end_io())),
            }));
        Ok(())
    }

    /// The copy engine's work to fill the parts of data block `new` outside
    /// `written` (byte offset, length in the block): from the old shared block, else
    /// from the external origin (zeroes past its end), else zeroes unless zeroing is off.
    fn prepare_jobs(
        &self,
        new: u64,
        old: Option<u64>,
        vblock: u64,
        written: (u64, u64),
        zero_new: bool,
    ) -> Vec<Job> {
        let block_bytes = self.bs * SECTOR;
        let base = self.data_sector(new, 0) * SECTOR;
        let (a, b) = (written.0, written.0 + written.1);
        let data = &self.pool.data;
        let mut jobs = Vec::new();
        for (lo, hi) in [(0, a), (b, block_bytes)] {
            if hi <= lo {
                continue;
            }
            if let Some(o) = old {
                let src = self.data_sector(o, 0) * SECTOR;
                jobs.push(Job::Copy(
                    data.clone(),
                    src + lo,
                    data.clone(),
                    base + lo,
                    hi - lo,
                ));
            } else if let Some((_, od)) = &self.origin {
                let vstart = vblock * block_bytes;
                let origin_bytes = self.origin_sectors() * SECTOR;
                let copy_hi = origin_bytes.saturating_sub(vstart).clamp(lo, hi);
                if copy_hi > lo {
                    jobs.push(Job::Copy(
                        od.clone(),
                        vstart + lo,
                        data.clone(),
                        base + lo,
                        copy_hi - lo,
                    ));
                }
                if hi > copy_hi {
                    jobs.push(Job::Zero(data.clone(), base + copy_hi, hi - copy_hi));
                }
            } else if zero_new {
                jobs.push(Job::Zero(data.clone(), base + lo, hi - lo));
            }
        }
        jobs
    }

    /// Send `data` (a piece remapped to the data device's sectors) through the pool
    /// device; an error fails the piece (`orig`, in this thin's sectors), and a
    /// suspended pool device requeues the request.
    fn remap_pool(&self, data: Bio, orig: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let mark = ctx.mark();
        match ctx.remap(&self.pool_dev, data, 0) {
            Err(MapErr::Errno(e)) => {
                ctx.abandon_since(mark);
                ctx.complete(orig, LeafKind::Fail(e));
                Ok(())
            }
            r => r,
        }
    }

    fn discard_piece(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let (vblock, off) = (bio.sector / self.bs, bio.sector % self.bs);
        let m = self.pool.lock();
        // Only whole blocks are unmapped; a discard is advisory, so a partial one does nothing.
        if !m.features.discard_enabled || off != 0 || bio.nr_sectors != self.bs || m.mode == Mode::ReadOnly {
            drop(m);
            ctx.complete(bio, LeafKind::Drop);
            return Ok(());
        }
        drop(m);
        let Some((mut m, found)) = self.lookup_locked(bio, vblock, ctx) else {
            return Ok(());
        };
        if found.is_none() {
            drop(m);
            ctx.complete(bio, LeafKind::Drop);
            return Ok(());
        }
        // I/O already in flight may still read or write this block: the unmap
        // waits for it on the pool's thread, with the block in the prison so that
        // I/O arriving meanwhile waits too (`Pool::commit_now`).
        m.prison.insert(Key::Virtual(self.id, vblock), Vec::new());
        let d = super::Discard {
            id: self.id,
            vblock,
            piece: ctx.submit(bio),
            pool_dev: self.pool_dev.dest(),
        };
        self.pool.queue_discard(&mut m, d);
        Ok(())
    }

    /// An empty flush: the metadata must be committed first if it changed; the
    /// commit thread sends the flush on once it has. It fails if a metadata
    /// failure dropped this thin's uncommitted changes (the kernel's `issue`):
    /// the pool is read-only then, nothing is committed any more, and passing
    /// would make the writes it covers (a FUA write's own, too) look durable.
    fn flush(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let mut m = self.pool.lock();
        if m.aborted.contains(&self.id) {
            drop(m);
            return Self::fail(ctx, bio, errno::EIO);
        }
        if m.dirty && m.mode != Mode::ReadOnly {
            let t = self.pool.request_commit(&m);
            let p = ctx.submit(bio);
            m.flush_waiters.push((t, self.id, p, self.pool_dev.dest()));
            return Ok(());
        }
        drop(m);
        self.remap_pool(bio, bio, ctx)
    }
}

/// Copy-engine work preparing a new data block.
enum Job {
    /// (source, offset, destination, offset, length), in bytes (whole sectors)
    Copy(Dest, u64, Dest, u64, u64),
    /// (destination, offset, length)
    Zero(Dest, u64, u64),
}

fn run_jobs(c: &Copier, jobs: &[Job]) -> std::io::Result<()> {
    for j in jobs {
        match j {
            Job::Copy(src, so, dst, d, len) => devio::copy(c, src, so / SECTOR, dst, d / SECTOR, len / SECTOR, false)?,
            Job::Zero(dst, d, len) => devio::zero(c, dst, d / SECTOR, len / SECTOR)?,
        }
    }
    Ok(())
}

/// A block being provisioned: the prison cell of (thin, virtual block) and the
/// data block reserved for it.
#[derive(Clone)]
struct Cell {
    pool: Arc<Pool>,
    id: u64,
    new: u64,
    vblock: u64,
}

impl Cell {
    /// The write to the new block has landed (or failed, or never went): map it,
    /// or give the block back; either way pieces waiting for it go again.
    fn finish(&self, ok: bool) -> i32 {
        let mut m = self.pool.lock();
        m.forget_block(self.id, self.vblock);
        m.release_log_record();
        let mut res = 0;
        if !ok {
            let _ = m.md.release_data_block(self.new);
        } else if m.mode == Mode::ReadOnly {
            // The pool failed while the block was being written: its transaction
            // (the block's allocation with it) is gone and nothing more is
            // committed, so the write cannot be mapped and must not succeed
            // (the kernel's process_prepared_mapping_fail).
            res = errno::EIO;
        } else {
            match m.md.insert(self.id, self.vblock, self.new) {
                Ok(()) => {
                    m.dirty = true;
                    // before the write is acknowledged: a daemon started after
                    // this one is killed maps it again (io::restart_log); room
                    // was reserved for it, so this fails only if the log broke
                    if !m.log_mapping(self.id, self.vblock, self.new) {
                        tracing::error!(
                            "thin {}: block {}: its mapping could not be recorded in the restart log: the write fails",
                            self.id,
                            self.vblock
                        );
                        self.pool.request_commit(&m);
                        res = errno::EIO;
                    }
                }
                Err(e) => {
                    self.pool.metadata_failed(&mut m, &e);
                    res = errno::EIO;
                }
            }
        }
        let waiters = m.prison.remove(&Key::Virtual(self.id, self.vblock));
        drop(m);
        for p in waiters.into_iter().flatten() {
            p.requeue();
        }
        res
    }

    fn end_io(self) -> EndIo {
        Arc::new(move |ok, _: &mut [u8]| self.finish(ok))
    }
}

impl Drop for ThinDev {
    fn drop(&mut self) {
        let mut m = self.pool.lock();
        // one entry per target: any of this thin's on the same device will do
        if let Some(i) = m
            .active
            .iter()
            .position(|(id, d)| *id == self.id && Weak::ptr_eq(d, &self.dev))
        {
            m.active.swap_remove(i);
        }
        // the last table of this thin takes its cache along (the pool's and ours)
        if m.fast.get(&self.id).is_some_and(|f| Arc::strong_count(f) <= 2) {
            m.fast.remove(&self.id);
        }
    }
}

/// The `thin` target type.
pub const TYPE: TargetType = TargetType {
    name: "thin",
    version: [1, 23, 0],
    new: |args, len, r| Ok(Box::new(ThinDev::new(args, len, r)?)),
    sync: None,
};

impl Target for ThinDev {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }
    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        if bio.op == Op::Flush {
            return self.flush(bio, ctx);
        }
        // Reads and writes come one data block at a time (max_io_len); discards
        // and zeroing by range, taken here a block at a time.
        let mut done = 0;
        while done < bio.nr_sectors {
            let s = bio.sector + done;
            let n = (self.bs - s % self.bs).min(bio.nr_sectors - done);
            let piece = bio.sub(done, n, s);
            if bio.op == Op::Discard {
                self.discard_piece(piece, ctx)?;
            } else {
                self.map_piece(piece, ctx)?;
            }
            done += n;
        }
        Ok(())
    }
    fn max_io_len(&self) -> u64 {
        self.bs
    }
    fn table_params(&self) -> String {
        let mut s = format!("{} {}", self.pool_dev.table_name(), self.id);
        if let Some((o, _)) = &self.origin {
            s.push(' ');
            s.push_str(&o.table_name());
        }
        s
    }
    fn status_params(&self) -> String {
        let mut m = self.pool.lock();
        let mapped = m.md.mapped_blocks(self.id).unwrap_or(0);
        let highest = m.md.highest_mapped(self.id).ok().flatten();
        let hi = highest.map_or("-".to_string(), |h| ((h + 1) * self.bs - 1).to_string());
        format!("{} {hi}", mapped * self.bs)
    }
    fn devices(&self) -> Vec<&DevRef> {
        let mut v = vec![&self.pool_dev];
        if let Some((o, _)) = &self.origin {
            v.push(o);
        }
        v
    }
    /// The pool device's limits, but discards only where the pool takes them (an
    /// `ignore_discard` pool's thins refuse them, as the kernel's do), as the pool's
    /// features were when this table was built.
    fn limits(&self) -> Limits {
        Limits {
            discard: self.discard,
            write_zeroes: true,
            ..self.pool_dev.limits()
        }
    }
    /// Pieces of this device queued for space are requeued: they wait for the
    /// resume at the top, holding nothing, so the suspend returns at once.
    fn presuspend(&self) {
        self.pool.requeue_no_space();
    }
    fn extents(&self, sector: u64, nr: u64, out: &mut Vec<(u64, u32)>) -> Result<(), TargetError> {
        // Unmapped blocks are holes (zeroes unless an external origin shows through).
        // A lookup that fails fails the request and the pool (read-only,
        // needs_check): "hole" would let a client skip data it should have copied.
        let hole = if self.origin.is_some() { 1 } else { 3 };
        let mut m = self.pool.lock();
        let mut s = sector;
        while s < sector + nr {
            let n = (self.bs - s % self.bs).min(sector + nr - s);
            match m.md.lookup(self.id, s / self.bs) {
                Ok(found) => out.push((n * SECTOR, if found.is_some() { 0 } else { hole })),
                Err(e) => {
                    self.pool.metadata_failed(&mut m, &e);
                    return Err(format!("thin device {} block {}: {e}", self.id, s / self.bs).into());
                }
            }
            s += n;
        }
        Ok(())
    }
    /// A base is an older thin of the same pool this device still shares data
    /// with (a snapshot it came from, or one taken of it): its id, as a number.
    fn check_base(&self, base: &str) -> Result<(), TargetError> {
        let b: u64 = base
            .parse()
            .map_err(|_| format!("base '{base}' is not a thin device id of the pool"))?;
        if b == self.id {
            return Err(format!("base {b} is the device itself").into());
        }
        let mut m = self.pool.lock();
        if m.md.device_details(b).is_err() {
            return Err(format!("thin device {b} does not exist in the pool").into());
        }
        // related: they share a data block, or the base maps nothing
        let mut base_blocks = std::collections::HashSet::new();
        m.md.mappings_in(b, 0, u64::MAX, &mut |_, d, _| {
            base_blocks.insert(d);
        })
        .map_err(|e| format!("reading thin device {b}: {e}"))?;
        if base_blocks.is_empty() {
            return Ok(());
        }
        let mut shared = false;
        m.md.mappings_in(self.id, 0, u64::MAX, &mut |_, d, _| {
            shared |= base_blocks.contains(&d)
        })
        .map_err(|e| format!("reading thin device {}: {e}", self.id))?;
        if shared {
            Ok(())
        } else {
            Err(format!(
                "thin device {b} shares no data with thin device {}: not an ancestor",
                self.id
            ).into())
        }
    }
    /// Blocks whose mapping differs from the base's (mapped to another data block,
    /// or mapped in one and not the other) are changed.
    fn changed_extents(
        &self,
        base: &str,
        sector: u64,
        nr: u64,
        out: &mut Vec<(u64, u32)>,
    ) -> Result<(), TargetError> {
        let Ok(b) = base.parse::<u64>() else {
            out.push((nr * SECTOR, 1));
            return Ok(());
        };
        let (lo, hi) = (sector / self.bs, (sector + nr).div_ceil(self.bs));
        let mut m = self.pool.lock();
        let mut mine = Vec::new();
        let mut theirs = Vec::new();
        let read =
            m.md.mappings_in(self.id, lo, hi, &mut |v, d, _| mine.push((v, d)))
                .and_then(|()| m.md.mappings_in(b, lo, hi, &mut |v, d, _| theirs.push((v, d))));
        if let Err(e) = read {
            self.pool.metadata_failed(&mut m, &e);
            return Err(format!("thin device {} against {b}: {e}", self.id).into());
        }
        drop(m);
        let (mut i, mut j) = (0, 0);
        let mut s = sector;
        let end = sector + nr;
        while s < end {
            let blk = s / self.bs;
            let n = (self.bs - s % self.bs).min(end - s);
            while i < mine.len() && mine[i].0 < blk {
                i += 1;
            }
            while j < theirs.len() && theirs[j].0 < blk {
                j += 1;
            }
            let a = mine.get(i).filter(|x| x.0 == blk).map(|x| x.1);
            let c = theirs.get(j).filter(|x| x.0 == blk).map(|x| x.1);
            out.push((n * SECTOR, u32::from(a != c)));
            s += n;
        }
        Ok(())
    }
}
