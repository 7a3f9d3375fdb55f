//! The thin-pool metadata API: devices, snapshots and block mappings over
//! the kernel's on-disk format. The thin-pool and thin targets build on this.
//!
//! Device details and each device's bottom-level root are kept in core and
//! written back at commit, as the kernel does, so a provisioning insert
//! touches only the device's own mapping tree.

use super::error::{Result, ThinError};
use super::map_cache::MapCache;
use super::superblock::*;
use crate::pdata::btree::{self, ValueKind};
use crate::pdata::cache::{BlockCache, FastMap};
use crate::pdata::sm_disk::{self, SmRoot};
use crate::pdata::space_map::{SmKind, SpaceMap, MAX_METADATA_BLOCKS};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{BlockKind, MetadataDev};
use std::collections::{BTreeMap, BTreeSet};

/// Top level of the mapping tree: dev id -> bottom-level root.
pub const TOP: ValueKind = ValueKind::Subtree { leaf_shift: 24 };
/// Bottom level: virtual block -> block_time.
pub const BOTTOM: ValueKind = ValueKind::DataRef { shift: 24 };
pub const DETAILS: ValueKind = ValueKind::Plain(24);

/// Default block cache: 16 MiB.
pub const DEFAULT_CACHE_BLOCKS: usize = 4096;

/// The lookup cache gets half the block cache's memory on top of it.
fn map_cache_bytes(cache_blocks: usize) -> usize {
    cache_blocks.saturating_mul(crate::pdata::BLOCK_SIZE) / 2
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub data_block: u64,
    pub time: u32,
    /// The block may be shared with a snapshot (kernel rule: the device was
    /// snapshotted after this mapping was made); write must break sharing.
    pub shared: bool,
}

#[derive(Clone, Copy, Debug)]
pub struct FormatOptions {
    /// Sectors per data block: 128..=2097152, a multiple of 128.
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
    pub cache_blocks: usize,
}

pub struct ThinPoolMetadata {
    tm: TransactionManager,
    sb: Superblock,
    details: BTreeMap<u64, DeviceDetails>,
    details_dirty: BTreeSet<u64>,
    roots: FastMap<u64, u64>,
    /// Devices whose top-level path was shadowed in this transaction.
    top_touched: FastMap<u64, ()>,
    /// Recent lookups, kept exact by every mapping change below.
    map_cache: MapCache,
    /// The simulated disk under the metadata, in crash trials.
    sim: Option<std::sync::Arc<crate::io::sim::SimDisk>>,
}

fn check_data_block_size(s: u32) -> Result<()> {
    if !(MIN_DATA_BLOCK_SIZE..=MAX_DATA_BLOCK_SIZE).contains(&s) || !s.is_multiple_of(MIN_DATA_BLOCK_SIZE) {
        return Err(ThinError::DataBlockSize(s));
    }
    Ok(())
}

/// Read and sanity-check the superblock at block 0. Every size in it is
/// checked against the metadata device before any reader sizes anything by it.
pub fn read_superblock(cache: &mut BlockCache) -> Result<Superblock> {
    let dev_blocks = cache.nr_blocks();
    read_superblock_within(cache, dev_blocks)
}

/// [`read_superblock`] for the superblock alone (`thin_check
/// --super-block-only`, which 1.x runs on a file of that one block too): its
/// sizes are checked against what the format allows, not against the device.
/// Nothing may be read or sized by them.
pub fn read_superblock_alone(cache: &mut BlockCache) -> Result<Superblock> {
    read_superblock_within(cache, u64::MAX)
}

fn read_superblock_within(cache: &mut BlockCache, dev_blocks: u64) -> Result<Superblock> {
    let sb = Superblock::decode(cache.read(SUPERBLOCK_LOCATION, BlockKind::Superblock)?);
    if sb.magic != MAGIC {
        return Err(ThinError::BadSuperblock(format!("bad magic {}", sb.magic)));
    }
    if sb.incompat_flags != 0 {
        return Err(ThinError::BadSuperblock(format!(
            "unsupported incompat flags {:#x}",
            sb.incompat_flags
        )));
    }
    check_sizes(&sb, SUPERBLOCK_LOCATION, dev_blocks)?;
    Ok(sb)
}

