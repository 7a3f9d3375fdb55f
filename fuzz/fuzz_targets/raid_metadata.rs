//! A raid array assembled from arbitrary metadata: the input's first 8 KiB are
//! leg 0's metadata device (dm-raid superblock, bitmap superblock and bits),
//! the next 8 KiB leg 1's, and so on for up to four legs; byte 32768, if the
//! input reaches it, picks the raid type (raid1 of two legs without it: the
//! first corpus), raid5_ls of 3 legs, raid6_zr of 4, raid10 of 3, raid0 of 2.
//! Then a read, a `check` and the status. Superblocks and bitmaps that lie
//! (levels, layouts, chunks, positions, events, failed legs, offsets, sizes)
//! must be refused or served, never panic or hang.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // (type and its params, legs, array sectors)
    let (head, legs, sectors) = match data.get(32768).map(|b| b % 5) {
        None | Some(0) => ("raid1 3 0 region_size 128", 2, 2048),
        Some(1) => ("raid5_ls 3 16 region_size 128", 3, 2048),
        Some(2) => ("raid6_zr 3 16 region_size 128", 4, 2048),
        Some(3) => ("raid10 3 16 region_size 128", 3, 1536),
        _ => ("raid0 1 16", 2, 2048),
    };
    let mut table = format!("0 {sectors} raid {head} {legs}");
    for i in 0..legs {
        let part = data.get(i * 8192..).unwrap_or(&[]);
        let path = common::dir().join(format!("raid-meta{i}"));
        let mut img = vec![0u8; 64 << 10];
        let n = part.len().min(8192);
        img[..n].copy_from_slice(&part[..n]);
        if std::fs::write(&path, &img).is_err() {
            return;
        }
        let d = common::file(&format!("raid-data{i}"), 1 << 20);
        table.push_str(&format!(" {} {d}", path.display()));
    }
    common::exercise("rd", &table, Some("check"));
});
