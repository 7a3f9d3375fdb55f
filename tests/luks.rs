//! `dmkit luks table` and `dmkit luks dump` on LUKS1 and LUKS2 images that the
//! real cryptsetup formats here: the table's key is the volume key
//! `cryptsetup luksDump --dump-volume-key` shows, its cipher, offset and
//! options are what cryptsetup's open loads (the fields of its luksDump, as
//! tests/crypt_oracle.rs checks against the kernel), and data written through
//! the daemon's crypt device with that table reads back. A wrong passphrase
//! exits 2, as cryptsetup's open; a header whose fields lie (with a valid
//! checksum) is refused naming the field; a primary header whose checksum
//! fails gives way to the secondary.

use crate::common;

use common::nbd::Client;
use common::{need, pattern, run, Daemon, Scratch, BIN};
use sha2::Digest;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::MIB;
const SIZE: u64 = 32 * MIB;
const PW: &str = "correct horse";

fn cryptsetup(args: &[&str], img: &Path) -> String {
    need("cryptsetup");
    run(Command::new("cryptsetup").args(args).arg(img))
}

/// A SIZE image formatted by `cryptsetup luksFormat --batch-mode ARGS` with
/// the passphrase in `pw`.
fn format(s: &Scratch, name: &str, pw: &Path, args: &[&str]) -> PathBuf {
    let img = s.sparse(name, SIZE);
    let mut a = vec![
        "luksFormat",
        "--batch-mode",
        "--key-file",
        pw.to_str().expect("utf-8"),
    ];
    a.extend_from_slice(args);
    cryptsetup(&a, &img);
    img
}

/// The volume key as `luksDump --dump-volume-key` prints it, in hex.
fn volume_key(img: &Path, pw: &Path) -> String {
    let dump = cryptsetup(
        &[
            "luksDump",
            "--dump-volume-key",
            "--batch-mode",
            "--key-file",
            pw.to_str().expect("utf-8"),
        ],
        img,
    );
    let after = dump.split("MK dump:").nth(1).expect("MK dump in luksDump");
    after
        .lines()
        .take_while(|l| l.starts_with(['\t', ' ']) || !l.contains(':'))
        .flat_map(|l| l.split_whitespace())
        .collect()
}

