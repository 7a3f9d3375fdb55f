//! `thin_dump`-compatible XML output, read straight from the trees (the
//! space maps are not needed, so a dump works even when they are damaged).

use super::error::{Result, ThinError};
use super::metadata::read_superblock;
use super::progress::Progress;
use super::superblock::{unpack_block_time, DeviceDetails, Superblock};
use super::xml::{self, RangeWriter, XmlDevice, XmlSuperblock};
use crate::pdata::btree;
use crate::pdata::cache::BlockCache;
use crate::pdata::space_map::{SmKind, SpaceMap};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{le64, BlockKind, MetadataDev};
use std::collections::BTreeMap;
use std::io::Write;

fn io(e: std::io::Error) -> ThinError {
    ThinError::Invalid(format!("writing output: {e}"))
}

/// A transaction manager for reading only: empty space maps.
pub fn reader(dev: Box<dyn MetadataDev>, cache_blocks: usize) -> TransactionManager {
    TransactionManager::new(
        BlockCache::new(dev, cache_blocks),
        SpaceMap::new(SmKind::Metadata, 0),
        SpaceMap::new(SmKind::Data, 0),
    )
}

/// Which metadata to read: the live superblock's, or a metadata snapshot's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Source {
    #[default]
    Live,
    /// The snapshot the superblock holds.
    HeldSnapshot,
    /// The snapshot at this block (`thin_dump -m BLOCK`).
    SnapshotAt(u64),
}

impl Source {
    pub fn snapshot(held: bool) -> Source {
        if held {
            Source::HeldSnapshot
        } else {
            Source::Live
        }
    }
}

/// The superblock to dump: the live one, or a metadata snapshot.
pub fn pick_superblock(tm: &mut TransactionManager, metadata_snap: bool) -> Result<Superblock> {
    pick(tm, Source::snapshot(metadata_snap))
}

fn pick(tm: &mut TransactionManager, src: Source) -> Result<Superblock> {
    let sb = read_superblock(&mut tm.cache)?;
    let at = match src {
        Source::Live => return Ok(sb),
        Source::HeldSnapshot if sb.held_root == 0 => return Err(ThinError::NoSnapshotHeld),
        Source::HeldSnapshot => sb.held_root,
        Source::SnapshotAt(b) => b,
    };
    Ok(Superblock::decode(tm.read(at, BlockKind::Superblock)?))
}

/// What `dump_with` writes (thin_dump's options).
#[derive(Clone, Copy, Debug, Default)]
pub struct DumpOptions {
    pub source: Source,
    /// Devices without their mappings (`--skip-mappings`).
    pub skip_mappings: bool,
    /// A progress line on stderr if it is a terminal.
    pub progress: bool,
}

/// Write the XML of the live metadata or of the held snapshot; `progress`
/// shows a progress line on stderr if it is a terminal.
pub fn dump(
    dev: Box<dyn MetadataDev>,
    metadata_snap: bool,
    out: &mut dyn Write,
    progress: bool,
) -> Result<()> {
    let o = DumpOptions {
        source: Source::snapshot(metadata_snap),
        skip_mappings: false,
        progress,
    };
    dump_with(dev, o, out)
}

pub fn dump_with(dev: Box<dyn MetadataDev>, o: DumpOptions, out: &mut dyn Write) -> Result<()> {
    let mut tm = reader(dev, 1024);
    let sb = pick(&mut tm, o.source)?;
    let mut details = BTreeMap::new();
    btree::walk(&mut tm, sb.details_root, 24, &mut |k, v| {
        details.insert(k, DeviceDetails::decode(v));
        Ok(())
    })?;
    let mut roots = Vec::new();
    btree::walk(&mut tm, sb.mapping_root, 8, &mut |k, v| {
        roots.push((k, le64(v, 0)));
        Ok(())
    })?;
    let xsb = XmlSuperblock {
        uuid: String::new(),
        time: sb.time,
        transaction: sb.trans_id,
        flags: sb.flags,
        version: sb.version,
        data_block_size: sb.data_block_size,
        nr_data_blocks: sb.data_sm_root.nr_blocks,
    };
    out.write_all(xml::superblock_open(&xsb).as_bytes()).map_err(io)?;
    let total = details.values().map(|d| d.mapped_blocks).sum();
    let mut prog = Progress::new("dumping mappings", total, o.progress);
    for (dev, root) in roots {
        let d = details
            .get(&dev)
            .ok_or_else(|| ThinError::BadSuperblock(format!("device {dev} has mappings but no details")))?;
        let xd = XmlDevice {
            dev_id: dev,
            mapped_blocks: d.mapped_blocks,
            transaction: d.transaction_id,
            creation_time: d.creation_time,
            snap_time: d.snapshotted_time,
            mappings: Vec::new(),
        };
        let mut buf = xml::device_open(&xd);
        if o.skip_mappings {
            buf.push_str("  </device>\n");
            out.write_all(buf.as_bytes()).map_err(io)?;
            continue;
        }
        let mut rw = RangeWriter::default();
        let mut err = None;
        btree::walk(&mut tm, root, 8, &mut |k, v| {
            let (b, t) = unpack_block_time(le64(v, 0));
            rw.push(&mut buf, k, b, t);
            prog.tick(1);
            if buf.len() > 1 << 16 {
                if let Err(e) = out.write_all(buf.as_bytes()) {
                    err = Some(e);
                }
                buf.clear();
            }
            Ok(())
        })?;
        if let Some(e) = err {
            return Err(io(e));
        }
        rw.flush(&mut buf);
        buf.push_str("  </device>\n");
        out.write_all(buf.as_bytes()).map_err(io)?;
    }
    out.write_all(b"</superblock>\n").map_err(io)?;
    Ok(())
}

pub fn dump_to_string(dev: Box<dyn MetadataDev>, metadata_snap: bool) -> Result<String> {
    let mut v = Vec::new();
    dump(dev, metadata_snap, &mut v, false)?;
    String::from_utf8(v).map_err(|e| ThinError::Invalid(e.to_string()))
}
