//! Building btrees bottom-up from sorted entries (restore, repair), with leaves
//! that other trees share taken in by reference.
//!
//! Leaves are packed full; the tail is balanced so that no node but a lone root is
//! under a third full (the checkers' rule). A shared leaf is used as it is when it
//! is full enough; otherwise its entries are copied in. Each new leaf takes a
//! reference on every data block its values name; a shared leaf taken in takes one
//! reference on the leaf.

use super::node;
use super::ValueKind;
use crate::pdata::error::{BlockKind, Result};
use crate::pdata::tm::TransactionManager;

/// A written node: its first key, block and number of entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRef {
    pub key: u64,
    pub block: u64,
    pub entries: usize,
}

/// Builds one tree of u64 values.
pub struct Builder {
    vk: ValueKind,
    /// Building internal nodes (values are child blocks, no references taken).
    internal: bool,
    max: usize,
    pending: Vec<(u64, u64)>,
    nodes: Vec<NodeRef>,
    /// Whether each of `nodes` was taken in shared (not written here).
    shared: Vec<bool>,
}

impl Builder {
    pub fn new(vk: ValueKind) -> Builder {
        Builder {
            vk,
            internal: false,
            max: node::max_entries(vk.value_size()),
            pending: Vec::new(),
            nodes: Vec::new(),
            shared: Vec::new(),
        }
    }

    fn min(&self) -> usize {
        self.max / 3
    }

    /// The next entry (keys ascending: the caller checks).
    pub fn push(&mut self, tm: &mut TransactionManager, key: u64, value: u64) -> Result<()> {
        if self.pending.len() >= 2 * self.max {
            let rest = self.pending.split_off(self.max);
            let first = std::mem::replace(&mut self.pending, rest);
            self.write(tm, &first)?;
        }
        self.pending.push((key, value));
        Ok(())
    }

    /// Leaves another tree holds, in key order after everything pushed so far.
    pub fn push_shared(&mut self, tm: &mut TransactionManager, leaves: &[NodeRef]) -> Result<()> {
        for l in leaves {
            let too_few_before = !self.pending.is_empty() && self.pending.len() < self.min();
            if l.entries < self.min() || too_few_before {
                // copy it in: the entries join ours
                let entries = self.read_entries(tm, l.block)?;
                for (k, v) in entries {
                    self.take_value_ref(tm, v)?;
                    self.push(tm, k, v)?;
                }
                continue;
            }
            self.flush(tm)?;
            tm.inc(l.block)?;
            self.nodes.push(*l);
            self.shared.push(true);
        }
        Ok(())
    }

    fn read_entries(&self, tm: &mut TransactionManager, b: u64) -> Result<Vec<(u64, u64)>> {
        let d = tm.read(b, BlockKind::BtreeNode)?;
        let value = |i: usize| {
            let mut v = [0u8; 8];
            let src = node::value(d, i);
            v[..src.len().min(8)].copy_from_slice(&src[..src.len().min(8)]);
            u64::from_le_bytes(v)
        };
        Ok((0..node::nr_entries(d))
            .map(|i| (node::key(d, i), value(i)))
            .collect())
    }

    fn take_value_ref(&self, tm: &mut TransactionManager, v: u64) -> Result<()> {
        if let (ValueKind::DataRef { shift }, false) = (self.vk, self.internal) {
            tm.data.inc(v >> shift)?;
        }
        Ok(())
    }

    /// Write one node of `entries` (their value references are already held).
    fn write(&mut self, tm: &mut TransactionManager, entries: &[(u64, u64)]) -> Result<()> {
        let b = tm.new_block(BlockKind::BtreeNode)?;
        let d = tm.write(b, BlockKind::BtreeNode)?;
        let flags = if self.internal { node::INTERNAL } else { node::LEAF };
        let vs = if self.internal { 8 } else { self.vk.value_size() };
        node::init(d, flags, vs);
        for (i, (k, v)) in entries.iter().enumerate() {
            node::set_key(d, i, *k);
            node::set_value(d, i, &v.to_le_bytes()[..vs]);
        }
        node::set_nr_entries(d, entries.len());
        self.nodes.push(NodeRef {
            key: entries.first().map_or(0, |e| e.0),
            block: b,
            entries: entries.len(),
        });
        self.shared.push(false);
        Ok(())
    }

    /// Write what is pending, balanced: a short tail borrows from the node before.
    fn flush(&mut self, tm: &mut TransactionManager) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if self.pending.len() < self.min() {
            if let (Some(prev), Some(shared)) = (self.nodes.pop(), self.shared.pop()) {
                let mut entries = self.read_entries(tm, prev.block)?;
                if shared {
                    for (_, v) in &entries {
                        self.take_value_ref(tm, *v)?;
                    }
                    tm.dec(prev.block)?;
                } else {
                    // our own node: its entries keep their references, the block goes
                    tm.dec(prev.block)?;
                }
                entries.append(&mut self.pending);
                self.pending = entries;
            }
        }
        let all = std::mem::take(&mut self.pending);
        if all.len() > self.max {
            let half = all.len() / 2;
            self.write(tm, &all[..half])?;
            self.write(tm, &all[half..])?;
        } else {
            self.write(tm, &all)?;
        }
        Ok(())
    }

    /// The written nodes of this level (leaves), after the tail is written.
    pub fn finish_level(mut self, tm: &mut TransactionManager) -> Result<Vec<NodeRef>> {
        self.flush(tm)?;
        Ok(self.nodes)
    }

    /// The root of the whole tree (an empty leaf if nothing was pushed).
    pub fn finish(mut self, tm: &mut TransactionManager) -> Result<u64> {
        self.flush(tm)?;
        if self.nodes.is_empty() {
            self.write(tm, &[])?;
        }
        let mut level = self.nodes;
        while level.len() > 1 {
            let mut up = Builder::new(ValueKind::Plain(8));
            up.internal = true;
            up.max = node::max_entries(8);
            for n in &level {
                up.push(tm, n.key, n.block)?;
            }
            up.flush(tm)?;
            level = up.nodes;
        }
        Ok(level[0].block)
    }
}

/// Write `entries` as shareable leaves (a `<def>`); each leaf holds one reference
/// on its data blocks and one on itself, which the caller drops when done.
pub fn leaves(
    tm: &mut TransactionManager,
    vk: ValueKind,
    entries: impl Iterator<Item = (u64, u64)>,
) -> Result<Vec<NodeRef>> {
    let mut b = Builder::new(vk);
    for (k, v) in entries {
        b.take_value_ref(tm, v)?;
        b.push(tm, k, v)?;
    }
    b.finish_level(tm)
}

/// Write a tree of `entries`, taking a reference on each value's data block.
pub fn build(
    tm: &mut TransactionManager,
    vk: ValueKind,
    entries: impl Iterator<Item = (u64, u64)>,
) -> Result<u64> {
    let mut b = Builder::new(vk);
    for (k, v) in entries {
        b.take_value_ref(tm, v)?;
        b.push(tm, k, v)?;
    }
    b.finish(tm)
}

impl Builder {
    /// Push an entry of our own, taking its value's reference.
    pub fn push_own(&mut self, tm: &mut TransactionManager, key: u64, value: u64) -> Result<()> {
        self.take_value_ref(tm, value)?;
        self.push(tm, key, value)
    }
}
