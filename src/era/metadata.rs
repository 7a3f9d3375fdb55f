//! The dm-era metadata as the kernel keeps it: a superblock naming the
//! current era and its writeset (a bitset of the origin's blocks written in
//! it), the writeset tree (era -> archived writeset) and the era array (block
//! -> the last era it was written in, as far as archived writesets have been
//! digested into it). The era target builds on this; the tools read it.
//!
//! Like the kernel: a checkpoint archives the current writeset into the tree
//! and starts a new era with a new writeset; archived writesets are digested
//! into the era array, oldest first, and then leave the tree; a metadata
//! snapshot is a copy of the superblock holding the writeset tree and the era
//! array as they were.

use super::error::{EraError, Result};
use super::superblock::{self as sbm, Superblock, Writeset, INVALID_WRITESET_ROOT, SUPERBLOCK_LOCATION};
use crate::pdata::btree::{self, ValueKind};
use crate::pdata::cache::BlockCache;
use crate::pdata::space_map::{SmKind, SpaceMap, MAX_METADATA_BLOCKS};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{array, bitset, sm_disk, BlockKind, MetadataDev};

/// The writeset tree: era -> writeset record, whose root is a bitset.
pub const WRITESETS: ValueKind = ValueKind::ArrayRoot {
    size: sbm::WRITESET_SIZE,
    offset: 4,
};

/// Metadata block cache of an era device: 16 MiB.
pub const CACHE_BLOCKS: usize = 4096;

/// Bits of an archived writeset digested into the era array per step (the
/// kernel's INSERTS_PER_STEP).
pub const DIGEST_STEP: u32 = 100;

/// Where the digest of the oldest archived writeset stands.
#[derive(Clone, Copy, Debug)]
struct Digest {
    era: u32,
    ws: Writeset,
    nr_bits: u32,
    next: u32,
}

pub struct EraMetadata {
    tm: TransactionManager,
    sb: Superblock,
    /// A writeset was archived: the digest has work.
    archived: bool,
    digest: Option<Digest>,
    /// Changes since the last commit.
    dirty: bool,
    sim: Option<std::sync::Arc<crate::io::sim::SimDisk>>,
}

/// Statistics as the target's status shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stats {
    pub used: u64,
    pub total: u64,
    pub era: u32,
    /// The metadata snapshot's block, or 0.
    pub snap: u64,
}

impl EraMetadata {
    /// Write new, empty era metadata to `dev` for blocks of `block_size` sectors.
    pub fn format(dev: Box<dyn MetadataDev>, block_size: u32) -> Result<EraMetadata> {
        let cache = BlockCache::new(dev, CACHE_BLOCKS);
        let nr_meta = cache.nr_blocks().min(MAX_METADATA_BLOCKS);
        if nr_meta < 8 {
            return Err(EraError::Invalid(format!(
                "metadata device too small ({nr_meta} blocks)"
            )));
        }
        let mut meta = SpaceMap::new(SmKind::Metadata, nr_meta)?;
        meta.set(SUPERBLOCK_LOCATION, 1)?;
        let mut tm = TransactionManager::new(cache, meta, SpaceMap::empty(SmKind::Data));
        sm_disk::create_trees(&mut tm, SmKind::Metadata)?;
        let mut sb = Superblock::new(block_size);
        sb.writeset_tree_root = btree::create(&mut tm, WRITESETS)?;
        sb.era_array_root = array::empty(&mut tm)?;
        let mut md = EraMetadata::with(tm, sb);
        md.commit()?;
        Ok(md)
    }

    /// Open existing metadata: the superblock, the space map and the era
    /// array's and current writeset's shapes are checked against each other.
    pub fn open(dev: Box<dyn MetadataDev>) -> Result<EraMetadata> {
        let mut cache = BlockCache::new(dev, CACHE_BLOCKS);
        let sb = sbm::read(&mut cache, SUPERBLOCK_LOCATION)?;
        let mut tm = sm_disk::open_tm(cache, &sb.sm_root)?;
        array::blocks::<u32>(&mut tm, sb.era_array_root, sb.nr_blocks as u64)?;
        if sb.current_writeset.root != INVALID_WRITESET_ROOT {
            array::blocks::<u64>(
                &mut tm,
                sb.current_writeset.root,
                bitset::nr_words(sb.current_writeset.nr_bits as u64),
            )?;
        }
        let mut md = EraMetadata::with(tm, sb);
        // as the kernel: whatever the tree holds is digested after a load
        md.archived = true;
        Ok(md)
    }

    /// Open `dev`, or format it when its superblock is all zeroes; the
    /// data block size must be the one the metadata has.
    pub fn open_or_format(mut dev: Box<dyn MetadataDev>, block_size: u32) -> Result<EraMetadata> {
        if crate::pdata::unformatted(dev.as_mut(), SUPERBLOCK_LOCATION)? {
            return EraMetadata::format(dev, block_size);
        }
        let md = EraMetadata::open(dev)?;
        if md.sb.data_block_size != block_size {
            return Err(EraError::Invalid(format!(
                "changing the data block size (from {} to {block_size}) is not supported",
                md.sb.data_block_size
            )));
        }
        Ok(md)
    }

