//! Table lines: `<start> <length> <target_type> <args...>`, in 512-byte sectors.

use thiserror::Error;

/// One parsed table line, before its target is constructed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableLine {
    /// 1-based line number in the text it came from.
    pub line_no: usize,
    pub start: u64,
    pub len: u64,
    pub target_type: String,
    pub args: Vec<String>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TableError {
    /// Line `line` (from 1) is wrong, or its target refused it with `errno`
    /// (positive; EINVAL for a line the parser refuses).
    #[error("table line {line}: {what}")]
    Line { line: usize, errno: i32, what: String },
    #[error("table is empty")]
    Empty,
}

impl TableError {
    pub fn line(line: usize, what: impl Into<String>) -> TableError {
        TableError::Line {
            line,
            errno: libc::EINVAL,
            what: what.into(),
        }
    }

    /// Line `line`'s target refused it with `errno`.
    pub fn refused(line: usize, errno: i32, what: impl Into<String>) -> TableError {
        TableError::Line {
            line,
            errno,
            what: what.into(),
        }
    }

    /// The errno the dm ioctl answers with.
    pub fn errno(&self) -> i32 {
        match self {
            TableError::Line { errno, .. } => *errno,
            TableError::Empty => libc::EINVAL,
        }
    }
}

/// The kernel's limit on a device's size in sectors (LLONG_MAX >> 9).
pub const MAX_SECTORS: u64 = (i64::MAX as u64) >> 9;

/// Split a line on whitespace, honouring backslash escapes (`\ ` embeds a space).
pub fn split_args(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                cur.push(n);
            }
            in_word = true;
        } else if c.is_whitespace() {
            if in_word {
                out.push(std::mem::take(&mut cur));
                in_word = false;
            }
        } else {
            cur.push(c);
            in_word = true;
        }
    }
    if in_word {
        out.push(cur);
    }
    out
}

/// A word as a table line carries it: a backslash before white space and before
/// a backslash, which [`split_args`] reads back as the word (the kernel's
/// `dm_split_args` escape), so a printed table loads again as it was.
pub fn escape(word: &str) -> std::borrow::Cow<'_, str> {
    if !word.chars().any(|c| c == '\\' || c.is_whitespace()) {
        return std::borrow::Cow::Borrowed(word);
    }
    let mut out = String::with_capacity(word.len() + 4);
    for c in word.chars() {
        if c == '\\' || c.is_whitespace() {
            out.push('\\');
        }
        out.push(c);
    }
    std::borrow::Cow::Owned(out)
}

/// Parse a sector count field of a table line.
pub fn parse_sectors(line: usize, field: &str, v: &str) -> Result<u64, TableError> {
    v.parse::<u64>()
        .map_err(|_| TableError::line(line, format!("{field} '{v}' is not a number of sectors")))
}

