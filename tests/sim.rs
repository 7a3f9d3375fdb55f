//! Deterministic crash trials (`dmkit sim`), a fixed budget per stack: seeded
//! workloads on simulated disks that lose and tear unflushed writes, a crash,
//! the stack reopened and every sector checked (see `src/sim.rs`). A failure
//! prints the command that replays it.

use dmkit::sim::{self, Options, Stack};

/// The thin trials' sample checked by the reference thin_check too.
const REF_CHECK_EVERY: u64 = 25;

fn run(stack: Stack, first: u64, trials: u64, io_errors: bool) {
    run_as(stack, first, trials, io_errors, false)
}

fn run_as(stack: Stack, first: u64, trials: u64, io_errors: bool, kill: bool) {
    run_ops(stack, first, trials, 120, io_errors, kill)
}

fn run_ops(stack: Stack, first: u64, trials: u64, ops: usize, io_errors: bool, kill: bool) {
    let o = Options {
        stack,
        seed: first,
        ops,
        break_commit_order: false,
        io_errors,
        dir: sim::default_dir(),
        ref_check_every: REF_CHECK_EVERY,
        kill,
        no_restart_logs: false,
        check_replay: false,
    };
    // the library's warnings (a request that waits long says what it waits for)
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .try_init();
    let s = sim::run_trials(&o, trials, false);
    eprintln!(
        "{}{}: {} trials, {} crashed mid-workload ({} at a flush inside a commit, {} after a chosen write, {} at the end), \
         {} with an I/O error, {} writes acknowledged, {} sectors checked, {} metadata images agreed on by the reference thin_check, \
         {} blocks promoted, {} written back by the cleaner, {} era marks checked, {} sectors left unchecked to the write hole",
        stack.name(),
        if kill { " (killed)" } else { "" },
        s.trials,
        s.crashed_mid_op,
        s.at_commit_flush,
        s.at_write,
        s.at_end,
        s.with_io_errors,
        s.acked_writes,
        s.sectors_checked,
        s.ref_checked,
        s.promotions,
        s.writebacks,
        s.era_blocks_checked,
        s.write_hole_sectors
    );
    let report: Vec<String> = s
        .failures
        .iter()
        .map(|(cmd, why)| format!("{why}\n  replay: {cmd}"))
        .collect();
    assert!(
        report.is_empty(),
        "{} of {trials} trials failed:\n{}",
        report.len(),
        report.join("\n")
    );
    // the budget exercised what it should
    assert!(
        s.crashed_mid_op > trials / 2,
        "too few crashes in the middle of a workload"
    );
    assert!(
        s.at_commit_flush > trials / 2 && s.at_write > trials / 20 && s.at_end > trials / 40,
        "crash points: {} at a commit flush, {} at a write, {} at the end",
        s.at_commit_flush,
        s.at_write,
        s.at_end
    );
    assert_eq!(s.at_commit_flush + s.at_write + s.at_end, s.trials);
    if stack == Stack::Thin {
        // the crash image and the recovered metadata of each sampled trial
        assert_eq!(
            s.ref_checked,
            2 * trials.div_ceil(REF_CHECK_EVERY),
            "reference checks"
        );
    } else {
        assert_eq!(s.ref_checked, 0);
    }
    // the cache stack's workload spans 2 MiB of its origin, cdp's 1 MiB, the
    // others 4 MiB or more
    let span = match stack {
        Stack::Cache => 4096,
        Stack::Cdp => 2048,
        _ => 8192,
    };
    assert!(s.acked_writes > trials * 20 && s.sectors_checked >= trials * span);
    match stack {
        Stack::Cache => assert!(
            s.promotions > trials && s.writebacks > trials / 10,
            "migrations: {} promotions, {} writebacks by the cleaner",
            s.promotions,
            s.writebacks
        ),
        Stack::Era => assert!(
            s.era_blocks_checked > trials * 20,
            "{} era marks checked",
            s.era_blocks_checked
        ),
        _ => assert_eq!((s.promotions, s.writebacks, s.era_blocks_checked), (0, 0, 0)),
    }
    // raid5's write hole, where a crash came while degraded: a few rows only
    if stack == Stack::Raid5 {
        assert!(
            s.write_hole_sectors * 20 < s.sectors_checked,
            "{} sectors unchecked to the write hole, {} checked",
            s.write_hole_sectors,
            s.sectors_checked
        );
    } else {
        assert_eq!(s.write_hole_sectors, 0);
    }
    if io_errors {
        assert!(
            s.with_io_errors > trials / 20,
            "too few trials hit an injected I/O error"
        );
    }
}

