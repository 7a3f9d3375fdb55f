//! The thin tools as LVM and administrators call them, side by side with the
//! thin-provisioning-tools 1.x reference (ci/fetch-tpt-ref.sh): each tool is run as
//! the reference and as dmkit's multi-call link of the same name, on copies of the
//! same metadata (clean, with snapshots sharing subtrees, and damaged in the ways
//! the reference's damage generator damages it), and the outputs, exit codes and
//! resulting metadata are compared.

use crate::thin_util;
use dmkit::pdata::cache::seal;
use dmkit::pdata::tm::reader;
use dmkit::pdata::{BlockKind, FileDev, BLOCK_SIZE};
use dmkit::thin::ir::plan_of;
use dmkit::thin::metadata::read_superblock;
use dmkit::thin::xml::{self, XmlMetadata};
use dmkit::thin::{FormatOptions, ThinPoolMetadata};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use thin_util::*;

/// A directory of dmkit's multi-call links.
fn ours(s: &Scratch) -> PathBuf {
    let dir = s.path("bin");
    if !dir.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        let o = Command::new(env!("CARGO_BIN_EXE_dmkit"))
            .args(["thin", "links"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    dir
}

fn run(bin: &Path, args: &[&str]) -> Output {
    Command::new(bin).args(args).output().expect("run tool")
}

/// (exit status, stdout, last stderr line)
fn outcome(o: &Output) -> (Option<i32>, String, String) {
    let err = String::from_utf8_lossy(&o.stderr);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        err.lines().last().unwrap_or("").to_string(),
    )
}

/// Run `tool args` as the reference and as dmkit on copies of `meta` (the copy's
/// path replaces "META"); the results and the copies afterwards.
fn both(s: &Scratch, meta: &Path, tool: &str, args: &[&str]) -> [(Output, Vec<u8>); 2] {
    let bins = [tool_path(tool), ours(s).join(tool)];
    bins.map(|bin| {
        let copy = s.path("copy");
        std::fs::copy(meta, &copy).unwrap();
        let c = copy.to_str().unwrap().to_string();
        let a: Vec<&str> = args
            .iter()
            .map(|x| if *x == "META" { c.as_str() } else { x })
            .collect();
        let o = run(&bin, &a);
        (o, std::fs::read(&copy).unwrap())
    })
}

fn tool_path(name: &str) -> PathBuf {
    tool(name)
}

/// Calls whose standard error differs from 1.x's on purpose (docs/manual/thin.md, "Where dmkit
/// differs from 1.x"): (tool, metadata case) and the reason. Everywhere else
/// dmkit's standard error is 1.x's, byte for byte.
const DELIBERATE: &[(&str, &str, &str)] = &[
    (
        "thin_check",
        "mapping root past the end",
        "the node error names the metadata block and the device's size (1.x: `value error: block out of bounds`)",
    ),
    (
        "thin_check",
        "details root at the top-level root",
        "the node error names the metadata block and the value sizes (1.x: an encoded node path, `AgFL, effecting keys [..]`)",
    ),
    (
        "thin_check",
        "metadata count too high",
        "the bad count is one plain line (1.x prefixes `metadata space map: value error:` and appends an encoded node path)",
    ),
];

fn deliberate(tool: &str, what: &str) -> Option<&'static str> {
    DELIBERATE
        .iter()
        .find(|(t, w, _)| *t == tool && *w == what)
        .map(|d| d.2)
}

