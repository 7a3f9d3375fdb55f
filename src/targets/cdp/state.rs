//! The cdp index, without I/O: each block's current version and the older
//! versions some kept point still reads, the points, and the data blocks in
//! use. The target drives it; a journal's replay rebuilds it with the same
//! calls.
//!
//! A version carries `fp`, the first flush point it belongs to: a write that
//! completes while `s` flushes have been issued belongs to point `s + 1` and
//! every later one until the block is written again. Point `p` reads, for
//! each block, the newest version with `fp <= p`. An older version is kept
//! while a kept point lies in `[its fp, the next version's fp)`; it is filed
//! under the newest such point, and looked at again when that point goes.

use std::collections::{BTreeMap, HashMap};

/// The data block of a version that reads as zeroes (never written, discarded).
pub const ZEROES: u64 = u64::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Version {
    pub fp: u64,
    pub slot: u64,
}

/// A version of no data: what a block never written reads at every point.
pub const BLANK: Version = Version { fp: 0, slot: ZEROES };

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Point {
    /// The client's flush number (flushes and FUA writes, from 1): how users
    /// name it (`flush:N`). Point numbers also count the commits the target
    /// makes for room, which are no points.
    pub flush: u64,
    pub time_ns: u64,
    pub label: Option<String>,
}

/// A data block no version needs any more, and when it may be used again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Garbage {
    /// Never journaled: free once no read still in flight may be reading it.
    Now(u64),
    /// Journaled: free once flush point `.0` (whose version replaced it) is
    /// committed, so that a replay after a crash never finds it in use.
    After(u64, u64),
}

pub struct Index {
    pub cur: Vec<Version>,
    old: HashMap<u64, Vec<Version>>,
    pub points: BTreeMap<u64, Point>,
    /// Older versions by the point that keeps them: (block, fp).
    keeps: HashMap<u64, Vec<(u64, u64)>>,
    data_blocks: u64,
    /// Data blocks never used since the index was made: `next_fresh..`.
    next_fresh: u64,
    free: Vec<u64>,
    /// Data blocks in use or waiting to be freed.
    pub used: u64,
    /// Older versions kept.
    pub kept_versions: u64,
}

impl Index {
    pub fn new(dev_blocks: usize, data_blocks: u64) -> Index {
        Index {
            cur: vec![BLANK; dev_blocks],
            old: HashMap::new(),
            points: BTreeMap::new(),
            keeps: HashMap::new(),
            data_blocks,
            next_fresh: 0,
            free: Vec::new(),
            used: 0,
            kept_versions: 0,
        }
    }

    /// A data block for a new version, if one is free.
    pub fn alloc(&mut self) -> Option<u64> {
        let s = self.free.pop().or_else(|| {
            (self.next_fresh < self.data_blocks).then(|| {
                self.next_fresh += 1;
                self.next_fresh - 1
            })
        })?;
        self.used += 1;
        Some(s)
    }

    /// Data blocks free now.
    pub fn free_blocks(&self) -> u64 {
        self.free.len() as u64 + (self.data_blocks - self.next_fresh)
    }

    pub fn release(&mut self, slot: u64) {
        if slot != ZEROES {
            self.used = self.used.saturating_sub(1);
            self.free.push(slot);
        }
    }

    /// What point `p` reads at `block`.
    pub fn at_point(&self, block: u64, p: u64) -> Version {
        let c = self.cur[block as usize];
        if c.fp <= p {
            return c;
        }
        let Some(vs) = self.old.get(&block) else {
            return BLANK;
        };
        match vs.partition_point(|v| v.fp <= p) {
            0 => BLANK,
            i => vs[i - 1],
        }
    }

