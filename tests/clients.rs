//! Real NBD clients against the real daemon: nbdinfo, qemu-img, nbdcopy, fio.

use crate::common;
use common::{need, pattern, read_at, run, Daemon};
use std::process::Command;

use common::MIB;

#[test]
fn nbdinfo_lists_and_maps() {
    need("nbdinfo");
    let d = Daemon::start("nbdinfo");
    let f = d.dir.sparse("f.img", 64 * MIB);
    // 1 MiB of data at 8 MiB, the rest of the file a hole.
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new().write(true).open(&f).expect("open");
        file.write_all_at(&pattern(1, MIB as usize), 8 * MIB)
            .expect("write");
        file.sync_all().expect("sync");
    }
    let a = d.dir.sparse("a.img", 8 * MIB);
    let b = d.dir.sparse("b.img", 8 * MIB);
    d.create("zero", "0 32768 zero");
    d.create("lin", &format!("0 32768 linear {} 0", f.display()));
    d.create(
        "str",
        &format!("0 32768 striped 2 8 {} 0 {} 0", a.display(), b.display()),
    );

    let list = run(Command::new("nbdinfo").arg("--list").arg(d.uri("")));
    for name in ["zero", "lin", "str"] {
        assert!(list.contains(&format!("export=\"{name}\":")), "{list}");
    }
    assert!(list.contains("export-size: 16777216"), "{list}");

    let map = |name: &str| run(Command::new("nbdinfo").arg("--map").arg(d.uri(name)));
    let norm = |s: String| s.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(norm(map("zero")), "0 16777216 3 hole,zero");
    assert_eq!(
        norm(map("lin")),
        "0 8388608 3 hole,zero 8388608 1048576 0 data 9437184 7340032 3 hole,zero"
    );
    // Nothing written on the striped device yet: all holes.
    assert_eq!(norm(map("str")), "0 16777216 3 hole,zero");
    // 4 KiB written at device offset 8 KiB: chunk 2, stripe 0, row 1 of file a.
    let mut c = common::nbd::Client::connect(&d.sock(), "str");
    c.write(8192, &pattern(2, 4096));
    assert_eq!(
        norm(map("str")),
        "0 8192 3 hole,zero 8192 4096 0 data 12288 16764928 3 hole,zero"
    );
    assert!(read_at(&a, 4096, 4096) == pattern(2, 4096));
}

#[test]
fn qemu_img_convert_in_and_out() {
    need("qemu-img");
    let d = Daemon::start("qemu");
    let a = d.dir.sparse("a.img", 32 * MIB);
    let b = d.dir.sparse("b.img", 32 * MIB);
    d.create(
        "str",
        &format!("0 131072 striped 2 128 {} 0 {} 0", a.display(), b.display()),
    );
    d.create("top", "0 131072 linear /dev/mapper/str 0");
    let src = d.dir.path("src.img");
    let mut data = pattern(7, (40 * MIB) as usize);
    data[(8 * MIB) as usize..(16 * MIB) as usize].fill(0); // a zero run qemu can skip
    data.resize((64 * MIB) as usize, 0);
    std::fs::write(&src, &data).expect("write src");
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(d.uri("top")));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(d.uri("top")));
    let out = d.dir.path("out.img");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(d.uri("top"))
        .arg(&out));
    assert!(
        std::fs::read(&out).expect("read out") == data,
        "qemu-img read back different data"
    );
}

