//! The `cdp` target through the real daemon and NBD: every flush (and FUA
//! write) a point, every point kept read back as the device was at it (from
//! a model of the writes, discards and flushes the test sent), across
//! `kill -9` and `serve --restore`, while retention drops the oldest points
//! for room; marks and times name points; a view pins its point; a thin
//! device with a point as its external origin is a writable snapshot of it;
//! tables and journals that lie are refused with what is wrong.

use crate::common;

use common::nbd::{Client, FLAG_FUA, FLUSH, TRIM, WRITE, WRITE_ZEROES};
use common::{assert_same, pattern, read_all, Daemon, Rng, MIB};
use std::time::Duration;

const BS: u64 = 4096;

/// What the test sent, per block: (first point, pattern seed or zeroes), in order.
struct Model {
    hist: Vec<Vec<(u64, Option<u64>)>>,
    /// Points acknowledged so far (the daemon's flush numbers).
    n: u64,
}

impl Model {
    fn new(blocks: usize) -> Model {
        Model {
            hist: vec![Vec::new(); blocks],
            n: 0,
        }
    }

    fn set(&mut self, b: usize, from: u64, v: Option<u64>) {
        let h = &mut self.hist[b];
        if h.last().is_some_and(|&(f, _)| f == from) {
            h.pop();
        }
        h.push((from, v));
    }

    fn at(&self, b: usize, p: u64) -> Option<u64> {
        self.hist[b]
            .iter()
            .rev()
            .find(|(f, _)| *f <= p)
            .and_then(|&(_, v)| v)
    }

    fn image(&self, p: u64) -> Vec<u8> {
        let mut out = vec![0u8; self.hist.len() * BS as usize];
        for b in 0..self.hist.len() {
            if let Some(seed) = self.at(b, p) {
                out[b * BS as usize..(b + 1) * BS as usize].copy_from_slice(&pattern(seed, BS as usize));
            }
        }
        out
    }
}

/// The points the device says it keeps: (flush number, time, mark).
fn points(d: &Daemon, name: &str) -> Vec<(u64, String, Option<String>)> {
    let out = d.ok(&["message", name, "0", "points", "100000"]);
    out.lines()
        .map(|l| {
            let mut w = l.split_whitespace();
            let n = w.next().and_then(|f| f.strip_prefix("flush:")).expect("flush:N");
            let t = w.next().and_then(|f| f.strip_prefix("time:")).expect("time:T");
            let m = w
                .next()
                .map(|m| m.strip_prefix("mark:").expect("mark:L").to_string());
            (n.parse().expect("a number"), t.to_string(), m)
        })
        .collect()
}

/// Every point the device keeps reads as the model had it; returns how many.
fn check_points(d: &Daemon, name: &str, m: &Model, size: u64) -> usize {
    let pts = points(d, name);
    for (n, _, _) in &pts {
        assert!(*n <= m.n, "point {n} is past the last acknowledged flush {}", m.n);
        let mut c = Client::connect(&d.sock(), &format!("{name}@flush:{n}"));
        assert_same(&read_all(&mut c, size), &m.image(*n), &format!("point flush:{n}"));
    }
    pts.len()
}

fn status_words(d: &Daemon, name: &str) -> Vec<String> {
    d.ok(&["status", name])
        .split_whitespace()
        .skip(3)
        .map(String::from)
        .collect()
}

