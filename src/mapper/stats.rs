//! dm statistics: I/O counters over regions of a device, in areas of a step,
//! kept and printed as the kernel's `dm-stats` does, driven by the `@stats_*`
//! messages (`dmstats` sends them). With no region, a request costs one atomic
//! load.
//!
//! Counters per area, in `@stats_print` order: reads, reads merged, sectors
//! read, milliseconds reading, the same four for writes, I/Os in flight,
//! milliseconds with I/O in flight, weighted milliseconds (the sum of the
//! in-flight count over time), milliseconds with reads in flight, with writes in
//! flight; then, for a region with a histogram, the count of completions per
//! latency bucket. A region made with `precise_timestamps` counts nanoseconds
//! instead of milliseconds. Discards and writes of zeroes count as writes, as
//! the kernel's data direction does; flushes (no sectors) are not counted.

use super::TargetError;
use crate::io::Op;
use crate::sync::Unpoison;
use arc_swap::ArcSwap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Areas held by every region of every device together (each costs ~150 bytes
/// plus 8 per histogram bucket): a typo in a step cannot take the daemon's memory.
const MAX_AREAS: usize = 1 << 22;
/// Histogram boundaries per region.
const MAX_BOUNDS: usize = 256;
/// Bytes of a program id or aux data.
const MAX_TEXT: usize = 4096;
static AREAS_HELD: AtomicUsize = AtomicUsize::new(0);

fn invalid(msg: &str, why: impl std::fmt::Display) -> TargetError {
    TargetError::invalid(format!("{msg}: {why}"))
}

#[derive(Default)]
struct Area {
    ios: [AtomicU64; 2],
    merges: [AtomicU64; 2],
    sectors: [AtomicU64; 2],
    ticks: [AtomicU64; 2],
    io_ticks: [AtomicU64; 2],
    io_ticks_total: AtomicU64,
    time_in_queue: AtomicU64,
    in_flight: [AtomicU32; 2],
    stamp: AtomicU64,
}

impl Area {
    /// Carry the in-flight time since the last stamp (racy as the kernel's
    /// dm_stat_round: a lost update only loses a sliver of time).
    fn round(&self, now: u64) {
        let diff = now.saturating_sub(self.stamp.swap(now, Relaxed));
        if diff == 0 {
            return;
        }
        let (r, w) = (self.in_flight[0].load(Relaxed), self.in_flight[1].load(Relaxed));
        if r > 0 {
            self.io_ticks[0].fetch_add(diff, Relaxed);
        }
        if w > 0 {
            self.io_ticks[1].fetch_add(diff, Relaxed);
        }
        if r + w > 0 {
            self.io_ticks_total.fetch_add(diff, Relaxed);
            self.time_in_queue.fetch_add(u64::from(r + w) * diff, Relaxed);
        }
    }
}

struct Region {
    id: u32,
    start: u64,
    end: u64,
    step: u64,
    precise: bool,
    bounds: Vec<u64>,
    program_id: String,
    aux: Mutex<String>,
    areas: Box<[Area]>,
    /// `areas.len() * (bounds.len() + 1)` buckets when there is a histogram.
    hist: Box<[AtomicU64]>,
}

impl Region {
    fn now(&self, ns: u64) -> u64 {
        if self.precise {
            ns
        } else {
            ns / 1_000_000
        }
    }

    /// Each area `[sector, end)` touches, with the sectors it has there.
    fn each_area(&self, sector: u64, end: u64, mut f: impl FnMut(usize, u64)) {
        if end <= self.start || sector >= self.end {
            return;
        }
        let lo = sector.max(self.start);
        let hi = end.min(self.end);
        let mut at = lo;
        while at < hi {
            let i = ((at - self.start) / self.step) as usize;
            let area_end = (self.start + (i as u64 + 1) * self.step).min(hi);
            if i >= self.areas.len() {
                return;
            }
            f(i, area_end - at);
            at = area_end;
        }
    }

    fn account(&self, dir: usize, sector: u64, end: u64, done: Option<(u64, bool)>, ns: u64) {
        let now = self.now(ns);
        self.each_area(sector, end, |i, len| {
            let a = &self.areas[i];
            a.round(now);
            match done {
                None => {
                    a.in_flight[dir].fetch_add(1, Relaxed);
                }
                Some((start_ns, merged)) => {
                    a.in_flight[dir].fetch_sub(1, Relaxed);
                    a.sectors[dir].fetch_add(len, Relaxed);
                    a.ios[dir].fetch_add(1, Relaxed);
                    a.merges[dir].fetch_add(u64::from(merged), Relaxed);
                    let took = now.saturating_sub(self.now(start_ns));
                    a.ticks[dir].fetch_add(took, Relaxed);
                    if !self.bounds.is_empty() {
                        let b = self.bounds.partition_point(|&x| x <= took);
                        self.hist[i * (self.bounds.len() + 1) + b].fetch_add(1, Relaxed);
                    }
                }
            }
        });
    }

    fn list_line(&self) -> String {
        let mut s = format!(
            "{}: {}+{} {} {} {}",
            self.id,
            self.start,
            self.end - self.start,
            self.step,
            self.program_id,
            self.aux.lock().unpoisoned()
        );
        if self.precise {
            s.push_str(" precise_timestamps");
        }
        if !self.bounds.is_empty() {
            let b: Vec<String> = self.bounds.iter().map(u64::to_string).collect();
            s.push_str(" histogram:");
            s.push_str(&b.join(","));
        }
        s
    }

    fn print(&self, from: usize, len: usize, clear: bool, ns: u64) -> String {
        let end = from.saturating_add(len).min(self.areas.len());
        let from = from.min(end);
        let now = self.now(ns);
        let mut out = String::new();
        let nb = self.bounds.len() + 1;
        for i in from..end {
            let a = &self.areas[i];
            a.round(now);
            let g = |x: &AtomicU64| x.load(Relaxed);
            let in_flight = a.in_flight[0].load(Relaxed) + a.in_flight[1].load(Relaxed);
            out.push_str(&format!(
                "{}+{} {} {} {} {} {} {} {} {} {} {} {} {} {}",
                self.start + i as u64 * self.step,
                self.step,
                g(&a.ios[0]),
                g(&a.merges[0]),
                g(&a.sectors[0]),
                g(&a.ticks[0]),
                g(&a.ios[1]),
                g(&a.merges[1]),
                g(&a.sectors[1]),
                g(&a.ticks[1]),
                in_flight,
                g(&a.io_ticks_total),
                g(&a.time_in_queue),
                g(&a.io_ticks[0]),
                g(&a.io_ticks[1]),
            ));
            if nb > 1 {
                for (k, h) in self.hist[i * nb..(i + 1) * nb].iter().enumerate() {
                    out.push(if k == 0 { ' ' } else { ':' });
                    out.push_str(&g(h).to_string());
                }
            }
            out.push('\n');
        }
        if clear {
            for i in from..end {
                let a = &self.areas[i];
                for c in [&a.ios, &a.merges, &a.sectors, &a.ticks, &a.io_ticks] {
                    c.iter().for_each(|x| x.store(0, Relaxed));
                }
                a.io_ticks_total.store(0, Relaxed);
                a.time_in_queue.store(0, Relaxed);
                if nb > 1 {
                    self.hist[i * nb..(i + 1) * nb]
                        .iter()
                        .for_each(|x| x.store(0, Relaxed));
                }
            }
        }
        out
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        AREAS_HELD.fetch_sub(self.areas.len(), Relaxed);
    }
}

/// A device's statistics regions.
pub struct Stats {
    on: AtomicBool,
    regions: ArcSwap<Vec<Arc<Region>>>,
    edit: Mutex<()>,
    /// The end sector and direction of the last request started (the kernel's
    /// per-cpu `last` position, one per device here): a request that starts
    /// there in the same direction counts as merged.
    last: AtomicU64,
    base: Instant,
}

impl Default for Stats {
    fn default() -> Stats {
        Stats {
            on: AtomicBool::new(false),
            regions: ArcSwap::from_pointee(Vec::new()),
            edit: Mutex::new(()),
            last: AtomicU64::new(u64::MAX),
            base: Instant::now(),
        }
    }
}

/// What a started request needs to be accounted at its end.
#[derive(Clone, Copy, Debug, Default)]
pub struct Started {
    ns: u64,
    merged: bool,
}

/// Whether the stats message `verb` (lower case) answers even with nothing to
/// say, as the kernel's do (an empty `@stats_list` is the empty string, which
/// libdevmapper wants; delete and set_aux answer nothing).
pub fn answers(verb: &str) -> bool {
    matches!(
        verb,
        "@stats_create" | "@stats_list" | "@stats_print" | "@stats_print_clear" | "@stats_clear"
    )
}

fn dir_of(op: Op) -> Option<usize> {
    match op {
        Op::Read => Some(0),
        Op::Write | Op::Discard | Op::WriteZeroes => Some(1),
        _ => None,
    }
}

/// `@stats_create`'s range (`-` for the whole device of `size` sectors, or
/// `<start>+<length>`) and step (sectors, or `/<n>` areas): start, end, step.
fn range_and_step(m: &str, range: &str, step: &str, size: u64) -> Result<(u64, u64, u64), TargetError> {
    let (start, len) = if range == "-" {
        (0, size.max(1))
    } else {
        let (a, b) = range
            .split_once('+')
            .ok_or_else(|| invalid(m, format!("range '{range}' is not - or <start>+<length>")))?;
        let p = |x: &str| {
            x.parse::<u64>()
                .map_err(|_| invalid(m, format!("range '{range}'")))
        };
        (p(a)?, p(b)?)
    };
    let end = start
        .checked_add(len)
        .filter(|&e| e > start)
        .ok_or_else(|| invalid(m, format!("empty or overflowing range '{range}'")))?;
    let step = if let Some(d) = step.strip_prefix('/') {
        let d: u32 = d
            .parse()
            .ok()
            .filter(|&d| d > 0)
            .ok_or_else(|| invalid(m, format!("step '{step}'")))?;
        (end - start).div_ceil(u64::from(d)).max(1)
    } else {
        step.parse::<u64>()
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| invalid(m, format!("step '{step}'")))?
    };
    Ok((start, end, step))
}