/// A field of cryptsetup's luksDump: the first word after `key`.
fn field(dump: &str, key: &str) -> String {
    dump.lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in luksDump: {dump}"))
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// The table cryptsetup's open loads for `img`, from its luksDump: LUKS2's
/// data segment (as tests/crypt_oracle.rs's kernel run confirms), or LUKS1's
/// cipher and payload offset.
fn expected_table(img: &Path, pw: &Path) -> String {
    let key = volume_key(img, pw);
    let dump = cryptsetup(&["luksDump"], img);
    let dev = img.display();
    if field(&dump, "Version:") == "1" {
        let cipher = format!(
            "{}-{}",
            field(&dump, "Cipher name:"),
            field(&dump, "Cipher mode:")
        );
        let offset: u64 = field(&dump, "Payload offset:").parse().expect("payload offset");
        return format!("0 {} crypt {cipher} {key} 0 {dev} {offset}", SIZE / 512 - offset);
    }
    let offset: u64 = field(&dump, "offset:").parse().expect("offset in bytes");
    let sector: u64 = field(&dump, "sector:").parse().expect("sector size");
    let opts = if sector == 512 {
        String::new()
    } else {
        format!(" 1 sector_size:{sector}")
    };
    format!(
        "0 {} crypt {} {key} 0 {dev} {}{opts}",
        (SIZE - offset) / 512,
        field(&dump, "cipher:"),
        offset / 512
    )
}

/// `dmkit ARGS` with `stdin` fed in.
fn dmkit(args: &[&str], stdin: &[u8]) -> Output {
    let mut c = Command::new(BIN)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dmkit");
    let _ = c.stdin.take().expect("stdin").write_all(stdin);
    c.wait_with_output().expect("dmkit")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `dmkit luks table IMG --key-file PW`: its line, which must be the only output.
fn luks_table(img: &Path, pw: &Path) -> String {
    let o = dmkit(
        &[
            "luks",
            "table",
            img.to_str().expect("utf-8"),
            "--key-file",
            pw.to_str().expect("utf-8"),
        ],
        b"",
    );
    assert_eq!(text(&o.stderr), "", "no error");
    assert!(o.status.success());
    let out = text(&o.stdout);
    out.strip_suffix('\n').expect("one line").to_string()
}

/// Open `table` in a daemon and check data written through it reads back
/// (and is not on the image in the clear).
fn round_trip(d: &Daemon, name: &str, table: &str, img: &Path, offset_bytes: u64) {
    d.create(name, table);
    assert_eq!(
        d.ok(&["table", "--showkeys", name]),
        format!("{table}\n"),
        "the daemon keeps the table"
    );
    let data = pattern(name.len() as u64, 256 << 10);
    {
        let mut c = Client::connect(&d.sock(), name);
        c.write(MIB, &data);
        assert!(
            c.read(MIB, data.len()) == data,
            "{name}: reads back what was written"
        );
    }
    let raw = common::read_at(img, offset_bytes + MIB, data.len());
    assert!(raw != data, "{name}: the image holds ciphertext");
    d.remove_closed(name);
}

/// The three LUKS2 kinds (pbkdf2, argon2id, 4096-byte sectors) and the two
/// LUKS1 ciphers: the table is cryptsetup's and opens the data.
#[test]
fn tables_of_luks1_and_luks2_images_are_cryptsetups_and_open_the_data() {
    let s = Scratch::new("luks-kinds");
    let pw = s.path("pw");
    std::fs::write(&pw, PW).expect("passphrase");
    let quick = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
    let cases: Vec<(&str, Vec<&str>, &str, &str)> = vec![
        (
            "l2-pbkdf2",
            [&["--type", "luks2", "--sector-size", "512"][..], &quick].concat(),
            "2",
            "pbkdf2 sha256 1000 iterations",
        ),
        (
            "l2-argon2id",
            vec![
                "--type",
                "luks2",
                "--sector-size",
                "512",
                "--pbkdf",
                "argon2id",
                "--pbkdf-force-iterations",
                "4",
                "--pbkdf-memory",
                "32768",
                "--pbkdf-parallel",
                "1",
            ],
            "2",
            "argon2id time 4 memory 32768 KiB cpus 1",
        ),
        (
            "l2-4k",
            [&["--type", "luks2", "--sector-size", "4096"][..], &quick].concat(),
            "2",
            "pbkdf2 sha256 1000 iterations",
        ),
        (
            "l1-xts",
            [
                &[
                    "--type",
                    "luks1",
                    "--cipher",
                    "aes-xts-plain64",
                    "--key-size",
                    "512",
                ][..],
                &quick[2..],
            ]
            .concat(),
            "1",
            "pbkdf2 sha256 1000 iterations",
        ),
        (
            "l1-cbc",
            [
                &[
                    "--type",
                    "luks1",
                    "--cipher",
                    "aes-cbc-essiv:sha256",
                    "--key-size",
                    "256",
                ][..],
                &quick[2..],
            ]
            .concat(),
            "1",
            "pbkdf2 sha256 1000 iterations",
        ),
    ];
    let d = Daemon::start("luks-kinds");
    for (name, args, version, kdf) in &cases {
        let img = format(&s, &format!("{name}.img"), &pw, args);
        let want = expected_table(&img, &pw);
        let got = luks_table(&img, &pw);
        assert_eq!(got, want, "{name}: the table cryptsetup's open loads");
        // the summary
        let dump = dmkit(&["luks", "dump", img.to_str().expect("utf-8")], b"");
        assert!(dump.status.success(), "{name}: {}", text(&dump.stderr));
        let cs = cryptsetup(&["luksDump"], &img);
        let sum = text(&dump.stdout);
        let fields: Vec<&str> = want.split(' ').collect();
        let (cipher, key, offset) = (fields[3], fields[4], fields[7].parse::<u64>().expect("offset"));
        let sector = if want.ends_with("sector_size:4096") {
            4096
        } else {
            512
        };
        let uuid = field(&cs, "UUID:");
        let area = if *version == "2" {
            format!("32768 ({} bytes)", 258048)
        } else {
            format!("4096 ({} bytes)", key.len() / 2 * 4000)
        };
        let mut wanted = format!("version: {version}\n");
        if *version == "2" {
            wanted += "header: primary\n";
        }
        wanted += &format!(
            "uuid: {uuid}\ncipher: {cipher}\nvolume key: {} bits\nsector size: {sector}\n\
             data offset: {} bytes ({offset} sectors)\ndata size: to the device's end\nkeyslots: 1\n  \
             0: {kdf}; af luks1 4000 stripes sha256; area {cipher} {} bits at byte {area}\n\
             digest: pbkdf2 sha256 {} iterations, keyslots 0\n",
            key.len() * 4,
            offset * 512,
            key.len() * 4,
            if *version == "2" {
                field(
                    cs.split("Digests:").nth(1).expect("Digests in luksDump"),
                    "Iterations:",
                )
            } else {
                field(&cs, "MK iterations:")
            },
        );
        assert_eq!(sum, wanted, "{name}: luks dump");
        round_trip(&d, name, &got, &img, offset * 512);
    }
}

/// A keyslot added with luksAddKey opens with its own passphrase, alone or
/// named; the other keyslot refuses it with exit code 2; a passphrase on
/// standard input stops at its newline; --name creates the device.
#[test]
fn a_second_keyslot_and_the_passphrase_on_stdin() {
    let s = Scratch::new("luks-slots");
    let pw = s.path("pw");
    let pw2 = s.path("pw2");
    std::fs::write(&pw, PW).expect("passphrase");
    std::fs::write(&pw2, "battery staple").expect("passphrase 2");
    let img = format(
        &s,
        "two.img",
        &pw,
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    need("cryptsetup");
    run(Command::new("cryptsetup")
        .args([
            "luksAddKey",
            "--batch-mode",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ])
        .arg("--key-file")
        .arg(&pw)
        .arg(&img)
        .arg(&pw2));
    let want = expected_table(&img, &pw);
    assert_eq!(luks_table(&img, &pw2), want, "keyslot 1's passphrase");
    let i = img.to_str().expect("utf-8");
    let o = dmkit(
        &["luks", "table", i, "--key-slot", "1"],
        b"battery staple\nignored after the newline",
    );
    assert_eq!(
        (text(&o.stdout), text(&o.stderr)),
        (format!("{want}\n"), String::new())
    );
    let o = dmkit(&["luks", "table", i, "--key-slot", "0"], b"battery staple");
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(text(&o.stdout), "");
    assert_eq!(
        text(&o.stderr),
        format!("dmkit luks table: {i}: keyslot 0 does not open with this passphrase\n")
    );
    let o = dmkit(&["luks", "table", i, "--key-slot", "5"], PW.as_bytes());
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr),
        format!("dmkit luks table: {i}: keyslot 5 is not active (active: 0 1)\n")
    );
    let dump = text(&dmkit(&["luks", "dump", i], b"").stdout);
    assert!(
        dump.contains("\nkeyslots: 2\n  0: pbkdf2 sha256 1000 iterations;"),
        "{dump}"
    );
    assert!(dump.contains("\n  1: pbkdf2 sha256 1000 iterations;"), "{dump}");
    assert!(dump.ends_with(" iterations, keyslots 0 1\n"), "{dump}");
    // --name: the daemon gets the table (the key never on a command line)
    let d = Daemon::start("luks-slots");
    let o = d.cli_in(&["luks", "table", i, "--name", "two"], "battery staple\n");
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    assert_eq!(d.ok(&["table", "--showkeys", "two"]), format!("{want}\n"));
    let o = d.cli_in(&["luks", "table", i, "--name", "two"], PW);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(text(&o.stderr), "dmkit create: two: device already exists\n");
}

/// A wrong passphrase: cryptsetup's exit code 2, one line, no output.
#[test]
fn a_wrong_passphrase_exits_2() {
    let s = Scratch::new("luks-wrong");
    let pw = s.path("pw");
    std::fs::write(&pw, PW).expect("passphrase");
    for (name, ty) in [("w2.img", "luks2"), ("w1.img", "luks1")] {
        let img = format(
            &s,
            name,
            &pw,
            &[
                "--type",
                ty,
                "--pbkdf-force-iterations",
                "1000",
                "--pbkdf",
                "pbkdf2",
            ],
        );
        let i = img.to_str().expect("utf-8");
        let o = dmkit(&["luks", "table", i], b"correct horse battery");
        assert_eq!(o.status.code(), Some(2), "{ty}");
        assert_eq!(text(&o.stdout), "");
        assert_eq!(
            text(&o.stderr),
            format!("dmkit luks table: {i}: no key slot matches this passphrase\n")
        );
    }
    let o = dmkit(&["luks", "table", pw.to_str().expect("utf-8")], PW.as_bytes());
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr),
        format!(
            "dmkit luks table: {}: reading the LUKS header (592 bytes at byte 0): the device ends before byte 592\n",
            pw.display()
        )
    );
}