    fn with(tm: TransactionManager, sb: Superblock) -> EraMetadata {
        let sim = tm.cache.sim();
        EraMetadata {
            tm,
            sb,
            archived: false,
            digest: None,
            dirty: false,
            sim,
        }
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }
    pub fn nr_blocks(&self) -> u64 {
        self.sb.nr_blocks as u64
    }
    pub fn current_era(&self) -> u32 {
        self.sb.current_era
    }
    pub fn dirty(&self) -> bool {
        self.dirty
    }

    pub fn stats(&self) -> Stats {
        Stats {
            used: self.tm.meta.nr_blocks() - self.tm.meta.nr_free(),
            total: self.tm.meta.nr_blocks(),
            era: self.sb.current_era,
            snap: self.sb.metadata_snap,
        }
    }

    /// Make everything since the last commit durable: the space map, every
    /// dirty block, a flush, then the superblock and a flush.
    pub fn commit(&mut self) -> Result<()> {
        let _window = crate::io::sim::commit_window(self.sim.as_ref());
        let (meta_root, _) = sm_disk::commit(&mut self.tm)?;
        self.sb.sm_root = meta_root;
        self.tm.cache.write_dirty()?;
        if !self.sim.as_ref().is_some_and(|d| d.broken_commit_order()) {
            self.tm.cache.flush()?;
        }
        let mut image = self.sb.clone();
        image.blocknr = SUPERBLOCK_LOCATION;
        self.tm
            .cache
            .write_through(SUPERBLOCK_LOCATION, BlockKind::EraSuperblock, &image.encode())?;
        self.tm.cache.flush()?;
        self.tm.transaction_committed();
        self.dirty = false;
        Ok(())
    }

    /// The origin now has `nr_blocks`: the era array follows (new blocks era 0).
    pub fn resize(&mut self, nr_blocks: u64) -> Result<()> {
        if nr_blocks > sbm::MAX_NR_BLOCKS {
            return Err(EraError::Invalid(format!(
                "Invalid number of origin blocks {nr_blocks}"
            )));
        }
        let old = self.sb.nr_blocks as u64;
        self.sb.era_array_root = array::resize(&mut self.tm, self.sb.era_array_root, old, nr_blocks, 0u32)?;
        self.sb.nr_blocks = nr_blocks as u32;
        if let Some(d) = &mut self.digest {
            d.nr_bits = d.nr_bits.min(nr_blocks as u32);
        }
        self.dirty = true;
        Ok(())
    }

    /// Mark `block` in the current writeset; true if it was not marked.
    pub fn mark(&mut self, block: u64) -> Result<bool> {
        let ws = self.sb.current_writeset;
        if ws.root == INVALID_WRITESET_ROOT || block >= ws.nr_bits as u64 {
            return Err(EraError::Invalid(format!(
                "block {block} is beyond the current writeset ({} bits)",
                ws.nr_bits
            )));
        }
        if bitset::test(&mut self.tm, ws.root, block)? {
            return Ok(false);
        }
        self.sb.current_writeset.root = bitset::set(&mut self.tm, ws.root, block)?;
        self.dirty = true;
        Ok(true)
    }

    /// Whether `block` is marked in the current writeset (on disk).
    pub fn marked(&mut self, block: u64) -> Result<bool> {
        let ws = self.sb.current_writeset;
        if ws.root == INVALID_WRITESET_ROOT || block >= ws.nr_bits as u64 {
            return Ok(false);
        }
        Ok(bitset::test(&mut self.tm, ws.root, block)?)
    }

    /// Move the current writeset into the writeset tree under the current era.
    pub fn archive(&mut self) -> Result<()> {
        let ws = self.sb.current_writeset;
        if ws.root == INVALID_WRITESET_ROOT {
            return Ok(());
        }
        let era = self.sb.current_era as u64;
        let (root, old) = btree::insert(
            &mut self.tm,
            self.sb.writeset_tree_root,
            era,
            &ws.encode(),
            WRITESETS,
        )?;
        self.sb.writeset_tree_root = root;
        if let Some(old) = old {
            // an era archived twice (metadata written by something else): the
            // old writeset is replaced, as the kernel's insert would
            bitset::del(&mut self.tm, Writeset::decode(&old).root)?;
        }
        self.sb.current_writeset.root = INVALID_WRITESET_ROOT;
        self.archived = true;
        self.dirty = true;
        Ok(())
    }

    /// Archive the current writeset (if any) and start the next era with an
    /// empty writeset of every block.
    pub fn rollover(&mut self) -> Result<()> {
        self.archive()?;
        let nr = self.sb.nr_blocks;
        let root = bitset::new(&mut self.tm, nr as u64)?;
        self.sb.current_writeset = Writeset { nr_bits: nr, root };
        self.sb.current_era = self.sb.current_era.wrapping_add(1);
        self.dirty = true;
        Ok(())
    }

