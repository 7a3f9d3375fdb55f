//! Bad and hostile NBD clients: each test checks the exact NBD error (or the
//! disconnect) and that the daemon and other clients keep working afterwards.

use crate::common;

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
use common::MIB;
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
/// A connection to export "d" with structured replies (no meta context) or
/// with simple replies.
fn connect_either(d: &Daemon, structured: bool) -> Client {
    if structured {
        nbd::connect_structured(&d.sock(), "d", &[]).0
    } else {
        Client::connect(&d.sock(), "d")
    }
}

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

/// A client that sends 2,000 reads of 1 MiB, then 18,000 of 4 KiB, and reads no
/// reply: the daemon stops taking its requests once the bytes it holds for them
/// reach its bound, so its memory stays within that bound (+32 MiB over the
/// baseline is asserted; before the bound it grew by about 100 MiB), a second
/// client is served meanwhile, and when the client reads at last every reply is
/// there, once, with the right data. The 20,000 headers (560 KB) are more than
/// the daemon's receive buffer (256 KiB) and the socket's together, so the
/// writer blocks however early or late the daemon reads (with 2,000 headers,
/// one late read took them all and the writer finished).
#[test]
fn client_that_never_reads_replies_keeps_memory_bounded() {
    const ASKED: u64 = 20_000;
    const LARGE: u64 = 2000;
    let len_of = |cookie: u64| if cookie < LARGE { MIB } else { 4096 };
    let (mut d, f) = setup("noread", 64);
    let disk: Vec<u8> = pattern(77, (64 * MIB) as usize);
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::OpenOptions::new().write(true).open(&f).unwrap(),
        &disk,
        0,
    )
    .unwrap();
    let mut by = Client::connect(&d.sock(), "d");
    // warm up the daemon's own buffers, so the baseline is not its first I/O
    for i in 0..8 {
        assert!(by.read(i * MIB, MIB as usize) == disk[(i * MIB) as usize..((i + 1) * MIB) as usize]);
    }
    let before = d.rss_kib();
    let mut greedy = Client::connect(&d.sock(), "d");
    let mut wr = greedy.s.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        for i in 0..ASKED {
            let mut h = Vec::with_capacity(28);
            h.extend_from_slice(&0x2560_9513u32.to_be_bytes());
            h.extend_from_slice(&0u16.to_be_bytes());
            h.extend_from_slice(&READ.to_be_bytes());
            h.extend_from_slice(&i.to_be_bytes());
            h.extend_from_slice(&((i % 32) * MIB).to_be_bytes());
            h.extend_from_slice(&(len_of(i) as u32).to_be_bytes());
            // blocks while the daemon leaves the requests in the socket
            wr.write_all(&h).expect("send request");
        }
    });
    let mut peak = 0;
    for round in 0..10u64 {
        std::thread::sleep(Duration::from_millis(150));
        peak = peak.max(d.rss_kib().saturating_sub(before));
        // the other client is served while the greedy one holds (past the
        // 32 MiB the greedy one reads)
        let data = pattern(round, 65536);
        by.write(40 * MIB + round * 65536, &data);
        assert_eq!(
            by.read(40 * MIB + round * 65536, 65536),
            data,
            "bystander round {round}"
        );
    }
    assert!(
        !writer.is_finished(),
        "the daemon took all {ASKED} requests of a client that reads nothing"
    );
    eprintln!(
        "daemon grew by at most {peak} KiB while {ASKED} unread replies ({LARGE} of 1 MiB) were asked for"
    );
    assert!(
        peak < 32 * 1024,
        "daemon grew by {peak} KiB for a client that reads nothing"
    );
    // Now the client reads: every reply, once, with its data.
    let mut seen = vec![false; ASKED as usize];
    for n in 0..ASKED {
        let r = greedy.next_reply(|c| len_of(c) as usize);
        let Reply::Simple { cookie, error, data } = r else {
            panic!("reply {n}: {r:?}")
        };
        assert_eq!(error, 0, "reply {n} (cookie {cookie})");
        assert!(
            cookie < ASKED && !seen[cookie as usize],
            "reply {n}: cookie {cookie} unknown or repeated"
        );
        seen[cookie as usize] = true;
        let off = ((cookie % 32) * MIB) as usize;
        assert!(
            data == disk[off..off + len_of(cookie) as usize],
            "reply {n}: cookie {cookie}: wrong data"
        );
        if n % 2000 == 0 {
            peak = peak.max(d.rss_kib().saturating_sub(before));
        }
    }
    writer.join().expect("writer");
    assert!(
        peak < 32 * 1024,
        "daemon grew by {peak} KiB while the replies were read"
    );
    answers_next(&mut greedy, 16 * MIB, 9);
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

