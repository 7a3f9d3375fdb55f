//! Copy-on-write btrees in the kernel's format (dm-btree): lookup, insert,
//! remove, range walks and subtree deletion.
//!
//! Inserts split full nodes top-down; removes top up thin children top-down
//! (merge or redistribute with a sibling), so every non-root node stays at
//! least a third full, which thin_check requires.

pub mod build;
pub mod node;
mod remove;

pub use remove::remove;

use super::error::{corrupt, BlockKind, Result};
use super::tm::TransactionManager;
use super::Block;

/// What a tree's leaf values refer to, for reference counting when a shared
/// node is copied or a subtree is deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueKind {
    /// Opaque values of the given size.
    Plain(usize),
    /// u64 values whose `value >> shift` is a data block (dm-thin block_time).
    DataRef { shift: u32 },
    /// u64 values that are roots of DataRef subtrees (dm-thin top level).
    Subtree { leaf_shift: u32 },
    /// u64 values that are metadata blocks holding no references themselves
    /// (the array blocks beneath a dm-array's btree).
    BlockRef,
    /// Values of `size` bytes holding, at byte `offset`, the root of a dm-array
    /// (a BlockRef tree): dm-era's writeset tree, whose values are bitsets.
    ArrayRoot { size: usize, offset: usize },
}

impl ValueKind {
    pub fn value_size(self) -> usize {
        match self {
            ValueKind::Plain(n) | ValueKind::ArrayRoot { size: n, .. } => n,
            _ => 8,
        }
    }
}

/// Guards walks against cycles in damaged metadata.
const MAX_DEPTH: usize = 32;

/// An empty tree: a single leaf.
pub fn create(tm: &mut TransactionManager, vk: ValueKind) -> Result<u64> {
    let b = tm.new_block(BlockKind::BtreeNode)?;
    node::init(tm.write(b, BlockKind::BtreeNode)?, node::LEAF, vk.value_size());
    Ok(b)
}

/// Make node `b` writable, copying it if needed; returns the block to use from
/// now on. When the copied node was shared, each of its children gains a
/// parent, so their counts go up (the kernel's lazy increment).
pub fn shadow(tm: &mut TransactionManager, b: u64, vk: ValueKind) -> Result<u64> {
    if !tm.is_writable(b) && tm.meta.count(b) == 0 {
        return Err(corrupt(b, "btree node is referenced but has count 0"));
    }
    tm.shadow_with(
        b,
        BlockKind::BtreeNode,
        |d| node::check_header(b, d, vk.value_size()),
        |tm, d| inc_children(tm, d, vk),
    )
}

/// +1 on everything a node points to.
pub fn inc_children(tm: &mut TransactionManager, d: &Block, vk: ValueKind) -> Result<()> {
    let nr = node::nr_entries(d);
    if !node::is_leaf(d) {
        for i in 0..nr {
            tm.meta.inc(node::value_u64(d, i))?;
        }
        return Ok(());
    }
    match vk {
        ValueKind::Plain(_) => {}
        ValueKind::DataRef { shift } => {
            for i in 0..nr {
                tm.data.inc(node::value_u64(d, i) >> shift)?;
            }
        }
        ValueKind::Subtree { .. } | ValueKind::BlockRef => {
            for i in 0..nr {
                tm.meta.inc(node::value_u64(d, i))?;
            }
        }
        ValueKind::ArrayRoot { offset, .. } => {
            for i in 0..nr {
                tm.meta.inc(array_root_of(d, i, offset))?;
            }
        }
    }
    Ok(())
}

/// The array root a leaf's value `i` holds at byte `offset` (ArrayRoot values).
fn array_root_of(d: &Block, i: usize, offset: usize) -> u64 {
    crate::pdata::le64(node::value(d, i), offset)
}

fn read_node(tm: &mut TransactionManager, b: u64, leaf_vs: usize) -> Result<&Block> {
    let d = tm.read(b, BlockKind::BtreeNode)?;
    node::check_header(b, d, leaf_vs)?;
    Ok(d)
}

