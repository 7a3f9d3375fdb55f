//! An integrity device whose first bytes are the input: its first 4 KiB the
//! superblock area, the rest the journal (or, in bitmap mode, the bitmap)
//! over a 1 MiB device of zeroes. The table takes the superblock's tag size
//! and block size, so a superblock that parses reaches the journal's replay;
//! the superblock area's last byte picks the mode (J, B, D or R). The device
//! is made (superblock checks, journal replay or bitmap recalculation), read,
//! its status asked and removed (its journal or bitmap closed). Superblocks
//! and journals that lie (sizes, sections, commit ids, entries' sectors,
//! tags) must be refused or served, never panic or hang.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

const DEVICE: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let mut img = vec![0u8; DEVICE];
    let n = data.len().min(DEVICE);
    img[..n].copy_from_slice(&data[..n]);
    let tag = u16::from_le_bytes([img[10], img[11]]).clamp(1, 300);
    let block = 512u32 << (img[28] & 3);
    let mode = ["J", "B", "D", "R"][usize::from(img[4095] & 3)];
    let path = common::dir().join("integrity");
    if std::fs::write(&path, &img).is_err() {
        return;
    }
    let table = format!(
        "0 8 integrity {} 0 {tag} {mode} 4 block_size:{block} internal_hash:crc32c fix_padding fix_hmac",
        path.display()
    );
    common::exercise("im", &table, None);
});
