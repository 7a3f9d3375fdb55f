//! `dmkit verity table` and `dmkit verity dump` on hash devices the real
//! `veritysetup format` writes here: the dump's fields are `veritysetup
//! dump`'s, the table line is the one `veritysetup open` loads (built from
//! those fields), and the device it creates (`--name`) serves the data and
//! verifies; a superblock whose fields lie is refused naming the field; and
//! the real `veritysetup open` and `close` work through the dm ioctl door
//! (`dmkit exec`), loading `dmkit verity table`'s line over loop devices.

use crate::common;

use common::nbd::Client;
use common::{image, need, run, Daemon, Scratch, BIN};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Output};

const SIZE: u64 = 4 << 20;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `veritysetup format ARGS DATA HASH`: the root hash it printed.
fn format(data: &Path, hash: &Path, args: &[&str]) -> String {
    need("veritysetup");
    let out = run(Command::new("veritysetup")
        .arg("format")
        .args(args)
        .arg(data)
        .arg(hash));
    value(&out, "Root hash:")
}

/// The value of `key`'s line in veritysetup's output.
fn value(out: &str, key: &str) -> String {
    out.lines()
        .find_map(|l| l.trim_start().strip_prefix(key))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("no '{key}' in:\n{out}"))
}

fn dmkit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("spawn dmkit")
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8")
}

/// `dmkit verity table DATA HASH ROOT [--hash-offset N]`: its one line.
fn verity_table(data: &Path, hash: &Path, root: &str, offset: u64) -> String {
    let o = dmkit(&[
        "verity",
        "table",
        s(data),
        s(hash),
        root,
        "--hash-offset",
        &offset.to_string(),
    ]);
    assert_eq!(text(&o.stderr), "", "no error");
    assert!(o.status.success());
    text(&o.stdout).strip_suffix('\n').expect("one line").to_string()
}

/// Four formats (hash types 1 and 0, sha256/sha512/sha1, block sizes 512 to
/// 4096, salts and none, superblocks at byte 0 and at a --hash-offset): the
/// dump is veritysetup's, the table is the line its open loads, and the
/// device `--name` creates serves the data, verified.
#[test]
fn tables_and_dumps_of_veritysetup_formats() {
    let sc = Scratch::new("verity-table");
    let d = Daemon::start("verity-table");
    let data = image(&sc, "data.img", SIZE, Some(71));
    let want = std::fs::read(&data).expect("data");
    let cases: [(&str, u64, &[&str]); 4] = [
        ("a", 0, &["--salt=5eed00aa"]),
        (
            "b",
            0,
            &[
                "--hash=sha512",
                "--salt=-",
                "--data-block-size=1024",
                "--hash-block-size=4096",
            ],
        ),
        (
            "c",
            8192,
            &[
                "--format=0",
                "--hash=sha1",
                "--data-block-size=512",
                "--hash-block-size=1024",
            ],
        ),
        (
            "d",
            4096,
            &["--hash=sha256", "--data-block-size=512", "--hash-block-size=512"],
        ),
    ];
    for (name, offset, args) in cases {
        let hash = sc.sparse(&format!("{name}.hash"), 2 << 20);
        let off = format!("--hash-offset={offset}");
        let mut all = args.to_vec();
        all.push(&off);
        let root = format(&data, &hash, &all);
        let vs = run(Command::new("veritysetup").args(["dump", &off]).arg(&hash));

        // the dump: veritysetup's fields
        let o = dmkit(&["verity", "dump", s(&hash), "--hash-offset", &offset.to_string()]);
        assert_eq!(text(&o.stderr), "");
        assert!(o.status.success());
        let dbs: u64 = value(&vs, "Data block size:").parse().expect("data block size");
        let hbs: u64 = value(&vs, "Hash block size:").parse().expect("hash block size");
        let blocks: u64 = value(&vs, "Data blocks:").parse().expect("data blocks");
        let hash_blocks: u64 = value(&vs, "Hash blocks:").parse().expect("hash blocks");
        let start = (offset + 512).div_ceil(hbs);
        let salt = value(&vs, "Salt:");
        let (alg, ty) = (value(&vs, "Hash algorithm:"), value(&vs, "Hash type:"));
        assert_eq!(
            text(&o.stdout),
            format!(
                "superblock offset: {offset}\nuuid: {}\nhash type: {ty}\nalgorithm: {alg}\n\
                 data block size: {dbs}\nhash block size: {hbs}\ndata blocks: {blocks}\nsalt: {salt}\n\
                 hash start block: {start}\nhash blocks: {hash_blocks}\nhash device bytes: {}\n",
                value(&vs, "UUID:"),
                (start + hash_blocks) * hbs
            ),
            "{name}: {vs}"
        );
        assert_eq!(blocks * dbs, SIZE, "{name}: the whole data file");

        // the table: what veritysetup open loads
        let table = verity_table(&data, &hash, &root, offset);
        assert_eq!(
            table,
            format!(
                "0 {} verity {ty} {} {} {dbs} {hbs} {blocks} {start} {alg} {root} {salt}",
                SIZE / 512,
                s(&data),
                s(&hash)
            ),
            "{name}"
        );

        // --name: the device, read-only, serving the data, verified
        let o = d.cli(&[
            "verity",
            "table",
            s(&data),
            s(&hash),
            &root.to_uppercase(),
            "--hash-offset",
            &offset.to_string(),
            "--name",
            name,
        ]);
        assert_eq!(
            (text(&o.stdout), text(&o.stderr)),
            (String::new(), String::new()),
            "{name}"
        );
        assert!(o.status.success());
        assert_eq!(d.ok(&["table", name]), format!("{table}\n"));
        assert_eq!(
            d.info_line(name, "State:"),
            "State:             ACTIVE (READ-ONLY)"
        );
        let got = Client::connect(&d.sock(), name).read(0, SIZE as usize);
        assert!(got == want, "{name}: the data through verity");
        assert_eq!(d.ok(&["status", name]), format!("0 {} verity V\n", SIZE / 512));
        d.remove_closed(name);
    }
}