/// `@stats_create`'s optional features (`<n> <feature>...`, taken from `it`
/// if the next word is a number): precise timestamps, histogram bounds.
fn features<'a>(
    m: &str,
    it: &mut std::iter::Peekable<impl Iterator<Item = &'a str>>,
) -> Result<(bool, Vec<u64>), TargetError> {
    let (mut precise, mut bounds) = (false, Vec::new());
    let Some(n) = it.peek().and_then(|a| a.parse::<u32>().ok()) else {
        return Ok((precise, bounds));
    };
    it.next();
    for _ in 0..n {
        let a = it
            .next()
            .ok_or_else(|| invalid(m, format!("{n} feature arguments announced")))?;
        if a.eq_ignore_ascii_case("precise_timestamps") {
            precise = true;
        } else if let Some(list) = a
            .get(..10)
            .filter(|p| p.eq_ignore_ascii_case("histogram:"))
            .and_then(|_| a.get(10..))
            .filter(|l| !l.is_empty())
        {
            // `get`: a word that is not ASCII there is an unknown feature, not a panic
            if !bounds.is_empty() {
                return Err(invalid(m, "histogram given twice"));
            }
            bounds = parse_bounds(m, list)?;
        } else {
            return Err(invalid(m, format!("unknown feature '{a}'")));
        }
    }
    Ok((precise, bounds))
}

