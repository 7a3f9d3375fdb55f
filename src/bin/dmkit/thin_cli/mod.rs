//! The thin-provisioning-tools commands, option for option as the 1.x tools have
//! them: `dmkit thin check ...` is `thin_check ...`, and a link named `thin_check`
//! (or any of [`TOOLS`]) to the dmkit binary is that tool, as `pdata_tools` does it.
//!
//! Conventions shared with the reference: help and version on standard output with
//! exit 0; usage errors as clap prints them, exit 2; a failure is one line on
//! standard error and exit 64 (sysexits' EX_USAGE, what 1.x returns for every
//! failure); a closed output pipe ends the tool silently.

mod check;
mod dump;
mod live;
mod other;
mod size;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use dmkit::thin::ls::LsField;
use dmkit::thin::rmap::Region;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The version `-V` prints: the thin-provisioning-tools release these commands
/// are tested beside (Debian trixie's 1.1.0, tests/thin_tools.rs). LVM reads it
/// to decide which options it may pass; every option its version checks gate
/// (`--clear-needs-check-flag` from 0.3.2, ...) is older than 1.1.0.
pub const TOOLS_VERSION: &str = "1.1.0";

/// One tool, registered once: its multi-call name (`thin_check`), its verb
/// under `dmkit thin`, `era` or `cache` (`check`), and how it runs: `run(display,
/// args)` parses the arguments after the program name (shown in usage as
/// `display`), runs it and returns the exit status.
pub struct Tool {
    pub name: &'static str,
    pub verb: &'static str,
    pub run: fn(&str, Vec<OsString>) -> i32,
}

/// A [`Tool`] whose arguments parse as `$args` and which runs `$run`.
macro_rules! tool {
    ($name:literal, $verb:literal, $args:ty, $run:path) => {
        $crate::thin_cli::Tool {
            name: $name,
            verb: $verb,
            run: |display, args| $crate::thin_cli::parse_run::<$args>(display, args, $run),
        }
    };
}

/// The thin tools.
pub const TOOLS: &[Tool] = &[
    tool!("thin_check", "check", CheckArgs, check::run),
    tool!("thin_dump", "dump", DumpArgs, dump::run_dump),
    tool!("thin_restore", "restore", RestoreArgs, dump::run_restore),
    tool!("thin_repair", "repair", RepairArgs, dump::run_repair),
    tool!("thin_rmap", "rmap", RmapArgs, other::run_rmap),
    tool!("thin_trim", "trim", TrimArgs, other::run_trim),
    tool!("thin_metadata_size", "metadata_size", MetadataSizeArgs, size::run),
    tool!("thin_delta", "delta", DeltaArgs, other::run_delta),
    tool!("thin_ls", "ls", LsArgs, other::run_ls),
];

/// Exit status of a failed tool (sysexits' EX_USAGE, as in 1.x).
pub const EXIT_FAILURE: i32 = 64;

