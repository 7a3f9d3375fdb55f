//! The crypt target's cipher alone, for `bench/crypt.py`: encrypts a 1 MiB
//! buffer in SECTOR-byte sectors for SECONDS, and prints the rate in bytes per
//! second of the process's CPU time (what `openssl speed -evp CIPHER -bytes
//! SECTOR` measures, by its user CPU time: so a run shares a loaded machine's
//! cores without the wait counting).
//!
//! Usage: crypt_speed CIPHER KEYHEX SECTOR SECONDS   (e.g. aes-xts-plain64 <128 hex> 4096 3)

use std::time::{Duration, Instant};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        eprintln!("usage: crypt_speed CIPHER KEYHEX SECTOR SECONDS");
        std::process::exit(2);
    }
    let key: Vec<u8> = (0..a[2].len() / 2)
        .map(|i| u8::from_str_radix(&a[2][2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    let sector: usize = a[3].parse().unwrap_or(4096);
    let secs: f64 = a[4].parse().unwrap_or(3.0);
    let cipher = match dmkit::targets::crypt::SectorCipher::new(&a[1], &key) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("crypt_speed: {e}");
            std::process::exit(1);
        }
    };
    let cpu = || {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
        t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
    };
    let mut buf = vec![0x5au8; 1 << 20];
    let (mut bytes, t0, c0) = (0u64, Instant::now(), cpu());
    let mut first = 0;
    while t0.elapsed() < Duration::from_secs_f64(secs) {
        if let Err(e) = cipher.apply(true, sector, first, &mut buf) {
            eprintln!("crypt_speed: {e}");
            std::process::exit(1);
        }
        first += (buf.len() / sector) as u64;
        bytes += buf.len() as u64;
    }
    println!("{:.0}", bytes as f64 / (cpu() - c0));
}
