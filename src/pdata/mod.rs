//! Persistent data: the kernel's `drivers/md/persistent-data` on-disk structures,
//! reimplemented in userspace. Knows nothing of thin provisioning: blocks with
//! checksums, a bounded block cache, copy-on-write transactions, btrees and
//! reference-counting space maps.

pub mod array;
pub mod bitset;
pub mod bounds;
pub mod btree;
pub mod cache;
pub mod checksum;
pub mod dev;
pub mod error;
pub mod header;
pub mod refcheck;
pub mod sm_disk;
pub mod space_map;
pub mod tm;
pub mod xml;

pub use dev::{FileDev, MemDev, MetadataDev};
pub use error::{BlockKind, PdataError, Result};

/// Size of every metadata block.
pub const BLOCK_SIZE: usize = 4096;

/// One metadata block.
pub type Block = [u8; BLOCK_SIZE];

pub(crate) fn le32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

pub(crate) fn le64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

pub(crate) fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn put64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// Whether the superblock at `location` is all zeroes: an unformatted device.
pub fn unformatted(dev: &mut dyn MetadataDev, location: u64) -> Result<bool> {
    let mut b = [0u8; BLOCK_SIZE];
    dev.read_block(location, &mut b).map_err(|e| PdataError::Io {
        block: location,
        source: e,
    })?;
    Ok(b.iter().all(|&x| x == 0))
}
