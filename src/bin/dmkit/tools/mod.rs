//! The thin-provisioning-tools commands, option for option as the 1.x tools have
//! them, in three families laid out as thin-provisioning-tools has them
//! ([`FAMILIES`]: `thin/`, `era.rs`, `cache.rs`, each tool registered once with
//! `tool!`): `dmkit thin check ...` is `thin_check ...`, and a link named
//! `thin_check` (or any tool's name) to the dmkit binary is that tool, as
//! `pdata_tools` does it.
//!
//! Conventions shared with the reference: help and version on standard output with
//! exit 0; usage errors as clap prints them, exit 2; a failure is one line on
//! standard error and exit 64 (sysexits' EX_USAGE, what 1.x returns for every
//! failure); a closed output pipe ends the tool silently.

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
        $crate::tools::Tool {
            name: $name,
            verb: $verb,
            run: |display, args| $crate::tools::parse_run::<$args>($name, display, args, $run),
        }
    };
}

/// Exit status of a failed tool (sysexits' EX_USAGE, as in 1.x).
pub const EXIT_FAILURE: i32 = 64;

/// The tool a program name is, if it is one of the families' tools
/// (`/usr/sbin/thin_check`).
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
    let word = argv.get(i)?.to_str()?;
    let f = FAMILIES.iter().find(|f| f.word == word)?;
    if let Some(dir) = run_dir_before_verb(&argv[..i]) {
        // the tools ask the daemon about /dev/mapper/POOL through the default
        // run directory; single-threaded still, so the environment is ours
        std::env::set_var("DMKIT_RUN_DIR", dir);
    }
    Some((f.main)(argv[i + 1..].to_vec()))
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

/// A family of tools, registered once: the word that names it on dmkit's
/// command line (`dmkit thin VERB`), its tools, and how `dmkit WORD ARGS...`
/// runs.
pub struct Family {
    pub word: &'static str,
    pub tools: &'static [Tool],
    pub main: fn(Vec<OsString>) -> i32,
}

/// The families, as thin-provisioning-tools has them.
pub const FAMILIES: &[Family] = &[
    Family {
        word: "thin",
        tools: thin::TOOLS,
        main: thin::main,
    },
    Family {
        word: "era",
        tools: era::TOOLS,
        main: era::main,
    },
    Family {
        word: "cache",
        tools: cache::TOOLS,
        main: cache::main,
    },
];

/// Every tool of every family.
fn all_tools() -> impl Iterator<Item = &'static Tool> {
    FAMILIES.iter().flat_map(|f| f.tools)
}

/// `dmkit WORD VERB ARGS...` for the family `word` whose tools are `tools`: the
/// tool whose verb is VERB (`metadata-size` is `metadata_size`), else clap's
/// answer from the family's subcommands `C` (no verb, `--help`, an unknown
/// one), and `other` for a subcommand that is no tool (`dmkit thin links`).
fn family_main<C: Subcommand>(word: &str, tools: &[Tool], args: Vec<OsString>, other: fn(C) -> i32) -> i32 {
    let verb = args.first().and_then(|v| v.to_str()).unwrap_or("");
    let verb = if verb == "metadata-size" {
        "metadata_size"
    } else {
        verb
    };
    if let Some(t) = tools.iter().find(|t| t.verb == verb) {
        return (t.run)(&format!("dmkit {word} {}", t.verb), args[1..].to_vec());
    }
    #[derive(Parser)]
    #[command(name = "dmkit")]
    struct Words<C: Subcommand> {
        #[command(subcommand)]
        cmd: C,
    }
    let name = format!("dmkit {word}");
    let parsed = Words::<C>::command()
        .bin_name(name.clone())
        .try_get_matches_from(std::iter::once(OsString::from(name)).chain(args))
        .and_then(|m| Words::<C>::from_arg_matches(&m));
    match parsed {
        Ok(w) => other(w.cmd),
        Err(e) => {
            let _ = e.print();
            e.exit_code()
        }
    }
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
    ($($t:ty),*) => {$(impl $crate::tools::Versioned for $t { fn version(&self) -> bool { self.version } })*};
}

pub mod cache;
pub mod era;
mod live;
mod size;
pub mod thin;
/// Parse `args` as tool `name`'s arguments (shown in usage as `display`) and
/// run it; the exit status.
fn parse_run<A: CommandFactory + FromArgMatches + Versioned>(
    name: &'static str,
    display: &str,
    args: Vec<OsString>,
    run: fn(A) -> Outcome,
) -> i32 {
    let cmd = A::command().name(name).bin_name(display.to_string());
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
