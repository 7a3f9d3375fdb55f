//! The dmsetup verbs as clap parses them: the CLI parses them first (for help and
//! errors without a daemon), and the daemon parses the same words again with
//! `try_parse_from`, so both sides agree on every flag.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// The device-mapper verbs, with dmsetup's names, flags and output.
#[derive(Subcommand, Debug, Clone)]
pub enum DmVerb {
    /// Create a device, load its table and resume it (the table comes from
    /// standard input without --table)
    #[command(
        after_help = "A table line is `<start> <length> <target> <args>`, start and length in \
512-byte sectors (2097152 sectors = 1 GiB); the lines cover the device from sector 0 without gaps. \
`dmkit targets` lists the target types; the kernel's Documentation/admin-guide/device-mapper/ \
describes each one's arguments, and the manual's recipes (docs/manual/) use them.

Examples:
  truncate -s 1G a.img
  dmkit create lin --table \"0 2097152 linear $PWD/a.img 0\"
  echo \"0 2097152 zero\" | dmkit create z
  dmkit create empty --notable        # a device without a table; `load` then `resume`"
    )]
    Create {
        /// Device name (also the NBD export name; /dev/mapper/NAME in other tables)
        name: String,
        #[command(flatten)]
        table: TableArgs,
        /// Create the device without a table
        #[arg(long, conflicts_with = "lines")]
        notable: bool,
        /// Make the device read-only
        #[arg(short, long)]
        readonly: bool,
        /// The device's uuid
        #[arg(short, long)]
        uuid: Option<String>,
        /// Give the device this minor number (kept across restarts), as
        /// dmsetup's --minor does; refused if a device has it
        #[arg(short, long)]
        minor: Option<u32>,
    },
    /// Load a table into the inactive slot (resume makes it live); the table
    /// comes from standard input without --table
    #[command(
        visible_alias = "reload",
        after_help = "Example (grow a linear device to 2 GiB):
  dmkit load lin --table \"0 4194304 linear $PWD/a.img 0\"
  dmkit table lin --inactive          # what resume will make live
  dmkit resume lin"
    )]
    Load {
        name: String,
        #[command(flatten)]
        table: TableArgs,
        /// A read-only table: the device is read-only once it is resumed
        /// (without --readonly or --writable the device keeps its mode)
        #[arg(long, conflicts_with = "writable")]
        readonly: bool,
        /// A writable table: the device is writable once it is resumed
        #[arg(long)]
        writable: bool,
    },
    /// Suspend devices: new I/O waits, in-flight I/O drains, then a flush
    #[command(after_help = "Example:
  dmkit suspend vol && dmkit message pool 0 \"create_snap 1 0\" && dmkit resume vol")]
    Suspend {
        #[command(flatten)]
        devs: Devices,
        /// Do not flush outstanding I/O
        #[arg(long)]
        noflush: bool,
        /// Accepted for dmsetup compatibility (no file system to freeze)
        #[arg(long)]
        nolockfs: bool,
    },
    /// Resume devices, swapping in the inactive table if there is one
    #[command(after_help = "Example:
  dmkit load lin --table \"0 2097152 zero\" && dmkit resume lin")]
    Resume {
        #[command(flatten)]
        devs: Devices,
    },
    /// Remove devices
    #[command(
        visible_alias = "rm",
        after_help = "A device that another device's table uses, or that an NBD client has open, \
cannot go now: --deferred marks it, and it goes when its last user does. An attached device \
needs `dmkit detach` first.

