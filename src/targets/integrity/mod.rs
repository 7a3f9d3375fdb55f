//! `integrity`: dm-integrity, a tag stored beside every block and checked on
//! every read, in the kernel's on-disk format (docs/design/dm-integrity.md):
//! what dmkit formats opens in Linux 6.12 and `integritysetup`, and what they
//! format opens here.
//!
//! Table: `<dev> <offset> <tag_size|-> <J|B|D|R> <#opt> <opt>...` with the
//! kernel's options: `journal_sectors`, `interleave_sectors`,
//! `buffer_sectors`, `journal_watermark`, `commit_time`, `block_size`,
//! `sectors_per_bit`, `bitmap_flush_interval`, `internal_hash:alg[:key]`
//! (`crc32c`, `crc32`, `sha256`, `hmac(sha256)`), `recalculate`,
//! `reset_recalculate`, `allow_discards`, `fix_padding`, `fix_hmac`,
//! `legacy_recalculate`. Refused with one line each: `meta_device`,
//! `journal_crypt`, `journal_mac`, mode `I`, `allow_discards_keyed`.
//!
//! Without `internal_hash` (a numeric tag size then), the tags are a device
//! above's (dm-crypt's AEAD tags, the kernel's DM-DIF-EXT-TAG profile): a
//! bio's [`Bio::tags`] are stored with its blocks and given back with them
//! on reads, unchecked here; a write that comes without tags leaves the
//! stored ones as they are (journal mode: zeroes, as the kernel's), and a
//! dirty bitmap after a crash has nothing to recompute them from.
//!
//! A blank device (its first 4 KiB zero) is formatted when the table is
//! loaded, as the kernel does: superblock and an empty journal, the tags left
//! as they are (unwritten blocks fail their check until written, or
//! `recalculate` computes their tags).
//!
//! Every read, write, flush and discard runs on the target's thread, in the
//! order they were mapped, so a read sees every write mapped before it:
//! - reads come with their tags and fail with EILSEQ (counted in the status)
//!   where a tag does not match, as the kernel's;
//! - mode J: a write goes into the journal in memory and completes; a flush,
//!   a FUA write, `commit_time` or the journal's watermark commits: the
//!   journal sections are written and flushed, then the blocks and their
//!   tags go to their places and are flushed. A crash leaves committed
//!   sections the next load (dmkit's or the kernel's) replays;
//! - mode D: data and tags are written in place, no crash atomicity;
//! - mode B: before a region is first written, its bit is set on disk (the
//!   bitmap lives in the journal's area, as the kernel's); the bits are
//!   cleared `bitmap_flush_interval` after the last change, once flushed; a
//!   load that finds them set after a crash recomputes those regions' tags;
//! - mode R: reads unchecked, writes fail.

pub mod format;

use crate::mapper::TargetError;
use crate::io::{errno, LeafKind, Op, SECTOR};
use crate::mapper::devio;
use crate::mapper::engine::Pending;
use crate::mapper::{arg_u64, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, TagProfile, Target, TargetType};
use crate::sync::Unpoison;
use format::*;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The `integrity` target type (the version Linux 6.12.117 reports).
pub const TYPE: TargetType = TargetType {
    name: "integrity",
    version: [1, 14, 0],
    new: |args, len, r| Ok(Box::new(Integrity::new(args, len, r)?)),
    sync: None,
};

const EILSEQ: i32 = libc::EILSEQ;
/// Sectors the background recalculation does at a time.
const RECALC_SECTORS: u64 = 2048;
/// Recalculated chunks between superblock writes.
const RECALC_SB_EVERY: u32 = 16;
/// Bytes of written blocks a journal-mode device holds before it commits
/// (the kernel's default journal is at most 64 MiB).
const MAX_OPEN_BYTES: u64 = 64 << 20;
/// Checksum failures logged before the log goes quiet.
const LOGGED_FAILURES: u64 = 100;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Journal,
    Bitmap,
    Direct,
    Recovery,
}

impl Mode {
    fn letter(self) -> char {
        match self {
            Mode::Journal => 'J',
            Mode::Bitmap => 'B',
            Mode::Direct => 'D',
            Mode::Recovery => 'R',
        }
    }
}

#[derive(Default)]
struct Opts {
    journal_sectors: Option<u64>,
    interleave_sectors: Option<u64>,
    buffer_sectors: Option<u64>,
    journal_watermark: Option<u64>,
    commit_time: Option<u64>,
    block_size: Option<u64>,
    sectors_per_bit: Option<u64>,
    bitmap_flush_interval: Option<u64>,
    /// As given (with its key).
    internal_hash: Option<String>,
    meta_device: Option<String>,
    recalculate: bool,
    reset_recalculate: bool,
    allow_discards: bool,
    fix_padding: bool,
    fix_hmac: bool,
    legacy_recalculate: bool,
}

fn parse_opts(words: &[String]) -> Result<Opts, TargetError> {
    let mut o = Opts::default();
    let num = |v: &str| -> Result<u64, TargetError> {
        v.parse::<u32>()
            .map(u64::from)
            .map_err(|_| TargetError::from("Invalid argument".to_string()))
    };
    for w in words {
        let (k, v) = w.split_once(':').unwrap_or((w.as_str(), ""));
        match k {
            "journal_sectors" => o.journal_sectors = Some(num(v)?),
            "interleave_sectors" => o.interleave_sectors = Some(num(v)?),
            "buffer_sectors" => o.buffer_sectors = Some(num(v)?),
            "journal_watermark" => {
                let n = num(v)?;
                if n > 100 {
                    return Err("Invalid argument".into());
                }
                o.journal_watermark = Some(n);
            }
            "commit_time" => o.commit_time = Some(num(v)?),
            "block_size" => {
                let n = num(v).map_err(|_| "Invalid block_size argument".to_string())?;
                if !(512..=4096).contains(&n) || !n.is_power_of_two() {
                    return Err("Invalid block_size argument".into());
                }
                o.block_size = Some(n);
            }
            "sectors_per_bit" => o.sectors_per_bit = Some(num(v)?),
            "bitmap_flush_interval" => {
                o.bitmap_flush_interval =
                    Some(num(v).map_err(|_| "Invalid bitmap_flush_interval argument".to_string())?)
            }
            "internal_hash" if !v.is_empty() => o.internal_hash = Some(v.to_string()),
            "internal_hash" => return Err("Invalid internal_hash argument".into()),
            "recalculate" if v.is_empty() => o.recalculate = true,
            "reset_recalculate" if v.is_empty() => {
                o.recalculate = true;
                o.reset_recalculate = true;
            }
            "allow_discards" if v.is_empty() => o.allow_discards = true,
            "fix_padding" if v.is_empty() => o.fix_padding = true,
            "fix_hmac" if v.is_empty() => o.fix_hmac = true,
            "legacy_recalculate" if v.is_empty() => o.legacy_recalculate = true,
            "meta_device" if !v.is_empty() => o.meta_device = Some(v.to_string()),
            "journal_crypt" | "journal_mac" | "allow_discards_keyed" => {
                return Err(format!("'{k}' is not supported by dmkit's integrity target").into())
            }
            _ => return Err(format!("Invalid argument '{}'", crate::table::bounded(w)).into()),
        }
    }
    Ok(o)
}

/// What the device holds and how to reach it: fixed once the table is made.
struct Layout {
    dev: DevRef,
    dest: crate::mapper::engine::Dest,
    /// Where the superblock, journal, tags and bitmap are: the metadata
    /// device if there is one, else `dest`.
    meta: Option<DevRef>,
    mdest: crate::mapper::engine::Dest,
    geo: Geometry,
    /// None: the tags are a device above's.
    hash: Option<Hash>,
    salt: Option<[u8; SALT_SIZE]>,
    mode: Mode,
    /// Bitmap mode: log2 of sectors per bit.
    log2_spbb: u8,
    watermark: u64,
    commit_time: Duration,
    flush_interval: Duration,
    allow_discards: bool,
}

