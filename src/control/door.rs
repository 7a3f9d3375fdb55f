//! The dm ioctl door, daemon side: the commands of `/dev/mapper/control` served
//! on the registry, with the kernel's answers (`drivers/md/dm-ioctl.c`).
//!
//! The door has its own socket, `RUN_DIR/dm-ioctl.sock`, rather than a request
//! kind on `control.sock`: one connection is one open descriptor of
//! `/dev/mapper/control` (it lives as long as the program keeps the descriptor,
//! and carries many ioctls, where a `control.sock` connection carries one verb),
//! and its frames are the binary buffer the ioctl passes, not words. The
//! library `dmkit exec` preloads (see [`crate::control::preload`]) connects here.
//!
//! A frame from the caller: the ioctl request number, the buffer's length, how
//! many of its first bytes the frame carries, the caller's working directory's
//! length (u32 LE each), those bytes, the directory (relative paths in a table
//! are the caller's, as the kernel resolves them). A buffer is carried whole
//! only for a command that reads what follows its header
//! ([`Cmd::reads_data`](dm::Cmd::reads_data)); of the others (a status, a
//! listing: libdevmapper's buffers are 16 KiB) the header alone goes, and the
//! reply brings back the result's bytes only.
//! The reply: the errno (0 on success; i32 LE), the number of bytes to copy
//! back over the caller's buffer, the length of a reason (u32 LE each), those
//! bytes, and the reason: why a request was refused, in words (the kernel's
//! DMERR goes to its log; the caller's library prints this one).

use super::dmioctl::{self as dm, Cmd, Errno, Request};
use super::Ctx;
use crate::mapper::registry::{ControlError, Registry};
use crate::mapper::{Device, DM_MAJOR};
use crate::sync::Unpoison;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The door's socket in the run directory.
pub const SOCKET: &str = "dm-ioctl.sock";

/// The longest working directory a frame may carry.
const MAX_CWD: u32 = 4096;

/// A refusal: the errno and why.
type Refusal = (Errno, String);

fn refuse(e: Errno, why: impl Into<String>) -> Refusal {
    (e, why.into())
}

/// The errno the kernel gives for what the registry refused.
fn errno_of(e: &ControlError) -> Errno {
    Errno(e.errno())
}

fn from_registry(e: ControlError) -> Refusal {
    (errno_of(&e), e.to_string())
}

/// A refused resume or removal: `block_device`, the errno when the device's
/// block device stood in the way.
fn refused(x: super::Refused, block_device: Errno) -> Refusal {
    match x {
        super::Refused::BlockDevice(why) => refuse(block_device, why),
        super::Refused::Registry(e) => from_registry(e),
    }
}

/// The frame the daemon sends, unasked, on a descriptor armed by DM_DEV_ARM_POLL
/// once an event happens: an errno no reply carries, nothing to copy, no reason.
/// Its arrival makes the descriptor readable, so `poll()` on the program's
/// control descriptor wakes as the kernel's does (POLLIN); the library drops it
/// at the next DM_DEV_ARM_POLL.
pub const POLL_NOTICE: i32 = 0x7fff_dc02;

/// How often an armed descriptor's daemon side looks for an event.
const POLL_TICK_MS: i32 = 50;

/// What the kernel's dm_global_event_nr counts, as one number that changes
/// when it would: any device's event (a target's, a resume's table swap, a
/// rename) and the devices made and removed (DEV_CREATE, DEV_REMOVE,
/// REMOVE_ALL issue a global event).
fn global_events(ctx: &Ctx) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for d in ctx.reg.list() {
        (d.minor, d.events(), d.name()).hash(&mut h);
    }
    h.finish()
}

/// poll() of one descriptor for `events`, waiting up to `ms` milliseconds: the
/// events that came (0 when none did; POLLHUP and POLLERR come unasked), None
/// when poll() failed.
fn poll_one(fd: i32, events: i16, ms: i32) -> Option<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    (n >= 0).then_some(if n > 0 { p.revents } else { 0 })
}