#[derive(Subcommand, Debug, Clone)]
pub enum ThinCmd {
    /// Validate metadata (thin_check)
    Check(CheckArgs),
    /// Write metadata as XML or human-readable text (thin_dump)
    Dump(DumpArgs),
    /// Build metadata from XML (thin_restore)
    Restore(RestoreArgs),
    /// Salvage damaged metadata into a new device or file (thin_repair)
    Repair(RepairArgs),
    /// Which thin blocks map a range of data blocks (thin_rmap)
    Rmap(RmapArgs),
    /// Discard the data device's unused blocks (thin_trim)
    Trim(TrimArgs),
    /// The metadata size a pool needs (thin_metadata_size)
    #[command(name = "metadata_size", alias = "metadata-size")]
    MetadataSize(MetadataSizeArgs),
    /// The differences between two thin devices' mappings (thin_delta)
    Delta(DeltaArgs),
    /// The thin devices of a pool with their usage (thin_ls)
    Ls(LsArgs),
    /// Make the tool names (thin_check, thin_dump, ...) links to this dmkit in DIR
    Links {
        /// Where the links go (e.g. /usr/local/sbin)
        dir: PathBuf,
        /// Replace files of those names that are there
        #[arg(short, long)]
        force: bool,
    },
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_check",
    about = "Validates thin provisioning metadata on a device or file.",
    disable_version_flag = true
)]
pub struct CheckArgs {
    /// The metadata device or file
    #[arg(value_parser = any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Fix trivial damage (leaked blocks) when nothing fatal is found
    #[arg(long, conflicts_with_all = ["ignore_non_fatal_errors", "metadata_snap",
        "override_mapping_root", "override_details_root", "super_block_only", "skip_mappings"])]
    pub auto_repair: bool,
    /// Clear the superblock's needs_check flag when nothing fatal is found
    #[arg(long, conflicts_with_all = ["metadata_snap", "override_mapping_root", "override_details_root"])]
    pub clear_needs_check_flag: bool,
    /// Fail only on fatal errors (leaked blocks are not)
    #[arg(long)]
    pub ignore_non_fatal_errors: bool,
    /// Check the metadata snapshot held on a live pool
    #[arg(short = 'm', long = "metadata-snap")]
    pub metadata_snap: bool,
    /// Print nothing; the exit status tells
    #[arg(short, long)]
    pub quiet: bool,
    /// Check the superblock only
    #[arg(long)]
    pub super_block_only: bool,
    /// Do not check the mapping trees
    #[arg(long)]
    pub skip_mappings: bool,
    /// Use this block as the mapping tree's root
    #[arg(long, value_name = "BLOCKNR")]
    pub override_mapping_root: Option<u64>,
    /// Use this block as the details tree's root
    #[arg(long, value_name = "BLOCKNR")]
    pub override_details_root: Option<u64>,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Xml,
    #[value(name = "human_readable")]
    HumanReadable,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_dump",
    about = "Dump thin-provisioning metadata to stdout in XML format",
    disable_version_flag = true
)]
pub struct DumpArgs {
    /// The metadata device or file
    #[arg(value_parser = any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// The data block size, for a repair that cannot find it
    #[arg(long, value_name = "SECTORS")]
    pub data_block_size: Option<u32>,
    /// Dump only this device (repeatable)
    #[arg(long = "dev-id", value_name = "THIN_ID")]
    pub dev_id: Vec<u64>,
    /// Output format
    #[arg(
        short,
        long,
        value_enum,
        value_name = "TYPE",
        default_value = "xml",
        hide_default_value = true
    )]
    pub format: Format,
    /// Dump the metadata snapshot held on a live pool, or the one at BLOCKNR
    #[arg(short = 'm', long = "metadata-snap", num_args = 0..=1, require_equals = true, value_name = "BLOCKNR")]
    pub metadata_snap: Option<Option<u64>>,
    /// The number of data blocks, for a repair that cannot find it
    #[arg(long, value_name = "NUM")]
    pub nr_data_blocks: Option<u64>,
    /// Write to this file instead of standard output
    #[arg(value_parser = any_path(), short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Print no messages
    #[arg(short, long)]
    pub quiet: bool,
    /// Salvage what damaged metadata still holds while dumping it
    #[arg(short, long, conflicts_with = "metadata_snap")]
    pub repair: bool,
    /// Devices without their mappings
    #[arg(long)]
    pub skip_mappings: bool,
    /// The transaction id, for a repair that cannot find it
    #[arg(long, value_name = "NUM")]
    pub transaction_id: Option<u64>,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

/// The superblock fields a caller may give (restore, repair, dump --repair).
#[derive(Args, Debug, Clone, Default)]
pub struct Overrides {
    /// The data block size, in sectors
    #[arg(long, value_name = "SECTORS")]
    pub data_block_size: Option<u32>,
    /// The number of data blocks
    #[arg(long, value_name = "NUM")]
    pub nr_data_blocks: Option<u64>,
    /// The transaction id
    #[arg(long, value_name = "NUM")]
    pub transaction_id: Option<u64>,
}

