//! Reference-counting space maps (metadata and data), kept in core as one
//! byte per block plus a side table for large counts, and written back to the
//! kernel's on-disk form (2-bit bitmaps, index, overflow btree) at commit
//! (by `sm_disk`).
//!
//! Allocation follows the kernel's rule: a block is handed out only if it is
//! free now *and* was free in the last committed state, so a transaction never
//! overwrites anything a crash could need.

use super::bounds;
use super::cache::FastMap;
use super::error::{PdataError, Result};

/// Entries per on-disk bitmap block: (4096 - 16) * 4.
pub const ENTRIES_PER_BITMAP: u64 = 16320;
/// The metadata space map's index block has room for 255 bitmaps.
pub const MAX_METADATA_BITMAPS: u64 = 255;
pub const MAX_METADATA_BLOCKS: u64 = MAX_METADATA_BITMAPS * ENTRIES_PER_BITMAP;

const BIG: u8 = u8::MAX;

/// Changed overflow entries beyond which the overflow tree is rebuilt at commit.
const OVERFLOW_REBUILD: usize = 1 << 14;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SmKind {
    Metadata,
    Data,
}

/// Data blocks a mapping can name (40 bits of its value).
pub const MAX_DATA_BLOCKS: u64 = 1 << 40;

impl SmKind {
    /// The superblock field holding this space map's size, as errors name it.
    pub fn nr_blocks_field(self) -> &'static str {
        match self {
            SmKind::Metadata => "metadata space map nr_blocks",
            SmKind::Data => "data space map nr_blocks",
        }
    }
    /// The most blocks the on-disk format lets this space map describe.
    pub fn max_blocks(self) -> u64 {
        match self {
            SmKind::Metadata => MAX_METADATA_BLOCKS,
            SmKind::Data => MAX_DATA_BLOCKS,
        }
    }
    pub(crate) fn max_blocks_why(self) -> &'static str {
        match self {
            SmKind::Metadata => "the 255 bitmaps of the metadata index block describe",
            SmKind::Data => "a mapping's 40-bit block number can address",
        }
    }
}

/// Blocks (or bitmaps) changed in this transaction: a hash set, for an insert that
/// costs the same however many there are (a restore sharing leaves changes the
/// counts of tens of thousands of blocks, again and again), sorted when written.
#[derive(Clone, Debug, Default)]
pub(crate) struct DirtySet(FastMap<u64, ()>);

impl DirtySet {
    pub(crate) fn insert(&mut self, b: u64) {
        self.0.insert(b, ());
    }
    #[cfg(test)]
    pub(crate) fn contains(&self, b: &u64) -> bool {
        self.0.contains_key(b)
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
    pub(crate) fn extend(&mut self, it: impl IntoIterator<Item = u64>) {
        self.0.extend(it.into_iter().map(|b| (b, ())));
    }
    /// The members, ascending.
    pub(crate) fn sorted(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.0.keys().copied().collect();
        v.sort_unstable();
        v
    }
    /// The members, ascending, leaving the set empty.
    pub(crate) fn take_sorted(&mut self) -> Vec<u64> {
        let v = self.sorted();
        self.0.clear();
        v
    }
}

impl FromIterator<u64> for DirtySet {
    fn from_iter<I: IntoIterator<Item = u64>>(it: I) -> DirtySet {
        let mut s = DirtySet::default();
        s.extend(it);
        s
    }
}

pub struct SpaceMap {
    pub kind: SmKind,
    nr_blocks: u64,
    pub(crate) counts: Vec<u8>,
    /// Counts >= 255 (the byte then holds `BIG`).
    big: FastMap<u64, u32>,
    pub(crate) nr_allocated: u64,
    /// Bit per block: its in-use state flipped an odd number of times in
    /// this transaction, so `in use now != in use at the last commit`. All
    /// zero after a load or commit, which is why opening scans nothing.
    toggled: Vec<u64>,
    /// Blocks whose `toggled` bit may be set (to clear at commit).
    flipped: Vec<u64>,
    cursor: u64,
    /// Bitmaps whose 2-bit encoding changed since the last commit.
    pub(crate) dirty_bitmaps: DirtySet,
    /// Blocks whose overflow-tree entry (count >= 3) may have changed.
    pub(crate) overflow_changed: DirtySet,
    /// So many counts of 3 or more changed that the overflow tree is rebuilt at
    /// commit from the counts, instead of updated entry by entry.
    pub(crate) overflow_rebuild: bool,
    /// On-disk location of each bitmap; 0 = not yet allocated.
    pub(crate) bitmap_locs: Vec<u64>,
    /// (nr_free, none_free_before) as last written for each bitmap.
    pub(crate) bitmap_info: Vec<(u32, u32)>,
    /// Index block (metadata sm) or index btree root (data sm).
    pub(crate) index_root: u64,
    pub(crate) ref_count_root: u64,
    /// Free blocks held back from allocation (with how many holds each), in
    /// memory only: the user's I/O to them has not finished yet (a thin
    /// discard's passdown). Never written: a restart finds them free.
    held: FastMap<u64, u32>,
}

impl SpaceMap {
    /// A space map of no blocks (a reader's, or one about to be loaded).
    pub fn empty(kind: SmKind) -> SpaceMap {
        SpaceMap {
            kind,
            nr_blocks: 0,
            counts: Vec::new(),
            big: FastMap::default(),
            nr_allocated: 0,
            toggled: Vec::new(),
            flipped: Vec::new(),
            cursor: 0,
            dirty_bitmaps: DirtySet::default(),
            overflow_changed: DirtySet::default(),
            overflow_rebuild: false,
            bitmap_locs: Vec::new(),
            bitmap_info: Vec::new(),
            index_root: 0,
            ref_count_root: 0,
            held: FastMap::default(),
        }
    }

