//! The cache tools side by side with the thin-provisioning-tools 1.x
//! reference: metadata the reference restored is checked and dumped by dmkit
//! (and the other way), versions 1 and 2; cache_metadata_size's figures and
//! errors; cache_repair of metadata whose space map is damaged; lying metadata
//! refused; cache_writeback's copies checked against the data a cache shows;
//! the multi-call names.

use crate::common;
use crate::thin_util;

use common::{Rng, Scratch, BIN};
use dmkit::pdata::cache::seal;
use dmkit::pdata::{BlockKind, BLOCK_SIZE};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn out(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"))
}

/// (exit code, stdout, stderr).
fn run(cmd: &mut Command) -> (i32, String, String) {
    let o = out(cmd);
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// stdout of a command that must succeed with nothing on stderr.
fn ok(cmd: &mut Command) -> String {
    let (code, o, e) = run(cmd);
    assert_eq!((code, e.as_str()), (0, ""), "{cmd:?}");
    o
}

fn dmkit(verb: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args(["cache", verb]);
    c
}

fn reference(tool: &str) -> Command {
    Command::new(thin_util::tool(tool))
}

/// Cache XML as 1.x writes it: `nr` cache blocks, every third one mapped (to
/// a scattered origin block), some dirty, each mapped one with a hint.
fn xml(nr: u32, seed: u64) -> String {
    let mut r = Rng(seed);
    let mut s = format!(
        "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"{nr}\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n"
    );
    let mapped: Vec<u32> = (0..nr).filter(|c| c % 3 == 0).collect();
    for &c in &mapped {
        let dirty = r.below(4) == 0;
        s += &format!(
            "    <mapping cache_block=\"{c}\" origin_block=\"{}\" dirty=\"{dirty}\"/>\n",
            (c as u64 * 7 + 11) % (nr as u64 * 3)
        );
    }
    s += "  </mappings>\n  <hints>\n";
    for &c in &mapped {
        let h = (r.next() as u32).to_le_bytes();
        s += &format!(
            "    <hint cache_block=\"{c}\" data=\"{}\"/>\n",
            dmkit::cache::xml::base64(&h)
        );
    }
    s + "  </hints>\n</superblock>"
}

fn restore_with(tool: Command, s: &Scratch, name: &str, text: &str, version: &str) -> PathBuf {
    let x = s.path(&format!("{name}.xml"));
    std::fs::write(&x, text).unwrap();
    let m = s.sparse(name, 8 << 20);
    let mut tool = tool;
    ok(tool
        .arg("-i")
        .arg(&x)
        .arg("-o")
        .arg(&m)
        .args(["--metadata-version", version]));
    m
}

/// Both dumps of `m`, which must agree; dmkit's.
fn dumps_agree(m: &Path) -> String {
    let ours = ok(dmkit("dump").arg(m));
    let theirs = ok(reference("cache_dump").arg(m));
    assert_eq!(ours, theirs, "cache_dump of {}", m.display());
    ours
}

fn checks_pass(m: &Path) {
    assert_eq!(ok(dmkit("check").arg(m)), "");
    assert_eq!(ok(reference("cache_check").arg(m)), "");
}

#[test]
fn restores_checks_and_dumps_agree_both_ways() {
    let s = Scratch::new("cache-tools");
    for version in ["1", "2"] {
        let text = xml(3000, 7 + version.len() as u64);
        // the reference's metadata, read by dmkit
        let theirs = restore_with(
            reference("cache_restore"),
            &s,
            &format!("ref{version}"),
            &text,
            version,
        );
        checks_pass(&theirs);
        assert_eq!(dumps_agree(&theirs), text);
        // dmkit's metadata, read by the reference
        let ours = restore_with(dmkit("restore"), &s, &format!("ours{version}"), &text, version);
        checks_pass(&ours);
        assert_eq!(dumps_agree(&ours), text);
        assert_eq!(std::fs::read(&ours).unwrap()[40], version.as_bytes()[0] - b'0');
        // dump -o writes the same
        let o = s.path("out.xml");
        ok(dmkit("dump").arg("-o").arg(&o).arg(&ours));
        assert_eq!(std::fs::read_to_string(&o).unwrap(), text);
    }
    // a cache with nothing mapped
    let empty = "<superblock uuid=\"\" block_size=\"64\" nr_cache_blocks=\"10\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n  </mappings>\n  <hints>\n  </hints>\n</superblock>";
    let m = restore_with(dmkit("restore"), &s, "empty", empty, "2");
    checks_pass(&m);
    assert_eq!(dumps_agree(&m), empty);
    // and one of no blocks (1.x cannot restore it: "array index out of bounds")
    let none = empty.replace("\"10\"", "\"0\"");
    let m = restore_with(dmkit("restore"), &s, "none", &none, "1");
    assert_eq!(ok(dmkit("check").arg(&m)), "");
    assert_eq!(ok(dmkit("dump").arg(&m)), none);
    // one whose clean flag is left clear
    let x = s.path("unclean.xml");
    std::fs::write(&x, xml(100, 1)).unwrap();
    let m = s.sparse("unclean", 4 << 20);
    ok(dmkit("restore")
        .arg("-i")
        .arg(&x)
        .arg("-o")
        .arg(&m)
        .arg("--omit-clean-shutdown"));
    assert_eq!(std::fs::read(&m).unwrap()[4] & 1, 0);
    checks_pass(&m);
}

#[test]
fn usage_and_input_errors_as_the_reference() {
    let s = Scratch::new("cache-errors");
    let m = s.sparse("zero", 4 << 20);
    let small = s.sparse("small", 8192);
    let x = s.path("a.xml");
    std::fs::write(&x, xml(30, 3)).unwrap();
    let missing = s.path("missing");
    let cases: Vec<(&str, Vec<&std::ffi::OsStr>)> = vec![
        ("cache_check", vec![m.as_os_str()]),
        ("cache_check", vec![missing.as_os_str()]),
        ("cache_check", vec![x.as_os_str()]),
        ("cache_dump", vec![m.as_os_str()]),
        (
            "cache_restore",
            vec!["-i".as_ref(), x.as_os_str(), "-o".as_ref(), missing.as_os_str()],
        ),
        (
            "cache_restore",
            vec!["-i".as_ref(), missing.as_os_str(), "-o".as_ref(), m.as_os_str()],
        ),
        (
            "cache_restore",
            vec!["-i".as_ref(), x.as_os_str(), "-o".as_ref(), small.as_os_str()],
        ),
        (
            "cache_repair",
            vec!["-i".as_ref(), m.as_os_str(), "-o".as_ref(), small.as_os_str()],
        ),
        (
            "cache_repair",
            vec!["-i".as_ref(), m.as_os_str(), "-o".as_ref(), m.as_os_str()],
        ),
        // an empty path is a file that cannot be found, not a usage error
        ("cache_check", vec!["".as_ref()]),
        ("cache_dump", vec!["".as_ref()]),
        (
            "cache_restore",
            vec!["-i".as_ref(), "".as_ref(), "-o".as_ref(), m.as_os_str()],
        ),
        (
            "cache_repair",
            vec!["-i".as_ref(), "".as_ref(), "-o".as_ref(), m.as_os_str()],
        ),
        (
            "cache_repair",
            vec!["-i".as_ref(), m.as_os_str(), "-o".as_ref(), "".as_ref()],
        ),
    ];
    for (tool, args) in cases {
        let verb = tool.trim_start_matches("cache_");
        let ours = run(dmkit(verb).args(&args));
        let theirs = run(reference(tool).args(&args));
        assert_eq!(ours, theirs, "{tool} {args:?}");
        assert_eq!(ours.0, 64, "{tool} {args:?}");
    }
    // clap's usage errors: exit 2 for both
    let (code, _, e) = run(dmkit("restore").args(["-i", "x", "-o", "y", "--metadata-version", "3"]));
    assert_eq!(code, 2);
    assert!(
        e.contains("invalid value '3' for '--metadata-version <NUM>'"),
        "{e}"
    );
    assert_eq!(
        run(reference("cache_restore").args(["-i", "x", "-o", "y", "--metadata-version", "3"])).0,
        2
    );
}

#[test]
fn metadata_size_as_the_reference() {
    for args in [
        "--nr-blocks 1000",
        "--nr-blocks 0",
        "--nr-blocks 1000000",
        "--nr-blocks 4294967296",
        "--device-size 1G --block-size 64k",
        "--device-size 10G --block-size 256k --max-hint-width 8",
        "--device-size 100 --block-size 64",
        "--nr-blocks 100 -n",
        "--nr-blocks 1000 -n=short -u k",
        "--nr-blocks 1000 -u m",
        "--nr-blocks 1000 --max-hint-width 0",
        "",
        "--device-size 1G --block-size 48k",
        "--device-size 1G --block-size 2g",
        "--device-size 10k --block-size 32k",
    ] {
        let a: Vec<&str> = args.split_whitespace().collect();
        let ours = run(dmkit("metadata_size").args(&a));
        let theirs = run(reference("cache_metadata_size").args(&a));
        assert_eq!(ours, theirs, "cache_metadata_size {args}");
    }
    let (code, o, _) = run(dmkit("metadata_size").args(["--nr-blocks", "1000"]));
    assert_eq!((code, o.as_str()), (0, "8246.69 sectors\n"));
    // clap's errors, as the reference's (exit 2)
    for args in [
        "--device-size 1G",
        "--nr-blocks 10 --block-size 64k",
        "--nr-blocks abc",
        "--nr-blocks 10 -u x",
    ] {
        let a: Vec<&str> = args.split_whitespace().collect();
        assert_eq!(run(dmkit("metadata_size").args(&a)).0, 2, "{args}");
        assert_eq!(run(reference("cache_metadata_size").args(&a)).0, 2, "{args}");
    }
}

/// Block `b` of a metadata file.
fn block(m: &Path, b: u64) -> Vec<u8> {
    let d = std::fs::read(m).unwrap();
    d[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].to_vec()
}

fn put_block(m: &Path, b: u64, data: &[u8]) {
    let mut d = std::fs::read(m).unwrap();
    d[b as usize * BLOCK_SIZE..(b as usize + 1) * BLOCK_SIZE].copy_from_slice(data);
    std::fs::write(m, d).unwrap();
}

#[test]
fn repair_of_a_damaged_space_map_as_the_reference() {
    let s = Scratch::new("cache-repair");
    for version in ["1", "2"] {
        let text = xml(2000, 5);
        let m = restore_with(dmkit("restore"), &s, &format!("m{version}"), &text, version);
        // the metadata space map's index block (the superblock's sm root)
        let sb = block(&m, 0);
        let index = u64::from_le_bytes(sb[80..88].try_into().unwrap());
        put_block(&m, index, &[0u8; BLOCK_SIZE]);
        let (code, o, e) = run(dmkit("check").arg(&m));
        assert_eq!((code, o.as_str()), (64, ""));
        assert_eq!(
            e,
            format!(
                "metadata space map: metadata block {index} (space map index block): bad checksum (on disk 0x00000000, computed 0x58cfd54f)\nmetadata contains errors\n"
            )
        );
        assert_eq!(run(reference("cache_check").arg(&m)).0, 64);
        let (ours, theirs) = (s.sparse("ours", 8 << 20), s.sparse("theirs", 8 << 20));
        ok(dmkit("repair").arg("-i").arg(&m).arg("-o").arg(&ours));
        ok(reference("cache_repair").arg("-i").arg(&m).arg("-o").arg(&theirs));
        checks_pass(&ours);
        checks_pass(&theirs);
        assert_eq!(dumps_agree(&ours), text);
        assert_eq!(dumps_agree(&theirs), text);
    }
}

/// Make `n` free metadata blocks of `m` leak: their counts set to one with
/// nothing referencing them, committed as the target commits (the space map,
/// then the superblock naming it). The blocks.
fn leak(m: &Path, n: usize) -> Vec<u64> {
    use dmkit::pdata::space_map::SmKind;
    let dev = dmkit::pdata::FileDev::open(m, true).unwrap();
    let mut cache = dmkit::pdata::cache::BlockCache::new(Box::new(dev), 64);
    let mut sb = dmkit::cache::superblock::read(&mut cache, 0).unwrap();
    let mut tm = dmkit::pdata::sm_disk::open_tm(cache, &sb.sm_root).unwrap();
    let sm = tm.sm(SmKind::Metadata);
    let free: Vec<u64> = (0..sm.nr_blocks())
        .filter(|&b| sm.count(b) == 0)
        .take(n)
        .collect();
    for &b in &free {
        tm.sm(SmKind::Metadata).set(b, 1).unwrap();
    }
    let (root, _) = dmkit::pdata::sm_disk::commit(&mut tm).unwrap();
    sb.sm_root = root;
    tm.cache.write_dirty().unwrap();
    tm.cache.flush().unwrap();
    tm.cache
        .write_through(0, BlockKind::CacheSuperblock, &sb.encode())
        .unwrap();
    tm.cache.flush().unwrap();
    free
}

/// cache_check with leaked metadata blocks, as 1.x: refused without
/// `--auto-repair` (the same words), repaired with it (the same words and
/// status), after which both checkers pass the metadata and both dumps are
/// what was restored.
#[test]
fn auto_repair_frees_leaked_blocks_as_the_reference() {
    let s = Scratch::new("cache-auto-repair");
    for version in ["1", "2"] {
        let text = xml(300, 7);
        let m = restore_with(dmkit("restore"), &s, &format!("m{version}"), &text, version);
        assert_eq!(leak(&m, 3).len(), 3);
        let plain = run(dmkit("check").arg(&m));
        assert_eq!(
            plain,
            run(reference("cache_check").arg(&m)),
            "cache_check of leaked metadata"
        );
        assert_eq!(plain.0, 64, "{plain:?}");
        assert!(plain.2.contains("3 metadata blocks have leaked."), "{plain:?}");
        let (ours, theirs) = (s.path("ours"), s.path("theirs"));
        std::fs::copy(&m, &ours).unwrap();
        std::fs::copy(&m, &theirs).unwrap();
        let repaired = run(dmkit("check").arg("--auto-repair").arg(&ours));
        assert_eq!(
            repaired,
            run(reference("cache_check").arg("--auto-repair").arg(&theirs)),
            "cache_check --auto-repair"
        );
        assert_eq!(repaired.0, 0, "{repaired:?}");
        assert!(repaired.2.contains("Repairing metadata leaks."), "{repaired:?}");
        for p in [&ours, &theirs] {
            checks_pass(p);
            assert_eq!(dumps_agree(p), text);
        }
    }
}

/// Re-seal block 0 after `f` edits it: a superblock that lies with a valid checksum.
fn lie(m: &Path, f: impl FnOnce(&mut [u8])) {
    let mut b: [u8; BLOCK_SIZE] = block(m, 0).try_into().unwrap();
    f(&mut b);
    seal(0, BlockKind::CacheSuperblock, &mut b);
    put_block(m, 0, &b);
}

#[test]
fn lying_metadata_is_refused() {
    let s = Scratch::new("cache-lies");
    let text = xml(600, 9);
    let base = restore_with(dmkit("restore"), &s, "base", &text, "2");
    let copy = |name: &str| {
        let p = s.path(name);
        std::fs::copy(&base, &p).unwrap();
        p
    };
    // more cache blocks than a mapping array on the device can hold
    let m = copy("huge");
    lie(&m, |b| b[240..244].copy_from_slice(&u32::MAX.to_le_bytes()));
    let (code, o, e) = run(dmkit("check").arg(&m));
    assert_eq!((code, o.as_str()), (64, ""));
    assert_eq!(e, "metadata block 0: cache_blocks is 4294967295, more than what a mapping array on the metadata device can hold (1042432)\n");
    let (code, _, e) = run(dmkit("dump").arg(&m));
    assert_eq!(code, 64);
    assert!(
        e.starts_with("metadata block 0: cache_blocks is 4294967295"),
        "{e}"
    );
    // 1.x sizes its dirty bitset by the lie and reads on (a difference kept)
    assert_eq!(
        run(reference("cache_check").arg(&m)),
        (0, String::new(), String::new())
    );
    // more cache blocks than the mapping array has, within what the device holds
    let m = copy("longer");
    lie(&m, |b| b[240..244].copy_from_slice(&5000u32.to_le_bytes()));
    let (code, _, e) = run(dmkit("check").arg(&m));
    assert_eq!(code, 64);
    assert!(
        e.starts_with("dirty bitset: metadata block ")
            && e.ends_with(": array block 0 has 10 entries, expected 79\nmetadata contains errors\n"),
        "{e}"
    );
    // 1.x walks whatever the arrays hold (a difference kept)
    assert_eq!(
        run(reference("cache_check").arg(&m)),
        (0, String::new(), String::new())
    );
    // a version neither tool knows
    let m = copy("v3");
    lie(&m, |b| b[40..44].copy_from_slice(&3u32.to_le_bytes()));
    assert_eq!(
        run(dmkit("check").arg(&m)),
        (64, String::new(), "unsupported metadata version 3\n".into())
    );
    assert_eq!(run(reference("cache_check").arg(&m)).0, 64);
    // an origin block mapped twice: the reference's restore writes it, both checks refuse it
    let twice = "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"10\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n    <mapping cache_block=\"1\" origin_block=\"4\" dirty=\"true\"/>\n    <mapping cache_block=\"2\" origin_block=\"4\" dirty=\"false\"/>\n  </mappings>\n  <hints>\n  </hints>\n</superblock>";
    let m = restore_with(reference("cache_restore"), &s, "twice", twice, "2");
    let (code, _, e) = run(dmkit("check").arg(&m));
    assert_eq!(
        (code, e.as_str()),
        (
            64,
            "origin block 4 is mapped by cache blocks 1 and 2\nmetadata contains errors\n"
        )
    );
    assert_eq!(run(reference("cache_check").arg(&m)).0, 64);
    let (code, _, e) = run(dmkit("dump").arg(&m));
    assert_eq!(
        (code, e.as_str()),
        (
            64,
            "metadata block 3: origin block 4 is mapped by cache blocks 1 and 2\n"
        )
    );
    // dmkit's restore refuses to write it, and a cache block past the end
    let x = s.path("twice.xml");
    let (code, _, e) = run(dmkit("restore").arg("-i").arg(&x).arg("-o").arg(&m));
    assert_eq!(
        (code, e.as_str()),
        (64, "origin block 4 is mapped by cache blocks 1 and 2\n")
    );
    std::fs::write(&x, twice.replace("cache_block=\"2\"", "cache_block=\"10\"")).unwrap();
    let (code, _, e) = run(dmkit("restore").arg("-i").arg(&x).arg("-o").arg(&m));
    assert_eq!(
        (code, e.as_str()),
        (64, "line 4: cache block 10 is beyond nr_cache_blocks (10)\n")
    );
    assert_eq!(
        run(reference("cache_restore").arg("-i").arg(&x).arg("-o").arg(&m)).0,
        64
    );
}

const BLOCK: usize = 64 << 10;

/// A fast device whose block `c` is filled with a byte of `c`, and an origin of
/// `nr` blocks filled with a byte of the block number plus 100.
fn devices(s: &Scratch, tag: &str, cache_blocks: usize, nr: usize) -> (PathBuf, PathBuf) {
    let fast: Vec<u8> = (0..cache_blocks)
        .flat_map(|c| vec![(c % 251) as u8; BLOCK])
        .collect();
    let origin: Vec<u8> = (0..nr)
        .flat_map(|b| vec![((b + 100) % 251) as u8; BLOCK])
        .collect();
    let (f, o) = (s.path(&format!("{tag}.fast")), s.path(&format!("{tag}.origin")));
    std::fs::write(&f, fast).unwrap();
    std::fs::write(&o, origin).unwrap();
    (f, o)
}

#[test]
fn writeback_moves_the_dirty_blocks() {
    let s = Scratch::new("cache-writeback");
    let nr = 300; // origin blocks
    let text = xml(100, 4); // origin blocks (c * 7 + 11) % 300
    let md = dmkit::cache::xml::parse(text.as_bytes()).unwrap();
    let dirty: Vec<_> = md.mappings.iter().filter(|m| m.dirty).collect();
    assert!(dirty.len() > 3 && dirty.len() < md.mappings.len());
    for version in ["1", "2"] {
        let m = restore_with(dmkit("restore"), &s, &format!("wb{version}"), &text, version);
        let (fast, origin) = devices(&s, &format!("ours{version}"), 100, nr);
        // what a cache shows: the cached copy of a dirty block, else the origin's
        let mut view = std::fs::read(&origin).unwrap();
        for d in &dirty {
            let o = d.oblock as usize * BLOCK;
            view[o..o + BLOCK].fill((d.cblock % 251) as u8);
        }
        // --no-metadata-update leaves the metadata as it was
        let before = std::fs::read(&m).unwrap();
        let (code, o, e) = run(dmkit("writeback")
            .arg("--metadata-device")
            .arg(&m)
            .arg("--origin-device")
            .arg(&origin)
            .arg("--fast-device")
            .arg(&fast)
            .arg("--no-metadata-update"));
        let copied = format!("{0}/{0} blocks successfully copied\n", dirty.len());
        assert_eq!(
            (code, o.as_str(), e.as_str()),
            (0, copied.as_str(), "Copying cache blocks\n")
        );
        assert_eq!(std::fs::read(&m).unwrap(), before);
        assert!(std::fs::read(&origin).unwrap() == view, "origin after writeback");
        // the reference does the same with the metadata update, and so do we
        let (rfast, rorigin) = devices(&s, &format!("ref{version}"), 100, nr);
        let rm = s.path(&format!("ref{version}.meta"));
        std::fs::copy(&m, &rm).unwrap();
        let (code, o, e) = run(reference("cache_writeback")
            .arg("--metadata-device")
            .arg(&rm)
            .arg("--origin-device")
            .arg(&rorigin)
            .arg("--fast-device")
            .arg(&rfast));
        assert_eq!(
            (code, o.as_str(), e.as_str()),
            (0, copied.as_str(), "Copying cache blocks\nUpdating metadata\n")
        );
        let (code, o, e) = run(Command::new(BIN)
            .args(["cache", "writeback", "--metadata-device"])
            .arg(&m)
            .arg("--origin-device")
            .arg(&origin)
            .arg("--fast-device")
            .arg(&fast));
        assert_eq!(
            (code, o.as_str(), e.as_str()),
            (0, copied.as_str(), "Copying cache blocks\nUpdating metadata\n")
        );
        assert!(std::fs::read(&rorigin).unwrap() == view, "reference's origin");
        checks_pass(&m);
        let after = dumps_agree(&m);
        assert_eq!(after, dumps_agree(&rm));
        assert!(!after.contains("dirty=\"true\""));
        // nothing dirty is left: nothing to copy
        let (code, o, _) = run(dmkit("writeback")
            .arg("--metadata-device")
            .arg(&m)
            .arg("--origin-device")
            .arg(&origin)
            .arg("--fast-device")
            .arg(&fast)
            .arg("-q"));
        assert_eq!((code, o.as_str()), (0, ""));
    }
    // after an unclean shutdown every mapped block is copied
    let x = s.path("unclean.xml");
    std::fs::write(&x, &text).unwrap();
    let m = s.sparse("unclean", 4 << 20);
    ok(dmkit("restore")
        .arg("-i")
        .arg(&x)
        .arg("-o")
        .arg(&m)
        .arg("--omit-clean-shutdown"));
    let (fast, origin) = devices(&s, "unclean", 100, nr);
    let (code, o, _) = run(dmkit("writeback")
        .arg("--metadata-device")
        .arg(&m)
        .arg("--origin-device")
        .arg(&origin)
        .arg("--fast-device")
        .arg(&fast));
    let all = md.mappings.len();
    assert_eq!(
        (code, o),
        (0, format!("{all}/{all} blocks successfully copied\n"))
    );
    // a fast device too small for the blocks to copy is refused before any copy
    let (small, origin) = devices(&s, "small", 10, nr);
    let m = restore_with(dmkit("restore"), &s, "smallmeta", &text, "2");
    let before = std::fs::read(&origin).unwrap();
    let (code, o, e) = run(dmkit("writeback")
        .arg("--metadata-device")
        .arg(&m)
        .arg("--origin-device")
        .arg(&origin)
        .arg("--fast-device")
        .arg(&small));
    assert_eq!((code, o.as_str()), (64, ""));
    assert!(e.starts_with("Copying cache blocks\ninvalid argument: fast device is too small: the blocks to write back reach byte"), "{e}");
    assert!(std::fs::read(&origin).unwrap() == before);
    // metadata that is not cache metadata: 1.x's words and exit code
    let zero = s.sparse("zero", 4 << 20);
    let (code, _, e) = run(dmkit("writeback")
        .arg("--metadata-device")
        .arg(&zero)
        .arg("--origin-device")
        .arg(&origin)
        .arg("--fast-device")
        .arg(&fast));
    assert_eq!(
        (code, e.as_str()),
        (65, "bad checksum in superblock\nmetadata contains errors (run cache_check for details).\nperhaps you need to run cache_repair.\n")
    );
}

#[test]
fn multi_call_names() {
    let s = Scratch::new("cache-links");
    for (name, _) in [
        ("cache_check", 0),
        ("cache_metadata_size", 0),
        ("cache_writeback", 0),
    ] {
        let link = s.path(name);
        std::os::unix::fs::symlink(BIN, &link).unwrap();
        assert_eq!(ok(Command::new(&link).arg("-V")), "1.1.0\n");
        let (code, o, _) = run(Command::new(&link).arg("--help"));
        assert_eq!(code, 0);
        assert!(o.contains(&format!("Usage: {name} ")), "{o}");
    }
    let (code, o, _) = run(Command::new(s.path("cache_metadata_size")).args(["--nr-blocks", "1000000"]));
    assert_eq!((code, o.as_str()), (0, "62879.50 sectors\n"));
    // what is missing, named as 1.x names it, before anything is opened
    let missing = s.path("missing");
    let m = missing.to_str().unwrap();
    for args in [
        &["--metadata-device", m][..],
        &["--metadata-device", m, "--origin-device", m],
        &["--metadata-device", m, "--fast-device", m],
        &["--fast-device", m],
        &["--metadata-device", m, "--origin-device", m, "--fast-device", m],
    ] {
        let ours = run(Command::new(s.path("cache_writeback")).args(args));
        let theirs = run(reference("cache_writeback").args(args));
        assert_eq!(ours, theirs, "cache_writeback {args:?}");
        let want = if args.len() == 6 { 64 } else { 2 };
        assert_eq!(ours.0, want, "cache_writeback {args:?}");
        assert_eq!(ours.1, "");
    }
}

/// The mapping array block of a small metadata file (`n` cache blocks, fewer
/// than one array block holds): its block number and contents.
fn mapping_block(m: &Path, n: u32) -> (u64, Vec<u8>) {
    let d = std::fs::read(m).unwrap();
    let le32 = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    d.chunks_exact(BLOCK_SIZE)
        .enumerate()
        .map(|(i, b)| (i as u64, b.to_vec()))
        // an array block's header: entries at 8, value size at 12, its own number at 16
        .find(|(i, b)| le32(b, 8) == n && le32(b, 12) == 8 && b[16..24] == i.to_le_bytes())
        .unwrap()
}

#[test]
fn bad_mapping_entries_are_named() {
    let s = Scratch::new("cache-entries");
    let text = "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"10\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n    <mapping cache_block=\"1\" origin_block=\"4\" dirty=\"true\"/>\n    <mapping cache_block=\"2\" origin_block=\"5\" dirty=\"false\"/>\n  </mappings>\n  <hints>\n  </hints>\n</superblock>";
    for version in ["1", "2"] {
        let m = restore_with(dmkit("restore"), &s, &format!("v{version}"), text, version);
        assert_eq!(run(dmkit("check").arg(&m)), (0, String::new(), String::new()));
        let (b, mut d) = mapping_block(&m, 10);
        let mut entry = |c: usize, v: u64| d[24 + 8 * c..32 + 8 * c].copy_from_slice(&v.to_le_bytes());
        // flags 4 (neither valid nor dirty), an unmapped block naming an
        // origin block, dirty without valid (version 1's flag; version 2
        // keeps dirty in a bitset, so there it is a flag it does not know)
        entry(3, 4);
        entry(5, 7 << 16);
        entry(6, 2);
        seal(b, BlockKind::Array, (&mut d[..]).try_into().unwrap());
        put_block(&m, b, &d);
        let dirty = if version == "1" {
            "cache block 6: dirty bit found on an unmapped block"
        } else {
            "cache block 6: unknown flags 0x2 in mapping"
        };
        let (code, o, e) = run(dmkit("check").arg(&m));
        assert_eq!(
            (code, o.as_str(), e),
            (
                64,
                "",
                format!(
                    "cache block 3: unknown flags 0x4 in mapping\ncache block 5: unmapped, but names \
                     origin block 7\n{dirty}\nmetadata contains errors\n"
                )
            ),
            "version {version}"
        );
        // the reference refuses it too
        assert_eq!(run(reference("cache_check").arg(&m)).0, 64, "version {version}");
    }
}
