//! `thin_restore`: build metadata from thin_dump XML. Each device's mapping tree
//! is built bottom-up in one pass; a shared subtree (`<def>`) is written once and
//! its leaves are shared by every device that refers to it, as the kernel shares
//! them between snapshots, so a dump of a pool with many snapshots restores into
//! the space the pool had.

use super::dump::Overrides;
use super::error::{Result, ThinError};
use super::metadata::{FormatOptions, ThinPoolMetadata, BOTTOM, DEFAULT_CACHE_BLOCKS};
use super::progress::Progress;
use super::superblock::{pack_block_time, DeviceDetails};
use super::xml::{Piece, Run, XmlMetadata};
use crate::pdata::btree::build::{self, Builder, NodeRef};
use crate::pdata::btree::node;
use crate::pdata::{BlockKind, MetadataDev};

/// Build `md_xml` on `dev`; `progress` shows a progress line on stderr if it is a terminal.
pub fn restore(md_xml: &XmlMetadata, dev: Box<dyn MetadataDev>, progress: bool) -> Result<ThinPoolMetadata> {
    restore_with(md_xml, dev, &Overrides::default(), progress)
}

/// As [`restore`], with superblock fields the caller gives (thin_restore's
/// `--transaction-id`, `--data-block-size`, `--nr-data-blocks`).
pub fn restore_with(
    md_xml: &XmlMetadata,
    dev: Box<dyn MetadataDev>,
    o: &Overrides,
    progress: bool,
) -> Result<ThinPoolMetadata> {
    let sb = &md_xml.superblock;
    let nr_data_blocks = sb.nr_data_blocks;
    let mut md = ThinPoolMetadata::format(
        dev,
        FormatOptions {
            data_block_size: sb.data_block_size,
            nr_data_blocks,
            cache_blocks: DEFAULT_CACHE_BLOCKS,
        },
    )
    .map_err(|e| match e {
        ThinError::Invalid(s) if s.starts_with("data block size") => {
            ThinError::Plain("invalid data block size".into())
        }
        e => e,
    })?;
    md.set_time(sb.time);
    md.set_transaction_id(0, sb.transaction)?;
    let total = md_xml.devices.iter().map(|d| md_xml.nr_blocks(d)).sum();
    let mut prog = Progress::new("restoring mappings", total, progress);
    let check = |r: &Run| -> Result<()> {
        if r.len == 0 || r.data.saturating_add(r.len) > nr_data_blocks {
            return Err(ThinError::Plain("block out of bounds".into()));
        }
        Ok(())
    };
    // shared subtrees: written once
    let mut defs: Vec<Vec<NodeRef>> = Vec::with_capacity(md_xml.defs.len());
    for d in &md_xml.defs {
        let mut last = None;
        for r in &d.runs {
            check(r)?;
            if last.is_some_and(|l| l >= r.origin) {
                return Err(ThinError::Plain("keys out of order".into()));
            }
            last = Some(r.origin + r.len - 1);
        }
        let entries = d
            .runs
            .iter()
            .flat_map(|r| r.blocks())
            .map(|(v, b, t)| (v, pack_block_time(b, t)));
        defs.push(build::leaves(md.tm(), BOTTOM, entries)?);
    }
    let mut seen = std::collections::BTreeSet::new();
    for d in &md_xml.devices {
        if !seen.insert(d.dev_id) {
            return Err(ThinError::DeviceExists(d.dev_id));
        }
        let mut b = Builder::new(BOTTOM);
        let mut last: Option<u64> = None;
        let mut count = 0u64;
        let mut order = |first: u64, end: u64| -> Result<()> {
            if last.is_some_and(|l| l >= first) {
                return Err(ThinError::Invalid(format!(
                    "device {}: keys out of order at block {first}",
                    d.dev_id
                )));
            }
            last = Some(end);
            Ok(())
        };
        for p in &d.pieces {
            match p {
                Piece::Run(r) => {
                    check(r)?;
                    order(r.origin, r.origin + r.len - 1)?;
                    for (v, db, t) in r.blocks() {
                        b.push_own(md.tm(), v, pack_block_time(db, t))?;
                    }
                    count += r.len;
                    prog.tick(r.len);
                }
                Piece::Ref(i) => {
                    let (Some(leaves), Some(def)) = (defs.get(*i), md_xml.defs.get(*i)) else {
                        return Err(ThinError::Invalid(format!(
                            "device {}: unknown sub tree",
                            d.dev_id
                        )));
                    };
                    if let (Some(f), Some(l)) = (def.runs.first(), def.runs.last()) {
                        order(f.origin, l.origin + l.len - 1)?;
                    }
                    let n: u64 = def.runs.iter().map(|r| r.len).sum();
                    b.push_shared(md.tm(), leaves)?;
                    count += n;
                    prog.tick(n);
                }
            }
        }
        let root = b.finish(md.tm())?;
        md.adopt_device(
            d.dev_id,
            root,
            DeviceDetails {
                mapped_blocks: count,
                transaction_id: d.transaction,
                creation_time: d.creation_time,
                snapshotted_time: d.snap_time,
            },
        )?;
    }
    // the defs' own references go; a def nobody used gives its blocks back
    for leaves in &defs {
        for l in leaves {
            let tm = md.tm();
            let values: Vec<u64> = {
                let d = tm.read(l.block, BlockKind::BtreeNode)?;
                (0..node::nr_entries(d)).map(|i| node::value_u64(d, i)).collect()
            };
            if tm.dec(l.block)? == 0 {
                for v in values {
                    tm.data.dec(v >> 24)?;
                }
            }
        }
    }
    if let Some(t) = o.transaction_id {
        let cur = md.transaction_id();
        md.set_transaction_id(cur, cur.max(t))?;
    }
    if let Some(n) = o.nr_data_blocks {
        if n > md.nr_data_blocks() {
            md.resize_data_dev(n)?;
        }
    }
    if let Some(s) = o.data_block_size {
        md.set_data_block_size(s)
            .map_err(|_| ThinError::Plain("invalid data block size".into()))?;
    }
    md.commit()?;
    Ok(md)
}