impl Stats {
    /// Whether any region exists (the request path's only cost without one).
    #[inline]
    pub fn on(&self) -> bool {
        self.on.load(Relaxed)
    }

    fn ns(&self) -> u64 {
        // never 0: a started request's stamp is nonzero
        self.base.elapsed().as_nanos() as u64 + 1
    }

    /// A request starts: count it in flight in every area it touches.
    pub fn start(&self, op: Op, sector: u64, nr_sectors: u64) -> Option<Started> {
        let dir = dir_of(op)?;
        if nr_sectors == 0 {
            return None;
        }
        let end = sector.saturating_add(nr_sectors);
        // position and direction packed: the end sector shifted, the direction low
        let key = end.wrapping_shl(1) | dir as u64;
        let prev = self.last.swap(key, Relaxed);
        let merged = prev != u64::MAX && prev >> 1 == sector && (prev & 1) as usize == dir;
        let ns = self.ns();
        for r in self.regions.load().iter() {
            r.account(dir, sector, end, None, ns);
        }
        Some(Started { ns, merged })
    }

    /// A request started with `s` is done.
    pub fn end(&self, op: Op, sector: u64, nr_sectors: u64, s: Started) {
        let Some(dir) = dir_of(op) else { return };
        let ns = self.ns();
        let end = sector.saturating_add(nr_sectors);
        for r in self.regions.load().iter() {
            r.account(dir, sector, end, Some((s.ns, s.merged)), ns);
        }
    }

