//! The era tools, option for option as thin-provisioning-tools 1.x has them:
//! `dmkit era check ...` is `era_check ...`, and a link named `era_check` to
//! the dmkit binary is that tool. The conventions are the thin tools' (help and
//! version on standard output, usage errors exit 2, failures one line on
//! standard error and exit 64).

use super::{check_input_as, metadata_fail as fail, open_output, quietly, req, stat, Failure, Outcome};
use clap::{Parser, Subcommand};
use dmkit::era::{tools, xml, EraError};
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

/// The era tools.
pub const TOOLS: &[super::Tool] = &[
    tool!("era_check", "check", EraCheckArgs, run_check),
    tool!("era_dump", "dump", EraDumpArgs, run_dump),
    tool!("era_restore", "restore", EraRestoreArgs, run_restore),
    tool!("era_invalidate", "invalidate", EraInvalidateArgs, run_invalidate),
];

#[derive(Subcommand, Debug, Clone)]
pub enum EraCmd {
    /// Validate era metadata (era_check)
    Check(EraCheckArgs),
    /// Write era metadata as XML (era_dump)
    Dump(EraDumpArgs),
    /// Build era metadata from XML (era_restore)
    Restore(EraRestoreArgs),
    /// List the blocks written since an era (era_invalidate)
    Invalidate(EraInvalidateArgs),
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Validate era metadata on device or file.",
    disable_version_flag = true
)]
pub struct EraCheckArgs {
    /// Specify the input device to check
    #[arg(value_parser = super::any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Only return a non-zero exit code if a fatal error is found.
    #[arg(long)]
    pub ignore_non_fatal_errors: bool,
    /// Suppress output messages, return only exit code.
    #[arg(short, long)]
    pub quiet: bool,
    /// Only check the superblock.
    #[arg(long)]
    pub super_block_only: bool,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Dump the era metadata to stdout in XML format",
    disable_version_flag = true
)]
pub struct EraDumpArgs {
    /// Specify the input device to dump
    #[arg(value_parser = super::any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Fold any unprocessed write sets into the final era array
    #[arg(long)]
    pub logical: bool,
    /// Specify the output file rather than stdout
    #[arg(value_parser = super::any_path(), short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Repair the metadata whilst dumping it
    #[arg(short, long)]
    pub repair: bool,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(about = "Convert XML format metadata to binary.", disable_version_flag = true)]
pub struct EraRestoreArgs {
    /// Specify the input xml
    #[arg(value_parser = super::any_path(), short, long, value_name = "FILE", required = true)]
    pub input: Option<PathBuf>,
    /// Specify the output device
    #[arg(value_parser = super::any_path(), short, long, value_name = "FILE", required = true)]
    pub output: Option<PathBuf>,
    /// Suppress output messages, return only exit code.
    #[arg(short, long)]
    pub quiet: bool,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "List blocks that may have changed since a given era",
    disable_version_flag = true
)]
pub struct EraInvalidateArgs {
    /// Specify the input device
    #[arg(value_parser = super::any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Use the metadata snapshot rather than the current superblock (a flag,
    /// as in 1.2.2 and later; 1.1 took a value here and ignored it)
    #[arg(long)]
    pub metadata_snapshot: bool,
    /// Specify the output file rather than stdout
    #[arg(value_parser = super::any_path(), short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Blocks written since the given era will be listed
    #[arg(long, value_name = "ERA", required = true)]
    pub written_since: Option<u32>,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

versioned!(EraCheckArgs, EraDumpArgs, EraRestoreArgs, EraInvalidateArgs);

/// The input file opened as metadata, after the checks 1.x makes of an input
/// ([`check_input_as`]).
fn input(p: Option<PathBuf>, xml_check: bool) -> Result<dmkit::pdata::FileDev, Failure> {
    let p = req(p);
    check_input_as(&p, xml_check)?;
    dmkit::pdata::FileDev::open(&p, false).map_err(|e| Failure::Message(format!("{}: {e}", p.display())))
}

fn run_check(a: EraCheckArgs) -> Outcome {
    let q = a.quiet;
    quietly(check(a), q)
}

fn check(a: EraCheckArgs) -> Outcome {
    let dev = input(a.input, true)?;
    if !a.quiet {
        eprintln!("Checking era metadata");
    }
    match tools::check(Box::new(dev), a.super_block_only, a.ignore_non_fatal_errors) {
        Ok(notes) => {
            if !a.quiet {
                notes.iter().for_each(|l| eprintln!("{l}"));
            }
            Ok(())
        }
        Err(lines) => {
            if !a.quiet {
                lines.iter().for_each(|l| eprintln!("{l}"));
            }
            Err(Failure::Quiet(super::EXIT_FAILURE))
        }
    }
}

fn run_dump(a: EraDumpArgs) -> Outcome {
    let dev = input(a.input, false)?;
    match &a.output {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(|e| Failure::Message(format!("output error: {e}")))?;
            let mut w = std::io::BufWriter::new(f);
            tools::dump(Box::new(dev), a.logical, &mut w).map_err(fail)?;
            w.flush().map_err(|e| fail(EraError::Output(e)))
        }
        None => {
            let stdout = std::io::stdout();
            let mut w = std::io::BufWriter::with_capacity(1 << 16, stdout.lock());
            tools::dump(Box::new(dev), a.logical, &mut w).map_err(fail)?;
            w.flush().map_err(|e| fail(EraError::Output(e)))
        }
    }
}

fn run_restore(a: EraRestoreArgs) -> Outcome {
    let q = a.quiet;
    quietly(restore(a), q)
}

fn restore(a: EraRestoreArgs) -> Outcome {
    let inp = req(a.input);
    stat(&inp, "input")?;
    let out = open_output(&req(a.output))?;
    let f = std::fs::File::open(&inp).map_err(|e| Failure::Message(format!("{}: {e}", inp.display())))?;
    let md = xml::parse(std::io::BufReader::new(f)).map_err(fail)?;
    tools::restore(&md, Box::new(out)).map_err(fail)
}

fn run_invalidate(a: EraInvalidateArgs) -> Outcome {
    let dev = input(a.input, false)?;
    let since = a.written_since.unwrap_or(0);
    let text = tools::invalidate(Box::new(dev), since, a.metadata_snapshot).map_err(fail)?;
    match &a.output {
        Some(p) => std::fs::write(p, text).map_err(|e| Failure::Message(format!("output error: {e}"))),
        None => super::emit(&text),
    }
}

/// `dmkit era VERB ARGS...`: `args` are the words after `era`.
pub fn main(args: Vec<OsString>) -> i32 {
    super::family_main::<EraCmd>("era", TOOLS, args, |_| 0)
}
