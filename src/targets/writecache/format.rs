//! The kernel's writecache layout on the cache device (little-endian), at
//! `start_sector`: a 64-byte superblock, then `n_blocks` 16-byte entries
//! (original sector, seq_count), rounded up to the block size; then the data
//! blocks. An entry is committed iff its seq_count is below the superblock's; free
//! entries carry seq_count all-ones.
//!
//! Pure bookkeeping: the caller reads and writes the bytes.

use crate::mapper::TargetError;

pub const MAGIC: u32 = 0x2348_9321;
pub const VERSION: u32 = 1;
pub const SB_BYTES: u64 = 64;
pub const ENTRY_BYTES: u64 = 16;
/// seq_count (and original sector) of a free entry.
pub const FREE: u64 = u64::MAX;

crate::layout! {
    /// The superblock's fields (the kernel's `struct wc_memory_superblock`:
    /// magic, version, block_size, a pad, n_blocks, seq_count, in 64 bytes).
    pub struct Superblock("writecache superblock", SB_BYTES as usize) {
        pub magic: u32 = 0,
        pub version: u32 = 4,
        pub block_size: u32 = 8,
        pub n_blocks: u64 = 16,
        pub seq_count: u64 = 24,
    }
}

crate::layout! {
    /// An entry (`struct wc_memory_entry`): the original sector and seq_count.
    struct Entry("writecache entry", ENTRY_BYTES as usize) {
        sector: u64 = 0,
        seq: u64 = 8,
    }
}

impl Superblock {
    /// The superblock from the metadata's first bytes; Err names the field
    /// that lies past them.
    pub fn parse(b: &[u8]) -> Result<Superblock, crate::layout::LayoutError> {
        Superblock::decode(b)
    }

    /// Write the superblock into the first 64 bytes of `b` (the rest of those
    /// zero); `b` holds at least the metadata's first block.
    pub fn store(&self, b: &mut [u8]) {
        if let Some(head) = b.get_mut(..Superblock::SIZE) {
            head.copy_from_slice(&self.encode());
        }
    }
}

/// Bytes of the metadata (superblock and entries), rounded up to the block size.
pub fn metadata_bytes(n_blocks: u64, block_size: u64) -> Option<u64> {
    let raw = n_blocks.checked_mul(ENTRY_BYTES)?.checked_add(SB_BYTES)?;
    raw.checked_next_multiple_of(block_size)
}

/// How many blocks a fresh cache of `area` bytes holds: the largest n whose
/// metadata and data fit (None: not even one).
pub fn blocks_for(area: u64, block_size: u64) -> Option<u64> {
    let mut n = area / (block_size + ENTRY_BYTES);
    while n > 0 {
        let fits = metadata_bytes(n, block_size)
            .and_then(|m| m.checked_add(n.checked_mul(block_size)?))
            .is_some_and(|total| total <= area);
        if fits {
            return Some(n);
        }
        n -= 1;
    }
    None
}

/// Byte offset of entry `i` in the metadata.
pub fn entry_offset(i: u64) -> usize {
    (SB_BYTES + i * ENTRY_BYTES) as usize
}

/// Entry `i`: (original sector, seq_count); `meta` holds `i` (the image is
/// [`metadata_bytes`] long for its `n_blocks`), else it reads as free.
pub fn entry(meta: &[u8], i: u64) -> (u64, u64) {
    match meta.get(entry_offset(i)..).map(Entry::decode) {
        Some(Ok(e)) => (e.sector, e.seq),
        _ => (FREE, FREE),
    }
}

/// Set entry `i` (which `meta` holds, as for [`entry`]).
pub fn set_entry(meta: &mut [u8], i: u64, sector: u64, seq: u64) {
    if let Some(b) = meta.get_mut(entry_offset(i)..) {
        let _ = Entry { sector, seq }.encode_into(b);
    }
}

/// A fresh metadata image as the kernel initialises it: every entry free; the
/// magic is left 0 (it is written last, once everything else is on disk).
pub fn fresh(n_blocks: u64, block_size: u32) -> Option<Vec<u8>> {
    let len = usize::try_from(metadata_bytes(n_blocks, u64::from(block_size))?).ok()?;
    let mut b = vec![0u8; len];
    Superblock {
        magic: 0,
        version: VERSION,
        block_size,
        n_blocks,
        seq_count: 0,
    }
    .store(&mut b);
    b[SB_BYTES as usize..entry_offset(n_blocks)].fill(0xFF);
    Some(b)
}

/// What a metadata image holds once the uncommitted entries are dropped.
#[derive(Debug, Default)]
pub struct Loaded {
    /// Committed entries: (index, original sector, seq_count), the survivor of each sector.
    pub used: Vec<(u64, u64, u64)>,
    /// Entries to clear on disk (uncommitted, or older duplicates): their seq_count
    /// becomes FREE.
    pub cleared: Vec<u64>,
}