impl Layout {
    /// Format a blank device with superblock `sb` at sector `offset`: the
    /// empty journal, then the superblock, each durable.
    fn format(&self, sb: &mut Superblock, offset: u64, tag_size: u64) -> Result<(), TargetError> {
        let w = |e: std::io::Error| format!("Could not initialize superblock: {e}");
        for i in 0..self.geo.journal_sections {
            let s = empty_section(&self.geo, i, 0);
            devio::write(&self.mdest, self.geo.journal_sector(i * self.geo.section_sectors), &s, false).map_err(w)?;
        }
        self.flush().map_err(w)?;
        sb.set_version(self.mode == Mode::Bitmap, self.meta.is_some());
        devio::write(&self.mdest, offset, &sb.to_bytes(), true).map_err(w)?;
        tracing::info!(
            "integrity: formatted {}: {} data sectors, {} journal sections, tag {} bytes",
            self.dev.table_name(),
            self.geo.provided,
            self.geo.journal_sections,
            tag_size
        );
        Ok(())
    }

    /// A commit under way, for the crash simulator (which may place a crash
    /// anywhere in one).
    fn window(&self) -> crate::io::sim::CommitWindow {
        let sim = match self.meta.as_ref().unwrap_or(&self.dev) {
            DevRef::File(f) => f.sim().cloned(),
            _ => None,
        };
        crate::io::sim::commit_window(sim.as_ref())
    }

    /// Both devices durable.
    fn flush(&self) -> std::io::Result<()> {
        if self.meta.is_some() {
            devio::flush(&self.mdest)?;
        }
        devio::flush(&self.dest)
    }

    /// The tag of a block, by the internal hash (zeroes without one).
    fn tag_of(&self, sector: u64, data: &[u8], out: &mut [u8]) {
        match &self.hash {
            Some(h) => h.tag(self.salt.as_ref(), sector, data, out),
            None => out.fill(0),
        }
    }

    /// Read the tags of `n` blocks from logical sector `l` (one area).
    fn read_tags(&self, l: u64, n: u64) -> std::io::Result<Vec<u8>> {
        let first = self.geo.tag_byte(l);
        let len = n * self.geo.tag_size;
        let s0 = first / SECTOR;
        let s1 = (first + len).div_ceil(SECTOR);
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        devio::read(&self.mdest, s0, &mut buf)?;
        let o = (first - s0 * SECTOR) as usize;
        Ok(buf[o..o + len as usize].to_vec())
    }

    /// Write the tags of the blocks from logical sector `l` (one area).
    fn write_tags(&self, l: u64, tags: &[u8]) -> std::io::Result<()> {
        let first = self.geo.tag_byte(l);
        let s0 = first / SECTOR;
        let s1 = (first + tags.len() as u64).div_ceil(SECTOR);
        let mut buf = vec![0u8; ((s1 - s0) * SECTOR) as usize];
        let o = (first - s0 * SECTOR) as usize;
        if o != 0 || !tags.len().is_multiple_of(SECTOR as usize) {
            devio::read(&self.mdest, s0, &mut buf)?;
        }
        buf[o..o + tags.len()].copy_from_slice(tags);
        devio::write(&self.mdest, s0, &buf, false)
    }

    /// Write blocks and their tags in place: `(logical sector, data)` runs
    /// within one area each.
    fn write_home(&self, l: u64, data: &[u8], tags: &[u8]) -> std::io::Result<()> {
        devio::write(&self.dest, self.geo.data_sector(l), data, false)?;
        self.write_tags(l, tags)
    }

    fn tags_for(&self, l: u64, data: &[u8]) -> Vec<u8> {
        let bs = (self.geo.spb() * SECTOR) as usize;
        let ts = self.geo.tag_size as usize;
        let mut tags = vec![0u8; data.len() / bs * ts];
        for (i, (blk, t)) in data.chunks(bs).zip(tags.chunks_mut(ts)).enumerate() {
            self.tag_of(l + i as u64 * self.geo.spb(), blk, t);
        }
        tags
    }
}

enum Job {
    Read { pending: Pending, bio: Bio },
    /// With the tags a device above gave (`tags`), if any.
    Write {
        pending: Pending,
        bio: Bio,
        data: Vec<u8>,
        tags: Option<Vec<u8>>,
    },
    Flush { pending: Pending },
    Discard { pending: Pending, bio: Bio },
    /// Replay or prepare at a first resume; the answer goes back.
    Resume(crate::sync::ReplyTx<Result<(), TargetError>>),
    /// Everything durable and the journal or bitmap closed, at a suspend.
    Suspend(crate::sync::ReplyTx<()>),
}

struct Queue {
    jobs: VecDeque<Job>,
    stop: bool,
}

struct Shared {
    q: Mutex<Queue>,
    wake: crate::sync::Cond,
    mismatches: AtomicU64,
    /// Where the background recalculation is (`u64::MAX`: not recalculating).
    recalc_at: AtomicU64,
    /// The device failed (a replay that could not be done, an I/O error on
    /// metadata): every later I/O fails, as the kernel's.
    failed: AtomicBool,
}

impl Shared {
    /// Nothing queued, no mismatch yet, recalculating from `recalc_at`.
    fn new(recalc_at: u64) -> Shared {
        Shared {
            q: Mutex::new(Queue {
                jobs: VecDeque::new(),
                stop: false,
            }),
            wake: crate::sync::Cond::new(),
            mismatches: AtomicU64::new(0),
            recalc_at: AtomicU64::new(recalc_at),
            failed: AtomicBool::new(false),
        }
    }
}

pub struct Integrity {
    lay: Arc<Layout>,
    shared: Arc<Shared>,
    opts: Opts,
    offset: u64,
    sb_flags: u32,
    journal_sectors_shown: u64,
    worker: Option<crate::sync::Thread<()>>,
    started: AtomicBool,
}

/// The internal hash the options name (None: the tags are a device
/// above's) and the tag size (the table's, else the digest's).
fn hash_and_tag(opts: &Opts, tag_given: Option<u64>) -> Result<(Option<Hash>, u64), TargetError> {
    let hash = match &opts.internal_hash {
        Some(spec) => Some(Hash::parse(spec)?.0),
        None if opts.recalculate => return Err("Recalculate can only be specified with internal_hash".into()),
        None => None,
    };
    let tag_size = match (tag_given, &hash) {
        (Some(t), _) => t,
        (None, Some(h)) => h.digest_size(),
        (None, None) => return Err("Unknown tag size".into()),
    };
    if tag_size > MAX_TAG_SIZE {
        return Err("Too big tag size".into());
    }
    Ok((hash, tag_size))
}

/// The options `recalculate` (start one if none is under way) and
/// `reset_recalculate` (from the start) in the superblock.
fn ask_recalculation(sb: &mut Superblock, opts: &Opts) {
    if opts.recalculate && !sb.has(SB_FLAG_RECALCULATING) {
        sb.flags |= SB_FLAG_RECALCULATING;
        sb.recalc_sector = 0;
    }
    if opts.reset_recalculate {
        sb.recalc_sector = 0;
    }
}

/// log2 of the sectors a bitmap bit covers (mode B; written to the superblock
/// at format): the table's `sectors_per_bit` (32768 if not given), at least a
/// block, and grown until the bitmap fits the journal's area.
fn bitmap_log2(sectors_per_bit: Option<u64>, log2_spb: u8, geo: &Geometry) -> u8 {
    let mut log2_spbb = sectors_per_bit
        .map_or(15, |v| if v == 0 { 0 } else { 63 - v.leading_zeros() as u8 })
        .max(log2_spb);
    let journal_bits = (geo.journal_sectors() * 4096).min(u64::from(u32::MAX));
    while log2_spbb < 63 && journal_bits < geo.provided.div_ceil(1u64 << log2_spbb) {
        log2_spbb += 1;
    }
    log2_spbb
}

