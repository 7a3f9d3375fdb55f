//! The `dmkit` command: `serve` runs the daemon; the dmsetup verbs talk to it with
//! dmsetup's semantics and output; `thin` holds the thin-provisioning-tools verbs.

mod tools;

use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use dmkit::control::verbs::{one_line, DmVerb};
use dmkit::daemon::{default_run_dir, serve, ServeOptions};
use dmkit::export::nbd::tls::Mode as TlsMode;
use dmkit::sync::Unpoison;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Linux device-mapper in userspace, served over NBD.
#[derive(Parser, Debug)]
#[command(
    name = "dmkit",
    version,
    disable_help_subcommand = true,
    after_help = "The run directory holds control.sock and nbd.sock: --run-dir, else $DMKIT_RUN_DIR, else /run/dmkit (root), $XDG_RUNTIME_DIR/dmkit, or /tmp/dmkit-<uid> without XDG_RUNTIME_DIR.

Start: dmkit serve --background && dmkit create z --table \"0 2097152 zero\" && dmkit ls"
)]
struct Cli {
    /// The daemon's run directory (control.sock, nbd.sock), before or after the verb
    #[arg(long, global = true, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the daemon: the control socket and the NBD export
    #[command(after_help = "Examples:
  dmkit serve --background            # returns once the daemon answers; log in RUN_DIR/serve.log
  dmkit serve --demo                  # a thin pool, a thin volume and a snapshot to try
  dmkit serve --group disk            # sockets mode 0660, group disk: its members may use dmkit
  dmkit serve --nbd-listen 0.0.0.0:10809 --tls require --tls-psk keys.psk   # NBD over TCP and TLS
  dmkit serve --restore --background  # after a crash: the previous daemon's devices again")]
    Serve(ServeArgs),
    /// The thin-provisioning-tools commands, option for option as thin_check,
    /// thin_dump, ... 1.x (a link named thin_check to dmkit is thin_check)
    #[command(subcommand)]
    Thin(tools::thin::ThinCmd),
    /// The era tools of thin-provisioning-tools, option for option as era_check,
    /// era_dump, era_restore and era_invalidate 1.x (a link named era_check to
    /// dmkit is era_check)
    #[command(subcommand)]
    Era(tools::era::EraCmd),
    /// The cache tools of thin-provisioning-tools, option for option as
    /// cache_check, cache_dump, cache_restore, cache_repair, cache_metadata_size
    /// and cache_writeback 1.x (a link named cache_check to dmkit is cache_check)
    #[command(subcommand)]
    Cache(tools::cache::CacheCmd),
    /// Print a completion script for a shell (bash, zsh, fish, elvish, powershell)
    Completions { shell: clap_complete::Shell },
    /// Print a `linear` table that maps a device onto FILE's blocks, one line per
    /// extent, over the block device holding FILE (FIEMAP; preallocate FILE with
    /// fallocate first). `dmkit extents FILE | dmkit create NAME` makes the device
    Extents { file: PathBuf },
    /// Follow a device's background work until it ends, showing what is left on
    /// a terminal: a snapshot-merge's merge, a writecache's write-back (send
    /// `cleaner` or `flush` first, else new writes keep it going), or a cache's
    /// (dm-cache) dirty blocks written back (under the `cleaner` policy)
    Progress { name: String },
    /// Crash trials: a seeded random workload on simulated disks that lose and
    /// tear unflushed writes, a crash, then the stack reopened and checked. A
    /// failing trial prints the command that replays it
    Sim(SimArgs),
    /// Replay a log-writes log (the kernel's format: written by a `log-writes`
    /// table, the kernel's dm-log-writes or QEMU's blklogwrites) onto TARGET,
    /// a file or block device, entry by entry: to its end, or through a mark,
    /// the first N entries or the N-th flush
    #[command(after_help = "Examples:
  dmkit replay log.img replay.img --until mark:before-upgrade
  dmkit replay log.img replay.img --until flush:3     # as the device was after its 3rd flush
  dmkit replay log.img --list                         # what the log holds, one line per entry
  dmkit replay log.img fs.img --check-at fua --check 'fsck.ext4 -fn {}'")]
    Replay(ReplayArgs),
    /// Run PROGRAM with device-mapper's door open to this run directory's
    /// daemon: its /dev/mapper/control reaches dmkit, so the real dmsetup (and
    /// other programs built on libdevmapper) drive dmkit's devices unmodified
    #[command(
        after_help = "The program runs with a preloaded library (LD_PRELOAD) that answers \
/dev/mapper/control (and $DM_DEV_DIR/mapper/control) with the daemon's dm ioctl door \
(RUN_DIR/dm-ioctl.sock), and /proc/devices and /proc/misc with a device-mapper line. The \
environment also gets DM_DISABLE_UDEV=1 (there are no uevents: libdevmapper makes the device \
nodes itself), DMKIT_RUN_DIR, and DM_DEV_DIR=RUN_DIR/dev unless DM_DEV_DIR is set (the nodes \
libdevmapper makes name dmkit's device numbers, which no kernel driver serves: they are kept out \
of /dev). Statically linked programs are not covered.

Examples:
  dmkit exec -- dmsetup version
  dmkit exec -- dmsetup create z --table \"0 2097152 zero\"
  dmkit exec -- dmsetup info -c
  dmkit exec -- bash                  # a shell whose device-mapper is dmkit"
    )]
    Exec {
        /// The program and its arguments
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "PROGRAM"
        )]
        program: Vec<String>,
    },
    /// LUKS1 and LUKS2 headers: the crypt table line that opens a volume with
    /// its passphrase, and what a header says
    #[command(
        subcommand,
        after_help = "Examples:
  dmkit luks dump disk.img
  dmkit luks table disk.img --key-file pw   # 0 ... crypt aes-xts-plain64 <key> 0 disk.img 32768"
    )]
    Luks(LuksCmd),
    /// Verity hash devices: the verity table line that opens a data device
    /// with the tree `veritysetup format` wrote and its root hash, and what
    /// the tree's superblock says
    #[command(
        subcommand,
        after_help = "Examples:
  dmkit verity dump hash.img
  dmkit verity table data.img hash.img ROOT_HASH --name v   # a read-only device v"
    )]
    Verity(VerityCmd),
    /// Serve TopoLVM's lvmd protocol (its node plugin's LVService and
    /// VGService) from this daemon's thin pools, and CSI's SnapshotMetadata
    /// (allocated and changed blocks of thin snapshots); runs until SIGTERM
    #[command(
        after_help = "FILE is lvmd's YAML (socket-name, device-classes); a device class is \
a dmkit thin pool: `type: thin` and `thin-pool: {name: POOL, overprovision-ratio: R}`, POOL \
being a dmkit thin-pool device. A volume is a thin device of that pool and a dmkit device named \
LV (VG-LV where the class names a volume-group), made a kernel block device with `attach` \
unless --no-attach. A record of each volume goes to --state; a lvmd stopped half-way through a \
change finishes or undoes it when it starts again.

