//! dm-integrity's on-disk format as Linux 6.12 writes it
//! (docs/design/dm-integrity.md): the superblock, where the journal, the tag
//! runs and the data lie, the tags' hashes, and the journal's sections with
//! their commit ids.

use crate::mapper::TargetError;
use sha2::{Digest, Sha256};

/// The superblock area: 4 KiB at the table's offset.
pub const SB_SECTORS: u64 = 8;
pub const MAGIC: &[u8; 8] = b"integrt\0";
/// Metadata sectors at the start of every journal section.
pub const JOURNAL_BLOCK_SECTORS: u64 = 8;
/// Bytes of a journal sector before its commit id.
pub const JOURNAL_SECTOR_DATA: usize = 504;
pub const MAX_TAG_SIZE: u64 = 255;
pub const SALT_SIZE: usize = 16;
pub const DISCARD_FILLER: u8 = 0xf6;
/// Default journal: the device's sectors >> 7, at most this.
pub const DEFAULT_MAX_JOURNAL_SECTORS: u64 = 131072;
pub const DEFAULT_INTERLEAVE_LOG2: u8 = 15;
pub const BITMAP_BLOCK_BYTES: usize = 4096;

pub const SB_FLAG_HAVE_JOURNAL_MAC: u32 = 0x1;
pub const SB_FLAG_RECALCULATING: u32 = 0x2;
pub const SB_FLAG_DIRTY_BITMAP: u32 = 0x4;
pub const SB_FLAG_FIXED_PADDING: u32 = 0x8;
pub const SB_FLAG_FIXED_HMAC: u32 = 0x10;
pub const SB_FLAG_INLINE: u32 = 0x20;
/// Keyed discards (the 6.12 stable kernels' version 7).
pub const SB_FLAG_KEYED_DISCARD: u32 = 0x40;

/// The superblock's fields (64 bytes at the start of the area).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Superblock {
    pub version: u8,
    pub log2_interleave: u8,
    pub tag_size: u16,
    pub journal_sections: u32,
    pub provided_data_sectors: u64,
    pub flags: u32,
    pub log2_spb: u8,
    pub log2_blocks_per_bit: u8,
    pub recalc_sector: u64,
    pub salt: [u8; SALT_SIZE],
}

/// What the superblock area holds.
pub enum Found {
    Superblock(Superblock),
    /// All zeroes: a device to format.
    Blank,
    /// Something else: not ours to format.
    Foreign,
}

crate::layout! {
    /// The superblock's first 64 bytes, as the kernel's `struct superblock`
    /// (dm-integrity.c) lays them out.
    struct Fields("integrity superblock", 64) {
        magic: [u8; 8] = 0,
        version: u8 = 8,
        log2_interleave: u8 = 9,
        tag_size: u16 = 10,
        journal_sections: u32 = 12,
        provided_data_sectors: u64 = 16,
        flags: u32 = 24,
        log2_spb: u8 = 28,
        log2_blocks_per_bit: u8 = 29,
        recalc_sector: u64 = 32,
        salt: [u8; SALT_SIZE] = 48,
    }
}
fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}
pub fn le64(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

impl Superblock {
    /// Read the 4 KiB superblock area.
    pub fn parse(area: &[u8]) -> Found {
        let Ok(f) = Fields::decode(area) else {
            return Found::Foreign;
        };
        if &f.magic != MAGIC {
            return if area.iter().all(|&b| b == 0) {
                Found::Blank
            } else {
                Found::Foreign
            };
        }
        Found::Superblock(Superblock {
            version: f.version,
            log2_interleave: f.log2_interleave,
            tag_size: f.tag_size,
            journal_sections: f.journal_sections,
            provided_data_sectors: f.provided_data_sectors,
            flags: f.flags,
            log2_spb: f.log2_spb,
            log2_blocks_per_bit: f.log2_blocks_per_bit,
            recalc_sector: f.recalc_sector,
            salt: f.salt,
        })
    }

    /// The version the kernel writes for these flags (its `sb_set_version`).
    pub fn set_version(&mut self, bitmap_mode: bool, meta: bool) {
        self.version = if self.flags & SB_FLAG_KEYED_DISCARD != 0 {
            7
        } else if self.flags & SB_FLAG_INLINE != 0 {
            6
        } else if self.flags & SB_FLAG_FIXED_HMAC != 0 {
            5
        } else if self.flags & SB_FLAG_FIXED_PADDING != 0 {
            4
        } else if bitmap_mode || self.flags & SB_FLAG_DIRTY_BITMAP != 0 {
            3
        } else if meta || self.flags & SB_FLAG_RECALCULATING != 0 {
            2
        } else {
            1
        };
    }

    /// The 4 KiB area as written.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; (SB_SECTORS * 512) as usize];
        let f = Fields {
            magic: *MAGIC,
            version: self.version,
            log2_interleave: self.log2_interleave,
            tag_size: self.tag_size,
            journal_sections: self.journal_sections,
            provided_data_sectors: self.provided_data_sectors,
            flags: self.flags,
            log2_spb: self.log2_spb,
            log2_blocks_per_bit: self.log2_blocks_per_bit,
            recalc_sector: self.recalc_sector,
            salt: self.salt,
        };
        b[..Fields::SIZE].copy_from_slice(&f.encode());
        b
    }

    pub fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }
}