impl Integrity {
    /// The table's arguments other than the devices: the offset, the tag size
    /// if given, the mode and the options, with the kernel's messages.
    fn parse_args(args: &[String]) -> Result<(u64, Option<u64>, Mode, Opts), TargetError> {
        if args.len() < 5 {
            return Err("Invalid argument count".into());
        }
        let offset = arg_u64(args, 1, "offset").map_err(|_| "Invalid starting offset".to_string())?;
        let tag_given = if args[2] == "-" {
            None
        } else {
            match args[2].parse::<u64>() {
                Ok(n) if n > 0 => Some(n),
                _ => return Err("Invalid tag size".into()),
            }
        };
        let mode = match args[3].as_str() {
            "J" => Mode::Journal,
            "B" => Mode::Bitmap,
            "D" => Mode::Direct,
            "R" => Mode::Recovery,
            "I" => return Err("inline mode (I) is not supported by dmkit's integrity target".into()),
            _ => return Err("Invalid mode (expecting J, B, D, R, I)".into()),
        };
        let nopt = args[4]
            .parse::<usize>()
            .ok()
            .filter(|&n| n <= 18)
            .ok_or("Invalid number of feature args")?;
        let words = args.get(5..5 + nopt).ok_or("Not enough feature arguments")?;
        if args.len() > 5 + nopt {
            return Err("Invalid argument count".into());
        }
        Ok((offset, tag_given, mode, parse_opts(words)?))
    }

    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Integrity, TargetError> {
        let (offset, tag_given, mode, opts) = Self::parse_args(args)?;
        let dev_name = &args[0];
        let dev = r.open(dev_name).map_err(|e| format!("Device lookup failed: '{dev_name}': {e}"))?;
        let (hash, tag_size) = hash_and_tag(&opts, tag_given)?;
        let log2_spb = (opts.block_size.unwrap_or(512) / 512).trailing_zeros() as u8;
        let dest = dev.dest();
        let dev_sectors = dev.size_sectors();
        let meta = match &opts.meta_device {
            Some(m) => Some(r.open(m).map_err(|e| format!("Device lookup failed: '{m}': {e}"))?),
            None => None,
        };
        let mdest = meta.as_ref().map_or_else(|| dest.clone(), |m| m.dest());
        let meta_sectors = meta.as_ref().map_or(dev_sectors, |m| m.size_sectors());
        // tag buffers of the metadata device (the kernel's dm-bufio blocks)
        let log2_buf = buffer_log2(opts.buffer_sectors);
        let meta_geo = meta.as_ref().map(|_| (meta_sectors, log2_buf));
        if meta_sectors <= offset + SB_SECTORS {
            return Err("The device is too small".into());
        }
        let mut area = vec![0u8; (SB_SECTORS * SECTOR) as usize];
        devio::read(&mdest, offset, &mut area).map_err(|e| format!("Error reading superblock: {e}"))?;
        let mut format = false;
        let mut sb = match Superblock::parse(&area) {
            Found::Superblock(sb) => sb,
            Found::Foreign => return Err("The device is not initialized".into()),
            Found::Blank if mode == Mode::Recovery => {
                return Err("The device is not initialized (mode R never formats)".into())
            }
            Found::Blank => {
                format = true;
                let mut sb = new_superblock(&opts, tag_size as u16, log2_spb, dev_sectors, offset, meta_geo)?;
                sb.set_version(mode == Mode::Bitmap, meta.is_some());
                sb
            }
        };
        check_superblock(&sb, tag_size, log2_spb, meta.is_some())?;
        let geo = Geometry::new(&sb, offset, dev_sectors, meta_geo)?;
        if len > geo.provided {
            return Err(format!(
                "Not enough provided sectors for requested mapping size ({len} > {})",
                geo.provided
            ).into());
        }
        if sb.has(SB_FLAG_RECALCULATING) && sb.recalc_sector < geo.provided && hash.as_ref().is_some_and(Hash::keyed) && !opts.legacy_recalculate {
            return Err("Recalculating with HMAC is disabled for security reasons - if you really need it, use the argument \"legacy_recalculate\"".into());
        }
        let log2_spbb = bitmap_log2(opts.sectors_per_bit, log2_spb, &geo);
        if format {
            sb.log2_blocks_per_bit = log2_spbb - log2_spb;
            sb.provided_data_sectors = geo.provided;
        }
        ask_recalculation(&mut sb, &opts);
        let salt = sb.has(SB_FLAG_FIXED_HMAC).then_some(sb.salt);
        let lay = Arc::new(Layout {
            dev,
            dest,
            meta,
            mdest,
            geo,
            hash,
            salt,
            mode,
            log2_spbb,
            watermark: opts.journal_watermark.unwrap_or(50),
            commit_time: Duration::from_millis(opts.commit_time.unwrap_or(10_000).max(1)),
            flush_interval: Duration::from_millis(opts.bitmap_flush_interval.unwrap_or(10_000).max(1)),
            allow_discards: opts.allow_discards,
        });
        if format {
            lay.format(&mut sb, offset, tag_size)?;
        }
        let recalc = if sb.has(SB_FLAG_RECALCULATING) && sb.recalc_sector < lay.geo.provided {
            sb.recalc_sector
        } else {
            u64::MAX
        };
        let shared = Arc::new(Shared::new(recalc));
        let journal_sectors_shown = lay.geo.journal_sectors();
        let sb_flags = sb.flags;
        let mut work = Work::new(lay.clone(), shared.clone(), sb);
        work.ask_recalc = opts.recalculate;
        work.reset_recalc = opts.reset_recalculate;
        let worker = crate::sync::spawn("dmkit-integrity", move || work.run())
            .map_err(|e| format!("Cannot allocate the integrity worker: {e}"))?;
        Ok(Integrity {
            lay,
            shared,
            opts,
            offset,
            sb_flags,
            journal_sectors_shown,
            worker: Some(worker),
            started: AtomicBool::new(false),
        })
    }

    fn push(&self, job: Job) {
        self.shared.q.lock().unpoisoned().jobs.push_back(job);
        self.shared.wake.notify_one();
    }

    fn params(&self, key: Option<&str>) -> String {
        let o = &self.opts;
        let g = &self.lay.geo;
        let mut p: Vec<String> = Vec::new();
        if let Some(m) = &self.lay.meta {
            p.push(format!("meta_device:{}", m.table_name()));
        }
        if g.spb() != 1 {
            p.push(format!("block_size:{}", g.spb() * SECTOR));
        }
        if self.sb_flags & SB_FLAG_RECALCULATING != 0 {
            p.push("recalculate".into());
        }
        if o.reset_recalculate {
            p.push("reset_recalculate".into());
        }
        if o.allow_discards {
            p.push("allow_discards".into());
        }
        p.push(format!("journal_sectors:{}", self.journal_sectors_shown));
        p.push(format!("interleave_sectors:{}", g.interleave()));
        p.push(format!("buffer_sectors:{}", buffer_sectors(o.buffer_sectors, g)));
        match self.lay.mode {
            Mode::Journal => {
                p.push(format!("journal_watermark:{}", self.lay.watermark));
                p.push(format!("commit_time:{}", self.lay.commit_time.as_millis()));
            }
            Mode::Bitmap => {
                p.push(format!("sectors_per_bit:{}", 1u64 << self.lay.log2_spbb));
                p.push(format!("bitmap_flush_interval:{}", self.lay.flush_interval.as_millis()));
            }
            _ => {}
        }
        if self.sb_flags & SB_FLAG_FIXED_PADDING != 0 {
            p.push("fix_padding".into());
        }
        if self.sb_flags & SB_FLAG_FIXED_HMAC != 0 {
            p.push("fix_hmac".into());
        }
        if o.legacy_recalculate {
            p.push("legacy_recalculate".into());
        }
        if let Some(h) = &o.internal_hash {
            match (h.split_once(':'), key) {
                (Some((alg, _)), Some(k)) => p.push(format!("internal_hash:{alg}:{k}")),
                _ => p.push(format!("internal_hash:{h}")),
            }
        }
        format!(
            "{} {} {} {} {} {}",
            self.lay.dev.table_name(),
            self.offset,
            self.lay.geo.tag_size,
            self.lay.mode.letter(),
            p.len(),
            p.join(" ")
        )
    }
}

