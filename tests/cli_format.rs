//! dmsetup-compatible output and errors, through the real CLI and daemon.

use crate::common;
use common::Daemon;

#[test]
fn table_status_info_ls_for_every_target() {
    let d = Daemon::start("fmt");
    let a = d.dir.sparse("a.img", 16 << 20);
    let b = d.dir.sparse("b.img", 16 << 20);
    let (a, b) = (a.display().to_string(), b.display().to_string());
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
    d.create(
        "lin",
        &format!("0 2048 linear {a} 0\n2048 2048 linear {b} 2048\n"),
    );
    d.create("str", &format!("0 8192 striped 2 64 {a} 4096 {b} 4096"));
    d.create("zer", "0 1000 zero");
    d.create("err", "0 1000 error");
    d.create("fla", &format!("0 2048 flakey {a} 0 30 0"));
    d.create("fl2", &format!("0 2048 flakey {a} 0 1 1 1 drop_writes"));
    d.create(
        "fl3",
        &format!("0 2048 flakey {a} 0 1 1 5 corrupt_bio_byte 32 r 1 0"),
    );
    d.create("dl1", &format!("0 2048 delay {a} 0 10"));
    d.create("dl3", &format!("0 2048 delay {a} 0 10 {b} 0 20 {b} 100 0"));
    d.create("stk", "0 4096 linear /dev/mapper/lin 0");

    assert_eq!(
        d.ok(&["table", "lin"]),
        format!("0 2048 linear {a} 0\n2048 2048 linear {b} 2048\n")
    );
    assert_eq!(d.ok(&["status", "lin"]), "0 2048 linear \n2048 2048 linear \n");
    assert_eq!(
        d.ok(&["table", "str"]),
        format!("0 8192 striped 2 64 {a} 4096 {b} 4096\n")
    );
    assert_eq!(
        d.ok(&["status", "str"]),
        format!("0 8192 striped 2 {a} {b} 1 AA\n")
    );
    assert_eq!(d.ok(&["table", "zer"]), "0 1000 zero \n");
    assert_eq!(d.ok(&["status", "zer"]), "0 1000 zero \n");
    assert_eq!(d.ok(&["table", "err"]), "0 1000 error \n");
    // No features: both error_reads and error_writes are implied and printed.
    assert_eq!(
        d.ok(&["table", "fla"]),
        format!("0 2048 flakey {a} 0 30 0 2 error_reads error_writes\n")
    );
    assert_eq!(d.ok(&["status", "fla"]), "0 2048 flakey \n");
    assert_eq!(
        d.ok(&["table", "fl2"]),
        format!("0 2048 flakey {a} 0 1 1 1 drop_writes\n")
    );
    assert_eq!(
        d.ok(&["table", "fl3"]),
        format!("0 2048 flakey {a} 0 1 1 5 corrupt_bio_byte 32 r 1 0\n")
    );
    assert_eq!(d.ok(&["table", "dl1"]), format!("0 2048 delay {a} 0 10\n"));
    assert_eq!(
        d.ok(&["table", "dl3"]),
        format!("0 2048 delay {a} 0 10 {b} 0 20 {b} 100 0\n")
    );
    assert_eq!(d.ok(&["status", "dl3"]), "0 2048 delay 0 0 0\n");
    // A dmkit device in a table prints as major:minor (511:minor of "lin").
    assert_eq!(d.ok(&["table", "stk"]), "0 4096 linear 511:0 0\n");

    // Listing every device prefixes lines with the name; --target filters.
    let all = d.ok(&["table"]);
    assert!(all.contains("zer: 0 1000 zero \n"), "{all}");
    assert!(
        all.contains(&format!("str: 0 8192 striped 2 64 {a} 4096 {b} 4096\n")),
        "{all}"
    );
    assert_eq!(d.ok(&["status", "--target", "zero"]), "zer: 0 1000 zero \n");

    let ls = d.ok(&["ls"]);
    assert!(
        ls.contains("lin\t(511:0)\n") && ls.contains("str\t(511:1)\n") && ls.contains("stk\t(511:9)\n"),
        "{ls}"
    );

    let info = d.ok(&["info", "stk"]);
    assert_eq!(
        info,
        "Name:              stk\nState:             ACTIVE\nRead Ahead:        256\n\
         Tables present:    LIVE\nOpen count:        0\nEvent number:      0\n\
         Major, minor:      511, 9\nNumber of targets: 1\n\n"
    );
    // "lin" is held by the table of "stk": counted as open, as the kernel counts it.
    assert!(d.ok(&["info", "lin"]).contains(
        "Open count:        1\nEvent number:      0\nMajor, minor:      511, 0\nNumber of targets: 2\n"
    ));

    d.ok(&["suspend", "zer"]);
    assert!(d.ok(&["info", "zer"]).contains("State:             SUSPENDED\n"));
    d.ok(&["resume", "zer"]);
    d.ok(&["load", "zer", "--table", "0 500 zero"]);
    assert!(d
        .ok(&["info", "zer"])
        .contains("Tables present:    LIVE & INACTIVE\n"));
    assert_eq!(d.ok(&["table", "zer"]), "0 1000 zero \n");
    d.ok(&["resume", "zer"]);
    assert_eq!(d.ok(&["table", "zer"]), "0 500 zero \n");

    d.ok(&[
        "create",
        "ro",
        "--readonly",
        "--table",
        "0 8 zero",
        "-u",
        "UUID-1",
    ]);
    let ro = d.ok(&["info", "ro"]);
    assert!(
        ro.contains("State:             ACTIVE (READ-ONLY)\n") && ro.ends_with("UUID: UUID-1\n\n"),
        "{ro}"
    );

    // the layout; the numbers are Linux 6.12's (tests/dm_versions.rs asks that kernel)
    let t = d.ok(&["targets"]);
    for (name, v) in [
        ("linear", "v1.4.0"),
        ("striped", "v1.6.0"),
        ("zero", "v1.2.0"),
        ("error", "v1.7.0"),
        ("flakey", "v1.5.0"),
        ("delay", "v1.4.0"),
    ] {
        assert!(t.contains(&format!("{name:<16} {v}\n")), "{t}");
    }
}

