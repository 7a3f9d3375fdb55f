//! An exact cache of recent mapping lookups: (device, virtual block) -> the
//! raw block_time value. Every change to a mapping goes through
//! `ThinPoolMetadata`, which keeps this cache in step, so a hit is always the
//! value the btree holds.
//!
//! Sets of four ways, each set one 64-byte cache line (four tags, then four
//! values), so a hit costs one memory access instead of a walk through four
//! btree levels. A device gets a cache id on first use; deleting the device
//! retires its id, so its entries can never match again and age out.

use crate::pdata::cache::FastMap;

const WAYS: usize = 4;
/// u64 words per set: WAYS tags, then WAYS values.
const SET_WORDS: usize = 2 * WAYS;
const VBLOCK_BITS: u32 = 40;
/// Cache ids fit above the virtual block in a tag.
const MAX_CID: u64 = (1 << (64 - VBLOCK_BITS)) - 1;

pub struct MapCache {
    /// Lazily allocated (zeroed pages cost nothing until touched).
    words: Vec<u64>,
    /// Index of the first word of set 0 (aligns sets to cache lines).
    start: usize,
    nr_sets: usize,
    cids: FastMap<u64, u64>,
    next_cid: u64,
}

impl MapCache {
    /// A cache of about `bytes` bytes (rounded down to a power of two sets;
    /// 0 disables it).
    pub fn new(bytes: usize) -> MapCache {
        let sets = bytes / (SET_WORDS * 8);
        let nr_sets = if sets == 0 { 0 } else { 1 << sets.ilog2() };
        MapCache {
            words: Vec::new(),
            start: 0,
            nr_sets,
            cids: FastMap::default(),
            next_cid: 1,
        }
    }

    fn tag(cid: u64, vblock: u64) -> u64 {
        (cid << VBLOCK_BITS) | vblock
    }

    /// Consecutive blocks of a device go to consecutive sets (dense ranges,
    /// the common case, never collide with themselves); each window of
    /// `nr_sets` blocks, and each device, starts at a hashed offset.
    fn set_of(&self, tag: u64) -> usize {
        let bits = self.nr_sets.trailing_zeros();
        let window = (tag >> bits).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let idx = (tag.wrapping_add(window) as usize) & (self.nr_sets - 1);
        self.start + SET_WORDS * idx
    }

    fn set(&self, tag: u64) -> Option<&[u64; SET_WORDS]> {
        let i = self.set_of(tag);
        self.words.get(i..i + SET_WORDS)?.try_into().ok()
    }

    fn set_mut(&mut self, tag: u64) -> Option<&mut [u64; SET_WORDS]> {
        let i = self.set_of(tag);
        self.words.get_mut(i..i + SET_WORDS)?.try_into().ok()
    }

    pub fn get(&self, dev: u64, vblock: u64) -> Option<u64> {
        if vblock >> VBLOCK_BITS != 0 {
            return None;
        }
        let tag = Self::tag(*self.cids.get(&dev)?, vblock);
        let s = self.set(tag)?;
        (0..WAYS).find(|&w| s[w] == tag).map(|w| s[WAYS + w])
    }

    fn alloc(&mut self) {
        // One spare set's worth of words lets set 0 start on a 64-byte boundary.
        self.words = vec![0u64; (self.nr_sets + 1) * SET_WORDS];
        let misalign = (self.words.as_ptr() as usize / 8) % SET_WORDS;
        self.start = (SET_WORDS - misalign) % SET_WORDS;
    }

    /// Record `dev`/`vblock` -> `value` (replacing any entry for it).
    pub fn put(&mut self, dev: u64, vblock: u64, value: u64) {
        if self.nr_sets == 0 || vblock >> VBLOCK_BITS != 0 {
            return;
        }
        let cid = match self.cids.get(&dev) {
            Some(&c) => c,
            None => {
                if self.next_cid > MAX_CID {
                    self.clear();
                }
                let c = self.next_cid;
                self.next_cid += 1;
                self.cids.insert(dev, c);
                c
            }
        };
        if self.words.is_empty() {
            self.alloc();
        }
        let tag = Self::tag(cid, vblock);
        let Some(s) = self.set_mut(tag) else { return };
        if let Some(w) = (0..WAYS).find(|&w| s[w] == tag) {
            s[WAYS + w] = value;
            return;
        }
        // Newest in way 0; the oldest falls out.
        s.copy_within(0..WAYS - 1, 1);
        s.copy_within(WAYS..2 * WAYS - 1, WAYS + 1);
        s[0] = tag;
        s[WAYS] = value;
    }

    pub fn forget(&mut self, dev: u64, vblock: u64) {
        if vblock >> VBLOCK_BITS != 0 {
            return;
        }
        let Some(&cid) = self.cids.get(&dev) else { return };
        let tag = Self::tag(cid, vblock);
        if let Some(s) = self.set_mut(tag) {
            if let Some(w) = (0..WAYS).find(|&w| s[w] == tag) {
                s[w] = 0;
            }
        }
    }

    /// Forget every entry of `dev` (it was deleted).
    pub fn forget_device(&mut self, dev: u64) {
        self.cids.remove(&dev);
    }

    /// Forget everything and give the memory back.
    pub fn clear(&mut self) {
        self.words = Vec::new();
        self.cids.clear();
        self.next_cid = 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_get_forget_and_device_ids() {
        let mut c = MapCache::new(64 * 16);
        assert_eq!(c.get(1, 5), None);
        c.put(1, 5, 50);
        c.put(2, 5, 99);
        assert_eq!(c.get(1, 5), Some(50));
        assert_eq!(c.get(2, 5), Some(99));
        c.put(1, 5, 51);
        assert_eq!(c.get(1, 5), Some(51));
        c.forget(1, 5);
        assert_eq!(c.get(1, 5), None);
        c.put(1, 6, 60);
        c.forget_device(1);
        assert_eq!(c.get(1, 6), None);
        // a re-created device id starts empty
        c.put(1, 7, 70);
        assert_eq!(c.get(1, 6), None);
        assert_eq!(c.get(1, 7), Some(70));
        assert_eq!(c.get(2, 5), Some(99));
        // out-of-range blocks are never cached
        c.put(1, 1 << 41, 1);
        assert_eq!(c.get(1, 1 << 41), None);
        c.clear();
        assert_eq!(c.get(2, 5), None);
    }

    #[test]
    fn sets_are_line_aligned_and_evict_oldest() {
        let mut c = MapCache::new(64);
        assert_eq!(c.nr_sets, 1);
        for v in 0..5 {
            c.put(0, v, v + 100);
        }
        assert_eq!((c.words.as_ptr() as usize + 8 * c.start) % 64, 0);
        assert_eq!(c.get(0, 0), None);
        for v in 1..5 {
            assert_eq!(c.get(0, v), Some(v + 100));
        }
        assert!(MapCache::new(0).get(0, 0).is_none());
    }
}
