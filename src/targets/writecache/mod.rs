//! `writecache <p|s> <origin> <cache> <block_size> <N> [<option>...]`: the
//! kernel's dm-writecache over its on-disk format (see [`format`]).
//!
//! Writes land in cache blocks and are committed in batches; reads hit the newest
//! cached copy of a block or go to the origin; a writeback thread copies
//! committed blocks to the origin when the cache fills past its high watermark,
//! when blocks pass max_age, and (`flush` message, flush_on_suspend, cleaner)
//! for everything, in origin-sector order (the 2019 sorted writeback).
//!
//! `s` keeps data on the cache device through the request path; `p` maps the
//! cache file into memory and copies data with memcpy, made durable by msync
//! before each commit. Both lay the cache out alike, so either opens the other's.

mod cache;
pub mod format;

use crate::mapper::TargetError;
use cache::{Cache, Devs};

use crate::io::SECTOR;
use crate::mapper::devio;
use crate::mapper::{arg_dev, Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use format::Superblock;
use std::sync::Arc;
use std::time::Duration;

/// The largest block size (the kernel's PAGE_SIZE on x86).
const MAX_BLOCK: u32 = 4096;
/// The most option words the table can carry.
const MAX_OPTION_WORDS: usize = 18;

/// The table line's settings: explicit options are kept as given (`dmsetup
/// table` prints exactly those), defaults come from the accessors.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub pmem: bool,
    pub block_size: u32,
    pub start_sector: u64,
    start_sector_set: bool,
    high_wm: Option<u32>,
    low_wm: Option<u32>,
    writeback_jobs: Option<u32>,
    autocommit_blocks: Option<u32>,
    autocommit_time: Option<u32>,
    pub max_age: Option<u32>,
    pub cleaner: bool,
    fua: Option<bool>,
    pub metadata_only: bool,
    pause: Option<u32>,
}

impl Options {
    pub fn autocommit_blocks(&self) -> u32 {
        self.autocommit_blocks
            .unwrap_or(if self.pmem { 64 } else { 65536 })
    }

    pub fn autocommit_time(&self) -> Duration {
        Duration::from_millis(u64::from(self.autocommit_time.unwrap_or(1000)))
    }

    /// Blocks in writeback at once (0: no limit); the kernel's default is
    /// min(256 MiB of pages, RAM / 16).
    pub fn writeback_jobs(&self) -> u32 {
        self.writeback_jobs.unwrap_or(65536)
    }

    /// Whether writeback writes to the origin carry FUA: pmem mode unless
    /// `nofua` (the kernel's writeback_fua, on by default); ssd mode never (its
    /// writeback is a copy followed by a flush of the origin).
    pub fn writeback_fua(&self) -> bool {
        self.pmem && self.fua.unwrap_or(true)
    }

    /// ms of idleness before watermark writeback starts (ssd only).
    pub fn pause_ms(&self) -> u32 {
        if self.pmem {
            0
        } else {
            self.pause.unwrap_or(3000)
        }
    }

    /// Free-block counts at the high and low watermarks (cleaner: everything).
    pub fn free_marks(&self, n: u64) -> (u64, u64) {
        if self.cleaner {
            return (n, n);
        }
        let at = |pct: u32| (n * u64::from(100 - pct) + 50) / 100;
        (at(self.high_wm.unwrap_or(50)), at(self.low_wm.unwrap_or(45)))
    }

