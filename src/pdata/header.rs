//! The header every persistent-data superblock of the kernel's device-mapper
//! targets begins with (thin, era, cache): checksum, flags, its own block number,
//! uuid, magic and version, in that order. The rest of each superblock is its
//! target's own.

use super::{le32, le64, put32, put64};

/// Bytes of the header (csum u32, flags u32, blocknr u64, uuid[16], magic u64, version u32).
pub const SIZE: usize = 44;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub flags: u32,
    pub blocknr: u64,
    pub uuid: [u8; 16],
    pub magic: u64,
    pub version: u32,
}

impl Header {
    /// The header at the start of `d` (at least [`SIZE`] bytes); the checksum
    /// is the block cache's to check.
    pub fn decode(d: &[u8]) -> Header {
        let mut uuid = [0u8; 16];
        uuid.copy_from_slice(&d[16..32]);
        Header {
            flags: le32(d, 4),
            blocknr: le64(d, 8),
            uuid,
            magic: le64(d, 32),
            version: le32(d, 40),
        }
    }

    /// Write the header at the start of `d`, the checksum left for the cache.
    pub fn encode(&self, d: &mut [u8]) {
        put32(d, 4, self.flags);
        put64(d, 8, self.blocknr);
        d[16..32].copy_from_slice(&self.uuid);
        put64(d, 32, self.magic);
        put32(d, 40, self.version);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let h = Header {
            flags: 3,
            blocknr: 7,
            uuid: [9; 16],
            magic: 0o6142003,
            version: 2,
        };
        let mut d = [0u8; SIZE];
        h.encode(&mut d);
        assert_eq!(&d[32..40], &0o6142003u64.to_le_bytes());
        assert_eq!(Header::decode(&d), h);
    }
}
