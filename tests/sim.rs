//! Deterministic crash trials (`dmkit sim`), a fixed budget per stack: seeded
//! workloads on simulated disks that lose and tear unflushed writes, a crash,
//! the stack reopened and every sector checked (see `src/sim.rs`). A failure
//! prints the command that replays it.

use dmkit::sim::{self, Options, Stack};

fn run(stack: Stack, first: u64, trials: u64, io_errors: bool) {
    let o = Options {
        stack,
        seed: first,
        ops: 120,
        break_commit_order: false,
        io_errors,
        dir: sim::default_dir(),
    };
    let s = sim::run_trials(&o, trials, false);
    eprintln!(
        "{}: {} trials, {} crashed mid-workload, {} with an I/O error, {} writes acknowledged, {} sectors checked",
        stack.name(),
        s.trials,
        s.crashed_mid_op,
        s.with_io_errors,
        s.acked_writes,
        s.sectors_checked
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
        s.crashed_mid_op > trials / 4,
        "too few crashes in the middle of a workload"
    );
    assert!(s.acked_writes > trials * 20 && s.sectors_checked > trials * 8192);
    if io_errors {
        assert!(
            s.with_io_errors > trials / 20,
            "too few trials hit an injected I/O error"
        );
    }
}

#[test]
fn thin_pool_crash_trials() {
    run(Stack::Thin, 0, 500, true);
}

#[test]
fn writecache_crash_trials() {
    run(Stack::Writecache, 0, 500, true);
}

#[test]
fn snapshot_crash_trials() {
    run(Stack::Snapshot, 0, 500, true);
}

/// The simulation can fail: with the flush before the thin-pool superblock
/// write left out (a test-only switch), a trial fails within the first 100 seeds.
#[test]
fn broken_commit_order_is_caught() {
    let o = Options {
        stack: Stack::Thin,
        seed: 0,
        ops: 120,
        break_commit_order: true,
        io_errors: false,
        dir: sim::default_dir(),
    };
    let s = sim::run_trials(&o, 100, true);
    let (cmd, why) = s
        .failures
        .first()
        .unwrap_or_else(|| panic!("100 trials with a broken commit order all passed"));
    eprintln!("caught after {} trials: {why} ({cmd})", s.trials);
    assert!(cmd.contains("--break-commit-order"), "{cmd}");
}