    fn parse_options(&mut self, words: &[String], cache_sectors: u64) -> Result<(), TargetError> {
        let bad = |w: &[&String]| {
            let w: Vec<&str> = w.iter().map(|s| s.as_str()).collect();
            format!("Invalid optional argument: '{}'", w.join(" "))
        };
        let mut i = 0;
        while i < words.len() {
            let w = &words[i];
            let name = w.to_ascii_lowercase();
            let valued = [
                "start_sector",
                "high_watermark",
                "low_watermark",
                "writeback_jobs",
                "autocommit_blocks",
                "autocommit_time",
                "max_age",
                "pause_writeback",
            ];
            if valued.contains(&name.as_str()) {
                let Some(v) = words.get(i + 1) else {
                    return Err(bad(&[w]).into());
                };
                let num = |max: u64| {
                    v.parse::<u64>()
                        .ok()
                        .filter(|&x| x <= max)
                        .ok_or_else(|| bad(&[w, v]))
                };
                match name.as_str() {
                    "start_sector" => {
                        let s = num(u64::MAX)?;
                        if s >= cache_sectors {
                            return Err(bad(&[w, v]).into());
                        }
                        self.start_sector = s;
                        self.start_sector_set = true;
                    }
                    "high_watermark" => self.high_wm = Some(num(100)? as u32),
                    "low_watermark" => self.low_wm = Some(num(100)? as u32),
                    "writeback_jobs" => self.writeback_jobs = Some(num(u64::from(u32::MAX))? as u32),
                    "autocommit_blocks" => self.autocommit_blocks = Some(num(u64::from(u32::MAX))? as u32),
                    "autocommit_time" => self.autocommit_time = Some(num(3_600_000)? as u32),
                    "max_age" => self.max_age = Some(num(86_400_000)? as u32),
                    _ => {
                        if self.pmem {
                            return Err(bad(&[w, v]).into());
                        }
                        self.pause = Some(num(60_000)? as u32);
                    }
                }
                i += 2;
                continue;
            }
            match name.as_str() {
                "cleaner" => self.cleaner = true,
                "fua" | "nofua" if self.pmem => self.fua = Some(name == "fua"),
                "metadata_only" => self.metadata_only = true,
                _ => return Err(bad(&[w]).into()),
            }
            i += 1;
        }
        if self.high_wm.unwrap_or(50) < self.low_wm.unwrap_or(45) {
            return Err("High watermark must be greater than or equal to low watermark".into());
        }
        Ok(())
    }

    /// The option words `dmsetup table` prints, in the kernel's order.
    fn table_words(&self) -> Vec<String> {
        let mut w = Vec::new();
        let mut kv = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                w.push(k.to_string());
                w.push(v);
            }
        };
        kv(
            "start_sector",
            self.start_sector_set.then(|| self.start_sector.to_string()),
        );
        kv("high_watermark", self.high_wm.map(|v| v.to_string()));
        kv("low_watermark", self.low_wm.map(|v| v.to_string()));
        kv("writeback_jobs", self.writeback_jobs.map(|v| v.to_string()));
        kv("autocommit_blocks", self.autocommit_blocks.map(|v| v.to_string()));
        kv("autocommit_time", self.autocommit_time.map(|v| v.to_string()));
        kv("max_age", self.max_age.map(|v| v.to_string()));
        if self.cleaner {
            w.push("cleaner".into());
        }
        if let Some(f) = self.fua {
            w.push(if f { "fua" } else { "nofua" }.into());
        }
        if self.metadata_only {
            w.push("metadata_only".into());
        }
        if let Some(p) = self.pause {
            w.push("pause_writeback".into());
            w.push(p.to_string());
        }
        w
    }
}

pub struct Writecache {
    origin: DevRef,
    cache_dev: DevRef,
    cache: Arc<Cache>,
}