/// Same exit status, standard output and standard error (where verdicts go),
/// unless the call is in [`DELIBERATE`], where only the status and standard
/// output must match.
fn assert_same(s: &Scratch, meta: &Path, tool: &str, args: &[&str], what: &str) {
    let [(r, _), (o, _)] = both(s, meta, tool, args);
    let (rr, ro, _) = outcome(&r);
    let (or, oo, _) = outcome(&o);
    let (re, oe) = (
        String::from_utf8_lossy(&r.stderr),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(
        (rr, &ro),
        (or, &oo),
        "{what}: {tool} {args:?}\nreference stderr: {re}\ndmkit stderr: {oe}"
    );
    if deliberate(tool, what).is_none() {
        assert_eq!(re, oe, "{what}: {tool} {args:?}: standard error");
    }
}

/// A pool: `origins` volumes of `n` mappings, each with `snaps` snapshots that
/// overwrite a few blocks; some volumes deleted again.
fn pool(path: &Path, origins: u64, n: u64, snaps: u64, seed: u64) {
    pool_of(path, origins, n, snaps, seed, 1 << 20)
}

/// [`pool`] with `nr_data_blocks` data blocks.
fn pool_of(path: &Path, origins: u64, n: u64, snaps: u64, seed: u64, nr_data_blocks: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(64 << 20).unwrap();
    let mut md = ThinPoolMetadata::format(
        Box::new(FileDev::open(path, true).unwrap()),
        FormatOptions {
            data_block_size: 128,
            nr_data_blocks,
            cache_blocks: 1024,
        },
    )
    .unwrap();
    let mut rng = Rng::new(seed);
    let mut next = 0;
    for o in 0..origins {
        let dev = o * 100;
        md.create_thin(dev).unwrap();
        for v in 0..n {
            let b = md.alloc_data_block().unwrap();
            md.insert(dev, v * (1 + o % 2), b).unwrap();
        }
        for k in 1..=snaps {
            next += 1;
            md.create_snap(dev + k, dev).unwrap();
            for _ in 0..(1 + rng.below(20)) {
                let b = md.alloc_data_block().unwrap();
                md.insert(dev + k, rng.below(n), b).unwrap();
            }
        }
    }
    if origins > 1 && snaps > 1 {
        md.delete(1).unwrap();
    }
    md.set_transaction_id(0, next).unwrap();
    md.commit().unwrap();
}

/// Rewrite a superblock field (u64 at `off`), checksum resealed.
fn poke_sb(path: &Path, off: usize, v: u64) {
    let mut img = std::fs::read(path).unwrap();
    img[off..off + 8].copy_from_slice(&v.to_le_bytes());
    let mut b = [0u8; BLOCK_SIZE];
    b.copy_from_slice(&img[..BLOCK_SIZE]);
    seal(0, BlockKind::Superblock, &mut b);
    img[..BLOCK_SIZE].copy_from_slice(&b);
    std::fs::write(path, img).unwrap();
}

/// The devices' (id, bottom root), ascending.
fn roots(path: &Path) -> Vec<(u64, u64)> {
    let mut tm = reader(Box::new(FileDev::open(path, false).unwrap()), 64);
    let sb = read_superblock(&mut tm.cache).unwrap();
    plan_of(&mut tm, &sb)
        .unwrap()
        .devices
        .iter()
        .map(|d| (d.0, d.2))
        .collect()
}

fn damaged(s: &Scratch, base: &Path, name: &str, f: impl FnOnce(&Path)) -> PathBuf {
    let p = s.path(name);
    std::fs::copy(base, &p).unwrap();
    f(&p);
    p
}

fn with_md(p: &Path, f: impl FnOnce(&mut ThinPoolMetadata)) {
    let mut md = ThinPoolMetadata::open(Box::new(FileDev::open(p, true).unwrap()), 256).unwrap();
    f(&mut md);
    md.commit().unwrap();
}

/// The damage kinds of the reference's damage generator, and more.
fn damage_set(s: &Scratch, base: &Path, one_dev: &Path) -> Vec<(&'static str, PathBuf)> {
    let free_meta = |p: &Path| {
        let md = ThinPoolMetadata::open(Box::new(FileDev::open(p, false).unwrap()), 64).unwrap();
        (1..md.nr_metadata_blocks())
            .rev()
            .find(|&b| md.metadata_block_ref_count(b) == 0)
            .unwrap()
    };
    let used_data = |p: &Path| {
        let md = ThinPoolMetadata::open(Box::new(FileDev::open(p, false).unwrap()), 64).unwrap();
        (0..md.nr_data_blocks())
            .find(|&b| md.data_block_ref_count(b) == 1)
            .unwrap()
    };
    vec![
        ("clean", base.to_path_buf()),
        (
            "metadata leak",
            damaged(s, base, "mleak", |p| {
                let b = free_meta(p);
                with_md(p, |md| md.repair_counts(&[], &[(b, 1)]).unwrap());
            }),
        ),
        (
            "data leak",
            damaged(s, base, "dleak", |p| {
                with_md(p, |md| {
                    let _ = md.alloc_data_block().unwrap();
                })
            }),
        ),
        (
            "data count too high",
            damaged(s, base, "dhigh", |p| {
                let b = used_data(p);
                with_md(p, |md| md.repair_counts(&[(b, 2)], &[]).unwrap());
            }),
        ),
        (
            "metadata count too high",
            damaged(s, base, "mhigh", |p| {
                let (_, r) = roots(p)[0];
                with_md(p, |md| md.repair_counts(&[], &[(r, 7)]).unwrap());
            }),
        ),
        (
            "needs_check",
            damaged(s, base, "nc", |p| with_md(p, |md| md.set_needs_check(true))),
        ),
        (
            "mapping root at a bottom leaf (one device)",
            damaged(s, one_dev, "wrongroot", |p| {
                let (_, r) = roots(p)[0];
                poke_sb(p, 320, r);
            }),
        ),
        (
            "mapping root past the end",
            damaged(s, base, "oob", |p| poke_sb(p, 320, 1 << 30)),
        ),
        (
            "bad checksum in a leaf",
            damaged(s, base, "badleaf", |p| {
                let mut tm = reader(Box::new(FileDev::open(p, false).unwrap()), 64);
                let (_, r) = roots(p)[0];
                let (l, _) = dmkit::pdata::btree::leaves(&mut tm, r, 8, false).unwrap();
                let mut img = std::fs::read(p).unwrap();
                img[*l.last().unwrap() as usize * BLOCK_SIZE + 100] ^= 1;
                std::fs::write(p, img).unwrap();
            }),
        ),
        (
            "bad checksum in the superblock",
            damaged(s, base, "badsb", |p| {
                let mut img = std::fs::read(p).unwrap();
                img[300] ^= 1;
                std::fs::write(p, img).unwrap();
            }),
        ),
        (
            "details root at the top-level root",
            damaged(s, base, "detroot", |p| {
                let img = std::fs::read(p).unwrap();
                let top = u64::from_le_bytes(img[320..328].try_into().unwrap());
                poke_sb(p, 328, top);
            }),
        ),
    ]
}

#[test]
fn check_gives_the_reference_verdicts() {
    let s = Scratch::new("tools-check");
    let base = s.path("base");
    pool(&base, 3, 3000, 4, 1);
    let one = s.path("one");
    pool(&one, 1, 200, 0, 2);
    for (what, p) in damage_set(&s, &base, &one) {
        for flags in [
            &[][..],
            &["-q"],
            &["--ignore-non-fatal-errors"],
            &["--super-block-only"],
            &["--skip-mappings"],
        ] {
            let mut args = flags.to_vec();
            args.push("META");
            if what == "needs_check" && flags == ["--skip-mappings"] {
                // 1.x tries to clear the flag on a file it opened read-only (EBADF);
                // dmkit only checks, as asked
                let [(r, _), (o, img)] = both(&s, &p, "thin_check", &args);
                assert!(outcome(&r).2.contains("Bad file descriptor"));
                assert!(o.status.success());
                assert_eq!(img, std::fs::read(&p).unwrap());
                continue;
            }
            assert_same(&s, &p, "thin_check", &args, what);
        }
        // the repairing calls: same status, and metadata the reference finds as clean
        for flags in [
            &["--auto-repair"][..],
            &["--clear-needs-check-flag"],
            &["-q", "--clear-needs-check-flag"],
        ] {
            let mut args = flags.to_vec();
            args.push("META");
            let [(r, rimg), (o, oimg)] = both(&s, &p, "thin_check", &args);
            assert_eq!(r.status.code(), o.status.code(), "{what}: thin_check {args:?}");
            let before = std::fs::read(&p).unwrap();
            assert_eq!(
                rimg == before,
                oimg == before,
                "{what}: {args:?}: one wrote, the other did not"
            );
            if o.status.success() {
                let after = s.path("after");
                std::fs::write(&after, &oimg).unwrap();
                assert_thin_check_clean(&after);
            }
        }
    }
}

/// An empty path names a file that cannot be found, as 1.x says it (exit
/// 64), not a usage error: the thin and era tools, as an argument and after
/// `-i`/`-o` (the cache tools: `tests/cache_tools.rs`).
#[test]
fn an_empty_path_is_a_missing_file_as_in_1x() {
    let s = Scratch::new("tools-empty-path");
    let meta = s.path("meta");
    pool(&meta, 1, 10, 0, 4);
    let m = meta.to_str().unwrap();
    let cases: &[(&str, &[&str])] = &[
        ("thin_check", &[""]),
        ("thin_dump", &[""]),
        ("thin_ls", &[""]),
        ("thin_delta", &["--snap1", "1", "--snap2", "2", ""]),
        ("thin_rmap", &["--region", "0..1", ""]),
        ("thin_restore", &["-i", "", "-o", m]),
        ("thin_repair", &["-i", "", "-o", m]),
        ("thin_repair", &["-i", m, "-o", ""]),
        ("era_check", &[""]),
        ("era_dump", &[""]),
        ("era_invalidate", &["--written-since", "0", ""]),
        ("era_restore", &["-i", "", "-o", m]),
    ];
    for (tool, args) in cases {
        let theirs = outcome(&run(&tool_path(tool), args));
        let o = outcome(&run(&ours(&s).join(tool), args));
        assert_eq!(theirs, o, "{tool} {args:?}");
        assert_eq!(o.0, Some(64), "{tool} {args:?}: {o:?}");
    }
}

/// A file that holds only the superblock (a pool's first metadata block):
/// `--super-block-only` reads it as 1.x does (the superblock's sizes are not
/// held against a device it does not describe), and a full check fails in
/// both.
#[test]
fn super_block_only_takes_a_file_of_the_superblock_alone() {
    let s = Scratch::new("tools-sb-alone");
    let base = s.path("base");
    pool(&base, 1, 200, 0, 3);
    let sb = s.path("sb");
    std::fs::write(&sb, &std::fs::read(&base).unwrap()[..BLOCK_SIZE]).unwrap();
    for flags in [&["--super-block-only"][..], &["-q", "--super-block-only"]] {
        let mut args = flags.to_vec();
        args.push("META");
        assert_same(&s, &sb, "thin_check", &args, "the superblock alone");
        let [(_, _), (o, _)] = both(&s, &sb, "thin_check", &args);
        assert!(o.status.success(), "thin_check {args:?}: {o:?}");
    }
    let [(r, _), (o, _)] = both(&s, &sb, "thin_check", &["META"]);
    assert!(
        !r.status.success() && !o.status.success(),
        "a full check of the superblock alone: reference {r:?}, dmkit {o:?}"
    );
}

#[test]
fn lvm_activation_check() {
    let s = Scratch::new("tools-lvm");
    let base = s.path("base");
    pool(&base, 2, 2000, 2, 3);
    let one = s.path("one");
    pool(&one, 1, 100, 0, 4);
    let set = damage_set(&s, &base, &one);
    let get = |name: &str| set.iter().find(|(w, _)| *w == name).unwrap().1.clone();
    let check = ours(&s).join("thin_check");
    let call = |p: &Path| run(&check, &["-q", "--clear-needs-check-flag", p.to_str().unwrap()]);
    let nc = |p: &Path| std::fs::read(p).unwrap()[4] & 1;

    // clean: exit 0, silent, untouched
    let p = damaged(&s, &get("clean"), "l-clean", |_| {});
    let before = std::fs::read(&p).unwrap();
    let o = call(&p);
    assert!(o.status.success() && o.stdout.is_empty() && o.stderr.is_empty());
    assert_eq!(std::fs::read(&p).unwrap(), before, "a clean pool was rewritten");

    // needs_check set: cleared
    let p = damaged(&s, &get("needs_check"), "l-nc", |_| {});
    assert_eq!(nc(&p), 1);
    assert!(call(&p).status.success());
    assert_eq!(nc(&p), 0, "needs_check not cleared");
    assert_thin_check_clean(&p);

    // a leak: fixed
    for leak in ["metadata leak", "data leak"] {
        let p = damaged(&s, &get(leak), "l-leak", |_| {});
        assert!(!thin_check(&p, &[]).0, "the reference sees the {leak}");
        assert!(call(&p).status.success(), "{leak}");
        assert_thin_check_clean(&p);
    }

    // fatal: non-zero, the file untouched, needs_check kept
    let fatal = damaged(&s, &get("data count too high"), "l-fatal", |p| {
        with_md(p, |md| md.set_needs_check(true))
    });
    assert!(!thin_check(&fatal, &[]).0);
    let before = std::fs::read(&fatal).unwrap();
    let o = call(&fatal);
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        std::fs::read(&fatal).unwrap(),
        before,
        "metadata with a fatal error was written"
    );
    assert_eq!(nc(&fatal), 1);
}