/// A superblock whose fields lie is refused with one line naming the field
/// (and the hash device); a data device smaller than the superblock's data
/// blocks, a hash device that ends inside the tree, a wrong-length root hash
/// and a misaligned offset likewise.
#[test]
fn lying_superblocks_are_refused_naming_the_field() {
    let sc = Scratch::new("verity-lies");
    let data = image(&sc, "data.img", SIZE, Some(72));
    let hash = sc.sparse("hash.img", 1 << 20);
    let root = format(&data, &hash, &["--salt=abcd"]);
    let good = std::fs::read(&hash).expect("hash");
    let h = s(&hash).to_string();
    let at = |field: &str| format!("dmkit verity table: {h}: verity superblock at byte 0: {field}");
    let cases: Vec<(usize, &[u8], String)> = vec![
        (0, b"VERITY", format!("dmkit verity table: {h}: no verity superblock at byte 0 (no \"verity\" magic)")),
        (8, &[2], format!("{} 2 (dmkit reads version 1)", at("version:"))),
        (12, &[9], format!("{} 9 (0 or 1)", at("hash type:"))),
        (32, b"md5\0\0\0", format!("{} 'md5' (dmkit has sha256, sha1, sha224, sha384, sha512)", at("algorithm:"))),
        (32, &[b'x'; 32], format!("{} not NUL-terminated in its 32 bytes", at("algorithm:"))),
        (64, &[0, 0, 0, 0x40], format!("{} 1073741824 (a power of two from 512 to 4096)", at("data block size:"))),
        (68, &[0, 6, 0, 0], format!("{} 1536 (a power of two from 512 to 4096)", at("hash block size:"))),
        (72, &[0; 8], format!("{} 0 (1 to 4503599627370495 blocks of 4096 bytes)", at("data blocks:"))),
        (80, &[0xff, 0xff], format!("{} 65535 (at most 256)", at("salt size:"))),
        (
            72,
            &[0, 0, 0, 0, 0, 1, 0, 0],
            format!("dmkit verity table: {h}: the hash tree ends at byte 35461414395904 (8657571873 hash blocks of 4096 bytes from block 1), the device holds 1048576 bytes"),
        ),
        (
            72,
            &[1, 4, 0, 0, 0, 0, 0, 0],
            format!("dmkit verity table: {}: 4194304 bytes, smaller than the superblock's 1025 data blocks of 4096 bytes", s(&data)),
        ),
    ];
    let f = std::fs::OpenOptions::new().write(true).open(&hash).expect("open");
    for (off, bytes, want) in cases {
        f.write_all_at(&good, 0).expect("restore");
        f.write_all_at(bytes, off as u64).expect("lie");
        let o = dmkit(&["verity", "table", s(&data), &h, &root]);
        assert_eq!(
            (text(&o.stdout), text(&o.stderr)),
            (String::new(), format!("{want}\n"))
        );
        assert_eq!(o.status.code(), Some(1));
    }
    f.write_all_at(&good, 0).expect("restore");
    for (args, want) in [
        (vec!["table", s(&data), &h, "abcd"], "dmkit verity table: root hash 'abcd': 64 hex digits for sha256".to_string()),
        (vec!["dump", &h, "--hash-offset", "100"], "dmkit verity dump: hash offset 100: not a multiple of 512 bytes".into()),
        (vec!["dump", s(&data), "--hash-offset", "4096"], format!("dmkit verity dump: {}: no verity superblock at byte 4096 (no \"verity\" magic)", s(&data))),
        (vec!["dump", &h, "--hash-offset", "1048576"], format!("dmkit verity dump: {h}: the device ends before the verity superblock's 512 bytes at byte 1048576")),
    ] {
        let mut a = vec!["verity"];
        a.extend(args);
        let o = dmkit(&a);
        assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), format!("{want}\n")));
        assert_eq!(o.status.code(), Some(1));
    }
}

