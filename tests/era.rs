//! dm-era through the daemon and an NBD client: writes in era 1, a
//! checkpoint, writes in era 2; the metadata dumped and listed by dmkit's era
//! tools and by the thin-provisioning-tools 1.x reference alike (taken live
//! with a metadata snapshot, and after the device is removed); metadata the
//! reference restored opened by the target; the kernel's errors for bad tables
//! and messages; lying metadata refused; and, after a SIGKILL under a write
//! load with flushes, every block written before the last acknowledged flush
//! found in a writeset of its era or a later one.

use crate::common;
use crate::thin_util;

use common::nbd::Client;
use common::{pattern, write_until_killed, Daemon, Rng, Scratch, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const BLOCK: u64 = 64 << 10; // 128 sectors
const ORIGIN: u64 = 64 << 20; // 1024 blocks

fn out(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"))
}

/// stdout of a command that must succeed with nothing on stderr but `stderr`.
fn ok(cmd: &mut Command, stderr: &str) -> String {
    let o = out(cmd);
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        stderr,
        "{cmd:?}: standard error"
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn dmkit_era(verb: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args(["era", verb]);
    c
}

fn reference(tool: &str) -> Command {
    Command::new(thin_util::tool(tool))
}

/// (used, total, era, snap) of the era device's status.
fn status(d: &Daemon, name: &str) -> (u64, u64, u32, String) {
    let s = d.ok(&["status", name]);
    let f: Vec<&str> = s.split_whitespace().collect();
    assert_eq!(f.len(), 7, "status: {s}");
    assert_eq!(
        &f[..4],
        ["0", &(ORIGIN / 512).to_string(), "era", "8"],
        "status: {s}"
    );
    let (used, total) = f[4].split_once('/').expect("used/total");
    (
        used.parse().expect("used"),
        total.parse().expect("total"),
        f[5].parse().expect("era"),
        f[6].to_string(),
    )
}

fn message(d: &Daemon, name: &str, words: &[&str]) {
    let mut a = vec!["message", name, "0"];
    a.extend_from_slice(words);
    assert_eq!(d.ok(&a), "", "message {words:?} prints nothing");
}

fn write_blocks(c: &mut Client, blocks: &[u64], seed: u64) {
    for &b in blocks {
        c.write(b * BLOCK + 4096, &pattern(seed + b, 8192));
    }
    assert_eq!(c.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
}

/// A copy of metadata a live device writes, once two reads 200 ms apart agree
/// (the worker is idle): what both tools then read.
fn settled_copy(meta: &Path, to: &Path) -> PathBuf {
    let t0 = Instant::now();
    let mut prev = std::fs::read(meta).expect("read metadata");
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let now = std::fs::read(meta).expect("read metadata");
        if now == prev {
            std::fs::write(to, &now).expect("write copy");
            return to.to_path_buf();
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "metadata never settled");
        prev = now;
    }
}

/// Both tools dump `meta` alike (plain and logical); dmkit's dump.
fn dumps_agree(meta: &Path) -> (String, String) {
    let ours = ok(dmkit_era("dump").arg(meta), "");
    let theirs = ok(reference("era_dump").arg(meta), "");
    assert_eq!(ours, theirs, "era_dump of {}", meta.display());
    let ours_l = ok(dmkit_era("dump").arg("--logical").arg(meta), "");
    let theirs_l = ok(reference("era_dump").arg("--logical").arg(meta), "");
    assert_eq!(ours_l, theirs_l, "era_dump --logical of {}", meta.display());
    (ours, ours_l)
}

/// Both tools' era_invalidate output (which must agree). `--metadata-snapshot`
/// is a flag, as in 1.2.2 and later; the 1.1 reference takes a value there.
fn invalidate(meta: &Path, since: u32, snap: bool) -> String {
    let a = ["--written-since".to_string(), since.to_string()];
    let (flag, valued): (&[&str], &[&str]) = if snap {
        (&["--metadata-snapshot"], &["--metadata-snapshot", "1"])
    } else {
        (&[], &[])
    };
    let ours = ok(dmkit_era("invalidate").args(&a).args(flag).arg(meta), "");
    let theirs = ok(reference("era_invalidate").args(&a).args(valued).arg(meta), "");
    assert_eq!(ours, theirs, "era_invalidate {a:?} {flag:?}");
    ours
}

/// Both checks pass on `meta`.
fn checks_pass(meta: &Path) {
    ok(dmkit_era("check").arg(meta), "Checking era metadata\n");
    ok(reference("era_check").arg(meta), "Checking era metadata\n");
}

/// The era of every block in a logical dump.
fn eras_of(logical: &str) -> Vec<u32> {
    let md = dmkit::era::xml::parse(logical.as_bytes()).expect("dump parses");
    assert!(md.writesets.is_empty(), "a logical dump has no writesets");
    let mut e = md.eras.clone();
    e.resize(md.sb.nr_blocks as usize, 0);
    e
}

const ERA1: [u64; 5] = [0, 5, 6, 7, 100];
const ERA2: [u64; 4] = [6, 200, 201, 1023];

#[test]
fn eras_dump_invalidate_and_the_reference() {
    let s = Scratch::new("era");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", ORIGIN);
    let table = format!(
        "0 {} era {} {} 128",
        ORIGIN / 512,
        meta.display(),
        origin.display()
    );
    let d = Daemon::start("era");
    d.create("e", &table);
    // a new metadata device is formatted, and the first resume starts era 1
    let (used, total, era, snap) = status(&d, "e");
    assert_eq!((total, era, snap.as_str()), (1024, 1, "-"));
    assert!(used > 3 && used < 20, "used {used}");
    assert_eq!(
        d.ok(&["table", "e"]).trim(),
        format!(
            "0 {} era {} {} 128",
            ORIGIN / 512,
            meta.display(),
            origin.display()
        )
    );

    let mut c = Client::connect(&d.sock(), "e");
    write_blocks(&mut c, &ERA1, 1);
    message(&d, "e", &["checkpoint"]);
    assert_eq!(status(&d, "e").2, 2);
    write_blocks(&mut c, &ERA2, 2);
    // what was written reads back
    assert_eq!(c.read(6 * BLOCK + 4096, 8192), pattern(2 + 6, 8192));
    assert_eq!(c.read(5 * BLOCK + 4096, 8192), pattern(1 + 5, 8192));

    // live: the snapshot archives era 2 and starts era 3
    message(&d, "e", &["take_metadata_snap"]);
    let (_, _, era, snap) = status(&d, "e");
    assert_eq!(era, 3);
    let snap: u64 = snap.parse().expect("the snapshot's block");
    assert!(snap > 0);
    let copy = settled_copy(&meta, &s.path("meta.live"));
    dumps_agree(&copy);
    checks_pass(&copy);
    let since2 = "<blocks>\n  <block block=\"6\"/>\n  <range begin=\"200\" end=\"202\"/>\n  <block block=\"1023\"/>\n</blocks>";
    assert_eq!(invalidate(&copy, 2, true), since2);
    let since1 = "<blocks>\n  <block block=\"0\"/>\n  <range begin=\"5\" end=\"8\"/>\n  <block block=\"100\"/>\n  <range begin=\"200\" end=\"202\"/>\n  <block block=\"1023\"/>\n</blocks>";
    assert_eq!(invalidate(&copy, 1, true), since1);
    assert_eq!(invalidate(&copy, 3, true), "<blocks>\n</blocks>");
    message(&d, "e", &["drop_metadata_snap"]);
    assert_eq!(status(&d, "e").3, "-");

    // removed: the current era is archived; the eras are in the array or the writesets
    drop(c);
    d.remove_closed("e");
    let (dump, logical) = dumps_agree(&meta);
    assert!(
        dump.starts_with("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"1024\" current_era=\"3\">\n")
    );
    checks_pass(&meta);
    let eras = eras_of(&logical);
    for (b, &e) in eras.iter().enumerate() {
        let want = if ERA2.contains(&(b as u64)) {
            2
        } else if ERA1.contains(&(b as u64)) {
            1
        } else {
            0
        };
        assert_eq!(e, want, "era of block {b}");
    }

    // a new daemon carries on from the metadata: the resume starts era 4
    drop(d);
    let d = Daemon::start("era-again");
    d.create("e", &table);
    assert_eq!(status(&d, "e").2, 4);
    let mut c = Client::connect(&d.sock(), "e");
    write_blocks(&mut c, &[3], 4);
    message(&d, "e", &["take_metadata_snap"]);
    let copy = settled_copy(&meta, &s.path("meta.again"));
    assert_eq!(
        invalidate(&copy, 4, true),
        "<blocks>\n  <block block=\"3\"/>\n</blocks>"
    );
    checks_pass(&copy);
}

/// era_invalidate as thin-provisioning-tools 1.3.3 fixed it: with no archived
/// writeset (every era digested into the array) the array says what was
/// written since the threshold (1.1, the reference here, lists nothing then);
/// with writesets from the threshold or before, the array is not read; and
/// `--metadata-snapshot` is a flag. The metadata and the expected lists are
/// 1.3.3's own test cases (`tests/era_invalidate.rs`), restored here by both
/// tools.
#[test]
fn invalidate_reads_the_era_array_when_no_writeset_is_left_as_1_3_3() {
    let s = Scratch::new("era-inval");
    let mut array = String::from("  <era_array>\n");
    for b in 0..16 {
        let era = if b < 5 { b + 1 } else { 0 };
        array.push_str(&format!("    <era block=\"{b}\" era=\"{era}\"/>\n"));
    }
    array.push_str("  </era_array>\n");
    let head = "<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"16\" current_era=\"5\">\n";
    let bits = |era: u32, set: &[u32]| {
        let mut w = format!("  <writeset era=\"{era}\" nr_bits=\"16\">\n");
        for b in 0..16 {
            w.push_str(&format!(
                "    <bit block=\"{b}\" value=\"{}\"/>\n",
                set.contains(&b)
            ));
        }
        w + "  </writeset>\n"
    };
    let restore = |name: &str, xml: String, by_reference: bool| -> PathBuf {
        let x = s.path(&format!("{name}.xml"));
        std::fs::write(&x, xml).expect("xml");
        let meta = s.sparse(name, 4 << 20);
        let mut c = if by_reference {
            reference("era_restore")
        } else {
            dmkit_era("restore")
        };
        ok(c.arg("-i").arg(&x).arg("-o").arg(&meta), "");
        meta
    };
    let ours = |meta: &Path, a: &[&str]| ok(dmkit_era("invalidate").args(a).arg(meta), "");
    let list = |ranges: &str| format!("<blocks>\n{ranges}</blocks>");

    // no writesets: eras 1..5 on blocks 0..4, the rest never written
    for by_reference in [false, true] {
        let meta = restore("none", format!("{head}{array}</superblock>"), by_reference);
        assert_eq!(
            ours(&meta, &["--written-since", "0"]),
            list("  <range begin=\"0\" end=\"16\"/>\n")
        );
        assert_eq!(
            ours(&meta, &["--written-since", "3"]),
            list("  <range begin=\"2\" end=\"5\"/>\n")
        );
        assert_eq!(ours(&meta, &["--written-since", "6"]), list(""));
        // the difference from the 1.1 reference is 1.3.3's fix
        assert_eq!(
            ok(
                reference("era_invalidate")
                    .args(["--written-since", "3"])
                    .arg(&meta),
                ""
            ),
            list("")
        );
    }

    // writesets of eras 3 (blocks 0, 1) and 4 (blocks 4, 5) over the same array
    let meta = restore(
        "sets",
        format!(
            "{head}{}{}{array}</superblock>",
            bits(3, &[0, 1]),
            bits(4, &[4, 5])
        ),
        false,
    );
    // from era 3 on: the writesets alone, the oldest (3) covering the threshold
    assert_eq!(
        invalidate(&meta, 3, false),
        list("  <range begin=\"0\" end=\"2\"/>\n  <range begin=\"4\" end=\"6\"/>\n")
    );
    // from era 4 on: era 4's writeset alone
    assert_eq!(
        invalidate(&meta, 4, false),
        list("  <range begin=\"4\" end=\"6\"/>\n")
    );
    // from era 2 on: the writesets and the array's blocks of eras 2..5
    assert_eq!(
        invalidate(&meta, 2, false),
        list("  <range begin=\"0\" end=\"6\"/>\n")
    );

    // the flag alone selects the snapshot; without one there is nothing to read
    let o = out(dmkit_era("invalidate")
        .args(["--written-since", "0", "--metadata-snapshot"])
        .arg(&meta));
    assert!(!o.status.success(), "no metadata snapshot to read");
    let o = out(dmkit_era("invalidate")
        .args(["--metadata-snapshot", "1", "--written-since", "0"])
        .arg(&meta));
    assert!(!o.status.success(), "a value after the flag is a second input");
}

#[test]
fn the_reference_restore_opens_and_dmkit_restore_reads_back() {
    let s = Scratch::new("era-restore");
    let xml = s.path("in.xml");
    let mut text =
        String::from("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"1024\" current_era=\"7\">\n");
    text.push_str("  <writeset era=\"7\" nr_bits=\"1024\">\n");
    for b in 0..1024 {
        text.push_str(&format!(
            "    <bit block=\"{b}\" value=\"{}\"/>\n",
            b == 9 || b == 10
        ));
    }
    text.push_str("  </writeset>\n  <era_array>\n");
    for b in 0..1024 {
        text.push_str(&format!(
            "    <era block=\"{b}\" era=\"{}\"/>\n",
            if b < 4 { 6 } else { 0 }
        ));
    }
    text.push_str("  </era_array>\n</superblock>");
    std::fs::write(&xml, &text).unwrap();

    // the reference's restore, dumped by both alike and opened by the target
    let meta = s.sparse("meta", 4 << 20);
    ok(
        reference("era_restore").arg("-i").arg(&xml).arg("-o").arg(&meta),
        "",
    );
    let (dump, _) = dumps_agree(&meta);
    assert_eq!(dump, text);
    checks_pass(&meta);
    let origin = s.sparse("origin", ORIGIN);
    let d = Daemon::start("era-restore");
    d.create(
        "e",
        &format!(
            "0 {} era {} {} 128",
            ORIGIN / 512,
            meta.display(),
            origin.display()
        ),
    );
    assert_eq!(status(&d, "e").2, 8);
    let mut c = Client::connect(&d.sock(), "e");
    write_blocks(&mut c, &[500], 8);
    drop(c);
    d.remove_closed("e");
    checks_pass(&meta);
    let (_, logical) = dumps_agree(&meta);
    let eras = eras_of(&logical);
    assert_eq!((eras[0], eras[3], eras[4], eras[9], eras[500]), (6, 6, 0, 7, 8));

    // dmkit's restore of the same XML: the reference dumps it back as it was
    let mine = s.sparse("mine", 4 << 20);
    ok(dmkit_era("restore").arg("-i").arg(&xml).arg("-o").arg(&mine), "");
    assert_eq!(ok(reference("era_dump").arg(&mine), ""), text);
    checks_pass(&mine);
    assert_eq!(
        invalidate(&mine, 7, false),
        "<blocks>\n  <range begin=\"9\" end=\"11\"/>\n</blocks>"
    );
}

#[test]
fn bad_tables_and_messages_give_the_kernels_errors() {
    let s = Scratch::new("era-bad");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", ORIGIN);
    let (m, o) = (meta.display().to_string(), origin.display().to_string());
    let n = ORIGIN / 512;
    let d = Daemon::start("era-bad");
    for (args, err) in [
        (format!("{m} {o}"), "Invalid argument count"),
        (format!("{m} {o} 128 1"), "Invalid argument count"),
        (format!("{m} {o} x"), "Error parsing block size"),
        (format!("{m} {o} 0"), "Invalid block size"),
        (format!("{m} {o} 12"), "Invalid block size"),
        (
            format!("{}/none {o} 128", s.0.display()),
            "Error opening metadata device",
        ),
        (
            format!("{m} {}/none 128", s.0.display()),
            "Error opening data device",
        ),
    ] {
        let o = d.cli_in(&["create", "x"], &format!("0 {n} era {args}"));
        assert!(!o.status.success(), "era {args} was accepted");
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(e.contains(err), "era {args}: {e}");
    }
    d.create("e", &format!("0 {n} era {m} {o} 128"));
    for (words, err) in [
        (vec!["checkpoint", "now"], "incorrect number of message arguments"),
        (vec!["rollover"], "unsupported message 'rollover'"),
        (vec!["drop_metadata_snap"], "no snap to drop"),
    ] {
        let mut a = vec!["message", "e", "0"];
        a.extend_from_slice(&words);
        let e = d.fails(&a);
        assert!(e.contains(err), "{words:?}: {e}");
    }
    // names match without case, as the kernel's strcasecmp
    message(&d, "e", &["Take_Metadata_Snap"]);
    let e = d.fails(&["message", "e", "0", "take_metadata_snap"]);
    assert!(e.contains("metadata snapshot already exists"), "{e}");
    message(&d, "e", &["drop_metadata_snap"]);
    d.ok(&["remove", "e"]);
    // the metadata's block size is the one it was made with
    let o2 = d.cli_in(&["create", "x"], &format!("0 {n} era {m} {o} 256"));
    let e = String::from_utf8_lossy(&o2.stderr);
    assert!(
        e.contains("Error reading metadata")
            && e.contains("changing the data block size (from 128 to 256) is not supported"),
        "{e}"
    );
}

/// Rewrite a field of the era superblock in `meta` and seal it again with a
/// valid checksum.
fn lie(meta: &Path, off: usize, bytes: &[u8]) {
    let mut img = std::fs::read(meta).unwrap();
    img[off..off + bytes.len()].copy_from_slice(bytes);
    let c = dmkit::pdata::checksum::block_csum(&img[..4096], 146_538_381);
    img[..4].copy_from_slice(&c.to_le_bytes());
    std::fs::write(meta, img).unwrap();
}

#[test]
fn lying_metadata_is_refused_with_a_clear_error() {
    let s = Scratch::new("era-lie");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", ORIGIN);
    let table = format!(
        "0 {} era {} {} 128",
        ORIGIN / 512,
        meta.display(),
        origin.display()
    );
    let d = Daemon::start("era-lie");
    d.create("e", &table);
    d.ok(&["remove", "e"]);
    let good = std::fs::read(&meta).unwrap();
    // nr_blocks (offset 180): more than the era array holds, and past 2^31
    for (nr, what) in [
        (5000u32, "array has 2 blocks, but its 5000 entries need 5"),
        (u32::MAX, "nr_blocks is 4294967295, more than 2^31 - 1"),
    ] {
        std::fs::write(&meta, &good).unwrap();
        lie(&meta, 180, &nr.to_le_bytes());
        let o = d.cli_in(&["create", "x"], &table);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && e.contains("Error reading metadata") && e.contains(what),
            "{e}"
        );
        for tool in ["dump", "check"] {
            let o = out(dmkit_era(tool).arg(&meta));
            assert_eq!(o.status.code(), Some(64), "era {tool}");
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(e.contains(what), "era {tool}: {e}");
        }
    }
    // the era array's root past the device's end
    std::fs::write(&meta, &good).unwrap();
    lie(&meta, 208, &(1u64 << 40).to_le_bytes());
    let o = d.cli_in(&["create", "x"], &table);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("era array root is 1099511627776, more than the metadata device's last block (1023)"),
        "{e}"
    );
    let o = out(dmkit_era("invalidate").args(["--written-since", "0"]).arg(&meta));
    assert_eq!(o.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&o.stderr).contains("era array root is 1099511627776"));
    // the intact metadata still opens
    std::fs::write(&meta, &good).unwrap();
    d.create("e", &table);
}

