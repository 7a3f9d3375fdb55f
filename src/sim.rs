//! Deterministic crash trials (`dmkit sim`): one seed drives a random workload
//! against a device stack on simulated disks ([`crate::io::sim`]), the crash
//! point, what the crash keeps, and an injected I/O error; the stack is then
//! reopened from the surviving bytes and checked.
//!
//! Every 512-byte sector a trial writes names itself: the write's id, the device
//! and the sector, then bytes derived from those. So a sector read back is either
//! zeroes or tells which write it came from, and the checks are exact:
//!
//! - before the crash, every read returns the last write to each sector;
//! - after it, every sector holds its last durable write (acknowledged, then made
//!   durable by a completed flush or FUA) or a write issued after that one, and
//!   never a sector of another device or another place, nor bytes never written;
//! - thin-pool metadata passes dmkit's checker after every trial;
//! - era: every block a write landed in (acknowledged, or found on the origin
//!   after the crash) is marked in the era metadata as written in the era the
//!   write was issued in or a later one;
//! - nothing panics.
//!
//! Trials run in-process through the device registry and dm-io, without the
//! daemon or sockets. The seed fixes the workload, the crash point and the
//! crash's choices, and the order of every thread: the trial's thread and the
//! targets' own (commit threads, kcopyd's jobs, workers) run one at a time
//! under a scheduler drawing from the seed, on virtual time
//! ([`crate::sync::sched`]), so a trial replays from its seed alone
//! (`--check-replay` runs each twice and compares their I/O).

use crate::io::sim::{self, SimDisk};
use crate::io::Op;
use crate::mapper::devio;
use crate::mapper::engine::{Dest, Engine};
use crate::mapper::Device;
use crate::mapper::{config::Config, Registry};
use crate::sync::sched::{Enrolment, Sched};
use crate::sync::Unpoison;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const SECTOR: u64 = 512;
/// Writes and reads are in 4 KiB units (the writecache block size).
const BLOCK: u64 = 4096;
const SPB: u64 = BLOCK / SECTOR;
/// The cache stack: blocks of 32 KiB, 16 of them in the cache, over the
/// first 2 MiB of the origin the workload writes (64 blocks), so blocks are
/// promoted and the cache fills.
const CACHE_BLOCK: u64 = 64;
const CACHE_BLOCKS: u64 = 16;
const CACHE_SPAN: u64 = (2 << 20) / SECTOR;
/// The integrity stacks' device: 8 MiB of a 10 MiB file.
const INTEGRITY_SECTORS: u64 = (8 << 20) / SECTOR;
/// The era stack's blocks: 16 KiB, so writes share and straddle them.
const ERA_BLOCK: u64 = 32;

/// The device stacks a trial can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stack {
    /// A thin-pool with up to four thins and snapshots of them.
    Thin,
    /// writecache (ssd mode) over a linear origin file.
    Writecache,
    /// snapshot-origin with one persistent snapshot.
    Snapshot,
    /// cache (writeback, smq) over an origin file with a cache of 16 blocks,
    /// switched to `cleaner` and back by its messages.
    Cache,
    /// era over an origin file, with checkpoints and metadata snapshots.
    Era,
    /// raid1 of two legs (metadata and data files each), reloaded now and then.
    Raid,
    /// raid5 (left symmetric) of three legs, chunks of 8 KiB, reloaded now and then.
    Raid5,
    /// integrity in journal mode (a journal of two sections, committed at
    /// 30% full, so commits wrap it), reloaded now and then.
    Integrity,
    /// integrity in bitmap mode (regions of 128 KiB, bits cleared every
    /// 20 ms), reloaded now and then.
    IntegrityBitmap,
    /// cdp (every flush a point) over data blocks for the device and 64 more,
    /// so retention drops points for room, reloaded now and then.
    Cdp,
}

impl Stack {
    pub fn name(self) -> &'static str {
        match self {
            Stack::Thin => "thin",
            Stack::Writecache => "writecache",
            Stack::Snapshot => "snapshot",
            Stack::Cache => "cache",
            Stack::Era => "era",
            Stack::Raid => "raid",
            Stack::Raid5 => "raid5",
            Stack::Integrity => "integrity",
            Stack::IntegrityBitmap => "integrity-bitmap",
            Stack::Cdp => "cdp",
        }
    }
    pub fn parse(s: &str) -> Option<Stack> {
        match s {
            "thin" => Some(Stack::Thin),
            "writecache" => Some(Stack::Writecache),
            "snapshot" => Some(Stack::Snapshot),
            "cache" => Some(Stack::Cache),
            "era" => Some(Stack::Era),
            "raid" => Some(Stack::Raid),
            "raid5" => Some(Stack::Raid5),
            "integrity" => Some(Stack::Integrity),
            "integrity-bitmap" => Some(Stack::IntegrityBitmap),
            "cdp" => Some(Stack::Cdp),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    pub stack: Stack,
    pub seed: u64,
    /// Operations before the crash (at most; a crash mid-way ends the run).
    pub ops: usize,
    /// Test-only: skip the flush before a thin-pool superblock write.
    pub break_commit_order: bool,
    /// Inject an I/O error in one trial of four.
    pub io_errors: bool,
    /// Where the trial's files go (a memory filesystem keeps trials fast).
    pub dir: PathBuf,
    /// Thin: in trials whose seed is a multiple of this (0: none), the reference
    /// `thin_check` checks the crash image and the recovered metadata too, and
    /// must agree with dmkit's checker.
    pub ref_check_every: u64,
    /// The crash is a kill of the daemon, not a power cut: every write issued
    /// is kept, the restart logs (`io::restart_log`) are on, and every write
    /// acknowledged before the kill must be there after it.
    pub kill: bool,
    /// Test-only: kill trials without the restart logs (they must fail).
    pub no_restart_logs: bool,
    /// Run each trial twice and fail it if the two did not do the same I/O in
    /// the same order (their [`Outcome::fingerprints`] differ).
    pub check_replay: bool,
}

/// What a passing trial did.
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub ops: usize,
    /// Requests the workload kept under way at most.
    pub depth: usize,
    pub acked_writes: u64,
    pub flushes: u64,
    /// Sectors checked after the crash.
    pub sectors_checked: u64,
    pub crashed_mid_op: bool,
    pub io_errors_injected: u64,
    /// raid5: sectors not checked, in rows a degraded array's write hole may
    /// have torn (see `verify`).
    pub write_hole_sectors: u64,
    /// Where the crash was placed.
    pub crash: Option<CrashKind>,
    /// Metadata images the reference thin_check agreed on.
    pub ref_checked: u64,
    /// cache: blocks promoted before the crash, and written back by the
    /// `cleaner` (dirty blocks gone while it ran).
    pub promotions: u64,
    pub writebacks: u64,
    /// era: blocks whose marks were checked after the crash.
    pub era_blocks_checked: u64,
    /// The simulated disk's [`fingerprint`](SimDisk::fingerprint) of the run
    /// that crashed, at the crash, and of the recovery after it: a trial that
    /// replays from its seed has the same two every time.
    pub fingerprints: (u64, u64),
}

/// The command that replays a trial.
pub fn replay_command(o: &Options) -> String {
    format!(
        "dmkit sim --stack {} --seed {} --ops {}{}{}{}{}",
        o.stack.name(),
        o.seed,
        o.ops,
        if o.break_commit_order {
            " --break-commit-order"
        } else {
            ""
        },
        if o.io_errors { "" } else { " --no-io-errors" },
        if o.kill { " --kill" } else { "" },
        if o.ref_check_every > 0 && o.stack == Stack::Thin {
            " --ref-check-every 1"
        } else {
            ""
        }
    )
}

/// splitmix64: the one source of every choice a trial makes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x6a09_e667_f3bc_c909)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The content of sector `sector` of device `dev` as write `id` wrote it.
fn fill_sector(out: &mut [u8], id: u64, dev: u64, sector: u64) {
    out[0..8].copy_from_slice(&id.to_le_bytes());
    out[8..16].copy_from_slice(&dev.to_le_bytes());
    out[16..24].copy_from_slice(&sector.to_le_bytes());
    let mut x = id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (dev << 48) ^ sector;
    for w in out[24..].chunks_mut(8) {
        let b = crate::rng::step(&mut x).to_le_bytes();
        w.copy_from_slice(&b[..w.len()]);
    }
}

/// Which write a sector read back came from: 0 for zeroes, or an error that
/// says what is wrong with it.
fn identify(buf: &[u8], dev: u64, sector: u64) -> Result<u64, String> {
    if buf.iter().all(|&b| b == 0) {
        return Ok(0);
    }
    let word = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&buf[i..i + 8]);
        u64::from_le_bytes(a)
    };
    let (id, d, s) = (word(0), word(8), word(16));
    let mut want = [0u8; SECTOR as usize];
    fill_sector(&mut want, id, d, s);
    if want[..] != *buf {
        return Err(format!(
            "sector {sector} holds bytes no write of this trial wrote"
        ));
    }
    if d != dev || s != sector {
        return Err(format!(
            "sector {sector} of device {dev} holds write {id} of device {d} sector {s}"
        ));
    }
    Ok(id)
}

