//! dm-cache through the daemon and an NBD client: the data reads back as a
//! model says in writeback, writethrough and passthrough over a mix of random
//! reads and writes with a hot set, the status counters move as they should;
//! a hot set is promoted and read from the cache; `cleaner` writes every dirty
//! block back, after which the origin alone holds the device's data and the
//! cache retires to a linear table (`lvconvert --splitcache`); the reference
//! cache_check and cache_dump read dmkit's metadata, and metadata made by the
//! reference cache_restore opens in the target; a restart keeps the hot set
//! (the hints); the kernel's errors for bad tables and messages; mappings past
//! the origin's end dropped, or refused when dirty; and, after a SIGKILL under
//! a write load with flushes, no flushed write is lost and no stale block is
//! read.

use crate::common;
use crate::thin_util;

use common::nbd::Client;
use common::{accept, assert_same, pattern, read_all, settle, write_until_killed, Daemon, Rng, Scratch, BIN};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::MIB;
/// Cache blocks of 128 sectors.
const BLOCK: u64 = 64 << 10;
const ORIGIN: u64 = 32 * MIB; // 512 blocks
const CACHE: u64 = 4 * MIB; // 64 cache blocks

fn table(meta: &Path, cache: &Path, origin: &Path, features: &str, policy: &str) -> String {
    format!(
        "0 {} cache {} {} {} 128 {features} {policy}",
        ORIGIN / 512,
        meta.display(),
        cache.display(),
        origin.display()
    )
}

/// The status line's fields after `0 <len> cache`.
fn status(d: &Daemon, name: &str) -> Vec<String> {
    let s = d.ok(&["status", name]);
    let f: Vec<String> = s.split_whitespace().map(str::to_string).collect();
    assert_eq!(
        &f[..3],
        ["0", &(ORIGIN / 512).to_string(), "cache"],
        "status: {s}"
    );
    f[3..].to_vec()
}

/// The counters of a status: (used cache blocks, read hits, read misses,
/// write hits, write misses, demotions, promotions, dirty).
fn counters(f: &[String]) -> [u64; 8] {
    let used = f[3].split_once('/').expect("used/total").0.parse().expect("used");
    let n = |i: usize| {
        f[i].parse::<u64>()
            .unwrap_or_else(|_| panic!("field {i} of {f:?}"))
    };
    [used, n(4), n(5), n(6), n(7), n(8), n(9), n(10)]
}

fn reference(tool: &str) -> Command {
    Command::new(thin_util::tool(tool))
}

fn dmkit_cache(verb: &str) -> Command {
    let mut c = Command::new(BIN);
    c.args(["cache", verb]);
    c
}

/// stdout of a command that must succeed with nothing on stderr.
fn ok(cmd: &mut Command) -> String {
    let o = cmd.output().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&o.stderr), "", "{cmd:?}: standard error");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The reference's check passes on `meta`, and both dumps agree: dmkit's dump.
fn reference_reads(meta: &Path) -> String {
    ok(reference("cache_check").arg(meta));
    ok(dmkit_cache("check").arg(meta));
    let theirs = ok(reference("cache_dump").arg(meta));
    let ours = ok(dmkit_cache("dump").arg(meta));
    assert_eq!(ours, theirs, "cache_dump of {}", meta.display());
    ours
}

struct Files {
    s: Scratch,
    meta: std::path::PathBuf,
    cache: std::path::PathBuf,
    origin: std::path::PathBuf,
    base: Vec<u8>,
}

fn files(tag: &str) -> Files {
    let s = Scratch::new(tag);
    let meta = s.sparse("meta", 4 * MIB);
    let cache = s.sparse("cache", CACHE);
    let base = pattern(77, ORIGIN as usize);
    let origin = s.path("origin");
    std::fs::write(&origin, &base).unwrap();
    Files {
        s,
        meta,
        cache,
        origin,
        base,
    }
}