/// Whether the connection has a frame to read within `ms` milliseconds (or has
/// been closed, or cannot be polled: the read that follows says why).
fn readable(fd: i32, ms: i32) -> bool {
    poll_one(fd, libc::POLLIN | libc::POLLRDHUP, ms).is_none_or(|r| r != 0)
}

/// Serve one connection (one open descriptor of the control node) until the
/// caller closes it.
pub fn serve_connection(s: &mut UnixStream, ctx: &Ctx) -> io::Result<()> {
    // DM_DEV_ARM_POLL: the events seen when it was armed
    let mut armed: Option<u64> = None;
    let fd = std::os::fd::AsRawFd::as_raw_fd(s);
    // a frame's parts (header, buffer, directory) in one read where they fit
    let mut rd = io::BufReader::with_capacity(64 << 10, s.try_clone()?);
    loop {
        if let Some(seen) = armed {
            while rd.buffer().is_empty() && !readable(fd, POLL_TICK_MS) {
                if global_events(ctx) != seen {
                    let mut notice = [0u8; 12];
                    notice[..4].copy_from_slice(&POLL_NOTICE.to_le_bytes());
                    s.write_all(&notice)?;
                    armed = None;
                    break;
                }
            }
        }
        let mut h = [0u8; 16];
        match rd.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        }
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let (request, len, sent, cwd_len) = (word(0), word(4), word(8), word(12));
        if sent as usize > dm::BUFFER_LIMIT || sent > len || cwd_len > MAX_CWD {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "dm ioctl frame carrying {sent} bytes of {len} (cwd {cwd_len}): more than the door takes"
                ),
            ));
        }
        let mut buf = vec![0u8; sent as usize];
        rd.read_exact(&mut buf)?;
        let mut cwd = vec![0u8; cwd_len as usize];
        rd.read_exact(&mut cwd)?;
        let cwd = String::from_utf8_lossy(&cwd).into_owned();
        // the type and number bytes name the command (the size is the header's)
        let arms = request & 0xffff == Cmd::DevArmPoll.request() & 0xffff;
        let before = arms.then(|| global_events(ctx));
        let (errno, mut out, why) = ioctl(ctx, request, buf, len as usize, &cwd, &|| hung_up(fd));
        if errno == 0 && before.is_some() {
            armed = before;
        }
        let mut rep = Vec::with_capacity(12 + out.len() + why.len());
        rep.extend_from_slice(&errno.to_le_bytes());
        rep.extend_from_slice(&(out.len() as u32).to_le_bytes());
        rep.extend_from_slice(&(why.len() as u32).to_le_bytes());
        rep.extend_from_slice(&out);
        rep.extend_from_slice(why.as_bytes());
        let r = s.write_all(&rep);
        // SECURE_DATA's wipe, done for every buffer: the door cannot know
        // which parameters were secret once the flag is cleared
        out.fill(0);
        rep.fill(0);
        r?;
    }
}