/// The buffer size the kernel prints: a power of two, at most 2^22 and,
/// without a metadata device, the tag run's alignment.
fn buffer_sectors(given: Option<u64>, g: &Geometry) -> u64 {
    let log2 = u32::from(buffer_log2(given));
    if g.meta {
        return 1 << log2;
    }
    1 << log2.min(g.metadata_run.trailing_zeros())
}

/// A new superblock for a blank device (the kernel's `initialize_superblock`):
/// with a metadata device, the most journal sections up to the wanted
/// number that leave room for every tag.
fn new_superblock(
    o: &Opts,
    tag_size: u16,
    log2_spb: u8,
    dev_sectors: u64,
    start: u64,
    meta: Option<(u64, u8)>,
) -> Result<Superblock, TargetError> {
    let (_, _, section_sectors) = Geometry::journal_shape(log2_spb, u64::from(tag_size));
    if section_sectors <= JOURNAL_BLOCK_SECTORS {
        return Err("Too big tag size".into());
    }
    let wanted = journal_sections_for(o.journal_sectors, dev_sectors, section_sectors);
    let mut sb = Superblock {
        tag_size,
        journal_sections: wanted,
        log2_spb,
        ..Superblock::default()
    };
    if o.fix_padding && meta.is_none() {
        sb.flags |= SB_FLAG_FIXED_PADDING;
    }
    if o.fix_hmac {
        sb.flags |= SB_FLAG_FIXED_HMAC;
        new_salt(&mut sb.salt)?;
    }
    match meta {
        None => {
            let interleave = o.interleave_sectors.unwrap_or(1 << DEFAULT_INTERLEAVE_LOG2);
            sb.log2_interleave = if interleave == 0 {
                DEFAULT_INTERLEAVE_LOG2
            } else {
                (63 - interleave.leading_zeros() as u8).clamp(3, 31)
            }
            .max(log2_spb);
        }
        Some((meta_sectors, mut log2_buf)) => loop {
            let mut js = 0u32;
            for bit in (0..32 - wanted.leading_zeros()).rev() {
                let t = js | (1 << bit);
                if t > wanted {
                    continue;
                }
                let trial = Superblock {
                    journal_sections: t,
                    ..sb.clone()
                };
                if Geometry::new(&trial, start, dev_sectors, Some((meta_sectors, log2_buf))).is_ok() {
                    js = t;
                }
            }
            if js > 0 {
                sb.journal_sections = js;
                break;
            }
            if log2_buf <= 3 {
                return Err("Could not initialize superblock: the metadata device is too small".into());
            }
            log2_buf -= 1;
        },
    }
    Ok(sb)
}

/// log2 of the tag buffers (`buffer_sectors`, a power of two, at most 2^22).
fn buffer_log2(given: Option<u64>) -> u8 {
    (63 - given.unwrap_or(128).max(1).leading_zeros()).min(22) as u8
}

/// The kernel's checks of a superblock against the table, in its words.
fn check_superblock(sb: &Superblock, tag_size: u64, log2_spb: u8, meta: bool) -> Result<(), TargetError> {
    if !(1..=7).contains(&sb.version) {
        return Err(format!("Unknown version {}", sb.version).into());
    }
    if sb.has(SB_FLAG_INLINE) {
        return Err("Inline flag mismatch".into());
    }
    if sb.has(SB_FLAG_KEYED_DISCARD) {
        return Err("Keyed discard cannot be disabled once enabled (dmkit has no keyed discards)".into());
    }
    if u64::from(sb.tag_size) != tag_size {
        return Err(format!(
            "Tag size doesn't match the information in superblock ({} in the superblock, {tag_size} in the table)",
            sb.tag_size
        ).into());
    }
    if sb.log2_spb != log2_spb {
        return Err(format!(
            "Block size doesn't match the information in superblock ({} bytes in the superblock)",
            512u64 << sb.log2_spb.min(20)
        ).into());
    }
    if sb.journal_sections == 0 {
        return Err("Corrupted superblock, journal_sections is 0".into());
    }
    let interleave_ok = if meta {
        sb.log2_interleave == 0
    } else {
        (3..=31).contains(&sb.log2_interleave) && sb.log2_interleave >= sb.log2_spb
    };
    if !interleave_ok {
        return Err(format!(
            "Invalid interleave_sectors in the superblock (log2 {})",
            sb.log2_interleave
        ).into());
    }
    if sb.has(SB_FLAG_HAVE_JOURNAL_MAC) {
        return Err("Journal mac mismatch".into());
    }
    Ok(())
}

impl Drop for Integrity {
    fn drop(&mut self) {
        self.shared.q.lock().unpoisoned().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.worker.take() {
            let _ = t.join();
        }
    }
}

impl Integrity {
    /// A bio's tags must be what the table offers (the kernel's map refuses
    /// the bio otherwise).
    fn check_tags(&self, bio: &Bio) -> Result<(), MapErr> {
        let Some(t) = bio.tags else { return Ok(()) };
        let g = &self.lay.geo;
        let why = if self.lay.hash.is_some() {
            "Unexpected integrity data when using internal hash".to_string()
        } else if Some(t.profile()) != self.tag_profile() {
            format!(
                "Invalid integrity data: {} bytes a {}-byte block, expected {} a {}",
                t.size,
                t.profile().block_size,
                g.tag_size,
                g.spb() * SECTOR
            )
        } else {
            return Ok(());
        };
        tracing::error!("integrity: {}: {why}", self.lay.dev.table_name());
        Err(MapErr::Errno(errno::EIO))
    }
}