/// What a sector may hold.
#[derive(Clone, Default, Debug)]
struct SectorModel {
    /// The last write known durable (0: zeroes, never written).
    durable: u64,
    /// Writes (and discards, as 0) issued since, oldest first; the last one is
    /// what a read returns before the crash.
    newer: Vec<u64>,
    /// Writes that were durable once and were superseded since.
    past: Vec<u64>,
    /// How many of `newer` (from the oldest) were acknowledged.
    acked: usize,
}

impl SectorModel {
    /// Whether a read before the crash may return `id`: the last write, or after
    /// discards (which a target may ignore, as dm-thin ignores partial blocks)
    /// zeroes or the last write before them.
    fn current_allows(&self, id: u64) -> bool {
        self.last_of_allows(&self.newer, id)
    }
    /// Whether a read may return `id` when `writes` (oldest first, 0 for a
    /// discard) are all that was done since the durable write.
    fn last_of_allows(&self, writes: &[u64], id: u64) -> bool {
        let mut it = writes.iter().rev();
        loop {
            match it.next() {
                Some(0) if id == 0 => return true,
                Some(0) => continue,
                Some(&w) => return w == id,
                None => return id == self.durable,
            }
        }
    }
    /// After a crash. A discard that has not been flushed leaves any earlier content of
    /// the sector possible. The kernel's writecache drops the cache entries and
    /// passes the discard to the origin without ordering the two, so the
    /// origin's older copy can come back. The contents after a discard are
    /// undefined by the block layer anyway.
    fn allows(&self, id: u64) -> bool {
        id == self.durable || self.newer.contains(&id) || (self.newer.contains(&0) && self.past.contains(&id))
    }
    /// After a kill of the daemon: what was acknowledged (as a read before the
    /// kill), or a write still in flight; after a discard, an older copy (the
    /// durable one too) as after a crash.
    fn kill_allows(&self, id: u64) -> bool {
        let (acked, later) = self.newer.split_at(self.acked.min(self.newer.len()));
        // a discard issued since may leave any older content (as after a crash)
        let discarded = self.newer.contains(&0) && (id == self.durable || self.past.contains(&id));
        later.contains(&id) || discarded || self.last_of_allows(acked, id)
    }
    /// Write `id` was acknowledged.
    fn acknowledged(&mut self, id: u64) {
        if let Some(i) = self.newer.iter().position(|&x| x == id) {
            self.acked = self.acked.max(i + 1);
        }
    }
    /// Write `id` (issued after everything in `newer`) is durable.
    fn make_durable(&mut self, id: u64) {
        if let Some(i) = self.newer.iter().position(|&x| x == id) {
            self.past.push(self.durable);
            self.past.extend(self.newer.drain(..=i).filter(|&x| x != id));
            self.durable = id;
            self.acked = self.acked.saturating_sub(i + 1);
        }
    }
}

/// One device's model: sectors by number (absent: never written, zeroes).
#[derive(Clone, Default)]
struct DevModel {
    sectors: BTreeMap<u64, SectorModel>,
    /// Writes acknowledged and not yet covered by a completed flush, with the
    /// trial's acknowledgement count when each was acknowledged.
    acked: Vec<(u64, u64, u64, u64)>, // (first sector, sectors, id, ack number)
    /// False while a create or delete of it is in doubt (crash during the message).
    certain: bool,
}

impl DevModel {
    fn issue(&mut self, sector: u64, n: u64, id: u64) {
        for s in sector..sector + n {
            self.sectors.entry(s).or_default().newer.push(id);
        }
    }
    fn ack(&mut self, sector: u64, n: u64, id: u64, fua: bool, seq: u64) {
        for s in sector..sector + n {
            if let Some(m) = self.sectors.get_mut(&s) {
                m.acknowledged(id);
            }
        }
        if fua {
            for s in sector..sector + n {
                if let Some(m) = self.sectors.get_mut(&s) {
                    m.make_durable(id);
                }
            }
        } else {
            self.acked.push((sector, n, id, seq));
        }
    }
    /// A flush issued when `upto` writes had been acknowledged completed: it
    /// covers those, not the ones acknowledged while it was in flight.
    fn flushed(&mut self, upto: u64) {
        let (covered, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.acked)
            .into_iter()
            .partition(|a| a.3 <= upto);
        self.acked = later;
        for (sector, n, id, _) in covered {
            for s in sector..sector + n {
                if let Some(m) = self.sectors.get_mut(&s) {
                    m.make_durable(id);
                }
            }
        }
    }
}

/// A device of the stack that takes I/O.
struct Dev {
    /// dm name.
    name: String,
    /// Model key and the id written into its sectors.
    key: u64,
    /// Sectors the workload uses.
    span: u64,
}

struct Trial {
    o: Options,
    rng: Rng,
    reg: Registry,
    /// The simulated disk under the trial's files.
    disk: Arc<SimDisk>,
    files: Vec<PathBuf>,
    models: HashMap<u64, DevModel>,
    devs: Vec<Dev>,
    next_id: u64,
    out: Outcome,
    /// Thin: the pool's next device id.
    next_thin: u64,
    /// The device whose id sectors of a device carry: a snapshot's lineage (its
    /// origin's, transitively), so data it shares with its origin identifies.
    owner_of: HashMap<u64, u64>,
    /// Thin ids deleted for certain: they must stay deleted after the crash.
    deleted: Vec<u64>,
    /// Injected I/O errors already accounted for.
    failures_seen: u64,
    /// Requests the workload keeps under way at most (1-8, chosen by the seed).
    depth: usize,
    /// The workload's request engine (`depth` slots), for every device.
    engine: Option<Engine>,
    /// The devices the workload sent requests to, by name.
    open: Vec<(String, Arc<Device>)>,
    /// Requests under way: (index in `open`, slot, what).
    in_flight: Vec<(usize, usize, Req)>,
    /// Acknowledgements so far (flushes cover those before their issue).
    acks: u64,
    /// The workload's own choices of when to wait for completions.
    pace: Rng,
    /// Writes under way when an injected I/O error was noticed: their
    /// acknowledgement proves nothing.
    undefined: Vec<u64>,
    /// cache: the `cleaner` policy is loaded, and the dirty count when it was;
    /// the promotion count of the live table when it was loaded (each table
    /// starts from what the metadata saved).
    cleaning: Option<u64>,
    promotions_at_load: u64,
    /// era: the current era, the era each write was issued in, and for each
    /// block the latest era a write to it that must be marked was issued in.
    era_now: u32,
    era_of: HashMap<u64, u32>,
    era_must: BTreeMap<u64, u32>,
    /// This thread's part in the scheduler the trial's threads run under.
    sched: Option<Enrolment>,
}

/// A workload request under way.
#[derive(Clone, Copy, Debug)]
enum Req {
    Write {
        key: u64,
        id: u64,
        sector: u64,
        n: u64,
        fua: bool,
    },
    Read {
        key: u64,
        sector: u64,
        n: u64,
    },
    /// Covers the acknowledgements up to `upto`.
    Flush {
        key: u64,
        upto: u64,
    },
    Discard {
        key: u64,
        sector: u64,
        n: u64,
    },
}

impl Req {
    /// The sectors it touches (None: a flush).
    fn range(&self) -> Option<(u64, u64)> {
        match *self {
            Req::Write { sector, n, .. } | Req::Read { sector, n, .. } | Req::Discard { sector, n, .. } => {
                Some((sector, n))
            }
            Req::Flush { .. } => None,
        }
    }
}

/// Whether `DMKIT_SIM_TRACE` is set: every operation of a trial printed (for
/// replays).
fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("DMKIT_SIM_TRACE").is_some())
}

/// A line of the trace that costs only its formatting: printed when
/// [`tracing`], and the last few kept in any case, for the watchdog.
fn trace(what: impl FnOnce() -> String) {
    let line = what();
    if tracing() {
        eprintln!("sim: {line}");
    }
    let mut w = WATCH.lock().unpoisoned();
    if w.recent.len() == RECENT_LINES {
        w.recent.pop_front();
    }
    w.recent.push_back(line);
}

/// A line of the trace that asks the stack something (a status, which may
/// commit or wait): made only when [`tracing`], so a trial does the same
/// with tracing off as without this line.
fn trace_status(what: impl FnOnce() -> String) {
    if tracing() {
        trace(what);
    }
}

/// Trace lines the watchdog prints.
const RECENT_LINES: usize = 40;

/// What the trial under way is doing, for the watchdog.
struct Watch {
    /// The trial's replay command and when it started; None between trials.
    trial: Option<(String, std::time::Instant)>,
    recent: std::collections::VecDeque<String>,
}

static WATCH: Mutex<Watch> = Mutex::new(Watch {
    trial: None,
    recent: std::collections::VecDeque::new(),
});

/// A trial that runs longer than this is stuck (one takes well under a second).
const TRIAL_STUCK: std::time::Duration = std::time::Duration::from_secs(120);

/// While it lives, a thread watches the trials: one that runs past
/// [`TRIAL_STUCK`] (a request a target never completes, a wait that never
/// ends) gets its replay command and its last events printed, and the process
/// exits with status 3, instead of hanging whoever runs it.
struct Watchdog(Arc<std::sync::atomic::AtomicBool>);