// ---- every request shape answered (issue 29, item 3) ----

use common::nbd::{
    Reply, BLOCK_STATUS, CACHE, FLAG_DF, FLAG_FAST_ZERO, FLAG_NO_HOLE, FLAG_REQ_ONE, REPLY_FLAG_DONE,
    REPLY_TYPE_BLOCK_STATUS, REPLY_TYPE_ERROR, REPLY_TYPE_NONE, REPLY_TYPE_OFFSET_DATA,
};

/// The structured reply to a refused request: one error chunk, no message.
fn error_chunk(cookie: u64, e: u32) -> Reply {
    let mut payload = e.to_be_bytes().to_vec();
    payload.extend_from_slice(&0u16.to_be_bytes());
    Reply::Chunk {
        cookie,
        flags: REPLY_FLAG_DONE,
        typ: REPLY_TYPE_ERROR,
        payload,
    }
}

fn simple(cookie: u64, error: u32) -> Reply {
    Reply::Simple {
        cookie,
        error,
        data: Vec::new(),
    }
}

/// The connection still answers: a write and a read-back of `seed`'s pattern at
/// `off`, each with its own cookie, in whichever reply form the client negotiated.
fn answers_next(c: &mut Client, off: u64, seed: u64) {
    let data = pattern(seed, 4096);
    c.send(WRITE, 0, 0xA1, off, 4096, &data);
    assert_eq!(c.next_reply(|_| 0), simple(0xA1, 0), "the next write");
    c.send(READ, 0, 0xA2, off, 4096, &[]);
    match c.next_reply(|_| 4096) {
        Reply::Simple {
            cookie,
            error,
            data: got,
        } => {
            assert_eq!((cookie, error), (0xA2, 0));
            assert_eq!(got, data, "read-back");
        }
        Reply::Chunk {
            cookie,
            flags,
            typ,
            payload,
        } => {
            assert_eq!(
                (cookie, flags, typ),
                (0xA2, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA)
            );
            assert_eq!(payload[..8], off.to_be_bytes());
            assert_eq!(payload[8..], data[..], "read-back");
        }
    }
}

/// Zero-length requests of every command, in both reply forms: each is answered
/// (a zero-length write used to wait for a payload of nothing, forever, and every
/// request after it on the connection with it).
#[test]
fn zero_length_requests_are_answered() {
    let (mut d, f) = setup("zerolen", 8);
    let mut by = Client::connect(&d.sock(), "d");
    let size = 8 * MIB;
    let mut c = Client::connect(&d.sock(), "d");
    let cases: [(u16, u16, u64, u32); 11] = [
        (WRITE, 0, 0, 0),
        (WRITE, FLAG_FUA, 4096, 0),
        (WRITE, 0, size, 0),
        (WRITE, 0, size + 512, ENOSPC),
        (READ, 0, 0, 0),
        (READ, 0, size + 512, EINVAL),
        (TRIM, 0, 0, 0),
        (WRITE_ZEROES, 0, 0, 0),
        (WRITE_ZEROES, NO_HOLE, 0, 0),
        (CACHE, 0, 0, 0),
        (BLOCK_STATUS, 0, 0, EINVAL),
    ];
    for (i, &(cmd, flags, off, want)) in cases.iter().enumerate() {
        let cookie = 100 + i as u64;
        c.send(cmd, flags, cookie, off, 0, &[]);
        assert_eq!(
            c.next_reply(|_| 0),
            simple(cookie, want),
            "command {cmd} flags {flags:#x} at {off}"
        );
        answers_next(&mut c, MIB, i as u64);
    }
    // Structured replies: an empty read is one NONE chunk (an OFFSET_DATA chunk
    // must carry data); an empty block status has no descriptor to give.
    let (mut c, ctx) = nbd::connect_structured(&d.sock(), "d", &["base:allocation"]);
    assert_eq!(ctx, vec![(1, "base:allocation".to_string())]);
    for (i, &(cmd, flags, off, want)) in cases.iter().enumerate() {
        let cookie = 200 + i as u64;
        c.send(cmd, flags, cookie, off, 0, &[]);
        let expect = match (cmd, want) {
            (_, e) if e != 0 => error_chunk(cookie, e),
            (READ, _) => Reply::Chunk {
                cookie,
                flags: REPLY_FLAG_DONE,
                typ: REPLY_TYPE_NONE,
                payload: Vec::new(),
            },
            _ => simple(cookie, 0),
        };
        assert_eq!(
            c.next_reply(|_| 0),
            expect,
            "structured: command {cmd} flags {flags:#x} at {off}"
        );
        answers_next(&mut c, 2 * MIB, i as u64);
    }
    assert_eq!(read_at(&f, 0, 8192), vec![0; 8192], "an empty write wrote");
    still_serving(&mut d, &mut by, "d");
}

