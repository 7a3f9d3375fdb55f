//! The `dmkit` command: `serve` runs the daemon; the other verbs talk to it with
//! dmsetup's semantics and output.

use anyhow::{bail, Context, Result};
use dmkit::daemon::{default_run_dir, serve, ServeOptions};
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

const USAGE: &str = "usage: dmkit [--run-dir DIR] COMMAND [ARGS]

Daemon:
  serve [--nbd-listen ADDR:PORT] [--group GROUP] [--demo] [--demo-dir DIR] [--buffered]
        [--copy-subjob-kb KB]   (copy engine sub-job size: default 512, at most 1024)

Device-mapper verbs (as dmsetup):
  create NAME [--table LINE]... [--readonly] [-u UUID]   (table from stdin without --table)
  load NAME [--table LINE]...        suspend NAME [--noflush]      resume NAME
  remove NAME [--force]              clear NAME
  message NAME SECTOR MSG...         status [NAME] [--target T]    table [NAME] [--target T]
  info [NAME]                        ls                            targets       version

Thin-provisioning metadata tools:
  thin dump|restore|check ...

The run directory holds control.sock and nbd.sock: --run-dir, else $DMKIT_RUN_DIR,
else /run/dmkit (root) or $XDG_RUNTIME_DIR/dmkit.";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("dmkit: {e:#}");
            std::process::exit(1);
        }
    }
}

fn run(mut args: Vec<String>) -> Result<i32> {
    let mut run_dir = None;
    while let Some(a) = args.first() {
        match a.as_str() {
            "--run-dir" => {
                if args.len() < 2 {
                    bail!("--run-dir needs a directory");
                }
                run_dir = Some(PathBuf::from(&args[1]));
                args.drain(..2);
            }
            "-h" | "--help" | "help" => {
                println!("{USAGE}");
                return Ok(0);
            }
            _ => break,
        }
    }
    let run_dir = run_dir.unwrap_or_else(default_run_dir);
    let Some(verb) = args.first().cloned() else {
        eprintln!("{USAGE}");
        return Ok(2);
    };
    match verb.as_str() {
        "serve" => {
            let mut o = ServeOptions {
                run_dir,
                nbd_listen: None,
                group: None,
                demo: None,
                direct_io: true,
                copy_subjob_kb: 512,
            };
            let mut demo = false;
            let mut demo_dir = PathBuf::from("dmkit-demo");
            let mut i = 1;
            while i < args.len() {
                let val = |i: usize| {
                    args.get(i + 1)
                        .cloned()
                        .with_context(|| format!("{} needs a value", args[i]))
                };
                match args[i].as_str() {
                    "--nbd-listen" => {
                        o.nbd_listen = Some(val(i)?);
                        i += 1;
                    }
                    "--group" => {
                        o.group = Some(val(i)?);
                        i += 1;
                    }
                    "--run-dir" => {
                        o.run_dir = PathBuf::from(val(i)?);
                        i += 1;
                    }
                    "--demo" => demo = true,
                    "--demo-dir" => {
                        demo_dir = PathBuf::from(val(i)?);
                        demo = true;
                        i += 1;
                    }
                    "--buffered" => o.direct_io = false,
                    "--copy-subjob-kb" => {
                        let v = val(i)?;
                        o.copy_subjob_kb = v
                            .parse()
                            .with_context(|| format!("--copy-subjob-kb: invalid size '{v}'"))?;
                        i += 1;
                    }
                    other => bail!("serve: unknown option '{other}'"),
                }
                i += 1;
            }
            if demo {
                o.demo = Some(demo_dir);
            }
            serve(o)?;
            Ok(0)
        }
        "thin" => Ok(dmkit::thin::cli::main(&args[1..])),
        _ => client(&run_dir, &args),
    }
}

fn client(run_dir: &std::path::Path, args: &[String]) -> Result<i32> {
    let verb = args[0].as_str();
    let needs_stdin = matches!(verb, "create" | "load" | "reload")
        && !args
            .iter()
            .any(|a| a == "--table" || a.starts_with("--table=") || a == "--notable");
    let mut stdin = Vec::new();
    if needs_stdin {
        std::io::stdin()
            .read_to_end(&mut stdin)
            .context("reading the table from standard input")?;
    }
    let sock = run_dir.join("control.sock");
    let mut s = UnixStream::connect(&sock).with_context(|| {
        format!(
            "cannot reach the dmkit daemon at {} (is `dmkit serve` running?)",
            sock.display()
        )
    })?;
    let (ok, out, err) = dmkit::control::call(&mut s, args, &stdin)?;
    print!("{out}");
    if !ok {
        eprintln!("dmkit {verb}: {}", err.trim_end());
        return Ok(1);
    }
    Ok(0)
}
