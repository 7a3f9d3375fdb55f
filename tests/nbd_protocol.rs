//! Bad and hostile NBD clients: each test checks the exact NBD error (or the
//! disconnect) and that the daemon and other clients keep working afterwards.

mod common;

use common::nbd::{self, Client, DISC, FLAG_FUA, FLUSH, READ, TRIM, WRITE, WRITE_ZEROES};
use common::{pattern, read_at, Daemon};
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

const EPERM: u32 = 1;
const EIO: u32 = 5;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EOVERFLOW: u32 = 75;
const MIB: u64 = 1 << 20;
const NO_HOLE: u16 = 2;

/// A daemon with device `d`: linear over a sparse file of `mib` MiB.
fn setup(tag: &str, mib: u64) -> (Daemon, PathBuf) {
    let d = Daemon::start(tag);
    let f = d.dir.sparse("disk", mib * MIB);
    d.create("d", &format!("0 {} linear {} 0", mib * MIB / 512, f.display()));
    (d, f)
}

/// A client connected before the abuse: after it, it must still write and read
/// back correctly, a new client must connect, and the daemon must be running.
fn still_serving(d: &mut Daemon, by: &mut Client, export: &str) {
    let data = pattern(0xB1, 64 << 10);
    by.write(by.size - (64 << 10), &data);
    assert_eq!(
        by.read(by.size - (64 << 10), data.len()),
        data,
        "bystander read-back"
    );
    let mut fresh = Client::connect(&d.sock(), export);
    assert_eq!(
        fresh.read(by.size - (64 << 10), data.len()),
        data,
        "new client read-back"
    );
    assert!(d.alive(), "daemon died:\n{}", d.log());
}

