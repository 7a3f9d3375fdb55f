//! The request engine: targets that finish requests later, from other threads,
//! without holding up the connection; suspend never waiting on a queued request;
//! capabilities composed down a stack as clients see them.

use crate::common;

use common::nbd::{reply_ready, Client, FLAG_FUA, READ, TRIM, WRITE};
use common::{pattern, Daemon, Scratch};
use std::time::{Duration, Instant};

use common::MIB;

/// Send every request, then read the replies: the cookies in completion order.
fn completion_order(c: &mut Client, reqs: &[(u64, u16, u64, u32, Vec<u8>)]) -> Vec<u64> {
    for (cookie, cmd, off, len, payload) in reqs {
        c.send(*cmd, 0, *cookie, *off, *len, payload);
    }
    let mut order = Vec::new();
    for _ in reqs {
        // every reply here is a simple one; reads carry their length of data
        let mut h = [0u8; 16];
        use std::io::Read;
        c.s.read_exact(&mut h).expect("reply");
        let err = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        assert_eq!(err, 0, "request {cookie} failed");
        let (_, cmd, _, len, _) = reqs.iter().find(|r| r.0 == cookie).expect("known cookie");
        if *cmd == READ {
            let mut d = vec![0u8; *len as usize];
            c.s.read_exact(&mut d).expect("read data");
        }
        order.push(cookie);
    }
    order
}

/// A thin write that provisions a block (here: copying 64 MiB from an external
/// origin) does not hold up a read of a mapped block sent after it on the same
/// connection: the copy runs on the copy engine's threads, not the connection's.
#[test]
fn provisioning_does_not_delay_reads_on_the_same_connection() {
    let s = Scratch::new("engine-provision");
    let meta = s.sparse("meta", 8 * MIB);
    let data = s.sparse("data", 1024 * MIB);
    // a sparse origin with data where the test looks
    let origin = s.sparse("origin", 256 * MIB);
    let head = pattern(5, 12288);
    {
        use std::os::unix::fs::FileExt;
        let o = std::fs::OpenOptions::new().write(true).open(&origin).unwrap();
        for b in 1..4u64 {
            o.write_all_at(&head, b * 64 * MIB).unwrap();
        }
    }
    let d = Daemon::start("engine-provision");
    // 64 MiB data blocks (131072 sectors), 16 of them
    d.create(
        "pool",
        &format!(
            "0 {} thin-pool {} {} 131072 0",
            1024 * MIB / 512,
            meta.display(),
            data.display()
        ),
    );
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create(
        "t",
        &format!(
            "0 {} thin /dev/mapper/pool 0 {}",
            256 * MIB / 512,
            origin.display()
        ),
    );
    let mut c = Client::connect(&d.sock(), "t");
    let p = pattern(9, 4096);
    c.write(0, &p); // block 0 is provisioned now
    for round in 0..3u64 {
        let block = (round + 1) * 64 * MIB;
        let order = completion_order(
            &mut c,
            &[
                (1, WRITE, block + 4096, 4096, p.clone()),
                (2, READ, 0, 4096, Vec::new()),
            ],
        );
        assert_eq!(
            order,
            [2, 1],
            "round {round}: the read waited for the provisioning write"
        );
        // and the provisioned block holds the write over the origin's data
        let got = c.read(block, 3 * 4096);
        let want = [&head[..4096], &p[..], &head[8192..]].concat();
        assert_eq!(got, want, "round {round}: provisioned block contents");
    }
}

