//! `raid <type> <#params> <chunk> [options] <#legs> <meta> <data> ...`: the
//! kernel's dm-raid (v1.15.1) for raid0, raid1, raid10 (near, far, offset),
//! raid4, raid5 (every layout) and raid6 (every layout dm-raid names), with
//! its metadata in the kernel's format ([`format`]) and md's placement of
//! chunks on the legs ([`layout`]); docs/design/dm-raid.md and
//! dm-raid-levels.md have the rules this follows.
//!
//! - A write goes to each copy on a leg that has not failed (raid1, raid10),
//!   tolerantly (`MapCtx::remap_tolerant`): it succeeds if a leg took it. A
//!   leg whose write fails is marked failed, and the write waits, mapped
//!   again, until the superblocks that record the loss are on the other legs'
//!   metadata (as md holds it), so a crash can never bring back the stale leg
//!   as a good one.
//! - raid4/5/6 writes, and reads whose leg is missing, go to the target's
//!   thread ([`Job`]), one at a time, so a stripe row is never read while it
//!   is half written: a write to a row whose legs all hold it reads the old
//!   block and parities and writes the block with P (and Q) changed by the
//!   difference; otherwise the row is read (the missing blocks rebuilt,
//!   [`parity::rebuild`]) and written whole. Reads of a leg that holds its
//!   block go straight to it.
//! - Before a region (`region_size`; of the array's sectors for raid1 and
//!   raid10, of each leg's for raid4/5/6) is written, its bit is set in the
//!   write-intent bitmap on every leg's metadata device; bits of regions left
//!   idle for two daemon periods are cleared, on an array with every leg in
//!   sync. After a crash the set bits name what may differ between the legs:
//!   those regions are copied again (raid1, raid10) or their parity computed
//!   again (raid4/5/6) — the kernel leaves them; doing it is safe and
//!   compatible, and closes raid5's write hole for the regions written. A
//!   leg that failed and comes back (a new table) gets the regions written
//!   meanwhile, and a leg marked `rebuild` everything.
//! - The copying (resync, recover, check, repair) runs on the target's own
//!   thread one region at a time; writes to that region wait for it.
//! - raid0 has no bitmap and no copies: reads and writes go to their chunk's
//!   leg; it takes no messages.
//!
//! Not done (refused with a message saying so): `delta_disks` (reshape),
//! `data_offset` other than 0, `journal_dev`, a table whose level, layout or
//! chunk differs from the superblocks' (the kernel would take the
//! superblocks'), a length md would round down. raid4/5/6 and raid10 take no
//! discards (dropped, as dm-raid does not offer them for raid4/5/6) and write
//! zeroes by writing. `write_mostly` legs are read only when no other leg can
//! be; `max_write_behind` is recorded and not used (writes to them are not
//! acknowledged early); recovery rates and `stripe_cache` are recorded and
//! not applied.

pub mod format;
pub mod layout;
pub mod parity;

use crate::mapper::TargetError;
use crate::io::{errno, EndIo, Op, REMAP, SECTOR};
use crate::mapper::devio;
use crate::mapper::engine::Pending;
use crate::mapper::{Bio, DevRef, MapCtx, MapErr, Resolver, Target, TargetType};
use crate::sync::Unpoison;
use format::{BitmapSuper, Super, BITMAP_OFFSET, BITMAP_SB_BYTES, HZ, MAX_CHUNKS, MAX_SECTOR};
use layout::{Geometry, Level};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The `raid` target type.
pub const TYPE: TargetType = TargetType {
    name: "raid",
    version: [1, 15, 1],
    new: |args, len, r| Ok(Box::new(Raid::new(args, len, r)?)),
    sync: None,
};

/// md's limit of legs.
const MAX_LEGS: usize = 253;
/// raid1: regions waiting for their read errors to be corrected (raid4/5/6:
/// leg ranges whose reads go through the thread); beyond, a read error fails
/// the leg (md fails a leg after 20 read errors).
const MAX_FIXES: usize = 20;
/// The default region: 4 MiB.
const DEFAULT_REGION: u64 = 8192;
/// The default daemon period: 5 s, in jiffies.
const DEFAULT_SLEEP: u64 = 5 * HZ;

struct Leg {
    meta: Option<DevRef>,
    data: Option<DevRef>,
}

/// What the table said, kept to print it back in the kernel's order.
#[derive(Default, Clone)]
struct Options {
    sync: bool,
    nosync: bool,
    rebuild: Vec<usize>,
    daemon_sleep: Option<u64>,
    min_recovery_rate: Option<u64>,
    max_recovery_rate: Option<u64>,
    write_mostly: Vec<usize>,
    max_write_behind: Option<u64>,
    region_size: Option<u64>,
    data_offset: Option<u64>,
    raid10_copies: Option<u64>,
    raid10_format: Option<String>,
    raid10_use_near_sets: bool,
    stripe_cache: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Idle,
    Resync,
    Recover,
    Check,
    Repair,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Action::Idle => "idle",
            Action::Resync => "resync",
            Action::Recover => "recover",
            Action::Check => "check",
            Action::Repair => "repair",
        }
    }
}

struct State {
    faulty: Vec<bool>,
    in_sync: Vec<bool>,
    events: u64,
    events_cleared: u64,
    /// The array's resync point (md's recovery_cp): MAX_SECTOR once in sync.
    resync_offset: u64,
    /// Regions the bitmap has set on disk.
    on_disk: Vec<bool>,
    /// Writes under way per region.
    writes: Vec<u32>,
    /// Daemon passes since each region was last written.
    idle_passes: Vec<u8>,
    /// Regions to copy to the legs that are not in sync (or, on an array
    /// whose legs are, between all legs: written when a crash came).
    needed: Vec<bool>,
    /// Regions whose bit a write waits for.
    wanted: Vec<bool>,
    /// Bits were cleared in memory, or a copy finished: the next metadata
    /// write flushes the data legs first (what it records must be durable).
    clearing: bool,
    /// Regions whose bit is being written: set in the bitmap written now, not
    /// yet in `on_disk` (a write to them waits until it is durable).
    setting: Vec<bool>,
    want_bits: bool,
    /// Bitmap bytes (of the bits) whose page must be written.
    dirty_pages: Vec<bool>,
    /// The superblocks must be written before waiting writes go on (a leg failed).
    sb_dirty: bool,
    /// Requests waiting for the bitmap, the superblocks or a region's copy.
    waiting: Vec<Pending>,
    /// The region being copied: writes to it wait.
    busy: Option<u64>,
    /// raid1: (leg, region) a read failed on, while the leg holds the rest:
    /// reads of the region go to the other legs until the thread has
    /// written it again from one of them (md's read-error correction).
    fixes: Vec<(usize, u64)>,
    /// raid4/5/6: (leg, leg sector, sectors) a direct read failed on: reads
    /// there go through the thread, which rebuilds what fails to read from
    /// the other legs and writes it back (md's read-error correction).
    reroute: Vec<(usize, u64, u64)>,
    action: Action,
    /// Progress of the current or last copy, in sectors.
    progress: u64,
    /// Where the copy resumes: the next region.
    cursor: u64,
    /// A full copy of the legs not in sync, rather than their needed regions.
    fullsync: bool,
    mismatches: u64,
    /// Before the first resume, and while suspended: no copying, messages busy.
    frozen: bool,
    stop: bool,
    /// The copy covers every region (not only the `needed` ones).
    all_regions: bool,
    /// The table was resumed once: metadata may be written.
    started: bool,
    /// raid4/5/6 writes and rebuilt reads, for the target's thread.
    jobs: VecDeque<Job>,
}

impl State {
    /// Whether reads of leg `leg`'s sectors `at..at + n` go through the
    /// thread (a direct read failed there: [`State::reroute`]).
    fn rerouted(&self, leg: usize, at: u64, n: u64) -> bool {
        self.reroute.iter().any(|&(l, s, m)| l == leg && s < at + n && at < s + m)
    }

    /// Leg `leg`'s sectors `at..at + n` read (or were written back): direct
    /// reads go there again.
    fn unroute(&mut self, leg: usize, at: u64, n: u64) {
        self.reroute.retain(|&(l, s, m)| !(l == leg && s < at + n && at < s + m));
    }

    /// A new array's state: `n` legs, `regions` regions, frozen until resumed.
    fn new(n: usize, regions: usize) -> State {
        State {
            faulty: vec![false; n],
            in_sync: vec![true; n],
            events: 0,
            events_cleared: 0,
            resync_offset: MAX_SECTOR,
            on_disk: vec![false; regions],
            writes: vec![0; regions],
            idle_passes: vec![0; regions],
            needed: vec![false; regions],
            wanted: vec![false; regions],
            setting: vec![false; regions],
            clearing: false,
            want_bits: false,
            dirty_pages: Vec::new(),
            sb_dirty: false,
            waiting: Vec::new(),
            busy: None,
            fixes: Vec::new(),
            reroute: Vec::new(),
            action: Action::Idle,
            progress: 0,
            cursor: 0,
            fullsync: false,
            mismatches: 0,
            frozen: true,
            stop: false,
            all_regions: false,
            started: false,
            jobs: VecDeque::new(),
        }
    }

    /// As before anything is known of the legs: `n` of them, `regions` regions.
    fn reset(&mut self, n: usize, regions: usize) {
        self.faulty = vec![false; n];
        self.in_sync = vec![true; n];
        self.events = 0;
        self.events_cleared = 0;
        self.resync_offset = MAX_SECTOR;
        self.on_disk = vec![false; regions];
        self.needed = vec![false; regions];
        self.dirty_pages = Vec::new();
        self.sb_dirty = false;
        self.action = Action::Idle;
        self.cursor = 0;
        self.progress = 0;
        self.fullsync = false;
        self.all_regions = false;
    }
}

/// A stripe row's blocks at one leg sector: the data blocks, P, and Q.
type RowBlocks = (Vec<Vec<u8>>, Vec<u8>, Option<Vec<u8>>);

/// Work a raid4/5/6 request leaves to the target's thread.
enum Job {
    /// A write (or zeroing) inside one chunk, its data taken from the request,
    /// over `regions` (counted in `writes`).
    Write {
        pending: Pending,
        bio: Bio,
        data: Vec<u8>,
        regions: std::ops::Range<u64>,
    },
    /// A read whose leg is missing: rebuilt from the others.
    Read { pending: Pending, bio: Bio },
}

struct Inner {
    legs: Vec<Leg>,
    len: u64,
    /// The raid type as the table names it, and md's geometry.
    type_name: String,
    geo: Geometry,
    /// The sectors the bitmap and the copies cover: the array's for raid1 and
    /// raid10, each leg's for raid4/5/6 (md's resync_max_sectors).
    span: u64,
    /// Region size in sectors.
    region: u64,
    regions: u64,
    daemon_sleep_s: u32,
    /// The daemon's period as the table gives it (jiffies of 4 ms; md's unit):
    /// the bitmap stores whole seconds, at least 1.
    daemon_period: Duration,
    /// One metadata writer at a time (the thread, a suspend).
    writing: Mutex<()>,
    write_behind: u32,
    write_mostly: Vec<bool>,
    st: Mutex<State>,
    wake: crate::sync::Cond,
    drained: crate::sync::Cond,
    /// raid4/5/6: rows whole-row writes are writing on threads of their own
    /// (`run_jobs`); `landed` is signalled as each ends.
    flying: Mutex<Vec<u64>>,
    landed: crate::sync::Cond,
    events: AtomicU64,
}

pub struct Raid {
    inner: Arc<Inner>,
    opts: Options,
    worker: Option<crate::sync::Thread<()>>,
}

fn bad(msg: &str) -> String {
    msg.to_string()
}

