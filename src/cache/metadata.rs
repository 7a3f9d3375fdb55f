//! dm-cache metadata as the kernel keeps it: a superblock naming the policy
//! and its hint width, the mapping array (cache block -> origin block and
//! flags), the hint array (the policy's 4 bytes per cache block), the discard
//! bitset (origin blocks, in discard blocks, known to be discarded) and, in
//! version 2, the dirty bitset (version 1 keeps dirty in the mapping's flags).
//! Every change is copy-on-write through the transaction manager and durable
//! at [`CacheMetadata::commit`], which also says whether the shutdown is clean.
//! The cache target builds on this; the tools read it.

use super::error::{CacheError, Result};
use super::superblock::{self as sbm, Superblock, M_DIRTY, M_VALID, SUPERBLOCK_LOCATION};
use crate::pdata::cache::BlockCache;
use crate::pdata::space_map::{SmKind, SpaceMap, MAX_METADATA_BLOCKS};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{array, bitset, bounds, sm_disk, BlockKind, MetadataDev, PdataError};

/// Metadata block cache of a cache device: 16 MiB.
pub const CACHE_BLOCKS: usize = 4096;

/// A valid mapping: which origin block a cache block holds, and whether the
/// cache's copy is newer than the origin's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub cblock: u32,
    pub oblock: u64,
    pub dirty: bool,
}

/// The flags a mapping of this metadata's version may carry (version 2 keeps
/// dirty in a bitset).
fn known_flags(sb: &Superblock) -> u64 {
    if sb.version == 1 {
        M_VALID | M_DIRTY
    } else {
        M_VALID
    }
}

/// What is wrong with one entry of a mapping array.
fn check_entry(sb: &Superblock, cblock: u64, v: u64, dirty_bit: bool) -> Option<String> {
    let (oblock, flags) = sbm::unpack_mapping(v);
    let known = known_flags(sb);
    let dirty = dirty_bit || flags & M_DIRTY != 0;
    if flags & !known != 0 {
        Some(format!(
            "cache block {cblock}: unknown flags {flags:#x} in mapping"
        ))
    } else if flags & M_VALID == 0 && dirty {
        Some(format!(
            "cache block {cblock}: dirty bit found on an unmapped block"
        ))
    } else if flags & M_VALID == 0 && oblock != 0 {
        Some(format!(
            "cache block {cblock}: unmapped, but names origin block {oblock}"
        ))
    } else {
        None
    }
}

/// The number of origin blocks the superblock vouches for (1.x's rule: the
/// discard bitset covers the origin after a clean shutdown), if it does.
pub fn nr_origin_blocks(sb: &Superblock) -> Option<u64> {
    (sb.clean_shutdown() && sb.discard_block_size > 0 && sb.discard_nr_blocks > 0 && sb.data_block_size > 0)
        .then(|| sb.discard_block_size.saturating_mul(sb.discard_nr_blocks) / sb.data_block_size as u64)
}

/// The origin blocks seen so far: a bitset as far as `limit` bits (what a
/// cache's origin usually spans), the rare ones past it in a list.
pub(crate) struct Seen {
    bits: Vec<u64>,
    limit: u64,
    far: Vec<u64>,
}

impl Seen {
    fn new(sb: &Superblock) -> Seen {
        Seen::of(sb.cache_blocks as u64, nr_origin_blocks(sb))
    }

    /// For the mappings of `nr` cache blocks onto an origin of `origin`
    /// blocks (when known).
    pub(crate) fn of(nr: u64, origin: Option<u64>) -> Seen {
        Seen {
            bits: Vec::new(),
            limit: origin.unwrap_or(u64::MAX).min((nr * 64).max(1 << 20)),
            far: Vec::new(),
        }
    }

    /// Whether `o` was seen before.
    #[inline]
    pub(crate) fn insert(&mut self, o: u64) -> Result<bool> {
        let w = (o / 64) as usize;
        match self.bits.get_mut(w) {
            Some(word) if o < self.limit => {
                let m = 1u64 << (o % 64);
                let had = *word & m != 0;
                *word |= m;
                Ok(had)
            }
            _ => self.insert_growing(o),
        }
    }

