//! The cache tools, option for option as thin-provisioning-tools 1.x has them:
//! `dmkit cache check ...` is `cache_check ...`, and a link named
//! `cache_check` to the dmkit binary is that tool. The conventions are the thin
//! tools' (help and version on standard output, usage errors exit 2, failures
//! one line on standard error and exit 64).

use super::{check_input_as, metadata_fail as fail, open_output, quietly, req, stat, Failure, Outcome};
use clap::{Parser, Subcommand};
use dmkit::cache::{tools, xml, CacheError};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The cache tools.
pub const TOOLS: &[super::Tool] = &[
    tool!("cache_check", "check", CacheCheckArgs, run_check),
    tool!("cache_dump", "dump", CacheDumpArgs, run_dump),
    tool!("cache_restore", "restore", CacheRestoreArgs, run_restore),
    tool!("cache_repair", "repair", CacheRepairArgs, run_repair),
    tool!(
        "cache_metadata_size",
        "metadata_size",
        CacheMetadataSizeArgs,
        run_size
    ),
    tool!("cache_writeback", "writeback", CacheWritebackArgs, run_writeback),
];

/// 1.x's exit status for metadata a writeback cannot use (sysexits' EX_DATAERR).
const EXIT_DATAERR: i32 = 65;

#[derive(Subcommand, Debug, Clone)]
pub enum CacheCmd {
    /// Validate cache metadata (cache_check)
    Check(CacheCheckArgs),
    /// Write cache metadata as XML (cache_dump)
    Dump(CacheDumpArgs),
    /// Build cache metadata from XML (cache_restore)
    Restore(CacheRestoreArgs),
    /// Salvage damaged cache metadata into a new device or file (cache_repair)
    Repair(CacheRepairArgs),
    /// The metadata size a cache needs (cache_metadata_size)
    #[command(name = "metadata_size", alias = "metadata-size")]
    MetadataSize(CacheMetadataSizeArgs),
    /// Copy a cache's dirty blocks to its origin (cache_writeback)
    Writeback(CacheWritebackArgs),
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Validates cache metadata on a device or file.",
    disable_version_flag = true
)]
pub struct CacheCheckArgs {
    /// Specify the input device to check
    #[arg(value_parser = super::any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Free leaked metadata blocks when nothing worse is found
    #[arg(long)]
    pub auto_repair: bool,
    /// Clears the 'needs_check' flag in the superblock
    #[arg(long)]
    pub clear_needs_check_flag: bool,
    /// Only return a non-zero exit code if a fatal error is found.
    #[arg(long)]
    pub ignore_non_fatal_errors: bool,
    /// Suppress output messages, return only exit code.
    #[arg(short, long)]
    pub quiet: bool,
    /// Don't check the discard bitset
    #[arg(long)]
    pub skip_discards: bool,
    /// Don't check the hint array
    #[arg(long)]
    pub skip_hints: bool,
    /// Don't check the mapping array
    #[arg(long)]
    pub skip_mappings: bool,
    /// Only check the superblock
    #[arg(long)]
    pub super_block_only: bool,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Dump the cache metadata to stdout in XML format",
    disable_version_flag = true
)]
pub struct CacheDumpArgs {
    /// Specify the input device to dump
    #[arg(value_parser = super::any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
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
pub struct CacheRestoreArgs {
    /// Specify the input xml
    #[arg(value_parser = super::any_path(), short, long, value_name = "FILE", required = true)]
    pub input: Option<PathBuf>,
    /// Specify the output metadata version
    #[arg(long, value_name = "NUM", default_value = "2", value_parser = ["1", "2"])]
    pub metadata_version: String,
    /// Specify the output device
    #[arg(value_parser = super::any_path(), short, long, value_name = "FILE", required = true)]
    pub output: Option<PathBuf>,
    /// Don't set the clean shutdown flag
    #[arg(long)]
    pub omit_clean_shutdown: bool,
    /// Suppress output messages, return only exit code
    #[arg(short, long)]
    pub quiet: bool,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Repair binary cache metadata, and write it to a different device or file",
    disable_version_flag = true
)]
pub struct CacheRepairArgs {
    /// Specify the input device
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
    about = "Estimate the size of the metadata device needed for a given configuration.",
    override_usage = "cache_metadata_size [OPTIONS] <--device-size <SIZE> --block-size <SIZE> | --nr-blocks <NUM>>",
    disable_version_flag = true
)]
pub struct CacheMetadataSizeArgs {
    /// Specify the size of each cache block
    #[arg(long, value_name = "SIZE[bskmg]", requires = "device_size", value_parser = super::size::storage_size)]
    pub block_size: Option<u64>,
    /// Specify total size of the fast device used in the cache
    #[arg(long, value_name = "SIZE[bskmgtp]", requires = "block_size", value_parser = super::size::storage_size)]
    pub device_size: Option<u64>,
    /// Specity the per-block hint width
    #[arg(long, value_name = "BYTES", default_value = "4")]
    pub max_hint_width: u32,
    /// Output numeric value only
    #[arg(short = 'n', long, value_name = "OPT", num_args = 0..=1, require_equals = true,
          value_parser = ["short", "long"], hide_possible_values = true)]
    pub numeric_only: Option<Option<String>>,
    /// Specify the number of cache blocks
    #[arg(long, value_name = "NUM", conflicts_with_all = ["block_size", "device_size"])]
    pub nr_blocks: Option<u64>,
    /// Specify the output unit in {bskKmMgG}
    #[arg(short = 'u', long, value_name = "UNIT", default_value = "sector", value_parser = super::size::unit_index)]
    pub unit: usize,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Repair binary cache metadata, and write it to a different device or file",
    disable_version_flag = true,
    next_display_order = None
)]
pub struct CacheWritebackArgs {
    // the required three first, in 1.x's order: clap names them in usage
    // lines in the order they are declared (help sorts them by name)
    /// Specify the cache metadata device
    #[arg(value_parser = super::any_path(), long, value_name = "FILE", required = true)]
    pub metadata_device: Option<PathBuf>,
    /// Specify the slow device begin cached
    #[arg(value_parser = super::any_path(), long, value_name = "FILE", required = true)]
    pub origin_device: Option<PathBuf>,
    /// Specify the fast device containing the data that needs to be written back
    #[arg(value_parser = super::any_path(), long, value_name = "FILE", required = true)]
    pub fast_device: Option<PathBuf>,
    /// Specify the size for the data cache, in megabytes
    #[arg(long, value_name = "MB")]
    pub buffer_size_meg: Option<u64>,
    /// Specify the data offset within the fast device
    #[arg(long, value_name = "SECTORS")]
    pub fast_device_offset: Option<u64>,
    /// List any blocks that failed the writeback process
    #[arg(long)]
    pub list_failed_blocks: bool,
    /// Do not clear the dirty flags in metadata
    #[arg(long)]
    pub no_metadata_update: bool,
    /// Specify the data offset within the slow device
    #[arg(long, value_name = "SECTORS")]
    pub origin_device_offset: Option<u64>,
    /// Suppress output messages, return only exit code.
    #[arg(short, long)]
    pub quiet: bool,
    /// Specify how many times to retry data copying on failed data block
    #[arg(long, value_name = "CNT", default_value = "0")]
    pub retry_count: u32,
    /// Print version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

versioned!(
    CacheCheckArgs,
    CacheDumpArgs,
    CacheRestoreArgs,
    CacheRepairArgs,
    CacheMetadataSizeArgs,
    CacheWritebackArgs
);

/// The input file opened as metadata, after the checks 1.x makes of an input
/// ([`check_input_as`]).
fn input(p: &Path, xml_check: bool, writable: bool) -> Result<dmkit::pdata::FileDev, Failure> {
    check_input_as(p, xml_check)?;
    let claim = writable.then(|| super::claim(p)).transpose()?;
    let dev = dmkit::pdata::FileDev::open(p, writable)
        .map_err(|e| Failure::Message(format!("{}: {e}", p.display())))?;
    Ok(match claim {
        Some(c) => dev.with_claim(c),
        None => dev,
    })
}

fn run_check(a: CacheCheckArgs) -> Outcome {
    let q = a.quiet;
    quietly(check(a), q)
}

fn check(a: CacheCheckArgs) -> Outcome {
    let dev = input(&req(a.input), true, a.clear_needs_check_flag || a.auto_repair)?;
    let opts = tools::CheckOpts {
        sb_only: a.super_block_only,
        skip_mappings: a.skip_mappings,
        skip_hints: a.skip_hints,
        skip_discards: a.skip_discards,
        ignore_non_fatal: a.ignore_non_fatal_errors,
        clear_needs_check: a.clear_needs_check_flag,
        auto_repair: a.auto_repair,
    };
    let (lines, r) = match tools::check(Box::new(dev), &opts) {
        Ok(notes) => (notes, Ok(())),
        Err(lines) => (lines, Err(Failure::Quiet(super::EXIT_FAILURE))),
    };
    if !a.quiet {
        lines.iter().for_each(|l| eprintln!("{l}"));
    }
    r
}

fn run_dump(a: CacheDumpArgs) -> Outcome {
    let dev = input(&req(a.input), false, false)?;
    match &a.output {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(|e| Failure::Message(format!("output error: {e}")))?;
            let mut w = std::io::BufWriter::new(f);
            tools::dump(Box::new(dev), a.repair, &mut w).map_err(fail)?;
            w.flush().map_err(|e| fail(CacheError::Output(e)))
        }
        None => {
            let stdout = std::io::stdout();
            let mut w = stdout.lock();
            tools::dump(Box::new(dev), a.repair, &mut w).map_err(fail)?;
            w.flush().map_err(|e| fail(CacheError::Output(e)))
        }
    }
}