    /// One `@stats_*` message (`words[0]` names it) for a device of `size`
    /// sectors: its output, or None if it is not a stats message.
    pub fn message(&self, words: &[String], size: u64) -> Option<Result<String, TargetError>> {
        let verb = words.first()?.to_ascii_lowercase();
        let m = verb.as_str();
        let r = match m {
            "@stats_create" => self.create(m, &words[1..], size),
            "@stats_delete" => self.with_id(m, words, 2).and_then(|id| self.delete(id)),
            "@stats_clear" => self.with_id(m, words, 2).and_then(|id| {
                self.find(id)?.print(0, usize::MAX, true, self.ns());
                Ok(String::new())
            }),
            "@stats_list" => match words.len() {
                1 | 2 => Ok(self.list(words.get(1).map(String::as_str))),
                _ => Err(invalid(m, "takes at most a program id")),
            },
            "@stats_print" | "@stats_print_clear" => self.print_msg(m, words),
            "@stats_set_aux" => self.with_id(m, words, 3).and_then(|id| {
                let aux = &words[2];
                if aux.len() > MAX_TEXT {
                    return Err(invalid(m, "aux data longer than 4096 bytes"));
                }
                *self.find(id)?.aux.lock().unpoisoned() = aux.clone();
                Ok(String::new())
            }),
            _ => return None,
        };
        Some(r)
    }

    /// The region id in `words[1]` of a message of `n` words.
    fn with_id(&self, m: &str, words: &[String], n: usize) -> Result<u32, TargetError> {
        if words.len() != n {
            return Err(invalid(m, format!("takes {} argument(s)", n - 1)));
        }
        parse_id(m, &words[1])
    }

    fn find(&self, id: u32) -> Result<Arc<Region>, TargetError> {
        self.regions
            .load()
            .iter()
            .find(|r| r.id == id)
            .cloned()
            .ok_or_else(|| TargetError::new(libc::ENOENT, format!("no statistics region {id}")))
    }

