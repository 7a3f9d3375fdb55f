//! Table text: the parser, then every target's constructor through a real
//! create (files of the scratch directory and the registry's devices are there
//! to be named), then status and table output, then remove.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = dmkit::table::parse_table(text);
    let reg = common::registry();
    // verity tables need a read-only device, as the kernel's do
    let read_only = text.contains("verity");
    if reg.create("t", Some(text), read_only, None).is_ok() {
        let _ = reg.table_lines(Some("t"), true, false, false);
        let _ = reg.table_lines(Some("t"), false, false, true);
        let _ = reg.remove("t", true, false);
        let _ = reg.remove("t", false, false);
    }
});