Example (lvmd.yaml):
  socket-name: /run/topolvm/lvmd.sock
  device-classes:
    - name: thin
      default: true
      type: thin
      thin-pool: {name: pool, overprovision-ratio: 10.0}

  dmkit lvmd --config lvmd.yaml --snapshot-metadata unix:/run/dmkit/snapshot-metadata.sock"
    )]
    Lvmd(LvmdArgs),
    #[command(flatten)]
    Dm(DmVerb),
}

#[derive(clap::Args, Debug)]
struct LvmdArgs {
    /// lvmd's configuration file (YAML)
    #[arg(long, value_name = "FILE", default_value = "/etc/topolvm/lvmd.yaml")]
    config: PathBuf,
    /// Leave volumes as dmkit devices (/dev/mapper/NAME, served over NBD)
    /// instead of attaching each as a ublk block device
    #[arg(long)]
    no_attach: bool,
    /// Also serve CSI's SnapshotMetadata service, on this unix socket
    /// (unix:PATH)
    #[arg(long, value_name = "unix:PATH")]
    snapshot_metadata: Option<String>,
    /// The CSI driver name the Identity service beside SnapshotMetadata
    /// answers (the driver whose snapshots these are)
    #[arg(long, value_name = "NAME", default_value = "topolvm.io")]
    csi_driver_name: String,
    /// SnapshotMetadata's ranges: `fixed` (one per pool block,
    /// FIXED_LENGTH) or `variable` (runs of blocks, VARIABLE_LENGTH)
    #[arg(long, value_name = "KIND", default_value = "fixed", value_parser = ["fixed", "variable"])]
    block_metadata: String,
    /// The directory of lvmd's records, one file per volume [default:
    /// RUN_DIR/lvmd]
    #[arg(long, value_name = "DIR")]
    state: Option<PathBuf>,
    /// For tests only: exit (status 137) after this many steps of changes,
    /// as a kill would stop it
    #[arg(long, hide = true, value_name = "N")]
    test_exit_after_steps: Option<u64>,
    /// For tests only: SnapshotMetadata reads pages of N runs of blocks
    /// (65,536 otherwise), so a small volume's answer spans pages
    #[arg(long, hide = true, value_name = "N")]
    test_page_runs: Option<usize>,
}

#[derive(Subcommand, Debug)]
enum VerityCmd {
    /// Print the verity table line that `veritysetup open DATA NAME HASH
    /// ROOT_HASH` loads (as `dmsetup table` shows it), from the superblock at
    /// the start of HASH (or at --hash-offset); with --name, create that
    /// device, read-only, in the daemon instead
    #[command(after_help = "Examples:
  veritysetup format ro.img ro.hash | tee ro.fmt                    # Root hash: 4a6f...
  dmkit verity table ro.img ro.hash 4a6f...    # 0 16384 verity 1 ro.img ro.hash 4096 4096 2048 1 sha256 4a6f... <salt>
  dmkit verity table ro.img ro.hash 4a6f... --name checked         # create it directly")]
    Table {
        /// The data device or image file
        data: PathBuf,
        /// The hash device or file, with its superblock
        hash: PathBuf,
        /// The root hash `veritysetup format` printed (hex)
        root_hash: String,
        /// Where the superblock is on HASH, in bytes (veritysetup's --hash-offset)
        #[arg(long, value_name = "BYTES", default_value_t = 0)]
        hash_offset: u64,
        /// Create the device NAME (read-only) with the table instead of printing it
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
    },
    /// Print what a verity superblock says: uuid, hash type, algorithm, block
    /// sizes, data blocks, salt, and where the tree lies (a summary, not
    /// veritysetup's text)
    Dump {
        /// The hash device or file
        hash: PathBuf,
        /// Where the superblock is, in bytes (veritysetup's --hash-offset)
        #[arg(long, value_name = "BYTES", default_value_t = 0)]
        hash_offset: u64,
    },
}