    fn create(&self, m: &str, args: &[String], size: u64) -> Result<String, TargetError> {
        let mut it = args.iter().map(String::as_str).peekable();
        let (Some(range), Some(step)) = (it.next(), it.next()) else {
            return Err(invalid(m, "<range> <step> required"));
        };
        let (start, end, step) = range_and_step(m, range, step, size)?;
        let (precise, bounds) = features(m, &mut it)?;
        let program_id = it.next().unwrap_or("-").to_string();
        let aux = it.next().unwrap_or("-").to_string();
        if it.next().is_some() {
            return Err(invalid(m, "too many arguments"));
        }
        if program_id.len() > MAX_TEXT || aux.len() > MAX_TEXT {
            return Err(invalid(m, "program id or aux data longer than 4096 bytes"));
        }
        let n = (end - start).div_ceil(step);
        let buckets = bounds.len() + 1;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n.saturating_mul(buckets) <= MAX_AREAS)
            .ok_or_else(|| {
                TargetError::new(
                    libc::ENOMEM,
                    format!("{m}: {n} areas of {step} sectors (at most {MAX_AREAS} areas a region)"),
                )
            })?;
        let held = AREAS_HELD.fetch_add(n, Relaxed);
        if held + n > MAX_AREAS {
            AREAS_HELD.fetch_sub(n, Relaxed);
            return Err(TargetError::new(
                libc::ENOMEM,
                format!("{m}: {n} more areas than the {MAX_AREAS} all regions may hold"),
            ));
        }
        let hist_len = if bounds.is_empty() { 0 } else { n * buckets };
        let mut region = Region {
            id: 0,
            start,
            end,
            step,
            precise,
            bounds,
            program_id,
            aux: Mutex::new(aux),
            areas: (0..n).map(|_| Area::default()).collect(),
            hist: (0..hist_len).map(|_| AtomicU64::new(0)).collect(),
        };
        let _g = self.edit.lock().unpoisoned();
        let old = self.regions.load_full();
        // the lowest free id, as the kernel's
        let mut id = 0;
        for r in old.iter() {
            if r.id == id {
                id += 1;
            } else {
                break;
            }
        }
        region.id = id;
        let now = self.ns();
        for a in region.areas.iter() {
            a.stamp.store(region.now(now), Relaxed);
        }
        let mut new: Vec<Arc<Region>> = old.iter().cloned().collect();
        let at = new.partition_point(|r| r.id < id);
        new.insert(at, Arc::new(region));
        self.regions.store(Arc::new(new));
        self.on.store(true, Relaxed);
        Ok(id.to_string())
    }

    fn delete(&self, id: u32) -> Result<String, TargetError> {
        let _g = self.edit.lock().unpoisoned();
        self.find(id)?;
        let new: Vec<Arc<Region>> = self
            .regions
            .load()
            .iter()
            .filter(|r| r.id != id)
            .cloned()
            .collect();
        self.on.store(!new.is_empty(), Relaxed);
        self.regions.store(Arc::new(new));
        Ok(String::new())
    }

    fn list(&self, program: Option<&str>) -> String {
        let mut out = String::new();
        for r in self.regions.load().iter() {
            if program.is_none_or(|p| p == r.program_id) {
                out.push_str(&r.list_line());
                out.push('\n');
            }
        }
        out
    }

    fn print_msg(&self, m: &str, words: &[String]) -> Result<String, TargetError> {
        if words.len() != 2 && words.len() != 4 {
            return Err(invalid(
                m,
                "takes <region_id> [<starting_line> <number_of_lines>]",
            ));
        }
        let id = parse_id(m, &words[1])?;
        let num = |w: Option<&String>, dflt: usize| match w.map(String::as_str) {
            None | Some("-") => Ok(dflt),
            Some(x) => x
                .parse::<usize>()
                .map_err(|_| invalid(m, format!("line count '{x}'"))),
        };
        let from = num(words.get(2), 0)?;
        let len = num(words.get(3), usize::MAX)?;
        let r = self.find(id)?;
        Ok(r.print(from, len, m == "@stats_print_clear", self.ns()))
    }
}