/// The leaves of a tree in key order, found by reading its internal nodes only
/// (the height comes from the leftmost path; leaves are not read). `tolerant`
/// skips subtrees that cannot be read (salvage) instead of failing; the number
/// skipped is returned beside the leaves.
pub fn leaves(
    tm: &mut TransactionManager,
    root: u64,
    leaf_vs: usize,
    tolerant: bool,
) -> Result<(Vec<u64>, u64)> {
    let mut height = 0;
    let mut b = root;
    loop {
        let d = match read_node(tm, b, leaf_vs) {
            Ok(d) => d,
            Err(_) if tolerant => return Ok((Vec::new(), 1)),
            Err(e) => return Err(e),
        };
        if node::is_leaf(d) {
            break;
        }
        if height >= MAX_DEPTH || node::nr_entries(d) == 0 {
            return match tolerant {
                true => Ok((Vec::new(), 1)),
                false => Err(corrupt(b, "btree internal node without a leaf below it")),
            };
        }
        b = node::value_u64(d, 0);
        height += 1;
    }
    let mut out = Vec::new();
    let mut budget = Visits::new(tm, root);
    leaves_rec(tm, root, leaf_vs, tolerant, height, &mut out, &mut budget)?;
    Ok((out, budget.skipped))
}

fn leaves_rec(
    tm: &mut TransactionManager,
    b: u64,
    leaf_vs: usize,
    tolerant: bool,
    height: usize,
    out: &mut Vec<u64>,
    budget: &mut Visits,
) -> Result<()> {
    budget.take()?;
    if height == 0 {
        out.push(b);
        return Ok(());
    }
    let kids = match read_node(tm, b, leaf_vs) {
        Ok(d) if !node::is_leaf(d) => (0..node::nr_entries(d))
            .map(|i| node::value_u64(d, i))
            .collect::<Vec<_>>(),
        Ok(_) if tolerant => {
            budget.skipped += 1;
            return Ok(());
        }
        Ok(_) => return Err(corrupt(b, "btree leaves at different depths")),
        Err(_) if tolerant => {
            budget.skipped += 1;
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    if height == 1 {
        for c in kids {
            budget.take()?;
            out.push(c);
        }
        return Ok(());
    }
    for c in kids {
        leaves_rec(tm, c, leaf_vs, tolerant, height - 1, out, budget)?;
    }
    Ok(())
}

/// Look up `key`; `f` converts the value while the node is borrowed.
pub fn lookup_with<T>(
    tm: &mut TransactionManager,
    root: u64,
    key: u64,
    leaf_vs: usize,
    f: impl FnOnce(&[u8]) -> T,
) -> Result<Option<T>> {
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let d = read_node(tm, b, leaf_vs)?;
        if node::is_leaf(d) {
            return Ok(node::find(d, key).map(|i| f(node::value(d, i))));
        }
        match node::lower_bound(d, key) {
            None => return Ok(None),
            Some(i) => b = node::value_u64(d, i),
        }
    }
    Err(corrupt(b, "btree deeper than 32 levels (cycle?)"))
}

pub fn lookup_u64(tm: &mut TransactionManager, root: u64, key: u64) -> Result<Option<u64>> {
    lookup_with(tm, root, key, 8, |v| {
        let mut a = [0u8; 8];
        a.copy_from_slice(v);
        u64::from_le_bytes(a)
    })
}

/// Split the full root in place: its entries go to two new children.
fn split_beneath(tm: &mut TransactionManager, root: u64) -> Result<()> {
    let old: Box<Block> = Box::new(*tm.read(root, BlockKind::BtreeNode)?);
    let n = node::nr_entries(&old);
    let half = n / 2;
    let mut kids = [0u64; 2];
    for (j, (from, count)) in [(0, half), (half, n - half)].into_iter().enumerate() {
        let c = tm.new_block(BlockKind::BtreeNode)?;
        let d = tm.write(c, BlockKind::BtreeNode)?;
        d.copy_from_slice(&old[..]);
        node::keep_range(d, from, count);
        kids[j] = c;
    }
    let d = tm.write(root, BlockKind::BtreeNode)?;
    node::init(d, node::INTERNAL, 8);
    node::insert_at(d, 0, node::key(&old, 0), &kids[0].to_le_bytes());
    node::insert_at(d, 1, node::key(&old, half), &kids[1].to_le_bytes());
    Ok(())
}

/// Split full child at parent slot `i` into two; returns the new right sibling.
fn split_child(tm: &mut TransactionManager, parent: u64, i: usize, child: u64) -> Result<u64> {
    let old: Box<Block> = Box::new(*tm.read(child, BlockKind::BtreeNode)?);
    let n = node::nr_entries(&old);
    let half = n / 2;
    let right = tm.new_block(BlockKind::BtreeNode)?;
    let d = tm.write(right, BlockKind::BtreeNode)?;
    d.copy_from_slice(&old[..]);
    node::keep_range(d, half, n - half);
    node::set_nr_entries(tm.write(child, BlockKind::BtreeNode)?, half);
    let p = tm.write(parent, BlockKind::BtreeNode)?;
    node::insert_at(p, i + 1, node::key(&old, half), &right.to_le_bytes());
    Ok(right)
}

/// Insert or overwrite `key`. Returns the (possibly new) root and the old
/// value, if any. Old values are not decremented: the caller decides.
pub fn insert(
    tm: &mut TransactionManager,
    root: u64,
    key: u64,
    value: &[u8],
    vk: ValueKind,
) -> Result<(u64, Option<Vec<u8>>)> {
    let vs = vk.value_size();
    let root = shadow(tm, root, vk)?;
    {
        let d = read_node(tm, root, vs)?;
        if node::nr_entries(d) == node::max(d) {
            split_beneath(tm, root)?;
        }
    }
    let mut b = root;
    for _ in 0..MAX_DEPTH {
        let d = tm.write(b, BlockKind::BtreeNode)?;
        if node::is_leaf(d) {
            let pos = node::lower_bound(d, key);
            if let Some(i) = pos.filter(|&i| node::key(d, i) == key) {
                let old = node::value(d, i).to_vec();
                node::set_value(d, i, value);
                return Ok((root, Some(old)));
            }
            node::insert_at(d, pos.map_or(0, |i| i + 1), key, value);
            return Ok((root, None));
        }
        let i = match node::lower_bound(d, key) {
            Some(i) => i,
            None => {
                // below every key: the leftmost subtree takes it
                node::set_key(d, 0, key);
                0
            }
        };
        let child = node::value_u64(d, i);
        let c = shadow(tm, child, vk)?;
        if c != child {
            node::set_value_u64(tm.write(b, BlockKind::BtreeNode)?, i, c);
        }
        let full = {
            let cd = read_node(tm, c, vs)?;
            node::nr_entries(cd) == node::max(cd)
        };
        b = if full {
            let right = split_child(tm, b, i, c)?;
            let rk = node::key(tm.read(right, BlockKind::BtreeNode)?, 0);
            if key >= rk {
                right
            } else {
                c
            }
        } else {
            c
        };
    }
    Err(corrupt(b, "btree deeper than 32 levels (cycle?)"))
}

/// Visit every (key, value) with lo <= key < hi in key order.
pub fn walk_range(
    tm: &mut TransactionManager,
    root: u64,
    leaf_vs: usize,
    lo: u64,
    hi: u64,
    f: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut budget = Visits::new(tm, root);
    walk_rec(tm, root, leaf_vs, (lo, hi), f, 0, &mut budget)
}

/// Visit every (key, value) in key order.
pub fn walk(
    tm: &mut TransactionManager,
    root: u64,
    leaf_vs: usize,
    f: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
) -> Result<()> {
    walk_range(tm, root, leaf_vs, 0, u64::MAX, f)
}

/// Nodes one walk of one tree may visit. In a sound tree every node has one
/// parent, so a walk reaches no more nodes than the device has blocks; a node
/// that lies (children pointing back up or at one shared subtree many times
/// over) could otherwise make a walk take exponential time and memory.
struct Visits {
    root: u64,
    left: u64,
    nr_blocks: u64,
    /// Subtrees a tolerant `leaves` could not read.
    skipped: u64,
}

impl Visits {
    fn new(tm: &TransactionManager, root: u64) -> Visits {
        let nr_blocks = tm.cache.nr_blocks();
        Visits {
            root,
            left: nr_blocks,
            nr_blocks,
            skipped: 0,
        }
    }
    fn take(&mut self) -> Result<()> {
        self.left = self.left.checked_sub(1).ok_or_else(|| {
            corrupt(
                self.root,
                format!(
                    "btree reaches more nodes than the metadata device has blocks ({}): a node is reached twice",
                    self.nr_blocks
                ),
            )
        })?;
        Ok(())
    }
}

fn walk_rec(
    tm: &mut TransactionManager,
    b: u64,
    leaf_vs: usize,
    (lo, hi): (u64, u64),
    f: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    depth: usize,
    budget: &mut Visits,
) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(corrupt(b, "btree deeper than 32 levels (cycle?)"));
    }
    budget.take()?;
    let d = read_node(tm, b, leaf_vs)?;
    let n = node::nr_entries(d);
    if node::is_leaf(d) {
        for i in 0..n {
            let k = node::key(d, i);
            if k >= lo && k < hi {
                f(k, node::value(d, i))?;
            }
        }
        return Ok(());
    }
    // child i covers [key[i], key[i+1])
    let kids: Vec<u64> = (0..n)
        .filter(|&i| {
            let start = if i == 0 { 0 } else { node::key(d, i) };
            let end = if i + 1 < n { node::key(d, i + 1) } else { u64::MAX };
            start < hi && end > lo
        })
        .map(|i| node::value_u64(d, i))
        .collect();
    for c in kids {
        walk_rec(tm, c, leaf_vs, (lo, hi), f, depth + 1, budget)?;
    }
    Ok(())
}

