//! `dmkit thin check|dump|restore`: the thin-provisioning-tools verbs, with the
//! flags scripts pass to `thin_check`, `thin_dump` and `thin_restore`. A flag
//! dmkit does not implement is refused by name, never ignored.

use super::check::{self, CheckOptions};
use super::dump::{self, DumpOptions, Source};
use super::{restore, xml};
use crate::pdata::FileDev;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::{Path, PathBuf};

#[derive(Subcommand, Debug, Clone)]
pub enum ThinCmd {
    /// Check a pool's metadata (thin_check)
    Check(CheckArgs),
    /// Write a pool's metadata as thin_dump XML (thin_dump)
    Dump(DumpArgs),
    /// Build metadata from thin_dump XML (thin_restore)
    Restore(RestoreArgs),
}

#[derive(Args, Debug, Clone)]
pub struct CheckArgs {
    /// The metadata device or file
    pub input: PathBuf,
    /// Print nothing; the exit status tells
    #[arg(short, long)]
    pub quiet: bool,
    /// Check the held metadata snapshot's trees only
    #[arg(short = 'm', long = "metadata-snap", visible_alias = "metadata-snapshot")]
    pub metadata_snap: bool,
    /// Check the superblock only
    #[arg(long)]
    pub super_block_only: bool,
    /// Do not check the mapping trees (nor, therefore, the space maps' counts)
    #[arg(long)]
    pub skip_mappings: bool,
    /// Leaked blocks (counts higher than the references) do not fail the check
    #[arg(long)]
    pub ignore_non_fatal_errors: bool,
    /// Refused: dmkit does not repair during a check
    #[arg(long, hide = true)]
    pub auto_repair: bool,
    /// Refused: dmkit does not yet clear the needs_check flag
    #[arg(long, hide = true)]
    pub clear_needs_check_flag: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Xml,
    #[value(name = "human_readable")]
    HumanReadable,
}

#[derive(Args, Debug, Clone)]
pub struct DumpArgs {
    /// The metadata device or file
    pub input: PathBuf,
    /// Dump the held metadata snapshot, or the one at BLOCK
    #[arg(short = 'm', long = "metadata-snap", num_args = 0..=1, value_name = "BLOCK")]
    pub metadata_snap: Option<Option<u64>>,
    /// Write to this file instead of standard output
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Output format (dmkit writes xml only)
    #[arg(short, long, value_enum, default_value = "xml")]
    pub format: Format,
    /// Devices without their mappings
    #[arg(long)]
    pub skip_mappings: bool,
    /// Refused: dmkit does not repair while dumping
    #[arg(short, long, hide = true)]
    pub repair: bool,
}

#[derive(Args, Debug, Clone)]
pub struct RestoreArgs {
    /// The XML to read
    #[arg(short, long)]
    pub input: PathBuf,
    /// The metadata device or file to write
    #[arg(short, long)]
    pub output: PathBuf,
    /// No progress line
    #[arg(short, long)]
    pub quiet: bool,
}

/// For callers that hold the words (tests, scripts in-process): parse and run.
#[derive(Parser, Debug)]
#[command(name = "dmkit thin", no_binary_name = true)]
struct ThinWords {
    #[command(subcommand)]
    cmd: ThinCmd,
}

/// Parse `args` (after `thin`) and run; returns the exit status (2 on bad usage).
pub fn main(args: &[String]) -> i32 {
    match ThinWords::try_parse_from(args) {
        Ok(w) => run(w.cmd),
        Err(e) => {
            let cmd = match args.first() {
                Some(v) => format!("dmkit thin {v}"),
                None => "dmkit thin".into(),
            };
            match crate::control::verbs::one_line(&e, &cmd) {
                Some(msg) => eprintln!("{msg}"),
                None => {
                    let _ = e.print();
                }
            }
            e.exit_code()
        }
    }
}

/// Run a parsed `thin` verb; returns the exit status.
pub fn run(cmd: ThinCmd) -> i32 {
    let r = match cmd {
        ThinCmd::Check(a) => cmd_check(a),
        ThinCmd::Dump(a) => cmd_dump(a),
        ThinCmd::Restore(a) => cmd_restore(a),
    };
    r.unwrap_or_else(|(code, msg)| {
        eprintln!("{msg}");
        code
    })
}

type Outcome = Result<i32, (i32, String)>;

fn refuse(flag: &str, why: &str) -> Outcome {
    Err((2, format!("{flag} is not supported by dmkit: {why}")))
}

fn open(path: &Path, writable: bool) -> Result<FileDev, (i32, String)> {
    FileDev::open(path, writable).map_err(|e| (1, format!("{}: {e}", path.display())))
}

fn cmd_dump(a: DumpArgs) -> Outcome {
    if a.repair {
        return refuse(
            "--repair",
            "dump a damaged pool without it, or restore from a good dump",
        );
    }
    if a.format != Format::Xml {
        return refuse("--format human_readable", "dmkit writes xml only");
    }
    let dev = open(&a.input, false)?;
    let o = DumpOptions {
        source: match a.metadata_snap {
            None => Source::Live,
            Some(None) => Source::HeldSnapshot,
            Some(Some(b)) => Source::SnapshotAt(b),
        },
        skip_mappings: a.skip_mappings,
        progress: true,
    };
    let res = match &a.output {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(|e| (1, format!("{}: {e}", p.display())))?;
            let mut w = std::io::BufWriter::new(f);
            dump::dump_with(Box::new(dev), o, &mut w).and_then(|_| {
                use std::io::Write;
                w.flush().map_err(|e| super::ThinError::Invalid(e.to_string()))
            })
        }
        None => {
            let stdout = std::io::stdout();
            let mut w = std::io::BufWriter::new(stdout.lock());
            let r = dump::dump_with(Box::new(dev), o, &mut w);
            use std::io::Write;
            let _ = w.flush();
            r
        }
    };
    res.map(|_| 0)
        .map_err(|e| (1, format!("metadata contains errors: {e}")))
}

fn cmd_restore(a: RestoreArgs) -> Outcome {
    let text = std::fs::read_to_string(&a.input).map_err(|e| (1, format!("{}: {e}", a.input.display())))?;
    let parsed = xml::parse(&text).map_err(|e| (1, format!("{}: {e}", a.input.display())))?;
    let dev = open(&a.output, true)?;
    restore::restore(&parsed, Box::new(dev), !a.quiet)
        .map(|_| 0)
        .map_err(|e| (1, format!("restore failed: {e}")))
}

fn cmd_check(a: CheckArgs) -> Outcome {
    if a.auto_repair {
        return refuse(
            "--auto-repair",
            "repair is not implemented; dump, fix and restore instead",
        );
    }
    if a.clear_needs_check_flag {
        return refuse("--clear-needs-check-flag", "not implemented yet");
    }
    let dev = open(&a.input, false)?;
    let r = check::check_with(
        Box::new(dev),
        CheckOptions {
            metadata_snap: a.metadata_snap,
            super_block_only: a.super_block_only,
            skip_mappings: a.skip_mappings,
            progress: !a.quiet,
        },
    );
    let ok = r.errors.is_empty() && (r.leaks.is_empty() || a.ignore_non_fatal_errors);
    if !a.quiet {
        for e in r.errors.iter().chain(r.leaks.iter()) {
            eprintln!("{e}");
        }
        if ok {
            println!("TRANSACTION_ID={}", r.transaction_id);
            println!("METADATA_FREE_BLOCKS={}", r.free_metadata_blocks);
        }
    }
    Ok(if ok { 0 } else { 1 })
}
