//! CRC-32C as the kernel uses it for metadata blocks: `crc32c(~0, data) ^ salt`,
//! i.e. initial value 0xFFFFFFFF and no final inversion.

const POLY: u32 = 0x82F6_3B78;

/// Slicing-by-8 tables, built at compile time.
static TABLES: [[u32; 256]; 8] = build_tables();

const fn build_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut s = 1;
    while s < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            i += 1;
        }
        s += 1;
    }
    t
}

/// CRC-32C register update without pre/post inversion.
pub fn crc32c_raw(mut crc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let lo = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) ^ crc;
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = TABLES[7][(lo & 0xff) as usize]
            ^ TABLES[6][((lo >> 8) & 0xff) as usize]
            ^ TABLES[5][((lo >> 16) & 0xff) as usize]
            ^ TABLES[4][(lo >> 24) as usize]
            ^ TABLES[3][(hi & 0xff) as usize]
            ^ TABLES[2][((hi >> 8) & 0xff) as usize]
            ^ TABLES[1][((hi >> 16) & 0xff) as usize]
            ^ TABLES[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = (crc >> 8) ^ TABLES[0][((crc ^ b as u32) & 0xff) as usize];
    }
    crc
}

/// Checksum of a metadata block: covers bytes 4..4096, xor the per-type salt.
pub fn block_csum(block: &[u8], salt: u32) -> u32 {
    crc32c_raw(0xFFFF_FFFF, &block[4..]) ^ salt
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectors() {
        assert_eq!(crc32c_raw(0xFFFF_FFFF, b"123456789"), 0x1CF9_6D7C);
        assert_eq!(crc32c_raw(0xFFFF_FFFF, &[0u8; 4092]), 0x58CD_A791);
        let z = [0u8; 4096];
        assert_eq!(block_csum(&z, 160774), 0x58CF_D397);
        assert_eq!(block_csum(&z, 121107), 0x58CC_7E82);
        assert_eq!(block_csum(&z, 240779), 0x58CE_0B1A);
        assert_eq!(block_csum(&z, 160478), 0x58CF_D54F);
    }

    #[test]
    fn empty_leaf_vector() {
        let mut b = [0u8; 4096];
        b[4] = 2;
        b[8] = 13;
        b[20] = 252;
        b[24] = 8;
        assert_eq!(block_csum(&b, 121107), 0x49AD_3021);
    }
}
