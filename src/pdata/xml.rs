//! What the thin, cache and era XML readers share: errors that name the line,
//! the attribute fast path, and an element's decoded attributes.

use quick_xml::events::BytesStart;

/// A parse error: the line of the XML and what is wrong there.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {what}")]
pub struct XmlError {
    pub line: usize,
    pub what: String,
}

/// A parse error on a line, as the reader's own error type.
pub fn at<E: From<XmlError>>(line: usize, what: impl std::fmt::Display) -> E {
    XmlError {
        line,
        what: what.to_string(),
    }
    .into()
}

/// A decimal attribute value: digits only, at least one, no overflow; else an
/// error naming the attribute and its value.
pub fn decimal(key: &[u8], v: &[u8], line: usize) -> Result<u64, XmlError> {
    (!v.is_empty())
        .then(|| {
            v.iter().try_fold(0u64, |acc, &d| {
                d.is_ascii_digit()
                    .then(|| acc.checked_mul(10)?.checked_add((d - b'0') as u64))
                    .flatten()
            })
        })
        .flatten()
        .ok_or_else(|| {
            at(
                line,
                format!(
                    "{}=\"{}\" is not a number",
                    String::from_utf8_lossy(key),
                    String::from_utf8_lossy(v)
                ),
            )
        })
}

/// The values of an element's attributes `keys` (each once, nothing else,
/// plain `key="value"` or `key='value'` pairs apart by whitespace, no entity in
/// a value), straight from its raw bytes (`BytesStart::attributes_raw`):
/// quick-xml's attribute iterator costs a restore more than the rest of the
/// tokenising. `None` for anything else; the caller then asks quick-xml, whose
/// errors and decoding are the reference.
pub fn plain_attrs<'a, const N: usize>(raw: &'a [u8], keys: [&str; N]) -> Option<[&'a [u8]; N]> {
    let mut out: [Option<&'a [u8]>; N] = [None; N];
    let mut s = raw;
    // the slot the next attribute fills when they come in `keys`' order (as
    // the tools write them): one key compared instead of a search
    let mut next = 0;
    loop {
        let gap = s.iter().take_while(|c| c.is_ascii_whitespace()).count();
        s = &s[gap..];
        if s.is_empty() || s == b"/" {
            break;
        }
        if gap == 0 {
            return None;
        }
        let eq = s.iter().position(|&c| c == b'=')?;
        let quote = *s.get(eq + 1)?;
        if quote != b'"' && quote != b'\'' {
            return None;
        }
        let rest = &s[eq + 2..];
        // the closing quote, or an entity first (not plain)
        let end = rest.iter().position(|&c| c == quote || c == b'&')?;
        if rest[end] == b'&' {
            return None;
        }
        let value = &rest[..end];
        let key = &s[..eq];
        let slot = match keys.get(next) {
            Some(k) if k.as_bytes() == key => next,
            _ => keys.iter().position(|k| k.as_bytes() == key)?,
        };
        next = slot + 1;
        if out[slot].replace(value).is_some() {
            return None;
        }
        s = &rest[end + 1..];
    }
    let mut res: [&'a [u8]; N] = [&[]; N];
    for (r, v) in res.iter_mut().zip(out) {
        *r = v?;
    }
    Some(res)
}

/// One element's attributes, decoded (entities included).
pub struct Attrs {
    pub name: String,
    pairs: Vec<(String, String)>,
    line: usize,
}

impl Attrs {
    pub fn of(e: &BytesStart, line: usize) -> Result<Attrs, XmlError> {
        let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
        let mut pairs = Vec::new();
        for a in e.attributes() {
            let a = a.map_err(|err| at::<XmlError>(line, format!("<{name}>: {err}")))?;
            let k = String::from_utf8_lossy(a.key.as_ref()).into_owned();
            let v = a
                .unescape_value()
                .map_err(|err| at::<XmlError>(line, format!("<{name}> {k}: {err}")))?;
            pairs.push((k, v.into_owned()));
        }
        Ok(Attrs { name, pairs, line })
    }
    pub fn get(&self, key: &str) -> Option<&str> {
        self.pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
    pub fn num<T: std::str::FromStr>(&self, key: &str) -> Result<T, XmlError> {
        let v = self.get(key).ok_or_else(|| {
            at::<XmlError>(
                self.line,
                format!("missing attribute '{key}' for tag '{}'", self.name),
            )
        })?;
        v.parse()
            .map_err(|_| at::<XmlError>(self.line, format!("{key}=\"{v}\" is not a number")))
    }
    pub fn num_or<T: std::str::FromStr>(&self, key: &str, default: T) -> Result<T, XmlError> {
        match self.get(key) {
            Some(_) => self.num(key),
            None => Ok(default),
        }
    }
}
