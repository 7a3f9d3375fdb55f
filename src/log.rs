//! Daemon log lines on stderr.

use std::time::{SystemTime, UNIX_EPOCH};

fn line(level: &str, msg: &str) {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    eprintln!("[{}.{:03}] dmkit {level}: {msg}", t.as_secs(), t.subsec_millis());
}

pub fn info(msg: &str) {
    line("info", msg);
}

pub fn warn(msg: &str) {
    line("warning", msg);
}
