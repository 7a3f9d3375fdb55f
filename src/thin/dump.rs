//! `thin_dump`: the metadata as thin-provisioning-tools 1.x writes it, XML or
//! human-readable, read straight from the trees (the space maps are not needed,
//! so a dump works even when they are damaged).
//!
//! Leaves that several devices share are written once, as `<def>`s named after
//! their first leaf block and referred to by `<ref>` (see [`super::runs`]): a pool
//! with a hundred snapshots dumps in the size of its distinct mappings.

use super::error::{Result, ThinError};
use super::metadata::read_superblock;
use super::progress::Progress;
use super::runs::Gatherer;
use super::superblock::{unpack_block_time, DeviceDetails, Superblock};
use super::xml::{self, RangeWriter, XmlDevice, XmlSuperblock};
use crate::pdata::btree::{self, node};
use crate::pdata::cache::BlockCache;
use crate::pdata::space_map::{SmKind, SpaceMap};
use crate::pdata::tm::TransactionManager;
use crate::pdata::{le64, BlockKind, MetadataDev, PdataError};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;

fn io(e: std::io::Error) -> ThinError {
    ThinError::Output(e)
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
    /// The snapshot at this block (`thin_dump -m=BLOCK`).
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
    let sb = read_superblock(&mut tm.cache).map_err(superblock_error)?;
    let at = match src {
        Source::Live => return Ok(sb),
        Source::HeldSnapshot if sb.held_root == 0 => return Err(ThinError::NoSnapshotHeld),
        Source::HeldSnapshot => sb.held_root,
        Source::SnapshotAt(b) => b,
    };
    // a snapshot's copy has no space maps (its data size reads 0, as in 1.x)
    Ok(Superblock::decode(tm.read(at, BlockKind::Superblock)?))
}

/// 1.x's word for a superblock that does not check out.
pub fn superblock_error(e: ThinError) -> ThinError {
    match e {
        ThinError::Pdata(PdataError::Checksum { .. }) => {
            ThinError::Plain("bad checksum in superblock".into())
        }
        e => e,
    }
}

/// Superblock fields a caller gives (`--transaction-id`, `--data-block-size`,
/// `--nr-data-blocks`). As in 1.x, the transaction id and the number of data
/// blocks only ever grow; the block size replaces the one found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    pub transaction_id: Option<u64>,
    pub data_block_size: Option<u32>,
    pub nr_data_blocks: Option<u64>,
}

/// The superblock fields a dump writes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
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
            time: sb.time,
            transaction: sb.trans_id,
            flags: sb.flags & super::superblock::NEEDS_CHECK,
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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DumpFormat {
    #[default]
    Xml,
    HumanReadable,
}

/// What `dump_with` writes (thin_dump's options).
#[derive(Clone, Debug, Default)]
pub struct DumpOptions {
    pub source: Source,
    /// Devices without their mappings (`--skip-mappings`).
    pub skip_mappings: bool,
    /// Only these devices (`--dev-id`), if given.
    pub dev_ids: Option<Vec<u64>>,
    pub format: DumpFormat,
    pub overrides: Overrides,
    /// Salvage damaged metadata (`--repair`).
    pub repair: bool,
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
        progress,
        ..DumpOptions::default()
    };
    dump_with(dev, &o, out).map(|_| ())
}

/// Dump as `o` says; returns the warnings a repair gave (for standard error).
pub fn dump_with(dev: Box<dyn MetadataDev>, o: &DumpOptions, out: &mut dyn Write) -> Result<Vec<String>> {
    let mut tm = reader(dev, 1024);
    let (mut plan, warnings) = if o.repair {
        let found = super::repair::salvage(&mut tm, &o.overrides)?;
        (found.plan, found.warnings)
    } else {
        let sb = pick(&mut tm, o.source)?;
        let mut p = plan_of(&mut tm, &sb)?;
        p.header.apply(&o.overrides);
        (p, Vec::new())
    };
    if let (Some(ids), false) = (&o.dev_ids, o.skip_mappings) {
        plan.devices.retain(|(d, _, _)| ids.contains(d));
    }
    let sink: Box<dyn Sink> = match o.format {
        DumpFormat::Xml => Box::new(XmlSink),
        DumpFormat::HumanReadable => Box::new(HumanSink),
    };
    write_plan(&mut tm, &plan, o, sink.as_ref(), out)?;
    Ok(warnings)
}