/// Whether the caller of a waiting DEV_WAIT has gone (its end of the socket
/// closed).
fn hung_up(fd: i32) -> bool {
    poll_one(fd, libc::POLLRDHUP, 0)
        .is_some_and(|r| r & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
}

/// dmkit's own request on the door (type byte 0xdc, not device-mapper's 0xfd):
/// the read-ahead, in sectors, of the device whose number is the 8-byte buffer
/// (u64, as `dev` fields carry it). The preload library answers
/// `/sys/dev/block/MAJOR:N/bdi/read_ahead_kb` with it, where libdevmapper reads a
/// device's read-ahead (its number may be another driver's on this kernel).
pub const READ_AHEAD_REQUEST: u32 = 0xdc01;

fn read_ahead(ctx: &Ctx, raw: &[u8]) -> (i32, Vec<u8>, String) {
    let Some(dev) = raw.get(..8).and_then(|b| <[u8; 8]>::try_from(b).ok()) else {
        return (
            libc::EFAULT,
            Vec::new(),
            "read-ahead: an 8-byte device number is required".into(),
        );
    };
    let (major, minor) = dm::decode_dev(u64::from_ne_bytes(dev));
    let d = (major == DM_MAJOR).then(|| ctx.reg.by_minor(minor)).flatten();
    match d {
        Some(d) => (
            0,
            d.limits().read_ahead_sectors().to_ne_bytes().to_vec(),
            String::new(),
        ),
        None => (libc::ENXIO, Vec::new(), String::new()),
    }
}

/// One ioctl: the request number, the first bytes of the caller's buffer (`raw`)
/// and its length (`len`) in; the errno (0: the ioctl succeeded), the bytes to
/// copy back over the buffer, and the reason of a refusal out. `gone` tells a
/// waiting DEV_WAIT that its caller left.
pub fn ioctl(
    ctx: &Ctx,
    request: u32,
    raw: Vec<u8>,
    len: usize,
    cwd: &str,
    gone: &dyn Fn() -> bool,
) -> (i32, Vec<u8>, String) {
    if request == READ_AHEAD_REQUEST {
        return read_ahead(ctx, &raw);
    }
    let mut r = match dm::decode(request, raw, len) {
        Ok(r) => r,
        Err((e, mut buf, n)) => {
            wipe_from(&mut buf, n);
            let why = format!(
                "dm ioctl 0x{request:08x}: {} (the kernel's checks of the buffer)",
                std::io::Error::from_raw_os_error(e.0)
            );
            return (e.0, buf, why);
        }
    };
    let cwd = (!cwd.is_empty()).then(|| Path::new(cwd));
    match run(ctx, &mut r, cwd, gone) {
        Ok(changed) => {
            if changed {
                ctx.record();
            }
            let n = r.out_len();
            wipe_from(&mut r.buf, n);
            (0, r.buf, String::new())
        }
        Err((e, why)) => {
            let why = crate::table::bounded_line(&why).into_owned();
            if e != dm::ENXIO {
                crate::lograte::client_line(
                    tracing::Level::INFO,
                    &format!("dm ioctl {:?} refused ({}): {why}", r.cmd, e.0),
                );
            }
            wipe_from(&mut r.buf, 0);
            (e.0, Vec::new(), why)
        }
    }
}

/// Zero the bytes of `buf` from `n` on, then drop them: what is not copied back
/// (a table's parameters, a key) does not linger in freed memory
/// (DM_SECURE_DATA_FLAG's wipe, done for every buffer).
fn wipe_from(buf: &mut Vec<u8>, n: usize) {
    if let Some(tail) = buf.get_mut(n..) {
        tail.fill(0);
    }
    buf.truncate(n);
}

/// The kernel's check of a device name (`check_name`), with the registry's.
fn check_name(name: &str) -> Result<(), Refusal> {
    if name.contains('/') || name == "control" || name == "." || name == ".." {
        return Err(refuse(
            dm::EINVAL,
            format!("invalid device name '{name}': no '/', not \"control\", \".\" or \"..\""),
        ));
    }
    Ok(())
}

/// `__find_device_hash_cell`: the device the header names (by uuid, else name,
/// else number; naming it two ways is ENXIO, as the kernel finds nothing), its
/// name and uuid written into the header.
fn find(ctx: &Ctx, r: &mut Request) -> Result<Arc<Device>, Refusal> {
    let (name, uuid, dev) = (r.name(), r.uuid(), r.dev());
    let none = || {
        refuse(
            dm::ENXIO,
            format!("no device (name '{name}', uuid '{uuid}', dev {dev:#x})"),
        )
    };
    let d = if !uuid.is_empty() {
        if !name.is_empty() || dev != 0 {
            return Err(none());
        }
        ctx.reg.by_uuid(&uuid)
    } else if !name.is_empty() {
        if dev != 0 {
            return Err(none());
        }
        ctx.reg.get(&name).ok()
    } else if dev != 0 {
        let (major, minor) = dm::decode_dev(dev);
        (major == DM_MAJOR).then(|| ctx.reg.by_minor(minor)).flatten()
    } else {
        None
    };
    let d = d.ok_or_else(none)?;
    r.set_identity(&d.name(), d.uuid().as_deref());
    if d.inactive.lock().unpoisoned().is_some() {
        r.add_flags(dm::INACTIVE_PRESENT_FLAG);
    } else {
        r.clear_flags(dm::INACTIVE_PRESENT_FLAG);
    }
    Ok(d)
}

/// `__dev_status` of a device.
fn status(ctx: &super::Ctx, d: &Arc<Device>) -> dm::DevStatus {
    let inactive = d
        .inactive
        .lock()
        .unpoisoned()
        .as_ref()
        .map(|t| t.entries.len() as u32);
    dm::DevStatus {
        major: DM_MAJOR.get(),
        minor: d.minor,
        suspended: d.suspended.load(Ordering::SeqCst),
        deferred_remove: d.deferred_remove.load(Ordering::SeqCst),
        read_only: d.read_only(),
        open_count: crate::mapper::report::open_count(d) + u32::from(ctx.ublk.held(d)),
        event_nr: d.events() as u32,
        live_targets: d.live.load().as_ref().map(|t| t.entries.len() as u32),
        inactive_targets: inactive,
    }
}

/// The live table, or the inactive one with QUERY_INACTIVE_TABLE.
fn table_of(d: &Device, r: &Request) -> Option<Arc<crate::mapper::Table>> {
    if r.has(dm::QUERY_INACTIVE_TABLE_FLAG) {
        d.inactive.lock().unpoisoned().clone()
    } else {
        d.live.load_full()
    }
}

/// `retrieve_status`: each target's status line, or its table line with
/// STATUS_TABLE.
fn put_status(d: &Device, r: &mut Request) {
    let Some(t) = table_of(d, r) else { return };
    let table = r.has(dm::STATUS_TABLE_FLAG);
    let lines: Vec<(u64, u64, &str, String)> = t
        .entries
        .iter()
        .map(|e| {
            let text = if table {
                e.target.table_params()
            } else if r.has(dm::NOFLUSH_FLAG) {
                e.target.status_params_noflush()
            } else {
                e.target.status_params()
            };
            (e.start, e.len, e.target.type_name(), text)
        })
        .collect();
    r.put_status(&lines);
}

/// What a handler is given besides the request: the daemon, the caller's
/// working directory (for relative paths in a table), and whether the caller
/// has gone (a DM_DEV_WAIT ends then).
struct Call<'a> {
    ctx: &'a Ctx,
    reg: &'a Registry,
    cwd: Option<&'a Path>,
    gone: &'a dyn Fn() -> bool,
}