#[derive(Subcommand, Debug)]
enum LuksCmd {
    /// Print the crypt table line that opens DEVICE's LUKS volume, as `dmsetup
    /// table --showkeys` shows the one `cryptsetup open` loads; with --name,
    /// create that device in the daemon instead (the key stays off command
    /// lines). The passphrase is read from --key-file (all of it), else from
    /// standard input (up to its first newline). Exit status 2: no keyslot
    /// opens with the passphrase
    #[command(after_help = "Examples:
  dmkit luks table vol.img --key-file pw                       # 0 2064384 crypt aes-xts-plain64 <key> 0 vol.img 32768 1 sector_size:4096
  dmkit create secret --table \"$(dmkit luks table vol.img --key-file pw)\"
  printf 'my passphrase' | dmkit luks table /dev/sdb --name secret   # create it directly")]
    Table {
        /// The LUKS device or image file (also the table's device)
        device: PathBuf,
        /// Read the passphrase from FILE (all of it, as cryptsetup --key-file)
        #[arg(long, value_name = "FILE")]
        key_file: Option<PathBuf>,
        /// Try this keyslot only
        #[arg(long, value_name = "N")]
        key_slot: Option<u32>,
        /// Create the device NAME with the table instead of printing it
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
    },
    /// Print what a LUKS header says: version, uuid, cipher, sector size, data
    /// offset, keyslots with their KDFs (a summary, not cryptsetup's text)
    Dump {
        /// The LUKS device or image file
        device: PathBuf,
    },
}

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("judging").args(["check", "judge"])))]
struct ReplayArgs {
    /// The log device or file
    log: PathBuf,
    /// The file or block device to write the replay onto (not with --list alone)
    target: Option<PathBuf>,
    /// Where to stop: mark:NAME, entry:N (the first N entries) or flush:N
    #[arg(long, value_name = "WHERE")]
    until: Option<String>,
    /// Print each entry replayed: its number, flags, sector and count in
    /// the log's blocks, and a mark's text
    #[arg(long)]
    list: bool,
    /// After the stop, these entries too (numbers, comma-separated): the
    /// crash state --crash-states names
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    with_entries: Vec<u64>,
    /// Check every state a crash could have left instead: for each flush
    /// epoch, the device at the flush before it plus any subset of the
    /// epoch's writes and any prefix of its FUA writes, built on TARGET
    /// (the device before the log began) and judged by --check or --judge
    #[arg(long, requires = "judging")]
    crash_states: bool,
    /// The judge of a state: a shell command, `{}` replaced by TARGET's
    /// path; exit 0 accepts the state (e.g. 'fsck.ext4 -fn {}'). With
    /// --crash-states or --check-at
    #[arg(long, value_name = "COMMAND")]
    check: Option<String>,
    /// Instead of --check: a shell command started once that judges every
    /// state in turn: it reads a line, TARGET's path, on its standard
    /// input and answers a line, `ok` to accept (anything else refuses the
    /// state and says why); no process is started per state
    #[arg(long, value_name = "COMMAND")]
    judge: Option<String>,
    /// Replay with --check run on TARGET after each entry of this kind:
    /// fua (each FUA write, a journal's commit), flush, mark or entry; the
    /// replay stops at the first state refused
    #[arg(
        long,
        value_name = "KIND",
        requires = "judging",
        conflicts_with = "crash_states"
    )]
    check_at: Option<String>,
    /// With --check-at: the checks begin after this entry (mark:NAME,
    /// entry:N or flush:N), e.g. the mark set after mkfs
    #[arg(long, value_name = "WHERE", requires = "check_at")]
    check_from: Option<String>,
    /// States tried per epoch, at most: all of them when there are no more,
    /// else this many chosen with --seed
    #[arg(long, default_value_t = 1024)]
    max_states: u64,
    /// The seed that chooses states when an epoch has too many
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(clap::Args, Debug)]
struct SimArgs {
    /// The stack: thin (thin-pool, thins, snapshots), writecache, snapshot,
    /// cache (writeback smq, switched to cleaner and back), era, raid (raid1
    /// of two legs, reloaded now and then), raid5 (three legs, likewise),
    /// integrity (journal mode, reloaded now and then), integrity-bitmap,
    /// cdp (every flush a point, retention dropping points for room)
    #[arg(long, default_value = "thin")]
    stack: String,
    /// The first trial's seed
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Number of trials (seeds seed, seed+1, ...)
    #[arg(long, default_value_t = 1)]
    trials: u64,
    /// Operations per trial before the crash
    #[arg(long, default_value_t = 120)]
    ops: usize,
    /// Test-only fault: write the thin-pool superblock without the flush before it
    #[arg(long)]
    break_commit_order: bool,
    /// Inject no I/O errors (by default one trial in four fails one I/O)
    #[arg(long)]
    no_io_errors: bool,
    /// Keep going after a failing trial
    #[arg(long)]
    keep_going: bool,
    /// Directory for the trials' files (default /dev/shm)
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
    /// Thin: also run the reference thin_check (thin-provisioning-tools 1.x) on
    /// the crash image and the recovered metadata of every Nth seed, which must
    /// agree with dmkit's checker (0: never)
    #[arg(long, value_name = "N", default_value_t = 50)]
    ref_check_every: u64,
    /// The crash is a kill of the daemon (every write issued is kept), and every
    /// write acknowledged before it must be there after it: checks the restart
    /// logs of thin pools, writecaches and cdp devices
    #[arg(long)]
    kill: bool,
    /// Run every trial twice and fail those whose two runs did not do the same
    /// I/O in the same order (a trial must replay from its seed alone)
    #[arg(long)]
    check_replay: bool,
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// Run in the background: return once the sockets are listening and the
    /// devices are made (exit status 0), or with the error that stopped the
    /// start (1); the daemon's log goes to RUN_DIR/serve.log. Under systemd
    /// (Type=notify), READY=1 goes to $NOTIFY_SOCKET either way
    #[arg(long)]
    background: bool,
    /// Also serve NBD over TCP on this address
    #[arg(long, value_name = "ADDR:PORT")]
    nbd_listen: Option<String>,
    /// NBD I/O threads, each serving many connections (0: one per core)
    #[arg(long, value_name = "N", default_value_t = 0)]
    nbd_reactors: usize,
    /// TLS on the NBD sockets (unix and TCP)
    #[arg(long, value_enum, default_value_t = TlsMode::Off)]
    tls: TlsMode,
    /// The X.509 credentials: ca-cert.pem, server-cert.pem, server-key.pem
    #[arg(long, value_name = "DIR")]
    tls_certificates: Option<PathBuf>,
    /// Require a client certificate signed by the ca-cert.pem of --tls-certificates
    #[arg(long)]
    tls_verify_peer: bool,
    /// Pre-shared keys: one 'identity:hexkey' a line, as psktool writes them
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Limit export EXPORT to TLS clients of these identities (PSK identities, or
    /// the common names of client certificates under --tls-verify-peer); others,
    /// plain clients included, see no such export. Repeatable, one per export
    #[arg(long, value_name = "EXPORT=ID[,ID...]")]
    tls_allow: Vec<String>,
    /// Let this group use the sockets (mode 0660)
    #[arg(long)]
    group: Option<String>,
    /// Run the demo: a thin pool with a volume and a snapshot, and a zero device
    #[arg(long)]
    demo: bool,
    /// The demo's directory (implies --demo)
    #[arg(long, value_name = "DIR")]
    demo_dir: Option<PathBuf>,
    /// Use the page cache instead of O_DIRECT on backing files
    #[arg(long)]
    buffered: bool,
    /// The copy engine's sub-job size (kcopyd), 1 to 1024 KiB
    #[arg(long, value_name = "KB", default_value_t = 512,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    copy_subjob_kb: u64,
    /// Write a writecache back in the pre-2019 order (oldest block first) instead
    /// of by origin sector; for benchmarks of the two orders on one build
    #[arg(long)]
    writecache_lru_writeback: bool,
    /// Make the devices the previous daemon had again (recorded in the run
    /// directory's devices.state, or devices.prev where a daemon started without
    /// --restore set them aside) and take over their ublk block devices, whose
    /// requests the kernel held meanwhile
    #[arg(long)]
    restore: bool,
    /// Make every device a kernel block device through ublk (as `dmkit attach`)
    /// when a table is resumed on it, and remove that block device with it: the
    /// /dev/mapper/NAME nodes programs behind the door (LVM) make then open the
    /// device, and filesystems on it mount (needs root and ublk_drv)
    #[arg(long)]
    attach: bool,
    /// Serve device NAME as a vhost-user-blk disk on unix socket SOCKET (as
    /// `dmkit attach NAME --vhost-user SOCKET`) once a table is resumed on it;
    /// repeatable
    #[arg(long, value_name = "NAME=SOCKET", value_parser = name_and_socket)]
    vhost_user: Vec<(String, PathBuf)>,
    /// How long a thin pool out of data space queues writes before failing them
    /// (the kernel's dm_thin_pool.no_space_timeout; 0: queue until space comes)
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    thin_no_space_timeout: u64,
    /// How long an NBD client has to finish the handshake before it is dropped
    #[arg(long, value_name = "MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    nbd_handshake_timeout_ms: u64,
    /// Do backing I/O with a synchronous queue instead of io_uring (where a
    /// seccomp policy or an old kernel refuses io_uring, this is what happens
    /// anyway)
    #[arg(long)]
    no_io_uring: bool,
    /// For tests only: how often a thin pool commits while it has changes
    /// (the kernel's is fixed at 1 s)
    #[arg(long, value_name = "MS", hide = true)]
    test_thin_commit_period_ms: Option<u64>,
    /// For tests only: delay a thin pool's discard passdown by this much
    #[arg(long, value_name = "MS", hide = true)]
    test_passdown_delay_ms: Option<u64>,
    /// For tests only: delay a thin pool's discards by this much
    #[arg(long, value_name = "MS", hide = true)]
    test_discard_delay_ms: Option<u64>,
    /// For tests only: the records a thin pool's or a writecache's restart log
    /// holds (writes beyond wait for a commit)
    #[arg(long, value_name = "N", hide = true,
          value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    test_restart_log_records: Option<u64>,
    /// For tests and benchmarks only: keep freed memory in the heap instead of
    /// giving it back after each change
    #[arg(long, hide = true)]
    test_no_memory_trim: bool,
    /// For tests only: accept the `__panic` message, with which any client of
    /// the control socket or the door can make a worker panic
    #[arg(long, hide = true)]
    test_panics: bool,
}

fn main() {
    let argv_os: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Called as thin_check, thin_dump, ... (multi-call, as pdata_tools), or
    // `dmkit thin|era|cache ...`: the tools, as the lean dmkit-tools runs them.
    if let Some(code) = tools::multi_call(&argv_os) {
        std::process::exit(code);
    }
    let argv: Vec<String> = argv_os.iter().map(|a| a.to_string_lossy().into_owned()).collect();
    let cli = match Cli::try_parse_from(&argv) {
        Ok(c) => c,
        Err(e) => {
            // The command as far as it names a verb: `dmkit suspend`, `dmkit thin check`.
            let words = verb_words(&argv);
            let depth = if words
                .first()
                .is_some_and(|w| w == "thin" || w == "era" || w == "cache")
            {
                2
            } else {
                1
            };
            let cmd = std::iter::once("dmkit")
                .chain(
                    words
                        .iter()
                        .take(depth)
                        .take_while(|w| !w.starts_with('-'))
                        .map(String::as_str),
                )
                .collect::<Vec<_>>()
                .join(" ");
            match one_line(&e, &cmd) {
                Some(msg) => {
                    eprintln!("{msg}");
                    std::process::exit(2);
                }
                None => e.exit(),
            }
        }
    };
    match run(cli, &argv) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // the parent of `serve --background` prints it, if this is its child
            tell_parent(&format!("{e:#}"));
            eprintln!("dmkit: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Log lines on stderr; RUST_LOG filters them (default: info).
fn init_log() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
}

/// `dmkit serve`.
fn serve_cmd(run_dir: PathBuf, a: ServeArgs) -> Result<i32> {
    if a.background {
        // before any thread starts: the child goes on, the parent waits
        daemonise(&run_dir)?;
    }
    init_log();
    let demo =
        (a.demo || a.demo_dir.is_some()).then(|| a.demo_dir.unwrap_or_else(|| PathBuf::from("dmkit-demo")));
    let ready = a.background.then(|| background(&run_dir)).transpose()?;
    serve(ServeOptions {
        run_dir,
        nbd_listen: a.nbd_listen,
        nbd_reactors: a.nbd_reactors,
        tls: dmkit::export::nbd::tls::Options {
            mode: a.tls,
            certificates: a.tls_certificates,
            verify_peer: a.tls_verify_peer,
            psk: a.tls_psk,
            allow: a.tls_allow,
        },
        group: a.group,
        demo,
        direct_io: !a.buffered,
        copy_subjob_kb: a.copy_subjob_kb,
        writecache_lru_writeback: a.writecache_lru_writeback,
        restore: a.restore,
        attach: a.attach,
        vhost_user: a.vhost_user,
        tuning: dmkit::daemon::Tuning {
            thin_no_space_timeout: Duration::from_secs(a.thin_no_space_timeout),
            nbd_handshake_timeout: Duration::from_millis(a.nbd_handshake_timeout_ms),
            no_io_uring: a.no_io_uring,
            test_thin_commit_period: a.test_thin_commit_period_ms.map(Duration::from_millis),
            test_passdown_delay: a.test_passdown_delay_ms.map(Duration::from_millis),
            test_discard_delay: a.test_discard_delay_ms.map(Duration::from_millis),
            test_restart_log_records: a.test_restart_log_records.map(|n| n as usize),
            test_no_memory_trim: a.test_no_memory_trim,
            test_panics: a.test_panics,
        },
        ready,
    })?;
    Ok(0)
}

/// `dmkit lvmd`.
fn lvmd_cmd(run_dir: PathBuf, a: LvmdArgs) -> Result<i32> {
    init_log();
    let snapshot_metadata = match a.snapshot_metadata.as_deref() {
        None => None,
        Some(s) => match s.strip_prefix("unix:") {
            Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
            _ => anyhow::bail!(
                "--snapshot-metadata {s}: unix:PATH (the socket the snapshot-metadata sidecar's --csi-address names; the sidecar serves TLS)"
            ),
        },
    };
    if !a.no_attach {
        // said now rather than by every CreateLV; the kernel's nbd client is no
        // fallback: its devices fail their I/O when the daemon restarts
        dmkit::export::ublk::available().map_err(|e| {
            anyhow::anyhow!(
                "lvmd makes each volume a ublk block device, and {e}; or run lvmd with --no-attach \
                 (each volume then a dmkit device only, served over NBD and the dm ioctl door)"
            )
        })?;
    }
    dmkit::lvmd::run(dmkit::lvmd::Options {
        config: a.config,
        state: a.state.unwrap_or_else(|| run_dir.join("lvmd")),
        run_dir,
        attach: !a.no_attach,
        snapshot_metadata,
        csi_driver_name: a.csi_driver_name,
        variable_length: a.block_metadata == "variable",
        test_exit_after_steps: a.test_exit_after_steps,
        test_page_runs: a.test_page_runs,
    })
    .map_err(anyhow::Error::msg)?;
    Ok(0)
}

fn run(cli: Cli, argv: &[String]) -> Result<i32> {
    let run_dir = cli.run_dir.clone().unwrap_or_else(default_run_dir);
    match cli.cmd {
        Cmd::Serve(a) => serve_cmd(run_dir, a),
        // dispatched before parsing; here only if that ever changes
        Cmd::Thin(_) => Ok(tools::thin::main(
            verb_words(argv).iter().skip(1).map(Into::into).collect(),
        )),
        Cmd::Era(_) => Ok(tools::era::main(
            verb_words(argv).iter().skip(1).map(Into::into).collect(),
        )),
        Cmd::Cache(_) => Ok(tools::cache::main(
            verb_words(argv).iter().skip(1).map(Into::into).collect(),
        )),
        Cmd::Lvmd(a) => lvmd_cmd(run_dir, a),
        Cmd::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "dmkit", &mut std::io::stdout());
            Ok(0)
        }
        Cmd::Extents { file } => {
            print!("{}", dmkit::extents::linear_table(&file)?);
            Ok(0)
        }
        Cmd::Progress { name } => follow(&run_dir.join("control.sock"), &name),
        Cmd::Sim(a) => sim(a),
        Cmd::Replay(a) => replay_cmd(a),
        Cmd::Exec { program } => exec(&run_dir, &program),
        Cmd::Luks(cmd) => Ok(luks(&run_dir, cmd)),
        Cmd::Verity(cmd) => Ok(verity(&run_dir, cmd)),
        Cmd::Dm(verb) => client(&run_dir, &verb, verb_words(argv)),
    }
}

