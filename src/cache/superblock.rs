//! The dm-cache superblock (block 0) and the values of its arrays: a mapping
//! is `origin block << 16 | flags` (valid; dirty in version 1 only, version 2
//! keeps a dirty bitset), a hint is the policy's 4 bytes.

use super::error::{CacheError, Result};
use crate::pdata::header::{self, Header};
use crate::pdata::sm_disk::SmRoot;
use crate::pdata::{array, bounds, Block, BlockKind, BLOCK_SIZE};

pub const MAGIC: u64 = 0o6142003;
pub const MIN_VERSION: u32 = 1;
pub const MAX_VERSION: u32 = 2;
pub const SUPERBLOCK_LOCATION: u64 = 0;
/// Superblock flags.
pub const CLEAN_SHUTDOWN: u32 = 1;
pub const NEEDS_CHECK: u32 = 2;
/// Metadata block size in sectors.
pub const METADATA_BLOCK_SECTORS: u32 = 8;
pub const POLICY_NAME_SIZE: usize = 16;
/// The width of a hint in the hint array (what smq keeps; cleaner keeps none).
pub const HINT_SIZE: u32 = 4;
/// Mapping flags.
pub const M_VALID: u64 = 1;
pub const M_DIRTY: u64 = 2;
/// Origin blocks fit in the 48 bits above a mapping's flags.
pub const MAX_ORIGIN_BLOCKS: u64 = 1 << 48;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    pub flags: u32,
    pub blocknr: u64,
    pub uuid: [u8; 16],
    pub magic: u64,
    pub version: u32,
    pub policy_name: [u8; POLICY_NAME_SIZE],
    pub policy_hint_size: u32,
    pub sm_root: SmRoot,
    pub mapping_root: u64,
    pub hint_root: u64,
    pub discard_root: u64,
    pub discard_block_size: u64,
    pub discard_nr_blocks: u64,
    pub data_block_size: u32,
    pub metadata_block_size: u32,
    pub cache_blocks: u32,
    pub compat_flags: u32,
    pub compat_ro_flags: u32,
    pub incompat_flags: u32,
    pub read_hits: u32,
    pub read_misses: u32,
    pub write_hits: u32,
    pub write_misses: u32,
    pub policy_version: [u32; 3],
    /// Version 2: the dirty bitset's root.
    pub dirty_root: u64,
}