#[test]
fn sigkill_under_load_keeps_every_flushed_write_in_its_era_or_later() {
    const BS: u64 = 4096;
    const SIZE: u64 = 8 << 20;
    let nb = (SIZE / BS) as usize;
    let s = Scratch::new("era-crash");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", SIZE);
    let table = format!("0 {} era {} {} 8", SIZE / 512, meta.display(), origin.display());
    let mut rng = Rng(0xe7a);
    let mut seed = 1u64 << 32;
    for round in 0..3 {
        let mut d = Daemon::start(&format!("era-crash-{round}"));
        d.create("e", &table);
        let era0 = {
            let st = d.ok(&["status", "e"]);
            st.split_whitespace()
                .nth(5)
                .and_then(|e| e.parse::<u32>().ok())
                .expect("era")
        };
        let load = write_until_killed(d.sock(), &["e"], |_: &mut Rng| 0, nb, BS, Rng(rng.next()), seed);
        // checkpoints while the load runs, then the kill after some flushed writes
        let n = 100 + rng.below(300) as usize;
        let t0 = Instant::now();
        while !load.wait_flushed(n, Duration::from_millis(30)) && t0.elapsed() < Duration::from_secs(60) {
            let _ = d.cli(&["message", "e", "0", "checkpoint"]);
        }
        d.kill9();
        let log = load.finish();
        assert!(
            log.1 >= n,
            "round {round}: {} writes covered by a flush, not {n}",
            log.1
        );
        seed = log.0.last().map_or(seed, |x| x.2) + 1;
        // the metadata after the crash: every flushed write's block is dated
        // era0 or later (in the array or in a writeset the logical dump folds in)
        checks_pass(&meta);
        let (_, logical) = dumps_agree(&meta);
        let eras = eras_of(&logical);
        for &(_, b, _) in &log.0[..log.1] {
            assert!(
                eras[b] >= era0,
                "round {round}: block {b} written in era {era0} or later is dated {}",
                eras[b]
            );
        }
        // and the data is there
        let got = std::fs::read(&origin).unwrap();
        let mut last = vec![None; nb];
        for &(_, b, sd) in &log.0[..log.1] {
            last[b] = Some(sd);
        }
        for (b, sd) in last.iter().enumerate() {
            if let (Some(sd), false) = (sd, log.0[log.1..].iter().any(|x| x.1 == b)) {
                assert_eq!(
                    &got[b * BS as usize..(b + 1) * BS as usize],
                    &pattern(*sd, BS as usize)[..],
                    "block {b}"
                );
            }
        }
    }
}

