//! The kernel's dm-log-writes log, byte for byte (drivers/md/dm-log-writes.c):
//!
//! - block 0 of the log device: the super, little-endian `magic` (u64),
//!   `version` (u64, 1), `nr_entries` (u64), `sectorsize` (u32), the rest of
//!   the block zero;
//! - then, entry after entry, one block (`sectorsize` bytes) holding `sector`,
//!   `nr_sectors`, `flags` and `data_len` (u64 each; sectors in units of
//!   `sectorsize`), a mark's text after them in the same block, and after the
//!   block a write's data, `nr_sectors` blocks of it (a discard has none).
//!
//! "Block" is the data device's logical block size (`sectorsize`); positions in
//! the log advance in 512-byte sectors.

use crate::mapper::TargetError;

/// "rhswfsj" read as a little-endian u64.
pub const MAGIC: u64 = 0x006a_7366_7773_6872;
pub const VERSION: u64 = 1;
pub const FLUSH: u64 = 1 << 0;
pub const FUA: u64 = 1 << 1;
pub const DISCARD: u64 = 1 << 2;
pub const MARK: u64 = 1 << 3;
pub const METADATA: u64 = 1 << 4;
/// Bytes of an entry's fields (a mark's text follows them).
pub const ENTRY_LEN: usize = 32;
/// The largest block size a log may name (the kernel's logical block sizes end
/// at the page size; 64 KiB bounds what a reader allocates).
pub const MAX_SECTORSIZE: u32 = 65536;
/// The mark the kernel logs when a log-writes table goes away.
pub const END_MARK: &str = "dm-log-writes-end";

crate::layout! {
    /// The super's fields (the rest of its block is zero).
    struct SuperFields("log-writes super", 28) {
        magic: u64 = 0,
        version: u64 = 8,
        nr_entries: u64 = 16,
        sectorsize: u32 = 24,
    }
}

crate::layout! {
    /// An entry's fields (a mark's text follows them in the block).
    struct EntryFields("log-writes entry", ENTRY_LEN) {
        sector: u64 = 0,
        nr_sectors: u64 = 8,
        flags: u64 = 16,
        data_len: u64 = 24,
    }
}

/// The super: how many entries the log holds and its block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Super {
    pub nr_entries: u64,
    pub sectorsize: u32,
}

impl Super {
    /// The super's block (`sectorsize` bytes).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; (self.sectorsize as usize).max(SuperFields::SIZE)];
        let f = SuperFields {
            magic: MAGIC,
            version: VERSION,
            nr_entries: self.nr_entries,
            sectorsize: self.sectorsize,
        };
        b[..SuperFields::SIZE].copy_from_slice(&f.encode());
        b
    }

    /// Read the super from the log's first 28 bytes or more; Err names the field.
    pub fn decode(b: &[u8]) -> Result<Super, TargetError> {
        if b.len() < SuperFields::SIZE {
            return Err(format!("the log is {} bytes long: no room for its super", b.len()).into());
        }
        let SuperFields {
            magic,
            version,
            nr_entries,
            sectorsize,
        } = SuperFields::decode(b)?;
        if magic != MAGIC {
            return Err(format!(
                "not a log-writes log: magic {magic:#x} at byte 0, not {MAGIC:#x}"
            ).into());
        }
        if version != VERSION {
            return Err(format!("log version {version} (byte 8) is not {VERSION}").into());
        }
        if !sectorsize.is_power_of_two() || !(512..=MAX_SECTORSIZE).contains(&sectorsize) {
            return Err(format!(
                "sectorsize {sectorsize} (byte 24) is not a power of two from 512 to {MAX_SECTORSIZE}"
            ).into());
        }
        Ok(Super { nr_entries, sectorsize })
    }
}

/// One entry's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// In blocks of the log's `sectorsize`.
    pub sector: u64,
    pub nr_sectors: u64,
    pub flags: u64,
    /// A mark's text length (0 for writes: their data follows the block).
    pub data_len: u64,
}

impl Entry {
    /// The entry's block: its fields, then `mark` (a mark's text), zeroes to
    /// `sectorsize`. `mark` must fit (the caller cuts it to `sectorsize - 33`).
    pub fn encode(&self, mark: &[u8], sectorsize: u32) -> Vec<u8> {
        let mut b = vec![0u8; (sectorsize as usize).max(ENTRY_LEN)];
        let f = EntryFields {
            sector: self.sector,
            nr_sectors: self.nr_sectors,
            flags: self.flags,
            data_len: self.data_len,
        };
        b[..ENTRY_LEN].copy_from_slice(&f.encode());
        let n = mark.len().min(b.len() - ENTRY_LEN);
        b[ENTRY_LEN..ENTRY_LEN + n].copy_from_slice(&mark[..n]);
        b
    }

    /// The fields from an entry's block; Err when it is shorter than
    /// [`ENTRY_LEN`], naming the field.
    pub fn decode(b: &[u8]) -> Result<Entry, crate::layout::LayoutError> {
        let f = EntryFields::decode(b)?;
        Ok(Entry {
            sector: f.sector,
            nr_sectors: f.nr_sectors,
            flags: f.flags,
            data_len: f.data_len,
        })
    }

    /// The flags by name, `|`-separated ("write" when none).
    pub fn flag_names(&self) -> String {
        let names = [
            (FLUSH, "flush"),
            (FUA, "fua"),
            (DISCARD, "discard"),
            (MARK, "mark"),
            (METADATA, "metadata"),
        ];
        let mut out: Vec<String> = names
            .iter()
            .filter(|(f, _)| self.flags & f != 0)
            .map(|(_, n)| n.to_string())
            .collect();
        let unknown = self.flags & !(FLUSH | FUA | DISCARD | MARK | METADATA);
        if unknown != 0 {
            out.push(format!("{unknown:#x}"));
        }
        if out.is_empty() {
            "write".into()
        } else {
            out.join("|")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn super_and_entries_round_trip_and_lies_are_named() {
        let s = Super {
            nr_entries: 7,
            sectorsize: 4096,
        };
        let b = s.encode();
        assert_eq!(&b[..8], b"rhswfsj\0");
        assert_eq!(Super::decode(&b), Ok(s));
        let mut bad = b.clone();
        bad[24] = 3;
        assert!(Super::decode(&bad).unwrap_err().what().contains("sectorsize"));
        bad = b.clone();
        bad[8] = 2;
        assert!(Super::decode(&bad).unwrap_err().what().contains("version 2"));
        assert!(Super::decode(&b[..20]).unwrap_err().what().contains("20 bytes"));
        let e = Entry {
            sector: 9,
            nr_sectors: 0,
            flags: MARK,
            data_len: 3,
        };
        let eb = e.encode(b"abc", 512);
        assert_eq!(eb.len(), 512);
        assert_eq!(&eb[32..35], b"abc");
        assert_eq!(Entry::decode(&eb), Ok(e));
        assert_eq!(Entry::decode(&eb[..20]).unwrap_err().field, "flags");
        assert_eq!(e.flag_names(), "mark");
        assert_eq!(Entry { flags: FLUSH | FUA | 64, ..e }.flag_names(), "flush|fua|0x40");
    }
}
