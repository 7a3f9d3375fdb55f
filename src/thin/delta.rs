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

/// Compare the two sides `o` names in the metadata `tm` reads.
/// A missing side is refused before the metadata is read, as 1.x does.
pub fn delta(tm: &mut TransactionManager, o: &DeltaOptions) -> Result<DeltaReport> {
    let given = |n: u8, side: Option<Side>| {
        side.ok_or_else(|| ThinError::Plain(format!("--thin{n} or --root{n} not specified")))
    };
    let sides = [given(1, o.left)?, given(2, o.right)?];
    let (sb, plan) = superblock_and_plan(tm, o.metadata_snap)?;
    let root = |n: u8, side: Side| -> Result<(Side, u64)> {
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
    let (left, lroot) = root(1, sides[0])?;
    let (right, rroot) = root(2, sides[1])?;
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
