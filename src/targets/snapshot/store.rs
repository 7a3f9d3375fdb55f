//! Exception stores: the kernel's persistent COW format (`P`, `PO`) and the
//! transient one (`N`).
//!
//! Persistent layout, in chunks of the COW device: chunk 0 is the header; metadata
//! area `i` is at chunk `1 + i·(E+1)`, where `E = chunk·512/16` entries fit in one
//! chunk; each area is followed by the E data chunks it describes. An entry is
//! (old_chunk, new_chunk), little-endian u64s, appended in commit order; the first
//! with new_chunk 0 ends the list, and a full area continues in the next one, which
//! is zeroed before the full one is committed.
//!
//! The state here is pure bookkeeping: the caller does the I/O it asks for
//! ([`Persistent::area_image`], [`header_image`]) in the order it asks.

use crate::io::SECTOR;

pub const SNAP_MAGIC: u32 = 0x7041_6e53;
pub const DISK_VERSION: u32 = 1;
/// Chunk size (sectors) when the table gives 0 and the header none: 16 KiB.
pub const DEFAULT_CHUNK_SECTORS: u64 = 32;
/// Header chunks before the first metadata area.
const HDR_CHUNKS: u64 = 1;
/// Bytes per on-disk exception.
const ENTRY: u64 = 16;

/// The on-disk header of a persistent store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub magic: u32,
    pub valid: u32,
    pub version: u32,
    pub chunk_size: u32,
}

impl Header {
    pub fn parse(b: &[u8]) -> Header {
        let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Header {
            magic: w(0),
            valid: w(4),
            version: w(8),
            chunk_size: w(12),
        }
    }
}

/// The header chunk: magic, valid, version 1, chunk size; the rest zero.
pub fn header_image(valid: bool, chunk: u64) -> Vec<u8> {
    let mut b = vec![0u8; (chunk * SECTOR) as usize];
    b[0..4].copy_from_slice(&SNAP_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&u32::from(valid).to_le_bytes());
    b[8..12].copy_from_slice(&DISK_VERSION.to_le_bytes());
    b[12..16].copy_from_slice(&(chunk as u32).to_le_bytes());
    b
}

/// Entries `(old, new)` of one metadata area's bytes, up to the end marker; and
/// whether the area is full (the list goes on in the next area).
pub fn parse_area(b: &[u8]) -> (Vec<(u64, u64)>, bool) {
    let mut out = Vec::new();
    for e in b.chunks_exact(ENTRY as usize) {
        let old = u64::from_le_bytes(e[0..8].try_into().unwrap_or_default());
        let new = u64::from_le_bytes(e[8..16].try_into().unwrap_or_default());
        if new == 0 {
            return (out, false);
        }
        out.push((old, new));
    }
    (out, true)
}

/// A persistent store's bookkeeping.
#[derive(Debug)]
pub struct Persistent {
    /// Chunk size in sectors.
    pub chunk: u64,
    /// Exceptions per metadata area (E).
    pub per_area: u64,
    /// Every committed exception, in commit order: area `i` holds
    /// `entries[i·E .. (i+1)·E]`.
    pub entries: Vec<(u64, u64)>,
    /// The area being filled and how many entries it holds.
    pub current_area: u64,
    pub committed: u64,
    /// The next chunk to hand out.
    pub next_free: u64,
    /// Exceptions handed out and not yet committed or given up.
    pub pending: u64,
    /// Entries appended since the area was last written (their callers wait).
    pub unwritten: u64,
}

/// What a commit asks the caller to write, in this order.
#[derive(Debug, Default)]
pub struct CommitIo {
    /// Zero metadata area at this chunk first (the area after a full one).
    pub zero_chunk: Option<u64>,
    /// Then write this image at this chunk, with a flush before and FUA.
    pub area: Option<(u64, Vec<u8>)>,
}

impl Persistent {
    /// A new, empty store (the header and area 0 are written by the caller).
    pub fn new(chunk: u64) -> Persistent {
        Persistent {
            chunk,
            per_area: chunk * SECTOR / ENTRY,
            entries: Vec::new(),
            current_area: 0,
            committed: 0,
            next_free: HDR_CHUNKS + 1,
            pending: 0,
            unwritten: 0,
        }
    }

