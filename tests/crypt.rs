//! dm-crypt (`crypt`) through the real daemon, the CLI and NBD: what lands in
//! the file beneath is checked against an independent decryption (openssl's
//! AES in ECB mode, with XTS's tweaks and CBC's chaining done here), also
//! while the device beneath is suspended and resumed under load; bad tables
//! fail with one clear line; the key messages behave as the kernel's.

use crate::common;
use common::nbd::{Client, TRIM};
use common::{fio_verify_while_suspending, need, pattern, read_at, Daemon};
use std::collections::HashSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::MIB;
const XTS512: &str = "27182818284590452353602874713526624977572470936999595749669676273141592653589793238462643383279502884197169399375105820974944592";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// `openssl` with `input` on stdin; its stdout.
fn openssl(args: &[&str], input: &[u8]) -> Vec<u8> {
    need("openssl");
    let mut c = Command::new("openssl")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn openssl");
    let mut stdin = c.stdin.take().expect("stdin");
    let data = input.to_vec();
    let w = std::thread::spawn(move || stdin.write_all(&data).expect("feed openssl"));
    let out = c.wait_with_output().expect("openssl");
    w.join().expect("writer");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// AES-ECB over whole blocks with openssl (no padding).
fn ecb(key: &[u8], data: &[u8], decrypt: bool) -> Vec<u8> {
    let alg = format!("-aes-{}-ecb", key.len() * 8);
    let k = to_hex(key);
    let mut args = vec!["enc", alg.as_str(), "-nopad", "-K", k.as_str()];
    if decrypt {
        args.push("-d");
    }
    let out = openssl(&args, data);
    assert_eq!(out.len(), data.len());
    out
}

fn xor(a: &mut [u8], b: &[u8]) {
    a.iter_mut().zip(b).for_each(|(x, y)| *x ^= y);
}

/// Decrypt `ct` (whole `unit`-byte sectors whose IV numbers are `ivs`) as
/// aes-xts-plain64 does, from the definition: T = E_k2(IV) multiplied by x per
/// block in GF(2^128), P = D_k1(C ^ T) ^ T.
fn xts_decrypt(key: &[u8], unit: usize, ivs: &[u64], ct: &[u8]) -> Vec<u8> {
    let (k1, k2) = key.split_at(key.len() / 2);
    let ivb: Vec<u8> = ivs.iter().flat_map(|n| u128::from(*n).to_le_bytes()).collect();
    let t0 = ecb(k2, &ivb, false);
    let mut tweaks = Vec::with_capacity(ct.len());
    for s in 0..ivs.len() {
        let mut t = u128::from_le_bytes(t0[s * 16..s * 16 + 16].try_into().expect("16"));
        for _ in 0..unit / 16 {
            tweaks.extend_from_slice(&t.to_le_bytes());
            let carry = t >> 127;
            t = (t << 1) ^ (carry * 0x87);
        }
    }
    let mut x = ct.to_vec();
    xor(&mut x, &tweaks);
    let mut p = ecb(k1, &x, true);
    xor(&mut p, &tweaks);
    p
}

/// Decrypt `ct` as aes-cbc-essiv:sha256 does: IV = E_{sha256(key)}(le64(n)),
/// P_0 = D(C_0) ^ IV, P_i = D(C_i) ^ C_{i-1} within a sector.
fn cbc_essiv_decrypt(key: &[u8], unit: usize, ivs: &[u64], ct: &[u8]) -> Vec<u8> {
    let salt = openssl(&["dgst", "-sha256", "-binary"], key);
    let ivb: Vec<u8> = ivs.iter().flat_map(|n| u128::from(*n).to_le_bytes()).collect();
    let iv = ecb(&salt, &ivb, false);
    let mut p = ecb(key, ct, true);
    for (s, sector) in p.chunks_mut(unit).enumerate() {
        let base = s * unit;
        xor(&mut sector[..16], &iv[s * 16..s * 16 + 16]);
        for b in 1..unit / 16 {
            xor(
                &mut sector[b * 16..b * 16 + 16],
                &ct[base + (b - 1) * 16..base + b * 16],
            );
        }
    }
    p
}

/// No 32-byte piece of `plain` (at 16-byte steps) is anywhere in `file`'s blocks.
fn assert_no_plaintext(file: &[u8], plain: &[u8]) {
    let pieces: HashSet<&[u8]> = plain.chunks_exact(32).collect();
    for off in (0..file.len().saturating_sub(32)).step_by(16) {
        assert!(
            !pieces.contains(&file[off..off + 32]),
            "plaintext found in the backing file at byte {off}"
        );
    }
}

#[test]
fn cbc_essiv_lands_as_openssl_decrypts_it_with_iv_offset_and_large_sectors() {
    let d = Daemon::start("crypt-essiv");
    // 512-byte sectors, AES-128, iv_offset 7, 1 MiB into the file
    let f = d.dir.sparse("a.img", 8 * MIB);
    let k16 = "00112233445566778899aabbccddeeff";
    let table_a = format!("aes-cbc-essiv:sha256 {k16} 7 {} 2048", f.display());
    d.create("a", &format!("0 8192 crypt {table_a}"));
    assert_eq!(
        d.ok(&["table", "--showkeys", "a"]),
        format!("0 8192 crypt {table_a}\n")
    );
    // without --showkeys the key is zeros of its length, as dmsetup shows it
    assert_eq!(
        d.ok(&["table", "a"]),
        format!("0 8192 crypt {}\n", table_a.replace(k16, &"0".repeat(32)))
    );
    let mut c = Client::connect(&d.sock(), "a");
    let data = pattern(1, 4 * 512);
    c.write(10 * 512, &data);
    assert!(c.read(10 * 512, data.len()) == data, "read back through crypt");
    let on_disk = read_at(&f, (2048 + 10) * 512, data.len());
    assert_no_plaintext(&on_disk, &data);
    // target sectors 10..14 plus iv_offset 7
    let ivs: Vec<u64> = (17..21).collect();
    assert!(
        cbc_essiv_decrypt(&hex(k16), 512, &ivs, &on_disk) == data,
        "openssl decrypts what dmkit wrote"
    );

    // 4096-byte sectors numbered in their own units, AES-256, iv_offset 16
    let g = d.dir.sparse("b.img", 8 * MIB);
    let k32 = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    let table_b = format!(
        "aes-cbc-essiv:sha256 {k32} 16 {} 0 2 sector_size:4096 iv_large_sectors",
        g.display()
    );
    d.create("b", &format!("0 16384 crypt {table_b}"));
    assert_eq!(
        d.ok(&["table", "--showkeys", "b"]),
        format!("0 16384 crypt {table_b}\n")
    );
    let mut c = Client::connect(&d.sock(), "b");
    let data = pattern(2, 3 * 4096);
    c.write(8192, &data);
    assert!(c.read(8192, data.len()) == data);
    let on_disk = read_at(&g, 8192, data.len());
    assert_no_plaintext(&on_disk, &data);
    // target sectors 16, 24, 32 plus 16, in 4096-byte units: 4, 5, 6
    assert!(cbc_essiv_decrypt(&hex(k32), 4096, &[4, 5, 6], &on_disk) == data);
    // I/O not aligned to the 4096-byte sector fails, as the kernel kills it
    assert_ne!(
        c.call(common::nbd::WRITE, 0, 512, 512, &[0; 512]),
        0,
        "unaligned write"
    );
}

#[test]
fn xts_writes_read_back_and_land_as_the_definition_says() {
    let d = Daemon::start("crypt-xts");
    let f = d.dir.sparse("f.img", 8 * MIB);
    d.create(
        "x",
        &format!("0 8192 crypt aes-xts-plain64 {XTS512} 8 {} 2048", f.display()),
    );
    let mut c = Client::connect(&d.sock(), "x");
    let data = pattern(7, 256 << 10);
    c.write(64 << 10, &data);
    assert!(c.read(64 << 10, data.len()) == data, "read back through crypt");
    let file = read_at(&f, 0, (8 * MIB) as usize);
    assert_no_plaintext(&file, &data);
    let at = (MIB + (64 << 10)) as usize;
    let first = (64 << 10) / 512 + 8;
    let ivs: Vec<u64> = (first..first + (data.len() / 512) as u64).collect();
    assert!(
        xts_decrypt(&hex(XTS512), 512, &ivs, &file[at..at + data.len()]) == data,
        "the file holds the data XTS-encrypted once with the plain64 IVs"
    );
    // discards only with allow_discards
    assert_ne!(c.call(TRIM, 0, 0, 4096, &[]), 0, "discard without allow_discards");
    d.create(
        "y",
        &format!(
            "0 8192 crypt aes-xts-plain64 {XTS512} 0 {} 0 1 allow_discards",
            f.display()
        ),
    );
    let mut y = Client::connect(&d.sock(), "y");
    assert_eq!(y.call(TRIM, 0, 0, 4096, &[]), 0, "discard with allow_discards");
    // the 512-bit key runs in OpenSSL's XTS, whose key schedules are in its
    // heap: the daemon's memory is locked (it runs as root here)
    assert!(
        d.log().contains("crypt: the daemon's memory is locked"),
        "the daemon says its memory is locked: {}",
        d.log()
    );
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.pid())).expect("status");
    let locked: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmLck");
    assert!(locked > 0, "the daemon's pages are locked: {status}");
}