#[test]
fn every_kept_point_reads_as_the_device_was_then_across_kills_and_retention() {
    let mut d = Daemon::start("cdp-points");
    let blocks = 256u64;
    let size = blocks * BS;
    // room for the device and about 1,300 older versions: retention drops the
    // oldest points for room long before the 10^4 flushes end
    let data = d.dir.sparse("data.img", (blocks + 1300) * BS);
    let journal = d.dir.sparse("journal.img", 8 * MIB);
    let table = format!("0 {} cdp {} {}", size / 512, data.display(), journal.display());
    d.create("vol", &table);
    let mut m = Model::new(blocks as usize);
    let mut rng = Rng(0xcd9);
    let mut seed = 1u64;
    let mut kept_seen = Vec::new();
    for round in 0..4 {
        let mut c = Client::connect(&d.sock(), "vol");
        for _ in 0..2500 {
            for _ in 0..rng.below(3) + 1 {
                let b = rng.below(blocks) as usize;
                match rng.below(10) {
                    0 => {
                        assert_eq!(c.call(TRIM, 0, b as u64 * BS, BS as u32, &[]), 0);
                        m.set(b, m.n + 1, None);
                    }
                    1 => {
                        // a FUA write is a point of its own
                        let data = pattern(seed, BS as usize);
                        assert_eq!(c.call(WRITE, FLAG_FUA, b as u64 * BS, BS as u32, &data), 0);
                        m.n += 1;
                        m.set(b, m.n, Some(seed));
                        seed += 1;
                    }
                    _ => {
                        c.write(b as u64 * BS, &pattern(seed, BS as usize));
                        m.set(b, m.n + 1, Some(seed));
                        seed += 1;
                    }
                }
            }
            assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
            m.n += 1;
        }
        // a write no flush took
        let b = rng.below(blocks) as usize;
        c.write(b as u64 * BS, &pattern(seed, BS as usize));
        let unflushed = (b, seed);
        seed += 1;
        let st = status_words(&d, "vol");
        assert_eq!(
            st[4],
            m.n.to_string(),
            "status: the last flush committed is the client's count"
        );
        let kept = check_points(&d, "vol", &m, size);
        assert!(
            kept > 100 && (kept as u64) < m.n,
            "round {round}: {kept} of {} points kept",
            m.n
        );
        kept_seen.push(kept);
        drop(c);
        d = d.kill9_and_restore();
        // the device after the kill: the last point and the write no flush
        // took (acknowledged: the killed daemon's restart log gives it back)
        let mut c = Client::connect(&d.sock(), "vol");
        let got = read_all(&mut c, size);
        m.set(unflushed.0, m.n + 1, Some(unflushed.1));
        assert_same(
            &got,
            &m.image(m.n + 1),
            &format!("the device after kill -9 in round {round}"),
        );
        assert_eq!(
            check_points(&d, "vol", &m, size),
            kept,
            "round {round}: the points kept before the kill are kept after it"
        );
    }
    assert!(m.n >= 10_000, "{} points made", m.n);
    // the views made for the checks went at their last close
    assert_eq!(
        d.ok(&["ls"]).lines().count(),
        1,
        "only vol is left: {}",
        d.ok(&["ls"])
    );
    // space: the data blocks in use never pass the data device
    let st = status_words(&d, "vol");
    let (used, total) = st[0].split_once('/').expect("used/total");
    assert!(used.parse::<u64>().unwrap() <= total.parse::<u64>().unwrap());
    println!("kept points per round: {kept_seen:?}");
}