/// A piece queued for data space is requeued when its device suspends, as the
/// kernel does: the suspend returns at once, and the write completes after the
/// pool grows and the device resumes.
#[test]
fn suspend_returns_while_a_request_is_queued_for_space() {
    let s = Scratch::new("engine-nospace");
    let meta = s.sparse("meta", 4 * MIB);
    let data = s.sparse("data", 2 * 65536);
    let d = Daemon::start("engine-nospace");
    let table = |blocks: u64| {
        format!(
            "0 {} thin-pool {} {} 128 0",
            blocks * 128,
            meta.display(),
            data.display()
        )
    };
    d.create("pool", &table(2));
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create("t", "0 8192 thin /dev/mapper/pool 0");
    let mut c = Client::connect(&d.sock(), "t");
    let p = pattern(3, 65536);
    c.write(0, &p);
    c.write(65536, &p);
    // the pool is full: this write waits for space
    let sock = d.sock();
    let writer = std::thread::spawn(move || {
        let mut c = Client::connect(&sock, "t");
        let p = pattern(4, 4096);
        c.call(WRITE, 0, 3 * 65536, 4096, &p)
    });
    std::thread::sleep(Duration::from_millis(300));
    assert!(!writer.is_finished(), "a write to a full pool completed at once");
    let t = Instant::now();
    d.ok(&["suspend", "t"]);
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "suspend took {took:?} with a write queued for space"
    );
    assert!(
        !writer.is_finished(),
        "the queued write completed while suspended"
    );
    // grow the pool, resume: the write goes through
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(8 * 65536)
        .unwrap();
    d.ok(&["load", "pool", "--table", &table(8)]);
    let t = Instant::now();
    d.ok(&["suspend", "pool"]);
    d.ok(&["resume", "pool"]);
    assert!(t.elapsed() < Duration::from_secs(1));
    d.ok(&["resume", "t"]);
    assert_eq!(
        writer.join().unwrap(),
        0,
        "the queued write failed after the pool grew"
    );
    assert_eq!(c.read(3 * 65536, 4096), pattern(4, 4096));
}

/// A FUA request whose device suspends while it is in flight does not complete
/// without its flush (issue 29, item 5). A FUA discard is held by a delay target
/// (400 ms for writes and discards, none for flushes); `suspend --noflush` starts,
/// and the delay target's presuspend sends the discard on at once, so it
/// completes while the device is suspending and its trailing flush is mapped on a
/// suspended device. That flush waits for the resume like any request: the reply
/// does not come while the device is suspended, and the backing file has seen no
/// flush; after the resume the flush reaches the file (`dmkit stats`) and only
/// then does the discard complete.
#[test]
fn a_fua_requests_flush_waits_for_the_resume() {
    let s = Scratch::new("engine-fua-suspend");
    let f = s.sparse("f", 8 * MIB);
    std::fs::write(&f, pattern(2, (8 * MIB) as usize)).unwrap();
    let d = Daemon::start("engine-fua-suspend");
    d.create(
        "dl",
        &format!("0 16384 delay {f} 0 0 {f} 0 400 {f} 0 0", f = f.display()),
    );
    let mut c = Client::connect(&d.sock(), "dl");
    let before = d.flushes("dl", &f);
    c.send(TRIM, FLAG_FUA, 1, 0, 65536, &[]);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !reply_ready(&c, Duration::from_millis(1)),
        "the delayed discard was not held"
    );
    let t = Instant::now();
    d.ok(&["suspend", "dl", "--noflush"]);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "suspend took {:?}",
        t.elapsed()
    );
    assert!(
        !reply_ready(&c, Duration::from_millis(300)),
        "the FUA discard completed while its device was suspended, before its flush"
    );
    assert_eq!(
        d.flushes("dl", &f),
        before,
        "a flush reached the file while the device was suspended"
    );
    d.ok(&["resume", "dl"]);
    assert_eq!(c.reply(None), (1, 0), "the FUA discard failed");
    assert_eq!(
        d.flushes("dl", &f),
        before + 1,
        "the FUA discard's flush did not reach the file"
    );
    assert_eq!(c.read(0, 65536), vec![0u8; 65536], "the discard did not land");
    assert_eq!(
        c.read(65536, 4096),
        pattern(2, (8 * MIB) as usize)[65536..65536 + 4096]
    );
}