Examples:
  dmkit remove top fast               # several at once, users first
  dmkit remove --deferred fast        # marked now, removed at its last close"
    )]
    Remove {
        #[command(flatten)]
        devs: Devices,
        /// Replace the table with `error` first (the remove still fails while the
        /// device is open)
        #[arg(short, long)]
        force: bool,
        /// Remove at the last close, or when the last table using it goes, if the
        /// device is in use now
        #[arg(long)]
        deferred: bool,
    },
    /// Remove every device, users before the devices they use
    #[command(
        name = "remove_all",
        alias = "remove-all",
        after_help = "Example:
  dmkit remove_all --force"
    )]
    RemoveAll {
        /// Replace open devices' tables with `error` first
        #[arg(short, long)]
        force: bool,
        /// Mark devices still in use for removal at their last close
        #[arg(long)]
        deferred: bool,
    },
    /// Drop the inactive table
    #[command(after_help = "Example:
  dmkit load lin --table \"0 2097152 zero\" && dmkit clear lin   # the load is undone")]
    Clear {
        #[command(flatten)]
        devs: Devices,
    },
    /// Rename a device, or give a device without a uuid one
    #[command(after_help = "Examples:
  dmkit rename top bottom
  dmkit rename bottom --setuuid dmkit-0001")]
    Rename {
        name: String,
        /// The new name
        #[arg(required_unless_present = "setuuid", conflicts_with = "setuuid")]
        new_name: Option<String>,
        /// Set the uuid instead of the name
        #[arg(long)]
        setuuid: Option<String>,
    },
    /// Send a message to the target at SECTOR of a device's live table
    #[command(
        after_help = "The message goes to the target whose table line covers SECTOR (0: the \
first line). Its words may be given as one argument or several; they are split on white space, \
as the kernel splits them. Each target's messages are its kernel's (thin-pool: create_thin, \
create_snap, delete, set_transaction_id, reserve_metadata_snap, release_metadata_snap; \
writecache: flush, flush_on_suspend, cleaner, clear_stats; flakey, delay: none).