#[test]
fn marks_times_views_and_a_writable_thin_snapshot_of_a_point() {
    let d = Daemon::start("cdp-views");
    let size = 4 * MIB;
    let data = d.dir.sparse("data.img", 6 * MIB);
    let journal = d.dir.sparse("journal.img", 8 * MIB);
    d.create(
        "vol",
        &format!(
            "0 {} cdp {} {} 4 keep 1h:0 keep 1d:1m",
            size / 512,
            data.display(),
            journal.display()
        ),
    );
    assert_eq!(
        d.ok(&["table", "vol"]).trim(),
        format!(
            "0 {} cdp {} {} 4 keep 1h:0 keep 1day:1m",
            size / 512,
            data.display(),
            journal.display()
        )
    );
    let mut c = Client::connect(&d.sock(), "vol");
    c.write(0, &pattern(1, 8192));
    let before = d.ok(&["message", "vol", "0", "mark", "before-upgrade"]);
    assert_eq!(before.trim(), "flush:1");
    std::thread::sleep(Duration::from_millis(1100));
    let t_mid = points(&d, "vol")[0].1.clone();
    c.write(4096, &pattern(2, 4096));
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    let want1 = {
        let mut v = pattern(1, 8192);
        v.resize(size as usize, 0);
        v
    };
    let mut want2 = want1.clone();
    want2[4096..8192].copy_from_slice(&pattern(2, 4096));
    // by mark, by time (the newest point at or before it), by number
    for (export, want) in [
        ("vol@mark:before-upgrade", &want1),
        (&format!("vol@time:{t_mid}") as &str, &want1),
        ("vol@flush:2", &want2),
    ] {
        let mut v = Client::connect(&d.sock(), export);
        assert_same(&read_all(&mut v, size), want, export);
        // read-only: a write fails
        assert_ne!(v.call(WRITE, 0, 0, 4096, &[0u8; 4096]), 0, "{export}: a write");
    }
    // names that are not points: answered as devices that do not exist (one
    // that would add a table line over a file of the host among them)
    let injected = format!("vol@flush:1\n0 8 linear {} 0", data.display());
    for bad in [
        "vol@flush:99",
        "vol@mark:nope",
        "vol@time:1999-01-01T00:00:00Z",
        "vol@when:now",
        "nope@flush:1",
        "vol@flush:1 2",
        injected.as_str(),
    ] {
        let e = common::nbd::go_on(common::nbd::greet(&d.sock()), bad)
            .err()
            .map(|(_, e)| e);
        assert!(e.is_some(), "{bad}: NBD_OPT_GO must fail");
    }
    assert_eq!(
        d.ok(&["ls"]).lines().count(),
        1,
        "no view is left behind: {}",
        d.ok(&["ls"])
    );
    // a view made by hand pins its point; a thin device over it is writable
    d.create(
        "then",
        &format!("0 {} cdp-point /dev/mapper/vol mark:before-upgrade", size / 512),
    );
    let t = d.ok(&["table", "then"]);
    assert!(
        t.starts_with(&format!("0 {} cdp-point ", size / 512)) && t.trim_end().ends_with(" flush:1"),
        "the view's table names its point by number: {t}"
    );
    let meta = d.dir.sparse("meta.img", 4 * MIB);
    let pdata = d.dir.sparse("pdata.img", 16 * MIB);
    d.create(
        "pool",
        &format!(
            "0 {} thin-pool {} {} 128 0",
            16 * MIB / 512,
            meta.display(),
            pdata.display()
        ),
    );
    d.ok(&["message", "pool", "0", "create_thin", "0"]);
    d.create(
        "snap",
        &format!("0 {} thin /dev/mapper/pool 0 /dev/mapper/then", size / 512),
    );
    let mut s = Client::connect(&d.sock(), "snap");
    assert_same(
        &read_all(&mut s, size),
        &want1,
        "the thin snapshot of mark:before-upgrade",
    );
    s.write(0, &pattern(3, 4096));
    let mut want3 = want1.clone();
    want3[..4096].copy_from_slice(&pattern(3, 4096));
    assert_same(&read_all(&mut s, size), &want3, "the thin snapshot after a write");
    // the cdp device goes on, its point unchanged
    c.write(0, &pattern(4, 4096));
    assert_eq!(c.call(FLUSH, 0, 0, 0, &[]), 0);
    let mut v = Client::connect(&d.sock(), "then");
    assert_same(
        &read_all(&mut v, size),
        &want1,
        "the pinned point after more writes",
    );
    assert!(
        d.fails(&["remove", "vol"]).contains("busy"),
        "the cdp device is held by its view"
    );
}

