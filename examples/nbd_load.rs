//! A small NBD load generator for what fio's nbd engine cannot send: writes with
//! NBD_CMD_FLAG_FUA at a queue depth. Random 4 KiB (or --bs) reads/writes over a unix
//! socket, for --seconds; prints `{"iops": N, "ios": N, "seconds": S}`.
//!
//! cargo run --release --example nbd_load -- --socket S --export E --rw randwrite --fua

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

struct Opts {
    socket: String,
    export: String,
    rw: String,
    bs: u32,
    qd: usize,
    seconds: f64,
    fua: bool,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        socket: String::new(),
        export: String::new(),
        rw: "randwrite".into(),
        bs: 4096,
        qd: 32,
        seconds: 5.0,
        fua: false,
    };
    let a: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < a.len() {
        let v = || a.get(i + 1).cloned().ok_or(format!("{} needs a value", a[i]));
        match a[i].as_str() {
            "--socket" => o.socket = v()?,
            "--export" => o.export = v()?,
            "--rw" => o.rw = v()?,
            "--bs" => o.bs = v()?.parse().map_err(|e| format!("--bs: {e}"))?,
            "--qd" => o.qd = v()?.parse().map_err(|e| format!("--qd: {e}"))?,
            "--seconds" => o.seconds = v()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--fua" => {
                o.fua = true;
                i += 1;
                continue;
            }
            x => return Err(format!("unknown option {x}")),
        }
        i += 2;
    }
    if o.socket.is_empty() || !["randread", "randwrite", "randrw"].contains(&o.rw.as_str()) {
        return Err("usage: nbd_load --socket S --export E [--rw randread|randwrite|randrw] [--bs N] [--qd N] [--seconds S] [--fua]".into());
    }
    Ok(o)
}

fn handshake(s: &mut UnixStream, export: &str) -> std::io::Result<u64> {
    let mut g = [0u8; 18];
    s.read_exact(&mut g)?;
    s.write_all(&3u32.to_be_bytes())?;
    let mut d = Vec::new();
    d.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes());
    d.extend_from_slice(&7u32.to_be_bytes());
    d.extend_from_slice(&(export.len() as u32 + 6).to_be_bytes());
    d.extend_from_slice(&(export.len() as u32).to_be_bytes());
    d.extend_from_slice(export.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&d)?;
    let mut size = 0;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h)?;
        let typ = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
        let len = u32::from_be_bytes([h[16], h[17], h[18], h[19]]) as usize;
        let mut p = vec![0u8; len];
        s.read_exact(&mut p)?;
        match typ {
            3 if len == 12 && p[0..2] == [0, 0] => {
                size = u64::from_be_bytes(p[2..10].try_into().unwrap_or_default());
            }
            3 => {}
            1 => return Ok(size),
            e => return Err(std::io::Error::other(format!("NBD_OPT_GO refused: {e:#x}"))),
        }
    }
}

fn main() {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(o) {
        eprintln!("nbd_load: {e}");
        std::process::exit(1);
    }
}

fn run(o: Opts) -> std::io::Result<()> {
    let mut s = UnixStream::connect(&o.socket)?;
    let size = handshake(&mut s, &o.export)?;
    let blocks = size / u64::from(o.bs);
    let mut rx_sock = s.try_clone()?;
    // Wakes the reader now and then to see whether the run is over.
    rx_sock.set_read_timeout(Some(Duration::from_millis(200)))?;
    let (credit_tx, credit_rx) = mpsc::sync_channel::<()>(o.qd);
    for _ in 0..o.qd {
        let _ = credit_tx.send(());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let bs = o.bs as usize;
    let reader = {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || -> std::io::Result<u64> {
            let mut done = 0u64;
            let mut buf = vec![0u8; bs];
            loop {
                if stop.load(Ordering::SeqCst) && done == sent.load(Ordering::SeqCst) {
                    return Ok(done);
                }
                let mut h = [0u8; 16];
                match rx_sock.read_exact(&mut h) {
                    Ok(()) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                        ) =>
                    {
                        continue
                    }
                    Err(e) => return Err(e),
                }
                let err = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                if err != 0 {
                    return Err(std::io::Error::other(format!("NBD error {err}")));
                }
                if h[8] == 1 {
                    rx_sock.read_exact(&mut buf)?; // a read's data
                }
                done += 1;
                let _ = credit_tx.try_send(());
            }
        })
    };
    let payload = vec![0x5au8; bs];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(o.seconds);
    let mut req = Vec::with_capacity(28 + bs);
    while Instant::now() < end {
        if credit_rx.recv_timeout(Duration::from_millis(100)).is_err() {
            continue;
        }
        dmkit::rng::step(&mut x);
        let write = match o.rw.as_str() {
            "randread" => false,
            "randwrite" => true,
            _ => x & (1 << 40) != 0,
        };
        let off = (x % blocks.max(1)) * u64::from(o.bs);
        req.clear();
        req.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        req.extend_from_slice(&(if write && o.fua { 1u16 } else { 0 }).to_be_bytes());
        req.extend_from_slice(&(if write { 1u16 } else { 0 }).to_be_bytes());
        // The cookie's first byte tells the reader whether data follows.
        req.extend_from_slice(&(if write { 0u64 } else { 1u64 << 56 }).to_be_bytes());
        req.extend_from_slice(&off.to_be_bytes());
        req.extend_from_slice(&o.bs.to_be_bytes());
        if write {
            req.extend_from_slice(&payload);
        }
        sent.fetch_add(1, Ordering::SeqCst);
        s.write_all(&req)?;
    }
    stop.store(true, Ordering::SeqCst);
    let done = reader
        .join()
        .map_err(|_| std::io::Error::other("reader panicked"))??;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "{{\"iops\": {:.0}, \"ios\": {done}, \"seconds\": {secs:.3}}}",
        done as f64 / secs
    );
    Ok(())
}