#[test]
fn fio_verifies_through_crypt_while_the_device_below_suspends() {
    let d = Daemon::start("crypt-fio");
    let f = d.dir.sparse("f.img", 32 * MIB);
    d.create("lin", &format!("0 65536 linear {} 0", f.display()));
    d.create(
        "x",
        &format!("0 65536 crypt aes-xts-plain64 {XTS512} 0 /dev/mapper/lin 0"),
    );
    fio_verify_while_suspending(&d, "x", "lin");
    // every block is in the file encrypted exactly once: the file decrypted
    // independently is what the device reads
    let mut c = Client::connect(&d.sock(), "x");
    let got = c.read(0, (16 * MIB) as usize);
    let file = read_at(&f, 0, (16 * MIB) as usize);
    let ivs: Vec<u64> = (0..(16 * MIB / 512)).collect();
    assert!(
        xts_decrypt(&hex(XTS512), 512, &ivs, &file) == got,
        "the device reads as the file decrypted once"
    );
    assert_no_plaintext(&file, &got);
}

/// `table` is refused with one line holding `want` and never the key `k`.
fn refused(d: &Daemon, table: &str, want: &str, k: &str) {
    let o = d.cli_in(&["create", "bad"], table);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{table} was accepted");
    assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
    assert!(e.contains(want), "{table}: {e}");
    assert!(!e.contains(k), "the error repeats the key: {e}");
}

