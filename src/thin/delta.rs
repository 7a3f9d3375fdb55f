//! thin_delta: the differences between two thin devices' mappings.

use super::dump::superblock_and_plan;
use super::superblock::NEEDS_CHECK;
use super::{Result, ThinError};
use crate::pdata::btree::{self, node};
use crate::pdata::tm::TransactionManager;
use crate::pdata::BlockKind;
use std::fmt::Write as _;

/// One side of a comparison: a device of the pool, or a mapping tree's root block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Thin(u64),
    Root(u64),
}

/// thin_delta's options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeltaOptions {
    /// `--thin1` or `--root1` (missing: an error before the metadata is read).
    pub left: Option<Side>,
    /// `--thin2` or `--root2`.
    pub right: Option<Side>,
    /// Each range with its data blocks, grouped by kind.
    pub verbose: bool,
    /// Compare in the held metadata snapshot.
    pub metadata_snap: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delta {
    LeftOnly,
    RightOnly,
    Same,
    Different,
}

impl Delta {
    fn tag(self) -> &'static str {
        match self {
            Delta::LeftOnly => "left_only",
            Delta::RightOnly => "right_only",
            Delta::Same => "same",
            Delta::Different => "different",
        }
    }
}

/// Thin blocks `begin..begin + length` of one kind; the data blocks they map
/// start at `left_data_begin` and `right_data_begin` (0 on a side without them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaRange {
    pub kind: Delta,
    pub begin: u64,
    pub length: u64,
    pub left_data_begin: u64,
    pub right_data_begin: u64,
}

/// A comparison: the superblock fields thin_delta prints, the sides, the ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaReport {
    pub time: u32,
    pub transaction: u64,
    pub needs_check: bool,
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
    pub left: Side,
    pub right: Side,
    pub ranges: Vec<DeltaRange>,
}

/// A device's mappings a leaf at a time: (virtual block, data block).
struct Cursor {
    leaves: Vec<u64>,
    li: usize,
    entries: Vec<(u64, u64)>,
    ei: usize,
}

impl Cursor {
    fn new(tm: &mut TransactionManager, root: u64) -> Result<Cursor> {
        let (leaves, _) = btree::leaves(tm, root, 8, false)?;
        Ok(Cursor {
            leaves,
            li: 0,
            entries: Vec::new(),
            ei: 0,
        })
    }

    /// At the start of leaf `li` (nothing of it taken yet).
    fn at_leaf_start(&self) -> Option<u64> {
        (self.ei >= self.entries.len())
            .then(|| self.leaves.get(self.li).copied())
            .flatten()
    }

    fn load(&mut self, tm: &mut TransactionManager) -> Result<()> {
        while self.ei >= self.entries.len() && self.li < self.leaves.len() {
            let b = self.leaves[self.li];
            self.li += 1;
            let d = tm.read(b, BlockKind::BtreeNode)?;
            node::check_header(b, d, 8)?;
            self.entries.clear();
            self.entries
                .extend((0..node::nr_entries(d)).map(|i| (node::key(d, i), node::value_u64(d, i) >> 24)));
            self.ei = 0;
        }
        Ok(())
    }

    fn peek(&mut self, tm: &mut TransactionManager) -> Result<Option<(u64, u64)>> {
        self.load(tm)?;
        Ok(self.entries.get(self.ei).copied())
    }
}

/// The ranges where two trees' mappings agree or differ, thin-contiguous ranges
/// of one kind merged; read a leaf at a time, and a leaf both share is read once.
fn delta_stream(tm: &mut TransactionManager, lroot: u64, rroot: u64) -> Result<Vec<DeltaRange>> {
    let (mut l, mut r) = (Cursor::new(tm, lroot)?, Cursor::new(tm, rroot)?);
    let mut out: Vec<DeltaRange> = Vec::new();
    let mut push = |kind: Delta, v: u64, dl: u64, dr: u64| match out.last_mut() {
        Some(p) if p.kind == kind && p.begin + p.length == v => p.length += 1,
        _ => out.push(DeltaRange {
            kind,
            begin: v,
            length: 1,
            left_data_begin: dl,
            right_data_begin: dr,
        }),
    };
    loop {
        // the same leaf on both sides: all of it is the same
        if let (Some(a), Some(b)) = (l.at_leaf_start(), r.at_leaf_start()) {
            if a == b {
                l.load(tm)?;
                for &(v, d) in &l.entries {
                    push(Delta::Same, v, d, d);
                }
                l.ei = l.entries.len();
                r.li += 1;
                continue;
            }
        }
        match (l.peek(tm)?, r.peek(tm)?) {
            (Some(a), Some(b)) if a.0 == b.0 => {
                let k = if a.1 == b.1 { Delta::Same } else { Delta::Different };
                push(k, a.0, a.1, b.1);
                l.ei += 1;
                r.ei += 1;
            }
            (Some(a), Some(b)) if a.0 < b.0 => {
                push(Delta::LeftOnly, a.0, a.1, 0);
                l.ei += 1;
            }
            (Some(a), None) => {
                push(Delta::LeftOnly, a.0, a.1, 0);
                l.ei += 1;
            }
            (_, Some(b)) => {
                push(Delta::RightOnly, b.0, 0, b.1);
                r.ei += 1;
            }
            (None, None) => break,
        }
    }
    Ok(out)
}

