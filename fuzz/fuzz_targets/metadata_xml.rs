//! The thin, cache and era XML readers (thin_restore, cache_restore,
//! era_restore's input): the first byte picks the reader, the rest is the text.
//! Hostile XML gets an error, never a panic, a hang or an allocation sized by a
//! number in it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 3 {
        0 => {
            if let Ok(text) = std::str::from_utf8(rest) {
                let _ = dmkit::thin::xml::parse(text);
            }
        }
        1 => {
            let _ = dmkit::cache::xml::parse(std::io::Cursor::new(rest));
        }
        _ => {
            let _ = dmkit::era::xml::parse(std::io::Cursor::new(rest));
        }
    }
});
