//! dm-cache through the daemon and an NBD client: the data reads back as a
//! model says in writeback, writethrough and passthrough over a mix of random
//! reads and writes with a hot set, the status counters move as they should;
//! a hot set is promoted and read from the cache; `cleaner` writes every dirty
//! block back, after which the origin alone holds the device's data and the
//! cache retires to a linear table (`lvconvert --splitcache`); the reference
//! cache_check and cache_dump read dmkit's metadata, and metadata made by the
//! reference cache_restore opens in the target; a restart keeps the hot set
//! (the hints); the kernel's errors for bad tables and messages; and, after a
//! SIGKILL under a write load with flushes, no flushed write is lost and no
//! stale block is read.

mod common;
mod thin_util;

use common::nbd::Client;
use common::{accept, assert_same, pattern, read_all, settle, write_until_killed, Daemon, Rng, Scratch, BIN};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
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
        d.ok(&["remove", "c"]);
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
