//! The kernel's dm-array: a fixed-size array of values of one size, kept as a
//! btree (key: block index, value: metadata block) of array blocks. Each array
//! block has its own header and checksum (max_entries, nr_entries, value_size,
//! its own block number) and then its values; every block is full but the last.
//! Array blocks of plain values hold no references, so one block may stand for
//! many indexes (a grown array's default blocks are one block, shared).
//!
//! Everything read is checked before it is used: a header's counts against the
//! value size, the btree's keys against the length the caller says the array
//! has, so metadata that lies with a valid checksum is an error, never an
//! out-of-range access or an allocation sized by the lie.

use super::btree::{self, ValueKind};
use super::error::{corrupt, BlockKind, PdataError, Result};
use super::tm::TransactionManager;
use super::{le32, put32, Block, BLOCK_SIZE};

/// The btree under an array: its values are array blocks.
pub const TREE: ValueKind = ValueKind::BlockRef;

/// Bytes of an array block's header: csum, max_entries, nr_entries, value_size, blocknr.
pub const HEADER: usize = 24;

/// A value an array holds: fixed size, little-endian on disk.
pub trait ArrayValue: Copy + Default + PartialEq + std::fmt::Debug + 'static {
    const SIZE: usize;
    fn decode(b: &[u8]) -> Self;
    fn encode(self, b: &mut [u8]);
}

impl ArrayValue for u32 {
    const SIZE: usize = 4;
    fn decode(b: &[u8]) -> u32 {
        le32(b, 0)
    }
    fn encode(self, b: &mut [u8]) {
        put32(b, 0, self);
    }
}

impl ArrayValue for u64 {
    const SIZE: usize = 8;
    fn decode(b: &[u8]) -> u64 {
        super::le64(b, 0)
    }
    fn encode(self, b: &mut [u8]) {
        super::put64(b, 0, self);
    }
}

/// Entries an array block of `value_size` holds (the kernel's calc_max_entries).
pub const fn max_entries(value_size: usize) -> usize {
    (BLOCK_SIZE - HEADER) / value_size
}

/// Array blocks an array of `len` entries of `value_size` has.
pub fn nr_blocks(len: u64, value_size: usize) -> u64 {
    len.div_ceil(max_entries(value_size) as u64)
}

fn block_max(d: &Block) -> usize {
    le32(d, 4) as usize
}
fn block_nr(d: &Block) -> usize {
    le32(d, 8) as usize
}
fn block_vs(d: &Block) -> usize {
    le32(d, 12) as usize
}

/// Check the header of array block `b`; returns its nr_entries.
pub fn check_block(b: u64, d: &Block, value_size: usize) -> Result<usize> {
    let vs = block_vs(d);
    if vs != value_size {
        return Err(corrupt(
            b,
            format!("array block has value size {vs}, expected {value_size}"),
        ));
    }
    let m = block_max(d);
    if m != max_entries(value_size) {
        return Err(corrupt(
            b,
            format!(
                "array block has max_entries {m}, expected {}",
                max_entries(value_size)
            ),
        ));
    }
    let n = block_nr(d);
    if n > m {
        return Err(corrupt(
            b,
            format!("array block has {n} entries, more than max_entries {m}"),
        ));
    }
    Ok(n)
}

fn value_off<V: ArrayValue>(i: usize) -> usize {
    HEADER + i * V::SIZE
}

/// An empty array.
pub fn empty(tm: &mut TransactionManager) -> Result<u64> {
    btree::create(tm, TREE)
}

/// Drop one reference to the array at `root` (its blocks go with the last).
pub fn del(tm: &mut TransactionManager, root: u64) -> Result<()> {
    btree::del_tree(tm, root, TREE)
}

