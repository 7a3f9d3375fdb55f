//! A bounded cache of metadata blocks in front of a `MetadataDev`.
//!
//! Blocks are validated (checksum, self block number) when they come in from
//! the device, not on every hit. Dirty blocks get their block number and
//! checksum filled in when they go out. Evicting a dirty block writes it: that
//! is safe because the transaction manager only ever dirties blocks that the
//! last committed state does not use.

use super::checksum::block_csum;
use super::error::{corrupt, BlockKind, PdataError, Result};
use super::{le32, le64, put32, put64, Block, MetadataDev, BLOCK_SIZE};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A cheap hasher for block numbers (the std SipHash dominates warm lookups).
#[derive(Default)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (v ^ (v >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<U64Hasher>>;

struct Slot {
    block: u64,
    data: Box<Block>,
    kind: BlockKind,
    dirty: bool,
    referenced: bool,
}

pub struct BlockCache {
    dev: Box<dyn MetadataDev>,
    nr_blocks: u64,
    map: FastMap<u64, usize>,
    slots: Vec<Slot>,
    capacity: usize,
    hand: usize,
}

/// Check a block read from disk: checksum with the kind's salt, then blocknr.
pub fn validate(block: u64, kind: BlockKind, data: &Block) -> Result<()> {
    let stored = le32(data, 0);
    let computed = block_csum(data, kind.salt());
    if stored != computed {
        return Err(PdataError::Checksum {
            block,
            kind,
            stored,
            computed,
        });
    }
    let found = le64(data, kind.blocknr_offset());
    if found != block {
        return Err(PdataError::BlockNr { block, kind, found });
    }
    Ok(())
}

/// Fill in the self block number and checksum before a block goes to disk.
pub fn seal(block: u64, kind: BlockKind, data: &mut Block) {
    put64(data, kind.blocknr_offset(), block);
    let c = block_csum(data, kind.salt());
    put32(data, 0, c);
}

impl BlockCache {
    /// `capacity` is in blocks (memory use is about capacity * 4 KiB); minimum 16.
    /// The simulated disk under the device, if any ([`MetadataDev::sim`]).
    pub fn sim(&self) -> Option<std::sync::Arc<crate::io::sim::SimDisk>> {
        self.dev.sim()
    }

    pub fn new(dev: Box<dyn MetadataDev>, capacity: usize) -> BlockCache {
        let nr_blocks = dev.nr_blocks();
        BlockCache {
            dev,
            nr_blocks,
            map: FastMap::default(),
            slots: Vec::new(),
            capacity: capacity.max(16),
            hand: 0,
        }
    }

    pub fn nr_blocks(&self) -> u64 {
        self.nr_blocks
    }

    /// Re-read the device size (after the metadata device grew).
    pub fn refresh_nr_blocks(&mut self) -> Result<u64> {
        let n = self.dev.refresh_size().map_err(|e| Self::io_err(0, e))?;
        self.nr_blocks = n.max(self.nr_blocks);
        Ok(self.nr_blocks)
    }

    fn check_range(&self, block: u64) -> Result<()> {
        if block >= self.nr_blocks {
            return Err(PdataError::OutOfRange {
                block,
                nr_blocks: self.nr_blocks,
            });
        }
        Ok(())
    }

    fn io_err(block: u64, source: std::io::Error) -> PdataError {
        PdataError::Io { block, source }
    }

    /// Find a slot for a new block, evicting (and writing if dirty) by CLOCK.
    fn free_slot(&mut self) -> Result<usize> {
        if self.slots.len() < self.capacity {
            self.slots.push(Slot {
                block: u64::MAX,
                data: Box::new([0u8; BLOCK_SIZE]),
                kind: BlockKind::BtreeNode,
                dirty: false,
                referenced: false,
            });
            return Ok(self.slots.len() - 1);
        }
        loop {
            let i = self.hand;
            self.hand = (self.hand + 1) % self.slots.len();
            let s = &mut self.slots[i];
            if s.referenced {
                s.referenced = false;
                continue;
            }
            if s.dirty {
                let b = s.block;
                seal(b, s.kind, &mut s.data);
                self.dev.write_block(b, &s.data).map_err(|e| Self::io_err(b, e))?;
                s.dirty = false;
            }
            self.map.remove(&s.block);
            s.block = u64::MAX;
            return Ok(i);
        }
    }

    fn load(&mut self, block: u64, kind: BlockKind) -> Result<usize> {
        if let Some(&i) = self.map.get(&block) {
            let s = &mut self.slots[i];
            s.referenced = true;
            if s.kind != kind && !s.dirty {
                validate(block, kind, &s.data)?;
                s.kind = kind;
            }
            return Ok(i);
        }
        self.check_range(block)?;
        let mut buf = Box::new([0u8; BLOCK_SIZE]);
        self.dev
            .read_block(block, &mut buf)
            .map_err(|e| Self::io_err(block, e))?;
        validate(block, kind, &buf)?;
        let i = self.free_slot()?;
        let s = &mut self.slots[i];
        s.block = block;
        s.data = buf;
        s.kind = kind;
        s.dirty = false;
        s.referenced = true;
        self.map.insert(block, i);
        Ok(i)
    }

