//! The dm-verity superblock veritysetup writes (read at a table's load and by
//! `dmkit verity`): any 512 bytes get a superblock or an error naming the field.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = [0u8; dmkit::targets::verity::superblock::SIZE];
    let n = data.len().min(b.len());
    b[..n].copy_from_slice(&data[..n]);
    let _ = dmkit::targets::verity::superblock::parse(&b, 0, "fuzz");
});