/// A new array block of `nr` entries, each `fill`.
fn new_block<V: ArrayValue>(tm: &mut TransactionManager, nr: usize, fill: V) -> Result<u64> {
    let b = tm.new_block(BlockKind::Array)?;
    let d = tm.write(b, BlockKind::Array)?;
    put32(d, 4, max_entries(V::SIZE) as u32);
    put32(d, 8, nr as u32);
    put32(d, 12, V::SIZE as u32);
    for i in 0..nr {
        let o = value_off::<V>(i);
        fill.encode(&mut d[o..o + V::SIZE]);
    }
    Ok(b)
}

/// The array block holding block index `bi`.
fn block_at(tm: &mut TransactionManager, root: u64, bi: u64) -> Result<u64> {
    btree::lookup_u64(tm, root, bi)?.ok_or_else(|| corrupt(root, format!("array has no block {bi}")))
}

/// The value at `index`.
pub fn get<V: ArrayValue>(tm: &mut TransactionManager, root: u64, index: u64) -> Result<V> {
    let mx = max_entries(V::SIZE) as u64;
    let b = block_at(tm, root, index / mx)?;
    let d = tm.read(b, BlockKind::Array)?;
    let n = check_block(b, d, V::SIZE)?;
    let i = (index % mx) as usize;
    if i >= n {
        return Err(corrupt(b, format!("array has no entry {index} (block has {n})")));
    }
    let o = value_off::<V>(i);
    Ok(V::decode(&d[o..o + V::SIZE]))
}

/// Make array block index `bi` writable (copying it if it is shared or
/// committed); returns the new root, the block, and its nr_entries.
fn shadow_block<V: ArrayValue>(tm: &mut TransactionManager, root: u64, bi: u64) -> Result<(u64, u64, usize)> {
    let b = block_at(tm, root, bi)?;
    let nb = tm.shadow_with(
        b,
        BlockKind::Array,
        |d| check_block(b, d, V::SIZE).map(|_| ()),
        |_, _| Ok(()),
    )?;
    let n = check_block(nb, tm.read(nb, BlockKind::Array)?, V::SIZE)?;
    let root = if nb != b {
        btree::insert(tm, root, bi, &nb.to_le_bytes(), TREE)?.0
    } else {
        root
    };
    Ok((root, nb, n))
}

/// Set the value at `index`; returns the new root.
pub fn set<V: ArrayValue>(tm: &mut TransactionManager, root: u64, index: u64, v: V) -> Result<u64> {
    let mx = max_entries(V::SIZE) as u64;
    let (root, b, n) = shadow_block::<V>(tm, root, index / mx)?;
    let i = (index % mx) as usize;
    if i >= n {
        return Err(corrupt(b, format!("array has no entry {index} (block has {n})")));
    }
    let o = value_off::<V>(i);
    v.encode(&mut tm.write(b, BlockKind::Array)?[o..o + V::SIZE]);
    Ok(root)
}

/// Change the number of entries in place of one block to `nr` (new ones `fill`).
fn set_block_len<V: ArrayValue>(
    tm: &mut TransactionManager,
    root: u64,
    bi: u64,
    nr: usize,
    fill: V,
) -> Result<u64> {
    let (root, b, n) = shadow_block::<V>(tm, root, bi)?;
    let d = tm.write(b, BlockKind::Array)?;
    for i in n..nr {
        let o = value_off::<V>(i);
        fill.encode(&mut d[o..o + V::SIZE]);
    }
    if nr < n {
        d[value_off::<V>(nr)..value_off::<V>(n)].fill(0);
    }
    put32(d, 8, nr as u32);
    Ok(root)
}