#[test]
fn dump_ls_delta_rmap_match_the_reference() {
    let s = Scratch::new("tools-read");
    let base = s.path("base");
    pool(&base, 3, 5000, 5, 5);
    let devs: Vec<u64> = roots(&base).iter().map(|d| d.0).collect();
    let (a, b) = (devs[0].to_string(), devs[2].to_string());
    for args in [
        &["META"][..],
        &["--format", "human_readable", "META"],
        &["--skip-mappings", "META"],
        &["--dev-id", &b, "--dev-id", &a, "META"],
        &["--transaction-id", "1000", "--nr-data-blocks", "5", "META"],
        &["--repair", "META"],
    ] {
        assert_same(&s, &base, "thin_dump", args, "thin_dump");
    }
    let [(r, _), _] = both(&s, &base, "thin_dump", &["META"]);
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("<def name="),
        "the test pool should share subtrees"
    );
    for args in [
        &["META"][..],
        &["--no-headers", "META"],
        &[
            "-o",
            "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS,HIGHEST_BLOCK,MAPPED_SECTORS,EXCLUSIVE_BYTES,SHARED,HIGHEST_MAPPED,TRANSACTION,CREATE_TIME,SNAP_TIME",
            "META",
        ],
    ] {
        assert_same(&s, &base, "thin_ls", args, "thin_ls");
    }
    for args in [
        &["--snap1", &a, "--snap2", &b, "META"][..],
        &["--thin1", &a, "--thin2", &b, "--verbose", "META"],
        &["--thin1", &b, "--thin2", &a, "--verbose", "META"],
        &["--thin1", "9999", "--thin2", &a, "META"],
    ] {
        assert_same(&s, &base, "thin_delta", args, "thin_delta");
    }
    // rmap on a pool without shared leaves (1.x reports a shared leaf for one device only)
    let flat = s.path("flat");
    pool(&flat, 3, 3000, 0, 6);
    assert_same(
        &s,
        &flat,
        "thin_rmap",
        &["--region", "0..500", "--region", "4000..9000", "META"],
        "rmap",
    );
    for args in [
        &["-b", "64k", "-s", "1t", "-m", "1000"][..],
        &["-b", "64k", "-s", "1t", "-m", "1000", "-n=short", "-u", "m"],
        &["-b", "100", "-s", "1t", "-m", "1"],
    ] {
        let [r, o] = [
            tool_path("thin_metadata_size"),
            ours(&s).join("thin_metadata_size"),
        ]
        .map(|b| outcome(&run(&b, args)));
        assert_eq!(r, o, "thin_metadata_size {args:?}");
    }
}

