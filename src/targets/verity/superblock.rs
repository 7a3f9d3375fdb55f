//! The verity superblock `veritysetup format` writes at the start of the hash
//! device (or at `--hash-offset`), and the table line `veritysetup open`
//! loads from it with a root hash: `dmkit verity table` and `dmkit verity
//! dump`.
//!
//! Layout (512 bytes, little-endian): `verity\0\0` magic (0..8), superblock
//! version (8, u32: 1), hash type (12, u32: the table's version, 0 or 1),
//! uuid (16..32), algorithm name (32..64, NUL-padded), data block size (64,
//! u32), hash block size (68, u32), data blocks (72, u64), salt size (80,
//! u16), padding, salt (88..344), padding. The tree starts at the first hash
//! block after the superblock.

use crate::mapper::TargetError;
use super::{Alg, Geometry, MAX_DATA_BLOCK};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The superblock's size on disk.
pub const SIZE: usize = 512;
const MAGIC: &[u8; 8] = b"verity\0\0";
/// The salt field's size: the longest salt a superblock holds.
pub const MAX_SALT: usize = 256;

/// What a verity superblock says, every field checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// The byte of the hash device it was read at.
    pub offset: u64,
    pub hash_type: u32,
    pub uuid: [u8; 16],
    pub algorithm: String,
    pub data_block_size: u32,
    pub hash_block_size: u32,
    pub data_blocks: u64,
    pub salt: Vec<u8>,
    /// The tree's first hash block (after the superblock).
    pub hash_start: u64,
    /// Hash blocks the tree takes.
    pub hash_blocks: u64,
}

crate::layout! {
    /// The superblock's fields, as veritysetup writes them (the kernel's
    /// `struct verity_sb` in cryptsetup's lib/verity).
    pub struct Fields("verity superblock", SIZE) {
        pub signature: [u8; 8] = 0,
        pub version: u32 = 8,
        pub hash_type: u32 = 12,
        pub uuid: [u8; 16] = 16,
        pub algorithm: [u8; 32] = 32,
        pub data_block_size: u32 = 64,
        pub hash_block_size: u32 = 68,
        pub data_blocks: u64 = 72,
        pub salt_size: u16 = 80,
        pub salt: [u8; MAX_SALT] = 88,
    }
}

/// A block size field: a power of two from 512 to the kernel's limit (its
/// page size, 4096 here: veritysetup formats up to 512 KiB, which no kernel
/// of this architecture opens).
fn block_size(v: u32, field: &str) -> Result<u32, TargetError> {
    if v.is_power_of_two() && (512..=MAX_DATA_BLOCK).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{field}: {v} (a power of two from 512 to {MAX_DATA_BLOCK})").into())
    }
}

/// Parse the superblock in `b`, read at byte `offset` of the hash device;
/// `what` names it in errors.
pub fn parse(b: &[u8; SIZE], offset: u64, what: &str) -> Result<Superblock, TargetError> {
    let field = |name: &str| format!("{what}: verity superblock at byte {offset}: {name}");
    let f = Fields::decode(b)?;
    if &f.signature != MAGIC {
        return Err(format!("{what}: no verity superblock at byte {offset} (no \"verity\" magic)").into());
    }
    let version = f.version;
    if version != 1 {
        return Err(format!("{}: {version} (dmkit reads version 1)", field("version")).into());
    }
    let hash_type = f.hash_type;
    if hash_type > 1 {
        return Err(format!("{}: {hash_type} (0 or 1)", field("hash type")).into());
    }
    let uuid = f.uuid;
    let alg = &f.algorithm;
    let len = alg
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| format!("{}: not NUL-terminated in its 32 bytes", field("algorithm")))?;
    let algorithm = String::from_utf8_lossy(&alg[..len]).into_owned();
    let digest_size = Alg::new(&algorithm)
        .ok_or_else(|| {
            format!(
                "{}: '{algorithm}' (dmkit has sha256, sha1, sha224, sha384, sha512)",
                field("algorithm")
            )
        })?
        .size();
    let data_block_size = block_size(f.data_block_size, &field("data block size"))?;
    let hash_block_size = block_size(f.hash_block_size, &field("hash block size"))?;
    if (hash_block_size as usize) < 2 * digest_size {
        return Err(format!(
            "{}: {hash_block_size} bytes hold fewer than two {algorithm} digests",
            field("hash block size")
        ).into());
    }
    let data_blocks = f.data_blocks;
    if data_blocks == 0 || data_blocks.checked_mul(u64::from(data_block_size)).is_none() {
        return Err(format!(
            "{}: {data_blocks} (1 to {} blocks of {data_block_size} bytes)",
            field("data blocks"),
            u64::MAX / u64::from(data_block_size)
        ).into());
    }
    let salt_size = usize::from(f.salt_size);
    if salt_size > MAX_SALT {
        return Err(format!("{}: {salt_size} (at most {MAX_SALT})", field("salt size")).into());
    }
    let salt = f.salt[..salt_size].to_vec();
    // the tree starts at the first hash block after the superblock
    let hash_start = (offset + SIZE as u64).div_ceil(u64::from(hash_block_size));
    let geo = Geometry::new(
        hash_type,
        data_block_size.trailing_zeros(),
        hash_block_size.trailing_zeros(),
        data_blocks,
        hash_start,
        digest_size,
    )
    .map_err(|e| format!("{}: {e}", field("data blocks")))?;
    Ok(Superblock {
        offset,
        hash_type,
        uuid,
        algorithm,
        data_block_size,
        hash_block_size,
        data_blocks,
        salt,
        hash_start,
        hash_blocks: geo.hash_blocks - hash_start,
    })
}

