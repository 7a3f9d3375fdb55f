//! Metadata benchmarks, ignored by default: `thin_meta_bench` (2^24 mappings
//! across 4 thins, 64 MiB block cache; run by bench/thin_meta.py) and
//! `thin_delta_bench` (run by hand, the command at it).

mod thin_util;
use dmkit::pdata::FileDev;
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use std::time::Instant;
use thin_util::*;

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

#[test]
#[ignore]
fn thin_meta_bench() {
    let total: u64 = std::env::var("THIN_BENCH_MAPPINGS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1 << 24);
    let dir = std::env::var("THIN_BENCH_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let name = match std::env::var("THIN_BENCH_REUSE") {
        Ok(_) => format!("dmkit-bench-meta-{total}"),
        Err(_) => format!("dmkit-bench-meta-{}", std::process::id()),
    };
    let path = std::path::Path::new(&dir).join(name);
    let cache_blocks = 64 * 1024 * 1024 / 4096;
    let meta_blocks = 262_144u64; // 1 GiB
    let per_dev = total / 4;

    // THIN_BENCH_REUSE=1 keeps a file built by an earlier run (same path rules).
    let reuse = std::env::var("THIN_BENCH_REUSE").is_ok() && path.exists();
    if !reuse {
        std::fs::File::create(&path)
            .unwrap()
            .set_len(meta_blocks * 4096)
            .unwrap();
        let t = Instant::now();
        let mut md = ThinPoolMetadata::format(
            Box::new(FileDev::open(&path, true).unwrap()),
            FormatOptions {
                data_block_size: 128,
                nr_data_blocks: total + 1024,
                cache_blocks,
            },
        )
        .unwrap();
        for d in 0..4 {
            md.create_thin(d).unwrap();
        }
        md.commit().unwrap();
        let mut n = 0u64;
        for v in 0..per_dev {
            for d in 0..4 {
                let b = md.alloc_data_block().unwrap();
                md.insert(d, v, b).unwrap();
                n += 1;
                if n.is_multiple_of(1000) {
                    md.commit().unwrap();
                }
            }
        }
        md.commit().unwrap();
        let ins = t.elapsed().as_secs_f64();
        println!(
            "BENCH inserts: {n} in {ins:.2}s = {:.0}/s (commit every 1000)",
            n as f64 / ins
        );
        let used = md.nr_metadata_blocks() - md.nr_free_metadata_blocks();
        println!(
            "BENCH metadata used: {used} blocks ({:.1} MiB)",
            used as f64 / 256.0
        );
        drop(md);
    }
    let t = Instant::now();
    let mut md = ThinPoolMetadata::open(Box::new(FileDev::open(&path, true).unwrap()), cache_blocks).unwrap();
    println!("BENCH open: {:.3}s", t.elapsed().as_secs_f64());

    // warm lookups: a hot set that fits the 64 MiB cache
    let hot = per_dev.min(1 << 18);
    let mut rng = Rng::new(1);
    // warm: every mapping of the hot set once
    for v in 0..hot {
        for d in 0..4 {
            md.lookup(d, v).unwrap();
        }
    }
    let iters = 5_000_000u64;
    let t = Instant::now();
    let mut found = 0u64;
    for _ in 0..iters {
        let r = rng.next();
        if md.lookup(r & 3, (r >> 8) % hot).unwrap().is_some() {
            found += 1;
        }
    }
    let el = t.elapsed().as_secs_f64();
    assert_eq!(found, iters);
    println!(
        "BENCH warm random lookups (hot set {hot}/dev): {:.0}/s",
        iters as f64 / el
    );
    let t = Instant::now();
    let seq = per_dev.min(4_000_000);
    for v in 0..seq {
        md.lookup(0, v).unwrap();
    }
    println!(
        "BENCH sequential lookups: {:.0}/s",
        seq as f64 / t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let cold = 1_000_000u64;
    for _ in 0..cold {
        md.lookup(rng.below(4), rng.below(per_dev)).unwrap();
    }
    println!(
        "BENCH random lookups over all {total} mappings (cache 64 MiB < tree): {:.0}/s",
        cold as f64 / t.elapsed().as_secs_f64()
    );
    drop(md);
    println!("BENCH peak RSS: {} MiB", vm_hwm_kib() / 1024);
    println!("BENCH_FILE {}", path.display());
}

/// What CSI's GetMetadataDelta reads (issue 49): two snapshots of a volume of
/// 10^6 mappings (64 KiB blocks: 61 GiB mapped), the later one with 1% of its
/// blocks written since, scattered or in runs of 100. Compared on a file of
/// `THIN_BENCH_DIR`: the delta `thin_delta` computes (every leaf of both trees,
/// a shared leaf once), and `changed_runs`, which passes over shared subtrees
/// unread. Prints the mapped volume compared per second of this thread's CPU
/// time, the median of 5 runs each. Run by hand:
/// `cargo test --release --test thin_bench -- --ignored --nocapture thin_delta_bench`.
#[test]
#[ignore]
fn thin_delta_bench() {
    use dmkit::thin::delta::{changed_runs, delta, mapped_runs, Delta, DeltaOptions, Side};
    let dir = std::env::var("THIN_BENCH_DIR").unwrap_or_else(|_| "/dev/shm".into());
    let mappings = 1_000_000u64;
    for (pattern, run) in [("scattered", 1u64), ("in runs of 100", 100)] {
        let path = std::path::Path::new(&dir).join(format!("dmkit-bench-delta-{}", std::process::id()));
        std::fs::File::create(&path)
            .unwrap()
            .set_len(65_536 * 4096)
            .unwrap();
        let mut md = ThinPoolMetadata::format(
            Box::new(FileDev::open(&path, true).unwrap()),
            FormatOptions {
                data_block_size: 128,
                nr_data_blocks: 2 * mappings,
                cache_blocks: 16_384,
            },
        )
        .unwrap();
        md.create_thin(0).unwrap();
        for v in 0..mappings {
            let b = md.alloc_data_block().unwrap();
            md.insert(0, v, b).unwrap();
        }
        md.commit().unwrap();
        md.create_snap(1, 0).unwrap();
        md.create_snap(2, 1).unwrap();
        let mut rng = Rng::new(3);
        let mut written = 0;
        while written < mappings / 100 {
            let at = rng.below(mappings - run);
            for v in at..at + run {
                let b = md.alloc_data_block().unwrap();
                md.insert(2, v, b).unwrap();
            }
            written += run;
        }
        md.commit().unwrap();
        drop(md);
        let o = DeltaOptions {
            left: Some(Side::Thin(1)),
            right: Some(Side::Thin(2)),
            ..DeltaOptions::default()
        };
        let volume = mappings as f64 * 65_536.0;
        let mut old = Vec::new();
        let mut new = Vec::new();
        let (mut want, mut got) = (0, 0);
        // GetMetadataAllocated: what thin 2 maps, by thin_delta's walk of the
        // thin against itself, and by mapped_runs in lvmd's pages of 65,536 runs
        let same = DeltaOptions {
            left: Some(Side::Thin(2)),
            right: Some(Side::Thin(2)),
            ..DeltaOptions::default()
        };
        let (mut old_alloc, mut new_alloc) = (Vec::new(), Vec::new());
        let (mut want_alloc, mut got_alloc) = (0, 0);
        for _ in 0..5 {
            let mut tm = dmkit::pdata::tm::reader(Box::new(FileDev::open(&path, false).unwrap()), 256);
            let t = thread_cpu();
            let rep = delta(&mut tm, &same).unwrap();
            want_alloc = rep
                .ranges
                .iter()
                .filter(|r| r.kind == Delta::Same)
                .map(|r| r.length)
                .sum::<u64>();
            old_alloc.push(thread_cpu() - t);
            let mut tm = dmkit::pdata::tm::reader(Box::new(FileDev::open(&path, false).unwrap()), 256);
            let t = thread_cpu();
            let (mut from, mut n) = (0, 0);
            loop {
                let (_, runs) = mapped_runs(&mut tm, &same, from, 65_536).unwrap();
                n += runs.iter().map(|r| r.1).sum::<u64>();
                match runs.last() {
                    Some(&(b, len)) if runs.len() == 65_536 => from = b + len,
                    _ => break,
                }
            }
            got_alloc = n;
            new_alloc.push(thread_cpu() - t);
        }
        assert_eq!((got_alloc, want_alloc), (mappings, mappings));
        for _ in 0..5 {
            // a new reader each time, as lvmd opens one for each request
            let mut tm = dmkit::pdata::tm::reader(Box::new(FileDev::open(&path, false).unwrap()), 256);
            let t = thread_cpu();
            let rep = delta(&mut tm, &o).unwrap();
            want = rep
                .ranges
                .iter()
                .filter(|r| r.kind != Delta::Same)
                .map(|r| r.length)
                .sum::<u64>();
            old.push(thread_cpu() - t);
            let mut tm = dmkit::pdata::tm::reader(Box::new(FileDev::open(&path, false).unwrap()), 256);
            let t = thread_cpu();
            let (_, runs) = changed_runs(&mut tm, &o, 0, usize::MAX).unwrap();
            got = runs.iter().map(|r| r.1).sum::<u64>();
            new.push(thread_cpu() - t);
        }
        assert_eq!(got, want);
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (o_s, n_s) = (median(&mut old), median(&mut new));
        println!(
            "BENCH delta of {mappings} mappings, {got} changed {pattern}: thin_delta's walk {:.1} ms ({:.2} TiB/s), changed_runs {:.1} ms ({:.2} TiB/s), {:.1}x",
            o_s * 1e3,
            volume / o_s / (1u64 << 40) as f64,
            n_s * 1e3,
            volume / n_s / (1u64 << 40) as f64,
            o_s / n_s
        );
        let (oa, na) = (median(&mut old_alloc), median(&mut new_alloc));
        println!(
            "BENCH allocated of {mappings} mappings ({pattern}): thin_delta's walk {:.1} ms, mapped_runs in pages of 65,536 runs {:.1} ms, {:.1}x",
            oa * 1e3,
            na * 1e3,
            oa / na
        );
        let _ = std::fs::remove_file(&path);
    }
}

/// This thread's CPU time in seconds.
fn thread_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, which lives here.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