#[test]
fn bad_tables_fail_with_one_clear_line() {
    let d = Daemon::start("crypt-bad");
    let f = d.dir.sparse("f.img", MIB);
    let p = f.display();
    let k = "00".repeat(64);
    for (table, want) in [
        (
            format!("twofish-xts-plain64 {k} 0 {p} 0"),
            "Error allocating crypto tfm",
        ),
        (
            format!("aes-xts-plain64 {} 0 {p} 0", "00".repeat(16)),
            "256-, 384- or 512-bit",
        ),
        (
            format!("aes-cbc-essiv:sha256 {} 0 {p} 0", "00".repeat(64)),
            "128-, 192- or 256-bit",
        ),
        (
            format!("aes-xts-plain64 {}0 0 {p} 0", "00".repeat(32)),
            "odd number of hex digits",
        ),
        (
            format!("aes-xts-plain64 {k} 0 {p} 0 1 sector_size:1000"),
            "Invalid feature value for sector_size",
        ),
        (
            format!("aes-xts-plain64 {k} 0 {p} 0 1 bogus_option"),
            "Invalid feature arguments",
        ),
        (
            format!("aes-xts-plain64 {k} 3 {p} 0 1 sector_size:4096"),
            "Invalid iv_offset sector",
        ),
        (
            format!("aes-xts-plain64 :64:logon:cryptsetup:abc 0 {p} 0"),
            "--disable-keyring",
        ),
        (format!("aes-xts-plain64 {k} 0 {p}"), "Not enough arguments"),
    ] {
        refused(&d, &format!("0 2048 crypt {table}"), want, &k);
    }
}

#[test]
fn key_wipe_and_set_as_the_kernel_allows_them() {
    let d = Daemon::start("crypt-key");
    let f = d.dir.sparse("f.img", 4 * MIB);
    let key = "5a".repeat(32);
    let table = format!("aes-xts-plain64 {key} 0 {} 0", f.display());
    d.create("x", &format!("0 8192 crypt {table}"));
    let mut c = Client::connect(&d.sock(), "x");
    let data = pattern(3, 64 << 10);
    c.write(0, &data);
    drop(c);

    let e = d.fails(&["message", "x", "0", "key", "wipe"]);
    assert!(e.contains("not suspended during key manipulation"), "{e}");
    d.ok(&["suspend", "x"]);
    d.ok(&["message", "x", "0", "key", "wipe"]);
    // the key is gone: the table shows zeroes, and the device does not resume
    assert_eq!(
        d.ok(&["table", "x"]),
        format!(
            "0 8192 crypt aes-xts-plain64 {} 0 {} 0\n",
            "0".repeat(64),
            f.display()
        )
    );
    let e = d.fails(&["resume", "x"]);
    assert!(e.contains("crypt key is not set"), "{e}");
    // I/O waits for a device that cannot resume until a key is set
    let sock = d.sock();
    let reader = std::thread::spawn(move || Client::connect(&sock, "x").read(0, 64 << 10));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!reader.is_finished(), "I/O went through a device without a key");
    let e = d.fails(&["message", "x", "0", "key", "set", &"5a".repeat(16)]);
    assert!(e.contains("key size may not change"), "{e}");
    assert!(!e.contains(&"5a".repeat(16)), "the error repeats the key: {e}");
    let e = d.fails(&["message", "x", "0", "key", "frob"]);
    assert!(e.contains("unrecognised message"), "{e}");
    d.ok(&["message", "x", "0", "key", "set", &key]);
    d.ok(&["resume", "x"]);
    assert!(
        reader.join().expect("reader") == data,
        "the read completes with the key set again"
    );
    assert_eq!(
        d.ok(&["table", "--showkeys", "x"]),
        format!("0 8192 crypt {table}\n")
    );
    // a wrong key of the right size resumes, and reads garbage, as the kernel's does
    d.ok(&["suspend", "x"]);
    d.ok(&["message", "x", "0", "key", "set", &"a5".repeat(32)]);
    d.ok(&["resume", "x"]);
    assert!(Client::connect(&d.sock(), "x").read(0, 4096) != data[..4096]);
}