/// `dmkit luks ...`: its exit status, the error printed (2 for a passphrase no
/// keyslot takes, as cryptsetup's open).
fn luks(run_dir: &Path, cmd: LuksCmd) -> i32 {
    use dmkit::targets::crypt::luks;
    match cmd {
        LuksCmd::Dump { device } => match luks::read_header(&device) {
            Ok(h) => {
                print!("{}", h.summary());
                0
            }
            Err(e) => {
                eprintln!("dmkit luks dump: {e}");
                e.exit_code()
            }
        },
        LuksCmd::Table {
            device,
            key_file,
            key_slot,
            name,
        } => {
            let pw = match &key_file {
                Some(f) => std::fs::File::open(f)
                    .map_err(|e| format!("{}: {e}", f.display()))
                    .and_then(|r| {
                        luks::read_passphrase(std::io::BufReader::new(r), true).map_err(|e| e.to_string())
                    }),
                None => prompt_passphrase(&device),
            };
            let pw = match pw {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("dmkit luks table: {e}");
                    return 1;
                }
            };
            let table = match luks::table(&device, pw.as_slice(), key_slot, &device.to_string_lossy()) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("dmkit luks table: {e}");
                    return e.exit_code();
                }
            };
            drop(pw);
            match name {
                None => {
                    println!("{}", table.as_str());
                    0
                }
                Some(name) => create_or_say(run_dir, &name, table.as_bytes(), false, "luks table"),
            }
        }
    }
}

