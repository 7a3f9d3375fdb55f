//! The cache_dump / cache_restore XML format, as 1.x writes it: a
//! `<superblock>` (uuid, block_size, nr_cache_blocks, policy, hint_width), the
//! valid `<mapping>`s in cache block order, and a `<hint>` (base64 of its
//! bytes) for each mapped cache block the hint array covers. 1.x's
//! `<discards>` section is read and ignored, as 1.x does. Errors name the line.

use super::error::{CacheError, Result};
use super::metadata::{Mapping, Seen};
use crate::pdata::xml::{at, decimal, plain_attrs};
use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;
use std::borrow::Cow;
use std::io::Write;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlSuperblock {
    pub uuid: String,
    pub block_size: u32,
    pub nr_cache_blocks: u32,
    pub policy: String,
    pub hint_width: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlCache {
    pub sb: XmlSuperblock,
    /// Valid mappings, in cache block order.
    pub mappings: Vec<Mapping>,
    /// (cache block, hint), in cache block order.
    pub hints: Vec<(u32, u32)>,
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

const NOT_B64: u8 = 0xff;

/// Each byte's value as a base64 digit, or [`NOT_B64`].
const UNB64: [u8; 256] = {
    let mut t = [NOT_B64; 256];
    let mut i = 0;
    while i < 64 {
        t[B64[i] as usize] = i as u8;
        i += 1;
    }
    t
};

/// Standard base64 with padding (how 1.x writes a hint's bytes).
pub fn base64(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                s.push(B64[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// The bytes of standard base64 (padding required, as 1.x writes it).
pub fn unbase64(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    for (k, q) in s.chunks(4).enumerate() {
        let last = k == s.len() / 4 - 1;
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && !last) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            let v = UNB64[c as usize];
            if v == NOT_B64 {
                return None;
            }
            n = n << 6 | v as u32;
        }
        n <<= 6 * pad as u32;
        out.extend_from_slice(&[(n >> 16) as u8, (n >> 8) as u8, n as u8][..3 - pad]);
    }
    Some(out)
}

/// The `<superblock ...>` line and the `<mappings>` line.
pub fn head(sb: &XmlSuperblock) -> String {
    format!(
        "<superblock uuid=\"{}\" block_size=\"{}\" nr_cache_blocks=\"{}\" policy=\"{}\" hint_width=\"{}\">\n  <mappings>\n",
        quick_xml::escape::escape(sb.uuid.as_str()),
        sb.block_size,
        sb.nr_cache_blocks,
        quick_xml::escape::escape(sb.policy.as_str()),
        sb.hint_width
    )
}

pub fn write_mapping(out: &mut dyn Write, m: &Mapping) -> std::io::Result<()> {
    writeln!(
        out,
        "    <mapping cache_block=\"{}\" origin_block=\"{}\" dirty=\"{}\"/>",
        m.cblock, m.oblock, m.dirty
    )
}

/// Between the mappings and the hints.
pub const MIDDLE: &str = "  </mappings>\n  <hints>\n";

pub fn write_hint(out: &mut dyn Write, cblock: u32, hint: u32) -> std::io::Result<()> {
    writeln!(
        out,
        "    <hint cache_block=\"{cblock}\" data=\"{}\"/>",
        base64(&hint.to_le_bytes())
    )
}

/// The end of the document (no newline after the last line, as 1.x).
pub const TAIL: &str = "  </hints>\n</superblock>";

/// The whole document.
pub fn write(md: &XmlCache, out: &mut dyn Write) -> std::io::Result<()> {
    out.write_all(head(&md.sb).as_bytes())?;
    for m in &md.mappings {
        write_mapping(out, m)?;
    }
    out.write_all(MIDDLE.as_bytes())?;
    for &(c, h) in &md.hints {
        write_hint(out, c, h)?;
    }
    out.write_all(TAIL.as_bytes())
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum In {
    Nowhere,
    Superblock,
    Mappings,
    Hints,
    Discards,
    Done,
}

fn bad(line: usize, what: impl std::fmt::Display) -> CacheError {
    at(line, what)
}

/// The attributes `keys` of element `e`, a `<tag>` (each required), as they
/// are in the input (nothing is copied but what entities change).
fn attrs<'a, const N: usize>(
    e: &'a BytesStart,
    tag: &str,
    keys: [&str; N],
    line: usize,
) -> Result<[Cow<'a, [u8]>; N]> {
    if let Some(v) = plain_attrs(e.attributes_raw(), keys) {
        return Ok(v.map(Cow::Borrowed));
    }
    let mut out: [Option<Cow<'a, [u8]>>; N] = std::array::from_fn(|_| None);
    for a in e.attributes() {
        let a = a.map_err(|err| bad(line, format!("<{tag}>: {err}")))?;
        match keys.iter().position(|k| k.as_bytes() == a.key.as_ref()) {
            Some(i) => out[i] = Some(a.value),
            None => {
                let k = String::from_utf8_lossy(a.key.as_ref());
                return Err(bad(line, format!("unknown attribute '{k}' in tag '{tag}'")));
            }
        }
    }
    let mut res: [Cow<'a, [u8]>; N] = std::array::from_fn(|_| Cow::Borrowed(&[][..]));
    for (i, v) in out.into_iter().enumerate() {
        res[i] = v.ok_or_else(|| bad(line, format!("missing attribute '{}' for tag '{tag}'", keys[i])))?;
    }
    Ok(res)
}

/// Read cache XML. Every cache block must be below nr_cache_blocks and appear
/// at most once among the mappings and once among the hints; no origin block
/// may be mapped twice; a hint is as wide as the hint array (4 bytes).
pub fn parse(r: impl std::io::BufRead) -> Result<XmlCache> {
    let mut reader = Reader::from_reader(r);
    reader.config_mut().check_end_names = true;
    let mut buf = Vec::new();
    let mut line = 1usize;
    let mut md = XmlCache::default();
    let mut inside = In::Nowhere;
    loop {
        buf.clear();
        let ev = reader.read_event_into(&mut buf).map_err(|e| match e {
            quick_xml::Error::Io(io) => CacheError::Plain(format!("reading XML: {io}")),
            e => bad(line, e),
        })?;
        let (e, empty) = match &ev {
            Event::Start(e) => (e, false),
            Event::Empty(e) => (e, true),
            Event::End(e) => {
                inside = match (e.name().as_ref(), inside) {
                    (b"superblock", In::Superblock) => In::Done,
                    (b"mappings", In::Mappings) | (b"hints", In::Hints) | (b"discards", In::Discards) => {
                        In::Superblock
                    }
                    (name, _) => {
                        return Err(bad(
                            line,
                            format!("unexpected </{}>", String::from_utf8_lossy(name)),
                        ));
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
            _ => return Err(bad(line, "unexpected text")),
        };
        let nr = md.sb.nr_cache_blocks as u64;
        let cblock_of = |v: &[u8]| -> Result<u32> {
            let c = decimal(b"cache_block", v, line)?;
            if c >= nr {
                return Err(bad(
                    line,
                    format!("cache block {c} is beyond nr_cache_blocks ({nr})"),
                ));
            }
            Ok(c as u32)
        };
        match (e.name().as_ref(), inside) {
            (b"superblock", In::Nowhere) if !empty => {
                md.sb = superblock_of(e, line)?;
                inside = In::Superblock;
            }
            (b"superblock", _) => return Err(bad(line, "duplicated superblock")),
            (b"mappings", In::Superblock) if !empty => inside = In::Mappings,
            (b"hints", In::Superblock) if !empty => inside = In::Hints,
            (b"discards", In::Superblock) if !empty => inside = In::Discards,
            (b"mappings" | b"hints" | b"discards", In::Superblock) => {}
            (b"mapping", In::Mappings) => md.mappings.push(mapping_of(e, line, cblock_of)?),
            (b"hint", In::Hints) => {
                let [c, d] = attrs(e, "hint", ["cache_block", "data"], line)?;
                let cblock = cblock_of(&c)?;
                let bytes = unbase64(&d).ok_or_else(|| bad(line, "hint data is not base64"))?;
                let hint: [u8; 4] = bytes.as_slice().try_into().map_err(|_| {
                    bad(
                        line,
                        format!("hint of cache block {cblock} has {} bytes, not 4", bytes.len()),
                    )
                })?;
                md.hints.push((cblock, u32::from_le_bytes(hint)));
            }
            (b"discard", In::Discards) => {}
            (name, _) => {
                return Err(bad(
                    line,
                    format!("unexpected <{}>", String::from_utf8_lossy(name)),
                ))
            }
        }
    }
    if inside != In::Done {
        return Err(CacheError::Plain("incompleted source metadata".into()));
    }
    each_block_once(md)
}

/// A `<mapping>` element (`cblock_of` checks its cache block).
fn mapping_of(e: &BytesStart, line: usize, cblock_of: impl Fn(&[u8]) -> Result<u32>) -> Result<Mapping> {
    let [c, o, d] = attrs(e, "mapping", ["cache_block", "origin_block", "dirty"], line)?;
    let oblock = decimal(b"origin_block", &o, line)?;
    if oblock >= super::superblock::MAX_ORIGIN_BLOCKS {
        return Err(bad(
            line,
            format!("origin block {oblock} does not fit a mapping (48 bits)"),
        ));
    }
    let dirty = match &d[..] {
        b"true" => true,
        b"false" => false,
        v => {
            return Err(bad(
                line,
                format!("dirty=\"{}\" is not true or false", String::from_utf8_lossy(v)),
            ))
        }
    };
    Ok(Mapping {
        cblock: cblock_of(&c)?,
        oblock,
        dirty,
    })
}

/// The `<superblock>` element's attributes, as the cache's superblock holds them.
fn superblock_of(e: &BytesStart, line: usize) -> Result<XmlSuperblock> {
    let [uuid, bs, nr, policy, hw] = attrs(
        e,
        "superblock",
        ["uuid", "block_size", "nr_cache_blocks", "policy", "hint_width"],
        line,
    )?;
    let n32 = |k: &[u8], v: &[u8]| -> Result<u32> {
        u32::try_from(decimal(k, v, line)?).map_err(|_| {
            bad(
                line,
                format!("{} is more than 32 bits", String::from_utf8_lossy(k)),
            )
        })
    };
    let sb = XmlSuperblock {
        uuid: String::from_utf8_lossy(&uuid).into_owned(),
        block_size: n32(b"block_size", &bs)?,
        nr_cache_blocks: n32(b"nr_cache_blocks", &nr)?,
        policy: String::from_utf8_lossy(&policy).into_owned(),
        hint_width: n32(b"hint_width", &hw)?,
    };
    if sb.hint_width != 0 && sb.hint_width != super::superblock::HINT_SIZE {
        return Err(bad(
            line,
            format!("hint_width {} (0 or 4 are supported)", sb.hint_width),
        ));
    }
    if sb.policy.len() >= super::superblock::POLICY_NAME_SIZE {
        return Err(bad(
            line,
            format!("policy name '{}' is longer than 15 bytes", sb.policy),
        ));
    }
    Ok(sb)
}

/// `md` with its mappings and hints sorted by cache block, if no cache block
/// is mapped or hinted twice and no origin block is mapped twice.
fn each_block_once(mut md: XmlCache) -> Result<XmlCache> {
    md.mappings.sort_by_key(|m| m.cblock);
    if let Some(w) = md.mappings.windows(2).find(|w| w[0].cblock == w[1].cblock) {
        return Err(CacheError::Plain(format!(
            "cache block {} is mapped twice",
            w[0].cblock
        )));
    }
    md.hints.sort_by_key(|h| h.0);
    if let Some(w) = md.hints.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(CacheError::Plain(format!("cache block {} has two hints", w[0].0)));
    }
    // the lowest origin block named twice (a bit per origin block, as
    // cache_check finds them); its cache blocks are looked up after
    let mut seen = Seen::of(md.sb.nr_cache_blocks as u64, None);
    let mut twice: Option<u64> = None;
    for m in &md.mappings {
        if seen.insert(m.oblock)? {
            twice = Some(twice.map_or(m.oblock, |t| t.min(m.oblock)));
        }
    }
    let far = seen.far_twice().first().copied();
    if let Some(o) = twice.into_iter().chain(far).min() {
        let mut by = md.mappings.iter().filter(|m| m.oblock == o).map(|m| m.cblock);
        let (a, b) = (by.next().unwrap_or(0), by.next().unwrap_or(0));
        return Err(CacheError::Plain(format!(
            "origin block {o} is mapped by cache blocks {a} and {b}"
        )));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_both_ways() {
        assert_eq!(base64(&[1, 0, 0, 0]), "AQAAAA==");
        assert_eq!(base64(&[1, 2, 3]), "AQID");
        assert_eq!(base64(&[0xff, 0xfe]), "//4=");
        for s in ["AQAAAA==", "AQID", "//4=", ""] {
            assert_eq!(base64(&unbase64(s.as_bytes()).unwrap()), s);
        }
        assert!(unbase64(b"AQA").is_none() && unbase64(b"A===").is_none() && unbase64(b"AQ==AQ==").is_none());
    }

    #[test]
    fn round_trip_and_errors() {
        let text = "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"1100\" policy=\"smq\" hint_width=\"4\">\n  <mappings>\n    <mapping cache_block=\"0\" origin_block=\"10\" dirty=\"true\"/>\n    <mapping cache_block=\"1\" origin_block=\"5\" dirty=\"false\"/>\n  </mappings>\n  <hints>\n    <hint cache_block=\"0\" data=\"AQAAAA==\"/>\n  </hints>\n</superblock>";
        let md = parse(text.as_bytes()).unwrap();
        assert_eq!(
            md.mappings[1],
            Mapping {
                cblock: 1,
                oblock: 5,
                dirty: false
            }
        );
        assert_eq!(md.hints, [(0, 1)]);
        let mut out = Vec::new();
        write(&md, &mut out).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), text);
        let sb = "<superblock uuid=\"\" block_size=\"128\" nr_cache_blocks=\"10\" policy=\"smq\" hint_width=\"4\">";
        for (body, what) in [
            ("<mappings><mapping cache_block=\"10\" origin_block=\"1\" dirty=\"true\"/></mappings></superblock>", "line 1: cache block 10 is beyond nr_cache_blocks (10)"),
            ("<mappings><mapping cache_block=\"1\" origin_block=\"1\" dirty=\"true\"/><mapping cache_block=\"2\" origin_block=\"1\" dirty=\"true\"/></mappings></superblock>", "origin block 1 is mapped by cache blocks 1 and 2"),
            // past the bitset of origin blocks (in its list), and the lowest of two named twice
            ("<mappings><mapping cache_block=\"1\" origin_block=\"5000000\" dirty=\"true\"/><mapping cache_block=\"2\" origin_block=\"5000000\" dirty=\"true\"/></mappings></superblock>", "origin block 5000000 is mapped by cache blocks 1 and 2"),
            ("<mappings><mapping cache_block=\"1\" origin_block=\"9\" dirty=\"true\"/><mapping cache_block=\"2\" origin_block=\"9\" dirty=\"true\"/><mapping cache_block=\"3\" origin_block=\"3\" dirty=\"true\"/><mapping cache_block=\"4\" origin_block=\"3\" dirty=\"true\"/></mappings></superblock>", "origin block 3 is mapped by cache blocks 3 and 4"),
            ("<mappings><mapping cache_block=\"1\" origin_block=\"1\" dirty=\"true\"/><mapping cache_block=\"1\" origin_block=\"2\" dirty=\"true\"/></mappings></superblock>", "cache block 1 is mapped twice"),
            ("<mappings><mapping cache_block=\"1\" origin_block=\"1\" dirty=\"maybe\"/></mappings></superblock>", "dirty=\"maybe\" is not true or false"),
            ("<mappings><mapping cache_block=\"1\" origin_block=\"18446744073709551616\" dirty=\"true\"/></mappings></superblock>", "origin_block=\"18446744073709551616\" is not a number"),
            ("<mappings><mapping cache_block=\"1x\" origin_block=\"1\" dirty=\"true\"/></mappings></superblock>", "cache_block=\"1x\" is not a number"),
            ("<mappings><mapping cache_block=\"\" origin_block=\"1\" dirty=\"true\"/></mappings></superblock>", "cache_block=\"\" is not a number"),
            ("<hints><hint cache_block=\"1\" data=\"AQAAAAAA\"/></hints></superblock>", "has 6 bytes, not 4"),
            ("<mappings><mapping cache_block=\"1\" origin_block=\"1\"/></mappings></superblock>", "missing attribute 'dirty' for tag 'mapping'"),
            ("<mappings>", "incompleted source metadata"),
        ] {
            let e = parse(format!("{sb}{body}").as_bytes()).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
