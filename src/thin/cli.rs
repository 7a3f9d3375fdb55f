//! `dmkit thin dump|restore|check`: the thin-provisioning-tools verbs.

use super::{check, dump, restore, xml};
use crate::pdata::FileDev;
use std::path::Path;

const USAGE: &str = "usage:
  dmkit thin dump METADATA [-m|--metadata-snap] [-o OUTPUT]
  dmkit thin restore -i XML -o METADATA
  dmkit thin check METADATA [-q|--quiet] [-m|--metadata-snap]";

/// Entry point for `dmkit thin ...`; returns the process exit status.
pub fn main(args: &[String]) -> i32 {
    let Some(verb) = args.first() else {
        eprintln!("{USAGE}");
        return 2;
    };
    let rest = &args[1..];
    match verb.as_str() {
        "dump" => cmd_dump(rest),
        "restore" => cmd_restore(rest),
        "check" => cmd_check(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            0
        }
        _ => {
            eprintln!("dmkit thin: unknown command '{verb}'\n{USAGE}");
            2
        }
    }
}

struct Opts {
    positional: Vec<String>,
    flags: Vec<String>,
    input: Option<String>,
    output: Option<String>,
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        positional: Vec::new(),
        flags: Vec::new(),
        input: None,
        output: None,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "-i" | "--input" => o.input = Some(it.next().ok_or("-i needs a file")?.clone()),
            "-o" | "--output" => o.output = Some(it.next().ok_or("-o needs a file")?.clone()),
            s if s.starts_with('-') => o.flags.push(s.to_string()),
            s => o.positional.push(s.to_string()),
        }
    }
    Ok(o)
}

fn has(o: &Opts, short: &str, long: &str) -> bool {
    o.flags.iter().any(|f| f == short || f == long)
}

fn open(path: &str, writable: bool) -> Result<FileDev, i32> {
    FileDev::open(Path::new(path), writable).map_err(|e| {
        eprintln!("{path}: {e}");
        1
    })
}

fn cmd_dump(args: &[String]) -> i32 {
    let o = match parse(args) {
        Ok(o) if o.positional.len() == 1 => o,
        Ok(_) => {
            eprintln!("{USAGE}");
            return 2;
        }
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return 2;
        }
    };
    let dev = match open(&o.positional[0], false) {
        Ok(d) => d,
        Err(c) => return c,
    };
    let snap = has(&o, "-m", "--metadata-snap");
    let res = match &o.output {
        Some(p) => match std::fs::File::create(p) {
            Ok(f) => {
                let mut w = std::io::BufWriter::new(f);
                dump::dump(Box::new(dev), snap, &mut w, true).and_then(|_| {
                    use std::io::Write;
                    w.flush().map_err(|e| super::ThinError::Invalid(e.to_string()))
                })
            }
            Err(e) => {
                eprintln!("{p}: {e}");
                return 1;
            }
        },
        None => {
            let stdout = std::io::stdout();
            let mut w = std::io::BufWriter::new(stdout.lock());
            let r = dump::dump(Box::new(dev), snap, &mut w, true);
            use std::io::Write;
            let _ = w.flush();
            r
        }
    };
    match res {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("metadata contains errors: {e}");
            1
        }
    }
}

fn cmd_restore(args: &[String]) -> i32 {
    let o = match parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\n{USAGE}");
            return 2;
        }
    };
    let (Some(input), Some(output)) = (&o.input, &o.output) else {
        eprintln!("{USAGE}");
        return 2;
    };
    let text = match std::fs::read_to_string(input) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{input}: {e}");
            return 1;
        }
    };
    let parsed = match xml::parse(&text) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{input}: {e}");
            return 1;
        }
    };
    let dev = match open(output, true) {
        Ok(d) => d,
        Err(c) => return c,
    };
    match restore::restore(&parsed, Box::new(dev), true) {
        Ok(_) => 0,
        Err(e) => {
            eprintln!("restore failed: {e}");
            1
        }
    }
}

fn cmd_check(args: &[String]) -> i32 {
    let o = match parse(args) {
        Ok(o) if o.positional.len() == 1 => o,
        _ => {
            eprintln!("{USAGE}");
            return 2;
        }
    };
    let quiet = has(&o, "-q", "--quiet");
    let dev = match open(&o.positional[0], false) {
        Ok(d) => d,
        Err(c) => return c,
    };
    let snap = has(&o, "-m", "--metadata-snap");
    let r = if quiet {
        check::check(Box::new(dev), snap)
    } else {
        check::check_with_progress(Box::new(dev), snap)
    };
    if !quiet {
        for e in r.errors.iter().chain(r.leaks.iter()) {
            eprintln!("{e}");
        }
        if r.ok() {
            println!("TRANSACTION_ID={}", r.transaction_id);
            println!("METADATA_FREE_BLOCKS={}", r.free_metadata_blocks);
        }
    }
    if r.ok() {
        0
    } else {
        1
    }
}