    /// The newest point that lies in `[lo, hi)`: kept, or issued and not yet
    /// committed (`(committed, issued]`).
    fn keeper(&self, lo: u64, hi: u64, committed: u64, issued: u64) -> Option<u64> {
        if hi == 0 || lo >= hi {
            return None;
        }
        let pending_hi = issued.min(hi - 1);
        if pending_hi > committed && pending_hi >= lo {
            return Some(pending_hi);
        }
        self.points.range(lo..hi).next_back().map(|(&n, _)| n)
    }

    /// Block `block` now holds `v` (a write completed, or a discard); what
    /// it held before is kept for the points that read it, or is garbage.
    pub fn install(&mut self, block: u64, v: Version, committed: u64, issued: u64) -> Option<Garbage> {
        let old = std::mem::replace(&mut self.cur[block as usize], v);
        if old == BLANK {
            return None;
        }
        match self.keeper(old.fp, v.fp, committed, issued) {
            Some(q) => {
                self.old.entry(block).or_default().push(old);
                self.keeps.entry(q).or_default().push((block, old.fp));
                self.kept_versions += 1;
                None
            }
            None if old.slot == ZEROES => None,
            None if old.fp == v.fp => Some(Garbage::Now(old.slot)),
            None => Some(Garbage::After(v.fp, old.slot)),
        }
    }

    /// Point `n` is dropped: the versions it kept go to the next older point
    /// that reads them, or are garbage.
    pub fn drop_point(&mut self, n: u64, out: &mut Vec<Garbage>) {
        self.points.remove(&n);
        for (block, fp) in self.keeps.remove(&n).unwrap_or_default() {
            let Some(vs) = self.old.get_mut(&block) else { continue };
            let Ok(i) = vs.binary_search_by_key(&fp, |v| v.fp) else {
                continue;
            };
            let end = vs.get(i + 1).map_or(self.cur[block as usize].fp, |v| v.fp);
            if let Some((&q, _)) = self.points.range(fp..end.min(n)).next_back() {
                self.keeps.entry(q).or_default().push((block, fp));
                continue;
            }
            let gone = vs.remove(i);
            if vs.is_empty() {
                self.old.remove(&block);
            }
            self.kept_versions -= 1;
            if gone.slot != ZEROES {
                out.push(Garbage::After(end, gone.slot));
            }
        }
    }

    /// Every version a replay at `committed` must see: for each block, the
    /// versions with `fp <= committed` (a checkpoint's content).
    pub fn journaled_versions(&self, committed: u64, mut f: impl FnMut(u64, Version)) {
        for (b, c) in self.cur.iter().enumerate() {
            let b = b as u64;
            if let Some(vs) = self.old.get(&b) {
                for v in vs.iter().filter(|v| v.fp <= committed) {
                    f(b, *v);
                }
            }
            if *c != BLANK && c.fp <= committed {
                f(b, *c);
            }
        }
    }

    /// After a replay: every data block no version names is free.
    pub fn rebuild_free(&mut self) {
        let mut inuse = vec![false; self.data_blocks as usize];
        let mut mark = |s: u64| {
            if let Some(x) = inuse.get_mut(s as usize) {
                *x = true;
            }
        };
        for v in &self.cur {
            mark(v.slot);
        }
        for vs in self.old.values() {
            for v in vs {
                mark(v.slot);
            }
        }
        let last = inuse.iter().rposition(|&x| x).map_or(0, |i| i as u64 + 1);
        self.next_fresh = last;
        self.free = (0..last).rev().filter(|&s| !inuse[s as usize]).collect();
        self.used = inuse.iter().filter(|&&x| x).count() as u64;
    }

