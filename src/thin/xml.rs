//! The thin_dump / thin_restore XML format: a small writer and a tolerant
//! reader for exactly the elements thin-provisioning-tools emit.

use super::error::{Result, ThinError};
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
    /// (virtual block, data block, time), ascending by virtual block.
    pub mappings: Vec<(u64, u64, u32)>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct XmlMetadata {
    pub superblock: XmlSuperblock,
    pub devices: Vec<XmlDevice>,
}

pub fn superblock_open(sb: &XmlSuperblock) -> String {
    format!(
        "<superblock uuid=\"{}\" time=\"{}\" transaction=\"{}\" flags=\"{}\" version=\"{}\" data_block_size=\"{}\" nr_data_blocks=\"{}\">\n",
        sb.uuid, sb.time, sb.transaction, sb.flags, sb.version, sb.data_block_size, sb.nr_data_blocks
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

pub fn write(md: &XmlMetadata) -> String {
    let mut out = superblock_open(&md.superblock);
    for d in &md.devices {
        out.push_str(&device_open(d));
        let mut rw = RangeWriter::default();
        for &(v, b, t) in &d.mappings {
            rw.push(&mut out, v, b, t);
        }
        rw.flush(&mut out);
        out.push_str("  </device>\n");
    }
    out.push_str("</superblock>\n");
    out
}

struct Tag<'a> {
    name: &'a str,
    closing: bool,
    attrs: HashMap<&'a str, &'a str>,
    line: usize,
}

impl Tag<'_> {
    fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let v = self
            .attrs
            .get(key)
            .ok_or_else(|| ThinError::Invalid(format!("line {}: <{}> lacks {key}", self.line, self.name)))?;
        v.parse()
            .map_err(|_| ThinError::Invalid(format!("line {}: {key}=\"{v}\" is not a number", self.line)))
    }
    fn num_or<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T> {
        if self.attrs.contains_key(key) {
            self.num(key)
        } else {
            Ok(default)
        }
    }
}

fn tags(text: &str) -> impl Iterator<Item = Result<Tag<'_>>> {
    let mut rest = text;
    let mut line = 1;
    std::iter::from_fn(move || loop {
        let start = rest.find('<')?;
        line += rest[..start].matches('\n').count();
        let Some(len) = rest[start..].find('>') else {
            return Some(Err(ThinError::Invalid(format!("line {line}: unterminated tag"))));
        };
        let body = &rest[start + 1..start + len];
        rest = &rest[start + len + 1..];
        if body.starts_with('?') || body.starts_with('!') {
            continue;
        }
        let closing = body.starts_with('/');
        let body = body.trim_start_matches('/').trim_end_matches('/');
        let mut parts = body.splitn(2, char::is_whitespace);
        let name = parts.next().unwrap_or("");
        let mut attrs = HashMap::new();
        let mut a = parts.next().unwrap_or("").trim();
        while let Some(eq) = a.find('=') {
            let key = a[..eq].trim();
            let after = a[eq + 1..].trim_start();
            let q = after.chars().next().unwrap_or('"');
            let after = &after[q.len_utf8().min(after.len())..];
            let end = after.find(q).unwrap_or(after.len());
            attrs.insert(key, &after[..end]);
            a = after[(end + 1).min(after.len())..].trim_start();
        }
        return Some(Ok(Tag {
            name,
            closing,
            attrs,
            line,
        }));
    })
}

pub fn parse(text: &str) -> Result<XmlMetadata> {
    let mut md = XmlMetadata::default();
    let mut seen_sb = false;
    let mut cur: Option<XmlDevice> = None;
    for tag in tags(text) {
        let tag = tag?;
        match (tag.name, tag.closing) {
            ("superblock", false) => {
                seen_sb = true;
                md.superblock = XmlSuperblock {
                    uuid: tag.attrs.get("uuid").unwrap_or(&"").to_string(),
                    time: tag.num("time")?,
                    transaction: tag.num("transaction")?,
                    flags: tag.num_or("flags", 0)?,
                    version: tag.num_or("version", 1)?,
                    data_block_size: tag.num("data_block_size")?,
                    nr_data_blocks: tag.num("nr_data_blocks")?,
                };
            }
            ("device", false) => {
                cur = Some(XmlDevice {
                    dev_id: tag.num("dev_id")?,
                    mapped_blocks: tag.num_or("mapped_blocks", 0)?,
                    transaction: tag.num_or("transaction", 0)?,
                    creation_time: tag.num_or("creation_time", 0)?,
                    snap_time: tag.num_or("snap_time", 0)?,
                    mappings: Vec::new(),
                });
            }
            ("device", true) => {
                if let Some(d) = cur.take() {
                    md.devices.push(d);
                }
            }
            ("single_mapping", false) | ("range_mapping", false) => {
                let d = cur.as_mut().ok_or_else(|| {
                    ThinError::Invalid(format!("line {}: mapping outside a device", tag.line))
                })?;
                let t: u32 = tag.num("time")?;
                if tag.name == "single_mapping" {
                    d.mappings
                        .push((tag.num("origin_block")?, tag.num("data_block")?, t));
                } else {
                    let (o, b, n): (u64, u64, u64) = (
                        tag.num("origin_begin")?,
                        tag.num("data_begin")?,
                        tag.num("length")?,
                    );
                    if o.checked_add(n).is_none() || b.checked_add(n).is_none() {
                        return Err(ThinError::Invalid(format!(
                            "line {}: range_mapping overflows",
                            tag.line
                        )));
                    }
                    for i in 0..n {
                        d.mappings.push((o + i, b + i, t));
                    }
                }
            }
            _ => {}
        }
    }
    if !seen_sb {
        return Err(ThinError::Invalid("no <superblock> element".into()));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let text = "<superblock uuid=\"\" time=\"3\" transaction=\"7\" flags=\"0\" version=\"2\" data_block_size=\"128\" nr_data_blocks=\"20000\">\n  <device dev_id=\"1\" mapped_blocks=\"4\" transaction=\"0\" creation_time=\"0\" snap_time=\"2\">\n    <range_mapping origin_begin=\"0\" data_begin=\"0\" length=\"3\" time=\"0\"/>\n    <single_mapping origin_block=\"10\" data_block=\"7\" time=\"2\"/>\n  </device>\n</superblock>\n";
        let md = parse(text).unwrap();
        assert_eq!(md.devices[0].mappings.len(), 4);
        assert_eq!(write(&md), text);
    }
}
