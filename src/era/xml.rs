//! The era_dump / era_restore XML format, as 1.x writes it: a `<superblock>`
//! (uuid, block_size, nr_blocks, current_era), each writeset with a `<bit>` for
//! every block (1.x's compact `<marked block_begin len>` is read too), and the
//! era array. Reading goes through quick-xml and the thin XML's attribute
//! reader; errors name the line.

use super::error::{EraError, Result};
use crate::pdata::bounds;
use crate::pdata::xml::{at, Attrs};
use quick_xml::events::Event;
use quick_xml::Reader;
use std::io::Write;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlSuperblock {
    pub uuid: String,
    pub block_size: u32,
    pub nr_blocks: u32,
    pub current_era: u32,
}

/// One writeset: its era, its size and its bits as words (as far as the
/// last marked one: the rest are clear).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlWriteset {
    pub era: u32,
    pub nr_bits: u32,
    pub words: Vec<u64>,
}

impl XmlWriteset {
    pub fn marked(&self, b: u32) -> bool {
        self.words
            .get(b as usize / 64)
            .is_some_and(|w| w & (1 << (b % 64)) != 0)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlEra {
    pub sb: XmlSuperblock,
    pub writesets: Vec<XmlWriteset>,
    /// The era array, one entry a block as far as the last the XML gives
    /// (blocks it leaves out are 0).
    pub eras: Vec<u32>,
}

/// The `<superblock ...>` line.
pub fn superblock_open(sb: &XmlSuperblock) -> String {
    format!(
        "<superblock uuid=\"{}\" block_size=\"{}\" nr_blocks=\"{}\" current_era=\"{}\">\n",
        quick_xml::escape::escape(sb.uuid.as_str()),
        sb.block_size,
        sb.nr_blocks,
        sb.current_era
    )
}

/// A writeset as 1.x prints it: a `<bit>` for every block up to the larger
/// of its own size and the superblock's block count.
pub fn write_writeset(out: &mut dyn Write, ws: &XmlWriteset, nr_blocks: u32) -> std::io::Result<()> {
    writeln!(out, "  <writeset era=\"{}\" nr_bits=\"{}\">", ws.era, ws.nr_bits)?;
    for b in 0..nr_blocks.max(ws.nr_bits) {
        let v = b < ws.nr_bits && ws.marked(b);
        writeln!(out, "    <bit block=\"{b}\" value=\"{v}\"/>")?;
    }
    out.write_all(b"  </writeset>\n")
}

/// Entries of the era array from block `first` on.
pub fn write_eras(out: &mut dyn Write, first: u64, eras: &[u32]) -> std::io::Result<()> {
    for (i, e) in eras.iter().enumerate() {
        writeln!(out, "    <era block=\"{}\" era=\"{e}\"/>", first + i as u64)?;
    }
    Ok(())
}

pub const ERA_ARRAY_OPEN: &str = "  <era_array>\n";
/// The era array's end and the document's (no newline after the last line, as 1.x).
pub const CLOSE: &str = "  </era_array>\n</superblock>";

/// The whole document.
pub fn write(md: &XmlEra) -> String {
    let mut out = superblock_open(&md.sb).into_bytes();
    for ws in &md.writesets {
        let _ = write_writeset(&mut out, ws, md.sb.nr_blocks);
    }
    out.extend_from_slice(ERA_ARRAY_OPEN.as_bytes());
    let mut eras = md.eras.clone();
    eras.resize(md.sb.nr_blocks as usize, 0);
    let _ = write_eras(&mut out, 0, &eras);
    out.extend_from_slice(CLOSE.as_bytes());
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(PartialEq, Eq)]
enum In {
    Nowhere,
    Superblock,
    Writeset,
    EraArray,
    Done,
}

/// A `<bit>` or `<marked>` element: its bits set in writeset `ws`.
fn mark_bits(ws: &mut XmlWriteset, a: &Attrs, line: usize) -> Result<()> {
    let (begin, len): (u32, u32) = if a.name == "bit" {
        match a.get("value") {
            Some("true") => (a.num("block")?, 1),
            Some("false") => (a.num("block")?, 0),
            Some(v) => return Err(at(line, format!("value=\"{v}\" is not true or false"))),
            None => return Err(at(line, "missing attribute 'value' for tag 'bit'")),
        }
    } else {
        (a.num("block_begin")?, a.num("len")?)
    };
    let end = begin as u64 + len as u64;
    if len > 0 && end > ws.nr_bits as u64 {
        return Err(at(
            line,
            format!("block {} is beyond the writeset's {} bits", end - 1, ws.nr_bits),
        ));
    }
    if len > 0 {
        bounds::resize(&mut ws.words, 0, "XML writeset bits", (end - 1) / 64 + 1)?;
    }
    for b in begin as u64..end {
        ws.words[b as usize / 64] |= 1 << (b % 64);
    }
    Ok(())
}

/// An `<era>` element: its block's era in the array.
fn set_era(md: &mut XmlEra, a: &Attrs, line: usize) -> Result<()> {
    let block: u32 = a.num("block")?;
    let era: u32 = a.num("era")?;
    let nr = md.sb.nr_blocks;
    if block >= nr {
        return Err(at(line, format!("era of block {block}, beyond the {nr} blocks")));
    }
    if block as usize >= md.eras.len() {
        bounds::resize(&mut md.eras, 0, "XML era block", block as u64 + 1)?;
    }
    md.eras[block as usize] = era;
    Ok(())
}

/// Read era XML. Every size in it is bounded by memory before anything is
/// allocated by it; a bit or era outside its writeset or array is an error.
pub fn parse(r: impl std::io::BufRead) -> Result<XmlEra> {
    let mut reader = Reader::from_reader(r);
    reader.config_mut().check_end_names = true;
    let mut buf = Vec::new();
    let mut line = 1usize;
    let mut md = XmlEra::default();
    let mut inside = In::Nowhere;
    let mut cur: Option<XmlWriteset> = None;
    loop {
        buf.clear();
        let ev = reader.read_event_into(&mut buf).map_err(|e| match e {
            quick_xml::Error::Io(io) => EraError::Plain(format!("reading XML: {io}")),
            e => at(line, e),
        })?;
        let (e, empty) = match &ev {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(e) => {
                inside = match (e.name().as_ref(), inside) {
                    (b"superblock", In::Superblock) => In::Done,
                    (b"writeset", In::Writeset) => {
                        md.writesets.extend(cur.take());
                        In::Superblock
                    }
                    (b"era_array", In::EraArray) => In::Superblock,
                    (name, _) => {
                        let name = String::from_utf8_lossy(name);
                        return Err(at(line, format!("unexpected </{name}>")));
                    }
                };
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
        let a = Attrs::of(e, line)?;
        let bad = |what: String| -> EraError { at(line, what) };
        match (a.name.as_str(), &inside) {
            ("superblock", In::Nowhere) if !empty => {
                md.sb = XmlSuperblock {
                    uuid: a.get("uuid").unwrap_or("").to_string(),
                    block_size: a.num("block_size")?,
                    nr_blocks: a.num("nr_blocks")?,
                    current_era: a.num("current_era")?,
                };
                inside = In::Superblock;
            }
            ("superblock", _) => return Err(bad("duplicated superblock".into())),
            ("writeset", In::Superblock) => {
                let nr_bits: u32 = a.num("nr_bits")?;
                let ws = XmlWriteset {
                    era: a.num("era")?,
                    nr_bits,
                    words: Vec::new(),
                };
                if empty {
                    md.writesets.push(ws);
                } else {
                    cur = Some(ws);
                    inside = In::Writeset;
                }
            }
            ("bit" | "marked", In::Writeset) => {
                let Some(ws) = cur.as_mut() else {
                    return Err(bad("not in writeset".into()));
                };
                mark_bits(ws, &a, line)?;
            }
            ("era_array", In::Superblock) if !empty => inside = In::EraArray,
            ("era_array", In::Superblock) => {}
            ("era", In::EraArray) => set_era(&mut md, &a, line)?,
            (name, _) => return Err(bad(format!("unexpected <{name}>"))),
        }
    }
    if inside != In::Done {
        return Err(EraError::Plain("incompleted source metadata".into()));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_errors() {
        let mut ws = XmlWriteset {
            era: 2,
            nr_bits: 6,
            words: vec![0b1001],
        };
        let md = XmlEra {
            sb: XmlSuperblock {
                uuid: String::new(),
                block_size: 128,
                nr_blocks: 6,
                current_era: 2,
            },
            writesets: vec![ws.clone()],
            eras: vec![1, 1, 0, 0, 1, 0],
        };
        let text = write(&md);
        assert!(text.starts_with(
            "<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"6\" current_era=\"2\">\n  <writeset era=\"2\" nr_bits=\"6\">\n    <bit block=\"0\" value=\"true\"/>\n    <bit block=\"1\" value=\"false\"/>\n"
        ));
        assert!(text.ends_with("    <era block=\"5\" era=\"0\"/>\n  </era_array>\n</superblock>"));
        assert_eq!(parse(text.as_bytes()).unwrap(), md);
        // the compact form reads the same
        let compact = "<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"6\" current_era=\"2\"><writeset era=\"2\" nr_bits=\"6\"><marked block_begin=\"0\" len=\"1\"/><marked block_begin=\"3\" len=\"1\"/></writeset><era_array><era block=\"0\" era=\"1\"/><era block=\"1\" era=\"1\"/><era block=\"4\" era=\"1\"/><era block=\"5\" era=\"0\"/></era_array></superblock>";
        assert_eq!(parse(compact.as_bytes()).unwrap(), md);
        ws.words[0] |= 1 << 5;
        assert!(ws.marked(5) && !ws.marked(64));
        for (bad, what) in [
            ("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"6\" current_era=\"2\">", "incompleted source metadata"),
            ("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"2\" current_era=\"2\"><era_array><era block=\"2\" era=\"1\"/></era_array></superblock>", "line 1: era of block 2, beyond the 2 blocks"),
            ("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"2\" current_era=\"2\"><writeset era=\"1\" nr_bits=\"2\"><bit block=\"2\" value=\"true\"/></writeset></superblock>", "line 1: block 2 is beyond the writeset's 2 bits"),
            ("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"2\" current_era=\"x\"></superblock>", "current_era=\"x\" is not a number"),
            ("<superblock uuid=\"\" block_size=\"128\" nr_blocks=\"4294967295\" current_era=\"1\"><foo/></superblock>", "line 1: unexpected <foo>"),
        ] {
            let e = parse(bad.as_bytes()).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