Examples:
  dmkit message pool 0 \"create_thin 0\"
  dmkit message pool 0 create_snap 1 0
  dmkit message mycache 0 flush"
    )]
    Message {
        /// The device
        name: String,
        /// The sector (in 512-byte sectors) the message's target covers; 0 for
        /// a one-target table
        sector: String,
        /// The message's words
        #[arg(required = true, num_args = 1.., allow_hyphen_values = true, trailing_var_arg = true)]
        message: Vec<String>,
    },
    /// Print each target's status line
    #[command(after_help = "Examples:
  dmkit status pool                   # 0 20971520 thin-pool 0 10/4096 0/163840 ...
  dmkit status                        # every device, each line after `NAME: `
  dmkit status --target thin")]
    Status(ShowArgs),
    /// Print each target's table line
    #[command(after_help = "Examples:
  dmkit table top                     # 0 4194304 linear 511:0 0
  dmkit table top --inactive")]
    Table(ShowArgs),
    /// Print device information (the long form, or columns with -c)
    #[command(after_help = "Examples:
  dmkit info vol
  dmkit info -c -o name,open,attr
  dmkit info -c -o help               # the fields")]
    Info {
        #[command(flatten)]
        devs: AnyDevices,
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
    #[command(after_help = "Examples:
  dmkit ls
  dmkit ls --tree
  dmkit ls --target thin-pool")]
    Ls {
        /// Show each device over the devices it maps onto
        #[arg(long)]
        tree: bool,
        /// Only devices with a target of this type
        #[arg(long)]
        target: Option<String>,
    },
    /// List the devices each device maps onto
    #[command(after_help = "Example:
  dmkit deps top                      # 1 dependencies  : (511, 0)")]
    Deps {
        #[command(flatten)]
        devs: AnyDevices,
    },
    /// Wait until a device's event counter exceeds EVENT_NR (default 0), as
    /// dmsetup wait does
    #[command(
        after_help = "A device's events are its targets' (a thin pool passing its low \
water mark or running out of space, a snapshot becoming invalid, an I/O error a target reports) \
and its own (a rename, a new uuid, remove --force's error table). \
`dmkit info NAME` shows the counter (Event number).

Example:
  dmkit wait pool $(dmkit info -c --noheadings -o events pool)   # the next event"
    )]
    Wait {
        /// The device
        name: String,
        /// The event number to wait beyond
        event_nr: Option<u64>,
        /// Accepted for dmsetup compatibility
        #[arg(long)]
        noflush: bool,
    },
    /// Accepted for dmsetup compatibility; does nothing: dmkit's devices have no
    /// device nodes (`attach` makes /dev/mapper/NAME for an attached device)
    #[command(after_help = "Example:
  dmkit mknodes")]
    Mknodes {
        /// Ignored
        names: Vec<String>,
    },
    /// Accepted for dmsetup compatibility; does nothing: dmkit makes no udev
    /// events, so there are no udev cookies to complete
    #[command(
        name = "udevcomplete_all",
        after_help = "Example:
  dmkit udevcomplete_all"
    )]
    UdevcompleteAll {
        /// Ignored (dmsetup: only cookies older than this many minutes)
        age: Option<u64>,
    },
    /// List the target types and their versions
    #[command(after_help = "Example:
  dmkit targets                       # linear v1.4.0, thin-pool v1.23.0, ...")]
    Targets,
    /// Print the daemon's version
    #[command(after_help = "Example:
  dmkit version")]
    Version,
    /// dmkit's own: the backing files under a device and the flushes each
    /// received; with --server, what the NBD server holds
    #[command(after_help = "Examples:
  dmkit stats pool                    # /…/meta.img flushes=3, /…/data.img flushes=3
  dmkit stats --server                # reactors=2 connections=1 per_reactor=1,0 handshakes=0 buffer_bytes=…")]
    Stats {
        /// The NBD server's reactor threads, connections (in their handshake and
        /// after it, and on each reactor) and the bytes of buffers it holds, instead
        /// of a device's files
        #[arg(long, conflicts_with_all = ["names", "uuid", "minor"])]
        server: bool,
        #[command(flatten)]
        devs: AnyDevices,
    },
    /// dmkit's own: make a device a kernel block device through ublk (ublk_drv,
    /// Linux 6.5+): /dev/ublkbN, and /dev/mapper/NAME pointing at it; or, with
    /// --vhost-user, a virtual machine's disk
    #[command(after_help = "Examples:
  modprobe ublk_drv && dmkit attach vol   # prints /dev/ublkb0
  dmkit attach vol --vhost-user /run/vol.sock   # then: qemu ... -chardev socket,id=c0,path=/run/vol.sock,reconnect=1 -device vhost-user-blk-pci,chardev=c0")]
    Attach {
        name: String,
        /// Take over the block device with this ublk id that a previous daemon
        /// served (what `serve --restore` does)
        #[arg(long, value_name = "ID", conflicts_with = "vhost_user")]
        recover: Option<u32>,
        /// Serve the device as a vhost-user-blk disk on this unix socket instead,
        /// for a virtual machine (QEMU's vhost-user-blk-pci, Cloud Hypervisor's
        /// vhost_user disk); needs no kernel module
        #[arg(long, value_name = "SOCKET")]
        vhost_user: Option<std::path::PathBuf>,
    },
    /// dmkit's own: remove a device's block device (refused while mounted)
    #[command(after_help = "Example:
  umount /mnt/vol && dmkit detach vol")]
    Detach {
        name: String,
        /// A vhost-user disk: stop serving it although a virtual machine is
        /// connected (its I/O waits until a frontend reconnects elsewhere)
        #[arg(long)]
        force: bool,
    },
    /// dmkit's own: the device whose table holds the file or block device PATH
    /// (what a tool refused with EBUSY names)
    #[command(hide = true)]
    Holder { path: std::path::PathBuf },
    /// dmkit's own: mount the devices as files for programs behind the door
    /// (`dmkit exec` asks); prints their folder
    #[command(hide = true)]
    DeviceFiles,
}