/// Parse table text (one target per line; blank lines and `#` comments skipped) and
/// check what the kernel checks of the layout: starts at 0, contiguous, no zero
/// lengths, no overflow.
pub fn parse_table(text: &str) -> Result<Vec<TableLine>, TableError> {
    let mut lines = Vec::new();
    let mut next_start = 0u64;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let trimmed = raw.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut words = split_args(trimmed).into_iter();
        let (Some(s), Some(l), Some(t)) = (words.next(), words.next(), words.next()) else {
            return Err(TableError::line(
                line_no,
                format!("'{trimmed}': expected '<start> <length> <target_type> [args...]'"),
            ));
        };
        let start = parse_sectors(line_no, "start", &s)?;
        let len = parse_sectors(line_no, "length", &l)?;
        if len == 0 {
            return Err(TableError::line(line_no, "zero-length target"));
        }
        if start != next_start {
            let what = if lines.is_empty() {
                format!("first target starts at sector {start}, not 0")
            } else if start > next_start {
                format!("gap in table: target starts at sector {start}, previous target ends at {next_start}")
            } else {
                format!(
                    "overlap in table: target starts at sector {start}, previous target ends at {next_start}"
                )
            };
            return Err(TableError::line(line_no, what));
        }
        let end = start
            .checked_add(len)
            .filter(|e| *e <= MAX_SECTORS)
            .ok_or_else(|| {
                TableError::line(
                    line_no,
                    format!(
                        "target too large: it would end at sector {}, past the largest device ({MAX_SECTORS} sectors, 2^54 - 1)",
                        u128::from(start) + u128::from(len)
                    ),
                )
            })?;
        next_start = end;
        lines.push(TableLine {
            line_no,
            start,
            len,
            target_type: t,
            args: words.collect(),
        });
    }
    if lines.is_empty() {
        return Err(TableError::Empty);
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_escapes() {
        let t = parse_table("0 8 linear /a\\ b 0\n# c\n\n8 8 zero\n").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].args, vec!["/a b".to_string(), "0".to_string()]);
        assert_eq!(t[1].start, 8);
        assert_eq!(t[1].line_no, 4);
    }

    #[test]
    fn escaped_words_split_back() {
        for w in [
            "/a b",
            "tab\there",
            "back\\slash",
            "plain",
            "end\\",
            " lead",
            "a  b",
        ] {
            let line = format!("0 8 linear {} 0", escape(w));
            let t = parse_table(&line).unwrap();
            assert_eq!(t[0].args, vec![w.to_string(), "0".to_string()], "{line}");
        }
        assert!(matches!(escape("plain"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn rejects_layout_errors() {
        let e = |s: &str| parse_table(s).unwrap_err().to_string();
        assert!(e("1 8 zero").contains("first target starts at sector 1"));
        assert!(e("0 8 zero\n9 8 zero").contains("line 2: gap in table"));
        assert!(e("0 8 zero\n7 8 zero").contains("line 2: overlap in table"));
        assert!(e("0 0 zero").contains("zero-length target"));
        assert!(e("x 8 zero").contains("start 'x' is not a number"));
        assert!(e("0 y zero").contains("length 'y' is not a number"));
        assert!(e("0 8").contains("expected '<start> <length> <target_type>"));
        assert!(e("0 18446744073709551615 zero").contains("too large"));
        assert_eq!(parse_table("\n# only\n"), Err(TableError::Empty));
    }
}

/// Input quoted in an error or a log line, bounded: whole when short, else its
/// first and last 40 bytes (at character boundaries) and its length, so no
/// client can make a reply or the log grow with the size of what it sent.
pub fn bounded(text: &str) -> std::borrow::Cow<'_, str> {
    const EDGE: usize = 40;
    if text.len() <= 3 * EDGE {
        return text.into();
    }
    let (head, tail) = ends(text, EDGE, EDGE);
    format!("{}...{} ({} bytes)", &text[..head], &text[tail..], text.len()).into()
}

/// Where the first `head` and the last `tail` bytes of `text` end and begin,
/// moved in to character boundaries (`text` is longer than both).
fn ends(text: &str, head: usize, tail: usize) -> (usize, usize) {
    let mut h = head;
    while !text.is_char_boundary(h) {
        h -= 1;
    }
    let mut t = text.len() - tail;
    while !text.is_char_boundary(t) {
        t += 1;
    }
    (h, t)
}

/// A whole reply or log line built from input, bounded at about 600 bytes: its
/// first 300 and last 200 bytes and its length when longer, so an error that
/// quotes a megabyte of a client's message stays a line.
pub fn bounded_line(text: &str) -> std::borrow::Cow<'_, str> {
    const HEAD: usize = 300;
    const TAIL: usize = 200;
    if text.len() <= HEAD + TAIL + 100 {
        return text.into();
    }
    let (head, tail) = ends(text, HEAD, TAIL);
    format!(
        "{} ...[{} bytes left out]... {}",
        &text[..head],
        tail - head,
        &text[tail..]
    )
    .into()
}

#[cfg(test)]
#[test]
fn bounded_quotes_keep_both_ends_and_say_the_length() {
    assert_eq!(bounded("short"), "short");
    let long = format!("{}{}{}", "a".repeat(50), "b".repeat(1_000_000), "c".repeat(50));
    let q = bounded(&long);
    assert_eq!(
        q,
        format!("{}...{} (1000100 bytes)", "a".repeat(40), "c".repeat(40))
    );
    let wide = "é".repeat(100);
    assert!(bounded(&wide).ends_with("(200 bytes)"));
}