/// The primary LUKS2 header's binary part and JSON area, parsed.
fn primary(img: &Path) -> (Vec<u8>, serde_json::Value) {
    let f = std::fs::File::open(img).expect("open");
    let mut bin = vec![0u8; 4096];
    f.read_exact_at(&mut bin, 0).expect("header");
    let hdr_size = u64::from_be_bytes(bin[8..16].try_into().expect("8")) as usize;
    let mut json = vec![0u8; hdr_size - 4096];
    f.read_exact_at(&mut json, 4096).expect("json");
    let end = json.iter().position(|&c| c == 0).unwrap_or(json.len());
    (bin, serde_json::from_slice(&json[..end]).expect("json parses"))
}

/// Write `json` as the primary header's JSON area with its checksum made
/// anew over the binary header and the area, as a valid (lying) header.
fn write_primary(img: &Path, bin: &[u8], json: &serde_json::Value) {
    let hdr_size = u64::from_be_bytes(bin[8..16].try_into().expect("8")) as usize;
    let mut area = serde_json::to_vec(json).expect("json");
    assert!(area.len() <= hdr_size - 4096);
    area.resize(hdr_size - 4096, 0);
    let mut bin = bin.to_vec();
    bin[448..512].fill(0);
    let mut h = sha2::Sha256::new();
    h.update(&bin);
    h.update(&area);
    bin[448..480].copy_from_slice(&h.finalize());
    let f = std::fs::OpenOptions::new().write(true).open(img).expect("open");
    f.write_all_at(&bin, 0).expect("binary header");
    f.write_all_at(&area, 4096).expect("json area");
}

