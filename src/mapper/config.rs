//! The daemon's options that the core and the targets read: fixed for the
//! daemon's life, set by `dmkit serve`'s command line (and by tests' and the
//! simulator's own registries).

/// Options fixed for the daemon's life.
#[derive(Clone, Debug)]
pub struct Config {
    /// Open backing files with O_DIRECT where the file system allows it.
    pub direct_io: bool,
    /// Where thin pools and writecaches record what they acknowledged and have
    /// not committed yet, for the next daemon (`io::restart_log`); none, none kept.
    pub restart_logs: Option<std::path::PathBuf>,
    /// The copy engine's sub-job size in KiB (`serve --copy-subjob-kb`, the
    /// kernel's kcopyd_subjob_size_kb); see [`Config::copy_subjob_bytes`].
    pub copy_subjob_kb: u64,
    /// Writecache writeback in LRU order (the pre-2019 kernel), for benchmarks.
    pub writecache_lru_writeback: bool,
    /// How often a thin pool commits while it has changes (the kernel's
    /// COMMIT_PERIOD; tests that need writes left uncommitted lengthen it).
    pub thin_commit_period: std::time::Duration,
    /// How long a thin pool out of data space queues I/O before failing it
    /// (the kernel's no_space_timeout).
    pub thin_no_space_timeout: std::time::Duration,
    /// Tests only: how long a thin pool's discard passdown waits before it is
    /// sent to the data device (zero: at once).
    pub thin_passdown_delay: std::time::Duration,
    /// Tests only: how long a thin pool's thread waits before it carries out
    /// deferred discards (zero: at once).
    pub thin_discard_delay: std::time::Duration,
    /// Tests only: records a restart log holds per generation (None: what never
    /// fills: twice a thin pool's data blocks, four times a writecache's blocks,
    /// up to `io::restart_log::MAX_RECORDS`).
    pub restart_log_records: Option<usize>,
    /// Crash trials (`dmkit sim`): files registered with this simulated disk
    /// open as its backing files (`io::sim`); None in the daemon.
    pub sim: Option<std::sync::Arc<crate::io::sim::SimDisk>>,
}

impl Config {
    /// The copy engine's sub-job size in bytes: `copy_subjob_kb`, 0 meaning
    /// 512 KiB, at most 1 MiB.
    pub fn copy_subjob_bytes(&self) -> usize {
        let kb = if self.copy_subjob_kb == 0 {
            512
        } else {
            self.copy_subjob_kb.min(1024)
        };
        kb as usize * 1024
    }
}

impl Default for Config {
    /// The daemon's defaults (`dmkit serve` changes them by its options only).
    fn default() -> Config {
        use std::time::Duration;
        Config {
            direct_io: true,
            restart_logs: None,
            copy_subjob_kb: 512,
            writecache_lru_writeback: false,
            thin_commit_period: Duration::from_secs(1),
            thin_no_space_timeout: Duration::from_secs(60),
            thin_passdown_delay: Duration::ZERO,
            thin_discard_delay: Duration::ZERO,
            restart_log_records: None,
            sim: None,
        }
    }
}