impl Target for Integrity {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let spb = self.lay.geo.spb();
        if bio.op != Op::Flush && (!bio.sector.is_multiple_of(spb) || !bio.nr_sectors.is_multiple_of(spb)) {
            tracing::error!(
                "integrity: Bio not aligned on {spb} sectors: {:#x}, {:#x}",
                bio.sector,
                bio.nr_sectors
            );
            return Err(MapErr::Errno(errno::EIO));
        }
        if self.shared.failed.load(Ordering::Relaxed) {
            return Err(MapErr::Errno(errno::EIO));
        }
        self.check_tags(&bio)?;
        let job = match bio.op {
            Op::Read => Job::Read {
                pending: ctx.submit(bio),
                bio,
            },
            _ if self.lay.mode == Mode::Recovery => return Err(MapErr::Errno(errno::EIO)),
            Op::Write => {
                let data = ctx.data_of(&bio).to_vec();
                let tags = match bio.tags {
                    Some(_) => Some(ctx.tags_of(&bio).ok_or(MapErr::Errno(errno::EIO))?.to_vec()),
                    None => None,
                };
                Job::Write {
                    pending: ctx.submit(bio),
                    bio,
                    data,
                    tags,
                }
            }
            Op::WriteZeroes => Job::Write {
                pending: ctx.submit(bio),
                bio,
                data: vec![0u8; bio.bytes() as usize],
                tags: None,
            },
            Op::Flush => Job::Flush {
                pending: ctx.submit(bio),
            },
            Op::Discard if self.lay.allow_discards => Job::Discard {
                pending: ctx.submit(bio),
                bio,
            },
            Op::Discard => {
                ctx.complete(bio, LeafKind::Drop);
                return Ok(());
            }
        };
        self.push(job);
        Ok(())
    }

    fn table_params(&self) -> String {
        self.params(None)
    }

    fn table_params_keyless(&self) -> Option<String> {
        let h = self.opts.internal_hash.as_ref()?;
        let (_, key) = h.split_once(':')?;
        Some(self.params(Some(&"0".repeat(key.len()))))
    }

    fn status_params(&self) -> String {
        let r = self.shared.recalc_at.load(Ordering::SeqCst);
        let recalc = if self.sb_flags & SB_FLAG_RECALCULATING != 0 || r != u64::MAX {
            r.min(self.lay.geo.provided).to_string()
        } else {
            "-".into()
        };
        format!(
            "{} {} {recalc}",
            self.shared.mismatches.load(Ordering::SeqCst),
            self.lay.geo.provided
        )
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.lay.dev]
    }

    fn held_devices(&self) -> Vec<&DevRef> {
        let mut v = vec![&self.lay.dev];
        v.extend(self.lay.meta.iter());
        v
    }

    fn max_io_len(&self) -> u64 {
        if self.lay.geo.meta {
            // no areas: requests of the kernel's default interleave
            1 << DEFAULT_INTERLEAVE_LOG2
        } else {
            self.lay.geo.interleave()
        }
    }

    fn logical_block_size(&self) -> u32 {
        (self.lay.geo.spb() * SECTOR) as u32
    }

    fn tag_profile(&self) -> Option<TagProfile> {
        match self.lay.hash {
            Some(_) => None,
            None => Some(TagProfile {
                tag_size: self.lay.geo.tag_size as u16,
                block_size: (self.lay.geo.spb() * SECTOR) as u32,
            }),
        }
    }

    fn limits(&self) -> Limits {
        let mut l = Limits::stacked(&self.devices());
        l.discard = self.lay.allow_discards;
        l.write_zeroes = false;
        l.read_only |= self.lay.mode == Mode::Recovery;
        l
    }

    fn preresume(&self) -> Result<(), TargetError> {
        if self.started.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let (tx, rx) = crate::sync::reply();
        self.push(Job::Resume(tx));
        let r = rx
            .recv()
            .unwrap_or_else(|| Err("the integrity worker stopped".into()));
        if r.is_err() {
            self.started.store(false, Ordering::SeqCst);
        }
        r
    }

    fn postsuspend(&self) {
        if !self.started.load(Ordering::SeqCst) {
            return;
        }
        let (tx, rx) = crate::sync::reply();
        self.push(Job::Suspend(tx));
        let _ = rx.recv();
    }
}

/// A new superblock's salt: random (from the trial's seed in a crash trial,
/// which then writes the same bytes in every run).
fn new_salt(salt: &mut [u8]) -> Result<(), TargetError> {
    if crate::sync::sched::seeded_bytes(salt) {
        return Ok(());
    }
    openssl::rand::rand_bytes(salt).map_err(|e| TargetError::from(format!("Could not initialize superblock: {e}")))
}

/// The worker's state: everything on disk is written from here.
struct Work {
    lay: Arc<Layout>,
    shared: Arc<Shared>,
    sb: Superblock,
    /// Mode J: the next section a commit writes, and its sequence.
    next_section: u64,
    seq: u8,
    /// Mode J: blocks written since the last commit, in order, and where each
    /// block's entry is.
    open: Vec<(u64, Vec<u8>, Vec<u8>)>,
    open_at: HashMap<u64, usize>,
    first_open: Option<Instant>,
    /// Mode B: the bits as on disk, and when one was last set.
    bitmap: Vec<u8>,
    bits_set: Option<Instant>,
    /// Something was written since the last suspend.
    written: bool,
    recalc_chunks: u32,
    /// The table's `recalculate` and `reset_recalculate`.
    ask_recalc: bool,
    reset_recalc: bool,
    resumed: bool,
    failures_logged: u64,
}

fn io_err(what: &str, e: std::io::Error) -> String {
    format!("integrity: {what}: {e}")
}

impl Work {
    fn new(lay: Arc<Layout>, shared: Arc<Shared>, sb: Superblock) -> Work {
        Work {
            lay,
            shared,
            sb,
            next_section: 0,
            seq: 1,
            open: Vec::new(),
            open_at: HashMap::new(),
            first_open: None,
            bitmap: Vec::new(),
            bits_set: None,
            written: false,
            recalc_chunks: 0,
            ask_recalc: false,
            reset_recalc: false,
            resumed: false,
            failures_logged: 0,
        }
    }

    fn run(mut self) {
        loop {
            let job = {
                let mut q = self.shared.q.lock().unpoisoned();
                loop {
                    if let Some(j) = q.jobs.pop_front() {
                        break Some(j);
                    }
                    if q.stop {
                        return;
                    }
                    if self.resumed && self.background_due() {
                        break None;
                    }
                    let wait = self.next_deadline();
                    q = self.shared.wake.wait_timeout(&self.shared.q, q, wait).0;
                }
            };
            match job {
                Some(j) => self.run_job(j),
                None => self.background(),
            }
        }
    }

    fn recalculating(&self) -> bool {
        self.shared.recalc_at.load(Ordering::SeqCst) < self.lay.geo.provided
    }

    fn background_due(&self) -> bool {
        let now = crate::sync::now();
        self.recalculating()
            || self.first_open.is_some_and(|t| now >= t + self.lay.commit_time)
            || self.bits_set.is_some_and(|t| now >= t + self.lay.flush_interval)
    }

    fn next_deadline(&self) -> Duration {
        let now = crate::sync::now();
        let mut d = Duration::from_secs(1);
        if let Some(t) = self.first_open {
            d = d.min((t + self.lay.commit_time).saturating_duration_since(now));
        }
        if let Some(t) = self.bits_set {
            d = d.min((t + self.lay.flush_interval).saturating_duration_since(now));
        }
        d.max(Duration::from_millis(1))
    }

    fn fail_device(&self, why: &TargetError) {
        tracing::error!("integrity: {why}; the device fails every I/O from now on");
        self.shared.failed.store(true, Ordering::SeqCst);
    }

    fn background(&mut self) {
        if self.shared.failed.load(Ordering::SeqCst) {
            return;
        }
        let now = crate::sync::now();
        if self.first_open.is_some_and(|t| now >= t + self.lay.commit_time) {
            if let Err(e) = self.commit() {
                self.fail_device(&e);
            }
        }
        if self.bits_set.is_some_and(|t| now >= t + self.lay.flush_interval) {
            if let Err(e) = self.clear_bitmap() {
                self.fail_device(&e);
            }
        }
        if self.recalculating() {
            if let Err(e) = self.recalc_step() {
                self.fail_device(&e);
                self.shared.recalc_at.store(u64::MAX, Ordering::SeqCst);
            }
        }
    }

    fn run_job(&mut self, job: Job) {
        let failed = self.shared.failed.load(Ordering::SeqCst);
        match job {
            Job::Resume(tx) => {
                let r = self.resume();
                if let Err(e) = &r {
                    tracing::error!("{e}");
                }
                self.resumed = r.is_ok();
                tx.send(r);
            }
            Job::Suspend(tx) => {
                if let Err(e) = self.suspend() {
                    self.fail_device(&e);
                }
                self.resumed = false;
                tx.send(());
            }
            Job::Read { pending, .. } | Job::Flush { pending } | Job::Discard { pending, .. } if failed => {
                pending.fail(errno::EIO)
            }
            Job::Write { pending, .. } if failed => pending.fail(errno::EIO),
            Job::Read { pending, bio } => match self.read(&bio) {
                Ok(data) => pending.done_with(data),
                Err(e) => pending.fail(e),
            },
            Job::Write {
                pending,
                bio,
                data,
                tags,
            } => {
                self.written = true;
                match self.write(&bio, data, tags) {
                    Ok(()) => pending.done(),
                    Err(e) => {
                        self.fail_device(&e);
                        pending.fail(errno::EIO)
                    }
                }
            }
            Job::Flush { pending } => match self.flush() {
                Ok(()) => pending.done(),
                Err(e) => {
                    self.fail_device(&e);
                    pending.fail(errno::EIO)
                }
            },
            Job::Discard { pending, bio } => {
                self.written = true;
                match self.discard(&bio) {
                    Ok(()) => pending.done(),
                    Err(e) => {
                        self.fail_device(&e);
                        pending.fail(errno::EIO)
                    }
                }
            }
        }
    }