/// Every flag bit on every command, with simple and with structured replies: a
/// flag the command takes (and the export offered) works, any other is EINVAL;
/// a refused write's payload is still consumed.
#[test]
fn every_flag_on_every_command() {
    let (mut d, f) = setup("flags", 8);
    let mut by = Client::connect(&d.sock(), "d");
    // HAS_FLAGS, SEND_FLUSH, SEND_FUA, SEND_TRIM, SEND_WRITE_ZEROES, CAN_MULTI_CONN,
    // SEND_CACHE, SEND_FAST_ZERO; SEND_DF only with structured replies.
    const OFFERED: u16 = 0x0001 | 0x0004 | 0x0008 | 0x0020 | 0x0040 | 0x0100 | 0x0400 | 0x0800;
    let cmds = [READ, WRITE, FLUSH, TRIM, CACHE, WRITE_ZEROES, BLOCK_STATUS];
    let mut last_write = vec![0u8; 4096];
    for structured in [false, true] {
        let mut c = if structured {
            let (c, ctx) = nbd::connect_structured(&d.sock(), "d", &["base:allocation"]);
            assert_eq!(ctx.len(), 1);
            assert_eq!(c.flags, OFFERED | 0x0080, "structured transmission flags");
            c
        } else {
            let c = Client::connect(&d.sock(), "d");
            assert_eq!(c.flags, OFFERED, "transmission flags");
            c
        };
        for (k, &cmd) in cmds.iter().enumerate() {
            let off = if cmd == FLUSH { 0 } else { k as u64 * 65536 };
            for bit in 0..16u16 {
                let flag = 1u16 << bit;
                let takes = match cmd {
                    READ => flag == FLAG_FUA || (flag == FLAG_DF && structured),
                    WRITE | FLUSH | TRIM | CACHE => flag == FLAG_FUA,
                    WRITE_ZEROES => matches!(flag, FLAG_FUA | FLAG_NO_HOLE | FLAG_FAST_ZERO),
                    _ => structured && matches!(flag, FLAG_FUA | FLAG_REQ_ONE),
                };
                let len = if cmd == FLUSH { 0 } else { 4096 };
                let payload = if cmd == WRITE {
                    pattern(u64::from(bit) + 16 * u64::from(structured), 4096)
                } else {
                    Vec::new()
                };
                let cookie = (u64::from(cmd) << 32) | u64::from(flag);
                c.send(cmd, flag, cookie, off, len, &payload);
                let r = c.next_reply(|_| if cmd == READ { len as usize } else { 0 });
                let what = format!("structured={structured} command {cmd} flag {flag:#x}");
                if !takes {
                    let want = if structured {
                        error_chunk(cookie, EINVAL)
                    } else {
                        simple(cookie, EINVAL)
                    };
                    assert_eq!(r, want, "{what}");
                    continue;
                }
                assert_eq!(r.error(), 0, "{what}: {r:?}");
                assert_eq!(r.cookie(), cookie, "{what}");
                assert!(r.done(), "{what}: {r:?}");
                match (&r, cmd) {
                    (Reply::Simple { data, .. }, READ) => assert_eq!(data.len(), 4096, "{what}"),
                    (Reply::Chunk { typ, payload, .. }, READ) => {
                        assert_eq!(*typ, REPLY_TYPE_OFFSET_DATA, "{what}");
                        assert_eq!(payload.len(), 8 + 4096, "{what}");
                    }
                    (Reply::Chunk { typ, payload, .. }, BLOCK_STATUS) => {
                        assert_eq!(*typ, REPLY_TYPE_BLOCK_STATUS, "{what}");
                        assert_eq!(payload[..4], 1u32.to_be_bytes(), "{what}: context id");
                        if flag == FLAG_REQ_ONE {
                            assert_eq!(payload.len(), 12, "{what}: one descriptor");
                        }
                    }
                    (r, _) => assert_eq!(*r, simple(cookie, 0), "{what}"),
                }
                if cmd == WRITE {
                    last_write = payload;
                }
            }
        }
        answers_next(&mut c, 2 * MIB, 77);
    }
    assert_eq!(
        read_at(&f, 65536, 4096),
        last_write,
        "a refused write reached the file"
    );
    still_serving(&mut d, &mut by, "d");
}