/// What is left to compare on one side of [`diff_u64`], the next last.
#[derive(Clone, Copy)]
enum Next {
    /// A node not read yet: its block, the least key its parent gives it, its depth.
    Node { block: u64, lo: u64, depth: usize },
    /// A leaf's entry: key and value.
    Entry(u64, u64),
}

impl Next {
    fn lo(self) -> u64 {
        match self {
            Next::Node { lo, .. } => lo,
            Next::Entry(k, _) => k,
        }
    }
}

/// The keys two trees of u64 values (`lroot`, `rroot`; None: an empty tree)
/// map differently, in key order from `from`: `f(key, left, right)` for a key
/// mapped on one side only or to different values; `f` returns false to stop.
/// A subtree both trees hold (the same block) is passed over unread, so
/// comparing a snapshot with its origin reads the nodes that differ and the
/// ones above them, not the trees; against an empty tree it is the other's
/// entries from `from`. Damaged metadata fails (an unreadable node, depth, a
/// node reached more often than the two trees could hold) or gives a wrong
/// answer, never a hang.
pub fn diff_u64(
    tm: &mut TransactionManager,
    (lroot, rroot): (Option<u64>, Option<u64>),
    from: u64,
    f: &mut dyn FnMut(u64, Option<u64>, Option<u64>) -> bool,
) -> Result<()> {
    let mut budget = Visits::new(tm, lroot.or(rroot).unwrap_or(0));
    budget.left = budget.left.saturating_mul(2);
    let start = |root: Option<u64>| {
        root.map(|block| Next::Node {
            block,
            lo: 0,
            depth: 0,
        })
        .into_iter()
        .collect::<Vec<_>>()
    };
    let mut sides = [start(lroot), start(rroot)];
    // where the node on top of a side ends: the least key of what is under it
    let hi = |s: &[Next]| s.len().checked_sub(2).map_or(u64::MAX, |i| s[i].lo());
    loop {
        let (l, r) = (sides[0].last().copied(), sides[1].last().copied());
        let act = match (l, r) {
            (None, None) => return Ok(()),
            (Some(Next::Node { block: a, .. }), Some(Next::Node { block: b, .. })) if a == b => {
                sides[0].pop();
                sides[1].pop();
                continue;
            }
            // two nodes over the same keys (the trees' shapes agree there, as a
            // snapshot's and its origin's do): both read; two leaves are
            // compared in place rather than entry by entry through the stacks
            (
                Some(Next::Node { block: a, lo, depth }),
                Some(Next::Node {
                    block: b,
                    lo: lo_b,
                    depth: depth_b,
                }),
            ) if lo == lo_b && hi(&sides[0]) == hi(&sides[1]) => {
                sides[0].pop();
                sides[1].pop();
                let left: Block = *read_diffed(tm, a, depth, &mut budget)?;
                let right = read_diffed(tm, b, depth_b, &mut budget)?;
                if node::is_leaf(&left) && node::is_leaf(right) {
                    if !diff_leaves(&left, right, from, f) {
                        return Ok(());
                    }
                } else {
                    expand(&mut sides[1], right, lo, depth_b, from);
                    expand(&mut sides[0], &left, lo, depth, from);
                }
                continue;
            }
            (Some(Next::Entry(ka, va)), Some(Next::Entry(kb, vb))) if ka == kb => {
                sides[0].pop();
                sides[1].pop();
                if va != vb && !f(ka, Some(va), Some(vb)) {
                    return Ok(());
                }
                continue;
            }
            (Some(_), None) => 0,
            (None, Some(_)) => 1,
            // the side whose next key is least; on a tie, a node is read first
            (Some(a), Some(b)) => match a.lo().cmp(&b.lo()) {
                std::cmp::Ordering::Less => 0,
                std::cmp::Ordering::Greater => 1,
                std::cmp::Ordering::Equal => usize::from(!matches!(a, Next::Node { .. })),
            },
        };
        match sides[act].pop() {
            Some(Next::Entry(k, v)) => {
                let (left, right) = if act == 0 {
                    (Some(v), None)
                } else {
                    (None, Some(v))
                };
                if !f(k, left, right) {
                    return Ok(());
                }
            }
            Some(Next::Node { block, lo, depth }) => {
                let d = read_diffed(tm, block, depth, &mut budget)?;
                expand(&mut sides[act], d, lo, depth, from);
            }
            None => {}
        }
    }
}