#[test]
fn suspend_resume_and_a_table_swap_start_new_eras_and_keep_the_marks() {
    let s = Scratch::new("era-swap");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", ORIGIN);
    let table = format!(
        "0 {} era {} {} 128",
        ORIGIN / 512,
        meta.display(),
        origin.display()
    );
    let d = Daemon::start("era-swap");
    d.create("e", &table);
    let mut c = Client::connect(&d.sock(), "e");
    write_blocks(&mut c, &[10], 1);
    // as the kernel: the suspend archives the era, the resume starts the next
    d.ok(&["suspend", "e"]);
    d.ok(&["resume", "e"]);
    assert_eq!(status(&d, "e").2, 2);
    write_blocks(&mut c, &[11], 2);
    // a new table on the same metadata takes over what the old one committed
    d.reload("e", &table);
    assert_eq!(status(&d, "e").2, 3);
    write_blocks(&mut c, &[12], 3);
    message(&d, "e", &["take_metadata_snap"]);
    let copy = settled_copy(&meta, &s.path("meta.copy"));
    assert_eq!(
        invalidate(&copy, 3, true),
        "<blocks>\n  <block block=\"12\"/>\n</blocks>"
    );
    assert_eq!(
        invalidate(&copy, 1, true),
        "<blocks>\n  <range begin=\"10\" end=\"13\"/>\n</blocks>"
    );
    checks_pass(&copy);
    drop(c);
    d.remove_closed("e");
    let eras = eras_of(&dumps_agree(&meta).1);
    assert_eq!((eras[10], eras[11], eras[12], eras[13]), (1, 2, 3, 0));
}

