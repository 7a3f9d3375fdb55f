//! Tables on Ceph RBD images (`rbd:POOL/IMAGE:conf=...`), against a real
//! single-node cluster (tests/common/ceph.rs) started once for the test run:
//! linear and striped verified with fio and `rbd export`, a thin pool whose
//! metadata passes the real thin_check and opens in the kernel, a writecache
//! with a local cache over an image, the exclusive lock between two daemons,
//! SIGKILL during writes, and the errors a user sees.

use crate::common;
use crate::oracle;
use common::ceph::cluster;
use common::nbd::{Client, FLUSH, WRITE};
use common::*;

use std::process::Command;
use std::time::{Duration, Instant};

use common::MIB;

fn fio_verify(d: &Daemon, name: &str, size: &str, extra: &[&str]) {
    let out = run(Command::new("fio")
        .arg("--name=verify")
        .arg("--ioengine=nbd")
        .arg(format!("--uri={}", d.uri(name)))
        .args(["--rw=randwrite", "--bs=4k", "--iodepth=32"])
        .arg(format!("--size={size}"))
        .args(["--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0"])
        .args(extra));
    assert!(out.contains("err= 0"), "fio on {name}: {out}");
}

/// Everything `name` serves (nbdcopy to a file).
fn served(d: &Daemon, name: &str) -> Vec<u8> {
    let p = d.dir.path(&format!("{name}.served"));
    run(Command::new("nbdcopy").arg(d.uri(name)).arg(&p));
    std::fs::read(&p).expect("read copy")
}

/// A device made from `table` takes a write and reads it back; then it goes.
fn serves_on(d: &Daemon, table: &str, seed: u64) {
    d.create("serves-on", table);
    let mut cl = Client::connect(&d.sock(), "serves-on");
    cl.write(0, &pattern(seed, 4096));
    assert_eq!(cl.read(0, 4096), pattern(seed, 4096));
    drop(cl);
    d.remove_closed("serves-on");
}

#[test]
fn linear_and_striped_over_images_verify_and_match_rbd_export() {
    need_all(&["fio", "nbdcopy", "rbd"]);
    let c = cluster();
    let d = Daemon::start("rbd-lin");
    c.create_image("lin", 128 * MIB);
    c.create_image("st-a", 64 * MIB);
    c.create_image("st-b", 64 * MIB);
    d.create("lin", &format!("0 {} linear {} 0", 128 * MIB / 512, c.dev("lin")));
    d.create(
        "st",
        &format!(
            "0 {} striped 2 128 {} 0 {} 0",
            128 * MIB / 512,
            c.dev("st-a"),
            c.dev("st-b")
        ),
    );
    let t = d.ok(&["table", "lin"]);
    assert_eq!(
        t.trim(),
        format!("0 262144 linear {} 0", c.dev("lin")),
        "table names the image"
    );
    fio_verify(&d, "lin", "96M", &[]);
    fio_verify(&d, "st", "96M", &["--bsrange=4k-256k", "--fsync=16"]);
    // FUA writes and write-zeroes through the image too
    let mut cl = Client::connect(&d.sock(), "lin");
    let blk = pattern(7, 65536);
    assert_eq!(cl.call(WRITE, common::nbd::FLAG_FUA, 100 * MIB, 65536, &blk), 0);
    assert_eq!(cl.call(common::nbd::WRITE_ZEROES, 0, 101 * MIB, 65536, &[]), 0);
    assert_eq!(cl.call(FLUSH, 0, 0, 0, &[]), 0);
    drop(cl);

    let lin = served(&d, "lin");
    assert_same(
        &c.export("lin", &d.dir.path("lin.rbd")),
        &lin,
        "rbd export of the linear image",
    );
    assert_eq!(&lin[100 * MIB as usize..][..65536], &blk[..]);
    assert!(lin[101 * MIB as usize..][..65536].iter().all(|&b| b == 0));
    // the striped device, put together from its two images
    let st = served(&d, "st");
    let (a, b) = (
        c.export("st-a", &d.dir.path("a.rbd")),
        c.export("st-b", &d.dir.path("b.rbd")),
    );
    let chunk = 128 * 512;
    for (i, piece) in st.chunks(chunk).enumerate() {
        let src = if i % 2 == 0 { &a } else { &b };
        let off = (i / 2) * chunk;
        assert!(
            piece == &src[off..off + chunk],
            "striped chunk {i} differs from its image"
        );
    }
    d.remove_closed("lin");
    d.remove_closed("st");
}

