//! On-disk form of the space maps: the 32-byte root blob, 2-bit bitmaps, the
//! metadata index block, the data index btree and the overflow ref-count
//! btree. Loading decodes everything into the in-core `SpaceMap`; committing
//! writes back what changed.

use crate::pdata::bounds;
use crate::pdata::btree::{self, ValueKind};
use crate::pdata::error::{corrupt, BlockKind, PdataError, Result};
use crate::pdata::space_map::{SmKind, SpaceMap, ENTRIES_PER_BITMAP};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{le32, le64, put32, put64, Block};

/// The sm root blob stored (zero-padded to 128 bytes) in the superblock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SmRoot {
    pub nr_blocks: u64,
    pub nr_allocated: u64,
    pub bitmap_root: u64,
    pub ref_count_root: u64,
}

impl SmRoot {
    pub fn decode(b: &[u8]) -> SmRoot {
        SmRoot {
            nr_blocks: le64(b, 0),
            nr_allocated: le64(b, 8),
            bitmap_root: le64(b, 16),
            ref_count_root: le64(b, 24),
        }
    }
    pub fn encode(&self, out: &mut [u8]) {
        out.fill(0);
        put64(out, 0, self.nr_blocks);
        put64(out, 8, self.nr_allocated);
        put64(out, 16, self.bitmap_root);
        put64(out, 24, self.ref_count_root);
    }
}

/// The space map root as a superblock field: the kernel keeps 128 bytes for
/// it (`SPACE_MAP_ROOT_SIZE`), of which the four counts take the first 32.
impl crate::layout::Field for SmRoot {
    const LEN: usize = 128;
    fn get(b: &[u8]) -> SmRoot {
        SmRoot::decode(b)
    }
    fn put(self, b: &mut [u8]) {
        self.encode(b);
    }
}

const REF_COUNT: ValueKind = ValueKind::Plain(4);
const INDEX_ENTRY: ValueKind = ValueKind::Plain(16);

/// Index entry {blocknr, nr_free, none_free_before}.
pub fn decode_index_entry(v: &[u8]) -> (u64, u32, u32) {
    (le64(v, 0), le32(v, 8), le32(v, 12))
}

fn encode_index_entry(loc: u64, info: (u32, u32)) -> [u8; 16] {
    let mut v = [0u8; 16];
    put64(&mut v, 0, loc);
    put32(&mut v, 8, info.0);
    put32(&mut v, 12, info.1);
    v
}

/// Write bitmap `idx` from the in-core counts; returns (nr_free, none_free_before).
fn encode_bitmap(sm: &SpaceMap, idx: u64, d: &mut Block) -> (u32, u32) {
    d[16..].fill(0);
    let base = (idx * ENTRIES_PER_BITMAP) as usize;
    let n = (sm.nr_blocks() as usize - base).min(ENTRIES_PER_BITMAP as usize);
    let mut nr_free = 0;
    let mut first_free = None;
    for (i, chunk) in sm.counts[base..base + n].chunks(4).enumerate() {
        let mut byte = 0u8;
        for (j, &c) in chunk.iter().enumerate() {
            let c = c.min(3);
            if c == 0 {
                nr_free += 1;
                first_free.get_or_insert(4 * i + j);
            }
            byte |= ((c >> 1) << (2 * j)) | ((c & 1) << (2 * j + 1));
        }
        d[16 + i] = byte;
    }
    (nr_free as u32, first_free.unwrap_or(n) as u32)
}

/// The four 2-bit entries of a bitmap byte (the high bit of each pair comes first).
static DECODE: [[u8; 4]; 256] = {
    let mut t = [[0u8; 4]; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut e = 0;
        while e < 4 {
            let s = 2 * e;
            t[byte][e] = (2 * ((byte >> s) & 1) + ((byte >> (s + 1)) & 1)) as u8;
            e += 1;
        }
        byte += 1;
    }
    t
};