/// Commands the protocol does not define (and RESIZE, which dmkit does not
/// offer) are EINVAL whatever their flags and length, in both reply forms.
#[test]
fn unknown_commands_every_length() {
    let (mut d, _f) = setup("unkcmd", 8);
    let mut by = Client::connect(&d.sock(), "d");
    for structured in [false, true] {
        let mut c = connect_either(&d, structured);
        for cmd in [8u16, 9, 42, 0x7fff, 0x8000, 0xffff] {
            for (flags, len) in [(0u16, 0u32), (0, 512), (FLAG_FUA, 4096), (0xffff, u32::MAX)] {
                let cookie = (u64::from(cmd) << 16) | u64::from(flags);
                c.send(cmd, flags, cookie, 0, len, &[]);
                let want = if structured {
                    error_chunk(cookie, EINVAL)
                } else {
                    simple(cookie, EINVAL)
                };
                assert_eq!(
                    c.next_reply(|_| 0),
                    want,
                    "command {cmd:#x} flags {flags:#x} length {len}"
                );
            }
        }
        answers_next(&mut c, MIB, 5);
    }
    still_serving(&mut d, &mut by, "d");
}

/// A block-status chunk's payload: (context id, descriptors).
fn descriptors(r: &Reply) -> (u32, Vec<(u32, u32)>) {
    let Reply::Chunk { typ, payload, .. } = r else {
        panic!("not a chunk: {r:?}")
    };
    assert_eq!(*typ, REPLY_TYPE_BLOCK_STATUS, "{r:?}");
    assert_eq!((payload.len() - 4) % 8, 0, "{r:?}");
    let id = u32::from_be_bytes(payload[0..4].try_into().unwrap());
    let d = payload[4..]
        .chunks(8)
        .map(|p| {
            (
                u32::from_be_bytes(p[0..4].try_into().unwrap()),
                u32::from_be_bytes(p[4..8].try_into().unwrap()),
            )
        })
        .collect();
    (id, d)
}