#[test]
fn sigkill_between_checkpoints_dates_every_flushed_write_its_era_or_later() {
    const BS: u64 = 4096;
    const SIZE: u64 = 4 << 20;
    let nb = SIZE / BS;
    let s = Scratch::new("era-crash-eras");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", SIZE);
    let table = format!("0 {} era {} {} 8", SIZE / 512, meta.display(), origin.display());
    let mut rng = Rng(0xe7a5);
    for round in 0..3 {
        let mut d = Daemon::start(&format!("era-crash-eras-{round}"));
        d.create("e", &table);
        let era0: u32 = d
            .ok(&["status", "e"])
            .split_whitespace()
            .nth(5)
            .and_then(|e| e.parse().ok())
            .expect("era");
        // one thread: 20 writes, a flush, a checkpoint, ... so each write's era is known
        let (sock, run) = (d.sock(), d.run.clone());
        let mut wr = Rng(rng.next());
        let log = std::sync::Arc::new(std::sync::Mutex::new((Vec::<(u64, u32)>::new(), 0usize)));
        let l2 = log.clone();
        let writer = std::thread::spawn(move || {
            let mut c = Client::connect(&sock, "e");
            for k in 0u32.. {
                for _ in 0..20 {
                    let b = wr.below(nb);
                    l2.lock().unwrap().0.push((b, era0 + k));
                    if c.try_call(common::nbd::WRITE, b * BS, &pattern(b, BS as usize)) != Some(0) {
                        return;
                    }
                }
                if c.try_call(common::nbd::FLUSH, 0, &[]) != Some(0) {
                    return;
                }
                let mut l = l2.lock().unwrap();
                l.1 = l.0.len();
                drop(l);
                let o = Command::new(BIN)
                    .arg("--run-dir")
                    .arg(&run)
                    .args(["message", "e", "0", "checkpoint"])
                    .output();
                if !o.is_ok_and(|o| o.status.success()) {
                    return;
                }
            }
        });
        let want = 200 + rng.below(400) as usize;
        let t0 = Instant::now();
        while log.lock().unwrap().1 < want && t0.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(2));
        }
        d.kill9();
        writer.join().expect("writer");
        let (writes, flushed) = std::mem::take(&mut *log.lock().unwrap());
        assert!(
            flushed >= want,
            "round {round}: {flushed} flushed writes, not {want}"
        );
        checks_pass(&meta);
        let eras = eras_of(&dumps_agree(&meta).1);
        let mut latest = vec![0u32; nb as usize];
        for &(b, e) in &writes[..flushed] {
            latest[b as usize] = latest[b as usize].max(e);
        }
        let last = writes.last().map_or(era0, |w| w.1);
        for (b, (&got, &min)) in eras.iter().zip(&latest).enumerate() {
            assert!(
                got >= min && got <= last,
                "round {round}: block {b}, last flushed write in era {min}, is dated {got} (eras up to {last})"
            );
        }
    }
}