/// The sizes a superblock (at `block`, on a metadata device of `dev_blocks`)
/// states: its space maps' and its data block size.
fn check_sizes(sb: &Superblock, block: u64, dev_blocks: u64) -> Result<()> {
    sm_disk::check_root(SmKind::Metadata, &sb.meta_sm_root, block, dev_blocks)?;
    sm_disk::check_root(SmKind::Data, &sb.data_sm_root, block, dev_blocks)?;
    check_data_block_size(sb.data_block_size).map_err(|_| {
        ThinError::BadSuperblock(format!(
            "data_block_size is {} sectors: must be 128..2097152 and a multiple of 128",
            sb.data_block_size
        ))
    })
}

impl ThinPoolMetadata {
    /// Write a new, empty pool to `dev` (everything on it is lost).
    pub fn format(dev: Box<dyn MetadataDev>, opts: FormatOptions) -> Result<ThinPoolMetadata> {
        Self::format_placed(dev, opts, false)
    }

    /// [`ThinPoolMetadata::format`] for a restore: the empty pool's own blocks
    /// (space maps, empty trees) go to the end of the device, and the blocks
    /// allocated next come from its start, one after another, as 1.x's
    /// thin_restore lays them out. A dump names a shared subtree after its first
    /// leaf block, so a restored pool then dumps with 1.x's names for its
    /// `<def>`s: dump, restore, dump is a fixed point, whichever tool restores.
    pub fn format_for_restore(dev: Box<dyn MetadataDev>, opts: FormatOptions) -> Result<ThinPoolMetadata> {
        Self::format_placed(dev, opts, true)
    }

    fn format_placed(
        dev: Box<dyn MetadataDev>,
        opts: FormatOptions,
        at_end: bool,
    ) -> Result<ThinPoolMetadata> {
        check_data_block_size(opts.data_block_size)?;
        let cache = BlockCache::new(dev, opts.cache_blocks);
        let nr_meta = cache.nr_blocks().min(MAX_METADATA_BLOCKS);
        if nr_meta < 16 {
            return Err(ThinError::Invalid(format!(
                "metadata device too small ({nr_meta} blocks)"
            )));
        }
        let mut meta = SpaceMap::new(SmKind::Metadata, nr_meta)?;
        meta.set(SUPERBLOCK_LOCATION, 1)?;
        if at_end {
            // room for both space maps' bitmaps and index blocks, the empty
            // trees, and their shadows at commit (a smaller device wraps around)
            let per_bitmap = crate::pdata::space_map::ENTRIES_PER_BITMAP;
            let need = 2 * (16 + nr_meta / per_bitmap + opts.nr_data_blocks / per_bitmap);
            meta.set_cursor(nr_meta.saturating_sub(need));
        }
        let data = SpaceMap::new(SmKind::Data, opts.nr_data_blocks)?;
        let mut tm = TransactionManager::new(cache, meta, data);
        sm_disk::create_trees(&mut tm, SmKind::Metadata)?;
        sm_disk::create_trees(&mut tm, SmKind::Data)?;
        let details_root = btree::create(&mut tm, DETAILS)?;
        let mapping_root = btree::create(&mut tm, TOP)?;
        let sb = Superblock {
            flags: 0,
            blocknr: SUPERBLOCK_LOCATION,
            uuid: [0; 16],
            magic: MAGIC,
            version: VERSION,
            time: 0,
            trans_id: 0,
            held_root: 0,
            data_sm_root: SmRoot::default(),
            meta_sm_root: SmRoot::default(),
            mapping_root,
            details_root,
            data_block_size: opts.data_block_size,
            metadata_block_size: METADATA_BLOCK_SECTORS,
            metadata_nr_blocks: nr_meta,
            compat_flags: 0,
            compat_ro_flags: 0,
            incompat_flags: 0,
        };
        let mut md = ThinPoolMetadata {
            tm,
            sb,
            details: BTreeMap::new(),
            details_dirty: BTreeSet::new(),
            roots: FastMap::default(),
            top_touched: FastMap::default(),
            map_cache: MapCache::new(map_cache_bytes(opts.cache_blocks)),
            sim: None,
        };
        md.sim = md.tm.cache.sim();
        md.commit()?;
        if at_end {
            md.tm.meta.set_cursor(SUPERBLOCK_LOCATION + 1);
        }
        Ok(md)
    }