/// `dmkit verity ...`: its exit status, the error printed.
fn verity(run_dir: &Path, cmd: VerityCmd) -> i32 {
    use dmkit::targets::verity::superblock;
    let (out, name, verb) = match cmd {
        VerityCmd::Dump { hash, hash_offset } => (
            superblock::read(&hash, hash_offset).map(|sb| sb.summary()),
            None,
            "verity dump",
        ),
        VerityCmd::Table {
            data,
            hash,
            root_hash,
            hash_offset,
            name,
        } => (
            superblock::table(&data, &hash, &root_hash, hash_offset).map(|t| format!("{t}\n")),
            name,
            "verity table",
        ),
    };
    match (out, name) {
        (Err(e), _) => {
            eprintln!("dmkit {verb}: {e}");
            1
        }
        (Ok(text), None) => {
            print!("{text}");
            0
        }
        (Ok(table), Some(name)) => create_or_say(run_dir, &name, table.as_bytes(), true, verb),
    }
}

/// [`create_from`], its error printed as `verb`'s: the exit status.
fn create_or_say(run_dir: &Path, name: &str, table: &[u8], readonly: bool, verb: &str) -> i32 {
    match create_from(run_dir, name, table, readonly) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dmkit {verb}: {e:#}");
            1
        }
    }
}

/// The passphrase from standard input, up to its newline; on a terminal,
/// asked for with the echo off (restored whatever happens to the read).
fn prompt_passphrase(device: &Path) -> std::result::Result<dmkit::targets::crypt::LockedBytes, String> {
    use rustix::termios::{tcgetattr, tcsetattr, LocalModes, OptionalActions};
    let stdin = std::io::stdin();
    let Ok(saved) = tcgetattr(&stdin) else {
        // not a terminal
        return dmkit::targets::crypt::luks::read_passphrase(stdin.lock(), false).map_err(|e| e.to_string());
    };
    eprint!("Enter passphrase for {}: ", device.display());
    let mut quiet = saved.clone();
    quiet.local_modes.remove(LocalModes::ECHO);
    tcsetattr(&stdin, OptionalActions::Now, &quiet).map_err(|e| format!("turning the echo off: {e}"))?;
    let pw = dmkit::targets::crypt::luks::read_passphrase(stdin.lock(), false).map_err(|e| e.to_string());
    let _ = tcsetattr(&stdin, OptionalActions::Now, &saved);
    eprintln!();
    pw
}

/// Create device `name` with `table`, sent as `dmkit create NAME` sends a
/// table read from its standard input.
fn create_from(run_dir: &Path, name: &str, table: &[u8], readonly: bool) -> Result<i32> {
    let cwd = std::env::current_dir().context("the current directory")?;
    let mut words = vec![
        "create".to_string(),
        name.to_string(),
        "--cwd".to_string(),
        cwd.to_string_lossy().into_owned(),
    ];
    if readonly {
        words.push("--readonly".into());
    }
    let mut s = connect(&run_dir.join("control.sock"))?;
    let (ok, out, err) = dmkit::control::call(&mut s, &words, table)?;
    print!("{out}");
    if !ok {
        for line in err.trim_end().lines() {
            eprintln!("dmkit create: {line}");
        }
        return Ok(1);
    }
    Ok(0)
}

