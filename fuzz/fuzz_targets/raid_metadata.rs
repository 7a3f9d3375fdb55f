//! A raid1 of two legs assembled from arbitrary metadata: the input's first 8 KiB
//! are leg 0's metadata device (dm-raid superblock, bitmap superblock and bits),
//! the next 8 KiB leg 1's; then a read, a `check` and the status. Superblocks
//! and bitmaps that lie (positions, events, failed legs, offsets, sizes) must
//! be refused or served, never panic or hang.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut metas = Vec::new();
    for (i, part) in [data.get(..8192).unwrap_or(data), data.get(8192..).unwrap_or(&[])]
        .iter()
        .enumerate()
    {
        let path = common::dir().join(format!("raid-meta{i}"));
        let mut img = vec![0u8; 64 << 10];
        let n = part.len().min(8192);
        img[..n].copy_from_slice(&part[..n]);
        if std::fs::write(&path, &img).is_err() {
            return;
        }
        metas.push(path.display().to_string());
    }
    let (d0, d1) = (
        common::file("raid-data0", 1 << 20),
        common::file("raid-data1", 1 << 20),
    );
    let table = format!(
        "0 2048 raid raid1 3 0 region_size 128 2 {} {d0} {} {d1}",
        metas[0], metas[1]
    );
    common::exercise("rd", &table, Some("check"));
});