fn int_arg(v: &str, err: &str) -> Result<i64, TargetError> {
    v.parse::<i64>().map_err(|_| TargetError::from(bad(err)))
}

impl Raid {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Raid, TargetError> {
        let Some(type_name) = args.first() else {
            return Err(bad("No arguments").into());
        };
        let type_name = type_name.to_ascii_lowercase();
        let level = layout::parse_type(&type_name).ok_or_else(|| bad("Unrecognised raid_type"))?;
        let nparams = args
            .get(1)
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n >= 1 && n <= args.len() - 2)
            .ok_or_else(|| bad("Cannot understand number of raid parameters"))?;
        let params = &args[2..2 + nparams];
        let rest = &args[2 + nparams..];
        let nlegs = rest
            .first()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n >= 1 && n <= (rest.len() - 1) / 2)
            .ok_or_else(|| bad("Cannot understand number of raid devices parameters"))?;
        if nlegs > MAX_LEGS {
            return Err(bad("Invalid number of supplied raid devices").into());
        }
        let opts = parse_options(params, level, nlegs, len)?;
        let min_legs = match level {
            Level::Parity { parities: 2, .. } => 4,
            _ => 2,
        };
        if nlegs <= level.parities() as usize {
            return Err(bad("Insufficient number of devices").into());
        }
        if nlegs < min_legs && matches!(level, Level::Parity { .. }) {
            return Err(format!(
                "Failed to run raid array: not enough configured devices ({nlegs}, minimum {min_legs})"
            ).into());
        }
        let chunk = params[0].parse::<u64>().unwrap_or(0);
        let level = match level {
            Level::Raid10(_) => Level::Raid10(raid10_layout(&opts)?),
            l => l,
        };
        let geo = geometry(level, nlegs, chunk, len)?;
        let span = match level {
            Level::Parity { .. } => geo.dev_sectors,
            _ => len,
        };
        if let Some(rs) = opts.region_size {
            if level != Level::Raid1 && rs < chunk {
                return Err(bad("Region size is smaller than the chunk size").into());
            }
        }
        let region = opts.region_size.unwrap_or_else(|| default_region(len));
        let legs = open_legs(&rest[1..1 + 2 * nlegs], &opts, geo.dev_sectors, r)?;
        let regions = span.div_ceil(region);
        // raid0 has no bitmap: its metadata is the superblock alone
        let need = if level == Level::Raid0 {
            512
        } else {
            BITMAP_OFFSET + format::bitmap_bytes(regions)
        };
        metadata_fits(&legs, need, regions)?;
        let daemon_jiffies = match opts.daemon_sleep {
            Some(0) | None => DEFAULT_SLEEP,
            Some(j) => j,
        };
        let inner = Inner {
            write_mostly: (0..nlegs).map(|i| opts.write_mostly.contains(&i)).collect(),
            legs,
            len,
            type_name,
            geo,
            span,
            region,
            regions,
            daemon_sleep_s: (daemon_jiffies / HZ) as u32,
            daemon_period: Duration::from_millis(daemon_jiffies * 1000 / HZ),
            writing: Mutex::new(()),
            write_behind: opts.max_write_behind.map_or(0, |w| (w / 2).min(8191) as u32),
            st: Mutex::new(State::new(nlegs, regions as usize)),
            wake: crate::sync::Cond::new(),
            drained: crate::sync::Cond::new(),
            flying: Mutex::new(Vec::new()),
            landed: crate::sync::Cond::new(),
            events: AtomicU64::new(0),
        };
        let inner = Arc::new(inner);
        inner.assemble(&opts)?;
        let weak = Arc::downgrade(&inner);
        let worker = crate::sync::spawn("raid", move || worker(weak))
            .map_err(|e| format!("starting the raid thread: {e}"))?;
        Ok(Raid {
            inner,
            opts,
            worker: Some(worker),
        })
    }
}

/// The legs of a table: (metadata, data) device pairs, "-" for none; each data
/// device must hold `dev_sectors`.
fn open_legs(pairs: &[String], opts: &Options, dev_sectors: u64, r: &dyn Resolver) -> Result<Vec<Leg>, TargetError> {
    let mut legs = Vec::with_capacity(pairs.len() / 2);
    for (i, pair) in pairs.chunks_exact(2).enumerate() {
        let (m, d) = (&pair[0], &pair[1]);
        let meta = if m == "-" {
            None
        } else {
            Some(r.open(m).map_err(|e| format!("RAID metadata device lookup failure: '{m}': {e}"))?)
        };
        let data = if d == "-" {
            if opts.rebuild.contains(&i) {
                return Err(bad("Drive designated for rebuild not specified").into());
            }
            if meta.is_some() {
                return Err(bad("No data device supplied with metadata device").into());
            }
            None
        } else {
            let dev = r.open(d).map_err(|e| format!("RAID device lookup failure: '{d}': {e}"))?;
            if dev.size_sectors() < dev_sectors {
                return Err(format!(
                    "Component device(s) too small: '{d}' has {} sectors, the array needs {} of each",
                    dev.size_sectors(),
                    dev_sectors
                ).into());
            }
            Some(dev)
        };
        legs.push(Leg { meta, data });
    }
    if legs.iter().any(|l| l.meta.is_none() && l.data.is_some()) && legs.iter().any(|l| l.meta.is_some()) {
        return Err(
            "a leg with a data device and no metadata device beside legs with one is not supported by dmkit (md would put its bitmap on the data device)"
                .into(),
        );
    }
    Ok(legs)
}

/// The array's geometry: raid1 has no chunk; the others' chunk is a power of
/// two of at least 8 sectors.
fn geometry(level: Level, nlegs: usize, chunk: u64, len: u64) -> Result<Geometry, TargetError> {
    if level == Level::Raid1 {
        return Geometry::new(level, nlegs, 0, len);
    }
    if chunk < 8 || !chunk.is_power_of_two() {
        return Err(bad(if chunk.is_power_of_two() {
            "Chunk size value is too small"
        } else {
            "Chunk size must be a power of 2"
        }).into());
    }
    Geometry::new(level, nlegs, chunk, len)
}

/// Every leg's metadata device holds `need` bytes (the superblock and the
/// bitmap of `regions` regions).
fn metadata_fits(legs: &[Leg], need: u64, regions: u64) -> Result<(), TargetError> {
    for (i, l) in legs.iter().enumerate() {
        if let Some(m) = &l.meta {
            if m.size_sectors() * SECTOR < need {
                return Err(format!(
                    "metadata device of leg {i} too small: {} bytes, the superblock and bitmap of {regions} regions need {need}",
                    m.size_sectors() * SECTOR
                ).into());
            }
        }
    }
    Ok(())
}

/// The kernel's default region: 4 MiB, or more so the bitmap has at most 2^21 bits.
fn default_region(len: u64) -> u64 {
    let min = len / MAX_CHUNKS;
    if min > DEFAULT_REGION {
        min.next_power_of_two()
    } else {
        DEFAULT_REGION
    }
}

/// md's raid10 layout from the table's `raid10_copies`, `raid10_format` and
/// `raid10_use_near_sets` (dm-raid's raid10_format_to_md_layout).
fn raid10_layout(o: &Options) -> Result<u32, TargetError> {
    let copies = o.raid10_copies.unwrap_or(2) as u32;
    let far_sets = if o.raid10_use_near_sets { 0 } else { layout::RAID10_USE_FAR_SETS };
    Ok(match o.raid10_format.as_deref().unwrap_or("near") {
        "near" => copies | (1 << 8),
        "far" => 1 | (copies << 8) | far_sets,
        "offset" => 1 | (copies << 8) | layout::RAID10_OFFSET | far_sets,
        _ => return Err(bad("Invalid 'raid10_format' value given").into()),
    })
}

fn parse_options(p: &[String], level: Level, nlegs: usize, len: u64) -> Result<Options, TargetError> {
    let mut o = Options::default();
    if p[0].parse::<i32>().is_err() {
        return Err(bad("Bad numerical argument given for chunk_size").into());
    }
    let mut i = 1;
    let mut write_mostly_count = 0;
    while i < p.len() {
        let key = p[i].to_ascii_lowercase();
        i += 1;
        let mut value = || -> Result<i64, TargetError> {
            let v = p.get(i).ok_or_else(|| bad("Wrong number of raid parameters given"))?;
            i += 1;
            int_arg(v, "Bad numerical argument given in raid params")
        };
        match key.as_str() {
            "sync" | "nosync" => {
                let set = if key == "sync" { &mut o.sync } else { &mut o.nosync };
                if std::mem::replace(set, true) {
                    return Err(format!("Only one '{key}' argument allowed").into());
                }
            }
            "rebuild" => {
                let idx = leg_index(value()?, nlegs, "Invalid rebuild index given")?;
                if o.rebuild.contains(&idx) {
                    return Err(bad("rebuild for this index already given").into());
                }
                o.rebuild.push(idx);
            }
            "write_mostly" => {
                let idx = leg_index(value()?, nlegs, "Invalid write_mostly index given")?;
                write_mostly_count += 1;
                if !o.write_mostly.contains(&idx) {
                    o.write_mostly.push(idx);
                }
            }
            // a number, once, not negative: where it goes, and the kernel's
            // words for a negative one
            "max_write_behind" | "daemon_sleep" | "min_recovery_rate" | "max_recovery_rate" | "region_size" => {
                let (slot, negative) = match key.as_str() {
                    "max_write_behind" => (&mut o.max_write_behind, "Max write-behind limit out of range"),
                    "daemon_sleep" => (&mut o.daemon_sleep, "daemon sleep period out of range"),
                    "min_recovery_rate" => (&mut o.min_recovery_rate, "min_recovery_rate out of range"),
                    "max_recovery_rate" => (&mut o.max_recovery_rate, "max_recovery_rate out of range"),
                    _ => (&mut o.region_size, "Bad numerical argument given in raid params"),
                };
                let v = value()?;
                once(slot.is_some(), &key)?;
                *slot = Some(nonneg(v, negative)?);
            }
            "data_offset" => {
                let v = value()?;
                once(o.data_offset.is_some(), "data_offset")?;
                o.data_offset = Some(data_offset(v)?);
            }
            "delta_disks" => {
                value()?;
                return Err("delta_disks (reshaping) is not supported by dmkit".into());
            }
            "stripe_cache" => {
                let v = value()?;
                if !matches!(level, Level::Parity { .. }) {
                    return Err(bad("Inappropriate argument: stripe_cache").into());
                }
                once(o.stripe_cache.is_some(), "stripe_cache")?;
                o.stripe_cache = Some(nonneg(v, "Bad stripe_cache size")?);
            }
            "raid10_copies" | "raid10_use_near_sets" if !matches!(level, Level::Raid10(_)) => {
                if key == "raid10_copies" {
                    value()?;
                }
                return Err(bad("Invalid flags combination").into());
            }
            "raid10_copies" => {
                let v = value()?;
                once(o.raid10_copies.is_some(), "raid10_copies")?;
                // 2 to the number of legs, as the kernel: more would also
                // spill into md's layout word (far copies, offset bits)
                if v < 2 || v > nlegs as i64 {
                    return Err(bad("Bad value for 'raid10_copies'").into());
                }
                o.raid10_copies = Some(v as u64);
            }
            "raid10_use_near_sets" => o.raid10_use_near_sets = true,
            "raid10_format" if matches!(level, Level::Raid10(_)) => {
                let v = p.get(i).ok_or_else(|| bad("Wrong number of raid parameters given"))?;
                i += 1;
                once(o.raid10_format.is_some(), "raid10_format")?;
                o.raid10_format = Some(raid10_format(v)?);
            }
            "raid10_format" => return Err(bad("'raid10_format' is an invalid parameter for this RAID type").into()),
            "journal_dev" => return Err(bad("'journal_dev' is an invalid parameter for this RAID type").into()),
            "journal_mode" => return Err(bad("raid4/5/6 'journal_mode' is invalid without 'journal_dev'").into()),
            _ => return Err(format!("Unable to parse RAID parameter: {}", p[i - 1]).into()),
        }
    }
    check_combination(&mut o, level, nlegs, len, write_mostly_count)?;
    Ok(o)
}