    /// [`Seen::insert`] of an origin block past the bitset as far as it is grown.
    #[cold]
    fn insert_growing(&mut self, o: u64) -> Result<bool> {
        if o >= self.limit {
            self.far.push(o);
            return Ok(false);
        }
        let w = (o / 64) as usize;
        if w >= self.bits.len() {
            let want = (w as u64 + 1)
                .max(2 * self.bits.len() as u64)
                .min(self.limit.div_ceil(64));
            bounds::resize(&mut self.bits, 0, "origin blocks seen", want)?;
        }
        let m = 1u64 << (o % 64);
        let had = self.bits[w] & m != 0;
        self.bits[w] |= m;
        Ok(had)
    }

    /// The origin blocks named twice among the far ones.
    pub(crate) fn far_twice(&mut self) -> Vec<u64> {
        self.far.sort_unstable();
        let mut out: Vec<u64> = self
            .far
            .windows(2)
            .filter(|w| w[0] == w[1])
            .map(|w| w[0])
            .collect();
        out.dedup();
        out
    }
}

/// Entry `v` of cache block `c`: its mapping, None if unmapped, or what is
/// wrong with it (its flags, its origin block past the origin's `limit`).
#[inline]
fn accept(
    sb: &Superblock,
    limit: Option<u64>,
    dirty_words: &[u64],
    c: u64,
    v: u64,
) -> std::result::Result<Option<Mapping>, String> {
    let bit = dirty_words
        .get((c / 64) as usize)
        .is_some_and(|w| w & (1 << (c % 64)) != 0);
    // the common entries, with nothing to say: a mapping within the origin,
    // or an unmapped block with no dirty bit
    let (oblock, flags) = sbm::unpack_mapping(v);
    if flags & !known_flags(sb) == 0 && flags & M_VALID != 0 && limit.is_none_or(|n| oblock < n) {
        return Ok(Some(Mapping {
            cblock: c as u32,
            oblock,
            dirty: bit || flags & M_DIRTY != 0,
        }));
    }
    if v == 0 && !bit {
        return Ok(None);
    }
    accept_rest(sb, limit, c, v, bit).map(|()| None)
}

/// [`accept`] of the entries it has something to say about: what is wrong
/// with the entry, or nothing (an unmapped block).
#[cold]
fn accept_rest(
    sb: &Superblock,
    limit: Option<u64>,
    c: u64,
    v: u64,
    bit: bool,
) -> std::result::Result<(), String> {
    if let Some(p) = check_entry(sb, c, v, bit) {
        return Err(p);
    }
    let (oblock, flags) = sbm::unpack_mapping(v);
    match limit {
        // valid, with known flags: only its origin block can be wrong
        Some(n) if flags & M_VALID != 0 => Err(format!(
            "cache block {c}: origin block {oblock} is beyond the end of the origin ({n} blocks)"
        )),
        _ => Ok(()),
    }
}

/// The dirty bitset of the metadata `sb` describes (empty in version 1).
fn dirty_words(tm: &mut TransactionManager, sb: &Superblock) -> Result<Vec<u64>> {
    if sb.version < 2 {
        return Ok(Vec::new());
    }
    bitset::read(tm, sb.dirty_root, sb.cache_blocks as u64)
        .map_err(|e| CacheError::Plain(format!("dirty bitset: {e}")))
}