#[test]
fn thin_pool_crash_trials() {
    run(Stack::Thin, 0, 300, true);
}

#[test]
fn writecache_crash_trials() {
    run(Stack::Writecache, 0, 300, true);
}

/// raid1 of two legs: the write-intent bitmap set before each region's first
/// write, idle bits cleared, reloads writing the metadata at the suspend, and
/// after the crash the regions whose bits are set copied from the first leg.
#[test]
fn raid_crash_trials() {
    run(Stack::Raid, 0, 300, true);
}

/// raid5 (left symmetric, 3 legs, chunks of 8 KiB): parity by read-modify-write
/// or reconstruct-write, bits set before each write, and after the crash the
/// parity of the regions whose bits are set computed again, so every leg XORs
/// to zero; where an injected error left the array degraded at the crash, the
/// rows a write was landing on are md's write hole and are not checked.
#[test]
fn raid5_crash_trials() {
    run(Stack::Raid5, 0, 300, true);
}

/// integrity in journal mode (two sections, committed at 30% full, so commits
/// wrap the journal; reloads): after the crash the next table replays the
/// committed sections, and every block reads with its tag, holding its last
/// durable write or a newer one. Without the replay, 179 of 300 trials fail.
#[test]
fn integrity_journal_crash_trials() {
    run(Stack::Integrity, 0, 300, true);
}

/// integrity in bitmap mode (128 KiB regions, bits cleared every 20 ms): a
/// region's bit is on disk before it is written, and after the crash the
/// regions whose bits are set get their tags again. Without that, 178 of 300
/// trials fail.
#[test]
fn integrity_bitmap_crash_trials() {
    run(Stack::IntegrityBitmap, 0, 300, true);
}

/// cdp (every flush a point, over data blocks for the device and 64 more,
/// so retention drops the oldest points for room; at most 64 points on a
/// journal so small that 600 operations swap its areas; reloads): after the
/// crash the journal's last whole batch is the device, every write a flush
/// acknowledged holds its data or a newer write's.
#[test]
fn cdp_crash_trials() {
    run_ops(Stack::Cdp, 0, 200, 600, true, false);
}

/// cdp with the daemon killed instead of the power cut: every write
/// acknowledged (flushed or not) is there after the restart, from the restart
/// log the killed daemon left. Before the log (e0feeea, on a stack of 8 MiB
/// over 8.5 MiB of data), 98 of 200 killed trials of 120 operations failed:
/// a write acknowledged and not flushed read as before it.
#[test]
fn cdp_kill_trials() {
    run_ops(Stack::Cdp, 0, 200, 600, true, true);
}

#[test]
fn snapshot_crash_trials() {
    run(Stack::Snapshot, 0, 300, true);
}

/// cache (writeback, smq) with 16 cache blocks: whole-block writes promoted,
/// the cleaner switched in and out writing dirty blocks back under the load.
#[test]
fn cache_crash_trials() {
    run(Stack::Cache, 0, 300, true);
}

/// era with checkpoints and metadata snapshots: the data as any stack's, and
/// every block written is marked in its era or a later one after the crash.
#[test]
fn era_crash_trials() {
    run(Stack::Era, 0, 300, true);
}

/// The crash is a kill of the daemon (`dmkit sim --kill`): every write issued
/// before it is kept, and every write acknowledged before it reads back after
/// the next daemon opened the pool (its restart log replayed).
#[test]
fn thin_pool_kill_trials() {
    run_as(Stack::Thin, 0, 100, true, true);
}

#[test]
fn writecache_kill_trials() {
    run_as(Stack::Writecache, 0, 100, true, true);
}

/// The kill trials have power: without the restart logs (a test-only switch)
/// many trials lose acknowledged writes.
#[test]
fn kill_trials_without_restart_logs_fail() {
    let mut failed = 0;
    for stack in [Stack::Thin, Stack::Writecache] {
        let o = Options {
            stack,
            seed: 0,
            ops: 120,
            break_commit_order: false,
            io_errors: false,
            dir: sim::default_dir(),
            ref_check_every: 0,
            kill: true,
            no_restart_logs: true,
            check_replay: false,
        };
        let s = sim::run_trials(&o, 50, false);
        eprintln!(
            "{}: {} of 50 kill trials without restart logs failed",
            stack.name(),
            s.failures.len()
        );
        assert!(
            s.failures
                .iter()
                .all(|(_, why)| why.contains("after the crash, sector")),
            "{:?}",
            s.failures
        );
        assert!(
            s.failures.len() >= 10,
            "{}: only {} of 50 failed",
            stack.name(),
            s.failures.len()
        );
        failed += s.failures.len();
    }
    assert!(failed >= 20);
}