/// A side and its mapping tree's root.
type Rooted = (Side, u64);

/// The superblock and the two sides `o` names with their mapping trees' roots.
/// A missing side is refused before the metadata is read, as 1.x does.
fn sides(
    tm: &mut TransactionManager,
    o: &DeltaOptions,
) -> Result<(super::superblock::Superblock, Rooted, Rooted)> {
    let given = |n: u8, side: Option<Side>| {
        side.ok_or_else(|| ThinError::Plain(format!("--thin{n} or --root{n} not specified")))
    };
    let sides = [given(1, o.left)?, given(2, o.right)?];
    let (sb, plan) = superblock_and_plan(tm, o.metadata_snap)?;
    let root = |n: u8, side: Side| -> Result<Rooted> {
        match side {
            Side::Thin(t) => plan
                .devices
                .iter()
                .find(|d| d.0 == t)
                .map(|d| (side, d.2))
                .ok_or_else(|| ThinError::Plain(format!("Unable to find mapping tree for snap{n} ({t})"))),
            Side::Root(r) => Ok((side, r)),
        }
    };
    Ok((sb, root(1, sides[0])?, root(2, sides[1])?))
}

/// Compare the two sides `o` names in the metadata `tm` reads.
pub fn delta(tm: &mut TransactionManager, o: &DeltaOptions) -> Result<DeltaReport> {
    let (sb, (left, lroot), (right, rroot)) = sides(tm, o)?;
    Ok(DeltaReport {
        time: sb.time,
        transaction: sb.trans_id,
        needs_check: sb.flags & NEEDS_CHECK != 0,
        data_block_size: sb.data_block_size,
        nr_data_blocks: sb.data_sm_root.nr_blocks,
        left,
        right,
        ranges: delta_stream(tm, lroot, rroot)?,
    })
}

/// Only what changed between the two sides `o` names: runs (first thin block,
/// blocks) of the blocks mapped on one side only or to different data blocks,
/// from thin block `from`, at most `max_runs` of them, and the pool's data
/// block size in sectors. Subtrees the two share are not read (a snapshot and
/// its origin share all they have not written since), so the work follows the
/// change, not the volume; the memory is the runs returned. A caller pages
/// through a large delta by asking again from the end of the last run.
pub fn changed_runs(
    tm: &mut TransactionManager,
    o: &DeltaOptions,
    from: u64,
    max_runs: usize,
) -> Result<(u32, Vec<(u64, u64)>)> {
    let (sb, (_, lroot), (_, rroot)) = sides(tm, o)?;
    Ok((
        sb.data_block_size,
        runs_between(tm, (Some(lroot), rroot), from, max_runs)?,
    ))
}

/// The runs of blocks the right side of `o` maps, from thin block `from`, at
/// most `max_runs` of them, and the pool's data block size in sectors (as
/// [`changed_runs`], against an empty tree: the work and memory follow what is
/// returned, not the volume).
pub fn mapped_runs(
    tm: &mut TransactionManager,
    o: &DeltaOptions,
    from: u64,
    max_runs: usize,
) -> Result<(u32, Vec<(u64, u64)>)> {
    let (sb, _, (_, rroot)) = sides(tm, o)?;
    Ok((
        sb.data_block_size,
        runs_between(tm, (None, rroot), from, max_runs)?,
    ))
}

/// The runs of keys two mapping trees (None: empty) map to different data
/// blocks, from `from`, at most `max_runs` (a new time stamp on the same data
/// block is no change).
fn runs_between(
    tm: &mut TransactionManager,
    roots: (Option<u64>, u64),
    from: u64,
    max_runs: usize,
) -> Result<Vec<(u64, u64)>> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let data = |v: Option<u64>| v.map(|v| v >> 24);
    btree::diff_u64(tm, (roots.0, Some(roots.1)), from, &mut |k, l, r| {
        if data(l) == data(r) {
            return true; // the same data block, another time stamp
        }
        let n = runs.len();
        match runs.last_mut() {
            Some(p) if p.0 + p.1 == k => p.1 += 1,
            _ if n == max_runs => return false,
            _ => runs.push((k, 1)),
        }
        true
    })?;
    Ok(runs)
}