#[test]
fn nbdcopy_round_trip_between_devices() {
    need("nbdcopy");
    let d = Daemon::start("nbdcopy");
    let f = d.dir.sparse("f.img", 48 * MIB);
    let g = d.dir.sparse("g.img", 48 * MIB);
    d.create("one", &format!("0 98304 linear {} 0", f.display()));
    d.create(
        "two",
        // Two segments, the halves swapped in the file.
        &format!(
            "0 49152 linear {g} 49152\n49152 49152 linear {g} 0",
            g = g.display()
        ),
    );
    let src = d.dir.path("src.bin");
    let data = pattern(3, (48 * MIB) as usize);
    std::fs::write(&src, &data).expect("write");
    run(Command::new("nbdcopy").arg(&src).arg(d.uri("one")));
    run(Command::new("nbdcopy").arg(d.uri("one")).arg(d.uri("two")));
    let back = d.dir.path("back.bin");
    run(Command::new("nbdcopy").arg(d.uri("two")).arg(&back));
    let got = std::fs::read(&back).expect("read back");
    assert_eq!(got.len(), data.len());
    assert!(got == data, "nbdcopy data mismatch");
    let half = data.len() / 2;
    assert!(
        read_at(&g, 0, 4096) == data[half..half + 4096],
        "second half not at the file's start"
    );
    assert!(
        read_at(&g, half as u64, 4096) == data[..4096],
        "first half not at the file's middle"
    );
    assert!(read_at(&f, 0, 4096) == data[..4096]);
}

fn fio_verify(d: &Daemon, name: &str, jobs: u32, extra: &[&str]) {
    let out = run(Command::new("fio")
        .arg("--name=verify")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={}", d.uri(name)))
        .args([
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=16M",
            "--offset_increment=16M",
        ])
        .arg(format!("--numjobs={jobs}"))
        .args([
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--group_reporting",
        ])
        .args(extra));
    assert!(out.contains("err= 0"), "fio on {name}: {out}");
}

#[test]
fn fio_verify_linear_and_striped_several_jobs() {
    need("fio");
    let d = Daemon::start("fio");
    let a = d.dir.sparse("a.img", 32 * MIB);
    let b = d.dir.sparse("b.img", 32 * MIB);
    let c = d.dir.sparse("c.img", 64 * MIB);
    d.create(
        "str",
        &format!("0 131072 striped 2 16 {} 0 {} 0", a.display(), b.display()),
    );
    d.create("lin", &format!("0 131072 linear {} 0", c.display()));
    fio_verify(&d, "lin", 4, &[]);
    fio_verify(&d, "str", 4, &["--bs=4k,64k", "--bsrange=4k-256k"]);
    // Mixed sizes with flushes in between.
    fio_verify(&d, "lin", 2, &["--bsrange=512-128k", "--fsync=8"]);
}

#[test]
fn stacked_writes_land_where_the_tables_put_them() {
    let d = Daemon::start("stack");
    let a = d.dir.sparse("a.img", 4 * MIB);
    let b = d.dir.sparse("b.img", 4 * MIB);
    // striped: 2 stripes of chunk 8 sectors (4 KiB), each stripe starting 1 MiB in.
    d.create(
        "str",
        &format!("0 8192 striped 2 8 {} 2048 {} 2048", a.display(), b.display()),
    );
    // linear over the striped device, from its sector 16 on; then a top linear.
    d.create("mid", "0 4096 linear /dev/mapper/str 16");
    d.create(
        "top",
        "0 2048 linear /dev/mapper/mid 1024\n2048 2048 linear /dev/mapper/mid 0",
    );
    let mut c = common::nbd::Client::connect(&d.sock(), "top");
    assert_eq!(c.size, 4096 * 512);
    // 16 KiB at top sector 2048 → mid sector 0 → str sector 16 (chunk 2 = stripe 0 row 1)
    let data = pattern(11, 16 << 10);
    c.write(2048 * 512, &data);
    // str chunks 2,3,4,5 → stripe 0 row 1, stripe 1 row 1, stripe 0 row 2, stripe 1 row 2.
    let row = |r: u64| (2048 + r * 8) * 512;
    assert!(read_at(&a, row(1), 4096) == data[0..4096]);
    assert!(read_at(&b, row(1), 4096) == data[4096..8192]);
    assert!(read_at(&a, row(2), 4096) == data[8192..12288]);
    assert!(read_at(&b, row(2), 4096) == data[12288..16384]);
    // And it reads back through every layer.
    assert!(c.read(2048 * 512, 16 << 10) == data);
    let mut m = common::nbd::Client::connect(&d.sock(), "mid");
    assert!(m.read(0, 16 << 10) == data);
}