/// What thin_restore and thin_repair both take: where from, where to, and the
/// superblock fields a caller gives.
#[derive(Args, Debug, Clone)]
pub struct InOut {
    /// What to read (thin_restore: the XML; thin_repair: the damaged metadata)
    #[arg(value_parser = any_path(), short, long, value_name = "FILE", required = true)]
    pub input: Option<PathBuf>,
    /// The metadata device or file to write
    #[arg(value_parser = any_path(), short, long, value_name = "FILE", required = true)]
    pub output: Option<PathBuf>,
    /// Print no messages
    #[arg(short, long)]
    pub quiet: bool,
    #[command(flatten)]
    pub overrides: Overrides,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_restore",
    about = "Convert XML format metadata to binary.",
    disable_version_flag = true
)]
pub struct RestoreArgs {
    #[command(flatten)]
    pub io: InOut,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_repair",
    about = "Repair thin-provisioning metadata, and write it to different device or file",
    disable_version_flag = true
)]
pub struct RepairArgs {
    #[command(flatten)]
    pub io: InOut,
    /// One positional word is accepted and ignored, as 1.x accepts it (for
    /// callers such as lvconvert that pass one).
    #[arg(hide = true)]
    pub dummy: Option<String>,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_rmap",
    about = "Output reverse map of a thin provisioned region of blocks",
    disable_version_flag = true
)]
pub struct RmapArgs {
    /// The metadata device or file
    #[arg(value_parser = any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// A range of data blocks, BEGIN..END (repeatable)
    #[arg(long, value_name = "BLOCK_RANGE", required = true)]
    pub region: Vec<Region>,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_trim",
    about = "Issue discard requests for free pool space (offline tool).",
    disable_version_flag = true
)]
pub struct TrimArgs {
    /// The pool's metadata device or file
    #[arg(value_parser = any_path(), long, value_name = "FILE", required = true)]
    pub metadata_dev: Option<PathBuf>,
    /// The pool's data device or file
    #[arg(value_parser = any_path(), long, value_name = "FILE", required = true)]
    pub data_dev: Option<PathBuf>,
    /// Print no messages
    #[arg(short, long)]
    pub quiet: bool,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_metadata_size",
    about = "Estimate the size of the metadata device needed for a given configuration.",
    disable_version_flag = true
)]
pub struct MetadataSizeArgs {
    /// The data block size
    #[arg(short = 'b', long, value_name = "SIZE[bskmg]", required = true, value_parser = size::storage_size)]
    pub block_size: Option<u64>,
    /// The largest number of thin devices and snapshots
    #[arg(short = 'm', long, value_name = "NUM", required = true)]
    pub max_thins: Option<u64>,
    /// Print the number only, or with its unit's letter (short) or name (long)
    #[arg(short = 'n', long, value_name = "OPT", num_args = 0..=1, require_equals = true,
          value_parser = ["short", "long"], hide_possible_values = true)]
    pub numeric_only: Option<Option<String>>,
    /// The pool's data size
    #[arg(short = 's', long, value_name = "SIZE[bskmgtp]", required = true, value_parser = size::storage_size)]
    pub pool_size: Option<u64>,
    /// The output unit, one of b s k K m M g G (or its name)
    #[arg(short = 'u', long, value_name = "UNIT", default_value = "sector", value_parser = size::unit_index)]
    pub unit: usize,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_delta",
    about = "Print the differences in the mappings between two thin devices",
    disable_version_flag = true
)]
pub struct DeltaArgs {
    /// The metadata device or file
    #[arg(value_parser = any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Compare the devices of the metadata snapshot held on a live pool
    #[arg(short = 'm', long = "metadata-snap")]
    pub metadata_snap: bool,
    /// Describe each range, shared or not, with its data blocks
    #[arg(long)]
    pub verbose: bool,
    /// The first tree's root block (instead of --thin1)
    #[arg(long, value_name = "BLOCKNR", conflicts_with = "thin1")]
    pub root1: Option<u64>,
    /// The second tree's root block (instead of --thin2)
    #[arg(long, value_name = "BLOCKNR", conflicts_with = "thin2")]
    pub root2: Option<u64>,
    /// The first device
    #[arg(long, value_name = "DEV_ID", visible_alias = "snap1")]
    pub thin1: Option<u64>,
    /// The second device
    #[arg(long, value_name = "DEV_ID", visible_alias = "snap2")]
    pub thin2: Option<u64>,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

#[derive(Parser, Debug, Clone)]
#[command(
    name = "thin_ls",
    about = "List thin volumes within a pool",
    disable_version_flag = true
)]
pub struct LsArgs {
    /// The metadata device or file
    #[arg(value_parser = any_path(), value_name = "INPUT", required = true)]
    pub input: Option<PathBuf>,
    /// Do not print the header line
    #[arg(long)]
    pub no_headers: bool,
    /// List the devices of the metadata snapshot held on a live pool
    #[arg(short = 'm', long = "metadata-snap")]
    pub metadata_snap: bool,
    /// The fields to print, comma separated (DEV, MAPPED_BLOCKS, EXCLUSIVE_BLOCKS,
    /// SHARED_BLOCKS, HIGHEST_BLOCK, the same in _SECTORS and _BYTES, MAPPED,
    /// EXCLUSIVE, SHARED, HIGHEST_MAPPED, TRANSACTION, CREATE_TIME, SNAP_TIME)
    #[arg(short = 'o', long = "format", value_name = "FIELDS", value_delimiter = ',',
          value_parser = LsField::parse)]
    pub format: Vec<LsField>,
    /// Print the version
    #[arg(short = 'V', long, exclusive = true)]
    pub version: bool,
}