/// Where everything lies, from the superblock and the device's size.
#[derive(Clone, Debug)]
pub struct Geometry {
    /// The table's offset: the superblock's sector.
    pub start: u64,
    pub log2_spb: u8,
    pub tag_size: u64,
    pub journal_sections: u64,
    pub entry_size: usize,
    pub section_entries: u64,
    pub section_sectors: u64,
    /// Superblock and journal.
    pub initial_sectors: u64,
    pub log2_interleave: u8,
    /// Tag sectors before each area's data.
    pub metadata_run: u64,
    pub provided: u64,
    /// Superblock, journal and tags on a device of their own.
    pub meta: bool,
}

impl Geometry {
    /// The journal's shape for these sizes (`calculate_journal_section_size`).
    pub fn journal_shape(log2_spb: u8, tag_size: u64) -> (usize, u64, u64) {
        let spb = 1u64 << log2_spb;
        let entry_size = (8 + 8 * spb + tag_size).div_ceil(8) * 8;
        let per_sector = JOURNAL_SECTOR_DATA as u64 / entry_size;
        let section_entries = per_sector * JOURNAL_BLOCK_SECTORS;
        let section_sectors = section_entries * spb + JOURNAL_BLOCK_SECTORS;
        (entry_size as usize, section_entries, section_sectors)
    }

    /// The geometry for a superblock on a device of `dev_sectors`, or, with
    /// a separate metadata device of `meta_sectors` (superblock, journal and
    /// tags there, in tag buffers of 2^`log2_buf` sectors), the data device's
    /// whole; an error says what does not fit.
    pub fn new(sb: &Superblock, start: u64, dev_sectors: u64, meta: Option<(u64, u8)>) -> Result<Geometry, TargetError> {
        let tag_size = u64::from(sb.tag_size);
        let (entry_size, section_entries, section_sectors) = Self::journal_shape(sb.log2_spb, tag_size);
        if section_entries == 0 {
            return Err("Too big tag size".into());
        }
        let mut g = Geometry {
            start,
            log2_spb: sb.log2_spb,
            tag_size,
            journal_sections: u64::from(sb.journal_sections),
            entry_size,
            section_entries,
            section_sectors,
            initial_sectors: SB_SECTORS + section_sectors * u64::from(sb.journal_sections),
            log2_interleave: sb.log2_interleave,
            metadata_run: 1,
            provided: 0,
            meta: meta.is_some(),
        };
        if let Some((meta_sectors, log2_buf)) = meta {
            g.provided = dev_sectors & !(g.spb() - 1);
            let fits = g.initial_sectors + 8 < meta_sectors
                && g.initial_sectors <= u64::from(u32::MAX)
                && (g.provided >> g.log2_spb)
                    .checked_mul(tag_size)
                    .map(|b| b.div_ceil(512 << log2_buf) << log2_buf)
                    .and_then(|m| m.checked_add(start + g.initial_sectors))
                    .is_some_and(|end| end <= meta_sectors);
            if !fits || g.provided == 0 {
                return Err("The device is too small".into());
            }
            return Ok(g);
        }
        let pad: u64 = if sb.has(SB_FLAG_FIXED_PADDING) { 4096 } else { 512 << 8 };
        let run_bytes = tag_size << (sb.log2_interleave - sb.log2_spb);
        g.metadata_run = run_bytes.div_ceil(pad) * pad / 512;
        // the largest multiple of 8 sectors whose last sector fits
        let mut provided = 0u64;
        if dev_sectors > 8 {
            for bit in (3..64 - dev_sectors.leading_zeros()).rev() {
                let p = provided | (1u64 << bit);
                if g.fits(p, dev_sectors) {
                    provided = p;
                }
            }
        }
        if provided == 0 {
            return Err("The device is too small".into());
        }
        g.provided = provided;
        Ok(g)
    }

