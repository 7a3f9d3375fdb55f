//! A persistent snapshot opened on a COW device holding arbitrary bytes (header
//! and exception areas), through a real table load; then a read of it.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let origin = common::file("snap-origin", 1 << 20);
    let table = |cow: &str| format!("0 2048 snapshot {origin} {cow} P 8");
    common::open_on_image("snap-cow", 128 << 10, data, "s", &table, None);
});
