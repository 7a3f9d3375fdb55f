//! The dm-era superblock (block 0, and the metadata snapshot's copy) and the
//! writeset record of the writeset tree.

use super::error::{EraError, Result};
use crate::pdata::header::Header;
use crate::pdata::sm_disk::SmRoot;
use crate::pdata::{bounds, le32, le64, put32, put64, Block, BlockKind, BLOCK_SIZE};

pub const MAGIC: u64 = 2_126_579_579;
pub const VERSION: u32 = 1;
pub const SUPERBLOCK_LOCATION: u64 = 0;
/// A writeset root of 0 is "no writeset" (the superblock's location).
pub const INVALID_WRITESET_ROOT: u64 = SUPERBLOCK_LOCATION;
/// Metadata block size in sectors.
pub const METADATA_BLOCK_SECTORS: u32 = 8;
/// Data block sizes are multiples of this many sectors.
pub const MIN_BLOCK_SIZE: u32 = 8;
/// nr_blocks is below 2^31 (the kernel's valid_nr_blocks).
pub const MAX_NR_BLOCKS: u64 = (1 << 31) - 1;
/// On-disk size of a writeset record: nr_bits (u32), root (u64), packed.
pub const WRITESET_SIZE: usize = 12;
/// The flag era_restore sets (1.x's "clean shutdown").
pub const CLEAN_SHUTDOWN: u32 = 1;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Writeset {
    pub nr_bits: u32,
    pub root: u64,
}

/// A writeset record, as a value of the writeset tree and a superblock field.
impl crate::layout::Field for Writeset {
    const LEN: usize = WRITESET_SIZE;
    fn get(b: &[u8]) -> Writeset {
        Writeset::decode(b)
    }
    fn put(self, b: &mut [u8]) {
        put32(b, 0, self.nr_bits);
        put64(b, 4, self.root);
    }
}

impl Writeset {
    pub fn decode(v: &[u8]) -> Writeset {
        Writeset {
            nr_bits: le32(v, 0),
            root: le64(v, 4),
        }
    }
    pub fn encode(&self) -> [u8; WRITESET_SIZE] {
        let mut v = [0u8; WRITESET_SIZE];
        crate::layout::Field::put(*self, &mut v);
        v
    }
}

