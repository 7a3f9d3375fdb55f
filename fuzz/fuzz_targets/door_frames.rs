//! The dm ioctl door's socket, fed bytes as the door's C library frames them
//! (a 16-byte header: request, buffer length, bytes carried, directory length;
//! the carried bytes; the directory), any number of frames, then a hang-up:
//! the daemon's connection loop answers or refuses each and ends, never
//! panicking, hanging or allocating by a length it was sent.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

fuzz_target!(|data: &[u8]| {
    let ctx = common::ctx();
    let Ok((mut client, mut server)) = UnixStream::pair() else {
        return;
    };
    let input = data.to_vec();
    // the program's side: its frames, then a hang-up, reading the replies
    let peer = std::thread::spawn(move || {
        let mut reader = match client.try_clone() {
            Ok(r) => r,
            Err(_) => return,
        };
        let drain = std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = reader.read_to_end(&mut sink);
        });
        let _ = client.write_all(&input);
        let _ = client.shutdown(std::net::Shutdown::Write);
        let _ = drain.join();
    });
    let _ = dmkit::control::door::serve_connection(&mut server, ctx);
    drop(server);
    let _ = peer.join();
    common::trim_registry(ctx);
});