impl Watchdog {
    fn start() -> Watchdog {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let _ = std::thread::Builder::new().name("sim-watchdog".into()).spawn(move || {
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(500));
                let w = WATCH.lock().unpoisoned();
                if let Some((cmd, t0)) = &w.trial {
                    if t0.elapsed() > TRIAL_STUCK {
                        let recent: Vec<&str> = w.recent.iter().map(String::as_str).collect();
                        eprintln!(
                            "sim: a trial has run for {} s and is stuck; replay: {cmd}\nits last events:\n  {}\n\
                             threads: {}\ndescriptors: {}",
                            TRIAL_STUCK.as_secs(),
                            recent.join("\n  "),
                            crate::io::describe_threads(true),
                            crate::io::describe_fds()
                        );
                        std::process::exit(3);
                    }
                }
            }
        });
        Watchdog(stop)
    }

    /// Trial `o` starts (Some) or ended (None).
    fn trial(o: Option<&Options>) {
        let mut w = WATCH.lock().unpoisoned();
        w.trial = o.map(|o| (replay_command(o), std::time::Instant::now()));
        w.recent.clear();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// One trial at a time: they share the process's exclusive holds on files.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Run alone among trials.
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unpoisoned()
}

/// Run one trial. Err says what failed (the caller prints [`replay_command`]).
pub fn run_trial(o: &Options) -> Result<Outcome, String> {
    let _g = exclusive();
    // watched once it runs, not while it waits for another thread's trial
    Watchdog::trial(Some(o));
    let r = run_trial_alone(o);
    Watchdog::trial(None);
    r
}

fn run_trial_alone(o: &Options) -> Result<Outcome, String> {
    // the process's own: trials of another process (another test, a user's
    // `dmkit sim`) may run at the same time under the same directory
    let dir = o.dir.join(format!(
        "sim-{}-{}.{}",
        o.stack.name(),
        o.seed,
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| trial(o, &dir)));
    devio::release_thread_engine();
    if std::env::var_os("DMKIT_SIM_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    match r {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(format!("panic: {msg}"))
        }
    }
}

fn copy_dir(d: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    std::fs::read_dir(d)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| std::fs::read(e.path()).ok().map(|b| (e.path(), b)))
        .collect()
}