/// BLOCK_STATUS without structured replies, without a context, with a context
/// selected for another export, with one and with two contexts, with REQ_ONE,
/// empty, past the end and misaligned: each gets the answer the protocol names.
#[test]
fn block_status_every_negotiation() {
    let (mut d, _f) = setup("bstatus", 8);
    let meta = d.dir.sparse("meta", 16 * MIB);
    let data = d.dir.sparse("data", 64 * MIB);
    d.create(
        "pool",
        &format!("0 131072 thin-pool {} {} 128 0", meta.display(), data.display()),
    );
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("vol", "0 65536 thin /dev/mapper/pool 0"); // 32 MiB, 64 KiB blocks
    let mut w = Client::connect(&d.sock(), "vol");
    w.write(0, &pattern(1, 65536));
    d.ok(&["suspend", "vol"]);
    d.ok(&["message", "pool", "0", "create_snap 1 0"]);
    d.ok(&["resume", "vol"]);
    w.write(MIB, &pattern(2, 65536));
    w.send(DISC, 0, 0, 0, 0, &[]);
    let mut by = Client::connect(&d.sock(), "d");

    // Simple replies only: EINVAL in a simple reply.
    let mut c = Client::connect(&d.sock(), "vol");
    c.send(BLOCK_STATUS, 0, 1, 0, 65536, &[]);
    assert_eq!(c.next_reply(|_| 0), simple(1, EINVAL));
    answers_next(&mut c, 4 * MIB, 1);
    // Structured replies, no context: an error chunk.
    let (mut c, _) = nbd::connect_structured(&d.sock(), "vol", &[]);
    c.send(BLOCK_STATUS, FLAG_REQ_ONE, 2, 0, 65536, &[]);
    assert_eq!(c.next_reply(|_| 0), error_chunk(2, EINVAL));
    answers_next(&mut c, 4 * MIB, 2);
    // A context selected for export d, then GO on vol: none selected there.
    let mut s = nbd::greet(&d.sock());
    nbd::send_opt(&mut s, 8, &[]);
    assert_eq!(nbd::opt_reply(&mut s).0, 1);
    let mut q = Vec::new();
    q.extend_from_slice(&1u32.to_be_bytes());
    q.extend_from_slice(b"d");
    q.extend_from_slice(&1u32.to_be_bytes());
    q.extend_from_slice(&15u32.to_be_bytes());
    q.extend_from_slice(b"base:allocation");
    nbd::send_opt(&mut s, 10, &q);
    assert_eq!(nbd::opt_reply(&mut s).0, 4);
    assert_eq!(nbd::opt_reply(&mut s).0, 1);
    let mut c = nbd::go_on(s, "vol").map_err(|(_, e)| e).expect("GO");
    c.send(BLOCK_STATUS, 0, 3, 0, 65536, &[]);
    assert_eq!(
        c.next_reply(|_| 0),
        error_chunk(3, EINVAL),
        "context of another export"
    );
    answers_next(&mut c, 4 * MIB, 3);

    // base:allocation: written blocks are data (0), the rest hole and zero (3).
    let (mut c, ctx) = nbd::connect_structured(&d.sock(), "vol", &["base:allocation"]);
    assert_eq!(ctx, vec![(1, "base:allocation".to_string())]);
    c.send(BLOCK_STATUS, 0, 4, 0, 2 * MIB as u32, &[]);
    let r = c.chunks(4);
    assert_eq!(r.len(), 1);
    assert!(r[0].done());
    let (id, ext) = descriptors(&r[0]);
    assert_eq!(id, 1);
    assert_eq!(
        ext[..3],
        [(65536, 0), (MIB as u32 - 65536, 3), (65536, 0)],
        "allocation map {ext:?}"
    );
    // The last descriptor may run past the request, the others may not.
    let before_last: u64 = ext[..ext.len() - 1].iter().map(|e| u64::from(e.0)).sum();
    assert!(before_last < 2 * MIB, "{ext:?}");
    // REQ_ONE: one descriptor, no longer than the request.
    c.send(BLOCK_STATUS, FLAG_REQ_ONE, 5, 0, 2 * MIB as u32, &[]);
    assert_eq!(descriptors(&c.chunks(5)[0]), (1, vec![(65536, 0)]));
    c.send(BLOCK_STATUS, FLAG_REQ_ONE, 6, 32768, 4096, &[]);
    assert_eq!(descriptors(&c.chunks(6)[0]), (1, vec![(4096, 0)]));
    c.send(BLOCK_STATUS, FLAG_REQ_ONE, 7, 65536, 4096, &[]);
    assert_eq!(descriptors(&c.chunks(7)[0]), (1, vec![(4096, 3)]));
    // Empty, past the end, running past the end, misaligned, maximal.
    for (cookie, off, len) in [
        (8u64, 0u64, 0u32),
        (9, 32 * MIB, 512),
        (10, 32 * MIB - 512, 1024),
        (11, 100, 512),
        (12, 0, u32::MAX),
        (13, 0, u32::MAX - 511),
    ] {
        c.send(BLOCK_STATUS, 0, cookie, off, len, &[]);
        assert_eq!(
            c.next_reply(|_| 0),
            error_chunk(cookie, EINVAL),
            "offset {off} length {len}"
        );
    }
    answers_next(&mut c, 4 * MIB, 4);

    // Two contexts: one chunk each (the last one DONE), each with its own id.
    let (mut c, ctx) = nbd::connect_structured(&d.sock(), "vol", &["base:allocation", "qemu:dirty-bitmap:1"]);
    assert_eq!(
        ctx,
        vec![
            (1, "base:allocation".to_string()),
            (2, "qemu:dirty-bitmap:1".to_string())
        ]
    );
    for (cookie, flags) in [(20u64, 0u16), (21, FLAG_REQ_ONE)] {
        c.send(BLOCK_STATUS, flags, cookie, 0, 2 * MIB as u32, &[]);
        let r = c.chunks(cookie);
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(!r[0].done() && r[1].done(), "{r:?}");
        let (a, b) = (descriptors(&r[0]), descriptors(&r[1]));
        assert_eq!((a.0, b.0), (1, 2));
        if flags == FLAG_REQ_ONE {
            assert_eq!(a.1, vec![(65536, 0)]);
            assert_eq!(
                b.1,
                vec![(MIB as u32, 0)],
                "unchanged since snapshot 1 up to 1 MiB"
            );
        } else {
            assert_eq!(a.1[0], (65536, 0));
            assert_eq!(
                b.1[..2],
                [(MIB as u32, 0), (65536, 1)],
                "changed since snapshot 1: {:?}",
                b.1
            );
        }
    }
    c.send(BLOCK_STATUS, FLAG_REQ_ONE, 22, MIB, 512, &[]);
    let r = c.chunks(22);
    assert_eq!(
        (descriptors(&r[0]), descriptors(&r[1])),
        ((1, vec![(512, 0)]), (2, vec![(512, 1)]))
    );
    answers_next(&mut c, 4 * MIB, 5);
    still_serving(&mut d, &mut by, "d");
}