/// The tool a program name is, if it is one of [`TOOLS`] (`/usr/sbin/thin_check`).
pub fn tool_named(argv0: &std::ffi::OsStr) -> Option<&'static str> {
    let base = Path::new(argv0).file_name()?.to_str()?;
    all_tools().find(|t| t.name == base).map(|t| t.name)
}

/// The tools as both binaries see a command line: called by a tool's name
/// (`/usr/sbin/thin_check`), that tool; with the word `thin`, `era` or `cache`
/// as the verb (only `--run-dir DIR` before it), that family's verb. The exit
/// status, or None when the command line is neither.
pub fn multi_call(argv: &[OsString]) -> Option<i32> {
    if let Some(tool) = argv.first().and_then(|a| tool_named(a)) {
        return Some(run_tool(tool, tool, argv[1..].to_vec()));
    }
    let i = verb_index(argv);
    let family = argv.get(i)?.to_str()?;
    if !matches!(family, "thin" | "era" | "cache") {
        return None;
    }
    if let Some(dir) = run_dir_before_verb(&argv[..i]) {
        // the tools ask the daemon about /dev/mapper/POOL through the default
        // run directory; single-threaded still, so the environment is ours
        std::env::set_var("DMKIT_RUN_DIR", dir);
    }
    let rest = argv[i + 1..].to_vec();
    Some(match family {
        "era" => era::main(rest),
        "cache" => cache::main(rest),
        _ => main(rest),
    })
}

/// The index of the verb in a dmkit command line: only `--run-dir DIR` (or
/// `--run-dir=DIR`) comes before it.
pub fn verb_index<S: AsRef<std::ffi::OsStr>>(argv: &[S]) -> usize {
    let mut i = 1;
    while let Some(a) = argv.get(i) {
        let a = a.as_ref().to_string_lossy();
        if a == "--run-dir" {
            i += 2;
        } else if a.starts_with("--run-dir=") {
            i += 1;
        } else {
            break;
        }
    }
    i
}