    /// The chunk of metadata area `area`.
    pub fn area_chunk(&self, area: u64) -> u64 {
        HDR_CHUNKS + area * (self.per_area + 1)
    }

    /// Take in the entries of area `area` as read from disk (in order); `full`:
    /// the list continues in the next area.
    pub fn load_area(&mut self, area: u64, list: &[(u64, u64)], full: bool) {
        for &(_, new) in list {
            if self.next_free <= new {
                self.next_free = new + 1;
            }
        }
        self.entries.extend_from_slice(list);
        if full {
            self.current_area = area + 1;
            self.committed = 0;
        } else {
            self.current_area = area;
            self.committed = list.len() as u64;
        }
        self.skip_metadata();
    }

    fn skip_metadata(&mut self) {
        if self.next_free % (self.per_area + 1) == HDR_CHUNKS {
            self.next_free += 1;
        }
    }

    /// Hand out a COW chunk, or None when the device (`cow_sectors`) is full.
    pub fn prepare(&mut self, cow_sectors: u64) -> Option<u64> {
        if cow_sectors < (self.next_free + 1) * self.chunk {
            return None;
        }
        let c = self.next_free;
        self.next_free += 1;
        self.skip_metadata();
        self.pending += 1;
        Some(c)
    }

    /// An exception handed out will never be committed (its copy failed or never
    /// ran): what was appended may now need writing.
    pub fn abandon(&mut self) -> CommitIo {
        self.pending = self.pending.saturating_sub(1);
        if self.pending == 0 && self.unwritten > 0 {
            return self.flush_area();
        }
        CommitIo::default()
    }

    /// Append a completed exception. The area is written when nothing else is
    /// pending or it just filled up (the kernel batches commits so); until then
    /// `unwritten` counts the callers waiting.
    pub fn commit(&mut self, old: u64, new: u64) -> CommitIo {
        self.entries.push((old, new));
        self.committed += 1;
        self.unwritten += 1;
        self.pending = self.pending.saturating_sub(1);
        if self.pending == 0 || self.committed == self.per_area {
            return self.flush_area();
        }
        CommitIo::default()
    }

    fn flush_area(&mut self) -> CommitIo {
        let full = self.committed == self.per_area;
        let io = CommitIo {
            zero_chunk: full.then(|| self.area_chunk(self.current_area + 1)),
            area: Some((self.area_chunk(self.current_area), self.area_image())),
        };
        if full {
            self.current_area += 1;
            self.committed = 0;
        }
        self.unwritten = 0;
        io
    }

    /// The current area's bytes: its entries, then zeroes.
    pub fn area_image(&self) -> Vec<u8> {
        let mut b = vec![0u8; (self.chunk * SECTOR) as usize];
        let first = (self.current_area * self.per_area) as usize;
        let list = self.entries.get(first..).unwrap_or_default();
        for (i, &(old, new)) in list.iter().take(self.per_area as usize).enumerate() {
            let o = i * ENTRY as usize;
            b[o..o + 8].copy_from_slice(&old.to_le_bytes());
            b[o + 8..o + 16].copy_from_slice(&new.to_le_bytes());
        }
        b
    }

    /// The next merge step: the trailing run of consecutive exceptions of the
    /// current area (moving back an area when it is empty) as (first old chunk,
    /// first new chunk, count); None when nothing is left.
    pub fn prepare_merge(&mut self) -> Option<(u64, u64, u64)> {
        if self.committed == 0 {
            if self.current_area == 0 {
                return None;
            }
            self.current_area -= 1;
            self.committed = self.per_area;
        }
        let first = (self.current_area * self.per_area) as usize;
        let area = &self.entries[first..first + self.committed as usize];
        let &(old, new) = area.last()?;
        let mut n = 1u64;
        while n < self.committed {
            let (o, w) = area[area.len() - 1 - n as usize];
            if o + n != old || w + n != new {
                break;
            }
            n += 1;
        }
        Some((old + 1 - n, new + 1 - n, n))
    }