    /// An empty space map of `nr_blocks` (the superblock's sm root field, or a
    /// size to format with), refused if the format cannot describe it or memory
    /// cannot hold it.
    pub fn new(kind: SmKind, nr_blocks: u64) -> Result<SpaceMap> {
        let field = kind.nr_blocks_field();
        bounds::field(0, field, nr_blocks, kind.max_blocks(), kind.max_blocks_why())?;
        let nr_bitmaps = nr_blocks.div_ceil(ENTRIES_PER_BITMAP);
        Ok(SpaceMap {
            kind,
            nr_blocks,
            counts: bounds::zeroed_vec(0, field, nr_blocks)?,
            big: FastMap::default(),
            nr_allocated: 0,
            toggled: bounds::zeroed_vec(0, field, nr_blocks.div_ceil(64))?,
            flipped: Vec::new(),
            cursor: 0,
            dirty_bitmaps: (0..nr_bitmaps).collect(),
            overflow_changed: DirtySet::default(),
            overflow_rebuild: false,
            bitmap_locs: bounds::zeroed_vec(0, field, nr_bitmaps)?,
            bitmap_info: bounds::zeroed_vec(0, field, nr_bitmaps)?,
            index_root: 0,
            ref_count_root: 0,
            held: FastMap::default(),
        })
    }

    pub fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }
    pub fn nr_allocated(&self) -> u64 {
        self.nr_allocated
    }
    /// Blocks free and not held (what `alloc` can still hand out, committed or not).
    pub fn nr_free(&self) -> u64 {
        (self.nr_blocks - self.nr_allocated).saturating_sub(self.held.len() as u64)
    }
    pub fn nr_bitmaps(&self) -> u64 {
        self.bitmap_locs.len() as u64
    }

    fn range_err(&self, b: u64) -> PdataError {
        PdataError::Invalid(format!(
            "{:?} space map: block {b} is beyond its {} blocks",
            self.kind, self.nr_blocks
        ))
    }

    pub fn count(&self, b: u64) -> u32 {
        match self.counts.get(b as usize) {
            None => 0,
            Some(&BIG) => self.big.get(&b).copied().unwrap_or(BIG as u32),
            Some(&c) => c as u32,
        }
    }