/// The devices a verb acts on: names, or one device picked by uuid or number.
#[derive(Args, Debug, Clone)]
pub struct Devices {
    /// Device names (several: each in turn, as dmsetup does)
    #[arg(value_name = "NAME", required_unless_present_any = ["uuid", "minor"])]
    pub names: Vec<String>,
    #[command(flatten)]
    pub pick: Pick,
}

/// Devices for a verb that acts on every device when none is named.
#[derive(Args, Debug, Clone)]
pub struct AnyDevices {
    /// Device names (none: every device)
    #[arg(value_name = "NAME")]
    pub names: Vec<String>,
    #[command(flatten)]
    pub pick: Pick,
}

/// dmsetup's other ways to name a device.
#[derive(Args, Debug, Clone, Default)]
pub struct Pick {
    /// The device with this uuid
    #[arg(short = 'u', long = "uuid", value_name = "UUID")]
    pub uuid: Option<String>,
    /// With --minor: the device with this number (dmkit's devices have major 511)
    #[arg(short = 'j', long, value_name = "MAJOR", requires = "minor")]
    pub major: Option<u32>,
    /// With --major: the device with this minor number
    #[arg(short = 'm', long, value_name = "MINOR", requires = "major")]
    pub minor: Option<u32>,
}

#[derive(Args, Debug, Clone)]
pub struct TableArgs {
    /// A table line `<start> <length> <target> <args>` (512-byte sectors); repeat
    /// for several lines
    #[arg(long = "table", value_name = "LINE")]
    pub lines: Vec<String>,
    /// The caller's working directory, which relative paths in the table are
    /// resolved against (the CLI sends it)
    #[arg(long, hide = true, value_name = "DIR")]
    pub cwd: Option<std::path::PathBuf>,
}

impl TableArgs {
    /// Whether the table is to come from standard input (`notable`: create's
    /// --notable).
    pub fn from_stdin(&self, notable: bool) -> bool {
        self.lines.is_empty() && !notable
    }
}

#[derive(Args, Debug, Clone)]
pub struct ShowArgs {
    #[command(flatten)]
    pub devs: AnyDevices,
    /// Only lines of targets of this type
    #[arg(long)]
    pub target: Option<String>,
    /// The inactive table (loaded, not yet resumed) instead of the live one
    #[arg(long)]
    pub inactive: bool,
    /// Print dm-crypt keys; without it they are shown as zeros of their length
    /// (as dmsetup does)
    #[arg(long)]
    pub showkeys: bool,
}

/// What the daemon parses a control request with.
#[derive(Parser, Debug)]
#[command(name = "dmkit", no_binary_name = true, disable_help_subcommand = true)]
pub struct Request {
    /// The client's run directory (the CLI takes it anywhere on the line; the
    /// daemon ignores it)
    #[arg(long, global = true, hide = true, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    #[command(subcommand)]
    pub verb: DmVerb,
}

/// A clap error as dmkit reports errors: one line, naming the command, what is
/// missing or unknown, a suggestion if clap has one, and where to find its help.
/// `None` for `--help` and `--version`, which are not errors.
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
    let mut lines = text.lines();
    let first = lines.next().unwrap_or("invalid arguments");
    let mut msg = first.strip_prefix("error: ").unwrap_or(first).to_string();
    // "the following required arguments were not provided:" lists them on the
    // indented lines that follow
    if msg.ends_with(':') {
        let listed: Vec<&str> = lines
            .clone()
            .take_while(|l| l.starts_with("  ") && !l.trim().is_empty())
            .map(str::trim)
            .collect();
        msg.push(' ');
        msg.push_str(&listed.join(" "));
    }
    for tip in text.lines().filter_map(|l| l.trim().strip_prefix("tip: ")) {
        match tip.split_once(" exists: ") {
            Some((_, what)) => msg.push_str(&format!("; did you mean {what}?")),
            None => msg.push_str(&format!("; {tip}")),
        }
    }
    Some(format!("{command}: {msg} (see '{command} --help')"))
}
