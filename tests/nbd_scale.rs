//! Many NBD clients at once on the real daemon: idle connections cost no thread
//! and little memory (the reactors of `export::nbd::reactor`), and clients that
//! never read their replies are bounded without stopping the others.

use crate::common;

use common::placement::{per_reactor, server_list, wait_connections};
use common::{pattern, Daemon, Scratch};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::MIB;

/// A free TCP port on loopback.
fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("address").port()
}

/// Raise this process's limit on open files to `want` (the hard limit allowing).
fn files_limit(want: u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on a live rlimit struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        assert!(
            l.rlim_max >= want,
            "this test opens {want} sockets; the hard limit on open files is {}",
            l.rlim_max
        );
        l.rlim_cur = l.rlim_cur.max(want);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
    }
}

/// Fixed-newstyle handshake with NBD_OPT_GO over TCP.
fn attach(addr: &str, export: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    s.write_all(&3u32.to_be_bytes()).expect("client flags"); // fixed newstyle, no zeroes
    let mut opt = (export.len() as u32).to_be_bytes().to_vec();
    opt.extend_from_slice(export.as_bytes());
    opt.extend_from_slice(&0u16.to_be_bytes());
    let mut m = b"IHAVEOPT".to_vec();
    m.extend_from_slice(&7u32.to_be_bytes()); // GO
    m.extend_from_slice(&(opt.len() as u32).to_be_bytes());
    m.extend_from_slice(&opt);
    s.write_all(&m).expect("GO");
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).expect("option reply");
        let typ = u32::from_be_bytes(h[12..16].try_into().expect("4"));
        let len = u32::from_be_bytes(h[16..20].try_into().expect("4"));
        let mut d = vec![0u8; len as usize];
        s.read_exact(&mut d).expect("option data");
        assert_eq!(typ & 0x8000_0000, 0, "GO refused: {typ:#x}");
        if typ == 1 {
            return s;
        }
    }
}

fn request(cmd: u16, cookie: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut r = 0x2560_9513u32.to_be_bytes().to_vec();
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&cmd.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&len.to_be_bytes());
    r
}

/// A read through `s`, answered with a simple reply.
fn read(s: &mut TcpStream, offset: u64, len: u32) -> Vec<u8> {
    s.write_all(&request(0, 7, offset, len)).expect("read request");
    let mut h = [0u8; 16];
    s.read_exact(&mut h).expect("reply");
    assert_eq!(&h[4..8], &[0; 4], "read failed");
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d).expect("data");
    d
}

fn threads(d: &Daemon) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", d.pid()))
        .expect("status")
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads:")
}

#[test]
fn ten_thousand_idle_connections_take_no_thread_each_and_little_memory() {
    const IDLE: usize = 10_000;
    files_limit(IDLE as u64 + 1_000);
    let s = Scratch::new("scale-idle");
    let f = s.sparse("f.img", 64 * MIB);
    let data = pattern(3, (64 * MIB) as usize);
    std::fs::write(&f, &data).expect("image");
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start_with("scale-idle", &["--nbd-listen", &addr, "--nbd-reactors", "2"], &[]);
    d.create("d", &format!("0 {} linear {} 0", 64 * MIB / 512, f.display()));
    // four busy clients read their own parts of the device throughout
    let busy = |k: u64| {
        let addr = addr.clone();
        let data = data.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let st = stop.clone();
        let h = std::thread::spawn(move || {
            let mut c = attach(&addr, "d");
            let mut n = 0u64;
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let off = k * 16 * MIB + (n % 4096) * 4096;
                assert_eq!(read(&mut c, off, 4096), &data[off as usize..off as usize + 4096]);
                n += 1;
            }
            n
        });
        (stop, h)
    };
    wait_connections(&d, 0);
    let (idle_threads, idle_rss) = (threads(&d), d.rss_kib());
    let clients: Vec<_> = (0..4).map(busy).collect();
    let conns: Vec<TcpStream> = (0..IDLE).map(|_| attach(&addr, "d")).collect();
    wait_connections(&d, IDLE as u64 + 4);
    // the last handshakes' threads end just after their connections are handed
    // on: given a moment to go (a thread per connection would not)
    let t0 = std::time::Instant::now();
    while threads(&d) > idle_threads && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (t, rss) = (threads(&d), d.rss_kib());
    println!(
        "idle daemon: {idle_threads} threads, {} MiB; with {IDLE} idle and 4 busy connections: {t} threads, {} MiB",
        idle_rss / 1024,
        rss / 1024
    );
    // no thread per connection: the reactors serve them all
    assert!(
        t <= idle_threads,
        "{t} threads with {IDLE} connections, {idle_threads} without"
    );
    assert!(
        rss < 200 * 1024,
        "{} MiB with {IDLE} idle connections",
        rss / 1024
    );
    // an idle connection still answers
    let mut one = conns.into_iter().enumerate().fold(None, |keep, (i, c)| {
        if i == IDLE / 2 {
            Some(c)
        } else {
            drop(c);
            keep
        }
    });
    let c = one.as_mut().expect("kept");
    assert_eq!(read(c, 32 * MIB, 65536), &data[32 << 20..(32 << 20) + 65536]);
    drop(one);
    let served: Vec<u64> = clients
        .into_iter()
        .map(|(stop, h)| {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            h.join().expect("busy client")
        })
        .collect();
    println!("busy clients' reads meanwhile: {served:?}");
    assert!(
        served.iter().all(|&n| n > 0),
        "a busy client was starved: {served:?}"
    );
    wait_connections(&d, 0);
    let after = d.rss_kib();
    println!("after they closed: {} MiB", after / 1024);
    assert!(
        after < idle_rss + 10 * 1024,
        "{} MiB after the connections closed, {} MiB before",
        after / 1024,
        idle_rss / 1024
    );
    d.wait_open_count("d", 0);
}

