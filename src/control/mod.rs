//! The daemon ⇄ CLI protocol over a unix socket, and the dmsetup verbs it carries.
//!
//! Request: argc (u32 BE), each argument as length (u32 BE) + bytes, then standard
//! input as length + bytes. Reply: status byte (0 ok), stdout text, stderr text, each
//! as length + bytes. The daemon does all parsing and formatting, so every client
//! sees the same output.

use crate::mapper::registry::Registry;
use std::io::{self, Read, Write};

/// Most bytes one request may carry (a table of many thousands of lines fits).
const MAX_REQUEST: u32 = 64 << 20;

fn put(w: &mut Vec<u8>, b: &[u8]) {
    w.extend_from_slice(&(b.len() as u32).to_be_bytes());
    w.extend_from_slice(b);
}

fn get<R: Read>(r: &mut R, budget: &mut u32) -> io::Result<Vec<u8>> {
    let mut l = [0u8; 4];
    r.read_exact(&mut l)?;
    let n = u32::from_be_bytes(l);
    if n > *budget {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control request too large",
        ));
    }
    *budget -= n;
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

/// Client side: send `args` (+ stdin) and return (ok, stdout, stderr).
pub fn call<S: Read + Write>(s: &mut S, args: &[String], stdin: &[u8]) -> io::Result<(bool, String, String)> {
    let mut req = Vec::new();
    req.extend_from_slice(&(args.len() as u32).to_be_bytes());
    for a in args {
        put(&mut req, a.as_bytes());
    }
    put(&mut req, stdin);
    s.write_all(&req)?;
    let mut st = [0u8; 1];
    s.read_exact(&mut st)?;
    let mut budget = u32::MAX;
    let out = get(s, &mut budget)?;
    let err = get(s, &mut budget)?;
    Ok((
        st[0] == 0,
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    ))
}

/// Server side: read one request, run it, write the reply.
pub fn handle<S: Read + Write>(s: &mut S, reg: &Registry) -> io::Result<()> {
    let mut budget = MAX_REQUEST;
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let argc = u32::from_be_bytes(n);
    if argc > 1 << 16 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "too many arguments"));
    }
    let mut args = Vec::with_capacity(argc as usize);
    for _ in 0..argc {
        args.push(String::from_utf8_lossy(&get(s, &mut budget)?).into_owned());
    }
    let stdin = String::from_utf8_lossy(&get(s, &mut budget)?).into_owned();
    let (ok, out, err) = match execute(reg, &args, &stdin) {
        Ok(out) => (true, out, String::new()),
        Err(e) => (false, String::new(), e),
    };
    let mut rep = vec![u8::from(!ok)];
    put(&mut rep, out.as_bytes());
    put(&mut rep, err.as_bytes());
    s.write_all(&rep)
}

/// Arguments of one verb: positional words and `--flag [value]` options.
struct Args<'a> {
    verb: &'a str,
    pos: Vec<&'a str>,
    opts: Vec<(&'a str, Option<&'a str>)>,
}

/// Options that take a value, per verb.
const VALUED: &[&str] = &["--table", "--target", "-u", "--uuid"];
/// Options known without a value.
const FLAGS: &[&str] = &[
    "--readonly",
    "-r",
    "--noflush",
    "--nolockfs",
    "--force",
    "-f",
    "--notable",
];

impl<'a> Args<'a> {
    fn parse(verb: &'a str, raw: &'a [String]) -> Result<Args<'a>, String> {
        let mut a = Args {
            verb,
            pos: Vec::new(),
            opts: Vec::new(),
        };
        let mut i = 0;
        while i < raw.len() {
            let w = raw[i].as_str();
            if verb == "message" && a.pos.len() >= 2 {
                // Message words are passed on as they are, dashes included.
                a.pos.push(w);
            } else if let Some((k, v)) = w.split_once('=').filter(|(k, _)| VALUED.contains(k)) {
                a.opts.push((k, Some(v)));
            } else if VALUED.contains(&w) {
                let v = raw
                    .get(i + 1)
                    .ok_or_else(|| format!("{verb}: option {w} needs a value"))?;
                a.opts.push((w, Some(v.as_str())));
                i += 1;
            } else if FLAGS.contains(&w) {
                a.opts.push((w, None));
            } else if w.starts_with('-') && w.len() > 1 {
                return Err(format!("{verb}: unknown option '{w}'"));
            } else {
                a.pos.push(w);
            }
            i += 1;
        }
        Ok(a)
    }
    fn has(&self, names: &[&str]) -> bool {
        self.opts.iter().any(|(k, _)| names.contains(k))
    }
    fn values(&self, name: &str) -> Vec<&'a str> {
        self.opts
            .iter()
            .filter(|(k, _)| *k == name)
            .filter_map(|(_, v)| *v)
            .collect()
    }
    fn name(&self) -> Result<&'a str, String> {
        self.pos
            .first()
            .copied()
            .ok_or_else(|| format!("{}: device name required", self.verb))
    }
    fn at_most(&self, n: usize) -> Result<(), String> {
        match self.pos.get(n) {
            Some(extra) => Err(format!("{}: unexpected argument '{extra}'", self.verb)),
            None => Ok(()),
        }
    }
    /// The table text: `--table` lines, else standard input.
    fn table(&self, stdin: &str) -> String {
        let t = self.values("--table");
        if t.is_empty() {
            stdin.to_string()
        } else {
            t.join("\n")
        }
    }
}