/// Cookies are echoed, not interpreted: duplicated, zero and all-ones cookies on
/// pipelined requests each get their own reply.
#[test]
fn duplicated_and_odd_cookies() {
    let (mut d, f) = setup("cookies", 8);
    let mut by = Client::connect(&d.sock(), "d");
    let base = pattern(9, 65536);
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::OpenOptions::new().write(true).open(&f).unwrap(),
        &base,
        0,
    )
    .unwrap();
    for structured in [false, true] {
        let mut c = connect_either(&d, structured);
        // A simple reply does not say how much data follows it: only the cookie
        // does, so reads share cookies with reads and writes with writes.
        let reads = [5u64, 5, u64::MAX, 5];
        let writes = [0u64, 0, 7, 7];
        let mut want = Vec::new();
        for i in 0..4 {
            c.send(READ, 0, reads[i], 4096, 4096, &[]);
            want.push((reads[i], 0, base[4096..8192].to_vec()));
            let w = 2 * i as u64 + 1;
            c.send(WRITE, 0, writes[i], MIB + w * 4096, 4096, &pattern(w, 4096));
            want.push((writes[i], 0, Vec::new()));
        }
        c.send(READ, 0, 5, 8 * MIB, 512, &[]); // past the end, same cookie again
        want.push((5, EINVAL, Vec::new()));
        let mut got: Vec<(u64, u32, Vec<u8>)> = (0..want.len())
            .map(
                |_| match c.next_reply(|k| if reads.contains(&k) { 4096 } else { 0 }) {
                    Reply::Simple { cookie, error, data } => (cookie, error, data),
                    r @ Reply::Chunk {
                        typ: REPLY_TYPE_OFFSET_DATA,
                        ..
                    } => {
                        let Reply::Chunk {
                            cookie,
                            payload,
                            flags,
                            ..
                        } = r
                        else {
                            unreachable!()
                        };
                        assert_eq!(flags, REPLY_FLAG_DONE);
                        assert_eq!(payload[..8], 4096u64.to_be_bytes());
                        (cookie, 0, payload[8..].to_vec())
                    }
                    r => (r.cookie(), r.error(), Vec::new()),
                },
            )
            .collect();
        got.sort();
        want.sort();
        assert_eq!(got, want, "structured={structured}");
        answers_next(&mut c, 3 * MIB, 6);
    }
    for i in [1u64, 3, 5, 7] {
        assert_eq!(read_at(&f, MIB + i * 4096, 4096), pattern(i, 4096), "write {i}");
    }
    still_serving(&mut d, &mut by, "d");
}

