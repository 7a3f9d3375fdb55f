//! The intermediate representation the thin tools share: what a dump is
//! made of (superblock fields, devices, runs, shared subtrees), produced by
//! reading a pool's trees, a repair's salvage or an XML file, and consumed by
//! the output formats and by restore.

use super::error::{Result, ThinError};
use super::superblock::{DeviceDetails, Superblock, NEEDS_CHECK};
use crate::pdata::btree;
use crate::pdata::le64;
use crate::pdata::tm::TransactionManager;
use std::collections::BTreeMap;

/// Superblock fields a caller gives (`--transaction-id`, `--data-block-size`,
/// `--nr-data-blocks`). As in 1.x, the transaction id and the number of data
/// blocks only ever grow; the block size replaces the one found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub transaction_id: Option<u64>,
    pub data_block_size: Option<u32>,
    pub nr_data_blocks: Option<u64>,
}

/// The superblock fields a dump writes and a restore reads (the XML
/// `<superblock>` element).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// Written escaped; 1.x stores none, so dumps and parsed files have "".
    pub uuid: String,
    pub time: u32,
    pub transaction: u64,
    pub flags: u32,
    pub version: u32,
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
}

impl Header {
    pub fn of(sb: &Superblock) -> Header {
        Header {
            uuid: String::new(),
            time: sb.time,
            transaction: sb.trans_id,
            flags: sb.flags & NEEDS_CHECK,
            version: sb.version,
            data_block_size: sb.data_block_size,
            nr_data_blocks: sb.data_sm_root.nr_blocks,
        }
    }

    pub fn apply(&mut self, o: &Overrides) {
        if let Some(t) = o.transaction_id {
            self.transaction = self.transaction.max(t);
        }
        if let Some(n) = o.nr_data_blocks {
            self.nr_data_blocks = self.nr_data_blocks.max(n);
        }
        if let Some(s) = o.data_block_size {
            self.data_block_size = s;
        }
    }
}

/// What to dump: the superblock fields, and each device with its details and
/// the root of its mapping tree.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub header: Header,
    pub devices: Vec<(u64, DeviceDetails, u64)>,
}

/// The devices of a superblock's trees, ascending by id.
pub fn plan_of(tm: &mut TransactionManager, sb: &Superblock) -> Result<Plan> {
    let mut details = BTreeMap::new();
    btree::walk(tm, sb.details_root, 24, &mut |k, v| {
        details.insert(k, DeviceDetails::decode(v));
        Ok(())
    })?;
    let mut roots = BTreeMap::new();
    btree::walk(tm, sb.mapping_root, 8, &mut |k, v| {
        roots.insert(k, le64(v, 0));
        Ok(())
    })?;
    if !details.keys().eq(roots.keys()) {
        return Err(ThinError::Plain(
            "Inconsistency between the details tree and the mapping tree".into(),
        ));
    }
    let devices = roots
        .into_iter()
        .filter_map(|(dev, root)| details.get(&dev).map(|d| (dev, *d, root)))
        .collect();
    Ok(Plan {
        header: Header::of(sb),
        devices,
    })
}

/// What a dump is made of, in order: the superblock, the shared subtrees, the
/// devices with their runs and references, the end. The output formats take it,
/// and so does restore (a repair writes a new pool straight from a dump).
pub trait Visitor {
    fn begin(&mut self, h: &Header) -> Result<()>;
    fn def_begin(&mut self, name: &str) -> Result<()>;
    fn def_end(&mut self) -> Result<()>;
    fn device_begin(&mut self, dev: u64, d: &DeviceDetails) -> Result<()>;
    fn device_end(&mut self) -> Result<()>;
    fn reference(&mut self, name: &str) -> Result<()>;
    /// A run: `len` blocks from virtual `v` to data `d` at time `t`.
    fn run(&mut self, v: u64, d: u64, len: u64, t: u32) -> Result<()>;
    fn end(&mut self) -> Result<()>;
}
