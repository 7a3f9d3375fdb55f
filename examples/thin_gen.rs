//! Builds a thin pool's metadata for the tool benchmarks: one volume with N random
//! mappings, then S snapshots of it, with the volume overwriting 0.1% of its blocks
//! after each snapshot (so the snapshots share most leaves and differ in a few, as a
//! pool with a snapshot schedule does).
//!
//! Usage: thin_gen FILE [MAPPINGS] [SNAPSHOTS]

use dmkit::pdata::FileDev;
use dmkit::thin::{FormatOptions, ThinPoolMetadata};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: thin_gen FILE [MAPPINGS] [SNAPSHOTS]")?;
    let n: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1_000_000);
    let snaps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(100);
    let f = std::fs::File::create(&path)?;
    f.set_len(1 << 30)?;
    drop(f);
    let mut md = ThinPoolMetadata::format(
        Box::new(FileDev::open(std::path::Path::new(&path), true)?),
        FormatOptions {
            data_block_size: 128,
            nr_data_blocks: 4 * n,
            cache_blocks: 16384,
        },
    )?;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move |m: u64| dmkit::rng::step(&mut x) % m;
    md.create_thin(0)?;
    for v in 0..n {
        let b = md.alloc_data_block()?;
        md.insert(0, v, b)?;
        if v % 100_000 == 0 {
            md.commit()?;
        }
    }
    for s in 1..=snaps {
        md.create_snap(s, 0)?;
        for _ in 0..n / 1000 {
            let b = md.alloc_data_block()?;
            md.insert(0, rnd(n), b)?;
        }
        md.commit()?;
    }
    md.set_transaction_id(0, snaps)?;
    md.commit()?;
    println!(
        "{path}: {n} mappings, {snaps} snapshots, {} metadata blocks used",
        md.nr_metadata_blocks() - md.nr_free_metadata_blocks()
    );
    Ok(())
}
