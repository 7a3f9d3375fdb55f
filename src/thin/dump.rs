//! `thin_dump`: the metadata as thin-provisioning-tools 1.x writes it, XML or
//! human-readable, read straight from the trees (the space maps are not needed,
//! so a dump works even when they are damaged).
//!
//! Leaves that several devices share are written once, as `<def>`s named after
//! their first leaf block and referred to by `<ref>` (see [`super::runs`]): a pool
//! with a hundred snapshots dumps in the size of its distinct mappings.

use super::error::{Result, ThinError};
use super::ir::{plan_of, Header, Overrides, Plan, Visitor};
use super::metadata::read_superblock;
use super::progress::Progress;
use super::runs::Gatherer;
use super::superblock::{unpack_block_time, DeviceDetails, Superblock};
use super::xml::{self, RangeWriter, XmlDevice};
use crate::pdata::btree::{self, node};
use crate::pdata::cache::FastMap;
use crate::pdata::tm::TransactionManager;
use crate::pdata::{BlockKind, MetadataDev, PdataError};
use std::fmt::Write as _;
use std::io::Write;

fn io(e: std::io::Error) -> ThinError {
    ThinError::Output(e)
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

/// The superblock (live, or the held snapshot's) and its devices, with the
/// words the read-only tools (ls, delta, rmap) give when there is none.
pub fn superblock_and_plan(tm: &mut TransactionManager, metadata_snap: bool) -> Result<(Superblock, Plan)> {
    let sb = pick_superblock(tm, metadata_snap).map_err(|e| match superblock_error(e) {
        ThinError::NoSnapshotHeld => ThinError::Plain("no current metadata snap".into()),
        e => e,
    })?;
    let plan = plan_of(tm, &sb)?;
    Ok((sb, plan))
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
    let mut tm = crate::pdata::tm::reader(dev, 1024);
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
    let mut w = Out {
        buf: String::with_capacity(1 << 17),
        out,
    };
    match o.format {
        DumpFormat::Xml => write_plan(&mut tm, &plan, o, &mut XmlSink(&mut w))?,
        DumpFormat::HumanReadable => write_plan(&mut tm, &plan, o, &mut HumanSink(&mut w))?,
    }
    w.out.write_all(w.buf.as_bytes()).map_err(io)?;
    w.out.flush().map_err(io)?;
    Ok(warnings)
}

struct XmlSink<'a, 'b>(&'a mut Out<'b>);

impl Visitor for XmlSink<'_, '_> {
    fn begin(&mut self, h: &Header) -> Result<()> {
        self.0.buf.push_str(&xml::superblock_open(h));
        Ok(())
    }
    fn def_begin(&mut self, name: &str) -> Result<()> {
        let _ = writeln!(self.0.buf, "  <def name=\"{name}\">");
        Ok(())
    }
    fn def_end(&mut self) -> Result<()> {
        self.0.buf.push_str("  </def>\n");
        self.0.spill()
    }
    fn device_begin(&mut self, dev: u64, d: &DeviceDetails) -> Result<()> {
        self.0.buf.push_str(&xml::device_open(&XmlDevice::of(dev, d)));
        Ok(())
    }
    fn device_end(&mut self) -> Result<()> {
        self.0.buf.push_str("  </device>\n");
        self.0.spill()
    }
    fn reference(&mut self, name: &str) -> Result<()> {
        let _ = writeln!(self.0.buf, "    <ref name=\"{name}\"/>");
        Ok(())
    }
    fn run(&mut self, v: u64, d: u64, len: u64, t: u32) -> Result<()> {
        let mut rw = RangeWriter::default();
        rw.run(
            &mut self.0.buf,
            xml::Run {
                origin: v,
                data: d,
                len,
                time: t,
            },
        );
        rw.flush(&mut self.0.buf);
        self.0.spill()
    }
    fn end(&mut self) -> Result<()> {
        self.0.buf.push_str("</superblock>");
        Ok(())
    }
}

struct HumanSink<'a, 'b>(&'a mut Out<'b>);

impl Visitor for HumanSink<'_, '_> {
    fn begin(&mut self, h: &Header) -> Result<()> {
        let _ = writeln!(
            self.0.buf,
            "begin superblock: \"\", {}, {}, {}, {}, {}, {}",
            h.time, h.transaction, h.flags, h.version, h.data_block_size, h.nr_data_blocks
        );
        Ok(())
    }
    fn def_begin(&mut self, name: &str) -> Result<()> {
        let _ = writeln!(self.0.buf, "def: {name}");
        Ok(())
    }
    fn def_end(&mut self) -> Result<()> {
        self.0.buf.push('\n');
        self.0.spill()
    }
    fn device_begin(&mut self, dev: u64, d: &DeviceDetails) -> Result<()> {
        let _ = write!(
            self.0.buf,
            "device: {dev}\nmapped_blocks: {}\ntransaction: {}\ncreation time: {}\nsnap time: {}\n",
            d.mapped_blocks, d.transaction_id, d.creation_time, d.snapshotted_time
        );
        Ok(())
    }
    fn device_end(&mut self) -> Result<()> {
        self.0.buf.push('\n');
        self.0.spill()
    }
    fn reference(&mut self, name: &str) -> Result<()> {
        let _ = writeln!(self.0.buf, "    ref: {name}");
        Ok(())
    }
    fn run(&mut self, v: u64, d: u64, len: u64, t: u32) -> Result<()> {
        let _ = writeln!(
            self.0.buf,
            "    ({v}..{}) -> ({d}..{}), {t}",
            v + len - 1,
            d + len - 1
        );
        self.0.spill()
    }
    fn end(&mut self) -> Result<()> {
        self.0.buf.push_str("end superblock\n");
        Ok(())
    }
}

/// A device's leaves: a stretch of its own (indices into its sequence), or a
/// shared run.
enum Entry {
    Leaves(usize, usize),
    Ref(u64),
}

/// Cut each device's leaf sequence into its own leaves and shared runs; the
/// shared runs (the defs) ascending by first leaf.
fn entries(seqs: &[Vec<u64>]) -> (Vec<Vec<u64>>, Vec<Vec<Entry>>) {
    let mut g = Gatherer::new();
    for s in seqs {
        g.new_seq();
        for &b in s {
            g.next(b);
        }
    }
    let mut runs: FastMap<u64, (usize, bool)> = FastMap::default();
    let mut defs = Vec::new();
    for (r, shared) in g.gather() {
        runs.insert(r[0], (r.len(), shared));
        if shared {
            defs.push(r);
        }
    }
    let per_dev = seqs
        .iter()
        .map(|s| {
            let mut out: Vec<Entry> = Vec::new();
            let mut i = 0;
            while i < s.len() {
                let b = s[i];
                match runs.get(&b) {
                    Some(&(n, true)) => {
                        out.push(Entry::Ref(b));
                        i += n;
                    }
                    other => {
                        let n = other.map_or(1, |&(n, _)| n);
                        let end = (i + n).min(s.len());
                        match out.last_mut() {
                            Some(Entry::Leaves(_, e)) if *e == i => *e = end,
                            _ => out.push(Entry::Leaves(i, end)),
                        }
                        i = end;
                    }
                }
            }
            out
        })
        .collect();
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

/// Walk a plan into a visitor: defs for shared leaf runs, then the devices.
pub fn write_plan(
    tm: &mut TransactionManager,
    plan: &Plan,
    o: &DumpOptions,
    v: &mut dyn Visitor,
) -> Result<()> {
    v.begin(&plan.header)?;
    if o.skip_mappings {
        for (dev, d, _) in &plan.devices {
            v.device_begin(*dev, d)?;
            v.device_end()?;
        }
        return v.end();
    }
    // each distinct root's leaves are found once
    let mut first_with: FastMap<u64, usize> = FastMap::default();
    let mut seqs: Vec<Vec<u64>> = Vec::with_capacity(plan.devices.len());
    for (i, (_, _, root)) in plan.devices.iter().enumerate() {
        let s = match first_with.get(root) {
            Some(&j) => seqs[j].clone(),
            None => {
                first_with.insert(*root, i);
                btree::leaves(tm, *root, 8, o.repair)?.0
            }
        };
        seqs.push(s);
    }
    let (defs, per_dev) = entries(&seqs);
    let total = plan.devices.iter().map(|(_, d, _)| d.mapped_blocks).sum();
    let mut prog = Progress::new("dumping mappings", total, o.progress);
    for def in &defs {
        v.def_begin(&def[0].to_string())?;
        emit_leaves(tm, def, v, o.repair, &mut prog)?;
        v.def_end()?;
    }
    for (((dev, d, _), es), seq) in plan.devices.iter().zip(&per_dev).zip(&seqs) {
        v.device_begin(*dev, d)?;
        for e in es {
            match e {
                Entry::Leaves(a, b) => emit_leaves(tm, &seq[*a..*b], v, o.repair, &mut prog)?,
                Entry::Ref(name) => v.reference(&name.to_string())?,
            }
        }
        v.device_end()?;
    }
    v.end()
}

/// The mappings of `leaves`, merged into runs across leaf boundaries.
fn emit_leaves(
    tm: &mut TransactionManager,
    leaves: &[u64],
    v: &mut dyn Visitor,
    tolerant: bool,
    prog: &mut Progress,
) -> Result<()> {
    let mut run: Option<(u64, u64, u64, u32)> = None;
    let mut buf = Vec::new();
    let mut i = 0;
    while i < leaves.len() {
        // consecutive blocks are read with one I/O
        let mut n = 1;
        while i + n < leaves.len() && n < 64 && leaves[i + n] == leaves[i] + n as u64 {
            n += 1;
        }
        let first = leaves[i];
        i += n;
        let checks = match tm
            .cache
            .read_run_uncached(first, n, BlockKind::BtreeNode, &mut buf)
        {
            Ok(c) => c,
            Err(_) if tolerant => continue,
            Err(e) => return Err(e.into()),
        };
        for (j, ok) in checks.into_iter().enumerate() {
            let l = first + j as u64;
            let d: &crate::pdata::Block =
                match buf[j * crate::pdata::BLOCK_SIZE..(j + 1) * crate::pdata::BLOCK_SIZE].try_into() {
                    Ok(d) => d,
                    Err(_) => continue,
                };
            let sound = ok.and_then(|()| {
                node::check_header(l, d, 8)?;
                if !node::is_leaf(d) {
                    return Err(crate::pdata::error::corrupt(l, "block is not a leaf"));
                }
                Ok(())
            });
            match sound {
                Ok(()) => {}
                Err(_) if tolerant => continue,
                Err(e) => return Err(e.into()),
            }
            let cnt = node::nr_entries(d);
            for e in 0..cnt {
                let k = node::key(d, e);
                let (b, t) = unpack_block_time(node::value_u64(d, e));
                match &mut run {
                    Some((v0, d0, len, t0)) if *v0 + *len == k && *d0 + *len == b && *t0 == t => *len += 1,
                    _ => {
                        if let Some((v0, d0, len, t0)) = run.take() {
                            v.run(v0, d0, len, t0)?;
                        }
                        run = Some((k, b, 1, t));
                    }
                }
            }
            prog.tick(cnt as u64);
        }
    }
    if let Some((v0, d0, len, t0)) = run {
        v.run(v0, d0, len, t0)?;
    }
    Ok(())
}

pub fn dump_to_string(dev: Box<dyn MetadataDev>, metadata_snap: bool) -> Result<String> {
    let mut v = Vec::new();
    dump(dev, metadata_snap, &mut v, false)?;
    String::from_utf8(v).map_err(|e| ThinError::Invalid(e.to_string()))
}
