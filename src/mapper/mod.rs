//! Mapped devices: their tables, lifecycle (load, suspend, resume, remove) and the
//! mapping of requests through tables, stacked devices included.

use crate::sync::Unpoison;
pub mod config;
pub mod devio;
pub mod engine;
pub mod error;
pub mod errors;
pub mod registry;
pub mod report;
pub mod stats;
pub mod target;

pub use errors::{ControlError, TargetError};
pub use registry::Registry;
pub use target::{
    arg_dev, arg_u64, dev_extents, Bio, Constructor, DevRef, DmHold, HoldMark, Limits, MapCtx, MapErr, Mark,
    Resolver, Shared, TagProfile, Tags, Target, TargetType,
};

use crate::io::{Op, SECTOR};
use arc_swap::ArcSwapOption;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The block major number dmkit's devices have: [`Major`], chosen when the
/// daemon starts (see [`Major::choose`]).
pub const DM_MAJOR: Major = Major;

static CHOSEN_MAJOR: AtomicU32 = AtomicU32::new(Major::PREFERRED);

/// dmkit's block major, read where it is printed or compared like a number.
///
/// It is not the kernel's device-mapper major (usually 253, and on some hosts
/// zram's): a node with dmkit's number must never open a kernel device, nor a
/// kernel node a dmkit device, so dmkit takes a major the kernel never gives
/// out. The kernel hands out block majors dynamically from 254 down
/// (`register_blkdev(0, ...)` searches below 255) and refuses any from 512 on;
/// above 259 (`blkext`) no driver has a fixed one. dmkit takes the highest
/// free one below 512, written in the run directory (`major`) so that every
/// daemon of that directory and every program behind its door uses the same.
#[derive(Clone, Copy, Debug)]
pub struct Major;

impl Major {
    /// The number taken where nothing has it (every host seen so far).
    pub const PREFERRED: u32 = 511;
    /// Below this the kernel allocates (or has fixed) block majors.
    const LOWEST: u32 = 260;
    /// The run directory's file that names it.
    pub const FILE: &'static str = "major";

    /// The number.
    pub fn get(self) -> u32 {
        CHOSEN_MAJOR.load(Ordering::Relaxed)
    }

    /// Make `m` dmkit's major in this process (the daemon, at start).
    pub fn set(m: u32) {
        CHOSEN_MAJOR.store(m, Ordering::Relaxed);
    }

    /// The highest block major in [260, 511] that `/proc/devices` (its text)
    /// does not list, or None when every one is taken.
    pub fn choose(proc_devices: &str) -> Option<u32> {
        let taken: std::collections::BTreeSet<u32> = proc_devices
            .lines()
            .skip_while(|l| !l.starts_with("Block devices:"))
            .filter_map(|l| l.split_whitespace().next()?.parse().ok())
            .collect();
        (Self::LOWEST..=Self::PREFERRED)
            .rev()
            .find(|m| !taken.contains(m))
    }
}

