//! thin_rmap: which thin blocks map a range of data blocks.

use super::dump::superblock_and_plan;
use super::superblock::unpack_block_time;
use super::Result;
use crate::pdata::btree;
use crate::pdata::tm::TransactionManager;

/// A range of data blocks, `BEGIN..END` (END excluded).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub begin: u64,
    pub end: u64,
}

impl std::str::FromStr for Region {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Region, String> {
        let mut it = s.split("..");
        let mut num = || -> std::result::Result<u64, String> {
            it.next()
                .ok_or_else(|| "badly formed region".to_string())?
                .parse::<u64>()
                .map_err(|e| e.to_string())
        };
        let (begin, end) = (num()?, num()?);
        if s.matches("..").count() != 1 {
            return Err("badly formed region".into());
        }
        if end <= begin {
            return Err("end <= begin".into());
        }
        Ok(Region { begin, end })
    }
}

/// Data blocks `data_begin..data_end`, mapped by device `thin_dev` from its
/// block `thin_begin` on. Ordered as thin_rmap prints them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct RmapRun {
    pub data_begin: u64,
    pub data_end: u64,
    pub thin_dev: u64,
    pub thin_begin: u64,
}

/// thin_rmap's line for a run (no newline).
impl std::fmt::Display for RmapRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = self.data_end - self.data_begin;
        write!(
            f,
            "data {}..{} -> thin({}) {}..{}",
            self.data_begin,
            self.data_end,
            self.thin_dev,
            self.thin_begin,
            self.thin_begin + len
        )
    }
}

/// Every mapping of the tree at `root`: (virtual block, data block, time).
fn mappings(tm: &mut TransactionManager, root: u64) -> Result<Vec<(u64, u64, u32)>> {
    let mut v = Vec::new();
    btree::walk(tm, root, 8, &mut |k, val| {
        let (b, t) = unpack_block_time(crate::pdata::le64(val, 0));
        v.push((k, b, t));
        Ok(())
    })?;
    Ok(v)
}

/// The runs of the live metadata's mappings into `regions`, data- and
/// thin-contiguous runs of one device merged, ascending.
pub fn rmap(tm: &mut TransactionManager, regions: &[Region]) -> Result<Vec<RmapRun>> {
    let (_, plan) = superblock_and_plan(tm, false)?;
    let inside = |b: u64| regions.iter().any(|r| b >= r.begin && b < r.end);
    let mut runs = Vec::new();
    let run = |d0: u64, v0: u64, len: u64, dev: u64| RmapRun {
        data_begin: d0,
        data_end: d0 + len,
        thin_dev: dev,
        thin_begin: v0,
    };
    for (dev, _, root) in &plan.devices {
        let mut cur: Option<(u64, u64, u64)> = None; // data, thin, len
        for (v, b, _) in mappings(tm, *root)? {
            if !inside(b) {
                continue;
            }
            match &mut cur {
                Some((d0, v0, len)) if *d0 + *len == b && *v0 + *len == v => *len += 1,
                _ => {
                    if let Some((d0, v0, len)) = cur.take() {
                        runs.push(run(d0, v0, len, *dev));
                    }
                    cur = Some((b, v, 1));
                }
            }
        }
        if let Some((d0, v0, len)) = cur {
            runs.push(run(d0, v0, len, *dev));
        }
    }
    runs.sort_unstable();
    Ok(runs)
}
