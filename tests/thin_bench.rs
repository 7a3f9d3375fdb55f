//! Metadata benchmark (ignored by default; run bench/thin_meta.py).
//! 2^24 mappings across 4 thins, 64 MiB block cache.

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
