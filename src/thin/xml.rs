//! The thin_dump / thin_restore XML format. Reading goes through quick-xml
//! (entities decoded, 1.x's shared `<def>`/`<ref>` subtrees); writing is the fixed
//! layout thin_dump prints, with the one free-text attribute (the uuid) escaped.

use super::error::{Result, ThinError};
use super::ir::{Header, Visitor};
use crate::pdata::xml::{self, Attrs};
use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;
use std::collections::HashMap;
use std::fmt::Write as _;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlDevice {
    pub dev_id: u64,
    pub mapped_blocks: u64,
    pub transaction: u64,
    pub creation_time: u32,
    pub snap_time: u32,
    /// The device's mappings in order: runs of its own, and references to shared
    /// subtrees (`<ref>`), each kept as written, never expanded a block at a time.
    pub pieces: Vec<Piece>,
}

/// Part of a device's mappings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    Run(Run),
    /// The shared subtree `XmlMetadata::defs[i]`.
    Ref(usize),
}

/// A shared subtree: `<def name="..">` with its runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlDef {
    pub name: String,
    pub runs: Vec<Run>,
}

/// `len` consecutive virtual blocks from `origin` mapped to consecutive data blocks
/// from `data`, all with `time`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub origin: u64,
    pub data: u64,
    pub len: u64,
    pub time: u32,
}

impl Run {
    /// Every mapping of the run: (virtual block, data block, time).
    pub fn blocks(self) -> impl Iterator<Item = (u64, u64, u32)> {
        (0..self.len).map(move |i| (self.origin + i, self.data + i, self.time))
    }
}

impl XmlDevice {
    /// A device element, mappings to follow, from its details.
    pub fn of(dev: u64, d: &super::superblock::DeviceDetails) -> XmlDevice {
        XmlDevice {
            dev_id: dev,
            mapped_blocks: d.mapped_blocks,
            transaction: d.transaction_id,
            creation_time: d.creation_time,
            snap_time: d.snapshotted_time,
            pieces: Vec::new(),
        }
    }

    /// A device of runs only.
    pub fn with_runs(mut self, runs: Vec<Run>) -> XmlDevice {
        self.pieces = runs.into_iter().map(Piece::Run).collect();
        self
    }

