//! The verity target's hash alone, for the choice of its sha256: RustCrypto's
//! `sha2` (what the target uses; SHA-NI where the CPU has it) against
//! OpenSSL's SHA-256, each hashing a salt and a 4 KiB block as a version-1
//! tree does, in turn for SECONDS each, ROUNDS times. Prints MB/s (10^6
//! bytes of blocks per second of CPU time) for each.
//!
//! Usage: verity_hash_speed [SECONDS] [ROUNDS]   (defaults 1 and 3)

use sha2::{Digest, Sha256};
use std::time::{Duration, Instant};

/// Blocks hashed per second of the process's CPU time by `hash`.
fn rate(secs: f64, mut hash: impl FnMut(&[u8])) -> f64 {
    let cpu = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
    };
    let block = [0x5au8; 4096];
    let (mut n, t0, c0) = (0u64, Instant::now(), cpu());
    while t0.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..256 {
            hash(&block);
        }
        n += 256;
    }
    n as f64 * 4096.0 / (cpu() - c0)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let secs: f64 = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let rounds: usize = a.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let salt = [0x00u8, 0xff];
    for _ in 0..rounds {
        let rust = rate(secs, |b| {
            std::hint::black_box(Sha256::new().chain_update(salt).chain_update(b).finalize());
        });
        let ossl = rate(secs, |b| {
            let mut h = openssl::sha::Sha256::new();
            h.update(&salt);
            h.update(b);
            std::hint::black_box(h.finish());
        });
        println!("sha2 {:.0} MB/s  openssl {:.0} MB/s", rust / 1e6, ossl / 1e6);
    }
}