    fn fits(&self, provided: u64, dev_sectors: u64) -> bool {
        if self.initial_sectors + 8 >= dev_sectors || self.initial_sectors > u64::from(u32::MAX) {
            return false;
        }
        self.data_sector_checked(provided - 1).is_some_and(|s| s < dev_sectors)
    }

    fn data_sector_checked(&self, l: u64) -> Option<u64> {
        let area = l >> self.log2_interleave;
        let off = l & ((1u64 << self.log2_interleave) - 1);
        self.start
            .checked_add(self.initial_sectors)?
            .checked_add(area.checked_mul(1u64 << self.log2_interleave)?)?
            .checked_add((area + 1).checked_mul(self.metadata_run)?)?
            .checked_add(off)
    }

    /// Where the area holding logical sector `l` ends (tag runs are one
    /// piece within an area; with a metadata device, one area).
    pub fn area_end(&self, l: u64) -> u64 {
        if self.meta {
            self.provided
        } else {
            ((l >> self.log2_interleave) + 1) << self.log2_interleave
        }
    }

    pub fn spb(&self) -> u64 {
        1 << self.log2_spb
    }

    pub fn interleave(&self) -> u64 {
        1 << self.log2_interleave
    }

    /// The device sector holding logical sector `l` (below `provided`).
    pub fn data_sector(&self, l: u64) -> u64 {
        if self.meta {
            return l;
        }
        let area = l >> self.log2_interleave;
        let off = l & (self.interleave() - 1);
        self.start + self.initial_sectors + area * self.interleave() + (area + 1) * self.metadata_run + off
    }

    /// The byte on the device where the tag of the block at logical sector
    /// `l` begins.
    pub fn tag_byte(&self, l: u64) -> u64 {
        if self.meta {
            return (self.start + self.initial_sectors) * 512 + (l >> self.log2_spb) * self.tag_size;
        }
        let area = l >> self.log2_interleave;
        let off = l & (self.interleave() - 1);
        (self.start + self.initial_sectors + area * (self.interleave() + self.metadata_run)) * 512
            + (off >> self.log2_spb) * self.tag_size
    }

    /// The device sector of journal sector `s`.
    pub fn journal_sector(&self, s: u64) -> u64 {
        self.start + SB_SECTORS + s
    }

    pub fn journal_entries(&self) -> u64 {
        self.section_entries * self.journal_sections
    }

    /// Journal sectors in all (as the table prints `journal_sectors`).
    pub fn journal_sectors(&self) -> u64 {
        self.section_sectors * self.journal_sections
    }
}

/// The journal sections a format makes from the table's `journal_sectors`
/// (or the default for the device).
pub fn journal_sections_for(journal_sectors: Option<u64>, dev_sectors: u64, section_sectors: u64) -> u32 {
    let want = match journal_sectors {
        Some(0) => 1,
        Some(n) => n,
        None => (dev_sectors >> 7).min(DEFAULT_MAX_JOURNAL_SECTORS),
    };
    (want / section_sectors).clamp(1, u64::from(u32::MAX)) as u32
}

/// A tag's hash (`internal_hash`).
#[derive(Clone)]
pub enum Hash {
    Crc32c,
    /// The kernel's crc32: seed 0, no final inversion.
    Crc32,
    Sha256,
    /// HMAC-SHA-256: the inner and outer states after the key's pads.
    HmacSha256(Box<(Sha256, Sha256)>),
}