/// `dmkit exec -- PROGRAM [ARGS...]`: replace this process by PROGRAM with the
/// dm ioctl door preloaded.
fn exec(run_dir: &Path, program: &[String]) -> Result<i32> {
    use std::os::unix::process::CommandExt;
    let run_dir = std::path::absolute(run_dir).with_context(|| format!("{}", run_dir.display()))?;
    let lib = dmkit::control::preload::install_for_user(&run_dir)
        .with_context(|| format!("writing the door's library into {}", run_dir.display()))?;
    let (prog, args) = program
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("dmkit exec: a program to run is required"))?;
    let mut cmd = std::process::Command::new(prog);
    cmd.args(args);
    let preload = match std::env::var_os("LD_PRELOAD") {
        Some(p) if !p.is_empty() => {
            let mut v = lib.clone().into_os_string();
            v.push(":");
            v.push(p);
            v
        }
        _ => lib.clone().into_os_string(),
    };
    cmd.env("LD_PRELOAD", preload)
        .env("DMKIT_DOOR_SOCKET", run_dir.join(dmkit::control::door::SOCKET))
        .env("DMKIT_RUN_DIR", &run_dir)
        .env("DM_DISABLE_UDEV", "1");
    // the devices as files, so a program can open /dev/mapper/NAME (none when no
    // daemon answers yet: the door then says so at the first ioctl)
    match device_files(&run_dir) {
        Ok(dir) => {
            cmd.env("DMKIT_DEVICE_FILES", dir)
                .env_remove("DMKIT_DEVICE_FILES_ERROR");
        }
        Err(why) => {
            cmd.env("DMKIT_DEVICE_FILES_ERROR", why)
                .env_remove("DMKIT_DEVICE_FILES");
        }
    }
    if std::env::var_os("DM_DEV_DIR").is_none() {
        let dev = lib.parent().unwrap_or(&run_dir).join("dev");
        std::fs::create_dir_all(dev.join("mapper"))
            .with_context(|| format!("creating {}/mapper", dev.display()))?;
        cmd.env("DM_DEV_DIR", dev);
    }
    let e = cmd.exec();
    anyhow::bail!("dmkit exec: running {prog}: {e}")
}

/// Ask the daemon to serve its devices as files: their folder, or why not.
fn device_files(run_dir: &Path) -> std::result::Result<std::path::PathBuf, String> {
    let mut s = UnixStream::connect(run_dir.join("control.sock")).map_err(|e| {
        format!(
            "no dmkit daemon at {} ({e})",
            run_dir.join("control.sock").display()
        )
    })?;
    match dmkit::control::call(&mut s, &["device-files".to_string()], b"") {
        Ok((true, out, _)) => Ok(out.trim_end().into()),
        Ok((false, _, err)) => Err(err.trim_end().to_string()),
        Err(e) => Err(format!("asking the daemon for its device files: {e}")),
    }
}

/// `dmkit replay`: a replay, with checks along it, or the crash states.
fn replay_cmd(a: ReplayArgs) -> Result<i32> {
    use dmkit::targets::log_writes::replay::Judge;
    let judge = match (a.check, a.judge) {
        (Some(c), _) => Some(Judge::Each(c)),
        (None, Some(j)) => Some(Judge::serve(&j).map_err(|e| anyhow::anyhow!("replay: {e}"))?),
        (None, None) => None,
    };
    let target = a.target.as_deref();
    match (a.crash_states, judge) {
        (true, Some(mut judge)) => replay_crash_states(&a.log, target, &mut judge, a.seed, a.max_states),
        (false, Some(judge)) => {
            let at = a.check_at.ok_or_else(|| {
                anyhow::anyhow!("replay: say when to check with --check-at (fua, flush, mark, entry), or use --crash-states")
            })?;
            let checks = ReplayChecks {
                judge,
                at,
                from: a.check_from,
            };
            replay(
                &a.log,
                target,
                a.until.as_deref(),
                &a.with_entries,
                a.list,
                Some(checks),
            )
        }
        _ => replay(&a.log, target, a.until.as_deref(), &a.with_entries, a.list, None),
    }
}

fn replay_crash_states(
    log: &std::path::Path,
    target: Option<&std::path::Path>,
    judge: &mut dmkit::targets::log_writes::replay::Judge,
    seed: u64,
    max_states: u64,
) -> Result<i32> {
    let target = target.ok_or_else(|| {
        anyhow::anyhow!(
            "replay --crash-states: name a TARGET holding the device as it was before the log began"
        )
    })?;
    let c = dmkit::targets::log_writes::replay::crash_states(log, target, judge, seed, max_states)
        .map_err(|e| anyhow::anyhow!("replay: {e}"))?;
    let sampled = if c.sampled > 0 {
        format!(" ({} of them sampled with --seed {seed})", c.sampled)
    } else {
        String::new()
    };
    match c.failed {
        Some(f) => {
            println!("{f}");
            println!(
                "checked {} crash states in {} epochs{sampled}: one refused",
                c.states, c.epochs
            );
            Ok(1)
        }
        None => {
            println!(
                "checked {} crash states in {} epochs{sampled}: all accepted",
                c.states, c.epochs
            );
            Ok(0)
        }
    }
}

/// `dmkit replay --check CMD|--judge CMD --check-at KIND [--check-from WHERE]`.
struct ReplayChecks {
    judge: dmkit::targets::log_writes::replay::Judge,
    at: String,
    from: Option<String>,
}

fn replay(
    log: &std::path::Path,
    target: Option<&std::path::Path>,
    until: Option<&str>,
    with: &[u64],
    list: bool,
    mut checks: Option<ReplayChecks>,
) -> Result<i32> {
    use dmkit::targets::log_writes::replay::{replay, CheckAt, Checks, Until};
    if target.is_none() && (!list || checks.is_some()) {
        anyhow::bail!("replay: name a TARGET to replay onto, or --list to only list the entries");
    }
    let until = until
        .map_or(Ok(Until::End), Until::parse)
        .map_err(|e| anyhow::anyhow!("replay: {e}"))?;
    let mut checks = checks
        .as_mut()
        .map(|c| -> Result<Checks> {
            Ok(Checks {
                at: CheckAt::parse(&c.at).map_err(|e| anyhow::anyhow!("replay: {e}"))?,
                from: c.from.as_deref().map(Until::parse).transpose().map_err(|e| {
                    anyhow::anyhow!("replay: {}", e.to_string().replacen("--until", "--check-from", 1))
                })?,
                judge: &mut c.judge,
            })
        })
        .transpose()?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let r = replay(
        log,
        target,
        &until,
        with,
        list.then_some(&mut out as &mut dyn std::io::Write),
        checks.as_mut(),
    )
    .map_err(|e| anyhow::anyhow!("replay: {e}"))?;
    drop(out);
    if let Some(c) = &checks {
        if let Some(f) = &r.failed {
            println!("{f}");
            println!("checked {} states: one refused", r.checked + 1);
            return Ok(1);
        }
        if r.checked == 0 {
            // a check that never ran is not a pass
            anyhow::bail!(
                "replay: no {} entry{} in the log: nothing was checked",
                c.at.name(),
                if c.from.is_some() {
                    " after --check-from"
                } else {
                    ""
                }
            );
        }
        println!("checked {} states: all accepted", r.checked);
    }
    if !r.reached {
        anyhow::bail!(
            "replay: the log ended after {} entries without reaching {until}",
            r.entries
        );
    }
    if target.is_some() {
        eprintln!(
            "replayed {} entries: {} writes, {} discards, {} flushes, {} marks",
            r.entries, r.writes, r.discards, r.flushes, r.marks
        );
    }
    Ok(0)
}