#[test]
fn demo_over_unix_and_tcp() {
    need("nbdinfo");
    let port = 20000 + (std::process::id() % 20000);
    let demo_dir = common::Scratch::new("demo-files");
    let addr = format!("127.0.0.1:{port}");
    let d = Daemon::start_with(
        "demo",
        &[
            "--demo-dir",
            demo_dir.0.to_str().expect("utf8"),
            "--nbd-listen",
            &addr,
        ],
        &[],
    );
    // The demo devices appear right after start (the sockets exist before them).
    let t0 = std::time::Instant::now();
    while !d.ok(&["ls"]).contains("demo-zero") {
        assert!(t0.elapsed().as_secs() < 10, "demo devices did not appear");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(d.ok(&["table", "demo-thin"]), "0 2097152 thin 511:0 0\n");
    assert_eq!(d.ok(&["table", "demo-snap"]), "0 2097152 thin 511:0 1\n");
    let pool = d.ok(&["status", "demo-pool"]);
    assert!(
        pool.contains(" 0/65536 - rw discard_passdown queue_if_no_space - "),
        "{pool}"
    );
    let size = run(Command::new("nbdinfo")
        .arg("--size")
        .arg(format!("nbd://{addr}/demo-thin")));
    assert_eq!(size.trim(), "1073741824");
    let size = run(Command::new("nbdinfo").arg("--size").arg(d.uri("demo-snap")));
    assert_eq!(size.trim(), "1073741824");
    // A fresh thin is all holes.
    let map = run(Command::new("nbdinfo").arg("--map").arg(d.uri("demo-thin")));
    assert_eq!(
        map.split_whitespace().collect::<Vec<_>>(),
        ["0", "1073741824", "3", "hole,zero"]
    );
    // Sockets are private to the owner without --group.
    use std::os::unix::fs::PermissionsExt;
    for s in ["control.sock", "nbd.sock", "dm-ioctl.sock"] {
        let mode = std::fs::metadata(d.run.join(s))
            .expect("stat")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{s}");
    }
    assert!(demo_dir.path("pool-meta.img").exists() && demo_dir.path("pool-data.img").exists());
}

#[test]
fn stalled_handshake_is_dropped_but_idle_clients_stay() {
    use std::io::Read;
    let d = Daemon::start_with("idle", &["--nbd-handshake-timeout-ms", "300"], &[]);
    let f = d.dir.sparse("f.img", MIB);
    d.create("lin", &format!("0 2048 linear {} 0", f.display()));
    let mut attached = common::nbd::Client::connect(&d.sock(), "lin");
    // A client that reads the greeting and then says nothing is hung up on.
    let mut stalled = std::os::unix::net::UnixStream::connect(d.sock()).expect("connect");
    stalled
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .expect("timeout");
    let mut greeting = [0u8; 18];
    stalled.read_exact(&mut greeting).expect("greeting");
    let mut rest = [0u8; 1];
    assert_eq!(stalled.read(&mut rest).expect("EOF, not a timeout"), 0);
    // The attached client idled past the handshake deadline and still works.
    std::thread::sleep(std::time::Duration::from_millis(800));
    attached.write(4096, &pattern(5, 4096));
    assert!(attached.read(4096, 4096) == pattern(5, 4096));
}

/// A client that trickles its handshake (a byte every 100 ms, each read well
/// within the socket's timeout) is hung up on once the whole handshake's
/// deadline has passed, so such clients cannot hold the bounded handshakes for
/// ever; a client that then handshakes normally is served.
#[test]
fn trickled_handshake_is_dropped_at_its_deadline() {
    use std::io::{Read, Write};
    let d = Daemon::start_with("trickle", &["--nbd-handshake-timeout-ms", "400"], &[]);
    let f = d.dir.sparse("f.img", MIB);
    d.create("lin", &format!("0 2048 linear {} 0", f.display()));
    let mut s = std::os::unix::net::UnixStream::connect(d.sock()).expect("connect");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    // client flags, then NBD_OPT_GO with 4,000 bytes of data that never all
    // come, a byte at a time
    let bytes: Vec<u8> = [0u8, 0, 0, 3]
        .into_iter()
        .chain(*b"IHAVEOPT")
        .chain(7u32.to_be_bytes())
        .chain(4000u32.to_be_bytes())
        .chain([0u8; 64])
        .collect();
    let t0 = std::time::Instant::now();
    let mut closed = false;
    for b in bytes {
        if s.write_all(&[b]).is_err() {
            closed = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        s.set_nonblocking(true).expect("nonblocking");
        let mut one = [0u8; 1];
        let r = s.read(&mut one);
        s.set_nonblocking(false).expect("blocking");
        if matches!(r, Ok(0)) {
            closed = true;
            break;
        }
    }
    let took = t0.elapsed();
    assert!(closed, "a trickling handshake was kept open for {took:?}");
    assert!(
        took < std::time::Duration::from_secs(3),
        "hung up only after {took:?}"
    );
    let mut c = common::nbd::Client::connect(&d.sock(), "lin");
    c.write(0, &pattern(7, 4096));
    assert_eq!(c.read(0, 4096), pattern(7, 4096));
}

/// Used data blocks of a pool, from its status line.
fn pool_used_data(d: &Daemon, pool: &str) -> u64 {
    let st = d.ok(&["status", pool]);
    let used = st
        .split_whitespace()
        .nth(5)
        .and_then(|f| f.split('/').next())
        .unwrap_or("");
    used.parse().unwrap_or_else(|_| panic!("no used data in '{st}'"))
}

#[test]
fn copies_between_thins_stay_thin() {
    need("nbdcopy");
    need("qemu-img");
    let d = Daemon::start("thincopy");
    let meta = d.dir.sparse("meta.img", 16 * MIB);
    let data = d.dir.sparse("data.img", 512 * MIB);
    d.create(
        "pool",
        &format!("0 1048576 thin-pool {} {} 128 0", meta.display(), data.display()),
    );
    for id in 0..3 {
        d.ok(&["message", "pool", "0", "create_thin", &id.to_string()]);
        d.create(&format!("t{id}"), &format!("0 262144 thin /dev/mapper/pool {id}"));
    }
    // 1 MiB of data in a 128 MiB thin: 16 blocks of 64 KiB.
    let mut c = common::nbd::Client::connect(&d.sock(), "t0");
    c.write(10 * MIB, &pattern(21, MIB as usize));
    drop(c);
    assert_eq!(pool_used_data(&d, "pool"), 16);
    let map = run(Command::new("nbdinfo").arg("--map").arg(d.uri("t0")));
    let norm = map.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(
        norm,
        "0 10485760 3 hole,zero 10485760 1048576 0 data 11534336 122683392 3 hole,zero"
    );
    // nbdcopy reads the holes as zero extents and skips them: 16 more blocks, not 2048.
    run(Command::new("nbdcopy").arg(d.uri("t0")).arg(d.uri("t1")));
    assert_eq!(pool_used_data(&d, "pool"), 32);
    // qemu-img convert onto a thin it is told is zero skips them as well.
    run(Command::new("qemu-img")
        .args(["convert", "-n", "--target-is-zero", "-f", "raw", "-O", "raw"])
        .arg(d.uri("t0"))
        .arg(d.uri("t2")));
    assert_eq!(pool_used_data(&d, "pool"), 48);
    for t in ["t1", "t2"] {
        assert_eq!(d.ok(&["status", t]), "0 262144 thin 2048 22527\n", "{t}");
        let mut c = common::nbd::Client::connect(&d.sock(), t);
        assert!(
            c.read(10 * MIB, MIB as usize) == pattern(21, MIB as usize),
            "{t} data"
        );
        assert!(c.read(0, 4096).iter().all(|&b| b == 0), "{t} hole");
    }
}
