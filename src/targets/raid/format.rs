//! The kernel's dm-raid metadata, as Linux 6.12 writes it (docs/design/dm-raid.md
//! §3 and §5): the dm-raid superblock at sector 0 of each metadata device and
//! md's write-intent bitmap at byte 4096 of it (a 256-byte bitmap superblock,
//! then one bit per region, least significant first). Little-endian; neither
//! superblock has a checksum.

use crate::pdata::{le32, le64, put32, put64};

/// "DmRd".
pub const SB_MAGIC: u32 = 0x6452_6d44;
/// "bitm".
pub const BITMAP_MAGIC: u32 = 0x6d74_6962;
/// The superblock's bytes; the rest of its 512-byte sector is zero.
pub const SB_BYTES: usize = 0x94;
/// Where the bitmap starts on a metadata device, in bytes.
pub const BITMAP_OFFSET: u64 = 4096;
/// The bitmap superblock's bytes, before the bits.
pub const BITMAP_SB_BYTES: usize = 256;
/// "No sector": in sync, no reshape.
pub const MAX_SECTOR: u64 = u64::MAX;
/// compat_features bit 0: the fields from `flags` on are valid (v1.9.0).
const SUPPORTS_V190: u32 = 1;
/// The kernel's jiffies per second (Debian's 6.12 config): the bitmap stores
/// the daemon period in seconds, the table gives it in jiffies.
pub const HZ: u64 = 250;
/// md's largest number of bitmap chunks.
pub const MAX_CHUNKS: u64 = 1 << 21;

/// One leg's dm-raid superblock (only what a raid1 uses and checks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Super {
    pub compat: u32,
    pub num_devices: u32,
    pub array_position: u32,
    pub events: u64,
    /// Legs the writer knew failed: bit i is leg i (0..256).
    pub failed: [u64; 4],
    pub disk_recovery_offset: u64,
    pub array_resync_offset: u64,
    pub level: u32,
    pub layout: u32,
    pub stripe_sectors: u32,
    pub flags: u32,
    pub reshape_position: u64,
    pub new_level: u32,
    pub delta_disks: i32,
    pub array_sectors: u64,
    pub data_offset: u64,
    pub sectors: u64,
    pub incompat: u32,
}

impl Super {
    /// Leg `position`'s superblock in an array of `n` legs at md `level`,
    /// `layout` and `stripe_sectors` (the chunk), of `array` sectors using
    /// `sectors` of each leg.
    pub fn new(level: u32, layout: u32, stripe_sectors: u32, n: u32, position: u32, array: u64, sectors: u64) -> Super {
        Super {
            compat: SUPPORTS_V190,
            num_devices: n,
            array_position: position,
            events: 0,
            failed: [0; 4],
            disk_recovery_offset: MAX_SECTOR,
            array_resync_offset: MAX_SECTOR,
            level,
            layout,
            stripe_sectors,
            flags: 0,
            reshape_position: MAX_SECTOR,
            new_level: level,
            delta_disks: 0,
            array_sectors: array,
            data_offset: 0,
            sectors,
            incompat: 0,
        }
    }

    /// The superblock in `b` (a sector at least), or None without the magic
    /// (a new leg). Only the first 64 failed legs count before v1.9.0.
    pub fn decode(b: &[u8]) -> Option<Super> {
        if b.len() < SB_BYTES || le32(b, 0) != SB_MAGIC {
            return None;
        }
        let compat = le32(b, 4);
        let v190 = compat & SUPPORTS_V190 != 0;
        let ext = |i: usize| if v190 { le64(b, 0x78 + 8 * i) } else { 0 };
        Some(Super {
            compat,
            num_devices: le32(b, 8),
            array_position: le32(b, 0x0c),
            events: le64(b, 0x10),
            failed: [le64(b, 0x18), ext(0), ext(1), ext(2)],
            disk_recovery_offset: le64(b, 0x20),
            array_resync_offset: le64(b, 0x28),
            level: le32(b, 0x30),
            layout: le32(b, 0x34),
            stripe_sectors: le32(b, 0x38),
            flags: if v190 { le32(b, 0x3c) } else { 0 },
            reshape_position: if v190 { le64(b, 0x40) } else { MAX_SECTOR },
            new_level: if v190 { le32(b, 0x48) } else { le32(b, 0x30) },
            delta_disks: if v190 { le32(b, 0x54) as i32 } else { 0 },
            array_sectors: if v190 { le64(b, 0x58) } else { 0 },
            data_offset: if v190 { le64(b, 0x60) } else { 0 },
            sectors: if v190 { le64(b, 0x70) } else { 0 },
            incompat: le32(b, 0x90),
        })
    }

    /// The sector the kernel writes: the fields, then zeroes.
    pub fn encode(&self, out: &mut [u8; 512]) {
        out.fill(0);
        put32(out, 0, SB_MAGIC);
        put32(out, 4, self.compat);
        put32(out, 8, self.num_devices);
        put32(out, 0x0c, self.array_position);
        put64(out, 0x10, self.events);
        put64(out, 0x18, self.failed[0]);
        put64(out, 0x20, self.disk_recovery_offset);
        put64(out, 0x28, self.array_resync_offset);
        put32(out, 0x30, self.level);
        put32(out, 0x34, self.layout);
        put32(out, 0x38, self.stripe_sectors);
        put32(out, 0x3c, self.flags);
        put64(out, 0x40, self.reshape_position);
        put32(out, 0x48, self.new_level);
        put32(out, 0x4c, self.layout);
        put32(out, 0x50, self.stripe_sectors);
        put32(out, 0x54, self.delta_disks as u32);
        put64(out, 0x58, self.array_sectors);
        put64(out, 0x60, self.data_offset);
        put64(out, 0x68, self.data_offset);
        put64(out, 0x70, self.sectors);
        for i in 0..3 {
            put64(out, 0x78 + 8 * i, self.failed[i + 1]);
        }
        put32(out, 0x90, self.incompat);
    }

