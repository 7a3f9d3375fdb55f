//! `cache <metadata dev> <cache dev> <origin dev> <block size> <#feature args>
//! [<feature arg>]* <policy> <#policy args> [<policy arg>]*`: dm-cache, the
//! target under lvmcache, over the kernel's metadata (`crate::cache`).
//!
//! A fast cache device holds copies of an origin's blocks; the policy
//! (`smq`, `mq` and `default` its aliases, or `cleaner`; see [`policy`])
//! decides which are promoted, demoted and written back, and the target does
//! it through the copier while I/O to a block being migrated waits (see
//! [`core`]). Writes go to the cache only (`writeback`, the default), to both
//! (`writethrough`), or to the origin only, invalidating what was cached
//! (`passthrough`).

mod core;
pub mod policy;

use crate::mapper::TargetError;
use self::core::{Core, IoMode, Shared};
use crate::cache::superblock::{max_cache_blocks, METADATA_BLOCK_SECTORS};
use crate::cache::CacheMetadata;
use crate::io::{errno, Op};
use crate::mapper::{Bio, DevRef, Limits, MapCtx, MapErr, Resolver, Target, TargetType};
use crate::pdata::space_map::MAX_METADATA_BLOCKS;
use std::sync::Arc;

/// The `cache` target type (Linux 6.12's dm-cache: v2.3.0, as its `dmsetup targets` says).
pub const TYPE: TargetType = TargetType {
    name: "cache",
    version: [2, 3, 0],
    new: |args, len, r| Ok(Box::new(Cache::new(args, len, r)?)),
    sync: None,
};

/// Cache blocks are 32 KiB to 1 GiB, in multiples of 32 KiB.
const MIN_BLOCK_SECTORS: u64 = 64;
const MAX_BLOCK_SECTORS: u64 = 2 * 1024 * 1024;
/// The kernel's DEFAULT_MIGRATION_THRESHOLD (sectors).
const DEFAULT_MIGRATION_THRESHOLD: u64 = 2048;

/// The features a table asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features {
    pub mode: IoMode,
    pub metadata_version: u32,
    pub discard_passdown: bool,
}

/// Parse `<#feature args> [<feature arg>]*` at `args[i..]`: the features and
/// the index after them.
fn parse_features(args: &[String], i: usize) -> Result<(Features, usize), TargetError> {
    let bad_count = "Invalid number of cache feature arguments";
    let n: usize = args
        .get(i)
        .and_then(|a| a.parse().ok())
        .filter(|&n| n <= 3 && n < args.len() - i)
        .ok_or(bad_count)?;
    let mut f = Features {
        mode: IoMode::Writeback,
        metadata_version: 1,
        discard_passdown: true,
    };
    let mut modes = 0;
    for a in &args[i + 1..i + 1 + n] {
        match a.to_ascii_lowercase().as_str() {
            "writeback" => {
                f.mode = IoMode::Writeback;
                modes += 1;
            }
            "writethrough" => {
                f.mode = IoMode::Writethrough;
                modes += 1;
            }
            "passthrough" => {
                f.mode = IoMode::Passthrough;
                modes += 1;
            }
            "metadata2" => f.metadata_version = 2,
            "no_discard_passdown" => f.discard_passdown = false,
            _ => return Err("Unrecognised cache feature requested".into()),
        }
    }
    if modes > 1 {
        return Err("Duplicate cache io_mode features requested".into());
    }
    Ok((f, i + 1 + n))
}

/// The features as the status prints them: `<#features> <features>*`.
fn emit_features(f: &Features) -> String {
    let mut w = vec![];
    if f.metadata_version == 2 {
        w.push("metadata2");
    }
    w.push(match f.mode {
        IoMode::Writeback => "writeback",
        IoMode::Writethrough => "writethrough",
        IoMode::Passthrough => "passthrough",
    });
    if !f.discard_passdown {
        w.push("no_discard_passdown");
    }
    format!("{} {}", w.len(), w.join(" "))
}

pub struct Cache {
    metadata: DevRef,
    cache_dev: DevRef,
    origin: DevRef,
    /// The table arguments after the three devices, as given.
    rest: Vec<String>,
    st: Arc<Shared>,
}

/// The metadata on a file, or on another dmkit device (LVM's `_cmeta`, read and
/// written through its table).
fn open_metadata(dev: &DevRef, block_size: u32, version: u32) -> Result<CacheMetadata, TargetError> {
    let d = crate::mapper::devio::metadata_dev(&dev.dest()).map_err(|e| e.to_string())?;
    CacheMetadata::open_or_format(d, block_size, version).map_err(|e| TargetError::invalid(e.to_string()))
}

