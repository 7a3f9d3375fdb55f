//! `dmkit lvmd`'s inputs from files: its YAML configuration (lvmd's format) and
//! its per-volume records (JSON): the first byte picks which. Hostile text gets
//! an error, never a panic, a hang or an allocation sized by a number in it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    if which % 2 == 0 {
        if let Ok(text) = std::str::from_utf8(rest) {
            if let Ok(c) = dmkit::lvmd::config::Config::parse(text) {
                // a configuration that parses names its default class
                for dc in &c.device_classes {
                    let _ = dc.device_name("v-1");
                    let _ = dc.spare_bytes();
                }
                let _ = c.class("");
            }
        }
    } else {
        let _ = serde_json::from_slice::<dmkit::lvmd::store::Volume>(rest);
    }
});
