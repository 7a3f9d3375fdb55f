//! The NBD handshake (fixed newstyle options) from arbitrary client bytes.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let reg = common::registry();
    let mut p = common::Pipe {
        input: data,
        output: Vec::new(),
    };
    let _ = dmkit::export::nbd::handshake::negotiate(&mut p, reg);
});