    // ---- reads ----

    fn read(&mut self, bio: &Bio) -> Result<Vec<u8>, i32> {
        let lay = self.lay.clone();
        let g = &lay.geo;
        let spb = g.spb();
        let bs = (spb * SECTOR) as usize;
        let mut out = vec![0u8; bio.bytes() as usize];
        devio::read(&lay.dest, g.data_sector(bio.sector), &mut out).map_err(|_| errno::EIO)?;
        if lay.mode == Mode::Recovery && lay.hash.is_some() {
            return Ok(out);
        }
        let n = bio.nr_sectors / spb;
        let mut tags = lay.read_tags(bio.sector, n).map_err(|_| errno::EIO)?;
        let ts = g.tag_size as usize;
        let unchecked_from = match lay.hash {
            Some(_) => self.shared.recalc_at.load(Ordering::SeqCst),
            // the tags are the device above's to check
            None => 0,
        };
        let mut want = vec![0u8; ts];
        for i in 0..n as usize {
            let l = bio.sector + i as u64 * spb;
            let blk = &mut out[i * bs..(i + 1) * bs];
            if let Some(&k) = self.open_at.get(&l) {
                blk.copy_from_slice(&self.open[k].1);
                tags[i * ts..(i + 1) * ts].copy_from_slice(&self.open[k].2);
                continue;
            }
            if l + spb > unchecked_from {
                continue;
            }
            let have = &tags[i * ts..(i + 1) * ts];
            lay.tag_of(l, blk, &mut want);
            if want != have && !(lay.allow_discards && have.iter().all(|&b| b == DISCARD_FILLER)) {
                self.shared.mismatches.fetch_add(1, Ordering::SeqCst);
                if self.failures_logged < LOGGED_FAILURES {
                    self.failures_logged += 1;
                    tracing::error!(
                        "integrity: {}: Checksum failed at sector {l:#x}",
                        lay.dev.table_name()
                    );
                }
                return Err(EILSEQ);
            }
        }
        if bio.tags.is_some() {
            out.extend_from_slice(&tags);
        }
        Ok(out)
    }

    // ---- writes ----

    /// Write `data` at `bio`'s blocks, with the tags a device above gave
    /// (`given`), else the internal hash's.
    fn write(&mut self, bio: &Bio, data: Vec<u8>, given: Option<Vec<u8>>) -> Result<(), TargetError> {
        let lay = self.lay.clone();
        let spb = lay.geo.spb();
        let bs = (spb * SECTOR) as usize;
        let ts = lay.geo.tag_size as usize;
        match lay.mode {
            Mode::Journal => {
                for (i, blk) in data.chunks(bs).enumerate() {
                    let l = bio.sector + i as u64 * spb;
                    let mut tag = vec![0u8; ts];
                    match given.as_ref().and_then(|t| t.get(i * ts..(i + 1) * ts)) {
                        Some(t) => tag.copy_from_slice(t),
                        None => lay.tag_of(l, blk, &mut tag),
                    }
                    match self.open_at.get(&l) {
                        Some(&k) => self.open[k] = (l, blk.to_vec(), tag),
                        None => {
                            self.open_at.insert(l, self.open.len());
                            self.open.push((l, blk.to_vec(), tag));
                        }
                    }
                    self.first_open.get_or_insert_with(crate::sync::now);
                    if self.open.len() as u64 >= self.commit_trigger() {
                        self.commit()?;
                    }
                }
                if bio.fua {
                    self.commit()?;
                }
                Ok(())
            }
            _ => {
                if lay.mode == Mode::Bitmap {
                    self.set_bits(bio.sector, bio.nr_sectors)?;
                }
                let tags = match (given, &lay.hash) {
                    (Some(t), _) => Some(t),
                    (None, Some(_)) => Some(lay.tags_for(bio.sector, &data)),
                    // a device above's tags stay as they are
                    (None, None) => None,
                };
                match tags {
                    Some(t) => lay.write_home(bio.sector, &data, &t),
                    None => devio::write(&lay.dest, lay.geo.data_sector(bio.sector), &data, false),
                }
                .map_err(|e| io_err("writing data and tags", e))?;
                if bio.fua {
                    lay.flush().map_err(|e| io_err("flushing", e))?;
                }
                Ok(())
            }
        }
    }

    fn flush(&mut self) -> Result<(), TargetError> {
        if self.lay.mode == Mode::Journal {
            self.commit()?;
        }
        self.lay.flush().map_err(|e| TargetError::from(io_err("flushing", e)))
    }

    fn discard(&mut self, bio: &Bio) -> Result<(), TargetError> {
        let lay = self.lay.clone();
        // what the journal holds goes first, so it cannot land after
        self.commit()?;
        if lay.mode == Mode::Bitmap {
            self.set_bits(bio.sector, bio.nr_sectors)?;
        }
        let n = bio.nr_sectors / lay.geo.spb();
        let tags = vec![DISCARD_FILLER; (n * lay.geo.tag_size) as usize];
        lay.write_tags(bio.sector, &tags).map_err(|e| io_err("writing tags", e))?;
        lay.flush().map_err(|e| io_err("flushing", e))?;
        // the data goes last; a device that does not discard keeps its bytes
        let _ = devio::discard(&lay.dest, lay.geo.data_sector(bio.sector), bio.nr_sectors);
        Ok(())
    }

    // ---- the journal ----

    /// Blocks held in memory before a commit: the watermark's share of the
    /// journal, and at most [`MAX_OPEN_BYTES`] of them, whatever size the
    /// superblock gives the journal.
    fn commit_trigger(&self) -> u64 {
        let all = self.lay.geo.journal_entries();
        let cap = MAX_OPEN_BYTES / (self.lay.geo.spb() * SECTOR);
        (all.saturating_mul(self.lay.watermark) / 100).clamp(1, all).min(cap)
    }

    /// Write what is open to the journal, durable, then to its places,
    /// durable.
    fn commit(&mut self) -> Result<(), TargetError> {
        if self.open.is_empty() {
            return Ok(());
        }
        let lay = self.lay.clone();
        let _window = lay.window();
        let g = &lay.geo;
        let open = std::mem::take(&mut self.open);
        self.open_at.clear();
        self.first_open = None;
        let per = g.section_entries as usize;
        for chunk in open.chunks(per) {
            let entries: Vec<(u64, &[u8], &[u8])> = chunk.iter().map(|(l, d, t)| (*l, &d[..], &t[..])).collect();
            let s = build_section(g, self.next_section, self.seq, &entries);
            devio::write(&lay.mdest, g.journal_sector(self.next_section * g.section_sectors), &s, false)
                .map_err(|e| io_err("writing the journal", e))?;
            self.next_section += 1;
            if self.next_section == g.journal_sections {
                self.next_section = 0;
                self.seq = (self.seq + 1) % 4;
            }
        }
        lay.flush().map_err(|e| io_err("flushing the journal", e))?;
        let mut blocks: Vec<&(u64, Vec<u8>, Vec<u8>)> = open.iter().collect();
        blocks.sort_by_key(|b| b.0);
        self.write_runs(&blocks)?;
        lay.flush().map_err(|e| TargetError::from(io_err("flushing", e)))
    }