/// thin_delta's XML for a report (no newline at the end, as thin_delta).
pub fn render(d: &DeltaReport, verbose: bool) -> String {
    let attr = |n: u8, side: Side| {
        let name = if n == 1 { "left" } else { "right" };
        match side {
            Side::Thin(t) => format!("{name}=\"{t}\""),
            Side::Root(r) => format!("{name}_root=\"{r}\""),
        }
    };
    let flags = if d.needs_check { " flags=\"1\"" } else { "" };
    let mut s = format!(
        "<superblock uuid=\"\" time=\"{}\" transaction=\"{}\"{flags} data_block_size=\"{}\" nr_data_blocks=\"{}\">\n  <diff {} {}>\n",
        d.time,
        d.transaction,
        d.data_block_size,
        d.nr_data_blocks,
        attr(1, d.left),
        attr(2, d.right)
    );
    let mut open: Option<Delta> = None;
    for r in &d.ranges {
        let (k, v, len) = (r.kind, r.begin, r.length);
        if !verbose {
            let _ = writeln!(s, "    <{} begin=\"{v}\" length=\"{len}\"/>", k.tag());
            continue;
        }
        if open != Some(k) {
            if let Some(o) = open {
                let _ = writeln!(s, "    </{}>", o.tag());
            }
            let _ = writeln!(s, "    <{}>", k.tag());
            open = Some(k);
        }
        match k {
            Delta::Different => {
                let _ = writeln!(
                    s,
                    "      <range begin=\"{v}\" left_data_begin=\"{}\" right_data_begin=\"{}\" length=\"{len}\"/>",
                    r.left_data_begin, r.right_data_begin
                );
            }
            _ => {
                let d = if k == Delta::RightOnly {
                    r.right_data_begin
                } else {
                    r.left_data_begin
                };
                let _ = writeln!(
                    s,
                    "      <range begin=\"{v}\" data_begin=\"{d}\" length=\"{len}\"/>"
                );
            }
        }
    }
    if let Some(o) = open {
        let _ = writeln!(s, "    </{}>", o.tag());
    }
    s.push_str("  </diff>\n</superblock>");
    s
}