impl std::fmt::Display for Major {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

impl PartialEq<Major> for u32 {
    fn eq(&self, _: &Major) -> bool {
        *self == Major.get()
    }
}

#[cfg(test)]
#[test]
fn the_major_is_the_highest_free_one_the_kernel_never_gives_out() {
    let devs = "Character devices:\n511 foo\n\nBlock devices:\n  7 loop\n253 zram\n259 blkext\n";
    assert_eq!(Major::choose(devs), Some(511), "a character major does not count");
    let devs = "Block devices:\n511 x\n510 y\n";
    assert_eq!(Major::choose(devs), Some(509));
    let all: String = (260..512).map(|m| format!("{m} d\n")).collect();
    assert_eq!(Major::choose(&format!("Block devices:\n{all}")), None);
}

/// One line of a table: a target at `[start, start+len)`.
pub struct TableEntry {
    pub start: u64,
    pub len: u64,
    pub target: Box<dyn Target>,
}

/// A constructed table.
pub struct Table {
    pub entries: Vec<TableEntry>,
    pub size: u64,
    /// Every target lets an empty flush bypass its map function.
    pub flush_bypass: bool,
    /// The table's distinct underlying devices, where an empty flush goes when
    /// `flush_bypass` holds: once each, however many targets use them.
    pub flush_devices: Vec<FlushDev>,
    pub logical_block_size: u32,
    /// Loaded read-only (DM_READONLY_FLAG, `--readonly`): its files are open
    /// read-only, and the device is read-only while it is live.
    pub read_only: bool,
    /// The areas of other dmkit devices the table uses, checked at its resume:
    /// (device, its name in the table, end sector).
    pub size_checks: Vec<(Arc<Device>, String, u64)>,
}

impl Table {
    /// Every target's preresume in order: the first refusal, as "resume refused
    /// by TYPE target: WHY" (a refused resume leaves the device suspended).
    pub fn preresume(&self) -> Result<(), TargetError> {
        for (d, name, end) in &self.size_checks {
            let size = d.size_sectors();
            if *end > size {
                return Err(format!(
                    "device '{name}' too small for the table: it needs {end} sectors, the device has {size}"
                )
                .into());
            }
        }
        for e in &self.entries {
            e.target
                .preresume()
                .map_err(|why| format!("resume refused by {} target: {why}", e.target.type_name()))?;
        }
        Ok(())
    }

    /// Every target's resume.
    pub fn resume(&self) {
        self.entries.iter().for_each(|e| e.target.resume());
    }

    /// Every target's presuspend.
    pub fn presuspend(&self) {
        self.entries.iter().for_each(|e| e.target.presuspend());
    }

    /// Every target's postsuspend.
    pub fn postsuspend(&self) {
        self.entries.iter().for_each(|e| e.target.postsuspend());
    }

    pub fn new(entries: Vec<TableEntry>) -> Table {
        let size = entries.last().map_or(0, |e| e.start + e.len);
        let flush_bypass = entries.iter().all(|e| e.target.flush_bypasses_map());
        let mut flush_devices = Vec::new();
        let mut seen: Vec<DevKey> = Vec::new();
        let mut lbs = 512;
        for e in &entries {
            lbs = lbs.max(e.target.logical_block_size());
            for d in e.target.devices() {
                lbs = lbs.max(d.logical_block_size());
                let k = dev_key(d);
                if !seen.contains(&k) {
                    seen.push(k);
                    flush_devices.push(match d {
                        DevRef::File(f) => FlushDev::File(f.clone()),
                        DevRef::Dm(h) => FlushDev::Dm(h.0.clone()),
                    });
                }
            }
        }
        Table {
            entries,
            size,
            flush_bypass,
            flush_devices,
            logical_block_size: lbs,
            read_only: false,
            size_checks: Vec::new(),
        }
    }