/// The layout of one output format.
trait Sink {
    fn begin(&self, buf: &mut String, h: &Header);
    fn def_begin(&self, buf: &mut String, name: u64);
    fn def_end(&self, buf: &mut String);
    fn device_begin(&self, buf: &mut String, dev: u64, d: &DeviceDetails);
    fn device_end(&self, buf: &mut String);
    fn reference(&self, buf: &mut String, name: u64);
    /// A run: `len` blocks from virtual `v` to data `d` at time `t`.
    fn run(&self, buf: &mut String, v: u64, d: u64, len: u64, t: u32);
    fn end(&self, buf: &mut String);
}

struct XmlSink;

impl Sink for XmlSink {
    fn begin(&self, buf: &mut String, h: &Header) {
        buf.push_str(&xml::superblock_open(&XmlSuperblock {
            uuid: String::new(),
            time: h.time,
            transaction: h.transaction,
            flags: h.flags,
            version: h.version,
            data_block_size: h.data_block_size,
            nr_data_blocks: h.nr_data_blocks,
        }));
    }
    fn def_begin(&self, buf: &mut String, name: u64) {
        let _ = writeln!(buf, "  <def name=\"{name}\">");
    }
    fn def_end(&self, buf: &mut String) {
        buf.push_str("  </def>\n");
    }
    fn device_begin(&self, buf: &mut String, dev: u64, d: &DeviceDetails) {
        buf.push_str(&xml::device_open(&XmlDevice {
            dev_id: dev,
            mapped_blocks: d.mapped_blocks,
            transaction: d.transaction_id,
            creation_time: d.creation_time,
            snap_time: d.snapshotted_time,
            pieces: Vec::new(),
        }));
    }
    fn device_end(&self, buf: &mut String) {
        buf.push_str("  </device>\n");
    }
    fn reference(&self, buf: &mut String, name: u64) {
        let _ = writeln!(buf, "    <ref name=\"{name}\"/>");
    }
    fn run(&self, buf: &mut String, v: u64, d: u64, len: u64, t: u32) {
        let mut rw = RangeWriter::default();
        rw.run(
            buf,
            xml::Run {
                origin: v,
                data: d,
                len,
                time: t,
            },
        );
        rw.flush(buf);
    }
    fn end(&self, buf: &mut String) {
        buf.push_str("</superblock>");
    }
}

struct HumanSink;

impl Sink for HumanSink {
    fn begin(&self, buf: &mut String, h: &Header) {
        let _ = writeln!(
            buf,
            "begin superblock: \"\", {}, {}, {}, {}, {}, {}",
            h.time, h.transaction, h.flags, h.version, h.data_block_size, h.nr_data_blocks
        );
    }
    fn def_begin(&self, buf: &mut String, name: u64) {
        let _ = writeln!(buf, "def: {name}");
    }
    fn def_end(&self, buf: &mut String) {
        buf.push('\n');
    }
    fn device_begin(&self, buf: &mut String, dev: u64, d: &DeviceDetails) {
        let _ = write!(
            buf,
            "device: {dev}\nmapped_blocks: {}\ntransaction: {}\ncreation time: {}\nsnap time: {}\n",
            d.mapped_blocks, d.transaction_id, d.creation_time, d.snapshotted_time
        );
    }
    fn device_end(&self, buf: &mut String) {
        buf.push('\n');
    }
    fn reference(&self, buf: &mut String, name: u64) {
        let _ = writeln!(buf, "    ref: {name}");
    }
    fn run(&self, buf: &mut String, v: u64, d: u64, len: u64, t: u32) {
        let _ = writeln!(buf, "    ({v}..{}) -> ({d}..{}), {t}", v + len - 1, d + len - 1);
    }
    fn end(&self, buf: &mut String) {
        buf.push_str("end superblock\n");
    }
}

/// A device's (or a def's) leaves: runs of its own, and shared runs.
enum Entry {
    Leaves(Vec<u64>),
    Ref(u64),
}

/// Cut each device's leaf sequence into its own leaves and shared runs.
fn entries(seqs: &[Vec<u64>]) -> (Vec<Vec<u64>>, Vec<Vec<Entry>>) {
    let mut g = Gatherer::new();
    for s in seqs {
        g.new_seq();
        for &b in s {
            g.next(b);
        }
    }
    let runs: BTreeMap<u64, (Vec<u64>, bool)> =
        g.gather().into_iter().map(|(r, sh)| (r[0], (r, sh))).collect();
    let per_dev = seqs
        .iter()
        .map(|s| {
            let mut out: Vec<Entry> = Vec::new();
            let mut i = 0;
            while i < s.len() {
                let b = s[i];
                match runs.get(&b) {
                    Some((run, true)) => {
                        out.push(Entry::Ref(b));
                        i += run.len();
                    }
                    other => {
                        let n = other.map_or(1, |(run, _)| run.len());
                        let take = &s[i..(i + n).min(s.len())];
                        match out.last_mut() {
                            Some(Entry::Leaves(v)) => v.extend_from_slice(take),
                            _ => out.push(Entry::Leaves(take.to_vec())),
                        }
                        i += n;
                    }
                }
            }
            out
        })
        .collect();
    let defs = runs.into_values().filter(|(_, sh)| *sh).map(|(r, _)| r).collect();
    (defs, per_dev)
}