/// A discard of a thin's mapped block waits for the I/O already in flight to that
/// block before it unmaps it, also I/O that took the lock-free fast path (which
/// enters the pool device before it looks the block up). A 32 MiB write to a
/// mapped 32 MiB block is sent, then
/// a discard of the same block on the same connection: the write is in flight on
/// the ring's workers for milliseconds, the discard maps in microseconds, so a
/// discard that unmapped at once would reply first. Had it, the block could be
/// freed, committed and handed to another thin while the old write was still on
/// its way to it. After both, the block reads as zeroes (unmapped) and the pool's
/// metadata passes the checker.
#[test]
fn a_discard_waits_for_io_in_flight_to_its_block() {
    const BLOCK: u64 = 32 * MIB;
    let s = Scratch::new("engine-discard");
    let meta = s.sparse("meta", 4 * MIB);
    let data = s.sparse("data", 4 * BLOCK);
    let d = Daemon::start("engine-discard");
    d.create(
        "pool",
        &format!(
            // without passdown: the discard does no I/O of its own that the file
            // system would order after the write
            "0 {} thin-pool {} {} {} 0 1 no_discard_passdown",
            4 * BLOCK / 512,
            meta.display(),
            data.display(),
            BLOCK / 512
        ),
    );
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create("t", &format!("0 {} thin /dev/mapper/pool 0", 2 * BLOCK / 512));
    let mut c = Client::connect(&d.sock(), "t");
    // provisions block 0; a read under the pool lock then caches the mapping,
    // so the write below takes the lock-free fast path
    c.write(0, &pattern(1, 4096));
    assert_eq!(c.read(0, 4096), pattern(1, 4096));
    let order = completion_order(
        &mut c,
        &[
            (1, WRITE, 0, BLOCK as u32, pattern(2, BLOCK as usize)),
            (2, TRIM, 0, BLOCK as u32, Vec::new()),
        ],
    );
    assert_eq!(
        order,
        vec![1, 2],
        "the discard completed before the write in flight to its block"
    );
    assert_eq!(
        c.read(0, 65536),
        vec![0u8; 65536],
        "the discarded block still reads data"
    );
    drop(c);
    d.remove_closed("t");
    d.remove_closed("pool");
    d.ok(&["thin", "check", &meta.display().to_string()]);
}

/// A target that completes requests later from its own thread (delay) does not
/// hold up the connection: a read of the undelayed part of the same device, sent
/// after a held one, completes first; the held one completes from the timer thread.
#[test]
fn a_target_completes_from_another_thread() {
    let s = Scratch::new("engine-delay");
    let f = s.sparse("f", 8 * MIB);
    std::fs::write(&f, pattern(7, (8 * MIB) as usize)).unwrap();
    let d = Daemon::start("engine-delay");
    d.create(
        "dl",
        &format!(
            "0 8192 delay {f} 0 400\n8192 8192 linear {f} 8192",
            f = f.display()
        ),
    );
    let mut c = Client::connect(&d.sock(), "dl");
    let t = Instant::now();
    let order = completion_order(
        &mut c,
        &[
            (1, READ, 0, 4096, Vec::new()),
            (2, READ, 8192 * 512, 4096, Vec::new()),
        ],
    );
    assert_eq!(order, [2, 1], "the undelayed read waited for the delayed one");
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "the delayed read was not held"
    );
    assert_eq!(c.read(0, 4096), pattern(7, (8 * MIB) as usize)[..4096]);
}