/// `--run-dir DIR` among the words before the verb.
fn run_dir_before_verb(words: &[OsString]) -> Option<OsString> {
    let mut it = words.iter().skip(1);
    while let Some(a) = it.next() {
        if a == "--run-dir" {
            return it.next().cloned();
        }
        if let Some(d) = a.to_str().and_then(|a| a.strip_prefix("--run-dir=")) {
            return Some(d.into());
        }
    }
    None
}

/// Every tool: the thin tools, the era tools and the cache tools.
fn all_tools() -> impl Iterator<Item = &'static Tool> {
    TOOLS.iter().chain(era::TOOLS).chain(cache::TOOLS)
}

/// Run tool `tool` (a name from [`TOOLS`]) on `args` (the arguments after the
/// program name), shown in usage as `display`; returns the exit status.
pub fn run_tool(tool: &str, display: &str, args: Vec<OsString>) -> i32 {
    match all_tools().find(|t| t.name == tool) {
        Some(t) => (t.run)(display, args),
        None => {
            eprintln!("{display}: unknown tool");
            2
        }
    }
}

/// Every tool's arguments carry `-V`.
pub(crate) trait Versioned {
    fn version(&self) -> bool;
}

macro_rules! versioned {
    ($($t:ty),*) => {$(impl $crate::thin_cli::Versioned for $t { fn version(&self) -> bool { self.version } })*};
}

pub mod cache;
pub mod era;
versioned!(
    CheckArgs,
    DumpArgs,
    RmapArgs,
    TrimArgs,
    MetadataSizeArgs,
    DeltaArgs,
    LsArgs
);

impl Versioned for RestoreArgs {
    fn version(&self) -> bool {
        self.io.version
    }
}

impl Versioned for RepairArgs {
    fn version(&self) -> bool {
        self.io.version
    }
}

fn parse_run<A: CommandFactory + FromArgMatches + Versioned>(
    display: &str,
    args: Vec<OsString>,
    run: fn(A) -> Outcome,
) -> i32 {
    let cmd = A::command().bin_name(display.to_string());
    let parsed = cmd
        .try_get_matches_from(std::iter::once(OsString::from(display)).chain(args))
        .and_then(|m| A::from_arg_matches(&m));
    let a = match parsed {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    if a.version() {
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), "{TOOLS_VERSION}");
        return 0;
    }
    match run(a) {
        Ok(()) => 0,
        Err(Failure::Quiet(code)) => code,
        Err(Failure::Message(msg)) => {
            eprintln!("{msg}");
            EXIT_FAILURE
        }
    }
}

/// How a tool fails: with a message for standard error, or with its status only
/// (the report was printed already, or -q asked for silence, or the pipe closed).
#[derive(Debug)]
pub enum Failure {
    Message(String),
    Quiet(i32),
}

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure::Message(e.to_string())
    }
}

pub type Outcome = Result<(), Failure>;

/// `dmkit thin VERB ARGS...`: `args` are the words after `thin`.
pub fn main(args: Vec<OsString>) -> i32 {
    let verb = args.first().and_then(|v| v.to_str()).unwrap_or("");
    let tool = TOOLS
        .iter()
        .find(|t| t.verb == verb || (verb == "metadata-size" && t.verb == "metadata_size"));
    match tool {
        Some(t) => (t.run)(&format!("dmkit thin {}", t.verb), args[1..].to_vec()),
        None => {
            // no verb, --help, or an unknown one: clap explains
            #[derive(Parser)]
            #[command(name = "dmkit thin", bin_name = "dmkit thin")]
            struct Thin {
                #[command(subcommand)]
                _cmd: ThinCmd,
            }
            match Thin::try_parse_from(std::iter::once(OsString::from("dmkit thin")).chain(args)) {
                Ok(Thin {
                    _cmd: ThinCmd::Links { dir, force },
                }) => match links(&dir, force) {
                    Ok(()) => 0,
                    Err(e) => {
                        eprintln!("dmkit thin links: {e}");
                        1
                    }
                },
                Ok(_) => 0,
                Err(e) => {
                    let _ = e.print();
                    e.exit_code()
                }
            }
        }
    }
}