#[test]
fn clients_that_never_read_replies_are_bounded_and_others_go_on() {
    const STUCK: usize = 64;
    let s = Scratch::new("scale-stuck");
    let f = s.sparse("f.img", 64 * MIB);
    let data = pattern(5, (64 * MIB) as usize);
    std::fs::write(&f, &data).expect("image");
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start_with(
        "scale-stuck",
        &["--nbd-listen", &addr, "--nbd-reactors", "2"],
        &[],
    );
    d.create("d", &format!("0 {} linear {} 0", 64 * MIB / 512, f.display()));
    d.create("z", &format!("0 {} zero", 1u64 << 30));
    let idle_rss = d.rss_kib();
    // each sends 256 reads of 1 MiB (256 MiB of replies) and reads nothing
    let stuck: Vec<TcpStream> = (0..STUCK)
        .map(|_| {
            let mut c = attach(&addr, "z");
            let reqs: Vec<u8> = (0..256u64)
                .flat_map(|i| request(0, i, i * MIB, MIB as u32))
                .collect();
            c.write_all(&reqs).expect("requests");
            c
        })
        .collect();
    // another client is served meanwhile, promptly and correctly
    let mut other = attach(&addr, "d");
    let t0 = Instant::now();
    for k in 0..256u64 {
        let off = k * 65536;
        assert_eq!(
            read(&mut other, off, 65536),
            &data[off as usize..off as usize + 65536]
        );
    }
    let took = t0.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let rss = d.rss_kib();
    println!(
        "{STUCK} clients not reading 256 MiB of replies each: {} MiB (idle {} MiB); another client's 256 reads took {took:?}",
        rss / 1024,
        idle_rss / 1024
    );
    // each holds at most its 8 MiB of replies (MAX_HELD_BYTES) plus its buffers
    let bound = idle_rss + (STUCK as u64) * 10 * 1024 + 64 * 1024;
    assert!(rss < bound, "{} MiB, bound {} MiB", rss / 1024, bound / 1024);
    assert!(took < Duration::from_secs(10), "the other client waited {took:?}");
    drop(stuck);
    drop(other);
    wait_connections(&d, 0);
    d.wait_open_count("z", 0);
}