/// A leg's index in an option (`what`: the kernel's words for a bad one).
fn leg_index(v: i64, nlegs: usize, what: &str) -> Result<usize, TargetError> {
    usize::try_from(v).ok().filter(|&x| x < nlegs).ok_or_else(|| TargetError::from(bad(what)))
}

/// An option given twice.
fn once(set: bool, what: &str) -> Result<(), TargetError> {
    if set {
        Err(format!("Only one {what} argument pair allowed").into())
    } else {
        Ok(())
    }
}

/// A number that may not be negative (`msg`: the kernel's words if it is).
fn nonneg(v: i64, msg: &str) -> Result<u64, TargetError> {
    u64::try_from(v).map_err(|_| TargetError::from(bad(msg)))
}

/// `raid10_format`: near, far or offset, in any case.
fn raid10_format(v: &str) -> Result<String, TargetError> {
    let v = v.to_ascii_lowercase();
    match v.as_str() {
        "near" | "far" | "offset" => Ok(v),
        _ => Err(bad("Invalid 'raid10_format' value given").into()),
    }
}

/// `data_offset`: the kernel takes 0 or a multiple of 8 from 32 on; dmkit only 0.
fn data_offset(v: i64) -> Result<u64, TargetError> {
    if v < 0 || (v != 0 && (v < 32 || v % 8 != 0)) {
        return Err(bad("Bogus data_offset value").into());
    }
    if v != 0 {
        return Err("data_offset other than 0 is not supported by dmkit".into());
    }
    Ok(0)
}