    /// Open an existing pool.
    pub fn open(dev: Box<dyn MetadataDev>, cache_blocks: usize) -> Result<ThinPoolMetadata> {
        let cache = BlockCache::new(dev, cache_blocks);
        let tm = TransactionManager::unloaded(cache);
        let mut md = ThinPoolMetadata {
            tm,
            sb: Superblock::decode(&[0u8; 4096]),
            details: BTreeMap::new(),
            details_dirty: BTreeSet::new(),
            roots: FastMap::default(),
            top_touched: FastMap::default(),
            map_cache: MapCache::new(map_cache_bytes(cache_blocks)),
            sim: None,
        };
        md.sim = md.tm.cache.sim();
        md.load()?;
        Ok(md)
    }

    /// (Re)read all committed state from disk.
    fn load(&mut self) -> Result<()> {
        self.tm.abort();
        self.map_cache.clear();
        let sb = read_superblock(&mut self.tm.cache)?;
        self.tm.meta = sm_disk::load(&mut self.tm, SmKind::Metadata, &sb.meta_sm_root)?;
        self.tm.data = sm_disk::load(&mut self.tm, SmKind::Data, &sb.data_sm_root)?;
        let mut details = BTreeMap::new();
        btree::walk(&mut self.tm, sb.details_root, 24, &mut |k, v| {
            details.insert(k, DeviceDetails::decode(v));
            Ok(())
        })?;
        let mut roots = FastMap::default();
        btree::walk(&mut self.tm, sb.mapping_root, 8, &mut |k, v| {
            roots.insert(k, crate::pdata::le64(v, 0));
            Ok(())
        })?;
        if let Some(dev) = roots.keys().find(|d| !details.contains_key(d)) {
            return Err(ThinError::BadSuperblock(format!(
                "device {dev} is in the mapping tree but has no details"
            )));
        }
        self.sb = sb;
        self.details = details;
        self.roots = roots;
        self.details_dirty.clear();
        self.top_touched.clear();
        Ok(())
    }

    /// Make everything done since the last commit durable: write all dirty
    /// blocks, flush, write the superblock, flush.
    pub fn commit(&mut self) -> Result<()> {
        let _window = crate::io::sim::commit_window(self.sim.as_ref());
        // The changed devices stay `changed` until the commit is done: a commit
        // that fails leaves them so, for the pool to know whose changes its abort drops.
        for &dev in &self.details_dirty {
            if let Some(d) = self.details.get(&dev) {
                let v = d.encode();
                self.sb.details_root = btree::insert(&mut self.tm, self.sb.details_root, dev, &v, DETAILS)?.0;
            }
        }
        let (meta_root, data_root) = sm_disk::commit(&mut self.tm)?;
        self.sb.meta_sm_root = meta_root;
        self.sb.data_sm_root = data_root;
        self.sb.metadata_nr_blocks = meta_root.nr_blocks;
        self.tm.cache.write_dirty()?;
        if !self.sim.as_ref().is_some_and(|d| d.broken_commit_order()) {
            self.tm.cache.flush()?;
        }
        let image = self.sb.encode();
        self.tm
            .cache
            .write_through(SUPERBLOCK_LOCATION, BlockKind::Superblock, &image)?;
        self.tm.cache.flush()?;
        self.tm.transaction_committed();
        self.top_touched.clear();
        self.details_dirty.clear();
        Ok(())
    }

    /// Names the committed state: right after `open` or `commit`, the same value
    /// for the same superblock (what a restart log follows, `io::restart_log`).
    pub fn committed_identity(&self) -> u64 {
        let b = self.sb.encode();
        (u64::from(crc32c::crc32c(&b[..])) << 32) | (self.sb.mapping_root & 0xffff_ffff)
    }

    /// Drop everything since the last commit.
    pub fn abort(&mut self) -> Result<()> {
        self.load()
    }

    // ---- devices ----------------------------------------------------------

    fn details_of(&self, dev: u64) -> Result<&DeviceDetails> {
        self.details.get(&dev).ok_or(ThinError::NoSuchDevice(dev))
    }