#[test]
fn tables_and_journals_that_lie_are_refused_with_what_is_wrong() {
    let d = Daemon::start("cdp-refused");
    let data = d.dir.sparse("data.img", 6 * MIB);
    let journal = d.dir.sparse("journal.img", 8 * MIB);
    let small = d.dir.sparse("small.img", 64 * 1024);
    let (dp, jp) = (data.display().to_string(), journal.display().to_string());
    for (args, want) in [
        (dp.clone(), "Invalid argument count"),
        (format!("{dp} {dp}"), "the same device"),
        (format!("{dp} {jp} 2 block_size 7"), "a power of two"),
        (format!("{dp} {jp} 2 keep 1h"), "expected AGE:EVERY"),
        (
            format!("{dp} {jp} 4 keep 1d:0 keep 1h:0"),
            "longer than the one before",
        ),
        (format!("{dp} {jp} 2 frobnicate 1"), "Unrecognised cdp feature"),
        (
            format!("{dp} {jp} 3 keep 1h:0"),
            "3 feature arguments announced, 2 given",
        ),
        (format!("{dp} {}", small.display()), "journal device"),
    ] {
        let e = d.fails(&["create", "x", "--table", &format!("0 8192 cdp {args}")]);
        assert!(e.contains(want), "cdp {args}: {e}");
    }
    let e = d.fails(&["create", "x", "--table", &format!("0 12288 cdp {dp} {jp}")]);
    assert!(e.contains("needs at least"), "a data device too small: {e}");
    // a journal device that holds something else is left alone
    std::fs::write(&journal, vec![0x5au8; 4096]).expect("write");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .expect("open")
        .set_len(8 * MIB)
        .expect("len");
    let e = d.fails(&["create", "x", "--table", &format!("0 8192 cdp {dp} {jp}")]);
    assert!(e.contains("not a cdp journal"), "{e}");
    assert_eq!(
        common::read_at(&journal, 0, 4),
        vec![0x5a; 4],
        "the journal device is untouched"
    );
    // made for another geometry
    std::fs::write(&journal, b"").expect("truncate");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .expect("open")
        .set_len(8 * MIB)
        .expect("len");
    d.create("x", &format!("0 8192 cdp {dp} {jp}"));
    d.ok(&["remove", "x"]);
    let e = d.fails(&["create", "x", "--table", &format!("0 4096 cdp {dp} {jp}")]);
    assert!(e.contains("the journal was made for 1024 blocks"), "{e}");
    // messages
    d.create("x", &format!("0 8192 cdp {dp} {jp}"));
    // part of a block: refused (the device's logical block size is its block's),
    // the block unchanged; written and not flushed, the table removed and made
    // again: the write is there
    let mut c = Client::connect(&d.sock(), "x");
    c.write(0, &pattern(7, 4096));
    assert_eq!(
        c.call(WRITE, 0, 512, 512, &[1u8; 512]),
        libc::EINVAL as u32,
        "a write of part of a block"
    );
    assert_eq!(
        c.call(WRITE_ZEROES, 0, 512, 512, &[]),
        libc::EINVAL as u32,
        "a zeroing of part of a block"
    );
    assert_eq!(
        c.read(0, 4096),
        pattern(7, 4096),
        "the block after the refused writes"
    );
    drop(c);
    d.remove_closed("x");
    d.create("x", &format!("0 8192 cdp {dp} {jp}"));
    let mut c = Client::connect(&d.sock(), "x");
    assert_eq!(
        c.read(0, 4096),
        pattern(7, 4096),
        "a write no flush took, after the table went and came back"
    );
    drop(c);
    for (msg, want) in [
        (vec!["mark", "a/c"], "a label of 1 to 64"),
        (vec!["mark", "a", "b"], "Unrecognised cdp message"),
        (vec!["frob"], "Unrecognised cdp message"),
        (vec!["points", "x"], "is not a count"),
    ] {
        let mut args = vec!["message", "x", "0"];
        args.extend(msg.iter());
        let e = d.fails(&args);
        assert!(e.contains(want), "{msg:?}: {e}");
    }
    let e = d.fails(&["create", "v", "--table", "0 8192 cdp-point /dev/mapper/x flush:5"]);
    assert!(e.contains("flush 5 is not kept"), "{e}");
    let e = d.fails(&[
        "create",
        "v",
        "--table",
        &format!("0 8192 cdp-point {dp} flush:1"),
    ]);
    assert!(e.contains("not a dmkit device with a cdp table"), "{e}");
}