/// thin_delta's output for `o` on the metadata `tm` reads.
pub fn delta_text(tm: &mut TransactionManager, o: &DeltaOptions) -> Result<String> {
    Ok(render(&delta(tm, o)?, o.verbose))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pdata::MemDev;
    use crate::thin::{FormatOptions, ThinPoolMetadata};

    /// What `delta` calls different, left only or right only (or, with
    /// `same`, the same), as runs.
    fn runs_from_delta(
        tm: &mut TransactionManager,
        o: &DeltaOptions,
        from: u64,
        same: bool,
    ) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let rep = delta(tm, o).expect("delta");
        for r in rep.ranges.iter().filter(|r| (r.kind == Delta::Same) == same) {
            for v in (r.begin..r.begin + r.length).filter(|&v| v >= from) {
                match runs.last_mut() {
                    Some(p) if p.0 + p.1 == v => p.1 += 1,
                    _ => runs.push((v, 1)),
                }
            }
        }
        runs
    }

    /// Three thins in a tree of three levels: thin 0, its snapshot 1 written
    /// in clusters and scattered blocks (unmapped in places, grown past the
    /// origin's end), its snapshot 2 with time stamps changed; thin 0 changed
    /// after the snapshots too.
    fn three_thins() -> MemDev {
        let dev = MemDev::new(8192);
        let mut md = ThinPoolMetadata::format(
            Box::new(dev.clone()),
            FormatOptions {
                data_block_size: 128,
                nr_data_blocks: 1 << 20,
                cache_blocks: 1024,
            },
        )
        .expect("format");
        md.create_thin(0).expect("thin");
        let mut x = 7u64;
        let mut rnd = |n: u64| crate::rng::step(&mut x) % n;
        // enough mappings for a tree of three levels (leaves of up to 126, internal nodes of up to 254)
        for v in 0..120_000u64 {
            if rnd(5) != 0 {
                let b = md.alloc_data_block().expect("alloc");
                md.insert(0, v, b).expect("insert");
            }
        }
        md.commit().expect("commit");
        md.create_snap(1, 0).expect("snap");
        md.create_snap(2, 0).expect("snap");
        // the snapshot written in clusters and scattered blocks, unmapped in
        // places, grown past the origin's end; the origin changed too
        for (dev, n) in [(1u64, 300u64), (0, 40)] {
            for _ in 0..n {
                let at = rnd(124_000);
                for v in at..at + 1 + rnd(20) {
                    if rnd(8) == 0 {
                        md.remove(dev, v).expect("remove");
                    } else {
                        let b = md.alloc_data_block().expect("alloc");
                        md.insert(dev, v, b).expect("insert");
                    }
                }
            }
        }
        // the same data block at another time is no change
        for v in 1000..1300 {
            if let Some(m) = md.lookup(2, v).expect("lookup") {
                md.insert_with_time(2, v, m.data_block, m.time + 9)
                    .expect("insert");
            }
        }
        md.commit().expect("commit");
        drop(md);
        dev
    }

    #[test]
    fn changed_runs_are_the_deltas_differences_and_skip_what_a_snapshot_shares() {
        let dev = three_thins();
        let mut tm = crate::pdata::tm::reader(Box::new(dev.clone()), 256);
        for (l, r) in [(0, 1), (1, 0), (0, 0), (1, 2), (0, 2)] {
            let o = DeltaOptions {
                left: Some(Side::Thin(l)),
                right: Some(Side::Thin(r)),
                ..DeltaOptions::default()
            };
            for from in [0, 1, 126, 60_000, 123_999, 130_000] {
                let want = runs_from_delta(&mut tm, &o, from, false);
                let (size, got) = changed_runs(&mut tm, &o, from, usize::MAX).expect("changed");
                assert_eq!(size, 128);
                assert_eq!(got, want, "thins {l} and {r} from {from}");
                if l == r {
                    assert!(got.is_empty());
                }
                let (_, first) = changed_runs(&mut tm, &o, from, 3).expect("changed");
                assert_eq!(first[..], want[..want.len().min(3)], "thins {l} and {r}, 3 runs");
                // page by page, each from the end of the last page's last run
                let mut paged = Vec::new();
                let mut at = from;
                loop {
                    let (_, page) = changed_runs(&mut tm, &o, at, 7).expect("page");
                    let Some(&(b, n)) = page.last() else { break };
                    paged.extend(page);
                    at = b + n;
                }
                assert_eq!(paged, want, "thins {l} and {r} from {from}, in pages of 7 runs");
            }
        }
        // a leaf thins 0 and 2 share, made unreadable: the changes between them
        // are still found (it is not read), while thin_delta's walk reads it
        let o = DeltaOptions {
            left: Some(Side::Thin(0)),
            right: Some(Side::Thin(2)),
            ..DeltaOptions::default()
        };
        let (_, (_, root0), (_, root2)) = sides(&mut tm, &o).expect("roots");
        let (leaves0, _) = btree::leaves(&mut tm, root0, 8, false).expect("leaves");
        let (leaves2, _) = btree::leaves(&mut tm, root2, 8, false).expect("leaves");
        let shared = *leaves0
            .iter()
            .rev()
            .find(|b| leaves2.contains(b))
            .expect("a shared leaf");
        let want = changed_runs(&mut tm, &o, 0, usize::MAX).expect("changed");
        let mut img = dev.image();
        let at = shared as usize * crate::pdata::BLOCK_SIZE;
        img[at..at + 64].fill(0xa5);
        let mut tm = crate::pdata::tm::reader(Box::new(MemDev::from_image(img)), 256);
        assert_eq!(changed_runs(&mut tm, &o, 0, usize::MAX).expect("changed"), want);
        assert!(delta(&mut tm, &o).is_err());
    }

    #[test]
    fn mapped_runs_are_what_a_thin_maps_from_any_block() {
        let dev = three_thins();
        let mut tm = crate::pdata::tm::reader(Box::new(dev), 256);
        for t in 0..3 {
            let o = DeltaOptions {
                left: Some(Side::Thin(t)),
                right: Some(Side::Thin(t)),
                ..DeltaOptions::default()
            };
            for from in [0, 1, 126, 60_000, 123_999, 130_000] {
                let want = runs_from_delta(&mut tm, &o, from, true);
                let (size, got) = mapped_runs(&mut tm, &o, from, usize::MAX).expect("mapped");
                assert_eq!((size, &got), (128, &want), "thin {t} from {from}");
                let (_, first) = mapped_runs(&mut tm, &o, from, 5).expect("mapped");
                assert_eq!(first[..], want[..want.len().min(5)], "thin {t}, 5 runs");
            }
        }
    }
}
