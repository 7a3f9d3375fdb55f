//! The reference counts a metadata space map should hold, found by walking
//! what a superblock reaches, and their comparison with the counts it has:
//! what the era and cache checks share (a node shared by two parents counts
//! two, and is read once).

use super::btree::{self, ValueKind};
use super::error::{BlockKind, PdataError, Result};
use super::sm_disk::{self, SmRoot};
use super::space_map::SmKind;
use super::tm::TransactionManager;
use super::{array, le64};
use std::collections::HashMap;

#[derive(Default)]
pub struct Refs {
    counts: HashMap<u64, u32>,
}

impl Refs {
    /// One more reference to `b`; true the first time.
    pub fn take(&mut self, b: u64) -> bool {
        let c = self.counts.entry(b).or_default();
        *c += 1;
        *c == 1
    }

    /// A reference to the btree at `b` whose leaves hold `vk` (an array's
    /// tree is one whose leaves are [`array::TREE`]).
    pub fn tree(&mut self, tm: &mut TransactionManager, b: u64, vk: ValueKind) -> Result<()> {
        self.tree_at(tm, b, vk, 0)
    }

    fn tree_at(&mut self, tm: &mut TransactionManager, b: u64, vk: ValueKind, depth: usize) -> Result<()> {
        if !self.take(b) {
            return Ok(());
        }
        if depth > 32 {
            return Err(PdataError::Corrupt {
                block: b,
                what: "btree deeper than 32 levels (cycle?)".into(),
            });
        }
        let d = tm.read(b, BlockKind::BtreeNode)?;
        btree::node::check_header(b, d, vk.value_size())?;
        let n = btree::node::nr_entries(d);
        let leaf = btree::node::is_leaf(d);
        let vals: Vec<u64> = match (leaf, vk) {
            (false, _) | (true, ValueKind::BlockRef) => {
                (0..n).map(|i| btree::node::value_u64(d, i)).collect()
            }
            (true, ValueKind::ArrayRoot { offset, .. }) => {
                (0..n).map(|i| le64(btree::node::value(d, i), offset)).collect()
            }
            _ => Vec::new(),
        };
        for v in vals {
            match (leaf, vk) {
                (false, _) => self.tree_at(tm, v, vk, depth + 1)?,
                (true, ValueKind::ArrayRoot { .. }) => self.tree_at(tm, v, array::TREE, 0)?,
                _ => {
                    self.take(v);
                }
            }
        }
        Ok(())
    }
}

/// Compare the metadata space map at `sm_root` with the references found: the
/// superblock (block 0), the space map's own blocks, and whatever `reach`
/// takes. A block with a count and no reference is leaked (returned, in
/// order), one with more references than its count, or with some but not
/// all, is an error (the first ten go to `errs`).
pub fn recount<E: From<PdataError>>(
    tm: &mut TransactionManager,
    sm_root: &SmRoot,
    errs: &mut Vec<String>,
    reach: &mut dyn FnMut(&mut TransactionManager, &mut Refs) -> std::result::Result<(), E>,
) -> std::result::Result<Vec<u64>, E> {
    let sm = sm_disk::load(tm, SmKind::Metadata, sm_root)?;
    let mut r = Refs::default();
    r.take(0);
    r.take(sm.index_root);
    for &b in &sm.bitmap_locs {
        r.take(b);
    }
    r.tree(tm, sm.ref_count_root, ValueKind::Plain(4))?;
    reach(tm, &mut r)?;
    let mut wrong = 0usize;
    let mut leaked = Vec::new();
    for b in 0..sm.nr_blocks() {
        let (want, have) = (r.counts.get(&b).copied().unwrap_or(0), sm.count(b));
        if want > have || (want < have && want > 0) {
            if wrong < 10 {
                errs.push(format!(
                    "metadata block {b}: reference count is {have}, but {want} references were found"
                ));
            }
            wrong += 1;
        } else if want < have {
            leaked.push(b);
        }
    }
    if let Some(b) = r.counts.keys().copied().filter(|&b| b >= sm.nr_blocks()).min() {
        errs.push(format!(
            "metadata block {b} is referenced but beyond the space map's {} blocks",
            sm.nr_blocks()
        ));
    }
    Ok(leaked)
}