/// Resize from `old_len` to `new_len` entries, new entries `fill`; returns the
/// new root. Whole new blocks share one array block, as the kernel's do.
pub fn resize<V: ArrayValue>(
    tm: &mut TransactionManager,
    root: u64,
    old_len: u64,
    new_len: u64,
    fill: V,
) -> Result<u64> {
    let mx = max_entries(V::SIZE) as u64;
    let (old_blocks, new_blocks) = (old_len.div_ceil(mx), new_len.div_ceil(mx));
    let mut root = root;
    if new_len > old_len {
        if !old_len.is_multiple_of(mx) {
            let end = new_len.min(old_blocks * mx);
            root = set_block_len(
                tm,
                root,
                old_blocks - 1,
                (end - (old_blocks - 1) * mx) as usize,
                fill,
            )?;
        }
        let mut full: Option<u64> = None;
        for bi in old_blocks..new_blocks {
            let nr = (new_len - bi * mx).min(mx);
            let b = if nr == mx {
                match full {
                    Some(b) => {
                        tm.inc(b)?;
                        b
                    }
                    None => {
                        let b = new_block(tm, mx as usize, fill)?;
                        full = Some(b);
                        b
                    }
                }
            } else {
                new_block(tm, nr as usize, fill)?
            };
            root = btree::insert(tm, root, bi, &b.to_le_bytes(), TREE)?.0;
        }
    } else if new_len < old_len {
        for bi in (new_blocks..old_blocks).rev() {
            let (r, old) = btree::remove(tm, root, bi, TREE)?;
            root = r;
            match old {
                Some(v) => {
                    tm.dec(super::le64(&v, 0))?;
                }
                None => return Err(corrupt(root, format!("array has no block {bi}"))),
            }
        }
        if !new_len.is_multiple_of(mx) {
            let nr = (new_len - (new_blocks - 1) * mx) as usize;
            root = set_block_len(tm, root, new_blocks - 1, nr, fill)?;
        }
    }
    Ok(root)
}

/// A new array of `len` entries, entry `i` being `values[i]` (default past
/// its end): bulk (restore), its blocks written in order under a btree built
/// bottom-up.
pub fn build<V: ArrayValue>(tm: &mut TransactionManager, len: u64, values: &[V]) -> Result<u64> {
    build_with(tm, len, &mut |i| {
        values.get(i as usize).copied().unwrap_or_default()
    })
}

/// [`build`] with entry `i` being `value(i)`, asked for in index order (a
/// sparse source walks a cursor instead of filling a vector).
pub fn build_with<V: ArrayValue>(
    tm: &mut TransactionManager,
    len: u64,
    value: &mut dyn FnMut(u64) -> V,
) -> Result<u64> {
    let mx = max_entries(V::SIZE) as u64;
    let mut tree = btree::build::Builder::new(TREE);
    for bi in 0..len.div_ceil(mx) {
        let first = bi * mx;
        let nr = (len - first).min(mx) as usize;
        let b = new_block(tm, nr, V::default())?;
        let d = tm.write(b, BlockKind::Array)?;
        for i in 0..nr {
            let v = value(first + i as u64);
            if v != V::default() {
                let o = value_off::<V>(i);
                v.encode(&mut d[o..o + V::SIZE]);
            }
        }
        tree.push(tm, bi, b)?;
    }
    tree.finish(tm)
}

/// The array blocks of an array that must have `len` entries, in index order:
/// its btree's keys must be exactly 0..nr_blocks(len). Nothing is sized by
/// `len` before the tree has shown it holds that many blocks.
pub fn blocks<V: ArrayValue>(tm: &mut TransactionManager, root: u64, len: u64) -> Result<Vec<u64>> {
    let want = nr_blocks(len, V::SIZE);
    let mut out = Vec::new();
    let mut bad: Option<String> = None;
    btree::walk(tm, root, 8, &mut |k, v| {
        if bad.is_none() {
            if k != out.len() as u64 {
                bad = Some(format!(
                    "array btree has block index {k} where {} was expected",
                    out.len()
                ));
            } else if k >= want {
                bad = Some(format!(
                    "array has more blocks than its {len} entries need ({want})"
                ));
            } else {
                out.push(super::le64(v, 0));
            }
        }
        Ok(())
    })?;
    if let Some(what) = bad {
        return Err(corrupt(root, what));
    }
    if out.len() as u64 != want {
        return Err(corrupt(
            root,
            format!(
                "array has {} blocks, but its {len} entries need {want}",
                out.len()
            ),
        ));
    }
    Ok(out)
}