/// Load bitmap `idx` (at `loc`) into the in-core counts; returns (nr_free, none_free_before).
fn decode_bitmap(
    sm: &mut SpaceMap,
    idx: u64,
    loc: u64,
    d: &Block,
    overflow: &Overflow,
) -> Result<(u32, u32)> {
    let base = idx * ENTRIES_PER_BITMAP;
    let n = (sm.nr_blocks() - base).min(ENTRIES_PER_BITMAP) as usize;
    let mut nr_free = 0;
    let mut first_free = None;
    let mut big = Vec::new();
    let counts = &mut sm.counts[base as usize..base as usize + n];
    // 32 entries (one u64) at a time; bit 2j is entry j's high bit, 2j+1 its low bit.
    const LOW: u64 = 0x5555_5555_5555_5555;
    let words = n / 32;
    for (wi, out) in counts[..32 * words].chunks_exact_mut(32).enumerate() {
        let w = le64(d, 16 + 8 * wi);
        let e0 = 32 * wi;
        let used = (w | (w >> 1)) & LOW;
        if used != LOW {
            nr_free += 32 - used.count_ones() as usize;
            first_free.get_or_insert(e0 + ((!used & LOW).trailing_zeros() / 2) as usize);
        }
        if w == 0 {
            continue;
        }
        for (k, quad) in out.chunks_exact_mut(4).enumerate() {
            quad.copy_from_slice(&DECODE[(w >> (8 * k)) as u8 as usize]);
        }
        let mut threes = w & (w >> 1) & LOW;
        while threes != 0 {
            big.push(base + (e0 + threes.trailing_zeros() as usize / 2) as u64);
            threes &= threes - 1;
        }
    }
    for e in 32 * words..n {
        match DECODE[d[16 + e / 4] as usize][e % 4] {
            0 => {
                nr_free += 1;
                first_free.get_or_insert(e);
            }
            3 => big.push(base + e as u64),
            c => counts[e] = c,
        }
    }
    for b in big {
        let c = match overflow.get(&b) {
            Some(&c) if c >= 3 => c,
            Some(&c) => {
                return Err(corrupt(
                    loc,
                    format!("{:?} block {b}: overflow count {c} is below 3", sm.kind),
                ))
            }
            None => {
                return Err(corrupt(
                    loc,
                    format!(
                        "{:?} block {b}: bitmap says count >= 3 but the ref-count tree has no entry",
                        sm.kind
                    ),
                ))
            }
        };
        sm.set_loaded(b, c);
    }
    sm.nr_allocated += (n - nr_free) as u64;
    Ok((nr_free as u32, first_free.unwrap_or(n) as u32))
}

/// The overflow tree's counts, ascending by block (as a walk yields them): a
/// sorted vector is an eighth of a hash map's memory and builds without rehashing,
/// which matters when a pool's snapshots share a million blocks.
#[derive(Default)]
pub(crate) struct Overflow(Vec<(u64, u32)>);

impl Overflow {
    fn get(&self, b: &u64) -> Option<&u32> {
        self.0.binary_search_by_key(b, |e| e.0).ok().map(|i| &self.0[i].1)
    }
    #[cfg(test)]
    fn insert(&mut self, b: u64, c: u32) {
        let i = self.0.partition_point(|e| e.0 < b);
        self.0.insert(i, (b, c));
    }
    #[cfg(test)]
    fn clear(&mut self) {
        self.0.clear();
    }
}

fn load_overflow(tm: &mut TransactionManager, root: u64) -> Result<Overflow> {
    let mut m = Vec::new();
    btree::walk(tm, root, 4, &mut |k, v| {
        m.push((k, le32(v, 0)));
        Ok(())
    })?;
    // a walk of a sound tree is sorted; a damaged one is sorted here
    if !m.windows(2).all(|w| w[0].0 < w[1].0) {
        m.sort_unstable_by_key(|e| e.0);
    }
    Ok(Overflow(m))
}

/// Check the sizes in an sm root (read from the superblock at block
/// `sb_block`) against the metadata device of `dev_blocks` blocks it lives on,
/// before anything is sized by them: the metadata space map cannot describe
/// more blocks than the device has, and each bitmap of the data space map is a
/// metadata block of its own.
pub fn check_root(kind: SmKind, root: &SmRoot, sb_block: u64, dev_blocks: u64) -> Result<()> {
    let field = kind.nr_blocks_field();
    bounds::field(
        sb_block,
        field,
        root.nr_blocks,
        kind.max_blocks(),
        kind.max_blocks_why(),
    )?;
    match kind {
        SmKind::Metadata => bounds::field(
            sb_block,
            field,
            root.nr_blocks,
            dev_blocks,
            "the metadata device's blocks",
        )?,
        SmKind::Data => bounds::field(
            sb_block,
            field,
            root.nr_blocks,
            dev_blocks.saturating_mul(ENTRIES_PER_BITMAP),
            format!("the bitmaps a metadata device of {dev_blocks} blocks can hold describe"),
        )?,
    };
    Ok(())
}