    pub fn devices(&self) -> Vec<u64> {
        self.details.keys().copied().collect()
    }

    pub fn device_details(&self, dev: u64) -> Result<DeviceDetails> {
        self.details_of(dev).copied()
    }

    pub fn mapped_blocks(&self, dev: u64) -> Result<u64> {
        Ok(self.details_of(dev)?.mapped_blocks)
    }

    pub fn create_thin(&mut self, dev: u64) -> Result<()> {
        if self.details.contains_key(&dev) {
            return Err(ThinError::DeviceExists(dev));
        }
        let root = btree::create(&mut self.tm, BOTTOM)?;
        self.set_top(dev, root)?;
        let t = self.sb.time;
        self.put_details(
            dev,
            DeviceDetails {
                mapped_blocks: 0,
                transaction_id: self.sb.trans_id,
                creation_time: t,
                snapshotted_time: t,
            },
        );
        Ok(())
    }

    /// Snapshot `origin` as `dev`: shares the origin's whole mapping tree
    /// (one reference count increment), O(1) in the origin's size.
    pub fn create_snap(&mut self, dev: u64, origin: u64) -> Result<()> {
        if self.details.contains_key(&dev) {
            return Err(ThinError::DeviceExists(dev));
        }
        let root = *self.roots.get(&origin).ok_or(ThinError::NoSuchDevice(origin))?;
        let mut od = *self.details_of(origin)?;
        self.tm.inc(root)?;
        self.set_top(dev, root)?;
        self.sb.time += 1;
        let t = self.sb.time;
        od.snapshotted_time = t;
        self.put_details(origin, od);
        self.put_details(
            dev,
            DeviceDetails {
                mapped_blocks: od.mapped_blocks,
                transaction_id: self.sb.trans_id,
                creation_time: t,
                snapshotted_time: t,
            },
        );
        Ok(())
    }

    /// Delete a device, freeing whatever is no longer shared.
    pub fn delete(&mut self, dev: u64) -> Result<()> {
        self.details_of(dev)?;
        self.map_cache.forget_device(dev);
        let (top, old) = btree::remove(&mut self.tm, self.sb.mapping_root, dev, TOP)?;
        self.sb.mapping_root = top;
        let root = match old {
            Some(v) => crate::pdata::le64(&v, 0),
            None => return Err(ThinError::NoSuchDevice(dev)),
        };
        btree::del_tree(&mut self.tm, root, BOTTOM)?;
        self.sb.details_root = btree::remove(&mut self.tm, self.sb.details_root, dev, DETAILS)?.0;
        self.details.remove(&dev);
        self.details_dirty.remove(&dev);
        self.roots.remove(&dev);
        self.top_touched.remove(&dev);
        Ok(())
    }

    /// Whether `dev` changed since the last commit (dm_thin_changed_this_transaction).
    pub fn changed(&self, dev: u64) -> bool {
        self.details_dirty.contains(&dev)
    }

    fn put_details(&mut self, dev: u64, d: DeviceDetails) {
        self.details.insert(dev, d);
        self.details_dirty.insert(dev);
    }

    /// Set a device's details (restore uses this; mapped_blocks is kept
    /// as counted).
    pub fn set_device_details(&mut self, dev: u64, mut d: DeviceDetails) -> Result<()> {
        d.mapped_blocks = self.details_of(dev)?.mapped_blocks;
        self.put_details(dev, d);
        Ok(())
    }

    fn set_top(&mut self, dev: u64, root: u64) -> Result<()> {
        let v = root.to_le_bytes();
        self.sb.mapping_root = btree::insert(&mut self.tm, self.sb.mapping_root, dev, &v, TOP)?.0;
        self.roots.insert(dev, root);
        self.top_touched.insert(dev, ());
        Ok(())
    }

    /// The device's bottom-level root, ready for modification. The top-level
    /// path is shadowed first: if a top-level node is shared (metadata
    /// snapshot), copying it hands its children the increments they need
    /// before the bottom root itself is copied.
    fn touch(&mut self, dev: u64) -> Result<u64> {
        let root = *self.roots.get(&dev).ok_or(ThinError::NoSuchDevice(dev))?;
        if !self.top_touched.contains_key(&dev) {
            self.set_top(dev, root)?;
        }
        Ok(root)
    }