/// The options' combinations each level takes, and the region size against
/// the array's length `len` (dm-raid's checks after the options' own); a
/// region size of 0 is the default.
fn check_combination(o: &mut Options, level: Level, nlegs: usize, len: u64, write_mostly_count: usize) -> Result<(), TargetError> {
    if o.sync && o.nosync {
        return Err(bad("sync and nosync are mutually exclusive").into());
    }
    if !o.rebuild.is_empty() && (o.sync || o.nosync) {
        return Err(bad("sync/nosync and rebuild are mutually exclusive").into());
    }
    if level != Level::Raid1 && (write_mostly_count > 0 || o.max_write_behind.is_some()) {
        return Err(bad("write_mostly and max_write_behind are only valid for raid1").into());
    }
    // what each level takes (dm-raid's flag check, after the options' own)
    let raid0_extra = o.sync
        || o.nosync
        || !o.rebuild.is_empty()
        || o.region_size.is_some()
        || o.daemon_sleep.is_some()
        || o.min_recovery_rate.is_some()
        || o.max_recovery_rate.is_some();
    let raid6_nosync = matches!(level, Level::Parity { parities: 2, .. }) && o.nosync;
    if (level == Level::Raid0 && raid0_extra) || raid6_nosync {
        return Err(bad("Invalid flags combination").into());
    }
    if o.raid10_use_near_sets && o.raid10_format.as_deref().is_none_or(|f| f == "near") {
        return Err(bad("RAID10 format 'near' and 'raid10_use_near_sets' are incompatible").into());
    }
    if write_mostly_count >= nlegs {
        return Err(bad("Can't set all raid1 devices to write_mostly").into());
    }
    if let (Some(min), Some(max)) = (o.min_recovery_rate, o.max_recovery_rate) {
        if max != 0 && min > max {
            return Err(bad("Bogus recovery rates").into());
        }
    }
    if let Some(rs) = o.region_size.filter(|&r| r != 0) {
        if rs > len {
            return Err(bad("Supplied region size is too large").into());
        }
        if rs < len / MAX_CHUNKS {
            return Err(bad("Supplied region size is too small").into());
        }
        if !rs.is_power_of_two() {
            return Err(bad("Region size is not a power of 2").into());
        }
    } else if o.region_size == Some(0) {
        o.region_size = None;
    }
    Ok(())
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unpoisoned()
    }

    fn nlegs(&self) -> usize {
        self.legs.len()
    }

    /// Read the superblocks and the bitmap, and decide each leg's state and what
    /// must be copied (the kernel's analyse_superblocks and bitmap load).
    fn assemble(&self, o: &Options) -> Result<(), TargetError> {
        self.assemble_legs(o)?;
        let mut st = self.lock();
        if self.geo.level == Level::Raid0 {
            // no redundancy: nothing to copy, no bitmap to wait for
            st.on_disk.fill(true);
            st.needed.fill(false);
            st.action = Action::Idle;
            st.resync_offset = MAX_SECTOR;
            st.dirty_pages = Vec::new();
            if !self.can_run(|i| !st.faulty[i]) {
                return Err("Insufficient redundancy to activate array".into());
            }
        }
        Ok(())
    }

    fn assemble_legs(&self, o: &Options) -> Result<(), TargetError> {
        let n = self.nlegs();
        let mut st = self.lock();
        // from scratch: run when the table is made (to refuse bad metadata at
        // once) and again at its first resume, since the table it replaces may
        // have changed the metadata meanwhile (failed a leg, set bits)
        st.reset(n, self.regions as usize);
        if self.legs.iter().all(|l| l.meta.is_none()) {
            // no metadata: no bitmap; a full resync unless nosync
            st.resync_offset = if o.nosync { MAX_SECTOR } else { 0 };
            for (i, l) in self.legs.iter().enumerate() {
                st.faulty[i] = l.data.is_none();
            }
            st.on_disk.fill(true);
            if !o.nosync {
                st.action = Action::Resync;
                st.all_regions = true;
            }
            return Ok(());
        }
        let supers = self.read_supers(o, &mut st);
        let fresh = (0..n)
            .filter(|&i| supers[i].is_some())
            .fold(None, |best: Option<usize>, i| match best {
                Some(b) if supers[b].as_ref().map(|s| s.events) >= supers[i].as_ref().map(|s| s.events) => Some(b),
                _ => Some(i),
            });
        let new_legs: Vec<usize> = (0..n)
            .filter(|&i| supers[i].is_none() && self.legs[i].meta.is_some() && !st.faulty[i])
            .collect();
        let Some(f) = fresh else {
            self.start_new(o, &mut st);
            return Ok(());
        };
        let Some(fs) = supers[f].clone() else {
            return Err("Unable to assemble array: Invalid superblocks".into());
        };
        self.check_freshest(&fs, o, &new_legs)?;
        st.events = fs.events.max(1);
        st.resync_offset = if o.nosync { MAX_SECTOR } else { fs.array_resync_offset };
        for (i, sup) in supers.iter().enumerate() {
            if self.legs[i].data.is_none() {
                st.faulty[i] = true;
                continue;
            }
            if st.faulty[i] {
                continue;
            }
            if o.rebuild.contains(&i) || sup.is_none() {
                st.in_sync[i] = false;
                st.fullsync = true;
            } else if fs.has_failed(i) {
                // a leg that failed comes back: the regions written meanwhile
                st.in_sync[i] = false;
            } else if sup.as_ref().is_some_and(|s| s.disk_recovery_offset != MAX_SECTOR) {
                st.in_sync[i] = false;
                st.fullsync = true;
            }
        }
        if !self.can_run(|i| !st.faulty[i] && st.in_sync[i]) {
            return Err("Insufficient redundancy to activate array".into());
        }
        if self.geo.level == Level::Raid0 {
            // no bitmap, nothing to copy
            st.on_disk.fill(true);
            st.sb_dirty = true;
            return Ok(());
        }
        self.load_bitmap(f, &mut st)?;
        tracing::info!(
            "raid: assembled from leg {f}'s superblock (events {}): failed {:?}, in sync {:?}, resync offset {:x}, {} regions marked",
            fs.events,
            st.faulty,
            st.in_sync,
            st.resync_offset,
            st.needed.iter().filter(|&&x| x).count()
        );
        if st.resync_offset != MAX_SECTOR {
            st.action = Action::Resync;
            st.all_regions = true;
            st.cursor = st.resync_offset / self.region;
        } else if st.in_sync.iter().zip(&st.faulty).any(|(&s, &fa)| !s && !fa) {
            st.action = Action::Recover;
            st.all_regions = st.fullsync;
        } else if st.needed.iter().any(|&x| x) {
            // written when the last daemon stopped: the legs may differ there
            st.action = Action::Resync;
        }
        Ok(())
    }

    /// A new array: every leg new, a full resync unless `nosync`.
    fn start_new(&self, o: &Options, st: &mut State) {
        tracing::info!("raid: superblocks created for new raid set");
        st.events = 1;
        st.resync_offset = if o.nosync { MAX_SECTOR } else { 0 };
        for (i, l) in self.legs.iter().enumerate() {
            st.faulty[i] |= l.data.is_none();
        }
        // md's new bitmap is stale: every bit set, written at resume
        st.on_disk.fill(true);
        st.dirty_pages = vec![true; self.pages()];
        st.sb_dirty = true;
        if !o.nosync {
            st.action = Action::Resync;
            st.all_regions = true;
        }
    }

    /// Each leg's superblock (None: new, to be rebuilt, unreadable or not
    /// read: `sync`); a leg whose superblock cannot be read is failed.
    fn read_supers(&self, o: &Options, st: &mut State) -> Vec<Option<Super>> {
        let mut supers: Vec<Option<Super>> = vec![None; self.nlegs()];
        if !o.sync {
            for (i, l) in self.legs.iter().enumerate() {
                let Some(m) = &l.meta else { continue };
                let mut b = [0u8; 512];
                match devio::read(&m.dest(), 0, &mut b) {
                    Ok(()) => supers[i] = Super::decode(&b),
                    Err(e) => {
                        tracing::error!("raid: failed to read superblock of device at position {i}: {e}");
                        st.faulty[i] = true;
                    }
                }
            }
        }
        for &i in &o.rebuild {
            supers[i] = None;
        }
        supers
    }

    /// Refuse an array the freshest superblock `fs` does not describe as the
    /// table does (flags, level, layout, legs), or with new legs (`new_legs`)
    /// the table does not ask to rebuild.
    fn check_freshest(&self, fs: &Super, o: &Options, new_legs: &[usize]) -> Result<(), TargetError> {
        let n = self.nlegs();
        if fs.compat > 1 {
            return Err("Unable to assemble array: Unknown flag(s) in compatible feature flags".into());
        }
        if fs.incompat != 0 {
            return Err("Unable to assemble array: No incompatible feature flags supported yet".into());
        }
        let g = &self.geo;
        if fs.level != g.level.md_level() {
            return Err(format!(
                "takeover not possible: the metadata is of raid level {}, the table {} (dmkit takes over no level)",
                fs.level, self.type_name
            ).into());
        }
        if fs.layout != g.level.md_layout() || u64::from(fs.stripe_sectors) != g.chunk {
            return Err(format!(
                "Reshape not supported: the metadata has layout {:#x} and chunk {}, the table {:#x} and {} (dmkit does not reshape)",
                fs.layout,
                fs.stripe_sectors,
                g.level.md_layout(),
                g.chunk
            ).into());
        }
        if fs.num_devices as usize != n && o.rebuild.len() != new_legs.len() {
            return Err(format!(
                "Unable to assemble array: Invalid superblocks (the metadata has {} legs, the table {n}, without 'rebuild' for the new ones)",
                fs.num_devices
            ).into());
        }
        let rebuilds: Vec<usize> = new_legs.iter().copied().filter(|i| o.rebuild.contains(i)).collect();
        if !new_legs.is_empty() && rebuilds.len() != new_legs.len() {
            return Err(
                "Unable to assemble array: Invalid superblocks (New device injected into existing raid set without 'delta_disks' or 'rebuild' parameter specified)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The write-intent bitmap, from leg `f`'s metadata: the regions that may
    /// differ between the legs (all of them if it is stale).
    fn load_bitmap(&self, f: usize, st: &mut State) -> Result<(), TargetError> {
        let Some(m) = self.legs[f].meta.as_ref() else {
            return Err("Unable to assemble array: Invalid superblocks".into());
        };
        let mut bytes = vec![0u8; self.pages() * 4096];
        devio::read(&m.dest(), BITMAP_OFFSET / SECTOR, &mut bytes)
            .map_err(|e| format!("Failed to run raid array: reading the bitmap of leg {f}: {e}"))?;
        let bs = BitmapSuper::decode(&bytes)
            .map_err(|why| format!("Failed to run raid array: invalid bitmap file superblock: {why}"))?;
        if u64::from(bs.chunksize) != self.region * SECTOR {
            return Err(format!(
                "the bitmap's region size ({} sectors) differs from the table's ({}): dmkit does not resize a bitmap",
                bs.chunksize / 512,
                self.region
            ).into());
        }
        let stale = bs.state & format::BITMAP_STALE != 0 || bs.events < st.events;
        st.events_cleared = bs.events_cleared;
        for r in 0..self.regions as usize {
            let bit = stale || bytes[BITMAP_SB_BYTES + r / 8] & (1 << (r % 8)) != 0;
            st.on_disk[r] = bit;
            // what may differ between the legs: copied again
            st.needed[r] = bit;
        }
        if stale {
            st.dirty_pages = vec![true; self.pages()];
        }
        st.sb_dirty = true;
        Ok(())
    }

    /// Bitmap pages (4 KiB) including the superblock's.
    fn pages(&self) -> usize {
        format::bitmap_bytes(self.regions).div_ceil(4096) as usize
    }

    fn degraded(st: &State) -> bool {
        st.faulty.iter().zip(&st.in_sync).any(|(&f, &s)| f || !s)
    }

    /// Legs a write goes to.
    fn write_legs(&self, st: &State) -> Vec<usize> {
        (0..self.nlegs())
            .filter(|&i| !st.faulty[i] && self.legs[i].data.is_some())
            .collect()
    }

    /// A leg failed: mark it, unless it is the last one in sync (md keeps that
    /// one, and the I/O fails instead). True if it was marked.
    fn fail_leg(&self, st: &mut State, i: usize) -> bool {
        if st.faulty[i] {
            return true;
        }
        // md keeps a leg whose loss would stop the array (the I/O fails instead)
        if st.in_sync[i] && !self.can_run(|j| j != i && self.good(st, j)) {
            return false;
        }
        tracing::error!(
            "raid: disk failure on leg {i}, disabling device; operation continuing on {} devices",
            self.write_legs(st).len().saturating_sub(1)
        );
        st.faulty[i] = true;
        st.sb_dirty = true;
        self.events.fetch_add(1, Ordering::SeqCst);
        self.wake.notify_all();
        true
    }

    /// The regions sectors `start..end` of the span (the bitmap's sectors) cover.
    fn regions_in(&self, start: u64, end: u64) -> std::ops::Range<u64> {
        let end = end.max(start + 1).min(self.span);
        (start / self.region)..end.div_ceil(self.region).max(start / self.region + 1)
    }

    /// The regions `bio` covers: of the array's sectors for raid1 and raid10,
    /// of each leg's for raid4/5/6 (the rows from its first sector to its last).
    fn regions_of(&self, bio: &Bio) -> std::ops::Range<u64> {
        let end = bio.sector + bio.nr_sectors.max(1);
        match self.geo.level {
            Level::Parity { .. } => {
                let (_, _, first) = self.geo.parity_block(bio.sector);
                let (_, _, last) = self.geo.parity_block(end - 1);
                self.regions_in(first, last + 1)
            }
            _ => self.regions_in(bio.sector, end),
        }
    }

    /// Whether a leg is there and holds what it should.
    fn good(&self, st: &State, i: usize) -> bool {
        !st.faulty[i] && st.in_sync[i] && self.legs[i].data.is_some()
    }

    /// Whether the array can run with the legs `good` says hold their data:
    /// one leg for raid1, all for raid0, all but the parities for raid4/5/6,
    /// one copy of every chunk for raid10.
    fn can_run(&self, good: impl Fn(usize) -> bool) -> bool {
        let n = self.nlegs();
        match self.geo.level {
            Level::Raid1 => (0..n).any(good),
            Level::Raid0 => (0..n).all(good),
            Level::Parity { parities, .. } => (0..n).filter(|&i| !good(i)).count() <= parities as usize,
            Level::Raid10(_) => (0..(n * self.geo.copies_count()) as u64)
                .all(|k| self.geo.copies(k * self.geo.chunk).iter().any(|&(l, _)| good(l))),
        }
    }

    /// Where the copies of sector `s` lie (raid1: every leg, there; raid10:
    /// md's copies): (leg, leg sector).
    fn copies_of(&self, s: u64) -> Vec<(usize, u64)> {
        match self.geo.level {
            Level::Raid10(_) => self.geo.copies(s),
            _ => (0..self.nlegs()).map(|i| (i, s)).collect(),
        }
    }

    /// The regions of a write are marked: true, and they count it as under
    /// way ([`written`](Self::written) ends it); false if it must wait, its
    /// bits asked for.
    fn admit(&self, st: &mut State, regions: std::ops::Range<u64>) -> bool {
        let mut ready = !st.sb_dirty;
        for r in regions.clone() {
            let r = r as usize;
            if st.busy == Some(r as u64) {
                ready = false;
            }
            if !st.on_disk[r] {
                st.wanted[r] = true;
                st.want_bits = true;
                ready = false;
            }
        }
        if ready {
            for r in regions {
                st.writes[r as usize] += 1;
                st.idle_passes[r as usize] = 0;
            }
        }
        ready
    }

    /// A write (or discard, or zeroing) over `regions`, or a flush (none),
    /// goes to every leg that has not failed once its regions are marked;
    /// until then it waits for the bitmap (or the superblocks, or a copy).
    fn map_mirrored(self: &Arc<Self>, bio: Bio, regions: std::ops::Range<u64>, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let mut st = self.lock();
        if !self.admit(&mut st, regions.clone()) {
            st.waiting.push(ctx.submit(bio));
            drop(st);
            self.wake.notify_all();
            return Ok(());
        }
        // every leg for a flush and raid1; each copy's place for raid10
        let legs: Vec<(usize, Bio)> = if bio.op == Op::Flush || self.geo.level == Level::Raid1 {
            self.write_legs(&st).into_iter().map(|i| (i, bio)).collect()
        } else {
            self.copies_of(bio.sector)
                .into_iter()
                .filter(|&(i, _)| !st.faulty[i] && self.legs[i].data.is_some())
                .map(|(i, at)| (i, Bio { sector: at, ..bio }))
                .collect()
        };
        drop(st);
        let w = Arc::new(WriteDone {
            left: AtomicUsize::new(legs.len()),
            good: AtomicUsize::new(0),
            failed: Mutex::new(Vec::new()),
        });
        for &(i, leg_bio) in &legs {
            let (me, w, regions) = (self.clone(), w.clone(), regions.clone());
            let hook: EndIo = Arc::new(move |ok, _: &mut [u8]| {
                if ok {
                    w.good.fetch_add(1, Ordering::SeqCst);
                } else {
                    w.failed.lock().unpoisoned().push(i);
                }
                if w.left.fetch_sub(1, Ordering::SeqCst) != 1 {
                    return 0;
                }
                me.end_write(regions.clone(), &w)
            });
            if let Some(d) = &self.legs[i].data {
                ctx.remap_tolerant(d, leg_bio, i as u16, hook)?;
            }
        }
        Ok(())
    }

    /// Every leg's part of a write is done: 0, EIO (no leg took it), or REMAP
    /// (a leg failed: the write goes again once the superblocks say so).
    fn end_write(&self, regions: std::ops::Range<u64>, w: &WriteDone) -> i32 {
        let mut st = self.lock();
        self.written(&mut st, regions);
        let failed = std::mem::take(&mut *w.failed.lock().unpoisoned());
        if failed.is_empty() {
            return 0;
        }
        let mut kept = false;
        for i in failed {
            kept |= !self.fail_leg(&mut st, i);
        }
        if w.good.load(Ordering::SeqCst) == 0 || kept {
            return errno::EIO;
        }
        REMAP
    }

    fn map_read(self: &Arc<Self>, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let st = self.lock();
        let end = bio.sector + bio.nr_sectors;
        let usable: Vec<(usize, u64)> = self
            .copies_of(bio.sector)
            .into_iter()
            .filter(|&(i, _)| self.good(&st, i) && !self.regions_of(&bio).any(|r| st.fixes.contains(&(i, r))))
            .collect();
        let plain: Vec<(usize, u64)> = usable.iter().copied().filter(|&(i, _)| !self.write_mostly[i]).collect();
        // where the legs may still differ (a resync ahead, or a region written
        // when a crash came and not yet copied), always the same leg
        let unsettled = st.resync_offset < end
            || (st.action == Action::Resync && self.regions_of(&bio).any(|r| st.needed[r as usize]));
        let pick = if unsettled || plain.is_empty() {
            usable.first().copied()
        } else {
            // spread by region over the legs
            plain.get(((bio.sector / self.region) as usize) % plain.len()).copied()
        };
        drop(st);
        let Some((i, at)) = pick else {
            return Err(MapErr::Errno(errno::EIO));
        };
        self.read_leg_tolerant(i, Bio { sector: at, ..bio }, self.regions_of(&bio), ctx)
    }

    /// Read `bio` (at its leg sector) from leg `i`, for the array's
    /// `regions` (raid1 and raid10); failing, the read is mapped again (from
    /// another leg, or rebuilt) and the leg corrected as md does, or marked
    /// failed.
    fn read_leg_tolerant(
        self: &Arc<Self>,
        i: usize,
        bio: Bio,
        regions: std::ops::Range<u64>,
        ctx: &mut MapCtx,
    ) -> Result<(), MapErr> {
        let Some(d) = &self.legs[i].data else {
            return Err(MapErr::Errno(errno::EIO));
        };
        let me = self.clone();
        ctx.remap_tolerant(
            d,
            bio,
            i as u16,
            Arc::new(move |ok, _: &mut [u8]| {
                if ok {
                    return 0;
                }
                let mut st = me.lock();
                if matches!(me.geo.level, Level::Raid1 | Level::Raid10(_))
                    && !st.faulty[i]
                    && st.fixes.len() < MAX_FIXES
                    && me.can_run(|j| j != i && me.good(&st, j))
                {
                    // as md: read from another leg, and write the region
                    // back to this one from it
                    for r in regions.clone() {
                        if !st.fixes.contains(&(i, r)) {
                            st.fixes.push((i, r));
                        }
                    }
                    me.wake.notify_all();
                    tracing::warn!(
                        "raid: read error on leg {i} at its sector {}; read from another leg, the region to be written again",
                        bio.sector
                    );
                    REMAP
                } else if matches!(me.geo.level, Level::Parity { .. })
                    && !st.faulty[i]
                    && st.reroute.len() < MAX_FIXES
                {
                    // as md: the block rebuilt from the others, and written
                    // back (the thread's read does both)
                    st.reroute.push((i, bio.sector, bio.nr_sectors));
                    tracing::warn!(
                        "raid: read error on leg {i} at its sector {}; rebuilt from the other legs, to be written again",
                        bio.sector
                    );
                    REMAP
                } else if me.fail_leg(&mut st, i) {
                    tracing::error!("raid: read error on leg {i} at its sector {}; read again without it", bio.sector);
                    REMAP
                } else {
                    errno::EIO
                }
            }),
        )
    }

    /// A write (or zeroing) for the target's thread, once its regions are
    /// marked (until then it waits, its bits asked for).
    fn queue_write(self: &Arc<Self>, mut st: MutexGuard<'_, State>, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let regions = self.regions_of(&bio);
        if !self.admit(&mut st, regions.clone()) {
            st.waiting.push(ctx.submit(bio));
        } else {
            let data = if bio.op == Op::Write {
                ctx.data_of(&bio).to_vec()
            } else {
                Vec::new()
            };
            st.jobs.push_back(Job::Write {
                pending: ctx.submit(bio),
                bio,
                data,
                regions,
            });
        }
        drop(st);
        self.wake.notify_all();
        Ok(())
    }

    /// A write over `regions` ended: they are no longer being written, and
    /// on a degraded array they need copying to the legs that missed it.
    fn written(&self, st: &mut State, regions: std::ops::Range<u64>) {
        let degraded = Self::degraded(st);
        for r in regions {
            let r = r as usize;
            st.writes[r] = st.writes[r].saturating_sub(1);
            if degraded {
                st.needed[r] = true;
            }
            if st.busy == Some(r as u64) && st.writes[r] == 0 {
                self.drained.notify_all();
            }
        }
    }

    /// raid0: each chunk's part on its leg (a read or write lies in one
    /// chunk; discards and zeroing are cut per leg, as striped does).
    fn map_raid0(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let n = self.nlegs() as u64;
        let chunk = self.geo.chunk;
        let dev = |i: usize| self.legs[i].data.as_ref().ok_or(MapErr::Errno(errno::EIO));
        match bio.op {
            Op::Flush => {
                for i in 0..self.nlegs() {
                    ctx.remap(dev(i)?, Bio { sector: 0, ..bio }, i as u16)?;
                }
            }
            Op::Read | Op::Write => {
                let (i, at) = self.geo.striped(bio.sector);
                ctx.remap(dev(i)?, Bio { sector: at, ..bio }, i as u16)?;
            }
            Op::Discard | Op::WriteZeroes => {
                let (start, end) = (bio.sector, bio.sector + bio.nr_sectors);
                // the first leg sector of leg i at or after array sector s
                let bound = |s: u64, i: u64| {
                    let (c, row) = (s / chunk, s / chunk / n);
                    match (c % n).cmp(&i) {
                        std::cmp::Ordering::Greater => (row + 1) * chunk,
                        std::cmp::Ordering::Less => row * chunk,
                        std::cmp::Ordering::Equal => row * chunk + s % chunk,
                    }
                };
                for i in 0..n {
                    let (lo, hi) = (bound(start, i), bound(end, i));
                    if hi > lo {
                        let b = Bio {
                            sector: lo,
                            nr_sectors: hi - lo,
                            ..bio
                        };
                        ctx.remap(dev(i as usize)?, b, i as u16)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// raid4/5/6: a read from its data block's leg when that leg holds it
    /// (failing, it is marked and the read goes again); a read whose leg does
    /// not, and every write, to the target's thread.
    fn map_parity(self: &Arc<Self>, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let mut st = self.lock();
        match bio.op {
            Op::Flush => {
                drop(st);
                self.map_mirrored(bio, 0..0, ctx)
            }
            // md's raid4/5/6 take no discards unless told the legs zero them
            // safely (dm-raid does not): nothing to do
            Op::Discard => {
                ctx.complete(bio, crate::io::LeafKind::Drop);
                Ok(())
            }
            Op::Read => {
                // a row at most (max_io_len): each chunk's part from its leg
                let chunk = self.geo.chunk;
                let mut pieces = Vec::with_capacity(4);
                let mut done = 0;
                while done < bio.nr_sectors {
                    let s = bio.sector + done;
                    let n = (chunk - s % chunk).min(bio.nr_sectors - done);
                    let (row, di, at) = self.geo.parity_block(s);
                    pieces.push((row.data[di], bio.sub(done, n, at)));
                    done += n;
                }
                if pieces
                    .iter()
                    .any(|(leg, b)| !self.good(&st, *leg) || st.rerouted(*leg, b.sector, b.nr_sectors))
                {
                    st.jobs.push_back(Job::Read {
                        pending: ctx.submit(bio),
                        bio,
                    });
                    drop(st);
                    self.wake.notify_all();
                    return Ok(());
                }
                drop(st);
                for (leg, b) in pieces {
                    self.read_leg_tolerant(leg, b, 0..0, ctx)?;
                }
                Ok(())
            }
            Op::Write | Op::WriteZeroes => self.queue_write(st, bio, ctx),
        }
    }

    // ---- the target's thread: raid4/5/6 stripes ----

    /// Read `n` sectors at leg sector `at` of leg `i`; a failure fails the leg.
    fn read_leg(&self, i: usize, at: u64, buf: &mut [u8]) -> bool {
        let Some(d) = &self.legs[i].data else { return false };
        if devio::read_data(&d.dest(), at, buf).is_ok() {
            return true;
        }
        let mut st = self.lock();
        self.fail_leg(&mut st, i);
        false
    }

    /// Read `n` sectors at leg sector `at` of leg `i`: whether it worked (a
    /// failure fails nothing: the caller rebuilds the block).
    fn try_read_leg(&self, i: usize, at: u64, buf: &mut [u8]) -> bool {
        self.legs[i]
            .data
            .as_ref()
            .is_some_and(|d| devio::read_data(&d.dest(), at, buf).is_ok())
    }

    /// Write to leg `i` (if it has not failed); a failure fails the leg.
    /// False if the leg could not be failed (the array would stop).
    fn write_leg(&self, i: usize, at: u64, buf: &[u8], fua: bool) -> bool {
        self.put_leg(i, at, buf, fua).unwrap_or_else(|marked| marked)
    }

    /// Write to leg `i` unless it has failed (or has no data device): Ok, or
    /// Err once the write failed, with whether the leg could be marked failed.
    fn put_leg(&self, i: usize, at: u64, buf: &[u8], fua: bool) -> Result<bool, bool> {
        let Some(d) = &self.legs[i].data else { return Ok(true) };
        if self.lock().faulty[i] || devio::write_data(&d.dest(), at, buf, fua).is_ok() {
            return Ok(true);
        }
        let mut st = self.lock();
        Err(self.fail_leg(&mut st, i))
    }

    /// The blocks of `row` at leg sector `at`, `len` bytes each: the data
    /// blocks, P and Q, each read from a leg that holds it or rebuilt from the
    /// others. None if too many legs are missing.
    fn read_row(&self, row: &layout::Row, at: u64, len: usize) -> Option<RowBlocks> {
        for _attempt in 0..=self.nlegs() {
            let n = len as u64 / SECTOR;
            let (good, known_bad): (Vec<bool>, Vec<bool>) = {
                let st = self.lock();
                (0..self.nlegs())
                    .map(|i| {
                        (self.good(&st, i), st.rerouted(i, at, n))
                    })
                    .unzip()
            };
            let mut data = vec![vec![0u8; len]; row.data.len()];
            let mut p = vec![0u8; len];
            let mut q = row.q.map(|_| vec![0u8; len]);
            let mut missing = Vec::new();
            // blocks that failed to read on legs still in the array
            let mut bad: Vec<(usize, usize)> = Vec::new();
            let nd = row.data.len();
            let blocks = row.data.iter().copied().chain([row.p]).chain(row.q).enumerate();
            for (k, leg) in blocks {
                let buf = match k {
                    k if k < nd => &mut data[k],
                    k if k == nd => &mut p,
                    _ => q.as_mut()?,
                };
                if !good[leg] {
                    missing.push(k);
                } else if known_bad[leg] || !self.try_read_leg(leg, at, buf) {
                    // (a direct read already failed there: not read again)
                    missing.push(k);
                    bad.push((k, leg));
                }
            }
            if missing.len() > 1 + usize::from(row.q.is_some()) {
                // more than the parity can rebuild: the legs that failed to
                // read fail, and the row is read again without them
                let mut st = self.lock();
                if bad.iter().any(|&(_, leg)| !self.fail_leg(&mut st, leg)) {
                    return None;
                }
                continue;
            }
            if !missing.is_empty() && !parity::rebuild(&mut data, &row.coef, &mut p, q.as_deref_mut(), &missing) {
                return None;
            }
            for (k, leg) in bad {
                let block = match k {
                    k if k < nd => &data[k],
                    k if k == nd => &p,
                    _ => q.as_ref()?,
                };
                self.correct(leg, at, block);
            }
            return Some((data, p, q));
        }
        None
    }

    /// Write `block` to leg `i` at its sector `at`, durable, and read it
    /// back: whether it holds it now (md's check of a corrected read error).
    fn write_back(&self, i: usize, at: u64, block: &[u8]) -> bool {
        let mut back = vec![0u8; block.len()];
        self.put_leg(i, at, block, true).is_ok() && self.try_read_leg(i, at, &mut back) && back == block
    }

    /// A block of leg `i` at its sector `at` that failed to read, rebuilt as
    /// `block`: written back and read again (md's read-error correction);
    /// if that fails too, the leg fails.
    fn correct(&self, i: usize, at: u64, block: &[u8]) {
        if self.write_back(i, at, block) {
            tracing::info!("raid: read error corrected: leg {i} at its sector {at} rebuilt from the other legs");
            self.lock().unroute(i, at, block.len() as u64 / SECTOR);
            return;
        }
        let mut st = self.lock();
        if !st.faulty[i] {
            tracing::error!("raid: leg {i} at its sector {at}: the rebuilt block did not write back; the leg fails");
            self.fail_leg(&mut st, i);
        }
    }

    /// Write `new` (None: zeroes) as data block `di` of `row` at leg sector
    /// `at`, with P and Q to match. 0 or an errno.
    fn write_block(&self, row: &layout::Row, di: usize, at: u64, new: Option<&[u8]>, len: usize, fua: bool) -> i32 {
        let zeroes;
        let new = match new {
            Some(b) => b,
            None => {
                zeroes = vec![0u8; len];
                &zeroes
            }
        };
        let all_good = {
            let st = self.lock();
            row.data.iter().chain(std::iter::once(&row.p)).chain(row.q.iter()).all(|&i| self.good(&st, i))
        };
        // read-modify-write: P ^= old ^ new, Q ^= g^k (old ^ new); a block
        // that fails to read sends it to the reconstruct-write, which
        // rebuilds and corrects it
        let rmw = all_good
            .then(|| {
                let mut old = vec![0u8; len];
                let mut p = vec![0u8; len];
                let mut q = row.q.map(|_| vec![0u8; len]);
                let ok = self.try_read_leg(row.data[di], at, &mut old)
                    && self.try_read_leg(row.p, at, &mut p)
                    && match (row.q, q.as_mut()) {
                        (Some(qd), Some(qb)) => self.try_read_leg(qd, at, qb),
                        _ => true,
                    };
                ok.then(|| {
                    parity::xor_into(&mut old, new);
                    parity::xor_into(&mut p, &old);
                    if let Some(q) = q.as_mut() {
                        parity::mul_xor_into(q, parity::pow2(row.coef[di]), &old);
                    }
                    (p, q)
                })
            })
            .flatten();
        let (p, q) = if let Some(pq) = rmw {
            pq
        } else {
            // reconstruct-write: the whole row, rebuilt where a leg is missing
            let Some((mut data, mut p, mut q)) = self.read_row(row, at, len) else {
                return errno::EIO;
            };
            data[di].copy_from_slice(new);
            let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            parity::syndromes(&refs, &row.coef, &mut p, q.as_deref_mut());
            (p, q)
        };
        let mut ok = self.write_leg(row.data[di], at, new, fua) && self.write_leg(row.p, at, &p, fua);
        if let (Some(qd), Some(qb)) = (row.q, q.as_ref()) {
            ok &= self.write_leg(qd, at, qb, fua);
        }
        let st = self.lock();
        if !ok || !self.can_run(|i| self.good(&st, i)) {
            return errno::EIO;
        }
        0
    }

    /// raid4/5/6: a write of a whole row (its data blocks, each a full chunk)
    /// is written with its parity computed from it, every leg at once; None
    /// if `bio` is not one.
    fn write_full_row(&self, bio: &Bio, data: &[u8]) -> Option<i32> {
        self.whole_row(bio, data)?;
        let (row, _, at) = self.geo.parity_block(bio.sector);
        let len = (self.geo.chunk * SECTOR) as usize;
        let blocks: Vec<&[u8]> = data.chunks(len).collect();
        let mut p = vec![0u8; len];
        let mut q = row.q.map(|_| vec![0u8; len]);
        parity::syndromes(&blocks, &row.coef, &mut p, q.as_deref_mut());
        let mut writes: Vec<(usize, &[u8])> = row.data.iter().copied().zip(blocks.iter().copied()).collect();
        writes.push((row.p, &p));
        if let (Some(qd), Some(qb)) = (row.q, q.as_deref()) {
            writes.push((qd, qb));
        }
        // every leg's write at once: the row goes at the legs' combined speed
        // (in a crash trial one after another, in the trial's order)
        let ok = if crate::sync::sched::active() {
            writes
                .iter()
                .fold(true, |ok, &(leg, buf)| self.write_leg(leg, at, buf, bio.fua) && ok)
        } else {
            std::thread::scope(|sc| {
                let hs: Vec<_> = writes
                    .iter()
                    .map(|&(leg, buf)| sc.spawn(move || self.write_leg(leg, at, buf, bio.fua)))
                    .collect();
                hs.into_iter().all(|h| h.join().unwrap_or(false))
            })
        };
        let st = self.lock();
        Some(if ok && self.can_run(|i| self.good(&st, i)) {
            0
        } else {
            errno::EIO
        })
    }

    /// Do a job: a raid4/5/6 write or rebuilt read, a raid10 zeroing.
    fn run_job(&self, job: Job) {
        let chunk = self.geo.chunk;
        match job {
            Job::Read { pending, bio } => {
                let mut out = vec![0u8; bio.bytes() as usize];
                let mut done = 0;
                while done < bio.nr_sectors {
                    let s = bio.sector + done;
                    let n = (chunk - s % chunk).min(bio.nr_sectors - done);
                    let (row, di, at) = self.geo.parity_block(s);
                    let Some((data, _, _)) = self.read_row(&row, at, (n * SECTOR) as usize) else {
                        pending.fail(errno::EIO);
                        return;
                    };
                    // read (or rebuilt and written back): direct reads again
                    self.lock().unroute(row.data[di], at, n);
                    let o = (done * SECTOR) as usize;
                    out[o..o + data[di].len()].copy_from_slice(&data[di]);
                    done += n;
                }
                pending.done_with(out);
            }
            Job::Write {
                pending,
                bio,
                data,
                regions,
            } => {
                let mut e = 0;
                let mut done = 0;
                if let Some(code) = self.write_full_row(&bio, &data) {
                    e = code;
                    done = bio.nr_sectors;
                }
                while done < bio.nr_sectors && e == 0 {
                    let s = bio.sector + done;
                    let n = (chunk - s % chunk).min(bio.nr_sectors - done);
                    let len = (n * SECTOR) as usize;
                    let o = (done * SECTOR) as usize;
                    let new = data.get(o..o + len);
                    e = match self.geo.level {
                        Level::Raid10(_) => {
                            let zero = vec![0u8; len];
                            let buf = new.unwrap_or(&zero);
                            let mut wrote = false;
                            for (i, at) in self.geo.copies(s) {
                                wrote |= !self.lock().faulty[i] && self.put_leg(i, at, buf, bio.fua).is_ok();
                            }
                            if wrote {
                                0
                            } else {
                                errno::EIO
                            }
                        }
                        _ => {
                            let (row, di, at) = self.geo.parity_block(s);
                            self.write_block(&row, di, at, new, len, bio.fua)
                        }
                    };
                    done += n;
                }
                let sb_dirty = {
                    let mut st = self.lock();
                    self.written(&mut st, regions);
                    st.sb_dirty
                };
                // a leg failed: the superblocks saying so are on disk first
                if sb_dirty {
                    self.set_wanted_bits();
                }
                if e == 0 {
                    pending.done();
                } else {
                    pending.fail(e);
                }
            }
        }
    }

    /// The row a job writes whole, if it does.
    fn full_row_of(&self, job: &Job) -> Option<u64> {
        let Job::Write { bio, data, .. } = job else { return None };
        self.whole_row(bio, data)
    }

    /// raid4/5/6: the row a write of `data` at `bio` covers whole, if it does.
    fn whole_row(&self, bio: &Bio, data: &[u8]) -> Option<u64> {
        let width = self.geo.row_sectors();
        let whole = matches!(self.geo.level, Level::Parity { .. })
            && bio.sector.is_multiple_of(width)
            && bio.nr_sectors == width
            && data.len() as u64 == width * SECTOR;
        whole.then_some(bio.sector / width)
    }

    /// Wait until no whole-row write is under way on `row` (any row: None).
    fn wait_landed(&self, row: Option<u64>) {
        let mut f = self.flying.lock().unpoisoned();
        while row.map_or(!f.is_empty(), |r| f.contains(&r)) {
            f = self.landed.wait(&self.flying, f);
        }
    }

    /// Run the jobs queued now, in order, except that a whole-row write goes
    /// on a thread of its own, so a sequential writer's rows are written at
    /// once: a job after it waits for it only if it writes the same row, and
    /// any other job (a partial row's read-modify-write, a rebuilt read)
    /// waits for every row under way. True if there were any.
    fn run_jobs(self: &Arc<Self>) -> bool {
        let jobs: VecDeque<Job> = std::mem::take(&mut self.lock().jobs);
        let any = !jobs.is_empty();
        for j in jobs {
            let Some(row) = self.full_row_of(&j) else {
                self.wait_landed(None);
                self.run_job(j);
                continue;
            };
            self.wait_landed(Some(row));
            self.flying.lock().unpoisoned().push(row);
            let me = self.clone();
            let land = move |me: &Inner| {
                me.flying.lock().unpoisoned().retain(|&r| r != row);
                me.landed.notify_all();
            };
            let job = Arc::new(Mutex::new(Some(j)));
            let theirs = job.clone();
            let spawned = crate::sync::spawn("raid-row", move || {
                if let Some(j) = theirs.lock().unpoisoned().take() {
                    me.run_job(j);
                }
                land(&me);
            });
            if spawned.is_err() {
                // no thread: here, in order
                if let Some(j) = job.lock().unpoisoned().take() {
                    self.run_job(j);
                }
                self.flying.lock().unpoisoned().retain(|&r| r != row);
            }
        }
        any
    }

    // ---- metadata ----

    /// Write the bitmap pages marked dirty and the superblocks to every leg
    /// with metadata that has not failed, each made durable; a leg whose
    /// metadata write fails is failed (and the superblocks written again).
    /// `clearing`: bits are cleared or a copy's progress recorded, so the data
    /// legs are flushed first (a completed write may still be in a leg's cache:
    /// a crash could keep it on one leg and not the other, and the cleared bit,
    /// or the leg called in sync, would hide that).
    fn write_metadata(&self, clearing: bool) {
        // the crash simulator may place a crash anywhere in here
        let sim = self.legs.iter().find_map(|l| match &l.meta {
            Some(DevRef::File(f)) => f.sim().cloned(),
            _ => None,
        });
        let _window = crate::io::sim::commit_window(sim.as_ref());
        if clearing {
            self.flush_data_legs();
        }
        for _round in 0..MAX_LEGS {
            let mut st = self.lock();
            let pages = std::mem::take(&mut st.dirty_pages);
            let image = self.bitmap_image(&st);
            let supers = self.leg_supers(&st);
            drop(st);
            let bad: Vec<usize> = supers
                .iter()
                .filter(|(i, sb)| !self.write_leg_metadata(*i, sb, &image, &pages))
                .map(|(i, _)| *i)
                .collect();
            let mut st = self.lock();
            if bad.is_empty() {
                return;
            }
            for i in bad {
                tracing::error!("raid: metadata write failed on leg {i}");
                self.fail_leg(&mut st, i);
            }
            st.events = st.events.saturating_add(1);
            st.dirty_pages = vec![true; self.pages()];
        }
    }

    /// Flush every data leg written to; a leg whose flush fails is failed.
    fn flush_data_legs(&self) {
        let legs = self.write_legs(&self.lock());
        let mut st = None;
        for i in legs {
            if let Some(d) = &self.legs[i].data {
                if devio::flush(&d.dest()).is_err() {
                    let g = st.get_or_insert_with(|| self.lock());
                    self.fail_leg(g, i);
                }
            }
        }
    }

    /// The bitmap as it goes to disk: its superblock, then a bit a region
    /// (set on disk or being set).
    fn bitmap_image(&self, st: &State) -> Vec<u8> {
        let mut image = vec![0u8; self.pages() * 4096];
            BitmapSuper {
                version: 4,
                events: st.events,
                events_cleared: st.events_cleared,
                sync_size: self.span,
                state: 0,
                chunksize: (self.region * SECTOR) as u32,
                daemon_sleep: self.daemon_sleep_s.max(1),
                write_behind: self.write_behind,
            }
            .encode(&mut image);
            for (r, (&b, &s)) in st.on_disk.iter().zip(&st.setting).enumerate() {
                if b || s {
                    image[BITMAP_SB_BYTES + r / 8] |= 1 << (r % 8);
                }
            }
        image
    }

    /// Each leg's superblock, in the order they are written.
    fn leg_supers(&self, st: &State) -> Vec<(usize, [u8; 512])> {
            let mut failed = [0u64; 4];
            for (i, &f) in st.faulty.iter().enumerate() {
                if f {
                    failed[i / 64] |= 1 << (i % 64);
                }
            }
            // a leg not in sync first, each leg's write durable before the
            // next: the others stop calling it failed only once its own
            // superblock says it is being recovered, so a crash between them
            // cannot bring it back as in sync with what it missed
            let mut order: Vec<usize> = (0..self.nlegs()).collect();
            order.sort_by_key(|&i| st.in_sync[i]);
            order
                .into_iter()
                .filter(|&i| !st.faulty[i] && self.legs[i].meta.is_some())
                .map(|i| {
                    let g = &self.geo;
                    let mut s = Super::new(
                        g.level.md_level(),
                        g.level.md_layout(),
                        g.chunk as u32,
                        self.nlegs() as u32,
                        i as u32,
                        self.len,
                        g.dev_sectors,
                    );
                    s.events = st.events;
                    s.failed = failed;
                    s.array_resync_offset = st.resync_offset;
                    s.disk_recovery_offset = if st.in_sync[i] {
                        MAX_SECTOR
                    } else if st.action == Action::Recover && st.fullsync {
                        st.cursor * self.region
                    } else {
                        0
                    };
                    let mut b = [0u8; 512];
                    s.encode(&mut b);
                    (i, b)
                })
                .collect()
    }

    /// Leg `i`'s metadata: the bitmap superblock and the dirty pages, then
    /// (after a flush) its superblock `sb`, durable; false if any of it failed.
    fn write_leg_metadata(&self, i: usize, sb: &[u8; 512], image: &[u8], pages: &[bool]) -> bool {
        let Some(m) = &self.legs[i].meta else { return true };
        let dest = m.dest();
        let bitmap = self.geo.level != Level::Raid0;
        let mut ok = !bitmap || devio::write(&dest, BITMAP_OFFSET / SECTOR, &image[..4096], false).is_ok();
        for (p, _) in pages.iter().enumerate().filter(|(p, &d)| bitmap && d && *p > 0) {
            let at = p * 4096;
            ok &= devio::write(&dest, (BITMAP_OFFSET + at as u64) / SECTOR, &image[at..at + 4096], false).is_ok();
        }
        ok && devio::flush(&dest).is_ok() && devio::write(&dest, 0, sb, true).is_ok()
    }

    /// Requests waiting for metadata or a copy are mapped again.
    fn release_waiting(&self, st: &mut State) {
        for p in std::mem::take(&mut st.waiting) {
            p.requeue();
        }
    }

    // ---- copying ----

    /// The legs a copy of the current action writes to.
    fn copy_targets(&self, st: &State) -> Vec<usize> {
        (0..self.nlegs())
            .filter(|&i| !st.faulty[i] && self.legs[i].data.is_some())
            .filter(|&i| matches!(st.action, Action::Resync | Action::Check | Action::Repair) || !st.in_sync[i])
            .collect()
    }

    /// Copy (or compare) region `r` to the legs `targets`; Err: a leg failed
    /// (marked) or nothing to read from.
    fn copy_region(&self, r: u64, action: Action, targets: &[usize]) -> Result<(), ()> {
        let start = r * self.region;
        let end = (start + self.region).min(self.span);
        let mut s = start;
        while s < end {
            // raid1 copies the region at once; the others a chunk (a row) at a time
            let n = match self.geo.level {
                Level::Raid1 => end - s,
                _ => (self.geo.chunk - s % self.geo.chunk).min(end - s),
            };
            match self.geo.level {
                Level::Parity { .. } => self.copy_row(s, n, action, targets)?,
                _ => self.copy_piece(&self.copies_of(s), n, action, targets)?,
            }
            s += n;
        }
        Ok(())
    }

    /// raid1 and raid10: `n` sectors of one chunk's `copies`, from the first
    /// that holds its data to the others on `targets` (compared first for a
    /// check or repair).
    fn copy_piece(&self, copies: &[(usize, u64)], n: u64, action: Action, targets: &[usize]) -> Result<(), ()> {
        let source = {
            let st = self.lock();
            copies.iter().copied().find(|&(i, _)| self.good(&st, i))
        };
        let Some((src, src_at)) = source else { return Err(()) };
        let mut buf = vec![0u8; (n * SECTOR) as usize];
        if !self.read_leg(src, src_at, &mut buf) {
            return Err(());
        }
        let mut other = vec![0u8; buf.len()];
        for &(t, at) in copies {
            if t == src || !targets.contains(&t) {
                continue;
            }
            if matches!(action, Action::Check | Action::Repair) {
                if !self.read_leg(t, at, &mut other) {
                    return Err(());
                }
                if other == buf {
                    continue;
                }
                self.lock().mismatches += n;
                if action == Action::Check {
                    continue;
                }
            }
            self.put_leg(t, at, &buf, false).map_err(drop)?;
        }
        Ok(())
    }

    /// raid4/5/6: the row at leg sector `at`, `n` sectors: a resync or repair
    /// writes its parity again (a check compares it, counting mismatched 4 KiB
    /// pages as md does, 8 sectors each), a recovery rebuilds the blocks of
    /// the legs `targets` that are not in sync.
    fn copy_row(&self, at: u64, n: u64, action: Action, targets: &[usize]) -> Result<(), ()> {
        let row = self.geo.row_at(at);
        let len = (n * SECTOR) as usize;
        let Some((data, p, q)) = self.read_row(&row, at, len) else { return Err(()) };
        let mut want_p = vec![0u8; len];
        let mut want_q = row.q.map(|_| vec![0u8; len]);
        let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        parity::syndromes(&refs, &row.coef, &mut want_p, want_q.as_deref_mut());
        if matches!(action, Action::Check | Action::Repair) {
            // each 4 KiB row whose P or Q is wrong counts once
            let pages = (0..len.div_ceil(4096))
                .filter(|&k| {
                    let r = k * 4096..((k + 1) * 4096).min(len);
                    p[r.clone()] != want_p[r.clone()]
                        || matches!((&q, &want_q), (Some(q), Some(wq)) if q[r.clone()] != wq[r.clone()])
                })
                .count();
            self.lock().mismatches += pages as u64 * 8;
            if action == Action::Check || pages == 0 {
                return Ok(());
            }
        }
        let write = |leg: usize, buf: &[u8]| -> Result<(), ()> {
            if targets.contains(&leg) {
                self.put_leg(leg, at, buf, false).map_err(drop)?;
            }
            Ok(())
        };
        if action == Action::Recover {
            for (k, &leg) in row.data.iter().enumerate() {
                write(leg, &data[k])?;
            }
        }
        write(row.p, &want_p)?;
        if let (Some(qd), Some(wq)) = (row.q, &want_q) {
            write(qd, wq)?;
        }
        Ok(())
    }

    /// One step of the current copy: the next region it needs. False once
    /// there is none (the action is over).
    fn copy_step(self: &Arc<Self>) -> bool {
        // a row being written whole is not read for a copy before it lands
        self.wait_landed(None);
        let mut st = self.lock();
        let action = st.action;
        if action == Action::Idle || st.frozen || st.stop {
            return false;
        }
        let targets = self.copy_targets(&st);
        // a resync needs every leg (md skips it on a degraded array); a
        // recovery an array that can run
        let runnable = self.can_run(|i| self.good(&st, i));
        if !runnable || (action == Action::Resync && Self::degraded(&st) && self.geo.level != Level::Raid1) {
            if !runnable {
                st.action = Action::Idle;
            } else {
                self.finish_action(&mut st);
            }
            return false;
        }
        let all = st.all_regions;
        let mut r = st.cursor;
        while r < self.regions && !all && !st.needed[r as usize] {
            r += 1;
        }
        let single = self.geo.level == Level::Raid1 && {
            let source = (0..self.nlegs()).find(|&i| self.good(&st, i));
            targets.iter().all(|&t| Some(t) == source)
        };
        if r >= self.regions || single || targets.is_empty() {
            self.finish_action(&mut st);
            return false;
        }
        st.busy = Some(r);
        while st.writes[r as usize] > 0 && !st.stop {
            if !st.jobs.is_empty() {
                // writes this thread is to do (raid4/5/6, raid10 zeroing):
                // done here, or the region would wait for itself
                drop(st);
                self.run_jobs();
                st = self.lock();
                continue;
            }
            st = self.drained.wait_timeout(&self.st, st, Duration::from_millis(50)).0;
        }
        drop(st);
        let res = self.copy_region(r, action, &targets);
        let mut st = self.lock();
        st.busy = None;
        self.drained.notify_all();
        if res.is_ok() {
            if !Self::degraded(&st) || action != Action::Recover {
                st.needed[r as usize] = false;
            }
            st.cursor = r + 1;
            st.progress = ((r + 1) * self.region).min(self.span);
            if action == Action::Resync && st.resync_offset != MAX_SECTOR {
                st.resync_offset = st.progress;
            }
        }
        self.release_waiting(&mut st);
        true
    }

    /// raid1 and raid10: write one region a read failed on again, each of
    /// its chunks from a leg that holds a copy, writes to the region held
    /// meanwhile; read back, it must match, or the leg fails. False if there
    /// was none to do.
    fn fix_step(&self) -> bool {
        let mut st = self.lock();
        if st.frozen || st.stop || st.busy.is_some() {
            return false;
        }
        let Some(&(i, r)) = st.fixes.first() else { return false };
        st.busy = Some(r);
        while st.writes[r as usize] > 0 && !st.stop {
            st = self.drained.wait_timeout(&self.st, st, Duration::from_millis(50)).0;
        }
        drop(st);
        let (start, end) = (r * self.region, ((r + 1) * self.region).min(self.span));
        let mut fixed = true;
        let mut s = start;
        while s < end && fixed {
            // raid10's copies lie chunk by chunk; raid1's region is one piece
            let n = match self.geo.level {
                Level::Raid10(_) => (self.geo.chunk - s % self.geo.chunk).min(end - s),
                _ => end - s,
            };
            let copies = self.copies_of(s);
            if let Some(&(_, at)) = copies.iter().find(|&&(l, _)| l == i) {
                let source = {
                    let st = self.lock();
                    copies.iter().copied().find(|&(j, _)| j != i && self.good(&st, j))
                };
                let len = (n * SECTOR) as usize;
                fixed = source.is_some_and(|(j, from)| {
                    let mut good = vec![0u8; len];
                    self.read_leg(j, from, &mut good) && self.write_back(i, at, &good)
                });
            }
            s += n;
        }
        let mut st = self.lock();
        st.fixes.retain(|&f| f != (i, r));
        st.busy = None;
        if fixed {
            tracing::info!("raid: read error corrected: region {r} of leg {i} written again from another leg");
        } else {
            self.fail_leg(&mut st, i);
        }
        self.drained.notify_all();
        self.release_waiting(&mut st);
        true
    }

    /// The copy reached the end.
    fn finish_action(&self, st: &mut State) {
        tracing::info!("raid: {} done", st.action.name());
        match st.action {
            Action::Resync => {
                st.resync_offset = MAX_SECTOR;
                // a leg that failed meanwhile still needs what was written
                if !Self::degraded(st) {
                    st.needed.fill(false);
                }
            }
            Action::Recover => {
                for i in 0..self.nlegs() {
                    if !st.faulty[i] && self.legs[i].data.is_some() {
                        st.in_sync[i] = true;
                    }
                }
                st.fullsync = false;
                st.needed.fill(false);
            }
            _ => {}
        }
        st.progress = self.span;
        st.action = Action::Idle;
        st.cursor = 0;
        st.events = st.events.saturating_add(1);
        st.sb_dirty = true;
        // the legs it copied to are called in sync once their copies are durable
        st.clearing = true;
        self.events.fetch_add(1, Ordering::SeqCst);
    }

    /// The daemon's pass: regions idle for two passes lose their bit, on an
    /// array whose legs are all in sync and with no copy under way.
    fn clear_idle_bits(&self) {
        let _one = crate::sync::lock(&self.writing);
        let mut st = self.lock();
        if Self::degraded(&st) || st.action != Action::Idle || st.frozen || self.legs.iter().all(|l| l.meta.is_none()) {
            return;
        }
        let mut changed = false;
        for r in 0..self.regions as usize {
            if st.on_disk[r] && st.writes[r] == 0 && !st.wanted[r] {
                st.idle_passes[r] = st.idle_passes[r].saturating_add(1);
                if st.idle_passes[r] >= 2 {
                    st.on_disk[r] = false;
                    let page = (BITMAP_SB_BYTES + r / 8) / 4096;
                    if st.dirty_pages.len() < self.pages() {
                        st.dirty_pages.resize(self.pages(), false);
                    }
                    st.dirty_pages[page] = true;
                    changed = true;
                }
            }
        }
        if changed {
            st.events_cleared = st.events;
            drop(st);
            self.write_metadata(true);
            // writes that came meanwhile for a cleared region wait for a set
            self.wake.notify_all();
        }
    }

    /// Set the bits writes wait for, write them, and let the writes go: a
    /// region counts as marked only once its bit is durable.
    fn set_wanted_bits(&self) {
        let _one = crate::sync::lock(&self.writing);
        let mut st = self.lock();
        if !st.want_bits && !st.sb_dirty {
            return;
        }
        st.want_bits = false;
        if st.dirty_pages.len() < self.pages() {
            st.dirty_pages.resize(self.pages(), false);
        }
        let mut newly = Vec::new();
        for r in 0..self.regions as usize {
            if std::mem::take(&mut st.wanted[r]) && !st.on_disk[r] {
                st.setting[r] = true;
                st.idle_passes[r] = 0;
                let page = (BITMAP_SB_BYTES + r / 8) / 4096;
                st.dirty_pages[page] = true;
                newly.push(r);
            }
        }
        if st.sb_dirty {
            st.events = st.events.saturating_add(1);
        }
        st.sb_dirty = false;
        // a copy under way records its progress: what it copied must be durable
        let clearing = std::mem::take(&mut st.clearing) || st.action != Action::Idle;
        drop(st);
        self.write_metadata(clearing);
        let mut st = self.lock();
        for r in newly {
            st.setting[r] = false;
            st.on_disk[r] = true;
        }
        self.release_waiting(&mut st);
    }
}

struct WriteDone {
    left: AtomicUsize,
    good: AtomicUsize,
    failed: Mutex<Vec<usize>>,
}

/// The target's thread: metadata the writes wait for first, then one region of
/// copying at a time, and the daemon pass every period.
fn worker(weak: std::sync::Weak<Inner>) {
    let mut last_pass = crate::sync::now();
    loop {
        let Some(me) = weak.upgrade() else { return };
        {
            let st = me.lock();
            if st.stop {
                return;
            }
            // metadata waited for goes out even while suspending (the writes
            // waiting for it must drain); nothing before the first resume
            let started = st.started;
            let busy = started
                && (st.want_bits
                    || st.sb_dirty
                    || !st.jobs.is_empty()
                    || (!st.fixes.is_empty() && !st.frozen)
                    || (st.action != Action::Idle && !st.frozen));
            if !busy {
                let nap = me.daemon_period.clamp(Duration::from_millis(1), Duration::from_millis(500));
                drop(me.wake.wait_timeout(&me.st, st, nap));
            }
            if !started {
                continue;
            }
        }
        me.set_wanted_bits();
        if me.run_jobs() {
            continue;
        }
        if me.fix_step() {
            continue;
        }
        if me.copy_step() {
            continue;
        }
        let period = me.daemon_period;
        if crate::sync::since(last_pass) >= period {
            last_pass = crate::sync::now();
            me.clear_idle_bits();
        }
    }
}

impl Drop for Raid {
    fn drop(&mut self) {
        {
            let mut st = self.inner.lock();
            st.stop = true;
            self.inner.release_waiting(&mut st);
        }
        self.inner.wake.notify_all();
        self.inner.drained.notify_all();
        if let Some(t) = self.worker.take() {
            let _ = t.join();
        }
    }
}

fn dev_name(d: &Option<DevRef>) -> String {
    d.as_ref().map_or_else(|| "-".into(), |d| d.table_name())
}

impl Target for Raid {
    fn type_name(&self) -> &'static str {
        "raid"
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        match self.inner.geo.level {
            Level::Raid0 => return self.inner.map_raid0(bio, ctx),
            Level::Parity { .. } => return self.inner.map_parity(bio, ctx),
            Level::Raid10(_) if bio.op == Op::Discard => {
                ctx.complete(bio, crate::io::LeafKind::Drop);
                return Ok(());
            }
            // zeroing chunk by chunk on the target's thread, like a write
            Level::Raid10(_) if bio.op == Op::WriteZeroes => return self.inner.queue_write(self.inner.lock(), bio, ctx),
            _ => {}
        }
        match bio.op {
            Op::Read => self.inner.map_read(bio, ctx),
            // a flush waits for the superblocks alone, and goes to every leg
            Op::Flush => self.inner.map_mirrored(bio, 0..0, ctx),
            Op::Write | Op::Discard | Op::WriteZeroes => {
                let regions = self.inner.regions_of(&bio);
                self.inner.map_mirrored(bio, regions, ctx)
            }
        }
    }

    fn table_params(&self) -> String {
        let o = &self.opts;
        let mut p: Vec<String> = vec![self.inner.geo.chunk.to_string()];
        if o.sync {
            p.push("sync".into());
        }
        if o.nosync {
            p.push("nosync".into());
        }
        let mut rebuild = o.rebuild.clone();
        rebuild.sort_unstable();
        for i in rebuild {
            p.extend(["rebuild".into(), i.to_string()]);
        }
        if o.daemon_sleep.is_some() {
            p.extend([
                "daemon_sleep".into(),
                (u64::from(self.inner.daemon_sleep_s.max(1)) * HZ).to_string(),
            ]);
        }
        if let Some(v) = o.min_recovery_rate {
            p.extend(["min_recovery_rate".into(), v.to_string()]);
        }
        if let Some(v) = o.max_recovery_rate {
            p.extend(["max_recovery_rate".into(), v.to_string()]);
        }
        let mut wm = o.write_mostly.clone();
        wm.sort_unstable();
        for i in wm {
            p.extend(["write_mostly".into(), i.to_string()]);
        }
        if o.max_write_behind.is_some() {
            p.extend(["max_write_behind".into(), self.inner.write_behind.to_string()]);
        }
        if o.region_size.is_some() {
            p.extend(["region_size".into(), self.inner.region.to_string()]);
        }
        if let Some(v) = o.stripe_cache {
            p.extend(["stripe_cache".into(), v.to_string()]);
        }
        if let Some(v) = o.raid10_copies {
            p.extend(["raid10_copies".into(), v.to_string()]);
        }
        if let Some(v) = &o.raid10_format {
            p.extend(["raid10_format".into(), v.clone()]);
        }
        if o.raid10_use_near_sets {
            p.push("raid10_use_near_sets".into());
        }
        if let Some(v) = o.data_offset {
            p.extend(["data_offset".into(), v.to_string()]);
        }
        let mut s = format!(
            "{} {} {} {}",
            self.inner.type_name,
            p.len(),
            p.join(" "),
            self.inner.nlegs()
        );
        for l in &self.inner.legs {
            s.push_str(&format!(" {} {}", dev_name(&l.meta), dev_name(&l.data)));
        }
        s
    }

    fn status_params(&self) -> String {
        let me = &self.inner;
        let st = me.lock();
        let action = if st.frozen && st.action != Action::Idle {
            "frozen"
        } else {
            st.action.name()
        };
        let resyncing = matches!(st.action, Action::Resync) || (st.frozen && st.action != Action::Idle);
        let check = matches!(st.action, Action::Check | Action::Repair);
        let mut health = String::with_capacity(me.nlegs());
        for i in 0..me.nlegs() {
            health.push(if me.legs[i].data.is_none() {
                '-'
            } else if st.faulty[i] {
                'D'
            } else if !check && (resyncing || !st.in_sync[i]) {
                'a'
            } else {
                'A'
            });
        }
        let synced = if st.action == Action::Idle {
            if st.resync_offset == MAX_SECTOR {
                me.span
            } else {
                st.resync_offset.min(me.span)
            }
        } else {
            st.progress.min(me.span)
        };
        // raid0: always in sync, over each leg's sectors
        let (synced, total) = if me.geo.level == Level::Raid0 {
            (me.geo.dev_sectors, me.geo.dev_sectors)
        } else {
            (synced, me.span)
        };
        format!(
            "{} {} {health} {synced}/{total} {action} {} 0 -",
            layout::status_name(me.geo.level),
            me.nlegs(),
            st.mismatches
        )
    }

    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        let me = &self.inner;
        if me.geo.level == Level::Raid0 {
            return Err("raid0 takes no messages: invalid argument".into());
        }
        let mut st = me.lock();
        if st.frozen {
            return Err(TargetError::busy("raid set is suspended: device or resource busy"));
        }
        let w = words.first().map(|w| w.to_ascii_lowercase()).unwrap_or_default();
        if w == "frozen" || w == "idle" {
            // stops the copy under way; the kernel then answers EINVAL (docs/design/dm-raid.md §8)
            if matches!(st.action, Action::Check | Action::Repair) {
                st.action = Action::Idle;
                st.cursor = 0;
            }
            return Err(format!("raid message '{w}': invalid argument (the copy under way, if any, stopped)").into());
        }
        if st.action != Action::Idle {
            return Err(TargetError::busy(format!(
                "raid set is busy with {}: device or resource busy",
                st.action.name()
            )));
        }
        match w.as_str() {
            "resync" => {
                if st.resync_offset != MAX_SECTOR {
                    st.action = Action::Resync;
                    st.all_regions = true;
                }
            }
            "recover" => {
                if st.in_sync.iter().zip(&st.faulty).any(|(&s, &f)| !s && !f) {
                    st.action = Action::Recover;
                    st.all_regions = st.fullsync;
                }
            }
            "check" | "repair" => {
                st.action = if w == "check" { Action::Check } else { Action::Repair };
                st.all_regions = true;
                st.mismatches = 0;
                st.cursor = 0;
                st.progress = 0;
            }
            _ => return Err(format!("raid message '{w}': invalid argument").into()),
        }
        drop(st);
        me.wake.notify_all();
        Ok(String::new())
    }

    fn devices(&self) -> Vec<&DevRef> {
        self.inner.legs.iter().filter_map(|l| l.data.as_ref()).collect()
    }

    fn held_devices(&self) -> Vec<&DevRef> {
        let mut v = Vec::new();
        for l in &self.inner.legs {
            v.extend(l.meta.iter());
            v.extend(l.data.iter());
        }
        v
    }

    fn max_io_len(&self) -> u64 {
        let g = &self.inner.geo;
        match g.level {
            Level::Raid1 => self.inner.region,
            // a whole row, so a large write reaches the target's thread as
            // full rows, written without reading
            Level::Parity { .. } => g.row_sectors(),
            _ => g.chunk,
        }
    }

    fn limits(&self) -> crate::mapper::Limits {
        let mut l = crate::mapper::Limits::stacked(&self.devices());
        if !matches!(self.inner.geo.level, Level::Raid0 | Level::Raid1) {
            // discards are dropped and zeroing is written (see map)
            l.discard = false;
            l.write_zeroes = false;
        }
        if self.inner.geo.level != Level::Raid1 {
            l.io_min = self.inner.geo.chunk * SECTOR;
            l.io_opt = self.inner.geo.row_sectors() * SECTOR;
        }
        l
    }

    fn presuspend(&self) {
        self.inner.lock().frozen = true;
    }

    fn postsuspend(&self) {
        let me = &self.inner;
        {
            let mut st = me.lock();
            // a copy under way finishes first (frozen: no other starts), or it
            // could write a region's old bytes after the next table's writes
            while st.busy.is_some() {
                st = me.drained.wait_timeout(&me.st, st, Duration::from_millis(10)).0;
            }
            // drained and in sync: every bit cleared, as md flushes its bitmap
            // at a suspend, so a bit found set at the next load means a crash
            if !Inner::degraded(&st) && st.action == Action::Idle && st.writes.iter().all(|&w| w == 0) {
                st.on_disk.fill(false);
                st.dirty_pages = vec![true; me.pages()];
                st.clearing = true;
            }
            st.sb_dirty = true;
        }
        // what the writes set and the copy reached, on disk before the table goes
        me.set_wanted_bits();
    }

    fn preresume(&self) -> Result<(), TargetError> {
        if self.inner.lock().started {
            return Ok(());
        }
        self.inner.assemble(&self.opts)
    }

    fn resume(&self) {
        let first = !std::mem::replace(&mut self.inner.lock().started, true);
        if first {
            // the superblocks (a new array's first) are on disk before the
            // resume returns, as the kernel writes them at preresume: a crash
            // cannot leave one leg with a superblock and another without
            self.inner.set_wanted_bits();
        }
        self.inner.lock().frozen = false;
        self.inner.wake.notify_all();
    }

    fn events(&self) -> u64 {
        self.inner.events.load(Ordering::SeqCst)
    }
}