impl Cache {
    pub fn new(args: &[String], len: u64, r: &dyn Resolver) -> Result<Cache, TargetError> {
        let arg = |i: usize| args.get(i).ok_or_else(|| "Insufficient args".to_string());
        let metadata = r
            .open(arg(0)?)
            .map_err(|e| format!("Error opening metadata device: {e}"))?;
        let cache_dev = r
            .open(arg(1)?)
            .map_err(|e| format!("Error opening cache device: {e}"))?;
        let cache_sectors = cache_dev.size_sectors();
        let origin = r
            .open(arg(2)?)
            .map_err(|e| format!("Error opening origin device: {e}"))?;
        if let DevRef::Dm(o) = &origin {
            // checked at resume, as the kernel's device areas (LVM loads the
            // cache before its `_corig` is resumed)
            r.size_check(&o.0, arg(2)?, len);
        } else if len > origin.size_sectors() {
            return Err("Device size larger than cached device".into());
        }
        let bs: u64 = arg(3)?
            .parse()
            .ok()
            .filter(|&b: &u64| {
                (MIN_BLOCK_SECTORS..=MAX_BLOCK_SECTORS).contains(&b) && b.is_multiple_of(MIN_BLOCK_SECTORS)
            })
            .ok_or("Invalid data block size")?;
        if bs > cache_sectors {
            return Err("Data block size is larger than the cache device".into());
        }
        let (features, i) = parse_features(args, 4)?;
        let policy_name = arg(i)?.clone();
        let np: usize = args
            .get(i + 1)
            .and_then(|a| a.parse().ok())
            .filter(|&n| n <= 1024 && n <= args.len() - i - 2)
            .ok_or("Invalid number of policy arguments")?;
        let policy_args = &args[i + 2..i + 2 + np];

        // what the metadata device can map bounds what is allocated for it
        let nr_cache = cache_sectors / bs;
        let meta_blocks = (metadata.size_sectors() / u64::from(METADATA_BLOCK_SECTORS)).min(MAX_METADATA_BLOCKS);
        if nr_cache > max_cache_blocks(meta_blocks) || nr_cache > u64::from(u32::MAX) {
            return Err(format!(
                "Error creating metadata object: {nr_cache} cache blocks are more than the metadata device ({meta_blocks} blocks) can map"
            ).into());
        }
        let mut policy = policy::create(&policy_name, nr_cache as u32, len, bs)
            .map_err(|e| format!("Error creating cache's policy: {e}"))?;
        let mut threshold = DEFAULT_MIGRATION_THRESHOLD;
        if np % 2 == 1 {
            tracing::warn!("Odd number of policy arguments given but they should be <key> <value> pairs.");
            return Err("Error setting cache policy's config values".into());
        }
        for kv in policy_args.chunks(2) {
            set_config_value(&mut threshold, policy.as_mut(), &kv[0], &kv[1])
                .map_err(|e| format!("Error setting cache policy's config values: {e}"))?;
        }

        let mut md = open_metadata(&metadata, bs as u32, features.metadata_version)
            .map_err(|e| format!("Error creating metadata object: {e}"))?;
        if features.mode == IoMode::Passthrough {
            let dirty = md
                .select(&mut |m| m.dirty)
                .map_err(|e| format!("dm_cache_metadata_all_clean() failed: {e}"))?;
            if !dirty.is_empty() {
                return Err("Cannot enter passthrough mode unless all blocks are clean".into());
            }
            policy.allow_migrations(false);
        }
        drop(md);
        let core = Core::new(policy, nr_cache as u32, len, bs)?;
        let st = Shared::new(
            core,
            features,
            bs,
            len / bs,
            threshold,
            origin.dest(),
            cache_dev.dest(),
        )?;
        Ok(Cache {
            metadata,
            cache_dev,
            origin,
            rest: args[3..].to_vec(),
            st,
        })
    }
}

/// A `<key> <value>` of the table or a message: the core's
/// `migration_threshold`, else the policy's.
fn set_config_value(threshold: &mut u64, p: &mut dyn policy::Policy, key: &str, value: &str) -> Result<(), TargetError> {
    let bad = || {
        tracing::warn!("bad config value for {key}: {value}");
        format!("bad config value for {key}: {value}")
    };
    if key.eq_ignore_ascii_case("migration_threshold") {
        *threshold = value.parse().map_err(|_| bad())?;
        return Ok(());
    }
    if p.set_config(key, value) {
        Ok(())
    } else {
        Err(bad().into())
    }
}

/// `<begin>` or `<begin>-<end>`: the cache blocks [begin, end).
fn parse_cblock_range(s: &str) -> Option<(u64, u64)> {
    if let Some((a, b)) = s.split_once('-') {
        return Some((a.parse().ok()?, b.parse().ok()?));
    }
    let b: u64 = s.parse().ok()?;
    Some((b, b.checked_add(1)?))
}