    /// Write blocks (sorted by sector) and their tags home, consecutive ones
    /// of an area together.
    fn write_runs(&self, blocks: &[&(u64, Vec<u8>, Vec<u8>)]) -> Result<(), TargetError> {
        let lay = &self.lay;
        let g = &lay.geo;
        let mut i = 0;
        while i < blocks.len() {
            let first = blocks[i].0;
            let mut j = i + 1;
            while j < blocks.len()
                && blocks[j].0 == blocks[j - 1].0 + g.spb()
                && blocks[j].0 < g.area_end(first)
            {
                j += 1;
            }
            let data: Vec<u8> = blocks[i..j].iter().flat_map(|b| b.1.iter().copied()).collect();
            let tags: Vec<u8> = blocks[i..j].iter().flat_map(|b| b.2.iter().copied()).collect();
            lay.write_home(first, &data, &tags)
                .map_err(|e| io_err("writing data and tags", e))?;
            i = j;
        }
        Ok(())
    }

    fn read_section(&self, i: u64) -> Result<Vec<u8>, TargetError> {
        let g = &self.lay.geo;
        let mut s = vec![0u8; (g.section_sectors * SECTOR) as usize];
        devio::read(&self.lay.mdest, g.journal_sector(i * g.section_sectors), &mut s)
            .map_err(|e| io_err("reading the journal", e))?;
        Ok(s)
    }

    fn write_section(&self, i: u64, seq: u8) -> Result<(), TargetError> {
        let g = &self.lay.geo;
        let s = empty_section(g, i, seq);
        devio::write(&self.lay.mdest, g.journal_sector(i * g.section_sectors), &s, false)
            .map_err(|e| TargetError::from(io_err("writing the journal", e)))
    }

    /// The kernel's replay: find the committed sections, write their blocks
    /// home, and leave the journal ready to go on.
    fn replay(&mut self) -> Result<(), TargetError> {
        let lay = self.lay.clone();
        let g = &lay.geo;
        let n = g.journal_sections;
        // a byte or two a section, whatever the journal's size
        let mut seqs = Vec::new();
        let mut any_used = false;
        for i in 0..n {
            let s = self.read_section(i)?;
            any_used |= (0..g.section_entries).any(|e| entry_sector(g, &s, e).is_some());
            seqs.push(section_seqs(g, i, &s).map_err(|e| format!("integrity: {e}"))?);
        }
        let plan = plan_replay(&seqs, any_used).map_err(|e| format!("integrity: {e}"))?;
        drop(seqs);
        if !plan.empty && plan.write_sections > 0 {
            let mut replayed = 0u64;
            for k in 0..plan.write_sections {
                let i = (plan.write_start + k) % n;
                let s = self.read_section(i)?;
                let mut blocks = Vec::new();
                for e in 0..g.section_entries {
                    let Some(l) = entry_sector(g, &s, e) else { continue };
                    if !l.is_multiple_of(g.spb()) {
                        return Err(format!("integrity: invalid sector in journal: section {i} entry {e}: {l}").into());
                    }
                    if l >= g.provided {
                        continue;
                    }
                    let (data, tag) = entry_block(g, &s, e);
                    // a device above's tags are its to check, as the kernel's
                    // replay checks only an internal hash's
                    if let Some(h) = &lay.hash {
                        let mut want = vec![0u8; tag.len()];
                        h.tag(lay.salt.as_ref(), l, &data, &mut want);
                        if want != tag {
                            return Err(format!(
                                "integrity: tag mismatch when replaying journal: section {i} entry {e}, sector {l}"
                            )
                            .into());
                        }
                    }
                    blocks.push((l, data, tag));
                }
                replayed += blocks.len() as u64;
                // later entries of a section win over earlier ones
                let mut last: HashMap<u64, usize> = HashMap::new();
                for (k, b) in blocks.iter().enumerate() {
                    last.insert(b.0, k);
                }
                let mut keep: Vec<&(u64, Vec<u8>, Vec<u8>)> =
                    blocks.iter().enumerate().filter(|(k, b)| last[&b.0] == *k).map(|(_, b)| b).collect();
                keep.sort_by_key(|b| b.0);
                self.write_runs(&keep)?;
            }
            lay.flush().map_err(|e| io_err("flushing", e))?;
            tracing::info!(
                "integrity: {}: replayed {} journal sections ({replayed} blocks)",
                lay.dev.table_name(),
                plan.write_sections
            );
        }
        if plan.write_sections == n && (lay.mode == Mode::Journal || plan.empty) {
            self.next_section = plan.write_start;
            self.seq = plan.want;
        } else {
            let erase = (plan.last_used + 2) % 4;
            let order: Vec<u64> = (0..n).map(|k| (plan.write_start + k) % n).collect();
            for (k, &i) in order.iter().enumerate() {
                self.write_section(i, erase)?;
                if k == 0 || k + 2 == n as usize {
                    lay.flush().map_err(|e| io_err("flushing the journal", e))?;
                }
            }
            lay.flush().map_err(|e| io_err("flushing the journal", e))?;
            self.next_section = 0;
            self.seq = (erase + 1) % 4;
        }
        Ok(())
    }

    fn write_sb(&mut self) -> Result<(), TargetError> {
        let _window = self.lay.window();
        self.sb.set_version(self.lay.mode == Mode::Bitmap, self.lay.meta.is_some());
        devio::write(&self.lay.mdest, self.lay.geo.start, &self.sb.to_bytes(), true)
            .map_err(|e| TargetError::from(io_err("writing the superblock", e)))
    }

    /// The superblock as it is now: the table it was read for may have been
    /// made while another table of the device ran, which wrote it since.
    fn reread_sb(&mut self) -> Result<(), TargetError> {
        let mut area = vec![0u8; (SB_SECTORS * SECTOR) as usize];
        devio::read(&self.lay.mdest, self.lay.geo.start, &mut area).map_err(|e| io_err("reading the superblock", e))?;
        let Found::Superblock(now) = Superblock::parse(&area) else {
            return Err("integrity: the superblock was changed while the device was suspended (it is gone)".into());
        };
        let layout = |s: &Superblock| {
            (
                s.log2_interleave,
                s.tag_size,
                s.journal_sections,
                s.log2_spb,
                s.flags & (SB_FLAG_FIXED_PADDING | SB_FLAG_FIXED_HMAC | SB_FLAG_HAVE_JOURNAL_MAC | SB_FLAG_INLINE),
                s.salt,
            )
        };
        if layout(&now) != layout(&self.sb) {
            return Err("integrity: The superblock was changed while the device was suspended".into());
        }
        let mut sb = now;
        // what this table asked for
        if self.ask_recalc && !sb.has(SB_FLAG_RECALCULATING) {
            sb.flags |= SB_FLAG_RECALCULATING;
            sb.recalc_sector = 0;
        }
        if self.reset_recalc {
            sb.recalc_sector = 0;
        }
        let at = if sb.has(SB_FLAG_RECALCULATING) && sb.recalc_sector < self.lay.geo.provided {
            sb.recalc_sector
        } else {
            u64::MAX
        };
        self.shared.recalc_at.store(at, Ordering::SeqCst);
        self.sb = sb;
        Ok(())
    }