impl Hash {
    /// From the table's `alg[:hexkey]`.
    pub fn parse(spec: &str) -> Result<(Hash, String), TargetError> {
        let (alg, key) = match spec.split_once(':') {
            Some((a, k)) => (a, Some(k)),
            None => (spec, None),
        };
        let key = match key {
            Some(k) => Some(hex::decode(k).map_err(|_| "Invalid internal_hash argument".to_string())?),
            None => None,
        };
        let h = match (alg, key) {
            ("crc32c", None) => Hash::Crc32c,
            ("crc32", None) => Hash::Crc32,
            ("sha256", None) => Hash::Sha256,
            ("hmac(sha256)", Some(k)) if !k.is_empty() && k.iter().all(|&b| b == 0) => {
                // what a restart's state file holds in place of a key
                return Err("Error setting internal hash key: the key is all zeroes, as dmkit records a keyed table \
                     (keys are never written down): load the table again with its key"
                    .into());
            }
            ("hmac(sha256)", Some(k)) => {
                let mut k = if k.len() > 64 { Sha256::digest(&k).to_vec() } else { k };
                k.resize(64, 0);
                let pad = |p: u8| {
                    let mut h = Sha256::new();
                    h.update(k.iter().map(|b| b ^ p).collect::<Vec<u8>>());
                    h
                };
                let (inner, outer) = (pad(0x36), pad(0x5c));
                zeroize::Zeroize::zeroize(&mut k);
                Hash::HmacSha256(Box::new((inner, outer)))
            }
            ("hmac(sha256)", None) => return Err("Error setting internal hash key".into()),
            ("crc32c" | "crc32" | "sha256", Some(_)) => return Err("Error setting internal hash key".into()),
            _ => return Err("Invalid internal hash".into()),
        };
        Ok((h, alg.to_string()))
    }

    pub fn digest_size(&self) -> u64 {
        match self {
            Hash::Crc32c | Hash::Crc32 => 4,
            Hash::Sha256 | Hash::HmacSha256(_) => 32,
        }
    }

    pub fn keyed(&self) -> bool {
        matches!(self, Hash::HmacSha256(_))
    }

    /// The tag of a block: the hash of the salt (when the superblock has
    /// one), the block's first logical sector (le64) and its data, cut to or
    /// zero-filled up to `out`'s length.
    pub fn tag(&self, salt: Option<&[u8; SALT_SIZE]>, sector: u64, data: &[u8], out: &mut [u8]) {
        let sec = sector.to_le_bytes();
        let mut full = [0u8; 32];
        let n = match self {
            Hash::Crc32c => {
                let mut c = salt.map_or(0, |s| crc32c::crc32c(s));
                c = if salt.is_some() {
                    crc32c::crc32c_append(c, &sec)
                } else {
                    crc32c::crc32c(&sec)
                };
                c = crc32c::crc32c_append(c, data);
                full[..4].copy_from_slice(&c.to_le_bytes());
                4
            }
            Hash::Crc32 => {
                let mut h = crc32fast::Hasher::new_with_initial(u32::MAX);
                if let Some(s) = salt {
                    h.update(s);
                }
                h.update(&sec);
                h.update(data);
                full[..4].copy_from_slice(&(!h.finalize()).to_le_bytes());
                4
            }
            Hash::Sha256 => {
                let mut h = Sha256::new();
                if let Some(s) = salt {
                    h.update(s);
                }
                h.update(sec);
                h.update(data);
                full.copy_from_slice(&h.finalize());
                32
            }
            Hash::HmacSha256(pads) => {
                let (inner, outer) = &**pads;
                let mut h = inner.clone();
                if let Some(s) = salt {
                    h.update(s);
                }
                h.update(sec);
                h.update(data);
                let mut o = outer.clone();
                o.update(h.finalize());
                full.copy_from_slice(&o.finalize());
                32
            }
        };
        let k = out.len().min(n);
        out[..k].copy_from_slice(&full[..k]);
        out[k..].fill(0);
    }
}

// ---- the journal ----

/// A journal sector's commit id for section `i`, sector `j`, sequence `seq`.
pub fn commit_id(i: u64, j: u64, seq: u8) -> u64 {
    0x1111_1111_1111_1111u64.wrapping_mul(u64::from(seq) + 1) ^ (i << 32) ^ j
}

/// An unused entry's sector field: its high half all ones.
const UNUSED_HI: u32 = u32::MAX;

/// Where entry `n` of a section lies in the section's bytes.
pub fn entry_at(g: &Geometry, n: u64) -> usize {
    ((n % JOURNAL_BLOCK_SECTORS) * 512) as usize + (n / JOURNAL_BLOCK_SECTORS) as usize * g.entry_size
}

/// The logical sector an entry holds, if it is used.
pub fn entry_sector(g: &Geometry, section: &[u8], n: u64) -> Option<u64> {
    let o = entry_at(g, n);
    (le32(section, o + 4) != UNUSED_HI).then(|| le64(section, o))
}