impl Writecache {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Writecache, TargetError> {
        if args.len() < 5 {
            return Err(
                "Bad arguments: writecache <p|s> <origin> <cache> <block_size> <N> [<option>...]".into(),
            );
        }
        let pmem = match args[0].to_ascii_lowercase().as_str() {
            "s" => false,
            "p" => true,
            m => return Err(format!("Bad arguments: mode '{m}' is neither p nor s").into()),
        };
        let mut o = Options {
            pmem,
            ..Options::default()
        };
        let origin =
            arg_dev(args, 1, 0, len, r).map_err(|e| format!("Origin data device lookup failed: {e}"))?;
        let cache_dev = r
            .open(&args[2])
            .map_err(|e| format!("Cache data device lookup failed: device '{}': {e}", args[2]))?;
        o.block_size = args[3]
            .parse::<u32>()
            .ok()
            .filter(|b| (512..=MAX_BLOCK).contains(b) && b.is_power_of_two())
            .ok_or_else(|| {
                format!(
                    "Invalid block size '{}' (a power of two, 512 to {MAX_BLOCK})",
                    args[3]
                )
            })?;
        let lbs = origin.logical_block_size().max(cache_dev.logical_block_size());
        if o.block_size < lbs {
            return Err(format!(
                "Block size is smaller than device logical block size ({} < {lbs})",
                o.block_size
            ).into());
        }
        let n: usize = args[4]
            .parse()
            .ok()
            .filter(|&n| n <= MAX_OPTION_WORDS && n <= args.len() - 5)
            .ok_or_else(|| format!("Invalid number of feature args '{}'", args[4]))?;
        if args.len() != 5 + n {
            return Err(format!(
                "Invalid number of feature args ({n} announced, {} given)",
                args.len() - 5
            ).into());
        }
        let cache_sectors = cache_dev.size_sectors();
        o.parse_options(&args[5..], cache_sectors)?;
        let n_blocks = open_or_format(&o, &cache_dev, cache_sectors)?;
        let file = |d: &DevRef| match d {
            DevRef::File(f) => Some(f.clone()),
            DevRef::Dm(_) => None,
        };
        let cache = Cache::new(
            o,
            n_blocks,
            origin.dest(),
            cache_dev.dest(),
            file(&origin),
            file(&cache_dev),
            r.config(),
        )?;
        Ok(Writecache {
            origin,
            cache_dev,
            cache,
        })
    }
}

/// Check the superblock, or write a fresh cache where the first block has
/// neither magic nor version (as the kernel does: zero the start to reformat).
/// Returns the number of cache blocks.
fn open_or_format(o: &Options, dev: &DevRef, dev_sectors: u64) -> Result<u64, TargetError> {
    let dest = dev.dest();
    let bs = u64::from(o.block_size);
    let area = (dev_sectors - o.start_sector) * SECTOR;
    let mut first = vec![0u8; o.block_size as usize];
    if area >= bs {
        devio::read(&dest, o.start_sector, &mut first)
            .map_err(|e| format!("Unable to read first block of metadata: {e}"))?;
    }
    let mut sb = Superblock::parse(&first)?;
    if sb.magic == 0 && sb.version == 0 {
        let n = format::blocks_for(area, bs).ok_or("Invalid device size")?;
        let mut image = format::fresh(n, o.block_size).ok_or("Invalid device size")?;
        let init = |e: std::io::Error| format!("Unable to initialize device: {e}");
        devio::write(&dest, o.start_sector, &image, false).map_err(init)?;
        devio::flush(&dest).map_err(init)?;
        sb = Superblock::parse(&image)?;
        sb.magic = format::MAGIC;
        sb.store(&mut image);
        devio::write(&dest, o.start_sector, &image[..o.block_size as usize], true).map_err(init)?;
    }
    if sb.magic != format::MAGIC {
        return Err(format!(
            "Invalid magic in the superblock (0x{:08x}, expected 0x{:08x})",
            sb.magic,
            format::MAGIC
        ).into());
    }
    if sb.version != format::VERSION {
        return Err(format!("Invalid version in the superblock ({})", sb.version).into());
    }
    if sb.block_size != o.block_size {
        return Err(format!(
            "Block size does not match superblock ({} in the table, {} on disk)",
            o.block_size, sb.block_size
        ).into());
    }
    let need = format::metadata_bytes(sb.n_blocks, bs)
        .and_then(|m| m.checked_add(sb.n_blocks.checked_mul(bs)?))
        .ok_or("Overflow in size calculation")?;
    if need > area {
        return Err(format!(
            "Memory area is too small ({} blocks need {need} bytes, the cache area has {area})",
            sb.n_blocks
        ).into());
    }
    Ok(sb.n_blocks)
}

/// The `writecache` target type.
pub const TYPE: TargetType = TargetType {
    name: "writecache",
    version: [1, 6, 0],
    new: |args, len, r| Ok(Box::new(Writecache::new(args, len, r)?)),
    sync: None,
};