/// The metadata and the origin may be other dmkit devices, as LVM stacks them:
/// the metadata is then read and written through its device's table (a linear
/// over a file here), and what the era recorded is in that file.
#[test]
fn era_over_dmkit_devices() {
    let s = Scratch::new("era-dm");
    let meta = s.sparse("meta", 4 << 20);
    let origin = s.sparse("origin", ORIGIN);
    let d = Daemon::start("era-dm");
    d.create(
        "m",
        &format!("0 {} linear {} 0", (4u64 << 20) / 512, meta.display()),
    );
    d.create("o", &format!("0 {} linear {} 0", ORIGIN / 512, origin.display()));
    d.create(
        "e",
        &format!("0 {} era /dev/mapper/m /dev/mapper/o 128", ORIGIN / 512),
    );
    assert_eq!(status(&d, "e").2, 1);
    let mut c = Client::connect(&d.sock(), "e");
    write_blocks(&mut c, &ERA1, 1);
    message(&d, "e", &["checkpoint"]);
    write_blocks(&mut c, &ERA2, 2);
    assert_eq!(c.read(6 * BLOCK + 4096, 8192), pattern(2 + 6, 8192));
    drop(c);
    d.remove_closed("e");
    d.ok(&["remove", "m", "o"]);
    // the era's writes are on the origin's file, its record on the metadata's
    assert_eq!(
        common::read_at(&origin, 6 * BLOCK + 4096, 8192),
        pattern(2 + 6, 8192)
    );
    checks_pass(&meta);
    let since2 = "<blocks>\n  <block block=\"6\"/>\n  <range begin=\"200\" end=\"202\"/>\n  <block block=\"1023\"/>\n</blocks>";
    assert_eq!(invalidate(&meta, 2, false), since2);
}