/// A transaction manager over `cache` with the metadata space map at `root`
/// loaded (the cache's and era's metadata have no data space map).
pub fn open_tm(cache: crate::pdata::cache::BlockCache, root: &SmRoot) -> Result<TransactionManager> {
    let mut tm = TransactionManager::unloaded(cache);
    tm.meta = load(&mut tm, SmKind::Metadata, root)?;
    Ok(tm)
}

/// Decode a space map from disk into core.
pub fn load(tm: &mut TransactionManager, kind: SmKind, root: &SmRoot) -> Result<SpaceMap> {
    check_root(kind, root, 0, tm.cache.nr_blocks())?;
    let mut sm = SpaceMap::new(kind, root.nr_blocks)?;
    let nr_bitmaps = sm.nr_bitmaps();
    match kind {
        SmKind::Metadata => {
            let d = tm.read(root.bitmap_root, BlockKind::Index)?;
            for i in 0..nr_bitmaps as usize {
                sm.bitmap_locs[i] = decode_index_entry(&d[16 + 16 * i..32 + 16 * i]).0;
            }
        }
        SmKind::Data => {
            let locs = &mut sm.bitmap_locs;
            btree::walk(tm, root.bitmap_root, 16, &mut |k, v| {
                if let Some(slot) = locs.get_mut(k as usize) {
                    *slot = decode_index_entry(v).0;
                }
                Ok(())
            })?;
        }
    }
    let overflow = load_overflow(tm, root.ref_count_root)?;
    for idx in 0..nr_bitmaps {
        let loc = sm.bitmap_locs[idx as usize];
        if loc == 0 {
            return Err(corrupt(
                root.bitmap_root,
                format!("{kind:?} space map index has no bitmap {idx}"),
            ));
        }
        let d: Box<Block> = Box::new(*tm.read(loc, BlockKind::Bitmap)?);
        sm.bitmap_info[idx as usize] = decode_bitmap(&mut sm, idx, loc, &d, &overflow)?;
    }
    sm.index_root = root.bitmap_root;
    sm.ref_count_root = root.ref_count_root;
    sm.transaction_committed();
    Ok(sm)
}

/// Create the empty on-disk trees of a new space map (format time).
pub fn create_trees(tm: &mut TransactionManager, kind: SmKind) -> Result<()> {
    let rc = btree::create(tm, REF_COUNT)?;
    tm.sm(kind).ref_count_root = rc;
    if kind == SmKind::Data {
        let idx = btree::create(tm, INDEX_ENTRY)?;
        tm.data.index_root = idx;
    }
    Ok(())
}