impl Target for Cache {
    fn type_name(&self) -> &'static str {
        TYPE.name
    }

    fn map(&self, bio: Bio, ctx: &mut MapCtx) -> Result<(), MapErr> {
        match bio.op {
            Op::Flush => {
                ctx.remap(&self.origin, bio, 0)?;
                ctx.remap(&self.cache_dev, bio, 0)
            }
            Op::Discard => {
                self.st.discard(&bio);
                if self.st.features.discard_passdown {
                    ctx.remap(&self.origin, bio, 0)
                } else {
                    ctx.complete(bio, crate::io::LeafKind::Drop);
                    Ok(())
                }
            }
            Op::WriteZeroes => Err(MapErr::Errno(errno::EOPNOTSUPP)),
            Op::Read | Op::Write => self.st.map_io(bio, ctx, &self.origin, &self.cache_dev),
        }
    }

    fn table_params(&self) -> String {
        let mut s = format!(
            "{} {} {}",
            self.metadata.table_name(),
            self.cache_dev.table_name(),
            self.origin.table_name()
        );
        for a in &self.rest {
            s.push(' ');
            s.push_str(a);
        }
        s
    }

    fn status_params(&self) -> String {
        let Some((used, total)) = self.st.metadata_usage() else {
            return "Fail".into();
        };
        let c = self.st.counters();
        format!(
            "{METADATA_BLOCK_SECTORS} {used}/{total} {} {}/{} {} {} {} {} {} {} {} {} 2 migration_threshold {} {} {} {} {} ",
            self.st.bs,
            c.residency,
            c.nr_cache,
            c.read_hit,
            c.read_miss,
            c.write_hit,
            c.write_miss,
            c.demotion,
            c.promotion,
            c.nr_dirty,
            emit_features(&self.st.features),
            self.st.migration_threshold(),
            c.policy_name,
            c.policy_config,
            // the kernel's metadata mode: ro once writes fail
            if c.read_only { "ro" } else { "rw" },
            if c.needs_check { "needs_check" } else { "-" },
        )
    }

    fn message(&self, words: &[String]) -> Result<String, TargetError> {
        let Some(first) = words.first() else {
            return Err("Invalid argument".into());
        };
        if first.eq_ignore_ascii_case("invalidate_cblocks") {
            if self.st.features.mode != IoMode::Passthrough {
                return Err("cache has to be in passthrough mode for invalidation".into());
            }
            let nr = self.st.counters().nr_cache;
            for w in &words[1..] {
                let (b, e) = parse_cblock_range(w).ok_or_else(|| format!("invalid cblock range '{w}'"))?;
                if b >= nr {
                    return Err(format!("begin cblock out of range: {b} >= {nr}").into());
                }
                if e > nr {
                    return Err(format!("end cblock out of range: {e} > {nr}").into());
                }
                if b >= e {
                    return Err(format!("invalid cblock range: {b} >= {e}").into());
                }
                self.st.invalidate_cblocks(b as u32..e as u32)?;
            }
            return Ok(String::new());
        }
        if words.len() != 2 {
            return Err("Invalid argument".into());
        }
        self.st.set_config(&words[0], &words[1])?;
        Ok(String::new())
    }

    fn devices(&self) -> Vec<&DevRef> {
        vec![&self.cache_dev, &self.origin]
    }

    fn held_devices(&self) -> Vec<&DevRef> {
        vec![&self.metadata, &self.cache_dev, &self.origin]
    }

    fn max_io_len(&self) -> u64 {
        self.st.bs
    }

    fn limits(&self) -> Limits {
        let l = Limits::stacked(&self.devices());
        let bs = self.st.bs * 512;
        let l = if l.io_opt < bs || !l.io_opt.is_multiple_of(bs) {
            Limits {
                io_min: bs,
                io_opt: bs,
                ..l
            }
        } else {
            l
        };
        Limits {
            // discards are the cache's own (passed down, or only recorded)
            discard: true,
            write_zeroes: false,
            ..l
        }
    }

    fn preresume(&self) -> Result<(), TargetError> {
        let f = &self.st.features;
        self.st.preresume(|| open_metadata(&self.metadata, self.st.bs as u32, f.metadata_version), &self.cache_dev)
    }

    fn postsuspend(&self) {
        self.st.postsuspend();
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        self.st.shut_down();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn features_parse_and_print_as_the_kernel() {
        let (f, i) = parse_features(&words("x 3 Metadata2 writethrough no_discard_passdown smq 0"), 1).unwrap();
        assert_eq!(i, 5);
        assert_eq!(
            f,
            Features {
                mode: IoMode::Writethrough,
                metadata_version: 2,
                discard_passdown: false
            }
        );
        assert_eq!(emit_features(&f), "3 metadata2 writethrough no_discard_passdown");
        let (f, _) = parse_features(&words("0"), 0).unwrap();
        assert_eq!(emit_features(&f), "1 writeback");
        for (s, e) in [
            ("4 a b c d", "Invalid number of cache feature arguments"),
            ("2 writeback", "Invalid number of cache feature arguments"),
            ("x", "Invalid number of cache feature arguments"),
            ("1 writearound", "Unrecognised cache feature requested"),
            ("2 writeback passthrough", "Duplicate cache io_mode features requested"),
        ] {
            assert_eq!(parse_features(&words(s), 0).unwrap_err(), e.into(), "{s}");
        }
    }

    #[test]
    fn cblock_ranges() {
        assert_eq!(parse_cblock_range("5"), Some((5, 6)));
        assert_eq!(parse_cblock_range("3-9"), Some((3, 9)));
        assert_eq!(parse_cblock_range("3-"), None);
        assert_eq!(parse_cblock_range("x"), None);
    }
}