    /// The entry containing `sector` (< size).
    #[inline]
    fn entry_at(&self, sector: u64) -> usize {
        self.entries.partition_point(|e| e.start + e.len <= sector)
    }
}

/// A device an empty flush is sent to (the table's targets hold it).
pub enum FlushDev {
    File(Arc<crate::io::BackingFile>),
    Dm(Arc<Device>),
}

#[derive(PartialEq, Eq)]
enum DevKey {
    File((u64, u64)),
    Dm(usize),
}

fn dev_key(d: &DevRef) -> DevKey {
    match d {
        DevRef::File(f) => DevKey::File(f.identity),
        DevRef::Dm(h) => DevKey::Dm(Arc::as_ptr(&h.0) as usize),
    }
}

/// A mapped device.
pub struct Device {
    /// The name, which `rename` changes (the NBD export is named after it).
    name: Mutex<String>,
    pub minor: u32,
    /// Set at create, or once later by `rename --setuuid`.
    uuid: Mutex<Option<String>>,
    /// The live table's mode (DM_READONLY_FLAG at its load), as the kernel's
    /// resume sets the disk read-only or writable from the table it makes live.
    read_only: AtomicBool,
    pub live: ArcSwapOption<Table>,
    pub inactive: Mutex<Option<Arc<Table>>>,
    /// Suspended by its user (`suspend`; `info` shows it).
    pub suspended: AtomicBool,
    /// Suspended by other devices for their own sake (a thin pool suspends its
    /// active thins while it is suspended: the kernel's dm_internal_suspend_noflush
    /// and DMF_SUSPENDED_INTERNALLY): I/O waits as in a suspend, `info` does not
    /// show it. Changed only under `control`, as `suspended` is.
    internal_suspends: AtomicU32,
    /// Requests being mapped or in flight through this device, counted in the
    /// epoch they entered (see `drain_epoch`).
    inflight: [AtomicU64; 2],
    epoch: std::sync::atomic::AtomicUsize,
    drain_lock: Mutex<()>,
    /// Threads waiting for an in-flight count to reach zero (suspend, an epoch
    /// drain): the request that brings it there wakes them through `drained`.
    drain_waiters: AtomicU32,
    drained: (Mutex<()>, crate::sync::Cond),
    pub event_nr: AtomicU32,
    /// Opens: NBD connections attached, device files open (one per open file
    /// description, counted until its last close).
    pub open_count: AtomicU32,
    /// Opens closed by a program whose end the count has not seen yet (see
    /// [`Device::settled_open_count`]), and when the last such close came.
    closing: AtomicU32,
    last_close: Mutex<Option<std::time::Instant>>,
    /// Tables (of other devices) that refer to this one.
    pub holders: AtomicU32,
    /// Removed: I/O fails.
    pub removed: AtomicBool,
    /// `remove --deferred` while open: removed at the last close.
    pub deferred_remove: AtomicBool,
    /// Serialises control operations (load/suspend/resume/remove) on this device.
    pub control: Mutex<()>,
    /// The kernel block device a frontend made of it (ublk's /dev/ublkbN).
    block_device: Mutex<Option<String>>,
    /// dm statistics regions (`@stats_*` messages): counted where requests to
    /// this device start and end.
    pub stats: stats::Stats,
    /// `FAULT_*`: a worker panicked serving it (its I/O fails, see
    /// `crate::panics`), or a test armed a panic.
    fault: AtomicU8,
}

const FAULT_NONE: u8 = 0;
/// The next request mapped through the device panics (the `__panic` message).
const FAULT_ARMED: u8 = 1;
/// A worker panicked serving the device: its I/O fails with EIO until it is removed.
const FAULT_FAILED: u8 = 2;

/// How long an open count waits for the end of an open a program has just
/// closed (see [`Device::settled_open_count`]).
const CLOSE_SETTLE: Duration = Duration::from_millis(100);

impl Device {
    /// A close of an open that may be its last (a device file's flush): until
    /// [`Device::close_ended`], counts read within [`CLOSE_SETTLE`] wait for it.
    /// `first`: the open's first close (a later one only moves the moment).
    pub fn close_started(&self, first: bool) {
        *self.last_close.lock().unwrap_or_else(|e| e.into_inner()) = Some(std::time::Instant::now());
        if first {
            self.closing.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The open [`Device::close_started`] named has ended (or was not closed
    /// after all: a duplicate's close).
    pub fn close_ended(&self) {
        let _ = self
            .closing
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// The open count, once the closes just made have reached it. A device
    /// file's open ends at its last close, which the FUSE release reports after
    /// `close()` has returned; a close that is not the last (a child's exit, a
    /// duplicate) gives no release. So a count read right after a close waits
    /// up to [`CLOSE_SETTLE`] for the release, and counts an open whose close
    /// came longer ago as still open, which it is.
    pub fn settled_open_count(&self) -> u32 {
        loop {
            let n = self.open_count.load(Ordering::SeqCst);
            if n == 0 || self.closing.load(Ordering::SeqCst) == 0 {
                return n;
            }
            let recent = self
                .last_close
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|t| t.elapsed() < CLOSE_SETTLE);
            if !recent {
                return n;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn new(name: String, minor: u32, uuid: Option<String>, read_only: bool) -> Device {
        Device {
            name: Mutex::new(name),
            minor,
            uuid: Mutex::new(uuid),
            read_only: AtomicBool::new(read_only),
            live: ArcSwapOption::empty(),
            inactive: Mutex::new(None),
            suspended: AtomicBool::new(false),
            internal_suspends: AtomicU32::new(0),
            inflight: [AtomicU64::new(0), AtomicU64::new(0)],
            epoch: std::sync::atomic::AtomicUsize::new(0),
            drain_lock: Mutex::new(()),
            drain_waiters: AtomicU32::new(0),
            drained: (Mutex::new(()), crate::sync::Cond::new()),
            event_nr: AtomicU32::new(0),
            open_count: AtomicU32::new(0),
            closing: AtomicU32::new(0),
            last_close: Mutex::new(None),
            holders: AtomicU32::new(0),
            removed: AtomicBool::new(false),
            deferred_remove: AtomicBool::new(false),
            control: Mutex::new(()),
            block_device: Mutex::new(None),
            stats: stats::Stats::default(),
            fault: AtomicU8::new(FAULT_NONE),
        }
    }

    /// A worker panicked serving this device: fail its I/O from now on.
    pub fn fail(&self) {
        self.fault.store(FAULT_FAILED, Ordering::SeqCst);
    }

    /// Failed after a panic (see [`Device::fail`]).
    pub fn failed(&self) -> bool {
        self.fault.load(Ordering::SeqCst) == FAULT_FAILED
    }

    /// Make the next request mapped through this device panic (tests of what a
    /// panic does; the registry allows it only under `serve --test-panics`).
    pub fn arm_panic(&self) {
        let _ = self
            .fault
            .compare_exchange(FAULT_NONE, FAULT_ARMED, Ordering::SeqCst, Ordering::SeqCst);
    }

    pub fn name(&self) -> String {
        self.name.lock().unpoisoned().clone()
    }

    pub fn set_name(&self, name: &str) {
        *self.name.lock().unpoisoned() = name.to_string();
    }

    pub fn uuid(&self) -> Option<String> {
        self.uuid.lock().unpoisoned().clone()
    }

    pub fn block_device(&self) -> Option<String> {
        self.block_device.lock().unpoisoned().clone()
    }

    pub fn set_block_device(&self, path: Option<String>) {
        *self.block_device.lock().unpoisoned() = path;
    }

    pub fn set_uuid(&self, uuid: &str) {
        *self.uuid.lock().unpoisoned() = Some(uuid.to_string());
    }

    pub fn size_sectors(&self) -> u64 {
        self.live.load().as_ref().map_or(0, |t| t.size)
    }

    pub fn logical_block_size(&self) -> u32 {
        self.live.load().as_ref().map_or(512, |t| t.logical_block_size)
    }

    /// What the live table's targets can do together (every target must, for
    /// discards and zeroing), as the export offers it (none without a table).
    pub fn limits(&self) -> Limits {
        // Asked of the live stack each time (at a handshake, a status): a pool
        // reloaded read-only makes its thins' new connections read-only.
        self.live.load().as_ref().map_or(Limits::NONE, |t| {
            t.entries
                .iter()
                .map(|e| e.target.limits())
                .reduce(Limits::and)
                .unwrap_or(Limits::NONE)
        })
    }

    /// The integrity profile of the live table (None without one): every
    /// target must offer the same (the kernel's dm_table_verify_integrity).
    pub fn tag_profile(&self) -> Option<TagProfile> {
        let t = self.live.load();
        let mut profiles = t.as_ref()?.entries.iter().map(|e| e.target.tag_profile());
        let first = profiles.next()??;
        profiles.all(|p| p == Some(first)).then_some(first)
    }

    /// Whether I/O to this device waits (suspended by its user or internally).
    #[inline]
    pub fn io_suspended(&self) -> bool {
        self.suspended.load(Ordering::SeqCst) || self.internal_suspends.load(Ordering::SeqCst) > 0
    }

    /// Whether another device holds this one suspended.
    pub fn internally_suspended(&self) -> bool {
        self.internal_suspends.load(Ordering::SeqCst) > 0
    }

    /// The user's suspend (its control lock held): block new I/O, release what
    /// targets hold, and wait for in-flight I/O to drain. A device suspended
    /// internally has done all that already: it only becomes suspended in the
    /// user's eyes too (the kernel waits for the internal resume instead; the
    /// end state is the same, and the caller is not held up by another device).
    pub fn suspend_and_drain(&self) {
        let internally = self.internally_suspended();
        self.suspended.store(true, Ordering::SeqCst);
        if !internally {
            self.presuspend_and_drain();
        }
    }

    /// With I/O already blocked: the targets' presuspend, the drain of what is in
    /// flight, the targets' postsuspend.
    fn presuspend_and_drain(&self) {
        if let Some(t) = self.live.load_full() {
            t.presuspend();
        }
        self.wait_drained(None, || self.in_flight() == 0);
        if let Some(t) = self.live.load_full() {
            t.postsuspend();
        }
    }

    /// Suspend this device for another device's sake, without flushing (the
    /// kernel's dm_internal_suspend_noflush): I/O waits as in a suspend, queued I/O
    /// that targets requeue at presuspend waits for the resume at the top, and the
    /// user's suspend state does not change. Nested calls count; each is undone by
    /// one [`internal_resume`](Self::internal_resume). Takes this device's control
    /// lock: the caller may hold another device's (a pool's), never this one's.
    pub fn internal_suspend_noflush(&self) {
        let _c = crate::sync::lock(&self.control);
        let before = self.internal_suspends.fetch_add(1, Ordering::SeqCst);
        // nested, or suspended by the user already: drained, targets presuspended
        if before == 0 && !self.suspended.load(Ordering::SeqCst) {
            self.presuspend_and_drain();
        }
    }

    /// Undo one [`internal_suspend_noflush`](Self::internal_suspend_noflush). The
    /// last one resumes the live table's targets and lets I/O go, unless the user
    /// has suspended the device meanwhile (then the user's resume does). A target
    /// that refuses the resume leaves the device suspended, as the user sees it
    /// (the kernel's __dm_internal_resume does the same).
    pub fn internal_resume(&self) {
        let _c = crate::sync::lock(&self.control);
        let left = match self.internal_suspends.load(Ordering::SeqCst) {
            0 => {
                tracing::error!("{}: internal resume without an internal suspend", self.name());
                return;
            }
            n => n - 1,
        };
        if left > 0 || self.suspended.load(Ordering::SeqCst) {
            self.internal_suspends.store(left, Ordering::SeqCst);
            return;
        }
        if let Some(t) = self.live.load_full() {
            if let Err(why) = t.preresume() {
                tracing::error!("{}: internal {why}; the device stays suspended", self.name());
                self.suspended.store(true, Ordering::SeqCst);
                self.internal_suspends.store(0, Ordering::SeqCst);
                return;
            }
            t.resume();
        }
        self.internal_suspends.store(0, Ordering::SeqCst);
    }

    /// The event number `info` shows: the device's own events and its targets'.
    pub fn events(&self) -> u64 {
        let own = u64::from(self.event_nr.load(Ordering::Relaxed));
        own + self
            .live
            .load()
            .as_ref()
            .map_or(0, |t| t.entries.iter().map(|e| e.target.events()).sum())
    }

    /// Requests mapped or in flight through this device now.
    pub fn in_flight(&self) -> u64 {
        self.inflight[0].load(Ordering::SeqCst) + self.inflight[1].load(Ordering::SeqCst)
    }

    /// Wait until every request that entered this device before the call has left,
    /// without holding up new ones (they count in the next epoch). Blocks: never call
    /// it from a thread whose own requests could be among those waited for.
    /// False if they had not all left within `limit` (a request queued for space,
    /// say); the caller then tries again later.
    pub fn drain_epoch(&self, limit: Duration) -> bool {
        let _l = crate::sync::lock(&self.drain_lock);
        let old = self.epoch.fetch_add(1, Ordering::SeqCst) & 1;
        self.wait_drained(Some(limit), || self.inflight[old].load(Ordering::SeqCst) == 0)
    }

    /// Sleep until `done` (a count of this device's requests reached zero), woken
    /// by the request that takes it there ([`release`]); false after `limit`.
    fn wait_drained(&self, limit: Option<Duration>, done: impl Fn() -> bool) -> bool {
        let (lock, cv) = &self.drained;
        let deadline = limit.map(|l| crate::sync::now() + l);
        let mut g = lock.lock().unpoisoned();
        // Counted before `done` is checked: a release that brings the count to
        // zero after this check sees the waiter and notifies under the lock,
        // which this thread only gives up inside `wait`.
        self.drain_waiters.fetch_add(1, Ordering::SeqCst);
        let ok = loop {
            if done() {
                break true;
            }
            let wait = match deadline {
                None => Duration::from_secs(1),
                Some(d) => match d.checked_duration_since(crate::sync::now()) {
                    Some(w) if !w.is_zero() => w,
                    _ => break false,
                },
            };
            g = cv.wait_timeout(lock, g, wait).0;
        };
        self.drain_waiters.fetch_sub(1, Ordering::SeqCst);
        ok
    }

    /// A count of this device's requests fell to zero: wake a waiting drain.
    #[cold]
    fn wake_drained(&self) {
        let _g = self.drained.0.lock().unpoisoned();
        self.drained.1.notify_all();
    }

    /// Whether the device is read-only (its live table's mode).
    pub fn read_only(&self) -> bool {
        self.read_only.load(Ordering::SeqCst)
    }

    /// Make everything written through the live table durable (synchronously, on
    /// the control path): each distinct underlying file once.
    pub fn flush_sync(&self) -> std::io::Result<()> {
        let mut files: Vec<Arc<crate::io::BackingFile>> = Vec::new();
        collect_files(self, &mut files, 0);
        for f in files {
            f.sync()?;
        }
        Ok(())
    }
}

pub(crate) fn collect_files(dev: &Device, out: &mut Vec<Arc<crate::io::BackingFile>>, depth: u32) {
    let Some(t) = dev.live.load_full() else { return };
    if depth > 16 {
        return;
    }
    for e in &t.entries {
        for d in e.target.held_devices() {
            match d {
                DevRef::File(f) => {
                    if !out.iter().any(|g| g.identity == f.identity) {
                        out.push(f.clone());
                    }
                }
                DevRef::Dm(h) => collect_files(&h.0, out, depth + 1),
            }
        }
    }
}

/// Stacking depth beyond which mapping refuses (tables cannot form cycles, so this
/// only bounds the stack).
const MAX_DEPTH: u32 = 16;

/// A request's claim on a device it passes through: the device cannot finish
/// suspending (or draining an epoch) while the request holds it. A hold on a
/// device below the top one is let go while the request has no I/O under way
/// (only pieces waiting in targets, see [`relax`]) and taken again when a piece
/// goes on through it: the kernel counts each clone bio in the device it is
/// submitted to only while it is there.
pub struct Hold {
    pub dev: Arc<Device>,
    epoch: usize,
    counted: bool,
}

/// Count a request in `dev`'s current epoch, unless `dev` is suspended.
#[inline]
fn count_in(dev: &Arc<Device>) -> Result<usize, MapErr> {
    let mut e = dev.epoch.load(Ordering::SeqCst) & 1;
    dev.inflight[e].fetch_add(1, Ordering::SeqCst);
    // An epoch flip between the load and the increment: count in the new epoch, so
    // that a drain of the old one cannot miss this request.
    loop {
        let now = dev.epoch.load(Ordering::SeqCst) & 1;
        if now == e {
            break;
        }
        dev.inflight[now].fetch_add(1, Ordering::SeqCst);
        leave(dev, e);
        e = now;
    }
    if dev.io_suspended() {
        leave(dev, e);
        return Err(MapErr::Suspended);
    }
    Ok(e)
}

/// Enter `dev` for a request (its holds so far): count it in flight unless it is
/// suspended.
#[inline]
fn enter(dev: &Arc<Device>, holds: &mut Vec<Hold>) -> Result<u16, MapErr> {
    if let Some(i) = holds.iter().position(|h| Arc::ptr_eq(&h.dev, dev)) {
        let h = &mut holds[i];
        if !h.counted {
            h.epoch = count_in(dev)?;
            h.counted = true;
        }
        return Ok(i as u16);
    }
    let epoch = count_in(dev)?;
    holds.push(Hold {
        dev: dev.clone(),
        epoch,
        counted: true,
    });
    Ok((holds.len() - 1) as u16)
}

/// Release every device a request entered (at completion, or before retrying it).
pub fn release(holds: &mut Vec<Hold>) {
    for h in holds.drain(..) {
        if h.counted {
            leave(&h.dev, h.epoch);
        }
    }
}

/// The request has no I/O under way, only pieces waiting in targets (for a block
/// being provisioned or discarded, for space, for a commit): let go of every
/// device below the top one, which it enters again when a piece goes on. A
/// piece waiting for something that waits for a lower device to drain (a thin
/// pool's discard waits for the pool's I/O) must not hold that device itself.
pub fn relax(holds: &mut [Hold]) {
    for h in holds.iter_mut().skip(1).filter(|h| h.counted) {
        h.counted = false;
        leave(&h.dev, h.epoch);
    }
}

/// Uncount one request of `dev` in `epoch`, waking a drain it was the last for.
#[inline]
fn leave(dev: &Device, epoch: usize) {
    let before = dev.inflight[epoch].fetch_sub(1, Ordering::SeqCst);
    if before == 1 && dev.drain_waiters.load(Ordering::SeqCst) > 0 {
        dev.wake_drained();
    }
}

/// Map `bio` (sectors of `dev`) into leaves on backing files.
pub fn map_bio(dev: &Arc<Device>, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
    // Before `enter`: a removed device stays suspended, and its I/O must fail rather
    // than wait for a resume that never comes.
    if dev.removed.load(Ordering::SeqCst) {
        return Err(MapErr::Errno(crate::io::errno::EIO));
    }
    match dev.fault.load(Ordering::Relaxed) {
        FAULT_NONE => {}
        FAULT_ARMED
            if dev
                .fault
                .compare_exchange(FAULT_ARMED, FAULT_NONE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok() =>
        {
            panic!("{}: the panic armed by the __panic message", dev.name())
        }
        FAULT_ARMED => {}
        _ => return Err(MapErr::Errno(crate::io::errno::EIO)),
    }
    ctx.descend(MAX_DEPTH)?;
    let r = enter_and_map(dev, bio, ctx);
    ctx.ascend();
    r
}

fn enter_and_map(dev: &Arc<Device>, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
    let hold = ctx.enter(dev)?;
    let guard = dev.live.load();
    let Some(table) = guard.as_ref() else {
        return Err(MapErr::Errno(crate::io::errno::EIO));
    };
    map_table(table, hold, bio, ctx)
}

fn map_table(table: &Table, hold: u16, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
    if bio.op == Op::Flush {
        if table.flush_bypass {
            ctx.at_target((hold, u32::MAX), 0);
            for d in &table.flush_devices {
                match d {
                    FlushDev::File(f) => ctx.push_file_leaf(f, bio, 0),
                    FlushDev::Dm(d) => map_bio(d, bio, ctx)?,
                }
            }
        } else {
            for (i, e) in table.entries.iter().enumerate() {
                ctx.at_target((hold, i as u32), e.start);
                e.target.map(bio, ctx)?;
            }
        }
        return Ok(());
    }
    let end = bio.sector.checked_add(bio.nr_sectors);
    if end.is_none_or(|e| e > table.size) {
        return Err(MapErr::Errno(crate::io::errno::EIO));
    }
    let mut i = table.entry_at(bio.sector);
    let mut done = 0;
    let data = matches!(bio.op, Op::Read | Op::Write);
    while done < bio.nr_sectors {
        let e = &table.entries[i];
        let sector = bio.sector + done;
        let left_in_target = e.start + e.len - sector;
        let mut n = left_in_target.min(bio.nr_sectors - done);
        let max = if data { e.target.max_io_len() } else { 0 };
        if max > 0 {
            n = n.min(max - (sector - e.start) % max);
        }
        ctx.at_target((hold, i as u32), e.start);
        e.target.map(bio.sub(done, n, sector - e.start), ctx)?;
        done += n;
        if n == left_in_target {
            i += 1;
        }
    }
    Ok(())
}

/// Tell the target that issued a leaf that its I/O failed.
pub fn report_io_error(holds: &[Hold], origin: (u16, u32, u16)) {
    let Some(dev) = holds.get(origin.0 as usize).map(|h| &h.dev) else {
        return;
    };
    let guard = dev.live.load();
    if let Some(e) = guard.as_ref().and_then(|t| t.entries.get(origin.1 as usize)) {
        e.target.io_error(origin.2);
        dev.event_nr.fetch_add(1, Ordering::Relaxed);
    }
}

/// Allocation status of `[sector, sector+nr)` of `dev`, as (bytes, NBD flags) runs.
pub fn device_extents(
    dev: &Device,
    sector: u64,
    nr: u64,
    out: &mut Vec<(u64, u32)>,
) -> Result<(), TargetError> {
    for_each_piece(dev, sector, nr, out, 0, &mut |t, s, n, out| t.extents(s, n, out))
}

/// A per-piece status function: the target, the piece (relative), the output.
type PieceFn<'a> = dyn FnMut(&dyn Target, u64, u64, &mut Vec<(u64, u32)>) -> Result<(), TargetError> + 'a;

/// Call `f` for each table entry's piece of `[sector, sector+nr)` (the target,
/// and the piece relative to the entry); with no live table, all of it is
/// `no_table` (base:allocation's data, or the dirty bitmap's "changed").
fn for_each_piece(
    dev: &Device,
    sector: u64,
    nr: u64,
    out: &mut Vec<(u64, u32)>,
    no_table: u32,
    f: &mut PieceFn,
) -> Result<(), TargetError> {
    let guard = dev.live.load();
    let Some(t) = guard.as_ref() else {
        out.push((nr * SECTOR, no_table));
        return Ok(());
    };
    let end = (sector + nr).min(t.size);
    if sector >= end {
        return Ok(());
    }
    let mut i = t.entry_at(sector);
    let mut s = sector;
    while s < end && i < t.entries.len() {
        let e = &t.entries[i];
        let n = (e.start + e.len - s).min(end - s);
        f(e.target.as_ref(), s - e.start, n, out)?;
        s += n;
        i += 1;
    }
    Ok(())
}

/// Whether every target of `dev`'s live table can compare with `base`
/// (`qemu:dirty-bitmap:BASE`); the first reason one cannot.
pub fn device_check_base(dev: &Device, base: &str) -> Result<(), TargetError> {
    let guard = dev.live.load();
    let Some(t) = guard.as_ref() else {
        return Err("the device has no live table".into());
    };
    for e in &t.entries {
        e.target.check_base(base)?;
    }
    Ok(())
}

/// Changed-block status of `[sector, sector+nr)` against `base`, as
/// `device_extents` gives allocation status: (bytes, 1 changed / 0 unchanged).
pub fn device_changed_extents(
    dev: &Device,
    base: &str,
    sector: u64,
    nr: u64,
    out: &mut Vec<(u64, u32)>,
) -> Result<(), TargetError> {
    for_each_piece(dev, sector, nr, out, 1, &mut |t, s, n, out| {
        t.changed_extents(base, s, n, out)
    })
}

/// Merge adjacent runs with equal flags.
pub fn coalesce(ext: &mut Vec<(u64, u32)>) {
    let mut w = 0;
    for r in 0..ext.len() {
        if ext[r].0 == 0 {
            continue;
        }
        if w > 0 && ext[w - 1].1 == ext[r].1 {
            ext[w - 1].0 += ext[r].0;
        } else {
            ext[w] = ext[r];
            w += 1;
        }
    }
    ext.truncate(w);
}