/// Writes through a buffer, flushed to `out` when it grows.
struct Out<'a> {
    buf: String,
    out: &'a mut dyn Write,
}

impl Out<'_> {
    fn spill(&mut self) -> Result<()> {
        if self.buf.len() > 1 << 16 {
            self.out.write_all(self.buf.as_bytes()).map_err(io)?;
            self.buf.clear();
        }
        Ok(())
    }
}

fn write_plan(
    tm: &mut TransactionManager,
    plan: &Plan,
    o: &DumpOptions,
    sink: &dyn Sink,
    out: &mut dyn Write,
) -> Result<()> {
    let mut w = Out {
        buf: String::with_capacity(1 << 17),
        out,
    };
    sink.begin(&mut w.buf, &plan.header);
    if o.skip_mappings {
        for (dev, d, _) in &plan.devices {
            sink.device_begin(&mut w.buf, *dev, d);
            sink.device_end(&mut w.buf);
        }
    } else {
        // each distinct root's leaves, once
        let mut by_root: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (_, _, root) in &plan.devices {
            if !by_root.contains_key(root) {
                let (l, _) = btree::leaves(tm, *root, 8, o.repair)?;
                by_root.insert(*root, l);
            }
        }
        let seqs: Vec<Vec<u64>> = plan
            .devices
            .iter()
            .map(|(_, _, r)| by_root.get(r).cloned().unwrap_or_default())
            .collect();
        drop(by_root);
        let (defs, per_dev) = entries(&seqs);
        let total = plan.devices.iter().map(|(_, d, _)| d.mapped_blocks).sum();
        let mut prog = Progress::new("dumping mappings", total, o.progress);
        for def in &defs {
            sink.def_begin(&mut w.buf, def[0]);
            emit_leaves(tm, def, sink, &mut w, o.repair, &mut prog)?;
            sink.def_end(&mut w.buf);
        }
        for ((dev, d, _), es) in plan.devices.iter().zip(&per_dev) {
            sink.device_begin(&mut w.buf, *dev, d);
            for e in es {
                match e {
                    Entry::Leaves(l) => emit_leaves(tm, l, sink, &mut w, o.repair, &mut prog)?,
                    Entry::Ref(name) => sink.reference(&mut w.buf, *name),
                }
            }
            sink.device_end(&mut w.buf);
            w.spill()?;
        }
    }
    sink.end(&mut w.buf);
    w.out.write_all(w.buf.as_bytes()).map_err(io)?;
    w.out.flush().map_err(io)?;
    Ok(())
}

/// The mappings of `leaves`, merged into runs across leaf boundaries.
fn emit_leaves(
    tm: &mut TransactionManager,
    leaves: &[u64],
    sink: &dyn Sink,
    w: &mut Out,
    tolerant: bool,
    prog: &mut Progress,
) -> Result<()> {
    let mut run: Option<(u64, u64, u64, u32)> = None;
    for &l in leaves {
        let d = match tm.read(l, BlockKind::BtreeNode).and_then(|d| {
            node::check_header(l, d, 8)?;
            if !node::is_leaf(d) {
                return Err(crate::pdata::error::corrupt(l, "block is not a leaf"));
            }
            Ok(d)
        }) {
            Ok(d) => d,
            Err(_) if tolerant => continue,
            Err(e) => return Err(e.into()),
        };
        let n = node::nr_entries(d);
        for i in 0..n {
            let k = node::key(d, i);
            let (b, t) = unpack_block_time(node::value_u64(d, i));
            match &mut run {
                Some((v0, d0, len, t0)) if *v0 + *len == k && *d0 + *len == b && *t0 == t => *len += 1,
                _ => {
                    if let Some((v0, d0, len, t0)) = run.take() {
                        sink.run(&mut w.buf, v0, d0, len, t0);
                    }
                    run = Some((k, b, 1, t));
                }
            }
        }
        prog.tick(n as u64);
        w.spill()?;
    }
    if let Some((v0, d0, len, t0)) = run {
        sink.run(&mut w.buf, v0, d0, len, t0);
    }
    Ok(())
}

pub fn dump_to_string(dev: Box<dyn MetadataDev>, metadata_snap: bool) -> Result<String> {
    let mut v = Vec::new();
    dump(dev, metadata_snap, &mut v, false)?;
    String::from_utf8(v).map_err(|e| ThinError::Invalid(e.to_string()))
}