fn parse_id(m: &str, w: &str) -> Result<u32, TargetError> {
    w.parse::<u32>()
        .ok()
        .filter(|&i| i <= i32::MAX as u32)
        .ok_or_else(|| invalid(m, format!("region id '{w}'")))
}

/// `n1,n2,...`: strictly increasing boundaries.
fn parse_bounds(m: &str, s: &str) -> Result<Vec<u64>, TargetError> {
    let mut out: Vec<u64> = Vec::new();
    for p in s.split(',') {
        let v: u64 = p
            .parse()
            .map_err(|_| invalid(m, format!("histogram boundary '{p}'")))?;
        if out.last().is_some_and(|&l| v <= l) || v == 0 {
            return Err(invalid(m, "histogram boundaries must increase from above 0"));
        }
        if out.len() == MAX_BOUNDS {
            return Err(invalid(m, format!("more than {MAX_BOUNDS} histogram boundaries")));
        }
        out.push(v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(s: &Stats, text: &str) -> Result<String, TargetError> {
        let w: Vec<String> = text.split_whitespace().map(str::to_string).collect();
        s.message(&w, 1000).expect("a stats message")
    }

    #[test]
    fn regions_count_reads_and_writes_per_area_as_the_kernel_prints_them() {
        let s = Stats::default();
        assert!(!s.on());
        assert_eq!(msg(&s, "@stats_create - /4 dmstats").unwrap(), "0");
        assert_eq!(
            msg(&s, "@stats_create 100+50 10 1 histogram:1,10 prog aux").unwrap(),
            "1"
        );
        assert!(s.on());
        assert_eq!(
            msg(&s, "@stats_list").unwrap(),
            "0: 0+1000 250 dmstats -\n1: 100+50 10 prog aux histogram:1,10\n"
        );
        assert_eq!(
            msg(&s, "@stats_list prog").unwrap(),
            "1: 100+50 10 prog aux histogram:1,10\n"
        );
        // a write over areas 0 and 1 of region 0, then a read following it
        let w = s.start(Op::Write, 240, 20).unwrap();
        s.end(Op::Write, 240, 20, w);
        let r = s.start(Op::Read, 260, 8).unwrap();
        assert!(!r.merged, "another direction");
        s.end(Op::Read, 260, 8, r);
        let r2 = s.start(Op::Read, 268, 8).unwrap();
        assert!(r2.merged, "starts where the last read ended");
        s.end(Op::Read, 268, 8, r2);
        assert!(s.start(Op::Flush, 0, 0).is_none());
        let p = msg(&s, "@stats_print 0").unwrap();
        let lines: Vec<&str> = p.lines().collect();
        assert_eq!(lines.len(), 4);
        let f = |l: &str| l.split(' ').map(str::to_string).collect::<Vec<_>>();
        let (a0, a1) = (f(lines[0]), f(lines[1]));
        assert_eq!(a0[0], "0+250");
        assert_eq!(&a0[1..4], ["0", "0", "0"]);
        assert_eq!(&a0[5..8], ["1", "0", "10"], "10 sectors of the write in area 0");
        assert_eq!(a1[0], "250+250");
        assert_eq!(&a1[1..4], ["2", "1", "16"], "two reads, one merged");
        assert_eq!(&a1[5..8], ["1", "0", "10"]);
        assert_eq!(a1[9], "0", "nothing in flight");
        assert_eq!(a0.len(), 14, "the range and 13 counters");
        // the histogram region: every completion lands in a bucket
        let p1 = msg(&s, "@stats_print 1 0 1").unwrap();
        assert_eq!(p1.lines().count(), 1);
        assert!(p1.starts_with("100+10 "), "{p1}");
        let h = msg(&s, "@stats_print 1").unwrap();
        let total: u64 = h
            .lines()
            .map(|l| {
                l.rsplit(' ')
                    .next()
                    .unwrap()
                    .split(':')
                    .map(|x| x.parse::<u64>().unwrap())
                    .sum::<u64>()
            })
            .sum();
        assert_eq!(total, 0, "nothing in 100..150");
        // in flight shows, clear keeps it
        let _open = s.start(Op::Write, 0, 8).unwrap();
        assert_eq!(f(msg(&s, "@stats_print_clear 0 0 1").unwrap().trim())[9], "1");
        let after = f(msg(&s, "@stats_print 0 0 1").unwrap().trim());
        assert_eq!(&after[1..9], ["0"; 8], "cleared");
        assert_eq!(after[9], "1", "still in flight");
        assert_eq!(msg(&s, "@stats_set_aux 0 newaux").unwrap(), "");
        assert!(msg(&s, "@stats_list dmstats").unwrap().contains("dmstats newaux"));
        assert_eq!(msg(&s, "@stats_delete 0").unwrap(), "");
        assert_eq!(msg(&s, "@stats_print 0").unwrap_err().errno(), libc::ENOENT);
        // the lowest free id is reused
        assert_eq!(msg(&s, "@stats_create 0+10 1").unwrap(), "0");
        msg(&s, "@stats_delete 0").unwrap();
        msg(&s, "@stats_delete 1").unwrap();
        assert!(!s.on());
    }

    #[test]
    fn bad_messages_get_the_kernels_errnos() {
        let s = Stats::default();
        for bad in [
            "@stats_create",
            "@stats_create -",
            "@stats_create - 0",
            "@stats_create - /0",
            "@stats_create 5+0 1",
            "@stats_create 18446744073709551615+2 1",
            "@stats_create - 1 1 histogram:5,5",
            "@stats_create - 1 1 histogram:0",
            "@stats_create - 1 2 precise_timestamps",
            "@stats_create - 1 1 bogus",
            // a character across the 10th byte (once a panic slicing it)
            "@stats_create - 1 1 histogramé1",
            "@stats_create - 1 1 histogram:",
            "@stats_create - 1 a b c",
            "@stats_delete x",
            "@stats_delete -1",
            "@stats_print 0 1",
            "@stats_list a b",
        ] {
            assert_eq!(msg(&s, bad).unwrap_err().errno(), libc::EINVAL, "{bad}");
        }
        assert_eq!(
            msg(&s, "@stats_create 0+18446744073709551614 1")
                .unwrap_err()
                .errno(),
            libc::ENOMEM
        );
        assert_eq!(msg(&s, "@stats_clear 3").unwrap_err().errno(), libc::ENOENT);
        assert!(s.message(&["@other".to_string()], 10).is_none());
    }

    proptest::proptest! {
        /// Any words a client sends as a stats message, ASCII or not (a
        /// character across any byte a parser looks at), get an answer or an
        /// error, never a panic: a panic on the control path ends the daemon.
        /// Creates are built as dmstats builds them (range, step, a count of
        /// features, the features, program id, aux data), so the features are
        /// parsed; the other verbs get any words.
        #[test]
        fn any_stats_message_is_answered_without_a_panic(
            verb in proptest::sample::select(vec![
                "@stats_create", "@stats_delete", "@stats_clear", "@stats_list",
                "@stats_print", "@stats_print_clear", "@stats_set_aux",
            ]),
            range in "(-|[0-9]{1,4}\\+[0-9]{1,4}|\\PC{0,6})",
            step in "(/?[0-9]{1,3}|\\PC{0,4})",
            features in proptest::collection::vec(
                "(histogram|precise_timestamps|histogram:)[:,0-9é€]{0,8}|\\PC{0,12}",
                0..3,
            ),
            rest in proptest::collection::vec("\\PC{0,14}", 0..3),
        ) {
            let s = Stats::default();
            let _ = msg(&s, "@stats_create - /4 one");
            let mut w = vec![verb.to_string(), range, step, features.len().to_string()];
            w.extend(features);
            w.extend(rest);
            let _ = s.message(&w, 1000);
        }
    }
}