/// A command's handler: Ok(whether the devices changed).
type Handler = fn(&Call, &mut Request) -> Result<bool, Refusal>;

/// The handler of each command, as the kernel's `lookup_ioctl` table.
fn handler(cmd: Cmd) -> Handler {
    match cmd {
        Cmd::Version | Cmd::DevArmPoll => |_, _| Ok(false),
        Cmd::RemoveAll => remove_all,
        Cmd::ListDevices => list_devices,
        Cmd::ListVersions => list_versions,
        Cmd::GetTargetVersion => get_target_version,
        Cmd::DevCreate => dev_create,
        Cmd::DevRemove => dev_remove,
        Cmd::DevRename => dev_rename,
        Cmd::DevSuspend => dev_suspend,
        Cmd::DevStatus => dev_status,
        Cmd::DevWait => dev_wait,
        Cmd::TableLoad => table_load,
        Cmd::TableClear => table_clear,
        Cmd::TableDeps => table_deps,
        Cmd::TableStatus => table_status,
        Cmd::TargetMsg => target_msg,
        Cmd::DevSetGeometry => dev_set_geometry,
    }
}

/// Run a decoded request; Ok(whether the devices changed).
fn run(ctx: &Ctx, r: &mut Request, cwd: Option<&Path>, gone: &dyn Fn() -> bool) -> Result<bool, Refusal> {
    let reg = &*ctx.reg;
    handler(r.cmd)(&Call { ctx, reg, cwd, gone }, r)
}