/// An empty section, its commit ids for sequence `seq`.
pub fn empty_section(g: &Geometry, i: u64, seq: u8) -> Vec<u8> {
    let mut s = vec![0u8; (g.section_sectors * 512) as usize];
    for n in 0..g.section_entries {
        let o = entry_at(g, n);
        s[o + 4..o + 8].copy_from_slice(&UNUSED_HI.to_le_bytes());
    }
    seal(&mut s, i, seq);
    s
}

/// Every sector's commit id.
fn seal(s: &mut [u8], i: u64, seq: u8) {
    for (j, sec) in s.chunks_mut(512).enumerate() {
        sec[JOURNAL_SECTOR_DATA..].copy_from_slice(&commit_id(i, j as u64, seq).to_le_bytes());
    }
}

/// A section holding `entries` (logical sector, block data, tag), sealed as
/// section `i` of sequence `seq`.
pub fn build_section(g: &Geometry, i: u64, seq: u8, entries: &[(u64, &[u8], &[u8])]) -> Vec<u8> {
    let mut s = empty_section(g, i, seq);
    let spb = g.spb();
    for (n, (sector, data, tag)) in entries.iter().enumerate() {
        let n = n as u64;
        let o = entry_at(g, n);
        s[o..o + 8].copy_from_slice(&sector.to_le_bytes());
        let first = ((JOURNAL_BLOCK_SECTORS + n * spb) * 512) as usize;
        for k in 0..spb as usize {
            let src = &data[k * 512..(k + 1) * 512];
            let lb = o + 8 + k * 8;
            s[lb..lb + 8].copy_from_slice(&src[JOURNAL_SECTOR_DATA..]);
            let d = first + k * 512;
            s[d..d + 512].copy_from_slice(src);
        }
        let t = o + 8 + spb as usize * 8;
        s[t..t + tag.len()].copy_from_slice(tag);
    }
    seal(&mut s, i, seq);
    s
}

/// Entry `n`'s block as it was written (its sectors' last bytes restored)
/// and its tag.
pub fn entry_block(g: &Geometry, section: &[u8], n: u64) -> (Vec<u8>, Vec<u8>) {
    let spb = g.spb() as usize;
    let o = entry_at(g, n);
    let first = ((JOURNAL_BLOCK_SECTORS + n * g.spb()) * 512) as usize;
    let mut data = section[first..first + spb * 512].to_vec();
    for k in 0..spb {
        let lb = o + 8 + k * 8;
        data[k * 512 + JOURNAL_SECTOR_DATA..(k + 1) * 512].copy_from_slice(&section[lb..lb + 8]);
    }
    let t = o + 8 + spb * 8;
    (data, section[t..t + g.tag_size as usize].to_vec())
}

/// The commit sequences a section's sectors carry: a mask of those seen and
/// the one they all carry, if they agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionSeqs {
    pub mask: u8,
    pub all: Option<u8>,
}

/// What sequences section `i`'s sectors carry; an error names a sector whose
/// commit id matches none.
pub fn section_seqs(g: &Geometry, i: u64, section: &[u8]) -> Result<SectionSeqs, TargetError> {
    let mut mask = 0u8;
    for (j, sec) in section.chunks(512).take(g.section_sectors as usize).enumerate() {
        let id = le64(sec, JOURNAL_SECTOR_DATA);
        let k = (0..4u8)
            .find(|&k| commit_id(i, j as u64, k) == id)
            .ok_or_else(|| format!("journal commit id: section {i} sector {j} matches no sequence"))?;
        mask |= 1 << k;
    }
    let all = (mask.count_ones() == 1).then(|| mask.trailing_zeros() as u8);
    Ok(SectionSeqs { mask, all })
}

/// What a journal scan found (the kernel's `replay_journal`, steps 2 to 6).
#[derive(Debug, PartialEq, Eq)]
pub struct Replay {
    /// The first section to replay, and how many.
    pub write_start: u64,
    pub write_sections: u64,
    /// The sequence the walk expected when it stopped.
    pub want: u8,
    pub last_used: u8,
    pub empty: bool,
}

