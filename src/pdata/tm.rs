//! Transaction manager: copy-on-write ("shadowing") of metadata blocks over
//! the block cache and the two space maps. Knows no block's layout: the
//! btree shadows its nodes through `shadow_with`.
//!
//! A block may be modified in place only if this transaction created it and
//! nothing else references it (count 1). Anything else is copied to a block
//! that was free at the last commit; the caller then repoints its parent.

use super::cache::{BlockCache, FastMap};
use super::error::{corrupt, BlockKind, Result};
use super::space_map::{SmKind, SpaceMap};
use super::Block;

pub struct TransactionManager {
    pub cache: BlockCache,
    pub meta: SpaceMap,
    pub data: SpaceMap,
    /// Blocks allocated in this transaction.
    shadows: FastMap<u64, ()>,
}

/// A transaction manager for reading only (empty space maps), caching
/// `cache_blocks` blocks: what the tools read metadata with.
pub fn reader(dev: Box<dyn super::MetadataDev>, cache_blocks: usize) -> TransactionManager {
    TransactionManager::unloaded(BlockCache::new(dev, cache_blocks))
}

impl TransactionManager {
    /// Over `cache`, with empty space maps: a reader's, or one whose maps its
    /// superblock gives next.
    pub fn unloaded(cache: BlockCache) -> TransactionManager {
        TransactionManager::new(
            cache,
            SpaceMap::empty(SmKind::Metadata),
            SpaceMap::empty(SmKind::Data),
        )
    }

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

    /// Make block `b` writable, copying it if needed, and return the block to
    /// use from now on. `check` vets the contents before a copy is made;
    /// `shared` runs on the copy when the original had other references, so
    /// the owner of the block's format can count the copy's new references.
    pub fn shadow_with(
        &mut self,
        b: u64,
        kind: BlockKind,
        check: impl FnOnce(&Block) -> Result<()>,
        shared: impl FnOnce(&mut TransactionManager, &Block) -> Result<()>,
    ) -> Result<u64> {
        if self.is_writable(b) {
            return Ok(b);
        }
        let count = self.meta.count(b);
        let copy: Box<Block> = Box::new(*self.cache.read(b, kind)?);
        check(&copy)?;
        let n = self.meta.alloc()?;
        self.cache.put(n, kind, &copy)?;
        self.shadows.insert(n, ());
        if count > 1 {
            shared(self, &copy)?;
        }
        self.dec(b)?;
        Ok(n)
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