/// Read and check the superblock at byte `offset` of `hash` (a file or a
/// block device), and that the device holds the whole tree.
pub fn read(hash: &Path, offset: u64) -> Result<Superblock, TargetError> {
    let p = hash.display();
    if !offset.is_multiple_of(512) {
        return Err(format!("hash offset {offset}: not a multiple of 512 bytes").into());
    }
    let f = std::fs::File::open(hash).map_err(|e| format!("{p}: {e}"))?;
    let mut b = [0u8; SIZE];
    f.read_exact_at(&mut b, offset).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            format!("{p}: the device ends before the verity superblock's 512 bytes at byte {offset}")
        } else {
            format!("{p}: reading the verity superblock at byte {offset}: {e}")
        }
    })?;
    let sb = parse(&b, offset, &p.to_string())?;
    let size = bytes(hash)?;
    let end = sb.hash_device_bytes();
    if end > size {
        return Err(format!(
            "{p}: the hash tree ends at byte {end} ({} hash blocks of {} bytes from block {}), \
             the device holds {size} bytes",
            sb.hash_blocks, sb.hash_block_size, sb.hash_start
        ).into());
    }
    Ok(sb)
}

/// The size of a file or block device.
fn bytes(p: &Path) -> Result<u64, TargetError> {
    crate::targets::crypt::luks::device_bytes(p).map_err(|e| TargetError::invalid(e.to_string()))
}

impl Superblock {
    /// The bytes of the hash device up to the tree's end (veritysetup dump's
    /// "Hash device size").
    pub fn hash_device_bytes(&self) -> u64 {
        (self.hash_start + self.hash_blocks).saturating_mul(u64::from(self.hash_block_size))
    }

