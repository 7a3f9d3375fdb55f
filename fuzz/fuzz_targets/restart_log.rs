//! A restart log left by a killed daemon (read back before a pool or cache
//! opens): any file gets its records, "nothing", or "overflowed", never a panic
//! or an allocation sized by a field in it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("dmkit-fuzz-restart-log-{}", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        let _ = dmkit::io::restart_log::RestartLog::previous(&path);
    }
});
