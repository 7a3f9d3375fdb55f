//! The daemon ⇄ CLI protocol over a unix socket, and the dmsetup verbs it carries.
//!
//! Request: argc (u32 BE), each argument as length (u32 BE) + bytes, then standard
//! input as length + bytes. Reply: status byte (0 ok), stdout text, stderr text, each
//! as length + bytes. The daemon does all parsing and formatting, so every client
//! sees the same output.

use crate::sync::Unpoison;
pub mod dmioctl;
pub mod door;
pub mod preload;
pub mod state;
pub mod verbs;

use crate::export::ublk;
use crate::mapper::registry::Registry;
use clap::Parser;
use std::io::{self, Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use verbs::{DmVerb, Request, ShowArgs, TableArgs};

/// What control requests act on: the devices, their block devices, and where
/// the daemon records them for `serve --restore`.
pub struct Ctx {
    pub reg: Arc<Registry>,
    pub ublk: ublk::Frontend,
    /// Devices served to virtual machines as vhost-user-blk disks.
    pub vhost: crate::export::vhost::Frontend,
    /// The devices as files, for programs behind the door (mounted on demand).
    pub files: crate::export::files::DeviceFiles,
    /// Where the daemon keeps its sockets and files (None: nowhere, when fuzzing).
    pub run_dir: Option<PathBuf>,
    /// The state file (None: not recorded).
    pub state: Option<PathBuf>,
    /// Keeps the state file up to date.
    pub(crate) recorder: state::Recorder,
    /// Every device is attached as a ublk block device when a table is resumed
    /// on it, and detached at its removal (`serve --attach`).
    pub auto_attach: bool,
}

impl Ctx {
    pub fn new(reg: Arc<Registry>, state: Option<PathBuf>) -> Ctx {
        Ctx {
            reg,
            ublk: ublk::Frontend::default(),
            vhost: Default::default(),
            files: Default::default(),
            run_dir: None,
            state,
            recorder: state::Recorder::default(),
            auto_attach: false,
        }
    }

    /// A context that makes no kernel block devices and records nothing (for
    /// fuzzing the protocol).
    pub fn sandboxed(reg: Arc<Registry>) -> Ctx {
        Ctx {
            ublk: ublk::Frontend::disabled(),
            vhost: crate::export::vhost::Frontend::disabled(),
            files: crate::export::files::DeviceFiles::disabled(),
            ..Ctx::new(reg, None)
        }
    }
}

/// Most bytes one request may carry (a table of many thousands of lines fits).
const MAX_REQUEST: u32 = 64 << 20;

pub use crate::client::call;
use crate::client::{get, put};

/// Server side: read one request, run it, write the reply.
pub fn handle<S: Read + Write>(s: &mut S, ctx: &Ctx) -> io::Result<()> {
    let mut budget = MAX_REQUEST;
    let mut n = [0u8; 4];
    s.read_exact(&mut n)?;
    let argc = u32::from_be_bytes(n);
    if argc > 1 << 16 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "too many arguments"));
    }
    let mut args = Vec::with_capacity(argc as usize);
    for _ in 0..argc {
        args.push(String::from_utf8_lossy(&get(s, &mut budget)?).into_owned());
    }
    let stdin = String::from_utf8_lossy(&get(s, &mut budget)?).into_owned();
    let (ok, out, err) = match execute(ctx, &args, &stdin) {
        Ok(out) => (true, out, String::new()),
        // a refusal may quote the request: bounded, whatever its size
        Err(e) => (false, String::new(), crate::table::bounded_line(&e).into_owned()),
    };
    let mut rep = vec![u8::from(!ok)];
    put(&mut rep, out.as_bytes());
    put(&mut rep, err.as_bytes());
    s.write_all(&rep)
}