/// Visit every valid mapping of the metadata `sb` describes, in cache block
/// order, each checked: its flags, its origin block within the origin (when
/// the superblock says how big it is). Returns the problems found (at most
/// 100), and the origin blocks named by more than one cache block (`f` has
/// seen those mappings too).
pub(crate) fn walk_mappings<F: FnMut(Mapping)>(
    tm: &mut TransactionManager,
    sb: &Superblock,
    mut f: F,
) -> Result<(Vec<String>, Vec<u64>)> {
    let nr = sb.cache_blocks as u64;
    let dirty_words = dirty_words(tm, sb)?;
    let limit = nr_origin_blocks(sb);
    let mut seen = Seen::new(sb);
    let mut twice: Vec<u64> = Vec::new();
    let mut problems: Vec<String> = Vec::new();
    let mut failed: Option<CacheError> = None;
    array::walk::<u64>(tm, sb.mapping_root, nr, &mut |first, vals| {
        for (i, &v) in vals.iter().enumerate() {
            let c = first + i as u64;
            let m = match accept(sb, limit, &dirty_words, c, v) {
                Ok(Some(m)) => m,
                Ok(None) => continue,
                Err(p) => {
                    if problems.len() < 100 {
                        problems.push(p);
                    }
                    continue;
                }
            };
            match seen.insert(m.oblock) {
                Ok(true) => twice.push(m.oblock),
                Ok(false) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
            f(m);
        }
        Ok(())
    })
    .map_err(|e| CacheError::Plain(format!("mapping array: {e}")))?;
    if let Some(e) = failed {
        return Err(e);
    }
    twice.extend(seen.far_twice());
    twice.sort_unstable();
    twice.dedup();
    twice.truncate(100);
    Ok((problems, twice))
}

/// Every valid mapping of the metadata `sb` describes, in cache block order,
/// each checked: its flags, its origin block within the origin (when the
/// superblock says how big it is) and named by no other cache block. The first
/// problems found go to `errs` (at most 100), an origin block named twice with
/// both cache blocks; the mappings that passed are returned (`keep`) or only
/// checked. With `errs` None the first problem is the error.
pub fn check_mappings(
    tm: &mut TransactionManager,
    sb: &Superblock,
    errs: Option<&mut Vec<String>>,
    keep: bool,
) -> Result<Vec<Mapping>> {
    let mut out: Vec<Mapping> = Vec::new();
    let (mut problems, twice) = walk_mappings(tm, sb, |m| {
        if keep {
            out.push(m)
        }
    })?;
    let refused = refused(tm, sb, &twice, &mut problems)?;
    out.retain(|m| refused.binary_search(&m.cblock).is_err());
    match errs {
        Some(e) => e.extend(problems),
        None => {
            if let Some(p) = problems.into_iter().next() {
                return Err(PdataError::Corrupt {
                    block: sb.mapping_root,
                    what: p,
                }
                .into());
            }
        }
    }
    Ok(out)
}

/// The cache blocks refused for naming an origin block in `twice` that a
/// lower cache block names (the first keeps it), ascending; each pair said in
/// `problems` (up to 100 of them).
fn refused(
    tm: &mut TransactionManager,
    sb: &Superblock,
    twice: &[u64],
    problems: &mut Vec<String>,
) -> Result<Vec<u32>> {
    let mut refused = Vec::new();
    if twice.is_empty() {
        return Ok(refused);
    }
    let mut by: Vec<(u64, u32)> = Vec::new();
    walk_mappings(tm, sb, |m| {
        if twice.binary_search(&m.oblock).is_ok() {
            by.push((m.oblock, m.cblock));
        }
    })?;
    by.sort_unstable();
    for w in by.windows(2).filter(|w| w[0].0 == w[1].0) {
        if problems.len() < 100 {
            problems.push(format!(
                "origin block {} is mapped by cache blocks {} and {}",
                w[0].0, w[0].1, w[1].1
            ));
        }
        refused.push(w[1].1);
    }
    refused.sort_unstable();
    Ok(refused)
}

/// What a repair keeps of a mapping array, decided in a pass that holds
/// nothing per mapping (so a repair copies the mappings from one array to the
/// other a block at a time): the mappings [`check_mappings`] passes, read as
/// version 1 reads them, every one dirty, when the dirty bitset of version 2
/// cannot be read (as 1.x).
pub struct Salvage {
    sb: Superblock,
    limit: Option<u64>,
    dirty_words: Vec<u64>,
    all_dirty: bool,
    refused: Vec<u32>,
    /// Assumed clean (no pass made): the origin blocks met so far.
    seen: Option<Seen>,
}

/// An assumption of [`Salvage::assume_clean`] that the metadata broke.
#[derive(Debug)]
pub struct NotClean;

impl Salvage {
    /// Without a pass: assume no origin block is named twice, and that the
    /// dirty bitset reads. [`Salvage::take`] says when that is wrong, and
    /// whether it was is known only once every mapping has been taken
    /// ([`Salvage::held`]).
    pub fn assume_clean(tm: &mut TransactionManager, sb: &Superblock) -> Result<Salvage> {
        Ok(Salvage {
            limit: nr_origin_blocks(sb),
            dirty_words: dirty_words(tm, sb)?,
            seen: Some(Seen::new(sb)),
            sb: sb.clone(),
            all_dirty: false,
            refused: Vec::new(),
        })
    }

    /// [`Salvage::mapping`], in cache block order, checking the assumption.
    pub fn take(&mut self, c: u64, v: u64) -> std::result::Result<Option<Mapping>, NotClean> {
        let m = self.mapping(c, v);
        if let (Some(m), Some(seen)) = (m, self.seen.as_mut()) {
            if !matches!(seen.insert(m.oblock), Ok(false)) {
                return Err(NotClean);
            }
        }
        Ok(m)
    }

    /// Whether the assumption held, once every mapping was taken.
    pub fn held(&mut self) -> bool {
        self.seen.as_mut().is_none_or(|s| s.far_twice().is_empty())
    }

    pub fn plan(tm: &mut TransactionManager, sb: &Superblock) -> Result<Salvage> {
        let plan = |tm: &mut TransactionManager, sb: &Superblock| -> Result<(Vec<u64>, Vec<u32>)> {
            let (mut problems, twice) = walk_mappings(tm, sb, |_| {})?;
            let refused = refused(tm, sb, &twice, &mut problems)?;
            Ok((dirty_words(tm, sb)?, refused))
        };
        let (sb, all_dirty, (dirty_words, refused)) = match plan(tm, sb) {
            Ok(p) => (sb.clone(), false, p),
            Err(_) if sb.version >= 2 => {
                let mut v1 = sb.clone();
                v1.version = 1;
                let p = plan(tm, &v1)?;
                (v1, true, p)
            }
            Err(e) => return Err(e),
        };
        Ok(Salvage {
            limit: nr_origin_blocks(&sb),
            sb,
            dirty_words,
            all_dirty,
            refused,
            seen: None,
        })
    }

    /// What is kept of cache block `c`, whose mapping array entry is `v`.
    pub fn mapping(&self, c: u64, v: u64) -> Option<Mapping> {
        let m = accept(&self.sb, self.limit, &self.dirty_words, c, v).ok()??;
        if self.refused.binary_search(&m.cblock).is_ok() {
            return None;
        }
        Some(Mapping {
            dirty: m.dirty || self.all_dirty,
            ..m
        })
    }
}

/// Every valid mapping, checked, in cache block order (see [`check_mappings`]).
pub fn read_mappings(
    tm: &mut TransactionManager,
    sb: &Superblock,
    errs: Option<&mut Vec<String>>,
) -> Result<Vec<Mapping>> {
    check_mappings(tm, sb, errs, true)
}

/// The hint array: as many hints as it holds (none until the kernel first
/// saves them: no array at all, root 0, as the kernel formats it; else one per
/// cache block).
pub fn read_hints(tm: &mut TransactionManager, sb: &Superblock) -> Result<Vec<u32>> {
    let n = nr_hints(tm, sb)?;
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut out: Vec<u32> = bounds::zeroed_vec(sb.hint_root, "hint array entries", n)?;
    array::walk::<u32>(tm, sb.hint_root, n, &mut |first, vals| {
        let f = first as usize;
        out[f..f + vals.len()].copy_from_slice(vals);
        Ok(())
    })?;
    Ok(out)
}

/// How many hints the hint array holds (0 without one).
pub fn nr_hints(tm: &mut TransactionManager, sb: &Superblock) -> Result<u64> {
    if sb.hint_root == 0 {
        return Ok(0);
    }
    Ok(array::len::<u32>(tm, sb.hint_root, sb.cache_blocks as u64)?)
}

pub struct CacheMetadata {
    tm: TransactionManager,
    sb: Superblock,
    sim: Option<std::sync::Arc<crate::io::sim::SimDisk>>,
}

impl CacheMetadata {
    /// Write new, empty cache metadata of `version` (1 or 2) to `dev` for
    /// blocks of `block_size` sectors, as the kernel formats it: no cache
    /// blocks yet, empty arrays and bitsets, no policy and no hint array (it
    /// is made when hints are first saved).
    pub fn format(dev: Box<dyn MetadataDev>, block_size: u32, version: u32) -> Result<CacheMetadata> {
        Self::format_cached(dev, block_size, version, CACHE_BLOCKS)
    }

    /// [`CacheMetadata::format`] with a block cache of `cache_blocks` blocks
    /// (the tools that build metadata write each block once).
    pub fn format_cached(
        dev: Box<dyn MetadataDev>,
        block_size: u32,
        version: u32,
        cache_blocks: usize,
    ) -> Result<CacheMetadata> {
        if !(sbm::MIN_VERSION..=sbm::MAX_VERSION).contains(&version) {
            return Err(CacheError::Invalid(format!(
                "metadata version {version} (1 or 2)"
            )));
        }
        let cache = BlockCache::new(dev, cache_blocks);
        let nr_meta = cache.nr_blocks().min(MAX_METADATA_BLOCKS);
        if nr_meta < 8 {
            return Err(CacheError::Invalid(format!(
                "metadata device too small ({nr_meta} blocks)"
            )));
        }
        let mut meta = SpaceMap::new(SmKind::Metadata, nr_meta)?;
        meta.set(SUPERBLOCK_LOCATION, 1)?;
        let mut tm = TransactionManager::new(cache, meta, SpaceMap::empty(SmKind::Data));
        sm_disk::create_trees(&mut tm, SmKind::Metadata)?;
        let mut sb = Superblock::new(block_size, version);
        sb.mapping_root = array::empty(&mut tm)?;
        sb.hint_root = 0;
        sb.discard_root = bitset::new(&mut tm, 0)?;
        if version >= 2 {
            sb.dirty_root = bitset::new(&mut tm, 0)?;
        }
        let mut md = CacheMetadata::with(tm, sb);
        md.commit(false)?;
        Ok(md)
    }

    /// Open existing metadata: the superblock is checked against the device,
    /// and the arrays' shapes against the superblock.
    pub fn open(dev: Box<dyn MetadataDev>) -> Result<CacheMetadata> {
        let mut cache = BlockCache::new(dev, CACHE_BLOCKS);
        let sb = sbm::read(&mut cache, SUPERBLOCK_LOCATION)?;
        let mut tm = sm_disk::open_tm(cache, &sb.sm_root)?;
        let nr = sb.cache_blocks as u64;
        array::blocks::<u64>(&mut tm, sb.mapping_root, nr)?;
        if sb.version >= 2 {
            array::blocks::<u64>(&mut tm, sb.dirty_root, bitset::nr_words(nr))?;
        }
        array::blocks::<u64>(&mut tm, sb.discard_root, bitset::nr_words(sb.discard_nr_blocks))?;
        nr_hints(&mut tm, &sb)?;
        Ok(CacheMetadata::with(tm, sb))
    }

    /// Open `dev`, or format it (`version`) when its superblock is all zeroes;
    /// the data block size must be the one the metadata has.
    pub fn open_or_format(
        mut dev: Box<dyn MetadataDev>,
        block_size: u32,
        version: u32,
    ) -> Result<CacheMetadata> {
        if crate::pdata::unformatted(dev.as_mut(), SUPERBLOCK_LOCATION)? {
            return CacheMetadata::format(dev, block_size, version);
        }
        let md = CacheMetadata::open(dev)?;
        if md.sb.data_block_size != block_size {
            return Err(CacheError::Invalid(format!(
                "changing the data block size (from {} to {block_size}) is not supported",
                md.sb.data_block_size
            )));
        }
        Ok(md)
    }

    fn with(tm: TransactionManager, sb: Superblock) -> CacheMetadata {
        let sim = tm.cache.sim();
        CacheMetadata { tm, sb, sim }
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }
    pub fn nr_cache_blocks(&self) -> u64 {
        self.sb.cache_blocks as u64
    }

    fn cblock_ok(&self, cblock: u64) -> Result<()> {
        if cblock >= self.nr_cache_blocks() {
            return Err(CacheError::Invalid(format!(
                "cache block {cblock} is beyond the {} cache blocks",
                self.sb.cache_blocks
            )));
        }
        Ok(())
    }

    /// The cache device now has `nr` blocks: the mapping array and the dirty
    /// bitset follow (new blocks unmapped and clean). Shrinking past a mapped
    /// block is refused, as the kernel refuses it.
    pub fn resize(&mut self, nr: u64) -> Result<()> {
        let old = self.nr_cache_blocks();
        if nr > sbm::max_cache_blocks(self.tm.cache.nr_blocks()) {
            return Err(CacheError::Invalid(format!(
                "{nr} cache blocks are more than a mapping array on the metadata device can hold"
            )));
        }
        for c in nr..old {
            if self.lookup(c)?.is_some() {
                return Err(CacheError::Invalid(format!(
                    "unable to shrink cache: cache block {c} is in use"
                )));
            }
        }
        self.sb.mapping_root = array::resize(&mut self.tm, self.sb.mapping_root, old, nr, 0u64)?;
        if self.sb.version >= 2 {
            self.sb.dirty_root = bitset::resize(&mut self.tm, self.sb.dirty_root, old, nr, false)?;
        }
        let hints = nr_hints(&mut self.tm, &self.sb)?;
        if hints > nr {
            self.sb.hint_root = array::resize(&mut self.tm, self.sb.hint_root, hints, nr, 0u32)?;
        }
        self.sb.cache_blocks = nr as u32;
        Ok(())
    }

    /// The mapping of `cblock`, if it is mapped.
    pub fn lookup(&mut self, cblock: u64) -> Result<Option<Mapping>> {
        self.cblock_ok(cblock)?;
        let (oblock, flags) =
            sbm::unpack_mapping(array::get::<u64>(&mut self.tm, self.sb.mapping_root, cblock)?);
        if flags & M_VALID == 0 {
            return Ok(None);
        }
        let dirty = if self.sb.version >= 2 {
            bitset::test(&mut self.tm, self.sb.dirty_root, cblock)?
        } else {
            flags & M_DIRTY != 0
        };
        Ok(Some(Mapping {
            cblock: cblock as u32,
            oblock,
            dirty,
        }))
    }

    /// Map `cblock` to `oblock`, clean.
    pub fn insert(&mut self, cblock: u64, oblock: u64) -> Result<()> {
        self.cblock_ok(cblock)?;
        if oblock >= sbm::MAX_ORIGIN_BLOCKS {
            return Err(CacheError::Invalid(format!(
                "origin block {oblock} does not fit a mapping"
            )));
        }
        self.sb.mapping_root = array::set(
            &mut self.tm,
            self.sb.mapping_root,
            cblock,
            sbm::pack_mapping(oblock, M_VALID),
        )?;
        if self.sb.version >= 2 {
            self.set_dirty_bit(cblock, false)?;
        }
        Ok(())
    }

    /// Unmap `cblock` (and clear its dirty bit).
    pub fn remove(&mut self, cblock: u64) -> Result<()> {
        self.cblock_ok(cblock)?;
        self.sb.mapping_root = array::set(&mut self.tm, self.sb.mapping_root, cblock, 0u64)?;
        if self.sb.version >= 2 {
            self.set_dirty_bit(cblock, false)?;
        }
        Ok(())
    }

    fn set_dirty_bit(&mut self, cblock: u64, dirty: bool) -> Result<()> {
        let root = self.sb.dirty_root;
        let w: u64 = array::get(&mut self.tm, root, cblock / 64)?;
        let m = 1u64 << (cblock % 64);
        let nw = if dirty { w | m } else { w & !m };
        if nw != w {
            self.sb.dirty_root = array::set(&mut self.tm, root, cblock / 64, nw)?;
        }
        Ok(())
    }

    /// Mark mapped `cblock` dirty or clean.
    pub fn set_dirty(&mut self, cblock: u64, dirty: bool) -> Result<()> {
        let Some(m) = self.lookup(cblock)? else {
            return Err(CacheError::Invalid(format!("cache block {cblock} is not mapped")));
        };
        if self.sb.version >= 2 {
            return self.set_dirty_bit(cblock, dirty);
        }
        let flags = if dirty { M_VALID | M_DIRTY } else { M_VALID };
        self.sb.mapping_root = array::set(
            &mut self.tm,
            self.sb.mapping_root,
            cblock,
            sbm::pack_mapping(m.oblock, flags),
        )?;
        Ok(())
    }

    /// Every valid mapping, checked (see [`read_mappings`]).
    pub fn mappings(&mut self) -> Result<Vec<Mapping>> {
        read_mappings(&mut self.tm, &self.sb, None)
    }

    /// The valid mappings `keep` selects, once all of them are checked (only
    /// the selected ones are held).
    pub fn select(&mut self, keep: &mut dyn FnMut(&Mapping) -> bool) -> Result<Vec<Mapping>> {
        check_mappings(&mut self.tm, &self.sb, None, false)?;
        let mut out = Vec::new();
        walk_mappings(&mut self.tm, &self.sb, |m| {
            if keep(&m) {
                out.push(m)
            }
        })?;
        Ok(out)
    }

    /// The saved hints (empty until saved).
    pub fn hints(&mut self) -> Result<Vec<u32>> {
        read_hints(&mut self.tm, &self.sb)
    }

    /// Save the policy's name, version and hints (one per cache block, or none
    /// for a policy without hints), as the kernel does at a clean shutdown.
    pub fn save_hints(&mut self, policy: &str, version: [u32; 3], hints: Option<&[u32]>) -> Result<()> {
        self.sb.set_policy(policy)?;
        self.sb.policy_version = version;
        let Some(hints) = hints else {
            self.sb.policy_hint_size = 0;
            return Ok(());
        };
        self.sb.policy_hint_size = sbm::HINT_SIZE;
        let nr = self.nr_cache_blocks();
        if hints.len() as u64 != nr {
            return Err(CacheError::Invalid(format!(
                "{} hints for {nr} cache blocks",
                hints.len()
            )));
        }
        if self.sb.hint_root != 0 {
            array::del(&mut self.tm, self.sb.hint_root)?;
        }
        self.sb.hint_root = array::build(&mut self.tm, nr, hints)?;
        Ok(())
    }

    /// The discard bitset now covers `nr` discard blocks of `block_size`
    /// sectors (new ones not discarded; a new block size starts afresh).
    pub fn resize_discards(&mut self, block_size: u64, nr: u64) -> Result<()> {
        if nr > sbm::max_bits(self.tm.cache.nr_blocks()) {
            return Err(CacheError::Invalid(format!(
                "{nr} discard blocks are more than a bitset on the metadata device can hold"
            )));
        }
        let old = if block_size == self.sb.discard_block_size {
            self.sb.discard_nr_blocks
        } else {
            bitset::del(&mut self.tm, self.sb.discard_root)?;
            self.sb.discard_root = bitset::new(&mut self.tm, 0)?;
            0
        };
        self.sb.discard_root = bitset::resize(&mut self.tm, self.sb.discard_root, old, nr, false)?;
        self.sb.discard_block_size = block_size;
        self.sb.discard_nr_blocks = nr;
        Ok(())
    }

    pub fn set_discard(&mut self, dblock: u64, discarded: bool) -> Result<()> {
        if dblock >= self.sb.discard_nr_blocks {
            return Err(CacheError::Invalid(format!(
                "discard block {dblock} is beyond the {} discard blocks",
                self.sb.discard_nr_blocks
            )));
        }
        let root = self.sb.discard_root;
        let w: u64 = array::get(&mut self.tm, root, dblock / 64)?;
        let m = 1u64 << (dblock % 64);
        let nw = if discarded { w | m } else { w & !m };
        if nw != w {
            self.sb.discard_root = array::set(&mut self.tm, root, dblock / 64, nw)?;
        }
        Ok(())
    }

    pub fn discarded(&mut self, dblock: u64) -> Result<bool> {
        if dblock >= self.sb.discard_nr_blocks {
            return Ok(false);
        }
        Ok(bitset::test(&mut self.tm, self.sb.discard_root, dblock)?)
    }

    /// The statistics the superblock keeps (read hits, read misses, write
    /// hits, write misses).
    pub fn set_stats(&mut self, stats: [u32; 4]) {
        [
            self.sb.read_hits,
            self.sb.read_misses,
            self.sb.write_hits,
            self.sb.write_misses,
        ] = stats;
    }

    /// Make everything since the last commit durable: the space map, every
    /// dirty block, a flush, then the superblock (with the clean-shutdown
    /// flag as `clean_shutdown` says) and a flush.
    pub fn commit(&mut self, clean_shutdown: bool) -> Result<()> {
        let _window = crate::io::sim::commit_window(self.sim.as_ref());
        let (meta_root, _) = sm_disk::commit(&mut self.tm)?;
        self.sb.sm_root = meta_root;
        if clean_shutdown {
            self.sb.flags |= sbm::CLEAN_SHUTDOWN;
        } else {
            self.sb.flags &= !sbm::CLEAN_SHUTDOWN;
        }
        self.tm.cache.write_dirty()?;
        if !self.sim.as_ref().is_some_and(|d| d.broken_commit_order()) {
            self.tm.cache.flush()?;
        }
        let mut image = self.sb.clone();
        image.blocknr = SUPERBLOCK_LOCATION;
        self.tm
            .cache
            .write_through(SUPERBLOCK_LOCATION, BlockKind::CacheSuperblock, &image.encode())?;
        self.tm.cache.flush()?;
        self.tm.transaction_committed();
        Ok(())
    }

    /// Free metadata blocks that nothing references (their counts set to
    /// zero; the caller found them leaked), clear the needs_check flag if
    /// asked, and commit, the clean-shutdown flag kept as it was.
    pub fn free_leaked(&mut self, leaked: &[u64], clear_needs_check: bool) -> Result<()> {
        for &b in leaked {
            self.tm.sm(SmKind::Metadata).set(b, 0)?;
        }
        if clear_needs_check {
            self.sb.flags &= !sbm::NEEDS_CHECK;
        }
        let clean = self.sb.flags & sbm::CLEAN_SHUTDOWN != 0;
        self.commit(clean)
    }

    /// Metadata blocks the device holds (as many as a space map can track).
    pub fn nr_metadata_blocks(&self) -> u64 {
        self.tm.cache.nr_blocks().min(MAX_METADATA_BLOCKS)
    }

    /// Metadata blocks allocated.
    pub fn nr_allocated(&self) -> u64 {
        self.tm.meta.nr_allocated()
    }

    /// The transaction manager and superblock, for the tools' builders.
    pub(crate) fn parts(&mut self) -> (&mut TransactionManager, &mut Superblock) {
        (&mut self.tm, &mut self.sb)
    }
}