/// Write both space maps' changes; returns (metadata root, data root).
/// Updating the space maps allocates and frees metadata blocks, which changes
/// metadata counts again, so the metadata bitmaps are relocated to a fixed
/// point before anything is encoded.
pub fn commit(tm: &mut TransactionManager) -> Result<(SmRoot, SmRoot)> {
    for kind in [SmKind::Data, SmKind::Metadata] {
        if tm.sm(kind).overflow_rebuild {
            // Rebuilt bottom-up from the counts: the old tree goes, and only 0<->1
            // transitions happen while the new one is written.
            let old = tm.sm(kind).ref_count_root;
            btree::del_tree(tm, old, REF_COUNT)?;
            let entries: Vec<(u64, u64)> = tm
                .sm(kind)
                .overflow_counts()
                .map(|(b, c)| (b, c as u64))
                .collect();
            tm.sm(kind).overflow_rebuild = false;
            tm.sm(kind).overflow_changed.clear();
            let root = btree::build::build(tm, REF_COUNT, entries.into_iter())?;
            tm.sm(kind).ref_count_root = root;
        }
        // Only 0<->1 transitions happen below, which never touch the overflow
        // tree, so this converges in one pass; the loop is belt and braces.
        for _ in 0..4 {
            let changed = tm.sm(kind).overflow_changed.take_sorted();
            if changed.is_empty() {
                break;
            }
            for b in changed {
                let c = tm.sm(kind).count(b);
                let root = tm.sm(kind).ref_count_root;
                let new_root = if c >= 3 {
                    btree::insert(tm, root, b, &c.to_le_bytes(), REF_COUNT)?.0
                } else {
                    btree::remove(tm, root, b, REF_COUNT)?.0
                };
                tm.sm(kind).ref_count_root = new_root;
            }
        }
    }

    let dirty: Vec<u64> = tm.data.dirty_bitmaps.take_sorted();
    for idx in dirty {
        let old = tm.data.bitmap_locs[idx as usize];
        let loc = tm.relocate(old, BlockKind::Bitmap)?;
        tm.data.bitmap_locs[idx as usize] = loc;
        let mut buf: Box<Block> = Box::new([0u8; 4096]);
        let info = encode_bitmap(&tm.data, idx, &mut buf);
        tm.data.bitmap_info[idx as usize] = info;
        tm.write(loc, BlockKind::Bitmap)?.copy_from_slice(&buf[..]);
        let root = tm.data.index_root;
        let v = encode_index_entry(loc, info);
        tm.data.index_root = btree::insert(tm, root, idx, &v, INDEX_ENTRY)?.0;
    }

    let index = tm.relocate(tm.meta.index_root, BlockKind::Index)?;
    tm.meta.index_root = index;
    loop {
        let pending: Vec<u64> = tm
            .meta
            .dirty_bitmaps
            .sorted()
            .into_iter()
            .filter(|&i| !tm.is_writable(tm.meta.bitmap_locs[i as usize]))
            .collect();
        if pending.is_empty() {
            break;
        }
        for idx in pending {
            let old = tm.meta.bitmap_locs[idx as usize];
            tm.meta.bitmap_locs[idx as usize] = tm.relocate(old, BlockKind::Bitmap)?;
        }
    }
    let dirty: Vec<u64> = tm.meta.dirty_bitmaps.take_sorted();
    for idx in dirty {
        let loc = tm.meta.bitmap_locs[idx as usize];
        let mut buf: Box<Block> = Box::new([0u8; 4096]);
        let info = encode_bitmap(&tm.meta, idx, &mut buf);
        tm.meta.bitmap_info[idx as usize] = info;
        tm.write(loc, BlockKind::Bitmap)?.copy_from_slice(&buf[..]);
    }
    let mut buf: Box<Block> = Box::new([0u8; 4096]);
    for i in 0..tm.meta.nr_bitmaps() as usize {
        let v = encode_index_entry(tm.meta.bitmap_locs[i], tm.meta.bitmap_info[i]);
        buf[16 + 16 * i..32 + 16 * i].copy_from_slice(&v);
    }
    tm.write(index, BlockKind::Index)?.copy_from_slice(&buf[..]);

    if !tm.meta.overflow_changed.is_empty() || !tm.data.overflow_changed.is_empty() {
        return Err(PdataError::Invalid(
            "internal error: space map commit did not converge".into(),
        ));
    }
    let root = |sm: &SpaceMap| SmRoot {
        nr_blocks: sm.nr_blocks(),
        nr_allocated: sm.nr_allocated(),
        bitmap_root: sm.index_root,
        ref_count_root: sm.ref_count_root,
    };
    Ok((root(&tm.meta), root(&tm.data)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Encoding then decoding every bitmap gives back every count, the free
    /// count and the first free entry, including a partial last bitmap.
    #[test]
    fn bitmap_round_trip() {
        let nr = 2 * ENTRIES_PER_BITMAP + 1001;
        let mut sm = SpaceMap::new(SmKind::Data, nr).unwrap();
        let mut x = 0x1234_5678_9abc_def0u64;
        let mut overflow = Overflow::default();
        for b in 0..nr {
            crate::rng::step(&mut x);
            // runs of free blocks at the start of the first bitmap
            let c = if b < 100 {
                0
            } else {
                [0, 1, 1, 2, 3, 7, 300][(x % 7) as usize]
            };
            sm.set(b, c).unwrap();
            if c >= 3 {
                overflow.insert(b, c);
            }
        }
        let mut loaded = SpaceMap::new(SmKind::Data, nr).unwrap();
        for idx in 0..sm.nr_bitmaps() {
            let mut d = [0u8; crate::pdata::BLOCK_SIZE];
            let info = encode_bitmap(&sm, idx, &mut d);
            assert_eq!(decode_bitmap(&mut loaded, idx, 7, &d, &overflow).unwrap(), info);
        }
        for b in 0..nr {
            assert_eq!(loaded.count(b), sm.count(b), "block {b}");
        }
        assert_eq!(loaded.nr_allocated(), sm.nr_allocated());
        // a 3 with no overflow entry is corruption, reported at the bitmap's block
        overflow.clear();
        let mut d = [0u8; crate::pdata::BLOCK_SIZE];
        encode_bitmap(&sm, 0, &mut d);
        let e =
            decode_bitmap(&mut SpaceMap::new(SmKind::Data, nr).unwrap(), 0, 7, &d, &overflow).unwrap_err();
        assert!(e.to_string().contains("7"), "{e}");
    }
}
