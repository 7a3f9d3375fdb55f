//! The NBD transmission phase: a valid handshake (structured replies, then GO
//! on a device the first byte picks), then arbitrary request bytes, through the
//! real connection and request engine over a socket pair.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

const MAGIC: u64 = 0x49484156454F5054; // IHAVEOPT

fn option(out: &mut Vec<u8>, opt: u32, payload: &[u8]) {
    out.extend_from_slice(&MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let reg = common::registry();
    let name: &[u8] = match pick % 4 {
        0 => b"z",
        1 => b"lin",
        2 => b"thin",
        _ => b"wc",
    };
    let mut hello = Vec::new();
    hello.extend_from_slice(&3u32.to_be_bytes()); // fixed newstyle, no zeroes
    option(&mut hello, 8, &[]); // STRUCTURED_REPLY
    let mut go = Vec::new();
    go.extend_from_slice(&(name.len() as u32).to_be_bytes());
    go.extend_from_slice(name);
    go.extend_from_slice(&0u16.to_be_bytes());
    option(&mut hello, 7, &go); // GO
    let Ok((server, client)) = UnixStream::pair() else {
        return;
    };
    let input: Vec<u8> = hello.into_iter().chain(rest.iter().copied()).collect();
    let mut wr = match client.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    };
    let writer = std::thread::spawn(move || {
        let _ = wr.write_all(&input);
        let _ = wr.shutdown(std::net::Shutdown::Write);
    });
    let mut rd = client;
    let reader = std::thread::spawn(move || {
        let mut sink = [0u8; 1 << 16];
        while matches!(rd.read(&mut sink), Ok(n) if n > 0) {}
    });
    dmkit::export::nbd::serve_connection(server, reg, "fuzz");
    let _ = writer.join();
    let _ = reader.join();
});
