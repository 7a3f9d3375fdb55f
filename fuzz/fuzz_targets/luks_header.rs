//! LUKS headers that lie: a LUKS2 header pair or a LUKS1 header that
//! cryptsetup wrote (seeds/luks_header), changed by the input, then read
//! (`dmkit luks dump`'s summary) and turned into a table line with a stand-in
//! key. The first input byte picks: bit 0 the LUKS1 header instead of LUKS2;
//! bit 1 the rest of the input is the primary's JSON area (else byte patches,
//! 4 bytes of offset and 1 of value, repeated); bit 2 leaves the primary's
//! checksum as it is (else it is recomputed over the change, so the change
//! reaches the JSON parser: a header that lies with a valid checksum).
//! Nothing may panic, abort, or allocate beyond the bounds the reader sets.
//! Keyslots are not unlocked: their KDFs' cost is bounded, not small.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::targets::crypt::{luks, LockedBytes};
use libfuzzer_sys::fuzz_target;
use sha2::Digest;

const LUKS2: &[u8] = include_bytes!("../seeds/luks_header/luks2");
const LUKS1: &[u8] = include_bytes!("../seeds/luks_header/luks1");
/// The seed's LUKS2 header size (binary header and JSON area).
const HDR: usize = 16384;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut img = if mode & 1 == 1 {
        LUKS1.to_vec()
    } else {
        LUKS2.to_vec()
    };
    if mode & 2 == 2 && mode & 1 == 0 {
        let n = rest.len().min(HDR - 4096);
        img[4096..HDR].fill(0);
        img[4096..4096 + n].copy_from_slice(&rest[..n]);
    } else {
        for p in rest.chunks_exact(5) {
            let at = u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize % img.len();
            img[at] = p[4];
        }
    }
    if mode & 4 == 0 && mode & 1 == 0 {
        let mut h = sha2::Sha256::new();
        h.update(&img[..448]);
        h.update([0u8; 64]);
        h.update(&img[512..HDR]);
        img[448..480].copy_from_slice(&h.finalize());
    }
    let path = common::dir().join("luks.img");
    std::fs::write(&path, &img).expect("write the image");
    if let Ok(h) = luks::read_header(&path) {
        let _ = h.summary();
        if let Ok(vk) = LockedBytes::new(64) {
            let _ = h.table(&vk, "dev", 1 << 30);
        }
    }
});