impl Target for Writecache {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        let devs = Devs {
            origin: &self.origin,
            cache: &self.cache_dev,
        };
        self.cache.map(bio, ctx, devs)
    }

    fn table_params(&self) -> String {
        let o = &self.cache.o;
        let words = o.table_words();
        let mut s = format!(
            "{} {} {} {} {}",
            if o.pmem { 'p' } else { 's' },
            self.origin.table_name(),
            self.cache_dev.table_name(),
            o.block_size,
            words.len()
        );
        for w in words {
            s.push(' ');
            s.push_str(&w);
        }
        s
    }

    fn status_params(&self) -> String {
        self.cache.status()
    }

    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        let w: Vec<String> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
        match w.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
            ["flush"] => self.cache.flush_message().map(|()| String::new()),
            ["flush_on_suspend"] => {
                self.cache.set_flush_on_suspend();
                Ok(String::new())
            }
            ["cleaner"] => {
                self.cache.set_cleaner();
                Ok(String::new())
            }
            ["clear_stats"] => {
                self.cache.clear_stats();
                Ok(String::new())
            }
            _ => Err(format!(
                "Invalid argument: unrecognised message received: '{}' (flush, flush_on_suspend, cleaner, clear_stats)",
                words.join(" ")
            ).into()),
        }
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.origin, &self.cache_dev]
    }

    fn replay_messages(&self) -> Vec<String> {
        self.cache.replay_messages()
    }

    fn limits(&self) -> Limits {
        let o = self.origin.limits();
        Limits {
            io_min: u64::from(self.cache.o.block_size),
            read_only: o.read_only || self.cache_dev.limits().read_only,
            ..o
        }
    }

    fn logical_block_size(&self) -> u32 {
        self.cache.o.block_size
    }

    fn presuspend(&self) {
        self.cache.presuspend();
    }

    fn postsuspend(&self) {
        self.cache.postsuspend();
    }

    fn preresume(&self) -> Result<(), TargetError> {
        self.cache.load()
    }

    fn resume(&self) {
        self.cache.start();
    }
}

impl Drop for Writecache {
    fn drop(&mut self) {
        if self.cache.is_running() {
            let _ = self.cache.persist(true);
            self.cache.stop_threads();
        }
        self.cache.remove_restart_logs();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn options_print_in_the_kernel_order() {
        let mut o = Options {
            pmem: true,
            ..Options::default()
        };
        o.parse_options(
            &words("nofua cleaner MAX_AGE 5000 start_sector 8 high_watermark 60 metadata_only"),
            1 << 20,
        )
        .unwrap();
        assert_eq!(
            o.table_words().join(" "),
            "start_sector 8 high_watermark 60 max_age 5000 cleaner nofua metadata_only"
        );
        assert_eq!(o.free_marks(1000), (1000, 1000));
    }

    #[test]
    fn bad_options_name_the_culprit() {
        let parse = |pmem: bool, s: &str| {
            let mut o = Options {
                pmem,
                ..Options::default()
            };
            o.parse_options(&words(s), 1000)
        };
        assert_eq!(
            parse(false, "high_watermark 101").unwrap_err(),
            "Invalid optional argument: 'high_watermark 101'".into()
        );
        assert!(parse(false, "fua").unwrap_err().what().contains("'fua'"));
        assert!(parse(true, "pause_writeback 10").is_err());
        assert!(parse(false, "start_sector 1000").is_err());
        assert!(parse(false, "autocommit_time 3600001").is_err());
        assert!(parse(false, "bogus").unwrap_err().what().contains("'bogus'"));
        assert_eq!(
            parse(false, "high_watermark 40 low_watermark 41").unwrap_err(),
            "High watermark must be greater than or equal to low watermark".into()
        );
        let mut o = Options::default();
        o.parse_options(&words("high_watermark 50 low_watermark 40"), 1000)
            .unwrap();
        assert_eq!(o.free_marks(1000), (500, 600));
        assert_eq!(o.autocommit_blocks(), 65536);
        assert_eq!(o.pause_ms(), 3000);
    }
}