/// Headers whose fields lie about sizes (with valid checksums) are refused
/// at once with the field named; a primary whose checksum fails gives way to
/// the secondary.
#[test]
fn lying_headers_are_refused_naming_the_field() {
    let s = Scratch::new("luks-lies");
    let pw = s.path("pw");
    std::fs::write(&pw, PW).expect("passphrase");
    let img = format(
        &s,
        "lie.img",
        &pw,
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "argon2id",
            "--pbkdf-force-iterations",
            "4",
            "--pbkdf-memory",
            "32768",
            "--pbkdf-parallel",
            "1",
        ],
    );
    let want = expected_table(&img, &pw);
    let i = img.to_str().expect("utf-8");
    let (bin, json) = primary(&img);
    let original = std::fs::read(&img).expect("image");
    let lies: Vec<(&[&str], serde_json::Value, String)> = vec![
        (
            &["keyslots", "0", "area", "size"],
            "1099511627776".into(),
            "keyslots.0.area.size: 1099511627776 is out of bounds (0 to 134217728 bytes, LUKS2's largest keyslots area)".into(),
        ),
        (
            &["keyslots", "0", "af", "stripes"],
            4294967295u64.into(),
            "keyslots.0.af.stripes: 4294967295 stripes (1 to 4000, LUKS's number)".into(),
        ),
        (
            &["keyslots", "0", "kdf", "memory"],
            4194305u64.into(),
            "keyslots.0.kdf.memory: 4194305 is out of bounds (8 to 4194304 KiB: at most 4 GiB)".into(),
        ),
        (
            &["keyslots", "0", "kdf", "time"],
            4294967295u64.into(),
            "keyslots.0.kdf.time: 4294967295 is out of bounds (1 to 1048576)".into(),
        ),
        (
            &["keyslots", "0", "key_size"],
            4096u64.into(),
            "keyslots.0.key_size: 4096 is out of bounds (1 to 96 bytes, what the ciphers dmkit has take)".into(),
        ),
        (
            &["keyslots", "0", "area", "offset"],
            "134250496".into(),
            format!(
                "{i}: reading keyslot 0's key material (256000 bytes at byte 134250496): \
                 the device ends before byte 134506496"
            ),
        ),
        (
            &["segments", "0", "encryption"],
            "twofish-xts-plain64".into(),
            "segments.0.encryption: Error allocating crypto tfm: cipher 'twofish-xts-plain64' is not supported \
             by dmkit (aes-xts-<iv>, aes-cbc-<iv>, cipher_null-ecb, their capi: forms, capi:authenc(hmac(sha256),<cipher>)-<iv>)"
                .into(),
        ),
        (
            &["config", "requirements"],
            serde_json::json!({"mandatory": ["online-reencrypt-v2"]}),
            "config.requirements.mandatory: online-reencrypt-v2 (a reencryption in progress, or a feature dmkit \
             does not have)"
                .into(),
        ),
    ];
    for (path, value, err) in lies {
        let mut j = json.clone();
        let mut target = &mut j;
        for k in path {
            target = &mut target[*k];
        }
        *target = value;
        let what = path.join(".");
        write_primary(&img, &bin, &j);
        let t0 = std::time::Instant::now();
        let o = dmkit(&["luks", "table", i], PW.as_bytes());
        assert_eq!(o.status.code(), Some(1), "{what}: {}", text(&o.stderr));
        let full = if err.starts_with(i) {
            format!("dmkit luks table: {err}\n")
        } else {
            format!("dmkit luks table: {i}: LUKS2 header: {err}\n")
        };
        assert_eq!(text(&o.stderr), full, "{what}");
        assert_eq!(text(&o.stdout), "");
        assert!(t0.elapsed().as_secs() < 5, "{what}: refused at once");
    }
    // a JSON area claiming a size LUKS2 does not have: the checksum no longer
    // covers it, and the secondary opens the volume
    let mut lying = bin.clone();
    lying[8..16].copy_from_slice(&(1u64 << 40).to_be_bytes());
    std::fs::write(&img, &original).expect("restore");
    let f = std::fs::OpenOptions::new().write(true).open(&img).expect("open");
    f.write_all_at(&lying, 0).expect("lie");
    assert_eq!(luks_table(&img, &pw), want, "the secondary header opens it");
    let dump = text(&dmkit(&["luks", "dump", i], b"").stdout);
    assert!(
        dump.starts_with(&format!(
            "version: 2\nheader: secondary at byte 16384 ({i}: LUKS2 primary header: hdr_size 1099511627776 \
             is not a size LUKS2 allows (16 KiB to 4096 KiB, a power of 2))\n"
        )),
        "{dump}"
    );
    // with the secondary gone too, the primary's error stands
    f.write_all_at(&[0u8; 4096], 16384).expect("secondary");
    let o = dmkit(&["luks", "table", i], PW.as_bytes());
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        text(&o.stderr),
        format!(
            "dmkit luks table: {i}: LUKS2 primary header: hdr_size 1099511627776 is not a size LUKS2 \
             allows (16 KiB to 4096 KiB, a power of 2)\n"
        )
    );
    // a primary whose checksum fails (one JSON byte changed)
    std::fs::write(&img, &original).expect("restore");
    let f = std::fs::OpenOptions::new().write(true).open(&img).expect("open");
    f.write_all_at(b" ", 4096 + 2).expect("flip");
    assert_eq!(luks_table(&img, &pw), want);
    let dump = text(&dmkit(&["luks", "dump", i], b"").stdout);
    assert!(
        dump.starts_with(&format!(
            "version: 2\nheader: secondary at byte 16384 ({i}: LUKS2 primary header at byte 0: checksum mismatch)\n"
        )),
        "{dump}"
    );
}