/// The lean binary of the tools: the tools' code without the daemon's, and
/// without OpenSSL (TLS is the daemon's), so a tool starts in 60% of the time.
pub const TOOLS_BIN: &str = "dmkit-tools";

/// Link every tool name in `dir` to the `dmkit-tools` beside the running
/// binary (to the running binary itself when there is none). A link that
/// points there already stays (running it again is harmless), and one to
/// the running dmkit is moved there; any other file of a tool's name is
/// replaced only with `force`, and none is touched until all of them may be.
fn links(dir: &Path, force: bool) -> std::io::Result<()> {
    let running = std::env::current_exe()?;
    let lean = running.with_file_name(TOOLS_BIN);
    let exe = if lean.is_file() { lean } else { running.clone() };
    let err = |p: &Path, e: std::io::Error| std::io::Error::new(e.kind(), format!("{}: {e}", p.display()));
    let mut todo = Vec::new();
    for t in all_tools() {
        let p = dir.join(t.name);
        match p.symlink_metadata() {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => todo.push((p, false)),
            Err(e) => return Err(err(&p, e)),
            Ok(_) if ours(&p, &exe) => println!("{} -> {} (already)", p.display(), exe.display()),
            Ok(_) if force || ours(&p, &running) => todo.push((p, true)),
            Ok(_) => {
                let what = std::fs::read_link(&p)
                    .map(|t| format!("a link to {}", t.display()))
                    .unwrap_or_else(|_| "a file".into());
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "{} is {what}, not this dmkit: nothing linked (--force replaces it)",
                        p.display()
                    ),
                ));
            }
        }
    }
    for (p, replace) in todo {
        if replace {
            std::fs::remove_file(&p).map_err(|e| err(&p, e))?;
        }
        std::os::unix::fs::symlink(&exe, &p).map_err(|e| err(&p, e))?;
        println!("{} -> {}", p.display(), exe.display());
    }
    Ok(())
}

