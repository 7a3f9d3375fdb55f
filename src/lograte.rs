//! Log lines a client can cause (a refused request, a failed connection, a
//! handshake that ended): rate-limited and bounded in length, so that no client
//! can make the daemon's log grow faster than a bound, however it behaves.

/// Lines a client can cause in the log (a refused request, a failed
/// connection): at most this many a second; the rest are counted and the count
/// logged with the next line let through.
const CLIENT_LOG_LINES_PER_SECOND: u64 = 20;

/// Log a line a client caused, within [`CLIENT_LOG_LINES_PER_SECOND`] and
/// bounded in length: no client can make the log grow faster than that.
pub fn client_line(level: tracing::Level, line: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static WINDOW: AtomicU64 = AtomicU64::new(0);
    static IN_WINDOW: AtomicU64 = AtomicU64::new(0);
    static DROPPED: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if WINDOW.swap(now, Ordering::Relaxed) != now {
        IN_WINDOW.store(0, Ordering::Relaxed);
    }
    if IN_WINDOW.fetch_add(1, Ordering::Relaxed) >= CLIENT_LOG_LINES_PER_SECOND {
        DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    let line = crate::table::bounded_line(line);
    let more = if dropped > 0 {
        format!(" ({dropped} lines like it left out of the log before this one)")
    } else {
        String::new()
    };
    match level {
        tracing::Level::WARN => tracing::warn!("{line}{more}"),
        tracing::Level::DEBUG => tracing::debug!("{line}{more}"),
        _ => tracing::info!("{line}{more}"),
    }
}
