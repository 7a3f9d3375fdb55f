//! Removal. Before descending into a child that is at its minimum fill
//! (max_entries / 3), the child is merged with or topped up from a sibling,
//! so removing one entry below can never leave a non-root node under-full.
//! An internal root left with one child is collapsed into its root block.

use super::{node, read_node, shadow, ValueKind, MAX_DEPTH};
use crate::pdata::error::{corrupt, BlockKind, Result};
use crate::pdata::tm::TransactionManager;
use crate::pdata::Block;

const NODE: BlockKind = BlockKind::BtreeNode;

/// Remove `key`. Returns the (possibly new) root and the removed value.
/// The removed value is not decremented: the caller decides.
pub fn remove(
    tm: &mut TransactionManager,
    root: u64,
    key: u64,
    vk: ValueKind,
) -> Result<(u64, Option<Vec<u8>>)> {
    let vs = vk.value_size();
    let root = shadow(tm, root, vk)?;
    let mut b = root;
    let mut removed = None;
    let mut depth = 0;
    loop {
        depth += 1;
        if depth > MAX_DEPTH {
            return Err(corrupt(b, "btree deeper than 32 levels (cycle?)"));
        }
        let d = tm.write(b, NODE)?;
        if node::is_leaf(d) {
            if let Some(i) = node::find(d, key) {
                removed = Some(node::value(d, i).to_vec());
                node::remove_at(d, i);
            }
            break;
        }
        let Some(mut i) = node::lower_bound(d, key) else {
            break;
        };
        let n = node::nr_entries(d);
        let child = node::value_u64(d, i);
        let (cn, cmax) = {
            let cd = read_node(tm, child, vs)?;
            (node::nr_entries(cd), node::max(cd))
        };
        if cn <= cmax / 3 && n >= 2 {
            i = rebalance(tm, b, i, key, vk)?;
        }
        let child = node::value_u64(tm.read(b, NODE)?, i);
        let c = shadow(tm, child, vk)?;
        if c != child {
            node::set_value_u64(tm.write(b, NODE)?, i, c);
        }
        b = c;
    }
    collapse_root(tm, root, vk)?;
    Ok((root, removed))
}

fn copy_of(tm: &mut TransactionManager, b: u64) -> Result<Box<Block>> {
    Ok(Box::new(*tm.read(b, NODE)?))
}

/// Merge child `i` with a sibling, or even out their entries. Returns the
/// slot in `parent` that now covers `key`.
fn rebalance(tm: &mut TransactionManager, parent: u64, i: usize, key: u64, vk: ValueKind) -> Result<usize> {
    let n = node::nr_entries(tm.read(parent, NODE)?);
    let (li, ri) = if i + 1 < n { (i, i + 1) } else { (i - 1, i) };
    let mut kids = [0u64; 2];
    for (j, slot) in [li, ri].into_iter().enumerate() {
        let old = node::value_u64(tm.read(parent, NODE)?, slot);
        let s = shadow(tm, old, vk)?;
        if s != old {
            node::set_value_u64(tm.write(parent, NODE)?, slot, s);
        }
        kids[j] = s;
    }
    let [l, r] = kids;
    let ld = copy_of(tm, l)?;
    let rd = copy_of(tm, r)?;
    let (ln, rn) = (node::nr_entries(&ld), node::nr_entries(&rd));
    if node::flags(&ld) != node::flags(&rd) || node::max(&ld) != node::max(&rd) {
        return Err(corrupt(r, "sibling btree nodes differ in kind"));
    }
    if ln + rn <= node::max(&ld) {
        node::append_from(tm.write(l, NODE)?, &rd, 0, rn);
        node::remove_at(tm.write(parent, NODE)?, ri);
        tm.dec(r)?;
    } else {
        let target = (ln + rn) / 2;
        if ln < target {
            let m = target - ln;
            node::append_from(tm.write(l, NODE)?, &rd, 0, m);
            node::keep_range(tm.write(r, NODE)?, m, rn - m);
        } else if ln > target {
            let m = ln - target;
            node::prepend_from(tm.write(r, NODE)?, &ld, target, m);
            node::set_nr_entries(tm.write(l, NODE)?, target);
        }
        let first = node::key(tm.read(r, NODE)?, 0);
        node::set_key(tm.write(parent, NODE)?, ri, first);
    }
    Ok(node::lower_bound(tm.read(parent, NODE)?, key).unwrap_or(0))
}

/// While the root is internal with a single child, pull the child up into
/// the root block (the root keeps its location).
fn collapse_root(tm: &mut TransactionManager, root: u64, vk: ValueKind) -> Result<()> {
    loop {
        let d = tm.read(root, NODE)?;
        if node::is_leaf(d) || node::nr_entries(d) != 1 {
            return Ok(());
        }
        let child = node::value_u64(d, 0);
        let c = shadow(tm, child, vk)?;
        let cd = copy_of(tm, c)?;
        tm.write(root, NODE)?.copy_from_slice(&cd[..]);
        tm.dec(c)?;
    }
}