/// DM_REMOVE_ALL: every device that can go goes; nothing is reported.
fn remove_all(&Call { ctx, reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    // the kernel removes what it can and reports nothing
    super::before_remove_all(ctx);
    if let Err(e) = reg.remove_all(false, r.has(dm::DEFERRED_REMOVE)) {
        tracing::info!("dm ioctl remove_all: {e}");
    }
    r.set_data_size(0);
    Ok(true)
}

/// DM_LIST_DEVICES: the name, numbers and event count of each device.
fn list_devices(&Call { reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let devs: Vec<dm::ListEntry> = reg
        .list()
        .iter()
        .map(|d| dm::ListEntry {
            name: d.name(),
            uuid: d.uuid(),
            major: DM_MAJOR.get(),
            minor: d.minor,
            event_nr: d.events() as u32,
        })
        .collect();
    r.put_name_list(&devs);
    Ok(false)
}

/// DM_LIST_VERSIONS: every target type and its version.
fn list_versions(&Call { reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let all: Vec<_> = reg.target_types().iter().map(|t| (t.name, t.version)).collect();
    r.put_versions(&all);
    Ok(false)
}

/// DM_GET_TARGET_VERSION: one target type's version.
fn get_target_version(&Call { reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let name = r.name();
    let t = reg
        .target_type(&name)
        .ok_or_else(|| refuse(dm::EINVAL, format!("no target type '{name}'")))?;
    r.put_versions(&[(t.name, t.version)]);
    Ok(false)
}

/// DM_DEV_CREATE: a device without a table.
fn dev_create(&Call { ctx, reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let name = r.name();
    check_name(&name)?;
    // DM_PERSISTENT_DEV_FLAG: the minor of `dev` (the kernel looks no further)
    let minor = r.has(dm::PERSISTENT_DEV_FLAG).then(|| dm::decode_dev(r.dev()).1);
    let uuid = Some(r.uuid()).filter(|u| !u.is_empty());
    reg.create_in(&name, None, r.has(dm::READONLY_FLAG), uuid, minor, None)
        .map_err(from_registry)?;
    let d = reg.get(&name).map_err(from_registry)?;
    r.clear_flags(dm::INACTIVE_PRESENT_FLAG);
    r.set_status(&status(ctx, &d));
    Ok(true)
}

/// DM_DEV_REMOVE, deferred with DM_DEFERRED_REMOVE.
fn dev_remove(&Call { ctx, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    let deferred = r.has(dm::DEFERRED_REMOVE);
    super::remove(ctx, &d.name(), false, deferred).map_err(|x| refused(x, dm::EBUSY))?;
    if d.removed.load(Ordering::SeqCst) {
        r.clear_flags(dm::DEFERRED_REMOVE);
    }
    Ok(true)
}

/// DM_DEV_RENAME: a new name, or a uuid with DM_UUID_FLAG.
fn dev_rename(&Call { ctx, reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let new = r.data_string().map_err(|e| {
        refuse(
            e,
            "rename: the new name or uuid is not a string inside the buffer after the header",
        )
    })?;
    let uuid = r.has(dm::UUID_FLAG);
    let max = if uuid { dm::UUID_LEN - 1 } else { dm::NAME_LEN - 1 };
    if new.is_empty() || new.len() > max {
        return Err(refuse(
            dm::EINVAL,
            format!("invalid new device name or uuid '{new}' (1 to {max} bytes)"),
        ));
    }
    if !uuid {
        check_name(&new)?;
    }
    let d = find(ctx, r)?;
    let name = d.name();
    if uuid {
        reg.set_uuid(&name, &new).map_err(from_registry)?;
    } else {
        reg.rename(&name, &new).map_err(from_registry)?;
        ctx.ublk.renamed(&d);
    }
    r.set_identity(&d.name(), d.uuid().as_deref());
    r.set_status(&status(ctx, &d));
    Ok(true)
}

/// DM_DEV_SUSPEND: suspend with DM_SUSPEND_FLAG, else resume.
fn dev_suspend(&Call { ctx, reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    let name = d.name();
    if r.has(dm::SUSPEND_FLAG) {
        reg.suspend(&name, r.has(dm::NOFLUSH_FLAG))
            .map_err(from_registry)?;
    } else {
        super::resume(ctx, &name).map_err(|x| refused(x, dm::EINVAL))?;
        r.clear_flags(dm::INACTIVE_PRESENT_FLAG);
    }
    r.set_status(&status(ctx, &d));
    Ok(true)
}

/// DM_DEV_STATUS: the device's flags, counts and numbers.
fn dev_status(&Call { ctx, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    r.set_status(&status(ctx, &d));
    Ok(false)
}

/// DM_DEV_WAIT: until the device's event count moves past the caller's.
fn dev_wait(&Call { ctx, gone, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    let seen = r.event_nr();
    while d.events() as u32 == seen {
        if d.removed.load(Ordering::SeqCst) {
            return Err(refuse(
                dm::ENXIO,
                format!("{}: removed while waited on", d.name()),
            ));
        }
        if gone() {
            return Err(refuse(Errno(libc::EINTR), "the waiter left"));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    r.set_status(&status(ctx, &d));
    put_status(&d, r);
    Ok(false)
}

/// DM_TABLE_LOAD: the inactive table from the target specs.
fn table_load(&Call { ctx, reg, cwd, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    let specs = r.table().map_err(|e| {
        refuse(
            e,
            format!(
                "{}: table load: the target specs do not lie inside the buffer as the kernel requires \
                 (target_count, data_start, each `next` 8-byte aligned past the previous parameters, \
                 NUL-terminated type and parameters)",
                d.name()
            ),
        )
    })?;
    let mut text = String::new();
    for s in &specs {
        if s.target_type.contains(char::is_whitespace) || s.params.contains('\n') {
            return Err(refuse(
                dm::EINVAL,
                format!(
                    "{}: target '{}' at sector {}: a type or parameters with a line break",
                    d.name(),
                    s.target_type,
                    s.start
                ),
            ));
        }
        text.push_str(&format!("{} {} {} {}\n", s.start, s.len, s.target_type, s.params));
    }
    // the table's mode, as the kernel's: read-only with DM_READONLY_FLAG,
    // writable without; the device takes it at the resume
    reg.load_in(&d.name(), &text, cwd, Some(r.has(dm::READONLY_FLAG)))
        .map_err(from_registry)?;
    r.add_flags(dm::INACTIVE_PRESENT_FLAG);
    r.set_status(&status(ctx, &d));
    Ok(true)
}

/// DM_TABLE_CLEAR: the inactive table dropped.
fn table_clear(&Call { ctx, reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    reg.clear(&d.name()).map_err(from_registry)?;
    r.clear_flags(dm::INACTIVE_PRESENT_FLAG);
    r.set_status(&status(ctx, &d));
    Ok(true)
}

/// DM_TABLE_DEPS: the devices a table names.
fn table_deps(&Call { ctx, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    r.set_status(&status(ctx, &d));
    if let Some(t) = table_of(&d, r) {
        r.put_deps(&crate::mapper::report::dep_numbers(&t));
    }
    Ok(false)
}

/// DM_TABLE_STATUS: each target's status or table line.
fn table_status(&Call { ctx, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    r.set_status(&status(ctx, &d));
    put_status(&d, r);
    Ok(false)
}

/// DM_TARGET_MSG: a message to the target at a sector.
fn target_msg(&Call { ctx, reg, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    let (sector, text) = r.message().map_err(|e| {
        refuse(
            e,
            format!(
                "{}: message: no NUL-terminated text inside the buffer after the header",
                d.name()
            ),
        )
    })?;
    let words: Vec<String> = text.split_whitespace().map(str::to_string).collect();
    if words.is_empty() {
        return Err(refuse(dm::EINVAL, format!("{}: empty message", d.name())));
    }
    // What may not run twice must know its answer fits before it runs
    // (libdevmapper repeats a message whose answer did not fit): a new
    // region's id, and what @stats_print_clear prints before it clears.
    let verb = words[0].to_ascii_lowercase();
    let need = match verb.as_str() {
        "@stats_create" => Some(i32::MAX.to_string().len()),
        "@stats_print_clear" => {
            let mut probe = words.clone();
            probe[0] = "@stats_print".into();
            Some(
                reg.message(&d.name(), sector, &probe)
                    .map_err(from_registry)?
                    .len(),
            )
        }
        _ => None,
    };
    if need.is_some_and(|n| !r.message_result_fits(n)) {
        return Ok(false);
    }
    let out = reg.message(&d.name(), sector, &words).map_err(from_registry)?;
    r.set_status(&status(ctx, &d));
    if crate::mapper::stats::answers(&verb) || !out.is_empty() {
        r.put_message_result(&out);
    }
    // a message may change what the state file records
    Ok(true)
}

/// DM_DEV_SET_GEOMETRY: checked, and not kept.
fn dev_set_geometry(&Call { ctx, .. }: &Call, r: &mut Request) -> Result<bool, Refusal> {
    let d = find(ctx, r)?;
    let g = r
        .data_string()
        .map_err(|e| refuse(e, format!("{}: geometry: no string inside the buffer", d.name())))?;
    let v: Vec<u64> = g.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let fits = matches!(v.as_slice(), [c, h, s, _] if *c <= 65535 && *h <= 255 && *s <= 255);
    if v.len() != 4 || g.split_whitespace().count() != 4 || !fits {
        return Err(refuse(
            dm::EINVAL,
            format!("{}: invalid geometry '{g}'", d.name()),
        ));
    }
    // accepted and not kept: nothing reads a dmkit device's geometry
    r.set_data_size(0);
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapper::{config::Config, Registry};

    fn ctx() -> Ctx {
        Ctx::sandboxed(Arc::new(Registry::new(
            Config { ..Config::default() },
            crate::targets::types(),
        )))
    }

    fn call(c: &Ctx, cmd: Cmd, b: Vec<u8>) -> (i32, Vec<u8>) {
        let n = b.len();
        let (e, out, _) = ioctl(c, cmd.request(), b, n, "", &|| false);
        (e, out)
    }

    fn create_zero(c: &Ctx, name: &str, sectors: u64) {
        let (e, _) = call(c, Cmd::DevCreate, dm::build(16384, name, "", 0, &[]));
        assert_eq!(e, 0);
        let d = dm::table_data(&[dm::Spec {
            start: 0,
            len: sectors,
            target_type: "zero".into(),
            params: String::new(),
        }]);
        let mut b = dm::build(16384, name, "", 0, &d);
        dm::set_target_count(&mut b, 1);
        let (e, out) = call(c, Cmd::TableLoad, b);
        assert_eq!(e, 0);
        assert_ne!(dm::reply_header(&out).flags & dm::INACTIVE_PRESENT_FLAG, 0);
        let (e, out) = call(c, Cmd::DevSuspend, dm::build(16384, name, "", 0, &[]));
        assert_eq!(e, 0);
        let h = dm::reply_header(&out);
        assert_eq!(h.flags & (dm::INACTIVE_PRESENT_FLAG | dm::SUSPEND_FLAG), 0);
        assert_ne!(h.flags & dm::ACTIVE_PRESENT_FLAG, 0);
    }

    #[test]
    fn create_load_resume_status_remove() {
        let c = ctx();
        create_zero(&c, "z", 64);
        let (e, out) = call(&c, Cmd::DevStatus, dm::build(16384, "z", "", 0, &[]));
        assert_eq!(e, 0);
        let h = dm::reply_header(&out);
        assert_eq!(
            (h.target_count, h.dev, h.name.as_str()),
            (1, dm::encode_dev(crate::mapper::DM_MAJOR.get(), 0), "z")
        );
        assert_eq!(out.len(), dm::MIN_DATA_SIZE);
        let (e, out) = call(
            &c,
            Cmd::TableStatus,
            dm::build(16384, "z", "", dm::STATUS_TABLE_FLAG, &[]),
        );
        assert_eq!(e, 0);
        assert_eq!(
            dm::read_status(&out),
            vec![(0, 64, "zero".to_string(), String::new())]
        );
        let (e, out) = call(&c, Cmd::ListDevices, dm::build(16384, "", "", 0, &[]));
        assert_eq!(e, 0);
        let dev0 = dm::encode_dev(crate::mapper::DM_MAJOR.get(), 0);
        assert_eq!(dm::read_name_list(&out), vec![("z".to_string(), dev0)]);
        // by number
        let mut b = dm::build(16384, "", "", 0, &[]);
        b[40..48].copy_from_slice(&dev0.to_ne_bytes());
        let (e, out) = call(&c, Cmd::DevStatus, b);
        assert_eq!((e, dm::reply_header(&out).name.as_str()), (0, "z"));
        let (e, _) = call(&c, Cmd::DevRemove, dm::build(16384, "z", "", 0, &[]));
        assert_eq!(e, 0);
        let (e, _) = call(&c, Cmd::DevStatus, dm::build(16384, "z", "", 0, &[]));
        assert_eq!(e, libc::ENXIO);
    }

    #[test]
    fn kernel_errnos_for_what_the_registry_refuses() {
        let c = ctx();
        create_zero(&c, "a", 8);
        let (e, _) = call(&c, Cmd::DevCreate, dm::build(16384, "a", "", 0, &[]));
        assert_eq!(e, libc::EBUSY);
        let (e, _) = call(&c, Cmd::DevCreate, dm::build(16384, "a/b", "", 0, &[]));
        assert_eq!(e, libc::EINVAL);
        create_zero(&c, "b", 8);
        let (e, _) = call(&c, Cmd::DevRename, dm::build(16384, "a", "", 0, b"b\0"));
        assert_eq!(e, libc::EBUSY);
        let (e, out) = call(&c, Cmd::DevRename, dm::build(16384, "a", "", 0, b"c\0"));
        assert_eq!((e, dm::reply_header(&out).name.as_str()), (0, "c"));
        // a table the registry refuses (a gap)
        let d = dm::table_data(&[dm::Spec {
            start: 8,
            len: 8,
            target_type: "zero".into(),
            params: String::new(),
        }]);
        let mut b = dm::build(16384, "c", "", 0, &d);
        dm::set_target_count(&mut b, 1);
        let n = b.len();
        let (e, _, why) = ioctl(&c, Cmd::TableLoad.request(), b, n, "", &|| false);
        assert_eq!(e, libc::EINVAL);
        assert!(!why.is_empty());
        // an unknown target
        let d = dm::table_data(&[dm::Spec {
            start: 0,
            len: 8,
            target_type: "nosuch".into(),
            params: String::new(),
        }]);
        let mut b = dm::build(16384, "c", "", 0, &d);
        dm::set_target_count(&mut b, 1);
        assert_eq!(call(&c, Cmd::TableLoad, b).0, libc::EINVAL);
        // messages: a zero target takes none
        let mut m = 0u64.to_ne_bytes().to_vec();
        m.extend_from_slice(b"hello\0");
        assert_eq!(
            call(&c, Cmd::TargetMsg, dm::build(16384, "c", "", 0, &m)).0,
            libc::EINVAL
        );
    }

    #[test]
    fn wait_returns_at_once_for_an_old_event_and_leaves_with_its_caller() {
        let c = ctx();
        create_zero(&c, "w", 8);
        let mut b = dm::build(16384, "w", "", 0, &[]);
        dm::set_event_nr(&mut b, 7);
        let (e, out) = call(&c, Cmd::DevWait, b);
        assert_eq!((e, dm::reply_header(&out).event_nr), (0, 0));
        let b = dm::build(16384, "w", "", 0, &[]);
        let n = b.len();
        let (e, _, _) = ioctl(&c, Cmd::DevWait.request(), b, n, "", &|| true);
        assert_eq!(e, libc::EINTR);
    }
}