    fn root_moved(&mut self, dev: u64, old: u64, new: u64) -> Result<()> {
        if old != new {
            self.set_top(dev, new)?;
        }
        Ok(())
    }

    // ---- mappings ---------------------------------------------------------

    pub fn lookup(&mut self, dev: u64, vblock: u64) -> Result<Option<Mapping>> {
        let snap_time = self.details_of(dev)?.snapshotted_time;
        let mapping = |v: u64| {
            let (data_block, time) = unpack_block_time(v);
            Mapping {
                data_block,
                time,
                shared: snap_time > time,
            }
        };
        if let Some(v) = self.map_cache.get(dev, vblock) {
            return Ok(Some(mapping(v)));
        }
        let root = *self.roots.get(&dev).ok_or(ThinError::NoSuchDevice(dev))?;
        let found = btree::lookup_u64(&mut self.tm, root, vblock)?;
        if let Some(v) = found {
            self.map_cache.put(dev, vblock, v);
        }
        Ok(found.map(mapping))
    }

    /// Visit the mappings of `dev` with lo <= vblock < hi, in order.
    pub fn mappings_in(
        &mut self,
        dev: u64,
        lo: u64,
        hi: u64,
        f: &mut dyn FnMut(u64, u64, u32),
    ) -> Result<()> {
        let root = *self.roots.get(&dev).ok_or(ThinError::NoSuchDevice(dev))?;
        btree::walk_range(&mut self.tm, root, 8, lo, hi, &mut |k, v| {
            let (b, t) = unpack_block_time(crate::pdata::le64(v, 0));
            f(k, b, t);
            Ok(())
        })?;
        Ok(())
    }

    /// Highest mapped virtual block, if any.
    pub fn highest_mapped(&mut self, dev: u64) -> Result<Option<u64>> {
        let mut last = None;
        self.mappings_in(dev, 0, u64::MAX, &mut |k, _, _| last = Some(k))?;
        Ok(last)
    }

    fn check_data_block(&self, b: u64) -> Result<()> {
        let n = self.tm.data.nr_blocks();
        if b >= n {
            return Err(ThinError::DataBlockOutOfRange {
                block: b,
                nr_blocks: n,
            });
        }
        Ok(())
    }

    /// Map `vblock` of `dev` to `data_block` at the current time. Takes over
    /// the reference the caller holds on `data_block` (from
    /// `alloc_data_block`); a replaced mapping's data block is released.
    pub fn insert(&mut self, dev: u64, vblock: u64, data_block: u64) -> Result<()> {
        let t = self.sb.time;
        self.insert_with_time(dev, vblock, data_block, t)
    }

    pub fn insert_with_time(&mut self, dev: u64, vblock: u64, data_block: u64, time: u32) -> Result<()> {
        self.check_data_block(data_block)?;
        let root = self.touch(dev)?;
        let value = pack_block_time(data_block, time);
        let (new_root, old) = match btree::insert(&mut self.tm, root, vblock, &value.to_le_bytes(), BOTTOM) {
            Ok(r) => r,
            Err(e) => {
                // the tree may or may not hold the new value now
                self.map_cache.forget(dev, vblock);
                return Err(e.into());
            }
        };
        self.map_cache.put(dev, vblock, value);
        self.root_moved(dev, root, new_root)?;
        let mut d = *self.details_of(dev)?;
        match old {
            None => d.mapped_blocks += 1,
            Some(o) => {
                let (ob, _) = unpack_block_time(crate::pdata::le64(&o, 0));
                if ob != data_block {
                    self.tm.data.dec(ob)?;
                }
            }
        }
        self.put_details(dev, d);
        Ok(())
    }

    /// Map an already-used data block into another place (restore, clone):
    /// takes a new reference on it.
    pub fn insert_shared(&mut self, dev: u64, vblock: u64, data_block: u64, time: u32) -> Result<()> {
        self.check_data_block(data_block)?;
        self.tm.data.inc(data_block)?;
        self.insert_with_time(dev, vblock, data_block, time)
    }

