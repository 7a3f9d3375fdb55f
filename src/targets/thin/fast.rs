//! Thin's lock-free fast path: a direct-mapped cache of a thin's mapped, unshared
//! blocks, read without the pool lock.
//!
//! Each slot is one atomic word: a valid bit, the virtual block's high bits (the
//! low bits are the slot index) and the data block, so a reader never sees half an
//! entry. Entries are only added under the pool lock, from a lookup that found the
//! block mapped and unshared, and every change that could make one stale clears it
//! under the same lock before the change: a discard (its block), a new mapping
//! (its block), a pool message such as create_snap or delete, and a metadata
//! failure (all). A reader enters the pool device before it looks (see
//! `ThinDev::map_piece`), so the commit that frees a block waits for it.

use std::sync::atomic::{AtomicU64, Ordering};

/// At most 2^14 slots (128 KiB) per active thin: a thin of up to 16 Ki blocks
/// (1 GiB of 64 KiB blocks) is cached whole; a larger one keeps the blocks last
/// looked up, one per slot, and the others take the locked path.
const MAX_SLOTS_LOG2: u32 = 14;
const DATA_BITS: u32 = 40;
const TAG_BITS: u32 = 63 - DATA_BITS;
const VALID: u64 = 1 << 63;

pub struct FastMap {
    slots: Box<[AtomicU64]>,
    log2: u32,
}

impl FastMap {
    /// A cache for a thin of `blocks` blocks.
    pub fn new(blocks: u64) -> FastMap {
        let log2 = blocks
            .max(2)
            .next_power_of_two()
            .trailing_zeros()
            .min(MAX_SLOTS_LOG2);
        FastMap {
            slots: (0..1usize << log2).map(|_| AtomicU64::new(0)).collect(),
            log2,
        }
    }

    fn slot_tag(&self, vblock: u64) -> (usize, u64) {
        ((vblock as usize) & ((1 << self.log2) - 1), vblock >> self.log2)
    }

    /// The data block of `vblock`, if cached.
    #[inline]
    pub fn get(&self, vblock: u64) -> Option<u64> {
        let (i, tag) = self.slot_tag(vblock);
        let v = self.slots[i].load(Ordering::SeqCst);
        (v & VALID != 0 && (v >> DATA_BITS) & ((1 << TAG_BITS) - 1) == tag)
            .then_some(v & ((1 << DATA_BITS) - 1))
    }

    /// Cache `vblock` → `data` (mapped and unshared, seen under the pool lock).
    /// Blocks whose numbers do not fit a slot are not cached.
    pub fn set(&self, vblock: u64, data: u64) {
        let (i, tag) = self.slot_tag(vblock);
        if tag >= 1 << TAG_BITS || data >= 1 << DATA_BITS {
            return;
        }
        self.slots[i].store(VALID | (tag << DATA_BITS) | data, Ordering::SeqCst);
    }

    /// Forget whatever the slot of `vblock` holds.
    pub fn forget(&self, vblock: u64) {
        self.slots[self.slot_tag(vblock).0].store(0, Ordering::SeqCst);
    }

    pub fn clear(&self) {
        for s in self.slots.iter() {
            s.store(0, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOTS: usize = 1 << MAX_SLOTS_LOG2;

    #[test]
    fn set_get_forget_and_collisions() {
        let f = FastMap::new(1 << 40);
        assert_eq!(f.slots.len(), SLOTS);
        assert_eq!(f.get(5), None);
        f.set(5, 77);
        assert_eq!(f.get(5), Some(77));
        // same slot, other block: not confused with it
        assert_eq!(f.get(5 + SLOTS as u64), None);
        f.set(5 + SLOTS as u64, 9);
        assert_eq!(f.get(5), None);
        assert_eq!(f.get(5 + SLOTS as u64), Some(9));
        f.forget(5);
        assert_eq!(f.get(5 + SLOTS as u64), None);
        // too large to cache
        f.set(1, 1 << DATA_BITS);
        assert_eq!(f.get(1), None);
        f.set(2, 3);
        f.clear();
        assert_eq!(f.get(2), None);
    }

    #[test]
    fn small_thins_get_small_caches() {
        let f = FastMap::new(3);
        assert_eq!(f.slots.len(), 4);
        f.set(1, 10);
        f.set(5, 50); // the same slot as 1
        assert_eq!(f.get(1), None);
        assert_eq!(f.get(5), Some(50));
        assert_eq!(FastMap::new(0).slots.len(), 2);
    }
}