/// The simulation has power: with the flush before the thin-pool superblock
/// write left out (a test-only switch), most trials fail, each with damaged
/// metadata when the pool is opened again, and the reference thin_check agrees
/// that the sampled crash images are damaged.
#[test]
fn broken_commit_order_is_caught() {
    let o = Options {
        stack: Stack::Thin,
        seed: 0,
        ops: 120,
        break_commit_order: true,
        io_errors: false,
        dir: sim::default_dir(),
        ref_check_every: 10,
        kill: false,
        no_restart_logs: false,
        check_replay: false,
    };
    let s = sim::run_trials(&o, 100, false);
    eprintln!(
        "{} of {} trials with a broken commit order failed; first: {:?}",
        s.failures.len(),
        s.trials,
        s.failures.first()
    );
    assert!(
        s.failures.len() >= 40,
        "only {} of 100 trials with a broken commit order failed",
        s.failures.len()
    );
    for (cmd, why) in &s.failures {
        assert!(cmd.contains("--break-commit-order"), "{cmd}");
        assert!(
            why.contains("bad checksum") || why.contains("after the crash") || why.contains("metadata"),
            "an unexpected failure: {why} ({cmd})"
        );
        assert!(
            !why.contains("disagrees"),
            "dmkit and the reference disagree: {why} ({cmd})"
        );
    }
}

/// I/O errors from a backing device put each target in its kernel error state.
mod error_states {
    use dmkit::io::sim::{FailPlan, SimDisk};
    use dmkit::mapper::devio;
    use dmkit::mapper::engine::Dest;
    use dmkit::mapper::{config::Config, Registry};
    use std::path::PathBuf;
    use std::sync::Arc;

    struct Setup {
        dir: PathBuf,
        reg: Registry,
        disk: Arc<SimDisk>,
    }