    /// Whether leg `i` is marked failed.
    pub fn has_failed(&self, i: usize) -> bool {
        self.failed.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
}

/// md's bitmap superblock, as dm-raid uses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BitmapSuper {
    pub version: u32,
    pub events: u64,
    pub events_cleared: u64,
    pub sync_size: u64,
    pub state: u32,
    /// The region size in bytes.
    pub chunksize: u32,
    /// Seconds.
    pub daemon_sleep: u32,
    pub write_behind: u32,
}

/// `state` bit 1: the bits cannot be trusted, every region is dirty.
pub const BITMAP_STALE: u32 = 2;

impl BitmapSuper {
    /// The bitmap superblock in `b` (256 bytes at least), checked as md checks
    /// it when the array starts: Err names the rule, in md's words.
    pub fn decode(b: &[u8]) -> Result<BitmapSuper, &'static str> {
        if b.len() < BITMAP_SB_BYTES || le32(b, 0) != BITMAP_MAGIC {
            return Err("bad magic");
        }
        let s = BitmapSuper {
            version: le32(b, 4),
            events: le64(b, 24),
            events_cleared: le64(b, 32),
            sync_size: le64(b, 40),
            state: le32(b, 48),
            chunksize: le32(b, 52),
            daemon_sleep: le32(b, 56),
            write_behind: le32(b, 60),
        };
        if !(3..=4).contains(&s.version) {
            // 5 is md-cluster's, which dm-raid never writes
            return Err("unrecognized superblock version");
        }
        if s.chunksize < 512 {
            return Err("bitmap chunksize too small");
        }
        if !s.chunksize.is_power_of_two() {
            return Err("bitmap chunksize not a power of 2");
        }
        if s.daemon_sleep == 0 || u64::from(s.daemon_sleep) * HZ > u64::from(u32::MAX >> 1) {
            return Err("daemon sleep period out of range");
        }
        if s.write_behind > 16383 {
            return Err("write-behind limit out of range (0 - 16383)");
        }
        if b[8..24].iter().any(|&x| x != 0) {
            return Err("bitmap superblock UUID mismatch");
        }
        Ok(s)
    }

    /// The 256 bytes md writes (uuid zero, no cluster).
    pub fn encode(&self, out: &mut [u8]) {
        out[..BITMAP_SB_BYTES].fill(0);
        put32(out, 0, BITMAP_MAGIC);
        put32(out, 4, self.version);
        put64(out, 24, self.events);
        put64(out, 32, self.events_cleared);
        put64(out, 40, self.sync_size);
        put32(out, 48, self.state);
        put32(out, 52, self.chunksize);
        put32(out, 56, self.daemon_sleep);
        put32(out, 60, self.write_behind);
    }
}

/// The bytes of the bitmap area (superblock and bits) for `chunks` regions.
pub fn bitmap_bytes(chunks: u64) -> u64 {
    BITMAP_SB_BYTES as u64 + chunks.div_ceil(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_superblock_round_trips_at_the_kernels_offsets() {
        let mut s = Super::new(1, 0, 0, 2, 1, 2048, 2048);
        s.events = 7;
        s.failed[0] = 1;
        s.failed[2] = 1 << 3;
        s.array_resync_offset = 1024;
        let mut b = [0u8; 512];
        s.encode(&mut b);
        assert_eq!(&b[0..4], b"DmRd");
        assert_eq!(le64(&b, 0x10), 7);
        assert_eq!(le64(&b, 0x58), 2048);
        assert!(b[SB_BYTES..].iter().all(|&x| x == 0));
        let d = Super::decode(&b).expect("decodes");
        assert_eq!(d, s);
        assert!(d.has_failed(0) && d.has_failed(128 + 3) && !d.has_failed(1));
        assert!(Super::decode(&[0u8; 512]).is_none());
    }

    #[test]
    fn a_bitmap_superblock_round_trips_and_md_checks_hold() {
        let s = BitmapSuper {
            version: 4,
            events: 3,
            events_cleared: 2,
            sync_size: 2048,
            state: 0,
            chunksize: 4 << 20,
            daemon_sleep: 5,
            write_behind: 0,
        };
        let mut b = [0u8; 256];
        s.encode(&mut b);
        assert_eq!(&b[0..4], b"bitm");
        assert_eq!(BitmapSuper::decode(&b), Ok(s.clone()));
        let mut z = b;
        put32(&mut z, 56, 0);
        assert_eq!(BitmapSuper::decode(&z), Err("daemon sleep period out of range"));
        let mut c = b;
        put32(&mut c, 52, 3 << 20);
        assert_eq!(BitmapSuper::decode(&c), Err("bitmap chunksize not a power of 2"));
        let mut u = b;
        u[10] = 1;
        assert_eq!(BitmapSuper::decode(&u), Err("bitmap superblock UUID mismatch"));
    }
}