    pub fn uuid_string(&self) -> String {
        let h = hex::encode(self.uuid);
        format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..])
    }

    fn salt_hex(&self) -> String {
        if self.salt.is_empty() {
            "-".into()
        } else {
            hex::encode(&self.salt)
        }
    }

    /// What `dmkit verity dump` prints.
    pub fn summary(&self) -> String {
        format!(
            "superblock offset: {}\nuuid: {}\nhash type: {}\nalgorithm: {}\ndata block size: {}\n\
             hash block size: {}\ndata blocks: {}\nsalt: {}\nhash start block: {}\nhash blocks: {}\n\
             hash device bytes: {}\n",
            self.offset,
            self.uuid_string(),
            self.hash_type,
            self.algorithm,
            self.data_block_size,
            self.hash_block_size,
            self.data_blocks,
            self.salt_hex(),
            self.hash_start,
            self.hash_blocks,
            self.hash_device_bytes()
        )
    }

    /// The table line (`dmsetup table` form) that opens `data` (of
    /// `data_bytes` bytes) verified by this tree on `hash` with `root` (hex).
    pub fn table(&self, data: &str, data_bytes: u64, hash: &str, root: &str) -> Result<String, TargetError> {
        let ds = Alg::new(&self.algorithm).map_or(0, |a| a.size());
        let root = root.to_ascii_lowercase();
        if root.len() != 2 * ds || hex::decode(&root).is_err() {
            return Err(format!(
                "root hash '{root}': {} hex digits for {}",
                2 * ds,
                self.algorithm
            ).into());
        }
        let bytes = self.data_blocks * u64::from(self.data_block_size);
        if bytes > data_bytes {
            return Err(format!(
                "{data}: {data_bytes} bytes, smaller than the superblock's {} data blocks of {} bytes",
                self.data_blocks, self.data_block_size
            ).into());
        }
        Ok(format!(
            "0 {} verity {} {data} {hash} {} {} {} {} {} {root} {}",
            bytes / 512,
            self.hash_type,
            self.data_block_size,
            self.hash_block_size,
            self.data_blocks,
            self.hash_start,
            self.algorithm,
            self.salt_hex()
        ))
    }
}

/// `dmkit verity table`: the line that opens `data` with the tree whose
/// superblock is at byte `offset` of `hash`, and root hash `root`.
pub fn table(data: &Path, hash: &Path, root: &str, offset: u64) -> Result<String, TargetError> {
    let sb = read(hash, offset)?;
    sb.table(
        &data.to_string_lossy(),
        bytes(data)?,
        &hash.to_string_lossy(),
        root,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn good() -> [u8; SIZE] {
        let mut b = [0u8; SIZE];
        b[..8].copy_from_slice(MAGIC);
        b[8] = 1;
        b[12] = 1;
        b[32..38].copy_from_slice(b"sha256");
        b[64..68].copy_from_slice(&4096u32.to_le_bytes());
        b[68..72].copy_from_slice(&4096u32.to_le_bytes());
        b[72..80].copy_from_slice(&1024u64.to_le_bytes());
        b[80] = 4;
        b[88..92].copy_from_slice(&[1, 2, 3, 4]);
        b
    }

    #[test]
    fn fields_and_the_tree_geometry() {
        let sb = parse(&good(), 0, "h").expect("superblock");
        assert_eq!((sb.hash_start, sb.hash_blocks, sb.hash_device_bytes()), (1, 9, 40960));
        assert_eq!(sb.salt, vec![1, 2, 3, 4]);
        // at byte 4096 the superblock takes block 1, the tree starts at 2
        assert_eq!(parse(&good(), 4096, "h").expect("superblock").hash_start, 2);
        let root = "ab".repeat(32);
        assert_eq!(
            sb.table("d", 4 << 20, "h", &root.to_uppercase()).expect("table"),
            format!("0 8192 verity 1 d h 4096 4096 1024 1 sha256 {root} 01020304")
        );
        assert!(sb.table("d", (4 << 20) - 1, "h", &root).unwrap_err().what().contains("smaller"));
        assert!(sb.table("d", 4 << 20, "h", "abcd").unwrap_err().what().contains("64 hex digits"));
    }

    #[test]
    fn lying_fields_are_refused_by_name() {
        let cases: [(usize, &[u8], &str); 9] = [
            (0, b"VERIT", "magic"),
            (8, &[2], "version: 2"),
            (12, &[7], "hash type: 7"),
            (32, b"md5\0\0\0", "algorithm: 'md5'"),
            (32, &[b'a'; 32], "algorithm: not NUL-terminated"),
            (64, &[0, 3, 0, 0], "data block size: 768"),
            (70, &[1], "hash block size: 69632"),
            (72, &[0xff; 8], "data blocks: 18446744073709551615"),
            (80, &[1, 1], "salt size: 257"),
        ];
        for (at, bytes, want) in cases {
            let mut b = good();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            let e = parse(&b, 0, "h").unwrap_err();
            assert!(e.what().contains(want), "{want}: {e}");
        }
        let mut b = good();
        b[72..80].copy_from_slice(&0u64.to_le_bytes());
        assert!(parse(&b, 0, "h").unwrap_err().what().contains("data blocks: 0"));
    }
}