    impl Setup {
        fn new(tag: &str, files: &[(&str, u64)]) -> Setup {
            let dir = dmkit::sim::default_dir().join(format!("sim-errors-{tag}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let disk = SimDisk::new(false);
            for (n, bytes) in files {
                let p = dir.join(n);
                std::fs::File::create(&p).unwrap().set_len(*bytes).unwrap();
                disk.register(&p).unwrap();
            }
            Setup {
                dir,
                reg: Registry::new(
                    Config {
                        direct_io: false,
                        restart_logs: None,
                        sim: Some(disk.clone()),
                        ..Config::default()
                    },
                    dmkit::targets::types(),
                ),
                disk,
            }
        }
        fn path(&self, n: &str) -> String {
            self.dir.join(n).display().to_string()
        }
        fn dev(&self, n: &str) -> Dest {
            Dest::Dm(self.reg.get(n).unwrap())
        }
        fn status(&self, n: &str) -> String {
            self.reg.table_lines(Some(n), true, false, false).unwrap()
        }
        /// Fail the next write to a simulated disk.
        fn fail_next_write(&self) {
            self.disk.fail_io(Some(FailPlan {
                nth: 0,
                reads: false,
                writes: true,
            }));
        }
    }

    impl Drop for Setup {
        fn drop(&mut self) {
            devio::release_thread_engine();
            for d in self.reg.list() {
                let _ = self.reg.remove(&d.name(), true, false);
                let _ = self.reg.remove(&d.name(), false, false);
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn writecache_cache_write_error_is_sticky() {
        let _g = dmkit::sim::exclusive();
        let s = Setup::new("wc", &[("origin", 4 << 20), ("cache", 1 << 20)]);
        let t = format!(
            "0 8192 writecache s {} {} 4096 0",
            s.path("origin"),
            s.path("cache")
        );
        s.reg.create("wc", Some(&t), false, None).unwrap();
        let wc = s.dev("wc");
        devio::write(&wc, 0, &[1u8; 4096], false).unwrap();
        s.fail_next_write();
        assert!(
            devio::write(&wc, 8, &[2u8; 4096], false).is_err(),
            "the failed cache write reaches the caller"
        );
        let st = s.status("wc");
        assert!(st.contains("writecache 1 "), "error state in the status: {st}");
        assert!(
            devio::write(&wc, 16, &[3u8; 4096], false).is_err(),
            "later writes fail: {st}"
        );
        assert!(devio::flush(&wc).is_err(), "flushes fail in the error state");
        let mut b = vec![0u8; 4096];
        devio::read(&wc, 0, &mut b).unwrap();
        assert_eq!(b, vec![1u8; 4096], "reads still served");
    }

    #[test]
    fn snapshot_cow_write_error_invalidates() {
        let _g = dmkit::sim::exclusive();
        let s = Setup::new("snap", &[("origin", 4 << 20), ("cow", 4 << 20)]);
        let sectors = (4 << 20) / 512;
        s.reg
            .create(
                "o",
                Some(&format!("0 {sectors} snapshot-origin {}", s.path("origin"))),
                false,
                None,
            )
            .unwrap();
        s.reg.suspend("o", false).unwrap();
        let t = format!("0 {sectors} snapshot {} {} P 8", s.path("origin"), s.path("cow"));
        s.reg.create("s", Some(&t), false, None).unwrap();
        s.reg.resume("o").unwrap();
        let o = s.dev("o");
        s.fail_next_write(); // the copy of the origin chunk into the COW device
        devio::write(&o, 0, &[7u8; 4096], false).unwrap();
        let st = s.status("s");
        assert!(st.contains("snapshot Invalid"), "{st}");
        let mut b = vec![0u8; 4096];
        assert!(
            devio::read(&s.dev("s"), 0, &mut b).is_err(),
            "an invalid snapshot fails reads"
        );
        devio::read(&o, 0, &mut b).unwrap();
        assert_eq!(b, vec![7u8; 4096], "the origin goes on");
        // the invalid header is durable: the snapshot loads invalid again
        s.reg.remove("s", false, false).unwrap();
        s.reg.create("s", Some(&t), false, None).unwrap();
        assert!(s.status("s").contains("snapshot Invalid"), "{}", s.status("s"));
    }

    #[test]
    fn thin_pool_metadata_write_error_goes_read_only() {
        let _g = dmkit::sim::exclusive();
        let s = Setup::new("thin", &[("meta", 4 << 20), ("data", 16 << 20)]);
        let t = format!(
            "0 32768 thin-pool {} {} 128 0 1 error_if_no_space",
            s.path("meta"),
            s.path("data")
        );
        s.reg.create("pool", Some(&t), false, None).unwrap();
        s.reg.message("pool", 0, &["create_thin 0".into()]).unwrap();
        s.reg
            .create("th", Some("0 16384 thin /dev/mapper/pool 0"), false, None)
            .unwrap();
        let th = s.dev("th");
        devio::write(&th, 0, &[5u8; 4096], false).unwrap();
        // the flush commits: zeroing, data and metadata writes are done by now
        // except the commit's own, the first of which fails
        s.fail_next_write();
        assert!(devio::flush(&th).is_err(), "the failed commit fails the flush");
        let st = s.status("pool");
        assert!(
            st.contains(" ro ") && st.contains("needs_check"),
            "read-only with needs_check: {st}"
        );
        assert!(
            devio::write(&th, 1024, &[6u8; 4096], false).is_err(),
            "a write that must provision fails in read-only mode"
        );
    }

    /// A thin whose uncommitted changes a metadata failure dropped (another
    /// thin's commit failed and the pool aborted its transaction) fails its
    /// flushes from then on, as the kernel's dm_thin_aborted_changes does: a
    /// flush (or the commit a FUA write asks for) that passed would call a
    /// write durable whose mapping is gone (seed 134 of the thin crash trials:
    /// a FUA write acknowledged, then read back as zeroes after the crash).
    #[test]
    fn thin_flush_after_its_changes_were_aborted_fails() {
        let _g = dmkit::sim::exclusive();
        let s = Setup::new("thinabort", &[("meta", 4 << 20), ("data", 16 << 20)]);
        let t = format!(
            "0 32768 thin-pool {} {} 128 0 1 error_if_no_space",
            s.path("meta"),
            s.path("data")
        );
        s.reg.create("pool", Some(&t), false, None).unwrap();
        for id in 0..3 {
            s.reg.message("pool", 0, &[format!("create_thin {id}")]).unwrap();
            let table = format!("0 16384 thin /dev/mapper/pool {id}");
            s.reg
                .create(&format!("th{id}"), Some(&table), false, None)
                .unwrap();
        }
        let (th0, th1, th2) = (s.dev("th0"), s.dev("th1"), s.dev("th2"));
        // both provision a block in the same transaction
        devio::write(&th0, 0, &[5u8; 4096], false).unwrap();
        devio::write(&th1, 0, &[6u8; 4096], false).unwrap();
        // th1's flush commits; the commit's first metadata write fails
        s.fail_next_write();
        assert!(devio::flush(&th1).is_err(), "the failed commit fails th1's flush");
        assert!(s.status("pool").contains(" ro "), "{}", s.status("pool"));
        // th0's write went with the aborted transaction: no flush may call it durable
        let flushed = devio::flush(&th0);
        let mut b = vec![0u8; 4096];
        devio::read(&th0, 0, &mut b).unwrap();
        assert!(
            flushed.is_err() || b == vec![5u8; 4096],
            "th0's flush passed but its write is gone ({flushed:?}, block reads {:?}...)",
            &b[..4]
        );
        assert!(devio::flush(&th1).is_err(), "th1's changes were dropped too");
        // a thin that changed nothing in the aborted transaction still flushes
        devio::flush(&th2).unwrap();
    }
}

/// Seeds that found bugs outside the CI budget's range (RELIABILITY.md), kept
/// as regressions: thin FUA to a block mapped in the current transaction
/// (1561); a writecache cache write that failed (1943); an unflushed writecache
/// discard (108744).
#[test]
fn regression_seeds() {
    for (stack, seed) in [
        (Stack::Thin, 1561),
        (Stack::Thin, 1101),
        (Stack::Writecache, 1943),
        (Stack::Writecache, 108744),
    ] {
        let o = Options {
            stack,
            seed,
            ops: 120,
            break_commit_order: false,
            io_errors: true,
            dir: sim::default_dir(),
            ref_check_every: 0,
            kill: false,
            no_restart_logs: false,
            check_replay: false,
        };
        if let Err(e) = sim::run_trial(&o) {
            panic!("{e}\n  replay: {}", sim::replay_command(&o));
        }
    }
}

/// Every trial replays from its seed alone: the trial's threads and the
/// targets' own (thin's commit thread, kcopyd's jobs, writecache's writer and
/// write-back, the snapshot merge, cache's, era's, raid's and integrity's
/// workers) run one at a time in an order drawn from the seed, on virtual
/// time, so two runs of one trial make the same I/O in the same order, byte
/// for byte (`dmkit sim --check-replay`), and two seeds do not.
#[test]
fn trials_replay_from_their_seed_alone() {
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .try_init();
    let stacks = [
        (Stack::Thin, false),
        (Stack::Thin, true),
        (Stack::Writecache, false),
        (Stack::Writecache, true),
        (Stack::Snapshot, false),
        (Stack::Cache, false),
        (Stack::Era, false),
        (Stack::Raid, false),
        (Stack::Raid5, false),
        (Stack::Integrity, false),
        (Stack::IntegrityBitmap, false),
        (Stack::Cdp, false),
    ];
    for (stack, kill) in stacks {
        let o = Options {
            stack,
            seed: 1000,
            ops: 120,
            break_commit_order: false,
            io_errors: true,
            dir: sim::default_dir(),
            ref_check_every: 0,
            kill,
            no_restart_logs: false,
            check_replay: true,
        };
        let s = sim::run_trials(&o, 12, false);
        let report: Vec<String> = s
            .failures
            .iter()
            .map(|(cmd, why)| format!("{why}\n  replay: {cmd} --check-replay"))
            .collect();
        assert!(report.is_empty(), "{}:\n{}", stack.name(), report.join("\n"));
        // the fingerprint says something: another seed, other I/O
        let a = sim::run_trial(&o).map_err(|e| format!("{}: {e}", stack.name()));
        let b = sim::run_trial(&Options {
            seed: 1001,
            ..o.clone()
        })
        .map_err(|e| format!("{}: {e}", stack.name()));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_ne!(
            a.fingerprints,
            b.fingerprints,
            "{}: seeds 1000 and 1001",
            stack.name()
        );
        eprintln!(
            "{}{}: 12 trials each run twice, the same I/O both times",
            stack.name(),
            if kill { " (killed)" } else { "" }
        );
    }
}