/// LUKS1 has no checksum: its fields are bounded alone (key bytes, a
/// keyslot's stripes and iterations), each refused by name.
#[test]
fn lying_luks1_headers_are_refused_naming_the_field() {
    let s = Scratch::new("luks1-lies");
    let pw = s.path("pw");
    std::fs::write(&pw, PW).expect("passphrase");
    let img = format(
        &s,
        "lie1.img",
        &pw,
        &["--type", "luks1", "--pbkdf-force-iterations", "1000"],
    );
    let i = img.to_str().expect("utf-8");
    let original = std::fs::read(&img).expect("image");
    for (at, value, err) in [
        (
            108u64,
            4096u32,
            "key-bytes: 4096 bytes (1 to 96, what the ciphers dmkit has take)",
        ),
        (
            208 + 44,
            u32::MAX,
            "key-slot-0 stripes: 4294967295 stripes (1 to 4000, LUKS's number)",
        ),
        (
            208 + 4,
            u32::MAX,
            "key-slot-0 iterations: 4294967295 PBKDF2 iterations (1 to 1073741824 accepted)",
        ),
        (
            164,
            0,
            "mk-digest-iter: 0 PBKDF2 iterations (1 to 1073741824 accepted)",
        ),
        (
            8,
            u32::from_be_bytes(*b"serp"),
            "cipher-name, cipher-mode: Error allocating crypto tfm: cipher 'serp-xts-plain64' is not supported \
             by dmkit (aes-xts-<iv>, aes-cbc-<iv>, cipher_null-ecb, their capi: forms, capi:authenc(hmac(sha256),<cipher>)-<iv>)",
        ),
    ] {
        std::fs::write(&img, &original).expect("restore");
        let f = std::fs::OpenOptions::new().write(true).open(&img).expect("open");
        f.write_all_at(&value.to_be_bytes(), at).expect("lie");
        let o = dmkit(&["luks", "table", i], PW.as_bytes());
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert_eq!(
            text(&o.stderr),
            format!("dmkit luks table: {i}: LUKS1 header: {err}\n")
        );
        assert_eq!(text(&o.stdout), "");
    }
}