/// Keep only the lines of targets of type `t` (`--target`).
fn filter_target(out: String, t: Option<&str>) -> String {
    let Some(t) = t else { return out };
    out.lines()
        .filter(|l| {
            let body = l.split_once(": ").map_or(*l, |(_, b)| b);
            body.split(' ').nth(2) == Some(t)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Run one dmsetup-style verb; Ok(stdout) or Err(the one-line error).
pub fn execute(reg: &Registry, args: &[String], stdin: &str) -> Result<String, String> {
    let Some(verb) = args.first() else {
        return Err("no command given".into());
    };
    let a = Args::parse(verb, &args[1..])?;
    let e = |x: crate::mapper::registry::ControlError| x.to_string();
    match verb.as_str() {
        "create" => {
            let name = a.name()?;
            a.at_most(1)?;
            let uuid = a
                .values("-u")
                .into_iter()
                .chain(a.values("--uuid"))
                .next()
                .map(str::to_string);
            reg.create(name, &a.table(stdin), a.has(&["--readonly", "-r"]), uuid)
                .map_err(e)?;
            Ok(String::new())
        }
        "load" | "reload" => {
            let name = a.name()?;
            a.at_most(1)?;
            reg.load(name, &a.table(stdin)).map_err(e)?;
            Ok(String::new())
        }
        "clear" => {
            a.at_most(1)?;
            reg.clear(a.name()?).map_err(e).map(|_| String::new())
        }
        "suspend" => {
            a.at_most(1)?;
            reg.suspend(a.name()?, a.has(&["--noflush"]))
                .map_err(e)
                .map(|_| String::new())
        }
        "resume" => {
            a.at_most(1)?;
            reg.resume(a.name()?).map_err(e).map(|_| String::new())
        }
        "remove" => {
            a.at_most(1)?;
            reg.remove(a.name()?, a.has(&["--force", "-f"]))
                .map_err(e)
                .map(|_| String::new())
        }
        "message" => {
            let name = a.name()?;
            let sector = a.pos.get(1).ok_or("message: sector required")?;
            let sector = sector
                .parse::<u64>()
                .map_err(|_| format!("message: invalid sector '{sector}'"))?;
            let words: Vec<String> = a.pos[2..].iter().map(|s| s.to_string()).collect();
            if words.is_empty() {
                return Err("message: message text required".into());
            }
            let mut r = reg.message(name, sector, &words).map_err(e)?;
            if !r.is_empty() && !r.ends_with('\n') {
                r.push('\n');
            }
            Ok(r)
        }
        "status" | "table" => {
            a.at_most(1)?;
            let out = reg
                .table_lines(a.pos.first().copied(), verb == "status")
                .map_err(e)?;
            Ok(filter_target(out, a.values("--target").first().copied()))
        }
        "info" => {
            a.at_most(1)?;
            reg.info(a.pos.first().copied()).map_err(e)
        }
        "ls" => {
            a.at_most(0)?;
            Ok(reg.ls())
        }
        "targets" => {
            a.at_most(0)?;
            Ok(Registry::targets())
        }
        "stats" => {
            a.at_most(1)?;
            reg.stats(a.name()?).map_err(e)
        }
        "version" => Ok(format!("dmkit version:     {}\n", env!("CARGO_PKG_VERSION"))),
        other => Err(format!("unknown command '{other}'")),
    }
}
