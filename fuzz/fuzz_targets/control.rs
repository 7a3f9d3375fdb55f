//! The control socket's protocol: one request (argument count, arguments,
//! standard input) from arbitrary bytes, run against the registry (through the daemon's control context).
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ctx = common::ctx();
    let mut p = common::Pipe {
        input: data,
        output: Vec::new(),
    };
    let _ = dmkit::control::handle(&mut p, ctx);
});