fn run_restore(a: CacheRestoreArgs) -> Outcome {
    let q = a.quiet;
    quietly(restore(a), q)
}

fn restore(a: CacheRestoreArgs) -> Outcome {
    let inp = req(a.input);
    stat(&inp, "input")?;
    let out = open_output(&req(a.output))?;
    let f = std::fs::File::open(&inp).map_err(|e| Failure::Message(format!("{}: {e}", inp.display())))?;
    let md = xml::parse(std::io::BufReader::with_capacity(1 << 16, f)).map_err(fail)?;
    let version = if a.metadata_version == "1" { 1 } else { 2 };
    tools::restore(&md, Box::new(out), version, a.omit_clean_shutdown).map_err(fail)
}

fn run_repair(a: CacheRepairArgs) -> Outcome {
    let q = a.quiet;
    quietly(repair(a), q)
}

fn repair(a: CacheRepairArgs) -> Outcome {
    let inp = req(a.input);
    stat(&inp, "input")?;
    let out = open_output(&req(a.output))?;
    let dev = input(&inp, true, false)?;
    tools::repair(Box::new(dev), Box::new(out)).map_err(fail)
}

fn run_size(a: CacheMetadataSizeArgs) -> Outcome {
    let nr = match (a.nr_blocks, a.block_size, a.device_size) {
        (Some(n), _, _) => n,
        (None, Some(block), Some(dev)) => {
            if block == 0 || !block.is_multiple_of(32 << 10) {
                return Err("block size must be a multiple of 32 KiB".into());
            }
            if block > 1 << 30 {
                return Err("maximum block size is 1 GiB".into());
            }
            if dev < block {
                return Err("pool size must be larger than block size".into());
            }
            dev.div_ceil(block)
        }
        _ => return Err("Please specify either --device-size and --block-size, or --nr-blocks.".into()),
    };
    let sectors = tools::metadata_size(nr, a.max_hint_width);
    super::size::print(sectors * 512.0, a.unit, a.numeric_only.as_ref());
    Ok(())
}