/// The length of an array that holds at most `max_len` entries, as its tree
/// and its last block say (every other block is full: [`walk`] checks it).
/// Nothing is read past what `max_len` allows.
pub fn len<V: ArrayValue>(tm: &mut TransactionManager, root: u64, max_len: u64) -> Result<u64> {
    let most = nr_blocks(max_len, V::SIZE);
    let mut n = 0u64;
    let mut last = None;
    let mut bad: Option<String> = None;
    btree::walk(tm, root, 8, &mut |k, v| {
        if bad.is_none() {
            if k != n {
                bad = Some(format!("array btree has block index {k} where {n} was expected"));
            } else if n >= most {
                bad = Some(format!(
                    "array has more blocks than {max_len} entries need ({most})"
                ));
            } else {
                n += 1;
                last = Some(super::le64(v, 0));
            }
        }
        Ok(())
    })?;
    if let Some(what) = bad {
        return Err(corrupt(root, what));
    }
    let Some(b) = last else { return Ok(0) };
    let d = tm.read(b, BlockKind::Array)?;
    let e = check_block(b, d, V::SIZE)? as u64;
    let len = (n - 1) * max_entries(V::SIZE) as u64 + e;
    if len > max_len {
        return Err(corrupt(
            b,
            format!("array has {len} entries, more than {max_len}"),
        ));
    }
    Ok(len)
}

/// Visit the values of an array that must have `len` entries, a block at a
/// time: `f(first index, values)`. Each block's header is checked: every block
/// full but the last, which holds the rest.
pub fn walk<V: ArrayValue>(
    tm: &mut TransactionManager,
    root: u64,
    len: u64,
    f: &mut dyn FnMut(u64, &[V]) -> Result<()>,
) -> Result<()> {
    let mx = max_entries(V::SIZE) as u64;
    let list = blocks::<V>(tm, root, len)?;
    let mut vals: Vec<V> = Vec::with_capacity(mx as usize);
    if tm.cache.dirty_count() > 0 {
        // blocks changed in this transaction are in the cache only
        for (bi, b) in list.into_iter().enumerate() {
            load_block(tm, b, bi as u64, len, &mut vals)?;
            f(bi as u64 * mx, &vals)?;
        }
        return Ok(());
    }
    // nothing changed: consecutive blocks (an array is usually written in
    // order) are read in one I/O, past the cache
    let mut buf = Vec::new();
    let mut bi = 0usize;
    while bi < list.len() {
        let run = list[bi..]
            .iter()
            .zip(list[bi]..)
            .take(RUN_BLOCKS)
            .take_while(|(b, want)| **b == *want)
            .count();
        let checked = tm
            .cache
            .read_run_uncached(list[bi], run, BlockKind::Array, &mut buf)?;
        for (i, (ok, d)) in checked.into_iter().zip(buf.chunks_exact(BLOCK_SIZE)).enumerate() {
            ok?;
            let d = <&Block>::try_from(d).map_err(|_| corrupt(list[bi + i], "short block"))?;
            decode_block(list[bi + i], (bi + i) as u64, len, d, &mut vals)?;
            f((bi + i) as u64 * mx, &vals)?;
        }
        bi += run;
    }
    Ok(())
}

/// The most blocks [`walk`] reads in one I/O (128 KiB).
const RUN_BLOCKS: usize = 32;

/// The values of array block `b`, the `bi`th of an array of `len` entries,
/// into `vals`; its header checked (full, or the last block holding the rest).
fn load_block<V: ArrayValue>(
    tm: &mut TransactionManager,
    b: u64,
    bi: u64,
    len: u64,
    vals: &mut Vec<V>,
) -> Result<()> {
    let d = tm.read(b, BlockKind::Array)?;
    decode_block(b, bi, len, d, vals)
}

