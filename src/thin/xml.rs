//! The thin_dump / thin_restore XML format. Reading goes through quick-xml
//! (entities decoded, 1.x's shared `<def>`/`<ref>` subtrees); writing is the fixed
//! layout thin_dump prints, with the one free-text attribute (the uuid) escaped.

use super::error::{Result, ThinError};
use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;
use std::collections::HashMap;
use std::fmt::Write as _;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlSuperblock {
    pub uuid: String,
    pub time: u32,
    pub transaction: u64,
    pub flags: u32,
    pub version: u32,
    pub data_block_size: u32,
    pub nr_data_blocks: u64,
}

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
    pub superblock: XmlSuperblock,
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
pub fn superblock_open(sb: &XmlSuperblock) -> String {
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

/// A parse error at a byte offset of the text, reported by line.
fn at(text: &str, pos: u64, what: impl std::fmt::Display) -> ThinError {
    let upto = text.get(..pos as usize).unwrap_or(text);
    let line = upto.matches('\n').count() + 1;
    ThinError::Plain(format!("line {line}: {what}"))
}

/// One element's attributes, decoded (entities included).
struct Attrs {
    name: String,
    pairs: Vec<(String, String)>,
    pos: u64,
}

impl Attrs {
    fn of(text: &str, e: &BytesStart, pos: u64) -> Result<Attrs> {
        let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
        let mut pairs = Vec::new();
        for a in e.attributes() {
            let a = a.map_err(|err| at(text, pos, format!("<{name}>: {err}")))?;
            let k = String::from_utf8_lossy(a.key.as_ref()).into_owned();
            let v = a
                .unescape_value()
                .map_err(|err| at(text, pos, format!("<{name}> {k}: {err}")))?;
            pairs.push((k, v.into_owned()));
        }
        Ok(Attrs { name, pairs, pos })
    }
    fn get(&self, key: &str) -> Option<&str> {
        self.pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
    fn num<T: std::str::FromStr>(&self, text: &str, key: &str) -> Result<T> {
        let v = self
            .get(key)
            .ok_or_else(|| at(text, self.pos, format!("<{}> lacks {key}", self.name)))?;
        v.parse()
            .map_err(|_| at(text, self.pos, format!("{key}=\"{v}\" is not a number")))
    }
    fn num_or<T: std::str::FromStr>(&self, text: &str, key: &str, default: T) -> Result<T> {
        match self.get(key) {
            Some(_) => self.num(text, key),
            None => Ok(default),
        }
    }
    /// A mapping element as a run.
    fn run(&self, text: &str) -> Result<Run> {
        let time = self.num(text, "time")?;
        let r = if self.name == "single_mapping" {
            Run {
                origin: self.num(text, "origin_block")?,
                data: self.num(text, "data_block")?,
                len: 1,
                time,
            }
        } else {
            Run {
                origin: self.num(text, "origin_begin")?,
                data: self.num(text, "data_begin")?,
                len: self.num(text, "length")?,
                time,
            }
        };
        if r.origin.checked_add(r.len).is_none() || r.data.checked_add(r.len).is_none() {
            return Err(at(text, self.pos, format!("<{}> overflows", self.name)));
        }
        Ok(r)
    }
}

/// Where mappings being read go: a device, or a shared subtree (`<def>`).
enum Into_ {
    Nowhere,
    Device(XmlDevice),
    Def(XmlDef),
}

/// Parse thin_dump XML: 0.x's (devices with mappings) and 1.x's, whose devices
/// may share subtrees written once as `<def name=..>` and named by `<ref name=..>`.
/// Errors name the line and say what is wrong, in 1.x's words where it has them.
pub fn parse(text: &str) -> Result<XmlMetadata> {
    let mut md = XmlMetadata::default();
    let mut seen_sb = false;
    let mut closed_sb = false;
    let mut def_index: HashMap<String, usize> = HashMap::new();
    let mut into = Into_::Nowhere;
    let mut r = Reader::from_str(text);
    r.config_mut().check_end_names = true;
    loop {
        let pos = r.buffer_position();
        let ev = r.read_event().map_err(|e| at(text, pos, e))?;
        let (e, closes) = match &ev {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(e) => {
                match (e.name().as_ref(), std::mem::replace(&mut into, Into_::Nowhere)) {
                    (b"device", Into_::Device(d)) => md.devices.push(d),
                    (b"def", Into_::Def(d)) => {
                        def_index.insert(d.name.clone(), md.defs.len());
                        md.defs.push(d);
                    }
                    (b"superblock", Into_::Nowhere) => closed_sb = true,
                    (name, _) => {
                        let name = String::from_utf8_lossy(name);
                        return Err(at(text, pos, format!("unexpected </{name}>")));
                    }
                }
                continue;
            }
            Event::Eof => break,
            Event::Text(t) if t.iter().all(u8::is_ascii_whitespace) => continue,
            Event::Decl(_) | Event::Comment(_) | Event::DocType(_) => continue,
            _ => return Err(at(text, pos, "unexpected text")),
        };
        let a = Attrs::of(text, e, pos)?;
        let nested = |inside: &str| {
            at(
                text,
                pos,
                format!(
                    "Nested subtrees are not allowed '<{}>' within '<{inside}>'",
                    a.name
                ),
            )
        };
        match a.name.as_str() {
            "superblock" => {
                if seen_sb {
                    return Err(at(text, pos, "duplicated superblock"));
                }
                seen_sb = true;
                md.superblock = XmlSuperblock {
                    uuid: a.get("uuid").unwrap_or("").to_string(),
                    time: a.num(text, "time")?,
                    transaction: a.num(text, "transaction")?,
                    flags: a.num_or(text, "flags", 0)?,
                    version: a.num_or(text, "version", 1)?,
                    data_block_size: a.num(text, "data_block_size")?,
                    nr_data_blocks: a.num(text, "nr_data_blocks")?,
                };
                closed_sb = closes;
            }
            "device" | "def" if !seen_sb => return Err(at(text, pos, "missing superblock")),
            "device" => {
                match &into {
                    Into_::Device(_) => return Err(nested("device")),
                    Into_::Def(_) => return Err(nested("def")),
                    Into_::Nowhere => {}
                }
                let d = XmlDevice {
                    dev_id: a.num(text, "dev_id")?,
                    mapped_blocks: a.num_or(text, "mapped_blocks", 0)?,
                    transaction: a.num_or(text, "transaction", 0)?,
                    creation_time: a.num_or(text, "creation_time", 0)?,
                    snap_time: a.num_or(text, "snap_time", 0)?,
                    pieces: Vec::new(),
                };
                if closes {
                    md.devices.push(d);
                } else {
                    into = Into_::Device(d);
                }
            }
            "def" => {
                match &into {
                    Into_::Device(_) => return Err(nested("device")),
                    Into_::Def(_) => return Err(nested("def")),
                    Into_::Nowhere => {}
                }
                let name = a
                    .get("name")
                    .ok_or_else(|| at(text, pos, "missing attribute 'name' for tag 'def'"))?
                    .to_string();
                let d = XmlDef {
                    name,
                    runs: Vec::new(),
                };
                if closes {
                    def_index.insert(d.name.clone(), md.defs.len());
                    md.defs.push(d);
                } else {
                    into = Into_::Def(d);
                }
            }
            "ref" => {
                let name = a
                    .get("name")
                    .ok_or_else(|| at(text, pos, "missing attribute 'name' for tag 'ref'"))?;
                let i = *def_index
                    .get(name)
                    .ok_or_else(|| at(text, pos, format!("Couldn't find sub tree '{name}'.")))?;
                match &mut into {
                    Into_::Device(d) => d.pieces.push(Piece::Ref(i)),
                    _ => {
                        return Err(at(
                            text,
                            pos,
                            "<ref> tags may only occur within <device> sections.",
                        ))
                    }
                }
            }
            "single_mapping" | "range_mapping" => {
                let run = a.run(text)?;
                match &mut into {
                    Into_::Device(d) => d.pieces.push(Piece::Run(run)),
                    Into_::Def(d) => d.runs.push(run),
                    Into_::Nowhere => {
                        return Err(at(
                            text,
                            pos,
                            "Mapping tags must appear within a <def> or <device> tag.",
                        ))
                    }
                }
            }
            other => return Err(at(text, pos, format!("unknown tag <{other}>"))),
        }
    }
    if !seen_sb || !closed_sb || !matches!(into, Into_::Nowhere) {
        return Err(ThinError::Plain("incomplete source metadata".into()));
    }
    Ok(md)
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
            superblock: XmlSuperblock {
                uuid: "a<b&c\"d'e>".into(),
                data_block_size: 128,
                nr_data_blocks: 10,
                ..XmlSuperblock::default()
            },
            ..XmlMetadata::default()
        };
        let text = write(&md);
        assert!(text.contains("uuid=\"a&lt;b&amp;c&quot;d&apos;e&gt;\""), "{text}");
        assert_eq!(parse(&text).unwrap(), md);
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