fn sim(a: SimArgs) -> Result<i32> {
    use dmkit::sim;
    if std::env::var_os("DMKIT_SIM_TRACE").is_some() {
        // the targets' own log lines between the simulator's
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_writer(std::io::stderr)
            .with_target(false)
            .init();
    }
    let stack = sim::Stack::parse(&a.stack).ok_or_else(|| {
        anyhow::anyhow!(
            "--stack {}: one of thin, writecache, snapshot, cache, era, raid, raid5, integrity, integrity-bitmap, cdp",
            a.stack
        )
    })?;
    let o = sim::Options {
        stack,
        seed: a.seed,
        ops: a.ops,
        break_commit_order: a.break_commit_order,
        io_errors: !a.no_io_errors,
        dir: a.dir.unwrap_or_else(sim::default_dir),
        ref_check_every: a.ref_check_every,
        kill: a.kill,
        no_restart_logs: false,
        check_replay: a.check_replay,
    };
    let t = std::time::Instant::now();
    let s = sim::run_trials(&o, a.trials, !a.keep_going);
    for (cmd, why) in &s.failures {
        println!("FAILED: {why}\n  replay: {cmd}");
    }
    // every count of the breakdown is of the passed trials, and adds up to them
    let passed = s.trials - s.failures.len() as u64;
    println!(
        "{} trials of {}: {passed} passed, {} failed; the passed ones crashed {} times at a flush inside a \
         commit, {} after a chosen write and {} after the last operation ({} of them in the middle of an \
         operation), {} hit an injected I/O error, {} metadata images checked by the reference thin_check \
         too; {} writes acknowledged, {} flushes, {} sectors checked after crashes{}; {:.1} s",
        s.trials,
        stack.name(),
        s.failures.len(),
        s.at_commit_flush,
        s.at_write,
        s.at_end,
        s.crashed_mid_op,
        s.with_io_errors,
        s.ref_checked,
        s.acked_writes,
        s.flushes,
        s.sectors_checked,
        match stack {
            sim::Stack::Cache => format!(
                "; {} blocks promoted, {} written back by the cleaner",
                s.promotions, s.writebacks
            ),
            sim::Stack::Era => format!("; {} era marks checked", s.era_blocks_checked),
            sim::Stack::Raid5 => format!(
                "; {} sectors not checked in rows a crash while degraded may have torn (the write hole)",
                s.write_hole_sectors
            ),
            _ => String::new(),
        },
        t.elapsed().as_secs_f64()
    );
    Ok(if s.failures.is_empty() { 0 } else { 1 })
}

/// The write end of the ready pipe of `serve --background`, in the child.
static READY_PIPE: std::sync::Mutex<Option<std::io::PipeWriter>> = std::sync::Mutex::new(None);

/// `serve --background`: fork. The parent waits on a pipe for the child's word
/// (ready, or the error that stopped it) and exits with it; the child leaves
/// the terminal's session, with its log in RUN_DIR/serve.log, and returns.
fn daemonise(run_dir: &Path) -> Result<()> {
    use std::io::Write;
    std::fs::create_dir_all(run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let log_path = run_dir.join("serve.log");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .with_context(|| format!("opening {}", log_path.display()))?;
    let (mut rx, tx) = std::io::pipe().context("making the ready pipe")?;
    // SAFETY: no other thread exists yet (this runs before the daemon starts
    // any), so the child is a whole copy of this process.
    match unsafe { libc::fork() } {
        -1 => Err(std::io::Error::last_os_error()).context("fork"),
        0 => {
            drop(rx);
            let null = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")?;
            use std::os::fd::AsRawFd;
            for (from, to) in [(null.as_raw_fd(), 0), (null.as_raw_fd(), 1), (log.as_raw_fd(), 2)] {
                // SAFETY: plain descriptor calls on descriptors this process owns.
                if unsafe { libc::dup2(from, to) } < 0 {
                    return Err(std::io::Error::last_os_error()).context("redirecting the daemon's output");
                }
            }
            // SAFETY: setsid has no memory effects; it fails only for a group leader,
            // which a fresh child is not.
            unsafe { libc::setsid() };
            *READY_PIPE.lock().unpoisoned() = Some(tx);
            Ok(())
        }
        pid => {
            drop(tx);
            let mut word = String::new();
            let _ = rx.read_to_string(&mut word);
            if let Some(notes) = word.strip_prefix("ready\n") {
                for line in notes.lines() {
                    println!("dmkit serve: {line}");
                }
                println!(
                    "dmkit serve: running in the background (pid {pid}); control {}, log {}",
                    run_dir.join("control.sock").display(),
                    log_path.display()
                );
                let _ = std::io::stdout().flush();
                std::process::exit(0);
            }
            let why = if word.is_empty() {
                format!(
                    "the daemon (pid {pid}) exited before it was ready; see {}",
                    log_path.display()
                )
            } else {
                word
            };
            eprintln!("dmkit serve: {why}");
            std::process::exit(1);
        }
    }
}

/// The daemon's ready word for the waiting parent, and the lines it prints first.
fn background(_run_dir: &Path) -> Result<dmkit::daemon::Ready> {
    Ok(Box::new(|notes: &str| tell_parent(&format!("ready\n{notes}"))))
}

/// Send the parent of `serve --background` its word (once; no-op otherwise).
fn tell_parent(word: &str) {
    use std::io::Write;
    if let Some(mut tx) = READY_PIPE.lock().unpoisoned().take() {
        let _ = tx.write_all(word.as_bytes());
    }
}

/// The words from the verb on: the daemon parses them again. Only `--run-dir`
/// comes before the verb.
fn verb_words(argv: &[String]) -> &[String] {
    argv.get(tools::verb_index(argv)..).unwrap_or(&[])
}

fn client(run_dir: &Path, verb: &DmVerb, words: &[String]) -> Result<i32> {
    let from_stdin = match verb {
        DmVerb::Create { table, notable, .. } => table.from_stdin(*notable),
        DmVerb::Load { table, .. } => table.from_stdin(false),
        _ => false,
    };
    let mut stdin = Vec::new();
    if from_stdin {
        std::io::stdin()
            .read_to_end(&mut stdin)
            .context("reading the table from standard input")?;
    }
    let sock = run_dir.join("control.sock");
    let mut s = connect(&sock)?;
    let progress = match verb {
        DmVerb::Message { name, message, .. }
            if std::io::IsTerminal::is_terminal(&std::io::stderr())
                && message.iter().any(|m| m.trim().eq_ignore_ascii_case("flush")) =>
        {
            Some(flush_progress(sock.clone(), name.clone()))
        }
        _ => None,
    };
    // relative paths in a table are the caller's, as the kernel resolves them
    let mut words = words.to_vec();
    if let DmVerb::Create { table, .. } | DmVerb::Load { table, .. } = verb {
        if table.cwd.is_none() {
            let cwd = std::env::current_dir().context("the current directory")?;
            words.extend(["--cwd".to_string(), cwd.to_string_lossy().into_owned()]);
        }
    }
    let words = words.as_slice();
    let (ok, out, err) = dmkit::control::call(&mut s, words, &stdin)?;
    if let Some((stop, h)) = progress {
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let _ = h.join();
    }
    print!("{out}");
    if !ok {
        let name = words.first().map_or("", String::as_str);
        // one line per error (several when several devices were named)
        for line in err.trim_end().lines() {
            eprintln!("dmkit {name}: {line}");
        }
        return Ok(1);
    }
    Ok(0)
}

/// Connect to the daemon's control socket, saying what is wrong when that fails:
/// no daemon there, or one this user may not talk to.
fn connect(sock: &Path) -> Result<UnixStream> {
    match UnixStream::connect(sock) {
        Ok(s) => Ok(s),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            use std::os::unix::fs::MetadataExt;
            let owner = std::fs::metadata(sock)
                .map(|m| {
                    format!(
                        " (mode {:04o}, owner uid {} gid {})",
                        m.mode() & 0o7777,
                        m.uid(),
                        m.gid()
                    )
                })
                .unwrap_or_default();
            anyhow::bail!(
                "permission denied on the dmkit daemon's socket {}{owner}: the daemon is running, but \
                 this user may not use it; run as its user, or start the daemon with \
                 `dmkit serve --group GROUP` (sockets mode 0660) and join that group",
                sock.display()
            )
        }
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            anyhow::bail!(
                "no dmkit daemon at {} ({e}): start one with `dmkit serve --background`, or name its \
                 run directory (--run-dir DIR or DMKIT_RUN_DIR)",
                sock.display()
            )
        }
        Err(e) => Err(e).with_context(|| format!("cannot reach the dmkit daemon at {}", sock.display())),
    }
}

