//! The kernel's btree node layout: a 32-byte header, `max_entries` keys, then
//! `max_entries` values (not `nr_entries`: values start after the full key array).

use crate::pdata::error::{corrupt, Result};
use crate::pdata::{le32, le64, put32, put64, Block, BLOCK_SIZE};

pub const INTERNAL: u32 = 1;
pub const LEAF: u32 = 2;
pub const HEADER: usize = 32;

/// max_entries for a value size, rounded down to a multiple of 3 like the kernel.
pub const fn max_entries(value_size: usize) -> usize {
    let n = (BLOCK_SIZE - HEADER) / (8 + value_size);
    3 * (n / 3)
}

pub fn flags(d: &Block) -> u32 {
    le32(d, 4)
}
pub fn is_leaf(d: &Block) -> bool {
    flags(d) == LEAF
}
pub fn nr_entries(d: &Block) -> usize {
    le32(d, 16) as usize
}
pub fn max(d: &Block) -> usize {
    le32(d, 20) as usize
}
pub fn value_size(d: &Block) -> usize {
    le32(d, 24) as usize
}
pub fn key(d: &Block, i: usize) -> u64 {
    le64(d, HEADER + 8 * i)
}
fn value_off(d: &Block, i: usize) -> usize {
    HEADER + 8 * max(d) + i * value_size(d)
}
pub fn value(d: &Block, i: usize) -> &[u8] {
    let off = value_off(d, i);
    &d[off..off + value_size(d)]
}
pub fn value_u64(d: &Block, i: usize) -> u64 {
    le64(d, value_off(d, i))
}

/// Check the header of a node read at `block`; `leaf_vs` is the value size
/// this tree's leaves must have. Everything used for indexing is bounded here,
/// so later accessors cannot go out of range.
pub fn check_header(block: u64, d: &Block, leaf_vs: usize) -> Result<()> {
    let f = flags(d);
    let vs = value_size(d);
    let (want_vs, what) = match f {
        INTERNAL => (8, "internal"),
        LEAF => (leaf_vs, "leaf"),
        _ => return Err(corrupt(block, format!("btree node has bad flags {f}"))),
    };
    if vs != want_vs {
        return Err(corrupt(
            block,
            format!("{what} btree node has value size {vs}, expected {want_vs}"),
        ));
    }
    let m = max(d);
    if m != max_entries(vs) {
        return Err(corrupt(
            block,
            format!("btree node has max_entries {m}, expected {}", max_entries(vs)),
        ));
    }
    let n = nr_entries(d);
    if n > m {
        return Err(corrupt(
            block,
            format!("btree node has {n} entries, more than max_entries {m}"),
        ));
    }
    Ok(())
}

