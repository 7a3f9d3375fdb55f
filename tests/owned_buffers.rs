//! Targets that issue I/O from buffers of their own (`MapCtx::remap_owned`),
//! through the real daemon: the toy cipher `xor` transforms every block exactly
//! once, also when its writes are parked and requeued by a suspended device.

use crate::common;
use common::{fio_verify_while_suspending, pattern, read_at, Daemon};

use common::MIB;
const KEY: &str = "5a17c3";

/// What `xor` stores for `data` at target sector `sector` (its documented key
/// stream, written out here independently of the target).
fn xored(data: &[u8], sector: u64) -> Vec<u8> {
    let key = [0x5a_u8, 0x17, 0xc3];
    data.iter()
        .enumerate()
        .map(|(j, b)| {
            let s = sector + j as u64 / 512;
            let i = j % 512;
            b ^ key[i % key.len()] ^ s.to_le_bytes()[i % 8]
        })
        .collect()
}

#[test]
fn xor_writes_read_back_and_land_transformed_once() {
    let d = Daemon::start("xor-once");
    let f = d.dir.sparse("f.img", 8 * MIB);
    // 1 MiB into the file, so the target's sectors differ from the file's
    d.create("x", &format!("0 8192 xor {} 2048 {KEY}", f.display()));
    let mut c = common::nbd::Client::connect(&d.sock(), "x");
    let data = pattern(7, 256 << 10);
    c.write(64 << 10, &data);
    assert!(c.read(64 << 10, data.len()) == data, "read back through xor");
    let on_disk = read_at(&f, MIB + (64 << 10), data.len());
    assert!(on_disk == xored(&data, 128), "the file holds the data XORed once");
    // a write that is not sector-aligned in the request still transforms per sector
    let small = pattern(8, 4096);
    c.write(1 << 20, &small);
    assert!(c.read(1 << 20, 4096) == small);
    assert!(read_at(&f, 2 * MIB, 4096) == xored(&small, 2048));
    assert_eq!(
        d.ok(&["table", "x"]),
        format!("0 8192 xor {} 2048 {KEY}\n", f.display())
    );
}

#[test]
fn fio_verifies_through_xor_while_the_device_below_suspends() {
    let d = Daemon::start("xor-fio");
    let f = d.dir.sparse("f.img", 32 * MIB);
    d.create("lin", &format!("0 65536 linear {} 0", f.display()));
    d.create("x", &format!("0 65536 xor /dev/mapper/lin 0 {KEY}"));
    fio_verify_while_suspending(&d, "x", "lin");
    // Every block fio wrote is in the file XORed exactly once: reading it back
    // through xor gives what the reference key stream makes of the file.
    let mut c = common::nbd::Client::connect(&d.sock(), "x");
    let got = c.read(0, (16 * MIB) as usize);
    let file = read_at(&f, 0, (16 * MIB) as usize);
    assert!(got == xored(&file, 0), "the device reads as the file XORed once");
}