/// A data device of cache_writeback: it must exist and be a file or block device.
fn data_device(p: &Path, read_only: bool) -> Result<dmkit::io::BackingFile, Failure> {
    check_input_as(p, false)?;
    dmkit::io::BackingFile::open(p, read_only, false)
        .map_err(|e| Failure::Message(format!("{}: {e}", p.display())))
}

fn run_writeback(a: CacheWritebackArgs) -> Outcome {
    let q = a.quiet;
    quietly(writeback(a), q)
}

fn writeback(a: CacheWritebackArgs) -> Outcome {
    let meta = req(a.metadata_device);
    let (origin_p, fast_p) = (req(a.origin_device), req(a.fast_device));
    let dev = input(&meta, false, !a.no_metadata_update)?;
    let origin = data_device(&origin_p, false)?;
    let fast = data_device(&fast_p, true)?;
    let (fo, oo) = (
        a.fast_device_offset.unwrap_or(0).saturating_mul(512),
        a.origin_device_offset.unwrap_or(0).saturating_mul(512),
    );
    if !fo.is_multiple_of(4096) || !oo.is_multiple_of(4096) {
        return Err("offsets must be page aligned".into());
    }
    let quiet = a.quiet;
    let mut stage = |s: &str| {
        if !quiet {
            eprintln!("{s}");
        }
    };
    let opts = tools::WritebackOpts {
        fast: &fast,
        fast_offset: fo,
        origin: &origin,
        origin_offset: oo,
        update_metadata: !a.no_metadata_update,
        stage: &mut stage,
    };
    let r = match tools::writeback(Box::new(dev), opts) {
        Ok(r) => r,
        Err(e @ (CacheError::Pdata(_) | CacheError::BadSuperblock(_) | CacheError::Plain(_))) => {
            if !quiet {
                eprintln!("{e}");
                eprintln!("metadata contains errors (run cache_check for details).");
                eprintln!("perhaps you need to run cache_repair.");
            }
            return Err(Failure::Quiet(EXIT_DATAERR));
        }
        Err(e) => return Err(fail(e)),
    };
    if !quiet {
        println!("{}/{} blocks successfully copied", r.copied, r.total);
        if !r.failed.is_empty() {
            println!("{} blocks were not copied", r.failed.len());
        }
        if a.list_failed_blocks {
            for c in &r.failed {
                println!("{c}");
            }
        }
    }
    if r.copied != r.total {
        return Err("Incompleted writeback".into());
    }
    Ok(())
}

/// `dmkit cache VERB ARGS...`: `args` are the words after `cache`.
pub fn main(args: Vec<OsString>) -> i32 {
    super::family_main::<CacheCmd>("cache", TOOLS, args, |_| 0)
}