    fn resume(&mut self) -> Result<(), TargetError> {
        let lay = self.lay.clone();
        if lay.mode == Mode::Recovery {
            return Ok(());
        }
        self.reread_sb()?;
        let g = &lay.geo;
        let mut sb_dirty = self.sb.provided_data_sectors != g.provided;
        self.sb.provided_data_sectors = g.provided;
        if self.sb.has(SB_FLAG_DIRTY_BITMAP) {
            // a crash in bitmap mode: the regions whose bits are set get
            // their tags again, then the journal area is a journal again
            let (log2_spbb, bits) = self.read_bitmap()?;
            let regions = g.provided.div_ceil(1u64 << log2_spbb);
            let mut n = 0;
            for b in 0..regions {
                if bits.get((b / 8) as usize).is_some_and(|x| x & (1 << (b % 8)) != 0) {
                    let s = b << log2_spbb;
                    self.recalc_range(s, (1u64 << log2_spbb).min(g.provided - s))?;
                    n += 1;
                }
            }
            lay.flush().map_err(|e| io_err("flushing", e))?;
            tracing::info!(
                "integrity: {}: the bitmap was dirty: tags of {n} regions recalculated",
                lay.dev.table_name()
            );
            for i in 0..g.journal_sections {
                self.write_section(i, 0)?;
            }
            lay.flush().map_err(|e| io_err("flushing the journal", e))?;
            self.sb.flags &= !SB_FLAG_DIRTY_BITMAP;
            sb_dirty = true;
            self.next_section = 0;
            self.seq = 1;
        } else {
            self.replay()?;
        }
        if lay.mode == Mode::Bitmap {
            self.sb.flags |= SB_FLAG_DIRTY_BITMAP;
            self.sb.log2_blocks_per_bit = lay.log2_spbb - g.log2_spb;
            self.write_sb()?;
            sb_dirty = false;
            self.bitmap = vec![0u8; self.bitmap_bytes()];
            self.write_bitmap()?;
        }
        if sb_dirty || (self.sb.has(SB_FLAG_RECALCULATING) && self.sb.recalc_sector == 0) {
            self.write_sb()?;
        }
        self.written = false;
        Ok(())
    }

    fn suspend(&mut self) -> Result<(), TargetError> {
        let lay = self.lay.clone();
        // a failed device leaves its journal or bitmap as they are: the next
        // load replays the one, recomputes what the other names
        if lay.mode == Mode::Recovery || self.shared.failed.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.commit()?;
        lay.flush().map_err(|e| io_err("flushing", e))?;
        let g = &lay.geo;
        match lay.mode {
            Mode::Journal if self.written => {
                // as the kernel leaves it: the sections from the next one on
                // with this sequence, those before it with the next
                for i in self.next_section..g.journal_sections {
                    self.write_section(i, self.seq)?;
                }
                for i in 0..self.next_section {
                    self.write_section(i, (self.seq + 1) % 4)?;
                }
                lay.flush().map_err(|e| io_err("flushing the journal", e))?;
                // the next commit goes on where this one would have
                self.seq = (self.seq + 1) % 4;
            }
            Mode::Bitmap => {
                for i in 0..g.journal_sections {
                    self.write_section(i, 0)?;
                }
                lay.flush().map_err(|e| io_err("flushing the journal", e))?;
                self.sb.flags &= !SB_FLAG_DIRTY_BITMAP;
                self.write_sb()?;
                self.bits_set = None;
                self.next_section = 0;
                self.seq = 1;
            }
            _ => {}
        }
        self.save_recalc()?;
        self.written = false;
        Ok(())
    }

    // ---- the bitmap (mode B) ----

    fn bitmap_bytes(&self) -> usize {
        let g = &self.lay.geo;
        let bits = g.provided.div_ceil(1u64 << self.lay.log2_spbb);
        (bits.div_ceil(8) as usize).div_ceil(BITMAP_BLOCK_BYTES) * BITMAP_BLOCK_BYTES
    }

    /// The bitmap a crash left: log2 of its sectors per bit, and its bytes.
    fn read_bitmap(&self) -> Result<(u8, Vec<u8>), TargetError> {
        let g = &self.lay.geo;
        let log2_spbb = u32::from(self.sb.log2_blocks_per_bit) + u32::from(g.log2_spb);
        if log2_spbb > 48 {
            return Err(format!(
                "integrity: the superblock's blocks per bitmap bit (2^{}) are out of range",
                self.sb.log2_blocks_per_bit
            ).into());
        }
        let bits = g.provided.div_ceil(1u64 << log2_spbb);
        let bytes = (bits.div_ceil(8)).div_ceil(BITMAP_BLOCK_BYTES as u64) * BITMAP_BLOCK_BYTES as u64;
        if bytes > g.journal_sectors() * SECTOR {
            return Err(format!(
                "integrity: the superblock's bitmap (2^{} blocks per bit) does not fit the journal's area",
                self.sb.log2_blocks_per_bit
            ).into());
        }
        let mut b = vec![0u8; bytes as usize];
        devio::read(&self.lay.mdest, g.journal_sector(0), &mut b).map_err(|e| io_err("reading the bitmap", e))?;
        Ok((log2_spbb as u8, b))
    }

    fn write_bitmap(&self) -> Result<(), TargetError> {
        devio::write(&self.lay.mdest, self.lay.geo.journal_sector(0), &self.bitmap, true)
            .map_err(|e| TargetError::from(io_err("writing the bitmap", e)))
    }

    /// The bits of a range set on disk before it is written.
    fn set_bits(&mut self, sector: u64, n: u64) -> Result<(), TargetError> {
        let s = self.lay.log2_spbb;
        let mut blocks = Vec::new();
        for b in (sector >> s)..=((sector + n - 1) >> s) {
            let (byte, bit) = ((b / 8) as usize, 1u8 << (b % 8));
            if self.bitmap[byte] & bit == 0 {
                self.bitmap[byte] |= bit;
                let blk = byte / BITMAP_BLOCK_BYTES;
                if blocks.last() != Some(&blk) {
                    blocks.push(blk);
                }
            }
        }
        let _window = self.lay.window();
        for blk in blocks {
            let o = blk * BITMAP_BLOCK_BYTES;
            devio::write(
                &self.lay.mdest,
                self.lay.geo.journal_sector((o / SECTOR as usize) as u64),
                &self.bitmap[o..o + BITMAP_BLOCK_BYTES],
                true,
            )
            .map_err(|e| io_err("writing the bitmap", e))?;
            self.bits_set = Some(crate::sync::now());
        }
        Ok(())
    }

    /// Everything written is durable: the bits go.
    fn clear_bitmap(&mut self) -> Result<(), TargetError> {
        let _window = self.lay.window();
        self.lay.flush().map_err(|e| io_err("flushing", e))?;
        self.bitmap.fill(0);
        self.write_bitmap()?;
        self.bits_set = None;
        Ok(())
    }

    // ---- recalculation ----

    /// Compute and write the tags of a range (within one area or more).
    fn recalc_range(&self, start: u64, len: u64) -> Result<(), TargetError> {
        let lay = &self.lay;
        if lay.hash.is_none() {
            // a device above's tags: nothing here computes them
            return Ok(());
        }
        let g = &lay.geo;
        let mut s = start;
        while s < start + len {
            let n = (start + len).min(g.area_end(s)).min(s + RECALC_SECTORS) - s;
            let mut data = vec![0u8; (n * SECTOR) as usize];
            devio::read(&lay.dest, g.data_sector(s), &mut data).map_err(|e| io_err("reading data", e))?;
            let tags = lay.tags_for(s, &data);
            lay.write_tags(s, &tags).map_err(|e| io_err("writing tags", e))?;
            s += n;
        }
        Ok(())
    }

    fn recalc_step(&mut self) -> Result<(), TargetError> {
        let g = &self.lay.geo;
        let at = self.shared.recalc_at.load(Ordering::SeqCst);
        let n = (at + RECALC_SECTORS).min(g.area_end(at)).min(g.provided) - at;
        self.recalc_range(at, n)?;
        self.shared.recalc_at.store(at + n, Ordering::SeqCst);
        self.recalc_chunks += 1;
        if self.recalc_chunks >= RECALC_SB_EVERY || at + n >= g.provided {
            self.recalc_chunks = 0;
            self.save_recalc()?;
        }
        Ok(())
    }

    /// The recalculation's place in the superblock, its tags durable first.
    fn save_recalc(&mut self) -> Result<(), TargetError> {
        if !self.sb.has(SB_FLAG_RECALCULATING) {
            return Ok(());
        }
        let at = self.shared.recalc_at.load(Ordering::SeqCst).min(self.lay.geo.provided);
        if at == self.sb.recalc_sector {
            return Ok(());
        }
        self.lay.flush().map_err(|e| io_err("flushing", e))?;
        self.sb.recalc_sector = at;
        self.write_sb()
    }
}