#[test]
fn a_restarted_daemon_restores_crypt_waiting_for_its_key_never_recorded() {
    use std::os::unix::fs::PermissionsExt;
    let d = Daemon::start("crypt-restore");
    let f = d.dir.sparse("f.img", 4 * MIB);
    let key = "c3".repeat(32);
    d.create(
        "x",
        &format!(
            "0 8192 crypt aes-xts-plain64 {key} 0 {} 0 1 no_read_workqueue",
            f.display()
        ),
    );
    let mut c = Client::connect(&d.sock(), "x");
    let data = pattern(5, 128 << 10);
    c.write(4096, &data);
    drop(c);
    // the message that failed and the table itself never reach the log
    let _ = d.cli(&["message", "x", "0", "key", "set", &key]);
    assert!(!d.log().contains(&key), "the daemon logged the key");
    let state = d.run.join("devices.state");
    let mode = std::fs::metadata(&state)
        .expect("state file")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the state file is owner-only");
    let recorded = std::fs::read_to_string(&state).expect("state");
    assert!(
        !recorded.contains(&key),
        "the key reached the state file:\n{recorded}"
    );
    let d = d.kill9_and_restore();
    assert!(!d.log().contains(&key), "the restoring daemon logged the key");
    // back, suspended with its key wiped: waiting for it
    assert_eq!(d.info_line("x", "State:"), "State:             SUSPENDED");
    let e = d.fails(&["resume", "x"]);
    assert!(e.contains("crypt key is not set"), "{e}");
    assert!(d
        .log()
        .contains("device 'x' is restored suspended, waiting for its dm-crypt key"));
    d.ok(&["message", "x", "0", "key", "set", &key]);
    d.ok(&["resume", "x"]);
    let mut c = Client::connect(&d.sock(), "x");
    assert!(
        c.read(4096, data.len()) == data,
        "the restored crypt device reads the data once its key is set"
    );
    // removed, its table leaves no trace of the key in the run directory
    drop(c);
    d.remove_closed("x");
    for e in std::fs::read_dir(&d.run).expect("run dir").flatten() {
        if e.path().is_file() {
            let b = std::fs::read(e.path()).unwrap_or_default();
            assert!(
                !String::from_utf8_lossy(&b).contains(&key),
                "{} holds the key",
                e.path().display()
            );
        }
    }
}