/// Whether `p` is (or leads to) the dmkit binary `exe`.
fn ours(p: &Path, exe: &Path) -> bool {
    match (std::fs::canonicalize(p), std::fs::canonicalize(exe)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// The input checks 1.x makes before it opens metadata: it exists, it is a file or
/// a block device, it is at least one block, and it is not XML.
fn check_input(path: &Path) -> Result<(), Failure> {
    check_input_as(path, true)
}

/// [`check_input`], the XML test only with `xml_check` (era_dump and
/// era_invalidate do not make it).
fn check_input_as(path: &Path, xml_check: bool) -> Result<(), Failure> {
    if !file_or_block_device(&stat(path, "input")?) {
        return Err(Failure::Message(format!(
            "Not a block device or regular file '{}'.",
            path.display()
        )));
    }
    let size = dmkit::pdata::FileDev::open(path, false)
        .map(|d| dmkit::pdata::MetadataDev::nr_blocks(&d) * dmkit::pdata::BLOCK_SIZE as u64)
        .map_err(|e| Failure::Message(format!("Couldn't get file size: {e}")))?;
    if size < dmkit::pdata::BLOCK_SIZE as u64 {
        return Err(Failure::Message(
            "Metadata device/file too small.  Is this binary metadata?".into(),
        ));
    }
    let mut head = [0u8; 16];
    if !xml_check {
        return Ok(());
    }
    if let Ok(mut f) = std::fs::File::open(path) {
        use std::io::Read;
        if f.read_exact(&mut head).is_ok()
            && (head.starts_with(b"<superblock")
                || head.starts_with(b"?xml")
                || head.starts_with(b"<!DOCTYPE"))
        {
            return Err(Failure::Message(
                "This looks like XML.  This tool only supports the binary metadata format.".into(),
            ));
        }
    }
    Ok(())
}

/// A tool's outcome under `-q`: failures keep their status and lose their message.
fn quietly(r: Outcome, quiet: bool) -> Outcome {
    match r {
        Err(Failure::Message(_)) if quiet => Err(Failure::Quiet(EXIT_FAILURE)),
        r => r,
    }
}

/// An input or output (`what`) that must exist, with 1.x's words when it does not.
fn stat(path: &Path, what: &str) -> Result<std::fs::Metadata, Failure> {
    std::fs::metadata(path).map_err(|e| {
        Failure::Message(match e.kind() {
            std::io::ErrorKind::NotFound => match live::mapper_hint(path) {
                Some(hint) if what == "input" => hint,
                _ => format!("Couldn't find {what} file '{}'", path.display()),
            },
            _ => format!("Invalid {what} file: {e}"),
        })
    })
}

fn file_or_block_device(md: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::FileTypeExt;
    md.file_type().is_file() || md.file_type().is_block_device()
}

/// Metadata to read (or, for a repairing check, write), checked as 1.x checks it.
/// Written metadata is claimed first: refused while a pool holds it.
pub fn open_input(path: &Path, writable: bool) -> Result<dmkit::pdata::FileDev, Failure> {
    check_input(path)?;
    let claim = writable.then(|| claim(path)).transpose()?;
    let dev = dmkit::pdata::FileDev::open(path, writable)
        .map_err(|e| Failure::Message(format!("{}: {e}", path.display())))?;
    Ok(match claim {
        Some(c) => dev.with_claim(c),
        None => dev,
    })
}

/// The exclusive claim a tool takes on a file it writes: the daemon holds the
/// files its tables name the same way, so a live pool's metadata or data is
/// refused with EBUSY and the device and process that hold it, as the kernel's
/// exclusive open refuses the reference tools.
pub fn claim(path: &Path) -> Result<dmkit::io::hold::Hold, Failure> {
    dmkit::io::hold::claim(path).map_err(|e| Failure::Message(e.to_string()))
}

/// The output of restore and repair: it must exist and hold a small pool.
pub fn open_output(p: &Path) -> Result<dmkit::pdata::FileDev, Failure> {
    if !file_or_block_device(&stat(p, "output")?) {
        return Err(Failure::Message(
            "Invalid output file: Not a block device or regular file".into(),
        ));
    }
    let claim = claim(p)?;
    let dev = dmkit::pdata::FileDev::open(p, true)
        .map_err(|e| Failure::Message(format!("Invalid output file: {e}")))?
        .with_claim(claim);
    if dmkit::pdata::MetadataDev::nr_blocks(&dev) < 10 {
        return Err(Failure::Message("Output file too small.".into()));
    }
    Ok(dev)
}

/// The parser of every path a tool takes: any bytes, the empty path too, which
/// the tool then reports as a file it cannot find, as 1.x does (clap's own
/// parser for paths refuses an empty value as a usage error).
pub fn any_path() -> impl clap::builder::TypedValueParser<Value = PathBuf> {
    use clap::builder::TypedValueParser as _;
    clap::builder::OsStringValueParser::new().map(PathBuf::from)
}

/// The path of a required argument (clap has checked it is there).
fn req(p: Option<PathBuf>) -> PathBuf {
    p.unwrap_or_default()
}

/// Write `s` to standard output; a closed pipe ends the tool quietly.
fn emit(s: &str) -> Outcome {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(s.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if broken_pipe(&e) => Err(Failure::Quiet(EXIT_FAILURE)),
        Err(e) => Err(Failure::Message(format!("output error: {e}"))),
    }
}

/// A cache or era tool's failure: quiet on a closed pipe (as 1.x), else the
/// message.
pub fn metadata_fail(e: dmkit::pdata::error::MetadataError) -> Failure {
    match &e {
        dmkit::pdata::error::MetadataError::Output(io) if broken_pipe(io) => Failure::Quiet(EXIT_FAILURE),
        _ => Failure::Message(e.to_string()),
    }
}

/// Whether an error is a closed output pipe (the tools end silently then).
pub fn broken_pipe(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::BrokenPipe
}
