//! `era <metadata dev> <origin dev> <block size>`: dm-era. Every block of the
//! origin written is recorded in the current era's writeset; a `checkpoint`
//! message starts a new era, archiving the writeset, and archived writesets are
//! digested into the era array (block -> last era written), in the kernel's
//! metadata format (`crate::era`), so `era_invalidate` lists the blocks written
//! since a given era.
//!
//! Crash safety as the kernel's: a write to a block not yet marked in the
//! current writeset waits while the mark is committed, so after a crash every
//! block written in an era is in that era's writeset or a later one's. Reads
//! and flushes pass through (a flush commits first when the digest left
//! changes); discards and zeroing mark every block they cover, as writes.
//! A worker thread marks, commits, digests, and commits at least every second
//! while anything is uncommitted.

use crate::mapper::TargetError;
use crate::era::metadata::Stats;
use crate::era::superblock::MIN_BLOCK_SIZE;
use crate::era::EraMetadata;
use crate::io::{errno, Op};
use crate::mapper::engine::Pending;
use crate::mapper::{Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use crate::sync::Unpoison;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// The `era` target type (the 6.12 kernel's dm-era version).
pub const TYPE: TargetType = TargetType {
    name: "era",
    version: [1, 0, 0],
    new: |args, len, r| Ok(Box::new(Era::new(args, len, r)?)),
    sync: None,
};

/// The longest anything stays uncommitted.
const COMMIT_PERIOD: Duration = Duration::from_secs(1);
/// Digest steps between looks at the queue.
const DIGEST_BURST: usize = 64;

struct Md {
    md: EraMetadata,
    /// The origin's size in blocks as the last resume saw it (0: never resumed).
    nr_blocks: u64,
    /// A metadata operation failed: writes fail from then on.
    failed: bool,
    /// The digest failed: it stops until the next resume, as the kernel's.
    digest_off: bool,
}

#[derive(Default)]
struct Queue {
    writes: Vec<Pending>,
    flushes: Vec<Pending>,
    stop: bool,
}

struct State {
    md: Mutex<Md>,
    queue: Mutex<Queue>,
    wake: crate::sync::Cond,
    /// The current era's blocks marked and committed (the kernel's in-core
    /// writeset): a write to one passes straight through.
    bits: RwLock<Vec<AtomicU64>>,
    /// The metadata has uncommitted changes (the digest's).
    dirty: AtomicBool,
    /// The digest has work: the worker comes back at once.
    digesting: AtomicBool,
    failed: AtomicBool,
    /// Suspended (after postsuspend): the worker leaves the metadata alone, as
    /// the kernel stops its worker.
    suspended: AtomicBool,
    block_sectors: u64,
}

pub struct Era {
    metadata: DevRef,
    origin: DevRef,
    /// The target's length in sectors.
    len: u64,
    block_sectors: u64,
    st: Arc<State>,
    worker: Mutex<Option<crate::sync::Thread<()>>>,
}

/// The metadata on a file, or on another dmkit device (read and written through
/// its table).
fn open_metadata(dev: &DevRef, block_size: u32) -> Result<EraMetadata, TargetError> {
    let d = crate::mapper::devio::metadata_dev(&dev.dest()).map_err(|e| e.to_string())?;
    EraMetadata::open_or_format(d, block_size).map_err(|e| TargetError::invalid(e.to_string()))
}

impl Era {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Era, TargetError> {
        if args.len() != 3 {
            return Err("Invalid argument count".into());
        }
        let metadata = r
            .open(&args[0])
            .map_err(|e| format!("Error opening metadata device: {e}"))?;
        let origin = r
            .open(&args[1])
            .map_err(|e| format!("Error opening data device: {e}"))?;
        let bs: u32 = args[2]
            .parse()
            .map_err(|_| "Error parsing block size".to_string())?;
        if bs == 0 || !bs.is_multiple_of(MIN_BLOCK_SIZE) {
            return Err("Invalid block size".into());
        }
        if let DevRef::Dm(o) = &origin {
            r.size_check(&o.0, &args[1], len);
        } else if origin.size_sectors() < len {
            return Err(format!(
                "Error opening data device: {} sectors, smaller than the target's {len}",
                origin.size_sectors()
            ).into());
        }
        let md = open_metadata(&metadata, bs).map_err(|e| format!("Error reading metadata: {e}"))?;
        let st = Arc::new(State {
            md: Mutex::new(Md {
                md,
                nr_blocks: 0,
                failed: false,
                digest_off: false,
            }),
            queue: Mutex::new(Queue::default()),
            wake: crate::sync::Cond::new(),
            bits: RwLock::new(Vec::new()),
            dirty: AtomicBool::new(false),
            digesting: AtomicBool::new(true),
            failed: AtomicBool::new(false),
            suspended: AtomicBool::new(true),
            block_sectors: bs as u64,
        });
        let s = st.clone();
        let worker = crate::sync::spawn("dmkit-era", move || s.work())
            .map_err(|e| format!("could not create the era worker: {e}"))?;
        Ok(Era {
            metadata,
            origin,
            len,
            block_sectors: bs as u64,
            st,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Run a metadata operation and commit, as the kernel's rpc to its worker.
    fn rpc<T>(&self, f: impl FnOnce(&mut EraMetadata) -> Result<T, TargetError>) -> Result<T, TargetError> {
        let mut m = self.st.md.lock().unpoisoned();
        if m.failed {
            return Err("metadata operation failed earlier: the era device fails writes".into());
        }
        let r = f(&mut m.md);
        let c = m.md.commit().map_err(|e| e.to_string());
        if c.is_err() {
            self.st.fail(&mut m);
        }
        self.st.dirty.store(m.md.dirty(), Ordering::SeqCst);
        drop(m);
        let v = r?;
        c?;
        Ok(v)
    }
}

impl State {
    fn blocks_of(&self, bio: &Bio) -> std::ops::Range<u64> {
        let first = bio.sector / self.block_sectors;
        let end = (bio.sector + bio.nr_sectors.max(1)).div_ceil(self.block_sectors);
        first..end
    }

    fn marked(&self, blocks: std::ops::Range<u64>) -> bool {
        let bits = self.bits.read().unpoisoned();
        blocks.into_iter().all(|b| {
            bits.get((b / 64) as usize)
                .is_some_and(|w| w.load(Ordering::Acquire) & (1 << (b % 64)) != 0)
        })
    }

    /// The in-core writeset of a new era: nothing marked, `nr_blocks` long
    /// (an error, not an abort, when memory cannot hold it).
    fn reset_bits(&self, nr_blocks: u64) -> Result<(), TargetError> {
        let words = nr_blocks.div_ceil(64) as usize;
        let mut bits = self.bits.write().unpoisoned();
        if bits.len() != words {
            let mut v: Vec<AtomicU64> = Vec::new();
            v.try_reserve_exact(words)
                .map_err(|_| format!("no memory for the in-core writeset of {nr_blocks} blocks"))?;
            v.extend((0..words).map(|_| AtomicU64::new(0)));
            *bits = v;
        } else {
            bits.iter().for_each(|w| w.store(0, Ordering::Release));
        }
        Ok(())
    }

    /// Start a new era: archive the current writeset, a new one on disk, and
    /// the in-core one cleared before anything commits, so a write mapped from
    /// now on waits for its mark in the new era.
    fn new_era(&self, md: &mut EraMetadata) -> Result<(), TargetError> {
        md.rollover().map_err(|e| format!("metadata_era_rollover failed: {e}"))?;
        self.reset_bits(md.nr_blocks())
    }

    fn fail(&self, m: &mut Md) {
        m.failed = true;
        self.failed.store(true, Ordering::SeqCst);
    }

    fn stop(&self) {
        self.queue.lock().unpoisoned().stop = true;
        self.wake.notify_all();
    }

    /// The worker: mark deferred writes and commit before they go on, commit
    /// for flushes, digest, and commit what is left at least every second.
    fn work(&self) {
        let mut last_commit = crate::sync::now();
        loop {
            let (writes, flushes) = {
                let mut q = self.queue.lock().unpoisoned();
                let busy = self.digesting.load(Ordering::SeqCst);
                if q.writes.is_empty() && q.flushes.is_empty() && !q.stop {
                    let wait = if busy { Duration::from_millis(1) } else { COMMIT_PERIOD };
                    q = self.wake.wait_timeout(&self.queue, q, wait).0;
                }
                if q.stop {
                    return;
                }
                (std::mem::take(&mut q.writes), std::mem::take(&mut q.flushes))
            };
            let mut m = self.md.lock().unpoisoned();
            if m.failed {
                writes.into_iter().chain(flushes).for_each(|p| p.fail(errno::EIO));
                continue;
            }
            if self.suspended.load(Ordering::SeqCst) {
                // held until the resume (the engine parks them meanwhile)
                writes.into_iter().chain(flushes).for_each(Pending::requeue);
                drop(m);
                crate::sync::sleep(Duration::from_millis(1));
                continue;
            }
            let mut ok = true;
            let mut newly = Vec::new();
            for p in &writes {
                for b in self.blocks_of(&p.bio()) {
                    if self.marked(b..b + 1) {
                        continue;
                    }
                    match m.md.mark(b) {
                        Ok(_) => newly.push(b),
                        Err(e) => {
                            tracing::error!("era: marking block {b} failed: {e}");
                            ok = false;
                        }
                    }
                }
            }
            let want_commit = !newly.is_empty() || (!flushes.is_empty() && m.md.dirty());
            if ok && want_commit {
                if let Err(e) = m.md.commit() {
                    tracing::error!("era: metadata commit failed: {e}");
                    ok = false;
                } else {
                    last_commit = crate::sync::now();
                }
            }
            if !ok {
                self.fail(&mut m);
                writes.into_iter().chain(flushes).for_each(|p| p.fail(errno::EIO));
                continue;
            }
            {
                let bits = self.bits.read().unpoisoned();
                for b in newly {
                    if let Some(w) = bits.get((b / 64) as usize) {
                        w.fetch_or(1 << (b % 64), Ordering::Release);
                    }
                }
            }
            // marked and durable: they go on (mapped again, now passing through)
            writes.into_iter().chain(flushes).for_each(Pending::requeue);
            // the digest, a burst at a time, between the queue's work
            for _ in 0..DIGEST_BURST {
                if m.digest_off {
                    break;
                }
                match m.md.digest_step() {
                    Ok(true) => {}
                    Ok(false) => break,
                    Err(e) => {
                        // as the kernel: the digest stops, the device carries on
                        tracing::error!("era: digest step failed, stopping digestion: {e}");
                        m.digest_off = true;
                    }
                }
            }
            let digesting = !m.digest_off && m.md.digest_pending();
            if m.md.dirty() && (crate::sync::since(last_commit) >= COMMIT_PERIOD || !digesting) {
                match m.md.commit() {
                    Ok(()) => last_commit = crate::sync::now(),
                    Err(e) => {
                        tracing::error!("era: periodic commit failed: {e}");
                        self.fail(&mut m);
                    }
                }
            }
            self.dirty.store(m.md.dirty(), Ordering::SeqCst);
            self.digesting.store(digesting, Ordering::SeqCst);
        }
    }
}

impl Drop for Era {
    fn drop(&mut self) {
        self.st.stop();
        if let Some(h) = self.worker.lock().unpoisoned().take() {
            let _ = h.join();
        }
    }
}

impl Target for Era {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let writes = matches!(bio.op, Op::Write | Op::Discard | Op::WriteZeroes);
        let pass = match bio.op {
            Op::Read => true,
            Op::Flush => !self.st.dirty.load(Ordering::SeqCst),
            _ => self.st.marked(self.st.blocks_of(&bio)),
        };
        if writes && self.st.failed.load(Ordering::SeqCst) {
            return Err(MapErr::Errno(errno::EIO));
        }
        if pass {
            return ctx.remap(&self.origin, bio, 0);
        }
        let p = ctx.submit(bio);
        let mut q = self.st.queue.lock().unpoisoned();
        if bio.op == Op::Flush {
            q.flushes.push(p);
        } else {
            q.writes.push(p);
        }
        drop(q);
        self.st.wake.notify_all();
        Ok(())
    }

    fn table_params(&self) -> String {
        format!(
            "{} {} {}",
            self.metadata.table_name(),
            self.origin.table_name(),
            self.block_sectors
        )
    }

    fn status_params(&self) -> String {
        match self.rpc(|md| Ok(md.stats())) {
            Ok(Stats {
                used,
                total,
                era,
                snap,
            }) => {
                let snap = if snap == 0 { "-".to_string() } else { snap.to_string() };
                format!(
                    "{} {used}/{total} {era} {snap}",
                    crate::era::superblock::METADATA_BLOCK_SECTORS
                )
            }
            Err(_) => "Error".into(),
        }
    }

    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        if words.len() != 1 {
            return Err("incorrect number of message arguments".into());
        }
        let st = &self.st;
        match words[0].to_ascii_lowercase().as_str() {
            "checkpoint" => self.rpc(|md| st.new_era(md))?,
            "take_metadata_snap" => self.rpc(|md| {
                if md.stats().snap != 0 {
                    return Err("metadata snapshot already exists".into());
                }
                st.new_era(md)?;
                md.snap_rolled_over().map(|_| ()).map_err(|e| TargetError::invalid(e.to_string()))
            })?,
            "drop_metadata_snap" => self.rpc(|md| md.drop_snap().map_err(|e| TargetError::invalid(e.to_string())))?,
            _ => return Err(format!("unsupported message '{}'", words[0]).into()),
        }
        self.st.wake.notify_all();
        Ok(String::new())
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.origin]
    }

    fn held_devices(&self) -> Vec<&DevRef> {
        vec![&self.metadata, &self.origin]
    }

    fn max_io_len(&self) -> u64 {
        self.block_sectors
    }

    fn limits(&self) -> Limits {
        let l = Limits::stacked(&self.devices());
        let bs = self.block_sectors * 512;
        // the kernel's io_hints: the block size, unless the stacked optimum is a multiple
        if l.io_opt < bs || !l.io_opt.is_multiple_of(bs) {
            Limits {
                io_min: 0,
                io_opt: bs,
                ..l
            }
        } else {
            l
        }
    }

    fn preresume(&self) -> Result<(), TargetError> {
        let new_size = self.len.div_ceil(self.block_sectors);
        let mut m = self.st.md.lock().unpoisoned();
        if m.nr_blocks == 0 {
            // first resume: what a table before this one committed counts
            let bs = self.block_sectors as u32;
            m.md = open_metadata(&self.metadata, bs).map_err(|e| format!("Error reading metadata: {e}"))?;
        }
        if m.nr_blocks != new_size {
            m.md.resize(new_size).map_err(|e| format!("metadata_resize failed: {e}"))?;
            m.md.commit().map_err(|e| format!("metadata_commit failed: {e}"))?;
            m.nr_blocks = new_size;
        }
        self.st.new_era(&mut m.md)?;
        m.md.commit().map_err(|e| format!("metadata_commit failed: {e}"))?;
        m.failed = false;
        m.digest_off = false;
        self.st.suspended.store(false, Ordering::SeqCst);
        self.st.digesting.store(true, Ordering::SeqCst);
        self.st.failed.store(false, Ordering::SeqCst);
        drop(m);
        self.st.wake.notify_all();
        Ok(())
    }

    fn postsuspend(&self) {
        let mut m = self.st.md.lock().unpoisoned();
        self.st.suspended.store(true, Ordering::SeqCst);
        if m.failed {
            return;
        }
        if let Err(e) = m.md.archive().and_then(|_| m.md.commit()) {
            tracing::error!("era: archiving the current era at suspend failed: {e}");
        }
    }
}