/// dm-crypt's integrity modes need a device below whose integrity profile is
/// theirs (dm-integrity without internal_hash, directly or through linear):
/// each mismatch is refused with the kernel's words; over a right one, data
/// reads back through the linear device and through the integrity device
/// itself, and the file holds no plaintext.
#[test]
fn integrity_modes_need_the_device_below_to_hold_their_tags() {
    let d = Daemon::start("crypt-aead");
    let f = d.dir.sparse("f.img", 16 * MIB);
    let g = d.dir.sparse("g.img", 4 * MIB);
    let k = "5a".repeat(96);
    let authenc = "capi:authenc(hmac(sha256),xts(aes))";
    let h = d.dir.sparse("h.img", 16 * MIB);
    let it = |name: &str, file: &std::path::Path, tag: u32| {
        d.create(
            name,
            &format!("0 8192 integrity {} 0 {tag} J 1 block_size:4096", file.display()),
        );
    };
    it("i32", &f, 32);
    it("i48", &h, 48);
    d.create("lin", "0 8192 linear /dev/mapper/i32 0");
    for (table, want) in [
        (format!("{authenc}-plain64 {k} 0 {} 0 2 integrity:32:aead sector_size:4096", g.display()), "Integrity profile not supported."),
        (format!("{authenc}-plain64 {k} 0 /dev/mapper/lin 0 2 integrity:48:aead sector_size:4096"), "Integrity profile tag size mismatch."),
        (format!("{authenc}-plain64 {k} 0 /dev/mapper/lin 0 1 integrity:32:aead"), "Integrity profile sector size mismatch."),
        (format!("{authenc}-plain64 {k} 0 /dev/mapper/lin 0 1 sector_size:4096"), "needs integrity:<bytes>:aead"),
        (format!("aes-xts-random {} 0 /dev/mapper/lin 0 1 sector_size:4096", "5a".repeat(64)), "Integrity profile not supported."),
        (format!("aes-xts-plain64 {} 0 /dev/mapper/lin 0 2 integrity:32:aead sector_size:4096", "5a".repeat(64)), "needs an AEAD cipher"),
        (format!("{authenc}-plain64 {k} 0 /dev/mapper/i48 0 2 integrity:48:aead sector_size:4096"), "auth tag size is not supported"),
        (format!("capi:authenc(hmac(md5),xts(aes))-plain64 {k} 0 /dev/mapper/lin 0 2 integrity:32:aead sector_size:4096"), "hmac(md5)"),
    ] {
        refused(&d, &format!("0 8192 crypt {table}"), want, &k);
    }
    d.create(
        "c",
        &format!(
            "0 8192 crypt {authenc}-plain64 {k} 0 /dev/mapper/lin 0 2 integrity:32:aead sector_size:4096"
        ),
    );
    assert_eq!(
        d.ok(&["table", "c"])
            .split_whitespace()
            .skip(7)
            .collect::<Vec<_>>()
            .join(" "),
        "0 2 integrity:32:aead sector_size:4096"
    );
    let data = pattern(12, 2 * MIB as usize);
    let mut c = Client::connect(&d.sock(), "c");
    c.write(MIB, &data);
    assert!(c.read(MIB, data.len()) == data, "reads back through linear");
    drop(c);
    d.wait_open_count("c", 0);
    d.remove_closed("c");
    d.create(
        "c2",
        &format!(
            "0 8192 crypt {authenc}-plain64 {k} 0 /dev/mapper/i32 0 2 integrity:32:aead sector_size:4096"
        ),
    );
    let mut c = Client::connect(&d.sock(), "c2");
    assert!(
        c.read(MIB, data.len()) == data,
        "reads back on the integrity device itself"
    );
    drop(c);
    let file = std::fs::read(&f).expect("image");
    assert!(
        !file
            .windows(4096)
            .step_by(4096)
            .any(|w| data.chunks(4096).any(|p| p == w)),
        "no block of plaintext in the file"
    );
}

/// An integrity-mode stack (dm-crypt's AEAD over a journal-mode integrity
/// device) killed with flushed writes in its journal: `serve --restore`
/// replays the journal (whose tags are dm-crypt's, not the integrity
/// device's to check), the crypt device comes back waiting for its key
/// (never recorded, MAC key included), and once given it the data reads
/// back, every MAC right.
#[test]
fn an_integrity_mode_stack_comes_back_after_a_kill_with_its_journal_replayed() {
    let d = Daemon::start("crypt-aead-kill");
    let f = d.dir.sparse("f.img", 16 * MIB);
    let key = "a7".repeat(96);
    d.create(
        "i",
        &format!("0 8192 integrity {} 0 32 J 1 block_size:4096", f.display()),
    );
    d.create(
        "c",
        &format!(
            "0 8192 crypt capi:authenc(hmac(sha256),xts(aes))-plain64 {key} 0 /dev/mapper/i 0 2 integrity:32:aead sector_size:4096"
        ),
    );
    let data = pattern(8, MIB as usize);
    let mut c = Client::connect(&d.sock(), "c");
    c.write(MIB, &data);
    assert_eq!(c.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
    drop(c);
    let recorded = std::fs::read_to_string(d.run.join("devices.state")).expect("state");
    assert!(!recorded.contains(&key[..64]), "a key reached the state file");
    let d = d.kill9_and_restore();
    assert!(!d.log().contains("tag mismatch"), "{}", d.log());
    assert_eq!(d.info_line("c", "State:"), "State:             SUSPENDED");
    d.ok(&["message", "c", "0", "key", "set", &key]);
    d.ok(&["resume", "c"]);
    let mut c = Client::connect(&d.sock(), "c");
    assert!(c.read(MIB, data.len()) == data, "the flushed writes read back");
}