/// Keep only the lines of targets of type `t` (`--target`).
fn filter_target(out: String, t: Option<&str>) -> String {
    let Some(t) = t else { return out };
    out.lines()
        .filter(|l| {
            let body = l.split_once(": ").map_or(*l, |(_, b)| b);
            body.split(' ').nth(2) == Some(t)
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Run one dmsetup-style verb; Ok(stdout) or Err(the one-line error). A verb
/// that changes devices is recorded in the state file.
pub fn execute(ctx: &Ctx, args: &[String], stdin: &str) -> Result<String, String> {
    // The CLI parsed these words already; only a client of its own gets an error.
    let req = Request::try_parse_from(args)
        .map_err(|e| verbs::one_line(&e, "dmkit").unwrap_or_else(|| "help is not a request".into()))?;
    let changes = !matches!(
        req.verb,
        DmVerb::Status(_)
            | DmVerb::Table(_)
            | DmVerb::Info { .. }
            | DmVerb::Ls { .. }
            | DmVerb::Deps { .. }
            | DmVerb::Targets
            | DmVerb::Version
            | DmVerb::Stats { .. }
            | DmVerb::Wait { .. }
            | DmVerb::Mknodes { .. }
            | DmVerb::UdevcompleteAll { .. }
            | DmVerb::Holder { .. }
            | DmVerb::DeviceFiles
    );
    // a message may set state the table does not show (writecache `cleaner`):
    // recorded too
    let r = run_verb(ctx, req.verb, stdin);
    if changes && r.is_ok() {
        ctx.record();
    }
    r
}

impl Ctx {
    /// Record the devices in the state file after a change (verbs and the dm
    /// ioctl door alike).
    pub fn record(&self) {
        if let Some(path) = &self.state {
            if let Err(e) = self.recorder.record(self, path, false) {
                tracing::warn!("recording the devices in {}: {e}", path.display());
            }
        }
        give_back_memory();
    }
}

static NO_TRIM: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Keep freed memory in the heap (`serve --test-no-memory-trim`: the
/// benchmark's comparison).
pub fn keep_freed_memory() {
    NO_TRIM.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Hand the C library's free heap pages back to the system after a change: a
/// removed table of 10^6 targets or 10^4 removed devices leave their memory in
/// the heap's free lists, where glibc returns only what sits at the top of the
/// heap; malloc_trim returns every free page (BENCHMARKS.md, "Memory given
/// back"). Its cost grows with the free chunks, not the used ones.
pub fn give_back_memory() {
    if NO_TRIM.load(std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    // SAFETY: malloc_trim only walks the allocator's own free lists and
    // advises the kernel about free pages; it touches no memory in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn run_verb(ctx: &Ctx, verb: DmVerb, stdin: &str) -> Result<String, String> {
    let reg = &*ctx.reg;
    let e = |x: crate::mapper::registry::ControlError| x.to_string();
    let done = |r: Result<(), _>| r.map(|_| String::new()).map_err(e);
    match verb {
        DmVerb::Create {
            name,
            table: t,
            notable,
            readonly,
            uuid,
            minor,
        } => {
            let text = (!notable).then(|| table_text(&t, stdin));
            done(reg.create_in(&name, text.as_deref(), readonly, uuid, minor, t.cwd.as_deref()))?;
            // create with a table is load + resume: with `serve --attach` the
            // device becomes a block device now, as after any resume
            after_resume(ctx, &name);
            Ok(String::new())
        }
        DmVerb::Load {
            name,
            table: t,
            readonly,
            writable,
        } => {
            let mode = (readonly || writable).then_some(readonly);
            done(reg.load_in(&name, &table_text(&t, stdin), t.cwd.as_deref(), mode))
        }
        DmVerb::Clear { devs } => each(reg, &devs.names, &devs.pick, |n| done(reg.clear(n))),
        DmVerb::Suspend { devs, noflush, .. } => {
            each(reg, &devs.names, &devs.pick, |n| done(reg.suspend(n, noflush)))
        }
        DmVerb::Resume { devs } => each(reg, &devs.names, &devs.pick, |n| {
            resume(ctx, n).map(|()| String::new()).map_err(|x| x.to_string())
        }),
        DmVerb::Remove {
            devs,
            force,
            deferred,
        } => each(reg, &devs.names, &devs.pick, |n| {
            remove(ctx, n, force, deferred)
                .map(|()| String::new())
                .map_err(|x| x.to_string())
        }),
        DmVerb::RemoveAll { force, deferred } => {
            before_remove_all(ctx);
            reg.remove_all(force, deferred)
                .map(|()| String::new())
                .map_err(|e| e.to_string())
        }
        DmVerb::Rename {
            name,
            new_name,
            setuuid,
        } => rename(ctx, &name, new_name, setuuid),
        DmVerb::Message {
            name,
            sector,
            message,
        } => send_message(reg, &name, &sector, &message),
        DmVerb::Status(a) => show(reg, a, true),
        DmVerb::Table(a) => show(reg, a, false),
        DmVerb::Info {
            devs,
            columns,
            options,
            noheadings,
            separator,
        } => {
            let names = picked(reg, &devs.names, &devs.pick)?;
            info(
                reg,
                &names,
                columns.then_some((options.as_deref(), !noheadings, separator.as_deref())),
            )
        }
        DmVerb::Ls { tree, target } => Ok(reg.ls(tree, target.as_deref())),
        DmVerb::Deps { devs } => deps(reg, &picked(reg, &devs.names, &devs.pick)?),
        DmVerb::Wait { name, event_nr, .. } => wait(reg, &name, event_nr.unwrap_or(0)),
        // no device nodes and no udev cookies here: nothing to do, as the help says
        DmVerb::Mknodes { .. } | DmVerb::UdevcompleteAll { .. } => Ok(String::new()),
        DmVerb::Targets => Ok(reg.targets()),
        DmVerb::Stats { server, devs } => stats(reg, server, &devs),
        DmVerb::Version => Ok(format!("dmkit version:     {}\n", env!("CARGO_PKG_VERSION"))),
        DmVerb::Attach {
            name,
            recover,
            vhost_user,
        } => attach(ctx, &name, recover, vhost_user),
        DmVerb::DeviceFiles => {
            let run_dir = ctx.run_dir.as_deref().ok_or("this daemon has no run directory")?;
            let dir = ctx.files.ensure(&ctx.reg, run_dir)?;
            Ok(format!("{}\n", dir.display()))
        }
        DmVerb::Holder { path } => Ok(reg.holder(&path).map(|n| n + "\n").unwrap_or_default()),
        DmVerb::Detach { name, force } => detach(ctx, &name, force),
    }
}

/// `stats NAME...` (or `--server`).
fn stats(reg: &Registry, server: bool, devs: &verbs::AnyDevices) -> Result<String, String> {
    if server {
        return Ok(reg.server.line());
    }
    if devs.names.is_empty() && devs.pick.uuid.is_none() && devs.pick.minor.is_none() {
        return Err("a device name (or --server) is required".into());
    }
    each(reg, &devs.names, &devs.pick, |n| {
        reg.stats(n).map_err(|x| x.to_string())
    })
}

/// A verb's table: its lines, or what came on standard input.
fn table_text(t: &TableArgs, stdin: &str) -> String {
    if t.lines.is_empty() {
        stdin.to_string()
    } else {
        t.lines.join("\n")
    }
}

/// `attach NAME`: a ublk device, or with `--vhost-user SOCKET` a vhost-user-blk
/// backend; its path.
fn attach(
    ctx: &Ctx,
    name: &str,
    recover: Option<u32>,
    vhost_user: Option<std::path::PathBuf>,
) -> Result<String, String> {
    let dev = ctx.reg.get(name).map_err(|x| x.to_string())?;
    let path = match vhost_user {
        Some(socket) => ctx.vhost.attach(&dev, &socket)?,
        None => ctx.ublk.attach(&dev, recover)?,
    };
    Ok(format!("{path}\n"))
}

/// `detach NAME`: its vhost-user backend, else its ublk device.
fn detach(ctx: &Ctx, name: &str, force: bool) -> Result<String, String> {
    let dev = ctx.reg.get(name).map_err(|x| x.to_string())?;
    if ctx.vhost.detach(&dev, force)? {
        return Ok(String::new());
    }
    ctx.ublk.detach(&dev).map(|()| String::new())
}

/// `deps` of `names` (none: every device; more than one: each line named).
fn deps(reg: &Registry, names: &[String]) -> Result<String, String> {
    let e = |x: crate::mapper::registry::ControlError| x.to_string();
    match names {
        [] => reg.deps(None).map_err(e),
        [one] => reg.deps(Some(one)).map_err(e),
        _ => each_name(names, |n| reg.deps(Some(n)).map(|o| prefixed(n, &o)).map_err(e)),
    }
}

/// `rename NAME NEW_NAME`, or `rename NAME --setuuid UUID`.
fn rename(
    ctx: &Ctx,
    name: &str,
    new_name: Option<String>,
    setuuid: Option<String>,
) -> Result<String, String> {
    let reg = &*ctx.reg;
    match (new_name, setuuid) {
        (_, Some(u)) => reg
            .set_uuid(name, &u)
            .map(|()| String::new())
            .map_err(|x| x.to_string()),
        (Some(n), None) => {
            reg.rename(name, &n).map_err(|x| x.to_string())?;
            if let Ok(d) = reg.get(&n) {
                ctx.ublk.renamed(&d);
            }
            Ok(String::new())
        }
        (None, None) => Err("a new name or --setuuid is required".into()),
    }
}

/// `message NAME SECTOR WORDS...`: the target's answer, ending in a newline.
fn send_message(reg: &Registry, name: &str, sector: &str, words: &[String]) -> Result<String, String> {
    let sector = sector.trim().parse::<u64>().map_err(|_| {
        format!("invalid sector '{sector}': a number of 512-byte sectors (0: the first target)")
    })?;
    let mut r = reg.message(name, sector, words).map_err(|x| x.to_string())?;
    if !r.is_empty() && !r.ends_with('\n') {
        r.push('\n');
    }
    Ok(r)
}

/// `info` of `names` (none: every device), or with `columns` (the fields,
/// whether headings are wanted, the separator) `info -c`.
fn info(
    reg: &Registry,
    names: &[String],
    columns: Option<(Option<&str>, bool, Option<&str>)>,
) -> Result<String, String> {
    let e = |x: crate::mapper::registry::ControlError| x.to_string();
    let Some((options, headings, separator)) = columns else {
        if names.is_empty() {
            return reg.info(None).map_err(e);
        }
        return each_name(names, |n| reg.info(Some(n)).map_err(e));
    };
    if names.is_empty() {
        return reg.info_columns(None, options, headings, separator).map_err(e);
    }
    let mut first = true;
    each_name(names, |n| {
        let r = reg.info_columns(Some(n), options, headings && first, separator);
        first = false;
        r.map_err(e)
    })
}

/// The names given, with the device `-u UUID` or `-j MAJOR -m MINOR` picks.
fn picked(reg: &Registry, names: &[String], pick: &verbs::Pick) -> Result<Vec<String>, String> {
    let mut out = names.to_vec();
    if let Some(u) = &pick.uuid {
        let d = reg.by_uuid(u);
        out.push(d.ok_or_else(|| format!("uuid {u}: No such device"))?.name());
    }
    if let (Some(major), Some(minor)) = (pick.major, pick.minor) {
        let d = (major == crate::mapper::DM_MAJOR)
            .then(|| reg.by_minor(minor))
            .flatten();
        let what = format!("{major}:{minor}: No such device");
        out.push(
            d.ok_or_else(|| {
                if major == crate::mapper::DM_MAJOR {
                    what
                } else {
                    format!("{what} (dmkit's devices have major {})", crate::mapper::DM_MAJOR)
                }
            })?
            .name(),
        );
    }
    Ok(out)
}

/// Run `f` on each device picked, in order, as dmsetup does with several names:
/// every one is tried; the outputs are joined and so are the errors (one line each).
fn each(
    reg: &Registry,
    names: &[String],
    pick: &verbs::Pick,
    f: impl FnMut(&str) -> Result<String, String>,
) -> Result<String, String> {
    each_name(&picked(reg, names, pick)?, f)
}

fn each_name(names: &[String], mut f: impl FnMut(&str) -> Result<String, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut errors = Vec::new();
    for n in names {
        match f(n) {
            Ok(o) => out.push_str(&o),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors.join("\n"))
    }
}

/// `NAME: ` before each line, as dmsetup prints several devices.
fn prefixed(name: &str, out: &str) -> String {
    if out.is_empty() {
        return format!("{name}: \n");
    }
    out.lines().map(|l| format!("{name}: {l}\n")).collect()
}

/// `dmsetup wait NAME [EVENT_NR]`: return once the device's event counter exceeds
/// `event_nr` (at once if it does already), or fail if the device goes.
fn wait(reg: &Registry, name: &str, event_nr: u64) -> Result<String, String> {
    let dev = reg.get(name).map_err(|x| x.to_string())?;
    while dev.events() <= event_nr {
        if dev.removed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(format!(
                "{name}: removed while waiting for event {}",
                event_nr + 1
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(String::new())
}

/// Why a resume or a removal was refused.
pub(crate) enum Refused {
    /// The device's block device stands in the way (held, or of another size).
    BlockDevice(String),
    /// The registry's reason.
    Registry(crate::mapper::registry::ControlError),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::BlockDevice(why) => f.write_str(why),
            Refused::Registry(e) => e.fmt(f),
        }
    }
}

/// Resume `name` (for the CLI and the door alike): devices marked for deferred
/// removal that the old table held go, and with `serve --attach` the device's
/// block device follows its live table.
pub(crate) fn resume(ctx: &Ctx, name: &str) -> Result<(), Refused> {
    before_resume(ctx, name).map_err(Refused::BlockDevice)?;
    let r = ctx.reg.resume(name);
    // the old table may have held a device marked for deferred removal
    ctx.reg.reap_deferred();
    after_resume(ctx, name);
    r.map_err(Refused::Registry)
}

/// Remove `name` (for the CLI and the door alike), its block device first with
/// `serve --attach`.
pub(crate) fn remove(ctx: &Ctx, name: &str, force: bool, deferred: bool) -> Result<(), Refused> {
    before_remove(ctx, name).map_err(Refused::BlockDevice)?;
    let r = ctx.reg.remove(name, force, deferred);
    ctx.reg.reap_deferred();
    // refused (held by another device, say): its block device again
    after_resume(ctx, name);
    r.map_err(Refused::Registry)
}

/// A resume that would change the size of a device attached as a block device is
/// refused: the ublk driver cannot resize a device (before Linux 6.16). With
/// `serve --attach` only while the block device is held (mounted): otherwise it
/// is attached again at the new size after the resume.
fn before_resume(ctx: &Ctx, name: &str) -> Result<(), String> {
    let Ok(dev) = ctx.reg.get(name) else { return Ok(()) };
    let Some(b) = dev.block_device() else {
        return Ok(());
    };
    let new = dev.inactive.lock().unpoisoned().as_ref().map(|t| t.size);
    if ctx.vhost.has(&dev) {
        return match new {
            Some(n) if n != dev.size_sectors() => Err(format!(
                "{name}: attached as {b}, which cannot tell the guest of a new size yet: the new table has {n} \
                 sectors, the device {}; detach it first (or load a table of the same size)",
                dev.size_sectors()
            )),
            _ => Ok(()),
        };
    }
    match new {
        Some(n) if n != dev.size_sectors() && (!ctx.auto_attach || ctx.ublk.held(&dev)) => {
            let how = if ctx.auto_attach {
                "unmount it first"
            } else {
                "detach it first"
            };
            Err(format!(
                "{name}: attached as {b}, whose size the kernel cannot change while it is in use: the new table \
                 has {n} sectors, the device {}; {how} (or load a table of the same size)",
                dev.size_sectors()
            ))
        }
        _ => Ok(()),
    }
}

/// With `serve --attach`, after a resume: the device is a block device of its
/// table's size and logical block size (attached, or attached again when the
/// table changed them). A device that cannot be attached still works through
/// the door's files; the reason is logged.
fn after_resume(ctx: &Ctx, name: &str) {
    let Ok(dev) = ctx.reg.get(name) else { return };
    if dev.suspended.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    if let Some(socket) = ctx.vhost.wanted(name) {
        if dev.block_device().is_none() && dev.size_sectors() > 0 {
            if let Err(e) = ctx.vhost.attach(&dev, &socket) {
                tracing::warn!("{name}: not served on {}: {e}", socket.display());
            }
        }
        return;
    }
    if !ctx.auto_attach {
        return;
    }
    if ctx.ublk.misfits(&dev) {
        if let Err(e) = ctx.ublk.detach(&dev) {
            tracing::warn!("{name}: its table changed shape, but its block device stays: {e}");
            return;
        }
    }
    if dev.block_device().is_none() && dev.size_sectors() > 0 {
        if let Err(e) = ctx.ublk.attach(&dev, None) {
            tracing::warn!("{name}: no block device: {e}");
        }
    }
}

/// With `serve --attach`, before every device is removed: the block devices
/// that are not held go (the held ones keep their devices).
pub(crate) fn before_remove_all(ctx: &Ctx) {
    if ctx.auto_attach {
        for d in ctx.reg.list() {
            if d.block_device().is_some() && !ctx.vhost.has(&d) {
                let _ = ctx.ublk.detach(&d);
            }
        }
    }
}

/// With `serve --attach`, before a removal: the device's block device goes
/// first (refused while it is held, as the kernel refuses to remove an open
/// device). If the removal is then refused, [`after_resume`] attaches it again.
fn before_remove(ctx: &Ctx, name: &str) -> Result<(), String> {
    if !ctx.auto_attach {
        return Ok(());
    }
    let Ok(dev) = ctx.reg.get(name) else { return Ok(()) };
    if dev.block_device().is_none() || ctx.vhost.has(&dev) {
        // a vhost-user disk stays: the removal is refused while it is attached
        return Ok(());
    }
    ctx.ublk
        .detach(&dev)
        .map_err(|e| format!("Device or resource busy: {e}"))
}

fn show(reg: &Registry, a: ShowArgs, status: bool) -> Result<String, String> {
    let names = picked(reg, &a.devs.names, &a.devs.pick)?;
    let lines = |n: Option<&str>| {
        reg.table_lines(n, status, a.inactive, a.showkeys)
            .map_err(|x| x.to_string())
    };
    let out = match names.as_slice() {
        [] => lines(None)?,
        [one] => lines(Some(one))?,
        _ => each_name(&names, |n| lines(Some(n)).map(|o| prefixed(n, &o)))?,
    };
    Ok(filter_target(out, a.target.as_deref()))
}