/// Lengths at and past the limits: a 32 MiB READ and WRITE are served (the
/// READ as one chunk with structured replies), 32 MiB + 512 is EOVERFLOW (the
/// write's payload consumed), and TRIM and WRITE_ZEROES, which carry no payload,
/// take the largest length the header holds.
#[test]
fn maximal_lengths() {
    let (mut d, f) = setup("maxlen", 8 * 1024);
    let mut by = Client::connect(&d.sock(), "d");
    let max = 32 * MIB as u32;
    let big = pattern(3, max as usize);
    for structured in [false, true] {
        let mut c = connect_either(&d, structured);
        c.send(WRITE, 0, 1, 0, max, &big);
        assert_eq!(c.next_reply(|_| 0), simple(1, 0), "32 MiB write");
        c.send(READ, 0, 2, 0, max, &[]);
        match c.next_reply(|_| max as usize) {
            Reply::Simple { cookie, error, data } => {
                assert_eq!((cookie, error), (2, 0));
                assert!(data == big, "32 MiB read-back");
            }
            Reply::Chunk {
                cookie,
                flags,
                typ,
                payload,
            } => {
                assert_eq!((cookie, flags, typ), (2, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA));
                assert!(payload[8..] == big[..], "32 MiB read-back");
            }
        }
        let refused = |c: &mut Client, cookie: u64| {
            let r = c.next_reply(|_| 0);
            let want = if structured {
                error_chunk(cookie, EOVERFLOW)
            } else {
                simple(cookie, EOVERFLOW)
            };
            assert_eq!(r, want, "cookie {cookie}");
        };
        c.send(READ, 0, 3, 0, max + 512, &[]);
        refused(&mut c, 3);
        c.send(WRITE, 0, 4, 0, max + 512, &vec![0xEE; max as usize + 512]);
        refused(&mut c, 4);
        c.send(TRIM, 0, 5, 64 * MIB, u32::MAX - 511, &[]);
        assert_eq!(c.next_reply(|_| 0), simple(5, 0), "TRIM of 4 GiB - 512");
        c.send(WRITE_ZEROES, 0, 6, 64 * MIB, u32::MAX - 511, &[]);
        assert_eq!(c.next_reply(|_| 0), simple(6, 0), "WRITE_ZEROES of 4 GiB - 512");
        c.send(CACHE, 0, 7, 0, u32::MAX - 511, &[]);
        assert_eq!(c.next_reply(|_| 0), simple(7, 0), "CACHE of 4 GiB - 512");
        answers_next(&mut c, 40 * MIB, 7);
    }
    assert!(
        read_at(&f, 0, 4096) == big[..4096],
        "refused write reached the file"
    );
    still_serving(&mut d, &mut by, "d");
}

/// DISC behind pipelined requests: every one of them is answered, then the
/// server closes; their writes are on the file.
#[test]
fn disc_with_requests_in_flight() {
    let (mut d, f) = setup("discfly", 8);
    let mut by = Client::connect(&d.sock(), "d");
    for structured in [false, true] {
        let mut c = connect_either(&d, structured);
        let seed = 50 * u64::from(structured);
        let mut batch = Vec::new();
        let mut req = |cmd: u16, cookie: u64, off: u64, len: u32, payload: &[u8]| {
            batch.extend_from_slice(&0x2560_9513u32.to_be_bytes());
            batch.extend_from_slice(&0u16.to_be_bytes());
            batch.extend_from_slice(&cmd.to_be_bytes());
            batch.extend_from_slice(&cookie.to_be_bytes());
            batch.extend_from_slice(&off.to_be_bytes());
            batch.extend_from_slice(&len.to_be_bytes());
            batch.extend_from_slice(payload);
        };
        for i in 0..32u64 {
            req(WRITE, i, i * 65536, 65536, &pattern(seed + i, 65536));
            req(READ, 100 + i, 4 * MIB + i * 65536, 65536, &[]);
        }
        req(FLUSH, 1000, 0, 0, &[]);
        req(DISC, 2000, 0, 0, &[]);
        c.s.write_all(&batch).unwrap();
        let mut cookies: Vec<u64> = (0..65)
            .map(|_| {
                let r = c.next_reply(|k| if (100..132).contains(&k) { 65536 } else { 0 });
                assert_eq!(r.error(), 0, "{r:?}");
                r.cookie()
            })
            .collect();
        cookies.sort();
        let want: Vec<u64> = (0..32).chain(100..132).chain([1000]).collect();
        assert_eq!(cookies, want, "structured={structured}");
        assert!(
            nbd::closed_within(&mut c.s, Duration::from_secs(5)),
            "not closed after DISC"
        );
        for i in 0..32u64 {
            assert_eq!(
                read_at(&f, i * 65536, 65536),
                pattern(seed + i, 65536),
                "write {i}"
            );
        }
    }
    still_serving(&mut d, &mut by, "d");
}