    /// Set a count, keeping every derived piece of state in step.
    pub fn set(&mut self, b: u64, new: u32) -> Result<()> {
        if b >= self.nr_blocks {
            return Err(self.range_err(b));
        }
        let old = self.count(b);
        if old == new {
            return Ok(());
        }
        if new >= BIG as u32 {
            self.counts[b as usize] = BIG;
            self.big.insert(b, new);
        } else {
            self.counts[b as usize] = new as u8;
            if old >= BIG as u32 {
                self.big.remove(&b);
            }
        }
        if (old == 0) != (new == 0) {
            if new == 0 {
                self.nr_allocated -= 1;
            } else {
                self.nr_allocated += 1;
            }
            self.toggled[(b / 64) as usize] ^= 1 << (b % 64);
            self.flipped.push(b);
        }
        if old.min(3) != new.min(3) {
            self.dirty_bitmaps.insert(b / ENTRIES_PER_BITMAP);
        }
        if (old >= 3 || new >= 3) && !self.overflow_rebuild {
            self.overflow_changed.insert(b);
            if self.overflow_changed.len() > OVERFLOW_REBUILD {
                self.overflow_rebuild = true;
                self.overflow_changed.clear();
            }
        }
        Ok(())
    }

    pub fn inc(&mut self, b: u64) -> Result<()> {
        let c = self.count(b);
        self.set(b, c.saturating_add(1))
    }

    /// Decrement; returns the new count. Decrementing a free block is an error
    /// (it means the metadata's counts are inconsistent).
    pub fn dec(&mut self, b: u64) -> Result<u32> {
        let c = self.count(b);
        if c == 0 {
            return Err(PdataError::Invalid(format!(
                "{:?} space map: decrement of free block {b}",
                self.kind
            )));
        }
        self.set(b, c - 1)?;
        Ok(c - 1)
    }

    /// Whether block `b` was in use at the last commit.
    pub fn committed(&self, b: u64) -> bool {
        let toggled = self.toggled[(b / 64) as usize] & (1 << (b % 64)) != 0;
        (self.counts[b as usize] != 0) != toggled
    }

    /// Where the next [`SpaceMap::alloc`] starts looking (it wraps around).
    pub fn set_cursor(&mut self, b: u64) {
        self.cursor = b;
    }

    /// Allocate a block (count 0 -> 1) that was also free at the last commit.
    pub fn alloc(&mut self) -> Result<u64> {
        let n = self.nr_blocks;
        if self.nr_allocated < n {
            let start = self.cursor.min(n);
            for b in (start..n).chain(0..start) {
                if self.counts[b as usize] == 0 && !self.committed(b) && !self.is_held(b) {
                    self.set(b, 1)?;
                    self.cursor = b + 1;
                    return Ok(b);
                }
            }
        }
        Err(match self.kind {
            SmKind::Metadata => PdataError::NoMetadataSpace { nr_blocks: n },
            SmKind::Data => PdataError::NoDataSpace { nr_blocks: n },
        })
    }

    /// Hold free block `b` back from allocation until [`SpaceMap::unhold`]; false
    /// (nothing held) if it is in use or out of range. Holds are not counted in
    /// the on-disk space map: they end with the process.
    pub fn hold(&mut self, b: u64) -> bool {
        if b >= self.nr_blocks || self.count(b) != 0 {
            return false;
        }
        *self.held.entry(b).or_insert(0) += 1;
        true
    }

    /// Drop one hold of `b` taken by [`SpaceMap::hold`].
    pub fn unhold(&mut self, b: u64) {
        if let Some(h) = self.held.get_mut(&b) {
            *h -= 1;
            if *h == 0 {
                self.held.remove(&b);
            }
        }
    }

    fn is_held(&self, b: u64) -> bool {
        !self.held.is_empty() && self.held.contains_key(&b)
    }

    /// Grow to `nr_blocks`; new blocks are free. Shrinking is refused.
    pub fn extend(&mut self, nr_blocks: u64) -> Result<()> {
        if nr_blocks < self.nr_blocks {
            return Err(PdataError::Invalid(format!(
                "{:?} space map cannot shrink from {} to {nr_blocks} blocks",
                self.kind, self.nr_blocks
            )));
        }
        let field = self.kind.nr_blocks_field();
        bounds::field(
            0,
            field,
            nr_blocks,
            self.kind.max_blocks(),
            self.kind.max_blocks_why(),
        )?;
        let nr_bitmaps = nr_blocks.div_ceil(ENTRIES_PER_BITMAP);
        let (old_blocks, old_bitmaps) = (self.nr_blocks, self.nr_bitmaps());
        let grown = bounds::resize(&mut self.counts, 0, field, nr_blocks)
            .and_then(|_| bounds::resize(&mut self.toggled, 0, field, nr_blocks.div_ceil(64)))
            .and_then(|_| bounds::resize(&mut self.bitmap_info, 0, field, nr_bitmaps))
            .and_then(|_| bounds::resize(&mut self.bitmap_locs, 0, field, nr_bitmaps));
        if let Err(e) = grown {
            // a refused grow leaves the map as it was
            self.counts.truncate(old_blocks as usize);
            self.toggled.truncate((old_blocks as usize).div_ceil(64));
            self.bitmap_info.truncate(old_bitmaps as usize);
            self.bitmap_locs.truncate(old_bitmaps as usize);
            return Err(e);
        }
        self.nr_blocks = nr_blocks;
        // The last old bitmap may have been partial: its nr_free changes.
        if old_bitmaps > 0 {
            self.dirty_bitmaps.insert(old_bitmaps - 1);
        }
        self.dirty_bitmaps.extend(old_bitmaps..nr_bitmaps);
        Ok(())
    }