/// A node [`diff_u64`] reaches at `depth`, counted against its budget.
fn read_diffed<'a>(
    tm: &'a mut TransactionManager,
    block: u64,
    depth: usize,
    budget: &mut Visits,
) -> Result<&'a Block> {
    if depth >= MAX_DEPTH {
        return Err(corrupt(block, "btree deeper than 32 levels (cycle?)"));
    }
    budget.take()?;
    read_node(tm, block, 8)
}

/// What node `d` (its least key `lo`) holds from `from`, onto a side of
/// [`diff_u64`]: a leaf's entries or an internal node's children, the least last.
fn expand(side: &mut Vec<Next>, d: &Block, lo: u64, depth: usize, from: u64) {
    let n = node::nr_entries(d);
    if node::is_leaf(d) {
        let keep = (0..n).rev().map(|i| (node::key(d, i), node::value_u64(d, i)));
        side.extend(keep.filter(|&(k, _)| k >= from).map(|(k, v)| Next::Entry(k, v)));
        return;
    }
    // child i holds keys from key[i] up to key[i + 1]
    for i in (0..n).rev() {
        if i + 1 < n && node::key(d, i + 1) <= from {
            break;
        }
        side.push(Next::Node {
            block: node::value_u64(d, i),
            lo: if i == 0 { lo } else { node::key(d, i) },
            depth: depth + 1,
        });
    }
}