    /// Unmap `vblock`; returns whether it was mapped.
    pub fn remove(&mut self, dev: u64, vblock: u64) -> Result<bool> {
        let root = self.touch(dev)?;
        self.map_cache.forget(dev, vblock);
        let (new_root, old) = btree::remove(&mut self.tm, root, vblock, BOTTOM)?;
        self.root_moved(dev, root, new_root)?;
        let Some(o) = old else { return Ok(false) };
        let (ob, _) = unpack_block_time(crate::pdata::le64(&o, 0));
        self.tm.data.dec(ob)?;
        let mut d = *self.details_of(dev)?;
        d.mapped_blocks = d.mapped_blocks.saturating_sub(1);
        self.put_details(dev, d);
        Ok(true)
    }

    // ---- data space -------------------------------------------------------

    /// A data block free now and at the last commit, with count 1.
    pub fn alloc_data_block(&mut self) -> Result<u64> {
        Ok(self.tm.data.alloc()?)
    }

    /// Drop a reference to a data block (e.g. an allocation that was not used).
    pub fn release_data_block(&mut self, b: u64) -> Result<()> {
        self.check_data_block(b)?;
        self.tm.data.dec(b)?;
        Ok(())
    }

    /// Hold free data block `b` back from allocation, in memory only, until
    /// [`ThinPoolMetadata::unhold_data_block`]: I/O to it is still on its way
    /// (a discard's passdown). False if the block is in use (nothing held).
    pub fn hold_data_block(&mut self, b: u64) -> bool {
        self.tm.data.hold(b)
    }

    pub fn unhold_data_block(&mut self, b: u64) {
        self.tm.data.unhold(b);
    }

    /// Whether data block `b` was in use at the last commit (a block allocated
    /// then and mapped only now was committed as allocated, unmapped).
    pub fn data_block_in_use_at_commit(&self, b: u64) -> bool {
        b < self.tm.data.nr_blocks() && self.tm.data.committed(b)
    }

    pub fn data_block_ref_count(&self, b: u64) -> u32 {
        self.tm.data.count(b)
    }

    pub fn metadata_block_ref_count(&self, b: u64) -> u32 {
        self.tm.meta.count(b)
    }

    /// Shared in the discard sense: more than one reference.
    pub fn is_data_block_shared(&self, b: u64) -> bool {
        self.tm.data.is_shared(b)
    }

    pub fn nr_data_blocks(&self) -> u64 {
        self.tm.data.nr_blocks()
    }
    pub fn nr_free_data_blocks(&self) -> u64 {
        self.tm.data.nr_free()
    }
    pub fn nr_metadata_blocks(&self) -> u64 {
        self.tm.meta.nr_blocks()
    }
    pub fn nr_free_metadata_blocks(&self) -> u64 {
        self.tm.meta.nr_free()
    }

    /// Grow the data device to `nr_blocks`.
    pub fn resize_data_dev(&mut self, nr_blocks: u64) -> Result<()> {
        self.tm.data.extend(nr_blocks)?;
        Ok(())
    }

    /// Grow the metadata space map to `nr_blocks` (at most the device size).
    pub fn resize_metadata_dev(&mut self, nr_blocks: u64) -> Result<()> {
        if nr_blocks > self.tm.cache.nr_blocks() {
            self.tm.cache.refresh_nr_blocks()?;
        }
        if nr_blocks > self.tm.cache.nr_blocks() {
            return Err(ThinError::Invalid(format!(
                "metadata device has only {} blocks",
                self.tm.cache.nr_blocks()
            )));
        }
        self.tm.meta.extend(nr_blocks)?;
        Ok(())
    }

    // ---- superblock fields ------------------------------------------------

    pub fn data_block_size(&self) -> u32 {
        self.sb.data_block_size
    }
    pub fn time(&self) -> u32 {
        self.sb.time
    }
    pub fn set_time(&mut self, t: u32) {
        self.sb.time = t;
    }
    pub fn transaction_id(&self) -> u64 {
        self.sb.trans_id
    }

    /// Compare-and-swap of the userspace transaction id.
    pub fn set_transaction_id(&mut self, current: u64, new: u64) -> Result<()> {
        if self.sb.trans_id != current {
            return Err(ThinError::TransactionIdMismatch {
                expected: current,
                current: self.sb.trans_id,
            });
        }
        self.sb.trans_id = new;
        Ok(())
    }