/// Wait (up to 3 s) for `info NAME` to show `Open count: n`.
fn wait_open_count(d: &Daemon, name: &str, n: u32) {
    let want = format!("Open count:        {n}");
    let t0 = std::time::Instant::now();
    loop {
        let info = d.ok(&["info", name]);
        if info.lines().any(|l| l == want) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "open count never became {n}:\n{info}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn out_of_range_requests() {
    let (mut d, _f) = setup("oor", 8);
    let mut by = Client::connect(&d.sock(), "d");
    let mut c = Client::connect(&d.sock(), "d");
    let size = c.size;
    assert_eq!(size, 8 * MIB);
    // Reads and trims past the end: EINVAL.
    assert_eq!(c.call(READ, 0, size - 512, 1024, &[]), EINVAL);
    assert_eq!(c.call(READ, 0, size, 512, &[]), EINVAL);
    assert_eq!(
        c.call(READ, 0, u64::MAX - 511, 1024, &[]),
        EINVAL,
        "offset+length overflows"
    );
    assert_eq!(c.call(TRIM, 0, size - 512, 4096, &[]), EINVAL);
    // Writes and write-zeroes past the end: ENOSPC; the write's payload is consumed.
    assert_eq!(c.call(WRITE, 0, size - 512, 1024, &[0xAA; 1024]), ENOSPC);
    assert_eq!(c.call(WRITE, 0, size, 4096, &[0xAA; 4096]), ENOSPC);
    assert_eq!(c.call(WRITE_ZEROES, 0, size - 512, 1024, &[]), ENOSPC);
    // The last whole sector is fine, and the stream is still in sync.
    c.write(size - 512, &[0x5A; 512]);
    assert_eq!(c.read(size - 512, 512), vec![0x5A; 512]);
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn misaligned_requests() {
    let (mut d, f) = setup("align", 8);
    let mut by = Client::connect(&d.sock(), "d");
    let mut c = Client::connect(&d.sock(), "d");
    assert_eq!(c.call(READ, 0, 100, 512, &[]), EINVAL);
    assert_eq!(c.call(READ, 0, 0, 100, &[]), EINVAL);
    assert_eq!(c.call(WRITE, 0, 0, 100, &[0xAA; 100]), EINVAL);
    assert_eq!(c.call(WRITE, 0, 256, 512, &[0xAA; 512]), EINVAL);
    assert_eq!(c.call(TRIM, 0, 512, 700, &[]), EINVAL);
    assert_eq!(c.call(WRITE_ZEROES, 0, 1, 512, &[]), EINVAL);
    // Nothing was written, and the connection is still in sync.
    assert_eq!(read_at(&f, 0, 1024), vec![0; 1024]);
    c.write(0, &[1; 512]);
    assert_eq!(c.read(0, 512), vec![1; 512]);
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn oversized_read_and_write() {
    let (mut d, f) = setup("big", 64);
    let mut by = Client::connect(&d.sock(), "d");
    let mut c = Client::connect(&d.sock(), "d");
    // A READ of more than 32 MiB (inside the device) is refused, not served.
    let e = c.call(READ, 0, 0, (33 * MIB) as u32, &[]);
    assert_eq!(e, EOVERFLOW, "33 MiB read");
    // A 40 MiB WRITE is refused, its payload read and thrown away: the next
    // request on the same connection works.
    let big = vec![0xEE; (40 * MIB) as usize];
    c.send(WRITE, 0, 11, 0, big.len() as u32, &big);
    let (cookie, e) = c.reply(None);
    assert_eq!(cookie, 11);
    assert_eq!(e, EOVERFLOW, "40 MiB write");
    assert_eq!(
        read_at(&f, 0, 4096),
        vec![0; 4096],
        "refused write reached the file"
    );
    c.write(4096, &[7; 4096]);
    assert_eq!(c.read(4096, 4096), vec![7; 4096]);
    // A WRITE claiming more than 64 MiB of payload: the server hangs up.
    c.send(WRITE, 0, 12, 0, (100 * MIB) as u32, &[0; 4096]);
    assert!(
        nbd::closed_within(&mut c.s, Duration::from_secs(5)),
        "no disconnect"
    );
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn unknown_commands_and_flags() {
    let (mut d, f) = setup("unknown", 8);
    let mut by = Client::connect(&d.sock(), "d");
    let mut c = Client::connect(&d.sock(), "d");
    assert_eq!(c.call(42, 0, 0, 512, &[]), EINVAL, "unknown command");
    assert_eq!(c.call(READ, 0x8000, 0, 512, &[]), EINVAL, "unknown flag on READ");
    assert_eq!(c.call(READ, NO_HOLE, 0, 512, &[]), EINVAL, "NO_HOLE on READ");
    assert_eq!(
        c.call(WRITE, 0x0100, 0, 512, &[9; 512]),
        EINVAL,
        "unknown flag on WRITE"
    );
    assert_eq!(c.call(FLUSH, 0, 512, 0, &[]), EINVAL, "FLUSH with an offset");
    assert_eq!(c.call(FLUSH, 0, 0, 512, &[]), EINVAL, "FLUSH with a length");
    assert_eq!(
        read_at(&f, 0, 512),
        vec![0; 512],
        "refused write reached the file"
    );
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    c.write(0, &[3; 512]);
    assert_eq!(c.read(0, 512), vec![3; 512]);
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn read_only_device() {
    let mut d = Daemon::start("ro");
    let f = d.dir.sparse("disk", 4 * MIB);
    let data = pattern(5, 8192);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .write_all(&data)
        .unwrap();
    d.ok(&[
        "create",
        "ro",
        "--readonly",
        "--table",
        &format!("0 8192 linear {} 0", f.display()),
    ]);
    let mut c = Client::connect(&d.sock(), "ro");
    assert_ne!(c.flags & 0x2, 0, "READ_ONLY missing from flags {:#x}", c.flags);
    assert_eq!(c.call(WRITE, 0, 0, 4096, &[0xFF; 4096]), EPERM);
    assert_eq!(c.call(WRITE, FLAG_FUA, 4096, 512, &[0xFF; 512]), EPERM);
    assert_eq!(c.call(TRIM, 0, 0, 4096, &[]), EPERM);
    assert_eq!(c.call(WRITE_ZEROES, 0, 0, 4096, &[]), EPERM);
    assert_eq!(c.call(WRITE_ZEROES, NO_HOLE, 0, 4096, &[]), EPERM);
    assert_eq!(c.read(0, 8192), data, "reads work");
    assert_eq!(read_at(&f, 0, 8192), data, "file changed");
    assert!(d.alive());
}

#[test]
fn disconnect_mid_write_payload() {
    let (mut d, f) = setup("midwrite", 8);
    let mut by = Client::connect(&d.sock(), "d");
    wait_open_count(&d, "d", 1);
    {
        let mut c = Client::connect(&d.sock(), "d");
        c.send(WRITE, 0, 1, 0, MIB as u32, &[0xCC; 4096]);
        // dropped with 1 MiB - 4 KiB of payload missing
    }
    wait_open_count(&d, "d", 1);
    assert_eq!(
        read_at(&f, 0, 4096),
        vec![0; 4096],
        "a partial write reached the file"
    );
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn garbage_during_handshake() {
    let (mut d, _f) = setup("garbage", 8);
    let mut by = Client::connect(&d.sock(), "d");
    // Random bytes instead of the client flags.
    for seed in 1..4 {
        let mut s = UnixStream::connect(d.sock()).unwrap();
        let _ = s.write_all(&pattern(seed, 4096));
        assert!(
            nbd::closed_within(&mut s, Duration::from_secs(5)),
            "seed {seed}: not closed"
        );
    }
    // Valid flags, then random bytes where an option should be.
    let mut s = nbd::greet(&d.sock());
    let mut junk = pattern(99, 4096);
    junk[0] = 0; // not the option magic
    let _ = s.write_all(&junk);
    assert!(
        nbd::closed_within(&mut s, Duration::from_secs(5)),
        "bad option magic: not closed"
    );
    // Unknown client flag bits.
    let mut s = UnixStream::connect(d.sock()).unwrap();
    let mut g = [0u8; 18];
    std::io::Read::read_exact(&mut s, &mut g).unwrap();
    s.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    assert!(
        nbd::closed_within(&mut s, Duration::from_secs(5)),
        "unknown client flags: not closed"
    );
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn bad_request_magic_closes_connection() {
    let (mut d, _f) = setup("magic", 8);
    let mut by = Client::connect(&d.sock(), "d");
    let mut c = Client::connect(&d.sock(), "d");
    let mut req = [0u8; 28];
    req[0..4].copy_from_slice(&0x1256_0953u32.to_be_bytes());
    req[24..28].copy_from_slice(&512u32.to_be_bytes());
    c.s.write_all(&req).unwrap();
    assert!(
        nbd::closed_within(&mut c.s, Duration::from_secs(5)),
        "bad magic: not closed"
    );
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn huge_option_length_disconnects() {
    let (mut d, _f) = setup("hugeopt", 8);
    let mut by = Client::connect(&d.sock(), "d");
    for code in [7u32, 99] {
        let mut s = nbd::greet(&d.sock());
        let mut h = Vec::new();
        h.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes());
        h.extend_from_slice(&code.to_be_bytes());
        h.extend_from_slice(&u32::MAX.to_be_bytes());
        h.extend_from_slice(&[0u8; 1024]);
        s.write_all(&h).unwrap();
        // Without waiting for 4 GiB that will never come.
        assert!(
            nbd::closed_within(&mut s, Duration::from_secs(5)),
            "option {code}: not closed"
        );
    }
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn starttls_refused_then_go() {
    let (mut d, _f) = setup("tls", 8);
    let mut s = nbd::greet(&d.sock());
    nbd::send_opt(&mut s, 5, &[]);
    let (typ, _) = nbd::opt_reply(&mut s);
    assert_ne!(typ & 0x8000_0000, 0, "STARTTLS answered {typ:#x}");
    assert_ne!(typ, 0x8000_0005, "NBD_REP_ERR_TLS_REQD in NOTLS mode");
    let mut c = nbd::go_on(s, "d").map_err(|(_, e)| e).expect("GO after STARTTLS");
    assert_eq!(c.size, 8 * MIB);
    c.write(0, &[4; 4096]);
    assert_eq!(c.read(0, 4096), vec![4; 4096]);
    assert!(d.alive());
}

#[test]
fn unknown_option_then_go() {
    let (mut d, _f) = setup("unkopt", 8);
    let mut s = nbd::greet(&d.sock());
    nbd::send_opt(&mut s, 99, b"some data the server must skip");
    let (typ, _) = nbd::opt_reply(&mut s);
    assert_eq!(typ, 0x8000_0001, "NBD_REP_ERR_UNSUP");
    nbd::send_opt(&mut s, 4, &[1, 2, 3]); // PEEK_EXPORT: withdrawn, so unknown
    assert_eq!(nbd::opt_reply(&mut s).0, 0x8000_0001);
    let mut c = nbd::go_on(s, "d")
        .map_err(|(_, e)| e)
        .expect("GO after unknown option");
    c.write(512, &[6; 512]);
    assert_eq!(c.read(512, 512), vec![6; 512]);
    assert!(d.alive());
}

#[test]
fn go_unknown_export() {
    let (mut d, _f) = setup("unkexp", 8);
    let s = nbd::greet(&d.sock());
    let (s, e) = match nbd::go_on(s, "no-such-device") {
        Ok(_) => panic!("GO for an unknown export succeeded"),
        Err(x) => x,
    };
    assert_eq!(e, 0x8000_0006, "NBD_REP_ERR_UNKNOWN");
    // The handshake goes on: GO for the real export works on the same socket.
    let mut c = nbd::go_on(s, "d")
        .map_err(|(_, e)| e)
        .expect("GO after unknown export");
    assert_eq!(c.read(0, 512), vec![0; 512]);
    assert!(d.alive());
}

#[test]
fn opt_abort_is_acked() {
    let (mut d, _f) = setup("abort", 8);
    let mut s = nbd::greet(&d.sock());
    nbd::send_opt(&mut s, 2, &[]);
    let (typ, p) = nbd::opt_reply(&mut s);
    assert_eq!((typ, p.len()), (1, 0), "NBD_REP_ACK with no payload");
    assert!(
        nbd::closed_within(&mut s, Duration::from_secs(5)),
        "not closed after ABORT"
    );
    // A client that aborts and hangs up without reading the reply.
    let mut s = nbd::greet(&d.sock());
    nbd::send_opt(&mut s, 2, &[]);
    drop(s);
    let mut c = Client::connect(&d.sock(), "d");
    assert_eq!(c.read(0, 512), vec![0; 512]);
    assert!(d.alive());
}

#[test]
fn many_clients_at_once() {
    let (mut d, f) = setup("many", 16);
    let sock = d.sock();
    let threads: Vec<_> = (0..16u64)
        .map(|i| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect(&sock, "d");
                let base = i * MIB;
                for round in 0..8u64 {
                    let data = pattern(i * 100 + round, 128 << 10);
                    let off = base + (round % 4) * (128 << 10);
                    c.write(off, &data);
                    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
                    assert_eq!(c.read(off, data.len()), data, "client {i} round {round}");
                }
                c.send(DISC, 0, 0, 0, 0, &[]);
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    for i in 0..16u64 {
        let off = i * MIB + 3 * (128 << 10);
        assert_eq!(
            read_at(&f, off, 128 << 10),
            pattern(i * 100 + 7, 128 << 10),
            "file region {i}"
        );
    }
    assert!(d.alive());
}

/// A client that sends requests and never reads the replies: the daemon stops
/// reading from it once its replies back up, so memory stays bounded, and other
/// clients are served meanwhile.
#[test]
fn client_that_never_reads_replies_keeps_memory_bounded() {
    let (mut d, _f) = setup("noread", 64);
    let mut by = Client::connect(&d.sock(), "d");
    let before = d.rss_kib();
    let mut greedy = Client::connect(&d.sock(), "d");
    greedy
        .s
        .set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // Up to 64 Ki 1 MiB read replies asked for, none read. The headers alone
    // (1.8 MiB) are more than the daemon's receive buffer and the socket's
    // buffers hold together, so a daemon that stops reading blocks the writer;
    // 8 Ki headers (224 KiB) fit in the receive buffer alone.
    const ASKED: u64 = 1 << 16;
    let mut sent = 0u64;
    for i in 0..ASKED {
        let mut h = Vec::with_capacity(28);
        h.extend_from_slice(&0x2560_9513u32.to_be_bytes());
        h.extend_from_slice(&0u16.to_be_bytes());
        h.extend_from_slice(&READ.to_be_bytes());
        h.extend_from_slice(&i.to_be_bytes());
        h.extend_from_slice(&((i % 64) * MIB).to_be_bytes());
        h.extend_from_slice(&(MIB as u32).to_be_bytes());
        if greedy.s.write_all(&h).is_err() {
            break; // the daemon stopped reading: back-pressure
        }
        sent += 1;
    }
    std::thread::sleep(Duration::from_millis(300));
    let grown = d.rss_kib().saturating_sub(before);
    eprintln!("{sent} requests taken before back-pressure; daemon grew {grown} KiB");
    assert!(
        sent < ASKED,
        "the daemon read all {sent} requests of a client that reads nothing"
    );
    assert!(
        grown < 256 * 1024,
        "daemon grew by {grown} KiB for {sent} unread 1 MiB replies"
    );
    still_serving(&mut d, &mut by, "d");
    drop(greedy);
    still_serving(&mut d, &mut by, "d");
}

/// A thousand clients connected at once, each served.
#[test]
fn a_thousand_connections() {
    let (mut d, f) = setup("thousand", 16);
    let want = pattern(42, 4096);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .and_then(|file| std::os::unix::fs::FileExt::write_all_at(&file, &want, 0))
        .unwrap();
    let mut clients: Vec<Client> = (0..1000).map(|_| Client::connect(&d.sock(), "d")).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        assert_eq!(c.read(0, 4096), want, "client {i}");
    }
    for c in &mut clients {
        c.send(DISC, 0, 0, 0, 0, &[]);
    }
    drop(clients);
    let mut by = Client::connect(&d.sock(), "d");
    still_serving(&mut d, &mut by, "d");
}

#[test]
fn write_flush_fua_read_back() {
    let (mut d, f) = setup("flush", 8);
    let mut c = Client::connect(&d.sock(), "d");
    assert_ne!(c.flags & 0x4, 0, "SEND_FLUSH");
    assert_ne!(c.flags & 0x8, 0, "SEND_FUA");
    let a = pattern(21, 256 << 10);
    c.write(MIB, &a);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    assert_eq!(c.read(MIB, a.len()), a);
    assert_eq!(read_at(&f, MIB, a.len()), a);
    let b = pattern(22, 64 << 10);
    assert_eq!(c.call(WRITE, FLAG_FUA, 2 * MIB, b.len() as u32, &b), 0);
    assert_eq!(c.read(2 * MIB, b.len()), b);
    assert_eq!(read_at(&f, 2 * MIB, b.len()), b);
    // Unaligned to O_DIRECT but sector-aligned FUA write.
    assert_eq!(c.call(WRITE, FLAG_FUA, 3 * MIB + 512, 1024, &[0x77; 1024]), 0);
    assert_eq!(read_at(&f, 3 * MIB + 512, 1024), vec![0x77; 1024]);
    assert!(d.alive());
}

#[test]
fn trim_reads_back_zeroes() {
    let (d, f) = setup("trim", 8);
    let mut c = Client::connect(&d.sock(), "d");
    let a = pattern(31, MIB as usize);
    c.write(MIB, &a);
    assert_eq!(c.call(TRIM, 0, MIB, MIB as u32, &[]), 0);
    assert_eq!(c.read(MIB, MIB as usize), vec![0; MIB as usize]);
    assert_eq!(read_at(&f, MIB, MIB as usize), vec![0; MIB as usize]);
    // FUA trim, and a trim of part of a written range leaves the rest alone.
    c.write(2 * MIB, &a);
    assert_eq!(c.call(TRIM, FLAG_FUA, 2 * MIB + 4096, 8192, &[]), 0);
    let got = c.read(2 * MIB, 16384);
    assert_eq!(&got[..4096], &a[..4096]);
    assert_eq!(&got[4096..12288], &[0; 8192][..]);
    assert_eq!(&got[12288..], &a[12288..16384]);
}

#[test]
fn write_zeroes_read_back_zeroes() {
    let (d, f) = setup("wzero", 8);
    let mut c = Client::connect(&d.sock(), "d");
    assert_ne!(c.flags & 0x40, 0, "SEND_WRITE_ZEROES");
    for (i, flags) in [0u16, NO_HOLE, NO_HOLE | FLAG_FUA].into_iter().enumerate() {
        let off = (i as u64 + 1) * MIB;
        let a = pattern(40 + i as u64, 512 << 10);
        c.write(off, &a);
        assert_eq!(
            c.call(WRITE_ZEROES, flags, off + 512, 256 << 10, &[]),
            0,
            "flags {flags:#x}"
        );
        let got = c.read(off, 512 << 10);
        assert_eq!(got[..512], a[..512], "flags {flags:#x}: before the range");
        assert!(
            got[512..512 + (256 << 10)].iter().all(|&b| b == 0),
            "flags {flags:#x}: not zero"
        );
        assert_eq!(
            got[512 + (256 << 10)..],
            a[512 + (256 << 10)..],
            "flags {flags:#x}: after"
        );
        let file = read_at(&f, off + 512, 256 << 10);
        assert!(file.iter().all(|&b| b == 0), "flags {flags:#x}: file not zero");
    }
}

// ---- one flush per underlying device (seed 002) ----

fn send_flushes(c: &mut Client, n: usize) {
    for _ in 0..n {
        assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    }
}

/// 1024 linear segments (8 sectors each, every other 8 sectors) over one file.
fn segmented(d: &Daemon, name: &str, file: &std::path::Path) {
    let table: String = (0..1024)
        .map(|i| format!("{} 8 linear {} {}\n", i * 8, file.display(), i * 16))
        .collect();
    d.create(name, &table);
}

#[test]
fn one_flush_per_file_with_1024_segments() {
    const N: u64 = 5;
    let d = Daemon::start("flush1024");
    let f = d.dir.sparse("disk", 8 * MIB);
    segmented(&d, "seg", &f);
    let mut c = Client::connect(&d.sock(), "seg");
    assert_eq!(c.size, 1024 * 8 * 512);
    c.write(0, &pattern(1, 8192)); // spans two segments
    let before = d.flushes("seg", &f);
    send_flushes(&mut c, N as usize);
    assert_eq!(
        d.flushes("seg", &f) - before,
        N,
        "file must see one flush per NBD FLUSH"
    );
    // And the data really went through the segments.
    assert_eq!(read_at(&f, 0, 4096), pattern(1, 8192)[..4096]);
    assert_eq!(read_at(&f, 8192, 4096), pattern(1, 8192)[4096..]);
}

#[test]
fn one_flush_per_file_through_stacked_device() {
    const N: u64 = 4;
    let d = Daemon::start("flushstack");
    let f = d.dir.sparse("disk", 8 * MIB);
    segmented(&d, "seg", &f);
    d.create("top", "0 8192 linear /dev/mapper/seg 0");
    let mut c = Client::connect(&d.sock(), "top");
    let before = d.flushes("top", &f);
    assert_eq!(
        d.flushes("seg", &f),
        before,
        "stats through the stack name the same file"
    );
    send_flushes(&mut c, N as usize);
    assert_eq!(d.flushes("top", &f) - before, N);
}

#[test]
fn striped_flush_reaches_each_file_once() {
    const N: u64 = 3;
    let d = Daemon::start("flushstripe");
    let a = d.dir.sparse("a", 4 * MIB);
    let b = d.dir.sparse("b", 4 * MIB);
    d.create(
        "st",
        &format!("0 16384 striped 2 8 {} 0 {} 0", a.display(), b.display()),
    );
    let mut c = Client::connect(&d.sock(), "st");
    let (a0, b0) = (d.flushes("st", &a), d.flushes("st", &b));
    send_flushes(&mut c, N as usize);
    assert_eq!(d.flushes("st", &a) - a0, N, "file a");
    assert_eq!(d.flushes("st", &b) - b0, N, "file b");
}

#[test]
fn io_error_from_error_target_is_eio() {
    let d = Daemon::start("eio");
    d.create("e", "0 2048 error");
    let mut c = Client::connect(&d.sock(), "e");
    assert_eq!(c.call(READ, 0, 0, 512, &[]), EIO);
    assert_eq!(c.call(WRITE, 0, 0, 512, &[1; 512]), EIO);
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0, "empty flushes succeed on error");
}