/// [`load_block`] of block `b` read as `d` (validated).
fn decode_block<V: ArrayValue>(b: u64, bi: u64, len: u64, d: &Block, vals: &mut Vec<V>) -> Result<()> {
    let mx = max_entries(V::SIZE) as u64;
    let want = (len - bi * mx).min(mx) as usize;
    let n = check_block(b, d, V::SIZE)?;
    if n != want {
        return Err(corrupt(
            b,
            format!("array block {bi} has {n} entries, expected {want}"),
        ));
    }
    vals.clear();
    vals.extend((0..n).map(|i| {
        let o = value_off::<V>(i);
        V::decode(&d[o..o + V::SIZE])
    }));
    Ok(())
}

/// An array read entry by entry in any order, a block at a time (a copy from
/// one array to another holds one block of each, not the arrays): each block
/// checked as [`walk`] checks it.
pub struct Reader<V> {
    len: u64,
    list: Vec<u64>,
    at: Option<u64>,
    vals: Vec<V>,
}

impl<V: ArrayValue> Reader<V> {
    /// The array at `root`, which must have `len` entries.
    pub fn new(tm: &mut TransactionManager, root: u64, len: u64) -> Result<Reader<V>> {
        Ok(Reader {
            len,
            list: blocks::<V>(tm, root, len)?,
            at: None,
            vals: Vec::new(),
        })
    }