    pub fn needs_check(&self) -> bool {
        self.sb.flags & NEEDS_CHECK != 0
    }
    pub fn set_needs_check(&mut self, on: bool) {
        if on {
            self.sb.flags |= NEEDS_CHECK;
        } else {
            self.sb.flags &= !NEEDS_CHECK;
        }
    }
    pub fn set_flags(&mut self, flags: u32) {
        self.sb.flags = flags;
    }
    pub fn set_version(&mut self, v: u32) {
        self.sb.version = v;
    }
    /// The superblock's 16-byte uuid field: the first 16 bytes of `uuid`,
    /// zero-padded, as thin_restore stores the XML's uuid attribute.
    pub fn set_uuid(&mut self, uuid: &str) {
        let b = uuid.as_bytes();
        let n = b.len().min(16);
        self.sb.uuid = [0; 16];
        self.sb.uuid[..n].copy_from_slice(&b[..n]);
    }
    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    // ---- metadata snapshot ------------------------------------------------

    /// Block of the held metadata snapshot, if any.
    pub fn held_root(&self) -> Option<u64> {
        (self.sb.held_root != 0).then_some(self.sb.held_root)
    }

    /// Take a read-only snapshot of the metadata for userspace (thin_dump -m).
    /// Commits before and after.
    pub fn reserve_metadata_snap(&mut self) -> Result<u64> {
        if self.sb.held_root != 0 {
            return Err(ThinError::SnapshotHeld(self.sb.held_root));
        }
        self.commit()?;
        let h = self.tm.new_block(BlockKind::Superblock)?;
        let mut copy = self.sb.clone();
        copy.blocknr = h;
        copy.held_root = 0;
        copy.data_sm_root = SmRoot::default();
        copy.meta_sm_root = SmRoot::default();
        let image = copy.encode();
        self.tm
            .write(h, BlockKind::Superblock)?
            .copy_from_slice(&image[..]);
        self.tm.inc(self.sb.mapping_root)?;
        self.tm.inc(self.sb.details_root)?;
        self.sb.held_root = h;
        self.commit()?;
        Ok(h)
    }

    pub fn release_metadata_snap(&mut self) -> Result<()> {
        let h = self.sb.held_root;
        if h == 0 {
            return Err(ThinError::NoSnapshotHeld);
        }
        let held = Superblock::decode(self.tm.read(h, BlockKind::Superblock)?);
        btree::del_tree(&mut self.tm, held.mapping_root, TOP)?;
        btree::del_tree(&mut self.tm, held.details_root, DETAILS)?;
        self.tm.dec(h)?;
        self.sb.held_root = 0;
        Ok(())
    }

    /// The transaction manager, for bulk builders (restore, repair).
    pub(crate) fn tm(&mut self) -> &mut TransactionManager {
        &mut self.tm
    }

    /// Add a device whose mapping tree was built elsewhere (restore): `root` and
    /// its references are taken over.
    pub(crate) fn adopt_device(&mut self, dev: u64, root: u64, d: DeviceDetails) -> Result<()> {
        if self.details.contains_key(&dev) {
            return Err(ThinError::DeviceExists(dev));
        }
        self.set_top(dev, root)?;
        self.put_details(dev, d);
        Ok(())
    }

    pub(crate) fn set_data_block_size(&mut self, s: u32) -> Result<()> {
        check_data_block_size(s)?;
        self.sb.data_block_size = s;
        Ok(())
    }

    /// Set reference counts to what the trees hold (thin_check --auto-repair of
    /// leaked blocks): `(block, expected count)` for the data and metadata maps.
    /// Takes effect at the next commit.
    pub fn repair_counts(&mut self, data: &[(u64, u32)], meta: &[(u64, u32)]) -> Result<()> {
        for &(b, c) in data {
            self.tm.data.set(b, c)?;
        }
        for &(b, c) in meta {
            self.tm.meta.set(b, c)?;
        }
        Ok(())
    }

    /// Blocks waiting to be written (for tests and memory accounting).
    pub fn dirty_blocks(&self) -> usize {
        self.tm.cache.dirty_count()
    }
}