    /// Take the metadata snapshot: roll over, commit, and copy the superblock
    /// to a block of its own that holds the writeset tree and era array.
    pub fn take_snap(&mut self) -> Result<u64> {
        self.rollover()?;
        self.snap_rolled_over()
    }

    /// [`take_snap`](Self::take_snap) once its rollover is done (the target
    /// clears its in-core writeset in between).
    pub fn snap_rolled_over(&mut self) -> Result<u64> {
        if self.sb.metadata_snap != SUPERBLOCK_LOCATION {
            return Err(EraError::Invalid("metadata snapshot already exists".into()));
        }
        self.commit()?;
        let h = self.tm.new_block(BlockKind::EraSuperblock)?;
        let mut copy = self.sb.clone();
        copy.blocknr = h;
        let image = copy.encode();
        self.tm
            .write(h, BlockKind::EraSuperblock)?
            .copy_from_slice(&image[..]);
        self.tm.inc(self.sb.writeset_tree_root)?;
        self.tm.inc(self.sb.era_array_root)?;
        self.sb.metadata_snap = h;
        self.dirty = true;
        Ok(h)
    }

    /// Drop the metadata snapshot and whatever only it held.
    pub fn drop_snap(&mut self) -> Result<()> {
        let h = self.sb.metadata_snap;
        if h == SUPERBLOCK_LOCATION {
            return Err(EraError::Invalid("no snap to drop".into()));
        }
        let held = sbm::read(&mut self.tm.cache, h)?;
        self.sb.metadata_snap = SUPERBLOCK_LOCATION;
        self.dirty = true;
        btree::del_tree(&mut self.tm, held.writeset_tree_root, WRITESETS)?;
        array::del(&mut self.tm, held.era_array_root)?;
        self.tm.dec(h)?;
        Ok(())
    }

    /// Whether archived writesets wait to be digested.
    pub fn digest_pending(&self) -> bool {
        self.archived || self.digest.is_some()
    }

    /// One step of the digest: up to `DIGEST_STEP` bits of the oldest archived
    /// writeset go into the era array; a writeset done leaves the tree. Returns
    /// whether more remains.
    pub fn digest_step(&mut self) -> Result<bool> {
        if self.digest.is_none() {
            if !self.archived {
                return Ok(false);
            }
            let mut first: Option<(u64, Writeset)> = None;
            btree::walk(
                &mut self.tm,
                self.sb.writeset_tree_root,
                sbm::WRITESET_SIZE,
                &mut |k, v| {
                    if first.is_none() {
                        first = Some((k, Writeset::decode(v)));
                    }
                    Ok(())
                },
            )?;
            let Some((era, ws)) = first else {
                self.archived = false;
                return Ok(false);
            };
            let era = u32::try_from(era)
                .map_err(|_| EraError::Plain(format!("writeset tree holds era {era}, more than 32 bits")))?;
            self.digest = Some(Digest {
                era,
                ws,
                nr_bits: ws.nr_bits.min(self.sb.nr_blocks),
                next: 0,
            });
        }
        let Some(mut d) = self.digest else {
            return Ok(false);
        };
        let end = d.next.saturating_add(DIGEST_STEP).min(d.nr_bits);
        let mut word: Option<(u32, u64)> = None;
        for b in d.next..end {
            let w = match word {
                Some((i, w)) if i == b / 64 => w,
                _ => {
                    let w: u64 = array::get(&mut self.tm, d.ws.root, (b / 64) as u64)?;
                    word = Some((b / 64, w));
                    w
                }
            };
            if w & (1 << (b % 64)) != 0 {
                self.sb.era_array_root = array::set(&mut self.tm, self.sb.era_array_root, b as u64, d.era)?;
                self.dirty = true;
            }
        }
        d.next = end;
        if d.next < d.nr_bits {
            self.digest = Some(d);
            return Ok(true);
        }
        let (root, old) = btree::remove(&mut self.tm, self.sb.writeset_tree_root, d.era as u64, WRITESETS)?;
        self.sb.writeset_tree_root = root;
        if let Some(old) = old {
            bitset::del(&mut self.tm, Writeset::decode(&old).root)?;
        }
        self.digest = None;
        self.dirty = true;
        Ok(true)
    }

    /// Digest every archived writeset.
    pub fn digest_all(&mut self) -> Result<()> {
        while self.digest_step()? {}
        Ok(())
    }

    /// Metadata blocks allocated (for tests).
    pub fn nr_allocated(&self) -> u64 {
        self.tm.meta.nr_allocated()
    }

    /// The transaction manager, for the tools' builders (restore).
    pub(crate) fn parts(&mut self) -> (&mut TransactionManager, &mut Superblock) {
        (&mut self.tm, &mut self.sb)
    }
}