/// The real cryptsetup, through the dm ioctl door (`dmkit exec`), opens a
/// LUKS2 image in the daemon: it unlocks the keyslot itself, attaches the
/// image to a loop device (the kernel's loop driver) and loads the table that
/// `dmkit luks table` prints, with the loop device's number for the device;
/// what is written through its device reads back through dmkit's own, once
/// cryptsetup closed it.
#[test]
fn cryptsetup_open_through_the_door_loads_dmkits_table() {
    let s = Scratch::new("luks-door");
    let pw = s.path("pw");
    std::fs::write(&pw, PW).expect("passphrase");
    let img = format(
        &s,
        "door.img",
        &pw,
        &[
            "--type",
            "luks2",
            "--pbkdf",
            "pbkdf2",
            "--pbkdf-force-iterations",
            "1000",
        ],
    );
    let want = luks_table(&img, &pw);
    let (i, p) = (img.to_str().expect("utf-8"), pw.to_str().expect("utf-8"));
    let d = Daemon::start("luks-door");
    let o = d.cli(&[
        "exec",
        "--",
        "cryptsetup",
        "open",
        "--type",
        "luks2",
        "--disable-keyring",
        "--key-file",
        p,
        i,
        "cs",
    ]);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    let got = d.ok(&["table", "--showkeys", "cs"]);
    let mut fields: Vec<&str> = got.trim_end().split(' ').collect();
    assert!(
        fields[6].starts_with("7:"),
        "a loop device (major 7): {}",
        fields[6]
    );
    fields[6] = i;
    assert_eq!(fields.join(" "), want, "cryptsetup's table is dmkit luks table's");
    let uuid = field(&cryptsetup(&["luksDump"], &img), "UUID:").replace('-', "");
    assert_eq!(d.info_line("cs", "UUID:"), format!("UUID: CRYPT-LUKS2-{uuid}-cs"));
    let data = pattern(9, 512 << 10);
    Client::connect(&d.sock(), "cs").write(0, &data);
    d.wait_open_count("cs", 0);
    let o = d.cli(&["exec", "--", "cryptsetup", "close", "cs"]);
    assert_eq!((text(&o.stdout), text(&o.stderr)), (String::new(), String::new()));
    assert!(o.status.success());
    assert_eq!(d.ok(&["ls"]), "No devices found\n");
    let o = d.cli_in(&["luks", "table", i, "--name", "mine"], PW);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let back = Client::connect(&d.sock(), "mine").read(0, data.len());
    assert!(back == data, "dmkit's device reads what cryptsetup's wrote");
}

