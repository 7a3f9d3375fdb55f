//! Target messages (`dmsetup message`): the first byte picks the device, the
//! rest is the message text.
#![no_main]
#[path = "../common.rs"]
mod common;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let reg = common::registry();
    let dev = common::FIXTURE[pick as usize % common::FIXTURE.len()];
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    let _ = reg.message(dev, u64::from(pick >> 4), &words);
    let _ = reg.table_lines(Some(dev), true, false, false);
});
