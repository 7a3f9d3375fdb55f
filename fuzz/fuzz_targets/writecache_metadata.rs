//! A writecache (ssd mode) opened on a cache device holding arbitrary metadata
//! bytes (superblock and entries), through a real table load; then a read and a
//! flush message.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let origin = common::file("wc-origin", 1 << 20);
    let table = |cache: &str| format!("0 2048 writecache s {origin} {cache} 4096 0");
    common::open_on_image("wc-cache", 128 << 10, data, "f", &table, Some("flush"));
});