/// Capabilities compose down a stack into what clients see (nbdinfo): `error`
/// under `linear` takes discards (the kernel's io_err_io_hints) but cannot zero
/// natively; a thin device offers its pool's block size as the preferred block
/// size; a device stacked on a read-only device is a read-only export and refuses
/// writes. A read-only pool's thins stay writable exports, as in the kernel (its
/// read-only mode still writes mapped, unshared blocks; only provisioning fails).
#[test]
fn capabilities_of_a_stack_appear_in_nbdinfo() {
    common::need("nbdinfo");
    let s = Scratch::new("engine-caps");
    let meta = s.sparse("meta", 4 * MIB);
    let data = s.sparse("data", 64 * MIB);
    let f = s.sparse("f", 4 * MIB);
    let d = Daemon::start("engine-caps");
    d.create("err", "0 2048 error");
    d.create("over-err", "0 2048 linear /dev/mapper/err 0");
    d.ok(&[
        "create",
        "ro",
        "--readonly",
        "--table",
        &format!("0 2048 linear {} 0", f.display()),
    ]);
    d.create("over-ro", "0 2048 linear /dev/mapper/ro 0");
    let pool = |features: &str| {
        format!(
            "0 {} thin-pool {} {} 128 0{features}",
            64 * MIB / 512,
            meta.display(),
            data.display()
        )
    };
    d.create("pool", &pool(""));
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create("t", "0 8192 thin /dev/mapper/pool 0");
    let info = |n: &str| common::run(std::process::Command::new("nbdinfo").arg(d.uri(n)));
    let has = |out: &str, line: &str| out.lines().any(|l| l.trim() == line);

    let out = info("over-err");
    for want in [
        "can_trim: true",
        "can_fast_zero: false",
        "is_read_only: false",
        "can_multi_conn: true",
    ] {
        assert!(has(&out, want), "error under linear: no '{want}' in\n{out}");
    }
    let out = info("over-ro");
    for want in ["is_read_only: true", "can_trim: false", "can_zero: false"] {
        assert!(
            has(&out, want),
            "linear over a read-only device: no '{want}' in\n{out}"
        );
    }
    let mut c = Client::connect(&d.sock(), "over-ro");
    assert_eq!(
        c.call(WRITE, 0, 0, 4096, &pattern(1, 4096)),
        1,
        "a write to a read-only export: EPERM"
    );
    let out = info("t");
    for want in [
        "block_size_preferred: 65536",
        "can_trim: true",
        "can_fua: true",
        "is_read_only: false",
    ] {
        assert!(has(&out, want), "thin: no '{want}' in\n{out}");
    }
    let mut c = Client::connect(&d.sock(), "t");
    c.write(0, &pattern(2, 4096));
    // the pool goes read-only: the thin stays a writable export, as in the kernel
    d.reload("pool", &pool(" 1 read_only"));
    let out = info("t");
    assert!(
        has(&out, "is_read_only: false"),
        "thin on a read-only pool:\n{out}"
    );
    assert_eq!(
        c.call(WRITE, 0, 0, 4096, &pattern(3, 4096)),
        0,
        "a mapped block stays writable"
    );
    assert_eq!(
        c.call(WRITE, 0, 65536, 4096, &pattern(3, 4096)),
        5,
        "provisioning fails: EIO"
    );
}

/// Files on a memory filesystem are read and written inline (small I/O) or
/// through io_uring (large): fio's mixed sizes across that line, reads and
/// writes with flushes, verify through a striped device over two /dev/shm
/// files, then a second pass verifies what the first wrote.
#[test]
fn memory_filesystem_io_verifies() {
    mem_io_verifies("mem-io", &[]);
}

/// The same without io_uring (containers often forbid it): the synchronous queue
/// runs every operation, and the connection's readiness poll is a plain poll(2).
#[test]
fn memory_filesystem_io_verifies_without_io_uring() {
    mem_io_verifies("mem-io-sync", &["--no-io-uring"]);
}

fn mem_io_verifies(tag: &str, serve_args: &[&str]) {
    common::need("fio");
    struct Dir(std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let dir = Dir(std::path::PathBuf::from(format!(
        "/dev/shm/dmkit-test-{tag}-{}",
        std::process::id()
    )));
    std::fs::create_dir_all(&dir.0).expect("mkdir in /dev/shm");
    let d = Daemon::start_with(tag, serve_args, &[]);
    let files: Vec<_> = ["a", "b"]
        .iter()
        .map(|n| {
            let p = dir.0.join(n);
            std::fs::File::create(&p)
                .and_then(|f| f.set_len(32 * MIB))
                .expect("file");
            p
        })
        .collect();
    d.create(
        "st",
        &format!(
            "0 {} striped 2 256 {} 0 {} 0",
            64 * MIB / 512,
            files[0].display(),
            files[1].display()
        ),
    );
    let fio = |verify_only: bool| {
        let mut c = std::process::Command::new("fio");
        c.args([
            "--name=mem",
            "--ioengine=nbd",
            &format!("--uri={}", d.uri("st")),
            "--rw=randwrite",
            "--bsrange=4k-256k",
            "--iodepth=16",
            "--size=64M",
            "--fsync=32",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--randseed=7",
        ]);
        if verify_only {
            c.arg("--verify_only=1");
        }
        common::run(&mut c)
    };
    fio(false);
    fio(true);
    let mut c = Client::connect(&d.sock(), "st");
    let data = pattern(5, 3 * 65536 + 4096);
    c.write(MIB + 512, &data);
    assert!(
        c.read(MIB + 512, data.len()) == data,
        "unaligned write across stripes"
    );
}