/// The pool message `thin_ls ...` / `thin_delta ...` answers as `dmkit thin ls` /
/// `dmkit thin delta` print on the same metadata: the text (plus the one newline
/// the client takes off), or the error line.
#[test]
fn online_answers_as_the_cli_prints() {
    let s = Scratch::new("tools-online");
    let base = s.path("base");
    pool(&base, 3, 2000, 3, 9);
    let devs: Vec<u64> = roots(&base).iter().map(|d| d.0).collect();
    let (a, b) = (devs[0].to_string(), devs[2].to_string());
    let root = roots(&base)[1].1.to_string();
    let all = "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS,SHARED_BLOCKS,HIGHEST_BLOCK,MAPPED_SECTORS,\
EXCLUSIVE_SECTORS,SHARED_SECTORS,HIGHEST_SECTOR,MAPPED_BYTES,EXCLUSIVE_BYTES,SHARED_BYTES,\
HIGHEST_BYTE,MAPPED,EXCLUSIVE,SHARED,HIGHEST_MAPPED,TRANSACTION,CREATE_TIME,SNAP_TIME";
    for args in [
        &["ls"][..],
        &["ls", "--no-headers"],
        &["ls", "-o", all],
        &["ls", "-o", "DEV,TRANSACTION", "--no-headers"],
        &["ls", "-m"],
        &["delta", "--thin1", &a, "--thin2", &b],
        &["delta", "--thin1", &b, "--thin2", &a, "--verbose"],
        &["delta", "--root1", &root, "--thin2", &a, "--verbose"],
        &["delta", "--thin1", "9999", "--thin2", &a],
        &["delta", "--thin1", &a],
        &["delta", "--thin1", &a, "--thin2", &b, "-m"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_dmkit"))
            .arg("thin")
            .args(args)
            .arg(&base)
            .output()
            .unwrap();
        let mut words = vec![format!("thin_{}", args[0])];
        words.extend(args[1..].iter().map(|w| w.to_string()));
        let dev = FileDev::open(&base, false).unwrap();
        let answer = dmkit::thin::online::online(Box::new(dev), &words);
        if o.status.success() {
            let cli = String::from_utf8(o.stdout).unwrap();
            assert_eq!(answer, Ok(cli + "\n"), "{args:?}");
        } else {
            assert_eq!(o.status.code(), Some(64), "{args:?}");
            // after thin_ls's "Scanning data mappings", if it counts
            let err = String::from_utf8_lossy(&o.stderr);
            let last = err.lines().last().unwrap_or("").to_string();
            assert_eq!(answer, Err(last), "{args:?}");
        }
    }
}

#[test]
fn bad_input_gets_the_reference_messages() {
    let s = Scratch::new("tools-input");
    let dir = s.path("adir");
    std::fs::create_dir_all(&dir).unwrap();
    let small = s.path("small");
    std::fs::write(&small, [0u8; 100]).unwrap();
    let zeros = s.path("zeros");
    std::fs::write(&zeros, vec![0u8; 1 << 20]).unwrap();
    let base = s.path("base");
    pool(&base, 1, 100, 1, 7);
    let xml_path = s.path("x.xml");
    let [(d, _), _] = both(&s, &base, "thin_dump", &["META"]);
    let mut x = d.stdout.clone();
    x.resize(8192, b' ');
    std::fs::write(&xml_path, &x).unwrap();
    for tool in ["thin_check", "thin_dump", "thin_ls"] {
        for input in [
            s.path("nonexistent"),
            dir.clone(),
            small.clone(),
            zeros.clone(),
            xml_path.clone(),
        ] {
            let p = input.to_str().unwrap();
            let [r, o] = [tool_path(tool), ours(&s).join(tool)].map(|b| outcome(&run(&b, &[p])));
            if tool != "thin_check" && input == xml_path {
                // 1.x checks for XML in thin_check only
                assert_eq!(r.0, o.0, "{tool} {p}");
                continue;
            }
            assert_eq!(r, o, "{tool} {p}");
        }
        // help and version: standard output, exit 0; -V alone
        for args in [&["-h"][..], &["-V", "x"], &[], &["--hedgehogs-only", "x"]] {
            let [r, o] = [tool_path(tool), ours(&s).join(tool)].map(|b| run(&b, args));
            assert_eq!(r.status.code(), o.status.code(), "{tool} {args:?}");
            assert_eq!(r.stdout.is_empty(), o.stdout.is_empty(), "{tool} {args:?}");
            if args.first() == Some(&"-V") {
                // the version LVM reads: the reference's
                assert_eq!(o.stdout, r.stdout, "{tool} -V");
            }
        }
    }
    // conflicting options are refused, as usage errors
    for args in [
        &["--auto-repair", "-m", "x"][..],
        &["--auto-repair", "--skip-mappings", "x"],
        &["--auto-repair", "--super-block-only", "x"],
        &["--auto-repair", "--ignore-non-fatal-errors", "x"],
        &["--clear-needs-check-flag", "-m", "x"],
    ] {
        let o = run(&ours(&s).join("thin_check"), args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let r = run(&tool_path("thin_check"), args);
        assert_eq!(r.status.code(), Some(2), "{args:?}");
    }
    // a closed output pipe ends a dump quietly
    let big = s.path("big");
    pool(&big, 2, 60_000, 0, 8);
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "{} {} | head -c 10 >/dev/null",
            ours(&s).join("thin_dump").display(),
            big.display()
        ))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Mappings of every device, from XML.
fn model(text: &str) -> Model {
    model_of_xml(text)
}

#[test]
fn round_trips_with_the_reference_both_ways_and_both_forms() {
    let s = Scratch::new("tools-rt");
    let base = s.path("base");
    pool(&base, 4, 8000, 25, 9);
    let shared_xml =
        String::from_utf8(run(&tool_path("thin_dump"), &[base.to_str().unwrap()]).stdout).unwrap();
    assert!(shared_xml.contains("<ref name="));
    let parsed: XmlMetadata = xml::parse(&shared_xml).unwrap();
    // the plain form: every device written out in full
    let mut plain = parsed.clone();
    for d in &mut plain.devices {
        let runs: Vec<_> = parsed.runs_of(d).collect();
        d.pieces = runs.into_iter().map(xml::Piece::Run).collect();
    }
    plain.defs.clear();
    let plain_xml = xml::write(&plain);
    let want = model(&shared_xml);
    assert_eq!(model(&plain_xml), want);
    for (form, text) in [("def/ref", &shared_xml), ("plain", &plain_xml)] {
        let x = s.path("in.xml");
        std::fs::write(&x, text).unwrap();
        // reference restore -> dmkit dump; dmkit restore -> reference dump
        for (restorer, dumper) in [
            (tool_path("thin_restore"), ours(&s).join("thin_dump")),
            (ours(&s).join("thin_restore"), tool_path("thin_dump")),
        ] {
            let m = s.path("m");
            std::fs::write(&m, vec![0u8; 64 << 20]).unwrap();
            let o = run(&restorer, &["-i", x.to_str().unwrap(), "-o", m.to_str().unwrap()]);
            assert!(
                o.status.success(),
                "{form}: {}",
                String::from_utf8_lossy(&o.stderr)
            );
            assert_thin_check_clean(&m);
            let d = run(&dumper, &[m.to_str().unwrap()]);
            assert!(d.status.success());
            assert_eq!(
                model(&String::from_utf8(d.stdout).unwrap()),
                want,
                "{form} via {}",
                restorer.display()
            );
        }
    }
    // dmkit's restore of the shared form shares leaves as the reference's does:
    // the same exclusive and shared counts, and no more metadata
    let x = s.path("in.xml");
    std::fs::write(&x, &shared_xml).unwrap();
    let [mr, mo] = [tool_path("thin_restore"), ours(&s).join("thin_restore")].map(|b| {
        let m = s.path(&format!(
            "m-{}",
            b.parent().unwrap().file_name().unwrap().to_str().unwrap()
        ));
        std::fs::write(&m, vec![0u8; 64 << 20]).unwrap();
        assert!(run(&b, &["-i", x.to_str().unwrap(), "-o", m.to_str().unwrap()])
            .status
            .success());
        m
    });
    let ls = |m: &Path| {
        run(
            &tool_path("thin_ls"),
            &["-o", "DEV,MAPPED_BLOCKS,EXCLUSIVE_BLOCKS", m.to_str().unwrap()],
        )
        .stdout
    };
    assert_eq!(ls(&mr), ls(&mo));
    let used = |m: &Path| {
        let md = ThinPoolMetadata::open(Box::new(FileDev::open(m, false).unwrap()), 64).unwrap();
        md.nr_metadata_blocks() - md.nr_free_metadata_blocks()
    };
    let (r, o) = (used(&mr), used(&mo));
    assert!(
        o <= r + r / 10,
        "dmkit's restore uses {o} metadata blocks, the reference's {r}"
    );
    // thin_repair of a pool whose superblock is gone, given the block size
    let broken = damaged(&s, &base, "nosb", |p| {
        let mut img = std::fs::read(p).unwrap();
        img[..BLOCK_SIZE].fill(0);
        std::fs::write(p, img).unwrap();
    });
    let [(r, _), (o, _)] = both(&s, &broken, "thin_dump", &["--repair", "META"]);
    assert_eq!(r.status.code(), o.status.code());
    assert_eq!(outcome(&r).2, outcome(&o).2, "the missing block size is named");
    let out = s.path("repaired");
    std::fs::write(&out, vec![0u8; 64 << 20]).unwrap();
    let o = run(
        &ours(&s).join("thin_repair"),
        &[
            "-i",
            broken.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--data-block-size",
            "128",
            // the one positional word 1.x accepts and ignores (lvconvert passes one)
            "dummy",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_thin_check_clean(&out);
    let d = run(&tool_path("thin_dump"), &[out.to_str().unwrap()]);
    assert_eq!(
        model(&String::from_utf8(d.stdout).unwrap()),
        want,
        "repair lost mappings"
    );
}

/// A loop device over `file`, detached when dropped.
struct Loop(String);

impl Loop {
    fn new(file: &Path) -> Loop {
        let o = Command::new("losetup")
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .expect("losetup (ci/install.sh installs it, package mount)");
        assert!(
            o.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        Loop(String::from_utf8_lossy(&o.stdout).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let o = Command::new("losetup").args(["-d", &self.0]).output();
        assert!(o.is_ok_and(|o| o.status.success()), "losetup -d {}", self.0);
    }
}

/// thin_trim as the reference runs it, on a loop device (1.x's BLKDISCARD fails
/// on a regular file): dmkit's discards the same ranges, the free data blocks
/// only; every mapped block keeps its data; output, stderr and status the same.
#[test]
fn trim_discards_the_free_blocks_as_the_reference_does() {
    let s = Scratch::new("tools-trim");
    let meta = s.path("meta");
    // a data device of 1,200 blocks (1.x wants the size the superblock gives)
    let nr = 1200u64;
    pool_of(&meta, 2, 300, 1, 11, nr);
    let md = ThinPoolMetadata::open(Box::new(FileDev::open(&meta, false).unwrap()), 64).unwrap();
    let bs = 128 * 512u64;
    let used: Vec<bool> = (0..nr).map(|b| md.data_block_ref_count(b) > 0).collect();
    drop(md);
    let nused = used.iter().filter(|&&u| u).count();
    assert!(
        nused > 300 && nused < 1000,
        "mapped and free blocks both: {nused}"
    );
    let data: Vec<u8> = (0..nr * bs).map(|i| (i / 4096 % 251) as u8 + 1).collect();
    let mut results = Vec::new();
    for bin in [tool_path("thin_trim"), ours(&s).join("thin_trim")] {
        let d = s.path("data");
        std::fs::write(&d, &data).unwrap();
        let m = s.path("meta-copy");
        std::fs::copy(&meta, &m).unwrap();
        let lo = Loop::new(&d);
        let o = run(
            &bin,
            &["--metadata-dev", m.to_str().unwrap(), "--data-dev", &lo.0],
        );
        drop(lo);
        assert_eq!(
            std::fs::read(&m).unwrap(),
            std::fs::read(&meta).unwrap(),
            "metadata untouched"
        );
        results.push((o, std::fs::read(&d).unwrap()));
    }
    let [(r, rdata), (o, odata)] = <[_; 2]>::try_from(results).ok().unwrap();
    assert!(
        r.status.success(),
        "reference: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    assert_eq!(
        (r.status.code(), &r.stdout, &r.stderr),
        (o.status.code(), &o.stdout, &o.stderr),
        "thin_trim: status, stdout, stderr"
    );
    for (b, &mapped) in used.iter().enumerate() {
        let range = b * bs as usize..(b + 1) * bs as usize;
        if mapped {
            assert_eq!(
                odata[range.clone()],
                data[range.clone()],
                "mapped block {b} kept its data"
            );
        } else {
            assert!(
                odata[range.clone()].iter().all(|&x| x == 0),
                "free block {b} discarded"
            );
        }
        assert_eq!(
            odata[range.clone()],
            rdata[range],
            "block {b} as the reference left it"
        );
    }
}

/// A pool's dump, restored and dumped again, is the same text, whichever tool
/// restores and whichever dumps: 1.x names a shared subtree after its first leaf
/// block and lays a restored pool's `<def>` leaves out from block 1 in the
/// order of the dump, and dmkit's restore does the same.
#[test]
fn dump_restore_dump_is_a_fixed_point() {
    let s = Scratch::new("tools-fixed");
    let base = s.path("base");
    pool(&base, 4, 8000, 25, 11);
    let dumpers = [tool_path("thin_dump"), ours(&s).join("thin_dump")];
    let dump = |m: &Path| {
        let [r, o] = dumpers.clone().map(|d| run(&d, &[m.to_str().unwrap()]));
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        assert_eq!(outcome(&r), outcome(&o), "the dumps of {}", m.display());
        String::from_utf8(o.stdout).unwrap()
    };
    let first = dump(&base);
    assert!(
        first.contains("<def name="),
        "the test pool should share subtrees"
    );
    let want = model(&first);
    let mut after = Vec::new();
    for restorer in [tool_path("thin_restore"), ours(&s).join("thin_restore")] {
        let mut text = first.clone();
        let mut dumps = Vec::new();
        for round in 0..2 {
            let x = s.path("in.xml");
            std::fs::write(&x, &text).unwrap();
            let m = s.path(&format!("m{round}"));
            std::fs::write(&m, vec![0u8; 64 << 20]).unwrap();
            let o = run(&restorer, &["-i", x.to_str().unwrap(), "-o", m.to_str().unwrap()]);
            assert_eq!(outcome(&o), (Some(0), String::new(), String::new()));
            text = dump(&m);
            assert_eq!(model(&text), want, "round {round} via {}", restorer.display());
            dumps.push(text.clone());
        }
        assert_eq!(dumps[0], dumps[1], "{}: not a fixed point", restorer.display());
        after.push(dumps.remove(0));
    }
    assert_eq!(
        after[0], after[1],
        "the restores name the shared subtrees differently"
    );
}

/// thin_delta without one of its sides says which, with 1.x's exit code, once it
/// has checked the input file and before it reads the metadata (so also on
/// metadata without a superblock, or without a metadata snapshot).
#[test]
fn delta_refuses_a_missing_side_before_reading() {
    let s = Scratch::new("tools-delta-args");
    let base = s.path("base");
    pool(&base, 1, 100, 1, 3);
    let zeros = s.path("zeros");
    std::fs::write(&zeros, vec![0u8; 1 << 20]).unwrap();
    let small = s.path("small");
    std::fs::write(&small, [0u8; 100]).unwrap();
    let (b, z, t) = (
        base.to_str().unwrap(),
        zeros.to_str().unwrap(),
        small.to_str().unwrap(),
    );
    let cases: &[(&[&str], i32, &str)] = &[
        (&["--snap1", "0", b], 64, "--thin2 or --root2 not specified\n"),
        (&["--snap1", "0", z], 64, "--thin2 or --root2 not specified\n"),
        (
            &["--snap1", "0", "-m", b],
            64,
            "--thin2 or --root2 not specified\n",
        ),
        (&["--root1", "5", z], 64, "--thin2 or --root2 not specified\n"),
        (&["--snap2", "1", z], 64, "--thin1 or --root1 not specified\n"),
        (&[z], 64, "--thin1 or --root1 not specified\n"),
        (
            &["--snap1", "0", "--snap2", "1", z],
            64,
            "bad checksum in superblock\n",
        ),
        (
            &["--snap1", "0", "--snap2", "1", "-m", b],
            64,
            "no current metadata snap\n",
        ),
        (
            &["--snap1", "0", t],
            64,
            "Metadata device/file too small.  Is this binary metadata?\n",
        ),
        (
            &["--snap1", "0", "/nonexistent"],
            64,
            "Couldn't find input file '/nonexistent'\n",
        ),
    ];
    for (args, code, err) in cases {
        for bin in [tool_path("thin_delta"), ours(&s).join("thin_delta")] {
            let o = run(&bin, args);
            assert_eq!(
                (
                    o.status.code(),
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                ),
                (Some(*code), "".into(), (*err).into()),
                "{} {args:?}",
                bin.display()
            );
        }
    }
    // no input at all: clap's usage error, exit 2, on both
    for bin in [tool_path("thin_delta"), ours(&s).join("thin_delta")] {
        let o = run(&bin, &["--snap1", "0", "--snap2", "1"]);
        assert_eq!(o.status.code(), Some(2));
        assert!(o.stdout.is_empty());
        assert!(String::from_utf8_lossy(&o.stderr)
            .starts_with("error: the following required arguments were not provided:\n  <INPUT>\n"));
    }
}

/// `thin_check -m` reads the metadata snapshot: on a damaged one it says so as
/// 1.x does, and prints none of the live superblock's fields.
#[test]
fn check_of_a_damaged_metadata_snapshot() {
    let s = Scratch::new("tools-check-snap");
    let base = s.path("base");
    pool(&base, 2, 3000, 3, 4);
    let held = damaged(&s, &base, "held", |p| {
        with_md(p, |md| {
            md.reserve_metadata_snap().unwrap();
        })
    });
    let snap_at = |p: &Path| {
        let md = ThinPoolMetadata::open(Box::new(FileDev::open(p, false).unwrap()), 64).unwrap();
        md.held_root().unwrap()
    };
    let at = snap_at(&held);
    let cases = [
        ("clean snapshot", held.clone()),
        (
            "snapshot superblock checksum",
            damaged(&s, &held, "snapsum", |p| {
                let mut img = std::fs::read(p).unwrap();
                img[at as usize * BLOCK_SIZE + 300] ^= 1;
                std::fs::write(p, img).unwrap();
            }),
        ),
        (
            "snapshot zeroed",
            damaged(&s, &held, "snapzero", |p| {
                let mut img = std::fs::read(p).unwrap();
                img[at as usize * BLOCK_SIZE..(at as usize + 1) * BLOCK_SIZE].fill(0);
                std::fs::write(p, img).unwrap();
            }),
        ),
        (
            "snapshot's leaf checksum",
            damaged(&s, &held, "snapleaf", |p| {
                // a leaf of the snapshot's trees that the live trees do not share:
                // the live pool changes after the snapshot is taken
                with_md(p, |md| {
                    for v in 0..300 {
                        let b = md.alloc_data_block().unwrap();
                        md.insert(0, v, b).unwrap();
                    }
                });
                let mut tm = reader(Box::new(FileDev::open(p, false).unwrap()), 64);
                let snap =
                    dmkit::thin::superblock::Superblock::decode(tm.read(at, BlockKind::Superblock).unwrap());
                let plan = plan_of(&mut tm, &snap).unwrap();
                let (l, _) = dmkit::pdata::btree::leaves(&mut tm, plan.devices[0].2, 8, false).unwrap();
                let mut img = std::fs::read(p).unwrap();
                img[l[0] as usize * BLOCK_SIZE + 100] ^= 1;
                std::fs::write(p, img).unwrap();
            }),
        ),
        ("no snapshot", base.clone()),
    ];
    // what 1.x says of a snapshot whose superblock does not check out: that alone
    for (what, p) in &cases[1..3] {
        let [(r, _), _] = both(&s, p, "thin_check", &["-m", "META"]);
        assert_eq!(
            outcome(&r),
            (
                Some(64),
                String::new(),
                "metadata snap: bad checksum in superblock".into()
            ),
            "{what}"
        );
        assert_eq!(r.stderr, b"metadata snap: bad checksum in superblock\n");
    }
    for (what, p) in &cases {
        for flags in [
            &["-m"][..],
            &["-m", "-q"],
            &["-m", "--skip-mappings"],
            &["-m", "--super-block-only"],
        ] {
            let mut args = flags.to_vec();
            args.push("META");
            assert_same(&s, p, "thin_check", &args, what);
        }
    }
}
