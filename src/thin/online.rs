//! thin_ls and thin_delta on a live pool: the pool message words
//! (`thin_ls [-o F1,F2] [--no-headers] [-m]`, `thin_delta --thin1 N|--root1 N
//! --thin2 N|--root2 N [--verbose] [-m]`), their parser, and the answer.

use super::delta::{delta_text, DeltaOptions, Side};
use super::ls::{ls_text, LsField, LsOptions};
use crate::pdata::tm::reader;
use crate::pdata::MetadataDev;

/// A tool the pool runs, with its options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Ls(LsOptions),
    Delta(DeltaOptions),
}

impl Request {
    /// The message words for the request ([`parse`] reads them back).
    pub fn words(&self) -> Vec<String> {
        let mut w = Vec::new();
        match self {
            Request::Ls(o) => {
                w.push("thin_ls".to_string());
                if !o.fields.is_empty() {
                    let names: Vec<&str> = o.fields.iter().map(|f| f.name()).collect();
                    w.extend(["-o".to_string(), names.join(",")]);
                }
                if o.no_headers {
                    w.push("--no-headers".into());
                }
                if o.metadata_snap {
                    w.push("-m".into());
                }
            }
            Request::Delta(o) => {
                w.push("thin_delta".to_string());
                for (n, side) in [(1, o.left), (2, o.right)] {
                    match side {
                        Some(Side::Thin(t)) => w.extend([format!("--thin{n}"), t.to_string()]),
                        Some(Side::Root(r)) => w.extend([format!("--root{n}"), r.to_string()]),
                        None => {}
                    }
                }
                if o.verbose {
                    w.push("--verbose".into());
                }
                if o.metadata_snap {
                    w.push("-m".into());
                }
            }
        }
        w
    }
}

/// Read a request from message words; an error names the word at fault.
pub fn parse(words: &[String]) -> Result<Request, String> {
    let (tool, rest) = match words.split_first() {
        Some((t, rest)) => (t.as_str(), rest),
        None => return Err("no tool named".into()),
    };
    let mut it = rest.iter().map(String::as_str);
    match tool {
        "thin_ls" => {
            let mut o = LsOptions::default();
            while let Some(w) = it.next() {
                match w {
                    "-o" | "--format" => {
                        let v = value(tool, w, it.next())?;
                        for name in v.split(',') {
                            let f = LsField::parse(name)
                                .map_err(|_| format!("{tool}: unknown field '{name}' in '{w} {v}'"))?;
                            o.fields.push(f);
                        }
                    }
                    "--no-headers" => o.no_headers = true,
                    "-m" | "--metadata-snap" => o.metadata_snap = true,
                    _ => return Err(format!("{tool}: unknown option '{w}'")),
                }
            }
            Ok(Request::Ls(o))
        }
        "thin_delta" => {
            let mut o = DeltaOptions::default();
            while let Some(w) = it.next() {
                let (slot, side, nth): (&mut Option<Side>, fn(u64) -> Side, u8) = match w {
                    "--thin1" | "--snap1" => (&mut o.left, Side::Thin, 1),
                    "--root1" => (&mut o.left, Side::Root, 1),
                    "--thin2" | "--snap2" => (&mut o.right, Side::Thin, 2),
                    "--root2" => (&mut o.right, Side::Root, 2),
                    "--verbose" => {
                        o.verbose = true;
                        continue;
                    }
                    "-m" | "--metadata-snap" => {
                        o.metadata_snap = true;
                        continue;
                    }
                    _ => return Err(format!("{tool}: unknown option '{w}'")),
                };
                let v = value(tool, w, it.next())?;
                let n = v
                    .parse::<u64>()
                    .map_err(|_| format!("{tool}: '{w}' takes a number, not '{v}'"))?;
                if slot.is_some() {
                    return Err(format!("{tool}: '{w}': side {nth} is given already"));
                }
                *slot = Some(side(n));
            }
            Ok(Request::Delta(o))
        }
        _ => Err(format!("unknown tool '{tool}' (thin_ls or thin_delta)")),
    }
}

/// The value after option `opt`.
fn value<'a>(tool: &str, opt: &str, v: Option<&'a str>) -> Result<&'a str, String> {
    v.ok_or_else(|| format!("{tool}: '{opt}' needs a value"))
}

/// A tool run inside the daemon on a live pool's metadata `dev` (`words`: the
/// tool's name and options, as [`Request::words`] writes them). The text ends
/// in one newline more than the tool prints, which the client takes off.
pub fn online(dev: Box<dyn MetadataDev>, words: &[String]) -> Result<String, String> {
    let request = parse(words)?;
    let mut tm = reader(dev, 4096);
    let r = match &request {
        Request::Ls(o) => ls_text(&mut tm, o),
        Request::Delta(o) => delta_text(&mut tm, o),
    };
    r.map(|t| t + "\n")
        .map_err(|e| e.to_string().trim_end().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split(' ').map(String::from).collect()
    }

    #[test]
    fn valid_words_parse_and_round_trip() {
        let ls = parse(&words("thin_ls -o DEV,MAPPED_BLOCKS --no-headers -m")).unwrap();
        assert_eq!(
            ls,
            Request::Ls(LsOptions {
                fields: vec![LsField::Dev, LsField::MappedBlocks],
                no_headers: true,
                metadata_snap: true,
            })
        );
        assert_eq!(parse(&ls.words()), Ok(ls.clone()));
        assert_eq!(parse(&words("thin_ls")), Ok(Request::Ls(LsOptions::default())));
        let delta = parse(&words("thin_delta --thin1 1 --root2 77 --verbose -m")).unwrap();
        assert_eq!(
            delta,
            Request::Delta(DeltaOptions {
                left: Some(Side::Thin(1)),
                right: Some(Side::Root(77)),
                verbose: true,
                metadata_snap: true,
            })
        );
        assert_eq!(parse(&delta.words()), Ok(delta.clone()));
        assert_eq!(
            delta.words(),
            words("thin_delta --thin1 1 --root2 77 --verbose -m")
        );
    }

    #[test]
    fn malformed_words_are_refused_by_name() {
        let e = |s: &str| parse(&words(s)).unwrap_err();
        assert_eq!(e("thin_ls --foo"), "thin_ls: unknown option '--foo'");
        assert_eq!(e("thin_delta --thin1 1 -x"), "thin_delta: unknown option '-x'");
        assert_eq!(e("thin_ls -o"), "thin_ls: '-o' needs a value");
        assert_eq!(e("thin_delta --thin1"), "thin_delta: '--thin1' needs a value");
        assert_eq!(
            e("thin_ls -o DEV,BOGUS"),
            "thin_ls: unknown field 'BOGUS' in '-o DEV,BOGUS'"
        );
        assert_eq!(
            e("thin_delta --thin1 x1"),
            "thin_delta: '--thin1' takes a number, not 'x1'"
        );
        assert_eq!(
            e("thin_delta --thin1 -1"),
            "thin_delta: '--thin1' takes a number, not '-1'"
        );
        assert_eq!(
            e("thin_delta --thin1 1 --root1 2"),
            "thin_delta: '--root1': side 1 is given already"
        );
        assert_eq!(e("thin_rm -f"), "unknown tool 'thin_rm' (thin_ls or thin_delta)");
        assert_eq!(parse(&[]), Err("no tool named".into()));
    }
}