/// What a device's status says about its background work.
enum Work {
    /// Still going: what is left, as a line for the user.
    Left(String),
    Done(String),
    Failed(String),
    /// No snapshot-merge, writecache or cache target.
    None,
}

/// Read the background work from a device's status lines; `first` is the
/// amount left when following began (for a percentage).
fn work(name: &str, status: &str, first: &mut Option<u64>) -> Work {
    for line in status.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.get(2).copied() {
            Some("snapshot-merge") => {
                let rest = f.get(3..).unwrap_or(&[]).join(" ");
                let used = f
                    .get(3)
                    .and_then(|x| x.split_once('/'))
                    .and_then(|x| x.0.parse::<u64>().ok());
                let (Some(used), Some(meta)) = (used, f.get(4).and_then(|x| x.parse::<u64>().ok())) else {
                    return Work::Failed(format!("{name}: merge stopped: {rest}"));
                };
                let left = used.saturating_sub(meta);
                let all = *first.get_or_insert(left);
                if left == 0 {
                    return Work::Done(format!("{name}: merged"));
                }
                let pct = 100.0 * (all.saturating_sub(left)) as f64 / all.max(1) as f64;
                return Work::Left(format!("{name}: {left} sectors left to merge ({pct:.1}% merged)"));
            }
            Some("writecache") => {
                let n = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok());
                let (Some(err), Some(total), Some(free)) = (n(3), n(4), n(5)) else {
                    return Work::Failed(format!("{name}: writecache status: {line}"));
                };
                if err != 0 {
                    return Work::Failed(format!("{name}: the cache is in the error state ({err})"));
                }
                let left = total.saturating_sub(free);
                if left == 0 {
                    return Work::Done(format!("{name}: nothing left to write back"));
                }
                return Work::Left(format!("{name}: {left} blocks left to write back"));
            }
            Some("cache") => {
                // dm-cache: the dirty count (field 11 of the target's status)
                let Some(left) = f.get(13).and_then(|x| x.parse::<u64>().ok()) else {
                    return Work::Failed(format!("{name}: cache status: {line}"));
                };
                if left == 0 {
                    return Work::Done(format!("{name}: no dirty block left"));
                }
                return Work::Left(format!("{name}: {left} dirty blocks left to write back"));
            }
            _ => {}
        }
    }
    Work::None
}

/// One status call to the daemon.
fn status_of(sock: &Path, name: &str) -> Result<String> {
    let mut c = connect(sock)?;
    let args = ["status".to_string(), name.to_string()];
    let (ok, out, err) = dmkit::control::call(&mut c, &args, &[])?;
    if !ok {
        anyhow::bail!("{}", err.trim_end());
    }
    Ok(out)
}

/// `dmkit progress NAME`: poll twice a second until the work ends.
fn follow(sock: &Path, name: &str) -> Result<i32> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut first = None;
    loop {
        match work(name, &status_of(sock, name)?, &mut first) {
            Work::Left(l) => {
                if tty {
                    eprint!("\r{l}   ");
                }
            }
            Work::Done(l) => {
                if tty {
                    eprint!("\r");
                }
                println!("{l}");
                return Ok(0);
            }
            Work::Failed(l) => {
                if tty {
                    eprintln!();
                }
                eprintln!("dmkit progress: {l}");
                return Ok(1);
            }
            Work::None => {
                eprintln!("dmkit progress: {name} has no snapshot-merge, writecache or cache target");
                return Ok(1);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

/// While `message NAME 0 flush` waits on a terminal: show how many blocks a
/// writecache still has to write back (from its status, twice a second).
fn flush_progress(
    sock: PathBuf,
    name: String,
) -> (Arc<std::sync::atomic::AtomicBool>, std::thread::JoinHandle<()>) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = stop.clone();
    let h = std::thread::spawn(move || {
        let mut shown = false;
        while !s2.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(500));
            let Ok(st) = status_of(&sock, &name) else {
                break;
            };
            let Work::Left(l) = work(&name, &st, &mut None) else {
                break;
            };
            if s2.load(std::sync::atomic::Ordering::SeqCst) {
                break;
            }
            eprint!("\r{l}   ");
            shown = true;
        }
        if shown {
            eprintln!();
        }
    });
    (stop, h)
}

/// `NAME=SOCKET` of `serve --vhost-user`.
fn name_and_socket(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !p.is_empty() => Ok((n.to_string(), PathBuf::from(p))),
        _ => Err(format!("{s:?}: expected NAME=SOCKET")),
    }
}