#[test]
fn thin_pool_on_images_passes_thin_check_and_opens_in_the_kernel() {
    need_all(&["thin_check", "rbd"]);
    let c = cluster();
    let d = Daemon::start("rbd-thin");
    const BS: u64 = 128; // 64 KiB blocks
    const POOL: u64 = 256 * BS; // 16 MiB of data
    const THIN: u64 = 128 * BS; // 8 MiB per thin
    c.create_image("tmeta", 8 * MIB);
    c.create_image("tdata", 16 * MIB);
    d.create(
        "pool",
        &format!("0 {POOL} thin-pool {} {} {BS} 0", c.dev("tmeta"), c.dev("tdata")),
    );
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("t0", &format!("0 {THIN} thin /dev/mapper/pool 0"));
    let mut cl = Client::connect(&d.sock(), "t0");
    let mut want0 = vec![0u8; (THIN * 512) as usize];
    let mut rng = Rng(11);
    for i in 0..40 {
        let off = rng.below(THIN * 512 / 4096) * 4096;
        let p = pattern(100 + i, 4096);
        cl.write(off, &p);
        want0[off as usize..][..4096].copy_from_slice(&p);
    }
    assert_eq!(cl.call(FLUSH, 0, 0, 0, &[]), 0);
    // a snapshot, then both written apart
    d.ok(&["suspend", "t0"]);
    d.ok(&["message", "pool", "0", "create_snap 1 0"]);
    d.ok(&["resume", "t0"]);
    d.create("t1", &format!("0 {THIN} thin /dev/mapper/pool 1"));
    let mut want1 = want0.clone();
    let mut c1 = Client::connect(&d.sock(), "t1");
    for i in 0..20 {
        let off = rng.below(THIN * 512 / 4096) * 4096;
        let p = pattern(200 + i, 4096);
        if i % 2 == 0 {
            cl.write(off, &p);
            want0[off as usize..][..4096].copy_from_slice(&p);
        } else {
            c1.write(off, &p);
            want1[off as usize..][..4096].copy_from_slice(&p);
        }
    }
    drop((cl, c1));
    let got0 = served(&d, "t0");
    let got1 = served(&d, "t1");
    assert_same(&got0, &want0, "thin 0 over RBD");
    assert_same(&got1, &want1, "snapshot 1 over RBD");
    d.remove_closed("t0");
    d.remove_closed("t1");
    d.ok(&["remove", "pool"]);

    // the metadata image, exported, passes the real thin_check
    let meta = d.dir.path("meta.exported");
    let data = d.dir.path("data.exported");
    c.export("tmeta", &meta);
    c.export("tdata", &data);
    let o = Command::new("thin_check")
        .arg(&meta)
        .output()
        .expect("thin_check");
    assert!(
        o.status.success(),
        "thin_check on the exported metadata: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    // and the kernel activates the pool over the exported data and reads the same
    let script = format!(
        r#"{}
mk pool "0 {POOL} thin-pool /dev/vda /dev/vdb {BS} 0"
mk t0 "0 {THIN} thin /dev/mapper/pool 0"
mk t1 "0 {THIN} thin /dev/mapper/pool 1"
echo "ORACLE md5-0 $(sum /dev/mapper/t0)"
echo "ORACLE md5-1 $(sum /dev/mapper/t1)"
dmsetup remove t0
dmsetup remove t1
dmsetup remove pool
"#,
        oracle::GUEST_HELPERS
    );
    let serial = oracle::run(&d.dir.0, &script, &[&meta, &data]);
    let m = oracle::markers(&serial);
    assert_eq!(
        oracle::marker(&m, "md5-0"),
        oracle::md5(&want0),
        "kernel reads thin 0"
    );
    assert_eq!(
        oracle::marker(&m, "md5-1"),
        oracle::md5(&want1),
        "kernel reads thin 1"
    );
}

#[test]
fn writecache_with_local_cache_writes_back_to_the_image() {
    need_all(&["fio", "nbdcopy", "rbd"]);
    let c = cluster();
    let d = Daemon::start("rbd-wc");
    c.create_image("wc-origin", 64 * MIB);
    let cache = d.dir.sparse("cache.img", 16 * MIB);
    d.create(
        "wc",
        &format!(
            "0 {} writecache s {} {} 4096 4 high_watermark 50 low_watermark 10",
            64 * MIB / 512,
            c.dev("wc-origin"),
            cache.display()
        ),
    );
    // 48 MiB written through a 16 MiB cache: writeback runs under the watermarks
    fio_verify(&d, "wc", "48M", &[]);
    d.ok(&["message", "wc", "0", "flush"]);
    let st = d.ok(&["status", "wc"]);
    let f: Vec<u64> = st
        .split_whitespace()
        .skip(3)
        .map(|x| x.parse().expect("number"))
        .collect();
    assert!(
        f[0] == 0 && f[2] == f[1] && f[3] == 0,
        "flush left the cache clean: {st}"
    );
    let got = served(&d, "wc");
    d.remove_closed("wc");
    assert_same(
        &c.export("wc-origin", &d.dir.path("origin.rbd")),
        &got,
        "the origin image alone holds the data after flush",
    );
}

#[test]
fn a_second_daemon_is_refused_the_image_until_the_first_lets_go() {
    need("rbd");
    let c = cluster();
    c.create_image("locked", 16 * MIB);
    let table = format!("0 {} linear {} 0", 16 * MIB / 512, c.dev("locked"));
    let first = Daemon::start("rbd-lock1");
    let second = Daemon::start("rbd-lock2");
    first.create("a", &table);
    let mut cl = Client::connect(&first.sock(), "a");
    cl.write(0, &pattern(1, 4096));
    drop(cl);
    let e = second.fails(&["create", "b", "--table", &table]);
    assert!(
        e.contains("rbd:rbd/locked") && e.contains("locked by another client"),
        "refusal names the image and the lock: {e}"
    );
    // the first stops serving it: the second takes over and sees its data
    first.remove_closed("a");
    second.create("b", &table);
    let mut cl = Client::connect(&second.sock(), "b");
    assert_eq!(cl.read(0, 4096), pattern(1, 4096));
    cl.write(4096, &pattern(2, 4096));
    drop(cl);
    second.remove_closed("b");
}

#[test]
fn sigkill_during_writes_keeps_every_flushed_write_on_the_image() {
    need("rbd");
    let c = cluster();
    const BS: u64 = 4096;
    const NB: usize = 1024;
    c.create_image("crash", NB as u64 * BS);
    let mut d = Daemon::start("rbd-kill");
    d.create(
        "k",
        &format!("0 {} linear {} 0", NB as u64 * BS / 512, c.dev("crash")),
    );
    let load = write_until_killed(d.sock(), &["k"], |_| 0, NB, BS, Rng(5), 1000);
    std::thread::sleep(Duration::from_millis(2500));
    d.kill9();
    let log = load.finish();
    assert!(
        log.1 > 25,
        "some flushes completed before the kill ({} writes, {} flushed)",
        log.0.len(),
        log.1
    );
    let mut state = vec![vec![vec![0u8; BS as usize]; NB]];
    let allowed = settle(&mut state, &log, BS);
    let got = c.export("crash", &d.dir.path("crash.rbd"));
    accept(&got, &mut state[0], &allowed[0], BS, "image after SIGKILL");
    // the dead daemon's lock does not keep the image from the next one
    let next = Daemon::start("rbd-kill-next");
    next.create(
        "k",
        &format!("0 {} linear {} 0", NB as u64 * BS / 512, c.dev("crash")),
    );
    let mut cl = Client::connect(&next.sock(), "k");
    assert_eq!(
        cl.read(0, NB * BS as usize),
        got,
        "the next daemon serves what the image holds"
    );
    cl.write(0, &pattern(1, 4096));
    drop(cl);
    next.remove_closed("k");
}

#[test]
fn unreachable_cluster_and_missing_image_fail_in_one_line_and_the_daemon_serves_on() {
    need("rbd");
    let c = cluster();
    let d = Daemon::start("rbd-err");
    // a configuration whose monitor address answers nothing
    let conf = std::fs::read_to_string(&c.conf).expect("conf");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("port");
    let port = dead.local_addr().expect("addr").port();
    drop(dead);
    let bad: String = conf
        .lines()
        .map(|l| {
            if l.starts_with("mon_host") {
                format!("mon_host = v2:127.0.0.1:{port}")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let bad_conf = d.dir.path("unreachable.conf");
    std::fs::write(&bad_conf, bad).expect("write conf");
    let t0 = Instant::now();
    let e = d.fails(&[
        "create",
        "x",
        "--table",
        &format!("0 2048 linear rbd:rbd/any:conf={} 0", bad_conf.display()),
    ]);
    let took = t0.elapsed();
    assert!(e.contains("rbd:rbd/any") && e.contains("unreachable"), "{e}");
    assert!(took < Duration::from_secs(20), "the error took {took:?}");

    let e = d.fails(&[
        "create",
        "y",
        "--table",
        &format!("0 2048 linear {} 0", c.dev("no-such-image")),
    ]);
    assert!(
        e.contains("image 'no-such-image' does not exist in pool 'rbd'"),
        "{e}"
    );
    let e = d.fails(&["create", "z", "--table", "0 2048 linear rbd:nopool/img 0"]);
    assert!(e.contains("rbd:nopool/img"), "{e}");
    let e = d.fails(&["create", "w", "--table", "0 2048 linear rbd:rbd/img:bogus=1 0"]);
    assert!(e.contains("unknown option 'bogus=1'"), "{e}");

    // the daemon serves on, over RBD too
    c.create_image("after-errors", 4 * MIB);
    serves_on(&d, &format!("0 8192 linear {} 0", c.dev("after-errors")), 3);
}

/// librbd is loaded only when a table names an image: a daemon that cannot load
/// it serves files as ever and refuses `rbd:` tables in one line. The library is
/// hidden from the daemon in a mount namespace of its own (root).
#[test]
fn without_librbd_rbd_tables_fail_in_one_line_and_files_still_work() {
    need_all(&["unshare", "ldconfig"]);
    let c = cluster();
    let libs = run(Command::new("ldconfig").arg("-p"));
    let lib = libs
        .lines()
        .find(|l| l.trim_start().starts_with("librbd.so.1 "))
        .and_then(|l| l.rsplit(" => ").next())
        .expect("ldconfig knows librbd.so.1");
    let real = std::fs::canonicalize(lib.trim()).expect("librbd's file");
    let hide = format!("mount --bind /dev/null {} && exec \"$0\" \"$@\"", real.display());
    let d = Daemon::start_wrapped("rbd-nolib", &["unshare", "-m", "sh", "-c", &hide], &[], &[]);
    let e = d.fails(&[
        "create",
        "r",
        "--table",
        &format!("0 2048 linear {} 0", c.dev("any")),
    ]);
    assert!(
        e.contains("rbd:rbd/any")
            && e.contains("librbd.so.1 cannot be loaded")
            && e.contains("install librbd1"),
        "{e}"
    );
    let f = d.dir.sparse("f.img", MIB);
    serves_on(&d, &format!("0 2048 linear {} 0", f.display()), 9);
}

/// Without io_uring (`serve --no-io-uring`) the synchronous queue polls the RBD
/// sink's eventfd with its other waits: the same I/O verifies.
#[test]
fn images_work_without_io_uring() {
    need_all(&["fio", "rbd"]);
    let c = cluster();
    c.create_image("nouring", 32 * MIB);
    let d = Daemon::start_with("rbd-nouring", &["--no-io-uring"], &[]);
    d.create(
        "n",
        &format!("0 {} linear {} 0", 32 * MIB / 512, c.dev("nouring")),
    );
    fio_verify(&d, "n", "24M", &["--bsrange=4k-128k", "--fsync=8"]);
    let mut cl = Client::connect(&d.sock(), "n");
    let blk = pattern(4, 8192);
    assert_eq!(cl.call(WRITE, common::nbd::FLAG_FUA, 0, 8192, &blk), 0);
    drop(cl);
    let got = served(&d, "n");
    assert_eq!(&got[..8192], &blk[..]);
    assert_same(
        &c.export("nouring", &d.dir.path("n.rbd")),
        &got,
        "rbd export without io_uring",
    );
    d.remove_closed("n");
}
