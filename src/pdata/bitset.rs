//! The kernel's dm-bitset: bits kept in a dm-array of u64 words, bit `i` in
//! word `i / 64` at position `i % 64`.

use super::array;
use super::bounds;
use super::error::Result;
use super::tm::TransactionManager;

/// Words a bitset of `nr_bits` has.
pub fn nr_words(nr_bits: u64) -> u64 {
    nr_bits.div_ceil(64)
}

/// A new bitset of `nr_bits`, all clear.
pub fn new(tm: &mut TransactionManager, nr_bits: u64) -> Result<u64> {
    let root = array::empty(tm)?;
    array::resize(tm, root, 0, nr_words(nr_bits), 0u64)
}

/// Resize from `old_bits` to `new_bits`, new bits `value`.
pub fn resize(
    tm: &mut TransactionManager,
    root: u64,
    old_bits: u64,
    new_bits: u64,
    value: bool,
) -> Result<u64> {
    let fill = if value { u64::MAX } else { 0 };
    let mut root = array::resize(tm, root, nr_words(old_bits), nr_words(new_bits), fill)?;
    if value && new_bits > old_bits && !old_bits.is_multiple_of(64) {
        // the old last word's unused bits become bits of the set
        let w = old_bits / 64;
        let cur: u64 = array::get(tm, root, w)?;
        root = array::set(tm, root, w, cur | (u64::MAX << (old_bits % 64)))?;
    }
    Ok(root)
}

/// Drop one reference to the bitset.
pub fn del(tm: &mut TransactionManager, root: u64) -> Result<()> {
    array::del(tm, root)
}

pub fn test(tm: &mut TransactionManager, root: u64, bit: u64) -> Result<bool> {
    let w: u64 = array::get(tm, root, bit / 64)?;
    Ok(w & (1 << (bit % 64)) != 0)
}

/// Set `bit`; returns the new root.
pub fn set(tm: &mut TransactionManager, root: u64, bit: u64) -> Result<u64> {
    let w: u64 = array::get(tm, root, bit / 64)?;
    let m = 1u64 << (bit % 64);
    if w & m != 0 {
        return Ok(root);
    }
    array::set(tm, root, bit / 64, w | m)
}

/// Set every bit whose word in `words` has it (a whole in-core copy written
/// back): only words that differ are written. Returns the new root.
pub fn or_words(tm: &mut TransactionManager, root: u64, first_word: u64, words: &[u64]) -> Result<u64> {
    let mut root = root;
    for (i, &w) in words.iter().enumerate() {
        if w == 0 {
            continue;
        }
        let at = first_word + i as u64;
        let cur: u64 = array::get(tm, root, at)?;
        if cur | w != cur {
            root = array::set(tm, root, at, cur | w)?;
        }
    }
    Ok(root)
}

/// The whole bitset of `nr_bits` in core, as words (bits past `nr_bits`
/// cleared). The word count is bounded by memory, and the tree must hold
/// exactly that many words before anything else is read.
pub fn read(tm: &mut TransactionManager, root: u64, nr_bits: u64) -> Result<Vec<u64>> {
    let n = nr_words(nr_bits);
    array::blocks::<u64>(tm, root, n)?;
    let mut out: Vec<u64> = bounds::zeroed_vec(root, "bitset words", n)?;
    array::walk::<u64>(tm, root, n, &mut |first, vals| {
        let f = first as usize;
        out[f..f + vals.len()].copy_from_slice(vals);
        Ok(())
    })?;
    if !nr_bits.is_multiple_of(64) {
        if let Some(last) = out.last_mut() {
            *last &= (1u64 << (nr_bits % 64)) - 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_test_read_resize() {
        let mut t = array::tests::tm(128);
        let mut root = new(&mut t, 1000).unwrap();
        for b in [0u64, 63, 64, 999] {
            root = set(&mut t, root, b).unwrap();
        }
        assert!(test(&mut t, root, 63).unwrap() && !test(&mut t, root, 62).unwrap());
        let w = read(&mut t, root, 1000).unwrap();
        assert_eq!(w.len(), 16);
        assert_eq!((w[0], w[1], w[15]), (1 | 1 << 63, 1, 1 << (999 - 960)));
        root = resize(&mut t, root, 1000, 1030, true).unwrap();
        let w = read(&mut t, root, 1030).unwrap();
        assert_eq!(w[15], (1 << 39) | (u64::MAX << 40));
        assert_eq!(w[16], (1 << 6) - 1);
        root = or_words(&mut t, root, 1, &[2, 0]).unwrap();
        assert_eq!(read(&mut t, root, 1030).unwrap()[1], 3);
        assert!(test(&mut t, root, 2000).is_err());
        // a bitset whose tree is shorter than its stated size is refused
        let e = read(&mut t, root, 1 << 40).unwrap_err().to_string();
        assert!(e.contains("array has 1 blocks"), "{e}");
        del(&mut t, root).unwrap();
        assert_eq!(t.meta.nr_allocated(), 1);
    }
}