    /// Called once the transaction is durable: its state becomes "committed".
    pub fn transaction_committed(&mut self) {
        for b in std::mem::take(&mut self.flipped) {
            self.toggled[(b / 64) as usize] = 0;
        }
        self.dirty_bitmaps.clear();
        self.overflow_changed.clear();
        self.overflow_rebuild = false;
    }

    /// Every block with a count of 3 or more, ascending, with its count.
    pub(crate) fn overflow_counts(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c >= 3)
            .map(|(b, _)| (b as u64, self.count(b as u64)))
    }

    /// Set a count of 3 or more found while loading (nr_allocated is the caller's).
    pub(crate) fn set_loaded(&mut self, b: u64, c: u32) {
        if c >= BIG as u32 {
            self.counts[b as usize] = BIG;
            self.big.insert(b, c);
        } else {
            self.counts[b as usize] = c as u8;
        }
    }

    /// Iterate (block, count) over blocks with count > 0.
    pub fn iter_used(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.counts
            .iter()
            .enumerate()
            .filter(|(_, &c)| c != 0)
            .map(|(b, _)| (b as u64, self.count(b as u64)))
    }

    /// Whether a data block is shared (count > 1), for discard decisions.
    pub fn is_shared(&self, b: u64) -> bool {
        self.count(b) > 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_respects_committed_state() {
        let mut sm = SpaceMap::new(SmKind::Data, 4).unwrap();
        let a = sm.alloc().unwrap();
        sm.transaction_committed();
        sm.dec(a).unwrap();
        // freed in this transaction: not reusable until commit
        let others: Vec<u64> = (0..3).map(|_| sm.alloc().unwrap()).collect();
        assert!(!others.contains(&a));
        assert!(sm.alloc().is_err());
        sm.transaction_committed();
        assert_eq!(sm.alloc().unwrap(), a);
    }

    #[test]
    fn held_block_is_not_allocated_until_unheld() {
        let mut sm = SpaceMap::new(SmKind::Data, 2).unwrap();
        let a = sm.alloc().unwrap();
        let b = sm.alloc().unwrap();
        sm.transaction_committed();
        assert!(!sm.hold(a), "a block in use cannot be held");
        sm.dec(a).unwrap();
        assert!(sm.hold(a));
        assert_eq!(sm.nr_free(), 0, "a held block is not free");
        sm.transaction_committed();
        assert!(sm.alloc().is_err(), "a held block was allocated");
        assert_eq!(sm.nr_allocated(), 1, "holds are not written");
        sm.unhold(a);
        assert_eq!(sm.nr_free(), 1);
        assert_eq!(sm.alloc().unwrap(), a);
        assert!(!sm.hold(b) && !sm.hold(7));
    }

    #[test]
    fn big_counts_and_dirty_tracking() {
        let mut sm = SpaceMap::new(SmKind::Metadata, 20000).unwrap();
        sm.transaction_committed();
        for _ in 0..300 {
            sm.inc(17000).unwrap();
        }
        assert_eq!(sm.count(17000), 300);
        assert!(sm.dirty_bitmaps.contains(&1));
        assert!(sm.overflow_changed.contains(&17000));
        for _ in 0..299 {
            sm.dec(17000).unwrap();
        }
        assert_eq!(sm.count(17000), 1);
        assert_eq!(sm.nr_allocated(), 1);
        assert!(sm.dec(5).is_err());
    }
}
