//! A persistent snapshot opened on a COW device holding arbitrary bytes (header
//! and exception areas), through a real table load; then reads of the snapshot.
#![no_main]
#[path = "../common.rs"]
mod common;
use dmkit::mapper::devio;
use dmkit::mapper::engine::Dest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reg = common::registry();
    let origin = common::file("snap-origin", 1 << 20);
    let cow = common::dir().join("snap-cow");
    let mut img = vec![0u8; 128 << 10];
    let n = data.len().min(img.len());
    img[..n].copy_from_slice(&data[..n]);
    if std::fs::write(&cow, &img).is_err() {
        return;
    }
    let table = format!("0 2048 snapshot {origin} {} P 8", cow.display());
    if reg.create("s", Some(&table), false, None).is_ok() {
        if let Ok(d) = reg.get("s") {
            let mut b = vec![0u8; 256 << 10];
            let _ = devio::read(&Dest::Dm(d), 0, &mut b);
        }
        let _ = reg.table_lines(Some("s"), true, false);
        let _ = reg.remove("s", true, false);
        let _ = reg.remove("s", false, false);
    }
});
