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

impl Superblock {
    pub fn decode(d: &Block) -> Superblock {
        let h = Header::decode(d);
        Superblock {
            flags: h.flags,
            blocknr: h.blocknr,
            uuid: h.uuid,
            magic: h.magic,
            version: h.version,
            time: le32(d, 44),
            trans_id: le64(d, 48),
            held_root: le64(d, 56),
            data_sm_root: SmRoot::decode(&d[64..192]),
            meta_sm_root: SmRoot::decode(&d[192..320]),
            mapping_root: le64(d, 320),
            details_root: le64(d, 328),
            data_block_size: le32(d, 336),
            metadata_block_size: le32(d, 340),
            metadata_nr_blocks: le64(d, 344),
            compat_flags: le32(d, 352),
            compat_ro_flags: le32(d, 356),
            incompat_flags: le32(d, 360),
        }
    }

    /// The block image, checksum left for the cache to fill in.
    pub fn encode(&self) -> Box<Block> {
        let mut d = Box::new([0u8; BLOCK_SIZE]);
        Header {
            flags: self.flags,
            blocknr: self.blocknr,
            uuid: self.uuid,
            magic: self.magic,
            version: self.version,
        }
        .encode(&mut d[..]);
        put32(&mut d[..], 44, self.time);
        put64(&mut d[..], 48, self.trans_id);
        put64(&mut d[..], 56, self.held_root);
        // a zeroed "space map root" stays all-zero, as in a snapshot copy
        if self.data_sm_root != SmRoot::default() {
            self.data_sm_root.encode(&mut d[64..192]);
        }
        if self.meta_sm_root != SmRoot::default() {
            self.meta_sm_root.encode(&mut d[192..320]);
        }
        put64(&mut d[..], 320, self.mapping_root);
        put64(&mut d[..], 328, self.details_root);
        put32(&mut d[..], 336, self.data_block_size);
        put32(&mut d[..], 340, self.metadata_block_size);
        put64(&mut d[..], 344, self.metadata_nr_blocks);
        put32(&mut d[..], 352, self.compat_flags);
        put32(&mut d[..], 356, self.compat_ro_flags);
        put32(&mut d[..], 360, self.incompat_flags);
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
