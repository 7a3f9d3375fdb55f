//! The dm-cache superblock (block 0) and the values of its arrays: a mapping
//! is `origin block << 16 | flags` (valid; dirty in version 1 only, version 2
//! keeps a dirty bitset), a hint is the policy's 4 bytes.

use super::error::{CacheError, Result};
use crate::pdata::header::{self, Header};
use crate::pdata::sm_disk::SmRoot;
use crate::pdata::{array, bounds, le32, le64, put32, put64, Block, BlockKind, BLOCK_SIZE};

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

impl Superblock {
    pub fn decode(d: &Block) -> Superblock {
        let h = Header::decode(d);
        let mut policy_name = [0u8; POLICY_NAME_SIZE];
        policy_name.copy_from_slice(&d[44..60]);
        Superblock {
            flags: h.flags,
            blocknr: h.blocknr,
            uuid: h.uuid,
            magic: h.magic,
            version: h.version,
            policy_name,
            policy_hint_size: le32(d, 60),
            sm_root: SmRoot::decode(&d[64..192]),
            mapping_root: le64(d, 192),
            hint_root: le64(d, 200),
            discard_root: le64(d, 208),
            discard_block_size: le64(d, 216),
            discard_nr_blocks: le64(d, 224),
            data_block_size: le32(d, 232),
            metadata_block_size: le32(d, 236),
            cache_blocks: le32(d, 240),
            compat_flags: le32(d, 244),
            compat_ro_flags: le32(d, 248),
            incompat_flags: le32(d, 252),
            read_hits: le32(d, 256),
            read_misses: le32(d, 260),
            write_hits: le32(d, 264),
            write_misses: le32(d, 268),
            policy_version: [le32(d, 272), le32(d, 276), le32(d, 280)],
            dirty_root: if h.version >= 2 { le64(d, 284) } else { 0 },
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
        .encode(&mut d[..header::SIZE]);
        d[44..60].copy_from_slice(&self.policy_name);
        put32(&mut d[..], 60, self.policy_hint_size);
        self.sm_root.encode(&mut d[64..192]);
        put64(&mut d[..], 192, self.mapping_root);
        put64(&mut d[..], 200, self.hint_root);
        put64(&mut d[..], 208, self.discard_root);
        put64(&mut d[..], 216, self.discard_block_size);
        put64(&mut d[..], 224, self.discard_nr_blocks);
        put32(&mut d[..], 232, self.data_block_size);
        put32(&mut d[..], 236, self.metadata_block_size);
        put32(&mut d[..], 240, self.cache_blocks);
        put32(&mut d[..], 244, self.compat_flags);
        put32(&mut d[..], 248, self.compat_ro_flags);
        put32(&mut d[..], 252, self.incompat_flags);
        put32(&mut d[..], 256, self.read_hits);
        put32(&mut d[..], 260, self.read_misses);
        put32(&mut d[..], 264, self.write_hits);
        put32(&mut d[..], 268, self.write_misses);
        for (i, v) in self.policy_version.iter().enumerate() {
            put32(&mut d[..], 272 + 4 * i, *v);
        }
        if self.version >= 2 {
            put64(&mut d[..], 284, self.dirty_root);
        }
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