    /// A slot named by a journal must lie on the data device.
    pub fn slot_ok(&self, slot: u64) -> bool {
        slot == ZEROES || slot < self.data_blocks
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(ix: &mut Index, n: u64) {
        ix.points.insert(
            n,
            Point {
                flush: n,
                time_ns: n,
                label: None,
            },
        );
    }

    #[test]
    fn points_read_their_versions_and_dropping_them_frees_only_what_none_reads() {
        let mut ix = Index::new(4, 16);
        let (a, b, c) = (ix.alloc().unwrap(), ix.alloc().unwrap(), ix.alloc().unwrap());
        // block 0: a in epoch 1, then flush 1, b in epoch 2, flush 2, c in epoch 3
        assert_eq!(ix.install(0, Version { fp: 1, slot: a }, 0, 0), None);
        point(&mut ix, 1);
        assert_eq!(ix.install(0, Version { fp: 2, slot: b }, 1, 1), None);
        point(&mut ix, 2);
        assert_eq!(ix.install(0, Version { fp: 3, slot: c }, 2, 2), None);
        assert_eq!(ix.at_point(0, 1).slot, a);
        assert_eq!(ix.at_point(0, 2).slot, b);
        assert_eq!(ix.at_point(0, 9).slot, c);
        assert_eq!(ix.at_point(1, 2), BLANK);
        let mut g = Vec::new();
        ix.drop_point(1, &mut g);
        assert_eq!(g, vec![Garbage::After(2, a)]);
        g.clear();
        ix.drop_point(2, &mut g);
        assert_eq!(g, vec![Garbage::After(3, b)]);
        assert_eq!(ix.kept_versions, 0);
        // rewritten in its own epoch: garbage at once
        let d = ix.alloc().unwrap();
        assert_eq!(ix.install(0, Version { fp: 3, slot: d }, 2, 2), Some(Garbage::Now(c)));
        // a flush issued and not committed keeps what it will read
        let e = ix.alloc().unwrap();
        assert_eq!(ix.install(0, Version { fp: 4, slot: e }, 2, 3), None);
        assert_eq!(ix.at_point(0, 3).slot, d);
    }

    #[test]
    fn a_version_kept_by_two_points_goes_to_the_older_when_the_newer_goes() {
        let mut ix = Index::new(1, 8);
        let a = ix.alloc().unwrap();
        ix.install(0, Version { fp: 1, slot: a }, 0, 0);
        point(&mut ix, 1);
        point(&mut ix, 2);
        point(&mut ix, 3);
        let b = ix.alloc().unwrap();
        ix.install(0, Version { fp: 4, slot: b }, 3, 3);
        let mut g = Vec::new();
        ix.drop_point(3, &mut g);
        assert!(g.is_empty());
        assert_eq!(ix.at_point(0, 2).slot, a);
        ix.drop_point(1, &mut g);
        assert!(g.is_empty());
        ix.drop_point(2, &mut g);
        assert_eq!(g, vec![Garbage::After(4, a)]);
    }

    #[test]
    fn a_discard_hides_older_data_from_later_points() {
        let mut ix = Index::new(1, 8);
        let a = ix.alloc().unwrap();
        ix.install(0, Version { fp: 1, slot: a }, 0, 0);
        point(&mut ix, 1);
        ix.install(0, Version { fp: 2, slot: ZEROES }, 1, 1);
        point(&mut ix, 2);
        assert_eq!(ix.at_point(0, 1).slot, a);
        assert_eq!(ix.at_point(0, 2).slot, ZEROES);
        let mut rebuilt = Index::new(1, 8);
        ix.journaled_versions(2, |b, v| {
            rebuilt.install(b, v, 0, 0);
        });
        assert_eq!(rebuilt.cur[0].slot, ZEROES);
    }

    #[test]
    fn free_blocks_are_rebuilt_from_what_versions_name() {
        let mut ix = Index::new(3, 8);
        ix.cur[0] = Version { fp: 1, slot: 5 };
        ix.cur[2] = Version { fp: 1, slot: 1 };
        ix.rebuild_free();
        assert_eq!(ix.used, 2);
        assert_eq!(ix.free_blocks(), 6);
        let got: Vec<u64> = (0..6).map(|_| ix.alloc().unwrap()).collect();
        assert_eq!(got, vec![0, 2, 3, 4, 6, 7]);
        assert_eq!(ix.alloc(), None);
    }
}