/// A client that sends requests and then half-closes (shuts its write side)
/// gets every one answered, also those the daemon's back-pressure (8 MiB of
/// replies held) left unparsed in its buffer when the end of the stream came:
/// the fuzzer found a 4 MiB read followed by a 6 MiB one answered by a closed
/// connection (`fuzz/corpus/nbd_requests/regress-half-close-behind-back-pressure`).
#[test]
fn requests_held_back_by_back_pressure_are_answered_after_a_half_close() {
    let (d, f) = setup("halfclose", 16);
    let disk = pattern(91, (16 * MIB) as usize);
    std::fs::write(&f, &disk).unwrap();
    for structured in [false, true] {
        let mut c = connect_either(&d, structured);
        c.send(READ, 0, 1, 0, (4 * MIB) as u32, &[]);
        c.send(READ, 0, 2, 4 * MIB, (6 * MIB) as u32, &[]);
        c.send(READ, 0, 3, MIB, 512, &[]);
        c.s.shutdown(std::net::Shutdown::Write).unwrap();
        // (offset, length) of each cookie's read
        let reads = [(0, 0), (0, 4 * MIB), (4 * MIB, 6 * MIB), (MIB, 512)];
        let mut got = std::collections::BTreeMap::new();
        let mut done = std::collections::BTreeSet::new();
        while done.len() < 3 {
            let r = c.next_reply(|k| reads[k as usize].1 as usize);
            assert_eq!(r.error(), 0, "structured {structured}: {r:?}");
            let k = r.cookie();
            let (base, len) = reads[k as usize];
            match &r {
                nbd::Reply::Simple { data, .. } => {
                    got.insert(k, data.clone());
                }
                nbd::Reply::Chunk { typ: 1, payload, .. } => {
                    let off = u64::from_be_bytes(payload[..8].try_into().unwrap()) - base;
                    let v = got.entry(k).or_insert_with(|| vec![0u8; len as usize]);
                    v[off as usize..off as usize + payload.len() - 8].copy_from_slice(&payload[8..]);
                }
                _ => {}
            }
            if r.done() {
                done.insert(k);
            }
        }
        assert_eq!(got.len(), 3, "structured {structured}: three replies");
        assert!(
            got[&1] == disk[..(4 * MIB) as usize],
            "structured {structured}: read 1"
        );
        assert!(
            got[&2] == disk[(4 * MIB) as usize..(10 * MIB) as usize],
            "structured {structured}: read 2"
        );
        assert!(
            got[&3] == disk[MIB as usize..MIB as usize + 512],
            "structured {structured}: read 3"
        );
        assert!(
            nbd::closed_within(&mut c.s, Duration::from_secs(5)),
            "closed after the replies"
        );
    }
}

/// A client that fails its handshake over and over cannot make the log grow
/// faster than its bound (issue 45): at most 20 such lines a second are
/// written, each after the first left out says how many were, and the lines
/// written and those left out add up to the handshakes that failed.
#[test]
fn failed_handshakes_are_logged_at_a_bounded_rate() {
    use std::io::{Read, Write};
    let d = Daemon::start("lograte");
    let bad = |d: &Daemon| {
        let mut s = std::os::unix::net::UnixStream::connect(d.sock()).expect("connect");
        let mut greeting = [0u8; 18];
        s.read_exact(&mut greeting).expect("greeting");
        // client flags with unknown bits: the server ends the handshake
        s.write_all(&[0xff; 4]).expect("flags");
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    };
    let n = 300;
    let t0 = std::time::Instant::now();
    for _ in 0..n {
        bad(&d);
    }
    let spent = t0.elapsed().as_secs() + 1;
    // past the second: one more, which says how many were left out before it
    std::thread::sleep(std::time::Duration::from_millis(1100));
    bad(&d);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let log = d.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("handshake ended: client flags carry unknown bits"))
        .collect();
    let left_out: u64 = lines
        .iter()
        .filter_map(|l| l.split_once(" (").map(|x| x.1))
        .filter_map(|r| r.strip_suffix(" lines like it left out of the log before this one)"))
        .map(|c| c.parse::<u64>().expect("a count"))
        .sum();
    assert!(
        lines.len() as u64 <= 20 * (spent + 1) + 1,
        "{} lines in {spent} s",
        lines.len()
    );
    assert!(left_out > 0, "some were left out: {}", lines.len());
    assert_eq!(
        lines.len() as u64 + left_out,
        n + 1,
        "written and left out add up"
    );
}