/// `cryptsetup luksFormat --integrity hmac-sha256` through the door: the
/// format stacks dm-crypt's AEAD (`capi:authenc(hmac(sha256),xts(aes))`) on
/// an integrity device whose tags are dm-crypt's and wipes the volume
/// through both, so every sector reads (zeroes, each MAC right); cryptsetup's
/// open loads both tables, data reads back, a block whose tag is not its MAC
/// fails with EILSEQ naming the sector, and close removes both devices (it
/// finds the integrity device below through /sys/dev/block).
#[test]
fn cryptsetup_integrity_volumes_stack_crypt_on_integrity_through_the_door() {
    let s = Scratch::new("luks-aead");
    let pw = s.path("pw");
    std::fs::write(&pw, PW).expect("passphrase");
    let img = s.sparse("aead.img", 64 * MIB);
    let (i, p) = (img.to_str().expect("utf-8"), pw.to_str().expect("utf-8"));
    let d = Daemon::start("luks-aead");
    let cs = |args: &[&str]| d.door_ok("cryptsetup", args);
    let key = ["--disable-keyring", "--key-file", p];
    d.luks_format_integrity(i, "aes-xts-plain64", p);
    assert_eq!(
        d.ok(&["ls"]),
        "No devices found\n",
        "the format's devices are gone"
    );
    // one table line cannot open it: `dmkit luks table` says what does
    let o = d.cli_in(&["luks", "table", i, "--name", "x"], PW);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("segments.0.integrity: an integrity-protected volume is two devices")
            && text(&o.stderr).contains("dmkit exec -- cryptsetup open"),
        "{}",
        text(&o.stderr)
    );
    cs(&[&["open", "--type", "luks2"][..], &key, &[i, "av"]].concat());
    let crypt = d.ok(&["table", "av"]);
    let f: Vec<&str> = crypt.split_whitespace().collect();
    assert_eq!(f[3], "capi:authenc(hmac(sha256),xts(aes))-plain64", "{crypt}");
    assert_eq!(
        f[4].len(),
        192,
        "a 512-bit cipher key and a 256-bit MAC key: {crypt}"
    );
    assert_eq!(
        f[7..].join(" "),
        "0 2 integrity:32:aead sector_size:4096",
        "{crypt}"
    );
    let n: u64 = f[1].parse().expect("length");
    let below = d.ok(&["table", "av_dif"]);
    let g: Vec<&str> = below.split_whitespace().collect();
    assert_eq!((g[2], g[5], g[6]), ("integrity", "32", "J"), "{below}");
    assert!(
        !below.contains("internal_hash"),
        "the tags are dm-crypt's: {below}"
    );
    let st = cs(&["status", "av"]);
    assert!(st.contains("integrity: hmac(sha256)"), "{st}");
    let mut c = Client::connect(&d.sock(), "av");
    for at in (0..n * 512).step_by(4 << 20) {
        let len = (n * 512 - at).min(4 << 20) as usize;
        assert!(
            c.read(at, len).iter().all(|&b| b == 0),
            "the wipe made every sector read ({at})"
        );
    }
    let data = pattern(31, 1 << 20);
    c.write(4 * MIB, &data);
    assert_eq!(c.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
    assert!(c.read(4 * MIB, data.len()) == data, "written data reads back");
    drop(c);
    // a block written on the integrity device itself comes without tags:
    // its tag is zeroes (journal mode, as the kernel's), which is no MAC
    let mut raw = Client::connect(&d.sock(), "av_dif");
    raw.write(4 * MIB + 8192, &[7u8; 4096]);
    drop(raw);
    let mut c = Client::connect(&d.sock(), "av");
    assert!(c.read(4 * MIB, 8192) == data[..8192], "the blocks before read");
    assert!(
        c.read(4 * MIB + 12288, 4096) == data[12288..16384],
        "the block after reads"
    );
    assert_ne!(
        c.call(common::nbd::READ, 0, 4 * MIB + 8192, 4096, &[]),
        0,
        "the changed block fails"
    );
    drop(c);
    let bad = (4 * MIB + 8192) / 512;
    assert!(
        d.log().contains(&format!("INTEGRITY AEAD ERROR, sector {bad}")),
        "the log names the sector"
    );
    d.read_fails_with_eilseq("av", 4096, bad / 8);
    d.wait_open_count("av", 0);
    cs(&["close", "av"]);
    assert_eq!(
        d.ok(&["ls"]),
        "No devices found\n",
        "close removed the integrity device too"
    );
}