    /// Runs of the mappings given a block at a time, ascending by virtual block.
    pub fn runs(blocks: &[(u64, u64, u32)]) -> Vec<Run> {
        let mut out: Vec<Run> = Vec::new();
        for &(v, d, t) in blocks {
            match out.last_mut() {
                Some(r) if r.origin + r.len == v && r.data + r.len == d && r.time == t => r.len += 1,
                _ => out.push(Run {
                    origin: v,
                    data: d,
                    len: 1,
                    time: t,
                }),
            }
        }
        out
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlMetadata {
    pub superblock: Header,
    pub defs: Vec<XmlDef>,
    pub devices: Vec<XmlDevice>,
}

impl XmlMetadata {
    /// The runs of a device, shared subtrees expanded, in order.
    pub fn runs_of<'a>(&'a self, d: &'a XmlDevice) -> impl Iterator<Item = Run> + 'a {
        d.pieces.iter().flat_map(move |p| match p {
            Piece::Run(r) => std::slice::from_ref(r).iter().copied(),
            Piece::Ref(i) => self
                .defs
                .get(*i)
                .map(|d| d.runs.as_slice())
                .unwrap_or(&[])
                .iter()
                .copied(),
        })
    }

    /// Every mapping of a device: (virtual block, data block, time).
    pub fn blocks<'a>(&'a self, d: &'a XmlDevice) -> impl Iterator<Item = (u64, u64, u32)> + 'a {
        self.runs_of(d).flat_map(Run::blocks)
    }

    /// The number of mappings of a device.
    pub fn nr_blocks(&self, d: &XmlDevice) -> u64 {
        self.runs_of(d).map(|r| r.len).sum()
    }
}

/// The superblock element as thin_dump 1.x writes it: `flags` only when set.
pub fn superblock_open(sb: &Header) -> String {
    let flags = if sb.flags != 0 {
        format!(" flags=\"{}\"", sb.flags)
    } else {
        String::new()
    };
    format!(
        "<superblock uuid=\"{}\" time=\"{}\" transaction=\"{}\"{flags} version=\"{}\" data_block_size=\"{}\" nr_data_blocks=\"{}\">\n",
        quick_xml::escape::escape(sb.uuid.as_str()),
        sb.time, sb.transaction, sb.version, sb.data_block_size, sb.nr_data_blocks
    )
}

pub fn device_open(d: &XmlDevice) -> String {
    format!(
        "  <device dev_id=\"{}\" mapped_blocks=\"{}\" transaction=\"{}\" creation_time=\"{}\" snap_time=\"{}\">\n",
        d.dev_id, d.mapped_blocks, d.transaction, d.creation_time, d.snap_time
    )
}

/// Merges consecutive mappings into range_mapping lines the way thin_dump does.
#[derive(Default)]
pub struct RangeWriter {
    run: Option<(u64, u64, u64, u32)>,
}

impl RangeWriter {
    pub fn push(&mut self, out: &mut String, v: u64, d: u64, t: u32) {
        if let Some((ov, od, len, ot)) = &mut self.run {
            if *ov + *len == v && *od + *len == d && *ot == t {
                *len += 1;
                return;
            }
        }
        self.flush(out);
        self.run = Some((v, d, 1, t));
    }

    /// A run of mappings, joined to the one before where they continue it.
    pub fn run(&mut self, out: &mut String, r: Run) {
        if let Some((ov, od, len, ot)) = &mut self.run {
            if *ov + *len == r.origin && *od + *len == r.data && *ot == r.time {
                *len += r.len;
                return;
            }
        }
        self.flush(out);
        self.run = Some((r.origin, r.data, r.len, r.time));
    }

    pub fn flush(&mut self, out: &mut String) {
        if let Some((v, d, len, t)) = self.run.take() {
            if len == 1 {
                let _ = writeln!(
                    out,
                    "    <single_mapping origin_block=\"{v}\" data_block=\"{d}\" time=\"{t}\"/>"
                );
            } else {
                let _ = writeln!(
                    out,
                    "    <range_mapping origin_begin=\"{v}\" data_begin=\"{d}\" length=\"{len}\" time=\"{t}\"/>"
                );
            }
        }
    }
}

/// The whole document, as thin_dump 1.x writes it (no newline after the end tag).
pub fn write(md: &XmlMetadata) -> String {
    let mut out = superblock_open(&md.superblock);
    for d in &md.defs {
        let _ = writeln!(
            out,
            "  <def name=\"{}\">",
            quick_xml::escape::escape(d.name.as_str())
        );
        let mut rw = RangeWriter::default();
        for r in &d.runs {
            rw.run(&mut out, *r);
        }
        rw.flush(&mut out);
        out.push_str("  </def>\n");
    }
    for d in &md.devices {
        out.push_str(&device_open(d));
        let mut rw = RangeWriter::default();
        for p in &d.pieces {
            match p {
                Piece::Run(r) => rw.run(&mut out, *r),
                Piece::Ref(i) => {
                    rw.flush(&mut out);
                    let name = md.defs.get(*i).map(|d| d.name.as_str()).unwrap_or("");
                    let _ = writeln!(out, "    <ref name=\"{}\"/>", quick_xml::escape::escape(name));
                }
            }
        }
        rw.flush(&mut out);
        out.push_str("  </device>\n");
    }
    out.push_str("</superblock>");
    out
}

/// A parse error on a line, as a thin error.
fn at(line: usize, what: impl std::fmt::Display) -> ThinError {
    xml::at(line, what)
}

/// A mapping element's run, its attributes parsed without copies (they are
/// plain decimal numbers; anything else is an error naming the line).
fn fast_run(e: &BytesStart, line: usize, single: bool) -> Result<Run> {
    let tag = if single { "single_mapping" } else { "range_mapping" };
    let mut f = [None::<u64>; 4]; // origin, data, length, time
    for a in e.attributes() {
        let a = a.map_err(|err| at(line, format!("<{tag}>: {err}")))?;
        let slot = match (single, a.key.as_ref()) {
            (true, b"origin_block") | (false, b"origin_begin") => 0,
            (true, b"data_block") | (false, b"data_begin") => 1,
            (false, b"length") => 2,
            (_, b"time") => 3,
            (_, k) => {
                let k = String::from_utf8_lossy(k);
                return Err(at(line, format!("unknown attribute '{k}' in tag '{tag}'")));
            }
        };
        f[slot] = Some(xml::decimal(a.key.as_ref(), a.value.as_ref(), line)?);
    }
    let names: [&str; 4] = if single {
        ["origin_block", "data_block", "", "time"]
    } else {
        ["origin_begin", "data_begin", "length", "time"]
    };
    let get =
        |i: usize| f[i].ok_or_else(|| at(line, format!("missing attribute '{}' for tag '{tag}'", names[i])));
    let time = get(3)?;
    let r = Run {
        origin: get(0)?,
        data: get(1)?,
        len: if single { 1 } else { get(2)? },
        time: u32::try_from(time).map_err(|_| at(line, format!("time=\"{time}\" is too large")))?,
    };
    if r.len == 0 || r.origin.checked_add(r.len).is_none() || r.data.checked_add(r.len).is_none() {
        return Err(at(line, format!("<{tag}> has a bad length")));
    }
    Ok(r)
}

#[derive(PartialEq, Eq)]
enum In {
    Nowhere,
    Device,
    Def,
}

/// A mapping element (nearly all of a dump: its numbers read straight from
/// the bytes) given to `v`; `within` a `<def>` or `<device>`, or an error.
fn mapping(e: &BytesStart, line: usize, single: bool, within: bool, v: &mut dyn Visitor) -> Result<()> {
    let run = fast_run(e, line, single)?;
    if !within {
        return Err(at(
            line,
            "Mapping tags must appear within a <def> or <device> tag.",
        ));
    }
    v.run(run.origin, run.data, run.len, run.time)
        .map_err(|e| at(line, e))
}

/// A `<superblock>` element's attributes (its uuid is not kept).
fn header_of(a: &Attrs) -> Result<Header> {
    Ok(Header {
        uuid: String::new(),
        time: a.num("time")?,
        transaction: a.num("transaction")?,
        flags: a.num_or("flags", 0)?,
        version: a.num_or("version", 1)?,
        data_block_size: a.num("data_block_size")?,
        nr_data_blocks: a.num("nr_data_blocks")?,
    })
}

/// A `<device>` element's details (0 where an attribute is left out).
fn details_of(a: &Attrs) -> Result<super::superblock::DeviceDetails> {
    Ok(super::superblock::DeviceDetails {
        mapped_blocks: a.num_or("mapped_blocks", 0)?,
        transaction_id: a.num_or("transaction", 0)?,
        creation_time: a.num_or("creation_time", 0)?,
        snapshotted_time: a.num_or("snap_time", 0)?,
    })
}

/// Read thin_dump XML (0.x's, and 1.x's with shared `<def>`/`<ref>` subtrees) as a
/// stream into `v`: nothing is kept but the element being read, so a dump of any
/// size restores in the memory the new metadata needs. Errors name the line and
/// say what is wrong, in 1.x's words where it has them.
pub fn parse_into(r: impl std::io::BufRead, v: &mut dyn Visitor) -> Result<()> {
    let mut reader = Reader::from_reader(r);
    reader.config_mut().check_end_names = true;
    let mut buf = Vec::with_capacity(1 << 12);
    let mut line = 1usize;
    let (mut seen_sb, mut closed_sb) = (false, false);
    let mut inside = In::Nowhere;
    loop {
        buf.clear();
        let ev = reader.read_event_into(&mut buf).map_err(|e| match e {
            quick_xml::Error::Io(io) => ThinError::Plain(format!("reading XML: {io}")),
            e => at(line, e),
        })?;
        let (e, closes) = match &ev {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(e) => {
                match (e.name().as_ref(), &inside) {
                    (b"device", In::Device) => v.device_end()?,
                    (b"def", In::Def) => v.def_end()?,
                    (b"superblock", In::Nowhere) if seen_sb => closed_sb = true,
                    (name, _) => {
                        let name = String::from_utf8_lossy(name);
                        return Err(at(line, format!("unexpected </{name}>")));
                    }
                }
                inside = In::Nowhere;
                continue;
            }
            Event::Eof => break,
            Event::Text(t) if t.iter().all(u8::is_ascii_whitespace) => {
                line += t.iter().filter(|&&c| c == b'\n').count();
                continue;
            }
            Event::Decl(_) | Event::Comment(_) | Event::DocType(_) => continue,
            _ => return Err(at(line, "unexpected text")),
        };
        let name = e.name();
        let name = name.as_ref();
        if name == b"single_mapping" || name == b"range_mapping" {
            mapping(e, line, name == b"single_mapping", inside != In::Nowhere, v)?;
            continue;
        }
        let a = Attrs::of(e, line)?;
        match a.name.as_str() {
            "superblock" => {
                if seen_sb {
                    return Err(at(line, "duplicated superblock"));
                }
                seen_sb = true;
                v.begin(&header_of(&a)?).map_err(|e| at(line, e))?;
                closed_sb = closes;
            }
            "device" | "def" if !seen_sb => return Err(at(line, "missing superblock")),
            "device" | "def" if inside != In::Nowhere => {
                let within = if inside == In::Device { "device" } else { "def" };
                let nested = format!(
                    "Nested subtrees are not allowed '<{}>' within '<{within}>'",
                    a.name
                );
                return Err(at(line, nested));
            }
            "device" => {
                v.device_begin(a.num("dev_id")?, &details_of(&a)?)
                    .map_err(|e| at(line, e))?;
                if closes {
                    v.device_end().map_err(|e| at(line, e))?;
                } else {
                    inside = In::Device;
                }
            }
            "def" => {
                let name = a
                    .get("name")
                    .ok_or_else(|| at(line, "missing attribute 'name' for tag 'def'"))?;
                v.def_begin(name).map_err(|e| at(line, e))?;
                if closes {
                    v.def_end().map_err(|e| at(line, e))?;
                } else {
                    inside = In::Def;
                }
            }
            "ref" => {
                let name = a
                    .get("name")
                    .ok_or_else(|| at(line, "missing attribute 'name' for tag 'ref'"))?;
                if inside != In::Device {
                    return Err(at(line, "<ref> tags may only occur within <device> sections."));
                }
                v.reference(name).map_err(|e| at(line, e))?;
            }
            other => return Err(at(line, format!("unknown tag <{other}>"))),
        }
    }
    if !seen_sb || !closed_sb || inside != In::Nowhere {
        return Err(ThinError::Plain("incomplete source metadata".into()));
    }
    v.end()
}

/// Collects a document into an [`XmlMetadata`].
#[derive(Default)]
struct Collect {
    md: XmlMetadata,
    defs: HashMap<String, usize>,
    def: Option<XmlDef>,
    dev: Option<XmlDevice>,
}

impl Visitor for Collect {
    fn begin(&mut self, h: &Header) -> Result<()> {
        self.md.superblock = h.clone();
        Ok(())
    }
    fn def_begin(&mut self, name: &str) -> Result<()> {
        self.def = Some(XmlDef {
            name: name.into(),
            runs: Vec::new(),
        });
        Ok(())
    }
    fn def_end(&mut self) -> Result<()> {
        if let Some(d) = self.def.take() {
            self.defs.insert(d.name.clone(), self.md.defs.len());
            self.md.defs.push(d);
        }
        Ok(())
    }
    fn device_begin(&mut self, dev: u64, d: &super::superblock::DeviceDetails) -> Result<()> {
        self.dev = Some(XmlDevice::of(dev, d));
        Ok(())
    }
    fn device_end(&mut self) -> Result<()> {
        if let Some(d) = self.dev.take() {
            self.md.devices.push(d);
        }
        Ok(())
    }
    fn reference(&mut self, name: &str) -> Result<()> {
        let i = *self
            .defs
            .get(name)
            .ok_or_else(|| ThinError::Plain(format!("Couldn't find sub tree '{name}'.")))?;
        if let Some(d) = &mut self.dev {
            d.pieces.push(Piece::Ref(i));
        }
        Ok(())
    }
    fn run(&mut self, v: u64, d: u64, len: u64, t: u32) -> Result<()> {
        let r = Run {
            origin: v,
            data: d,
            len,
            time: t,
        };
        match (&mut self.def, &mut self.dev) {
            (Some(def), _) => def.runs.push(r),
            (None, Some(dev)) => dev.pieces.push(Piece::Run(r)),
            (None, None) => {}
        }
        Ok(())
    }
    fn end(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Parse a whole document into memory (tests, small files; restore streams).
pub fn parse(text: &str) -> Result<XmlMetadata> {
    let mut c = Collect::default();
    parse_into(text.as_bytes(), &mut c)?;
    Ok(c.md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let text = "<superblock uuid=\"\" time=\"3\" transaction=\"7\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"20000\">\n  <device dev_id=\"1\" mapped_blocks=\"4\" transaction=\"0\" creation_time=\"0\" snap_time=\"2\">\n    <range_mapping origin_begin=\"0\" data_begin=\"0\" length=\"3\" time=\"0\"/>\n    <single_mapping origin_block=\"10\" data_block=\"7\" time=\"2\"/>\n  </device>\n</superblock>";
        let md = parse(text).unwrap();
        assert_eq!(md.nr_blocks(&md.devices[0]), 4);
        assert_eq!(md.devices[0].pieces.len(), 2, "ranges stay ranges");
        assert_eq!(write(&md), text);
    }

    #[test]
    fn uuid_is_escaped_and_decoded() {
        let md = XmlMetadata {
            superblock: Header {
                uuid: "a<b&c\"d'e>".into(),
                data_block_size: 128,
                nr_data_blocks: 10,
                ..Header::default()
            },
            ..XmlMetadata::default()
        };
        let text = write(&md);
        assert!(text.contains("uuid=\"a&lt;b&amp;c&quot;d&apos;e&gt;\""), "{text}");
        // 1.x stores no uuid: reading drops it
        assert_eq!(parse(&text).unwrap().superblock.uuid, "");
    }

    #[test]
    fn shared_subtrees_of_thin_dump_1x() {
        let text = r#"<superblock uuid="" time="1" transaction="2" version="2" data_block_size="128" nr_data_blocks="16384">
  <def name="7">
    <range_mapping origin_begin="0" data_begin="10" length="3" time="0"/>
  </def>
  <device dev_id="0" mapped_blocks="4" transaction="0" creation_time="0" snap_time="1">
    <ref name="7"/>
    <single_mapping origin_block="5" data_block="20" time="1"/>
  </device>
  <device dev_id="1" mapped_blocks="3" transaction="0" creation_time="1" snap_time="1">
    <ref name="7"/>
  </device>
</superblock>
"#;
        let md = parse(text).unwrap();
        let blocks: Vec<Vec<(u64, u64, u32)>> = md.devices.iter().map(|d| md.blocks(d).collect()).collect();
        assert_eq!(
            blocks,
            vec![
                vec![(0, 10, 0), (1, 11, 0), (2, 12, 0), (5, 20, 1)],
                vec![(0, 10, 0), (1, 11, 0), (2, 12, 0)],
            ]
        );
        let bad = text.replace(
            "<ref name=\"7\"/>\n  </device>\n</superblock>",
            "<ref name=\"8\"/>\n  </device>\n</superblock>",
        );
        let e = parse(&bad).unwrap_err().to_string();
        assert!(
            e.contains("line 10") && e.contains("Couldn't find sub tree '8'."),
            "{e}"
        );
    }
}