crate::layout! {
    /// What follows the common header in the dm-cache superblock (the
    /// kernel's `struct cache_disk_superblock` in dm-cache-metadata.c);
    /// `dirty_root` is version 2's.
    struct Fields("cache superblock", 292) {
        policy_name: [u8; POLICY_NAME_SIZE] = 44,
        policy_hint_size: u32 = 60,
        sm_root: SmRoot = 64,
        mapping_root: u64 = 192,
        hint_root: u64 = 200,
        discard_root: u64 = 208,
        discard_block_size: u64 = 216,
        discard_nr_blocks: u64 = 224,
        data_block_size: u32 = 232,
        metadata_block_size: u32 = 236,
        cache_blocks: u32 = 240,
        compat_flags: u32 = 244,
        compat_ro_flags: u32 = 248,
        incompat_flags: u32 = 252,
        read_hits: u32 = 256,
        read_misses: u32 = 260,
        write_hits: u32 = 264,
        write_misses: u32 = 268,
        policy_version: [u32; 3] = 272,
        dirty_root: u64 = 284,
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
            policy_name: f.policy_name,
            policy_hint_size: f.policy_hint_size,
            sm_root: f.sm_root,
            mapping_root: f.mapping_root,
            hint_root: f.hint_root,
            discard_root: f.discard_root,
            discard_block_size: f.discard_block_size,
            discard_nr_blocks: f.discard_nr_blocks,
            data_block_size: f.data_block_size,
            metadata_block_size: f.metadata_block_size,
            cache_blocks: f.cache_blocks,
            compat_flags: f.compat_flags,
            compat_ro_flags: f.compat_ro_flags,
            incompat_flags: f.incompat_flags,
            read_hits: f.read_hits,
            read_misses: f.read_misses,
            write_hits: f.write_hits,
            write_misses: f.write_misses,
            policy_version: f.policy_version,
            dirty_root: if h.version >= 2 { f.dirty_root } else { 0 },
        }
    }

    /// The block image, checksum left for the cache to fill in.
    pub fn encode(&self) -> Box<Block> {
        let mut d = Box::new([0u8; BLOCK_SIZE]);
        let f = Fields {
            policy_name: self.policy_name,
            policy_hint_size: self.policy_hint_size,
            sm_root: self.sm_root,
            mapping_root: self.mapping_root,
            hint_root: self.hint_root,
            discard_root: self.discard_root,
            discard_block_size: self.discard_block_size,
            discard_nr_blocks: self.discard_nr_blocks,
            data_block_size: self.data_block_size,
            metadata_block_size: self.metadata_block_size,
            cache_blocks: self.cache_blocks,
            compat_flags: self.compat_flags,
            compat_ro_flags: self.compat_ro_flags,
            incompat_flags: self.incompat_flags,
            read_hits: self.read_hits,
            read_misses: self.read_misses,
            write_hits: self.write_hits,
            write_misses: self.write_misses,
            policy_version: self.policy_version,
            // version 1 has no dirty bitset: its bytes stay zero
            dirty_root: if self.version >= 2 { self.dirty_root } else { 0 },
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
        .encode(&mut d[..header::SIZE]);
        d
    }

    /// A superblock of `version` for blocks of `data_block_size` sectors,
    /// everything else empty.
    pub fn new(data_block_size: u32, version: u32) -> Superblock {
        Superblock {
            magic: MAGIC,
            version,
            data_block_size,
            metadata_block_size: METADATA_BLOCK_SECTORS,
            ..Superblock::default()
        }
    }

    /// The policy's name (up to its first NUL).
    pub fn policy(&self) -> String {
        let end = self
            .policy_name
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(POLICY_NAME_SIZE);
        String::from_utf8_lossy(&self.policy_name[..end]).into_owned()
    }

    /// Set the policy's name (at most 15 bytes, as the kernel keeps it NUL-ended).
    pub fn set_policy(&mut self, name: &str) -> Result<()> {
        if name.len() >= POLICY_NAME_SIZE {
            return Err(CacheError::Invalid(format!(
                "policy name '{name}' is longer than {} bytes",
                POLICY_NAME_SIZE - 1
            )));
        }
        self.policy_name = [0; POLICY_NAME_SIZE];
        self.policy_name[..name.len()].copy_from_slice(name.as_bytes());
        Ok(())
    }

    pub fn clean_shutdown(&self) -> bool {
        self.flags & CLEAN_SHUTDOWN != 0
    }
}

/// A mapping array entry: (origin block, flags).
pub fn unpack_mapping(v: u64) -> (u64, u64) {
    (v >> 16, v & 0xffff)
}

pub fn pack_mapping(oblock: u64, flags: u64) -> u64 {
    (oblock << 16) | (flags & 0xffff)
}

/// The most cache blocks a mapping array on a metadata device of `dev_blocks`
/// blocks can hold (a u64 each, in at most every block).
pub fn max_cache_blocks(dev_blocks: u64) -> u64 {
    dev_blocks
        .saturating_mul(array::max_entries(8) as u64)
        .min(u32::MAX as u64)
}

/// The most bits a bitset on a metadata device of `dev_blocks` blocks can hold.
pub fn max_bits(dev_blocks: u64) -> u64 {
    dev_blocks
        .saturating_mul(array::max_entries(8) as u64)
        .saturating_mul(64)
}

