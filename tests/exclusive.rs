//! The daemon holds the files its tables name exclusively, as the kernel's
//! dm_get_device does: a tool that writes a live pool's metadata or data is
//! refused with EBUSY naming the device and process that hold it (and works once
//! the pool is gone), a second daemon is refused the same way until the first
//! lets go, tables of one daemon share a file, read-only tools still read a live
//! pool's metadata, and relative paths in a table are the caller's.

use crate::common;

use common::nbd::Client;
use common::{assert_same, image, pattern, read_all, Daemon, Scratch, BIN};
use std::path::Path;
use std::process::{Command, Output};

use common::MIB;

fn tool(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("run dmkit")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// The one line a refused tool prints, and its exit status 64.
fn refused(args: &[&str], path: &Path, device: &str, pid: u32) {
    let o = tool(args);
    assert_eq!(o.status.code(), Some(64), "{args:?}: {o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        err,
        format!(
            "{}: Device or resource busy (EBUSY): held by dmkit device '{device}', process {pid} (dmkit)\n",
            path.display()
        ),
        "{args:?}"
    );
}

fn ok(args: &[&str]) -> String {
    let o = tool(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn pool_table(meta: &Path, data: &Path) -> String {
    format!(
        "0 {} thin-pool {} {} 128 0",
        16 * MIB / 512,
        meta.display(),
        data.display()
    )
}

#[test]
fn writing_tools_are_refused_on_a_live_pools_files() {
    let d = Daemon::start("excl-tools");
    let meta = image(&d.dir, "meta.img", 4 * MIB, None);
    let data = image(&d.dir, "data.img", 16 * MIB, None);
    d.create("pool", &pool_table(&meta, &data));
    d.ok(&["message", "pool", "0", "create_thin 0"]);
    d.create("thin", &format!("0 {} thin /dev/mapper/pool 0", 8 * MIB / 512));
    let mut c = Client::connect(&d.sock(), "thin");
    c.write(0, &pattern(3, MIB as usize));
    drop(c);
    d.wait_open_count("thin", 0);
    // read-only tools work on the live pool's metadata, as 1.x's do (the check
    // before the metadata snapshot: dmkit's checker miscounts a held root)
    ok(&["thin", "check", s(&meta)]);
    let xml = d.dir.path("pool.xml");
    let out = ok(&["thin", "dump", s(&meta)]);
    assert!(out.contains("nr_data_blocks=\"256\""), "{out}");
    std::fs::write(&xml, &out).expect("xml");
    d.ok(&["message", "pool", "0", "reserve_metadata_snap"]);
    let snap = ok(&["thin", "dump", "-m", s(&meta)]);
    assert!(
        snap.contains("<range_mapping origin_begin=\"0\" data_begin=\"0\" length=\"16\""),
        "{snap}"
    );
    let copy = d.dir.path("copy.img");
    std::fs::copy(&meta, &copy).expect("copy");

    let pid = d.pid();
    refused(
        &["thin", "restore", "-i", s(&xml), "-o", s(&meta)],
        &meta,
        "pool",
        pid,
    );
    refused(
        &["thin", "repair", "-i", s(&copy), "-o", s(&meta)],
        &meta,
        "pool",
        pid,
    );
    refused(
        &["thin", "check", "--clear-needs-check-flag", s(&meta)],
        &meta,
        "pool",
        pid,
    );
    refused(&["thin", "check", "--auto-repair", s(&meta)], &meta, "pool", pid);
    refused(
        &["thin", "trim", "--metadata-dev", s(&meta), "--data-dev", s(&data)],
        &meta,
        "pool",
        pid,
    );
    // the multi-call names go the same way
    let link = d.dir.path("thin_restore");
    std::os::unix::fs::symlink(BIN, &link).expect("link");
    let o = Command::new(&link)
        .args(["-i", s(&xml), "-o", s(&meta)])
        .output()
        .expect("thin_restore");
    assert_eq!(o.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&o.stderr).contains("held by dmkit device 'pool'"));

    // the pool's data is still what was written
    let mut c = Client::connect(&d.sock(), "thin");
    assert_same(&c.read(0, MIB as usize), &pattern(3, MIB as usize), "thin");
    drop(c);
    d.wait_open_count("thin", 0);

    // once the pool is gone, every one of them runs
    d.ok(&["message", "pool", "0", "release_metadata_snap"]);
    d.ok(&["remove", "thin"]);
    d.ok(&["remove", "pool"]);
    ok(&["thin", "check", "--clear-needs-check-flag", s(&meta)]);
    ok(&["thin", "trim", "--metadata-dev", s(&meta), "--data-dev", s(&data)]);
    ok(&["thin", "repair", "-i", s(&copy), "-o", s(&meta)]);
    ok(&["thin", "restore", "-i", s(&xml), "-o", s(&meta)]);
    ok(&["thin", "check", s(&meta)]);
}

#[test]
fn a_second_daemon_is_refused_until_the_first_lets_go() {
    let a = Daemon::start("excl-a");
    let b = Daemon::start("excl-b");
    let meta = image(&a.dir, "meta.img", 4 * MIB, None);
    let data = image(&a.dir, "data.img", 16 * MIB, Some(5));
    // two tables of one daemon share a file, as two kernel tables may
    a.create("pool", &pool_table(&meta, &data));
    a.create(
        "raw",
        &format!("0 {} linear {} 0", 16 * MIB / 512, data.display()),
    );

    let table = pool_table(&meta, &data);
    let err = b.fails(&["create", "p2", "--table", &table]);
    assert!(
        err.contains(&format!(
            "{}: Device or resource busy (EBUSY): held by dmkit device 'pool', process {} (dmkit)",
            meta.display(),
            a.pid()
        )),
        "{err}"
    );
    let lin = format!("0 8 linear {} 0", data.display());
    let err = b.fails(&["create", "l2", "--table", &lin]);
    assert!(err.contains("held by dmkit device 'pool'"), "{err}");
    assert_eq!(b.ok(&["ls"]), "No devices found\n");

    a.ok(&["remove", "pool"]);
    // the data file is still in a table of the first daemon
    let err = b.fails(&["create", "l2", "--table", &lin]);
    assert!(
        err.contains(&format!(
            "held by dmkit device 'raw', process {} (dmkit)",
            a.pid()
        )),
        "{err}"
    );
    a.ok(&["remove", "raw"]);
    b.ok(&["create", "p2", "--table", &table]);
    b.ok(&["create", "l2", "--table", &lin]);
    let err = a.fails(&["create", "pool", "--table", &table]);
    assert!(
        err.contains(&format!("held by dmkit device 'p2', process {} (dmkit)", b.pid())),
        "{err}"
    );
}

#[test]
fn relative_paths_resolve_in_the_callers_directory() {
    let d = Daemon::start("relative");
    let s1 = Scratch::new("relative-caller");
    let disk = image(&s1, "disk.img", MIB, Some(11));
    let sub = s1.path("sub");
    std::fs::create_dir_all(&sub).expect("sub");
    image(&s1, "sub/disk.img", MIB, Some(12));
    let cli = |dir: &Path, args: &[&str]| {
        let o = Command::new(BIN)
            .current_dir(dir)
            .arg("--run-dir")
            .arg(&d.run)
            .args(args)
            .output()
            .expect("dmkit");
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let t = format!("0 {} linear disk.img 0", MIB / 512);
    cli(&s1.0, &["create", "rel", "--table", &t]);
    assert_eq!(
        d.ok(&["table", "rel"]),
        format!("0 {} linear {} 0\n", MIB / 512, disk.display())
    );
    let mut c = Client::connect(&d.sock(), "rel");
    assert_same(&read_all(&mut c, MIB), &pattern(11, MIB as usize), "rel");
    drop(c);
    d.wait_open_count("rel", 0);
    // `load` from another directory names another file; `./` is dropped
    cli(
        &sub,
        &[
            "load",
            "rel",
            "--table",
            &format!("0 {} linear ./disk.img 0", MIB / 512),
        ],
    );
    d.ok(&["resume", "rel"]);
    assert_eq!(
        d.ok(&["table", "rel"]),
        format!("0 {} linear {}/disk.img 0\n", MIB / 512, sub.display())
    );
    let mut c = Client::connect(&d.sock(), "rel");
    assert_same(
        &read_all(&mut c, MIB),
        &pattern(12, MIB as usize),
        "rel after load",
    );
}