/// Index of the largest key <= k, or None.
pub fn lower_bound(d: &Block, k: u64) -> Option<usize> {
    let (mut lo, mut hi) = (0usize, nr_entries(d));
    // invariant: keys[..lo] <= k, keys[hi..] > k
    while lo < hi {
        let mid = (lo + hi) / 2;
        if key(d, mid) <= k {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo.checked_sub(1)
}

/// Exact-match search in a leaf.
pub fn find(d: &Block, k: u64) -> Option<usize> {
    lower_bound(d, k).filter(|&i| key(d, i) == k)
}

pub fn init(d: &mut Block, flags: u32, value_size: usize) {
    d[HEADER..].fill(0);
    put32(d, 4, flags);
    put32(d, 16, 0);
    put32(d, 20, max_entries(value_size) as u32);
    put32(d, 24, value_size as u32);
    put32(d, 28, 0);
}

pub fn set_nr_entries(d: &mut Block, n: usize) {
    put32(d, 16, n as u32);
}
pub fn set_key(d: &mut Block, i: usize, k: u64) {
    put64(d, HEADER + 8 * i, k);
}
pub fn set_value(d: &mut Block, i: usize, v: &[u8]) {
    let off = value_off(d, i);
    d[off..off + v.len()].copy_from_slice(v);
}
pub fn set_value_u64(d: &mut Block, i: usize, v: u64) {
    let off = value_off(d, i);
    put64(d, off, v);
}

/// Insert at position i, shifting later entries right. Caller ensures room.
pub fn insert_at(d: &mut Block, i: usize, k: u64, v: &[u8]) {
    let n = nr_entries(d);
    let vs = value_size(d);
    let kb = HEADER + 8 * i;
    d.copy_within(kb..HEADER + 8 * n, kb + 8);
    let vb = value_off(d, i);
    d.copy_within(vb..vb + (n - i) * vs, vb + vs);
    set_nr_entries(d, n + 1);
    set_key(d, i, k);
    set_value(d, i, v);
}

pub fn remove_at(d: &mut Block, i: usize) {
    let n = nr_entries(d);
    let vs = value_size(d);
    let kb = HEADER + 8 * i;
    d.copy_within(kb + 8..HEADER + 8 * n, kb);
    let vb = value_off(d, i);
    d.copy_within(vb + vs..vb + (n - i) * vs, vb);
    set_nr_entries(d, n - 1);
}

/// Append entries [from, from+count) of `src` to the end of `dst` (same value size).
pub fn append_from(dst: &mut Block, src: &Block, from: usize, count: usize) {
    let n = nr_entries(dst);
    let vs = value_size(src);
    for j in 0..count {
        set_key(dst, n + j, key(src, from + j));
    }
    let so = value_off(src, from);
    let doff = value_off(dst, n);
    dst[doff..doff + count * vs].copy_from_slice(&src[so..so + count * vs]);
    set_nr_entries(dst, n + count);
}

/// Keep only entries [from, from+count), moved to the front.
pub fn keep_range(d: &mut Block, from: usize, count: usize) {
    let vs = value_size(d);
    d.copy_within(HEADER + 8 * from..HEADER + 8 * (from + count), HEADER);
    let so = value_off(d, from);
    let d0 = value_off(d, 0);
    d.copy_within(so..so + count * vs, d0);
    set_nr_entries(d, count);
}

/// Prepend entries [from, from+count) of `src` in front of `dst`'s entries.
pub fn prepend_from(dst: &mut Block, src: &Block, from: usize, count: usize) {
    let n = nr_entries(dst);
    let vs = value_size(dst);
    dst.copy_within(HEADER..HEADER + 8 * n, HEADER + 8 * count);
    let d0 = value_off(dst, 0);
    dst.copy_within(d0..d0 + n * vs, d0 + count * vs);
    for j in 0..count {
        set_key(dst, j, key(src, from + j));
    }
    let so = value_off(src, from);
    dst[d0..d0 + count * vs].copy_from_slice(&src[so..so + count * vs]);
    set_nr_entries(dst, n + count);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_entries_table() {
        assert_eq!(max_entries(8), 252);
        assert_eq!(max_entries(16), 168);
        assert_eq!(max_entries(24), 126);
        assert_eq!(max_entries(4), 336);
    }

    #[test]
    fn insert_remove_search() {
        let mut d = [0u8; BLOCK_SIZE];
        init(&mut d, LEAF, 8);
        for k in [5u64, 1, 9, 3] {
            let pos = lower_bound(&d, k).map_or(0, |i| i + 1);
            insert_at(&mut d, pos, k, &(k * 10).to_le_bytes());
        }
        let keys: Vec<u64> = (0..nr_entries(&d)).map(|i| key(&d, i)).collect();
        assert_eq!(keys, [1, 3, 5, 9]);
        assert_eq!(value_u64(&d, find(&d, 5).unwrap()), 50);
        assert_eq!(find(&d, 4), None);
        assert_eq!(lower_bound(&d, 0), None);
        remove_at(&mut d, 1);
        assert_eq!(value_u64(&d, find(&d, 9).unwrap()), 90);
        assert_eq!(nr_entries(&d), 3);
    }
}