/// Read the superblock at `block` as the tools read it: a bad checksum is
/// 1.x's "bad checksum in superblock"; then [`check`].
pub fn read(cache: &mut crate::pdata::cache::BlockCache, block: u64) -> Result<Superblock> {
    let dev_blocks = cache.nr_blocks();
    let sb = match cache.read(block, BlockKind::CacheSuperblock) {
        Ok(d) => Superblock::decode(d),
        Err(crate::pdata::PdataError::Checksum { .. }) => {
            return Err(CacheError::Plain("bad checksum in superblock".into()))
        }
        Err(e) => return Err(e.into()),
    };
    check(&sb, block, dev_blocks)?;
    Ok(sb)
}

/// The magic, the version, and every size and block number in the
/// superblock against the metadata device (`dev_blocks`), so nothing is sized
/// by a lie.
pub fn check(sb: &Superblock, block: u64, dev_blocks: u64) -> Result<()> {
    if sb.magic != MAGIC {
        return Err(CacheError::BadSuperblock(format!(
            "bad magic {} (expected {MAGIC})",
            sb.magic
        )));
    }
    if !(MIN_VERSION..=MAX_VERSION).contains(&sb.version) {
        return Err(CacheError::Plain(format!(
            "unsupported metadata version {}",
            sb.version
        )));
    }
    if sb.policy_hint_size != 0 && sb.policy_hint_size != HINT_SIZE {
        return Err(CacheError::BadSuperblock(format!(
            "policy hint size {} (only 0 and {HINT_SIZE} are supported)",
            sb.policy_hint_size
        )));
    }
    bounds::field(
        block,
        "cache_blocks",
        sb.cache_blocks as u64,
        max_cache_blocks(dev_blocks),
        "what a mapping array on the metadata device can hold",
    )?;
    bounds::field(
        block,
        "discard_nr_blocks",
        sb.discard_nr_blocks,
        max_bits(dev_blocks),
        "what a bitset on the metadata device can hold",
    )?;
    let roots = [
        ("mapping root", sb.mapping_root),
        ("hint root", sb.hint_root),
        ("discard root", sb.discard_root),
        ("dirty root", sb.dirty_root),
    ];
    // version 1 has no dirty bitset
    let n = if sb.version >= 2 { 4 } else { 3 };
    bounds::roots(block, &roots[..n], dev_blocks)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdata::{le32, le64};

    #[test]
    fn layout_and_bounds() {
        let mut sb = Superblock::new(128, 2);
        sb.set_policy("smq").unwrap();
        sb.policy_version = [2, 0, 0];
        sb.policy_hint_size = 4;
        sb.cache_blocks = 1100;
        sb.dirty_root = 8;
        sb.read_misses = 9;
        let d = sb.encode();
        // offsets as the kernel's struct cache_disk_superblock
        assert_eq!(&d[32..40], &MAGIC.to_le_bytes());
        assert_eq!(&d[44..48], b"smq\0");
        assert_eq!(le32(&d[..], 240), 1100);
        assert_eq!(le32(&d[..], 272), 2);
        assert_eq!(le64(&d[..], 284), 8);
        assert_eq!(Superblock::decode(&d), sb);
        assert_eq!(sb.policy(), "smq");
        assert!(sb.set_policy("a-name-of-16-chr").is_err());
        assert!(check(&sb, 0, 64).is_ok());
        sb.cache_blocks = 64 * 509 + 1;
        let e = check(&sb, 0, 64).unwrap_err().to_string();
        assert!(e.contains("cache_blocks is 32577"), "{e}");
        sb.cache_blocks = 10;
        sb.dirty_root = 64;
        let e = check(&sb, 0, 64).unwrap_err().to_string();
        assert!(e.contains("dirty root is 64"), "{e}");
        sb.version = 3;
        assert_eq!(
            check(&sb, 0, 64).unwrap_err().to_string(),
            "unsupported metadata version 3"
        );
        assert_eq!(unpack_mapping(pack_mapping(77, M_VALID | M_DIRTY)), (77, 3));
    }
}
