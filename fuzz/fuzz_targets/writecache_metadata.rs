//! A writecache (ssd mode) opened on a cache device holding arbitrary metadata
//! bytes (superblock and entries), through a real table load; then a read of
//! the whole device and a flush message.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::mapper::devio;
use dmkit::mapper::engine::Dest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reg = common::registry();
    let origin = common::file("wc-origin", 1 << 20);
    let cache = common::dir().join("wc-cache");
    let mut img = vec![0u8; 128 << 10];
    let n = data.len().min(img.len());
    img[..n].copy_from_slice(&data[..n]);
    if std::fs::write(&cache, &img).is_err() {
        return;
    }
    let table = format!("0 2048 writecache s {origin} {} 4096 0", cache.display());
    if reg.create("f", Some(&table), false, None).is_ok() {
        if let Ok(d) = reg.get("f") {
            let mut b = vec![0u8; 256 << 10];
            let _ = devio::read(&Dest::Dm(d), 0, &mut b);
        }
        let _ = reg.message("f", 0, &["flush".to_string()]);
        let _ = reg.table_lines(Some("f"), true, false);
        let _ = reg.remove("f", true, false);
        let _ = reg.remove("f", false, false);
    }
});
