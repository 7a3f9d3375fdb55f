//! Transaction manager: copy-on-write ("shadowing") of metadata blocks over
//! the block cache and the two space maps.
//!
//! A block may be modified in place only if this transaction created it and
//! nothing else references it (count 1). Anything else is copied to a block
//! that was free at the last commit; the caller then repoints its parent.

use super::btree::ValueKind;
use super::cache::{BlockCache, FastMap};
use super::error::{corrupt, BlockKind, Result};
use super::space_map::{SmKind, SpaceMap};
use super::{btree::node, Block};

pub struct TransactionManager {
    pub cache: BlockCache,
    pub meta: SpaceMap,
    pub data: SpaceMap,
    /// Blocks allocated in this transaction.
    shadows: FastMap<u64, ()>,
}

impl TransactionManager {
    pub fn new(cache: BlockCache, meta: SpaceMap, data: SpaceMap) -> TransactionManager {
        TransactionManager {
            cache,
            meta,
            data,
            shadows: FastMap::default(),
        }
    }

    pub fn read(&mut self, b: u64, kind: BlockKind) -> Result<&Block> {
        self.cache.read(b, kind)
    }

    /// Whether `b` can be changed in place in this transaction.
    pub fn is_writable(&self, b: u64) -> bool {
        self.shadows.contains_key(&b) && self.meta.count(b) == 1
    }

    /// A block already made writable by `new_block`/`shadow`.
    pub fn write(&mut self, b: u64, kind: BlockKind) -> Result<&mut Block> {
        if !self.is_writable(b) {
            return Err(corrupt(
                b,
                "internal error: write to a block not shadowed in this transaction",
            ));
        }
        self.cache.write(b, kind)
    }

    /// Allocate a zeroed metadata block with count 1.
    pub fn new_block(&mut self, kind: BlockKind) -> Result<u64> {
        let b = self.meta.alloc()?;
        self.cache.write_new(b, kind)?;
        self.shadows.insert(b, ());
        Ok(b)
    }

    pub fn inc(&mut self, b: u64) -> Result<()> {
        self.meta.inc(b)
    }

    /// Decrement a metadata block; at 0 it is freed (and never written).
    pub fn dec(&mut self, b: u64) -> Result<u32> {
        let c = self.meta.dec(b)?;
        if c == 0 && self.shadows.remove(&b).is_some() {
            self.cache.forget_dirty(b);
        }
        Ok(c)
    }

    /// Give a non-btree block (bitmap, index block) a writable location; its
    /// contents will be rewritten entirely. `old` 0 means "none yet".
    pub fn relocate(&mut self, old: u64, kind: BlockKind) -> Result<u64> {
        if old != 0 && self.is_writable(old) {
            return Ok(old);
        }
        let b = self.new_block(kind)?;
        if old != 0 {
            self.dec(old)?;
        }
        Ok(b)
    }

    /// Make btree node `b` writable, copying it if needed. Returns the block to
    /// use from now on. When the copied node was shared, each of its children
    /// gains a parent, so their counts go up (the kernel's lazy increment).
    pub fn shadow(&mut self, b: u64, vk: ValueKind) -> Result<u64> {
        if self.is_writable(b) {
            return Ok(b);
        }
        let count = self.meta.count(b);
        if count == 0 {
            return Err(corrupt(b, "btree node is referenced but has count 0"));
        }
        let copy: Box<Block> = Box::new(*self.cache.read(b, BlockKind::BtreeNode)?);
        node::check_header(b, &copy, vk.value_size())?;
        let n = self.meta.alloc()?;
        self.cache.put(n, BlockKind::BtreeNode, &copy)?;
        self.shadows.insert(n, ());
        if count > 1 {
            self.inc_children(&copy, vk)?;
        }
        self.dec(b)?;
        Ok(n)
    }

    /// +1 on everything a node points to.
    pub fn inc_children(&mut self, d: &Block, vk: ValueKind) -> Result<()> {
        let nr = node::nr_entries(d);
        if !node::is_leaf(d) {
            for i in 0..nr {
                self.meta.inc(node::value_u64(d, i))?;
            }
            return Ok(());
        }
        match vk {
            ValueKind::Plain(_) => {}
            ValueKind::DataRef { shift } => {
                for i in 0..nr {
                    self.data.inc(node::value_u64(d, i) >> shift)?;
                }
            }
            ValueKind::Subtree { .. } => {
                for i in 0..nr {
                    self.meta.inc(node::value_u64(d, i))?;
                }
            }
        }
        Ok(())
    }

    /// Start a new transaction after a durable commit.
    pub fn transaction_committed(&mut self) {
        self.shadows.clear();
        self.meta.transaction_committed();
        self.data.transaction_committed();
    }

    /// Forget everything not committed (the caller reopens the space maps).
    pub fn abort(&mut self) {
        self.shadows.clear();
        self.cache.clear();
    }

    pub fn sm(&mut self, kind: SmKind) -> &mut SpaceMap {
        match kind {
            SmKind::Metadata => &mut self.meta,
            SmKind::Data => &mut self.data,
        }
    }
}