/// The real veritysetup, through the dm ioctl door (`dmkit exec`), opens a
/// verity device in the daemon: it attaches the data and hash files to loop
/// devices (the kernel's loop driver) and loads the table `dmkit verity
/// table` prints, with the loop devices' numbers for the devices; the device
/// serves the data; `veritysetup status` and `close` work through the door;
/// `veritysetup open --fec-device` loads the FEC options with the FEC file's
/// loop device.
#[test]
fn veritysetup_open_through_the_door_loads_dmkits_table() {
    let sc = Scratch::new("verity-door");
    let data = image(&sc, "data.img", SIZE, Some(73));
    let hash = sc.sparse("hash.img", 1 << 20);
    let root = format(&data, &hash, &["--salt=0123abcd"]);
    let want_table = verity_table(&data, &hash, &root, 0);
    let d = Daemon::start("verity-door");
    let o = d.cli(&[
        "exec",
        "--",
        "veritysetup",
        "open",
        s(&data),
        "vs",
        s(&hash),
        &root,
    ]);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    let got = d.ok(&["table", "vs"]);
    let mut fields: Vec<&str> = got.trim_end().split(' ').collect();
    for i in [4, 5] {
        assert!(
            fields[i].starts_with("7:"),
            "a loop device (major 7): {}",
            fields[i]
        );
    }
    fields[4] = s(&data);
    fields[5] = s(&hash);
    assert_eq!(
        fields.join(" "),
        want_table,
        "veritysetup's table is dmkit verity table's"
    );
    assert_eq!(
        d.info_line("vs", "State:"),
        "State:             ACTIVE (READ-ONLY)"
    );
    let uuid = value(&run(Command::new("veritysetup").arg("dump").arg(&hash)), "UUID:").replace('-', "");
    assert_eq!(
        d.info_line("vs", "UUID:"),
        format!("UUID: CRYPT-VERITY-{uuid}-vs")
    );
    let got = Client::connect(&d.sock(), "vs").read(0, SIZE as usize);
    assert!(
        got == std::fs::read(&data).expect("data"),
        "the data through veritysetup's device"
    );
    d.wait_open_count("vs", 0);
    let o = d.cli(&["exec", "--", "veritysetup", "status", "vs"]);
    assert!(o.status.success());
    let st = text(&o.stdout);
    assert_eq!(value(&st, "status:"), "verified");
    assert_eq!(value(&st, "root hash:"), root);
    assert_eq!(value(&st, "data loop:"), s(&data));
    assert_eq!(value(&st, "hash loop:"), s(&hash));
    let o = d.cli(&["exec", "--", "veritysetup", "close", "vs"]);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    assert_eq!(d.ok(&["ls"]), "No devices found\n");

    // with FEC: veritysetup loads the FEC options, the FEC file on a third
    // loop device, fec_blocks covering the data and the hash file after its
    // superblock (1024 + 255)
    let fec = sc.path("fec.img");
    let root = format(
        &data,
        &hash,
        &["--salt=0123abcd", "--fec-device", s(&fec), "--fec-roots", "2"],
    );
    let want_table = verity_table(&data, &hash, &root, 0);
    let o = d.cli(&[
        "exec",
        "--",
        "veritysetup",
        "open",
        "--fec-device",
        s(&fec),
        "--fec-roots",
        "2",
        s(&data),
        "vf",
        s(&hash),
        &root,
    ]);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    let got = d.ok(&["table", "vf"]);
    let mut fields: Vec<&str> = got.trim_end().split(' ').collect();
    assert_eq!(fields.len(), 22, "{got}");
    for i in [4, 5, 15] {
        assert!(
            fields[i].starts_with("7:"),
            "a loop device (major 7): {}",
            fields[i]
        );
    }
    fields[4] = s(&data);
    fields[5] = s(&hash);
    fields[15] = s(&fec);
    assert_eq!(
        fields.join(" "),
        format!(
            "{want_table} 8 use_fec_from_device {} fec_blocks 1279 fec_start 0 fec_roots 2",
            s(&fec)
        )
    );
    let got = Client::connect(&d.sock(), "vf").read(0, SIZE as usize);
    assert!(
        got == std::fs::read(&data).expect("data"),
        "the data through veritysetup's FEC device"
    );
    d.wait_open_count("vf", 0);
    let o = d.cli(&["exec", "--", "veritysetup", "close", "vf"]);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
}