/// Sort out the entries of `meta` as the kernel's resume does: uncommitted ones
/// (seq_count ≥ the superblock's) are dropped, of two committed entries for one
/// sector the newer (higher seq_count) wins, and two with the same seq_count are
/// corrupt metadata. A committed entry whose block does not lie within the first
/// `origin_sectors` sectors of the origin is corrupt too: it could never be
/// written back.
pub fn load(
    meta: &[u8],
    n_blocks: u64,
    sb_seq: u64,
    block_sectors: u64,
    origin_sectors: u64,
) -> Result<Loaded, TargetError> {
    let mut out = Loaded::default();
    let mut by_sector: std::collections::HashMap<u64, (u64, u64)> = std::collections::HashMap::new();
    for i in 0..n_blocks {
        let (sector, seq) = entry(meta, i);
        if seq == FREE {
            continue;
        }
        if seq >= sb_seq {
            out.cleared.push(i);
            continue;
        }
        if block_sectors > 1 && sector % block_sectors != 0 {
            return Err(format!(
                "writecache: entry {i} maps sector {sector}, which is not a multiple of the block size ({block_sectors} sectors)"
            ).into());
        }
        if sector
            .checked_add(block_sectors.max(1))
            .is_none_or(|end| end > origin_sectors)
        {
            return Err(format!(
                "writecache: entry {i} maps sector {sector}, past the end of the origin ({origin_sectors} sectors)"
            ).into());
        }
        match by_sector.get(&sector).copied() {
            None => {
                by_sector.insert(sector, (i, seq));
            }
            Some((j, s)) if s == seq => {
                return Err(format!(
                "writecache: two identical entries, position {j} and {i}: sector {sector}, seq_count {seq}"
            ).into())
            }
            Some((_, s)) if s > seq => out.cleared.push(i),
            Some((j, _)) => {
                out.cleared.push(j);
                by_sector.insert(sector, (i, seq));
            }
        }
    }
    out.used = by_sector
        .into_iter()
        .map(|(sec, (i, seq))| (i, sec, seq))
        .collect();
    out.used.sort_unstable();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizing_matches_the_kernel_rule() {
        // 1 MiB, 4 KiB blocks: 255 blocks need 64 + 255·16 = 4144 → 8192 bytes of
        // metadata + 255·4096 > 1 MiB, so 254.
        assert_eq!(blocks_for(1 << 20, 4096), Some(254));
        assert_eq!(metadata_bytes(254, 4096), Some(8192));
        assert_eq!(blocks_for(4096, 4096), None);
        assert_eq!(blocks_for(8192, 4096), Some(1));
        assert_eq!(blocks_for(1024, 512), Some(1));
    }

    #[test]
    fn load_keeps_the_newest_committed_entry() {
        let mut m = fresh(6, 512).unwrap();
        set_entry(&mut m, 0, 80, 3); // committed
        set_entry(&mut m, 1, 80, 5); // committed, newer: wins
        set_entry(&mut m, 2, 16, 7); // uncommitted (sb seq 7)
        set_entry(&mut m, 3, 24, 1);
        let l = load(&m, 6, 7, 1, 1 << 20).unwrap();
        assert_eq!(l.used, vec![(1, 80, 5), (3, 24, 1)]);
        let mut c = l.cleared.clone();
        c.sort_unstable();
        assert_eq!(c, vec![0, 2]);
        set_entry(&mut m, 4, 24, 1);
        let e = load(&m, 6, 7, 1, 1 << 20).unwrap_err();
        assert!(e.what().contains("two identical entries"), "{e}");
    }

    #[test]
    fn load_refuses_an_entry_past_the_origin() {
        let mut m = fresh(6, 4096).unwrap();
        set_entry(&mut m, 0, u64::MAX - 7, 1);
        let e = load(&m, 6, 7, 8, 1 << 20).unwrap_err();
        assert!(
            e.what().contains("entry 0") && e.what().contains("past the end of the origin"),
            "{e}"
        );
        set_entry(&mut m, 0, (1 << 20) - 8, 1);
        assert!(load(&m, 6, 7, 8, 1 << 20).is_ok());
        set_entry(&mut m, 0, 1 << 20, 1);
        assert!(load(&m, 6, 7, 8, 1 << 20).is_err());
    }

    #[test]
    fn load_refuses_an_entry_off_the_block_grid() {
        // found by fuzzing: an entry at sector 2044 of a 4 KiB-block cache mapped a
        // read past the end of its request
        let mut m = fresh(6, 4096).unwrap();
        set_entry(&mut m, 0, 16, 1);
        assert!(load(&m, 6, 7, 8, 1 << 20).is_ok());
        set_entry(&mut m, 1, 2044, 2);
        let e = load(&m, 6, 7, 8, 1 << 20).unwrap_err();
        assert!(
            e.what().contains("entry 1 maps sector 2044") && e.what().contains("block size"),
            "{e}"
        );
    }

    #[test]
    fn superblock_round_trip() {
        let mut b = fresh(3, 4096).unwrap();
        let mut sb = Superblock::parse(&b).unwrap();
        assert_eq!(
            (sb.magic, sb.version, sb.block_size, sb.n_blocks),
            (0, 1, 4096, 3)
        );
        sb.magic = MAGIC;
        sb.seq_count = 9;
        sb.store(&mut b);
        assert_eq!(Superblock::parse(&b), Ok(sb));
        assert_eq!(entry(&b, 2), (FREE, FREE));
    }
}