crate::layout! {
    /// What follows the common header in the dm-era superblock (the kernel's
    /// `struct superblock_disk` in dm-era-target.c).
    struct Fields("era superblock", 224) {
        sm_root: SmRoot = 44,
        data_block_size: u32 = 172,
        metadata_block_size: u32 = 176,
        nr_blocks: u32 = 180,
        current_era: u32 = 184,
        current_writeset: Writeset = 188,
        writeset_tree_root: u64 = 200,
        era_array_root: u64 = 208,
        metadata_snap: u64 = 216,
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    pub flags: u32,
    pub blocknr: u64,
    pub uuid: [u8; 16],
    pub magic: u64,
    pub version: u32,
    pub sm_root: SmRoot,
    pub data_block_size: u32,
    pub metadata_block_size: u32,
    pub nr_blocks: u32,
    pub current_era: u32,
    pub current_writeset: Writeset,
    pub writeset_tree_root: u64,
    pub era_array_root: u64,
    pub metadata_snap: u64,
}

impl Superblock {
    pub fn decode(d: &Block) -> Superblock {
        let h = Header::decode(d);
        let f = Fields::from_array(d);
        Superblock {
            flags: h.flags,
            blocknr: h.blocknr,
            uuid: h.uuid,
            magic: h.magic,
            version: h.version,
            sm_root: f.sm_root,
            data_block_size: f.data_block_size,
            metadata_block_size: f.metadata_block_size,
            nr_blocks: f.nr_blocks,
            current_era: f.current_era,
            current_writeset: f.current_writeset,
            writeset_tree_root: f.writeset_tree_root,
            era_array_root: f.era_array_root,
            metadata_snap: f.metadata_snap,
        }
    }

    /// The block image, checksum left for the cache to fill in.
    pub fn encode(&self) -> Box<Block> {
        let mut d = Box::new([0u8; BLOCK_SIZE]);
        let f = Fields {
            sm_root: self.sm_root,
            data_block_size: self.data_block_size,
            metadata_block_size: self.metadata_block_size,
            nr_blocks: self.nr_blocks,
            current_era: self.current_era,
            current_writeset: self.current_writeset,
            writeset_tree_root: self.writeset_tree_root,
            era_array_root: self.era_array_root,
            metadata_snap: self.metadata_snap,
        };
        d[..Fields::SIZE].copy_from_slice(&f.encode());
        // the common header over the bytes the fields leave before them
        Header {
            flags: self.flags,
            blocknr: self.blocknr,
            uuid: self.uuid,
            magic: self.magic,
            version: self.version,
        }
        .encode(&mut d[..]);
        d
    }

    /// A superblock for `nr_blocks` of `data_block_size`, everything else empty.
    pub fn new(data_block_size: u32) -> Superblock {
        Superblock {
            magic: MAGIC,
            version: VERSION,
            data_block_size,
            metadata_block_size: METADATA_BLOCK_SECTORS,
            ..Superblock::default()
        }
    }
}

/// Read the superblock at `block` and check what every reader relies on: the
/// magic, the version, and every size and block number in it against the
/// metadata device (`dev_blocks`), so nothing is sized by a lie.
pub fn read(cache: &mut crate::pdata::cache::BlockCache, block: u64) -> Result<Superblock> {
    let dev_blocks = cache.nr_blocks();
    let sb = Superblock::decode(cache.read(block, BlockKind::EraSuperblock)?);
    if sb.magic != MAGIC {
        return Err(EraError::BadSuperblock(format!(
            "bad magic {} (expected {MAGIC})",
            sb.magic
        )));
    }
    if sb.version != VERSION {
        return Err(EraError::BadSuperblock(format!(
            "Era metadata version {} found, but only versions between {VERSION} and {VERSION} supported.",
            sb.version
        )));
    }
    check_fields(&sb, block, dev_blocks)?;
    Ok(sb)
}

/// The most bits a writeset on a metadata device of `dev_blocks` blocks can
/// have: its words fill at most every block (a tree that says more shares
/// blocks, and its walk would run for as long as the lie is big).
pub fn max_bits(dev_blocks: u64) -> u64 {
    let words = dev_blocks.saturating_mul(crate::pdata::array::max_entries(8) as u64);
    words.saturating_mul(64).min(MAX_NR_BLOCKS)
}

/// The superblock's sizes and block numbers against the metadata device.
pub fn check_fields(sb: &Superblock, block: u64, dev_blocks: u64) -> Result<()> {
    // the era array holds a 32-bit era per block, in at most every block
    let max_blocks = dev_blocks
        .saturating_mul(crate::pdata::array::max_entries(4) as u64)
        .min(MAX_NR_BLOCKS);
    bounds::field(
        block,
        "nr_blocks",
        sb.nr_blocks as u64,
        max_blocks,
        "2^31 - 1, and what an era array on the metadata device can hold",
    )?;
    bounds::field(
        block,
        "current writeset nr_bits",
        sb.current_writeset.nr_bits as u64,
        max_bits(dev_blocks),
        "2^31 - 1, and what a bitset on the metadata device can hold",
    )?;
    bounds::roots(
        block,
        &[
            ("current writeset root", sb.current_writeset.root),
            ("writeset tree root", sb.writeset_tree_root),
            ("era array root", sb.era_array_root),
            ("metadata snap", sb.metadata_snap),
        ],
        dev_blocks,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes the metadata device cannot hold are refused, naming the field: a
    /// tree that claims them shares blocks, and walking it would take as long
    /// as the lie is big.
    #[test]
    fn sizes_beyond_what_the_device_holds_are_refused() {
        let mut sb = Superblock::new(128);
        let dev = 256;
        let most = dev * crate::pdata::array::max_entries(4) as u64;
        sb.nr_blocks = most as u32;
        assert!(check_fields(&sb, 0, dev).is_ok());
        sb.nr_blocks = most as u32 + 1;
        let e = check_fields(&sb, 0, dev).unwrap_err().to_string();
        assert!(e.contains("nr_blocks"), "{e}");
        sb.nr_blocks = 1000;
        sb.current_writeset.nr_bits = max_bits(dev) as u32 + 1;
        let e = check_fields(&sb, 0, dev).unwrap_err().to_string();
        assert!(e.contains("current writeset nr_bits"), "{e}");
    }
}