/// Decide what to replay from what each section's sectors carry and
/// whether any entry is used.
pub fn plan_replay(seqs: &[SectionSeqs], any_used: bool) -> Result<Replay, TargetError> {
    let n = seqs.len() as u64;
    let mut used = [false; 4];
    let mut max_section = [0u64; 4];
    for (i, s) in seqs.iter().enumerate() {
        for k in 0..4 {
            if s.mask & (1 << k) != 0 {
                used[k] = true;
                max_section[k] = i as u64;
            }
        }
    }
    let unused = if !used[3] {
        (0..4).rev().find(|&k| used[k]).map_or(0, |k| k + 1)
    } else {
        (0..4)
            .find(|&k| !used[k])
            .ok_or("journal commit ids: all four sequences are in use")?
    } as u8;
    let last_used = (unused + 3) % 4;
    let mut want = (last_used + 3) % 4;
    let mut empty = !any_used;
    if !used[want as usize] && used[((want + 3) % 4) as usize] {
        empty = true;
    }
    let mut write_start = max_section[last_used as usize] + 1;
    if write_start >= n {
        write_start = 0;
        want = (want + 1) % 4;
    }
    let mut i = write_start;
    let mut write_sections = 0;
    while write_sections < n {
        if seqs[i as usize].all != Some(want) {
            break;
        }
        write_sections += 1;
        i += 1;
        if i == n {
            i = 0;
            want = (want + 1) % 4;
        }
    }
    Ok(Replay {
        write_start,
        write_sections,
        want,
        last_used,
        empty,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sb(tag: u16, log2_spb: u8, sections: u32) -> Superblock {
        Superblock {
            version: 4,
            log2_interleave: 15,
            tag_size: tag,
            journal_sections: sections,
            flags: SB_FLAG_FIXED_PADDING,
            log2_spb,
            ..Superblock::default()
        }
    }

    #[test]
    fn the_worked_geometries_come_out() {
        // 1 GiB, tag 4, 512-byte blocks: the default journal is 93 sections
        let dev = 2_097_152;
        let (_, _, ss) = Geometry::journal_shape(0, 4);
        assert_eq!(ss, 176);
        let n = journal_sections_for(None, dev, ss);
        assert_eq!(n, 93);
        let g = Geometry::new(&sb(4, 0, n), 0, dev, None).unwrap();
        assert_eq!((g.initial_sectors, g.metadata_run, g.provided), (16376, 256, 2_064_392));
        assert_eq!(g.journal_sectors(), 16368);
        let (_, _, ss) = Geometry::journal_shape(3, 4);
        let n = journal_sections_for(None, dev, ss);
        let g = Geometry::new(&sb(4, 3, n), 0, dev, None).unwrap();
        assert_eq!((n, g.initial_sectors, g.metadata_run, g.provided), (41, 16080, 32, 2_079_024));
    }

    #[test]
    fn a_fresh_journal_replays_nothing_and_goes_on_at_section_0() {
        let g = Geometry::new(&sb(4, 0, 4), 0, 200_000, None).unwrap();
        let seqs: Vec<SectionSeqs> = (0..4).map(|i| section_seqs(&g, i, &empty_section(&g, i, 0)).unwrap()).collect();
        let r = plan_replay(&seqs, false).unwrap();
        assert_eq!((r.write_start, r.write_sections, r.want, r.empty), (0, 4, 1, true));
    }

    #[test]
    fn an_entry_comes_back_with_its_last_bytes() {
        let g = Geometry::new(&sb(4, 0, 2), 0, 200_000, None).unwrap();
        let data: Vec<u8> = (0..512).map(|i| (i * 7) as u8).collect();
        let s = build_section(&g, 1, 2, &[(40, &data, &[1, 2, 3, 4])]);
        assert_eq!(entry_sector(&g, &s, 0), Some(40));
        assert_eq!(entry_sector(&g, &s, 1), None);
        let (d, t) = entry_block(&g, &s, 0);
        assert_eq!((d, t), (data, vec![1, 2, 3, 4]));
        assert_eq!(section_seqs(&g, 1, &s).unwrap().all, Some(2));
    }

    #[test]
    fn crc32_is_the_kernels_unseeded_crc() {
        // crc32_le(0, "123456789") without the final inversion
        let mut h = crc32fast::Hasher::new_with_initial(u32::MAX);
        h.update(b"123456789");
        assert_eq!(!h.finalize(), 0x2DFD_2D88);
        let mut t = [0u8; 4];
        Hash::Crc32c.tag(None, 0, b"", &mut t);
        assert_eq!(t, crc32c::crc32c(&[0u8; 8]).to_le_bytes());
    }
}
