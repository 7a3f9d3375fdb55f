//! `thin_restore`: build metadata from a dump. The dump is read as a stream
//! ([`super::xml::parse_into`], or a repair's plan straight from the damaged pool)
//! into a [`Restorer`], which builds each device's mapping tree bottom-up in one
//! pass. A shared subtree (`<def>`) is written once and its leaves are shared by
//! every device that refers to it, as the kernel shares them between snapshots, so
//! a pool with many snapshots restores into the space it had, and nothing of the
//! dump is held in memory but the element being read.

use super::error::{Result, ThinError};
use super::ir::{Header, Overrides, Visitor};
use super::metadata::{FormatOptions, ThinPoolMetadata, BOTTOM};
use super::progress::Progress;
use super::superblock::{pack_block_time, DeviceDetails};
use super::xml::{Piece, XmlMetadata};
use crate::pdata::btree::build::{Builder, NodeRef};
use crate::pdata::btree::node;
use crate::pdata::{BlockKind, MetadataDev};
use std::collections::{BTreeSet, HashMap};

/// The block cache of the pool being built (4 MiB): every block is written once,
/// so a bigger cache only holds more memory.
const RESTORE_CACHE_BLOCKS: usize = 1024;

/// A shared subtree's leaves and the keys they cover.
struct Def {
    leaves: Vec<NodeRef>,
    first: u64,
    last: u64,
    count: u64,
}

/// What is being built: a def's leaves, or a device's tree.
struct Building {
    b: Builder,
    last: Option<u64>,
    first: Option<u64>,
    count: u64,
}

impl Building {
    fn new() -> Building {
        Building {
            b: Builder::new(BOTTOM),
            last: None,
            first: None,
            count: 0,
        }
    }

    /// Keys must ascend: `first..=end` comes after everything so far.
    fn order(&mut self, first: u64, end: u64) -> Result<()> {
        if self.last.is_some_and(|l| l >= first) {
            return Err(ThinError::Plain("keys out of order".into()));
        }
        self.first.get_or_insert(first);
        self.last = Some(end);
        Ok(())
    }
}

/// Builds a pool from a dump's events.
pub struct Restorer {
    dev: Option<Box<dyn MetadataDev>>,
    md: Option<ThinPoolMetadata>,
    o: Overrides,
    nr_data_blocks: u64,
    defs: HashMap<String, Def>,
    def: Option<(String, Building)>,
    device: Option<(u64, DeviceDetails, Building)>,
    seen: BTreeSet<u64>,
    progress: Progress,
}

impl Restorer {
    pub fn new(dev: Box<dyn MetadataDev>, o: Overrides, progress: bool) -> Restorer {
        Restorer {
            dev: Some(dev),
            md: None,
            o,
            nr_data_blocks: 0,
            defs: HashMap::new(),
            def: None,
            device: None,
            seen: BTreeSet::new(),
            progress: Progress::new("restoring mappings", 0, progress),
        }
    }

    fn md(&mut self) -> Result<&mut ThinPoolMetadata> {
        self.md
            .as_mut()
            .ok_or_else(|| ThinError::Plain("missing superblock".into()))
    }

    /// Drop the defs' own references (a def nobody used gives its blocks back),
    /// apply the overrides, commit.
    pub fn finish(mut self) -> Result<ThinPoolMetadata> {
        let mut md = self
            .md
            .take()
            .ok_or_else(|| ThinError::Plain("incomplete source metadata".into()))?;
        for def in self.defs.values() {
            for l in &def.leaves {
                let tm = md.tm();
                if tm.meta.count(l.block) == 1 {
                    let values: Vec<u64> = {
                        let d = tm.read(l.block, BlockKind::BtreeNode)?;
                        (0..node::nr_entries(d)).map(|i| node::value_u64(d, i)).collect()
                    };
                    for v in values {
                        tm.data.dec(v >> 24)?;
                    }
                }
                tm.dec(l.block)?;
            }
        }
        if let Some(t) = self.o.transaction_id {
            let cur = md.transaction_id();
            md.set_transaction_id(cur, cur.max(t))?;
        }
        if let Some(n) = self.o.nr_data_blocks {
            if n > md.nr_data_blocks() {
                md.resize_data_dev(n)?;
            }
        }
        if let Some(s) = self.o.data_block_size {
            md.set_data_block_size(s)
                .map_err(|_| ThinError::Plain("invalid data block size".into()))?;
        }
        md.commit()?;
        Ok(md)
    }
}