/// [`diff_u64`]'s `f` for two leaves over the same keys, from `from`, in key
/// order; false when `f` stopped it.
fn diff_leaves(
    l: &Block,
    r: &Block,
    from: u64,
    f: &mut dyn FnMut(u64, Option<u64>, Option<u64>) -> bool,
) -> bool {
    let (nl, nr) = (node::nr_entries(l), node::nr_entries(r));
    let first = |d: &Block, n: usize| (0..n).find(|&i| node::key(d, i) >= from).unwrap_or(n);
    let (mut i, mut j) = (first(l, nl), first(r, nr));
    while i < nl || j < nr {
        let kl = (i < nl).then(|| node::key(l, i));
        let kr = (j < nr).then(|| node::key(r, j));
        let go = match (kl, kr) {
            (Some(a), Some(b)) if a == b => {
                let (va, vb) = (node::value_u64(l, i), node::value_u64(r, j));
                i += 1;
                j += 1;
                va == vb || f(a, Some(va), Some(vb))
            }
            (Some(a), b) if b.is_none_or(|b| a < b) => {
                i += 1;
                f(a, Some(node::value_u64(l, i - 1)), None)
            }
            (_, Some(b)) => {
                j += 1;
                f(b, None, Some(node::value_u64(r, j - 1)))
            }
            _ => true, // both ended: the loop stops first
        };
        if !go {
            return false;
        }
    }
    true
}

/// Drop one reference to the tree at `root`; if it was the last, free its
/// nodes and release what its leaves refer to.
pub fn del_tree(tm: &mut TransactionManager, root: u64, vk: ValueKind) -> Result<()> {
    del_rec(tm, root, vk, 0)
}

fn del_rec(tm: &mut TransactionManager, b: u64, vk: ValueKind, depth: usize) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(corrupt(b, "btree deeper than 32 levels (cycle?)"));
    }
    if tm.meta.count(b) > 1 {
        tm.dec(b)?;
        return Ok(());
    }
    let d = read_node(tm, b, vk.value_size())?;
    let n = node::nr_entries(d);
    let leaf = node::is_leaf(d);
    let vals: Vec<u64> = match (leaf, vk) {
        (true, ValueKind::Plain(_)) => Vec::new(),
        (true, ValueKind::ArrayRoot { offset, .. }) => (0..n).map(|i| array_root_of(d, i, offset)).collect(),
        _ => (0..n).map(|i| node::value_u64(d, i)).collect(),
    };
    for v in vals {
        match (leaf, vk) {
            (false, _) => del_rec(tm, v, vk, depth + 1)?,
            (true, ValueKind::DataRef { shift }) => {
                tm.data.dec(v >> shift)?;
            }
            (true, ValueKind::Subtree { leaf_shift }) => {
                del_rec(tm, v, ValueKind::DataRef { shift: leaf_shift }, 0)?
            }
            (true, ValueKind::BlockRef) => {
                tm.dec(v)?;
            }
            (true, ValueKind::ArrayRoot { .. }) => del_rec(tm, v, ValueKind::BlockRef, 0)?,
            (true, ValueKind::Plain(_)) => {}
        }
    }
    tm.dec(b)?;
    Ok(())
}
