//! The thin tools (`thin_check`, `thin_dump`, ... as thin-provisioning-tools
//! 1.x has them): their arguments, and `dmkit thin VERB`.

mod check;
mod dump;

mod other;

use super::*;

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
#[command(about = "Convert XML format metadata to binary.", disable_version_flag = true)]
pub struct RestoreArgs {
    #[command(flatten)]
    pub io: InOut,
}

#[derive(Parser, Debug, Clone)]
#[command(
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
#[command(about = "List thin volumes within a pool", disable_version_flag = true)]
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

/// `dmkit thin VERB ARGS...`: `args` are the words after `thin`.
pub fn main(args: Vec<OsString>) -> i32 {
    super::family_main::<ThinCmd>("thin", TOOLS, args, |cmd| match cmd {
        ThinCmd::Links { dir, force } => match links(&dir, force) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("dmkit thin links: {e}");
                1
            }
        },
        _ => 0,
    })
}
