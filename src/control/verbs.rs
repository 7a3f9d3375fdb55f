//! The dmsetup verbs as clap parses them: the CLI parses them first (for help and
//! errors without a daemon), and the daemon parses the same words again with
//! `try_parse_from`, so both sides agree on every flag.

use clap::{Args, Parser, Subcommand};

/// The device-mapper verbs, with dmsetup's names, flags and output.
#[derive(Subcommand, Debug, Clone)]
pub enum DmVerb {
    /// Create a device, load its table and resume it (the table comes from
    /// standard input without --table)
    Create {
        /// Device name (also the NBD export name)
        name: String,
        #[command(flatten)]
        table: TableArgs,
        /// Make the device read-only
        #[arg(short, long)]
        readonly: bool,
        /// The device's uuid
        #[arg(short, long)]
        uuid: Option<String>,
    },
    /// Load a table into the inactive slot (resume makes it live)
    #[command(visible_alias = "reload")]
    Load {
        name: String,
        #[command(flatten)]
        table: TableArgs,
    },
    /// Suspend a device: new I/O waits, in-flight I/O drains, then a flush
    Suspend {
        name: String,
        /// Do not flush outstanding I/O
        #[arg(long)]
        noflush: bool,
        /// Accepted for dmsetup compatibility (no file system to freeze)
        #[arg(long)]
        nolockfs: bool,
    },
    /// Resume a device, swapping in the inactive table if there is one
    Resume { name: String },
    /// Remove a device
    #[command(visible_alias = "rm")]
    Remove {
        name: String,
        /// Replace the table with `error` first (the remove still fails while the
        /// device is open)
        #[arg(short, long)]
        force: bool,
        /// Remove at the last close if the device is open now
        #[arg(long)]
        deferred: bool,
    },
    /// Drop the inactive table
    Clear { name: String },
    /// Rename a device, or give a device without a uuid one
    Rename {
        name: String,
        /// The new name
        #[arg(required_unless_present = "setuuid", conflicts_with = "setuuid")]
        new_name: Option<String>,
        /// Set the uuid instead of the name
        #[arg(long)]
        setuuid: Option<String>,
    },
    /// Send a message to the target at SECTOR (words are split on white space)
    Message {
        name: String,
        sector: String,
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true, trailing_var_arg = true)]
        message: Vec<String>,
    },
    /// Print each target's status line
    Status(ShowArgs),
    /// Print each target's table line
    Table(ShowArgs),
    /// Print device information (the long form, or columns with -c)
    Info {
        name: Option<String>,
        /// Columns: one line per device
        #[arg(short = 'c', long)]
        columns: bool,
        /// Fields to print with -c (comma-separated; `help` lists them)
        #[arg(short = 'o', long, requires = "columns")]
        options: Option<String>,
        /// No heading line with -c
        #[arg(long, requires = "columns")]
        noheadings: bool,
        /// Column separator with -c
        #[arg(long, requires = "columns")]
        separator: Option<String>,
    },
    /// List devices
    Ls {
        /// Show each device over the devices it maps onto
        #[arg(long)]
        tree: bool,
        /// Only devices with a target of this type
        #[arg(long)]
        target: Option<String>,
    },
    /// List the devices each device maps onto
    Deps { name: Option<String> },
    /// List the target types and their versions
    Targets,
    /// Print the daemon's version
    Version,
    /// dmkit's own: the backing files under a device and the flushes each received
    Stats { name: String },
    /// dmkit's own: make a device a kernel block device through ublk (ublk_drv,
    /// Linux 6.5+): /dev/ublkbN, and /dev/mapper/NAME pointing at it
    Attach {
        name: String,
        /// Take over the block device with this ublk id that a previous daemon
        /// served (what `serve --restore` does)
        #[arg(long, value_name = "ID")]
        recover: Option<u32>,
    },
    /// dmkit's own: remove a device's block device (refused while mounted)
    Detach { name: String },
    /// dmkit's own: the device whose table holds the file or block device PATH
    /// (what a tool refused with EBUSY names)
    #[command(hide = true)]
    Holder { path: std::path::PathBuf },
}

#[derive(Args, Debug, Clone)]
pub struct TableArgs {
    /// A table line `<start> <length> <target> <args>`; repeat for several lines
    #[arg(long = "table")]
    pub lines: Vec<String>,
    /// Create the device without a table
    #[arg(long, conflicts_with = "lines")]
    pub notable: bool,
    /// The caller's working directory, which relative paths in the table are
    /// resolved against (the CLI sends it)
    #[arg(long, hide = true, value_name = "DIR")]
    pub cwd: Option<std::path::PathBuf>,
}

impl TableArgs {
    /// Whether the table is to come from standard input.
    pub fn from_stdin(&self) -> bool {
        self.lines.is_empty() && !self.notable
    }
}

#[derive(Args, Debug, Clone)]
pub struct ShowArgs {
    pub name: Option<String>,
    /// Only lines of targets of this type
    #[arg(long)]
    pub target: Option<String>,
    /// The inactive table (loaded, not yet resumed) instead of the live one
    #[arg(long)]
    pub inactive: bool,
}

/// What the daemon parses a control request with.
#[derive(Parser, Debug)]
#[command(name = "dmkit", no_binary_name = true, disable_help_subcommand = true)]
pub struct Request {
    #[command(subcommand)]
    pub verb: DmVerb,
}

/// A clap error as dmkit reports errors: one line, naming the command and where
/// to find its help. `None` for `--help` and `--version`, which are not errors.
pub fn one_line(e: &clap::Error, command: &str) -> Option<String> {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        return None;
    }
    // An unknown verb is the parent command's error.
    let command = match e.kind() {
        ErrorKind::InvalidSubcommand => command.rsplit_once(' ').map_or(command, |(p, _)| p),
        _ => command,
    };
    let text = e.render().to_string();
    let first = text.lines().next().unwrap_or("invalid arguments");
    let first = first.strip_prefix("error: ").unwrap_or(first);
    Some(format!("{command}: {first} (see '{command} --help')"))
}