/// Random 4 KiB reads and writes, 80% of them over `hot` blocks: each read
/// checked against `model`, each write applied to it. Returns nothing; panics
/// on the first difference.
fn mix(c: &mut Client, model: &mut [u8], rng: &mut Rng, n: usize, hot: &[u64], write_pct: u64, seed: u64) {
    for i in 0..n {
        let block = if rng.below(100) < 80 {
            hot[rng.below(hot.len() as u64) as usize]
        } else {
            rng.below(ORIGIN / BLOCK)
        };
        let off = block * BLOCK + rng.below(BLOCK / 4096) * 4096;
        let o = off as usize;
        if rng.below(100) < write_pct {
            let data = pattern(seed + i as u64, 4096);
            c.write(off, &data);
            model[o..o + 4096].copy_from_slice(&data);
        } else {
            let got = c.read(off, 4096);
            assert!(got == model[o..o + 4096], "read at {off} differs from the model");
        }
    }
}

const HOT: [u64; 12] = [3, 4, 5, 40, 41, 100, 200, 201, 202, 300, 450, 511];

/// Read the hot set until at least `want` blocks are promoted (at most 30 s).
fn warm(d: &Daemon, c: &mut Client, model: &mut [u8], rng: &mut Rng, want: u64) {
    let t0 = Instant::now();
    while counters(&status(d, "c"))[6] < want {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "not promoted: {:?}",
            status(d, "c")
        );
        mix(c, model, rng, 200, &HOT, 0, 0);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn mode_model(features: &str, tag: &str) {
    let f = files(tag);
    let mut model = f.base.clone();
    let d = Daemon::start(tag);
    let t = table(&f.meta, &f.cache, &f.origin, features, "smq 0");
    d.create("c", &t);
    assert_eq!(d.ok(&["table", "c"]).trim(), t);
    // formatted as the kernel does (no hint array until the hints are first
    // saved), committed at the resume: both checks pass on it while it is live
    // (as on the kernel's, 1.x's cache_dump cannot read it before a clean
    // shutdown has saved hints)
    let live = f.s.path("meta.live");
    std::fs::copy(&f.meta, &live).unwrap();
    ok(reference("cache_check").arg(&live));
    ok(dmkit_cache("check").arg(&live));
    let dump = ok(dmkit_cache("dump").arg(&live));
    assert!(
        dump.contains("nr_cache_blocks=\"64\"") && !dump.contains("<mapping "),
        "{dump}"
    );
    let st = status(&d, "c");
    // a fresh cache: 64 cache blocks, nothing used, the kernel's defaults
    assert_eq!(&st[..2], ["8", &st[1]]);
    assert_eq!(st[2], "128");
    assert_eq!(st[3], "0/64");
    let mode = features.split_whitespace().nth(1).unwrap_or("writeback");
    assert_eq!(
        st[11..].join(" "),
        format!("1 {mode} 2 migration_threshold 2048 smq 0 rw -"),
        "{st:?}"
    );
    let mut c = Client::connect(&d.sock(), "c");
    let mut rng = Rng(0xcace + features.len() as u64);
    warm(&d, &mut c, &mut model, &mut rng, 8);
    let before = counters(&status(&d, "c"));
    mix(&mut c, &mut model, &mut rng, 1500, &HOT, 30, 1000);
    assert_eq!(c.call(common::nbd::FLUSH, 0, 0, 0, &[]), 0);
    let after = counters(&status(&d, "c"));
    // hits after the warm-up, of reads and writes
    assert!(after[1] > before[1] + 300, "read hits {before:?} -> {after:?}");
    assert!(after[3] > before[3] + 100, "write hits {before:?} -> {after:?}");
    match mode {
        "writeback" => assert!(
            after[7] > 0,
            "writes to cached blocks leave them dirty: {after:?}"
        ),
        _ => assert_eq!(after[7], 0, "{mode} never leaves a block dirty: {after:?}"),
    }
    assert_same(&read_all(&mut c, ORIGIN), &model, mode);
    drop(c);
    // suspended, nothing migrates: the status is what the metadata will say
    d.ok(&["suspend", "c"]);
    let after = counters(&status(&d, "c"));
    d.ok(&["remove", "c"]);
    // writethrough: the origin alone has everything
    if mode == "writethrough" {
        assert_same(
            &std::fs::read(&f.origin).unwrap(),
            &model,
            "the origin after writethrough",
        );
    }
    let dump = reference_reads(&f.meta);
    let mapped = dump.matches("<mapping ").count() as u64;
    assert_eq!(
        mapped, after[0],
        "the dump's mappings are the status's used blocks"
    );
    assert_eq!(
        dump.matches("dirty=\"true\"").count() as u64,
        after[7],
        "dirty blocks"
    );

    // passthrough over what writethrough cached: reads from the origin, a
    // write to a cached block unmaps it first
    if mode == "writethrough" {
        let t = table(&f.meta, &f.cache, &f.origin, "1 passthrough", "smq 0");
        d.create("c", &t);
        let mut c = Client::connect(&d.sock(), "c");
        let st = counters(&status(&d, "c"));
        assert_eq!(st[0], mapped);
        mix(&mut c, &mut model, &mut rng, 600, &HOT, 40, 5000);
        let st2 = counters(&status(&d, "c"));
        assert!(
            st2[5] > 0 && st2[0] < mapped,
            "passthrough invalidates written blocks: {st:?} -> {st2:?}"
        );
        assert_eq!(st2[6], 0, "passthrough promotes nothing");
        assert_same(&read_all(&mut c, ORIGIN), &model, "passthrough");
        drop(c);
        d.remove_closed("c");
        assert_same(
            &std::fs::read(&f.origin).unwrap(),
            &model,
            "the origin after passthrough",
        );
        reference_reads(&f.meta);
    }
    drop(f.s);
}

#[test]
fn writeback_reads_back_the_model() {
    mode_model("0", "cache-wb");
}

#[test]
fn writethrough_and_passthrough_read_back_the_model() {
    mode_model("1 writethrough", "cache-wt");
}

/// The `<hints>` of a dump.
fn hints_of(dump: &str) -> &str {
    let a = dump.find("<hints>").expect("hints in the dump");
    let b = dump.find("</hints>").expect("end of hints");
    &dump[a..b]
}

#[test]
fn a_hot_set_is_promoted_and_a_restart_keeps_it() {
    let f = files("cache-hot");
    let mut model = f.base.clone();
    let d = Daemon::start("cache-hot");
    let t = table(&f.meta, &f.cache, &f.origin, "0", "smq 0");
    d.create("c", &t);
    let mut c = Client::connect(&d.sock(), "c");
    let mut rng = Rng(0x4075e7);
    warm(&d, &mut c, &mut model, &mut rng, HOT.len() as u64);
    // reads of the hot set alone: at least 95% of them hit once it is warm
    let mut hot_only = |c: &mut Client, n: usize| {
        for _ in 0..n {
            let b = HOT[rng.below(HOT.len() as u64) as usize];
            let off = b * BLOCK + rng.below(16) * 4096;
            let got = c.read(off, 4096);
            assert!(got == model[off as usize..off as usize + 4096], "read at {off}");
        }
    };
    let t0 = Instant::now();
    let ratio = loop {
        let a = counters(&status(&d, "c"));
        hot_only(&mut c, 400);
        let b = counters(&status(&d, "c"));
        let ratio = (b[1] - a[1]) as f64 / 400.0;
        if ratio >= 0.95 || t0.elapsed() > Duration::from_secs(30) {
            break ratio;
        }
    };
    assert!(ratio >= 0.95, "hot set read hit ratio {ratio}");
    let used = counters(&status(&d, "c"))[0];
    drop(c);
    d.remove_closed("c");
    let dump = reference_reads(&f.meta);
    // new promotions sit at the top level: their hint says so
    assert!(
        hints_of(&dump).contains("data=\"PwAAAA==\""),
        "{}",
        hints_of(&dump)
    );

    // a new daemon: the same blocks are cached, the hot set hits at once, and
    // the hints were taken up (saved again unchanged, not started afresh)
    drop(d);
    let d = Daemon::start("cache-hot-again");
    d.create("c", &t);
    assert_eq!(counters(&status(&d, "c"))[0], used);
    d.ok(&["remove", "c"]);
    let again = reference_reads(&f.meta);
    assert_eq!(hints_of(&again), hints_of(&dump), "the hints after a restart");
    d.create("c", &t);
    let mut c = Client::connect(&d.sock(), "c");
    let a = counters(&status(&d, "c"));
    for &b in &HOT {
        let got = c.read(b * BLOCK, 4096);
        assert!(got == model[(b * BLOCK) as usize..(b * BLOCK) as usize + 4096]);
    }
    let b = counters(&status(&d, "c"));
    assert_eq!(
        (b[1] - a[1], b[2] - a[2]),
        (HOT.len() as u64, 0),
        "the hot set hits after the restart"
    );
}

/// Switch `c` to `table` as LVM does: load, suspend, resume.
fn switch(d: &Daemon, t: &str) {
    d.reload("c", t);
}

/// Wait (at most 30 s) until the cache has no dirty block.
fn wait_clean(d: &Daemon) {
    let t0 = Instant::now();
    while counters(&status(d, "c"))[7] != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "still dirty: {:?}",
            status(d, "c")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn cleaner_writes_everything_back_and_the_cache_retires_to_linear() {
    let f = files("cache-clean");
    let mut model = f.base.clone();
    let d = Daemon::start("cache-clean");
    d.create("c", &table(&f.meta, &f.cache, &f.origin, "0", "smq 0"));
    let mut c = Client::connect(&d.sock(), "c");
    let mut rng = Rng(0xc1ea);
    warm(&d, &mut c, &mut model, &mut rng, 8);
    mix(&mut c, &mut model, &mut rng, 800, &HOT, 60, 9000);
    let dirty = counters(&status(&d, "c"))[7];
    assert!(dirty > 4, "dirty blocks to write back: {dirty}");
    assert!(
        std::fs::read(&f.origin).unwrap() != model,
        "the origin lags the cache"
    );
    drop(c);

    switch(&d, &table(&f.meta, &f.cache, &f.origin, "0", "cleaner 0"));
    let st = status(&d, "c");
    assert_eq!(st[st.len() - 4..].join(" "), "cleaner 0 rw -", "{st:?}");
    wait_clean(&d);
    let mut c = Client::connect(&d.sock(), "c");
    assert_same(&read_all(&mut c, ORIGIN), &model, "through the cleaner");
    assert_eq!(counters(&status(&d, "c"))[6], 0, "the cleaner promotes nothing");
    drop(c);
    assert_same(
        &std::fs::read(&f.origin).unwrap(),
        &model,
        "the origin after the cleaner",
    );

    // lvconvert --splitcache: the origin alone, as a linear table
    switch(&d, &format!("0 {} linear {} 0", ORIGIN / 512, f.origin.display()));
    let mut c = Client::connect(&d.sock(), "c");
    assert_same(
        &read_all(&mut c, ORIGIN),
        &model,
        "the retired cache's linear device",
    );
    drop(c);
    d.remove_closed("c");
    let dump = reference_reads(&f.meta);
    assert!(!dump.contains("dirty=\"true\""), "clean after the cleaner");
    assert!(dump.contains("policy=\"cleaner\""), "{}", &dump[..200]);
}

#[test]
fn metadata_the_reference_restored_serves_the_cache_devices_blocks() {
    for version in ["1", "2"] {
        let f = files(&format!("cache-restored-v{version}"));
        // 64 cache blocks, every third mapped, every fourth of those dirty
        let mut xml = String::from(
            "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"64\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n",
        );
        let mapped: Vec<(u64, u64, bool)> = (0..64u64)
            .filter(|c| c % 3 == 0)
            .map(|c| (c, (c * 7 + 11) % 512, c % 4 == 0))
            .collect();
        for &(c, o, dirty) in &mapped {
            xml += &format!("    <mapping cache_block=\"{c}\" origin_block=\"{o}\" dirty=\"{dirty}\"/>\n");
        }
        xml += "  </mappings>\n</superblock>\n";
        let x = f.s.path("in.xml");
        std::fs::write(&x, &xml).unwrap();
        ok(reference("cache_restore")
            .arg("-i")
            .arg(&x)
            .arg("-o")
            .arg(&f.meta)
            .args(["--metadata-version", version]));
        // the cache device holds its own data for each mapped block
        let cache_data = pattern(5, CACHE as usize);
        std::fs::write(&f.cache, &cache_data).unwrap();
        let mut model = f.base.clone();
        for &(c, o, _) in &mapped {
            let (cs, os) = ((c * BLOCK) as usize, (o * BLOCK) as usize);
            model[os..os + BLOCK as usize].copy_from_slice(&cache_data[cs..cs + BLOCK as usize]);
        }
        let d = Daemon::start(&format!("cache-restored-v{version}"));
        d.create("c", &table(&f.meta, &f.cache, &f.origin, "0", "smq 0"));
        let st = counters(&status(&d, "c"));
        let nr_dirty = mapped.iter().filter(|m| m.2).count() as u64;
        assert_eq!(
            (st[0], st[7]),
            (mapped.len() as u64, nr_dirty),
            "v{version}: {st:?}"
        );
        let mut c = Client::connect(&d.sock(), "c");
        assert_same(&read_all(&mut c, ORIGIN), &model, "the restored cache");
        drop(c);
        // the cleaner writes the dirty ones back: the origin has their cache data
        switch(&d, &table(&f.meta, &f.cache, &f.origin, "0", "cleaner 0"));
        wait_clean(&d);
        d.ok(&["remove", "c"]);
        let origin = std::fs::read(&f.origin).unwrap();
        for &(c, o, dirty) in &mapped {
            let (cs, os) = ((c * BLOCK) as usize, (o * BLOCK) as usize);
            let want = if dirty {
                &cache_data[cs..cs + BLOCK as usize]
            } else {
                &f.base[os..os + BLOCK as usize]
            };
            assert!(
                origin[os..os + BLOCK as usize] == *want,
                "v{version}: origin block {o}"
            );
        }
        reference_reads(&f.meta);
    }
}

#[test]
fn bad_tables_and_messages_give_the_kernels_errors() {
    let f = files("cache-bad");
    let (m, c, o) = (
        f.meta.display().to_string(),
        f.cache.display().to_string(),
        f.origin.display().to_string(),
    );
    let none = f.s.path("none").display().to_string();
    let n = ORIGIN / 512;
    let d = Daemon::start("cache-bad");
    for (args, err) in [
        (format!("{m} {c}"), "Insufficient args"),
        (
            format!("{none} {c} {o} 128 0 smq 0"),
            "Error opening metadata device",
        ),
        (
            format!("{m} {none} {o} 128 0 smq 0"),
            "Error opening cache device",
        ),
        (
            format!("{m} {c} {none} 128 0 smq 0"),
            "Error opening origin device",
        ),
        (format!("{m} {c} {o} 100 0 smq 0"), "Invalid data block size"),
        (format!("{m} {c} {o} 32 0 smq 0"), "Invalid data block size"),
        (format!("{m} {c} {o} 4194304 0 smq 0"), "Invalid data block size"),
        (
            format!("{m} {c} {o} 16384 0 smq 0"),
            "Data block size is larger than the cache device",
        ),
        (
            format!("{m} {c} {o} 128 4 a b c d smq 0"),
            "Invalid number of cache feature arguments",
        ),
        (
            format!("{m} {c} {o} 128 2 writeback"),
            "Invalid number of cache feature arguments",
        ),
        (
            format!("{m} {c} {o} 128 1 writearound smq 0"),
            "Unrecognised cache feature requested",
        ),
        (
            format!("{m} {c} {o} 128 2 writethrough passthrough smq 0"),
            "Duplicate cache io_mode features requested",
        ),
        (format!("{m} {c} {o} 128 0"), "Insufficient args"),
        (
            format!("{m} {c} {o} 128 0 smq 2 migration_threshold"),
            "Invalid number of policy arguments",
        ),
        (
            format!("{m} {c} {o} 128 0 lru 0"),
            "Error creating cache's policy",
        ),
        (
            format!("{m} {c} {o} 128 0 smq 1 migration_threshold"),
            "Error setting cache policy's config values",
        ),
        (
            format!("{m} {c} {o} 128 0 smq 2 sequential_threshold 4"),
            "Error setting cache policy's config values",
        ),
        (
            format!("{m} {c} {o} 128 0 smq 2 migration_threshold x"),
            "Error setting cache policy's config values",
        ),
    ] {
        let out = d.cli_in(&["create", "x"], &format!("0 {n} cache {args}"));
        assert!(!out.status.success(), "cache {args} was accepted");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(e.contains(err), "cache {args}: {e}");
    }
    // larger than the origin
    let out = d.cli_in(
        &["create", "x"],
        &format!("0 {} cache {m} {c} {o} 128 0 smq 0", n + 128),
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("Device size larger than cached device"));

    // mq takes its old tunables (with no effect) and prints them
    let t = format!("0 {n} cache {m} {c} {o} 128 0 mq 4 sequential_threshold 4 migration_threshold 1024");
    d.create("c", &t);
    assert_eq!(d.ok(&["table", "c"]).trim(), t);
    // formatted as the kernel does (no hint array until the hints are first
    // saved), committed at the resume: both checks pass on it while it is live
    // (as on the kernel's, 1.x's cache_dump cannot read it before a clean
    // shutdown has saved hints)
    let live = f.s.path("meta.live");
    std::fs::copy(&f.meta, &live).unwrap();
    ok(reference("cache_check").arg(&live));
    ok(dmkit_cache("check").arg(&live));
    let dump = ok(dmkit_cache("dump").arg(&live));
    assert!(
        dump.contains("nr_cache_blocks=\"64\"") && !dump.contains("<mapping "),
        "{dump}"
    );
    let st = status(&d, "c");
    assert_eq!(
        st[11..].join(" "),
        "1 writeback 2 migration_threshold 1024 smq 10 random_threshold 0 sequential_threshold 0 \
         discard_promote_adjustment 0 read_promote_adjustment 0 write_promote_adjustment 0 rw -"
    );
    for (words, err) in [
        (
            vec!["migration_threshold", "x"],
            "bad config value for migration_threshold: x",
        ),
        (vec!["foo", "1"], "bad config value for foo: 1"),
        (vec!["migration_threshold"], "Invalid argument"),
        (
            vec!["invalidate_cblocks", "1"],
            "cache has to be in passthrough mode for invalidation",
        ),
    ] {
        let mut a = vec!["message", "c", "0"];
        a.extend_from_slice(&words);
        let e = d.fails(&a);
        assert!(e.contains(err), "{words:?}: {e}");
    }
    assert_eq!(d.ok(&["message", "c", "0", "Migration_Threshold", "4096"]), "");
    assert!(status(&d, "c").join(" ").contains("migration_threshold 4096 smq"));
    d.ok(&["remove", "c"]);

    // passthrough: invalidation of cache block ranges
    d.create(
        "c",
        &format!("0 {n} cache {m} {c} {o} 128 2 metadata2 passthrough smq 0"),
    );
    assert!(status(&d, "c")
        .join(" ")
        .ends_with(" 2 metadata2 passthrough 2 migration_threshold 2048 smq 0 rw -"));
    for (w, err) in [
        ("70", "begin cblock out of range: 70 >= 64"),
        ("1-65", "end cblock out of range: 65 > 64"),
        ("5-3", "invalid cblock range: 5 >= 3"),
        ("x", "invalid cblock range 'x'"),
    ] {
        let e = d.fails(&["message", "c", "0", "invalidate_cblocks", w]);
        assert!(e.contains(err), "{w}: {e}");
    }
    assert_eq!(
        d.ok(&["message", "c", "0", "invalidate_cblocks", "0-64", "3"]),
        ""
    );
    d.ok(&["remove", "c"]);
    // the metadata's block size is the one it was made with
    let out = d.cli_in(&["create", "x"], &format!("0 {n} cache {m} {c} {o} 256 0 smq 0"));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains("Error creating metadata object")
            && e.contains("changing the data block size (from 128 to 256) is not supported"),
        "{e}"
    );
}

#[test]
fn sigkill_under_a_write_load_loses_no_flushed_write() {
    const BS: u64 = BLOCK;
    // 96 blocks written over, a cache of 64: promotions, dirty blocks and
    // migrations under way when the daemon dies
    let nb = 96usize;
    let f = files("cache-kill");
    let t = table(&f.meta, &f.cache, &f.origin, "0", "smq 2 migration_threshold 512");
    let mut state = vec![f.base[..nb * BS as usize]
        .chunks(BS as usize)
        .map(<[u8]>::to_vec)
        .collect::<Vec<_>>()];
    let mut rng = Rng(0x5eedcace);
    let mut seed = 1u64 << 32;
    for round in 0..3 {
        let mut d = Daemon::start(&format!("cache-kill-{round}"));
        d.create("c", &t);
        let load = write_until_killed(d.sock(), &["c"], |_: &mut Rng| 0, nb, BS, Rng(rng.next()), seed);
        let n = 100 + rng.below(300) as usize;
        let ran = load.wait_flushed(n, Duration::from_secs(60));
        // and once migrations run under the load, at a moment the round
        // chooses (a full cache of blocks dirty since the restart makes room
        // only once they are older than the writeback sentinels, 10-20 s: the
        // later rounds wait a little for that, not for all of it)
        let (want, within) = if round == 0 { (5, 20) } else { (1, 3) };
        let t0 = Instant::now();
        while counters(&status(&d, "c"))[6] < want && t0.elapsed() < Duration::from_secs(within) {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        d.kill9();
        let log = load.finish();
        assert!(ran, "round {round}: {} writes covered by a flush, not {n}", log.1);
        seed = log.0.last().map_or(seed, |x| x.2) + 1;
        let allowed = settle(&mut state, &log, BS);
        let d = Daemon::start(&format!("cache-kill-{round}-after"));
        d.create("c", &t);
        // after a dirty shutdown every cached block counts as dirty
        let st = counters(&status(&d, "c"));
        assert_eq!(st[7], st[0], "round {round}: {st:?}");
        if round == 0 {
            assert!(st[0] > 0, "round {round}: something was cached: {st:?}");
        }
        let mut c = Client::connect(&d.sock(), "c");
        let got = read_all(&mut c, nb as u64 * BS);
        accept(&got, &mut state[0], &allowed[0], BS, &format!("round {round}"));
        drop(c);
        d.remove_closed("c");
        reference_reads(&f.meta);
    }
    // and the cleaner makes the origin what the cache showed
    let d = Daemon::start("cache-kill-clean");
    d.create("c", &table(&f.meta, &f.cache, &f.origin, "0", "cleaner 0"));
    wait_clean(&d);
    d.ok(&["remove", "c"]);
    let origin = std::fs::read(&f.origin).unwrap();
    assert_same(
        &origin[..nb * BS as usize],
        &state[0].concat(),
        "the origin after the cleaner",
    );
}

#[test]
fn mappings_past_the_origins_end_are_dropped_unless_dirty() {
    for (dirty, err) in [
        (false, None),
        (true, Some("unable to shrink origin; cache block 4 is dirty")),
    ] {
        let f = files(&format!("cache-past-{dirty}"));
        let xml = format!(
            "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"64\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n    \
             <mapping cache_block=\"1\" origin_block=\"7\" dirty=\"false\"/>\n    \
             <mapping cache_block=\"4\" origin_block=\"600\" dirty=\"{dirty}\"/>\n  </mappings>\n</superblock>\n"
        );
        let x = f.s.path("in.xml");
        std::fs::write(&x, &xml).unwrap();
        ok(reference("cache_restore")
            .arg("-i")
            .arg(&x)
            .arg("-o")
            .arg(&f.meta));
        let d = Daemon::start(&format!("cache-past-{dirty}"));
        let t = table(&f.meta, &f.cache, &f.origin, "0", "smq 0");
        match err {
            None => {
                d.create("c", &t);
                // origin block 600 is past the 512 of the origin: unmapped
                assert_eq!(counters(&status(&d, "c"))[0], 1);
                d.ok(&["remove", "c"]);
                let dump = reference_reads(&f.meta);
                assert!(
                    dump.contains("origin_block=\"7\"") && !dump.contains("origin_block=\"600\""),
                    "{dump}"
                );
            }
            Some(e) => {
                let out = d.cli_in(&["create", "c"], &t);
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert!(!out.status.success() && stderr.contains(e), "{stderr}");
            }
        }
    }
}