fn make_file(path: &Path, bytes: u64) -> Result<(), String> {
    let f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.set_len(bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Where a trial's crash goes. A first run of the workload without a crash
/// counts the events; the second run crashes at one of them, chosen by the seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashKind {
    /// As a flush inside a commit is about to reach the media: the point where a
    /// missing or misplaced flush shows (3 trials of 4).
    CommitFlush,
    /// Just after a write chosen uniformly among all of them.
    Write,
    /// After the last operation (with whatever is still unflushed).
    End,
}

fn choose_crash(seed: u64, counts: sim::Counts, kill: bool) -> (CrashKind, Option<sim::CrashAt>, sim::Fates) {
    let mut r = Rng::new(seed ^ 0x5eed_c4a5_11ed_0001);
    let roll = r.below(100);
    let fates = if kill {
        sim::Fates::Kept
    } else if r.chance(50) {
        sim::Fates::Independent
    } else {
        sim::Fates::NewestFirst
    };
    let (kind, at) = if roll < 75 && counts.commit_flushes > 0 {
        let n = 1 + r.below(counts.commit_flushes);
        (CrashKind::CommitFlush, Some(sim::CrashAt::CommitFlush(n)))
    } else if roll < 90 && counts.writes > 0 {
        let n = 1 + r.below(counts.writes);
        (CrashKind::Write, Some(sim::CrashAt::Write(n)))
    } else {
        (CrashKind::End, None)
    };
    (kind, at, fates)
}

/// The trial's registry: a daemon's, with restart logs under `dir` when the
/// crash is a kill.
fn registry(o: &Options, dir: &Path, disk: &Arc<SimDisk>) -> Registry {
    Registry::new(
        Config {
            direct_io: false,
            restart_logs: (o.kill && !o.no_restart_logs).then(|| dir.join("uncommitted")),
            sim: Some(disk.clone()),
            ..Config::default()
        },
        crate::targets::types(),
    )
}

fn new_trial(o: &Options, dir: &Path, disk: Arc<SimDisk>) -> Trial {
    Trial {
        o: o.clone(),
        rng: Rng::new(o.seed),
        reg: registry(o, dir, &disk),
        disk,
        files: Vec::new(),
        models: HashMap::new(),
        devs: Vec::new(),
        next_id: 1,
        out: Outcome::default(),
        next_thin: 0,
        owner_of: HashMap::new(),
        deleted: Vec::new(),
        failures_seen: 0,
        depth: 1 + Rng::new(o.seed ^ 0xdeb7_0000_0000_0001).below(8) as usize,
        engine: None,
        open: Vec::new(),
        in_flight: Vec::new(),
        acks: 0,
        pace: Rng::new(o.seed ^ 0x9ace_0000_0000_0001),
        undefined: Vec::new(),
        cleaning: None,
        promotions_at_load: 0,
        era_now: 0,
        era_of: HashMap::new(),
        era_must: BTreeMap::new(),
        sched: None,
    }
}

/// Make the stack on new files under a new simulation and run the workload until
/// its last operation or the crash `at`.
fn run_workload(
    o: &Options,
    dir: &Path,
    at: Option<sim::CrashAt>,
    fail: Option<sim::FailPlan>,
) -> Result<Trial, String> {
    let disk = SimDisk::new(o.break_commit_order);
    let mut t = new_trial(o, dir, disk.clone());
    // the run without a crash and the run with it the same up to the crash
    t.schedule(o.seed ^ 0x5c4e_d000_0000_0001);
    // a log of the first run (its files had other identities) is no use
    let _ = std::fs::remove_dir_all(dir.join("uncommitted"));
    let sizes: &[(&str, u64)] = match o.stack {
        Stack::Thin => &[("meta", 4 << 20), ("data", 16 << 20)],
        Stack::Writecache => &[("origin", 8 << 20), ("cache", 1 << 20)],
        Stack::Snapshot => &[("origin", 8 << 20), ("cow", 12 << 20)],
        Stack::Cache => &[
            ("meta", 2 << 20),
            ("cache", CACHE_BLOCKS * CACHE_BLOCK * SECTOR),
            ("origin", 8 << 20),
        ],
        Stack::Era => &[("meta", 2 << 20), ("origin", 8 << 20)],
        Stack::Raid => &[
            ("meta0", 1 << 20),
            ("data0", 8 << 20),
            ("meta1", 1 << 20),
            ("data1", 8 << 20),
        ],
        Stack::Raid5 => &[
            ("meta0", 1 << 20),
            ("data0", 4 << 20),
            ("meta1", 1 << 20),
            ("data1", 4 << 20),
            ("meta2", 1 << 20),
            ("data2", 4 << 20),
        ],
        Stack::Integrity | Stack::IntegrityBitmap => &[("data", 10 << 20)],
        Stack::Cdp => &[("data", 320 * 4096), ("journal", 128 << 10)],
    };
    for (n, bytes) in sizes {
        let p = dir.join(n);
        // a new file each run: a pool of the first run still on its way out
        // keeps the old one (pools are found by the metadata file's identity)
        let _ = std::fs::remove_file(&p);
        make_file(&p, *bytes)?;
        t.files.push(p);
    }
    if matches!(o.stack, Stack::Integrity | Stack::IntegrityBitmap) {
        // formatted and wiped before the simulation takes the file, as
        // `integritysetup format` leaves it
        t.wipe_integrity()?;
    }
    for p in &t.files {
        disk.register(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    disk.seed_completions(o.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    t.build(false)?;
    disk.crash_at(at);
    disk.fail_io(fail);
    while t.out.ops < o.ops && !disk.frozen() {
        t.step()?;
        t.out.ops += 1;
    }
    t.complete_all()?;
    Ok(t)
}

/// A run without a crash counts the events a crash can be placed at; the seed
/// picks the crash among them, what it keeps, and (one trial in four) an I/O
/// error before it.
fn plan_crash(
    o: &Options,
    dir: &Path,
) -> Result<(CrashKind, Option<sim::CrashAt>, sim::Fates, Option<sim::FailPlan>), String> {
    let mut first = run_workload(o, dir, None, None)?;
    let counts = first.disk.counts();
    let (kind, at, fates) = choose_crash(o.seed, counts, o.kill);
    let mut r = Rng::new(o.seed ^ 0xe10e_4404_0000_0001);
    let fail = (r.chance(25) && o.io_errors).then(|| {
        let kind = r.below(3);
        sim::FailPlan {
            nth: r.below(first.disk.ios_before(at)),
            reads: kind != 1,
            writes: kind != 0,
        }
    });
    first.teardown();
    first.unschedule()?;
    trace(|| {
        format!("events of a run without a crash: {counts:?}; the crash: {kind:?} {at:?} {fates:?}; I/O error: {fail:?}")
    });
    Ok((kind, at, fates, fail))
}

fn trial(o: &Options, dir: &Path) -> Result<Outcome, String> {
    let (kind, at, fates, fail) = plan_crash(o, dir)?;
    let mut t = run_workload(o, dir, at, fail)?;
    trace_status(|| {
        format!(
            "before the crash: {:?}",
            t.reg.table_lines(None, true, false, false)
        )
    });
    if o.stack == Stack::Cache {
        t.count_promotions();
        if let (Some(before), Some(now)) = (t.cleaning, t.status_field("cache", 10)) {
            t.out.writebacks += before.saturating_sub(now);
        }
    }
    t.out.crash = Some(kind);
    t.out.depth = t.depth;
    t.out.crashed_mid_op = t.disk.frozen();
    t.out.io_errors_injected = t.disk.failed();
    t.out.fingerprints.0 = t.disk.fingerprint();
    // the power goes
    let mut crash_rng = Rng::new(o.seed ^ 0xc0ff_ee00);
    let images = t.disk.crash_images(fates, |n| crash_rng.below(n));
    let logs_at_kill = copy_dir(&dir.join("uncommitted"));
    t.teardown();
    t.unschedule()?;
    for (p, img) in &images {
        std::fs::write(p, img).map_err(|e| format!("{}: {e}", p.display()))?;
        if std::env::var_os("DMKIT_SIM_KEEP").is_some() {
            let _ = std::fs::write(p.with_extension("crash"), img);
        }
    }
    let ref_check =
        o.stack == Stack::Thin && o.ref_check_every > 0 && o.seed.is_multiple_of(o.ref_check_every);
    if ref_check {
        // what the crash left, before the pool takes it up again
        let verdict = compare_thin_checks(&t.files[0], dir)?;
        t.out.ref_checked += 1;
        trace(|| format!("crash image: {verdict}"));
    }
    t.reopen_and_verify(dir, &logs_at_kill)?;
    if o.stack == Stack::Era {
        t.check_era_marks()?;
    }
    if o.stack == Stack::Thin {
        let meta = &t.files[0];
        let dev = crate::pdata::FileDev::open(meta, false).map_err(|e| format!("{}: {e}", meta.display()))?;
        let r = crate::thin::check::check(Box::new(dev), false);
        metadata_verdict(&r, t.depth).map_err(|e| format!("thin-pool metadata after the crash: {e}"))?;
        if ref_check {
            compare_thin_checks(meta, dir)?;
            t.out.ref_checked += 1;
        }
    }
    Ok(t.out)
}

/// Whether the metadata a crash left may be taken as it is. Only leaked data
/// blocks are allowed, at most two per request that was under way: a commit (for
/// another request's flush) records a block allocated to a write whose
/// preparation (zeroing, copying) has not finished, and the crash comes before
/// the commit that maps it. The kernel's dm-thin has the same window (the
/// allocation in provision_block, the insert in process_prepared_mapping), and
/// thin_check calls such leaks non-fatal.
fn metadata_verdict(r: &crate::thin::check::Report, depth: usize) -> Result<(), String> {
    let leaked_data = |l: &String| {
        l.strip_suffix(" data blocks have leaked.")
            .and_then(|n| n.parse::<u64>().ok())
    };
    let bound = 2 * depth as u64;
    let leaks_ok = r
        .leaks
        .iter()
        .all(|l| leaked_data(l).is_some_and(|n| depth > 1 && n <= bound));
    if r.fatal.is_some() || !r.errors.is_empty() || !leaks_ok {
        return Err(format!(
            "{} (with {depth} requests under way at most)",
            check_findings(r)
        ));
    }
    Ok(())
}

/// Everything dmkit's checker found, fatal or not.
fn check_findings(r: &crate::thin::check::Report) -> String {
    r.fatal
        .iter()
        .chain(&r.errors)
        .chain(&r.non_fatal)
        .chain(&r.leaks)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ")
}

/// The reference `thin_check` (thin-provisioning-tools 1.x): `DMKIT_REF_THIN_CHECK`,
/// else `$TPT_REF/usr/sbin/thin_check`, else where ci/install.sh puts it.
pub fn ref_thin_check() -> PathBuf {
    if let Some(p) = std::env::var_os("DMKIT_REF_THIN_CHECK") {
        return PathBuf::from(p);
    }
    std::env::var_os("TPT_REF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/dmkit-ref/thin-provisioning-tools"))
        .join("usr/sbin/thin_check")
}

/// dmkit's checker and the reference `thin_check` on the metadata in `meta` must
/// agree (both clean, or both not); Err names the file and both verdicts.
/// Returns the common verdict.
fn compare_thin_checks(meta: &Path, dir: &Path) -> Result<&'static str, String> {
    let bin = ref_thin_check();
    // a copy: the reference takes the file exclusively, and ours may be in use
    let copy = dir.join("meta.check");
    std::fs::copy(meta, &copy).map_err(|e| format!("{}: {e}", copy.display()))?;
    let ours = {
        let dev =
            crate::pdata::FileDev::open(&copy, false).map_err(|e| format!("{}: {e}", copy.display()))?;
        crate::thin::check::check(Box::new(dev), false)
    };
    let out = std::process::Command::new(&bin)
        .arg(&copy)
        .output()
        .map_err(|e| format!("reference {}: {e} (ci/install.sh installs it)", bin.display()))?;
    let _ = std::fs::remove_file(&copy);
    let theirs = out.status.success();
    if ours.ok() != theirs {
        return Err(format!(
            "thin_check disagrees on {}: dmkit {} ({}), reference {} ({}: {})",
            meta.display(),
            if ours.ok() { "clean" } else { "damaged" },
            check_findings(&ours),
            if theirs { "clean" } else { "damaged" },
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(if theirs { "clean (both)" } else { "damaged (both)" })
}

fn words(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

impl Trial {
    fn path(&self, i: usize) -> String {
        self.files[i].display().to_string()
    }

    /// Create the stack; `again`: after the crash, from the surviving metadata.
    fn build(&mut self, again: bool) -> Result<(), String> {
        let e = |x: crate::mapper::registry::ControlError| x.to_string();
        match self.o.stack {
            Stack::Thin => {
                let data_sectors = (16 << 20) / SECTOR;
                let table = format!(
                    "0 {data_sectors} thin-pool {} {} 128 0 1 error_if_no_space",
                    self.path(0),
                    self.path(1)
                );
                self.reg.create("pool", Some(&table), false, None).map_err(e)?;
                if !again {
                    for _ in 0..2 {
                        self.create_thin(None)?;
                    }
                    return Ok(());
                }
                self.rebuild_thins()
            }
            Stack::Raid | Stack::Raid5 => {
                let sectors = (8 << 20) / SECTOR;
                self.reg
                    .create("raid", Some(&self.raid_table()), false, None)
                    .map_err(e)?;
                self.single_device("raid", sectors, again);
                Ok(())
            }
            Stack::Integrity | Stack::IntegrityBitmap => {
                self.reg
                    .create("integrity", Some(&self.integrity_table()), false, None)
                    .map_err(e)?;
                self.single_device("integrity", INTEGRITY_SECTORS, again);
                Ok(())
            }
            Stack::Cdp => {
                self.reg
                    .create("cdp", Some(&self.cdp_table()), false, None)
                    .map_err(e)?;
                self.single_device("cdp", Self::CDP_SECTORS, again);
                Ok(())
            }
            Stack::Writecache => {
                let sectors = (8 << 20) / SECTOR;
                let table = format!(
                    "0 {sectors} writecache s {} {} 4096 6 high_watermark 50 low_watermark 20 pause_writeback 0",
                    self.path(0),
                    self.path(1)
                );
                self.reg.create("wc", Some(&table), false, None).map_err(e)?;
                self.single_device("wc", sectors, again);
                Ok(())
            }
            Stack::Cache => {
                let table = self.cache_table("smq");
                self.reg.create("cache", Some(&table), false, None).map_err(e)?;
                self.single_device("cache", CACHE_SPAN, again);
                self.cleaning = None;
                self.promotions_at_load = self.status_field("cache", 9).unwrap_or(0);
                Ok(())
            }
            Stack::Era => {
                let sectors = (8 << 20) / SECTOR;
                let table = format!("0 {sectors} era {} {} {ERA_BLOCK}", self.path(0), self.path(1));
                self.reg.create("era", Some(&table), false, None).map_err(e)?;
                self.single_device("era", sectors, again);
                self.era_now = self.current_era().unwrap_or(0);
                Ok(())
            }
            Stack::Snapshot => {
                let sectors = (8 << 20) / SECTOR;
                let table = format!("0 {sectors} snapshot-origin {}", self.path(0));
                self.reg.create("origin", Some(&table), false, None).map_err(e)?;
                self.single_device("origin", sectors, again);
                // A snapshot whose creation did not finish before the crash (or
                // failed) is not checked: loading its COW device now may make a
                // new snapshot of the origin as it is after the crash.
                if again && self.models.get(&1).is_some_and(|m| m.certain) {
                    self.create_snapshot_dev()
                        .map_err(|err| format!("snapshot after the crash: {err}"))?;
                }
                Ok(())
            }
        }
    }

    /// The thins after the crash, on the pool just made: each one a model has
    /// (one whose creation was not certain may be gone), and none deleted for
    /// certain.
    fn rebuild_thins(&mut self) -> Result<(), String> {
        let keys: Vec<(u64, bool)> = {
            let mut k: Vec<_> = self.models.iter().map(|(k, m)| (*k, m.certain)).collect();
            k.sort_unstable();
            k
        };
        self.devs.clear();
        for (key, certain) in keys {
            let name = format!("thin{key}");
            let table = format!("0 {} thin /dev/mapper/pool {key}", Self::THIN_SECTORS);
            match self.reg.create(&name, Some(&table), false, None) {
                Ok(()) => self.devs.push(Dev {
                    name,
                    key,
                    span: Self::THIN_SPAN,
                }),
                Err(_) if !certain => {
                    self.models.remove(&key);
                }
                Err(err) => return Err(format!("thin {key} after the crash: {err}")),
            }
        }
        // a thin deleted for certain stays deleted
        for &id in &self.deleted {
            let table = format!("0 {} thin /dev/mapper/pool {id}", Self::THIN_SECTORS);
            if self.reg.create("gone", Some(&table), false, None).is_ok() {
                return Err(format!("thin {id} was deleted before the crash and is back"));
            }
        }
        Ok(())
    }

    /// The stack's one top device, model key 0 (a new model unless `again`).
    fn single_device(&mut self, name: &str, sectors: u64, again: bool) {
        if !again {
            let m = DevModel {
                certain: true,
                ..Default::default()
            };
            self.models.insert(0, m);
        }
        self.devs = vec![Dev {
            name: name.into(),
            key: 0,
            span: sectors,
        }];
    }

    /// raid, after the crash: once the copying the bitmap asked for is done,
    /// every leg is in sync and the legs agree: raid1's two hold the same
    /// bytes, raid5's three XOR to zero (a region a crash may have left
    /// different, or with a stale parity, had its bit set on disk).
    fn raid_legs_consistent(&mut self) -> Result<(), String> {
        let t0 = crate::sync::now();
        loop {
            let st = self
                .reg
                .table_lines(Some("raid"), true, false, false)
                .map_err(|e| e.to_string())?;
            if st.contains(" idle ") {
                let all = if self.o.stack == Stack::Raid5 {
                    " AAA "
                } else {
                    " AA "
                };
                if !st.contains(all) {
                    return Err(format!("raid after the crash and its copying: {st}"));
                }
                break;
            }
            if crate::sync::since(t0) > std::time::Duration::from_secs(60) {
                return Err(format!("raid not idle 60 s after the crash: {st}"));
            }
            crate::sync::sleep(std::time::Duration::from_millis(5));
        }
        let legs = if self.o.stack == Stack::Raid5 { 3 } else { 2 };
        let mut x = std::fs::read(&self.files[1]).map_err(|e| format!("leg 0: {e}"))?;
        for l in 1..legs {
            let b = std::fs::read(&self.files[2 * l + 1]).map_err(|e| format!("leg {l}: {e}"))?;
            for (a, b) in x.iter_mut().zip(&b) {
                *a ^= b;
            }
        }
        // raid1: leg 0 ^ leg 1; raid5: every leg's, P included
        if let Some(i) = x.iter().position(|&b| b != 0) {
            return Err(format!(
                "raid: after the crash and its copying, the legs disagree at leg sector {}",
                i / SECTOR as usize
            ));
        }
        Ok(())
    }

    /// The integrity stack's table (tags crc32c, 512-byte blocks).
    /// 1 MiB of device (256 blocks) over 320 data blocks (the fewest the
    /// target takes: retention drops points for room within a trial), at most
    /// 64 points, on a journal of 128 KiB (about the least they need: a
    /// trial of 600 operations swaps its areas, a checkpoint written).
    const CDP_SECTORS: u64 = (1 << 20) / SECTOR;

    fn cdp_table(&self) -> String {
        format!(
            "0 {} cdp {} {} 2 max_points 64",
            Self::CDP_SECTORS,
            self.path(0),
            self.path(1)
        )
    }

    fn integrity_table(&self) -> String {
        let mode = if self.o.stack == Stack::Integrity {
            "J 5 journal_sectors:352 journal_watermark:30"
        } else {
            "B 5 sectors_per_bit:256 bitmap_flush_interval:20"
        };
        format!(
            "0 {INTEGRITY_SECTORS} integrity {} 0 4 {mode} internal_hash:crc32c fix_padding fix_hmac",
            self.path(0)
        )
    }

    /// Format the integrity stack's file and write zeroes over all of it
    /// (every block then has its tag), outside the simulation.
    fn wipe_integrity(&mut self) -> Result<(), String> {
        let e = |x: crate::mapper::registry::ControlError| x.to_string();
        let table = self.integrity_table();
        self.reg.create("wipe", Some(&table), false, None).map_err(e)?;
        let dest = Dest::Dm(self.reg.get("wipe").map_err(e)?);
        let zero = vec![0u8; 1 << 20];
        let mut s = 0;
        while s < INTEGRITY_SECTORS {
            let n = (INTEGRITY_SECTORS - s).min(zero.len() as u64 / SECTOR);
            devio::write(&dest, s, &zero[..(n * SECTOR) as usize], false)
                .map_err(|x| format!("wipe: {x}"))?;
            s += n;
        }
        devio::flush(&dest).map_err(|x| format!("wipe: {x}"))?;
        drop(dest);
        devio::release_thread_engine();
        self.reg.remove("wipe", false, false).map_err(e)
    }

    /// The raid stack's table: two legs, regions of 64 KiB (128 of them), a
    /// daemon period of 5 jiffies (20 ms) so idle bits are cleared under the
    /// workload;
    /// `nosync`: the legs start equal (both zero).
    fn raid_table(&self) -> String {
        if self.o.stack == Stack::Raid5 {
            // chunks of 8 KiB: a region of 64 KiB per leg holds 8 rows
            return format!(
                "0 {} raid raid5_ls 6 16 region_size 128 daemon_sleep 5 nosync 3 {} {} {} {} {} {}",
                (8 << 20) / SECTOR,
                self.path(0),
                self.path(1),
                self.path(2),
                self.path(3),
                self.path(4),
                self.path(5)
            );
        }
        format!(
            "0 {} raid raid1 6 0 region_size 128 daemon_sleep 5 nosync 2 {} {} {} {}",
            (8 << 20) / SECTOR,
            self.path(0),
            self.path(1),
            self.path(2),
            self.path(3)
        )
    }

    /// The cache stack's table with `policy`: writeback, over the whole origin.
    fn cache_table(&self, policy: &str) -> String {
        format!(
            "0 {} cache {} {} {} {CACHE_BLOCK} 1 writeback {policy} 0",
            (8 << 20) / SECTOR,
            self.path(0),
            self.path(1),
            self.path(2)
        )
    }

    /// Field `i` of a device's status after its target name (None when the
    /// status does not have it: a failed target).
    fn status_field(&self, name: &str, i: usize) -> Option<u64> {
        let st = self.reg.table_lines(Some(name), true, false, false).ok()?;
        st.split_whitespace().nth(3 + i)?.parse().ok()
    }

    /// cache: count the promotions of the live table since it was loaded.
    fn count_promotions(&mut self) {
        let now = self.status_field("cache", 9).unwrap_or(0);
        self.out.promotions += now.saturating_sub(self.promotions_at_load);
        self.promotions_at_load = now;
    }

    /// era: the current era, as its status says.
    fn current_era(&self) -> Option<u32> {
        self.status_field("era", 2).and_then(|e| u32::try_from(e).ok())
    }

    /// Load `table` into device `name` and make it live, as lvconvert does
    /// (suspend, resume). Err: the device may be left suspended.
    fn reload(&mut self, name: &str, table: &str) -> Result<(), String> {
        self.reg.load(name, table).map_err(|e| format!("load: {e}"))?;
        self.reg
            .suspend(name, false)
            .map_err(|e| format!("suspend: {e}"))?;
        self.reg.resume(name).map_err(|e| format!("resume: {e}"))
    }

    /// era: a write issued in era `era` landed in sectors `sector..+n`, so the
    /// blocks they cover must be marked in that era or a later one.
    fn era_requires(must: &mut BTreeMap<u64, u32>, sector: u64, n: u64, era: u32) {
        for b in sector / ERA_BLOCK..(sector + n).div_ceil(ERA_BLOCK) {
            let e = must.entry(b).or_insert(era);
            *e = (*e).max(era);
        }
    }

    /// era, after the crash and the recovery: every block a write landed in is
    /// marked in the era metadata as written in the write's era or later.
    fn check_era_marks(&mut self) -> Result<(), String> {
        let meta = self.files[0].clone();
        let mut eras: Vec<u32> = self.era_must.values().copied().collect();
        eras.sort_unstable();
        eras.dedup();
        for since in eras {
            let dev =
                crate::pdata::FileDev::open(&meta, false).map_err(|e| format!("{}: {e}", meta.display()))?;
            let (nr, marked) = crate::era::tools::marked_since(Box::new(dev), since, false)
                .map_err(|e| format!("era metadata after the crash: {e}"))?;
            for (&b, _) in self.era_must.iter().filter(|&(_, &e)| e == since) {
                let is = b < nr
                    && marked
                        .get((b / 64) as usize)
                        .is_some_and(|w| w & (1 << (b % 64)) != 0);
                if !is {
                    return Err(format!(
                        "era: block {b} was written in era {since} and is not marked as written since then after the crash"
                    ));
                }
                self.out.era_blocks_checked += 1;
            }
        }
        Ok(())
    }

    const THIN_SECTORS: u64 = (8 << 20) / SECTOR;
    /// Thins are written in their first 4 MiB, so blocks get overwritten.
    const THIN_SPAN: u64 = (4 << 20) / SECTOR;

    fn create_snapshot_dev(&mut self) -> Result<(), String> {
        let sectors = (8 << 20) / SECTOR;
        let table = format!("0 {sectors} snapshot {} {} P 8", self.path(0), self.path(1));
        self.reg.suspend("origin", false).map_err(|e| e.to_string())?;
        let r = self.reg.create("snap", Some(&table), false, None);
        self.reg.resume("origin").map_err(|e| e.to_string())?;
        r.map_err(|e| e.to_string())?;
        self.devs.push(Dev {
            name: "snap".into(),
            key: 1,
            span: sectors,
        });
        Ok(())
    }

    /// create_thin (origin None) or create_snap of `origin`, and its device.
    fn create_thin(&mut self, origin: Option<u64>) -> Result<(), String> {
        let id = self.next_thin;
        self.next_thin += 1;
        let msg = match origin {
            None => format!("create_thin {id}"),
            Some(o) => format!("create_snap {id} {o}"),
        };
        let mut model = match origin {
            None => DevModel::default(),
            Some(o) => self.models.get(&o).cloned().unwrap_or_default(),
        };
        model.certain = false;
        model.acked.clear();
        self.models.insert(id, model);
        if let Some(o) = origin {
            self.owner_of.insert(id, self.owner(o));
            self.reg
                .suspend(&format!("thin{o}"), false)
                .map_err(|e| e.to_string())?;
        } else {
            self.owner_of.insert(id, id);
        }
        let r = self.reg.message("pool", 0, &words(&msg));
        trace(|| format!("message {msg}: {r:?}"));
        if let Some(o) = origin {
            self.reg.resume(&format!("thin{o}")).map_err(|e| e.to_string())?;
        }
        match r {
            Ok(_) => {
                if !self.disk.frozen() {
                    if let Some(m) = self.models.get_mut(&id) {
                        m.certain = true;
                    }
                }
            }
            Err(_) => {
                // refused (an injected error): it may still exist after a crash
                return Ok(());
            }
        }
        let name = format!("thin{id}");
        let table = format!("0 {} thin /dev/mapper/pool {id}", Self::THIN_SECTORS);
        self.reg
            .create(&name, Some(&table), false, None)
            .map_err(|e| format!("{name}: {e}"))?;
        self.devs.push(Dev {
            name,
            key: id,
            span: Self::THIN_SPAN,
        });
        Ok(())
    }

    /// Back up on what survived the crash, with no more faults: the files on a
    /// new disk with nothing planned, so the stack's I/O after the crash runs as
    /// before it, in the seed's order (none of it through io_uring); the restart
    /// logs as the kill left them; then every sector checked, and the stack
    /// taken down.
    fn reopen_and_verify(&mut self, dir: &Path, logs_at_kill: &[(PathBuf, Vec<u8>)]) -> Result<(), String> {
        let o = self.o.clone();
        self.disk = SimDisk::new(o.break_commit_order);
        for p in &self.files {
            self.disk
                .register(p)
                .map_err(|e| format!("{}: {e}", p.display()))?;
        }
        self.disk
            .seed_completions(o.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xaf7e_0000_0000_0001);
        self.reg = registry(&o, dir, &self.disk);
        self.schedule(o.seed ^ 0x5c4e_d000_0000_0002);
        for (p, b) in logs_at_kill {
            if std::fs::read(p).ok().as_ref() != Some(b) {
                trace(|| format!("restart log {} changed after the kill", p.display()));
                let _ = std::fs::write(p, b);
            }
        }
        self.build(true)?;
        trace_status(|| {
            format!(
                "after the crash: {:?}",
                self.reg.table_lines(None, true, false, false)
            )
        });
        self.verify_all()?;
        if matches!(o.stack, Stack::Raid | Stack::Raid5) {
            self.raid_legs_consistent()?;
        }
        self.teardown();
        self.unschedule()?;
        self.out.fingerprints.1 = self.disk.fingerprint();
        Ok(())
    }

    /// From here on the trial's threads run under a scheduler seeded with `seed`.
    fn schedule(&mut self, seed: u64) {
        self.sched = Some(Sched::new(seed).enrol("sim-trial"));
    }

    /// The trial's threads run as ordinary threads again; Err if they blocked
    /// one another.
    fn unschedule(&mut self) -> Result<(), String> {
        match self.sched.take().and_then(Enrolment::end) {
            Some(why) => Err(format!("the trial's threads blocked: {why}")),
            None => Ok(()),
        }
    }

    fn teardown(&mut self) {
        // thins before their pool, the snapshot before its origin
        let _ = self.complete_all();
        if let Some(mut e) = self.engine.take() {
            e.shut_down();
        }
        self.open.clear();
        let names: Vec<String> = self.reg.list().iter().map(|d| d.name()).collect();
        devio::release_thread_engine();
        for pass in 0..3 {
            for n in &names {
                let last = pass == 2;
                let _ = self.reg.remove(n, last, false);
            }
        }
        // the removals' I/O may have made this thread an engine again: none
        // that served the old stack serves the next one
        devio::release_thread_engine();
    }

    fn dev_dest(&self, i: usize) -> Result<Dest, String> {
        self.reg
            .get(&self.devs[i].name)
            .map(Dest::Dm)
            .map_err(|e| e.to_string())
    }

    /// After an injected I/O error, every write acknowledged and not yet durable
    /// is undefined on every device of the stack: a target that fails a
    /// metadata operation drops its uncommitted changes (dm-thin aborts the
    /// pool's transaction), and its next flush may pass.
    fn note_failures(&mut self) {
        let f = self.disk.failed();
        if f > self.failures_seen {
            self.failures_seen = f;
            for m in self.models.values_mut() {
                m.acked.clear();
            }
            // and so is every write under way now: the failure may have come
            // after it was done but before its completion was taken (a thin
            // write mapped, then the transaction dropped by the failed commit)
            for &(_, _, r) in &self.in_flight {
                if let Req::Write { id, .. } = r {
                    self.undefined.push(id);
                }
            }
        }
    }

    fn step(&mut self) -> Result<(), String> {
        // the targets' threads that have work may go first (the trial holds
        // no lock here)
        crate::sync::sched::yield_now();
        self.note_failures();
        let roll = self.rng.below(100);
        if self.devs.is_empty() {
            return Ok(());
        }
        let di = self.rng.below(self.devs.len() as u64) as usize;
        match roll {
            0..=49 => self.write(di),
            50..=64 => self.read(di),
            65..=79 => self.flush(di),
            80..=86 => self.discard(di),
            _ => self.message(di),
        }
    }

    fn pick_range(&mut self, di: usize) -> (u64, u64) {
        let span_blocks = self.devs[di].span / SPB;
        let n = 1 + self.rng.below(16).min(self.rng.below(16));
        let b = self.rng.below(span_blocks - n);
        (b * SPB, n * SPB)
    }

    fn write(&mut self, di: usize) -> Result<(), String> {
        let (sector, n) = self.pick_range(di);
        let fua = self.rng.chance(15);
        let id = self.next_id;
        self.next_id += 1;
        if self.o.stack == Stack::Era {
            self.era_of.insert(id, self.era_now);
        }
        let key = self.devs[di].key;
        let owner = self.owner(key);
        let mut buf = vec![0u8; (n * SECTOR) as usize];
        for (i, s) in buf.chunks_mut(SECTOR as usize).enumerate() {
            fill_sector(s, id, owner, sector + i as u64);
        }
        let req = Req::Write {
            key,
            id,
            sector,
            n,
            fua,
        };
        self.submit(di, req, &buf)
    }

    fn read(&mut self, di: usize) -> Result<(), String> {
        let (sector, n) = self.pick_range(di);
        let key = self.devs[di].key;
        self.submit(di, Req::Read { key, sector, n }, &[])
    }

    fn flush(&mut self, di: usize) -> Result<(), String> {
        let key = self.devs[di].key;
        self.submit(di, Req::Flush { key, upto: 0 }, &[])
    }

    fn discard(&mut self, di: usize) -> Result<(), String> {
        if self.o.stack == Stack::Snapshot {
            return self.write(di);
        }
        let (sector, n) = self.pick_range(di);
        let key = self.devs[di].key;
        self.submit(di, Req::Discard { key, sector, n }, &[])
    }

    /// Start `req` on device `di` once no request under way overlaps it and
    /// fewer than `depth` are; its completion is handled by [`Trial::complete`].
    fn submit(&mut self, di: usize, mut req: Req, data: &[u8]) -> Result<(), String> {
        let name = self.devs[di].name.clone();
        let ei = match self.open.iter().position(|(n, _)| *n == name) {
            Some(i) => i,
            None => {
                let Dest::Dm(dev) = self.dev_dest(di)? else {
                    return Err(format!("{name}: not a device"));
                };
                self.open.push((name.clone(), dev));
                self.open.len() - 1
            }
        };
        if self.engine.is_none() {
            self.engine = Some(Engine::new(self.depth).map_err(|e| format!("engine: {e}"))?);
        }
        // the block layer does not order overlapping requests: a well-behaved
        // client does not issue them together
        while let Some((s, n)) = req.range() {
            let overlaps = self
                .in_flight
                .iter()
                .any(|&(e, _, r)| e == ei && r.range().is_some_and(|(s2, n2)| s < s2 + n2 && s2 < s + n));
            if !overlaps {
                break;
            }
            self.complete_one()?;
        }
        while self.in_flight.len() >= self.depth {
            self.complete_one()?;
        }
        match &mut req {
            Req::Write {
                key, sector, n, id, ..
            } => self.model(*key).issue(*sector, *n, *id),
            // what a discarded sector reads is zeroes or what it held
            Req::Discard { key, sector, n } => self.model(*key).issue(*sector, *n, 0),
            Req::Flush { upto, .. } => *upto = self.acks,
            Req::Read { .. } => {}
        }
        let Some(e) = self.engine.as_mut() else {
            return Err("no engine".into());
        };
        let Some(r) = e.alloc() else {
            return Err(format!(
                "{name}: no free request slot with {} under way",
                self.in_flight.len()
            ));
        };
        let q = e.request_mut(r);
        let (op, sector, nr, fua) = match req {
            Req::Write { sector, n, fua, .. } => (Op::Write, sector, n, fua),
            Req::Read { sector, n, .. } => (Op::Read, sector, n, false),
            Req::Flush { .. } => (Op::Flush, 0, 0, false),
            Req::Discard { sector, n, .. } => (Op::Discard, sector, n, false),
        };
        q.op = op;
        q.sector = sector;
        q.nr_sectors = nr;
        q.fua = fua;
        q.punch = false;
        q.fast_zero = false;
        let len = if matches!(op, Op::Read | Op::Write) {
            (nr * SECTOR) as usize
        } else {
            0
        };
        q.buf.ensure(len.max(1));
        if op == Op::Write {
            q.buf.as_mut_slice()[..len].copy_from_slice(data);
        }
        e.start(r, &self.open[ei].1);
        trace(|| format!("start {req:?} on {name} ({} under way)", self.in_flight.len() + 1));
        self.in_flight.push((ei, r, req));
        // completions are taken at seed-chosen moments, so requests pile up
        if self.pace.chance(30) {
            self.complete_one()?;
        }
        Ok(())
    }

    /// Wait until at least one request under way completes, and handle every one
    /// that has.
    fn complete_one(&mut self) -> Result<(), String> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        let Some(e) = self.engine.as_mut() else {
            return Err("requests under way without an engine".into());
        };
        let mut done = Vec::new();
        while done.is_empty() {
            // waits while a piece is out with a target (a thin flush waits for a commit)
            e.turn(Some(std::time::Duration::from_millis(1)))
                .map_err(|x| format!("engine: {x}"))?;
            while let Some(r) = e.pop_done() {
                done.push(r);
            }
        }
        for r in done {
            self.complete(r)?;
        }
        Ok(())
    }

    fn complete_all(&mut self) -> Result<(), String> {
        while !self.in_flight.is_empty() {
            self.complete_one()?;
        }
        Ok(())
    }

    /// Request `r` completed: the model learns what it may.
    fn complete(&mut self, r: usize) -> Result<(), String> {
        let Some(pos) = self.in_flight.iter().position(|&(_, s, _)| s == r) else {
            return Err(format!("a completion of slot {r} that was not started"));
        };
        let (ei, _, req) = self.in_flight.swap_remove(pos);
        let name = self.open[ei].0.clone();
        let Some(e) = self.engine.as_mut() else {
            return Err("a completion without an engine".into());
        };
        let res = e.request(r).error;
        let data = match req {
            Req::Read { n, .. } => e.request(r).buf.as_slice()[..(n * SECTOR) as usize].to_vec(),
            _ => Vec::new(),
        };
        e.free(r);
        trace(|| format!("done {req:?} on {name}: {res}"));
        match req {
            Req::Write {
                key,
                id,
                sector,
                n,
                fua,
            } => {
                if res == 0 && !self.disk.frozen() && !self.undefined.contains(&id) {
                    self.acks += 1;
                    let seq = self.acks;
                    self.model(key).ack(sector, n, id, fua, seq);
                    self.out.acked_writes += 1;
                    if let Some(&era) = self.era_of.get(&id) {
                        Self::era_requires(&mut self.era_must, sector, n, era);
                    }
                }
            }
            Req::Read { key, sector, .. } => {
                if res != 0 || self.disk.failed() > 0 || self.disk.frozen() {
                    // after an injected error or the crash, a read proves nothing
                    return Ok(());
                }
                let owner = self.owner(key);
                let m = self.model(key);
                for (i, s) in data.chunks(SECTOR as usize).enumerate() {
                    let sec = sector + i as u64;
                    let got =
                        identify(s, owner, sec).map_err(|e| format!("{name}: before the crash: {e}"))?;
                    let sm = m.sectors.get(&sec).cloned().unwrap_or_default();
                    if !sm.current_allows(got) {
                        return Err(format!(
                            "{name}: before the crash, sector {sec} reads write {got}; written since the last durable {}: {:?}",
                            sm.durable, sm.newer
                        ));
                    }
                }
            }
            Req::Flush { key, upto } => {
                self.note_failures();
                if res == 0 && !self.disk.frozen() {
                    self.model(key).flushed(upto);
                    self.out.flushes += 1;
                } else if res != 0 {
                    // A failed flush leaves the writes before it undefined, even if a
                    // later flush succeeds (as fsync after an error on Linux; dm-thin
                    // aborts the transaction, and the later flushes of a thin that
                    // had nothing uncommitted then pass).
                    self.model(key).acked.clear();
                }
            }
            Req::Discard { .. } => {}
        }
        Ok(())
    }

    fn message(&mut self, di: usize) -> Result<(), String> {
        // control operations wait for the requests under way, as dmsetup's
        // suspend does
        self.complete_all()?;
        match self.o.stack {
            Stack::Thin => self.thin_message(di),
            Stack::Raid | Stack::Raid5 | Stack::Integrity | Stack::IntegrityBitmap | Stack::Cdp => {
                self.reload_message(di)
            }
            Stack::Writecache => self.writecache_message(),
            Stack::Cache => self.cache_message(di),
            Stack::Era => self.era_message(),
            Stack::Snapshot => self.snapshot_message(di),
        }
    }

    /// thin: a thin created, a snapshot of one, or one deleted (a write when none of them can be).
    fn thin_message(&mut self, di: usize) -> Result<(), String> {
        let live = self.devs.len();
        let r = self.rng.below(3);
        if r == 0 && live < 4 {
            self.create_thin(None)
        } else if r == 1 && live < 4 {
            let o = self.devs[di].key;
            self.create_thin(Some(o))
        } else if live > 1 {
            let d = self.devs.remove(di);
            if let Some(i) = self.open.iter().position(|(n, _)| *n == d.name) {
                // indices of the requests under way: none are
                self.open.remove(i);
            }
            if let Some(e) = self.engine.as_mut() {
                e.forget_devices();
            }
            devio::release_thread_engine();
            if let Some(m) = self.models.get_mut(&d.key) {
                m.certain = false;
            }
            self.reg
                .remove(&d.name, false, false)
                .map_err(|e| format!("{}: {e}", d.name))?;
            let r = self.reg.message("pool", 0, &words(&format!("delete {}", d.key)));
            trace(|| format!("delete {}: {r:?}", d.key));
            if r.is_ok() && !self.disk.frozen() {
                self.models.remove(&d.key);
                self.deleted.push(d.key);
            }
            Ok(())
        } else {
            self.write(di)
        }
    }

    /// raid and integrity: a reload of the table, or a write.
    fn reload_message(&mut self, di: usize) -> Result<(), String> {
        // a reload, as `lvchange --refresh` does: the old table's
        // metadata (raid's superblocks and bitmap, integrity's
        // journal or bitmap) closed at the suspend, the new one
        // takes it up
        if self.rng.chance(50) {
            return self.write(di);
        }
        let (name, table) = if matches!(self.o.stack, Stack::Raid | Stack::Raid5) {
            ("raid", self.raid_table())
        } else if self.o.stack == Stack::Cdp {
            ("cdp", self.cdp_table())
        } else {
            ("integrity", self.integrity_table())
        };
        let r = self.reload(name, &table);
        trace(|| format!("reload: {r:?}"));
        if r.is_err() {
            self.devs.clear();
        }
        Ok(())
    }

    /// writecache: `flush`.
    fn writecache_message(&mut self) -> Result<(), String> {
        // write everything back to the origin: the data must not change
        let r = self.reg.message("wc", 0, &words("flush"));
        trace(|| format!("message flush: {r:?}"));
        Ok(())
    }

    /// cache: a new `migration_threshold`, a switch of policy, or a write.
    fn cache_message(&mut self, di: usize) -> Result<(), String> {
        // to `cleaner` (every dirty block written back while the
        // workload goes on) and back to `smq`, as lvconvert switches
        if self.rng.chance(60) {
            return self.write(di);
        }
        if self.rng.chance(25) {
            let v = 64 * self.rng.below(64);
            let r = self
                .reg
                .message("cache", 0, &words(&format!("migration_threshold {v}")));
            trace(|| format!("message migration_threshold {v}: {r:?}"));
            return Ok(());
        }
        let policy = if self.cleaning.is_some() { "smq" } else { "cleaner" };
        let dirty = self.status_field("cache", 10);
        self.count_promotions();
        let table = self.cache_table(policy);
        let r = self.reload("cache", &table);
        trace(|| format!("switch to {policy} with {dirty:?} dirty: {r:?}"));
        match r {
            Ok(()) => {
                if let (Some(before), Some(now)) = (self.cleaning, dirty) {
                    self.out.writebacks += before.saturating_sub(now);
                }
                self.cleaning = (policy == "cleaner").then(|| dirty.unwrap_or(0));
                self.promotions_at_load = self.status_field("cache", 9).unwrap_or(0);
            }
            Err(_) => {
                // (an injected error) the device may be suspended:
                // the workload leaves it until the crash
                self.devs.clear();
            }
        }
        Ok(())
    }

    /// era: a checkpoint, or a metadata snapshot taken or dropped.
    fn era_message(&mut self) -> Result<(), String> {
        let m = match self.rng.below(5) {
            0 => "take_metadata_snap",
            1 => "drop_metadata_snap",
            _ => "checkpoint",
        };
        let r = self.reg.message("era", 0, &words(m));
        trace(|| format!("message {m}: {r:?}"));
        if let Some(e) = self.current_era() {
            self.era_now = self.era_now.max(e);
        }
        Ok(())
    }

    /// snapshot: the snapshot taken (once a trial), or a write.
    fn snapshot_message(&mut self, di: usize) -> Result<(), String> {
        // one snapshot per trial: model key 1 once it is taken
        if self.models.contains_key(&1) {
            return self.write(di);
        }
        // a snapshot of the origin as it is now, made as lvcreate makes it
        self.flush(0)?;
        self.complete_all()?;
        let mut model = self.models.get(&0).cloned().unwrap_or_default();
        model.certain = false;
        model.acked.clear();
        self.models.insert(1, model);
        self.owner_of.insert(1, 0);
        let r = self.create_snapshot_dev();
        trace(|| format!("snapshot created: {r:?}"));
        match r {
            Ok(()) => {
                if !self.disk.frozen() {
                    if let Some(m) = self.models.get_mut(&1) {
                        m.certain = true;
                    }
                }
                Ok(())
            }
            Err(_) => Ok(()),
        }
    }

    fn model(&mut self, key: u64) -> &mut DevModel {
        self.models.entry(key).or_default()
    }

    /// The device whose id a sector of `key` carries when it was never written
    /// through `key` itself (a snapshot's sectors come from its origin).
    fn owner(&self, key: u64) -> u64 {
        self.owner_of.get(&key).copied().unwrap_or(key)
    }

    fn verify_all(&mut self) -> Result<(), String> {
        for i in 0..self.devs.len() {
            self.verify(i)?;
        }
        Ok(())
    }

    /// After the crash: every sector of the device's span is allowed by its model.
    fn verify(&mut self, di: usize) -> Result<(), String> {
        let dest = self.dev_dest(di)?;
        let (name, key, span) = (self.devs[di].name.clone(), self.devs[di].key, self.devs[di].span);
        let owner = self.owner(key);
        if self.o.stack == Stack::Snapshot && key == 1 {
            let st = self
                .reg
                .table_lines(Some(&name), true, false, false)
                .map_err(|e| e.to_string())?;
            if st.contains("Invalid") {
                // only an I/O error may invalidate it (the COW device cannot fill)
                if self.out.io_errors_injected == 0 {
                    return Err(format!("{name}: invalid after the crash with no I/O error: {st}"));
                }
                let mut b = vec![0u8; 4096];
                if devio::read(&dest, 0, &mut b).is_ok() {
                    return Err(format!("{name}: an invalid snapshot served a read"));
                }
                return Ok(());
            }
        }
        // raid5 without a journal, degraded by an injected error when the power
        // went: a row (2 chunks of 16 sectors) a write was still landing on may
        // have its parity torn, and the missing leg's blocks there are rebuilt
        // from it (md's write hole; the kernel's dm-raid starts such an array
        // as dmkit does, RELIABILITY.md "Mirrors and striped raid"): its
        // sectors are not checked, and counted
        let torn: std::collections::BTreeSet<u64> =
            if self.o.stack == Stack::Raid5 && self.out.io_errors_injected > 0 {
                self.models
                    .get(&key)
                    .map(|m| {
                        m.sectors
                            .iter()
                            .filter(|(_, sm)| sm.newer.iter().any(|&w| w != 0))
                            .map(|(&sec, _)| sec / 32)
                            .collect()
                    })
                    .unwrap_or_default()
            } else {
                Default::default()
            };
        let mut buf = vec![0u8; 256 << 10];
        let per = buf.len() as u64 / SECTOR;
        let empty = SectorModel::default();
        let mut s0 = 0;
        while s0 < span {
            let n = per.min(span - s0);
            let b = &mut buf[..(n * SECTOR) as usize];
            trace(|| format!("verify: read {name} sectors {s0}+{n}"));
            devio::read(&dest, s0, b)
                .map_err(|e| format!("{name}: read at sector {s0} after the crash: {e}"))?;
            let m = self.models.get(&key);
            for (i, s) in b.chunks(SECTOR as usize).enumerate() {
                let sec = s0 + i as u64;
                if torn.contains(&(sec / 32)) {
                    self.out.write_hole_sectors += 1;
                    continue;
                }
                let sm = m.and_then(|m| m.sectors.get(&sec)).unwrap_or(&empty);
                let got = identify(s, owner, sec).map_err(|e| format!("{name}: after the crash: {e}"))?;
                if let Some(&era) = self.era_of.get(&got) {
                    Self::era_requires(&mut self.era_must, sec, 1, era);
                }
                // after an injected I/O error, what was acknowledged and not
                // yet durable is undefined (see `note_failures`): a kill then
                // keeps what a crash would
                let ok = if self.o.kill && self.out.io_errors_injected == 0 {
                    sm.kill_allows(got)
                } else {
                    sm.allows(got)
                };
                if !ok {
                    let mut one = vec![0u8; 4096];
                    let again = devio::read(&dest, sec & !7, &mut one)
                        .map(|_| identify(&one[((sec & 7) * 512) as usize..][..512], owner, sec));
                    trace(|| format!("re-read of sector {sec} alone: {again:?}"));
                    return Err(format!(
                        "{name}: after the crash, sector {sec} holds write {got}; it may hold only {} (durable) or {:?} (durable before: {:?})",
                        sm.durable, sm.newer, sm.past
                    ));
                }
                self.out.sectors_checked += 1;
            }
            s0 += n;
        }
        Ok(())
    }
}

/// What a run of trials found.
#[derive(Debug, Default)]
pub struct Summary {
    pub trials: u64,
    /// Failed trials: the replay command and what failed.
    pub failures: Vec<(String, String)>,
    pub acked_writes: u64,
    pub flushes: u64,
    pub sectors_checked: u64,
    /// Trials whose crash came at a chosen write, in the middle of the workload.
    pub crashed_mid_op: u64,
    /// Trials in which an injected I/O error was hit.
    pub with_io_errors: u64,
    /// Trials whose crash was placed at a flush inside a commit, after a chosen
    /// write, and after the last operation.
    pub at_commit_flush: u64,
    pub at_write: u64,
    pub at_end: u64,
    /// Metadata images on which the reference thin_check agreed with dmkit's.
    pub ref_checked: u64,
    /// cache: blocks promoted and written back (by the cleaner), all trials.
    pub promotions: u64,
    pub writebacks: u64,
    /// era: block marks checked after crashes.
    pub era_blocks_checked: u64,
    /// raid5: sectors left unchecked in rows the write hole may have torn.
    pub write_hole_sectors: u64,
}

/// Run `trials` trials with seeds `base.seed`, `base.seed + 1`, ...; stop at the
/// first failure if `stop_at_first`.
pub fn run_trials(base: &Options, trials: u64, stop_at_first: bool) -> Summary {
    let mut sum = Summary::default();
    let _watchdog = Watchdog::start();
    for i in 0..trials {
        let o = Options {
            seed: base.seed.wrapping_add(i),
            ..base.clone()
        };
        sum.trials += 1;
        match run_trial(&o).and_then(|out| replays(&o, out)) {
            Ok(out) => {
                sum.acked_writes += out.acked_writes;
                sum.flushes += out.flushes;
                sum.sectors_checked += out.sectors_checked;
                sum.crashed_mid_op += u64::from(out.crashed_mid_op);
                sum.with_io_errors += u64::from(out.io_errors_injected > 0);
                sum.ref_checked += out.ref_checked;
                sum.promotions += out.promotions;
                sum.writebacks += out.writebacks;
                sum.era_blocks_checked += out.era_blocks_checked;
                sum.write_hole_sectors += out.write_hole_sectors;
                match out.crash {
                    Some(CrashKind::CommitFlush) => sum.at_commit_flush += 1,
                    Some(CrashKind::Write) => sum.at_write += 1,
                    Some(CrashKind::End) | None => sum.at_end += 1,
                }
            }
            Err(e) => {
                sum.failures.push((replay_command(&o), e));
                if stop_at_first {
                    break;
                }
            }
        }
    }
    sum
}

/// `out` if the trial need not be checked for its replay, or if a second run
/// of it did the same I/O in the same order.
fn replays(o: &Options, out: Outcome) -> Result<Outcome, String> {
    if !o.check_replay {
        return Ok(out);
    }
    let again = run_trial(o)?;
    if again.fingerprints != out.fingerprints {
        return Err(format!(
            "the trial did not replay from its seed: its I/O differed between two runs \
             (fingerprints {:016x}/{:016x} then {:016x}/{:016x}, before and after the crash)",
            out.fingerprints.0, out.fingerprints.1, again.fingerprints.0, again.fingerprints.1
        ));
    }
    Ok(out)
}

/// A memory filesystem when there is one (`/dev/shm`), else the temporary directory.
pub fn default_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}