impl Visitor for Restorer {
    fn begin(&mut self, h: &Header) -> Result<()> {
        let dev = self
            .dev
            .take()
            .ok_or_else(|| ThinError::Plain("duplicated superblock".into()))?;
        let mut md = ThinPoolMetadata::format_for_restore(
            dev,
            FormatOptions {
                data_block_size: h.data_block_size,
                nr_data_blocks: h.nr_data_blocks,
                cache_blocks: RESTORE_CACHE_BLOCKS,
            },
        )
        .map_err(|e| match e {
            ThinError::DataBlockSize(_) => ThinError::Plain("invalid data block size".into()),
            e => e,
        })?;
        md.set_time(h.time);
        md.set_transaction_id(0, h.transaction)?;
        self.nr_data_blocks = h.nr_data_blocks;
        self.md = Some(md);
        Ok(())
    }

    fn def_begin(&mut self, name: &str) -> Result<()> {
        self.def = Some((name.to_string(), Building::new()));
        Ok(())
    }

    fn def_end(&mut self) -> Result<()> {
        let Some((name, b)) = self.def.take() else {
            return Err(ThinError::Plain("unexpected </def>".into()));
        };
        let leaves = b.b.finish_level(self.md()?.tm())?;
        let def = Def {
            leaves,
            first: b.first.unwrap_or(0),
            last: b.last.unwrap_or(0),
            count: b.count,
        };
        if let Some(old) = self.defs.insert(name, def) {
            // a def redefined: the old one's leaves go when unused
            for l in old.leaves {
                self.md()?.tm().dec(l.block)?;
            }
        }
        Ok(())
    }

    fn device_begin(&mut self, dev: u64, d: &DeviceDetails) -> Result<()> {
        if !self.seen.insert(dev) {
            return Err(ThinError::DeviceExists(dev));
        }
        self.device = Some((dev, *d, Building::new()));
        Ok(())
    }

    fn device_end(&mut self) -> Result<()> {
        let Some((dev, mut d, b)) = self.device.take() else {
            return Err(ThinError::Plain("unexpected </device>".into()));
        };
        let md = self.md()?;
        let root = b.b.finish(md.tm())?;
        d.mapped_blocks = b.count;
        md.adopt_device(dev, root, d)
    }

    fn reference(&mut self, name: &str) -> Result<()> {
        let Some(def) = self.defs.get(name) else {
            return Err(ThinError::Plain(format!("Couldn't find sub tree '{name}'.")));
        };
        let Some((_, _, b)) = self.device.as_mut() else {
            return Err(ThinError::Plain(
                "<ref> tags may only occur within <device> sections.".into(),
            ));
        };
        if def.count == 0 {
            return Ok(());
        }
        b.order(def.first, def.last)?;
        b.count += def.count;
        self.progress.tick(def.count);
        let Some(md) = self.md.as_mut() else {
            return Err(ThinError::Plain("missing superblock".into()));
        };
        b.b.push_shared(md.tm(), &def.leaves)?;
        Ok(())
    }

    fn run(&mut self, v: u64, d: u64, len: u64, t: u32) -> Result<()> {
        if len == 0 || d.saturating_add(len) > self.nr_data_blocks {
            return Err(ThinError::Plain("block out of bounds".into()));
        }
        let Some(md) = self.md.as_mut() else {
            return Err(ThinError::Plain("missing superblock".into()));
        };
        let b = match (&mut self.def, &mut self.device) {
            (Some((_, b)), _) => b,
            (None, Some((_, _, b))) => b,
            (None, None) => {
                return Err(ThinError::Plain(
                    "Mapping tags must appear within a <def> or <device> tag.".into(),
                ))
            }
        };
        b.order(v, v + len - 1)?;
        let tm = md.tm();
        for i in 0..len {
            b.b.push_own(tm, v + i, pack_block_time(d + i, t))?;
        }
        b.count += len;
        self.progress.tick(len);
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        Ok(())
    }
}

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
    let mut r = Restorer::new(dev, *o, progress);
    r.begin(&md_xml.superblock)?;
    for d in &md_xml.defs {
        r.def_begin(&d.name)?;
        for x in &d.runs {
            r.run(x.origin, x.data, x.len, x.time)?;
        }
        r.def_end()?;
    }
    for d in &md_xml.devices {
        r.device_begin(
            d.dev_id,
            &DeviceDetails {
                mapped_blocks: d.mapped_blocks,
                transaction_id: d.transaction,
                creation_time: d.creation_time,
                snapshotted_time: d.snap_time,
            },
        )?;
        for p in &d.pieces {
            match p {
                Piece::Run(x) => r.run(x.origin, x.data, x.len, x.time)?,
                Piece::Ref(i) => {
                    let name = md_xml.defs.get(*i).map(|d| d.name.as_str()).unwrap_or("");
                    r.reference(name)?
                }
            }
        }
        r.device_end()?;
    }
    r.finish()
}