#[test]
fn bad_tables_and_commands_name_what_is_wrong() {
    let d = Daemon::start("bad");
    let f = d.dir.sparse("f.img", 1 << 20);
    let f = f.display().to_string();
    let create = |t: &str| {
        let o = d.cli_in(&["create", "x"], t);
        assert!(!o.status.success(), "table {t:?} was accepted");
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
        e
    };
    let cases: Vec<(String, &str)> = vec![
        ("".into(), "table is empty"),
        (
            "0 8".into(),
            "line 1: '0 8': expected '<start> <length> <target_type>",
        ),
        ("zero 8 zero".into(), "line 1: start 'zero' is not a number"),
        ("0 x zero".into(), "line 1: length 'x' is not a number"),
        ("0 0 zero".into(), "line 1: zero-length target"),
        (
            "8 8 zero".into(),
            "line 1: first target starts at sector 8, not 0",
        ),
        (
            "0 8 zero\n16 8 zero".into(),
            "line 2: gap in table: target starts at sector 16, previous target ends at 8",
        ),
        ("0 8 zero\n4 8 zero".into(), "line 2: overlap in table"),
        (
            "0 8 frobnicate".into(),
            "line 1: frobnicate: unknown target type 'frobnicate'",
        ),
        (
            "0 8 zero extra".into(),
            "line 1: zero: zero: No arguments required",
        ),
        (
            format!("0 8 linear {f}"),
            "line 1: linear: linear takes 2 arguments",
        ),
        (
            format!("0 8 linear {f} abc"),
            "line 1: linear: invalid offset 'abc'",
        ),
        (
            "0 8 linear /nonexistent/file 0".into(),
            "line 1: linear: device '/nonexistent/file': No such file",
        ),
        (
            format!("0 4096 linear {f} 0"),
            "too small for target: offset 0 + length 4096 sectors > device size 2048 sectors",
        ),
        (
            "0 8 linear /dev/mapper/nope 0".into(),
            "no dmkit device named 'nope'",
        ),
        (
            format!("0 8 striped 0 8 {f} 0"),
            "number of stripes must be at least 1",
        ),
        (
            format!("0 16 striped 2 8 {f} 0"),
            "striped with 2 stripes takes 6 arguments, got 4",
        ),
        (
            format!("0 16 striped 2 0 {f} 0 {f} 8"),
            "chunk size must be greater than 0",
        ),
        (
            format!("0 15 striped 2 8 {f} 0 {f} 8"),
            "target length 15 is not divisible by the number of stripes 2",
        ),
        (
            format!("0 16 striped 2 16 {f} 0 {f} 8"),
            "stripe length 8 is not divisible by the chunk size 16",
        ),
        (
            format!("0 8 flakey {f} 0 0 0"),
            "up and down intervals must add up to more than 0",
        ),
        (
            format!("0 8 flakey {f} 0 1 1 2 drop_writes error_writes"),
            "drop_writes and error_writes are mutually exclusive",
        ),
        (
            format!("0 8 flakey {f} 0 1 1 1 bogus"),
            "unknown flakey feature 'bogus'",
        ),
        (
            format!("0 8 flakey {f} 0 1 1 3 drop_writes"),
            "feature count 3 does not match",
        ),
        (
            format!("0 8 flakey {f} 0 1 1 5 corrupt_bio_byte 1 x 0 0"),
            "direction 'x' is not r or w",
        ),
        (format!("0 8 delay {f} 0"), "delay takes 3, 6 or 9 arguments"),
        (format!("0 8 delay {f} 0 soon"), "invalid delay 'soon'"),
    ];
    for (table, want) in &cases {
        let e = create(table);
        assert!(
            e.contains(want),
            "table {table:?}: error {e:?} does not contain {want:?}"
        );
    }
    // A failed create leaves nothing behind.
    assert_eq!(d.ok(&["ls"]), "No devices found\n");

    d.create("z", "0 8 zero");
    assert!(d
        .fails(&["create", "z", "--table", "0 8 zero"])
        .contains("z: device already exists"));
    assert!(d.fails(&["status", "nope"]).contains("nope: No such device"));
    assert!(d.fails(&["resume", "nope"]).contains("nope: No such device"));
    assert!(d
        .fails(&["message", "z", "0", "hello"])
        .contains("message 'hello' refused: target zero takes no messages"));
    assert!(d
        .fails(&["message", "z", "99", "hello"])
        .contains("sector 99 is beyond the end of the device"));
    assert!(d
        .fails(&["message", "z", "x", "hello"])
        .contains("invalid sector 'x'"));
    assert!(d
        .fails(&["frob"])
        .contains("dmkit: unrecognized subcommand 'frob' (see 'dmkit --help')"));
    assert!(d
        .fails(&["suspend", "z", "--bogus"])
        .contains("dmkit suspend: unexpected argument '--bogus' found"));
    assert!(d
        .fails(&["load", "z", "--table", "0 8 zero\n0 8 zero"])
        .contains("line 2: overlap in table"));
    // A failed load leaves the live table alone and no inactive one.
    assert!(d.ok(&["info", "z"]).contains("Tables present:    LIVE\n"));
    // Without a daemon: a clear error, non-zero status.
    let o = std::process::Command::new(common::BIN)
        .args(["--run-dir", "/nonexistent/run", "ls"])
        .output()
        .expect("run");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no dmkit daemon at /nonexistent/run/control.sock"));
}
