//! What the SIGBUS guard costs a writecache in pmem mode (`io::mapped`), against
//! the other way to survive a file that shrinks: `pread`/`pwrite` on the same
//! file. Copies BLOCK bytes at random block offsets of a FILE of MIB MiB, each
//! way, and prints the median of five rounds in ns per copy:
//!
//!   guarded read, guarded write (Mapped::read_at / write_at, as the daemon),
//!   pread, pwrite (the same file, through the page cache).
//!
//! Usage: mapped_copy FILE MIB BLOCK   (e.g. /dev/shm/mc 256 4096)

use dmkit::io::mapped::Mapped;
use std::os::unix::fs::FileExt;
use std::time::Instant;

const ROUNDS: usize = 5;
const COPIES: usize = 200_000;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 4 {
        eprintln!("usage: mapped_copy FILE MIB BLOCK");
        std::process::exit(2);
    }
    let mib: u64 = a[2].parse().unwrap_or(256);
    let block: usize = a[3].parse().unwrap_or(4096).clamp(512, 1 << 20);
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&a[1])
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("mapped_copy: {}: {e}", a[1]);
            std::process::exit(1);
        }
    };
    let len = mib << 20;
    let map = file
        .set_len(len)
        .and_then(|()| Mapped::new(&file, len as usize))
        .unwrap_or_else(|e| {
            eprintln!("mapped_copy: {e}");
            std::process::exit(1);
        });
    // every page present in the page cache first, for both ways alike
    let fill = vec![0x5au8; 1 << 20];
    for off in (0..len).step_by(1 << 20) {
        let _ = file.write_all_at(&fill, off);
    }
    let blocks = len / block as u64;
    let mut rng = dmkit::rng::XorShift::seeded(7);
    let offs: Vec<u64> = (0..COPIES).map(|_| rng.below(blocks) * block as u64).collect();
    let mut buf = vec![0u8; block];
    let mut time = |what: &dyn Fn(u64, &mut [u8]) -> bool| -> f64 {
        let mut runs: Vec<f64> = (0..ROUNDS)
            .map(|_| {
                let t = Instant::now();
                for &o in &offs {
                    if !what(o, &mut buf) {
                        eprintln!("mapped_copy: a copy failed at {o}");
                        std::process::exit(1);
                    }
                }
                t.elapsed().as_nanos() as f64 / COPIES as f64
            })
            .collect();
        runs.sort_by(f64::total_cmp);
        runs[ROUNDS / 2]
    };
    let rows: [(&str, f64); 4] = [
        ("guarded read", time(&|o, b| map.read_at(o as usize, b))),
        ("guarded write", time(&|o, b| map.write_at(o as usize, b))),
        ("pread", time(&|o, b| file.read_exact_at(b, o).is_ok())),
        ("pwrite", time(&|o, b| file.write_all_at(b, o).is_ok())),
    ];
    for (what, ns) in rows {
        println!("{what:14} {ns:8.0} ns per {block}-byte copy");
    }
    let _ = std::fs::remove_file(&a[1]);
}