    /// The last `n` exceptions were merged: drop them; the area image to write
    /// (flush before, FUA) and its chunk.
    pub fn commit_merge(&mut self, n: u64) -> (u64, Vec<u8>) {
        let n = n.min(self.committed);
        self.entries.truncate(self.entries.len() - n as usize);
        self.committed -= n;
        // as the kernel keeps it once merging: as if committed in order
        self.next_free = self.area_chunk(self.current_area) + self.committed + 1;
        (self.area_chunk(self.current_area), self.area_image())
    }

    /// `dmsetup status` figures: (sectors allocated, metadata sectors).
    pub fn usage(&self) -> (u64, u64) {
        (
            self.next_free * self.chunk,
            (self.current_area + 1 + HDR_CHUNKS) * self.chunk,
        )
    }
}

/// A transient store: chunks handed out from 0, nothing on disk.
#[derive(Debug)]
pub struct Transient {
    pub chunk: u64,
    /// Next free sector.
    pub next_free: u64,
}

impl Transient {
    pub fn prepare(&mut self, cow_sectors: u64) -> Option<u64> {
        if cow_sectors < self.next_free + self.chunk {
            return None;
        }
        let c = self.next_free / self.chunk;
        self.next_free += self.chunk;
        Some(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_allocation_and_commit_batches() {
        // 1 KiB chunks: 64 entries per area
        let mut p = Persistent::new(2);
        assert_eq!(p.per_area, 64);
        assert_eq!(p.area_chunk(0), 1);
        assert_eq!(p.area_chunk(1), 66);
        let big = 1 << 30;
        let chunks: Vec<u64> = (0..65).map(|_| p.prepare(big).unwrap()).collect();
        assert_eq!(chunks[0], 2);
        assert_eq!(chunks[63], 65);
        // chunk 66 is area 1: skipped
        assert_eq!(chunks[64], 67);
        // commits wait while others are pending
        assert!(p.commit(0, 2).area.is_none());
        for (i, &c) in chunks.iter().enumerate().skip(1).take(62) {
            assert!(p.commit(i as u64, c).area.is_none());
        }
        // the 64th fills the area: area 1 is zeroed, then area 0 written
        let io = p.commit(63, 65);
        assert_eq!(io.zero_chunk, Some(66));
        let (at, img) = io.area.unwrap();
        assert_eq!(at, 1);
        let (list, full) = parse_area(&img);
        assert!(full);
        assert_eq!(list[63], (63, 65));
        assert_eq!((p.current_area, p.committed), (1, 0));
        // the last pending one commits at once
        let io = p.commit(64, 67);
        assert_eq!(io.area.as_ref().map(|a| a.0), Some(66));
        assert_eq!(p.usage(), (68 * 2, 3 * 2));
    }

    #[test]
    fn reload_recomputes_next_free_and_merge_walks_back() {
        let mut p = Persistent::new(2);
        let area0: Vec<(u64, u64)> = (0..64).map(|i| (100 + i, 2 + i)).collect();
        p.load_area(0, &area0, true);
        p.load_area(1, &[(500, 67), (501, 68)], false);
        assert_eq!((p.current_area, p.committed, p.next_free), (1, 2, 69));
        assert_eq!(p.prepare_merge(), Some((500, 67, 2)));
        let (at, img) = p.commit_merge(2);
        assert_eq!(at, 66);
        assert_eq!(parse_area(&img).0, vec![]);
        // area 1 is empty: back to area 0, all 64 consecutive
        assert_eq!(p.prepare_merge(), Some((100, 2, 64)));
        p.commit_merge(64);
        assert_eq!(p.prepare_merge(), None);
        assert_eq!(p.usage(), (4, 4), "merge complete: allocated == metadata");
    }

    #[test]
    fn header_round_trip() {
        let h = Header::parse(&header_image(true, 16));
        assert_eq!(
            h,
            Header {
                magic: SNAP_MAGIC,
                valid: 1,
                version: 1,
                chunk_size: 16
            }
        );
        assert_eq!(&header_image(false, 8)[0..4], b"SnAp");
    }

    #[test]
    fn transient_hands_out_from_zero() {
        let mut t = Transient {
            chunk: 8,
            next_free: 0,
        };
        assert_eq!(t.prepare(16), Some(0));
        assert_eq!(t.prepare(16), Some(1));
        assert_eq!(t.prepare(16), None);
    }
}