/// `n` clients whose handshakes run at the same moment (as fio's jobs start).
fn attach_together(addr: &str, n: usize) -> Vec<TcpStream> {
    let go = std::sync::Arc::new(std::sync::Barrier::new(n));
    let hs: Vec<_> = (0..n)
        .map(|_| {
            let (addr, go) = (addr.to_string(), go.clone());
            std::thread::spawn(move || {
                go.wait();
                attach(&addr, "d")
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("client")).collect()
}

#[test]
fn connections_are_placed_evenly_as_clients_come_and_go() {
    let s = Scratch::new("scale-place");
    let f = s.sparse("f.img", 8 * MIB);
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start_with(
        "scale-place",
        &["--nbd-listen", &addr, "--nbd-reactors", "3"],
        &[],
    );
    d.create("d", &format!("0 {} linear {} 0", 8 * MIB / 512, f.display()));
    let even = |p: &[u64]| p.iter().max().unwrap_or(&0) - p.iter().min().unwrap_or(&0) <= 1;
    // four clients at once, then gone, ten times over: each time spread
    // over the three reactors (2,1,1 in some order), and every count back
    // to zero after (a closed connection is uncounted)
    for round in 0..10 {
        let c = attach_together(&addr, 4);
        wait_connections(&d, 4);
        let p = per_reactor(&d);
        println!("round {round}: four clients placed {p:?}");
        assert_eq!(p.len(), 3);
        assert_eq!(p.iter().sum::<u64>(), 4, "round {round}: {p:?}");
        assert!(even(&p), "round {round}: four clients placed {p:?}");
        drop(c);
        wait_connections(&d, 0);
        assert_eq!(
            per_reactor(&d),
            [0, 0, 0],
            "round {round}: closed connections still counted"
        );
    }
    // six held (2,2,2); the first three close, whichever reactors they were
    // on; three new clients fill exactly those places
    let mut held = attach_together(&addr, 6);
    wait_connections(&d, 6);
    assert_eq!(per_reactor(&d), [2, 2, 2]);
    held.drain(..3);
    wait_connections(&d, 3);
    let after_close = per_reactor(&d);
    held.extend(attach_together(&addr, 3));
    wait_connections(&d, 6);
    let p = per_reactor(&d);
    println!("six held, three closed: {after_close:?}; three more: {p:?}");
    assert_eq!(after_close.iter().sum::<u64>(), 3);
    assert_eq!(
        p,
        [2, 2, 2],
        "after three of six closed ({after_close:?}), three new ones went to {p:?}"
    );
    drop(held);
    wait_connections(&d, 0);
    assert_eq!(per_reactor(&d), [0, 0, 0]);
}

/// One NBD connection per fio job (writes verified as they go), the jobs moved
/// between the CPUs the way the scheduler might: each connection ends on the
/// reactor pinned to its client's CPU, two on each (the placement that ran the
/// same job at twice the IOPS of the other one, BENCHMARKS.md `repeat`), and
/// follows its client when it moves, its data intact.
#[test]
fn each_fio_job_is_served_on_its_cpu_and_its_connection_follows_it() {
    let s = Scratch::new("scale-cpu");
    let f = s.sparse("f.img", 64 * MIB);
    let d = Daemon::start_with("scale-cpu", &["--nbd-reactors", "2"], &[]);
    d.create("d", &format!("0 {} linear {} 0", 64 * MIB / 512, f.display()));
    common::placement::fio_jobs_follow_their_cpus(&d, &d.uri("d"), None);
}

/// Reactors pinned (two, on two CPUs): a reactor left serving two connections
/// more than the other gives it one, which then serves as before.
#[test]
fn a_reactor_serving_two_more_than_another_gives_it_a_connection() {
    common::placement::two_cpus();
    let s = Scratch::new("scale-even");
    let f = s.sparse("f.img", 8 * MIB);
    std::fs::write(&f, pattern(5, 8 * MIB as usize)).expect("pattern");
    let addr = format!("127.0.0.1:{}", free_port());
    let d = Daemon::start_with("scale-even", &["--nbd-listen", &addr, "--nbd-reactors", "2"], &[]);
    d.create("d", &format!("0 {} linear {} 0", 8 * MIB / 512, f.display()));
    // four clients one at a time, noting where each went
    let mut clients = Vec::new();
    for _ in 0..4 {
        let before = per_reactor(&d);
        let c = attach(&addr, "d");
        wait_connections(&d, clients.len() as u64 + 1);
        let after = per_reactor(&d);
        let on = (0..2).find(|&r| after[r] > before[r]).expect("placed somewhere");
        clients.push((c, on));
    }
    assert_eq!(per_reactor(&d), [2, 2]);
    // the two on reactor 0 leave: 0 and 2
    let (gone, mut kept): (Vec<_>, Vec<_>) = clients.into_iter().partition(|(_, on)| *on == 0);
    drop(gone);
    wait_connections(&d, 2);
    common::placement::wait_server(&d, "reactor 1 gave reactor 0 a connection", |d| {
        per_reactor(d) == [1, 1] && server_list(d, "moved") == [1]
    });
    // both connections still serve, the moved one included
    let want = pattern(5, 8 * MIB as usize);
    for (i, (c, _)) in kept.iter_mut().enumerate() {
        let off = (i as u64 + 1) * MIB;
        assert_eq!(
            read(c, off, 65536),
            want[off as usize..off as usize + 65536],
            "client {i}"
        );
    }
    println!("placed 2,2; two of reactor 0 closed; now {:?}", per_reactor(&d));
    drop(kept);
    wait_connections(&d, 0);
}
