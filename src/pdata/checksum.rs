//! CRC-32C as the kernel uses it for metadata blocks: `crc32c(~0, data) ^ salt`,
//! i.e. initial value 0xFFFFFFFF and no final inversion.

/// CRC-32C register update without pre/post inversion (the `crc32c` crate uses
/// the SSE4.2 instruction where the CPU has it).
pub fn crc32c_raw(crc: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!crc, data)
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