    /// Entry `i` (below the length).
    pub fn get(&mut self, tm: &mut TransactionManager, i: u64) -> Result<V> {
        let mx = max_entries(V::SIZE) as u64;
        let bi = i / mx;
        if self.at != Some(bi) {
            let Some(&b) = self.list.get(bi as usize) else {
                return Err(PdataError::Invalid(format!(
                    "array entry {i} is past its {} entries",
                    self.len
                )));
            };
            self.at = None;
            load_block(tm, b, bi, self.len, &mut self.vals)?;
            self.at = Some(bi);
        }
        Ok(self.vals[(i % mx) as usize])
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::pdata::cache::BlockCache;
    use crate::pdata::space_map::{SmKind, SpaceMap};
    use crate::pdata::MemDev;

    pub(crate) fn tm(nr: u64) -> TransactionManager {
        let cache = BlockCache::new(Box::new(MemDev::new(nr)), 64);
        let mut meta = SpaceMap::new(SmKind::Metadata, nr).unwrap();
        meta.set(0, 1).unwrap();
        TransactionManager::new(cache, meta, SpaceMap::empty(SmKind::Data))
    }

    fn all<V: ArrayValue>(tm: &mut TransactionManager, root: u64, len: u64) -> Vec<V> {
        let mut v = Vec::new();
        walk::<V>(tm, root, len, &mut |first, vals| {
            assert_eq!(first, v.len() as u64);
            v.extend_from_slice(vals);
            Ok(())
        })
        .unwrap();
        v
    }

    #[test]
    fn sizes() {
        assert_eq!(max_entries(4), 1018);
        assert_eq!(max_entries(8), 509);
        assert_eq!(nr_blocks(0, 4), 0);
        assert_eq!(nr_blocks(1018, 4), 1);
        assert_eq!(nr_blocks(1019, 4), 2);
    }

    #[test]
    fn grow_set_get_shrink() {
        let mut t = tm(512);
        let mut root = empty(&mut t).unwrap();
        assert!(all::<u32>(&mut t, root, 0).is_empty());
        root = resize(&mut t, root, 0, 2500, 7u32).unwrap();
        // two full blocks share one array block
        let bl = blocks::<u32>(&mut t, root, 2500).unwrap();
        assert_eq!(bl.len(), 3);
        assert_eq!(bl[0], bl[1]);
        assert_eq!(t.meta.count(bl[0]), 2);
        root = set(&mut t, root, 5, 1u32).unwrap();
        root = set(&mut t, root, 2499, 9u32).unwrap();
        // the write to a shared block copied it
        let bl = blocks::<u32>(&mut t, root, 2500).unwrap();
        assert_ne!(bl[0], bl[1]);
        assert_eq!((t.meta.count(bl[0]), t.meta.count(bl[1])), (1, 1));
        assert_eq!(get::<u32>(&mut t, root, 5).unwrap(), 1);
        assert_eq!(get::<u32>(&mut t, root, 1018 + 5).unwrap(), 7);
        let v = all::<u32>(&mut t, root, 2500);
        assert_eq!(v.len(), 2500);
        assert_eq!((v[5], v[6], v[2499]), (1, 7, 9));
        // grow the partial last block, then shrink into the first block
        root = resize(&mut t, root, 2500, 3100, 3u32).unwrap();
        let v = all::<u32>(&mut t, root, 3100);
        assert_eq!((v[2499], v[2500], v[3099]), (9, 3, 3));
        root = resize(&mut t, root, 3100, 10, 0u32).unwrap();
        assert_eq!(all::<u32>(&mut t, root, 10), [7, 7, 7, 7, 7, 1, 7, 7, 7, 7]);
        assert!(get::<u32>(&mut t, root, 10).is_err());
        // a wrong length is refused, whichever way it is wrong
        assert!(walk::<u32>(&mut t, root, 11, &mut |_, _| Ok(())).is_err());
        let e = blocks::<u32>(&mut t, root, 5000).unwrap_err().to_string();
        assert!(
            e.contains("array has 1 blocks, but its 5000 entries need 5"),
            "{e}"
        );
        let e = blocks::<u32>(&mut t, root, 0).unwrap_err().to_string();
        assert!(e.contains("more blocks than its 0 entries need"), "{e}");
        assert_eq!(len::<u32>(&mut t, root, 10).unwrap(), 10);
        let e = len::<u32>(&mut t, root, 9).unwrap_err().to_string();
        assert!(e.contains("array has 10 entries, more than 9"), "{e}");
        // deleting frees every block but the tree's own root's block count
        del(&mut t, root).unwrap();
        assert_eq!(t.meta.nr_allocated(), 1);
    }

    #[test]
    fn built_arrays_read_back() {
        let mut t = tm(128);
        let vals: Vec<u32> = (0..5000).collect();
        let root = build(&mut t, 5000, &vals[..4000]).unwrap();
        assert_eq!(all::<u32>(&mut t, root, 5000)[..4000], vals[..4000]);
        assert!(all::<u32>(&mut t, root, 5000)[4000..].iter().all(|&v| v == 0));
        let root = set(&mut t, root, 4999, 1u32).unwrap();
        assert_eq!(get::<u32>(&mut t, root, 4999).unwrap(), 1);
        let e = build::<u64>(&mut t, 0, &[]).unwrap();
        assert!(all::<u64>(&mut t, e, 0).is_empty());
    }

    #[test]
    fn u64_values_and_lying_headers() {
        let mut t = tm(64);
        let mut root = empty(&mut t).unwrap();
        root = resize(&mut t, root, 0, 600, u64::MAX).unwrap();
        root = set(&mut t, root, 599, 5u64).unwrap();
        assert_eq!(all::<u64>(&mut t, root, 600)[599], 5);
        let b = blocks::<u64>(&mut t, root, 600).unwrap()[1];
        // a header that claims more entries than fit
        put32(t.write(b, BlockKind::Array).unwrap(), 8, 4000);
        let e = walk::<u64>(&mut t, root, 600, &mut |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("4000 entries, more than max_entries 509"), "{e}");
        // a value size the array does not have
        let e = walk::<u32>(&mut t, root, 600, &mut |_, _| Ok(()));
        assert!(e.is_err());
        put32(t.write(b, BlockKind::Array).unwrap(), 8, 90);
        let e = walk::<u64>(&mut t, root, 600, &mut |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("array block 1 has 90 entries, expected 91"), "{e}");
    }
}
