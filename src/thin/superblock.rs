//! The dm-thin superblock (block 0, and the held metadata-snapshot copy: the
//! persistent-data header, then dm-thin's fields) and the device-details
//! record.

use crate::pdata::header::Header;
use crate::pdata::sm_disk::SmRoot;
use crate::pdata::{le32, le64, put32, put64, Block, BLOCK_SIZE};

pub const MAGIC: u64 = 27_022_010;
pub const VERSION: u32 = 2;
pub const SUPERBLOCK_LOCATION: u64 = 0;
pub const NEEDS_CHECK: u32 = 1;
/// Metadata block size in sectors.
pub const METADATA_BLOCK_SECTORS: u32 = 8;
pub const MIN_DATA_BLOCK_SIZE: u32 = 128;
pub const MAX_DATA_BLOCK_SIZE: u32 = 2_097_152;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub flags: u32,
    pub blocknr: u64,
    pub uuid: [u8; 16],
    pub magic: u64,
    pub version: u32,
    pub time: u32,
    pub trans_id: u64,
    pub held_root: u64,
    pub data_sm_root: SmRoot,
    pub meta_sm_root: SmRoot,
    pub mapping_root: u64,
    pub details_root: u64,
    pub data_block_size: u32,
    pub metadata_block_size: u32,
    pub metadata_nr_blocks: u64,
    pub compat_flags: u32,
    pub compat_ro_flags: u32,
    pub incompat_flags: u32,
}

crate::layout! {
    /// What follows the common header in the dm-thin superblock (the
    /// kernel's `struct thin_disk_superblock` in dm-thin-metadata.c).
    struct Fields("thin superblock", 364) {
        time: u32 = 44,
        trans_id: u64 = 48,
        held_root: u64 = 56,
        data_sm_root: SmRoot = 64,
        meta_sm_root: SmRoot = 192,
        mapping_root: u64 = 320,
        details_root: u64 = 328,
        data_block_size: u32 = 336,
        metadata_block_size: u32 = 340,
        metadata_nr_blocks: u64 = 344,
        compat_flags: u32 = 352,
        compat_ro_flags: u32 = 356,
        incompat_flags: u32 = 360,
    }
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
            time: f.time,
            trans_id: f.trans_id,
            held_root: f.held_root,
            data_sm_root: f.data_sm_root,
            meta_sm_root: f.meta_sm_root,
            mapping_root: f.mapping_root,
            details_root: f.details_root,
            data_block_size: f.data_block_size,
            metadata_block_size: f.metadata_block_size,
            metadata_nr_blocks: f.metadata_nr_blocks,
            compat_flags: f.compat_flags,
            compat_ro_flags: f.compat_ro_flags,
            incompat_flags: f.incompat_flags,
        }
    }

    /// The block image, checksum left for the cache to fill in (a zeroed
    /// space map root, as in a snapshot copy, is 128 zero bytes).
    pub fn encode(&self) -> Box<Block> {
        let mut d = Box::new([0u8; BLOCK_SIZE]);
        let f = Fields {
            time: self.time,
            trans_id: self.trans_id,
            held_root: self.held_root,
            data_sm_root: self.data_sm_root,
            meta_sm_root: self.meta_sm_root,
            mapping_root: self.mapping_root,
            details_root: self.details_root,
            data_block_size: self.data_block_size,
            metadata_block_size: self.metadata_block_size,
            metadata_nr_blocks: self.metadata_nr_blocks,
            compat_flags: self.compat_flags,
            compat_ro_flags: self.compat_ro_flags,
            incompat_flags: self.incompat_flags,
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
}

/// Per-device record in the details tree (24 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceDetails {
    pub mapped_blocks: u64,
    pub transaction_id: u64,
    pub creation_time: u32,
    pub snapshotted_time: u32,
}

impl DeviceDetails {
    pub fn decode(v: &[u8]) -> DeviceDetails {
        DeviceDetails {
            mapped_blocks: le64(v, 0),
            transaction_id: le64(v, 8),
            creation_time: le32(v, 16),
            snapshotted_time: le32(v, 20),
        }
    }
    pub fn encode(&self) -> [u8; 24] {
        let mut v = [0u8; 24];
        put64(&mut v, 0, self.mapped_blocks);
        put64(&mut v, 8, self.transaction_id);
        put32(&mut v, 16, self.creation_time);
        put32(&mut v, 20, self.snapshotted_time);
        v
    }
}

/// Mapping value: 40-bit data block, 24-bit time.
pub fn pack_block_time(data_block: u64, time: u32) -> u64 {
    (data_block << 24) | (time as u64 & 0xFF_FFFF)
}

pub fn unpack_block_time(v: u64) -> (u64, u32) {
    (v >> 24, (v & 0xFF_FFFF) as u32)
}