    /// A validated block, for reading.
    pub fn read(&mut self, block: u64, kind: BlockKind) -> Result<&Block> {
        let i = self.load(block, kind)?;
        Ok(&self.slots[i].data)
    }

    /// A validated block, to modify in place (marks it dirty).
    pub fn write(&mut self, block: u64, kind: BlockKind) -> Result<&mut Block> {
        let i = self.load(block, kind)?;
        let s = &mut self.slots[i];
        s.dirty = true;
        Ok(&mut s.data)
    }

    /// A zero-filled dirty block that replaces whatever was at `block`.
    pub fn write_new(&mut self, block: u64, kind: BlockKind) -> Result<&mut Block> {
        self.check_range(block)?;
        let i = match self.map.get(&block) {
            Some(&i) => i,
            None => {
                let i = self.free_slot()?;
                self.map.insert(block, i);
                i
            }
        };
        let s = &mut self.slots[i];
        s.block = block;
        s.data.fill(0);
        s.kind = kind;
        s.dirty = true;
        s.referenced = true;
        Ok(&mut s.data)
    }

    /// Replace a block's contents.
    pub fn put(&mut self, block: u64, kind: BlockKind, data: &Block) -> Result<()> {
        let d = self.write_new(block, kind)?;
        d.copy_from_slice(data);
        Ok(())
    }

    /// Drop a block freed during this transaction so it is never written.
    pub fn forget_dirty(&mut self, block: u64) {
        if let Some(&i) = self.map.get(&block) {
            if self.slots[i].dirty {
                self.slots[i].dirty = false;
                self.slots[i].block = u64::MAX;
                self.map.remove(&block);
            }
        }
    }

    /// Write every dirty block (in block order), without a flush.
    pub fn write_dirty(&mut self) -> Result<()> {
        let mut dirty: Vec<usize> = (0..self.slots.len()).filter(|&i| self.slots[i].dirty).collect();
        dirty.sort_by_key(|&i| self.slots[i].block);
        for i in dirty {
            let s = &mut self.slots[i];
            let b = s.block;
            seal(b, s.kind, &mut s.data);
            self.dev.write_block(b, &s.data).map_err(|e| Self::io_err(b, e))?;
            s.dirty = false;
        }
        Ok(())
    }

    /// Write one block straight through (the superblock), keeping the cache coherent.
    pub fn write_through(&mut self, block: u64, kind: BlockKind, data: &Block) -> Result<()> {
        let mut buf = Box::new(*data);
        seal(block, kind, &mut buf);
        self.dev
            .write_block(block, &buf)
            .map_err(|e| Self::io_err(block, e))?;
        if let Some(i) = self.map.remove(&block) {
            self.slots[i].block = u64::MAX;
            self.slots[i].dirty = false;
        }
        Ok(())
    }

    /// Read and validate a block into `buf`, bypassing the cache (one-pass
    /// walks such as the checker, which visit every block once).
    pub fn read_uncached(&mut self, block: u64, kind: BlockKind, buf: &mut Block) -> Result<()> {
        self.check_range(block)?;
        self.dev
            .read_block(block, buf)
            .map_err(|e| Self::io_err(block, e))?;
        validate(block, kind, buf)
    }

    /// Read `n` consecutive blocks from `first` in one I/O, uncached, into `buf`
    /// (resized); each is validated as `kind` and the result given per block.
    /// Blocks dirty in the cache are not seen (for read-only walks).
    pub fn read_run_uncached(
        &mut self,
        first: u64,
        n: usize,
        kind: BlockKind,
        buf: &mut Vec<u8>,
    ) -> Result<Vec<Result<()>>> {
        if n > 0 {
            self.check_range(first + n as u64 - 1)?;
        }
        buf.resize(n * BLOCK_SIZE, 0);
        self.dev
            .read_blocks(first, buf)
            .map_err(|e| Self::io_err(first, e))?;
        Ok(buf
            .chunks_exact(BLOCK_SIZE)
            .enumerate()
            .map(|(i, c)| match <&Block>::try_from(c) {
                Ok(b) => validate(first + i as u64, kind, b),
                Err(_) => Err(corrupt(first + i as u64, "short block")),
            })
            .collect())
    }

    /// Read a block with no validation and no caching (for superblock probing).
    pub fn read_raw(&mut self, block: u64) -> Result<Box<Block>> {
        self.check_range(block)?;
        let mut buf = Box::new([0u8; BLOCK_SIZE]);
        self.dev
            .read_block(block, &mut buf)
            .map_err(|e| Self::io_err(block, e))?;
        Ok(buf)
    }

    /// The device underneath.
    pub fn dev(&self) -> &dyn MetadataDev {
        self.dev.as_ref()
    }

    /// The device, for a new owner (clean blocks only: nothing dirty is lost).
    pub fn into_dev(self) -> Box<dyn MetadataDev> {
        self.dev
    }

    pub fn flush(&mut self) -> Result<()> {
        self.dev.flush().map_err(|e| Self::io_err(0, e))
    }

    /// Drop every cached block, dirty ones included (transaction abort).
    pub fn clear(&mut self) {
        self.map.clear();
        self.slots.clear();
        self.hand = 0;
    }

    pub fn dirty_count(&self) -> usize {
        self.slots.iter().filter(|s| s.dirty).count()
    }
}
